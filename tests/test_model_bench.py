"""`run_prefix_bench` on a small toy request: numbers, bound formula, machine-readable last line."""

import re

import pytest
import torch

torch.set_num_threads(1)

from rlcd.bench.prefix import make_questions, make_state, run_prefix_bench  # noqa: E402
from rlcd.model.build import build_model  # noqa: E402
from rlcd.model.tokenizer import toy_tokenizer  # noqa: E402
from rlcd.model.runner import CaseRunner  # noqa: E402


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


def test_prefix_bench_bfloat16_is_judged_against_float32_rows():
    """In bf16 each path is measured against full rows of a float32 copy of the same weights, and the
    prefix path passes when it adds no error beyond bf16's own (1.5 x the full bf16 rows' error + 1e-4)."""
    import copy

    from rlcd.bench.prefix import PARITY_ATOL, PARITY_FACTOR, precision_parity

    lines = []
    dm = build_model({"model": "tiny-llama", "recipe": {}}, dtype=torch.bfloat16)
    res = run_prefix_bench(questions=6, state_tokens=80, repeats=1, decision_model=dm, logit_std=3.0,
                           print_fn=lines.append)
    assert res["placement"]["dtype"] == "bfloat16"
    # independent reference: the bench's float32 copy, rebuilt here from the bf16 weights
    state, qs = make_state(dm.tokenizer, 80, 0), make_questions(6, 0)
    ids = [f"q{i}" for i in range(6)]
    ref = CaseRunner(copy.deepcopy(dm).float()).score_full(state, qs, ids=ids)
    full = CaseRunner(dm).score_full(state, qs, ids=ids)
    shared = CaseRunner(dm).score_case(state, qs, ids=ids)[0]
    err_full = max(float((a - r).abs().max()) for a, r in zip(full, ref))
    err_prefix = max(float((b - r).abs().max()) for b, r in zip(shared, ref))
    assert res["err_full"] == err_full and res["err_prefix"] == err_prefix
    assert err_full > 1e-3, "bf16 rounding must be visible against float32 (else the test says nothing)"
    assert res["parity_ok"] == (err_prefix <= PARITY_FACTOR * err_full + PARITY_ATOL)
    assert res["parity_ok"], res
    assert any("against float32 full rows" in line and line.endswith("ok") for line in lines)
    # negative control: a prefix path off by 10x bf16's error fails
    worse = [b + 10 * err_full for b in shared]
    assert not precision_parity(dm, state, qs, ids, full, worse, True)["parity_ok"]
    # float32: no reference copy, parity is the plain tolerance check
    assert precision_parity(build_model({"model": "tiny-toy", "recipe": {}}), state, qs, ids, full, shared, True) == \
        {"err_full": None, "err_prefix": None, "parity_ok": True}


@pytest.mark.slow  # ~35 s on the shared 2-core machine (two model loads, the transformers pipeline)
def test_pipeline_bench_command_small(tmp_path, monkeypatch):
    """`rlcd bench pipeline` on tiny-llama, small: rlcd and transformers' pipeline agree, the JSON holds the
    command, and the evaluation section's shared rows equal the full rows."""
    import json

    from typer.testing import CliRunner

    from rlcd.cli import app

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "pipe.json"
    r = CliRunner().invoke(app, ["bench", "pipeline", "--model", "tiny-llama", "--sizes", "1,3", "--repeats", "1",
                                 "--eval-cases", "2", "--json", str(out)])
    assert r.exit_code == 0, r.output
    rec = json.loads(out.read_text())
    assert rec["bench"] == "pipeline" and "--sizes 1,3" in rec["command"]
    serving, ev = rec["results"]["serving"], rec["results"]["evaluation"]
    assert serving["1"]["rlcd_path"] == "full" and serving["3"]["rlcd_path"] == "prefix"
    for n in ("1", "3"):
        assert serving[n]["max_prob_diff"] < 1e-4 and serving[n]["rlcd_p50_ms"] > 0 and serving[n]["pipeline_p50_ms"] > 0
        assert serving[n]["ratio"] == serving[n]["pipeline_p50_ms"] / serving[n]["rlcd_p50_ms"]
    assert ev["rows"] == 12 and ev["rel_logit_diff"] < 1e-5 and ev["token_bound"] > 1.5
    bad = CliRunner().invoke(app, ["bench", "pipeline", "--sizes", "1,x"])
    assert bad.exit_code == 2 and "--sizes" in bad.output


def test_bench_train_case_vs_row_prints_training_and_evaluation_in_one_run(tmp_path, monkeypatch):
    """`rlcd bench train --case-vs-row`: per model, training examples/s case vs row with the token bounds,
    then evaluation rows/s shared vs full rows; one JSON record with the command that made it."""
    import json

    from typer.testing import CliRunner

    from rlcd.cli import app

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "case.json"
    r = CliRunner().invoke(app, ["bench", "train", "--case-vs-row", "tiny-toy", "--updates", "1", "--warmup", "0",
                                 "--rounds", "1", "--cases", "8", "--eval-cases", "2", "--threads", "1",
                                 "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert re.search(r"case vs row: tiny-toy: row [\d.]+ examples/s, case [\d.]+ examples/s: [\d.]+x", r.output)
    assert "evaluation: tiny-toy:" in r.output and "shared prefixes" in r.output
    rec = json.loads(out.read_text())
    assert rec["bench"] == "train-case" and "--eval-cases 2" in rec["command"]
    m = rec["results"]["models"]["tiny-toy"]
    assert m["row"]["examples"] == m["case"]["examples"] == 32  # one update of the recipe's 32 questions each
    assert m["speedup"] == m["case"]["examples_per_s"] / m["row"]["examples_per_s"]
    assert m["token_ratio"] > 1.0 and m["whole_case_token_ratio"] > 1.0  # shared prefixes run fewer tokens
    ev = m["evaluation"]
    assert ev["rows"] == 12 and ev["rel_logit_diff"] < 1e-5 and ev["speedup"] > 0
    bad = CliRunner().invoke(app, ["bench", "train", "--case-vs-row", " , "])
    assert bad.exit_code == 2 and "--case-vs-row" in bad.output


def test_features_bench_measures_extraction_and_training_in_one_run():
    """`rlcd bench features` on tiny-toy: every rate positive, each ratio the quotient of the rates it names,
    the three extractions over the same entries, and the machine-readable last line."""
    from rlcd.bench.features import run_features_bench

    lines = []
    res = run_features_bench("tiny-toy", cases=2, head_updates=2, lora_updates=1, say=lines.append)
    ex, tr = res["extract"], res["train"]
    runs = (ex["shared"], ex["per_row"], ex["shared_lora_on"])
    assert len({(r["entries"], r["row_tokens"]) for r in runs}) == 1 and ex["shared"]["entries"] > 2
    assert all(r["row_tokens_per_s"] > 0 for r in runs)
    assert ex["ratio"] == pytest.approx(ex["shared"]["row_tokens_per_s"] / ex["per_row"]["row_tokens_per_s"])
    assert ex["lora_off_ratio"] == pytest.approx(ex["shared"]["row_tokens_per_s"] /
                                                 ex["shared_lora_on"]["row_tokens_per_s"])
    assert tr["ratio"] == pytest.approx(tr["head_only_updates_per_s"] / tr["lora_updates_per_s"])
    m = re.fullmatch(r"features: extract_ratio=(\S+) lora_off_ratio=(\S+) head_only_updates_per_s=\S+ "
                     r"lora_updates_per_s=\S+ train_ratio=\S+", lines[-1])
    assert m and float(m.group(2)) == pytest.approx(ex["lora_off_ratio"], abs=0.01)
