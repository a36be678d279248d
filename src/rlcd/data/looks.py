"""`DATA/test-looks.jsonl`: every time a data directory's test split was scored, kept beside the split.

The cookbook's rule is to decide on dev and keep the final test split untouched; nothing else records how
often a test split has been looked at, and every look spent on choosing (a checkpoint, a recipe, a
threshold) makes its numbers more optimistic. `rlcd evaluate RUN` and `rlcd evaluate RUN --data OTHER`
append one line when they score a test split:

    {"run", "eval", "when", "command", "argv", "test_sha256", "checkpoint_sha256", "rows"}

and say, on stderr and in the report, how many looks came before. Rules:

- Looks count per test split *content* (`test_sha256`): a re-prepared split with other rows starts at 0,
  the same rows written again keep their count.
- One evaluation is one look: the same run scoring the same split with the same checkpoint again (a
  recomputation: the numbers are the ones already seen) is not recorded twice.
- Appends are safe beside other writers: the file is locked (flock) while it is read and the line appended
  in one write. A directory that cannot be written is reported, never fatal (`Looks.error`).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcd.data.io import sha256_file

LOOKS_FILE = "test-looks.jsonl"
ARGV_CHARS = 300


@dataclass
class Looks:
    """What `record_look` found: the earlier looks at this split (other evaluations), whether this one was
    new, and an error when the file could not be written."""

    data_dir: Path
    before: list[dict] = field(default_factory=list)
    recorded: bool = False
    error: str | None = None
    repeat: dict | None = None  # the earlier look this evaluation recomputes (same run, eval, checkpoint), if any

    @property
    def latest(self) -> dict | None:
        return max(self.before, key=lambda x: x.get("when", "")) if self.before else None

    def meta(self) -> dict[str, Any]:
        """evaluation.json's `meta.test_looks` (what the report's note reads)."""
        latest = self.latest
        return {"data_dir": str(self.data_dir), "before": len(self.before), "recorded": self.recorded,
                "latest": {k: latest.get(k) for k in ("run", "when", "command")} if latest else None,
                **({"error": self.error} if self.error else {})}

    def note(self) -> str | None:
        """The stderr line (without "note: "), when the split was scored before: by other evaluations (counted),
        or only by this same evaluation (a recomputation, not counted again)."""
        counted = looks_note(self.meta(), tense="has")
        if counted is not None or self.repeat is None:
            return counted
        return (f"{self.data_dir}'s test split was already scored by this run's checkpoint at "
                f"{self.repeat.get('when')} ({self.repeat.get('command')}): the same numbers again, not counted as "
                "another look")


def looks_note(meta: dict | None, *, tense: str = "had") -> str | None:
    """'DATA's test split has (had) been scored N time(s) before ...' from `Looks.meta()`, or None when N = 0."""
    n = int((meta or {}).get("before") or 0)
    if n <= 0:
        return None
    latest = meta.get("latest") or {}
    when = f" at {latest['when']}" if latest.get("when") else ""
    return (f"{meta.get('data_dir')}'s test split {tense} been scored {n} time{'s' if n != 1 else ''} before "
            f"{'this evaluation ' if tense == 'had' else ''}(latest: {latest.get('run')}{when}); choosing on it (a "
            "checkpoint, a recipe, a threshold) makes its numbers optimistic: choose on dev, keep test for the end")


def _path(data_dir: Path) -> Path:
    return Path(data_dir) / LOOKS_FILE


def _read(path: Path) -> list[dict]:
    out = []
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:  # missing, or not readable: no looks known (record_look says why it cannot write)
        return out
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn line of a crashed writer: skipped, the others still count
        if isinstance(obj, dict):
            out.append(obj)
    return out


def sha256_of_test(data_dir: Path) -> str | None:
    p = Path(data_dir) / "test.jsonl"
    return sha256_file(p) if p.is_file() else None


def previous_looks(data_dir: Path, *, exclude_runs_under: Path | None = None) -> list[dict]:
    """The recorded looks at the data directory's current test split (by its sha256), oldest first;
    `exclude_runs_under`: leave out looks by runs inside that directory (a sweep's own runs)."""
    sha = sha256_of_test(data_dir)
    looks = [x for x in _read(_path(data_dir)) if sha is not None and x.get("test_sha256") == sha]
    if exclude_runs_under is not None:
        root = str(Path(exclude_runs_under).resolve()) + os.sep
        looks = [x for x in looks if not str(x.get("run", "")).startswith(root)]
    return looks


def _argv() -> str:
    """This process's command line, `rlcd ...` when it is the rlcd CLI (`rlcd`, `python -m rlcd.cli`)."""
    argv = list(sys.argv) or [""]
    first = Path(argv[0])
    if first.name == "rlcd" or first.parts[-3:] == ("rlcd", "cli", "__main__.py"):
        argv[0] = "rlcd"
    return shlex.join(argv)


def _key(look: dict) -> tuple:
    return (look.get("run"), look.get("checkpoint_sha256"), look.get("test_sha256"))


def record_look(data_dir: Path, *, run: Path, eval_name: str, checkpoint_sha256: str, rows: int,
                command: str, when: str | None = None) -> Looks:
    """Append this evaluation's look at `data_dir`'s test split (unless the same evaluation is already there)
    and return the looks before it. Never raises on an unwritable directory: `Looks.error` says why."""
    import fcntl

    data_dir = Path(data_dir).resolve()
    look = {"run": str(Path(run).resolve()), "eval": eval_name,
            "when": when or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": command, "argv": _argv()[:ARGV_CHARS], "test_sha256": sha256_of_test(data_dir),
            "checkpoint_sha256": checkpoint_sha256, "rows": int(rows)}
    out = Looks(data_dir)
    try:
        fd = os.open(_path(data_dir), os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        out.before = previous_looks(data_dir)
        out.error = f"{_path(data_dir)}: {e.strerror or e}"
        return out
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        same = [x for x in _read(_path(data_dir)) if x.get("test_sha256") == look["test_sha256"]]
        out.before = [x for x in same if _key(x) != _key(look)]
        out.repeat = next((x for x in same if _key(x) == _key(look)), None)
        if out.repeat is None:
            os.write(fd, (json.dumps(look, sort_keys=True) + "\n").encode("utf-8"))
            os.fsync(fd)
            out.recorded = True
    except OSError as e:
        out.error = f"{_path(data_dir)}: {e.strerror or e}"
    finally:
        os.close(fd)  # releases the lock
    return out


__all__ = ["LOOKS_FILE", "Looks", "looks_note", "previous_looks", "record_look", "sha256_of_test"]
