"""The report's "Coherence of derived forms" section, read from `eval/probe-coherence.json` (`rlcd probe coherence`).

Reads the file only (no model): per relation family the violation rate at the probe's tolerance with its 95%
case-bootstrap interval, the mean deviation, and the gap of the derived answers to their exact targets beside the
gap the base answers imply -- coherence alone is not quality, so no violation rate is shown without its gap.
Without the file the section is one line that says how to produce it.
"""

from __future__ import annotations

import json

from rlcd.report.context import Context
from rlcd.report.document import Section, Table, Text, fmt, fmt_ci

TITLE = "Coherence of derived forms"
FORMAT = "rlcd.probe_coherence/1"
FILE = "probe-coherence.json"


def coherence(ctx: Context) -> Section | None:
    if ctx.run.eval_name != "eval":
        return None  # the probe scores the run's own test split only
    s = Section(TITLE)
    path = ctx.run.eval_dir / FILE
    if not path.is_file():
        return s.add(Text(f"No `eval/{FILE}` yet: `rlcd probe coherence {ctx.name}` asks the test questions in "
                          "derived forms with exact targets (negations, merged options, tails, sub-menus, ...) and "
                          "writes it."))
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        per_family, per_form = doc["per_family"], doc["per_form"]
    except (OSError, ValueError, KeyError, TypeError):
        doc, per_family, per_form = {}, None, None
    if doc.get("format") != FORMAT or not isinstance(per_family, dict) or not isinstance(per_form, dict):
        return s.add(Text(f"`eval/{FILE}` is not a `{FORMAT}` result; rerun `rlcd probe coherence {ctx.name}`.",
                          kind="warn"))
    probed, evaluated = doc.get("checkpoint_sha256"), ctx.meta.get("checkpoint_sha256")
    if probed and evaluated and probed != evaluated:
        s.add(Text(f"`eval/{FILE}` scored other weights than this evaluation (checkpoint sha256 {probed[:12]}… vs "
                   f"{evaluated[:12]}…): rerun `rlcd probe coherence {ctx.name}`.", kind="warn"))
    tol = doc.get("tol")
    s.add(Text(f"{doc.get('n_base')} test questions asked again in {doc.get('n_derived')} derived forms whose exact "
               "answer is a fixed map f of the original's (`rlcd data derive`). Deviation: max over candidates of "
               f"|derived answer - f(original answer)|; a violation: deviation > {tol}. Gap: total variation of the "
               "derived answer to its exact target (implied: of f(original answer)); the original answers' mean gap "
               f"is {fmt(doc.get('base_mean_gap'), 3)}. {'Calibrated' if doc.get('calibrated') else 'Raw'} "
               f"probabilities; 95% percentile bootstrap over cases ({doc.get('resamples')} resamples). Every form "
               "is asked as written, to measure the model's own coherence: the evaluation above (and `rlcd serve`) "
               "asks each question in its canonical form, which makes the order and yes/no-choice forms agree by "
               "construction."))
    names = doc.get("families") or {}
    rows = []
    for fam, b in per_family.items():
        forms = ", ".join(f for f, fb in per_form.items() if fb.get("family") == fam and fb.get("n_rows"))
        rows.append([names.get(fam, fam), b.get("n_rows"), b.get("n_cases"),
                     fmt_ci(b.get("violation_rate"), b.get("violation_rate95"), 3),
                     fmt(b.get("mean_deviation"), 3), fmt(b.get("mean_gap"), 3), fmt(b.get("mean_gap_implied"), 3),
                     forms or "—"])
    o = doc.get("overall") or {}
    rows.append(["all forms", o.get("n_rows"), o.get("n_cases"),
                 fmt_ci(o.get("violation_rate"), o.get("violation_rate95"), 3), fmt(o.get("mean_deviation"), 3),
                 fmt(o.get("mean_gap"), 3), fmt(o.get("mean_gap_implied"), 3), ""])
    s.add(Table(["family", "rows", "cases", "violation rate [95% CI]", "mean deviation", "gap to exact",
                 "implied gap", "forms"], rows))
    worst = sorted((fb for fb in per_form.items() if fb[1].get("n_rows")),
                   key=lambda kv: -(kv[1].get("mean_gap") or 0.0))
    s.add(Table(["form", "family", "rows", "violation rate", "gap to exact", "implied gap"],
                [[f, names.get(fb.get("family"), fb.get("family")), fb.get("n_rows"), fmt(fb.get("violation_rate"), 3),
                  fmt(fb.get("mean_gap"), 3), fmt(fb.get("mean_gap_implied"), 3)] for f, fb in worst],
                caption="Each form's gap to its exact target, largest first."))
    return s
