"""Scoring rules, calibration error, reliability tables, coverage-risk and aggregates.

Everything here works on *prediction rows* (``eval/predictions-<split>.jsonl``, see
docs/ARCHITECTURE.md): ``{id, group, type, labels, target, posterior|null, logits}`` with raw logits
over the K valid candidates. Probabilities are ``softmax(logits / T_type)``; all arithmetic is numpy
float64.

Per row, with p the model's probabilities and t the target distribution:

- accuracy        ``argmax p == argmax t`` (ties resolve to the first index, as numpy/torch do)
- soft accuracy   ``t[argmax p]``
- NLL             ``-sum_k t_k log max(p_k, 1e-12)``
- Brier           ``sum_k (p_k - t_k)^2``
- score rows only (ordinal levels 0..K-1):
  RPS             ``sum_{k<K-1} (P_k - T_k)^2 / (K - 1)`` with P, T the cumulative sums
  level MAE       ``|sum_k k p_k - sum_k k t_k|`` (in levels)
  within one      ``|argmax p - argmax t| <= 1``

Calibration uses 15 equal-width bins on the confidence ``max p``; bin b holds
``b/15 <= conf < (b+1)/15`` and the last bin is closed (conf == 1.0 falls in it):

- ``ece``         hard-label ECE: sum_b (n_b/N) |mean conf_b - mean correct_b|, correct = accuracy
  above. Equals torchmetrics' l1 calibration error for any confidence < 1.
- ``ece_target``  target-referenced ECE: the same with ``mean t[argmax p]`` in place of the hard
  accuracy (hard-label ECE rewards over-confidence on soft teacher labels).
- ``sharpness_gap`` ``mean(max p) - mean(max t)``: > 0 means sharper than the targets.

When a row carries a known ``posterior`` the same scores are computed against the posterior (block
``posterior``), together with the Bayes floor: the posterior's own NLL against the target
(``bayes_nll``) and the gap ``model_nll - bayes_nll`` (``bayes_gap``), over the rows with a posterior.
The reference a reader needs to judge that gap: ``uniform_gap`` = ``uniform_nll - bayes_nll``, the gap of the
uniform answer (1/K on each of a row's K candidates; ``uniform_nll`` its NLL against the target), which
depends only on the rows -- a model whose calibrated gap is near it has learnt nothing the probabilities show.

Aggregates (``summarize``): ``overall``, ``per_type``, ``per_group``, ``per_k_bucket`` (2, 3-5, 6-10,
11+) and ``group_macro`` (unweighted mean over groups of every metric). Output is plain JSON-ready
Python (floats, ints, None, dicts, lists), independent of the order of the input rows.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from rlcd.schema import QUESTION_TYPES

N_BINS = 15
EPS = 1e-12
K_BUCKETS: tuple[tuple[str, int, int], ...] = (("2", 2, 2), ("3-5", 3, 5), ("6-10", 6, 10), ("11+", 11, 10**9))
ORDINAL_TYPES = ("score",)

# ----------------------------------------------------------------------------------------------
# probabilities


def softmax(logits: Sequence[float] | np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """float64 softmax of ``logits / temperature`` (stable; -inf logits get probability 0)."""
    z = np.asarray(logits, dtype=np.float64) / float(temperature)
    if z.ndim != 1 or z.size == 0:
        raise ValueError("logits must be a non-empty 1-D vector")
    m = np.max(z)
    if not np.isfinite(m):
        raise ValueError("logits need at least one finite value and no +inf/nan")
    e = np.exp(z - m)
    return e / e.sum()


def k_bucket(k: int) -> str:
    """Candidate-count bucket name of a K: "2", "3-5", "6-10" or "11+"."""
    for name, lo, hi in K_BUCKETS:
        if lo <= k <= hi:
            return name
    raise ValueError(f"no bucket for K={k}")


def row_temperature(row: Mapping[str, Any], temperatures: Mapping[str, float] | None) -> float:
    """The temperature that applies to a row (1.0 when none is given for its type)."""
    if not temperatures:
        return 1.0
    return float(temperatures.get(row["type"], 1.0))


def row_probabilities(row: Mapping[str, Any], temperatures: Mapping[str, float] | None = None) -> np.ndarray:
    """softmax(row logits / T_type)."""
    return softmax(row["logits"], row_temperature(row, temperatures))


# ----------------------------------------------------------------------------------------------
# per-row scores (p, t are 1-D float arrays of the same length)


def _vec(x: Sequence[float] | np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def accuracy(p, t) -> float:
    return float(int(np.argmax(_vec(p)) == np.argmax(_vec(t))))


def soft_accuracy(p, t) -> float:
    return float(_vec(t)[int(np.argmax(_vec(p)))])


def nll(p, t) -> float:
    p, t = _vec(p), _vec(t)
    return float(-np.sum(t * np.log(np.maximum(p, EPS))))


def brier(p, t) -> float:
    p, t = _vec(p), _vec(t)
    return float(np.sum((p - t) ** 2))


def rps(p, t) -> float:
    """Ranked probability score over ordered levels, normalised by K - 1 (0 best, 1 worst)."""
    p, t = _vec(p), _vec(t)
    k = p.size
    if k < 2:
        raise ValueError("RPS needs at least 2 levels")
    cp, ct = np.cumsum(p)[:-1], np.cumsum(t)[:-1]
    return float(np.sum((cp - ct) ** 2) / (k - 1))


def expected_level_mae(p, t) -> float:
    p, t = _vec(p), _vec(t)
    levels = np.arange(p.size, dtype=np.float64)
    return float(abs(np.dot(levels, p) - np.dot(levels, t)))


def within_one(p, t) -> float:
    return float(int(abs(int(np.argmax(_vec(p))) - int(np.argmax(_vec(t)))) <= 1))


def row_scores(p, t, *, ordinal: bool = False) -> dict[str, float]:
    """All per-row scores of p against t (ordinal ones only when ``ordinal``)."""
    p, t = _vec(p), _vec(t)
    if p.shape != t.shape:
        raise ValueError(f"p has {p.size} entries, t has {t.size}")
    out = {
        "accuracy": accuracy(p, t),
        "soft_accuracy": soft_accuracy(p, t),
        "nll": nll(p, t),
        "brier": brier(p, t),
        "confidence": float(np.max(p)),
        "target_max": float(np.max(t)),
    }
    if ordinal:
        out.update(rps=rps(p, t), level_mae=expected_level_mae(p, t), within_one=within_one(p, t))
    return out


# ----------------------------------------------------------------------------------------------
# calibration


def bin_index(confidence: np.ndarray, n_bins: int = N_BINS) -> np.ndarray:
    """Equal-width bin of each confidence: b/n <= c < (b+1)/n, last bin closed."""
    c = np.asarray(confidence, dtype=np.float64)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    idx = np.searchsorted(edges, c, side="right") - 1
    return np.clip(idx, 0, n_bins - 1)


def calibration_error(confidence, reference, n_bins: int = N_BINS) -> float:
    """l1 binned calibration error: sum_b (n_b/N) |mean confidence_b - mean reference_b|.

    ``reference`` is the hard correctness (0/1) for the hard-label ECE, or ``t[argmax p]`` for the
    target-referenced one. Returns nan for no rows.
    """
    c = np.asarray(confidence, dtype=np.float64)
    r = np.asarray(reference, dtype=np.float64)
    if c.size == 0:
        return float("nan")
    idx = bin_index(c, n_bins)
    count = np.bincount(idx, minlength=n_bins).astype(np.float64)
    sum_c = np.bincount(idx, weights=c, minlength=n_bins)
    sum_r = np.bincount(idx, weights=r, minlength=n_bins)
    nz = count > 0
    gap = np.abs(sum_c[nz] / count[nz] - sum_r[nz] / count[nz])
    return float(np.sum(gap * count[nz]) / c.size)


def reliability_table(confidence, correct, target_accuracy, n_bins: int = N_BINS) -> list[dict[str, Any]]:
    """Per bin: lo, hi, count, mean confidence, hard accuracy, mean t[argmax p] (None when empty)."""
    c = np.asarray(confidence, dtype=np.float64)
    a = np.asarray(correct, dtype=np.float64)
    s = np.asarray(target_accuracy, dtype=np.float64)
    idx = bin_index(c, n_bins) if c.size else np.zeros(0, dtype=int)
    count = np.bincount(idx, minlength=n_bins)
    sc = np.bincount(idx, weights=c, minlength=n_bins)
    sa = np.bincount(idx, weights=a, minlength=n_bins)
    ss = np.bincount(idx, weights=s, minlength=n_bins)
    table = []
    for b in range(n_bins):
        n = int(count[b])
        table.append({
            "lo": b / n_bins,
            "hi": (b + 1) / n_bins,
            "count": n,
            "confidence": float(sc[b] / n) if n else None,
            "accuracy": float(sa[b] / n) if n else None,
            "target_accuracy": float(ss[b] / n) if n else None,
        })
    return table


def risk_curve(confidence, correct) -> tuple[np.ndarray, np.ndarray]:
    """Coverage and error rate of the kept rows when keeping rows with confidence >= threshold.

    One point per distinct confidence value (ties are kept or dropped together), sorted by
    increasing coverage; the last point has coverage 1.
    """
    c = np.asarray(confidence, dtype=np.float64)
    a = np.asarray(correct, dtype=np.float64)
    n = c.size
    if n == 0:
        return np.zeros(0), np.zeros(0)
    order = np.lexsort((a, -c))  # descending confidence; deterministic within ties
    cs, errs = c[order], 1.0 - a[order]
    cum_err = np.cumsum(errs)
    kept = np.arange(1, n + 1, dtype=np.float64)
    last_of_tie = np.r_[cs[1:] != cs[:-1], True]
    return kept[last_of_tie] / n, cum_err[last_of_tie] / kept[last_of_tie]


def aurc(coverage: np.ndarray, risk: np.ndarray) -> float:
    """Area under the (step) coverage-risk curve: sum of risk x coverage increment."""
    if len(coverage) == 0:
        return float("nan")
    dc = np.diff(np.r_[0.0, coverage])
    return float(np.sum(dc * risk))


def coverage_risk(rows: Iterable[Mapping[str, Any]], temperatures: Mapping[str, float] | None = None,
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(coverage, risk) of prediction rows when thresholding max p (see ``risk_curve``)."""
    conf, corr = [], []
    for row in sorted_rows(rows):
        p = row_probabilities(row, temperatures)
        conf.append(float(np.max(p)))
        corr.append(accuracy(p, row["target"]))
    return risk_curve(conf, corr)


# ----------------------------------------------------------------------------------------------
# aggregation


def sorted_rows(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Rows in a canonical order (by id, then group, then the row's JSON) so results are order-free."""
    rows = list(rows)
    return sorted(rows, key=lambda r: (str(r.get("id")), str(r.get("group")),
                                       json.dumps(r, sort_keys=True, default=str)))


def _mean(x: list[float]) -> float | None:
    return float(math.fsum(x) / len(x)) if x else None


class _Scored:
    """Per-row score columns for a set of rows (against the target or the posterior)."""

    def __init__(self) -> None:
        self.cols: dict[str, list[float]] = defaultdict(list)

    def add(self, s: dict[str, float]) -> None:
        for k, v in s.items():
            self.cols[k].append(v)

    def block(self, *, reliability: bool) -> dict[str, Any]:
        c = self.cols
        n = len(c["accuracy"])
        out: dict[str, Any] = {"n": n}
        if n == 0:
            return out
        for key in ("accuracy", "soft_accuracy", "nll", "brier"):
            out[key] = _mean(c[key])
        out["ece"] = calibration_error(c["confidence"], c["accuracy"])
        out["ece_target"] = calibration_error(c["confidence"], c["soft_accuracy"])
        out["mean_confidence"] = _mean(c["confidence"])
        out["mean_target_max"] = _mean(c["target_max"])
        out["sharpness_gap"] = out["mean_confidence"] - out["mean_target_max"]
        cov, risk = risk_curve(c["confidence"], c["accuracy"])
        out["aurc"] = aurc(cov, risk)
        if c.get("rps"):
            out["n_score"] = len(c["rps"])
            out["rps"] = _mean(c["rps"])
            out["level_mae"] = _mean(c["level_mae"])
            out["within_one"] = _mean(c["within_one"])
        if reliability:
            out["reliability"] = reliability_table(c["confidence"], c["accuracy"], c["soft_accuracy"])
        return out


def _block(scored: list[dict[str, Any]], *, reliability: bool) -> dict[str, Any]:
    """Aggregate block of per-row score records produced by ``_score_row``."""
    vs_target, vs_post = _Scored(), _Scored()
    bayes_nll, model_nll, bayes_acc, uniform_nll = [], [], [], []
    for r in scored:
        vs_target.add(r["target"])
        if r["posterior"] is not None:
            vs_post.add(r["posterior"])
            bayes_nll.append(r["bayes_nll"])
            model_nll.append(r["target"]["nll"])
            bayes_acc.append(r["bayes_accuracy"])
            uniform_nll.append(r["uniform_nll"])
    out = vs_target.block(reliability=reliability)
    if bayes_nll:
        post = vs_post.block(reliability=reliability)
        post["model_nll"] = _mean(model_nll)
        post["bayes_nll"] = _mean(bayes_nll)
        post["bayes_gap"] = post["model_nll"] - post["bayes_nll"]
        post["bayes_accuracy"] = _mean(bayes_acc)
        post["uniform_nll"] = _mean(uniform_nll)
        post["uniform_gap"] = post["uniform_nll"] - post["bayes_nll"]
        out["posterior"] = post
    return out


def _score_row(row: Mapping[str, Any], temperatures: Mapping[str, float] | None) -> dict[str, Any]:
    p = row_probabilities(row, temperatures)
    t = _vec(row["target"])
    if t.size != p.size:
        raise ValueError(f"row {row.get('id')!r}: {p.size} logits but {t.size} target entries")
    ordinal = row["type"] in ORDINAL_TYPES
    rec: dict[str, Any] = {"target": row_scores(p, t, ordinal=ordinal), "posterior": None}
    post = row.get("posterior")
    if post is not None:
        q = _vec(post)
        if q.size != p.size:
            raise ValueError(f"row {row.get('id')!r}: {p.size} logits but {q.size} posterior entries")
        rec["posterior"] = row_scores(p, q, ordinal=ordinal)
        rec["bayes_nll"] = nll(q, t)
        rec["bayes_accuracy"] = accuracy(q, t)
        rec["uniform_nll"] = nll(np.full(p.size, 1.0 / p.size), t)
    return rec


def _macro(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """Unweighted mean over blocks of every numeric metric (recursing into sub-blocks)."""
    keys = sorted({k for b in blocks for k in b})
    out: dict[str, Any] = {}
    for k in keys:
        if k == "reliability":
            continue
        vals = [b[k] for b in blocks if k in b and b[k] is not None]
        if not vals:
            continue
        if all(isinstance(v, dict) for v in vals):
            out[k] = _macro(vals)
            out[k]["n_groups"] = len(vals)
        elif k == "n" or k.startswith("n_"):
            out[k] = int(sum(vals))
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            finite = [float(v) for v in vals if math.isfinite(float(v))]
            out[k] = _mean(finite)
    return out


def summarize(rows: Iterable[Mapping[str, Any]], temperatures: Mapping[str, float] | None = None,
              ) -> dict[str, Any]:
    """Aggregate metrics of prediction rows under ``{type: T}`` temperatures (None = raw logits).

    Returns ``{"n", "temperatures", "overall", "per_type", "per_group", "per_k_bucket",
    "group_macro"}``. ``overall`` and ``per_type`` blocks carry a reliability table; every block has
    n, accuracy, soft_accuracy, nll, brier, ece, ece_target, mean_confidence, mean_target_max,
    sharpness_gap, aurc, the score metrics (n_score, rps, level_mae, within_one) when it holds score
    rows, and a ``posterior`` sub-block when rows carry a posterior. Deterministic and independent of
    row order (rows are canonically sorted by id first).
    """
    rows = sorted_rows(rows)
    temps = {t: float(temperatures.get(t, 1.0)) for t in QUESTION_TYPES} if temperatures else None
    scored = [_score_row(r, temps) for r in rows]
    by_type: dict[str, list] = defaultdict(list)
    by_group: dict[str, list] = defaultdict(list)
    by_k: dict[str, list] = defaultdict(list)
    for row, s in zip(rows, scored):
        by_type[row["type"]].append(s)
        by_group[str(row["group"])].append(s)
        by_k[k_bucket(len(row["logits"]))].append(s)
    type_order = [t for t in QUESTION_TYPES if t in by_type] + sorted(set(by_type) - set(QUESTION_TYPES))
    per_group = {g: _block(by_group[g], reliability=False) for g in sorted(by_group)}
    macro = _macro(list(per_group.values()))
    macro["n_groups"] = len(per_group)
    return {
        "n": len(rows),
        "temperatures": temps,
        "overall": _block(scored, reliability=True),
        "per_type": {t: _block(by_type[t], reliability=True) for t in type_order},
        "per_group": per_group,
        "per_k_bucket": {name: _block(by_k[name], reliability=False) for name, _, _ in K_BUCKETS if name in by_k},
        "group_macro": macro,
    }


# ----------------------------------------------------------------------------------------------
# majority baseline


def _field(row: Any, name: str) -> Any:
    if isinstance(row, Mapping):
        return row.get(name)
    return getattr(row, name, None)


def _instructions_key(row: Any) -> str:
    """Canonical text of a row's question instructions (dict rows, or Record-like objects)."""
    instr = _field(row, "instructions")
    if instr is None:
        q = _field(row, "question")
        instr = _field(q, "instructions") if q is not None else None
    if instr is None:
        raise ValueError(f"row {_field(row, 'id')!r}: no instructions (need an 'instructions' key or question.instructions)")
    return instr if isinstance(instr, str) else json.dumps(instr, sort_keys=True, ensure_ascii=False)


def _labels_of(row: Any) -> list[str]:
    labels = _field(row, "labels")
    if labels is None:
        q = _field(row, "question")
        labels = _field(q, "labels") if q is not None else None
    if labels is None:
        raise ValueError(f"row {_field(row, 'id')!r}: no candidate labels")
    return [str(x) for x in labels]


def _group_of(row: Any) -> str:
    g = _field(row, "group")
    if g is None and not isinstance(row, Mapping) and hasattr(row, "sampling_group"):
        g = row.sampling_group
    if g is None:
        raise ValueError(f"row {_field(row, 'id')!r}: no group")
    return str(g)


def _best(counter: Counter, allowed: list[str]) -> str | None:
    """Most frequent label among ``allowed`` (ties -> smallest label string), None if none counted."""
    cands = [(-counter[lab], lab) for lab in allowed if counter[lab] > 0]
    return min(cands)[1] if cands else None


def majority_baseline(train_rows: Iterable[Any], test_rows: Iterable[Any]) -> dict[str, Any]:
    """Test accuracy of always answering, per (sampling group, instructions), the training majority.

    Rows may be dicts (``group``, ``labels``, ``target``, and ``instructions`` or
    ``question.instructions``) or ``rlcd.schema.Record`` objects, on either side. The answer for a
    test row is the label that was most often the argmax of the training targets for the same
    (group, instructions) pair; ties go to the smallest label string. When that pair was never seen
    in training (or its majority label is not a candidate of the test row) the answer falls back to
    the group's training majority among the row's labels, then to the row's first candidate; those
    rows are counted in ``n_fallback_group`` / ``n_fallback_first``.
    """
    by_key: dict[tuple[str, str], Counter] = defaultdict(Counter)
    by_group: dict[str, Counter] = defaultdict(Counter)
    for row in train_rows:
        labels = _labels_of(row)
        t = _vec(_field(row, "target"))
        lab = labels[int(np.argmax(t))]
        g = _group_of(row)
        by_key[(g, _instructions_key(row))][lab] += 1
        by_group[g][lab] += 1
    acc, soft = [], []
    per_group: dict[str, list[float]] = defaultdict(list)
    fb_group = fb_first = 0
    test = sorted(test_rows, key=lambda r: (str(_field(r, "id")), _group_of(r)))
    for row in test:
        labels = _labels_of(row)
        t = _vec(_field(row, "target"))
        g = _group_of(row)
        ans = _best(by_key.get((g, _instructions_key(row)), Counter()), labels)
        if ans is None:
            ans = _best(by_group.get(g, Counter()), labels)
            if ans is not None:
                fb_group += 1
        if ans is None:
            ans = labels[0]
            fb_first += 1
        i = labels.index(ans)
        a = float(int(i == int(np.argmax(t))))
        acc.append(a)
        soft.append(float(t[i]))
        per_group[g].append(a)
    groups = {g: _mean(v) for g, v in sorted(per_group.items())}
    return {
        "n": len(acc),
        "accuracy": _mean(acc),
        "soft_accuracy": _mean(soft),
        "group_macro_accuracy": _mean(list(groups.values())) if groups else None,
        "per_group": groups,
        "n_train": int(sum(sum(c.values()) for c in by_group.values())),
        "n_keys": len(by_key),
        "n_fallback_group": fb_group,
        "n_fallback_first": fb_first,
    }


# ----------------------------------------------------------------------------------------------
# JSON


def to_jsonable(obj: Any) -> Any:
    """Plain-JSON copy: numpy scalars/arrays to Python, non-finite floats to None."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return [to_jsonable(v) for v in obj.tolist()]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        f = float(obj)
        return f if math.isfinite(f) else None
    return obj


def dumps(obj: Any) -> str:
    """Canonical JSON text (sorted keys kept as built, indent 2, non-finite -> null)."""
    return json.dumps(to_jsonable(obj), indent=2, ensure_ascii=False, allow_nan=False) + "\n"
