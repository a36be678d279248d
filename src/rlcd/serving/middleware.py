"""What every request goes through, around its route: the request id, the API key, the drain, the in-flight count,
the latency metric and the access log line.

Why one middleware and not several: each step needs what an earlier one decided (the id for the log line, the
status for the metric, whether the request was admitted for the in-flight count), and one `try/finally` makes sure
a request that raises is still logged, measured and counted out. Order: the key is checked first (a refused client
learns nothing about the server's state), then a draining server refuses /v1 requests with 503 + Retry-After.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from rlcd.serving import access
from rlcd.serving.context import ServerContext, error_response
from rlcd.serving.lifecycle import Draining
from rlcd.serving.server_metrics import OTHER_ROUTE


def request_id(request: Any) -> str:
    """The client's id from either header (control characters as `_`), else a new one."""
    sent = request.headers.get("x-request-id") or request.headers.get(access.TYPESAFE_REQUEST_ID)
    return access.echoed_request_id(sent) or uuid.uuid4().hex


def auth_refusal(ctx: ServerContext, request: Any) -> Any:
    """The 401 for a protected path without the key, in the official API's shape (transformers serve has no key);
    None when the request may go on."""
    from fastapi.responses import JSONResponse

    if ctx.api_key is None or not access.is_protected(request.url.path):
        return None
    refused = access.refusal(request.headers.get("authorization"), ctx.api_key)
    if refused is None:
        return None
    return JSONResponse({"detail": {"error_type": "authentication_error", "message": refused}}, status_code=401,
                        headers={"WWW-Authenticate": "Bearer"})


def install(app: Any, ctx: ServerContext, paths: set[str]) -> None:
    """Add the middleware to `app`; `paths` are its routes' paths, the latency metric's `route` label (any other
    path is `other`, so requests for made-up paths cannot grow the label set)."""

    def route_of(path: str) -> str:
        return path if path in paths else OTHER_ROUTE

    @app.middleware("http")
    async def frame(request, call_next):
        t0 = time.perf_counter()
        rid = request_id(request)
        path = request.url.path
        status, admitted = 500, False  # logged as a 500 should the app raise
        try:
            response = auth_refusal(ctx, request)
            if response is None and access.is_api(path):
                try:
                    ctx.lifecycle.admit()
                    admitted = True
                except Draining as e:
                    response = error_response(e)
            if response is None:
                response = await call_next(request)
            response.headers["X-Request-ID"] = rid  # transformers' header
            response.headers[access.TYPESAFE_REQUEST_ID] = rid  # the official SDK's (`response.request_id`)
            status = response.status_code
            return response
        finally:
            if admitted:
                ctx.lifecycle.done()
            seconds = time.perf_counter() - t0
            ctx.metrics.observe_request(route_of(path), status, seconds)
            if ctx.access_log:
                seen = getattr(request.state, "rlcd", {})  # filled by /v1/systemone
                access.write_access(access.access_record(
                    ctx.access_log, rid=rid, client=request.client.host if request.client else None,
                    method=request.method, path=path, status=status, total_ms=seconds * 1000, **seen))


__all__ = ["install", "request_id", "auth_refusal"]
