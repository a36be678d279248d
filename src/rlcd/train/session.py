"""One optimizer update: `Session.update(step)`, the whole of it, for `rlcd train` and `rlcd bench train`.

Data order is a pure function of (seed, absolute micro-batch index) and the RLCD logit noise is drawn
from a generator seeded by the same pair, so a resumed run continues the exact stream of an uninterrupted
one. Where each micro-batch's features come from is the `SourcePlan`'s business (`rlcd.train.sources`).
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from rlcd.diagnostics import ObjectiveDiagnostics, RewardDiagnostics, TypeDiagnostics
from rlcd.objectives import ce_loss, gradient_diagnostics, reward_samples, rlcd_loss, row_terms
from rlcd.recipe import Recipe, head_lr, lr_factor
from rlcd.schema import Record

from .distributed import Dist, micro_indices, reduce_stats
from .sources import Source, SourcePlan


class TrainingDiverged(RuntimeError):
    """A non-finite loss or gradient: the update was not applied, the last checkpoint is intact."""


def noise_generator(seed: int, index: int) -> torch.Generator:
    """CPU generator for the logit noise of micro-batch `index`: resume- and device-independent."""
    return torch.Generator().manual_seed((seed * 1_000_003 + index) % (2**63 - 1))


@dataclass
class Session:
    """Everything one process needs to run updates: model, optimizer, data, sampler, recipe, sources."""

    recipe: Recipe
    horizon: int
    model: Any                      # DecisionModel
    wrapped: Any                    # DDP(model) or model
    optimizer: torch.optim.Optimizer
    collator: Any
    records: dict[str, Record]
    dev: dict[str, list[Record]]
    sampler: Any
    dist: Dist
    device: torch.device
    sources: SourcePlan
    consumed: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    objective_fn: Callable | None = None
    head_peak: float | None = None  # an --init head kept (config "init"."head_lr_peak"): its peak LR, no warm-up
    _fixed: dict = field(default_factory=dict)  # (id, order) -> the row in that fixed candidate order

    # ------------------------------------------------------------------ the objective
    def objective(self, logits, batch, index):
        r = self.recipe
        if r.objective == "ce":
            return ce_loss(logits, batch.cand_mask, batch.target)
        return rlcd_loss(logits, batch.cand_mask, batch.target, batch.ordinal, ce_weight=r.ce_weight,
                         noise=self.noise(index, logits), **self.rlcd_settings(index, batch))

    def noise(self, index: int, logits: torch.Tensor) -> torch.Tensor:
        """The logit noise of micro-batch `index`: [G, B, K] standard normal drawn from (seed, index)."""
        shape = (self.recipe.n_perturbations, *logits.shape)
        return torch.randn(shape, generator=noise_generator(self.recipe.seed, index)).to(logits.device)

    def rlcd_settings(self, index: int, batch) -> dict[str, Any]:
        """The RLCD arm of micro-batch `index`: its update's sigma, G, reward weights, advantage groups."""
        r = self.recipe
        return {"sigma": r.sigma_at(index // r.grad_accum, self.horizon), "n_perturbations": r.n_perturbations,
                "w_spherical": r.w_spherical, "w_rps": r.w_rps, "w_log": r.w_log,
                "norm_groups": batch.type_id if r.advantage_norm == "type" else None}

    def set_lr(self, step: int) -> dict[str, float]:
        """Each group's LR for update `step`: its peak times the recipe's schedule; a head an --init start keeps
        (`head_peak`) skips the warm-up, so it never climbs above what its source last trained it with."""
        r = self.recipe
        out = {}
        for g in self.optimizer.param_groups:
            if g["name"] == "head":
                g["lr"] = head_lr(r, step, self.horizon, self.head_peak)
            else:
                g["lr"] = r.lr_lora * lr_factor(step, self.horizon, warmup_frac=r.warmup_frac, floor=r.lr_floor)
            out[f"lr_{g['name']}"] = g["lr"]
        return out

    @property
    def dev_rows(self) -> int:
        return sum(len(rows) for rows in self.dev.values())

    def trainable(self) -> list:
        """Every parameter the optimizer holds (LoRA, then the head): what the gradient clip sees."""
        return [p for ps in self.model.param_groups().values() for p in ps]

    # ------------------------------------------------------------------ data
    def source_of(self, index: int) -> Source:
        return self.sources.for_update(index // self.recipe.grad_accum)

    def microbatch(self, index: int):
        """Micro-batch `index`, built by its update's source: whole cases when the source batches by case
        (`Sampler.case_microbatch`; the model then shares each state's prefix), else rows (`batch_of`)."""
        r, src = self.recipe, self.source_of(index)
        if src.by_case:
            cases = [self.rows_of(case, src) for case in self.sampler.case_microbatch(r.seed, index, r.batch_size)]
            return src.cases([rows for rows, _ in cases], [orders for _, orders in cases])
        return self.batch_of(self.sampler.microbatch(r.seed, index, r.batch_size), src)

    def batch_of(self, draws, src: Source):
        """The rows of `draws` as `src` builds them (`rows_of`)."""
        return src.rows("train", *self.rows_of(draws, src))

    def rows_of(self, draws, src: Source) -> tuple[list[Record], list[int]]:
        """The records of `draws` and their candidate orders. A source with fixed candidate orders (the caches,
        and the frozen backbone that must see the same rows) gives a choice row one of them (`order_of_draw`);
        otherwise every choice row is shuffled afresh (order 0: no cache entry is read)."""
        from rlcd.data.sampling import order_of_draw, shuffle_choice, with_fixed_order

        if not src.fixed_orders:
            return [shuffle_choice(self.records[d.id], d.perm_seed) for d in draws], [0] * len(draws)
        how = self.recipe.choice_orders if src.frozen else "balanced"  # the cut-state cache keeps the balanced set
        orders = [order_of_draw(self.records[d.id], d.perm_seed, how) for d in draws]
        rows = []
        for d, o in zip(draws, orders):
            key = (d.id, o)
            if key not in self._fixed:  # a pure function of the row: built once per run
                self._fixed[key] = with_fixed_order(self.records[d.id], o)
            rows.append(self._fixed[key])
        return rows, orders

    def draws(self, index: int) -> list:
        """The sampler draws of micro-batch `index` (a case micro-batch's cases flattened)."""
        r = self.recipe
        if self.source_of(index).by_case:
            return [d for case in self.sampler.case_microbatch(r.seed, index, r.batch_size) for d in case]
        return self.sampler.microbatch(r.seed, index, r.batch_size)

    def count_consumed(self, step: int) -> None:
        """Add the sampling groups of all of update `step`'s examples (every rank's: the stream is pure)."""
        r = self.recipe
        for index in range(step * r.grad_accum, (step + 1) * r.grad_accum):
            for d in self.draws(index):
                self.consumed[d.group] += 1

    # ------------------------------------------------------------------ one update
    def accumulate(self, step: int, *, diagnostics: bool = False,
                   mark: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Forward/backward this rank's micro-batches of update `step`; gradients left in .grad.

        `mark(part)` (optional) is called as each part of the work ends -- "data", "forward",
        "objective", "backward", "other" -- so `rlcd bench train` can time this very code.
        """
        mark = mark or (lambda part: None)
        r = self.recipe
        self.optimizer.zero_grad(set_to_none=True)
        indices = micro_indices(step, accum=r.grad_accum, rank=self.dist.rank, world=self.dist.world)
        n_local = len(indices)
        stats_sum: dict[str, float] = defaultdict(float)
        per_type, by_type = TypeDiagnostics(), ObjectiveDiagnostics()
        rewards = RewardDiagnostics() if diagnostics and r.objective == "rlcd" else None
        tokens = examples = 0
        finite = True
        diag = None
        mark("other")
        for j, index in enumerate(indices):
            batch = self.microbatch(index)
            mark("data")
            sync = j == len(indices) - 1
            ctx = self.wrapped.no_sync() if (self.dist.active and not sync) else contextlib.nullcontext()
            with ctx:
                logits = self.wrapped(batch)
                mark("forward")
                loss, stats = (self.objective_fn or self.objective)(logits, batch, index)
                mark("objective")
                finite &= math.isfinite(stats["loss"])
                (loss / n_local).backward()
                mark("backward")
            for k, v in stats.items():
                stats_sum[k] += v / n_local
            per_type.add(logits.detach(), batch)
            tokens += int(batch.n_tokens)
            examples += len(batch.ids)
            args = (logits.detach(), batch.cand_mask, batch.target, batch.ordinal)
            rl = diagnostics and r.objective == "rlcd"
            kw = {"noise": self.noise(index, logits), **self.rlcd_settings(index, batch)} if rl else {}
            by_type.add(row_terms(*args, objective=r.objective, full=diagnostics, ce_weight=r.ce_weight, **kw),
                        batch.type_id)
            if rewards is not None:
                rewards.add(reward_samples(*args, **kw), batch.type_id, batch.ordinal)
                if diag is None:
                    d = gradient_diagnostics(*args, **kw)
                    diag = {"grad_cosine": float(d["grad_cosine"]), "grad_norm_ratio": float(d["grad_norm_ratio"])}
            mark("other")
        out = dict(stats_sum)
        out.update(per_type.summary(reduce=self.dist.reduce))
        out.update(by_type.summary(reduce=self.dist.reduce))
        if rewards is not None:
            out.update(rewards.summary(reduce=self.dist.reduce))
        if diag:
            out.update(diag)
        out["_finite"] = finite
        out["_tokens"] = tokens
        out["_examples"] = examples
        return out

    def apply_update(self, trainable: list, stats: dict[str, Any], step: int, where: str = "") -> float:
        """Clip, refuse a non-finite loss or gradient *before* stepping, step, move the centring."""
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, self.recipe.grad_clip))
        if not (stats["_finite"] and math.isfinite(grad_norm)):
            raise TrainingDiverged(f"non-finite loss or gradient at update {step + 1} (loss {stats.get('loss')}, "
                                   f"grad norm {grad_norm}); the optimizer step was not applied{where}")
        self.optimizer.step()
        self.model.head.apply_centring_update(reduce=self.dist.reduce)
        return grad_norm

    def update(self, step: int, trainable: list, *, where: str = "",
               mark: Callable[[str], None] | None = None) -> dict[str, Any]:
        """One optimizer update -- the whole of it, for `train()` and `rlcd bench train` alike.

        LR for `step` -> this rank's micro-batches (forward, loss / n_local, backward) -> stats averaged
        over ranks -> clip -> finite check -> AdamW step -> centring update. Returns the stats with
        `grad_norm` and the learning rates; `mark("optimizer")` closes the last timed part.
        """
        r = self.recipe
        lrs = self.set_lr(step)
        self.model.frozen_features = self.sources.for_update(step).frozen
        diag_due = r.diagnostics_every > 0 and (step + 1) % r.diagnostics_every == 0
        stats = reduce_stats(self.accumulate(step, diagnostics=diag_due, mark=mark), self.dist)
        if mark:
            mark("other")
        stats["grad_norm"] = self.apply_update(trainable, stats, step, where)
        if mark:
            mark("optimizer")
        self.count_consumed(step)
        stats.update(lrs)
        return stats


__all__ = ["Session", "TrainingDiverged", "noise_generator"]
