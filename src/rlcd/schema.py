"""Typed-decision records and their validation rules.

Everything that crosses a stage boundary (importer -> prepare -> train -> evaluate -> serve) is one
of these pydantic models. Validation errors are turned into `RecordError`s that name the row id,
the field and the rule, so a user can fix the offending line.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, SerializationInfo, SerializerFunctionWrapHandler, ValidationError,
                      ValidationInfo, field_validator, model_serializer, model_validator)

from rlcd.errors import UserError

QuestionType = Literal["choice", "noul", "score"]
QUESTION_TYPES: tuple[str, ...] = ("choice", "noul", "score")
TYPE_ID = {t: i for i, t in enumerate(QUESTION_TYPES)}
SPLITS: tuple[str, ...] = ("train", "dev", "calibration", "test")
MIN_CANDIDATES, MAX_CANDIDATES = 2, 255
# A request may ask a one-option choice or a one-level score, as transformers' decision API allows (its
# answer is fixed: probability 1, confidence 1); records keep MIN_CANDIDATES, a one-option row teaches nothing.
REQUEST_MIN_CANDIDATES = 1
TARGET_SUM_TOL = 1e-4
RENORMALISED_TOL = 1e-12  # |sum - 1| of a renormalised vector is <= ~2e-16; within this, no second division

# Special tokens of the Qwen3.5 vocabulary (the default backbone): the data-level rule every record
# and request meets, so a prepared data set is valid for the default family. Each backbone's prompt
# encoder also rejects its own marker and special tokens (rlcd.model.families: SmolLM2's
# <|im_start|>, <repo_name>, ...), so the rule a model applies is its tokenizer's.
RESERVED_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)

JSONValue = Union[str, dict, list]


class RecordError(UserError, ValueError):
    """A row broke a rule. `row` is the record/question id, `field` the offending field."""

    def __init__(self, row: str | None, field: str, rule: str):
        self.row, self.field, self.rule = row, field, rule
        super().__init__(f"row {row!r}: field {field!r}: {rule}")


def text_of(value: Any) -> str:
    """The text a state / instruction / criteria value contributes to a prompt (JSON for objects, "" for None)."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return json.dumps(value, ensure_ascii=False)


def find_reserved(value: Any, tokens: tuple[str, ...] = RESERVED_TOKENS) -> str | None:
    """First of `tokens` (special-token texts) found anywhere inside `value` (str or JSON object), or None."""
    text = text_of(value) if not isinstance(value, str) else value
    for tok in tokens:
        if tok in text:
            return tok
    return None


def check_distribution(values: list[float], k: int, *, field: str, row: str | None) -> list[float]:
    """Validate a probability vector (length k, finite, >= 0, sums to 1 +- 1e-4), renormalise it (idempotent)."""
    if not isinstance(values, (list, tuple)):
        raise RecordError(row, field, f"must be a list of {k} numbers")
    if len(values) != k:
        raise RecordError(row, field, f"has {len(values)} entries but the question has {k} candidates")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RecordError(row, field, "entries must be numbers")
        v = float(v)
        if not math.isfinite(v):
            raise RecordError(row, field, "entries must be finite")
        if v < 0:
            raise RecordError(row, field, "entries must be non-negative")
        out.append(v)
    total = math.fsum(out)
    if abs(total - 1.0) > TARGET_SUM_TOL:
        raise RecordError(row, field, f"must sum to 1 within {TARGET_SUM_TOL} (sums to {total:.6g})")
    # A vector that sums to 1 to rounding is kept: dividing it by its sum again moves entries by an ulp, so a
    # record read back from the JSON it was written as would differ from it (renormalised once, it stays put).
    if abs(total - 1.0) <= RENORMALISED_TOL:
        return out
    return [v / total for v in out]


class Question(BaseModel):
    """One typed question. Candidates (`labels`) are derived from type and criteria."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: QuestionType
    instructions: Optional[JSONValue] = None  # optional, as in transformers' System One questions
    criteria: Union[list[str], dict[str, Optional[str]], None] = None

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> "Question":
        c = self.criteria
        lo = int((info.context or {}).get("min_candidates", MIN_CANDIDATES))
        if self.type == "choice":
            if c is None:
                raise ValueError("choice criteria is required: a list of labels or a mapping label -> description")
            labels = list(c) if isinstance(c, list) else list(c.keys())
            if not lo <= len(labels) <= MAX_CANDIDATES:
                raise ValueError(f"choice needs {lo}..{MAX_CANDIDATES} labels, got {len(labels)}")
            if len(set(labels)) != len(labels):
                raise ValueError("choice labels must be unique")
            if any(not isinstance(x, str) or not x.strip() for x in labels):
                raise ValueError("choice labels must be non-empty strings")
        elif self.type == "noul":
            if c is not None:
                if isinstance(c, list):
                    raise ValueError("noul criteria must be a mapping {false: description, true: description}")
                if not set(c) <= {"false", "true"}:
                    raise ValueError("noul criteria may only describe 'true' and 'false' (one, both or neither), got "
                                     f"keys {sorted(c)}")
        else:  # score
            if not isinstance(c, list) or not lo <= len(c) <= MAX_CANDIDATES:
                raise ValueError(f"score criteria must be a list of {lo}..{MAX_CANDIDATES} level descriptions, ascending")
        for name, value in (("instructions", self.instructions), ("criteria", c)):
            tok = find_reserved(value) if value is not None else None
            if tok is not None:
                raise ValueError(f"{name} contains the reserved token {tok!r}")
        return self

    @property
    def labels(self) -> list[str]:
        """Candidate labels in model order: choice labels, ["false","true"], or "0".."K-1"."""
        if self.type == "choice":
            c = self.criteria
            return list(c) if isinstance(c, list) else list(c.keys())  # type: ignore[arg-type]
        if self.type == "noul":
            return ["false", "true"]
        return [str(i) for i in range(len(self.criteria))]  # type: ignore[arg-type]

    @property
    def k(self) -> int:
        return len(self.labels)

    def descriptions(self) -> list[str | None]:
        """Per-candidate description (None where the user gave only a label)."""
        c = self.criteria
        if self.type == "score":
            return list(c)  # type: ignore[arg-type]
        if isinstance(c, dict):
            return [c.get(label) for label in self.labels]
        return [None] * self.k


class Record(BaseModel):
    """One question about one state: the unit of training and evaluation."""

    model_config = ConfigDict(extra="forbid")

    id: str
    source: str
    language: str = "en"
    task: str
    group: str | None = None
    split: Literal["train", "dev", "calibration", "test"] | None = None
    state: JSONValue
    image: str | None = None
    question: Question
    target: list[float]
    posterior: list[float] | None = None
    case_id: str | None = None  # rows of one case share it (isolation, shared prefix)
    # a derived question form (`rlcd data derive`): {"form", "family", "base": base row id, ...the map's
    # parameters}; None for an original row, and then left out of the row's JSON (files stay byte-identical)
    derived: Optional[dict[str, Any]] = None

    @field_validator("id", "source", "task", "language")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v or not v.strip():
            raise ValueError("must be a non-empty string")
        return v

    @field_validator("state")
    @classmethod
    def _state(cls, v: Any) -> Any:
        tok = find_reserved(v)
        if tok is not None:
            raise ValueError(f"contains the reserved token {tok!r}")
        return v

    @field_validator("derived")
    @classmethod
    def _derived(cls, v: Any) -> Any:
        if v is not None and not all(isinstance(v.get(key), str) and v[key] for key in ("form", "family", "base")):
            raise ValueError("a derived row names its form, family and base row id (non-empty strings)")
        return v

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict:
        out = handler(self)
        if out.get("derived", 0) is None:
            del out["derived"]
        return out

    @model_validator(mode="after")
    def _fill(self) -> "Record":
        k = self.question.k
        self.target = check_distribution(self.target, k, field="target", row=self.id)
        if self.posterior is not None:
            self.posterior = check_distribution(self.posterior, k, field="posterior", row=self.id)
        if self.group is None:
            self.group = f"{self.source}/{self.language}/{self.task}"
        return self

    @property
    def sampling_group(self) -> str:
        return f"{self.source}/{self.language}/{self.task}"


class Case(BaseModel):
    """One state with several questions (the typed-decisions row and request shape)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    state: JSONValue
    image: str | None = None
    questions: dict[str, Question]


def _rule_from_pydantic(err: ValidationError) -> tuple[str, str]:
    first = err.errors()[0]
    loc = ".".join(str(x) for x in first.get("loc", ()))
    msg = first.get("msg", "invalid")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return (loc or "record"), msg


def parse_record(obj: Any, *, row: str | None = None) -> Record:
    """Validate a raw dict into a Record; raise RecordError naming the row, the field and the rule."""
    rid = row
    if isinstance(obj, dict) and isinstance(obj.get("id"), str):
        rid = obj["id"]
    if not isinstance(obj, dict):
        raise RecordError(rid, "record", "must be a JSON object")
    try:
        return Record.model_validate(obj)
    except RecordError:
        raise
    except ValidationError as e:
        # a RecordError raised inside a validator arrives wrapped; unwrap it
        for item in e.errors():
            ctx = item.get("ctx") or {}
            inner = ctx.get("error")
            if isinstance(inner, RecordError):
                raise RecordError(rid, inner.field, inner.rule) from None
        field, rule = _rule_from_pydantic(e)
        raise RecordError(rid, field, rule) from None


def parse_question(obj: Any, *, qid: str | None = None, min_candidates: int = MIN_CANDIDATES) -> Question:
    """Validate a raw question dict; errors name the question id, field and rule.

    `min_candidates`: REQUEST_MIN_CANDIDATES (1) for a request's questions; records keep the default (2)."""
    if isinstance(obj, Question):
        return obj
    if not isinstance(obj, dict):
        raise RecordError(qid, "question", "must be a JSON object with type, instructions, criteria")
    try:
        return Question.model_validate(obj, context={"min_candidates": min_candidates})
    except ValidationError as e:
        field, rule = _rule_from_pydantic(e)
        raise RecordError(qid, field, rule) from None
