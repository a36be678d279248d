"""Rows of one state -> the ONNX graph's inputs, with the shared prefix computed once and no KV cache.

The graph is the decoder's plain forward with an explicit attention mask: inputs `input_ids [B, T]`,
`position_ids [B, T]`, `attention_mask [B, T, T]` (bool, query i may read key j) and `read_positions [B, R]`;
output `hidden [B, R, H]`, the last hidden states at the read positions. rlcd's shared-prefix layout is
then one *packed* sequence per case instead of a cache:

    tokens     prefix[0:c] | suffix_1 | suffix_2 | ... | suffix_n     (suffix_i = row_i.ids[c:])
    positions  0 .. c-1    | c .. c+|s_1|-1 | c .. c+|s_2|-1 | ...
    mask       the prefix causal; every suffix token reads the whole prefix and its own suffix causally

which is exactly what a prefix forward plus each row's suffix on its cache computes (the torch path,
`rlcd.model.runner`): every row sees its own token sequence at its own positions. The cut c is
the torch path's (`min(common prefix, smallest decision position)`) and the rule for taking it is the same
(`model.plan.sharing_pays`); a case where sharing does not pay runs one sequence per row (plain causal).
A padded token reads only itself (finite values, never read); padding is on the right.

Attention costs T^2 per packed case where the cache path costs T x |suffix|; for requests of a few
questions the shared MLP work dominates. Torch-free (numpy), like the whole serving side of the export.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from rlcd.model.plan import common_prefix_len, request_tokens, sharing_pays


@dataclass
class Sequence_:
    """One packed sequence: its token ids, positions, the allowed (query, key) blocks, and per row the
    offsets of its decision and marker tokens."""

    ids: list[int]
    positions: list[int]
    blocks: list[tuple[int, int, int]]  # (start, end, prefix): tokens [start, end) read [0, prefix) and [start, self]
    reads: list[list[int]] = field(default_factory=list)  # per row: [decision, marker_1..marker_k] offsets
    rows: list[int] = field(default_factory=list)  # the case's row index of each entry of `reads`

    def __len__(self) -> int:
        return len(self.ids)


def case_prefix_len(rows: Sequence) -> int | None:
    """The shared-prefix length of a case's rows (`EncodedRow`s), or None when full rows are cheaper
    (`rlcd.model.plan.plan_paths(path="auto")` for a text decoder)."""
    n = min(common_prefix_len([r.ids for r in rows]), min(r.decision_pos for r in rows))
    return n if sharing_pays(len(rows), n) else None


def pack_case(rows: Sequence) -> list[Sequence_]:
    """The sequences of one case: one packed sequence (prefix once + every suffix), or one per row."""
    cut = case_prefix_len(rows)
    if cut is None:
        return [Sequence_(list(r.ids), list(range(len(r))), [(0, len(r), 0)],
                          [[r.decision_pos, *r.marker_pos]], [i]) for i, r in enumerate(rows)]
    seq = Sequence_(list(rows[0].ids[:cut]), list(range(cut)), [(0, cut, 0)])
    for i, r in enumerate(rows):
        start = len(seq.ids)
        seq.ids.extend(r.ids[cut:])
        seq.positions.extend(range(cut, len(r)))
        seq.blocks.append((start, len(seq.ids), cut))
        seq.reads.append([start + p - cut for p in (r.decision_pos, *r.marker_pos)])
        seq.rows.append(i)
    return [seq]


def processed_tokens(rows: Sequence) -> int:
    """usage.input_tokens of a case, as the torch path counts it (`rlcd.model.plan.request_tokens`)."""
    return request_tokens(rows)


def group_sequences(lengths: Sequence[int], *, max_rows: int = 64, waste: float = 0.25) -> list[list[int]]:
    """Indices grouped into calls: sorted by length, a call grows while its padded tokens stay within
    `waste` of its real ones (and it holds at most `max_rows` sequences)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        if g is not None and len(g) < max_rows:
            real = sum(lengths[j] for j in g) + lengths[i]
            if (len(g) + 1) * lengths[i] <= (1 + waste) * real:
                g.append(i)
                continue
        groups.append([i])
    return groups


def feed(seqs: Sequence[Sequence_], pad_id: int) -> dict[str, np.ndarray]:
    """The graph's inputs for sequences run in one call (right-padded; reads padded with position 0)."""
    b = len(seqs)
    t = max(len(s) for s in seqs)
    r = max(sum(len(x) for x in s.reads) for s in seqs)
    ids = np.full((b, t), pad_id, dtype=np.int64)
    pos = np.zeros((b, t), dtype=np.int64)
    mask = np.zeros((b, t, t), dtype=bool)
    reads = np.zeros((b, r), dtype=np.int64)
    idx = np.arange(t)
    mask[:, idx, idx] = True  # padding reads itself
    for i, s in enumerate(seqs):
        n = len(s)
        ids[i, :n] = s.ids
        pos[i, :n] = s.positions
        for start, end, prefix in s.blocks:
            q = np.arange(start, end)[:, None]
            k = np.arange(t)[None, :]
            mask[i, start:end] = ((k >= start) & (k <= q)) | (k < prefix)
        flat = [p for x in s.reads for p in x]
        reads[i, :len(flat)] = flat
    return {"input_ids": ids, "position_ids": pos, "attention_mask": mask, "read_positions": reads}


__all__ = ["Sequence_", "case_prefix_len", "pack_case", "processed_tokens", "group_sequences", "feed", "common_prefix_len"]
