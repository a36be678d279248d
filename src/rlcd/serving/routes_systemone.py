"""`POST /v1/systemone`: read the body under the size limit, prepare the request, score it in a batch, answer.

Why the steps run where they do: the body is read on the event loop (it only waits on the socket); decoding, parsing,
tokenisation and image decoding run in the worker pool (`run_in_threadpool`); the model runs in the batcher's one
thread, awaited through a future, so the event loop never blocks on it. `answer` is also the warm-up's path
(`rlcd.serving.lifecycle`), so the first real request finds a warm model.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from rlcd.serving import wire
from rlcd.serving.bodies import read_request
from rlcd.serving.context import ServerContext, error_response
from rlcd.serving.errors import PredictError
from rlcd.serving.limits import Limits
from rlcd.serving.openapi import systemone_body

log = logging.getLogger("rlcd.server")


async def read_body(request: Any, limits: Limits) -> bytes:
    """The raw body, refused (413) past `max_request_bytes` by its Content-Length or by the bytes received."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise PredictError("Content-Length", "is not an integer", status=400) from None
        if n > limits.max_request_bytes:
            raise PredictError("body", f"Content-Length {n} is more than max_request_bytes={limits.max_request_bytes}",
                               status=413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limits.max_request_bytes:
            raise PredictError("body", f"more than max_request_bytes={limits.max_request_bytes} bytes received",
                               status=413)
    return bytes(body)


async def answer(ctx: ServerContext, obj: Any, seen: dict[str, Any], parts: dict[str, bytes], *,
                 warm_up: bool = False) -> tuple[Any, dict]:
    """(prepared, response) for a decoded request; `seen` gets what the access log reports. `warm_up`: not counted
    in the batcher's stats and metrics, and not bound by the request timeout (a first forward may be slow)."""
    p, batcher = ctx.predictor, ctx.batcher
    with batcher.arriving():  # the batcher waits its window only while requests are on their way
        prepared = await run_in_threadpool(p.prepare, obj, image_root=ctx.image_root, limits=ctx.limits, parts=parts)
        seen["questions"] = len(prepared.request.qids)
        if prepared.request.gate and ctx.gates is None:
            raise PredictError("x_gate", "this server has no thresholds.json to gate with: run `rlcd gate RUN` "
                                         "(or `rlcd evaluate RUN`), or start it with --thresholds FILE")
        if prepared.case is None:  # every question has one option: fixed answers, no model
            seen.update(input_tokens=0, queue_ms=0.0, model_ms=0.0)
            return prepared, _gated(ctx, prepared, p.respond(prepared, [], {"input_tokens": 0}))
        future = batcher.submit(prepared, counted=not warm_up)
    try:
        logits, usage = await asyncio.wait_for(asyncio.wrap_future(future), None if warm_up else ctx.batching.timeout_s)
    except asyncio.TimeoutError:
        raise batcher.timed_out(future) from None
    seen.update(input_tokens=int(usage["input_tokens"]), queue_ms=future.queue_s * 1000, model_ms=future.model_s * 1000)
    return prepared, _gated(ctx, prepared, p.respond(prepared, logits, usage))


def _gated(ctx: ServerContext, prepared: Any, response: dict) -> dict:
    r = prepared.request
    return ctx.gates.annotate(response, r.qids, r.questions) if r.gate and ctx.gates is not None else response


def router(ctx: ServerContext) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/systemone", response_model=wire.SystemOneResponse, response_model_exclude_none=True,
            openapi_extra=systemone_body())
    async def systemone(request: Request):
        request.state.rlcd = seen = {}  # what the access log line reports
        try:
            body = await read_body(request, ctx.limits)
            obj, parts = await run_in_threadpool(read_request, body, request.headers.get("content-encoding"),
                                                 request.headers.get("content-type"), ctx.limits)
            prepared, response = await answer(ctx, obj, seen, parts)
            ctx.metrics.observe_answers(prepared.request.qids, prepared.request.questions, response)
            return response
        except PredictError as e:
            return error_response(e)
        except Exception as e:  # a bug, not bad input: report it and keep serving
            log.exception("unhandled error in /v1/systemone")
            return error_response(PredictError("body", f"internal error: {type(e).__name__}: {e}", status=500))

    return r


__all__ = ["router", "answer", "read_body"]
