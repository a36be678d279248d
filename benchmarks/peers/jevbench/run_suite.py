"""Run a JevBench suite against a System One server and write a summary JSON (+ the full report, gzipped).

Runs in the JevBench venv (`setup.sh`; jevbench and httpx only), called by `run.sh` once `rlcd serve` is ready:

    python run_suite.py --url http://127.0.0.1:PORT --name NAME --suite jevbench-mini --out OUT.json \
        [--serve-options "..."] [--run RUN]

`--domains`, `--relations`, `--groups` select part of the suite (JevBench's own selection; the overall score is
reported only when all five dimensions ran). OUT.json holds what the server says it is (`/v1/models`), the settings, and JevBench's scores: overall, per
dimension (pillars), group and relation (the share of a relation's tests that pass), with the bootstrap intervals
JevBench computes. OUT.report.json.gz is JevBench's own report (`Report.save`), every outcome included, which
`jevbench report` reads.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx
import jevbench as jb
from importlib.metadata import version

# the relations a server can make hold exactly by answering one canonical form of each question (docs/SERVING.md)
EXACT = ("option_permutation", "clone_symmetry", "option_clone", "noul_as_choice", "noul_as_score")


def by_type(outcomes: list[dict], relation: str) -> dict[str, dict]:
    """Pass rate of `relation`'s outcomes per type of the question tested (option_permutation permutes a choice's
    options but reverses a score's levels: only the first is the same question by construction)."""
    import jevbench

    types = {}
    for line in (Path(jevbench.__file__).parent / "suites" / "jevbench-240" / "cases.jsonl").open():
        case = json.loads(line)
        types.update({(case["id"], k): q["type"] for k, q in case["questions"].items()})
    out: dict[str, dict] = {}
    for o in outcomes:
        if o.get("relation") != relation:
            continue
        t = out.setdefault(types.get((o["case_id"], o["targets"][0]), "?"), {"n": 0, "passed": 0, "max_deviation": 0.0})
        t["n"] += 1
        t["passed"] += not o["violated"]
        t["max_deviation"] = max(t["max_deviation"], float(o["deviation"]))
    return out


def add_by_type(summary_path: Path) -> None:
    """Add `option_permutation_by_type` to a summary from its saved report (OUT.report.json.gz)."""
    import gzip

    report = json.load(gzip.open(summary_path.with_name(summary_path.stem + ".report.json.gz"), "rt"))
    summary = json.loads(summary_path.read_text())
    summary["option_permutation_by_type"] = by_type(report["result"]["outcomes"], "option_permutation")
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", help="the server's base URL (http://127.0.0.1:PORT)")
    ap.add_argument("--name", help="the model's name in the report (and the `model` field sent)")
    ap.add_argument("--add-by-type", type=Path, help="only add option_permutation_by_type to this summary, from "
                                                     "its saved report")
    ap.add_argument("--suite", default="jevbench-mini")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--serve-options", default="")
    ap.add_argument("--run", default="")
    ap.add_argument("--domains", default="", help="comma-separated domains (cases); default: all")
    ap.add_argument("--relations", default="", help="comma-separated relations; with --groups their union; "
                                                    "default: every scored relation (the overall score)")
    ap.add_argument("--groups", default="", help="comma-separated groups, e.g. BAT.isolation")
    args = ap.parse_args()
    if args.add_by_type:
        add_by_type(args.add_by_type)
        return
    pick = {k: [x for x in getattr(args, k).split(",") if x] or None for k in ("domains", "relations", "groups")}

    models = httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]
    model = jb.systemone(f"{args.url}/v1/systemone", model=args.name, timeout=600)
    start = time.time()
    report = jb.evaluate(model, suite=args.suite, name=args.name, cache=None, **pick)
    wall = time.time() - start
    s = report.scores
    summary = {
        "name": args.name,
        "suite": args.suite,
        "selection": pick,
        "jevbench": version("jevbench"),
        "run": args.run,
        "serve_options": args.serve_options,
        "server": {k: models.get(k) for k in ("id", "backbone", "canonical_requests", "order_votes", "vote_combine",
                                              "row_cache_mb", "temperatures", "checkpoint_sha256", "placement")},
        "requests": report.result.get("requests"),
        "errors": len(report.result.get("errors") or []),
        "wall_seconds": round(wall, 1),
        "overall": s["overall"],
        "overall_ci95": s["ci"].get("overall"),
        "pillars": s["pillars"],
        "groups": s["groups"],
        "relations": s["relations"],
        "graded_relations": s["graded"]["relations"],
        "exact_relations": {r: s["relations"].get(r) for r in EXACT},
        "option_permutation_by_type": by_type(report.result["outcomes"], "option_permutation"),
        "n_cases": s["n_cases"],
        "tolerance": s["tolerance"],
        "incomplete": s["incomplete"],
        "excluded": s["excluded"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    report.save(args.out.with_name(args.out.stem + ".report.json.gz"))
    print(report.table("dimension"))
    print(json.dumps({"overall": s["overall"], "exact": summary["exact_relations"],
                      "BAT.isolation": s["groups"].get("BAT.isolation"), "wall_seconds": summary["wall_seconds"]}))


if __name__ == "__main__":
    main()
