"""The training recipe: every constant and the LR schedule, nothing else.

Users turn five knobs (`steps`, `seed`, `objective`, `sigma`, `ce_weight`); the rest is the recipe
and is frozen into every run's `config.json`. A resume may only raise `steps`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

KNOBS = ("steps", "seed", "objective", "sigma", "ce_weight")


@dataclass(frozen=True)
class Recipe:
    # --- knobs -------------------------------------------------------------------------------
    steps: int = 3600            # optimizer updates (3,600 x 32 = 115,200 sampled examples)
    seed: int = 0
    objective: str = "rlcd"      # "rlcd" | "ce"  (RL-only = rlcd with ce_weight 0)
    sigma: float = 0.3           # std of the Gaussian logit perturbations
    ce_weight: float = 1.0       # weight of the soft cross-entropy term
    # --- sampling ----------------------------------------------------------------------------
    batch_size: int = 8          # examples per micro-batch
    grad_accum: int = 4          # micro-batches per update (per process)
    pool_cap: int = 6000         # eligible training rows per sampling group
    dev_cap: int = 256           # dev rows per sampling group (selection subset)
    # --- optimisation ------------------------------------------------------------------------
    lr_lora: float = 1e-4
    lr_head: float = 5e-4
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    warmup_frac: float = 0.03    # of the decay horizon
    horizon_cap: int = 2400      # decay horizon D = min(steps, 2400), fixed at first start
    lr_floor: float = 0.10       # cosine ends at, then stays at, 10% of peak
    # --- cadence -----------------------------------------------------------------------------
    eval_every: int = 400
    checkpoint_every: int = 100
    log_every: int = 10
    diagnostics_every: int = 100
    # --- model -------------------------------------------------------------------------------
    lora_rank: int = 8
    lora_alpha: int = 16
    proj_dim: int = 256
    centring: str = "running_mean"

    def __post_init__(self) -> None:
        if self.objective not in ("rlcd", "ce"):
            raise ValueError(f"objective must be 'rlcd' or 'ce', got {self.objective!r}")
        if not self.sigma > 0:
            raise ValueError(f"sigma must be > 0, got {self.sigma}")
        if not self.ce_weight >= 0:
            raise ValueError(f"ce_weight must be >= 0, got {self.ce_weight}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")

    def decay_horizon(self) -> int:
        return min(self.steps, self.horizon_cap)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown recipe fields: {sorted(unknown)}")
        return cls(**d)

    def with_(self, **kw) -> "Recipe":
        return replace(self, **kw)


def warmup_steps(horizon: int, warmup_frac: float = 0.03) -> int:
    return max(1, round(warmup_frac * horizon))


def lr_factor(step: int, horizon: int, *, warmup_frac: float = 0.03, floor: float = 0.10) -> float:
    """Multiplier of the peak LR for update `step` (0-based), a pure function of (step, horizon).

    Linear warm-up over W = round(0.03 D) updates reaching the peak at update W-1, cosine from the
    peak at update W down to `floor` at update D, then a constant `floor` (also after a budget
    extension, which keeps D).
    """
    w = warmup_steps(horizon, warmup_frac)
    if step < w:
        return (step + 1) / w
    if horizon <= w:
        return floor
    progress = min(1.0, (step - w) / (horizon - w))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
