"""Canonical requests: each question of a request is asked in one canonical form and its answer is mapped back.

Some of what a coherence test asks of a server holds exactly when the server asks the model one form of each
question, whatever form the caller sent (docs/SERVING.md, "Canonical requests"). `canonical(question)` returns
the question as it is asked (`Canonical.asked`) and, per caller option, the asked option that answers it
(`source`) and how many caller options share that asked option (`shares`). Rules, applied in this order:

1. **Duplicates** (choice): options whose descriptions are the same string (exact match; options without a
   description are never duplicates, their ids differ) are asked once, under the id that comes first in the
   canonical order; each copy gets the asked option's probability divided by the number of copies.
2. **Order** (choice): options are asked sorted by (description, id), an option without a description sorting
   as the empty description, so the answer does not depend on the order they were sent in. A choice sent as a
   list of ids (no descriptions) is asked sorted by id.
3. **Yes/no as a noul**: a choice left with exactly two options after rule 1, or a two-level score, whose two
   options *mean* no and yes, or false and true, is asked as the noul `{"type": "noul", "instructions": <the
   same>}`. An option's meaning is its description when it has one, else its id (a score level's is its
   description), stripped of surrounding white space and case-folded; the two meanings must be exactly
   {"no", "yes"} or {"false", "true"} (so "Yes." or "y" do not count, nor a "yes" id described as something
   else). The option meaning yes/true gets P(true), the other P(false), under the noul's temperature.

Every other question (noul, score, a choice already in canonical order with no duplicates) is asked as sent.
The mapping back is exact: with `p` the asked question's probabilities under the asked type's temperature,
the caller's option i gets ``p[source[i]] / shares[i]`` (`answer_logits`). Pure functions, numpy only (the
portable server has no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from rlcd.schema import Question, Record

# (meaning of the false option, meaning of the true option)
YES_NO_MEANINGS = (("no", "yes"), ("false", "true"))


@dataclass(frozen=True)
class Canonical:
    """One question's canonical form: `asked` is what the model is asked; caller option i is answered by asked
    option `source[i]`, shared with `shares[i]` caller options (its copies, itself included)."""

    asked: Question
    source: tuple[int, ...]
    shares: tuple[int, ...]

    @property
    def direct(self) -> bool:
        """Whether caller option i is asked option i, unshared (the asked logits are the answer's, untouched)."""
        return self.shares == (1,) * len(self.shares) and self.source == tuple(range(len(self.source)))


def _meaning(text: Any) -> str | None:
    return text.strip().casefold() if isinstance(text, str) else None


def yes_no(meanings: Sequence[str | None]) -> tuple[int, ...] | None:
    """Per option, 1 where it means yes/true and 0 where it means no/false, when two options mean exactly
    {no, yes} or {false, true}; else None."""
    if len(meanings) != 2:
        return None
    for false, true in YES_NO_MEANINGS:
        if sorted(m or "" for m in meanings) == sorted((false, true)):
            return tuple(1 if m == true else 0 for m in meanings)
    return None


def as_noul(question: Question) -> Question:
    """The noul asked for a yes/no choice or score: the same instructions, no criteria."""
    return Question(type="noul", instructions=question.instructions)


def canonical(question: Question) -> Canonical:
    """`question` in its canonical form (the rules in the module docstring) and the map back to its options."""
    k = question.k
    ident = Canonical(question, tuple(range(k)), (1,) * k)
    if question.type == "score":
        truth = yes_no([_meaning(d) for d in question.descriptions()]) if k == 2 else None
        return Canonical(as_noul(question), truth, (1, 1)) if truth is not None else ident
    if question.type != "choice":
        return ident
    labels, descs = question.labels, question.descriptions()
    order = sorted(range(k), key=lambda i: (descs[i] if descs[i] is not None else "", labels[i]))
    kept: list[int] = []  # caller indices asked, in canonical order
    slot: dict[int, int] = {}  # caller index -> asked position
    first: dict[str, int] = {}  # description -> asked position
    for i in order:
        d = descs[i]
        if d is not None and d in first:
            slot[i] = first[d]
            continue
        slot[i] = len(kept)
        if d is not None:
            first[d] = len(kept)
        kept.append(i)
    source = tuple(slot[i] for i in range(k))
    shares = tuple(sum(1 for j in range(k) if source[j] == source[i]) for i in range(k))
    truth = yes_no([_meaning(descs[i] if descs[i] is not None else labels[i]) for i in kept])
    if truth is not None:
        return Canonical(as_noul(question), tuple(truth[s] for s in source), shares)
    if isinstance(question.criteria, dict):
        criteria: Any = {labels[i]: descs[i] for i in kept}
    else:
        criteria = [labels[i] for i in kept]
    asked = question.model_copy(update={"criteria": criteria})
    out = Canonical(asked, source, shares)
    return ident if out.direct else out


def canonical_questions(questions: Sequence[Question]) -> list[Canonical]:
    """`canonical` of each question, in order."""
    return [canonical(q) for q in questions]


def asked_forms(questions: Sequence[Question], on: bool = True) -> tuple[list[Canonical] | None, list[Question]]:
    """(canonical forms, the questions the model is asked): with `on`, each question's `canonical` form and its
    `asked` question; else (None, the questions as sent) -- `rlcd serve --as-asked`."""
    if not on:
        return None, list(questions)
    canon = canonical_questions(questions)
    return canon, [c.asked for c in canon]


def fold(c: Canonical, values: Sequence[float]) -> list[float]:
    """A distribution over the caller's options folded onto the asked ones: asked option j gets the sum of the
    caller options it answers (``sum_{i: source[i] = j} values[i]``). The exact target of the asked form: the
    mapping back gives each caller option ``p[source[i]] / shares[i]``, whose fold is ``p`` again."""
    out = [0.0] * c.asked.k
    for i, v in enumerate(values):
        out[c.source[i]] += float(v)
    return out


def canonical_record(rec: Record) -> Record:
    """`rec` asked in its canonical form: the question `canonical(rec.question).asked`, its target and posterior
    folded onto the asked options (`fold`); the same id, state, group and case. `rec` itself when the question is
    asked as written. What `rlcd evaluate`, `rlcd calibrate`, the export gates and `evaluate --remote` score by
    default: the rows of a run's evaluation are the rows its server is asked (docs/SERVING.md)."""
    c = canonical(rec.question)
    if c.asked is rec.question:
        return rec
    posterior = None if rec.posterior is None else fold(c, rec.posterior)
    return rec.model_copy(update={"question": c.asked, "target": fold(c, rec.target), "posterior": posterior})


def canonical_records(records: Sequence[Record], on: bool = True) -> list[Record]:
    """`canonical_record` of each record (with `on`; else the records as written: `--as-asked`)."""
    return [canonical_record(r) for r in records] if on else list(records)


def answer_logits(c: Canonical, logits: Any, temperatures: Mapping[str, float]) -> tuple[Any, float]:
    """(logits, temperature) over the caller's options whose softmax(logits / temperature) is the mapped-back
    answer: ``p_caller[i] = p[source[i]] / shares[i]``, with ``p = softmax(logits / T_asked)`` the asked
    question's probabilities (`logits` None for a one-option asked question: p = [1]).

    Direct (option i asked as option i: a question asked as sent, or a [no, yes] score asked as a noul): the logits
    themselves and the asked type's temperature (a question asked as sent is answered as it always was). No
    shared options: the logits permuted (`z[source]`), still under the asked type's temperature (a noul's for a
    yes/no question), so the answer is exactly the asked one's. Shared options: log p_caller, temperature 1."""
    t = float(temperatures[c.asked.type])
    if c.direct and logits is not None:
        return logits, t
    if logits is None:
        z = np.zeros(1)
    else:
        z = np.asarray(logits.tolist() if hasattr(logits, "tolist") else logits, dtype=np.float64)
    src = np.asarray(c.source, dtype=int)
    if all(s == 1 for s in c.shares):
        return z[src], t
    y = z / t
    p = np.exp(y - y.max())
    p /= p.sum()
    return np.log(p[src]) - np.log(np.asarray(c.shares, dtype=np.float64)), 1.0


__all__ = ["Canonical", "YES_NO_MEANINGS", "answer_logits", "as_noul", "asked_forms",
           "canonical", "canonical_questions", "canonical_record", "canonical_records", "fold", "yes_no"]
