"""HTTP server speaking System One (`POST /v1/systemone`) as `transformers serve` does (FastAPI + uvicorn).

Endpoints:

* `POST /v1/systemone`: a System One request (see `rlcd.serving.request`: transformers' format, plus
  rlcd's `image` alias) -> `{"model", "answers", "usage": {"input_tokens", "output_tokens": 0,
  "images"}}`. Images come as `assets` (`data_base64`, or a `path` resolved under the configured image
  root only: absolute paths, `..` and symlinks leading outside are refused; without an image root every
  path is refused; URLs are refused, the server does not fetch) or as `image: {"base64"|"path"}`.
* `GET /health` and `GET /healthz`: `{"status": "ok", "model": name}`.
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
`WWW-Authenticate: Bearer` otherwise); `/health` stays open; the OpenAPI
document declares the bearer scheme. With `access_log`, each request writes one line on stderr
(`rlcd.serving.access.access_line`: request id, status, questions, input tokens, queue wait, model time).

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

import datetime
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from .predict import Predictor, Prepared
from .serving import access
from .serving.batcher import Batcher, BatchingConfig, Overloaded
from .serving.bodies import parse_body, read_request
from .serving.errors import PredictError
from .serving.gating import Gates
from .serving.images import decode_base64_image, load_request_image, resolve_image_path  # noqa: F401 (API)
from .serving.limits import Limits
from .serving.request import MAX_ASSETS

log = logging.getLogger("rlcd.server")


def _err(e: PredictError):
    from fastapi.responses import JSONResponse

    headers = {"Retry-After": str(e.retry_after)} if isinstance(e, Overloaded) else None
    return JSONResponse(e.to_json(), status_code=e.status, headers=headers)


def _openapi_body() -> dict[str, Any]:
    """The request body of /v1/systemone in the OpenAPI document (parsed by hand for exact 4xx errors)."""
    request = {"$ref": "#/components/schemas/SystemOneRequest"}
    multipart = {"type": "object", "required": ["request"], "additionalProperties": False, "properties": {
        "request": request, **{f"asset-{i}": {"type": "string", "format": "binary"} for i in range(MAX_ASSETS)}},
        "description": "the official SDK's image form: the JSON request, and image parts its assets name "
                       '({"type": "image", "part": "asset-0"})'}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": request},
                                                          "multipart/form-data": {"schema": multipart}},
                            "description": "Content-Encoding gzip or zstd is accepted (decoded size bounded by "
                                           "max_request_bytes)"},
        "responses": {str(code): {"description": why, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
            for code, why in ((400, "undecodable input"), (403, "image path outside the image root"),
                              (404, "unknown model (strict) or image file"), (413, "a size limit"),
                              (415, "an unsupported Content-Encoding"),
                              (422, "a rule of the request format, or a body that is not JSON"))}}


def _declare_bearer(schema: dict[str, Any]) -> None:
    """The bearer scheme in the OpenAPI document, on every /v1 operation (with its 401)."""
    schema["components"].setdefault("securitySchemes", {})[access.BEARER] = {
        "type": "http", "scheme": "bearer", "description": f"the server's API key (--api-key / {access.API_KEY_ENV})"}
    for path, ops in schema.get("paths", {}).items():
        if access.is_protected(path):
            for op in ops.values():
                op["security"] = [{access.BEARER: []}]
                op.setdefault("responses", {})["401"] = {"description": "no or a wrong API key", "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/AuthErrorResponse"}}}}


def _declare_request_ids(schema: dict[str, Any]) -> None:
    """The request-id headers in the OpenAPI document: optional on every request, present on every response."""
    sent = "the client's id for this request; either header, echoed in both response headers (a new id when absent)"
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            op.setdefault("parameters", []).extend(
                {"name": name, "in": "header", "required": False, "schema": {"type": "string"}, "description": sent}
                for name in REQUEST_ID_HEADERS)
            for response in op.get("responses", {}).values():
                response.setdefault("headers", {}).update(
                    {name: {"required": True, "schema": {"type": "string"}, "description": "the request id"}
                     for name in REQUEST_ID_HEADERS})


def create_app(predictor: Predictor, *, image_root: Path | str | None = None, limits: Limits | None = None,
               batching: BatchingConfig | None = None, api_key: str | None = None, access_log: bool = False,
               thresholds: Path | str | Gates | None = None):
    """The FastAPI app around one Predictor (see the module docstring).

    `api_key`: required as `Authorization: Bearer KEY` on every /v1/* request. `access_log`: one line per
    request on stderr. `thresholds`: a `thresholds.json` (path or loaded `Gates`) for requests with `x_gate`."""
    import asyncio
    import contextlib
    import time
    import uuid

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from fastapi.openapi.utils import get_openapi
    from starlette.concurrency import run_in_threadpool

    from .serving import wire

    limits = limits or predictor.limits
    if api_key is not None:
        access.check_api_key(api_key)
    root: Path | None = None
    if image_root is not None:
        root = Path(image_root).expanduser().resolve()
        if not root.is_dir():
            raise ValueError(f"image root {image_root} is not a directory")
    started = int(time.time())
    gates = thresholds if isinstance(thresholds, Gates) or thresholds is None else Gates.load(thresholds)
    release_date = getattr(predictor, "release_date", None) or datetime.datetime.fromtimestamp(
        started, datetime.timezone.utc).date().isoformat()
    batching = batching or BatchingConfig()
    batcher = Batcher(predictor.score_many, batching, size_of=Prepared.size)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        import anyio.to_thread

        # request parsing, tokenisation and image decoding run in worker threads: a few per core is plenty,
        # and each thread costs a malloc arena (resident memory that grows under load)
        anyio.to_thread.current_default_thread_limiter().total_tokens = PREPARE_THREADS
        yield
        await asyncio.get_running_loop().run_in_executor(None, batcher.close)  # answers what is queued

    app = FastAPI(title="rlcd", summary="Calibrated typed decisions over System One (/v1/systemone)",
                  lifespan=lifespan)
    app.state.predictor = predictor
    app.state.batcher = batcher
    app.state.limits = limits
    app.state.image_root = root
    app.state.gates = gates

    @app.middleware("http")
    async def request_id(request: Request, call_next):
        t0 = time.perf_counter()
        sent = request.headers.get("x-request-id") or request.headers.get(TYPESAFE_REQUEST_ID)
        rid = access.echoed_request_id(sent) or uuid.uuid4().hex
        refused = (access.refusal(request.headers.get("authorization"), api_key)
                   if api_key is not None and access.is_protected(request.url.path) else None)
        status = 500  # logged as such should the app raise
        try:
            if refused is not None:  # the official API's error shape (transformers serve has no key)
                response = JSONResponse({"detail": {"error_type": "authentication_error", "message": refused}},
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
            else:
                response = await call_next(request)
            response.headers["X-Request-ID"] = rid  # transformers' header
            response.headers[TYPESAFE_REQUEST_ID] = rid  # the official SDK's (`response.request_id`)
            status = response.status_code
            return response
        finally:
            if access_log:
                seen = getattr(request.state, "rlcd", {})  # filled by /v1/systemone
                access.write_access(access.access_line(
                    rid=rid, client=request.client.host if request.client else None, method=request.method,
                    path=request.url.path, status=status, total_ms=(time.perf_counter() - t0) * 1000, **seen))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return _err(PredictError("body", f"internal error: {type(exc).__name__}", status=500))

    @app.get("/health")
    @app.get("/healthz", include_in_schema=False)
    def health() -> dict:
        return {"status": "ok", "model": predictor.name}

    @app.get("/v1/models", response_model=wire.ModelList)
    def models() -> dict:
        """Both clients' shapes in one object: transformers' (OpenAI's) `object`/`data`, the official SDK's `models`."""
        info = predictor.info()
        info.update({"created": started, "owned_by": "rlcd", "limits": limits.to_dict(), "image_root": root is not None,
                     "batching": batcher.stats(), "thresholds": gates.source if gates is not None else None})
        card = {"name": predictor.name, "release_date": release_date,
                "description": f"rlcd typed-decision model on {info.get('backbone')} (choice, noul and score; "
                               "calibrated per type)"}
        return {"object": "list", "data": [info], "models": [card]}

    async def answer(obj: Any, seen: dict[str, Any], parts: dict[str, bytes]) -> dict:
        with batcher.arriving():  # the batcher waits its window only while requests are on their way
            prepared = await run_in_threadpool(predictor.prepare, obj, image_root=root, limits=limits, parts=parts)
            seen["questions"] = len(prepared.request.qids)
            if prepared.request.gate and gates is None:
                raise PredictError("x_gate", "this server has no thresholds.json to gate with: run `rlcd gate RUN` "
                                             "(or `rlcd evaluate RUN`), or start it with --thresholds FILE")
            if prepared.case is None:  # every question has one option: fixed answers, no model
                seen.update(input_tokens=0, queue_ms=0.0, model_ms=0.0)
                return gated(prepared, predictor.respond(prepared, [], {"input_tokens": 0}))
            future = batcher.submit(prepared)
        try:
            logits, usage = await asyncio.wait_for(asyncio.wrap_future(future), batching.timeout_s)
        except asyncio.TimeoutError:
            raise batcher.timed_out(future) from None
        seen.update(input_tokens=int(usage["input_tokens"]), queue_ms=future.queue_s * 1000,
                    model_ms=future.model_s * 1000)
        return gated(prepared, predictor.respond(prepared, logits, usage))

    def gated(prepared: Prepared, response: dict) -> dict:
        r = prepared.request
        return gates.annotate(response, r.qids, r.questions) if r.gate and gates is not None else response

    @app.post("/v1/systemone", response_model=wire.SystemOneResponse, response_model_exclude_none=True,
              openapi_extra=_openapi_body())
    async def systemone(request: Request):
        request.state.rlcd = seen = {}  # what the access log line reports
        try:
            declared = request.headers.get("content-length")
            if declared is not None:
                try:
                    n = int(declared)
                except ValueError:
                    raise PredictError("Content-Length", "is not an integer", status=400) from None
                if n > limits.max_request_bytes:
                    raise PredictError("body", f"Content-Length {n} is more than max_request_bytes="
                                               f"{limits.max_request_bytes}", status=413)
            body = bytearray()
            async for chunk in request.stream():
                body += chunk
                if len(body) > limits.max_request_bytes:
                    raise PredictError("body", f"more than max_request_bytes={limits.max_request_bytes} bytes "
                                               "received", status=413)
            obj, parts = await run_in_threadpool(read_request, bytes(body), request.headers.get("content-encoding"),
                                                 request.headers.get("content-type"), limits)
            return await answer(obj, seen, parts)
        except PredictError as e:
            return _err(e)
        except Exception as e:  # a bug, not bad input: report it and keep serving
            log.exception("unhandled error in /v1/systemone")
            return _err(PredictError("body", f"internal error: {type(e).__name__}: {e}", status=500))

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version="1", summary=app.summary, routes=app.routes)
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (wire.SystemOneRequest, wire.ErrorResponse, wire.AuthErrorResponse):
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(js.pop("$defs", {}))
                comps[model.__name__] = js
            if api_key is not None:
                _declare_bearer(schema)
            _declare_request_ids(schema)  # after the bearer scheme: its 401 carries them too
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


SERVE_ENV = "RLCD_SERVE_CONFIG"
TYPESAFE_REQUEST_ID = "x-typesafe-request-id"  # the official SDK reads the request id here
REQUEST_ID_HEADERS = ("X-Request-ID", TYPESAFE_REQUEST_ID)  # transformers' and the official SDK's
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
                               name=cfg.get("name"), strict_model=bool(cfg.get("strict_model")))
    return create_app(predictor, image_root=cfg.get("image_root"), limits=lim,
                      batching=BatchingConfig(**cfg["batching"]), api_key=os.environ.get(access.API_KEY_ENV) or None,
                      access_log=bool(cfg.get("access_log")), thresholds=cfg.get("thresholds"))


def load_predictor(path: Path, *, portable: bool = False, placement: Any = None, **kw: Any) -> Predictor:
    """The Predictor of a run's export (torch), or with `portable` of a portable ONNX export directory
    (`rlcd.portable.runtime`: onnxruntime + tokenizers + numpy, torch never imported)."""
    if portable:
        from .portable.runtime import load_portable

        return load_portable(path, **kw)
    return Predictor.from_run(path, placement=placement, **kw)


def default_thresholds(run: Path | str) -> Path | None:
    """RUN/eval/thresholds.json when `run` is a run directory that has one (what `rlcd gate` writes)."""
    path = Path(run) / "eval" / "thresholds.json"
    return path if path.is_file() else None


def serve(run: Path | str, host: str = "127.0.0.1", port: int = 8000, image_root: Path | str | None = None,
          log_level: str = "info", placement: Any = None, served_model_name: str | None = None,
          strict_model: bool = False, batching: BatchingConfig | None = None, workers: int = 1,
          api_key: str | None = None, quiet: bool = False, thresholds: Path | str | None = None,
          portable: bool = False, **limits: Any) -> None:
    """Load `run`'s export and serve it with uvicorn until interrupted.

    `api_key`: required on /v1/* (binding a non-loopback host without one prints a warning). `quiet`: no
    access log line per request (uvicorn's own access log is always off: rlcd's line replaces it).
    `thresholds`: the thresholds.json `x_gate` requests are gated with (default: RUN/eval/thresholds.json, if any).
    `portable`: `run` is a portable ONNX export directory (`rlcd export --format onnx`), served without torch.

    `workers` > 1 runs that many uvicorn worker processes (uvicorn's own process manager), each with its
    own copy of the model: memory grows by one model per worker; throughput by up to one model's per
    worker on as many cores / devices.
    """
    import uvicorn

    from .serving.transport import NoDelayH11Protocol

    lim = Limits().with_(**limits)
    batching = batching or BatchingConfig()
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
        os.environ[SERVE_ENV] = json.dumps({"access_log": not quiet,
            "run": str(Path(run).resolve()), "placement": placement.to_dict() if placement is not None else None,
            "limits": lim.to_dict(), "batching": batching.to_dict(), "name": served_model_name,
            "strict_model": strict_model, "portable": portable, "image_root": str(image_root) if image_root is not None else None,
            "thresholds": str(Path(thresholds).resolve()) if thresholds is not None else None})
        uvicorn.run("rlcd.server:app_from_env", factory=True, workers=workers, **server_kw)
        return
    predictor = load_predictor(Path(run), portable=portable, limits=lim, placement=placement, name=served_model_name,
                               strict_model=strict_model)
    app = create_app(predictor, image_root=image_root, limits=lim, batching=batching, api_key=api_key,
                     access_log=not quiet, thresholds=gates)
    uvicorn.run(app, **server_kw)


__all__ = ["create_app", "serve", "parse_body", "decode_base64_image", "resolve_image_path", "load_request_image"]
