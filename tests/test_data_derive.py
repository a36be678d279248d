"""Derived question forms: every target (and posterior) against an independent float64 computation from the base
distribution, the accounting, the manifest, and bad input refused in one line."""

import json

import numpy as np
import pytest

from rlcd.data import derive, synth
from rlcd.data.derive import FORMS, derive_records, parse_forms
from rlcd.data.io import load_split, write_jsonl
from rlcd.schema import Record, parse_record
from conftest import user_error


def expected(form: str, meta: dict, p: list[float]) -> np.ndarray:
    """The exact derived distribution written out per form from its meaning (not from `cells`)."""
    p = np.asarray(p, dtype=np.float64)
    k = p.size
    if form in ("noul_as_choice", "negated", "noul_swapped"):
        return np.array([p[1], p[0]])
    if form in ("noul_as_score", "binary_as_noul"):
        return p.copy()
    if form == "is_option":
        o = meta["option"]
        return np.array([1.0 - p[o], p[o]])
    if form == "not_option":
        o = meta["option"]
        return np.array([p[o], 1.0 - p[o]])
    if form == "not_level":
        lv = meta["level"]
        return np.array([p[lv], 1.0 - p[lv]])
    if form == "tail":
        lv = meta["level"]
        upper = sum(p[i] for i in range(k) if i >= lv)
        return np.array([1.0 - upper, upper])
    if form == "merge_two":
        a, b = meta["options"]
        out = [p[i] + (p[b] if i == a else 0.0) for i in range(k) if i != b]
        return np.array(out)
    if form == "merge_levels":
        a, b = meta["levels"]
        assert b == a + 1
        return np.array([p[i] + (p[b] if i == a else 0.0) for i in range(k) if i != b])
    if form == "blocks":
        blocks = meta["blocks"]
        assert sorted(i for blk in blocks for i in blk) == list(range(k))  # a partition
        return np.array([sum(p[i] for i in blk) for blk in blocks])
    if form == "catch_all":
        o = meta["option"]
        return np.array([p[i] for i in range(k) if i != o] + [p[o]])
    if form == "removed":
        o = meta["option"]
        return np.array([p[i] / (1.0 - p[o]) for i in range(k) if i != o])
    if form == "added":
        out = list(p)
        out.insert(meta["position"], 0.0)  # an unrelated option: mass 0, the rest unchanged
        return np.array(out)
    if form == "levels_reversed":
        return p[::-1].copy()
    raise AssertionError(form)


@pytest.fixture(scope="module")
def derived():
    base = synth.generate(24, seed=5) + synth.generate(8, seed=6, votes=3)
    base.append(_record(id="c9:two", case_id="c9", question={"type": "score", "criteria": ["low", "high"]},
                        target=[0.25, 0.75], posterior=[0.2, 0.8]))
    rows, excluded = derive_records(base, parse_forms("all", reorder=True))
    return base, rows, excluded


def test_every_target_and_posterior_matches_an_independent_computation(derived):
    base, rows, _ = derived
    by_id = {r.id: r for r in base}
    seen = set()
    for r in rows:
        if r.derived is None:
            continue
        form, b = r.derived["form"], by_id[r.derived["base"]]
        seen.add(form)
        assert r.derived["family"] == FORMS[form]
        np.testing.assert_allclose(r.target, expected(form, r.derived, b.target), rtol=0, atol=1e-12)
        np.testing.assert_allclose(r.posterior, expected(form, r.derived, b.posterior), rtol=0, atol=1e-12)
        assert len(r.target) == r.question.k
        # same state, split, case, group: isolation and the case bootstrap see one case
        assert (r.state, r.split, r.case_id, r.group, r.language) == (b.state, b.split, b.case_id, b.group, b.language)
    assert seen == set(FORMS)


def test_question_types_and_labels_follow_the_form(derived):
    base, rows, _ = derived
    by_id = {r.id: r for r in base}
    for r in rows:
        if r.derived is None:
            continue
        form, b = r.derived["form"], by_id[r.derived["base"]]
        want = {"noul_as_choice": "choice", "noul_as_score": "score", "levels_reversed": "score",
                "merge_levels": "score"}.get(form, "noul" if form in ("negated", "is_option", "not_option", "tail",
                                                                          "not_level", "noul_swapped", "binary_as_noul")
                                             else "choice")
        assert r.question.type == want, form
        if form == "catch_all":
            assert r.question.labels[:-1] == [lab for i, lab in enumerate(b.question.labels) if i != r.derived["option"]]
        if form == "added":
            assert r.question.labels[r.derived["position"]] not in b.question.labels
        if form == "removed":
            assert b.question.labels[r.derived["option"]] not in r.question.labels
        if form == "levels_reversed":
            assert r.question.criteria == b.question.criteria[::-1]


def test_deriving_is_a_pure_function_of_the_row(derived):
    base, rows, _ = derived
    again, _ = derive_records(base, parse_forms("all", reorder=True))
    assert [r.model_dump(mode="json") for r in again] == [r.model_dump(mode="json") for r in rows]
    alone, _ = derive_records([base[3]], parse_forms("all", reorder=True))
    assert [r.id for r in alone] == [r.id for r in rows if r.id == base[3].id or r.id.startswith(base[3].id + "~")]


def test_german_rows_get_german_wording(derived):
    _, rows, _ = derived
    de = [r for r in rows if r.derived and r.language == "de" and r.derived["form"] == "is_option"]
    en = [r for r in rows if r.derived and r.language == "en" and r.derived["form"] == "is_option"]
    assert de and en
    assert all("Antwort" in r.question.instructions or "wählen" in r.question.instructions
               or "Option" in r.question.instructions for r in de)
    assert not any("answer" in r.question.instructions or "pick" in r.question.instructions for r in de)


def _record(**kw) -> Record:
    obj = {"id": "c1:q", "source": "s", "task": "t", "state": {"x": 1}, "case_id": "c1",
           "question": {"type": "choice", "criteria": ["a", "b", "c"]}, "target": [1.0, 0.0, 0.0]}
    obj.update(kw)
    return parse_record(obj)


def test_removing_the_option_with_all_the_mass_is_excluded_with_its_reason():
    r = _record()
    rows, excluded = derive_records([r], ["removed"], per_option=3)
    written = [x for x in rows if x.derived]
    assert len(written) + len(excluded) == 3  # every instance asked is written or excluded
    assert [e["reason"] for e in excluded] == ["removed_all_mass"]
    assert "'a'" in excluded[0]["detail"]
    for x in written:  # the kept renormalisations: p_j / (1 - p_o) with p_o = 0
        assert x.target == [1.0, 0.0]


def test_undescribed_noul_has_no_wording_to_swap():
    r = _record(question={"type": "noul", "instructions": "Is it?"}, target=[0.3, 0.7])
    rows, excluded = derive_records([r], ["noul_swapped", "negated"])
    assert [e["reason"] for e in excluded] == ["undescribed_noul"]
    (neg,) = [x for x in rows if x.derived]
    assert neg.target == [0.7, 0.3]


def test_a_derived_row_is_not_derived_again():
    r = _record(question={"type": "noul", "instructions": "Is it?"}, target=[0.3, 0.7])
    rows, _ = derive_records([r], ["negated"])
    with pytest.raises(Exception, match="already a derived row"):
        derive_records([rows[1]], ["negated"])


def test_original_rows_keep_their_json(derived):
    base, _, _ = derived
    assert "derived" not in base[0].model_dump(mode="json")


def test_derive_dir_keeps_splits_and_counts_every_row(tmp_path):
    from rlcd.data.prepare import prepare

    write_jsonl(tmp_path / "s.jsonl", synth.generate(30, seed=2))
    prepare([tmp_path / "s.jsonl"], tmp_path / "p", seed=2)
    m = derive.derive_dir(tmp_path / "p", tmp_path / "d", parse_forms(None))
    d = m["derive"]
    assert d["base_written"] == d["base_rows"] == 180
    assert d["instances"] == d["derived_written"] + d["excluded"]
    total = 0
    for split in ("train", "dev", "calibration", "test"):
        base = load_split(tmp_path / "p", split)
        rows = load_split(tmp_path / "d", split)
        assert [r.id for r in rows if r.derived is None] == [r.id for r in base]
        assert all(r.split == split for r in rows)
        derived_rows = [r for r in rows if r.derived]
        assert sum(c[split] for c in d["per_form"].values()) == len(derived_rows)
        assert m["splits"][split] == len(rows)
        base_split = {r.id: r.split for r in base}
        assert all(base_split[r.derived["base"]] == split for r in derived_rows)
        total += len(derived_rows)
    assert total == d["derived_written"]
    assert "levels_reversed" not in d["per_form"]  # the order family only with --reorder
    assert json.loads((tmp_path / "d" / "manifest.json").read_text())["derive"]["forms"] == list(parse_forms(None))


def test_cli_derive_and_its_refusals(tmp_path):
    from typer.testing import CliRunner

    from rlcd.cli import app
    from rlcd.data.prepare import prepare

    write_jsonl(tmp_path / "s.jsonl", synth.generate(6, seed=2))
    prepare([tmp_path / "s.jsonl"], tmp_path / "p", seed=2)
    res = CliRunner().invoke(app, ["data", "derive", str(tmp_path / "p"), "--out", str(tmp_path / "d"),
                                   "--forms", "complement,tail", "--reorder"])
    assert res.exit_code == 0, res.output
    forms = json.loads((tmp_path / "d" / "manifest.json").read_text())["derive"]["forms"]
    assert forms == ["negated", "not_option", "not_level", "tail", "levels_reversed", "noul_swapped"]
    user_error(["data", "derive", tmp_path / "p", "--out", tmp_path / "d"], contains="not empty")
    user_error(["data", "derive", tmp_path / "d", "--out", tmp_path / "e"], contains="already holds derived rows")
    user_error(["data", "derive", tmp_path / "p", "--out", tmp_path / "e", "--forms", "nope"], contains="--forms nope")
    user_error(["data", "derive", tmp_path / "missing", "--out", tmp_path / "e"], contains="not a processed data")
    user_error(["data", "derive", tmp_path / "p", "--out", tmp_path / "e", "--per-option", "0"], contains="--per-option")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "train.jsonl").write_text('{"id": "x"}\n')
    user_error(["data", "derive", tmp_path / "bad", "--out", tmp_path / "e"], contains="row 'x': field 'source'")
    assert not (tmp_path / "e").exists()  # nothing written before the inputs are checked


def test_synth_forms_derived_writes_base_and_derived_rows(tmp_path):
    from typer.testing import CliRunner

    from rlcd.cli import app
    from rlcd.data.io import load_records

    res = CliRunner().invoke(app, ["data", "synth", "--out", str(tmp_path / "s.jsonl"), "--cases", "4",
                                   "--forms", "derived"])
    assert res.exit_code == 0, res.output
    rows = load_records(tmp_path / "s.jsonl")
    base = [r for r in rows if r.derived is None]
    assert [r.id for r in base] == [r.id for r in synth.generate(4, 0)]
    assert {r.derived["family"] for r in rows if r.derived} == {"equivalence", "complement", "merge", "marginal",
                                                                "submenu"}
    # prepare keeps each derived row in its base row's split (one case, one isolation group)
    from rlcd.data.prepare import prepare

    m = prepare([tmp_path / "s.jsonl"], tmp_path / "p", seed=1, fractions=(0.5, 0.0, 0.0, 0.5))
    assert m["excluded"] == 0 and m["splits"]["test"] and m["splits"]["train"]
    for split in ("train", "test"):
        rows = load_split(tmp_path / "p", split)
        base = {r.id for r in rows if r.derived is None}
        assert all(r.derived["base"] in base for r in rows if r.derived)
    user_error(["data", "synth", "--out", tmp_path / "t.jsonl", "--forms", "x"], contains="--forms x")
