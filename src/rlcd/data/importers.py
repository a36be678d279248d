"""Importers: outside data sets -> typed-decision Records.

Every importer returns `(records, exclusions)`. An exclusion is
`{"row", "source_file", "reason", "detail"}`; `row` is the row/record id when known, else the
1-based row number. Every input row ends up either in `records` (one or more) or in
`exclusions`, never silently dropped.

Image paths in the returned records are relative to `out_dir`, the directory that will hold the
records file: images given as files are referenced in place, images given as bytes (and the
easy-vqa images) are written content-addressed to `<out_dir>/images/<sha256><ext>`.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlcd.data.io import read_jsonl, sha256_bytes, sha256_file
from rlcd.errors import UserError
from rlcd.schema import Question, Record, RecordError, parse_question, parse_record

Exclusion = dict[str, Any]
ImportResult = tuple[list[Record], list[Exclusion]]

SPLIT_ALIASES = {"train": "train", "dev": "dev", "validation": "dev", "val": "dev",
                 "calibration": "calibration", "test": "test"}
YES_NO = {"no": 0, "yes": 1}
EASY_VQA_COLOURS = ("black", "blue", "brown", "gray", "green", "red", "teal", "yellow")
EASY_VQA_SHAPES = ("circle", "rectangle", "triangle")


def exclusion(row: Any, source_file: str | Path, reason: str, detail: str) -> Exclusion:
    return {"row": row, "source_file": str(source_file), "reason": reason, "detail": detail}


# --- reading rows ---------------------------------------------------------------------------


def read_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(row number, dict or exception) from a .jsonl, .csv or .parquet file, or a hub id.

    A hub id (a path that does not exist) is loaded through the optional `datasets` library;
    tests never take that branch.
    """
    path = Path(path)
    if not path.exists():
        yield from _hub_rows(str(path))
        return
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from _parquet_rows(path)
    elif suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as fh:
            yield from enumerate(csv.DictReader(fh), start=1)
    else:
        yield from read_jsonl(path)


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    n = 0
    for batch in pq.ParquetFile(path).iter_batches():
        for row in batch.to_pylist():
            n += 1
            yield n, row


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(?::[\w.-]+)?")


def is_hub_id(text: str) -> bool:
    """`owner/name[:split]` that is not an existing path: a Hugging Face hub dataset id."""
    return not Path(text).exists() and bool(HUB_ID.fullmatch(text))


def _hub_rows(name: str) -> Iterator[tuple[int, Any]]:
    if not is_hub_id(name):
        raise UserError(f"{name}: no such file (a hub dataset id looks like owner/name[:split])")
    spec, _, split = name.partition(":")
    try:
        import datasets
    except ImportError:
        raise UserError(f"--input {name} is a hub dataset id; reading it needs the optional `datasets` library: "
                        "pip install 'rlcd[hub]'") from None
    yield from enumerate(datasets.load_dataset(spec, split=split or "train"), start=1)


def _split_of(row: dict, split: str | None) -> str | None:
    """The row's official split: the importer argument wins, else a `split` column, else None."""
    value = split if split is not None else row.get("split")
    if value is None:
        return None
    if str(value).lower() not in SPLIT_ALIASES:
        raise RecordError(None, "split", f"unknown split {value!r} (expected one of {sorted(SPLIT_ALIASES)})")
    return SPLIT_ALIASES[str(value).lower()]


def _json_field(row: dict, name: str) -> Any:
    """A column holding a JSON string (decoded) or an already-decoded object."""
    if name not in row or row[name] is None:
        raise RecordError(None, name, "column is missing")
    value = row[name]
    return json.loads(value) if isinstance(value, str) else value


# --- images ---------------------------------------------------------------------------------


def store_image_bytes(data: bytes, out_dir: Path, ext: str = ".png") -> str:
    """Write image bytes to `<out_dir>/images/<sha256><ext>` (once) and return the relative path."""
    rel = f"images/{sha256_bytes(data)}{ext}"
    dest = out_dir / rel
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
    return rel


def copy_image(src: Path, out_dir: Path) -> str:
    """Copy an image file content-addressed into `<out_dir>/images/` and return the relative path."""
    rel = f"images/{sha256_file(src)}{src.suffix.lower()}"
    dest = out_dir / rel
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
    return rel


def relative_to(path: Path, out_dir: Path) -> str:
    """`path` relative to `out_dir`, POSIX style (what records store)."""
    return Path(os.path.relpath(path.resolve(), out_dir.resolve())).as_posix()


# --- typed-decisions ------------------------------------------------------------------------

GOLD_SUM_TOL = 1e-3  # the dataset's gold is "normalized within tolerance"
DEFAULT_TASK = "typed-decisions"  # task of a row without a `workflow` column


class GoldError(RecordError):
    """A gold entry excluded under its own reason (`missing_gold`, `zero_target`, `gold_not_normalized`)."""

    def __init__(self, row: str | None, field: str, rule: str, reason: str):
        super().__init__(row, field, rule)
        self.reason = reason


def gold_target(question: Question, gold: Any, *, row: str, qid: str | None = None) -> list[float]:
    """Target from `gold[qid]["probabilities"]` keyed by label (a missing label counts 0), or a list in
    candidate order; score gold may be keyed by level index or by level name (`score_gold_by_index`).

    The dataset documents its gold as normalized within tolerance: with s = sum of the given
    probabilities, |s - 1| <= GOLD_SUM_TOL (1e-3) is accepted and renormalised, t_k = p_k / s (so
    the record passes the schema's stricter 1e-4 check); anything further off is refused
    (`gold_not_normalized`), never rescaled into a distribution nobody wrote.
    """
    if gold is None:
        raise GoldError(row, "gold", "no gold entry for this question", "missing_gold")
    probs = gold.get("probabilities") if isinstance(gold, dict) else None
    labels = question.labels
    if isinstance(probs, list):  # one probability per candidate, in candidate order
        if len(probs) != len(labels):
            raise RecordError(row, "gold.probabilities", f"has {len(probs)} entries but the question has "
                                                         f"{len(labels)} candidates {labels}")
        probs = dict(zip(labels, probs))
    if not isinstance(probs, dict):
        raise RecordError(row, "gold.probabilities", "must be a mapping label -> probability (or a list in "
                                                     "candidate order)")
    if question.type == "score":
        probs = score_gold_by_index(question, probs, row=row)
    unknown = sorted(set(probs) - set(labels))
    if unknown:
        names = f" or by level name {list(question.criteria)}" if question.type == "score" else ""
        raise RecordError(row, "gold.probabilities", f"labels {unknown} are not candidates {labels}{names}")
    values = [probs.get(label, 0.0) for label in labels]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise RecordError(row, "gold.probabilities", f"entries must be finite non-negative numbers, got {v!r}")
    total = math.fsum(values)
    if total <= 0:
        raise GoldError(row, "gold.probabilities", "all probabilities are zero", "zero_target")
    if abs(total - 1.0) > GOLD_SUM_TOL:
        what = f"question {qid!r}" if qid is not None else "the question"
        raise GoldError(row, "gold.probabilities",
                        f"probabilities of {what} sum to {total:.6g}, not 1 within {GOLD_SUM_TOL:g} (the dataset's "
                        "gold is normalized within tolerance); fix the row's gold or drop the row",
                        "gold_not_normalized")
    return [v / total for v in values]


def score_gold_by_index(question: Question, probs: dict, *, row: str) -> dict:
    """Score gold keyed by level index ("0".."K-1") or by level name (the criteria text) -> keyed by index.

    Keys that read both ways with different meanings (numeral level names such as ["1", ..., "5"]) are
    refused rather than guessed: such gold is given as a list in level order.
    """
    names = [str(n) for n in question.criteria]  # type: ignore[union-attr]
    index = {name: str(i) for i, name in enumerate(names)}
    keys = set(probs)
    as_index = keys <= set(question.labels)
    as_name = keys <= set(index) and len(index) == len(names)
    if as_index and as_name and any(index[k] != k for k in keys):
        raise RecordError(row, "gold.probabilities",
                          f"keys {sorted(keys)} are both level indices and level names of {names}; give the "
                          "probabilities as a list in level order instead")
    if as_name and not as_index:
        return {index[k]: v for k, v in probs.items()}
    return probs


def content_id(state: Any, questions: Any) -> str:
    """`td-` + the first 16 hex digits of sha256 over the canonical JSON of {state, questions}.

    Canonical = keys sorted, no whitespace, UTF-8: the same content gives the same id on every run
    whatever its key order or JSON spacing, so two rows with the same content share an id and
    `rlcd data prepare` excludes the second as `duplicate_id`.
    """
    text = json.dumps({"state": state, "questions": questions}, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False)
    return "td-" + sha256_bytes(text.encode("utf-8"))[:16]


def _given(row: dict, name: str) -> Any:
    """A column's value, None when absent, null or blank."""
    value = row.get(name)
    return None if value is None or (isinstance(value, str) and not value.strip()) else value


def import_typed_decisions(path: str | Path, *, split: str | None = None,
                           source: str = "typed-decisions", language: str = "en") -> ImportResult:
    """Typed-decisions rows -> one record per (row, question).

    The dataset documents three columns, `state`, `questions` and `gold` (JSON strings or objects);
    `id`, `workflow` and `split` are optional. Record id `{row_id}:{qid}`, case_id `row_id`, task =
    `workflow`, else `typed-decisions`; `row_id` = the `id` column, else `content_id(state, questions)`.
    """
    records: list[Record] = []
    excluded: list[Exclusion] = []
    for row_no, row in read_rows(path):
        if isinstance(row, Exception):
            excluded.append(exclusion(row_no, path, "unparsable", f"row {row_no}: {row}"))
            continue
        given = None if _given(row, "id") is None else str(row["id"])
        where = given or str(row_no)  # names the row in details until its id is known
        try:
            task, row_split, state, questions, gold = _typed_case(row, split)
        except json.JSONDecodeError as exc:
            excluded.append(exclusion(given or row_no, path, "unparsable",
                                      f"row {where!r}: a JSON column does not parse ({exc})"))
            continue
        except RecordError as exc:
            excluded.append(exclusion(given or row_no, path, "invalid", str(RecordError(where, exc.field, exc.rule))))
            continue
        rid = given or content_id(state, questions)
        for qid, qobj in questions.items():
            record_id = f"{rid}:{qid}"
            try:
                question = parse_question(qobj, qid=record_id)
                target = gold_target(question, gold.get(qid), row=record_id, qid=qid)
                records.append(parse_record({
                    "id": record_id, "source": source, "language": language, "task": task,
                    "split": row_split, "state": state, "case_id": rid,
                    "question": question.model_dump(mode="json"), "target": target,
                }))
            except RecordError as exc:
                excluded.append(exclusion(record_id, path, getattr(exc, "reason", "invalid"),
                                          str(RecordError(record_id, exc.field, exc.rule))))
    return records, excluded


def _typed_case(row: dict, split: str | None) -> tuple[str, str | None, Any, dict, dict]:
    """(task, split, state, questions, gold) of a typed-decisions row, or RecordError / JSONDecodeError."""
    workflow = _given(row, "workflow")
    if workflow is not None and not isinstance(workflow, str):
        raise RecordError(None, "workflow", f"must be a string (or absent: task {DEFAULT_TASK!r}), got {workflow!r}")
    row_split = _split_of(row, split)
    state, questions, gold = (_json_field(row, name) for name in ("state", "questions", "gold"))
    if not isinstance(questions, dict) or not questions:
        raise RecordError(None, "questions", "must be a non-empty mapping qid -> question")
    if not isinstance(gold, dict):
        raise RecordError(None, "gold", "must be a mapping qid -> {probabilities}")
    return workflow or DEFAULT_TASK, row_split, state, questions, gold


# --- VQAv2-style yes/no ---------------------------------------------------------------------


def vqa_target(row: dict, *, rid: str) -> list[float]:
    """[#no, #yes] / (#no + #yes) over yes/no votes; hard target from multiple_choice_answer if no votes."""
    counts = [0, 0]
    for vote in row.get("answers") or []:
        answer = vote.get("answer") if isinstance(vote, dict) else vote
        idx = YES_NO.get(str(answer).strip().lower())
        if idx is not None:
            counts[idx] += 1
    if sum(counts) == 0:
        idx = YES_NO.get(str(row.get("multiple_choice_answer", "")).strip().lower())
        if idx is None:
            raise RecordError(rid, "answers", "no yes/no votes and multiple_choice_answer is not yes/no")
        counts[idx] = 1
    total = sum(counts)
    return [counts[0] / total, counts[1] / total]


def _vqa_image(value: Any, images_dir: Path, out_dir: Path, *, rid: str) -> str:
    """Record image path for a VQA `image` value: a file name under images_dir, or {bytes, path}."""
    if isinstance(value, dict) and value.get("bytes"):
        return store_image_bytes(value["bytes"], out_dir, Path(value.get("path") or "x.jpg").suffix.lower() or ".jpg")
    name = value.get("path") if isinstance(value, dict) else value
    if not name:
        raise RecordError(rid, "image", "missing")
    path = images_dir / str(name)
    if not path.is_file():
        raise RecordError(rid, "image", f"file not found: {path}")
    return relative_to(path, out_dir)


def import_vqav2(path: str | Path, images_dir: str | Path, out_dir: str | Path, *, split: str | None = None,
                 source: str = "vqav2") -> ImportResult:
    """VQAv2-style rows (`question, image, answer_type, answers, multiple_choice_answer`) -> noul records.

    Only `answer_type == "yes/no"` is kept (other rows are excluded as `not_yes_no`). Rows about the
    same image form one case, so they share a prefix and always land in the same split.
    """
    images_dir, out_dir = Path(images_dir), Path(out_dir)
    records: list[Record] = []
    excluded: list[Exclusion] = []
    for row_no, row in read_rows(path):
        if isinstance(row, Exception):
            excluded.append(exclusion(row_no, path, "unparsable", f"row {row_no}: {row}"))
            continue
        rid = f"{source}:{row.get('question_id', row_no)}"
        if row.get("answer_type") != "yes/no":
            excluded.append(exclusion(rid, path, "not_yes_no", f"row {rid!r}: answer_type is {row.get('answer_type')!r}"))
            continue
        try:
            target = vqa_target(row, rid=rid)
        except RecordError as exc:
            excluded.append(exclusion(rid, path, "no_yes_no_votes", str(exc)))
            continue
        try:
            image = _vqa_image(row.get("image") or row.get("image_path"), images_dir, out_dir, rid=rid)
            records.append(parse_record({
                "id": rid, "source": source, "language": "en", "task": "yes-no", "split": _split_of(row, split),
                "state": "", "image": image, "case_id": f"{source}:image:{row.get('image_id', image)}",
                "question": {"type": "noul", "instructions": row.get("question")}, "target": target,
            }))
        except RecordError as exc:
            reason = "missing_image" if exc.field == "image" else "invalid"
            excluded.append(exclusion(rid, path, reason, str(RecordError(rid, exc.field, exc.rule))))
    return records, excluded


# --- text classification --------------------------------------------------------------------

TEXT_QUESTION = "Which label fits this text?"  # the default question of a text record


def import_text(path: str | Path, *, text_column: str = "text", label_column: str = "label",
                labels: list[str] | None = None, task: str | None = None, source: str = "text",
                language: str = "en", id_column: str = "id", split: str | None = None,
                instructions: str = TEXT_QUESTION) -> ImportResult:
    """Text classification (JSONL or CSV) -> one choice record per row.

    The label set is `labels` in the given order, or every label seen, sorted. Rows with a label
    outside a given set are excluded as `unknown_label`. `instructions` is the question every record
    asks (`rlcd data import --kind text --question TEXT`). A text or label column no row has is a
    UserError naming the columns there are.
    """
    task = task or Path(path).stem
    rows: list[tuple[str, Any, Any, str | None]] = []
    excluded: list[Exclusion] = []
    columns: dict[str, None] = {}  # every column seen, in order
    for row_no, row in read_rows(path):
        if isinstance(row, Exception):
            excluded.append(exclusion(row_no, path, "unparsable", f"row {row_no}: {row}"))
            continue
        columns.update(dict.fromkeys(map(str, row)))
        rid = f"{task}:{row.get(id_column) or row_no}"
        text, label = row.get(text_column), row.get(label_column)
        if not isinstance(text, str) or not text.strip():
            excluded.append(exclusion(rid, path, "invalid", str(RecordError(rid, text_column, "text is missing or empty"))))
        elif label is None or str(label).strip() == "":
            excluded.append(exclusion(rid, path, "invalid", str(RecordError(rid, label_column, "label is missing"))))
        else:
            rows.append((rid, text, str(label).strip(), row.get("split")))
    _check_columns(path, columns, {"--text-column": text_column, "--label-column": label_column})
    label_set = list(labels) if labels else sorted({label for _, _, label, _ in rows})
    if len(label_set) < 2:
        raise UserError(f"{path}: text classification needs at least 2 labels, found {label_set} (in column "
                        f"{label_column!r}); give the label set with --labels")
    index = {label: i for i, label in enumerate(label_set)}
    records: list[Record] = []
    for rid, text, label, row_split in rows:
        if label not in index:
            excluded.append(exclusion(rid, path, "unknown_label",
                                      str(RecordError(rid, label_column, f"label {label!r} is not in {label_set}"))))
            continue
        target = [0.0] * len(label_set)
        target[index[label]] = 1.0
        try:
            records.append(parse_record({
                "id": rid, "source": source, "language": language, "task": task,
                "split": _split_of({"split": row_split}, split), "state": text,
                "question": {"type": "choice", "instructions": instructions, "criteria": label_set},
                "target": target,
            }))
        except RecordError as exc:
            excluded.append(exclusion(rid, path, "invalid", str(exc)))
    return records, excluded


def _check_columns(path: str | Path, columns: dict[str, None], needed: dict[str, str]) -> None:
    """A column no row has is a wrong column name, not a file of invalid rows: one UserError naming it."""
    if not columns:
        return  # no readable row at all: the exclusions say why
    for option, name in needed.items():
        if name not in columns:
            raise UserError(f"{path}: no column {name!r} (columns: {', '.join(columns)}); name the column with "
                            f"{option}")


# --- easy-vqa -------------------------------------------------------------------------------


def _easy_vqa_question(answer: str) -> tuple[str, dict, list[float]] | None:
    """(task, question without instructions, target) for an easy-vqa answer; None if unknown."""
    if answer in YES_NO:
        return "yes-no", {"type": "noul"}, [1.0 - YES_NO[answer], float(YES_NO[answer])]
    for task, options in (("color", EASY_VQA_COLOURS), ("shape", EASY_VQA_SHAPES)):
        if answer in options:
            return task, {"type": "choice", "criteria": list(options)}, [float(o == answer) for o in options]
    return None


def import_easy_vqa(out_dir: str | Path, *, limit: int | None = None) -> ImportResult:
    """The installed easy-vqa set (MIT) with its official train/test split.

    yes/no -> noul (task `yes-no`); colour answers -> choice over the 8 colours (task `color`);
    shape answers -> choice over the 3 shapes (task `shape`). `limit` keeps the first questions of
    each split in file order, shared between the splits in their official proportions.
    """
    import easy_vqa

    out_dir = Path(out_dir)
    splits = {
        "train": (easy_vqa.get_train_questions(), easy_vqa.get_train_image_paths()),
        "test": (easy_vqa.get_test_questions(), easy_vqa.get_test_image_paths()),
    }
    total = sum(len(qs[0]) for qs, _ in splits.values())
    records: list[Record] = []
    excluded: list[Exclusion] = []
    source_file = Path(easy_vqa.__file__).parent / "data"
    for split, ((texts, answers, image_ids), image_paths) in splits.items():
        n = len(texts) if limit is None else min(len(texts), round(limit * len(texts) / total))
        stored: dict[int, str] = {}
        for i in range(n):
            rid = f"easy-vqa:{split}:{i}"
            kind = _easy_vqa_question(answers[i])
            if kind is None:
                excluded.append(exclusion(rid, source_file, "unknown_answer", f"row {rid!r}: answer {answers[i]!r}"))
                continue
            task, question, target = kind
            image_id = image_ids[i]
            if image_id not in stored:
                stored[image_id] = copy_image(Path(image_paths[image_id]), out_dir)
            records.append(parse_record({
                "id": rid, "source": "easy-vqa", "language": "en", "task": task, "split": split,
                "state": "", "image": stored[image_id], "case_id": f"easy-vqa:{split}:image{image_id}",
                "question": {**question, "instructions": texts[i]}, "target": target,
            }))
    return records, excluded


# --- native JSONL ---------------------------------------------------------------------------


def import_jsonl(path: str | Path, out_dir: str | Path) -> ImportResult:
    """Native record JSONL: validated, duplicate ids excluded, image paths rebased onto `out_dir`."""
    path, out_dir = Path(path), Path(out_dir)
    records: list[Record] = []
    excluded: list[Exclusion] = []
    seen: dict[str, int] = {}
    for line_no, obj in read_jsonl(path):
        if isinstance(obj, Exception):
            excluded.append(exclusion(line_no, path, "unparsable", f"line {line_no}: {obj}"))
            continue
        try:
            record = parse_record(obj, row=f"line {line_no}")
        except RecordError as exc:
            excluded.append(exclusion(exc.row or line_no, path, "invalid", str(exc)))
            continue
        if record.id in seen:
            excluded.append(exclusion(record.id, path, "duplicate_id", str(RecordError(
                record.id, "id", f"already used on line {seen[record.id]}"))))
            continue
        seen[record.id] = line_no
        if record.image is not None:
            image = path.parent / record.image
            if not image.is_file():
                excluded.append(exclusion(record.id, path, "missing_image",
                                          str(RecordError(record.id, "image", f"file not found: {image}"))))
                continue
            record = record.model_copy(update={"image": relative_to(image, out_dir)})
        records.append(record)
    return records, excluded
