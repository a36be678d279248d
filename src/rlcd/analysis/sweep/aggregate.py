"""A sweep's results: each arm aggregated over its seeds, as summary.json, summary.md and two plots.

Decided on **dev** (the cookbook: choose on dev, never tune on test): an arm's ``metrics`` are its
runs' dev-split numbers (``choose_on``), the arms are ranked on them (``ranking``: by ``rank_by``,
calibrated dev NLL by default), and the test numbers sit beside them as ``metrics_beside``,
labelled "not for choosing" in summary.md, the plots and the CLI table.

Read from every run's ``eval/evaluation.json`` (the headline blocks for the headline split, test
when present; ``other_splits`` for the others): for ``raw`` and ``calibrated`` probabilities,
overall / per type / group-macro accuracy, NLL, Brier, ECE, target-referenced ECE and sharpness
gap; when rows carry a known posterior, the same against the posterior plus the Bayes gap; the
fitted temperature per type. Each metric becomes
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

FORMAT = "rlcd.sweep/2"  # /2: ``metrics`` are the dev split's (were the headline split's), ``ranking`` added
TYPES = ("choice", "noul", "score")
VIEWS = ("raw", "calibrated")
BLOCK_METRICS = ("accuracy", "nll", "brier", "ece", "ece_target", "sharpness_gap")
POSTERIOR_METRICS = ("accuracy", "nll", "brier", "ece_target", "sharpness_gap", "bayes_gap", "model_nll",
                     "bayes_nll")


# --- numbers -----------------------------------------------------------------------------------


CHOOSE_ON = "dev"
RANK_BY = "calibrated.overall.nll"
HIGHER_IS_BETTER = ("accuracy",)  # a rank_by key ending in one of these: higher is better; else lower
RANKABLE = ("accuracy", "nll", "brier", "ece", "ece_target", "bayes_gap", "model_nll")


def split_blocks(ev: Mapping[str, Any], split: str | None = None) -> dict[str, Any] | None:
    """``{"raw", "calibrated"}`` summaries of ``split`` in an evaluation dict (None: the headline split);
    None when the evaluation has no such split."""
    if split is None or ev.get("headline_split") == split:
        return {"raw": ev.get("raw"), "calibrated": ev.get("calibrated")}
    other = (ev.get("other_splits") or {}).get(split)
    return dict(other) if isinstance(other, Mapping) else None


def metric_values(ev: Mapping[str, Any], split: str | None = None) -> dict[str, float]:
    """Flat ``{"raw.overall.nll": v, ..., "temperature.choice": T}`` from one evaluation dict: the
    metrics of ``split`` (None: the headline split; none at all when the split is absent) and the
    temperatures (fitted on the calibration split, the same whatever ``split``)."""
    out: dict[str, float] = {}
    blocks_of = split_blocks(ev, split)
    if blocks_of is None:
        return out

    def put(key: str, v: Any) -> None:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
            out[key] = float(v)

    for view in VIEWS:
        summ = blocks_of.get(view) or {}
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


def _arm_summary(arm: Arm, specs: Sequence[RunSpec], by_result: Mapping[str, RunResult],
                 choose_on: str = CHOOSE_ON, beside: str | None = "test") -> dict[str, Any]:
    per_metric: dict[str, list[float]] = {}
    per_beside: dict[str, list[float]] = {}
    runs, splits, fit = [], set(), {}
    for spec in specs:
        entry, ev = _run_entry(spec, by_result.get(spec.name))
        runs.append(entry)
        if ev is None:
            continue
        splits.add(ev.get("headline_split"))
        if split_blocks(ev, choose_on) is None:
            entry["missing_split"] = choose_on
        for k, v in metric_values(ev, choose_on).items():
            per_metric.setdefault(k, []).append(v)
        for k, v in (metric_values(ev, beside) if beside else {}).items():
            per_beside.setdefault(k, []).append(v)
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
        "metrics_beside": {k: mean_std(v) for k, v in sorted(per_beside.items())},
    }


def check_rank_by(rank_by: str) -> str:
    """A ranking key is a metric of the summary (``raw|calibrated.<block>.<metric>``) lower or higher
    being better without doubt; ValueError naming the choices otherwise."""
    parts = rank_by.split(".")
    if len(parts) < 3 or parts[0] not in VIEWS or parts[-1] not in RANKABLE:
        raise ValueError(f"rank_by {rank_by!r}: expected raw|calibrated.<overall|group_macro|per_type.T>.<metric>, "
                         f"metric one of {', '.join(RANKABLE)} (e.g. {RANK_BY})")
    return rank_by


def rank_arms(arms: Sequence[Mapping[str, Any]], rank_by: str = RANK_BY) -> list[str]:
    """Arm names best first by the mean of ``rank_by`` over seeds (ties in grid order; arms without it left out)."""
    higher = rank_by.endswith(HIGHER_IS_BETTER)
    scored = [(a["metrics"].get(rank_by) or {}).get("mean") for a in arms]
    order = sorted(range(len(arms)), key=lambda i: (scored[i] is None,
                                                    0.0 if scored[i] is None else (-scored[i] if higher else scored[i]),
                                                    i))
    return [arms[i]["name"] for i in order if scored[i] is not None]


def summarize_runs(arms: Sequence[Arm], specs: Sequence[RunSpec], *, results: Sequence[RunResult] = (),
                   notes: Sequence[str] = (), config: Mapping[str, Any] | None = None,
                   choose_on: str = CHOOSE_ON, rank_by: str = RANK_BY) -> dict[str, Any]:
    """The summary.json content: per arm, mean/std over its seeds of every metric of the ``choose_on``
    split (dev) and, beside, of the other of dev/test; the arms ranked on ``rank_by`` (see module doc)."""
    check_rank_by(rank_by)
    beside = "test" if choose_on != "test" else "dev"
    by_result = {r.name: r for r in results}
    out_arms = [_arm_summary(arm, [s for s in specs if s.arm == arm.name], by_result, choose_on, beside)
                for arm in arms]
    failed = [r["name"] for a in out_arms for r in a["runs"] if r["status"] == "failed"]
    notes = list(notes)
    missing = [r["name"] for a in out_arms for r in a["runs"] if r.get("missing_split")]
    if missing:
        notes.append(f"no {choose_on} split in the evaluation of {', '.join(missing)}: left out of the {choose_on} "
                     f"numbers")
    order = rank_arms(out_arms, rank_by)
    ranking = {"split": choose_on, "metric": rank_by, "higher_is_better": rank_by.endswith(HIGHER_IS_BETTER),
               "order": order, "best": order[0] if order else None, "beside": beside,
               "beside_note": "not for choosing" if beside == "test" else None}
    return {"format": FORMAT, "config": dict(config or {}), "notes": notes, "choose_on": choose_on,
            "beside": beside, "ranking": ranking, "arms": out_arms, "failed": failed}


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
    choose, beside = summary.get("choose_on", CHOOSE_ON), summary.get("beside", "test")
    md += [f"Every cell is the mean ± sample standard deviation over seeds (no ± with one seed) on the runs' "
           f"**{choose}** split, the split to choose on; {_beside_label(beside)} numbers are in their own "
           "table below. Lower is better for NLL, Brier and ECE; sharpness gap = "
           "mean max p − mean max target (> 0: sharper than the targets). ECE-t is the target-referenced ECE.", ""]
    if summary.get("notes"):
        md += ["Notes:", ""] + [f"- {n}" for n in summary["notes"]] + [""]
    return md


def _beside_label(split: str) -> str:
    return f"{split} (not for choosing)" if split == "test" else split


def _metric_table(arms: Sequence[Mapping[str, Any]], title: str, prefix: str, cols: Sequence[tuple[str, str]],
                  with_temperatures: bool = False, source: str = "metrics") -> list[str]:
    """One row per arm that has any of the metrics ``prefix.<key>``; nothing when no arm has one."""
    head = ["arm", "n"] + [c for c, _ in cols] + ([f"T {t}" for t in TYPES] if with_temperatures else [])
    lines = [f"## {title}", "", _row(head), "|" + "---|" * len(head)]
    rows = 0
    for a in arms:
        m = a.get(source) or {}
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
    md = ["## Per type (raw NLL / calibrated NLL), same split", "", _row(head), "|" + "---|" * len(head)]
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


def _ranking_section(summary: Mapping[str, Any]) -> list[str]:
    rk = summary.get("ranking")
    if not rk:
        return []
    by = {a["name"]: a for a in summary["arms"]}
    metric, beside = rk["metric"], _beside_label(rk["beside"])
    better = "higher" if rk["higher_is_better"] else "lower"
    md = [f"## Choice: on {rk['split']}, by `{metric}` ({better} is better)", ""]
    if not rk["order"]:
        return md + [f"No arm has `{metric}` on {rk['split']}.", ""]
    md += [f"Best on {rk['split']}: **`{rk['best']}`**. The {beside} column is shown for reference only.", "",
           _row(["rank", "arm", "n", f"{rk['split']} {metric}", f"{beside} {metric}"]), "|---|---|---|---|---|"]
    for i, name in enumerate(rk["order"], 1):
        a = by[name]
        md.append(_row([str(i), f"`{name}`", str(a["n_ok"]), _pm(a["metrics"].get(metric)),
                        _pm((a.get("metrics_beside") or {}).get(metric))]))
    return md + [""]


def _beside_tables(summary: Mapping[str, Any]) -> list[str]:
    arms, label = summary["arms"], _beside_label(summary.get("beside", "test"))
    md = _metric_table(arms, f"Raw probabilities (overall), {label}", "raw.overall", METRIC_COLUMNS,
                       source="metrics_beside")
    md += _metric_table(arms, f"Calibrated probabilities (overall), {label}", "calibrated.overall", METRIC_COLUMNS,
                        source="metrics_beside")
    md += _metric_table(arms, f"Bayes gap, {label}", "calibrated.overall", POSTERIOR_COLUMNS[-1:],
                        source="metrics_beside")
    return md


def summary_markdown(summary: Mapping[str, Any]) -> str:
    arms = summary["arms"]
    choose = summary.get("choose_on", CHOOSE_ON)
    md = _header(summary)
    md += _ranking_section(summary)
    md += _metric_table(arms, f"Raw probabilities (overall), {choose}", "raw.overall", METRIC_COLUMNS,
                        with_temperatures=True)
    md += _metric_table(arms, f"Calibrated probabilities (overall, per-type temperatures), {choose}",
                        "calibrated.overall", METRIC_COLUMNS)
    md += _posterior_tables(arms)
    md += _per_type_table(arms)
    md += _beside_tables(summary)
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


def plot_vs_sigma(summary: Mapping[str, Any], metrics: Sequence[tuple[str, ...]], ylabel: str, title: str,
                  path: Path) -> Path:
    """One line (with ±std error bars) per (metric, arm family) over sigma; arms without sigma as
    horizontal dashed reference lines (with a ±std band). A metric is ``(key, label)`` (the arm's
    ``metrics``) or ``(key, label, "metrics_beside")`` (drawn fainter: the split not to choose on)."""
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
    for mi, (metric, mlabel, *src) in enumerate(metrics):
        colour = f"C{mi}"
        source = src[0] if src else "metrics"
        faint = 0.45 if source != "metrics" else 1.0
        for fi, (fam, members) in enumerate(families.items()):
            pts = []
            for a in sorted(members, key=lambda x: float(x["sigma"])):
                st = (a.get(source) or {}).get(metric)
                if st and st.get("mean") is not None:
                    pts.append((float(a["sigma"]), st["mean"], st.get("std") or 0.0))
            if not pts:
                continue
            xs, ys, es = zip(*pts)
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, color=colour, linestyle=styles[fi % len(styles)],
                        label=f"{mlabel} ({fam})", alpha=faint)
            drawn = True
        for a in refs:
            st = (a.get(source) or {}).get(metric)
            if not st or st.get("mean") is None:
                continue
            ax.axhline(st["mean"], linestyle="--", color=colour, alpha=0.8 * faint,
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
    choose, beside = summary.get("choose_on", CHOOSE_ON), summary.get("beside", "test")
    plot_vs_sigma(summary, [("raw.overall.nll", f"{choose} NLL raw"),
                            ("calibrated.overall.nll", f"{choose} NLL calibrated"),
                            ("calibrated.overall.nll", f"{_beside_label(beside)} NLL calibrated", "metrics_beside")],
                  "NLL", f"NLL vs sigma (choose on {choose})", paths["nll"])
    return paths
