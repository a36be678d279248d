"""Where the demo's seconds go: frozen-feature extraction entries/s on SmolLM2-135M for a few synth cases,
with every balanced candidate order of a train choice row (the demo's path) vs one order, float32 vs bfloat16,
and the generator's states as they are vs a shorter filler. One JSON line per arm on stdout.

    PYTHONPATH=src python docs/experiments/real-weights/demo_scale_probe.py CASES THREADS [arm ...]
arms: f32-orders f32-one bf16-orders bf16-one
"""
from __future__ import annotations

import json
import resource
import sys
import time

import torch


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    from rlcd.data.synth import generate
    from rlcd.features import extract_split
    from rlcd.model.backbone import load_backbone
    from rlcd.model.decision import DecisionModel

    n_cases, threads, arms = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:] or ["f32-orders", "f32-one"]
    torch.set_num_threads(threads)
    records = generate(n_cases, seed=7)
    models = {}
    for arm in arms:
        dt = torch.bfloat16 if arm.startswith("bf16") else torch.float32
        if dt not in models:
            models[dt] = DecisionModel(load_backbone("smollm2-135m", dtype=dt), seed=0)
        model = models[dt]
        split = "train" if arm.endswith("orders") else "test"
        extract_split(model, records[:6], model.collator(), split)  # warm-up: one case
        w0, c0 = time.perf_counter(), cpu_s()
        t, _ = extract_split(model, records, model.collator(), split)
        wall, cpu = time.perf_counter() - w0, cpu_s() - c0
        n = int(t["h_dec"].shape[0])
        print(json.dumps({"arm": arm, "cases": n_cases, "threads": threads, "entries": n, "wall_s": round(wall, 2),
                          "cpu_s": round(cpu, 2), "entries_per_s": round(n / wall, 2),
                          "cases_per_s": round(n_cases / wall, 3), "row_tokens": int(t["n_tokens"].sum()),
                          "loadavg": open("/proc/loadavg").read().split()[:3]}), flush=True)


if __name__ == "__main__":
    main()
