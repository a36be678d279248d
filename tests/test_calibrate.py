"""Temperature fitting: recovers known temperatures, respects [0.1, 10], per-type rules, the held-out guard."""

import math

import numpy as np
import pytest
import torch

from rlcd.calibrate import fit_per_type, fit_temperature

torch.set_num_threads(1)


def _softmax(z, temperature):
    e = np.exp(z / temperature - np.max(z / temperature))
    return e / e.sum()


def ragged(seed, n=400, kmax=8, scale=2.0):
    rng = np.random.default_rng(seed)
    return [rng.normal(0, scale, size=int(rng.integers(2, kmax + 1))) for _ in range(n)]


@pytest.mark.parametrize("t0", [0.5, 2.0, 4.0])
def test_recovers_temperature_from_probability_targets(t0):
    # logits z; the truth at temperature t0 is softmax(z / t0); targets are those probabilities
    z = ragged(int(t0 * 10))
    targets = [_softmax(x, t0) for x in z]
    temperature, info = fit_temperature(z, targets)
    assert temperature == pytest.approx(t0, rel=0.02)
    assert info["converged"] and info["at_bound"] is None
    assert info["n"] == len(z) and 0 < info["iterations"] <= 100
    assert info["loss_after"] < info["loss_before"]


@pytest.mark.parametrize("t0", [0.5, 2.0, 4.0])
def test_recovers_temperature_from_sampled_one_hot_labels(t0):
    # hard labels drawn from softmax(z / t0): the fitted T is the maximum-likelihood temperature
    rng = np.random.default_rng(100 + int(t0 * 10))
    n, k = 20000, 5
    z = rng.normal(0, 2.0, size=(n, k))
    p = np.exp(z / t0)
    p /= p.sum(axis=1, keepdims=True)
    y = (rng.random((n, 1)) > np.cumsum(p, axis=1)).sum(axis=1)
    temperature, info = fit_temperature(z, np.eye(k)[y])
    assert temperature == pytest.approx(t0, rel=0.02)


@pytest.mark.parametrize("t0", [0.11, 9.5])
def test_recovers_temperatures_close_to_the_bounds(t0):
    # a squashed parameterisation T = 0.1 + 9.9 sigmoid(u) crawls near its bounds (on these rows it
    # stops at 9.22 for t0 = 9.5 after 100 LBFGS iterations); the log-space projection gets there
    z = ragged(7, n=300)
    temperature, info = fit_temperature(z, [_softmax(x, t0) for x in z])
    assert temperature == pytest.approx(t0, rel=0.02)
    assert 0.1 <= temperature <= 10.0


@pytest.mark.parametrize("t0,bound,side", [(0.03, 0.1, "lower"), (40.0, 10.0, "upper")])
def test_optimum_outside_the_box_stays_on_the_bound(t0, bound, side):
    z = ragged(11, n=300)
    temperature, info = fit_temperature(z, [_softmax(x, t0) for x in z])
    assert temperature == pytest.approx(bound, rel=1e-9)
    assert 0.1 - 1e-12 <= temperature <= 10.0 + 1e-12
    assert info["at_bound"] == side and info["converged"]
    # the gradient at the bound is alive and points outward (KKT), not a dead zero
    assert abs(info["grad"]) > 1e-4
    assert (info["grad"] > 0) == (side == "lower")


def test_uniform_targets_push_to_the_upper_bound():
    z = ragged(12, n=200)
    temperature, info = fit_temperature(z, [np.full(len(x), 1 / len(x)) for x in z])
    assert temperature == pytest.approx(10.0)
    assert info["loss_after"] < info["loss_before"]


def test_padded_and_ragged_inputs_agree_and_custom_bounds():
    z = ragged(13, n=200, kmax=5)
    targets = [_softmax(x, 1.7) for x in z]
    zp = np.full((len(z), 5), -np.inf)
    tp = np.zeros((len(z), 5))
    for i, (a, b) in enumerate(zip(z, targets)):
        zp[i, : len(a)], tp[i, : len(b)] = a, b
    t_ragged, _ = fit_temperature(z, targets)
    t_padded, _ = fit_temperature(zp, tp)
    assert t_ragged == pytest.approx(t_padded, rel=1e-9)
    t_box, info = fit_temperature(z, targets, t_min=0.5, t_max=1.2)
    assert t_box == pytest.approx(1.2) and info["at_bound"] == "upper"
    zp_bad, tp_bad = zp.copy(), tp.copy()
    zp_bad[0, 4], tp_bad[0, 4] = -np.inf, 0.5  # target mass on a padded candidate
    with pytest.raises(ValueError, match="padding"):
        fit_temperature(zp_bad, tp_bad)


def _rows(type_, n, t0, seed, split=None):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = 2 if type_ == "noul" else int(rng.integers(2, 6))
        z = rng.normal(0, 2.0, size=k)
        r = {"id": f"{type_}{i}", "group": "s/en/t", "type": type_, "labels": [str(j) for j in range(k)],
             "target": _softmax(z, t0).tolist(), "posterior": None, "logits": z.tolist()}
        if split:
            r["split"] = split
        out.append(r)
    return out


def test_fit_per_type_fits_each_type_and_keeps_t1_below_ten_rows():
    rows = _rows("choice", 40, 2.0, 1) + _rows("score", 10, 0.5, 2) + _rows("noul", 9, 3.0, 3)
    temps, infos = fit_per_type(rows)
    assert set(temps) == {"choice", "noul", "score"}
    assert temps["choice"] == pytest.approx(2.0, rel=0.02)
    assert temps["score"] == pytest.approx(0.5, rel=0.02)  # exactly 10 rows: fitted
    assert temps["noul"] == 1.0  # 9 rows: not fitted, even though the truth is 3
    assert "9" in infos["noul"]["reason"] and infos["noul"]["n"] == 9
    assert infos["noul"]["iterations"] == 0 and infos["choice"]["n"] == 40
    for info in infos.values():
        assert {"loss_before", "loss_after", "iterations", "n", "converged"} <= set(info)
    temps, infos = fit_per_type(_rows("choice", 12, 2.0, 4))
    assert temps["noul"] == temps["score"] == 1.0 and infos["score"]["n"] == 0


def test_small_calibration_warnings_name_the_rule_that_applies():
    """A type fitted on few rows is 'noisy' (< 30); a type with too few to fit says how many a fit takes (10)."""
    from rlcd.evaluate import small_data_warnings

    cal = _rows("choice", 40, 2.0, 1) + _rows("score", 12, 0.5, 2) + _rows("noul", 3, 3.0, 3)
    _, infos = fit_per_type(cal)
    test = _rows("choice", 60, 1.0, 4)
    warnings = small_data_warnings({"calibration": cal, "test": test}, infos)
    assert sorted(warnings) == ["warning: noul: 3 calibration rows (a fit takes 10); its temperature stays T = 1",
                                "warning: score: 12 calibration rows (< 30); its temperature is noisy"]
    assert small_data_warnings({"calibration": [], "test": test[:5]}, {})[0].startswith(
        "warning: the test split has 5 rows")


def test_fit_per_type_uses_only_the_rows_given():
    cal = _rows("choice", 30, 2.0, 5, split="calibration")
    other = _rows("choice", 30, 0.3, 6)
    temps, _ = fit_per_type(cal)
    direct, _ = fit_temperature([r["logits"] for r in cal], [r["target"] for r in cal])
    assert temps["choice"] == pytest.approx(direct, rel=1e-12)
    assert fit_per_type(cal + other)[0]["choice"] != pytest.approx(temps["choice"], rel=0.02)
    with pytest.raises(ValueError, match="calibration rows only"):
        fit_per_type(cal + _rows("noul", 3, 1.0, 7, split="test"))


def _grid_best(z, targets, t_min=0.1, t_max=10.0, points=20001):
    """Independent float64 reference: the minimum over a dense log-spaced grid of T (numpy only)."""
    best = np.inf
    for x, t in zip(z, targets):
        assert len(x) == len(t)
    temps = np.exp(np.linspace(np.log(t_min), np.log(t_max), points))[:, None]
    total = np.zeros(points)
    for x, t in zip(z, targets):
        s = np.asarray(x, dtype=np.float64)[None, :] / temps  # [points, k]
        m = s.max(axis=1, keepdims=True)
        logp = s - (m + np.log(np.exp(s - m).sum(axis=1, keepdims=True)))
        total -= logp @ np.asarray(t, dtype=np.float64)
    best = float(np.min(total / len(z)))
    return best


def _fit_cases():
    rng = np.random.default_rng(2024)
    cases = {}
    # near-uniform logits (flat loss in log T over most of the box) with one-hot labels weakly tied to them
    z = [rng.normal(0, 0.02, size=3) for _ in range(60)]
    cases["flat"] = (z, [np.eye(3)[int(np.argmax(x + rng.normal(0, 0.02, size=3)))] for x in z])
    z = [rng.normal(0, 0.01, size=2) for _ in range(40)]
    cases["flat_noul"] = (z, [np.eye(2)[int(rng.integers(0, 2))] for _ in z])
    # sharp logits, labels mostly agree: optimum at small T
    z = [rng.normal(0, 8.0, size=4) for _ in range(50)]
    cases["sharp"] = (z, [np.eye(4)[int(np.argmax(x)) if rng.random() < 0.9 else int(rng.integers(0, 4))] for x in z])
    z = [rng.normal(0, 1.0, size=4) for _ in range(50)]
    cases["lower_bound"] = (z, [_softmax(x, 0.02) for x in z])
    cases["upper_bound"] = (z, [_softmax(x, 50.0) for x in z])
    for i in range(4):
        k = int(rng.integers(2, 6))
        z = [rng.normal(0, rng.uniform(0.05, 5.0), size=k) for _ in range(int(rng.integers(10, 60)))]
        cases[f"random{i}"] = (z, [np.eye(k)[int(rng.integers(0, k))] for _ in z])
    return cases


@pytest.mark.parametrize("name", list(_fit_cases()))
def test_fit_reaches_the_grid_minimum(name):
    z, targets = _fit_cases()[name]
    temperature, info = fit_temperature(z, targets)
    best = _grid_best(z, targets)
    assert 0.1 <= temperature <= 10.0
    assert info["loss_after"] <= best + 1e-6, (temperature, info["loss_after"], best)
    assert info["converged"], info


# ------------------------------------------------------------------ the held-out guard


def _np_soft_ce_rows(z, targets, temperature):
    """Independent float64 per-row soft cross-entropy at one temperature (numpy only)."""
    out = []
    for x, t in zip(z, targets):
        s = np.asarray(x, dtype=np.float64) / temperature
        m = s.max()
        out.append(-float(np.dot(np.asarray(t, dtype=np.float64), s - (m + np.log(np.exp(s - m).sum())))))
    return np.array(out)


def _np_grid_fit(z, targets, points=401):
    """The minimiser over T in [0.1, 10] (numpy only): a log grid brackets it, golden section narrows it (to about
    sqrt(machine eps) in log T, where loss values tie: hence rel 1e-7 on the held-out losses below)."""
    def f(u):
        return _np_soft_ce_rows(z, targets, math.exp(u)).mean()

    grid = np.linspace(math.log(0.1), math.log(10.0), points)
    j = int(np.argmin([f(u) for u in grid]))
    a, b = grid[max(j - 1, 0)], grid[min(j + 1, points - 1)]
    g = (math.sqrt(5) - 1) / 2
    while b - a > 1e-11:
        c, d = b - g * (b - a), a + g * (b - a)
        if f(c) <= f(d):
            b = d
        else:
            a = c
    return math.exp((a + b) / 2)


def _np_cross_fit(rows, folds=5):
    """The guard recomputed: cases sorted and dealt round-robin, each fold scored at the grid fit of the rest."""
    case = [r["id"].split(":", 1)[0] for r in rows]
    keys = sorted(set(case))
    k = min(folds, len(keys))
    fold = np.array([keys.index(c) % k for c in case])
    held, at_one, fold_temps = np.zeros(len(rows)), np.zeros(len(rows)), []
    for f in range(k):
        fit = [r for r, g in zip(rows, fold) if g != f]
        t_f = _np_grid_fit([r["logits"] for r in fit], [r["target"] for r in fit])
        fold_temps.append(t_f)
        idx = np.flatnonzero(fold == f)
        held[idx] = _np_soft_ce_rows([rows[i]["logits"] for i in idx], [rows[i]["target"] for i in idx], t_f)
        at_one[idx] = _np_soft_ce_rows([rows[i]["logits"] for i in idx], [rows[i]["target"] for i in idx], 1.0)
    return held.mean(), at_one.mean(), fold_temps


def _case_rows(type_, cases, per_case, t0, seed):
    """Rows of `cases` source cases (ids 'case:i'), targets softmax(z / t0[case]) for a per-case temperature."""
    rng = np.random.default_rng(seed)
    out = []
    for c in range(cases):
        for i in range(per_case):
            k = 2 if type_ == "noul" else 4
            z = rng.normal(0, 2.0, size=k)
            out.append({"id": f"case{c:02d}:{type_}{i}", "group": "s/en/t", "type": type_,
                        "labels": [str(j) for j in range(k)], "target": _softmax(z, t0(c)).tolist(),
                        "posterior": None, "logits": z.tolist()})
    return out


def test_the_guard_keeps_a_fit_that_beats_t1_on_held_out_cases():
    rows = _case_rows("choice", 12, 3, lambda c: 2.5, seed=21)
    temps, infos = fit_per_type(rows)
    direct, _ = fit_temperature([r["logits"] for r in rows], [r["target"] for r in rows])
    info, held = infos["choice"], infos["choice"]["heldout"]
    assert temps["choice"] == pytest.approx(direct, rel=1e-12) and "reason" not in info
    loss, loss_t1, fold_temps = _np_cross_fit(rows)
    assert held["folds"] == 5 and held["n_cases"] == 12 and held["beats_t1"]
    assert held["loss_t1"] == pytest.approx(loss_t1, rel=1e-12) == pytest.approx(info["loss_before"], rel=1e-12)
    assert held["loss"] == pytest.approx(loss, rel=1e-7) and loss < loss_t1
    assert held["fold_temperatures"] == pytest.approx(fold_temps, rel=1e-6)


def test_the_guard_refuses_a_fit_that_loses_to_t1_on_held_out_cases():
    """Two cases pulling opposite ways (one sharpened, T = 0.25; one flattened, T = 4): the temperature fitted
    on either one makes the other worse than T = 1, so the fit on both is refused, whatever T it found."""
    rows = _case_rows("noul", 2, 8, lambda c: 0.25 if c == 0 else 4.0, seed=22)
    temps, infos = fit_per_type(rows)
    direct, fit = fit_temperature([r["logits"] for r in rows], [r["target"] for r in rows])
    info, held = infos["noul"], infos["noul"]["heldout"]
    loss, loss_t1, fold_temps = _np_cross_fit(rows)
    assert loss > loss_t1, "the fixture: the cross-fit loses to T = 1"
    assert held["folds"] == 2 and not held["beats_t1"]
    assert held["loss"] == pytest.approx(loss, rel=1e-7) and held["loss_t1"] == pytest.approx(loss_t1, rel=1e-12)
    assert held["fold_temperatures"] == pytest.approx(fold_temps, rel=1e-6)
    assert temps["noul"] == 1.0 and info["temperature"] == 1.0
    assert info["fitted_temperature"] == pytest.approx(direct, rel=1e-12) and abs(direct - 1) > 0.05
    assert info["fitted_loss"] == pytest.approx(fit["loss_after"], rel=1e-12)
    assert info["loss_after"] == info["loss_before"] == pytest.approx(loss_t1, rel=1e-12)
    assert "did not beat T = 1 on held-out calibration cases (2-fold cross-fit by case" in info["reason"]


def test_one_case_cannot_be_held_out_so_its_fit_is_refused():
    rows = _case_rows("score", 1, 12, lambda c: 3.0, seed=23)
    temps, infos = fit_per_type(rows)
    assert temps["score"] == 1.0 and infos["score"]["heldout"]["folds"] == 0
    assert "from one case" in infos["score"]["reason"] and infos["score"]["fitted_temperature"] > 2


def test_a_refused_fit_is_said_in_the_summary_the_report_table_and_the_warnings():
    from rlcd.evaluate import small_data_warnings
    from rlcd.report import evaluation_from_predictions, format_summary

    cal = [dict(r, split="calibration") for r in _case_rows("noul", 2, 8, lambda c: 0.25 if c == 0 else 4.0, 22)]
    cal += [dict(r, split="calibration") for r in _case_rows("choice", 12, 3, lambda c: 2.5, 21)]
    temps, infos = fit_per_type(cal)
    test = [dict(r, split="test") for r in _case_rows("noul", 10, 4, lambda c: 1.0, 24)]
    ev = evaluation_from_predictions({"calibration": cal, "test": test}, temps, {"calibration": infos}, resamples=50)
    text = format_summary(ev)
    assert "note: noul temperature fit refused: the fit (T = " in text
    assert "note: choice temperature" not in text
    warnings = small_data_warnings({"calibration": cal, "test": test}, infos)
    assert any(w.startswith("warning: noul: 16 calibration rows (< 30); its fit (T = ") and "T = 1 is kept" in w
               for w in warnings), warnings
