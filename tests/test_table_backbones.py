"""docs/experiments/real-weights/table_backbones.py (issue 56): the paired NLL difference it prints as a gap difference
is one (checked on the committed full-budget head and control), a compare over other rows is not taken for one, and
updates/s is the sum of the throughput windows of the run's last build."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1] / "docs" / "experiments" / "real-weights"
sys.path.insert(0, str(HERE))
import table_backbones as tb  # noqa: E402

FULL = HERE / "full-budget"


@pytest.mark.parametrize("qtype", [None, "choice", "noul", "score"])
def test_nll_difference_is_the_gap_difference_on_the_committed_runs(qtype):
    ev = {k: tb.read_json(FULL / f"{k}.evaluation.json.gz") for k in ("head", "control")}
    c = json.loads((FULL / f"compare-head-vs-control-nll{'' if qtype is None else '-' + qtype}.json").read_text())
    assert tb._covers(ev["head"], qtype, c["mean_a"], c["n"]) and tb._covers(ev["control"], qtype, c["mean_b"], c["n"])
    block = (lambda e: e["calibrated"]["overall"] if qtype is None else e["calibrated"]["per_type"][qtype])
    gaps = [block(ev[k])["nll"] - block(ev[k])["posterior"]["bayes_nll"] for k in ("head", "control")]
    assert c["mean_diff"] == pytest.approx(gaps[1] - gaps[0], abs=1e-12)
    assert tb._gap(ev["control"], qtype) - tb._gap(ev["head"], qtype) == pytest.approx(c["mean_diff"], abs=1e-12)


def test_compare_over_other_rows_is_not_a_gap_difference(tmp_path):
    ev = tb.read_json(FULL / "head.evaluation.json.gz")
    n, nll = ev["calibrated"]["overall"]["n"], ev["calibrated"]["overall"]["nll"]
    assert tb._covers(ev, None, nll, n)
    assert not tb._covers(ev, None, nll, n - 1)  # a compare that dropped a row
    assert not tb._covers(ev, None, nll + 1e-3, n)  # another mean: other temperatures or rows
    for name in ("a-head", "b-head"):
        (tmp_path / f"{name}.evaluation.json.gz").write_bytes(gzip.compress(json.dumps(ev).encode()))
    compare = json.loads((FULL / "compare-head-vs-control-nll.json").read_text())
    (tmp_path / "compare-a-head-vs-b-head-nll.json").write_text(json.dumps({**compare, "n": n - 1, "mean_a": nll,
                                                                           "mean_b": nll}))
    evals = {k: ev for k in ("a-head", "b-head")}
    [got] = tb.load_compares(tmp_path, evals)
    assert got["same_rows"] is False and "gap_a" not in got
    (tmp_path / "compare-a-head-vs-b-head-nll.json").write_text(json.dumps({**compare, "n": n, "mean_a": nll,
                                                                           "mean_b": nll}))
    [got] = tb.load_compares(tmp_path, evals)
    assert got["same_rows"] is True
    assert got["gap_a"] == got["gap_b"] == ev["calibrated"]["overall"]["posterior"]["bayes_gap"]


def test_train_rate_sums_the_last_build_windows():
    old = [{"event": "session", "step": 0, "resume": False}, {"event": "train", "step": 10, "examples": 32,
                                                               "examples_per_s": 1.0}]
    rows = old + [
        {"event": "session", "step": 0, "resume": False},  # a new build in the same file: the old one is ignored
        {"event": "train", "step": 10, "examples": 32, "examples_per_s": 320.0},   # 10 updates in 1 s
        {"event": "eval", "step": 10},
        {"event": "train", "step": 30, "examples": 32, "examples_per_s": 160.0},   # 20 updates in 4 s
        {"event": "session", "step": 30, "resume": True},
        {"event": "train", "step": 40, "examples": 32, "examples_per_s": 64.0},    # 10 updates in 5 s
    ]
    got = tb.train_rate(rows)
    assert got["updates"] == 40 and got["seconds"] == pytest.approx(10.0)
    assert got["updates_per_s"] == pytest.approx(4.0)
    assert tb.train_rate([{"event": "eval", "step": 0}]) is None


def test_a_cache_made_from_cut_states_is_costed_by_a_whole_pass_of_the_same_entries(tmp_path):
    """Features made from cut states ran only the layers above the cut: their seconds are not a backbone's cost. The
    table takes NAME.full-features.json instead, only when it is a whole pass over the same entries, else none."""
    full = json.loads((FULL / "features.json").read_text())
    from_cut = {**full, "extract_seconds": full["extract_seconds"] / 3, "from_cut_states": {"cut": 26, "storage": "float32"}}
    whole = {**full, "from_cut_states": None}
    assert tb.whole_pass(tmp_path, "s", whole) == whole, "a whole pass is its own record"
    assert tb.whole_pass(tmp_path, "s", from_cut) is None, "no whole-pass record: no cost"
    (tmp_path / "s.full-features.json").write_text(json.dumps(full))
    got = tb.whole_pass(tmp_path, "s", from_cut)
    assert got["extract_seconds"] == full["extract_seconds"] and got["source"] == "s.full-features.json"
    (tmp_path / "s.full-features.json").write_text(json.dumps({**full, "row_tokens": full["row_tokens"] + 1}))
    assert tb.whole_pass(tmp_path, "s", from_cut) is None, "another set of rows is not this cache's cost"


def test_a_topk_arm_gets_its_row_and_its_paired_table(tmp_path, monkeypatch, capsys):
    """run-backbone-topk.sh copies NAME-topK.* and compare-NAME-ce-vs-NAME-topK-*: the arm is found by its name, its
    calibrated gap is its evaluation's, and its compare against its init is read as a gap difference (same rows)."""
    for src, dst in (("head", "g-ce"), ("control", "g-top2")):
        (tmp_path / f"{dst}.evaluation.json.gz").write_bytes((FULL / f"{src}.evaluation.json.gz").read_bytes())
        (tmp_path / f"{dst}.config.json").write_text((FULL / f"{src}.config.json").read_text())
    (tmp_path / "g-top2-extra.json").write_text("{}")  # not a config: not an arm
    for m in ("nll", "brier", "accuracy"):
        (tmp_path / f"compare-g-ce-vs-g-top2-{m}.json").write_text((FULL / f"compare-head-vs-control-{m}.json").read_text())
    (tmp_path / "backbones.json").write_text(json.dumps({"ref": "s", "backbones": ["s", "g"]}))
    assert tb.topk_runs(tmp_path) == ["g-top2"]
    monkeypatch.setattr(sys, "argv", ["table_backbones.py", str(tmp_path)])
    tb.main()
    out = capsys.readouterr().out
    gap = tb._gap(tb.read_json(FULL / "control.evaluation.json.gz"), None)
    assert f"| g | top-2 LoRA (CE, from its CE head) | " in out and f"| {gap:.4f} |" in out
    c = json.loads((FULL / "compare-head-vs-control-nll.json").read_text())
    assert f"| g-ce -> g-top2 | all | " in out and f"{c['mean_diff']:+.4f} [{c['ci_low']:+.4f}, {c['ci_high']:+.4f}]" in out
    assert "| s-ce -> g-top2 | all | not run |" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["topk"] == ["g-top2"] and summary["runs"]["g-top2"]["objective"] == "top2"
    [nll] = [x for x in summary["compare"] if x["metric"] == "nll" and x["type"] is None]
    assert (nll["a"], nll["b"], nll["same_rows"]) == ("g-ce", "g-top2", True)
