"""The order probe per question type (issue 46): choice orders (all for K <= 4, a seeded sample above), score
levels reversed, noul wording swapped (the complement rule), order votes against an independent float64
computation, case-bootstrap intervals, "not probed" bookkeeping, case-batched scoring, and the report's
"Order-fragile questions" section."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rlcd.analysis.probes import PROBE_CASE, candidate_permutations, permute_record, probe_order_scores
from rlcd.order_votes import vote_orders
from rlcd.schema import Question, Record

VALUE = {"a": 1.0, "b": 0.4, "c": 0.0, "d": -0.3, "e": -0.5, "f": -0.8,
         "low": 0.0, "mid": 1.0, "high": 2.5, "fine": 0.0, "bad": 1.2}


def _rec(rid, qtype, criteria=None, instructions="q", case_id=None):
    q = Question(type=qtype, instructions=instructions, criteria=criteria)
    return Record(id=rid, source="t", task="t", state=f"state {case_id or rid}", question=q,
                  target=[1.0 / q.k] * q.k, case_id=case_id)


def biased(bias: float):
    """Logit of candidate j = VALUE of what it shows (choice label / score or noul description) + `bias` at j = 0.

    noul: the true logit is the value of the true description minus the false one's (a wording-consistent model)."""
    def score(records):
        out = []
        for r in records:
            q = r.question
            if q.type == "noul":
                d = q.descriptions()
                z = [0.0, VALUE[d[1]] - VALUE[d[0]]]
            else:
                z = [VALUE[x] for x in (q.labels if q.type == "choice" else q.descriptions())]
            z[0] += bias
            out.append(z)
        return out
    return score


def _softmax(z):
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


# ----------------------------------------------------------------------------------------------
# orders


def test_permutation_sets_all_up_to_four_sampled_above():
    for k, n in ((2, 1), (3, 5), (4, 23)):
        perms = candidate_permutations(k, max_perms=1)  # K <= 4: all K! - 1, whatever max_perms
        assert len(perms) == n == math.factorial(k) - 1
        assert len({tuple(p) for _, p in perms}) == n and all(p != list(range(k)) for _, p in perms)
    six = candidate_permutations(6, max_perms=8, seed=3)
    assert len(six) == 8 and six[0] == ("reversal", [5, 4, 3, 2, 1, 0])
    assert len({tuple(p) for _, p in six}) == 8 and all(sorted(p) == list(range(6)) != p for _, p in six)
    assert candidate_permutations(6, max_perms=8, seed=3) == six  # reproducible
    assert candidate_permutations(6, max_perms=8, seed=4) != six
    assert len(candidate_permutations(5, max_perms=200)) == 119  # K! - 1 <= max_perms: all of them


def test_permute_record_moves_descriptions_of_score_and_noul():
    s = permute_record(_rec("s", "score", ["low", "mid", "high"]), [2, 1, 0])
    assert s.question.criteria == ["high", "mid", "low"] and s.question.labels == ["0", "1", "2"]
    n = permute_record(_rec("n", "noul", {"false": "fine", "true": "bad"}), [1, 0])
    assert n.question.criteria == {"false": "bad", "true": "fine"}


# ----------------------------------------------------------------------------------------------
# exact flip counts per type


def test_choice_flips_exactly_when_the_bias_beats_the_label_gap():
    recs = [_rec("c3", "choice", ["a", "b", "c"]), _rec("c4", "choice", ["a", "b", "c", "d"])]
    # bias 5 at position 0: an order flips iff it puts another label first: (K-1)/K of all K! orders
    res = probe_order_scores(biased(5.0), recs, votes=[1])
    n_flips = {r["id"]: r["n_flips"] for r in res["rows"]}
    assert n_flips == {"c3": 4, "c4": 18}  # 6 - 2 and 24 - 6 orders put another label first
    assert res["per_type"]["choice"]["flip_rate"] == pytest.approx(22 / 28)
    # bias 0.5 < gap a-b (0.6): never a flip; bias 0.8: "b" first wins (0.4 + 0.8 > 1.0), others do not
    assert probe_order_scores(biased(0.5), recs, votes=[1])["per_type"]["choice"]["flip_rate"] == 0.0
    res = probe_order_scores(biased(0.8), recs, votes=[1])
    assert {r["id"]: r["n_flips"] for r in res["rows"]} == {"c3": 2, "c4": 6}  # orders with "b" first: 2 and 6


def test_score_reversed_levels_map_back():
    recs = [_rec(f"s{i}", "score", ["low", "mid", "high"]) for i in range(3)]
    # bias 1: original top "high" (2.5 vs 1.0); reversed "high" at 0 gets 3.5: still level 2 -> no flip
    res = probe_order_scores(biased(1.0), recs)
    assert res["per_type"]["score"]["flip_rate"] == 0.0 and res["per_type"]["score"]["mean_tv"] > 0
    # bias 3: original top level 0 (3.0 > 2.5); reversed: slot 0 shows "high" -> level 2: a flip
    res = probe_order_scores(biased(3.0), recs)
    score = res["per_type"]["score"]
    assert score["n_comparisons"] == 3 and score["flip_rate"] == 1.0
    assert {r["top"] for r in res["rows"]} == {"0"}
    assert {c["top"] for r in res["rows"] for c in r["comparisons"]} == {"2"}
    # a description-blind scorer with symmetric logits is a tie under both: no flip
    flat = probe_order_scores(lambda rs: [[0.0] * r.question.k for r in rs], recs)
    assert flat["per_type"]["score"]["flip_rate"] == 0.0


def test_noul_complement_rule():
    recs = [_rec("n1", "noul", {"false": "fine", "true": "bad"}), _rec("n2", "noul", {"false": "bad", "true": "fine"})]
    # a wording-consistent model answers the swapped question with the complement: no flip, TV 0
    res = probe_order_scores(biased(0.0), recs)
    assert res["per_type"]["noul"]["flip_rate"] == 0.0 and res["per_type"]["noul"]["max_tv"] < 1e-12

    def says_true(p_true):
        return lambda rs: [[0.0, math.log(p_true / (1 - p_true))] for _ in rs]

    # always P(true) = 0.8: swapped, the complement would be 0.2; 1 - P'(true) = 0.2 -> the decision does not invert
    res = probe_order_scores(says_true(0.8), recs)
    assert res["per_type"]["noul"]["flip_rate"] == 1.0
    assert all(c["tv"] == pytest.approx(0.6) and c["top"] == "false" for r in res["rows"] for c in r["comparisons"])
    # P(true) = 0.5 exactly: a tie, never a flip
    assert probe_order_scores(says_true(0.5), recs)["per_type"]["noul"]["flip_rate"] == 0.0
    # bias 2 toward "false" on top of the wording: n1 P(true) = s(1.2 - 2) < .5; swapped s(-1.2 - 2) -> 1-P' > .5: flip
    res = probe_order_scores(biased(2.0), recs)
    assert {r["id"]: r["n_flips"] for r in res["rows"]} == {"n1": 1, "n2": 1}


def test_not_probed_counts_add_up_with_reasons():
    recs = [_rec("n0", "noul"), _rec("n1", "noul", {"true": "bad"}),
            _rec("n2", "noul", {"false": "bad", "true": "bad"}), _rec("n3", "noul", {"false": "fine", "true": "bad"}),
            _rec("c", "choice", ["a", "b"]), _rec("s", "score", ["low", "high"])]
    res = probe_order_scores(biased(0.0), recs)
    assert [(x["id"], x["type"]) for x in res["not_probed"]] == [("n0", "noul"), ("n1", "noul"), ("n2", "noul")]
    assert all(x["reason"] for x in res["not_probed"])
    assert res["counts"]["noul"]["reasons"] == {
        "noul criteria do not describe both false and true: no wording to swap": 2,
        "noul criteria describe false and true alike: swapping changes nothing": 1}
    for t, c in res["counts"].items():
        assert c["read"] == c["probed"] + c["not_probed"] == sum(r.question.type == t for r in recs)
        assert c["probed"] == res["per_type"][t]["n_rows"] and c["not_probed"] == res["per_type"][t]["n_not_probed"]
    assert len(res["rows"]) + len(res["not_probed"]) == res["n_records"] == len(recs)


# ----------------------------------------------------------------------------------------------
# order votes


def _independent_voted(z_of, perm, n, k, how="mean"):
    """float64 by hand: mean over vote orders v of softmax(z(asked order)) mapped back, asked = perm[v[j]]; logmean:
    the mean of the log-probabilities, renormalised."""
    acc = np.zeros(k)
    for v in vote_orders(k, n):
        asked = [perm[j] for j in v]
        p = _softmax(z_of(asked))
        back = np.zeros(k)
        for j, orig in enumerate(asked):
            back[orig] = p[j] if how == "mean" else np.log(p[j])
        acc += back
    acc /= len(vote_orders(k, n))
    return acc if how == "mean" else np.exp(acc) / np.exp(acc).sum()


@pytest.mark.parametrize("how", ["mean", "logmean"])
def test_votes_reduce_flips_and_match_an_independent_float64_computation(how):
    labels = ["a", "b", "c", "d", "e", "f"]
    recs = [_rec("c3", "choice", labels[:3]), _rec("c4", "choice", labels[:4]), _rec("c6", "choice", labels)]
    score = biased(0.8)
    res = probe_order_scores(score, recs, votes=[1, 2, 3], vote_combine=how)
    assert res["vote_combine"] == how
    ch = res["per_type"]["choice"]
    assert ch["votes"]["2"]["flip_rate"] < ch["flip_rate"] and ch["votes"]["3"]["flip_rate"] <= ch["flip_rate"]
    # K = 3 with 3 votes: a cyclic listing votes over the same three orders as the given one, so only the three
    # other listings (reversal, 0-2-1, 1-0-2) can flip
    row3 = [r for r in res["rows"] if r["id"] == "c3"][0]
    assert row3["n_flips_by_votes"]["3"] <= 3 and row3["n_flips_by_votes"]["1"] == 2
    if how == "logmean":  # all K = 3 cyclic shifts: the additive position bias cancels exactly, no listing flips
        assert row3["n_flips_by_votes"]["3"] == 0

    # the reported TV of each voted comparison equals the hand computation
    from rlcd.analysis.probes import _answer, _plan_item, _score_plan

    for rec in recs:
        k = rec.question.k

        def z_of(asked, rec=rec):
            return np.asarray([VALUE[rec.question.labels[i]] for i in asked]) + np.eye(k)[0] * 0.8

        items = [{**_plan_item(rec, 8, 0, [1, 2, 3]), "combine": how}]
        _score_plan(score, items)
        for name, perm in items[0]["perms"]:
            for n in (1, 2, 3):
                ref = _independent_voted(z_of, list(range(k)), n, k, how)
                got = _independent_voted(z_of, perm, n, k, how)
                assert _answer(items[0], list(range(k)), n, 1.0) == pytest.approx(ref, abs=1e-12)
                assert _answer(items[0], perm, n, 1.0) == pytest.approx(got, abs=1e-12)
        row = [r for r in res["rows"] if r["id"] == rec.id][0]
        for c, (name, perm) in zip(row["comparisons"], items[0]["perms"]):
            assert c["perm"] == name
            ref, got = _softmax(z_of(list(range(k)))), np.zeros(k)
            got[perm] = _softmax(z_of(perm))
            assert c["tv"] == pytest.approx(0.5 * np.abs(got - ref).sum(), abs=1e-12)


def test_every_order_of_a_case_is_scored_in_one_call_and_shares_its_case():
    calls = []
    score = biased(1.0)

    def recording(records):
        calls.append([(r.id, r.case_id, r.state) for r in records])
        return score(records)

    recs = [_rec("x:q1", "choice", ["a", "b", "c"], case_id="x"), _rec("x:q2", "score", ["low", "high"], case_id="x"),
            _rec("lone", "choice", ["a", "b"])]
    probe_order_scores(recording, recs, votes=[1, 2])
    (call,) = calls
    assert len(call) == 6 + 2 + 2  # K = 3: identity + 5 orders (votes add none); score 2; K = 2: 2
    assert {c for i, c, _ in call if i.startswith("x:")} == {"x"}
    assert {c for i, c, _ in call if i.startswith("lone")} == {PROBE_CASE + "lone"}
    assert len({i for i, _, _ in call}) == len(call)


# ----------------------------------------------------------------------------------------------
# intervals


def test_interval_holds_the_estimate_and_is_reproducible():
    recs = []
    for i in range(30):  # two questions per case; the bias 0.8 beats the top gap of a, b (0.6), not of a, c (1.0)
        recs += [_rec(f"k{i}:q1", "choice", ["a", "b", "c"] if i % 3 else ["a", "c", "d"], case_id=f"k{i}"),
                 _rec(f"k{i}:q2", "score", ["low", "mid", "high"], case_id=f"k{i}")]
    res = probe_order_scores(biased(0.8), recs, resamples=500, seed=7)
    for t in ("choice", "score"):
        b = res["per_type"][t]
        assert b["n_cases"] == 30 and b["n_rows"] == 30
        lo, hi = b["flip_rate95"]
        assert lo <= b["flip_rate"] <= hi
    again = probe_order_scores(biased(0.8), recs, resamples=500, seed=7)
    assert again["per_type"]["choice"]["flip_rate95"] == res["per_type"]["choice"]["flip_rate95"]
    assert again["questions"] == res["questions"]
    assert 0.0 < res["per_type"]["choice"]["flip_rate95"][0] < res["per_type"]["choice"]["flip_rate95"][1] < 1.0
    # the interval is the 2.5/97.5 % quantiles of the case bootstrap of the per-comparison flips
    from rlcd.bootstrap import bootstrap_means

    flips = [float(c["flip"]) for r in res["rows"] if r["type"] == "choice" for c in r["comparisons"]]
    cases = [r["case"] for r in res["rows"] if r["type"] == "choice" for _ in r["comparisons"]]
    boot = bootstrap_means(np.asarray(flips), resamples=500, seed=7, groups=np.asarray(cases))
    assert res["per_type"]["choice"]["flip_rate95"] == pytest.approx(list(np.quantile(boot, [0.025, 0.975])))
    # per K bucket and per question, each with its interval
    assert set(res["choice_per_k_bucket"]) == {"3-5"} and res["choice_per_k_bucket"]["3-5"]["flip_rate95"]
    q = res["questions"][0]
    assert {"instructions", "type", "flip_rate", "flip_rate95", "n_rows", "n_cases"} <= set(q)


# ----------------------------------------------------------------------------------------------
# report


def test_report_shows_the_order_fragile_questions(tmp_path):
    from test_report import make_run

    from rlcd.analysis.probes import write_json_atomic
    from rlcd.report import write_report

    run, *_ = make_run(tmp_path)
    text = write_report(run).read_text()
    assert "## Order-fragile questions" in text and "`rlcd probe order" in text
    recs = [_rec(f"k{i}:q1", "choice", ["a", "b", "c"], instructions="Which colour is it?", case_id=f"k{i}")
            for i in range(6)] + [_rec(f"k{i}:q2", "noul", {"false": "fine", "true": "bad"},
                                       instructions="Is it broken?", case_id=f"k{i}") for i in range(6)]
    res = probe_order_scores(biased(0.8), recs, resamples=200)
    write_json_atomic(run / "eval" / "probe-order.json", {**res, "split": "test"})
    text = write_report(run).read_text()
    section = text[text.index("## Order-fragile questions"):]
    section = section[:section.index("\n## ", 5)]
    assert "| Which colour is it? | choice |" in section and "flip rate [95% CI]" in section
    assert "2 votes" in section and "Is it broken?" not in section  # the noul never flips: not listed
    html = (run / "eval" / "report.html").read_text()
    assert "Order-fragile questions" in html and "Which colour is it?" in html
    assert "scored other weights" not in text
    write_json_atomic(run / "eval" / "probe-order.json", {**res, "checkpoint_sha256": "00" * 32})  # another model
    assert "scored other weights than this evaluation" in write_report(run).read_text()
