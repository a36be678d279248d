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
LBFGS runs with a strong-Wolfe line search. The loss is convex in 1/T, hence unimodal in log T;
but in log T it can be very flat (near-uniform logits) or sharply curved, where LBFGS alone may stop
short. So the fit is finished by a bracketed 1-D search: the loss on a coarse grid of ``SEARCH_GRID``
log-spaced T over the box brackets the minimiser between two grid neighbours, a golden-section
search narrows that bracket to ``SEARCH_TOL`` in log T, and the returned T is the best of the LBFGS
point, the golden-section point and the two bounds (a bound wins when the optimum lies outside the
box). ``converged`` reports the KKT condition at the returned T: a remaining Newton step below
0.1 % of T (or a predicted further loss decrease below 1e-10) inside the box, or a gradient pushing
outward at a bound; and the returned loss no higher than the coarse grid's best.

``fit_per_type`` fits one temperature per decision type (choice, noul, score) from the rows it is
given and nothing else, behind a guard: a type keeps T = 1 (with a ``reason`` in its info) when

- it has fewer than ``min_rows`` (10) calibration rows, or
- the fit does not beat T = 1 on held-out calibration cases: the type's source cases (``case_id``,
  else the id prefix before ':') are sorted and dealt round-robin into ``CV_FOLDS`` (5) folds (as many
  as there are cases when fewer; one case alone cannot be held out, so the fit is refused); each fold's
  rows are scored at the temperature fitted on the other folds, and the fit is kept only when that
  cross-fitted mean loss is below the loss of the same rows at T = 1 (``heldout`` in the info holds
  both, the fold count and the fold temperatures). A case never sits on both sides of a fold, as the
  rows of one case share a state.

Why refuse rather than shrink towards 1: on a small split the fitted T can make a type worse than
T = 1 on rows it was not fitted on (issue 58 reports a noul T = 0.63 fitted on 24 rows with a held-out KL of 0.409
where the uniform answer gave 0.276), and a shrinkage weight would be one more quantity fitted on
those same few rows. The cross-fit measures the fitting *procedure* out of sample; when it loses to
T = 1 the honest answer is T = 1, and the refused fit stays in the info (``fitted_temperature``,
``fitted_loss``) for the report. When it wins, the T fitted on all the rows is used.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from rlcd.bootstrap import group_key
from rlcd.schema import QUESTION_TYPES

T_MIN, T_MAX = 0.1, 10.0
ITERS, LR = 100, 0.1
MIN_ROWS = 10
CV_FOLDS = 5  # the held-out guard: cases dealt round-robin into this many folds
GUARD = {"min_rows": MIN_ROWS, "folds": CV_FOLDS,
         "rule": "a type keeps T = 1 below min_rows calibration rows, or when the fit does not beat T = 1 on "
                 "held-out calibration cases (cross-fit by case, round-robin folds)"}
STEP_TOL = 1e-3  # converged when the remaining Newton step in log T is below 0.1 % of T
DECREASE_TOL = 1e-10  # ... or the loss decrease that step predicts is below this (flat losses)
SEARCH_GRID = 61  # coarse grid in log T that brackets the minimiser for the golden-section finish
SEARCH_TOL = 1e-9  # width in log T the golden-section search narrows the bracket to
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


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
    "lower"/"upper"/None; search_evaluations = loss evaluations of the bracketed finish; converged =
    newton_step < 0.1 % (or a predicted further decrease < 1e-10) inside the box, or the gradient
    pushing outward at a bound, and a loss no higher than the coarse grid's best).
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
    opt = torch.optim.LBFGS([u], lr=lr, max_iter=iters, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = soft_ce(z, t, mask, temperature_of(u))
        loss.backward()
        return loss

    opt.step(closure)
    state = opt.state[opt._params[0]]
    iterations = int(state.get("n_iter", 0))

    u_lbfgs = min(max(float(u.detach()[0]), lo), hi)
    if not math.isfinite(u_lbfgs):
        u_lbfgs = u0
    u_final, grid_best, evaluations = _finish_in_log_t(z, t, mask, lo, hi, u_lbfgs)
    ue = torch.tensor([u_final], dtype=torch.float64, requires_grad=True)
    loss = soft_ce(z, t, mask, torch.exp(ue))
    (g,) = torch.autograd.grad(loss, ue, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), ue)
    grad, hess = float(g.detach()[0]), float(h[0])
    loss_after = float(loss.detach())
    temperature = t_min if u_final <= lo else t_max if u_final >= hi else float(math.exp(u_final))
    at_bound = "lower" if u_final <= lo + 1e-12 else "upper" if u_final >= hi - 1e-12 else None
    # remaining Newton step in log T = relative distance of T from the optimum (inf if not convex here)
    newton = abs(grad) / hess if hess > 0 else (0.0 if grad == 0 else math.inf)
    flat = hess > 0 and 0.5 * grad * grad / hess <= DECREASE_TOL  # nothing left to gain along log T
    if at_bound == "lower":
        kkt = grad >= 0 or newton <= STEP_TOL or flat  # the loss would only go down below t_min
    elif at_bound == "upper":
        kkt = grad <= 0 or newton <= STEP_TOL or flat  # ... only above t_max
    else:
        kkt = newton <= STEP_TOL or flat
    converged = kkt and loss_after <= grid_best + 1e-12
    return temperature, {
        "temperature": temperature,
        "loss_before": loss_before,
        "loss_after": loss_after,
        "iterations": iterations,
        "search_evaluations": evaluations,
        "n": n,
        "converged": bool(converged),
        "grad": grad,
        "newton_step": newton,
        "at_bound": at_bound,
    }


def _finish_in_log_t(z: torch.Tensor, t: torch.Tensor, mask: torch.Tensor, lo: float, hi: float,
                     u_start: float) -> tuple[float, float, int]:
    """(u, coarse-grid best loss, loss evaluations): the minimiser in u = log T over [lo, hi].

    The loss is unimodal in u (convex in 1/T), so the best of a coarse grid brackets the minimiser
    between its neighbours; golden section narrows the bracket; the candidates (``u_start``, the
    golden-section point, the bounds) are compared and the lowest loss wins, earlier ones on ties.
    """
    grid = torch.linspace(lo, hi, SEARCH_GRID, dtype=torch.float64)
    with torch.no_grad():
        temps = torch.exp(grid).reshape(-1, 1, 1)
        step = max(1, 4_000_000 // max(1, z.numel()))  # [step, N, K] cells per call stay bounded
        curve = torch.cat([soft_ce(z, t, mask, temps[i:i + step]) for i in range(0, SEARCH_GRID, step)])
        curve = torch.where(torch.isfinite(curve), curve, torch.full_like(curve, math.inf))

        def f(x: float) -> float:
            v = float(soft_ce(z, t, mask, math.exp(x)))
            return v if math.isfinite(v) else math.inf

        j = int(torch.argmin(curve))
        a, b = float(grid[max(j - 1, 0)]), float(grid[min(j + 1, SEARCH_GRID - 1)])
        c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
        fc, fd = f(c), f(d)
        evaluations = SEARCH_GRID + 2
        while b - a > SEARCH_TOL:
            if fc <= fd:
                b, d, fd = d, c, fc
                c = b - _GOLDEN * (b - a)
                fc = f(c)
            else:
                a, c, fc = c, d, fd
                d = a + _GOLDEN * (b - a)
                fd = f(d)
            evaluations += 1
        best_u = _newton_polish(z, t, mask, 0.5 * (a + b), lo, hi)
        best_f = f(best_u)
        for cand in (u_start, lo, hi):  # another candidate wins only by more than rounding noise
            fv = f(cand)
            if fv < best_f - 1e-12 * (1.0 + abs(best_f)):
                best_u, best_f = cand, fv
        evaluations += 4
    return best_u, float(curve.min()), evaluations


def _newton_polish(z: torch.Tensor, t: torch.Tensor, mask: torch.Tensor, u: float, lo: float, hi: float,
                   steps: int = 3) -> float:
    """A few Newton steps in u from a golden-section point, kept in [lo, hi] and only while they lower the loss.

    Golden section locates the minimiser only to ~sqrt(machine eps) (loss values tie there); the
    gradient's root is located to ~eps, so the result no longer depends on the order rows are summed in.
    """
    def value_grad_hess(x: float) -> tuple[float, float, float]:
        ux = torch.tensor([x], dtype=torch.float64, requires_grad=True)
        loss = soft_ce(z, t, mask, torch.exp(ux))
        (g,) = torch.autograd.grad(loss, ux, create_graph=True)
        (h,) = torch.autograd.grad(g.sum(), ux)
        return float(loss.detach()), float(g.detach()[0]), float(h[0])

    with torch.enable_grad():
        f, g, h = value_grad_hess(u)
        for _ in range(steps):
            if not (h > 0 and math.isfinite(g)) or g == 0:
                break
            nxt = min(max(u - g / h, lo), hi)
            fn, gn, hn = value_grad_hess(nxt)
            if not fn <= f + 1e-15 * (1.0 + abs(f)):
                break
            u, f, g, h = nxt, fn, gn, hn
    return u


def fit_per_type(rows: Iterable[Mapping[str, Any]], *, min_rows: int = MIN_ROWS, iters: int = ITERS,
                 lr: float = LR, t_min: float = T_MIN, t_max: float = T_MAX, folds: int = CV_FOLDS,
                 ) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """One temperature per decision type from prediction rows (``type``, ``logits``, ``target``).

    Uses exactly the rows it is given (pass the calibration partition only); a row that says it
    belongs to another split (``split`` key other than "calibration") is refused. A type with fewer
    than ``min_rows`` rows, or whose fit does not beat T = 1 on held-out cases (``heldout_check``,
    ``folds`` folds), gets T = 1 and an info dict with a ``reason`` (module docstring). Returns
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
        temperature, info = fit_temperature(
            [r["logits"] for r in group], [r["target"] for r in group],
            iters=iters, lr=lr, t_min=t_min, t_max=t_max)
        info["heldout"] = check = heldout_check(group, folds=folds, iters=iters, lr=lr, t_min=t_min, t_max=t_max)
        if not check["beats_t1"]:
            why = (f"the fit (T = {temperature:.3g}) did not beat T = 1 on held-out calibration cases "
                   f"({check['folds']}-fold cross-fit by case: loss {check['loss']:.4f} vs {check['loss_t1']:.4f} "
                   "at T = 1): T = 1" if check["folds"] else
                   f"all {n} calibration rows are from one case, so no fit can be checked on held-out cases: T = 1")
            info.update(fitted_temperature=temperature, fitted_loss=info["loss_after"], temperature=1.0,
                        loss_after=info["loss_before"], reason=why)
            temperature = 1.0
        temps[qtype], infos[qtype] = temperature, info
    return temps, infos


def heldout_check(rows: Sequence[Mapping[str, Any]], *, folds: int = CV_FOLDS, iters: int = ITERS, lr: float = LR,
                  t_min: float = T_MIN, t_max: float = T_MAX) -> dict[str, Any]:
    """Whether fitting a temperature beats T = 1 on held-out cases of ``rows`` (one type's calibration rows).

    The distinct cases (``rlcd.bootstrap.group_key``), sorted, are dealt round-robin into
    ``k = min(folds, cases)`` folds; fold f's rows are scored at the T fitted (``fit_temperature``) on the
    other folds' rows. Returns ``{folds: k, n_cases, fold_temperatures, loss, loss_t1, beats_t1}`` with
    ``loss`` = mean over all rows of their held-out soft CE and ``loss_t1`` = the same rows' mean at T = 1;
    ``beats_t1`` = loss < loss_t1 by more than rounding (1e-12 relative). One case: k = 0, beats_t1 False.
    """
    keys = sorted({group_key(r) for r in rows})
    k = min(folds, len(keys))
    if k < 2:
        return {"folds": 0, "n_cases": len(keys), "fold_temperatures": [], "loss": None, "loss_t1": None,
                "beats_t1": False}
    fold_of = {key: i % k for i, key in enumerate(keys)}
    fold = [fold_of[group_key(r)] for r in rows]
    total = total_t1 = 0.0
    fold_temps = []
    for f in range(k):
        fit_rows = [r for r, g in zip(rows, fold) if g != f]
        held = [r for r, g in zip(rows, fold) if g == f]
        t_f, _ = fit_temperature([r["logits"] for r in fit_rows], [r["target"] for r in fit_rows],
                                 iters=iters, lr=lr, t_min=t_min, t_max=t_max)
        fold_temps.append(t_f)
        z, t, mask = padded([r["logits"] for r in held], [r["target"] for r in held])
        with torch.no_grad():
            total += float(soft_ce(z, t, mask, t_f, per_row=True).sum())
            total_t1 += float(soft_ce(z, t, mask, 1.0, per_row=True).sum())
    loss, loss_t1 = total / len(rows), total_t1 / len(rows)
    return {"folds": k, "n_cases": len(keys), "fold_temperatures": fold_temps, "loss": loss, "loss_t1": loss_t1,
            "beats_t1": bool(loss < loss_t1 - 1e-12 * (1.0 + abs(loss_t1)))}
