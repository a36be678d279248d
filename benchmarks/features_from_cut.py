"""Features from a cut-state cache, each case's stored prefix run once (by case) vs every row run whole (rows: what
`rlcd features` did before issue 69's 4k arm): process CPU and wall seconds per round, the ratio, and the largest
|d| between the two paths' features (h_dec, h_cand). The arms alternate, their order swapped each round; the first
round is a warm-up. The model is the head-only one `rlcd features DATA --model SPEC` builds (LoRA zero, switched off).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/features_from_cut.py DATA SPEC SPLIT ENTRIES ROUNDS OUT.json
    e.g. ... runs/ds/d1000 gemma3-270m train 384 3 benchmarks/results/features-from-cut-gemma3-270m.json
"""
import json, statistics, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from rlcd.bench.report import save_result
from rlcd.cut_cache import find_cut_states
from rlcd.features import cache_entries, extract_split, split_records
from rlcd.model.build import build_model

data, spec, split, n_entries, rounds, out_path = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), \
    int(sys.argv[5]), sys.argv[6]
model = build_model({"model": spec, "model_seed": 0, "recipe": {}}, device=torch.device("cpu"), dtype=torch.float32)
cut = find_cut_states(model, data, any_cut=True)
if cut is None:
    sys.exit(f"{data}: no cut-state cache matches {spec} (rlcd features {data} --model {spec} --cut K first)")
records = split_records(data, None)[split]
keep, seen = [], 0  # whole cases, in file order, until ENTRIES entries (a train choice row counts once per order)
for r in records:
    if seen >= n_entries and (not keep or r.case_id != keep[-1].case_id):
        break
    keep.append(r)
    seen = len(cache_entries(split, keep))
collator = model.collator(image_root=data)
arms = {"rows": dict(shared=False), "by_case": dict(shared=True)}
res = {k: {"wall_s": [], "cpu_s": []} for k in arms}
feats = {}
for r in range(rounds + 1):
    for k in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
        w0, c0 = time.perf_counter(), time.process_time()
        tensors, index = extract_split(model, keep, collator, split, cut_states=cut, **arms[k])
        w1, c1 = time.perf_counter(), time.process_time()
        if r:
            res[k]["wall_s"].append(w1 - w0)
            res[k]["cpu_s"].append(c1 - c0)
        feats[k] = tensors
        print(f"round {r} {k}: {w1 - w0:.1f} s wall, {c1 - c0:.1f} s CPU", file=sys.stderr, flush=True)
out = {"data": str(data), "model": spec, "split": split, "cases": len({r.case_id for r in keep}), "rows": len(keep),
       "entries": len(index), "row_tokens": int(feats["rows"]["n_tokens"].sum()), "cut": int(cut.key["cut"]),
       "storage": cut.key["storage"], "threads": torch.get_num_threads(), "rounds": rounds,
       "median": {k: {m: statistics.median(v) for m, v in d.items()} for k, d in res.items()}, "samples": res}
out["rows_over_by_case"] = {m: out["median"]["rows"][m] / out["median"]["by_case"][m] for m in ("wall_s", "cpu_s")}
out["max_abs_diff"] = {n: float((feats["rows"][n] - feats["by_case"][n]).abs().max()) for n in ("h_dec", "h_cand")}
out["same_index"] = all(torch.equal(feats["rows"][n], feats["by_case"][n]) for n in ("k", "n_tokens"))
print(json.dumps({k: v for k, v in out.items() if k != "samples"}, indent=1))
save_result("features-from-cut", "OMP_NUM_THREADS=2 .venv/bin/python benchmarks/features_from_cut.py "
            + " ".join(sys.argv[1:]), out, path=out_path)
