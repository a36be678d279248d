"""`rlcd calibrate`, `rlcd evaluate`, `rlcd report`: the steps after training."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from rlcd.cli._common import DeviceOpt, DType, DTypeOpt, RunArg, VoteCombine, VoteCombineOpt, echo_json, placement


class Which(str, Enum):
    best = "best"
    last = "last"


NoCacheOpt = Annotated[bool, typer.Option("--no-cache", help="run the backbone even when the data directory's "
                                           "feature cache matches the model (a head-only run reads it by default)")]
AllowDataChangeOpt = Annotated[bool, typer.Option("--allow-data-change", help="score even though the run's data "
                                                   "files changed since it started (recorded in the outputs)")]
EvalAsAskedOpt = Annotated[bool, typer.Option(
    "--as-asked", help="score every row as the data writes it; by default each row is asked in the canonical form "
                       "`rlcd serve` asks it (options sorted, duplicates once, a yes/no choice or score as a noul; "
                       "docs/SERVING.md), so the evaluation is that of what the server answers")]
CheckpointOpt = Annotated[Which, typer.Option("--checkpoint", help="best: the dev-selected checkpoint (the "
                                              "recipe); last: the one the final update left")]


def calibrate(run: RunArg = None, device: DeviceOpt = "auto", dtype: DTypeOpt = DType.auto,
              checkpoint: CheckpointOpt = Which.best, allow_data_change: AllowDataChangeOpt = False,
              no_cache: NoCacheOpt = False, as_asked: EvalAsAskedOpt = False) -> None:
    """Fit one temperature per decision type on the calibration split (merged best or last checkpoint).

    Writes eval/temperatures.json; `rlcd evaluate` and the export use these temperatures when they
    were fitted on the same checkpoint, calibration data and placement (else evaluate fits them).
    """
    from rlcd.cli._common import run_path
    from rlcd.evaluate import calibrate_run
    from rlcd.run import Run

    r = Run.open(run_path(run, None))
    echo_json(calibrate_run(r, placement=placement(device, dtype), which=checkpoint.value,
                            allow_data_change=allow_data_change, feature_cache=not no_cache, canonical=not as_asked))


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
             allow_data_change: AllowDataChangeOpt = False, no_cache: NoCacheOpt = False,
             order_votes: Annotated[int, typer.Option(
                 "--order-votes", metavar="N", help="evaluate the answers voted over N option orders of each choice "
                                                    "question (1..8; 1 = off): scored live, no export/ written "
                                                    "(docs/SERVING.md); with --remote the orders go out as extra "
                                                    "questions of each request and are combined here")] = 1,
             vote_combine: VoteCombineOpt = VoteCombine.logmean,
             remote: Annotated[Optional[str], typer.Option(
                 "--remote", metavar="URL", help="score any System One server instead of a run (no RUN): with --data D "
                                                 "and --out DIR; see `rlcd.remote`")] = None,
             split: Annotated[str, typer.Option(
                 "--split", help="with --remote: the split of D to evaluate (its calibration split, when there, fits "
                                 "the temperatures)")] = "test",
             api_key_env: Annotated[Optional[str], typer.Option(
                 "--api-key-env", metavar="VAR", help="with --remote: the environment variable holding the server's "
                                                      "API key (sent as Authorization: Bearer)")] = None,
             remote_model: Annotated[Optional[str], typer.Option(
                 "--remote-model", metavar="NAME", help="with --remote: the model name to ask for (default: the first "
                                                        "one /v1/models lists)")] = None,
             concurrency: Annotated[int, typer.Option(
                 "--concurrency", min=1, max=64, help="with --remote: requests in flight at once")] = 4,
             max_lost: Annotated[float, typer.Option(
                 "--max-lost", metavar="SHARE", min=0.0, max=1.0,
                 help="with --remote: the share of rows read that may go unanswered; above it DIR is still written and "
                      "the command exits 3 (1 accepts any loss)")] = 0.05,
             as_asked: EvalAsAskedOpt = False,
             force: Annotated[bool, typer.Option(
                 "--force", help="with --remote: replace an earlier remote evaluation in --out DIR (its files are "
                                 "removed first)")] = False,
             ) -> None:
    """Score dev/calibration/test with the merged best (or last) checkpoint, calibrate, write eval/ and export/.

    With --data OTHER: score OTHER's splits with the same model (the run's temperatures unless
    --recalibrate; majority baseline from OTHER's train split) into RUN/eval-NAME/, leaving eval/ and
    export/ as they are. Progress (rows done / total per split, rows/s, time left) and model loading go to
    stderr, the summary to stdout.

    With --remote URL --data D --out DIR (no RUN): score any System One server on D's test split (or --split),
    one request per state; temperatures fitted on its answers to D's calibration split; DIR/eval/ holds what a
    run's eval/ holds (predictions, evaluation.json, report, thresholds.json) plus unanswered.jsonl, and
    DIR/remote.json says what was asked of whom. `rlcd compare RUN DIR` pairs it with any run by case. More than
    --max-lost (5%) of the rows unanswered, or a server that stops answering mid-run: sending stops, DIR is
    written and the command exits 3. A non-empty DIR is refused; --force replaces an earlier remote evaluation.
    """
    from rlcd.cli._common import check_order_votes, run_path
    from rlcd.errors import OptionError
    from rlcd.evaluate import evaluate_on_data, evaluate_run, print_summary
    from rlcd.progress import echo
    from rlcd.run import Run

    check_order_votes(order_votes)
    if remote is not None:  # votes: each choice question sent in N orders within its request, averaged here
        _evaluate_remote(run, remote, data=data, out=out, split=split, api_key_env=api_key_env, model=remote_model,
                         concurrency=concurrency, recalibrate=recalibrate, order_votes=order_votes, max_lost=max_lost,
                         vote_combine=vote_combine.value, as_asked=as_asked, force=force)
        return
    for name, value, default in (("--split", split, "test"), ("--api-key-env", api_key_env, None), ("--force", force, False),
                                 ("--remote-model", remote_model, None), ("--concurrency", concurrency, 4),
                                 ("--max-lost", max_lost, 0.05)):
        if value != default:
            raise OptionError(f"{name} goes with --remote URL (evaluation of a System One server)")
    if data is None and (out is not None or recalibrate):
        raise OptionError(f"{'--out' if out is not None else '--recalibrate'} goes with --data OTHER (evaluation on "
                          "another data set)")
    r = Run.open(run_path(run, None))
    if data is not None:
        print_summary(evaluate_on_data(r, data, name=out, recalibrate=recalibrate, placement=placement(device, dtype),
                                       print_fn=echo, which=checkpoint.value, order_votes=order_votes,
                                       vote_combine=vote_combine.value, canonical=not as_asked))
        return
    print_summary(evaluate_run(r, placement=placement(device, dtype), print_fn=echo, which=checkpoint.value,
                               allow_data_change=allow_data_change, feature_cache=not no_cache,
                               order_votes=order_votes, vote_combine=vote_combine.value, canonical=not as_asked))


def _evaluate_remote(run, url: str, *, data, out, split: str, api_key_env, model, concurrency: int,
                     recalibrate: bool, order_votes: int, max_lost: float = 0.05, vote_combine: str = "logmean",
                     as_asked: bool = False, force: bool = False) -> None:
    """`rlcd evaluate --remote URL --data D --out DIR`: checks the options, then `rlcd.remote.evaluate_remote`."""
    import os

    from rlcd.errors import OptionError
    from rlcd.evaluate import print_summary
    from rlcd.progress import echo
    from rlcd.remote.client import base_url
    from rlcd.remote.evaluate import RowsLost, evaluate_remote

    if run is not None:
        raise OptionError(f"--remote scores a server, not a run: drop RUN ({run}) or drop --remote")
    if data is None or out is None:
        raise OptionError("--remote URL needs --data D (a processed data directory) and --out DIR (where the "
                          "evaluation goes)")
    if recalibrate:
        raise OptionError("--recalibrate goes with RUN --data OTHER; --remote always fits its temperatures on D's "
                          "calibration split")
    key = None
    if api_key_env is not None:
        key = os.environ.get(api_key_env)
        if not key:
            raise OptionError(f"--api-key-env {api_key_env}: that environment variable is not set")
    try:
        base_url(url)
    except ValueError as e:
        raise OptionError(str(e)) from None
    try:
        ev = evaluate_remote(url, data, Path(out), split=split, api_key=key, model=model, concurrency=concurrency,
                             votes=order_votes, vote_combine=vote_combine, print_fn=echo, max_lost=max_lost,
                             canonical=not as_asked, force=force)
    except RowsLost as e:  # DIR is written (when any row was answered): its summary first, then one line, exit 3
        if e.evaluation is not None:
            print_summary(e.evaluation)
        raise
    print_summary(ev)


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


class Precision(str, Enum):
    bfloat16 = "bfloat16"


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
               "--max-flips", metavar="FRACTION", help="with --format onnx or --precision: the most test decisions the "
                                                       "export may flip against torch float32 (default 0.005 = 0.5%; "
                                                       "--precision counts only flips beyond its noise floor); "
                                                       "above it the command exits 1", show_default=False)] = None,
           max_dp: Annotated[Optional[float], typer.Option(
               "--max-dp", metavar="P", help="with --precision: the largest |dp| (probability moved on one test row) "
                                             "the precision may show (default 0.02); above it the command exits 1",
               show_default=False)] = None,
           precision: Annotated[Optional[Precision], typer.Option(
               "--precision", help="also score the test split on the CPU with the backbone in float32 and in this "
                                   "precision and record the parity in export/precision-bfloat16.json; `--dtype auto` "
                                   "serves bf16 on a CPU with bf16 units only once this gate passed",
               show_default=False)] = None,
           ) -> None:
    """Write export/ (rlcd's predictor) and export/hf/ (transformers: pipeline("decision", trust_remote_code=True)),
    or with --format onnx the portable export into --out.

    Uses the best checkpoint and the temperatures `rlcd calibrate` / `rlcd evaluate` stored; runs on the CPU
    in float32 (what `rlcd predict` serves). --format onnx starts from export/ (run `rlcd export RUN` first), scores
    the run's test split with torch and with onnxruntime, and writes DIR only when the decisions agree (manifest.json
    records the parity; `rlcd serve --export DIR` serves it without torch). --precision bfloat16 then scores the
    test split on the CPU with the backbone in float32 and in bfloat16 and records flips, max |dp| and the NLL delta
    in export/precision-bfloat16.json (exit 1 above --max-flips counting only the flips whose float32 margin exceeds
    bf16's measured noise, above --max-dp, or with the NLL delta measurably positive); `--dtype auto` serves bf16
    only after it passed.
    """
    from rlcd.cli._common import run_path

    path = run_path(run, None)
    if format is Format.onnx and precision is not None:
        raise typer.BadParameter("--precision goes with the torch export (--format hf), not --format onnx",
                                 param_hint="--precision")
    if max_dp is not None and precision is None:
        raise typer.BadParameter("--max-dp goes with --precision", param_hint="--max-dp")
    if format is Format.onnx:
        if out is None:
            raise typer.BadParameter("--format onnx needs --out DIR (the directory to write)", param_hint="--out")
        from rlcd.portable.exporter import MAX_FLIPS, export_onnx
        from rlcd.progress import echo

        export_onnx(path, out, quantize=quantize.value if quantize is not None else None,
                    max_flips=MAX_FLIPS if max_flips is None else max_flips, say=echo)
        typer.echo(str(out))
        return
    for name, value in (("--out", out), ("--quantize", quantize),
                        ("--max-flips", max_flips if precision is None else None)):
        if value is not None:
            raise typer.BadParameter(f"{name} goes with --format onnx" + (" or --precision" if name == "--max-flips"
                                                                          else ""), param_hint=name)
    if max_flips is not None and not 0.0 <= max_flips <= 1.0:
        raise typer.BadParameter(f"{max_flips}: a fraction of the test rows in [0, 1] (0.005 = 0.5%)",
                                 param_hint="--max-flips")
    if max_dp is not None and not 0.0 <= max_dp <= 1.0:
        raise typer.BadParameter(f"{max_dp}: a probability difference in [0, 1] (0.02 = two points)",
                                 param_hint="--max-dp")
    from rlcd.evaluate import export_run
    from rlcd.run import Run

    from rlcd.export import read_export_meta
    from rlcd.report.notes import result_notes

    r = Run.open(path)
    if precision is not None:  # the gate's test rows, before anything is written
        from rlcd.portable.exporter import test_records

        test_records(r)
    out_dir = export_run(r)
    meta = {**read_export_meta(r.export_dir), "run": str(r.root), "training_progress": r.training_progress()}
    for note in result_notes(meta):
        typer.echo(f"note: {note}", err=True)
    if precision is not None:
        from rlcd.precision import check_precision
        from rlcd.progress import echo

        with r.lock("export --precision"):
            check_precision(r, precision.value, max_flips=max_flips, max_dp=max_dp, say=echo)
    typer.echo(str(out_dir))


def ship(run: Annotated[Path, typer.Argument(help="an evaluated run whose sealed test set was scored "
                                                    "(`rlcd evaluate RUN --data SEALED --out sealed`)")],
         out: Annotated[Path, typer.Option("--out", metavar="DIR", help="the directory to write, e.g. models/NAME "
                                                                        "(new or empty; --force replaces it)")],
         sealed: Annotated[str, typer.Option(metavar="NAME", help="the eval-NAME/ directory holding the sealed "
                                                                  "set's scoring")] = "sealed",
         name: Annotated[Optional[str], typer.Option(help="the model's name in its card (default: DIR's name)")] = None,
         about: Annotated[str, typer.Option(help="a paragraph for the card's top")] = "",
         force: Annotated[bool, typer.Option("--force", help="replace a non-empty DIR")] = False) -> None:
    """Write a run's trainable part (LoRA, scorer head, temperatures: the export, a few MB), its config, its
    evaluations and a model card with the sealed test set's numbers into DIR; `rlcd serve DIR` and `rlcd predict
    DIR` load it when the backbone's package is installed."""
    from rlcd.ship import ship as ship_run

    done = ship_run(run, out, sealed=sealed, name=name, about=about, force=force)
    typer.echo(f"shipped {run} -> {done} ({sum(f.stat().st_size for f in done.iterdir()) / 1e6:.1f} MB)")
