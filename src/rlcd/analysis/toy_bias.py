"""Toy bias of the noise-smoothed proper score: no model, just logits.

The RL term of the RLCD objective is an evolution-strategies estimate of the gradient of the
*smoothed* reward ``J(z) = E_eps[ r(softmax(z + eps)) ]`` with ``eps ~ N(0, sigma^2 I)``. For
sigma -> 0 this is the proper score itself and its maximiser is the target ``t``; for sigma > 0 the
maximiser ``z*`` is not ``log t``: the noise-free prediction ``softmax(z*)`` comes out sharper than
``t`` (with the log score the optimality condition is ``E_eps[softmax(z* + eps)] = t``, and averaging
over noise flattens a distribution, so ``softmax(z*)`` itself has to be sharper).

This module maximises ``J`` over ``z`` directly and reports the noise-free maximum probability of
``softmax(z*)`` and ``KL(t || softmax(z*))``.

Numerics (all fixed so that results are reproducible bit for bit on CPU):

* The expectation is a sample average over a *fixed* set of ``samples`` noise vectors (common
  random numbers), drawn once per (target size K, seed) as a scrambled Sobol sequence mapped
  through the inverse normal CDF (quasi-Monte Carlo: the estimate of the optimum is stable to
  ~1e-4 from 1,024 samples on). The same standard-normal draws are reused for every sigma
  (``eps = sigma * e``), so curves over sigma are smooth.
* Like the RLCD objective, the noise is centred over the candidates (``eps - mean(eps)``). This
  does **not** change anything: softmax is invariant to adding a constant to all logits. It is done
  only so that the noise here is literally the noise of ``rlcd_loss``.
* The sample-average objective is maximised in float64 with L-BFGS (strong-Wolfe line search),
  starting from ``z = log t`` (the sigma = 0 optimum). With the log score the objective is concave
  in ``z`` (up to the floor), so this is the global optimum; with the full reward (spherical and RPS
  terms are not concave) it is the optimum reached from ``log t``.
* sigma = 0 is evaluated without noise (one zero noise vector).
* At large sigma and many candidates (e.g. peaked K = 77 at sigma 4) the -9.21 floor makes the
  objective flat in the logits of the small candidates; ``max_prob`` is then ~1 and ``kl`` depends
  a little (~1e-2 relative) on where L-BFGS stops (``max_iter`` = 100). Elsewhere both are stable
  to ~1e-4.

Rewards (the RLCD reward of issue 4, per sampled distribution ``q``):

* ``"log"``: ``LS = sum_j t_j * max(log(max(q_j, 1e-12)), -9.21)`` — the floored log score exactly
  as in the RLCD reward (the floor only matters for tiny probabilities at large sigma);
* ``"full"``: ``LS + 0.75 * SPH - RPS * ordinal`` with ``SPH = sum_j t_j q_j / max(||q||_2, 1e-9)``
  and ``RPS = sum_j (Q_j - T_j)^2 / (max(K, 2) - 1)`` over the cumulative sums in level order. The
  default targets are non-ordinal (no RPS term) except where a target spec says ``ordinal: true``.

Default targets (``default_targets()``), all deterministic:

* ``reference``: ``t = (0.7, 0.2, 0.1)`` — the reference target (with the log score the noise-free
  max probability is about 0.700 / 0.723 / 0.780 / 0.905 at sigma 0 / 0.5 / 1 / 2);
* ``peaked-K`` for K in {2, 5, 20, 77}: ``t_0 = 0.7``, the remaining 0.3 split equally over the other
  K - 1 candidates;
* ``near-uniform-K`` for K in {2, 5, 20, 77}: ``t_j ∝ 1 + 0.1 * (1 - 2 j / (K - 1))``, a linear tilt
  from 1.1 down to 0.9 times uniform (so K = 2 gives (0.55, 0.45)). An exactly uniform target would
  be a fixed point (z = 0 is optimal at every sigma); the small tilt shows the sharpening.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

LOG_FLOOR = -9.21
PROB_FLOOR = 1e-12
SPHERICAL_WEIGHT = 0.75
REWARDS = ("log", "full")
DEFAULT_SIGMAS: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
DEFAULT_SAMPLES = 4096
SWEEP_KS: tuple[int, ...] = (2, 5, 20, 77)
REFERENCE_TARGET: tuple[float, ...] = (0.7, 0.2, 0.1)


# --------------------------------------------------------------------------------------------
# targets


def peaked_target(k: int, top: float = 0.7) -> list[float]:
    """``t_0 = top``, the rest ``(1 - top)`` split equally over the other ``k - 1`` candidates."""
    if k < 2:
        raise ValueError(f"peaked target needs k >= 2, got {k}")
    rest = (1.0 - top) / (k - 1)
    return [top] + [rest] * (k - 1)


def near_uniform_target(k: int, tilt: float = 0.1) -> list[float]:
    """``t_j ∝ 1 + tilt * (1 - 2 j / (k - 1))``: uniform with a linear tilt of +-``tilt``."""
    if k < 2:
        raise ValueError(f"near-uniform target needs k >= 2, got {k}")
    w = [1.0 + tilt * (1.0 - 2.0 * j / (k - 1)) for j in range(k)]
    s = math.fsum(w)
    return [x / s for x in w]


def default_targets() -> list[dict[str, Any]]:
    """The reference target plus the K sweep {2, 5, 20, 77} x {peaked, near-uniform}."""
    out: list[dict[str, Any]] = [
        {"name": "reference", "target": list(REFERENCE_TARGET), "ordinal": False}
    ]
    for k in SWEEP_KS:
        out.append({"name": f"peaked-{k}", "target": peaked_target(k), "ordinal": False})
    for k in SWEEP_KS:
        out.append({"name": f"near-uniform-{k}", "target": near_uniform_target(k), "ordinal": False})
    return out


def _normalise_target_specs(targets: Iterable[Any] | None) -> list[dict[str, Any]]:
    if targets is None:
        return default_targets()
    specs = []
    for i, spec in enumerate(targets):
        if isinstance(spec, dict):
            if "target" not in spec:
                raise ValueError(f"target spec {i} has no 'target' key")
            vec, name, ordinal = spec["target"], spec.get("name"), bool(spec.get("ordinal", False))
        else:
            vec, name, ordinal = spec, None, False
        vec = [float(x) for x in vec]
        if len(vec) < 2:
            raise ValueError(f"target {i} must have at least 2 entries, got {len(vec)}")
        if any(not math.isfinite(x) or x < 0 for x in vec):
            raise ValueError(f"target {i} entries must be finite and non-negative: {vec}")
        total = math.fsum(vec)
        if abs(total - 1.0) > 1e-4:
            raise ValueError(f"target {i} sums to {total}, not 1 (+-1e-4)")
        vec = [x / total for x in vec]
        specs.append({"name": name or f"target-{i}", "target": vec, "ordinal": ordinal})
    return specs


# --------------------------------------------------------------------------------------------
# rewards and the smoothed objective


def standard_normal_qmc(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """``[n, k]`` float64 standard-normal draws from a scrambled Sobol sequence (fixed by seed)."""
    engine = torch.quasirandom.SobolEngine(k, scramble=True, seed=seed)
    u = engine.draw(n, dtype=torch.float64).clamp(1e-12, 1.0 - 1e-12)
    return math.sqrt(2.0) * torch.special.erfinv(2.0 * u - 1.0)


def reward(q: torch.Tensor, t: torch.Tensor, kind: str, ordinal: bool = False) -> torch.Tensor:
    """RLCD reward of distributions ``q [..., K]`` against target ``t [K]`` (one value per row)."""
    log_q = torch.log(q.clamp_min(PROB_FLOOR)).clamp_min(LOG_FLOOR)
    out = (t * log_q).sum(-1)
    if kind == "log":
        return out
    if kind != "full":
        raise ValueError(f"reward must be one of {REWARDS}, got {kind!r}")
    sph = (t * q).sum(-1) / torch.linalg.vector_norm(q, dim=-1).clamp_min(1e-9)
    out = out + SPHERICAL_WEIGHT * sph
    if ordinal:
        k = q.shape[-1]
        rps = ((q.cumsum(-1) - t.cumsum(-1)) ** 2).sum(-1) / (max(k, 2) - 1)
        out = out - rps
    return out


def kl_divergence(t: Sequence[float] | np.ndarray, p: Sequence[float] | np.ndarray) -> float:
    """``KL(t || p) = sum_{t_j > 0} t_j log(t_j / p_j)`` in nats (float64)."""
    t = np.asarray(t, dtype=np.float64)
    p = np.asarray(p, dtype=np.float64)
    m = t > 0
    kl = float(np.sum(t[m] * (np.log(t[m]) - np.log(np.maximum(p[m], 1e-300)))))
    return max(kl, 0.0)  # KL >= 0; clip float round-off (~1e-16) at the sigma = 0 optimum


def optimise_logits(
    target: Sequence[float],
    sigma: float,
    kind: str = "log",
    *,
    ordinal: bool = False,
    noise: torch.Tensor | None = None,
    samples: int = DEFAULT_SAMPLES,
    seed: int = 0,
    max_iter: int = 100,
) -> tuple[np.ndarray, float]:
    """Maximise the sample-average smoothed reward over logits; returns ``(z*, objective)``.

    ``noise``: optional ``[n, K]`` standard-normal draws (common random numbers); when None they are
    drawn with :func:`standard_normal_qmc`. They are scaled by ``sigma`` and centred over the
    candidates (a no-op for softmax, kept for fidelity with ``rlcd_loss``).
    """
    if sigma < 0 or not math.isfinite(sigma):
        raise ValueError(f"sigma must be finite and >= 0, got {sigma}")
    t = torch.tensor([float(x) for x in target], dtype=torch.float64)
    k = t.numel()
    if sigma == 0:
        eps = torch.zeros(1, k, dtype=torch.float64)
    else:
        e = noise if noise is not None else standard_normal_qmc(samples, k, seed)
        e = e.to(torch.float64)
        if e.shape[-1] != k:
            raise ValueError(f"noise has {e.shape[-1]} columns but the target has {k} entries")
        eps = sigma * e
        eps = eps - eps.mean(-1, keepdim=True)
    z = torch.log(t.clamp_min(1e-12)).clone().requires_grad_(True)
    opt = torch.optim.LBFGS(
        [z], lr=1.0, max_iter=max_iter, history_size=20, tolerance_grad=1e-10,
        tolerance_change=1e-12, line_search_fn="strong_wolfe",
    )

    def closure():
        opt.zero_grad()
        q = torch.softmax(z + eps, dim=-1)
        loss = -reward(q, t, kind, ordinal).mean()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        zs = z.detach()
        obj = float(reward(torch.softmax(zs + eps, -1), t, kind, ordinal).mean())
    zs = zs - zs.mean()
    return zs.numpy().copy(), obj


def run_toy_bias(
    sigmas: Sequence[float] = DEFAULT_SIGMAS,
    targets: Iterable[Any] | None = None,
    rewards: Sequence[str] = REWARDS,
    samples: int = DEFAULT_SAMPLES,
    seed: int = 0,
) -> dict[str, Any]:
    """Smoothed-score optimum for every (target, reward, sigma).

    ``targets``: None for :func:`default_targets`, or a list whose items are probability vectors or
    dicts ``{"target": [...], "name"?: str, "ordinal"?: bool}``.

    Returns ``{"rows": [{"target", "reward", "sigma", "max_prob", "kl", "name", "k", "ordinal",
    "objective"}, ...], "config": {...}}`` where ``max_prob`` and ``kl`` are for the noise-free
    ``softmax(z*)``, ``objective`` is the maximised sample-average smoothed reward.
    """
    for r in rewards:
        if r not in REWARDS:
            raise ValueError(f"reward must be one of {REWARDS}, got {r!r}")
    sigmas = [float(s) for s in sigmas]
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    specs = _normalise_target_specs(targets)
    # The tensors are small ([samples, K]); intra-op threading only adds overhead (2x slower on 2
    # cores), so run single-threaded and restore the caller's setting afterwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(specs, sigmas, rewards, samples, seed)
    finally:
        torch.set_num_threads(threads)


def _run(specs: list[dict[str, Any]], sigmas: list[float], rewards: Sequence[str], samples: int,
         seed: int) -> dict[str, Any]:
    start = time.perf_counter()
    noise_cache: dict[int, torch.Tensor] = {}
    rows = []
    for spec in specs:
        k = len(spec["target"])
        if k not in noise_cache:
            noise_cache[k] = standard_normal_qmc(samples, k, seed)
        for kind in rewards:
            for sigma in sigmas:
                z, obj = optimise_logits(
                    spec["target"], sigma, kind, ordinal=spec["ordinal"], noise=noise_cache[k]
                )
                p = np.exp(z - z.max())
                p /= p.sum()
                rows.append({
                    "name": spec["name"], "k": k, "ordinal": spec["ordinal"],
                    "target": [float(x) for x in spec["target"]], "reward": kind, "sigma": sigma,
                    "max_prob": float(p.max()), "kl": kl_divergence(spec["target"], p),
                    "objective": obj,
                })
    return {
        "rows": rows,
        "config": {
            "sigmas": sigmas, "rewards": list(rewards), "samples": samples, "seed": seed,
            "noise": "scrambled Sobol -> inverse normal CDF, fixed per (K, seed), centred",
            "optimiser": "L-BFGS float64 from log t", "log_floor": LOG_FLOOR,
            "spherical_weight": SPHERICAL_WEIGHT, "seconds": round(time.perf_counter() - start, 3),
        },
    }


# --------------------------------------------------------------------------------------------
# plot


def plot_toy_bias(result: dict[str, Any], path: str | Path) -> Path:
    """Two panels against sigma, one colour per target, solid = log score, dashed = full reward.

    Left: sharpening ``max_prob / max(t)`` of the noise-free ``softmax(z*)`` (1 = no bias). Right:
    ``KL(t || softmax(z*))`` on a log axis (the sigma = 0 points, KL = 0 up to round-off, are left out).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = result["rows"]
    fig = Figure(figsize=(12, 4.8))
    FigureCanvasAgg(fig)
    ax_p, ax_kl = fig.subplots(1, 2)
    series: dict[tuple[str, str], list[dict[str, Any]]] = {}
    names: list[str] = []
    for row in rows:
        name = row.get("name") or str([round(x, 3) for x in row["target"]])
        if name not in names:
            names.append(name)
        series.setdefault((name, row["reward"]), []).append(row)
    colours = {n: f"C{i % 10}" if i < 10 else None for i, n in enumerate(names)}
    for (name, kind), rs in series.items():
        rs = sorted(rs, key=lambda r: r["sigma"])
        style = "-" if kind == "log" else "--"
        kw = {"color": colours[name], "marker": "o", "ms": 3, "label": f"{name} ({kind})"}
        ax_p.plot([r["sigma"] for r in rs], [r["max_prob"] / max(r["target"]) for r in rs], style, **kw)
        pos = [r for r in rs if r["sigma"] > 0 and r["kl"] > 1e-12]
        ax_kl.plot([r["sigma"] for r in pos], [r["kl"] for r in pos], style, **kw)
    ax_p.axhline(1.0, color="0.6", lw=0.8)
    ax_p.set_xlabel("sigma")
    ax_p.set_ylabel("max prob of softmax(z*) / max t")
    ax_p.set_title("noise-free sharpening of the smoothed-score optimum")
    ax_kl.set_xlabel("sigma")
    ax_kl.set_ylabel("KL(t || softmax(z*)) [nats]")
    ax_kl.set_yscale("log")
    ax_kl.set_title("KL of the smoothed-score optimum to the target")
    ax_kl.legend(fontsize=6, ncol=2, loc="lower right")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
