"""benchmarks/peers/jevbench/request_cost.py: the per-request accounting its README numbers come from.

The requests are hand-made (JevBench's shape: a state and a question batch); the expected counts are worked out
from the rows `Predictor.prepare` makes, request by request: which prefixes the LRU holds, which rows repeat.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from _tiny_export import TEMPERATURES, build_tiny_model  # noqa: E402

from rlcd.predict import Predictor  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "peers" / "jevbench" / "request_cost.py"
A = ("Order 5521: the parcel arrived two weeks late, the box was crushed and two of the three plates inside were "
     "broken. The customer wrote twice and called once; nobody answered.")
B = "Invoice 1193 was paid twice by bank transfer and the customer asks for one payment back."
LATE = {"type": "noul", "instructions": "Was the parcel late?"}
DEPT = {"type": "choice", "instructions": "Which department handles this?",
        "criteria": {"billing": "money", "shipping": "parcels", "returns": "goods sent back"}}
DEPT_PERMUTED = {"type": "choice", "instructions": "Which department handles this?",
                 "criteria": {"returns": "goods sent back", "billing": "money", "shipping": "parcels"}}
URGENCY = {"type": "score", "instructions": "How urgent is it?", "criteria": ["not urgent", "urgent", "critical"]}
ONE = {"type": "choice", "instructions": "Which queue?", "criteria": {"main": "the only queue"}}


@pytest.fixture(scope="module")
def rc():
    spec = importlib.util.spec_from_file_location("request_cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(model_spec="tiny-llama")


def _predictor(model, canonical: bool = True) -> Predictor:
    return Predictor(model, {"model": "tiny-llama", "temperatures": dict(TEMPERATURES)}, canonical=canonical)


def _req(state, **questions):
    return {"state": state, "questions": questions}


REQUESTS = [
    _req(A, late=LATE, dept=DEPT),               # A cold
    _req(A, renamed=LATE, urgency=URGENCY),      # A warm; `late` asked again under another key: a repeat row
    _req(B, late=LATE),                          # B cold
    _req(A, dept=DEPT_PERMUTED, queue=ONE),      # A: the permuted choice repeats only in canonical form; ONE: no row
]


def _rows(predictor, request):
    case = predictor.prepare(request).case
    return [] if case is None else case.rows


def _suffix(row) -> int:
    return row.marker_pos[-1] + 1 - row.prefix_len


@pytest.mark.parametrize("canonical", [True, False])
@pytest.mark.parametrize("held", ["all", "one", "none"])
def test_count_follows_the_lru_and_the_repeated_rows(rc, model, canonical, held):
    p = _predictor(model, canonical)
    rows = [_rows(p, r) for r in REQUESTS]
    pa, pb = rows[0][0].prefix_len, rows[2][0].prefix_len
    assert pa != pb and all(r.prefix_len == pa for i in (0, 1, 3) for r in rows[i])
    per_token = 1000
    cache = {"all": 10 * (pa + pb) * per_token, "one": max(pa, pb) * per_token, "none": 0}[held]
    got = rc.count(p, REQUESTS, cache, per_token)
    # A, A, B, A: the second A always hits when anything is held; the last A only when both fit
    hits = {"all": 2, "one": 1, "none": 0}[held]
    prefixes = {"all": pa + pb, "one": 2 * pa + pb, "none": 3 * pa + pb}[held]
    late_a = _suffix(rows[0][0])
    dept_a = _suffix(rows[0][1])
    assert got["requests"] == 4 and got["questions"] == 7 and got["rows"] == 6  # the one-option question runs nothing
    assert got["state_hits"] == hits and got["prefix_tokens_run"] == prefixes
    assert got["suffix_tokens"] == sum(_suffix(r) for rs in rows for r in rs)
    assert got["row_tokens"] == sum(len(r) for rs in rows for r in rs)
    # `late` on A again; the permuted `dept` on A again only when it is rendered in canonical order
    assert got["repeat_rows"] == (2 if canonical else 1)
    assert got["repeat_suffix_tokens"] == late_a + (dept_a if canonical else 0)
    total = prefixes + got["suffix_tokens"]
    assert got["backbone_tokens_per_request"] == round(total / 4, 1)
    assert got["backbone_tokens_per_request_without_repeat_rows"] == round((total - got["repeat_suffix_tokens"]) / 4, 1)


def test_timed_counts_each_backbone_call_and_puts_the_model_back(rc, model):
    p = _predictor(model)
    lm = model.decoder_forward
    out = rc.timed(p, REQUESTS[:2])
    assert model.decoder_forward == lm  # the counting wrapper is gone
    second = out["requests"][1]
    for r, rows in zip(out["requests"], (_rows(p, REQUESTS[0]), _rows(p, REQUESTS[1]))):
        assert r["calls"] and r["tokens"] == sum(a * b for a, b in r["calls"])
        assert r["tokens"] >= sum(_suffix(x) for x in rows)  # at least every suffix ran (padding aside)
        assert r["score_s"] > 0 and r["bare_s"] > 0 and r["score_over_bare"] > 0
    assert second["cached_prefix"] in (0, _rows(p, REQUESTS[1])[0].prefix_len)
    assert out["median_score_over_bare"] > 0 and out["threads"] == 1


def test_row_cache_ab_answers_alike_and_counts_the_repeated_rows(rc, model):
    out = rc.row_cache_ab(_predictor(model), REQUESTS, 4)
    # `late` asked again on A (another key) and the permuted `dept` on A (canonical form): two rows not run
    assert out["rows"]["hits"] == 2 and out["rows"]["entries"] == 4 and out["rows"]["max_bytes"] == 4 << 20
    assert out["max_probability_gap"] < 1e-4 and out["requests"] == 4
    assert out["states_on"]["max_bytes"] == out["states_off"]["max_bytes"] > 0
    assert out["score_s_on"] >= 0 and out["score_s_off"] > 0
