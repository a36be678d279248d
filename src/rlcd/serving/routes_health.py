"""`GET /health` (liveness), `GET /ready` (readiness) and `POST /drain` (out of rotation): `rlcd.serving.lifecycle`.

None of them is in the OpenAPI document but /health: /ready and /drain are for the operator and the load balancer,
not API clients, and a schema fuzzer must not drain the server it fuzzes. /drain needs the API key when the server
has one (`rlcd.serving.access.is_protected`).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from rlcd.serving.context import ServerContext


def router(ctx: ServerContext) -> APIRouter:
    r = APIRouter()

    @r.get("/health")
    @r.get("/healthz", include_in_schema=False)
    def health() -> dict:
        return {"status": "ok", "model": ctx.predictor.name}

    @r.get("/ready", include_in_schema=False)
    def ready():
        """200 when the model is loaded and warm and the server is not draining; 503 with the reason otherwise."""
        ok, why = ctx.lifecycle.readiness()
        body = {"ready": ok, "model": ctx.predictor.name, **({} if ok else {"reason": why})}
        return JSONResponse(body, status_code=200 if ok else 503)

    @r.post("/drain", include_in_schema=False)
    async def drain():
        """Refuse new /v1 requests, wait (at most the request timeout) for those in flight: 200 once none is left,
        202 with the count when some still run. /ready stays 503 from the first call on."""
        left = await ctx.lifecycle.drain(ctx.batching.timeout_s)
        return JSONResponse({"status": "drained" if left == 0 else "draining", "in_flight": left},
                            status_code=200 if left == 0 else 202)

    return r


__all__ = ["router"]
