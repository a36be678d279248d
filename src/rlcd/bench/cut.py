"""`rlcd bench cut`: what top-K-layer LoRA over the cut-state cache buys, measured in one run.

On generated synth data (six questions per case), for each K in `ks` and for LoRA on every layer (the
pinned recipe, live):

* cut extraction (`rlcd.cut_cache.ensure_cut_states`, all four splits): row tokens per second, stored
  tokens (prefix-shared) and bytes, bytes per row token;
* training: optimizer updates per second through `Session.update` (the very call `rlcd train` makes),
  `batch_size x grad_accum` rows per update, with `batch_by` row and case, on the cut cache; and with
  `--no-cache` (the backbone live, LoRA only on the top K: autograd builds no graph below them);
* the ratio of each K's updates/s to the all-layer run's, against the layer ratio L / K and the goal
  0.7 x L / K;
* storage: the logits (64 train rows, given order) of the (untrained) model from a bfloat16-stored cache vs the float32 one vs the
  live backbone (max |d logit|): the storage dtype is chosen by this number.

The last printed line is machine-readable:

    cut: K=...:row=...x,case=...x ...
"""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence


def _updates(data: Path, model: str, recipe, workdir: Path, placement, *, updates: int, warmup: int,
             feature_cache: bool = True) -> dict[str, Any]:
    from rlcd.bench.train import time_updates
    from rlcd.train import Dist, build_session, init_centring, new_run

    config, samples = new_run(workdir, data, model, recipe)
    s = build_session(config, samples, Dist(), placement=placement, feature_cache=feature_cache, progress=False)
    init_centring(s)
    out = time_updates(s, updates, warmup)
    out["updates_per_s"] = updates / out["wall_s"]
    out["source"] = s.sources.main.name
    del s
    gc.collect()  # a session's model holds reference cycles: free it before the next one is timed
    return out


def _logits(model, source, records) -> list:
    model.eval()
    return source.logits(model, "train", records)


def _storage_error(data: Path, model_name: str, k: int, placement) -> dict[str, float]:
    from rlcd.cut_cache import ensure_cut_states
    from rlcd.data.io import load_split
    from rlcd.model.build import build_model
    from rlcd.train.sources import CutStates, LiveSource

    m = build_model({"model": model_name, "model_seed": 0, "recipe": {"lora_layers": k}},
                    device=placement.torch_device, dtype=placement.torch_dtype)
    records = load_split(data, "train")[:64]
    live = _logits(m, LiveSource(m.collator(image_root=data), m.device), records)
    out = {}
    for storage in ("float32", "bfloat16"):
        cache = ensure_cut_states(m, data, storage=storage, progress=False)
        got = _logits(m, CutStates(cache, m.device), records)
        out[f"{storage}_max_abs_dlogit"] = max(float((a - b).abs().max()) for a, b in zip(got, live))
        out[f"{storage}_bytes"] = cache.nbytes
    out["logit_scale"] = max(float(a.abs().max()) for a in live)
    out["rows"] = len(records)
    return out


def run_cut_bench(model: str = "smollm2-135m", *, ks: Sequence[int] = (1, 2, 4, 8), cases: int = 8,
                  updates: int = 2, warmup: int = 1, all_updates: int = 1, batch_size: int = 8, grad_accum: int = 1,
                  live_k: bool = True, placement: Any = None, threads: Optional[int] = None,
                  say: Callable[[str], None] = print) -> dict[str, Any]:
    import torch

    from rlcd.bench.train import make_bench_data
    from rlcd.cut_cache import ensure_cut_states
    from rlcd.data.io import load_split
    from rlcd.device import resolve_placement
    from rlcd.model.build import build_model
    from rlcd.recipe import Recipe

    if threads:
        torch.set_num_threads(threads)
    placement = placement or resolve_placement("cpu")
    base = Recipe(batch_size=batch_size, grad_accum=grad_accum)
    res: dict[str, Any] = {"model": model, "cases": cases, "batch_size": batch_size, "grad_accum": grad_accum,
                           "updates": updates, "all_layer_updates": all_updates, "ks": list(ks), "per_k": {}}
    with tempfile.TemporaryDirectory(prefix="rlcd-bench-cut-") as tmp:
        tmp = Path(tmp)
        data = make_bench_data(tmp / "data", cases=cases)
        res["train_rows"] = len(load_split(data, "train"))
        say(f"bench cut: {model}, {cases} synth cases -> {data}; updates of {batch_size} x {grad_accum} rows")
        full = {}
        for by in ("row", "case"):
            full[by] = _updates(data, model, base.with_(batch_by=by), tmp / f"all-{by}", placement,
                                updates=all_updates, warmup=warmup, feature_cache=False)
            say(f"  all layers (live, batch_by {by}): {full[by]['updates_per_s']:.4f} updates/s "
                f"({full[by]['step_ms'] / 1000:.1f} s per update)")
        res["all_layers"] = full
        layers = None
        for k in ks:
            m = build_model({"model": model, "model_seed": 0, "recipe": {"lora_layers": k}},
                            device=placement.torch_device, dtype=placement.torch_dtype)
            layers = m.num_layers
            t0 = time.perf_counter()
            cache = ensure_cut_states(m, data, progress=False)
            dt = time.perf_counter() - t0
            mf = cache.manifest
            row = {"cut_layer": m.cut_layer, "extract_seconds": dt, "row_tokens": mf["row_tokens"],
                   "stored_tokens": mf["stored_tokens"], "bytes": mf["bytes"],
                   "row_tokens_per_s": mf["row_tokens"] / dt, "bytes_per_row_token": mf["bytes"] / mf["row_tokens"]}
            del m
            for by in ("row", "case"):
                u = _updates(data, model, base.with_(lora_layers=k, batch_by=by), tmp / f"k{k}-{by}", placement,
                             updates=updates, warmup=warmup)
                row[by] = u
                row[f"{by}_ratio"] = u["updates_per_s"] / full[by]["updates_per_s"]
            if live_k:
                u = _updates(data, model, base.with_(lora_layers=k), tmp / f"k{k}-live", placement,
                             updates=updates, warmup=warmup, feature_cache=False)
                row["live_row"] = u
                row["live_row_ratio"] = u["updates_per_s"] / full["row"]["updates_per_s"]
            row["layer_ratio"] = layers / k
            row["goal_ratio"] = 0.7 * layers / k
            res["per_k"][str(k)] = row
            say(f"  K={k}: extraction {row['row_tokens_per_s']:.0f} row tokens/s, {mf['stored_tokens']} stored of "
                f"{mf['row_tokens']} row tokens, {mf['bytes'] / 2**20:.1f} MiB; updates/s rows "
                f"{row['row']['updates_per_s']:.3f} ({row['row_ratio']:.1f}x), cases {row['case']['updates_per_s']:.3f} "
                f"({row['case_ratio']:.1f}x)" + (f", live {row['live_row_ratio']:.1f}x" if live_k else "")
                + f"; layer ratio {layers / k:.1f}, goal {0.7 * layers / k:.1f}")
        res["layers"] = layers
        res["storage"] = _storage_error(data, model, max(ks), placement)
        say(f"  storage (K={max(ks)}, {res['storage']['rows']} rows, logits up to {res['storage']['logit_scale']:.1f}): "
            f"max |d logit| vs live float32 {res['storage']['float32_max_abs_dlogit']:.2e}, "
            f"bfloat16 {res['storage']['bfloat16_max_abs_dlogit']:.2e}")
    say("cut: " + " ".join(f"K={k}:row={r['row_ratio']:.2f}x,case={r['case_ratio']:.2f}x,goal={r['goal_ratio']:.1f}x"
                           for k, r in res["per_k"].items()))
    return res


__all__ = ["run_cut_bench"]
