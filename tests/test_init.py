"""`rlcd train NEW --data D --init RUN`: a new run that starts from RUN's dev-selected trainable weights."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import synth_processed
from typer.testing import CliRunner

from rlcd import checkpoint as ckpt
from rlcd.cli import app
from rlcd.dev_evals import read_dev_eval
from rlcd.errors import OptionError
from rlcd.recipe import Recipe, lr_factor
from rlcd.run import Run
from rlcd.train import train

torch.set_num_threads(1)
FAST = dict(eval_every=1, checkpoint_every=1, log_every=1, diagnostics_every=0)
QUIET = dict(progress=False, print_fn=lambda _: None)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return synth_processed(tmp_path_factory.mktemp("data"), 40, seed=3)


@pytest.fixture(scope="module")
def source(tmp_path_factory, data_dir) -> Path:
    run = tmp_path_factory.mktemp("src") / "run"
    train(run, data_dir=data_dir, model="tiny-toy", recipe=Recipe(steps=3, lr_head=5e-3, **FAST), **QUIET)
    return run


def test_init_continues_the_source_weights_with_a_fresh_optimizer(tmp_path, data_dir, source):
    best = ckpt.load(source / "checkpoints" / "best")
    new = tmp_path / "new"
    recipe = Recipe(steps=2, seed=1, **FAST)
    state = train(new, data_dir=data_dir, model="tiny-toy", recipe=recipe, init=source, stop_after=0, **QUIET)
    assert state["step"] == 0
    start = ckpt.load(new / "checkpoints" / "last")
    assert start["weights"].keys() == best["weights"].keys()
    assert {"head.mu_d", "head.mu_c", "head.centring_ready"} <= set(start["weights"])  # the centring buffers came along
    assert float(start["weights"]["head.centring_ready"]) == 1.0
    for k, v in best["weights"].items():
        assert torch.equal(start["weights"][k], v), k
    assert not start["optimizer"]["state"]  # fresh AdamW moments
    # the first forward of the new run (its step-0 dev evaluation) is the source's best model, logit for logit
    assert read_dev_eval(Run(new), 0) == read_dev_eval(Run(source), best["state"]["best_step"])
    config = json.loads((new / "config.json").read_text())
    assert config["init"]["run"] == str(source.resolve()) and config["init"]["checkpoint"] == "best"
    assert config["init"]["step"] == best["state"]["best_step"]
    assert config["init"]["weights_sha256"] == ckpt.weights_sha256(source / "checkpoints" / "best")
    assert len(config["init"]["backbone_fingerprint"]) == 64

    # a resume of an initialised run continues its own stream; its head keeps the source's LR (no warm-up)
    train(new, resume=True, **QUIET)
    first = next(r for r in map(json.loads, (new / "metrics.jsonl").read_text().splitlines()) if r["event"] == "train")
    assert first["step"] == 1
    assert first["lr_head"] == pytest.approx(config["init"]["head_lr_peak"], rel=1e-12)

    from rlcd.report.run_sections import _init
    text = _init(SimpleNamespace(config=config)).text
    assert str(source.resolve()) in text and config["init"]["weights_sha256"] in text


def _source_last_head_lr(source: Path) -> float:
    """The LR of the source's last head update before its best checkpoint, from its config by hand."""
    cfg = json.loads((source / "config.json").read_text())
    best = ckpt.load(source / "checkpoints" / "best")["state"]["best_step"]
    r, horizon = cfg["recipe"], cfg["decay_horizon"]
    if best == 0:
        return r["lr_head"]
    w = max(1, round(r["warmup_frac"] * horizon))
    s = best - 1
    if s < w:
        return r["lr_head"] * (s + 1) / w
    progress = min(1.0, (s - w) / (horizon - w))
    return r["lr_head"] * (r["lr_floor"] + (1 - r["lr_floor"]) * 0.5 * (1 + math.cos(math.pi * progress)))


@pytest.mark.parametrize("init_head,lr_head", [("keep", 1e-2), ("keep", 1e-5), ("rewarm", 1e-2)])
def test_init_keeps_the_head_it_was_given(tmp_path, data_dir, source, init_head, lr_head):
    """An --init start does not re-warm the head it is given: its head LR starts at its peak, which is at most the
    LR its source last trained it with (a larger lr_head is capped, a smaller one kept), and follows the cosine;
    LoRA warms up as usual. `init_head=rewarm` is the old schedule (head warmed up to lr_head)."""
    new = tmp_path / "new"
    recipe = Recipe(steps=4, warmup_frac=0.5, lr_head=lr_head, init_head=init_head, **FAST)  # W = 2 updates
    said = []
    train(new, data_dir=data_dir, model="tiny-toy", recipe=recipe, init=source, progress=False, print_fn=said.append)
    config = json.loads((new / "config.json").read_text())
    rows = [r for r in map(json.loads, (new / "metrics.jsonl").read_text().splitlines()) if r["event"] == "train"]
    src_lr = _source_last_head_lr(source)
    assert config["init"]["head_lr"] == pytest.approx(src_lr, rel=1e-12)
    lora = [recipe.lr_lora * lr_factor(s, 4, warmup_frac=0.5, floor=recipe.lr_floor) for s in range(4)]
    assert [r["lr_lora"] for r in rows] == pytest.approx(lora, rel=1e-12)
    if init_head == "keep":
        peak = min(lr_head, src_lr)
        assert config["init"]["head_lr_peak"] == pytest.approx(peak, rel=1e-12)
        expected = [peak * lr_factor(s, 4, warmup_frac=0.5, floor=recipe.lr_floor, warmup=False) for s in range(4)]
        assert expected[0] == expected[1] == peak  # no warm-up: the first updates run at the peak
        assert any("--init: the head keeps its training" in line for line in said)
    else:
        assert "head_lr_peak" not in config["init"]
        expected = [lr_head * f for f in (0.5, 1.0)] + [lr_head * lr_factor(s, 4, warmup_frac=0.5) for s in (2, 3)]
        assert any("warmed up again" in line for line in said)
    assert [r["lr_head"] for r in rows] == pytest.approx(expected, rel=1e-12)


def test_init_refuses_another_backbone_and_writes_nothing(tmp_path, data_dir, source):
    new = tmp_path / "new"
    with pytest.raises(OptionError, match="model seed 0.*model seed 1.*same backbone"):
        train(new, data_dir=data_dir, model="tiny-toy", model_seed=1, recipe=Recipe(steps=1, **FAST), init=source,
              **QUIET)
    with pytest.raises(OptionError, match="lora_rank 8 there, 4 here"):
        train(new, data_dir=data_dir, model="tiny-toy", recipe=Recipe(steps=1, lora_rank=4, **FAST), init=source,
              **QUIET)
    # same name, other weights: the source's export fingerprint catches it after the model is built
    other = tmp_path / "other"
    shutil.copytree(source, other)
    (other / "export").mkdir(exist_ok=True)
    (other / "export" / "model.json").write_text(json.dumps({"backbone_fingerprint": "0" * 64,
                                                             "backbone_fingerprint_rounding": "bfloat16"}))
    with pytest.raises(OptionError, match="fingerprint differs"):
        train(new, data_dir=data_dir, model="tiny-toy", recipe=Recipe(steps=1, **FAST), init=other, **QUIET)
    assert not new.exists()

    res = CliRunner().invoke(app, ["train", str(new), "--data", str(data_dir), "--model", "tiny", "--init",
                                   str(source)])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--init" in lines[0] and "same backbone" in lines[0], res.stderr
    assert not new.exists()
    for args, needle in ((["--init", str(tmp_path / "nosuch")], "no such run directory"),
                         (["--resume", str(source), "--init", str(source)], "--init")):
        res = CliRunner().invoke(app, ["train", *(["--data", str(data_dir), str(new)] if args[0] == "--init" else []),
                                       *args])
        assert res.exit_code == 2 and needle in res.stderr and "Traceback" not in res.output, res.output
    assert not new.exists()


def test_an_init_run_holds_its_lock_while_it_trains(tmp_path, data_dir, source):
    """Like every new run, a run started with --init holds RUN/.lock from its creation to its end, so a second
    writer (evaluate, another trainer) is refused while it trains."""
    import os

    from rlcd.objectives import ce_loss

    new = tmp_path / "new"
    seen = []

    def objective(logits, batch, index):
        seen.append((new / ".lock").read_text())
        return ce_loss(logits, batch.cand_mask, batch.target)

    train(new, data_dir=data_dir, model="tiny-toy", recipe=Recipe(steps=1, grad_accum=1, **FAST), init=source,
          objective_fn=objective, **QUIET)
    assert seen == [f"{os.getpid()} train\n"]
    assert (new / ".lock").read_text() == ""  # released at the end
