"""Splits, isolation, exclusions and the manifest of `prepare`."""

import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from rlcd.data import prepare as prep
from rlcd.data.io import read_jsonl, sha256_file, write_jsonl
from rlcd.data.synth import generate
from rlcd.schema import SPLITS

FIX = Path(__file__).parent / "fixtures" / "data"
PNG_B = FIX / "vqav2_images" / "img_b.png"


def rec(rid, state=None, split=None, case_id=None, image=None, source="unit", instructions="ok?"):
    row = {"id": rid, "source": source, "task": "t", "state": state if state is not None else f"state of {rid}",
           "question": {"type": "noul", "instructions": instructions}, "target": [0.4, 0.6]}
    for key, value in (("split", split), ("case_id", case_id), ("image", image)):
        if value is not None:
            row[key] = value
    return row


def outputs(out_dir):
    """{id: split} over the four split files, and the exclusion lines."""
    where = {}
    for split in SPLITS:
        for _, obj in read_jsonl(out_dir / f"{split}.jsonl"):
            assert obj["split"] == split and obj["id"] not in where
            where[obj["id"]] = split
    excluded = [obj for _, obj in read_jsonl(out_dir / "excluded.jsonl")]
    return where, excluded


def run(tmp_path, rows, seed=0, name="in.jsonl"):
    write_jsonl(tmp_path / name, rows)
    manifest = prep.prepare([tmp_path / name], tmp_path / "out", seed=seed)
    return manifest, *outputs(tmp_path / "out")


def test_a_case_never_spans_splits(tmp_path):
    write_jsonl(tmp_path / "synth.jsonl", generate(160, seed=5))
    prep.prepare([tmp_path / "synth.jsonl"], tmp_path / "out", seed=3)
    where, excluded = outputs(tmp_path / "out")
    assert not excluded
    splits_of_case = defaultdict(set)
    for rid, split in where.items():
        splits_of_case[rid.split(":")[0]].add(split)
    assert all(len(s) == 1 for s in splits_of_case.values())
    assert set(Counter(where.values())) == set(SPLITS)


def test_hash_bands_have_the_documented_sizes():
    u = [prep.hash_unit(0, f"group-{i}") for i in range(20000)]
    shares = Counter(prep.banded_split(x, {"test", "dev", "calibration"}) for x in u)
    for split, share in (("test", 0.10), ("dev", 0.05), ("calibration", 0.05), ("train", 0.80)):
        assert shares[split] / len(u) == pytest.approx(share, abs=0.01)


def test_identical_images_never_span_splits(tmp_path):
    from PIL import Image

    rows = []
    for i in range(40):  # 40 distinct images, each stored twice under different names
        for folder, prefix in (("a", "p"), ("b", "q")):
            (tmp_path / folder).mkdir(exist_ok=True)
            Image.new("RGB", (2, 2), (i, 2 * i, 3 * i)).save(tmp_path / folder / f"{prefix}{i}.png")
            rows.append(rec(f"{prefix}{i}", image=f"{folder}/{prefix}{i}.png", state=f"{prefix} caption {i}"))
    manifest, where, excluded = run(tmp_path, rows)
    assert not excluded
    assert all(where[f"p{i}"] == where[f"q{i}"] for i in range(40))
    assert len(set(where.values())) > 1  # pairs do land in different splits, so the check above has teeth
    images = {k: v for k, v in manifest["outputs"].items() if k.startswith("images/")}
    assert len(images) == 40
    for name, digest in images.items():
        assert name == f"images/{digest}.png" and sha256_file(tmp_path / "out" / name) == digest
    for split in SPLITS:
        for _, obj in read_jsonl(tmp_path / "out" / f"{split}.jsonl"):
            assert obj["image"] in images


def test_test_wins_and_nothing_moves(tmp_path):
    rows = [
        rec("c-train", case_id="c1", split="train"), rec("c-dev", case_id="c1", split="dev"),
        rec("c-test", case_id="c1", split="test"), rec("c-free", case_id="c1"),
        rec("s-train", state="shared text", split="train"), rec("s-cal", state="shared text", split="calibration"),
        rec("i-train", image="img.png", split="train", state=""), rec("i-test", image="img2.png", split="test", state=""),
    ]
    (tmp_path / "img.png").write_bytes(PNG_B.read_bytes())
    (tmp_path / "img2.png").write_bytes(PNG_B.read_bytes())
    _, where, excluded = run(tmp_path, rows)
    assert where == {"c-test": "test", "c-free": "test", "s-cal": "calibration", "i-test": "test"}
    reasons = {e["row"]: e["reason"] for e in excluded}
    assert reasons == {"c-train": "cross_split_group", "c-dev": "cross_split_group",
                       "s-train": "cross_split_group", "i-train": "cross_split_group"}
    detail = next(e["detail"] for e in excluded if e["row"] == "c-dev")
    assert "c-dev" in detail and "test" in detail and "own split dev" in detail


def test_official_train_is_carved_but_never_into_test(tmp_path):
    rows = [rec(f"tr{i}", split="train") for i in range(300)] + [rec(f"te{i}", split="test") for i in range(30)]
    _, where, _ = run(tmp_path, rows)
    from_train = Counter(s for rid, s in where.items() if rid.startswith("tr"))
    assert set(from_train) == {"train", "dev", "calibration"}
    assert {s for rid, s in where.items() if rid.startswith("te")} == {"test"}


def test_a_source_with_its_own_dev_keeps_it(tmp_path):
    rows = [rec(f"tr{i}", split="train") for i in range(300)] + [rec(f"dv{i}", split="dev") for i in range(20)]
    _, where, _ = run(tmp_path, rows)
    assert {s for rid, s in where.items() if rid.startswith("tr")} == {"train", "calibration"}
    assert {s for rid, s in where.items() if rid.startswith("dv")} == {"dev"}


def test_exact_duplicates_and_duplicate_ids(tmp_path):
    rows = [rec("a", state="same"), rec("b", state="same"), rec("c", state="same", instructions="other?"),
            rec("a", state="x")]
    _, where, excluded = run(tmp_path, rows)
    assert set(where) == {"a", "c"}
    assert sorted((e["row"], e["reason"]) for e in excluded) == [("a", "duplicate_id"), ("b", "duplicate")]
    assert "'a'" in next(e["detail"] for e in excluded if e["reason"] == "duplicate")


def test_read_equals_used_plus_excluded_on_a_mixed_file(tmp_path):
    good = [json.dumps(r) for r in (rec("g1"), rec("g2", case_id="k"), rec("g3", case_id="k", split="test"),
                                    rec("g4", case_id="k", split="train"), rec("g5", state="state of g1"))]
    bad = ["{not json", json.dumps(rec("g1")), json.dumps({**rec("b1"), "target": [0.9, 0.9]}), "[1]",
           json.dumps(rec("b2", image="gone.png"))]
    lines = [good[0], bad[0], good[1], "", bad[1], good[2], bad[2], good[3], bad[3], good[4], "   ", bad[4]]
    (tmp_path / "mixed.jsonl").write_text("\n".join(lines) + "\n")
    manifest = prep.prepare([tmp_path / "mixed.jsonl"], tmp_path / "out")
    where, excluded = outputs(tmp_path / "out")
    assert manifest["read"] == 10  # blank lines are not rows
    assert manifest["read"] == manifest["used"] + manifest["excluded"] == len(where) + len(excluded)
    assert manifest["exclusions"] == {"unparsable": 1, "duplicate_id": 1, "invalid": 3, "cross_split_group": 1,
                                      "duplicate": 1}
    assert sum(manifest["splits"].values()) == manifest["used"]
    image_excl = next(e for e in excluded if e["row"] == "b2")
    assert "image" in image_excl["detail"] and "not found" in image_excl["detail"]
    assert next(e for e in excluded if e["reason"] == "unparsable")["row"] == 2


def test_manifest_hashes_counts_and_determinism(tmp_path):
    write_jsonl(tmp_path / "synth.jsonl", generate(40, seed=1))
    manifest = prep.prepare([tmp_path / "synth.jsonl"], tmp_path / "out", seed=7)
    on_disk = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert on_disk == manifest
    assert manifest["inputs"] == [{"path": str(tmp_path / "synth.jsonl"), "sha256": sha256_file(tmp_path / "synth.jsonl")}]
    assert set(manifest["outputs"]) == {f"{s}.jsonl" for s in SPLITS} | {"excluded.jsonl"}
    for name, digest in manifest["outputs"].items():
        assert sha256_file(tmp_path / "out" / name) == digest
    where, _ = outputs(tmp_path / "out")
    per_group = Counter((rid.split(":")[0], s) for rid, s in where.items())
    assert sum(sum(c.values()) for c in manifest["counts"].values()) == sum(per_group.values())
    again = prep.prepare([tmp_path / "synth.jsonl"], tmp_path / "again", seed=7)
    assert again["outputs"] == manifest["outputs"]
    other = prep.prepare([tmp_path / "synth.jsonl"], tmp_path / "other", seed=8)
    assert other["outputs"]["train.jsonl"] != manifest["outputs"]["train.jsonl"]


def test_dry_run_writes_nothing_and_counts_the_same(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [rec("a"), rec("a"), rec("b")])
    dry = prep.prepare([tmp_path / "in.jsonl"], tmp_path / "out", dry_run=True)
    assert not (tmp_path / "out").exists() and dry["outputs"] == {}
    real = prep.prepare([tmp_path / "in.jsonl"], tmp_path / "out")
    assert {k: v for k, v in real.items() if k != "outputs"} == {k: v for k, v in dry.items() if k != "outputs"}


def test_a_lost_row_fails_loudly(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "in.jsonl", [rec("a"), rec("b")])
    real = prep.drop_duplicates

    def leaky(rows, assigned):
        kept, excluded = real(rows, assigned)
        kept.pop(next(iter(kept)))
        return kept, excluded

    monkeypatch.setattr(prep, "drop_duplicates", leaky)
    with pytest.raises(prep.InvariantError, match="read 2"):
        prep.prepare([tmp_path / "in.jsonl"], tmp_path / "out")
    assert not (tmp_path / "out").exists()
