"""STOP_AT in the real-weights scripts: a session sets the UTC time its long experiment must stop by.

An evening session ends after midnight, so a time of day already past today must mean tomorrow's (a script started at
23:20 with STOP_AT=01:50 used to stop at once), fixed when the script starts; a time that is not one is refused.
"""

import datetime as dt
import subprocess
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parents[1] / "docs/experiments/real-weights/lib-run.sh"


def _left(stop_at: str) -> subprocess.CompletedProcess:
    script = f'STOP_AT="{stop_at}"; source "{LIB}"; stop_at_checked; left'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)


def _hhmm(minutes_from_now: int) -> str:
    return (dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=minutes_from_now)).strftime("%H:%M")


def test_a_time_of_day_still_ahead_today_is_today():
    done = _left(_hhmm(3))
    assert done.returncode == 0, done.stderr
    assert 60 <= int(done.stdout) <= 3 * 60


def test_a_time_of_day_already_past_means_tomorrow():
    done = _left(_hhmm(-3))
    assert done.returncode == 0, done.stderr
    assert 86400 - 4 * 60 <= int(done.stdout) <= 86400 - 2 * 60


@pytest.mark.parametrize("bad", ["25:00", "1650", "tomorrow"])
def test_a_stop_at_that_is_not_a_time_of_day_is_refused_in_one_line(bad):
    done = _left(bad)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"bash: STOP_AT={bad}: not a UTC time of day (e.g. 16:30)"]
