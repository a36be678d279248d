"""Dev predictions kept at every evaluation (RUN/dev-evals/) and the advantage magnitudes read from them."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import synth_processed
from test_objectives import reference

from rlcd import dev_evals
from rlcd.recipe import Recipe
from rlcd.run import Run
from rlcd.train import train

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("dev_evals")
    data = synth_processed(base, 40, seed=4)
    recipe = Recipe(steps=3, eval_every=1, checkpoint_every=1, log_every=1, diagnostics_every=0, lr_head=5e-3,
                    sigma_end=0.1)
    train(base / "run", data_dir=data, model="tiny-toy", recipe=recipe, progress=False, print_fn=lambda _: None)
    return base / "run"


def test_every_evaluation_keeps_its_dev_logits(run):
    r = Run(run)
    evals = [x for x in map(json.loads, r.metrics_path.read_text().splitlines()) if x["event"] == "eval"]
    assert dev_evals.dev_eval_steps(r) == [e["step"] for e in evals] == [0, 1, 2, 3]
    dev_ids = sorted(i for ids in r.samples()["dev"].values() for i in ids)
    for e in evals:
        raw = r.dev_eval_path(e["step"]).read_bytes()
        assert raw[4:8] == b"\0\0\0\0"  # no timestamp in the gzip header: equal logits, equal bytes
        rows = dev_evals.read_dev_eval(r, e["step"])
        assert sorted(x["id"] for x in rows) == dev_ids
        assert all(set(x) == {"id", "group", "type", "target", "logits"} and len(x["logits"]) == len(x["target"])
                   for x in rows)
        # the kept logits reproduce the selection score logged at that evaluation
        hits = defaultdict(list)
        for x in rows:
            hits[x["group"]].append(int(np.argmax(x["logits"])) == int(np.argmax(x["target"])))
        macro = np.mean([np.mean(v) for v in hits.values()])
        assert macro == pytest.approx(e["dev_macro_accuracy"], abs=1e-12)
    assert dev_evals.read_dev_eval(r, 0) != dev_evals.read_dev_eval(r, 3)  # training moved the logits


def test_advantage_magnitude_is_the_reward_std_against_float64_reference(run):
    rows = dev_evals.read_dev_eval(Run(run), 3)
    picked = [next(x for x in rows if x["type"] == t) for t in ("choice", "noul", "score")]
    mags = dev_evals.advantage_magnitudes(picked, sigma=0.2, w_log=0.5, w_spherical=0.75, w_rps=1.0)
    for x in picked:
        k = len(x["logits"])
        noise = dev_evals._noise(x["id"], k, dev_evals.N_SAMPLES).numpy()[:, None, :]
        ref = reference(np.array([x["logits"]]), np.ones((1, k), bool), np.array([x["target"]]),
                        np.array([x["type"] == "score"]), noise, 0.2, 1.0, w_log=0.5)
        assert mags[x["id"]] == pytest.approx(float(np.std(ref["reward"][:, 0], ddof=1)), rel=1e-5)
    # common random numbers: the same logits give the same magnitude whatever else is in the batch
    alone = dev_evals.advantage_magnitudes(picked[:1], sigma=0.2, w_log=0.5)
    assert alone[picked[0]["id"]] == pytest.approx(mags[picked[0]["id"]], rel=1e-9)


def test_amplified_questions_rank_the_growth_per_type(run):
    r = Run(run)
    config = r.config()
    found = dev_evals.amplified_questions(r, config["recipe"], config["decay_horizon"], top=3)
    assert (found["first_step"], found["last_step"]) == (0, 3)
    recipe = Recipe.from_dict(config["recipe"])
    first = dev_evals.advantage_magnitudes(dev_evals.read_dev_eval(r, 0), sigma=recipe.sigma_at(0, 3))
    last = dev_evals.advantage_magnitudes(dev_evals.read_dev_eval(r, 3), sigma=recipe.sigma_at(3, 3))
    types = {x["id"]: x["type"] for x in dev_evals.read_dev_eval(r, 3)}
    for t, top in found["per_type"].items():
        growth = sorted((last[i] - first[i] for i in first if types[i] == t), reverse=True)[:3]
        assert [q["growth"] for q in top] == pytest.approx(growth, rel=1e-9)
        assert all(q["growth"] == pytest.approx(q["last"] - q["first"]) for q in top)
    assert set(found["per_type"]) == {"choice", "noul", "score"}


def test_resume_trim_drops_the_files_after_the_checkpoint(run, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    dev_evals.trim_dev_evals(Run(copy), 1)  # what a resume from update 1 does before continuing the stream
    assert dev_evals.dev_eval_steps(Run(copy)) == [0, 1]
    assert dev_evals.read_dev_eval(Run(copy), 1) == dev_evals.read_dev_eval(Run(run), 1)
