"""`PredictError`: a request that breaks a rule, with the HTTP status the server answers with."""

from __future__ import annotations

from typing import Any

from rlcd.schema import RecordError


class PredictError(RecordError):
    """A request broke a rule. `field` is a path into the request, `question` the question id (or None).

    `status` is the HTTP status the server answers with (422 unless the rule says otherwise:
    413 for size limits, 404 for an unknown model, 400 for undecodable input).
    """

    def __init__(self, field: str, message: str, *, question: str | None = None, status: int = 422):
        self.question = question
        self.message = message
        self.status = int(status)
        super().__init__(question, field, message)

    def to_json(self) -> dict[str, Any]:
        err: dict[str, Any] = {"field": self.field, "message": self.message}
        if self.question is not None:
            err["question"] = self.question
        return {"error": err}

    def __str__(self) -> str:
        where = f"question {self.question!r}: " if self.question is not None else ""
        return f"{where}field {self.field!r}: {self.message}"
