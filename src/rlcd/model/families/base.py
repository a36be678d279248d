"""The backbone-family interface: what `DecisionModel` needs to know about one kind of decoder.

A family answers, for a loaded model and its tokenizer:

* the LoRA targets: a full-match regex over module names, found from the architecture (every
  `nn.Linear` of the decoder layers; never the vision tower, never `lm_head`);
* the prompt frame (`PromptSpec`): the one-token candidate marker (an existing special token the
  chat template does not use), the special-token text rejected in inputs, the chat-template text
  around the user content, and the image tokens (None for a text-only backbone);
* the language-model forward: `run(lm, ids, image_features, mask, positions, cache=...)` ->
  last hidden states (+ cache), with explicit positions (`full_positions`, `suffix_positions`);
* the prefix-cache rule: `select_cache_rows(cache, index)` gives each suffix row its case's prefix state.

Families are stateless singletons; every method takes the (peft-unwrapped) causal LM it drives, so
one family serves a model before and after LoRA is merged.
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# module-name words of vision towers and projectors: never LoRA targets
VISION_WORDS = ("visual", "vision", "image", "multi_modal_projector", "mm_projector")


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


@functools.lru_cache(maxsize=None)
def _cache_kwarg_of(cls: type) -> str:
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg(decoder: nn.Module) -> str:
    """transformers >= 5.24 calls the cache argument `cache`; 5.17-5.23 `past_key_values`."""
    return _cache_kwarg_of(type(decoder))


def out_cache(out: Any) -> Any:
    c = getattr(out, "cache", None)
    return c if c is not None else getattr(out, "past_key_values", None)


def layer_linear_regex(model: nn.Module) -> str:
    """A full-match regex for every `nn.Linear` inside the repeated decoder layers of `model`.

    Layers are found as `<path>.<index>.<rest>` where `<path>` is a ModuleList; modules whose name
    holds a vision word are skipped. Result: `<path>\\.\\d+\\.(?:<rest1>|<rest2>|...)`, the rests
    sorted, so the regex is a pure function of the architecture.
    """
    lists = {name for name, mod in model.named_modules() if isinstance(mod, nn.ModuleList)}
    by_list: dict[str, set[str]] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or any(w in name for w in VISION_WORDS):
            continue
        m = re.fullmatch(r"(.+?)\.(\d+)\.(.+)", name)
        if m and m.group(1) in lists:
            by_list.setdefault(m.group(1), set()).add(m.group(3))
    if not by_list:
        raise RuntimeError(f"{type(model).__name__}: no nn.Linear inside repeated decoder layers (no LoRA targets)")
    parts = [rf"{re.escape(path)}\.\d+\.(?:{'|'.join(re.escape(r) for r in sorted(rests))})"
             for path, rests in sorted(by_list.items())]
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def fork_cache_rows(cache: Any, index: torch.Tensor) -> Any:
    """A new cache whose row i is row `index[i]` of `cache`; `cache` itself is left as it was.

    Cheaper than `copy.deepcopy(cache)` followed by `reorder_cache(index)`: only the selected rows are
    copied (`reorder_cache` rebinds every state to an `index_select` of it, a fresh tensor), so a
    forward that advances the fork's recurrent states in place cannot touch the original. The cache
    and layer objects are copied one level down (their dicts and lists of states too).
    """
    import copy

    new = copy.copy(cache)
    new.layers = []
    for layer in cache.layers:
        twin = copy.copy(layer)
        for name, value in vars(layer).items():
            if isinstance(value, (dict, list)):
                setattr(twin, name, copy.copy(value))
        new.layers.append(twin)
    new.reorder_cache(index)
    return new


class Family:
    """One kind of decoder. Subclasses: `Qwen35Family`, `CausalLMFamily`."""

    name: str = ""
    supports_images: bool = False
    exact_align: int | None = None  # score_case(exact=True) cuts the prefix on this grid
    suffix_chunk: int | None = None  # chunk size passed to the suffix calls (None: the default)

    # ---------------------------------------------------------------- architecture
    def decoder(self, lm: nn.Module) -> nn.Module:
        """The inner decoder (no lm_head) that returns `last_hidden_state`."""
        raise NotImplementedError

    def text_config(self, lm: nn.Module) -> Any:
        return lm.config.get_text_config()

    def vision(self, lm: nn.Module) -> nn.Module | None:
        return None

    def lora_targets(self, lm: nn.Module) -> str:
        return layer_linear_regex(lm)

    # ---------------------------------------------------------------- prompt
    def prompt_spec(self, tokenizer: Any) -> PromptSpec:
        raise NotImplementedError

    # ---------------------------------------------------------------- forward
    def full_positions(self, input_ids: torch.Tensor, image_mask: torch.Tensor | None,
                       image_grid_thw: torch.Tensor | None, merge_size: int) -> torch.Tensor:
        """Position ids of right-padded full rows."""
        b, t = input_ids.shape
        return torch.arange(t, device=input_ids.device).view(1, t).expand(b, t)

    def suffix_positions(self, n: int, length: int, start: int, device: Any) -> torch.Tensor:
        """Position ids of n suffix rows of `length` tokens that continue at position `start`."""
        return (torch.arange(length, device=device) + start).view(1, -1).expand(n, length)

    def run(self, lm: nn.Module, input_ids: torch.Tensor, image_features: torch.Tensor | None,
            attention_mask: torch.Tensor | None, positions: torch.Tensor, *, cache: Any = None,
            use_cache: bool = False, chunk_size: int | None = None) -> Any:
        """The decoder forward -> an output with `last_hidden_state` (and the cache when `use_cache`)."""
        raise NotImplementedError

    def select_cache_rows(self, cache: Any, index: torch.Tensor, device: Any) -> Any:
        """Row i of the result is row `index[i]` of `cache` (rows may repeat), in place; returns it.

        Used by `DecisionModel.score_cases` to give every suffix row its own request's prefix. One rule for
        every family and every cache width: `reorder_cache` (an `index_select` of each state), which also
        repeats a one-row cache (`batch_repeat_interleave` would repeat every row of a wider one)."""
        cache.reorder_cache(index.to(device))
        return cache


__all__ = ["Family", "PromptSpec", "VISION_WORDS", "cache_kwarg", "out_cache", "layer_linear_regex", "fork_cache_rows"]
