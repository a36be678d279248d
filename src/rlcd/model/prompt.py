"""Prompt rendering: one row per question, as token-id segments with exact positions.

Row layout (each segment is tokenized on its own and the ids are concatenated, so segment
boundaries -- the shared prefix and the decision position -- are exact):

    [head]                                                     chat-template opening (text decoders)
    [<|vision_start|><|image_pad|> x n<|vision_end|>"\\n"]     image segment (optional)
    "State: {state}\\n"                                          prefix: shared by the rows of one state
    "{type} question: {instructions}\\nOptions:\\n"               stem: the decision position is its last token
    "- {option}" <M> "\\n"                                       one per candidate, <M> = the marker token

The frame comes from the backbone family (`PromptSpec`): Qwen3.5 uses the project's own format
with the marker `<|fim_suffix|>` and the vision tokens; a text decoder puts its chat template's
opening (system line, user turn header) in front and uses an unused special token as the marker.

Option text: choice `label` or `label: description`; noul `false: ...` / `true: ...` (defaults below
when no descriptions are given); score `level i: description`. Objects are JSON-dumped
(`schema.text_of`, `ensure_ascii=False`).

Rejected with a `RecordError` (a ValueError naming the row, the field and the rule): the text of
any special token of the backbone's tokenizer (the marker, vision tokens, chat tokens, ...) anywhere
in the inputs, an image for a text-only backbone, rows longer than `max_tokens`
(default 8,192, image tokens included), and candidate counts outside 2..255. Nothing is truncated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..schema import MAX_CANDIDATES, MIN_CANDIDATES, Question, RecordError, find_reserved, text_of
from .frame import PromptSpec

DEFAULT_MAX_TOKENS = 8192
DEFAULT_NOUL = {"false": "no", "true": "yes"}


@dataclass
class EncodedRow:
    """One rendered row. Positions index `ids`."""

    ids: list[int]
    prefix_len: int  # head + image segment + state segment (identical for every row of one state/image)
    decision_pos: int  # last token of the stem
    marker_pos: list[int]  # the K marker tokens, in candidate order
    n_image_tokens: int = 0
    image_start: int | None = None  # index of the first image pad token (None without image)

    @property
    def k(self) -> int:
        return len(self.marker_pos)

    def __len__(self) -> int:
        return len(self.ids)


def option_texts(question: Question) -> list[str]:
    """The candidate texts in model order (`question.labels` order)."""
    labels = question.labels
    descs = question.descriptions()
    if question.type == "choice":
        return [lab if d is None else f"{lab}: {text_of(d)}" for lab, d in zip(labels, descs)]
    if question.type == "noul":
        return [f"{lab}: {text_of(d) if d is not None else DEFAULT_NOUL[lab]}" for lab, d in zip(labels, descs)]
    return [f"level {i}: {text_of(d)}" for i, d in enumerate(descs)]


def stem_text(question: Question) -> str:
    return f"{question.type} question: {text_of(question.instructions)}\nOptions:\n"


def state_text(state: Any) -> str:
    return f"State: {text_of(state)}\n"


def default_spec(tokenizer: Any) -> PromptSpec:
    """The frame of the family a bare tokenizer belongs to: Qwen3.5 when it has every Qwen special
    token, else a text decoder's."""
    from .families import CAUSAL_LM, QWEN35
    from .tokenizer import special_ids

    try:
        special_ids(tokenizer)
    except RuntimeError:
        return CAUSAL_LM.prompt_spec(tokenizer)
    return QWEN35.prompt_spec(tokenizer)


def _token_id(tokenizer: Any, token: str) -> int:
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise RuntimeError(f"{token!r} is not a single token in this tokenizer ({ids})")
    return int(ids[0])


class PromptEncoder:
    """Turns (state, question[, image token count]) into an `EncodedRow` with a given tokenizer and frame."""

    def __init__(self, tokenizer: Any, *, max_tokens: int = DEFAULT_MAX_TOKENS, spec: PromptSpec | None = None):
        self.tokenizer = tokenizer
        self.max_tokens = int(max_tokens)
        self.spec = spec or default_spec(tokenizer)
        self.reserved = tuple(dict.fromkeys((*self.spec.reserved, self.spec.marker)))
        self.special = {_token_id(tokenizer, t) for t in self.reserved}
        self.marker_id = _token_id(tokenizer, self.spec.marker)
        self.image_pad_id = self.vision_start_id = self.vision_end_id = None
        if self.spec.image_tokens is not None:
            start, pad, end = self.spec.image_tokens
            self.vision_start_id, self.image_pad_id, self.vision_end_id = (
                _token_id(tokenizer, start), _token_id(tokenizer, pad), _token_id(tokenizer, end))
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = _token_id(tokenizer, self.spec.pad) if self.spec.pad else tokenizer.eos_token_id
        if pad is None:
            raise RuntimeError("the tokenizer has no pad or eos token to pad rows with")
        self.pad_id = int(pad)
        self._backend = getattr(tokenizer, "_tokenizer", None)
        self._newline = self._encode([("\n")])[0]
        self.head = self._encode([self.spec.head])[0] if self.spec.head else []

    @property
    def marker(self) -> str:
        return self.spec.marker

    @property
    def text_only(self) -> bool:
        return self.spec.text_only

    # ---------------------------------------------------------------- tokenization
    def _encode(self, texts: list[str]) -> list[list[int]]:
        if self._backend is not None:
            return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=False)]
        return [list(self.tokenizer.encode(t, add_special_tokens=False)) for t in texts]

    def _check_text(self, value: Any, *, row: str | None, field: str) -> None:
        tok = find_reserved(value, self.reserved) if value is not None else None
        if tok is not None:
            raise RecordError(row, field, f"contains the reserved token {tok!r} (the marker is {self.marker!r}); "
                                          "remove special-token text from the input")

    def check_inputs(self, state: Any, question: Question, *, row: str | None = None) -> None:
        """The special-token rule alone (no tokenising): what `encode` rejects in the texts of one row."""
        self._check_text(state, row=row, field="state")
        self._check_text(question.instructions, row=row, field="question.instructions")
        for lab in question.labels:
            self._check_text(lab, row=row, field="question.criteria")
        for d in question.descriptions():
            self._check_text(d, row=row, field="question.criteria")

    def _check_ids(self, ids: list[int], *, row: str | None, field: str) -> None:
        if any(i in self.special for i in ids):
            raise RecordError(row, field, "tokenizes to a reserved special token; remove special-token text")

    # ---------------------------------------------------------------- segments
    def refuse_image(self, row: str | None) -> None:
        """The one refusal of an image on a text-only backbone (rows, records, requests alike)."""
        if self.text_only:
            raise RecordError(row, "image", f"the {self.spec.family} backbone is text-only; send no image, or use "
                                            "a vision-language backbone (a qwen3.5 preset)")

    def image_segment(self, n_image_tokens: int, *, row: str | None = None) -> list[int]:
        if n_image_tokens <= 0:
            return []
        self.refuse_image(row)
        return [self.vision_start_id] + [self.image_pad_id] * n_image_tokens + [self.vision_end_id] + self._newline

    def prefix_ids(self, state: Any, *, n_image_tokens: int = 0, row: str | None = None) -> list[int]:
        """Head + image segment + state segment: the part shared by every row of one state."""
        self._check_text(state, row=row, field="state")
        st = self._encode([state_text(state)])[0]
        self._check_ids(st, row=row, field="state")
        return self.head + self.image_segment(n_image_tokens, row=row) + st

    def question_segments(self, question: Question, *, row: str | None = None) -> tuple[list[int], list[list[int]]]:
        """(stem ids, [candidate ids incl. marker and newline])."""
        if not isinstance(question, Question):
            raise RecordError(row, "question", "must be a rlcd.schema.Question")
        k = len(question.labels)
        if not MIN_CANDIDATES <= k <= MAX_CANDIDATES:
            raise RecordError(row, "question.criteria",
                              f"has {k} candidates; a question needs {MIN_CANDIDATES}..{MAX_CANDIDATES}")
        self._check_text(question.instructions, row=row, field="question.instructions")
        for lab in question.labels:
            self._check_text(lab, row=row, field="question.criteria")
        for d in question.descriptions():
            self._check_text(d, row=row, field="question.criteria")
        opts = option_texts(question)
        enc = self._encode([stem_text(question)] + [f"- {o}" for o in opts])
        stem, cands = enc[0], enc[1:]
        self._check_ids(stem, row=row, field="question.instructions")
        for c in cands:
            self._check_ids(c, row=row, field="question.criteria")
        return stem, [c + [self.marker_id] + self._newline for c in cands]

    def assemble(self, prefix: list[int], stem: list[int], cands: list[list[int]], *, n_image_tokens: int = 0,
                 row: str | None = None, max_tokens: int | None = None) -> EncodedRow:
        """One row from its segments; longer than `max_tokens` (default: the encoder's) is a RecordError."""
        limit = self.max_tokens if max_tokens is None else int(max_tokens)
        ids = list(prefix) + list(stem)
        decision = len(ids) - 1
        markers = []
        for c in cands:
            ids.extend(c)
            markers.append(len(ids) - 1 - len(self._newline))
        n = len(ids)
        if n > limit:
            raise RecordError(row, "tokens", f"row has {n} tokens ({n_image_tokens} of them image tokens), more than "
                                             f"max_tokens={limit}; shorten the state, instructions or "
                                             "criteria (rows are never truncated)")
        found = [i for i, t in enumerate(ids) if t == self.marker_id]
        assert found == markers and len(markers) == len(cands), (
            f"row {row!r}: expected exactly {len(cands)} markers at {markers}, found {found}")
        assert all(decision < m for m in markers)
        image_start = len(self.head) + 1 if n_image_tokens > 0 else None
        return EncodedRow(ids, len(prefix), decision, markers, n_image_tokens, image_start)

    def encode(self, state: Any, question: Question, *, n_image_tokens: int = 0, row: str | None = None,
               prefix: list[int] | None = None, max_tokens: int | None = None) -> EncodedRow:
        """Render and tokenize one row (`prefix` may be passed in when already tokenized)."""
        if prefix is None:
            prefix = self.prefix_ids(state, n_image_tokens=n_image_tokens, row=row)
        stem, cands = self.question_segments(question, row=row)
        return self.assemble(prefix, stem, cands, n_image_tokens=n_image_tokens, row=row, max_tokens=max_tokens)


def render_text(state: Any, question: Question, *, n_image_tokens: int = 0, spec: PromptSpec | None = None) -> str:
    """Human-readable rendering of a row (for docs and debugging; the model uses the ids). Default
    frame: Qwen3.5's."""
    if spec is None:
        from .families.qwen35 import IMAGE_TOKENS
        from .tokenizer import QWEN_MARKER

        spec = PromptSpec(family="qwen3.5", marker=QWEN_MARKER, reserved=(), image_tokens=IMAGE_TOKENS)
    img = ""
    if n_image_tokens:
        start, pad, end = spec.image_tokens or ("<image>", "<pad>", "</image>")
        img = start + pad * n_image_tokens + end + "\n"
    opts = "".join(f"- {o}{spec.marker}\n" for o in option_texts(question))
    return spec.head + img + state_text(state) + stem_text(question) + opts
