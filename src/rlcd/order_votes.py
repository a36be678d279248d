"""Order votes: a choice question asked with its options in several orders, answered in candidate space.

A choice answer should not depend on the order its options are listed in. With ``order_votes=N`` a choice
question of K options is also asked in N-1 other orders (`vote_orders`): for N = 2 the reversal, else the
cyclic shifts 1..N-1 (shift s puts original option ``(j + s) % K`` at position j). N is capped at K (the
K cyclic shifts are all the distinct ones; for K = 2 the reversal is the shift). Each order's answer is mapped
back to the question's own option order and the orders are combined (`combine`, `how`):

    logmean (default):  logits_vote = m - logsumexp(m),  m = mean_o log_softmax(z_o)[aligned]
    mean:               logits_vote = log p_vote,        p_vote = mean_o softmax(z_o)[aligned]

logmean is the normalised geometric mean of the orders' probabilities (PriDe, Zheng et al., ICLR 2024; AnyJev's
`permute`): an additive position bias (b_j added to the logit shown at position j) adds mean_o b_{pos_o(i)} to
option i's log-mean, which is the same for every option -- so it cancels exactly -- when the orders show every option
at every position equally often (N = K: all K cyclic shifts; K = 2: the reversal), and is averaged otherwise. The
mean of probabilities never cancels it exactly. Measured on the demo run: docs/SERVING.md.

The voted logits replace the question's raw logits everywhere downstream (temperatures, answers, metrics),
so a temperature fitted on voted logits calibrates the voted answer. ``noul`` and ``score`` options carry
meaning in their order (false/true, ascending levels) and are never voted. ``N = 1`` is the plain answer.

For a list of questions (a request's, a case's records): `vote_plan` gives each its orders, `asked` the questions
as asked (the given ones, then the other orders, question by question: more rows of the same case, so the state
runs once) and `voted` reads the asked rows' logits back into one voted vector per question.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from rlcd.schema import Question

MAX_VOTES = 8  # the most orders one question is asked in (each is one more suffix on the shared prefix)
COMBINES = ("logmean", "mean")  # how the orders' answers are combined (`combine`)
DEFAULT_COMBINE = "logmean"


def check_combine(how: str) -> str:
    """`how` as a vote combination (one of COMBINES), else a ValueError naming them."""
    if how not in COMBINES:
        raise ValueError(f"vote_combine must be one of {', '.join(COMBINES)}, got {how!r}")
    return how


def check_votes(n: int) -> int:
    """`n` as an order-vote count (1..MAX_VOTES), else a ValueError naming the rule."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_VOTES:
        raise ValueError(f"order_votes must be an integer from 1 (no votes) to {MAX_VOTES}, got {n!r}")
    return n


def vote_orders(k: int, n: int) -> list[list[int]]:
    """The orders a K-option choice question is asked in under `n` votes, the given order first.

    ``perm[j]`` is the original option index shown at position j. N = 2: the reversal; N >= 3: cyclic
    shifts 1..N-1. Capped at K orders (fewer for K < N); K = 1 has only its own order."""
    check_votes(n)
    ident = list(range(k))
    if k < 2 or n == 1:
        return [ident]
    if n == 2:
        return [ident, ident[::-1]]
    return [ident] + [[(j + s) % k for j in range(k)] for s in range(1, min(n, k))]


def permute_question(question: Question, perm: Sequence[int]) -> Question:
    """The choice question with its options in order `perm` (a mapping keeps each description with its label)."""
    if question.type != "choice":
        raise ValueError(f"only choice questions are asked in other orders, not {question.type}")
    labels = question.labels
    if sorted(int(i) for i in perm) != list(range(len(labels))):
        raise ValueError(f"{list(perm)} is not an order of {len(labels)} options")
    c = question.criteria
    criteria: Any = {labels[i]: c[labels[i]] for i in perm} if isinstance(c, dict) else [labels[i] for i in perm]
    return question.model_copy(update={"criteria": criteria})


def align(values: Sequence[float], perm: Sequence[int]) -> np.ndarray:
    """Values over a permuted order mapped back to the original order: ``out[perm[j]] = values[j]``."""
    v = np.asarray(values, dtype=np.float64)
    out = np.empty_like(v)
    out[np.asarray(perm, dtype=int)] = v
    return out


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def _log_softmax(z: np.ndarray) -> np.ndarray:
    y = z - z.max()
    return y - np.log(np.exp(y).sum())


def combine(logits_per_order: Sequence[Sequence[float]], orders: Sequence[Sequence[int]],
            how: str = DEFAULT_COMBINE) -> list[float]:
    """The voted logits in the original option order (float64), normalised log-probabilities:
    `how` "logmean": ``m - logsumexp(m)`` with ``m = mean_o log_softmax(z_o)[aligned]``; "mean":
    ``log mean_o softmax(z_o)[aligned]``.

    `logits_per_order[o]` are the raw logits of the question asked in `orders[o]` (positions of that order)."""
    check_combine(how)
    if len(logits_per_order) != len(orders) or not orders:
        raise ValueError(f"{len(logits_per_order)} logit rows for {len(orders)} orders")
    if how == "logmean":
        m = np.mean([align(_log_softmax(np.asarray(z, dtype=np.float64)), perm)
                     for z, perm in zip(logits_per_order, orders)], axis=0)
        return [float(x) for x in _log_softmax(m)]
    p = np.mean([align(_softmax(np.asarray(z, dtype=np.float64)), perm)
                 for z, perm in zip(logits_per_order, orders)], axis=0)
    return [float(x) for x in np.log(np.maximum(p, 1e-300))]


def vote_plan(questions: Sequence[Question], n: int) -> list[list[list[int]]] | None:
    """Per question, the orders it is asked in: `vote_orders(K, n)` for a choice question, its own order alone for
    noul and score. None when nothing is voted (n = 1, or no choice question of K > 1), so that work runs as plain."""
    if check_votes(n) == 1:
        return None
    plan = [vote_orders(q.k, n) if q.type == "choice" else [list(range(q.k))] for q in questions]
    return plan if any(len(orders) > 1 for orders in plan) else None


def asked(questions: Sequence[Question], plan: list[list[list[int]]] | None) -> list[Question]:
    """The questions as asked: `questions` in their own order, then each voted question's other orders, question by
    question (what `voted` reads back)."""
    if plan is None:
        return list(questions)
    return list(questions) + [permute_question(q, perm) for q, orders in zip(questions, plan) for perm in orders[1:]]


def voted(logits: Sequence[Any], plan: list[list[list[int]]] | None, how: str = DEFAULT_COMBINE) -> list[Any]:
    """The logits of the `asked` questions -> one vector per question: a voted question's orders `combine`d by `how`
    (a float64 numpy array), any other question's logits as they came (the same object)."""
    if plan is None:
        return list(logits)
    extra = iter(logits[len(plan):])
    out = []
    for own, orders in zip(logits, plan):
        if len(orders) == 1:
            out.append(own)
            continue
        rows = [own] + [next(extra) for _ in orders[1:]]
        out.append(np.asarray(combine([np.asarray(r, dtype=np.float64) for r in rows], orders, how)))
    return out


__all__ = ["COMBINES", "DEFAULT_COMBINE", "MAX_VOTES", "align", "asked", "check_combine", "check_votes", "combine", "permute_question", "vote_orders", "vote_plan",
           "voted"]
