"""`rlcd probe coherence`: does the model give one probability per meaning?

The test split's original rows are derived (``rlcd.data.derive``, every form including the order family, a pure
function of each row, so two runs over the same data are asked the same questions) and every base row and
derived row is scored. A derived form's map ``f`` (its ``cells``; ``rlcd.data.derive.transform``) turns the
model's answer ``p`` to the base question into the answer coherence asks of the derived question, so per
derived row:

- **deviation** ``d = max_j |q_j - f(p)_j|`` (q: the model's answer to the derived question; for a noul form
  ``|q_true - f(p)_true|``);
- **violation** ``d > tol`` (``TOL`` = 0.05, the tolerance probability-law checks of System One servers use);
- **gap to the exact target** ``TV(q, e) = 0.5 sum_j |q_j - e_j|`` with e the derived row's posterior (its
  target when it has none), beside ``TV(f(p), e)``, the gap the base answer implies: coherence alone is not
  quality (a constant answer is perfectly coherent for most forms), so every violation rate stands beside a gap.

Reported per family (type equivalence, complement, partition and merge, marginal and tail, sub-menu, order and
wording) and per form: rows, cases, violation rate with its 95% percentile bootstrap interval over whole cases
(``rlcd.bootstrap``, ``resamples`` draws from ``default_rng(seed)``), mean deviation with its interval, mean gap
of the derived answer and of the mapped base answer. Probabilities are ``softmax(z / T_type)``: raw (T = 1)
unless ``calibrated`` (the run's per-type temperatures; a form changing the type then also changes T, which
this measures too). A run's own test split is written to ``RUN/eval/probe-coherence.json`` for ``rlcd report``.
A data directory whose test split already holds derived rows (``rlcd data derive``) is probed on its original
rows, re-derived here, so runs trained with and without forms are asked the same questions.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from rlcd.analysis.probes import (AS_ASKED, CASE_ROWS_PER_CALL, CONFIDENCE, RESAMPLES, ScoreFn, load_run_model,
                                  model_scorer, percentile_interval, scored_checkpoint, softmax, write_json_atomic)
from rlcd.data.derive import FAMILIES, FORMS, PER_OPTION, apply_derived, derive_records, parse_forms
from rlcd.run import Run
from rlcd.schema import Record

FORMAT = "rlcd.probe_coherence/1"
TOL = 0.05
FILE = "probe-coherence.json"


def deviation(meta: Mapping[str, Any], p_base: Sequence[float], q_derived: Sequence[float]) -> float:
    """``max_j |q_j - f(p)_j|``: how far the derived answer is from the one the base answer implies."""
    implied = apply_derived(dict(meta), p_base)
    q = np.asarray(q_derived, dtype=np.float64)
    if q.shape != implied.shape:
        raise ValueError(f"derived answer has {q.size} candidates, the form implies {implied.size}")
    return float(np.max(np.abs(q - implied)))


def violation_counts(devs: Sequence[float], tol: float = TOL) -> tuple[int, int]:
    """(violations, comparisons): a violation is a deviation strictly above ``tol``."""
    return int(sum(1 for d in devs if d > tol)), len(devs)


def _tv(a: Sequence[float], b: Sequence[float]) -> float:
    return float(0.5 * np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).sum())


def _interval(values: Sequence[float], groups: Sequence[str], resamples: int, seed: int) -> list[float] | None:
    from rlcd.bootstrap import bootstrap_means

    if not len(values):
        return None
    return percentile_interval(bootstrap_means(np.asarray(values, dtype=np.float64), resamples=resamples, seed=seed,
                                               groups=np.asarray(list(groups), dtype=object).astype(str)), CONFIDENCE)


def _block(rows: list[dict[str, Any]], *, tol: float, resamples: int, seed: int) -> dict[str, Any]:
    if not rows:
        return {"n_rows": 0, "n_cases": 0}
    cases = [r["case"] for r in rows]
    devs = [r["deviation"] for r in rows]
    viol = [1.0 if d > tol else 0.0 for d in devs]
    n_viol, n = violation_counts(devs, tol)
    return {
        "n_rows": n, "n_cases": len(set(cases)), "violations": n_viol,
        "violation_rate": n_viol / n, "violation_rate95": _interval(viol, cases, resamples, seed),
        "mean_deviation": float(np.mean(devs)), "mean_deviation95": _interval(devs, cases, resamples, seed),
        "mean_gap": float(np.mean([r["gap"] for r in rows])),
        "mean_gap_implied": float(np.mean([r["gap_implied"] for r in rows])),
    }


def _score_all(score_fn: ScoreFn, records: list[Record]) -> list[np.ndarray]:
    """Logits of every record, a case's rows in one scorer call (at most CASE_ROWS_PER_CALL rows per call)."""
    by_case: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(records):
        by_case[r.case_id if r.case_id is not None else "probe-coherence/" + r.id].append(i)
    out: list[np.ndarray | None] = [None] * len(records)
    batch: list[int] = []

    def flush() -> None:
        if not batch:
            return
        asked = [records[i] for i in batch]
        logits = list(score_fn(asked))
        if len(logits) != len(asked):
            raise ValueError(f"scorer returned {len(logits)} rows for {len(asked)} records")
        for i, z in zip(batch, logits):
            z = np.asarray(z, dtype=np.float64)
            if z.shape != (records[i].question.k,):
                raise ValueError(f"record {records[i].id!r}: scorer gave {z.shape} logits for {records[i].question.k}")
            out[i] = z
        batch.clear()

    for idx in by_case.values():
        if batch and len(batch) + len(idx) > CASE_ROWS_PER_CALL:
            flush()
        batch.extend(idx)
    flush()
    return out  # type: ignore[return-value]


def probe_coherence_scores(score_fn: ScoreFn, records: Sequence[Record], *, forms: Sequence[str] | None = None,
                           per_option: int = PER_OPTION, temperatures: Mapping[str, float] | None = None,
                           tol: float = TOL, resamples: int = RESAMPLES, seed: int = 0,
                           keep_rows: bool = True) -> dict[str, Any]:
    """The coherence probe of a scorer (records -> logits) over ``records``' original rows (derived rows in
    ``records`` are set aside: the forms are derived here). ``forms``: default every form (order family too)."""
    forms = tuple(forms) if forms is not None else parse_forms(None, reorder=True)
    base = [r for r in records if r.derived is None]
    rows, excluded = derive_records(base, forms, per_option=per_option)
    logits = _score_all(score_fn, rows)
    temps = dict(temperatures or {})
    answers = {r.id: softmax(z, float(temps.get(r.question.type, 1.0))) for r, z in zip(rows, logits)}
    by_id = {r.id: r for r in base}
    items = []
    for r in rows:
        if r.derived is None:
            continue
        meta, b = r.derived, by_id[r.derived["base"]]
        p, q = answers[b.id], answers[r.id]
        exact = r.posterior if r.posterior is not None else r.target
        items.append({"id": r.id, "base": b.id, "form": meta["form"], "family": meta["family"],
                      "case": b.case_id if b.case_id is not None else r.case_id, "type": r.question.type,
                      "deviation": deviation(meta, p, q), "gap": _tv(q, exact),
                      "gap_implied": _tv(apply_derived(meta, p), exact),
                      "answer": [float(x) for x in q], "implied": apply_derived(meta, p).tolist()})
    base_gap = [_tv(answers[b.id], b.posterior if b.posterior is not None else b.target) for b in base]
    kw = {"tol": tol, "resamples": resamples, "seed": seed}
    per_family = {fam: _block([it for it in items if it["family"] == fam], **kw)
                  for fam in FAMILIES if any(FORMS[f] == fam for f in forms)}
    per_form = {f: {"family": FORMS[f], **_block([it for it in items if it["form"] == f], **kw)} for f in forms}
    out: dict[str, Any] = {
        "format": FORMAT, "requests": "as_asked", "requests_note": AS_ASKED,
        "tol": tol, "resamples": resamples, "seed": seed, "confidence": CONFIDENCE,
        "forms": list(forms), "per_option": per_option, "families": {k: FAMILIES[k] for k in per_family},
        "temperatures": temps or None, "n_base": len(base), "n_derived": len(items),
        "n_excluded": len(excluded), "exclusions": _count(e["reason"] for e in excluded),
        "base_mean_gap": float(np.mean(base_gap)) if base_gap else None,
        "overall": _block(items, **kw), "per_family": per_family, "per_form": per_form,
    }
    if keep_rows:
        out["rows"] = items
    return out


def _count(xs) -> dict[str, int]:
    c: dict[str, int] = defaultdict(int)
    for x in xs:
        c[x] += 1
    return dict(sorted(c.items()))


def probe_coherence_run(run_dir: Path, *, data_dir: Path | None = None, limit: int | None = None,
                        forms: Sequence[str] | None = None, per_option: int = PER_OPTION, calibrated: bool = False,
                        tol: float = TOL, batch_size: int = 32, placement: Any = None, resamples: int = RESAMPLES,
                        seed: int = 0, save: bool = True) -> dict[str, Any]:
    """Load a run, read the test split of its data dir (or ``data_dir``), run the probe; the run's own test
    split (any data dir with the same original test rows) is saved to ``RUN/eval/probe-coherence.json``."""
    from rlcd.analysis.probes import first_per_type
    from rlcd.data.io import load_split

    from rlcd.analysis.probes import check_probe_order_options

    run_dir = Path(run_dir)
    if not 0 < tol < 1:
        raise ValueError(f"--tol {tol}: give a probability difference in (0, 1)")
    check_probe_order_options(limit=limit, max_perms=1, votes=1, resamples=resamples, batch_size=batch_size)
    run = Run(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    if not (run.export_dir / "model.json").is_file() and not run.exists():
        raise FileNotFoundError(f"{run_dir}: not a run (no config.json, no export/model.json)")
    own = (run.config() if run.exists() else {}).get("data_dir")
    if data_dir is None:
        if own is None:
            raise ValueError(f"{run_dir}/config.json names no data_dir; pass the processed data dir (--data)")
        data_dir = Path(own)
    data_dir = Path(data_dir)
    path = data_dir / "test.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (the test split of {data_dir})")
    records = first_per_type([r for r in load_split(data_dir, "test") if r.derived is None], limit)
    if not records:
        raise ValueError(f"{path} has no original rows to probe")
    own_ids = None
    if own is not None and (Path(own) / "test.jsonl").is_file():
        own_ids = [r.id for r in load_split(Path(own), "test") if r.derived is None]
    model, temps, config = load_run_model(run_dir, placement=placement)
    score_fn = model_scorer(model, model.collator(image_root=data_dir), device=model.device, batch_size=batch_size)
    out = probe_coherence_scores(score_fn, records, forms=forms, per_option=per_option,
                                 temperatures=temps if calibrated else None, tol=tol, resamples=resamples, seed=seed)
    out.update(run=str(run_dir), split="test", data_dir=str(data_dir), limit=limit, calibrated=calibrated,
               placement=model.placement, checkpoint_sha256=scored_checkpoint(run_dir), saved=None)
    if save and limit is None and own_ids is not None and own_ids == [r.id for r in records]:
        target = Run(run_dir).eval_dir / FILE
        out["saved"] = str(target)
        write_json_atomic(target, out)
    return out
