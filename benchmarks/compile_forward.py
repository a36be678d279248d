"""Would torch.compile buy the batch job its 1.1x (issue 73)? One decoder forward of the demo's shape (SmolLM2-135M
cut to its first 20 layers, one state of TOKENS tokens, one thread, float32), plain against `torch.compile`
(inductor, static shape), interleaved for ROUNDS rounds after one compile; medians without the first round.

    .venv/bin/python benchmarks/compile_forward.py TOKENS ROUNDS OUT.json
"""
import os, statistics, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import torch

torch.set_num_threads(1)
from rlcd.bench.report import machine_info, save_result
from rlcd.model.backbone import load_backbone

tokens, rounds, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
m = load_backbone("smollm2-135m").model.eval()
base = getattr(m, "model", m)
base.layers = base.layers[:20]  # the demo reads the state after layer 20
ids = torch.randint(100, m.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
load_before = list(os.getloadavg())


def plain(x):
    return base(input_ids=x).last_hidden_state


compiled = torch.compile(plain, dynamic=False)
with torch.inference_mode():
    t = time.perf_counter()
    ref = compiled(ids)
    compile_s = time.perf_counter() - t
    diff = float((ref - plain(ids)).abs().max())
    ts = {"plain": [], "compiled": []}
    for r in range(rounds):
        for k, fn in ((("plain", plain), ("compiled", compiled)) if r % 2 == 0 else
                      (("compiled", compiled), ("plain", plain))):
            t = time.perf_counter()
            fn(ids)
            ts[k].append(time.perf_counter() - t)
med = {k: statistics.median(v[1:]) for k, v in ts.items()}
res = {"tokens": tokens, "layers": 20, "rounds": rounds, "threads": 1, "dtype": "float32", "compile_s": compile_s,
       "max_abs_diff": diff, "median_s": med, "speedup": med["plain"] / med["compiled"],
       "loadavg_before": load_before, "loadavg_after": list(os.getloadavg()), "samples_s": ts}
save_result("compile-forward", f"python benchmarks/compile_forward.py {tokens} {rounds} {out}", res, path=out,
            machine=machine_info())
print({k: v for k, v in res.items() if k != "samples_s"})
