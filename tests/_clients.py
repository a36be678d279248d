"""Where the TypeSafe client family lives for the tests: `.venv-clients/` (built by `make clients` from
requirements-clients.txt with Python >= 3.13, which jev-cli needs). Offline without it the tests that drive the
clients skip, saying why; under CI (`CI` set) a missing venv is a failure, since CI installs it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-clients"
BIN = VENV / "bin"


def clients_bin(name: str = "python") -> Path:
    """A program of the clients venv; skip (fail under CI) when it is not there."""
    path = BIN / name
    if not path.is_file():
        why = f"{path} is missing: `make clients` builds it from requirements-clients.txt (needs Python >= 3.13)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return path


def run_client(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 120,
               check: bool = True) -> subprocess.CompletedProcess:
    """A clients-venv command with a clean environment (no rlcd PYTHONPATH: the venv is Python 3.13)."""
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    base.update({"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost", "HOME": os.environ.get("HOME", "/tmp")})
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env={**base, **(env or {})})
    if check:
        assert out.returncode == 0, (args, out.returncode, out.stdout[-3000:], out.stderr[-3000:])
    return out
