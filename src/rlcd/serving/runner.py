"""What serving drives: a `Runner` -- cases in, logits and `Usage` out -- whatever engine is behind it.

Two engines implement it: `rlcd.model.runner.CaseRunner` (torch: a `DecisionModel`, shared prefixes on the decoder's
cache, both request caches) and `rlcd.portable.runtime.PortableModel` (onnxruntime + numpy, no torch, no cache).
`Predictor`, `serving.scoring.Scorer` and `serving.state_encoding.StateEncoder` are typed against this protocol
alone, so serving imports neither engine (the layer rule, docs/ARCHITECTURE.md) and the portable server runs without
torch. `tests/test_serving_pieces.py::test_both_engines_are_runners` holds both to it.

A call, as the Predictor makes it: `prepare_case` in a request thread (tokenising, the image preprocessed; `keyed`:
the request caches' key of the image computed there too), then `score_cases` on the model thread, under the scoring
lock, with the request caches scoped by `identity()` (`serving.state_encoding.cache_scope`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Iterator, Protocol, Sequence, runtime_checkable

from rlcd.serving.cache import ScopedStateCache


@dataclass(frozen=True, eq=False)
class Usage(Mapping[str, Any]):
    """What scoring one case cost. `input_tokens` is a function of the request alone (`model.plan.request_tokens`:
    the part its rows share counted once): what the response's `usage.input_tokens` says, whatever path, cache, batch
    or engine. The rest describe the work: `prefix_tokens` (the shared prefix run once; 0 on the full-row path),
    `cached_tokens` (the part of it the state cache supplied, not run), `cached_rows` (rows the row cache supplied),
    `rows`, `full_tokens` (the rows' tokens run whole), `image_tokens`, `calls` (model calls of the whole batch),
    `batched_requests` (cases in the batch), `path` ("prefix" or "full").

    A read-only mapping too (`usage["input_tokens"]`, `dict(usage)`), as the usage dicts it replaces were read."""

    input_tokens: int = 0
    prefix_tokens: int = 0
    cached_tokens: int = 0
    cached_rows: int = 0
    rows: int = 0
    full_tokens: int = 0
    image_tokens: int = 0
    calls: int = 0
    batched_requests: int = 0
    path: str = "full"

    def __getitem__(self, key: str) -> Any:
        if key not in _USAGE_FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_USAGE_FIELDS)

    def __len__(self) -> int:
        return len(_USAGE_FIELDS)

    def __repr__(self) -> str:
        return f"Usage({', '.join(f'{k}={getattr(self, k)!r}' for k in _USAGE_FIELDS)})"


_USAGE_FIELDS = tuple(f.name for f in fields(Usage))


class Case(Protocol):
    """A prepared case as serving sees it: opaque but for its size (the batcher's token bound)."""

    @property
    def n_tokens(self) -> int: ...


@runtime_checkable
class Runner(Protocol):
    """An engine that scores cases (module docstring). `supports_images`: whether a request may carry an image;
    `placement`: where it runs (`/v1/models`); `identity()`: what a cached state of it depends on (model, weights'
    versions, prompt frame, placement), for the request caches' scope."""

    supports_images: bool

    @property
    def placement(self) -> Mapping[str, Any]: ...

    def eval(self) -> Any: ...

    def identity(self) -> Mapping[str, Any]: ...

    def prepare_case(self, state: Any, questions: Sequence[Any], image: Any = None, ids: Sequence[str] | None = None,
                     *, case_id: str | None = None, max_tokens: int | None = None, keyed: bool = False) -> Case: ...

    def score_cases(self, cases: Sequence[Any], *, state_cache: ScopedStateCache | None = None,
                    row_cache: ScopedStateCache | None = None) -> list[tuple[list[Any], Usage]]: ...


__all__ = ["Case", "Runner", "Usage"]
