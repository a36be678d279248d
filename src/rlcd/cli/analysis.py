"""`rlcd analyze toy-bias`, `rlcd compare`, `rlcd sweep` (+ its hidden `sweep-worker`), `rlcd probe order|coherence|noise`.

Heavy imports (torch, matplotlib) happen inside the commands so importing this module stays cheap.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional, Union

import typer

from rlcd.cli._common import DeviceOpt, DType, DTypeOpt, VoteCombine, VoteCombineOpt, placement

analyze_app = typer.Typer(help="Model-free analyses (toy bias of the smoothed score).", no_args_is_help=True)
probe_app = typer.Typer(help="Probes of a trained run: candidate order, coherence of derived forms, noise over-sharpening.", no_args_is_help=True)


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
def toy_bias(
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
    from rich.table import Table

    from rlcd.analysis.toy_bias import plot_toy_bias, run_toy_bias
    from rlcd.consoles import result_console

    sigma_list = _floats(sigmas, "--sigmas")
    reward_list = [r.strip() for r in rewards.split(",") if r.strip()]
    try:
        result = run_toy_bias(sigmas=sigma_list, rewards=reward_list, samples=samples, seed=seed)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    cells: dict[tuple[str, str], dict[float, dict[str, Any]]] = {}
    for row in result["rows"]:
        cells.setdefault((row["name"], row["reward"]), {})[row["sigma"]] = row
    console = result_console()
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


def compare(
    run_a: Annotated[str, typer.Argument(help="run dir of side A (several: comma-separated, pooled per row)")],
    run_b: Annotated[str, typer.Argument(help="run dir of side B (several: comma-separated, pooled per row)")],
    metric: Annotated[str, typer.Option(help="nll | brier | accuracy")] = "nll",
    split: Annotated[str, typer.Option(help="prediction split: dev | calibration | test")] = "test",
    resamples: Annotated[int, typer.Option(help="bootstrap resamples")] = 5000,
    seed: Annotated[int, typer.Option(help="bootstrap seed")] = 0,
    rows: Annotated[bool, typer.Option("--rows", help="resample single rows instead of whole source cases "
                                                      "(case_id / id prefix before ':', the default)")] = False,
    json_out: Annotated[Optional[Path], typer.Option(help="also write the JSON result to this file")] = None,
    raw: Annotated[bool, typer.Option(help="compare raw logits (ignore the fitted temperatures)")] = False,
    qtype: Annotated[Optional[str], typer.Option("--type", help="only the rows of one question type: "
                                                                "choice | noul | score")] = None,
    eval_name: Annotated[Optional[str], typer.Option("--eval", metavar="NAME", help="read each run's eval-NAME/ "
                                                     "(`rlcd evaluate RUN --data D --out NAME`, e.g. a sealed test "
                                                     "set) instead of eval/")] = None,
) -> None:
    """Paired bootstrap of a per-row metric between runs A and B: difference B - A, 95% CI, p-value.

    RUN_A / RUN_B may list several runs, comma-separated (pooled per row). The bootstrap resamples
    whole source cases (case_id) unless --rows is given; the output says which. Prints a short human
    summary on stderr and the JSON result on stdout.
    """
    from rich.console import Console

    from rlcd.analysis.compare import compare_runs, summary_lines

    err = Console(stderr=True)
    try:
        result = compare_runs(_run_dirs(run_a), _run_dirs(run_b), metric=metric, split=split,
                              resamples=resamples, seed=seed, grouped=not rows, raw=raw, qtype=qtype,
                              eval_name=eval_name)
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    for line in summary_lines(result):
        err.print(line, highlight=False, markup=False, soft_wrap=True)
    text = json.dumps(result, indent=2)
    sys.stdout.write(text + "\n")
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(text + "\n")


# ----------------------------------------------------------------------------------------------
# sweep and probes (registered by rlcd.cli as `rlcd sweep`, `rlcd sweep-worker`, `rlcd probe order|noise`)


def _fail(e: Exception) -> None:
    """A mistake found by the library (a ValueError or a missing file): the CLI's one error style, `rlcd: error: ...`
    on one line and exit 2 (`rlcd.cli.RlcdGroup`)."""
    from rlcd.errors import UserError

    if isinstance(e, UserError):
        raise e
    raise UserError(str(e)) from None


def _write_json(path: Optional[Path], obj: Any) -> None:
    if path is None:
        return
    from rlcd.metrics import dumps

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(obj), encoding="utf-8")
    typer.echo(f"wrote {path}", err=True)


def _num(v: Any, digits: int = 3) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def sweep(
    data: Annotated[Path, typer.Option(help="processed data dir (rlcd data prepare)")],
    out: Annotated[Path, typer.Option(help="sweep directory: runs/, configs/, logs/, summary.json/.md, plots")],
    model: Annotated[str, typer.Option(help="preset (qwen3.5-0.8b, qwen3.5-2b, tiny, tiny-toy, smollm2-135m, gemma3-270m, tiny-llama), local dir, .gguf file or hub id")] = "qwen3.5-0.8b",
    grid: Annotated[Optional[list[str]], typer.Option(help="KEY=V1,V2,... over recipe fields; repeat for more keys "
                                                           "(e.g. --grid sigma=0.25,1,4 --grid objective=rlcd,ce)")] = None,
    seeds: Annotated[str, typer.Option(help="N (seeds 0..N-1) or a comma-separated list of seeds")] = "3",
    steps: Annotated[int, typer.Option(help="optimizer updates per run")] = 3600,
    recipe: Annotated[Optional[list[str]], typer.Option(help="KEY=VALUE recipe override for every run (repeatable)")] = None,
    scale_cadence: Annotated[bool, typer.Option(help="scale eval/checkpoint/log/diagnostics cadence to a budget "
                                                     "below 3,600 updates")] = True,
    in_process: Annotated[bool, typer.Option(help="run every arm in this process instead of one process per run")] = False,
    devices: Annotated[Optional[str], typer.Option(help="comma-separated CUDA devices: one run per device at a time "
                                                        "(each run's --device auto is its GPU)")] = None,
    dtype: DTypeOpt = DType.auto,
    dry_run: Annotated[bool, typer.Option(help="write the run configs and print the worker commands; train nothing")] = False,
    choose_on: Annotated[str, typer.Option(help="split the summary ranks the arms on: dev (the default; test is "
                                                "shown beside it, not for choosing) or test (noted, with how often "
                                                "DATA's test split was scored before: DATA/test-looks.jsonl)")] = "dev",
    rank_by: Annotated[str, typer.Option(help="metric the arms are ranked by (raw|calibrated.<block>.<metric>)")]
    = "calibrated.overall.nll",
    export: Annotated[bool, typer.Option(help="also write every run's export/ (merged model + export/hf); off: "
                                              "`rlcd export RUN` writes it for the arm you keep")] = False,
) -> None:
    """Run a grid of recipe arms x seeds (one run dir and process each), evaluate each, and summarise.

    Finished runs (eval/evaluation.json present) are skipped, so re-running resumes a sweep. The ce
    objective ignores the RLCD fields (sigma, sigma_end, ce_weight, G, reward weights, advantage_norm):
    its arm runs once per seed and is summarised once. Every run trains and evaluates on
    the auto device (its GPU with --devices) in --dtype, recorded in its config. Writes summary.json,
    summary.md, fitted_T_vs_sigma.png and nll_vs_sigma.png under --out; exits 1 if a run failed. The
    summary is on dev and ranks the arms there (--choose-on, --rank-by); test sits beside, not for choosing.
    """
    from rlcd.analysis.sweep import parse_grid, run_sweep
    from rlcd.recipe import parse_overrides

    dev = [d.strip() for d in devices.split(",") if d.strip()] if devices else None
    summary = run_sweep(data, model, parse_grid(grid or []), seeds, steps, out, parse_overrides(recipe or []),
                        scale_cadence=scale_cadence, in_process=in_process, devices=dev, dtype=dtype.value,
                        dry_run=dry_run, choose_on=choose_on, rank_by=rank_by, export=export)
    if dry_run:
        for cmd in summary["commands"]:
            typer.echo(cmd)
        return
    from rich import box
    from rich.table import Table

    from rlcd.consoles import result_console

    rk = summary["ranking"]
    beside = f"{rk['beside']} (not for choosing)" if rk["beside"] == "test" else rk["beside"]
    table = Table(title=f"sweep summary on {rk['split']} ({out / 'summary.md'})", box=box.SIMPLE, padding=(0, 1))
    for col in ("arm", "ok", "accuracy", "NLL", "Brier", "ECE-t", "sharp gap", "T choice", "T noul", "T score",
                "Bayes gap", f"{rk['beside']} {rk['metric'].split('.')[-1]}"):
        table.add_column(col, justify="left" if col == "arm" else "right", no_wrap=True)

    def cell(arm, key, digits=3, source="metrics"):
        st = arm[source].get(key)
        if not st or st.get("mean") is None:
            return "–"
        return f"{st['mean']:.{digits}f}" + (f"±{st['std']:.{digits}f}" if st.get("std") is not None else "")

    for a in summary["arms"]:
        table.add_row(a["name"], f"{a['n_ok']}/{len(a['seeds'])}", cell(a, "raw.overall.accuracy"),
                      cell(a, "raw.overall.nll"), cell(a, "raw.overall.brier"), cell(a, "raw.overall.ece_target"),
                      cell(a, "raw.overall.sharpness_gap"), cell(a, "temperature.choice", 2),
                      cell(a, "temperature.noul", 2), cell(a, "temperature.score", 2),
                      cell(a, "raw.overall.posterior.bayes_gap"), cell(a, rk["metric"], source="metrics_beside"))
    result_console().print(table)
    if rk["best"] is not None:
        typer.echo(f"best on {rk['split']} by {rk['metric']}: {rk['best']} (ranking: {', '.join(rk['order'])}); "
                   f"the last column is {beside}")
    if summary["failed"]:
        typer.echo(f"{len(summary['failed'])} run(s) failed: {', '.join(summary['failed'])} (see summary.md)", err=True)
        raise typer.Exit(code=1)


def sweep_worker(
    config: Annotated[Path, typer.Option("--config", help="a run config written by `rlcd sweep` (OUT/configs/RUN.json)")],
) -> None:
    """Train (or resume) and evaluate one sweep run from its config; `rlcd sweep` starts one per run."""
    from rlcd.analysis.sweep.scheduler import read_run_config, run_one
    from rlcd.evaluate import print_summary

    print_summary(run_one(read_run_config(config), progress=True))


def _ints(text: str, name: str) -> list[int]:
    from rlcd.errors import OptionError

    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise OptionError(f"{name} {text}: give comma-separated whole numbers, e.g. 1,2") from None


def _flip_cell(b: dict) -> str:
    ci = b.get("flip_rate95")
    return _num(b.get("flip_rate")) + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")


@probe_app.command("order")
def probe_order(
    run: Annotated[Path, typer.Argument(help="run directory (export/ or checkpoints/best)")],
    split: Annotated[str, typer.Option(help="data split to re-score")] = "test",
    limit: Annotated[Optional[int], typer.Option(help="at most this many questions of each type (file order)")] = None,
    data: Annotated[Optional[Path], typer.Option(help="processed data dir (default: the run's)")] = None,
    max_perms: Annotated[int, typer.Option(help="choice orders per question above K = 4 (the reversal + a seeded "
                                                "sample); K <= 4 is asked in all K!-1 other orders")] = 8,
    order_votes: Annotated[str, typer.Option(help="comma-separated order-vote counts N to report for choice (1, the "
                                                  "plain answer, always)")] = "1,2",
    vote_combine: VoteCombineOpt = VoteCombine.logmean,
    resamples: Annotated[int, typer.Option(help="bootstrap resamples over cases for the 95% intervals")] = 1000,
    seed: Annotated[int, typer.Option(help="seed of the sampled orders and of the bootstrap")] = 0,
    calibrated: Annotated[bool, typer.Option(help="apply the run's temperatures (TV only; flips do not change)")]
    = False,
    batch_size: Annotated[int, typer.Option()] = 32,
    out: Annotated[Optional[Path], typer.Option("--out", "--json-out", help="also write the JSON result here")] = None,
    device: DeviceOpt = "auto",
    dtype: DTypeOpt = DType.auto,
) -> None:
    """Ask every question with its options listed differently and measure how the answer changes.

    choice: other option orders (all for K <= 4, else the reversal + a seeded sample of --max-perms), with and
    without order votes; score: levels reversed; noul: false/true descriptions swapped (the consistent answer
    is the complement). Reports the top-answer flip rate with its 95% case-bootstrap interval and the mean
    total-variation distance, per type, per K bucket and per question. The run's own test split is also
    written to RUN/eval/probe-order.json, where `rlcd report RUN` finds it."""
    from rich import box
    from rich.table import Table

    from rlcd.analysis.probes import check_probe_order_options, probe_order_run
    from rlcd.consoles import result_console

    votes = _ints(order_votes, "--order-votes")
    # every option before the placement is resolved and the model loads (probe_order_run checks the run and data)
    check_probe_order_options(limit=limit, max_perms=max_perms, votes=votes, resamples=resamples,
                              batch_size=batch_size)
    try:
        result = probe_order_run(run, split=split, limit=limit, data_dir=data, max_perms=max_perms,
                                 calibrated=calibrated, batch_size=batch_size, placement=placement(device, dtype),
                                 votes=votes, resamples=resamples, seed=seed,
                                 vote_combine=vote_combine.value)
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    table = Table(title=f"option-order probe: {run} ({split})", box=box.SIMPLE, padding=(0, 1))
    for col in ("type", "votes", "probe", "questions", "cases", "comparisons", "flip rate [95% CI]", "rows w/ flip",
                "mean TV", "top at 1st", "1/K"):
        table.add_column(col, justify="left" if col in ("type", "probe") else "right", no_wrap=True)

    def add(name: str, n: str, probe: str, b: dict) -> None:
        if not b.get("n_rows"):
            table.add_row(name, n, probe, "0", "0", "0", "–", "–", "–", "–", "–")
            return
        table.add_row(name, n, probe, str(b["n_rows"]), str(b["n_cases"]), str(b["n_comparisons"]), _flip_cell(b),
                      _num(b.get("rows_with_flip")), _num(b.get("mean_tv"), 4), _num(b.get("top_at_first")),
                      _num(b.get("top_at_first_uniform")))

    co = result["choice_orders"]
    for t, b in result["per_type"].items():
        probe = {"choice": f"orders ({co['all']} all, {co['sampled']} sampled)", "score": "levels reversed",
                 "noul": "wording swapped"}[t]
        add(t, "1", probe, b)
        for n, vb in (b["votes"].items() if isinstance(b.get("votes"), dict) else ()):
            add(t, n, "voted", vb)
    for bucket, b in result["choice_per_k_bucket"].items():
        add(f"choice K {bucket}", "1", "", b)
        for n, vb in b["votes"].items():
            add(f"choice K {bucket}", n, "voted", vb)
    console = result_console()
    console.print(table)
    console.print(f"Questions {result['requests_note']}.", highlight=False)
    console.print(f"choice orders: all K!-1 for K <= 4 ({co['all']} questions); above, the reversal + a seeded sample "
                  f"of at most {result['max_perms']} orders ({co['sampled']} questions). Intervals: percentile "
                  f"bootstrap over cases, {result['resamples']} resamples, seed {result['seed']}.", highlight=False)
    for t, c in result["counts"].items():
        for reason, n in c["reasons"].items():
            console.print(f"{t}: {n} of {c['read']} not probed: {reason}", highlight=False)
    if result.get("saved"):
        typer.echo(f"wrote {result['saved']} (`rlcd report {run}` shows it)", err=True)
    _write_json(out, result)


@probe_app.command("noise")
def probe_noise(
    run: Annotated[Path, typer.Argument(help="run directory with eval/predictions-<split>.jsonl")],
    sigma: Annotated[Optional[float], typer.Option(help="noise std (default: the run's training sigma)")] = None,
    split: Annotated[str, typer.Option(help="prediction split")] = "test",
    samples: Annotated[int, typer.Option(help="noise samples per row")] = 128,
    seed: Annotated[int, typer.Option()] = 0,
    symmetrize: Annotated[bool, typer.Option(help="reuse each draw cyclically shifted and negated (unbiased, "
                                                  "far less Monte-Carlo error)")] = True,
    out: Annotated[Optional[Path], typer.Option(help="write the JSON result here")] = None,
) -> None:
    """Noise-free softmax(z) vs noise-averaged E[softmax(z + eps)] from the raw prediction logits:
    mean max-prob of each, mean KL, argmax change rate (the over-sharpening diagnostic)."""
    from rich import box
    from rich.table import Table

    import math

    from rlcd.analysis.probes import probe_noise_run
    from rlcd.consoles import result_console
    from rlcd.errors import OptionError

    if samples < 1:
        raise OptionError(f"--samples {samples}: give the noise draws per row, 1 or more")
    if sigma is not None and not (math.isfinite(sigma) and sigma > 0):
        raise OptionError(f"--sigma {sigma:g}: give a noise scale > 0 (leave it out for the run's training sigma)")
    try:
        result = probe_noise_run(run, sigma, split=split, samples=samples, seed=seed, symmetrize=symmetrize)
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    table = Table(title=f"noise probe: {run} ({split}), sigma {result['sigma']:g}, {samples} samples",
                  box=box.SIMPLE, padding=(0, 1))
    for col in ("type", "n", "max p free", "max p avg", "sharpening", "KL(avg||free)", "argmax changed",
                "NLL free", "NLL avg", "target max"):
        table.add_column(col, justify="left" if col == "type" else "right", no_wrap=True)
    for name, b in [*result["per_type"].items(), ("all", result["overall"])]:
        table.add_row(name, str(b["n"]), _num(b["mean_max_prob_noise_free"]), _num(b["mean_max_prob_noise_averaged"]),
                      _num(b.get("sharpening")), _num(b["mean_kl_averaged_to_free"], 4), _num(b["argmax_change_rate"]),
                      _num(b["nll_noise_free"]), _num(b["nll_noise_averaged"]), _num(b["mean_target_max"]))
    console = result_console()
    console.print(table)
    if result.get("trained_sigma") is not None:
        console.print(f"run trained with objective {result.get('trained_objective')}, sigma "
                      f"{result['trained_sigma']:g}", highlight=False)
    _write_json(out, result)


@probe_app.command("coherence")
def probe_coherence(
    run: Annotated[Path, typer.Argument(help="run directory (export/ or checkpoints/best)")],
    data: Annotated[Optional[Path], typer.Option(help="processed data dir whose test split is probed (default: the "
                                                      "run's); derived rows in it are set aside and re-derived")] = None,
    forms: Annotated[Optional[str], typer.Option(
        help="comma-separated forms or families (default: every form, the order family too)")] = None,
    per_option: Annotated[int, typer.Option("--per-option", help="instances per row of a per-option form")] = 2,
    limit: Annotated[Optional[int], typer.Option(help="at most this many base questions of each type (file order; "
                                                      "the result is then not saved in the run)")] = None,
    tol: Annotated[float, typer.Option(help="a violation: the derived answer more than this far (max over "
                                            "candidates) from the one the base answer implies")] = 0.05,
    calibrated: Annotated[bool, typer.Option(help="apply the run's per-type temperatures")] = False,
    resamples: Annotated[int, typer.Option(help="bootstrap resamples over cases for the 95% intervals")] = 1000,
    seed: Annotated[int, typer.Option(help="seed of the bootstrap")] = 0,
    batch_size: Annotated[int, typer.Option()] = 32,
    out: Annotated[Optional[Path], typer.Option("--out", "--json-out", help="also write the JSON result here")] = None,
    device: DeviceOpt = "auto",
    dtype: DTypeOpt = DType.auto,
) -> None:
    """Ask the test split's questions in derived forms with exact targets and measure the probability laws.

    Per relation family (type equivalence, complement, partition and merge, marginal and tail, sub-menu, order
    and wording) and per form: the violation rate at --tol with its 95% case-bootstrap interval, the mean
    deviation from the answer the base answer implies, and the gap (TV) of the derived answer to its exact
    target. The run's own test split is written to RUN/eval/probe-coherence.json, where `rlcd report RUN`
    finds it."""
    from rich import box
    from rich.table import Table

    from rlcd.analysis.coherence import probe_coherence_run
    from rlcd.consoles import result_console
    from rlcd.data.derive import parse_forms

    try:
        chosen = parse_forms(forms, reorder=forms is None)
        if per_option < 1:
            raise ValueError(f"--per-option {per_option}: give 1 or more")
        result = probe_coherence_run(run, data_dir=data, limit=limit, forms=chosen, per_option=per_option,
                                     calibrated=calibrated, tol=tol, batch_size=batch_size,
                                     placement=placement(device, dtype), resamples=resamples, seed=seed)
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    table = Table(title=f"coherence probe: {run} (test, tol {result['tol']:g})", box=box.SIMPLE, padding=(0, 1))
    for col in ("family / form", "rows", "cases", "violation rate [95% CI]", "mean deviation", "gap to exact",
                "implied gap"):
        table.add_column(col, justify="left" if col == "family / form" else "right", no_wrap=True)

    def cell(b: dict) -> str:
        ci = b.get("violation_rate95")
        return _num(b.get("violation_rate")) + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")

    def add(name: str, b: dict) -> None:
        table.add_row(name, str(b.get("n_rows", 0)), str(b.get("n_cases", 0)), cell(b), _num(b.get("mean_deviation")),
                      _num(b.get("mean_gap")), _num(b.get("mean_gap_implied")))

    for fam, b in result["per_family"].items():
        add(result["families"][fam], b)
        for form, fb in result["per_form"].items():
            if fb["family"] == fam and fb.get("n_rows"):
                add(f"  {form}", fb)
    add("all forms", result["overall"])
    console = result_console()
    console.print(table)
    console.print(f"Questions {result['requests_note']}.", highlight=False)
    console.print(f"{result['n_base']} base questions, {result['n_derived']} derived ({result['n_excluded']} not "
                  f"derivable: {result['exclusions'] or 'none'}); base answers' mean gap to exact "
                  f"{_num(result['base_mean_gap'])}. Intervals: percentile bootstrap over cases, {result['resamples']} "
                  f"resamples, seed {result['seed']}.", highlight=False)
    if result.get("saved"):
        typer.echo(f"wrote {result['saved']} (`rlcd report {run}` shows it)", err=True)
    _write_json(out, result)
