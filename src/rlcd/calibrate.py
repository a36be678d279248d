"""Per-type temperature scaling fitted with LBFGS on the calibration partition.

``fit_temperature`` minimises the mean soft cross-entropy ``-sum_k t_k log softmax(z / T)_k`` over
rows with ``torch.optim.LBFGS`` (100 iterations, lr 0.1, float64), T constrained to
``[t_min, t_max]`` = [0.1, 10].

Parameterisation. The optimiser sees ``u = log T`` (steps are relative changes of T, the natural
scale of a temperature; T = 0.1 and T = 10 are symmetric about the start T = 1). The bound is a
*projection* with a straight-through gradient: the forward pass uses
``T = exp(clamp(u, log t_min, log t_max))`` while the backward pass treats the clamp as the identity,
so the gradient at (and beyond) a bound is the true gradient of the loss at that bound, never zero.
A smooth squashing map (``t_min + (t_max - t_min) * sigmoid(u)``) would have a vanishing derivative
near the bounds, so an optimum at or close to 0.1 or 10 would be approached ever more slowly.
The loss is convex in 1/T, so: if the optimum lies inside the box LBFGS converges to it; if it lies
outside, u walks past the bound, the (clamped) loss stops changing and LBFGS stops on its
loss-change tolerance; the returned T is projected into the box. ``converged`` reports the KKT
condition at the returned T: a remaining Newton step below 0.1 % of T inside the box, or a gradient
pushing outward at a bound.

``fit_per_type`` fits one temperature per decision type (choice, noul, score) from the rows it is
given and nothing else; a type with fewer than ``min_rows`` (10) rows keeps T = 1 with a reason.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from rlcd.schema import QUESTION_TYPES

T_MIN, T_MAX = 0.1, 10.0
ITERS, LR = 100, 0.1
MIN_ROWS = 10
STEP_TOL = 1e-3  # converged when the remaining Newton step in log T is below 0.1 % of T


def padded(logits: Any, targets: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [N,K], targets [N,K], mask [N,K]) float64; accepts ragged lists or padded arrays.

    Padded arrays mark padding with a non-finite logit (-inf or nan); targets must be 0 there.
    """
    if isinstance(logits, (np.ndarray, torch.Tensor)) and np.ndim(logits) == 2:
        z = torch.as_tensor(np.asarray(logits, dtype=np.float64))
        t = torch.as_tensor(np.asarray(targets, dtype=np.float64))
        if t.shape != z.shape:
            raise ValueError(f"logits {tuple(z.shape)} and targets {tuple(t.shape)} differ in shape")
        mask = torch.isfinite(z)
    else:
        zs = [np.asarray(x, dtype=np.float64).reshape(-1) for x in logits]
        ts = [np.asarray(x, dtype=np.float64).reshape(-1) for x in targets]
        if len(zs) != len(ts):
            raise ValueError(f"{len(zs)} logit rows but {len(ts)} target rows")
        k = max((len(x) for x in zs), default=0)
        z = torch.full((len(zs), k), float("-inf"), dtype=torch.float64)
        t = torch.zeros((len(zs), k), dtype=torch.float64)
        mask = torch.zeros((len(zs), k), dtype=torch.bool)
        for i, (zi, ti) in enumerate(zip(zs, ts)):
            if len(zi) != len(ti):
                raise ValueError(f"row {i}: {len(zi)} logits but {len(ti)} target entries")
            z[i, : len(zi)] = torch.from_numpy(zi)
            t[i, : len(ti)] = torch.from_numpy(ti)
            mask[i, : len(zi)] = True
        mask &= torch.isfinite(z)
    if bool((t[~mask] != 0).any()):
        raise ValueError("targets must be 0 where logits are padding / non-finite")
    if not bool(mask.any(dim=1).all()):
        raise ValueError("every row needs at least one finite logit")
    return z, t, mask


def soft_ce(z: torch.Tensor, t: torch.Tensor, mask: torch.Tensor, temperature: torch.Tensor | float, *,
            per_row: bool = False) -> torch.Tensor:
    """Mean over rows of -sum_k t_k log softmax(z / T)_k (padding excluded); ``per_row`` keeps the [N] row values.

    ``temperature`` may be a ``[J, 1, 1]`` tensor: the result then has a leading J axis (one per T).
    """
    scaled = (z.masked_fill(~mask, 0.0) / temperature).masked_fill(~mask, float("-inf"))  # no inf * 0 in backward
    logp = torch.log_softmax(scaled, dim=-1).masked_fill(~mask, 0.0)
    rows = -(t * logp).sum(dim=-1)
    return rows if per_row else rows.mean(dim=-1)


def fit_temperature(logits: Sequence[np.ndarray] | np.ndarray, targets: Sequence[np.ndarray] | np.ndarray, *,
                    iters: int = ITERS, lr: float = LR, t_min: float = T_MIN, t_max: float = T_MAX,
                    ) -> tuple[float, dict[str, Any]]:
    """Fit one temperature T in [t_min, t_max] minimising mean soft CE of softmax(logits/T) vs targets.

    ``logits``/``targets``: a list of 1-D arrays (K may differ per row) or padded [N, K] arrays
    (padding = -inf logits with 0 targets). Returns ``(T, info)`` with info
    ``{loss_before, loss_after, iterations, n, converged, grad, newton_step, at_bound, temperature}``
    (loss_before at T = 1; grad = d loss / d log T at the returned T; newton_step = |grad| / curvature
    in log T, i.e. the estimated relative distance of T from the optimum; at_bound
    "lower"/"upper"/None; converged = newton_step < 0.1 % inside the box, or the gradient pushing
    outward at a bound).
    """
    if not 0 < t_min < t_max:
        raise ValueError("need 0 < t_min < t_max")
    z, t, mask = padded(logits, targets)
    n = int(z.shape[0])
    if n == 0:
        raise ValueError("fit_temperature needs at least one row")
    lo, hi = math.log(t_min), math.log(t_max)
    u0 = min(max(0.0, lo), hi)  # start at T = 1 (projected if 1 is outside the box)
    u = torch.tensor([u0], dtype=torch.float64, requires_grad=True)

    def temperature_of(param: torch.Tensor) -> torch.Tensor:
        clamped = param.clamp(lo, hi)
        return torch.exp(param + (clamped - param).detach())  # projected value, identity gradient

    with torch.no_grad():
        loss_before = float(soft_ce(z, t, mask, 1.0))
    opt = torch.optim.LBFGS([u], lr=lr, max_iter=iters)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = soft_ce(z, t, mask, temperature_of(u))
        loss.backward()
        return loss

    opt.step(closure)
    state = opt.state[opt._params[0]]
    iterations = int(state.get("n_iter", 0))

    u_final = min(max(float(u.detach()[0]), lo), hi)
    if not math.isfinite(u_final):
        u_final = u0
    ue = torch.tensor([u_final], dtype=torch.float64, requires_grad=True)
    loss = soft_ce(z, t, mask, torch.exp(ue))
    (g,) = torch.autograd.grad(loss, ue, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), ue)
    grad, hess = float(g.detach()[0]), float(h[0])
    loss_after = float(loss.detach())
    temperature = float(math.exp(u_final))
    at_bound = "lower" if u_final <= lo + 1e-12 else "upper" if u_final >= hi - 1e-12 else None
    # remaining Newton step in log T = relative distance of T from the optimum (inf if not convex here)
    newton = abs(grad) / hess if hess > 0 else (0.0 if grad == 0 else math.inf)
    if at_bound == "lower":
        converged = grad >= 0 or newton <= STEP_TOL  # the loss would only go down below t_min
    elif at_bound == "upper":
        converged = grad <= 0 or newton <= STEP_TOL  # ... only above t_max
    else:
        converged = newton <= STEP_TOL
    return temperature, {
        "temperature": temperature,
        "loss_before": loss_before,
        "loss_after": loss_after,
        "iterations": iterations,
        "n": n,
        "converged": bool(converged),
        "grad": grad,
        "newton_step": newton,
        "at_bound": at_bound,
    }


def fit_per_type(rows: Iterable[Mapping[str, Any]], *, min_rows: int = MIN_ROWS, iters: int = ITERS,
                 lr: float = LR, t_min: float = T_MIN, t_max: float = T_MAX,
                 ) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """One temperature per decision type from prediction rows (``type``, ``logits``, ``target``).

    Uses exactly the rows it is given (pass the calibration partition only); a row that says it
    belongs to another split (``split`` key other than "calibration") is refused. A type with fewer
    than ``min_rows`` rows gets T = 1 and an info dict with a ``reason``. Returns
    ``({type: T}, {type: info})`` for every type in choice, noul, score (and any other type seen).
    """
    by_type: dict[str, list[Mapping[str, Any]]] = {t: [] for t in QUESTION_TYPES}
    for row in rows:
        split = row.get("split")
        if split is not None and split != "calibration":
            raise ValueError(f"row {row.get('id')!r} is from split {split!r}; temperatures are fitted on calibration rows only")
        by_type.setdefault(row["type"], []).append(row)
    temps: dict[str, float] = {}
    infos: dict[str, dict[str, Any]] = {}
    for qtype in sorted(by_type, key=lambda x: (QUESTION_TYPES.index(x) if x in QUESTION_TYPES else 99, x)):
        group = sorted(by_type[qtype], key=lambda r: str(r.get("id")))
        n = len(group)
        if n < min_rows:
            info: dict[str, Any] = {
                "temperature": 1.0, "n": n, "iterations": 0, "converged": False,
                "reason": f"{n} calibration rows < {min_rows}: T = 1",
            }
            if n:
                z, t, mask = padded([r["logits"] for r in group], [r["target"] for r in group])
                with torch.no_grad():
                    info["loss_before"] = info["loss_after"] = float(soft_ce(z, t, mask, 1.0))
            else:
                info["loss_before"] = info["loss_after"] = None
            temps[qtype], infos[qtype] = 1.0, info
            continue
        temps[qtype], infos[qtype] = fit_temperature(
            [r["logits"] for r in group], [r["target"] for r in group],
            iters=iters, lr=lr, t_min=t_min, t_max=t_max)
    return temps, infos
