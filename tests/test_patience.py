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


def test_select_by_nll_keeps_the_lowest_dev_nll(tmp_path, data_dir):
    """`select_by=nll`: the best checkpoint is the evaluation with the lowest pooled dev NLL (earliest on ties),
    whatever the macro accuracy did; its score is that NLL; the pinned recipe still selects on accuracy."""
    recipe = Recipe(steps=6, eval_every=1, checkpoint_every=6, log_every=1, diagnostics_every=0, select_by="nll",
                    lr_head=3e-2)
    run = tmp_path / "run"
    state = train(run, data_dir=data_dir, model="tiny-toy", recipe=recipe, progress=False, print_fn=lambda _: None)
    evals = _rows(run, "eval")
    nll = [(r["dev_nll"], r["step"]) for r in evals]
    best_nll, best_step = min(nll)
    assert state["best_step"] == best_step and state["best_score"] == pytest.approx(best_nll, abs=1e-12)
    assert ckpt.load(run / "checkpoints" / "best")["state"]["step"] == best_step
    assert len({round(n, 6) for n, _ in nll}) > 1  # the NLL moved: the choice was not a tie at step 0
    config = json.loads((run / "config.json").read_text())
    assert config["recipe_deviations"]["select_by"] == {"value": "nll", "pinned": "macro_accuracy"}
    assert Recipe().select_by == "macro_accuracy"

    from rlcd.report.training_log import selected_step
    assert selected_step(evals, {}, "nll") == best_step
    acc = [(r["dev_macro_accuracy"], -r["step"]) for r in evals]
    assert selected_step(evals, {}) == -max(acc)[1]


def test_select_by_nll_without_dev_rows_is_refused_before_anything_is_written(tmp_path, data_dir):
    import shutil

    empty = tmp_path / "data"
    shutil.copytree(data_dir, empty, ignore=shutil.ignore_patterns("features"))
    (empty / "dev.jsonl").write_text("")
    with pytest.raises(OptionError, match="select_by=nll selects on the dev NLL, but .*dev.jsonl has no rows"):
        train(tmp_path / "run", data_dir=empty, model="tiny-toy", recipe=Recipe(steps=1, select_by="nll"),
              progress=False, print_fn=lambda _: None)
    assert not (tmp_path / "run").exists()
