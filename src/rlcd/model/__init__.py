"""The decision model: backbone presets and families (Qwen3.5, text decoders), prompt rendering, collation,
candidate scorer.

Public API (see docs/ARCHITECTURE.md for the contracts):

    from rlcd.model import load_backbone, save_backbone, Backbone, PRESETS
    from rlcd.model import Collator, Batch, PromptEncoder, CandidateScorer, DecisionModel
"""

# Loaded on first use (PEP 562), so that `rlcd.model.prompt` (the prompt encoder) imports without torch:
# the portable ONNX runtime (`rlcd.portable.runtime`) renders prompts with it and must not load torch.
_EXPORTS = {
    "LORA_TARGET_REGEX": "backbone", "PRESETS": "backbone", "Backbone": "backbone", "BackboneError": "backbone",
    "load_backbone": "backbone", "save_backbone": "backbone", "build_model": "build", "Batch": "collate",
    "Collator": "collate", "DecisionModel": "decision", "CENTRINGS": "head", "CandidateScorer": "head",
    "DEFAULT_MAX_TOKENS": "prompt", "EncodedRow": "prompt", "PromptEncoder": "prompt", "option_texts": "prompt",
    "render_text": "prompt",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "PRESETS", "LORA_TARGET_REGEX", "Backbone", "BackboneError", "build_model", "load_backbone", "save_backbone", "Batch", "Collator",
    "DecisionModel", "CandidateScorer", "CENTRINGS", "PromptEncoder", "EncodedRow", "option_texts",
    "render_text", "DEFAULT_MAX_TOKENS",
]
