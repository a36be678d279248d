"""Cases: the questions about one state, tokenised and with their image preprocessed, ready for a model call.

A case is one request (serving) or the records of one source case (evaluation, feature and cut-state extraction):
one state, one image or none, several questions. `CaseEncoder` does the CPU part of scoring it -- every row
rendered by the model's `PromptEncoder` with the shared prefix (head, image segment, state) rendered once, the
image preprocessed -- without a model call, so a server runs it in its request threads, off the model thread.
`CaseInputs` is what it hands to `rlcd.model.runner.CaseRunner`: plain data; the runner computes the request
caches' keys from it (`image_digest` is kept here once computed, with `keyed=True` before the model thread needs
it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ..schema import Question, Record
from .collate import load_image, n_image_tokens, process_images
from .prompt import EncodedRow, PromptEncoder
from .state_cache import image_digest


@dataclass
class CaseInputs:
    """One case ready for the model: its rows and preprocessed image (`CaseEncoder.prepare`)."""

    rows: list[EncodedRow]
    pixel_values: torch.Tensor | None = None
    grid: torch.Tensor | None = None
    n_img: int = 0
    image_digest: str | None = None  # the request caches' key of the image (`state_cache.image_digest`), once computed

    @property
    def n_tokens(self) -> int:
        return sum(len(r) for r in self.rows)

    def subset(self, rows: Sequence[int]) -> "CaseInputs":
        """The same case with only `rows` (by index; itself when that is every row)."""
        if len(rows) == len(self.rows):
            return self
        return CaseInputs([self.rows[j] for j in rows], self.pixel_values, self.grid, self.n_img, self.image_digest)


class CaseEncoder:
    """Questions about one state -> `CaseInputs` with a model's prompt frame (`PromptEncoder`), image processor and
    merge size (`for_model`). No model call, no torch forward: safe in request threads."""

    def __init__(self, encoder: PromptEncoder, image_processor: Any = None, merge_size: int = 1):
        self.encoder = encoder
        self.image_processor = image_processor
        self.merge_size = int(merge_size)

    @classmethod
    def for_model(cls, model: Any) -> "CaseEncoder":
        """The encoder of a `DecisionModel` (its prompt frame, image processor and merge size)."""
        return cls(model.encoder, model.image_processor, model.merge_size)

    def rows(self, state: Any, questions: Sequence[Question], *, n_image_tokens: int = 0,
             ids: Sequence[str] | None = None, case_id: str | None = None,
             max_tokens: int | None = None) -> list[EncodedRow]:
        """Every question's row about `state` (its prefix rendered once); `ids` name the rows (q0, q1, ...)."""
        qids = list(ids) if ids is not None else [f"q{i}" for i in range(len(questions))]
        if len(qids) != len(questions):
            raise ValueError(f"{len(qids)} ids for {len(questions)} questions")
        prefix = self.encoder.prefix_ids(state, n_image_tokens=n_image_tokens,
                                         row=case_id if case_id is not None else (qids[0] if len(qids) == 1 else "request"))
        return [self.encoder.encode(state, q, n_image_tokens=n_image_tokens, row=qid, prefix=prefix,
                                    max_tokens=max_tokens) for q, qid in zip(questions, qids)]

    def image(self, image: Any) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """(pixel_values, grid, image tokens) of one image (all None / 0 without one; refused on a text-only
        backbone)."""
        if image is None:
            return None, None, 0
        self.encoder.refuse_image(None)
        pv, grid = process_images(self.image_processor, [image])
        return pv, grid, n_image_tokens(grid[0].tolist(), self.merge_size)

    def prepare(self, state: Any, questions: Sequence[Question], image: Any = None,
                ids: Sequence[str] | None = None, *, case_id: str | None = None, max_tokens: int | None = None,
                keyed: bool = False) -> CaseInputs:
        """The CPU part of scoring one case: rows tokenised, the image preprocessed (no model call). `max_tokens`
        overrides the encoder's row limit (a server's request limits); `keyed`: the image's cache key computed now,
        off the model thread (a request cache is on)."""
        pv, grid, n_img = self.image(image)
        rows = self.rows(state, list(questions), n_image_tokens=n_img, ids=ids, case_id=case_id, max_tokens=max_tokens)
        return CaseInputs(rows, pv, grid, n_img, image_digest(pv, grid) if keyed and pv is not None else None)

    def from_records(self, records: Sequence[Record], image_root: Path | str | None = None) -> CaseInputs:
        """One case from records of one source case (one state, one image or none; `Record.case_id`): their
        questions as the rows, in order, each row named by its record id. Records that do not share the first one's
        state and image are refused (ValueError): they are not one case."""
        records = list(records)
        if not records:
            raise ValueError("a case needs at least one record")
        first = records[0]
        for r in records[1:]:
            if r.state != first.state or r.image != first.image:
                raise ValueError(f"records {first.id!r} and {r.id!r} do not share one state and image")
        image = None
        if first.image:
            self.encoder.refuse_image(first.id)
            image = load_image(first, Path(image_root) if image_root is not None else None)
        return self.prepare(first.state, [r.question for r in records], image, [r.id for r in records],
                            case_id=first.case_id)


__all__ = ["CaseEncoder", "CaseInputs"]
