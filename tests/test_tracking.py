"""`rlcd train --log tensorboard`: RUN/tb/ event files hold every scalar of metrics.jsonl at its step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import synth_processed

from rlcd.errors import OptionError
from rlcd.recipe import Recipe
from rlcd.run import Run
from rlcd.tracking import check_tracker, scalars
from rlcd.train import train

torch.set_num_threads(1)
FAST = Recipe(steps=4, eval_every=2, checkpoint_every=2, log_every=1, diagnostics_every=1)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return synth_processed(tmp_path_factory.mktemp("data"), 40, seed=4)


def expected_scalars(metrics: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] in log order, derived from metrics.jsonl independently of rlcd.tracking."""
    out: dict[str, list[tuple[int, float]]] = {}

    def walk(prefix: str, obj, step: int) -> None:
        for k, v in obj.items():
            if isinstance(v, dict):
                walk(f"{prefix}/{k}", v, step)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out.setdefault(f"{prefix}/{k}", []).append((step, float(np.float32(v))))  # stored as float32

    for row in metrics:
        walk(row["event"], {k: v for k, v in row.items() if k not in ("event", "step")}, row["step"])
    return out


def event_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard's own reader serves them (the restart purge included).

    `plugin_event_accumulator` is the reader behind TensorBoard's scalar dashboard; the older
    `event_accumulator` does not apply a restart's purge to tensor summaries.
    """
    from tensorboard.backend.event_processing.plugin_event_accumulator import TENSORS, EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(tb_dir), size_guidance={TENSORS: 0})
    acc.Reload()
    return {tag: [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"]}


def test_event_files_equal_metrics_jsonl_across_a_resume(tmp_path, data_dir):
    run = tmp_path / "run"
    # killed after 3 updates: the row of update 3 is logged, the last checkpoint is update 2
    train(run, data_dir=data_dir, model="tiny-toy", recipe=FAST, progress=False, log="tensorboard", stop_after=3)
    assert Run(run).config()["log"] == "tensorboard"
    train(run, resume=True, progress=False)  # keeps logging to tb/ (config.json says so), from update 2 on
    metrics = Run(run).metrics()
    want = expected_scalars(metrics)
    got = event_scalars(Run(run).tb_dir)
    kinds = {tag.split("/")[0] for tag in want}
    assert kinds == {"session", "train", "eval"}, "train, eval and session rows all reach TensorBoard"
    assert any(t.startswith("train/per_type/") for t in want) and any(t.startswith("eval/dev_accuracy/") for t in want)
    assert any(t == "train/grad_cosine" for t in want), "the gradient diagnostics rows too"
    types = {t for row in metrics if row["event"] == "train" for t in row["per_type"]}
    per_type = {f"train/{k}/{t}" for t in types for k in ("ce", "policy_loss", "grad_norm", "grad_share")}
    per_type |= {f"train/reward/{t}/mean" for t in types}
    assert len(types) == 3 and per_type <= set(got), "the objective per type is on TensorBoard"
    assert [s for s, _ in got["train/grad_share/choice"]] == [1, 2, 3, 4]  # diagnostics_every = 1
    assert got == want  # the same tags, steps and (float32) values; update 3 of the killed session is purged
    assert [s for s, _ in got["train/loss"]] == [1, 2, 3, 4]


def test_resume_can_turn_tracking_on_and_records_it(tmp_path, data_dir):
    run = tmp_path / "run"
    train(run, data_dir=data_dir, model="tiny-toy", recipe=FAST.with_(steps=2), progress=False)
    assert Run(run).config()["log"] == "none" and not Run(run).tb_dir.exists()
    train(run, resume=True, steps=3, progress=False, log="tensorboard")
    assert Run(run).config()["log"] == "tensorboard"
    metrics = Run(run).metrics()
    resumed = max(i for i, row in enumerate(metrics) if row["event"] == "session")
    got = event_scalars(Run(run).tb_dir)
    assert got == expected_scalars(metrics[resumed:])  # every row logged from the resume on
    assert [s for s, _ in got["train/loss"]] == [3]


def test_scalars_flatten_nested_rows_and_skip_non_numbers():
    row = {"event": "train", "step": 7, "loss": 1.5, "examples": 32, "resume": True, "device": "cpu",
           "per_type": {"choice": {"entropy": 0.25, "n": 3}}, "dev_accuracy": {"synth/en": 0.5}}
    assert scalars(row) == {"train/loss": 1.5, "train/examples": 32.0, "train/per_type/choice/entropy": 0.25,
                            "train/per_type/choice/n": 3.0, "train/dev_accuracy/synth/en": 0.5}


def test_unknown_or_missing_tracker_is_refused_before_anything_is_written(tmp_path, data_dir, monkeypatch):
    with pytest.raises(OptionError, match="unknown tracker"):
        check_tracker("wandb")
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as when the extra is not installed
    with pytest.raises(OptionError, match=r"pip install 'rlcd\[tracking\]'"):
        train(tmp_path / "run", data_dir=data_dir, model="tiny-toy", recipe=FAST, progress=False, log="tensorboard")
    assert not (tmp_path / "run").exists()


def test_cli_log_option(tmp_path, data_dir):
    from typer.testing import CliRunner

    from rlcd.cli import app

    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["train", str(run), "--data", str(data_dir), "--model", "tiny-toy", "--steps", "1",
                                   "--log", "tensorboard", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["step"] == 1  # stdout is the result alone; progress and notices are on stderr
    assert "train: 1/1 updates (100%)" in res.stderr
    assert event_scalars(Run(run).tb_dir)["train/loss"][0][0] == 1
    res = CliRunner().invoke(app, ["train", str(tmp_path / "other"), "--data", str(data_dir), "--log", "wandb"])
    assert res.exit_code == 2 and "--log" in res.stderr
