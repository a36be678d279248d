"""The data-scale picture's numbers (issue 69): per-block calibrated gaps from an arm's held-out predictions,
stage costs from a run script's costs.tsv, the sentence, the figure and the command's refusals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rlcd.analysis import data_scale as ds


def _arm(tmp_path, name, scale, seed, eval_name="sealed", temps=None):
    """A run directory holding only RUN/eval-NAME/: 8 cases x (choice, noul, score) rows with logits and posteriors."""
    rng = np.random.default_rng(seed)
    temps = temps or {"choice": 1.3, "noul": 0.8, "score": 2.0}
    d = tmp_path / name / f"eval-{eval_name}"
    d.mkdir(parents=True)
    rows = []
    for c in range(8):
        for t, k in (("choice", 4), ("noul", 2), ("score", 5)):
            post = rng.dirichlet(np.ones(k))
            rows.append({"id": f"case{c}:{t}", "case_id": f"case{c}", "type": t, "target": post.tolist(),
                         "posterior": post.tolist(), "logits": (scale * rng.normal(size=k)).tolist()})
    (d / "predictions-test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "evaluation.json").write_text(json.dumps({"temperatures": temps}))
    return tmp_path / name, rows, temps


def _gap64(rows, temps, block):
    """Mean NLL(softmax(z/T)) - NLL(posterior) against the target, in float64, written out independently."""
    out = []
    for r in rows:
        if block != "overall" and r["type"] != block:
            continue
        z = np.asarray(r["logits"], dtype=np.float64) / temps[r["type"]]
        logp = z - (np.log(np.sum(np.exp(z - z.max()))) + z.max())
        t = np.asarray(r["target"], dtype=np.float64)
        q = np.asarray(r["posterior"], dtype=np.float64)
        out.append(-(t * logp).sum() + (t * np.log(q)).sum())
    return float(np.mean(out))


def test_arm_gaps_match_an_independent_float64_gap_per_block(tmp_path):
    run, rows, temps = _arm(tmp_path, "a", 1.0, 0)
    gaps = ds.arm_gaps(run, "sealed")
    assert list(gaps) == ["overall", "choice", "noul", "score"]
    for block, g in gaps.items():
        assert g["gap"] == pytest.approx(_gap64(rows, temps, block), abs=1e-6)
        assert g["ci95"][0] <= g["gap"] <= g["ci95"][1]
        assert g["n"] == (24 if block == "overall" else 8)
    k = {"choice": 4, "noul": 2, "score": 5}
    uni = np.mean([math.log(k[r["type"]]) + float(np.sum(np.asarray(r["target"]) * np.log(r["posterior"])))
                   for r in rows])
    assert gaps["overall"]["uniform_gap"] == pytest.approx(uni, abs=1e-6)


def test_a_missing_evaluation_names_the_command_that_makes_it(tmp_path):
    (tmp_path / "r").mkdir()
    with pytest.raises(FileNotFoundError, match=r"eval-sealed/evaluation.json: missing .*--out sealed"):
        ds.arm_gaps(tmp_path / "r", "sealed")


def test_stage_costs_sum_the_arms_stages_only(tmp_path):
    tsv = tmp_path / "costs.tsv"
    tsv.write_text("stage\twall_s\tuser_s\tsys_s\texit\n"
                   "cut d1000\t100\t180\t5\t0\n"
                   "train d1000-ce\t10\t18\t1\t0\n"
                   "train d10000-top2\t999\t999\t9\t0\n"  # another arm whose label starts with d1000
                   "evaluate d1000-top2 sealed\t20\t30\t2\t0\n"
                   "probe coherence d1000-top2\t40\t70\t1\t0\n"
                   "cut d4000\t400\t700\t10\t0\n")
    assert ds.stage_costs(tsv, "d1000") == {"cpu_s": 180 + 5 + 18 + 1 + 30 + 2 + 70 + 1, "wall_s": 170.0,
                                            "train_cpu_s": 180 + 5 + 18 + 1}  # evaluations and probes do not train
    assert ds.stage_costs(tsv, "d4000") == {"cpu_s": 710.0, "wall_s": 400.0, "train_cpu_s": 710.0}
    assert ds.stage_costs(tmp_path / "none.tsv", "d1000") == {}


def test_the_command_writes_the_table_the_picture_and_the_sentence_of_the_best_arm(tmp_path, capsys):
    small, _, _ = _arm(tmp_path, "d1000-top2", 3.0, 1)  # sharp random logits: the larger gap
    large, rows, temps = _arm(tmp_path, "d4000-top2", 0.1, 2)
    tsv = tmp_path / "costs.tsv"
    tsv.write_text("stage\twall_s\tuser_s\tsys_s\texit\ncut d4000\t3000\t5400\t0\t0\n"
                   "evaluate d4000-top2 sealed\t900\t1800\t0\t0\n")
    out = tmp_path / "docs"
    assert ds.main(["--arm", f"4000={large}", "--arm", f"1000={small}", "--costs", str(tsv), "--backbone", "B",
                    "--out", str(out)]) == 0
    doc = json.loads((out / "data-scale.json").read_text())
    assert [a["cases"] for a in doc["arms"]] == [1000, 4000]  # sorted by size
    assert (out / "data-scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    best = doc["arms"][1]["gaps"]["overall"]
    assert best["gap"] < doc["arms"][0]["gaps"]["overall"]["gap"]
    line = capsys.readouterr().out.strip()
    assert line == doc["sentence"]
    assert line.startswith(f"4,000 cases buy a calibrated gap of {best['gap']:.3f} nats") and "on B for 1.5 CPU hours of training" in line


def test_a_malformed_arm_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        ds.main(["--arm", "runs/x", "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and "give CASES=RUN" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
