"""The report's first screen: verdict lines, the headline table with intervals, the overall reliability.

A reader should learn from one screen (1280 x 900) whether the model learned anything beyond the
majority baseline, how far it is from the Bayes floor (when rows carry a known posterior) and what
calibration did, each judged against its 95% interval; metadata, recipe and hashes come later.
"""

from __future__ import annotations

from typing import Any, Sequence

from rlcd.report import plots
from rlcd.report.context import Context
from rlcd.report.document import Bullets, Section, Text, fmt, fmt_ci
from rlcd.report.metrics_sections import BOOTSTRAP_NOTE, _ci, calibration_flags, raw_cal_table


def _against(value: float, ci: Sequence[Any] | None, other: float, what: str) -> str:
    """'above/below <what> beyond noise' when the interval of `value` excludes `other`, else 'within noise of'."""
    if ci and ci[0] is not None and ci[1] is not None:
        if ci[0] > other:
            return f"above {what} beyond noise (its 95% interval excludes it)"
        if ci[1] < other:
            return f"**below** {what} beyond noise (its 95% interval excludes it)"
        return f"within noise of {what} (its 95% interval holds it)"
    return f"{'above' if value > other else 'not above'} {what} (no interval)"


def learned_line(ctx: Context) -> str:
    acc = ctx.raw["overall"]
    mb = ctx.ev.get("majority_baseline")
    if not mb or mb.get("accuracy") is None:
        return (f"**Learned vs majority**: accuracy {fmt_ci(acc.get('accuracy'), _ci(acc, 'accuracy'))}; the majority "
                "baseline is not available (it needs `eval/evaluation.json` from `rlcd evaluate`).")
    base = float(mb["accuracy"])
    n_model, n_base = ctx.raw["overall"].get("n"), mb.get("n")
    if n_model is not None and n_base is not None and n_model != n_base:  # an evaluation.json from before the fix
        return (f"**Learned vs majority**: accuracy {fmt_ci(acc.get('accuracy'), _ci(acc, 'accuracy'))} on {n_model} "
                f"rows vs {fmt(base)} for the training majority on {n_base} rows: not comparable (not the same rows); "
                "evaluate again to score the baseline on the rows the model answered.")
    return (f"**Learned vs majority**: accuracy {fmt_ci(acc.get('accuracy'), _ci(acc, 'accuracy'))} vs "
            f"{fmt(base)} for always answering the training majority: "
            + _against(float(acc["accuracy"]), _ci(acc, "accuracy"), base, "the majority baseline") + ".")


def bayes_line(ctx: Context) -> str | None:
    pr, pc = ctx.raw["overall"].get("posterior"), ctx.cal["overall"].get("posterior")
    if not pr or not pc:
        return None
    return (f"**Gap to the Bayes floor** (NLL, {pr['n']} rows with a known posterior): calibrated "
            f"{fmt(pc.get('bayes_gap'))}, raw {fmt(pr.get('bayes_gap'))} above the floor {fmt(pr.get('bayes_nll'))} "
            f"(0 is the best any model can do in expectation; the uniform answer is {fmt(pr.get('uniform_gap'))} "
            "above it).")


def calibration_line(ctx: Context) -> str | None:
    overall = (ctx.ev.get("calibration_effect") or {}).get("overall") or {}
    parts = []
    for m, name in (("nll", "NLL"), ("ece", "ECE")):
        d = overall.get(m) or {}
        delta, ci = d.get("delta"), d.get("ci95")
        if delta is None:
            continue
        raw, cal = ctx.raw["overall"].get(m), ctx.cal["overall"].get(m)
        if ci and ci[1] is not None and ci[1] < 0:
            verdict = "better beyond noise"
        elif ci and ci[0] is not None and ci[0] > 0:
            verdict = "**worse** beyond noise"
        else:
            verdict = "no change beyond noise"
        parts.append(f"{name} {fmt(raw)} → {fmt(cal)} (Δ {fmt_ci(delta, ci)}: {verdict})")
    if not parts:
        return None
    return "**Calibration effect** (per-type temperatures, paired): " + "; ".join(parts) + "."


def summary(ctx: Context) -> Section:
    """The headline section, first in both documents (and above the table of contents in HTML)."""
    raw, cal = ctx.raw, ctx.cal
    s = Section(f"Headline: {ctx.head} split (n = {raw['n']})")
    s.add(Bullets([line for line in (learned_line(ctx), bayes_line(ctx), calibration_line(ctx)) if line]))
    flags = calibration_flags(ctx.ev.get("calibration_effect") or {}, ctx.head)
    s.add(*[f for f in flags if f.kind == "warn"])
    s.add(raw_cal_table(raw["overall"], cal["overall"], intervals=True))
    s.add(ctx.figures.add("reliability_overall", plots.reliability(raw["overall"], cal["overall"], "all types",
                                                                   height=4.2),
                          "reliability, all types",
                          "Overall reliability, raw vs calibrated: accuracy per confidence bin at its mean "
                          "confidence (Wilson 95% bars, hollow: fewer than 5 rows), rows per bin below."))
    gm = raw["group_macro"]
    s.add(Text(f"Group macro accuracy (the selection score's form): {fmt_ci(gm.get('accuracy'), _ci(gm, 'accuracy'))} "
               f"over {gm.get('n_groups')} groups. `ece` is hard-label ECE (15 bins on max p); `ece_target` compares "
               "confidence with the target mass on the chosen candidate; `sharpness_gap` = mean(max p) − mean(max "
               "target). " + BOOTSTRAP_NOTE))
    s.add(*[f for f in flags if f.kind != "warn"])
    return s
