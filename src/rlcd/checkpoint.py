"""Atomic checkpoints: trainable weights (safetensors), optimizer, step, RNG states, recipe, score.

A checkpoint directory is written under a temporary name, every file fsync'd, then swapped in with
renames, so a kill at any moment leaves a loadable checkpoint: either the new one, or the previous
one (kept as `<name>.old` for the instant between the two renames; `load` falls back to it). A write that fails
(a full disk: an `OSError` naming the file) removes its temporary directory and leaves the previous one as it was.
A SIGKILL mid-write runs no cleanup: its `.tmp-<name>-<pid>` stays until the next start of the run calls
`remove_dead_temps` (train and resume do). A temporary directory is never read as a checkpoint: `resolve` looks at
`<name>` and `<name>.old` only.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rlcd.files import fsync_dir as _fsync_dir  # a module name the killed-write test replaces
from rlcd.files import pid_alive, plain_mode

WEIGHTS = "trainable.safetensors"
OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"
STATE = "state.json"


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _torch_save(obj: Any, path: Path) -> None:
    """`torch.save` through a buffer that Python writes: a full disk is then `OSError: [Errno 28] No space left on
    device: PATH`, where torch's own file writer says only `[enforce fail at inline_container.cc] unexpected pos`."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    with open(path, "wb") as f:
        f.write(buf.getbuffer())


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save(path: Path, *, weights: dict[str, torch.Tensor], optimizer: dict | None, state: dict) -> None:
    """Write a checkpoint atomically at `path` (a directory)."""
    path = Path(path)
    parent = path.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".tmp-{path.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp / WEIGHTS))
        plain_mode(tmp / WEIGHTS)  # safetensors writes 600; every other file of the run is what open() makes
        if optimizer is not None:
            _torch_save(optimizer, tmp / OPTIMIZER)
        _torch_save(rng_state(), tmp / RNG)
        (tmp / STATE).write_text(json.dumps(state, indent=2, sort_keys=True))
        for f in tmp.iterdir():
            _fsync_file(f)
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk gets its room back; a resume (another pid) never would
        raise
    old = parent / f"{path.name}.old"
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(parent)
    if old.exists():
        shutil.rmtree(old)


def remove_dead_temps(directory: Path) -> list[Path]:
    """Remove the `.tmp-<name>-<pid>` directories in `directory` that `save` left when its process died mid-write:
    those whose pid no longer runs, or is this process's own (a restarted container reuses pids; call this before
    this process saves). A live writer's directory stays. Returns what was removed."""
    removed = []
    for tmp in sorted(Path(directory).glob(".tmp-*-*")):
        pid = tmp.name.rsplit("-", 1)[-1]
        if not tmp.is_dir() or not pid.isdigit() or (int(pid) != os.getpid() and pid_alive(int(pid))):
            continue
        shutil.rmtree(tmp, ignore_errors=True)
        removed.append(tmp)
    return removed


def resolve(path: Path) -> Path | None:
    """The loadable checkpoint at `path`, or its `.old` twin if a swap was interrupted."""
    path = Path(path)
    for cand in (path, path.parent / f"{path.name}.old"):
        if (cand / STATE).is_file() and (cand / WEIGHTS).is_file():
            return cand
    return None


def load(path: Path, *, map_location: str = "cpu") -> dict[str, Any]:
    found = resolve(path)
    if found is None:
        raise FileNotFoundError(f"no loadable checkpoint at {path}")
    out: dict[str, Any] = {
        "path": found,
        "weights": load_file(str(found / WEIGHTS), device=map_location),
        "state": json.loads((found / STATE).read_text()),
    }
    if (found / OPTIMIZER).is_file():
        out["optimizer"] = torch.load(found / OPTIMIZER, map_location=map_location, weights_only=False)
    if (found / RNG).is_file():
        out["rng"] = torch.load(found / RNG, weights_only=False)
    return out


def weights_sha256(path: Path) -> str:
    found = resolve(path)
    if found is None:
        raise FileNotFoundError(f"no loadable checkpoint at {path}")
    h = hashlib.sha256()
    with open(found / WEIGHTS, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
