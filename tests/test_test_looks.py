"""DATA/test-looks.jsonl: every scoring of a test split is recorded beside it (run, when, command), once per
evaluation, and a later evaluation says on stderr and in its report how often the split was scored before; a
sweep that ranks on test says it too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import synth_processed
from typer.testing import CliRunner

from rlcd.cli import app
from rlcd.data.looks import LOOKS_FILE, previous_looks, record_look
from rlcd.recipe import Recipe

torch.set_num_threads(1)
runner = CliRunner()


def _looks(data: Path) -> list[dict]:
    path = data / LOOKS_FILE
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.is_file() else []


def test_one_look_per_evaluation_tied_to_the_splits_content(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "test.jsonl").write_text('{"id": "a"}\n')
    first = record_look(data, run=tmp_path / "r1", eval_name="eval", checkpoint_sha256="c1", rows=1, command="evaluate")
    assert first.recorded and first.before == [] and first.note() is None
    again = record_look(data, run=tmp_path / "r1", eval_name="eval", checkpoint_sha256="c1", rows=1, command="evaluate")
    assert not again.recorded and again.before == []  # the same evaluation recomputed: not a second look
    assert again.note() == (f"{data.resolve()}'s test split was already scored by this run's checkpoint at "
                            f"{_looks(data)[0]['when']} (evaluate): the same numbers again, not counted as another look")
    other = record_look(data, run=tmp_path / "r2", eval_name="eval", checkpoint_sha256="c2", rows=1, command="sweep")
    assert other.recorded and len(other.before) == 1
    assert other.note().startswith(f"{data.resolve()}'s test split has been scored 1 time before (latest: "
                                   f"{(tmp_path / 'r1').resolve()} at ")
    assert [x["command"] for x in _looks(data)] == ["evaluate", "sweep"]
    assert set(_looks(data)[0]) == {"run", "eval", "when", "command", "argv", "test_sha256", "checkpoint_sha256", "rows"}
    with open(data / LOOKS_FILE, "a") as f:
        f.write('{"run": "torn', )  # a crashed writer's half line is skipped, the others still count
    assert len(previous_looks(data)) == 2
    (data / "test.jsonl").write_text('{"id": "b"}\n')  # a re-prepared split with other rows starts at 0
    assert previous_looks(data) == []
    fresh = record_look(data, run=tmp_path / "r1", eval_name="eval", checkpoint_sha256="c1", rows=1, command="evaluate")
    assert fresh.recorded and fresh.before == []


def test_an_unwritable_looks_file_is_said_never_fatal(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "test.jsonl").write_text("{}\n")
    (data / LOOKS_FILE).mkdir()  # cannot be opened for appending (as a read-only directory would refuse it)
    looks = record_look(data, run=tmp_path / "r", eval_name="eval", checkpoint_sha256="c", rows=1, command="x")
    assert not looks.recorded and LOOKS_FILE in looks.error and looks.meta()["error"] == looks.error


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("looks")
    data = synth_processed(base, 40, seed=4)
    recipe = Recipe(steps=1, eval_every=1, checkpoint_every=1, log_every=1, diagnostics_every=0)
    from rlcd.train import train

    for name, seed in (("a", 0), ("b", 1)):
        train(base / name, data_dir=data, model="tiny-toy", recipe=recipe.with_(seed=seed), progress=False,
              print_fn=lambda _: None)
    return base, data


def _evaluate(*args):
    res = runner.invoke(app, ["evaluate", *map(str, args), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    return res


def _scored_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if "test split has been scored" in ln]


def test_a_test_split_scored_twice_says_so_on_stderr_and_in_the_report(two_runs):
    base, data = two_runs
    res = _evaluate(base / "a")
    assert _scored_lines(res.stderr) == [] and len(_looks(data)) == 1
    (look,) = _looks(data)
    assert look["run"] == str((base / "a").resolve()) and look["command"] == "evaluate" and look["eval"] == "eval"
    assert look["rows"] == sum(1 for _ in open(data / "test.jsonl"))
    res = _evaluate(base / "a")  # the same evaluation again: still one look, nothing to say
    assert _scored_lines(res.stderr) == [] and len(_looks(data)) == 1

    res = _evaluate(base / "b")
    (line,) = _scored_lines(res.stderr)
    assert line.startswith(f"note: {data.resolve()}'s test split has been scored 1 time before (latest: "
                           f"{(base / 'a').resolve()} at ")
    assert "choose on dev, keep test for the end" in line
    assert len(_looks(data)) == 2
    ev = json.loads((base / "b" / "eval" / "evaluation.json").read_text())
    assert ev["meta"]["test_looks"]["before"] == 1 and ev["meta"]["test_looks"]["recorded"] is True
    report = (base / "b" / "eval" / "report.md").read_text()
    assert "test split had been scored 1 time before this evaluation" in report
    assert "test split had been scored 1 time before this evaluation" in res.stdout  # the summary's note
    # the report regenerates from the files: the same note, and no new look
    res = runner.invoke(app, ["report", str(base / "b")])
    assert res.exit_code == 0, res.output
    assert "scored 1 time before this evaluation" in (base / "b" / "eval" / "report.md").read_text()
    assert len(_looks(data)) == 2

    # evaluate --data on the same split with the same checkpoint: the numbers already seen, not a new look
    res = _evaluate(base / "b", "--data", data, "--out", "again")
    assert len(_scored_lines(res.stderr)) == 1 and len(_looks(data)) == 2
    ev = json.loads((base / "b" / "eval-again" / "evaluation.json").read_text())
    assert ev["meta"]["test_looks"]["before"] == 1 and ev["meta"]["test_looks"]["recorded"] is False


def test_a_sweep_ranking_on_test_says_how_often_it_was_scored(two_runs, tmp_path):
    base, data = two_runs
    from rlcd.analysis.sweep import test_choice_note

    n = len(previous_looks(data))
    assert n >= 1
    note = test_choice_note(data, tmp_path / "sweep")
    assert note.startswith("--choose-on test ranks the arms on the test split: ")
    assert f"has been scored {n} time" in note and "each run of this sweep scores it once more" in note
    assert "was not scored before this sweep" in test_choice_note(data, base)  # its own runs are not counted
    res = runner.invoke(app, ["sweep", "--data", str(data), "--out", str(tmp_path / "sweep"), "--model", "tiny-toy",
                              "--seeds", "1", "--steps", "1", "--choose-on", "test", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert f"note: --choose-on test ranks the arms on the test split: {data.resolve()}'s test split has been scored" \
        in " ".join(res.stderr.split())
