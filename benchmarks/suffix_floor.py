"""The physical floor of a warm question (issue 45): its suffix's matmul FLOPs over this CPU's measured fp32 matmul peak.

A warm question runs only its suffix (`suffixes.q0.suffix` tokens of benchmarks/results/state-cache.json) through the
decoder, attending to the cached state (`prefix_tokens`). Its FLOPs, from the SmolLM2 GGUF's own shape: per token and
layer the q/k/v/o projections and the gated MLP (2 x weights each), plus attention scores and values over every
attended position as a masked dense kernel computes them (2 x 2 x heads x head_dim x (prefix + suffix)); no LM head
(the scorer reads hidden states). The peak: the best of 20 fp32 [2048 x 2048] @ [2048 x 2048] products per thread count.
Printed beside the bench's warm p50, so the ratio says how far the warm path is from what no engine can skip.

Two more lines say where the rest goes. A forward of a few rows reads every decoder weight once (the GGUF's shape:
~107M parameters, ~428 MB in float32), far more than any cache holds, so the memory floor is those bytes over this
CPU's measured read rate (the best `sum` over a 1 GiB tensor). And `linears` times the decoder's own 7 x layers
projections at the suffix's row count with a distinct weight per layer, as the forward streams them (a loop over one
layer's weights would run from cache and flatter the rate).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/suffix_floor.py [benchmarks/results/state-cache.json]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def smollm2_shape() -> dict[str, int]:
    import gguf

    from rlcd.model.tokenizer import smollm2_gguf

    fields = gguf.GGUFReader(str(smollm2_gguf())).fields

    def get(key: str) -> int:
        f = fields[f"llama.{key}"]
        return int(f.parts[f.data[0]][0])

    hidden, heads = get("embedding_length"), get("attention.head_count")
    return {"hidden": hidden, "intermediate": get("feed_forward_length"), "layers": get("block_count"),
            "heads": heads, "kv_heads": get("attention.head_count_kv"), "head_dim": hidden // heads}


def suffix_flops(shape: dict[str, int], suffix: int, prefix: int) -> int:
    per_token = 2 * sum(o * i for o, i in weight_shapes(shape))
    attention = 2 * 2 * shape["heads"] * shape["head_dim"] * suffix * (prefix + suffix)
    return shape["layers"] * (suffix * per_token + attention)


def matmul_peak(threads: int) -> float:
    """fp32 FLOP/s of [2048 x 2048] @ [2048 x 2048] at `threads` torch threads (`rlcd.bench.gpu.matmul_rate`, best of 20)."""
    from rlcd.bench.gpu import matmul_rate

    torch.set_num_threads(threads)
    return matmul_rate(2048, 1, torch.device("cpu"), torch.float32, repeats=20)["flops_per_s"]


def weight_shapes(shape: dict[str, int]) -> list[tuple[int, int]]:
    """(out, in) of one layer's projections: q, k, v, o, gate, up, down."""
    h, i, hd = shape["hidden"], shape["intermediate"], shape["head_dim"]
    q, kv = shape["heads"] * hd, shape["kv_heads"] * hd
    return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]


def read_rate(threads: int, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of the best `sum` over a float32 tensor of `nbytes` (larger than any cache)."""
    torch.set_num_threads(threads)
    x = torch.ones(nbytes // 4)
    best = 0.0
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        x.sum()
        best = max(best, nbytes / (time.perf_counter() - t0))
    return best


def linears_ms(shape: dict[str, int], rows: int, threads: int, repeats: int = 7) -> float:
    """Best wall ms of every decoder projection at `rows` rows, one distinct float32 weight per layer."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=g) for _ in range(shape["layers"]) for o, i in weight_shapes(shape)]
    xs = {i: torch.randn(rows, i, generator=g) for _, i in weight_shapes(shape)}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            for w in ws:
                torch.nn.functional.linear(xs[w.shape[1]], w)
            best = min(best, 1e3 * (time.perf_counter() - t0))
    return best


def main(path: Path) -> None:
    bench = json.loads(path.read_text())["results"]
    shape = smollm2_shape()
    suffix, prefix = bench["suffixes"]["q0"]["suffix"], bench["prefix_tokens"]
    flops = suffix_flops(shape, suffix, prefix)
    print(f"SmolLM2 shape {shape}; warm suffix {suffix} tokens after {prefix}: {flops / 1e9:.3f} GFLOP")
    weight_bytes = 4 * shape["layers"] * sum(o * i for o, i in weight_shapes(shape))
    for t in bench["threads"]:
        peak = matmul_peak(int(t))
        floor_ms = 1e3 * flops / peak
        warm = bench["p50_ms"][str(t)]["warm_1q"]
        print(f"threads {t}: fp32 matmul peak {peak / 1e9:.1f} GFLOP/s -> floor {floor_ms:.1f} ms; "
              f"bench warm p50 {warm:.1f} ms = {warm / floor_ms:.2f}x the floor")
        rate = read_rate(int(t))
        print(f"threads {t}: read rate {rate / 1e9:.1f} GB/s -> the decoder's weights ({weight_bytes / 1e6:.0f} MB) "
              f"read once: {1e3 * weight_bytes / rate:.1f} ms")
        lin = linears_ms(shape, suffix, int(t))
        print(f"threads {t}: the decoder's projections alone at {suffix} rows, weights streamed: {lin:.1f} ms "
              f"({lin / warm:.0%} of the warm p50; {warm - lin:.1f} ms beyond them)")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/state-cache.json"))
