"""`rlcd gate` / `rlcd.gate`: thresholds.json in jev-eval's contract, against independent computations.

Prediction rows are generated (no model): three questions per case, logits drawn per row, targets one-hot, half of
them on the argmax so that accuracy grows with confidence. Every number is recomputed here the slow way (loops over
candidate thresholds, explicit resamples with duplicated rows) and compared; jev-eval's own reader and `check` load
the file; the CLI refuses mistakes in one line before writing anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import user_error

from rlcd import gate as G
from rlcd.bootstrap import draw_groups, group_codes
from rlcd.metrics import row_probabilities

TEMPS = {"choice": 1.3, "noul": 0.8, "score": 1.1}
QUESTIONS = (("team", "choice", 3), ("urgent", "noul", 2), ("level", "score", 4))


def make_rows(n_cases: int, seed: int, prefix: str = "c") -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for c in range(n_cases):
        for name, qtype, k in QUESTIONS:
            logits = rng.normal(size=k) * 2.0
            gold = int(np.argmax(logits)) if rng.random() < 0.55 else int(rng.integers(k))
            target = [0.0] * k
            target[gold] = 1.0
            labels = ["false", "true"] if qtype == "noul" else [f"o{i}" for i in range(k)] if qtype == "choice" \
                else [str(i) for i in range(k)]
            rows.append({"id": f"{prefix}{c}:{name}", "case_id": f"{prefix}{c}", "group": "synth/en/t", "type": qtype,
                         "labels": labels, "target": target, "posterior": None, "logits": logits.tolist(),
                         "instructions": f"{name}?"})
    return rows


CAL, TEST = make_rows(120, 0), make_rows(80, 1, prefix="t")


# ------------------------------------------------------------------------------------- per answer
def test_gate_confidence_is_what_serve_answers():
    """The gate's confidence equals the served answer's (rlcd.serving.answer, torch float64) and noul's band."""
    from rlcd.schema import Question
    from rlcd.serving.answer import make_answer

    for row in CAL[:30]:
        p = row_probabilities(row, TEMPS)
        q = Question(type=row["type"], criteria=None if row["type"] == "noul" else
                     (row["labels"] if row["type"] == "choice" else [f"l{i}" for i in range(len(p))]))
        a = make_answer(q, row["logits"], TEMPS[row["type"]])
        want = abs(a["noul"] - 0.5) * 2 if row["type"] == "noul" else a["confidence"]
        assert G.gate_confidence(row["type"], p) == pytest.approx(want, abs=1e-12)


def test_correctness_follows_jev_eval():
    p = np.array([0.1, 0.5, 0.4])
    assert G.is_correct("choice", p, [0, 1, 0]) and not G.is_correct("choice", p, [1, 0, 0])
    assert G.is_correct("noul", np.array([0.4, 0.6]), [0, 1]) and G.is_correct("noul", np.array([0.5, 0.5]), [0, 1])
    # score: the level nearest the expected score (1.3 -> 1), not the argmax (1 here too); 2.5 rounds to 2 (Python)
    assert G.is_correct("score", p, [0, 1, 0])
    p2 = np.array([0.0, 0.0, 0.5, 0.5])
    assert G.is_correct("score", p2, [0, 0, 1, 0]) and not G.is_correct("score", p2, [0, 0, 0, 1])
    assert G.is_correct("score", p2, [0, 0, 0, 1], tolerance=1)


# ------------------------------------------------------------------------------------- picking and the guard
def _slow_pick(conf, correct, goal: G.Goal):
    """Brute force: every distinct confidence, highest first, by direct masks."""
    points = []
    for t in sorted(set(conf), reverse=True):
        covered = [c for c, x in zip(correct, conf) if x >= t]
        points.append((t, len(covered) / len(conf), sum(covered) / len(covered)))
    if goal.target_accuracy is not None:
        hits = [p for p in points if p[2] >= goal.target_accuracy]
        return max(hits, key=lambda p: p[1])[0] if hits else None
    return next((p[0] for p in points if p[1] >= 1 - goal.max_escalation - 1e-12), None)


def _qrows(rows, name):
    items = [i for i in G.items_of(rows, TEMPS) if i.question == name]
    return G.Rows.of([i.confidence for i in items], [i.correct for i in items], [i.case for i in items])


@pytest.mark.parametrize("goal", [G.Goal(target_accuracy=0.6), G.Goal(target_accuracy=0.75), G.Goal(max_escalation=0.3),
                                  G.Goal(max_escalation=0.0)])
def test_the_pick_on_all_rows_is_the_brute_force_one(goal):
    for name, _, _ in QUESTIONS:
        rows = _qrows(CAL, name)
        rec = G.recommend(rows, goal, resamples=20)
        want = _slow_pick(list(rows.confidence), list(rows.correct), goal)
        assert rec.get("threshold") == want, (name, goal, rec)


def test_out_of_bag_numbers_equal_an_explicit_resampling():
    """Same draws (rlcd.bootstrap, default_rng(seed)), done row by row: duplicate in-bag rows, pick by brute force,
    score on the rows of the cases not drawn."""
    rows, goal, resamples, seed = _qrows(CAL, "team"), G.Goal(target_accuracy=0.6), 40, 3
    rec = G.recommend(rows, goal, resamples=resamples, seed=seed)
    codes, n_groups = group_codes(rows.cases, rows.n)
    drawn = draw_groups(np.random.default_rng(seed), n_groups, resamples)
    picks, accs, covs = [], [], []
    for r in range(resamples):
        bag = [i for g in drawn[r] for i in np.flatnonzero(codes == g)]
        t = _slow_pick([rows.confidence[i] for i in bag], [rows.correct[i] for i in bag], goal)
        if t is None:
            continue
        picks.append(t)
        oob = [i for i in range(rows.n) if codes[i] not in set(drawn[r])]
        cov = [i for i in oob if rows.confidence[i] >= t]
        if oob and cov:
            accs.append(sum(rows.correct[i] for i in cov) / len(cov))
            covs.append(len(cov) / len(oob))
    assert rec["accuracy"] == pytest.approx(float(np.mean(accs)), abs=1e-12)
    assert rec["coverage"] == pytest.approx(float(np.mean(covs)), abs=1e-12)
    ordered = sorted(accs)
    assert rec["accuracy95"] == [ordered[round(0.025 * (len(accs) - 1))], ordered[round(0.975 * (len(accs) - 1))]]
    assert rec["misses"] == resamples - len(picks) and rec["status"] == "warn"  # 120 rows < 200: provisional


def test_held_out_is_the_gate_applied_to_test():
    rows = _qrows(TEST, "team")
    got = G.held_out(rows, 0.3, resamples=30, seed=1)
    covered = rows.confidence >= 0.3
    assert got["accuracy"] == pytest.approx(rows.correct[covered].mean()) and got["coverage"] == covered.mean()
    assert got["covered"] == int(covered.sum()) and got["n"] == rows.n
    lo, hi = got["accuracy95"]
    assert lo <= got["accuracy"] <= hi and got["coverage95"][0] <= got["coverage"] <= got["coverage95"][1]


def test_min_rows_unreachable_and_the_yes_cut():
    rows = _qrows(CAL, "team")
    assert G.recommend(rows, G.Goal(target_accuracy=0.6), min_rows=rows.n + 1)["status"] == "refused"
    wrong = G.Rows.of(rows.confidence, [False] * rows.n, rows.cases)
    assert G.recommend(wrong, G.Goal(target_accuracy=0.5), resamples=5)["status"] == "unreachable"
    doc = G.thresholds_document(CAL, TEST, TEMPS, G.Goal(target_accuracy=0.6), model="m", resamples=50)
    items = [i for i in G.items_of(CAL, TEMPS) if i.question == "urgent"]
    for cut in doc.get("yesAt", {}).get("urgent", []):
        want = _slow_pick([i.p_yes for i in items], [i.gold_yes for i in items], G.Goal(target_accuracy=cut["target"]))
        assert cut["threshold"] == round(want, 4)
        base = np.mean([i.gold_yes for i in items])
        assert cut["recall"] == pytest.approx(round(cut["precision"] * cut["flagged"] / base, 4), abs=2e-4)


# ------------------------------------------------------------------------------------- the document
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run directory with calibration/test predictions and temperatures (what `rlcd evaluate` leaves)."""
    from rlcd.data.io import write_jsonl

    run = tmp_path_factory.mktemp("gate") / "run"
    (run / "eval").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": "tiny-toy", "recipe": {}}))
    write_jsonl(run / "eval" / "predictions-calibration.jsonl", CAL)
    write_jsonl(run / "eval" / "predictions-test.jsonl", TEST)
    (run / "eval" / "temperatures.json").write_text(json.dumps({"temperatures": TEMPS}))
    return run


def test_the_document_is_jev_evals_contract(run_dir):
    path, doc = G.gate_run(run_dir, G.Goal(max_escalation=0.5), resamples=100)  # reachable by every gate
    assert path == run_dir / "eval" / "thresholds.json" and json.loads(path.read_text()) == doc
    assert doc["version"] == 1 and doc["model"] == "run" and doc["guard"] == {"method": "bootstrap", "resamples": 100,
                                                                               "seed": 0}
    assert set(doc["definitions"]) == {"team", "urgent", "level"} and doc["definitions"]["team"]["type"] == "choice"
    for qid, entry in doc["questions"].items():
        assert set(entry) == {"type", "threshold", "accuracy", "coverage", "n"} and entry["n"] == 120
    assert doc["composite"]["questions"] == ["level", "team"] and doc["composite"]["n"] == 120
    assert set(doc["x_rlcd"]["types"]) <= {"choice", "noul", "score"}
    gates = {g["name"]: g for g in doc["x_rlcd"]["gates"]}
    assert all(G.usable(g) for g in gates.values()), [g for g in gates.values() if not G.usable(g)]
    assert gates["choice"]["test"]["n"] == gates["team"]["test"]["n"] == gates["_row"]["test"]["n"] == 80
    assert gates["row"]["test"]["n"] == 80 and gates["team"]["threshold"] == gates["choice"]["threshold"]
    # every written gate's held-out numbers are the threshold applied to the test rows, recomputed here
    team = gates["team"]
    rows = _qrows(TEST, "team")
    acc, cov, _ = G.selective(rows, team["threshold"])
    assert team["test"]["accuracy"] == pytest.approx(acc, abs=1e-6) and team["test"]["coverage"] == pytest.approx(cov)
    assert any("team (question, choice, n=120): gate at" in line for line in G.summary_lines(doc))


def test_jev_evals_reader_and_check_load_the_file(run_dir):
    from _clients import clients_bin, run_client

    path, _ = G.gate_run(run_dir, G.Goal(max_escalation=0.4), resamples=100)
    records = [{"model": "run", "row": i, "id": q, "type": t, "question": {"type": t, "instructions": f"{q}?"},
                "answer": {"type": "noul", "noul": 0.9} if t == "noul" else None, "gold": True}
               for i in range(60) for q, t, _ in QUESTIONS if t == "noul"]
    script = ("import json, sys\nfrom jev_eval.check import load_thresholds, check, warnings\n"
              "from jev_eval.analysis import score_records\n"
              "doc = load_thresholds(sys.argv[1])\n"
              "records = json.loads(sys.argv[2])\n"
              "checks = check(doc, score_records(records))\n"
              "print(json.dumps({'questions': sorted(doc['questions']), 'checks': [c.name for c in checks], "
              "'warnings': warnings(doc, score_records(records))}))")
    out = run_client([str(clients_bin()), "-c", script, str(path), json.dumps(records)])
    got = json.loads(out.stdout.strip().splitlines()[-1])
    doc = json.loads(path.read_text())
    assert got["questions"] == sorted(doc["questions"]) and "urgent" in got["checks"]
    assert got["warnings"] == []  # same model name, same definition of "urgent"


def test_the_report_shows_the_gates(run_dir):
    from rlcd.report import write_report

    G.gate_run(run_dir, G.Goal(target_accuracy=0.6), resamples=50)
    md = write_report(run_dir).read_text()
    assert "## Gating: thresholds.json" in md and "test accuracy [95% CI]" in md
    assert "| team (provisional) | question | 120 |" in md  # 120 rows < 200: jev-eval's provisional


# ------------------------------------------------------------------------------------- the CLI
def test_cli_writes_and_refuses_mistakes(run_dir, tmp_path):
    from typer.testing import CliRunner

    from rlcd.cli import app

    out = tmp_path / "t.json"
    res = CliRunner().invoke(app, ["gate", str(run_dir), "--max-escalation", "0.3", "--bootstrap", "50",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["x_rlcd"]["goal"] == {"maxEscalation": 0.3}
    assert "gate at" in res.stdout and f"wrote {out}" in res.stderr
    bare = tmp_path / "bare"
    (bare / "eval").mkdir(parents=True)
    (bare / "config.json").write_text("{}")
    for args, says in ((["gate", str(run_dir)], "exactly one"),
                       (["gate", str(run_dir), "--target-accuracy", "0.9", "--max-escalation", "0.1"], "exactly one"),
                       (["gate", str(run_dir), "--target-accuracy", "1.5"], "(0, 1]"),
                       (["gate", str(run_dir), "--max-escalation", "-0.1"], "[0, 1]"),
                       (["gate", str(run_dir), "--target-accuracy", "0.9", "--yes-precision", "2"], "precisions"),
                       (["gate", str(tmp_path / "nope"), "--target-accuracy", "0.9"], "no such run"),
                       (["gate", str(bare), "--target-accuracy", "0.9"], "rlcd evaluate"),
                       (["gate", str(run_dir), "--target-accuracy", "0.9", "--out", str(tmp_path)], "directory")):
        before = sorted(p.name for p in tmp_path.rglob("*"))
        user_error(args, contains=says)
        assert sorted(p.name for p in tmp_path.rglob("*")) == before, args  # nothing written
