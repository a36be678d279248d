"""Experiment tracking: every scalar of metrics.jsonl mirrored to TensorBoard event files in RUN/tb/.

`rlcd train --log tensorboard` (recorded as `config["log"]`; `none` is the default) hands each row
that train() appends to metrics.jsonl to a `TensorBoardTracker` as well, so the event files hold
exactly what the log holds. A row becomes scalars by `scalars(row)`:

    tag   = "{event}/{key}", nested dicts joined by "/"   (train/loss, train/per_type/choice/entropy,
                                                           eval/dev_accuracy/<group>, session/world_size)
    step  = row["step"]
    value = every int or float leaf (bools and strings are not measurements and are left out)

Values are stored as TensorBoard scalars, float32 (`float(np.float32(value))` of the log's float64):
TensorBoard's fast data server (the default reader) does not show float64 scalar tensors. Every training session opens its event file with a
SessionLog START (SummaryWriter's `purge_step`): TensorBoard takes the first as the start and each
later one as a restart, dropping the earlier events at or after its step. A resume from update S
drops the log lines after S (`Run.trim_metrics`) and starts at S + 1, so the curves lose the same
points the log lost. Open them with `tensorboard --logdir RUN/tb`.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from rlcd.errors import OptionError
from rlcd.run import Run

TRACKERS = ("none", "tensorboard")
INSTALL_HINT = "pip install 'rlcd[tracking]'"


def flatten(obj: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(key path joined by '/', leaf value) for every leaf of nested dicts."""
    for key, value in obj.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            yield from flatten(value, path)
        else:
            yield path, value


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars of one metrics.jsonl row: {tag: value} (see the module docstring)."""
    event = row.get("event", "metrics")
    body = {k: v for k, v in row.items() if k not in ("event", "step")}
    return {f"{event}/{path}": float(v) for path, v in flatten(body)
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def check_tracker(kind: str) -> str:
    """`kind` when it names a tracker that can run here, else a one-line OptionError saying what to do."""
    if kind not in TRACKERS:
        raise OptionError(f"--log {kind}: unknown tracker; use one of {', '.join(TRACKERS)}")
    if kind == "tensorboard":
        try:
            import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
        except ImportError:
            raise OptionError(f"--log tensorboard needs the optional `tensorboard` package: {INSTALL_HINT}") from None
    return kind


class TensorBoardTracker:
    """Writes `scalars(row)` of each logged row at its step; flushed per row, so a crash loses nothing."""

    def __init__(self, run: Run, *, purge_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = run.tb_dir
        self.writer = SummaryWriter(str(self.log_dir), purge_step=purge_step)

    def log(self, row: Mapping[str, Any]) -> None:
        step = int(row.get("step", 0))
        for tag, value in scalars(row).items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_tracker(kind: str, run: Run, *, resume_step: int | None = None) -> TensorBoardTracker | None:
    """The tracker a run logs to (None for `none`); `resume_step`: the update a resume starts from."""
    if check_tracker(kind) == "none":
        return None
    return TensorBoardTracker(run, purge_step=0 if resume_step is None else resume_step + 1)


__all__ = ["TRACKERS", "TensorBoardTracker", "check_tracker", "flatten", "open_tracker", "scalars"]
