"""The loop: update, log, evaluate and select, checkpoint, stop. Setup lives in `rlcd.train.setup`."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from rlcd.progress import Progress
from rlcd.recipe import Recipe

from .distributed import finish_distributed
from .setup import Trainer, early_stop_notice, setup


def train(run_dir: Path, **kwargs: Any) -> dict:
    """Train (or resume) the run at `run_dir`; returns the final state dict (state.json's content).

    Holds the run's lock (`Run.lock`, rank 0) until the end. Inputs are checked and the model is built
    before anything is written, so a failed start leaves no run directory behind. `stop_after` ends the
    process after that many updates without a final evaluation, as a kill would (used to test resume
    equivalence). `backbone` hands `build_model` a ready backbone (tests, benchmarks). `progress=False`
    silences the progress display (stderr); `feature_cache=False` runs the frozen backbone live in a
    head-only phase instead of reading the data directory's feature cache (same numbers within float
    noise, slower). `log` is the experiment tracker (`rlcd.tracking`: "none", the default of a new run, or
    "tensorboard"); a resume keeps the run's own unless `log` is given, and records the change. `init`: a
    new run starts from that run's dev-selected (best) trainable weights -- LoRA, head and centring
    buffers -- with a fresh optimizer and schedule (same backbone required). See `rlcd.train.setup.setup`.
    """
    try:
        out = _setup_and_fit(run_dir, **kwargs)  # the trainer (and DDP, which holds the group) is released here
    except BaseException:
        finish_distributed(clean=False)
        raise
    finish_distributed()
    return out


def _setup_and_fit(run_dir: Path, **kwargs: Any) -> dict:
    with contextlib.ExitStack() as held:
        t = setup(run_dir, held=held, **kwargs)
        return t.finished if t.finished is not None else fit(t)


def fit(t: Trainer) -> dict:
    """Run the remaining updates of `t`'s recipe; returns the final state.json content."""
    s, state, r, writer = t.session, t.state, t.session.recipe, t.writer
    if state.step == 0:
        t.select(0)
        writer.checkpoint("last", s, state)
    bar = Progress("train", r.steps, unit="updates", start=state.step, enabled=s.dist.main and t.progress)
    trainable = s.trainable()
    rate = Throughput()
    start = state.step
    for step in range(start, r.steps):
        if t.stop_after is not None and step - start >= t.stop_after:
            break  # as a kill would: no final evaluation, no final checkpoint
        stats = s.update(step, trainable, where=f" and {t.run.checkpoint('last')} is intact")
        done = state.step = step + 1
        rate.add(stats)
        if log_due(done, r):
            writer.log({"event": "train", "step": done, **{k: v for k, v in stats.items() if not k.startswith("_")},
                        "examples": stats["_examples"], **rate.take(),
                        "consumed": dict(sorted(s.consumed.items()))})
        if done % r.eval_every == 0 or done == r.steps:
            t.select(done)
        bar.update(done, progress_info(stats, state.score, s.dev_rows))
        if done % r.checkpoint_every == 0 or done == r.steps or state.stopped_early is not None:
            writer.checkpoint("last", s, state)
        if state.stopped_early is not None:
            break
    bar.close()
    if s.dist.main and state.stopped_early is not None:
        t.print_fn(early_stop_notice(t.run, state, r))
    writer.close()
    s.dist.barrier()
    return state.snapshot(s)


class Throughput:
    """Examples and tokens per second over the updates since the last logged row."""

    def __init__(self):
        self.t, self.examples, self.tokens = time.perf_counter(), 0, 0

    def add(self, stats: dict[str, Any]) -> None:
        self.examples += stats["_examples"]
        self.tokens += stats["_tokens"]

    def take(self) -> dict[str, float]:
        now = time.perf_counter()
        dt = max(now - self.t, 1e-9)
        out = {"examples_per_s": self.examples / dt, "tokens_per_s": self.tokens / dt}
        self.t, self.examples, self.tokens = now, 0, 0
        return out


def log_due(done: int, r: Recipe) -> bool:
    """Whether update `done` (1-based) writes a train row: every `log_every`, the last update, and every
    `diagnostics_every` (its diagnostics exist on that update only), whatever the two cadences."""
    diag = r.diagnostics_every > 0 and done % r.diagnostics_every == 0
    return done % r.log_every == 0 or done == r.steps or diag


def progress_info(stats: dict[str, Any], score: float | None, dev_rows: int = 1) -> str:
    """Loss, CE and the last dev score for the progress display ("no dev rows" on an empty dev subset)."""
    loss, ce = stats.get("loss"), stats.get("ce_loss")
    if loss is None or ce is None:
        return ""
    dev = "no dev rows" if not dev_rows else f"dev {'-' if score is None else f'{score:.4f}'}"
    return f"loss {loss:.4f} ce {ce:.4f} {dev}"


__all__ = ["train", "fit", "log_due", "progress_info", "Throughput"]
