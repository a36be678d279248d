"""rlcd.objectives against an independent float64 reference written with loops / numpy.

The reference below is implemented from the formula in issue 4, not from the torch code: it
loops over questions and samples and works only on the valid candidates of each row.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rlcd import objectives as obj
from rlcd.objectives import ce_loss, gradient_diagnostics, rlcd_loss

torch.set_num_threads(1)

NG = 4  # the formula's G, written out independently of the module constant


# --------------------------------------------------------------------------------------------
# independent float64 reference


def _softmax(x):
    x = np.asarray(x, dtype=np.float64)
    w = np.exp(x - x.max())
    return w / w.sum()


def reference(logits, mask, target, ordinal, noise, sigma, ce_weight, *, w_sph=0.75, w_rps=1.0,
              norm_groups=None, w_log=1.0):
    """Everything of issue 4 in float64: loss, stats, reward parts and d loss / d logits.

    G is the number of noise draws given; ``norm_groups`` (one id per row) switches the advantage
    std from one over all G*B entries to one per group of rows.
    """
    logits = np.asarray(logits, np.float64)
    mask = np.asarray(mask, bool)
    target = np.asarray(target, np.float64)
    noise = np.asarray(noise, np.float64)
    NG = noise.shape[0]
    B, K = logits.shape
    eps = np.zeros((NG, B, K))
    ls = np.zeros((NG, B))
    sph = np.zeros((NG, B))
    rps = np.zeros((NG, B))
    r = np.zeros((NG, B))
    for b in range(B):
        v = [j for j in range(K) if mask[b, j]]
        k = len(v)
        t = target[b, v]
        for g in range(NG):
            e = [sigma * noise[g, b, j] for j in v]
            centre = sum(e) / k
            for i, j in enumerate(v):
                eps[g, b, j] = e[i] - centre
            q = _softmax([logits[b, j] + eps[g, b, j] for j in v])
            ls[g, b] = sum(t[i] * max(math.log(max(q[i], 1e-12)), -9.21) for i in range(k))
            sph[g, b] = sum(t[i] * q[i] for i in range(k)) / max(math.sqrt(sum(x * x for x in q)),
                                                                 1e-9)
            cq = ct = 0.0
            acc = 0.0
            for i in range(k):
                cq += q[i]
                ct += t[i]
                acc += (cq - ct) ** 2
            rps[g, b] = acc / (max(k, 2) - 1)
            r[g, b] = w_log * ls[g, b] + w_sph * sph[g, b] - (w_rps * rps[g, b] if ordinal[b] else 0.0)
    adv = np.zeros((NG, B))
    for b in range(B):
        m = sum(r[g, b] for g in range(NG)) / NG
        for g in range(NG):
            adv[g, b] = r[g, b] - m
    def sample_std(values):
        mean = sum(values) / len(values)
        return math.sqrt(sum((x - mean) ** 2 for x in values) / (len(values) - 1))

    std = sample_std(list(adv.ravel()))
    a_hat = np.zeros((NG, B))
    for b in range(B):
        if norm_groups is None:
            scale = std
        else:
            scale = sample_std([adv[g, c] for c in range(B) if norm_groups[c] == norm_groups[b]
                                for g in range(NG)])
        for g in range(NG):
            a_hat[g, b] = adv[g, b] / (scale + 1e-6)
    logp = np.array([[-sum(eps[g, b, j] ** 2 for j in range(K)) / (2 * sigma**2)
                      for b in range(B)] for g in range(NG)])
    policy = -np.mean(a_hat * logp)
    ce_rows, grad_ce = [], np.zeros((B, K))
    for b in range(B):
        v = [j for j in range(K) if mask[b, j]]
        p = _softmax(logits[b, v])
        ce_rows.append(-sum(target[b, j] * math.log(p[i]) for i, j in enumerate(v)))
        for i, j in enumerate(v):
            grad_ce[b, j] = (p[i] - target[b, j]) / B
    ce = float(np.mean(ce_rows))
    grad_pg = np.zeros((B, K))
    for b in range(B):
        for j in range(K):
            if mask[b, j]:
                grad_pg[b, j] = -sum(a_hat[g, b] * eps[g, b, j] for g in range(NG)) / (
                    NG * B * sigma**2)
    ordinal = np.asarray(ordinal, bool)
    return {
        "eps": eps, "log_score": ls, "spherical": sph, "rps": rps, "reward": r, "adv": adv,
        "a_hat": a_hat, "adv_std": std, "policy_loss": policy, "ce": ce,
        "loss": policy + ce_weight * ce, "grad_pg": grad_pg, "grad_ce": grad_ce,
        "grad": grad_pg + ce_weight * grad_ce,
        # scale of the summands of L_pg: the policy value is a near-cancelling mean of these
        "policy_scale": float(np.mean(np.abs(a_hat * logp))),
        "reward_mean": float(r.mean()), "reward_std": float(r.std(ddof=1)),
        "log_score_mean": float(ls.mean()), "spherical_mean": float(sph.mean()),
        "rps_mean": float(rps[:, ordinal].mean()) if ordinal.any() else 0.0,
    }


# --------------------------------------------------------------------------------------------
# helpers


def random_batch(seed, B=9, K=12, junk_padding=True):
    """Mixed K in 1..K (always one row with k=1 and one full row), padding holding junk."""
    rng = np.random.default_rng(seed)
    ks = rng.integers(1, K + 1, size=B)
    ks[0], ks[1] = 1, K
    mask = np.zeros((B, K), bool)
    target = np.zeros((B, K), np.float32)
    logits = (rng.normal(size=(B, K)) * 2.0).astype(np.float32)
    for b, k in enumerate(ks):
        mask[b, :k] = True
        if b % 3 == 2:  # hard label
            target[b, rng.integers(k)] = 1.0
        else:
            t = rng.dirichlet(np.ones(k)).astype(np.float32)
            target[b, :k] = t / t.sum()
    if junk_padding:
        junk = np.array([-np.inf, np.inf, np.nan, 1e30, -7.0], np.float32)
        logits[~mask] = junk[rng.integers(len(junk), size=(~mask).sum())]
    ordinal = rng.random(B) < 0.5
    ordinal[0], ordinal[1], ordinal[2] = True, True, False
    noise = rng.normal(size=(NG, B, K)).astype(np.float32)
    if junk_padding:
        pad_noise = np.array([5.0, np.inf, -np.inf, np.nan], np.float32)  # must all be ignored
        noise[:, ~mask] = pad_noise[rng.integers(len(pad_noise), size=noise[:, ~mask].shape)]
    return (torch.from_numpy(logits), torch.from_numpy(mask), torch.from_numpy(target),
            torch.from_numpy(ordinal), torch.from_numpy(noise))


def rel_close(actual, expected, rtol=1e-6, scale=None):
    """Relative agreement; entries near 0 are judged relative to the tensor's scale."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    if scale is None:
        scale = np.abs(expected).max()
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


def loss_and_grad(logits, mask, target, ordinal, noise, sigma, ce_weight):
    x = logits.clone().requires_grad_(True)
    loss, stats = rlcd_loss(x, mask, target, ordinal, sigma=sigma, ce_weight=ce_weight,
                            noise=noise)
    loss.backward()
    return loss, stats, x.grad


# --------------------------------------------------------------------------------------------
# the contract


def test_constants():
    assert (obj.G, obj.LOG_FLOOR, obj.SPHERICAL_WEIGHT, obj.RPS_WEIGHT) == (4, -9.21, 0.75, 1.0)


@pytest.mark.parametrize("sigma", [0.1, 0.3, 2.0])
@pytest.mark.parametrize("ce_weight", [0.0, 1.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_grad_and_stats_match_float64_reference(sigma, ce_weight, seed):
    logits, mask, target, ordinal, noise = random_batch(seed)
    loss, stats, grad = loss_and_grad(logits, mask, target, ordinal, noise, sigma, ce_weight)
    ref = reference(logits.numpy(), mask.numpy(), target.numpy(), ordinal.numpy(),
                    noise.numpy(), sigma, ce_weight)

    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert all(isinstance(v, float) for v in stats.values())
    assert set(stats) == {"loss", "policy_loss", "ce_loss", "reward_mean", "reward_std",
                          "log_score_mean", "spherical_mean", "rps_mean", "advantage_std"}
    # gradient: elementwise within 1e-6 relative (near-zero entries against the largest one)
    assert torch.isfinite(grad).all()
    assert (grad[~mask] == 0).all()
    rel_close(grad.numpy(), ref["grad"])
    # loss value: L_pg is a near-cancelling mean, so judge it against the size of its summands
    pscale = ref["policy_scale"]
    rel_close(stats["policy_loss"], ref["policy_loss"], scale=pscale)
    rel_close(stats["ce_loss"], ref["ce"])
    rel_close(loss.item(), ref["loss"], scale=pscale + ref["ce"])
    rel_close(stats["loss"], ref["loss"], scale=pscale + ref["ce"])
    for key in ("reward_mean", "reward_std", "log_score_mean", "spherical_mean", "rps_mean"):
        rel_close(stats[key], ref[key], rtol=1e-5)
    rel_close(stats["advantage_std"], ref["adv_std"], rtol=1e-5)


@pytest.mark.parametrize("sigma", [0.1, 2.0])
def test_reward_parts_and_advantages_match_reference(sigma):
    logits, mask, target, ordinal, noise = random_batch(3)
    terms = obj._rlcd_terms("t", logits, mask, target, ordinal, sigma=sigma, noise=noise,
                            generator=None)
    ref = reference(logits.numpy(), mask.numpy(), target.numpy(), ordinal.numpy(),
                    noise.numpy(), sigma, 1.0)
    rel_close(terms.eps.numpy(), ref["eps"])
    for name, key in (("log_score", "log_score"), ("spherical", "spherical"), ("rps", "rps"),
                      ("reward", "reward")):
        rel_close(getattr(terms, name).numpy(), ref[key], rtol=1e-5)
    rel_close(terms.a_hat.numpy(), ref["a_hat"], rtol=1e-4)


ARMS = [  # (n_perturbations, w_spherical, w_rps, per-type std): the arms Sev and the cookbook compare
    (8, 0.75, 1.0, False),
    (3, 0.0, 2.5, False),  # G not a power of two: the baseline takes the other path
    (4, 0.75, 1.0, True),
    (8, 0.5, 0.0, True),
]


@pytest.mark.parametrize("G, w_sph, w_rps, per_type", ARMS)
@pytest.mark.parametrize("ce_weight", [0.0, 1.0])
def test_arms_match_float64_reference(G, w_sph, w_rps, per_type, ce_weight):
    logits, mask, target, ordinal, _ = random_batch(20 + G)
    noise = torch.from_numpy(np.random.default_rng(G).normal(size=(G, *logits.shape)).astype(np.float32))
    groups = torch.tensor([0, 2, 1, 0, 1, 2, 2, 0, 1]) if per_type else None
    kw = dict(n_perturbations=G, w_spherical=w_sph, w_rps=w_rps, norm_groups=groups)
    x = logits.clone().requires_grad_(True)
    loss, stats = rlcd_loss(x, mask, target, ordinal, sigma=0.3, ce_weight=ce_weight, noise=noise, **kw)
    loss.backward()
    ref = reference(logits.numpy(), mask.numpy(), target.numpy(), ordinal.numpy(), noise.numpy(), 0.3,
                    ce_weight, w_sph=w_sph, w_rps=w_rps,
                    norm_groups=None if groups is None else groups.numpy())
    rel_close(x.grad.numpy(), ref["grad"])
    rel_close(stats["loss"], ref["loss"], scale=ref["policy_scale"] + ref["ce"])
    for key in ("reward_mean", "reward_std", "log_score_mean", "spherical_mean", "rps_mean"):
        rel_close(stats[key], ref[key], rtol=1e-5)
    rel_close(stats["advantage_std"], ref["adv_std"], rtol=1e-5)
    parts = obj.reward_samples(logits, mask, target, ordinal, sigma=0.3, noise=noise, **kw)
    for name, key in (("log", "log_score"), ("spherical", "spherical"), ("rps", "rps"), ("reward", "reward"),
                      ("advantage", "adv")):
        assert parts[name].shape == (G, len(logits))
        rel_close(parts[name].numpy(), ref[key], rtol=1e-5)
    rel_close(parts["a_hat"].numpy(), ref["a_hat"], rtol=1e-4)
    d = gradient_diagnostics(logits, mask, target, ordinal, sigma=0.3, noise=noise, **kw)
    rel_close(d["pg_grad"].numpy(), ref["grad_pg"])


@pytest.mark.parametrize("w_log", [0.0, 0.5])
def test_w_log_weighs_the_log_score_against_float64_reference(w_log):
    """w_log scales the floored log score in the reward (0 removes it); loss, gradient and rewards follow."""
    logits, mask, target, ordinal, noise = random_batch(41)
    x = logits.clone().requires_grad_(True)
    loss, stats = rlcd_loss(x, mask, target, ordinal, sigma=0.3, ce_weight=1.0, noise=noise, w_log=w_log)
    loss.backward()
    ref = reference(logits.numpy(), mask.numpy(), target.numpy(), ordinal.numpy(), noise.numpy(), 0.3, 1.0,
                    w_log=w_log)
    rel_close(x.grad.numpy(), ref["grad"])
    rel_close(stats["reward_mean"], ref["reward_mean"], rtol=1e-5)
    parts = obj.reward_samples(logits, mask, target, ordinal, sigma=0.3, noise=noise, w_log=w_log)
    rel_close(parts["reward"].numpy(), ref["reward"], rtol=1e-5)
    rel_close(parts["log"].numpy(), ref["log_score"], rtol=1e-5)  # the part itself is logged unweighted
    without_log = 0.75 * ref["spherical"] - 1.0 * ref["rps"] * ordinal.numpy()[None, :]
    if w_log == 0.0:  # nothing of the log score is left in the reward
        rel_close(parts["reward"].numpy(), without_log, rtol=1e-5)
    else:
        assert not np.allclose(parts["reward"].numpy(), without_log)
    d = gradient_diagnostics(logits, mask, target, ordinal, sigma=0.3, noise=noise, w_log=w_log)
    rel_close(d["pg_grad"].numpy(), ref["grad_pg"])


def test_pinned_w_log_is_bit_identical_to_the_default():
    logits, mask, target, ordinal, noise = random_batch(42)
    a = obj.reward_samples(logits, mask, target, ordinal, sigma=0.3, noise=noise)
    b = obj.reward_samples(logits, mask, target, ordinal, sigma=0.3, noise=noise, w_log=1.0)
    assert torch.equal(a["reward"], b["reward"]) and torch.equal(a["a_hat"], b["a_hat"])


def test_per_type_std_differs_from_the_batch_std():
    """The per-group normaliser is not the batch one in disguise: each group's A_hat has unit std by itself."""
    logits, mask, target, ordinal, noise = random_batch(30)
    groups = torch.tensor([0, 1, 1, 1, 1, 1, 1, 1, 1])
    batch = obj.reward_samples(logits, mask, target, ordinal, sigma=0.3, noise=noise)
    typed = obj.reward_samples(logits, mask, target, ordinal, sigma=0.3, noise=noise, norm_groups=groups)
    torch.testing.assert_close(typed["advantage"], batch["advantage"])
    assert not torch.allclose(typed["a_hat"][:, 1:], batch["a_hat"][:, 1:])
    per_group = typed["a_hat"][:, 1:].double().std(correction=1)
    assert per_group.item() == pytest.approx(1.0, rel=1e-4)  # group 1 is normalised by its own std


@pytest.mark.parametrize("G", [3, 5, 8])
def test_identical_rewards_give_exactly_zero_advantage_for_any_G(G):
    logits, mask, target, ordinal, _ = random_batch(31)
    logits = logits.masked_fill(mask, 0.1)
    loss, stats = rlcd_loss(logits, mask, target, ordinal, sigma=0.3, ce_weight=0.0,
                            noise=torch.zeros(G, *logits.shape), n_perturbations=G)
    assert stats["advantage_std"] == 0.0 and stats["policy_loss"] == 0.0


def test_sampled_logits_and_advantages_carry_no_gradient():
    logits, mask, target, ordinal, noise = random_batch(4)
    x = logits.clone().requires_grad_(True)
    terms = obj._rlcd_terms("t", x, mask, target, ordinal, sigma=0.3, noise=noise,
                            generator=None)
    for name in ("z", "q", "log_score", "spherical", "rps", "reward", "advantage", "a_hat"):
        assert not getattr(terms, name).requires_grad, name
    assert terms.policy_loss.requires_grad and terms.ce.requires_grad
    # and the gradient of the policy term is exactly the score-function form (no path through q)
    (g,) = torch.autograd.grad(terms.policy_loss, x)
    ref = reference(logits.numpy(), mask.numpy(), target.numpy(), ordinal.numpy(),
                    noise.numpy(), 0.3, 0.0)
    rel_close(g.numpy(), ref["grad_pg"])


def test_centred_noise_sums_to_zero_and_vanishes_on_padding():
    logits, mask, target, ordinal, noise = random_batch(5)
    terms = obj._rlcd_terms("t", logits, mask, target, ordinal, sigma=0.3, noise=noise,
                            generator=None)
    assert (terms.eps[:, ~mask] == 0).all()
    sums = terms.eps.sum(-1)
    assert sums.abs().max().item() < 1e-6
    assert terms.eps.abs().sum().item() > 0
    # eps is not simply zero: compare with the uncentred draw on a full row
    assert not torch.allclose(terms.eps[:, 1], 0.3 * noise[:, 1])


def test_row_with_one_candidate_gets_zero_noise_and_zero_advantage():
    logits, mask, target, ordinal, noise = random_batch(6)
    assert mask[0].sum() == 1
    terms = obj._rlcd_terms("t", logits, mask, target, ordinal, sigma=2.0, noise=noise,
                            generator=None)
    assert (terms.eps[:, 0] == 0).all()
    assert (terms.advantage[:, 0] == 0).all() and (terms.a_hat[:, 0] == 0).all()
    # it still counts in the std: the reference std over all G*B entries agrees
    ref = reference(logits.numpy(), mask.numpy(), target.numpy(), ordinal.numpy(),
                    noise.numpy(), 2.0, 1.0)
    rel_close(terms.advantage_std.item(), ref["adv_std"], rtol=1e-5)


@pytest.mark.parametrize("case", ["zero_noise", "all_single"])
def test_all_equal_rewards_give_zero_advantage_no_nan(case):
    logits, mask, target, ordinal, noise = random_batch(7)
    if case == "zero_noise":
        noise = torch.zeros_like(noise)
        logits = logits.masked_fill(mask, 0.1)  # awkward value for float sums
    else:
        mask = torch.zeros_like(mask)
        mask[:, 0] = True
        target = mask.float()
    x = logits.clone().requires_grad_(True)
    loss, stats = rlcd_loss(x, mask, target, ordinal, sigma=0.3, ce_weight=0.0, noise=noise)
    loss.backward()
    assert stats["advantage_std"] == 0.0
    assert stats["policy_loss"] == 0.0
    assert all(math.isfinite(v) for v in stats.values())
    assert (x.grad == 0).all()


def test_rps_prefers_nearer_wrong_level():
    K = 5
    target = torch.zeros(2, K)
    target[:, 0] = 1.0  # truth: level 0
    logits = torch.full((2, K), -4.0)
    logits[0, 1] = 4.0  # mass on level 1 (near)
    logits[1, 4] = 4.0  # mass on level 4 (far); a permutation, so LS and SPH are identical
    mask = torch.ones(2, K, dtype=torch.bool)
    noise = torch.zeros(NG, 2, K)
    for ordinal, should_differ in ((torch.tensor([True, True]), True),
                                   (torch.tensor([False, False]), False)):
        terms = obj._rlcd_terms("t", logits, mask, target, ordinal, sigma=0.3, noise=noise,
                                generator=None)
        near, far = terms.reward[0]
        assert terms.log_score[0, 0] == pytest.approx(terms.log_score[0, 1].item())
        if should_differ:
            assert near > far + 0.5
            assert terms.rps[0, 0] < terms.rps[0, 1]
        else:
            assert near.item() == pytest.approx(far.item(), abs=1e-6)


def test_ce_loss_equals_torch_cross_entropy_with_probability_targets():
    rng = np.random.default_rng(8)
    B, K = 6, 7
    logits = torch.from_numpy((rng.normal(size=(B, K)) * 3).astype(np.float32))
    target = torch.from_numpy(rng.dirichlet(np.ones(K), size=B).astype(np.float32))
    mask = torch.ones(B, K, dtype=torch.bool)
    x = logits.clone().requires_grad_(True)
    loss, stats = ce_loss(x, mask, target)
    y = logits.clone().requires_grad_(True)
    expected = F.cross_entropy(y, target)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert stats["ce_loss"] == stats["loss"] == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-6, atol=1e-7)


def test_ce_loss_with_padding_equals_per_row_cross_entropy():
    logits, mask, target, ordinal, noise = random_batch(9)
    loss, _ = ce_loss(logits, mask, target)
    rows = [F.cross_entropy(logits[b, mask[b]][None], target[b, mask[b]][None])
            for b in range(len(mask))]
    assert loss.item() == pytest.approx(torch.stack(rows).mean().item(), rel=1e-6)
    # and rlcd_loss's ce part is the same quantity
    _, stats = rlcd_loss(logits, mask, target, ordinal, noise=noise)
    assert stats["ce_loss"] == pytest.approx(loss.item(), rel=1e-6)


def _reward_grad_fd(logits, mask, target, ordinal, h=1e-6):
    """d r / d z at eps = 0 by central differences of the float64 reference reward."""
    B, K = logits.shape
    zeros = np.zeros((NG, B, K))
    out = np.zeros((B, K))
    for b in range(B):
        for j in range(K):
            if not mask[b, j]:
                continue
            up, dn = logits.copy(), logits.copy()
            up[b, j] += h
            dn[b, j] -= h
            r_up = reference(up, mask, target, ordinal, zeros, 1.0, 0.0)["reward"][0, b]
            r_dn = reference(dn, mask, target, ordinal, zeros, 1.0, 0.0)["reward"][0, b]
            out[b, j] = (r_up - r_dn) / (2 * h)
    return out


def test_expected_policy_gradient_aligns_with_ce_gradient_as_sigma_goes_to_zero():
    rng = np.random.default_rng(10)
    B, K, R = 4, 6, 600  # R replicas x G = 2400 draws per question, one batched call
    ks = [6, 5, 3, 4]
    mask = np.zeros((B, K), bool)
    target = np.zeros((B, K), np.float32)
    for b, k in enumerate(ks):
        mask[b, :k] = True
        target[b, :k] = rng.dirichlet(np.ones(k) * 0.5)
        target[b] /= target[b].sum()
    logits = np.where(mask, rng.normal(size=(B, K)) * 1.5, -np.inf).astype(np.float32)
    ordinal = np.array([True, False, True, False])
    rep = lambda a: torch.from_numpy(np.tile(a, (R,) + (1,) * (a.ndim - 1)))
    gen = torch.Generator().manual_seed(0)
    diag = gradient_diagnostics(rep(logits), rep(mask), rep(target), rep(ordinal), sigma=0.01,
                                noise=torch.randn(NG, R * B, K, generator=gen))
    g_pg = diag["pg_grad"].double().reshape(R, B, K).mean(0).numpy()
    g_ce = diag["ce_grad"].double().reshape(R, B, K).mean(0).numpy()

    def cos(a, b):
        return float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))

    # CE gradient of the loss from the float64 reference (independent of the torch code)
    ref = reference(logits, mask, target, ordinal, np.zeros((NG, B, K)), 1.0, 1.0)
    rel_close(g_ce * R, ref["grad_ce"], rtol=1e-5)  # batch mean over R*B rows = R times smaller
    # the policy gradient of the LOSS descends the reward, like the CE gradient of the loss
    assert cos(g_pg, ref["grad_ce"]) > 0.9
    # and it estimates -(centred) d reward / d logits (the reward includes SPH and RPS)
    dr = _reward_grad_fd(logits.astype(np.float64), mask, target, ordinal)
    dr = np.where(mask, dr - dr.sum(-1, keepdims=True) / mask.sum(-1, keepdims=True), 0.0)
    assert cos(g_pg, -dr) > 0.95


def test_gradient_diagnostics_match_reference():
    logits, mask, target, ordinal, noise = random_batch(11)
    x = logits.clone().requires_grad_(True)
    d = gradient_diagnostics(x, mask, target, ordinal, sigma=0.3, noise=noise)
    assert x.grad is None
    ref = reference(logits.numpy(), mask.numpy(), target.numpy(), ordinal.numpy(),
                    noise.numpy(), 0.3, 1.0)
    rel_close(d["pg_grad"].numpy(), ref["grad_pg"])
    rel_close(d["ce_grad"].numpy(), ref["grad_ce"])
    n_pg, n_ce = np.linalg.norm(ref["grad_pg"]), np.linalg.norm(ref["grad_ce"])
    for key in ("pg_grad_norm", "ce_grad_norm", "grad_norm_ratio", "grad_cosine"):
        assert isinstance(d[key], float)
    assert d["grad_norm_ratio"] == pytest.approx(n_pg / n_ce, rel=1e-5)
    assert d["grad_cosine"] == pytest.approx(
        float((ref["grad_pg"] * ref["grad_ce"]).sum() / (n_pg * n_ce)), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("G, per_type, ce_weight", [(4, False, 1.0), (4, True, 0.7), (3, False, 0.0)])
def test_row_terms_split_the_loss_and_its_logit_gradient_by_row(G, per_type, ce_weight):
    """row_terms against the float64 reference: per-row CE and policy terms (their means are the loss's terms),
    each sample's reward, and d loss / d logits equal to the gradient rlcd_loss's own backward leaves."""
    logits, mask, target, ordinal, _ = random_batch(60 + G)  # mixed K, junk on padding
    noise = torch.from_numpy(np.random.default_rng(G).normal(size=(G, *logits.shape)).astype(np.float32))
    groups = torch.tensor([0, 2, 1, 0, 1, 2, 2, 0, 1]) if per_type else None
    kw = dict(sigma=0.3, ce_weight=ce_weight, noise=noise, n_perturbations=G, norm_groups=groups)
    x = logits.clone().requires_grad_(True)
    loss, stats = rlcd_loss(x, mask, target, ordinal, **kw)
    loss.backward()
    before = x.grad.clone()
    rows = obj.row_terms(x, mask, target, ordinal, **kw)
    assert torch.equal(x.grad, before)  # a detached copy: the caller's .grad is untouched
    assert set(rows) == {"ce", "policy", "reward", "grad"} and rows["grad"].shape == logits.shape
    ref = reference(logits.numpy(), mask.numpy(), target.numpy(), ordinal.numpy(), noise.numpy(), 0.3, ce_weight,
                    norm_groups=None if groups is None else groups.numpy())
    m = mask.numpy()
    ce_rows = [-sum(target[b, j].item() * math.log(p) for j, p in zip(np.flatnonzero(m[b]), _softmax(logits[b, m[b]])))
               for b in range(len(m))]
    logp = -(ref["eps"] ** 2).sum(-1) / (2 * 0.3 ** 2)
    policy_rows = -(ref["a_hat"] * logp).mean(0)
    rel_close(rows["ce"].numpy(), ce_rows)
    rel_close(rows["policy"].numpy(), policy_rows, rtol=1e-5, scale=ref["policy_scale"])
    rel_close(rows["reward"].numpy(), ref["reward"], rtol=1e-5)
    rel_close(rows["grad"].numpy(), ref["grad"])
    assert (rows["grad"][~mask] == 0).all()
    torch.testing.assert_close(rows["grad"], before, rtol=1e-6, atol=1e-9)  # what the real backward left
    assert rows["ce"].mean().item() == pytest.approx(stats["ce_loss"], rel=1e-6)
    rel_close(rows["policy"].mean().item(), stats["policy_loss"], scale=ref["policy_scale"])


def test_row_terms_of_the_ce_arm_and_the_cheap_ce_rows():
    logits, mask, target, ordinal, noise = random_batch(70)
    x = logits.clone().requires_grad_(True)
    loss, _ = ce_loss(x, mask, target)
    loss.backward()
    ref = reference(logits.numpy(), mask.numpy(), target.numpy(), ordinal.numpy(), noise.numpy(), 0.3, 1.0)
    rows = obj.row_terms(logits, mask, target, objective="ce")
    assert set(rows) == {"ce", "grad"}
    rel_close(rows["grad"].numpy(), ref["grad_ce"])
    torch.testing.assert_close(rows["grad"], x.grad, rtol=1e-6, atol=1e-9)
    assert rows["ce"].mean().item() == pytest.approx(loss.item(), rel=1e-6)
    for objective in ("ce", "rlcd"):  # full=False: the CE rows alone, no noise needed
        cheap = obj.row_terms(logits, mask, target, ordinal, objective=objective, full=False)
        assert set(cheap) == {"ce"} and torch.equal(cheap["ce"], rows["ce"])
    with pytest.raises(ValueError, match="objective must be"):
        obj.row_terms(logits, mask, target, objective="rl")
    with pytest.raises(ValueError, match="needs sigma"):
        obj.row_terms(logits, mask, target, ordinal, noise=noise)


def test_noise_drawn_from_generator():
    logits, mask, target, ordinal, _ = random_batch(12)
    a, _ = rlcd_loss(logits, mask, target, ordinal, generator=torch.Generator().manual_seed(3))
    b, _ = rlcd_loss(logits, mask, target, ordinal, generator=torch.Generator().manual_seed(3))
    c, _ = rlcd_loss(logits, mask, target, ordinal, generator=torch.Generator().manual_seed(4))
    noise = torch.randn(NG, *logits.shape, generator=torch.Generator().manual_seed(3))
    d, _ = rlcd_loss(logits, mask, target, ordinal, noise=noise)
    assert a.item() == b.item() == d.item()
    assert a.item() != c.item()


def test_bf16_logits_give_float32_results():
    logits, mask, target, ordinal, noise = random_batch(13)
    xb = logits.masked_fill(~mask, float("-inf")).bfloat16().requires_grad_(True)
    loss, stats = rlcd_loss(xb, mask, target, ordinal, noise=noise)
    assert loss.dtype == torch.float32
    assert all(isinstance(v, float) and math.isfinite(v) for v in stats.values())
    loss.backward()
    assert xb.grad.dtype == torch.bfloat16 and torch.isfinite(xb.grad.float()).all()
    # same numbers as float32 logits holding the bf16 values
    xf = xb.detach().float()
    loss32, _ = rlcd_loss(xf, mask, target, ordinal, noise=noise)
    assert loss.item() == loss32.item()
    lc, _ = ce_loss(xb, mask, target)
    assert lc.dtype == torch.float32


# --------------------------------------------------------------------------------------------
# validation


def _bad(**changes):
    logits, mask, target, ordinal, noise = random_batch(14)
    args = dict(logits=logits, mask=mask, target=target, ordinal=ordinal, noise=noise)
    for key, fn in changes.items():
        args[key] = fn(args[key].clone()) if callable(fn) else fn
    return args


def _set(idx, value):
    def f(t):
        t[idx] = value
        return t
    return f


@pytest.mark.parametrize("changes, pattern", [
    (dict(logits=_set((1, 3), float("nan"))), r"logits must be finite.*row 1 candidate 3"),
    (dict(logits=_set((1, 0), float("inf"))), r"logits must be finite.*row 1 candidate 0"),
    (dict(target=_set((1, 2), float("nan"))), r"target must be finite.*row 1"),
    (dict(target=_set((1, 2), -0.5)), r"target must be >= 0.*row 1 candidate 2"),
    (dict(target=_set((0, 5), 0.25)), r"target must be 0 on padded.*row 0 candidate 5"),
    (dict(target=lambda t: t * 2), r"target rows must sum to 1"),
    (dict(mask=_set((0, 0), False)), r"mask must mark at least one valid candidate.*row 0"),
    (dict(noise=_set((2, 1, 4), float("nan"))), r"noise must be finite.*sample 2 row 1"),
    (dict(mask=lambda m: m[:, :5]), r"mask shape"),
    (dict(target=lambda t: t[:-1]), r"target shape"),
    (dict(ordinal=lambda o: o[:-1]), r"ordinal shape"),
    (dict(noise=lambda n: n[:3]), r"noise shape"),
    (dict(mask=lambda m: m.float()), r"mask must be a bool"),
    (dict(logits=lambda x: x[0]), r"logits must have shape \[B, K\]"),
])
def test_bad_input_raises_clear_error(changes, pattern):
    args = _bad(**changes)
    with pytest.raises(ValueError, match=pattern):
        rlcd_loss(args["logits"], args["mask"], args["target"], args["ordinal"],
                  noise=args["noise"])


@pytest.mark.parametrize("kw, pattern", [
    (dict(n_perturbations=1), r"n_perturbations must be an integer >= 2"),
    (dict(n_perturbations=8), r"noise shape .* \(G = n_perturbations = 8\)"),
    (dict(w_spherical=-0.1), r"w_spherical must be finite and >= 0"),
    (dict(w_rps=float("inf")), r"w_rps must be finite"),
    (dict(w_log=-1.0), r"w_log must be finite and >= 0"),
    (dict(norm_groups=torch.zeros(3, dtype=torch.long)), r"norm_groups shape"),
    (dict(norm_groups=torch.zeros(9)), r"norm_groups must be an integer"),
    (dict(sigma=0.0), r"sigma must be finite and > 0"),
    (dict(sigma=-0.3), r"sigma must be finite and > 0"),
    (dict(sigma=float("nan")), r"sigma"),
    (dict(ce_weight=-1.0), r"ce_weight must be finite and >= 0"),
])
def test_bad_hyperparameters_raise(kw, pattern):
    logits, mask, target, ordinal, noise = random_batch(15)
    with pytest.raises(ValueError, match=pattern):
        rlcd_loss(logits, mask, target, ordinal, noise=noise, **kw)


def test_ce_loss_and_diagnostics_validate_too():
    logits, mask, target, ordinal, noise = random_batch(16)
    bad = logits.clone()
    bad[1, 1] = float("nan")
    with pytest.raises(ValueError, match=r"ce_loss: logits must be finite"):
        ce_loss(bad, mask, target)
    with pytest.raises(ValueError, match=r"gradient_diagnostics: logits must be finite"):
        gradient_diagnostics(bad, mask, target, ordinal, sigma=0.3, noise=noise)
    with pytest.raises(ValueError, match=r"sigma"):
        gradient_diagnostics(logits, mask, target, ordinal, sigma=0.0, noise=noise)
