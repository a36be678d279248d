"""Files rlcd writes: their modes (as a plain `open()` makes them) and the temporary directories of dead writers.

safetensors' `save_file` (and `save_pretrained`, which calls it) writes through a private temporary file and
leaves the weights mode 600 while every other file of the same directory is 644 under the usual umask 022: a
portable export or an `export/hf` copied into a container that runs as another user then cannot read its
weights. `plain_mode(path)` gives such a file the mode `0o666 & ~umask` -- what `open()` creates -- so the
umask the user chose still decides (a umask of 077 keeps it private).

`pid_alive(pid)`: whether a writer whose temporary directory is named after its pid still runs (a SIGKILL runs no
cleanup, so its `.tmp-...-<pid>` stays behind until the next start removes it).

`need_space(dir, nbytes, what, kept)`: refuse, before writing, a file that cannot fit: assembling a cache copies its
committed chunks end to end, so its peak is twice its size; without the check the copy runs until the disk is full
(minutes for a cache of gigabytes) and the CLI's ENOSPC handler then says the disk is full but not how much is needed.

`write_atomic(path, text, durable=...)`: the one way a small file is replaced whole (run files, probe results,
batch parts and outputs): written under a temporary name beside it, then renamed over it, so a reader sees the old
file or the new one, never half of one. `durable=True` also fsyncs the file before the rename and the directory
after it (a batch part must survive a crash, since `--resume` trusts what it finds); `False` leaves that to the
kernel (a config or a probe result written again by the next run).
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Iterable

_LOCK = threading.Lock()


def umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc/self/status, "Umask:"); else
    set and restored at once under a lock (`os.umask` has no read-only form)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _LOCK:
        old = os.umask(0o022)
        os.umask(old)
    return old


def plain_mode(*paths: Path | str) -> None:
    """chmod each file in `paths` to `0o666 & ~umask()`: the mode `open(path, "w")` would have given it."""
    mode = 0o666 & ~umask()
    for p in paths:
        os.chmod(p, mode)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user counts as alive: it may be writing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_dir(path: Path) -> None:
    """fsync a directory, so a rename into it survives a crash (atomic checkpoints, batch parts)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path | str, text: str | Iterable[str], *, durable: bool) -> None:
    """Replace `path` by `text` (a string, or pieces written in turn: a large output is never joined in memory)
    through a temporary file beside it (`.NAME.tmp-PID`, removed if the write fails) and a rename; `durable`:
    fsync the file before the rename and the directory after it (module docstring)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            for piece in [text] if isinstance(text, str) else text:
                fh.write(piece)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def need_space(directory: Path, nbytes: int, what: str, kept: str, margin: int = 64 << 20) -> None:
    """Raise `DiskSpaceError` unless `directory` has `nbytes` (+ `margin`) free; `kept` says what a re-run keeps."""
    from rlcd.errors import DiskSpaceError

    free = shutil.disk_usage(directory).free
    if free < nbytes + margin:
        raise DiskSpaceError(f"{what} needs {_size(nbytes)} (and {_size(margin)} of headroom) under {directory}, but "
                             f"only {_size(free)} are free; free some space and re-run the same command ({kept})")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


__all__ = ["fsync_dir", "need_space", "pid_alive", "plain_mode", "umask", "write_atomic"]
