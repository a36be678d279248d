"""Backbone families: one small adapter per kind of decoder (see `base.Family`).

* `qwen3.5` (`QWEN35`): Qwen3.5 vision-language models, driven by hand (M-RoPE, hybrid cache).
* `causal-lm` (`CAUSAL_LM`): any text `AutoModelForCausalLM` decoder (Llama/SmolLM2, Qwen2.5/Qwen3,
  Gemma-style), loaded from the hub, a local directory or a GGUF file.

`family_named(name)` returns a family by name; `family_for_model_type(model_type)` the one that
loads a checkpoint whose `config.json` says `model_type`.
"""

from __future__ import annotations

from .base import Family, PromptSpec
from .causal_lm import CAUSAL_LM
from .qwen35 import QWEN35

FAMILIES: dict[str, Family] = {QWEN35.name: QWEN35, CAUSAL_LM.name: CAUSAL_LM}
QWEN35_MODEL_TYPES = ("qwen3_5",)


def family_named(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown backbone family {name!r}; known: {', '.join(FAMILIES)}") from None


def family_for_model_type(model_type: str | None) -> Family:
    """Qwen3.5 checkpoints get the vision-language family; everything else loads as a text decoder."""
    return QWEN35 if model_type in QWEN35_MODEL_TYPES else CAUSAL_LM


__all__ = ["Family", "PromptSpec", "FAMILIES", "QWEN35", "CAUSAL_LM", "family_named", "family_for_model_type"]
