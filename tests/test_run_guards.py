"""One writer per run (an OS lock, released on exit or crash), frozen data checked before scoring, and
results that say when the run is unfinished, untrained or scored on changed data."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import synth_processed

from rlcd.errors import DataChanged
from rlcd.run import Run, RunBusy

torch.set_num_threads(1)

HOLD = """
import sys, time
from rlcd.run import Run
with Run(sys.argv[1]).lock(sys.argv[2]):
    print("locked", flush=True)
    sys.stdin.readline()
"""


def _fake_run(root: Path) -> Path:
    """A run directory with config.json and samples.json only: enough for the checks that come before loading."""
    data = root / "data"
    data.mkdir(parents=True)
    (data / "test.jsonl").write_text("{}\n")
    run = root / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"data_dir": str(data), "recipe": {"steps": 3}}))
    from rlcd.data.io import sha256_file

    (run / "samples.json").write_text(json.dumps({"files": {"test.jsonl": sha256_file(data / "test.jsonl")}}))
    from rlcd import checkpoint as ckpt

    for which in ("best", "last"):  # present (never loaded: every check here comes first)
        (run / "checkpoints" / which).mkdir(parents=True)
        (run / "checkpoints" / which / ckpt.STATE).write_text(json.dumps({"step": 1}))
        (run / "checkpoints" / which / ckpt.WEIGHTS).write_bytes(b"")
    return run


def _holder(run: Path, what: str = "train") -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run), what], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def _rlcd(*args):
    """The CLI in this process (its user-error handling included): returncode and stderr."""
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from rlcd.cli import app

    res = CliRunner().invoke(app, [str(a) for a in args])
    return SimpleNamespace(returncode=res.exit_code, stderr=res.stderr + ("" if res.exception is None or
                           isinstance(res.exception, SystemExit) else f"Traceback {res.exception!r}"))


def test_a_second_writer_is_refused_while_another_process_holds_the_run(tmp_path):
    run = _fake_run(tmp_path)
    holder = _holder(run, "train")
    try:
        with pytest.raises(RunBusy, match=rf"in use by process {holder.pid} \(train\)"):
            with Run(run).lock("evaluate"):
                pass
        from rlcd.train import train

        with pytest.raises(RunBusy, match=str(holder.pid)):
            train(run, resume=True, progress=False)
        for cmd in (["evaluate", run], ["calibrate", run], ["export", run]):
            res = _rlcd(*cmd)
            assert res.returncode == 2, (cmd, res.stderr)
            assert f"in use by process {holder.pid}" in res.stderr and "Traceback" not in res.stderr
            assert len(res.stderr.strip().splitlines()) <= 2
        assert not (run / "eval").exists() and not (run / "export").exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    with Run(run).lock("evaluate"):  # released on a normal exit
        assert (run / ".lock").read_text().split()[:2] == [str(os.getpid()), "evaluate"]
    assert (run / ".lock").read_text() == ""  # ... and by us: no pid left behind


def test_a_crashed_holder_leaves_no_stale_lock(tmp_path):
    run = _fake_run(tmp_path)
    holder = _holder(run, "train")
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    assert str(holder.pid) in (run / ".lock").read_text()  # the file still names it, but the OS lock is gone
    with Run(run).lock("evaluate"):
        pass


def test_evaluate_on_other_data_is_one_writer_too(tmp_path):
    """`rlcd evaluate RUN --data OTHER` writes RUN/eval-NAME/: a second one beside a first gets RunBusy, one line,
    exit 2, and nothing is written (the lock comes after the inputs are checked, before the model loads)."""
    run = _fake_run(tmp_path)
    (tmp_path / "other").mkdir()
    other = synth_processed(tmp_path / "other", 12, seed=3)
    holder = _holder(run, "evaluate --data")
    try:
        res = _rlcd("evaluate", run, "--data", other, "--out", "second")
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert f"in use by process {holder.pid} (evaluate --data)" in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert not (run / "eval-second").exists() and not (other / "test-looks.jsonl").exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_the_lock_is_reentrant_within_one_process(tmp_path):
    run = _fake_run(tmp_path)
    with Run(run).lock("evaluate"):
        with Run(run).lock("calibrate"):
            pass
        holder = subprocess.run([sys.executable, "-c", HOLD, str(run), "x"], input="\n", capture_output=True,
                                text=True, timeout=60)
        assert holder.returncode != 0 and "RunBusy" in holder.stderr  # still held after the inner exit


def test_evaluate_and_calibrate_refuse_changed_data(tmp_path):
    run = _fake_run(tmp_path)
    (tmp_path / "data" / "test.jsonl").write_text("{}\n{}\n")
    (tmp_path / "data" / "dev.jsonl").write_text("{}\n")
    for cmd in ("evaluate", "calibrate"):
        res = _rlcd(cmd, run)
        assert res.returncode == 2, res.stderr
        assert "data files changed" in res.stderr and "dev.jsonl, test.jsonl" in res.stderr
        assert "--allow-data-change" in res.stderr and "Traceback" not in res.stderr
    assert not (run / "eval").exists()


# ------------------------------------------------------------------ a real, unfinished run


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """A run killed (stop_after) at update 1 of 3."""
    from rlcd.recipe import Recipe
    from rlcd.train import train

    base = tmp_path_factory.mktemp("guards")
    synth_processed(base, 60, seed=9)
    recipe = Recipe(steps=3, eval_every=1, checkpoint_every=1, log_every=1, lr_head=5e-3)
    train(base / "run", data_dir=base / "processed", model="tiny-toy", recipe=recipe, progress=False, stop_after=1)
    return base / "run"


def test_an_unfinished_run_says_so_and_changed_data_is_recorded(stopped, tmp_path):
    from rlcd.evaluate import MIN_CALIBRATION_ROWS, MIN_TEST_ROWS, evaluate_run
    from rlcd.report import format_summary

    data = tmp_path / "data"
    shutil.copytree(Run(stopped).data_dir, data)
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "data_dir": str(data)}))
    test_lines = (data / "test.jsonl").read_text().splitlines(keepends=True)
    (data / "test.jsonl").write_text("".join(test_lines[:-1]))  # the data changed under the run
    with pytest.raises(DataChanged, match="test.jsonl"):
        evaluate_run(run, progress=False)
    assert not (run / "eval").exists()

    said: list[str] = []
    ev = evaluate_run(run, progress=False, allow_data_change=True, print_fn=said.append)
    meta = ev["meta"]
    assert meta["data_changed"] == {"files": ["test.jsonl"], "allowed": True}
    assert json.loads((run / "eval" / "evaluation.json").read_text())["meta"]["data_changed"]["files"] == ["test.jsonl"]
    assert meta["training_progress"] == {"step": 1, "steps": 3}
    summary = format_summary(ev)
    report = (run / "eval" / "report.md").read_text()
    for text in (summary, report):
        assert "the run stopped at update 1 of 3" in text
        assert "data files changed since the run started (test.jsonl)" in text
        assert ("the selected checkpoint is the untrained step 0" in text) == (meta["selected_step"] == 0)
    assert any("data files changed" in s for s in said)
    res = _rlcd("export", run)  # exporting it says so too (stderr; stdout keeps the path)
    assert res.returncode == 0 and "note: the run stopped at update 1 of 3" in res.stderr, res.stderr
    # small data: warnings computed from the prediction files independently
    n_test = len(test_lines) - 1
    assert any("test split has" in s for s in said) == (n_test < MIN_TEST_ROWS)
    cal_types = [json.loads(ln)["type"] for ln in (run / "eval" / "predictions-calibration.jsonl").read_text().splitlines()]
    for t in ("choice", "noul", "score"):
        small = 0 < cal_types.count(t) < MIN_CALIBRATION_ROWS
        assert any(s.startswith(f"warning: {t}: {cal_types.count(t)} calibration rows") for s in said) == small, (t, said)


def test_notes_for_an_untrained_selection():
    from rlcd.report.notes import result_notes

    notes = result_notes({"selected_step": 0, "training_progress": {"step": 3, "steps": 3}})
    assert notes == ["the selected checkpoint is the untrained step 0: no dev evaluation beat the starting model"]
    assert result_notes({"selected_step": 2, "training_progress": {"step": 3, "steps": 3}}) == []
