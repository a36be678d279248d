"""Prompt rendering (segments, positions, rejections) and collation (toy vocabulary)."""

import numpy as np
import pytest
import torch
from PIL import Image

torch.set_num_threads(1)

from rlcd.model.backbone import make_image_processor  # noqa: E402
from rlcd.model.collate import Batch, Collator  # noqa: E402
from rlcd.model.prompt import PromptEncoder, option_texts, render_text  # noqa: E402
from rlcd.model.tokenizer import toy_tokenizer  # noqa: E402
from rlcd.model.tokenizer import QWEN_MARKER as MARKER_TOKEN  # noqa: E402
from rlcd.schema import TYPE_ID, Question, Record, RecordError  # noqa: E402


@pytest.fixture(scope="module")
def enc():
    return PromptEncoder(toy_tokenizer())


def q_choice(**kw):
    return Question(type="choice", instructions="Which colour is the ball?", criteria=["red", "green", "blue"], **kw)


def test_option_texts_per_type():
    assert option_texts(q_choice()) == ["red", "green", "blue"]
    q = Question(type="choice", instructions="x", criteria={"a": "first", "b": "sécond"})
    assert option_texts(q) == ["a: first", "b: sécond"]
    assert option_texts(Question(type="noul", instructions="x")) == ["false: no", "true: yes"]
    q = Question(type="noul", instructions="x", criteria={"true": "it is", "false": "it is not"})
    assert option_texts(q) == ["false: it is not", "true: it is"]
    q = Question(type="score", instructions="x", criteria=["low", "mid", "high"])
    assert option_texts(q) == ["level 0: low", "level 1: mid", "level 2: high"]


def test_row_layout_positions_and_exactly_k_markers(enc):
    tok = enc.tokenizer
    state = {"ball": "red", "size": "big é"}
    q = Question(type="score", instructions={"ask": "how big?"}, criteria=["small", "medium", "large", "huge"])
    row = enc.encode(state, q, row="r1")
    text = tok.decode(row.ids)
    assert text == render_text(state, q)
    assert text.startswith('State: {"ball": "red", "size": "big é"}\nscore question: {"ask": "how big?"}\nOptions:\n')
    # decision position = last token of the stem; nothing of the candidates before it
    assert tok.decode(row.ids[: row.decision_pos + 1]).endswith("Options:\n")
    assert tok.decode(row.ids[row.decision_pos + 1:]).startswith("- level 0: small" + MARKER_TOKEN)
    marker = tok.convert_tokens_to_ids(MARKER_TOKEN)
    assert [i for i, t in enumerate(row.ids) if t == marker] == row.marker_pos
    assert row.k == q.k == 4
    assert all(row.decision_pos < m for m in row.marker_pos)
    # the prefix is exactly the state segment, shared by any question about this state
    other = enc.encode(state, q_choice(), row="r2")
    assert other.ids[: other.prefix_len] == row.ids[: row.prefix_len]
    assert tok.decode(row.ids[: row.prefix_len]) == 'State: {"ball": "red", "size": "big é"}\n'


def test_image_segment(enc):
    row = enc.encode("s", q_choice(), n_image_tokens=6)
    assert row.ids[0] == enc.vision_start_id
    assert row.ids[1:7] == [enc.image_pad_id] * 6
    assert row.ids[7] == enc.vision_end_id
    assert enc.tokenizer.decode(row.ids[8:row.prefix_len]) == "\nState: s\n"
    assert row.image_start == 1 and row.n_image_tokens == 6


@pytest.mark.parametrize("where", ["state", "instructions", "label", "description"])
@pytest.mark.parametrize("token", [MARKER_TOKEN, "<|image_pad|>", "<|im_start|>"])
def test_reserved_token_text_rejected(enc, where, token):
    state, instr, crit = "a state", "a question", ["a", "b"]
    if where == "state":
        state = f"before {token} after"
    elif where == "instructions":
        instr = {"text": f"x{token}"}
    elif where == "label":
        crit = ["a", f"b{token}"]
    else:
        crit = {"a": "fine", "b": f"also {token}"}
    q = Question.model_construct(type="choice", instructions=instr, criteria=crit)  # bypass schema checks
    with pytest.raises(RecordError) as ei:
        enc.encode(state, q, row="row-7")
    msg = str(ei.value)
    assert "row-7" in msg and "reserved token" in msg and token in msg
    field = {"state": "state", "instructions": "question.instructions"}.get(where, "question.criteria")
    assert ei.value.field == field


def test_oversize_row_rejected_not_truncated(enc):
    small = PromptEncoder(enc.tokenizer, max_tokens=60)
    ok = small.encode("short", q_choice(), row="fits")
    assert len(ok) <= 60
    with pytest.raises(RecordError) as ei:
        small.encode("word " * 80, q_choice(), row="too-long")
    assert "too-long" in str(ei.value) and "max_tokens=60" in str(ei.value) and ei.value.field == "tokens"
    # image tokens count towards the limit
    n_text = len(ok)
    with pytest.raises(RecordError) as ei:
        small.encode("short", q_choice(), n_image_tokens=60 - n_text, row="img")
    assert "image tokens" in str(ei.value)


@pytest.mark.parametrize("k", [0, 1, 256])
def test_bad_candidate_counts_rejected(enc, k):
    q = Question.model_construct(type="choice", instructions="x", criteria=[f"l{i}" for i in range(k)])
    with pytest.raises(RecordError) as ei:
        enc.encode("s", q, row="cands")
    assert "cands" in str(ei.value) and "2..255" in str(ei.value)


def test_255_candidates_accepted(enc):
    q = Question(type="choice", instructions="x", criteria=[f"l{i}" for i in range(255)])
    assert enc.encode("s", q).k == 255


def test_missing_marker_is_caught(enc):
    stem, cands = enc.question_segments(q_choice())
    cands[1] = cands[1][:-2]  # drop a marker
    with pytest.raises(AssertionError):
        enc.assemble(enc.prefix_ids("s"), stem, cands, row="bad")


def _record(rid, state, question, target, image=None, **kw):
    return Record(id=rid, source="src", task="t", state=state, image=image, question=question, target=target, **kw)


def test_collator_batch_fields(tmp_path):
    (tmp_path / "images").mkdir()
    rng = np.random.RandomState(0)
    Image.fromarray((rng.rand(64, 96, 3) * 255).astype("uint8")).save(tmp_path / "images" / "a.png")
    Image.fromarray((rng.rand(128, 64, 3) * 255).astype("uint8")).save(tmp_path / "images" / "b.png")
    recs = [
        _record("r1", "one", Question(type="noul", instructions="big?"), [0.25, 0.75], image="images/a.png"),
        _record("r2", {"s": "two"}, q_choice(), [0, 1, 0]),
        _record("r3", "three", Question(type="score", instructions="how?", criteria=list("abcd")), [0, 0, 1, 0],
                image="images/b.png"),
    ]
    b = Collator(toy_tokenizer(), make_image_processor(), image_root=tmp_path)(recs)
    assert isinstance(b, Batch) and len(b) == 3 and b.kmax == 4
    lengths = b.attention_mask.sum(1)
    for i in range(3):  # right padding
        assert b.attention_mask[i, : lengths[i]].all() and not b.attention_mask[i, lengths[i]:].any()
    assert b.n_tokens == int(lengths.sum())
    assert b.cand_mask.tolist() == [[True, True, False, False], [True, True, True, False], [True] * 4]
    assert torch.allclose(b.target[0], torch.tensor([0.25, 0.75, 0, 0]))
    assert b.ordinal.tolist() == [False, False, True]
    assert b.type_id.tolist() == [TYPE_ID["noul"], TYPE_ID["choice"], TYPE_ID["score"]]
    assert b.ids == ["r1", "r2", "r3"] and b.groups == ["src/en/t"] * 3 and b.types == ["noul", "choice", "score"]
    # images: 64x96 -> grid 1x4x6 -> 6 tokens; 128x64 -> 1x8x4 -> 8 tokens
    assert b.image_grid_thw.tolist() == [[1, 4, 6], [1, 8, 4]]
    assert b.pixel_values.shape[0] == 24 + 32
    assert b.mm_token_type_ids.sum(1).tolist() == [6, 0, 8]
    image_pad = toy_tokenizer().convert_tokens_to_ids("<|image_pad|>")
    assert torch.equal(b.mm_token_type_ids.bool(), b.input_ids == image_pad)
    marker = toy_tokenizer().convert_tokens_to_ids(MARKER_TOKEN)
    for i in range(3):
        k = int(b.cand_mask[i].sum())
        assert (b.input_ids[i, b.marker_pos[i, :k]] == marker).all()
        assert int((b.input_ids[i] == marker).sum()) == k
        assert b.decision_pos[i] < b.marker_pos[i, 0]
    moved = b.to("cpu")
    assert moved.ids == b.ids and torch.equal(moved.input_ids, b.input_ids)


def test_collator_missing_image_names_row(tmp_path):
    rec = _record("img-row", "s", q_choice(), [1, 0, 0], image="images/nope.png")
    with pytest.raises(RecordError) as ei:
        Collator(toy_tokenizer(), make_image_processor(), image_root=tmp_path)([rec])
    assert "img-row" in str(ei.value) and ei.value.field == "image"
