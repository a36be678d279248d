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
