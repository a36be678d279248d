"""The OpenAPI document (`/openapi.json`, `/docs`): FastAPI's, completed with what it cannot see.

Why by hand: /v1/systemone parses its body itself (exact 4xx errors naming the field, compressed and multipart
bodies), so FastAPI knows neither its request schema nor its error answers; the API key is checked in a middleware,
and the request-id headers are added to every answer there. The document is the contract `tests/test_fuzz_server.py`
fuzzes against, so what is added here is what the server does.
"""

from __future__ import annotations

from typing import Any, Callable

from rlcd.serving import access
from rlcd.serving.request import MAX_ASSETS


def systemone_body() -> dict[str, Any]:
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


def declare_bearer(schema: dict[str, Any]) -> None:
    """The bearer scheme in the OpenAPI document, on every /v1 operation (with its 401)."""
    schema["components"].setdefault("securitySchemes", {})[access.BEARER] = {
        "type": "http", "scheme": "bearer", "description": f"the server's API key (--api-key / {access.API_KEY_ENV})"}
    for path, ops in schema.get("paths", {}).items():
        if access.is_protected(path):
            for op in ops.values():
                op["security"] = [{access.BEARER: []}]
                op.setdefault("responses", {})["401"] = {"description": "no or a wrong API key", "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/AuthErrorResponse"}}}}


def declare_request_ids(schema: dict[str, Any]) -> None:
    """The request-id headers in the OpenAPI document: optional on every request, present on every response."""
    sent = "the client's id for this request; either header, echoed in both response headers (a new id when absent)"
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            op.setdefault("parameters", []).extend(
                {"name": name, "in": "header", "required": False, "schema": {"type": "string"}, "description": sent}
                for name in access.REQUEST_ID_HEADERS)
            for response in op.get("responses", {}).values():
                response.setdefault("headers", {}).update(
                    {name: {"required": True, "schema": {"type": "string"}, "description": "the request id"}
                     for name in access.REQUEST_ID_HEADERS})


def openapi_builder(app: Any, api_key: str | None) -> Callable[[], dict[str, Any]]:
    """`app.openapi`: the document built once, on first use (FastAPI's, plus the schemas and headers above)."""
    from fastapi.openapi.utils import get_openapi

    from rlcd.serving import wire

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version="1", summary=app.summary, routes=app.routes)
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (wire.SystemOneRequest, wire.ErrorResponse, wire.AuthErrorResponse):
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(js.pop("$defs", {}))
                comps[model.__name__] = js
            if api_key is not None:
                declare_bearer(schema)
            declare_request_ids(schema)  # after the bearer scheme: its 401 carries them too
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


__all__ = ["systemone_body", "declare_bearer", "declare_request_ids", "openapi_builder"]
