"""JSONL reading/writing, hashing and load_split."""

import hashlib
import json

import pytest

from rlcd.data.io import load_split, read_jsonl, sha256_file, write_jsonl
from rlcd.schema import Record, RecordError

ROW = {"id": "r1", "source": "s", "task": "t", "state": "hi", "question": {"type": "noul", "instructions": "ok?"},
       "target": [0.5, 0.5]}


def test_read_jsonl_yields_errors_instead_of_raising(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{broken\n\xff\xfe\n  \n[2]\n')
    rows = list(read_jsonl(path))
    assert [n for n, _ in rows] == [1, 3, 4, 6]  # 1-based line numbers, blank lines skipped
    assert rows[0][1] == {"a": 1} and rows[3][1] == [2]
    assert isinstance(rows[1][1], json.JSONDecodeError) and isinstance(rows[2][1], UnicodeDecodeError)


def test_write_jsonl_round_trips_models_and_dicts(tmp_path):
    record = Record.model_validate(ROW)
    path = tmp_path / "sub" / "out.jsonl"
    assert write_jsonl(path, [record, {"plain": "dict", "text": "Grüße"}]) == 2
    rows = [obj for _, obj in read_jsonl(path)]
    assert Record.model_validate(rows[0]) == record and rows[1]["text"] == "Grüße"
    assert "Grüße" in path.read_text(encoding="utf-8")  # not ASCII-escaped
    assert [p.name for p in path.parent.iterdir()] == ["out.jsonl"]  # no temporary file left


def test_sha256_file(tmp_path):
    data = b"abc" * 1_000_000
    (tmp_path / "f").write_bytes(data)
    assert sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_load_split(tmp_path):
    write_jsonl(tmp_path / "dev.jsonl", [ROW, {**ROW, "id": "r2"}])
    assert [r.id for r in load_split(tmp_path, "dev")] == ["r1", "r2"]
    with open(tmp_path / "dev.jsonl", "a") as fh:
        fh.write('{"id": "r3"}\n')
    with pytest.raises(RecordError, match="r3"):
        load_split(tmp_path, "dev")
    (tmp_path / "test.jsonl").write_text("nope\n")
    with pytest.raises(RecordError, match="test.jsonl:1"):
        load_split(tmp_path, "test")
