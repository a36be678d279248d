"""What a run starts from, checked before anything is built or written: config.json and samples.json of a
new run, the checks of a resume, the source run of `--init`.

A new run's config freezes the recipe, its deviations, the decay horizon, the model, the data directory
and the versions; samples.json freezes the eligible training ids, the dev subset and the data files'
sha256, which a resume must find unchanged.
"""

from __future__ import annotations

import datetime as _dt
import json
import subprocess
import sys
from pathlib import Path

from rlcd import checkpoint as ckpt
from rlcd.errors import OptionError, UserError
from rlcd.recipe import Recipe, head_lr
from rlcd.run import Run

DATA_FILES = ("train.jsonl", "dev.jsonl", "calibration.jsonl", "test.jsonl")


class ResumeRefused(UserError, RuntimeError):
    """The run directory cannot be resumed with the given data, recipe or flags."""


def load_records(data_dir: Path):
    """The (train, dev) rows of a processed data directory."""
    from rlcd.data.io import load_split

    return load_split(data_dir, "train"), load_split(data_dir, "dev")


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



def check_resume(run: Run, config: dict, samples: dict, steps: int | None) -> dict:
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
    from rlcd.data.sampling import derived_pool, dev_subset, eligible_pool

    data_dir = Path(data_dir).resolve()
    train, dev = records or load_records(data_dir)
    if not train:
        raise OptionError(f"{data_dir}/train.jsonl has no rows; nothing to train on")
    samples = {
        "train": eligible_pool(train, cap=recipe.pool_cap),
        "dev": dev_subset(dev, cap=recipe.dev_cap),
        "files": data_hashes(data_dir),
    }
    if recipe.forms == "derived":
        samples["train_derived"] = derived_pool(train, cap=recipe.pool_cap)
        if not samples["train_derived"]:
            raise OptionError(f"--recipe forms=derived: {data_dir}/train.jsonl holds no derived rows; make a data "
                              f"directory with them: `rlcd data derive {data_dir} --out DIR2`, then --data DIR2")
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
    the same backbone (preset or path, model seed) with the same LoRA and head shapes (a head-only source's LoRA
    is zero, so only its head shape must match: it starts a `lora_layers` run, say, from its trained head). Returns what
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
    head_only = bool(cfg["recipe"].get("head_only"))  # its LoRA is zero: only the head (and centring) carries over
    lora_fields = ("lora_rank", "lora_alpha", "lora_layers")
    diff = [f"{k} {other[k]} there, {mine[k]} here" for k in MODEL_FIELDS
            if mine[k] != other[k] and not (head_only and k in lora_fields)]
    depth = (cfg["recipe"].get("backbone_layers"), recipe.backbone_layers)  # another depth: other features
    diff += [f"backbone_layers {depth[0]} there, {depth[1]} here"] if depth[0] != depth[1] else []
    if diff:
        raise OptionError(f"--init {path}: the trainable weights have another shape ({'; '.join(diff)}); give the "
                          "same model fields (--recipe) as that run")
    state = ckpt.load(best)["state"]
    step = state.get("best_step")
    return {"path": best, "export": src.export_dir / "model.json", "head_only": head_only,
            "record": {"run": str(src.root.resolve()), "checkpoint": "best", "step": step,
                       "weights_sha256": ckpt.weights_sha256(best), "head_lr": last_head_lr(cfg, step or 0),
                       **({"head_only": True} if head_only else {})}}


def last_head_lr(config: dict, step: int) -> float:
    """The LR a run's head was trained with in the last update before its checkpoint at `step` (the peak for an
    untrained head, step 0): what an --init start that keeps that head may continue at."""
    r = Recipe.from_dict(config["recipe"])
    kept = (config.get("init") or {}).get("head_lr_peak")
    if step <= 0:
        return r.lr_head if kept is None else kept
    return head_lr(r, step - 1, int(config["decay_horizon"]), kept)


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
    weights = ckpt.load(source["path"], map_location=str(model.device))["weights"]
    if source.get("head_only"):  # a head-only run's LoRA is zero, whatever its shape: this run's own zero LoRA stays
        weights = {k: v for k, v in weights.items() if not k.startswith("lora.")}
        weights.update({k: v for k, v in model.trainable_state_dict().items() if k.startswith("lora.")})
    model.load_trainable_state_dict(weights)
    return found


def deviation_notice(recipe: Recipe) -> str | None:
    dev = recipe.deviations()
    if not dev:
        return None
    parts = ", ".join(f"{k}={v['value']} (pinned {v['pinned']})" for k, v in dev.items())
    return f"note: this run deviates from the pinned recipe: {parts}"



__all__ = ["DATA_FILES", "ResumeRefused", "check_data_dir", "check_resume", "data_hashes", "deviation_notice",
           "git_revision", "init_source", "last_head_lr", "library_versions", "load_init_weights", "load_records", "new_run"]
