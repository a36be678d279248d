"""Planning a batch of cases over their token ids alone: which rows share a prefix, how long it is, which calls run.

One rule for serving, evaluation and training, computed without torch (the portable runtime plans with it too) and
once per call (`plan_paths`):

* the shared prefix of a case's rows (`shared_prefix_len`): their common token prefix, capped at the smallest
  decision position, so every row's decision token is computed in its own suffix (with a state cache on, also at
  the end of the state, so the prefix depends on the state and image alone); on Qwen3.5's 64-token DeltaNet chunk
  grid where asked (`align`);
* whether it pays (`sharing_pays`): running the prefix once, then each row's suffix on its cache, costs one more
  model call than running the rows whole, and saves (rows - 1) x prefix_len tokens. `CALL_OVERHEAD` is that call's
  price in tokens of work;
* how the suffixes (or full rows) are grouped into calls (`plan_suffix_groups`): fewest padded tokens plus the same
  per-call overhead;
* `request_tokens`: what `usage.input_tokens` counts, a function of the request alone.

"cut" is kept for the layer sense (the first decoder layer with LoRA, `rlcd.cut_cache`); the token sense is the
prefix length (`prefix_len`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

CALL_OVERHEAD = 48  # one more model call costs about this many tokens of work
SUFFIX_GRANULE = 32  # Qwen3.5's suffix chunk (`families.qwen35.SUFFIX_CHUNK`): plan_suffix_groups' default grid


class Row(Protocol):
    """What planning reads of an encoded row (`rlcd.model.prompt.EncodedRow`)."""

    ids: Sequence[int]
    decision_pos: int
    prefix_len: int  # the end of the state segment


class Case(Protocol):
    """What planning reads of a case (`rlcd.model.cases.CaseInputs`)."""

    rows: Sequence[Row]
    n_img: int


def sharing_pays(n_rows: int, prefix_len: int, overhead: int = CALL_OVERHEAD) -> bool:
    """Whether running a common prefix of `prefix_len` tokens once for `n_rows` rows beats full rows."""
    return (n_rows - 1) * prefix_len > overhead


def request_tokens(rows) -> int:
    """`usage.input_tokens` of a request whose questions (vote orders included) are the encoded `rows` (each with
    `ids` and `decision_pos`; image tokens are in `ids`): its prompt's tokens with the part every row shares counted
    once, ``p + sum(len(row) - p)``, ``p`` the rows' common token prefix up to the first decision position (a
    single row: its own tokens). A function of the request alone: neither the path the planner picks (full rows or
    a shared prefix), nor a state- or row-cache hit, nor the batch it ran in, nor the engine (torch or ONNX)
    changes it (docs/SERVING.md, "Usage")."""
    rows = list(rows)
    if not rows:
        return 0
    ids = [list(r.ids) for r in rows]
    n = min(len(x) for x in ids)
    common = next((i for i in range(n) if any(x[i] != ids[0][i] for x in ids)), n)
    p = min(common, min(int(r.decision_pos) for r in rows))
    return p + sum(len(x) - p for x in ids)


def common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    """The length of the longest common prefix of `seqs`."""
    first = seqs[0]
    n = min(len(s) for s in seqs)
    for i in range(n):
        x = first[i]
        if any(s[i] != x for s in seqs):
            return i
    return n


def _on_grid(prefix_len: int, n_img: int, align: int | None) -> int:
    """`prefix_len` moved down onto the `align` grid, unless that would leave no token (or not the whole image)."""
    if align:
        aligned = (prefix_len // align) * align
        if aligned >= (n_img + 2 if n_img else 1):
            return aligned
    return prefix_len


def shared_prefix_len(rows: Sequence[Row], n_img: int = 0, *, align: int | None = None, state: bool = False) -> int:
    """The rows' shared-prefix length: their common token prefix, never past any row's decision position (`state`:
    nor past the end of the state segment); moved down onto the `align` grid (Qwen3.5's DeltaNet chunk) when given."""
    n = min(common_prefix_len([r.ids for r in rows]), min(r.decision_pos for r in rows))
    if state:
        n = min(n, min(r.prefix_len for r in rows))
    return _on_grid(n, n_img, align)


@dataclass(frozen=True)
class Plan:
    """Per case: the shared-prefix length it runs with, or None for full rows (`prefix_len`); `off`: the same with
    the state cache off (what a cold case would have done without it; equal to `prefix_len` when no cache is on)."""

    prefix_len: list[int | None]
    off: list[int | None]


def plan_paths(cases: Sequence[Case], *, align: int | None = None, path: str = "auto", overhead: int = CALL_OVERHEAD,
               state_prefix: bool = False, max_state_tokens: int | None = None) -> Plan:
    """Per case: the shared-prefix length, or None for full rows; each case's common prefix computed once.

    `path="auto"`: a case takes the prefix path only when it saves more than one call's overhead (`overhead` token
    equivalents, as in `plan_suffix_groups`): the shared prefix computed once instead of once per row saves
    (rows - 1) * prefix_len tokens, while the prefix path costs one extra call. So a single-question case, or one
    whose suffixes dominate (a short shared prefix), runs as full rows. `"prefix"` / `"full"` force a path
    (benchmarks, tests). `align`: the chunk grid the prefix is moved onto (`exact` scoring on Qwen3.5), or None.

    `state_prefix` (a state cache is on): the prefix stops at the end of the state (`EncodedRow.prefix_len`), so it
    depends on the state and image alone and a later request about them finds it; the rule counts one later reuse of
    the prefix, `rows * prefix_len > overhead`, so a single question about a long state takes the prefix path and
    leaves its state in the cache -- unless the prefix is longer than a stored state can be (`max_state_tokens`:
    Gemma 3's sliding window less one, 511 tokens on the 270M): that state is never kept, so no reuse is counted and
    the case plans as with the cache off (no extra call). `Plan.off` is then the cache-off plan of the same cases.
    """
    if path not in ("auto", "prefix", "full"):
        raise ValueError(f"path must be 'auto', 'prefix' or 'full', not {path!r}")
    run: list[int | None] = []
    off: list[int | None] = []

    def choose(c: Case, n_rows: int, n: int) -> int | None:
        if path == "auto" and not sharing_pays(n_rows, n, overhead):
            return None
        if c.n_img and n < c.n_img + 2:  # the image is encoded once, so it must lie inside the prefix
            raise RuntimeError("shared prefix does not cover the image")
        return n

    for c in cases:
        if path == "full" or not c.rows:
            run.append(None)
            off.append(None)
            continue
        common = min(common_prefix_len([r.ids for r in c.rows]), min(r.decision_pos for r in c.rows))
        own = _on_grid(common, c.n_img, align)
        if not state_prefix:
            run.append(choose(c, len(c.rows), own))
            continue
        n = _on_grid(min(common, min(r.prefix_len for r in c.rows)), c.n_img, align)
        reuse = max_state_tokens is None or n <= max_state_tokens
        run.append(choose(c, len(c.rows) + int(reuse), n))
        off.append(choose(c, len(c.rows), own) if path == "auto" else run[-1])
    return Plan(run, off if state_prefix else run)


def plan_suffix_groups(lengths: Sequence[int], *, max_rows: int = 64, overhead: int = CALL_OVERHEAD,
                       granule: int = SUFFIX_GRANULE) -> list[list[int]]:
    """Split rows into batched calls by suffix length, minimising padded work + a per-call overhead.

    Rows are sorted by length; a dynamic programme picks contiguous groups (at most `max_rows` rows)
    minimising sum(rows_in_group * padded_longest_in_group + overhead), where lengths are rounded up
    to the DeltaNet chunk (`granule`; the CPU reference kernel pads every row to it; 1 for a decoder
    without chunked recurrent layers) and `overhead`
    is the measured fixed cost of one call in token equivalents (~6 ms = ~50 tokens on 2 CPU cores,
    hidden 256). Similar lengths give one call; mixed lengths (e.g. 27..82 tokens) a few.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    ls = [-(-lengths[i] // granule) * granule for i in order]
    n = len(ls)
    best = [0.0] + [math.inf] * n
    start = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(max(0, j - max_rows), j):
            c = best[i] + (j - i) * ls[j - 1] + overhead
            if c < best[j]:
                best[j], start[j] = c, i
    groups, j = [], n
    while j > 0:
        groups.append(order[start[j]:j])
        j = start[j]
    return groups[::-1]


__all__ = ["CALL_OVERHEAD", "Plan", "common_prefix_len", "plan_paths", "plan_suffix_groups", "request_tokens",
           "shared_prefix_len", "sharing_pays"]
