"""Top-layer LoRA over cached cut states: only the decoder layers above the cut run, forward and backward.

With LoRA on the top K decoder layers only (`Recipe.lora_layers`), every layer below the cut
`c = L - K` is frozen, so each row's hidden states entering layer c are a pure function of the row: the
cut-state cache (`rlcd.cut_cache`) stores them once per case prefix plus each row's suffix. A `CutBatch`
carries those states; `cut_features(model, batch)` -- reached through `DecisionModel.features` and
`forward`, so DDP wraps it unchanged -- runs layers [c, L) on them (`Family.run(..., layers=(c, L), inputs_embeds=...)`,
the decoder's own forward on a view of those layers) and returns the (h_dec, h_cand) the full forward of
the same rows gives, up to float noise:

* rows (`batch_by="row"`, and every unit that cannot share): each row's prefix and suffix states
  concatenated into its full row, right-padded, one call;
* whole cases (`batch_by="case"`): a unit's stored prefix runs once through the top layers with
  gradients and a cache (built for the stage alone; functional linear-attention layers on Qwen3.5, as in
  `case_train`), expanded to the unit's rows, and the suffixes run on it -- the prefix-sharing of
  `case_train.case_forward`, one level down, by the same `prefix_forward` fed states instead of ids. Qwen3.5 shares only prefixes on its 64-token chunk grid.

Positions are stored per token ([n, P]: P = 1 for a text decoder, 3 for Qwen3.5's M-RoPE) and laid out
as the family's forward takes them ([B, T] or [3, B, T]).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .case_train import in_row_order
from .collate import RowLabels
from .prefix_forward import read_states, run_prefixes, suffix_forward


@dataclass
class CutBatch(RowLabels):
    """A micro-batch read from the cut-state cache: per row its suffix states (and the index of its case's
    prefix in `prefixes`, or None), plus the `Batch` fields the objective and the diagnostics read (`RowLabels`)."""

    prefixes: list[tuple[torch.Tensor, torch.Tensor]]  # (states [c, H], positions [c, P]) per distinct prefix
    prefix_of: list[int | None]                        # per row: its prefix, or None (the suffix is the whole row)
    suffixes: list[tuple[torch.Tensor, torch.Tensor]]  # per row: (states [n, H], positions [n, P]) after the prefix
    decision_pos: torch.Tensor  # [B] long (full-row coordinates)
    marker_pos: torch.Tensor    # [B, Kmax] long (0 on padded candidates)
    units: list[list[int]] | None = None  # rows grouped by case (batch_by="case"); None: rows
    stored_dtype: str = field(default="float32")
    cut_layer: int | None = None  # the layer the states enter (default: the model's own cut)

    def __len__(self) -> int:
        return len(self.suffixes)


def _layout(pos: torch.Tensor) -> torch.Tensor:
    """[B, T, P] per-token positions -> the family's layout: [B, T] (P = 1) or [P, B, T]."""
    return pos[..., 0] if pos.shape[-1] == 1 else pos.permute(2, 0, 1)


def _row(batch: CutBatch, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row i's full states and positions (its prefix, if any, then its suffix)."""
    s, p = batch.suffixes[i]
    j = batch.prefix_of[i]
    if j is None:
        return s, p
    ps, pp = batch.prefixes[j]
    return torch.cat([ps, s]), torch.cat([pp, p])


def _pad(parts: list[tuple[torch.Tensor, torch.Tensor]], dev, dtype, *, left: bool = False):
    """Right- (or left-) padded states [n, T, H], positions [n, T, P] (0 on pads) and mask [n, T]."""
    t = max(s.shape[0] for s, _ in parts)
    h, p = parts[0][0].shape[1], parts[0][1].shape[1]
    states = torch.zeros((len(parts), t, h), dtype=dtype)
    pos = torch.zeros((len(parts), t, p), dtype=torch.long)
    mask = torch.zeros((len(parts), t), dtype=torch.long)
    for i, (s, q) in enumerate(parts):
        n = s.shape[0]
        sl = slice(t - n, t) if left else slice(0, n)
        states[i, sl] = s.to(dtype)
        pos[i, sl] = q.long()
        mask[i, sl] = 1
    return states.to(dev), pos.to(dev), mask.to(dev)


def _shareable(model: Any, batch: CutBatch, unit: list[int]) -> bool:
    """A unit shares its stored prefix: two rows or more, one prefix, on the family's chunk grid."""
    if len(unit) < 2:
        return False
    j = batch.prefix_of[unit[0]]
    if j is None or any(batch.prefix_of[i] != j for i in unit):
        return False
    align = model.family.exact_align
    c = batch.prefixes[j][0].shape[0]
    return not (align and c % align) and all(batch.suffixes[i][0].shape[0] >= 2 for i in unit)


def cut_features(model: Any, batch: CutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(h_dec [B, H], h_cand [B, Kmax, H]) of a CutBatch through the layers above the cut (module docstring)."""
    dev = model.device
    dtype = next(model.backbone.parameters()).dtype
    layers = (batch.cut_layer if batch.cut_layer is not None else model.cut_layer, model.num_layers)
    units = batch.units if batch.units is not None else [[i] for i in range(len(batch))]
    shared = [u for u in units if _shareable(model, batch, u)]
    solo = [i for u in units if not _shareable(model, batch, u) for i in u]
    parts: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
    if solo:
        states, pos, mask = _pad([_row(batch, i) for i in solo], dev, dtype)
        h = model.decoder_forward(None, None, mask, _layout(pos), layers=layers, inputs_embeds=states).last_hidden_state
        idx = torch.tensor(solo, dtype=torch.long)
        parts.append((solo, *read_states(h, batch.decision_pos[idx], batch.marker_pos[idx])))
    if shared:
        parts.append(_shared(model, batch, shared, layers, dev, dtype, batch.kmax))
    return in_row_order(parts, dev)


def _shared(model: Any, batch: CutBatch, units: list[list[int]], layers: tuple[int, int], dev, dtype,
            kmax: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Each unit's prefix once (left-padded, with a stage cache), then every row's suffix on its unit's cache rows
    (`prefix_forward`, fed the stored states instead of token ids)."""
    from transformers import DynamicCache

    from .case_train import functional_cache
    from .families.base import stage_config

    prefixes = [batch.prefixes[batch.prefix_of[u[0]]] for u in units]
    lens = [s.shape[0] for s, _ in prefixes]
    pstates, ppos, pmask = _pad(prefixes, dev, dtype, left=True)
    width = pstates.shape[1]
    padded = any(n != width for n in lens)
    dec = model.family.text_decoder(model.causal_lm())
    _, cache = run_prefixes(model, pmask if padded else None, _layout(ppos), embeds=pstates, layers=layers,
                            cache=functional_cache(DynamicCache(config=stage_config(dec, *layers))))
    members = [(ui, r) for ui, u in enumerate(units) for r in u]
    owner = torch.tensor([ui for ui, _ in members], dtype=torch.long, device=dev)
    sstates, spos, smask = _pad([batch.suffixes[r] for _, r in members], dev, dtype)
    h = suffix_forward(model, cache, pmask, owner, smask, _layout(spos), embeds=sstates, layers=layers)
    rows = [r for _, r in members]
    idx = torch.tensor(rows, dtype=torch.long, device=dev)
    shift = torch.tensor([lens[ui] for ui, _ in members], dtype=torch.long, device=dev)
    dpos = batch.decision_pos.to(dev)[idx] - shift
    mpos = (batch.marker_pos.to(dev)[idx] - shift[:, None]).clamp(min=0) * batch.cand_mask.to(dev)[idx]
    return (rows, *read_states(h, dpos, mpos))


__all__ = ["CutBatch", "cut_features"]
