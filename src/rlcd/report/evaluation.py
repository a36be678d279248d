"""evaluation.json: its whole content from the prediction files, so the files regenerate it exactly.

``evaluation_from_predictions`` builds the content from the prediction rows, the temperatures, the
metadata and the majority baseline (the inputs that are not in the prediction files);
``regenerate_evaluation(run)`` rebuilds it from the files and ``evaluation_json`` gives the
canonical text (byte-identical for the same inputs, whatever the row order).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from rlcd import metrics as M
from rlcd import uncertainty as U
from rlcd.run import Run
from rlcd.schema import QUESTION_TYPES

FORMAT = "rlcd.evaluation/2"
SPLIT_ORDER = ("dev", "calibration", "test")
HEADLINE_PREFERENCE = ("test", "dev", "calibration")


def split_order(splits: Iterable[str]) -> list[str]:
    splits = set(splits)
    return [s for s in SPLIT_ORDER if s in splits] + sorted(splits - set(SPLIT_ORDER))


def headline_split(splits: Iterable[str]) -> str:
    """The split whose metrics are the headline ``raw``/``calibrated`` blocks (test when present)."""
    splits = list(splits)
    for s in HEADLINE_PREFERENCE:
        if s in splits:
            return s
    if not splits:
        raise ValueError("no prediction splits")
    return sorted(splits)[0]


def _with_intervals(summary: dict[str, Any], intervals: Mapping[str, Any]) -> dict[str, Any]:
    """``ci95`` beside the overall, per-type and group-macro metrics of a ``metrics.summarize`` output."""
    if "overall" in intervals:
        summary["overall"]["ci95"] = intervals["overall"]
    for t, ci in intervals.get("per_type", {}).items():
        summary["per_type"][t]["ci95"] = ci
    if "group_macro" in intervals:
        summary["group_macro"]["ci95"] = intervals["group_macro"]
    return summary


def evaluation_from_predictions(pred_rows_by_split: Mapping[str, Sequence[Mapping[str, Any]]],
                                temperatures: Mapping[str, float] | None, meta: Mapping[str, Any] | None,
                                *, majority_baseline: Mapping[str, Any] | None = None,
                                resamples: int = U.RESAMPLES, seed: int = U.SEED) -> dict[str, Any]:
    """The complete evaluation.json content (plain JSON types).

    ``pred_rows_by_split``: {split: prediction rows}; ``temperatures``: {type: T} (missing types and
    None mean T = 1); ``meta``: copied verbatim (selected step, checkpoint sha256, data hashes,
    calibration fit info, ...); ``majority_baseline``: the output of ``rlcd.metrics.majority_baseline``
    (it needs the training rows, which are not in the prediction files), copied verbatim.

    Layout::

        {"format", "headline_split", "n_rows": {split: n},
         "temperatures": {choice, noul, score}, "temperatures_ci95": {type: [lo, hi] | null},
         "raw": summary, "calibrated": summary,           # the headline split (test when present)
         "calibration_effect": effect,                    # calibrated - raw, paired (headline split)
         "other_splits": {split: {"raw", "calibrated", "calibration_effect"}},
         "bootstrap": {...}, "majority_baseline": {...} | null, "meta": {...}}

    where each summary is ``rlcd.metrics.summarize``'s output with ``ci95: {metric: [lo, hi]}``
    beside its overall, per-type and group-macro metrics, and ``effect`` is
    ``rlcd.uncertainty.split_intervals``'s ``calibration_effect`` (``{"overall", "per_type": {t}}``
    of ``{metric: {"delta", "ci95"}}``). Intervals and temperature intervals: grouped bootstrap over
    source cases (``rlcd.uncertainty``). Same inputs -> identical JSON text (row order does not matter).
    """
    splits = split_order(pred_rows_by_split)
    head = headline_split(splits)
    temps = {t: float((temperatures or {}).get(t, 1.0)) for t in QUESTION_TYPES}
    for t in sorted(set(map(str, temperatures or {})) - set(QUESTION_TYPES)):
        temps[t] = float(temperatures[t])  # type: ignore[index]

    n_cases = {}

    def both(split):
        rows = pred_rows_by_split[split]
        ci = U.split_intervals(rows, temps, resamples=resamples, seed=seed)
        n_cases[split] = ci["n_cases"]
        return {"raw": _with_intervals(M.summarize(rows, None), ci["raw"]),
                "calibrated": _with_intervals(M.summarize(rows, temps), ci["calibrated"]),
                "calibration_effect": ci["calibration_effect"]}

    headline = both(head)
    cal_rows = pred_rows_by_split.get("calibration") or []
    ev = {
        "format": FORMAT,
        "headline_split": head,
        "n_rows": {s: len(pred_rows_by_split[s]) for s in splits},
        "temperatures": temps,
        "temperatures_ci95": U.temperature_intervals(cal_rows, resamples=resamples, seed=seed),
        "raw": headline["raw"],
        "calibrated": headline["calibrated"],
        "calibration_effect": headline["calibration_effect"],
        "other_splits": {s: both(s) for s in splits if s != head},
        "bootstrap": {"unit": "source case (case_id, else the id prefix before ':')", "resamples": resamples,
                      "seed": seed, "confidence": U.CONFIDENCE, "interval": "percentile", "n_cases": n_cases,
                      "temperatures_fitted_on": "calibration" if cal_rows else None},
        "majority_baseline": dict(majority_baseline) if majority_baseline is not None else None,
        "meta": dict(meta or {}),
    }
    return M.to_jsonable(ev)


def evaluation_json(ev: Mapping[str, Any]) -> str:
    """Canonical text of an evaluation dict (what evaluation.json holds)."""
    return M.dumps(ev)


def as_run(run: Run | str | Path) -> Run:
    return run if isinstance(run, Run) else Run(run)


def write_evaluation(run: Run | str | Path, ev: Mapping[str, Any]) -> Path:
    """Write ``RUN/eval/evaluation.json`` in canonical form."""
    path = as_run(run).evaluation_path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(evaluation_json(ev), encoding="utf-8")
    return path


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file (blank lines skipped); a bad line raises naming the file and line."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
    return rows


def load_predictions(run: Run | str | Path) -> dict[str, list[dict[str, Any]]]:
    """{split: rows} from ``RUN/eval/predictions-<split>.jsonl``."""
    out = {split: read_jsonl(p) for split, p in as_run(run).prediction_paths().items()}
    return {s: out[s] for s in split_order(out)}


def regenerate_evaluation(run: Run | str | Path) -> dict[str, Any]:
    """Rebuild evaluation.json content from the prediction files + the stored non-derived inputs."""
    run = as_run(run)
    stored = json.loads(run.evaluation_path.read_text(encoding="utf-8"))
    return evaluation_from_predictions(load_predictions(run), stored.get("temperatures"),
                                       stored.get("meta"), majority_baseline=stored.get("majority_baseline"))
