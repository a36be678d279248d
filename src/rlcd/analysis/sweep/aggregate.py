"""A sweep's results: each arm aggregated over its seeds, as summary.json, summary.md and two plots.

Read from every run's ``eval/evaluation.json`` (headline split: test when present): for ``raw``
and ``calibrated`` probabilities, overall / per type / group-macro accuracy, NLL, Brier, ECE,
target-referenced ECE and sharpness gap; when rows carry a known posterior, the same against the
posterior plus the Bayes gap; the fitted temperature per type. Each metric becomes
``{"mean", "std", "n", "values"}`` with the sample standard deviation
``std = sqrt(sum((v - mean)^2) / (n - 1))`` (``None`` with one seed). Plots:
``fitted_T_vs_sigma.png`` and ``nll_vs_sigma.png``; arms without a sigma (``ce``) are drawn as
horizontal reference lines.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

from rlcd.analysis.sweep.grid import Arm, RunSpec, fmt_value
from rlcd.analysis.sweep.scheduler import RunResult

FORMAT = "rlcd.sweep/1"
TYPES = ("choice", "noul", "score")
VIEWS = ("raw", "calibrated")
BLOCK_METRICS = ("accuracy", "nll", "brier", "ece", "ece_target", "sharpness_gap")
POSTERIOR_METRICS = ("accuracy", "nll", "brier", "ece_target", "sharpness_gap", "bayes_gap", "model_nll",
                     "bayes_nll")


# --- numbers -----------------------------------------------------------------------------------


def metric_values(ev: Mapping[str, Any]) -> dict[str, float]:
    """Flat ``{"raw.overall.nll": v, ..., "temperature.choice": T}`` from one evaluation dict."""
    out: dict[str, float] = {}

    def put(key: str, v: Any) -> None:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
            out[key] = float(v)

    for view in VIEWS:
        summ = ev.get(view) or {}
        blocks = {"overall": summ.get("overall"), "group_macro": summ.get("group_macro")}
        for t, b in (summ.get("per_type") or {}).items():
            blocks[f"per_type.{t}"] = b
        for bname, block in blocks.items():
            if not isinstance(block, Mapping):
                continue
            for m in BLOCK_METRICS:
                put(f"{view}.{bname}.{m}", block.get(m))
            post = block.get("posterior")
            if isinstance(post, Mapping):
                for m in POSTERIOR_METRICS:
                    put(f"{view}.{bname}.posterior.{m}", post.get(m))
    for t, v in (ev.get("temperatures") or {}).items():
        put(f"temperature.{t}", v)
    return out


def mean_std(values: Sequence[float]) -> dict[str, Any]:
    """``{"mean", "std" (sample, ddof 1; None for one value), "n", "values"}``."""
    vals = [float(v) for v in values]
    if not vals:
        return {"mean": None, "std": None, "n": 0, "values": []}
    std = statistics.stdev(vals) if len(vals) > 1 else None
    return {"mean": statistics.fmean(vals), "std": std, "n": len(vals), "values": vals}


def _fit_notes(ev: Mapping[str, Any]) -> dict[str, str]:
    """{type: reason} of the temperature fits that fell back (e.g. too few calibration rows)."""
    cal = (ev.get("meta") or {}).get("calibration") or {}
    return {t: info["reason"] for t, info in cal.items() if isinstance(info, Mapping) and info.get("reason")}


def _run_entry(spec: RunSpec, res: RunResult | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(summary entry of one run, its evaluation dict when it is usable)."""
    entry: dict[str, Any] = {"name": spec.name, "seed": spec.seed, "run_dir": str(spec.run_dir),
                             "status": res.status if res else None}
    ev = None
    if (res is None or res.status in ("done", "skipped")) and spec.evaluation_path.is_file():
        ev = json.loads(spec.evaluation_path.read_text())
        entry["status"] = res.status if res is not None else "found"
        entry["headline_split"] = ev.get("headline_split")
        entry["selected_step"] = (ev.get("meta") or {}).get("selected_step")
    else:
        entry["status"] = "failed"
        entry["error"] = (res.error if res else None) or "no eval/evaluation.json"
    if res is not None:
        entry["seconds"] = res.seconds
        if res.log:
            entry["log"] = res.log
    return entry, ev


def _arm_summary(arm: Arm, specs: Sequence[RunSpec], by_result: Mapping[str, RunResult]) -> dict[str, Any]:
    per_metric: dict[str, list[float]] = {}
    runs, splits, fit = [], set(), {}
    for spec in specs:
        entry, ev = _run_entry(spec, by_result.get(spec.name))
        runs.append(entry)
        if ev is None:
            continue
        splits.add(ev.get("headline_split"))
        for k, v in metric_values(ev).items():
            per_metric.setdefault(k, []).append(v)
        if _fit_notes(ev):
            fit[spec.name] = _fit_notes(ev)
    recipe = specs[0].config["recipe"] if specs else {}
    sigma = arm.params.get("sigma", recipe.get("sigma")) if arm.objective == "rlcd" else None
    return {
        "name": arm.name,
        "params": dict(arm.params),
        "objective": arm.objective,
        "sigma": sigma,
        "grid_points": [dict(p) for p in arm.merged],
        "recipe": {k: v for k, v in recipe.items() if k != "seed"},
        "seeds": [s.seed for s in specs],
        "n_ok": sum(1 for r in runs if r["status"] != "failed"),
        "headline_split": sorted(x for x in splits if x) or None,
        "runs": runs,
        "temperature_fit_notes": fit,
        "selected_step_0": [r["name"] for r in runs if r.get("selected_step") == 0],  # no dev eval beat the start
        "metrics": {k: mean_std(v) for k, v in sorted(per_metric.items())},
    }


def summarize_runs(arms: Sequence[Arm], specs: Sequence[RunSpec], *, results: Sequence[RunResult] = (),
                   notes: Sequence[str] = (), config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The summary.json content: per arm, mean/std over its seeds of every metric (see module doc)."""
    by_result = {r.name: r for r in results}
    out_arms = [_arm_summary(arm, [s for s in specs if s.arm == arm.name], by_result) for arm in arms]
    failed = [r["name"] for a in out_arms for r in a["runs"] if r["status"] == "failed"]
    return {"format": FORMAT, "config": dict(config or {}), "notes": list(notes), "arms": out_arms,
            "failed": failed}


# --- summary.md ---------------------------------------------------------------------------------

METRIC_COLUMNS = (("accuracy", "accuracy"), ("NLL", "nll"), ("Brier", "brier"), ("ECE-t", "ece_target"),
                  ("ECE", "ece"), ("sharpness gap", "sharpness_gap"))
POSTERIOR_COLUMNS = (("NLL vs posterior", "posterior.nll"), ("Brier vs posterior", "posterior.brier"),
                     ("ECE-t vs posterior", "posterior.ece_target"),
                     ("sharpness gap vs posterior", "posterior.sharpness_gap"), ("Bayes gap", "posterior.bayes_gap"))


def _pm(stat: Mapping[str, Any] | None, digits: int = 3) -> str:
    """``mean ± std`` (no ± with one seed; – without a value)."""
    if not stat or stat.get("mean") is None:
        return "–"
    s = f"{stat['mean']:.{digits}f}"
    if stat.get("std") is not None:
        s += f" ± {stat['std']:.{digits}f}"
    return s


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _header(summary: Mapping[str, Any]) -> list[str]:
    cfg = summary.get("config", {})
    md = ["# Sweep summary", ""]
    if cfg:
        md += [f"Data `{cfg.get('data')}`, model `{cfg.get('model')}`, {cfg.get('steps')} updates, seeds "
               f"{cfg.get('seeds')}; grid `{json.dumps(cfg.get('grid'))}`; recipe overrides "
               f"`{json.dumps(cfg.get('recipe_overrides'))}`"
               + (f"; cadence scaled to the budget: `{json.dumps(cfg.get('cadence'))}`" if cfg.get("cadence") else "")
               + ".", ""]
    md += ["Every cell is the mean ± sample standard deviation over seeds (no ± with one seed) of the run's "
           "headline split (test when present). Lower is better for NLL, Brier and ECE; sharpness gap = "
           "mean max p − mean max target (> 0: sharper than the targets). ECE-t is the target-referenced ECE.", ""]
    if summary.get("notes"):
        md += ["Notes:", ""] + [f"- {n}" for n in summary["notes"]] + [""]
    return md


def _metric_table(arms: Sequence[Mapping[str, Any]], title: str, prefix: str, cols: Sequence[tuple[str, str]],
                  with_temperatures: bool = False) -> list[str]:
    """One row per arm that has any of the metrics ``prefix.<key>``; nothing when no arm has one."""
    head = ["arm", "n"] + [c for c, _ in cols] + ([f"T {t}" for t in TYPES] if with_temperatures else [])
    lines = [f"## {title}", "", _row(head), "|" + "---|" * len(head)]
    rows = 0
    for a in arms:
        m = a["metrics"]
        cells = [_pm(m.get(f"{prefix}.{key}")) for _, key in cols]
        if all(c == "–" for c in cells):
            continue
        if with_temperatures:
            cells += [_pm(m.get(f"temperature.{t}"), 2) for t in TYPES]
        lines.append(_row([f"`{a['name']}`", str(a["n_ok"])] + cells))
        rows += 1
    return lines + [""] if rows else []


def _posterior_tables(arms: Sequence[Mapping[str, Any]]) -> list[str]:
    raw = _metric_table(arms, "Against the known posterior (raw)", "raw.overall", POSTERIOR_COLUMNS)
    cal = _metric_table(arms, "Against the known posterior (calibrated)", "calibrated.overall", POSTERIOR_COLUMNS)
    if not raw and not cal:
        return ["## Against the known posterior", "", "No rows carry a posterior.", ""]
    return ["Bayes gap = model NLL − the posterior's own NLL against the target (0 is the floor).", ""] + raw + cal


def _per_type_table(arms: Sequence[Mapping[str, Any]]) -> list[str]:
    head = ["arm"] + [f"{t} raw" for t in TYPES] + [f"{t} cal" for t in TYPES]
    md = ["## Per type (raw NLL / calibrated NLL)", "", _row(head), "|" + "---|" * len(head)]
    for a in arms:
        m = a["metrics"]
        md.append(_row([f"`{a['name']}`"] + [_pm(m.get(f"raw.per_type.{t}.nll")) for t in TYPES]
                       + [_pm(m.get(f"calibrated.per_type.{t}.nll")) for t in TYPES]))
    return md + [""]


def _runs_section(summary: Mapping[str, Any]) -> list[str]:
    arms = summary["arms"]
    md = []
    fit = {a["name"]: a["temperature_fit_notes"] for a in arms if a["temperature_fit_notes"]}
    if fit:
        md += ["## Temperature fits that fell back", ""]
        for runs in fit.values():
            md += [f"- `{run}`: " + "; ".join(f"{t}: {r}" for t, r in by_type.items()) for run, by_type in runs.items()]
        md += [""]
    untrained = [(a["name"], run) for a in arms for run in a.get("selected_step_0") or []]
    if untrained:
        md += ["## Runs that selected the untrained step 0", "",
               "No dev evaluation beat the starting model: these runs' numbers are the untrained model's.", ""]
        md += [f"- `{arm}`: `{run}`" for arm, run in untrained] + [""]
    md += ["## Runs", "", "| arm | run | status | seconds |", "|---|---|---|---|"]
    for a in arms:
        for r in a["runs"]:
            sec = f"{r['seconds']:.1f}" if r.get("seconds") else "–"
            md.append(f"| `{a['name']}` | `{r['name']}` | {r['status']} | {sec} |")
    md.append("")
    if summary.get("failed"):
        md += ["## Failed runs", ""]
        for r in (r for a in arms for r in a["runs"] if r["status"] == "failed"):
            err = (r.get("error") or "").strip().splitlines()
            md.append(f"- `{r['name']}`: {err[0] if err else 'unknown error'}"
                      + (f" (log `{r['log']}`)" if r.get("log") else ""))
        md.append("")
    return md


def summary_markdown(summary: Mapping[str, Any]) -> str:
    arms = summary["arms"]
    md = _header(summary)
    md += _metric_table(arms, "Raw probabilities (overall)", "raw.overall", METRIC_COLUMNS, with_temperatures=True)
    md += _metric_table(arms, "Calibrated probabilities (overall, per-type temperatures)", "calibrated.overall",
                        METRIC_COLUMNS)
    md += _posterior_tables(arms)
    md += _per_type_table(arms)
    md += _runs_section(summary)
    md += ["## Plots", "", "![fitted temperature vs sigma](fitted_T_vs_sigma.png)", "",
           "![NLL vs sigma](nll_vs_sigma.png)", ""]
    return "\n".join(md)


# --- plots --------------------------------------------------------------------------------------


def _series_key(arm: Mapping[str, Any]) -> str:
    rest = {k: v for k, v in arm["params"].items() if k not in ("sigma", "objective")}
    label = arm["objective"]
    if rest:
        label += " " + ",".join(f"{k}={fmt_value(v)}" for k, v in rest.items())
    return label


def plot_vs_sigma(summary: Mapping[str, Any], metrics: Sequence[tuple[str, str]], ylabel: str, title: str,
                  path: Path) -> Path:
    """One line (with ±std error bars) per (metric, arm family) over sigma; arms without sigma as
    horizontal dashed reference lines (with a ±std band)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    arms = summary["arms"]
    curves = [a for a in arms if a.get("sigma") is not None]
    refs = [a for a in arms if a.get("sigma") is None]
    styles = ("-", "-.", ":", (0, (5, 1)))  # one per sigma family; a metric keeps one colour throughout
    families: dict[str, list] = {}
    for a in curves:
        families.setdefault(_series_key(a), []).append(a)
    sigmas = sorted({float(a["sigma"]) for a in curves})
    drawn = False
    for mi, (metric, mlabel) in enumerate(metrics):
        colour = f"C{mi}"
        for fi, (fam, members) in enumerate(families.items()):
            pts = []
            for a in sorted(members, key=lambda x: float(x["sigma"])):
                st = a["metrics"].get(metric)
                if st and st.get("mean") is not None:
                    pts.append((float(a["sigma"]), st["mean"], st.get("std") or 0.0))
            if not pts:
                continue
            xs, ys, es = zip(*pts)
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, color=colour, linestyle=styles[fi % len(styles)],
                        label=f"{mlabel} ({fam})")
            drawn = True
        for a in refs:
            st = a["metrics"].get(metric)
            if not st or st.get("mean") is None:
                continue
            ax.axhline(st["mean"], linestyle="--", color=colour, alpha=0.8,
                       label=f"{mlabel} ({_series_key(a)}, no sigma)")
            if st.get("std"):
                ax.axhspan(st["mean"] - st["std"], st["mean"] + st["std"], color=colour, alpha=0.12)
            drawn = True
    if sigmas and min(sigmas) > 0 and max(sigmas) / min(sigmas) >= 8:
        ax.set_xscale("log")
    if sigmas:
        ax.minorticks_off()
        ax.set_xticks(sigmas)
        ax.set_xticklabels([f"{s:g}" for s in sigmas])
    ax.set_xlabel("sigma (logit noise std)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if drawn:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def write_summary(out: Path, summary: Mapping[str, Any]) -> dict[str, Path]:
    """summary.json, summary.md, fitted_T_vs_sigma.png and nll_vs_sigma.png under `out`."""
    from rlcd.metrics import dumps

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "summary.json", "md": out / "summary.md", "fitted_T": out / "fitted_T_vs_sigma.png",
             "nll": out / "nll_vs_sigma.png"}
    paths["json"].write_text(dumps(summary), encoding="utf-8")
    paths["md"].write_text(summary_markdown(summary), encoding="utf-8")
    plot_vs_sigma(summary, [(f"temperature.{t}", f"T {t}") for t in TYPES], "fitted temperature",
                  "fitted temperature per type vs sigma", paths["fitted_T"])
    plot_vs_sigma(summary, [("raw.overall.nll", "NLL raw"), ("calibrated.overall.nll", "NLL calibrated")],
                  "test NLL", "NLL vs sigma", paths["nll"])
    return paths
