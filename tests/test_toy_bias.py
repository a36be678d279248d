"""Toy bias of the noise-smoothed proper score (no model)."""

import json

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from rlcd.analysis.toy_bias import (  # noqa: E402
    default_targets,
    near_uniform_target,
    optimise_logits,
    peaked_target,
    plot_toy_bias,
    run_toy_bias,
)

# Reference values of issue 8 (noise-free max probability, log score, t = (0.7, 0.2, 0.1)).
REFERENCE = {0.0: 0.700, 0.5: 0.723, 1.0: 0.780, 2.0: 0.905}


def test_reference_values_log_score():
    result = run_toy_bias(sigmas=list(REFERENCE), targets=[[0.7, 0.2, 0.1]], rewards=("log",))
    rows = result["rows"]
    assert [r["sigma"] for r in rows] == list(REFERENCE)
    for row in rows:
        assert row["reward"] == "log"
        assert row["target"] == pytest.approx([0.7, 0.2, 0.1])
        assert abs(row["max_prob"] - REFERENCE[row["sigma"]]) < 0.01, row
        assert row["kl"] >= 0
    # sigma 0 is the plain proper score: the optimum is t itself
    assert rows[0]["kl"] < 1e-9


def test_log_optimum_satisfies_the_smoothed_stationarity_condition():
    """Independent check: for the (unfloored) log score, grad J = t - E[softmax(z + eps)] = 0.

    At sigma = 0.5 / 1 the floor is never reached, so z* must make the noise-averaged softmax equal
    t. Verified with fresh plain Monte-Carlo draws in numpy, not the optimiser's Sobol set.
    """
    t = np.array([0.7, 0.2, 0.1])
    rng = np.random.default_rng(123)
    for sigma in (0.5, 1.0):
        z, _ = optimise_logits(t, sigma, "log", samples=2048)
        x = z + sigma * rng.standard_normal((200_000, 3))
        x -= x.max(axis=1, keepdims=True)
        q = np.exp(x)
        q /= q.sum(axis=1, keepdims=True)
        np.testing.assert_allclose(q.mean(axis=0), t, atol=4e-3)
        p = np.exp(z) / np.exp(z).sum()
        assert p[0] > t[0] + 0.01  # and the noise-free prediction is sharper than t


def test_default_targets_are_deterministic_and_documented():
    specs = default_targets()
    names = [s["name"] for s in specs]
    assert names[0] == "reference"
    for k in (2, 5, 20, 77):
        assert f"peaked-{k}" in names and f"near-uniform-{k}" in names
    assert peaked_target(2) == pytest.approx([0.7, 0.3])
    assert peaked_target(5) == pytest.approx([0.7] + [0.075] * 4)
    assert near_uniform_target(2) == pytest.approx([0.55, 0.45])
    nu = near_uniform_target(77)
    assert sum(nu) == pytest.approx(1.0) and max(nu) / min(nu) == pytest.approx(1.1 / 0.9)
    assert default_targets() == specs


def test_kl_rises_with_sigma_for_the_k_sweep(tmp_path):
    sigmas = [0.0, 1.0, 2.0, 4.0]
    sweep = [s for s in default_targets() if s["name"] != "reference"]
    result = run_toy_bias(sigmas=sigmas, targets=sweep, rewards=("log", "full"), samples=1024)
    rows = result["rows"]
    assert len(rows) == len(sweep) * 2 * len(sigmas)
    series = {}
    for r in rows:
        series.setdefault((r["name"], r["reward"]), []).append(r)
    assert len(series) == 16
    for key, rs in series.items():
        rs.sort(key=lambda r: r["sigma"])
        kls = [r["kl"] for r in rs]
        assert kls[0] < 1e-9, key  # sigma 0: proper score, optimum = target
        assert all(b > a for a, b in zip(kls, kls[1:])), (key, kls)
        # over-sharpening: the noise-free top probability grows with sigma as well
        mp = [r["max_prob"] for r in rs]
        assert mp[-1] > mp[0] + 1e-3, (key, mp)
    # the result is JSON-serialisable and plottable
    json.dumps(result)
    png = plot_toy_bias(result, tmp_path / "toy_bias.png")
    assert png.exists() and png.stat().st_size > 1000


def test_full_reward_is_proper_at_sigma_zero_and_ordinal_flag_is_used():
    t = [0.1, 0.6, 0.3]
    nominal = run_toy_bias(sigmas=[0.0, 1.0], targets=[{"target": t, "name": "x"}], rewards=("full",), samples=512)
    ordinal = run_toy_bias(sigmas=[0.0, 1.0], targets=[{"target": t, "ordinal": True}], rewards=("full",), samples=512)
    assert nominal["rows"][0]["kl"] < 1e-8 and ordinal["rows"][0]["kl"] < 1e-8
    # the RPS term lowers the objective for ordinal targets
    assert ordinal["rows"][1]["objective"] < nominal["rows"][1]["objective"]
    assert ordinal["rows"][1]["ordinal"] is True and nominal["rows"][1]["name"] == "x"


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="reward"):
        run_toy_bias(sigmas=[0.0], targets=[[0.5, 0.5]], rewards=("brier",))
    with pytest.raises(ValueError, match="sums to"):
        run_toy_bias(sigmas=[0.0], targets=[[0.5, 0.6]])
    with pytest.raises(ValueError, match="sigma"):
        run_toy_bias(sigmas=[-1.0], targets=[[0.5, 0.5]])


def test_cli_writes_json_and_plot(tmp_path):
    from typer.testing import CliRunner

    from rlcd.cli import app

    out = tmp_path / "tb"
    res = CliRunner().invoke(app, ["analyze", "toy-bias", "--out", str(out), "--sigmas", "0,1", "--rewards", "log",
                                           "--samples", "256"])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "toy_bias.json").read_text())
    assert {"target", "reward", "sigma", "max_prob", "kl"} <= set(data["rows"][0])
    assert len(data["rows"]) == 9 * 2
    assert (out / "toy_bias.png").stat().st_size > 1000
    assert "reference" in res.output
