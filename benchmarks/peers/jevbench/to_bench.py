"""JevBench summaries (`run_suite.py`'s JSONs) -> one bench result for benchmarks/BENCHMARKS.md.

    python benchmarks/peers/jevbench/to_bench.py --eval RUN/eval/evaluation.json \
        benchmarks/peers/jevbench/results/demo-canonical.json benchmarks/peers/jevbench/results/demo-as-asked.json

Writes benchmarks/results/jevbench-demo.json (`rlcd.bench.report.save_result`; then `rlcd bench report`): rlcd's arms
beside the JevBench leaderboard's published jevbench-mini scores, each with its accuracy, and the pass rate of
every relation the arms ran. rlcd's accuracy is its own evaluation's (`rlcd evaluate`, the test split, calibrated):
JevBench uses no gold answers. The published numbers are the ones the issue quotes and jevbench 0.1.0's README
states (uniform 89.4 at 39.8% accuracy; the models' accuracies are on the leaderboard's site, not in the package).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# jevbench-mini overall scores as published (issue 55; jevbench 0.1.0 README: "56.5 to 83.9", uniform 89.4 / 39.8%)
PUBLISHED = [("open-jev-9b", 83.9, None), ("jevany-gemma-4b", 81.2, None), ("luce", 64.9, None),
             ("laya", 56.5, None), ("uniform answer", 89.4, 0.398)]
KEY = ("option_permutation", "clone_symmetry", "option_clone", "noul_as_choice", "noul_as_score")
# columns: option_permutation split by the type tested (a choice's options permuted; a score's levels reversed)
COLUMNS = ("option_permutation (choice)", "option_permutation (score reversed)", *KEY[1:])


def _cells(a: dict) -> list:
    split = a.get("option_permutation_by_type") or {}
    perm = [split[t]["passed"] / split[t]["n"] if split.get(t, {}).get("n") else None for t in ("choice", "score")]
    return perm + [a["relations"].get(r) for r in KEY[1:]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("summaries", nargs="+", type=Path)
    ap.add_argument("--eval", type=Path, required=True, help="the served run's eval/evaluation.json (its accuracy)")
    ap.add_argument("--name", default="jevbench-demo")
    args = ap.parse_args(argv)

    from rlcd.bench.report import save_result

    ev = json.loads(args.eval.read_text())
    acc = ev["calibrated"]["overall"]["accuracy"]
    arms = [json.loads(p.read_text()) for p in args.summaries]
    rows = []
    for a in arms:
        overall = a.get("overall")
        rows.append([f"rlcd {a['name']} ({'canonical' if a['server'].get('canonical_requests') else 'as asked'})",
                     None if overall is None else round(100 * overall, 1), round(acc, 4),
                     *_cells(a), a["groups"].get("BAT.isolation"),
                     "measured here"])
    for name, score, accuracy in PUBLISHED:
        rows.append([name, score, accuracy, *([None] * len(COLUMNS)), None, "leaderboard (published)"])
    relations = sorted({r for a in arms for r in a["relations"]})
    out = {
        "suite": arms[0]["suite"],
        "selection": arms[0].get("selection"),
        "requests": {a["name"]: a["requests"] for a in arms},
        "errors": {a["name"]: a["errors"] for a in arms},
        "wall_seconds": {a["name"]: a["wall_seconds"] for a in arms},
        "accuracy_source": f"{args.eval} (calibrated, {ev.get('headline_split', 'test')} split, all types)",
        "table": {"columns": ["model", "JevBench overall", "accuracy", *COLUMNS, "BAT.isolation", "source"],
                  "rows": rows},
        "relations_table": {"columns": ["relation", *(a["name"] for a in arms)],
                            "rows": [[r, *(a["relations"].get(r) for a in arms)] for r in relations]},
        "groups": {a["name"]: a["groups"] for a in arms},
        "option_permutation_by_type": {a["name"]: a.get("option_permutation_by_type") for a in arms},
        "serve_options": {a["name"]: a["serve_options"] for a in arms},
    }
    cmd = ("python benchmarks/peers/jevbench/to_bench.py --eval " + str(args.eval) + " "
           + " ".join(str(p) for p in args.summaries) + "  # after benchmarks/peers/jevbench/run.sh per arm")
    print(save_result(args.name, cmd, out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
