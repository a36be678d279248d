"""onnxruntime's thread spinning on the portable export: the same cold requests scored by `PortableModel` at 1 thread,
at N threads with spinning off (rlcd's default) and at N threads with spinning on (onnxruntime's default), the three
taking turns (order alternating by round), in one process. Prints and writes the p50s.

    python benchmarks/onnx_spinning.py EXPORT_DIR [--threads 2] [--rounds 7] [--questions 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("export", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--questions", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from rlcd.bench.serve import synthetic_questions, synthetic_state
    from rlcd.portable.runtime import PortableModel
    from rlcd.schema import Question

    models = {"1 thread": PortableModel(args.export, threads=1),
              f"{args.threads} threads, spinning off": PortableModel(args.export, threads=args.threads),
              f"{args.threads} threads, spinning on": PortableModel(args.export, threads=args.threads, spin=True)}
    rng = random.Random(0)
    ms: dict[str, list[float]] = {k: [] for k in models}
    for r in range(args.rounds + 1):  # round 0 warms up
        qs = synthetic_questions(args.questions, rng)
        state, questions = synthetic_state(rng), [Question.model_validate(q) for q in qs.values()]
        for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
            case = models[name].prepare_case(state, questions, None, list(qs))
            t0 = time.perf_counter()
            models[name].score_cases([case])
            if r:
                ms[name].append(1000 * (time.perf_counter() - t0))
    result = {"export": str(args.export), "questions": args.questions, "rounds": args.rounds,
              "load_average": os.getloadavg(), "cpus": os.cpu_count(),
              "p50_ms": {k: statistics.median(v) for k, v in ms.items()}, "ms": ms}
    for k, v in result["p50_ms"].items():
        print(f"{k:<28} p50 {v:7.0f} ms")
    if args.json:
        from rlcd.bench.report import save_result

        save_result("onnx-spinning", "python benchmarks/onnx_spinning.py " + " ".join(
            sys.argv[1:]), result, path=args.json)


if __name__ == "__main__":
    main()
