"""`rlcd predict` (one request, from a file, stdin or flags) and `rlcd serve` (HTTP /v1/systemone)."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from rlcd.cli._common import (AttentionOpt, DeviceOpt, DType, DTypeOpt, OrderVotesOpt, RunAlias, RunArg, VoteCombine,
                              VoteCombineOpt, check_order_votes, echo_json, placement, run_path)

# the server's defaults (rlcd.serving.limits.Limits), spelled here so --help needs no import of it
MAX_QUESTIONS, MAX_CANDIDATES, MAX_TOKENS, MAX_REQUEST_BYTES, MAX_IMAGE_PIXELS = 64, 255, 8192, 8 << 20, 4096 * 4096
STATE_CACHE_MB = 256  # rlcd.predict.DEFAULT_STATE_CACHE_MB
StateCacheOpt = Annotated[float, typer.Option(
    help="MiB of decoder states kept between requests, so a later request about the same state (and image) runs "
         "only its questions; least recently used states go first; 0 turns it off (docs/SERVING.md)")]


RowCacheOpt = Annotated[float, typer.Option(
    help="MiB of answered rows' features kept between requests, so a question asked again about the same state "
         "(and image) runs no backbone forward; its answer is the first one's, equal to a fresh one up to float "
         "noise, not bit for bit; 0 (the default) turns it off (docs/SERVING.md)")]


def check_state_cache_mb(value: float, flag: str = "--state-cache-mb", what: str = "the state cache") -> float:
    """A negative or non-finite --state-cache-mb (or --row-cache-mb) is one line and exit 2 (before anything
    loads)."""
    import math

    from rlcd.errors import OptionError

    if not (math.isfinite(value) and value >= 0):
        raise OptionError(f"{flag} {value:g}: give a size in MiB >= 0 (0 turns {what} off)")
    return value


AsAskedOpt = Annotated[bool, typer.Option(
    "--as-asked", help="ask every question as sent; by default each is asked in one canonical form (a choice's "
                       "options sorted by description then id, duplicates once, a yes/no choice or score as a noul) "
                       "and the answer mapped back to the caller's options (docs/SERVING.md)")]


class AccessLog(str, Enum):
    """The access line's format (rlcd.serving.access.ACCESS_FORMATS)."""

    text = "text"
    json = "json"


def predict(
    run: RunArg = None,
    request_arg: Annotated[Optional[Path], typer.Argument(
        metavar="REQUEST", help="request JSON file or '-' (the same as --request)", show_default=False)] = None,
    run_alias: RunAlias = None,
    request: Annotated[Optional[Path], typer.Option(
        help="request JSON file ('-' = stdin; default: stdin when it is not a terminal)")] = None,
    state: Annotated[Optional[str], typer.Option(help="state text (or a JSON object)")] = None,
    question: Annotated[Optional[list[str]], typer.Option(
        "--question", "-q", help='a question: JSON with an "id" key, or qid=JSON (repeatable)')] = None,
    image: Annotated[Optional[Path], typer.Option(help="image file for the request")] = None,
    state_cache_mb: StateCacheOpt = STATE_CACHE_MB,
    order_votes: OrderVotesOpt = 1,
    vote_combine: VoteCombineOpt = VoteCombine.logmean,
    as_asked: AsAskedOpt = False,
    device: DeviceOpt = "auto",
    dtype: DTypeOpt = DType.auto,
    attention: AttentionOpt = "sdpa",
    input: Annotated[Optional[Path], typer.Option(
        "--input", metavar="FILE", help="batch: score every request of FILE (.jsonl: one /v1/systemone request with "
                                        "an \"id\" per line; .parquet: one per row) into --output",
        rich_help_panel="Batch", show_default=False)] = None,
    data: Annotated[Optional[Path], typer.Option(
        "--data", metavar="DIR", help="batch: score a processed split instead (--split S), one request per record",
        rich_help_panel="Batch", show_default=False)] = None,
    split: Annotated[Optional[str], typer.Option(
        "--split", metavar="S", help="batch: the split of --data (train, dev, calibration, test)",
        rich_help_panel="Batch", show_default=False)] = None,
    output: Annotated[Optional[Path], typer.Option(
        "--output", metavar="FILE", help="batch: the answers (.jsonl or .parquet), committed in parts; rejected rows "
                                         "go to FILE.rejects.jsonl with their line and reason",
        rich_help_panel="Batch", show_default=False)] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="batch: continue a killed job, skipping the rows already committed",
        rich_help_panel="Batch")] = False,
    batch_size: Annotated[int, typer.Option(
        min=1, help="batch: states per batched model call", rich_help_panel="Batch")] = 16,
    chunk_rows: Annotated[int, typer.Option(
        min=1, help="batch: rows per committed part (what a killed job can lose and redo)",
        rich_help_panel="Batch")] = 256,
    threads: Annotated[Optional[int], typer.Option(
        min=1, help="batch: torch (or onnxruntime) threads per process (default: the library's)",
        rich_help_panel="Batch", show_default=False)] = None,
    image_root: Annotated[Optional[Path], typer.Option(
        help="batch: the directory image paths in requests are resolved under (--data: the data dir)",
        rich_help_panel="Batch", show_default=False)] = None,
    export: Annotated[Optional[Path], typer.Option(
        "--export", metavar="DIR", help="answer with a portable ONNX export instead of a run (onnxruntime, no torch)",
        show_default=False)] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="batch: no progress on stderr",
                                        rich_help_panel="Batch")] = False,
    ray: Annotated[bool, typer.Option(
        "--ray", help="batch: run on Ray Data, one Predictor per actor (pip install 'rlcd\\[ray]')",
        rich_help_panel="Ray")] = False,
    ray_address: Annotated[Optional[str], typer.Option(
        "--ray-address", metavar="ADDRESS", help="the cluster to join (default: RAY_ADDRESS, else a local one "
                                                 "started for the job)", rich_help_panel="Ray",
        show_default=False)] = None,
    num_actors: Annotated[Optional[int], typer.Option(
        min=1, help="actors, each with its own Predictor [default: 1]", rich_help_panel="Ray",
        show_default=False)] = None,
    cpus_per_actor: Annotated[Optional[float], typer.Option(
        min=0.01, help="CPUs reserved per actor [default: 1]", rich_help_panel="Ray", show_default=False)] = None,
    gpus_per_actor: Annotated[Optional[float], typer.Option(
        min=0, help="GPUs per actor [default: 0]", rich_help_panel="Ray", show_default=False)] = None,
) -> None:
    """Answer one /v1/systemone request with a run's export and print the JSON response; or, with --input FILE
    --output FILE, score a whole file of requests (batch), with --ray on a Ray cluster.

    `rlcd predict RUN request.json`, `... RUN - < request.json`, or the request built from --state and -q.
    The request is read and validated before the model loads, so a malformed one fails at once.

    Batch: `rlcd predict RUN --input requests.jsonl --output answers.jsonl [--resume] [--ray]`, or
    `--data DIR --split test`; a summary (rows == answered + rejected) is printed at the end (docs/SERVING.md).
    """
    import json

    from rlcd.cli.batch import check_batch_options, predict_batch

    check_state_cache_mb(state_cache_mb)
    check_order_votes(order_votes)
    single = [name for name, v in (("REQUEST", request_arg), ("--request", request), ("--state", state),
                                   ("--question", question), ("--image", image)) if v]
    ray_opts = [name for name, v in (("--ray-address", ray_address), ("--num-actors", num_actors),
                                     ("--cpus-per-actor", cpus_per_actor), ("--gpus-per-actor", gpus_per_actor))
                if v is not None]
    batch_opts = [name for name, v, d in (("--batch-size", batch_size, 16), ("--chunk-rows", chunk_rows, 256),
                                          ("--threads", threads, None), ("--image-root", image_root, None),
                                          ("--quiet", quiet, False)) if v != d]
    if export is not None and (run is not None or run_alias is not None):
        raise typer.BadParameter("give RUN or --export DIR, not both", param_hint="--export")
    if export is not None and attention != "sdpa":
        raise typer.BadParameter(f"{attention}: a portable export's graph was traced with its attention when it was "
                                 "written; leave --attention out, or predict with the run itself", param_hint="--attention")
    if check_batch_options(input=input, data=data, split=split, output=output, single=single, resume=resume, ray=ray,
                           ray_opts=ray_opts, batch_opts=batch_opts):
        if export is not None:
            from rlcd.portable.runtime import read_manifest, require_onnx

            read_manifest(export)
            require_onnx()
            path = None
        else:
            from rlcd.run import find_export

            path = run_path(run, run_alias)
            find_export(path)
        res = predict_batch(run=path, export=export, input=input, data=data, split=split, output=output,
                            resume=resume, batch_size=batch_size, chunk_rows=chunk_rows, threads=threads,
                            image_root=image_root, order_votes=order_votes, state_cache_mb=state_cache_mb,
                            device=device, dtype=dtype.value, ray=ray, ray_address=ray_address,
                            num_actors=num_actors or 1, cpus_per_actor=cpus_per_actor or 1.0,
                            gpus_per_actor=gpus_per_actor or 0.0, quiet=quiet, canonical=not as_asked,
                            vote_combine=vote_combine.value, attention=attention)
        from rlcd.progress import echo

        echo(f"rlcd predict: {res['rows']} rows read = {res['answered']} answered + {res['rejected']} rejected "
             f"(rejects: {res['rejects']})")
        echo_json(res)
        return

    from rlcd.errors import UserError
    from rlcd.run import find_export
    from rlcd.serving.request import parse_request
    from rlcd.serving.cli_request import build_cli_request, pending_stdin
    from rlcd.serving.limits import Limits

    if export is None:
        path = run_path(run, run_alias)
    if request_arg is not None:
        if request is not None and request != request_arg:
            raise typer.BadParameter(f"given twice ({request_arg} and --request {request}); give it once",
                                     param_hint="REQUEST")
        request = request_arg
    if export is None:
        find_export(path)
    else:
        from rlcd.portable.runtime import read_manifest, require_onnx

        read_manifest(export)
        require_onnx()
    if request is None and state is None and not question and not sys.stdin.isatty():
        request = Path("-")
    elif request is None and (pending_stdin() or "").strip():  # --state / -q, and a request piped in as well
        raise UserError("a request on stdin and --state/-q: give the request one way; to add --state/-q to the "
                        "piped request, name stdin as REQUEST (`rlcd predict RUN - --state ...`)")
    if request is not None and str(request) != "-" and not request.is_file():
        raise typer.BadParameter(f"{request}: no such file", param_hint="REQUEST" if request_arg else "--request")
    try:
        req, img = build_cli_request(request, state, question)
    except UserError:
        raise
    except json.JSONDecodeError as e:
        src = "stdin" if str(request) == "-" else str(request)
        raise UserError(f"the request ({src}) is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (ValueError, OSError) as e:
        raise UserError(f"the request: {e}") from None
    if image is not None:
        if not image.is_file():
            raise typer.BadParameter(f"{image}: no such file", param_hint="--image")
        img = image
    parse_request(req, Limits())  # before the model loads (and before torch is imported)
    if export is not None:
        from rlcd.portable.runtime import load_portable

        echo_json(load_portable(export, order_votes=order_votes, canonical=not as_asked,
                                vote_combine=vote_combine.value).predict(req, img))
        return
    from rlcd.predict import Predictor

    where = placement(device, dtype, run=path, attention=attention)
    predictor = Predictor.from_run(path, placement=where, lazy=True,  # loaded only if needed
                                   state_cache_mb=state_cache_mb, order_votes=order_votes,
                                   canonical=not as_asked, vote_combine=vote_combine.value)
    echo_json(predictor.predict(req, img))


def serve(
    run: RunArg = None,
    run_alias: RunAlias = None,
    host: Annotated[str, typer.Option(help="bind address (loopback by default)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    image_root: Annotated[Optional[Path], typer.Option(
        help="directory that image paths in requests are resolved under (none: base64 images only)")] = None,
    max_questions: Annotated[int, typer.Option(help="questions per request")] = MAX_QUESTIONS,
    max_candidates: Annotated[int, typer.Option(help="candidates per question")] = MAX_CANDIDATES,
    max_tokens: Annotated[int, typer.Option(help="tokens per rendered row (image tokens included)")] = MAX_TOKENS,
    max_request_bytes: Annotated[int, typer.Option(help="request body bytes")] = MAX_REQUEST_BYTES,
    max_image_pixels: Annotated[int, typer.Option(help="pixels of a decoded image")] = MAX_IMAGE_PIXELS,
    served_model_name: Annotated[Optional[str], typer.Option(
        help="the model name /v1/models shows and responses echo when a request names none (default: the run's "
             "directory name)")] = None,
    strict_model: Annotated[bool, typer.Option(
        help="refuse (404) a request whose `model` is not the served name; by default any name is echoed")] = False,
    batch_window_ms: Annotated[float, typer.Option(
        min=0, help="gather requests arriving within this many ms into one forward (0 = no batching)")] = 4.0,
    max_batch_questions: Annotated[int, typer.Option(min=1, help="questions per batched forward")] = 256,
    max_batch_tokens: Annotated[int, typer.Option(min=1, help="prompt tokens per batched forward")] = 65536,
    max_queue: Annotated[int, typer.Option(min=1, help="requests waiting at most; more get 503 + Retry-After")] = 256,
    request_timeout: Annotated[float, typer.Option(min=0.001, help="seconds a request may wait for its answer "
                                                                    "(then 503 + Retry-After)")] = 60.0,
    workers: Annotated[int, typer.Option(min=1, help="uvicorn worker processes, each with its own copy of the "
                                                     "model (memory: one model per worker)")] = 1,
    api_key: Annotated[Optional[str], typer.Option(
        envvar="RLCD_API_KEY", show_envvar=True, show_default=False,
        help="require 'Authorization: Bearer KEY' on every /v1/* request (/health stays open); prefer the "
             "environment variable, which stays out of shell history and ps")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="no access log line per request on stderr")] = False,
    access_log: Annotated[Optional[AccessLog], typer.Option(
        help="the access line per request on stderr: text (key=value pairs) or json (one object per line)",
        show_default="text")] = None,
    thresholds: Annotated[Optional[Path], typer.Option(
        help="thresholds.json that requests with \"x_gate\": true are gated with (default: RUN/eval/thresholds.json, "
             "written by `rlcd gate` / `rlcd evaluate`)", show_default=False)] = None,
    state_cache_mb: StateCacheOpt = STATE_CACHE_MB,
    row_cache_mb: RowCacheOpt = 0.0,
    export: Annotated[Optional[Path], typer.Option(
        "--export", metavar="DIR", help="serve a portable ONNX export (`rlcd export RUN --format onnx --out DIR`) "
                                        "instead of a run: onnxruntime + tokenizers + numpy, no torch",
        show_default=False)] = None,
    order_votes: OrderVotesOpt = 1,
    threads: Annotated[Optional[int], typer.Option(
        min=1, metavar="N", help="CPU threads of the model: torch's intra-op threads, or with --export onnxruntime's "
                                 "intra-op and inter-op threads (default: torch's default, OMP_NUM_THREADS or the "
                                 "physical cores, for both)", show_default=False)] = None,
    vote_combine: VoteCombineOpt = VoteCombine.logmean,
    as_asked: AsAskedOpt = False,
    device: DeviceOpt = "auto",
    dtype: DTypeOpt = DType.auto,
    attention: AttentionOpt = "sdpa",
    ctx: typer.Context = None,  # type: ignore[assignment]  # typer passes it: which options were given
) -> None:
    """Serve a run over HTTP: POST /v1/systemone (System One: transformers' clients and TypeSafe's SDK family),
    GET /v1/models, GET /health (liveness), GET /ready (readiness), POST /drain, GET /metrics (Prometheus).
    With --export DIR: a portable ONNX export, same wire format, without torch."""
    from rlcd.run import find_export
    from rlcd.server import serve as run_server
    from rlcd.serving.access import check_api_key
    from rlcd.serving.batcher import BatchingConfig

    check_state_cache_mb(state_cache_mb)
    check_state_cache_mb(row_cache_mb, "--row-cache-mb", "the row cache")
    check_order_votes(order_votes)
    if api_key is not None:
        try:
            check_api_key(api_key, "--api-key / RLCD_API_KEY")
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--api-key") from None
    if quiet and access_log is not None:
        raise typer.BadParameter("--quiet turns the access log off; give --quiet or --access-log, not both",
                                 param_hint="--access-log")
    if export is not None:
        if run is not None or run_alias is not None:
            raise typer.BadParameter("give RUN or --export DIR, not both", param_hint="--export")
        check_portable_options(device, dtype, state_cache_mb, given=lambda name: _given(ctx, name),
                               row_cache_mb=row_cache_mb, attention=attention)
        from rlcd.portable.runtime import read_manifest, require_onnx

        read_manifest(export)  # one-line errors before binding
        require_onnx()
        path = export
    else:
        path = run_path(run, run_alias)
        find_export(path)
    if image_root is not None and not image_root.is_dir():
        raise typer.BadParameter(f"{image_root}: not a directory", param_hint="--image-root")
    if thresholds is not None:
        from rlcd.serving.gating import Gates

        if not thresholds.is_file():
            raise typer.BadParameter(f"{thresholds}: no such file", param_hint="--thresholds")
        try:
            Gates.load(thresholds)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--thresholds") from None
    check_port(host, port)  # before the model loads
    batching = BatchingConfig(window_ms=batch_window_ms, max_batch_questions=max_batch_questions,
                              max_batch_tokens=max_batch_tokens, max_queue=max_queue, timeout_s=request_timeout)
    run_server(path, host=host, port=port, image_root=image_root,
               placement=None if export is not None else placement(device, dtype, run=path, attention=attention),
               portable=export is not None,
               served_model_name=served_model_name, strict_model=strict_model, batching=batching, workers=workers,
               api_key=api_key, quiet=quiet, access_log=(access_log or AccessLog.text).value, thresholds=thresholds,
               state_cache_mb=state_cache_mb, order_votes=order_votes, threads=threads, canonical=not as_asked,
               vote_combine=vote_combine.value, row_cache_mb=row_cache_mb, max_questions=max_questions,
               max_candidates=max_candidates,
               max_tokens=max_tokens,
               max_request_bytes=max_request_bytes, max_image_pixels=max_image_pixels)


def _given(ctx: Optional[typer.Context], name: str) -> bool:
    """Whether the option `name` (its parameter name) came from the command line or the environment."""
    from typer._click.core import ParameterSource  # typer's vendored click, as rlcd.cli's error handling

    if ctx is None:
        return False
    source = ctx.get_parameter_source(name)
    return source is not None and source not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)


def check_portable_options(device: str, dtype: DType | str, state_cache_mb: float, *, given,
                           row_cache_mb: float = 0, attention: str = "sdpa") -> None:
    """`serve --export` runs onnxruntime on the CPU at the precision the export was written in, without a state
    cache: an option asking otherwise is refused in one line (exit 2) before anything loads, never ignored."""
    from rlcd.errors import OptionError

    dtype = dtype.value if isinstance(dtype, DType) else str(dtype)
    if str(device).strip().lower() not in ("auto", "cpu"):
        raise OptionError(f"--device {device}: a portable export runs on onnxruntime's CPU provider only; leave "
                          "--device out (or give cpu), or serve the run itself (`rlcd serve RUN --device ...`)")
    if dtype != DType.auto.value:
        raise OptionError(f"--dtype {dtype}: a portable export's precision was fixed when it was written (manifest.json "
                          "graph.precision: float32 or int8, `rlcd export --quantize`); leave --dtype out")
    if given("attention") and attention != "sdpa":
        raise OptionError(f"--attention {attention}: a portable export's graph was traced with its attention when it "
                          "was written; leave --attention out, or serve the run itself")
    if given("row_cache_mb") and row_cache_mb != 0:
        raise OptionError(f"--row-cache-mb {row_cache_mb:g}: a portable export keeps no row features (its graph "
                          "takes whole packed rows); leave --row-cache-mb out")
    if given("state_cache_mb") and state_cache_mb != 0:
        raise OptionError(f"--state-cache-mb {state_cache_mb:g}: a portable export keeps no decoder states (its "
                          "graph takes whole packed rows); leave --state-cache-mb out")


def check_port(host: str, port: int) -> None:
    """Bind (host, port) once, as uvicorn will (SO_REUSEADDR), and let it go: a port in use, a privileged
    port or an unknown host is a one-line UserError before the seconds of loading a model, not a uvicorn
    traceback after them. (Another process can still take the port in between; uvicorn then reports it.)"""
    import errno
    import socket

    from rlcd.errors import UserError

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError, OverflowError) as e:
        raise UserError(f"cannot serve on --host {host} --port {port}: {e}") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(f"port {port} on {host} is already in use (another server?); stop it or choose "
                                "another --port") from None
            raise UserError(f"cannot serve on --host {host} --port {port}: {e.strerror or e}") from None
