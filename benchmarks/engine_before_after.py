"""Issue 72's no-regression check: the serving, state-cache and cut benches on two source trees (before and after
the engine moved out of `DecisionModel`), interleaved A B B A per round so the machine's drift hits both alike; the
after/before ratio of each metric's median over rounds. One JSON; the load average before and after.

    python benchmarks/engine_before_after.py BEFORE_SRC AFTER_SRC TEXT_RUN IMAGE_RUN --rounds 2 --json OUT

TEXT_RUN: a SmolLM2 run (`rlcd demo`'s text/run) for the state-cache bench; IMAGE_RUN: a tiny VLM run (the demo's
image/run) for the serve load bench (its plan asks image questions); the cut bench builds its own SmolLM2 data.
Each bench is the `rlcd bench` command itself, run with PYTHONPATH set to one tree's src/.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("before"); ap.add_argument("after"); ap.add_argument("text_run"); ap.add_argument("image_run")
ap.add_argument("--rounds", type=int, default=2); ap.add_argument("--json", required=True)
a = ap.parse_args()
rlcd = [str(Path(sys.executable).parent / "rlcd")]
BENCHES = {
    "state_cache": ["bench", "serve", a.text_run, "--state-cache", "--threads", "1", "--repeats", "2",
                    "--dtype", "float32"],
    "serve": ["bench", "serve", a.image_run, "--levels", "1,4", "--requests", "24"],
    "cut": ["bench", "cut", "--model", "smollm2-135m", "--ks", "2", "--cases", "4", "--updates", "4",
            "--all-updates", "1", "--threads", "1"],
}


def metrics(name, d):
    r = d.get("results", d)
    if name == "state_cache":
        return {f"p50_ms.{k}": v for k, v in r["p50_ms"]["1"].items()}
    if name == "serve":
        out = {}
        for mode, levels in r["modes"].items():
            for c, s in levels.items():
                out[f"{mode}.c{c}.decisions_per_s"] = s["decisions_per_s"]
                out[f"{mode}.c{c}.p50_ms_1"] = s["p50_ms_1"]
        return out
    k = r["per_k"]["2"]
    return {"row.examples_per_s": k["row"]["examples_per_s"], "case.examples_per_s": k["case"]["examples_per_s"],
            "extraction.row_tokens_per_s": k["row_tokens_per_s"]}


runs = {t: {b: [] for b in BENCHES} for t in ("before", "after")}
load = {"start": os.getloadavg()}
with tempfile.TemporaryDirectory() as tmp:
    for rnd in range(a.rounds):
        for name, args in BENCHES.items():
            order = ("before", "after", "after", "before")[2 * (rnd % 2): 2 * (rnd % 2) + 2]
            for tree in order:
                out = Path(tmp) / f"{name}-{tree}-{rnd}.json"
                env = {**os.environ, "PYTHONPATH": str(Path(getattr(a, tree)) / "src"), "PYTHONHASHSEED": "0"}
                t0 = time.perf_counter()
                p = subprocess.run(rlcd + args + ["--json", str(out)], env=env, capture_output=True, text=True)
                if p.returncode != 0 or not out.is_file():
                    sys.exit(f"{name} on {tree} failed ({p.returncode}): {p.stderr[-800:]}")
                runs[tree][name].append(metrics(name, json.loads(out.read_text())))
                print(f"round {rnd + 1} {name:<11} {tree:<6} {time.perf_counter() - t0:6.1f} s", flush=True)
load["end"] = os.getloadavg()
ratios = {}
for name in BENCHES:
    for key in runs["before"][name][0]:
        b = statistics.median(m[key] for m in runs["before"][name])
        f = statistics.median(m[key] for m in runs["after"][name])
        ratios[f"{name}.{key}"] = {"before": b, "after": f, "after_over_before": f / b if b else None}
from rlcd.bench.report import result_record  # the bench JSON every `rlcd bench` writes (machine, time, git)

command = " ".join(["python", "benchmarks/engine_before_after.py", *sys.argv[1:]])
results = {"before": a.before, "after": a.after, "rounds": a.rounds, "order": "ABBA per bench and round",
           "load_average": load, "ratios": ratios, "runs": runs}
Path(a.json).write_text(json.dumps(result_record("engine-before-after", command, results), indent=2) + "\n")
for k, v in ratios.items():
    print(f"{k:<45} before {v['before']:10.2f}  after {v['after']:10.2f}  after/before {v['after_over_before']:.3f}")
