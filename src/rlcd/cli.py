"""`rlcd` command line: each command is a thin call into one stage.

Heavy imports (torch, transformers) happen inside the commands so `rlcd --help` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(help="Train, calibrate, evaluate, analyse and serve calibrated typed-decision models.",
                  no_args_is_help=True, pretty_exceptions_show_locals=False)
bench_app = typer.Typer(help="Benchmarks that print ratios measured in one run.", no_args_is_help=True)
probe_app = typer.Typer(help="Probes of a trained run: candidate order, noise over-sharpening.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")
app.add_typer(probe_app, name="probe")


def _mount_subapps() -> None:
    from rlcd.analysis.cli import analyze_app, compare_command, probe_noise_command, probe_order_command, sweep_command
    from rlcd.data.cli import app as data_app

    app.add_typer(data_app, name="data", help="Import, generate, validate and split typed-decision records.")
    app.add_typer(analyze_app, name="analyze", help="Model-free analyses (toy bias of the smoothed score).")
    app.command("compare", help="Paired bootstrap of two runs (or comma-separated run lists) on one metric.")(
        compare_command)
    app.command("sweep", help="Run a recipe grid x seeds (one process per run), evaluate, summarise.")(sweep_command)
    probe_app.command("order", help="Top-label flip rate / TV under candidate reversal and cyclic shifts.")(
        probe_order_command)
    probe_app.command("noise", help="Noise-free vs noise-averaged predictions (over-sharpening diagnostic).")(
        probe_noise_command)
    from rlcd.bench.report import bench_prefix_command, bench_report_command
    from rlcd.bench.train import bench_train_command

    bench_app.command("prefix", help="Shared prefix vs row-by-row forwards: max |diff|, speedup, token bound.")(
        bench_prefix_command)
    bench_app.command("train", help="Training-loop throughput and per-part share of an update; sampler rows/s.")(
        bench_train_command)
    bench_app.command("report", help="Regenerate benchmarks/BENCHMARKS.md from benchmarks/results/*.json.")(
        bench_report_command)
    # these three import torch; registered here so their options come from one signature
    from rlcd.bench.serve import bench_serve_command
    from rlcd.predict import predict_command
    from rlcd.server import serve_command

    app.command("predict", help="Answer one /v1/systemone request with a trained run.")(predict_command)
    app.command("serve", help="Serve POST /v1/systemone, GET /healthz, GET /v1/models (FastAPI).")(serve_command)
    bench_app.command("serve", help="Bounded loopback load on `rlcd serve`: latency, decisions/s, 4xx/5xx.")(
        bench_serve_command)


_mount_subapps()


@app.command()
def train(
    data: Annotated[Optional[Path], typer.Option(help="processed data dir (rlcd data prepare)")] = None,
    model: Annotated[str, typer.Option(help="preset (qwen3.5-0.8b, qwen3.5-2b, tiny, tiny-toy) or local dir")] = "qwen3.5-0.8b",
    run: Annotated[Optional[Path], typer.Option(help="run directory to create")] = None,
    resume: Annotated[Optional[Path], typer.Option(help="resume this run directory")] = None,
    steps: Annotated[Optional[int], typer.Option(help="optimizer updates (default 3600)")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    objective: Annotated[str, typer.Option(help="rlcd | ce")] = "rlcd",
    sigma: Annotated[float, typer.Option()] = 0.3,
    ce_weight: Annotated[float, typer.Option()] = 1.0,
) -> None:
    """Train a run with the fixed recipe (or resume one; a larger --steps extends it)."""
    from rlcd.recipe import Recipe
    from rlcd.train import train as run_train

    if resume is not None:
        out = run_train(resume, resume=True, steps=steps)
    else:
        if data is None or run is None:
            raise typer.BadParameter("a new run needs --data and --run (or use --resume RUN)")
        recipe = Recipe(seed=seed, objective=objective, sigma=sigma, ce_weight=ce_weight)
        out = run_train(run, data_dir=data, model=model, recipe=recipe, steps=steps)
    typer.echo(json.dumps({k: out[k] for k in ("step", "best_step", "best_score")}))


@app.command()
def calibrate(run: Path) -> None:
    """Fit one temperature per decision type on the calibration partition (merged best model)."""
    from rlcd.evaluate import calibrate_run

    typer.echo(json.dumps(calibrate_run(run), indent=2))


@app.command()
def evaluate(run: Path) -> None:
    """Calibrate, score dev/calibration/test, write eval/ (predictions, evaluation.json, plots, report) and export/."""
    from rlcd.evaluate import evaluate_run, print_summary

    print_summary(evaluate_run(run))


@app.command()
def report(run: Path) -> None:
    """Regenerate eval/plots and eval/report.md from the prediction files alone."""
    from rlcd.report import write_report

    typer.echo(str(write_report(run)))


@app.command()
def demo(out: Annotated[Path, typer.Option(help="demo output directory")] = Path("runs/demo"),
         steps: Annotated[Optional[int], typer.Option(help="override the demo's training budget")] = None) -> None:
    """The whole chain offline on the embedded default: data, splits, train tiny, calibrate, evaluate, report."""
    from rlcd.demo import run_demo

    run_demo(out, steps=steps)


if __name__ == "__main__":  # `python -m rlcd.cli ...` and `torchrun -m rlcd.cli train ...`
    app()
