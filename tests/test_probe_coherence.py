"""`rlcd probe coherence`: the deviation and violation counter on hand cases, known scorers (the exact posterior:
no violation, no gap; a uniform answer: deviations from a hand formula), and the command end to end on a tiny
random-weight run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rlcd.analysis.coherence import deviation, probe_coherence_scores, violation_counts
from rlcd.data.io import write_jsonl
from rlcd.data.synth import generate
from conftest import user_error

torch.set_num_threads(1)


def test_deviation_on_hand_cases():
    neg = {"cells": [[1], [0]]}
    assert deviation(neg, [0.3, 0.7], [0.7, 0.3]) == pytest.approx(0.0, abs=1e-15)
    assert deviation(neg, [0.3, 0.7], [0.6, 0.4]) == pytest.approx(0.1, abs=1e-15)
    merged = {"cells": [[0, 2], [1]]}  # options 0 and 2 merged
    assert deviation(merged, [0.2, 0.5, 0.3], [0.4, 0.6]) == pytest.approx(0.1, abs=1e-15)
    removed = {"cells": [[1], [2]], "renormalise": True}  # option 0 removed: (0.5, 0.3) / 0.8
    assert deviation(removed, [0.2, 0.5, 0.3], [0.625, 0.375]) == pytest.approx(0.0, abs=1e-15)
    assert deviation(removed, [0.2, 0.5, 0.3], [0.5, 0.5]) == pytest.approx(0.125, abs=1e-15)
    added = {"cells": [[0], [], [1]]}  # an unrelated option in the middle: mass 0
    assert deviation(added, [0.4, 0.6], [0.3, 0.1, 0.6]) == pytest.approx(0.1, abs=1e-15)
    with pytest.raises(ValueError, match="candidates"):
        deviation(neg, [0.3, 0.7], [0.2, 0.3, 0.5])


def test_violation_counter_on_hand_cases():
    assert violation_counts([0.0, 0.05, 0.0500001, 0.2, 0.049]) == (2, 5)  # strictly above the tolerance
    assert violation_counts([0.0, 0.05, 0.2], tol=0.01) == (2, 3)
    assert violation_counts([]) == (0, 0)


@pytest.fixture(scope="module")
def records():
    return generate(12, seed=4)


def test_the_exact_posterior_is_coherent_and_has_no_gap(records):
    with np.errstate(divide="ignore"):
        oracle = lambda rows: [np.log(np.asarray(r.posterior)).tolist() for r in rows]  # noqa: E731
        res = probe_coherence_scores(oracle, records, resamples=50)
    assert res["n_base"] == len(records) and res["n_derived"] > 10 * len(records) // 2
    assert res["overall"]["violations"] == 0 and res["overall"]["mean_deviation"] < 1e-12
    assert res["overall"]["mean_gap"] < 1e-12 and res["base_mean_gap"] < 1e-12
    assert set(res["per_family"]) == {"equivalence", "complement", "merge", "marginal", "submenu", "order"}
    for b in res["per_family"].values():
        assert b["violation_rate"] == 0.0 and b["violation_rate95"] == [0.0, 0.0]


def test_a_uniform_answer_deviates_as_the_hand_formula_says(records):
    uniform = lambda rows: [[0.0] * r.question.k for r in rows]  # noqa: E731
    res = probe_coherence_scores(uniform, records, forms=["is_option", "negated", "tail"], resamples=200, seed=3)
    by_id = {r.id: r for r in records}
    n_viol = 0
    for row in res["rows"]:
        k = by_id[row["base"]].question.k
        if row["form"] == "is_option":
            want = abs(0.5 - 1.0 / k)  # implied P(true) = 1/K, asked 0.5
        elif row["form"] == "negated":
            want = 0.0  # the complement of 1/2 is 1/2
        else:  # tail "level l or higher?": implied (K - l) / K under a uniform base answer
            want = abs(0.5 - (k - _level(records, row)) / k)
        assert row["deviation"] == pytest.approx(want, abs=1e-12)
        n_viol += row["deviation"] > 0.05
    assert res["overall"]["violations"] == n_viol
    assert res["per_family"]["complement"]["violation_rate"] == 0.0
    fam = res["per_family"]["marginal"]
    lo, hi = fam["violation_rate95"]
    assert lo <= fam["violation_rate"] <= hi and fam["n_cases"] == 12


def _level(records, row):
    from rlcd.data.derive import derive_records

    rows, _ = derive_records([r for r in records if r.id == row["base"]], ["tail"])
    return next(r.derived["level"] for r in rows if r.id == row["id"])


def test_probe_coherence_cli_on_tiny_run_and_the_report(tmp_path):
    from _tiny_export import make_tiny_export

    from rlcd.cli import app

    run = make_tiny_export(tmp_path / "run")
    data = tmp_path / "data"
    write_jsonl(data / "test.jsonl", generate(2, seed=5))
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "data_dir": str(data)}))
    out = tmp_path / "coh.json"
    result = CliRunner().invoke(app, ["probe", "coherence", str(run), "--resamples", "100", "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    assert "coherence probe" in result.output and "sub-menu" in result.output
    res = json.loads(out.read_text())
    saved = run / "eval" / "probe-coherence.json"
    assert res["format"] == "rlcd.probe_coherence/1" and res["saved"] == str(saved)
    assert res["requests"] == "as_asked" and "asked as written" in result.output  # said beside served numbers
    assert json.loads(saved.read_text()) == res
    assert res["n_base"] == 12 and res["overall"]["n_cases"] == 2
    for row in res["rows"]:  # every deviation recomputed from the two answers
        assert row["deviation"] == pytest.approx(float(np.max(np.abs(np.subtract(row["answer"], row["implied"])))),
                                                 abs=1e-12)
    for fam, b in res["per_family"].items():
        lo, hi = b["violation_rate95"]
        assert lo - 1e-12 <= b["violation_rate"] <= hi + 1e-12, fam
        assert b["violations"] == sum(r["deviation"] > 0.05 for r in res["rows"] if r["family"] == fam)
    # a derived data dir: both probes ask the original rows only (its derived rows are set aside, re-derived alike)
    from rlcd.data.derive import derive_dir, parse_forms

    derive_dir(data, tmp_path / "derived", parse_forms(None))
    out2 = tmp_path / "coh2.json"
    result = CliRunner().invoke(app, ["probe", "coherence", str(run), "--data", str(tmp_path / "derived"),
                                      "--resamples", "100", "--json-out", str(out2)])
    assert result.exit_code == 0, result.output
    res2 = json.loads(out2.read_text())
    assert [r["id"] for r in res2["rows"]] == [r["id"] for r in res["rows"]]
    assert res2["saved"] == str(saved)  # the same original test rows as the run's own: its result
    np.testing.assert_allclose([r["deviation"] for r in res2["rows"]], [r["deviation"] for r in res["rows"]],
                               atol=1e-5)
    order = tmp_path / "order.json"
    result = CliRunner().invoke(app, ["probe", "order", str(run), "--data", str(tmp_path / "derived"), "--limit", "1",
                                      "--max-perms", "2", "--resamples", "50", "--json-out", str(order)])
    assert result.exit_code == 0, result.output
    assert json.loads(order.read_text())["n_records"] == 3  # one original question per type, no derived row
    # the report's section reads the file as written
    from rlcd.report import build
    from rlcd.report.coherence_sections import coherence
    from rlcd.report.context import Context
    from rlcd.report.document import to_markdown
    from rlcd.run import Run

    assert build.SECTIONS.index(coherence) == build.SECTIONS.index(build.order_sections.fragile) + 1
    ctx = Context(run=Run(run), preds={}, ev={"meta": {}}, notes=[], stored=None, figures=None)
    text = to_markdown("r", [coherence(ctx)])
    assert "sub-menu" in text and "violation rate" in text
    fam = res["per_family"]["submenu"]
    assert f"{fam['violation_rate']:.3f}" in text
    saved.unlink()
    assert "rlcd probe coherence" in to_markdown("r", [coherence(ctx)])
    user_error(["probe", "coherence", run, "--forms", "nope"], contains="--forms nope")
    user_error(["probe", "coherence", run, "--tol", "2"], contains="--tol")
    user_error(["probe", "coherence", run, "--data", tmp_path / "none"], contains="test.jsonl does not exist")
    user_error(["probe", "coherence", tmp_path / "no-run"], contains="no such run directory")
    user_error(["probe", "coherence", run, "--limit", "0"], contains="--limit 0")
    user_error(["probe", "coherence", run, "--resamples", "0"], contains="--resamples 0")


def test_report_shows_coherence_after_the_order_probe(tmp_path, records):
    from test_report import make_run

    from rlcd.analysis.probes import write_json_atomic
    from rlcd.report import write_report

    run, *_ = make_run(tmp_path)
    text = write_report(run).read_text()
    assert "## Coherence of derived forms" in text and "`rlcd probe coherence" in text
    assert text.index("## Order-fragile questions") < text.index("## Coherence of derived forms")
    uniform = lambda rows: [[0.0] * r.question.k for r in rows]  # noqa: E731
    res = probe_coherence_scores(uniform, records, resamples=100)
    write_json_atomic(run / "eval" / "probe-coherence.json", res)
    text = write_report(run).read_text()
    section = text[text.index("## Coherence of derived forms"):]
    section = section[:section.index("\n## ", 5)]
    b = res["per_family"]["marginal"]
    lo, hi = b["violation_rate95"]
    assert f"| marginal and tail | {b['n_rows']} | {b['n_cases']} | {b['violation_rate']:.3f} [{lo:.3f}, {hi:.3f}]" \
        in section
    assert "Coherence of derived forms" in (run / "eval" / "report.html").read_text()
    write_json_atomic(run / "eval" / "probe-coherence.json", {**res, "checkpoint_sha256": "00" * 32})
    assert "scored other weights than this evaluation" in write_report(run).read_text()
    write_json_atomic(run / "eval" / "probe-coherence.json", {"format": "other"})
    assert "is not a `rlcd.probe_coherence/1` result" in write_report(run).read_text()
