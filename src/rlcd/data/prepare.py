"""Record files -> an isolated, hashed processed directory.

Output: `train.jsonl dev.jsonl calibration.jsonl test.jsonl excluded.jsonl manifest.json images/`.

Rules, in order:
1. Every non-blank input line is read. A line that is not JSON is excluded `unparsable`, a record
   that breaks a schema rule (or names a missing image) `invalid`, a second record with an id
   already used `duplicate_id`. The detail is the RecordError message: row, field, rule.
2. Isolation groups (union-find): rows of one case (same source and case_id), rows whose images
   have identical bytes, and rows with identical non-empty state text are one group, because a
   model could memorise any of these across splits.
3. Splits. A group whose rows carry official splits takes the highest of them
   (test > dev > calibration > train); rows with a lower official split are excluded
   `cross_split_group` (never moved). A group without official splits is placed by
   u = sha256(seed, smallest id in the group): u < 0.10 test, < 0.15 dev, < 0.20 calibration,
   else train (other shares: `fractions`, `rlcd data prepare --splits`, recorded in the
   manifest). A group whose official split is train gets the same dev/calibration bands (never
   test), unless one of its sources already ships its own dev/calibration rows; so calibration
   is always carved from training groups.
   With a render check (`rlcd data prepare --model M`: `rlcd.row_check` renders each valid row with that
   backbone's prompt encoder), a row over the token limit is excluded `too_long` (its token count in the
   detail) and a row breaking another rule of that rendering (special-token text of that tokenizer, an
   image for a text-only backbone) `unrenderable`, before isolation. Without one, prepare needs no backbone.
4. Exact duplicates (same state, image bytes and question) are excluded `duplicate`, keeping the
   row in the highest split, then the first read.
5. The manifest holds counts per (group, split), exclusions per reason, the sha256 of every input
   and output file and the seed; `read == used + excluded` is checked and a break raises.

Images are copied content-addressed to `images/<sha256><ext>` and record paths rewritten to it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rlcd.data.io import read_jsonl, sha256_file, write_jsonl
from rlcd.schema import SPLITS, Record, RecordError, parse_record, text_of

PRIORITY = {"train": 0, "calibration": 1, "dev": 2, "test": 3}
BANDS = (("test", 0.10), ("dev", 0.15), ("calibration", 0.20))  # cumulative upper bounds of u
FRACTIONS = (0.8, 0.05, 0.05, 0.1)  # train, dev, calibration, test: the shares BANDS give (`--splits`)


def bands_of(fractions: tuple[float, float, float, float] | None) -> tuple[tuple[str, float], ...]:
    """Cumulative bands (test, dev, calibration) from train/dev/calibration/test fractions (None: BANDS)."""
    if fractions is None:
        return BANDS
    _, dev, cal, test = fractions
    return (("test", test), ("dev", test + dev), ("calibration", test + dev + cal))


def parse_fractions(text: str) -> tuple[float, float, float, float]:
    """`0.8,0.05,0.05,0.1` -> (train, dev, calibration, test); 4 numbers >= 0 summing to 1, else ValueError."""
    try:
        parts = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{text!r}: expected four numbers train,dev,calibration,test "
                         "(e.g. 0.8,0.05,0.05,0.1)") from None
    if len(parts) != 4:
        raise ValueError(f"{text!r}: expected four fractions train,dev,calibration,test, got {len(parts)}")
    if any(not (x >= 0) for x in parts) or abs(sum(parts) - 1.0) > 1e-9:
        raise ValueError(f"{text!r}: the four fractions must be >= 0 and sum to 1 (they sum to {sum(parts):g})")
    return parts  # type: ignore[return-value]
REASONS = ("unparsable", "invalid", "duplicate_id", "too_long", "unrenderable", "cross_split_group", "duplicate")
# a render check: (record, its image file or None) -> (reason, detail) when the row breaks a rendering rule
RenderCheck = Callable[[Record, "Path | None"], "tuple[str, str] | None"]


@dataclass
class Row:
    """A valid input record plus what isolation needs to know about it."""

    record: Record
    source_file: str
    image_src: Path | None = None
    image_sha: str | None = None


class InvariantError(RuntimeError):
    """`read == used + excluded` broke: some row was neither written nor excluded."""


def _excl(row: Any, source_file: str, reason: str, detail: str) -> dict:
    return {"row": row, "source_file": source_file, "reason": reason, "detail": detail}


# --- 1. reading ------------------------------------------------------------------------------


def read_inputs(inputs: list[Path]) -> tuple[list[Row], list[dict], int]:
    """Valid rows, exclusions and the number of rows read, over all input files in order."""
    rows: list[Row] = []
    excluded: list[dict] = []
    seen: dict[str, str] = {}
    image_shas: dict[Path, str] = {}
    read = 0
    for path in inputs:
        path = Path(path)
        for line_no, obj in read_jsonl(path):
            read += 1
            where = f"{path.name}:{line_no}"
            if isinstance(obj, Exception):
                excluded.append(_excl(line_no, str(path), "unparsable", f"line {where}: not valid JSON ({obj})"))
                continue
            try:
                row = _row(obj, path, where, image_shas)
            except RecordError as exc:
                excluded.append(_excl(line_no if exc.row in (None, where) else exc.row, str(path), "invalid", str(exc)))
                continue
            rid = row.record.id
            if rid in seen:
                excluded.append(_excl(rid, str(path), "duplicate_id",
                                      str(RecordError(rid, "id", f"already used at {seen[rid]}"))))
                continue
            seen[rid] = where
            rows.append(row)
    return rows, excluded, read


def _row(obj: Any, path: Path, where: str, image_shas: dict[Path, str]) -> Row:
    record = parse_record(obj, row=where)
    row = Row(record, str(path))
    if record.image is not None:
        src = (path.parent / record.image).resolve()
        if not src.is_file():
            raise RecordError(record.id, "image", f"file not found: {src}")
        if src not in image_shas:
            image_shas[src] = sha256_file(src)
        row.image_src, row.image_sha = src, image_shas[src]
    return row


# --- 2. isolation ----------------------------------------------------------------------------


def isolation_groups(rows: list[Row]) -> list[list[int]]:
    """Indices of rows that must share a split: same case, same image bytes, or same state text."""
    parent = list(range(len(rows)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[tuple, int] = {}
    for i, row in enumerate(rows):
        for key in _isolation_keys(row):
            j = first.setdefault(key, i)
            parent[find(i)] = find(j)
    groups: dict[int, list[int]] = defaultdict(list)
    for i in range(len(rows)):
        groups[find(i)].append(i)
    return list(groups.values())


def _isolation_keys(row: Row) -> list[tuple]:
    r = row.record
    keys: list[tuple] = []
    if r.case_id is not None:
        keys.append(("case", r.source, r.case_id))
    if row.image_sha is not None:
        keys.append(("image", row.image_sha))
    state = text_of(r.state)
    if state.strip():
        keys.append(("state", state))
    return keys


# --- 3. splits -------------------------------------------------------------------------------


def hash_unit(seed: int, key: str) -> float:
    """A uniform number in [0, 1) from (seed, key)."""
    digest = hashlib.sha256(f"{seed}:{key}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def banded_split(u: float, allowed: set[str], bands: tuple[tuple[str, float], ...] = BANDS) -> str:
    """The band of u (test, dev, calibration, else train); a band not in `allowed` falls to train."""
    for split, upper in bands:
        if u < upper:
            return split if split in allowed else "train"
    return "train"


def assign_splits(rows: list[Row], groups: list[list[int]], seed: int,
                  bands: tuple[tuple[str, float], ...] = BANDS) -> tuple[dict[int, str], list[dict]]:
    """Split per kept row index, and the `cross_split_group` exclusions."""
    official = defaultdict(set)  # source -> official splits it ships
    for row in rows:
        if row.record.split is not None:
            official[row.record.source].add(row.record.split)
    assigned: dict[int, str] = {}
    excluded: list[dict] = []
    for members in groups:
        recs = [rows[i].record for i in members]
        given = {r.split for r in recs if r.split is not None}
        u = hash_unit(seed, min(r.id for r in recs))
        winner = max(given, key=PRIORITY.__getitem__) if given else None
        if winner is None:
            split = banded_split(u, {"test", "dev", "calibration"}, bands)
        elif winner == "train":
            shipped = set().union(*(official[r.source] for r in recs))
            split = banded_split(u, {"dev", "calibration"} - shipped, bands)
        else:
            split = winner
        for i, r in zip(members, recs):
            if r.split is None or r.split == winner:
                assigned[i] = split
            else:
                keeper = next(x.id for x in recs if x.split == winner)
                excluded.append(_excl(r.id, rows[i].source_file, "cross_split_group", str(RecordError(
                    r.id, "split", f"its isolation group (same case, image or state as {keeper!r}) is in "
                    f"{split}; its own split {r.split} loses (test > dev > calibration > train)"))))
    return assigned, excluded


# --- 4. duplicates ---------------------------------------------------------------------------


def drop_duplicates(rows: list[Row], assigned: dict[int, str]) -> tuple[dict[int, str], list[dict]]:
    """Keep one row per (state, image bytes, question): the one in the highest split, then first read."""
    kept: dict[int, str] = {}
    excluded: list[dict] = []
    first: dict[tuple, str] = {}
    for i in sorted(assigned, key=lambda i: (-PRIORITY[assigned[i]], i)):
        r = rows[i].record
        key = (text_of(r.state), rows[i].image_sha, json.dumps(r.question.model_dump(mode="json"), sort_keys=True))
        if key in first:
            excluded.append(_excl(r.id, rows[i].source_file, "duplicate", str(RecordError(
                r.id, "record", f"same state, image and question as {first[key]!r}"))))
        else:
            first[key] = r.id
            kept[i] = assigned[i]
    return kept, excluded


# --- 5. output -------------------------------------------------------------------------------


def _output_records(rows: list[Row], kept: dict[int, str]) -> dict[str, list[Record]]:
    """Records per split in input order, with split set and image paths rewritten."""
    out: dict[str, list[Record]] = {s: [] for s in SPLITS}
    for i in sorted(kept):
        row = rows[i]
        update: dict[str, Any] = {"split": kept[i]}
        if row.image_sha is not None:
            update["image"] = f"images/{row.image_sha}{row.image_src.suffix.lower()}"
        out[kept[i]].append(row.record.model_copy(update=update))
    return out


def _counts(by_split: dict[str, list[Record]]) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for split, records in by_split.items():
        for r in records:
            counts.setdefault(r.group, {s: 0 for s in SPLITS})[split] += 1
    return dict(sorted(counts.items()))


def _write(out_dir: Path, rows: list[Row], kept: dict[int, str], by_split: dict[str, list[Record]],
           excluded: list[dict]) -> dict[str, str]:
    """Write images and files; return the sha256 of every output file by relative path."""
    outputs: dict[str, str] = {}
    for i in sorted(kept):
        row = rows[i]
        if row.image_sha is None:
            continue
        rel = f"images/{row.image_sha}{row.image_src.suffix.lower()}"
        if rel not in outputs:
            dest = out_dir / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if not dest.exists():
                shutil.copyfile(row.image_src, dest)
            outputs[rel] = row.image_sha
    for split, records in by_split.items():
        write_jsonl(out_dir / f"{split}.jsonl", records)
        outputs[f"{split}.jsonl"] = sha256_file(out_dir / f"{split}.jsonl")
    write_jsonl(out_dir / "excluded.jsonl", excluded)
    outputs["excluded.jsonl"] = sha256_file(out_dir / "excluded.jsonl")
    return dict(sorted(outputs.items()))


@dataclass
class Plan:
    """Everything `prepare` decided, before anything is written."""

    inputs: list[Path]
    seed: int
    rows: list[Row]
    kept: dict[int, str]
    by_split: dict[str, list[Record]]
    excluded: list[dict]
    read: int
    fractions: tuple[float, float, float, float] | None = None
    checked_with: dict | None = None  # {"model", "max_tokens"} of the render check, None without one

    @property
    def used(self) -> int:
        return sum(len(v) for v in self.by_split.values())


def render_exclusions(rows: list[Row], check: RenderCheck) -> tuple[list[Row], list[dict]]:
    """The rows `check` passes, and the exclusions (`too_long`, `unrenderable`) of the others."""
    kept, excluded = [], []
    for row in rows:
        found = check(row.record, row.image_src)
        if found is None:
            kept.append(row)
        else:
            excluded.append(_excl(row.record.id, row.source_file, *found))
    return kept, excluded


def plan(inputs: list[Path], seed: int = 0, fractions: tuple[float, float, float, float] | None = None,
         check: RenderCheck | None = None, checked_with: dict | None = None) -> Plan:
    """Read, (render-check,) isolate, split and deduplicate; check `read == used + excluded`.
    `check`: see `RenderCheck`; `checked_with` says what it renders with (the manifest's `render_check`)."""
    inputs = [Path(p) for p in inputs]
    rows, excluded, read = read_inputs(inputs)
    if check is not None:
        rows, unrendered = render_exclusions(rows, check)
        excluded += unrendered
    assigned, cross = assign_splits(rows, isolation_groups(rows), seed, bands_of(fractions))
    kept, dups = drop_duplicates(rows, assigned)
    result = Plan(inputs, seed, rows, kept, _output_records(rows, kept), excluded + cross + dups, read, fractions,
                  checked_with)
    if result.read != result.used + len(result.excluded):
        raise InvariantError(f"read {result.read} rows but used {result.used} + excluded {len(result.excluded)}")
    return result


def manifest_of(p: Plan) -> dict:
    return {
        "seed": p.seed,
        "split_fractions": dict(zip(("train", "dev", "calibration", "test"), p.fractions or FRACTIONS)),
        "inputs": [{"path": str(f), "sha256": sha256_file(f)} for f in p.inputs],
        "read": p.read, "used": p.used, "excluded": len(p.excluded),
        "splits": {s: len(p.by_split[s]) for s in SPLITS},
        "counts": _counts(p.by_split),
        "exclusions": dict(sorted(Counter(e["reason"] for e in p.excluded).items())),
        "render_check": p.checked_with,
        "outputs": {},
    }


def prepare(inputs: list[Path], out_dir: Path, seed: int = 0, dry_run: bool = False,
            fractions: tuple[float, float, float, float] | None = None, check: RenderCheck | None = None,
            checked_with: dict | None = None) -> dict:
    """Validate, isolate, split and (unless `dry_run`) write a processed directory; return the manifest.

    `fractions`: (train, dev, calibration, test) shares of the hash-placed groups (default FRACTIONS);
    `check` / `checked_with`: a render check (see `plan`).
    """
    p = plan(inputs, seed, fractions, check, checked_with)
    manifest = manifest_of(p)
    if not dry_run:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        manifest["outputs"] = _write(out_dir, p.rows, p.kept, p.by_split, p.excluded)
        (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return manifest
