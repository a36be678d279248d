"""`Prepared`: what a request's preparation hands to scoring and to mapping answers back.

A request is answered in three steps that may run on different threads (`rlcd.predict.Predictor`): preparation
(validation, image decoding, canonical forms, tokenising: no model call), scoring (`serving.scoring`, the model
under its lock, batched across requests by the server's batcher) and mapping answers back (`serving.mapping`).
This record is the one thing the three share, so each piece can be built and tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcd.serving.request import ParsedRequest
from rlcd.serving.runner import Case


@dataclass
class Prepared:
    """A request ready for the model: parsed, its image decoded (or None), its rows tokenised
    (`case`, a `Runner.prepare_case` result)."""

    request: ParsedRequest
    image: Any
    case: Case | None = None  # None when no question needs the model (each has a single option)
    # order votes: per scored question (the case's first rows, in order), the orders it is asked in; the rows
    # of the orders after the first follow the scored questions in the case, question by question. None: no votes
    votes: list[list[list[int]]] | None = None
    # canonical requests: per request question, its canonical form (`serving.canonical`); None: asked as sent
    canon: list[Any] | None = None

    def size(self) -> tuple[int, int]:
        """(questions, tokens) for the batcher's bounds; a voted question counts once per order it is asked in."""
        extra = sum(len(orders) - 1 for orders in self.votes) if self.votes else 0
        return len(self.request.qids) + extra, int(self.case.n_tokens) if self.case is not None else 0


__all__ = ["Prepared"]
