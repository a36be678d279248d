"""The System One request, exactly as `transformers serve` validates it, plus rlcd's older shapes.

A request is `{"model"?, "state", "questions": {qid: question}, "assets"?, "image"?}`:

* `model`: any string, echoed in the response (transformers requires it; rlcd defaults to the served
  name). With `strict_model`, a name other than the served ones is a 404, as rlcd did before.
* `state`: a string, a JSON object or a JSON array.
* `questions`: 1..`max_questions` questions (transformers: 1..64), each `{"type", "instructions"?,
  "criteria"?}` with no other keys:
  - `choice`: criteria `{label: description | null}` (transformers) or `[label, ...]` (rlcd);
  - `noul`: criteria `{"true"?: ..., "false"?: ...}` with one, both or neither described, or none;
  - `score`: criteria `[level description, ...]`, lowest first.
  A choice may have one option and a score one level, as in transformers (the answer is then fixed:
  probability 1, confidence 1; `rlcd.predict` answers it without the model). Records need two.
  Instructions, descriptions and levels are strings, JSON values, or *content*: a part
  `{"type": "text", "text": ...}` / `{"type": "image", ...}` or a list of parts. Text parts are joined;
  an image part is an image of the request.
* `assets`: at most 4 images keyed by placeholder (`{"type": "image", "format": "png", "data_base64":
  ...}` as System One sends them, `{"path": ...}` under the server's image root; URLs are refused: the
  server is offline). An asset is used when its placeholder occurs in a string of the state, the
  instructions or the criteria (as transformers does); the placeholder text stays as written and the
  image goes in the prompt's image segment. An asset nothing refers to is not used (a warning says so).
* `image`: rlcd's alias, `{"base64": ...}` or `{"path": ...}`.
* `x_gate`: rlcd's extension (a boolean): answer each question with its gate decision from the served run's
  `thresholds.json` (`rlcd.serving.gating`).
* Any other top-level field is ignored, as the official API does (jevcompat's `request.unknown-fields`; the
  SDK's `extra_body` sends such fields) and listed in `ParsedRequest.ignored` -- except `stream` and
  `temperature`, which ask for an answer this server does not give (streamed; at another temperature than the
  calibrated one): those are a 422, as any unknown field is in `transformers serve`.

The model reads one image per request: more is a 422, any image for a text-only backbone too.
Every rule broken is a `PredictError` naming the field (`questions.q1.criteria`), with its status:
400 undecodable, 403 path outside the image root, 404 unknown model or image file, 413 size limits,
422 any other rule.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from rlcd.schema import (QUESTION_TYPES, REQUEST_MIN_CANDIDATES, Question, RecordError, find_reserved,
                         parse_question)
from rlcd.serving.errors import PredictError
from rlcd.serving.limits import Limits

REQUEST_KEYS = ("model", "state", "questions", "assets", "image")
EXTENSION_KEYS = ("x_gate",)
# unknown fields are ignored, but not those asking for an answer this server does not give (a streamed one, one at
# another temperature than the calibrated): ignoring them would answer something else than what was asked
REFUSED_KEYS = ("stream", "temperature")
REFUSED_WHY = {"stream": "not supported: this server answers with one JSON response, never a stream; drop \"stream\"",
               "temperature": "not supported: answers use the temperature fitted on the calibration split; drop "
                              "\"temperature\""}
QUESTION_KEYS = ("type", "instructions", "criteria")
MAX_QID_CHARS = 256
MAX_ASSETS = 4  # transformers' SystemOneRequest
IMAGE_PART_TYPES = ("image", "image_url")
PART_TYPES = ("text", *IMAGE_PART_TYPES)


@dataclass
class ParsedRequest:
    """A validated request: what the model needs, the raw criteria (score legends) and the image specs."""

    model: str | None
    state: Any
    qids: list[str]
    questions: list[Question]
    raw_criteria: dict[str, Any]
    images: list[tuple[str, Any]] = field(default_factory=list)  # (field path, image spec) not yet decoded
    warnings: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # unknown top-level fields, ignored
    gate: bool = False  # x_gate: the answers carry their gate decision


# ---------------------------------------------------------------------------------------------- content
def is_part(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get("type") in PART_TYPES


def is_content(value: Any) -> bool:
    """A content part, or a non-empty list of content parts (anything else is plain JSON)."""
    return is_part(value) or (isinstance(value, list) and bool(value) and all(is_part(x) for x in value))


def content_text(value: Any, where: str, qid: str | None, images: list[tuple[str, Any]]) -> Any:
    """The text of a content value (text parts joined, image parts collected into `images`); other values as is."""
    if not is_content(value):
        return value
    parts = [value] if isinstance(value, Mapping) else value
    texts = []
    for i, part in enumerate(parts):
        path = where if isinstance(value, Mapping) else f"{where}.{i}"
        if part["type"] == "text":
            if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise PredictError(path, 'a text part is {"type": "text", "text": "..."}', question=qid)
            texts.append(part["text"])
        else:
            images.append((path, {k: v for k, v in part.items() if k != "type"}))
    return "".join(texts)


# ---------------------------------------------------------------------------------------------- checks
def json_size(obj: Any) -> int:
    try:
        return len(json.dumps(obj, ensure_ascii=False).encode("utf-8"))
    except (TypeError, ValueError) as e:
        raise PredictError("request", f"must be JSON-serialisable ({e})", status=400) from None
    except RecursionError:
        raise PredictError("request", "is nested too deeply", status=400) from None


def _strings(value: Any):
    """Every string inside a JSON value (dict keys and values, list items)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield str(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _question(qid: str, raw: Any, images: list[tuple[str, Any]], limits: Limits) -> Question:
    base = f"questions.{qid}"
    if not isinstance(raw, Mapping):
        raise PredictError(base, "must be a JSON object {type, instructions?, criteria?}", question=qid)
    t = raw.get("type")
    if t not in QUESTION_TYPES:
        raise PredictError(f"{base}.type", f"unknown question type {t!r}; use one of {', '.join(QUESTION_TYPES)}",
                           question=qid)
    extra = sorted(str(k) for k in raw if k not in QUESTION_KEYS)
    if extra:
        raise PredictError(f"{base}.{extra[0]}", f"unknown field; a question has {', '.join(QUESTION_KEYS)}",
                           question=qid)
    q = dict(raw)
    q["instructions"] = content_text(raw.get("instructions"), f"{base}.instructions", qid, images)
    c = raw.get("criteria")
    if isinstance(c, Mapping):
        q["criteria"] = {k: content_text(v, f"{base}.criteria.{k}", qid, images) for k, v in c.items()}
        q["criteria"] = {k: (v if v is None or isinstance(v, str) else json.dumps(v, ensure_ascii=False))
                         for k, v in q["criteria"].items()}
    elif isinstance(c, list) and t == "score":
        levels = [content_text(v, f"{base}.criteria.{i}", qid, images) for i, v in enumerate(c)]
        q["criteria"] = [v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for v in levels]
    try:
        question = parse_question(q, qid=qid, min_candidates=REQUEST_MIN_CANDIDATES)
    except RecordError as e:
        sub = e.field
        if sub == "record":  # a whole-question rule: name the part it is about
            sub = "instructions" if e.rule.startswith("instructions") else "criteria"
        raise PredictError(base if sub == "question" else f"{base}.{sub}", e.rule, question=qid) from None
    if question.k > limits.max_candidates:
        raise PredictError(f"{base}.criteria", f"has {question.k} candidates, more than max_candidates="
                                               f"{limits.max_candidates}", question=qid, status=413)
    return question


def _assets(request: Mapping[str, Any], texts: list[str], images: list[tuple[str, Any]],
            warnings: list[str]) -> None:
    assets = request.get("assets")
    if assets is None:
        return
    if not isinstance(assets, Mapping):
        raise PredictError("assets", "must be an object mapping placeholder -> image")
    if len(assets) > MAX_ASSETS:
        raise PredictError("assets", f"has {len(assets)} images, at most {MAX_ASSETS}")
    for name, spec in assets.items():
        if not isinstance(name, str) or not name:
            raise PredictError("assets", "placeholders must be non-empty strings")
        if not isinstance(spec, Mapping):
            raise PredictError(f"assets.{name}", 'must be an object, e.g. {"type": "image", "format": "png", '
                                                 '"data_base64": "..."}')
        if any(name in t for t in texts):
            images.append((f"assets.{name}", dict(spec)))
        else:
            warnings.append(f"asset {name!r} is not used: no string of the state, instructions or criteria "
                            "contains its placeholder")


def parse_request(request: Any, limits: Limits, *, served: tuple[str, ...] = (), strict_model: bool = False,
                  takes_images: bool = True) -> ParsedRequest:
    """Check a request against the wire format and the limits (images are found, not decoded)."""
    if not isinstance(request, Mapping):
        raise PredictError("body", f"must be a JSON object, got {type(request).__name__}", status=400)
    refused = [k for k in REFUSED_KEYS if k in request]
    if refused:
        raise PredictError(refused[0], REFUSED_WHY[refused[0]])
    ignored = sorted(str(k) for k in request if k not in REQUEST_KEYS + EXTENSION_KEYS)
    gate = request.get("x_gate", False)
    if not isinstance(gate, bool):
        raise PredictError("x_gate", "must be true or false (true: each answer carries its gate decision)")
    size = json_size(request)
    if size > limits.max_request_bytes:
        raise PredictError("request", f"is {size} bytes, more than max_request_bytes={limits.max_request_bytes}",
                           status=413)
    name = request.get("model")
    if name is not None and not isinstance(name, str):
        raise PredictError("model", "must be a string")
    if strict_model and name is not None and served and name not in served:
        raise PredictError("model", f"unknown model {name!r}; this server serves {served[0]!r}", status=404)
    if request.get("state") is None:
        raise PredictError("state", "is required (a string or a JSON object)")
    state = request["state"]
    if not isinstance(state, (str, dict, list)):
        raise PredictError("state", f"must be a string or a JSON object/array, got {type(state).__name__}")
    tok = find_reserved(state)
    if tok is not None:
        raise PredictError("state", f"contains the reserved token {tok!r}; special-token text is not allowed in inputs")
    qs = request.get("questions")
    if qs is None:
        raise PredictError("questions", "is required: an object mapping question id -> {type, instructions, criteria}")
    if not isinstance(qs, Mapping):
        raise PredictError("questions", f"must be an object mapping question id -> question, got {type(qs).__name__}")
    if not qs:
        raise PredictError("questions", "must contain at least one question")
    if len(qs) > limits.max_questions:
        raise PredictError("questions", f"has {len(qs)} questions, more than max_questions={limits.max_questions}",
                           status=413)
    images: list[tuple[str, Any]] = []
    qids, questions, raw_criteria = [], [], {}
    for qid, raw in qs.items():
        if not isinstance(qid, str) or not qid.strip() or len(qid) > MAX_QID_CHARS:
            raise PredictError("questions", f"question ids must be non-empty strings of at most {MAX_QID_CHARS} "
                                            f"characters (got {str(qid)[:40]!r})", question=str(qid))
        questions.append(_question(qid, raw, images, limits))
        qids.append(qid)
        raw_criteria[qid] = raw.get("criteria") if isinstance(raw, Mapping) else None
    warnings: list[str] = []
    if request.get("assets") is not None:  # the texts are only searched for asset placeholders
        texts = list(_strings(state)) + [t for q in qs.values() for t in _strings(
            {k: v for k, v in q.items() if k in ("instructions", "criteria")})]
        _assets(request, texts, images, warnings)
    if request.get("image") is not None:
        images.append(("image", request["image"]))
    if images and not takes_images:
        raise PredictError(images[0][0], "this model's backbone is text-only (it reads no images); send text only")
    if len(images) > 1:
        raise PredictError(images[1][0], f"this model reads one image per request, got {len(images)} "
                                         f"({', '.join(f for f, _ in images)})")
    return ParsedRequest(name, state, qids, questions, raw_criteria, images, warnings, ignored, gate)


__all__ = ["ParsedRequest", "parse_request", "content_text", "is_content", "json_size", "REQUEST_KEYS",
           "EXTENSION_KEYS", "MAX_QID_CHARS"]
