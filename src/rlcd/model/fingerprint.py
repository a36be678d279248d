"""`backbone_fingerprint`: which backbone weights a model holds, for checks across runs and exports.

Lives with the model so that both `rlcd.export` (load-time check) and `rlcd.train` (`--init` from
another run) can use it without training depending on the export layer.
"""

from __future__ import annotations

import hashlib

import torch

FINGERPRINT_DTYPE = "bfloat16"


def backbone_fingerprint(model, rounding: str | None = FINGERPRINT_DTYPE) -> str:
    """sha256 over a few tensors neither LoRA nor merging touches (embeddings, vision tower if any).

    Catches a different random init or base model; identical before and after `merge()`. The values
    are rounded to bfloat16 first, so a model evaluated on a GPU in bfloat16 and served on a CPU in
    float32 has one fingerprint (`rounding=None`: the float32 bytes of exports written before that).
    """
    h = hashlib.sha256()
    named = [(n, p) for n, p in model.backbone.named_parameters()
             if "lora_" not in n and ("embed_tokens" in n or "visual" in n)]
    if not named:  # a decoder that names its embeddings otherwise (wte, word_embeddings, ...)
        named = [("input_embeddings", model.backbone.get_input_embeddings().weight)]
    for _, p in named[:4]:  # names differ with and without the peft wrapper; bytes do not
        t = p.detach()
        if rounding:
            t = t.to(getattr(torch, rounding))
        h.update(t.float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
