"""The training loop: sample, step, evaluate, select, checkpoint, resume, DDP.

Data order is a pure function of (seed, absolute micro-batch index), and the logit noise of the
RLCD objective is drawn from a generator seeded by the same pair, so a resumed run continues the
exact stream of an uninterrupted one. An update is always the recipe's global batch: A = grad_accum
micro-batches of B examples (8 x 4 = 32), indices `[step*A, (step+1)*A)`, whatever the world size.
Under `torchrun`, rank r of N takes the contiguous block of A/N of them; each rank averages its loss
over its A/N micro-batches and DDP averages over ranks, so the gradient equals one process's (N must
divide A; other N are refused with the options). Rank 0 alone evaluates and writes.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from rlcd import checkpoint as ckpt
from rlcd.dev_evals import trim_dev_evals, write_dev_eval
from rlcd.device import Placement, describe, resolve_placement
from rlcd.errors import OptionError, UserError
from rlcd.diagnostics import RewardDiagnostics, TypeDiagnostics, dev_scores
from rlcd.objectives import ce_loss, gradient_diagnostics, reward_samples, rlcd_loss
from rlcd.progress import Progress, echo
from rlcd.recipe import Recipe, lr_factor
from rlcd.run import Run
from rlcd.schema import Record
from rlcd.tracking import check_tracker, open_tracker

DATA_FILES = ("train.jsonl", "dev.jsonl", "calibration.jsonl", "test.jsonl")


class TrainingDiverged(RuntimeError):
    """A non-finite loss or gradient: the update was not applied, the last checkpoint is intact."""


class ResumeRefused(UserError, RuntimeError):
    """The run directory cannot be resumed with the given data, recipe or flags."""


# ----------------------------------------------------------------------------------------------
# distributed helpers


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def init_distributed() -> Dist:
    """Join the torchrun process group when launched by torchrun; a plain launch uses none."""
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) <= 1:
        return Dist()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
    return Dist(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local)


def local_accum(grad_accum: int, world: int, batch_size: int = 8) -> int:
    """Micro-batches each of `world` ranks runs per update so that the update keeps the recipe's batch."""
    if world < 1 or grad_accum % world:
        ok = [n for n in range(1, grad_accum + 1) if grad_accum % n == 0]
        raise OptionError(
            f"{world} processes cannot share an update of {grad_accum} micro-batches of {batch_size} "
            f"(global batch {grad_accum * batch_size}): launch {', '.join(map(str, ok))} processes, or keep the "
            f"global batch with --recipe grad_accum=G --recipe batch_size=B where G is a multiple of {world} and "
            f"G x B = {grad_accum * batch_size}")
    return grad_accum // world


def micro_indices(step: int, *, accum: int, rank: int = 0, world: int = 1) -> list[int]:
    """Absolute micro-batch indices of update `step` for `rank`: its contiguous block of the A = `accum`
    indices `[step*A, (step+1)*A)` shared by all ranks (A/world each)."""
    per = local_accum(accum, world)
    base = step * accum + rank * per
    return list(range(base, base + per))


def log_due(done: int, r: Recipe) -> bool:
    """Whether update `done` (1-based) writes a train row: every `log_every`, the last update, and every
    `diagnostics_every` (its diagnostics exist on that update only), whatever the two cadences."""
    diag = r.diagnostics_every > 0 and done % r.diagnostics_every == 0
    return done % r.log_every == 0 or done == r.steps or diag


def noise_generator(seed: int, index: int) -> torch.Generator:
    """CPU generator for the logit noise of micro-batch `index`: resume- and device-independent."""
    return torch.Generator().manual_seed((seed * 1_000_003 + index) % (2**63 - 1))


# ----------------------------------------------------------------------------------------------
# run metadata


def git_revision() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001 - a missing git is not an error
        return None


def library_versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for name in ("rlcd", "torch", "transformers", "peft", "safetensors", "numpy"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "missing"
    return out


def data_hashes(data_dir: Path) -> dict[str, str]:
    from rlcd.data.io import sha256_file

    return {name: sha256_file(data_dir / name) for name in DATA_FILES if (data_dir / name).is_file()}


# ----------------------------------------------------------------------------------------------
# the session


@dataclass
class Session:
    """Everything one process needs to run updates: model, optimizer, data, sampler, recipe."""

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
    consumed: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    objective_fn: Callable | None = None
    features: Any = None            # rlcd.features.FeatureCache read while the backbone is frozen, or None (live)
    _fixed: dict = field(default_factory=dict)  # (id, order) -> the row in that fixed candidate order

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
        f = lr_factor(step, self.horizon, warmup_frac=self.recipe.warmup_frac, floor=self.recipe.lr_floor)
        out = {}
        for g in self.optimizer.param_groups:
            peak = self.recipe.lr_lora if g["name"] == "lora" else self.recipe.lr_head
            g["lr"] = peak * f
            out[f"lr_{g['name']}"] = g["lr"]
        return out

    def microbatch(self, index: int):
        """Micro-batch `index`: while only the head learns (`Recipe.head_phase`), rows in fixed candidate
        orders, from the feature cache when there is one (`batch_of`; `batch_by` does not apply: there is no
        backbone forward to share); else a `Batch` of rows, or with `batch_by="case"` a `CaseBatch` of whole
        cases (`Sampler.case_microbatch`; `DecisionModel.forward` then shares each state's prefix)."""
        from rlcd.data.sampling import shuffle_choice

        r = self.recipe
        if r.head_phase(index // r.grad_accum):
            return self.batch_of(self.sampler.microbatch(r.seed, index, r.batch_size), head_phase=True)
        if r.batch_by == "case":
            from rlcd.model.case_train import collate_cases

            cases = self.sampler.case_microbatch(r.seed, index, r.batch_size)
            units = [[shuffle_choice(self.records[d.id], d.perm_seed) for d in case] for case in cases]
            return collate_cases(self.collator, units).to(self.device)
        return self.batch_of(self.sampler.microbatch(r.seed, index, r.batch_size), head_phase=False)

    def batch_of(self, draws, *, head_phase: bool):
        """The batch of `draws`. While only the head learns, a choice row takes one of its fixed candidate
        orders (`order_of_draw`) and the features come from the cache when there is one (else the frozen
        backbone runs live, on the same rows); otherwise every choice row is shuffled afresh."""
        from rlcd.data.sampling import order_of_draw, shuffle_choice, with_fixed_order

        if not head_phase:
            return self.collator([shuffle_choice(self.records[d.id], d.perm_seed) for d in draws]).to(self.device)
        orders = [order_of_draw(self.records[d.id], d.perm_seed) for d in draws]
        rows = []
        for d, o in zip(draws, orders):
            key = (d.id, o)
            if key not in self._fixed:  # a pure function of the row: built once per run
                self._fixed[key] = with_fixed_order(self.records[d.id], o)
            rows.append(self._fixed[key])
        if self.features is not None:
            return self.features.batch("train", rows, orders).to(self.device)
        return self.collator(rows).to(self.device)

    def draws(self, index: int) -> list:
        """The sampler draws of micro-batch `index` (a case micro-batch's cases flattened)."""
        r = self.recipe
        if r.batch_by == "case" and not r.head_phase(index // r.grad_accum):
            return [d for case in self.sampler.case_microbatch(r.seed, index, r.batch_size) for d in case]
        return self.sampler.microbatch(r.seed, index, r.batch_size)

    def count_consumed(self, step: int) -> None:
        """Add the sampling groups of all of update `step`'s examples (every rank's: the stream is pure)."""
        r = self.recipe
        for index in range(step * r.grad_accum, (step + 1) * r.grad_accum):
            for d in self.draws(index):
                self.consumed[d.group] += 1

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
        per_type = TypeDiagnostics()
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
            if rewards is not None:
                args = (logits.detach(), batch.cand_mask, batch.target, batch.ordinal)
                kw = {"noise": self.noise(index, logits), **self.rlcd_settings(index, batch)}
                rewards.add(reward_samples(*args, **kw), batch.type_id, batch.ordinal)
                if diag is None:
                    d = gradient_diagnostics(*args, **kw)
                    diag = {"grad_cosine": float(d["grad_cosine"]), "grad_norm_ratio": float(d["grad_norm_ratio"])}
            mark("other")
        out = dict(stats_sum)
        out.update(per_type.summary(reduce=dist.all_reduce if self.dist.active else None))
        if rewards is not None:
            out.update(rewards.summary(reduce=dist.all_reduce if self.dist.active else None))
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
        self.model.head.apply_centring_update(reduce=dist.all_reduce if self.dist.active else None)
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
        self.model.frozen_features = r.head_phase(step)
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


def reduce_stats(stats: dict[str, Any], d: Dist) -> dict[str, Any]:
    """Average float stats over ranks (rank 0 logs the mean)."""
    if not d.active:
        return stats
    keys = sorted(k for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
    t = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    out = dict(stats)
    for k, v in zip(keys, (t / d.world).tolist()):
        out[k] = v if not k.startswith("_") else v * d.world  # token/example counts are sums
    return out


# ----------------------------------------------------------------------------------------------
# evaluation on the frozen dev subset


@torch.no_grad()
def dev_accuracy(model, dev: dict[str, list[Record]], collator, device, batch_size: int = 16, *,
                 shared: bool = True, features=None, keep: list | None = None) -> dict[str, Any]:
    """Top-1 accuracy per sampling group and the unweighted group macro (the selection score), plus the
    dev scoring rules of `rlcd.diagnostics.dev_scores` (NLL, Brier, ECE overall and per type) from the same
    forward. `shared` (default): every dev case's state runs once, its questions as suffixes on its cache
    (`rlcd.model.case_scoring.score_records`, logits equal to full rows up to float32 noise); False: full
    rows, `batch_size` per forward. `features`: a `FeatureCache` holding the dev rows, read instead of running
    the (frozen) backbone. `keep`: a list that receives the scored rows (id, group, type, target, logits)."""
    was_training = model.training
    model.eval()
    flat = [(group, rec) for group in sorted(dev) for rec in dev[group]]
    if features is not None:
        recs = [rec for _, rec in flat]
        logits = []
        for i in range(0, len(recs), 256):
            chunk = recs[i:i + 256]
            host = model(features.batch("dev", chunk, [0] * len(chunk)).to(device)).float().cpu()
            logits += [host[j, :rec.question.k] for j, rec in enumerate(chunk)]
    elif shared:
        from rlcd.model.case_scoring import score_records

        logits = score_records(model, [rec for _, rec in flat], image_root=collator.image_root)
    else:
        logits = []
        for i in range(0, len(flat), batch_size):
            chunk = [rec for _, rec in flat[i:i + batch_size]]
            host = model(collator(chunk).to(device)).float().cpu()
            logits += [host[j, :rec.question.k] for j, rec in enumerate(chunk)]
    model.train(was_training)
    correct: dict[str, int] = {group: 0 for group in dev}
    scored = []
    for (group, rec), lg in zip(flat, logits):
        correct[group] += int(int(lg.argmax()) == int(torch.tensor(rec.target).argmax()))
        scored.append({"id": rec.id, "group": group, "type": rec.question.type, "target": rec.target,
                       "logits": lg.tolist()})
    per_group = {group: correct[group] / max(1, len(dev[group])) for group in sorted(dev)}
    if keep is not None:
        keep.extend(scored)
    macro = sum(per_group.values()) / max(1, len(per_group))
    return {"dev_accuracy": per_group, "dev_macro_accuracy": macro, **dev_scores(scored)}


def improves_on(per_group: dict[str, float], dev: dict[str, list], best_score: float | None) -> bool:
    """Whether this dev evaluation beats the best so far, compared as exact rationals, not floats.

    Float macro averages of the same counts can differ by an ulp (0.3611111111111111 vs
    0.36111111111111116), which must not select a new checkpoint. Each group's accuracy is
    correct / n with n = its frozen dev size, so the macro is a fraction with denominator at most
    D = groups * lcm(n); the stored best (a float) is read back as the nearest such fraction.
    """
    if best_score is None:
        return True
    sizes = {g: max(1, len(dev.get(g, ()))) for g in per_group}
    new = sum((Fraction(round(acc * sizes[g]), sizes[g]) for g, acc in per_group.items()), Fraction(0))
    new /= max(1, len(per_group))
    denom = max(1, len(per_group)) * math.lcm(*sizes.values(), 1)
    if denom > 10**7:  # too fine to recover exactly from a float: compare at 12 decimals
        return round(float(new), 12) > round(best_score, 12)
    return new > Fraction(best_score).limit_denominator(denom)


# ----------------------------------------------------------------------------------------------
# building a session from a run's config


def _load_records(data_dir: Path):
    from rlcd.data.io import load_split

    train = load_split(data_dir, "train")
    dev = load_split(data_dir, "dev")
    return train, dev


def build_session(config: dict, samples: dict, d: Dist, *, placement: Placement | None = None, backbone=None,
                  objective_fn=None, records=None, feature_cache: bool = True, progress: bool = True,
                  print_fn: Callable[[str], None] | None = None,
                  load_weights: Callable[[Any], None] | None = None, start_step: int = 0) -> Session:
    """Model, optimizer, sampler and dev subset of a run. `records`: the (train, dev) rows if the caller
    already read them; `backbone`: a ready backbone for `build_model` (tests, benchmarks); `load_weights`
    puts a resume's or an `--init`'s trainable weights into the built model before the feature cache is
    looked up, since a LoRA they bring is part of the frozen backbone whose features the cache holds.
    `start_step`: the update a resume continues from; a run whose head phase lies behind it (an LP-FT run
    past its warm-up, LoRA moved) reads no cache and extracts none.

    A run whose head learns alone for a while (`head_only`, `head_warmup`) reads its frozen features from
    the data directory's feature cache (`rlcd.features`; extracted here on first need, by rank 0 while the
    other ranks wait) unless `feature_cache` is False (the backbone then runs live, without gradients).
    A head-only run's LoRA adapters stay at B = 0 with requires_grad off, so its export merges to the base."""
    from rlcd.data.sampling import Sampler
    from rlcd.model.build import build_model

    recipe = Recipe.from_dict(config["recipe"])
    local_accum(recipe.grad_accum, d.world, recipe.batch_size)
    data_dir = Path(config["data_dir"])
    train, dev_rows = records or _load_records(data_dir)
    by_id = {r.id: r for r in train}
    pool = {g: list(ids) for g, ids in samples["train"].items()}
    dev_by_id = {r.id: r for r in dev_rows}
    dev = {g: [dev_by_id[i] for i in ids] for g, ids in samples["dev"].items()}
    placement = placement or resolve_placement(config.get("device", "auto"), config.get("dtype", "auto"),
                                               local_rank=d.local_rank if d.active else None)
    device = placement.torch_device
    torch.manual_seed(recipe.seed)
    model = build_model(config, device=device, dtype=placement.torch_dtype, backbone=backbone)
    model.train()
    if recipe.head_only:
        for p in model.param_groups()["lora"]:
            p.requires_grad_(False)
    if load_weights is not None:
        load_weights(model)
    features = None
    if feature_cache and (recipe.head_only or start_step < recipe.head_warmup):
        from rlcd.features import ensure_features

        if d.main:
            features = ensure_features(model, data_dir, progress=progress, say=print_fn,
                                       records={"train": train, "dev": dev_rows})
        if d.active:
            dist.barrier()
            if not d.main:
                features = ensure_features(model, data_dir, progress=False)
    groups = model.param_groups()
    optimizer = torch.optim.AdamW(
        [{"params": groups["lora"], "lr": recipe.lr_lora, "name": "lora"},
         {"params": groups["head"], "lr": recipe.lr_head, "name": "head"}],
        weight_decay=recipe.weight_decay,
    )
    wrapped = model
    if d.active:
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model, device_ids=[device.index or 0] if device.type == "cuda" else None,
                      find_unused_parameters=recipe.head_warmup > 0)  # LoRA gets no gradient in the warm-up
    check_special_tokens(model.encoder, [by_id[i] for ids in pool.values() for i in ids],
                         [r for rows in dev.values() for r in rows])
    collator = model.collator(image_root=data_dir)
    case_of = {i: by_id[i].case_id for ids in pool.values() for i in ids} if recipe.batch_by == "case" else None
    return Session(recipe=recipe, horizon=int(config["decay_horizon"]), model=model, wrapped=wrapped,
                   optimizer=optimizer, collator=collator, records=by_id, dev=dev,
                   sampler=Sampler(pool, case_of),
                   dist=d, device=device, objective_fn=objective_fn, features=features)


def check_special_tokens(encoder, *splits) -> None:
    """Refuse, before the first update, a row holding special-token text of this backbone.

    Records already meet the data-level rule (the Qwen3.5 specials, `schema.RESERVED_TOKENS`); a
    backbone with other special tokens (SmolLM2's `<|im_start|>`, `<repo_name>`, ...) would otherwise
    meet such a row only when the sampler draws it, mid-run. Raises the encoder's `RecordError`.
    """
    from rlcd.schema import RESERVED_TOKENS

    if set(encoder.reserved) <= set(RESERVED_TOKENS):
        return  # nothing beyond what the records were validated against
    for rows in splits:
        for rec in rows:
            encoder.check_inputs(rec.state, rec.question, row=rec.id)


def init_centring(s: Session, n_batches: int = 4) -> None:
    """Estimate the scorer's centring statistics from fixed micro-batches before the first update.

    Uses micro-batch indices far outside the training stream (negative-free offset), so the
    estimate is identical on every rank and for every world size.
    """
    batches = [s.batch_of(s.sampler.microbatch(s.recipe.seed + 7919, i, s.recipe.batch_size),
                          head_phase=s.recipe.head_phase(0)) for i in range(n_batches)]
    s.model.init_centring(batches)


# ----------------------------------------------------------------------------------------------
# new and resumed runs


def _check_resume(run: Run, config: dict, samples: dict, steps: int | None) -> dict:
    data_dir = Path(config["data_dir"])
    now = data_hashes(data_dir)
    if now != samples["files"]:
        changed = sorted(k for k in set(now) | set(samples["files"]) if now.get(k) != samples["files"].get(k))
        raise ResumeRefused(f"refusing to resume {run.root}: data files changed since the run started "
                            f"({', '.join(changed)} in {data_dir}); start a new run instead")
    if steps is not None:
        old = config["recipe"]["steps"]
        if steps < old:
            raise ResumeRefused(f"refusing to resume {run.root}: --steps {steps} is smaller than the run's "
                                f"{old}; only a larger budget is allowed")
        config = json.loads(json.dumps(config))
        config["recipe"]["steps"] = steps
    return config


def new_run(run_dir: Path, data_dir: Path, model: str, recipe: Recipe, *, model_seed: int = 0,
            world_size: int = 1, dtype: str = "auto", records=None, log: str = "none") -> tuple[dict, dict]:
    """The config.json and samples.json of a fresh run (nothing is written here)."""
    from rlcd.data.sampling import dev_subset, eligible_pool

    data_dir = Path(data_dir).resolve()
    train, dev = records or _load_records(data_dir)
    if not train:
        raise OptionError(f"{data_dir}/train.jsonl has no rows; nothing to train on")
    samples = {
        "train": eligible_pool(train, cap=recipe.pool_cap),
        "dev": dev_subset(dev, cap=recipe.dev_cap),
        "files": data_hashes(data_dir),
    }
    config = {
        "recipe": recipe.to_dict(),
        "recipe_deviations": recipe.deviations(),
        "decay_horizon": recipe.decay_horizon(),
        "model": model,
        "model_seed": model_seed,
        "dtype": dtype,
        "data_dir": str(data_dir),
        "world_size": world_size,
        "log": log,
        "versions": library_versions(),
        "git_revision": git_revision(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    return config, samples


def check_data_dir(data_dir: Path, flag: str = "--data") -> Path:
    """A processed data directory with train.jsonl and dev.jsonl, else a one-line UserError naming `flag`
    (how the command took it: `--data`, or `DATA` for a positional argument)."""
    from rlcd.errors import RunError

    data_dir = Path(data_dir).expanduser()
    if data_dir.is_file():
        from rlcd.data.io import suggest_processed_dir

        raise RunError(f"{flag} {data_dir} is a file; {flag} takes a processed data directory: make one with "
                       f"`rlcd data prepare {data_dir} --out {suggest_processed_dir(data_dir)}` and pass that")
    if not data_dir.is_dir():
        raise RunError(f"{flag} {data_dir}: no such directory; make one with `rlcd data prepare FILES --out {data_dir}`")
    missing = [f for f in ("train.jsonl", "dev.jsonl") if not (data_dir / f).is_file()]
    if missing:
        raise RunError(f"{flag} {data_dir}: not a processed data directory (no {', '.join(missing)}); make one "
                       f"with `rlcd data prepare FILES --out {data_dir}`")
    return data_dir.resolve()


def init_source(path: Path, model: str, model_seed: int, recipe: Recipe) -> dict:
    """The run `--init` names, checked before anything is built: a run with a best checkpoint, trained on
    the same backbone (preset or path, model seed) with the same LoRA and head shapes. Returns what
    `load_init_weights` needs and the record kept in config.json ("init")."""
    from rlcd.model.build import MODEL_FIELDS, model_options

    src = Run.open(path)
    best = src.require_checkpoint("best")
    cfg = src.config()
    theirs = (str(cfg.get("model")), int(cfg.get("model_seed", 0)))
    if theirs != (str(model), int(model_seed)) and not _same_model_path(theirs[0], model, theirs[1] == model_seed):
        raise OptionError(f"--init {path}: that run was trained on backbone {theirs[0]} (model seed {theirs[1]}), this "
                          f"one uses {model} (model seed {model_seed}); --init needs the same backbone")
    mine, other = model_options(recipe.to_dict()), model_options(cfg["recipe"])
    diff = [f"{k} {other[k]} there, {mine[k]} here" for k in MODEL_FIELDS if mine[k] != other[k]]
    if diff:
        raise OptionError(f"--init {path}: the trainable weights have another shape ({'; '.join(diff)}); give the "
                          "same model fields (--recipe) as that run")
    state = ckpt.load(best)["state"]
    return {"path": best, "export": src.export_dir / "model.json",
            "record": {"run": str(src.root.resolve()), "checkpoint": "best", "step": state.get("best_step"),
                       "weights_sha256": ckpt.weights_sha256(best)}}


def _same_model_path(theirs: str, mine: str, same_seed: bool) -> bool:
    """Two spellings of one local backbone directory (relative vs absolute)."""
    a, b = Path(theirs).expanduser(), Path(mine).expanduser()
    return same_seed and a.exists() and b.exists() and a.resolve() == b.resolve()


def load_init_weights(model, source: dict) -> str:
    """Load the source run's best trainable weights into `model` after checking the backbone fingerprint
    against the source's export (when it has one); returns this backbone's fingerprint."""
    from rlcd.model.fingerprint import backbone_fingerprint

    found = backbone_fingerprint(model)
    if source["export"].is_file():
        meta = json.loads(source["export"].read_text())
        rounding = meta.get("backbone_fingerprint_rounding")
        if meta.get("backbone_fingerprint") not in (None, backbone_fingerprint(model, rounding)):
            raise OptionError(f"--init {source['record']['run']}: the backbone built here does not match the one that "
                              "run was trained on (parameter fingerprint differs); point at the same weights")
    model.load_trainable_state_dict(ckpt.load(source["path"], map_location=str(model.device))["weights"])
    return found


def deviation_notice(recipe: Recipe) -> str | None:
    dev = recipe.deviations()
    if not dev:
        return None
    parts = ", ".join(f"{k}={v['value']} (pinned {v['pinned']})" for k, v in dev.items())
    return f"note: this run deviates from the pinned recipe: {parts}"


# ----------------------------------------------------------------------------------------------
# the loop


def _train(run_dir: Path, *, held: contextlib.ExitStack, data_dir: Path | None = None, model: str = "qwen3.5-0.8b",
          recipe: Recipe | None = None, resume: bool = False, steps: int | None = None,
          stop_after: int | None = None, progress: bool = True, model_seed: int = 0,
          objective_fn: Callable | None = None, device: str = "auto", dtype: str = "auto",
          backbone=None, log: str | None = None, print_fn: Callable[[str], None] = echo,
          feature_cache: bool = True, init: Path | None = None) -> dict:
    """Train (or resume) the run at `run_dir`; returns the final state dict.

    Inputs are checked and the model is built before anything is written, so a failed start leaves
    no run directory behind. `stop_after` ends the process after that many updates without a final
    evaluation, as a kill would (used to test resume equivalence). `backbone` hands `build_model` a
    ready backbone (tests, benchmarks). `progress=False` silences the progress display (stderr);
    `feature_cache=False` runs the frozen backbone live in a head-only phase instead of reading the
    data directory's feature cache (same numbers within float noise, slower). `log` is the experiment tracker (`rlcd.tracking`: "none", the default of a new run, or
    "tensorboard"); a resume keeps the run's own unless `log` is given, and records the change.
    `init`: a new run starts from that run's dev-selected (best) trainable weights -- LoRA, head and
    centring buffers -- with a fresh optimizer and schedule (`init_source`; same backbone required).
    """
    from rlcd.model.backbone import check_backbone_spec

    run = Run(run_dir)
    d = init_distributed()
    records = None
    if resume and init is not None:
        raise OptionError(f"--init {init} starts a new run; a resume continues {run.root} from its own checkpoint")
    source = None
    if resume:
        if not run.exists():
            raise ResumeRefused(f"refusing to resume {run.root}: no config.json there (start it with "
                                f"`rlcd train {run.root} --data DATA`)")
        if d.main:  # one writer per run (rank 0 writes; the other ranks never touch the directory)
            held.enter_context(run.lock("train --resume"))
        config = run.config()
        samples = run.samples()
        config = _check_resume(run, config, samples, steps)
        if log is not None and log != config.get("log", "none"):
            config = {**config, "log": log}
        check_tracker(config.get("log", "none"))
    else:
        if data_dir is None:
            raise OptionError("a new run needs --data (a processed data directory)")
        if run.exists():
            raise OptionError(f"{run.root} already holds a run; resume it with `rlcd train --resume {run.root}` "
                              "or choose another run directory")
        check_backbone_spec(model)
        log = check_tracker(log or "none")
        data_dir = check_data_dir(Path(data_dir))
        recipe = recipe or Recipe()
        if steps is not None:
            recipe = recipe.with_(steps=steps)
        local_accum(recipe.grad_accum, d.world, recipe.batch_size)
        source = init_source(Path(init), model, model_seed, recipe) if init is not None else None
        placement = resolve_placement(device, dtype, local_rank=d.local_rank if d.active else None)
        records = _load_records(data_dir)
        config, samples = new_run(run.root, data_dir, model, recipe, model_seed=model_seed, world_size=d.world,
                                  dtype=dtype, records=records, log=log)
        if source is not None:
            config["init"] = source["record"]
    if resume:
        placement = resolve_placement(device, dtype if dtype != "auto" else config.get("dtype", "auto"),
                                      local_rank=d.local_rank if d.active else None)
    loaded, fingerprint = None, {}
    if resume:
        loaded = ckpt.load(run.checkpoint("last"), map_location=str(placement.torch_device))

    def load_weights(model) -> None:
        if loaded is not None:
            model.load_trainable_state_dict(loaded["weights"])
        elif source is not None:
            fingerprint["found"] = load_init_weights(model, source)  # the centring buffers come with it

    s = build_session(config, samples, d, placement=placement, backbone=backbone, objective_fn=objective_fn,
                      records=records, feature_cache=feature_cache, progress=progress,
                      print_fn=print_fn if d.main else None, load_weights=load_weights,
                      start_step=int(loaded["state"]["step"]) if loaded is not None else 0)
    r = s.recipe
    if d.main:
        notice = deviation_notice(r)
        if notice:
            print_fn(notice)
        print_fn(f"train: {run.root} on {describe(placement)}, {d.world} process(es), "
                 f"{r.grad_accum // d.world} x {r.batch_size} examples per process per update")
    state = {"step": 0, "best_score": None, "best_step": None, "score": None, "consumed": {},
             "evals_since_best": 0, "stopped_early": None}
    if loaded is not None:
        s.optimizer.load_state_dict(loaded["optimizer"])
        ckpt.set_rng_state(loaded["rng"])
        state.update({k: loaded["state"][k] for k in ("step", "best_score", "best_step", "score", "consumed")})
        state.update({k: loaded["state"].get(k, state[k]) for k in ("evals_since_best", "stopped_early")})
        s.consumed.update(state["consumed"])
        if state["stopped_early"] is not None:
            if d.main:
                print_fn(early_stop_notice(run, state, r))
            return {**loaded["state"], "stopped_early": state["stopped_early"]}
        if d.main:
            if config != run.config():
                run.write_config(config)
            run.trim_metrics(state["step"])
            trim_dev_evals(run, state["step"])
    elif source is not None:
        config["init"]["backbone_fingerprint"] = fingerprint["found"]
        if d.main:
            Run.create(run.root, config, samples)
    else:
        init_centring(s)
        if d.main:
            Run.create(run.root, config, samples)
            held.enter_context(run.lock("train"))
    tracker = None
    if d.main:
        tracker = open_tracker(config.get("log", "none"), run, resume_step=state["step"] if resume else None)
    writer = RunWriter(run, enabled=d.main, tracker=tracker)
    writer.log({"event": "session", "step": state["step"], "world_size": d.world, **placement.to_dict(),
                "resume": bool(resume),
                "features": None if s.features is None else str(s.features.root)})

    def snapshot() -> dict:
        return {**state, "recipe": r.to_dict(), "consumed": dict(s.consumed), "world_size": d.world,
                "decay_horizon": s.horizon}

    def evaluate_and_select(step: int) -> None:
        if d.main:
            frozen = r.head_only or step <= r.head_warmup  # LoRA has not moved yet: the cache holds these features
            scored: list[dict] = []
            ev = dev_accuracy(s.model, s.dev, s.collator, s.device, features=s.features if frozen else None,
                              keep=scored)
            write_dev_eval(run, step, scored)
            state["score"] = ev["dev_macro_accuracy"]
            writer.log({"event": "eval", "step": step, **ev})
            if improves_on(ev["dev_accuracy"], s.dev, state["best_score"]):
                state["best_score"], state["best_step"] = ev["dev_macro_accuracy"], step
                state["evals_since_best"] = 0
                writer.checkpoint("best", s, snapshot())
            else:
                state["evals_since_best"] += 1
        if d.active:
            dist.barrier()
        if patience_exhausted(r.patience, state["evals_since_best"], d):
            state["stopped_early"] = step
            writer.log({"event": "stopped_early", "step": step, "patience": r.patience,
                        "best_step": state["best_step"], "best_score": state["best_score"]})

    if state["step"] == 0:
        evaluate_and_select(0)
        writer.checkpoint("last", s, snapshot())

    bar = Progress("train", r.steps, unit="updates", start=state["step"], enabled=d.main and progress)
    trainable = [p for ps in s.model.param_groups().values() for p in ps]
    t_last, window_examples, window_tokens = time.perf_counter(), 0, 0
    start = state["step"]
    for step in range(start, r.steps):
        if stop_after is not None and step - start >= stop_after:
            break
        stats = s.update(step, trainable, where=f" and {run.checkpoint('last')} is intact")
        done = step + 1
        state["step"] = done
        window_examples += stats["_examples"]
        window_tokens += stats["_tokens"]
        if log_due(done, r):
            now = time.perf_counter()
            dt = max(now - t_last, 1e-9)
            row = {"event": "train", "step": done, **{k: v for k, v in stats.items() if not k.startswith("_")},
                   "examples": stats["_examples"], "examples_per_s": window_examples / dt,
                   "tokens_per_s": window_tokens / dt, "consumed": dict(sorted(s.consumed.items()))}
            writer.log(row)
            t_last, window_examples, window_tokens = now, 0, 0
        if done % r.eval_every == 0 or done == r.steps:
            evaluate_and_select(done)
        bar.update(done, _progress_info(stats, state["score"]))  # after the evaluation: its dev score shows
        if done % r.checkpoint_every == 0 or done == r.steps or state["stopped_early"] is not None:
            writer.checkpoint("last", s, snapshot())
        if state["stopped_early"] is not None:
            break
    bar.close()
    if d.main and state["stopped_early"] is not None:
        print_fn(early_stop_notice(run, state, r))
    writer.close()
    if d.active:
        dist.barrier()
    return snapshot()


def train(run_dir: Path, **kwargs: Any) -> dict:
    """Train (or resume) the run at `run_dir` holding its lock (`Run.lock`, rank 0) until the end; see `_train`."""
    with contextlib.ExitStack() as held:
        return _train(run_dir, held=held, **kwargs)


def patience_exhausted(patience: int | None, evals_since_best: int, d: Dist) -> bool:
    """Whether `patience` dev evaluations in a row brought no strict improvement (rank 0 decides, every
    rank gets its answer); None is the recipe's fixed budget: never."""
    if patience is None:
        return False
    stop = evals_since_best >= patience
    if d.active:
        flag = torch.tensor([1.0 if stop else 0.0])
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.broadcast(flag, src=0)
        stop = bool(flag.item())
    return stop


def early_stop_notice(run: Run, state: dict, r: Recipe) -> str:
    return (f"train: {run.root} stopped early at update {state['stopped_early']}: {r.patience} dev evaluation(s) "
            f"without strict improvement (patience {r.patience}); best update {state['best_step']} "
            f"(dev macro accuracy {state['best_score']}). A resume has nothing left to do; start a new run "
            "(e.g. with --init) to train further")


def _progress_info(stats: dict[str, Any], score: float | None) -> str:
    """Loss, CE and the last dev score for the progress display."""
    loss, ce = stats.get("loss"), stats.get("ce_loss")
    if loss is None or ce is None:
        return ""
    return f"loss {loss:.4f} ce {ce:.4f} dev {'-' if score is None else f'{score:.4f}'}"


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

    def checkpoint(self, name: str, s: Session, state: dict) -> None:
        if self.enabled:
            ckpt.save(self.run.checkpoint(name), weights=s.model.trainable_state_dict(),
                      optimizer=s.optimizer.state_dict(), state=state)
