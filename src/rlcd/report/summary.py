"""The short plain-text summary `rlcd evaluate` prints: raw vs calibrated per type with intervals."""

from __future__ import annotations

from typing import Any, Mapping

from rlcd.report.document import fmt, fmt_interval
from rlcd.report.notes import result_notes
from rlcd.uncertainty import worsened_by_calibration


def format_summary(ev: Mapping[str, Any]) -> str:
    """Short plain-text table for a terminal: raw vs calibrated per type, baseline, Bayes gap."""
    raw, cal = ev["raw"], ev["calibrated"]
    lines = [f"split {ev['headline_split']} (n={raw['n']})",
             f"{'type':<9}{'n':>6} {'acc':>7} {'nll raw':>8} {'nll cal':>8} {'ece raw':>8} {'ece cal':>8}"
             f" {'T':>6}  {'T 95% CI':<16} {'nll cal 95% CI':<18}"]
    blocks = [("overall", raw["overall"], cal["overall"])]
    blocks += [(t, raw["per_type"][t], cal["per_type"][t]) for t in raw["per_type"]]
    t_ci = ev.get("temperatures_ci95") or {}
    for name, r, c in blocks:
        temp = ev["temperatures"].get(name) if name != "overall" else None
        t_int = fmt_interval(t_ci.get(name), 2) if name != "overall" else ""
        lines.append(f"{name:<9}{r['n']:>6} {fmt(r['accuracy']):>7} {fmt(r['nll']):>8} {fmt(c['nll']):>8}"
                     f" {fmt(r['ece']):>8} {fmt(c['ece']):>8} {fmt(temp, 3):>6}  {t_int:<16}"
                     f" {fmt_interval((c.get('ci95') or {}).get('nll')):<18}")
    mb = ev.get("majority_baseline")
    lines.append(f"majority baseline accuracy: {fmt(mb.get('accuracy')) if mb else 'not computed'}"
                 f"   model accuracy: {fmt(raw['overall']['accuracy'])}")
    post_r, post_c = raw["overall"].get("posterior"), cal["overall"].get("posterior")
    if post_r:
        lines.append(f"gap to Bayes floor (NLL): raw {fmt(post_r['bayes_gap'])}  calibrated {fmt(post_c['bayes_gap'])}"
                     f"  (floor {fmt(post_r['bayes_nll'])}, n={post_r['n']}; a uniform answer: "
                     f"{fmt(post_r.get('uniform_gap'))})")
    else:
        lines.append("gap to Bayes floor: no rows carry a posterior")
    lines += [f"note: {n}" for n in result_notes(ev.get("meta"))]
    lines += fit_notes(ev)
    for t, m, delta, ci in worsened_by_calibration(ev.get("calibration_effect") or {}):
        lines.append(f"warning: calibration made {t} {m} worse beyond noise (delta {delta:+.4f}, 95% CI {fmt_interval(ci)})")
    return "\n".join(lines)


def fit_notes(ev: Mapping[str, Any]) -> list[str]:
    """One line per temperature that was not fitted (too few rows), whose fit was refused (it did not beat T = 1
    on held-out calibration cases: `rlcd.calibrate`) or whose fit did not converge."""
    out = []
    for qtype, info in ((ev.get("meta") or {}).get("calibration") or {}).items():
        if info.get("reason"):
            what = "fit refused" if "fitted_temperature" in info else "not fitted"
            out.append(f"note: {qtype} temperature {what}: {info['reason']}")
        elif info.get("converged") is False:
            out.append(f"warning: the {qtype} temperature fit did not converge (T {fmt(info.get('temperature'), 3)}, "
                       f"remaining step {fmt(info.get('newton_step'), 3)} in log T); "
                       "treat its calibrated numbers with care")
    return out
