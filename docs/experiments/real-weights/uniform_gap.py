"""The uniform answer's gap to the Bayes floor on a processed data dir's split (what `uniform_gap` in
evaluation.json reports for that split), overall and per type, as one JSON line.

    python docs/experiments/real-weights/uniform_gap.py runs/rw3/processed test
"""
import json
import sys

from rlcd.data.io import load_split
from rlcd.metrics import summarize

data, split = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "test"
rows = [{"id": r.id, "group": r.group, "type": r.question.type, "target": list(r.target),
         "posterior": r.posterior, "logits": [0.0] * len(r.target)} for r in load_split(data, split)]
s = summarize(rows)
out = {"data": data, "split": split, "n": s["overall"]["posterior"]["n"],
       "uniform_gap": s["overall"]["posterior"]["uniform_gap"],
       "per_type": {t: b["posterior"]["uniform_gap"] for t, b in s["per_type"].items()}}
print(json.dumps(out))
