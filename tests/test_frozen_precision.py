"""The frozen layers in bfloat16 (issue 69: the 4k arm's cut states in ~half the CPU): `Recipe.frozen_precision`
runs the layers below the cut under bfloat16 autocast and stores their states in bfloat16; the layers LoRA trains
stay float32. Compared with the float32 cached path within stated tolerances; a float32 run never reads such a
cache; the user's mistakes are one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import fresh_data, synth_processed, user_error

from rlcd.cut_cache import cut_key, ensure_cut_states, find_cut_states
from rlcd.recipe import Recipe
from rlcd.train import Dist, build_session, init_centring, new_run

torch.set_num_threads(1)
# bfloat16 keeps 8 significant bits (relative rounding <= 2^-8 = 0.4%); autocast rounds every matrix product's inputs,
# so a state 2 layers up carries a few of those: tolerances below are stated relative to the float32 norm
STATE_REL = 0.03   # per token: |bf16 - fp32| / |fp32| of a stored state
GRAD_REL = 0.15    # whole-gradient relative distance of a first update (0.073 measured on tiny-llama's random
                   # weights; states read in the wrong place or order are ~1)
LOSS_REL = 0.01    # first-update loss


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return synth_processed(tmp_path_factory.mktemp("data"), 16, seed=3)


def _model(name="tiny-llama", k=2):
    from rlcd.model.build import build_model

    return build_model({"model": name, "model_seed": 0, "recipe": {"lora_layers": k}})


def _states(cache, split="train"):
    """Every stored token's state as float32 [T, H], and the index (equal layouts compare token by token)."""
    states, pos = cache.maps[split]
    arr = np.array(states)
    t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16).float() if arr.dtype == np.uint16 else \
        torch.from_numpy(arr.astype(np.float32))
    return t, np.array(pos), (cache.segments[split], cache.entries[split])


def test_bfloat16_cut_states_are_the_float32_ones_to_bfloat16_noise_and_autocast_ran(tmp_path, data_dir):
    data = fresh_data(tmp_path, data_dir)
    m = _model()
    full = ensure_cut_states(m, data, progress=False)
    rounded = ensure_cut_states(m, data, progress=False, storage="bfloat16")  # float32 compute, bfloat16 storage
    bf16 = ensure_cut_states(m, data, progress=False, storage="bfloat16", precision="bfloat16")
    assert len({full.root, rounded.root, bf16.root}) == 3, "three keys, three caches"
    assert bf16.manifest["precision"] == "bfloat16" and bf16.manifest["storage"] == "bfloat16"
    assert bf16.manifest["bytes"] < 0.6 * full.manifest["bytes"]
    a, pa, ia = _states(full)
    b, pb, ib = _states(bf16)
    r, _, _ = _states(rounded)
    assert ia == ib and np.array_equal(pa, pb), "same entries, segments and positions"
    rel = (b - a).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-6)
    assert float(rel.max()) < STATE_REL, float(rel.max())
    assert not torch.equal(b, r), "the layers below the cut ran under bfloat16 autocast, not only the storage"


def test_a_float32_run_never_reads_a_bfloat16_cache_and_its_key_is_unchanged(tmp_path, data_dir):
    data = fresh_data(tmp_path, data_dir)
    m = _model()
    assert "precision" not in cut_key(m, data), "float32 keys are the ones every existing cache was built under"
    assert cut_key(m, data, "bfloat16", precision="bfloat16")["precision"] == "bfloat16"
    built = ensure_cut_states(m, data, progress=False, storage="bfloat16", precision="bfloat16")
    assert find_cut_states(m, data) is None and find_cut_states(m, data, storage="bfloat16") is None
    assert find_cut_states(m, data, storage="bfloat16", precision="bfloat16").root == built.root
    from rlcd.model.build import build_model

    head = build_model({"model": "tiny-llama", "model_seed": 0, "recipe": {}})
    assert find_cut_states(head, data, any_cut=True) is None, "a float32 head never takes bfloat16 states"
    assert find_cut_states(head, data, any_cut=True, precision="bfloat16").root == built.root


def _first_update(data, precision):
    recipe = Recipe(steps=3, grad_accum=2, lora_layers=2, batch_by="case", frozen_precision=precision)
    config, samples = new_run(data / "unused", data, "tiny-llama", recipe)
    s = build_session(config, samples, Dist(), progress=False)
    init_centring(s)
    s.set_lr(0)
    stats = s.accumulate(0)
    return s, stats, {n: p.grad.clone() for n, p in s.model.named_parameters() if p.grad is not None}


def test_a_top_layer_update_on_bfloat16_states_is_the_float32_update_within_tolerance(tmp_path, data_dir):
    data = fresh_data(tmp_path, data_dir)
    s32, st32, g32 = _first_update(data, "float32")
    s16, st16, g16 = _first_update(data, "bfloat16")
    assert s16.sources.main.cache.key["precision"] == "bfloat16"
    assert "precision" not in s32.sources.main.cache.key
    assert next(p for n, p in s16.model.named_parameters() if "lora_A" in n).dtype == torch.float32, \
        "the trained layers stay float32"
    assert g16.keys() == g32.keys()
    assert st16["loss"] == pytest.approx(st32["loss"], rel=LOSS_REL)
    num = sum(((g16[k] - g32[k]) ** 2).sum() for k in g32).sqrt()
    den = sum((g32[k] ** 2).sum() for k in g32).sqrt()
    assert 0 < float(num / den) < GRAD_REL, float(num / den)


def test_head_features_from_bfloat16_cut_states_carry_their_precision(tmp_path, data_dir):
    from rlcd.features import ensure_features, find_features
    from rlcd.model.build import build_model

    data = fresh_data(tmp_path, data_dir)
    ensure_cut_states(_model(), data, progress=False, storage="bfloat16", precision="bfloat16")
    head = build_model({"model": "tiny-llama", "model_seed": 0, "recipe": {}})
    below = find_cut_states(head, data, any_cut=True, precision="bfloat16")
    fast = ensure_features(head, data, progress=False, cut_states=below, precision="bfloat16")
    assert fast.key["precision"] == "bfloat16"
    assert fast.key["from_cut_states"] == {"cut": 2, "storage": "bfloat16", "precision": "bfloat16"}
    assert find_features(head, data) is None, "a float32 evaluation never reads bfloat16 features"
    with pytest.raises(ValueError, match="computed in bfloat16, not in float32"):
        ensure_features(head, data, progress=False, cut_states=below)
    full = ensure_features(head, data, progress=False)  # float32, the full backbone
    for split, tensors in full.tensors.items():
        for name in ("h_dec", "h_cand"):
            a, b = tensors[name], fast.tensors[split][name]
            if not a.numel():
                continue
            rel = (b - a).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-6)
            assert float(rel.max()) < STATE_REL, (split, name, float(rel.max()))


def test_frozen_precision_mistakes_are_one_line(tmp_path, data_dir):
    from rlcd.errors import OptionError

    with pytest.raises(OptionError, match="frozen_precision must be float32 or bfloat16"):
        Recipe(frozen_precision="fp16", lora_layers=2)
    with pytest.raises(OptionError, match="with LoRA on every layer nothing is frozen"):
        Recipe(frozen_precision="bfloat16")
    assert Recipe(frozen_precision="bfloat16", head_only=True).deviations()["frozen_precision"]["value"] == "bfloat16"
    assert Recipe.from_dict({k: v for k, v in Recipe().to_dict().items() if k != "frozen_precision"}) == Recipe(), \
        "a config written before the field reads as float32"
    data = fresh_data(tmp_path, data_dir)
    user_error(["train", str(tmp_path / "run"), "--data", str(data), "--model", "tiny-llama", "--no-cache",
                "--recipe", "lora_layers=2", "--recipe", "frozen_precision=bfloat16", "--steps", "2"],
               contains="--no-cache runs the frozen layers live in float32")
    assert not (tmp_path / "run" / "config.json").exists()
    user_error(["features", str(data), "--model", "tiny-llama", "--cut", "2", "--frozen-precision", "bfloat16",
                "--storage", "float32"], contains="stored in bfloat16")
    user_error(["features", str(data), "--model", "tiny-llama", "--frozen-precision", "half"], contains="'half'")
    assert not (data / "features").exists(), "nothing extracted for a refused command"


def test_rlcd_features_builds_bfloat16_cut_states_then_features_from_them(tmp_path, data_dir):
    from typer.testing import CliRunner

    from rlcd.cli import app

    data = fresh_data(tmp_path, data_dir)
    cli = CliRunner()
    got = cli.invoke(app, ["features", str(data), "--model", "tiny-llama", "--cut", "2", "--frozen-precision",
                           "bfloat16"])
    assert got.exit_code == 0, got.output
    cut = json.loads(got.stdout)
    assert cut["precision"] == "bfloat16" and cut["storage"] == "bfloat16"
    got = cli.invoke(app, ["features", str(data), "--model", "tiny-llama", "--frozen-precision", "bfloat16"])
    assert got.exit_code == 0, got.output
    feats = json.loads(got.stdout)
    assert feats["precision"] == "bfloat16" and feats["from_cut_states"]["precision"] == "bfloat16"
