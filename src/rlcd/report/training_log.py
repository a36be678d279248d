"""metrics.jsonl as the report reads it: training lines, evaluation lines, series and smoothing.

Lines with ``"event": "eval"`` are dev evaluations (``dev_macro_accuracy``, ``dev_accuracy``
{group: acc}, ``dev_nll``/``dev_brier``/``dev_ece`` and their ``/<type>`` variants); other lines
with a ``step`` are training updates (``loss``, ``ce_loss``, ``policy_loss``, ``reward_mean``,
``lr_lora``, ``lr_head``, ``grad_norm``, ...; at the diagnostics cadence ``grad_cosine``,
``grad_norm_ratio``, ``reward/<type>/<component>/{mean,std}``, ``adv_std``, ``adv_extreme_share``;
on every line ``per_type: {type: {entropy, max_prob, effective_candidates, n}}`` and ``ce/<type>``, pooled
over DDP ranks; at the diagnostics cadence the objective per type, ``policy_loss/<type>``,
``reward/<type>/{mean,std}``, ``grad_norm/<type>`` and ``grad_share/<type>``, see ``rlcd.diagnostics``);
logs of older runs have the pooled ``log_score_mean``/``spherical_mean``/``rps_mean`` and
``advantage_std`` only).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

REWARD_PARTS = ("log_score_mean", "spherical_mean", "rps_mean")  # pooled (rlcd.objectives stats)
COMPONENTS = ("log", "spherical", "rps")


def read_training_log(path: str | Path) -> tuple[list[dict], list[dict], int]:
    """(train lines, eval lines, number of unreadable lines) of a metrics.jsonl."""
    train, evals, bad = [], [], 0
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if not isinstance(obj, dict) or "step" not in obj:
                bad += 1
                continue
            if obj.get("event") == "eval":
                evals.append(obj)
            elif obj.get("event") in (None, "train", "step"):
                train.append(obj)
    return train, evals, bad


def series(lines: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the lines holding a finite number under ``key``."""
    xs, ys = [], []
    for obj in lines:
        v = obj.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(float(obj["step"]))
            ys.append(float(v))
    return xs, ys


def has(lines: list[dict], key: str) -> bool:
    return bool(series(lines, key)[0])


def ema(values: list[float], span: float | None = None) -> np.ndarray:
    """Debiased exponential moving average (TensorBoard's smoothing).

    ``alpha = 2 / (span + 1)``; ``s_t = (1 - alpha) s_{t-1} + alpha x_t`` from ``s_0 = 0``, divided by
    ``1 - (1 - alpha)^(t+1)`` so the first points are not pulled towards 0. The default span is a
    tenth of the points (at least 1: no smoothing for very short logs).
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return x
    span = max(1.0, x.size / 10) if span is None else max(1.0, float(span))
    alpha = 2.0 / (span + 1.0)
    out = np.empty_like(x)
    s = 0.0
    for i, v in enumerate(x):
        s = (1 - alpha) * s + alpha * v
        out[i] = s / (1 - (1 - alpha) ** (i + 1))
    return out


def reward_keys(train: list[dict]) -> dict[str, list[str]]:
    """{type: [component, ...]} of the per-type reward series in the log (``reward/<t>/<c>/mean``)."""
    found: dict[str, list[str]] = {}
    for obj in train:
        for key in obj:
            parts = key.split("/")
            if len(parts) == 4 and parts[0] == "reward" and parts[3] == "mean" and parts[2] in COMPONENTS:
                comps = found.setdefault(parts[1], [])
                if parts[2] not in comps:
                    comps.append(parts[2])
    return {t: [c for c in COMPONENTS if c in comps] for t, comps in found.items()}


def has_diagnostics(train: list[dict]) -> bool:
    """Whether the log holds any RLCD diagnostic (a CE-only run has none)."""
    return bool(reward_keys(train)) or any(has(train, k) for k in REWARD_PARTS + (
        "advantage_std", "adv_std", "adv_extreme_share", "grad_cosine", "grad_norm_ratio"))


def selected_step(evals: list[dict], meta: dict[str, Any], select_by: str = "macro_accuracy") -> int | None:
    """The step the evaluation used: ``meta.selected_step``, else the best dev score the run selects on
    (highest macro accuracy, or lowest NLL for ``select_by="nll"``; earliest on ties)."""
    if isinstance(meta.get("selected_step"), int):
        return meta["selected_step"]
    key, sign = ("dev_nll", -1.0) if select_by == "nll" else ("dev_macro_accuracy", 1.0)
    scored = [e for e in evals if isinstance(e.get(key), (int, float))]
    if not scored:
        return None
    return int(max(scored, key=lambda e: (sign * e[key], -e["step"]))["step"])


def last_value(lines: list[dict], key: str) -> Any:
    for obj in reversed(lines):
        if key in obj:
            return obj[key]
    return None


TYPE_STATS = ("entropy", "max_prob", "effective_candidates")


def type_stat_series(lines: list[dict], type_: str, stat: str) -> tuple[list[float], list[float]]:
    """(steps, values) of ``per_type[type_][stat]`` (the output statistics of each update's rows)."""
    xs, ys = [], []
    for obj in lines:
        v = ((obj.get("per_type") or {}).get(type_) or {}).get(stat) if isinstance(obj.get("per_type"), dict) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(float(obj["step"]))
            ys.append(float(v))
    return xs, ys


def type_stat_types(lines: list[dict]) -> list[str]:
    """The question types with any per-type output statistic in the log, in first-seen order."""
    seen: dict[str, None] = {}
    for obj in lines:
        per = obj.get("per_type")
        if isinstance(per, dict):
            seen.update({t: None for t, b in per.items() if isinstance(b, dict) and any(k in b for k in TYPE_STATS)})
    return list(seen)


OBJECTIVE_STATS = ("ce", "policy_loss", "grad_norm", "grad_share")  # ``<stat>/<type>`` keys (rlcd.diagnostics)


def objective_types(lines: list[dict]) -> list[str]:
    """The question types with any ``<stat>/<type>`` objective key (``OBJECTIVE_STATS``) in the log, first seen first."""
    seen: dict[str, None] = {}
    for obj in lines:
        for key in obj:
            parts = key.split("/")
            if len(parts) == 2 and parts[0] in OBJECTIVE_STATS:
                seen[parts[1]] = None
    return list(seen)


def mean_value(lines: list[dict], key: str) -> float | None:
    """Mean of the finite values logged under ``key`` (None when there are none)."""
    ys = series(lines, key)[1]
    return float(np.mean(ys)) if ys else None
