"""Training through shared prefixes (`Recipe.batch_by = "case"`): the case sampler's rules, gradient and
logit parity of `case_forward` with full rows (tiny-llama; tiny, the hybrid Qwen3.5 cache; an image), the
functional cache being what makes the backward possible, and a bit-exact resume of a case run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import ddp_worker
from conftest import synth_processed, torchrun

from rlcd import checkpoint as ckpt
from rlcd.data.sampling import Sampler
from rlcd.data.synth import generate
from rlcd.errors import OptionError
from rlcd.model import case_train
from rlcd.model.backbone import load_backbone
from rlcd.model.collate import Batch
from rlcd.model.decision import DecisionModel
from rlcd.objectives import ce_loss
from rlcd.recipe import Recipe
from rlcd.schema import Question, Record
from rlcd.train import train

torch.set_num_threads(1)
HERE = Path(__file__).parent


# ---------------------------------------------------------------------------------------------- recipe + sampler


def test_batch_by_is_a_validated_recipe_arm():
    assert Recipe().batch_by == "row" and "batch_by" not in Recipe().deviations()
    assert Recipe(batch_by="case").deviations()["batch_by"] == {"value": "case", "pinned": "row"}
    with pytest.raises(OptionError, match="batch_by must be 'row' or 'case'"):
        Recipe(batch_by="cases")


def _pool():
    # group a: three 6-row cases and two rows without a case; group b: one 11-row case
    pool = {"a": [f"c{c}:q{q}" for c in range(3) for q in range(6)] + ["solo1", "solo2"],
            "b": [f"big:q{q}" for q in range(11)]}
    case_of = {i: i.split(":")[0] for ids in pool.values() for i in ids if ":" in i}
    return pool, case_of


def test_case_microbatch_fills_the_batch_with_whole_cases():
    pool, case_of = _pool()
    s = Sampler(pool, case_of)
    for index in range(200):
        cases = s.case_microbatch(7, index, 8)
        assert sum(len(c) for c in cases) == 8  # the recipe's micro-batch, whatever the case sizes
        assert cases == s.case_microbatch(7, index, 8)  # a pure function of (seed, index)
        for j, case in enumerate(cases):
            keys = {case_of.get(d.id, d.id) for d in case}
            assert len(keys) == 1 and len({d.group for d in case}) == 1  # one case, one group
            assert len({d.id for d in case}) == len(case)  # a case's rows are not repeated within one draw
            key = keys.pop()
            full = 11 if key == "big" else 6 if key.startswith("c") else 1
            if j < len(cases) - 1:
                assert len(case) == full  # only the last case of a micro-batch is split
            else:
                assert len(case) == min(full, 8 - sum(len(c) for c in cases[:-1]))
    assert s.case_microbatch(7, 0, 8) != s.case_microbatch(7, 1, 8)
    assert s.case_microbatch(7, 0, 8) != s.case_microbatch(8, 0, 8)
    # groups are drawn uniformly: the 11-row case of group b opens about half of the micro-batches
    first_b = sum(s.case_microbatch(0, i, 8)[0][0].group == "b" for i in range(400))
    assert 160 < first_b < 240
    with pytest.raises(ValueError, match="without case_of"):
        Sampler(pool).case_microbatch(0, 0, 8)


# ---------------------------------------------------------------------------------------------- gradient parity


def _model(preset: str) -> DecisionModel:
    dm = DecisionModel(load_backbone(preset, seed=0), seed=0)
    with torch.no_grad():  # LoRA B starts at zero (no gradient reaches A): give every LoRA tensor a gradient
        g = torch.Generator().manual_seed(1)
        for n, p in dm.backbone.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return dm.train()


def _units(rows_per_case: int):
    by: dict[str, list] = {}
    for r in generate(3, seed=5):
        by.setdefault(r.case_id, []).append(r)
    cases = list(by.values())
    return [cases[0][:rows_per_case], cases[1][:rows_per_case], [cases[2][0]]]  # two shared units, one full row


def _grads(dm, batch):
    dm.zero_grad(set_to_none=True)
    logits = dm(batch)
    loss, _ = ce_loss(logits, batch.cand_mask, batch.target)
    loss.backward()
    dm.head.reset_pending()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in dm.named_parameters() if p.grad is not None}


def _parity(preset: str, rows_per_case: int, monkeypatch):
    dm = _model(preset)
    units = _units(rows_per_case)
    col = dm.collator()
    cb = case_train.collate_cases(col, units)
    fb = col([r for u in units for r in u])
    assert [(u.start, u.end) for u in cb.units] == [(0, rows_per_case), (rows_per_case, 2 * rows_per_case),
                                                  (2 * rows_per_case, 2 * rows_per_case + 1)]
    assert torch.equal(cb.input_ids, fb.input_ids) and torch.equal(cb.target, fb.target)
    cuts = [case_train.unit_prefix_len(dm, cb.rows[u.start:u.end], u.n_img) for u in cb.units]
    assert cuts[0] and cuts[1] and cuts[2] is None
    calls = []
    lm = dm.decoder_forward
    monkeypatch.setattr(dm, "decoder_forward", lambda ids, *a, **k: calls.append(tuple(ids.shape)) or lm(ids, *a, **k))
    lc, gc = _grads(dm, cb)
    # one full-row call (the one-row unit), one prefix call for both states, one suffix call for all rows
    assert calls == [(1, len(cb.rows[-1])), (2, max(cuts[:2])), (2 * rows_per_case, calls[-1][1])]
    monkeypatch.undo()
    lf, gf = _grads(dm, fb)
    assert gf.keys() == gc.keys() and any("lora_A" in k for k in gf) and all(float(g.norm()) > 0 for g in gf.values())
    m = fb.cand_mask
    assert float(lf[m].abs().max()) > 0.1
    return float((lc[m] - lf[m]).abs().max()), gc, gf


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _vec(g):
    return torch.cat([g[k].flatten() for k in sorted(g)])


def test_case_gradients_equal_full_rows_text_decoder(monkeypatch):
    """tiny-llama (DynamicCache: torch.cat + index_select): every parameter gradient within 1e-4 relative."""
    diff, gc, gf = _parity("tiny-llama", 4, monkeypatch)
    assert diff < 1e-5
    for k in gf:
        assert _rel(gc[k], gf[k]) < 1e-4, k


def test_case_gradients_equal_full_rows_hybrid_qwen35(monkeypatch):
    """tiny (Gated DeltaNet + attention, the functional cache).

    Bounds (see rlcd.model.case_train and benchmarks/case_train_residue.py): logits within 1e-5, the whole
    gradient within 1e-5 and every tensor within 1e-4 relative -- except the decay gate's LoRA
    (`linear_attn.in_proj_a`): transformers' reference DeltaNet kernel computes in float32 and its float32
    gradient for the decay is mostly rounding on this random preset (the full-row gradient itself is
    ~0.9 relative away from a float64 kernel's), so a different summation order (the state's gradient summed
    over a case's rows before it flows into the prefix) moves it by a few percent: bounded at 0.1.
    """
    diff, gc, gf = _parity("tiny", 3, monkeypatch)
    assert diff < 1e-5
    assert _rel(_vec(gc), _vec(gf)) < 1e-5
    gate = [k for k in gf if "in_proj_a" in k]
    assert gate
    for k in gf:
        assert _rel(gc[k], gf[k]) < (0.1 if k in gate else 1e-4), k


def test_the_shipped_linear_attention_cache_cannot_backpropagate(monkeypatch):
    """The functional cache layers are what make the backward possible (transformers' copy_ breaks autograd)."""
    dm = _model("tiny-toy")
    cb = case_train.collate_cases(dm.collator(), _units(3))
    monkeypatch.setattr(case_train, "functional_cache", lambda cache: cache)
    with pytest.raises(RuntimeError, match="inplace operation"):
        _grads(dm, cb)


# ---------------------------------------------------------------------------------------------- the training loop

FAST = dict(eval_every=3, checkpoint_every=1, log_every=1, diagnostics_every=2, dev_cap=8, batch_by="case")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return synth_processed(tmp_path_factory.mktemp("data"), 40, seed=3)


def _train(run, data_dir, **kw):
    recipe = Recipe(steps=kw.pop("steps", 3), **FAST)
    return train(run, data_dir=data_dir, model="tiny-toy", recipe=recipe, progress=False, **kw)


def _rows(run, event):
    return [r for r in (json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines())
            if r["event"] == event]


def test_case_run_resumes_bit_exact(tmp_path, data_dir):
    full, part = tmp_path / "full", tmp_path / "part"
    _train(full, data_dir)
    _train(part, data_dir, stop_after=2)
    train(part, resume=True, progress=False)
    a, b = ckpt.load(full / "checkpoints" / "last")["weights"], ckpt.load(part / "checkpoints" / "last")["weights"]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    rows = _rows(full, "train")
    assert [(r["step"], r["loss"]) for r in rows] == [(r["step"], r["loss"]) for r in _rows(part, "train")]
    assert [r["examples"] for r in rows] == [32] * 3  # the recipe's batch: 8 rows x 4 micro-batches
    assert {"adv_std", "grad_cosine", "per_type"} <= set(rows[1])  # diagnostics at their cadence
    consumed = ckpt.load(full / "checkpoints" / "last")["state"]["consumed"]
    assert sum(consumed.values()) == 3 * 32
    assert json.loads((full / "config.json").read_text())["recipe_deviations"]["batch_by"]["value"] == "case"


def test_case_micro_batches_come_from_the_case_sampler(tmp_path, data_dir):
    from rlcd.bench.train import bench_session

    s = bench_session(data_dir, "tiny-toy", workdir=tmp_path, recipe=Recipe(batch_by="case", dev_cap=8))
    for index in range(3):
        b = s.microbatch(index)
        cases = s.sampler.case_microbatch(0, index, 8)
        assert isinstance(b, case_train.CaseBatch) and len(b) == 8
        assert [len(u) for u in b.units] == [len(c) for c in cases]
        assert b.ids == [d.id for c in cases for d in c]
        assert [d.id for d in s.draws(index)] == b.ids
    # the bench's token count: shared prefixes run fewer tokens than the same rows in full; rows run all
    from rlcd.bench.train import processed_tokens, use_batch_by

    case = processed_tokens(s, range(3))
    assert case["rows"] == 24 and case["run_tokens_per_row"] < case["full_tokens_per_row"]
    # the ceiling: every pool case's state once (counted here from the encoded rows of each case)
    assert s.model.family.exact_align == 64
    from rlcd.bench.train import whole_case_tokens
    from rlcd.model.plan import common_prefix_len

    by_case: dict = {}
    for i in (i for ids in s.bench_pool.values() for i in ids):
        by_case.setdefault(s.records[i].case_id, []).append(s.records[i])
    full = run = n = 0
    for recs in by_case.values():
        rows = [s.model.encoder.encode(r.state, r.question, row=r.id) for r in recs]
        cut = min(common_prefix_len([r.ids for r in rows]), min(r.decision_pos for r in rows)) if len(rows) > 1 else 0
        cut -= cut % (s.model.family.exact_align or 1)  # Qwen3.5 trains on the DeltaNet chunk grid
        full, run, n = full + sum(len(r) for r in rows), run + cut + sum(len(r) - cut for r in rows), n + len(rows)
    whole = whole_case_tokens(s)
    assert whole["whole_case_token_ratio"] == pytest.approx(full / run) and whole["whole_case_token_ratio"] > 1.5
    assert whole["whole_case_tokens_per_row"] == pytest.approx(run / n)
    use_batch_by(s, "row")
    assert isinstance(s.microbatch(0), Batch) and not isinstance(s.microbatch(0), case_train.CaseBatch)
    assert processed_tokens(s, range(3))["token_ratio"] == 1.0


@pytest.mark.slow
def test_ddp_case_gradients_match_single_process(tmp_path, data_dir):
    """2 gloo ranks x 4 case micro-batches == 1 process x 8 (the same indices), within 1e-5."""
    worker = str(HERE / "ddp_worker.py")
    torchrun(worker, "grads", data_dir, tmp_path, "case", cwd=tmp_path)
    ddp_worker.grads(data_dir, tmp_path, "case")  # the one-process reference, in this process
    ddp, ref = torch.load(tmp_path / "grads-world2.pt"), torch.load(tmp_path / "grads-world1.pt")
    assert ddp.keys() == ref.keys() and len(ref) > 10
    for name in ref:
        torch.testing.assert_close(ddp[name], ref[name], atol=1e-5, rtol=1e-5, msg=name)


def test_case_gradients_equal_full_rows_with_an_image(tmp_path, monkeypatch):
    """tiny-toy with an image in one case: the image is encoded once for the case, inside its shared prefix."""
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(0)
    Image.fromarray((rng.rand(64, 96, 3) * 255).astype("uint8")).save(tmp_path / "a.png")
    dm = _model("tiny-toy")
    units = _units(3)
    units[0] = [r.model_copy(update={"image": "a.png"}) for r in units[0]]
    col = dm.collator(image_root=tmp_path)
    cb = case_train.collate_cases(col, units)
    fb = col([r for u in units for r in u])
    assert cb.units[0].n_img > 0 and cb.units[1].n_img == 0
    assert case_train.unit_prefix_len(dm, cb.rows[:3], cb.units[0].n_img) is not None  # the image is shared
    seen = []
    features = dm.image_features
    monkeypatch.setattr(dm, "image_features", lambda pv, grid: seen.append(tuple(grid.shape)) or features(pv, grid))
    lc, gc = _grads(dm, cb)
    assert seen == [(1, 3)]  # one image encoding for the three rows of its case
    monkeypatch.undo()
    lf, gf = _grads(dm, fb)
    m = fb.cand_mask
    assert float((lc[m] - lf[m]).abs().max()) < 1e-5
    assert _rel(_vec(gc), _vec(gf)) < 1e-5


def test_a_unit_whose_shared_prefix_saves_less_than_a_call_runs_as_full_rows():
    """Training plans each unit with serving's rule (`sharing_pays`): two questions about a two-token state
    share ~34 template tokens, less than a call's overhead, so they run as full rows; a long state shares."""
    from rlcd.model.plan import CALL_OVERHEAD, shared_prefix_len

    dm = _model("tiny-llama")
    qs = [Question(type="noul", instructions="Is it urgent?"), Question(type="noul", instructions="Is it paid?")]

    def case(state, key):
        return [Record(id=f"{key}{i}", source="s", task="t", state=state, question=q, target=[1.0, 0.0], case_id=key)
                for i, q in enumerate(qs)]

    units = [case("ok", "s"), case("Late: " + "the parcel came late, " * 8, "l")]
    cb = case_train.collate_cases(dm.collator(), units)
    raw = [shared_prefix_len(cb.rows[u.start:u.end], align=dm.family.exact_align) for u in cb.units]
    assert raw[0] <= CALL_OVERHEAD < raw[1]  # the premise: one short shared prefix, one long
    assert [case_train.unit_prefix_len(dm, cb.rows[u.start:u.end], u.n_img) for u in cb.units] == [None, raw[1]]
    with torch.no_grad():  # either path, the same logits as full rows
        shared, full = dm(cb), dm(dm.collator()([r for u in units for r in u]))
    assert float((shared - full)[cb.cand_mask].abs().max()) < 1e-5
