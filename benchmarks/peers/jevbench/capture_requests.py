"""Write every request a JevBench selection sends, without a server: the suite answered by JevBench's own
`FakeCoherent` backend (in the JevBench venv, `setup.sh`).

    python capture_requests.py --out requests.jsonl [--suite jevbench-mini] [--domains a,b] [--relations r,s]
        [--groups G]

Each line is one request body as `SystemOneHTTP` sends it (`{"state", "questions"}`, a noul's null criteria
dropped), in the order a sequential run (one request in flight, no request cache) sends them. What a request asks
(its state and questions) does not depend on the answers for the relations of jevbench 0.1.0 run without
`minimize`, so these are the requests `run_suite.py` sends a real server; `request_cost.py` (rlcd's venv) reads
them to count and time what they cost.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jevbench as jb
from jevbench.backends import FakeCoherent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--suite", default="jevbench-mini")
    for name in ("domains", "relations", "groups"):
        ap.add_argument(f"--{name}", default="", help="comma-separated; default: all (as run_suite.py)")
    args = ap.parse_args()
    pick = {k: [x for x in getattr(args, k).split(",") if x] or None for k in ("domains", "relations", "groups")}
    fake, sent = FakeCoherent(), []

    def answer(state, questions):
        wire = {k: {f: v for f, v in q.items() if not (f == "criteria" and v is None)} for k, q in questions.items()}
        sent.append({"state": state, "questions": wire})
        return fake.ask(state, questions)

    report = jb.evaluate(jb.from_callable(answer), suite=args.suite, cache=None, **pick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for r in sent:
            f.write(json.dumps(r) + "\n")
    print(json.dumps({"requests": len(sent), "reported_requests": report.result.get("requests"),
                      "questions": sum(len(r["questions"]) for r in sent),
                      "states": len({json.dumps(r["state"], sort_keys=True) for r in sent}), "out": str(args.out)}))


if __name__ == "__main__":
    main()
