"""The cut states in bfloat16 against float32, on a trained run's own backbone and rows (issue 69: `Recipe.frozen_precision`).

For the first CASES cases of DATA's dev split (with a copy of DATA holding only those rows), in ABBA order over
ROUNDS rounds (float32, bfloat16, bfloat16, float32, ...), each time from an empty cache:

- `rlcd.cut_cache.ensure_cut_states` at the run's cut, float32 (compute and storage) vs bfloat16 (autocast compute,
  bfloat16 storage): extraction seconds (the manifest's), CPU seconds of the process, stored tokens per second;
- per stored token, |s_bf16 - s_fp32| / |s_fp32| (median, p99, max);
- the run's trained model (its dev-selected LoRA on the top K layers and head, not merged) scoring every dev row from
  each cache (`CutStates.logits`, the path a `lora_layers` run trains and selects on): max |dp| over rows and options,
  and the raw NLL of the soft targets, paired per row (mean difference and its 95% row-bootstrap interval).

    .venv/bin/python benchmarks/cut_precision.py RUN DATA CASES ROUNDS OUT.json
"""
import json, shutil, statistics, sys, tempfile, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import numpy as np
import torch

from rlcd.bench.report import machine_info, save_result
from rlcd.cut_cache import ensure_cut_states
from rlcd.export import load_checkpoint_model
from rlcd.features import cache_root
from rlcd.train.sources import CutStates

run, data, n_cases, rounds, out = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
lines = (data / "dev.jsonl").read_text().splitlines()
cases: list[str] = []
kept = []
for line in lines:
    case = json.loads(line)["id"].rsplit(":", 1)[0]
    if case not in cases:
        if len(cases) == n_cases:
            continue
        cases.append(case)
    kept.append(line)
work = Path(tempfile.mkdtemp(prefix="cut-precision-"))
sub = work / "data"
shutil.copytree(data, sub, ignore=shutil.ignore_patterns("features", "*.jsonl"))
(sub / "dev.jsonl").write_text("\n".join(kept) + "\n")
for split in ("train", "calibration", "test"):
    (sub / f"{split}.jsonl").write_text("")

model, config, state = load_checkpoint_model(run, "best", merge=False)
from rlcd.data.io import load_records  # noqa: E402

records = load_records(sub / "dev.jsonl")
arms = {"float32": [], "bfloat16": []}
kept_states, logits = {}, {}
for r in range(rounds):
    for prec in (["float32", "bfloat16"] if r % 2 == 0 else ["bfloat16", "float32"]):
        shutil.rmtree(cache_root(sub), ignore_errors=True)
        c0 = time.process_time()
        cache = ensure_cut_states(model, sub, progress=False, storage=prec, precision=prec)
        cpu = time.process_time() - c0
        arms[prec].append({"seconds": cache.manifest["seconds"], "cpu_s": cpu,
                           "stored_tokens": cache.manifest["stored_tokens"]})
        if r == 0:
            states = np.array(cache.maps["dev"][0])
            kept_states[prec] = (torch.from_numpy(states.view(np.int16)).view(torch.bfloat16).float()
                                 if states.dtype == np.uint16 else torch.from_numpy(states.astype(np.float32)))
            src = CutStates(cache, torch.device("cpu"), batch_by="row")
            model.eval()
            logits[prec] = src.logits(model, "dev", records)
a, b = kept_states["float32"], kept_states["bfloat16"]
rel = ((b - a).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-6)).numpy()
max_dp, d_nll = 0.0, []
for rec, la, lb in zip(records, logits["float32"], logits["bfloat16"]):
    pa, pb = torch.softmax(la.double(), -1), torch.softmax(lb.double(), -1)
    t = torch.tensor(rec.target, dtype=torch.float64)
    max_dp = max(max_dp, float((pa - pb).abs().max()))
    d_nll.append(float(-(t * pb.log()).sum() + (t * pa.log()).sum()))
rng = np.random.default_rng(0)
d = np.array(d_nll)
boot = [float(d[rng.integers(0, len(d), len(d))].mean()) for _ in range(2000)]
med = {p: statistics.median(x["seconds"] for x in v) for p, v in arms.items()}
res = {
    "run": str(run), "data": str(data), "cases": len(cases), "rows": len(records), "rounds": rounds,
    "checkpoint": {"step": state.get("best_step")}, "arms": arms,
    "seconds_median": med, "speedup_fp32_over_bf16": med["float32"] / med["bfloat16"],
    "stored_tokens": arms["float32"][0]["stored_tokens"],
    "state_rel_err": {"median": float(np.median(rel)), "p99": float(np.quantile(rel, 0.99)), "max": float(rel.max())},
    "trained_model_on_dev": {"max_abs_dp": max_dp, "nll_bf16_minus_fp32_mean": float(d.mean()),
                             "nll_diff_ci95": [float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))]},
    "threads": torch.get_num_threads(),
}
shutil.rmtree(work, ignore_errors=True)
cmd = f"OMP_NUM_THREADS={torch.get_num_threads()} .venv/bin/python benchmarks/cut_precision.py " + " ".join(sys.argv[1:])
save_result("cut-precision", cmd, res, path=out, machine=machine_info())
print(json.dumps({k: res[k] for k in ("seconds_median", "speedup_fp32_over_bf16", "state_rel_err",
                                      "trained_model_on_dev")}, indent=1))
