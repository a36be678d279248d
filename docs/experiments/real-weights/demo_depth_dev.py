"""Issue 71: two demo runs compared on the dev rows they share (paired by row, cases resampled): raw and calibrated
KL(posterior || model) per row, i.e. the NLL gap to the Bayes floor, from each run's eval/predictions-dev.jsonl and
its own temperatures. The test split is not read. Prints one JSON object.

    python docs/experiments/real-weights/demo_depth_dev.py RUN_A RUN_B
"""
import json
import sys
from pathlib import Path

import numpy as np


def gaps(run: Path) -> dict[str, tuple[str, float, float]]:
    temps = json.loads((run / "eval" / "evaluation.json").read_text())["temperatures"]
    out = {}
    for line in (run / "eval" / "predictions-dev.jsonl").read_text().splitlines():
        r = json.loads(line)
        p, z = np.asarray(r["posterior"], float), np.asarray(r["logits"], float)
        kl = []
        for t in (1.0, float(temps[r["type"]])):
            q = z / t - np.logaddexp.reduce(z / t)
            kl.append(float(np.sum(np.where(p > 0, p * (np.log(np.where(p > 0, p, 1)) - q), 0.0))))
        out[r["id"]] = (r["id"].split(":")[0], *kl)
    return out


a, b = (gaps(Path(x)) for x in sys.argv[1:3])
shared = sorted(set(a) & set(b))
cases = sorted({a[i][0] for i in shared})
rng = np.random.default_rng(0)
res = {"a": sys.argv[1], "b": sys.argv[2], "rows": len(shared), "cases": len(cases)}
for k, name in ((1, "raw"), (2, "calibrated")):
    d = {c: [] for c in cases}
    for i in shared:
        d[a[i][0]].append(b[i][k] - a[i][k])
    sums = np.array([sum(d[c]) for c in cases]); counts = np.array([len(d[c]) for c in cases])
    boots = [(sums[j].sum() / counts[j].sum()) for j in (rng.integers(0, len(cases), len(cases)) for _ in range(2000))]
    res[name] = {"a": float(np.mean([a[i][k] for i in shared])), "b": float(np.mean([b[i][k] for i in shared])),
                 "b_minus_a": float(sums.sum() / counts.sum()), "ci95": [float(np.quantile(boots, .025)),
                                                                        float(np.quantile(boots, .975))]}
print(json.dumps(res))
