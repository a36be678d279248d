"""DecisionModel: decision position, LoRA step, merge, trainable state, shared prefix vs full forwards."""


import numpy as np
import pytest
import torch
from PIL import Image

torch.set_num_threads(1)

from rlcd.model import prefix_forward as PF  # noqa: E402
from rlcd.model.backbone import load_backbone  # noqa: E402
from rlcd.model.collate import pad_rows  # noqa: E402
from rlcd.model.build import build_model  # noqa: E402
from rlcd.model.decision import DecisionModel  # noqa: E402
from rlcd.model.plan import plan_suffix_groups  # noqa: E402
from rlcd.schema import Question  # noqa: E402
from rlcd.model.runner import CaseRunner  # noqa: E402

STATE = {"ticket": "Parcel arrived damaged, the box was crushed and the vase inside is broken.", "priority": "high"}
QS = [
    Question(type="choice", instructions="Which team should handle it?", criteria=["billing", "shipping", "support"]),
    Question(type="noul", instructions="Is a refund requested?"),
    Question(type="score", instructions="How urgent is it?", criteria=["not urgent", "somewhat", "urgent", "critical"]),
    Question(type="choice", instructions="Which product category?",
             criteria={"home": "furniture, vases and decoration", "toys": "games for children",
                       "garden": "plants, tools and outdoor furniture", "books": "printed books",
                       "food": "groceries and drinks"}),
    Question(type="noul", instructions={"ask": "Does the customer mention a photo?", "lang": "en"},
             criteria={"false": "no photo is mentioned", "true": "a photo is mentioned or attached"}),
    Question(type="choice", instructions="Which team should handle it?", criteria=["sales", "logistics"]),
]


def toy(seed=0, **kw):
    return DecisionModel(load_backbone("tiny-toy", seed=seed), seed=seed, **kw)


def batch_of(dm, state=STATE, qs=QS, targets=None):
    rows = CaseRunner(dm).cases.rows(state, qs)
    return pad_rows(rows, pad_id=dm.encoder.pad_id, image_pad_id=dm.encoder.image_pad_id,
                    types=[q.type for q in qs], targets=targets)


def liven(dm, scale_to=3.0):
    """Centre the random head on a batch and scale it so logits are O(1) (differences become visible)."""
    with torch.no_grad():
        b = batch_of(dm)
        dm.init_centring([b])
        lg = dm(b)
        dm.head.w_d.weight.mul_(scale_to / float(lg[b.cand_mask].std()))
    return dm


def image(seed=0, size=(96, 64)):
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(size[1], size[0], 3) * 255).astype("uint8"))


def assert_match(shared, full, min_scale=0.5):
    assert len(shared) == len(full)
    assert max(float(f.abs().max()) for f in full) > min_scale, "logits too small for a meaningful comparison"
    for s, f in zip(shared, full):
        assert s.shape == f.shape and s.dtype == torch.float32
        torch.testing.assert_close(s, f, atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------------------------------------


def test_forward_shapes_dtype_and_padding():
    dm = toy().eval()
    b = batch_of(dm)
    with torch.no_grad():
        lg = dm(b)
    assert lg.shape == (len(QS), 5) and lg.dtype == torch.float32
    assert torch.equal(torch.isinf(lg), ~b.cand_mask) and (lg[~b.cand_mask] < 0).all()


def test_bf16_backbone_gives_fp32_logits():
    dm = DecisionModel(load_backbone("tiny-toy", dtype=torch.bfloat16)).eval()
    with torch.no_grad():
        lg = dm(batch_of(dm))
    assert lg.dtype == torch.float32 and dm.head.w_d.weight.dtype == torch.float32
    assert torch.isfinite(lg[batch_of(dm).cand_mask]).all()


def test_decision_position_sees_no_candidate():
    dm = toy().eval()
    q = QS[0]
    variants = [q, Question(type="choice", instructions=q.instructions, criteria=["a", "b"]),
                Question(type="choice", instructions=q.instructions, criteria={"x": "long " * 30, "y": "z", "w": "v"})]
    with torch.no_grad():
        h = [dm.features(batch_of(dm, qs=[v]))[0][0] for v in variants]
        together = dm.features(batch_of(dm, qs=variants))[0]  # padded batch
        changed = dm.features(batch_of(dm, qs=[Question(type="choice", instructions="Who pays?",
                                                        criteria=["a", "b"])]))[0][0]
    for x in h[1:] + list(together):
        torch.testing.assert_close(x, h[0], atol=1e-6, rtol=1e-6)
    assert (changed - h[0]).abs().max() > 1e-3, "the decision state must depend on the instructions"


def _ce(logits, target, mask):
    logp = torch.log_softmax(logits.masked_fill(~mask, -1e9), -1)
    return -(logp * target).sum(-1).mean()


def _train(dm, steps=1, lr=1e-2, head_lr=None):
    b = batch_of(dm, targets=[[0, 1, 0], [1, 0], [0, 0, 0, 1], [0, 0, 0, 0, 1], [0, 1], [1, 0]])
    groups = dm.param_groups()
    opt = torch.optim.AdamW([{"params": groups["lora"], "lr": lr},
                             {"params": groups["head"], "lr": lr if head_lr is None else head_lr}], lr=lr)
    dm.train()
    for _ in range(steps):
        opt.zero_grad()
        _ce(dm(b), b.target, b.cand_mask).backward()
        opt.step()
    dm.eval()
    return b


def test_lora_step_changes_output_and_vision_stays_bit_identical():
    dm = liven(toy())
    frozen = {n: p.detach().clone() for n, p in dm.named_parameters() if not p.requires_grad}
    lora0 = {n: p.detach().clone() for n, p in dm.backbone.named_parameters() if "lora_B" in n}
    b = batch_of(dm)
    with torch.no_grad():
        before = dm(b)
    _train(dm, steps=1)
    with torch.no_grad():
        after = dm(b)
    assert (after - before)[b.cand_mask].abs().max() > 1e-3
    assert any(not torch.equal(p, lora0[n]) for n, p in dm.backbone.named_parameters() if "lora_B" in n)
    for n, p in dm.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"frozen parameter {n} changed"
    assert any(".visual." in n for n in frozen)
    assert all(p.grad is None for p in dm.vision.parameters())


def test_merge_parity():
    dm = liven(toy(), scale_to=1.0)
    _train(dm, steps=1, lr=1e-4, head_lr=0.0)  # the recipe's LoRA learning rate
    b = batch_of(dm)
    base = toy()  # same backbone without the trained adapters
    base.head.load_state_dict(dm.head.state_dict())
    with torch.no_grad():
        unmerged = dm(b)
        plain = base(b)
        dm.merge()
        merged = dm(b)
    assert (unmerged - plain)[b.cand_mask].abs().max() > 1e-2, "LoRA must matter for this check to mean anything"
    assert unmerged[b.cand_mask].abs().max() > 0.5
    torch.testing.assert_close(merged, unmerged, atol=1e-4, rtol=0)
    assert dm.merged and dm.param_groups()["lora"] == []
    assert not any("lora_" in n for n, _ in dm.named_parameters())
    assert not any(p.requires_grad for p in dm.backbone.parameters())
    assert dm.info["lora"]["merged"] is True
    dm.train()
    assert not dm.vision.training


def test_trainable_state_dict_round_trip(tmp_path):
    from safetensors.torch import load_file, save_file

    a = liven(toy())
    _train(a, steps=2)
    sd = a.trainable_state_dict()
    assert any(k.startswith("lora.") for k in sd) and {"head.mu_d", "head.mu_c", "head.centring_ready",
                                                        "head.w_d.weight", "head.w_c.weight"} <= set(sd)
    save_file(sd, str(tmp_path / "t.safetensors"))
    b_model = toy(seed=0)
    b = batch_of(a)
    with torch.no_grad():
        la = a(b)
        assert not torch.allclose(b_model(b), la, atol=1e-4)
        b_model.load_trainable_state_dict(load_file(str(tmp_path / "t.safetensors")))
        lb = b_model(b)
    assert torch.equal(la, lb)
    assert set(b_model.trainable_state_dict()) == set(sd)
    with pytest.raises(KeyError):
        b_model.load_trainable_state_dict({k: v for k, v in sd.items() if k != "head.mu_d"})


def test_init_centring_from_batches():
    dm = toy()
    b1, b2 = batch_of(dm, qs=QS[:3]), batch_of(dm, qs=QS[3:])
    n = dm.init_centring([b1, b2])
    assert n == len(QS)
    with torch.no_grad():
        d1, c1 = dm.features(b1)
        d2, c2 = dm.features(b2)
    torch.testing.assert_close(dm.head.mu_d, torch.cat([d1, d2]).mean(0))
    torch.testing.assert_close(dm.head.mu_c, torch.cat([c1[b1.cand_mask], c2[b2.cand_mask]]).mean(0))


# ----------------------------------------------------------------------------- shared prefix


def test_plan_suffix_groups():
    lengths = [27, 82, 28, 60, 29, 81, 40, 30]
    groups = plan_suffix_groups(lengths, max_rows=3)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(len(g) <= 3 for g in groups)
    assert plan_suffix_groups([30] * 10) == [list(range(10))]


def test_shared_prefix_equals_full_forwards_text():
    dm = liven(toy())
    full = CaseRunner(dm).score_full(STATE, QS, batch_size=1)
    shared, usage = CaseRunner(dm).score_case(STATE, QS)
    assert_match(shared, full)
    assert usage["rows"] == len(QS) and usage["prefix_tokens"] > 10
    assert usage["input_tokens"] == usage["prefix_tokens"] + usage["full_tokens"] - len(QS) * usage["prefix_tokens"]
    assert CaseRunner(dm).n_tokens(STATE, QS)["input_tokens"] == usage["input_tokens"]
    # many small calls (each from its own copy of the prefix cache) give the same logits
    small, usage2 = CaseRunner(dm).score_case(STATE, QS, max_rows=2)
    assert usage2["calls"] >= 4
    assert_match(small, full)
    # batched full forwards agree too
    assert_match(CaseRunner(dm).score_full(STATE, QS, batch_size=4), full)


def test_shared_prefix_exact_mode_cuts_on_the_chunk_grid():
    dm = liven(toy())
    state = dict(STATE, notes="The customer called twice and wrote an email about the broken vase. " * 2)
    full = CaseRunner(dm).score_full(state, QS)
    fast = CaseRunner(dm).score_case(state, QS)[1]["prefix_tokens"]
    shared, usage = CaseRunner(dm).score_case(state, QS, exact=True)
    assert usage["prefix_tokens"] % 64 == 0 and 0 < usage["prefix_tokens"] <= fast
    assert_match(shared, full)


def test_shared_prefix_cache_must_be_copied():
    """Negative control: without a fork per call the linear-attention state leaks between calls."""
    dm = liven(toy())
    full = CaseRunner(dm).score_full(STATE, QS)
    orig = PF.fork_cache_rows

    def no_fork(cache, index):  # the same cache object, reordered in place: states shared across calls
        cache.reorder_cache(index)
        return cache

    try:
        PF.fork_cache_rows = no_fork
        broken = CaseRunner(dm).score_case(STATE, QS, max_rows=2)[0]
        leak = max(float((s - f).abs().max()) for s, f in zip(broken, full))
    except RuntimeError:  # or loudly: a later call finds the shared cache resized by an earlier one
        leak = float("inf")
    finally:
        PF.fork_cache_rows = orig
    assert leak > 1e-3


@pytest.mark.parametrize("case", ["identical_instructions", "identical_rows", "single_question"])
def test_shared_prefix_decision_position_edge_cases(case):
    dm = liven(toy())
    same = "Which team should handle it?"
    if case == "identical_instructions":  # common prefix runs past the stem: cut capped at the decision
        qs = [Question(type="choice", instructions=same, criteria=["billing", "shipping"]),
              Question(type="choice", instructions=same, criteria=["billing", "support", "sales"]),
              Question(type="choice", instructions=same, criteria=["logistics", "support"])]
    elif case == "identical_rows":
        qs = [QS[2], QS[2], QS[2]]
    else:
        qs = [QS[3]]
    rows = CaseRunner(dm).cases.rows(STATE, qs)
    full = CaseRunner(dm).score_full(STATE, qs)
    shared, usage = CaseRunner(dm).score_case(STATE, qs, path="prefix")  # forced: one question plans full rows
    assert usage["prefix_tokens"] == min(r.decision_pos for r in rows)
    assert_match(shared, full)
    if case == "identical_rows":
        assert torch.equal(shared[0], shared[1]) and torch.equal(shared[1], shared[2])


def test_shared_prefix_equals_full_forwards_with_one_image():
    dm = liven(toy())
    img = image(0, (96, 64))
    full = CaseRunner(dm).score_full(STATE, QS, image=img)
    shared, usage = CaseRunner(dm).score_case(STATE, QS, image=img)
    assert usage["image_tokens"] == 6
    assert_match(shared, full)
    text_only = CaseRunner(dm).score_case(STATE, QS)[0]
    assert max(float((a - b).abs().max()) for a, b in zip(shared, text_only)) > 1e-3, "the image must matter"
    # identical instructions with an image (cut capped at the decision position)
    qs = [QS[0], Question(type="choice", instructions=QS[0].instructions, criteria=["x", "y"])]
    assert_match(CaseRunner(dm).score_case(STATE, qs, image=img)[0], CaseRunner(dm).score_full(STATE, qs, image=img))
    # a text request after an image request is unaffected (no stale rope state)
    torch.testing.assert_close(CaseRunner(dm).score_case(STATE, QS)[0][0], text_only[0], atol=0, rtol=0)


def test_image_encoded_once_per_request():
    dm = liven(toy())
    calls = []
    handle = dm.vision.register_forward_hook(lambda m, args, kwargs_out=None: calls.append(1))
    try:
        CaseRunner(dm).score_case(STATE, QS, image=image(1))[0]
        assert len(calls) == 1
        calls.clear()
        CaseRunner(dm).score_full(STATE, QS, image=image(1), batch_size=1)
        assert len(calls) == len(QS)  # control: the row-by-row path encodes it every time
        calls.clear()
        CaseRunner(dm).score_case(STATE, QS)[0]
        assert not calls
    finally:
        handle.remove()


def test_score_case_rejects_bad_rows_with_ids():
    from rlcd.schema import RecordError

    dm = toy()
    bad = Question.model_construct(type="choice", instructions="x <|fim_suffix|>", criteria=["a", "b"])
    with pytest.raises(RecordError) as ei:
        CaseRunner(dm).score_case(STATE, [QS[0], bad], ids=["ok", "bad-q"])[0]
    assert ei.value.row == "bad-q"


def test_real_vocabulary_tiny_shared_prefix():
    dm = liven(build_model({"model": "tiny", "recipe": {}}))
    assert dm.info["vocab"] == "qwen3.5" and dm.info["marker_id"] == 248062 and dm.info["hidden_size"] == 256
    qs = QS[:4]
    assert_match(CaseRunner(dm).score_case(STATE, qs)[0], CaseRunner(dm).score_full(STATE, qs))
