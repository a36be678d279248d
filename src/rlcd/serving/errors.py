"""`PredictError`: a request that breaks a rule, with the HTTP status the server answers with."""

from __future__ import annotations

from typing import Any

from rlcd.schema import RecordError


# the error `type` per HTTP status (FastAPI uses pydantic's error types; these name ours)
ERROR_TYPES = {400: "invalid_input", 403: "forbidden_path", 404: "not_found", 413: "too_large", 415: "unsupported_encoding",
               422: "value_error", 503: "overloaded", 504: "timeout"}


class PredictError(RecordError):
    """A request broke a rule. `field` is a path into the request, `question` the question id (or None).

    `status` is the HTTP status the server answers with (422 unless the rule says otherwise:
    413 for size limits, 404 for an unknown model, 400 for undecodable input). `kind` overrides the error
    `type` the status implies (`json_invalid` for a body that is not JSON, FastAPI's name for it).
    """

    def __init__(self, field: str, message: str, *, question: str | None = None, status: int = 422,
                 kind: str | None = None):
        self.question = question
        self.message = message
        self.status = int(status)
        self.kind = kind
        super().__init__(question, field, message)

    def to_json(self) -> dict[str, Any]:
        """FastAPI's / transformers' error body: {"detail": [{"loc", "msg", "type"}]} (+ rlcd's "question")."""
        loc = ["body", *self.field.split(".")] if self.field not in ("body", "request") else ["body"]
        item: dict[str, Any] = {"loc": loc, "msg": self.message,
                                "type": self.kind or ERROR_TYPES.get(self.status, "value_error")}
        if self.question is not None:
            item["question"] = self.question
        return {"detail": [item]}

    def __str__(self) -> str:
        where = f"question {self.question!r}: " if self.question is not None else ""
        return f"{where}field {self.field!r}: {self.message}"
