"""LoRA on the top K layers over the cut-state cache (issue 34): cache == live backbone (rows and cases, both
families), the cut is part of the key, a killed extraction is never read, resume is exact, evaluate from the
cache == --no-cache, DDP == one process, and the user's mistakes are one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import ddp_worker
from conftest import fresh_data, killed_extraction, synth_processed, torchrun, user_error

from rlcd import checkpoint as ckpt
from rlcd.cut_cache import CutCache, cut_key, ensure_cut_states, find_cut_states
from rlcd.features import cache_root
from rlcd.recipe import Recipe
from rlcd.train import Dist, build_session, init_centring, new_run, train

torch.set_num_threads(1)
FAST = dict(eval_every=2, checkpoint_every=1, log_every=1, diagnostics_every=0)
ROOT = Path(__file__).resolve().parents[1]
QUIET = dict(progress=False, print_fn=lambda _: None)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return synth_processed(tmp_path_factory.mktemp("data"), 16, seed=3)


def _model(name="tiny-toy", seed=0, k=2):
    from rlcd.model.build import build_model

    return build_model({"model": name, "model_seed": seed, "recipe": {"lora_layers": k}})


def _first_grads(data, model, batch_by, cache, k=2):
    recipe = Recipe(steps=3, grad_accum=2, lora_layers=k, batch_by=batch_by)
    config, samples = new_run(data / "unused", data, model, recipe)
    s = build_session(config, samples, Dist(), feature_cache=cache, progress=False)
    init_centring(s)
    s.set_lr(0)
    stats = s.accumulate(0)
    return s, stats, {n: p.grad.clone() for n, p in s.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-toy"])
@pytest.mark.parametrize("batch_by", ["row", "case"])
def test_k_layer_updates_on_the_cut_cache_equal_the_live_backbone(tmp_path, data_dir, model, batch_by):
    """An update's gradients from cached cut states + the top 2 layers equal those of the live backbone with LoRA
    on the same 2 layers (same rows, same orders), to float32 noise; LoRA exists only above the cut."""
    data = fresh_data(tmp_path, data_dir)
    s, cached_stats, cached = _first_grads(data, model, batch_by, True)
    assert s.sources.main.name == "cut" and s.model.cut_layer == s.model.num_layers - 2
    if batch_by == "case":  # the stored prefixes were shared through the top layers' cache
        b = s.microbatch(0)
        assert b.units is not None and any(len(u) > 1 for u in b.units) and b.prefixes
    _, live_stats, live = _first_grads(data, model, batch_by, False)
    assert cached.keys() == live.keys()
    layers = {int(n.split(".layers.")[1].split(".")[0]) for n in cached if "lora_" in n}
    assert layers == {s.model.num_layers - 2, s.model.num_layers - 1}, "LoRA only on the top 2 layers"
    assert cached_stats["loss"] == pytest.approx(live_stats["loss"], rel=1e-5)
    assert cached_stats["_tokens"] == live_stats["_tokens"]
    num = sum(((cached[k] - live[k]) ** 2).sum() for k in live).sqrt()
    den = sum((live[k] ** 2).sum() for k in live).sqrt()
    assert float(num / den) < 2e-5
    for k in live:  # every tensor that gets a real gradient agrees too
        if live[k].norm() > 1e-3 * den:
            torch.testing.assert_close(cached[k], live[k], rtol=1e-3, atol=1e-5 * float(den), msg=k)


def test_the_cut_is_part_of_the_key_and_the_merge_is_not(tmp_path, data_dir):
    data = fresh_data(tmp_path, data_dir)
    m = _model(k=2)
    first = ensure_cut_states(m, data, progress=False)
    assert find_cut_states(m, data).root == first.root
    assert cut_key(_model(k=1), data) != cut_key(m, data)  # another K
    assert cut_key(_model(seed=1, k=2), data) != cut_key(m, data)  # another backbone
    assert cut_key(_model("tiny-llama", k=2), data)["backbone"] != cut_key(m, data)["backbone"]
    # the LoRA above the cut moves and is merged: the states below the cut are the same, so is the key
    with torch.no_grad():
        for n, p in m.backbone.named_parameters():
            if "lora_B" in n:
                p.add_(0.1)
    m.merge()
    assert find_cut_states(m, data).root == first.root
    # an edited split: another key, a rebuild; the old directory is never read for it
    (data / "test.jsonl").write_text("\n".join((data / "test.jsonl").read_text().splitlines()[:-1]) + "\n")
    fresh = _model(k=2)
    assert find_cut_states(fresh, data) is None
    rebuilt = ensure_cut_states(fresh, data, progress=False)
    assert rebuilt.root != first.root and rebuilt.manifest["splits"]["test"]["entries"] == \
        first.manifest["splits"]["test"]["entries"] - 1
    # storage is shared by prefix: fewer stored tokens than row tokens, and the size is what the files hold
    mf = rebuilt.manifest
    assert mf["stored_tokens"] < mf["row_tokens"]
    assert mf["bytes"] == sum(p.stat().st_size for p in rebuilt.root.iterdir() if p.name != "manifest.json")
    # a file cut short is never read
    states = rebuilt.root / "train.states.bin"
    states.write_bytes(states.read_bytes()[:-4])
    assert CutCache.load(rebuilt.root, mf["key"]) is None


def test_a_killed_extraction_leaves_nothing_a_later_run_reads(tmp_path, data_dir):
    data = fresh_data(tmp_path, data_dir)
    root = killed_extraction(data, "rlcd.cut_cache", "ensure_cut_states", {"lora_layers": 2})
    m = _model()
    assert find_cut_states(m, data) is None
    said = []
    built = ensure_cut_states(m, data, progress=False, say=said.append)
    assert built.manifest["complete"] and built.manifest["attempts"] == 2
    splits = built.manifest["splits"]
    train, total = splits["train"]["entries"], sum(s["entries"] for s in splits.values())
    assert [s for s in said if s.endswith(f": {train} of {total} entries already extracted")], said
    assert not [p for p in root.iterdir() if p.name.startswith((".tmp-", ".partial-"))], \
        "the dead temp dir was removed, the train split's chunks resumed, the partial removed once published"


def _train(run, data, steps=4, **kw):
    recipe = Recipe(steps=steps, lora_layers=2, lr_lora=1e-2, **{**FAST, **kw.pop("recipe", {})})
    return train(run, data_dir=data, model="tiny-toy", recipe=recipe, **QUIET, **kw)


def test_a_cut_run_resumes_bit_exact_and_evaluates_like_the_live_backbone(tmp_path, data_dir):
    from rlcd.evaluate import evaluate_run

    data = fresh_data(tmp_path, data_dir)
    _train(tmp_path / "full", data)
    _train(tmp_path / "part", data, stop_after=2)
    train(tmp_path / "part", resume=True, **QUIET)
    a = ckpt.load(tmp_path / "full" / "checkpoints" / "last")["weights"]
    b = ckpt.load(tmp_path / "part" / "checkpoints" / "last")["weights"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(torch.count_nonzero(v) for k, v in a.items() if "lora_B" in k), "LoRA moved"
    session = json.loads((tmp_path / "full" / "metrics.jsonl").read_text().splitlines()[0])
    cut = find_cut_states(_model(), data).root
    assert session["features"] == str(cut)  # the session says which cache it reads
    assert [p.name for p in cache_root(data).iterdir()] == [cut.name]  # one, shared by both runs
    run = tmp_path / "full"
    said: list[str] = []
    evaluate_run(run, progress=False, print_fn=said.append, export=False)
    assert any(s.startswith("cut states: reading") for s in said)
    cached = [json.loads(x) for x in (run / "eval" / "predictions-test.jsonl").read_text().splitlines()]
    evaluate_run(run, progress=False, feature_cache=False, export=False)
    live = [json.loads(x) for x in (run / "eval" / "predictions-test.jsonl").read_text().splitlines()]
    assert [r["id"] for r in cached] == [r["id"] for r in live]
    diff = max(abs(x - y) for r, q in zip(cached, live) for x, y in zip(r["logits"], q["logits"]))
    assert diff < 1e-4


@pytest.mark.slow
def test_ddp_cut_gradients_match_one_process(tmp_path, data_dir):
    """2 gloo ranks on the cut-state cache (rank 0 extracts, rank 1 waits and reads) == 1 process, within 1e-5."""
    data = fresh_data(tmp_path, data_dir)
    worker = str(ROOT / "tests" / "ddp_worker.py")
    torchrun(worker, "grads", data, tmp_path, "cut", cwd=tmp_path, env={"PYTHONPATH": str(ROOT / "src")})
    ddp_worker.grads(data, tmp_path, "cut")
    ddp, ref = torch.load(tmp_path / "grads-world2.pt"), torch.load(tmp_path / "grads-world1.pt")
    assert any("lora_" in n for n in ref) and ddp.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(ddp[name], ref[name], atol=1e-5, rtol=1e-5, msg=name)


def test_lora_layers_mistakes_are_one_line_and_write_nothing(tmp_path, data_dir):
    data = fresh_data(tmp_path, data_dir)
    base = ["train", tmp_path / "r", "--data", data, "--model", "tiny-toy", "--steps", "1"]
    user_error(base + ["--recipe", "lora_layers=0"], contains="lora_layers must be none")
    user_error(base + ["--recipe", "lora_layers=9"], contains="this backbone has 4 decoder layers")
    user_error(base + ["--recipe", "lora_layers=4"], contains="give 1..3")  # all 4: nothing frozen below the cut
    user_error(["features", data, "--model", "tiny-toy", "--cut", "4"], contains="--cut 4: this backbone has 4 decoder layers")
    user_error(base + ["--recipe", "lora_layers=2", "--recipe", "head_only=true"], contains="head-only run trains no LoRA")
    assert not (tmp_path / "r").exists() and not cache_root(data).exists()
    ro = tmp_path / "ro"
    shutil.copytree(data, ro)
    (ro / "features").write_text("not a directory")  # an unwritable cache directory, even for root
    user_error(["train", tmp_path / "r2", "--data", ro, "--model", "tiny-toy", "--steps", "1", "--recipe",
                "lora_layers=2"], contains="is not writable")
    user_error(["features", ro, "--model", "tiny-toy", "--cut", "2"], contains="is not writable")
    assert not (tmp_path / "r2").exists()
    _train(tmp_path / "ok", data, steps=1)
    user_error(["train", "--resume", tmp_path / "ok", "--recipe", "lora_layers=1"], contains="would change the run's")


def test_head_only_features_from_cut_states_equal_a_full_extraction(tmp_path, data_dir):
    """A data directory with a cut-state cache gives a head-only model (LoRA everywhere, zero) its final features
    from the layers above that cut alone: the same features as a full extraction, to float32 noise."""
    from rlcd.features import ensure_features
    from rlcd.model.build import build_model

    data = fresh_data(tmp_path, data_dir)
    ensure_cut_states(_model(k=2), data, progress=False)
    head = build_model({"model": "tiny-toy", "model_seed": 0, "recipe": {}})
    below = find_cut_states(head, data, any_cut=True)
    assert below is not None and below.key["cut"] == 2
    assert find_cut_states(build_model({"model": "tiny-toy", "model_seed": 1, "recipe": {}}), data, any_cut=True) is None
    fast = ensure_features(head, data, progress=False, cut_states=below)
    assert fast.manifest["from_cut_states"] == str(below.root)
    hit = ensure_features(head, data, progress=False, cut_states=lambda: pytest.fail("a cache hit looked up cut states"))
    assert hit.root == fast.root
    shutil.rmtree(fast.root)
    full = ensure_features(head, data, progress=False)
    assert full.manifest["from_cut_states"] is None
    for split, tensors in full.tensors.items():
        for name, t in tensors.items():
            if t.is_floating_point():
                torch.testing.assert_close(fast.tensors[split][name], t, atol=1e-4, rtol=1e-4, msg=f"{split} {name}")
            else:
                assert torch.equal(fast.tensors[split][name], t), (split, name)


def test_features_from_cut_states_run_each_cases_prefix_once(tmp_path, data_dir, monkeypatch):
    """Features from a cut-state cache run a case's stored prefix once through the layers above the cut and its
    rows' suffixes on it (issue 69: 2.6x fewer tokens than whole rows on Gemma's 1k benchmark), not every row
    whole: the same features as the whole rows, to float32 noise."""
    import rlcd.model.cut_forward as cut_forward
    from rlcd.features import extract_split, split_records
    from rlcd.model.build import build_model

    data = fresh_data(tmp_path, data_dir)
    ensure_cut_states(_model("tiny-llama", k=2), data, progress=False)
    head = build_model({"model": "tiny-llama", "model_seed": 0, "recipe": {}})
    below = find_cut_states(head, data, any_cut=True)
    units: list[list[int]] = []
    real = cut_forward._shared
    monkeypatch.setattr(cut_forward, "_shared", lambda model, batch, us, *a: (units.extend(us), real(model, batch, us, *a))[1])
    records = split_records(data, None)["train"]
    by_case, index = extract_split(head, records, head.collator(image_root=data), "train", cut_states=below)
    shared_rows = sum(len(u) for u in units)
    assert units and min(len(u) for u in units) >= 2 and shared_rows >= 0.9 * len(index), (len(units), shared_rows)
    units.clear()
    rows, index_rows = extract_split(head, records, head.collator(image_root=data), "train", cut_states=below,
                                     shared=False)
    assert not units and index_rows == index
    for name, t in rows.items():
        if t.is_floating_point():
            torch.testing.assert_close(by_case[name], t, atol=1e-5, rtol=1e-5, msg=name)
        else:
            assert torch.equal(by_case[name], t), name


def test_the_feature_key_says_whether_cut_states_or_the_full_backbone_ran(tmp_path, data_dir):
    """Issue 58: features from cut states differ from a full forward's by ~1e-4, so the key records the source; a
    full-backbone cache is preferred, a cut-derived one is found without looking up cut states, and a cache built
    from cut states before the key said so is never read as the full backbone's."""
    import json

    from rlcd.features import FeatureCache, cache_root, ensure_features, feature_key, find_features, key_id
    from rlcd.model.build import build_model

    data = fresh_data(tmp_path, data_dir)
    ensure_cut_states(_model(k=2), data, progress=False)
    head = build_model({"model": "tiny-toy", "model_seed": 0, "recipe": {}})
    below = find_cut_states(head, data, any_cut=True)
    full_key, cut_key_ = feature_key(head, data), feature_key(head, data, cut_states=below)
    assert "from_cut_states" not in full_key and cut_key_["from_cut_states"] == {"cut": 2, "storage": "float32"}
    assert {k: v for k, v in cut_key_.items() if k != "from_cut_states"} == full_key
    assert key_id(full_key) != key_id(cut_key_)

    fast = ensure_features(head, data, progress=False, cut_states=lambda: below)
    assert fast.key == cut_key_ and fast.root.name == key_id(cut_key_)
    assert find_features(head, data).root == fast.root, "found without a cut-state lookup, its key says cut states"
    # the same cache as an older rlcd wrote it: the key without the field, under the full key's name
    old = cache_root(data) / key_id(full_key)
    fast.root.rename(old)
    manifest = json.loads((old / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps({**manifest, "key": full_key, "key_id": key_id(full_key)}))
    assert FeatureCache.load(old, full_key) is None and find_features(head, data) is None
    full = ensure_features(head, data, progress=False)
    assert full.root == old and full.key == full_key and full.manifest["from_cut_states"] is None, "rebuilt"
    again = ensure_features(head, data, progress=False, cut_states=lambda: pytest.fail("a full cache is there"))
    assert again.root == full.root


def test_a_top_layer_run_starts_from_a_head_only_runs_head(tmp_path, data_dir):
    """`--init` from a head-only run (LoRA zero on every layer) into `lora_layers=2`: the head and its centring
    come along, this run's LoRA (top 2 layers only) starts at zero; its step-0 dev scores are the source's."""
    from rlcd.dev_evals import read_dev_eval
    from rlcd.run import Run

    data = fresh_data(tmp_path, data_dir)
    src = tmp_path / "head"
    train(src, data_dir=data, model="tiny-toy", recipe=Recipe(steps=2, head_only=True, lr_head=5e-3, **FAST), **QUIET)
    new = tmp_path / "top"
    train(new, data_dir=data, model="tiny-toy", recipe=Recipe(steps=2, lora_layers=2, **FAST), init=src,
          stop_after=0, **QUIET)
    best = ckpt.load(src / "checkpoints" / "best")
    start = ckpt.load(new / "checkpoints" / "last")["weights"]
    for k, v in best["weights"].items():
        if k.startswith("head."):
            assert torch.equal(start[k], v), k
    assert all(torch.count_nonzero(v) == 0 for k, v in start.items() if "lora_B" in k)
    assert read_dev_eval(Run(new), 0) == read_dev_eval(Run(src), best["state"]["best_step"])
    assert json.loads((new / "config.json").read_text())["init"]["head_only"] is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU machine)")
@pytest.mark.parametrize("batch_by", ["row", "case"])
def test_cut_features_on_cuda_equal_the_cpu(tmp_path, data_dir, batch_by):
    """The top layers over cut states on a GPU, with the batch moved there as the training loop moves it, give the
    CPU's features (a case batch once mixed host index lists with device label tensors and failed on CUDA only)."""
    data = fresh_data(tmp_path, data_dir)
    s, _, _ = _first_grads(data, "tiny-llama", batch_by, True)  # on CUDA already: a run's device defaults to it
    b, model = s.microbatch(0), s.model
    with torch.no_grad():
        model.to("cpu")
        d_cpu, c_cpu = model.features(b.to("cpu"))
        assert d_cpu.device.type == "cpu"
        model.to("cuda")
        d, c = model.features(b.to("cuda"))
    assert d.device.type == "cuda"
    torch.testing.assert_close(d.cpu(), d_cpu, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(c.cpu(), c_cpu, rtol=1e-4, atol=1e-4)


def test_the_features_json_says_when_only_the_layers_above_a_cut_ran(tmp_path, data_dir):
    """`rlcd features`' JSON is what experiment tables read an extraction's cost from: a cache made from cut states
    ran only the layers above the cut, so its `extract_seconds` are not a whole backbone pass and it says so."""
    from typer.testing import CliRunner

    from rlcd.cli import app

    def features(data, *extra):
        res = CliRunner().invoke(app, ["features", str(data), "--model", "tiny-toy", *extra])
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout[res.stdout.index("{"):])

    full = features(fresh_data(tmp_path / "a", data_dir))
    assert full["from_cut_states"] is None and full["extract_seconds"] > 0
    data = fresh_data(tmp_path / "b", data_dir)
    features(data, "--cut", "2")
    derived = features(data)
    assert derived["from_cut_states"] == {"cut": 2, "storage": "float32"}
    assert derived["key_id"] != full["key_id"] and derived["entries"] == full["entries"]


def test_too_little_disk_to_assemble_is_one_line_and_keeps_the_extracted_chunks(tmp_path, data_dir, monkeypatch):
    """Assembling a split copies its chunks end to end (a peak of twice its size): when the disk cannot hold that,
    `rlcd features --cut` ends (after its progress lines) with one line naming the split, the bytes and the partial
    directory, exit 2, and publishes nothing; freeing space and re-running computes no chunk again."""
    import collections

    from typer.testing import CliRunner

    import rlcd.files
    from rlcd.cli import app

    data = fresh_data(tmp_path, data_dir)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(rlcd.files.shutil, "disk_usage", lambda p: usage(1 << 40, 1 << 40, 1 << 20))
    res = CliRunner().invoke(app, ["features", str(data), "--model", "tiny-toy", "--cut", "2"])
    last = res.stderr.strip().splitlines()[-1]
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert last.startswith("rlcd: error: assembling the train split's cut states needs ") and \
        "only 1.0 MiB are free" in last and ".partial-cut-" in last, last
    root = cache_root(data)
    (partial,) = [p for p in root.iterdir() if p.name.startswith(".partial-cut-")]
    assert sorted(p.name for p in partial.glob("train-*.states.bin")), "the train split's chunks were kept"
    assert not [p for p in root.iterdir() if not p.name.startswith((".partial-", ".tmp-"))], "nothing published"
    monkeypatch.undo()
    said = []
    built = ensure_cut_states(_model(), data, progress=False, say=said.append)
    train = built.manifest["splits"]["train"]["entries"]
    assert built.manifest["complete"] and [s for s in said if f": {train} of " in s], said
