"""LR schedule and recipe validation: the numbers every run is held to."""

import math

import pytest

from rlcd.recipe import KNOBS, Recipe, lr_factor, warmup_steps


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
                                    ({"ce_weight": -1.0}, "ce_weight"), ({"steps": 0}, "steps")])
def test_bad_knobs_rejected(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Recipe(**kw)


def test_round_trip_and_unknown_field():
    r = Recipe(steps=12, sigma=1.0)
    assert Recipe.from_dict(r.to_dict()) == r
    with pytest.raises(ValueError, match="unknown recipe fields"):
        Recipe.from_dict({**r.to_dict(), "lr": 1.0})
