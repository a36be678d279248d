"""Interleaved A/B of one cold question (issue 58), 1 torch thread, wall and process CPU time per call, medians:
off = state cache off (one full forward); on = cache on (a full forward that keeps its cache, the state stored from
it uncopied); on_prefix = cache on, forced onto the prefix path (two calls: what a cold question ran before issue 58,
less the state copy it then made). The arms run in turn, their order rotating each round. CPU time is what
to read on a shared machine (wall time counts other jobs).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/state_cache_cold_ab.py REPEATS OUT.json [RUN]
"""
import json, statistics, sys, time
import torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "src"))
from rlcd.predict import Predictor
from rlcd.serving.cache import StateCache
from rlcd.bench.pipeline import request_of
from rlcd.bench.prefix import make_state

torch.set_num_threads(1)
base = Predictor.from_run(sys.argv[3] if len(sys.argv) > 3 else "/work/main/runs/demo/text/run", state_cache_mb=0)
model = base.runner
q = request_of("x", 1, 0)["questions"]
cache = StateCache(1 << 30)
res = {k: {"wall": [], "cpu": []} for k in ("off", "on", "on_prefix")}
n = [0]
def case():
    n[0] += 1
    return base.prepare({"state": make_state(model.model.tokenizer, 250, n[0]), "questions": q}).case
runs = {"off": lambda c: model.score_cases([c]),
        "on": lambda c: model.score_cases([c], state_cache=cache.scoped("a")),
        "on_prefix": lambda c: model.score_cases([c], state_cache=cache.scoped("b"), path="prefix")}
for r in range(int(sys.argv[1]) + 1):
    names = list(runs)
    for k in names[r % 3:] + names[: r % 3]:  # the order rotates each round: no arm always follows another
        fn = runs[k]
        c = case()
        w0, c0 = time.perf_counter(), time.process_time()
        (_, usage), = fn(c)
        w1, c1 = time.perf_counter(), time.process_time()
        if r:
            res[k]["wall"].append(1000 * (w1 - w0)); res[k]["cpu"].append(1000 * (c1 - c0))
        if r == 1:
            print(k, usage["path"], usage["calls"], file=sys.stderr)
out = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in res.items()}
out["ratios"] = {f"{k}_over_off": {m: out[k][m] / out["off"][m] for m in ("wall", "cpu")} for k in ("on", "on_prefix")}
out["samples"] = res
print(json.dumps({k: v for k, v in out.items() if k != "samples"}, indent=1))
from rlcd.bench.report import save_result

out["repeats"], out["threads"] = int(sys.argv[1]), 1
save_result("state-cache-cold-ab", "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/state_cache_cold_ab.py "
            + " ".join(sys.argv[1:]), out, path=sys.argv[2])
