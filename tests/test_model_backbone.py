"""Backbone presets, deterministic tiny weights, offline hub failure, save/load, LoRA placement, positions."""

import re
import socket

import pytest
import torch
from torch import nn

torch.set_num_threads(1)

from rlcd.model.backbone import (  # noqa: E402
    LORA_TARGET_REGEX,
    PRESETS,
    config_hash,
    language_linear_names,
    load_backbone,
    save_backbone,
)
from rlcd.model.collate import pad_rows  # noqa: E402
from rlcd.model.decision import DecisionModel, mrope_positions  # noqa: E402
from rlcd.schema import Question  # noqa: E402
from rlcd.model.runner import CaseRunner  # noqa: E402

QS = [
    Question(type="choice", instructions="Which colour?", criteria=["red", "green", "blue"]),
    Question(type="noul", instructions="Is it big?"),
    Question(type="score", instructions="How big?", criteria=["tiny", "small", "medium", "large"]),
]
STATE = {"text": "a big red ball on the grass", "n": 3}


def _batch(dm, state=STATE, qs=QS):
    rows = CaseRunner(dm).cases.rows(state, qs)
    return pad_rows(rows, pad_id=dm.encoder.pad_id, image_pad_id=dm.encoder.image_pad_id, types=[q.type for q in qs])


def test_presets():
    assert PRESETS["qwen3.5-0.8b"]["hub_id"] == "Qwen/Qwen3.5-0.8B"
    assert PRESETS["qwen3.5-0.8b"]["revision"] == "2fc06364715b967f1860aea9cf38778875588b17"
    assert PRESETS["qwen3.5-2b"]["hub_id"] == "Qwen/Qwen3.5-2B"
    assert PRESETS["qwen3.5-2b"]["revision"] == "15852e8c16360a2fea060d615a32b45270f8a8fc"
    assert PRESETS["tiny"]["hidden"] == 256 and PRESETS["tiny"]["vocab"] == "qwen"
    assert PRESETS["tiny-toy"]["vocab"] == "toy"


def test_tiny_toy_structure_and_info():
    bb = load_backbone("tiny-toy")
    cfg = bb.model.config
    assert type(bb.model).__name__ == "Qwen3_5ForConditionalGeneration"
    assert cfg.text_config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg.vision_config.depth == 2 and cfg.vision_config.out_hidden_size == cfg.text_config.hidden_size == 64
    info = bb.info
    assert info["preset"] == "tiny-toy" and info["hidden_size"] == 64 and info["seed"] == 0
    assert info["config_hash"] == config_hash(cfg) and len(info["config_hash"]) == 64
    assert info["marker_token"] == "<|fim_suffix|>" and info["marker_id"] == bb.tokenizer.convert_tokens_to_ids("<|fim_suffix|>")
    assert info["vocab"] == "toy-1024"
    assert cfg.image_token_id == bb.tokenizer.convert_tokens_to_ids("<|image_pad|>")


def test_random_weights_deterministic_from_seed():
    a, b, c = (load_backbone("tiny-toy", seed=s).model for s in (0, 0, 1))
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert any(not torch.equal(pa[n], pc[n]) for n in pa)
    rng_state = torch.get_rng_state()
    load_backbone("tiny-toy", seed=3)
    assert torch.equal(torch.get_rng_state(), rng_state), "building must not consume the global RNG"


@pytest.mark.parametrize("preset", ["qwen3.5-0.8b", "qwen3.5-2b"])
def test_hub_preset_offline_fails_with_clear_message(preset, tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    assert hc.HF_HUB_OFFLINE, "tests must run with HF_HUB_OFFLINE=1 (tests/conftest.py)"
    attempts = []

    def no_network(*a, **k):
        attempts.append(a)
        raise OSError("network disabled in tests")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    with pytest.raises(RuntimeError) as ei:
        load_backbone(preset, cache_dir=str(tmp_path))  # empty cache: a local hub copy cannot be used
    msg = str(ei.value)
    assert not attempts, "loading must not touch the network"
    assert PRESETS[preset]["hub_id"] in msg and PRESETS[preset]["revision"] in msg
    assert "no network" in msg and "--model" in msg and "local directory" in msg and "save_pretrained" in msg


def test_unknown_spec_rejected():
    with pytest.raises(ValueError, match="unknown backbone"):
        load_backbone("no-such-preset")


def test_save_backbone_local_dir_identical_logits(tmp_path):
    bb = load_backbone("tiny-toy", seed=5)
    save_backbone(bb, tmp_path / "bb")
    loaded = load_backbone(str(tmp_path / "bb"))
    assert loaded.info["source"] == "local" and loaded.info["preset"] == "tiny-toy"
    assert loaded.info["config_hash"] == bb.info["config_hash"] and "saved_config_hash" not in loaded.info
    assert loaded.info["seed"] == 5
    a = DecisionModel(bb, seed=0).eval()
    b = DecisionModel(loaded, seed=0).eval()
    with torch.no_grad():
        a.head.w_d.weight.mul_(100)
        b.head.w_d.weight.mul_(100)
        la, lb = a(_batch(a)), b(_batch(b))
    assert la[torch.isfinite(la)].abs().max() > 0.1
    assert torch.equal(la, lb)
    other = DecisionModel(load_backbone("tiny-toy", seed=6), seed=0).eval()
    with torch.no_grad():
        other.head.w_d.weight.mul_(100)
        assert not torch.allclose(other(_batch(other)), la, atol=1e-4)


def test_lora_only_on_language_linears_and_vision_frozen():
    lang = set(language_linear_names(load_backbone("tiny-toy").model))  # before wrapping
    dm = DecisionModel(load_backbone("tiny-toy"))
    base = dm.backbone.get_base_model()
    assert set(language_linear_names(base)) == lang
    assert len(lang) == 3 * (5 + 3) + (4 + 3)  # 3 DeltaNet layers, 1 full-attention layer
    wrapped = {n for n, m in base.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == lang, "every language nn.Linear gets an adapter, nothing else"
    assert not any("visual" in n or "lm_head" in n for n in wrapped)
    for n in lang:
        assert re.fullmatch(LORA_TARGET_REGEX, n)
    vision_linears = [n for n, m in base.named_modules() if isinstance(m, nn.Linear) and ".visual." in n]
    assert vision_linears and not any(re.fullmatch(LORA_TARGET_REGEX, n) for n in vision_linears)
    trainable = [n for n, p in dm.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or n.startswith("head.") for n in trainable)
    assert not any(p.requires_grad for p in dm.vision.parameters())
    groups = dm.param_groups()
    assert set(groups) == {"lora", "head"}
    assert len(groups["lora"]) == 2 * len(lang) and len(groups["head"]) == 2
    assert {id(p) for g in groups.values() for p in g} == {id(p) for p in dm.parameters() if p.requires_grad}
    dm.train()
    assert dm.training and dm.head.training and not dm.vision.training
    assert all(not m.training for m in dm.vision.modules())
    info = dm.info
    assert info["lora"]["r"] == 8 and info["lora"]["alpha"] == 16 and info["lora"]["dropout"] == 0.0
    assert info["centring"] == "running_mean" and info["head"]["proj_dim"] == 256


def test_mrope_positions_match_transformers(tmp_path):
    from PIL import Image

    from rlcd.model.collate import Collator
    from rlcd.schema import Record

    dm = DecisionModel(load_backbone("tiny-toy"))
    for name, size in (("a.png", (96, 64)), ("b.png", (64, 128))):
        Image.new("RGB", size, (200, 10, 10)).save(tmp_path / name)
    recs = [
        Record(id="1", source="s", task="t", state="one", image="a.png", question=QS[1], target=[1, 0]),
        Record(id="2", source="s", task="t", state="two words", question=QS[0], target=[1, 0, 0]),
        Record(id="3", source="s", task="t", state="3", image="b.png", question=QS[2], target=[0, 1, 0, 0]),
    ]
    b = Collator(dm.tokenizer, dm.image_processor, image_root=tmp_path)(recs)
    core = dm.decoder()
    ref, _ = core.get_rope_index(b.input_ids, mm_token_type_ids=b.mm_token_type_ids,
                                 image_grid_thw=b.image_grid_thw, attention_mask=b.attention_mask)
    mine = mrope_positions(b.input_ids, b.mm_token_type_ids, b.image_grid_thw, dm.merge_size)
    for i in range(3):
        real = b.attention_mask[i].bool()
        assert torch.equal(ref[:, i, real], mine[:, i, real])
    assert not torch.equal(mine[0], mine[1]), "image rows must have 3-D positions"
    # and the hand-driven forward equals the transformers forward of the inner model
    with torch.no_grad():
        core.rope_deltas = None
        hf = core(input_ids=b.input_ids, attention_mask=b.attention_mask, pixel_values=b.pixel_values,
                  image_grid_thw=b.image_grid_thw, mm_token_type_ids=b.mm_token_type_ids).last_hidden_state
        ours = dm.hidden_states(b)
    for i in range(3):
        real = b.attention_mask[i].bool()
        torch.testing.assert_close(ours[i, real], hf[i, real], atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------ issue 70: a bad .gguf is one line


def _bad_ggufs(base):
    import struct

    base.mkdir(parents=True, exist_ok=True)
    (base / "empty.gguf").write_bytes(b"")
    (base / "junk.gguf").write_bytes(b"<html>not a model</html>" * 40)
    # a GGUF header promising 3 tensors and 2 metadata entries, cut after the counts: a download that stopped
    (base / "cut.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 3, 2) + b"\x05\x00")
    return {"empty.gguf": "is empty (0 bytes)", "junk.gguf": "does not start with the GGUF magic bytes",
            "cut.gguf": "truncated or corrupt", "missing.gguf": "no such .gguf file"}


def test_an_empty_corrupt_or_missing_gguf_is_one_line_for_train_and_prepare(tmp_path):
    """Before: a 160-line traceback (empty: "cannot mmap an empty file"; cut: a struct error) and a missing file
    called an "unknown backbone". Each is one line, exit 2, nothing written, for `train` and `data prepare`."""
    from conftest import synth_processed, user_error

    data = synth_processed(tmp_path, 6, seed=1)
    for name, says in _bad_ggufs(tmp_path / "models").items():
        model = tmp_path / "models" / name
        user_error(["train", tmp_path / f"run-{name}", "--data", data, "--model", model, "--steps", "1"],
                   contains=says, max_lines=2)
        assert not (tmp_path / f"run-{name}").exists()
        user_error(["data", "prepare", tmp_path / "synth.jsonl", "--out", tmp_path / f"p-{name}", "--model", model],
                   contains=says, max_lines=2)
        assert not (tmp_path / f"p-{name}").exists()
