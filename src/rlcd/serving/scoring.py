"""Scoring: the model call for a batch of prepared requests, serialised, with one request's failure kept its own.

`Scorer.score_many` runs every request that needs the model in one `DecisionModel.score_cases` call (prefixes
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
the state cache (`serving.state_encoding`), whose argument `cache_kw(model)` is taken under the lock.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping, Sequence

from rlcd.order_votes import DEFAULT_COMBINE, voted
from rlcd.serving.prepared import Prepared


class Scorer:
    """The model calls of one served model. `model`: a callable returning the model (a lazy Predictor loads it on
    the first call that needs it); `cache_kw(model)`: the extra `score_cases` arguments (the scoped state cache)."""

    def __init__(self, model: Callable[[], Any], cache_kw: Callable[[Any], Mapping[str, Any]] | None = None):
        self._model = model
        self._cache_kw = cache_kw or (lambda model: {})
        self.lock = threading.Lock()  # around every model call

    def _call(self, cases: Sequence[Any]) -> list[Any]:
        model = self._model()
        return model.score_cases(list(cases), **self._cache_kw(model))

    def score_cases(self, cases: Sequence[Any]) -> list[Any]:
        """[(logits, usage) or the exception that case raised alone], in order; a lone case's error is raised."""
        with self.lock:
            try:
                return self._call(cases)
            except Exception:
                if len(cases) == 1:
                    raise
        out: list[Any] = []
        for case in cases:
            try:
                with self.lock:
                    out.append(self._call([case])[0])
            except Exception as e:  # noqa: BLE001 - reported per request by the caller
                out.append(e)
        return out

    def score_many(self, prepared: Sequence[Prepared], how: str = DEFAULT_COMBINE) -> list[Any]:
        """[(logits per scored question, usage) or an exception] per request, in order; a voted question's logits
        are its orders combined by `how`."""
        out: list[Any] = [([], {"input_tokens": 0}) for _ in prepared]
        live = [i for i, p in enumerate(prepared) if p.case is not None]
        if live:
            for i, res in zip(live, self.score_cases([prepared[i].case for i in live])):
                out[i] = res if isinstance(res, Exception) else (voted(res[0], prepared[i].votes, how), res[1])
        return out


__all__ = ["Scorer"]
