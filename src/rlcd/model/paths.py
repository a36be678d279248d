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


__all__ = ["CALL_OVERHEAD", "sharing_pays"]
