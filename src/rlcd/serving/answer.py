"""Answers in transformers' System One shapes and meanings (`transformers.decision.Question.answer`).

With p = softmax(logits / T_type) over the K options (float64):

* choice -> `{"type", "choice": argmax, "confidence", "probabilities": {label: p}}` with
  confidence = max(0, (p_max - 1/K) / (1 - 1/K)): 0 for a uniform answer, 1 for a certain one;
* noul   -> `{"type", "noul": P(true)}`;
* score  -> `{"type", "score": sum_l l p_l, "legend": {"0": level, ...}, "confidence", "probabilities"}`
  (a level sent as null has the legend value "null", the text the model read for it)
  with confidence = max(0, 1 - E|l - argmax| / E_uniform|l - (K-1)/2|): the expected distance to the
  modal level against a uniform distribution's expected distance to the middle.

The first maximum wins ties, as in transformers (dict order = option order). A one-option choice or
one-level score has p = 1 and confidence 1 whatever the logit (`fixed_answer`, no model needed).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from rlcd.schema import Question

NULL_LEVEL = "null"  # the legend value of a score level given as null: the text the prompt shows for it


def probabilities(logits: Any, temperature: float) -> Any:
    """softmax(logits / T) in float64, a torch tensor (torch is imported here, on first use)."""
    import torch

    z = torch.as_tensor(logits, dtype=torch.float64) / float(temperature)
    return torch.softmax(z, dim=-1)


def probability_list(logits: Any, temperature: float) -> list[float]:
    """softmax(logits / T) in float64 as floats: torch's softmax for torch logits (the torch Predictor's answers are
    what they always were), numpy's for anything else -- so the portable ONNX server answers without torch."""
    if type(logits).__module__.split(".")[0] == "torch":
        return [float(x) for x in probabilities(logits, temperature).tolist()]
    z = np.asarray(logits, dtype=np.float64) / float(temperature)
    e = np.exp(z - z.max())
    return [float(x) for x in (e / e.sum()).tolist()]


def choice_confidence(p_max: float, k: int) -> float:
    return 1.0 if k == 1 else max(0.0, (p_max - 1 / k) / (1 - 1 / k))


def score_confidence(probs: Sequence[float], best: int) -> float:
    k = len(probs)
    if k == 1:
        return 1.0
    distance = sum(p * abs(level - best) for level, p in enumerate(probs))
    uniform = sum(abs(level - (k - 1) / 2) for level in range(k)) / k
    return max(0.0, 1 - distance / uniform)


def make_answer(question: Question, logits: Any, temperature: float,
                levels: Sequence[Any] | None = None) -> dict[str, Any]:
    """The wire answer for one question from its raw logits and its type's temperature.

    `levels`: the score levels as the request gave them (content objects included) for the legend;
    defaults to the parsed level texts.
    """
    probs = probability_list(logits, temperature)
    labels = question.labels
    by_option = dict(zip(labels, probs))
    if question.type == "noul":
        return {"type": "noul", "noul": by_option["true"]}
    best = max(range(len(probs)), key=lambda i: probs[i])  # first maximum on ties
    if question.type == "choice":
        return {"type": "choice", "choice": labels[best], "confidence": choice_confidence(probs[best], len(probs)),
                "probabilities": by_option}
    # a level sent as null reads as "null" in the prompt and shows so in the legend: System One clients parse a
    # legend value as a string, object or array (the official SDK refuses null), transformers' as anything
    legend = [NULL_LEVEL if v is None else v for v in levels] if levels is not None else question.descriptions()
    return {"type": "score", "score": math.fsum(i * x for i, x in enumerate(probs)),
            "legend": dict(zip(labels, legend)), "confidence": score_confidence(probs, best),
            "probabilities": by_option}


def fixed_answer(question: Question, levels: Sequence[Any] | None = None) -> dict[str, Any]:
    """The answer to a one-option question: softmax of one logit is 1, so it is the same for any logit."""
    if question.k != 1:
        raise ValueError(f"a fixed answer is only for one-option questions, this one has {question.k}")
    return make_answer(question, [0.0], 1.0, levels=levels)


__all__ = ["make_answer", "fixed_answer", "probabilities", "probability_list", "choice_confidence", "score_confidence"]
