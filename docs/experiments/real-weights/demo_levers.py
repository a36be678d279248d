"""Probe: head-only recipe variants at demo scale, on the demo's cached SmolLM2 features (one seed each).

Trains the demo's text run (`demo_recipe()` plus `key=value` recipe overrides) on a demo's processed data
(its `features/` already built by `make demo`), evaluates without export, and prints one JSON line:
accuracy, majority, raw and calibrated gap to the Bayes floor (overall and per type), temperatures.

    rlcd demo --out /tmp/demoF                      # builds /tmp/demoF/text/processed/features
    python docs/experiments/real-weights/demo_levers.py base /tmp/demoF/text/processed
    python docs/experiments/real-weights/demo_levers.py ce /tmp/demoF/text/processed objective=ce
"""
import json
import shutil
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
from rlcd.demo import demo_recipe  # noqa: E402
from rlcd.evaluate import evaluate_run  # noqa: E402
from rlcd.recipe import coerce_value  # noqa: E402
from rlcd.train import train  # noqa: E402

name, data = sys.argv[1], Path(sys.argv[2])
kw = {k: coerce_value(k, v) for k, v in (a.split("=", 1) for a in sys.argv[3:])}
recipe = demo_recipe(kw.pop("steps", 600)).with_(**kw)
run = Path("/tmp/demo-levers") / name
shutil.rmtree(run, ignore_errors=True)
t0 = time.perf_counter()
train(run, data_dir=data, model="smollm2-135m", recipe=recipe, progress=False)
ev = evaluate_run(run, progress=False, export=False, print_fn=lambda s: None)
cal, raw = ev["calibrated"], ev["raw"]
print("PROBE", json.dumps({
    "name": name, "overrides": {k: str(v) for k, v in kw.items()}, "steps": recipe.steps,
    "acc": raw["overall"]["accuracy"], "maj": ev["majority_baseline"]["accuracy"],
    "gap_raw": raw["overall"]["posterior"]["bayes_gap"], "gap_cal": cal["overall"]["posterior"]["bayes_gap"],
    "T": ev["temperatures"],
    "by_type_cal": {t: v["posterior"]["bayes_gap"] for t, v in cal["per_type"].items()},
    "wall": time.perf_counter() - t0}), flush=True)
