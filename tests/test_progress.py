"""rlcd.progress: plain lines off a terminal (done/total, rate, eta), a rich bar on one, silence when off."""

from __future__ import annotations

import io
import re

import pytest

import rlcd.progress as progress_mod
from rlcd.progress import Progress, duration


class Clock:
    """A perf_counter that moves only when the test says so."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(progress_mod.time, "perf_counter", c)
    return c


def test_plain_lines_show_done_total_rate_and_eta(clock):
    out = io.StringIO()
    p = Progress("score test", 40, stream=out, bar=False, lines=4)
    for done in range(4, 41, 4):  # 4 rows every 2 s: 2 rows/s
        clock.t += 2.0
        p.update(done)
    p.close()
    lines = out.getvalue().splitlines()
    # one line per quarter of the total (10, 20, 30, 40 rows), each at the next update reaching it
    assert [int(re.match(r"score test: (\d+)/40 rows", ln).group(1)) for ln in lines] == [12, 20, 32, 40]
    # rate = rows done / seconds since start; eta = rows left / rate
    assert lines[0] == "score test: 12/40 rows (30%), 2.0 rows/s, eta 14s"
    assert lines[-1] == "score test: 40/40 rows (100%), 2.0 rows/s, eta 0s"


def test_a_slow_step_still_prints_every_every_s(clock):
    out = io.StringIO()
    p = Progress("train", 1000, unit="updates", start=100, stream=out, bar=False, lines=10, every_s=30.0)
    clock.t += 31.0
    p.update(101, "loss 1.0")
    clock.t += 5.0
    p.update(102)  # neither 1/10 of the total nor 30 s since the last line
    assert out.getvalue().splitlines() == [
        "train: 101/1000 updates (10%), 31.0 s/update, eta 7h44m, loss 1.0"]  # 1 update in 31 s, 899 left


def test_disabled_prints_nothing(clock):
    out = io.StringIO()
    p = Progress("score dev", 3, stream=out, enabled=False)
    p.update(3)
    p.close()
    assert out.getvalue() == ""


def test_bar_on_a_terminal(clock):
    out = io.StringIO()
    with Progress("train", 10, unit="updates", start=4, stream=out, bar=True) as p:
        clock.t += 1.0
        p.update(6, "loss 1.0")
    text = out.getvalue()
    assert re.search(r"^train .*\s6/10 updates 2\.0 updates/s eta 2s loss 1\.0\s*$", text, re.M), text  # same formulas
    assert "train: 6/10" not in text  # the bar, not a plain line


def test_progress_goes_to_the_current_stderr(capsys):
    p = Progress("score x", 2, bar=False)
    p.update(2)
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.startswith("score x: 2/2 rows (100%)")


def test_speed_below_one_per_second_is_seconds_per_unit():
    assert progress_mod.speed(38.25, "rows") == "38.2 rows/s"
    assert progress_mod.speed(0.25, "updates") == "4.0 s/update"
    assert progress_mod.speed(0.0, "rows") == "0.0 rows/s"


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (42.4, "42s"), (185, "3m05s"), (7620, "2h07m")])
def test_duration(seconds, text):
    assert duration(seconds) == text


def test_the_clock_starts_when_the_model_is_ready(clock):
    """A batch job made its bar, then loaded the model for 80 s, then scored 2 rows/s: the eta said `1m25s` for
    seconds of work left. After `ready()` rate and eta count the scoring only (plain lines and the bar alike)."""
    out = io.StringIO()
    p = Progress("predict", 40, stream=out, bar=False, lines=4)
    clock.t += 80.0  # loading
    p.ready()
    clock.t += 6.0
    p.update(12)
    assert out.getvalue().splitlines() == ["predict: 12/40 rows (30%), 2.0 rows/s, eta 14s"]
    bar_out = io.StringIO()
    with Progress("predict", 40, stream=bar_out, bar=True) as b:
        clock.t += 80.0
        b.ready()
        clock.t += 6.0
        b.update(12)
    assert re.search(r"12/40 rows 2\.0 rows/s eta 14s", bar_out.getvalue()), bar_out.getvalue()


def test_the_batch_job_starts_the_clock_after_loading_the_model(tmp_path):
    from rlcd.batch.io import PartWriter
    from rlcd.batch.local import run_local

    events = []

    class Predictor:
        @property
        def runner(self):
            events.append("model loaded")

    class Bar:
        start = 0

        def ready(self):
            events.append("clock started")

        def update(self, done, info=""):
            events.append("update")

    writer = PartWriter.check(tmp_path / "out.jsonl", {"model": "m"}, resume=False)
    run_local(Predictor(), [], writer, progress=Bar())
    assert events == ["model loaded", "clock started"]
