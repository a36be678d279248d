"""`rlcd data ...`: import, synth, prepare, validate; plus `demo_data` for `make demo`."""

from __future__ import annotations

from collections import Counter, defaultdict
from enum import Enum
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from rlcd.data import importers, synth
from rlcd.data.io import write_jsonl
from rlcd.data.prepare import manifest_of, plan
from rlcd.data.prepare import prepare as prepare_dir
from rlcd.schema import SPLITS, Record

app = typer.Typer(help="Data: import outside sets, generate known-posterior cases, prepare isolated splits.",
                  no_args_is_help=True)
console = Console()


class Kind(str, Enum):
    typed_decisions = "typed-decisions"
    vqav2 = "vqav2"
    text = "text"
    easy_vqa = "easy-vqa"
    jsonl = "jsonl"


# --- printing -------------------------------------------------------------------------------


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


def _print_details(exclusions: list[dict], limit: int = 20) -> None:
    for e in exclusions[:limit]:
        console.print(f"  [{e['reason']}] {e['detail']}", markup=False, highlight=False)
    if len(exclusions) > limit:
        console.print(f"  ... and {len(exclusions) - limit} more")


# --- commands -------------------------------------------------------------------------------


def excluded_path(out: Path) -> Path:
    """Where `import` writes the exclusions for records file `out`: `<stem>.excluded.jsonl`."""
    return out.with_name(f"{out.stem}.excluded.jsonl")


@app.command("import")
def import_cmd(
    kind: Kind = typer.Option(..., "--kind", help="Input format."),
    out: Path = typer.Option(..., "--out", help="Records file to write (JSONL)."),
    input_: str = typer.Option(None, "--input", help="Input file (.jsonl/.csv/.parquet) or hub id; not for easy-vqa."),
    split: str = typer.Option(None, "--split", help="Official split of every row (train/dev/calibration/test)."),
    images: Path = typer.Option(None, "--images", help="vqav2: directory the image column is relative to."),
    text_column: str = typer.Option("text", "--text-column", help="text: column holding the text."),
    label_column: str = typer.Option("label", "--label-column", help="text: column holding the label."),
    labels: str = typer.Option(None, "--labels", help="text: comma-separated label set (default: inferred, sorted)."),
    task: str = typer.Option(None, "--task", help="text: task name (default: the input file's stem)."),
    limit: int = typer.Option(None, "--limit", help="easy-vqa: keep this many questions in total."),
) -> None:
    """Convert an outside data set into records; exclusions go to `<out stem>.excluded.jsonl`."""
    if kind is not Kind.easy_vqa and not input_:
        raise typer.BadParameter("--input is required for this kind", param_hint="--input")
    out_dir = out.parent
    if kind is Kind.typed_decisions:
        records, excluded = importers.import_typed_decisions(input_, split=split)
    elif kind is Kind.vqav2:
        if images is None:
            raise typer.BadParameter("--images is required for vqav2", param_hint="--images")
        records, excluded = importers.import_vqav2(input_, images, out_dir, split=split)
    elif kind is Kind.text:
        label_set = [x.strip() for x in labels.split(",")] if labels else None
        records, excluded = importers.import_text(input_, text_column=text_column, label_column=label_column,
                                                  labels=label_set, task=task, split=split)
    elif kind is Kind.easy_vqa:
        records, excluded = importers.import_easy_vqa(out_dir, limit=limit)
    else:
        records, excluded = importers.import_jsonl(Path(input_), out_dir)
    write_jsonl(out, records)
    write_jsonl(excluded_path(out), excluded)
    console.print(records_table(records, f"imported {len(records)} records -> {out}"))
    if excluded:
        console.print(exclusions_table(excluded, f"excluded -> {excluded_path(out)}"))


@app.command("synth")
def synth_cmd(
    out: Path = typer.Option(..., "--out", help="Records file to write (JSONL)."),
    cases: int = typer.Option(400, "--cases", min=1, help="Number of cases (six questions each)."),
    seed: int = typer.Option(0, "--seed"),
    votes: int = typer.Option(None, "--votes", min=1, help="Target = mean of this many votes (default: the posterior)."),
) -> None:
    """Generate known-posterior typed-decision cases."""
    records = synth.generate(cases, seed, votes=votes)
    write_jsonl(out, records)
    console.print(records_table(records, f"{cases} cases, {len(records)} records -> {out}"))


@app.command("prepare")
def prepare_cmd(
    inputs: list[Path] = typer.Argument(..., exists=True, dir_okay=False, help="Record files (JSONL)."),
    out: Path = typer.Option(..., "--out", help="Processed directory to write."),
    seed: int = typer.Option(0, "--seed", help="Seed of the hash that places groups without official splits."),
) -> None:
    """Validate, isolate and split records into a processed directory with a manifest."""
    print_manifest(prepare_dir(inputs, out, seed=seed))
    console.print(f"wrote {out}")


@app.command("validate")
def validate_cmd(
    inputs: list[Path] = typer.Argument(..., exists=True, dir_okay=False, help="Record files (JSONL)."),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Dry run of `prepare`: the same counts and exclusion reasons, nothing written."""
    result = plan(inputs, seed)
    print_manifest(manifest_of(result))
    _print_details(result.excluded)


def demo_data(out_dir: Path, seed: int = 0, n_cases: int = 400, easy_vqa_limit: int = 400) -> dict:
    """Synth cases + a small easy-vqa subset, prepared into `<out_dir>/processed`; returns the manifest."""
    out_dir = Path(out_dir)
    raw = out_dir / "raw"
    write_jsonl(raw / "synth.jsonl", synth.generate(n_cases, seed))
    records, excluded = importers.import_easy_vqa(raw, limit=easy_vqa_limit)
    write_jsonl(raw / "easy-vqa.jsonl", records)
    write_jsonl(excluded_path(raw / "easy-vqa.jsonl"), excluded)
    return prepare_dir([raw / "synth.jsonl", raw / "easy-vqa.jsonl"], out_dir / "processed", seed=seed)
