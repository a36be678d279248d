"""`rlcd bench features`: what the frozen-feature cache buys, measured in one run.

Two ratios on generated synth data (six questions per case):

* extraction: row tokens per second of `rlcd.features.extract_split` over the train split with prefix
  sharing (one state forward per case, its questions as suffixes: `CaseRunner.case_features`) vs
  every row as a full forward (`shared=False`); "row tokens" are the full rows' tokens in both, so the
  ratio is the speed-up; and prefix-shared with the run's zero LoRA switched off (what extraction does)
  vs left on (`lora_off=False`): `lora_off_ratio`;
* training: optimizer updates per second of a head-only session on the cache (`head_only=true`) vs
  the recipe's LoRA session on the live backbone, both through `Session.update` (the very call
  `rlcd train` makes), recipe batch 8 x 4.

The last printed line is machine-readable:

    features: extract_ratio=... lora_off_ratio=... head_only_updates_per_s=... lora_updates_per_s=... train_ratio=...
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional


def _extract_rate(model, records, collator, *, shared: bool, lora_off: bool = True) -> dict[str, float]:
    from rlcd.features import extract_split

    t0 = time.perf_counter()
    tensors, index = extract_split(model, records, collator, "train", shared=shared, lora_off=lora_off)
    dt = time.perf_counter() - t0
    tokens = int(tensors["n_tokens"].sum())
    return {"seconds": dt, "entries": len(index), "row_tokens": tokens, "row_tokens_per_s": tokens / dt}


def run_features_bench(model: str = "tiny", *, cases: int = 24, head_updates: int = 200, lora_updates: int = 3,
                       placement: Any = None, threads: Optional[int] = None,
                       say: Callable[[str], None] = print) -> dict[str, Any]:
    import torch

    from rlcd.bench.train import bench_session, make_bench_data, time_updates
    from rlcd.data.io import load_split
    from rlcd.device import resolve_placement
    from rlcd.recipe import Recipe

    if threads:
        torch.set_num_threads(threads)
    placement = placement or resolve_placement("cpu")
    with tempfile.TemporaryDirectory(prefix="rlcd-bench-features-") as tmp:
        data = make_bench_data(Path(tmp) / "data", cases=cases)
        say(f"bench features: {model}, {cases} synth cases -> {data}")
        head = bench_session(data, model, workdir=Path(tmp) / "h", recipe=Recipe(head_only=True), placement=placement)
        records = load_split(data, "train")
        collator = head.model.collator(image_root=data)
        full = _extract_rate(head.model, records, collator, shared=False)
        shared = _extract_rate(head.model, records, collator, shared=True)
        lora_on = _extract_rate(head.model, records, collator, shared=True, lora_off=False)
        say(f"  extraction: shared {shared['row_tokens_per_s']:.0f} vs per-row {full['row_tokens_per_s']:.0f} "
            f"row tokens/s over {shared['entries']} entries; shared with the zero LoRA left on "
            f"{lora_on['row_tokens_per_s']:.0f}")
        h = time_updates(head, head_updates, warmup=5)
        del head
        lora = bench_session(data, model, workdir=Path(tmp) / "l", recipe=Recipe(), placement=placement)
        l_ = time_updates(lora, lora_updates, warmup=1)
    res = {
        "model": model, "cases": cases, "placement": placement.to_dict(), "threads": torch.get_num_threads(),
        "extract": {"shared": shared, "per_row": full, "ratio": shared["row_tokens_per_s"] / full["row_tokens_per_s"],
                    "shared_lora_on": lora_on,
                    "lora_off_ratio": shared["row_tokens_per_s"] / lora_on["row_tokens_per_s"]},
        "train": {"head_only_updates_per_s": 1000.0 / h["step_ms"], "lora_updates_per_s": 1000.0 / l_["step_ms"],
                  "head_only_updates": head_updates, "lora_updates": lora_updates},
    }
    res["train"]["ratio"] = res["train"]["head_only_updates_per_s"] / res["train"]["lora_updates_per_s"]
    say(f"features: extract_ratio={res['extract']['ratio']:.2f} lora_off_ratio={res['extract']['lora_off_ratio']:.2f} "
        f"head_only_updates_per_s={res['train']['head_only_updates_per_s']:.1f} "
        f"lora_updates_per_s={res['train']['lora_updates_per_s']:.3f} train_ratio={res['train']['ratio']:.0f}")
    return res
