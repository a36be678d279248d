"""The known-posterior generator: deterministic, and every posterior matches an independent
recomputation from the formulas in the module docstring (features read back from the state text)."""

import math

import numpy as np
import pytest

from rlcd.data import synth
from rlcd.data.synth import generate


@pytest.fixture(scope="module")
def records():
    return generate(96, seed=11)


def _cases(records):
    cases = {}
    for r in records:
        cases.setdefault(r.case_id, []).append(r)
    return cases


def _one_keyword(text, table):
    hits = [i for i, kws in enumerate(table) if any(kw in text for kw in kws)]
    assert len(hits) <= 1, (text, hits)
    return hits[0] if hits else None


def _level(text, table):
    (hit,) = [lv for lv, phrases in enumerate(table) if any(p in text for p in phrases)]
    return hit


def _softmax(z):
    e = [math.exp(x - max(z)) for x in z]
    return [x / sum(e) for x in e]


def _score(mu, levels):
    mu = min(max(mu, 0), levels - 1)
    return _softmax([-2.0 * (lv - mu) ** 2 for lv in range(levels)])


def _subset(record, labels, t, s):
    idx = [labels.index(label) for label in record.question.labels]
    assert t in idx and idx == sorted(idx)
    return _softmax([3.5 * (j == t) + 1.5 * (j == s) for j in idx])


def _support_truth(lang, state, rec):
    t = _one_keyword(state["subject"], synth.TOPIC_KEYWORDS[lang])
    s = _one_keyword(state["message"], synth.TOPIC_KEYWORDS[lang])
    u = _level(state["message"], synth.TONES[lang])
    tier = synth.TIERS[lang].index(state["customer_tier"])
    sla, n = int(state["sla_breached"]), state["open_tickets"]
    assert t is not None and s != t
    return {
        "topic": _subset(rec["topic"], synth.TOPICS[lang], t, s),
        "queue": _softmax([2, 4 * sla, 4 * (tier == 2), 4 * (u == 2)]),
        "escalate": _softmax([0, -2.5 + 3 * sla + 2 * (tier == 2) + 2 * (u == 2)]),
        "recontact": _softmax([0, -2 + n + 1.5 * (u >= 1)]),
        "urgency": _score(sla + (u >= 1) + (u == 2) + (tier == 2), 4),
        "effort": _score((t in (4, 5, 9, 10)) + (s is not None), 3),
    }


def _invoice_truth(lang, state, rec):
    t = _one_keyword(state["description"], synth.CATEGORY_KEYWORDS[lang])
    s = _one_keyword(state["note"], synth.CATEGORY_KEYWORDS[lang])
    u = _level(state["note"], synth.TERMS[lang])
    band = synth.BANDS[lang].index(state["amount_band"])
    lo, hi = ((20, 500), (500, 5000), (5000, 50000))[band]
    assert lo <= state["amount"] <= hi
    dup, po, n = int(state["duplicate_suspected"]), int(state["purchase_order"]), state["line_items"]
    new = int(state["vendor_status"] == synth.VENDOR_STATUS[lang][1])
    assert t is not None and s != t
    return {
        "category": _subset(rec["category"], synth.CATEGORIES[lang], t, s),
        "approver": _softmax([3.0 * (j == band) for j in range(3)]),
        "hold": _softmax([0, -3 + 4 * dup + 2 * new + 2 * (1 - po)]),
        "due_soon": _softmax([0, -2.5 + 2.5 * u]),
        "fraud_risk": _score(2 * dup + new + (1 - po) + (band == 2), 5),
        "priority": _score(2 * u + (band == 2) + (n >= 4), 6),
    }


def test_posteriors_match_independent_recomputation(records):
    for case in _cases(records).values():
        first = case[0]
        rec = {r.id.split(":")[1]: r for r in case}
        truth = (_support_truth if first.task == "support-triage" else _invoice_truth)(first.language, first.state, rec)
        assert set(truth) == set(rec)
        for qid, expected in truth.items():
            assert rec[qid].posterior == pytest.approx(expected, abs=1e-9), (first.case_id, qid)
            assert rec[qid].target == rec[qid].posterior


def test_deterministic_and_prefix_stable(records):
    again = generate(96, seed=11)
    assert [r.model_dump() for r in again] == [r.model_dump() for r in records]
    prefix = generate(10, seed=11)
    assert [r.model_dump() for r in prefix] == [r.model_dump() for r in records[: len(prefix)]]
    other = generate(10, seed=12)
    assert [r.state for r in other] != [r.state for r in prefix]


def test_shape_groups_types_and_ids(records):
    assert len({r.id for r in records}) == len(records)
    assert {r.group for r in records} == {f"synth/{lang}/{wf}" for lang in synth.LANGUAGES for wf in synth.WORKFLOWS}
    cases = _cases(records)
    for case_id, case in cases.items():
        assert {r.question.type for r in case} == {"choice", "noul", "score"}
        assert all(r.state == case[0].state and r.id.startswith(case_id + ":") for r in case)
        assert len({(r.language, r.task) for r in case}) == 1
    choice_k = {r.question.k for r in records if r.id.endswith((":topic", ":category"))}
    assert min(choice_k) == 2 and max(choice_k) == 12
    assert {r.question.k for r in records if r.question.type == "score"} == {3, 4, 5, 6}
    assert any(isinstance(r.question.criteria, dict) for r in records if r.question.type == "choice")


def test_posteriors_are_peaked_but_not_certain(records):
    best = [max(r.posterior) for r in records]
    assert 0.7 <= float(np.mean(best)) <= 0.9
    assert max(best) < 1.0


def test_layout_does_not_depend_on_the_answer(records):
    """Same keys in the same order per workflow, and every text slot always filled."""
    for wf in synth.WORKFLOWS:
        states = [r.state for r in records if r.task == wf]
        assert len({tuple(s) for s in states}) == 1
        for s in states:
            assert all(v not in ("", None) for v in s.values())
    for r in records:
        if r.task == "support-triage":
            assert sum(p in r.state["message"] for lv in synth.TONES[r.language] for p in lv) == 1


def test_votes_keep_states_and_posteriors(records):
    voted = generate(96, seed=11, votes=3)
    for a, b in zip(voted, records):
        assert a.state == b.state and a.posterior == b.posterior
        assert all(math.isclose(x * 3, round(x * 3), abs_tol=1e-9) for x in a.target)
    assert any(a.target != b.target for a, b in zip(voted, records))


def test_vote_target_is_unbiased():
    rng = np.random.default_rng(0)
    p = [0.6, 0.3, 0.1]
    mean = np.mean([synth.vote_target(p, 3, rng) for _ in range(6000)], axis=0)
    assert mean == pytest.approx(p, abs=0.02)
