"""rlcd.diagnostics against independent numpy computations: per-type reward parts, advantage spread,
extreme advantages pooled over an update's micro-batches, the objective per type (CE, policy term, reward,
logit-gradient split) against the float64 reference of test_objectives, and the dev scoring rules."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlcd.diagnostics import ObjectiveDiagnostics, RewardDiagnostics, dev_scores
from rlcd.objectives import reward_samples
from rlcd.schema import QUESTION_TYPES

torch.set_num_threads(1)


def micro_batch(seed, B=6, K=5, G=4):
    rng = np.random.default_rng(seed)
    type_id = torch.from_numpy(rng.integers(0, 3, size=B))
    type_id[:3] = torch.tensor([0, 1, 2])
    mask = torch.ones(B, K, dtype=torch.bool)
    mask[type_id == 1, 2:] = False  # noul rows: 2 candidates
    target = torch.from_numpy(rng.dirichlet(np.ones(K), size=B).astype(np.float32)) * mask
    target = target / target.sum(-1, keepdim=True)
    logits = torch.from_numpy(rng.normal(size=(B, K)).astype(np.float32) * 3)
    noise = torch.from_numpy(rng.normal(size=(G, B, K)).astype(np.float32))
    ordinal = type_id == 2
    return logits, mask, target, ordinal, noise, type_id


def test_reward_diagnostics_pool_micro_batches_per_type():
    diag = RewardDiagnostics()
    pooled = {t: {k: [] for k in ("log", "spherical", "rps", "advantage", "a_hat")} for t in range(3)}
    for seed in (0, 1):
        logits, mask, target, ordinal, noise, type_id = micro_batch(seed)
        parts = reward_samples(logits, mask, target, ordinal, sigma=2.0, noise=noise)
        diag.add(parts, type_id, ordinal)
        for b, t in enumerate(type_id.tolist()):
            for k in pooled[t]:
                pooled[t][k] += parts[k][:, b].tolist()
    got = diag.summary()
    for t, name in enumerate(QUESTION_TYPES):
        for comp in ("log", "spherical") + (("rps",) if name == "score" else ()):
            vals = np.array(pooled[t][comp])
            assert got[f"reward/{name}/{comp}/mean"] == pytest.approx(vals.mean(), rel=1e-12)
            assert got[f"reward/{name}/{comp}/std"] == pytest.approx(vals.std(ddof=1), rel=1e-9)
        assert f"reward/{name}/rps/mean" in got if name == "score" else f"reward/{name}/rps/mean" not in got
        assert got[f"adv_std/{name}"] == pytest.approx(np.std(pooled[t]["advantage"], ddof=1), rel=1e-9)
        assert got[f"adv_extreme_share/{name}"] == np.mean(np.abs(pooled[t]["a_hat"]) > 3)
    adv = np.concatenate([pooled[t]["advantage"] for t in range(3)])
    a_hat = np.concatenate([pooled[t]["a_hat"] for t in range(3)])
    assert got["adv_std"] == pytest.approx(adv.std(ddof=1), rel=1e-9)
    assert got["adv_extreme_share"] == np.mean(np.abs(a_hat) > 3)


def test_extreme_share_counts_large_normalised_advantages():
    """One outlier question among many quiet ones: its samples are the extreme ones."""
    B, K, G = 40, 3, 4
    logits = torch.zeros(B, K)
    mask = torch.ones(B, K, dtype=torch.bool)
    target = torch.full((B, K), 1 / 3)
    noise = torch.zeros(G, B, K)
    noise[:, 0] = torch.tensor([[3.0, -3, 0], [-3, 3, 0], [3, 0, -3], [-3, 0, 3]])  # only row 0 moves
    noise[:, 1:] = 1e-3 * torch.randn(G, B - 1, K, generator=torch.Generator().manual_seed(0))
    ordinal = torch.zeros(B, dtype=torch.bool)
    target[0] = torch.tensor([1.0, 0, 0])
    diag = RewardDiagnostics()
    parts = reward_samples(logits, mask, target, ordinal, sigma=1.0, noise=noise)
    diag.add(parts, torch.zeros(B, dtype=torch.long), ordinal)
    got = diag.summary()
    expected = float((parts["a_hat"].abs() > 3).double().mean())
    assert got["adv_extreme_share"] == expected
    assert 0 < expected <= G / (G * B)  # the outlier's samples, nothing else


def test_summary_reduce_sees_the_sums_before_reading():
    logits, mask, target, ordinal, noise, type_id = micro_batch(2)
    one, two = RewardDiagnostics(), RewardDiagnostics()
    parts = reward_samples(logits, mask, target, ordinal, sigma=0.3, noise=noise)
    one.add(parts, type_id, ordinal)
    two.add(parts, type_id, ordinal)
    two.add(parts, type_id, ordinal)
    doubled = one.summary(reduce=lambda t: t.mul_(2))  # what an all_reduce over two equal ranks does
    plain = two.summary()
    assert doubled.keys() == plain.keys()
    for k in plain:
        assert doubled[k] == pytest.approx(plain[k], rel=1e-12), k


def test_dev_scores_by_hand():
    rows = [
        {"id": "a", "group": "g", "type": "noul", "target": [0.0, 1.0], "logits": [0.0, 0.0]},
        {"id": "b", "group": "g", "type": "noul", "target": [1.0, 0.0], "logits": [0.0, np.log(3.0)]},
        {"id": "c", "group": "h", "type": "choice", "target": [0.0, 0.0, 1.0], "logits": [0.0, 0.0, 0.0]},
    ]
    got = dev_scores(rows)
    nll = {"a": np.log(2), "b": np.log(4), "c": np.log(3)}
    brier = {"a": 0.5, "b": 2 * 0.75 ** 2, "c": 2 / 9 + (2 / 3) ** 2}
    assert got["dev_nll"] == pytest.approx(np.mean(list(nll.values())))
    assert got["dev_brier"] == pytest.approx(np.mean(list(brier.values())))
    assert got["dev_nll/noul"] == pytest.approx((nll["a"] + nll["b"]) / 2)
    assert got["dev_nll/choice"] == pytest.approx(nll["c"])
    # ECE, one row per bin, all wrong (argmax ties go to index 0): a conf 1/2, b conf 3/4, c conf 1/3
    assert got["dev_ece/noul"] == pytest.approx((0.5 + 0.75) / 2)
    assert got["dev_ece"] == pytest.approx((0.5 + 0.75 + 1 / 3) / 3)
    # per-type top-1 accuracy: b argmax 1 (target 0) wrong, a tie -> 0 (target 1) wrong; c tie -> 0 (target 2) wrong
    assert got["dev_accuracy/noul"] == 0.0 and got["dev_accuracy/choice"] == 0.0
    right = dict(rows[1], logits=[np.log(3.0), 0.0])
    assert dev_scores([rows[0], right, rows[2]])["dev_accuracy/noul"] == pytest.approx(0.5)
    assert "dev_nll/score" not in got and "dev_accuracy/score" not in got and dev_scores([]) == {}


def test_type_diagnostics_still_summarise(monkeypatch):
    from rlcd.diagnostics import TypeDiagnostics

    logits, mask, _, _, _, type_id = micro_batch(3)
    d = TypeDiagnostics()
    d.add(logits, SimpleNamespace(cand_mask=mask, type_id=type_id))
    out = d.summary()["per_type"]
    assert sum(v["n"] for v in out.values()) == len(type_id)
    assert out["noul"]["effective_candidates"] <= 2 + 1e-6


def test_type_diagnostics_pool_over_ranks_with_reduce():
    """Two 'ranks' with their own rows: summary(reduce=sum over ranks) gives, on each, the per-type means
    over all rows (float64 reference), not its own rows' means."""
    from rlcd.diagnostics import TypeDiagnostics

    batches = [micro_batch(seed, B=7 + seed) for seed in (4, 5)]
    ranks = []
    for logits, mask, _, _, _, type_id in batches:
        d = TypeDiagnostics()
        d.add(logits, SimpleNamespace(cand_mask=mask, type_id=type_id))
        ranks.append(d)
    local = ranks[0].summary()["per_type"]
    others = ranks[1].sums.clone()
    pooled = ranks[0].summary(reduce=lambda t: t.add_(others))["per_type"]  # what all_reduce(SUM) does
    ref: dict[int, list] = {0: [], 1: [], 2: []}
    for logits, mask, _, _, _, type_id in batches:
        for z, m, t in zip(logits.double(), mask, type_id.tolist()):
            p = torch.softmax(z[m], -1)
            h = float(-(p * p.log()).sum())
            ref[t].append((h, float(p.max()), math.exp(h)))
    for i, t in enumerate(("choice", "noul", "score")):
        vals = np.array(ref[i])
        assert pooled[t]["n"] == len(vals) > local[t]["n"]
        assert pooled[t]["entropy"] == pytest.approx(vals[:, 0].mean(), rel=1e-5)
        assert pooled[t]["max_prob"] == pytest.approx(vals[:, 1].mean(), rel=1e-5)
        assert pooled[t]["effective_candidates"] == pytest.approx(vals[:, 2].mean(), rel=1e-5)


# ------------------------------------------------------------------ the objective per type


def _update(seeds, objective="rlcd", *, ce_weight=0.7, sigma=0.5, full=True, K=(5, 7)):
    """One update of micro-batches (three types, padded K, K varying between micro-batches): the diagnostics,
    the real loss's stats, the logit gradients of (loss / A).backward(), and the float64 reference terms."""
    from test_objectives import reference

    from rlcd.objectives import ce_loss, rlcd_loss, row_terms

    diag, stats, grads, refs = ObjectiveDiagnostics(), [], [], []
    for i, seed in enumerate(seeds):
        logits, mask, target, ordinal, noise, type_id = micro_batch(seed, K=K[i % len(K)])
        x = logits.clone().requires_grad_(True)
        kw = dict(sigma=sigma, ce_weight=ce_weight, noise=noise) if objective == "rlcd" else {}
        loss, st = (rlcd_loss(x, mask, target, ordinal, **kw) if objective == "rlcd" else ce_loss(x, mask, target))
        (loss / len(seeds)).backward()
        diag.add(row_terms(logits, mask, target, ordinal, objective=objective, full=full, **kw), type_id)
        stats.append(st)
        grads.append(x.grad)
        ref = reference(logits.numpy(), mask.numpy(), target.numpy(), ordinal.numpy(), noise.numpy(), sigma, ce_weight)
        ce_rows = [float(-(target[b][mask[b]].double() * torch.log_softmax(logits[b][mask[b]].double(), -1)).sum())
                   for b in range(len(mask))]
        refs.append({**ref, "ce_rows": np.array(ce_rows), "type_id": type_id.numpy(),
                     "grad": ref["grad"] if objective == "rlcd" else ref["grad_ce"],
                     "policy": -(ref["a_hat"] * -(ref["eps"] ** 2).sum(-1) / (2 * sigma ** 2))})
    return diag, stats, grads, refs


def _per_type_reference(refs):
    """Per type, from the float64 reference: mean CE, mean policy term, reward mean / std, and the norm of the
    update loss's gradient ((1/A) sum_i L_i) with respect to that type's logits."""
    A = len(refs)
    out = {}
    for t, name in enumerate(QUESTION_TYPES):
        rows = [(r, r["type_id"] == t) for r in refs]
        ce = np.concatenate([r["ce_rows"][sel] for r, sel in rows])
        if not len(ce):
            continue
        policy = np.concatenate([r["policy"][:, sel].ravel() for r, sel in rows])
        reward = np.concatenate([r["reward"][:, sel].ravel() for r, sel in rows])
        grad2 = sum(float((r["grad"][sel] ** 2).sum()) for r, sel in rows)
        out[name] = {"n": len(ce), "ce": ce.mean(), "policy": policy.mean(), "reward": reward.mean(),
                     "reward_std": reward.std(ddof=1), "grad_norm": math.sqrt(grad2) / A}
    return out


def test_objective_diagnostics_per_type_against_float64():
    diag, stats, grads, refs = _update((10, 11, 12))
    got = diag.summary()
    ref = _per_type_reference(refs)
    assert set(ref) == set(QUESTION_TYPES)
    total = sum(r["grad_norm"] ** 2 for r in ref.values())
    for t, r in ref.items():
        assert got[f"ce/{t}"] == pytest.approx(r["ce"], rel=1e-6)
        assert got[f"policy_loss/{t}"] == pytest.approx(r["policy"], rel=1e-5, abs=1e-6)
        assert got[f"reward/{t}/mean"] == pytest.approx(r["reward"], rel=1e-5)
        assert got[f"reward/{t}/std"] == pytest.approx(r["reward_std"], rel=1e-5)
        assert got[f"grad_norm/{t}"] == pytest.approx(r["grad_norm"], rel=1e-5)
        assert got[f"grad_share/{t}"] == pytest.approx(r["grad_norm"] ** 2 / total, rel=1e-5)
    # the split adds up to the update's pooled numbers
    whole = sum(float(g.double().square().sum()) for g in grads)  # ||dL/dlogits||^2 of the real backward
    assert sum(got[f"grad_norm/{t}"] ** 2 for t in ref) == pytest.approx(whole, rel=1e-6)
    assert sum(got[f"grad_share/{t}"] for t in ref) == pytest.approx(1.0, abs=1e-12)
    n = sum(r["n"] for r in ref.values())  # every micro-batch holds 6 rows: the pooled stats are row means
    for key, stat in (("ce/{}", "ce_loss"), ("policy_loss/{}", "policy_loss"), ("reward/{}/mean", "reward_mean")):
        pooled = sum(ref[t]["n"] * got[key.format(t)] for t in ref) / n
        assert pooled == pytest.approx(np.mean([s[stat] for s in stats]), rel=1e-5, abs=1e-6), key
    # the types differ, so a split that pooled them would fail above
    assert len({round(got[f"grad_share/{t}"], 6) for t in ref}) == 3


def test_objective_diagnostics_keys_per_objective_and_cadence():
    types = [f"/{t}" for t in QUESTION_TYPES]
    rl = _update((20, 21))[0].summary()
    assert set(rl) == {f"{k}{t}" for k in ("ce", "policy_loss", "grad_norm", "grad_share") for t in types} | {
        f"reward{t}/{s}" for t in types for s in ("mean", "std")}
    diag, _, grads, refs = _update((20, 21), "ce")
    ce = diag.summary()
    assert set(ce) == {f"{k}{t}" for k in ("ce", "grad_norm", "grad_share") for t in types}
    for t, r in _per_type_reference(refs).items():
        assert ce[f"ce/{t}"] == pytest.approx(r["ce"], rel=1e-6)
        assert ce[f"grad_norm/{t}"] == pytest.approx(r["grad_norm"], rel=1e-5)
    assert sum(ce[f"grad_norm/{t}"] ** 2 for t in QUESTION_TYPES) == pytest.approx(
        sum(float(g.double().square().sum()) for g in grads), rel=1e-6)
    cheap = _update((20, 21), full=False)[0].summary()  # off the diagnostics cadence: CE alone
    assert set(cheap) == {f"ce{t}" for t in types} and all(cheap[k] == rl[k] for k in cheap)
    assert ObjectiveDiagnostics().summary() == {}


def test_objective_diagnostics_leave_out_absent_types_and_pool_over_ranks():
    from rlcd.objectives import row_terms

    logits, mask, target, ordinal, noise, type_id = micro_batch(30)
    keep = type_id != 2  # no score rows in this update
    only = ObjectiveDiagnostics()
    only.add(row_terms(logits[keep], mask[keep], target[keep], ordinal[keep], sigma=0.3, noise=noise[:, keep]),
             type_id[keep])
    assert not [k for k in only.summary() if k.endswith("/score") or "/score/" in k]
    # two "ranks" of one update: summary(reduce=sum over ranks) equals one process holding all four micro-batches
    (one, *_), (two, *_), (both, *_) = _update((31, 32)), _update((33, 34)), _update((31, 32, 33, 34))
    others = two.sums.clone()
    local = one.summary()
    pooled = ObjectiveDiagnostics()
    pooled.sums = one.sums.clone()
    pooled = pooled.summary(reduce=lambda t: t.add_(others))
    want = both.summary()
    assert pooled.keys() == want.keys()
    for k in want:
        assert pooled[k] == pytest.approx(want[k], rel=1e-12), k
    assert local["grad_norm/choice"] != pytest.approx(want["grad_norm/choice"], rel=1e-3)  # pooling matters
