"""The request caches' store: an LRU bounded in bytes, shared by the requests of one served model.

Serving owns the caches (`serving.state_encoding.StateEncoder` makes two: the state cache of prefix states and the
row cache of answered rows), their sizes and their scope (`cache_scope`: a model's identity as it is now); the runner
that scores cases (`rlcd.model.runner.CaseRunner`) computes the keys and reads and writes the entries
(`rlcd.model.state_cache`: what an entry is). An entry is anything with `nbytes`, the bytes it keeps alive.

`StateCache` is an LRU bounded in those bytes: least recently used entries go first; an entry larger than the bound
is not stored; `max_bytes=0` disables it. Thread-safe (one lock). Torch-free: the portable server builds it too.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Protocol


class Entry(Protocol):
    """What the store holds: anything that says the bytes it keeps alive."""

    nbytes: int


class StateCache:
    """An LRU of entries (each with `nbytes`: prefix states, row features) bounded in bytes; `max_bytes=0` disables
    it (get misses nothing, put stores nothing, no counter moves). `stats()` is a flat dict of ints for monitoring."""

    def __init__(self, max_bytes: int):
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = self._too_large = self._stores = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def get(self, key: Hashable) -> Entry | None:
        if not self.enabled:
            return None
        with self._lock:
            state = self._entries.get(key)
            if state is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return state

    def put(self, key: Hashable, state: Entry) -> bool:
        """Store `state` (most recent), evicting the least recently used until it fits; False when it is larger
        than the whole bound (not stored) or the cache is disabled."""
        if not self.enabled:
            return False
        with self._lock:
            if state.nbytes > self.max_bytes:
                self._too_large += 1
                return False
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            while self._entries and self._bytes + state.nbytes > self.max_bytes:
                _, gone = self._entries.popitem(last=False)
                self._bytes -= gone.nbytes
                self._evictions += 1
            self._entries[key] = state
            self._bytes += state.nbytes
            self._stores += 1
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def keys(self) -> list[Hashable]:
        """Keys from least to most recently used (tests, debugging)."""
        with self._lock:
            return list(self._entries)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self._hits, "misses": self._misses, "entries": len(self._entries), "bytes": self._bytes,
                    "max_bytes": self.max_bytes, "evictions": self._evictions, "stores": self._stores,
                    "too_large": self._too_large}

    def scoped(self, scope: Hashable) -> "ScopedStateCache":
        return ScopedStateCache(self, scope)


@dataclass(frozen=True)
class ScopedStateCache:
    """`StateCache` keys prefixed by `scope` (a model's fingerprint): what a runner's `score_cases` takes."""

    cache: StateCache
    scope: Hashable

    def get(self, key: Hashable) -> Entry | None:
        return self.cache.get((self.scope, key))

    def put(self, key: Hashable, state: Entry) -> bool:
        return self.cache.put((self.scope, key), state)


__all__ = ["Entry", "ScopedStateCache", "StateCache"]
