"""95% intervals for the evaluation: the headline metrics and the fitted temperatures.

Everything is a grouped percentile bootstrap over source cases (``rlcd.bootstrap``: a drawn case
brings all its rows), ``RESAMPLES`` = 1,000 resamples from ``default_rng(SEED)``, interval =
the 2.5 % and 97.5 % quantiles of the resampled statistic. It is vectorised: each metric of a block
of rows (overall, one type, the group macro) is a function of per-case sums, so a resample's
statistic is ``counts @ case_sums`` with ``counts[r, c]`` how often case c was drawn:

- means (accuracy, soft accuracy, NLL, Brier, mean confidence, sharpness gap, RPS, level MAE,
  within one): ``sum_i w_i x_i / sum_i w_i`` with ``w_i`` the count of row i's case;
- ECE: bin b holds ``D_b = sum_{i in b} w_i (conf_i - ref_i)``, and
  ``ECE = sum_b |D_b| / sum_i w_i`` (the same as ``sum_b n_b/N |mean conf_b - mean ref_b|``);
- AURC: rows sorted by confidence once; the weighted coverage-risk steps of ``rlcd.metrics``;
- group macro: the mean over sampling groups of each group's weighted mean.

With every case drawn once these are exactly ``rlcd.metrics.summarize``'s numbers (tested).

``calibration_effect`` resamples raw and calibrated metrics with the same counts, so the interval
of ``calibrated - raw`` is paired; an interval above 0 for NLL or ECE means calibration made that
type worse by more than resampling noise.

``temperature_intervals`` refits each type's temperature on every resample of the calibration
rows: the weighted mean soft cross-entropy is tabulated on a grid of ``GRID`` log-spaced T in
[0.1, 10] (``loss[r, j] = counts @ case_loss[:, j] / counts @ case_rows``), its minimum refined by
a parabola through the grid point and its neighbours in log T; at a bound the bound is the fit,
as in ``rlcd.calibrate``. Interval ends are rounded to 6 significant digits (far below the Monte
Carlo error), so evaluation.json is reproduced exactly from the prediction files.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from rlcd import metrics as M
from rlcd.bootstrap import chunk_size, draw_groups, group_codes, group_counts, group_key
from rlcd.calibrate import MIN_ROWS, T_MAX, T_MIN, padded, soft_ce

RESAMPLES = 1000
SEED = 0
CONFIDENCE = 0.95
GRID = 241
_GRID_CELLS = 4_000_000  # float64 cells per batched loss evaluation of the temperature grid
MEANS = ("accuracy", "soft_accuracy", "nll", "brier", "mean_confidence", "sharpness_gap")
SCORE_MEANS = ("rps", "level_mae", "within_one")
MACRO_MEANS = ("accuracy", "nll", "brier")
DELTA_METRICS = ("nll", "brier", "ece", "ece_target")


def _round(x: float) -> float | None:
    return float(f"{x:.6g}") if math.isfinite(x) else None


def _interval(samples: np.ndarray) -> list[float | None] | None:
    """Percentile interval of the finite resampled values (None when there are none)."""
    s = samples[np.isfinite(samples)]
    if s.size == 0:
        return None
    alpha = 1.0 - CONFIDENCE
    lo, hi = np.quantile(s, [alpha / 2, 1 - alpha / 2])
    return [_round(float(lo)), _round(float(hi))]


# ----------------------------------------------------------------------------------------------
# per-row columns


class _Columns:
    """Per-row scores of a split under one set of temperatures, in the canonical row order."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], temperatures: Mapping[str, float] | None):
        n = len(rows)
        self.acc, self.soft, self.nll, self.brier, self.conf, self.tmax = (np.zeros(n) for _ in range(6))
        self.score = {k: np.full(n, np.nan) for k in SCORE_MEANS}
        for i, row in enumerate(rows):
            p = M.row_probabilities(row, temperatures)
            s = M.row_scores(p, row["target"], ordinal=row["type"] in M.ORDINAL_TYPES)
            self.acc[i], self.soft[i], self.nll[i], self.brier[i] = (s["accuracy"], s["soft_accuracy"], s["nll"],
                                                                     s["brier"])
            self.conf[i], self.tmax[i] = s["confidence"], s["target_max"]
            for k in SCORE_MEANS:
                if k in s:
                    self.score[k][i] = s[k]
        self.bins = M.bin_index(self.conf) if n else np.zeros(0, dtype=int)

    def mean_columns(self) -> dict[str, np.ndarray]:
        return {"accuracy": self.acc, "soft_accuracy": self.soft, "nll": self.nll, "brier": self.brier,
                "mean_confidence": self.conf, "sharpness_gap": self.conf - self.tmax}


class _Block:
    """The columns of one block of rows (a boolean selection), laid out for ``counts @ case_sums``."""

    def __init__(self, cols: _Columns, sel: np.ndarray, sgroups: np.ndarray | None):
        self.names: list[str] = ["n"]
        parts = [sel.astype(np.float64)]
        means = cols.mean_columns()
        for name, x in means.items():
            self.names.append(name)
            parts.append(np.where(sel, x, 0.0))
        self.score = bool(np.any(sel & np.isfinite(cols.score["rps"])))
        if self.score:
            ssel = sel & np.isfinite(cols.score["rps"])
            self.names.append("n_score")
            parts.append(ssel.astype(np.float64))
            for k in SCORE_MEANS:
                self.names.append(k)
                parts.append(np.where(ssel, cols.score[k], 0.0))
        for ref_name, ref in (("ece", cols.acc), ("ece_target", cols.soft)):
            gap = np.where(sel, cols.conf - ref, 0.0)
            for b in range(M.N_BINS):
                self.names.append(f"{ref_name}:{b}")
                parts.append(np.where(cols.bins == b, gap, 0.0))
        self.groups: list[str] = []
        if sgroups is not None:
            self.groups = sorted(set(sgroups[sel]))
            for g in self.groups:
                gsel = sel & (sgroups == g)
                self.names.append(f"macro:{g}:n")
                parts.append(gsel.astype(np.float64))
                for k in MACRO_MEANS:
                    self.names.append(f"macro:{g}:{k}")
                    parts.append(np.where(gsel, means[k], 0.0))
        self.values = np.stack(parts, axis=1)  # [rows, columns]
        self.index = {name: j for j, name in enumerate(self.names)}
        self.sel = sel
        self.cols = cols

    def statistics(self, totals: np.ndarray) -> dict[str, np.ndarray]:
        """Metric per resample from ``totals`` = counts @ case sums ([R, columns])."""
        ix = self.index
        with np.errstate(invalid="ignore", divide="ignore"):
            n = totals[:, ix["n"]]
            out = {k: totals[:, ix[k]] / n for k in MEANS}
            for ref in ("ece", "ece_target"):
                cols = [ix[f"{ref}:{b}"] for b in range(M.N_BINS)]
                out[ref] = np.abs(totals[:, cols]).sum(axis=1) / n
            if self.score:
                ns = totals[:, ix["n_score"]]
                out.update({k: totals[:, ix[k]] / ns for k in SCORE_MEANS})
            if self.groups:
                for k in MACRO_MEANS:
                    per_group = np.stack([totals[:, ix[f"macro:{g}:{k}"]] / totals[:, ix[f"macro:{g}:n"]]
                                          for g in self.groups], axis=1)
                    out[f"macro:{k}"] = np.nanmean(per_group, axis=1) if per_group.size else per_group
        return out


def _aurc_samples(cols: _Columns, sel: np.ndarray, row_weights: np.ndarray) -> np.ndarray:
    """AURC per resample of the rows in ``sel``; ``row_weights`` [R, rows] (see ``rlcd.metrics.risk_curve``)."""
    idx = np.flatnonzero(sel)
    c, a = cols.conf[idx], cols.acc[idx]
    order = np.lexsort((a, -c))
    cs, err = c[order], 1.0 - a[order]
    starts = np.flatnonzero(np.r_[True, cs[1:] != cs[:-1]])  # first row of each tie
    w = row_weights[:, idx[order]]
    w_tie = np.add.reduceat(w, starts, axis=1)
    e_tie = np.add.reduceat(w * err, starts, axis=1)
    kept, errs = np.cumsum(w_tie, axis=1), np.cumsum(e_tie, axis=1)
    total = kept[:, -1:]
    with np.errstate(invalid="ignore", divide="ignore"):
        risk = np.where(kept > 0, errs / kept, 0.0)
        return (w_tie / total * risk).sum(axis=1)


# ----------------------------------------------------------------------------------------------
# public


def _case_sums(values: np.ndarray, codes: np.ndarray, n_cases: int) -> np.ndarray:
    """[cases, columns]: the column sums over the rows of each case."""
    out = np.zeros((n_cases, values.shape[1]))
    np.add.at(out, codes, values)
    return out


def _resample_counts(n_cases: int, resamples: int, seed: int) -> Iterable[np.ndarray]:
    rng = np.random.default_rng(seed)
    step = chunk_size(n_cases)
    for lo in range(0, resamples, step):
        yield group_counts(draw_groups(rng, n_cases, min(step, resamples - lo)), n_cases)


def _blocks(cols: _Columns, types: np.ndarray, sgroups: np.ndarray) -> dict[tuple[str, str | None], _Block]:
    out = {("overall", None): _Block(cols, np.ones(len(types), dtype=bool), sgroups)}
    for t in [t for t in M.QUESTION_TYPES if t in set(types)] + sorted(set(types) - set(M.QUESTION_TYPES)):
        out[("per_type", t)] = _Block(cols, types == t, None)
    return out


Samples = dict[tuple[str, tuple[str, str | None]], dict[str, np.ndarray]]


def resampled_metrics(rows: Sequence[Mapping[str, Any]], temperatures: Mapping[str, float] | None, *,
                      resamples: int = RESAMPLES, seed: int = SEED) -> tuple[Samples, Samples, int]:
    """Every metric of every block on every resample, raw and calibrated.

    Returns ``(samples, points, n_cases)``: ``samples[(side, (kind, type))][metric]`` is an array of
    ``resamples`` values (side "raw" | "calibrated"; kind "overall" | "per_type"; group-macro metrics
    are ``"macro:<metric>"`` of the overall block), ``points`` the same on the rows as given.
    Resample r draws the cases ``draw_groups(default_rng(seed), n_cases, ...)[r]`` over the rows in
    ``rlcd.metrics.sorted_rows`` order, cases numbered by first appearance.
    """
    rows = M.sorted_rows(rows)
    codes, n_cases = group_codes([group_key(r) for r in rows], len(rows))
    types = np.array([str(r["type"]) for r in rows])
    sgroups = np.array([str(r["group"]) for r in rows])
    temps = {t: float(temperatures.get(t, 1.0)) for t in M.QUESTION_TYPES} if temperatures else None
    sides = {"raw": _blocks(_Columns(rows, None), types, sgroups),
             "calibrated": _blocks(_Columns(rows, temps), types, sgroups)}
    keys = list(sides["raw"])
    layout = [(side, key) for side in sides for key in keys]
    sums = _case_sums(np.concatenate([sides[s][k].values for s, k in layout], axis=1), codes, n_cases)
    widths = np.cumsum([0] + [sides[s][k].values.shape[1] for s, k in layout])
    samples: dict[tuple, dict[str, list[np.ndarray]]] = {sk: {} for sk in layout}
    for counts in _resample_counts(n_cases, resamples, seed):
        totals = counts @ sums
        row_weights = counts[:, codes]
        for j, (side, key) in enumerate(layout):
            block = sides[side][key]
            stats = block.statistics(totals[:, widths[j]:widths[j + 1]])
            stats["aurc"] = _aurc_samples(block.cols, block.sel, row_weights)
            for name, v in stats.items():
                samples[(side, key)].setdefault(name, []).append(v)
    joined = {sk: {name: np.concatenate(v) for name, v in d.items()} for sk, d in samples.items()}
    points = {}
    for side, key in layout:
        block = sides[side][key]
        points[(side, key)] = block.statistics(block.values.sum(axis=0, keepdims=True))
        points[(side, key)]["aurc"] = _aurc_samples(block.cols, block.sel, np.ones((1, len(rows))))
    return joined, points, n_cases


def split_intervals(rows: Sequence[Mapping[str, Any]], temperatures: Mapping[str, float] | None, *,
                    resamples: int = RESAMPLES, seed: int = SEED) -> dict[str, Any]:
    """Grouped-bootstrap 95% intervals of one split's metrics, raw and calibrated, and the paired
    calibration effect.

    Returns ``{"raw": blocks, "calibrated": blocks, "calibration_effect": blocks_of_deltas,
    "n_cases": int}`` where ``blocks = {"overall": {metric: [lo, hi]}, "per_type": {t: {...}},
    "group_macro": {metric: [lo, hi]}}`` and the deltas are ``{metric: {"delta", "ci95"}}`` for
    ``calibrated - raw`` of NLL, Brier, ECE and target ECE.
    """
    if not rows:
        return {"raw": {}, "calibrated": {}, "calibration_effect": {}, "n_cases": 0}
    samples, points, n_cases = resampled_metrics(rows, temperatures, resamples=resamples, seed=seed)
    keys = [key for side, key in samples if side == "raw"]
    out: dict[str, Any] = {"n_cases": n_cases}
    for side in ("raw", "calibrated"):
        out[side] = _nest({key: {name: _interval(v) for name, v in samples[(side, key)].items()} for key in keys})
    effect = {key: {m: {"delta": _round(float(points[("calibrated", key)][m][0] - points[("raw", key)][m][0])),
                        "ci95": _interval(samples[("calibrated", key)][m] - samples[("raw", key)][m])}
                    for m in DELTA_METRICS} for key in keys}
    out["calibration_effect"] = _nest(effect)
    return out


def _nest(blocks: Mapping[tuple[str, str | None], dict[str, Any]]) -> dict[str, Any]:
    """{("overall", None): ..., ("per_type", t): ...} -> {"overall", "per_type": {t}, "group_macro"}."""
    out: dict[str, Any] = {"per_type": {}}
    for (kind, t), d in blocks.items():
        if kind == "overall":
            out["overall"] = {k: v for k, v in d.items() if not k.startswith("macro:")}
            macro = {k.split(":", 1)[1]: v for k, v in d.items() if k.startswith("macro:")}
            if macro:
                out["group_macro"] = macro
        else:
            out["per_type"][t] = d
    return out


def temperature_intervals(rows: Sequence[Mapping[str, Any]], *, resamples: int = RESAMPLES, seed: int = SEED,
                          min_rows: int = MIN_ROWS) -> dict[str, list[float | None] | None]:
    """{type: [lo, hi]} of the temperature refitted on each case resample of the calibration rows.

    A type with fewer than ``min_rows`` rows keeps T = 1 in ``rlcd.calibrate`` and gets None here.
    """
    out: dict[str, list[float | None] | None] = {t: None for t in M.QUESTION_TYPES}
    for t, fits in resampled_temperatures(rows, resamples=resamples, seed=seed, min_rows=min_rows).items():
        out[t] = _interval(fits) if fits is not None else None
    return out


def resampled_temperatures(rows: Sequence[Mapping[str, Any]], *, resamples: int = RESAMPLES, seed: int = SEED,
                           min_rows: int = MIN_ROWS) -> dict[str, np.ndarray | None]:
    """{type: the temperature fitted on each resample} (None for a type below ``min_rows`` rows).

    Resamples draw cases over all the rows (as ``resampled_metrics`` does), so the types share them.
    """
    rows = M.sorted_rows(rows)
    out: dict[str, np.ndarray | None] = {}
    if not rows:
        return out
    codes, n_cases = group_codes([group_key(r) for r in rows], len(rows))
    types = np.array([str(r["type"]) for r in rows])
    u = np.linspace(math.log(T_MIN), math.log(T_MAX), GRID)
    for t in sorted(set(types), key=lambda x: (M.QUESTION_TYPES.index(x) if x in M.QUESTION_TYPES else 99, x)):
        idx = np.flatnonzero(types == t)
        if idx.size < min_rows:
            out[t] = None
            continue
        losses = _row_losses([rows[i] for i in idx], np.exp(u))  # [rows, grid]
        sums = _case_sums(np.concatenate([np.ones((idx.size, 1)), losses], axis=1), codes[idx], n_cases)
        fits = []
        for counts in _resample_counts(n_cases, resamples, seed):
            totals = counts @ sums
            with np.errstate(invalid="ignore", divide="ignore"):
                curve = totals[:, 1:] / totals[:, :1]
            fits.append(_grid_minimum(u, curve))
        out[t] = np.exp(np.concatenate(fits))
    return out


def _row_losses(rows: Sequence[Mapping[str, Any]], temps: np.ndarray) -> np.ndarray:
    """[rows, len(temps)]: each row's soft cross-entropy at each temperature (``rlcd.calibrate.soft_ce``)."""
    import torch

    z, t, mask = padded([r["logits"] for r in rows], [r["target"] for r in rows])
    step = max(1, _GRID_CELLS // max(1, z.numel()))  # temperatures per call: [step, rows, K] stays bounded
    grid = torch.as_tensor(temps, dtype=torch.float64).reshape(-1, 1, 1)
    return torch.cat([soft_ce(z, t, mask, grid[j:j + step], per_row=True) for j in range(0, len(temps), step)]).T.numpy()


def _grid_minimum(u: np.ndarray, curve: np.ndarray) -> np.ndarray:
    """Minimiser in u of each row of ``curve`` [R, grid]: grid argmin refined by a parabola (bounds kept)."""
    j = np.argmin(np.where(np.isfinite(curve), curve, np.inf), axis=1)
    inner = (j > 0) & (j < len(u) - 1)
    jj = np.clip(j, 1, len(u) - 2)
    rows = np.arange(curve.shape[0])
    lo, mid, hi = curve[rows, jj - 1], curve[rows, jj], curve[rows, jj + 1]
    h = u[1] - u[0]
    with np.errstate(invalid="ignore", divide="ignore"):
        step = 0.5 * h * (lo - hi) / (lo - 2 * mid + hi)
    step = np.where(np.isfinite(step), np.clip(step, -h, h), 0.0)
    best = np.where(inner, u[jj] + step, u[j])
    return np.where(np.isfinite(curve).any(axis=1), best, np.nan)


FLAG_METRICS = ("nll", "ece")


def effect_blocks(effect: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """``[("overall", block), (type, block), ...]`` of a ``calibration_effect``."""
    return [("overall", effect.get("overall") or {})] + list((effect.get("per_type") or {}).items())


def worsened_by_calibration(effect: Mapping[str, Any]) -> list[tuple[str, str, float, list[float]]]:
    """(block, metric, delta, ci95) for each block of a ``calibration_effect`` whose calibrated NLL or ECE
    is worse than raw beyond the paired 95% interval (its lower bound above 0)."""
    out = []
    for name, block in effect_blocks(effect):
        for m in FLAG_METRICS:
            d = block.get(m) or {}
            ci = d.get("ci95")
            if ci and ci[0] is not None and ci[0] > 0:
                out.append((name, m, d["delta"], ci))
    return out


def bayes_gap_interval(rows: Sequence[Mapping[str, Any]], temperatures: Mapping[str, float] | None, *,
                       resamples: int = RESAMPLES, seed: int = SEED) -> dict[str, Any] | None:
    """The gap to the Bayes floor of `rows` that carry a posterior, with its grouped-bootstrap 95% interval, and
    the uniform answer's gap on the same rows: ``{"gap", "ci95": [lo, hi], "uniform_gap", "n"}`` (None when no
    row carries a posterior). Per row the gap is NLL(model) - NLL(posterior) against the row's target, as in
    ``rlcd.metrics`` (``bayes_gap``); cases are resampled whole."""
    from rlcd.bootstrap import bootstrap_means

    gaps, uniform, groups = [], [], []
    for r in rows:
        if r.get("posterior") is None:
            continue
        t, q = np.asarray(r["target"], dtype=np.float64), np.asarray(r["posterior"], dtype=np.float64)
        floor = M.nll(q, t)
        gaps.append(M.nll(M.row_probabilities(r, temperatures), t) - floor)
        uniform.append(M.nll(np.full(t.size, 1.0 / t.size), t) - floor)
        groups.append(group_key(r))
    if not gaps:
        return None
    boot = bootstrap_means(np.asarray(gaps), resamples=resamples, seed=seed, groups=groups)
    return {"gap": _round(float(np.mean(gaps))), "ci95": _interval(boot), "uniform_gap": _round(float(np.mean(uniform))),
            "n": len(gaps)}
