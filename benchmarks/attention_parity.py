"""Packed answers against lone ones, per attention kernel (issue 73: "answers equal within 1e-6 of single requests").

The batch job (`rlcd predict --input`, `rlcd.batch.local.score_rows`) packs the rows about one state into one case and
several states into one left-padded forward. With torch's fused `sdpa` kernel the blocking over keys follows the
padded length, so a packed row's probabilities differ from its lone answer by float noise; `eager` attention
(`--attention eager`: matmul, masked softmax, matmul) adds exact zeros for the padding. For each kernel, on the same
ROWS rows of a processed data dir (its SPLITS, in order), one process, one torch thread, float32:

- `packed`: the rows through `score_rows` (BATCH states a call, the job's default 16), wall and CPU seconds;
- `single`: every row as a request of its own (`Predictor.predict`, the state cache cleared before each: what one
  HTTP request per row computes), wall and CPU seconds;
- max and 99th percentile over rows of max |p_packed - p_single| (every option's probability, noul's p).

The kernels run in turn for each of ROUNDS rounds (order rotating), so drift in the machine's load hits both alike;
times are medians over rounds, the parity is the same every round (checked).

    .venv/bin/python benchmarks/attention_parity.py RUN DATA SPLITS ROWS ROUNDS OUT.json [BATCH]
"""
import json, statistics, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import torch

torch.set_num_threads(1)
from rlcd.batch.io import scan_split
from rlcd.batch.local import score_rows
from rlcd.bench.report import machine_info, save_result
from rlcd.device import resolve_placement
from rlcd.predict import Predictor

run, data, splits, n_rows, rounds, out = (sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(","), int(sys.argv[4]),
                                          int(sys.argv[5]), sys.argv[6])
batch = int(sys.argv[7]) if len(sys.argv) > 7 else 16
rows = []
for split in splits:
    rows += [r for r in scan_split(data, split) if r.request is not None]
rows = rows[:n_rows]
if len(rows) < n_rows:
    sys.exit(f"attention_parity: {data} has {len(rows)} rows in {','.join(splits)}, fewer than {n_rows}")
kernels = ("sdpa", "eager")
predictors = {k: Predictor.from_run(run, placement=resolve_placement("cpu", "float32", attention=k)) for k in kernels}


def probs(resp: dict) -> list[float]:
    out = []
    for qid in sorted(resp["answers"]):
        a = resp["answers"][qid]
        out += [a["noul"]] if a["type"] == "noul" else [a["probabilities"][c] for c in sorted(a["probabilities"])]
    return out


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    res = fn()
    return res, time.perf_counter() - w, time.process_time() - c


def singles(p: Predictor) -> list[dict]:
    got = []
    for r in rows:
        p.clear_state_cache()
        got.append(p.predict(r.request, image_root=data))
    return got


runs = {k: {"packed_wall_s": [], "packed_cpu_s": [], "single_wall_s": [], "single_cpu_s": []} for k in kernels}
parity = {}
load_before = list(__import__("os").getloadavg())
for rnd in range(rounds):
    order = kernels[rnd % 2:] + kernels[: rnd % 2]
    for k in order:
        p = predictors[k]
        p.clear_state_cache()
        packed, w, c = timed(lambda: score_rows(p, rows, batch_size=batch, image_root=data))
        runs[k]["packed_wall_s"].append(w); runs[k]["packed_cpu_s"].append(c)
        lone, w, c = timed(lambda: singles(p))
        runs[k]["single_wall_s"].append(w); runs[k]["single_cpu_s"].append(c)
        assert all(o.response is not None for o in packed), [o.reject for o in packed if o.reject][:3]
        diffs = [max(abs(a - b) for a, b in zip(probs(o.response), probs(s))) for o, s in zip(packed, lone)]
        d = sorted(diffs)
        now = {"max_abs_dp": d[-1], "p99_abs_dp": d[int(0.99 * (len(d) - 1))], "median_abs_dp": d[len(d) // 2],
               "rows_over_1e-6": sum(x > 1e-6 for x in d)}
        assert parity.setdefault(k, now) == now, (k, parity[k], now)  # the same numbers every round
        print(f"round {rnd} {k}: max |dp| {now['max_abs_dp']:.3e}, packed {runs[k]['packed_wall_s'][-1]:.1f} s, "
              f"single {runs[k]['single_wall_s'][-1]:.1f} s", flush=True)
med = {k: {m: statistics.median(v) for m, v in runs[k].items()} for k in kernels}
for k in kernels:
    med[k]["packed_rows_per_cpu_s"] = len(rows) / med[k]["packed_cpu_s"]
    med[k]["single_rows_per_cpu_s"] = len(rows) / med[k]["single_cpu_s"]
res = {"run": run, "data": str(data), "splits": splits, "rows": len(rows), "states": len({json.dumps(r.request.get(
    "state"), sort_keys=True) for r in rows}), "rounds": rounds, "batch_size": batch, "threads": 1, "dtype": "float32",
       "loadavg_before": load_before, "loadavg_after": list(__import__("os").getloadavg()),
       "parity": parity, "median": med, "runs": runs,
       "eager_over_sdpa": {m: med["eager"][m] / med["sdpa"][m] for m in ("packed_cpu_s", "single_cpu_s")},
       "packed_over_single_rows_per_cpu_s": {k: med[k]["packed_rows_per_cpu_s"] / med[k]["single_rows_per_cpu_s"]
                                             for k in kernels}}
cmd = f"python benchmarks/attention_parity.py {run} {data} {','.join(splits)} {n_rows} {rounds} {out}" + (
    f" {batch}" if len(sys.argv) > 7 else "")
save_result("attention-parity", cmd, res, path=out, machine=machine_info())
print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))
