"""The backbone-family interface: what `DecisionModel` needs to know about one kind of decoder.

A family answers, for a loaded model and its tokenizer:

* the LoRA targets: a full-match regex over module names, found from the architecture (every
  `nn.Linear` of the decoder layers; never the vision tower, never `lm_head`);
* the prompt frame (`PromptSpec`): the one-token candidate marker (an existing special token the
  chat template does not use), the special-token text rejected in inputs, the chat-template text
  around the user content, and the image tokens (None for a text-only backbone);
* the language-model forward: `run(lm, ids, image_features, mask, positions, cache=...)` ->
  last hidden states (+ cache), with explicit positions (`full_positions`, `suffix_positions`);
* the prefix-cache rule: `select_cache_rows(cache, index)` gives each suffix row its case's prefix state;
* stages (`run(..., layers=(start, end), inputs_embeds=h)`): decoder layers [start, end) alone, fed the
  hidden states at `start` (what the cut-state cache of top-layer LoRA stores), by the decoder's own
  forward on a view of those layers (`decoder_view`).

Families are stateless singletons; every method takes the (peft-unwrapped) causal LM it drives, so
one family serves a model before and after LoRA is merged.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import re
from typing import Any

import torch
from torch import nn

from ..frame import PromptSpec  # noqa: F401 (defined torch-free; the families' API here too)

# module-name words of vision towers and projectors: never LoRA targets
VISION_WORDS = ("visual", "vision", "image", "multi_modal_projector", "mm_projector")


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


def stage_config(dec: nn.Module, start: int, end: int) -> Any:
    """`dec`'s config for its layers [start, end) alone: `num_hidden_layers` and `layer_types` sliced (what a
    cache for those layers, and the decoder's own per-layer mask choice, read)."""
    cfg = copy.copy(dec.config)
    cfg.num_hidden_layers = end - start
    types = getattr(dec.config, "layer_types", None)
    if types is not None:
        cfg.layer_types = list(types)[start:end]
    return cfg


def decoder_view(dec: nn.Module, start: int, end: int) -> nn.Module:
    """A shallow copy of the text decoder `dec` holding only its layers [start, end) (the same modules, no
    weights copied): its own forward then embeds nothing it is not given (pass `inputs_embeds`), builds its
    masks and rotary embeddings as usual, runs those layers, and applies the final norm only when `end` is
    the last layer (the hidden states at a cut are the un-normed residual stream)."""
    view = copy.copy(dec)
    view._modules = dict(dec._modules)
    view._modules["layers"] = nn.ModuleList(list(dec.layers)[start:end])
    if end < len(dec.layers):
        view._modules["norm"] = nn.Identity()
    view.config = stage_config(dec, start, end)
    return view


@contextlib.contextmanager
def numbered_from(layers: nn.Module, offset: int):
    """Renumber the `layer_idx` of every module in `layers` by -`offset` while a stage runs, so the layers
    index a cache built for the stage alone (and its first full-attention layer sizes the mask); restored after."""
    changed = [(m, m.layer_idx) for m in layers.modules() if isinstance(getattr(m, "layer_idx", None), int)]
    try:
        for m, idx in changed:
            m.layer_idx = idx - offset
        yield
    finally:
        for m, idx in changed:
            m.layer_idx = idx


def run_stage(dec: nn.Module, hidden: torch.Tensor, attention_mask: Any, positions: torch.Tensor,
              layers: tuple[int, int], *, cache: Any = None, use_cache: bool = False, **kw: Any) -> Any:
    """Layers [start, end) of text decoder `dec` on `hidden` (the states entering layer `start`)."""
    start, end = layers
    if not 0 <= start < end <= len(dec.layers):
        raise ValueError(f"layers {layers} outside the decoder's 0..{len(dec.layers)}")
    view = decoder_view(dec, start, end)
    if cache is not None:
        kw[cache_kwarg(dec)] = cache
    with numbered_from(view.layers, start):
        return view(inputs_embeds=hidden, attention_mask=attention_mask, position_ids=positions,
                    use_cache=use_cache, **kw)


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

    def text_decoder(self, lm: nn.Module) -> nn.Module:
        """The text decoder whose `layers`, `norm` and `config` a stage slices (`run_stage`)."""
        return self.decoder(lm)

    def num_layers(self, lm: nn.Module) -> int:
        return len(self.text_decoder(lm).layers)

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

    def run(self, lm: nn.Module, input_ids: torch.Tensor | None, image_features: torch.Tensor | None,
            attention_mask: torch.Tensor | None, positions: torch.Tensor, *, cache: Any = None,
            use_cache: bool = False, chunk_size: int | None = None, layers: tuple[int, int] | None = None,
            inputs_embeds: torch.Tensor | None = None) -> Any:
        """The decoder forward -> an output with `last_hidden_state` (and the cache when `use_cache`).

        `layers=(start, end)`: only those decoder layers (a stage; `last_hidden_state` is then the hidden state
        after layer end-1, normed only when end is the last layer), fed `inputs_embeds` -- the hidden states
        entering layer `start` -- or, when start is 0, the embeddings of `input_ids`."""
        raise NotImplementedError

    def select_cache_rows(self, cache: Any, index: torch.Tensor, device: Any) -> Any:
        """Row i of the result is row `index[i]` of `cache` (rows may repeat), in place; returns it.

        Used by `prefix_forward.cache_rows` to give every suffix row its own case's prefix. One rule for
        every family and every cache width: `reorder_cache` (an `index_select` of each state), which also
        repeats a one-row cache (`batch_repeat_interleave` would repeat every row of a wider one)."""
        cache.reorder_cache(index.to(device))
        return cache


def restrict_to_layers(regex: str, indices: list[int]) -> str:
    """A LoRA target regex (`<path>\\.\\d+\\.(...)`) narrowed to the decoder layers `indices`."""
    alt = "(?:" + "|".join(str(i) for i in sorted(indices)) + ")"
    if r"\.\d+\." not in regex:
        raise ValueError(f"cannot restrict LoRA targets {regex!r} to layers: no layer index in it")
    return regex.replace(r"\.\d+\.", r"\." + alt + r"\.")


__all__ = ["Family", "PromptSpec", "VISION_WORDS", "cache_kwarg", "out_cache", "layer_linear_regex", "fork_cache_rows",
           "decoder_view", "numbered_from", "restrict_to_layers", "run_stage", "stage_config"]
