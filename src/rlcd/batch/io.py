"""The batch job's files: the input read in chunks, the output committed in parts, the rejects beside it.

Input (`scan`): JSONL, one `/v1/systemone` request per non-blank line, each with an `"id"` (a non-empty
string, unique in the file); or Parquet, one request per row: either an `id` column and a `request` column
(the request as a JSON string), or the request's own fields as columns beside `id`; or a processed
split (`scan_split`: one request per record, id = the record's id, its image path under the data dir).
Every row is numbered (`line`: the 1-based line of a JSONL file, the 1-based row of a Parquet file or split)
and yields one `Row`; a row that cannot become a request (not JSON, not an object, no id, a duplicate id)
carries its `reason` and becomes a reject without reaching the model.

Output (`PartWriter`): while the job runs, `FILE.parts/` holds `job.json` (what the job was started with:
the input's size and mtime, the model, the options that change answers) and the committed parts
`part-<first line>.jsonl`, each the outcomes of a window of consecutive input rows in line order: answers
`{"line", "id", "response"}` and rejects `{"line", "id", "reject": {"field", "reason"}}`. A part is
written under a temporary name, fsync'd and renamed (then the directory fsync'd): a killed job leaves
whole parts only. `--resume` reads the parts back, skips every line they hold (none twice) and starts at
the first line they do not (none lost). When the input is done, `finish` writes FILE (answers, in line
order: `{"id", "line", **response}` per JSONL line, or Parquet columns `id`, `line`, `response` (JSON)) and
`FILE.rejects.jsonl` (`{"line", "id", "field", "reason"}`), each through a temporary file and a rename,
then removes the parts.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from rlcd.errors import OptionError, UserError
from rlcd.files import fsync_dir, write_atomic

PARTS_SUFFIX, REJECTS_SUFFIX = ".parts", ".rejects.jsonl"
JOB = "job.json"
FORMATS = ("jsonl", "parquet")


@dataclass
class Row:
    """One input row: its 1-based `line`, its `id` (None when it has none), the request, or why it has none."""

    line: int
    id: str | None
    request: Any = None
    reason: str | None = None
    field: str = "request"


@dataclass
class Outcome:
    """What became of one row: `response` (the System One response) or `reject` ({"field", "reason"})."""

    line: int
    id: str | None
    response: dict | None = None
    reject: dict | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"line": self.line, "id": self.id}
        if self.reject is not None:
            out["reject"] = self.reject
        else:
            out["response"] = self.response
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Outcome":
        return cls(int(d["line"]), d.get("id"), d.get("response"), d.get("reject"))


def file_format(path: Path, what: str) -> str:
    """jsonl (.jsonl, .json, .ndjson) or parquet (.parquet, .pq), from the name; anything else is a UserError."""
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        require_pyarrow(what)
        return "parquet"
    raise OptionError(f"{what} {path}: give a .jsonl or a .parquet file (the format is read from the name)")


def require_pyarrow(what: str) -> None:
    import importlib.util

    if importlib.util.find_spec("pyarrow") is None:
        raise UserError(f"{what}: Parquet needs pyarrow: pip install 'rlcd[data]'")


# ---------------------------------------------------------------------------------------------- input
def count_rows(path: Path) -> int:
    """Rows of an input file (the progress bar's total): non-blank lines of a JSONL file, rows of a Parquet file."""
    if file_format(path, "--input") == "parquet":
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(path).metadata.num_rows)
    n = 0
    with open(path, "rb") as fh:
        for raw in fh:
            n += bool(raw.strip())
    return n


def _row(line: int, obj: Any, seen: set[str]) -> Row:
    """A parsed input object as a Row: the request is the object less its `id` (a `request` field, when the
    object has one beside `id` and no `questions`, is the request itself)."""
    if not isinstance(obj, Mapping):
        return Row(line, None, reason=f"a row is a JSON object (a /v1/systemone request with an \"id\"), "
                                      f"got {type(obj).__name__}")
    rid = obj.get("id")
    if not isinstance(rid, str) or not rid:
        got = "none" if rid is None else repr(rid)[:60]
        return Row(line, None, reason=f"each row needs an \"id\", a non-empty string; got {got}", field="id")
    if rid in seen:
        return Row(line, rid, reason=f"id {rid!r} was already given by an earlier row; ids are unique", field="id")
    seen.add(rid)
    if "request" in obj and "questions" not in obj:
        req = obj["request"]
        if isinstance(req, (str, bytes)):
            try:
                req = json.loads(req)
            except json.JSONDecodeError as e:
                return Row(line, rid, reason=f"the request is not valid JSON: {e.msg} at column {e.colno}")
    else:
        req = {k: v for k, v in obj.items() if k != "id"}
    return Row(line, rid, req)


def scan(path: Path, *, skip_through: int = 0, seen: set[str] | None = None) -> Iterator[Row]:
    """The rows of an input file, in order, after line `skip_through` (resume). `seen`: ids already used
    (a resumed job's), extended as rows are read so a repeated id is a reject."""
    seen = set() if seen is None else seen
    if file_format(path, "--input") == "parquet":
        yield from _scan_parquet(path, skip_through, seen)
        return
    with open(path, "rb") as fh:
        for line, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            if line <= skip_through:
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                msg = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
                yield Row(line, None, reason=f"not valid JSON: {msg}")
                continue
            yield _row(line, obj, seen)


OBJECT_COLUMNS = ("questions", "assets", "image")  # request fields that are JSON objects: a text column is JSON


def from_columns(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A Parquet row with the request's fields as columns, as the request a JSONL line would give. A column a row
    leaves empty (null) is absent. An object field (OBJECT_COLUMNS) stored as text is JSON text, parsed (left as
    it is when it does not parse: the request check then says why). In a struct column Parquet gives every row
    every key any row has, the missing ones null: a question that is null is absent, and so is a question's
    null `instructions`/`criteria`. (Inside a `criteria` mapping a null stays: there it means "no description".)"""
    out: dict[str, Any] = {}
    for k, v in obj.items():
        if v is None and k != "id":
            continue
        if k in OBJECT_COLUMNS and isinstance(v, str) and "request" not in obj:
            try:
                v = json.loads(v)
            except json.JSONDecodeError:
                pass
        if k == "questions" and isinstance(v, Mapping):
            v = {qid: ({f: x for f, x in q.items() if x is not None} if isinstance(q, Mapping) else q)
                 for qid, q in v.items() if q is not None}
        out[k] = v
    return out


def _scan_parquet(path: Path, skip_through: int, seen: set[str]) -> Iterator[Row]:
    import pyarrow.parquet as pq

    line = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for obj in batch.to_pylist():
            line += 1
            if line > skip_through:
                yield _row(line, from_columns(obj), seen)


def split_request(record: Any) -> dict[str, Any]:
    """The /v1/systemone request asking a processed record's question about its state (its image a path under
    the data directory, which the job then uses as its image root); a choice's criteria in System One's mapping."""
    q = record.question
    question = q.model_dump(exclude_none=True)
    if q.type == "choice" and isinstance(q.criteria, list):
        question["criteria"] = {label: None for label in q.criteria}
    req: dict[str, Any] = {"state": record.state, "questions": {"q1": question}}
    if record.image:
        req["image"] = {"path": record.image}
    return req


def scan_split(data: Path, split: str, *, skip_through: int = 0, seen: set[str] | None = None) -> Iterator[Row]:
    """The requests of a processed split (`DIR/SPLIT.jsonl`), one per record, numbered by line."""
    from rlcd.data.io import read_jsonl
    from rlcd.schema import Record

    seen = set() if seen is None else seen
    for line, obj in read_jsonl(Path(data) / f"{split}.jsonl"):
        if line <= skip_through:
            continue
        if isinstance(obj, Exception):
            yield Row(line, None, reason=f"not valid JSON: {obj}")
            continue
        try:
            rec = Record.model_validate(obj)
        except Exception as e:  # noqa: BLE001 - a bad record is a reject naming the rule
            yield Row(line, obj.get("id") if isinstance(obj, dict) else None, reason=f"not a record: {e}".splitlines()[0])
            continue
        yield _row(line, {"id": rec.id, "request": split_request(rec)}, seen)


# ---------------------------------------------------------------------------------------------- output
def parts_dir(output: Path) -> Path:
    return output.with_name(output.name + PARTS_SUFFIX)


def rejects_path(output: Path) -> Path:
    return output.with_name(output.name + REJECTS_SUFFIX)


def input_identity(path: Path) -> dict[str, Any]:
    st = Path(path).stat()
    return {"path": str(Path(path).resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def said(value: Any) -> str:
    """A job.json value in words for a refusal: the input file as its path, size and modification time; another
    mapping as ``key value, ...``; anything else as itself (strings unquoted)."""
    import datetime as _dt

    if isinstance(value, Mapping):
        if {"path", "bytes", "mtime_ns"} <= set(value):
            when = _dt.datetime.fromtimestamp(value["mtime_ns"] / 1e9, _dt.timezone.utc).isoformat(timespec="seconds")
            return f"{value['path']}, {value['bytes']} bytes, modified {when}"
        return ", ".join(f"{k} {said(v)}" for k, v in value.items()) or "nothing"
    if value is None:
        return "not recorded"
    return str(value)


class PartWriter:
    """The output of one job (see the module docstring). `open(output, job, resume)` checks the files first:
    an existing FILE or an unfinished job without `resume`, or a resume of another job, is a UserError
    naming the fix, raised before anything is written."""

    def __init__(self, output: Path, job: Mapping[str, Any]):
        self.output, self.job = Path(output), dict(job)
        self.parts = parts_dir(self.output)
        self.format = file_format(self.output, "--output")
        self.next_line = 1  # the first line not yet committed
        self.answered = self.rejected = 0
        self.seen: set[str] = set()

    @classmethod
    def check(cls, output: Path, job: Mapping[str, Any], *, resume: bool) -> "PartWriter":
        """The writer, its committed parts read back when `resume`; nothing written yet."""
        w = cls(output, job)
        if not w.output.parent.is_dir():
            raise OptionError(f"--output {output}: no such directory {w.output.parent}")
        if w.parts.exists():
            if not resume:
                raise UserError(f"{w.parts} holds an unfinished job: give --resume to continue it, or remove "
                                f"{w.parts} to start again")
            w._read_back()
        elif resume:
            raise UserError(f"--resume: no unfinished job for --output {output} (no {w.parts})")
        elif w.output.exists():
            raise UserError(f"--output {output} exists: remove it (and {rejects_path(w.output).name}) or choose "
                            "another file")
        return w

    def _read_back(self) -> None:
        meta = self.parts / JOB
        if not meta.is_file():
            raise UserError(f"{self.parts}: no {JOB}; not a batch job's parts (remove it to start again)")
        old = json.loads(meta.read_text(encoding="utf-8"))
        diff = sorted(k for k in set(old) | set(self.job) if old.get(k) != self.job.get(k))
        if diff:
            k = diff[0]
            raise UserError(f"--resume refused: {k} differs from the job's start ({said(old.get(k))} then, "
                            f"{said(self.job.get(k))} now); run it as it began, or remove {self.parts} to start again")
        for part in self.committed():
            for o in self.read_part(part):
                self._count(o)

    def _count(self, o: Outcome) -> None:
        self.next_line = max(self.next_line, o.line + 1)
        if o.id is not None:  # a duplicate's reject carries an id already seen
            self.seen.add(o.id)
        if o.reject is None:
            self.answered += 1
        else:
            self.rejected += 1

    def committed(self) -> list[Path]:
        return sorted(self.parts.glob("part-*.jsonl"))

    @staticmethod
    def read_part(part: Path) -> Iterator[Outcome]:
        with open(part, encoding="utf-8") as fh:
            for ln in fh:
                yield Outcome.from_json(json.loads(ln))

    def start(self) -> None:
        """Create FILE.parts/ with job.json (a new job); a resumed job's stays."""
        if not self.parts.exists():
            tmp = self.parts.with_name(self.parts.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            write_atomic(tmp / JOB, [json.dumps(self.job, indent=2, sort_keys=True)], durable=True)
            os.replace(tmp, self.parts)
            fsync_dir(self.parts.parent)

    def commit(self, outcomes: list[Outcome]) -> None:
        """One part: `outcomes` (consecutive rows after those committed), sorted by line, written atomically."""
        if not outcomes:
            return
        outcomes = sorted(outcomes, key=lambda o: o.line)
        if outcomes[0].line < self.next_line:
            raise RuntimeError(f"line {outcomes[0].line} is committed already (next is {self.next_line})")
        write_atomic(self.parts / f"part-{outcomes[0].line:012d}.jsonl",
                     (json.dumps(o.to_json(), ensure_ascii=False) + "\n" for o in outcomes), durable=True)
        for o in outcomes:
            self._count(o)

    def finish(self) -> None:
        """FILE and FILE.rejects.jsonl from the parts (line order), each atomically; then the parts go."""
        parts = self.committed()

        def outcomes() -> Iterator[Outcome]:
            for part in parts:
                yield from self.read_part(part)

        write_atomic(rejects_path(self.output),
                     (json.dumps({"line": o.line, "id": o.id, **o.reject}, ensure_ascii=False) + "\n"
                      for o in outcomes() if o.reject is not None), durable=True)
        answers = (o for o in outcomes() if o.reject is None)
        if self.format == "jsonl":
            write_atomic(self.output, (json.dumps({"id": o.id, "line": o.line, **o.response}, ensure_ascii=False)
                                       + "\n" for o in answers), durable=True)
        else:
            self._write_parquet(answers)
        shutil.rmtree(self.parts)
        fsync_dir(self.output.parent)

    def _write_parquet(self, answers: Iterator[Outcome], chunk: int = 4096) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([("id", pa.string()), ("line", pa.int64()), ("response", pa.string())])
        tmp = self.output.with_name(self.output.name + ".tmp")
        with pq.ParquetWriter(tmp, schema) as writer:
            buf: list[Outcome] = []

            def flush() -> None:
                writer.write_table(pa.table({"id": [o.id for o in buf], "line": [o.line for o in buf],
                                             "response": [json.dumps(o.response, ensure_ascii=False) for o in buf]},
                                            schema=schema))
                buf.clear()

            for o in answers:
                buf.append(o)
                if len(buf) >= chunk:
                    flush()
            if buf:
                flush()
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, self.output)


def read_output(path: Path) -> list[dict[str, Any]]:
    """A finished job's answers as {"id", "line", **response} dicts, JSONL or Parquet (tests, the bench)."""
    path = Path(path)
    if file_format(path, "--output") == "parquet":
        import pyarrow.parquet as pq

        return [{"id": r["id"], "line": r["line"], **json.loads(r["response"])}
                for r in pq.read_table(path).to_pylist()]
    return [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]


__all__ = ["Row", "Outcome", "PartWriter", "scan", "scan_split", "count_rows", "split_request", "file_format",
           "parts_dir", "rejects_path", "input_identity", "read_output", "FORMATS"]
