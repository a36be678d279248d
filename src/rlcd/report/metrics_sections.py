"""Report sections on the evaluation metrics, one screen each: temperatures, per type, ordinal
metrics, majority baseline, Bayes floor, per group, other splits, reliability (the headline, which
leads the report, is `rlcd.report.verdict`)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from rlcd import metrics as M
from rlcd.calibrate import CV_FOLDS, MIN_ROWS
from rlcd.report import plots
from rlcd.report.context import Context
from rlcd.report.document import Bullets, Section, Table, Text, fmt, fmt_ci, fmt_interval
from rlcd.uncertainty import effect_blocks, worsened_by_calibration

HEAD_METRICS = ("accuracy", "soft_accuracy", "nll", "brier", "ece", "ece_target", "sharpness_gap",
                "mean_confidence", "aurc")


def _label(block: str) -> str:
    return "all types" if block == "overall" else block
BOOTSTRAP_NOTE = ("Intervals: 95% grouped percentile bootstrap, 1,000 resamples of whole source cases (every "
                  "question about one state moves together), seeded, so the same files give the same numbers.")


def _ci(block: Mapping[str, Any], key: str) -> Sequence[Any] | None:
    return (block.get("ci95") or {}).get(key)


def raw_cal_table(raw: Mapping, cal: Mapping, keys: Sequence[str] = HEAD_METRICS, *, intervals: bool = False) -> Table:
    if intervals:
        return Table(["metric", "raw [95% CI]", "calibrated [95% CI]"],
                     [[k, fmt_ci(raw.get(k), _ci(raw, k)), fmt_ci(cal.get(k), _ci(cal, k))] for k in keys if k in raw])
    return Table(["metric", "raw", "calibrated"], [[k, raw.get(k), cal.get(k)] for k in keys if k in raw])


def calibration_flags(effect: Mapping[str, Any], split: str) -> list[Text]:
    """A warning for each type (and overall) whose calibrated NLL or ECE is worse than raw beyond the
    paired 95% interval of ``calibrated - raw``; one reassuring line when there is none."""
    flags = [Text(f"⚠ Calibration made **{_label(name)}** {m.upper()} worse on {split}: Δ = {delta:+.4f}, paired "
                  f"95% CI [{ci[0]:+.4f}, {ci[1]:+.4f}], which excludes 0: more than resampling noise.", kind="warn")
             for name, m, delta, ci in worsened_by_calibration(effect)]
    if not flags and effect.get("overall"):
        flags.append(Text(f"No type's calibrated NLL or ECE on {split} is worse than raw beyond its paired 95% "
                          "interval.", kind="ok"))
    return flags


def bound_note(info: dict) -> str:
    """The fit's `at_bound` ("lower"/"upper") in words: which bound T stopped at and what that says."""
    side = info.get("at_bound")
    if side == "upper":
        return (f"stopped at the upper bound T = {fmt(info.get('temperature'), 3)}: the fit wanted a higher T (answers "
                "far too sharp for the calibration rows)")
    if side == "lower":
        return (f"stopped at the lower bound T = {fmt(info.get('temperature'), 3)}: the fit wanted a lower T (answers "
                "far too flat for the calibration rows)")
    return ""


def temperatures(ctx: Context) -> Section:
    s = Section("Temperatures")
    cal_info = ctx.meta.get("calibration") if isinstance(ctx.meta.get("calibration"), dict) else {}
    cis = ctx.ev.get("temperatures_ci95") or {}
    rows = []
    for t, temp in ctx.temperatures.items():
        info = cal_info.get(t, {}) if cal_info else {}
        rows.append([t, fmt(temp, 3), fmt_interval(cis.get(t), 3),
                     info.get("n"), info.get("loss_before"), info.get("loss_after"), info.get("iterations"),
                     info.get("converged"), info.get("reason") or bound_note(info)])
    s.add(Table(["type", "T", "95% CI (refit per resample)", "calibration rows", "loss at T=1", "loss at T",
                 "LBFGS iterations", "converged", "note"], rows))
    s.add(Text("The interval refits each type's temperature on every bootstrap resample of the calibration cases "
               "(grid over log T in [0.1, 10], refined by a parabola). A wide interval says the calibration split "
               f"is too small to pin the temperature down. A type keeps T = 1 (the note says why) below {MIN_ROWS} "
               f"calibration rows, or when its fit did not beat T = 1 on held-out calibration cases ({CV_FOLDS}-fold "
               "cross-fit by case); its interval is then the refused fit's."))
    if not cal_info:
        s.add(Text("Fit details (`meta.calibration`) were not recorded."))
    return s


def per_type(ctx: Context) -> Section:
    raw, cal = ctx.raw, ctx.cal
    s = Section("Per type")
    s.add(Table(["type", "n", "accuracy", "NLL raw", "NLL cal", "ECE raw", "ECE cal"],
                [[t, r["n"], fmt_ci(r["accuracy"], _ci(r, "accuracy")), fmt_ci(r["nll"], _ci(r, "nll")),
                  fmt_ci(cal["per_type"][t]["nll"], _ci(cal["per_type"][t], "nll")), fmt_ci(r["ece"], _ci(r, "ece")),
                  fmt_ci(cal["per_type"][t]["ece"], _ci(cal["per_type"][t], "ece"))]
                 for t, r in raw["per_type"].items()], caption="value [95% CI]"))
    s.add(Table(["type", "soft acc", "Brier raw", "Brier cal", "ECE-target raw", "ECE-target cal", "sharpness raw",
                 "sharpness cal"],
                [[t, r["soft_accuracy"], r["brier"], cal["per_type"][t]["brier"], r["ece_target"],
                  cal["per_type"][t]["ece_target"], r["sharpness_gap"], cal["per_type"][t]["sharpness_gap"]]
                 for t, r in raw["per_type"].items()]))
    effect = ctx.ev.get("calibration_effect") or {}
    blocks = [(_label(name), b) for name, b in effect_blocks(effect)]
    s.add(Section("Calibration effect (calibrated − raw, paired)", level=3).add(
        Table(["type", "Δ NLL", "Δ Brier", "Δ ECE", "Δ ECE-target"],
              [[name] + [fmt_ci((b.get(m) or {}).get("delta"), (b.get(m) or {}).get("ci95"))
                         for m in ("nll", "brier", "ece", "ece_target")] for name, b in blocks if b],
              caption="Δ [95% CI] on the same resamples; negative is better; an interval above 0 is flagged "
                      "in the headline")))
    return s


def ordinal(ctx: Context) -> Section:
    s = Section("Ordinal (score) metrics")
    if "rps" in ctx.raw["overall"]:
        return s.add(raw_cal_table(ctx.raw["overall"], ctx.cal["overall"], ("n_score", "rps", "level_mae", "within_one"),
                                   intervals=True))
    return s.add(Text("No score rows in this split."))


def majority(ctx: Context) -> Section:
    s = Section("Majority baseline")
    mb = ctx.ev.get("majority_baseline")
    if not mb:
        return s.add(Text("Not available: the majority baseline needs the training rows and is stored in "
                          "`eval/evaluation.json` by `rlcd evaluate`."))
    acc = ctx.raw["overall"]
    return s.add(Text(
        f"Always answering, per (sampling group, question instructions), the candidate most often the argmax of the "
        f"training targets: accuracy **{fmt(mb.get('accuracy'))}** (soft {fmt(mb.get('soft_accuracy'))}, group macro "
        f"{fmt(mb.get('group_macro_accuracy'))}, n = {mb.get('n')}) vs the model's "
        f"{fmt_ci(acc['accuracy'], _ci(acc, 'accuracy'))}. Test rows whose (group, instructions) pair was not seen in "
        f"training (or whose majority label is not one of its candidates): {mb.get('n_fallback_group', 0)} answered "
        f"with the group majority, {mb.get('n_fallback_first', 0)} with the first candidate."))


def posterior(ctx: Context) -> Section:
    s = Section("Known posterior: gap to the Bayes floor")
    pr, pc = ctx.raw["overall"].get("posterior"), ctx.cal["overall"].get("posterior")
    if not pr:
        return s.add(Text("No rows carry a posterior, so there is no Bayes floor to compare with."))
    s.add(Text(f"{pr['n']} rows carry a known posterior. On those rows `model_nll` is the model's NLL against the "
               "target, `bayes_nll` the posterior's own NLL against the target (the floor no model can beat in "
               "expectation) and `bayes_gap` = model_nll − bayes_nll; `bayes_accuracy` is the posterior's top-1 "
               "accuracy against the target. `uniform_gap` is the gap of the uniform answer (1/K per candidate), "
               "the same before and after calibration: a calibrated gap near it means the probabilities carry "
               "little beyond the number of candidates."))
    s.add(raw_cal_table(pr, pc, ("model_nll", "bayes_nll", "bayes_gap", "uniform_gap", "bayes_accuracy")))
    s.add(Text("The same scores with the posterior in place of the target (how close the model is to the truth):"))
    return s.add(raw_cal_table(pr, pc, ("accuracy", "soft_accuracy", "nll", "brier", "ece", "ece_target",
                                        "sharpness_gap")))


def per_group(ctx: Context) -> Section:
    raw, cal = ctx.raw, ctx.cal
    mb_groups = (ctx.ev.get("majority_baseline") or {}).get("per_group") or {}
    s = Section("Per group")
    s.add(Table(["group", "n", "accuracy", "majority", "NLL raw", "NLL cal", "ECE raw", "ECE cal"],
                [[g, b["n"], b["accuracy"], mb_groups.get(g), b["nll"], cal["per_group"][g]["nll"], b["ece"],
                  cal["per_group"][g]["ece"]] for g, b in raw["per_group"].items()]))
    s.add(Text("Group macro (unweighted mean over groups):"))
    s.add(raw_cal_table(raw["group_macro"], cal["group_macro"], ("accuracy", "nll", "brier", "ece", "ece_target")))
    s.add(ctx.figures.add("group_accuracy", plots.group_accuracy(raw["per_group"], mb_groups or None,
                                                                 f"per-group accuracy ({ctx.head})"),
                          "per-group accuracy"))
    return s


def other_splits(ctx: Context) -> Section | None:
    others = ctx.ev["other_splits"]
    if not others:
        return None
    s = Section("Other splits")
    rows = []
    for split, b in others.items():
        r, c = b["raw"]["overall"], b["calibrated"]["overall"]
        rows.append([split, b["raw"]["n"], fmt_ci(r.get("accuracy"), _ci(r, "accuracy")), r.get("nll"),
                     fmt_ci(c.get("nll"), _ci(c, "nll")), r.get("ece"), fmt_ci(c.get("ece"), _ci(c, "ece")),
                     r.get("ece_target"), c.get("ece_target")])
    s.add(Table(["split", "n", "accuracy", "NLL raw", "NLL cal", "ECE raw", "ECE cal", "ECE-target raw",
                 "ECE-target cal"], rows, caption="value [95% CI]"))
    if "calibration" in others:
        s.add(Text("(The calibration split is the one the temperatures were fitted on: its calibrated numbers are "
                   "in-sample.)"))
    return s


def reliability(ctx: Context) -> Section:
    raw, cal, head = ctx.raw, ctx.cal, ctx.head
    s = Section(f"Reliability and coverage ({head}, raw vs calibrated)")
    s.add(Text("Per type (all types together: in the headline). Points: mean accuracy of each confidence bin at "
               "the bin's mean confidence, with the bin's Wilson 95% interval; hollow points hold fewer than 5 rows. "
               "Bars below: rows per bin."))
    for t in raw["per_type"]:
        s.add(ctx.figures.add(f"reliability_{t}", plots.reliability(raw["per_type"][t], cal["per_type"][t], t),
                              f"reliability, {t}"))
    curves = {"raw": M.coverage_risk(ctx.preds[head], None),
              "calibrated": M.coverage_risk(ctx.preds[head], ctx.temperatures)}
    s.add(Section("Coverage-risk", level=3).add(
        ctx.figures.add("coverage_risk", plots.coverage_risk(curves, f"coverage-risk ({head})"), "coverage-risk"),
        Bullets([f"AURC raw {fmt_ci(raw['overall'].get('aurc'), _ci(raw['overall'], 'aurc'))}, calibrated "
                 f"{fmt_ci(cal['overall'].get('aurc'), _ci(cal['overall'], 'aurc'))} (lower is better)."])))
    return s
