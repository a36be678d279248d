"""`rlcd gate`: the cut-points to gate a run's answers on, as jev-eval's thresholds.json (`rlcd.gate`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from rlcd.cli._common import RunAlias, RunArg, run_path


def _targets(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: expected precisions in (0, 1], e.g. 0.9,0.7") from None
    if not values or not all(0 < v <= 1 for v in values):
        raise typer.BadParameter(f"{text!r}: expected precisions in (0, 1], e.g. 0.9,0.7")
    return values


def gate(
    run: RunArg = None,
    run_alias: RunAlias = None,
    target_accuracy: Annotated[Optional[float], typer.Option(
        help="the gate of most coverage whose selective accuracy reaches this (e.g. 0.95)", show_default=False)] = None,
    max_escalation: Annotated[Optional[float], typer.Option(
        help="the strictest gate that escalates at most this share of answers (e.g. 0.3)", show_default=False)] = None,
    yes_precision: Annotated[str, typer.Option(
        help="noul: the lowest P(true) whose 'yes' is right this often, per target (yesAt)")] = "0.9,0.7",
    bootstrap: Annotated[int, typer.Option(min=1, help="resamples of the out-of-bag guard (cases drawn)")] = 1000,
    seed: Annotated[int, typer.Option(help="seed of the resampling")] = 0,
    tolerance: Annotated[int, typer.Option(min=0, help="score: count within-N levels of gold as correct")] = 0,
    min_rows: Annotated[int, typer.Option(min=1, help="fewer calibration rows than this: no gate (jev-eval: 50)")] = 50,
    out: Annotated[Optional[Path], typer.Option(help="where to write (default: RUN/eval/thresholds.json)",
                                                show_default=False)] = None,
) -> None:
    """Choose confidence gates on the calibration split and verify them on test: writes eval/thresholds.json.

    jev-eval's thresholds.json (contract version 1; jev-sort, Leash and jev-guard load it), picked under the
    bootstrap out-of-bag guard over calibration cases, each gate's held-out test accuracy and coverage with 95%
    intervals beside it. `rlcd serve` gates answers with it when a request says "x_gate": true; `rlcd report RUN`
    shows it in the report.
    """
    from rlcd.errors import UserError
    from rlcd.gate import Goal, gate_run, summary_lines
    from rlcd.run import Run

    goal = Goal(target_accuracy=target_accuracy, max_escalation=max_escalation)  # a one-line error if not exactly one
    targets = _targets(yes_precision)
    r = Run.open(run_path(run, run_alias))
    if out is not None and out.is_dir():
        raise UserError(f"--out {out} is a directory; name the file to write (e.g. {out / 'thresholds.json'})")
    path, doc = gate_run(r, goal, yes_targets=targets, resamples=bootstrap, seed=seed, tolerance=tolerance,
                         min_rows=min_rows, out=out)
    for line in summary_lines(doc):
        typer.echo(line)
    typer.echo(f"wrote {path} ({len(doc['questions'])} questions, {len(doc['x_rlcd']['types'])} types)", err=True)
