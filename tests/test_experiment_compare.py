"""lib-compare.sh, the paired compares four real-weights scripts share (backbones, top-K, data scale, bf16 control).

The experiment pages cite its JSON files by name, so the names are a contract: compare-A-vs-B[-EVAL][-SPLIT]-METRIC
[-TYPE].json, one per metric and type. A re-run keeps a compare newer than both evaluations it reads and re-makes one
that an evaluation has since replaced; a compare that fails stops the script and leaves no JSON behind. `rlcd` is
replaced here by a stand-in that records its arguments, so these run in seconds (10 s for the file).
"""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parents[1] / "docs/experiments/real-weights/lib-compare.sh"

FAKE_RLCD = """#!/usr/bin/env python3
import json, sys
args = sys.argv[1:]
if "FAIL" in " ".join(args):
    sys.exit("compare failed")
out = args[args.index("--json-out") + 1]
json.dump(args, open(out, "w"))
"""

TYPES = ["all", "choice", "noul", "score"]


@pytest.fixture
def world(tmp_path):
    fake = tmp_path / "fake-rlcd"
    fake.write_text(FAKE_RLCD)
    fake.chmod(0o755)
    for run in ("A", "B"):
        for ev in ("eval", "eval-sealed"):
            (tmp_path / run / ev).mkdir(parents=True)
            (tmp_path / run / ev / "evaluation.json").write_text("{}")
    for d in ("bb-compare", "compare"):
        (tmp_path / d).mkdir()
    return tmp_path


def _compare(world: Path, *args: str, compares: str = "") -> subprocess.CompletedProcess:
    quoted = " ".join(f'"{a}"' for a in args)
    script = (f'set -euo pipefail; cd "{world}"; OUT="{world}"; METRICS="nll brier"; RLCD=("{world}/fake-rlcd"); '
              f'{"COMPARES=" + compares + "; " if compares else ""}source "{LIB}"; compare {quoted}')
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)


def test_without_evaluation_or_split_it_writes_one_file_per_metric_and_type_under_bb_compare(world):
    done = _compare(world, "ref-ce", "A", "new-top2", "B")
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in (world / "bb-compare").glob("*.json"))
    assert names == sorted(f"compare-ref-ce-vs-new-top2-{m}{'' if t == 'all' else '-' + t}.json"
                           for m in ("nll", "brier") for t in TYPES)
    args = json.loads((world / "bb-compare" / "compare-ref-ce-vs-new-top2-brier-noul.json").read_text())
    assert args[:3] == ["compare", "A", "B"]
    assert "--eval" not in args and "--split" not in args
    assert args[args.index("--metric") + 1] == "brier" and args[args.index("--type") + 1] == "noul"
    overall = json.loads((world / "bb-compare" / "compare-ref-ce-vs-new-top2-nll.json").read_text())
    assert "--type" not in overall


def test_an_evaluation_and_a_split_go_into_the_name_and_the_command(world):
    done = _compare(world, "d1000-top2", "A", "d4000-top2", "B", "sealed", "test", compares=f"{world}/compare")
    assert done.returncode == 0, done.stderr
    args = json.loads((world / "compare" / "compare-d1000-top2-vs-d4000-top2-sealed-test-nll-score.json").read_text())
    assert args[args.index("--eval") + 1] == "sealed" and args[args.index("--split") + 1] == "test"
    assert len(list((world / "compare").glob("*.json"))) == 8
    assert not list((world / "bb-compare").glob("*.json"))


def test_a_split_without_an_evaluation_reads_the_runs_own_evaluation(world):
    done = _compare(world, "d1000-top2-float32", "A", "bfloat16", "B", "", "dev", compares=f"{world}/compare")
    assert done.returncode == 0, done.stderr
    args = json.loads((world / "compare" / "compare-d1000-top2-float32-vs-bfloat16-dev-nll.json").read_text())
    assert "--eval" not in args and args[args.index("--split") + 1] == "dev"


def test_a_rerun_keeps_what_is_newer_than_both_evaluations_and_remakes_what_an_evaluation_replaced(world):
    _compare(world, "a", "A", "b", "B", "sealed", "test", compares=f"{world}/compare")
    _compare(world, "a", "A", "b", "B")
    sealed = world / "compare" / "compare-a-vs-b-sealed-test-nll.json"
    own = world / "bb-compare" / "compare-a-vs-b-nll.json"
    old = time.time() - 100
    for f in (sealed, own):
        os.utime(f, (old, old))
    for ev in ("eval", "eval-sealed"):  # the evaluations are older still: both compares are current
        os.utime(world / "A" / ev / "evaluation.json", (old - 100, old - 100))
        os.utime(world / "B" / ev / "evaluation.json", (old - 100, old - 100))
    _compare(world, "a", "A", "b", "B", "sealed", "test", compares=f"{world}/compare")
    _compare(world, "a", "A", "b", "B")
    assert sealed.stat().st_mtime == pytest.approx(old, abs=1) and own.stat().st_mtime == pytest.approx(old, abs=1)
    (world / "B" / "eval-sealed" / "evaluation.json").write_text("{}")  # B's sealed evaluation is re-made
    _compare(world, "a", "A", "b", "B", "sealed", "test", compares=f"{world}/compare")
    _compare(world, "a", "A", "b", "B")
    assert sealed.stat().st_mtime > old + 50  # re-made: it read eval-sealed
    assert own.stat().st_mtime == pytest.approx(old, abs=1)  # kept: it reads eval, which did not change


def test_a_failing_compare_stops_the_script_and_leaves_no_json(world):
    done = _compare(world, "a", "FAIL", "b", "B", compares=f"{world}/compare")
    assert done.returncode != 0
    assert not list((world / "compare").glob("*.json*"))
    assert "compare failed" in (world / "compare" / "compare.log").read_text()
