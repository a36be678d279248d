"""rlcd.metrics on hand-computed cases, and ECE cross-checked against torchmetrics."""

import json
import math
import random

import numpy as np
import pytest
import torch

from rlcd import metrics as M
from rlcd.schema import parse_record

torch.set_num_threads(1)


def row(rid, p, t, *, type_="noul", group="s/en/a", posterior=None, labels=None):
    """A prediction row whose raw logits are log p, so softmax(logits) == p."""
    k = len(p)
    return {"id": rid, "group": group, "type": type_, "labels": labels or [str(i) for i in range(k)],
            "target": list(t), "posterior": posterior, "logits": [math.log(x) for x in p]}


# ---------------------------------------------------------------------------------------------- binary


def test_binary_row_scores_by_hand():
    p, t = [0.25, 0.75], [0.4, 0.6]
    s = M.row_scores(p, t)
    assert s["accuracy"] == 1.0
    assert s["soft_accuracy"] == pytest.approx(0.6)
    assert s["nll"] == pytest.approx(0.4 * 1.3862943611 + 0.6 * 0.2876820725, abs=1e-9)  # -ln .25, -ln .75
    assert s["brier"] == pytest.approx(0.0225 + 0.0225)
    assert "rps" not in s
    # a wrong, over-confident row
    s = M.row_scores([0.9, 0.1], [0.3, 0.7])
    assert s["accuracy"] == 0.0 and s["soft_accuracy"] == pytest.approx(0.3)
    assert s["brier"] == pytest.approx(0.36 + 0.36)
    assert s["nll"] == pytest.approx(0.3 * 0.1053605157 + 0.7 * 2.302585093, abs=1e-9)
    # the 1e-12 floor keeps NLL finite
    assert M.nll([1.0, 0.0], [0.0, 1.0]) == pytest.approx(-math.log(1e-12))


def test_binary_aggregate_ece_by_hand():
    # conf .75 and .78 share bin 11 ([11/15, 12/15)); .9 is alone in bin 13.
    rows = [row("a", [0.25, 0.75], [0.4, 0.6]),   # correct, t[argmax p] = .6
            row("b", [0.22, 0.78], [0.8, 0.2]),   # wrong,   t[argmax p] = .2
            row("c", [0.9, 0.1], [0.3, 0.7])]     # wrong,   t[argmax p] = .3
    o = M.summarize(rows)["overall"]
    assert o["n"] == 3
    assert o["accuracy"] == pytest.approx(1 / 3)
    assert o["soft_accuracy"] == pytest.approx((0.6 + 0.2 + 0.3) / 3)
    # hard: bin 11 mean conf .765 vs acc .5; bin 13 .9 vs 0
    assert o["ece"] == pytest.approx(2 / 3 * 0.265 + 1 / 3 * 0.9)
    # target-referenced: bin 11 .765 vs .4; bin 13 .9 vs .3
    assert o["ece_target"] == pytest.approx(2 / 3 * 0.365 + 1 / 3 * 0.6)
    assert o["sharpness_gap"] == pytest.approx((0.75 + 0.78 + 0.9) / 3 - (0.6 + 0.8 + 0.7) / 3)
    rel = {b["lo"]: b for b in o["reliability"] if b["count"]}
    assert set(rel) == {11 / 15, 13 / 15}
    b11 = rel[11 / 15]
    assert (b11["count"], b11["confidence"], b11["accuracy"], b11["target_accuracy"]) == (
        2, pytest.approx(0.765), pytest.approx(0.5), pytest.approx(0.4))
    assert sum(b["count"] for b in o["reliability"]) == 3 and len(o["reliability"]) == 15


def test_temperature_applies_per_type():
    r = {"id": "a", "group": "g", "type": "noul", "labels": ["false", "true"], "target": [0.4, 0.6],
         "posterior": None, "logits": [0.0, math.log(3.0)]}
    s = M.summarize([r], {"noul": 2.0, "choice": 5.0})
    p1 = math.sqrt(3) / (1 + math.sqrt(3))  # softmax([0, ln3] / 2) = [1, sqrt 3] / (1 + sqrt 3)
    assert s["overall"]["nll"] == pytest.approx(-(0.4 * math.log(1 - p1) + 0.6 * math.log(p1)))
    assert s["overall"]["mean_confidence"] == pytest.approx(p1)
    # a temperature for another type leaves the row alone
    assert M.summarize([r], {"choice": 5.0})["overall"]["mean_confidence"] == pytest.approx(0.75)


# ---------------------------------------------------------------------------------------------- ordinal


def test_ordinal_row_scores_by_hand():
    p, t = [0.1, 0.2, 0.3, 0.4], [0.0, 0.6, 0.4, 0.0]
    s = M.row_scores(p, t, ordinal=True)
    assert s["accuracy"] == 0.0 and s["soft_accuracy"] == 0.0 and s["within_one"] == 0.0  # argmax 3 vs 1
    # cumulative p .1 .3 .6 vs t 0 .6 1.0 -> (.01 + .09 + .16) / 3
    assert s["rps"] == pytest.approx(0.26 / 3)
    assert s["level_mae"] == pytest.approx(abs(2.0 - 1.4))
    assert s["brier"] == pytest.approx(0.01 + 0.16 + 0.01 + 0.16)
    assert s["nll"] == pytest.approx(-(0.6 * math.log(0.2) + 0.4 * math.log(0.3)))
    s2 = M.row_scores([0.05, 0.15, 0.7, 0.1], t, ordinal=True)
    assert s2["within_one"] == 1.0 and s2["accuracy"] == 0.0
    assert s2["rps"] == pytest.approx((0.0025 + 0.16 + 0.01) / 3)
    assert s2["level_mae"] == pytest.approx(abs(1.85 - 1.4))
    # RPS extremes: perfect 0, all mass at the wrong end 1
    assert M.rps([0, 0, 1.0], [0, 0, 1.0]) == 0.0
    assert M.rps([1.0, 0, 0, 0], [0, 0, 0, 1.0]) == pytest.approx(1.0)


def test_ordinal_metrics_only_in_blocks_with_score_rows():
    t = [0.0, 0.6, 0.4, 0.0]
    rows = [row("s1", [0.1, 0.2, 0.3, 0.4], t, type_="score"), row("s2", [0.05, 0.15, 0.7, 0.1], t, type_="score"),
            row("n1", [0.25, 0.75], [0.4, 0.6], type_="noul")]
    s = M.summarize(rows)
    assert s["overall"]["n_score"] == 2
    assert s["overall"]["rps"] == pytest.approx((0.26 + 0.1725) / 6)
    assert s["overall"]["within_one"] == pytest.approx(0.5)
    assert s["per_type"]["score"]["level_mae"] == pytest.approx((0.6 + 0.45) / 2)
    assert "rps" not in s["per_type"]["noul"]


# ---------------------------------------------------------------------------------------------- posterior


def test_posterior_block_and_bayes_floor():
    p, t, q = [0.25, 0.75], [0.4, 0.6], [0.3, 0.7]
    rows = [row("a", p, t, posterior=q), row("b", [0.5, 0.5], [1.0, 0.0])]  # b has no posterior
    s = M.summarize(rows)
    post = s["overall"]["posterior"]
    assert post["n"] == 1
    model_nll = -(0.4 * math.log(0.25) + 0.6 * math.log(0.75))
    bayes = -(0.4 * math.log(0.3) + 0.6 * math.log(0.7))
    assert post["model_nll"] == pytest.approx(model_nll)
    assert post["bayes_nll"] == pytest.approx(bayes)
    assert post["bayes_gap"] == pytest.approx(model_nll - bayes)
    assert post["nll"] == pytest.approx(-(0.3 * math.log(0.25) + 0.7 * math.log(0.75)))  # vs the posterior
    assert post["brier"] == pytest.approx(0.05 ** 2 * 2)
    assert post["accuracy"] == 1.0 and post["soft_accuracy"] == pytest.approx(0.7)
    assert post["bayes_accuracy"] == 1.0
    assert "posterior" not in M.summarize([rows[1]])["overall"]


def test_the_uniform_answer_is_the_reference_for_the_bayes_gap():
    """uniform_gap: the gap of 1/K on each candidate, in float64 from the rows alone (the model's logits and
    temperatures do not enter it), so a calibrated gap can be read against it."""
    rows = [row("a", [0.25, 0.75], [0.4, 0.6], posterior=[0.3, 0.7]),
            row("b", [0.1, 0.2, 0.3, 0.4], [0.0, 1.0, 0.0, 0.0], type_="choice", posterior=[0.1, 0.6, 0.2, 0.1]),
            row("c", [0.5, 0.5], [1.0, 0.0])]  # no posterior: not counted
    uniform = (math.log(2) + math.log(4)) / 2  # -sum t log(1/K) = log K for a target summing to 1
    bayes = (-(0.4 * math.log(0.3) + 0.6 * math.log(0.7)) - math.log(0.6)) / 2
    for temps in (None, {"noul": 3.0}):
        post = M.summarize(rows, temps)["overall"]["posterior"]
        assert post["uniform_nll"] == pytest.approx(uniform, rel=1e-12)
        assert post["uniform_gap"] == pytest.approx(uniform - bayes, rel=1e-12)
    uniform_rows = [row(r["id"], [1.0 / len(r["target"])] * len(r["target"]), r["target"], type_=r["type"],
                        posterior=r["posterior"]) for r in rows]
    post = M.summarize(uniform_rows)["overall"]["posterior"]
    assert post["bayes_gap"] == pytest.approx(post["uniform_gap"], rel=1e-12), "equal logits score the uniform gap"


# ---------------------------------------------------------------------------------------------- torchmetrics


def test_ece_matches_torchmetrics_multiclass():
    from torchmetrics.classification import MulticlassCalibrationError

    rng = np.random.default_rng(3)
    n, k = 600, 4
    probs = rng.dirichlet(np.full(k, 0.7), size=n)
    labels = np.array([rng.choice(k, p=pr) if i % 3 else rng.integers(k) for i, pr in enumerate(probs)])
    assert probs.max() < 1 - 1e-6
    rows = [row(f"r{i}", probs[i], np.eye(k)[labels[i]], type_="choice") for i in range(n)]
    ours = M.summarize(rows)["overall"]["ece"]
    ref = MulticlassCalibrationError(num_classes=k, n_bins=15, norm="l1")(
        torch.tensor(probs, dtype=torch.float32), torch.tensor(labels))
    assert ours == pytest.approx(float(ref), abs=1e-5)
    assert ours > 0.01  # a non-trivial value, not 0 == 0


def test_ece_matches_torchmetrics_binary_on_mixed_k():
    from torchmetrics.classification import BinaryCalibrationError

    rng = np.random.default_rng(4)
    rows, conf, correct = [], [], []
    for i in range(400):
        k = int(rng.integers(2, 9))
        p = rng.dirichlet(np.ones(k) * 0.5)
        y = int(rng.integers(k)) if i % 2 else int(np.argmax(p))
        rows.append(row(f"r{i}", p, np.eye(k)[y], type_="choice"))
        conf.append(p.max())
        correct.append(int(np.argmax(p) == y))
    ours = M.summarize(rows)["overall"]["ece"]
    ref = BinaryCalibrationError(n_bins=15, norm="l1")(torch.tensor(conf, dtype=torch.float32),
                                                      torch.tensor(correct))
    assert ours == pytest.approx(float(ref), abs=1e-5)


# ---------------------------------------------------------------------------------------------- aggregates


def test_group_macro_buckets_and_types():
    rows = [row("a1", [0.2, 0.8], [0, 1.0], group="A"),                       # correct
            row("a2", [0.1, 0.2, 0.3, 0.4], [0, 0, 0, 1.0], group="A", type_="choice"),  # correct, K=4
            row("b1", [0.7, 0.3], [0, 1.0], group="B"),                       # wrong
            row("b2", [0.6] + [0.4 / 6] * 6, [0, 1.0, 0, 0, 0, 0, 0], group="B", type_="choice"),  # wrong, K=7
            row("b3", [0.5] + [0.5 / 11] * 11, [1.0] + [0] * 11, group="B", type_="score"),      # correct, K=12
            row("b4", [0.9, 0.1], [0, 1.0], group="B")]                       # wrong
    s = M.summarize(rows)
    assert s["overall"]["accuracy"] == pytest.approx(3 / 6)
    assert s["per_group"]["A"]["accuracy"] == 1.0 and s["per_group"]["B"]["accuracy"] == pytest.approx(0.25)
    assert s["group_macro"]["accuracy"] == pytest.approx((1.0 + 0.25) / 2)
    assert s["group_macro"]["n_groups"] == 2 and s["group_macro"]["n"] == 6
    assert s["group_macro"]["ece"] == pytest.approx((s["per_group"]["A"]["ece"] + s["per_group"]["B"]["ece"]) / 2)
    assert list(s["per_k_bucket"]) == ["2", "3-5", "6-10", "11+"]
    assert [s["per_k_bucket"][b]["n"] for b in ("2", "3-5", "6-10", "11+")] == [3, 1, 1, 1]
    assert list(s["per_type"]) == ["choice", "noul", "score"]
    for block in [s["overall"], *s["per_type"].values(), *s["per_group"].values(), *s["per_k_bucket"].values()]:
        for key in ("n", "accuracy", "soft_accuracy", "nll", "brier", "ece", "ece_target", "sharpness_gap"):
            assert key in block, key
    assert M.k_bucket(2) == "2" and M.k_bucket(5) == "3-5" and M.k_bucket(6) == "6-10" and M.k_bucket(11) == "11+"


def test_summarize_is_deterministic_and_order_free():
    rng = np.random.default_rng(5)
    rows = []
    for i in range(60):
        k = int(rng.integers(2, 6))
        t = rng.dirichlet(np.ones(k))
        rows.append({"id": f"r{i:03d}", "group": f"s/en/{i % 3}", "type": ["choice", "noul", "score"][i % 3] if k == 2
                     else ["choice", "score"][i % 2], "labels": [str(j) for j in range(k)], "target": t.tolist(),
                     "posterior": t.tolist() if i % 4 == 0 else None, "logits": rng.normal(size=k).tolist()})
    temps = {"choice": 1.3, "noul": 0.7, "score": 2.0}
    a = M.dumps(M.summarize(rows, temps))
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    assert M.dumps(M.summarize(shuffled, temps)) == a
    assert M.dumps(M.summarize(json.loads(json.dumps(rows)), temps)) == a
    assert M.dumps(M.summarize(rows)) != a  # the temperatures do matter


def test_coverage_risk_by_hand():
    rows = [row("a", [0.1, 0.9], [0, 1.0]), row("b", [0.8, 0.2], [0, 1.0]),
            row("c", [0.3, 0.7], [0, 1.0]), row("d", [0.4, 0.6], [1.0, 0])]
    cov, risk = M.coverage_risk(rows, None)
    assert cov.tolist() == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert risk.tolist() == pytest.approx([0.0, 0.5, 1 / 3, 0.5])
    # tied confidences are kept or dropped together: one point
    cov, risk = M.risk_curve([0.9, 0.9, 0.5], [1, 0, 1])
    assert cov.tolist() == pytest.approx([2 / 3, 1.0]) and risk.tolist() == pytest.approx([0.5, 1 / 3])
    # temperatures change confidences per type and so the order across types
    r2 = [row("n", [0.2, 0.8], [0, 1.0]), row("c", [0.1, 0.15, 0.75], [1.0, 0, 0], type_="choice")]
    assert M.coverage_risk(r2, None)[1].tolist() == pytest.approx([0.0, 0.5])
    assert M.coverage_risk(r2, {"noul": 10.0})[1].tolist() == pytest.approx([1.0, 0.5])


# ---------------------------------------------------------------------------------------------- baseline


def test_majority_baseline_by_hand():
    def tr(i, instr, y, group="g"):
        return {"id": f"t{i}", "group": group, "labels": ["x", "y"], "instructions": instr,
                "target": [1.0, 0.0] if y == "x" else [0.0, 1.0]}

    train = [tr(1, "A", "x"), tr(2, "A", "x"), tr(3, "A", "y"), tr(4, "B", "y"), tr(5, "B", "y"),
             {"id": "t6", "group": "g", "labels": ["x", "y"], "question": {"instructions": "C2"},
              "target": [0.9, 0.1]}]
    test = [tr(10, "A", "x"), tr(11, "A", "y"), tr(12, "B", "y"), tr(13, "NEW", "x"), tr(14, "NEW", "y", group="h")]
    mb = M.majority_baseline(train, test)
    # A -> x (2:1): right, wrong; B -> y: right; NEW unseen -> group g majority x (3 x : 2 y): right;
    # group h unseen -> first candidate x: wrong
    assert mb["accuracy"] == pytest.approx(3 / 5)
    assert mb["n"] == 5 and mb["n_fallback_group"] == 1 and mb["n_fallback_first"] == 1
    assert mb["per_group"] == {"g": pytest.approx(0.75), "h": 0.0}
    assert mb["group_macro_accuracy"] == pytest.approx(0.375)


def test_majority_baseline_accepts_records_and_dict_instructions():
    def rec(i, instr, target):
        return parse_record({"id": f"r{i}", "source": "s", "task": "t", "state": "x",
                             "question": {"type": "choice", "instructions": instr, "criteria": ["a", "b", "c"]},
                             "target": target})

    train = [rec(1, {"q": "colour", "n": 1}, [0.1, 0.2, 0.7]), rec(2, {"n": 1, "q": "colour"}, [0.2, 0.1, 0.7]),
             rec(3, {"q": "colour", "n": 1}, [0.6, 0.3, 0.1])]
    test = [rec(4, {"q": "colour", "n": 1}, [0.0, 0.2, 0.8]), rec(5, {"q": "colour", "n": 1}, [0.5, 0.3, 0.2])]
    mb = M.majority_baseline(train, test)
    assert mb["accuracy"] == pytest.approx(0.5)  # always "c"
    assert mb["soft_accuracy"] == pytest.approx((0.8 + 0.2) / 2)
    assert mb["n_keys"] == 1 and mb["n_fallback_group"] == 0
    with pytest.raises(ValueError, match="instructions"):
        M.majority_baseline([{"id": "z", "group": "g", "labels": ["a", "b"], "target": [1.0, 0.0]}], [])
