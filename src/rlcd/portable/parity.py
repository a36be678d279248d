"""Parity of two scorings of the same rows (torch vs onnxruntime): what the export gate reads.

Per row, with p = softmax(logits / T_type) of the reference (torch) and q of the candidate (onnxruntime):

* flip      argmax p != argmax q (first maximum on ties): the decision changed; `flip_rate` = flips / rows
* dp        max_k |p_k - q_k|; reported as the max over rows
* NLL       -sum_k t_k log max(., 1e-12) against the row's target (`rlcd.metrics.nll`); delta = mean(q) - mean(p)
* ECE       hard-label ECE, 15 bins (`rlcd.metrics.calibration_error`); delta = ECE(q) - ECE(p)

The NLL and ECE deltas get 95% percentile intervals from a grouped bootstrap over source cases
(`rlcd.bootstrap`: whole cases resampled, as every interval of an evaluation; `resamples` draws, seed 0).
numpy only; the gate itself (`flip_rate <= bound`) is the exporter's.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from rlcd import metrics as M
from rlcd.bootstrap import draw_groups, group_codes, resample_indices

RESAMPLES = 1000


def _interval(x: np.ndarray) -> list[float]:
    lo, hi = np.percentile(x, [2.5, 97.5])
    return [float(lo), float(hi)]


def compare(rows: Sequence[Mapping[str, Any]], reference: Sequence[Sequence[float]], candidate: Sequence[Sequence[float]],
            temperatures: Mapping[str, float], *, resamples: int = RESAMPLES, seed: int = 0,
            names: tuple[str, str] = ("torch", "onnx")) -> dict[str, Any]:
    """`rows`: per row its `type`, `target` and `case_id` (or `id`); `reference` / `candidate`: raw logits per row;
    `names`: the keys the two sides' NLL, ECE and accuracy are reported under (reference first)."""
    if not rows or len(rows) != len(reference) or len(rows) != len(candidate):
        raise ValueError(f"need one reference and one candidate logit vector per row ({len(rows)} rows)")
    n = len(rows)
    flips = np.zeros(n, dtype=bool)
    dp = np.zeros(n)
    nll = np.zeros((2, n))
    conf = np.zeros((2, n))
    correct = np.zeros((2, n))
    for i, (row, a, b) in enumerate(zip(rows, reference, candidate)):
        t = np.asarray(row["target"], dtype=np.float64)
        temp = float(temperatures.get(row["type"], 1.0))
        ps = [M.softmax(np.asarray(a, dtype=np.float64), temp), M.softmax(np.asarray(b, dtype=np.float64), temp)]
        flips[i] = int(np.argmax(ps[0])) != int(np.argmax(ps[1]))
        dp[i] = float(np.max(np.abs(ps[0] - ps[1])))
        for j, p in enumerate(ps):
            nll[j, i] = M.nll(p, t)
            conf[j, i] = float(np.max(p))
            correct[j, i] = M.accuracy(p, t)
    ece = [M.calibration_error(conf[j], correct[j]) for j in range(2)]
    codes, n_groups = group_codes([str(r.get("case_id") or r.get("id")) for r in rows], n)
    rng = np.random.default_rng(seed)
    d_nll, d_ece = np.empty(resamples), np.empty(resamples)
    for r, drawn in enumerate(draw_groups(rng, n_groups, resamples)):
        idx = resample_indices(codes, drawn)
        d_nll[r] = nll[1, idx].mean() - nll[0, idx].mean()
        d_ece[r] = (M.calibration_error(conf[1, idx], correct[1, idx])
                    - M.calibration_error(conf[0, idx], correct[0, idx]))
    a, b = names
    return {
        "rows": n, "cases": n_groups, "flips": int(flips.sum()), "flip_rate": float(flips.mean()),
        "max_abs_dp": float(dp.max()), "mean_abs_dp": float(dp.mean()),
        "nll": {a: float(nll[0].mean()), b: float(nll[1].mean()),
                "delta": float(nll[1].mean() - nll[0].mean()), "delta_95": _interval(d_nll)},
        "ece": {a: float(ece[0]), b: float(ece[1]), "delta": float(ece[1] - ece[0]),
                "delta_95": _interval(d_ece)},
        "accuracy": {a: float(correct[0].mean()), b: float(correct[1].mean())},
        "bootstrap": {"resamples": resamples, "seed": seed, "unit": "case"},
    }


def describe(report: Mapping[str, Any]) -> str:
    """One line: flips, max |dp|, NLL and ECE deltas with their intervals."""
    n, e = report["nll"], report["ece"]
    return (f"{report['flips']}/{report['rows']} test decisions flipped ({100 * report['flip_rate']:.2f}%), max |dp| "
            f"{report['max_abs_dp']:.2g}, NLL delta {n['delta']:+.2g} [{n['delta_95'][0]:+.2g}, {n['delta_95'][1]:+.2g}], "
            f"ECE delta {e['delta']:+.2g} [{e['delta_95'][0]:+.2g}, {e['delta_95'][1]:+.2g}]")


__all__ = ["compare", "describe", "RESAMPLES"]
