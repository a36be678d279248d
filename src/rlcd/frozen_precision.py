"""What the frozen layers compute in when they are cached (`Recipe.frozen_precision`): float32, or bfloat16 autocast.

Both caches of frozen computation read it -- the cut-state cache (`rlcd.cut_cache`: the layers below the cut) and the
frozen-feature cache (`rlcd.features`: a head phase's features) -- so it lives apart from either. "bfloat16" runs
matrix products in bfloat16 (norms and the residual stream stay float32, as autocast keeps them): ~2x faster on a CPU
with AVX512-BF16 or AMX for ~1% relative error per state (`benchmarks/cut_precision.py`). Layers that train never run
under it.
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("float32", "bfloat16")


def check_precision(precision: str) -> str:
    from rlcd.errors import OptionError

    if precision not in PRECISIONS:
        raise OptionError(f"frozen precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def lower_precision(model, precision: str):
    """The context the frozen layers run in: bfloat16 autocast on the model's device for "bfloat16" (only when the
    model's weights are float32: a bfloat16 model already runs so), else nothing."""
    p = next(model.backbone.parameters())
    if precision == "float32" or p.dtype != torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(p.device.type, dtype=torch.bfloat16)


__all__ = ["PRECISIONS", "check_precision", "lower_precision"]
