"""End to end on a tiny run: train a few updates, evaluate, export, report, predictor parity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import synth_processed

from rlcd.recipe import Recipe
from rlcd.train import train

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("eval")
    synth_processed(base, 80, seed=5)
    recipe = Recipe(steps=3, eval_every=1, checkpoint_every=1, log_every=1, diagnostics_every=1, lr_head=5e-3)
    train(base / "run", data_dir=base / "processed", model="tiny-toy", recipe=recipe, progress=False)
    return base / "run"


@pytest.fixture(scope="module")
def evaluated(run):
    from rlcd.evaluate import evaluate_run

    return evaluate_run(run)


def test_calibration_reads_only_the_calibration_split(run, monkeypatch):
    import rlcd.data.io as io
    from rlcd.evaluate import calibrate_run

    seen = []
    real = io.load_split

    def spy(d, split):
        seen.append(split)
        return real(d, split)

    monkeypatch.setattr(io, "load_split", spy)
    out = calibrate_run(run)
    assert seen == ["calibration"]
    assert set(out["temperatures"]) == {"choice", "noul", "score"}
    assert all(0.1 <= t <= 10 for t in out["temperatures"].values())


def test_evaluation_artefacts(run, evaluated):
    ev = json.loads((run / "eval" / "evaluation.json").read_text())
    for block in ("raw", "calibrated"):
        assert {"accuracy", "nll", "brier", "ece", "ece_target", "sharpness_gap"} <= set(ev[block]["overall"])
        assert set(ev[block]["per_type"]) <= {"choice", "noul", "score"}
    assert ev["majority_baseline"]["accuracy"] is not None
    assert ev["meta"]["selected_step"] is not None and len(ev["meta"]["checkpoint_sha256"]) == 64
    for split in ("dev", "calibration", "test"):
        rows = [json.loads(x) for x in (run / "eval" / f"predictions-{split}.jsonl").read_text().splitlines()]
        assert rows and all(len(r["logits"]) == len(r["labels"]) == len(r["target"]) for r in rows)
        assert all(r["instructions"] and 0 < len(r["state_excerpt"]) <= 240 for r in rows)  # the error analysis
    assert ev["temperatures_ci95"].keys() == ev["temperatures"].keys()
    assert "ci95" in ev["calibrated"]["overall"] and ev["bootstrap"]["resamples"] == 1000
    model_json = json.loads((run / "export" / "model.json").read_text())
    assert model_json["temperatures"] == ev["temperatures"]
    assert (run / "export" / "trainable.safetensors").stat().st_size > 0
    report = (run / "eval" / "report.md").read_text()
    plots = list((run / "eval" / "plots").glob("*.png"))
    assert len(plots) >= 4 and all(p.stat().st_size > 1000 for p in plots)
    missing = [p.name for p in plots if p.name not in report]
    assert not missing, f"plots not embedded in report.md: {missing}"
    html = (run / "eval" / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(plots)
    assert "worst rows by calibrated NLL" in report and "Rows without question or state text" not in report


def test_predictions_regenerate_evaluation_exactly(run, evaluated):
    from rlcd.report import evaluation_json, regenerate_evaluation

    stored = (run / "eval" / "evaluation.json").read_text()
    assert evaluation_json(regenerate_evaluation(run)) == stored


def test_merged_equals_unmerged_and_export_predictor_matches_eval(run, evaluated):
    from rlcd.evaluate import _collator, predict_rows, scored_records
    from rlcd.export import load_checkpoint_model

    unmerged, config, _ = load_checkpoint_model(run, "best", merge=False)
    merged, _, _ = load_checkpoint_model(run, "best", merge=True)
    records = scored_records(Path(config["data_dir"]), "test")[:12]  # as evaluate asks them: canonical forms
    a = predict_rows(unmerged, records, _collator(unmerged, Path(config["data_dir"])))
    b = predict_rows(merged, records, _collator(merged, Path(config["data_dir"])))
    for ra, rb in zip(a, b):
        torch.testing.assert_close(torch.tensor(ra["logits"]), torch.tensor(rb["logits"]), atol=1e-4, rtol=0)
    stored = {json.loads(x)["id"]: json.loads(x) for x in (run / "eval" / "predictions-test.jsonl").read_text().splitlines()}
    for row in b:
        torch.testing.assert_close(torch.tensor(row["logits"]), torch.tensor(stored[row["id"]]["logits"]),
                                   atol=1e-5, rtol=0)


def test_export_refuses_a_different_backbone(run, evaluated, tmp_path):
    import shutil

    from rlcd.export import load_export

    copy = tmp_path / "export"
    shutil.copytree(run / "export", copy)
    meta = json.loads((copy / "model.json").read_text())
    meta["model_seed"] = meta["model_seed"] + 1
    (copy / "model.json").write_text(json.dumps(meta))
    with pytest.raises(RuntimeError, match="fingerprint"):
        load_export(copy)


def test_calibrate_writes_the_temperatures_evaluate_and_export_use(run, tmp_path):
    """One calibration path: `rlcd calibrate` stores them, `rlcd evaluate` and the export read them back."""
    import shutil

    from rlcd.evaluate import calibrate_run, evaluate_run

    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("eval", "export"))
    stored = calibrate_run(copy)
    path = copy / "eval" / "temperatures.json"
    assert json.loads(path.read_text())["temperatures"] == stored["temperatures"]
    assert stored["device"] == "cpu" and stored["dtype"] == "float32" and len(stored["checkpoint_sha256"]) == 64
    planted = {"choice": 1.25, "noul": 0.75, "score": 2.5}  # not what a fit gives: proves they are read
    path.write_text(json.dumps({**stored, "temperatures": planted}))
    ev = evaluate_run(copy)
    assert ev["temperatures"] == planted
    assert json.loads((copy / "export" / "model.json").read_text())["temperatures"] == planted
    assert ev["meta"]["placement"] == {"device": "cpu", "dtype": "float32"}
    # a different checkpoint invalidates them: evaluate fits again and overwrites the file
    stale = {**stored, "temperatures": planted, "checkpoint_sha256": "0" * 64}
    path.write_text(json.dumps(stale))
    ev = evaluate_run(copy)
    assert ev["temperatures"] == stored["temperatures"]
    assert json.loads(path.read_text())["checkpoint_sha256"] == stored["checkpoint_sha256"]
    # temperatures fitted before the held-out guard (no "guard" key) are fitted again, with it
    path.write_text(json.dumps({k: v for k, v in {**stored, "temperatures": planted}.items() if k != "guard"}))
    ev = evaluate_run(copy, export=False)
    assert ev["temperatures"] == stored["temperatures"] and json.loads(path.read_text())["guard"] == stored["guard"]


def test_evaluate_piped_shows_progress_lines_on_stderr(run, tmp_path):
    """`rlcd evaluate RUN | cat`: off a terminal each split prints plain lines (rows done / total, rows/s,
    eta) on stderr, after saying which model it loads; stdout keeps the summary alone."""
    import re
    import shutil

    from typer.testing import CliRunner

    from rlcd.cli import app
    from rlcd.data.io import load_split

    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("eval", "export"))
    res = CliRunner().invoke(app, ["evaluate", str(copy), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    data = Path(json.loads((copy / "config.json").read_text())["data_dir"])
    for split in ("dev", "calibration", "test"):
        n = len(load_split(data, split))
        assert re.search(rf"^score {split}: {n}/{n} rows \(100%\), [\d.]+ rows/s, eta 0s$", res.stderr, re.M), res.stderr
    assert 0 <= res.stderr.index("model: loading") < res.stderr.index("score dev:")
    assert "checkpoints/best" in res.stderr.splitlines()[0] and "tiny-toy" in res.stderr
    assert "rows" not in res.stdout and "model:" not in res.stdout


def test_a_library_caller_can_turn_progress_off(run, capsys):
    import re

    from rlcd.evaluate import calibrate_run

    calibrate_run(run, progress=False)
    assert "score" not in capsys.readouterr().err
    calibrate_run(run)
    assert re.search(r"^score calibration: (\d+)/\1 rows \(100%\)", capsys.readouterr().err, re.M)


def test_evaluate_the_last_checkpoint(run, evaluated, tmp_path):
    """`rlcd evaluate --checkpoint last`: the last checkpoint's weights, named as such in eval/ and export/."""
    import shutil

    from rlcd import checkpoint as ckpt
    from rlcd.evaluate import evaluate_run

    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("eval", "export"))
    # make best and last differ for sure: halve the stored best scorer (last stays what training left)
    best = ckpt.load(copy / "checkpoints" / "best")
    ckpt.save(copy / "checkpoints" / "best", weights={k: v * 0.5 if k.startswith("head.w_") else v
                                                      for k, v in best["weights"].items()},
              optimizer=None, state={**best["state"], "best_step": 1})
    last_state = ckpt.load(copy / "checkpoints" / "last")["state"]
    ev = evaluate_run(copy, which="last")
    assert ev["meta"]["checkpoint"] == "last" and ev["meta"]["selected_step"] == last_state["step"] == 3
    assert ev["meta"]["checkpoint_sha256"] == ckpt.weights_sha256(copy / "checkpoints" / "last")
    model_json = json.loads((copy / "export" / "model.json").read_text())
    assert model_json["checkpoint"] == "last" and model_json["checkpoint_sha256"] == ev["meta"]["checkpoint_sha256"]
    temps = json.loads((copy / "eval" / "temperatures.json").read_text())
    assert temps["checkpoint_sha256"] == ev["meta"]["checkpoint_sha256"]
    last_logits = [json.loads(x)["logits"] for x in (copy / "eval" / "predictions-test.jsonl").read_text().splitlines()]
    ev_best = evaluate_run(copy)
    assert ev_best["meta"]["checkpoint"] == "best" and ev_best["meta"]["selected_step"] == 1
    best_logits = [json.loads(x)["logits"] for x in (copy / "eval" / "predictions-test.jsonl").read_text().splitlines()]
    assert best_logits != last_logits


def test_export_pairs_the_temperatures_with_the_checkpoint_they_were_fitted_on(run, tmp_path):
    """`rlcd calibrate --checkpoint last` then `rlcd export`: the export holds the last weights (what the
    temperatures calibrate), and temperatures of weights the run no longer holds are refused."""
    import shutil

    from rlcd import checkpoint as ckpt
    from rlcd.errors import RunError
    from rlcd.evaluate import calibrate_run, export_run

    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("eval", "export"))
    best = ckpt.load(copy / "checkpoints" / "best")  # make best and last differ
    ckpt.save(copy / "checkpoints" / "best", weights={k: v * 0.5 if k.startswith("head.w_") else v
                                                      for k, v in best["weights"].items()},
              optimizer=None, state={**best["state"], "best_step": 1})
    stored = calibrate_run(copy, which="last", progress=False)
    export_run(copy)
    model_json = json.loads((copy / "export" / "model.json").read_text())
    assert model_json["checkpoint"] == "last" and model_json["temperatures"] == stored["temperatures"]
    assert model_json["checkpoint_sha256"] == ckpt.weights_sha256(copy / "checkpoints" / "last")

    shutil.rmtree(copy / "export")
    path = copy / "eval" / "temperatures.json"
    path.write_text(json.dumps({**stored, "checkpoint_sha256": "0" * 64}))
    with pytest.raises(RunError, match="rlcd calibrate"):
        export_run(copy)
    assert not (copy / "export").exists()


def test_evaluate_scores_the_forms_the_server_asks_and_as_asked_on_request(run, evaluated, tmp_path):
    """By default every row (calibration included, so the temperatures) is scored in the canonical form `rlcd serve`
    asks it; `canonical=False` (`--as-asked`) scores the rows as written. Both say which in evaluation.json and
    temperatures.json, and a temperature file fitted on the other form is not reused."""
    import shutil

    from rlcd.evaluate import evaluate_run, original_records
    from rlcd.serving.canonical import canonical_record

    config = json.loads((run / "config.json").read_text())
    data = Path(config["data_dir"])
    for split in ("calibration", "test"):
        rows = [json.loads(x) for x in (run / "eval" / f"predictions-{split}.jsonl").read_text().splitlines()]
        want = [canonical_record(r) for r in original_records(data, split)]
        assert [(r["id"], r["type"], r["labels"]) for r in rows] == [(r.id, r.question.type, r.question.labels)
                                                                      for r in want]
    moved = [r for r in original_records(data, "test") if canonical_record(r) is not r]
    assert moved, "the fixture writes some rows in another form than the canonical one"
    assert evaluated["meta"]["requests"] == "canonical"
    assert json.loads((run / "eval" / "temperatures.json").read_text())["requests"] == "canonical"
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    ev = evaluate_run(copy, progress=False, export=False, canonical=False)
    assert ev["meta"]["requests"] == "as_asked"
    temps = json.loads((copy / "eval" / "temperatures.json").read_text())
    assert temps["requests"] == "as_asked" and temps["n_rows"] == len(original_records(data, "calibration"))
    lines = (copy / "eval" / "predictions-test.jsonl").read_text().splitlines()
    rows = {json.loads(x)["id"]: json.loads(x) for x in lines}
    assert all(rows[r.id]["labels"] == r.question.labels for r in moved)
