"""Probes of a trained run: option-order sensitivity and noise over-sharpening.

**Order probe** (``probe_order``). Each question is asked again with its options listed differently, and
the answer is mapped back to the question's own option order and compared with the answer as given. An
order ``perm`` lists original candidate indices in their new order: the asked question's candidate j shows
the *description* of original candidate ``perm[j]`` (``permute_record``), so the consistent answer is
``p'[j] = p[perm[j]]`` and the aligned answer is ``aligned[perm[j]] = p'[j]``. Per type:

- **choice**: label and description move together (``rlcd.data.sampling.shuffle_choice``). All K! - 1
  non-identity orders for K <= 4 (``ALL_ORDERS_MAX_K``), or when K! - 1 <= ``max_perms``; above, the
  reversal plus ``max_perms - 1`` other orders drawn without replacement from
  ``numpy.random.default_rng((seed, K, crc32(id)))`` (``candidate_permutations``), so each question's
  sample is a pure function of the seed and its id.
- **score**: the level descriptions reversed (level i shows the description of level K-1-i); mapped back
  level i <-> K-1-i.
- **noul**: the descriptions of false and true swapped; the consistent answer is the complement, so
  P(true) is compared with 1 - P'(true) (the aligned answer). A noul question whose criteria do not
  describe both, or describe both alike, has nothing to swap: it is counted as *not probed*, with the
  reason, never dropped silently.

Per comparison:

- **flip**: the top candidate of the aligned answer differs from the top as given, counted only when the
  two are not tied (probability difference > ``TIE_TOL`` under either order), so an exact tie broken by
  position is not a flip. For noul this is: the decision at 0.5 does not invert.
- **TV**: the total-variation distance ``0.5 * sum_k |aligned_k - p_k|``;
- **top at first** (choice, plain answers): how often the top candidate sits in the first position, over
  all scored orders, next to ``mean 1/K``, the rate of a position-blind model with distinct scores.

**Order votes** (``votes``, choice only; ``rlcd.order_votes``): with N votes a choice answer is
``log mean_o softmax(z_o)`` over the orders ``vote_orders(K, N)`` of the listing it is asked in, aligned
back (``order_votes.combine``, by ``vote_combine``: logmean by default, or mean). The voted answer under the original listing is compared with the voted
answer under each probe order (voted from that order's listing: asked orders ``perm[v[j]]``). N = 1 is the
plain answer; noul and score are never voted. Every distinct asked order of a question is scored once.

**Intervals**: the flip rate is the fraction of (question, order) comparisons that flip; its 95% interval is
a percentile bootstrap over whole cases (``rlcd.bootstrap``: ``case_id``, else the id prefix before ':'),
``resamples`` draws from ``default_rng(seed)``. Reported per type (and per vote count), for choice per K
bucket, and per question (type + instructions), highest flip rate first.

**Cost**: the asked records of a case share its ``case_id`` (``PROBE_CASE`` + id when it has none) and are
scored together, so with ``model_scorer`` (``case_scoring.score_records``) a case's state runs once and
every order of every question is a suffix on its cache.

Probabilities are ``softmax(logits / T)``, raw (T = 1) unless temperatures are given; flips do not
depend on T (a voted answer's T applies to its voted logits, as in ``rlcd evaluate``).

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
import zlib
from collections import defaultdict
from itertools import permutations as _all_orders
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rlcd.errors import OptionError
from rlcd.order_votes import DEFAULT_COMBINE, check_combine
from rlcd.run import Run
from rlcd.schema import QUESTION_TYPES, Record, text_of

ORDER_FORMAT = "rlcd.probe_order/2"
AS_ASKED = ("asked as written: these probes measure the model's own sensitivity to a question's form; "
            "`rlcd serve`, `rlcd evaluate` and every other path answer each question in its canonical form by "
            "default (docs/SERVING.md), so option order, duplicated options and a yes/no choice asked as a noul "
            "do not move the served answers")
NOISE_FORMAT = "rlcd.probe_noise/1"
TIE_TOL = 1e-9
ALL_ORDERS_MAX_K = 4  # choice questions up to this K are asked in all K! - 1 other orders
RESAMPLES = 1000
CONFIDENCE = 0.95
DEFAULT_VOTES = (1, 2)
MAX_QUESTIONS = 50  # question groups listed (highest flip rate first), each with its interval
PROBE_CASE = "probe-order/"  # the scoring case of a record without case_id (its orders share its state)
CASE_ROWS_PER_CALL = 4096  # asked records per scorer call (whole cases)
PROBES = {
    "choice": "other option orders (label and description move together)",
    "noul": "false/true descriptions swapped (consistent answer: the complement)",
    "score": "levels reversed (level i <-> K-1-i)",
}
NOUL_UNDESCRIBED = "noul criteria do not describe both false and true: no wording to swap"
NOUL_ALIKE = "noul criteria describe false and true alike: swapping changes nothing"
VOTES_CHOICE_ONLY = "order votes apply to choice only"

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
# orders


def perm_name(perm: Sequence[int]) -> str:
    """``reversal``, ``shiftS`` (original ``(j + S) % K`` at position j) or ``order:2,0,1``."""
    k = len(perm)
    p = [int(i) for i in perm]
    if p == list(range(k - 1, -1, -1)):
        return "reversal"
    for s in range(1, k):
        if p == [(j + s) % k for j in range(k)]:
            return f"shift{s}"
    return "order:" + ",".join(map(str, p))


def all_orders(k: int, max_perms: int = 8) -> bool:
    """Whether a K-option choice question is asked in all its K! - 1 other orders (else a sample)."""
    return k <= ALL_ORDERS_MAX_K or math.factorial(k) - 1 <= max_perms


def candidate_permutations(k: int, max_perms: int = 8, seed: int | Sequence[int] = 0) -> list[tuple[str, list[int]]]:
    """Non-identity probe orders of K choice options: ``[(name, perm), ...]``, ``perm[j]`` the original index at j.

    ``all_orders(k, max_perms)``: every non-identity order, lexicographic. Otherwise the reversal first, then
    ``max_perms - 1`` further distinct orders, each ``rng.permutation(k)`` with ``rng = default_rng(seed)``
    (identity, the reversal and repeats skipped): a seeded sample, reproducible for the same (k, max_perms, seed).
    """
    if k < 2:
        return []
    if max_perms < 1:
        raise ValueError(f"max_perms must be >= 1, got {max_perms}")
    ident = tuple(range(k))
    if all_orders(k, max_perms):
        return [(perm_name(p), list(p)) for p in _all_orders(range(k)) if p != ident]
    rev = ident[::-1]
    out = [("reversal", list(rev))]
    seen = {ident, rev}
    rng = np.random.default_rng(seed)
    while len(out) < max_perms:
        p = tuple(int(i) for i in rng.permutation(k))
        if p not in seen:
            seen.add(p)
            out.append((perm_name(p), list(p)))
    return out


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


def permute_record(record: Record, perm: Sequence[int]) -> Record:
    """The record asked with candidate j showing the description of original candidate ``perm[j]``.

    choice: ``permute_choice`` (labels move with their descriptions). score: the level descriptions in
    order ``perm`` (levels keep their index). noul: the false/true descriptions in order ``perm`` (``[1, 0]``
    swaps them). Target and posterior move with the descriptions, so they stay the consistent answer."""
    q = record.question
    if q.type == "choice":
        return permute_choice(record, perm)
    perm = [int(i) for i in perm]
    if sorted(perm) != list(range(q.k)):
        raise ValueError(f"record {record.id!r}: {perm} is not a permutation of {q.k} candidates")
    desc = q.descriptions()
    if q.type == "score":
        criteria: Any = [desc[i] for i in perm]
    else:
        criteria = {lab: desc[i] for lab, i in zip(q.labels, perm) if desc[i] is not None}
    update: dict[str, Any] = {"question": q.model_copy(update={"criteria": criteria}),
                              "target": [record.target[i] for i in perm]}
    if record.posterior is not None:
        update["posterior"] = [record.posterior[i] for i in perm]
    return record.model_copy(update=update)


def noul_unswappable(question: Any) -> str | None:
    """Why a noul question cannot be asked with its wording swapped (None when it can)."""
    c = question.criteria if isinstance(question.criteria, dict) else {}
    f, t = (c.get("false") or "").strip(), (c.get("true") or "").strip()
    if not f or not t:
        return NOUL_UNDESCRIBED
    return NOUL_ALIKE if f == t else None


def probe_orders(record: Record, max_perms: int = 8, seed: int = 0) -> tuple[str, list[tuple[str, list[int]]]] | str:
    """(how, [(name, perm), ...]) of the orders a record is probed in, or the reason it is not probed."""
    q = record.question
    if q.type == "choice":
        how = "all" if all_orders(q.k, max_perms) else "sampled"
        return how, candidate_permutations(q.k, max_perms, (int(seed), q.k, zlib.crc32(record.id.encode("utf-8"))))
    if q.type == "score":
        return "reversed", [("reversal", list(range(q.k - 1, -1, -1)))]
    why = noul_unswappable(q)
    return why if why is not None else ("swapped", [("swap", [1, 0])])


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


def percentile_interval(samples: np.ndarray, confidence: float = CONFIDENCE) -> list[float] | None:
    s = np.asarray(samples, dtype=np.float64)
    s = s[np.isfinite(s)]
    if s.size == 0:
        return None
    a = 1.0 - confidence
    lo, hi = np.quantile(s, [a / 2, 1 - a / 2])
    return [float(lo), float(hi)]


def flip_interval(flips: Sequence[float], groups: Sequence[str], *, resamples: int = RESAMPLES,
                  seed: int = 0) -> list[float] | None:
    """95% percentile interval of the flip rate, resampling whole cases (``bootstrap.bootstrap_means``)."""
    from rlcd.bootstrap import bootstrap_means

    if not len(flips):
        return None
    return percentile_interval(bootstrap_means(np.asarray(flips, dtype=np.float64), resamples=resamples, seed=seed,
                                               groups=np.asarray(list(groups), dtype=object).astype(str)))


# ----------------------------------------------------------------------------------------------
# order probe


def model_scorer(model, collator, *, device: Any = "cpu", batch_size: int = 32, shared: bool = True) -> ScoreFn:
    """Wrap a DecisionModel (``model(batch) -> [B, Kmax]`` logits) and a Collator as a ScoreFn.

    ``shared`` (default) and a DecisionModel (a model that scores cases): each case's state runs
    once and its records as suffixes on its cache (``case_scoring.score_records``, at most max(batch_size, 64)
    rows per call); else every record as a full row through the collator, records of similar K together."""
    import torch

    from rlcd.model.decision import DecisionModel

    if shared and isinstance(model, DecisionModel):
        from rlcd.model.case_scoring import score_records

        def score_cases(records: list[Record]) -> list[list[float]]:
            logits = score_records(model, records, image_root=getattr(collator, "image_root", None),
                                   max_rows=max(batch_size, 64))
            return [lg.float().tolist() for lg in logits]

        return score_cases

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


def check_vote_list(votes: Sequence[int] | int) -> list[int]:
    """Vote counts to report: sorted, unique, each 1..MAX_VOTES, with 1 (the plain answer) always included."""
    from rlcd.order_votes import check_votes

    items = [votes] if isinstance(votes, int) else list(votes)
    return sorted({1, *(check_votes(n) for n in items)})


def _compose(perm: Sequence[int], vote: Sequence[int]) -> tuple[int, ...]:
    """The order asked when the listing ``perm`` is itself asked in vote order ``vote``: position j shows
    original candidate ``perm[vote[j]]``."""
    return tuple(int(perm[v]) for v in vote)


def _vote_sets(k: int, qtype: str, votes: Sequence[int]) -> dict[int, list[list[int]]]:
    from rlcd.order_votes import vote_orders

    return {n: vote_orders(k, n) for n in (votes if qtype == "choice" else [1])}


def _plan_item(rec: Record, max_perms: int, seed: int, votes: Sequence[int]) -> dict[str, Any] | str:
    """What one record is asked: its probe orders and every distinct asked order (identity first)."""
    got = probe_orders(rec, max_perms, seed)
    if isinstance(got, str):
        return got
    how, perms = got
    k = rec.question.k
    ident = list(range(k))
    vote_sets = _vote_sets(k, rec.question.type, votes)
    asked: dict[tuple[int, ...], int] = {tuple(ident): 0}
    for pi in [ident] + [p for _, p in perms]:
        for orders in vote_sets.values():
            for v in orders:
                asked.setdefault(_compose(pi, v), len(asked))
    return {"rec": rec, "how": how, "perms": perms, "votes": vote_sets, "asked": list(asked)}


def _score_plan(score_fn: ScoreFn, items: list[dict[str, Any]]) -> None:
    """Score every item's asked orders, a case's records together (one scorer call holds whole cases);
    sets ``item["z"] = {order: logits}``."""
    by_case: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for it in items:
        rec = it["rec"]
        by_case[rec.case_id if rec.case_id is not None else PROBE_CASE + rec.id].append(it)
    batch: list[Record] = []
    owners: list[tuple[dict[str, Any], tuple[int, ...]]] = []

    def flush() -> None:
        if not batch:
            return
        logits = list(score_fn(list(batch)))
        if len(logits) != len(batch):
            raise ValueError(f"scorer returned {len(logits)} rows for {len(batch)} records")
        for (it, order), z, asked in zip(owners, logits, batch):
            z = np.asarray(z, dtype=np.float64)
            if z.shape != (asked.question.k,):
                raise ValueError(f"record {asked.id!r}: scorer gave {z.shape} logits for {asked.question.k} candidates")
            it["z"][order] = z
        batch.clear()
        owners.clear()

    for case, case_items in by_case.items():
        n = sum(len(it["asked"]) for it in case_items)
        if batch and len(batch) + n > CASE_ROWS_PER_CALL:
            flush()
        for it in case_items:
            rec, ident = it["rec"], tuple(range(it["rec"].question.k))
            it["z"] = {}
            for j, order in enumerate(it["asked"]):
                asked = rec if order == ident else permute_record(rec, order)
                rid = rec.id if j == 0 else f"{rec.id}#probe-{j}"
                batch.append(asked.model_copy(update={"case_id": case, "id": rid}))
                owners.append((it, order))
    flush()


def _answer(it: dict[str, Any], perm: Sequence[int], n: int, temperature: float) -> np.ndarray:
    """The answer (original candidate order) to the question listed as ``perm``, voted over n orders."""
    from rlcd.order_votes import combine

    orders = [_compose(perm, v) for v in it["votes"][n]]
    if len(orders) == 1:
        return align(softmax(it["z"][orders[0]], temperature), orders[0])
    return softmax(np.asarray(combine([it["z"][o] for o in orders], orders, it.get("combine", DEFAULT_COMBINE))), temperature)


def _evaluate_item(it: dict[str, Any], temperature: float) -> dict[str, Any]:
    rec = it["rec"]
    q = rec.question
    ident = list(range(q.k))
    out: dict[str, Any] = {"id": rec.id, "type": q.type, "k": q.k, "orders": it["how"],
                           "question": text_of(q.instructions), "by_votes": {}}
    for n in it["votes"]:
        p_ref = _answer(it, ident, n, temperature)
        comps = []
        for name, perm in it["perms"]:
            aligned = _answer(it, perm, n, temperature)
            comps.append({"perm": name, "flip": is_flip(p_ref, aligned), "tv": total_variation(aligned, p_ref),
                          "top": q.labels[int(np.argmax(aligned))]})
        out["by_votes"][n] = {"top": q.labels[int(np.argmax(p_ref))], "comparisons": comps}
    if q.type == "choice":
        shown = [ident] + [p for _, p in it["perms"]]
        out["top_at_first"] = [float(int(np.argmax(it["z"][tuple(p)])) == 0) for p in shown]
    return out


def _order_block(rows: list[dict[str, Any]], n: int, *, resamples: int, seed: int) -> dict[str, Any]:
    """Flip rate [95% case-bootstrap interval], TV and counts of the rows' comparisons under n votes."""
    comps = [(r["case"], c) for r in rows for c in r["by_votes"][n]["comparisons"]]
    flips = [float(c["flip"]) for _, c in comps]
    out: dict[str, Any] = {
        "applicable": True,
        "n_rows": len(rows),
        "n_cases": len({r["case"] for r in rows}),
        "n_comparisons": len(comps),
        "flip_rate": _mean(flips),
        "flip_rate95": flip_interval(flips, [g for g, _ in comps], resamples=resamples, seed=seed),
        "rows_with_flip": _mean([float(any(c["flip"] for c in r["by_votes"][n]["comparisons"])) for r in rows]),
        "mean_tv": _mean([c["tv"] for _, c in comps]),
        "max_tv": max((c["tv"] for _, c in comps), default=None),
    }
    if n == 1 and rows and all("top_at_first" in r for r in rows):
        out["top_at_first"] = _mean([x for r in rows for x in r["top_at_first"]])
        out["top_at_first_uniform"] = _mean([1.0 / r["k"] for r in rows])
    by_kind: dict[str, list] = defaultdict(list)
    for _, c in comps:
        by_kind["reversal" if c["perm"] == "reversal" else "shift" if c["perm"].startswith("shift") else
                "other" if c["perm"].startswith("order:") else c["perm"]].append(c)
    out["by_kind"] = {kind: {"n_comparisons": len(cs), "flip_rate": _mean([float(c["flip"]) for c in cs]),
                             "mean_tv": _mean([c["tv"] for c in cs])} for kind, cs in sorted(by_kind.items())}
    return out


def _with_votes(rows: list[dict[str, Any]], votes: Sequence[int], **kw: Any) -> dict[str, Any]:
    """The plain block (old keys at the top level) and, for choice, one block per vote count N > 1."""
    block = _order_block(rows, 1, **kw)
    block["votes"] = {str(n): _order_block(rows, n, **kw) for n in votes if n > 1}
    return block


def _question_table(rows: list[dict[str, Any]], votes: Sequence[int], *, resamples: int, seed: int) -> list[dict]:
    """Per question (type + instructions): flip rate [95%] per vote count, highest plain flip rate first."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["type"], r["question"])].append(r)

    def rate(rs: list[dict[str, Any]]) -> float:
        fl = [float(c["flip"]) for r in rs for c in r["by_votes"][1]["comparisons"]]
        return math.fsum(fl) / len(fl) if fl else 0.0

    ranked = sorted(groups.items(), key=lambda kv: (-rate(kv[1]), -len(kv[1]), kv[0]))[:MAX_QUESTIONS]
    out = []
    for (qtype, text), rs in ranked:
        plain = _order_block(rs, 1, resamples=resamples, seed=seed)
        entry = {"type": qtype, "instructions": text, **{k: plain[k] for k in (
            "n_rows", "n_cases", "n_comparisons", "flip_rate", "flip_rate95", "mean_tv")}}
        if qtype == "choice":
            entry["votes"] = {}
            for n in votes:
                if n > 1:
                    b = _order_block(rs, n, resamples=resamples, seed=seed)
                    entry["votes"][str(n)] = {k: b[k] for k in ("flip_rate", "flip_rate95", "mean_tv")}
        out.append(entry)
    return out


def probe_order_scores(score_fn: ScoreFn, records: Sequence[Record], *, max_perms: int = 8,
                       votes: Sequence[int] | int = DEFAULT_VOTES, vote_combine: str = DEFAULT_COMBINE,
                       temperatures: Mapping[str, float] | float | None = None, resamples: int = RESAMPLES,
                       seed: int = 0, keep_rows: bool = True) -> dict[str, Any]:
    """The order probe with any scorer ``score_fn(records) -> logits per record`` (see module doc).

    Every record read is either probed or listed in ``not_probed`` with its reason; ``counts`` per type say
    ``read == probed + not_probed``."""
    from rlcd.bootstrap import group_key

    records = list(records)
    vote_list = check_vote_list(votes)
    check_combine(vote_combine)
    if max_perms < 1:
        raise ValueError(f"max_perms must be >= 1, got {max_perms}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    items, not_probed = [], []
    for rec in records:
        it = _plan_item(rec, max_perms, seed, vote_list)
        if isinstance(it, str):
            not_probed.append({"id": rec.id, "type": rec.question.type, "reason": it})
        else:
            items.append({**it, "combine": vote_combine})
    _score_plan(score_fn, items)
    rows = []
    for it in items:
        row = _evaluate_item(it, _temperature_for(it["rec"].question.type, temperatures))
        row["case"] = group_key({"id": it["rec"].id, "case_id": it["rec"].case_id})
        rows.append(row)
    kw = {"resamples": resamples, "seed": seed}
    per_type: dict[str, Any] = {}
    counts: dict[str, Any] = {}
    for t in QUESTION_TYPES:
        rs = [r for r in rows if r["type"] == t]
        skipped = [x for x in not_probed if x["type"] == t]
        reasons: dict[str, int] = defaultdict(int)
        for x in skipped:
            reasons[x["reason"]] += 1
        counts[t] = {"read": len(rs) + len(skipped), "probed": len(rs), "not_probed": len(skipped),
                     "reasons": dict(reasons)}
        block = (_with_votes(rs, vote_list, **kw) if t == "choice" else _order_block(rs, 1, **kw)) if rs else {
            "applicable": True, "n_rows": 0, "n_cases": 0, "n_comparisons": 0, "flip_rate": None, "flip_rate95": None}
        if t != "choice":
            block["votes"] = VOTES_CHOICE_ONLY
        block.update(probe=PROBES[t], n_not_probed=len(skipped), not_probed_reasons=dict(reasons))
        per_type[t] = block
    choice = [r for r in rows if r["type"] == "choice"]
    by_k: dict[str, list] = defaultdict(list)
    for r in choice:
        by_k[k_bucket(r["k"])].append(r)
    out: dict[str, Any] = {
        "format": ORDER_FORMAT,
        "requests": "as_asked", "requests_note": AS_ASKED,
        "n_records": len(records),
        "max_perms": max_perms,
        "votes": vote_list,
        "vote_combine": vote_combine,
        "seed": seed,
        "resamples": resamples,
        "confidence": CONFIDENCE,
        "temperature_choice": _temperature_for("choice", temperatures),
        "temperatures": {t: _temperature_for(t, temperatures) for t in QUESTION_TYPES},
        "tie_tolerance": TIE_TOL,
        "orders": {
            "choice": f"all K!-1 non-identity orders for K <= {ALL_ORDERS_MAX_K} (or K!-1 <= max_perms); above, the "
                      f"reversal and {max_perms - 1} other orders drawn from default_rng((seed, K, crc32(id)))",
            "score": PROBES["score"], "noul": PROBES["noul"],
        },
        "choice_orders": {"all": sum(r["orders"] == "all" for r in choice),
                          "sampled": sum(r["orders"] == "sampled" for r in choice)},
        "counts": counts,
        "per_type": per_type,
        "choice_per_k_bucket": {b: _with_votes(v, vote_list, **kw)
                                for b, v in sorted(by_k.items(), key=lambda kv: min(x["k"] for x in kv[1]))},
        "questions": _question_table(rows, vote_list, **kw),
        "n_question_groups": len({(r["type"], r["question"]) for r in rows}),
        "not_probed": not_probed,
    }
    if keep_rows:
        out["rows"] = []
        for r in rows:
            plain = r["by_votes"][1]
            row = {"id": r["id"], "type": r["type"], "k": r["k"], "case": r["case"], "orders": r["orders"],
                   "top": plain["top"], "n_flips": sum(c["flip"] for c in plain["comparisons"]),
                   "max_tv": max((c["tv"] for c in plain["comparisons"]), default=0.0),
                   "comparisons": plain["comparisons"]}
            if len(r["by_votes"]) > 1:
                row["n_flips_by_votes"] = {str(n): sum(c["flip"] for c in b["comparisons"])
                                           for n, b in r["by_votes"].items()}
            out["rows"].append(row)
    return out


def probe_order(model, records: Sequence[Record], collator, *, max_perms: int = 8, device: Any = "cpu",
                batch_size: int = 32, temperatures: Mapping[str, float] | float | None = None,
                votes: Sequence[int] | int = DEFAULT_VOTES, resamples: int = RESAMPLES, seed: int = 0,
                keep_rows: bool = True, shared: bool = True, vote_combine: str = DEFAULT_COMBINE) -> dict[str, Any]:
    """Order probe of a DecisionModel (``model(batch) -> logits``) with its Collator (``model_scorer``)."""
    return probe_order_scores(model_scorer(model, collator, device=device, batch_size=batch_size, shared=shared),
                              records, max_perms=max_perms, temperatures=temperatures, votes=votes,
                              resamples=resamples, seed=seed, keep_rows=keep_rows, vote_combine=vote_combine)


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


def scored_checkpoint(run_dir: Path) -> str | None:
    """sha256 of the weights the probe scores (``export/model.json``'s, else checkpoints/best's; None if unknown),
    so that the report can tell a probe of another checkpoint from one of the evaluated model."""
    run = Run(run_dir)
    try:
        if (run.export_dir / "model.json").is_file():
            from rlcd.export import read_export_meta

            return read_export_meta(run.export_dir).get("checkpoint_sha256")
        from rlcd import checkpoint

        return checkpoint.weights_sha256(run.checkpoint("best"))
    except (OSError, ValueError, KeyError):
        return None


def first_per_type(records: Sequence[Record], limit: int | None) -> list[Record]:
    """The first ``limit`` records of each question type (file order kept); all when ``limit`` is None."""
    if limit is None:
        return list(records)
    seen: dict[str, int] = defaultdict(int)
    kept = []
    for r in records:
        if seen[r.question.type] < limit:
            seen[r.question.type] += 1
            kept.append(r)
    return kept


def check_probe_order_options(*, limit: int | None, max_perms: int, votes: Sequence[int] | int, resamples: int,
                              batch_size: int) -> list[int]:
    """The probe's options as the command line names them, checked before anything loads; returns the vote list."""
    from rlcd.errors import OptionError
    from rlcd.order_votes import MAX_VOTES

    if limit is not None and limit < 1:
        raise OptionError(f"--limit {limit}: give the number of questions of each type to probe, 1 or more (leave it "
                          "out for all)")
    for flag, value in (("--max-perms", max_perms), ("--resamples", resamples), ("--batch-size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise OptionError(f"{flag} {value}: give a whole number, 1 or more")
    items = [votes] if isinstance(votes, int) else list(votes)
    for n in items:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_VOTES:
            raise OptionError(f"--order-votes {n}: each vote count is a whole number from 1 (the plain answer) to "
                              f"{MAX_VOTES} (the orders a choice question is asked in)")
    return check_vote_list(items)


def probe_order_run(run_dir: Path, *, split: str = "test", limit: int | None = None, data_dir: Path | None = None,
                    max_perms: int = 8, calibrated: bool = False, batch_size: int = 32, placement: Any = None,
                    votes: Sequence[int] | int = DEFAULT_VOTES, resamples: int = RESAMPLES, seed: int = 0,
                    save: bool = True, vote_combine: str = DEFAULT_COMBINE) -> dict[str, Any]:
    """Load a run, read ``split`` of its data dir (or ``data_dir``) and run the order probe.

    ``limit`` keeps the first N records of each type (file order). Scoring the run's own test split (``split``
    test, its own data dir) with ``save`` also writes the result to ``RUN/eval/probe-order.json``, where the
    report finds it (``saved`` in the result names the file).

    Every option, the run and the split's rows are checked before the model loads (`check_probe_order_options`,
    then the data): a mistake is one `OptionError` / `RunError` naming the flag, and nothing is written -- an
    earlier probe-order.json is never replaced by a probe of no rows.
    """
    from rlcd.data.io import load_split
    from rlcd.errors import RunError

    check_probe_order_options(limit=limit, max_perms=max_perms, votes=votes, resamples=resamples,
                              batch_size=batch_size)
    run_dir = Path(run_dir)
    run = Run(run_dir)
    if not run_dir.is_dir():
        raise RunError(f"{run_dir}: no such run directory")
    if not (run.export_dir / "model.json").is_file() and not run.exists():
        raise RunError(f"{run_dir}: not a run (no config.json, no export/model.json)")
    own = run.config().get("data_dir") if run.exists() else None
    if data_dir is None:
        if own is None:
            raise OptionError(f"{run_dir}/config.json names no data_dir; pass the processed data dir with --data")
        data_dir = Path(own)
    data_dir = Path(data_dir)
    path = data_dir / f"{split}.jsonl"
    if not path.is_file():
        raise RunError(f"{path} does not exist (--split {split} of {data_dir})")
    records = first_per_type([r for r in load_split(data_dir, split) if r.derived is None], limit)  # originals
    if not records:
        raise RunError(f"{path} has no rows to probe")
    model, temps, config = load_run_model(run_dir, placement=placement)
    device = model.device
    collator = model.collator(image_root=data_dir)
    out = probe_order(model, records, collator, max_perms=max_perms, device=device, batch_size=batch_size,
                      temperatures=temps if calibrated else None, votes=votes, resamples=resamples, seed=seed,
                      vote_combine=vote_combine)
    out.update(run=str(run_dir), split=split, data_dir=str(data_dir), limit=limit, calibrated=calibrated,
               placement=model.placement, checkpoint_sha256=scored_checkpoint(run_dir), saved=None)
    if save and split == "test" and own is not None and data_dir.resolve() == Path(own).resolve():
        target = Run(run_dir).probe_order_path
        out["saved"] = str(target)
        write_json_atomic(target, out)
    return out


def write_json_atomic(path: Path, obj: Any) -> None:
    """``rlcd.metrics.dumps(obj)`` to ``path`` through a temporary file and a rename (never half-written)."""
    from rlcd.metrics import dumps

    from rlcd.files import write_atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, dumps(obj), durable=False)


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
