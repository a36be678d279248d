"""Which path a group of rows sharing a state takes: one rule for serving, evaluation and training.

Running the rows' common prefix once (then each row's suffix on its cache) costs one more model call
than running them as full rows, and saves (rows - 1) * cut tokens. `CALL_OVERHEAD` is that call's
price in tokens of work; the suffix-grouping planner (`decision.plan_suffix_groups`) uses the same unit.
"""

from __future__ import annotations

CALL_OVERHEAD = 48  # one more model call costs about this many tokens of work


def sharing_pays(n_rows: int, cut: int, overhead: int = CALL_OVERHEAD) -> bool:
    """Whether running a common prefix of `cut` tokens once for `n_rows` rows beats full rows."""
    return (n_rows - 1) * cut > overhead


def request_tokens(rows) -> int:
    """`usage.input_tokens` of a request whose questions (vote orders included) are the encoded `rows` (each with
    `ids` and `decision_pos`; image tokens are in `ids`): its prompt's tokens with the part every row shares counted
    once, ``cut + sum(len(row) - cut)``, ``cut`` the rows' common token prefix up to the first decision position (a
    single row: its own tokens). A function of the request alone: neither the path the planner picks (full rows or
    a shared prefix), nor a state- or row-cache hit, nor the batch it ran in, nor the engine (torch or ONNX)
    changes it (docs/SERVING.md, "Usage")."""
    rows = list(rows)
    if not rows:
        return 0
    ids = [list(r.ids) for r in rows]
    n = min(len(x) for x in ids)
    common = next((i for i in range(n) if any(x[i] != ids[0][i] for x in ids)), n)
    cut = min(common, min(int(r.decision_pos) for r in rows))
    return cut + sum(len(x) - cut for x in ids)


__all__ = ["CALL_OVERHEAD", "request_tokens", "sharing_pays"]
