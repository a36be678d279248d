"""CLI of the analysis suite: ``rlcd analyze toy-bias`` and the ``rlcd compare`` command function.

Heavy imports (torch, matplotlib) happen inside the commands so importing this module stays cheap.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional, Union

import typer

analyze_app = typer.Typer(help="Model-free analyses (toy bias of the smoothed score).", no_args_is_help=True)


@analyze_app.callback()
def _analyze() -> None:
    """Model-free analyses (toy bias of the smoothed score)."""
    # A callback keeps `analyze` a command group even while it has a single command.


def _floats(text: str, name: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{name} must be comma-separated numbers, got {text!r}") from None


@analyze_app.command("toy-bias")
def toy_bias_command(
    out: Annotated[Optional[Path], typer.Option(help="write toy_bias.json and toy_bias.png here")] = None,
    sigmas: Annotated[str, typer.Option(help="comma-separated noise scales")] = "0,0.25,0.5,1,2,4",
    rewards: Annotated[str, typer.Option(help="comma-separated: log, full")] = "log,full",
    samples: Annotated[int, typer.Option(help="noise samples (fixed scrambled Sobol set per K)")] = 4096,
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Maximise E_eps[reward(softmax(z + eps))] over logits z for reference targets; no model.

    Reports the noise-free max probability of softmax(z*) and KL(t || softmax(z*)) per sigma.
    """
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from rlcd.analysis.toy_bias import plot_toy_bias, run_toy_bias

    sigma_list = _floats(sigmas, "--sigmas")
    reward_list = [r.strip() for r in rewards.split(",") if r.strip()]
    try:
        result = run_toy_bias(sigmas=sigma_list, rewards=reward_list, samples=samples, seed=seed)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    cells: dict[tuple[str, str], dict[float, dict[str, Any]]] = {}
    for row in result["rows"]:
        cells.setdefault((row["name"], row["reward"]), {})[row["sigma"]] = row
    console = Console()
    for field, title, fmt in (
        ("max_prob", "noise-free max probability of softmax(z*)", lambda v: f"{v:.3f}"),
        ("kl", "KL(t || softmax(z*)) [nats]", lambda v: "0" if v < 1e-12 else f"{v:.1e}"),
    ):
        table = Table(title=title, box=box.SIMPLE, padding=(0, 1), collapse_padding=True)
        table.add_column("target", no_wrap=True)
        table.add_column("reward", no_wrap=True)
        for s in sigma_list:
            table.add_column(f"σ={s:g}", justify="right", no_wrap=True, min_width=7)
        for (name, kind), by_sigma in cells.items():
            table.add_row(name, kind, *(fmt(by_sigma[s][field]) for s in sigma_list))
        console.print(table)
    console.print(f"{samples} noise samples per K (scrambled Sobol, seed {seed}); "
                  f"{result['config']['seconds']:.1f} s", highlight=False)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "toy_bias.json").write_text(json.dumps(result, indent=2) + "\n")
        plot_toy_bias(result, out / "toy_bias.png")
        typer.echo(f"wrote {out / 'toy_bias.json'} and {out / 'toy_bias.png'}")


def _run_dirs(value: Union[str, Path, list, tuple]) -> list[Path]:
    """Run directories from a comma-separated string, a path, or a list of either."""
    items = value if isinstance(value, (list, tuple)) else [value]
    out: list[Path] = []
    for item in items:
        out.extend(Path(p.strip()) for p in str(item).split(",") if p.strip())
    return out


def compare_command(
    run_a: Annotated[str, typer.Argument(help="run dir of side A (several: comma-separated, pooled per row)")],
    run_b: Annotated[str, typer.Argument(help="run dir of side B (several: comma-separated, pooled per row)")],
    metric: Annotated[str, typer.Option(help="nll | brier | accuracy")] = "nll",
    split: Annotated[str, typer.Option(help="prediction split: dev | calibration | test")] = "test",
    resamples: Annotated[int, typer.Option(help="bootstrap resamples")] = 5000,
    seed: Annotated[int, typer.Option(help="bootstrap seed")] = 0,
    grouped: Annotated[bool, typer.Option(help="resample whole isolation groups (case_id / id prefix before ':')")] = False,
    json_out: Annotated[Optional[Path], typer.Option(help="also write the JSON result to this file")] = None,
    raw: Annotated[bool, typer.Option(help="compare raw logits (ignore the fitted temperatures)")] = False,
) -> dict[str, Any]:
    """Paired bootstrap of a per-row metric between runs A and B: difference B - A, 95% CI, p-value.

    ``run_a`` / ``run_b`` may be a comma-separated string (CLI) or a list of paths (Python). Prints a
    short human summary on stderr and the JSON result on stdout; returns the result.
    """
    from rich.console import Console

    from rlcd.analysis.compare import compare_runs, summary_lines

    err = Console(stderr=True)
    try:
        result = compare_runs(_run_dirs(run_a), _run_dirs(run_b), metric=metric, split=split,
                              resamples=resamples, seed=seed, grouped=grouped, raw=raw)
    except (ValueError, FileNotFoundError) as e:
        err.print(f"rlcd compare: {e}", style="red", highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(code=2) from None
    for line in summary_lines(result):
        err.print(line, highlight=False, markup=False, soft_wrap=True)
    text = json.dumps(result, indent=2)
    sys.stdout.write(text + "\n")
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(text + "\n")
    return result
