"""Per-request limits of the predictor and the server (torch-free, so the CLI can show the defaults)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from rlcd.schema import MAX_CANDIDATES


@dataclass(frozen=True)
class Limits:
    """Per-request limits (all configurable on the CLI / server)."""

    max_questions: int = 64            # questions per request
    max_candidates: int = MAX_CANDIDATES  # candidates per question (<= 255)
    max_tokens: int = 8192             # tokens per rendered row, image tokens included
    max_request_bytes: int = 8 << 20   # HTTP body (and JSON size of a request given to predict)
    max_image_pixels: int = 4096 * 4096  # width * height of a decoded image

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"limit {name} must be a positive integer, got {value!r}")
        if not 2 <= self.max_candidates <= MAX_CANDIDATES:
            raise ValueError(f"max_candidates must be in 2..{MAX_CANDIDATES}, got {self.max_candidates}")

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def with_(self, **kw: Any) -> "Limits":
        return replace(self, **{k: v for k, v in kw.items() if v is not None})
