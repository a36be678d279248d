"""Paired bootstrap compare of run artefacts (eval/predictions-<split>.jsonl)."""

import json
import math

import numpy as np
import pytest

from rlcd.analysis.compare import (
    bootstrap_means,
    compare_runs,
    draw_groups,
    group_codes,
    group_key,
    load_prediction_rows,
    paired_bootstrap,
    resample_indices,
)

# ------------------------------------------------------------------------------------------
# paired_bootstrap on synthetic data


def test_bootstrap_recovers_a_planted_difference():
    rng = np.random.default_rng(7)
    n = 400
    base = rng.normal(1.0, 1.0, n)  # shared per-row difficulty: pairing removes it
    a = base + rng.normal(0, 0.3, n)
    b = base + 0.2 + rng.normal(0, 0.3, n)
    res = paired_bootstrap(a, b, resamples=2000, seed=1)
    assert res["n"] == n and res["resamples"] == 2000
    assert res["mean_diff"] == pytest.approx(float(np.mean(b - a)))  # direction B - A
    assert res["ci_low"] < 0.2 < res["ci_high"]
    assert res["ci_low"] > 0  # excludes 0
    assert res["p_value"] < 0.01
    # the interval is roughly mean +- 1.96 standard errors of the paired differences
    se = np.std(b - a, ddof=1) / math.sqrt(n)
    assert res["ci_high"] - res["ci_low"] == pytest.approx(2 * 1.96 * se, rel=0.15)
    # swapping the sides flips the sign
    flipped = paired_bootstrap(b, a, resamples=2000, seed=1)
    assert flipped["mean_diff"] == pytest.approx(-res["mean_diff"])
    assert flipped["ci_high"] < 0


def test_bootstrap_without_a_difference_gives_a_wide_interval_containing_zero():
    rng = np.random.default_rng(11)
    n = 60
    a = rng.normal(0, 1, n)
    b = rng.normal(0, 1, n)
    b = b - (b - a).mean()  # exactly zero mean difference
    res = paired_bootstrap(a, b, resamples=2000, seed=2)
    assert res["mean_diff"] == pytest.approx(0.0, abs=1e-12)
    assert res["ci_low"] < 0 < res["ci_high"]
    se = np.std(b - a, ddof=1) / math.sqrt(n)
    assert res["ci_high"] - res["ci_low"] > 2 * se  # wide: a couple of standard errors
    assert res["p_value"] > 0.5
    # identical arrays: no difference at all
    same = paired_bootstrap(a, a, resamples=200, seed=0)
    assert same["ci_low"] == same["ci_high"] == 0.0 and same["p_value"] == 1.0


def test_bootstrap_is_seeded():
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=50), rng.normal(size=50)
    assert paired_bootstrap(a, b, resamples=300, seed=5) == paired_bootstrap(a, b, resamples=300, seed=5)
    assert paired_bootstrap(a, b, resamples=300, seed=5) != paired_bootstrap(a, b, resamples=300, seed=6)


def test_grouped_resampling_keeps_groups_whole():
    groups = np.array(["g1", "g1", "g1", "g2", "g3", "g3", "g4", "g4", "g4", "g4", "g5"])
    codes, n_groups = group_codes(groups, groups.size)
    assert n_groups == 5
    members = {g: set(np.flatnonzero(groups == g)) for g in set(groups)}
    rng = np.random.default_rng(0)
    for drawn in draw_groups(rng, n_groups, 50):
        idx = resample_indices(codes, drawn)
        counts = np.bincount(idx, minlength=groups.size)
        draws_per_group = {}
        for g, rows in members.items():
            c = {int(counts[i]) for i in rows}
            assert len(c) == 1, (g, c)  # all members of a group appear equally often (whole groups)
            draws_per_group[g] = c.pop()
        assert sum(draws_per_group.values()) == n_groups  # n_groups groups drawn per resample
        assert idx.size == sum(draws_per_group[g] * len(members[g]) for g in members)
        # every drawn group contributes all its rows, nothing else is drawn
        drawn_groups = {groups[i] for i in idx}
        assert all(members[g] <= set(idx.tolist()) for g in drawn_groups)


def test_bootstrap_means_uses_the_group_resamples():
    """The bootstrap statistic of resample r is the mean over exactly resample_indices(drawn_r)."""
    rng = np.random.default_rng(4)
    groups = np.repeat(np.arange(12), rng.integers(1, 5, 12))
    d = rng.normal(size=groups.size)
    codes, n_groups = group_codes(groups, groups.size)
    expected_rng = np.random.default_rng(9)
    drawn = draw_groups(expected_rng, n_groups, 25)
    expected = [d[resample_indices(codes, row)].mean() for row in drawn]
    np.testing.assert_allclose(bootstrap_means(d, resamples=25, seed=9, groups=groups), expected, rtol=1e-12)


def test_grouped_interval_is_wider_for_clustered_differences():
    rng = np.random.default_rng(5)
    n_groups, size = 40, 10
    groups = np.repeat(np.arange(n_groups), size)
    d = np.repeat(rng.normal(0, 1, n_groups), size) + rng.normal(0, 0.05, n_groups * size)
    a = np.zeros_like(d)
    plain = paired_bootstrap(a, d, resamples=1000, seed=0)
    grouped = paired_bootstrap(a, d, resamples=1000, seed=0, groups=groups)
    assert grouped["n_groups"] == n_groups and plain["n_groups"] == n_groups * size
    # rows of a group are copies: the honest interval is ~sqrt(10) times wider
    ratio = (grouped["ci_high"] - grouped["ci_low"]) / (plain["ci_high"] - plain["ci_low"])
    assert 2.2 < ratio < 4.5


def test_bad_input_raises():
    with pytest.raises(ValueError):
        paired_bootstrap(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError):
        paired_bootstrap(np.array([0.0, np.nan]), np.zeros(2))
    with pytest.raises(ValueError):
        paired_bootstrap(np.zeros(3), np.zeros(3), groups=np.array([1, 2]))


# ------------------------------------------------------------------------------------------
# run directories written by hand


def _row(rid, logits, target, typ="choice", **extra):
    labels = [f"l{i}" for i in range(len(target))] if typ == "choice" else None
    return {"id": rid, "group": "src/en/task", "type": typ, "labels": labels, "target": target,
            "posterior": None, "logits": logits, **extra}


def _write_run(path, rows, temperatures=None, split="test"):
    (path / "eval").mkdir(parents=True)
    with (path / "eval" / f"predictions-{split}.jsonl").open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    if temperatures is not None:
        (path / "eval" / "evaluation.json").write_text(json.dumps({"temperatures": temperatures}))
    return path


def _nll(logits, target, temperature=1.0):
    z = [x / temperature for x in logits]
    m = max(z)
    lse = m + math.log(sum(math.exp(x - m) for x in z))
    return -sum(t * max(x - lse, math.log(1e-12)) for x, t in zip(z, target))


def test_load_prediction_rows_applies_temperatures(tmp_path):
    run = _write_run(tmp_path / "r", [_row("a", [2.0, 0.0], [1.0, 0.0]),
                                      _row("b", [0.0, 1.0], [0.0, 1.0], typ="noul")],
                     temperatures={"choice": 2.0})
    rows = load_prediction_rows(run, "test")
    assert [r["temperature"] for r in rows] == [2.0, 1.0]  # noul has no temperature -> 1
    assert rows[0]["probs"][0] == pytest.approx(math.exp(1) / (math.exp(1) + 1))
    raw = load_prediction_rows(run, "test", raw=True)
    assert raw[0]["probs"][0] == pytest.approx(math.exp(2) / (math.exp(2) + 1))
    with pytest.raises(FileNotFoundError):
        load_prediction_rows(run, "dev")


def test_load_prediction_rows_rejects_duplicates_and_bad_rows(tmp_path):
    run = _write_run(tmp_path / "dup", [_row("a", [0.0, 1.0], [0.5, 0.5]), _row("a", [0.0, 1.0], [0.5, 0.5])])
    with pytest.raises(ValueError, match="duplicate id 'a'"):
        load_prediction_rows(run, "test")
    run = _write_run(tmp_path / "bad", [_row("a", [0.0, 1.0, 2.0], [0.5, 0.5])])
    with pytest.raises(ValueError, match=":1: row 'a' has 3 logits"):
        load_prediction_rows(run, "test")


def test_compare_runs_aligns_by_id_and_reports_dropped_rows(tmp_path):
    # A: ids x1..x4 + onlyA; B: same ids in another order + onlyB1, onlyB2. B is confidently right.
    ta = [1.0, 0.0]
    rows_a = [_row(f"x{i}", [0.0, 0.0], ta) for i in range(1, 5)] + [_row("onlyA", [5.0, 0.0], ta)]
    rows_b = ([_row(f"x{i}", [float(i), 0.0], ta) for i in (4, 2, 3, 1)]
              + [_row("onlyB1", [0.0, 9.0], ta), _row("onlyB2", [0.0, 9.0], ta)])
    run_a = _write_run(tmp_path / "a", rows_a)
    run_b = _write_run(tmp_path / "b", rows_b)
    res = compare_runs([run_a], [run_b], metric="nll", split="test", resamples=500, seed=0, grouped=False)
    assert res["n"] == 4
    assert res["rows"]["compared"] == 4
    assert res["rows"]["dropped_a"] == 1 and res["rows"]["dropped_b"] == 2
    assert res["rows"]["a_rows"] == 5 and res["rows"]["b_rows"] == 6
    exp_a = [_nll([0.0, 0.0], ta)] * 4
    exp_b = [_nll([float(i), 0.0], ta) for i in (1, 2, 3, 4)]  # aligned by id, not by line
    assert res["mean_a"] == pytest.approx(np.mean(exp_a))
    assert res["mean_b"] == pytest.approx(np.mean(exp_b))
    assert res["mean_diff"] == pytest.approx(np.mean(exp_b) - np.mean(exp_a))
    assert res["direction"] == "B - A" and res["mean_diff"] < 0
    json.dumps(res)
    # brier and accuracy use the same alignment
    acc = compare_runs([run_a], [run_b], metric="accuracy", split="test", resamples=200, seed=0, grouped=False)
    # A ties (argmax -> first index 0, which is right); B always right
    assert acc["mean_a"] == 1.0 and acc["mean_b"] == 1.0 and acc["mean_diff"] == 0.0
    br = compare_runs([run_a], [run_b], metric="brier", split="test", resamples=200, seed=0, grouped=False)
    assert br["mean_a"] == pytest.approx(0.5)


def test_compare_runs_pairs_rows_by_id_not_by_file_order(tmp_path):
    """Per-row values differ a lot between rows but B is slightly better on every row: only a
    correct pairing gives a narrow interval excluding 0 (the means alone would not notice)."""
    t = [1.0, 0.0]
    n = 30
    rows_a = [_row(f"r{i}", [0.3 * i - 4.0, 0.0], t) for i in range(n)]
    rows_b = [_row(f"r{i}", [0.3 * i - 4.0 + 0.2, 0.0], t) for i in reversed(range(n))]
    res = compare_runs([_write_run(tmp_path / "a", rows_a)], [_write_run(tmp_path / "b", rows_b)],
                       metric="nll", split="test", resamples=1000, seed=0, grouped=False)
    diffs = [_nll([0.3 * i - 3.8, 0.0], t) - _nll([0.3 * i - 4.0, 0.0], t) for i in range(n)]
    assert all(d < 0 for d in diffs)
    assert res["mean_diff"] == pytest.approx(np.mean(diffs))
    assert min(diffs) - 1e-12 <= res["ci_low"] < res["ci_high"] <= max(diffs) + 1e-12
    assert res["ci_high"] < 0 and res["p_value"] < 0.01


def test_compare_runs_pools_several_runs_per_side(tmp_path):
    t = [0.0, 1.0, 0.0]
    a1 = _write_run(tmp_path / "a1", [_row("q1", [0.0, 1.0, 0.0], t), _row("q2", [0.0, 2.0, 0.0], t),
                                      _row("q3", [0.0, 0.0, 0.0], t)])
    a2 = _write_run(tmp_path / "a2", [_row("q1", [0.0, 3.0, 0.0], t), _row("q2", [1.0, 0.0, 0.0], t)])
    b = _write_run(tmp_path / "b", [_row("q1", [0.0, 0.0, 0.0], t), _row("q2", [0.0, 0.0, 0.0], t),
                                    _row("q3", [0.0, 0.0, 0.0], t)])
    res = compare_runs([a1, a2], [b], metric="nll", split="test", resamples=200, seed=0, grouped=False)
    # q3 is missing from a2: not in every run of side A -> dropped and reported
    assert res["n"] == 2
    assert [r["dropped_not_in_every_run_of_side"] for r in res["rows"]["runs_a"]] == [1, 0]
    assert res["rows"]["dropped_b"] == 1
    pooled_q1 = (_nll([0.0, 1.0, 0.0], t) + _nll([0.0, 3.0, 0.0], t)) / 2
    pooled_q2 = (_nll([0.0, 2.0, 0.0], t) + _nll([1.0, 0.0, 0.0], t)) / 2
    assert res["mean_a"] == pytest.approx((pooled_q1 + pooled_q2) / 2)
    assert res["mean_b"] == pytest.approx(math.log(3))


def test_compare_runs_grouped_uses_case_id_then_id_prefix(tmp_path):
    assert group_key({"id": "case7:q1", "case_id": "c7"}) == "c7"
    assert group_key({"id": "case7:q1", "case_id": None}) == "case7"
    assert group_key({"id": "plain"}) == "plain"
    t = [1.0, 0.0]
    rows = [_row(f"c{c}:q{q}", [0.0, 0.0], t) for c in range(6) for q in range(3)]
    rows_b = [_row(f"c{c}:q{q}", [float(c), 0.0], t) for c in range(6) for q in range(3)]
    ra, rb = _write_run(tmp_path / "a", rows), _write_run(tmp_path / "b", rows_b)
    res = compare_runs([ra], [rb], metric="nll", split="test", resamples=300, seed=0, grouped=True)
    assert res["grouped"] is True and res["n"] == 18 and res["n_groups"] == 6


def test_compare_runs_rejects_different_data_and_empty_overlap(tmp_path):
    ra = _write_run(tmp_path / "a", [_row("q1", [0.0, 0.0], [1.0, 0.0])])
    rb = _write_run(tmp_path / "b", [_row("q1", [0.0, 0.0], [0.0, 1.0])])
    rc = _write_run(tmp_path / "c", [_row("q9", [0.0, 0.0], [1.0, 0.0])])
    with pytest.raises(ValueError, match="different targets"):
        compare_runs([ra], [rb], metric="nll", split="test", resamples=10, seed=0, grouped=False)
    with pytest.raises(ValueError, match="share no row ids"):
        compare_runs([ra], [rc], metric="nll", split="test", resamples=10, seed=0, grouped=False)
    with pytest.raises(ValueError, match="metric"):
        compare_runs([ra], [ra], metric="ece", split="test", resamples=10, seed=0, grouped=False)


def test_compare_command_prints_summary_and_json(tmp_path, capsys):
    from typer.testing import CliRunner

    from rlcd.cli import app

    t = [1.0, 0.0]
    a1 = _write_run(tmp_path / "a1", [_row(f"q{i}", [0.0, 0.0], t) for i in range(5)])
    a2 = _write_run(tmp_path / "a2", [_row(f"q{i}", [0.5, 0.0], t) for i in range(5)])
    b = _write_run(tmp_path / "b", [_row(f"q{i}", [2.0, 0.0], t) for i in range(5)], temperatures={"choice": 2.0})
    out_json = tmp_path / "cmp.json"
    res = CliRunner().invoke(app, ["compare", f"{a1},{a2}", str(b), "--metric", "nll", "--resamples", "100",
                                   "--json-out", str(out_json)])
    assert res.exit_code == 0, res.output
    assert "B - A" in res.stderr and "rows compared: 5" in res.stderr
    assert json.loads(res.stdout)["n"] == 5
    assert json.loads(out_json.read_text())["mean_b"] == pytest.approx(_nll([1.0, 0.0], t))
    assert json.loads(out_json.read_text())["runs_a"] == [str(a1), str(a2)]

    # comma-separated run dirs per side, raw logits
    cli = CliRunner().invoke(app, ["compare", f"{a1},{a2}", str(b), "--metric", "brier", "--resamples", "50",
                                   "--raw"])
    assert cli.exit_code == 0, cli.output
    data = json.loads(cli.stdout[cli.stdout.index("{"):])
    assert data["metric"] == "brier" and data["calibrated"] is False and len(data["runs_a"]) == 2
    bad = CliRunner().invoke(app, ["compare", str(a1), str(tmp_path / "missing")])
    assert bad.exit_code == 2


def test_compare_resamples_cases_by_default_and_rows_with_the_rows_flag(tmp_path):
    """Rows of one case share their difference: the case bootstrap equals a bootstrap of per-case means
    (6 cases, not 18 rows) and its interval is wider; the output says which unit it resampled."""
    from typer.testing import CliRunner

    from rlcd.cli import app

    t = [1.0, 0.0]
    rows_a = [_row(f"c{c}:q{q}", [0.0, 0.0], t, case_id=f"case{c}") for c in range(6) for q in range(3)]
    rows_b = [_row(f"c{c}:q{q}", [float(c) - 2.5, 0.0], t, case_id=f"case{c}") for c in range(6) for q in range(3)]
    ra, rb = _write_run(tmp_path / "a", rows_a), _write_run(tmp_path / "b", rows_b)
    default = compare_runs([ra], [rb], metric="nll", resamples=400, seed=3)
    assert default["grouped"] is True and default["resampling_unit"] == "case" and default["n_groups"] == 6
    by_rows = compare_runs([ra], [rb], metric="nll", resamples=400, seed=3, grouped=False)
    assert by_rows["resampling_unit"] == "row" and by_rows["n_groups"] == 18
    assert default["ci_high"] - default["ci_low"] > by_rows["ci_high"] - by_rows["ci_low"]
    # every case has 3 rows, so a case resample's mean is the mean of the drawn cases' mean differences
    case_d = np.array([_nll([c - 2.5, 0.0], t) - _nll([0.0, 0.0], t) for c in range(6)])
    ref = paired_bootstrap(np.zeros(6), case_d, resamples=400, seed=3, groups=np.arange(6))
    assert (default["ci_low"], default["ci_high"]) == pytest.approx((ref["ci_low"], ref["ci_high"]))

    cli = CliRunner().invoke(app, ["compare", str(ra), str(rb), "--resamples", "100"])
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.stdout)["resampling_unit"] == "case" and "over 6 source cases" in cli.stderr
    cli = CliRunner().invoke(app, ["compare", str(ra), str(rb), "--resamples", "100", "--rows"])
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.stdout)["resampling_unit"] == "row" and "over 18 single rows" in cli.stderr


def test_compare_one_question_type(tmp_path):
    """--type keeps one question type's rows: the means are those rows' means by hand, the other rows are counted
    as other types, and a type with no rows or an unknown type is a one-line error (exit 2)."""
    from typer.testing import CliRunner

    from rlcd.cli import app

    t2 = [1.0, 0.0]
    rows_a = [_row(f"c{i}", [0.0, 0.0], t2) for i in range(4)] + [_row(f"n{i}", [0.0, 1.0], t2, "noul") for i in range(3)]
    rows_b = [_row(f"c{i}", [1.0 + i, 0.0], t2) for i in range(4)] + [_row(f"n{i}", [2.0, 0.0], t2, "noul") for i in range(3)]
    a, b = _write_run(tmp_path / "a", rows_a), _write_run(tmp_path / "b", rows_b)
    res = compare_runs([a], [b], metric="nll", resamples=200, seed=0, grouped=False, qtype="noul")
    assert res["type"] == "noul" and res["n"] == 3
    assert res["rows"]["compared"] == 3 and res["rows"]["other_types"] == 4
    assert res["mean_a"] == pytest.approx(_nll([0.0, 1.0], t2)) and res["mean_b"] == pytest.approx(_nll([2.0, 0.0], t2))
    res = compare_runs([a], [b], metric="nll", resamples=200, seed=0, grouped=False, qtype="choice")
    assert res["mean_b"] == pytest.approx(np.mean([_nll([1.0 + i, 0.0], t2) for i in range(4)]))
    assert compare_runs([a], [b], resamples=50, grouped=False)["type"] is None
    cli = CliRunner().invoke(app, ["compare", str(a), str(b), "--type", "noul", "--resamples", "50"])
    assert cli.exit_code == 0 and "(noul rows)" in cli.stderr and "4 of other types" in cli.stderr
    for bad, msg in (("score", "share no score rows"), ("yesno", "--type must be one of choice, noul, score")):
        out = CliRunner().invoke(app, ["compare", str(a), str(b), "--type", bad])
        assert out.exit_code == 2 and msg in out.stderr, out.stderr


def test_compare_says_what_a_directory_lacks(tmp_path):
    """Issue 58: a remote evaluation's directory without dev predictions was told to run `rlcd evaluate DIR` (it is
    not a run), and a missing directory was told it had no predictions. The remote case names what it holds and
    the `rlcd evaluate --remote` command that scores the split; a missing one says "no such directory"."""
    from conftest import user_error

    t = [1.0, 0.0]
    run = _write_run(tmp_path / "run", [_row(f"c{i}", [0.0, 1.0], t) for i in range(3)], split="dev")
    remote = _write_run(tmp_path / "remote", [_row(f"c{i}", [1.0, 0.0], t) for i in range(3)])
    _write_run(tmp_path / "remote-cal", [_row("k0", [1.0, 0.0], t)], split="calibration")
    (tmp_path / "remote-cal" / "eval" / "predictions-calibration.jsonl").rename(
        remote / "eval" / "predictions-calibration.jsonl")
    (remote / "remote.json").write_text(json.dumps({"format": "rlcd.remote_evaluation/1", "url": "http://h:9",
                                                    "data": "/d/processed", "split": "test"}))
    res = user_error(["compare", run, remote, "--split", "dev"], max_lines=1,
                     contains=f"{remote} is a remote evaluation (remote.json) of 'test' with predictions for "
                              "calibration, test; score dev into a new directory with `rlcd evaluate --remote "
                              "http://h:9 --data /d/processed --split dev --out NEWDIR`")
    assert f"rlcd evaluate {remote}`" not in res.stderr and res.stderr.startswith("rlcd: error: ")
    res = user_error(["compare", run, tmp_path / "gone", "--split", "dev"], max_lines=1,
                     contains=f"{tmp_path / 'gone'}: no such directory")
    assert "no predictions" not in res.stderr
    user_error(["compare", remote, run], max_lines=1, contains=f"(run `rlcd evaluate {run}`)")  # a run: evaluate it
    with pytest.raises(FileNotFoundError, match="no such directory"):  # still a FileNotFoundError for callers
        load_prediction_rows(tmp_path / "gone")


def test_compare_reads_another_eval_directory_with_its_own_temperatures(tmp_path):
    """Wave 7's sealed test set: `rlcd evaluate RUN --data SEALED --out sealed` writes RUN/eval-sealed/, and
    `rlcd compare A B --eval sealed` pairs those predictions (with eval-sealed's temperatures), never eval/'s."""
    from conftest import user_error
    from typer.testing import CliRunner

    from rlcd.cli import app

    t = [1.0, 0.0]
    a = _write_run(tmp_path / "a", [_row(f"q{i}", [0.0, 0.0], t) for i in range(4)])  # eval/: a different set
    b = _write_run(tmp_path / "b", [_row(f"q{i}", [0.0, 0.0], t) for i in range(4)])
    for run, logit, temp in ((a, 1.0, 1.0), (b, 3.0, 2.0)):
        _write_run(tmp_path / "tmp" / run.name, [_row(f"s{i}", [logit, 0.0], t) for i in range(6)],
                   temperatures={"choice": temp})
        (tmp_path / "tmp" / run.name / "eval").rename(run / "eval-sealed")
    res = compare_runs([a], [b], resamples=100, grouped=False, eval_name="sealed")
    assert res["n"] == 6 and res["eval"] == "eval-sealed"
    assert res["mean_a"] == pytest.approx(_nll([1.0, 0.0], t)) and res["mean_b"] == pytest.approx(_nll([3.0, 0.0], t, 2.0))
    assert compare_runs([a], [b], resamples=20, grouped=False)["mean_b"] == pytest.approx(_nll([0.0, 0.0], t))
    cli = CliRunner().invoke(app, ["compare", str(a), str(b), "--eval", "sealed", "--resamples", "50"])
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.stdout)["rows"]["compared"] == 6
    user_error(["compare", a, b, "--eval", "other"], max_lines=1,
               contains=f"(run `rlcd evaluate {a} --data DATA --out other`)")
