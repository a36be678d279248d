"""Issue 46's tables from run-order-and-peers.sh's outputs: the order probe (flip rates per type, with and without
votes), the control scored remotely with and without order votes (paired by case), and any2jev against the control.

    python docs/experiments/real-weights/table_order_and_peers.py runs/rw6 docs/experiments/real-weights/order-and-peers

Copies the small JSON it reads (the probe without its per-row block, each remote evaluation's metrics and meta, the
comparisons) into the output directory and writes tables.md there; prints the tables.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

TYPES = ("choice", "noul", "score")


def _ci(x: list[float] | None) -> str:
    return f"[{x[0]:.3f}, {x[1]:.3f}]" if x else "—"


def probe_table(probe: dict) -> list[str]:
    lines = ["| type | probe | votes | questions | cases | comparisons | flip rate [95% CI] | mean TV |",
             "|---|---|---|---|---|---|---|---|"]
    what = {"choice": "other option orders", "noul": "false/true wording swapped", "score": "levels reversed"}
    for t in TYPES:
        b = probe["per_type"].get(t) or {}
        if not b.get("applicable", True) or "flip_rate" not in b:
            continue
        votes = b.get("votes") if isinstance(b.get("votes"), dict) else {}  # noul/score: a note, votes are choice-only
        rows = [(1, b)] + sorted(((int(n), v) for n, v in votes.items()), key=lambda x: x[0])
        for n, v in rows:
            lines.append(f"| {t} | {what[t]} | {n} | {v['n_rows']} | {v['n_cases']} | {v['n_comparisons']} | "
                         f"{v['flip_rate']:.3f} {_ci(v.get('flip_rate95'))} | {v['mean_tv']:.4f} |")
    kinds = probe["per_type"]["choice"].get("by_kind") or {}
    if kinds:
        lines += ["", "choice by kind of order (flip rate, votes 1 -> 2 -> 3; the reversal is one of the two voted "
                  "orders at N = 2, so its voted flip rate is 0 by construction; read 'other'):", ""]
        lines += ["| kind | comparisons | votes 1 | votes 2 | votes 3 |", "|---|---|---|---|---|"]
        votes = probe["per_type"]["choice"].get("votes") or {}
        for kind, v in kinds.items():
            vv = [votes.get(str(n), {}).get("by_kind", {}).get(kind, {}).get("flip_rate") for n in (2, 3)]
            lines.append(f"| {kind} | {v['n_comparisons']} | {v['flip_rate']:.3f} | "
                         + " | ".join("—" if x is None else f"{x:.3f}" for x in vv) + " |")
    return lines


def remote_row(name: str, ev: dict) -> str:
    r, c = ev["raw"]["overall"], ev["calibrated"]["overall"]
    m = ev["meta"].get("remote", {})
    gap = c.get("posterior", {}).get("bayes_gap")
    return (f"| {name} | {m.get('model', '—')} | {m.get('order_votes', 1)} | {m.get('rows_scored', '—')} / "
            f"{m.get('rows_read', '—')} | {r['accuracy']:.4f} | {r['nll']:.4f} | {c['nll']:.4f} | {c['ece']:.4f} | "
            f"{'—' if gap is None else f'{gap:.4f}'} | {m.get('seconds', '—')} |")


def compare_row(name: str, d: dict) -> str:
    return (f"| {name} | {d['metric']} | {d.get('type') or 'all'} | {d['n']} | {d['mean_a']:.4f} | {d['mean_b']:.4f} | "
            f"{d['mean_diff']:+.4f} [{d['ci_low']:+.4f}, {d['ci_high']:+.4f}] |")


def main(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    out = ["# Issue 46 on the real-weights benchmark (data seed 1, SmolLM2-135M, the matched control)", ""]
    probe_path = src / "probe" / "control.json"
    if probe_path.is_file():
        probe = json.loads(probe_path.read_text())
        slim = {k: v for k, v in probe.items() if k not in ("rows",)}
        (dst / "probe-control.json").write_text(json.dumps(slim, indent=1) + "\n")
        out += ["## Order probe (test split, `rlcd probe order runs/rw6/control --order-votes 1,2,3`)", ""]
        out += [f"Probed checkpoint: sha256 {str(probe.get('checkpoint_sha256'))[:12]}.", ""]
        out += probe_table(probe)
        out += ["", f"Not probed: {len(probe.get('not_probed') or [])} noul questions without both descriptions.", ""]
    evs = {}
    for name in ("remote-control", "remote-control-votes2", "remote-any2jev"):
        p = src / name / "eval" / "evaluation.json"
        if p.is_file():
            ev = json.loads(p.read_text())
            evs[name] = ev
            keep = {"raw": {"overall": ev["raw"]["overall"], "per_type": ev["raw"]["per_type"]},
                    "calibrated": {"overall": ev["calibrated"]["overall"], "per_type": ev["calibrated"]["per_type"]},
                    "temperatures": ev.get("temperatures"), "meta": ev["meta"]}
            for block in (keep["raw"], keep["calibrated"]):
                for sub in [block["overall"], *block["per_type"].values()]:
                    for k in ("reliability",):
                        sub.pop(k, None)
                        (sub.get("posterior") or {}).pop(k, None)
            (dst / f"{name}.json").write_text(json.dumps(keep, indent=1) + "\n")
    if evs:
        out += ["## Remote evaluations (`rlcd evaluate --remote`, test split; temperatures fitted on the remote's "
                "calibration answers)", "",
                "| system | model | order votes | rows scored / read | accuracy | NLL raw | NLL cal | ECE cal | "
                "gap to Bayes (cal) | seconds |", "|---|---|---|---|---|---|---|---|---|---|"]
        out += [remote_row(n, ev) for n, ev in evs.items()]
        out.append("")
    cmps = sorted(src.glob("compare-votes1-vs-votes2-*.json")) + sorted(src.glob("compare-local-vs-remote-control-*.json")) \
        + sorted(src.glob("compare-control-vs-any2jev-*.json"))
    if cmps:
        out += ["## Paired comparisons by case (B - A, calibrated, 95% percentile bootstrap over cases)", "",
                "| A vs B | metric | type | rows | A | B | B - A [95% CI] |", "|---|---|---|---|---|---|---|"]
        for p in cmps:
            shutil.copy(p, dst / p.name)
            d = json.loads(p.read_text())
            pair = p.stem.removeprefix("compare-").rsplit("-", 2 if d.get("type") else 1)[0]
            out.append(compare_row(pair, d))
        out.append("")
    text = "\n".join(out) + "\n"
    (dst / "tables.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
