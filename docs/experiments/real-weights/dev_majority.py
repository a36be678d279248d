"""Majority-baseline dev macro accuracy on the dev subsets the runs select on (dev_cap 16 and 64).

    PYTHONPATH=src python docs/experiments/real-weights/dev_majority.py runs/rw/smollm2-rlcd runs/rw/check-tiny-demo

For each run directory: the dev rows of its samples.json, scored by `rlcd.metrics.majority_baseline`
trained on the run's training split; prints the group-macro accuracy (what `dev_macro_accuracy` is).
"""

import json
import sys
from pathlib import Path

from rlcd.data.io import load_split
from rlcd.metrics import majority_baseline

for run in map(Path, sys.argv[1:]):
    config = json.loads((run / "config.json").read_text())
    samples = json.loads((run / "samples.json").read_text())
    data = Path(config["data_dir"])
    dev = {r.id: r for r in load_split(data, "dev")}
    rows = [dev[i] for ids in samples["dev"].values() for i in ids]
    mb = majority_baseline(load_split(data, "train"), rows)
    print(f"{run}: dev_cap {config['recipe']['dev_cap']}, {len(rows)} rows, majority group-macro "
          f"{mb['group_macro_accuracy']:.3f}")
