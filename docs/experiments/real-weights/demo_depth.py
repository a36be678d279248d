"""Issue 71: which SmolLM2-135M depth should the demo read? Its text configuration (canonical synth cases, head only,
CE, bf16 extraction, `demo_recipe`) with `--recipe backbone_layers=L` (the first L of 30 decoder layers, then the
final norm), chosen on dev: best dev NLL (the checkpoint the run keeps) and the extraction's seconds. One JSON line per
L, appended to OUT as each finishes. The test split is not read.

    python docs/experiments/real-weights/demo_depth.py CASES WORK OUT L [L ...]
"""
import dataclasses
import json
import sys
import time
from pathlib import Path

from rlcd.demo import DEMO_MODEL, demo_data, demo_placement, demo_recipe
from rlcd.train import train

cases, work, out = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
data = work / "processed"
if not (data / "manifest.json").is_file():
    demo_data(work, seed=0, n_cases=cases)
placement = demo_placement()
for L in [int(x) for x in sys.argv[4:]]:
    recipe = dataclasses.replace(demo_recipe(), backbone_layers=L if L < 30 else None)
    t0 = time.perf_counter()
    state = train(work / f"run-L{L}", data_dir=data, model=DEMO_MODEL, recipe=recipe, device=placement.device,
                  dtype=placement.dtype, progress=False, print_fn=lambda _: None)
    wall = time.perf_counter() - t0
    feats = [json.loads(p.read_text()) for p in (data / "features").glob("*/manifest.json")]
    seconds = {m["key"].get("backbone", {}).get("config_hash", "")[:8]: m.get("seconds") for m in feats}
    evals = [json.loads(x) for x in (work / f"run-L{L}" / "metrics.jsonl").read_text().splitlines()]
    dev = [e for e in evals if e.get("kind") == "eval" or "dev_nll" in e]
    row = {"cases": cases, "layers": L, "wall_s": round(wall, 1), "dtype": placement.dtype,
           "best_step": state.get("best_step"), "best_dev": state.get("best_score"),
           "extraction_seconds_by_config": seconds, "dev_curve": dev}
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps({k: v for k, v in row.items() if k != "dev_curve"}), flush=True)
