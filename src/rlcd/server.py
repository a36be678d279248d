"""HTTP server speaking `/v1/systemone` (FastAPI + uvicorn).

Endpoints:

* `POST /v1/systemone`: a request `{"model"?, "state", "questions", "image"?}` -> the Predictor's
  response. The image is `{"base64": "..."}` (a `data:image/...;base64,` prefix is accepted) or
  `{"path": "relative/path.png"}`, resolved under the configured image root only: absolute paths,
  `..` segments and symlinks that lead outside the root are refused, and without an image root
  every path is refused.
* `GET /healthz`: `{"status": "ok", "model": name}`.
* `GET /v1/models`: `{"object": "list", "data": [model info incl. temperatures and limits]}`.

Every bad input gets a 4xx JSON body `{"error": {"field": ..., "message": ...}}` (plus `question`
when one question is at fault): 400 undecodable input (JSON, base64, image bytes), 403 an image
path outside the root, 404 unknown model / image file / route, 405 wrong method, 413 size limits
(body bytes -- the `Content-Length` header and the bytes actually received --, questions,
candidates, tokens, image pixels), 422 rule violations. An unexpected failure is a 500 with the
same JSON shape, and the server keeps serving.

Concurrency: one model, requests serialised by the Predictor's lock. Body parsing, validation and
image decoding run in worker threads outside the lock; only the model call is serialised.
"""

import json
import logging
from pathlib import Path
from typing import Any

from .predict import Predictor
from .serving.errors import PredictError
from .serving.images import decode_base64_image, load_request_image, resolve_image_path  # noqa: F401 (API)
from .serving.limits import Limits

log = logging.getLogger("rlcd.server")


def _err(status: int, field: str | None, message: str, question: str | None = None):
    from fastapi.responses import JSONResponse

    body: dict[str, Any] = {"field": field, "message": message}
    if question is not None:
        body["question"] = question
    return JSONResponse({"error": body}, status_code=status)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def parse_body(body: bytes) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity, no duplicate keys. PredictError(400) otherwise."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PredictError("body", f"is not UTF-8 ({e.reason} at byte {e.start})", status=400) from None
    if not text.strip():
        raise PredictError("body", "is empty; send a JSON object", status=400)
    try:
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise PredictError("body", f"is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})",
                           status=400) from None
    except ValueError as e:
        raise PredictError("body", f"is not valid JSON: {e}", status=400) from None
    except RecursionError:
        raise PredictError("body", "is nested too deeply", status=400) from None


def create_app(predictor: Predictor, *, image_root: Path | str | None = None, limits: Limits | None = None):
    """The FastAPI app around one Predictor (see the module docstring)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException

    limits = limits or predictor.limits
    root: Path | None = None
    if image_root is not None:
        root = Path(image_root).expanduser().resolve()
        if not root.is_dir():
            raise ValueError(f"image root {image_root} is not a directory")

    app = FastAPI(title="rlcd", summary="Calibrated typed decisions over /v1/systemone", docs_url=None,
                  redoc_url=None)
    app.state.predictor = predictor
    app.state.limits = limits
    app.state.image_root = root

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _err(exc.status_code, None, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return _err(422, "request", str(exc))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return _err(500, None, f"internal error: {type(exc).__name__}")

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok", "model": predictor.name}

    @app.get("/v1/models")
    def models() -> dict:
        info = predictor.info()
        info["limits"] = limits.to_dict()
        info["image_root"] = root is not None
        return {"object": "list", "data": [info]}

    def answer(obj: Any) -> dict:
        if not isinstance(obj, dict):
            raise PredictError("body", f"must be a JSON object, got {type(obj).__name__}", status=400)
        obj = dict(obj)
        image = load_request_image(obj.pop("image", None), root, limits)
        return predictor.predict(obj, image, limits=limits)

    @app.post("/v1/systemone")
    async def systemone(request: Request):
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
            obj = await run_in_threadpool(parse_body, bytes(body))
            return await run_in_threadpool(answer, obj)
        except PredictError as e:
            return _err(e.status, e.field, e.message, e.question)
        except Exception as e:  # a bug, not bad input: report it and keep serving
            log.exception("unhandled error in /v1/systemone")
            return _err(500, None, f"internal error: {type(e).__name__}: {e}")

    return app


def serve(run: Path | str, host: str = "127.0.0.1", port: int = 8000, image_root: Path | str | None = None,
          log_level: str = "info", placement: Any = None, **limits: Any) -> None:
    """Load `run`'s export and serve it with uvicorn until interrupted."""
    import uvicorn

    lim = Limits().with_(**limits)
    predictor = Predictor.from_run(Path(run), limits=lim, placement=placement)
    app = create_app(predictor, image_root=image_root, limits=lim)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


__all__ = ["create_app", "serve", "parse_body", "decode_base64_image", "resolve_image_path", "load_request_image"]
