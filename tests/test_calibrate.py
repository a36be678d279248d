"""Temperature fitting: recovers known temperatures, respects [0.1, 10], per-type rules."""

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
