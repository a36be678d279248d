"""Sweeps: grid parsing and expansion (the ce arm deduplicated), resolved recipes, aggregation of
fake evaluation.json files (mean / sample std), resume-by-skip, and one small real sweep."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from rlcd.analysis.sweep import (SweepError, expand_grid, mean_std, metric_values, parse_grid, parse_seeds, plan_runs,
                                 run_sweep, scaled_cadence, summarize_runs, write_summary)
from rlcd.errors import OptionError, UserError
from rlcd.recipe import Recipe, parse_overrides

torch.set_num_threads(1)

GRID = {"sigma": [0.25, 1.0, 4.0], "objective": ["rlcd", "ce"]}


# ----------------------------------------------------------------------------------------------
# grid


def test_parse_grid_types_values_and_rejects_bad_keys():
    g = parse_grid(["sigma=0.25,1,4", "objective=rlcd,ce", "ce-weight=0,1"])
    assert g == {"sigma": [0.25, 1.0, 4.0], "objective": ["rlcd", "ce"], "ce_weight": [0.0, 1.0]}
    assert all(isinstance(v, float) for v in g["sigma"])
    assert parse_overrides(["eval_every=5", "batch_size=4"]) == {"eval_every": 5, "batch_size": 4}
    with pytest.raises(OptionError, match="--grid sgima: not a recipe field"):  # the recipe's own parser
        parse_grid(["sgima=1"])
    with pytest.raises(OptionError, match="not a valid int"):
        parse_overrides(["eval_every=2.5"])
    with pytest.raises(SweepError, match="KEY="):
        parse_grid(["sigma"])
    assert parse_seeds("3") == [0, 1, 2] and parse_seeds("4,7") == [4, 7] and parse_seeds(2) == [0, 1]
    with pytest.raises(SweepError, match="--seeds 'three'"):
        parse_seeds("three")
    assert issubclass(SweepError, OptionError) and issubclass(SweepError, UserError)


def test_expand_grid_dedupes_the_ce_arm():
    arms, notes = expand_grid(GRID)
    names = [a.name for a in arms]
    assert names == ["rlcd-sigma0.25", "ce", "rlcd-sigma1", "rlcd-sigma4"]
    ce = arms[1]
    assert ce.params == {"objective": "ce"} and len(ce.merged) == 3
    assert [a.params.get("sigma") for a in arms if a.objective == "rlcd"] == [0.25, 1.0, 4.0]
    assert any("'ce'" in n and "sigma" in n and "3 grid points" in n for n in notes)
    # ce_weight is ignored by ce too; repeated values collapse
    arms, notes = expand_grid({"objective": ["ce", "rlcd"], "ce_weight": [0.0, 1.0, 1.0]})
    assert [a.name for a in arms] == ["ce", "rlcd-ce_weight0", "rlcd-ce_weight1"]
    assert any("repeated" in n for n in notes)
    # an objective fixed by the overrides counts as well
    arms, _ = expand_grid({"sigma": [1, 2]}, {"objective": "ce"})
    assert [a.name for a in arms] == ["base"]
    with pytest.raises(SweepError, match="cannot be a grid key"):
        expand_grid({"seed": [0, 1]})


def test_plan_resolves_full_recipes(tmp_path):
    arms, _ = expand_grid(GRID)
    specs = plan_runs(tmp_path / "data", "tiny-toy", arms, [0, 1], 40, tmp_path / "out",
                      recipe_overrides={"log_every": 7})
    assert len(specs) == 8
    by = {s.name: s for s in specs}
    assert set(by) == {f"{a}-s{s}" for a in ("rlcd-sigma0.25", "rlcd-sigma1", "rlcd-sigma4", "ce") for s in (0, 1)}
    r = Recipe.from_dict(by["rlcd-sigma4-s1"].config["recipe"])
    assert (r.sigma, r.seed, r.steps, r.objective) == (4.0, 1, 40, "rlcd")
    assert r.eval_every == scaled_cadence(40)["eval_every"] == 4 and r.log_every == 7  # override wins
    assert Recipe.from_dict(by["ce-s0"].config["recipe"]).objective == "ce"
    assert by["ce-s0"].run_dir == (tmp_path / "out" / "runs" / "ce-s0").resolve()
    assert by["ce-s0"].config["export"] is False  # a sweep's runs write no export/ unless asked
    assert scaled_cadence(3600) == {} and scaled_cadence(2) == {k: 1 for k in scaled_cadence(2)}
    with pytest.raises(SweepError, match="sigma must be > 0"):
        plan_runs(tmp_path, "tiny-toy", expand_grid({"sigma": [0.0]})[0], [0], 5, tmp_path / "o")


# ----------------------------------------------------------------------------------------------
# aggregation from fake evaluation files


def _fake_eval(nll: float, acc: float, t_choice: float, bayes_gap: float | None = None,
               test_nll: float | None = None) -> dict:
    """Dev blocks from `nll`; test blocks from `test_nll` (default: the same numbers as dev)."""
    def block(scale, value=nll):
        b = {"n": 10, "accuracy": acc, "nll": value * scale, "brier": 0.5 * scale, "ece": 0.1, "ece_target": 0.05,
             "sharpness_gap": 0.2 * value * scale}
        if bayes_gap is not None:
            b["posterior"] = {"n": 10, "nll": value * scale - 0.1, "bayes_gap": bayes_gap, "accuracy": acc}
        return b

    def views(value):
        return {"raw": {"overall": block(1.0, value), "per_type": {"choice": block(1.0, value)},
                        "group_macro": {"accuracy": acc}},
                "calibrated": {"overall": block(0.9, value), "per_type": {"choice": block(0.9, value)}}}

    test = views(nll if test_nll is None else test_nll)
    return {"format": "rlcd.evaluation/2", "headline_split": "test",
            "temperatures": {"choice": t_choice, "noul": 1.0, "score": 2.0},
            "raw": test["raw"], "calibrated": test["calibrated"], "other_splits": {"dev": views(nll)},
            "meta": {"calibration": {"noul": {"temperature": 1.0, "reason": "3 calibration rows < 10: T = 1"}}}}


def _write_fake_runs(specs, values):
    for spec in specs:
        if spec.name not in values:
            continue
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        cfg = {k: spec.config[k] for k in ("model", "data_dir", "recipe", "model_seed")}
        (spec.run_dir / "config.json").write_text(json.dumps(cfg))
        (spec.run_dir / "eval").mkdir(exist_ok=True)
        v = values[spec.name]
        ev = _fake_eval(**v) if isinstance(v, dict) else _fake_eval(*v)
        (spec.run_dir / "eval" / "evaluation.json").write_text(json.dumps(ev))


def test_mean_std():
    st = mean_std([1.0, 2.0, 4.0])
    assert st["mean"] == pytest.approx(7 / 3)
    assert st["std"] == pytest.approx(math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2))
    assert mean_std([3.0]) == {"mean": 3.0, "std": None, "n": 1, "values": [3.0]}


def test_summary_aggregates_fake_runs(tmp_path):
    arms, notes = expand_grid({"sigma": [0.5, 2.0], "objective": ["rlcd", "ce"]})
    specs = plan_runs(tmp_path / "data", "tiny-toy", arms, [0, 1, 2], 10, tmp_path / "out")
    values = {
        "rlcd-sigma0.5-s0": (1.0, 0.5, 1.1, 0.3), "rlcd-sigma0.5-s1": (2.0, 0.6, 1.3, 0.5),
        "rlcd-sigma0.5-s2": (3.0, 0.7, 1.2, 0.4),
        "rlcd-sigma2-s0": (4.0, 0.2, 2.0), "rlcd-sigma2-s1": (6.0, 0.4, 3.0),  # s2 missing: failed
        "ce-s0": (0.9, 0.8, 1.0), "ce-s1": (0.9, 0.8, 1.0), "ce-s2": (0.9, 0.8, 1.0),
    }
    _write_fake_runs(specs, values)
    summary = summarize_runs(arms, specs, notes=notes)
    arms_by = {a["name"]: a for a in summary["arms"]}
    assert list(arms_by) == ["rlcd-sigma0.5", "ce", "rlcd-sigma2"]
    m = arms_by["rlcd-sigma0.5"]["metrics"]
    assert m["raw.overall.nll"]["mean"] == pytest.approx(2.0) and m["raw.overall.nll"]["std"] == pytest.approx(1.0)
    assert m["raw.overall.nll"]["values"] == [1.0, 2.0, 3.0]
    assert m["calibrated.overall.nll"]["mean"] == pytest.approx(1.8)
    assert m["raw.overall.accuracy"]["mean"] == pytest.approx(0.6)
    assert m["temperature.choice"]["mean"] == pytest.approx(1.2) and m["temperature.choice"]["std"] == pytest.approx(0.1)
    assert m["raw.overall.posterior.bayes_gap"]["mean"] == pytest.approx(0.4)
    assert m["raw.overall.sharpness_gap"]["mean"] == pytest.approx(0.4)
    assert m["raw.group_macro.accuracy"]["n"] == 3
    s2 = arms_by["rlcd-sigma2"]
    assert s2["n_ok"] == 2 and summary["failed"] == ["rlcd-sigma2-s2"]
    assert s2["metrics"]["raw.overall.nll"]["mean"] == pytest.approx(5.0)
    assert s2["metrics"]["raw.overall.nll"]["std"] == pytest.approx(math.sqrt(2.0))
    assert "raw.overall.posterior.bayes_gap" not in s2["metrics"]
    ce = arms_by["ce"]
    assert ce["sigma"] is None and ce["metrics"]["raw.overall.nll"]["std"] == pytest.approx(0.0)
    assert arms_by["rlcd-sigma2"]["sigma"] == 2.0
    assert ce["temperature_fit_notes"]["ce-s0"] == {"noul": "3 calibration rows < 10: T = 1"}

    paths = write_summary(tmp_path / "out", summary)
    md = paths["md"].read_text()
    assert "| `rlcd-sigma0.5` | 3 | 0.600 ± 0.100 | 2.000 ± 1.000 |" in md
    assert "rlcd-sigma2-s2" in md and "Failed runs" in md and "Bayes gap" in md
    for key in ("fitted_T", "nll"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(paths["json"].read_text())["arms"][0]["metrics"]["raw.overall.nll"]["mean"] == 2.0


def test_metric_values_flattens_blocks():
    flat = metric_values(_fake_eval(1.5, 0.25, 1.7, 0.2))
    assert flat["raw.overall.nll"] == 1.5 and flat["calibrated.per_type.choice.nll"] == pytest.approx(1.35)
    assert flat["temperature.choice"] == 1.7 and flat["raw.overall.posterior.bayes_gap"] == 0.2


def test_run_sweep_skips_finished_runs_and_refuses_a_different_run(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("")
    out = tmp_path / "out"
    arms, _ = expand_grid({"sigma": [1.0], "objective": ["rlcd", "ce"]})
    specs = plan_runs(data, "tiny-toy", arms, [0, 1], 3, out)
    _write_fake_runs(specs, {s.name: (1.0 + i, 0.5, 1.0) for i, s in enumerate(specs)})
    # one run dir holds a run with another budget: it must not be summarised as this arm
    bad = next(s for s in specs if s.name == "ce-s1")
    cfg = json.loads((bad.run_dir / "config.json").read_text())
    cfg["recipe"]["steps"] = 99
    (bad.run_dir / "config.json").write_text(json.dumps(cfg))

    from rlcd.cli import app

    res = CliRunner().invoke(app, ["sweep", "--data", str(data), "--model", "tiny-toy", "--grid", "sigma=1",
                                   "--grid", "objective=rlcd,ce", "--seeds", "2", "--steps", "3", "--out", str(out)])
    assert res.exit_code == 1, res.output  # the refused run counts as failed
    summary = json.loads((out / "summary.json").read_text())
    status = {r["name"]: r["status"] for a in summary["arms"] for r in a["runs"]}
    assert status == {"rlcd-sigma1-s0": "skipped", "rlcd-sigma1-s1": "skipped", "ce-s0": "skipped",
                      "ce-s1": "failed"}
    ce = next(a for a in summary["arms"] if a["name"] == "ce")
    assert ce["metrics"]["raw.overall.nll"]["n"] == 1
    assert not (out / "logs").exists()  # nothing was trained
    assert "different run" in (out / "summary.md").read_text()


def test_dry_run_writes_worker_configs(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("")
    res = run_sweep(data, "tiny-toy", GRID, 2, 5, tmp_path / "out", {"eval_every": 2}, dry_run=True)
    assert len(res["commands"]) == 8
    assert all(" -m rlcd.cli sweep-worker --config " in c for c in res["commands"])
    cfg = json.loads((tmp_path / "out" / "configs" / "ce-s1.json").read_text())
    assert cfg["recipe"]["objective"] == "ce" and cfg["recipe"]["eval_every"] == 2 and cfg["recipe"]["seed"] == 1
    assert cfg["dtype"] == "auto"
    assert not (tmp_path / "out" / "runs").exists()


def test_cli_dry_run_records_the_dtype_and_prints_worker_commands(tmp_path):
    from rlcd.cli import app

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("")
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["sweep", "--data", str(data), "--out", str(out), "--model", "tiny-toy",
                                   "--grid", "sigma=1,2", "--seeds", "1", "--steps", "4", "--dtype", "bfloat16",
                                   "--dry-run"])
    assert res.exit_code == 0, res.output
    commands = res.stdout.strip().splitlines()
    assert len(commands) == 2 and all(c.endswith(".json") and " sweep-worker --config " in c for c in commands)
    for name in ("sigma1-s0", "sigma2-s0"):
        assert json.loads((out / "configs" / f"{name}.json").read_text())["dtype"] == "bfloat16"


def test_sweep_user_errors_are_one_line(tmp_path):
    """Bad grids, seeds, dtypes, data dirs and worker configs: exit 2, one line, no traceback, nothing run."""
    from rlcd.cli import app

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("")
    out = tmp_path / "out"
    base = ["sweep", "--data", str(data), "--out", str(out), "--model", "tiny-toy", "--steps", "2", "--dry-run"]
    cases = [
        (base + ["--grid", "sgima=1"], "sgima"),
        (base + ["--grid", "sigma"], "KEY=V1,V2"),
        (base + ["--grid", "seed=0,1"], "cannot be a grid key"),
        (base + ["--grid", "sigma=0"], "sigma must be > 0"),
        (base + ["--seeds", "three"], "--seeds"),
        (base + ["--recipe", "eval_every=2.5"], "eval_every"),
        (base + ["--dtype", "float16"], "--dtype"),
        (["sweep", "--data", str(tmp_path), "--out", str(out), "--dry-run"], "rlcd data prepare"),
        (["sweep-worker", "--config", str(tmp_path / "nope.json")], "no such sweep run config"),
    ]
    for args, needle in cases:
        res = CliRunner().invoke(app, args)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.exit_code == 2 and 1 <= len(lines) <= 2 and needle in res.stderr, (args, res.output)
        assert "Traceback" not in res.output
    assert not (out / "configs").exists()
    assert "sweep-worker" not in CliRunner().invoke(app, ["--help"]).stdout  # hidden: launched by `rlcd sweep`


# ----------------------------------------------------------------------------------------------
# one real sweep (one process per run)


@pytest.mark.slow
def test_small_real_sweep(tmp_path, monkeypatch):
    from rlcd.data.io import write_jsonl
    from rlcd.data.prepare import prepare
    from rlcd.data.synth import generate

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    write_jsonl(tmp_path / "synth.jsonl", generate(40, seed=3))
    prepare([tmp_path / "synth.jsonl"], tmp_path / "data", seed=0)
    out = tmp_path / "sweep"
    summary = run_sweep(tmp_path / "data", "tiny-toy", {"sigma": [1.0], "objective": ["rlcd", "ce"]}, 1, 2, out,
                        progress=False)
    assert summary["failed"] == [], "\n".join(p.read_text()[-2000:] for p in (out / "logs").glob("*.log"))
    assert [a["name"] for a in summary["arms"]] == ["rlcd-sigma1", "ce"]
    for a in summary["arms"]:
        assert a["n_ok"] == 1 and a["runs"][0]["status"] == "done"
        m = a["metrics"]
        assert 0.0 <= m["raw.overall.accuracy"]["mean"] <= 1.0 and m["raw.overall.nll"]["mean"] > 0
        assert m["raw.overall.posterior.bayes_gap"]["n"] == 1 and "temperature.choice" in m
        cfg = json.loads((out / "runs" / f"{a['name']}-s0" / "config.json").read_text())
        assert cfg["recipe"]["steps"] == 2 and cfg["recipe"]["eval_every"] == 1
        assert cfg["recipe"]["objective"] == a["objective"]
    assert (out / "logs" / "ce-s0.log").is_file()
    for a in summary["arms"]:  # evaluated without export/ (a sweep reads eval/ only); the log says how to get one
        run_dir = out / "runs" / f"{a['name']}-s0"
        assert (run_dir / "eval" / "evaluation.json").is_file() and not (run_dir / "export").exists()
        assert f"`rlcd export {run_dir.resolve()}` writes export/" in (out / "logs" / f"{a['name']}-s0.log").read_text()
    for name in ("summary.json", "summary.md", "fitted_T_vs_sigma.png", "nll_vs_sigma.png"):
        assert (out / name).stat().st_size > 0, name
    # a second call finds everything done and trains nothing
    again = run_sweep(tmp_path / "data", "tiny-toy", {"sigma": [1.0], "objective": ["rlcd", "ce"]}, 1, 2, out,
                      progress=False)
    assert [r["status"] for a in again["arms"] for r in a["runs"]] == ["skipped", "skipped"]
    assert again["arms"][0]["metrics"] == summary["arms"][0]["metrics"]


def test_in_process_sweep_resumes_an_interrupted_run(tmp_path):
    """A run killed after its first update is resumed from checkpoints/last, then evaluated."""
    from rlcd.data.io import write_jsonl
    from rlcd.data.prepare import prepare
    from rlcd.data.synth import generate
    from rlcd.train import train

    write_jsonl(tmp_path / "synth.jsonl", generate(40, seed=3))
    prepare([tmp_path / "synth.jsonl"], tmp_path / "data", seed=0)
    out = tmp_path / "sweep"
    grid = {"objective": ["ce"]}
    (spec,) = plan_runs(tmp_path / "data", "tiny-toy", expand_grid(grid)[0], [0], 2, out, dtype="float32")
    train(spec.run_dir, data_dir=tmp_path / "data", model="tiny-toy", recipe=Recipe.from_dict(spec.config["recipe"]),
          progress=False, stop_after=1, dtype="float32")
    assert not spec.evaluation_path.exists()
    log = spec.run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    log.write_text("".join(json.dumps({**r, "before_kill": True}) + "\n" for r in rows))
    # the same run under another dtype is a different run: refused, nothing trained
    refused = run_sweep(tmp_path / "data", "tiny-toy", grid, 1, 2, out, in_process=True, progress=False,
                        dtype="bfloat16")
    assert refused["failed"] == ["ce-s0"] and "dtype 'float32' != 'bfloat16'" in refused["arms"][0]["runs"][0]["error"]
    summary = run_sweep(tmp_path / "data", "tiny-toy", grid, 1, 2, out, in_process=True, progress=False,
                        dtype="float32", export=True)
    assert summary["failed"] == [] and summary["arms"][0]["runs"][0]["status"] == "done"
    assert summary["config"]["export"] is True and (spec.run_dir / "export" / "hf" / "config.json").is_file()
    assert summary["config"]["dtype"] == "float32" and json.loads(spec.run.config_path.read_text())["dtype"] == "float32"
    assert json.loads(spec.evaluation_path.read_text())["meta"]["placement"] == {"device": "cpu", "dtype": "float32"}
    train_rows = [json.loads(x) for x in log.read_text().splitlines() if '"train"' in x]
    # continued from the checkpoint (the pre-kill line is kept), not restarted
    assert [(r["step"], r.get("before_kill", False)) for r in train_rows] == [(1, True), (2, False)]
    assert spec.evaluation_path.is_file() and (out / "summary.md").is_file()


# ----------------------------------------------------------------------------------------------
# issue 23: every diagnostics row kept, ce arms deduplicated over every RLCD field, boolean arms


def test_a_600_step_sweep_keeps_every_diagnostics_row(tmp_path):
    """Scaled to 600 updates, log_every (2) does not divide diagnostics_every (17): every diagnostics
    update still writes a train row, so none of the 35 diagnostics rows is lost."""
    from rlcd.train import log_due

    (spec,) = plan_runs(tmp_path / "d", "tiny-toy", expand_grid({"sigma": [1.0]})[0], [0], 600, tmp_path / "o")
    r = Recipe.from_dict(spec.config["recipe"])
    assert r.diagnostics_every % r.log_every != 0
    diag_steps = [s for s in range(1, 601) if s % r.diagnostics_every == 0]
    assert len(diag_steps) == 600 // r.diagnostics_every and all(log_due(s, r) for s in diag_steps)
    assert [s for s in range(1, 601) if log_due(s, r)] == sorted(
        set(range(r.log_every, 601, r.log_every)) | set(diag_steps) | {600})
    off = Recipe(steps=600, log_every=4, diagnostics_every=0)
    assert [s for s in range(1, 601) if log_due(s, off)] == list(range(4, 601, 4))


def test_a_short_train_logs_every_diagnostics_update(tmp_path):
    from conftest import synth_processed

    from rlcd.train import train

    data = synth_processed(tmp_path, 30, seed=3)
    recipe = Recipe(steps=4, log_every=3, diagnostics_every=2, eval_every=4, checkpoint_every=4, batch_size=2,
                    grad_accum=1, dev_cap=4)
    train(tmp_path / "run", data_dir=data, model="tiny-toy", recipe=recipe, progress=False)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["event"] == "train"]
    assert [r["step"] for r in train_rows] == [2, 3, 4]
    assert [r["step"] for r in train_rows if "adv_std" in r and "grad_cosine" in r] == [2, 4]


def test_ce_arms_collapse_over_every_field_ce_ignores():
    grid = {"objective": ["rlcd", "ce"], "w_spherical": [0.0, 0.75], "n_perturbations": [2, 4],
            "advantage_norm": ["batch", "type"], "sigma_end": [None, 0.1], "w_rps": [0.0, 1.0]}
    arms, notes = expand_grid(grid)
    ce = [a for a in arms if a.objective == "ce"]
    assert len(ce) == 1 and ce[0].params == {"objective": "ce"} and len(ce[0].merged) == 32
    assert len([a for a in arms if a.objective == "rlcd"]) == 32
    (note,) = [n for n in notes if "'ce'" in n]
    for k in ("advantage_norm", "n_perturbations", "sigma_end", "w_rps", "w_spherical"):
        assert k in note
    assert "32 grid points are run once per seed and shown once in the summary" in note
    # a field ce does read still makes separate ce arms
    arms, _ = expand_grid({"objective": ["ce"], "lr_head": [1e-4, 5e-4], "w_rps": [0.0, 1.0]})
    assert [a.params for a in arms] == [{"objective": "ce", "lr_head": 1e-4}, {"objective": "ce", "lr_head": 5e-4}]
    # one ce run per seed, and the summary lists the arm once
    specs = plan_runs("d", "tiny-toy", expand_grid(grid)[0], [0, 1], 10, "o")
    assert sorted(s.name for s in specs if s.arm == "ce") == ["ce-s0", "ce-s1"] and len(specs) == 66
    summary = summarize_runs(expand_grid(grid)[0], specs, notes=notes)
    assert [a["name"] for a in summary["arms"]].count("ce") == 1
    assert "shown once in the summary" in "\n".join(summary["notes"])


def test_a_boolean_recipe_field_is_an_arm_like_any_other(monkeypatch):
    """`--grid head_only=true,false` (a bool field; stand-in when the recipe has none yet)."""
    import rlcd.recipe as recipe_mod

    if not any(t is bool for t in recipe_mod.field_types().values()):
        real = recipe_mod.field_types
        monkeypatch.setattr(recipe_mod, "field_types", lambda: {**real(), "head_only": bool})
    key = next(k for k, t in recipe_mod.field_types().items() if t is bool)
    grid = parse_grid([f"{key}=true,false,1", "objective=rlcd,ce"])
    assert grid == {key: [True, False, True], "objective": ["rlcd", "ce"]}
    assert all(type(v) is bool for v in grid[key])
    arms, notes = expand_grid(grid)
    assert [a.name for a in arms] == [f"rlcd-{key}true", f"ce-{key}true", f"rlcd-{key}false", f"ce-{key}false"]
    assert [a.params[key] for a in arms] == [True, True, False, False]
    assert any("repeated values" in n for n in notes)
    with pytest.raises(OptionError, match=f"--grid {key}=maybe: not a valid bool"):
        parse_grid([f"{key}=maybe"])


def test_a_sweep_whose_dev_and_test_rankings_differ_is_summarised_by_dev(tmp_path):
    """sigma 0.5 is best on dev, sigma 2 on test: the summary, its table, the CLI line and the plot
    choose sigma 0.5; the test numbers sit beside, labelled not for choosing."""
    arms, notes = expand_grid({"sigma": [0.5, 2.0], "objective": ["rlcd", "ce"]})
    specs = plan_runs(tmp_path / "data", "tiny-toy", arms, [0, 1], 10, tmp_path / "out")
    dev_test = {"rlcd-sigma0.5": (1.0, 3.0), "rlcd-sigma2": (2.0, 1.0), "ce": (3.0, 2.0)}
    values = {s.name: {"nll": dev_test[s.arm][0] + 0.1 * s.seed, "acc": 0.5, "t_choice": 1.0,
                       "test_nll": dev_test[s.arm][1] + 0.1 * s.seed} for s in specs}
    _write_fake_runs(specs, values)
    summary = summarize_runs(arms, specs, notes=notes)
    rk = summary["ranking"]
    assert summary["choose_on"] == "dev" and rk["metric"] == "calibrated.overall.nll"
    assert rk["order"] == ["rlcd-sigma0.5", "rlcd-sigma2", "ce"] and rk["best"] == "rlcd-sigma0.5"
    by = {a["name"]: a for a in summary["arms"]}
    assert by["rlcd-sigma0.5"]["metrics"]["calibrated.overall.nll"]["mean"] == pytest.approx(0.9 * 1.05)
    assert by["rlcd-sigma0.5"]["metrics_beside"]["calibrated.overall.nll"]["mean"] == pytest.approx(0.9 * 3.05)
    # on test the order would differ; asked explicitly, it is the test order
    on_test = summarize_runs(arms, specs, choose_on="test")["ranking"]
    assert on_test["order"] == ["rlcd-sigma2", "ce", "rlcd-sigma0.5"] and on_test["beside"] == "dev"
    assert summarize_runs(arms, specs, rank_by="raw.overall.accuracy")["ranking"]["higher_is_better"] is True
    with pytest.raises(ValueError, match="rank_by"):
        summarize_runs(arms, specs, rank_by="raw.overall.sharpness_gap")

    paths = write_summary(tmp_path / "out", summary)
    md = paths["md"].read_text()
    assert "Best on dev: **`rlcd-sigma0.5`**" in md
    assert "| 1 | `rlcd-sigma0.5` | 2 | 0.945 ± 0.064 | 2.745 ± 0.064 |" in md
    assert "test (not for choosing)" in md and "## Calibrated probabilities (overall), test (not for choosing)" in md
    assert md.index("## Choice: on dev") < md.index("## Raw probabilities (overall), dev")

    # a run evaluated without a dev split is left out of the dev numbers, with a note
    ev_path = specs[0].evaluation_path
    ev = json.loads(ev_path.read_text())
    del ev["other_splits"]["dev"]
    ev_path.write_text(json.dumps(ev))
    again = summarize_runs(arms, specs)
    first = next(a for a in again["arms"] if a["name"] == specs[0].arm)
    assert first["metrics"]["calibrated.overall.nll"]["n"] == 1
    assert first["metrics_beside"]["calibrated.overall.nll"]["n"] == 2
    assert any(specs[0].name in n and "no dev split" in n for n in again["notes"])


def test_sweep_cli_chooses_on_dev_and_refuses_a_bad_rank_key(tmp_path):
    from rlcd.cli import app

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("")
    out = tmp_path / "out"
    arms, _ = expand_grid({"sigma": [0.5, 2.0]})
    specs = plan_runs(data, "tiny-toy", arms, [0], 3, out)
    _write_fake_runs(specs, {"sigma0.5-s0": {"nll": 1.0, "acc": 0.5, "t_choice": 1.0, "test_nll": 3.0},
                             "sigma2-s0": {"nll": 2.0, "acc": 0.5, "t_choice": 1.0, "test_nll": 1.0}})
    base = ["sweep", "--data", str(data), "--model", "tiny-toy", "--grid", "sigma=0.5,2", "--seeds", "1",
            "--steps", "3", "--out", str(out)]
    res = CliRunner().invoke(app, base)
    assert res.exit_code == 0, res.output
    assert "best on dev by calibrated.overall.nll: sigma0.5" in res.stdout and "not for choosing" in res.stdout
    assert json.loads((out / "summary.json").read_text())["ranking"]["best"] == "sigma0.5"
    res = CliRunner().invoke(app, base + ["--choose-on", "test"])
    assert res.exit_code == 0 and "best on test by calibrated.overall.nll: sigma2" in res.stdout
    for bad, needle in ((["--rank-by", "nll"], "--rank-by"), (["--choose-on", "calibration"], "--choose-on")):
        res = CliRunner().invoke(app, base + bad)
        assert res.exit_code == 2 and needle in res.stderr and "Traceback" not in res.output, res.output


def test_summary_names_runs_that_selected_the_untrained_step_0(tmp_path):
    arms, notes = expand_grid({"sigma": [0.5], "objective": ["rlcd"]})
    specs = plan_runs(tmp_path / "data", "tiny-toy", arms, [0, 1], 10, tmp_path / "out")
    _write_fake_runs(specs, {s.name: (1.0, 0.5, 1.1) for s in specs})
    for spec, step in zip(specs, (0, 7)):
        ev = json.loads(spec.evaluation_path.read_text())
        ev.setdefault("meta", {})["selected_step"] = step
        spec.evaluation_path.write_text(json.dumps(ev))
    summary = summarize_runs(arms, specs, notes=notes)
    assert summary["arms"][0]["selected_step_0"] == [specs[0].name]
    md = write_summary(tmp_path / "out", summary)["md"].read_text()
    assert "## Runs that selected the untrained step 0" in md
    assert f"`{specs[0].name}`" in md.split("## Runs that selected the untrained step 0")[1].split("## Runs\n")[0]
    assert f"`{specs[1].name}`" not in md.split("## Runs that selected the untrained step 0")[1].split("## Runs\n")[0]
