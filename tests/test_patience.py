"""Early stopping (recipe `patience`): where it stops, what it writes, and what a resume does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import synth_processed

from rlcd import checkpoint as ckpt
from rlcd.errors import OptionError
from rlcd.recipe import Recipe
from rlcd.train import train

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return synth_processed(tmp_path_factory.mktemp("data"), 40, seed=3)


def _rows(run, event):
    return [r for r in map(json.loads, (Path(run) / "metrics.jsonl").read_text().splitlines()) if r["event"] == event]


def _expected_stop(scores: list[tuple[int, float]], patience: int) -> int | None:
    """The step at which `patience` evaluations in a row brought no strict improvement."""
    best, since = None, 0
    for step, score in scores:
        if best is None or score > best:
            best, since = score, 0
        else:
            since += 1
            if since >= patience:
                return step
    return None


def test_patience_stops_after_evaluations_without_strict_improvement(tmp_path, data_dir):
    # a near-zero learning rate keeps the dev score flat, so evaluations stop improving at once
    recipe = Recipe(steps=12, eval_every=1, checkpoint_every=5, log_every=1, diagnostics_every=0, patience=2,
                    lr_lora=1e-9, lr_head=1e-9)
    run = tmp_path / "run"
    state = train(run, data_dir=data_dir, model="tiny-toy", recipe=recipe, progress=False, print_fn=lambda _: None)
    evals = [(r["step"], r["dev_macro_accuracy"]) for r in _rows(run, "eval")]
    expected = _expected_stop(evals, 2)
    assert expected is not None and expected < 12
    assert state["stopped_early"] == expected == state["step"] == evals[-1][0]
    assert _rows(run, "stopped_early") == [{"event": "stopped_early", "step": expected, "patience": 2,
                                            "best_step": state["best_step"], "best_score": state["best_score"]}]
    last = ckpt.load(run / "checkpoints" / "last")["state"]  # the final last checkpoint, off the cadence
    assert last["step"] == expected and last["stopped_early"] == expected
    config = json.loads((run / "config.json").read_text())
    assert config["recipe_deviations"]["patience"] == {"value": 2, "pinned": None}

    # a resume (even with a larger budget) has nothing left to do: it writes nothing and says why
    before = (run / "metrics.jsonl").read_text()
    said = []
    again = train(run, resume=True, steps=20, progress=False, print_fn=said.append)
    assert again["step"] == expected and again["stopped_early"] == expected
    assert (run / "metrics.jsonl").read_text() == before
    assert json.loads((run / "config.json").read_text())["recipe"]["steps"] == 12
    assert any("stopped early" in line for line in said)


def test_patience_values():
    assert Recipe().patience is None and "patience" not in Recipe().deviations()  # the pinned fixed budget
    assert Recipe(patience=1).deviations()["patience"] == {"value": 1, "pinned": None}
    for bad in (0, -1, True, 1.5):
        with pytest.raises(OptionError, match="patience must be none"):
            Recipe(patience=bad)
