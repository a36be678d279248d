"""Each message a user reads says what it means in words (issue 70 item 10): no Python dict reprs, no bare
"upper", a missing package never first called installed, a refused field never called unknown."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from conftest import user_error


@pytest.mark.parametrize("field, says", [("stream", "never a stream"), ("temperature", "temperature fitted")])
def test_a_refused_stream_or_temperature_says_why_not_unknown_field(field, says):
    from rlcd.serving.errors import PredictError
    from rlcd.serving.limits import Limits
    from rlcd.serving.request import parse_request

    body = {"model": "m", "state": "s", "questions": {"q": {"type": "noul", "instructions": "ok?"}}, field: True}
    with pytest.raises(PredictError) as e:
        parse_request(body, Limits())
    detail = json.dumps(e.value.body() if hasattr(e.value, "body") else str(e.value))
    assert says in str(e.value) and "unknown field" not in str(e.value), (str(e.value), detail)


def test_a_temperature_at_its_bound_is_said_in_words_in_the_report():
    from rlcd.report.metrics_sections import temperatures

    info = {"n": 40, "loss_before": 1.2, "loss_after": 0.9, "iterations": 7, "converged": True,
            "at_bound": "upper", "temperature": 10.0}
    ctx = SimpleNamespace(meta={"calibration": {"choice": info, "noul": {**info, "at_bound": None}}},
                          ev={}, temperatures={"choice": 10.0, "noul": 1.3})
    section = temperatures(ctx)
    table = next(b for b in section.blocks if hasattr(b, "rows"))
    notes = {row[0]: row[-1] for row in table.rows}
    assert notes["choice"] != "upper" and "upper bound T = 10" in notes["choice"] and "higher T" in notes["choice"]
    assert notes["noul"] == ""


def test_derive_says_its_exclusions_in_words_not_a_dict(tmp_path):
    from typer.testing import CliRunner

    from rlcd.cli import app
    from rlcd.data.io import write_jsonl
    from rlcd.data.prepare import prepare

    rows = [{"id": f"c{i}:q", "source": "s", "task": "t", "state": {"x": i}, "case_id": f"c{i}",
             "question": {"type": "choice", "instructions": "Which?", "criteria": ["a", "b", "c"]},
             "target": [1.0, 0.0, 0.0]} for i in range(12)]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    prepare([tmp_path / "rows.jsonl"], tmp_path / "processed", seed=0)
    res = CliRunner().invoke(app, ["data", "derive", str(tmp_path / "processed"), "--out", str(tmp_path / "d"),
                                   "--forms", "removed"])
    assert res.exit_code == 0, res.output
    head = res.stdout.splitlines()[0]
    assert "{" not in head and "'" not in head and "(removed_all_mass " in head, head


def test_a_refused_batch_resume_says_the_input_in_words(tmp_path):
    from rlcd.batch.io import JOB, PartWriter, input_identity, parts_dir
    from rlcd.errors import UserError

    src = tmp_path / "in.jsonl"
    src.write_text("{}\n")
    job = {"input": input_identity(src), "model": "m"}
    parts = parts_dir(tmp_path / "out.jsonl")
    parts.mkdir()
    (parts / JOB).write_text(json.dumps(job))
    src.write_text("{}\n{}\n")  # the input changed since the job began
    with pytest.raises(UserError) as e:
        PartWriter.check(tmp_path / "out.jsonl", {**job, "input": input_identity(src)}, resume=True)
    msg = str(e.value)
    assert "{" not in msg and "': " not in msg, msg
    assert f"input differs from the job's start ({src}, 3 bytes, modified " in msg and ", 6 bytes, modified " in msg


def test_a_missing_gemma_package_is_said_first_never_called_installed(tmp_path, monkeypatch):
    """The first line said "loading preset gemma3-270m from the GGUF file of the installed gemma3-... package",
    the next that the package is not installed."""
    import importlib.util

    from rlcd.model import packaged

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == packaged.GEMMA3_MODULE else real(name, *a))
    from conftest import synth_processed

    synth_processed(tmp_path, 4, seed=1)
    res = user_error(["data", "prepare", tmp_path / "synth.jsonl", "--out", tmp_path / "p", "--model", "gemma3-270m"],
                     contains="which is not installed")
    assert "installed gemma3" not in res.stderr and "of the installed" not in res.stderr, res.stderr
    assert not (tmp_path / "p").exists()
