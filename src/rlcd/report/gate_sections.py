"""The report's gating section: the cut-points of `eval/thresholds.json` (`rlcd gate`) with what they buy on test.

Reads the file only (no recomputation): each gate's threshold, its out-of-bag accuracy and coverage on the
calibration split (the honesty guard of `rlcd.gate`), and the same threshold applied to the test split with 95%
grouped-bootstrap intervals. Gates that were not chosen are listed with the reason.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from rlcd.report.context import Context
from rlcd.gate import refused_names
from rlcd.report.document import Section, Table, Text, fmt, fmt_ci


def _why(g: Mapping[str, Any], min_rows: Any) -> str:
    return {"refused": f"not chosen: fewer than {min_rows} calibration rows",
            "unreachable": "not chosen: no gate reaches the goal",
            "unstable": "not chosen: unstable under the bootstrap guard"}.get(g.get("status"), str(g.get("status")))


def gates(ctx: Context) -> Section | None:
    path = ctx.run.eval_dir / "thresholds.json"
    if not path.is_file():
        return None
    s = Section("Gating: thresholds.json")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        ext = doc["x_rlcd"]
        listed = ext["gates"]
    except (OSError, ValueError, KeyError, TypeError):
        return s.add(Text("`eval/thresholds.json` is not one `rlcd gate` wrote (no `x_rlcd.gates`); nothing to show.",
                          kind="warn"))
    goal = ext.get("goal") or {}
    want = (f"selective accuracy ≥ {goal['targetAccuracy']}" if "targetAccuracy" in goal
            else f"escalate at most {goal.get('maxEscalation')}")
    s.add(Text(f"Gates chosen on the **{ext.get('split', 'calibration')}** split for {want} (jev-eval's contract, "
               f"version {doc.get('version')}; `rlcd serve` applies them to requests with `\"x_gate\": true`). An "
               "answer is auto-decided when its gate confidence (choice/score `confidence`, noul |P(true) − 0.5| × 2; "
               "yesAt gates: P(true)) is at least the threshold, else escalated. Calibration numbers are out-of-bag "
               f"means over {doc.get('guard', {}).get('resamples')} case resamples (the pick never saw those rows); "
               f"the test columns apply the same threshold to the **{ext.get('heldOut', 'test')}** split, 95% "
               "grouped-bootstrap intervals."))
    rows = []
    refused = [g["name"] for g in listed if g.get("status") == "refused"]
    for g in listed:
        kind = g.get("kind")
        name = g.get("name") if kind != "type" else f"{g.get('name')} (all rows)"
        if g.get("status") == "refused":
            continue
        if g.get("status") not in ("ok", "warn"):
            rows.append([name, kind, g.get("n"), _why(g, ext.get("minRows")), "", "", "", ""])
            continue
        t = g.get("test") or {}
        rows.append([name + (" (provisional)" if g.get("status") == "warn" else ""), kind, g.get("n"),
                     fmt(g.get("threshold")), fmt_ci(g.get("accuracy"), g.get("accuracy95")), fmt(g.get("coverage")),
                     fmt_ci(t.get("accuracy"), t.get("accuracy95")) if t else "no test rows",
                     fmt_ci(t.get("coverage"), t.get("coverage95")) if t else ""])
    s.add(Table(["gate", "kind", "calibration rows", "threshold", "accuracy (out-of-bag) [95%]", "coverage (out-of-bag)",
                 "test accuracy [95% CI]", "test coverage [95% CI]"], rows))
    if refused:
        s.add(Text(f"Not chosen, fewer than {ext.get('minRows')} calibration rows: {refused_names(refused, 8)}. "
                   "`rlcd gate RUN --min-rows N` lowers the floor (jev-eval refuses below 50 and calls a gate "
                   "provisional below 200)."))
    chosen = [g for g in listed if g.get("status") in ("ok", "warn") and g.get("test")]
    misses = [g["name"] for g in chosen if g["test"].get("accuracy95") and "targetAccuracy" in goal
              and g["test"]["accuracy95"][1] < goal["targetAccuracy"] and g.get("kind") != "yesAt"
              and g.get("kind") != "typeYesAt"]
    if misses:
        s.add(Text(f"On test, the 95% interval of accuracy lies below the target for: {', '.join(misses)}.", kind="warn"))
    return s
