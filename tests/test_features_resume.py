"""Resumable cache extraction (`rlcd.partial`): an extraction that fails after chunk j and runs again publishes the
bytes of an uninterrupted one (feature cache and cut-state cache), computing only the missing chunks; another key
never reads the partial (nor removes it); a finished extraction leaves no partial; a second writer of the same key
waits for the first and says which pid it waits for."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import synth_processed

from rlcd import features, partial
from rlcd.cut_cache import cut_key, ensure_cut_states
from rlcd.features import cache_root, ensure_features, feature_key, key_id
from rlcd.partial import Partial
from rlcd.model.runner import CaseRunner

torch.set_num_threads(1)
TIMING = ("seconds", "created", "attempts")


class Injected(RuntimeError):
    pass


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return synth_processed(tmp_path_factory.mktemp("data"), 16, seed=3)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 2 calls of at most 4 entries: a dozen chunks over the tiny data, several in train."""
    monkeypatch.setattr(features, "ROWS_PER_CALL", 4)
    monkeypatch.setattr(partial, "CHUNK_CALLS", 2)


def _copy(data_dir: Path, to: Path) -> Path:
    shutil.copytree(data_dir, to, ignore=shutil.ignore_patterns("features"))
    return to


def _model(seed=0, k=None):
    from rlcd.model.build import build_model

    return build_model({"model": "tiny-toy", "model_seed": seed, "recipe": {"lora_layers": k}})


@pytest.fixture
def commits(monkeypatch):
    """Counts committed chunks; `commits.fail_after = j` raises Injected right after the j-th commit of a call."""
    real = Partial.commit

    class Counter:
        n = 0
        fail_after: int | None = None

    def commit(self, *a, **kw):
        real(self, *a, **kw)
        Counter.n += 1
        if Counter.fail_after is not None and Counter.n == Counter.fail_after:
            Counter.fail_after = None
            raise Injected(f"injected failure after chunk {Counter.n}")

    monkeypatch.setattr(Partial, "commit", commit)
    return Counter


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith((".partial-", ".tmp-")))


def _same_cache(a: Path, b: Path) -> dict:
    """Every published file of `a` and `b` byte-identical, the manifest except its timing fields; returns b's."""
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        if name != "manifest.json":
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
    assert {k: v for k, v in ma.items() if k not in TIMING} == {k: v for k, v in mb.items() if k not in TIMING}
    return mb


def _resume_equals_uninterrupted(tmp_path, data_dir, commits, ensure, what, partial_name):
    ref_data, data = _copy(data_dir, tmp_path / "ref"), _copy(data_dir, tmp_path / "data")
    ref = ensure(ref_data)
    total = commits.n
    assert total >= 6, f"the test needs several chunks ({total})"
    assert ref.manifest["attempts"] == 1 and _leftovers(cache_root(ref_data)) == [], "no partial once published"

    commits.n, commits.fail_after = 0, 3
    with pytest.raises(Injected):
        ensure(data)
    part = cache_root(data) / partial_name
    state = json.loads((part / "progress.json").read_text())
    kept = sum(c["entries"] for chunks in state["done"].values() for c in chunks.values())
    assert sum(len(c) for c in state["done"].values()) == 3 and kept > 0
    assert not [p for p in cache_root(data).iterdir() if not p.name.startswith(".")], "nothing published"

    commits.n, commits.fail_after = 0, 2  # fails again two chunks later, after resuming
    with pytest.raises(Injected):
        ensure(data)
    state = json.loads((part / "progress.json").read_text())
    assert sum(len(c) for c in state["done"].values()) == 5 and state["attempts"] == 2
    kept = sum(c["entries"] for chunks in state["done"].values() for c in chunks.values())
    said: list[str] = []
    commits.n = 0
    got = ensure(data, said.append)
    assert commits.n == total - 5, "only the missing chunks were computed"
    entries = sum(v if isinstance(v, int) else v["entries"] for v in ref.manifest["splits"].values())
    assert f"{what}: resuming {part}: {kept} of {entries} entries already extracted" in said, said
    manifest = _same_cache(ref.root, got.root)
    assert manifest["attempts"] == 3
    assert _leftovers(cache_root(data)) == [], "the finished extraction removed its partial"
    return got


def test_a_resumed_feature_extraction_publishes_the_uninterrupted_bytes(tmp_path, data_dir, commits):
    m = _model()

    def ensure(data, say=None):
        return ensure_features(m, data, progress=False, say=say)

    kid = key_id(feature_key(m, data_dir))
    got = _resume_equals_uninterrupted(tmp_path, data_dir, commits, ensure, "features", f".partial-{kid}")
    # the chunks of a partial assembled equal the same calls kept in memory (what `rlcd bench features` runs)
    from rlcd.data.io import load_split

    recs = load_split(got.root.parents[1], "train")
    tensors, index = features.extract_split(m, recs, m.collator(image_root=got.root.parents[1]), "train")
    assert tensors.keys() == got.tensors["train"].keys()
    assert all(torch.equal(tensors[k], got.tensors["train"][k]) for k in tensors)
    assert [tuple(e) for e in index] == sorted(got.index["train"], key=got.index["train"].get)


def test_a_resumed_cut_state_extraction_publishes_the_uninterrupted_bytes(tmp_path, data_dir, commits):
    m = _model(k=2)

    def ensure(data, say=None):
        return ensure_cut_states(m, data, progress=False, say=say)

    kid = key_id(cut_key(m, data_dir))
    got = _resume_equals_uninterrupted(tmp_path, data_dir, commits, ensure, "cut states", f".partial-cut-{kid}")
    assert got.manifest["bytes"] == sum(p.stat().st_size for p in got.root.iterdir() if p.name != "manifest.json")
    # the chunks' offsets and segment numbers were shifted right: the last case of train (in the last chunk) reads
    # back the states of a direct forward
    from rlcd.data.io import load_split
    from rlcd.features import cache_entries, entries_by_case

    data = got.root.parents[1]
    entries = cache_entries("train", load_split(data, "train"))
    last = entries_by_case(entries)[-1]
    case = CaseRunner(m).cases.from_records([entries[j][0] for j in last], image_root=data)
    ((prefix, rows),) = CaseRunner(m).cut_states([case], m.cut_layer)
    for j, row in zip(last, rows):
        e = got.entries["train"][(entries[j][0].id, entries[j][1])]
        for seg, want in ((e[3], row), (e[2], prefix)):
            if want is None:
                assert seg == -1
                continue
            states, pos = got._segment("train", seg)
            torch.testing.assert_close(states, want[0].float(), atol=1e-5, rtol=1e-5)
            assert torch.equal(pos, want[1].to(torch.int32))


def test_another_key_never_reads_nor_removes_the_partial(tmp_path, data_dir, commits):
    data, ref_data = _copy(data_dir, tmp_path / "data"), _copy(data_dir, tmp_path / "ref")
    root = cache_root(data)
    commits.fail_after = 2
    with pytest.raises(Injected):
        ensure_features(_model(seed=0), data, progress=False)
    seed0 = root / f".partial-{key_id(feature_key(_model(seed=0), data))}"
    before = {p.name: p.read_bytes() for p in seed0.iterdir() if p.name != "lock"}
    said: list[str] = []
    other = ensure_features(_model(seed=1), data, progress=False, say=said.append)
    assert not [s for s in said if "resuming" in s], said
    assert [s for s in said if "1 partial extraction(s) of other keys kept" in s and seed0.name in s], said
    assert {p.name: p.read_bytes() for p in seed0.iterdir() if p.name != "lock"} == before, "kept untouched"
    _same_cache(ensure_features(_model(seed=1), ref_data, progress=False).root, other.root)
    # a progress file that names another key (under this key's name) is never read either: all is recomputed
    progress = json.loads((seed0 / "progress.json").read_text())
    (seed0 / "progress.json").write_text(json.dumps({**progress, "key": {**progress["key"], "dtype": "float64"}}))
    said, commits.n = [], 0
    again = ensure_features(_model(seed=0), data, progress=False, say=said.append)
    assert not [s for s in said if "resuming" in s], said
    assert commits.n >= 6, "every chunk computed anew"
    _same_cache(ensure_features(_model(seed=0), ref_data, progress=False).root, again.root)
    assert _leftovers(root) == []


def test_a_second_writer_waits_for_the_first_and_names_its_pid(tmp_path, data_dir):
    data = _copy(data_dir, tmp_path / "data")
    m = _model()
    part = cache_root(data) / f".partial-{key_id(feature_key(m, data))}"
    part.mkdir(parents=True)
    fd = os.open(part / "lock", os.O_RDWR | os.O_CREAT)  # another writer: holds the lock, its pid in the file
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"4242\n")
    said: list[str] = []
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(cache=ensure_features(m, data, progress=False, say=said.append)))
    t.start()
    deadline = time.monotonic() + 60
    while not said and time.monotonic() < deadline:
        time.sleep(0.05)
    assert said == [f"features: another extraction (pid 4242) is writing {part}; waiting for it"]
    time.sleep(0.3)
    assert t.is_alive() and not out, "it waits while the lock is held"
    # the first writer publishes and removes its partial (what ensure_features does), then lets go
    first = ensure_features(_model(), _copy(data_dir, tmp_path / "elsewhere"), progress=False)
    shutil.copytree(first.root, cache_root(data) / first.root.name)
    shutil.rmtree(part)
    os.close(fd)
    t.join(60)
    assert not t.is_alive()
    assert out["cache"].root == cache_root(data) / first.root.name
    assert said[-1] == f"features: reusing {out['cache'].root}", said
    assert _leftovers(cache_root(data)) == []
