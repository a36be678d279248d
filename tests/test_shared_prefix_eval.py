"""Shared-prefix features and evaluation: the prefix path equals full rows (tiny = Qwen3.5 VLM, tiny-llama
= text decoder; with and without images), records grouped into cases, the per-case path planner."""

import numpy as np
import pytest
import torch
from PIL import Image

torch.set_num_threads(1)

from rlcd.model.build import build_model  # noqa: E402
from rlcd.schema import Question, Record  # noqa: E402

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
            rows = dm.encode_case(STATE, QS)
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
    inputs = [dm.case_inputs_from_records(rs, tmp_path) for rs in cases]
    assert [r.ids for r in inputs[1].rows] == [r.ids for r in dm.encode_case("A much shorter state.", QS[1:3])]
    feats, usages = dm.case_features_with_usage(inputs, max_rows=3, path="prefix")
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
    scored = dm.score_cases(inputs, max_rows=3, path="prefix")
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
        dm.case_inputs_from_records(rs)
    from rlcd.schema import RecordError

    with pytest.raises(RecordError, match="text-only"):
        dm.case_inputs_from_records(records(0, STATE, QS[:2], image="a.png"), tmp_path)


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_planner_runs_a_single_question_as_one_full_forward(preset):
    dm = model(preset)
    calls = []
    handle = dm._core().register_forward_hook(lambda *a: calls.append(1)) if preset == "tiny-llama" else None
    one = dm.prepare_case(STATE, QS[:1])
    (lg, usage), = dm.score_cases([one])
    assert usage["path"] == "full" and usage["prefix_tokens"] == 0 and usage["calls"] == 1
    assert usage["input_tokens"] == usage["full_tokens"] == len(one.rows[0])
    assert dm.n_tokens(STATE, QS[:1])["path"] == "full"
    n_auto = len(calls)
    ref = dm.score_full(STATE, QS[:1])
    torch.testing.assert_close(lg[0], ref[0], atol=1e-5, rtol=0)
    (forced, u2), = dm.score_cases([one], path="prefix")
    assert u2["path"] == "prefix" and u2["calls"] == 2
    torch.testing.assert_close(forced[0], ref[0], atol=1e-4, rtol=0)
    if handle is not None:
        handle.remove()
        assert n_auto == 1 and len(calls) == 1 + 1 + 2  # auto: one forward; score_full: one; prefix: two
    # several questions over a long shared state take the prefix path; a mixed batch plans per case
    many = dm.prepare_case(STATE, QS)
    (_, u_one), (_, u_many) = dm.score_cases([one, many])
    assert (u_one["path"], u_many["path"]) == ("full", "prefix")
    assert dm.plan_paths([one, many], path="full") == [None, None]
    with pytest.raises(ValueError, match="path must be"):
        dm.plan_paths([one], path="fast")
