"""`rlcd bench data|prefix|pipeline|train|features|cut|serve|onnx|votes|batch|report`: ratios measured in one run, saved as
result JSON."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Optional

import typer

from rlcd.cli._common import DeviceOpt, DType, DTypeOpt, RunAlias, RunArg, placement, run_path

app = typer.Typer(help="Benchmarks that print ratios measured in one run.", no_args_is_help=True)
RESULTS = Path("benchmarks/results")


def _save(kind: str, json_out: Optional[Path], result: dict, *flags: tuple, command: Optional[str] = None,
          positional: tuple = ()) -> None:
    """Write `result` as bench result `kind` (when --json was given) with the command that reproduces it:
    `rlcd bench COMMAND [POSITIONAL] --flag value ...` for every (flag, value, default) whose value is set and
    differs from its default (default None: always written when set), then `--json PATH`."""
    if json_out is None:
        return
    from rlcd.bench.report import invocation, save_result

    args = ["rlcd", "bench", command or kind, *map(str, positional)]
    for flag, value, default in flags:
        if value is not None and value != default:
            args += [flag, str(getattr(value, "value", value))]
    save_result(kind, invocation(shlex.join([*args, "--json", str(json_out)])), result, path=json_out)


def _threads(threads: Optional[int]) -> None:
    if threads:
        import torch

        torch.set_num_threads(int(threads))


@app.command("prefix")
def prefix(
    model: Annotated[str, typer.Option(help="backbone preset (tiny, tiny-llama, smollm2-135m, ...) or local dir")] = "tiny",
    questions: Annotated[int, typer.Option(min=1, help="questions in the request")] = 32,
    state_tokens: Annotated[int, typer.Option(min=1, help="approximate state length in tokens")] = 512,
    repeats: Annotated[int, typer.Option(min=1, help="timed repeats (median)")] = 5,
    seed: Annotated[int, typer.Option()] = 0,
    threads: Annotated[Optional[int], typer.Option(help="torch threads (default: torch's)")] = None,
    json_out: Annotated[Path, typer.Option("--json", help="result JSON (bench format)")] = RESULTS / "prefix.json",
    device: DeviceOpt = "auto",
    dtype: DTypeOpt = DType.auto,
) -> None:
    """Shared prefix vs row-by-row forwards: max |diff|, speedup, token bound."""
    from rlcd.bench.prefix import run_prefix_bench
    from rlcd.model.backbone import check_backbone_spec

    check_backbone_spec(model)
    pl = placement(device, dtype)
    _threads(threads)
    res = run_prefix_bench(model=model, questions=questions, state_tokens=state_tokens, repeats=repeats, seed=seed,
                           placement=pl)
    _save("prefix", json_out, res, ("--model", model, None), ("--dtype", dtype, DType.auto),
          ("--device", device, "auto"), ("--questions", questions, 32), ("--state-tokens", state_tokens, 512),
          ("--repeats", repeats, 5), ("--seed", seed, 0), ("--threads", threads, None))


@app.command("pipeline")
def pipeline_cmd(
    model: Annotated[str, typer.Option(help="backbone preset (tiny, tiny-llama, smollm2-135m, ...) or local dir")] = "tiny",
    sizes: Annotated[str, typer.Option(help="questions per request, comma-separated")] = "1,5,50",
    repeats: Annotated[int, typer.Option(min=1, help="timed repeats per size (median)")] = 5,
    state_tokens: Annotated[int, typer.Option(min=1, help="approximate state length in tokens")] = 150,
    eval_cases: Annotated[int, typer.Option(min=1, help="six-question synth cases of the evaluation section")] = 20,
    seed: Annotated[int, typer.Option()] = 0,
    threads: Annotated[Optional[int], typer.Option(help="torch threads (default: torch's)")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write the result JSON (bench format) here")] = None,
    device: DeviceOpt = "auto",
    dtype: DTypeOpt = DType.auto,
) -> None:
    """rlcd's Predictor vs transformers' pipeline("decision") on one export (p50, ratio, max |dp|); evaluation
    rows/s through shared prefixes vs full rows."""
    from rlcd.bench.pipeline import run_pipeline_bench
    from rlcd.model.backbone import check_backbone_spec

    check_backbone_spec(model)
    try:
        size_t = tuple(int(x) for x in sizes.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter("--sizes is comma-separated integers, e.g. 1,5,50", param_hint="--sizes") from None
    if not size_t or min(size_t) < 1:
        raise typer.BadParameter("--sizes needs at least one size, each >= 1", param_hint="--sizes")
    pl = placement(device, dtype)
    _threads(threads)
    res = run_pipeline_bench(model=model, sizes=size_t, repeats=repeats, state_tokens=state_tokens,
                             eval_cases=eval_cases, seed=seed, placement=pl)
    _save("pipeline", json_out, res, ("--model", model, None), ("--sizes", sizes, None), ("--repeats", repeats, None),
          ("--state-tokens", state_tokens, 150), ("--eval-cases", eval_cases, None), ("--seed", seed, 0),
          ("--threads", threads, None), ("--device", device, "auto"), ("--dtype", dtype, DType.auto))


@app.command("train")
def train(
    model: Annotated[str, typer.Option(help="backbone preset (tiny, tiny-toy, tiny-llama, ...) or local dir")] = "tiny",
    updates: Annotated[int, typer.Option(min=1, help="measured optimizer updates")] = 20,
    warmup: Annotated[int, typer.Option(min=0, help="warm-up updates run first and excluded")] = 2,
    seed: Annotated[int, typer.Option()] = 0,
    data: Annotated[Optional[Path], typer.Option(help="processed data dir (default: generated synth data)")] = None,
    sampler_calls: Annotated[int, typer.Option(min=1, help="microbatch calls of the sampler benchmark")] = 20_000,
    threads: Annotated[Optional[int], typer.Option(help="torch threads (default: torch's)")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write the result JSON (bench format) here")] = None,
    device: DeviceOpt = "auto",
    dtype: DTypeOpt = DType.auto,
    case_vs_row: Annotated[Optional[str], typer.Option(
        "--case-vs-row", help="instead: training examples/s with batch_by case vs row for these comma-separated "
                              "models (e.g. tiny,smollm2-135m) on generated six-question synth cases")] = None,
    cases: Annotated[int, typer.Option(min=1, help="synth cases generated for --case-vs-row")] = 80,
    eval_cases: Annotated[int, typer.Option(
        min=0, help="--case-vs-row: then evaluation rows/s, shared prefixes vs full rows, on N synth cases "
                    "(0: skip)")] = 10,
    rounds: Annotated[int, typer.Option(
        min=1, help="alternating row/case rounds of --updates each (--case-vs-row)")] = 2,
    state_tokens: Annotated[Optional[int], typer.Option(
        min=1, help="--case-vs-row: each case's state becomes ~N tokens of ticket text (default: synth's own)",
    )] = None,
) -> None:
    """Training-loop throughput and per-part share of an update; sampler rows/s (or --case-vs-row: training
    examples/s with batch_by case vs row, then evaluation rows/s shared vs full rows, per model)."""
    from rlcd.bench.train import run_case_vs_row, run_train_bench
    from rlcd.model.backbone import check_backbone_spec

    if case_vs_row is not None:
        models = tuple(m.strip() for m in case_vs_row.split(",") if m.strip())
        if not models:
            raise typer.BadParameter("name at least one model", param_hint="--case-vs-row")
        for m in models:
            check_backbone_spec(m)
        res = run_case_vs_row(models, updates=updates, warmup=warmup, rounds=rounds, cases=cases, seed=seed,
                              state_tokens=state_tokens, threads=threads, eval_cases=eval_cases,
                              placement=placement(device, dtype))
        _save("train-case", json_out, res, ("--case-vs-row", case_vs_row, None), ("--updates", updates, None),
              ("--warmup", warmup, None), ("--rounds", rounds, None), ("--cases", cases, None),
              ("--eval-cases", eval_cases, None), ("--state-tokens", state_tokens, None), ("--seed", seed, 0),
              ("--threads", threads, None), ("--device", device, "auto"), ("--dtype", dtype, DType.auto),
              command="train")
        return
    check_backbone_spec(model)
    if data is not None and not (data / "train.jsonl").is_file():
        raise typer.BadParameter(f"{data}: not a processed data directory (no train.jsonl)", param_hint="--data")
    res = run_train_bench(model=model, updates=updates, seed=seed, data_dir=data, warmup=warmup,
                          sampler_calls=sampler_calls, threads=threads, placement=placement(device, dtype))
    _save("train", json_out, res, ("--model", model, None), ("--updates", updates, None), ("--warmup", warmup, 2),
          ("--seed", seed, 0), ("--data", data, None), ("--sampler-calls", sampler_calls, 20_000),
          ("--threads", threads, None), ("--device", device, "auto"), ("--dtype", dtype, DType.auto))


@app.command("features")
def features(
    model: Annotated[str, typer.Option(help="backbone preset (tiny, tiny-llama, smollm2-135m, ...) or local dir")] = "tiny",
    cases: Annotated[int, typer.Option(min=2, help="generated synth cases (six questions each)")] = 24,
    head_updates: Annotated[int, typer.Option(min=1, help="measured head-only updates on the cache")] = 200,
    lora_updates: Annotated[int, typer.Option(min=1, help="measured LoRA updates on the live backbone")] = 3,
    threads: Annotated[Optional[int], typer.Option(help="torch threads (default: torch's)")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write the result JSON (bench format) here")] = None,
    device: DeviceOpt = "cpu",
    dtype: DTypeOpt = DType.auto,
) -> None:
    """Feature extraction with vs without prefix sharing; head-only updates on the cache vs LoRA updates live."""
    from rlcd.bench.features import run_features_bench
    from rlcd.model.backbone import check_backbone_spec
    from rlcd.progress import echo

    check_backbone_spec(model)
    _threads(threads)
    res = run_features_bench(model, cases=cases, head_updates=head_updates, lora_updates=lora_updates,
                             placement=placement(device, dtype), threads=threads, say=echo)
    _save("features", json_out, res, ("--model", model, None), ("--cases", cases, None),
          ("--head-updates", head_updates, 200), ("--lora-updates", lora_updates, 3), ("--threads", threads, None),
          ("--device", device, "cpu"), ("--dtype", dtype, DType.auto))


@app.command("cut")
def cut(
    model: Annotated[str, typer.Option(help="backbone preset (smollm2-135m, tiny-llama, tiny, ...) or local dir")] = "smollm2-135m",
    ks: Annotated[str, typer.Option(help="top-layer counts K, comma-separated")] = "1,2,4,8",
    cases: Annotated[int, typer.Option(min=2, help="generated synth cases (six questions each)")] = 8,
    updates: Annotated[int, typer.Option(min=1, help="measured updates per K and batch_by")] = 2,
    all_updates: Annotated[int, typer.Option(min=1, help="measured updates with LoRA on every layer")] = 1,
    batch_size: Annotated[int, typer.Option(min=1, help="rows per micro-batch")] = 8,
    grad_accum: Annotated[int, typer.Option(min=1, help="micro-batches per update")] = 1,
    threads: Annotated[Optional[int], typer.Option(help="torch threads (default: torch's)")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write the result JSON (bench format) here")] = None,
    device: DeviceOpt = "cpu",
    dtype: Annotated[str, typer.Option(
        "--dtype", metavar="auto|float32|bfloat16[,...]",
        help="backbone dtype (LoRA, scorer and optimizer state stay float32); a comma-separated list "
             "(float32,bfloat16) runs the whole bench once per dtype, in turn, and adds the updates/s ratios")] = "auto",
) -> None:
    """Top-K-layer LoRA on the cut-state cache vs LoRA on every layer: updates/s (rows and cases), cut extraction
    tokens/s, cache size, bfloat16 vs float32 storage error."""
    from rlcd.bench.cut import run_cut_bench
    from rlcd.model.backbone import check_backbone_spec
    from rlcd.progress import echo

    check_backbone_spec(model)
    try:
        k_t = tuple(int(x) for x in ks.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter("--ks is comma-separated integers, e.g. 1,2,4,8", param_hint="--ks") from None
    if not k_t or min(k_t) < 1:
        raise typer.BadParameter("--ks needs at least one K, each >= 1", param_hint="--ks")
    where = {}
    for d in [x.strip() for x in dtype.split(",") if x.strip()] or ["auto"]:
        p = placement(device, d)
        if p.dtype in where:
            raise typer.BadParameter(f"{dtype}: {p.dtype} given twice", param_hint="--dtype")
        where[p.dtype] = p
    _threads(threads)
    runs = {d: run_cut_bench(model, ks=k_t, cases=cases, updates=updates, all_updates=all_updates,
                             batch_size=batch_size, grad_accum=grad_accum, placement=p, threads=threads, say=echo)
            for d, p in where.items()}
    res = next(iter(runs.values())) if len(runs) == 1 else cut_by_dtype(runs)
    if len(runs) > 1:
        for d, sp in res["speedup"].items():
            echo(f"cut: {d} updates/s over {res['dtypes'][0]}'s: " + ", ".join(f"{k} {v:.2f}x" for k, v in sp.items()))
    _save("cut", json_out, res, ("--model", model, None), ("--ks", ks, "1,2,4,8"), ("--cases", cases, 8),
          ("--updates", updates, 2), ("--all-updates", all_updates, 1), ("--batch-size", batch_size, 8),
          ("--grad-accum", grad_accum, 1), ("--threads", threads, None), ("--device", device, "cpu"),
          ("--dtype", dtype, "auto"))


def cut_by_dtype(runs: dict) -> dict:
    """`rlcd bench cut --dtype a,b`: each dtype's result, and per update kind the updates/s of each later dtype over
    the first's (the runs are sequential, not interleaved: the machine's load drifts between them)."""
    labels = list(runs)
    first = runs[labels[0]]

    def rates(r: dict) -> dict:
        out = {f"all_layers.{by}": r["all_layers"][by]["updates_per_s"] for by in ("row", "case")}
        out.update({f"per_k.{k}.{by}": v[by]["updates_per_s"] for k, v in r["per_k"].items() for by in ("row", "case")})
        return out

    base = rates(first)
    return {"model": first["model"], "dtypes": labels, "order": "sequential, in the order of dtypes",
            "by_dtype": runs, "updates_per_s": {d: rates(r) for d, r in runs.items()},
            "speedup": {d: {k: v / base[k] for k, v in rates(runs[d]).items()} for d in labels[1:]}}


@app.command("serve")
def serve(
    run: RunArg = None,
    run_alias: RunAlias = None,
    requests: Annotated[int, typer.Option(min=1, help="requests per concurrency level and mode")] = 96,
    levels: Annotated[str, typer.Option(help="requests in flight, comma-separated; each with batching on and off")] = "1,4,16,64",
    malformed: Annotated[float, typer.Option(min=0, max=1, help="fraction of deliberately malformed requests")] = 0.10,
    sizes: Annotated[str, typer.Option(help="questions per request, comma-separated, used in turn")] = "1,5,50",
    window_ms: Annotated[Optional[float], typer.Option(min=0, help="batching window of the batched mode (ms)")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    port: Annotated[int, typer.Option(help="loopback port (0 = a free one)")] = 0,
    timeout: Annotated[float, typer.Option(help="per-request timeout in seconds")] = 120.0,
    total_timeout: Annotated[float, typer.Option(help="time bound of each load in seconds")] = 900.0,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="also write the summary here")] = None,
    state_cache: Annotated[bool, typer.Option(
        "--state-cache", help="instead of the load: the state cache's scenarios, no HTTP (cold and warm single "
                              "questions, 5 questions in 1 request and in 5, cache on and off) at --threads")] = False,
    threads: Annotated[str, typer.Option(help="--state-cache: torch thread counts, comma-separated")] = "1,2",
    repeats: Annotated[int, typer.Option(min=1, help="--state-cache: timed repeats (median)")] = 5,
    state_tokens: Annotated[int, typer.Option(min=1, help="--state-cache: approximate state length in tokens")] = 250,
    scenarios: Annotated[Optional[str], typer.Option(
        help="--state-cache: the scenarios to run, comma-separated (default all; e.g. cold_1q_off,cold_1q,warm_1q)")
    ] = None,
    device: DeviceOpt = "auto",
    dtype: Annotated[str, typer.Option(
        "--dtype", metavar="auto|float32|bfloat16[,...]",
        help="backbone dtype (the scorer stays float32); with --state-cache a comma-separated list "
             "(float32,bfloat16) is measured interleaved, one model per dtype")] = "auto",
) -> None:
    """Loopback load on the server at several concurrencies, batching on and off: decisions/s, p50/p95/p99, 4xx/5xx
    (--state-cache: what the cross-request state cache saves, p50s and the warm/cold ratio; per dtype of --dtype)."""
    from rlcd.bench.serve import run_serve_bench
    from rlcd.run import find_export

    path = run_path(run, run_alias)
    find_export(path)
    dtypes = [x.strip() for x in dtype.split(",") if x.strip()]
    if not dtypes or (len(dtypes) > 1 and not state_cache):
        raise typer.BadParameter("one of auto, float32, bfloat16 (a comma-separated list goes with --state-cache)",
                                 param_hint="--dtype")
    where = {}
    for d in dtypes:
        p = placement(device, d, run=path)
        if p.dtype in where:
            raise typer.BadParameter(f"{dtype}: {p.dtype} given twice", param_hint="--dtype")
        where[p.dtype] = p
    if state_cache:
        from rlcd.bench.state_cache import run_state_cache_bench
        from rlcd.predict import Predictor

        try:
            thread_t = tuple(int(x) for x in threads.split(",") if x.strip())
        except ValueError:
            raise typer.BadParameter("comma-separated integers, e.g. 1,2", param_hint="--threads") from None
        if not thread_t or min(thread_t) < 1:
            raise typer.BadParameter("at least one thread count, each >= 1", param_hint="--threads")
        from rlcd.bench.state_cache import SCENARIOS

        chosen = tuple(x.strip() for x in (scenarios or ",".join(SCENARIOS)).split(",") if x.strip())
        if not chosen or any(x not in SCENARIOS for x in chosen):
            raise typer.BadParameter(f"comma-separated, from {','.join(SCENARIOS)}", param_hint="--scenarios")
        predictors = {d: Predictor.from_run(path, placement=p) for d, p in where.items()}
        res = run_state_cache_bench(predictors if len(predictors) > 1 else next(iter(predictors.values())),
                                    threads=thread_t, repeats=repeats, state_tokens=state_tokens, seed=seed,
                                    scenarios=chosen)
        _save("serve-state-cache", json_out, res, ("--threads", threads, "1,2"), ("--scenarios", scenarios, None),
              ("--repeats", repeats, 5), ("--state-tokens", state_tokens, 250), ("--seed", seed, 0),
              ("--device", device, "auto"), ("--dtype", dtype, "auto"), command="serve",
              positional=(path, "--state-cache"))
        return
    try:
        size_t = tuple(int(x) for x in sizes.split(",") if x.strip())
        level_t = tuple(int(x) for x in levels.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter("--sizes and --levels are comma-separated integers, e.g. 1,5,50") from None
    summary = run_serve_bench(path, requests=requests, levels=level_t, malformed=malformed, sizes=size_t, seed=seed,
                              port=port, window_ms=window_ms, timeout=timeout, total_timeout=total_timeout,
                              placement=next(iter(where.values())))
    _save("serve", json_out, summary, ("--requests", requests, 96), ("--levels", levels, "1,4,16,64"),
          ("--malformed", malformed, 0.10), ("--sizes", sizes, "1,5,50"), ("--window-ms", window_ms, None),
          ("--seed", seed, 0), ("--device", device, "auto"), ("--dtype", dtype, "auto"), positional=(path,))
    if summary["c5xx"] or summary["crashes"]:
        raise typer.Exit(1)


@app.command("onnx")
def onnx(
    run: RunArg = None,
    run_alias: RunAlias = None,
    threads: Annotated[str, typer.Option(help="intra-op threads of both engines, comma-separated (e.g. 1,2)")] = "1",
    repeats: Annotated[int, typer.Option(min=1, help="timed passes over the test split (best kept), after a warm-up")] = 3,
    export: Annotated[Optional[Path], typer.Option(
        "--export", metavar="DIR", help="measure this fp32 portable export of RUN instead of exporting one")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="also write the result here")] = None,
    http: Annotated[bool, typer.Option(
        "--http", help="instead: `rlcd serve RUN` and `rlcd serve --export DIR` over HTTP at each --threads, taking "
                       "turns, cold requests of --sizes questions; p50/p90 ms (needs --export; --repeats rounds)")]
    = False,
    sizes: Annotated[str, typer.Option(help="--http: questions per request, comma-separated")] = "1,5",
) -> None:
    """The portable export (ONNX fp32, int8 blockwise, int8 dynamic) against torch on the run's test split: rows/s,
    the ratio to torch measured in the same run, and each graph's parity (flips, max |dp|, NLL and ECE deltas).
    With --http: the torch server and the ONNX server at equal threads, one interleaved run over HTTP."""
    from rlcd.bench.onnx import http_table, run_onnx_bench, run_onnx_http_bench, table
    from rlcd.progress import echo
    from rlcd.run import find_export

    path = run_path(run, run_alias)
    find_export(path)
    try:
        counts = tuple(int(x) for x in threads.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter("comma-separated integers, e.g. 1,2", param_hint="--threads") from None
    if not counts or min(counts) < 1:
        raise typer.BadParameter("at least one thread count, each >= 1", param_hint="--threads")
    if http:
        from rlcd.portable.runtime import read_manifest

        if export is None:
            raise typer.BadParameter("--http serves a portable export of RUN: give --export DIR (`rlcd export RUN "
                                     "--format onnx --out DIR`)", param_hint="--export")
        read_manifest(export)
        try:
            size_t = tuple(int(x) for x in sizes.split(",") if x.strip())
        except ValueError:
            raise typer.BadParameter("comma-separated integers, e.g. 1,5", param_hint="--sizes") from None
        if not size_t or min(size_t) < 1:
            raise typer.BadParameter("at least one request size, each >= 1", param_hint="--sizes")
        result = run_onnx_http_bench(path, export, threads=counts, repeats=repeats, sizes=size_t, say=echo)
        typer.echo(http_table(result))
        _save("onnx-http", json_out, result, ("--threads", threads, "1"), ("--repeats", repeats, 3),
              ("--export", export, None), ("--sizes", sizes, "1,5"), command="onnx", positional=(path, "--http"))
        return
    result = run_onnx_bench(path, threads=counts, repeats=repeats, export=export, say=echo)
    typer.echo(table(result))
    _save("onnx", json_out, result, ("--threads", threads, "1"), ("--repeats", repeats, 3), ("--export", export, None),
          positional=(path,))


@app.command("votes")
def votes(
    run: RunArg = None,
    run_alias: RunAlias = None,
    order_votes: Annotated[str, typer.Option(
        "--order-votes", metavar="N,N,...", help="vote counts to compare, comma-separated (1 is always measured: "
                                                 "the ratios' base)")] = "1,2,3,4",
    questions: Annotated[int, typer.Option(min=1, help="questions per request (choice, noul, score in turn)")] = 6,
    repeats: Annotated[int, typer.Option(min=1, help="timed repeats (median), every N in each")] = 5,
    state_tokens: Annotated[int, typer.Option(min=1, help="approximate state length in tokens")] = 250,
    seed: Annotated[int, typer.Option()] = 0,
    threads: Annotated[Optional[int], typer.Option(help="torch threads (default: torch's)")] = None,
    json_out: Annotated[Optional[Path], typer.Option(
        "--json", help="also write the result here (bench format)")] = None,
    device: DeviceOpt = "auto",
    dtype: DTypeOpt = DType.auto,
) -> None:
    """What order votes cost: time and input tokens per request at each --order-votes N, and their ratios to N = 1,
    measured in one interleaved run (state cache off). The result JSON goes to stdout, progress lines to stderr."""
    from rlcd.cli._common import MAX_ORDER_VOTES, echo_json
    from rlcd.run import find_export

    try:
        counts = tuple(int(x) for x in order_votes.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter("comma-separated integers, e.g. 1,2,3,4", param_hint="--order-votes") from None
    if not counts or not all(1 <= n <= MAX_ORDER_VOTES for n in counts):
        raise typer.BadParameter(f"vote counts from 1 to {MAX_ORDER_VOTES}, e.g. 1,2,3,4", param_hint="--order-votes")
    path = run_path(run, run_alias)
    find_export(path)
    from rlcd.bench.votes import run_votes_bench
    from rlcd.predict import Predictor
    from rlcd.progress import echo

    _threads(threads)
    res = run_votes_bench(Predictor.from_run(path, placement=placement(device, dtype), state_cache_mb=0),
                          votes=counts, questions=questions, repeats=repeats, state_tokens=state_tokens, seed=seed,
                          say=echo)
    echo_json(res)
    _save("votes", json_out, res, ("--order-votes", order_votes, "1,2,3,4"), ("--questions", questions, 6),
          ("--repeats", repeats, 5), ("--state-tokens", state_tokens, 250), ("--seed", seed, 0),
          ("--threads", threads, None), ("--device", device, "auto"), ("--dtype", dtype, DType.auto),
          positional=(path,))


@app.command("batch")
def batch(
    run: RunArg = None,
    run_alias: RunAlias = None,
    data: Annotated[Optional[Path], typer.Option(help="processed data dir (default: the run's)")] = None,
    split: Annotated[str, typer.Option(help="the splits whose records are the rows, comma-separated")] = "test",
    rows: Annotated[Optional[int], typer.Option(min=1, help="at most this many rows (default: all)")] = None,
    rounds: Annotated[int, typer.Option(min=1, help="interleaved rounds of every arm (median)")] = 2,
    actors: Annotated[str, typer.Option(help="Ray actor counts, comma-separated (empty: no Ray arms)")] = "1,2",
    threads: Annotated[int, typer.Option(min=1, help="torch threads of every process")] = 1,
    chunk_rows: Annotated[int, typer.Option(min=1, help="rows per committed part of the batch jobs")] = 256,
    batch_size: Annotated[int, typer.Option(min=1, help="states per model call of the batch jobs")] = 16,
    floor: Annotated[bool, typer.Option(help="measure the floor arm: the bare decoder forwards of the same shapes")] = True,
    singles: Annotated[int, typer.Option(min=0, help="rows sent alone to compare the jobs' answers with")] = 200,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16, every arm")] = "float32",
    arms: Annotated[str, typer.Option(help="only these arms, comma-separated (default: all)")] = "",
    python: Annotated[Optional[Path], typer.Option(
        help="interpreter of the measured processes (it needs ray for the Ray arms; default: this one)")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="also write the result here (bench format)")] = None,
) -> None:
    """Offline scoring rows/s on one machine, interleaved: one HTTP request per state against `rlcd serve`,
    `rlcd predict --input` in one process (packed), the same at the Ray arm's total threads, through Ray with each
    actor count, and the floor (the decoder's own forwards of the same shapes); peak RSS of each; the ratios; the
    jobs' largest |p - p_single| over --singles rows; and a projection (labelled as such) of rows/s per actor x
    actors."""
    from rlcd.bench.batch import run_batch_bench
    from rlcd.progress import echo
    from rlcd.run import find_export

    path = run_path(run, run_alias)
    find_export(path)
    try:
        actor_t = tuple(int(x) for x in actors.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter("comma-separated integers, e.g. 1,2", param_hint="--actors") from None
    if actor_t and min(actor_t) < 1:
        raise typer.BadParameter("actor counts are >= 1", param_hint="--actors")
    splits = tuple(x.strip() for x in split.split(",") if x.strip())
    if data is not None and not all((data / f"{s}.jsonl").is_file() for s in splits):
        raise typer.BadParameter(f"{data}: not a processed data directory with {', '.join(splits)}",
                                 param_hint="--data")
    if actor_t:
        import subprocess
        import sys

        if subprocess.run([str(python or sys.executable), "-c", "import ray"], capture_output=True).returncode:
            raise typer.BadParameter("the Ray arms need ray in the interpreter: pip install 'rlcd[ray]', give "
                                     "--python PATH, or --actors ''", param_hint="--actors")
    if dtype not in ("float32", "bfloat16"):
        raise typer.BadParameter(f"{dtype!r}: float32 or bfloat16", param_hint="--dtype")
    only = tuple(a.strip() for a in arms.split(",") if a.strip())
    try:
        res = run_batch_bench(path, data=data, splits=splits, rows=rows, rounds=rounds, actors=actor_t,
                              threads=threads, chunk_rows=chunk_rows, batch_size=batch_size, floor=floor,
                              n_singles=singles, dtype=dtype, only=only, python=str(python) if python else None,
                              say=echo)
    except ValueError as e:
        if "no arm" not in str(e):
            raise
        raise typer.BadParameter(str(e), param_hint="--arms") from None
    _save("batch", json_out, res, ("--data", data, None), ("--split", split, "test"), ("--rows", rows, None),
          ("--rounds", rounds, 2), ("--actors", actors, "1,2"), ("--threads", threads, 1),
          ("--chunk-rows", chunk_rows, 256), ("--batch-size", batch_size, 16), ("--floor", floor, True),
          ("--singles", singles, 200), ("--dtype", dtype, "float32"), ("--arms", arms, ""), ("--python", python, None),
          positional=(path,))


@app.command("report")
def report(
    results_dir: Annotated[Path, typer.Option(help="directory of bench JSON files")] = RESULTS,
    out: Annotated[Path, typer.Option(help="Markdown file to write")] = Path("benchmarks/BENCHMARKS.md"),
) -> None:
    """Regenerate benchmarks/BENCHMARKS.md from benchmarks/results/*.json."""
    from rlcd.bench.report import load_results, write_benchmarks_md

    if not results_dir.is_dir():
        raise typer.BadParameter(f"{results_dir}: no such directory", param_hint="--results-dir")
    path = write_benchmarks_md(results_dir, out)
    typer.echo(f"wrote {path} from {len(load_results(results_dir))} result file(s) in {results_dir}")


@app.command("data")
def data(
    cases: Annotated[int, typer.Option(min=1, help="synthetic cases (six questions each)")] = 400,
    easy_vqa: Annotated[int, typer.Option(min=0, help="easy-vqa questions")] = 400,
    seed: Annotated[int, typer.Option()] = 0,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write the result JSON (bench format) here")] = None,
) -> None:
    """Data layer speed: cases -> prepared splits (rows/s) and sampler rows/s."""
    from rlcd.bench.data import run_data_bench

    res = run_data_bench(cases=cases, easy_vqa=easy_vqa, seed=seed)
    _save("data", json_out, res, ("--cases", cases, 400), ("--easy-vqa", easy_vqa, 400), ("--seed", seed, 0))
