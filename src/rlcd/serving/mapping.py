"""Mapping answers back: the logits of the questions the model was asked -> the System One response.

The answers are transformers' shapes and meanings (`serving.answer`: choice confidence `(p_max - 1/K) / (1 - 1/K)`,
score confidence from the expected distance to the modal level plus a `legend`, noul `P(true)`), after the run's
per-type temperature T (probabilities are `softmax(logits / T)`). The response is `{"model": <the request's model,
else the served name>, "answers": {qid: answer}, "usage": {"input_tokens", "output_tokens": 0, "images"}}`
(+ `"warnings"` when an asset was unused).

`usage.input_tokens` counts the tokens the model processed (the shared prefix once, plus every question's suffix,
vote orders included; image tokens included; a state-cache hit does not change it); `usage.images` is 1 when the
model read the request's image, else 0. A one-option choice or one-level score (transformers accepts them) has a
fixed answer (probability 1, confidence 1, `serving.answer.fixed_answer`): it is answered without the model and its
tokens are not counted; a request of only such questions runs no model at all (`input_tokens` 0, `images` 0).

A question asked in its canonical form (`serving.canonical`) is answered on the caller's options
(`canonical.answer_logits`): caller option i gets ``p[source[i]] / shares[i]`` of the asked question's
probabilities, under the asked type's temperature.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

from rlcd.schema import QUESTION_TYPES
from rlcd.serving.answer import fixed_answer, make_answer
from rlcd.serving.canonical import Canonical, answer_logits
from rlcd.serving.prepared import Prepared
from rlcd.serving.request import ParsedRequest


def check_temperatures(meta: Mapping[str, Any]) -> dict[str, float]:
    """The export's per-type temperatures, each a positive finite number (ValueError naming the type otherwise)."""
    temps = dict(meta.get("temperatures") or {})
    missing = [t for t in QUESTION_TYPES if t not in temps]
    if missing:
        raise ValueError(f"export meta has no temperature for {missing}")
    for t in QUESTION_TYPES:
        if not (isinstance(temps[t], (int, float)) and math.isfinite(temps[t]) and temps[t] > 0):
            raise ValueError(f"temperature for {t} must be a positive finite number, got {temps[t]!r}")
    return {t: float(temps[t]) for t in QUESTION_TYPES}


def answers(request: ParsedRequest, canon: Sequence[Canonical] | None, logits: Iterable[Any],
            temperatures: Mapping[str, float]) -> dict[str, dict[str, Any]]:
    """{qid: wire answer} for every question of `request`. `logits`: those of the questions asked with more than
    one option, in request order (the asked form's when `canon`, the per-question canonical forms, is given)."""
    out = {}
    scored = iter(logits)
    for i, (qid, q) in enumerate(zip(request.qids, request.questions)):
        levels = request.raw_criteria.get(qid) if q.type == "score" else None
        c = canon[i] if canon is not None else None
        if q.k == 1:
            out[qid] = fixed_answer(q, levels)
        elif c is None or c.asked is q:
            out[qid] = make_answer(q, next(scored), temperatures[q.type], levels=levels)
        else:  # asked in canonical form: mapped back to the caller's options
            z, t = answer_logits(c, next(scored) if c.asked.k > 1 else None, temperatures)
            out[qid] = make_answer(q, z, t, levels=levels)
    return out


def respond(prepared: Prepared, logits: Iterable[Any], usage: Mapping[str, Any], *,
            temperatures: Mapping[str, float], name: str) -> dict[str, Any]:
    """The System One response of one prepared request from its scored logits and usage; `name`: the served name,
    echoed when the request names no model."""
    r = prepared.request
    read_image = prepared.image is not None and prepared.case is not None
    out = {"model": r.model if r.model is not None else name,
           "answers": answers(r, prepared.canon, logits, temperatures),
           "usage": {"input_tokens": int(usage["input_tokens"]), "output_tokens": 0, "images": 1 if read_image else 0}}
    if r.warnings:
        out["warnings"] = list(r.warnings)
    return out


__all__ = ["answers", "check_temperatures", "respond"]
