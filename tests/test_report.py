"""evaluation.json from prediction rows (deterministic, regenerable) and the report on a tiny run dir."""

import json
import random
import re

import numpy as np
import pytest
import torch

from rlcd import metrics as M
from rlcd.calibrate import fit_per_type
from rlcd.report import (evaluation_from_predictions, evaluation_json, format_summary, load_predictions,
                         regenerate_evaluation, write_evaluation, write_report)

torch.set_num_threads(1)

GROUPS = ("synth/en/colour", "vqa/en/yesno", "td/en/rating")
PNG = b"\x89PNG\r\n\x1a\n"


def _softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def make_rows(split, n, seed, *, posterior=True):
    """Prediction rows of all three types; the model's logits are 2x too sharp (T* ~ 2)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        type_ = ("choice", "noul", "score")[i % 3]
        k = {"choice": int(rng.integers(3, 13)), "noul": 2, "score": 5}[type_]
        z = rng.normal(0, 1.5, size=k)
        truth = _softmax(z)
        target = np.eye(k)[rng.choice(k, p=truth)] if i % 2 else truth
        labels = [f"c{j}" for j in range(k)] if type_ == "choice" else (
            ["false", "true"] if type_ == "noul" else [str(j) for j in range(k)])
        group = GROUPS[i % 3] if i % 5 else GROUPS[(i + 1) % 3]
        rows.append({"id": f"{split}-{i:04d}", "group": group, "type": type_, "labels": labels,
                     "target": target.tolist(),
                     "posterior": truth.tolist() if posterior and group.startswith("synth") else None,
                     "logits": (2.0 * z + rng.normal(0, 0.1, size=k)).tolist(),
                     "instructions": f"question {type_} {i % 4}"})
    return rows


def make_run(tmp_path, *, with_eval=True, with_log=True, posterior=True, diagnostics=True):
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    preds = {s: make_rows(s, n, seed, posterior=posterior)
             for s, n, seed in (("dev", 30, 1), ("calibration", 60, 2), ("test", 60, 3))}
    for split, rows in preds.items():
        with open(run / "eval" / f"predictions-{split}.jsonl", "w") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
    temps, infos = fit_per_type(preds["calibration"])
    train = make_rows("train", 90, 4)
    meta = {"run": "tiny", "selected_step": 40, "checkpoint_sha256": "ab" * 32,
            "data_hashes": {"train.jsonl": "cd" * 32}, "calibration": infos}
    mb = M.majority_baseline(train, preds["test"])
    if with_eval:
        write_evaluation(run, evaluation_from_predictions(preds, temps, meta, majority_baseline=mb))
    if with_log:
        with open(run / "metrics.jsonl", "w") as fh:
            for step in range(1, 41):
                line = {"step": step, "loss": 2.0 / step, "ce_loss": 1.5 / step, "lr_lora": 1e-4 * min(1, step / 5),
                        "lr_head": 5e-4 * min(1, step / 5), "grad_norm": 1.0 / step ** 0.5,
                        "per_type": {t: {"entropy": h / step ** 0.3, "max_prob": 1 - 0.5 / step ** 0.3,
                                         "effective_candidates": float(np.exp(h / step ** 0.3)), "n": 10}
                                     for t, h in (("choice", 1.6), ("noul", 0.6), ("score", 1.2))}}
                line.update({f"ce/{t}": c / step for t, c in (("choice", 1.5), ("noul", 0.5), ("score", 1.0))})
                if diagnostics and step % 2 == 0:  # the split of the objective at the diagnostics cadence
                    shares = {"choice": 0.5 + step / 200, "noul": 0.1, "score": 0.4 - step / 200}
                    line.update({f"grad_share/{t}": v for t, v in shares.items()})
                    line.update({f"grad_norm/{t}": v ** 0.5 for t, v in shares.items()})
                    line.update({f"policy_loss/{t}": 0.01 * i for i, t in enumerate(shares)})
                    line.update({f"reward/{t}/mean": -1 + step / 40 - i / 10 for i, t in enumerate(shares)})
                if diagnostics:
                    line.update(policy_loss=0.1 - step / 400, reward_mean=-1 + step / 40, log_score_mean=-1.2 + step / 50,
                                spherical_mean=0.4 + step / 200, advantage_std=1.0, grad_cosine=0.3,
                                grad_norm_ratio=0.8)
                fh.write(json.dumps(line) + "\n")
                if step % 10 == 0:
                    fh.write(json.dumps({"event": "eval", "step": step, "dev_macro_accuracy": 0.3 + step / 100,
                                         "dev_accuracy": {g: 0.3 + step / 100 for g in GROUPS},
                                         "dev_nll/choice": 1.2 - step / 100, "dev_accuracy/choice": 0.2 + step / 100,
                                         "dev_nll/noul": 0.7 - step / 400, "dev_accuracy/noul": 0.5 + step / 400})
                             + "\n")
            fh.write("{not json\n")
    return run, preds, temps, meta, mb


def test_evaluation_structure_and_determinism(tmp_path):
    _, preds, temps, meta, mb = make_run(tmp_path, with_log=False)
    ev = evaluation_from_predictions(preds, temps, meta, majority_baseline=mb)
    assert ev["headline_split"] == "test" and ev["n_rows"] == {"dev": 30, "calibration": 60, "test": 60}
    assert set(ev["temperatures"]) == {"choice", "noul", "score"}
    assert all(1.4 < t < 3.2 for t in ev["temperatures"].values())  # logits 2x too sharp; 20 rows a type
    for side in ("raw", "calibrated"):
        o = ev[side]["overall"]
        for key in ("accuracy", "nll", "brier", "ece", "ece_target", "sharpness_gap"):
            assert isinstance(o[key], float), key
        assert set(ev[side]["per_type"]) == {"choice", "noul", "score"}
        assert set(ev[side]["per_group"]) == set(GROUPS)
        assert "posterior" in o and "rps" in o
    assert ev["raw"]["overall"]["accuracy"] == ev["calibrated"]["overall"]["accuracy"]  # T > 0 keeps argmax
    post_r, post_c = ev["raw"]["overall"]["posterior"], ev["calibrated"]["overall"]["posterior"]
    assert post_r["uniform_gap"] == post_c["uniform_gap"] > 0  # the rows' reference, whatever the temperatures
    assert ev["calibrated"]["overall"]["nll"] < ev["raw"]["overall"]["nll"]
    assert set(ev["other_splits"]) == {"dev", "calibration"}
    assert ev["majority_baseline"] == json.loads(json.dumps(mb)) and ev["meta"]["selected_step"] == 40
    # intervals beside every headline metric block, for every split, and for each fitted temperature
    for summ in [ev["raw"], ev["calibrated"]] + [b[k] for b in ev["other_splits"].values() for k in ("raw", "calibrated")]:
        for block in [summ["overall"], *summ["per_type"].values()]:
            for key in ("accuracy", "nll", "brier", "ece", "ece_target", "sharpness_gap", "aurc"):
                lo, hi = block["ci95"][key]
                assert lo <= hi, key
        assert set(summ["group_macro"]["ci95"]) == {"accuracy", "nll", "brier"}
    assert "rps" in ev["raw"]["per_type"]["score"]["ci95"] and "rps" not in ev["raw"]["per_type"]["noul"]["ci95"]
    for t, (lo, hi) in ev["temperatures_ci95"].items():
        assert lo < ev["temperatures"][t] < hi, t
    assert set(ev["calibration_effect"]["per_type"]) == {"choice", "noul", "score"}
    assert ev["bootstrap"]["resamples"] == 1000 and ev["bootstrap"]["n_cases"] == {"dev": 30, "calibration": 60,
                                                                                   "test": 60}

    text = evaluation_json(ev)
    shuffled = {s: random.Random(len(s)).sample(rows, len(rows)) for s, rows in reversed(list(preds.items()))}
    again = evaluation_from_predictions(shuffled, dict(reversed(list(temps.items()))), meta, majority_baseline=mb)
    assert evaluation_json(again) == text
    assert evaluation_json(evaluation_from_predictions(preds, {**temps, "noul": 1.0}, meta,
                                                       majority_baseline=mb)) != text


def test_prediction_files_regenerate_evaluation_json_exactly(tmp_path):
    run, *_ = make_run(tmp_path, with_log=False)
    stored = (run / "eval" / "evaluation.json").read_text()
    assert evaluation_json(regenerate_evaluation(run)) == stored
    # editing one logit in a prediction file changes the regenerated evaluation
    path = run / "eval" / "predictions-test.jsonl"
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    first["logits"][0] += 3.0
    path.write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")
    assert evaluation_json(regenerate_evaluation(run)) != stored


def test_report_and_plots_exist_for_a_tiny_run(tmp_path):
    run, *_ = make_run(tmp_path)
    report = write_report(run)
    assert report == run / "eval" / "report.md"
    text = report.read_text()
    plots = ["reliability_overall", "reliability_choice", "reliability_noul", "reliability_score", "coverage_risk",
             "group_accuracy", "training_curves", "rlcd_diagnostics", "accuracy_by_k", "type_stats",
             "objective_per_type", "dev_per_type"]
    for name in plots:
        png = run / "eval" / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == PNG and png.stat().st_size > 5000, name
        assert f"](plots/{name}.png)" in text, name
    for heading in ("## Headline: test split (n = 60)", "## Temperatures", "## Per type", "## Majority baseline",
                    "## Known posterior", "## Per group", "## Other splits", "## Training"):
        assert heading in text, heading
    assert "| uniform_gap |" in text
    assert "a uniform answer" in format_summary(json.loads((run / "eval" / "evaluation.json").read_text()))
    assert "matches the prediction files exactly" in text
    assert "| accuracy | 0." in text and "raw [95% CI]" in text and "95% CI (refit per resample)" in text
    for heading in ("## Error analysis (test)", "### Confusion matrices", "### Accuracy by number of candidates K",
                    "### The 20 worst rows by calibrated NLL", "### RLCD diagnostics", "### Recipe",
                    "### Output sharpness per type", "### Objective per type", "### Dev curve per type"):
        assert heading in text, heading
    # the per-type dev curve's table: first (step 10) and last (step 40) evaluation of each type
    assert f"| choice | {0.3:.3f} → {0.6:.3f} | {1.1:.3f} → {0.8:.3f} |" in text
    assert f"| noul | {0.525:.3f} → {0.6:.3f} | {0.675:.3f} → {0.6:.3f} |" in text
    # the per-type objective table: CE first -> last, policy mean, reward first -> last, gradient norm and share means
    mean_share = np.mean([0.5 + s / 200 for s in range(2, 41, 2)])
    mean_norm = np.mean([(0.5 + s / 200) ** 0.5 for s in range(2, 41, 2)])
    assert (f"| choice | {1.5:.3f} → {1.5 / 40:.3f} | 0.0000 | {-1 + 2 / 40:.3f} → {0.0:.3f} | {mean_norm:.4f} | "
            f"{mean_share:.4f} |") in text
    assert f"| noul | {0.5:.3f} → {0.5 / 40:.3f} | 0.0100 |" in text
    assert (run / "eval" / "report.html").stat().st_size > 100_000
    assert "1 unreadable line(s) skipped" in text
    assert f"| choice | {1.6:.3f} → {1.6 / 40 ** 0.3:.3f} | {0.5:.3f} → {1 - 0.5 / 40 ** 0.3:.3f} |" in text
    order = [text.index(h) for h in ("## Headline", "## Temperatures", "## Training", "## Data and recipe",
                                     "## About this report")]
    assert order == sorted(order)  # summary first, what the run was last
    assert "not available" not in text.lower() and "missing" not in text.lower()


def test_report_without_optional_inputs(tmp_path):
    run, preds, *_ = make_run(tmp_path, with_eval=False, with_log=False, posterior=False)
    text = write_report(run).read_text()
    assert "`eval/evaluation.json` is missing" in text
    assert "fitted here on `predictions-calibration.jsonl`" in text
    assert "No rows carry a posterior" in text
    assert "Not available" in text  # majority baseline
    assert "`metrics.jsonl` is missing" in text
    plots = run / "eval" / "plots"
    assert not (plots / "training_curves.png").exists()
    assert (plots / "coverage_risk.png").stat().st_size > 0
    # a CE-only log: curves, but the diagnostics section says nothing was logged
    (run / "eval" / "predictions-calibration.jsonl").unlink()
    (run / "eval" / "predictions-dev.jsonl").unlink()
    with open(run / "metrics.jsonl", "w") as fh:
        for step in range(1, 6):
            fh.write(json.dumps({"step": step, "ce_loss": 1.0 / step, "lr_lora": 1e-4}) + "\n")
    text = write_report(run).read_text()
    assert "calibrated = raw (T = 1)" in text
    assert (plots / "training_curves.png").stat().st_size > 0
    assert not (plots / "rlcd_diagnostics.png").exists()
    assert "No reward parts" in text
    assert "### Objective per type" not in text and not (plots / "objective_per_type.png").exists()
    # a CE-arm log with the per-type split: CE and the gradient columns, no policy or reward ones
    with open(run / "metrics.jsonl", "w") as fh:
        for step in range(1, 5):
            fh.write(json.dumps({"step": step, "ce_loss": 1.0 / step, "ce/noul": 0.5 / step, "grad_norm/noul": 0.2,
                                 "grad_share/noul": 1.0}) + "\n")
    text = write_report(run).read_text()
    assert "### Objective per type" in text and "policy term" not in text
    assert f"| noul | {0.5:.3f} → {0.125:.3f} | 0.2000 | 1.0000 |" in text
    assert list(load_predictions(run)) == ["test"]


def test_report_needs_predictions(tmp_path):
    (tmp_path / "eval").mkdir()
    with pytest.raises(FileNotFoundError, match="predictions"):
        write_report(tmp_path)


def test_report_with_an_empty_split(tmp_path):
    """A split with no rows (e.g. no dev rows in a tiny data set) is reported, not a crash."""
    run, preds, temps, meta, mb = make_run(tmp_path)
    (run / "eval" / "predictions-dev.jsonl").write_text("")
    preds["dev"] = []
    write_evaluation(run, evaluation_from_predictions(preds, temps, meta, majority_baseline=mb))
    text = write_report(run).read_text()
    assert "| dev | 0 |" in text


def test_report_flags_a_calibration_that_hurts_beyond_noise(tmp_path):
    run, preds, temps, meta, mb = make_run(tmp_path, with_log=False)
    harmful = {"choice": 0.25, "noul": 0.25, "score": 0.25}  # 8x too sharp on top of 2x: NLL must get worse
    ev = evaluation_from_predictions(preds, harmful, meta, majority_baseline=mb)
    write_evaluation(run, ev)
    from rlcd.report import format_summary

    summary = format_summary(ev)  # the CLI summary says it too
    for t in ("overall", "choice", "noul", "score"):
        assert f"warning: calibration made {t} nll worse beyond noise" in summary, t
    text = write_report(run).read_text()
    for t in ("all types", "choice", "noul", "score"):
        assert f"⚠ Calibration made **{t}** NLL worse on test" in text, t
    html = (run / "eval" / "report.html").read_text()
    assert html.count('<p class="warn">') >= 4
    write_evaluation(run, evaluation_from_predictions(preds, {t: 1.0 for t in harmful}, meta, majority_baseline=mb))
    text = write_report(run).read_text()
    assert "⚠" not in text and "No type's calibrated NLL or ECE on test is worse than raw" in text


def test_training_curves_ema_is_debiased():
    from rlcd.report.training_log import ema

    assert np.allclose(ema([3.0] * 50), 3.0)  # no pull towards the zero start
    x = [0.0] * 10 + [1.0] * 10
    got = ema(x, span=3)  # alpha = 0.5
    assert np.allclose(got[:10], 0.0) and got[10] == 0.5 / (1 - 0.5 ** 11) and np.isclose(got[11], 0.75 / (1 - 0.5 ** 12))
    assert np.allclose(ema(x, span=1), x) and len(ema([])) == 0


def test_wilson_interval_holds_the_proportion_and_known_values():
    from rlcd.report.plots import wilson

    assert wilson(0.5, 10) == pytest.approx((0.236593, 0.763407), abs=1e-6)  # textbook value
    assert wilson(0.2, 50) == pytest.approx((0.112437, 0.330371), abs=2e-6)  # the formula by hand, z = 1.95996
    for n in range(1, 300):
        for p in (0.0, 1.0, 1 / 3):
            lo, hi = wilson(p, n)
            assert 0.0 <= lo <= p <= hi <= 1.0, (p, n)  # at 0 and 1 rounding put p outside before


def test_summary_says_which_temperature_fits_did_not_converge_or_were_skipped(tmp_path):
    from rlcd.report import format_summary

    run, preds, temps, meta, mb = make_run(tmp_path, with_log=False)
    infos = {t: dict(i) for t, i in meta["calibration"].items()}
    assert all(i["converged"] for i in infos.values())
    ev = evaluation_from_predictions(preds, temps, meta, majority_baseline=mb)
    assert "did not converge" not in format_summary(ev) and "not fitted" not in format_summary(ev)
    infos["noul"]["converged"] = False
    infos["score"] = {"temperature": 1.0, "n": 4, "converged": False, "reason": "4 calibration rows < 10: T = 1"}
    ev = evaluation_from_predictions(preds, temps, {**meta, "calibration": infos}, majority_baseline=mb)
    summary = format_summary(ev)
    assert "warning: the noul temperature fit did not converge" in summary
    assert "note: score temperature not fitted: 4 calibration rows < 10: T = 1" in summary
    assert "choice temperature" not in summary


def test_a_run_with_known_posteriors_opens_with_its_learning_curve(tmp_path):
    """Where every dev and test row carries a posterior (synth data, `make demo`), report.md and report.html open
    with the learning curve: dev NLL against updates between the uniform answer and the Bayes floor, and the final
    test point -- the calibrated gap with its interval, the numbers of the headline's posterior block. Rows without
    a posterior (the default fixture mixes sources) get no such section: there is no floor to draw."""
    run, preds, temps, meta, mb = make_run(tmp_path)
    for split, rows in preds.items():
        for r in rows:
            if r["posterior"] is None:
                r["posterior"] = r["target"]
        (run / "eval" / f"predictions-{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ev = evaluation_from_predictions(preds, temps, meta, majority_baseline=mb)
    write_evaluation(run, ev)
    with open(run / "metrics.jsonl", "a") as fh:
        for step in (10, 20, 30, 40):
            fh.write(json.dumps({"event": "eval", "step": step, "dev_nll": 2.0 - step / 40,
                                 "dev_macro_accuracy": 0.3 + step / 100}) + "\n")
    md = write_report(run).read_text()
    html = (run / "eval" / "report.html").read_text()
    assert md.index("## Learning curve") < md.index("## Headline: test split")
    assert re.match(r"^# .+\n+## Learning curve", md)
    assert html.index("<h2>Learning curve") < html.index("<h2>Headline") < html.index("<nav>")
    assert (run / "eval" / "plots" / "learning_curve.png").read_bytes().startswith(PNG)
    post = ev["calibrated"]["overall"]["posterior"]
    section = md[md.index("## Learning curve"): md.index("## Headline")]
    assert f"calibrated gap **{post['bayes_gap']:.4f}**" in section
    assert f"vs {post['uniform_gap']:.4f} for the uniform answer" in section
    floor = np.mean([M.nll(r["posterior"], r["target"]) for r in preds["dev"]])
    assert f"→ {2.0 - 1.0 - floor:.4f} at step 40" in section  # the last dev NLL minus the dev rows' floor

    plain, *_ = make_run(tmp_path / "mixed")
    assert "## Learning curve" not in write_report(plain).read_text()
