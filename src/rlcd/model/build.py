"""`build_model`: the one place a decision model is built from a run's config.

Every recipe field that concerns the model reaches it (LoRA rank and alpha, the top layers that get LoRA,
projection size, centring; `backbone_layers` keeps the decoder's first N layers, `keep_layers`); the backbone comes from `config["model"]` (preset, local directory or hub id) with the
config's `model_seed`, or a caller (a test, a benchmark) passes a ready `Backbone` instead of
patching a loader. Placement: the backbone in `dtype` on `device`, the scorer FP32 on `device`.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .backbone import Backbone, keep_layers, load_backbone
from .decision import DecisionModel

MODEL_FIELDS = ("lora_rank", "lora_alpha", "proj_dim", "centring", "lora_layers")


def model_options(recipe: Mapping[str, Any]) -> dict[str, Any]:
    """The DecisionModel keyword arguments a recipe dict sets (defaults for fields an old config lacks)."""
    from rlcd.recipe import Recipe

    pinned = Recipe()
    return {k: recipe.get(k, getattr(pinned, k)) for k in MODEL_FIELDS}


def build_model(config: Mapping[str, Any], *, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, backbone: Backbone | None = None) -> DecisionModel:
    """A fresh (untrained) DecisionModel for `config` (a run's config.json or an export's model.json)."""
    seed = int(config.get("model_seed", 0))
    if backbone is None:
        backbone = load_backbone(config["model"], dtype=dtype, device=device, seed=seed)
    layers = config["recipe"].get("backbone_layers")
    if layers is not None:
        backbone = keep_layers(backbone, int(layers))
    model = DecisionModel(backbone, seed=seed, **model_options(config["recipe"]))
    return model.to(device)


__all__ = ["build_model", "model_options", "MODEL_FIELDS"]
