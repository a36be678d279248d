"""Rows a backbone cannot render are found up front: `rlcd data prepare --model M` excludes them with the reason,
and `rlcd train` refuses a run whose train pool or dev subset holds one before its first update and before its
run directory exists, instead of meeting the row when the sampler first draws it (hours in, and again at every
resume)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import synth_processed, user_error
from typer.testing import CliRunner

from rlcd.cli import app
from rlcd.data.io import read_jsonl, write_jsonl
from rlcd.data.synth import generate
from rlcd.recipe import Recipe
from rlcd.schema import RecordError

torch.set_num_threads(1)
runner = CliRunner()
HUGE_STATE = "the parcel is late. " * 1200  # ~10,900 tokens with the tiny-toy vocabulary, limit 8,192
RECIPE = Recipe(steps=1, eval_every=1, checkpoint_every=1, log_every=1, diagnostics_every=0)


def _huge(like, rid: str = "huge"):
    """A record like `like` (a synth record) whose state renders far past the token limit."""
    return like.model_copy(update={"id": rid, "case_id": rid, "state": HUGE_STATE, "split": None})


def _plant(data: Path, rid: str = "huge") -> None:
    """Add an over-long row to a prepared train split (a new run reads the split directly)."""
    rows = [obj for _, obj in read_jsonl(data / "train.jsonl")]
    rows.append({**rows[0], "id": rid, "case_id": rid, "state": HUGE_STATE})
    write_jsonl(data / "train.jsonl", rows)


class Spy:
    """An objective that counts its calls: any call is an update that ran."""

    def __init__(self):
        self.calls = 0

    def __call__(self, logits, batch, index):
        self.calls += 1
        raise AssertionError("an update ran before the refusal")


def test_train_refuses_an_over_long_training_row_before_any_update(tmp_path):
    data = synth_processed(tmp_path, 12, seed=1)
    _plant(data)
    before = sorted(p.name for p in data.iterdir())
    res = user_error(["train", tmp_path / "run", "--data", data, "--model", "tiny-toy", "--steps", "1"],
                     contains="row 'huge': field 'tokens': row has ")
    (error,) = [ln for ln in res.stderr.splitlines() if ln.startswith("rlcd: error:")]  # beside the backbone's INFO line
    assert "more than max_tokens=8192" in error and "1 too_long" in error and "--model tiny-toy` excludes them" in error
    assert not (tmp_path / "run").exists()
    spy = Spy()
    from rlcd.train import train

    for recipe in (RECIPE, RECIPE.with_(head_only=True)):  # a head-only run: refused before extracting features too
        with pytest.raises(RecordError, match=r"row 'huge'.*\[1 of \d+ training-pool and dev rows break"):
            train(tmp_path / "run", data_dir=data, model="tiny-toy", recipe=recipe, progress=False,
                  print_fn=lambda _: None, objective_fn=spy)
    assert spy.calls == 0
    assert not (tmp_path / "run").exists()
    assert sorted(p.name for p in data.iterdir()) == before  # no features/, nothing else written beside the data


def test_prepare_with_a_model_excludes_the_long_row_with_its_reason_and_train_then_starts(tmp_path):
    records = generate(12, seed=1)
    write_jsonl(tmp_path / "rows.jsonl", [*records, _huge(records[0])])
    res = runner.invoke(app, ["data", "prepare", str(tmp_path / "rows.jsonl"), "--out", str(tmp_path / "plain")])
    assert res.exit_code == 0, res.output
    assert "token limits not checked (--model M" in res.stdout
    plain = [obj["id"] for split in ("train", "dev", "calibration", "test")
             for _, obj in read_jsonl(tmp_path / "plain" / f"{split}.jsonl")]
    assert "huge" in plain  # backbone-free: nothing here knows the tokenizer

    out = tmp_path / "checked"
    res = runner.invoke(app, ["data", "prepare", str(tmp_path / "rows.jsonl"), "--out", str(out), "--model", "tiny-toy"])
    assert res.exit_code == 0, res.output
    (excl,) = [obj for _, obj in read_jsonl(out / "excluded.jsonl")]
    assert excl["row"] == "huge" and excl["reason"] == "too_long" and excl["source_file"].endswith("rows.jsonl")
    assert re.search(r"row has \d{5} tokens .*more than max_tokens=8192", excl["detail"]), excl["detail"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["read"] == len(records) + 1 == manifest["used"] + manifest["excluded"]
    assert manifest["exclusions"] == {"too_long": 1}
    assert manifest["render_check"] == {"model": "tiny-toy", "max_tokens": 8192}
    assert "every kept row rendered with tiny-toy within 8192 tokens" in res.stdout
    # the dry run says the same
    res = runner.invoke(app, ["data", "validate", str(tmp_path / "rows.jsonl"), "--model", "tiny-toy"])
    assert res.exit_code == 0 and "[too_long] row 'huge'" in res.stdout, res.output
    # and the checked directory trains
    from rlcd.train import train

    state = train(tmp_path / "run", data_dir=out, model="tiny-toy", recipe=RECIPE, progress=False,
                  print_fn=lambda _: None)
    assert state["step"] == 1


def test_max_tokens_lowers_the_limit_and_every_mistake_is_one_line(tmp_path):
    records = generate(4, seed=2)
    write_jsonl(tmp_path / "rows.jsonl", records)
    rows = str(tmp_path / "rows.jsonl")
    out = tmp_path / "short"
    res = runner.invoke(app, ["data", "prepare", rows, "--out", str(out), "--model", "tiny-toy", "--max-tokens", "180"])
    assert res.exit_code == 0, res.output
    excluded = [obj for _, obj in read_jsonl(out / "excluded.jsonl")]
    assert excluded and {e["reason"] for e in excluded} == {"too_long"}
    assert all("max_tokens=180" in e["detail"] for e in excluded)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["read"] == len(records) == manifest["used"] + manifest["excluded"]
    assert manifest["render_check"]["max_tokens"] == 180
    for args, says in ((["--max-tokens", "100"], "goes with --model M"),
                       (["--model", "tiny-toy", "--max-tokens", "9000"], "give 1..8192"),
                       (["--model", "no-such-backbone"], "unknown backbone 'no-such-backbone'")):
        user_error(["data", "prepare", rows, "--out", tmp_path / "never", *args], contains=says, max_lines=3)
        assert not (tmp_path / "never").exists()


def test_a_text_only_backbone_excludes_its_special_tokens_and_images_as_unrenderable(tmp_path):
    from PIL import Image

    records = generate(4, seed=3)
    Image.new("RGB", (40, 30), (200, 10, 10)).save(tmp_path / "red.png")
    special = records[0].model_copy(update={"id": "chat", "case_id": "chat", "state": "see <repo_name> here"})
    pictured = records[1].model_copy(update={"id": "pic", "case_id": "pic", "state": "look", "image": "red.png"})
    write_jsonl(tmp_path / "rows.jsonl", [*records, special, pictured])
    out = tmp_path / "out"
    res = runner.invoke(app, ["data", "prepare", str(tmp_path / "rows.jsonl"), "--out", str(out), "--model",
                              "tiny-llama"])
    assert res.exit_code == 0, res.output
    excl = {obj["row"]: obj for _, obj in read_jsonl(out / "excluded.jsonl")}
    assert set(excl) == {"chat", "pic"} and {e["reason"] for e in excl.values()} == {"unrenderable"}
    assert "'<repo_name>'" in excl["chat"]["detail"] and "text-only" in excl["pic"]["detail"]


def test_image_tokens_from_the_size_equal_the_collators(tmp_path):
    from PIL import Image

    from rlcd.model.backbone import make_image_processor
    from rlcd.model.collate import n_image_tokens, process_images
    from rlcd.row_check import image_tokens

    ip = make_image_processor()
    for size in ((40, 30), (333, 97), (640, 480)):
        im = Image.new("RGB", size, (1, 2, 3))
        im.save(tmp_path / "x.png")
        _, grid = process_images(ip, [im])
        assert image_tokens(ip, tmp_path / "x.png") == n_image_tokens(grid[0].tolist(), ip.merge_size)
    (tmp_path / "bad.png").write_bytes(b"not a png")
    with pytest.raises(RecordError, match="cannot read image"):
        image_tokens(ip, tmp_path / "bad.png")


def test_the_clis_default_limit_is_the_encoders():
    from rlcd.cli.data import MAX_TOKENS
    from rlcd.model.prompt import DEFAULT_MAX_TOKENS

    assert MAX_TOKENS == DEFAULT_MAX_TOKENS
