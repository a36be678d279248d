"""Probe: how the demo's calibrated gap moves with the number of training rows, on one demo's cached features.

Retrains the demo's text head (`demo_recipe()`, bf16 features where the demo used them) on a finished demo's
processed data with `pool_cap=N` (at most N training rows per sampling group, the sampler's sha256 order: the
same cache, fewer rows), calibrates and evaluates without export, and prints one JSON line: training rows,
accuracy, majority, raw and calibrated gap with its 95% interval, the uniform answer's gap, temperatures.

    rlcd demo --out /tmp/demoT240 --cases 240       # builds the cache
    python docs/experiments/real-weights/demo_scale_sizes.py /tmp/demoT240/text/processed 110 [key=value ...]
"""
import json
import resource
import shutil
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
from rlcd.data.io import read_jsonl  # noqa: E402
from rlcd.demo import demo_placement, demo_recipe  # noqa: E402
from rlcd.evaluate import evaluate_run  # noqa: E402
from rlcd.recipe import coerce_value  # noqa: E402
from rlcd.train import train  # noqa: E402
from rlcd.uncertainty import bayes_gap_interval  # noqa: E402

data, cap = Path(sys.argv[1]), int(sys.argv[2])
kw = {k: coerce_value(k, v) for k, v in (a.split("=", 1) for a in sys.argv[3:])}
recipe = demo_recipe(kw.pop("steps", 600)).with_(pool_cap=cap, **kw)
where = demo_placement()
run = Path("/tmp/demo-sizes") / f"cap{cap}-{'-'.join(f'{k}{v}' for k, v in kw.items())}"
shutil.rmtree(run, ignore_errors=True)
t0 = time.perf_counter()
train(run, data_dir=data, model="smollm2-135m", recipe=recipe, progress=False, device=where.device, dtype=where.dtype,
      print_fn=lambda s: None)
ev = evaluate_run(run, placement=where, progress=False, export=False, print_fn=lambda s: None)
cal, raw = ev["calibrated"], ev["raw"]
rows = [r for _, r in read_jsonl(run / "eval" / "predictions-test.jsonl")]
g = bayes_gap_interval(rows, ev["temperatures"])
samples = json.loads((run / "samples.json").read_text())
ru = resource.getrusage(resource.RUSAGE_SELF)
print("SIZE", json.dumps({
    "pool_cap": cap, "overrides": {k: str(v) for k, v in kw.items()}, "steps": recipe.steps,
    "train_rows": sum(len(v) for v in samples["train"].values()), "test_rows": g["n"],
    "acc": raw["overall"]["accuracy"], "maj": ev["majority_baseline"]["accuracy"],
    "gap_raw": raw["overall"]["posterior"]["bayes_gap"], "gap_cal": g["gap"], "gap_cal_ci95": g["ci95"],
    "uniform_gap": g["uniform_gap"], "T": ev["temperatures"],
    "by_type_cal": {t: v["posterior"]["bayes_gap"] for t, v in cal["per_type"].items()},
    "wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(ru.ru_utime + ru.ru_stime, 1),
    "loadavg": open("/proc/loadavg").read().split()[:3]}), flush=True)
