"""JevBench summaries (`run_suite.py`'s JSONs) -> one bench result for benchmarks/BENCHMARKS.md.

    python benchmarks/peers/jevbench/to_bench.py [--eval RUN/eval/evaluation.json] [--name NAME] \
        benchmarks/peers/jevbench/results/demo-canonical.json benchmarks/peers/jevbench/results/demo-as-asked.json

Each arm's accuracy is its own run's (`run` in its summary: RUN/eval/evaluation.json); `--eval` is used for an arm
whose run has none on this machine. An arm with neither is refused (no accuracy, no row). Writes
benchmarks/results/NAME.json (default jevbench-demo) (`rlcd.bench.report.save_result`; then `rlcd bench report`): rlcd's arms
beside the JevBench leaderboard's published jevbench-mini scores, each with its accuracy, and the pass rate of
every relation the arms ran. rlcd's accuracy is its own evaluation's (`rlcd evaluate`, the test split, calibrated):
JevBench uses no gold answers. The two are different numbers and sit in two columns, each named for what it
measures (OWN_ACCURACY, JEV_ACCURACY). The published numbers are the ones the issue quotes and jevbench 0.1.0's README
states (uniform 89.4 at 39.8% accuracy; the models' accuracies are on the leaderboard's site, not in the package).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# jevbench-mini overall scores as published (issue 55; jevbench 0.1.0 README: "56.5 to 83.9", uniform 89.4 / 39.8%)
PUBLISHED = [("open-jev-9b", 83.9, None), ("jevany-gemma-4b", 81.2, None), ("luce", 64.9, None),
             ("laya", 56.5, None), ("uniform answer", 89.4, 0.398)]
KEY = ("option_permutation", "clone_symmetry", "option_clone", "noul_as_choice", "noul_as_score")
# columns: option_permutation split by the type tested (a choice's options permuted; a score's levels reversed)
COLUMNS = ("option_permutation (choice)", "option_permutation (score reversed)", *KEY[1:])
# JevBench's five dimensions ("pillars"), scored 0-100 like the overall when their groups ran
PILLARS = ("REP", "BAT", "MEA", "LOG", "CHO")
# two different accuracies, never under one name: rlcd's arms are scored on rlcd's own test split (JevBench items carry
# no gold answers); the leaderboard's accuracy is on JevBench's items
OWN_ACCURACY = "accuracy on rlcd's test split (calibrated)"
JEV_ACCURACY = "accuracy on JevBench items (leaderboard)"


def _score(x: float | None) -> float | None:
    return None if x is None else round(100 * x, 1)


def accuracy_of(arm: dict, fallback: Path | None) -> tuple[float, str]:
    """(accuracy, source) of an arm: its run's evaluation (calibrated, all types), else `fallback`'s."""
    for p in ([Path(arm["run"]) / "eval" / "evaluation.json"] if arm.get("run") else []) + (
            [fallback] if fallback else []):
        if p.exists():
            ev = json.loads(p.read_text())
            return ev["calibrated"]["overall"]["accuracy"], f"{p} (calibrated, {ev.get('headline_split', 'test')} split)"
    print(f"to_bench: error: {arm['name']}: no evaluation for its run {arm.get('run')!r} here; give --eval "
          "RUN/eval/evaluation.json", file=sys.stderr)
    raise SystemExit(2)


def _cells(a: dict) -> list:
    split = a.get("option_permutation_by_type") or {}
    perm = [split[t]["passed"] / split[t]["n"] if split.get(t, {}).get("n") else None for t in ("choice", "score")]
    return perm + [a["relations"].get(r) for r in KEY[1:]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("summaries", nargs="+", type=Path)
    ap.add_argument("--eval", type=Path, help="eval/evaluation.json for an arm whose run has none here")
    ap.add_argument("--name", default="jevbench-demo")
    ap.add_argument("--results-dir", type=Path, default=None, help="where NAME.json goes (default benchmarks/results)")
    args = ap.parse_args(argv)

    from rlcd.bench.report import save_result

    arms = [json.loads(p.read_text()) for p in args.summaries]
    accs = {a["name"]: accuracy_of(a, args.eval) for a in arms}
    rows = []
    for a in arms:
        pillars = a.get("pillars") or {}
        rows.append([f"rlcd {a['name']} ({a['server'].get('backbone', '?')}, "
                     f"{'canonical' if a['server'].get('canonical_requests') else 'as asked'})",
                     _score(a.get("overall")), round(accs[a["name"]][0], 4), None,
                     *(_score(pillars.get(k)) for k in PILLARS),
                     *_cells(a), a["groups"].get("BAT.isolation"), "measured here"])
    for name, score, accuracy in PUBLISHED:
        rows.append([name, score, None, accuracy, *([None] * len(PILLARS)), *([None] * len(COLUMNS)), None,
                     "leaderboard (published)"])
    relations = sorted({r for a in arms for r in a["relations"]})
    out = {
        "suite": arms[0]["suite"],
        "selection": arms[0].get("selection"),
        "requests": {a["name"]: a["requests"] for a in arms},
        "errors": {a["name"]: a["errors"] for a in arms},
        "wall_seconds": {a["name"]: a["wall_seconds"] for a in arms},
        "accuracy_source": {n: src for n, (_, src) in accs.items()},
        "table": {"columns": ["model", "JevBench overall", OWN_ACCURACY, JEV_ACCURACY, *PILLARS, *COLUMNS,
                              "BAT.isolation", "source"],
                  "rows": rows},
        "relations_table": {"columns": ["relation", *(a["name"] for a in arms)],
                            "rows": [[r, *(a["relations"].get(r) for a in arms)] for r in relations]},
        "overall_ci95": {a["name"]: a.get("overall_ci95") for a in arms},
        "pillars": {a["name"]: a.get("pillars") for a in arms},
        "groups": {a["name"]: a["groups"] for a in arms},
        "option_permutation_by_type": {a["name"]: a.get("option_permutation_by_type") for a in arms},
        "serve_options": {a["name"]: a["serve_options"] for a in arms},
    }
    cmd = ("python benchmarks/peers/jevbench/to_bench.py " + (f"--eval {args.eval} " if args.eval else "")
           + (f"--name {args.name} " if args.name != "jevbench-demo" else "")
           + " ".join(str(p) for p in args.summaries) + "  # after benchmarks/peers/jevbench/run.sh per arm")
    print(save_result(args.name, cmd, out, **({"results_dir": args.results_dir} if args.results_dir else {})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
