"""State encoding: a request's questions tokenised into one case, and the state cache that lets a later request
about the same state skip its prefix.

All questions of a request are one case (`Runner.prepare_case`): the shared prefix (chat-template head,
image, state) runs once, the image is encoded once, the question suffixes run batched. A voted question's other
orders (`rlcd.order_votes`: `vote_plan`, `asked`) are more rows of the same case, after the scored questions,
question by question: more suffixes on the same prefix. A tokenising error (`RecordError`) becomes a
`PredictError` naming the request's field and question (`from_record_error`; a row over the token limit is 413).

The state cache (`rlcd.serving.cache`, `state_cache_mb`, default 256 MiB, 0 turns it off): the decoder state
of each state's prefix is kept, LRU bounded in bytes, so a later request about the same state and image runs only
its questions. Keys are the exact prefix token ids and the image's pixel digest (computed in `encode`, off the
model thread), scoped by `cache_scope` (the export's identity and the runner's `identity()`: the model's info, the
prompt frame, LoRA and merge state, the placement, the parameters' version counters): another model, frame, LoRA
state or image never hits. The scope is computed at every model call (`StateEncoder.cache_kw`, under the scoring lock), so a weight changed in place
between two calls moves it. `usage.input_tokens` does not depend on the cache: a hit skips the prefix's forward,
not its count.

The row cache (`row_cache_mb`, default 0: off; `rlcd serve --row-cache-mb N`): the features of every row answered
(`state_cache.RowFeatures`: [1 + k] hidden states, 2.25 KiB each for SmolLM2-135M in float32), LRU bounded in
bytes, same scope, keyed by the row's whole tokens, the image and the positions read (`state_cache.row_key`). A later request that asks a question already answered about the same state and image,
word for word once rendered, runs only the head on it; a request whose every question was answered runs no backbone
forward. JevBench re-sends a case's batch with a few questions rewritten: 74.6 % of jevbench-mini's rows repeat one
(`benchmarks/peers/jevbench/README.md`). Its answers are the earlier ones, which equal the cache-off answers up to
float noise (the row ran in another batch), not bit for bit as the state cache's lone requests do: hence off by
default. Its usage is the request's, as with the state cache.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Mapping, Sequence

from rlcd.order_votes import asked, vote_plan
from rlcd.schema import Question, RecordError
from rlcd.serving.cache import ScopedStateCache, StateCache
from rlcd.serving.errors import PredictError
from rlcd.serving.runner import Case, Runner

DEFAULT_STATE_CACHE_MB = 256  # MiB; a 250-token SmolLM2-135M state takes 12.5 MiB in float32 (docs/SERVING.md)


def state_cache_bytes(mb: float, name: str = "state_cache_mb", what: str = "the state cache") -> int:
    """`state_cache_mb` (mebibytes, 0 = off) in bytes; a negative, non-finite or non-number value is a ValueError
    (naming `name`: `row_cache_mb` for the row cache)."""
    if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not math.isfinite(mb) or mb < 0:
        raise ValueError(f"{name} must be a number >= 0 (0 turns {what} off), got {mb!r}")
    return int(mb * (1 << 20))


def cache_scope(runner: Runner, meta: Mapping[str, Any]) -> str:
    """The request caches' scope for `runner`'s model as it is now: a digest of the export's identity (backbone spec
    and fingerprint, checkpoint sha256, recipe) and the runner's `identity()` (for a `CaseRunner`: the model's
    `info` -- prompt frame and version, LoRA config and merge state, head --, its placement, its parameters' count and
    in-place version counters: a weight loaded or changed in place moves them). Any change gives a new scope, so old
    entries are never hit."""
    ident = {"meta": {k: meta.get(k) for k in ("model", "model_seed", "backbone_fingerprint", "checkpoint_sha256",
                                              "recipe")}, **runner.identity()}
    return hashlib.blake2b(json.dumps(ident, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


def from_record_error(e: RecordError, qids: Sequence[str]) -> PredictError:
    """A tokenising error of the row of question `e.row` as the request's error: the field as a path into the
    request (`questions.<qid>.<field>`, `state`, `image`, `request`), 413 for a row over the token limit, else 422."""
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


class StateEncoder:
    """Owns the request caches of one served model and turns a request's questions into its case.

    `meta`: the export's metadata (part of the cache scope). The caches' entries need torch only when a state is
    stored: a portable (ONNX) Predictor, whose engine keeps no state, never imports it."""

    def __init__(self, meta: Mapping[str, Any], state_cache_mb: float = DEFAULT_STATE_CACHE_MB,
                 row_cache_mb: float = 0):
        self.cache = StateCache(state_cache_bytes(state_cache_mb))
        self.rows = StateCache(state_cache_bytes(row_cache_mb, "row_cache_mb", "the row cache"))
        self.meta = meta

    def encode(self, runner: Runner, state: Any, questions: Sequence[Question], qids: Sequence[str], image: Any = None,
               *, max_tokens: int, order_votes: int = 1) -> tuple[Case, list[list[list[int]]] | None]:
        """(case, votes): `questions` (each with more than one option; `qids` their ids) tokenised by `runner` into
        one case with their vote orders' rows (`order_votes` N; votes None when nothing is voted), and the image's
        cache key set when the cache is on. Raises PredictError (`from_record_error`)."""
        votes = vote_plan(questions, order_votes)
        # every row names its question, so an error in a vote order's row names it too
        ids = list(qids) + [qid for qid, orders in zip(qids, votes or []) for _ in orders[1:]]
        try:  # keyed: the image's cache key computed here, off the model thread
            case = runner.prepare_case(state, asked(questions, votes), image, ids, max_tokens=max_tokens,
                                       keyed=self.cache.enabled or self.rows.enabled)
        except RecordError as e:
            raise from_record_error(e, list(qids)) from None
        return case, votes

    def cache_kw(self, runner: Runner) -> dict[str, ScopedStateCache]:
        """`score_cases`' cache arguments (call it under the scoring lock): the state cache and the row cache,
        each scoped to `runner`'s model as it is now, those that are on; {} when both are off."""
        if not (self.cache.enabled or self.rows.enabled):
            return {}
        scope = cache_scope(runner, self.meta)
        kw = {"state_cache": self.cache.scoped(scope)} if self.cache.enabled else {}
        if self.rows.enabled:
            kw["row_cache"] = self.rows.scoped(scope)
        return kw

    def stats(self) -> dict[str, int]:
        """The cache's counters (`StateCache.stats`)."""
        return self.cache.stats()

    def row_stats(self) -> dict[str, int]:
        """The row cache's counters (`StateCache.stats`: an entry is one row's features)."""
        return self.rows.stats()

    def clear(self) -> None:
        """Drop every cached state and row (the counters stay)."""
        self.cache.clear()
        self.rows.clear()


__all__ = ["DEFAULT_STATE_CACHE_MB", "StateEncoder", "cache_scope", "from_record_error",
           "state_cache_bytes"]
