"""The partial directory of a resumable cache extraction: what a killed `rlcd features` keeps.

Extracting a cache (`rlcd.features`, `rlcd.cut_cache`) over real weights on a CPU takes from tens of minutes
to hours, so the work is committed in chunks into a directory tied to the cache KEY, and a later extraction
of the same key computes only the chunks it does not find there:

    DATA/features/.partial-<NAME>/       NAME: the published directory's name (<KEY_ID>, cut-<KEY_ID>)
      lock                             flock'ed by the one extraction writing here; holds its pid
      progress.json                    {"key", "name", "chunk_calls", "rows_per_call", "done": {split: {chunk:
                                        {"entries", "digest"}}}, "seconds", "attempts", "updated"}
      <split>-<chunk:05d>.<suffix>     one chunk's files (the cache decides which)

A chunk is `CHUNK_CALLS` consecutive extraction calls of one split (`plan_chunks`): whole cases packed
greedily into calls of at most `rows_per_call` entries, exactly the calls an extraction in one go makes, so
every entry sees the same batch and a resumed cache is byte for byte the uninterrupted one. Chunk
boundaries are a pure function of the split's entries, never of when a run was killed. A chunk counts as done
when progress.json lists it with the digest of its entries and calls (`chunk_digest`: ids, orders and call
layout; another split file, another order scheme or another packing is another digest) and its files exist;
each file is written as `<file>.tmp`, fsync'd and renamed, then progress.json the same way, so a kill at any
instant leaves whole chunks and at most a `.tmp` file (removed on the next start).

One writer at a time: the lock is `fcntl.flock` on `lock`; a second extraction of the same key says which pid
holds it and waits (it then usually finds the first one's published cache). The directory is removed once
its cache is published. A partial of another key is never read nor removed silently: the extraction names
them (`others`) so they can be resumed with their own key, or deleted by hand.

Chunk size: 8 calls of at most 64 entries (<= 512 entries unless one case alone has more than 64). Whole calls,
so chunking changes no batch; 512 entries, so a kill loses little: issue 54's derived-forms cut cache (~105,700
entries, several CPU hours, as reported there, not measured here) is ~210 chunks of a minute or two each,
while ~210 small files and fsyncs cost nothing next to that. The feature chunks are also what bounds memory: a
split is assembled into preallocated tensors one chunk file at a time.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from rlcd.files import fsync_dir

CHUNK_CALLS = 8
PREFIX = ".partial-"
PROGRESS = "progress.json"
LOCK = "lock"


def plan_chunks(groups: list[list[int]], rows_per_call: int,
                chunk_calls: int | None = None) -> list[list[list[list[int]]]]:
    """Chunks -> calls -> cases -> entry indices: cases (`groups`, in order) packed greedily into calls of at most
    `rows_per_call` entries (a larger case is a call of its own), `chunk_calls` (default `CHUNK_CALLS`) calls a
    chunk. A pure function of its arguments."""
    chunk_calls = CHUNK_CALLS if chunk_calls is None else chunk_calls
    calls: list[list[list[int]]] = []
    call: list[list[int]] = []
    for g in groups:
        if call and sum(len(x) for x in call) + len(g) > rows_per_call:
            calls.append(call)
            call = []
        call.append(g)
    if call:
        calls.append(call)
    return [calls[i:i + chunk_calls] for i in range(0, len(calls), chunk_calls)]


def chunk_entries(chunk: list[list[list[int]]]) -> list[int]:
    """The entry indices of a chunk in the order it computes them."""
    return [j for call in chunk for g in call for j in g]


def chunk_digest(chunk: list[list[list[int]]], entries: list) -> str:
    """sha256 (16 hex) of a chunk's call layout and of the (id, order) of its entries."""
    ids = [[entries[j][0].id, int(entries[j][1])] for j in chunk_entries(chunk)]
    return hashlib.sha256(json.dumps([chunk, ids]).encode()).hexdigest()[:16]


def _write_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class Partial:
    """The partial directory of the cache `name` (its published directory's name) with key `key` under `root`."""

    def __init__(self, root: Path, name: str, key: dict[str, Any], rows_per_call: int):
        self.root, self.name, self.key, self.rows_per_call = Path(root), name, key, int(rows_per_call)
        self.dir = self.root / f"{PREFIX}{name}"
        self.state: dict[str, Any] = self._fresh()
        self._fd: int | None = None
        self._t0 = time.perf_counter()
        self._before = 0.0

    def _fresh(self) -> dict[str, Any]:
        return {"key": self.key, "name": self.name, "chunk_calls": CHUNK_CALLS, "rows_per_call": self.rows_per_call,
                "done": {}, "seconds": 0.0, "attempts": 0}

    # -- the lock ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def held(self, say: Callable[[str], None], what: str) -> Iterator["Partial"]:
        """This directory, created if needed and locked for this process (waiting, after saying so, while another
        extraction holds it); its `.tmp` files are removed when the block ends (a failed chunk's leftovers)."""
        self._lock(say, what)
        try:
            yield self
        finally:
            if self.dir.is_dir():
                for f in self.dir.glob("*.tmp"):
                    f.unlink(missing_ok=True)
            os.close(self._fd)  # type: ignore[arg-type]
            self._fd = None

    def _lock(self, say: Callable[[str], None], what: str) -> None:
        told = False
        while True:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                if not told:
                    say(f"{what}: another extraction (pid {self._holder(fd)}) is writing {self.dir}; waiting for it")
                    told = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:  # the holder may have finished and removed the directory: this lock is then on a dead file
                same = os.fstat(fd).st_ino == os.stat(self.dir / LOCK).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self._fd = fd
                return
            os.close(fd)

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            return os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        except OSError:
            return "?"

    # -- progress ------------------------------------------------------------------------------

    def published_meanwhile(self, load: Callable[[], Any], say: Callable[[str], None], what: str, final: Path) -> Any:
        """The cache another extraction published while this one waited for the lock (`load()`; this partial is
        then removed), else None, with this attempt begun (`begin`). Call with the lock held."""
        again = load()
        if again is not None:
            self.remove()
            say(f"{what}: reusing {final}")
            return again
        self.begin()
        return None

    def begin(self) -> None:
        """Read what earlier attempts finished (a progress file of another key or chunk layout is ignored and its
        chunks removed), count this attempt and start its clock. Call with the lock held."""
        try:
            state = json.loads((self.dir / PROGRESS).read_text())
        except (OSError, ValueError):
            state = None
        if not (isinstance(state, dict) and state.get("key") == self.key and state.get("name") == self.name
                and state.get("chunk_calls") == CHUNK_CALLS and state.get("rows_per_call") == self.rows_per_call
                and isinstance(state.get("done"), dict)):
            if state is not None or any(self.dir.iterdir()):
                for f in self.dir.iterdir():
                    if f.name != LOCK:
                        f.unlink() if not f.is_dir() else shutil.rmtree(f, ignore_errors=True)
            state = self._fresh()
        state["attempts"] = int(state.get("attempts", 0)) + 1
        self.state = state
        self._before = float(state.get("seconds", 0.0))
        self._t0 = time.perf_counter()
        self._save()

    @property
    def attempts(self) -> int:
        return int(self.state["attempts"])

    def seconds(self) -> float:
        """Extraction seconds over every attempt: earlier ones up to their last finished chunk, this one so far."""
        return self._before + time.perf_counter() - self._t0

    def entries_done(self, split: str | None = None) -> int:
        """Entries in the chunks listed as done (of `split`, else of every split)."""
        done = self.state["done"]
        return sum(int(c["entries"]) for s, chunks in done.items() if split in (None, s) for c in chunks.values())

    def file(self, split: str, chunk: int, suffix: str) -> Path:
        return self.dir / f"{split}-{chunk:05d}.{suffix}"

    def tmp(self, split: str, chunk: int, suffix: str) -> Path:
        """Where a chunk's file is written before `commit` renames it into place."""
        p = self.file(split, chunk, suffix)
        return p.with_name(p.name + ".tmp")

    def has(self, split: str, chunk: int, digest: str, suffixes: tuple[str, ...]) -> bool:
        """Whether chunk `chunk` of `split` is done for these entries (`digest`) and its files are there."""
        c = self.state["done"].get(split, {}).get(str(chunk))
        return bool(c and c.get("digest") == digest and all(self.file(split, chunk, s).is_file() for s in suffixes))

    def commit(self, split: str, chunk: int, digest: str, entries: int, suffixes: tuple[str, ...]) -> None:
        """fsync each `tmp(split, chunk, suffix)` and rename it into place, then record the chunk as done."""
        for s in suffixes:
            tmp = self.tmp(split, chunk, s)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, self.file(split, chunk, s))
        fsync_dir(self.dir)
        self.state["done"].setdefault(split, {})[str(chunk)] = {"entries": int(entries), "digest": digest}
        self._save()

    def _save(self) -> None:
        self.state["seconds"] = round(self.seconds(), 3)
        self.state["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        _write_durably(self.dir / PROGRESS, json.dumps(self.state, sort_keys=True) + "\n")

    def remove(self) -> None:
        """Delete the directory (its cache is published). Call with the lock held: a waiter then sees the lock
        file gone and looks again."""
        shutil.rmtree(self.dir, ignore_errors=True)

    def others(self) -> list[Path]:
        """Partial directories of other keys in the same root (kept: never read for this key)."""
        return sorted(d for d in self.root.glob(f"{PREFIX}*") if d.is_dir() and d != self.dir)


def drop_finished(root: Path, name: str) -> None:
    """Remove the partial directory of a cache already published under `name` (a kill between publishing and
    removing it), unless an extraction holds its lock."""
    d = Path(root) / f"{PREFIX}{name}"
    if not d.is_dir():
        return
    try:
        fd = os.open(d / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return
    shutil.rmtree(d, ignore_errors=True)
    os.close(fd)


__all__ = ["CHUNK_CALLS", "Partial", "chunk_digest", "chunk_entries", "drop_finished", "plan_chunks"]
