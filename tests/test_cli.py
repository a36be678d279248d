"""The `rlcd` command line: the command table, --help/--version, and the user-error policy.

Policy: a user's mistake prints one or two lines on stderr naming the thing and the fix, exits 2,
and writes nothing; `--strict` data checks exit 1 when rows are excluded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from conftest import user_error
from typer.testing import CliRunner

from rlcd.cli import app

runner = CliRunner()
FIX = Path(__file__).parent / "fixtures" / "data"

TABLE = {
    "data": {"import", "synth", "prepare", "validate", "derive"},
    "train": None, "features": None, "calibrate": None, "evaluate": None, "report": None, "export": None, "ship": None, "gate": None, "predict": None,
    "serve": None, "compare": None, "sweep": None, "sweep-worker": None, "demo": None,
    "analyze": {"toy-bias"},
    "probe": {"order", "coherence", "noise"},
    "bench": {"prefix", "pipeline", "train", "features", "cut", "serve", "onnx", "votes", "batch", "report", "data"},
}
RUNS_A_MODEL = ["train", "features", "calibrate", "evaluate", "predict", "serve", "demo", "probe order", "probe coherence",
                "bench prefix",
                "bench pipeline", "bench train", "bench features", "bench cut", "bench serve", "bench votes"]


def _command(path: str):
    cmd = typer.main.get_command(app)
    for name in path.split():
        cmd = cmd.commands[name]
    return cmd


def test_command_table_is_exactly_the_documented_one():
    root = typer.main.get_command(app)
    assert set(root.commands) == set(TABLE)
    for name, subs in TABLE.items():
        sub = root.commands[name]
        assert (set(sub.commands) if hasattr(sub, "commands") else None) == subs, name


@pytest.mark.parametrize("path", RUNS_A_MODEL)
def test_every_model_command_takes_device_and_dtype(path):
    opts = {o for p in _command(path).params for o in getattr(p, "opts", [])}
    assert {"--device", "--dtype"} <= opts, path


def test_serve_defaults_are_the_limits_defaults():
    from rlcd.cli import serve
    from rlcd.serving.limits import Limits

    lim = Limits()
    assert (serve.MAX_QUESTIONS, serve.MAX_CANDIDATES, serve.MAX_TOKENS, serve.MAX_REQUEST_BYTES,
            serve.MAX_IMAGE_PIXELS) == (lim.max_questions, lim.max_candidates, lim.max_tokens,
                                        lim.max_request_bytes, lim.max_image_pixels)


def test_help_imports_neither_torch_nor_transformers():
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "rlcd.cli", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "train" in out.stdout
    modules = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time")}
    assert "typer" in modules and "rich" in modules  # the check sees imports at all
    assert not {m for m in modules if m.split(".")[0] in ("torch", "transformers", "numpy", "peft")}


def test_help_wraps_sentences_at_the_terminal_not_at_the_source_lines():
    """A docstring's 120-column line breaks do not cut a sentence in `--help`: prose paragraphs are reflowed,
    list items and `\\b` blocks keep their lines."""
    from rlcd.cli import reflow

    out = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "220"})
    assert out.exit_code == 0
    assert any("RUN positional) every update keeps" in ln for ln in out.output.splitlines())
    top = runner.invoke(app, ["--help"], env={"COLUMNS": "220"}).output
    assert any("plus an image question on the tiny VLM" in ln for ln in top.splitlines())
    assert reflow("One\nsentence.\n\nA list:\n- a\n- b") == "One sentence.\n\nA list:\n- a\n- b"
    assert reflow("\bkept\nas is") == "\bkept\nas is" and reflow(None) is None


def _commands(group, path=()):
    """(path, click command) for every visible command of the app."""
    for name, cmd in getattr(group, "commands", {}).items():
        if getattr(cmd, "hidden", False):
            continue
        yield (*path, name), cmd
        yield from _commands(cmd, (*path, name))


def test_help_never_cuts_an_option_name_at_80_columns():
    """`serve --help` at 80 columns showed `--max-request-by…`: rich shrank the option-name column with an
    ellipsis. Every command's help at 80 columns shows each of its option names whole."""
    import re

    import typer.main

    group = typer.main.get_command(app)
    checked = 0
    for path, cmd in _commands(group):
        out = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
        assert out.exit_code == 0, (path, out.output)
        shown = set(re.findall(r"--[A-Za-z0-9][A-Za-z0-9-]*", out.output))
        for param in cmd.params:
            for name in [*param.opts, *param.secondary_opts]:
                if name.startswith("--") and not getattr(param, "hidden", False):
                    assert name in shown, (" ".join(path), name, out.output)
                    checked += 1
    assert checked > 100 and any(p == ("serve",) for p, _ in _commands(group))


def test_version():
    from importlib.metadata import version

    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.stdout.strip() == f"rlcd {version('rlcd')}"


# ---------------------------------------------------------------------------------------- user errors
@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from conftest import synth_processed

    return synth_processed(tmp_path_factory.mktemp("data"), 8, seed=1)


@pytest.fixture(scope="module")
def bare_run(tmp_path_factory):
    """A directory that is a run (config.json) with no checkpoints and no eval/ yet."""
    run = tmp_path_factory.mktemp("bare") / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": "tiny-toy", "recipe": {}, "data_dir": str(run)}))
    return run


def test_train_user_errors_write_nothing(tmp_path, data_dir):
    run = tmp_path / "run"
    cases = [
        (["train", run, "--data", data_dir, "--model", "nosuch"], "unknown backbone 'nosuch'"),
        (["train", run, "--model", "tiny-toy"], "--data"),
        (["train", "--data", data_dir, "--model", "tiny-toy"], "run directory"),
        (["train", run, "--data", tmp_path / "nodata", "--model", "tiny-toy"], "no such directory"),
        (["train", run, "--data", tmp_path, "--model", "tiny-toy"], "not a processed data directory"),
        (["train", run, "--data", data_dir, "--model", "tiny-toy", "--recipe", "lora_rnak=4"], "lora_rnak"),
        (["train", run, "--data", data_dir, "--model", "tiny-toy", "--recipe", "lora_rank=four"], "lora_rank"),
        (["train", run, "--data", data_dir, "--model", "tiny-toy", "--recipe", "sigma=-1"], "sigma"),
        (["train", run, "--data", data_dir, "--model", "tiny-toy", "--sigma", "1", "--recipe", "sigma=2"], "once"),
        (["train", run, "--data", data_dir, "--model", "tiny-toy", "--objective", "rl"], "--objective"),
        (["train", run, "--data", data_dir, "--model", "tiny-toy", "--dtype", "float16"], "--dtype"),
        (["train", run, "--data", data_dir, "--model", "tiny-toy", "--device", "tpu"], "--device"),
        (["train", "--resume", tmp_path / "nope"], "no config.json"),
        (["train", "--resume", tmp_path / "nope", "--sigma", "1"], "--sigma"),
        (["train", "--resume", tmp_path / "nope", "--recipe", "lora_rank=4", "--objective", "ce"], "--objective"),
    ]
    import torch

    if not torch.cuda.is_available():
        cases.append((["train", run, "--data", data_dir, "--model", "tiny-toy", "--device", "cuda"],
                       "no CUDA device"))
    for args, needle in cases:
        user_error(args, contains=needle)
        assert not run.exists(), args


def test_run_commands_name_the_missing_piece(tmp_path, bare_run):
    missing = tmp_path / "nope"
    for cmd in ("evaluate", "calibrate", "predict", "serve", "report", "export"):
        user_error([cmd, missing], contains=str(missing))
        user_error([cmd], contains="RUN")
    user_error(["evaluate", bare_run], contains="checkpoints/best")
    user_error(["calibrate", bare_run], contains="checkpoints/best")
    user_error(["predict", bare_run, "--state", "x"], contains="rlcd evaluate")
    user_error(["serve", bare_run], contains="rlcd evaluate")
    user_error(["report", bare_run], contains="rlcd evaluate")
    user_error(["export", bare_run], contains="rlcd calibrate")
    user_error(["probe", "order", missing])
    user_error(["bench", "serve", missing])
    user_error(["bench", "prefix", "--model", "nosuch"], contains="unknown backbone")
    user_error(["compare", missing, missing])
    user_error(["predict", "a", "--run", "b"], contains="twice")
    assert not list(tmp_path.iterdir())


def test_predict_checks_the_request_before_loading_a_model(tmp_path):
    """No export is needed to refuse a malformed request: the model would load after these checks."""
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.json").write_text("{}")  # loading it would fail loudly, so a pass proves no load
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    user_error(["predict", export, "--request", bad], contains="not valid JSON")
    user_error(["predict", export, "--request", tmp_path / "missing.json"], contains="no such file")
    user_error(["predict", export, bad], contains="not valid JSON")  # the request as REQUEST, after RUN
    user_error(["predict", export, tmp_path / "missing.json"], contains="Invalid value for REQUEST")
    user_error(["predict", export, bad, "--request", tmp_path / "other.json"], contains="given twice")
    q = json.dumps({"type": "choice", "instructions": "x", "criteria": []})
    user_error(["predict", export, "--state", "s", "-q", f"q1={q}"], contains="questions.q1")
    unknown = json.dumps({"type": "maybe", "instructions": "x"})
    user_error(["predict", export, "--state", "s", "-q", f"q1={unknown}"], contains="unknown question type")
    res = runner.invoke(app, ["predict", str(export)], input='{"state": "s", "questions": {}}')
    assert res.exit_code == 2 and "at least one question" in res.stderr


def test_data_commands_strict_and_errors(tmp_path):
    good = tmp_path / "s.jsonl"
    assert runner.invoke(app, ["data", "synth", "--out", str(good), "--cases", "120"]).exit_code == 0
    assert runner.invoke(app, ["data", "validate", str(good)]).exit_code == 0
    assert runner.invoke(app, ["data", "validate", str(good), "--strict"]).exit_code == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good.read_text() + "{broken\n")
    res = runner.invoke(app, ["data", "validate", str(bad)])
    assert res.exit_code == 0 and "unparsable" in res.stdout
    res = runner.invoke(app, ["data", "validate", str(bad), "--strict"])
    assert res.exit_code == 1 and "1 row(s) excluded" in res.stderr  # the verdict is a notice, not the result
    res = runner.invoke(app, ["data", "prepare", str(bad), "--out", str(tmp_path / "p"), "--strict"])
    assert res.exit_code == 1 and (tmp_path / "p" / "manifest.json").is_file()
    user_error(["data", "validate", tmp_path / "missing.jsonl"], contains="no such file")
    user_error(["data", "import", "--kind", "text", "--out", tmp_path / "x.jsonl"], contains="--input")
    user_error(["data", "import", "--kind", "text", "--input", tmp_path / "missing.csv", "--out",
                tmp_path / "x.jsonl"], contains="no such file")


def test_prepare_warns_on_an_empty_split(tmp_path):
    one = tmp_path / "one.jsonl"
    runner.invoke(app, ["data", "synth", "--out", str(one), "--cases", "1"])
    res = runner.invoke(app, ["data", "prepare", str(one), "--out", str(tmp_path / "p")])
    assert res.exit_code == 0 and "split is empty" in res.stderr and "split is empty" not in res.stdout
    res = runner.invoke(app, ["data", "prepare", str(one), "--out", str(tmp_path / "p2"), "--strict"])
    assert res.exit_code == 1 and "empty split" in res.stderr


def test_hub_import_without_datasets_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails, as when the extra is not installed
    user_error(["data", "import", "--kind", "typed-decisions", "--input", "owner/set", "--out",
                tmp_path / "x.jsonl"], contains="pip install 'rlcd[hub]'")
    assert not (tmp_path / "x.jsonl").exists()


def test_install_hints_name_declared_extras():
    """Every `pip install 'rlcd[X]'` the code or README prints names an extra that pyproject.toml declares."""
    import re
    import tomllib

    root = Path(__file__).resolve().parent.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    texts = [p.read_text(encoding="utf-8") for p in (root / "src").rglob("*.py")] + [(root / "README.md").read_text()]
    hints = {m for text in texts for m in re.findall(r"pip install '?rlcd\[(\w+)\]", text)}
    assert {"hub", "tracking"} <= hints
    assert hints <= set(extras)
    packages = {e: {re.split(r"[<>=!~ ;\[]", r)[0].lower() for r in reqs} for e, reqs in extras.items()}
    assert "datasets" in packages["hub"] and "tensorboard" in packages["tracking"]
    # make test installs the tracking extra (requirements.txt pins it), never the hub one: its tests run offline
    pins = {ln.split("==")[0] for ln in (root / "requirements.txt").read_text().splitlines() if "==" in ln}
    assert "tensorboard" in pins and "datasets" not in pins


@pytest.mark.parametrize("error", ["enospc", "safetensors", "other"])
def test_a_full_disk_is_one_line_and_anything_else_keeps_its_traceback(error, monkeypatch, tmp_path):
    import errno

    import rlcd.data.io as io

    class SafetensorError(Exception):
        pass

    raised = {"enospc": OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "raw.jsonl")),
              "safetensors": SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                                             "message: \"No space left on device\" })"),
              "other": OSError(errno.EACCES, "Permission denied")}[error]

    def full(*a, **k):
        raise raised

    monkeypatch.setattr(io, "write_jsonl", full)
    res = CliRunner().invoke(app, ["data", "synth", "--cases", "2", "--out", str(tmp_path / "raw.jsonl")],
                             standalone_mode=True, catch_exceptions=True)
    if error == "other":  # not a full disk: a bug or another failure keeps its traceback
        assert res.exception is raised
        return
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 1 and len(lines) == 1, res.output
    assert lines[0].startswith("rlcd: error: the disk is full (") and "rlcd train --resume RUN" in lines[0]
