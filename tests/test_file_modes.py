"""Weights are as readable as every other file rlcd writes: safetensors' `save_file` leaves 600, a plain `open()`
leaves 0o666 & ~umask (644 under the usual 022), so a run's export/ copied into a container running as another
user can read its weights (issue 58). The portable export's files: tests/test_onnx_export.py."""

import os
import stat
from pathlib import Path

import pytest
import torch

from _tiny_export import make_tiny_export
from rlcd import checkpoint as ckpt
from rlcd.files import umask


@pytest.fixture
def mask():
    """Set the umask for one test (`mask(0o022)`), restored after."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_umask_is_read_as_set(mask):
    for m in (0o022, 0o077, 0o002):
        mask(m)
        assert umask() == m
        assert umask() == m, "reading it left it as it was"


def test_every_file_of_a_run_and_its_exports_is_readable_like_the_rest(tmp_path, mask):
    from rlcd.evaluate import write_hf
    from rlcd.run import Run

    mask(0o022)
    run = make_tiny_export(tmp_path / "run", model_spec="tiny-toy")
    write_hf(Run(run))
    modes = _modes(run)
    assert "export/hf/model.safetensors" in modes and "checkpoints/best/trainable.safetensors" in modes
    assert {name: m for name, m in modes.items() if m != 0o644} == {}, "every file as open() makes it under 022"


def test_a_private_umask_keeps_the_weights_private(tmp_path, mask):
    mask(0o077)
    ckpt.save(tmp_path / "last", weights={"a": torch.ones(3)}, optimizer=None, state={"step": 1})
    assert _modes(tmp_path / "last") == {name: 0o600 for name in (ckpt.RNG, ckpt.STATE, ckpt.WEIGHTS)}
