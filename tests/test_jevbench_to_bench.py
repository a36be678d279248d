"""benchmarks/peers/jevbench/to_bench.py: each arm beside its own run's accuracy (JevBench uses no gold answers, so a
score without the accuracy of the model that earned it misleads), JevBench's five dimensions as 0-100 columns, and an
arm whose run has no evaluation here refused, not shown without one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "peers" / "jevbench"))
import to_bench  # noqa: E402

COMMITTED = ROOT / "benchmarks" / "peers" / "jevbench" / "results" / "demo-canonical.json"


def _arm(tmp_path: Path, name: str, accuracy: float | None, pillars: dict) -> Path:
    arm = json.loads(COMMITTED.read_text())
    run = tmp_path / f"run-{name}"
    if accuracy is not None:
        (run / "eval").mkdir(parents=True)
        (run / "eval" / "evaluation.json").write_text(json.dumps(
            {"calibrated": {"overall": {"accuracy": accuracy}}, "headline_split": "test"}))
    arm.update(name=name, run=str(run), pillars=pillars, overall=0.8234, overall_ci95=[0.8, 0.85])
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps(arm))
    return p


def test_each_arm_carries_its_own_runs_accuracy_and_the_dimensions(tmp_path):
    a = _arm(tmp_path, "a", 0.61, {"REP": 0.875, "BAT": 1.0, "MEA": 0.5234, "LOG": None, "CHO": 0.25})
    b = _arm(tmp_path, "b", 0.74, {"REP": 0.5, "BAT": 0.9, "MEA": 0.6, "LOG": 0.1, "CHO": 0.0})
    assert to_bench.main([str(a), str(b), "--name", "jb-test", "--results-dir", str(tmp_path / "out")]) == 0
    rec = json.loads((tmp_path / "out" / "jb-test.json").read_text())["results"]
    cols = rec["table"]["columns"]
    rows = {r[0]: dict(zip(cols, r)) for r in rec["table"]["rows"]}
    ra = next(v for k, v in rows.items() if k.startswith("rlcd a "))
    rb = next(v for k, v in rows.items() if k.startswith("rlcd b "))
    own = "accuracy on rlcd's test split (calibrated)"
    assert (ra[own], rb[own]) == (0.61, 0.74)
    assert ra["JevBench overall"] == pytest.approx(82.3) and ra["MEA"] == pytest.approx(52.3) and ra["LOG"] is None
    assert rb["CHO"] == 0.0 and rb["BAT"] == pytest.approx(90.0)
    assert rows["uniform answer"]["JevBench overall"] == 89.4 and rows["uniform answer"]["MEA"] is None
    assert rec["accuracy_source"]["a"].startswith(str(tmp_path / "run-a"))


def test_an_arm_without_an_evaluation_is_refused_unless_given_one(tmp_path, capsys):
    lost = _arm(tmp_path, "lost", None, {})
    with pytest.raises(SystemExit) as e:
        to_bench.main([str(lost), "--results-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "lost: no evaluation for its run" in err[0]
    assert not (tmp_path / "out").exists(), "nothing written before the inputs are checked"
    ev = tmp_path / "ev.json"
    ev.write_text(json.dumps({"calibrated": {"overall": {"accuracy": 0.5}}}))
    assert to_bench.main([str(lost), "--eval", str(ev), "--results-dir", str(tmp_path / "out")]) == 0
    assert not (ROOT / "benchmarks" / "results" / "jb-test.json").exists()


def test_two_different_accuracies_never_share_a_column(tmp_path):
    """rlcd's arms are scored on rlcd's own test split; the leaderboard's uniform answer (0.398) on JevBench's
    items. One column named "accuracy" held both; now each column says what it measured, and each row fills its own."""
    a = _arm(tmp_path, "a", 0.61, {})
    assert to_bench.main([str(a), "--name", "jb-test", "--results-dir", str(tmp_path / "out")]) == 0
    rec = json.loads((tmp_path / "out" / "jb-test.json").read_text())["results"]
    cols = rec["table"]["columns"]
    assert "accuracy" not in cols
    own, jev = "accuracy on rlcd's test split (calibrated)", "accuracy on JevBench items (leaderboard)"
    rows = {r[0]: dict(zip(cols, r)) for r in rec["table"]["rows"]}
    ra = next(v for k, v in rows.items() if k.startswith("rlcd a "))
    assert (ra[own], ra[jev]) == (0.61, None)
    assert (rows["uniform answer"][own], rows["uniform answer"][jev]) == (None, 0.398)
