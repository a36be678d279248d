"""Atomic checkpoints: a write killed half-way leaves the previous checkpoint loadable."""

import os

import pytest
import torch

from rlcd import checkpoint as ckpt


def _w(v):
    return {"a": torch.full((3,), float(v)), "b": torch.arange(4.0) * v}


def test_round_trip(tmp_path):
    ckpt.save(tmp_path / "last", weights=_w(1), optimizer={"x": 1}, state={"step": 5})
    got = ckpt.load(tmp_path / "last")
    assert got["state"]["step"] == 5 and got["optimizer"] == {"x": 1}
    assert torch.equal(got["weights"]["b"], _w(1)["b"])
    assert len(ckpt.weights_sha256(tmp_path / "last")) == 64


def test_failed_write_keeps_previous(tmp_path, monkeypatch):
    ckpt.save(tmp_path / "last", weights=_w(1), optimizer=None, state={"step": 1})

    def boom(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckpt.torch, "save", boom)
    with pytest.raises(OSError):
        ckpt.save(tmp_path / "last", weights=_w(2), optimizer={"x": 2}, state={"step": 2})
    monkeypatch.undo()
    got = ckpt.load(tmp_path / "last")
    assert got["state"]["step"] == 1 and torch.equal(got["weights"]["a"], _w(1)["a"])


def test_interrupted_swap_falls_back_to_old(tmp_path, monkeypatch):
    ckpt.save(tmp_path / "last", weights=_w(1), optimizer=None, state={"step": 1})
    real_rename = os.rename
    calls = []

    def rename_then_die(src, dst):
        calls.append((src, dst))
        real_rename(src, dst)
        if str(dst).endswith(".old"):
            raise KeyboardInterrupt("killed between the two renames")

    monkeypatch.setattr(ckpt.os, "rename", rename_then_die)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(tmp_path / "last", weights=_w(2), optimizer=None, state={"step": 2})
    monkeypatch.undo()
    assert not (tmp_path / "last").exists()
    got = ckpt.load(tmp_path / "last")
    assert got["state"]["step"] == 1
    # the next save recovers cleanly
    ckpt.save(tmp_path / "last", weights=_w(3), optimizer=None, state={"step": 3})
    assert ckpt.load(tmp_path / "last")["state"]["step"] == 3
    assert not (tmp_path / "last.old").exists()


def test_missing_checkpoint_message(tmp_path):
    with pytest.raises(FileNotFoundError, match="no loadable checkpoint"):
        ckpt.load(tmp_path / "nothing")


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_writer_killed_mid_write_leaves_a_temp_never_read_and_removed_on_the_next_start(tmp_path):
    """A real writer SIGKILLed after every file of its new checkpoint is written (nothing of `save`'s cleanup runs):
    its `.tmp-last-<pid>` holds a complete-looking checkpoint, yet `last` still resolves to the previous one;
    `remove_dead_temps` removes it (and another dead writer's), never a live writer's nor a checkpoint."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    ckpt.save(tmp_path / "last", weights=_w(1), optimizer=None, state={"step": 1})
    ckpt.save(tmp_path / "best", weights=_w(1), optimizer=None, state={"step": 1})
    script = ("import os, signal, torch\n"
              "from rlcd import checkpoint as ckpt\n"
              "ckpt._fsync_dir = lambda p: os.kill(os.getpid(), signal.SIGKILL)\n"
              f"ckpt.save(__import__('pathlib').Path({str(tmp_path / 'last')!r}), weights={{'a': torch.zeros(3)}},"
              " optimizer=None, state={'step': 2})\n")
    src = Path(__file__).resolve().parents[1] / "src"
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(src)},
                            stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    killed = tmp_path / f".tmp-last-{proc.pid}"
    assert sorted(p.name for p in killed.iterdir()) == [ckpt.RNG, ckpt.STATE, ckpt.WEIGHTS], "the write got far"
    assert ckpt.resolve(tmp_path / "last") == tmp_path / "last" and ckpt.load(tmp_path / "last")["state"]["step"] == 1
    other = tmp_path / f".tmp-best-{_dead_pid()}"
    other.mkdir()
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as live:
        try:
            (tmp_path / f".tmp-best-{live.pid}").mkdir()
            assert ckpt.remove_dead_temps(tmp_path) == sorted([killed, other])
            assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f".tmp-best-{live.pid}", "best", "last"])
        finally:
            live.kill()
    assert ckpt.load(tmp_path / "last")["state"]["step"] == 1 and ckpt.load(tmp_path / "best")["state"]["step"] == 1
