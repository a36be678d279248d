"""The demo's text stage with and without top-layer LoRA (issue 34): same data, same head-only start.

PYTHONPATH=src python docs/experiments/real-weights/demo_top_layers.py OUT [K] [STEPS]

1. `rlcd demo`'s data and head-only run (`rlcd.demo.demo_data`, `demo_recipe`), evaluated: today's demo;
2. from its head (`--init`), LoRA on the top K layers over the cut-state cache, batch_by case, STEPS updates of
   32 at the demo's head LR, evaluated the same way.
Prints each stage's wall seconds and `learning_line`, and writes OUT/demo-top-layers.json.
"""

import json
import sys
import time
from pathlib import Path

from rlcd.demo import DEMO_MODEL, demo_data, demo_recipe, learning_line
from rlcd.evaluate import evaluate_run
from rlcd.train import train

out = Path(sys.argv[1])
k = int(sys.argv[2]) if len(sys.argv) > 2 else 2
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 100
res = {"k": k, "steps": steps}
t0 = time.perf_counter()
demo_data(out, seed=0)
data = out / "processed"
train(out / "head", data_dir=data, model=DEMO_MODEL, recipe=demo_recipe(), device="cpu", dtype="float32")
ev = evaluate_run(out / "head", progress=False)
res["head_only"] = {"seconds": time.perf_counter() - t0, "line": learning_line(ev)}
print(res["head_only"], flush=True)
t1 = time.perf_counter()
every = max(1, steps // 4)
recipe = demo_recipe().with_(head_only=False, lora_layers=k, batch_by="case", steps=steps, eval_every=every,
                             checkpoint_every=every, log_every=max(1, steps // 20), diagnostics_every=every)
train(out / "top", data_dir=data, model=DEMO_MODEL, recipe=recipe, init=out / "head", device="cpu", dtype="float32")
ev = evaluate_run(out / "top", progress=False)
res["top_layers"] = {"seconds": time.perf_counter() - t1, "total_seconds": time.perf_counter() - t0,
                     "line": learning_line(ev)}
print(res["top_layers"], flush=True)
(out / "demo-top-layers.json").write_text(json.dumps(res, indent=2) + "\n")
