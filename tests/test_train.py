"""The training loop on a toy-vocabulary tiny Qwen3.5: resume equivalence, extension, NaN stop,
atomic checkpoints, refused resumes, and DDP under torchrun (gloo, 2 ranks)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import ddp_worker
from conftest import synth_processed, torchrun

from rlcd import checkpoint as ckpt
from rlcd.errors import UserError
from rlcd.recipe import Recipe
from rlcd.train import ResumeRefused, TrainingDiverged, train

torch.set_num_threads(1)
HERE = Path(__file__).parent
FAST = dict(eval_every=2, checkpoint_every=1, log_every=1, diagnostics_every=2)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return synth_processed(tmp_path_factory.mktemp("data"), 60, seed=3)


def _train(run, data_dir, **kw):
    recipe = Recipe(steps=kw.pop("steps", 4), **{**FAST, **kw.pop("recipe", {})})
    return train(run, data_dir=data_dir, model="tiny-toy", recipe=recipe, progress=False, **kw)


def _weights(run, which="last"):
    return ckpt.load(Path(run) / "checkpoints" / which)["weights"]


def _losses(run):
    rows = [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["ce_loss"], r["policy_loss"]) for r in rows if r["event"] == "train"]


def _evals(run):
    rows = [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["dev_macro_accuracy"]) for r in rows if r["event"] == "eval"]


def test_run_directory_layout(tmp_path, data_dir):
    run = tmp_path / "run"
    state = _train(run, data_dir, steps=2)
    assert state["step"] == 2
    config = json.loads((run / "config.json").read_text())
    samples = json.loads((run / "samples.json").read_text())
    assert config["recipe"]["steps"] == 2 and config["decay_horizon"] == 2
    assert {"torch", "transformers", "peft"} <= set(config["versions"])
    assert set(samples["files"]) >= {"train.jsonl", "dev.jsonl"}
    assert all(len(ids) <= 6000 for ids in samples["train"].values())
    for which in ("last", "best"):
        loaded = ckpt.load(run / "checkpoints" / which)
        assert {"step", "best_score", "recipe", "consumed"} <= set(loaded["state"])
        assert loaded["optimizer"]["state"], "optimizer moments are saved"
    assert _evals(run)[0][0] == 0 and _evals(run)[-1][0] == 2  # step 0 and the last update
    train_rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert {"lr_lora", "lr_head", "grad_norm", "tokens_per_s", "advantage_std", "per_type"} <= set(train_rows[-1])
    _check_diagnostics(run)


DIAG_KEYS = {"grad_cosine", "grad_norm_ratio", "adv_std", "adv_extreme_share"}


def _check_diagnostics(run):
    """Training rows at the diagnostics cadence and every eval row carry the issue-16 diagnostics."""
    rows = [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["event"] == "train"]
    diag = [r for r in train_rows if "adv_std" in r]
    assert diag and all(r["step"] % 2 == 0 for r in diag)  # diagnostics_every = 2
    assert all(not (DIAG_KEYS & set(r)) for r in train_rows if r["step"] % 2)
    types = set(diag[-1]["per_type"])
    for r in diag:
        assert DIAG_KEYS <= set(r)
        assert 0.0 <= r["adv_extreme_share"] <= 1.0 and r["adv_std"] >= 0.0
        for t in types:
            for comp in ("log", "spherical") + (("rps",) if t == "score" else ()):
                assert r[f"reward/{t}/{comp}/std"] >= 0.0
                assert math.isfinite(r[f"reward/{t}/{comp}/mean"])
        assert "reward/choice/rps/mean" not in r  # RPS is in the reward of score rows only
    _check_objective_per_type(train_rows, rlcd=True)
    for ev in [r for r in rows if r["event"] == "eval"]:
        assert {"dev_nll", "dev_brier", "dev_ece"} <= set(ev)
        assert ev["dev_nll"] > 0 and 0 <= ev["dev_ece"] <= 1 and 0 <= ev["dev_brier"] <= 2
        types = {k.split("/", 1)[1] for k in ev if k.startswith("dev_nll/")}
        assert types and all(0.0 <= ev[f"dev_accuracy/{t}"] <= 1.0 for t in types)  # per type at every evaluation
    return diag


def _check_objective_per_type(train_rows, *, rlcd: bool):
    """Every train row splits CE by type (its row-weighted mean is ce_loss: every micro-batch holds 8 rows); rows
    at the diagnostics cadence (every second update here) also split the policy term, the reward and the logit
    gradient (shares summing to 1), and no other row does."""
    cadence = ("policy_loss", "reward", "grad_norm", "grad_share") if rlcd else ("grad_norm", "grad_share")
    for r in train_rows:
        types = set(r["per_type"])
        n = {t: b["n"] for t, b in r["per_type"].items()}
        assert {k.split("/")[1] for k in r if k.startswith("ce/")} == types
        assert sum(n[t] * r[f"ce/{t}"] for t in types) / sum(n.values()) == pytest.approx(r["ce_loss"], rel=1e-5)
        split = {k for k in r if k.split("/")[0] in cadence and "/" in k and k.count("/") < 3}
        if r["step"] % 2:
            assert not split, r["step"]
            continue
        want = {f"{k}/{t}" for k in cadence if k != "reward" for t in types}
        want |= {f"reward/{t}/{s}" for t in types for s in ("mean", "std")} if rlcd else set()
        assert split == want, r["step"]
        assert sum(r[f"grad_share/{t}"] for t in types) == pytest.approx(1.0, abs=1e-9)
        assert all(r[f"grad_norm/{t}"] > 0 for t in types)
        if rlcd:
            assert sum(n[t] * r[f"reward/{t}/mean"] for t in types) / sum(n.values()) == pytest.approx(
                r["reward_mean"], rel=1e-5)
            assert sum(n[t] * r[f"policy_loss/{t}"] for t in types) / sum(n.values()) == pytest.approx(
                r["policy_loss"], rel=1e-4, abs=1e-6)


def test_ce_objective_logs_the_per_type_split_without_policy_or_reward(tmp_path, data_dir):
    run = tmp_path / "run"
    _train(run, data_dir, steps=2, recipe={"objective": "ce"})
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert [r["step"] for r in rows] == [1, 2] and len(rows[-1]["per_type"]) == 3
    _check_objective_per_type(rows, rlcd=False)
    assert not [k for r in rows for k in r if k.startswith(("policy_loss/", "reward/"))]


def test_resume_reproduces_uninterrupted_run(tmp_path, data_dir):
    full, part = tmp_path / "full", tmp_path / "part"
    _train(full, data_dir, steps=4)
    _train(part, data_dir, steps=4, stop_after=2)
    assert ckpt.load(part / "checkpoints" / "last")["state"]["step"] == 2
    # a stale line past the checkpoint (as a kill after logging would leave) is trimmed on resume
    with open(part / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"event": "train", "step": 3, "loss": 99.0, "ce_loss": 0, "policy_loss": 0}) + "\n")
    train(part, resume=True, progress=False)
    a, b = _weights(full), _weights(part)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert _losses(full) == _losses(part)
    assert _evals(full) == _evals(part)
    assert ckpt.load(full / "checkpoints" / "best")["state"]["best_step"] == \
        ckpt.load(part / "checkpoints" / "best")["state"]["best_step"]


def test_extension_keeps_horizon_and_moments(tmp_path, data_dir):
    run = tmp_path / "run"
    _train(run, data_dir, steps=3)
    moments = ckpt.load(run / "checkpoints" / "last")["optimizer"]["state"]
    train(run, resume=True, steps=5, progress=False)
    config = json.loads((run / "config.json").read_text())
    assert config["recipe"]["steps"] == 5 and config["decay_horizon"] == 3
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    lr = {r["step"]: r["lr_head"] for r in rows}
    assert lr[4] == pytest.approx(0.1 * 5e-4) and lr[5] == pytest.approx(0.1 * 5e-4)  # the 10% floor
    after = ckpt.load(run / "checkpoints" / "last")["optimizer"]["state"]
    assert after[0]["step"] == moments[0]["step"] + 2  # Adam moments continued, not reset
    with pytest.raises(ResumeRefused, match="smaller"):
        train(run, resume=True, steps=4, progress=False)


def test_nan_stops_before_the_optimizer_step(tmp_path, data_dir):
    run = tmp_path / "run"
    _train(run, data_dir, steps=2)
    before = _weights(run)
    from rlcd.objectives import ce_loss

    def poisoned(logits, batch, index):
        loss, stats = ce_loss(logits, batch.cand_mask, batch.target)
        return loss * float("nan"), {**stats, "loss": float("nan")}

    with pytest.raises(TrainingDiverged, match="update 3"):
        train(run, resume=True, steps=4, progress=False, objective_fn=poisoned)
    after = ckpt.load(run / "checkpoints" / "last")
    assert after["state"]["step"] == 2
    for k in before:
        assert torch.equal(before[k], after["weights"][k])


def test_checkpoint_write_killed_half_way_keeps_previous(tmp_path, data_dir, monkeypatch):
    run = tmp_path / "run"
    _train(run, data_dir, steps=2)
    real = ckpt.save_file

    def dies(*a, **k):
        real(*a, **k)
        raise KeyboardInterrupt("killed during the checkpoint write")

    monkeypatch.setattr(ckpt, "save_file", dies)
    with pytest.raises(KeyboardInterrupt):
        train(run, resume=True, steps=3, progress=False)
    monkeypatch.undo()
    assert ckpt.load(run / "checkpoints" / "last")["state"]["step"] == 2
    train(run, resume=True, steps=3, progress=False)
    assert ckpt.load(run / "checkpoints" / "last")["state"]["step"] == 3


def test_resume_refuses_changed_data(tmp_path, data_dir):
    import shutil

    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    run = tmp_path / "run"
    _train(run, copy, steps=1)
    lines = (copy / "train.jsonl").read_text().splitlines()
    (copy / "train.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(ResumeRefused, match="data files changed.*train.jsonl"):
        train(run, resume=True, steps=2, progress=False)


def test_new_run_refuses_existing_dir(tmp_path, data_dir):
    run = tmp_path / "run"
    _train(run, data_dir, steps=1)
    with pytest.raises(UserError, match="--resume"):
        _train(run, data_dir, steps=1)


@pytest.mark.slow
def test_ddp_first_step_gradients_match_single_process(tmp_path, data_dir):
    """2 gloo ranks x 4 micro-batches == 1 process x 8 micro-batches (the same indices), within 1e-5."""
    worker = str(HERE / "ddp_worker.py")
    torchrun(worker, "grads", str(data_dir), str(tmp_path), cwd=tmp_path)
    ddp_worker.grads(data_dir, tmp_path)  # the one-process reference, in this process
    ddp, ref = torch.load(tmp_path / "grads-world2.pt"), torch.load(tmp_path / "grads-world1.pt")
    assert ddp.keys() == ref.keys() and len(ref) > 10
    assert any(float(g.abs().max()) > 0 for g in ref.values())
    for name in ref:
        torch.testing.assert_close(ddp[name], ref[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_ddp_keeps_the_recipe_batch_and_matches_one_process(tmp_path, data_dir):
    """2 gloo ranks run 2 of the 4 micro-batches each: 32 examples per update, the same weights as 1 process."""
    run = tmp_path / "run"
    out = torchrun(str(HERE / "ddp_worker.py"), "train", str(data_dir), str(run), cwd=tmp_path)
    config = json.loads((run / "config.json").read_text())
    assert config["world_size"] == 2
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert [r["step"] for r in rows] == [1, 2, 3], "each update logged once (rank 0 alone writes)"
    assert [r["examples"] for r in rows] == [32, 32, 32], "the global batch stays 8 x 4"
    consumed = ckpt.load(run / "checkpoints" / "last")["state"]["consumed"]
    assert sum(consumed.values()) == 3 * 32, "every rank's examples are counted"
    assert not list(run.glob("checkpoints/.tmp-*")), out.stdout[-2000:]
    assert out.stdout.count("group after train: ended") == 2, out.stdout[-2000:]

    single = tmp_path / "single"
    ddp_worker.run(data_dir, single)
    one = [json.loads(x) for x in (single / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert [r["examples"] for r in one] == [32, 32, 32]
    # the reward diagnostics are pooled over ranks: the 2-rank update reports what one process sees
    prefixes = ("reward/", "adv_std", "adv_extreme", "ce/", "policy_loss/", "grad_norm/", "grad_share/")
    pooled = [k for k in one[1] if k.startswith(prefixes)]
    assert pooled and set(pooled) == {k for k in rows[1] if k.startswith(prefixes)}
    assert "grad_share/choice" in pooled
    for k in pooled:
        assert rows[1][k] == pytest.approx(one[1][k], rel=1e-4, abs=1e-6), k
    # so are the per-type entropy / max p / effective K: every rank's rows, not rank 0's
    assert rows[1]["per_type"].keys() == one[1]["per_type"].keys()
    for t, b in one[1]["per_type"].items():
        assert rows[1]["per_type"][t]["n"] == b["n"], t
        for k in ("entropy", "max_prob", "effective_candidates"):
            assert rows[1]["per_type"][t][k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (t, k)
    w2 = ckpt.load(run / "checkpoints" / "last")["weights"]
    w1 = ckpt.load(single / "checkpoints" / "last")["weights"]
    assert w1.keys() == w2.keys() and len(w1) > 10
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], atol=1e-5, rtol=1e-5, msg=name)

    # the stream does not depend on the world size, so one process may resume a 2-process run
    train(run, resume=True, steps=4, progress=False)
    sessions = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"session"' in x]
    assert [s["world_size"] for s in sessions] == [2, 1]


def test_recipe_override_reaches_the_model_and_is_recorded(tmp_path, data_dir):
    """`rlcd train --recipe lora_rank=4` trains rank-4 LoRA matrices and config.json says so."""
    from typer.testing import CliRunner

    from rlcd.cli import app

    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["train", str(run), "--data", str(data_dir), "--model", "tiny-toy", "--steps", "1",
                                   "--recipe", "lora_rank=4", "--recipe", "lora_alpha=8", "--recipe", "eval_every=1",
                                   "--device", "cpu"])
    assert res.exit_code == 0, res.output
    notice = next(ln for ln in res.stderr.splitlines() if "deviates from the pinned recipe" in ln)
    assert "lora_rank=4 (pinned 8)" in notice and "lora_alpha=8 (pinned 16)" in notice
    config = json.loads((run / "config.json").read_text())
    assert config["recipe"]["lora_rank"] == 4 and config["recipe"]["lora_alpha"] == 8
    assert config["recipe_deviations"]["lora_rank"] == {"value": 4, "pinned": 8}
    weights = _weights(run)
    a = {k: v for k, v in weights.items() if "lora_A" in k}
    b = {k: v for k, v in weights.items() if "lora_B" in k}
    assert a and all(v.shape[0] == 4 for v in a.values()) and all(v.shape[1] == 4 for v in b.values())
    session = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert session["event"] == "session" and session["device"] == "cpu" and session["dtype"] == "float32"
    # the export rebuilds the same rank from config (build_model reads the recipe)
    from rlcd.model.build import build_model

    model = build_model(config)
    assert model.lora_config["r"] == 4 and model.lora_config["alpha"] == 8


def test_arms_reach_the_objective(tmp_path, data_dir, monkeypatch):
    """sigma_end anneals the sigma each update passes, n_perturbations sets G of the drawn noise, the reward
    weights and the per-type advantage std reach rlcd_loss and the diagnostics alike."""
    import rlcd.train.session as T

    calls = {"loss": [], "samples": [], "grad": [], "rows": []}

    def spy(name, real):
        def wrapper(*args, **kw):
            calls[name].append((kw["sigma"], kw["noise"].shape[0], kw["w_spherical"], kw["w_rps"],
                                kw["norm_groups"] is not None))
            return real(*args, **kw)
        return wrapper

    monkeypatch.setattr(T, "rlcd_loss", spy("loss", T.rlcd_loss))
    monkeypatch.setattr(T, "reward_samples", spy("samples", T.reward_samples))
    monkeypatch.setattr(T, "gradient_diagnostics", spy("grad", T.gradient_diagnostics))
    real_rows = T.row_terms  # the per-type split: off the diagnostics cadence it needs no noise
    full_rows = spy("rows", real_rows)
    monkeypatch.setattr(T, "row_terms", lambda *a, **kw: (full_rows if kw["full"] else real_rows)(*a, **kw))
    arm = {"sigma": 0.4, "sigma_end": 0.1, "n_perturbations": 8, "w_spherical": 0.5, "w_rps": 2.0,
           "advantage_norm": "type", "grad_accum": 2}
    _train(tmp_path / "run", data_dir, steps=4, recipe=arm)
    r = Recipe(**arm, steps=4)
    expected = [r.sigma_at(step, 4) for step in range(4) for _ in range(2)]  # 2 micro-batches per update
    assert [c[0] for c in calls["loss"]] == pytest.approx(expected, abs=1e-15)
    assert expected[0] == 0.4 and expected[-1] == pytest.approx(0.175)
    assert {c[1:] for c in calls["loss"] + calls["samples"] + calls["grad"] + calls["rows"]} == {(8, 0.5, 2.0, True)}
    assert [c[0] for c in calls["samples"]] == pytest.approx([r.sigma_at(s, 4) for s in (1, 3) for _ in range(2)])
    assert [c[0] for c in calls["rows"]] == [c[0] for c in calls["samples"]]
    assert len(calls["grad"]) == 2  # one micro-batch per diagnostics update


def test_arm_flags_train_and_are_recorded(tmp_path, data_dir):
    """`rlcd train --recipe sigma_end=0.1 --recipe n_perturbations=8` trains, records the arm and logs the diagnostics."""
    from typer.testing import CliRunner

    from rlcd.cli import app

    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["train", str(run), "--data", str(data_dir), "--model", "tiny-toy", "--steps", "2",
                                   "--recipe", "sigma_end=0.1", "--recipe", "n_perturbations=8",
                                   "--recipe", "diagnostics_every=2", "--recipe", "eval_every=2",
                                   "--recipe", "log_every=1", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "sigma_end=0.1 (pinned None)" in res.stderr and "n_perturbations=8 (pinned 4)" in res.stderr
    config = json.loads((run / "config.json").read_text())
    assert config["recipe"]["sigma_end"] == 0.1 and config["recipe"]["n_perturbations"] == 8
    assert config["recipe_deviations"]["n_perturbations"] == {"value": 8, "pinned": 4}
    _check_diagnostics(run)


def test_selection_compares_dev_accuracy_exactly_not_by_ulp():
    from rlcd.train import improves_on

    dev = {"a": [None] * 6, "b": [None] * 9, "c": [None] * 4}

    def evaluation(correct):
        per_group = {g: c / len(dev[g]) for g, c in zip("abc", correct)}
        return per_group, sum(per_group.values()) / len(per_group)

    first, best = evaluation((0, 6, 2))  # macro 7/18
    same, macro = evaluation((1, 0, 4))  # also exactly 7/18, one ulp above as a float
    assert macro > best  # what the float comparison used to select
    assert improves_on(first, dev, None)
    assert not improves_on(same, dev, best)
    assert not improves_on(first, dev, best)
    assert improves_on(evaluation((1, 6, 2))[0], dev, best)
    assert not improves_on(evaluation((0, 5, 2))[0], dev, best)


def test_the_progress_line_says_when_the_dev_subset_is_empty():
    """An empty dev subset scores a macro 0 that selects nothing: the progress line says so instead of "dev 0.0000"."""
    from rlcd.train.loop import progress_info

    stats = {"loss": 1.0, "ce_loss": 0.5}
    assert progress_info(stats, 0.0, dev_rows=0) == "loss 1.0000 ce 0.5000 no dev rows"
    assert progress_info(stats, 0.25, dev_rows=3) == "loss 1.0000 ce 0.5000 dev 0.2500"
    assert progress_info(stats, None, dev_rows=3) == "loss 1.0000 ce 0.5000 dev -"


def test_resume_removes_the_temp_dir_of_a_checkpoint_write_killed_earlier(tmp_path, data_dir):
    """A SIGKILL during a checkpoint write leaves `.tmp-last-<pid>` (tests/test_checkpoint.py kills a real writer);
    the next start of the run removes it and resumes from the checkpoint itself."""
    import subprocess
    import sys

    run = tmp_path / "run"
    _train(run, data_dir, steps=2, stop_after=1)
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # a pid that no longer runs: the killed writer's
    stale = run / "checkpoints" / f".tmp-last-{p.pid}"
    stale.mkdir()
    (stale / ckpt.STATE).write_text(json.dumps({"step": 99}))
    said = []
    train(run, resume=True, progress=False, print_fn=said.append)
    assert not stale.exists() and any(str(stale) in s and "killed" in s for s in said), said
    assert ckpt.load(run / "checkpoints" / "last")["state"]["step"] == 2


@pytest.mark.parametrize("world", ["1", "2"])
def test_a_finished_torchrun_rank_leaves_with_its_code_and_its_output(world):
    """exit_torchrun_rank: under torchrun (WORLD_SIZE > 1) the rank's buffered output is flushed and it exits
    with the given code without finalization (no atexit handler runs); a plain process just goes on."""
    import subprocess
    import sys

    script = ("import atexit, sys\nfrom rlcd.train import exit_torchrun_rank\natexit.register(print, 'finalized')\n"
              "sys.stdout.write('done|'); sys.stderr.write('err|')\nexit_torchrun_rank(3)\nprint('went on')\n")
    env = {**os.environ, "WORLD_SIZE": world}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    if world == "2":
        assert (out.returncode, out.stdout, out.stderr) == (3, "done|", "err|")
    else:
        assert (out.returncode, out.stdout, out.stderr) == (0, "done|went on\nfinalized\n", "err|")
