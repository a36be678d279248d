"""A System One answer mapped back to a probability for each of the question's candidates.

What a remote system sends is checked, never trusted: an answer whose type differs from the question's, a
probability that is not a finite number in [0, 1], a label the question does not have, or a distribution that
does not sum to 1 (within SUM_TOL) is *unusable*, with the reason. Read in candidate order
(`Question.labels`):

* choice: ``probabilities`` {label: p} when sent (every label, nothing else); else *reconstructed* from
  ``choice`` + ``confidence`` by inverting transformers' confidence, ``p_max = 1/K + c (1 - 1/K)``, the rest
  shared equally (the least informative distribution with that top answer and confidence);
* noul: ``noul`` = P(true), so [1 - p, p] over ["false", "true"];
* score: ``probabilities`` {"0".. "K-1": p} when sent; else *reconstructed* from the expected ``score`` s in
  [0, K-1] as the two levels around it, ``p_floor(s) = 1 - frac(s)``, ``p_ceil(s) = frac(s)`` (the narrowest
  distribution with that mean).

A reconstructed answer is usable but marked (`Mapped.reconstructed` names the rule), and an evaluation counts
them: their NLL and calibration describe the reconstruction as much as the system.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from rlcd.schema import Question

SUM_TOL = 1e-3  # how far a sent distribution may sum from 1 before it is refused (then it is renormalised)


@dataclass(frozen=True)
class Mapped:
    """Probabilities in candidate order, or None with the reason it is unusable."""

    probs: list[float] | None
    reason: str | None = None
    reconstructed: str | None = None


def _unusable(reason: str) -> Mapped:
    return Mapped(None, reason=reason)


def _prob(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    v = float(value)
    return v if math.isfinite(v) and -1e-9 <= v <= 1 + 1e-9 else None


def _distribution(sent: Any, labels: list[str], field: str) -> Mapped:
    if not isinstance(sent, Mapping):
        return _unusable(f"{field} is not an object {{label: probability}}")
    if set(map(str, sent)) != set(labels):
        missing, extra = sorted(set(labels) - set(map(str, sent))), sorted(set(map(str, sent)) - set(labels))
        return _unusable(f"{field} labels differ from the question's (missing {missing}, extra {extra})")
    probs = [_prob(sent[label]) for label in labels]
    if any(p is None for p in probs):
        return _unusable(f"{field} holds a value that is not a probability in [0, 1]")
    total = math.fsum(probs)  # type: ignore[arg-type]
    if abs(total - 1) > SUM_TOL:
        return _unusable(f"{field} sums to {total:.6g}, not 1")
    return Mapped([min(max(p, 0.0), 1.0) / total for p in probs])  # type: ignore[arg-type]


def map_answer(question: Question, answer: Any) -> Mapped:
    """`answer` (one entry of a response's ``answers``) as probabilities over `question`'s candidates."""
    if not isinstance(answer, Mapping):
        return _unusable("the answer is not an object")
    if answer.get("type") != question.type:
        return _unusable(f"answer type {answer.get('type')!r} for a {question.type} question")
    labels, k = question.labels, question.k
    if question.type == "noul":
        p = _prob(answer.get("noul"))
        return _unusable("noul is not a probability in [0, 1]") if p is None else Mapped([1 - p, p])
    if "probabilities" in answer and answer["probabilities"] is not None:
        return _distribution(answer["probabilities"], labels, "probabilities")
    if question.type == "choice":
        choice, c = answer.get("choice"), _prob(answer.get("confidence"))
        if choice not in labels:
            return _unusable(f"choice {choice!r} is not one of the question's labels")
        if c is None:
            return _unusable("no probabilities, and confidence is not a number in [0, 1]")
        p_max = 1 / k + c * (1 - 1 / k)
        rest = (1 - p_max) / (k - 1) if k > 1 else 0.0
        return Mapped([p_max if label == choice else rest for label in labels],
                      reconstructed="choice: top answer + confidence")
    s = answer.get("score")
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or not 0 <= s <= k - 1:
        return _unusable(f"no probabilities, and score {s!r} is not a number in [0, {k - 1}]")
    lo = min(int(math.floor(s)), k - 1)
    frac = float(s) - lo
    probs = [0.0] * k
    probs[lo] += 1 - frac
    if frac > 0:
        probs[lo + 1] += frac
    return Mapped(probs, reconstructed="score: expected level only")


__all__ = ["Mapped", "SUM_TOL", "map_answer"]
