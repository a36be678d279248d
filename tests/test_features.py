"""Head-only training on the shared feature cache (issue 20): cache == live backbone, key changes rebuild,
a killed extraction is never read, resume is exact, the head warm-up freezes LoRA first."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import ddp_worker
from conftest import fresh_data, killed_extraction, synth_processed, torchrun, user_error

from rlcd import checkpoint as ckpt
from rlcd.errors import OptionError
from rlcd.features import FeatureCache, cache_root, ensure_features, find_features
from rlcd.recipe import Recipe
from rlcd.train import train

torch.set_num_threads(1)
FAST = dict(eval_every=3, checkpoint_every=1, log_every=1, diagnostics_every=0)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return synth_processed(tmp_path_factory.mktemp("data"), 40, seed=5)


def _train(run, data_dir, model="tiny-toy", steps=4, **kw):
    recipe = Recipe(steps=steps, **{**FAST, **kw.pop("recipe", {})})
    return train(run, data_dir=data_dir, model=model, recipe=recipe, progress=False, print_fn=lambda _: None, **kw)


def _weights(run, which="last"):
    return ckpt.load(Path(run) / "checkpoints" / which)["weights"]


def _model(name="tiny-toy", seed=0):
    from rlcd.model.build import build_model

    return build_model({"model": name, "model_seed": seed, "recipe": {}})


def _assert_heads_agree(a, b, steps):
    """Two runs' heads trained on features that differ by float32 noise (prefix-shared extraction vs full rows).
    AdamW's first steps move each weight by about lr * sign(g), so an element whose gradient is noise-sized can
    end up to a few lr steps apart; every other element agrees to float32 noise."""
    for k in a:
        if k.startswith("head.w_"):
            d = (a[k] - b[k]).abs()
            assert float(d.mean()) < 1e-7, (k, float(d.mean()))
            assert float((d > 1e-6).float().mean()) < 1e-3, (k, int((d > 1e-6).sum()))
            assert float(d.max()) < 2 * steps * Recipe().lr_head, (k, float(d.max()))
        elif k.startswith("head."):
            assert torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-5), k


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_head_only_on_the_cache_equals_the_live_frozen_backbone(tmp_path, data_dir, name):
    data = fresh_data(tmp_path, data_dir)
    cached = _train(tmp_path / "cached", data, model=name, steps=5, recipe={"head_only": True})
    live = _train(tmp_path / "live", data, model=name, steps=5, recipe={"head_only": True}, feature_cache=False)
    assert find_features(_model(name), data) is not None, "training built the cache"
    assert cached["step"] == live["step"] == 5
    a, b = _weights(tmp_path / "cached"), _weights(tmp_path / "live")
    assert set(a) == set(b)
    _assert_heads_agree(a, b, steps=5)
    lora_b = [v for k, v in a.items() if "lora_B" in k]
    assert lora_b and all(torch.count_nonzero(v) == 0 for v in lora_b), "a head-only run leaves LoRA B at 0"
    session = [json.loads(x) for x in (tmp_path / "cached" / "metrics.jsonl").read_text().splitlines()][0]
    assert session["features"] and Path(session["features"]).parent == cache_root(data)


def test_the_cache_is_reused_and_rebuilt_when_its_key_changes(tmp_path, data_dir):
    data = fresh_data(tmp_path, data_dir)
    m = _model()
    first = ensure_features(m, data, progress=False)
    again = ensure_features(m, data, progress=False)
    assert again.root == first.root
    assert again.manifest["created"] == first.manifest["created"], "a matching key is reused, not re-extracted"
    other_seed = ensure_features(_model(seed=1), data, progress=False)
    assert other_seed.root != first.root, "another backbone (weights) is another key"
    m.encoder.max_tokens = 4096  # another prompt frame limit: part of the key
    assert find_features(m, data) is None
    m.encoder.max_tokens = 8192
    # an edited split: the old cache no longer matches and a new one is built
    rows = (data / "test.jsonl").read_text().splitlines()
    (data / "test.jsonl").write_text("\n".join(rows[:-1]) + "\n")
    assert find_features(m, data) is None
    rebuilt = ensure_features(m, data, progress=False)
    assert rebuilt.root != first.root and rebuilt.manifest["splits"]["test"] == len(rows) - 1
    # a cache directory whose manifest lies about completeness is never read
    manifest = json.loads((rebuilt.root / "manifest.json").read_text())
    (rebuilt.root / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    assert FeatureCache.load(rebuilt.root, manifest["key"]) is None
    assert ensure_features(m, data, progress=False).manifest["complete"]


def test_a_killed_extraction_leaves_nothing_a_later_run_reads(tmp_path, data_dir):
    data = fresh_data(tmp_path, data_dir)
    root = killed_extraction(data, "rlcd.features", "ensure_features", {})
    m = _model()
    assert find_features(m, data) is None
    said = []
    built = ensure_features(m, data, progress=False, say=said.append)
    assert built.manifest["complete"] and built.manifest["attempts"] == 2
    train, total = built.manifest["splits"]["train"], sum(built.manifest["splits"].values())
    assert [s for s in said if s.endswith(f": {train} of {total} entries already extracted")], said
    assert not [p for p in root.iterdir() if p.name.startswith((".tmp-", ".partial-"))], \
        "the dead temp dir was removed, the train split's chunks resumed, the partial removed once published"


def test_head_only_resume_is_bit_exact(tmp_path, data_dir):
    data = fresh_data(tmp_path, data_dir)
    _train(tmp_path / "full", data, steps=6, recipe={"head_only": True})
    _train(tmp_path / "part", data, steps=6, recipe={"head_only": True}, stop_after=3)
    train(tmp_path / "part", resume=True, progress=False, print_fn=lambda _: None)
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "part")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_head_only_run_from_a_moved_lora_reads_that_loras_features(tmp_path, data_dir):
    """`--init` from a run whose LoRA moved, then head only: the frozen backbone includes that LoRA, so the cache
    holds its features (its key names the LoRA), the cached run trains as the live one does, and a resume reads
    the same cache. (The key left LoRA out and the cache was looked up before the init weights were loaded, so
    such a run trained its head on the base model's features and was evaluated on the LoRA's.)"""
    data = fresh_data(tmp_path, data_dir)
    src = tmp_path / "lora"
    _train(src, data, model="tiny-llama", steps=3, recipe={"lr_lora": 1e-2}, feature_cache=False)
    shutil.rmtree(src / "checkpoints" / "best")  # make the source's best its last, as a longer run's would be
    shutil.copytree(src / "checkpoints" / "last", src / "checkpoints" / "best")
    lora_b = [v for k, v in _weights(src, "best").items() if "lora_B" in k]
    assert lora_b and all(torch.count_nonzero(v) > 0 for v in lora_b), "the source's LoRA moved"
    head = {"head_only": True}
    cached = _train(tmp_path / "cached", data, model="tiny-llama", steps=4, recipe=head, init=src)
    live = _train(tmp_path / "live", data, model="tiny-llama", steps=4, recipe=head, init=src, feature_cache=False)
    assert cached["step"] == live["step"] == 4
    a, b = _weights(tmp_path / "cached"), _weights(tmp_path / "live")
    _assert_heads_agree(a, b, steps=4)
    assert find_features(_model("tiny-llama"), data) is None, "no cache of the base model's features was built"
    dirs = [p for p in cache_root(data).iterdir() if not p.name.startswith(".")]
    assert len(dirs) == 1 and json.loads((dirs[0] / "manifest.json").read_text())["key"]["lora"]
    _train(tmp_path / "part", data, model="tiny-llama", steps=4, recipe=head, init=src, stop_after=2)
    train(tmp_path / "part", resume=True, progress=False, print_fn=lambda _: None)
    c = _weights(tmp_path / "part")
    assert all(torch.equal(a[k], c[k]) for k in a), "the resumed run equals the uninterrupted one"
    assert [p for p in cache_root(data).iterdir() if not p.name.startswith(".")] == dirs, "the resume reused it"


def test_a_zero_lora_is_switched_off_for_extraction_without_changing_a_feature(data_dir, monkeypatch):
    """Extraction runs with peft's adapters disabled while every LoRA B is zero (faster); the features equal the
    adapters-on extraction bit for bit and every parameter's requires_grad is as it was."""
    import contextlib

    from rlcd import features
    from rlcd.data.io import load_split

    model = _model("tiny-llama")
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    for p in lora[::2]:
        p.requires_grad_(False)
    flags = [p.requires_grad for p in model.parameters()]
    recs = load_split(data_dir, "test")[:12]
    off, _ = features.extract_split(model, recs, model.collator(image_root=data_dir), "test")
    assert [p.requires_grad for p in model.parameters()] == flags
    monkeypatch.setattr(features, "_zero_lora_off", lambda m: contextlib.nullcontext())
    on, _ = features.extract_split(model, recs, model.collator(image_root=data_dir), "test")
    assert off.keys() == on.keys() and all(torch.equal(off[k], on[k]) for k in on)
    assert features.lora_digest(model) is None and "lora" not in features.feature_key(model, data_dir)


def test_head_warmup_trains_only_the_head_then_lora_joins(tmp_path, data_dir):
    data = fresh_data(tmp_path, data_dir)
    run = tmp_path / "lpft"
    _train(run, data, steps=5, recipe={"head_warmup": 3}, stop_after=3)
    w0 = _weights(run, "best")  # step 0 is the best until an evaluation beats it (eval at 3)
    w3 = _weights(run)
    lora = [k for k in w3 if k.startswith("lora.")]
    assert lora and all(torch.equal(w3[k], w0[k]) for k in lora), "LoRA did not move in the warm-up"
    assert not torch.equal(w3["head.w_d.weight"], w0["head.w_d.weight"]), "the head learnt in the warm-up"
    train(run, resume=True, stop_after=1, progress=False, print_fn=lambda _: None)
    w4 = _weights(run)
    assert any(not torch.equal(w4[k], w3[k]) for k in lora if "lora_B" in k), "LoRA learns after the warm-up"
    caches = sorted(p.name for p in cache_root(data).iterdir())
    assert len(caches) == 1
    state = train(run, resume=True, progress=False, print_fn=lambda _: None)
    assert state["step"] == 5
    assert sorted(p.name for p in cache_root(data).iterdir()) == caches, "past the warm-up nothing is extracted"
    session = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"session"' in x]
    assert session[-1]["features"] is None and session[0]["features"], "the last resume reads no cache"


def test_cached_and_live_evaluations_give_the_same_predictions(tmp_path, data_dir):
    from rlcd.evaluate import evaluate_run

    data = fresh_data(tmp_path, data_dir)
    run = tmp_path / "run"
    _train(run, data, steps=3, recipe={"head_only": True})
    evaluate_run(run, progress=False, feature_cache=True)
    cached = {s: (run / "eval" / f"predictions-{s}.jsonl").read_text() for s in ("dev", "calibration", "test")}
    evaluate_run(run, progress=False, feature_cache=False)
    assert sum(len(t.splitlines()) for t in cached.values()) > 20
    for split, text in cached.items():
        a = [json.loads(x) for x in text.splitlines()]
        b = [json.loads(x) for x in (run / "eval" / f"predictions-{split}.jsonl").read_text().splitlines()]
        assert [r["id"] for r in a] == [r["id"] for r in b]
        if not a:
            continue
        diff = max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra["logits"], rb["logits"]))
        assert diff < 1e-4, (split, diff)


def test_recipe_refuses_a_warmup_beyond_the_budget_and_both_modes():
    with pytest.raises(OptionError, match="head_warmup must be an integer in \\[0, steps=10\\]"):
        Recipe(steps=10, head_warmup=11)
    with pytest.raises(OptionError, match="head_only=true and head_warmup>0"):
        Recipe(head_only=True, head_warmup=5)
    assert Recipe(head_only=True).deviations()["head_only"] == {"value": True, "pinned": False}


def test_cli_mistakes_are_one_line_and_exit_2(tmp_path, data_dir):
    data = fresh_data(tmp_path, data_dir)
    user_error(["train", tmp_path / "r", "--data", data, "--model", "tiny-toy", "--steps", "10", "--recipe",
                "head_warmup=50"], contains="head_warmup must be an integer in [0, steps=10]")
    assert not (tmp_path / "r").exists()
    user_error(["train", "--resume", tmp_path / "r", "--recipe", "head_only=true"],
               contains="would change the run's frozen config")
    (data / "features").write_text("not a directory")
    user_error(["features", data, "--model", "tiny-toy"], contains="is not writable")
    user_error(["train", tmp_path / "r2", "--data", data, "--model", "tiny-toy", "--steps", "2", "--recipe",
                "head_only=true"], contains="is not writable")
    assert not (tmp_path / "r2").exists()


@pytest.mark.slow
def test_ddp_head_only_gradients_match_one_process(tmp_path, data_dir):
    """2 gloo ranks on the shared cache (rank 0 extracts, rank 1 waits and reads) == 1 process, within 1e-5."""
    data = fresh_data(tmp_path, data_dir)
    worker = str(ROOT / "tests" / "ddp_worker.py")
    torchrun(worker, "grads", data, tmp_path, "head-only", cwd=tmp_path, env={"PYTHONPATH": str(ROOT / "src")})
    ddp_worker.grads(data, tmp_path, "head-only")  # the one-process reference, in this process (reads the cache)
    ddp, ref = torch.load(tmp_path / "grads-world2.pt"), torch.load(tmp_path / "grads-world1.pt")
    assert set(ref) == {"head.w_d.weight", "head.w_c.weight"}, "only the head gets gradients"
    for name in ref:
        torch.testing.assert_close(ddp[name], ref[name], atol=1e-5, rtol=1e-5, msg=name)


def test_merging_a_zero_lora_keeps_the_weights_bytes_and_so_the_cache_key():
    """A head-only run's LoRA is zero; merging it added 0 to every wrapped weight, which turns -0.0 into +0.0 (Q4_K
    GGUF weights hold many: Gemma 3 and Qwen2.5), changed `weights_digest`, and the run's evaluation missed the
    feature cache it trained on (it ran the whole backbone, minutes instead of seconds). A non-zero LoRA still
    folds into the weights."""
    from rlcd.features import weights_digest

    m = _model()
    wrapped = [p for n, p in m.backbone.named_parameters() if ".base_layer.weight" in n]
    assert wrapped, "the preset wraps no layer with LoRA"
    with torch.no_grad():
        for p in wrapped:
            p[0, :4] = -0.0
    digest = weights_digest(m)
    m.merge()
    assert m.merged and not any("lora_" in n for n, _ in m.backbone.named_parameters())
    assert weights_digest(m) == digest
    kept = {id(p) for p in m.backbone.parameters()}
    assert all(id(p) in kept and bool(torch.signbit(p[0, :4]).all()) for p in wrapped)

    m = _model()
    with torch.no_grad():
        for n, p in m.backbone.named_parameters():
            if "lora_B" in n:
                p.fill_(0.01)
    digest = weights_digest(m)
    m.merge()
    assert weights_digest(m) != digest, "a trained LoRA is folded into the weights"


def test_choice_orders_given_caches_one_entry_per_row_and_the_run_reads_it(tmp_path, data_dir):
    """`choice_orders=given` (the demo's extraction): every train choice row is cached once, in its given order,
    not in its balanced set; the head-only run trains on that cache (every draw reads order 0), and its evaluation
    finds the same cache rather than extracting again. The balanced cache of the same data is another key."""
    from rlcd.data.io import load_split
    from rlcd.data.sampling import n_orders

    data = fresh_data(tmp_path, data_dir)
    train_rows = load_split(data, "train")
    balanced = sum(n_orders(r.question.k) if r.question.type == "choice" else 1 for r in train_rows)
    assert balanced > len(train_rows), "the fixture has choice rows with several orders"
    _train(tmp_path / "run", data, steps=4, recipe={"head_only": True, "choice_orders": "given"})
    (cache,) = [d for d in cache_root(data).iterdir() if not d.name.startswith(".")]
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["key"]["orders"] == "given-v1"
    assert manifest["splits"]["train"] == len(train_rows)
    assert all(o == 0 for _, o in json.loads((cache / "train.index.json").read_text()))
    found = find_features(_model(), data)
    assert found is not None and found.root == cache, "evaluation reads the given-order cache"
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["recipe_deviations"]["choice_orders"] == {"value": "given", "pinned": "balanced"}
    other = ensure_features(_model(), data, progress=False)
    assert other.root != cache and other.manifest["splits"]["train"] == balanced
    with pytest.raises(OptionError, match="choice_orders"):
        Recipe(choice_orders="shuffled")


@pytest.mark.parametrize("name", ["tiny-llama"])
def test_backbone_layers_reads_the_state_after_the_first_n_layers_then_the_final_norm(name):
    """`backbone_layers=N` (the demo's cheaper extraction): the kept decoder's output is the full decoder's hidden
    state after layer N with the final norm applied (as the top layer's is), and its depth, config and config hash
    say N, so no cache of the whole decoder matches it."""
    from rlcd.model.build import build_model

    full = build_model({"model": name, "model_seed": 0, "recipe": {}}).eval()
    kept = build_model({"model": name, "model_seed": 0, "recipe": {"backbone_layers": 2}}).eval()
    assert (full.num_layers, kept.num_layers) == (4, 2)
    dec_full, dec_kept = (m.family.text_decoder(m.backbone) for m in (full, kept))
    assert len(dec_kept.layers) == dec_kept.config.num_hidden_layers == 2
    assert kept.info["config_hash"] != full.info["config_hash"] and kept.info["num_layers"] == 2
    ids = torch.randint(5, 200, (2, 11))
    with torch.no_grad():
        states = dec_full(input_ids=ids, output_hidden_states=True).hidden_states
        want = dec_full.norm(states[2]).double()
        got = dec_kept(input_ids=ids).last_hidden_state.double()
    assert float((got - want).abs().max()) < 1e-5 * float(want.abs().max())
    assert float((got - dec_full.norm(states[3]).double()).abs().max()) > 1e-3, "another layer's state differs"


def test_a_backbone_layers_run_trains_evaluates_and_serves_at_its_depth(tmp_path, data_dir):
    """The depth lands in config.json and reaches every place the model is built: the cached training features,
    a live evaluation (the same logits as the cached one) and the exported predictor; an --init from another
    depth is refused."""
    from rlcd.evaluate import evaluate_run
    from rlcd.predict import Predictor

    data = fresh_data(tmp_path, data_dir)
    run = tmp_path / "run"
    _train(run, data, model="tiny-llama", steps=3, recipe={"head_only": True, "backbone_layers": 2})
    assert json.loads((run / "config.json").read_text())["recipe"]["backbone_layers"] == 2
    (cache,) = [d for d in cache_root(data).iterdir() if not d.name.startswith(".")]
    assert find_features(_model("tiny-llama"), data) is None, "the whole decoder's features are another key"
    evaluate_run(run, progress=False, feature_cache=True)
    cached = [json.loads(x) for x in (run / "eval" / "predictions-test.jsonl").read_text().splitlines()]
    evaluate_run(run, progress=False, feature_cache=False)
    live = [json.loads(x) for x in (run / "eval" / "predictions-test.jsonl").read_text().splitlines()]
    assert cached and [r["id"] for r in cached] == [r["id"] for r in live]
    assert max(abs(x - y) for a, b in zip(cached, live) for x, y in zip(a["logits"], b["logits"])) < 1e-4
    predictor = Predictor.from_run(run)
    assert predictor.model.num_layers == 2
    with pytest.raises(OptionError, match="backbone_layers 2 there, None here"):
        _train(tmp_path / "init", data, model="tiny-llama", steps=3, init=run)


def test_backbone_layers_refuses_a_depth_the_backbone_lacks():
    from rlcd.model.build import build_model

    for bad in (0, "2", True):
        with pytest.raises(OptionError, match="backbone_layers must be none"):
            Recipe(backbone_layers=bad)
    with pytest.raises(OptionError, match=r"backbone_layers=9: this backbone has 4 decoder layers; give 1..4"):
        build_model({"model": "tiny-toy", "model_seed": 0, "recipe": {"backbone_layers": 9}})
    with pytest.raises(OptionError, match=r"the first 2 decoder layers are all linear attention .* keep at least 4"):
        build_model({"model": "tiny", "model_seed": 0, "recipe": {"backbone_layers": 2}})  # Qwen3.5: 3 linear, 1 full
