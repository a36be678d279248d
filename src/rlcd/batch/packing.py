"""Packing: a window's requests about one state scored as one case, several states per model call.

A file of requests often asks many questions about each state, one or a few per line. Scored line by line, each
state's prefix runs once per line (or is copied out of the state cache once per line); scored one HTTP request per
state, it runs once but each state is its own model call. Packed, the lines about one state become one case -- every
line's rows behind one shared prefix -- and the cases of `batch_size` states go through one `Runner.score_cases`
call: their prefixes in one left-padded forward, all their question rows as batched suffix calls
(`model.runner.CaseRunner`; the portable runtime packs rows its own way). States are taken in order of length
(`blocks`), so a call's prefixes are of similar lengths and little is padded, and a call holds at most
`batch_size` states and `max_tokens` processed tokens: memory is bounded by those, not by the file.

Answers do not change: a row's logits depend only on its own prefix and suffix (each case's logits equal those it
gets alone up to float noise: the engines' contract), each line's logits are its own rows' (a line's rows stay
together, in order: its scored questions, then its vote orders, `rlcd.order_votes`), and each line's usage is its
own (`usage.input_tokens` is `model.plan.request_tokens` of its rows: a function of the request alone). A pack whose
call fails is scored line by line (`Predictor.score_many`), so one bad line cannot reject its neighbours.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from rlcd.model.plan import request_tokens
from rlcd.order_votes import voted

DEFAULT_PACK_TOKENS = 16384  # processed tokens per model call (prefixes once, every row's suffix)


@dataclass
class Pack:
    """The lines about one state: `members` (indices into the prepared list, in order) and their rows as one case."""

    members: list[int]
    case: Any

    @property
    def tokens(self) -> int:
        """Tokens the call processes for this pack: the shared prefix once, every row's own part."""
        return request_tokens(self.case.rows)

    @property
    def width(self) -> int:
        """The length its call pads to (the shortest row: about the state's length), for length bucketing."""
        return min(len(r) for r in self.case.rows)


def merged(cases: Sequence[Any]) -> Any:
    """One case holding every row of `cases` (cases about one state and image), in order; the first one's image."""
    if len(cases) == 1:
        return cases[0]
    return dataclasses.replace(cases[0], rows=[r for c in cases for r in c.rows])


def packs(prepared: Sequence[Any], keys: Sequence[str]) -> list[Pack]:
    """The prepared requests that need the model grouped by `keys` (their state and image), first-seen order."""
    groups: dict[str, list[int]] = {}
    for i, (p, k) in enumerate(zip(prepared, keys)):
        if p.case is not None:
            groups.setdefault(k, []).append(i)
    return [Pack(m, merged([prepared[i].case for i in m])) for m in groups.values()]


def blocks(items: Sequence[Pack], batch_size: int, max_tokens: int = DEFAULT_PACK_TOKENS) -> list[list[Pack]]:
    """The model calls: packs by width (then first seen), cut into runs of at most `batch_size` packs and
    `max_tokens` tokens (a pack larger than that is a call of its own)."""
    if batch_size < 1 or max_tokens < 1:
        raise ValueError(f"batch_size and max_tokens must be >= 1, got {batch_size} and {max_tokens}")
    order = sorted(range(len(items)), key=lambda i: (items[i].width, i))
    out: list[list[Pack]] = []
    tokens = 0
    for i in order:
        p = items[i]
        if out and len(out[-1]) < batch_size and tokens + p.tokens <= max_tokens:
            out[-1].append(p)
            tokens += p.tokens
        else:
            out.append([p])
            tokens = p.tokens
    return out


def split(pack: Pack, prepared: Sequence[Any], logits: list[Any], usage: Any, how: str) -> list[tuple[int, Any]]:
    """The pack's logits and usage back per line: [(index, (logits per scored question, usage))]."""
    out, at = [], 0
    for i in pack.members:
        p = prepared[i]
        n = len(p.case.rows)
        own = usage if len(pack.members) == 1 else dataclasses.replace(
            usage, input_tokens=request_tokens(p.case.rows), rows=n, full_tokens=int(p.case.n_tokens))
        out.append((i, (voted(logits[at: at + n], p.votes, how), own)))
        at += n
    if at != len(logits):
        raise RuntimeError(f"a pack of {at} rows came back with {len(logits)} logits")
    return out


def score_packed(predictor: Any, prepared: Sequence[Any], keys: Sequence[str], *, batch_size: int,
                 max_tokens: int = DEFAULT_PACK_TOKENS, on_done: Callable[[int], None] | None = None) -> list[Any]:
    """Per prepared request, in order: (logits per scored question, usage) or the request's own exception --
    what `Predictor.score_many` returns, with each state's requests packed into one case (module docstring).
    `on_done(n)`: called as n more requests are scored (the progress bar)."""
    fixed = iter(predictor.score_many([p for p in prepared if p.case is None]))  # no model call
    out: list[Any] = [None if p.case is not None else next(fixed) for p in prepared]
    for block in blocks(packs(prepared, keys), batch_size, max_tokens):
        results = predictor.scorer.score_cases([pk.case for pk in block])
        for pk, res in zip(block, results):
            if isinstance(res, Exception):  # one line of it may be at fault: each line alone
                for i, r in zip(pk.members, predictor.score_many([prepared[i] for i in pk.members])):
                    out[i] = r
                continue
            for i, r in split(pk, prepared, res[0], res[1], predictor.vote_combine):
                out[i] = r
        if on_done is not None:
            on_done(sum(len(pk.members) for pk in block))
    return out


__all__ = ["DEFAULT_PACK_TOKENS", "Pack", "blocks", "merged", "packs", "score_packed", "split"]
