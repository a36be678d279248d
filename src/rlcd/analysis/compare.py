"""Paired bootstrap comparison of two runs (or two sets of seed runs) on the same rows.

Conventions (printed by ``rlcd compare`` too):

* **Direction**: every difference is ``B - A`` (run B minus run A). For ``nll`` and ``brier``
  (lower is better) a negative difference means B is better; for ``accuracy`` a positive one does.
* **Rows**: prediction rows are aligned by ``id``; only ids present on both sides (and in every run
  of a side) are compared. How many rows each run/side lost is reported, never dropped silently.
* **Seed pooling**: with several runs on a side, the per-row metric is averaged over that side's
  runs before the bootstrap (the resampling unit stays the row / group).
* **Probabilities**: ``softmax(logits / T_type)`` with the per-type temperatures of the run's
  ``eval/evaluation.json`` (``"temperatures": {type: T}``; T = 1 for a type without one, or for
  every type when the file has none or ``raw=True``).
* **Bootstrap**: ``resamples`` resamples of whole source cases with replacement (the default, as
  the evaluation's intervals: rows of one case -- ``case_id``, else the id prefix before ``:`` --
  are not independent; every drawn case contributes all its rows, so the resampled statistic is
  ``sum of diffs over drawn rows / number of drawn rows``), or, with ``grouped=False``
  (``rlcd compare --rows``), of single rows. The interval is the
  percentile interval of the resampled mean differences. The two-sided p-value is the percentile-
  bootstrap p-value ``p = min(1, 2 * min((1 + #{d* <= 0}) / (R + 1), (1 + #{d* >= 0}) / (R + 1)))``:
  twice the (add-one smoothed) share of the bootstrap distribution on the far side of zero, so
  ``p < 1 - confidence`` exactly when 0 lies outside the percentile interval (up to ties and the
  add-one). Its smallest value is ``2 / (R + 1)``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlcd import metrics as _metrics
from rlcd.bootstrap import bootstrap_means, draw_groups, group_codes, group_key, resample_indices
from rlcd.run import Run
from rlcd.schema import QUESTION_TYPES

METRICS: dict[str, Any] = {
    "nll": _metrics.nll,  # -sum t log max(p, 1e-12)
    "brier": _metrics.brier,  # sum (p - t)^2
    "accuracy": _metrics.accuracy,  # argmax p == argmax t (first index on ties)
}
LOWER_IS_BETTER = {"nll": True, "brier": True, "accuracy": False}
DIRECTION = "B - A"
__all__ = ["bootstrap_means", "compare_runs", "draw_groups", "group_codes", "group_key", "load_prediction_rows",
           "paired_bootstrap", "resample_indices", "row_metric", "summary_lines"]


# --------------------------------------------------------------------------------------------
# loading


def _temperatures_of(evaluation: Mapping[str, Any]) -> dict[str, float] | None:
    temps = evaluation.get("temperatures")
    if temps is None:
        for key in ("calibrated", "calibration"):
            sub = evaluation.get(key)
            if isinstance(sub, Mapping) and isinstance(sub.get("temperatures"), Mapping):
                temps = sub["temperatures"]
                break
    if temps is None:
        return None
    if not isinstance(temps, Mapping):
        raise ValueError(f"evaluation.json 'temperatures' must be an object {{type: T}}, got {temps!r}")
    out = {}
    for k, v in temps.items():
        v = float(v)
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"evaluation.json temperature for type {k!r} must be finite and > 0, got {v}")
        out[str(k)] = v
    return out


def load_temperatures(run_dir: str | Path, eval_name: str | None = None) -> dict[str, float] | None:
    """Per-type temperatures from ``run_dir/eval/evaluation.json`` (``eval-NAME/`` with ``eval_name``; None when
    absent)."""
    path = _run(run_dir, eval_name).evaluation_path
    if not path.exists():
        return None
    with path.open() as f:
        evaluation = json.load(f)
    return _temperatures_of(evaluation)


def _run(run_dir: str | Path, eval_name: str | None) -> Run:
    """The run whose ``eval/`` (or, with ``eval_name``, ``eval-NAME/``: `rlcd evaluate RUN --data D --out NAME`) is read."""
    return Run(run_dir) if eval_name is None else Run(run_dir).on_data(eval_name)


def load_prediction_rows(run_dir: str | Path, split: str = "test", *, raw: bool = False,
                         eval_name: str | None = None) -> list[dict[str, Any]]:
    """Rows of ``run_dir/eval/predictions-<split>.jsonl`` (``eval-NAME/`` with ``eval_name``) with probabilities
    attached; the temperatures are those of the same directory's evaluation.json.

    Each returned row is the JSON object of the file plus ``"temperature"`` (the T applied) and
    ``"probs"`` (``softmax(logits / T)`` as a float64 array). ``raw=True`` ignores the temperatures.
    Raises a ``RunError`` (a ``FileNotFoundError``) when the file is missing (`missing_predictions`) and ``ValueError`` naming the line for a
    malformed row or a duplicate id.
    """
    run_dir = Path(run_dir)
    path = _run(run_dir, eval_name).predictions_path(split)
    if not path.exists():
        raise missing_predictions(run_dir, split, eval_name)
    temps = None if raw else load_temperatures(run_dir, eval_name)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            for key in ("id", "type", "target", "logits"):
                if key not in row:
                    raise ValueError(f"{where}: prediction row has no {key!r}")
            rid = str(row["id"])
            if rid in seen:
                raise ValueError(f"{where}: duplicate id {rid!r}")
            seen.add(rid)
            if len(row["logits"]) != len(row["target"]):
                raise ValueError(
                    f"{where}: row {rid!r} has {len(row['logits'])} logits but {len(row['target'])} target entries"
                )
            t = 1.0 if temps is None else float(temps.get(row["type"], 1.0))
            try:
                probs = _metrics.softmax(row["logits"], t)
            except ValueError as e:
                raise ValueError(f"{where}: row {rid!r}: {e}") from None
            row["id"] = rid
            row["temperature"] = t
            row["probs"] = probs
            rows.append(row)
    return rows


def missing_predictions(run_dir: Path, split: str, eval_name: str | None = None) -> Exception:
    """The one-line error for a side without ``predictions-<split>.jsonl``, saying what to run for that kind of
    directory: none at all, a remote evaluation (``remote.json``: `rlcd evaluate --remote` scores one split, plus
    calibration, into its own directory), or a run (`rlcd evaluate RUN` writes dev, calibration and test)."""
    from rlcd.errors import RunError

    path = _run(run_dir, eval_name).predictions_path(split)
    if not run_dir.is_dir():
        return RunError(f"{run_dir}: no such directory (a run, or a remote evaluation's --out)")
    remote = run_dir / "remote.json"
    if remote.is_file():
        try:
            info = json.loads(remote.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            info = {}
        info = info if isinstance(info, dict) else {}
        held = sorted(p.name[len("predictions-"):-len(".jsonl")] for p in path.parent.glob("predictions-*.jsonl"))
        return RunError(f"{path}: no predictions for split {split!r}: {run_dir} is a remote evaluation "
                        f"(remote.json) of {info.get('split', '?')!r} with predictions for "
                        f"{', '.join(held) or 'no split'}; score {split} into a new directory with `rlcd evaluate "
                        f"--remote {info.get('url') or 'URL'} --data {info.get('data') or 'DATA'} --split {split} "
                        "--out NEWDIR` and compare that")
    if eval_name is not None:
        return RunError(f"{path}: no predictions for split {split!r} (run `rlcd evaluate {run_dir} --data DATA "
                        f"--out {eval_name}`)")
    return RunError(f"{path}: no predictions for split {split!r} (run `rlcd evaluate {run_dir}`)")


def row_metric(row: Mapping[str, Any], metric: str) -> float:
    """Per-row value of ``metric`` (nll | brier | accuracy) from ``row["probs"]`` and ``row["target"]``."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {sorted(METRICS)}, got {metric!r}")
    return float(METRICS[metric](row["probs"], np.asarray(row["target"], dtype=np.float64)))


# --------------------------------------------------------------------------------------------
# bootstrap


def paired_bootstrap(
    a: np.ndarray,
    b: np.ndarray,
    *,
    resamples: int = 5000,
    seed: int = 0,
    groups: np.ndarray | None = None,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """Paired bootstrap of ``mean(b - a)`` (direction B - A).

    Returns ``{"mean_diff", "ci_low", "ci_high", "p_value", "n", "resamples", "n_groups",
    "confidence", "direction"}``; the interval is the percentile interval at ``confidence`` and the
    p-value is the two-sided percentile-bootstrap p-value defined in the module docstring.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"a and b must be 1-D arrays of the same length, got {a.shape} and {b.shape}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("metric values must be finite")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    d = b - a
    boot = bootstrap_means(d, resamples=resamples, seed=seed, groups=groups)
    alpha = 1.0 - confidence
    lo, hi = np.quantile(boot, [alpha / 2, 1 - alpha / 2])
    r = boot.size
    p_le = (1 + int(np.sum(boot <= 0))) / (r + 1)
    p_ge = (1 + int(np.sum(boot >= 0))) / (r + 1)
    _, n_groups = group_codes(groups, d.size)
    return {
        "mean_diff": float(d.mean()),
        "ci_low": float(lo),
        "ci_high": float(hi),
        "p_value": float(min(1.0, 2.0 * min(p_le, p_ge))),
        "n": int(d.size),
        "resamples": int(resamples),
        "n_groups": int(n_groups),
        "confidence": float(confidence),
        "direction": DIRECTION,
    }


# --------------------------------------------------------------------------------------------
# run comparison


def _side(runs: Sequence[str | Path], metric: str, split: str, raw: bool, label: str,
          eval_name: str | None = None) -> dict[str, Any]:
    if not runs:
        raise ValueError(f"side {label} has no run directories")
    per_run = []
    for run in runs:
        rows = load_prediction_rows(run, split, raw=raw, eval_name=eval_name)
        if not rows:
            raise ValueError(f"{run}: predictions-{split}.jsonl has no rows")
        per_run.append((Path(run), {r["id"]: r for r in rows}))
    common = set(per_run[0][1])
    for _, rows in per_run[1:]:
        common &= set(rows)
    runs_info = []
    for run, rows in per_run:
        runs_info.append({
            "run": str(run), "rows": len(rows), "dropped_not_in_every_run_of_side": len(rows) - len(common),
            "temperatures": {r["type"]: r["temperature"] for r in rows.values()},
        })
    ref = per_run[0][1]
    values: dict[str, float] = {}
    for rid in common:
        for run, rows in per_run[1:]:
            _check_same_row(ref[rid], rows[rid], f"{per_run[0][0]} vs {run}")
        values[rid] = float(np.mean([row_metric(rows[rid], metric) for _, rows in per_run]))
    return {"values": values, "ref": ref, "runs": runs_info, "common": len(common)}


def _check_same_row(r1: Mapping[str, Any], r2: Mapping[str, Any], where: str) -> None:
    t1 = np.asarray(r1["target"], dtype=np.float64)
    t2 = np.asarray(r2["target"], dtype=np.float64)
    if t1.shape != t2.shape or not np.allclose(t1, t2, atol=1e-6):
        raise ValueError(f"{where}: row {r1['id']!r} has different targets ({list(t1)} vs {list(t2)}); "
                         "these runs were not evaluated on the same data")
    l1, l2 = r1.get("labels"), r2.get("labels")
    if l1 is not None and l2 is not None and list(l1) != list(l2):
        raise ValueError(f"{where}: row {r1['id']!r} has different labels ({l1} vs {l2})")


def compare_runs(
    runs_a: Sequence[str | Path],
    runs_b: Sequence[str | Path],
    metric: str = "nll",
    split: str = "test",
    resamples: int = 5000,
    seed: int = 0,
    grouped: bool = True,
    *,
    raw: bool = False,
    confidence: float = 0.95,
    qtype: str | None = None,
    eval_name: str | None = None,
) -> dict[str, Any]:
    """Paired bootstrap of ``metric`` between side A (``runs_a``) and side B (``runs_b``); B - A.

    Rows are aligned by id over the intersection of all runs; several runs per side are averaged per
    row. ``qtype`` (choice | noul | score) keeps the rows of that question type only (the result's
    ``"type"`` and ``rows.other_types`` say so). ``grouped`` (the default) resamples whole source cases (:func:`group_key`); ``grouped=False``
    single rows. ``"resampling_unit"`` says which (``"case"`` or ``"row"``). The result carries
    the bootstrap numbers, the side means, and a ``"rows"`` block with every count of dropped rows.
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {sorted(METRICS)}, got {metric!r}")
    if qtype is not None and qtype not in QUESTION_TYPES:
        raise ValueError(f"--type must be one of {', '.join(QUESTION_TYPES)}, got {qtype!r}")
    side_a = _side(runs_a, metric, split, raw, "A", eval_name)
    side_b = _side(runs_b, metric, split, raw, "B", eval_name)
    ids_a, ids_b = set(side_a["values"]), set(side_b["values"])
    shared = sorted(ids_a & ids_b)
    if not shared:
        raise ValueError(f"runs A and B share no row ids in split {split!r} (A has {len(ids_a)}, B has {len(ids_b)})")
    common = [rid for rid in shared if qtype is None or side_a["ref"][rid]["type"] == qtype]
    if not common:
        raise ValueError(f"runs A and B share no {qtype} rows in split {split!r} ({len(shared)} shared rows of other types)")
    for rid in common:
        _check_same_row(side_a["ref"][rid], side_b["ref"][rid], "run A vs run B")
    a = np.array([side_a["values"][rid] for rid in common])
    b = np.array([side_b["values"][rid] for rid in common])
    groups = np.array([group_key(side_a["ref"][rid]) for rid in common]) if grouped else None
    boot = paired_bootstrap(a, b, resamples=resamples, seed=seed, groups=groups, confidence=confidence)
    return {
        "metric": metric,
        "split": split,
        "direction": DIRECTION,
        "lower_is_better": LOWER_IS_BETTER[metric],
        "calibrated": not raw,
        "grouped": bool(grouped),
        "resampling_unit": "case" if grouped else "row",
        "seed": int(seed),
        "type": qtype,
        "eval": _run(".", eval_name).eval_name,  # the directory read in each run: eval or eval-NAME
        "mean_a": float(a.mean()),
        "mean_b": float(b.mean()),
        **boot,
        "runs_a": [str(r) for r in runs_a],
        "runs_b": [str(r) for r in runs_b],
        "rows": {
            "compared": len(common),
            "a_rows": len(ids_a),
            "b_rows": len(ids_b),
            "other_types": len(shared) - len(common),
            "dropped_a": len(ids_a) - len(shared),
            "dropped_b": len(ids_b) - len(shared),
            "runs_a": side_a["runs"],
            "runs_b": side_b["runs"],
        },
    }


def summary_lines(result: Mapping[str, Any]) -> list[str]:
    """A short human summary of a :func:`compare_runs` result."""
    m = result["metric"]
    better = "lower" if result["lower_is_better"] else "higher"
    rows = result["rows"]
    pct = int(round(100 * result["confidence"]))
    unit = (f"{result['n_groups']} source cases (case_id; --rows for single rows)" if result["grouped"]
            else f"{result['n']} single rows (--rows; rows of one case are not independent)")
    lines = [
        f"{m} on {result['split']}{' (' + result['type'] + ' rows)' if result.get('type') else ''} "
        f"({'calibrated' if result['calibrated'] else 'raw'}; {better} is better): "
        f"A = {result['mean_a']:.4f}, B = {result['mean_b']:.4f}",
        f"difference B - A = {result['mean_diff']:+.4f}, {pct}% CI [{result['ci_low']:+.4f}, {result['ci_high']:+.4f}], "
        f"p = {result['p_value']:.4g} ({result['resamples']} paired bootstrap resamples over {unit}, seed {result['seed']})",
        f"rows compared: {rows['compared']} (dropped: {rows['dropped_a']} only in A, {rows['dropped_b']} only in B"
        + (f"; {rows['other_types']} of other types" if rows.get("other_types") else "")
        + "".join(f"; {r['dropped_not_in_every_run_of_side']} of {r['run']} not in every run of its side"
                  for r in rows["runs_a"] + rows["runs_b"] if r["dropped_not_in_every_run_of_side"])
        + ")",
    ]
    return lines
