"""CandidateScorer: closed form vs an independent float64 computation, FP32 under bf16, centring."""

import math

import pytest
import torch

torch.set_num_threads(1)

from rlcd.model.head import CandidateScorer  # noqa: E402

H, P = 24, 16


def _inputs(b=3, k=5, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h_dec = (torch.randn(b, H, generator=g) * 2 + 1).to(dtype)
    h_cand = (torch.randn(b, k, H, generator=g) * 2 - 1).to(dtype)
    mask = torch.ones(b, k, dtype=torch.bool)
    mask[0, 3:] = False
    if b > 2:
        mask[2, 2:] = False
    return h_dec, h_cand, mask


def _scorer(centring, seed=1):
    torch.manual_seed(seed)
    s = CandidateScorer(H, proj_dim=P, centring=centring)
    g = torch.Generator().manual_seed(seed + 10)
    s.mu_d.copy_(torch.randn(H, generator=g))
    s.mu_c.copy_(torch.randn(H, generator=g))
    s.centring_ready.fill_(1.0)
    return s.eval()


def _reference(s, h_dec, h_cand, mask):
    """Independent float64 computation of logit_k = (W_c c_k) . (W_d d) / sqrt(P)."""
    d = h_dec.double()
    c = h_cand.double()
    if s.centring == "running_mean":
        d = d - s.mu_d.double()
        c = c - s.mu_c.double()
    elif s.centring == "layernorm":
        def ln(x):
            mean = x.mean(-1, keepdim=True)
            var = ((x - mean) ** 2).mean(-1, keepdim=True)
            return (x - mean) / torch.sqrt(var + 1e-5)
        d, c = ln(d), ln(c)
    wd, wc = s.w_d.weight.double(), s.w_c.weight.double()
    out = torch.empty(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        pd = wd @ d[i]
        for k in range(mask.shape[1]):
            out[i, k] = (wc @ c[i, k]) @ pd / math.sqrt(P) if mask[i, k] else -math.inf
    return out


@pytest.mark.parametrize("centring", ["running_mean", "layernorm", "none"])
def test_closed_form_matches_float64(centring):
    s = _scorer(centring)
    h_dec, h_cand, mask = _inputs()
    got = s(h_dec, h_cand, mask)
    ref = _reference(s, h_dec, h_cand, mask)
    assert got.dtype == torch.float32
    assert torch.equal(torch.isinf(got), ~mask) and (got[~mask] < 0).all()
    torch.testing.assert_close(got[mask].double(), ref[mask], atol=1e-5, rtol=1e-5)


def test_fp32_output_under_bf16_input_and_autocast():
    s = _scorer("running_mean")
    h_dec, h_cand, mask = _inputs(dtype=torch.bfloat16)
    ref = _reference(s, h_dec, h_cand, mask)  # float64 of the bf16 values
    got = s(h_dec, h_cand, mask)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got[mask].double(), ref[mask], atol=1e-5, rtol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_ac = s(h_dec, h_cand, mask)
    assert got_ac.dtype == torch.float32
    torch.testing.assert_close(got_ac[mask].double(), ref[mask], atol=1e-5, rtol=1e-5)
    # a bf16 computation would be far off at this scale; the check above can fail
    bf = (torch.einsum("bkp,bp->bk", (h_cand - s.mu_c.bfloat16()) @ s.w_c.weight.bfloat16().T,
                       (h_dec - s.mu_d.bfloat16()) @ s.w_d.weight.bfloat16().T) / math.sqrt(P)).double()
    assert (bf[mask] - ref[mask]).abs().max() > 1e-4


def test_parameters_independent_of_k_and_padding_does_not_leak():
    s = _scorer("running_mean")
    assert sum(p.numel() for p in s.parameters()) == 2 * H * P
    h_dec, h_cand, _ = _inputs(b=2, k=3)
    base = s(h_dec, h_cand)
    big = torch.cat([h_cand, torch.randn(2, 252, H) * 100], 1)
    other = torch.cat([h_cand, torch.randn(2, 252, H) * -1000], 1)  # the same shape, other padding values
    mask = torch.zeros(2, 255, dtype=torch.bool)
    mask[:, :3] = True
    out = s(h_dec, big, mask)
    assert out.shape == (2, 255)
    # padding values do not reach a real candidate's logit: bit-identical at the same shape
    torch.testing.assert_close(s(h_dec, other, mask)[:, :3], out[:, :3], atol=0, rtol=0)
    # another K is another matmul shape, so some CPU kernels differ by float32 rounding (1.2e-7 seen on AVX512)
    torch.testing.assert_close(out[:, :3], base, atol=1e-6, rtol=1e-5)
    assert torch.isinf(out[:, 3:]).all()


def test_running_mean_uses_buffers_not_batch_statistics():
    s = _scorer("running_mean").train()
    h_dec, h_cand, mask = _inputs(b=4, k=3)
    mask = torch.ones(4, 3, dtype=torch.bool)
    state = {k: v.clone() for k, v in s.state_dict().items()}
    together = s(h_dec, h_cand, mask)
    s.load_state_dict(state)
    alone = s(h_dec[:1], h_cand[:1], mask[:1])
    torch.testing.assert_close(alone, together[:1], atol=1e-6, rtol=1e-6)


def test_ema_update_once_per_optimizer_update():
    s = _scorer("running_mean")
    h_dec, h_cand, mask = _inputs(b=3, k=5)
    mu_d0, mu_c0 = s.mu_d.clone(), s.mu_c.clone()
    s.eval()
    s(h_dec, h_cand, mask)
    s.apply_centring_update()
    assert torch.equal(s.mu_d, mu_d0) and torch.equal(s.mu_c, mu_c0), "eval forwards never move the buffers"
    s.train()
    s(h_dec, h_cand, mask, update=False)
    s.apply_centring_update()
    assert torch.equal(s.mu_d, mu_d0)
    out1 = s(h_dec[:2], h_cand[:2], mask[:2])
    out2 = s(h_dec[2:], h_cand[2:], mask[2:])  # a second micro-batch of the same update
    assert torch.equal(s.mu_d, mu_d0), "buffers stay fixed within an update"
    ref = _reference(_scorer("running_mean"), h_dec, h_cand, mask)  # computed with the *old* buffers
    out = torch.cat([out1, out2])
    torch.testing.assert_close(out[mask].double(), ref[mask], atol=1e-5, rtol=1e-5)
    summed = []
    s.apply_centring_update(reduce=lambda t: summed.append(t.clone()))
    assert len(summed) == 1
    cand_mean = h_cand[mask].mean(0)  # padded candidates excluded; both micro-batches pooled
    torch.testing.assert_close(s.mu_d, 0.99 * mu_d0 + 0.01 * h_dec.mean(0), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s.mu_c, 0.99 * mu_c0 + 0.01 * cand_mean, atol=1e-6, rtol=1e-6)


def test_reduce_pools_accumulators_across_processes():
    """Two 'ranks' with half the rows each, summed by reduce, equal one process with all rows."""
    h_dec, h_cand, mask = _inputs(b=4, k=5)
    one, r0, r1 = (_scorer("running_mean").train() for _ in range(3))
    one(h_dec, h_cand, mask)
    one.apply_centring_update()
    r0(h_dec[:2], h_cand[:2], mask[:2])
    r1(h_dec[2:], h_cand[2:], mask[2:])
    other = r1.pending.clone()
    r0.apply_centring_update(reduce=lambda t: t.add_(other))
    torch.testing.assert_close(r0.mu_d, one.mu_d, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(r0.mu_c, one.mu_c, atol=1e-6, rtol=1e-6)


def test_init_centring_and_first_training_update():
    h_dec, h_cand, mask = _inputs(b=3, k=5)
    s = CandidateScorer(H, proj_dim=P)
    assert float(s.centring_ready) == 0.0 and not s.mu_d.any()
    s.init_centring(h_dec, h_cand, mask)
    torch.testing.assert_close(s.mu_d, h_dec.mean(0))
    torch.testing.assert_close(s.mu_c, h_cand[mask].mean(0))
    assert float(s.centring_ready) == 1.0
    s.init_centring(h_dec, h_cand[mask])  # flattened candidates work too
    torch.testing.assert_close(s.mu_c, h_cand[mask].mean(0))
    # without init, the first update sets the buffers to its means
    s2 = CandidateScorer(H, proj_dim=P).train()
    s2(h_dec, h_cand, mask)
    s2.apply_centring_update()
    torch.testing.assert_close(s2.mu_d, h_dec.mean(0))
    torch.testing.assert_close(s2.mu_c, h_cand[mask].mean(0))
    assert {"mu_d", "mu_c", "centring_ready", "w_d.weight", "w_c.weight"} == set(s2.state_dict())


def test_bad_centring_rejected():
    with pytest.raises(ValueError):
        CandidateScorer(H, centring="batchnorm")
