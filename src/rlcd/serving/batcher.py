"""Dynamic batching with back-pressure: concurrent requests share the model's forwards.

One batcher per server, with one model thread. `submit(prepared)` queues a validated request (a
`Predictor.prepare` result) and returns a `concurrent.futures.Future` of its (logits, usage); the
server awaits it with `asyncio.wrap_future`, so the event loop never runs or waits on the model.
Continuous batching (as vLLM's scheduler does): a request that reaches an *idle* model (nothing was
queued when the last batch ended) is dispatched at once, with only what is already queued beside it,
whatever the window and whoever else is being prepared; requests that queue while a batch runs form
the next batch, up to `max_batch_questions` questions and `max_batch_tokens` tokens. Only then, for a
batch gathered behind a busy model, the model thread also waits up to `window_ms` for requests still
being prepared (inside `arriving()`, the server's preparation and `submit`). So a lone client never
pays for the window (p50 at one client as without batching), and concurrent clients still share
forwards. Each batch is one `score_many` call (the predictor's batched path: each request's answers
equal those it gets alone).

`window_ms=0` turns batching off: one request per forward, in arrival order.

Back-pressure: at most `max_queue` requests wait; one more is refused at once (`Overloaded`, a 503
with a `Retry-After` hint) instead of waiting without bound; a request not answered within
`timeout_s` gets the same 503 (its work is skipped if it had not started). `close()` stops accepting
(503) and answers what is queued before it returns: graceful shutdown.

`submit(prepared, counted=False)` runs a request without counting it in `stats()` or telling the `observer`:
the server's start-up warm-up, which must not show in the numbers of the requests it serves. `observer(requests,
questions, tokens, seconds)` is called after each batch with its counted requests (the /metrics batch histograms).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import queue
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Sequence

from rlcd.serving.errors import PredictError

DEFAULT_WINDOW_MS = 4.0
POLL_S = 0.00025  # how often the window re-checks for requests on their way


@dataclass(frozen=True)
class BatchingConfig:
    """How the server batches: the gathering window, batch bounds, queue bound and request timeout."""

    window_ms: float = DEFAULT_WINDOW_MS
    max_batch_questions: int = 256
    max_batch_tokens: int = 65536
    max_queue: int = 256
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not (self.window_ms >= 0 and math.isfinite(self.window_ms)):
            raise ValueError(f"window_ms must be >= 0, got {self.window_ms}")
        for name in ("max_batch_questions", "max_batch_tokens", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    @property
    def enabled(self) -> bool:
        return self.window_ms > 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _malloc_trim() -> Callable[[], None]:
    """glibc's malloc_trim(0), or a no-op where there is none."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    return lambda: trim(0) and None


release_free_memory = _malloc_trim()


class Overloaded(PredictError):
    """503: the queue is full, the request waited too long, or the server is shutting down."""

    def __init__(self, message: str, retry_after: float):
        super().__init__("body", message, status=503)
        self.retry_after = max(1, int(math.ceil(retry_after)))


class TimedFuture(concurrent.futures.Future):
    """A request's future with its timings for the access log: `queue_s` from `submit` to the start of its
    batch's forward, `model_s` that forward's time (shared by the batch). None until it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.submitted = time.perf_counter()
        self.queue_s: float | None = None
        self.model_s: float | None = None


@dataclass
class _Item:
    prepared: Any
    questions: int
    tokens: int
    future: TimedFuture
    counted: bool = True


class Batcher:
    """Queue + model thread around `score_many(prepared list) -> [(logits, usage) | Exception]`."""

    def __init__(self, score_many: Callable[[Sequence[Any]], list[Any]], config: BatchingConfig | None = None, *,
                 size_of: Callable[[Any], tuple[int, int]] = lambda p: (1, 0),
                 observer: Callable[[int, int, int, float], None] | None = None):
        self.score_many = score_many
        self.config = config or BatchingConfig()
        self.size_of = size_of  # prepared -> (questions, tokens)
        self.observer = observer  # (requests, questions, tokens, seconds) of each batch's counted requests
        self.queue: queue.Queue[_Item] = queue.Queue()
        self.accepting = True
        self.batches = 0
        self.batched_requests = 0
        self.last_batch_s = 0.1  # for the Retry-After hint
        self.busy_s = 0.0  # time the model thread spent in score_many (utilisation = busy_s / wall)
        self._held: _Item | None = None
        self._arriving = 0  # requests being prepared (inside `arriving()`), not yet submitted
        self._arriving_lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rlcd-model", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ requests
    def retry_after(self) -> float:
        per_batch = self.config.max_batch_questions if self.config.enabled else 1
        return self.last_batch_s * (1 + self.queue.qsize() / per_batch)

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """Wrap a request's preparation and `submit`: while any request is inside, a batch gathered behind a
        busy model waits the window for it; when none is, or the model was idle, a batch starts at once."""
        with self._arriving_lock:
            self._arriving += 1
        try:
            yield
        finally:
            with self._arriving_lock:
                self._arriving -= 1

    def submit(self, prepared: Any, *, counted: bool = True) -> TimedFuture:
        """Queue `prepared`; raises Overloaded (503) when the queue is full or the server is closing.
        `counted=False`: left out of `stats()` and the observer (the start-up warm-up)."""
        if not self.accepting:
            raise Overloaded("the server is shutting down; retry on another replica", 1)
        if self.queue.qsize() >= self.config.max_queue:
            raise Overloaded(f"the server is overloaded ({self.config.max_queue} requests queued); retry later",
                             self.retry_after())
        questions, tokens = self.size_of(prepared)
        item = _Item(prepared, int(questions), int(tokens), TimedFuture(), counted)
        self.queue.put(item)
        return item.future

    def timed_out(self, future: concurrent.futures.Future) -> Overloaded:
        """The 503 for a request whose `timeout_s` passed; cancels its work if it has not started."""
        future.cancel()
        return Overloaded(f"no answer within {self.config.timeout_s:g} s (the server is overloaded); retry later",
                          self.retry_after())

    # ------------------------------------------------------------------ the model thread
    def _next(self, timeout: float | None) -> _Item | None:
        if self._held is not None:
            item, self._held = self._held, None
            return item
        try:
            return self.queue.get(timeout=timeout) if timeout is None or timeout > 0 else self.queue.get_nowait()
        except queue.Empty:
            return None

    def _gather(self, first: _Item, *, busy: bool) -> list[_Item]:
        """`first` and what joins it: what is queued, and (`busy`: it queued while a batch ran) requests still
        being prepared, for up to the window."""
        batch = [first]
        if not self.config.enabled:
            return batch
        c = self.config
        questions, tokens = first.questions, first.tokens
        deadline = time.perf_counter() + (c.window_ms / 1000.0 if busy else 0.0)
        while True:
            if self._arriving == 0 and self.queue.empty():
                return batch  # nobody else is on the way: waiting would only add latency
            left = deadline - time.perf_counter()
            # short polls, so a request that leaves `arriving()` right after its submit is noticed at once;
            # past the window, only what is already queued joins
            item = self._next(min(left, POLL_S) if left > 0 else 0)
            if item is None:
                if left <= 0:
                    return batch
                continue
            if questions + item.questions > c.max_batch_questions or tokens + item.tokens > c.max_batch_tokens:
                self._held = item  # the first of the next batch
                return batch
            batch.append(item)
            questions += item.questions
            tokens += item.tokens

    def _run(self) -> None:
        while not (self._stop.is_set() and self.queue.empty() and self._held is None):
            busy = self._held is not None or not self.queue.empty()  # queued while the last batch ran
            first = self._next(0.05)
            if first is None:
                continue
            batch = [i for i in self._gather(first, busy=busy) if i.future.set_running_or_notify_cancel()]
            if not batch:
                continue
            t0 = time.perf_counter()
            try:
                results = self.score_many([i.prepared for i in batch])
            except Exception as e:  # a bug in scoring: every request of the batch gets it
                results = [e] * len(batch)
            self.last_batch_s = time.perf_counter() - t0
            self._count([i for i in batch if i.counted], self.last_batch_s)
            for item, res in zip(batch, results):
                item.future.queue_s, item.future.model_s = t0 - item.future.submitted, self.last_batch_s
                if isinstance(res, BaseException):
                    item.future.set_exception(res)
                else:
                    item.future.set_result(res)
            del batch, results
            release_free_memory()

    def _count(self, items: list[_Item], seconds: float) -> None:
        """A batch in `stats()` and to the observer, its uncounted requests (the warm-up) left out."""
        if not items:
            return
        self.busy_s += seconds
        self.batches += 1
        self.batched_requests += len(items)
        if self.observer is not None:
            try:
                self.observer(len(items), sum(i.questions for i in items), sum(i.tokens for i in items), seconds)
            except Exception:  # noqa: BLE001 - metrics must never stop the model thread
                logging.getLogger("rlcd.server").exception("batch observer failed")

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting, answer everything queued, stop the model thread."""
        self.accepting = False
        self._stop.set()
        self.thread.join(timeout)

    def stats(self) -> dict[str, Any]:
        return {"batches": self.batches, "requests": self.batched_requests,
                "mean_batch": self.batched_requests / self.batches if self.batches else None,
                "busy_s": self.busy_s,
                "queued": self.queue.qsize(), **self.config.to_dict()}


__all__ = ["Batcher", "BatchingConfig", "Overloaded", "TimedFuture", "DEFAULT_WINDOW_MS"]
