"""Where `(h_dec, h_cand)` come from: the one seam between the training code and the backbone.

Setup chooses the sources once (`plan_sources`); the session, the dev evaluation and the loop ask the
plan, never a mode flag. A source turns rows into what `DecisionModel.forward` takes and scores records
for an evaluation:

    LiveSource      the backbone runs: token batches of rows, or with `batch_by="case"` whole cases whose
                    state runs once (`rlcd.model.case_train`). `frozen`: the head alone learns (a head
                    phase run with --no-cache), no gradient reaches the backbone and choice rows keep the
                    feature cache's fixed candidate orders, so both paths see the same rows (`fixed`: so do
                    a `lora_layers` run's, with --no-cache, for the cut-state cache's orders).
    CachedFeatures  the data directory's feature cache (`rlcd.features`): the backbone does not run.
    CutStates       the cut-state cache (`rlcd.cut_cache`) + the decoder layers above the cut, live and with
                    LoRA (`Recipe.lora_layers`): rows, or whole cases sharing each stored prefix.

`SourcePlan` holds the head-phase source (while only the head learns: `Recipe.head_phase`) and the main
one (after). Update `step` takes the head-phase source while `step < until`; the evaluation after `done`
updates while `done <= until`, because the first LoRA update is the one that moves the features.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from rlcd.schema import Record


class Source(Protocol):
    name: str           # "live" | "features": recorded in the session event
    frozen: bool        # no gradient reaches the backbone (the head learns alone)
    fixed_orders: bool  # choice rows take one of the cache's fixed candidate orders (else a fresh shuffle)
    by_case: bool       # training micro-batches are whole cases (rows() is still used for row batches)

    def rows(self, split: str, rows: Sequence[Record], orders: Sequence[int]) -> Any:
        """The micro-batch of `rows` (already in their candidate orders `orders`), on the model's device."""

    def cases(self, units: Sequence[Sequence[Record]], orders: Sequence[Sequence[int]]) -> Any:
        """A micro-batch of whole cases (only when `by_case`; rows in their orders, as for `rows`)."""

    def logits(self, model, split: str, records: Sequence[Record], *,
               on_rows: Callable[[int], None] | None = None) -> list[torch.Tensor]:
        """Each record's logits over its K candidates (given order; float32, CPU), the model as it is (put it in
        eval mode first); `on_rows(n)` after each model call that scored n rows (progress)."""


@dataclass
class LiveSource:
    """The backbone runs on token batches (the pinned recipe's source)."""

    collator: Any
    device: torch.device
    batch_by: str = "row"
    frozen: bool = False
    max_rows: int = 64  # rows per scoring call
    fixed: bool = False  # the cut-state cache's fixed orders, so that --no-cache trains on the same rows
    name: str = "live"

    @property
    def fixed_orders(self) -> bool:
        return self.frozen or self.fixed

    @property
    def by_case(self) -> bool:
        return self.batch_by == "case" and not self.frozen

    def rows(self, split: str, rows: Sequence[Record], orders: Sequence[int]) -> Any:
        return self.collator(list(rows)).to(self.device)

    def cases(self, units: Sequence[Sequence[Record]], orders: Sequence[Sequence[int]]) -> Any:
        from rlcd.model.case_train import collate_cases

        return collate_cases(self.collator, [list(u) for u in units]).to(self.device)

    def logits(self, model, split: str, records: Sequence[Record], *,
               on_rows: Callable[[int], None] | None = None) -> list[torch.Tensor]:
        """Every case's state once, its questions as suffixes on its cache (`case_scoring.score_records`)."""
        from rlcd.model.case_scoring import score_records

        return score_records(model, list(records), image_root=self.collator.image_root, max_rows=self.max_rows,
                             on_rows=on_rows)


@dataclass
class CacheRows:
    """What both caches share: a micro-batch is read from `cache`, and an evaluation scores records in chunks of
    `chunk` rows (each in its first fixed order) through the model's `forward`."""

    cache: Any
    device: torch.device
    chunk = 256  # rows per scoring call (a class attribute, not a field)

    def rows(self, split: str, rows: Sequence[Record], orders: Sequence[int]) -> Any:
        return self.cache.batch(split, list(rows), list(orders)).to(self.device)

    @torch.no_grad()
    def logits(self, model, split: str, records: Sequence[Record], *,
               on_rows: Callable[[int], None] | None = None) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for i in range(0, len(records), self.chunk):
            part = list(records[i:i + self.chunk])
            host = model(self.rows(split, part, [0] * len(part))).float().cpu()
            out += [host[j, :rec.question.k] for j, rec in enumerate(part)]
            if on_rows is not None:
                on_rows(len(part))
        return out


@dataclass
class CachedFeatures(CacheRows):
    """Rows read from a `rlcd.features.FeatureCache`: only the head runs."""

    frozen: bool = True
    fixed_orders: bool = True
    by_case: bool = False
    name: str = "features"

    def cases(self, units, orders):  # pragma: no cover - by_case is False
        raise TypeError("cached features are read row by row")


@dataclass
class CutStates(CacheRows):
    """Rows (or whole cases) read from a `rlcd.cut_cache.CutCache`: the layers above the cut run, LoRA learns."""

    batch_by: str = "row"
    frozen: bool = False
    fixed_orders: bool = True
    name: str = "cut"
    chunk = 32  # the K live layers hold every token's states of a chunk

    @property
    def by_case(self) -> bool:
        return self.batch_by == "case"

    def cases(self, units: Sequence[Sequence[Record]], orders: Sequence[Sequence[int]]) -> Any:
        flat, groups = [], []
        for unit in units:
            groups.append(list(range(len(flat), len(flat) + len(unit))))
            flat += list(unit)
        return self.cache.batch("train", flat, [o for os_ in orders for o in os_], units=groups).to(self.device)


@dataclass(frozen=True)
class SourcePlan:
    """The head-phase source (or None) until update `until` (None: for the whole run), the main one after."""

    main: Source
    head: Source | None = None
    until: int | None = None

    def for_update(self, step: int) -> Source:
        """The source of update `step` (0-based)."""
        return self.head if self.head is not None and (self.until is None or step < self.until) else self.main

    def for_eval(self, done: int) -> Source:
        """The source of the evaluation after `done` updates."""
        return self.head if self.head is not None and (self.until is None or done <= self.until) else self.main

    @property
    def cache_root(self) -> str | None:
        """The feature cache directory a source reads (the session event records it), else None."""
        for src in (self.head, self.main):
            if src is not None and getattr(src, "cache", None) is not None:
                return str(src.cache.root)
        return None


def plan_sources(recipe, *, collator, device: torch.device, features=None, cut_states=None,
                 start_step: int = 0) -> SourcePlan:
    """The run's sources: a head-only run reads `features` (or runs the frozen backbone live without them)
    for all of it; an LP-FT run (`head_warmup`) does so until its warm-up ends, then trains LoRA; the pinned
    recipe trains live throughout. LoRA trains on `cut_states` (the layers above the cut) when given (a
    `lora_layers` run), else live. A resume past the warm-up plans no head phase."""
    live = (CutStates(cut_states, device, batch_by=recipe.batch_by) if cut_states is not None
            else LiveSource(collator, device, batch_by=recipe.batch_by, fixed=recipe.lora_layers is not None))
    head_phase = recipe.head_only or start_step < recipe.head_warmup
    if not head_phase:
        return SourcePlan(main=live)
    head: Source = (CachedFeatures(features, device) if features is not None
                    else LiveSource(collator, device, batch_by=recipe.batch_by, frozen=True))
    if recipe.head_only:
        return SourcePlan(main=head, head=head, until=None)
    return SourcePlan(main=live, head=head, until=recipe.head_warmup)


__all__ = ["Source", "LiveSource", "CachedFeatures", "CutStates", "SourcePlan", "plan_sources"]
