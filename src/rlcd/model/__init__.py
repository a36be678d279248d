"""The decision model: backbone presets and families (Qwen3.5, text decoders), prompt rendering, collation,
candidate scorer.

Public API (see docs/ARCHITECTURE.md for the contracts):

    from rlcd.model import load_backbone, save_backbone, Backbone, PRESETS
    from rlcd.model import Collator, Batch, PromptEncoder, CandidateScorer, DecisionModel
"""

from .backbone import LORA_TARGET_REGEX, PRESETS, Backbone, BackboneError, load_backbone, save_backbone
from .build import build_model
from .collate import Batch, Collator
from .decision import DecisionModel
from .head import CENTRINGS, CandidateScorer
from .prompt import DEFAULT_MAX_TOKENS, EncodedRow, PromptEncoder, option_texts, render_text

__all__ = [
    "PRESETS", "LORA_TARGET_REGEX", "Backbone", "BackboneError", "build_model", "load_backbone", "save_backbone", "Batch", "Collator",
    "DecisionModel", "CandidateScorer", "CENTRINGS", "PromptEncoder", "EncodedRow", "option_texts",
    "render_text", "DEFAULT_MAX_TOKENS",
]
