"""Recipe sweeps: a grid of arms x seeds, one run directory (and one process) per run, one summary.

``run_sweep(data, model, grid, seeds, steps, out)``:

1. **Grid expansion** (``expand_grid``). ``grid`` maps Recipe fields to value lists
   (``{"sigma": [0.25, 1, 4], "objective": ["rlcd", "ce"]}``); the arms are the Cartesian product.
   The ``ce`` objective ignores ``sigma`` and ``ce_weight`` (its loss is the soft cross-entropy
   alone), so those keys are dropped from ``ce`` arms and the duplicates collapse into one arm,
   run once per seed; the collapse is reported in ``notes``. Duplicate values in a list are
   dropped too (also noted). ``steps`` and ``seed`` are not grid keys (``steps`` / ``seeds``).
2. **Recipe per run**: ``Recipe(**scaled cadence, **recipe_overrides, **arm params, steps, seed)``.
   With ``scale_cadence`` (default) and ``steps`` below the recipe's 3,600, the cadence fields
   (``eval_every``, ``checkpoint_every``, ``log_every``, ``diagnostics_every``) are scaled by
   ``steps / 3600`` (at least 1), so a small budget still evaluates ~9 times and selects a best
   checkpoint the way the full recipe does; explicit ``recipe_overrides`` win. The resolved recipe
   of every run is in ``summary.json`` and in the run's ``config.json``.
3. **Runs**: ``out/runs/<arm>-s<seed>``. By default each run is its own process,
   ``python -m rlcd.analysis.sweep run-one --config out/configs/<run>.json`` (train with the full
   recipe, then ``evaluate_run``), its output in ``out/logs/<run>.log``; with ``devices`` (e.g.
   ``["0", "1"]``) up to one run per device goes at a time with ``CUDA_VISIBLE_DEVICES`` set, else
   runs go one after another. ``in_process=True`` calls the same function in this process (tests).
   A run whose ``eval/evaluation.json`` exists is skipped (resume a sweep by re-running it); a run
   dir with a different config is refused; an interrupted run is resumed from ``checkpoints/last``.
   A failed run is recorded (``failed``) and the sweep goes on.
4. **Summary**: ``summary.json`` and ``summary.md`` aggregate each arm over its seeds from the
   runs' ``eval/evaluation.json`` (headline split, test when present): for ``raw`` and ``calibrated``
   probabilities, overall / per type / group macro accuracy, NLL, Brier, ECE, target-referenced ECE,
   sharpness gap, and, when rows carry a known posterior, the same against the posterior plus the
   Bayes gap; the fitted temperature per type. Each metric is
   ``{"mean", "std", "n", "values"}`` with the sample standard deviation (ddof 1; ``None`` with
   one seed). Plots: ``fitted_T_vs_sigma.png`` and ``nll_vs_sigma.png`` (arms without a sigma,
   i.e. ``ce``, drawn as horizontal reference lines).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from rlcd.recipe import Recipe

FORMAT = "rlcd.sweep/1"
CADENCE = ("eval_every", "checkpoint_every", "log_every", "diagnostics_every")
NOT_GRID_KEYS = ("steps", "seed")
CE_IGNORES = ("sigma", "ce_weight")  # the ce objective's loss does not read these
TYPES = ("choice", "noul", "score")
VIEWS = ("raw", "calibrated")
BLOCK_METRICS = ("accuracy", "nll", "brier", "ece", "ece_target", "sharpness_gap")
POSTERIOR_METRICS = ("accuracy", "nll", "brier", "ece_target", "sharpness_gap", "bayes_gap", "model_nll",
                     "bayes_nll")


class SweepError(ValueError):
    """A sweep that cannot be planned or resumed as asked."""


# ----------------------------------------------------------------------------------------------
# grid


def _recipe_types() -> dict[str, type]:
    base = Recipe()
    return {f.name: type(getattr(base, f.name)) for f in fields(Recipe)}


def coerce_value(key: str, value: Any) -> Any:
    """A grid/override value converted to the type of the Recipe field ``key``."""
    types = _recipe_types()
    if key not in types:
        raise SweepError(f"{key!r} is not a recipe field (known: {', '.join(sorted(types))})")
    kind = types[key]
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
        raise SweepError(f"{key}: {value!r} is not a valid {kind.__name__}") from None


def parse_grid(specs: Sequence[str]) -> dict[str, list[Any]]:
    """``["sigma=0.25,1,4", "objective=rlcd,ce"]`` -> ``{"sigma": [0.25, 1.0, 4.0], "objective": [...]}``."""
    grid: dict[str, list[Any]] = {}
    for spec in specs:
        if "=" not in spec:
            raise SweepError(f"--grid {spec!r}: expected KEY=V1,V2,...")
        key, _, values = spec.partition("=")
        key = key.strip().replace("-", "_")
        items = [v.strip() for v in values.split(",") if v.strip()]
        if not items:
            raise SweepError(f"--grid {spec!r}: no values")
        if key in grid:
            raise SweepError(f"--grid {key} given twice")
        grid[key] = [coerce_value(key, v) for v in items]
    return grid


def parse_overrides(specs: Sequence[str]) -> dict[str, Any]:
    """``["eval_every=5", "batch_size=4"]`` -> recipe overrides (typed)."""
    out: dict[str, Any] = {}
    for spec in specs:
        if "=" not in spec:
            raise SweepError(f"--recipe {spec!r}: expected KEY=VALUE")
        key, _, value = spec.partition("=")
        key = key.strip().replace("-", "_")
        out[key] = coerce_value(key, value.strip())
    return out


def parse_seeds(value: int | str | Sequence[int]) -> list[int]:
    """``3`` -> [0, 1, 2]; ``"0,5,7"`` -> [0, 5, 7]; a list stays as it is."""
    if isinstance(value, str):
        text = value.strip()
        if "," in text:
            seeds = [int(x) for x in text.split(",") if x.strip()]
        else:
            seeds = list(range(int(text)))
    elif isinstance(value, int):
        seeds = list(range(value))
    else:
        seeds = [int(x) for x in value]
    if not seeds:
        raise SweepError("need at least one seed")
    if len(set(seeds)) != len(seeds):
        raise SweepError(f"seeds repeat: {seeds}")
    return seeds


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def arm_name(params: Mapping[str, Any]) -> str:
    """Directory-safe arm name: the objective's value, then ``<key><value>`` per other key."""
    parts = []
    for k, v in sorted(params.items(), key=lambda kv: kv[0] != "objective"):
        parts.append(_fmt_value(v) if k == "objective" else f"{k}{_fmt_value(v)}")
    name = "-".join(parts) or "base"
    return "".join(c if (c.isalnum() or c in "._-+") else "_" for c in name)


@dataclass
class Arm:
    name: str
    params: dict[str, Any]                       # the grid values that define the arm
    merged: list[dict[str, Any]] = field(default_factory=list)  # grid points it stands for
    objective: str = "rlcd"                      # effective objective (grid value, else override)


def expand_grid(grid: Mapping[str, Sequence[Any]], recipe_overrides: Mapping[str, Any] | None = None,
                ) -> tuple[list[Arm], list[str]]:
    """Arms of the grid (Cartesian product, ce arms deduplicated) and human-readable notes."""
    overrides = dict(recipe_overrides or {})
    notes: list[str] = []
    clean: dict[str, list[Any]] = {}
    for key, values in grid.items():
        if key in NOT_GRID_KEYS:
            raise SweepError(f"{key!r} cannot be a grid key; use the sweep's --{key}s/--steps option")
        typed = [coerce_value(key, v) for v in values]
        uniq = list(dict.fromkeys(typed))
        if not uniq:
            raise SweepError(f"grid key {key!r} has no values")
        if len(uniq) < len(typed):
            notes.append(f"grid {key}: repeated values dropped ({len(typed)} -> {len(uniq)})")
        clean[key] = uniq
    keys = list(clean)
    arms: dict[str, Arm] = {}
    for combo in itertools.product(*(clean[k] for k in keys)):
        point = dict(zip(keys, combo))
        params = dict(point)
        objective = params.get("objective", overrides.get("objective", "rlcd"))
        if objective == "ce":
            for k in CE_IGNORES:
                params.pop(k, None)
        name = arm_name(params)
        arm = arms.setdefault(name, Arm(name=name, params=params, objective=str(objective)))
        arm.merged.append(point)
    for arm in arms.values():
        dropped = sorted({k for p in arm.merged for k in p if k not in arm.params})
        if dropped:
            n = len(arm.merged)
            notes.append(f"arm {arm.name!r}: objective=ce does not read {', '.join(dropped)}; "
                         + (f"its {n} grid points are run once per seed" if n > 1 else "the value is ignored"))
    return list(arms.values()), notes


def scaled_cadence(steps: int) -> dict[str, int]:
    """Cadence fields scaled to a budget below the recipe's (empty at or above it)."""
    base = Recipe()
    if steps >= base.steps:
        return {}
    return {f: max(1, round(getattr(base, f) * steps / base.steps)) for f in CADENCE}


# ----------------------------------------------------------------------------------------------
# plan


@dataclass
class RunSpec:
    name: str
    arm: str
    seed: int
    run_dir: Path
    config: dict[str, Any]

    @property
    def evaluation_path(self) -> Path:
        return self.run_dir / "eval" / "evaluation.json"


def plan_runs(data: Path, model: str, arms: Sequence[Arm], seeds: Sequence[int], steps: int, out: Path, *,
              recipe_overrides: Mapping[str, Any] | None = None, scale_cadence: bool = True,
              model_seed: int = 0) -> list[RunSpec]:
    """One RunSpec per arm x seed, with its full resolved recipe (validated here, before any run)."""
    overrides = {k: coerce_value(k, v) for k, v in (recipe_overrides or {}).items()}
    for k in NOT_GRID_KEYS:
        if k in overrides:
            raise SweepError(f"{k!r} is set by the sweep (--{'steps' if k == 'steps' else 'seeds'}), not an override")
    base = scaled_cadence(steps) if scale_cadence else {}
    specs = []
    for arm in arms:
        for seed in seeds:
            kw = {**base, **overrides, **arm.params, "steps": int(steps), "seed": int(seed)}
            try:
                recipe = Recipe(**kw)
            except (TypeError, ValueError) as e:
                raise SweepError(f"arm {arm.name!r}: {e}") from None
            name = f"{arm.name}-s{seed}"
            run_dir = (Path(out) / "runs" / name).resolve()
            config = {"run_dir": str(run_dir), "data_dir": str(Path(data).resolve()), "model": model,
                      "model_seed": model_seed, "recipe": recipe.to_dict()}
            specs.append(RunSpec(name=name, arm=arm.name, seed=int(seed), run_dir=run_dir, config=config))
    return specs


# ----------------------------------------------------------------------------------------------
# one run


def _same_run(existing: Mapping[str, Any], config: Mapping[str, Any]) -> list[str]:
    diffs = []
    if existing.get("model") != config["model"]:
        diffs.append(f"model {existing.get('model')!r} != {config['model']!r}")
    if str(Path(existing.get("data_dir", "")).resolve()) != str(Path(config["data_dir"]).resolve()):
        diffs.append(f"data {existing.get('data_dir')!r} != {config['data_dir']!r}")
    old = existing.get("recipe", {})
    for k, v in config["recipe"].items():
        if old.get(k) != v:
            diffs.append(f"recipe.{k} {old.get(k)!r} != {v!r}")
    if existing.get("model_seed", 0) != config.get("model_seed", 0):
        diffs.append(f"model_seed {existing.get('model_seed', 0)} != {config.get('model_seed', 0)}")
    return diffs


def run_one(config: Mapping[str, Any], *, progress: bool = False) -> dict[str, Any]:
    """Train (or resume) and evaluate one sweep run; returns its evaluation dict.

    ``config``: ``{"run_dir", "data_dir", "model", "model_seed", "recipe": full Recipe dict}``.
    ``progress``: the run's own training and scoring progress (a worker writes it to its log; in
    process the sweep's per-run lines are enough).
    """
    from rlcd import checkpoint as ckpt
    from rlcd.evaluate import evaluate_run
    from rlcd.train import train

    run_dir = Path(config["run_dir"])
    recipe = Recipe.from_dict(dict(config["recipe"]))
    ev_path = run_dir / "eval" / "evaluation.json"
    if ev_path.is_file():
        return json.loads(ev_path.read_text())
    if (run_dir / "config.json").is_file():
        existing = json.loads((run_dir / "config.json").read_text())
        diffs = _same_run(existing, config)
        if diffs:
            raise SweepError(f"{run_dir} holds a different run ({'; '.join(diffs)}); remove it or use another --out")
        last = ckpt.resolve(run_dir / "checkpoints" / "last")
        if last is None:
            # started (config written) but died before its first checkpoint: nothing to keep
            shutil.rmtree(run_dir)
        else:
            step = json.loads((last / ckpt.STATE).read_text()).get("step", 0)
            if step < recipe.steps:
                train(run_dir, resume=True, progress=progress)
    if not (run_dir / "config.json").is_file():
        train(run_dir, data_dir=Path(config["data_dir"]), model=config["model"], recipe=recipe, progress=progress,
              model_seed=int(config.get("model_seed", 0)))
    return evaluate_run(run_dir, progress=progress)


# ----------------------------------------------------------------------------------------------
# executing the plan


@dataclass
class RunResult:
    name: str
    status: str          # "done" | "skipped" | "failed"
    seconds: float
    error: str | None = None
    log: str | None = None


def _worker_command(config_path: Path) -> list[str]:
    return [sys.executable, "-m", "rlcd.analysis.sweep", "run-one", "--config", str(config_path)]


def _write_config(out: Path, spec: RunSpec) -> Path:
    path = out / "configs" / f"{spec.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec.config, indent=2, sort_keys=True) + "\n")
    return path


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def execute(specs: Sequence[RunSpec], out: Path, *, in_process: bool = False, devices: Sequence[str] | None = None,
            on_event: Callable[[str, RunSpec, RunResult | None], None] | None = None) -> list[RunResult]:
    """Run every spec whose evaluation.json is missing; returns one RunResult per spec (plan order)."""
    out = Path(out)
    results: dict[str, RunResult] = {}
    todo = []
    for spec in specs:
        if spec.evaluation_path.is_file():
            if (spec.run_dir / "config.json").is_file():
                diffs = _same_run(json.loads((spec.run_dir / "config.json").read_text()), spec.config)
                if diffs:
                    res = RunResult(spec.name, "failed", 0.0,
                                    f"{spec.run_dir} holds a different run: {'; '.join(diffs)}")
                    results[spec.name] = res
                    on_event and on_event("end", spec, res)
                    continue
            res = RunResult(spec.name, "skipped", 0.0)
            results[spec.name] = res
            on_event and on_event("end", spec, res)
        else:
            todo.append(spec)
    if in_process:
        for spec in todo:
            on_event and on_event("start", spec, None)
            t0 = time.perf_counter()
            try:
                run_one(spec.config)
                res = RunResult(spec.name, "done", time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - one failed run must not end the sweep
                res = RunResult(spec.name, "failed", time.perf_counter() - t0, f"{type(e).__name__}: {e}")
            results[spec.name] = res
            on_event and on_event("end", spec, res)
        return [results[s.name] for s in specs]

    slots: list[str | None] = list(devices) if devices else [None]
    running: dict[str | None, tuple[RunSpec, subprocess.Popen, float, Path, Any]] = {}
    queue = list(todo)
    while queue or running:
        for slot in slots:
            if slot in running or not queue:
                continue
            spec = queue.pop(0)
            cfg = _write_config(out, spec)
            log = out / "logs" / f"{spec.name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            env = dict(os.environ)
            if slot is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(slot)
            fh = open(log, "w")
            on_event and on_event("start", spec, None)
            proc = subprocess.Popen(_worker_command(cfg), stdout=fh, stderr=subprocess.STDOUT, env=env)
            running[slot] = (spec, proc, time.perf_counter(), log, fh)
        finished = [s for s, (_, p, *_r) in running.items() if p.poll() is not None]
        if not finished:
            time.sleep(0.2)
            continue
        for slot in finished:
            spec, proc, t0, log, fh = running.pop(slot)
            fh.close()
            dt = time.perf_counter() - t0
            if proc.returncode == 0 and spec.evaluation_path.is_file():
                res = RunResult(spec.name, "done", dt, log=str(log))
            else:
                res = RunResult(spec.name, "failed", dt, f"exit code {proc.returncode}; last lines of {log}:\n"
                                f"{_tail(log)}", log=str(log))
            results[spec.name] = res
            on_event and on_event("end", spec, res)
    return [results[s.name] for s in specs]


# ----------------------------------------------------------------------------------------------
# summary


def _get(d: Any, path: Sequence[str]) -> Any:
    for k in path:
        if not isinstance(d, Mapping) or k not in d:
            return None
        d = d[k]
    return d


def metric_values(ev: Mapping[str, Any]) -> dict[str, float]:
    """Flat ``{"raw.overall.nll": v, ..., "temperature.choice": T}`` from one evaluation dict."""
    out: dict[str, float] = {}

    def put(key: str, v: Any) -> None:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
            out[key] = float(v)

    for view in VIEWS:
        summ = ev.get(view) or {}
        blocks = {"overall": summ.get("overall"), "group_macro": summ.get("group_macro")}
        for t, b in (summ.get("per_type") or {}).items():
            blocks[f"per_type.{t}"] = b
        for bname, block in blocks.items():
            if not isinstance(block, Mapping):
                continue
            for m in BLOCK_METRICS:
                put(f"{view}.{bname}.{m}", block.get(m))
            post = block.get("posterior")
            if isinstance(post, Mapping):
                for m in POSTERIOR_METRICS:
                    put(f"{view}.{bname}.posterior.{m}", post.get(m))
    for t, v in (ev.get("temperatures") or {}).items():
        put(f"temperature.{t}", v)
    return out


def mean_std(values: Sequence[float]) -> dict[str, Any]:
    """``{"mean", "std" (sample, ddof 1; None for one value), "n", "values"}``."""
    vals = [float(v) for v in values]
    n = len(vals)
    if n == 0:
        return {"mean": None, "std": None, "n": 0, "values": []}
    mean = math.fsum(vals) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else None
    return {"mean": mean, "std": std, "n": n, "values": vals}


def _fit_notes(ev: Mapping[str, Any]) -> dict[str, str]:
    cal = _get(ev, ("meta", "calibration")) or {}
    return {t: info["reason"] for t, info in cal.items() if isinstance(info, Mapping) and info.get("reason")}


def summarize_runs(arms: Sequence[Arm], specs: Sequence[RunSpec], *, results: Sequence[RunResult] = (),
                   notes: Sequence[str] = (), config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The summary.json content: per arm, mean/std over its seeds of every metric (see module doc)."""
    by_result = {r.name: r for r in results}
    out_arms = []
    failed = []
    for arm in arms:
        mine = [s for s in specs if s.arm == arm.name]
        per_metric: dict[str, list[float]] = {}
        runs, splits, fit = [], set(), {}
        for spec in mine:
            res = by_result.get(spec.name)
            entry: dict[str, Any] = {"name": spec.name, "seed": spec.seed, "run_dir": str(spec.run_dir),
                                     "status": res.status if res else None}
            usable = res is None or res.status in ("done", "skipped")
            if usable and spec.evaluation_path.is_file():
                ev = json.loads(spec.evaluation_path.read_text())
                entry["status"] = res.status if res is not None else "found"
                entry["headline_split"] = ev.get("headline_split")
                splits.add(ev.get("headline_split"))
                for k, v in metric_values(ev).items():
                    per_metric.setdefault(k, []).append(v)
                notes_t = _fit_notes(ev)
                if notes_t:
                    fit[spec.name] = notes_t
            else:
                entry["status"] = "failed" if res is None or res.status == "failed" else res.status
                entry["error"] = res.error if res else "no eval/evaluation.json"
                failed.append(spec.name)
            if res is not None:
                entry["seconds"] = res.seconds
                if res.log:
                    entry["log"] = res.log
            runs.append(entry)
        recipe = mine[0].config["recipe"] if mine else {}
        sigma = arm.params.get("sigma", recipe.get("sigma")) if arm.objective == "rlcd" else None
        out_arms.append({
            "name": arm.name,
            "params": dict(arm.params),
            "objective": arm.objective,
            "sigma": sigma,
            "grid_points": [dict(p) for p in arm.merged],
            "recipe": {k: v for k, v in recipe.items() if k != "seed"},
            "seeds": [s.seed for s in mine],
            "n_ok": sum(1 for r in runs if r["status"] != "failed"),
            "headline_split": sorted(x for x in splits if x) or None,
            "runs": runs,
            "temperature_fit_notes": fit,
            "metrics": {k: mean_std(v) for k, v in sorted(per_metric.items())},
        })
    return {"format": FORMAT, "config": dict(config or {}), "notes": list(notes), "arms": out_arms,
            "failed": failed}


def _pm(stat: Mapping[str, Any] | None, digits: int = 3) -> str:
    if not stat or stat.get("mean") is None:
        return "–"
    s = f"{stat['mean']:.{digits}f}"
    if stat.get("std") is not None:
        s += f" ± {stat['std']:.{digits}f}"
    return s


def summary_markdown(summary: Mapping[str, Any]) -> str:
    cfg = summary.get("config", {})
    arms = summary["arms"]
    md = ["# Sweep summary", ""]
    if cfg:
        md += [f"Data `{cfg.get('data')}`, model `{cfg.get('model')}`, {cfg.get('steps')} updates, seeds "
               f"{cfg.get('seeds')}; grid `{json.dumps(cfg.get('grid'))}`; recipe overrides "
               f"`{json.dumps(cfg.get('recipe_overrides'))}`"
               + (f"; cadence scaled to the budget: `{json.dumps(cfg.get('cadence'))}`" if cfg.get("cadence") else "")
               + ".", ""]
    md += ["Every cell is the mean ± sample standard deviation over seeds (no ± with one seed) of the run's "
           "headline split (test when present). Lower is better for NLL, Brier and ECE; sharpness gap = "
           "mean max p − mean max target (> 0: sharper than the targets). ECE-t is the target-referenced ECE.", ""]
    if summary.get("notes"):
        md += ["Notes:", ""] + [f"- {n}" for n in summary["notes"]] + [""]

    def table(title: str, prefix: str, cols: Sequence[tuple[str, str]], extra_t: bool = False) -> list[str]:
        head = ["arm", "n"] + [c for c, _ in cols] + ([f"T {t}" for t in TYPES] if extra_t else [])
        lines = [f"## {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        any_row = False
        for a in arms:
            m = a["metrics"]
            cells = [_pm(m.get(f"{prefix}.{key}")) for _, key in cols]
            if all(c == "–" for c in cells):
                continue
            any_row = True
            if extra_t:
                cells += [_pm(m.get(f"temperature.{t}"), 2) for t in TYPES]
            lines.append("| " + " | ".join([f"`{a['name']}`", str(a["n_ok"])] + cells) + " |")
        return lines + [""] if any_row else []

    cols = [("accuracy", "accuracy"), ("NLL", "nll"), ("Brier", "brier"), ("ECE-t", "ece_target"),
            ("ECE", "ece"), ("sharpness gap", "sharpness_gap")]
    md += table("Raw probabilities (overall)", "raw.overall", cols, extra_t=True)
    md += table("Calibrated probabilities (overall, per-type temperatures)", "calibrated.overall", cols)
    pcols = [("NLL vs posterior", "posterior.nll"), ("Brier vs posterior", "posterior.brier"),
             ("ECE-t vs posterior", "posterior.ece_target"), ("sharpness gap vs posterior", "posterior.sharpness_gap"),
             ("Bayes gap", "posterior.bayes_gap")]
    post_raw = table("Against the known posterior (raw)", "raw.overall", pcols)
    post_cal = table("Against the known posterior (calibrated)", "calibrated.overall", pcols)
    if post_raw or post_cal:
        md += ["Bayes gap = model NLL − the posterior's own NLL against the target (0 is the floor).", ""]
        md += post_raw + post_cal
    else:
        md += ["## Against the known posterior", "", "No rows carry a posterior.", ""]
    md += ["## Per type (raw NLL / calibrated NLL)", ""]
    head = ["arm"] + [f"{t} raw" for t in TYPES] + [f"{t} cal" for t in TYPES]
    md += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a in arms:
        m = a["metrics"]
        md.append("| " + " | ".join([f"`{a['name']}`"] + [_pm(m.get(f"raw.per_type.{t}.nll")) for t in TYPES]
                                     + [_pm(m.get(f"calibrated.per_type.{t}.nll")) for t in TYPES]) + " |")
    md.append("")
    fit = {a["name"]: a["temperature_fit_notes"] for a in arms if a["temperature_fit_notes"]}
    if fit:
        md += ["## Temperature fits that fell back", ""]
        for arm, runs in fit.items():
            for run, by_type in runs.items():
                md += [f"- `{run}`: " + "; ".join(f"{t}: {r}" for t, r in by_type.items())]
        md += [""]
    md += ["## Runs", "", "| arm | run | status | seconds |", "|---|---|---|---|"]
    for a in arms:
        for r in a["runs"]:
            sec = f"{r['seconds']:.1f}" if r.get("seconds") else "–"
            md.append(f"| `{a['name']}` | `{r['name']}` | {r['status']} | {sec} |")
    md.append("")
    if summary.get("failed"):
        md += ["## Failed runs", ""]
        for a in arms:
            for r in a["runs"]:
                if r["status"] == "failed":
                    err = (r.get("error") or "").strip().splitlines()
                    md.append(f"- `{r['name']}`: {err[0] if err else 'unknown error'}"
                              + (f" (log `{r['log']}`)" if r.get("log") else ""))
        md.append("")
    md += ["## Plots", "", "![fitted temperature vs sigma](fitted_T_vs_sigma.png)", "",
           "![NLL vs sigma](nll_vs_sigma.png)", ""]
    return "\n".join(md)


def _series_key(arm: Mapping[str, Any]) -> str:
    rest = {k: v for k, v in arm["params"].items() if k not in ("sigma", "objective")}
    label = arm["objective"]
    if rest:
        label += " " + ",".join(f"{k}={_fmt_value(v)}" for k, v in rest.items())
    return label


def plot_vs_sigma(summary: Mapping[str, Any], metrics: Sequence[tuple[str, str]], ylabel: str, title: str,
                  path: Path) -> Path:
    """One line (with ±std error bars) per (metric, arm family) over sigma; arms without sigma as
    horizontal dashed reference lines (with a ±std band)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    arms = summary["arms"]
    curves = [a for a in arms if a.get("sigma") is not None]
    refs = [a for a in arms if a.get("sigma") is None]
    styles = ("-", "-.", ":", (0, (5, 1)))  # one per sigma family; a metric keeps one colour throughout
    families: dict[str, list] = {}
    for a in curves:
        families.setdefault(_series_key(a), []).append(a)
    sigmas = sorted({float(a["sigma"]) for a in curves})
    drawn = False
    for mi, (metric, mlabel) in enumerate(metrics):
        colour = f"C{mi}"
        for fi, (fam, members) in enumerate(families.items()):
            pts = []
            for a in sorted(members, key=lambda x: float(x["sigma"])):
                st = a["metrics"].get(metric)
                if st and st.get("mean") is not None:
                    pts.append((float(a["sigma"]), st["mean"], st.get("std") or 0.0))
            if not pts:
                continue
            xs, ys, es = zip(*pts)
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, color=colour, linestyle=styles[fi % len(styles)],
                        label=f"{mlabel} ({fam})")
            drawn = True
        for a in refs:
            st = a["metrics"].get(metric)
            if not st or st.get("mean") is None:
                continue
            ax.axhline(st["mean"], linestyle="--", color=colour, alpha=0.8,
                       label=f"{mlabel} ({_series_key(a)}, no sigma)")
            if st.get("std"):
                ax.axhspan(st["mean"] - st["std"], st["mean"] + st["std"], color=colour, alpha=0.12)
            drawn = True
    if sigmas and min(sigmas) > 0 and max(sigmas) / min(sigmas) >= 8:
        ax.set_xscale("log")
    if sigmas:
        ax.minorticks_off()
        ax.set_xticks(sigmas)
        ax.set_xticklabels([f"{s:g}" for s in sigmas])
    ax.set_xlabel("sigma (logit noise std)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if drawn:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def write_summary(out: Path, summary: Mapping[str, Any]) -> dict[str, Path]:
    from rlcd.metrics import dumps

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "summary.json", "md": out / "summary.md", "fitted_T": out / "fitted_T_vs_sigma.png",
             "nll": out / "nll_vs_sigma.png"}
    paths["json"].write_text(dumps(summary), encoding="utf-8")
    paths["md"].write_text(summary_markdown(summary), encoding="utf-8")
    plot_vs_sigma(summary, [(f"temperature.{t}", f"T {t}") for t in TYPES], "fitted temperature",
                  "fitted temperature per type vs sigma", paths["fitted_T"])
    plot_vs_sigma(summary, [("raw.overall.nll", "NLL raw"), ("calibrated.overall.nll", "NLL calibrated")],
                  "test NLL", "NLL vs sigma", paths["nll"])
    return paths


# ----------------------------------------------------------------------------------------------
# the sweep


def run_sweep(data: Path, model: str, grid: Mapping[str, Sequence[Any]], seeds: int | str | Sequence[int],
              steps: int, out: Path, recipe_overrides: Mapping[str, Any] | None = None, *,
              scale_cadence: bool = True, in_process: bool = False, devices: Sequence[str] | None = None,
              dry_run: bool = False, progress: bool | None = None, model_seed: int = 0) -> dict[str, Any]:
    """Plan, run (skipping finished runs), summarise; writes summary.json/.md and plots under ``out``.

    With ``dry_run`` nothing is trained: the run configs are written under ``out/configs`` and the
    returned summary lists the worker command of every run (``commands``) for an external scheduler.
    """
    from rich.console import Console

    out = Path(out)
    data = Path(data)
    if not (data / "train.jsonl").is_file():
        raise SweepError(f"{data} is not a processed data dir (no train.jsonl); run `rlcd data prepare` first")
    overrides = {k: coerce_value(k, v) for k, v in (recipe_overrides or {}).items()}
    seed_list = parse_seeds(seeds)
    arms, notes = expand_grid(grid, overrides)
    specs = plan_runs(data, model, arms, seed_list, steps, out, recipe_overrides=overrides,
                      scale_cadence=scale_cadence, model_seed=model_seed)
    cadence = scaled_cadence(steps) if scale_cadence else {}
    cadence = {k: v for k, v in cadence.items() if k not in overrides}
    config = {"data": str(data.resolve()), "model": model, "grid": {k: list(v) for k, v in grid.items()},
              "seeds": seed_list, "steps": int(steps), "recipe_overrides": overrides, "cadence": cadence,
              "mode": "in-process" if in_process else "subprocess", "devices": list(devices) if devices else None}
    console = Console(stderr=True)
    console.print(f"sweep: {len(arms)} arms x {len(seed_list)} seeds = {len(specs)} runs -> {out}", highlight=False)
    for n in notes:
        console.print(f"  note: {n}", highlight=False)
    out.mkdir(parents=True, exist_ok=True)
    if dry_run:
        commands = [" ".join(_worker_command(_write_config(out, s))) for s in specs]
        return {"format": FORMAT, "config": config, "notes": notes, "commands": commands,
                "arms": [{"name": a.name, "params": a.params, "grid_points": a.merged} for a in arms]}

    use_rich = console.is_terminal if progress is None else progress
    bar = task = None
    if use_rich:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("[bold]sweep[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                       TimeElapsedColumn(), console=console)
        bar.start()
        task = bar.add_task("", total=len(specs))

    def on_event(kind: str, spec: RunSpec, res: RunResult | None) -> None:
        if kind == "start":
            if bar is not None:
                bar.update(task, description=spec.name)
            else:
                console.print(f"  start {spec.name}", highlight=False)
            return
        assert res is not None
        msg = f"  {res.status:7s} {spec.name}" + (f" ({res.seconds:.1f} s)" if res.seconds else "")
        if res.status == "failed":
            msg += f": {(res.error or '').splitlines()[0] if res.error else ''}"
        console.print(msg, highlight=False, markup=False)
        if bar is not None:
            bar.advance(task)

    try:
        results = execute(specs, out, in_process=in_process, devices=devices, on_event=on_event)
    finally:
        if bar is not None:
            bar.stop()
    summary = summarize_runs(arms, specs, results=results, notes=notes, config=config)
    paths = write_summary(out, summary)
    console.print(f"wrote {paths['json']}, {paths['md']}, {paths['fitted_T'].name}, {paths['nll'].name}",
                  highlight=False)
    return summary


# ----------------------------------------------------------------------------------------------
# worker entry point: python -m rlcd.analysis.sweep run-one --config FILE


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcd.analysis.sweep",
                                     description="Sweep worker: train + evaluate one run with a full recipe.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    one = sub.add_parser("run-one", help="train (or resume) and evaluate one run from a JSON config")
    one.add_argument("--config", required=True, type=Path,
                     help='{"run_dir", "data_dir", "model", "model_seed", "recipe": {...}}')
    args = parser.parse_args(argv)
    if args.cmd == "run-one":
        config = json.loads(args.config.read_text())
        ev = run_one(config, progress=True)
        from rlcd.evaluate import print_summary

        print_summary(ev)
        return 0
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
