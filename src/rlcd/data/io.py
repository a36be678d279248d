"""JSONL reading/writing and file hashing shared by every data command.

Reading never raises on a bad line: it yields the exception instead, so callers (prepare, the
importers) can exclude that line with a reason and keep going.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from rlcd.schema import Record, RecordError, parse_record


def read_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """Yield `(line_no, obj)` per non-blank line (1-based); `obj` is the exception if it does not parse."""
    with open(path, "rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                yield line_no, json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                yield line_no, exc


def to_json(row: Any) -> Any:
    """A JSON-ready value: pydantic models are dumped in JSON mode, everything else passes through."""
    return row.model_dump(mode="json") if isinstance(row, BaseModel) else row


def write_jsonl(path: str | Path, rows: Iterable[Any]) -> int:
    """Write rows (dicts or pydantic models) one per line, atomically; return the number written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(to_json(row), ensure_ascii=False) + "\n")
            n += 1
    os.replace(tmp, path)
    return n


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes (streamed, so large inputs are fine)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_records(path: str | Path) -> list[Record]:
    """Every record of a clean JSONL file; the first bad line raises, naming the file and line."""
    out = []
    for line_no, obj in read_jsonl(path):
        where = f"{Path(path).name}:{line_no}"
        if isinstance(obj, Exception):
            raise RecordError(where, "line", f"not valid JSON ({obj})")
        out.append(parse_record(obj, row=where))
    return out


def load_split(processed_dir: str | Path, split: str) -> list[Record]:
    """The records of `<processed_dir>/<split>.jsonl` (train, dev, calibration or test)."""
    return load_records(Path(processed_dir) / f"{split}.jsonl")


def excluded_path(out: str | Path) -> Path:
    """Where an import writes the exclusions of records file `out`: `<stem>.excluded.jsonl` beside it."""
    out = Path(out)
    return out.with_name(f"{out.stem}.excluded.jsonl")


def suggest_processed_dir(records_file: str | Path) -> Path:
    """A processed-directory name beside a records file that does not exist yet (`x.jsonl` -> `x-processed`),
    for messages that tell a user to run `rlcd data prepare` (its --out must not be an existing file)."""
    path = Path(records_file)
    base = path.with_name(f"{path.stem}-processed")
    candidate, n = base, 2
    while candidate.exists():
        candidate, n = base.with_name(f"{base.name}-{n}"), n + 1
    return candidate
