"""Training with derived forms (`--recipe forms=derived`): a recorded deviation; each micro-batch holds exactly
`derived_slots` derived rows (row and case batching), the pinned recipe draws none, and a tiny run trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import synth_processed

from rlcd.data.derive import derive_dir, parse_forms
from rlcd.data.io import load_split
from rlcd.data.sampling import Sampler, derived_pool, derived_slots, dev_subset, eligible_pool
from rlcd.errors import OptionError
from rlcd.recipe import Recipe
from rlcd.train import train

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def derived_dir(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("forms")
    derive_dir(synth_processed(base, 30, seed=3), base / "derived", parse_forms(None))
    return base / "derived"


def test_forms_is_a_validated_recorded_deviation():
    assert Recipe().forms == "base" and "forms" not in Recipe().deviations()
    assert "forms_share" not in Recipe().deviations()
    assert Recipe(forms="derived").deviations()["forms"] == {"value": "derived", "pinned": "base"}
    with pytest.raises(OptionError, match="forms must be 'base'"):
        Recipe(forms="all")
    for bad in (0.0, 1.0, -0.1, float("nan")):
        with pytest.raises(OptionError, match="forms_share"):
            Recipe(forms="derived", forms_share=bad)


def test_derived_slots():
    assert [derived_slots(8, s) for s in (0.01, 0.1, 0.25, 0.5, 0.99)] == [1, 1, 2, 4, 7]
    assert derived_slots(2, 0.25) == 1 and derived_slots(32, 0.25) == 8


def test_pools_keep_derived_rows_apart(derived_dir):
    train_rows = load_split(derived_dir, "train")
    derived_ids = {r.id for r in train_rows if r.derived}
    assert derived_ids
    pool = eligible_pool(train_rows)
    assert not derived_ids & {i for ids in pool.values() for i in ids}
    assert not any(r.derived for r in load_split(derived_dir, "dev")
                   if r.id in {i for ids in dev_subset(load_split(derived_dir, "dev")).values() for i in ids})
    dpool = derived_pool(train_rows)
    assert {i for ids in dpool.values() for i in ids} == derived_ids
    assert all(k.split("|")[1] == next(r for r in train_rows if r.id == ids[0]).derived["form"]
               for k, ids in dpool.items())


def test_the_share_holds_and_the_default_draws_no_derived_row(derived_dir):
    rows = load_split(derived_dir, "train")
    by_id = {r.id: r for r in rows}
    pool, dpool = eligible_pool(rows), derived_pool(rows)
    case_of = {r.id: r.case_id for r in rows}
    plain = Sampler(pool, case_of)
    mixed = Sampler(pool, case_of, dpool, 0.25)
    forms = set()
    for index in range(300):
        assert not any(by_id[d.id].derived for d in plain.microbatch(0, index, 8))
        assert not any(by_id[d.id].derived for c in plain.case_microbatch(0, index, 8) for d in c)
        draws = mixed.microbatch(0, index, 8)
        assert len(draws) == 8 and sum(1 for d in draws if by_id[d.id].derived) == 2
        assert draws == mixed.microbatch(0, index, 8)  # still a pure function of (seed, index)
        cases = mixed.case_microbatch(0, index, 8)
        flat = [d for c in cases for d in c]
        assert len(flat) == 8 and sum(1 for d in flat if by_id[d.id].derived) == 2
        for c in cases:  # a derived row joins its own case: one state per case
            assert len({by_id[d.id].case_id for d in c}) == 1
        forms |= {by_id[d.id].derived["form"] for d in draws if by_id[d.id].derived}
        assert all(d.group == by_id[d.id].sampling_group for d in draws)
    assert len(forms) >= 10  # the forms are drawn uniformly, not in proportion to their instance counts


def test_a_forms_run_trains_and_records_its_pool(tmp_path, derived_dir):
    fast = dict(eval_every=2, checkpoint_every=2, log_every=1, diagnostics_every=0, dev_cap=4)
    run = tmp_path / "run"
    train(run, data_dir=derived_dir, model="tiny-toy", recipe=Recipe(steps=2, forms="derived", **fast), progress=False)
    config = json.loads((run / "config.json").read_text())
    assert config["recipe_deviations"]["forms"] == {"value": "derived", "pinned": "base"}
    samples = json.loads((run / "samples.json").read_text())
    assert samples["train_derived"] and all("|" in k for k in samples["train_derived"])
    # evaluation calibrates on and scores the original rows only (the forms are the coherence probe's)
    from typer.testing import CliRunner

    from rlcd.cli import app

    res = CliRunner().invoke(app, ["evaluate", str(run), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    for split in ("test", "calibration"):
        ids = [json.loads(x)["id"] for x in (run / "eval" / f"predictions-{split}.jsonl").read_text().splitlines()]
        assert ids == [r.id for r in load_split(derived_dir, split) if r.derived is None]
    with pytest.raises(OptionError, match="holds no derived rows"):
        train(tmp_path / "r2", data_dir=derived_dir.parent / "processed", model="tiny-toy",
              recipe=Recipe(steps=1, forms="derived", **fast), progress=False)
    assert not (tmp_path / "r2").exists()
