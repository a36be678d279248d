"""`GET /v1/models`: the served model, in both client families' shapes in one object.

Why both: transformers' (OpenAI's) clients read `{"object": "list", "data": [{id, ...}]}`, the official System One
SDK reads `{"models": [{name, description, release_date}]}`; one object with both lets either list the model.
"""

from __future__ import annotations

from fastapi import APIRouter

from rlcd.serving import wire

from rlcd.serving.context import ServerContext


def router(ctx: ServerContext) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models", response_model=wire.ModelList)
    def models() -> dict:
        """Both clients' shapes in one object: transformers' (OpenAI's) `object`/`data`, the official SDK's `models`."""
        p = ctx.predictor
        info = p.info()
        info.update({"created": ctx.started, "owned_by": "rlcd", "limits": ctx.limits.to_dict(),
                     "image_root": ctx.image_root is not None, "batching": ctx.batcher.stats(),
                     "thresholds": ctx.gates.source if ctx.gates is not None else None})
        lic = info.get("license")
        terms = f"; backbone weights under the {lic['name']}" if isinstance(lic, dict) and lic.get("name") else ""
        card = {"name": p.name, "release_date": ctx.release_date,
                "description": f"rlcd typed-decision model on {info.get('backbone')} (choice, noul and score; "
                               f"calibrated per type{terms})"}
        return {"object": "list", "data": [info], "models": [card]}

    return r


__all__ = ["router"]
