"""Predictor: load a run's `export/` and answer System One (`/v1/systemone`) requests.

The request format is transformers' (`rlcd.serving.request`: `{"model"?, "state", "questions",
"assets"?}` plus rlcd's `image` alias); the answers are transformers' shapes and meanings
(`rlcd.serving.answer`: choice confidence `(p_max - 1/K) / (1 - 1/K)`, score confidence from the
expected distance to the modal level plus a `legend`, noul `P(true)`), after the run's per-type
temperature T (probabilities are `softmax(logits / T)`). The response is
`{"model": <the request's model, else the served name>, "answers": {qid: answer},
"usage": {"input_tokens", "output_tokens": 0, "images"}}` (+ `"warnings"` when an asset was unused).

All questions of a request are scored together (`DecisionModel.prepare_case` then `score_cases`, which
also batches several requests): the shared prefix (image + state) runs once, the image is encoded
once, the question suffixes run batched.
`usage.input_tokens` counts the tokens processed that way (shared prefix once, plus every
question's suffix; image tokens included); `usage.images` is 0 or 1.
A one-option choice or one-level score (transformers accepts them) has a fixed answer (probability 1,
confidence 1, `serving.answer.fixed_answer`): it is answered without the model and its tokens are not
counted; a request of only such questions runs no model at all (`input_tokens` 0, `images` 0).

A request goes through three steps: `prepare` (validation and image decoding, no model), `score`
(the model call, under a lock) and `respond`; `predict` runs the three. Answers are deterministic:
the model is in eval mode and the scorer's centring buffers are frozen, so the same request gives the
same answer whatever came before, up to float noise (< 1e-4 in probability, tested): the only state
that survives a call is the state cache.

The state cache (`rlcd.model.state_cache`, `state_cache_mb`, default 256 MiB, 0 turns it off): the
decoder state of each state's prefix (chat-template head, image, state) is kept, LRU bounded in bytes,
so a later request about the same state and image runs only its questions. Keys are the exact prefix
token ids and the image's pixel digest, scoped by `_cache_scope` (the model's fingerprint and info, the
prompt frame, LoRA and merge state, the placement, the parameters' version counters): another model,
frame, LoRA state or image never hits. `state_cache_stats()` is what monitoring reads.
`usage.input_tokens` does not depend on it: a hit skips the prefix's forward, not its count.

Order votes (`order_votes` N, default 1: off; `rlcd.order_votes`): each choice question of K > 1 options is
also asked in the other orders of `vote_orders(K, N)`, as extra rows of the same case (more suffixes on the
same shared prefix: the state still runs once, and a cached state serves them all). Its logits become
`combine(..., vote_combine)`, aligned back to the question's own option order: "logmean" (default) the normalised
mean of the orders' log-probabilities, "mean" the log of their mean probability; the answer is then made from them
as from any logits (the type's temperature applied). noul and score questions are never voted. `usage.input_tokens` counts the extra suffixes (they are processed tokens), and
the batcher's question count (`Prepared.size`) counts them as rows.

Canonical requests (`canonical`, default on; `rlcd serve --as-asked` turns them off; `rlcd.serving.canonical`):
each question is asked in its canonical form -- a choice's options in (description, id) order, options with the
same description once, a yes/no choice or [no, yes] score as the noul -- and its answer mapped back to the caller's
options (`canonical.answer_logits`), so those forms of one question get the same answer. Order votes are planned
on the asked questions.

Validation errors raise `PredictError` (a `RecordError`): `.field` is a path into the request
(`"questions.q1.criteria"`), `.question` the question id where there is one, `.status` the HTTP
status. Limits (`Limits`): questions per request, candidates per question, tokens per row (image
tokens included), request bytes and image pixels.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .device import Placement
from .order_votes import DEFAULT_COMBINE, asked, check_combine, check_votes, vote_plan, voted
from .schema import QUESTION_TYPES, RecordError
from .serving.answer import fixed_answer, make_answer, probabilities
from .serving.canonical import answer_logits, canonical_questions
from .serving.errors import PredictError
from .serving.images import load_image_spec, open_image
from .serving.limits import Limits
from .serving.request import ParsedRequest, parse_request

DEFAULT_STATE_CACHE_MB = 256  # MiB; a 250-token SmolLM2-135M state takes 12.5 MiB in float32 (docs/SERVING.md)


@dataclass
class Prepared:
    """A request ready for the model: parsed, its image decoded (or None), its rows tokenised
    (`case`, a `DecisionModel.prepare_case` result)."""

    request: ParsedRequest
    image: Any
    case: Any = None  # None when no question needs the model (each has a single option)
    # order votes: per scored question (the case's first rows, in order), the orders it is asked in; the rows
    # of the orders after the first follow the scored questions in the case, question by question. None: no votes
    votes: list[list[list[int]]] | None = None
    # canonical requests: per request question, its canonical form (`serving.canonical`); None: asked as sent
    canon: list[Any] | None = None

    def size(self) -> tuple[int, int]:
        """(questions, tokens) for the batcher's bounds; a voted question counts once per order it is asked in."""
        extra = sum(len(orders) - 1 for orders in self.votes) if self.votes else 0
        return len(self.request.qids) + extra, int(self.case.n_tokens) if self.case is not None else 0


# ----------------------------------------------------------------------------------- predictor
def _run_name(path: Path) -> str:
    path = Path(path).resolve()
    if path.name == "export":
        path = path.parent
    return path.name or "rlcd"


def _reads_images(meta: Mapping[str, Any]) -> bool:
    """Whether the export's backbone family reads images (what a loaded model's `supports_images` says)."""
    from .model.families import family_named

    return bool(family_named(str((meta.get("backbone") or {}).get("family", "qwen3.5"))).supports_images)


def _export_date(path: Path) -> str | None:
    """YYYY-MM-DD (UTC) of the export's model.json: the "release date" /v1/models shows."""
    import datetime

    for meta in (path / "model.json", path / "export" / "model.json"):
        if meta.is_file():
            return datetime.datetime.fromtimestamp(meta.stat().st_mtime, datetime.timezone.utc).date().isoformat()
    return None


def state_cache_bytes(mb: float) -> int:
    """`state_cache_mb` (mebibytes, 0 = off) in bytes; a negative, non-finite or non-number value is a ValueError."""
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not math.isfinite(mb) or mb < 0:
        raise ValueError(f"state_cache_mb must be a number >= 0 (0 turns the state cache off), got {mb!r}")
    return int(mb * (1 << 20))


def _cache_scope(model: Any, meta: Mapping[str, Any]) -> str:
    """The state cache's scope for `model` as it is now: a digest of the export's identity (backbone spec and
    fingerprint, checkpoint sha256, recipe), the model's `info` (prompt frame and version, LoRA config and
    merge state, head), its placement, and its parameters' count and in-place version counters (a weight
    loaded or changed in place moves them). Any change gives a new scope, so old entries are never hit."""
    params = list(model.parameters()) if hasattr(model, "parameters") else []
    ident = {"meta": {k: meta.get(k) for k in ("model", "model_seed", "backbone_fingerprint", "checkpoint_sha256",
                                              "recipe")},
             "info": getattr(model, "info", None), "placement": getattr(model, "placement", None),
             "params": [len(params), sum(p._version for p in params)], "object": id(model)}
    return hashlib.blake2b(json.dumps(ident, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


class Predictor:
    """Answers typed-decision requests with one merged, calibrated model.

    Requests are serialised: a lock around the model call makes a shared `Predictor` thread-safe
    (validation and image decoding run outside it). See the module docstring for the wire format
    and the confidence definition.
    """

    def __init__(self, model: Any, meta: Mapping[str, Any], *, name: str | None = None,
                 limits: Limits | None = None, strict_model: bool = False, loader: Any = None,
                 state_cache_mb: float = DEFAULT_STATE_CACHE_MB, order_votes: int = 1, canonical: bool = True,
                 vote_combine: str = DEFAULT_COMBINE):
        temps = dict(meta.get("temperatures") or {})
        missing = [t for t in QUESTION_TYPES if t not in temps]
        if missing:
            raise ValueError(f"export meta has no temperature for {missing}")
        for t in QUESTION_TYPES:
            if not (isinstance(temps[t], (int, float)) and math.isfinite(temps[t]) and temps[t] > 0):
                raise ValueError(f"temperature for {t} must be a positive finite number, got {temps[t]!r}")
        if model is None and loader is None:
            raise ValueError("a Predictor needs a model or a loader of one")
        self.order_votes = check_votes(order_votes)
        self.canonical = bool(canonical)
        self.vote_combine = check_combine(vote_combine)
        from .model.state_cache import StateCache  # torch only when a state is stored: a portable Predictor has none

        self.state_cache = StateCache(state_cache_bytes(state_cache_mb))
        self._model, self._loader = model, loader
        self.meta = dict(meta)
        self.temperatures = {t: float(temps[t]) for t in QUESTION_TYPES}
        self.name = name or str(meta.get("model") or "rlcd")
        self.limits = limits or Limits()
        self.strict_model = bool(strict_model)
        self.takes_images = (bool(getattr(model, "supports_images", True)) if model is not None
                             else _reads_images(self.meta))
        self._lock = threading.Lock()  # around every model call
        self._loading = threading.Lock()
        self.release_date: str | None = None  # /v1/models: the day the export was written (from_run sets it)
        if model is not None:
            model.eval()

    @property
    def model(self) -> Any:
        """The merged model; a lazy Predictor (`from_run(lazy=True)`) loads it when a request first needs it."""
        if self._model is None:
            with self._loading:
                if self._model is None:
                    self._model = self._loader()
                    self._model.eval()
        return self._model

    @property
    def loaded(self) -> bool:
        """Whether the model is in memory (a lazy Predictor's is not until a request needs it): /ready reads it."""
        return self._model is not None

    @classmethod
    def from_run(cls, path: str | Path, *, placement: Placement | None = None, name: str | None = None,
                 limits: Limits | None = None, strict_model: bool = False, lazy: bool = False,
                 state_cache_mb: float = DEFAULT_STATE_CACHE_MB, order_votes: int = 1,
                 canonical: bool = True, vote_combine: str = DEFAULT_COMBINE) -> "Predictor":
        """Load from a run dir (its `export/`) or an export dir (merged model, temperatures). `lazy`: read only
        the export's metadata now and load the model when a request first needs it (`rlcd predict`: a request
        whose every question has one option is answered without it). `order_votes`, `vote_combine`, `canonical`: see
        the module docstring."""
        from .export import load_export, read_export_meta
        from .run import find_export

        name = name or _run_name(Path(path))
        kw = dict(name=name, limits=limits, strict_model=strict_model, state_cache_mb=state_cache_mb,
                  order_votes=order_votes, canonical=canonical, vote_combine=vote_combine)
        if lazy:
            meta = read_export_meta(find_export(Path(path)))
            predictor = cls(None, meta, loader=lambda: load_export(Path(path), placement=placement)[0], **kw)
            predictor.release_date = _export_date(Path(path))
            return predictor
        model, meta = load_export(Path(path), placement=placement)
        predictor = cls(model, meta, **kw)
        predictor.release_date = _export_date(Path(path))
        return predictor

    @property
    def served_names(self) -> tuple[str, ...]:
        """Names a strict server accepts in `model`: the served name and the backbone spec."""
        return (self.name, str(self.meta.get("model")))

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
            "license": bb.get("license"),  # the backbone weights' licence as its preset recorded it (None: unknown)
            "temperatures": dict(self.temperatures),
            "question_types": list(QUESTION_TYPES),
            "selected_step": self.meta.get("selected_step"),
            "checkpoint_sha256": self.meta.get("checkpoint_sha256"),
            "limits": self.limits.to_dict(),
            "strict_model": self.strict_model,
            "images": self.takes_images,
            "confidence": "transformers' System One definitions: choice (p_max - 1/K) / (1 - 1/K); score "
                          "1 - E|level - argmax| / E_uniform|level - middle|; noul has none (its answer is P(true))",
            "placement": getattr(self._model, "placement", None),
            "order_votes": self.order_votes,
            "vote_combine": self.vote_combine,
            "canonical_requests": self.canonical,
        }

    # ------------------------------------------------------------------ answering
    def prepare(self, request: Any, image: Any = None, *, image_root: Path | None = None,
                limits: Limits | None = None, parts: Mapping[str, bytes] | None = None) -> Prepared:
        """Validate `request`, decode its image (from `image`, the request's `image`, an asset or a part),
        tokenise its rows and preprocess the image: everything but the model call, safe to run in threads.
        `parts`: the image parts of a multipart body by name (an asset's `{"part": NAME}`)."""
        lim = limits or self.limits
        parsed = parse_request(request, lim, served=self.served_names, strict_model=self.strict_model,
                               takes_images=self.takes_images)
        if image is not None:
            if parsed.images:
                raise PredictError(parsed.images[0][0], "the request carries an image and another was passed "
                                                        "beside it; this model reads one image per request")
            if not self.takes_images:
                raise PredictError("image", "this model's backbone is text-only (it reads no images); send text only")
            decoded = open_image(image, max_pixels=lim.max_image_pixels)
        elif parsed.images:
            field, spec = parsed.images[0]
            decoded = load_image_spec(field, spec, image_root, lim, parts)
        else:
            decoded = None
        canon = canonical_questions(parsed.questions) if self.canonical else None
        asking = [c.asked for c in canon] if canon is not None else parsed.questions
        scored = [i for i, q in enumerate(asking) if q.k > 1]  # one option: a fixed answer, no model
        if not scored:
            return Prepared(parsed, decoded, None, canon=canon)
        qids = [parsed.qids[i] for i in scored]
        questions = [asking[i] for i in scored]
        votes = vote_plan(questions, self.order_votes)  # the other orders: more rows of the same case
        ids = qids + [qid for qid, orders in zip(qids, votes or []) for _ in orders[1:]]  # an error names its question
        try:
            case = self.model.prepare_case(parsed.state, asked(questions, votes), decoded, ids,
                                           max_tokens=lim.max_tokens)  # rows over the limit: a 413 naming the question
        except RecordError as e:
            raise self._from_record_error(e, qids) from None
        if self.state_cache.enabled and getattr(case, "pixel_values", None) is not None:
            from .model.state_cache import image_digest

            case.image_digest = image_digest(case.pixel_values, case.grid)  # here, off the model thread
        return Prepared(parsed, decoded, case, votes, canon)

    def score(self, prepared: Prepared) -> tuple[list[Any], dict]:
        """The model call for one request: logits per question and usage (serialised by a lock)."""
        return self.score_many([prepared])[0]

    def score_many(self, prepared: list[Prepared]) -> list[Any]:
        """Several requests in one batched model call (`DecisionModel.score_cases`: prefixes batched, suffixes
        batched; each request's logits equal those it gets alone). Returns [(logits, usage)], in order.

        Should the batched call fail, each request is scored alone, so one bad request cannot fail the
        others: its own error takes its place in the list. A request with nothing to score (`case` None)
        gets no logits and 0 tokens. With order votes, a voted question's logits are its combined ones and
        the usage counts every order's suffix."""
        out: list[Any] = [([], {"input_tokens": 0}) for _ in prepared]
        live = [i for i, p in enumerate(prepared) if p.case is not None]
        if live:
            for i, res in zip(live, self._score_cases([prepared[i].case for i in live])):
                out[i] = res if isinstance(res, Exception) else (
                    voted(res[0], prepared[i].votes, self.vote_combine), res[1])
        return out

    def _score_cases(self, cases: list[Any]) -> list[Any]:
        with self._lock:
            try:
                return self.model.score_cases(cases, **self._cache_kw())
            except Exception:
                if len(cases) == 1:
                    raise
        out: list[Any] = []
        for case in cases:
            try:
                with self._lock:
                    out.append(self.model.score_cases([case], **self._cache_kw())[0])
            except Exception as e:  # noqa: BLE001 - reported per request by the caller
                out.append(e)
        return out

    # ------------------------------------------------------------------ state cache
    def _cache_kw(self) -> dict[str, Any]:
        """`score_cases`' state-cache argument (called under the lock): the cache scoped to the model as it is now."""
        if not self.state_cache.enabled:
            return {}
        return {"state_cache": self.state_cache.scoped(_cache_scope(self.model, self.meta))}

    def state_cache_stats(self) -> dict[str, int]:
        """The state cache's counters, a flat dict of ints (what `/metrics` exports): hits, misses (lookups that
        found nothing), entries, bytes (held now), max_bytes (the bound; 0: off), evictions (least recently used
        entries dropped for room), stores, too_large (states larger than the whole bound, never stored)."""
        return self.state_cache.stats()

    def clear_state_cache(self) -> None:
        """Drop every cached state (the counters stay)."""
        self.state_cache.clear()

    def respond(self, prepared: Prepared, logits: list[Any], usage: Mapping[str, Any]) -> dict[str, Any]:
        """The System One response from the logits."""
        r = prepared.request
        answers = {}
        scored = iter(logits)  # the logits of the questions asked with more than one option, in order
        for i, (qid, q) in enumerate(zip(r.qids, r.questions)):
            levels = r.raw_criteria.get(qid) if q.type == "score" else None
            c = prepared.canon[i] if prepared.canon is not None else None
            if q.k == 1:
                answers[qid] = fixed_answer(q, levels)
            elif c is None or c.asked is q:
                answers[qid] = make_answer(q, next(scored), self.temperatures[q.type], levels=levels)
            else:  # asked in canonical form: mapped back to the caller's options
                z, t = answer_logits(c, next(scored) if c.asked.k > 1 else None, self.temperatures)
                answers[qid] = make_answer(q, z, t, levels=levels)
        read_image = prepared.image is not None and prepared.case is not None
        out = {"model": r.model if r.model is not None else self.name, "answers": answers,
               "usage": {"input_tokens": int(usage["input_tokens"]), "output_tokens": 0,
                         "images": 1 if read_image else 0}}
        if r.warnings:
            out["warnings"] = list(r.warnings)
        return out

    def predict(self, request: Mapping[str, Any], image: Any = None, *, image_root: Path | None = None,
                limits: Limits | None = None) -> dict[str, Any]:
        """Answer one request (see the module docstring). Raises PredictError on bad input."""
        prepared = self.prepare(request, image, image_root=image_root, limits=limits)
        logits, usage = self.score(prepared)
        return self.respond(prepared, logits, usage)

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


__all__ = ["Limits", "PredictError", "Predictor", "Prepared", "make_answer", "probabilities", "open_image",
           "parse_request"]
