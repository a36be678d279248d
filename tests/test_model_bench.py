"""`run_prefix_bench` on a small toy request: numbers, bound formula, machine-readable last line."""

import re

import torch

torch.set_num_threads(1)

from rlcd.bench.prefix import make_questions, make_state, run_prefix_bench  # noqa: E402
from rlcd.model.build import build_model  # noqa: E402
from rlcd.model.tokenizer import toy_tokenizer  # noqa: E402


def test_workload_is_deterministic_and_mixed():
    tok = toy_tokenizer()
    s = make_state(tok, 100, seed=3)
    assert s == make_state(tok, 100, seed=3) and s != make_state(tok, 100, seed=4)
    assert 100 <= len(tok.encode(s, add_special_tokens=False)) < 140
    qs = make_questions(7)
    assert {q.type for q in qs} == {"choice", "noul", "score"}
    assert [q.model_dump() for q in qs] == [q.model_dump() for q in make_questions(7)]


def test_prefix_bench_small():
    lines = []
    dm = build_model({"model": "tiny-toy", "recipe": {}})
    res = run_prefix_bench(questions=6, state_tokens=80, repeats=1, decision_model=dm, logit_std=3.0,
                           print_fn=lines.append)
    assert res["questions"] == 6 and res["max_abs_logit"] > 1.0
    assert res["tol_ok"] and res["max_abs_diff"] < 1e-4 + 1e-5 * res["max_abs_logit"]
    b, p, length = res["questions"], res["prefix_tokens"], res["mean_row_tokens"]
    assert abs(res["bound"] - (b * length) / (p + b * (length - p))) < 1e-9
    assert res["input_tokens_shared"] == p + res["input_tokens_full"] - b * p
    assert abs(res["ratio"] - res["speedup"] / res["bound"]) < 1e-9
    m = re.fullmatch(r"prefix: max_abs_diff=(\S+) speedup=(\S+) bound=(\S+) ratio=(\S+)", lines[-1])
    assert m and abs(float(m.group(3)) - res["bound"]) < 0.01
