"""Probes: candidate-order sensitivity (fake scorers with known answers, label alignment, a real
tiny model through the CLI) and noise over-sharpening (hand-made logits vs an independent float64
Monte-Carlo)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rlcd.analysis.probes import (align, candidate_permutations, model_scorer, permute_choice, probe_noise,
                                  probe_order, probe_order_scores, total_variation)
from rlcd.data.io import write_jsonl
from rlcd.data.synth import generate
from rlcd.schema import Question, Record

torch.set_num_threads(1)


def _choice(rid: str, labels, target=None, posterior=None, described=False) -> Record:
    k = len(labels)
    crit = {lab: f"about {lab}" for lab in labels} if described else list(labels)
    return Record(id=rid, source="t", task="t", state=f"state {rid}",
                  question=Question(type="choice", instructions="pick one", criteria=crit),
                  target=target or [1.0 / k] * k, posterior=posterior)


def _records() -> list[Record]:
    recs = [
        _choice("a", ["red", "green"]),
        _choice("b", ["cat", "dog", "bird", "fish"], target=[0.1, 0.6, 0.2, 0.1]),
        _choice("c", [f"opt{i}" for i in range(12)], described=True),
        _choice("d", ["x", "y", "z"]),
        Record(id="n", source="t", task="t", state="s", question=Question(type="noul", instructions="ok?"),
               target=[0.3, 0.7]),
        Record(id="s", source="t", task="t", state="s",
               question=Question(type="score", instructions="how much?", criteria=["low", "mid", "high"]),
               target=[0.2, 0.3, 0.5]),
    ]
    return recs


def _label_value(label: str) -> float:
    return int(hashlib.sha256(label.encode()).hexdigest()[:8], 16) / 2**32 * 6.0


def order_blind(records):
    """Logit per candidate depends only on its label text."""
    return [[_label_value(lab) for lab in r.question.labels] for r in records]


def first_position(records):
    """Always prefers the candidate in position 0, whatever its label."""
    return [[5.0] + [0.0] * (r.question.k - 1) for r in records]


# ----------------------------------------------------------------------------------------------
# permutations


def test_candidate_permutations():
    assert candidate_permutations(2) == [("reversal", [1, 0])]  # shift 1 == reversal for K = 2
    perms = candidate_permutations(4)  # K <= 4: all 23 other orders, named where they have a name
    assert len(perms) == 23 and len({tuple(p) for _, p in perms}) == 23
    assert {"reversal", "shift1", "shift2", "shift3"} <= {n for n, _ in perms}
    assert dict(perms)["shift1"] == [1, 2, 3, 0] and dict(perms)["order:0,1,3,2"] == [0, 1, 3, 2]
    capped = candidate_permutations(12, max_perms=8)
    assert len(capped) == 8 and capped[0][0] == "reversal"
    assert len({tuple(p) for _, p in capped}) == 8
    assert all(sorted(p) == list(range(12)) and p != list(range(12)) for _, p in capped)


def test_permute_choice_moves_target_posterior_and_descriptions():
    rec = _choice("b", ["cat", "dog", "bird"], target=[0.1, 0.6, 0.3], posterior=[0.2, 0.5, 0.3], described=True)
    out = permute_choice(rec, [2, 0, 1])
    assert out.question.labels == ["bird", "cat", "dog"]
    assert out.target == pytest.approx([0.3, 0.1, 0.6])
    assert out.posterior == pytest.approx([0.3, 0.2, 0.5])
    assert out.question.criteria == {"bird": "about bird", "cat": "about cat", "dog": "about dog"}
    assert rec.question.labels == ["cat", "dog", "bird"]  # the original is untouched
    with pytest.raises(ValueError, match="not a permutation"):
        permute_choice(rec, [0, 0, 1])


# ----------------------------------------------------------------------------------------------
# order probe


def test_order_blind_model_never_flips():
    res = probe_order_scores(order_blind, _records())
    ch = res["per_type"]["choice"]
    assert ch["n_rows"] == 4 and ch["n_comparisons"] == 1 + 23 + 8 + 5  # K = 2, 4 (all), 12 (sampled), 3 (all)
    assert ch["flip_rate"] == 0.0 and ch["rows_with_flip"] == 0.0 and ch["flip_rate95"] == [0.0, 0.0]
    assert ch["mean_tv"] < 1e-12 and ch["max_tv"] < 1e-12
    assert ch["votes"]["2"]["flip_rate"] == 0.0 and ch["votes"]["2"]["mean_tv"] < 1e-12
    assert res["counts"]["noul"] == {"read": 1, "probed": 0, "not_probed": 1,
                                     "reasons": {res["not_probed"][0]["reason"]: 1}}
    assert res["per_type"]["score"]["n_rows"] == 1
    assert res["per_type"]["score"]["votes"] == "order votes apply to choice only"


def test_position_preferring_model_flips():
    res = probe_order_scores(first_position, _records())
    ch = res["per_type"]["choice"]
    # an order flips exactly when it moves another label to position 0
    for row in [r for r in res["rows"] if r["type"] == "choice"]:
        moved = [c["flip"] for c in row["comparisons"]]
        assert row["n_flips"] == sum(moved) and 0 < sum(moved) <= len(moved)
    assert ch["n_comparisons"] == 37 and round(ch["flip_rate"] * 37) == 1 + 18 + 4 + sum(
        r["n_flips"] for r in res["rows"] if r["k"] == 12)
    assert ch["rows_with_flip"] == 1.0
    assert ch["top_at_first"] == 1.0 and ch["top_at_first_uniform"] < 0.5
    assert ch["mean_tv"] > 0.5
    assert res["per_type"]["choice"]["by_kind"]["reversal"]["flip_rate"] == 1.0


def test_tv_is_measured_on_label_aligned_distributions():
    # position-only scorer: p = (0.6, 0.3, 0.1) over positions, whatever the labels
    fixed = np.log([0.6, 0.3, 0.1])

    def by_position(records):
        return [fixed.tolist() for _ in records]

    res = probe_order_scores(by_position, [_choice("d", ["x", "y", "z"])])
    (row,) = res["rows"]
    (comp,) = [c for c in row["comparisons"] if c["perm"] == "reversal"]
    # reference {x: .6, y: .3, z: .1}; reversed order (z, y, x) gets (.6, .3, .1) -> {z: .6, y: .3, x: .1}
    assert comp["tv"] == pytest.approx(0.5 * (0.5 + 0.0 + 0.5), abs=1e-12)  # index-wise it would be 0
    assert comp["top"] == "z" and comp["flip"] is True
    assert align([0.6, 0.3, 0.1], [2, 1, 0]).tolist() == pytest.approx([0.1, 0.3, 0.6])
    assert total_variation([0.6, 0.3, 0.1], [0.1, 0.3, 0.6]) == pytest.approx(0.5)


def test_exact_ties_are_not_flips():
    def flat(records):
        return [[0.0] * r.question.k for r in records]

    res = probe_order_scores(flat, [_choice("d", ["x", "y", "z"])])
    assert res["per_type"]["choice"]["flip_rate"] == 0.0


def test_probe_order_through_the_collator(tmp_path):
    """The model path: collate permuted records, read logits [B, Kmax] (-inf on padding)."""
    from rlcd.model.collate import Collator
    from rlcd.model.tokenizer import toy_tokenizer

    class FirstPosition(torch.nn.Module):
        def forward(self, batch):
            z = torch.zeros(batch.cand_mask.shape)
            z[:, 0] = 3.0
            return z.masked_fill(~batch.cand_mask, float("-inf"))

    collator = Collator(toy_tokenizer(), None)
    res = probe_order(FirstPosition(), _records(), collator, batch_size=5)
    assert res["per_type"]["choice"]["flip_rate"] == pytest.approx(probe_order_scores(first_position, _records())
                                                                   ["per_type"]["choice"]["flip_rate"])
    assert res["per_type"]["score"]["flip_rate"] == 1.0  # level 0 first, then level K-1 first
    assert res["per_type"]["noul"]["n_rows"] == 0 and res["counts"]["noul"]["not_probed"] == 1


def test_probe_order_cli_on_tiny_model(tmp_path):
    from _tiny_export import make_tiny_export

    from rlcd.cli import app

    run = make_tiny_export(tmp_path / "run")
    data = tmp_path / "data"
    recs = generate(2, seed=5)
    write_jsonl(data / "test.jsonl", recs)
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "data_dir": str(data)}))  # the run's own test split
    out = tmp_path / "order.json"
    result = CliRunner().invoke(app, ["probe", "order", str(run), "--limit", "3", "--max-perms", "3",
                                      "--resamples", "200", "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    assert "option-order probe" in result.output and "not probed" in result.output
    res = json.loads(out.read_text())
    assert res["format"] == "rlcd.probe_order/2" and res["votes"] == [1, 2] and res["resamples"] == 200
    saved = run / "eval" / "probe-order.json"
    assert res["saved"] == str(saved) and json.loads(saved.read_text()) == res
    ch = res["per_type"]["choice"]
    assert ch["n_rows"] == 3 and 0.0 <= ch["flip_rate"] <= 1.0 and ch["mean_tv"] > 0
    # the first 3 of each type: noul "escalate", "recontact" (no wording to swap) and "hold"; score K = 4, 3, 5
    assert res["counts"]["noul"]["read"] == 3 and res["counts"]["noul"]["probed"] == 2
    assert res["counts"]["noul"]["not_probed"] == 1 and res["per_type"]["score"]["n_comparisons"] == 3
    assert res["n_records"] == 9 == len(res["rows"]) + len(res["not_probed"])
    for t in ("choice", "noul", "score"):
        b = res["per_type"][t]
        lo, hi = b["flip_rate95"]
        assert lo - 1e-12 <= b["flip_rate"] <= hi + 1e-12 and b["n_cases"] == 2
    assert set(ch["votes"]) == {"2"} and res["per_type"]["noul"]["votes"] == "order votes apply to choice only"
    assert {q["type"] for q in res["questions"]} == {"choice", "noul", "score"}
    # the identity order of the scorer reproduces a plain forward of the same records
    from rlcd.analysis.probes import load_run_model
    from rlcd.model.collate import Collator

    model, _, _ = load_run_model(run)
    choice = [r for r in recs if r.question.type == "choice"][:3]
    z = model_scorer(model, Collator(model.tokenizer, model.image_processor), batch_size=2)(choice)
    ref = {r["id"]: r["top"] for r in res["rows"]}
    for rec, logits in zip(choice, z):
        assert ref[rec.id] == rec.question.labels[int(np.argmax(logits))]
    # the probe scores a case's orders on its shared prefix: the same logits as full rows, up to float32 noise
    asked = [permute_choice(rec, p) for rec in choice for _, p in candidate_permutations(rec.question.k, 3)[:2]]
    full = model_scorer(model, Collator(model.tokenizer, model.image_processor), batch_size=2, shared=False)(asked)
    shared = model_scorer(model, Collator(model.tokenizer, model.image_processor), batch_size=2)(asked)
    assert np.allclose(np.concatenate(full), np.concatenate(shared), atol=1e-4)
    assert res["checkpoint_sha256"] and len(res["checkpoint_sha256"]) == 64


# ----------------------------------------------------------------------------------------------
# noise probe


ROWS = [
    {"id": "r1", "type": "choice", "logits": [4.0, 0.0, -1.0], "target": [0.7, 0.2, 0.1]},
    {"id": "r2", "type": "noul", "logits": [0.0, 3.0], "target": [0.1, 0.9], "posterior": [0.2, 0.8]},
    {"id": "r3", "type": "score", "logits": [-2.0, 1.0, 5.0, 0.5], "target": [0.0, 0.1, 0.8, 0.1]},
]


def _softmax(z):
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _mc_average(z, sigma, n=400_000, seed=12345):
    """Independent float64 Monte-Carlo of E[softmax(z + eps)], eps centred Gaussian."""
    rng = np.random.Generator(np.random.PCG64(seed))
    z = np.asarray(z, dtype=np.float64)
    e = rng.normal(0.0, sigma, size=(n, z.size))
    e -= e.mean(axis=1, keepdims=True)
    return _softmax(z + e).mean(axis=0)


@pytest.mark.parametrize("sigma,symmetrize", [(0.5, True), (2.0, True), (2.0, False)])
def test_noise_average_matches_independent_monte_carlo(sigma, symmetrize):
    res = probe_noise(ROWS, sigma, samples=50_000 if not symmetrize else 10_000, seed=0, symmetrize=symmetrize,
                      keep_rows=True)
    by_id = {r["id"]: r for r in res["rows"]}
    maxq, kls = [], []
    for row in ROWS:
        q = _mc_average(row["logits"], sigma)
        p = _softmax(row["logits"])
        got = by_id[row["id"]]
        assert got["max_p"] == pytest.approx(p.max(), abs=1e-12)
        assert got["max_q"] == pytest.approx(q.max(), abs=4e-3)
        assert got["max_q"] < got["max_p"]  # peaked rows: averaging over noise flattens
        kl = float(np.sum(q * np.log(q / p)))
        assert got["kl_qp"] == pytest.approx(kl, rel=0.05, abs=1e-3)
        assert got["changed"] is False
        maxq.append(q.max())
        kls.append(kl)
    o = res["overall"]
    assert o["n"] == 3 and o["argmax_change_rate"] == 0.0
    assert o["mean_max_prob_noise_averaged"] == pytest.approx(np.mean(maxq), abs=3e-3)
    assert o["mean_kl_averaged_to_free"] == pytest.approx(np.mean(kls), rel=0.05, abs=1e-3)
    assert o["sharpening"] > 0
    assert res["per_type"]["noul"]["posterior"]["n"] == 1


def test_noise_probe_grows_with_sigma_and_vanishes_without_noise():
    small = probe_noise(ROWS, 1e-6, samples=128)["overall"]
    assert small["mean_max_prob_noise_averaged"] == pytest.approx(small["mean_max_prob_noise_free"], abs=1e-9)
    assert small["mean_kl_averaged_to_free"] < 1e-10
    gaps = [probe_noise(ROWS, s, samples=2000)["overall"]["sharpening"] for s in (0.5, 1.0, 2.0, 4.0)]
    assert all(b > a for a, b in zip(gaps, gaps[1:]))


def test_symmetrized_noise_removes_the_max_bias_of_near_uniform_rows():
    from rlcd.analysis.probes import noise_average

    q = noise_average([0.0, 0.0, 0.0, 0.0], 4.0, 128, np.random.default_rng(0))
    assert q == pytest.approx([0.25] * 4, abs=1e-15)  # tied logits stay exactly tied
    rows = [{"id": f"u{i}", "type": "choice", "logits": [1e-3 * i, 0.0, 0.0, 0.0]} for i in range(20)]
    plain = probe_noise(rows, 4.0, samples=128, symmetrize=False)["overall"]
    sym = probe_noise(rows, 4.0, samples=128)["overall"]
    # truth: E softmax keeps near-uniform rows near-uniform (max-prob ~0.25, never above max p + 1e-3)
    assert plain["mean_max_prob_noise_averaged"] > plain["mean_max_prob_noise_free"] + 0.01  # MC bias
    assert abs(sym["sharpening"]) < 2e-3 and sym["argmax_change_rate"] <= 0.1


def test_noise_probe_is_deterministic_and_order_free():
    a = probe_noise(ROWS, 1.0, samples=128, seed=3)
    b = probe_noise(list(reversed(ROWS)), 1.0, samples=128, seed=3)
    assert a == b
    with pytest.raises(ValueError, match="sigma"):
        probe_noise(ROWS, 0.0)


def test_probe_noise_cli_reads_predictions(tmp_path):
    from rlcd.cli import app

    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"recipe": {"sigma": 0.5, "objective": "rlcd"}}))
    write_jsonl(run / "eval" / "predictions-test.jsonl", ROWS)
    out = tmp_path / "noise.json"
    result = CliRunner().invoke(app, ["probe", "noise", str(run), "--out", str(out)])
    assert result.exit_code == 0, result.output
    res = json.loads(out.read_text())
    assert res["sigma"] == 0.5 and res["samples"] == 128 and res["trained_objective"] == "rlcd"
    assert res == {**probe_noise(ROWS, 0.5), **{k: res[k] for k in ("run", "split", "trained_sigma",
                                                                       "trained_objective")}}
    result = CliRunner().invoke(app, ["probe", "noise", str(tmp_path / "missing"), "--sigma", "1"])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_probe_order_checks_every_option_before_loading_and_keeps_an_earlier_probe(tmp_path, monkeypatch):
    """Issue 58: `--limit -1` (or 0) loaded the model and overwrote eval/probe-order.json with an empty probe;
    `--order-votes 9` was refused only after loading, by an internal name, without `error:`. Every option, the
    split and its rows are now checked before the model loads, each in one `rlcd: error:` line naming the flag."""
    from conftest import user_error

    from rlcd.analysis import probes

    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "test.jsonl", generate(6, seed=1))
    (data / "dev.jsonl").write_text("")
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"data_dir": str(data)}))
    (run / "export").mkdir()
    (run / "export" / "model.json").write_text("{}")
    earlier = run / "eval" / "probe-order.json"
    earlier.write_text('{"earlier": true}')
    monkeypatch.setattr(probes, "load_run_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    for args, needle in ((["--limit", "-1"], "--limit -1: give the number of questions"),
                         (["--limit", "0"], "--limit 0"),
                         (["--order-votes", "9"], "--order-votes 9: each vote count is a whole number from 1"),
                         (["--order-votes", "1,0"], "--order-votes 0"),
                         (["--order-votes", "two"], "--order-votes two: give comma-separated whole numbers"),
                         (["--max-perms", "0"], "--max-perms 0"),
                         (["--resamples", "0"], "--resamples 0"),
                         (["--batch-size", "0"], "--batch-size 0"),
                         (["--split", "nosuch"], "nosuch.jsonl does not exist"),
                         (["--split", "dev"], "dev.jsonl has no rows to probe"),
                         (["--data", tmp_path / "nodata"], "test.jsonl does not exist")):
        res = user_error(["probe", "order", run, *args], contains=needle, max_lines=1)
        assert res.stderr.startswith("rlcd: error: "), res.stderr
    user_error(["probe", "order", tmp_path / "norun"], contains="no such run directory", max_lines=1)
    assert earlier.read_text() == '{"earlier": true}'
    with pytest.raises(ValueError, match="--limit 0"):  # the library checks too, before loading
        probes.probe_order_run(run, limit=0)


def test_probe_noise_checks_its_options_in_the_cli_style(tmp_path):
    from conftest import user_error

    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"recipe": {"sigma": 0.5, "objective": "rlcd"}}))
    write_jsonl(run / "eval" / "predictions-test.jsonl", ROWS)
    for args, needle in ((["--samples", "0"], "--samples 0"), (["--sigma", "0"], "--sigma 0: give a noise scale"),
                         (["--sigma", "-1"], "--sigma -1")):
        res = user_error(["probe", "noise", run, *args], contains=needle, max_lines=1)
        assert res.stderr.startswith("rlcd: error: "), res.stderr
    res = user_error(["probe", "noise", tmp_path / "missing", "--sigma", "1"], contains="does not exist", max_lines=1)
    assert res.stderr.startswith("rlcd: error: "), res.stderr
