"""`rlcd calibrate`, `rlcd evaluate`, `rlcd report`: the steps after training."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from rlcd.cli._common import DeviceOpt, DType, DTypeOpt, RunArg, echo_json, placement


class Which(str, Enum):
    best = "best"
    last = "last"


NoCacheOpt = Annotated[bool, typer.Option("--no-cache", help="run the backbone even when the data directory's "
                                           "feature cache matches the model (a head-only run reads it by default)")]
AllowDataChangeOpt = Annotated[bool, typer.Option("--allow-data-change", help="score even though the run's data "
                                                   "files changed since it started (recorded in the outputs)")]
CheckpointOpt = Annotated[Which, typer.Option("--checkpoint", help="best: the dev-selected checkpoint (the "
                                              "recipe); last: the one the final update left")]


def calibrate(run: RunArg = None, device: DeviceOpt = "auto", dtype: DTypeOpt = DType.auto,
              checkpoint: CheckpointOpt = Which.best, allow_data_change: AllowDataChangeOpt = False,
              no_cache: NoCacheOpt = False) -> None:
    """Fit one temperature per decision type on the calibration split (merged best or last checkpoint).

    Writes eval/temperatures.json; `rlcd evaluate` and the export use these temperatures when they
    were fitted on the same checkpoint, calibration data and placement (else evaluate fits them).
    """
    from rlcd.cli._common import run_path
    from rlcd.evaluate import calibrate_run
    from rlcd.run import Run

    r = Run.open(run_path(run, None))
    echo_json(calibrate_run(r, placement=placement(device, dtype), which=checkpoint.value,
                            allow_data_change=allow_data_change, feature_cache=not no_cache))


def evaluate(run: RunArg = None, device: DeviceOpt = "auto", dtype: DTypeOpt = DType.auto,
             checkpoint: CheckpointOpt = Which.best, allow_data_change: AllowDataChangeOpt = False,
             no_cache: NoCacheOpt = False) -> None:
    """Score dev/calibration/test with the merged best (or last) checkpoint, calibrate, write eval/ and export/.

    Progress (rows done / total per split, rows/s, time left) and model loading go to stderr, the
    summary to stdout.
    """
    from rlcd.cli._common import run_path
    from rlcd.evaluate import evaluate_run, print_summary
    from rlcd.progress import echo
    from rlcd.run import Run

    r = Run.open(run_path(run, None))
    print_summary(evaluate_run(r, placement=placement(device, dtype), print_fn=echo, which=checkpoint.value,
                               allow_data_change=allow_data_change, feature_cache=not no_cache))


def report(run: RunArg = None) -> None:
    """Regenerate eval/report.md, eval/report.html and eval/plots from the prediction files alone (no model)."""
    from rlcd.cli._common import run_path
    from rlcd.report import write_report

    md = write_report(run_path(run, None))
    typer.echo(str(md))
    typer.echo(str(md.with_suffix(".html")))


def export(run: RunArg = None) -> None:
    """Write export/ (rlcd's predictor) and export/hf/ (transformers: pipeline("decision", trust_remote_code=True)).

    Uses the best checkpoint and the temperatures `rlcd calibrate` / `rlcd evaluate` stored; runs on the CPU
    in float32 (what `rlcd predict` serves).
    """
    from rlcd.cli._common import run_path
    from rlcd.evaluate import export_run
    from rlcd.run import Run

    from rlcd.export import read_export_meta
    from rlcd.report.notes import result_notes

    r = Run.open(run_path(run, None))
    out = export_run(r)
    meta = {**read_export_meta(r.export_dir), "run": str(r.root), "training_progress": r.training_progress()}
    for note in result_notes(meta):
        typer.echo(f"note: {note}", err=True)
    typer.echo(str(out))
