"""The cross-request state cache: a state's prefix computed once, reused by later requests about it.

Agents ask several questions about one state over time, in separate requests. Within a request the
state's prefix already runs once (`CaseRunner.score_cases`); this cache keeps that prefix's decoder
state -- what the shared-prefix path hands its suffix calls, nothing else -- so a later request about
the same state runs only its questions' suffixes.

What is stored (`PrefixState`): one row of the prefix cache: every attention layer's keys and values
[1, heads, cut, dim] (left padding dropped) and a copy of every linear-attention layer's conv and recurrent
states (Qwen3.5's Gated DeltaNet). Keys and values of a forward that ran one row alone are kept as the forward
left them, not copied (a view when the state is their first positions; `nbytes` counts all they hold): a cold
request pays no copy of its state (issue 58). The scorer reads no position inside the prefix (the cut never passes
a decision position), so no hidden states are kept. Only caches made of the layer classes in
`SUPPORTED_LAYERS` are stored: full attention (`DynamicLayer`), sliding-window attention
(`DynamicSlidingWindowLayer`: Gemma 3's local layers) and the linear-attention layers; another kind (static,
quantized) is never cached. A sliding-window layer keeps only its last `sliding_window - 1` positions,
so a state is kept only when every such layer still holds all of its positions: a prefix of at most
`sliding_window - 1` tokens (`max_state_tokens`); a longer one is never stored (Gemma 3 270M: 511 tokens).

Exactness: nothing a forward does reaches a stored state. The supported layers replace their keys and values
(`update` concatenates -- the sliding-window layer then keeps a view of the new tensor's last positions --,
`reorder_cache` selects) and never write into them; `stack_states` builds each batch's prefix cache
from new tensors -- keys and values left-padded with zeros to a common width (which the suffix calls mask),
recurrent states concatenated -- so the in-place updates of the suffix calls cannot reach it. A sliding-window
layer is built as a batched prefix forward of its rows would have left it: padded to the width, its
`cumulative_length` the width, and only the last `sliding_window - 1` positions kept once the width reaches the
window (`update`'s crop), so the suffix calls mask and offset it as they do the forward's own. One exception
saves a warm question three copies of its state's keys and values: a lone state that needs no padding lends
its keys and values as they are, because the supported layers' `update` concatenates onto them into a new
tensor and never writes into them (`tests/test_state_cache.py` holds transformers to that).

Keys (`prefix_key`): the exact prefix token ids (chat-template head, image tokens, state) and the
digest of the preprocessed image's pixels and grid (`image_digest`), under a scope the owner chooses
(the Predictor's: the model's fingerprint, its info with the prompt frame and LoRA/merge state, the
placement and the parameters' version counters). Another model, prompt frame, LoRA state or image
therefore never hits.

The store itself (`rlcd.serving.cache.StateCache`: an LRU bounded in bytes, scoped by the Predictor) belongs to
serving; what is stored and how a state goes into and out of a decoder's cache is this module's, and the keys are
computed by the runner that reads and writes the store (`rlcd.model.runner`).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import Any, Sequence


SUPPORTED_LAYERS = frozenset({"DynamicLayer", "DynamicSlidingWindowLayer", "LinearAttentionLayer",
                              "LinearAttentionAndFullAttentionLayer"})
_SLIDING = "DynamicSlidingWindowLayer"  # the keys/values of the last sliding_window - 1 of cumulative_length positions
_KV = ("keys", "values")  # [B, heads, T, dim]
_STATES = ("conv_states", "recurrent_states")  # {index: [B, ...]}


@dataclass(frozen=True)
class PrefixState:
    """One state's prefix as the decoder left it: a one-row cache of `tokens` positions (`cache` is never
    given to a forward: `stack_states` copies it) and the bytes of its tensors."""

    cache: Any
    tokens: int
    nbytes: int


def _layer_twin(layer: Any) -> Any:
    """A shallow copy of a cache layer whose dicts and lists are copied too (as `fork_cache_rows` does)."""
    twin = copy.copy(layer)
    for name, value in vars(layer).items():
        if isinstance(value, (dict, list)):
            setattr(twin, name, copy.copy(value))
    return twin


def _supported(cache: Any) -> bool:
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer).__name__ in SUPPORTED_LAYERS
                                and type(layer).__module__ == "transformers.cache_utils" for layer in layers)


def _sliding(layer: Any) -> bool:
    return type(layer).__name__ == _SLIDING


def max_state_tokens(state: PrefixState) -> int | None:
    """The most prefix tokens a state of this cache layout can hold: `sliding_window - 1` with a sliding-window
    layer (the positions it keeps), None when no layer drops any (a longer prefix's state is never stored)."""
    sizes = [int(layer.sliding_window) - 1 for layer in state.cache.layers if _sliding(layer)]
    return min(sizes) if sizes else None


def snapshot_row(cache: Any, row: int, start: int, end: int | None = None) -> PrefixState | None:
    """Row `row` of a batched cache, positions [start, end) (`start`: left padding dropped; `end`: a full row's
    cache cut at the end of its state), as a `PrefixState`; None for a cache this module does not know how to keep
    exactly. Keys and values of a one-row cache are kept as they are (they are never written into: the module
    docstring), those of a wider batch copied so the state holds its own row only; recurrent states are copied
    (the suffix calls advance them in place). A sliding-window layer holds positions [cumulative_length - kept,
    cumulative_length): the state is kept only when they include all of [start, end) (None once the window has
    dropped one), and its twin's `cumulative_length` is the state's length, as a forward of the state alone leaves
    it. `nbytes`: the bytes the state keeps alive."""
    import torch  # here, not at import: a Predictor with the cache off (the portable server) needs no torch

    if not _supported(cache):
        return None
    new = copy.copy(cache)
    new.layers = []
    nbytes, tokens = 0, None
    for layer in cache.layers:
        twin = _layer_twin(layer)
        lo, hi = start, end
        if _sliding(layer):
            if getattr(layer, "record_past", False):
                return None  # holds past positions until a `crop`: not what a forward leaves
            keys = getattr(layer, "keys", None)
            if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
                return None
            total = int(layer.cumulative_length)
            held = total - keys.shape[-2]  # the first position the window still holds
            hi = total if end is None else end
            if start < held or hi > total:
                return None
            lo, hi = start - held, hi - held
        for name in _KV:
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and t.dim() == 4:
                kept = t[row: row + 1, :, lo:hi]
                if t.shape[0] == 1:  # the forward's own tensor: no copy
                    nbytes += t.untyped_storage().nbytes()
                else:
                    kept = kept.clone()
                    nbytes += kept.nbytes
                setattr(twin, name, kept)
                tokens = kept.shape[-2]
        if _sliding(layer):
            twin.cumulative_length = int(twin.keys.shape[-2])
        for name in _STATES:
            d = getattr(layer, name, None)
            if isinstance(d, dict):
                setattr(twin, name, {k: v[row: row + 1].clone() if isinstance(v, torch.Tensor) else v
                                     for k, v in d.items()})
                nbytes += sum(v.nbytes for v in getattr(twin, name).values() if isinstance(v, torch.Tensor))
        new.layers.append(twin)
    return PrefixState(new, int(tokens or 0), int(nbytes))


def stack_states(states: Sequence[PrefixState], width: int) -> Any:
    """One cache whose row i is `states[i]`: keys and values left-padded with zeros to `width` positions (the
    caller masks them), linear-attention states concatenated. Every tensor that a forward advances in place is
    new, so the stored states stay as they were; a lone state of exactly `width` positions lends its keys and
    values as they are (a forward only reads them: `update` concatenates). A sliding-window layer is what a batched
    prefix forward of these rows leaves: `cumulative_length = width`, and from `width >= sliding_window` on only
    the last `sliding_window - 1` positions (`DynamicSlidingWindowLayer.update`'s crop; a stored state is never
    longer than that, `snapshot_row`)."""
    import torch  # here, not at import: a Predictor with the cache off (the portable server) needs no torch

    if not states:
        raise ValueError("stack_states needs at least one state")
    first = states[0].cache
    new = copy.copy(first)
    new.layers = []
    for li, layer in enumerate(first.layers):
        rows = [s.cache.layers[li] for s in states]
        if any(type(r) is not type(layer) for r in rows):
            raise RuntimeError("cached prefix states of different cache layouts cannot be batched")
        twin = _layer_twin(layer)
        kept = width
        if _sliding(layer):
            twin.cumulative_length = width
            if width >= layer.sliding_window:
                kept = layer.sliding_window - 1
        for name in _KV:
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and t.dim() == 4:
                parts = [getattr(r, name) for r in rows]
                if any(p.shape[-2] > kept for p in parts):
                    raise ValueError(f"a state of {max(p.shape[-2] for p in parts)} positions does not fit "
                                     f"{kept} (width {width})")
                if len(parts) == 1 and parts[0].shape[-2] == kept == width:
                    setattr(twin, name, parts[0])  # read, never written: the layers' update concatenates
                    continue
                out = t.new_zeros((len(parts), t.shape[1], kept, t.shape[-1]))  # one copy, the left padding zero
                for i, p in enumerate(parts):
                    out[i: i + 1, :, kept - p.shape[-2]:] = p
                setattr(twin, name, out)
        for name in _STATES:
            d = getattr(layer, name, None)
            if isinstance(d, dict):
                setattr(twin, name, {k: torch.cat([getattr(r, name)[k] for r in rows])
                                     if isinstance(v, torch.Tensor) else v for k, v in d.items()})
        new.layers.append(twin)
    return new


def image_digest(pixel_values: torch.Tensor | None, grid: torch.Tensor | None) -> str | None:
    """blake2b of the preprocessed image (dtype, shape, bytes) and its grid: what the model sees of it."""
    import torch  # here, not at import: a Predictor with the cache off (the portable server) needs no torch

    if pixel_values is None:
        return None
    h = hashlib.blake2b(digest_size=32)
    for t in (pixel_values, grid):
        if t is None:
            continue
        t = t.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class RowFeatures:
    """One answered row's features as the decoder left them (`CaseRunner.case_features`): the decision
    position's last hidden state [H] and the markers' [k, H], each its own copy; `nbytes` their bytes. What a row
    cache holds: a later request with the same row about the same state and image runs only the head on it."""

    h_dec: Any
    h_cand: Any
    nbytes: int


def row_key(ids: Sequence[int], image: str | None, decision_pos: int, marker_pos: Sequence[int],
            exact: bool = False) -> bytes:
    """The key of an answered row within one scope: its whole token ids and the image digest (`prefix_key`), the
    positions read (decision, markers) and the `exact` chunk grid it ran on."""
    h = hashlib.blake2b(prefix_key(ids, image), digest_size=32)
    h.update(b"row" + int(decision_pos).to_bytes(8, "little") + bytes([int(bool(exact))]))
    h.update(b"".join(int(m).to_bytes(8, "little") for m in marker_pos))
    return h.digest()


def prefix_key(ids: Sequence[int], image: str | None) -> bytes:
    """The key of a prefix within one scope: its exact token ids and the image digest (or none)."""
    h = hashlib.blake2b(digest_size=32)
    h.update(len(ids).to_bytes(8, "little"))
    h.update(b"".join(int(i).to_bytes(8, "little", signed=True) for i in ids))
    h.update(b"image:" + (image.encode() if image else b"-"))
    return h.digest()


__all__ = ["PrefixState", "RowFeatures", "image_digest", "max_state_tokens", "prefix_key", "row_key", "snapshot_row",
           "stack_states", "SUPPORTED_LAYERS"]
