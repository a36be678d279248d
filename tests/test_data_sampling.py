"""Eligible pools (caps, hash order), the microbatch sampler and shuffle_choice."""

import hashlib
import random
from collections import Counter

import pytest

import numpy as np

from rlcd.data.sampling import (MAX_ORDERS, Draw, Sampler, dev_subset, eligible_pool, fixed_order, microbatch,
                               n_orders, order_of_draw, orders_of, shuffle_choice)
from rlcd.schema import Record

CHI2_999 = {2: 13.82, 9: 27.88}  # chi-square quantile 0.999 by degrees of freedom


def make(rid, task="t", question=None, target=None, posterior=None):
    question = question or {"type": "noul", "instructions": "ok?"}
    return Record(id=rid, source="s", task=task, state=f"state {rid}", question=question,
                  target=target or [0.5, 0.5], posterior=posterior)


def sha_order(ids):
    return sorted(ids, key=lambda i: hashlib.sha256(i.encode()).hexdigest())


def test_caps_follow_hash_order_per_group():
    records = [make(f"a{i}", task="a") for i in range(300)] + [make(f"b{i}", task="b") for i in range(7)]
    pool = eligible_pool(records, cap=50)
    assert pool == {"s/en/a": sha_order(f"a{i}" for i in range(300))[:50], "s/en/b": sha_order(f"b{i}" for i in range(7))}
    random.Random(0).shuffle(records)
    assert eligible_pool(records, cap=50) == pool  # input order does not matter
    dev = dev_subset(records)
    assert len(dev["s/en/a"]) == 256 and dev["s/en/a"][:50] == pool["s/en/a"]


def test_default_training_cap_is_6000():
    records = [make(f"r{i}") for i in range(6003)]
    (ids,) = eligible_pool(records).values()
    assert len(ids) == 6000 and ids == sha_order(r.id for r in records)[:6000]


@pytest.fixture(scope="module")
def pool():
    return {"big": [f"big{i}" for i in range(1000)], "mid": [f"mid{i}" for i in range(10)], "one": ["one0"], "empty": []}


def test_microbatch_is_a_pure_function_of_seed_and_index(pool):
    a = [Sampler(pool).microbatch(3, i) for i in (5, 0, 9)]
    sampler = Sampler(dict(reversed(list(pool.items()))))  # a fresh sampler, pool in another order
    b = [sampler.microbatch(3, i) for i in (9, 5, 0)]
    assert a == [b[1], b[2], b[0]]
    assert microbatch(pool, 3, 5) == a[0] and len(a[0]) == 8 and all(isinstance(d, Draw) for d in a[0])
    assert Sampler(pool).microbatch(3, 6) != a[0] and Sampler(pool).microbatch(4, 5) != a[0]
    assert all(d.id.startswith(d.group) for batch in a for d in batch)


def _chi2(counts):
    """Pearson chi-square of observed counts against a uniform expectation over their cells."""
    expected = sum(counts.values()) / len(counts)
    return sum((c - expected) ** 2 / expected for c in counts.values())


def test_groups_are_uniform_whatever_their_size(pool):
    sampler = Sampler(pool)
    draws = [d for i in range(3000) for d in sampler.microbatch(17, i)]
    groups = Counter(d.group for d in draws)
    assert set(groups) == {"big", "mid", "one"}  # empty groups are never drawn
    assert _chi2(groups) < CHI2_999[2]
    rows = Counter(d.id for d in draws if d.group == "mid")
    assert len(rows) == 10 and _chi2(rows) < CHI2_999[9]
    assert len({d.perm_seed for d in draws}) > 0.99 * len(draws)


def test_empty_pool_is_refused():
    with pytest.raises(ValueError, match="no rows"):
        Sampler({"g": []})


# --- shuffle_choice -------------------------------------------------------------------------


def _pairs(record):
    q = record.question
    return {label: (record.target[i], (record.posterior or [None] * q.k)[i], q.descriptions()[i])
            for i, label in enumerate(q.labels)}


@pytest.mark.parametrize("criteria", [
    ["red", "green", "blue", "cyan", "magenta"],
    {"red": "warm", "green": "grass", "blue": "sky", "cyan": "sea", "magenta": "ink"},
])
def test_shuffle_choice_keeps_candidate_target_pairs(criteria):
    record = make("c", question={"type": "choice", "instructions": "colour?", "criteria": criteria},
                  target=[0.5, 0.2, 0.15, 0.1, 0.05], posterior=[0.4, 0.3, 0.1, 0.1, 0.1])
    before = record.model_dump()
    orders = set()
    for seed in range(20):
        shuffled = shuffle_choice(record, seed)
        assert _pairs(shuffled) == _pairs(record)
        assert type(shuffled.question.criteria) is type(criteria)
        assert shuffle_choice(record, seed) == shuffled
        orders.add(tuple(shuffled.question.labels))
    assert len(orders) > 5
    assert record.model_dump() == before  # the input record is untouched


@pytest.mark.parametrize("question,target", [
    ({"type": "noul", "instructions": "ok?", "criteria": {"false": "no", "true": "yes"}}, [0.3, 0.7]),
    ({"type": "score", "instructions": "how much?", "criteria": ["low", "mid", "high"]}, [0.2, 0.3, 0.5]),
])
def test_noul_and_score_are_never_permuted(question, target):
    record = make("n", question=question, target=target)
    assert all(shuffle_choice(record, seed) is record for seed in range(10))


# --- balanced fixed orders (the caches' candidate orders while the backbone is frozen) ---------------


def _choice(rid: str, k: int) -> Record:
    return make(rid, question={"type": "choice", "instructions": "which?", "criteria": [f"c{i}" for i in range(k)]},
                target=[1.0] + [0.0] * (k - 1))


@pytest.mark.parametrize("k", [2, 3])
def test_small_rows_keep_every_order_once(k):
    """K <= 3: a position prior is learnable, so the cache holds all K! orders, each once, the identity first."""
    import itertools

    for rid in ("a", "b", "row-17"):
        orders = [tuple(fixed_order(rid, k, o)) for o in orders_of(_choice(rid, k))]
        assert orders[0] == tuple(range(k))
        assert sorted(orders) == sorted(itertools.permutations(range(k)))


@pytest.mark.parametrize("k", [4, 5, 8, 9, 13, 40])
def test_larger_rows_keep_a_latin_set(k):
    """K >= 4: every kept order is a permutation, the identity is one of them, and no candidate sits in a
    position twice; up to 8 candidates every candidate sits in every position exactly once."""
    for rid in ("a", "b", "row-17"):
        orders = [fixed_order(rid, k, o) for o in orders_of(_choice(rid, k))]
        assert len(orders) == n_orders(k) == min(k, MAX_ORDERS)
        assert orders[0] == list(range(k))
        assert all(sorted(o) == list(range(k)) for o in orders)
        for p in range(k):  # the candidates a position holds across the orders: all distinct
            held = [o[p] for o in orders]
            assert len(set(held)) == len(held)
        if k <= MAX_ORDERS:
            assert all(sorted(o[p] for o in orders) == list(range(k)) for p in range(k))
    assert fixed_order("a", 5, 2) != fixed_order("b", 5, 2)  # the square depends on the row


@pytest.mark.parametrize("k", [2, 3, 4, 6])
def test_draws_use_every_order_equally_often(k):
    """Over the sampler's permutation seeds each cached order of a row comes up 1/n of the time (a chi-square
    bound at 20,000 draws), and the original order no more often than the others (it was 62.5% at K = 2)."""
    rec = _choice("r", k)
    rng = np.random.default_rng(0)
    seeds = rng.integers(0, 2**32, size=20000, dtype=np.uint64).tolist()
    counts = Counter(order_of_draw(rec, s) for s in seeds)
    n = n_orders(k)
    assert set(counts) == set(range(n))
    expected = len(seeds) / n
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    assert chi2 < 3 * n + 30, counts  # far above the chi-square's mean (n - 1); 62.5% identity gives ~5,000
    position_of_first = Counter(fixed_order("r", k, order_of_draw(rec, s)).index(0) for s in seeds)
    assert max(position_of_first.values()) / len(seeds) < 1 / k + 0.02


def test_noul_and_score_rows_keep_one_order_and_bad_orders_are_refused():
    noul = make("n", question={"type": "noul", "instructions": "ok?", "criteria": {"false": "no", "true": "yes"}},
                target=[0.3, 0.7])
    assert list(orders_of(noul)) == [0] and order_of_draw(noul, 12345) == 0
    assert list(orders_of(_choice("c", 3), split="dev")) == [0]
    with pytest.raises(ValueError, match="order 6 out of range for a choice row of 3 candidates"):
        fixed_order("c", 3, 6)
