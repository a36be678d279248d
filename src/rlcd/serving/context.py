"""What the route families share: one `ServerContext` per app, and the JSON error answer.

Why a context object: each route family (`routes_systemone`, `routes_models`, `routes_health`, `routes_metrics`) and
the middleware read the same predictor, batcher, limits, gates, lifecycle and metrics; passing one object keeps each
family readable on its own instead of as closures inside one long `create_app`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcd.serving.batcher import Batcher, BatchingConfig
from rlcd.serving.errors import PredictError
from rlcd.serving.gating import Gates
from rlcd.serving.lifecycle import Lifecycle
from rlcd.serving.limits import Limits
from rlcd.serving.server_metrics import ServerMetrics


@dataclass
class ServerContext:
    """One app's state. `predictor` is duck-typed (`rlcd.predict.Predictor`: prepare, respond, info, name), since
    `rlcd.serving` sits below `rlcd.predict`."""

    predictor: Any
    batcher: Batcher
    batching: BatchingConfig
    limits: Limits
    image_root: Path | None
    gates: Gates | None
    lifecycle: Lifecycle
    metrics: ServerMetrics
    api_key: str | None
    access_log: str | None  # "text", "json" or None (off)
    started: int  # unix time, /v1/models' `created`
    release_date: str


def error_response(e: PredictError) -> Any:
    """The JSON answer of a PredictError (`Retry-After` on a 503 that has a retry hint)."""
    from fastapi.responses import JSONResponse

    retry_after = getattr(e, "retry_after", None)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(e.to_json(), status_code=e.status, headers=headers)


__all__ = ["ServerContext", "error_response"]
