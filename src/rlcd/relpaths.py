"""Committed artefacts name files relative to the repo, never by this machine's absolute paths.

A run's own files keep absolute paths (its config.json's ``data_dir`` is how it finds its data again), but a copy
committed under docs/ or benchmarks/results/ (an experiment's config.json, cut-states.json, a summary) is read on
another machine: ``/work/main/runs/rw6/processed`` says nothing there. `relative_text` rewrites every absolute path
in a text the way a reader can follow it:

- a path through a ``runs/`` directory: from ``runs/`` on (``runs/rw6/processed``: where the repo's scripts put it);
- a path under the repo root: relative to it; one beside it (another checkout, a venv): ``../NAME/...``;
- a path under a home directory: ``~/...``; under /tmp: ``$TMPDIR/...`` (a scratch directory, named as one).

`relativize(paths, root)` applies it in place to JSON files (``.json``, ``.jsonl``, and their ``.gz``, recompressed
without a timestamp) -- the text is substituted, not re-dumped, so a file's layout stays as it was. The collect
steps of docs/experiments/real-weights/*.sh run ``python -m rlcd.relpaths DIR`` after copying; tests/test_layout.py
scans docs/ and benchmarks/results/ for what it would rewrite.
"""

from __future__ import annotations

import gzip
import os
import re
import sys
from pathlib import Path

MACHINE_PATH = re.compile(r"(?<![\w.~$/-])/(?:work|root|home|tmp|mnt|Users)/[^\s\"'`,;)\]}]*")
JSON_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")


def relative_path(path: str, root: Path) -> str:
    """One absolute path as the module doc says (`root`: the repo root the path was written under)."""
    parts = Path(path).parts
    if "runs" in parts[1:]:
        return "/".join(parts[parts.index("runs", 1):])
    root = Path(root).resolve()
    p = Path(path)
    if p == root or root in p.parents:
        return os.path.relpath(p, root)
    if len(parts) > 2 and parts[1] in ("root", "home", "Users"):
        home = Path(*parts[:2]) if parts[1] == "root" else Path(*parts[:3])
        return "~/" + os.path.relpath(p, home) if p != home else "~"
    if len(parts) > 1 and parts[1] == "tmp":
        return "$TMPDIR/" + "/".join(parts[2:])
    if root.parent in p.parents:
        return os.path.relpath(p, root)
    return path


def relative_text(text: str, root: Path) -> str:
    """`text` with every machine path (MACHINE_PATH) rewritten by `relative_path`."""
    return MACHINE_PATH.sub(lambda m: relative_path(m.group(0), root), text)


def _json_files(paths: list[Path]):
    for p in paths:
        if p.is_dir():
            yield from sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(JSON_SUFFIXES))
        elif p.name.endswith(JSON_SUFFIXES):
            yield p


def relativize(paths: list[Path], root: Path) -> list[Path]:
    """Rewrite the JSON files in `paths` (files or directories, recursively) in place; returns those changed."""
    changed = []
    for f in _json_files([Path(p) for p in paths]):
        zipped = f.suffix == ".gz"
        raw = f.read_bytes()
        text = (gzip.decompress(raw) if zipped else raw).decode("utf-8")
        new = relative_text(text, root)
        if new == text:
            continue
        data = new.encode("utf-8")
        f.write_bytes(gzip.compress(data, compresslevel=9, mtime=0) if zipped else data)
        changed.append(f)
    return changed


def main(argv: list[str] | None = None) -> int:
    """``python -m rlcd.relpaths [--root DIR] PATH...`` (root: the current directory, the repo root)."""
    args = list(sys.argv[1:] if argv is None else argv)
    root = Path.cwd()
    if args[:1] == ["--root"]:
        root, args = Path(args[1]), args[2:]
    for f in relativize([Path(a) for a in args], root):
        print(f"relative paths: {f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

__all__ = ["MACHINE_PATH", "relative_path", "relative_text", "relativize"]
