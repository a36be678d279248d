"""The report's "Order-fragile questions" section, read from `eval/probe-order.json` (`rlcd probe order RUN`).

Reads the file only (no model, no recomputation): the flip rate per type with its 95% case-bootstrap interval,
with and without order votes for choice, and the questions (type + instructions) whose answers flip most often
when their options are listed differently (choice reordered, score levels reversed, noul wording swapped).
Without the file the section is one line that says how to produce it.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from rlcd.report.context import Context
from rlcd.report.document import Section, Table, Text, fmt, fmt_ci
from rlcd.report.error_analysis import short

TITLE = "Order-fragile questions"
FORMAT = "rlcd.probe_order/2"
SHOWN = 10
PROBE = {"choice": "options reordered", "score": "levels reversed", "noul": "false/true wording swapped"}


def _cell(b: Mapping[str, Any] | None) -> str:
    return "—" if not b or b.get("flip_rate") is None else fmt_ci(b.get("flip_rate"), b.get("flip_rate95"), 3)


def fragile(ctx: Context) -> Section | None:
    if ctx.run.eval_name != "eval":
        return None  # the probe scores the run's own test split only
    s = Section(TITLE)
    path = ctx.run.probe_order_path
    if not path.is_file():
        return s.add(Text(f"No `eval/probe-order.json` yet: `rlcd probe order {ctx.name}` measures how answers change "
                          "when the options are reordered and writes it."))
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        per_type, questions = doc["per_type"], doc["questions"]
    except (OSError, ValueError, KeyError, TypeError):
        doc, per_type, questions = {}, None, None
    if doc.get("format") != FORMAT or not isinstance(per_type, dict) or not isinstance(questions, list):
        return s.add(Text(f"`eval/probe-order.json` is not a `{FORMAT}` result; rerun `rlcd probe order {ctx.name}`.",
                          kind="warn"))
    probed, evaluated = doc.get("checkpoint_sha256"), ctx.meta.get("checkpoint_sha256")
    if probed and evaluated and probed != evaluated:
        s.add(Text("`eval/probe-order.json` scored other weights than this evaluation (checkpoint sha256 "
                   f"{probed[:12]}… vs {evaluated[:12]}…): rerun `rlcd probe order {ctx.name}`.", kind="warn"))
    votes = [str(n) for n in doc.get("votes", []) if str(n) != "1"]
    limit = f", the first {doc['limit']} questions of each type" if doc.get("limit") else ""
    s.add(Text(f"Each question of the **{doc.get('split', 'test')}** split{limit} asked again with its options listed "
               "differently (choice: other orders, all for K ≤ 4, else the reversal and a seeded sample of "
               f"{doc.get('max_perms')}; score: levels reversed; noul: false/true wording swapped, the consistent "
               "answer being the complement). A flip: the top answer, mapped back, changes. Flip rates per "
               f"(question, order) comparison, 95% percentile bootstrap over cases ({doc.get('resamples')} resamples); "
               "`rlcd probe order` wrote this file. The questions are asked as written, to measure the model's own "
               "sensitivity to order: the numbers above this section (and `rlcd serve`) ask each question in its "
               "canonical form, whose answer does not depend on the order its options are sent in."))
    rows = []
    for t, b in per_type.items():
        c = (doc.get("counts") or {}).get(t, {})
        not_probed = "; ".join(f"{n}: {r}" for r, n in (c.get("reasons") or {}).items())
        voted = [f"{n} votes: {_cell(b['votes'].get(n))}" for n in votes if isinstance(b.get("votes"), dict)]
        rows.append([t, PROBE.get(t, ""), b.get("n_rows"), b.get("n_cases"), _cell(b), "; ".join(voted) or "—",
                     fmt(b.get("mean_tv"), 3), not_probed or "—"])
    s.add(Table(["type", "probe", "questions", "cases", "flip rate [95% CI]", "with order votes", "mean TV",
                 "not probed"], rows))
    shown = [q for q in questions if q.get("flip_rate")][:SHOWN]
    if not shown:
        return s.add(Text("No question's answer flipped.", kind="ok"))
    header = ["question", "type", "flip rate [95% CI]", *(f"{n} votes" for n in votes), "mean TV", "n", "cases"]
    s.add(Table(header, [[short(q.get("instructions") or "(no instructions)", 80), q.get("type"), _cell(q),
                          *(_cell((q.get("votes") or {}).get(n)) if q.get("type") == "choice" else "—"
                            for n in votes),
                          fmt(q.get("mean_tv"), 3), q.get("n_rows"), q.get("n_cases")] for q in shown],
                caption=f"Questions (type + instructions) whose answers flip most often (at most {SHOWN}; n: questions "
                        "asked, cases: their cases)."))
    return s
