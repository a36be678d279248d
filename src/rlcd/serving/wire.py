"""Pydantic models of the System One wire format, for the OpenAPI document (`/openapi.json`, `/docs`).

Validation itself is `rlcd.serving.request.parse_request` (rule-by-rule errors naming the field and
the HTTP status); these models describe the same shapes for clients and code generators.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

Content = Union[str, dict[str, Any], list[Any]]


class ChoiceQuestion(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["choice"]
    instructions: Optional[Content] = None
    criteria: Union[dict[str, Optional[Content]], list[str]] = Field(
        description="{label: description or null} (transformers) or [label, ...] (rlcd)")


class NoulQuestion(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["noul"]
    instructions: Optional[Content] = None
    criteria: Optional[dict[Literal["true", "false"], Optional[Content]]] = None


class ScoreQuestion(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["score"]
    instructions: Optional[Content] = None
    criteria: list[Content] = Field(description="the levels, lowest first")


class SystemOneRequest(BaseModel):
    """A System One request, as `transformers serve` takes it (plus rlcd's optional `model` and `image`)."""

    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = Field(None, description="echoed back; checked only with --strict-model")
    state: Union[str, dict[str, Any], list[Any]]
    questions: dict[str, Union[ChoiceQuestion, NoulQuestion, ScoreQuestion]] = Field(min_length=1)
    assets: dict[str, dict[str, Any]] = Field(default_factory=dict, max_length=4, description=(
        'images keyed by placeholder: {"type": "image", "format": "png", "data_base64": ...} or {"path": ...}'))
    image: Optional[dict[str, str]] = Field(None, description='rlcd alias: {"base64": ...} or {"path": ...}')


class ChoiceAnswer(BaseModel):
    type: Literal["choice"]
    choice: str
    confidence: float = Field(description="(p_max - 1/K) / (1 - 1/K)")
    probabilities: dict[str, float]


class NoulAnswer(BaseModel):
    type: Literal["noul"]
    noul: float = Field(description="P(true)")


class ScoreAnswer(BaseModel):
    type: Literal["score"]
    score: float = Field(description="expected level")
    legend: dict[str, Any]
    confidence: float = Field(description="1 - E|level - argmax| / E_uniform|level - middle|")
    probabilities: dict[str, float]


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int = 0
    images: int = 0


class SystemOneResponse(BaseModel):
    model: str
    answers: dict[str, Union[ChoiceAnswer, NoulAnswer, ScoreAnswer]]
    usage: Usage
    warnings: Optional[list[str]] = None


class ErrorItem(BaseModel):
    loc: list[Union[str, int]]
    msg: str
    type: str
    question: Optional[str] = None


class ErrorResponse(BaseModel):
    detail: list[ErrorItem]


class ModelCard(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
