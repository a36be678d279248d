"""`rlcd calibrate`, `rlcd evaluate`, `rlcd report`: the steps after training."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

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


OutOpt = Annotated[Optional[str], typer.Option(
    "--out", metavar="NAME", help="with --data: write RUN/eval-NAME/ (default: the data directory's name)")]


def evaluate(run: RunArg = None, device: DeviceOpt = "auto", dtype: DTypeOpt = DType.auto,
             checkpoint: CheckpointOpt = Which.best,
             data: Annotated[Optional[Path], typer.Option(
                 "--data", metavar="OTHER", help="score the run's model on another processed data directory "
                                                 "(zero-shot / cross-data); writes RUN/eval-NAME/ only")] = None,
             out: OutOpt = None,
             recalibrate: Annotated[bool, typer.Option(
                 "--recalibrate", help="with --data: fit the temperatures on OTHER's calibration split instead of "
                                       "using the run's own")] = False,
             allow_data_change: AllowDataChangeOpt = False, no_cache: NoCacheOpt = False) -> None:
    """Score dev/calibration/test with the merged best (or last) checkpoint, calibrate, write eval/ and export/.

    With --data OTHER: score OTHER's splits with the same model (the run's temperatures unless
    --recalibrate; majority baseline from OTHER's train split) into RUN/eval-NAME/, leaving eval/ and
    export/ as they are. Progress (rows done / total per split, rows/s, time left) and model loading go to
    stderr, the summary to stdout.
    """
    from rlcd.cli._common import run_path
    from rlcd.errors import OptionError
    from rlcd.evaluate import evaluate_on_data, evaluate_run, print_summary
    from rlcd.progress import echo
    from rlcd.run import Run

    if data is None and (out is not None or recalibrate):
        raise OptionError(f"{'--out' if out is not None else '--recalibrate'} goes with --data OTHER (evaluation on "
                          "another data set)")
    r = Run.open(run_path(run, None))
    if data is not None:
        print_summary(evaluate_on_data(r, data, name=out, recalibrate=recalibrate, placement=placement(device, dtype),
                                       print_fn=echo, which=checkpoint.value))
        return
    print_summary(evaluate_run(r, placement=placement(device, dtype), print_fn=echo, which=checkpoint.value,
                               allow_data_change=allow_data_change, feature_cache=not no_cache))


def report(run: RunArg = None, out: Annotated[Optional[str], typer.Option(
        "--out", metavar="NAME", help="regenerate RUN/eval-NAME/ (written by `rlcd evaluate RUN --data OTHER`)")] = None
           ) -> None:
    """Regenerate eval/report.md, eval/report.html and eval/plots from the prediction files alone (no model)."""
    from rlcd.cli._common import run_path
    from rlcd.report import write_report
    from rlcd.run import Run

    path = run_path(run, None)
    md = write_report(Run(path).on_data(out) if out is not None else path)
    typer.echo(str(md))
    typer.echo(str(md.with_suffix(".html")))


class Format(str, Enum):
    hf = "hf"
    onnx = "onnx"


class Quantize(str, Enum):
    int8 = "int8"
    int8_dynamic = "int8-dynamic"


def export(run: RunArg = None,
           format: Annotated[Format, typer.Option(
               "--format", help="hf: export/ and export/hf/ (torch, transformers); onnx: the portable export into --out "
                                "(onnxruntime + tokenizers + numpy; text decoders only), behind the parity gate")] = Format.hf,
           out: Annotated[Optional[Path], typer.Option(
               "--out", metavar="DIR", help="with --format onnx: the directory to write (new or empty)")] = None,
           quantize: Annotated[Optional[Quantize], typer.Option(
               "--quantize", help="with --format onnx: int8 = weight-only blockwise int8 (Q8_0-like); int8-dynamic = "
                                  "onnxruntime's dynamic quantization; shipped only if it passes the gate")] = None,
           max_flips: Annotated[Optional[float], typer.Option(
               "--max-flips", metavar="FRACTION", help="with --format onnx: the most test decisions the export may flip "
                                                       "against torch (default 0.005 = 0.5%); above it nothing is "
                                                       "exported and the command exits 1", show_default=False)] = None,
           ) -> None:
    """Write export/ (rlcd's predictor) and export/hf/ (transformers: pipeline("decision", trust_remote_code=True)),
    or with --format onnx the portable export into --out.

    Uses the best checkpoint and the temperatures `rlcd calibrate` / `rlcd evaluate` stored; runs on the CPU
    in float32 (what `rlcd predict` serves). --format onnx starts from export/ (run `rlcd export RUN` first), scores
    the run's test split with torch and with onnxruntime, and writes DIR only when the decisions agree (manifest.json
    records the parity; `rlcd serve --export DIR` serves it without torch).
    """
    from rlcd.cli._common import run_path

    path = run_path(run, None)
    if format is Format.onnx:
        if out is None:
            raise typer.BadParameter("--format onnx needs --out DIR (the directory to write)", param_hint="--out")
        from rlcd.portable.exporter import MAX_FLIPS, export_onnx
        from rlcd.progress import echo

        export_onnx(path, out, quantize=quantize.value if quantize is not None else None,
                    max_flips=MAX_FLIPS if max_flips is None else max_flips, say=echo)
        typer.echo(str(out))
        return
    for name, value in (("--out", out), ("--quantize", quantize), ("--max-flips", max_flips)):
        if value is not None:
            raise typer.BadParameter(f"{name} goes with --format onnx", param_hint=name)
    from rlcd.evaluate import export_run
    from rlcd.run import Run

    from rlcd.export import read_export_meta
    from rlcd.report.notes import result_notes

    r = Run.open(path)
    out_dir = export_run(r)
    meta = {**read_export_meta(r.export_dir), "run": str(r.root), "training_progress": r.training_progress()}
    for note in result_notes(meta):
        typer.echo(f"note: {note}", err=True)
    typer.echo(str(out_dir))
