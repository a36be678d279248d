"""Eligible pools and the deterministic training sampler.

* `eligible_pool` / `dev_subset`: per sampling group (`source/language/task`) the first `cap` ids in
  sha256 order of the id. The order depends on the ids alone, so a run can freeze the lists and
  any later run over the same records picks the same rows.
* `microbatch(pool, seed, index)`: each example draws a group uniformly (groups sorted by name),
  then a row of that group uniformly, with replacement, plus a permutation seed. The draw comes
  from `numpy.random.default_rng([seed, index])` alone, so a resumed run continues the same stream
  from its absolute microbatch index.
* `Sampler.case_microbatch(seed, index)` (`Recipe.batch_by = "case"`): the same micro-batch filled with
  whole cases instead of single rows (see its docstring for the split rule).
* Derived forms (`Recipe.forms = "derived"`, rows of `rlcd data derive`): `eligible_pool` and `dev_subset`
  never take a derived row (the pinned recipe trains and selects on original rows); `derived_pool` holds them
  per (sampling group, form), and a Sampler given one fills `derived_slots` rows of each micro-batch from it
  (see `derived_slots` for the share and why).
* `shuffle_choice`: permutes a choice question's candidates together with target and posterior,
  so the model cannot learn a position prior; noul and score keep their fixed order.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from rlcd.schema import Record

TRAIN_CAP = 6000
DEV_CAP = 256


def hash_order_key(record_id: str) -> str:
    """Sort key of an id: its sha256 (stable across machines and Python versions)."""
    return hashlib.sha256(record_id.encode("utf-8")).hexdigest()


def _capped_by_group(records: Iterable[Record], cap: int) -> dict[str, list[str]]:
    by_group: dict[str, list[str]] = defaultdict(list)
    for r in records:
        if r.derived is None:
            by_group[r.sampling_group].append(r.id)
    return {g: sorted(ids, key=hash_order_key)[:cap] for g, ids in sorted(by_group.items())}


def derived_pool(records: Iterable[Record], cap: int = TRAIN_CAP) -> dict[str, list[str]]:
    """Derived rows per `<sampling group>|<form>`, at most `cap` ids each in hash order (pass the train split).
    Keyed by form so that a form with many instances per row (is_option, ...) is drawn as often as one with one."""
    by_key: dict[str, list[str]] = defaultdict(list)
    for r in records:
        if r.derived is not None:
            by_key[f"{r.sampling_group}|{r.derived['form']}"].append(r.id)
    return {k: sorted(ids, key=hash_order_key)[:cap] for k, ids in sorted(by_key.items())}


def derived_slots(size: int, share: float) -> int:
    """Rows of a `size`-row micro-batch drawn from derived forms: ``min(size - 1, max(1, round(share * size)))``.

    A fixed count, not a coin per row, so every micro-batch holds the share exactly (8 rows, share 0.25: 2 derived
    rows, 8 of the 32 of an update) and the base rows' gradient noise does not vary with it. Why 0.25: the
    derived rows outnumber the original ones about 7 to 1 (`rlcd data derive` on the demo: 2,474 derived for 360
    base rows), so drawing in proportion would make original forms a ninth of training; the original-form
    calibrated gap is the result that must not get worse, so original rows keep three quarters of every batch,
    while a quarter still shows each form (16 forms over 4 groups) about every other update. At least one row of
    each kind is kept."""
    return min(size - 1, max(1, round(share * size)))


def eligible_pool(records: Iterable[Record], cap: int = TRAIN_CAP) -> dict[str, list[str]]:
    """Training pool: per sampling group, at most `cap` ids in hash order (pass the train split)."""
    return _capped_by_group(records, cap)


def dev_subset(records: Iterable[Record], cap: int = DEV_CAP) -> dict[str, list[str]]:
    """Fixed dev subset: per sampling group, at most `cap` ids in hash order (pass the dev split)."""
    return _capped_by_group(records, cap)


@dataclass(frozen=True)
class Draw:
    """One sampled example: which group, which row, and the seed for its candidate permutation."""

    group: str
    id: str
    perm_seed: int


class Sampler:
    """Precomputes the pool once so that each microbatch costs one small RNG call.

    `case_of` (id -> case key; ids it lacks are one-row cases) is needed by `case_microbatch` only.
    `derived` (`derived_pool`) with `share`: each micro-batch takes `derived_slots(size, share)` rows from it
    (`_derived_draws`); without it (the pinned recipe) the draws are exactly those of the base pool alone."""

    def __init__(self, pool: dict[str, list[str]], case_of: dict[str, str | None] | None = None,
                 derived: dict[str, list[str]] | None = None, share: float = 0.0):
        self.derived_keys = sorted(k for k, ids in (derived or {}).items() if ids)
        self.derived_ids = [list(derived[k]) for k in self.derived_keys] if derived else []
        self.share = share
        if derived is not None and not self.derived_keys:
            raise ValueError("the derived pool has no rows")
        self.derived_by_case: dict[str, list[str]] = defaultdict(list)
        if derived is not None and case_of is not None:
            for ids in self.derived_ids:
                for i in ids:
                    if case_of.get(i) is not None:
                        self.derived_by_case[case_of[i]].append(i)
        self.case_of = case_of or {}
        self.groups = sorted(g for g, ids in pool.items() if ids)
        if not self.groups:
            raise ValueError("the pool has no rows: every group is empty")
        self.ids = [list(pool[g]) for g in self.groups]
        self.sizes = np.array([len(ids) for ids in self.ids], dtype=np.float64)
        self.cases: list[list[list[str]]] | None = None
        if case_of is not None:
            self.cases = []
            for ids in self.ids:  # per group: its cases in first-row pool order, each case's rows in pool order
                by_case: dict[str, list[str]] = {}
                for i in ids:
                    key = case_of.get(i)
                    by_case.setdefault(("case", key) if key is not None else ("row", i), []).append(i)
                self.cases.append(list(by_case.values()))

    def case_microbatch(self, seed: int, index: int, size: int = 8) -> list[list[Draw]]:
        """Micro-batch `index` as whole cases: a list of cases, each a list of draws (`size` draws in all).

        A pure function of (pool, seed, index), from `numpy.random.default_rng([seed, index, 1])` (a stream
        apart from `microbatch`'s). Repeat until `size` rows are taken: draw a group uniformly, then one
        of its cases uniformly (with replacement; a case is its rows of that group in the pool), then a
        random order of the case's rows and one permutation seed per row. Split rule: a case with more
        rows than the room left contributes the first `room` rows of its random order and the rest is
        not used by this draw -- carrying it into the next micro-batch would make a micro-batch depend
        on the one before, breaking the (seed, index) stream that resume and DDP rely on. So a case
        larger than `size` always arrives as a random `size`-row chunk of itself.
        """
        if self.cases is None:
            raise ValueError("this Sampler was built without case_of: it cannot draw whole cases")
        rng = np.random.default_rng([seed, index, 1])
        out: list[list[Draw]] = []
        n_derived = derived_slots(size, self.share) if self.derived_keys else 0
        room = size - n_derived
        while room > 0:
            gi = int(rng.random() * len(self.groups))
            cases = self.cases[gi]
            rows = cases[int(rng.random() * len(cases))]
            take = rng.permutation(len(rows))[:room].tolist()
            perm = rng.integers(0, 2**32, size=len(take), dtype=np.uint64).tolist()
            out.append([Draw(self.groups[gi], rows[i], p) for i, p in zip(take, perm)])
            room -= len(take)
        if n_derived:
            self._derived_into_cases(out, seed, index, n_derived)
        return out

    def _derived_into_cases(self, cases: list[list[Draw]], seed: int, index: int, n: int) -> None:
        """Add `n` derived rows to a case micro-batch: drawn uniformly (with replacement) among the derived rows of
        the cases already in it, each joining its case (its state is forwarded once); when those cases have none,
        `_derived_draws` rows as one-row cases. From `default_rng([seed, index, 3])`."""
        rng = np.random.default_rng([seed, index, 3])
        keys = [self.case_of.get(c[0].id) for c in cases]
        pool = [(j, i) for j, key in enumerate(keys) if key is not None for i in self.derived_by_case.get(key, ())]
        if not pool:
            cases.extend([d] for d in self._derived_draws(seed, index, n))
            return
        picks = (rng.random(n) * len(pool)).astype(np.int64).tolist()
        perm = rng.integers(0, 2**32, size=n, dtype=np.uint64).tolist()
        for pick, p in zip(picks, perm):
            j, rid = pool[pick]
            cases[j].append(Draw(cases[j][0].group, rid, p))

    def _derived_draws(self, seed: int, index: int, n: int) -> list[Draw]:
        """`n` derived rows from `default_rng([seed, index, 2])` (a stream apart from the base draws): a
        (group, form) key uniformly, then a row of it uniformly, with replacement; `group` is the sampling group."""
        rng = np.random.default_rng([seed, index, 2])
        u = rng.random((2, n))
        perm = rng.integers(0, 2**32, size=n, dtype=np.uint64).tolist()
        ki = (u[0] * len(self.derived_keys)).astype(np.int64).tolist()
        return [Draw(self.derived_keys[k].split("|", 1)[0], self.derived_ids[k][int(v * len(self.derived_ids[k]))], p)
                for k, v, p in zip(ki, u[1].tolist(), perm)]

    def microbatch(self, seed: int, index: int, size: int = 8) -> list[Draw]:
        """The `size` draws of microbatch `index`: a pure function of (pool, seed, index). With a derived pool the
        last `derived_slots(size, share)` draws are derived rows (`_derived_draws`), the others base rows."""
        if self.derived_keys:
            n = derived_slots(size, self.share)
            return self._base_draws(seed, index, size - n) + self._derived_draws(seed, index, n)
        return self._base_draws(seed, index, size)

    def _base_draws(self, seed: int, index: int, size: int) -> list[Draw]:
        rng = np.random.default_rng([seed, index])
        u = rng.random((2, size))
        perm = rng.integers(0, 2**32, size=size, dtype=np.uint64).tolist()
        gi = (u[0] * len(self.groups)).astype(np.int64)
        ri = (u[1] * self.sizes[gi]).astype(np.int64).tolist()
        groups, ids = self.groups, self.ids
        return [Draw(groups[g], ids[g][r], p) for g, r, p in zip(gi.tolist(), ri, perm)]


def microbatch(pool: dict[str, list[str]], seed: int, index: int, size: int = 8) -> list[Draw]:
    """Convenience form of `Sampler(pool).microbatch`; build a Sampler once in loops."""
    return Sampler(pool).microbatch(seed, index, size)


def shuffle_choice(record: Record, seed: int) -> Record:
    """A copy of a choice record with candidates, target and posterior permuted together.

    List criteria are reordered; dict criteria keep each description with its label. Noul and
    score records are returned unchanged (their order carries meaning).
    """
    q = record.question
    if q.type != "choice":
        return record
    return permute_choice(record, np.random.default_rng(seed).permutation(q.k).tolist())


def permute_choice(record: Record, perm: list[int]) -> Record:
    """A copy of a choice record whose candidate j is the original candidate `perm[j]` (with its target,
    posterior and description); noul and score records are returned unchanged."""
    q = record.question
    if q.type != "choice":
        return record
    labels = q.labels
    if isinstance(q.criteria, dict):
        criteria: list[str] | dict[str, str] = {labels[i]: q.criteria[labels[i]] for i in perm}
    else:
        criteria = [labels[i] for i in perm]
    update = {
        "question": q.model_copy(update={"criteria": criteria}),
        "target": [record.target[i] for i in perm],
    }
    if record.posterior is not None:
        update["posterior"] = [record.posterior[i] for i in perm]
    return record.model_copy(update=update)


MAX_ORDERS = 8  # candidate orders kept per choice row above K = 3 (the Latin set's rows; K orders when K <= 8)
ORDERS_SCHEME = "balanced-v1"  # in the feature and cut-state cache keys: a cache of another scheme is not reused
GIVEN_SCHEME = "given-v1"  # the feature-cache key of `choice_orders=given`: each row in its given order only


def n_orders(k: int) -> int:
    """How many fixed candidate orders a choice row of `k` candidates has while the backbone is frozen:
    all k! for k <= 3 (a position prior is learnable there, so every order is seen), else the k rows of
    a Latin square (every candidate in every position once), at most MAX_ORDERS of them."""
    return math.factorial(k) if k <= 3 else min(k, MAX_ORDERS)


def fixed_order(record_id: str, k: int, order: int) -> list[int]:
    """Candidate order `order` (0..n_orders(k)-1) of a choice row; 0 is the identity.

    k <= 3: the k! permutations in lexicographic order. k >= 4: row `j` of a Latin square
    L_j[p] = tau[(tau^-1[p] + j) mod k], with tau a permutation drawn from sha256(id), so row 0 is the
    identity, every row is a permutation and each candidate sits in each position in exactly one row
    (the rows a k > MAX_ORDERS row keeps are spread evenly: j = round(i k / MAX_ORDERS)). Everything
    depends on the row alone, not on a run's seed."""
    n = n_orders(k)
    if not 0 <= order < n:
        raise ValueError(f"order {order} out of range for a choice row of {k} candidates (0..{n - 1})")
    if order == 0:
        return list(range(k))
    if k <= 3:
        return list(next(itertools.islice(itertools.permutations(range(k)), order, None)))
    digest = hashlib.sha256(f"{record_id}\0latin".encode("utf-8")).digest()
    tau = np.random.default_rng(int.from_bytes(digest[:8], "little")).permutation(k)
    inv = np.argsort(tau)
    shift = order if k <= MAX_ORDERS else round(order * k / MAX_ORDERS)
    return [int(tau[(inv[p] + shift) % k]) for p in range(k)]


def orders_scheme(choice_orders: str = "balanced") -> str:
    """The cache-key name of a `Recipe.choice_orders` value."""
    return GIVEN_SCHEME if choice_orders == "given" else ORDERS_SCHEME


def orders_of(record: Record, split: str = "train", choice_orders: str = "balanced") -> range:
    """The fixed orders a cache keeps for a row: every order of a train choice row, the given one else (and
    always the given one only with `choice_orders="given"`: 1 entry per row instead of up to 8 -- the demo's
    extraction, where the balanced orders multiplied the frozen forwards by 2.5)."""
    if split == "train" and record.question.type == "choice" and choice_orders == "balanced":
        return range(n_orders(record.question.k))
    return range(1)


def order_of_draw(record: Record, perm_seed: int, choice_orders: str = "balanced") -> int:
    """Which of a row's fixed orders a draw uses while the backbone is frozen: `perm_seed mod n_orders(k)`
    for a choice row (perm_seed is uniform on [0, 2^32), so every order is equally likely to within
    n / 2^32), 0 for noul and score."""
    if record.question.type != "choice" or choice_orders == "given":
        return 0
    return perm_seed % n_orders(record.question.k)


def with_fixed_order(record: Record, order: int) -> Record:
    """The record in its fixed order `order` (`fixed_order`); noul/score rows unchanged."""
    if record.question.type != "choice" or order == 0:
        return record
    return permute_choice(record, fixed_order(record.id, record.question.k, order))
