"""`rlcd calibrate`, `rlcd evaluate`, `rlcd report`: the steps after training."""

from __future__ import annotations

import typer

from rlcd.cli._common import DeviceOpt, DType, DTypeOpt, RunArg, echo_json, placement


def calibrate(run: RunArg = None, device: DeviceOpt = "auto", dtype: DTypeOpt = DType.auto) -> None:
    """Fit one temperature per decision type on the calibration split (merged best checkpoint).

    Writes eval/temperatures.json; `rlcd evaluate` and the export use these temperatures when they
    were fitted on the same checkpoint, calibration data and placement (else evaluate fits them).
    """
    from rlcd.cli._common import run_path
    from rlcd.evaluate import calibrate_run
    from rlcd.run import Run

    r = Run.open(run_path(run, None))
    echo_json(calibrate_run(r, placement=placement(device, dtype)))


def evaluate(run: RunArg = None, device: DeviceOpt = "auto", dtype: DTypeOpt = DType.auto) -> None:
    """Score dev/calibration/test with the merged best checkpoint, calibrate, write eval/ and export/."""
    from rlcd.cli._common import run_path
    from rlcd.evaluate import evaluate_run, print_summary
    from rlcd.run import Run

    r = Run.open(run_path(run, None))
    print_summary(evaluate_run(r, placement=placement(device, dtype), print_fn=typer.echo))


def report(run: RunArg = None) -> None:
    """Regenerate eval/report.md, eval/report.html and eval/plots from the prediction files alone (no model)."""
    from rlcd.cli._common import run_path
    from rlcd.report import write_report

    md = write_report(run_path(run, None))
    typer.echo(str(md))
    typer.echo(str(md.with_suffix(".html")))
