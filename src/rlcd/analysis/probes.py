"""Probes of a trained run: candidate-order sensitivity and noise over-sharpening.

**Order probe** (``probe_order``). Each ``choice`` record is re-scored under candidate
permutations: the reversal and the cyclic shifts 1..K-1 (duplicates removed, e.g. for K = 2 the
reversal *is* the shift), at most ``max_perms`` of them (the reversal plus evenly spaced shifts when
capped). A permutation ``perm`` lists original candidate indices in their new order, as
``rlcd.data.sampling.shuffle_choice`` does: the permuted question's candidate j is the original
candidate ``perm[j]`` (a mapping keeps each description with its label), and target and posterior
move with it. The model's distribution ``p'`` over the permuted order is mapped back to the original
label order (``aligned[perm[j]] = p'[j]``) and compared with the distribution ``p`` under the order
as given:

- **flip**: the top *label* differs (``labels[argmax p] != labels[perm[argmax p']]``), counted only
  when the two labels are not tied (probability difference > ``TIE_TOL`` under either order), so an
  exact tie broken by position is not a flip;
- **TV**: the total-variation distance ``0.5 * sum_k |aligned_k - p_k|`` between label-aligned
  distributions;
- **top at first**: how often the top candidate sits in the first position, over all scored orders,
  next to ``mean 1/K``, the rate of a position-blind model with distinct scores.

``noul`` and ``score`` candidates have a fixed order that carries meaning; they are not permuted and
are reported as not applicable. Probabilities are ``softmax(logits / T)``, raw (T = 1) unless
temperatures are given; flips do not depend on T.

**Noise probe** (``probe_noise``), from prediction rows alone (``eval/predictions-<split>.jsonl``,
raw logits): the noise-free prediction ``p = softmax(z)`` against the noise-averaged one
``q = mean_s softmax(z + eps_s)`` with ``eps_s = sigma * n_s - mean_k(sigma * n_s)`` (n standard normal,
centred over the row's candidates, as in the RLCD objective), ``samples`` draws per row (float64,
``numpy.random.default_rng(seed)``, rows in id order), each draw by default also used cyclically
shifted and negated (an unbiased variance reduction; see ``noise_average``). An RLCD-trained model learns logits whose
*noise-averaged* distribution fits the targets, so its noise-free ``p`` is sharper: reported per type
and overall are the mean max-prob of p and of q, the mean KL(q || p) and KL(p || q), the fraction of
rows whose argmax changes, and the NLL of p and of q against the target (and the posterior when
known). Exchangeable noise preserves the ranking of the logits in expectation, so the argmax change
rate measures near-ties resolved by Monte-Carlo error; it should be ~0.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rlcd.run import Run
from rlcd.schema import QUESTION_TYPES, Record

ORDER_FORMAT = "rlcd.probe_order/1"
NOISE_FORMAT = "rlcd.probe_noise/1"
TIE_TOL = 1e-9
NOT_PERMUTED = "candidate order is fixed and carries meaning (noul: false/true; score: ascending levels)"

ScoreFn = Callable[[list[Record]], Sequence[Sequence[float]]]
"""records -> raw logits over each record's K candidates (in the record's candidate order)."""


# ----------------------------------------------------------------------------------------------
# helpers


def softmax(z: Sequence[float] | np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """float64 softmax over the last axis."""
    a = np.asarray(z, dtype=np.float64) / float(temperature)
    a = a - a.max(axis=-1, keepdims=True)
    e = np.exp(a)
    return e / e.sum(axis=-1, keepdims=True)


def total_variation(p: Sequence[float], q: Sequence[float]) -> float:
    return float(0.5 * np.abs(np.asarray(p, dtype=np.float64) - np.asarray(q, dtype=np.float64)).sum())


def kl(p: np.ndarray, q: np.ndarray) -> float:
    """KL(p || q) in nats (0 log 0 = 0)."""
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    nz = p > 0
    return float(np.sum(p[nz] * (np.log(p[nz]) - np.log(np.maximum(q[nz], 1e-300)))))


def _mean(xs: Sequence[float]) -> float | None:
    return float(math.fsum(xs) / len(xs)) if xs else None


def k_bucket(k: int) -> str:
    from rlcd.metrics import k_bucket as _kb

    return _kb(k)


# ----------------------------------------------------------------------------------------------
# permutations


def candidate_permutations(k: int, max_perms: int = 8) -> list[tuple[str, list[int]]]:
    """Non-identity probe permutations of K candidates: ``[("reversal", perm), ("shift1", perm), ...]``.

    ``perm[j]`` is the original index placed at position j. The reversal comes first, then cyclic
    shifts (shift s puts original candidate ``(j + s) % K`` at position j); a permutation equal to
    an earlier one is dropped. With more than ``max_perms`` the reversal is kept with
    ``max_perms - 1`` evenly spaced shifts.
    """
    if k < 2:
        return []
    if max_perms < 1:
        raise ValueError(f"max_perms must be >= 1, got {max_perms}")
    rev = list(range(k - 1, -1, -1))
    shifts = [(f"shift{s}", [(j + s) % k for j in range(k)]) for s in range(1, k)]
    out: list[tuple[str, list[int]]] = [("reversal", rev)]
    seen = {tuple(rev)}
    uniq_shifts = []
    for name, p in shifts:
        if tuple(p) not in seen:
            seen.add(tuple(p))
            uniq_shifts.append((name, p))
    room = max_perms - 1
    if len(uniq_shifts) > room:
        if room <= 0:
            uniq_shifts = []
        else:
            idx = np.unique(np.round(np.linspace(0, len(uniq_shifts) - 1, room)).astype(int))
            uniq_shifts = [uniq_shifts[i] for i in idx]
    return out + uniq_shifts


def permute_choice(record: Record, perm: Sequence[int]) -> Record:
    """A copy of a choice record with candidates, target and posterior reordered by ``perm``
    (``perm[j]`` = original index at position j), like ``shuffle_choice`` with a given permutation."""
    q = record.question
    if q.type != "choice":
        raise ValueError(f"record {record.id!r}: only choice questions are permuted, not {q.type}")
    perm = [int(i) for i in perm]
    if sorted(perm) != list(range(q.k)):
        raise ValueError(f"record {record.id!r}: {perm} is not a permutation of {q.k} candidates")
    labels = q.labels
    if isinstance(q.criteria, dict):
        criteria: list[str] | dict[str, Any] = {labels[i]: q.criteria[labels[i]] for i in perm}
    else:
        criteria = [labels[i] for i in perm]
    update: dict[str, Any] = {"question": q.model_copy(update={"criteria": criteria}),
                              "target": [record.target[i] for i in perm]}
    if record.posterior is not None:
        update["posterior"] = [record.posterior[i] for i in perm]
    return record.model_copy(update=update)


def align(p_perm: Sequence[float], perm: Sequence[int]) -> np.ndarray:
    """Probabilities over a permuted order mapped back to the original order: out[perm[j]] = p_perm[j]."""
    p_perm = np.asarray(p_perm, dtype=np.float64)
    out = np.empty_like(p_perm)
    out[np.asarray(perm, dtype=int)] = p_perm
    return out


def is_flip(p_ref: np.ndarray, p_aligned: np.ndarray, tol: float = TIE_TOL) -> bool:
    """Top label changed, and the two labels are not tied under both orders."""
    a, b = int(np.argmax(p_ref)), int(np.argmax(p_aligned))
    if a == b:
        return False
    return bool(max(abs(p_ref[a] - p_ref[b]), abs(p_aligned[a] - p_aligned[b])) > tol)


# ----------------------------------------------------------------------------------------------
# order probe


def model_scorer(model, collator, *, device: Any = "cpu", batch_size: int = 32) -> ScoreFn:
    """Wrap a DecisionModel (``model(batch) -> [B, Kmax]`` logits) and a Collator as a ScoreFn."""
    import torch

    @torch.no_grad()
    def score(records: list[Record]) -> list[list[float]]:
        order = sorted(range(len(records)), key=lambda i: records[i].question.k)  # similar K per batch
        res: dict[int, list[float]] = {}
        for s in range(0, len(order), batch_size):
            idx = order[s:s + batch_size]
            chunk = [records[i] for i in idx]
            logits = model(collator(chunk).to(device)).float().cpu()
            for j, i in enumerate(idx):
                res[i] = logits[j, :records[i].question.k].tolist()
        return [res[i] for i in range(len(records))]

    return score


def _temperature_for(qtype: str, temperatures: Mapping[str, float] | float | None) -> float:
    if temperatures is None:
        return 1.0
    if isinstance(temperatures, (int, float)):
        return float(temperatures)
    return float(temperatures.get(qtype, 1.0))


def _order_block(rows: list[dict[str, Any]]) -> dict[str, Any]:
    comps = [c for r in rows for c in r["comparisons"]]
    out: dict[str, Any] = {
        "applicable": True,
        "n_rows": len(rows),
        "n_comparisons": len(comps),
        "flip_rate": _mean([float(c["flip"]) for c in comps]),
        "rows_with_flip": _mean([float(any(c["flip"] for c in r["comparisons"])) for r in rows]),
        "mean_tv": _mean([c["tv"] for c in comps]),
        "max_tv": max((c["tv"] for c in comps), default=None),
        "top_at_first": _mean([x for r in rows for x in r["top_at_first"]]),
        "top_at_first_uniform": _mean([1.0 / r["k"] for r in rows]),
    }
    by_kind: dict[str, list] = defaultdict(list)
    for c in comps:
        by_kind["reversal" if c["perm"] == "reversal" else "shift"].append(c)
    out["by_kind"] = {kind: {"n_comparisons": len(cs), "flip_rate": _mean([float(c["flip"]) for c in cs]),
                             "mean_tv": _mean([c["tv"] for c in cs])} for kind, cs in sorted(by_kind.items())}
    return out


def probe_order_scores(score_fn: ScoreFn, records: Sequence[Record], *, max_perms: int = 8,
                       temperatures: Mapping[str, float] | float | None = None,
                       keep_rows: bool = True) -> dict[str, Any]:
    """The order probe with any scorer ``score_fn(records) -> logits per record`` (see module doc)."""
    records = list(records)
    choice = [r for r in records if r.question.type == "choice"]
    plan: list[tuple[int, str, list[int]]] = []  # (record index in choice, perm name, perm)
    batch: list[Record] = []
    for i, rec in enumerate(choice):
        k = rec.question.k
        plan.append((i, "identity", list(range(k))))
        batch.append(rec)
        for name, perm in candidate_permutations(k, max_perms):
            plan.append((i, name, perm))
            batch.append(permute_choice(rec, perm))
    logits = list(score_fn(batch)) if batch else []
    if len(logits) != len(batch):
        raise ValueError(f"scorer returned {len(logits)} rows for {len(batch)} records")
    per_rec: dict[int, dict[str, Any]] = {}
    for (i, name, perm), z, rec in zip(plan, logits, batch):
        z = np.asarray(z, dtype=np.float64)
        if z.shape != (rec.question.k,):
            raise ValueError(f"record {rec.id!r}: scorer gave {z.shape} logits for {rec.question.k} candidates")
        p = softmax(z, _temperature_for("choice", temperatures))
        top_first = float(int(np.argmax(p)) == 0)
        if name == "identity":
            per_rec[i] = {"id": rec.id, "k": rec.question.k, "group": rec.group, "p_ref": p,
                          "top": rec.question.labels[int(np.argmax(p))], "comparisons": [],
                          "top_at_first": [top_first]}
            continue
        entry = per_rec[i]
        aligned = align(p, perm)
        orig_labels = choice[i].question.labels
        entry["comparisons"].append({
            "perm": name,
            "flip": is_flip(entry["p_ref"], aligned),
            "tv": total_variation(aligned, entry["p_ref"]),
            "top": orig_labels[int(np.argmax(aligned))],
        })
        entry["top_at_first"].append(top_first)
    rows = [per_rec[i] for i in range(len(choice))]
    per_type: dict[str, Any] = {}
    counts = defaultdict(int)
    for r in records:
        counts[r.question.type] += 1
    for t in QUESTION_TYPES:
        if t == "choice":
            per_type[t] = _order_block(rows) if rows else {"applicable": True, "n_rows": 0}
        else:
            per_type[t] = {"applicable": False, "n_rows": counts.get(t, 0), "reason": NOT_PERMUTED}
    by_k: dict[str, list] = defaultdict(list)
    for r in rows:
        by_k[k_bucket(r["k"])].append(r)
    out: dict[str, Any] = {
        "format": ORDER_FORMAT,
        "n_records": len(records),
        "max_perms": max_perms,
        "temperature_choice": _temperature_for("choice", temperatures),
        "tie_tolerance": TIE_TOL,
        "per_type": per_type,
        "choice_per_k_bucket": {b: _order_block(v) for b, v in sorted(by_k.items(), key=lambda kv: min(x["k"] for x in kv[1]))},
    }
    if keep_rows:
        out["rows"] = [{"id": r["id"], "k": r["k"], "top": r["top"],
                        "n_flips": sum(c["flip"] for c in r["comparisons"]),
                        "max_tv": max((c["tv"] for c in r["comparisons"]), default=0.0),
                        "comparisons": [{"perm": c["perm"], "flip": c["flip"], "tv": c["tv"], "top": c["top"]}
                                        for c in r["comparisons"]]} for r in rows]
    return out


def probe_order(model, records: Sequence[Record], collator, *, max_perms: int = 8, device: Any = "cpu",
                batch_size: int = 32, temperatures: Mapping[str, float] | float | None = None,
                keep_rows: bool = True) -> dict[str, Any]:
    """Order probe of a DecisionModel (``model(batch) -> logits``) with its Collator."""
    return probe_order_scores(model_scorer(model, collator, device=device, batch_size=batch_size), records,
                              max_perms=max_perms, temperatures=temperatures, keep_rows=keep_rows)


def load_run_model(run_dir: Path, *, placement: Any = None):
    """(merged model, temperatures, config) of a run: ``export/`` when present, else checkpoints/best."""
    run = Run(run_dir)
    config = run.config() if run.exists() else {}
    if (run.export_dir / "model.json").is_file():
        from rlcd.export import load_export

        model, meta = load_export(run.root, placement=placement)
        return model, dict(meta.get("temperatures") or {}), config
    from rlcd.export import load_checkpoint_model

    run = Run.open(run_dir)
    model, config, _ = load_checkpoint_model(run, "best", placement=placement)
    temps = {}
    if run.evaluation_path.is_file():
        temps = dict(json.loads(run.evaluation_path.read_text()).get("temperatures") or {})
    return model, temps, config


def probe_order_run(run_dir: Path, *, split: str = "test", limit: int | None = None, data_dir: Path | None = None,
                    max_perms: int = 8, calibrated: bool = False, batch_size: int = 32,
                    placement: Any = None) -> dict[str, Any]:
    """Load a run, read ``split`` of its data dir (or ``data_dir``) and run the order probe.

    ``limit`` keeps the first N choice records of the split (file order); other types are counted.
    """
    from rlcd.data.io import load_split

    run_dir = Path(run_dir)
    model, temps, config = load_run_model(run_dir, placement=placement)
    device = model.device
    if data_dir is None:
        if "data_dir" not in config:
            raise ValueError(f"{run_dir}/config.json names no data_dir; pass the processed data dir")
        data_dir = Path(config["data_dir"])
    data_dir = Path(data_dir)
    path = data_dir / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    records = load_split(data_dir, split)
    if limit is not None:
        kept, n_choice = [], 0
        for r in records:
            if r.question.type == "choice":
                if n_choice >= limit:
                    continue
                n_choice += 1
            kept.append(r)
        records = kept
    collator = model.collator(image_root=data_dir)
    out = probe_order(model, records, collator, max_perms=max_perms, device=device, batch_size=batch_size,
                      temperatures=temps if calibrated else None)
    out.update(run=str(run_dir), split=split, data_dir=str(data_dir), limit=limit, calibrated=calibrated,
               placement=model.placement)
    return out


# ----------------------------------------------------------------------------------------------
# noise probe


MAX_SHIFTS = 16


def noise_average(z: Sequence[float], sigma: float, samples: int, rng: np.random.Generator, *,
                  symmetrize: bool = True) -> np.ndarray:
    """mean softmax(z + eps), eps = sigma n - mean_k(sigma n), n ~ N(0, I), over ``samples`` draws (float64).

    With ``symmetrize`` every draw is also used with its coordinates cyclically shifted (all K
    shifts, or ``MAX_SHIFTS`` evenly spaced ones for larger K) and negated: the noise distribution
    is exchangeable and symmetric, so each variant has the same distribution and the estimate stays
    unbiased, but its Monte-Carlo error drops sharply (tied logits get exactly equal probabilities
    when all shifts are used). Without it, near-uniform rows show a spurious *upward* bias of the
    averaged max-prob of order sigma / sqrt(samples).
    """
    z = np.asarray(z, dtype=np.float64)
    k = z.size
    e = sigma * rng.standard_normal((samples, k))
    e = e - e.mean(axis=-1, keepdims=True)
    if symmetrize and k > 1:
        shifts = range(k) if k <= MAX_SHIFTS else np.unique(np.round(np.linspace(0, k - 1, MAX_SHIFTS)).astype(int))
        rolled = np.concatenate([np.roll(e, int(s), axis=1) for s in shifts], axis=0)
        e = np.concatenate([rolled, -rolled], axis=0)
    return softmax(z[None, :] + e).mean(axis=0)


def argmax_changed(p: np.ndarray, q: np.ndarray) -> bool:
    """argmax q differs from argmax p, and is not a candidate tied with p's top (p ties are no change)."""
    a, b = int(np.argmax(p)), int(np.argmax(q))
    return bool(a != b and p[b] < p[a])


def _noise_block(items: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "n": len(items),
        "mean_max_prob_noise_free": _mean([x["max_p"] for x in items]),
        "mean_max_prob_noise_averaged": _mean([x["max_q"] for x in items]),
        "mean_kl_averaged_to_free": _mean([x["kl_qp"] for x in items]),
        "mean_kl_free_to_averaged": _mean([x["kl_pq"] for x in items]),
        "argmax_change_rate": _mean([float(x["changed"]) for x in items]),
        "mean_target_max": _mean([x["t_max"] for x in items if x.get("t_max") is not None]),
        "nll_noise_free": _mean([x["nll_p"] for x in items if x.get("nll_p") is not None]),
        "nll_noise_averaged": _mean([x["nll_q"] for x in items if x.get("nll_q") is not None]),
    }
    if out["mean_max_prob_noise_free"] is not None:
        out["sharpening"] = out["mean_max_prob_noise_free"] - out["mean_max_prob_noise_averaged"]
    post = [x for x in items if x.get("post_nll_p") is not None]
    if post:
        out["posterior"] = {"n": len(post), "nll_noise_free": _mean([x["post_nll_p"] for x in post]),
                            "nll_noise_averaged": _mean([x["post_nll_q"] for x in post])}
    return out


def _xent(t: np.ndarray, p: np.ndarray) -> float:
    return float(-np.sum(t * np.log(np.maximum(p, 1e-12))))


def probe_noise(rows: Sequence[Mapping[str, Any]], sigma: float, *, samples: int = 128, seed: int = 0,
                symmetrize: bool = True, keep_rows: bool = False) -> dict[str, Any]:
    """Noise-free vs noise-averaged predictions of prediction rows ``{id, type, logits, target?, posterior?}``."""
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    rng = np.random.default_rng(seed)
    ordered = sorted(rows, key=lambda r: (str(r.get("id")), str(r.get("group"))))
    items = []
    for row in ordered:
        z = np.asarray(row["logits"], dtype=np.float64)
        if z.ndim != 1 or z.size < 1 or not np.all(np.isfinite(z)):
            raise ValueError(f"row {row.get('id')!r}: logits must be a finite 1-D list")
        p = softmax(z)
        q = noise_average(z, sigma, samples, rng, symmetrize=symmetrize)
        it: dict[str, Any] = {"id": row.get("id"), "type": row.get("type", "choice"), "k": int(z.size),
                              "max_p": float(p.max()), "max_q": float(q.max()), "kl_qp": kl(q, p), "kl_pq": kl(p, q),
                              "changed": argmax_changed(p, q)}
        t = row.get("target")
        if t is not None:
            t = np.asarray(t, dtype=np.float64)
            it.update(t_max=float(t.max()), nll_p=_xent(t, p), nll_q=_xent(t, q))
        post = row.get("posterior")
        if post is not None:
            post = np.asarray(post, dtype=np.float64)
            it.update(post_nll_p=_xent(post, p), post_nll_q=_xent(post, q))
        items.append(it)
    by_type: dict[str, list] = defaultdict(list)
    for it in items:
        by_type[it["type"]].append(it)
    order = [t for t in QUESTION_TYPES if t in by_type] + sorted(set(by_type) - set(QUESTION_TYPES))
    out: dict[str, Any] = {
        "format": NOISE_FORMAT,
        "sigma": float(sigma),
        "samples": int(samples),
        "seed": int(seed),
        "symmetrize": bool(symmetrize),
        "noise": "eps = sigma*n - mean_k(sigma*n), n ~ N(0, I), per row, numpy default_rng(seed), rows in id order"
                 + ("; each draw also used cyclically shifted and negated (antithetic)" if symmetrize else ""),
        "overall": _noise_block(items),
        "per_type": {t: _noise_block(by_type[t]) for t in order},
    }
    if keep_rows:
        out["rows"] = items
    return out


def probe_noise_run(run_dir: Path, sigma: float | None = None, *, split: str = "test", samples: int = 128,
                    seed: int = 0, symmetrize: bool = True, keep_rows: bool = False) -> dict[str, Any]:
    """The noise probe on ``run_dir/eval/predictions-<split>.jsonl``; sigma defaults to the run's."""
    from rlcd.report import read_jsonl

    run_dir = Path(run_dir)
    path = Run(run_dir).predictions_path(split)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run `rlcd evaluate {run_dir}` first")
    trained_sigma = trained_objective = None
    if Run(run_dir).exists():
        recipe = Run(run_dir).config().get("recipe", {})
        trained_sigma, trained_objective = recipe.get("sigma"), recipe.get("objective")
    if sigma is None:
        if trained_sigma is None:
            raise ValueError(f"{run_dir}/config.json has no recipe sigma; pass --sigma")
        sigma = float(trained_sigma)
    out = probe_noise(read_jsonl(path), sigma, samples=samples, seed=seed, symmetrize=symmetrize, keep_rows=keep_rows)
    out.update(run=str(run_dir), split=split, trained_sigma=trained_sigma, trained_objective=trained_objective)
    return out
