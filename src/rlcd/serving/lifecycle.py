"""Whether the server should get traffic: warm-up, readiness, in-flight requests and drain.

Why apart from `/health`: a load balancer must not route to a process that is alive but cannot answer well yet (the
model still loading, its first forward still paying for allocations and kernels) or that is being taken out of
rotation. So

* `/health` is liveness: the process answers HTTP (always 200 while it runs);
* `/ready` is readiness: 200 only when the model is loaded, the warm-up request has been answered and the server is
  not draining; otherwise 503 with the reason;
* `/drain` stops admitting `/v1/*` requests (503 + Retry-After, `type: "draining"`), waits until the ones in flight
  are answered, and leaves `/ready` at 503 for good: the replica can then be stopped without failing a request.

The warm-up is one tiny request through the real path (`Predictor.prepare` in the worker pool, the batcher's model
thread, `Predictor.respond`), not counted in the batcher's stats or the metrics (`Batcher.submit(counted=False)`).
The counters are touched from the event loop and worker threads, so a lock guards them; waiting polls instead of
using an asyncio primitive, which would bind to one event loop (a TestClient runs each request on a fresh one).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable

from rlcd.serving.batcher import Overloaded

# what the warm-up asks: valid for every backbone (text only, two candidates, a few tokens)
WARM_UP_REQUEST = {"state": "rlcd warm-up request", "questions": {
    "warm-up": {"type": "noul", "instructions": "Is this a warm-up request?"}}}
DRAIN_RETRY_AFTER_S = 1  # seconds: a draining replica does not come back; the hint is to retry elsewhere now
POLL_S = 0.01


class Draining(Overloaded):
    """503 for a /v1 request that arrives while the server drains."""

    def __init__(self) -> None:
        super().__init__("the server is draining (being taken out of rotation or stopped): retry on another "
                         "replica", DRAIN_RETRY_AFTER_S)
        self.kind = "draining"


class Lifecycle:
    """Warm-up state, the drain flag and the count of admitted /v1 requests not yet answered."""

    def __init__(self, model_loaded: Callable[[], bool] = lambda: True):
        self.model_loaded = model_loaded
        self.warmed_up = False
        self.warm_up_error: str | None = None
        self.draining = False
        self.in_flight = 0
        self._lock = threading.Lock()

    def readiness(self) -> tuple[bool, str | None]:
        """(ready, why not): draining first (it is final), then a failed or unfinished warm-up."""
        if self.draining:
            return False, "draining: this server takes no new requests"
        if self.warm_up_error is not None:
            return False, f"the warm-up request failed: {self.warm_up_error}"
        if not self.model_loaded():
            return False, "the model is not loaded yet"
        if not self.warmed_up:
            return False, "warming up: the first request has not been answered yet"
        return True, None

    def admit(self) -> None:
        """Count a /v1 request in; Draining (503) once a drain started. No await between check and count, so a drain
        waits for every request it did not refuse."""
        with self._lock:
            if self.draining:
                raise Draining()
            self.in_flight += 1

    def done(self) -> None:
        with self._lock:
            self.in_flight -= 1

    async def drain(self, timeout_s: float) -> int:
        """Refuse new /v1 requests from now on and wait up to `timeout_s` for those in flight; returns how many are
        still in flight (0: drained)."""
        with self._lock:
            self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        return self.in_flight

    async def warm_up(self, answer: Callable[[Any], Any]) -> None:
        """Run `answer(WARM_UP_REQUEST)` (a coroutine function: the real request path); ready when it returns."""
        try:
            await answer(WARM_UP_REQUEST)
        except Exception as e:  # noqa: BLE001 - reported by /ready and the log; the server keeps running
            logging.getLogger("rlcd.server").exception("the warm-up request failed")
            self.warm_up_error = f"{type(e).__name__}: {e}"
            return
        self.warmed_up = True


__all__ = ["Lifecycle", "Draining", "WARM_UP_REQUEST", "DRAIN_RETRY_AFTER_S"]
