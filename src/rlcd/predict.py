"""Predictor: load a run's `export/` and answer System One (`/v1/systemone`) requests.

The request format is transformers' (`rlcd.serving.request`: `{"model"?, "state", "questions", "assets"?}` plus
rlcd's `image` alias). The engine is a `serving.runner.Runner`: a `DecisionModel` under a `model.runner.CaseRunner`
(torch), or the portable runtime's `PortableModel` (onnxruntime, no torch). A request goes through three steps:
`prepare` (validation, image decoding, canonical forms and tokenising: no model call, safe in threads), `score` (the
model call, under a lock; `score_many` batches several requests) and `respond`; `predict` runs the three. Each step is a piece of `rlcd.serving`, with its own
docstring and tests, shared by the server, `rlcd predict`, the batch scorer and the ONNX runtime:

* `serving.canonical`       request canonicalisation: each question asked in one canonical form (`canonical`,
                            default on; `rlcd serve --as-asked` turns it off);
* `serving.state_encoding`  the questions tokenised into one case (order votes as extra rows), the state
                            cache of each state's prefix (`state_cache_mb`, `state_cache_stats`) and the row
                            cache of answered rows (`row_cache_mb`, `row_cache_stats`);
* `serving.scoring`         the batched model call under the lock, one request's failure kept its own, order
                            votes combined (`order_votes`, `vote_combine`);
* `serving.mapping`         logits -> the System One response: fixed answers, canonical answers mapped back to the
                            caller's ids, the type's temperature, usage, warnings;
* `serving.prepared`        `Prepared`, what the three steps hand on.

Validation errors raise `PredictError` (a `RecordError`): `.field` is a path into the request
(`"questions.q1.criteria"`), `.question` the question id where there is one, `.status` the HTTP status. Limits
(`Limits`): questions per request, candidates per question, tokens per row (image tokens included), request bytes
and image pixels.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from .device import Placement
from .order_votes import DEFAULT_COMBINE, check_combine, check_votes
from .schema import QUESTION_TYPES
from .serving import mapping
from .serving.answer import make_answer, probabilities
from .serving.canonical import asked_forms
from .serving.errors import PredictError
from .serving.images import open_image, request_image
from .serving.limits import Limits
from .serving.prepared import Prepared
from .serving.request import parse_request
from .serving.runner import Runner, Usage
from .serving.cache import StateCache
from .serving.scoring import Scored, Scorer
from .serving.state_encoding import DEFAULT_STATE_CACHE_MB, StateEncoder
# importable from here as before the pieces were split out (tests, benches, docs name them so)
from .serving.state_encoding import cache_scope as _cache_scope  # noqa: F401
from .serving.state_encoding import from_record_error, state_cache_bytes  # noqa: F401

if TYPE_CHECKING:
    from .model.decision import DecisionModel


def as_runner(model: Runner | DecisionModel) -> Runner:
    """The engine a Predictor drives: a `Runner` as it is (the portable runtime, a `CaseRunner`), a `DecisionModel`
    under a `CaseRunner` (torch is imported only then: the portable server runs without it)."""
    if isinstance(model, Runner):
        return model
    from .model.runner import CaseRunner

    return CaseRunner(model)


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


class Predictor:
    """Answers typed-decision requests with one merged, calibrated model: the `rlcd.serving` pieces composed (see
    the module docstring). Thread-safe: the model calls are serialised by the scorer's lock."""

    def __init__(self, model: Runner | DecisionModel | None, meta: Mapping[str, Any], *, name: str | None = None,
                 limits: Limits | None = None, strict_model: bool = False,
                 loader: Callable[[], Runner | DecisionModel] | None = None,
                 state_cache_mb: float = DEFAULT_STATE_CACHE_MB, order_votes: int = 1, canonical: bool = True,
                 vote_combine: str = DEFAULT_COMBINE, row_cache_mb: float = 0):
        self.temperatures = mapping.check_temperatures(meta)
        if model is None and loader is None:
            raise ValueError("a Predictor needs a model or a loader of one")
        self.order_votes, self.canonical = check_votes(order_votes), bool(canonical)
        self.vote_combine = check_combine(vote_combine)
        self.meta = dict(meta)
        self.encoder = StateEncoder(self.meta, state_cache_mb, row_cache_mb)
        self.scorer = Scorer(lambda: self.runner, self.encoder.cache_kw)
        self._runner = as_runner(model) if model is not None else None
        self._loader, self._loading = loader, threading.Lock()
        self.name = name or str(meta.get("model") or "rlcd")
        self.limits = limits or Limits()
        self.strict_model = bool(strict_model)
        self.takes_images = (bool(self._runner.supports_images) if self._runner is not None
                             else _reads_images(meta))
        self.release_date: str | None = None  # /v1/models: the day the export was written (from_run sets it)
        if self._runner is not None:
            self._runner.eval()

    @property
    def runner(self) -> Runner:
        """The engine; a lazy Predictor (`from_run(lazy=True)`) loads its model when a request first needs it."""
        if self._runner is None:
            with self._loading:
                if self._runner is None:
                    runner = as_runner(self._loader())
                    runner.eval()
                    self._runner = runner
        return self._runner

    @property
    def model(self) -> Runner | DecisionModel:
        """The model the engine runs, loaded if need be: a `CaseRunner`'s `DecisionModel` (tests and benches reach
        its tokenizer, encoder and weights), else the engine itself (the portable runtime is its own model)."""
        runner = self.runner
        return getattr(runner, "model", runner)

    @property
    def loaded(self) -> bool:
        """Whether the model is in memory (a lazy Predictor's is not until a request needs it): /ready reads it."""
        return self._runner is not None

    @property
    def state_cache(self) -> StateCache:
        """The state cache (`rlcd.serving.cache.StateCache`, owned by `serving.state_encoding`)."""
        return self.encoder.cache

    @classmethod
    def from_run(cls, path: str | Path, *, placement: Placement | None = None, name: str | None = None,
                 limits: Limits | None = None, strict_model: bool = False, lazy: bool = False,
                 state_cache_mb: float = DEFAULT_STATE_CACHE_MB, order_votes: int = 1,
                 canonical: bool = True, vote_combine: str = DEFAULT_COMBINE,
                 row_cache_mb: float = 0) -> "Predictor":
        """Load from a run dir (its `export/`) or an export dir (merged model, temperatures). `lazy`: read only
        the export's metadata now and load the model when a request first needs it (`rlcd predict`: a request
        whose every question has one option is answered without it)."""
        from .export import load_export, read_export_meta
        from .run import find_export

        kw = dict(name=name or _run_name(Path(path)), limits=limits, strict_model=strict_model,
                  state_cache_mb=state_cache_mb, order_votes=order_votes, canonical=canonical,
                  vote_combine=vote_combine, row_cache_mb=row_cache_mb)
        if lazy:
            meta = read_export_meta(find_export(Path(path)))
            predictor = cls(None, meta, loader=lambda: load_export(Path(path), placement=placement)[0], **kw)
        else:
            predictor = cls(*load_export(Path(path), placement=placement), **kw)
        predictor.release_date = _export_date(Path(path))
        return predictor

    @property
    def served_names(self) -> tuple[str, ...]:
        """Names a strict server accepts in `model`: the served name and the backbone spec."""
        return (self.name, str(self.meta.get("model")))

    def info(self) -> dict[str, Any]:
        """What `/v1/models` shows: name, backbone, temperatures, limits, question types."""
        bb = self.meta.get("backbone") or {}
        return {
            "id": self.name, "object": "model", "backbone": self.meta.get("model"), "preset": bb.get("preset"),
            "revision": bb.get("revision"),
            "license": bb.get("license"),  # the backbone weights' licence as its preset recorded it (None: unknown)
            "temperatures": dict(self.temperatures), "question_types": list(QUESTION_TYPES),
            "selected_step": self.meta.get("selected_step"), "checkpoint_sha256": self.meta.get("checkpoint_sha256"),
            "limits": self.limits.to_dict(), "strict_model": self.strict_model, "images": self.takes_images,
            "confidence": "transformers' System One definitions: choice (p_max - 1/K) / (1 - 1/K); score "
                          "1 - E|level - argmax| / E_uniform|level - middle|; noul has none (its answer is P(true))",
            "placement": self._runner.placement if self._runner is not None else None,
            "order_votes": self.order_votes,
            "vote_combine": self.vote_combine, "canonical_requests": self.canonical,
            "row_cache_mb": self.encoder.rows.max_bytes / (1 << 20),
        }

    def prepare(self, request: Any, image: Any = None, *, image_root: Path | None = None,
                limits: Limits | None = None, parts: Mapping[str, bytes] | None = None) -> Prepared:
        """Validate `request`, decode its image (from `image`, the request's `image`, an asset or a part), put its
        questions in canonical form and tokenise them: everything but the model call, safe to run in threads.
        `parts`: the image parts of a multipart body by name (an asset's `{"part": NAME}`)."""
        lim = limits or self.limits
        parsed = parse_request(request, lim, served=self.served_names, strict_model=self.strict_model,
                               takes_images=self.takes_images)
        decoded = request_image(parsed, image, takes_images=self.takes_images, limits=lim, image_root=image_root,
                                parts=parts)
        canon, asking = asked_forms(parsed.questions, self.canonical)
        scored = [i for i, q in enumerate(asking) if q.k > 1]  # one option: a fixed answer, no model
        if not scored:
            return Prepared(parsed, decoded, None, canon=canon)
        case, votes = self.encoder.encode(self.runner, parsed.state, [asking[i] for i in scored],
                                          [parsed.qids[i] for i in scored], decoded, max_tokens=lim.max_tokens,
                                          order_votes=self.order_votes)
        return Prepared(parsed, decoded, case, votes, canon)

    def score(self, prepared: Prepared) -> tuple[list[Any], Usage]:
        """The model call for one request: logits per question and usage (serialised by a lock)."""
        return self.score_many([prepared])[0]

    def score_many(self, prepared: list[Prepared]) -> list[Scored | Exception]:
        """Several requests in one batched model call: [(logits, usage) or the request's own exception], in order
        (`serving.scoring.Scorer.score_many`)."""
        return self.scorer.score_many(prepared, self.vote_combine)

    def respond(self, prepared: Prepared, logits: list[Any], usage: Mapping[str, Any]) -> dict[str, Any]:
        """The System One response from the logits (`serving.mapping.respond`)."""
        return mapping.respond(prepared, logits, usage, temperatures=self.temperatures, name=self.name)

    def predict(self, request: Mapping[str, Any], image: Any = None, *, image_root: Path | None = None,
                limits: Limits | None = None) -> dict[str, Any]:
        """Answer one request (see the module docstring). Raises PredictError on bad input."""
        prepared = self.prepare(request, image, image_root=image_root, limits=limits)
        logits, usage = self.score(prepared)
        return self.respond(prepared, logits, usage)

    def state_cache_stats(self) -> dict[str, int]:
        """The state cache's counters, a flat dict of ints (what `/metrics` exports): hits, misses (lookups that
        found nothing), entries, bytes (held now), max_bytes (the bound; 0: off), evictions (least recently used
        entries dropped for room), stores, too_large (states larger than the whole bound, never stored)."""
        return self.encoder.stats()

    def row_cache_stats(self) -> dict[str, int]:
        """The row cache's counters (`serving.state_encoding`: the features of answered rows), as
        `state_cache_stats`: an entry is one row."""
        return self.encoder.row_stats()

    def clear_state_cache(self) -> None:
        """Drop every cached state and row (the counters stay)."""
        self.encoder.clear()


__all__ = ["Limits", "PredictError", "Predictor", "Prepared", "make_answer", "probabilities", "open_image",
           "parse_request"]
