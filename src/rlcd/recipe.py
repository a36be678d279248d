"""The training recipe: every constant and the LR schedule, nothing else.

Users turn five knobs (`steps`, `seed`, `objective`, `sigma`, `ce_weight`); the rest is the recipe
and is frozen into every run's `config.json`. Any field can still be overridden
(`rlcd train --recipe FIELD=VALUE`, `rlcd sweep --grid FIELD=...`, typed by the same `coerce_value`);
a run whose non-knob fields differ from the pinned values records them as `recipe_deviations` and
says so when it starts. A resume may only raise `steps`.
"""

from __future__ import annotations

import math
import typing
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Sequence

from rlcd.errors import OptionError

KNOBS = ("steps", "seed", "objective", "sigma", "ce_weight")
CHOICE_ORDERS = ("balanced", "given")  # rlcd.data.sampling.orders_of: what a frozen-feature cache keeps per choice row
SELECT_BY = ("macro_accuracy", "nll")  # dev selection scores: group-macro top-1 accuracy (higher), pooled NLL (lower)


@dataclass(frozen=True)
class Recipe:
    # --- knobs -------------------------------------------------------------------------------
    steps: int = 3600            # optimizer updates (3,600 x 32 = 115,200 sampled examples)
    seed: int = 0
    objective: str = "rlcd"      # "rlcd" | "ce"  (RL-only = rlcd with ce_weight 0)
    sigma: float = 0.3           # std of the Gaussian logit perturbations
    ce_weight: float = 1.0       # weight of the soft cross-entropy term
    # --- RLCD arms (the pinned values compute exactly the pinned recipe's numbers) -----------
    sigma_end: float | None = None  # None: constant sigma; else linear sigma -> sigma_end over the decay horizon
    n_perturbations: int = 4     # Gaussian logit samples per question (G)
    w_spherical: float = 0.75    # reward weight of the spherical score
    w_rps: float = 1.0           # reward weight of the RPS penalty (score questions)
    w_log: float = 1.0           # reward weight of the floored log score (0 removes it)
    advantage_norm: str = "batch"  # advantage std: "batch" (one per micro-batch) or "type" (one per question type)
    # --- what learns (LP-FT) -------------------------------------------------------------------
    head_only: bool = False      # the scorer alone learns on frozen (cached) backbone features; LoRA stays 0
    head_warmup: int = 0         # head-only updates before LoRA joins (schedule and horizon unchanged)
    lora_layers: int | None = None  # LoRA on the top K decoder layers only (None: every layer); below is frozen
    backbone_layers: int | None = None  # read the decision states after the first N decoder layers (then the final
                                 # norm); the layers above are dropped at load (None: all). Cheaper forwards where a
                                 # middle layer reads the task as well as the top (the demo: rlcd.demo)
    frozen_precision: str = "float32"  # what the frozen part computes in when it is cached: the layers below the cut
                                 # (cut-state cache) and a head phase's features; "bfloat16": under bfloat16 autocast,
                                 # ~2x faster on a CPU with AVX512-BF16 (rlcd.cut_cache). Trained layers stay float32
    init_head: str = "keep"      # an --init start: "keep" the given head (no warm-up, peak <= its source's last LR)
                                 # or "rewarm" it like a fresh one (warm-up to lr_head)
    # --- sampling ----------------------------------------------------------------------------
    batch_size: int = 8          # examples per micro-batch
    grad_accum: int = 4          # micro-batches per update, split over DDP ranks (global batch 32)
    pool_cap: int = 6000         # eligible training rows per sampling group
    dev_cap: int = 256           # dev rows per sampling group (selection subset)
    batch_by: str = "row"        # "row": rows drawn one by one; "case": whole cases, each state forwarded once
    forms: str = "base"          # "base": original rows only; "derived": a share of each micro-batch drawn from the
                                 # derived question forms of `rlcd data derive` (rlcd.data.sampling.derived_slots)
    forms_share: float = 0.25    # with forms=derived: the share of each micro-batch's rows that are derived forms
    choice_orders: str = "balanced"  # frozen features of a train choice row: its "balanced" candidate orders (the
                                 # sampler draws one of them), or its "given" order only (1 entry, not K! or <= 8)
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
    patience: int | None = None  # dev evaluations without strict improvement before stopping; None: fixed budget
    select_by: str = "macro_accuracy"  # the best checkpoint: dev group-macro accuracy (pinned) or dev "nll" (lowest)
    # --- model -------------------------------------------------------------------------------
    lora_rank: int = 8
    lora_alpha: int = 16
    proj_dim: int = 256
    centring: str = "running_mean"

    def __post_init__(self) -> None:
        if self.objective not in ("rlcd", "ce"):
            raise OptionError(f"objective must be 'rlcd' or 'ce', got {self.objective!r}")
        if not self.sigma > 0:
            raise OptionError(f"sigma must be > 0, got {self.sigma}")
        if not self.ce_weight >= 0:
            raise OptionError(f"ce_weight must be >= 0, got {self.ce_weight}")
        if self.sigma_end is not None and not (_real(self.sigma_end) and self.sigma_end > 0):
            raise OptionError(f"sigma_end must be none (constant sigma) or a number > 0, got {self.sigma_end!r}")
        if not (isinstance(self.n_perturbations, int) and self.n_perturbations >= 2):
            raise OptionError(f"n_perturbations must be an integer >= 2 (the baseline needs two samples), "
                              f"got {self.n_perturbations!r}")
        for name in ("w_spherical", "w_rps", "w_log"):
            if not (_real(getattr(self, name)) and getattr(self, name) >= 0):
                raise OptionError(f"{name} must be a finite number >= 0, got {getattr(self, name)!r}")
        if self.batch_by not in ("row", "case"):
            raise OptionError(f"batch_by must be 'row' or 'case', got {self.batch_by!r}")
        if self.forms not in ("base", "derived"):
            raise OptionError(f"forms must be 'base' (original rows only) or 'derived' (a share of each micro-batch "
                              f"from `rlcd data derive` rows), got {self.forms!r}")
        if not (_real(self.forms_share) and 0 < self.forms_share < 1):
            raise OptionError(f"forms_share must be a number in (0, 1) (the derived share of a micro-batch), got "
                              f"{self.forms_share!r}")
        if self.advantage_norm not in ("batch", "type"):
            raise OptionError(f"advantage_norm must be 'batch' or 'type', got {self.advantage_norm!r}")
        for name in ("steps", "batch_size", "grad_accum", "pool_cap", "dev_cap", "eval_every", "checkpoint_every",
                     "log_every", "horizon_cap", "lora_rank", "proj_dim"):
            if getattr(self, name) < 1:
                raise OptionError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not isinstance(self.head_only, bool):
            raise OptionError(f"head_only must be true or false, got {self.head_only!r}")
        if not (isinstance(self.head_warmup, int) and not isinstance(self.head_warmup, bool)
                and 0 <= self.head_warmup <= self.steps):
            raise OptionError(f"head_warmup must be an integer in [0, steps={self.steps}] (head-only updates before "
                              f"LoRA joins), got {self.head_warmup!r}")
        if self.head_only and self.head_warmup:
            raise OptionError("head_only=true and head_warmup>0 both given: a head-only run never lets LoRA join; "
                              "use one of them")
        if self.lora_layers is not None:
            if not (isinstance(self.lora_layers, int) and not isinstance(self.lora_layers, bool)
                    and self.lora_layers >= 1):
                raise OptionError(f"lora_layers must be none (LoRA on every layer) or an integer >= 1 (LoRA on the top "
                                  f"K decoder layers), got {self.lora_layers!r}")
            if self.head_only:
                raise OptionError("lora_layers and head_only=true both given: a head-only run trains no LoRA, so there "
                                  "are no LoRA layers to choose; use one of them")
        if self.backbone_layers is not None and not (isinstance(self.backbone_layers, int)
                                                     and not isinstance(self.backbone_layers, bool)
                                                     and self.backbone_layers >= 1):
            raise OptionError(f"backbone_layers must be none (every decoder layer) or an integer >= 1 (the first N "
                              f"decoder layers), got {self.backbone_layers!r}")
        if self.diagnostics_every < 0:
            raise OptionError(f"diagnostics_every must be >= 0 (0 = off), got {self.diagnostics_every}")
        if self.patience is not None and not (isinstance(self.patience, int) and not isinstance(self.patience, bool)
                                              and self.patience >= 1):
            raise OptionError(f"patience must be none (the fixed budget) or an integer >= 1, got {self.patience!r}")
        if self.frozen_precision not in ("float32", "bfloat16"):
            raise OptionError(f"frozen_precision must be float32 or bfloat16 (what the cached frozen layers compute "
                              f"in), got {self.frozen_precision!r}")
        if self.frozen_precision != "float32" and not (self.lora_layers is not None or self.head_only
                                                       or self.head_warmup):
            raise OptionError(f"frozen_precision={self.frozen_precision} applies to cached frozen layers (lora_layers=K, "
                              f"head_only=true or head_warmup>0); with LoRA on every layer nothing is frozen")
        if self.init_head not in ("keep", "rewarm"):
            raise OptionError(f"init_head must be 'keep' (an --init head keeps its learning rate: no warm-up, peak at "
                              f"most its source's last LR) or 'rewarm', got {self.init_head!r}")
        if self.select_by not in SELECT_BY:
            raise OptionError(f"select_by must be one of {', '.join(SELECT_BY)} (the dev score that picks the best "
                              f"checkpoint), got {self.select_by!r}")
        if self.choice_orders not in CHOICE_ORDERS:
            raise OptionError(f"choice_orders must be one of {', '.join(CHOICE_ORDERS)} (the candidate orders the "
                              f"frozen-feature cache keeps per train choice row), got {self.choice_orders!r}")
        if self.choice_orders != "balanced" and self.lora_layers is not None:
            raise OptionError("choice_orders applies to the frozen-feature cache only; lora_layers reads the cut-state "
                              "cache, which keeps the balanced orders")
        if self.centring not in ("running_mean", "layernorm", "none"):
            raise OptionError(f"centring must be running_mean, layernorm or none, got {self.centring!r}")
        for name in ("lr_lora", "lr_head", "grad_clip", "lora_alpha"):
            if not getattr(self, name) > 0:
                raise OptionError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.lr_floor <= 1 or not 0 <= self.warmup_frac < 1 or self.weight_decay < 0:
            raise OptionError("lr_floor must be in [0, 1], warmup_frac in [0, 1) and weight_decay >= 0")

    def decay_horizon(self) -> int:
        return min(self.steps, self.horizon_cap)

    def head_phase(self, step: int) -> bool:
        """True while update `step` (0-based) trains the head alone on frozen features."""
        return self.head_only or step < self.head_warmup

    def sigma_at(self, step: int, horizon: int) -> float:
        """sigma of update `step` (0-based) for decay horizon D.

        ``sigma`` itself when ``sigma_end`` is None; else ``sigma + (sigma_end - sigma) * min(1, step / D)``:
        linear from ``sigma`` at the first update to ``sigma_end`` at update D, then constant (also after
        a budget extension, which keeps D), like the LR schedule.
        """
        if self.sigma_end is None:
            return self.sigma
        return self.sigma + (self.sigma_end - self.sigma) * min(1.0, step / max(1, horizon))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise OptionError(f"unknown recipe fields: {sorted(unknown)}")
        return cls(**d)

    def with_(self, **kw) -> "Recipe":
        return replace(self, **kw)

    def deviations(self) -> dict[str, dict[str, Any]]:
        """Non-knob fields that differ from the pinned recipe: {field: {"value", "pinned"}}."""
        pinned = Recipe()
        return {f.name: {"value": getattr(self, f.name), "pinned": getattr(pinned, f.name)}
                for f in fields(self) if f.name not in KNOBS and getattr(self, f.name) != getattr(pinned, f.name)}


def _real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def field_types() -> dict[str, Any]:
    """{field: annotated type} of the Recipe (e.g. int, float, str, `float | None`)."""
    return typing.get_type_hints(Recipe)


def coerce_value(key: str, value: Any, *, flag: str = "--recipe") -> Any:
    """A string (or number) converted to the type of Recipe field `key`; OptionError naming the rule."""
    types = field_types()
    if key not in types:
        raise OptionError(f"{flag} {key}: not a recipe field (fields: {', '.join(sorted(types))})")
    kind = types[key]
    optional = type(None) in typing.get_args(kind)
    if optional:
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
            return None
    try:
        if kind is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                return value.lower() in ("true", "1")
            return bool(value)
        if kind is int:
            f = float(value)
            if f != int(f):
                raise ValueError(value)
            return int(f)
        if kind is float:
            f = float(value)
            if not math.isfinite(f):
                raise ValueError(value)
            return f
        return str(value).strip()
    except (TypeError, ValueError):
        name = getattr(kind, "__name__", str(kind))
        raise OptionError(f"{flag} {key}={value}: not a valid {name}{' (or none)' if optional else ''}") from None


def parse_overrides(specs: Sequence[str], *, flag: str = "--recipe") -> dict[str, Any]:
    """`["lora_rank=4", "eval_every=50"]` -> {"lora_rank": 4, "eval_every": 50} (typed, validated names)."""
    out: dict[str, Any] = {}
    for spec in specs:
        if "=" not in spec:
            raise OptionError(f"{flag} {spec!r}: expected FIELD=VALUE (e.g. {flag} lora_rank=4)")
        key, _, value = spec.partition("=")
        key = key.strip().replace("-", "_")
        if key in out:
            raise OptionError(f"{flag} {key} given twice")
        out[key] = coerce_value(key, value.strip(), flag=flag)
    return out


def warmup_steps(horizon: int, warmup_frac: float = 0.03) -> int:
    return max(1, round(warmup_frac * horizon))


def lr_factor(step: int, horizon: int, *, warmup_frac: float = 0.03, floor: float = 0.10,
              warmup: bool = True) -> float:
    """Multiplier of the peak LR for update `step` (0-based), a pure function of (step, horizon).

    Linear warm-up over W = round(0.03 D) updates reaching the peak at update W-1, cosine from the
    peak at update W down to `floor` at update D, then a constant `floor` (also after a budget
    extension, which keeps D). `warmup=False` (a head an --init start keeps): the peak during those
    W updates instead, the same cosine after.
    """
    w = warmup_steps(horizon, warmup_frac)
    if step < w:
        return (step + 1) / w if warmup else 1.0
    if horizon <= w:
        return floor
    progress = min(1.0, (step - w) / (horizon - w))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def head_lr(r: Recipe, step: int, horizon: int, kept_peak: float | None = None) -> float:
    """The head's LR for update `step`: `lr_head` times the schedule, or, for a head an --init start keeps
    (`kept_peak`, config "init"."head_lr_peak"), that peak times the schedule without its warm-up."""
    peak = r.lr_head if kept_peak is None else kept_peak
    return peak * lr_factor(step, horizon, warmup_frac=r.warmup_frac, floor=r.lr_floor, warmup=kept_peak is None)
