"""Pydantic models of the System One wire format, for the OpenAPI document (`/openapi.json`, `/docs`).

Validation itself is `rlcd.serving.request.parse_request` (rule-by-rule errors naming the field and
the HTTP status); these models describe the same shapes for clients and code generators.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from rlcd.schema import MAX_CANDIDATES
from rlcd.serving.request import MAX_QID_CHARS

Content = Union[str, dict[str, Any], list[Any]]
# a description or a score level: text, content, or any other JSON value, which the prompt reads as its JSON text
# (`5` reads "5", null "null"), as rlcd.serving.request parses it
Description = Optional[Union[str, dict[str, Any], list[Any], float, bool]]
# the counts and lengths rlcd.serving.request enforces (labels must also not be blank; a server's --max-candidates
# may be lower than the format's MAX_CANDIDATES: a 413)
Labels = Union[Annotated[dict[str, Description], Field(min_length=1, max_length=MAX_CANDIDATES,
                                                        json_schema_extra={"propertyNames": {"minLength": 1}})],
               Annotated[list[Annotated[str, Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_CANDIDATES, json_schema_extra={"uniqueItems": True})]]


class ChoiceQuestion(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["choice"]
    instructions: Optional[Content] = None
    criteria: Labels = Field(description="{label: description or null} (transformers) or [label, ...] (rlcd); "
                                         f"1..{MAX_CANDIDATES} unique labels, not blank")


class NoulQuestion(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["noul"]
    instructions: Optional[Content] = None
    criteria: Optional[dict[Literal["true", "false"], Description]] = None


class ScoreQuestion(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["score"]
    instructions: Optional[Content] = None
    criteria: list[Description] = Field(min_length=1, max_length=MAX_CANDIDATES, description=(
        'the levels, lowest first; a null level (transformers accepts it) reads as "null" and shows so in the legend'))


class ImageBase64(BaseModel):
    model_config = ConfigDict(extra="forbid")
    base64: str = Field(min_length=1, description="the image bytes in base64, or a data URL")


class ImagePath(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1, description="a path under the server's --image-root")


class SystemOneRequest(BaseModel):
    """A System One request, as `transformers serve` takes it (plus rlcd's optional `model` and `image`).

    Other top-level fields are ignored, as the official API does (`stream` and `temperature` excepted: a 422). rlcd's extension:
    `"x_gate": true` adds each answer's gate decision from the run's thresholds.json. The same JSON may come
    as the `request` part of a multipart/form-data body whose assets name image parts (`{"part": "asset-0"}`)."""

    model_config = ConfigDict(extra="allow")
    model: Optional[str] = Field(None, description="echoed back; checked only with --strict-model")
    state: Union[str, dict[str, Any], list[Any]]
    questions: dict[str, Union[ChoiceQuestion, NoulQuestion, ScoreQuestion]] = Field(
        min_length=1, description=f"question id -> question; ids are 1..{MAX_QID_CHARS} characters, not blank",
        json_schema_extra={"propertyNames": {"minLength": 1, "maxLength": MAX_QID_CHARS}})
    assets: Optional[dict[str, dict[str, Any]]] = Field(default_factory=dict, max_length=4, description=(
        'images keyed by placeholder: {"type": "image", "format": "png", "data_base64": ...}, {"path": ...}, or '
        '{"type": "image", "part": "asset-0"} in a multipart body'))
    image: Optional[Union[ImageBase64, ImagePath]] = Field(
        None, description='rlcd alias: {"base64": ...} or {"path": ...}')


class GateDecision(BaseModel):
    decision: Optional[Literal["auto", "escalate"]] = Field(None, description="absent when no gate applies")
    confidence: Optional[float] = Field(None, description="choice/score confidence, noul |noul - 0.5| * 2; "
                                                          "for the response: the min over choice/score answers")
    threshold: Optional[float] = None
    gate: Optional[str] = Field(None, description="the thresholds.json entry used, e.g. questions.team")


class ChoiceAnswer(BaseModel):
    type: Literal["choice"]
    choice: str
    confidence: float = Field(description="(p_max - 1/K) / (1 - 1/K)")
    probabilities: dict[str, float]
    x_gate: Optional[GateDecision] = None


class NoulAnswer(BaseModel):
    type: Literal["noul"]
    noul: float = Field(description="P(true)")
    x_gate: Optional[GateDecision] = None


class ScoreAnswer(BaseModel):
    type: Literal["score"]
    score: float = Field(description="expected level")
    legend: dict[str, Any]
    confidence: float = Field(description="1 - E|level - argmax| / E_uniform|level - middle|")
    probabilities: dict[str, float]
    x_gate: Optional[GateDecision] = None


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int = 0
    images: int = 0


class SystemOneResponse(BaseModel):
    model: str
    answers: dict[str, Union[ChoiceAnswer, NoulAnswer, ScoreAnswer]]
    usage: Usage
    warnings: Optional[list[str]] = None
    x_gate: Optional[GateDecision] = Field(None, description="the row decision (with x_gate in the request)")


class ErrorItem(BaseModel):
    loc: list[Union[str, int]]
    msg: str
    type: str
    question: Optional[str] = None


class ErrorResponse(BaseModel):
    detail: list[ErrorItem]


class AuthError(BaseModel):
    error_type: Literal["authentication_error"]
    message: str


class AuthErrorResponse(BaseModel):
    """401: the official API's shape for errors that are not validation errors."""

    detail: AuthError


class ModelCard(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelMetadata(BaseModel):
    name: str
    description: str
    release_date: str = Field(description="YYYY-MM-DD: the day the export was written")


class ModelList(BaseModel):
    """transformers' (OpenAI's) list and the official SDK's `models` in one object; each client reads its own."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
    models: list[ModelMetadata]
