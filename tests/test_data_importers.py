"""Each importer on a fixture that mirrors its real schema."""

import csv
import hashlib
import json
import math
import sys
from collections import Counter
from pathlib import Path

import pytest

from rlcd.data import importers
from rlcd.data.io import read_jsonl, sha256_file, write_jsonl
from rlcd.errors import UserError
from rlcd.schema import RecordError, parse_record

FIX = Path(__file__).parent / "fixtures" / "data"


def _by_id(records):
    return {r.id: r for r in records}


def _reasons(excluded):
    return {e["row"]: e["reason"] for e in excluded}


def _input_rows(path):
    return sum(1 for _ in read_jsonl(path))


# --- typed-decisions ------------------------------------------------------------------------


def _check_typed_decisions(records, excluded, source_file):
    recs = _by_id(records)
    assert set(recs) == {"td-1:action", "td-1:urgent", "td-1:severity", "td-2:approve",
                         "td-3:approve", "td-4:route", "td-10:urgent"}
    action = recs["td-1:action"]
    assert (action.source, action.language, action.task, action.case_id) == ("typed-decisions", "en", "customer_service", "td-1")
    assert action.question.labels == ["refund", "replace", "escalate"] and action.target == pytest.approx([0.7, 0.2, 0.1])
    assert isinstance(action.state, dict) and action.state["customer"] == "C-1042"
    assert recs["td-1:urgent"].target == pytest.approx([0.2, 0.8])  # noul order is false, true
    assert recs["td-1:severity"].target == pytest.approx([0.1, 0.6, 0.3, 0.0])  # missing level "3" -> 0
    assert recs["td-10:urgent"].split == "test" and recs["td-1:urgent"].split is None
    reasons = _reasons(excluded)
    assert reasons == {"td-2:route": "gold_not_normalized", "td-3:route": "missing_gold", "td-4:approve": "zero_target",
                       "td-5:action": "invalid", "td-6": "unparsable", 7: "unparsable", "td-8:action": "invalid",
                       "td-9:urgent": "invalid"}
    details = {e["row"]: e["detail"] for e in excluded}
    # {"controller": 0.6, "cfo": 0.3} sums to 0.9: excluded, not rescaled to [0, 2/3, 1/3]
    assert "'td-2:route'" in details["td-2:route"] and "question 'route'" in details["td-2:route"]
    assert "sum to 0.9," in details["td-2:route"]
    assert "store_credit" in details["td-5:action"] and "td-5:action" in details["td-5:action"]
    assert "ranking" in details["td-8:action"] or "'choice', 'noul' or 'score'" in details["td-8:action"]
    assert "reserved token" in details["td-9:urgent"]
    assert all(e["source_file"] == str(source_file) for e in excluded)


def test_typed_decisions_jsonl():
    path = FIX / "typed_decisions.jsonl"
    _check_typed_decisions(*importers.import_typed_decisions(path), path)


def test_typed_decisions_parquet_matches_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [obj for _, obj in read_jsonl(FIX / "typed_decisions.jsonl") if isinstance(obj, dict)]
    columns = ("id", "workflow", "state", "questions", "gold", "split")
    table = pa.table({c: [r.get(c) for r in rows] for c in columns})
    pq.write_table(table, tmp_path / "td.parquet")
    records, excluded = importers.import_typed_decisions(tmp_path / "td.parquet")
    ref, _ = importers.import_typed_decisions(FIX / "typed_decisions.jsonl")
    assert [r.model_dump() for r in records] == [r.model_dump() for r in ref]
    assert sorted(e["reason"] for e in excluded) == sorted(
        ["gold_not_normalized", "missing_gold", "zero_target", "invalid", "unparsable", "invalid", "invalid"])


def test_typed_decisions_split_argument_overrides_column():
    records, _ = importers.import_typed_decisions(FIX / "typed_decisions.jsonl", split="validation")
    assert {r.split for r in records} == {"dev"}


def _score_row(criteria, probabilities, rid="s-1"):
    questions = {"severity": {"type": "score", "instructions": "How severe is it?", "criteria": criteria}}
    return {"id": rid, "state": {"ticket": "The server room is flooded."}, "questions": questions,
            "gold": {"severity": {"probabilities": probabilities}}}


def test_score_gold_keyed_by_level_name_equals_gold_keyed_by_index(tmp_path):
    """README/docs/DATA.md: score gold may name its levels by index ("0".."K-1") or by the criteria text."""
    levels = ["none", "minor", "major", "critical"]
    rows = [_score_row(levels, {"0": 0.1, "1": 0.6, "2": 0.3}, "by-index"),
            _score_row(levels, {"none": 0.1, "minor": 0.6, "major": 0.3}, "by-name"),
            _score_row(levels, [0.1, 0.6, 0.3, 0.0], "as-list"),
            _score_row(levels, {"none": 0.5, "2": 0.5}, "mixed"),
            _score_row(levels, {"fatal": 1.0}, "unknown")]
    write_jsonl(tmp_path / "score.jsonl", rows)
    records, excluded = importers.import_typed_decisions(tmp_path / "score.jsonl")
    recs = _by_id(records)
    assert set(recs) == {"by-index:severity", "by-name:severity", "as-list:severity"}
    for rid in recs:
        assert recs[rid].target == pytest.approx([0.1, 0.6, 0.3, 0.0], abs=1e-12), rid
    details = {e["row"]: e["detail"] for e in excluded}
    assert set(details) == {"mixed:severity", "unknown:severity"}
    assert "or by level name ['none', 'minor', 'major', 'critical']" in details["unknown:severity"]
    assert "'fatal'" in details["unknown:severity"]


def test_score_gold_with_numeral_level_names_is_refused_when_ambiguous(tmp_path):
    """Levels named "1".."5": keys {"1", "2"} read as indices mean levels 2-3, as names levels 1-2 -- refused;
    keys only one reading fits are taken by that reading."""
    likert = ["1", "2", "3", "4", "5"]
    rows = [_score_row(likert, {"1": 0.5, "2": 0.5}, "ambiguous"),
            _score_row(likert, {"4": 0.2, "5": 0.8}, "names-only"),  # "5" is no index of 5 levels
            _score_row(likert, {"0": 1.0}, "index-only"),
            _score_row(likert, [0.5, 0.5, 0, 0, 0], "list")]
    write_jsonl(tmp_path / "likert.jsonl", rows)
    records, excluded = importers.import_typed_decisions(tmp_path / "likert.jsonl")
    recs = _by_id(records)
    assert recs["names-only:severity"].target == pytest.approx([0, 0, 0, 0.2, 0.8], abs=1e-12)
    assert recs["index-only:severity"].target == pytest.approx([1, 0, 0, 0, 0], abs=1e-12)
    assert recs["list:severity"].target == pytest.approx([0.5, 0.5, 0, 0, 0], abs=1e-12)
    (only,) = excluded
    assert only["row"] == "ambiguous:severity" and "list in level order" in only["detail"]


def test_gold_as_a_list_needs_one_entry_per_candidate(tmp_path):
    row = _score_row(["low", "high"], [0.2, 0.3, 0.5])
    write_jsonl(tmp_path / "short.jsonl", [row])
    records, excluded = importers.import_typed_decisions(tmp_path / "short.jsonl")
    assert not records and "has 3 entries but the question has 2 candidates" in excluded[0]["detail"]


THREE = FIX / "typed_decisions_three_columns.jsonl"  # rows with only state, questions, gold (+ one workflow)


def _raw_rows(path):
    return [obj for _, obj in read_jsonl(path)]


def _decoded(value):
    return json.loads(value) if isinstance(value, str) else value


def _sha_id(row):
    """The documented id, computed here from the raw row: td- + sha256(canonical {state, questions})[:16]."""
    canonical = json.dumps({"state": _decoded(row["state"]), "questions": _decoded(row["questions"])},
                           sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "td-" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def test_typed_decisions_gold_is_normalized_within_1e_3():
    """|sum - 1| <= 1e-3: renormalised (p / sum); further off: excluded `gold_not_normalized`, never rescaled."""
    raw = _raw_rows(THREE)
    records, excluded = importers.import_typed_decisions(THREE)
    first = _sha_id(raw[0])
    recs = _by_id(records)
    action, urgent = recs[f"{first}:action"], recs[f"{first}:urgent"]
    assert action.target == pytest.approx([0.6 / 1.0005, 0.3 / 1.0005, 0.1005 / 1.0005], rel=1e-12)
    assert urgent.target == pytest.approx([0.5995 / 0.9995, 0.4 / 0.9995], rel=1e-12)  # [P(false), P(true)]
    assert abs(math.fsum(action.target) - 1) < 1e-12
    # the same gold unrenormalised would break the schema's own 1e-4 rule for native records
    with pytest.raises(RecordError, match="within 0.0001"):
        parse_record({**action.model_dump(mode="json"), "target": [0.6, 0.3, 0.1005]})
    reasons = _reasons(excluded)
    assert reasons == {f"{_sha_id(raw[2])}:action": "gold_not_normalized",
                       f"{_sha_id(raw[3])}:urgent": "gold_not_normalized"}
    details = " ".join(e["detail"] for e in excluded)
    assert "question 'action' sum to 1.002," in details and "question 'urgent' sum to 0.998," in details


def test_typed_decisions_rows_without_id_get_a_stable_content_id_and_a_default_task(tmp_path):
    raw = _raw_rows(THREE)
    records, excluded = importers.import_typed_decisions(THREE)
    ids = [_sha_id(r) for r in raw]
    assert ids[0] == ids[1]  # same content, other key order and JSON spacing
    assert len(set(ids)) == 4
    assert [r.id for r in records] == [f"{ids[0]}:action", f"{ids[0]}:urgent", f"{ids[1]}:urgent",
                                       f"{ids[1]}:action", f"{ids[4]}:urgent"]
    assert {r.case_id for r in records} == {ids[0], ids[4]}
    by_task = {r.id: r.task for r in records}
    assert by_task[f"{ids[0]}:action"] == "typed-decisions" and by_task[f"{ids[4]}:urgent"] == "billing"
    again, _ = importers.import_typed_decisions(THREE)
    assert [r.model_dump() for r in again] == [r.model_dump() for r in records]
    # the id is the content's, not the file's: the same rows as CSV (JSON re-spaced) give the same records
    with open(tmp_path / "td.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["state", "questions", "gold", "workflow"])
        writer.writeheader()
        for r in raw:
            writer.writerow({k: v if isinstance(v, str) else json.dumps(v, indent=1) for k, v in r.items()})
    from_csv, _ = importers.import_typed_decisions(tmp_path / "td.csv")
    assert [r.model_dump() for r in from_csv] == [r.model_dump() for r in records]
    # every question of every row is either a record or an exclusion
    questions = sum(len(_decoded(r["questions"])) for r in raw)
    assert len(records) + len(excluded) == questions


def test_prepare_excludes_the_second_of_two_rows_with_the_same_content(tmp_path):
    from rlcd.data.prepare import prepare

    records, _ = importers.import_typed_decisions(THREE)
    write_jsonl(tmp_path / "td.jsonl", records)
    manifest = prepare([tmp_path / "td.jsonl"], tmp_path / "processed", seed=0)
    assert manifest["exclusions"] == {"duplicate_id": 2}  # the copy's two questions
    assert manifest["read"] == len(records) == manifest["used"] + manifest["excluded"]
    dup = [e for _, e in read_jsonl(tmp_path / "processed" / "excluded.jsonl")]
    first = _sha_id(_raw_rows(THREE)[0])
    assert {e["row"] for e in dup} == {f"{first}:action", f"{first}:urgent"}
    assert all("already used at td.jsonl:" in e["detail"] for e in dup)


def test_a_hub_id_without_datasets_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails, as when not installed
    from rlcd.errors import UserError

    with pytest.raises(UserError, match=r"pip install 'rlcd\[hub\]'"):
        importers.import_typed_decisions("some-org/some-set:train")


# --- VQAv2 ----------------------------------------------------------------------------------


def test_vqav2_yes_no_votes(tmp_path):
    out_dir = tmp_path / "imported"
    out_dir.mkdir()
    records, excluded = importers.import_vqav2(FIX / "vqav2.jsonl", FIX / "vqav2_images", out_dir)
    recs = _by_id(records)
    assert set(recs) == {"vqav2:101", "vqav2:102", "vqav2:104"}
    assert recs["vqav2:101"].target == pytest.approx([0.3, 0.7])  # [#no, #yes] / (#no + #yes)
    assert recs["vqav2:102"].target == pytest.approx([6 / 7, 1 / 7])  # "maybe" votes do not count
    assert recs["vqav2:104"].target == [0.0, 1.0]  # no votes: hard target from multiple_choice_answer
    assert all(r.question.type == "noul" and r.task == "yes-no" for r in records)
    assert recs["vqav2:101"].case_id == recs["vqav2:102"].case_id != recs["vqav2:104"].case_id
    assert _reasons(excluded) == {"vqav2:103": "not_yes_no", "vqav2:105": "no_yes_no_votes", "vqav2:106": "missing_image"}
    for r in records:  # image paths are relative to the output directory and resolve to the fixture image
        assert not Path(r.image).is_absolute()
        assert sha256_file(out_dir / r.image) == sha256_file(FIX / "vqav2_images" / Path(r.image).name)
    assert len(records) + len(excluded) == _input_rows(FIX / "vqav2.jsonl")


def test_vqav2_embedded_image_bytes_are_stored_content_addressed(tmp_path):
    data = (FIX / "vqav2_images" / "img_a.png").read_bytes()
    row = {"question_id": 1, "image": {"bytes": data, "path": "x.png"}, "question": "Red?",
           "answer_type": "yes/no", "answers": ["yes", "yes", "no"], "multiple_choice_answer": "yes"}
    src = tmp_path / "rows.parquet"
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([row]), src)
    (record,), excluded = importers.import_vqav2(src, tmp_path, tmp_path / "out")
    assert not excluded and record.target == pytest.approx([1 / 3, 2 / 3])
    assert record.image == f"images/{sha256_file(FIX / 'vqav2_images' / 'img_a.png')}.png"
    assert (tmp_path / "out" / record.image).read_bytes() == data


# --- text classification --------------------------------------------------------------------


def test_text_csv_infers_sorted_labels():
    records, excluded = importers.import_text(FIX / "text.csv")
    assert [r.id for r in records] == ["text:1", "text:2", "text:3", "text:6"]
    assert all(r.question.labels == ["negative", "neutral", "positive"] for r in records)
    assert _by_id(records)["text:2"].target == [1.0, 0.0, 0.0]
    assert _by_id(records)["text:1"].state == "The food was great, thanks!"
    assert _reasons(excluded) == {"text:4": "invalid", "text:5": "invalid"}
    assert all(r.task == "text" and r.question.type == "choice" for r in records)


def test_text_jsonl_custom_columns_and_given_labels():
    labels = ["reservation", "hours", "menu"]
    records, excluded = importers.import_text(FIX / "text.jsonl", text_column="sentence", label_column="intent",
                                              labels=labels, task="intents")
    assert [r.question.labels for r in records] == [labels] * 3
    assert [r.target.index(1.0) for r in records] == [0, 1, 2]
    assert Counter(e["reason"] for e in excluded) == {"unknown_label": 1, "unparsable": 1}
    assert "cancellation" in next(e["detail"] for e in excluded if e["reason"] == "unknown_label")


def test_text_with_a_single_label_is_refused(tmp_path):
    (tmp_path / "one.csv").write_text("text,label\na,x\nb,x\n")
    with pytest.raises(UserError, match="at least 2 labels, found \\['x'\\] \\(in column 'label'\\)"):
        importers.import_text(tmp_path / "one.csv")


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_text_without_the_label_column_names_it_and_the_columns_there_are(tmp_path, suffix):
    path = tmp_path / f"tickets{suffix}"
    if suffix == ".csv":
        path.write_text("text,category\nMy parcel is late,shipping\nRefund please,billing\n")
    else:
        write_jsonl(path, [{"text": "My parcel is late", "category": "shipping"},
                           {"text": "Refund please", "category": "billing"}])
    with pytest.raises(UserError) as err:
        importers.import_text(path)
    assert str(err.value) == (f"{path}: no column 'label' (columns: text, category); name the column with "
                              "--label-column")
    with pytest.raises(UserError, match="no column 'body' \\(columns: text, category\\).*--text-column"):
        importers.import_text(path, text_column="body", label_column="category")
    records, excluded = importers.import_text(path, label_column="category")
    assert len(records) == 2 and not excluded


def test_text_question_is_the_given_one():
    records, _ = importers.import_text(FIX / "text.csv")
    assert {r.question.instructions for r in records} == {importers.TEXT_QUESTION}
    records, _ = importers.import_text(FIX / "text.csv", instructions="What is the tone of this review?")
    assert {r.question.instructions for r in records} == {"What is the tone of this review?"}


# --- easy-vqa -------------------------------------------------------------------------------


def test_easy_vqa_subset(tmp_path):
    records, excluded = importers.import_easy_vqa(tmp_path, limit=120)
    assert not excluded and 115 <= len(records) <= 125
    splits = Counter(r.split for r in records)
    assert set(splits) == {"train", "test"} and splits["train"] > splits["test"]
    by_task = {r.task: r for r in records}
    assert set(by_task) == {"yes-no", "color", "shape"}
    assert by_task["yes-no"].question.type == "noul"
    assert by_task["color"].question.labels == list(importers.EASY_VQA_COLOURS) and len(importers.EASY_VQA_COLOURS) == 8
    assert by_task["shape"].question.labels == ["circle", "rectangle", "triangle"]
    for r in records:
        assert sum(r.target) == 1.0 and max(r.target) == 1.0
        path = tmp_path / r.image
        assert r.image == f"images/{sha256_file(path)}.png"
    again, _ = importers.import_easy_vqa(tmp_path / "again", limit=120)
    assert [r.model_dump() for r in again] == [r.model_dump() for r in records]


def test_easy_vqa_answers_match_the_question_text(tmp_path):
    records, _ = importers.import_easy_vqa(tmp_path, limit=60)
    for r in records:
        text = r.question.instructions
        assert ("color" in text) == (r.task == "color")
        assert (text.split()[0] in ("is", "does")) == (r.task == "yes-no")


# --- native JSONL ---------------------------------------------------------------------------


def test_native_jsonl_validates_and_rebases_images(tmp_path):
    src_dir = tmp_path / "src"
    (src_dir / "pics").mkdir(parents=True)
    (src_dir / "pics" / "a.png").write_bytes((FIX / "vqav2_images" / "img_a.png").read_bytes())
    base = {"source": "mine", "task": "t", "state": "s", "question": {"type": "noul", "instructions": "ok?"},
            "target": [0.5, 0.5]}
    rows = [{**base, "id": "a", "image": "pics/a.png"}, {**base, "id": "b"}, {**base, "id": "a"},
            {**base, "id": "c", "image": "pics/none.png"}, {**base, "id": "d", "target": [1, 1]}]
    write_jsonl(src_dir / "in.jsonl", rows)
    with open(src_dir / "in.jsonl", "a") as fh:
        fh.write("{oops\n")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    records, excluded = importers.import_jsonl(src_dir / "in.jsonl", out_dir)
    assert [r.id for r in records] == ["a", "b"]
    assert (out_dir / records[0].image).resolve() == (src_dir / "pics" / "a.png").resolve()
    assert _reasons(excluded) == {"a": "duplicate_id", "c": "missing_image", "d": "invalid", 6: "unparsable"}
    assert parse_record(json.loads(records[0].model_dump_json())).image == records[0].image


def test_the_documented_typed_decisions_example_imports_as_documented(tmp_path):
    """docs/DATA.md's row (one question per type) gives the targets the page describes."""
    import re

    doc = (Path(__file__).parents[1] / "docs" / "DATA.md").read_text()
    row = json.loads(re.search(r"```json\n(.*?)```", doc, re.S).group(1))
    write_jsonl(tmp_path / "doc.jsonl", [row])
    records, excluded = importers.import_typed_decisions(tmp_path / "doc.jsonl")
    assert not excluded
    got = {r.id: (r.question.type, r.question.labels, r.target) for r in records}
    assert got == {
        "t-1042:action": ("choice", ["refund", "replace", "escalate"], pytest.approx([0.7, 0.2, 0.1])),
        "t-1042:team": ("choice", ["billing", "shipping"], pytest.approx([0.4, 0.6])),
        "t-1042:urgent": ("noul", ["false", "true"], pytest.approx([0.2, 0.8])),
        "t-1042:severity": ("score", ["0", "1", "2", "3"], pytest.approx([0.1, 0.6, 0.3, 0.0])),
    }
    assert {(r.task, r.split, r.case_id) for r in records} == {("customer_service", "train", "t-1042")}
