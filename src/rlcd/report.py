"""evaluation.json content, plots and report.md from a run's prediction files and training log.

Inputs (all under the run directory):

- ``eval/predictions-<split>.jsonl`` (required): prediction rows ``{id, group, type, labels, target,
  posterior|null, logits}`` (docs/ARCHITECTURE.md).
- ``eval/evaluation.json`` (optional): read for ``temperatures``, ``meta`` and ``majority_baseline``,
  the inputs that are not in the prediction files. Without it the report fits temperatures on
  ``predictions-calibration.jsonl`` (or uses T = 1 when that is missing too) and says so.
- ``metrics.jsonl`` (optional): training log; lines with ``"event": "eval"`` are dev evaluations
  (``dev_macro_accuracy``, ``dev_accuracy`` {group: acc}), other lines with a ``step`` are training
  steps (``loss``, ``ce_loss``, ``policy_loss``, ``reward_mean``, ``reward_*`` parts, ``lr_lora``,
  ``lr_head``, ``grad_norm``, ``advantage_std``, ``grad_cosine``, ``grad_norm_ratio``).

``evaluation_from_predictions`` builds the whole evaluation.json content from the prediction rows,
the temperatures, the metadata and the majority baseline, so "the prediction files regenerate
evaluation.json exactly" holds by construction: ``regenerate_evaluation(run_dir)`` rebuilds it from
the files and ``evaluation_json`` gives the canonical text (byte-identical for the same inputs).

Plots use matplotlib's Agg canvas directly (no pyplot, no global backend switch).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from rlcd import metrics as M
from rlcd.errors import RunError
from rlcd.run import Run
from rlcd.schema import QUESTION_TYPES

FORMAT = "rlcd.evaluation/1"
SPLIT_ORDER = ("dev", "calibration", "test")
HEADLINE_PREFERENCE = ("test", "dev", "calibration")
PLOTS = "plots"

# ----------------------------------------------------------------------------------------------
# evaluation.json


def _split_order(splits: Iterable[str]) -> list[str]:
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


def evaluation_from_predictions(pred_rows_by_split: Mapping[str, Sequence[Mapping[str, Any]]],
                                temperatures: Mapping[str, float] | None, meta: Mapping[str, Any] | None,
                                *, majority_baseline: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The complete evaluation.json content (plain JSON types).

    ``pred_rows_by_split``: {split: prediction rows}; ``temperatures``: {type: T} (missing types and
    None mean T = 1); ``meta``: copied verbatim (selected step, checkpoint sha256, data hashes,
    calibration fit info, ...); ``majority_baseline``: the output of ``rlcd.metrics.majority_baseline``
    (it needs the training rows, which are not in the prediction files), copied verbatim.

    Layout::

        {"format", "headline_split", "n_rows": {split: n},
         "temperatures": {choice, noul, score},
         "raw": summary, "calibrated": summary,           # the headline split (test when present)
         "other_splits": {split: {"raw": summary, "calibrated": summary}},
         "majority_baseline": {...} | null, "meta": {...}}

    where each summary is ``rlcd.metrics.summarize``'s output. Same inputs -> identical JSON text
    (row order does not matter).
    """
    splits = _split_order(pred_rows_by_split)
    head = headline_split(splits)
    temps = {t: float((temperatures or {}).get(t, 1.0)) for t in QUESTION_TYPES}
    for t in sorted(set(map(str, temperatures or {})) - set(QUESTION_TYPES)):
        temps[t] = float(temperatures[t])  # type: ignore[index]

    def both(rows):
        return {"raw": M.summarize(rows, None), "calibrated": M.summarize(rows, temps)}

    headline = both(pred_rows_by_split[head])
    ev = {
        "format": FORMAT,
        "headline_split": head,
        "n_rows": {s: len(pred_rows_by_split[s]) for s in splits},
        "temperatures": temps,
        "raw": headline["raw"],
        "calibrated": headline["calibrated"],
        "other_splits": {s: both(pred_rows_by_split[s]) for s in splits if s != head},
        "majority_baseline": dict(majority_baseline) if majority_baseline is not None else None,
        "meta": dict(meta or {}),
    }
    return M.to_jsonable(ev)


def evaluation_json(ev: Mapping[str, Any]) -> str:
    """Canonical text of an evaluation dict (what evaluation.json holds)."""
    return M.dumps(ev)


def _run(run: Run | str | Path) -> Run:
    return run if isinstance(run, Run) else Run(run)


def write_evaluation(run: Run | str | Path, ev: Mapping[str, Any]) -> Path:
    """Write ``RUN/eval/evaluation.json`` in canonical form."""
    path = _run(run).evaluation_path
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
    out = {split: read_jsonl(p) for split, p in _run(run).prediction_paths().items()}
    return {s: out[s] for s in _split_order(out)}


def regenerate_evaluation(run: Run | str | Path) -> dict[str, Any]:
    """Rebuild evaluation.json content from the prediction files + the stored non-derived inputs."""
    run = _run(run)
    stored = json.loads(run.evaluation_path.read_text(encoding="utf-8"))
    return evaluation_from_predictions(load_predictions(run), stored.get("temperatures"),
                                       stored.get("meta"), majority_baseline=stored.get("majority_baseline"))


# ----------------------------------------------------------------------------------------------
# training log


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


def _series(lines: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for obj in lines:
        v = obj.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(float(obj["step"]))
            ys.append(float(v))
    return xs, ys


# ----------------------------------------------------------------------------------------------
# plots


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def _reliability_points(table: list[dict], ref: str) -> tuple[list[float], list[float], list[int]]:
    xs, ys, ns = [], [], []
    for b in table:
        if b["count"]:
            xs.append(b["confidence"])
            ys.append(b[ref])
            ns.append(b["count"])
    return xs, ys, ns


def plot_reliability(raw_block: Mapping, cal_block: Mapping, title: str, path: Path) -> Path:
    """Two panels (hard-label and target-referenced), raw vs calibrated, bins sized by count."""
    fig = Figure(figsize=(10, 4.5))
    for ax, ref, name in zip(fig.subplots(1, 2), ("accuracy", "target_accuracy"),
                             ("hard-label accuracy", "target-referenced accuracy t[argmax p]")):
        ax.plot([0, 1], [0, 1], color="0.6", ls="--", lw=1, label="perfect")
        for block, label, color in ((raw_block, "raw", "tab:red"), (cal_block, "calibrated", "tab:blue")):
            xs, ys, ns = _reliability_points(block["reliability"], ref)
            ece = block["ece"] if ref == "accuracy" else block["ece_target"]
            tot = max(sum(ns), 1)
            ax.plot(xs, ys, color=color, lw=1.2, label=f"{label} (ECE {ece:.3f})")
            ax.scatter(xs, ys, s=[20 + 300 * n / tot for n in ns], color=color, alpha=0.6)
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence (max p)", ylabel=name)
        ax.set_title(f"{title}: {name.split(' t[')[0]}", fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def plot_coverage_risk(curves: Mapping[str, tuple[np.ndarray, np.ndarray]], title: str, path: Path) -> Path:
    fig = Figure(figsize=(6, 4.5))
    ax = fig.subplots()
    for (label, (cov, risk)), color in zip(curves.items(), ("tab:red", "tab:blue", "tab:green")):
        ax.step(cov, risk, where="post", color=color, label=f"{label} (AURC {M.aurc(cov, risk):.3f})")
    ax.set(xlim=(0, 1), ylim=(0, None), xlabel="coverage (fraction kept, thresholding max p)",
           ylabel="error rate of kept decisions", title=title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_group_accuracy(per_group: Mapping[str, Mapping], majority: Mapping[str, float] | None,
                        title: str, path: Path) -> Path:
    groups = list(per_group)
    y = np.arange(len(groups))
    fig = Figure(figsize=(8, max(2.5, 0.45 * len(groups) + 1.5)))
    ax = fig.subplots()
    h = 0.4 if majority else 0.7
    ax.barh(y - (h / 2 if majority else 0), [per_group[g]["accuracy"] for g in groups], height=h,
            color="tab:blue", label="model top-1 accuracy")
    if majority:
        ax.barh(y + h / 2, [majority.get(g) or 0.0 for g in groups], height=h, color="0.6",
                label="majority baseline")
    ax.set_yticks(y, groups, fontsize=8)
    ax.invert_yaxis()
    ax.set(xlim=(0, 1), xlabel="accuracy", title=title)
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def _panel(ax, lines: list[dict], keys: Sequence[str], title: str) -> bool:
    drawn = False
    for key in keys:
        xs, ys = _series(lines, key)
        if xs:
            ax.plot(xs, ys, lw=1, marker="." if len(xs) < 30 else None, label=key)
            drawn = True
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    if drawn:
        if len(keys) > 1:
            ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="0.5")
    return drawn


def plot_training(train: list[dict], evals: list[dict], path: Path) -> Path:
    fig = Figure(figsize=(13, 7))
    axes = fig.subplots(2, 3).ravel()
    ce_keys = ["ce_loss"] if _series(train, "ce_loss")[0] else ["loss"]
    _panel(axes[0], train, ce_keys + (["loss"] if ce_keys == ["ce_loss"] and _series(train, "loss")[0] else []),
           "cross-entropy / loss")
    _panel(axes[1], train, ["reward_mean"], "reward (mean)")
    _panel(axes[2], train, ["policy_loss"], "policy loss")
    _panel(axes[3], evals, ["dev_macro_accuracy"], "dev macro accuracy")
    _panel(axes[4], train, ["lr_lora", "lr_head"], "learning rate")
    _panel(axes[5], train, ["grad_norm"], "gradient norm")
    return _save(fig, path)


REWARD_PARTS = ("log_score_mean", "spherical_mean", "rps_mean")  # rlcd.objectives stats


def reward_part_keys(train: list[dict]) -> list[str]:
    return [k for k in REWARD_PARTS if _series(train, k)[0]]


def has_diagnostics(train: list[dict]) -> bool:
    return bool(reward_part_keys(train)) or any(
        _series(train, k)[0] for k in ("advantage_std", "grad_cosine", "grad_norm_ratio"))


def plot_diagnostics(train: list[dict], path: Path) -> Path:
    fig = Figure(figsize=(13, 3.8))
    axes = fig.subplots(1, 4)
    _panel(axes[0], train, reward_part_keys(train) or ["reward_mean"], "reward parts")
    _panel(axes[1], train, ["advantage_std"], "advantage std")
    _panel(axes[2], train, ["grad_cosine"], "cos(RL grad, CE grad)")
    _panel(axes[3], train, ["grad_norm_ratio"], "|RL grad| / |CE grad|")
    return _save(fig, path)


# ----------------------------------------------------------------------------------------------
# markdown


def _f(x: Any, nd: int = 4) -> str:
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return "—" if not math.isfinite(x) else f"{x:.{nd}f}"
    return str(x)


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_f(c) if not isinstance(c, str) else c for c in r) + " |" for r in rows]
    return out + [""]


HEAD_METRICS = ("accuracy", "soft_accuracy", "nll", "brier", "ece", "ece_target", "sharpness_gap",
                "mean_confidence", "aurc")


def _raw_cal_table(raw: Mapping, cal: Mapping, keys: Sequence[str] = HEAD_METRICS) -> list[str]:
    return _table(["metric", "raw", "calibrated"], [(k, raw.get(k), cal.get(k)) for k in keys if k in raw])


def format_summary(ev: Mapping[str, Any]) -> str:
    """Short plain-text table for a terminal: raw vs calibrated per type, baseline, Bayes gap."""
    raw, cal = ev["raw"], ev["calibrated"]
    lines = [f"split {ev['headline_split']} (n={raw['n']})",
             f"{'type':<9}{'n':>6} {'acc':>7} {'nll raw':>8} {'nll cal':>8} {'ece raw':>8} {'ece cal':>8}"
             f" {'T':>6}"]
    blocks = [("overall", raw["overall"], cal["overall"])]
    blocks += [(t, raw["per_type"][t], cal["per_type"][t]) for t in raw["per_type"]]
    for name, r, c in blocks:
        temp = ev["temperatures"].get(name) if name != "overall" else None
        lines.append(f"{name:<9}{r['n']:>6} {_f(r['accuracy']):>7} {_f(r['nll']):>8} {_f(c['nll']):>8}"
                     f" {_f(r['ece']):>8} {_f(c['ece']):>8} {_f(temp, 3):>6}")
    mb = ev.get("majority_baseline")
    lines.append(f"majority baseline accuracy: {_f(mb.get('accuracy')) if mb else 'not computed'}"
                 f"   model accuracy: {_f(raw['overall']['accuracy'])}")
    post_r, post_c = raw["overall"].get("posterior"), cal["overall"].get("posterior")
    if post_r:
        lines.append(f"gap to Bayes floor (NLL): raw {_f(post_r['bayes_gap'])}  calibrated {_f(post_c['bayes_gap'])}"
                     f"  (floor {_f(post_r['bayes_nll'])}, n={post_r['n']})")
    else:
        lines.append("gap to Bayes floor: no rows carry a posterior")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# the report


def _stored_inputs(run: Run, preds: Mapping[str, list]) -> tuple[dict, dict, Any, list[str], dict | None]:
    """(temperatures, meta, majority baseline, notes, stored evaluation) for the report."""
    notes: list[str] = []
    path = run.evaluation_path
    if path.exists():
        stored = json.loads(path.read_text(encoding="utf-8"))
        return (stored.get("temperatures") or {}, stored.get("meta") or {}, stored.get("majority_baseline"),
                notes, stored)
    notes.append("`eval/evaluation.json` is missing: no metadata and no majority baseline;")
    if preds.get("calibration"):
        from rlcd.calibrate import fit_per_type

        temps, infos = fit_per_type(preds["calibration"])
        notes.append("temperatures were fitted here on `predictions-calibration.jsonl`.")
        return temps, {"calibration": infos}, None, notes, None
    notes.append("no calibration predictions either, so calibrated = raw (T = 1).")
    return {t: 1.0 for t in QUESTION_TYPES}, {}, None, notes, None


def write_report(run: Run | str | Path) -> Path:
    """Write ``eval/plots/*.png`` and ``eval/report.md`` for a run; returns the report path.

    Needs at least one ``eval/predictions-<split>.jsonl``; every other input is optional and its
    section says what is missing.
    """
    run = _run(run)
    run_dir, eval_dir = run.root, run.eval_dir
    preds = load_predictions(run)
    if not preds:
        raise RunError(f"{eval_dir}: no predictions-<split>.jsonl files; run `rlcd evaluate {run_dir}` first")
    temps, meta, majority, notes, stored = _stored_inputs(run, preds)
    ev = evaluation_from_predictions(preds, temps, meta, majority_baseline=majority)
    head = ev["headline_split"]
    raw, cal = ev["raw"], ev["calibrated"]
    plots = run.plots_dir
    plots.mkdir(parents=True, exist_ok=True)
    for old in plots.glob("*.png"):
        old.unlink()

    md: list[str] = [f"# rlcd evaluation report: {meta.get('run') or run_dir.name}", ""]
    md += ["Regenerate with `rlcd report " + str(meta.get("run") or run_dir.name) + "`; every number and plot "
           "below comes from `eval/predictions-*.jsonl`, the temperatures and `metrics.jsonl`.", ""]
    md += ["## Inputs", ""]
    md += _table(["split", "rows", "headline"], [(s, len(r), "yes" if s == head else "") for s, r in preds.items()])
    md += [f"- {n}" for n in notes]
    if stored is not None:
        same = evaluation_json(stored) == evaluation_json(ev)
        md.append("- `eval/evaluation.json` " + ("matches the prediction files exactly." if same else
                  "**differs** from what the prediction files give now (stale or edited); the tables below "
                  "are recomputed from the prediction files."))
    scalars = [(k, v) for k, v in sorted(meta.items()) if not isinstance(v, (dict, list))]
    if scalars:
        md += ["", "Metadata:", ""] + _table(["key", "value"], [(k, str(v)) for k, v in scalars])
    hashes = meta.get("data_hashes")
    if isinstance(hashes, dict) and hashes:
        md += ["Data hashes:", ""] + _table(["file", "sha256"], [(k, f"`{v}`") for k, v in sorted(hashes.items())])
    md.append("")

    md += [f"## Headline: {head} split (n = {raw['n']})", ""]
    md += _raw_cal_table(raw["overall"], cal["overall"])
    md += [f"Group macro accuracy: {_f(raw['group_macro'].get('accuracy'))} over "
           f"{raw['group_macro'].get('n_groups')} groups. `ece` is hard-label ECE (15 bins on max p); "
           "`ece_target` compares confidence with the target mass on the chosen candidate; "
           "`sharpness_gap` = mean(max p) − mean(max target).", ""]

    md += ["## Temperatures", ""]
    cal_info = meta.get("calibration") if isinstance(meta.get("calibration"), dict) else {}
    trows = []
    for t in ev["temperatures"]:
        info = cal_info.get(t, {}) if cal_info else {}
        trows.append((t, ev["temperatures"][t], info.get("n"), info.get("loss_before"), info.get("loss_after"),
                      info.get("iterations"), info.get("converged"), info.get("reason") or info.get("at_bound") or ""))
    md += _table(["type", "T", "calibration rows", "loss at T=1", "loss at T", "LBFGS iterations", "converged",
                  "note"], trows)
    if not cal_info:
        md += ["Fit details (`meta.calibration`) were not recorded.", ""]

    md += ["## Per type", ""]
    md += _table(["type", "n", "accuracy", "soft acc", "NLL raw", "NLL cal", "Brier raw", "Brier cal", "ECE raw",
                  "ECE cal", "ECE-target raw", "ECE-target cal", "sharpness raw", "sharpness cal"],
                 [(t, r["n"], r["accuracy"], r["soft_accuracy"], r["nll"], cal["per_type"][t]["nll"], r["brier"],
                   cal["per_type"][t]["brier"], r["ece"], cal["per_type"][t]["ece"], r["ece_target"],
                   cal["per_type"][t]["ece_target"], r["sharpness_gap"], cal["per_type"][t]["sharpness_gap"])
                  for t, r in raw["per_type"].items()])

    md += ["## Ordinal (score) metrics", ""]
    if "rps" in raw["overall"]:
        md += _raw_cal_table(raw["overall"], cal["overall"], ("n_score", "rps", "level_mae", "within_one"))
    else:
        md += ["No score rows in this split.", ""]

    md += ["## Majority baseline", ""]
    if majority:
        md += [f"Always answering, per (sampling group, question instructions), the candidate most often the "
               f"argmax of the training targets: accuracy **{_f(majority.get('accuracy'))}** (soft "
               f"{_f(majority.get('soft_accuracy'))}, group macro {_f(majority.get('group_macro_accuracy'))}, "
               f"n = {majority.get('n')}) vs the model's {_f(raw['overall']['accuracy'])}. Test rows whose "
               f"(group, instructions) pair was not seen in training (or whose majority label is not one of its "
               f"candidates): {majority.get('n_fallback_group', 0)} "
               f"answered with the group majority, {majority.get('n_fallback_first', 0)} with the first "
               "candidate.", ""]
    else:
        md += ["Not available: the majority baseline needs the training rows and is stored in "
               "`eval/evaluation.json` by `rlcd evaluate`.", ""]

    md += ["## Known posterior: gap to the Bayes floor", ""]
    pr, pc = raw["overall"].get("posterior"), cal["overall"].get("posterior")
    if pr:
        md += [f"{pr['n']} rows carry a known posterior. On those rows `model_nll` is the model's NLL against "
               "the target, `bayes_nll` the posterior's own NLL against the target (the floor no model can beat "
               "in expectation) and `bayes_gap` = model_nll − bayes_nll; `bayes_accuracy` is the posterior's "
               "top-1 accuracy against the target.", ""]
        md += _raw_cal_table(pr, pc, ("model_nll", "bayes_nll", "bayes_gap", "bayes_accuracy"))
        md += ["The same scores with the posterior in place of the target (how close the model is to the truth):", ""]
        md += _raw_cal_table(pr, pc, ("accuracy", "soft_accuracy", "nll", "brier", "ece", "ece_target",
                                      "sharpness_gap"))
    else:
        md += ["No rows carry a posterior, so there is no Bayes floor to compare with.", ""]

    md += ["## Per candidate-count bucket", ""]
    md += _table(["K", "n", "accuracy", "NLL raw", "NLL cal", "ECE raw", "ECE cal"],
                 [(k, b["n"], b["accuracy"], b["nll"], cal["per_k_bucket"][k]["nll"], b["ece"],
                   cal["per_k_bucket"][k]["ece"]) for k, b in raw["per_k_bucket"].items()])

    md += ["## Per group", ""]
    mb_groups = (majority or {}).get("per_group") or {}
    md += _table(["group", "n", "accuracy", "majority", "NLL raw", "NLL cal", "ECE raw", "ECE cal"],
                 [(g, b["n"], b["accuracy"], mb_groups.get(g), b["nll"], cal["per_group"][g]["nll"], b["ece"],
                   cal["per_group"][g]["ece"]) for g, b in raw["per_group"].items()])
    md += ["Group macro (unweighted mean over groups):", ""]
    md += _raw_cal_table(raw["group_macro"], cal["group_macro"], ("accuracy", "nll", "brier", "ece", "ece_target"))

    if ev["other_splits"]:
        md += ["## Other splits", ""]
        md += _table(["split", "n", "accuracy", "NLL raw", "NLL cal", "ECE raw", "ECE cal", "ECE-target raw",
                      "ECE-target cal"],
                     [(s, b["raw"]["n"], *(b[kind]["overall"].get(key) for kind, key in (
                         ("raw", "accuracy"), ("raw", "nll"), ("calibrated", "nll"), ("raw", "ece"),
                         ("calibrated", "ece"), ("raw", "ece_target"), ("calibrated", "ece_target"))))
                      for s, b in ev["other_splits"].items()])
        if "calibration" in ev["other_splits"]:
            md += ["(The calibration split is the one the temperatures were fitted on: its calibrated numbers are "
                   "in-sample.)", ""]

    md += ["## Plots", "", f"### Reliability ({head}, raw vs calibrated)", ""]
    plot_reliability(raw["overall"], cal["overall"], "all types", plots / "reliability_overall.png")
    md += ["![reliability, all types](plots/reliability_overall.png)", ""]
    for t in raw["per_type"]:
        plot_reliability(raw["per_type"][t], cal["per_type"][t], t, plots / f"reliability_{t}.png")
        md += [f"![reliability, {t}](plots/reliability_{t}.png)", ""]
    curves = {"raw": M.coverage_risk(preds[head], None), "calibrated": M.coverage_risk(preds[head], ev["temperatures"])}
    plot_coverage_risk(curves, f"coverage-risk ({head})", plots / "coverage_risk.png")
    md += ["### Coverage-risk", "", "![coverage-risk](plots/coverage_risk.png)", ""]
    plot_group_accuracy(raw["per_group"], mb_groups or None, f"per-group accuracy ({head})",
                        plots / "group_accuracy.png")
    md += ["### Per-group accuracy", "", "![per-group accuracy](plots/group_accuracy.png)", ""]

    md += ["## Training", ""]
    log = run.metrics_path
    if log.exists():
        train, evals, bad = read_training_log(log)
        md += [f"`metrics.jsonl`: {len(train)} training lines, {len(evals)} dev evaluations"
               + (f", {bad} unreadable line(s) skipped" if bad else "") + ".", ""]
        if train or evals:
            plot_training(train, evals, plots / "training_curves.png")
            md += ["![training curves](plots/training_curves.png)", ""]
        if evals:
            best = max(evals, key=lambda e: (e.get("dev_macro_accuracy") or -1.0, -e["step"]))
            md += [f"Best dev macro accuracy {_f(best.get('dev_macro_accuracy'))} at step {best['step']}"
                   + (f"; selected step {meta['selected_step']}" if "selected_step" in meta else "") + ".", ""]
        md += ["### RLCD diagnostics", ""]
        if has_diagnostics(train):
            plot_diagnostics(train, plots / "rlcd_diagnostics.png")
            md += ["![RLCD diagnostics](plots/rlcd_diagnostics.png)", ""]
        else:
            md += ["No reward parts, advantage std or gradient diagnostics were logged (e.g. a CE-only run).", ""]
    else:
        md += ["`metrics.jsonl` is missing: no training curves.", ""]

    path = run.report_md
    path.write_text("\n".join(md).rstrip() + "\n", encoding="utf-8")
    return path
