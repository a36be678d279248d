"""The state cache on SmolLM2-135M (real weights, random head), 1 thread: one question about a new state with
the cache off and on, then a new question about that (now cached) state, and the same question cold; per
call [wall ms, CPU ms, input tokens]. CPU time is printed because on a shared machine the wall time
measures the other jobs too; `rlcd bench serve RUN --state-cache` is the full, interleaved benchmark.

    PYTHONPATH=src OMP_NUM_THREADS=1 nice -n 10 python benchmarks/state_cache_smollm2.py
"""
import time, json
import torch
torch.set_num_threads(1)
from rlcd.model.build import build_model
from rlcd.predict import Predictor
from rlcd.bench.prefix import make_state
from rlcd.bench.pipeline import request_of
m = build_model({"model": "smollm2-135m", "model_seed": 0, "recipe": {}}); m.merge(); m.eval()
meta = {"model": "smollm2-135m", "temperatures": {"choice": 1.0, "noul": 1.0, "score": 1.0}}
on, off = Predictor(m, meta, state_cache_mb=1024), Predictor(m, meta, state_cache_mb=0)
qs = request_of("x", 5, 0)["questions"]
def t(p, st, q):
    w, c = time.perf_counter(), time.process_time()
    out = p.predict({"state": st, "questions": {q: qs[q]}})
    return round(1000 * (time.perf_counter() - w)), round(1000 * (time.process_time() - c)), out["usage"]["input_tokens"]
print("loaded", flush=True)
for r in range(3):
    a = t(off, make_state(m.tokenizer, 250, 100 + r), "q0")
    s = make_state(m.tokenizer, 250, 200 + r)
    b = t(on, s, "q0")
    c = t(on, s, "q1")
    d = t(off, s, "q1")
    print(json.dumps({"round": r, "cold_off": a, "cold_on": b, "warm": c, "same_q_cold_off": d}), flush=True)
print("stats", on.state_cache_stats(), flush=True)
