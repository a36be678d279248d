"""Every row rendered once with a backbone's prompt encoder, before anything trains on it.

Records are validated without a tokenizer (`rlcd.schema`), so the rules only a backbone's tokenizer can
check would otherwise meet a row when the sampler first draws it: the run stops mid-way, hours in, and a
resume draws the same row and stops again. `RowCheck` applies them to whole splits up front, with the
encoder training uses (`DecisionModel.encoder`):

- `too_long`: the rendered row has more than `max_tokens` tokens (image tokens included; default the
  encoder's 8,192). Nothing is ever truncated.
- `unrenderable`: any other rule of the rendering: the text of one of this backbone's special tokens
  (SmolLM2's `<|im_start|>`, ...), an image for a text-only backbone, an image file that cannot be read.

`rlcd data prepare --model M` excludes such rows with the reason (`RowCheck.problem` per row);
`rlcd train` refuses the run before its directory exists (`refuse`), naming the first row, the rule and
how many rows break one. Cost: one tokenisation per case state (a case's questions share its prefix ids) and
one per question; an image's token count comes from its size alone (its header, no decoding).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from rlcd.schema import Record, RecordError, text_of

REASONS = ("too_long", "unrenderable")


@dataclass(frozen=True)
class Problem:
    """A row that breaks a rendering rule: its reason (`REASONS`), the encoder's RecordError and, for a
    row over the limit, its token count."""

    row: str
    reason: str
    error: RecordError
    tokens: int | None = None

    @property
    def detail(self) -> str:
        return str(self.error)


class RowCheck:
    """Renders records with `encoder` (a `rlcd.model.prompt.PromptEncoder`); `image_processor` counts the
    image tokens of a vision-language backbone (None: text-only)."""

    def __init__(self, encoder: Any, image_processor: Any = None, *, max_tokens: int | None = None,
                 name: str | None = None):
        self.encoder = encoder
        self.image_processor = image_processor
        self.max_tokens = int(max_tokens if max_tokens is not None else encoder.max_tokens)
        self.name = name  # the backbone as the user named it (messages)
        self._prefixes: dict[tuple, list[int] | RecordError] = {}
        self._images: dict[Path, int | RecordError] = {}

    @classmethod
    def for_model(cls, model: Any, *, name: str | None = None) -> "RowCheck":
        """The check a `DecisionModel` trains with: its own encoder and limit."""
        return cls(model.encoder, model.image_processor, name=name)

    @classmethod
    def for_backbone(cls, spec: str, *, max_tokens: int | None = None) -> "RowCheck":
        """Load backbone `spec` (CPU, float32; no LoRA, no head) for its tokenizer, frame and image processor."""
        from rlcd.model.backbone import load_backbone
        from rlcd.model.prompt import PromptEncoder

        bb = load_backbone(spec)
        encoder = PromptEncoder(bb.tokenizer, spec=bb.family.prompt_spec(bb.tokenizer))
        return cls(encoder, bb.image_processor, max_tokens=max_tokens, name=str(spec))

    # ------------------------------------------------------------------ one row
    def problem(self, rec: Record, image: Path | None = None) -> Problem | None:
        """The rule `rec` breaks when rendered, else None. `image`: the file of `rec.image` (required when it
        has one)."""
        try:
            n_img = self._image_tokens(rec, image) if rec.image else 0
            prefix = self._prefix(rec, n_img)
            stem, cands = self.encoder.question_segments(rec.question, row=rec.id)
        except RecordError as e:
            return Problem(rec.id, "unrenderable", e)
        n = len(prefix) + len(stem) + sum(len(c) for c in cands)
        if n > self.max_tokens:
            try:
                self.encoder.assemble(prefix, stem, cands, n_image_tokens=n_img, row=rec.id, max_tokens=self.max_tokens)
            except RecordError as e:
                return Problem(rec.id, "too_long", e, tokens=n)
        return None

    def problems(self, records: Iterable[Record], image_root: Path | None = None) -> list[Problem]:
        """Every broken row of `records` (image paths relative to `image_root`), in order."""
        out = []
        for rec in records:
            image = None
            if rec.image:
                image = Path(rec.image)
                if not image.is_absolute() and image_root is not None:
                    image = Path(image_root) / image
            found = self.problem(rec, image)
            if found is not None:
                out.append(found)
        return out

    def _prefix(self, rec: Record, n_img: int) -> list[int]:
        return _memo(self._prefixes, (text_of(rec.state), rec.image, n_img), rec.id,
                     lambda: self.encoder.prefix_ids(rec.state, n_image_tokens=n_img, row=rec.id))

    def _image_tokens(self, rec: Record, image: Path | None) -> int:
        self.encoder.refuse_image(rec.id)
        if self.image_processor is None:
            raise RecordError(rec.id, "image", "this backbone has no image processor")
        if image is None:
            raise RecordError(rec.id, "image", "no image file given to count its tokens")
        return _memo(self._images, image, rec.id, lambda: image_tokens(self.image_processor, image))


def _memo(memo: dict, key: Any, row: str, compute: Callable[[], Any]) -> Any:
    """`compute()` once per `key` (a case's state, an image file: shared by many rows), its `RecordError` too,
    raised again for each `row` that meets it."""
    if key not in memo:
        try:
            memo[key] = compute()
        except RecordError as e:
            memo[key] = e
    got = memo[key]
    if isinstance(got, RecordError):
        raise RecordError(row, got.field, got.rule)
    return got


def image_tokens(image_processor: Any, path: Path) -> int:
    """The `<|image_pad|>` count the collator gives the image at `path`: from its size alone when the processor
    can say (`get_number_of_image_patches`, what vLLM uses), else by processing it."""
    from PIL import Image

    if not Path(path).is_file():
        raise RecordError(None, "image", f"file not found: {path}")
    merge = int(getattr(image_processor, "merge_size", 2) or 2)
    try:
        with Image.open(path) as im:
            width, height = im.size
            if not hasattr(image_processor, "get_number_of_image_patches"):
                from rlcd.model.collate import n_image_tokens, process_images

                im.load()
                _, grid = process_images(image_processor, [im.convert("RGB")])
                return n_image_tokens(grid[0].tolist(), merge)
    except RecordError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable image is the row's problem
        raise RecordError(None, "image", f"cannot read image {path}: {e}") from None
    return int(image_processor.get_number_of_image_patches(height, width)) // (merge * merge)


def refuse(problems: list[Problem], total: int, *, what: str, fix: str) -> None:
    """Raise one `RecordError` line for the first problem: its row, field and rule, then how many of `total`
    rows of `what` break a rule and `fix`. Nothing when `problems` is empty."""
    if not problems:
        return
    first = problems[0]
    counts = {}
    for p in problems:
        counts[p.reason] = counts.get(p.reason, 0) + 1
    how = ", ".join(f"{n} {r}" for r, n in counts.items())
    raise RecordError(first.row, first.error.field, f"{first.error.rule} [{len(problems)} of {total} {what} break a "
                      f"rendering rule ({how}); {fix}]")


__all__ = ["Problem", "REASONS", "RowCheck", "image_tokens", "refuse"]
