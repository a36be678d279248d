"""Scoring: the model call for a batch of prepared requests, serialised, with one request's failure kept its own.

`Scorer.score_many` runs every request that needs the model in one `Runner.score_cases` call (prefixes
batched, suffixes batched: each request's logits equal those it gets alone, up to float noise), under a lock, so a
shared Predictor is thread-safe while validation and image decoding run outside it. Should the batched call fail,
each request is scored alone, so one bad request cannot fail the others: its own exception takes its place in the
list. A request with nothing to score (`case` None: every question has one option) gets no logits and 0 tokens and
runs no model.

Order votes (`rlcd.order_votes`): a voted choice question's rows (its other orders, after the scored questions of
the case) are read back as one vector, `combine(..., how)` aligned to the question's own option order: "logmean"
(default) the normalised mean of the orders' log-probabilities, "mean" the log of their mean probability. noul and
score questions are never voted. The usage counts every order's suffix (they are processed tokens).

Answers are deterministic: the model is in eval mode and the scorer's centring buffers are frozen, so the same
request gives the same logits whatever came before (< 1e-4 in probability, tested); the only state a call leaves is
the state cache (`serving.state_encoding`), whose argument `cache_kw(runner)` is taken under the lock.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping, Sequence

from rlcd.order_votes import DEFAULT_COMBINE, voted
from rlcd.serving.cache import ScopedStateCache
from rlcd.serving.prepared import Prepared
from rlcd.serving.runner import Case, Runner, Usage

Scored = tuple[list[Any], Usage]  # (logits per question, usage)


class Scorer:
    """The model calls of one served model. `runner`: a callable returning the engine (a lazy Predictor loads it on
    the first call that needs it); `cache_kw(runner)`: the extra `score_cases` arguments (the scoped caches)."""

    def __init__(self, runner: Callable[[], Runner],
                 cache_kw: Callable[[Runner], Mapping[str, ScopedStateCache]] | None = None):
        self._runner = runner
        self._cache_kw = cache_kw or (lambda runner: {})
        self.lock = threading.Lock()  # around every model call

    def _call(self, cases: Sequence[Case]) -> list[Scored]:
        runner = self._runner()
        return runner.score_cases(list(cases), **self._cache_kw(runner))

    def score_cases(self, cases: Sequence[Case]) -> list[Scored | Exception]:
        """[(logits, usage) or the exception that case raised alone], in order; a lone case's error is raised."""
        with self.lock:
            try:
                return self._call(cases)
            except Exception:
                if len(cases) == 1:
                    raise
        out: list[Scored | Exception] = []
        for case in cases:
            try:
                with self.lock:
                    out.append(self._call([case])[0])
            except Exception as e:  # noqa: BLE001 - reported per request by the caller
                out.append(e)
        return out

    def score_many(self, prepared: Sequence[Prepared], how: str = DEFAULT_COMBINE) -> list[Scored | Exception]:
        """[(logits per scored question, usage) or an exception] per request, in order; a voted question's logits
        are its orders combined by `how`."""
        out: list[Scored | Exception] = [([], Usage()) for _ in prepared]
        live = [i for i, p in enumerate(prepared) if p.case is not None]
        if live:
            for i, res in zip(live, self.score_cases([prepared[i].case for i in live])):
                out[i] = res if isinstance(res, Exception) else (voted(res[0], prepared[i].votes, how), res[1])
        return out


__all__ = ["Scorer"]
