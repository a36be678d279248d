"""Scoring records case by case through shared prefixes (evaluation, calibration, dev evaluation).

Records of one case (`Record.case_id`, one state and image) hold several questions about one state;
a full-row forward pays for that state once per question. `score_records` groups the records into
cases (a record without `case_id` is a case of its own; records that share a `case_id` but not the
state or image are kept apart), packs whole cases into model calls of at most `max_rows` rows and
`max_tokens` processed tokens (cases sorted by length, so a call's prefixes are padded little), and
scores each call with `CaseRunner.score_cases`: the prefixes in one forward, every question as a
suffix on its case's cache, or full rows where the planner finds that cheaper (a single question).
The logits come back in input order and equal the full-row ones up to float32 noise.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

import torch

from ..schema import Record
from .decision import DecisionModel


def group_cases(records: Sequence[Record]) -> list[list[int]]:
    """Indices of `records` grouped by case, in order of first appearance (rows in input order)."""
    groups: dict[Any, list[int]] = {}
    for i, rec in enumerate(records):
        case = rec.case_id if rec.case_id is not None else ("row", i)
        key = (case, rec.image, json.dumps(rec.state, sort_keys=True, ensure_ascii=False))
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def pack_cases(sizes: Sequence[tuple[int, int]], *, max_rows: int, max_tokens: int) -> list[list[int]]:
    """Consecutive runs of cases (given as (rows, tokens)) of at most `max_rows` rows and `max_tokens`
    tokens each; a case larger than either bound makes a call of its own."""
    calls: list[list[int]] = []
    rows = tokens = 0
    for i, (r, t) in enumerate(sizes):
        if calls and calls[-1] and (rows + r > max_rows or tokens + t > max_tokens):
            calls.append([])
            rows = tokens = 0
        if not calls:
            calls.append([])
        calls[-1].append(i)
        rows, tokens = rows + r, tokens + t
    return calls


def score_records(model: DecisionModel, records: Sequence[Record], *, image_root: Any = None, max_rows: int = 64,
                  max_tokens: int = 16384, path: str = "auto",
                  on_rows: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """Logits [k] (float32, CPU) per record, in input order, scored case by case (module docstring).

    `on_rows(n)` is called after each model call with the number of rows it scored (progress).
    `path`: "auto" (the planner), "prefix" or "full" (forced; see `rlcd.model.plan.plan_paths`).
    """
    from .runner import CaseRunner

    runner = CaseRunner(model)
    records = list(records)
    groups = group_cases(records)
    cases = [runner.cases.from_records([records[i] for i in g], image_root) for g in groups]
    # long states together: a call's prefixes are left-padded to its longest
    order = sorted(range(len(cases)), key=lambda c: (len(cases[c].rows[0]), c))
    sizes = [(len(cases[c].rows), cases[c].n_tokens) for c in order]
    out: list[torch.Tensor | None] = [None] * len(records)
    for call in pack_cases(sizes, max_rows=max_rows, max_tokens=max_tokens):
        chosen = [order[j] for j in call]
        scored = runner.score_cases([cases[c] for c in chosen], max_rows=max_rows, path=path)
        n = 0
        for c, (logits, _) in zip(chosen, scored):
            for i, lg in zip(groups[c], logits):
                out[i] = lg
            n += len(logits)
        if on_rows is not None:
            on_rows(n)
    return out  # type: ignore[return-value]


@torch.no_grad()
def full_row_logits(model: Any, collator: Any, records: Sequence[Record], *, batch_size: int, device: Any,
                    on_rows: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """The reference: every record as a full row, `batch_size` rows per forward; logits [k] in input order."""
    records = list(records)
    out: list[torch.Tensor] = []
    for i in range(0, len(records), batch_size):
        chunk = records[i:i + batch_size]
        host = model(collator(chunk).to(device)).float().cpu()
        out += [host[j, :rec.question.k] for j, rec in enumerate(chunk)]
        if on_rows is not None:
            on_rows(len(chunk))
    return out


__all__ = ["group_cases", "pack_cases", "score_records", "full_row_logits"]
