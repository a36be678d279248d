"""`rlcd train`: a new run with the recipe (and any `--recipe` overrides), or `--resume` of one."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from rlcd.cli._common import DeviceOpt, DType, DTypeOpt, RunAlias, RunArg, echo_json, is_main_process


class Objective(str, Enum):
    rlcd = "rlcd"
    ce = "ce"


class Tracker(str, Enum):
    none = "none"
    tensorboard = "tensorboard"


def train(
    run: RunArg = None,
    data: Annotated[Optional[Path], typer.Option(help="processed data directory (rlcd data prepare)")] = None,
    run_alias: RunAlias = None,
    model: Annotated[Optional[str], typer.Option(
        help="backbone: a preset (qwen3.5-0.8b, the default; qwen3.5-2b, tiny, tiny-toy, smollm2-135m, "
             "gemma3-270m, tiny-llama), a local model directory, a .gguf file or a hub id owner/name@revision (any "
             "Qwen3.5 or text causal LM)")] = None,
    resume: Annotated[Optional[Path], typer.Option(help="resume this run (only --steps may grow)")] = None,
    init: Annotated[Optional[Path], typer.Option(
        "--init", metavar="RUN", help="start from RUN's dev-selected (best) LoRA + head weights, with a fresh "
                                      "optimizer and schedule (same backbone required); recorded in config.json")] = None,
    steps: Annotated[Optional[int], typer.Option(min=1, help="optimizer updates (recipe: 3600)")] = None,
    seed: Annotated[Optional[int], typer.Option(help="sampling, LoRA and noise seed (recipe: 0)")] = None,
    objective: Annotated[Optional[Objective], typer.Option(help="rlcd (recipe) or the CE-only arm")] = None,
    sigma: Annotated[Optional[float], typer.Option(help="std of the logit perturbations (recipe: 0.3)")] = None,
    ce_weight: Annotated[Optional[float], typer.Option(help="weight of the soft CE term (recipe: 1.0)")] = None,
    recipe: Annotated[Optional[list[str]], typer.Option(
        "--recipe", metavar="FIELD=VALUE", help="override any recipe field (repeatable), e.g. --recipe lora_rank=4; "
                                                "recorded in config.json")] = None,
    log: Annotated[Optional[Tracker], typer.Option(
        help="experiment tracking: tensorboard writes every metrics.jsonl scalar to RUN/tb/ (open it with "
             "`tensorboard --logdir RUN/tb`; needs pip install 'rlcd\\[tracking]'); none (the default). Recorded in "
             "config.json: a resume keeps the run's choice unless --log is given", show_default=False)] = None,
    device: DeviceOpt = "auto",
    dtype: DTypeOpt = DType.auto,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="head-only phases run the frozen backbone live "
                                           "instead of reading DATA/features/ (rlcd features)")] = False,
) -> None:
    """Train a run with the fixed recipe, or resume one (a larger --steps extends it).

    New run: `rlcd train RUN --data DATA [--model M]`. Resume: `rlcd train --resume RUN [--steps N]`.
    Under torchrun (`torchrun --nproc_per_node 2 -m rlcd.cli train RUN --data DATA`: RUN positional) every
    update keeps the recipe's batch of 8 x 4 examples, split over the processes; rank 0 prints the result.
    Progress and notices go to stderr; the final state (JSON) to stdout.
    """
    from rlcd.errors import OptionError
    from rlcd.recipe import Recipe, parse_overrides
    from rlcd.train import exit_torchrun_rank
    from rlcd.train import train as run_train

    if resume is not None:
        frozen = [flag for flag, value in (("--data", data), ("--model", model), ("--seed", seed),
                                           ("--objective", objective), ("--sigma", sigma), ("--ce-weight", ce_weight),
                                           ("--recipe", recipe), ("--init", init)) if value]
        if frozen:
            raise OptionError(f"--resume {resume}: {', '.join(frozen)} would change the run's frozen config; a resume "
                              "takes only --steps (larger), --log, --device and --dtype; start a new run to change the rest")
        for other in (run, run_alias):
            if other is not None and Path(other) != Path(resume):
                raise OptionError(f"--resume {resume} and run directory {other} differ; give the run once")
        out = run_train(resume, resume=True, steps=steps, device=device, dtype=dtype.value,
                        log=log.value if log else None, feature_cache=not no_cache)
    else:
        if run is not None and run_alias is not None and Path(run) != Path(run_alias):
            raise typer.BadParameter(f"RUN given twice ({run} and --run {run_alias}); give it once")
        path = run if run is not None else run_alias
        if path is None or data is None:
            raise typer.BadParameter("a new run needs a run directory and --data: rlcd train RUN --data DATA "
                                     "(or rlcd train --resume RUN)")
        fields = parse_overrides(recipe or [])
        knobs = {k: v for k, v in (("seed", seed), ("objective", objective.value if objective else None),
                                   ("sigma", sigma), ("ce_weight", ce_weight)) if v is not None}
        both = sorted(set(fields) & set(knobs))
        if both:
            raise OptionError(f"--{both[0].replace('_', '-')} and --recipe {both[0]}=... both given; give it once")
        rec = Recipe().with_(**fields, **knobs)
        if init is not None and model is None:  # --init: the source run's backbone unless --model says otherwise
            from rlcd.run import Run

            model = Run.open(init).config().get("model")
        out = run_train(path, data_dir=data, model=model or "qwen3.5-0.8b", recipe=rec, steps=steps,
                        device=device, dtype=dtype.value, log=log.value if log else None, feature_cache=not no_cache,
                        init=init)
    if is_main_process():  # under torchrun every rank returns the same state: one JSON object on stdout
        echo_json({k: out[k] for k in ("step", "best_step", "best_score")})
    exit_torchrun_rank(0)  # a finished torchrun rank leaves before finalization, where gloo can abort it
