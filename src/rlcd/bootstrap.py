"""The grouped bootstrap: resample whole isolation groups (source cases) with replacement.

Rows of one source case (``case_id``: the questions asked about one state) are not independent
draws, so every interval in rlcd resamples cases, never rows: a drawn case brings all its rows, as
often as it is drawn. ``rlcd compare`` (paired differences between runs) and the evaluation's
intervals (``rlcd.uncertainty``) share these primitives.

A resample is ``n_groups`` group indices drawn uniformly with replacement (``draw_groups``, numpy
``default_rng(seed)``); ``group_counts`` turns a block of resamples into how often each group was
drawn, so any statistic built from per-group sums is one matrix product per block of resamples.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

_MAX_CHUNK_CELLS = 2_000_000


def group_key(row: Mapping[str, Any]) -> str:
    """Isolation group of a row: its ``case_id`` if set, else the id prefix before ':', else the id."""
    case_id = row.get("case_id")
    if case_id is not None and str(case_id) != "":
        return str(case_id)
    rid = str(row["id"])
    return rid.split(":", 1)[0] if ":" in rid else rid


def group_codes(groups: Sequence[Any] | np.ndarray | None, n: int) -> tuple[np.ndarray, int]:
    """Integer code per row (groups numbered in order of first appearance) and the group count.

    ``groups=None`` makes every row its own group.
    """
    if groups is None:
        return np.arange(n), n
    groups = np.asarray(groups)
    if groups.shape != (n,):
        raise ValueError(f"groups must have shape ({n},), got {groups.shape}")
    _, first, inverse = np.unique(groups, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return rank[inverse.reshape(-1)], int(order.size)


def draw_groups(rng: np.random.Generator, n_groups: int, size: int) -> np.ndarray:
    """``[size, n_groups]`` group indices drawn with replacement (one bootstrap resample per row)."""
    return rng.integers(0, n_groups, size=(size, n_groups))


def group_counts(drawn: np.ndarray, n_groups: int) -> np.ndarray:
    """``[size, n_groups]`` float64: how often each group was drawn in each resample of ``drawn``."""
    drawn = np.asarray(drawn)
    size = drawn.shape[0]
    flat = (drawn + np.arange(size)[:, None] * n_groups).ravel()
    return np.bincount(flat, minlength=size * n_groups).reshape(size, n_groups).astype(np.float64)


def chunk_size(n_groups: int) -> int:
    """Resamples per block so that a block's ``[size, n_groups]`` arrays stay near 2 million cells."""
    return max(1, _MAX_CHUNK_CELLS // max(1, n_groups))


def resample_indices(codes: np.ndarray, drawn: np.ndarray) -> np.ndarray:
    """Row indices of one resample: every member of every drawn group, once per draw of that group."""
    codes = np.asarray(codes)
    order = np.argsort(codes, kind="stable")
    sizes = np.bincount(codes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return np.concatenate([order[starts[g]: starts[g] + sizes[g]] for g in drawn]) if drawn.size else order[:0]


def bootstrap_means(
    d: np.ndarray, *, resamples: int = 5000, seed: int = 0, groups: Sequence[Any] | np.ndarray | None = None
) -> np.ndarray:
    """Bootstrap distribution of the mean of ``d`` (rows, or whole groups, resampled with replacement).

    Resample r draws ``n_groups`` groups with :func:`draw_groups` (``rng = default_rng(seed)``, in
    chunks of resamples) and returns ``mean(d[resample_indices(codes, drawn_r)])``, computed from per-group
    sums and sizes.
    """
    d = np.asarray(d, dtype=np.float64)
    if d.ndim != 1 or d.size == 0:
        raise ValueError("need a non-empty 1-D array of paired differences")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    codes, n_groups = group_codes(groups, d.size)
    sums = np.bincount(codes, weights=d, minlength=n_groups)
    sizes = np.bincount(codes, minlength=n_groups).astype(np.float64)
    rng = np.random.default_rng(seed)
    chunk = chunk_size(n_groups)
    out = np.empty(resamples, dtype=np.float64)
    for lo in range(0, resamples, chunk):
        m = min(chunk, resamples - lo)
        drawn = draw_groups(rng, n_groups, m)
        out[lo: lo + m] = sums[drawn].sum(axis=1) / sizes[drawn].sum(axis=1)
    return out
