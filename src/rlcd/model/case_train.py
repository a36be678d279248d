"""Training through shared prefixes (`Recipe.batch_by = "case"`): one state forward per case, with gradients.

A `CaseBatch` is a `Batch` (right-padded full rows, targets, masks: everything the objective and the
diagnostics read) whose rows come in *units*: contiguous row ranges that share a state (and image).
`case_forward(model, batch)` -- reached through `DecisionModel.forward`, so DDP wraps it unchanged --
returns the same logits [B, Kmax] as the full-row forward of the same rows:

* units of two or more rows: every unit's prefix (the common token prefix, capped at the smallest
  decision position) in one left-padded forward *with* gradients and a cache; the cache rows expanded
  to the unit's rows (`prefix_forward.cache_rows`, an `index_select`); all suffixes in one right-padded
  call on that cache (`prefix_forward.suffix_forward`, the forward inference and cut-state training run
  too). The loss backpropagates through the suffixes into the prefix.
* one-row units, units whose shared prefix saves less than a call costs (`plan.sharing_pays`, as
  in serving and evaluation), and Qwen3.5 units whose prefix is shorter than one DeltaNet chunk: plain
  full rows in one more call (a prefix call plus a suffix call would cost more).
* one head call over all rows in batch order, exactly as `DecisionModel.forward` makes it (the
  centring accumulators see the same features).

Qwen3.5 (hybrid cache). transformers' `LinearAttentionLayer.update_conv_state` / `update_recurrent_state`
`copy_` the new states into static buffers (kept for CUDA graphs): autograd refuses the backward
("modified by an inplace operation"). `functional_cache(cache)` turns the layers of one cache, built
here, into a subclass that assigns the new tensors instead; no other cache is touched (serving keeps
the static buffers). The shared prefix is moved down onto the DeltaNet chunk grid (`Family.exact_align`, 64) and
the suffixes run with the default chunk, so every chunk of the recurrent scan covers the same tokens as
in a full row. Why, measured in float64 on the random `tiny` preset (`benchmarks/case_train_residue.py`):

* the 6e-8 relative float64 loss residue of the first probe (QWEN35-NOTES.md) is the size of one
  float32 rounding (2**-24 = 6.0e-8), not a path error: the candidate scorer computes in FP32 by design
  (a float64 backbone still gives a float32 loss), and transformers' reference
  `torch_chunk_gated_delta_rule` casts its inputs to float32 whatever the model dtype. Here the two
  paths' float64 losses agree exactly; with that kernel made float64 the shared path equals full rows
  (logits identical, gradients 1e-8 relative; worst tensor 6e-8 on the chunk grid, 9e-7 off it).
* the ~1e-3 gradient differences sit in the decay gate's LoRA (`linear_attn.in_proj_a`): its float32
  gradient is mostly rounding on this preset, whose decays are extreme (the full-row gradient itself
  is 0.87 relative away from the float64 kernel's). Any other summation order moves it: the shared
  path sums the state's gradient over a case's rows before it flows into the prefix. Off the chunk
  grid the difference is several times larger (tiny: 0.31 vs 0.06 on the grid; tiny-toy in float32:
  1.3e-3 vs 1.7e-4, where batched vs one-row-at-a-time full rows differ by 1.1e-5). The whole
  gradient agrees within 1e-6, every other tensor within 1e-4 (tested).

Text decoders: `DynamicCache` grows by `torch.cat` and expands by `index_select`, both differentiable,
so no change is needed (the gradient parity is tested).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Sequence

import torch

from ..schema import Record
from .collate import Batch, Collator, moved, n_image_tokens, pad_rows, process_images
from .plan import shared_prefix_len, sharing_pays
from .prefix_forward import left_pad, prefix_positions, read_states, run_prefixes, suffix_forward
from .prompt import EncodedRow


# ----------------------------------------------------------------------------------------------
# the batch


@dataclass
class Unit:
    """Rows [start, end) of a CaseBatch: one state (one image) whose prefix may be shared."""

    start: int
    end: int
    pixel_values: torch.Tensor | None = None
    grid: torch.Tensor | None = None
    n_img: int = 0

    def __len__(self) -> int:
        return self.end - self.start


@dataclass
class CaseBatch(Batch):
    """A `Batch` of full rows grouped into `units` (see the module docstring); `rows` are the encoded rows."""

    units: list[Unit] = field(default_factory=list)
    rows: list[EncodedRow] = field(default_factory=list)

    def to(self, device: Any, non_blocking: bool = False) -> "CaseBatch":
        return moved(self, device, non_blocking)


def collate_cases(collator: Collator, units: Sequence[Sequence[Record]]) -> CaseBatch:
    """Records grouped by case -> a CaseBatch (rows in unit order; an image is loaded once per unit).

    A unit whose rows hold different images is split by image (rows sharing tokens but not pixels must
    not share a prefix)."""
    enc = collator.encoder
    rows: list[EncodedRow] = []
    recs: list[Record] = []
    out_units: list[Unit] = []
    for unit in units:
        by_image: dict[Any, list[Record]] = {}
        for rec in unit:
            by_image.setdefault(rec.image, []).append(rec)
        for image, members in by_image.items():
            pv = grid = None
            n_img = 0
            if image:
                enc.refuse_image(members[0].id)
                if collator.image_processor is None:
                    from ..schema import RecordError

                    raise RecordError(members[0].id, "image", "this collator has no image processor")
                pv, grid = process_images(collator.image_processor, [collator.load_image(members[0])])
                n_img = n_image_tokens(grid[0].tolist(), collator.merge_size)
            start = len(rows)
            for rec in members:
                rows.append(enc.encode(rec.state, rec.question, n_image_tokens=n_img, row=rec.id))
                recs.append(rec)
            out_units.append(Unit(start, len(rows), pv, grid, n_img))
    if not rows:
        raise ValueError("cannot collate an empty list of cases")
    b = pad_rows(rows, pad_id=enc.pad_id, image_pad_id=enc.image_pad_id, targets=[r.target for r in recs],
                 types=[r.question.type for r in recs], ids=[r.id for r in recs],
                 groups=[r.group or r.sampling_group for r in recs])
    return CaseBatch(**{f.name: getattr(b, f.name) for f in fields(Batch)}, units=out_units, rows=rows)


# ----------------------------------------------------------------------------------------------
# a cache autograd can go through


def _functional_class(cls: type) -> type:
    """`cls` (a transformers linear-attention cache layer) with out-of-place state updates."""

    def update_conv_state(self, conv_states, state_idx=0, conv_kernel_size=None, **kwargs):
        if self.record_past:
            raise RuntimeError("the functional cache does not record the past")
        if not self.is_conv_states_initialized[state_idx]:
            if self.device is None:
                self.dtype, self.device = conv_states.dtype, conv_states.device
            self.conv_kernel_size[state_idx] = conv_states.shape[-1] if conv_kernel_size is None else conv_kernel_size
            self.is_conv_states_initialized[state_idx] = True
        k = self.conv_kernel_size[state_idx]
        if not self.has_previous_state[state_idx]:
            full = conv_states
            self.has_previous_state[state_idx] = True
            if full.shape[-1] < k:
                full = torch.nn.functional.pad(full, (k - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([self.conv_states[state_idx], conv_states], dim=-1)
        self.conv_states[state_idx] = full[..., -k:]
        return full

    def update_recurrent_state(self, recurrent_states, state_idx=0, **kwargs):
        self.recurrent_states[state_idx] = recurrent_states
        self.is_recurrent_states_initialized[state_idx] = True
        return recurrent_states

    return type(f"Functional{cls.__name__}", (cls,), {"update_conv_state": update_conv_state,
                                                       "update_recurrent_state": update_recurrent_state,
                                                       "__doc__": "out-of-place state updates (training)"})


_FUNCTIONAL: dict[type, type] = {}


def functional_cache(cache: Any) -> Any:
    """Give this cache's linear-attention layers out-of-place state updates (in place; returns it)."""
    try:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin
    except ImportError:  # a transformers without linear-attention caches: nothing to change
        return cache
    for layer in getattr(cache, "layers", []):
        if isinstance(layer, LinearAttentionCacheLayerMixin) and type(layer) not in _FUNCTIONAL.values():
            cls = type(layer)
            if cls not in _FUNCTIONAL:
                _FUNCTIONAL[cls] = _functional_class(cls)
            layer.__class__ = _FUNCTIONAL[cls]
    return cache


def new_training_cache(model: Any) -> Any:
    """An empty `DynamicCache` for the model's text config, with functional linear-attention layers."""
    from transformers import DynamicCache

    return functional_cache(DynamicCache(config=model.family.text_config(model.causal_lm())))


# ----------------------------------------------------------------------------------------------
# the forward


def unit_prefix_len(model: Any, rows: Sequence[EncodedRow], n_img: int) -> int | None:
    """The shared-prefix length of a unit for training, or None when its rows run as full rows.

    The common prefix capped at the smallest decision position (`plan.shared_prefix_len`), on the family's
    chunk grid when it has one (Qwen3.5: 64): None for one row, when no grid point lies past the image
    (a short state: full rows are exact and barely dearer), or when sharing saves less than the extra
    call costs (`sharing_pays`, the rule serving and evaluation use)."""
    if len(rows) < 2:
        return None
    align = model.family.exact_align
    n = shared_prefix_len(rows, n_img, align=align)
    if n < 1 or (align and n % align) or (n_img and n < n_img + 2) or not sharing_pays(len(rows), n):
        return None
    return n


def case_forward(model: Any, batch: CaseBatch) -> torch.Tensor:
    """Logits [B, Kmax] of a CaseBatch: shared prefixes with gradients (see the module docstring)."""
    dev = model.device
    shared, solo = [], []
    for u in batch.units:
        n = unit_prefix_len(model, batch.rows[u.start:u.end], u.n_img)
        if n is None:
            solo.append(u)
        else:
            shared.append((u, n))
    kmax = batch.kmax
    parts: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
    if solo:
        idx = [i for u in solo for i in range(u.start, u.end)]
        with_img = [u for u in solo if u.pixel_values is not None]
        sub = pad_rows([batch.rows[i] for i in idx], pad_id=model.encoder.pad_id,
                       image_pad_id=model.encoder.image_pad_id,
                       pixel_values=torch.cat([u.pixel_values for u in with_img for _ in range(len(u))])
                       if with_img else None,
                       image_grid_thw=torch.cat([u.grid.repeat(len(u), 1) for u in with_img]) if with_img else None)
        h_dec, h_cand = model.features(sub)
        parts.append((idx, h_dec, _pad_k(h_cand, kmax)))
    if shared:
        parts.append(_shared_features(model, batch, shared, kmax))
    h_dec, h_cand = in_row_order(parts, dev)
    return model.head(h_dec, h_cand, batch.cand_mask.to(dev))


def in_row_order(parts: Sequence[tuple[list[int], torch.Tensor, torch.Tensor]],
                 dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(h_dec, h_cand) of a batch in row order from parts computed apart: each `(rows, h_dec, h_cand)`, the
    features of the batch rows `rows` in that order (the rows of all parts: each row once)."""
    order = [i for rows, _, _ in parts for i in rows]
    inv = torch.empty(len(order), dtype=torch.long)
    inv[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    inv = inv.to(dev)
    return (torch.cat([p[1] for p in parts]).index_select(0, inv),
            torch.cat([p[2] for p in parts]).index_select(0, inv))


def _pad_k(h_cand: torch.Tensor, kmax: int) -> torch.Tensor:
    k = h_cand.shape[1]
    return h_cand if k == kmax else torch.nn.functional.pad(h_cand, (0, 0, 0, kmax - k))


def _shared_features(model: Any, batch: CaseBatch, shared: list[tuple[Unit, int]],
                     kmax: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Every shared unit's prefix in one left-padded forward with gradients and a training cache, then all their
    rows' suffixes in one call on it (`prefix_forward`)."""
    dev, family, enc = model.device, model.family, model.encoder
    lens = [n for _, n in shared]
    width = max(lens)
    padded = any(n != width for n in lens)  # on the chunk grid for Qwen3.5: left pads are whole chunks
    prefixes = [batch.rows[u.start].ids[:n] for u, n in shared]
    positions = [prefix_positions(model, p, u.grid) for p, (u, _) in zip(prefixes, shared)]
    next_pos = [int(p.max()) + 1 for p in positions]
    feats = [model.image_features(u.pixel_values, u.grid) for u, _ in shared if u.pixel_values is not None]
    pids, pmask, ppos = left_pad(model, prefixes, positions, width)
    _, cache = run_prefixes(model, pmask if padded else None, ppos, ids=pids,
                            image_features=torch.cat(feats) if feats else None, cache=new_training_cache(model))
    members = [(ui, r) for ui, (u, _) in enumerate(shared) for r in range(u.start, u.end)]
    owner = torch.tensor([ui for ui, _ in members], dtype=torch.long, device=dev)
    n = len(members)
    suf = [batch.rows[r].ids[lens[ui]:] for ui, r in members]
    s_max = max(len(x) for x in suf)
    if min(len(x) for x in suf) < 2:
        raise RuntimeError("a suffix of one token would take the in-place single-token cache path")
    sids = torch.full((n, s_max), enc.pad_id, dtype=torch.long, device=dev)
    smask = torch.zeros((n, s_max), dtype=torch.long, device=dev)
    for i, x in enumerate(suf):
        sids[i, :len(x)] = torch.tensor(x, dtype=torch.long, device=dev)
        smask[i, :len(x)] = 1
    pos = torch.cat([family.suffix_positions(1, s_max, next_pos[ui], dev) for ui, _ in members], dim=-2)
    h = suffix_forward(model, cache, pmask, owner, smask, pos, ids=sids)
    mpos = [[0] * kmax for _ in members]
    for i, (ui, r) in enumerate(members):
        mpos[i][:batch.rows[r].k] = [m - lens[ui] for m in batch.rows[r].marker_pos]
    h_dec, h_cand = read_states(h, [batch.rows[r].decision_pos - lens[ui] for ui, r in members], mpos)
    return [r for _, r in members], h_dec, h_cand


__all__ = ["CaseBatch", "Unit", "collate_cases", "case_forward", "functional_cache", "new_training_cache",
           "unit_prefix_len"]
