"""The learning curve that opens the report of a run whose rows carry a known posterior (`make demo`'s): dev NLL
against updates, read beside the two references that say what it means -- the uniform answer (no learning) and
the Bayes floor (all that can be learned) -- and the final calibrated test point with its 95% interval.

Everything is drawn as NLL above the Bayes floor of its own rows (the floor is then 0 on every split): the dev
curve is `metrics.jsonl`'s pooled raw `dev_nll` minus the floor of the dev subset the run evaluated
(`samples.json`'s dev ids, read from `eval/predictions-dev.jsonl`), the test point is the calibrated gap of
`eval/predictions-test.jsonl` (`rlcd.uncertainty.bayes_gap_interval`). No posterior on those rows, no training
log or no dev evaluation: no section.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from rlcd import metrics as M
from rlcd.report import plots
from rlcd.report.context import Context
from rlcd.report.document import Section, Text, fmt, fmt_interval
from rlcd.report.training_log import selected_step


def dev_references(ctx: Context) -> dict[str, float] | None:
    """{"floor", "uniform"}: mean NLL of the posterior and of the uniform answer on the dev subset the run
    evaluated (all dev predictions when samples.json is missing), or None when a row there has no posterior."""
    rows = ctx.preds.get("dev") or []
    try:
        ids = {i for g in json.loads(ctx.run.samples_path.read_text())["dev"].values() for i in g}
        rows = [r for r in rows if r["id"] in ids] or rows
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    if not rows or any(r.get("posterior") is None for r in rows):
        return None
    floor = [M.nll(r["posterior"], r["target"]) for r in rows]
    uniform = [M.nll(np.full(len(r["target"]), 1.0 / len(r["target"])), r["target"]) for r in rows]
    return {"floor": float(np.mean(floor)), "uniform": float(np.mean(uniform)), "n": len(rows)}


def learning_curve(ctx: Context) -> Section | None:
    from rlcd.uncertainty import bayes_gap_interval

    if ctx.training is None:
        return None
    evals = [e for e in ctx.training[1] if isinstance(e.get("dev_nll"), (int, float))]
    ref = dev_references(ctx)
    test = bayes_gap_interval(ctx.preds.get(ctx.head) or [], ctx.temperatures)
    if not evals or ref is None or test is None:
        return None
    select_by = ((ctx.config or {}).get("recipe") or {}).get("select_by", "macro_accuracy")
    chosen = selected_step(ctx.training[1], ctx.meta, select_by)
    steps = [int(e["step"]) for e in evals]
    dev_gap = [float(e["dev_nll"]) - ref["floor"] for e in evals]
    png = plots.learning_curve(steps, dev_gap, ref["uniform"] - ref["floor"], test, chosen, ctx.head)
    lo, hi = test["ci95"] or (None, None)
    below = hi is not None and hi < test["uniform_gap"]
    s = Section("Learning curve")
    s.add(ctx.figures.add("learning_curve", png, "dev NLL above the Bayes floor against updates",
                          f"Dev NLL (raw, T = 1, {ref['n']} dev rows) above the dev rows' Bayes floor at every dev "
                          f"evaluation; the floor (0) and the uniform answer ({fmt(ref['uniform'] - ref['floor'])} "
                          f"above it) as lines; the final {ctx.head} point: the calibrated gap of the selected "
                          f"checkpoint with its 95% case-bootstrap interval."))
    return s.add(Text(
        f"Dev gap {fmt(dev_gap[0])} at step {steps[0]} → {fmt(dev_gap[-1])} at step {steps[-1]} "
        f"(uniform answer {fmt(ref['uniform'] - ref['floor'])}). {ctx.head.capitalize()} ({test['n']} rows): calibrated "
        f"gap **{fmt(test['gap'])}** {fmt_interval(test['ci95'])} vs {fmt(test['uniform_gap'])} for the uniform answer"
        + (" — the whole interval below it." if below else " — the interval is not wholly below it.")))
