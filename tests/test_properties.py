"""Property tests (hypothesis) of the invariants that have a formula: the RLCD reward and advantage,
temperature scaling, the metrics and record validation.

Every value is checked against a numpy float64 computation written here from the formulas in the
modules' docstrings (objectives steps 1-4 and 7, the metrics' per-row scores and binned ECEs, the soft
CE that ``fit_temperature`` minimises), never against the code under test. Examples are derandomized:
CI sees the same examples on every run, and no example database is written.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from rlcd import metrics as M
from rlcd.calibrate import fit_per_type, fit_temperature
from rlcd.objectives import reward_samples, rlcd_loss, row_terms
from rlcd.schema import Question, RecordError, check_distribution, parse_record
from rlcd.serving.answer import make_answer, probabilities

torch.set_num_threads(1)

LOG_FLOOR = -9.21  # the formula's constants, written out independently of the modules
N_BINS = 15
T_MIN, T_MAX = 0.1, 10.0


def props(examples: int):
    """Deterministic, bounded hypothesis settings (no deadline: the first torch call warms up)."""
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def finite(lo: float, hi: float, width: int = 64):
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False, width=width)


def _softmax64(z, temperature: float = 1.0) -> np.ndarray:
    x = np.asarray(z, np.float64) / temperature
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _distribution(weights) -> np.ndarray:
    """weights >= 0 with a positive sum -> a float64 distribution."""
    w = np.asarray(weights, np.float64)
    return w / w.sum()


@st.composite
def distributions(draw, k: int, hard: bool | None = None) -> np.ndarray:
    """A float64 distribution over k entries: one-hot (hard, one time in four unless told), or soft with exact
    zeros allowed (integer weights: hypothesis's favourite floats, 0.5 or 1.0, make too few inexact ratios)."""
    if hard if hard is not None else draw(st.integers(0, 3)) == 0:
        t = np.zeros(k)
        t[draw(st.integers(0, k - 1))] = 1.0
        return t
    w = draw(st.lists(st.integers(-(10**6) // 3, 10**6).map(lambda i: max(i, 0)), min_size=k, max_size=k))
    assume(sum(w) > 0)
    return _distribution(w)


# =============================================================================================
# 1. RLCD reward and advantage


JUNK = [float("nan"), float("inf"), float("-inf"), 1e30, -7.0]


@st.composite
def rlcd_batches(draw):
    """A micro-batch in the objective's input format: B 1..5 rows, K 2..8, any mask with at least one valid
    candidate per row (rows with one valid candidate included), junk on padding, G 2..6 noise draws."""
    b_rows, k, g = draw(st.integers(1, 5)), draw(st.integers(2, 8)), draw(st.integers(2, 6))
    mask = np.zeros((b_rows, k), bool)
    target = np.zeros((b_rows, k), np.float32)
    for b in range(b_rows):
        valid = draw(st.lists(st.integers(0, k - 1), min_size=1, max_size=k, unique=True))
        mask[b, valid] = True
        target[b, sorted(valid)] = draw(distributions(len(valid))).astype(np.float32)
    logits = draw(arrays(np.float32, (b_rows, k), elements=finite(-12.0, 12.0, 32)))
    noise = draw(arrays(np.float32, (g, b_rows, k), elements=finite(-4.0, 4.0, 32)))
    n_pad = int((~mask).sum())
    logits[~mask] = draw(st.lists(st.sampled_from(JUNK), min_size=n_pad, max_size=n_pad))
    noise[:, ~mask] = np.reshape(draw(st.lists(st.sampled_from(JUNK), min_size=g * n_pad, max_size=g * n_pad)),
                                 (g, n_pad))
    ordinal = np.array(draw(st.lists(st.booleans(), min_size=b_rows, max_size=b_rows)), bool)
    groups = draw(st.one_of(st.none(), st.lists(st.integers(0, 2), min_size=b_rows, max_size=b_rows)))
    kw = {
        "sigma": draw(finite(0.05, 3.0)),
        "n_perturbations": g,
        "w_log": draw(st.one_of(st.just(1.0), finite(0.0, 2.0))),
        "w_spherical": draw(st.one_of(st.just(0.75), finite(0.0, 2.0))),
        "w_rps": draw(st.one_of(st.just(1.0), finite(0.0, 2.0))),
    }
    if groups is not None:
        kw["norm_groups"] = torch.tensor(groups, dtype=torch.long)
    tensors = (torch.from_numpy(logits), torch.from_numpy(mask), torch.from_numpy(target),
               torch.from_numpy(ordinal), torch.from_numpy(noise))
    return tensors, kw


def reward_reference(logits, mask, target, ordinal, noise, *, sigma, n_perturbations, w_log, w_spherical,
                     w_rps, norm_groups=None):
    """Steps 1-4 and 7 of the objectives docstring in numpy float64, row by row on the valid candidates."""
    logits, mask, target = logits.numpy(), mask.numpy(), target.numpy()
    ordinal, noise = ordinal.numpy(), noise.numpy()
    g, b_rows, k_all = noise.shape
    assert g == n_perturbations
    ls, sph, rps = np.zeros((g, b_rows)), np.zeros((g, b_rows)), np.zeros((g, b_rows))
    eps = np.zeros((g, b_rows, k_all))
    for b in range(b_rows):
        v = np.flatnonzero(mask[b])
        t = target[b, v].astype(np.float64)
        e = sigma * noise[:, b, v].astype(np.float64)  # [G, k]
        eps[:, b, v] = e - e.mean(axis=1, keepdims=True)
        z = logits[b, v].astype(np.float64) + eps[:, b, v]
        zmax = z.max(axis=1, keepdims=True)
        logq = z - zmax - np.log(np.exp(z - zmax).sum(axis=1, keepdims=True))
        q = np.exp(logq)
        ls[:, b] = (t * np.maximum(logq, LOG_FLOOR)).sum(axis=1)
        sph[:, b] = (q @ t) / np.maximum(np.sqrt((q * q).sum(axis=1)), 1e-9)
        rps[:, b] = ((np.cumsum(q, axis=1) - np.cumsum(t)) ** 2).sum(axis=1) / (max(v.size, 2) - 1)
    reward = w_log * ls + w_spherical * sph - w_rps * rps * ordinal[None, :]
    adv = reward - reward.mean(axis=0)
    std = adv.std(ddof=1)
    if norm_groups is None:
        scale = np.full(b_rows, std)
    else:
        ids = norm_groups.numpy()
        scale = np.array([adv[:, ids == ids[b]].std(ddof=1) for b in range(b_rows)])
    a_hat = adv / (scale[None, :] + 1e-6)
    return {"log": ls, "spherical": sph, "rps": rps, "reward": reward, "advantage": adv, "a_hat": a_hat,
            "advantage_std": std, "eps": eps}


def _close(actual, expected, *, rtol, atol=0.0):
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64), rtol=rtol,
                               atol=atol)


@props(80)
@given(rlcd_batches())
def test_reward_parts_lie_in_their_bounds_and_match_float64(batch):
    (logits, mask, target, ordinal, noise), kw = batch
    parts = reward_samples(logits, mask, target, ordinal, noise=noise, **kw)
    ref = reward_reference(logits, mask, target, ordinal, noise, **kw)
    t64 = target.double()
    t_sum, t_norm = t64.sum(-1).numpy(), t64.norm(dim=-1).numpy()
    log, sph, rps = (parts[name].double().numpy() for name in ("log", "spherical", "rps"))
    # LS = sum t max(log q, floor): each term in [floor t_j, 0]
    assert (log <= 1e-12).all() and (log >= LOG_FLOOR * t_sum - 1e-12).all()
    # SPH = <t, q> / ||q||: in [0, ||t||_2] by Cauchy-Schwarz, and ||t||_2 <= 1
    assert (sph >= 0).all() and (sph <= t_norm + 1e-12).all() and (t_norm <= 1 + 1e-6).all()
    # RPS: k - 1 squared differences of cumulative probabilities in [0, 1], over k - 1
    assert (rps >= 0).all() and (rps <= 1 + 1e-12).all()
    reward = parts["reward"].double().numpy()
    lo = kw["w_log"] * LOG_FLOOR * t_sum - kw["w_rps"] * ordinal.numpy()
    assert (reward >= lo - 1e-9).all() and (reward <= kw["w_spherical"] * t_norm + 1e-9).all()
    for name in ("log", "spherical", "rps", "reward", "advantage"):
        _close(parts[name], ref[name], rtol=1e-10, atol=1e-10)
    _close(parts["a_hat"], ref["a_hat"], rtol=1e-6, atol=1e-6)


@props(80)
@given(rlcd_batches())
def test_advantages_are_centred_per_question(batch):
    (logits, mask, target, ordinal, noise), kw = batch
    parts = reward_samples(logits, mask, target, ordinal, noise=noise, **kw)
    reward, adv, a_hat = (parts[name].double().numpy() for name in ("reward", "advantage", "a_hat"))
    g = kw["n_perturbations"]
    # A = r - mean_g r: zero mean over the G samples of every question, and the same differences as r
    assert np.abs(adv.sum(axis=0)).max() <= 1e-12 * g * (1.0 + np.abs(reward).max())
    _close(adv - adv[0], reward - reward[0], rtol=0, atol=1e-12 * (1.0 + np.abs(reward).max()))
    assert np.abs(a_hat.sum(axis=0)).max() <= 1e-5 * g * (1.0 + np.abs(a_hat).max())
    # a question with one valid candidate has no noise, G equal rewards and exactly zero advantage
    single = mask.sum(-1).numpy() == 1
    assert (adv[:, single] == 0).all() and (a_hat[:, single] == 0).all()
    # A_hat = A / (std + 1e-6): the same sign and, within a normalisation group, one positive scale
    assert (np.sign(a_hat) == np.sign(adv))[np.abs(adv) > 1e-9].all()


@props(60)
@given(rlcd_batches(), finite(0.0, 2.0))
def test_loss_stats_and_logit_gradient_follow_formula_7(batch, ce_weight):
    (logits, mask, target, ordinal, noise), kw = batch
    ref = reward_reference(logits, mask, target, ordinal, noise, **kw)
    x = logits.clone().requires_grad_(True)
    loss, stats = rlcd_loss(x, mask, target, ordinal, noise=noise, ce_weight=ce_weight, **kw)
    loss.backward()
    m = mask.numpy()
    for key, value in (("reward_mean", ref["reward"].mean()), ("reward_std", ref["reward"].std(ddof=1)),
                       ("log_score_mean", ref["log"].mean()), ("spherical_mean", ref["spherical"].mean()),
                       ("advantage_std", ref["advantage_std"])):
        _close(stats[key], value, rtol=1e-9, atol=1e-10)
    ordf = ordinal.numpy()
    _close(stats["rps_mean"], ref["rps"][:, ordf].mean() if ordf.any() else 0.0, rtol=1e-9, atol=1e-10)
    # CE = -mean_b sum_{j valid} t_j log softmax(logits_b)_j; its gradient (softmax - t) / B on valid candidates
    b_rows, sigma, g = m.shape[0], kw["sigma"], kw["n_perturbations"]
    ce_rows, grad_ce = np.zeros(b_rows), np.zeros(m.shape)
    t = target.double().numpy()
    for b in range(b_rows):
        v = np.flatnonzero(m[b])
        p = _softmax64(logits[b, v].double().numpy())
        ce_rows[b] = -(t[b, v] * np.log(p)).sum()
        grad_ce[b, v] = (p - t[b, v]) / b_rows
    _close(stats["ce_loss"], ce_rows.mean(), rtol=1e-6, atol=1e-6)
    # step 7: d loss / d logits = -(1/(G B)) sum_g A_hat eps / sigma^2 + ce_weight (softmax - t) / B
    grad_pg = -(ref["a_hat"][:, :, None] * ref["eps"]).sum(0) / (g * b_rows * sigma ** 2)
    expected = grad_pg + ce_weight * grad_ce
    grad = x.grad.double().numpy()
    assert (grad[~m] == 0).all()
    scale = np.abs(expected).max()
    _close(grad, expected, rtol=1e-5, atol=1e-5 * scale + 1e-7)
    # row_terms splits the same objective by row: its rewards and gradient are the loss's
    rows = row_terms(logits, mask, target, ordinal, ce_weight=ce_weight, noise=noise, **kw)
    _close(rows["reward"], ref["reward"], rtol=1e-10, atol=1e-10)
    _close(rows["ce"], ce_rows, rtol=1e-5, atol=1e-5)
    _close(rows["grad"], grad, rtol=1e-6, atol=1e-6 * scale + 1e-8)


# =============================================================================================
# 2. temperature scaling


@st.composite
def separated_logits(draw):
    """K 2..10 logits whose distinct values differ by >= 1e-3 (a smaller gap can round to a tie under /T),
    sometimes with the maximum repeated (an exact tie stays exact under /T)."""
    k = draw(st.integers(2, 10))
    base = draw(finite(-30.0, 30.0))
    gaps = draw(st.lists(finite(1e-3, 6.0), min_size=k, max_size=k))
    z = (base + np.cumsum(gaps))[np.array(draw(st.permutations(range(k))))]
    if draw(st.booleans()):
        z[draw(st.integers(0, k - 1))] = z.max()
    return z


@props(150)
@given(separated_logits(), finite(0.02, 50.0))
def test_temperature_keeps_the_argmax(z, temperature):
    best = int(np.argmax(z))  # first maximum on ties
    p_eval = M.softmax(z, temperature)
    p_serve = probabilities(z.tolist(), temperature).numpy()
    for p in (p_eval, p_serve):
        assert int(np.argmax(p)) == best
        _close(p, _softmax64(z, temperature), rtol=1e-12, atol=1e-300)
        assert abs(math.fsum(p) - 1.0) <= 1e-12
    labels = [f"option {i}" for i in range(len(z))]
    answer = make_answer(Question(type="choice", criteria=labels), z.tolist(), temperature)
    assert answer["choice"] == labels[best]
    # evaluation scores a row labelled with the raw argmax as correct under any temperature
    row = {"id": "r", "group": "g", "type": "choice", "labels": labels, "posterior": None,
           "logits": z.tolist(), "target": np.eye(len(z))[best].tolist()}
    assert M.summarize([row], {"choice": temperature})["overall"]["accuracy"] == 1.0


def soft_ce_reference(logits, targets, temperature: float) -> float:
    """mean over rows of -sum_k t_k log softmax(z / T)_k, float64 numpy, ragged rows."""
    total = []
    for z, t in zip(logits, targets):
        x = np.asarray(z, np.float64) / temperature
        logp = x - x.max() - math.log(np.exp(x - x.max()).sum())
        total.append(-float(np.dot(np.asarray(t, np.float64), logp)))
    return math.fsum(total) / len(total)


@st.composite
def calibration_sets(draw, n_min: int = 10, n_max: int = 40):
    """Ragged rows (K 2..6) with targets that are softmax(z / t0) (t0 anywhere, the bounds included), one-hot
    labels, or arbitrary distributions."""
    n = draw(st.integers(n_min, n_max))
    scale = draw(finite(0.2, 5.0))
    kind = draw(st.sampled_from(["soft", "hard", "any"]))
    t0 = draw(st.floats(0.02, 40.0))
    logits, targets = [], []
    for _ in range(n):
        k = draw(st.integers(2, 6))
        z = np.asarray(draw(st.lists(finite(-3.0, 3.0), min_size=k, max_size=k))) * scale
        if kind == "soft":
            t = _softmax64(z, t0)
        else:
            t = draw(distributions(k, hard=kind == "hard"))
        logits.append(z)
        targets.append(t)
    return logits, targets


@props(30)
@given(calibration_sets())
def test_fitted_temperature_minimises_the_soft_ce_in_its_box(data):
    logits, targets = data
    temperature, info = fit_temperature(logits, targets)
    assert T_MIN <= temperature <= T_MAX
    loss = soft_ce_reference(logits, targets, temperature)
    tol = 1e-9 * (1.0 + abs(loss))
    assert info["loss_after"] == pytest.approx(loss, rel=1e-12, abs=1e-12)
    assert info["loss_before"] == pytest.approx(soft_ce_reference(logits, targets, 1.0), rel=1e-12, abs=1e-12)
    grid = np.exp(np.linspace(math.log(T_MIN), math.log(T_MAX), 121))
    for other in [temperature * 0.9, temperature * 1.1, 1.0, *grid]:
        other = min(max(other, T_MIN), T_MAX)
        assert loss <= soft_ce_reference(logits, targets, other) + tol, (temperature, other)


@props(15)
@given(calibration_sets(n_min=2, n_max=25), calibration_sets(n_min=2, n_max=25), st.integers(1, 20))
def test_per_type_fit_uses_only_its_own_rows(choice_set, score_set, min_rows):
    sets = {"choice": choice_set, "score": score_set}
    rows = [{"id": f"{qtype}-{i}", "type": qtype, "logits": z.tolist(), "target": t.tolist()}
            for qtype, (zs, ts) in sets.items() for i, (z, t) in enumerate(zip(zs, ts))]
    temps, infos = fit_per_type(rows[::-1], min_rows=min_rows)
    assert temps["noul"] == 1.0 and infos["noul"]["n"] == 0
    for qtype, (zs, ts) in sets.items():
        assert infos[qtype]["n"] == len(zs)
        if len(zs) < min_rows:
            assert temps[qtype] == 1.0
            assert infos[qtype]["loss_after"] == pytest.approx(soft_ce_reference(zs, ts, 1.0), rel=1e-12)
        else:  # the fit of this type's rows alone, in the id order fit_per_type documents, unless the guard refused it
            ordered = sorted(range(len(zs)), key=lambda i: f"{qtype}-{i}")
            alone, _ = fit_temperature([zs[i] for i in ordered], [ts[i] for i in ordered])
            if infos[qtype]["heldout"]["beats_t1"]:
                assert temps[qtype] == alone and "reason" not in infos[qtype]
            else:
                assert temps[qtype] == 1.0 and infos[qtype]["fitted_temperature"] == alone


# =============================================================================================
# 3. metrics


@st.composite
def prob_target_pairs(draw, k_min: int = 2, k_max: int = 10):
    k = draw(st.integers(k_min, k_max))
    return draw(distributions(k)), draw(distributions(k))


@props(150)
@given(prob_target_pairs())
def test_row_scores_match_float64(pair):
    p, t = pair
    k = p.size
    s = M.row_scores(p, t, ordinal=True)
    nll = -math.fsum(t[i] * math.log(max(p[i], 1e-12)) for i in range(k))
    brier = math.fsum((p[i] - t[i]) ** 2 for i in range(k))
    cp, ct = np.cumsum(p), np.cumsum(t)
    rps = math.fsum((cp[i] - ct[i]) ** 2 for i in range(k - 1)) / (k - 1)
    best_p, best_t = int(np.argmax(p)), int(np.argmax(t))
    level_mae = abs(math.fsum(i * p[i] for i in range(k)) - math.fsum(i * t[i] for i in range(k)))
    expected = {"nll": nll, "brier": brier, "rps": rps, "level_mae": level_mae,
                "accuracy": float(best_p == best_t), "soft_accuracy": t[best_p], "confidence": p.max(),
                "target_max": t.max(), "within_one": float(abs(best_p - best_t) <= 1)}
    assert set(s) == set(expected)
    for key, value in expected.items():
        assert s[key] == pytest.approx(value, rel=1e-12, abs=1e-13), key
    assert M.nll(p, t) == s["nll"] and M.brier(p, t) == s["brier"] and M.rps(p, t) == s["rps"]
    # the scores' ranges: NLL in [0, -log 1e-12], Brier in [0, 2], RPS in [0, 1]
    assert 0 <= s["nll"] <= -math.log(1e-12) + 1e-9 and 0 <= s["brier"] <= 2 + 1e-12 and 0 <= s["rps"] <= 1 + 1e-12
    assert "rps" not in M.row_scores(p, t)


def ece_reference(confidence, reference) -> float:
    """sum_b (n_b / N) |mean conf_b - mean ref_b| over 15 bins b/15 <= c < (b+1)/15, the last one closed."""
    bins: dict[int, list[tuple[float, float]]] = {}
    for c, r in zip(confidence, reference):
        b = max(i for i in range(N_BINS) if i / N_BINS <= c)
        bins.setdefault(b, []).append((c, r))
    n = len(confidence)
    return math.fsum(len(v) / n * abs(math.fsum(c for c, _ in v) / len(v) - math.fsum(r for _, r in v) / len(v))
                     for v in bins.values())


EDGES = [b / N_BINS for b in range(N_BINS + 1)]


@props(150)
@given(st.lists(st.tuples(st.one_of(finite(0.0, 1.0), st.sampled_from(EDGES)), finite(0.0, 1.0)),
                min_size=1, max_size=60))
def test_calibration_error_matches_binned_float64(pairs):
    confidence, reference = [c for c, _ in pairs], [r for _, r in pairs]
    ece = M.calibration_error(confidence, reference)
    assert ece == pytest.approx(ece_reference(confidence, reference), rel=1e-12, abs=1e-14)
    assert 0 <= ece <= 1 + 1e-12
    table = M.reliability_table(confidence, reference, reference)
    counts = [sum(1 for c in confidence if max(i for i in range(N_BINS) if i / N_BINS <= c) == b)
              for b in range(N_BINS)]
    assert [row["count"] for row in table] == counts


TYPE_K = {"noul": (2, 2), "choice": (2, 8), "score": (2, 8)}


@st.composite
def prediction_rows(draw):
    n = draw(st.integers(1, 30))
    rows = []
    for i in range(n):
        qtype = draw(st.sampled_from(sorted(TYPE_K)))
        k = draw(st.integers(*TYPE_K[qtype]))
        logits = draw(st.lists(finite(-8.0, 8.0), min_size=k, max_size=k))
        rows.append({"id": f"r{i:02d}", "group": draw(st.sampled_from(["a", "b"])), "type": qtype,
                     "labels": [str(j) for j in range(k)], "target": draw(distributions(k)).tolist(),
                     "posterior": None, "logits": logits})
    temps = draw(st.one_of(st.none(), st.fixed_dictionaries({t: finite(0.1, 10.0) for t in TYPE_K})))
    return rows, temps


@props(60)
@given(prediction_rows())
def test_summarize_matches_float64(data):
    rows, temps = data
    out = M.summarize(rows, temps)
    scored = []
    for r in rows:
        p = _softmax64(r["logits"], temps[r["type"]] if temps else 1.0)
        t = np.asarray(r["target"], np.float64)
        # a confidence within rounding of a bin edge may fall on either side under another summation order
        assume(min(abs(p.max() - e) for e in EDGES) > 1e-12)
        best = int(np.argmax(p))
        cp, ct = np.cumsum(p), np.cumsum(t)
        scored.append({"type": r["type"], "conf": p.max(), "correct": float(best == int(np.argmax(t))),
                       "soft": t[best], "nll": -float(np.sum(t * np.log(np.maximum(p, 1e-12)))),
                       "brier": float(np.sum((p - t) ** 2)), "tmax": t.max(),
                       "rps": float(np.sum((cp[:-1] - ct[:-1]) ** 2) / (p.size - 1))})

    def check(block, subset):
        assert block["n"] == len(subset)
        for key, col in (("accuracy", "correct"), ("soft_accuracy", "soft"), ("nll", "nll"), ("brier", "brier")):
            assert block[key] == pytest.approx(math.fsum(s[col] for s in subset) / len(subset), rel=1e-12, abs=1e-13)
        conf = [s["conf"] for s in subset]
        assert block["ece"] == pytest.approx(ece_reference(conf, [s["correct"] for s in subset]), rel=1e-10, abs=1e-13)
        assert block["ece_target"] == pytest.approx(ece_reference(conf, [s["soft"] for s in subset]), rel=1e-10,
                                                    abs=1e-13)
        gap = math.fsum(conf) / len(subset) - math.fsum(s["tmax"] for s in subset) / len(subset)
        assert block["sharpness_gap"] == pytest.approx(gap, rel=1e-12, abs=1e-13)
        score = [s["rps"] for s in subset if s["type"] == "score"]
        assert block.get("n_score") == (len(score) or None)
        if score:
            assert block["rps"] == pytest.approx(math.fsum(score) / len(score), rel=1e-12, abs=1e-13)

    check(out["overall"], scored)
    for qtype in TYPE_K:
        subset = [s for s in scored if s["type"] == qtype]
        assert (qtype in out["per_type"]) == bool(subset)
        if subset:
            check(out["per_type"][qtype], subset)


# =============================================================================================
# 4. record validation


# '<' is left out of every generated text, so no text holds a reserved special token
TEXT = st.text(st.characters(codec="utf-8", exclude_characters="<"), max_size=12)
NAME = TEXT.filter(lambda s: s.strip() != "")
JSON_VALUE = st.one_of(TEXT, st.dictionaries(NAME, TEXT, max_size=3), st.lists(TEXT, max_size=3))


@st.composite
def questions(draw) -> dict:
    qtype = draw(st.sampled_from(["choice", "noul", "score"]))
    q: dict = {"type": qtype}
    if draw(st.booleans()):
        q["instructions"] = draw(st.one_of(st.none(), JSON_VALUE))
    if qtype == "choice":
        labels = draw(st.lists(NAME, min_size=2, max_size=8, unique=True))
        q["criteria"] = labels if draw(st.booleans()) else {lab: draw(st.one_of(st.none(), TEXT)) for lab in labels}
    elif qtype == "noul":
        keys = draw(st.lists(st.sampled_from(["false", "true"]), unique=True))
        q["criteria"] = draw(st.one_of(st.none(), st.just({key: draw(st.one_of(st.none(), TEXT)) for key in keys})))
    else:
        q["criteria"] = draw(st.lists(TEXT, min_size=2, max_size=8))
    return q


def _k(question: dict) -> int:
    """The candidate count of a question dict, from the schema's documented rule (not from Question)."""
    return 2 if question["type"] == "noul" else len(question["criteria"])


@st.composite
def valid_records(draw) -> dict:
    """A record dict the documented rules accept; targets may miss a sum of 1 by up to 5e-5 (renormalised)."""
    question = draw(questions())
    k = _k(question)
    record = {"id": draw(NAME), "source": draw(NAME), "task": draw(NAME), "state": draw(JSON_VALUE),
              "question": question,
              "target": (draw(distributions(k)) * (1 + draw(st.integers(-50_000, 50_000)) * 1e-9)).tolist()}
    optional = {"language": NAME, "group": st.one_of(st.none(), NAME), "image": st.one_of(st.none(), TEXT),
                "split": st.sampled_from([None, "train", "dev", "calibration", "test"]),
                "posterior": st.one_of(st.none(), distributions(k).map(lambda a: a.tolist())),
                "case_id": st.one_of(st.none(), NAME)}
    for key, strategy in optional.items():
        if draw(st.booleans()):
            record[key] = draw(strategy)
    return record


@props(150)
@given(valid_records())
def test_valid_record_round_trips_through_json(raw):
    record = parse_record(json.loads(json.dumps(raw)))
    assert record == parse_record(raw)
    # the fields as given; the target and posterior renormalised to sum 1
    for key in ("id", "source", "task", "state", "image", "split", "case_id"):
        assert getattr(record, key) == raw.get(key)
    assert record.language == raw.get("language", "en")
    assert record.group == (raw.get("group") or f"{record.source}/{record.language}/{record.task}")
    assert record.question.model_dump() == {"instructions": None, **raw["question"]}
    for key in ("target", "posterior"):
        if raw.get(key) is not None:
            total = math.fsum(raw[key])
            _close(getattr(record, key), [v / total for v in raw[key]], rtol=1e-12, atol=1e-300)
    # the record written as JSON (as prepare writes it) reads back as the same record
    again = parse_record(json.loads(record.model_dump_json()))
    assert again == record


@props(300)
@given(st.lists(finite(0.0, 1.0), min_size=2, max_size=12), st.integers(-50_000, 50_000))
def test_renormalising_a_distribution_is_idempotent(weights, delta):
    """A target within the tolerance is renormalised once: the record prepare writes is the record train reads."""
    assume(math.fsum(weights) > 1e-3)
    k = len(weights)
    given_ = (_distribution(weights) * (1 + delta * 1e-9)).tolist()
    once = check_distribution(given_, k, field="target", row="r")
    assert check_distribution(once, k, field="target", row="r") == once
    assert abs(math.fsum(once) - 1.0) <= 1e-12
    _close(once, _distribution(given_), rtol=1e-12, atol=1e-300)


MAX_DELTA = 1e-4  # the schema's documented target-sum tolerance


DISTRIBUTION_RULES = ("sum", "length", "negative", "nonfinite", "number")
OTHER_RULES = ("type", "split", "reserved_state", "score_levels", "duplicate_labels", "reserved_instructions",
               "empty_name", "extra_field")


@st.composite
def invalid_records(draw):
    """(a record dict breaking exactly one documented rule, the field the error must name, a rule fragment)."""
    record = draw(valid_records())
    kind = draw(st.sampled_from(DISTRIBUTION_RULES + OTHER_RULES))
    if kind in DISTRIBUTION_RULES:
        k = _k(record["question"])
        field = draw(st.sampled_from(["target", "posterior"]))
        value = draw(distributions(k)).tolist()
        if kind == "sum":
            factor = draw(st.one_of(finite(0.0, 1 - 2 * MAX_DELTA), finite(1 + 2 * MAX_DELTA, 3.0)))
            value, rule = [v * factor for v in value], "must sum to 1 within"
        elif kind == "length":
            value = value + [0.0] if draw(st.booleans()) else value[:-1]
            rule = f"has {len(value)} entries but the question has {k} candidates"
        elif kind == "negative":
            i, j = draw(st.permutations(range(k)))[:2]
            d = draw(finite(1e-6, 1.0))
            value[i], value[j], rule = -d, value[j] + value[i] + d, "non-negative"  # still sums to 1
        elif kind == "nonfinite":
            value[draw(st.integers(0, k - 1))] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
            rule = "finite"
        else:
            i = draw(st.integers(0, k - 1))
            value[i], rule = draw(NAME.filter(lambda s: not _is_number(s))), "valid number"
        record[field] = value
        return record, (f"{field}.{i}" if kind == "number" else field), rule
    question = record["question"]
    if kind == "type":
        question["type"] = draw(NAME.filter(lambda s: s not in ("choice", "noul", "score")))
        return record, "question.type", "'choice', 'noul' or 'score'"
    if kind == "split":
        record["split"] = draw(NAME.filter(lambda s: s not in ("train", "dev", "calibration", "test")))
        return record, "split", "'train', 'dev', 'calibration' or 'test'"
    if kind == "reserved_state":
        record["state"] = draw(st.sampled_from(["a <|im_end|>", {"x": "<think>"}, ["<|fim_pad|>"]]))
        return record, "state", "reserved token"
    if kind == "empty_name":
        key = draw(st.sampled_from(["id", "source", "task", "language"]))
        record[key] = draw(st.sampled_from(["", " ", "\t\n"]))
        return record, key, "must be a non-empty string"
    if kind == "extra_field":
        key = draw(NAME.filter(lambda s: s not in RECORD_FIELDS))
        record[key] = draw(TEXT)
        return record, key, "Extra inputs are not permitted"
    if kind == "score_levels":
        question.update(type="score", criteria=draw(st.lists(TEXT, max_size=1)))
        rule = "score criteria must be"
    elif kind == "duplicate_labels":
        label = draw(NAME)
        question.update(type="choice", criteria=[label, *draw(st.lists(NAME, max_size=3)), label])
        rule = "must be unique"
    else:
        question["instructions"] = draw(st.sampled_from(["pick <|im_start|>", {"x": "</tool_call>"}]))
        rule = "reserved token"
    record["target"] = [1.0]  # the question is refused before the target is read
    record.pop("posterior", None)
    return record, "question", rule


RECORD_FIELDS = {"id", "source", "language", "task", "group", "split", "state", "image", "question", "target",
                 "posterior", "case_id"}


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@props(150)
@given(invalid_records())
def test_invalid_record_names_row_field_and_rule(case):
    record, field, rule = case
    with pytest.raises(RecordError) as info:
        parse_record(record)
    assert (info.value.row, info.value.field) == (record["id"], field)
    assert str(info.value).startswith(f"row {record['id']!r}: field {field!r}: ")
    assert rule in info.value.rule
