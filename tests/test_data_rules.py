"""One test per rejection rule: the message names the row, the field and the rule, both from
`parse_record` directly and as an `invalid` exclusion written by `prepare`."""

import copy
import json
import math

import pytest

from rlcd.data.prepare import prepare
from rlcd.schema import RecordError, parse_record

GOOD = {
    "id": "row-7", "source": "unit", "task": "t", "state": {"ticket": "hello"},
    "question": {"type": "choice", "instructions": "pick one", "criteria": ["a", "b"]},
    "target": [0.25, 0.75],
}


def _q(**kw):
    return lambda r: r["question"].update(kw)


def _set(**kw):
    return lambda r: r.update(kw)


# (reason name, mutation of GOOD, field named in the message, rule text in the message)
CASES = [
    ("bad_type", _q(type="ranking"), "question.type", "'choice', 'noul' or 'score'"),
    ("choice_too_few_labels", _q(criteria=["a"]), "question", "choice needs 2..255 labels, got 1"),
    ("choice_too_many_labels", _q(criteria=[f"l{i}" for i in range(256)]), "question", "choice needs 2..255 labels, got 256"),
    ("choice_duplicate_labels", _q(criteria=["a", "a"]), "question", "choice labels must be unique"),
    ("choice_empty_label", _q(criteria={"a": "x", " ": "y"}), "question", "non-empty strings"),
    ("choice_missing_criteria", _q(criteria=None), "question", "choice criteria is required"),
    ("noul_wrong_keys", _q(type="noul", criteria={"yes": "y", "no": "n"}), "question", "only describe 'true' and 'false'"),
    ("noul_list_criteria", _q(type="noul", criteria=["false", "true"]), "question", "must be a mapping"),
    ("score_one_level", _q(type="score", criteria=["only"]), "question", "score criteria must be a list of 2..255"),
    ("score_mapping", _q(type="score", criteria={"0": "low", "1": "high"}), "question", "score criteria must be a list"),
    ("target_length", _set(target=[0.2, 0.3, 0.5]), "target", "has 3 entries but the question has 2 candidates"),
    ("target_negative", _set(target=[-0.5, 1.5]), "target", "non-negative"),
    ("target_nan", _set(target=[math.nan, 1.0]), "target", "finite"),
    ("target_inf", _set(target=[math.inf, 0.0]), "target", "finite"),
    ("target_sum", _set(target=[0.5, 0.6]), "target", "must sum to 1 within"),
    ("target_not_number", _set(target=["a", "b"]), "target.0", "valid number"),
    ("posterior_sum", _set(posterior=[0.1, 0.1]), "posterior", "must sum to 1 within"),
    ("reserved_in_state_text", _set(state="see <|fim_suffix|> here"), "state", "reserved token '<|fim_suffix|>'"),
    ("reserved_in_state_object", _set(state={"note": "<|image_pad|>"}), "state", "reserved token '<|image_pad|>'"),
    ("reserved_in_instructions", _q(instructions="which <|im_start|>"), "question", "instructions contains the reserved token"),
    ("reserved_in_criteria", _q(criteria={"a": "first <|im_end|>", "b": "second"}), "question", "criteria contains the reserved token"),
    ("empty_task", _set(task="  "), "task", "must be a non-empty string"),
    ("unknown_split", _set(split="holdout"), "split", "'train', 'dev', 'calibration' or 'test'"),
    ("unknown_field", _set(colour="red"), "colour", "Extra inputs are not permitted"),
]


def _broken(mutate):
    record = copy.deepcopy(GOOD)
    mutate(record)
    return record


def test_good_record_passes():
    assert parse_record(copy.deepcopy(GOOD)).target == [0.25, 0.75]


@pytest.mark.parametrize("name,mutate,field,rule", CASES, ids=[c[0] for c in CASES])
def test_rejection_names_row_field_and_rule(name, mutate, field, rule):
    with pytest.raises(RecordError) as info:
        parse_record(_broken(mutate))
    assert info.value.row == "row-7"
    assert info.value.field == field
    message = str(info.value)
    assert "row-7" in message and repr(field) in message and rule in message


@pytest.mark.parametrize("name,mutate,field,rule", CASES, ids=[c[0] for c in CASES])
def test_prepare_excludes_with_the_same_message(tmp_path, name, mutate, field, rule):
    lines = [json.dumps({**GOOD, "id": "ok-1", "state": "other"}), json.dumps(_broken(mutate), allow_nan=True)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    manifest = prepare([tmp_path / "in.jsonl"], tmp_path / "out")
    excluded = [json.loads(x) for x in (tmp_path / "out" / "excluded.jsonl").read_text().splitlines()]
    assert manifest["read"] == 2 and manifest["used"] == 1
    assert [e["reason"] for e in excluded] == ["invalid"]
    assert excluded[0]["row"] == "row-7" and excluded[0]["source_file"].endswith("in.jsonl")
    assert rule in excluded[0]["detail"] and "row-7" in excluded[0]["detail"]


def test_non_object_line_names_file_and_line(tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps(GOOD) + "\n[1, 2]\n")
    prepare([tmp_path / "in.jsonl"], tmp_path / "out")
    (excl,) = [json.loads(x) for x in (tmp_path / "out" / "excluded.jsonl").read_text().splitlines()]
    assert excl["reason"] == "invalid" and "in.jsonl:2" in excl["detail"] and "must be a JSON object" in excl["detail"]


def test_target_is_renormalised_within_tolerance():
    record = parse_record({**copy.deepcopy(GOOD), "target": [0.25, 0.75004]})
    assert math.isclose(sum(record.target), 1.0, abs_tol=1e-12)


def test_renormalised_target_reads_back_unchanged():
    """Found by tests/test_properties.py: dividing by the sum a second time moved entries by an ulp, so a record
    read back from its own JSON (prepare writes, train reads) differed from it, and [0.01, 0.3, 0.69] (fsum
    0.9999999999999999) was stored as [0.010000000000000002, ...]. A vector summing to 1 to rounding is kept."""
    three = {**copy.deepcopy(GOOD), "question": {"type": "score", "criteria": ["lo", "mid", "hi"]}}
    assert parse_record({**three, "target": [0.01, 0.3, 0.69]}).target == [0.01, 0.3, 0.69]
    record = parse_record({**three, "target": [0.01 * 1.00003, 0.3 * 1.00003, 0.69 * 1.00003]})
    assert math.isclose(math.fsum(record.target), 1.0, abs_tol=1e-15)
    assert parse_record(json.loads(record.model_dump_json())) == record
