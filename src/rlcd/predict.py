"""Predictor: load a run's `export/` and answer `/v1/systemone` requests.

Request (a dict, the TypeSafe-style wire format)::

    {"model"?: str, "state": str | object, "questions": {qid: {"type", "instructions", "criteria"}}}

plus an optional image (a file path or a PIL image, passed separately). Response::

    {"model": name, "answers": {qid: answer}, "usage": {"input_tokens": n, "images": m}}

with, after the run's per-type temperature `T` (probabilities are `softmax(logits / T)`):

* choice -> `{"type", "choice": argmax label, "probabilities": {label: p}, "confidence"}`
* noul   -> `{"type", "noul": P(true), "confidence"}`
* score  -> `{"type", "score": sum_i i * p_i, "probabilities": {"0".."K-1": p}, "confidence"}`

**Confidence** is the probability of the most likely candidate after temperature scaling:
`max_k p_k` (for noul `max(P(true), P(false))`, for score the probability of the modal level). It
is in `[1/K, 1]`; with calibrated temperatures it is the expected accuracy of the top answer.

All questions of a request are scored in one `DecisionModel.score_case` call: the shared prefix
(image + state) runs once, the image is encoded once, the question suffixes run batched.
`usage.input_tokens` counts the tokens processed that way (shared prefix once, plus every
question's suffix; image tokens included); `usage.images` is 0 or 1.

Answers are deterministic: the model is in eval mode, the scorer's centring buffers are frozen, no
cache or state survives a call, so the same request gives the same answer whatever came before.
Requests are serialised: one lock guards the model call (validation and image decoding happen
outside it), so a `Predictor` may be shared by threads.

Validation errors raise `PredictError` (a `RecordError`): `.field` is a path into the request
(`"questions.q1.criteria"`), `.question` the question id where there is one, `.rule` the message.
Limits (`Limits`): questions per request, candidates per question, tokens per row (image tokens
included), request bytes (the server's body limit; `predict` checks the JSON size of the request)
and image pixels.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any, Mapping

import torch

from .device import Placement
from .schema import QUESTION_TYPES, Question, RecordError, find_reserved, parse_question
from .serving.errors import PredictError
from .serving.images import open_image
from .serving.limits import Limits

REQUEST_KEYS = ("model", "state", "questions")
MAX_QID_CHARS = 256


# ----------------------------------------------------------------------------------- answers
def probabilities(logits: torch.Tensor | list[float], temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float64."""
    z = torch.as_tensor(logits, dtype=torch.float64) / float(temperature)
    return torch.softmax(z, dim=-1)


def make_answer(question: Question, logits: torch.Tensor | list[float], temperature: float) -> dict[str, Any]:
    """The wire answer for one question from its raw logits and its type's temperature."""
    p = probabilities(logits, temperature)
    probs = [float(x) for x in p.tolist()]
    top = max(range(len(probs)), key=lambda i: probs[i])  # first maximum on ties
    confidence = probs[top]
    labels = question.labels
    if question.type == "choice":
        return {"type": "choice", "choice": labels[top], "probabilities": dict(zip(labels, probs)),
                "confidence": confidence}
    if question.type == "noul":
        return {"type": "noul", "noul": probs[1], "confidence": confidence}
    return {"type": "score", "score": math.fsum(i * x for i, x in enumerate(probs)),
            "probabilities": dict(zip(labels, probs)), "confidence": confidence}


# ----------------------------------------------------------------------------------- validation
def _json_size(obj: Any) -> int:
    try:
        return len(json.dumps(obj, ensure_ascii=False).encode("utf-8"))
    except (TypeError, ValueError) as e:
        raise PredictError("request", f"must be JSON-serialisable ({e})", status=400) from None
    except RecursionError:
        raise PredictError("request", "is nested too deeply", status=400) from None


def validate_request(request: Any, limits: Limits, *, model_names: tuple[str, ...] = ()) -> tuple[Any, list[str], list[Question]]:
    """Check a request against the wire format and the limits -> (state, qids, questions)."""
    if not isinstance(request, Mapping):
        raise PredictError("request", f"must be a JSON object, got {type(request).__name__}", status=400)
    unknown = sorted(str(k) for k in request if k not in REQUEST_KEYS)
    if "image" in unknown:
        raise PredictError("image", "pass the image to Predictor.predict(request, image=...) (a path or a PIL "
                                    "image); only the HTTP server reads an image member from the request")
    if unknown:
        raise PredictError(unknown[0], f"unknown field; a request has {', '.join(REQUEST_KEYS)} (and an "
                                       "optional image)")
    size = _json_size(request)
    if size > limits.max_request_bytes:
        raise PredictError("request", f"is {size} bytes, more than max_request_bytes={limits.max_request_bytes}",
                           status=413)
    name = request.get("model")
    if name is not None:
        if not isinstance(name, str):
            raise PredictError("model", "must be a string")
        if model_names and name not in model_names:
            raise PredictError("model", f"unknown model {name!r}; this server serves {model_names[0]!r}", status=404)
    if "state" not in request or request["state"] is None:
        raise PredictError("state", "is required (a string or a JSON object)")
    state = request["state"]
    if not isinstance(state, (str, dict, list)):
        raise PredictError("state", f"must be a string or a JSON object/array, got {type(state).__name__}")
    tok = find_reserved(state)
    if tok is not None:
        raise PredictError("state", f"contains the reserved token {tok!r}; special-token text is not allowed "
                                    "in inputs")
    if "questions" not in request or request["questions"] is None:
        raise PredictError("questions", "is required: an object mapping question id -> {type, instructions, "
                                        "criteria}")
    qs = request["questions"]
    if not isinstance(qs, Mapping):
        raise PredictError("questions", f"must be an object mapping question id -> question, got "
                                        f"{type(qs).__name__}")
    if not qs:
        raise PredictError("questions", "must contain at least one question")
    if len(qs) > limits.max_questions:
        raise PredictError("questions", f"has {len(qs)} questions, more than max_questions={limits.max_questions}",
                           status=413)
    qids: list[str] = []
    questions: list[Question] = []
    for qid, raw in qs.items():
        if not isinstance(qid, str) or not qid.strip() or len(qid) > MAX_QID_CHARS:
            raise PredictError("questions", f"question ids must be non-empty strings of at most {MAX_QID_CHARS} "
                                            f"characters (got {str(qid)[:40]!r})", question=str(qid))
        base = f"questions.{qid}"
        if isinstance(raw, Mapping):
            t = raw.get("type")
            if t not in QUESTION_TYPES:
                raise PredictError(f"{base}.type", f"unknown question type {t!r}; use one of "
                                                   f"{', '.join(QUESTION_TYPES)}", question=qid)
            if "instructions" not in raw:
                raise PredictError(f"{base}.instructions", "is required", question=qid)
        try:
            q = parse_question(raw if not isinstance(raw, Mapping) else dict(raw), qid=qid)
        except RecordError as e:
            sub = e.field
            if sub == "record":  # a whole-question rule: name the part it is about
                sub = "instructions" if e.rule.startswith("instructions") else "criteria"
            field = base if sub == "question" else f"{base}.{sub}"
            raise PredictError(field, e.rule, question=qid) from None
        if q.k > limits.max_candidates:
            raise PredictError(f"{base}.criteria", f"has {q.k} candidates, more than max_candidates="
                                                   f"{limits.max_candidates}", question=qid, status=413)
        qids.append(qid)
        questions.append(q)
    return state, qids, questions


# ----------------------------------------------------------------------------------- predictor
def _run_name(path: Path) -> str:
    path = Path(path).resolve()
    if path.name == "export":
        path = path.parent
    return path.name or "rlcd"


class Predictor:
    """Answers typed-decision requests with one merged, calibrated model.

    Requests are serialised: a lock around the model call makes a shared `Predictor` thread-safe
    (validation and image decoding run outside it). See the module docstring for the wire format
    and the confidence definition.
    """

    def __init__(self, model: Any, meta: Mapping[str, Any], *, name: str | None = None,
                 limits: Limits | None = None):
        temps = dict(meta.get("temperatures") or {})
        missing = [t for t in QUESTION_TYPES if t not in temps]
        if missing:
            raise ValueError(f"export meta has no temperature for {missing}")
        for t in QUESTION_TYPES:
            if not (isinstance(temps[t], (int, float)) and math.isfinite(temps[t]) and temps[t] > 0):
                raise ValueError(f"temperature for {t} must be a positive finite number, got {temps[t]!r}")
        self.model = model
        self.meta = dict(meta)
        self.temperatures = {t: float(temps[t]) for t in QUESTION_TYPES}
        self.name = name or str(meta.get("model") or "rlcd")
        self.limits = limits or Limits()
        self._lock = threading.Lock()
        model.eval()

    @classmethod
    def from_run(cls, path: str | Path, *, placement: Placement | None = None, name: str | None = None,
                 limits: Limits | None = None) -> "Predictor":
        """Load from a run dir (its `export/`) or an export dir (merged model, temperatures)."""
        from .export import load_export

        model, meta = load_export(Path(path), placement=placement)
        return cls(model, meta, name=name or _run_name(Path(path)), limits=limits)

    # ------------------------------------------------------------------ info
    def info(self) -> dict[str, Any]:
        """What `/v1/models` shows: name, backbone, temperatures, limits, question types."""
        bb = self.meta.get("backbone") or {}
        return {
            "id": self.name,
            "object": "model",
            "backbone": self.meta.get("model"),
            "preset": bb.get("preset"),
            "revision": bb.get("revision"),
            "temperatures": dict(self.temperatures),
            "question_types": list(QUESTION_TYPES),
            "selected_step": self.meta.get("selected_step"),
            "checkpoint_sha256": self.meta.get("checkpoint_sha256"),
            "limits": self.limits.to_dict(),
            "confidence": "probability of the most likely candidate after temperature scaling",
            "placement": getattr(self.model, "placement", None),
        }

    # ------------------------------------------------------------------ answering
    def validate(self, request: Any, limits: Limits | None = None) -> tuple[Any, list[str], list[Question]]:
        return validate_request(request, limits or self.limits, model_names=(self.name, str(self.meta.get("model"))))

    def predict(self, request: Mapping[str, Any], image: Any = None, *, limits: Limits | None = None) -> dict[str, Any]:
        """Answer one request (see the module docstring). Raises PredictError on bad input."""
        lim = limits or self.limits
        state, qids, questions = self.validate(request, lim)
        if image is not None:
            image = open_image(image, max_pixels=lim.max_image_pixels)
        with self._lock:
            encoder = getattr(self.model, "encoder", None)
            old = getattr(encoder, "max_tokens", None)
            if encoder is not None:
                encoder.max_tokens = lim.max_tokens
            try:
                logits, usage = self.model.score_case_with_usage(state, questions, image, qids)
            except RecordError as e:
                raise self._from_record_error(e, qids) from None
            finally:
                if encoder is not None:
                    encoder.max_tokens = old
        answers = {qid: make_answer(q, lg, self.temperatures[q.type]) for qid, q, lg in zip(qids, questions, logits)}
        return {"model": self.name, "answers": answers,
                "usage": {"input_tokens": int(usage["input_tokens"]), "images": 0 if image is None else 1}}

    @staticmethod
    def _from_record_error(e: RecordError, qids: list[str]) -> PredictError:
        field = e.field
        qid = e.row if e.row in qids else None
        status = 413 if field == "tokens" else 422
        if field in ("state", "image"):
            return PredictError(field, e.rule, question=qid, status=status)
        if qid is None:
            return PredictError("request" if field == "tokens" else f"request.{field}", e.rule, status=status)
        if field == "tokens":  # the whole rendered row is too long
            return PredictError(f"questions.{qid}", e.rule, question=qid, status=status)
        field = field[len("question."):] if field.startswith("question.") else field
        return PredictError(f"questions.{qid}.{field}", e.rule, question=qid, status=status)


__all__ = ["Limits", "PredictError", "Predictor", "make_answer", "probabilities", "open_image",
           "validate_request"]
