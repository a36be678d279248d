"""Gating cut-points: act on the confident answers, escalate the rest -- `eval/thresholds.json` in jev-eval's contract.

What System One users do with probabilities is gate on them. `jev-eval` (PyPI) writes the cut-points the family's
tools load (jev-sort `--thresholds`, Leash, jev-guard) as `thresholds.json`, contract version 1. This module writes
the same file from a run's calibrated predictions (numpy on prediction rows, no model):

* **Rows**: `eval/predictions-calibration.jsonl` picks the gates, `eval/predictions-test.jsonl` verifies them;
  p = softmax(logits / T_type) with the run's temperatures (`eval/temperatures.json`).
* **Gate confidence** (what rlcd serve answers, transformers' definitions): choice `confidence = max(0, (p_max -
  1/K) / (1 - 1/K))`; score `confidence = max(0, 1 - E|l - argmax| / E_uniform|l - (K-1)/2|)`; noul
  `|P(true) - 0.5| * 2` (the contract's two-sided band, never the raw P(true)). A gate t auto-decides an answer
  when its confidence >= t.
* **Correct** (jev-eval's definitions, the gold being argmax of the target, first on ties): choice argmax p ==
  gold; noul (P(true) >= 0.5) == (gold is true); score: the level nearest the expected score `sum_l l p_l`
  (Python's round, clipped to 0..K-1) is within `tolerance` levels of gold.
* **Picking** (jev-eval's `recommend_threshold`, over the distinct confidences observed, highest first, with
  coverage = covered / n and selective accuracy = correct covered / covered): `target_accuracy A` takes the gate of
  most coverage whose selective accuracy >= A; `max_escalation E` the highest gate whose coverage >= 1 - E.
* **Honesty guard** (jev-eval's bootstrap with out-of-bag scoring, grouped): each of `resamples` resamples draws
  the calibration *cases* (`case_id`, `rlcd.bootstrap`) with replacement, picks a gate on the drawn rows (weighted
  by how often their case was drawn) and scores it on the rows of the cases it did not draw. The gate reported is
  the pick on all rows; its `accuracy` / `coverage` are the out-of-bag means (rows each pick never saw: slightly
  pessimistic, the safe direction); 95% ranges of the gate and of the out-of-bag accuracy are nearest-rank
  percentiles (2.5%, 97.5%); the same-rows numbers are kept beside them. Fewer than `min_rows` rows: refused
  (left out of the file); below MIN_WARN: provisional; no pick on all rows: unreachable; no usable resample:
  unstable.
* **Held out** (`test`): the chosen t applied as is to the test rows: selective accuracy and coverage, with 95%
  grouped-bootstrap percentile intervals over test cases.

Gates: one per *question* (rows whose id is `case_id:NAME`, grouped by NAME and the question's definition: type,
instructions, criteria) -- the contract's `questions`, with `definitions`; the contract's `composite` (jev-eval's
rule: min confidence over every gated choice/score question, on the cases that have all of them, correct only if
every one is); `yesAt` per noul question (flag when P(true) >= t at a precision target, jev-eval's
`--yes-precision`). rlcd adds, under `x_rlcd` (readers ignore keys they do not know): one gate per question type
(`types`, pooled over all rows of the type: what `rlcd serve` falls back to for questions the file does not
name), `rowGate` (per case, the min over its own choice/score answers), the held-out test numbers of every gate
and every gate's status (`gates`), the goal, the temperatures and the split names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from rlcd.bootstrap import chunk_size, draw_groups, group_codes, group_counts, group_key
from rlcd.errors import OptionError, RunError
from rlcd.metrics import row_probabilities
from rlcd.schema import QUESTION_TYPES

CONTRACT_VERSION = 1
MIN_REFUSE = 50      # jev-eval: below this many labeled rows a gate is refused ("gather more labels")
MIN_WARN = 200       # jev-eval: below this it is provisional
DEFAULT_RESAMPLES = 1000
DEFAULT_SEED = 0
DEFAULT_TARGET = 0.9           # what `rlcd evaluate` writes
DEFAULT_YES = (0.9, 0.7)       # yesAt targets (Leash's repairAt / noteAt example)
GATED_TYPES = ("choice", "score")  # a row gate takes the min over these (noul carries no gate confidence in it)
COMPOSITE = "_row"


class GateError(OptionError):
    """A goal or option out of range (a one-line error, exit 2)."""


@dataclass(frozen=True)
class Goal:
    """Exactly one of target_accuracy (in (0, 1]) and max_escalation (in [0, 1])."""

    target_accuracy: float | None = None
    max_escalation: float | None = None

    def __post_init__(self) -> None:
        if (self.target_accuracy is None) == (self.max_escalation is None):
            raise GateError("give exactly one of --target-accuracy or --max-escalation")
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise GateError(f"--target-accuracy must be in (0, 1], got {self.target_accuracy}")
        if self.max_escalation is not None and not 0 <= self.max_escalation <= 1:
            raise GateError(f"--max-escalation must be in [0, 1], got {self.max_escalation}")

    def to_dict(self) -> dict[str, float]:
        return ({"targetAccuracy": self.target_accuracy} if self.target_accuracy is not None
                else {"maxEscalation": self.max_escalation})


# ---------------------------------------------------------------------------------------------- per answer
def gate_confidence(qtype: str, p: np.ndarray) -> float:
    """The confidence a gate compares with its threshold (the module docstring)."""
    k = len(p)
    if qtype == "noul":
        return abs(float(p[1]) - 0.5) * 2
    if k == 1:
        return 1.0
    best = int(np.argmax(p))
    if qtype == "choice":
        return max(0.0, (float(p[best]) - 1 / k) / (1 - 1 / k))
    levels = np.arange(k, dtype=np.float64)
    distance = float(np.sum(p * np.abs(levels - best)))
    uniform = float(np.mean(np.abs(levels - (k - 1) / 2)))
    return max(0.0, 1 - distance / uniform)


def is_correct(qtype: str, p: np.ndarray, target: Sequence[float], tolerance: int = 0) -> bool:
    """jev-eval's correctness against gold = argmax target (the module docstring)."""
    gold = int(np.argmax(np.asarray(target, dtype=np.float64)))
    if qtype == "noul":
        return (float(p[1]) >= 0.5) == (gold == 1)
    if qtype == "choice":
        return int(np.argmax(p)) == gold
    score = float(np.sum(np.arange(len(p)) * p))
    level = min(max(round(score), 0), len(p) - 1)
    return abs(level - gold) <= tolerance


@dataclass(frozen=True)
class Item:
    """One prediction row as the gates see it."""

    case: str
    type: str
    question: str | None  # the question's name within its case (id `case_id:NAME`), if any
    confidence: float
    correct: bool
    p_yes: float | None   # noul: P(true)
    gold_yes: bool | None


def question_name(row: Mapping[str, Any]) -> str | None:
    """NAME of a row whose id is `case_id:NAME` (typed-decisions and synthetic rows); None otherwise."""
    case, rid = row.get("case_id"), str(row["id"])
    if case is None or not rid.startswith(f"{case}:"):
        return None
    return rid[len(str(case)) + 1:] or None


def items_of(rows: Sequence[Mapping[str, Any]], temperatures: Mapping[str, float], tolerance: int = 0) -> list[Item]:
    out = []
    for row in rows:
        p = row_probabilities(row, temperatures)
        t = row["type"]
        gold_yes = bool(int(np.argmax(row["target"])) == 1) if t == "noul" else None
        out.append(Item(group_key(row), t, question_name(row), gate_confidence(t, p), is_correct(t, p, row["target"], tolerance),
                        float(p[1]) if t == "noul" else None, gold_yes))
    return out


# ---------------------------------------------------------------------------------------------- picking
@dataclass(frozen=True)
class Rows:
    """The rows behind one gate: confidence, correct, and the case each belongs to."""

    confidence: np.ndarray
    correct: np.ndarray
    cases: list[str]

    @property
    def n(self) -> int:
        return int(self.confidence.size)

    @classmethod
    def of(cls, conf: Sequence[float], correct: Sequence[bool], cases: Sequence[str]) -> "Rows":
        return cls(np.asarray(conf, dtype=np.float64), np.asarray(correct, dtype=np.float64), list(cases))


def _blocks(rows: Rows) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(order, sorted confidence, sorted correct, last index of each tie block), confidence descending."""
    order = np.argsort(-rows.confidence, kind="stable")
    c, a = rows.confidence[order], rows.correct[order]
    ends = np.flatnonzero(np.r_[c[1:] != c[:-1], True]) if c.size else np.zeros(0, dtype=np.int64)
    return order, c, a, ends


def _pick(weights: np.ndarray, a: np.ndarray, ends: np.ndarray, goal: Goal) -> np.ndarray:
    """Per resample (rows of `weights`, in sorted order), the tie block the goal picks; -1 for none."""
    cw = np.cumsum(weights, axis=1)[:, ends]
    cc = np.cumsum(weights * a, axis=1)[:, ends]
    present = np.diff(np.c_[np.zeros((cw.shape[0], 1)), cw], axis=1) > 0
    total = cw[:, -1:]
    with np.errstate(invalid="ignore", divide="ignore"):
        coverage = cw / total
        accuracy = cc / cw
    if goal.target_accuracy is not None:
        ok = present & (accuracy >= goal.target_accuracy)
        last = ok.shape[1] - 1 - np.argmax(ok[:, ::-1], axis=1)  # most coverage
        return np.where(ok.any(axis=1), last, -1)
    ok = present & (coverage >= 1.0 - float(goal.max_escalation) - 1e-12)
    return np.where(ok.any(axis=1), np.argmax(ok, axis=1), -1)  # the highest gate within the budget


def selective(rows: Rows, threshold: float) -> tuple[float, float, int]:
    """(selective accuracy, coverage, covered rows) at `threshold` (accuracy 0 when nothing is covered)."""
    covered = rows.confidence >= threshold
    k = int(covered.sum())
    return (float(rows.correct[covered].mean()) if k else 0.0), (k / rows.n if rows.n else 0.0), k


def nearest_rank(values: Sequence[float], q: float) -> float:
    """jev-eval's percentile: the nearest-rank value at q in [0, 1]."""
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))])


def _resample_weights(rows: Rows, resamples: int, seed: int):
    """Blocks of [size, n] case-draw counts per row (grouped bootstrap, `rlcd.bootstrap`)."""
    codes, n_groups = group_codes(rows.cases, rows.n)
    rng = np.random.default_rng(seed)
    step = chunk_size(max(n_groups, rows.n))
    for lo in range(0, resamples, step):
        m = min(step, resamples - lo)
        yield group_counts(draw_groups(rng, n_groups, m), n_groups)[:, codes]


def recommend(rows: Rows, goal: Goal, *, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
              min_rows: int = MIN_REFUSE) -> dict[str, Any]:
    """The gate for `rows` under the guard: status, n, and (when usable) threshold, out-of-bag accuracy and
    coverage, their 95% ranges and the same-rows numbers (the module docstring)."""
    n = rows.n
    if n < min_rows:
        return {"status": "refused", "n": n}
    order, c, a, ends = _blocks(rows)
    whole = _pick(np.ones((1, n)), a, ends, goal)[0]
    if whole < 0:
        return {"status": "unreachable", "n": n}
    threshold = float(c[ends[whole]])
    same_acc, same_cov, _ = selective(rows, threshold)
    picks: list[float] = []
    oob_acc: list[float] = []
    oob_cov: list[float] = []
    for w in _resample_weights(rows, resamples, seed):
        w = w[:, order]
        idx = _pick(w, a, ends, goal)
        oob = (w == 0).astype(np.float64)
        co = np.cumsum(oob, axis=1)[:, ends]
        cc = np.cumsum(oob * a, axis=1)[:, ends]
        n_oob = oob.sum(axis=1)
        for r in np.flatnonzero(idx >= 0):
            picks.append(float(c[ends[idx[r]]]))
            covered = co[r, idx[r]]
            if n_oob[r] > 0 and covered > 0:
                oob_acc.append(float(cc[r, idx[r]] / covered))
                oob_cov.append(float(covered / n_oob[r]))
    if not picks or not oob_acc:
        return {"status": "unstable", "n": n, "sameRows": {"threshold": threshold, "accuracy": same_acc,
                                                           "coverage": same_cov}}
    return {"status": "warn" if n < MIN_WARN else "ok", "n": n, "threshold": threshold,
            "accuracy": float(np.mean(oob_acc)), "coverage": float(np.mean(oob_cov)),
            "threshold95": [nearest_rank(picks, 0.025), nearest_rank(picks, 0.975)],
            "accuracy95": [nearest_rank(oob_acc, 0.025), nearest_rank(oob_acc, 0.975)],
            "sameRows": {"accuracy": same_acc, "coverage": same_cov},
            "resamples": resamples, "misses": resamples - len(picks)}


def held_out(rows: Rows, threshold: float, *, resamples: int = DEFAULT_RESAMPLES,
             seed: int = DEFAULT_SEED) -> dict[str, Any] | None:
    """The gate applied as is to held-out rows: accuracy and coverage with 95% grouped-bootstrap intervals."""
    if rows.n == 0:
        return None
    acc, cov, k = selective(rows, threshold)
    covered = (rows.confidence >= threshold).astype(np.float64)
    accs: list[float] = []
    covs: list[float] = []
    for w in _resample_weights(rows, resamples, seed):
        wc = (w * covered).sum(axis=1)
        covs += list(wc / w.sum(axis=1))
        ok = wc > 0
        accs += list((w * covered * rows.correct).sum(axis=1)[ok] / wc[ok])
    return {"n": rows.n, "covered": k, "accuracy": acc if k else None, "coverage": cov,
            "accuracy95": [nearest_rank(accs, 0.025), nearest_rank(accs, 0.975)] if accs else None,
            "coverage95": [nearest_rank(covs, 0.025), nearest_rank(covs, 0.975)]}


# ---------------------------------------------------------------------------------------------- the document
def _definition_key(definition: Mapping[str, Any] | None, row: Mapping[str, Any]) -> str:
    if definition is not None:
        return json.dumps(definition, sort_keys=True, ensure_ascii=False)
    return json.dumps([row["type"], row.get("instructions"), row.get("labels")], ensure_ascii=False)


def definition_of(row: Mapping[str, Any], record_questions: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The question as asked (from the data split's records when known, else type, instructions and labels)."""
    q = record_questions.get(str(row["id"]))
    if q is not None:
        return dict(q)
    out: dict[str, Any] = {"type": row["type"]}
    if row.get("instructions") is not None:
        out["instructions"] = row["instructions"]
    if row["type"] == "choice":
        out["criteria"] = list(row.get("labels") or [])
    return out


def _question_ids(rows: Sequence[Mapping[str, Any]], defs: list[str]) -> list[str | None]:
    """A readable id per row's question: NAME, or GROUP:NAME when NAME means different questions."""
    names = [question_name(r) for r in rows]
    meanings: dict[str, set[str]] = {}
    for name, key in zip(names, defs):
        if name is not None:
            meanings.setdefault(name, set()).add(key)
    ids: list[str | None] = []
    for row, name in zip(rows, names):
        ids.append(None if name is None else name if len(meanings[name]) == 1 else f"{row['group']}:{name}")
    return ids


def _rows(items: Sequence[Item], *, yes: bool = False) -> Rows:
    if yes:
        return Rows.of([i.p_yes for i in items], [bool(i.gold_yes) for i in items], [i.case for i in items])
    return Rows.of([i.confidence for i in items], [i.correct for i in items], [i.case for i in items])


def _row_items(items: Sequence[Item], ids: Sequence[str | None], only: Sequence[str] | None) -> Rows:
    """Per case: min confidence over its gated answers, correct iff all are; with `only`, just the cases
    answering every question in `only` (jev-eval's composite), over those questions."""
    per_case: dict[str, list[Item]] = {}
    names: dict[str, set[str]] = {}
    for item, qid in zip(items, ids):
        if item.type not in GATED_TYPES or (only is not None and qid not in only):
            continue
        per_case.setdefault(item.case, []).append(item)
        names.setdefault(item.case, set()).add(str(qid))
    cases = [c for c in per_case if only is None or names[c] == set(only)]
    return Rows.of([min(i.confidence for i in per_case[c]) for c in cases],
                   [all(i.correct for i in per_case[c]) for c in cases], cases)


def _entry(rec: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    return {**extra, "threshold": round(rec["threshold"], 4), "accuracy": round(rec["accuracy"], 4),
            "coverage": round(rec["coverage"], 4), "n": rec["n"]}


def usable(rec: Mapping[str, Any]) -> bool:
    return rec.get("status") in ("ok", "warn")


def thresholds_document(calibration: Sequence[Mapping[str, Any]], test: Sequence[Mapping[str, Any]],
                        temperatures: Mapping[str, float], goal: Goal, *, model: str,
                        yes_targets: Sequence[float] = DEFAULT_YES, resamples: int = DEFAULT_RESAMPLES,
                        seed: int = DEFAULT_SEED, tolerance: int = 0, min_rows: int = MIN_REFUSE,
                        record_questions: Mapping[str, Mapping[str, Any]] | None = None,
                        now: datetime | None = None) -> dict[str, Any]:
    """`thresholds.json` (contract version 1 + `x_rlcd`) from calibration rows, verified on test rows."""
    if not calibration:
        raise RunError("no calibration predictions: the gates are chosen on the calibration split")
    for t in yes_targets:
        if not 0 < t <= 1:
            raise GateError(f"--yes-precision targets must be in (0, 1], got {t}")
    record_questions = record_questions or {}
    kw = {"resamples": resamples, "seed": seed}

    both = [*calibration, *test]  # question ids named over both splits, so a question has one id in each
    keys = [_definition_key(record_questions.get(str(r["id"])), r) for r in both]
    ids = _question_ids(both, keys)
    cal_ids, test_ids = ids[:len(calibration)], ids[len(calibration):]
    cal_defs = [definition_of(r, record_questions) for r in calibration]
    cal_items, test_items = items_of(calibration, temperatures, tolerance), items_of(test, temperatures, tolerance)
    definitions = {qid: d for qid, d in zip(cal_ids, cal_defs) if qid is not None}
    kinds = {qid: it.type for qid, it in zip(cal_ids, cal_items) if qid is not None}
    gates: list[dict[str, Any]] = []

    def gate(name: str, kind: str, qtype: str | None, cal: Rows, held: Rows, g: Goal = goal) -> dict[str, Any]:
        rec = recommend(cal, g, min_rows=min_rows, **kw)
        if usable(rec):
            rec["test"] = held_out(held, rec["threshold"], **kw)
        gates.append({"name": name, "kind": kind, "type": qtype, **rec})
        return rec

    def pick(items, ids, qid=None, qtype=None):
        return [i for i, q in zip(items, ids) if (qid is None or q == qid) and (qtype is None or i.type == qtype)]

    doc_questions: dict[str, Any] = {}
    for qid in sorted(kinds):
        rec = gate(qid, "question", kinds[qid], _rows(pick(cal_items, cal_ids, qid)), _rows(pick(test_items, test_ids, qid)))
        if usable(rec):
            doc_questions[qid] = _entry(rec, type=kinds[qid])
    composite = None
    gated = sorted(q for q, k in kinds.items() if k in GATED_TYPES)
    if len(gated) > 1:
        rec = gate(COMPOSITE, "composite", None, _row_items(cal_items, cal_ids, gated),
                   _row_items(test_items, test_ids, gated))
        if usable(rec):
            composite = {**_entry(rec), "questions": gated}
    yes_at: dict[str, list[dict[str, Any]]] = {}
    type_yes: list[dict[str, Any]] = []
    for target in sorted(yes_targets, reverse=True):
        g = Goal(target_accuracy=target)
        for qid in sorted(q for q, k in kinds.items() if k == "noul"):
            cal = _rows(pick(cal_items, cal_ids, qid), yes=True)
            rec = gate(f"{qid} yes@{target}", "yesAt", "noul", cal, _rows(pick(test_items, test_ids, qid), yes=True), g)
            if usable(rec):
                yes_at.setdefault(qid, []).append(_yes_entry(rec, target, cal))
        cal = _rows(pick(cal_items, cal_ids, qtype="noul"), yes=True)
        rec = gate(f"noul yes@{target}", "typeYesAt", "noul", cal, _rows(pick(test_items, test_ids, qtype="noul"), yes=True), g)
        if usable(rec):
            type_yes.append(_yes_entry(rec, target, cal))
    types: dict[str, Any] = {}
    for qtype in QUESTION_TYPES:
        rec = gate(qtype, "type", qtype, _rows(pick(cal_items, cal_ids, qtype=qtype)),
                   _rows(pick(test_items, test_ids, qtype=qtype)))
        if usable(rec):
            types[qtype] = _entry(rec, type=qtype)
    row_gate = gate("row", "rowGate", None, _row_items(cal_items, cal_ids, None), _row_items(test_items, test_ids, None))
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")
    doc: dict[str, Any] = {
        "version": CONTRACT_VERSION, "model": model, "generatedAt": stamp,
        "guard": {"method": "bootstrap", "resamples": resamples, "seed": seed},
        "tolerance": tolerance, "questions": doc_questions}
    if composite is not None:
        doc["composite"] = composite
    if yes_at:
        doc["yesAt"] = yes_at
    doc["definitions"] = dict(sorted(definitions.items()))
    doc["x_rlcd"] = {
        "split": "calibration", "heldOut": "test", "goal": goal.to_dict(), "yesTargets": list(yes_targets),
        "grouping": "case_id", "minRows": min_rows, "temperatures": dict(temperatures),
        "types": types, **({"typeYesAt": type_yes} if type_yes else {}),
        **({"rowGate": _entry(row_gate)} if usable(row_gate) else {}),
        "gates": [_rounded(g) for g in gates]}
    return doc


def _yes_entry(rec: Mapping[str, Any], target: float, cal: Rows) -> dict[str, Any]:
    base = float(cal.correct.mean()) if cal.n else 0.0
    recall = rec["accuracy"] * rec["coverage"] / base if base else 0.0
    return {"target": target, "threshold": round(rec["threshold"], 4), "precision": round(rec["accuracy"], 4),
            "recall": round(recall, 4), "flagged": round(rec["coverage"], 4), "n": rec["n"]}


def _rounded(obj: Any) -> Any:
    if isinstance(obj, float):
        return round(obj, 6)
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------------- a run
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise RunError(f"{path}:{n}: not a JSON line ({e.msg})") from None
    return out


def record_questions_of(data_dir: Path | None, splits: Sequence[str] = ("calibration", "test")) -> dict[str, dict]:
    """id -> the question exactly as the data split holds it (for `definitions`); {} when the data is gone."""
    out: dict[str, dict] = {}
    if data_dir is None:
        return out
    for split in splits:
        path = Path(data_dir) / f"{split}.jsonl"
        if not path.is_file():
            continue
        for row in read_jsonl(path):
            q = row.get("question")
            if isinstance(q, dict) and "id" in row:
                out[str(row["id"])] = {k: v for k, v in q.items() if v is not None}
    return out


def gate_run(run: Any, goal: Goal, *, yes_targets: Sequence[float] = DEFAULT_YES, resamples: int = DEFAULT_RESAMPLES,
             seed: int = DEFAULT_SEED, tolerance: int = 0, min_rows: int = MIN_REFUSE,
             out: Path | None = None) -> tuple[Path, dict[str, Any]]:
    """Read the run's calibration/test predictions and temperatures, write `thresholds.json` (default
    `eval/thresholds.json`) atomically; every input is checked before anything is written."""
    from rlcd.run import Run, write_json

    run = run if isinstance(run, Run) else Run.open(run)
    cal_path, test_path, temps_path = (run.predictions_path("calibration"), run.predictions_path("test"),
                                       run.temperatures_path)
    if not cal_path.is_file():
        raise RunError(f"{cal_path} is missing: run `rlcd evaluate {run.root}` first (the gates are chosen on the "
                       "calibrated calibration predictions)")
    if not temps_path.is_file():
        raise RunError(f"{temps_path} is missing: run `rlcd calibrate {run.root}` or `rlcd evaluate {run.root}` first")
    temps = json.loads(temps_path.read_text(encoding="utf-8")).get("temperatures") or {}
    missing = [t for t in QUESTION_TYPES if not isinstance(temps.get(t), (int, float)) or temps[t] <= 0]
    if missing:
        raise RunError(f"{temps_path} has no valid temperature for {', '.join(missing)}")
    try:
        data_dir = run.data_dir
    except Exception:  # noqa: BLE001 - a run without a readable config: definitions from the rows alone
        data_dir = None
    doc = thresholds_document(read_jsonl(cal_path), read_jsonl(test_path) if test_path.is_file() else [], temps, goal,
                              model=run.root.resolve().name, yes_targets=yes_targets, resamples=resamples, seed=seed,
                              tolerance=tolerance, min_rows=min_rows, record_questions=record_questions_of(data_dir))
    path = Path(out) if out is not None else run.eval_dir / "thresholds.json"
    write_json(path, doc)
    return path, doc


def default_gates(run: Any, say: Any = None) -> Path | None:
    """What `rlcd evaluate` ends with: `eval/thresholds.json` at DEFAULT_TARGET (None when the run has no
    calibration predictions to gate on)."""
    try:
        path, doc = gate_run(run, Goal(target_accuracy=DEFAULT_TARGET))
    except RunError as e:
        if say:
            say(f"gates: none written ({e})")
        return None
    if say:
        say(f"gates: {path} (target accuracy {DEFAULT_TARGET}: {len(doc['questions'])} questions, "
            f"{len(doc['x_rlcd']['types'])} types; `rlcd gate RUN` picks another goal)")
    return path


def summary_lines(doc: Mapping[str, Any]) -> list[str]:
    """One line per gate that was chosen (and one per gate that was not, saying why)."""
    lines = []
    listed = doc.get("x_rlcd", {}).get("gates", [])
    refused = [g["name"] for g in listed if g.get("status") == "refused"]
    for g in listed:
        what = f"{g['name']} ({g['kind']}{', ' + g['type'] if g.get('type') and g['kind'] != 'type' else ''}, n={g['n']})"
        if g.get("status") == "refused":
            continue
        if not usable(g):
            why = {"refused": f"refused: fewer than {doc['x_rlcd']['minRows']} rows",
                   "unreachable": "no gate reaches the goal", "unstable": "unstable under the bootstrap guard"}
            lines.append(f"{what}: {why.get(g['status'], g['status'])}")
            continue
        t = g.get("test")
        held = ("no test rows" if not t else
                f"test {_pct(t['accuracy'])} {_range(t['accuracy95'])} at coverage {_pct(t['coverage'])} "
                f"{_range(t['coverage95'])} (n={t['n']})")
        lines.append(f"{what}: gate at {g['threshold']:.4f}{' (provisional)' if g['status'] == 'warn' else ''}: "
                     f"auto {_pct(g['coverage'])} at {_pct(g['accuracy'])} out-of-bag; {held}")
    if refused:
        lines.append(f"refused (fewer than {doc['x_rlcd']['minRows']} calibration rows): {refused_names(refused)}")
    return lines


def refused_names(names: Sequence[str], shown: int = 6) -> str:
    """`a, b, c and 12 more` (the report and the summary list refused gates in one line)."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more ({len(names)} gates)" if more > 0 else "")


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _range(ci: Sequence[float] | None) -> str:
    return "[—]" if not ci else f"[{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


__all__ = ["Goal", "GateError", "gate_run", "thresholds_document", "recommend", "held_out", "gate_confidence",
           "is_correct", "summary_lines", "usable", "DEFAULT_TARGET", "DEFAULT_YES"]
