"""HTTP server speaking System One (`POST /v1/systemone`) as `transformers serve` does (FastAPI + uvicorn).

Endpoints:

* `POST /v1/systemone`: a System One request (see `rlcd.serving.request`: transformers' format, plus
  rlcd's `image` alias) -> `{"model", "answers", "usage": {"input_tokens", "output_tokens": 0,
  "images"}}`. Images come as `assets` (`data_base64`, or a `path` resolved under the configured image
  root only: absolute paths, `..` and symlinks leading outside are refused; without an image root every
  path is refused; URLs are refused, the server does not fetch) or as `image: {"base64"|"path"}`.
* `GET /health` and `GET /healthz`: `{"status": "ok", "model": name}` (liveness). `GET /ready`: 200 once the model
  is loaded and a warm-up request has been answered, 503 with the reason otherwise or once draining; `POST /drain`:
  refuse new /v1 requests (503 + Retry-After), finish those in flight (`rlcd.serving.lifecycle`).
* `GET /metrics`: Prometheus metrics of this app (`rlcd.serving.server_metrics`).
* `GET /v1/models`: `{"object": "list", "data": [{"id", "object": "model", "created", "owned_by", ...}],
  "models": [{"name", "description", "release_date"}]}`: transformers' (OpenAI's) list and the official SDK's in one
  object (+ backbone, temperatures, limits, placement in `data`).

Bodies may be gzip or zstd (`Content-Encoding`, decoded under `max_request_bytes`) and multipart/form-data (the
official SDK's image form): `rlcd.serving.bodies`. `"x_gate": true` in a request adds gate decisions from a
thresholds.json (`rlcd.serving.gating`).
* `/openapi.json` declares the request, response and error schemas and the request-id headers; `/docs` serves
  Swagger UI.

With an API key (`rlcd.serving.access`), every `/v1/*` request needs `Authorization: Bearer KEY`
(401 `{"detail": {"error_type": "authentication_error", "message"}}`, the official API's shape, and
`WWW-Authenticate: Bearer` otherwise), and so does `/drain`; `/health`, `/ready` and `/metrics` stay open; the
OpenAPI document declares the bearer scheme. With `access_log`, each request writes one line on stderr
(`rlcd.serving.access`: request id, status, questions, input tokens, queue wait, model time; logfmt or JSON).

Layout: `create_app` builds a `ServerContext` and registers the route families on it, each a module of its own:
`rlcd.serving.routes_systemone`, `routes_models`, `routes_health` (health, ready, drain), `routes_metrics`;
`rlcd.serving.middleware` wraps every request; `rlcd.serving.openapi` completes the document.

Every response carries `X-Request-ID` and `x-typesafe-request-id` (the client's, else a new one). Every bad input
gets FastAPI's and transformers' error body `{"detail": [{"loc", "msg", "type"}]}` (+ `question` when one question
is at fault): 400 undecodable input (base64, image bytes, compressed data), 403 an image path outside the root,
404 an unknown model (only with `strict_model`) or image file, 413 size limits (body bytes -- the
`Content-Length` header and the bytes actually received --, questions, candidates, tokens, image
pixels, decoded body bytes), 415 an unknown Content-Encoding, 422 rule violations (a body that is not a JSON
object too: `json_invalid`). Unknown routes and methods keep FastAPI's `{"detail": "Not Found"}`.
An unexpected failure is a 500 with the same JSON shape, and the server keeps serving.

Concurrency: body parsing, validation and image decoding run in a bounded pool of worker threads;
the model runs in the batcher's one model thread (`rlcd.serving.batcher`: concurrent requests share
forwards, a bounded queue answers 503 + Retry-After when full), so the event loop never blocks on it.
"""

import contextlib
import datetime
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from .predict import DEFAULT_STATE_CACHE_MB, Predictor, Prepared
from .serving import access, middleware, routes_health, routes_metrics, routes_models, routes_systemone
from .serving.access import REQUEST_ID_HEADERS, TYPESAFE_REQUEST_ID  # noqa: F401 (API)
from .serving.batcher import Batcher, BatchingConfig
from .serving.bodies import parse_body
from .serving.context import ServerContext, error_response
from .serving.errors import PredictError
from .serving.gating import Gates
from .serving.images import decode_base64_image, load_request_image, resolve_image_path  # noqa: F401 (API)
from .serving.lifecycle import Lifecycle
from .serving.limits import Limits
from .serving.openapi import openapi_builder
from .serving.server_metrics import ServerMetrics

log = logging.getLogger("rlcd.server")
ROUTE_FAMILIES = (routes_health, routes_models, routes_systemone, routes_metrics)


def access_format(access_log: bool | str | None) -> str | None:
    """The access log's format from `create_app`'s argument: True is "text" (the form before JSON existed)."""
    if access_log is True:
        return "text"
    if access_log is False or access_log is None:
        return None
    if access_log not in access.ACCESS_FORMATS:
        raise ValueError(f"access log format must be one of {', '.join(access.ACCESS_FORMATS)}, got {access_log!r}")
    return access_log


def create_app(predictor: Predictor, *, image_root: Path | str | None = None, limits: Limits | None = None,
               batching: BatchingConfig | None = None, api_key: str | None = None, access_log: bool | str = False,
               thresholds: Path | str | Gates | None = None):
    """The FastAPI app around one Predictor (see the module docstring): the context its route families share,
    the middleware, the routes, the OpenAPI document.

    `api_key`: required as `Authorization: Bearer KEY` on every /v1/* request and /drain. `access_log`: one line per
    request on stderr, "text" (or True) or "json". `thresholds`: a `thresholds.json` (path or loaded `Gates`) for
    requests with `x_gate` and the gate metrics."""
    from fastapi import FastAPI

    ctx = server_context(predictor, image_root=image_root, limits=limits, batching=batching, api_key=api_key,
                         access_log=access_log, thresholds=thresholds)
    app = FastAPI(title="rlcd", summary="Calibrated typed decisions over System One (/v1/systemone)",
                  lifespan=_lifespan(ctx))
    app.state.context = ctx
    app.state.predictor, app.state.batcher, app.state.limits = predictor, ctx.batcher, ctx.limits
    app.state.image_root, app.state.gates = ctx.image_root, ctx.gates
    routers = [family.router(ctx) for family in ROUTE_FAMILIES]
    paths = {r.path for r in app.routes if hasattr(r, "path")} | {r.path for router in routers for r in router.routes}
    middleware.install(app, ctx, paths)
    app.add_exception_handler(Exception, _internal_error)
    for router in routers:
        app.include_router(router)
    app.openapi = openapi_builder(app, api_key)
    return app


def server_context(predictor: Predictor, *, image_root: Path | str | None, limits: Limits | None,
                   batching: BatchingConfig | None, api_key: str | None, access_log: bool | str | None,
                   thresholds: Path | str | Gates | None) -> ServerContext:
    """Check the arguments (ValueError before anything starts) and build what the routes share."""
    if api_key is not None:
        access.check_api_key(api_key)
    root: Path | None = None
    if image_root is not None:
        root = Path(image_root).expanduser().resolve()
        if not root.is_dir():
            raise ValueError(f"image root {image_root} is not a directory")
    fmt = access_format(access_log)
    gates = thresholds if isinstance(thresholds, Gates) or thresholds is None else Gates.load(thresholds)
    started = int(time.time())
    release_date = getattr(predictor, "release_date", None) or datetime.datetime.fromtimestamp(
        started, datetime.timezone.utc).date().isoformat()
    batching = batching or BatchingConfig()
    metrics = ServerMetrics(gates)
    batcher = Batcher(predictor.score_many, batching, size_of=Prepared.size, observer=metrics.observe_batch)
    lifecycle = Lifecycle(model_loaded=lambda: bool(getattr(predictor, "loaded", True)))
    metrics.watch(queue_depth=batcher.queue.qsize, in_flight=lambda: lifecycle.in_flight,
                  ready=lambda: lifecycle.readiness()[0], predictor=predictor)
    return ServerContext(predictor=predictor, batcher=batcher, batching=batching, limits=limits or predictor.limits,
                         image_root=root, gates=gates, lifecycle=lifecycle, metrics=metrics, api_key=api_key,
                         access_log=fmt, started=started, release_date=release_date)


def _lifespan(ctx: ServerContext):
    """Start-up: the worker pool's size, then the warm-up in the background (so /health answers while it runs and
    /ready says why it is not ready yet). Shut-down: answer what is queued, then stop the model thread."""
    import asyncio

    @contextlib.asynccontextmanager
    async def lifespan(app):
        import anyio.to_thread

        # request parsing, tokenisation and image decoding run in worker threads: a few per core is plenty,
        # and each thread costs a malloc arena (resident memory that grows under load)
        anyio.to_thread.current_default_thread_limiter().total_tokens = PREPARE_THREADS
        warm = asyncio.create_task(ctx.lifecycle.warm_up(
            lambda request: routes_systemone.answer(ctx, request, {}, {}, warm_up=True)))
        yield
        warm.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await warm
        await asyncio.get_running_loop().run_in_executor(None, ctx.batcher.close)  # answers what is queued

    return lifespan


async def _internal_error(request: Any, exc: Exception):
    log.exception("unhandled error on %s", request.url.path)
    return error_response(PredictError("body", f"internal error: {type(exc).__name__}", status=500))


SERVE_ENV = "RLCD_SERVE_CONFIG"
# Keep idle connections open longer than clients do (httpx expires them after 5 s, uvicorn's default is also
# 5 s): with equal timeouts a client reuses a connection the server is closing, and the request fails
# (measured: 14 read errors in 1,000 requests at 64 in flight). 75 s is nginx's default.
KEEP_ALIVE_S = 75
PREPARE_THREADS = max(4, 2 * (os.cpu_count() or 1))


def app_from_env():
    """The app a uvicorn worker builds (`rlcd serve --workers N`): its config comes in `RLCD_SERVE_CONFIG`,
    its API key in `RLCD_API_KEY` (the environment, not a command line `ps` shows)."""
    from .device import Placement

    cfg = json.loads(os.environ[SERVE_ENV])
    placement = Placement(**cfg["placement"]) if cfg.get("placement") else None
    lim = Limits(**cfg["limits"])
    predictor = load_predictor(Path(cfg["run"]), portable=bool(cfg.get("portable")), limits=lim, placement=placement,
                               name=cfg.get("name"), strict_model=bool(cfg.get("strict_model")),
                               state_cache_mb=cfg.get("state_cache_mb", DEFAULT_STATE_CACHE_MB),
                               order_votes=int(cfg.get("order_votes", 1)), threads=cfg.get("threads"),
                               canonical=bool(cfg.get("canonical", True)),
                               vote_combine=cfg.get("vote_combine", "logmean"),
                               row_cache_mb=cfg.get("row_cache_mb", 0))
    return create_app(predictor, image_root=cfg.get("image_root"), limits=lim,
                      batching=BatchingConfig(**cfg["batching"]), api_key=os.environ.get(access.API_KEY_ENV) or None,
                      access_log=cfg.get("access_log") or None, thresholds=cfg.get("thresholds"))


def load_predictor(path: Path, *, portable: bool = False, placement: Any = None,
                   state_cache_mb: float = DEFAULT_STATE_CACHE_MB, threads: int | None = None, **kw: Any) -> Predictor:
    """The Predictor of a run's export (torch), or with `portable` of a portable ONNX export directory
    (`rlcd.portable.runtime`: onnxruntime + tokenizers + numpy, torch never imported; no state cache: its
    graph takes whole packed rows, not a decoder state). `threads`: torch's intra-op threads, or onnxruntime's
    intra-op and inter-op threads (None: torch's default for both, `rlcd.portable.runtime.default_threads`)."""
    if portable:
        from .portable.runtime import load_portable

        kw.pop("row_cache_mb", None)  # its graph takes whole packed rows: no features to keep either
        return load_portable(path, threads=threads, **kw)
    if threads is not None:
        import torch

        torch.set_num_threads(int(threads))
    return Predictor.from_run(path, placement=placement, state_cache_mb=state_cache_mb, **kw)


def default_thresholds(run: Path | str) -> Path | None:
    """RUN/eval/thresholds.json when `run` is a run directory that has one (what `rlcd gate` writes)."""
    path = Path(run) / "eval" / "thresholds.json"
    return path if path.is_file() else None


def serve(run: Path | str, host: str = "127.0.0.1", port: int = 8000, image_root: Path | str | None = None,
          log_level: str = "info", placement: Any = None, served_model_name: str | None = None,
          strict_model: bool = False, batching: BatchingConfig | None = None, workers: int = 1,
          api_key: str | None = None, quiet: bool = False, thresholds: Path | str | None = None,
          access_log: str = "text", state_cache_mb: float = DEFAULT_STATE_CACHE_MB, portable: bool = False,
          order_votes: int = 1, threads: int | None = None, canonical: bool = True, vote_combine: str = "logmean",
          row_cache_mb: float = 0, **limits: Any) -> None:
    """Load `run`'s export and serve it with uvicorn until interrupted.

    `api_key`: required on /v1/* and /drain (binding a non-loopback host without one prints a warning).
    `access_log`: "text" (logfmt) or "json", one line per request; `quiet`: none (uvicorn's own access log is always
    off: rlcd's line replaces it).
    `thresholds`: the thresholds.json `x_gate` requests are gated with (default: RUN/eval/thresholds.json, if any).
    `state_cache_mb`: each process's state cache (`Predictor`; 0 turns it off; a portable export has none).
    `portable`: `run` is a portable ONNX export directory (`rlcd export --format onnx`), served without torch.
    `order_votes`: each choice question also asked in N-1 other option orders, answered on the mean probabilities
    (`Predictor`; 1: off), combined by `vote_combine` ("logmean" or "mean", `rlcd.order_votes.combine`).
    `threads`: the model's CPU threads (`load_predictor`).
    `canonical`: canonical requests (`Predictor`, `rlcd.serving.canonical`; False: every question asked as sent).
    `row_cache_mb`: each process's row cache of answered rows (`rlcd.serving.state_encoding`; 0, the default: off).

    `workers` > 1 runs that many uvicorn worker processes (uvicorn's own process manager), each with its
    own copy of the model: memory grows by one model per worker; throughput by up to one model's per
    worker on as many cores / devices.
    """
    import uvicorn

    from .serving.transport import NoDelayH11Protocol

    lim = Limits().with_(**limits)
    batching = batching or BatchingConfig()
    fmt = None if quiet else access_format(access_log)
    thresholds = thresholds if thresholds is not None else default_thresholds(run)
    gates = Gates.load(thresholds) if thresholds is not None else None  # a bad file fails before the model loads
    if api_key is not None:
        access.check_api_key(api_key)
    elif not access.is_loopback(host):
        print(access.exposed_warning(host), file=sys.stderr, flush=True)
    server_kw = dict(host=host, port=port, log_level=log_level, timeout_graceful_shutdown=int(batching.timeout_s),
                     timeout_keep_alive=KEEP_ALIVE_S, http=NoDelayH11Protocol, access_log=False)
    if workers > 1:
        if api_key is not None:  # inherited by the worker processes; never on a command line
            os.environ[access.API_KEY_ENV] = api_key
        else:
            os.environ.pop(access.API_KEY_ENV, None)
        os.environ[SERVE_ENV] = json.dumps({"access_log": fmt,
            "run": str(Path(run).resolve()), "placement": placement.to_dict() if placement is not None else None,
            "limits": lim.to_dict(), "batching": batching.to_dict(), "name": served_model_name,
            "strict_model": strict_model, "portable": portable,
            "image_root": str(image_root) if image_root is not None else None, "state_cache_mb": state_cache_mb,
            "order_votes": order_votes, "threads": threads, "canonical": canonical, "vote_combine": vote_combine,
            "row_cache_mb": row_cache_mb,
            "thresholds": str(Path(thresholds).resolve()) if thresholds is not None else None})
        uvicorn.run("rlcd.server:app_from_env", factory=True, workers=workers, **server_kw)
        return
    predictor = load_predictor(Path(run), portable=portable, limits=lim, placement=placement, name=served_model_name,
                               strict_model=strict_model, state_cache_mb=state_cache_mb, order_votes=order_votes,
                               threads=threads, canonical=canonical, vote_combine=vote_combine,
                               row_cache_mb=row_cache_mb)
    app = create_app(predictor, image_root=image_root, limits=lim, batching=batching, api_key=api_key,
                     access_log=fmt, thresholds=gates)
    uvicorn.run(app, **server_kw)


__all__ = ["create_app", "serve", "parse_body", "decode_base64_image", "resolve_image_path", "load_request_image"]
