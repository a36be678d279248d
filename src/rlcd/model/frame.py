"""PromptSpec: how one tokenizer frames a row. Torch-free (no model, no transformers), so that the prompt
encoder (`rlcd.model.prompt`) runs where torch is absent (the portable ONNX runtime); the families build it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptSpec:
    """How one tokenizer frames a row (see `rlcd.model.prompt`).

    `head`: text before the user content -- the chat template's opening (system line, user turn
    header) or the BOS token a tokenizer without a template adds; tokenised with special tokens
    parsed. The template's closing text would follow the last candidate marker, where a causal
    decoder cannot let it change any read position, so it is never run. `reserved`: special-token
    text that inputs may not contain (the marker included). `image_tokens`: (start, pad, end), or
    None for a text-only backbone.
    """

    family: str
    marker: str
    reserved: tuple[str, ...]
    head: str = ""
    image_tokens: tuple[str, str, str] | None = None
    template: str | None = None  # "chat" when `head` comes from the tokenizer's chat template, "bos", or None
    pad: str | None = None  # the padding token when the tokenizer names none (default: its EOS)

    @property
    def text_only(self) -> bool:
        return self.image_tokens is None


__all__ = ["PromptSpec"]
