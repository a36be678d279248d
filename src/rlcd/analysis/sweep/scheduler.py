"""Running a sweep's plan: one process per run, resumable, at most one run per device at a time.

Each run is its own process, ``python -m rlcd.cli sweep-worker --config out/configs/<run>.json``
(train with the full recipe, then evaluate), its output in ``out/logs/<run>.log``. With
``devices`` (e.g. ``["0", "1"]``) up to one run per device goes at a time with
``CUDA_VISIBLE_DEVICES`` set to it (so the worker's ``auto`` device is that GPU); without, runs go
one after another. ``in_process=True`` calls the same `run_one` in this process (tests).

Resuming is re-running: a run whose ``eval/evaluation.json`` exists is skipped; a run directory
holding a different run (model, data, dtype, model seed or any recipe field) is refused; a run
interrupted after its first checkpoint continues from ``checkpoints/last``; one that died before
it is started again. A failed run is recorded (``failed``, with the tail of its log) and the sweep
goes on.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from rlcd.analysis.sweep.grid import RunSpec, SweepError
from rlcd.progress import echo
from rlcd.recipe import Recipe
from rlcd.run import Run

Event = Callable[[str, RunSpec, "RunResult | None"], None]  # ("start" | "end", spec, result at "end")


@dataclass
class RunResult:
    name: str
    status: str          # "done" | "skipped" | "failed"
    seconds: float
    error: str | None = None
    log: str | None = None


def config_differences(existing: Mapping[str, Any], config: Mapping[str, Any]) -> list[str]:
    """Why the run config `existing` (a run's config.json) is not the sweep run `config` (empty: same run)."""
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
    if existing.get("dtype", "auto") != config.get("dtype", "auto"):
        diffs.append(f"dtype {existing.get('dtype', 'auto')!r} != {config.get('dtype', 'auto')!r}")
    return diffs


def read_run_config(path: Path) -> dict[str, Any]:
    """A worker config written by `write_run_config`, or a one-line SweepError."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SweepError(f"{path}: no such sweep run config (written by `rlcd sweep` under OUT/configs/)") from None
    except json.JSONDecodeError as e:
        raise SweepError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None


def run_one(config: Mapping[str, Any], *, progress: bool = False) -> dict[str, Any]:
    """Train (or resume) and evaluate one sweep run; returns its evaluation dict.

    ``config``: ``{"run_dir", "data_dir", "model", "model_seed", "dtype", "export", "recipe": full Recipe
    dict}``; ``export`` false (also when absent) writes no export/ -- 529 MB for SmolLM2-135M (float32
    merged + export/hf) that a sweep never reads -- and `rlcd export RUN` writes it for the arm you keep.
    ``progress``: the run's own training and scoring progress (a worker writes it to its log; in
    process the sweep's per-run lines are enough).
    Training and evaluation run on the ``auto`` device (the GPU ``CUDA_VISIBLE_DEVICES`` leaves
    visible, else the CPU) with the config's backbone dtype.
    """
    from rlcd import checkpoint as ckpt
    from rlcd.device import resolve_placement
    from rlcd.evaluate import evaluate_run
    from rlcd.train import train

    run = Run(config["run_dir"])
    recipe = Recipe.from_dict(dict(config["recipe"]))
    dtype = str(config.get("dtype", "auto"))
    if run.evaluation_path.is_file():
        return json.loads(run.evaluation_path.read_text())
    if run.exists():
        diffs = config_differences(run.config(), config)
        if diffs:
            raise SweepError(f"{run.root} holds a different run ({'; '.join(diffs)}); remove it or use another --out")
        last = ckpt.resolve(run.checkpoint("last"))
        if last is None:
            # started (config written) but died before its first checkpoint: nothing to keep
            shutil.rmtree(run.root)
        else:
            step = json.loads((last / ckpt.STATE).read_text()).get("step", 0)
            if step < recipe.steps:
                train(run.root, resume=True, progress=progress, dtype=dtype)
    if not run.exists():
        train(run.root, data_dir=Path(config["data_dir"]), model=config["model"], recipe=recipe, progress=progress,
              model_seed=int(config.get("model_seed", 0)), dtype=dtype)
    say = echo if progress else None
    return evaluate_run(run.root, placement=resolve_placement("auto", dtype), progress=progress, print_fn=say,
                        export=bool(config.get("export", False)), command="sweep")


def worker_command(config_path: Path) -> list[str]:
    """The process that runs one spec: the hidden `rlcd sweep-worker` command."""
    return [sys.executable, "-m", "rlcd.cli", "sweep-worker", "--config", str(config_path)]


def write_run_config(out: Path, spec: RunSpec) -> Path:
    path = Path(out) / "configs" / f"{spec.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec.config, indent=2, sort_keys=True) + "\n")
    return path


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _finished(spec: RunSpec) -> RunResult | None:
    """`skipped` for a finished run of this spec, `failed` for a finished different run, None to run it."""
    if not spec.evaluation_path.is_file():
        return None
    if spec.run.exists():
        diffs = config_differences(spec.run.config(), spec.config)
        if diffs:
            return RunResult(spec.name, "failed", 0.0, f"{spec.run_dir} holds a different run: {'; '.join(diffs)}")
    return RunResult(spec.name, "skipped", 0.0)


def _run_in_process(spec: RunSpec) -> RunResult:
    t0 = time.perf_counter()
    try:
        run_one(spec.config)
        return RunResult(spec.name, "done", time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - one failed run must not end the sweep
        return RunResult(spec.name, "failed", time.perf_counter() - t0, f"{type(e).__name__}: {e}")


def execute(specs: Sequence[RunSpec], out: Path, *, in_process: bool = False, devices: Sequence[str] | None = None,
            on_event: Event | None = None) -> list[RunResult]:
    """Run every spec whose evaluation.json is missing; returns one RunResult per spec (plan order)."""
    out = Path(out)
    emit: Event = on_event or (lambda kind, spec, res: None)
    results: dict[str, RunResult] = {}
    todo = []
    for spec in specs:
        done = _finished(spec)
        if done is None:
            todo.append(spec)
        else:
            results[spec.name] = done
            emit("end", spec, done)
    if in_process:
        for spec in todo:
            emit("start", spec, None)
            results[spec.name] = _run_in_process(spec)
            emit("end", spec, results[spec.name])
        return [results[s.name] for s in specs]

    slots: list[str | None] = list(devices) if devices else [None]
    running: dict[str | None, tuple[RunSpec, subprocess.Popen, float, Path, Any]] = {}
    queue = list(todo)
    while queue or running:
        for slot in slots:
            if slot in running or not queue:
                continue
            spec = queue.pop(0)
            cfg = write_run_config(out, spec)
            log = out / "logs" / f"{spec.name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            env = dict(os.environ)
            if slot is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(slot)
            fh = open(log, "w")
            emit("start", spec, None)
            proc = subprocess.Popen(worker_command(cfg), stdout=fh, stderr=subprocess.STDOUT, env=env)
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
            emit("end", spec, res)
    return [results[s.name] for s in specs]
