"""The top-level `rlcd` command: every stage is reachable and bad invocations say what to do."""

from typer.testing import CliRunner

from rlcd.cli import app

runner = CliRunner()


def test_every_command_is_mounted():
    out = runner.invoke(app, ["--help"]).output
    for cmd in ("data", "train", "calibrate", "evaluate", "report", "demo", "predict", "serve", "compare",
                "sweep", "analyze", "probe", "bench"):
        assert cmd in out, cmd
    bench = runner.invoke(app, ["bench", "--help"]).output
    assert all(c in bench for c in ("prefix", "train", "serve", "report"))
    probe = runner.invoke(app, ["probe", "--help"]).output
    assert "order" in probe and "noise" in probe


def test_new_run_needs_data_and_run():
    res = runner.invoke(app, ["train", "--model", "tiny-toy"])
    assert res.exit_code != 0
    assert "--data and --run" in res.output


def test_resume_of_a_missing_run_is_refused(tmp_path):
    res = runner.invoke(app, ["train", "--resume", str(tmp_path / "nope")])
    assert res.exit_code != 0
    assert "no config.json" in str(res.exception)
