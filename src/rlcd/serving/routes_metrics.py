"""`GET /metrics`: the app's Prometheus registry in the text exposition format (`rlcd.serving.server_metrics`).

Open like /health (a scraper holds no secret; no metric holds a request's content) and outside the OpenAPI document
(it is not the API). With `--workers N` a scrape reaches one worker and shows its counts only (prometheus-client's
multi-process mode is not used): run one process per port to see them all.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from rlcd.serving.context import ServerContext


def router(ctx: ServerContext) -> APIRouter:
    r = APIRouter()

    @r.get("/metrics", include_in_schema=False)
    def metrics():
        body, content_type = ctx.metrics.render()
        return Response(body, media_type=content_type)

    return r


__all__ = ["router"]
