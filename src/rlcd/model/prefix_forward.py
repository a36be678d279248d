"""The prefix-then-suffixes forward, written once: inference, case training and cut-state training call it.

Rows that share a state share the tokens before their questions. The shared forward runs each case's prefix once,
keeps its cache, gives every row its own case's cache row and runs the rows' suffixes on it: each row then sees its
own token sequence at its own positions, as a full forward of it would (up to float noise). Three callers:

* inference (`rlcd.model.runner`: serving, evaluation, feature and cut-state extraction): token ids, the decoder's
  own cache (or one stacked from stored states), no gradients, suffixes grouped into several calls;
* case training (`rlcd.model.case_train`, `Recipe.batch_by="case"`): token ids, a cache autograd can go through
  (`case_train.new_training_cache`), gradients through the suffixes into the prefix, one suffix call;
* cut-state training (`rlcd.model.cut_forward`): hidden states entering the cut layer instead of ids
  (`embeds`), the layers above the cut only (`layers`), a stage cache of those layers.

What differs is a parameter: ids or embeddings, the cache (`cache=None`: the decoder makes one), the layer range.
The pieces: `prefix_positions` / `left_pad` (prefixes left-padded into one batch, pads masked and at position 0),
`run_prefixes` (the prefix forward, keeping its cache), `cache_rows` (the only place a cache's rows are selected or
forked: `Family.select_cache_rows` reorders in place, `fork_cache_rows` copies the selected rows so that the
in-place recurrent-state updates of one suffix call cannot reach the next), `suffix_forward` (the suffixes on their
rows, the prefix's mask in front of theirs) and `read_states` (the decision and marker states of each row).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .families.base import fork_cache_rows, out_cache

ROWS = ("select", "fork", "as_is")  # how `suffix_forward` gets its cache rows


def prefix_positions(model: Any, ids: Sequence[int], grid: torch.Tensor | None) -> torch.Tensor:
    """The positions of one prefix as the family lays them out ([1, n], or [3, 1, n] for M-RoPE)."""
    t = torch.tensor([list(ids)], dtype=torch.long, device=model.device)
    image_mask = t == model.image_token_id if model.image_token_id is not None else None
    return model.family.full_positions(t, image_mask, grid, model.merge_size)


def left_pad(model: Any, prefixes: Sequence[Sequence[int]], positions: Sequence[torch.Tensor],
             width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [n, width], mask [n, width], positions) of prefixes left-padded to `width`: pads are the pad token,
    masked, at position 0."""
    dev = model.device
    ids = torch.full((len(prefixes), width), model.encoder.pad_id, dtype=torch.long, device=dev)
    mask = torch.zeros((len(prefixes), width), dtype=torch.long, device=dev)
    for j, p in enumerate(prefixes):
        ids[j, width - len(p):] = torch.tensor(list(p), dtype=torch.long, device=dev)
        mask[j, width - len(p):] = 1
    pos = torch.cat([torch.nn.functional.pad(q, (width - len(p), 0)) for p, q in zip(prefixes, positions)], dim=-2)
    return ids, mask, pos


def run_prefixes(model: Any, mask: torch.Tensor | None, positions: torch.Tensor, *, ids: torch.Tensor | None = None,
                 embeds: torch.Tensor | None = None, image_features: torch.Tensor | None = None, cache: Any = None,
                 layers: tuple[int, int] | None = None) -> tuple[Any, Any]:
    """The prefix forward (token `ids`, or `embeds`: the states entering `layers[0]`) keeping its cache: `cache`, or
    the one the decoder makes when None. `mask`: None when no prefix is padded. Returns (output, cache)."""
    out = model.decoder_forward(ids, image_features, mask, positions, cache=cache, use_cache=True, layers=layers,
                                inputs_embeds=embeds)
    cache = cache if cache is not None else out_cache(out)
    if cache is None:
        raise RuntimeError("the language model returned no cache")
    return out, cache


def cache_rows(model: Any, cache: Any, owner: torch.Tensor, rows: str = "select") -> Any:
    """Row i of the result is row `owner[i]` of `cache` (rows repeat: a case's prefix for each of its rows).

    `select`: `cache` itself, reordered in place (`Family.select_cache_rows`, an `index_select`: differentiable);
    `fork`: a new cache of copies of those rows, `cache` left as it was (a later call still reads it); `as_is`:
    `cache` unchanged (its rows are already in order)."""
    if rows not in ROWS:
        raise ValueError(f"rows must be one of {ROWS}, not {rows!r}")
    if rows == "as_is":
        return cache
    if rows == "fork":
        return fork_cache_rows(cache, owner)
    return model.family.select_cache_rows(cache, owner, model.device)


def suffix_forward(model: Any, cache: Any, prefix_mask: torch.Tensor, owner: torch.Tensor, suffix_mask: torch.Tensor,
                   positions: torch.Tensor, *, ids: torch.Tensor | None = None, embeds: torch.Tensor | None = None,
                   rows: str = "select", layers: tuple[int, int] | None = None,
                   chunk_size: int | None = None) -> torch.Tensor:
    """Last hidden states [n, s, H] of n suffixes (`ids` or `embeds`, right-padded: `suffix_mask` [n, s]), row i on
    the prefix cache row `owner[i]` (`cache_rows(rows=...)`), reading that prefix's mask before its own."""
    rowed = cache_rows(model, cache, owner, rows)
    attn = torch.cat([prefix_mask[owner], suffix_mask], dim=1)
    return model.decoder_forward(ids, None, attn, positions, cache=rowed, use_cache=True, chunk_size=chunk_size,
                                 layers=layers, inputs_embeds=embeds).last_hidden_state


def read_states(h: torch.Tensor, decision: Any, markers: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [n, decision[i]], h [n, markers[i, k]]) of states `h` [n, T, H]: each row's decision state [n, H] and
    marker states [n, K, H]. The positions (lists or tensors) are moved to `h`'s device first: built on the host,
    they failed to index CUDA states (found in cut_forward, now the rule for every caller)."""
    dev = h.device
    d = torch.as_tensor(decision, dtype=torch.long).to(dev)
    m = torch.as_tensor(markers, dtype=torch.long).to(dev)
    r = torch.arange(h.shape[0], device=dev)
    return h[r, d], h[r[:, None], m]


__all__ = ["cache_rows", "left_pad", "prefix_positions", "read_states", "run_prefixes", "suffix_forward"]
