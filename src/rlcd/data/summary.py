"""Rich tables for the data commands: records per group, exclusions per reason, the split manifest."""

from __future__ import annotations

from collections import Counter, defaultdict

from rich.console import Console
from rich.table import Table

from rlcd.consoles import ResultConsole, notice_console
from rlcd.schema import SPLITS, Record

console = ResultConsole()  # stdout: full-width tables in a pipe
notices = notice_console()  # stderr: warnings




def records_table(records: list[Record], title: str) -> Table:
    """Rows and mean max-posterior (when known) per sampling group."""
    table = Table(title=title)
    for col in ("group", "records", "types", "mean max posterior"):
        table.add_column(col, justify="left" if col in ("group", "types") else "right")
    by_group: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        by_group[r.sampling_group].append(r)
    for group, recs in sorted(by_group.items()):
        types = Counter(r.question.type for r in recs)
        post = [max(r.posterior) for r in recs if r.posterior is not None]
        table.add_row(group, str(len(recs)), ", ".join(f"{t} {n}" for t, n in sorted(types.items())),
                      f"{sum(post) / len(post):.3f}" if post else "-")
    return table


def exclusions_table(exclusions: list[dict] | dict[str, int], title: str = "excluded") -> Table:
    counts = exclusions if isinstance(exclusions, dict) else Counter(e["reason"] for e in exclusions)
    table = Table(title=title)
    table.add_column("reason")
    table.add_column("rows", justify="right")
    for reason, n in sorted(counts.items()):
        table.add_row(reason, str(n))
    return table


def print_manifest(manifest: dict, out: Console | None = None) -> None:
    """The manifest summary: rows per (group, split), exclusions per reason, and the invariant."""
    out = out or console
    table = Table(title="rows per group and split")
    table.add_column("group")
    for split in (*SPLITS, "total"):
        table.add_column(split, justify="right")
    for group, counts in manifest["counts"].items():
        table.add_row(group, *(str(counts[s]) for s in SPLITS), str(sum(counts.values())))
    table.add_row("total", *(str(manifest["splits"][s]) for s in SPLITS), str(manifest["used"]), style="bold")
    out.print(table)
    if manifest["exclusions"]:
        out.print(exclusions_table(manifest["exclusions"]))
    out.print(f"read {manifest['read']} = used {manifest['used']} + excluded {manifest['excluded']}"
              f"  (seed {manifest['seed']})")
    check = manifest.get("render_check")
    out.print(f"every kept row rendered with {check['model']} within {check['max_tokens']} tokens" if check else
              "token limits not checked (--model M renders every row with that backbone first)", highlight=False)


def print_details(exclusions: list[dict], limit: int = 20) -> None:
    for e in exclusions[:limit]:
        console.print(f"  [{e['reason']}] {e['detail']}", markup=False, highlight=False)
    if len(exclusions) > limit:
        console.print(f"  ... and {len(exclusions) - limit} more")
