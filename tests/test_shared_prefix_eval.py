"""Shared-prefix features and evaluation: the prefix path equals full rows (tiny = Qwen3.5 VLM, tiny-llama
= text decoder; with and without images), records grouped into cases, the per-case path planner."""

import numpy as np
import pytest
import torch
from PIL import Image

torch.set_num_threads(1)

from rlcd.model.build import build_model  # noqa: E402
from rlcd.schema import Question, Record  # noqa: E402
from rlcd.model.runner import CaseRunner  # noqa: E402

STATE = {"ticket": "Parcel arrived damaged, the box was crushed and the vase inside is broken.", "priority": "high"}
QS = [
    Question(type="choice", instructions="Which team should handle it?", criteria=["billing", "shipping", "support"]),
    Question(type="noul", instructions="Is a refund requested?"),
    Question(type="score", instructions="How urgent is it?", criteria=["not urgent", "somewhat", "urgent", "critical"]),
    Question(type="choice", instructions="Which product category?",
             criteria={"home": "furniture and vases", "toys": "games", "garden": "plants and tools"}),
]
_MODELS: dict = {}


def model(preset):
    """A cached random model with its head centred and scaled so logits are O(1) (differences visible)."""
    if preset not in _MODELS:
        dm = build_model({"model": preset, "recipe": {}}).eval()
        from rlcd.model.collate import pad_rows

        with torch.no_grad():
            rows = CaseRunner(dm).cases.rows(STATE, QS)
            b = pad_rows(rows, pad_id=dm.encoder.pad_id, image_pad_id=dm.encoder.image_pad_id)
            dm.init_centring([b])
            lg = dm(b)
            dm.head.w_d.weight.mul_(3.0 / float(lg[b.cand_mask].std()))
        _MODELS[preset] = dm
    return _MODELS[preset]


def normalise(dm, recs, collate):
    """Rescale the head so the full-row logits of `recs` have standard deviation 1 (logits are linear in
    W_d): a max abs logit difference of 1e-4 then means the same thing for every model and state."""
    with torch.inference_mode():
        b = collate(recs)
        std = float(dm(b)[b.cand_mask].float().std())
    with torch.no_grad():
        dm.head.w_d.weight.mul_(1.0 / std)


def write_image(path, seed=0, size=(96, 64)):
    rng = np.random.RandomState(seed)
    Image.fromarray((rng.rand(size[1], size[0], 3) * 255).astype("uint8")).save(path)
    return path.name


def records(case, state, qs, image=None, prefix="r"):
    return [Record(id=f"{prefix}{case}-{i}", source="s", task="t", state=state, image=image, question=q,
                   target=[1.0] + [0.0] * (q.k - 1), case_id=f"c{case}") for i, q in enumerate(qs)]


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_case_features_equal_full_row_features(preset, tmp_path):
    dm = model(preset)
    with_image = dm.supports_images
    img = write_image(tmp_path / "a.png") if with_image else None
    cases = [records(0, STATE, QS, image=img),
             records(1, "A much shorter state.", QS[1:3]),
             records(2, dict(STATE, notes="second ticket " * 5), QS[::-1])]
    inputs = [CaseRunner(dm).cases.from_records(rs, tmp_path) for rs in cases]
    shorter = CaseRunner(dm).cases.rows("A much shorter state.", QS[1:3])
    assert [r.ids for r in inputs[1].rows] == [r.ids for r in shorter]
    feats, usages = CaseRunner(dm).features(inputs, max_rows=3, path="prefix")
    assert [u["path"] for u in usages] == ["prefix"] * 3 and usages[0]["calls"] >= 3
    collate = dm.collator(image_root=tmp_path)
    normalise(dm, [r for rs in cases for r in rs], collate)
    worst = 0.0
    for recs, fs in zip(cases, feats):
        assert len(fs) == len(recs)
        with torch.inference_mode():
            h_dec, h_cand = dm.features(collate(recs))
        for i, (hd, hc) in enumerate(fs):
            k = recs[i].question.k
            assert hd.shape == h_dec[i].shape and hc.shape == (k, h_dec.shape[-1])
            assert hd.dtype == h_dec.dtype and hd.device == dm.device
            worst = max(worst, float((hd - h_dec[i]).abs().max()), float((hc - h_cand[i, :k]).abs().max()))
    assert worst < 1e-4
    # the features carry information: a different state moves them far beyond the tolerance
    assert float((feats[0][1][0] - feats[1][0][0]).abs().max()) > 1e-2
    # score_cases = case_features + head: the logits of the full-row forward
    scored = CaseRunner(dm).score_cases(inputs, max_rows=3, path="prefix")
    diff, scale = 0.0, 0.0
    for recs, (lgs, _) in zip(cases, scored):
        with torch.inference_mode():
            ref = dm(collate(recs)).float()
        for i, lg in enumerate(lgs):
            assert lg.dtype == torch.float32 and lg.shape == (recs[i].question.k,)
            diff = max(diff, float((lg - ref[i, : len(lg)]).abs().max()))
            scale = max(scale, float(lg.abs().max()))
    assert diff < 1e-4 and scale > 0.5


def test_case_inputs_from_records_refuses_mixed_states(tmp_path):
    dm = model("tiny-llama")
    rs = records(0, STATE, QS[:2]) + records(1, "other", QS[:1])
    with pytest.raises(ValueError, match="do not share one state"):
        CaseRunner(dm).cases.from_records(rs)
    from rlcd.schema import RecordError

    with pytest.raises(RecordError, match="text-only"):
        CaseRunner(dm).cases.from_records(records(0, STATE, QS[:2], image="a.png"), tmp_path)


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_planner_runs_a_single_question_as_one_full_forward(preset):
    dm = model(preset)
    calls = []
    handle = dm.decoder().register_forward_hook(lambda *a: calls.append(1)) if preset == "tiny-llama" else None
    one = CaseRunner(dm).prepare_case(STATE, QS[:1])
    (lg, usage), = CaseRunner(dm).score_cases([one])
    assert usage["path"] == "full" and usage["prefix_tokens"] == 0 and usage["calls"] == 1
    assert usage["input_tokens"] == usage["full_tokens"] == len(one.rows[0])
    assert CaseRunner(dm).n_tokens(STATE, QS[:1])["path"] == "full"
    n_auto = len(calls)
    ref = CaseRunner(dm).score_full(STATE, QS[:1])
    torch.testing.assert_close(lg[0], ref[0], atol=1e-5, rtol=0)
    (forced, u2), = CaseRunner(dm).score_cases([one], path="prefix")
    assert u2["path"] == "prefix" and u2["calls"] == 2
    torch.testing.assert_close(forced[0], ref[0], atol=1e-4, rtol=0)
    if handle is not None:
        handle.remove()
        assert n_auto == 1 and len(calls) == 1 + 1 + 2  # auto: one forward; score_full: one; prefix: two
    # several questions over a long shared state take the prefix path; a mixed batch plans per case
    many = CaseRunner(dm).prepare_case(STATE, QS)
    (_, u_one), (_, u_many) = CaseRunner(dm).score_cases([one, many])
    assert (u_one["path"], u_many["path"]) == ("full", "prefix")
    assert CaseRunner(dm).plan([one, many], path="full").prefix_len == [None, None]
    with pytest.raises(ValueError, match="path must be"):
        CaseRunner(dm).plan([one], path="fast").prefix_len


def mixed_records(dm, tmp_path):
    """Cases interleaved in the input: a 4-question case (with an image on a vision backbone), a
    3-question case, a lone record without case_id, a 2-question case whose case_id is reused by a
    record with another state (a different case), and a text copy of the image case's state."""
    img = write_image(tmp_path / "b.png", seed=3) if dm.supports_images else None
    a = records(0, STATE, QS, image=img, prefix="a")
    b = records(1, "Second ticket: the courier never came and nobody answers the phone.", QS[1:], prefix="b")
    c = records(2, "Third state, short.", QS[2:], prefix="c")
    lone = Record(id="lone", source="s", task="t", state=STATE, question=QS[0], target=[0.0, 1.0, 0.0])
    odd = Record(id="odd", source="s", task="t", state="Another state under case c2.", question=QS[1],
                 target=[1.0, 0.0], case_id="c2")
    text_copy = records(3, STATE, QS[:2], prefix="t")
    return [a[0], b[0], lone, a[1], c[0], odd, b[1], a[2], c[1], text_copy[0], b[2], a[3], text_copy[1]]


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_predict_rows_shared_equals_full_rows_in_input_order(preset, tmp_path, capsys):
    from rlcd.evaluate import predict_rows

    dm = model(preset)
    recs = mixed_records(dm, tmp_path)
    collate = dm.collator(image_root=tmp_path)
    normalise(dm, recs, collate)
    full = predict_rows(dm, recs, collate, batch_size=5, shared=False)
    shared = predict_rows(dm, recs, collate, split="test", progress=True)
    assert "score test" in capsys.readouterr().err
    assert [r["id"] for r in shared] == [r.id for r in recs] == [r["id"] for r in full]
    assert all(r["split"] == "test" for r in shared)
    assert [r.get("case_id") for r in shared] == [r.case_id for r in recs]
    diff = max(float((torch.tensor(s["logits"]) - torch.tensor(f["logits"])).abs().max())
               for s, f in zip(shared, full))
    scale = max(abs(x) for f in full for x in f["logits"])
    assert diff < 1e-4 and scale > 0.5
    if dm.supports_images:  # the image reaches the shared path: the image case differs from its text copy
        by_id = {r["id"]: r["logits"] for r in shared}
        assert max(abs(x - y) for x, y in zip(by_id["a0-0"], by_id["t3-0"])) > 1e-3
    # small calls (one case each, the rows split) give the same logits
    from rlcd.model.case_scoring import score_records

    small = score_records(dm, recs, image_root=tmp_path, max_rows=2)
    assert max(float((s - torch.tensor(f["logits"])).abs().max()) for s, f in zip(small, full)) < 1e-4


def test_dev_accuracy_shared_equals_full_rows(tmp_path):
    from rlcd.train import dev_accuracy

    dm = model("tiny-llama")
    recs = mixed_records(dm, tmp_path)
    collate = dm.collator(image_root=tmp_path)
    normalise(dm, recs, collate)
    dev = {"g1": recs[:7], "g0": recs[7:]}
    dm.train()
    shared = dev_accuracy(dm, dev, collate, dm.device)
    assert dm.training  # the mode is restored
    full = dev_accuracy(dm, dev, collate, dm.device, shared=False)
    assert shared["dev_accuracy"] == full["dev_accuracy"] and list(shared["dev_accuracy"]) == ["g0", "g1"]
    assert shared["dev_macro_accuracy"] == full["dev_macro_accuracy"]
    assert set(shared) == set(full)
    for key in ("dev_nll", "dev_brier", "dev_ece"):
        assert shared[key] == pytest.approx(full[key], abs=1e-5)
    # the accuracy is the fraction of rows whose top logit is the target's top candidate (float64 check)
    with torch.inference_mode():
        lg = dm.eval()(collate(dev["g0"])).double()
    want = sum(int(lg[i, : r.question.k].argmax()) == max(range(r.question.k), key=lambda j: (r.target[j], -j))
               for i, r in enumerate(dev["g0"])) / len(dev["g0"])
    assert shared["dev_accuracy"]["g0"] == want


def test_group_and_pack_cases():
    from rlcd.model.case_scoring import group_cases, pack_cases

    q = QS[1]
    rs = [Record(id=i, source="s", task="t", state=st, question=q, target=[1.0, 0.0], case_id=cid)
          for i, st, cid in [("x0", "A", "x"), ("y0", "B", "y"), ("n0", "A", None), ("x1", "A", "x"),
                             ("n1", "A", None), ("x2", "Z", "x")]]
    assert group_cases(rs) == [[0, 3], [1], [2], [4], [5]]
    assert pack_cases([(6, 100), (6, 100), (6, 100), (70, 10), (1, 1)], max_rows=12, max_tokens=1000) == \
        [[0, 1], [2], [3], [4]]
    assert pack_cases([(2, 600), (2, 600), (2, 100)], max_rows=64, max_tokens=1000) == [[0], [1, 2]]
    assert pack_cases([], max_rows=4, max_tokens=10) == []


@pytest.mark.slow  # loads the real SmolLM2-135M weights and scores 12 rows three times (~1 row/s per pass)
def test_predict_rows_shared_equals_full_rows_on_real_smollm2(tmp_path):
    from rlcd.data.synth import generate
    from rlcd.evaluate import predict_rows

    dm = build_model({"model": "smollm2-135m", "recipe": {}}).eval()
    recs = generate(1, seed=5) + mixed_records(dm, tmp_path)[:6]  # one six-question synth case + mixed cases
    collate = dm.collator(image_root=tmp_path)
    b = collate(recs)
    with torch.no_grad():  # one full pass centres the head and scales its logits to std 1 (as `normalise`)
        h_dec, h_cand = dm.features(b)
        dm.head.init_centring(h_dec, h_cand, b.cand_mask)
        dm.head.w_d.weight.mul_(1.0 / float(dm.head(h_dec, h_cand, b.cand_mask, update=False)[b.cand_mask].std()))
    full = predict_rows(dm, recs, collate, shared=False)
    shared = predict_rows(dm, recs, collate)
    assert [r["id"] for r in shared] == [r.id for r in recs]
    diff = max(float((torch.tensor(s["logits"]) - torch.tensor(f["logits"])).abs().max())
               for s, f in zip(shared, full))
    assert diff < 1e-4 and max(abs(x) for f in full for x in f["logits"]) > 0.5
