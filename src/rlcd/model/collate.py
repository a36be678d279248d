"""Collation: records -> a right-padded `Batch` (ids, positions, candidate mask, targets, images).

Images (`Record.image`, a path relative to `image_root`) go through the PIL image processor
(`Qwen2VLImageProcessorPil`; torchvision is not needed), and `<|image_pad|>` is expanded by hand to
`t*h*w // merge**2` copies. `mm_token_type_ids` is 1 on image tokens, 0 elsewhere. A record with an
image is refused by a text-only backbone's collator (no image processor), naming the row.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Sequence

import torch

from ..schema import TYPE_ID, Record, RecordError
from .prompt import DEFAULT_MAX_TOKENS, EncodedRow, PromptEncoder


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] long, right padded
    attention_mask: torch.Tensor  # [B, T] long
    decision_pos: torch.Tensor  # [B] long
    marker_pos: torch.Tensor  # [B, Kmax] long (0 on padded candidates)
    cand_mask: torch.Tensor  # [B, Kmax] bool
    target: torch.Tensor  # [B, Kmax] float32 (0 on padding)
    ordinal: torch.Tensor  # [B] bool (type == score)
    type_id: torch.Tensor  # [B] long (schema.TYPE_ID)
    mm_token_type_ids: torch.Tensor  # [B, T] long, 1 on image tokens
    pixel_values: torch.Tensor | None  # [sum patches, C*tp*p*p] or None
    image_grid_thw: torch.Tensor | None  # [n_images, 3] or None
    ids: list[str]
    groups: list[str]
    types: list[str]
    n_tokens: int  # real (non-pad) tokens in the batch, image tokens included

    def to(self, device: Any, non_blocking: bool = False) -> "Batch":
        return moved(self, device, non_blocking)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def kmax(self) -> int:
        return int(self.cand_mask.shape[1])


@dataclass
class RowLabels:
    """What the objective and the diagnostics read of a micro-batch, whatever its features come from: the base
    of the cached batches (`FeatureBatch`, `rlcd.model.cut_forward.CutBatch`); `Batch` carries the
    same fields."""

    cand_mask: torch.Tensor  # [B, Kmax] bool
    target: torch.Tensor  # [B, Kmax] float32 (0 on padding)
    ordinal: torch.Tensor  # [B] bool (type == score)
    type_id: torch.Tensor  # [B] long (schema.TYPE_ID)
    ids: list[str]
    groups: list[str]
    types: list[str]
    n_tokens: int  # full-row tokens of the batch (what a live forward would run)

    def to(self, device: Any, non_blocking: bool = False):
        return moved(self, device, non_blocking)

    @property
    def kmax(self) -> int:
        return int(self.cand_mask.shape[1])


@dataclass
class FeatureBatch(RowLabels):
    """A micro-batch of cached features (`rlcd.features.FeatureCache.batch`): what `DecisionModel.forward` needs
    instead of token ids, plus the `Batch` fields the objective and the diagnostics read (`RowLabels`)."""

    h_dec: torch.Tensor  # [B, H]
    h_cand: torch.Tensor  # [B, Kmax, H] (0 on padding)

    def __len__(self) -> int:
        return int(self.h_dec.shape[0])


def moved(obj: Any, device: Any, non_blocking: bool = False) -> Any:
    """A copy of dataclass `obj` (a Batch, CaseBatch or FeatureBatch) with every tensor field on `device`."""
    kw = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        kw[f.name] = v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v
    return type(obj)(**kw)


def n_image_tokens(grid_thw: Sequence[int], merge_size: int) -> int:
    t, h, w = (int(x) for x in grid_thw)
    return t * h * w // (merge_size * merge_size)


def process_images(image_processor: Any, images: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """PIL images -> (pixel_values, image_grid_thw) with the PIL Qwen2-VL processor."""
    out = image_processor(images=[im.convert("RGB") for im in images], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def pad_rows(rows: list[EncodedRow], *, pad_id: int, image_pad_id: int | None, targets: list[list[float]] | None = None,
             types: list[str] | None = None, ids: list[str] | None = None, groups: list[str] | None = None,
             pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None) -> Batch:
    """Right-pad encoded rows into a Batch."""
    b = len(rows)
    t = max(len(r) for r in rows)
    kmax = max(r.k for r in rows)
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)
    attn = torch.zeros((b, t), dtype=torch.long)
    marker = torch.zeros((b, kmax), dtype=torch.long)
    cmask = torch.zeros((b, kmax), dtype=torch.bool)
    target = torch.zeros((b, kmax), dtype=torch.float32)
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = torch.tensor(r.ids, dtype=torch.long)
        attn[i, : len(r)] = 1
        marker[i, : r.k] = torch.tensor(r.marker_pos, dtype=torch.long)
        cmask[i, : r.k] = True
        if targets is not None:
            target[i, : r.k] = torch.tensor(targets[i], dtype=torch.float32)
    types = types or ["choice"] * b
    mm = (input_ids == image_pad_id).long() * attn if image_pad_id is not None else torch.zeros_like(attn)
    return Batch(
        input_ids=input_ids,
        attention_mask=attn,
        decision_pos=torch.tensor([r.decision_pos for r in rows], dtype=torch.long),
        marker_pos=marker,
        cand_mask=cmask,
        target=target,
        ordinal=torch.tensor([ty == "score" for ty in types], dtype=torch.bool),
        type_id=torch.tensor([TYPE_ID[ty] for ty in types], dtype=torch.long),
        mm_token_type_ids=mm,
        pixel_values=pixel_values,
        image_grid_thw=image_grid_thw,
        ids=list(ids) if ids is not None else [str(i) for i in range(b)],
        groups=list(groups) if groups is not None else [""] * b,
        types=list(types),
        n_tokens=int(attn.sum().item()),
    )


def load_image(rec: Record, image_root: Path | None) -> Any:
    """The record's image as an RGB PIL image (its path relative to `image_root`); a missing or unreadable file is a
    RecordError naming the record."""
    from PIL import Image

    path = Path(rec.image)  # type: ignore[arg-type]
    if not path.is_absolute() and image_root is not None:
        path = image_root / path
    if not path.is_file():
        raise RecordError(rec.id, "image", f"file not found: {path} (image paths are relative to image_root="
                                           f"{image_root})")
    try:
        with Image.open(path) as im:
            im.load()
            return im.convert("RGB")
    except Exception as e:
        raise RecordError(rec.id, "image", f"cannot read image {path}: {e}") from None


class Collator:
    """`Collator(tokenizer, image_processor)(records) -> Batch` (right padding).

    `encoder`: the model's `PromptEncoder` (its frame and marker); by default one is built for the
    tokenizer (`DecisionModel.collator()` passes the model's own)."""

    def __init__(self, tokenizer: Any, image_processor: Any, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                 image_root: Path | str | None = None, encoder: PromptEncoder | None = None):
        self.encoder = encoder or PromptEncoder(tokenizer, max_tokens=max_tokens)
        self.image_processor = image_processor
        self.image_root = Path(image_root) if image_root is not None else None
        self.merge_size = int(getattr(image_processor, "merge_size", 2) or 2) if image_processor is not None else 2

    def load_image(self, rec: Record) -> Any:
        return load_image(rec, self.image_root)

    def __call__(self, records: list[Record]) -> Batch:
        if not records:
            raise ValueError("cannot collate an empty list of records")
        images, owners = [], []
        for i, rec in enumerate(records):
            if rec.image:
                self.encoder.refuse_image(rec.id)
                if self.image_processor is None:
                    raise RecordError(rec.id, "image", "this collator has no image processor")
                images.append(self.load_image(rec))
                owners.append(i)
        pixel_values = grid = None
        n_img = [0] * len(records)
        if images:
            pixel_values, grid = process_images(self.image_processor, images)
            for j, i in enumerate(owners):
                n_img[i] = n_image_tokens(grid[j].tolist(), self.merge_size)
        rows = [
            self.encoder.encode(rec.state, rec.question, n_image_tokens=n_img[i], row=rec.id)
            for i, rec in enumerate(records)
        ]
        return pad_rows(
            rows,
            pad_id=self.encoder.pad_id,
            image_pad_id=self.encoder.image_pad_id,
            targets=[rec.target for rec in records],
            types=[rec.question.type for rec in records],
            ids=[rec.id for rec in records],
            groups=[rec.group or rec.sampling_group for rec in records],
            pixel_values=pixel_values,
            image_grid_thw=grid,
        )
