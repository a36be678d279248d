"""What a run writes while it trains: metrics.jsonl rows (mirrored to the tracker) and the checkpoints.

`TrainState` is what `state.json` records beside the weights: where the run is and what selection has
seen. Only rank 0 writes (`RunWriter(enabled=...)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcd import checkpoint as ckpt
from rlcd.run import Run


@dataclass
class TrainState:
    step: int = 0
    best_score: float | None = None
    best_step: int | None = None
    score: float | None = None
    evals_since_best: int = 0
    stopped_early: int | None = None

    @classmethod
    def from_checkpoint(cls, saved: dict[str, Any]) -> "TrainState":
        """The state a checkpoint's state.json holds (runs written before patience existed lack its two keys)."""
        return cls(step=saved["step"], best_score=saved["best_score"], best_step=saved["best_step"],
                   score=saved["score"], evals_since_best=saved.get("evals_since_best", 0),
                   stopped_early=saved.get("stopped_early"))

    def snapshot(self, s) -> dict[str, Any]:
        """state.json of session `s` at this state (also what `train()` returns)."""
        return {"step": self.step, "best_score": self.best_score, "best_step": self.best_step, "score": self.score,
                "consumed": dict(s.consumed), "evals_since_best": self.evals_since_best,
                "stopped_early": self.stopped_early, "recipe": s.recipe.to_dict(), "world_size": s.dist.world,
                "decay_horizon": s.horizon}


class RunWriter:
    """Rank-0-only writer of metrics.jsonl (and of the tracker, which sees every row it gets) and checkpoints."""

    def __init__(self, run: Run, enabled: bool, tracker=None):
        self.run = run
        self.enabled = enabled
        self.tracker = tracker

    def log(self, row: dict) -> None:
        if self.enabled:
            self.run.log(row)
            if self.tracker is not None:
                self.tracker.log(row)

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()

    def checkpoint(self, name: str, s, state: TrainState) -> None:
        if self.enabled:
            ckpt.save(self.run.checkpoint(name), weights=s.model.trainable_state_dict(),
                      optimizer=s.optimizer.state_dict(), state=state.snapshot(s))


__all__ = ["TrainState", "RunWriter"]
