"""Training objectives: the RLCD loss, the CE-only arm and gradient diagnostics.

All three work on one micro-batch of candidate logits:

- ``logits [B, K]``: any float dtype; the loss and its gradient are computed in float32 (the
  detached, [G, B, K]-sized reward/advantage stage in float64, see ``_rlcd_terms``). Padded
  candidates (``mask`` False) may hold any value (``-inf``, ``nan``, junk): they are replaced
  before any arithmetic and receive zero gradient.
- ``mask [B, K]`` bool: valid candidates; every row needs at least one.
- ``target [B, K]``: a probability distribution over the valid candidates of each row (finite,
  >= 0, sums to 1 within ``TARGET_SUM_TOL``), exactly 0 on padding.
- ``ordinal [B]`` bool: score questions (levels in ascending order along K); they get the RPS
  penalty.

The RLCD formula (issue 4, the contract), per micro-batch, with G samples per question
(``n_perturbations``, 4 in the pinned recipe):

1. ``k_b`` = valid candidates of row b; ``e = sigma * noise * mask``;
   ``eps = (e - sum_j e_j / k_b) * mask`` (centred over the valid candidates, zero on padding).
2. ``z = stopgrad(logits) + eps``; ``q = softmax(z)`` over the valid candidates.
3. Reward (no gradient): ``LS = sum_j t_j max(log max(q_j, 1e-12), -9.21)``;
   ``SPH = (sum_j t_j q_j) / max(||q||_2, 1e-9)``; ordinal rows
   ``RPS = sum_{j valid} (Q_j - T_j)^2 / (max(k_b, 2) - 1)`` with Q, T the cumulative sums of q
   and t in level order; ``r = w_log LS + w_sph SPH - w_rps RPS * ordinal`` (w_log 1.0, w_sph 0.75,
   w_rps 1.0; w_log 0 removes the log score).
4. ``A = r - mean_g r`` (per question); ``A_hat = A / (std(A) + 1e-6)`` with ONE sample std
   (ddof 1) over all G*B entries; ``A_hat`` is detached. With ``norm_groups`` (e.g. the question
   type of each row) the std is taken per group instead: over the G * n_c entries of the rows of
   group c, and each row is divided by its own group's std (+1e-6).
5. ``logp = -sum_{j valid} (z_j - logits_j)^2 / (2 sigma^2)``; ``L_pg = -mean_{g,b} A_hat logp``.
6. ``CE = -mean_b sum_{j valid} t_j log softmax(logits_b)_j``.
7. ``loss = L_pg + ce_weight * CE``; on valid candidates
   ``d loss / d logits = -(1/(G B)) sum_g A_hat eps / sigma^2 + ce_weight (softmax - t) / B``.

The defaults (G = 4, w_log 1.0, w_sph 0.75, w_rps 1.0, one batch std) are the pinned recipe and compute
exactly the same numbers as before these settings existed.

Validation is deferred to a single device->host transfer per call (the failure flags travel with
the logged stats), so the objective costs one synchronisation per micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "G",
    "LOG_FLOOR",
    "SPHERICAL_WEIGHT",
    "RPS_WEIGHT",
    "ADVANTAGE_EPS",
    "TARGET_SUM_TOL",
    "rlcd_loss",
    "ce_loss",
    "gradient_diagnostics",
    "reward_samples",
    "row_terms",
]

G = 4  # Gaussian perturbations (samples) per question
LOG_FLOOR = -9.21  # floor of the log score (~ log 1e-4)
Q_FLOOR = 1e-12  # probability floor inside the log (never binding: log(1e-12) < LOG_FLOOR)
NORM_FLOOR = 1e-9  # floor of ||q||_2 in the spherical score
SPHERICAL_WEIGHT = 0.75
RPS_WEIGHT = 1.0
ADVANTAGE_EPS = 1e-6  # added to the global advantage std
TARGET_SUM_TOL = 1e-3  # |sum of a target row over valid candidates - 1| allowed

# Order of the deferred validation flags (see _validation_flags / _raise_on_flags).
_CHECKS = ("rows", "logits", "target_finite", "target_negative", "target_padding", "target_sum",
           "noise")


# --------------------------------------------------------------------------------------------
# validation


def _check_shapes(fn: str, logits, mask, target, ordinal=None, noise=None, g: int = G,
                  norm_groups=None) -> None:
    """Cheap (no device sync) structural checks; raise ValueError naming the argument."""
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise ValueError(f"{fn}: logits must be a floating-point torch.Tensor [B, K]")
    if logits.dim() != 2 or logits.shape[0] < 1 or logits.shape[1] < 1:
        raise ValueError(f"{fn}: logits must have shape [B, K] with B, K >= 1, got "
                         f"{tuple(logits.shape)}")
    shape = tuple(logits.shape)
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise ValueError(f"{fn}: mask must be a bool torch.Tensor [B, K] (True = valid candidate)")
    if tuple(mask.shape) != shape:
        raise ValueError(f"{fn}: mask shape {tuple(mask.shape)} must equal logits shape {shape}")
    if not isinstance(target, Tensor) or not target.is_floating_point():
        raise ValueError(f"{fn}: target must be a floating-point torch.Tensor [B, K]")
    if tuple(target.shape) != shape:
        raise ValueError(f"{fn}: target shape {tuple(target.shape)} must equal logits shape "
                         f"{shape}")
    if ordinal is not None:
        if not isinstance(ordinal, Tensor) or ordinal.dtype != torch.bool:
            raise ValueError(f"{fn}: ordinal must be a bool torch.Tensor [B]")
        if tuple(ordinal.shape) != shape[:1]:
            raise ValueError(f"{fn}: ordinal shape {tuple(ordinal.shape)} must be [B] = "
                             f"{shape[:1]}")
    if noise is not None:
        if not isinstance(noise, Tensor) or not noise.is_floating_point():
            raise ValueError(f"{fn}: noise must be a floating-point torch.Tensor [G, B, K]")
        if tuple(noise.shape) != (g, *shape):
            raise ValueError(f"{fn}: noise shape {tuple(noise.shape)} must be [G, B, K] = "
                             f"{(g, *shape)} (G = n_perturbations = {g})")
    if norm_groups is not None:
        if not isinstance(norm_groups, Tensor) or norm_groups.is_floating_point() or norm_groups.is_complex():
            raise ValueError(f"{fn}: norm_groups must be an integer torch.Tensor [B] (one group id per row)")
        if tuple(norm_groups.shape) != shape[:1]:
            raise ValueError(f"{fn}: norm_groups shape {tuple(norm_groups.shape)} must be [B] = {shape[:1]}")


def _check_scalar(fn: str, name: str, value, *, positive: bool) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{fn}: {name} must be a real number, got {value!r}") from None
    if not math.isfinite(v) or (v <= 0 if positive else v < 0):
        rule = "> 0" if positive else ">= 0"
        raise ValueError(f"{fn}: {name} must be finite and {rule}, got {value!r}")
    return v


def _check_settings(fn: str, n_perturbations, w_spherical, w_rps, w_log=1.0) -> tuple[int, float, float, float]:
    """The reward/sample settings of the RLCD arms, validated (G >= 2: a baseline needs two samples)."""
    if isinstance(n_perturbations, bool) or not isinstance(n_perturbations, int) or n_perturbations < 2:
        raise ValueError(f"{fn}: n_perturbations must be an integer >= 2, got {n_perturbations!r}")
    return (n_perturbations, _check_scalar(fn, "w_spherical", w_spherical, positive=False),
            _check_scalar(fn, "w_rps", w_rps, positive=False), _check_scalar(fn, "w_log", w_log, positive=False))


def _validation_flags(lf: Tensor, m: Tensor, target: Tensor, noise: Tensor | None) -> Tensor:
    """One float32 tensor of 0/1 failure flags in _CHECKS order (read together with the stats)."""
    pad = ~m
    t_valid = target.masked_fill(pad, 0.0)
    no_flag = torch.zeros((), dtype=torch.bool, device=lf.device)
    flags = [
        ~(m.any(-1).all()),
        (~torch.isfinite(lf) & m).any(),
        (~torch.isfinite(target)).any(),
        (target < 0).any(),
        ((target != 0) & pad).any(),
        ((t_valid.sum(-1) - 1.0).abs() > TARGET_SUM_TOL).any(),
        (~torch.isfinite(noise) & m).any() if noise is not None else no_flag,
    ]
    return torch.stack(flags).to(torch.float32)


def _first(bad: Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in bad.nonzero()[0].tolist())


def _raise_on_flags(fn: str, flags: list[float], lf: Tensor, m: Tensor, target: Tensor,
                    noise: Tensor | None) -> None:
    """Raise a ValueError for the first failed check (slow path, only on bad input)."""
    failed = [name for name, f in zip(_CHECKS, flags) if f]
    if not failed:
        return
    name = failed[0]
    if name == "rows":
        row = _first(~m.any(-1))[0]
        raise ValueError(f"{fn}: mask must mark at least one valid candidate per row; row {row} "
                         f"has none")
    if name == "logits":
        b, j = _first(~torch.isfinite(lf) & m)
        raise ValueError(f"{fn}: logits must be finite on valid candidates (mask True); row {b} "
                         f"candidate {j} is {lf[b, j].item()}")
    if name == "target_finite":
        b, j = _first(~torch.isfinite(target))
        raise ValueError(f"{fn}: target must be finite; row {b} candidate {j} is "
                         f"{target[b, j].item()}")
    if name == "target_negative":
        b, j = _first(target < 0)
        raise ValueError(f"{fn}: target must be >= 0; row {b} candidate {j} is "
                         f"{target[b, j].item()}")
    if name == "target_padding":
        b, j = _first((target != 0) & ~m)
        raise ValueError(f"{fn}: target must be 0 on padded candidates (mask False); row {b} "
                         f"candidate {j} is {target[b, j].item()}")
    if name == "target_sum":
        sums = target.masked_fill(~m, 0.0).sum(-1)
        b = _first((sums - 1.0).abs() > TARGET_SUM_TOL)[0]
        raise ValueError(f"{fn}: target rows must sum to 1 over valid candidates (tolerance "
                         f"{TARGET_SUM_TOL}); row {b} sums to {sums[b].item()}")
    assert noise is not None
    g, b, j = _first(~torch.isfinite(noise) & m)
    raise ValueError(f"{fn}: noise must be finite on valid candidates; sample {g} row {b} "
                     f"candidate {j} is {noise[g, b, j].item()}")


def _prepare(logits: Tensor, mask: Tensor, target: Tensor):
    """float32 logits with padding replaced by 0, float32 target, mask on the logits' device."""
    dev = logits.device
    m = mask.to(dev)
    lf = logits.float()
    t = target.to(device=dev, dtype=torch.float32)
    return lf, lf.masked_fill(~m, 0.0), m, t


def _soft_ce_rows(lf_safe: Tensor, m: Tensor, t: Tensor) -> Tensor:
    """[B] per-row soft CE ``-sum_{j valid} t_j log softmax(logits_b)_j`` (padding contributes exactly 0)."""
    logsm = torch.log_softmax(lf_safe.masked_fill(~m, float("-inf")), dim=-1)
    return -(t * logsm.masked_fill(~m, 0.0)).sum(-1)


def _soft_ce(lf_safe: Tensor, m: Tensor, t: Tensor) -> Tensor:
    """-mean_b sum_{j valid} t_j log softmax(logits_b)_j: the mean of ``_soft_ce_rows`` (negating before the
    mean is bit-identical to negating after it, value and gradient alike)."""
    return _soft_ce_rows(lf_safe, m, t).mean()


# --------------------------------------------------------------------------------------------
# the RLCD terms


@dataclass
class _Terms:
    """Intermediates of one RLCD evaluation (exposed for tests and debugging)."""

    eps: Tensor  # [G, B, K] centred perturbation, zero on padding
    z: Tensor  # [G, B, K] sampled logits (detached; float64 like everything down to a_hat)
    q: Tensor  # [G, B, K] sampled distributions (0 on padding)
    log_score: Tensor  # [G, B]
    spherical: Tensor  # [G, B]
    rps: Tensor  # [G, B] (computed for every row; only ordinal rows enter the reward)
    reward: Tensor  # [G, B]
    advantage: Tensor  # [G, B] A (before normalisation)
    a_hat: Tensor  # [G, B] normalised advantage (detached, float32)
    advantage_std: Tensor  # scalar: std of A over all G*B entries (the normaliser unless per group)
    policy_loss: Tensor  # scalar, carries the gradient
    ce: Tensor  # scalar, carries the gradient
    flags: Tensor  # [len(_CHECKS)] deferred validation flags
    lf: Tensor  # [B, K] float32 logits as given
    mask: Tensor
    target: Tensor  # float32
    ordinal: Tensor  # float32 [B]
    noise: Tensor  # float32 [G, B, K]


def _group_mean(reward: Tensor) -> Tensor:
    """mean_g reward [G, B] -> [B], exactly r when all G rewards of a question equal r.

    For G a power of two a pairwise tree of adjacent sums times 1/G (G = 4 is
    ``((r0 + r1) + (r2 + r3)) * 0.25``, the pinned recipe's expression); otherwise
    ``r_0 + sum_g (r_g - r_0) / G``.
    """
    g = reward.shape[0]
    if g & (g - 1) == 0:
        r = reward
        while r.shape[0] > 1:
            r = r[0::2] + r[1::2]
        return r[0] * (1.0 / g)
    return reward[0] + (reward - reward[0]).sum(0) / g


def _group_std(advantage: Tensor, norm_groups: Tensor) -> Tensor:
    """[B] sample std (ddof 1) of A over the G * n_c entries of each row's group c (no host sync).

    Groups are compared pairwise ([B, B], B is a micro-batch), so any integer ids work.
    """
    g = advantage.shape[0]
    ids = norm_groups.to(advantage.device)
    same = (ids[:, None] == ids[None, :]).to(advantage.dtype)  # [B, B]
    n = same.sum(-1) * g  # entries in each row's group
    mean = (same @ advantage.sum(0)) / n
    sq = (same @ (advantage - mean).square().sum(0))
    return (sq / (n - 1.0)).sqrt()


def _rlcd_terms(fn: str, logits: Tensor, mask: Tensor, target: Tensor, ordinal: Tensor, *,
                sigma: float, noise: Tensor | None, generator: torch.Generator | None,
                n_perturbations: int = G, w_spherical: float = SPHERICAL_WEIGHT,
                w_rps: float = RPS_WEIGHT, norm_groups: Tensor | None = None, w_log: float = 1.0) -> _Terms:
    g_samples, w_spherical, w_rps, w_log = _check_settings(fn, n_perturbations, w_spherical, w_rps, w_log)
    _check_shapes(fn, logits, mask, target, ordinal, noise, g=g_samples, norm_groups=norm_groups)
    sigma = _check_scalar(fn, "sigma", sigma, positive=True)
    lf, lf_safe, m, t = _prepare(logits, mask, target)
    dev = lf.device
    pad = ~m
    ordf = ordinal.to(device=dev, dtype=torch.float32)
    if noise is None:
        noise_f = torch.randn((g_samples, *lf.shape), generator=generator, device=dev, dtype=torch.float32)
        flags = _validation_flags(lf, m, t, None)
    else:
        noise_f = noise.to(device=dev, dtype=torch.float32)
        flags = _validation_flags(lf, m, t, noise_f)

    # The detached reward stage (eps for the rewards, z, q, rewards, advantages) runs in float64:
    # A = r - mean_g r cancels catastrophically at small sigma (float32 rewards put ~1e-4 relative
    # error into A_hat at sigma 0.1). It is [G, B, K]-sized, so this is free; MPS has no float64.
    rdt = torch.float32 if dev.type == "mps" else torch.float64
    with torch.no_grad():
        # 1. centred perturbation; masked_fill (not multiply) so junk noise on padding cannot leak.
        k = m.sum(-1, keepdim=True).to(rdt)  # [B, 1]
        e = (noise_f.to(rdt) * sigma).masked_fill(pad, 0.0)
        eps_r = (e - e.sum(-1, keepdim=True) / k).masked_fill(pad, 0.0)
        # 2. sampled logits (detached) and their distributions over the valid candidates.
        z = lf_safe.detach().to(rdt) + eps_r
        logq = torch.log_softmax(z.masked_fill(pad, float("-inf")), dim=-1)
        q = logq.exp()  # exactly 0 on padding
        # 3. rewards. max(log max(q, 1e-12), -9.21) == max(log q, -9.21) since log 1e-12 < -9.21.
        tr = t.to(rdt)
        log_score = (tr * logq.clamp_min(LOG_FLOOR)).sum(-1)
        spherical = (tr * q).sum(-1) / q.norm(dim=-1).clamp_min(NORM_FLOOR)
        cdiff = q.cumsum(-1) - tr.cumsum(-1)
        rps = (cdiff.square().masked_fill(pad, 0.0).sum(-1)
               / (k.squeeze(-1).clamp_min(2.0) - 1.0))
        reward = w_log * log_score + w_spherical * spherical - w_rps * rps * ordf.to(rdt)
        # 4. group-mean baseline, exact for G identical rewards (A = 0); one std, or one per group.
        advantage = reward - _group_mean(reward)
        adv_std = advantage.std(correction=1)
        scale = adv_std if norm_groups is None else _group_std(advantage, norm_groups)
        a_hat = (advantage / (scale + ADVANTAGE_EPS)).to(torch.float32)
        eps = eps_r.to(torch.float32)

    # 5. REINFORCE on the Gaussian log-density. z - logits is written as eps - (lf - lf.detach()):
    # the same function (value eps, d/dlogits = -1) without the rounding of (logits + eps) - logits.
    diff = eps - (lf_safe - lf_safe.detach())
    logp = -diff.square().sum(-1) / (2.0 * sigma * sigma)  # [G, B]
    policy_loss = -(a_hat * logp).mean()
    # 6. soft cross-entropy on the unperturbed logits.
    ce = _soft_ce(lf_safe, m, t)
    return _Terms(eps=eps, z=z, q=q, log_score=log_score, spherical=spherical, rps=rps,
                  reward=reward, advantage=advantage, a_hat=a_hat, advantage_std=adv_std,
                  policy_loss=policy_loss, ce=ce, flags=flags, lf=lf, mask=m, target=t,
                  ordinal=ordf, noise=noise_f)


# --------------------------------------------------------------------------------------------
# public API


_STAT_KEYS = ("loss", "policy_loss", "ce_loss", "reward_mean", "reward_std", "log_score_mean",
              "spherical_mean", "rps_mean", "advantage_std")


def rlcd_loss(logits: Tensor, mask: Tensor, target: Tensor, ordinal: Tensor, *,
              sigma: float = 0.3, ce_weight: float = 1.0, noise: Tensor | None = None,
              generator: torch.Generator | None = None, n_perturbations: int = G,
              w_spherical: float = SPHERICAL_WEIGHT, w_rps: float = RPS_WEIGHT,
              norm_groups: Tensor | None = None, w_log: float = 1.0) -> tuple[Tensor, dict[str, float]]:
    """RLCD loss of one micro-batch: REINFORCE on Gaussian logit perturbations + ``ce_weight`` x CE.

    Args:
        logits: ``[B, K]`` candidate logits, any float dtype (loss and gradient in float32, the
            detached reward/advantage stage in float64); padded entries may hold any value.
        mask: ``[B, K]`` bool, True on valid candidates (at least one per row).
        target: ``[B, K]`` target distribution over the valid candidates, 0 on padding.
        ordinal: ``[B]`` bool, True for score questions (RPS penalty in level order).
        sigma: std of the Gaussian perturbation (> 0).
        ce_weight: weight of the soft cross-entropy (>= 0); 0 gives the RL-only arm.
        noise: optional ``[G, B, K]`` standard-normal draws (G = ``n_perturbations``); values on
            padding are ignored. When None they are drawn with
            ``torch.randn((G, B, K), generator=generator)`` on the logits' device (the generator,
            if given, must live on that device).
        generator: optional ``torch.Generator`` for the draw.
        n_perturbations: G, samples per question (>= 2; 4 in the pinned recipe).
        w_spherical, w_rps: reward weights of the spherical score and the RPS penalty (>= 0).
        w_log: reward weight of the floored log score (>= 0; 1 in the pinned recipe, 0 removes it).
        norm_groups: optional ``[B]`` integer group id per row; the advantage std is then taken
            per group (step 4) instead of once over the micro-batch.

    Returns:
        ``(loss, stats)``: ``loss`` a float32 scalar tensor to backpropagate; ``stats`` a dict of
        Python floats: ``loss``, ``policy_loss``, ``ce_loss``, ``reward_mean``, ``reward_std``
        (ddof 1 over the G*B rewards), ``log_score_mean``, ``spherical_mean``, ``rps_mean``
        (ordinal rows only, 0 if none), ``advantage_std`` (the std of step 4, before + 1e-6).

    Note:
        The logged ``policy_loss`` VALUE IS MOSTLY NOISE: it equals
        ``mean(A_hat * ||eps||^2) / (2 sigma^2)``, a random number that can be negative and says
        nothing about progress. Only its gradient, ``-(1/(G B)) sum_g A_hat eps / sigma^2``,
        matters. Watch ``ce_loss`` and the reward stats instead.

    Raises:
        ValueError: shape/dtype mismatches, ``sigma <= 0``, ``ce_weight < 0``, a row without valid
            candidates, non-finite logits on valid candidates, non-finite / negative targets,
            targets non-zero on padding or not summing to 1, non-finite noise on valid candidates.
    """
    fn = "rlcd_loss"
    ce_weight = _check_scalar(fn, "ce_weight", ce_weight, positive=False)
    terms = _rlcd_terms(fn, logits, mask, target, ordinal, sigma=sigma, noise=noise,
                        generator=generator, n_perturbations=n_perturbations,
                        w_spherical=w_spherical, w_rps=w_rps, norm_groups=norm_groups, w_log=w_log)
    if ce_weight == 0.0:
        loss = terms.policy_loss
    else:
        loss = terms.policy_loss + ce_weight * terms.ce
    with torch.no_grad():
        n_ord = terms.ordinal.sum() * terms.reward.shape[0]
        rdt = terms.reward.dtype
        stats_t = torch.cat([torch.stack([
            loss.detach().to(rdt),
            terms.policy_loss.detach().to(rdt),
            terms.ce.detach().to(rdt),
            terms.reward.mean(),
            terms.reward.std(correction=1),
            terms.log_score.mean(),
            terms.spherical.mean(),
            (terms.rps * terms.ordinal.to(rdt)).sum() / n_ord.to(rdt).clamp_min(1.0),
            terms.advantage_std,
        ]), terms.flags.to(rdt)])
    values = stats_t.tolist()  # the one device -> host transfer of this call
    _raise_on_flags(fn, values[len(_STAT_KEYS):], terms.lf, terms.mask, terms.target,
                    terms.noise if noise is not None else None)
    return loss, dict(zip(_STAT_KEYS, values[: len(_STAT_KEYS)]))


def ce_loss(logits: Tensor, mask: Tensor, target: Tensor) -> tuple[Tensor, dict[str, float]]:
    """Soft cross-entropy, the Sev CE-only arm: ``-mean_b sum_{j valid} t_j log softmax(z_b)_j``.

    Same inputs, masking and validation as :func:`rlcd_loss` (no ordinal, no noise). Returns
    ``(loss, stats)`` with ``stats = {"loss": ..., "ce_loss": ...}`` (Python floats, equal).
    """
    fn = "ce_loss"
    _check_shapes(fn, logits, mask, target)
    lf, lf_safe, m, t = _prepare(logits, mask, target)
    flags = _validation_flags(lf, m, t, None)
    loss = _soft_ce(lf_safe, m, t)
    values = torch.cat([loss.detach().reshape(1), flags]).tolist()
    _raise_on_flags(fn, values[1:], lf, m, t, None)
    return loss, {"loss": values[0], "ce_loss": values[0]}


def gradient_diagnostics(logits: Tensor, mask: Tensor, target: Tensor, ordinal: Tensor, *,
                         sigma: float, noise: Tensor | None, n_perturbations: int = G,
                         w_spherical: float = SPHERICAL_WEIGHT, w_rps: float = RPS_WEIGHT,
                         norm_groups: Tensor | None = None, w_log: float = 1.0) -> dict:
    """Gradients of the policy term and of CE with respect to the logits, and how they compare.

    Uses the same formula, settings (``n_perturbations``, ``w_log``, ``w_spherical``, ``w_rps``,
    ``norm_groups``) and ``noise`` (``[G, B, K]``; None draws from torch's global RNG) as
    :func:`rlcd_loss`. Works on a detached copy of ``logits``: the caller's graph and
    ``.grad`` fields are untouched.

    Returns a dict with Python floats ``pg_grad_norm`` (||g_pg||), ``ce_grad_norm`` (||g_ce||),
    ``grad_norm_ratio`` (||g_pg|| / ||g_ce||; ``inf`` if only g_ce is zero, 0 if both are) and
    ``grad_cosine`` (0 if either gradient is zero), plus the float32 tensors ``pg_grad`` and
    ``ce_grad`` ([B, K], zero on padding). g_ce is the gradient of CE itself (not scaled by any
    ce_weight).
    """
    fn = "gradient_diagnostics"
    _check_shapes(fn, logits, mask, target, ordinal)  # before the float() copy below
    x = logits.detach().float().clone().requires_grad_(True)
    terms = _rlcd_terms(fn, x, mask, target, ordinal, sigma=sigma, noise=noise, generator=None,
                        n_perturbations=n_perturbations, w_spherical=w_spherical, w_rps=w_rps,
                        norm_groups=norm_groups, w_log=w_log)
    (g_pg,) = torch.autograd.grad(terms.policy_loss, x, retain_graph=True)
    (g_ce,) = torch.autograd.grad(terms.ce, x)
    stats_t = torch.cat([torch.stack([g_pg.norm(), g_ce.norm(), (g_pg * g_ce).sum()]),
                         terms.flags])
    values = stats_t.tolist()
    _raise_on_flags(fn, values[3:], terms.lf, terms.mask, terms.target,
                    terms.noise if noise is not None else None)
    n_pg, n_ce, dot = values[:3]
    if n_ce > 0:
        ratio = n_pg / n_ce
    else:
        ratio = math.inf if n_pg > 0 else 0.0
    cosine = dot / (n_pg * n_ce) if n_pg > 0 and n_ce > 0 else 0.0
    return {
        "pg_grad_norm": n_pg,
        "ce_grad_norm": n_ce,
        "grad_norm_ratio": ratio,
        "grad_cosine": max(-1.0, min(1.0, cosine)),
        "pg_grad": g_pg.detach(),
        "ce_grad": g_ce.detach(),
    }


def reward_samples(logits: Tensor, mask: Tensor, target: Tensor, ordinal: Tensor, *, sigma: float,
                   noise: Tensor, n_perturbations: int = G, w_spherical: float = SPHERICAL_WEIGHT,
                   w_rps: float = RPS_WEIGHT, norm_groups: Tensor | None = None,
                   w_log: float = 1.0) -> dict[str, Tensor]:
    """Per-sample reward parts and advantages of one micro-batch, left on the device.

    The same formula, settings and ``noise`` as :func:`rlcd_loss` (pass the noise that call used to
    see what its update saw). Nothing is read back to the host, so a caller can sum these over an
    update and read the sums once; the values are not re-validated (``rlcd_loss`` did that).
    Returns ``[G, B]`` tensors: ``log`` (LS, unweighted), ``spherical`` (SPH), ``rps`` (RPS of every row; only
    ordinal rows enter the reward), ``reward``, ``advantage`` (A) and ``a_hat`` (A normalised).
    """
    with torch.no_grad():
        terms = _rlcd_terms("reward_samples", logits.detach(), mask, target, ordinal, sigma=sigma,
                            noise=noise, generator=None, n_perturbations=n_perturbations,
                            w_spherical=w_spherical, w_rps=w_rps, norm_groups=norm_groups, w_log=w_log)
    return {"log": terms.log_score, "spherical": terms.spherical, "rps": terms.rps,
            "reward": terms.reward, "advantage": terms.advantage, "a_hat": terms.a_hat}


def row_terms(logits: Tensor, mask: Tensor, target: Tensor, ordinal: Tensor | None = None, *,
              objective: str = "rlcd", full: bool = True, ce_weight: float = 1.0, sigma: float | None = None,
              noise: Tensor | None = None, n_perturbations: int = G, w_spherical: float = SPHERICAL_WEIGHT,
              w_rps: float = RPS_WEIGHT, norm_groups: Tensor | None = None,
              w_log: float = 1.0) -> dict[str, Tensor]:
    """The micro-batch objective split by row, left on the device: what each row adds to the loss and the
    gradient the loss sends into its logits.

    ``objective`` "rlcd" recomputes :func:`rlcd_loss` (same formula, settings, ``ce_weight`` and ``noise``;
    pass the noise that call used); "ce" recomputes :func:`ce_loss` (``ordinal``, ``sigma`` and the RLCD
    settings unused). Works on a detached float32 copy of ``logits`` like :func:`gradient_diagnostics`:
    the caller's graph and ``.grad`` fields are untouched, nothing is read back to the host and nothing is
    re-validated (the loss call did that). Returns:

    - ``ce`` ``[B]``: ``-sum_{j valid} t_j log softmax(logits_b)_j``; the loss's CE is its mean over b;
    - ``policy`` ``[B]`` (rlcd only): ``-(1/G) sum_g A_hat_gb logp_gb``, with the A_hat of the whole
      micro-batch (its std, or its group's); the loss's policy term is its mean over b;
    - ``reward`` ``[G, B]`` (rlcd only): the total reward r of each sample (float64 off MPS);
    - ``grad`` ``[B, K]`` float32, zero on padding: ``d loss / d logits`` of this micro-batch's loss
      (``L_pg + ce_weight CE``, or ``L_pg`` alone at ce_weight 0, as rlcd_loss builds it; CE for "ce"),
      by autograd through the objective's own code rather than a second derivation of formula 7.

    ``full=False`` returns ``ce`` alone: no reward stage, no backward, a log-softmax over ``[B, K]``, cheap
    enough for every update (the full split re-runs the reward stage of an rlcd_loss call and backpropagates it).
    """
    fn = "row_terms"
    if objective not in ("rlcd", "ce"):
        raise ValueError(f"{fn}: objective must be 'rlcd' or 'ce', got {objective!r}")
    _check_shapes(fn, logits, mask, target, ordinal if objective == "rlcd" else None)
    if not full:
        with torch.no_grad():
            _, lf_safe, m, t = _prepare(logits.detach(), mask, target)
            return {"ce": _soft_ce_rows(lf_safe, m, t)}
    with torch.enable_grad():
        x = logits.detach().float().clone().requires_grad_(True)
        _, x_safe, m, t = _prepare(x, mask, target)
        ce_rows = _soft_ce_rows(x_safe, m, t)
        if objective == "ce":
            (grad,) = torch.autograd.grad(ce_rows.mean(), x)
            return {"ce": ce_rows.detach(), "grad": grad}
        if sigma is None:
            raise ValueError(f"{fn}: objective 'rlcd' needs sigma")
        ce_weight = _check_scalar(fn, "ce_weight", ce_weight, positive=False)
        terms = _rlcd_terms(fn, x, mask, target, ordinal, sigma=sigma, noise=noise, generator=None,
                            n_perturbations=n_perturbations, w_spherical=w_spherical, w_rps=w_rps,
                            norm_groups=norm_groups, w_log=w_log)
        loss = terms.policy_loss if ce_weight == 0.0 else terms.policy_loss + ce_weight * terms.ce
        (grad,) = torch.autograd.grad(loss, x)
    # -A_hat logp with logp = -||z - logits||^2 / (2 sigma^2) and z - logits = eps in value (step 5)
    policy_rows = (terms.a_hat * terms.eps.square().sum(-1)).mean(0) / (2.0 * float(sigma) ** 2)
    return {"ce": ce_rows.detach(), "policy": policy_rows, "reward": terms.reward, "grad": grad}
