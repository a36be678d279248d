"""rlcd.uncertainty: the vectorised grouped bootstrap against materialised resamples scored by
rlcd.metrics / rlcd.calibrate, case grouping, determinism, and the calibration-effect flag."""

import numpy as np
import pytest
from test_report import make_rows

from rlcd import metrics as M
from rlcd import uncertainty as U
from rlcd.bootstrap import draw_groups, group_codes, group_key, resample_indices
from rlcd.calibrate import padded, soft_ce

TEMPS = {"choice": 2.0, "noul": 1.5, "score": 2.5}
MEANS = ("accuracy", "soft_accuracy", "nll", "brier", "mean_confidence", "sharpness_gap", "ece", "ece_target", "aurc")


def rows_with_cases(n=90, per_case=3, seed=3):
    rows = make_rows("test", n, seed)
    for i, r in enumerate(rows):
        r["case_id"] = f"case-{i // per_case}"
    return rows


def materialised(rows, r, resamples, seed):
    """The rows of resample ``r`` written out (every drawn case's rows, once per draw)."""
    rows = M.sorted_rows(rows)
    codes, n_cases = group_codes([group_key(x) for x in rows], len(rows))
    drawn = draw_groups(np.random.default_rng(seed), n_cases, resamples)[r]
    return [rows[i] for i in resample_indices(codes, drawn)]


def test_every_resample_equals_metrics_summarize_on_the_materialised_rows():
    rows = rows_with_cases()
    samples, points, n_cases = U.resampled_metrics(rows, TEMPS, resamples=6, seed=4)
    assert n_cases == 30
    for r in range(6):
        resample = materialised(rows, r, 6, 4)
        for side, temps in (("raw", None), ("calibrated", TEMPS)):
            summary = M.summarize(resample, temps)
            blocks = {("overall", None): summary["overall"],
                      **{("per_type", t): b for t, b in summary["per_type"].items()}}
            for key, block in blocks.items():
                for m in MEANS + (("rps", "level_mae", "within_one") if "rps" in block else ()):
                    assert samples[(side, key)][m][r] == pytest.approx(block[m], rel=1e-10, abs=1e-12), (side, key, m)
            for m in ("accuracy", "nll", "brier"):
                assert samples[(side, ("overall", None))][f"macro:{m}"][r] == pytest.approx(
                    summary["group_macro"][m], rel=1e-10)
    # and on the rows as given, the point estimates are summarize's
    summary = M.summarize(rows, TEMPS)
    for m in MEANS:
        assert points[("calibrated", ("overall", None))][m][0] == pytest.approx(summary["overall"][m], rel=1e-10)


def test_resampling_is_by_case_not_by_row():
    """Cases of 4 identical rows give exactly the intervals of one row per case (and wider than rows as units)."""
    single = make_rows("test", 40, 5)
    for i, r in enumerate(single):
        r["id"] = f"case{i:03d}:q"
    copies = [{**r, "id": f"{r['id']}{j}"} for r in single for j in range(4)]
    a = U.split_intervals(single, TEMPS, resamples=300, seed=1)
    b = U.split_intervals(copies, TEMPS, resamples=300, seed=1)
    assert a["n_cases"] == b["n_cases"] == 40
    for m in ("accuracy", "nll", "ece", "aurc"):
        assert a["calibrated"]["overall"][m] == b["calibrated"]["overall"][m], m
    as_rows = [{**r, "id": f"r{i}"} for i, r in enumerate(copies)]  # every row its own case
    c = U.split_intervals(as_rows, TEMPS, resamples=300, seed=1)
    width = lambda ci: ci[1] - ci[0]  # noqa: E731
    assert width(c["calibrated"]["overall"]["nll"]) < 0.7 * width(b["calibrated"]["overall"]["nll"])


def test_intervals_are_deterministic_order_free_and_bracket_the_estimate():
    rows = rows_with_cases(180, per_case=2)
    out = U.split_intervals(rows, TEMPS)
    again = U.split_intervals(list(reversed(rows)), dict(reversed(list(TEMPS.items()))))
    assert out == again
    summary = M.summarize(rows, TEMPS)
    for m in ("accuracy", "nll", "brier", "ece"):
        lo, hi = out["calibrated"]["overall"][m]
        assert lo < summary["overall"][m] < hi, m
    assert set(out["raw"]["per_type"]) == {"choice", "noul", "score"}
    assert set(out["raw"]["group_macro"]) == {"accuracy", "nll", "brier"}
    assert out != U.split_intervals(rows, TEMPS, seed=1)


def best_temperature(rows):
    """argmin_T of the calibration loss on these rows by golden-section search in log T (to 1e-9)."""
    z, t, mask = padded([x["logits"] for x in rows], [x["target"] for x in rows])
    lo, hi = np.log(0.1), np.log(10.0)
    g = (5 ** 0.5 - 1) / 2
    while hi - lo > 1e-9:
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if float(soft_ce(z, t, mask, float(np.exp(a)))) < float(soft_ce(z, t, mask, float(np.exp(b)))):
            hi = b
        else:
            lo = a
    return float(np.exp((lo + hi) / 2))


def test_temperature_refits_match_the_optimum_on_the_materialised_resamples():
    rows = rows_with_cases(150, per_case=3, seed=7)
    fits = U.resampled_temperatures(rows, resamples=5, seed=2)
    for r in range(5):
        resample = materialised(rows, r, 5, 2)
        for t in ("choice", "noul", "score"):
            expected = best_temperature([x for x in resample if x["type"] == t])
            assert fits[t][r] == pytest.approx(expected, rel=2e-4), (r, t)  # LBFGS itself stops at ~1e-4
    ci = U.temperature_intervals(rows)
    for t in ("choice", "noul", "score"):
        assert 1.2 < ci[t][0] < ci[t][1] < 4.0  # make_rows' logits are ~2x too sharp


def test_temperature_interval_needs_enough_rows_and_keeps_the_bounds():
    rows = rows_with_cases(24, per_case=1)  # 8 rows a type < 10
    assert U.temperature_intervals(rows) == {"choice": None, "noul": None, "score": None}
    sharp = [{**r, "logits": (np.asarray(r["logits"]) * 1e3).tolist()} for r in rows_with_cases(60, per_case=1)]
    ci = U.temperature_intervals(sharp, resamples=50)
    assert all(ci[t][1] == 10.0 for t in ("choice", "score"))  # the optimum lies beyond T = 10


def test_calibration_effect_flags_a_harmful_temperature_only():
    rows = rows_with_cases(150, per_case=1)
    harmful = U.split_intervals(rows, {"choice": 0.3, "noul": 0.3, "score": 0.3}, resamples=300)
    eff = harmful["calibration_effect"]["overall"]["nll"]
    assert eff["delta"] > 0 and eff["ci95"][0] > 0
    neutral = U.split_intervals(rows, None, resamples=300)["calibration_effect"]["per_type"]["choice"]["ece"]
    assert neutral == {"delta": 0.0, "ci95": [0.0, 0.0]}


def test_the_fitted_temperature_lies_in_its_interval_on_flat_logits():
    """Near-uniform logits whose argmax is right 3 times in 4: the loss in log T is flat near T = 1 and the
    optimum is small. The fit must reach it (LBFGS alone used to stop near T = 0.9, outside the interval)."""
    from rlcd.calibrate import fit_temperature

    rng = np.random.default_rng(3)
    rows = []
    for i in range(200):
        z = rng.normal(0, 0.05, size=2)
        y = int(np.argmax(z)) if rng.random() < 0.75 else int(np.argmin(z))
        rows.append({"id": f"r{i}", "group": "g", "type": "noul", "labels": ["false", "true"],
                     "target": np.eye(2)[y].tolist(), "posterior": None, "logits": z.tolist()})
    fitted, info = fit_temperature([r["logits"] for r in rows], [r["target"] for r in rows])
    lo, hi = U.temperature_intervals(rows, resamples=200)["noul"]
    assert info["converged"] and lo <= fitted <= hi, (fitted, lo, hi)
    assert fitted == pytest.approx(best_temperature(rows), rel=1e-6)


def test_the_bayes_gap_interval_holds_the_headline_gap_and_names_the_uniform_answers():
    """`bayes_gap_interval` (the demo's headline and the learning curve's test point): its point is the calibrated
    `bayes_gap` and `uniform_gap` that `rlcd.metrics` reports on the same rows, its interval holds that point and
    narrows as cases are added, and rows without a posterior are left out."""
    from rlcd.uncertainty import bayes_gap_interval

    rng = np.random.default_rng(0)

    def rows(n_cases):
        out = []
        for c in range(n_cases):
            for q in range(3):
                k = int(rng.integers(2, 6))
                post = rng.dirichlet(np.ones(k))
                out.append({"id": f"c{c}:q{q}", "case_id": f"c{c}", "group": "g", "type": "choice",
                            "target": post.tolist(), "posterior": post.tolist(),
                            "logits": (np.log(post) * 1.7 + rng.normal(0, 0.5, k)).tolist()})
        return out

    temps = {"choice": 1.3, "noul": 1.0, "score": 1.0}
    small, large = rows(20), rows(200)
    g = bayes_gap_interval(small + [{**small[0], "id": "x", "posterior": None}], temps)
    post = M.summarize(small, temps)["overall"]["posterior"]
    assert g["n"] == len(small)
    assert g["gap"] == pytest.approx(post["bayes_gap"], rel=1e-5)
    assert g["uniform_gap"] == pytest.approx(post["uniform_gap"], rel=1e-5)
    assert g["ci95"][0] < g["gap"] < g["ci95"][1]
    wide = g["ci95"][1] - g["ci95"][0]
    big = bayes_gap_interval(large, temps)
    assert big["ci95"][1] - big["ci95"][0] < wide / 2
    assert bayes_gap_interval([{**small[0], "posterior": None}], temps) is None
