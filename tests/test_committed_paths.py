"""Committed artefacts (docs/, benchmarks/results/, models/) name files relative to the repo, never by this machine's
absolute paths (issue 70): the scan, and the rewrite the collect steps run (`rlcd.relpaths`)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_ABSOLUTE = re.compile(r"(?<![\w.~$/-])/(?:work|root|home|tmp|mnt|Users)/[^\s\"'`,;)\]}]*")


def _committed_json():
    import subprocess

    listed = subprocess.run(["git", "ls-files", "docs", "benchmarks/results", "models"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split()
    return [ROOT / f for f in listed if f.endswith((".json", ".jsonl", ".json.gz", ".jsonl.gz"))]


def test_committed_experiment_json_names_no_absolute_machine_path():
    """`"data_dir": "/work/main/runs/rw6/processed"` says nothing on another machine: the JSON committed under docs/
    and benchmarks/results/ names files relative to the repo (runs/..., ~/..., $TMPDIR/...)."""
    import gzip

    files = _committed_json()
    assert len(files) > 100, "the scan sees the committed experiments"
    found = {}
    for f in files:
        raw = f.read_bytes()
        text = (gzip.decompress(raw) if f.suffix == ".gz" else raw).decode("utf-8")
        hits = _ABSOLUTE.findall(text)
        if hits:
            found[str(f.relative_to(ROOT))] = hits[:2]
    assert not found, f"{len(found)} files name absolute paths, e.g. {list(found.items())[:5]}"


def test_relative_paths_follow_the_repo_layout(tmp_path):
    from rlcd.relpaths import relative_path, relative_text, relativize

    root = Path("/work/main")
    assert relative_path("/work/main/runs/rw6/processed", root) == "runs/rw6/processed"
    assert relative_path("/work/wt-c/runs/rw3/processed/features/cut-1", root) == "runs/rw3/processed/features/cut-1"
    assert relative_path("/work/main/docs/x.md", root) == "docs/x.md"
    assert relative_path("/work/peers/smollm2", root) == "../peers/smollm2"
    assert relative_path("/root/.cache/rlcd/gguf", root) == "~/.cache/rlcd/gguf"
    assert relative_path("/tmp/f54/processed", root) == "$TMPDIR/f54/processed"
    text = '{"data_dir": "/work/main/runs/a/processed", "note": "read /tmp/x/y.jsonl, kept", "url": "http://h/work/x"}'
    assert relative_text(text, root) == ('{"data_dir": "runs/a/processed", "note": "read $TMPDIR/x/y.jsonl, kept", '
                                         '"url": "http://h/work/x"}')
    import gzip

    (tmp_path / "a.json").write_text(text)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(text.encode(), mtime=0))
    (tmp_path / "c.json").write_text('{"x": 1}')
    assert sorted(p.name for p in relativize([tmp_path], root)) == ["a.json", "b.jsonl.gz"]
    assert gzip.decompress((tmp_path / "b.jsonl.gz").read_bytes()).decode() == relative_text(text, root)
