"""LR schedule and recipe validation: the numbers every run is held to."""

import math

import pytest

from rlcd.recipe import KNOBS, Recipe, lr_factor, parse_overrides, warmup_steps


def expected(step, horizon, floor=0.1):
    w = max(1, round(0.03 * horizon))
    if step < w:
        return (step + 1) / w
    p = min(1.0, (step - w) / (horizon - w))
    return floor + (1 - floor) * (1 + math.cos(math.pi * p)) / 2


def test_default_recipe_numbers():
    r = Recipe()
    assert (r.batch_size, r.grad_accum, r.steps) == (8, 4, 3600)
    assert (r.lr_lora, r.lr_head, r.weight_decay, r.grad_clip) == (1e-4, 5e-4, 0.01, 1.0)
    assert (r.pool_cap, r.dev_cap, r.eval_every) == (6000, 256, 400)
    assert r.decay_horizon() == 2400 and warmup_steps(2400) == 72
    assert set(KNOBS) <= set(r.to_dict())


@pytest.mark.parametrize("step,value", [(0, 1 / 72), (71, 1.0), (72, 1.0), (2400, 0.1), (3000, 0.1), (3599, 0.1)])
def test_schedule_full_recipe(step, value):
    assert lr_factor(step, 2400) == pytest.approx(value, abs=1e-12)


def test_schedule_midpoint_is_halfway_between_peak_and_floor():
    mid = 72 + (2400 - 72) / 2
    assert lr_factor(int(mid), 2400) == pytest.approx(0.55, abs=1e-12)


@pytest.mark.parametrize("horizon", [10, 50, 300])
def test_schedule_short_runs(horizon):
    for step in range(0, horizon + 20):
        assert lr_factor(step, horizon) == pytest.approx(expected(step, horizon), abs=1e-12)
    # monotone non-increasing after warm-up, floor after the horizon
    w = warmup_steps(horizon)
    vals = [lr_factor(s, horizon) for s in range(w, horizon + 20)]
    assert all(a >= b - 1e-15 for a, b in zip(vals, vals[1:]))
    assert lr_factor(horizon + 1000, horizon) == pytest.approx(0.1)


def test_extension_keeps_horizon():
    short = Recipe(steps=100)
    assert short.decay_horizon() == 100
    # an extended run keeps D=100 (frozen in config.json), so the factor after 100 is the floor
    assert lr_factor(150, short.decay_horizon()) == pytest.approx(0.1)


@pytest.mark.parametrize("kw,msg", [({"objective": "ppo"}, "objective"), ({"sigma": 0.0}, "sigma"),
                                    ({"ce_weight": -1.0}, "ce_weight"), ({"steps": 0}, "steps"),
                                    ({"sigma_end": 0.0}, "sigma_end must be none"),
                                    ({"sigma_end": "0.1"}, "sigma_end must be none"),
                                    ({"n_perturbations": 1}, "n_perturbations must be an integer >= 2"),
                                    ({"w_spherical": -0.5}, "w_spherical must be a finite number >= 0"),
                                    ({"w_rps": float("nan")}, "w_rps"),
                                    ({"advantage_norm": "group"}, "advantage_norm must be 'batch' or 'type'"),
                                    ({"select_by": "brier"}, "select_by must be one of macro_accuracy, nll"),
                                    ({"init_head": "fresh"}, "init_head must be 'keep'")])
def test_bad_knobs_rejected(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Recipe(**kw)


def test_round_trip_and_unknown_field():
    r = Recipe(steps=12, sigma=1.0)
    assert Recipe.from_dict(r.to_dict()) == r
    with pytest.raises(ValueError, match="unknown recipe fields"):
        Recipe.from_dict({**r.to_dict(), "lr": 1.0})


def test_arm_defaults_are_the_pinned_recipe():
    r = Recipe()
    assert (r.sigma_end, r.n_perturbations, r.w_spherical, r.w_rps, r.advantage_norm) == (None, 4, 0.75, 1.0, "batch")
    assert r.deviations() == {}
    assert [r.sigma_at(s, 2400) for s in (0, 1200, 5000)] == [0.3, 0.3, 0.3]


def test_sigma_anneals_linearly_over_the_decay_horizon():
    r = Recipe(sigma=0.4, sigma_end=0.1)
    assert r.sigma_at(0, 2400) == 0.4
    assert r.sigma_at(1200, 2400) == pytest.approx(0.25, abs=1e-15)
    assert r.sigma_at(600, 2400) == pytest.approx(0.4 - 0.3 * 0.25, abs=1e-15)
    assert r.sigma_at(2400, 2400) == pytest.approx(0.1, abs=1e-15)
    assert r.sigma_at(3599, 2400) == pytest.approx(0.1, abs=1e-15)  # extension keeps sigma_end
    assert r.deviations()["sigma_end"] == {"value": 0.1, "pinned": None}


def test_arm_overrides_parse_to_their_types():
    got = parse_overrides(["sigma_end=0.1", "n_perturbations=8", "w_spherical=0", "w_rps=2",
                           "advantage_norm=type"])
    assert got == {"sigma_end": 0.1, "n_perturbations": 8, "w_spherical": 0.0, "w_rps": 2.0, "advantage_norm": "type"}
    assert isinstance(got["w_spherical"], float) and isinstance(got["n_perturbations"], int)
    assert parse_overrides(["sigma_end=none"]) == {"sigma_end": None}
    Recipe(**got)  # a valid arm
    with pytest.raises(ValueError, match="sigma_end=fast: not a valid float \\(or none\\)"):
        parse_overrides(["sigma_end=fast"])
