"""Setup: a new run, a resume or an `--init` start -> a ready `Trainer` for the loop (`rlcd.train.loop`).

Every input is checked and the model is built before anything is written, so a failed start leaves no
run directory behind. Order (`setup`): the run's inputs (`_new_start` / `_resume_start`: config, samples,
placement, the resume checkpoint or the `--init` source) -> `build_session`, one `_setup_*` part each as
torchtune's recipes do (data, placement, model with the row check and the resume/init weights loaded *before*
the feature cache is looked up, since a LoRA they bring is part of the frozen backbone, caches, optimizer, DDP,
sources) -> the training state restored (resume) or the centring estimated (new run)
-> the run directory created and locked -> the tracker and the "session" event.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from rlcd import checkpoint as ckpt
from rlcd.device import Placement, describe, resolve_placement
from rlcd.errors import OptionError
from rlcd.progress import echo
from rlcd.recipe import Recipe
from rlcd.run import Run
from rlcd.schema import Record
from rlcd.tracking import check_tracker, open_tracker

from .distributed import Dist, init_distributed, local_accum
from .inputs import (ResumeRefused, check_data_dir, check_resume, deviation_notice, init_source, load_init_weights,
                     load_records, new_run)
from .selection import DevSelection
from .session import Session
from .sources import plan_sources
from .writer import RunWriter, TrainState


def build_session(config: dict, samples: dict, d: Dist, *, placement: Placement | None = None, backbone=None,
                  objective_fn=None, records=None, feature_cache: bool = True, progress: bool = True,
                  print_fn: Callable[[str], None] | None = None,
                  load_weights: Callable[[Any], None] | None = None, start_step: int = 0) -> Session:
    """Model, optimizer, sampler, dev subset and feature sources of a run, one `_setup_*` part each, in this order:
    data, placement, model (with the row check and the resume's or `--init`'s weights), caches, optimizer, DDP,
    sources. `records`: the (train, dev) rows if the caller already read them; `backbone`: a ready backbone for
    `build_model` (tests, benchmarks); `load_weights` puts a resume's or an `--init`'s trainable weights into the
    built model before the feature cache is looked up, since a LoRA they bring is part of the frozen backbone whose
    features the cache holds. `start_step`: the update a resume continues from; a run whose head phase lies behind
    it (an LP-FT run past its warm-up, LoRA moved) reads no cache and extracts none.

    A run whose head learns alone for a while (`head_only`, `head_warmup`) reads its frozen features from
    the data directory's feature cache (`rlcd.features`; extracted here on first need, by rank 0 while the
    other ranks wait) unless `feature_cache` is False (the backbone then runs live, without gradients). A
    `lora_layers` run trains on the cut-state cache (`rlcd.cut_cache`, the same way) unless `feature_cache`
    is False (the backbone then runs live, autograd building no graph below the first LoRA layer).
    A head-only run's LoRA adapters stay at B = 0 with requires_grad off, so its export merges to the base."""
    recipe = Recipe.from_dict(config["recipe"])
    local_accum(recipe.grad_accum, d.world, recipe.batch_size)
    data = _setup_data(config, samples, recipe, records)
    placement = placement or _setup_placement(config, d)
    model = _setup_model(config, recipe, data, placement, backbone=backbone, load_weights=load_weights)
    features, cut_states = _setup_caches(model, recipe, data, d, enabled=feature_cache, progress=progress,
                                         print_fn=print_fn, start_step=start_step)
    optimizer = _setup_optimizer(model, recipe)
    wrapped = _setup_ddp(model, recipe, d, placement.torch_device)
    collator, sampler, sources = _setup_sources(model, recipe, data, placement.torch_device, features=features,
                                                cut_states=cut_states, start_step=start_step)
    return Session(recipe=recipe, horizon=int(config["decay_horizon"]), model=model, wrapped=wrapped,
                   optimizer=optimizer, collator=collator, records=data.by_id, dev=data.dev, sampler=sampler, dist=d,
                   device=placement.torch_device, sources=sources, objective_fn=objective_fn,
                   head_peak=(config.get("init") or {}).get("head_lr_peak"))


@dataclass
class _Data:
    """A run's rows as the session reads them: the training pool (and its derived forms) by group, the dev subset."""

    data_dir: Path
    train: list[Record]
    dev_rows: list[Record]
    by_id: dict[str, Record]
    pool: dict[str, list[str]]
    derived: dict[str, list[str]] | None
    dev: dict[str, list[Record]]

    def pool_rows(self) -> list[Record]:
        """Every training-pool row, derived forms included (what the row check renders)."""
        return [self.by_id[i] for ids in (*self.pool.values(), *(self.derived or {}).values()) for i in ids]


def _setup_data(config: dict, samples: dict, recipe: Recipe, records=None) -> _Data:
    """The data directory's rows (`records` if the caller read them) and the frozen samples' pool and dev subset."""
    data_dir = Path(config["data_dir"])
    train, dev_rows = records or load_records(data_dir)
    pool = {g: list(ids) for g, ids in samples["train"].items()}
    derived = samples.get("train_derived") if recipe.forms == "derived" else None
    if recipe.forms == "derived" and not derived:
        raise OptionError("recipe forms=derived but the run's samples.json holds no derived pool (train_derived)")
    dev_by_id = {r.id: r for r in dev_rows}
    dev = {g: [dev_by_id[i] for i in ids] for g, ids in samples["dev"].items()}
    return _Data(data_dir, train, dev_rows, {r.id: r for r in train}, pool, derived, dev)


def _setup_placement(config: dict, d: Dist) -> Placement:
    """The run's device and dtype (`rlcd.device.resolve_placement`) when the caller did not resolve them."""
    return resolve_placement(config.get("device", "auto"), config.get("dtype", "auto"),
                             local_rank=d.local_rank if d.active else None)


def _setup_model(config: dict, recipe: Recipe, data: _Data, placement: Placement, *, backbone=None,
                 load_weights: Callable[[Any], None] | None = None) -> Any:
    """The model built under the recipe's seed, every pool and dev row checked against it (`check_rows`), in
    training mode (a head-only run's LoRA frozen), with the resume's or `--init`'s weights loaded."""
    from rlcd.model.build import build_model

    torch.manual_seed(recipe.seed)
    model = build_model(config, device=placement.torch_device, dtype=placement.torch_dtype, backbone=backbone)
    check_rows(model, config["model"], data.data_dir, data.pool_rows(), [r for rows in data.dev.values() for r in rows])
    model.train()
    if recipe.head_only:
        for p in model.param_groups()["lora"]:
            p.requires_grad_(False)
    if load_weights is not None:
        load_weights(model)
    return model


def _setup_caches(model: Any, recipe: Recipe, data: _Data, d: Dist, *, enabled: bool, progress: bool,
                  print_fn: Callable[[str], None] | None, start_step: int) -> tuple[Any, Any]:
    """(feature cache, cut-state cache), each None unless the recipe reads it: the cut states of a `lora_layers`
    run, the frozen features of a head phase still ahead (rank 0 extracts a missing one, the others wait)."""
    features = cut_states = None
    known = {"train": data.train, "dev": data.dev_rows}
    if not enabled and recipe.frozen_precision != "float32":
        from rlcd.errors import OptionError

        raise OptionError(f"--no-cache runs the frozen layers live in float32; frozen_precision="
                          f"{recipe.frozen_precision} is what their caches compute in: drop one of them")
    if enabled and recipe.lora_layers is not None:
        from rlcd.cut_cache import ensure_cut_states

        bf16 = recipe.frozen_precision == "bfloat16"
        cut_states = _rank0_first(d, lambda main: ensure_cut_states(
            model, data.data_dir, progress=progress and main, say=print_fn if main else None, records=known,
            storage="bfloat16" if bf16 else "float32", precision=recipe.frozen_precision))
    if enabled and (recipe.head_only or start_step < recipe.head_warmup):
        from rlcd.cut_cache import find_cut_states
        from rlcd.features import ensure_features

        def build(main: bool):  # on a miss, from a cut-state cache this model matches: the top layers only
            return ensure_features(model, data.data_dir, progress=progress and main, say=print_fn if main else None,
                                   records=known, choice_orders=recipe.choice_orders,
                                   cut_states=lambda: find_cut_states(model, data.data_dir, any_cut=True,
                                                                      precision=recipe.frozen_precision),
                                   precision=recipe.frozen_precision)

        features = _rank0_first(d, build)
    return features, cut_states


def _setup_optimizer(model: Any, recipe: Recipe) -> torch.optim.Optimizer:
    """AdamW over the `lora` and `head` groups at their own learning rates."""
    groups = model.param_groups()
    return torch.optim.AdamW(
        [{"params": groups["lora"], "lr": recipe.lr_lora, "name": "lora"},
         {"params": groups["head"], "lr": recipe.lr_head, "name": "head"}],
        weight_decay=recipe.weight_decay,
    )


def _setup_ddp(model: Any, recipe: Recipe, d: Dist, device: torch.device) -> Any:
    """The module the updates call: the model itself, or DDP around it under torchrun."""
    if not d.active:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index or 0] if device.type == "cuda" else None,
               find_unused_parameters=recipe.head_warmup > 0)  # LoRA gets no gradient in the warm-up


def _setup_sources(model: Any, recipe: Recipe, data: _Data, device: torch.device, *, features: Any,
                   cut_states: Any, start_step: int) -> tuple[Any, Any, Any]:
    """(collator, sampler, sources): the model's collator on the data directory, the pool's sampler (whole cases
    with `batch_by=case`), and where each update's features come from (`plan_sources`)."""
    from rlcd.data.sampling import Sampler

    collator = model.collator(image_root=data.data_dir)
    case_of = ({i: data.by_id[i].case_id for ids in (*data.pool.values(), *(data.derived or {}).values()) for i in ids}
               if recipe.batch_by == "case" else None)
    sources = plan_sources(recipe, collator=collator, device=device, features=features, cut_states=cut_states,
                           start_step=start_step)
    return collator, Sampler(data.pool, case_of, data.derived, recipe.forms_share), sources


def precision_deviation(placement: Placement) -> dict | None:
    """The record of a bfloat16 backbone on the CPU, where the pinned default is float32 (None otherwise).

    What runs in bf16 and what stays fp32 is the GPU path's: the frozen backbone weights and activations in
    bfloat16; LoRA adapters (peft keeps them float32 over a bf16 base), the scorer, the master weights and
    AdamW's state float32; the recipe's numbers unchanged."""
    if placement.device != "cpu" or placement.dtype != "bfloat16":
        return None
    return {"device": "cpu", "dtype": "bfloat16", "default": "float32",
            "float32": ["lora", "head", "optimizer_state"],
            "note": "bfloat16 backbone on the CPU, a deviation from the float32 CPU default; LoRA, the scorer "
                    "and the optimizer state stay float32"}


def _rank0_first(d: Dist, build: Callable[[bool], Any]) -> Any:
    """`build(main)` on rank 0 (which extracts a missing cache), then, past a barrier, on the other ranks
    (which find it complete)."""
    out = build(True) if d.main else None
    if d.active:
        d.barrier()
        if not d.main:
            out = build(False)
    return out


def check_rows(model, name: str, data_dir: Path, pool: list[Record], dev: list[Record]) -> None:
    """Render every training-pool and dev row once with the model's encoder and refuse, before the first update
    and before the run directory exists, a run whose data holds a row this backbone cannot train on: longer
    than the encoder's limit, special-token text of this backbone, an image it cannot take
    (`rlcd.row_check`). Else the sampler would meet the row mid-run, and a resume would meet it again.
    Raises one `RecordError` line: the first row, its rule, the count, the fix."""
    from rlcd.row_check import RowCheck, refuse

    rows = pool + dev
    refuse(RowCheck.for_model(model, name=name).problems(rows, image_root=data_dir), len(rows),
           what="training-pool and dev rows",
           fix=f"`rlcd data prepare FILES --out NEW --model {name}` excludes them with the reason; train on NEW")


def init_centring(s: Session, n_batches: int = 4) -> None:
    """Estimate the scorer's centring statistics from fixed micro-batches before the first update.

    Uses micro-batch indices far outside the training stream (negative-free offset), so the
    estimate is identical on every rank and for every world size; rows, never whole cases.
    """
    src = s.sources.for_update(0)
    batches = [s.batch_of(s.sampler.microbatch(s.recipe.seed + 7919, i, s.recipe.batch_size), src)
               for i in range(n_batches)]
    s.model.init_centring(batches)


# ----------------------------------------------------------------------------------------------
# a run's start


@dataclass
class Start:
    """The checked inputs of a start: frozen config and samples, placement, and what the weights come from."""

    config: dict
    samples: dict
    placement: Placement
    records: tuple[list[Record], list[Record]] | None = None
    loaded: dict | None = None   # a resume's checkpoints/last
    source: dict | None = None   # an --init start's source run (init_source)


@dataclass
class Trainer:
    """A ready run: what `setup` hands the loop. `finished`: a resume with nothing left to do (stopped early)."""

    run: Run
    session: Session
    state: TrainState
    writer: RunWriter
    select: DevSelection
    progress: bool = True
    stop_after: int | None = None
    print_fn: Callable[[str], None] = echo
    finished: dict | None = None


def _resume_start(run: Run, d: Dist, held: contextlib.ExitStack, *, steps: int | None, log: str | None,
                  device: str, dtype: str, print_fn: Callable[[str], None] = echo) -> Start:
    if not run.exists():
        raise ResumeRefused(f"refusing to resume {run.root}: no config.json there (start it with "
                            f"`rlcd train {run.root} --data DATA`)")
    if d.main:  # one writer per run (rank 0 writes; the other ranks never touch the directory)
        held.enter_context(run.lock("train --resume"))
        for gone in ckpt.remove_dead_temps(run.checkpoints_dir):  # a writer killed mid-checkpoint (SIGKILL)
            print_fn(f"train: removed {gone}, the temporary directory of a checkpoint write that was killed")
    samples = run.samples()
    config = check_resume(run, run.config(), samples, steps)
    if log is not None and log != config.get("log", "none"):
        config = {**config, "log": log}
    check_tracker(config.get("log", "none"))
    placement = resolve_placement(device, dtype if dtype != "auto" else config.get("dtype", "auto"),
                                  local_rank=d.local_rank if d.active else None)
    trained = trained_dtype(run, config)
    if trained is not None and placement.dtype != trained:
        asked = f"--dtype {dtype}" if dtype != "auto" else f"--dtype auto (here: {placement.dtype})"
        raise ResumeRefused(f"refusing to resume {run.root} with {asked}: the run trains its backbone in {trained} "
                            f"(config.json, metrics.jsonl) and one run is one precision; resume with --dtype "
                            f"{trained}, or start a new run (--init {run.root} keeps its weights) to train in "
                            f"{placement.dtype}")
    loaded = ckpt.load(run.checkpoint("last"), map_location=str(placement.torch_device))
    return Start(config, samples, placement, loaded=loaded)


def trained_dtype(run: Run, config: dict) -> str | None:
    """The backbone dtype the run has trained in: config.json's `dtype` when it names one, else (`auto`) the one its
    sessions resolved it to (metrics.jsonl's session events); None when neither says. A resume keeps it: config.json
    records one precision for the whole run, so a resume in another one is refused rather than recorded."""
    if config.get("dtype", "auto") != "auto":
        return str(config["dtype"])
    sessions = [row.get("dtype") for row in run.metrics() if row.get("event") == "session" and row.get("dtype")]
    return str(sessions[-1]) if sessions else None


def _new_start(run: Run, d: Dist, *, data_dir: Path | None, model: str, recipe: Recipe | None, steps: int | None,
               model_seed: int, device: str, dtype: str, log: str | None, init: Path | None) -> Start:
    from rlcd.model.backbone import check_backbone_spec

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
    records = load_records(data_dir)
    config, samples = new_run(run.root, data_dir, model, recipe, model_seed=model_seed, world_size=d.world,
                              dtype=dtype, records=records, log=log)
    if recipe.select_by == "nll" and not any(samples["dev"].values()):
        raise OptionError(f"select_by=nll selects on the dev NLL, but {data_dir / 'dev.jsonl'} has no rows; give data "
                          "with a dev split or keep the pinned select_by=macro_accuracy")
    if source is not None:
        config["init"] = dict(source["record"])
        if recipe.init_head == "keep":  # the head continues at (at most) the LR its source last trained it with
            config["init"]["head_lr_peak"] = min(recipe.lr_head, source["record"]["head_lr"])
    return Start(config, samples, placement, records=records, source=source)


def setup(run_dir: Path, *, held: contextlib.ExitStack, data_dir: Path | None = None, model: str = "qwen3.5-0.8b",
          recipe: Recipe | None = None, resume: bool = False, steps: int | None = None,
          stop_after: int | None = None, progress: bool = True, model_seed: int = 0,
          objective_fn: Callable | None = None, device: str = "auto", dtype: str = "auto",
          backbone=None, log: str | None = None, print_fn: Callable[[str], None] = echo,
          feature_cache: bool = True, init: Path | None = None) -> Trainer:
    """The run at `run_dir` ready to train: a new run (`data_dir`, `model`, `recipe`, `init`) or a resume
    (`resume=True`; `steps` may extend it, `log`/`device`/`dtype` may change). See `rlcd.train.train`."""
    run = Run(run_dir)
    d = init_distributed()
    if resume and init is not None:
        raise OptionError(f"--init {init} starts a new run; a resume continues {run.root} from its own checkpoint")
    start = (_resume_start(run, d, held, steps=steps, log=log, device=device, dtype=dtype,
                           print_fn=print_fn) if resume else
             _new_start(run, d, data_dir=data_dir, model=model, recipe=recipe, steps=steps, model_seed=model_seed,
                        device=device, dtype=dtype, log=log, init=init))
    config, loaded, fingerprint = start.config, start.loaded, {}
    deviation = precision_deviation(start.placement)
    if deviation is not None:  # recorded in config.json (never silent); a resume keeps the precision (trained_dtype)
        config["precision_deviation"] = deviation

    def load_weights(model) -> None:
        if loaded is not None:
            model.load_trainable_state_dict(loaded["weights"])
        elif start.source is not None:
            fingerprint["found"] = load_init_weights(model, start.source)  # the centring buffers come with it

    s = build_session(config, start.samples, d, placement=start.placement, backbone=backbone,
                      objective_fn=objective_fn, records=start.records, feature_cache=feature_cache,
                      progress=progress, print_fn=print_fn if d.main else None, load_weights=load_weights,
                      start_step=int(loaded["state"]["step"]) if loaded is not None else 0)
    r = s.recipe
    if d.main:
        notice = deviation_notice(r)
        if notice:
            print_fn(notice)
        if start.source is not None and loaded is None:
            print_fn(init_head_notice(config["init"], r))
        if deviation is not None:
            print_fn(f"train: {deviation['note']} (config.json precision_deviation)")
        print_fn(f"train: {run.root} on {describe(start.placement)}, {d.world} process(es), "
                 f"{r.grad_accum // d.world} x {r.batch_size} examples per process per update")
    state = TrainState()
    if loaded is not None:
        s.optimizer.load_state_dict(loaded["optimizer"])
        ckpt.set_rng_state(loaded["rng"])
        state = TrainState.from_checkpoint(loaded["state"])
        s.consumed.update(loaded["state"]["consumed"])
    writer = RunWriter(run, enabled=d.main)
    t = Trainer(run, s, state, writer, DevSelection(run, s, state, writer), progress=progress,
                stop_after=stop_after, print_fn=print_fn)
    if state.stopped_early is not None:
        if d.main:
            print_fn(early_stop_notice(run, state, r))
        t.finished = {**loaded["state"], "stopped_early": state.stopped_early}
        return t
    if loaded is not None:
        if d.main:
            if config != run.config():
                run.write_config(config)
            run.trim_metrics(state.step)
            from rlcd.dev_evals import trim_dev_evals

            trim_dev_evals(run, state.step)
    else:
        if start.source is not None:
            config["init"]["backbone_fingerprint"] = fingerprint["found"]
        else:
            init_centring(s)
        if d.main:
            Run.create(run.root, config, start.samples)
            held.enter_context(run.lock("train"))
    if d.main:
        writer.tracker = open_tracker(config.get("log", "none"), run, resume_step=state.step if resume else None)
    writer.log({"event": "session", "step": state.step, "world_size": d.world, **start.placement.to_dict(),
                "resume": bool(resume), "features": s.sources.cache_root})
    return t


def init_head_notice(init: dict, r: Recipe) -> str:
    """What an --init start does with the head it is given (config "init"), in one line."""
    if "head_lr_peak" in init:
        return (f"--init: the head keeps its training: head LR peak {init['head_lr_peak']:.3g} with no warm-up (its "
                f"source last trained it at {init['head_lr']:.3g}; lr_head {r.lr_head:.3g}); --recipe init_head=rewarm "
                "warms it up again")
    return f"--init: the head is warmed up again to lr_head {r.lr_head:.3g} (init_head=rewarm)"


def early_stop_notice(run: Run, state: TrainState, r: Recipe) -> str:
    return (f"train: {run.root} stopped early at update {state.stopped_early}: {r.patience} dev evaluation(s) "
            f"without strict improvement (patience {r.patience}); best update {state.best_step} "
            f"({'dev NLL' if r.select_by == 'nll' else 'dev macro accuracy'} {state.best_score}). A resume has nothing left to do; start a new run "
            "(e.g. with --init) to train further")


__all__ = ["build_session", "check_rows", "init_centring", "setup", "Trainer", "Start",
           "early_stop_notice", "init_head_notice"]
