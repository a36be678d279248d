"""Recipe sweeps: a grid of arms x seeds, one run directory (and one process) per run, one summary.

``run_sweep(data, model, grid, seeds, steps, out)`` composes three modules, one job each:

- `grid`: ``--grid KEY=V1,V2`` -> arms (the ``ce`` arm deduplicated) -> one `RunSpec` per
  arm x seed with its full resolved recipe (cadence scaled to short budgets);
- `scheduler`: runs the specs, one process per run (``rlcd sweep-worker``), one run per device
  at a time, skipping finished runs, so re-running a sweep resumes it;
- `aggregate`: each arm's metrics over its seeds (mean, sample std), on dev (the split to choose
  on; test beside it, not for choosing), the arms ranked on dev -> ``summary.json``,
  ``summary.md``, ``fitted_T_vs_sigma.png`` and ``nll_vs_sigma.png``.

Layout of ``out``: ``runs/<arm>-s<seed>/`` (run directories), ``configs/<run>.json`` (worker
configs), ``logs/<run>.log``, and the summary files.
"""

from __future__ import annotations

import contextlib
import shlex
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from rlcd.analysis.sweep.aggregate import (CHOOSE_ON, FORMAT, RANK_BY, check_rank_by, mean_std, metric_values,
                                           rank_arms, summarize_runs, write_summary)
from rlcd.analysis.sweep.grid import (Arm, RunSpec, SweepError, expand_grid, parse_grid, parse_seeds, plan_runs,
                                      scaled_cadence)
from rlcd.analysis.sweep.scheduler import Event, RunResult, execute, run_one, worker_command, write_run_config
from rlcd.recipe import coerce_value

__all__ = ["Arm", "RunResult", "RunSpec", "SweepError", "execute", "expand_grid", "mean_std", "metric_values",
           "parse_grid", "parse_seeds", "plan_runs", "rank_arms", "run_one", "run_sweep", "scaled_cadence",
           "summarize_runs", "write_summary"]


@contextlib.contextmanager
def _progress(console: Any, total: int, bar: bool) -> Iterator[Event]:
    """An `execute` event handler: a rich progress bar (terminal) or one line per start, one per end."""
    progress = task = None
    if bar:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("[bold]sweep[/]"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.description}"), TimeElapsedColumn(), console=console)
        progress.start()
        task = progress.add_task("", total=total)

    def on_event(kind: str, spec: RunSpec, res: RunResult | None) -> None:
        if kind == "start":
            if progress is not None:
                progress.update(task, description=spec.name)
            else:
                console.print(f"  start {spec.name}", highlight=False)
            return
        assert res is not None
        msg = f"  {res.status:7s} {spec.name}" + (f" ({res.seconds:.1f} s)" if res.seconds else "")
        if res.status == "failed":
            msg += f": {(res.error or '').splitlines()[0] if res.error else ''}"
        console.print(msg, highlight=False, markup=False)
        if progress is not None:
            progress.advance(task)

    try:
        yield on_event
    finally:
        if progress is not None:
            progress.stop()


def test_choice_note(data: Path, out: Path) -> str:
    """What ranking arms on the test split spends: its earlier looks (`rlcd.data.looks`; this sweep's own runs
    left out, so a resumed sweep says the same), and that every run of the sweep is one more."""
    from rlcd.data.looks import Looks, looks_note, previous_looks

    before = previous_looks(data, exclude_runs_under=out)
    said = looks_note(Looks(data.resolve(), before=before).meta(), tense="has")
    return ("--choose-on test ranks the arms on the test split: " + (said or f"{data.resolve()}'s test split was "
            "not scored before this sweep; choosing on it spends it (its numbers become optimistic): choose on dev, "
            "keep test for the end") + "; each run of this sweep scores it once more")


def run_sweep(data: Path, model: str, grid: Mapping[str, Sequence[Any]], seeds: int | str | Sequence[int],
              steps: int, out: Path, recipe_overrides: Mapping[str, Any] | None = None, *,
              scale_cadence: bool = True, in_process: bool = False, devices: Sequence[str] | None = None,
              dtype: str = "auto", dry_run: bool = False, progress: bool | None = None,
              model_seed: int = 0, choose_on: str = CHOOSE_ON, rank_by: str = RANK_BY,
              export: bool = False) -> dict[str, Any]:
    """Plan, run (skipping finished runs), summarise; writes summary.json/.md and plots under ``out``.

    ``dtype`` (auto | float32 | bfloat16) is the backbone dtype of every run, recorded in its
    config; each run uses the ``auto`` device (with ``devices``, the GPU it was given). With
    ``dry_run`` nothing is trained: the run configs are written under ``out/configs`` and the
    returned summary lists the worker command of every run (``commands``) for an external scheduler.
    ``choose_on`` (dev, the default, or test) is the split the summary ranks the arms on, by ``rank_by``.
    ``export``: also write each run's export/ (off by default: the summary reads eval/ only).
    """
    from rich.console import Console

    out = Path(out)
    data = Path(data)
    if not (data / "train.jsonl").is_file():
        raise SweepError(f"{data} is not a processed data dir (no train.jsonl); run `rlcd data prepare` first")
    if choose_on not in ("dev", "test"):
        raise SweepError(f"--choose-on {choose_on!r}: expected dev (the default) or test")
    try:
        check_rank_by(rank_by)
    except ValueError as e:
        raise SweepError(f"--rank-by: {e}") from None
    overrides = {k: coerce_value(k, v) for k, v in (recipe_overrides or {}).items()}
    seed_list = parse_seeds(seeds)
    arms, notes = expand_grid(grid, overrides)
    if choose_on == "test":
        notes.append(test_choice_note(data, out))
    specs = plan_runs(data, model, arms, seed_list, steps, out, recipe_overrides=overrides,
                      scale_cadence=scale_cadence, model_seed=model_seed, dtype=dtype, export=export)
    cadence = scaled_cadence(steps) if scale_cadence else {}
    cadence = {k: v for k, v in cadence.items() if k not in overrides}
    config = {"data": str(data.resolve()), "model": model, "grid": {k: list(v) for k, v in grid.items()},
              "seeds": seed_list, "steps": int(steps), "recipe_overrides": overrides, "cadence": cadence,
              "dtype": dtype, "mode": "in-process" if in_process else "subprocess",
              "devices": list(devices) if devices else None, "choose_on": choose_on, "rank_by": rank_by,
              "export": bool(export)}
    console = Console(stderr=True)
    console.print(f"sweep: {len(arms)} arms x {len(seed_list)} seeds = {len(specs)} runs -> {out}", highlight=False)
    for n in notes:
        console.print(f"  note: {n}", highlight=False)
    out.mkdir(parents=True, exist_ok=True)
    if dry_run:
        commands = [shlex.join(worker_command(write_run_config(out, s))) for s in specs]
        return {"format": FORMAT, "config": config, "notes": notes, "commands": commands,
                "arms": [{"name": a.name, "params": a.params, "grid_points": a.merged} for a in arms]}

    with _progress(console, len(specs), console.is_terminal if progress is None else progress) as on_event:
        results = execute(specs, out, in_process=in_process, devices=devices, on_event=on_event)
    summary = summarize_runs(arms, specs, results=results, notes=notes, config=config, choose_on=choose_on,
                             rank_by=rank_by)
    paths = write_summary(out, summary)
    console.print(f"wrote {paths['json']}, {paths['md']}, {paths['fitted_T'].name}, {paths['nll'].name}",
                  highlight=False)
    return summary
