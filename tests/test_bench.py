"""Benchmarks: the instrumented training update (parts, fidelity to `train()`), the sampler
micro-benchmark, result files and BENCHMARKS.md generation, the 0.8B shape, and gpu.sh --dry-run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from rlcd import checkpoint as ckpt  # noqa: E402
from rlcd.bench import report  # noqa: E402
from rlcd.bench.train import PARTS, bench_session, format_report, run_train_bench, sampler_bench, time_updates  # noqa: E402
from rlcd.recipe import Recipe  # noqa: E402
from conftest import synth_processed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return synth_processed(tmp_path_factory.mktemp("bench-data"), 30, seed=5)


def test_train_bench_parts_partition_the_update(data_dir):
    lines: list[str] = []
    res = run_train_bench(model="tiny-toy", updates=2, data_dir=data_dir, warmup=1, sampler_calls=500,
                          print_fn=lines.append)
    shares = res["shares"]
    assert set(shares) == set(PARTS)
    assert all(v > 0 for v in shares.values()), shares
    assert abs(sum(shares.values()) - 1.0) < 0.02, shares  # the parts cover the whole measured update
    assert res["objective_share"] == shares["objective"]
    assert res["examples"] == 2 * 8 * 4  # measured updates x batch x accumulation; warm-up excluded
    assert res["tokens"] > res["examples"] and res["tokens_per_s"] > 0 and res["examples_per_s"] > 0
    assert abs(res["step_ms"] - sum(res["parts_ms"].values())) < 0.02 * res["step_ms"]
    assert res["sampler_rows_per_s"] > 0 and res["sampler"]["rows"] == 500 * 8
    m = re.fullmatch(r"train: examples_per_s=(\S+) tokens_per_s=(\S+) objective_share=(\S+) "
                     r"sampler_rows_per_s=(\S+)", lines[-1])
    assert m and abs(float(m.group(1)) - res["examples_per_s"]) < 0.01
    assert any(ln.startswith(("PASS objective", "FAIL objective")) for ln in lines)
    assert any(ln.startswith(("PASS sampler", "FAIL sampler")) for ln in lines)
    # PASS/FAIL follow the numbers
    fake = dict(res, objective_share=0.5, objective_pass=False)
    assert any(ln.startswith("FAIL objective share 50.000%") for ln in format_report(fake))


def test_instrumented_update_is_the_training_update(tmp_path, data_dir):
    """Two bench updates leave exactly the weights two updates of `rlcd.train.train` leave."""
    from rlcd.train import train

    recipe = Recipe(steps=2, eval_every=100, log_every=1)
    train(tmp_path / "run", data_dir=data_dir, model="tiny-toy", recipe=recipe, progress=False)
    ref = ckpt.load(tmp_path / "run" / "checkpoints" / "last")["weights"]
    s = bench_session(data_dir, "tiny-toy", recipe=recipe, workdir=tmp_path)
    time_updates(s, updates=2, warmup=0)
    got = s.model.trainable_state_dict()
    assert set(got) == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_sampler_bench_counts_rows():
    pool = {"a/en/x": [f"a{i}" for i in range(50)], "b/en/y": [f"b{i}" for i in range(7)]}
    r = sampler_bench(pool, calls=300, batch_size=8)
    assert r["rows"] == 2400 and r["calls"] == 300 and r["groups"] == 2 and r["pool_rows"] == 57
    assert r["rows_per_s"] > 0 and abs(r["rows_per_s"] - r["rows"] / r["wall_s"]) < 1e-6 * r["rows_per_s"]
    with pytest.raises(ValueError):
        sampler_bench(pool, calls=0)


def _fake_machine(i: int) -> dict:
    return {"cpu": f"Fake CPU model {i}", "cores": 2 + i, "cores_usable": 2, "torch": f"2.1{i}.0", "threads": 1 + i,
            "transformers": "5.17.0", "python": "3.11.7", **({"gpu": "NVIDIA H200", "cuda": "12.8"} if i == 3 else {})}


def test_save_result_and_benchmarks_md(tmp_path):
    rd = tmp_path / "results"
    payloads = {
        "prefix": {"speedup": 7.5, "bound": 8.4, "ratio": 0.89, "max_abs_diff": 3e-7, "questions": 32},
        "train": {"examples_per_s": 40.2, "tokens_per_s": 9000.0, "objective_share": 0.004,
                  "parts_ms": {p: 1.0 + i for i, p in enumerate(PARTS)},
                  "shares": {p: (1.0 + i) / 21 for i, p in enumerate(PARTS)}, "step_ms": 21.0,
                  "sampler_rows_per_s": 250000.0, "nan_is_dropped": float("nan")},
        "pipeline": {"model": "tiny", "serving": {"1": {"ratio": 2.0}}},
        "features": {"model": "tiny", "extract": {"ratio": 2.5}, "train": {"ratio": 76.0}},
        "cut": {"model": "tiny", "layers": 2, "per_k": {"1": {"row_ratio": 3.5, "bytes_per_row_token": 64.0}}},
        "serve": {"decisions_per_s": 120.0, "p50_ms_1": 12.0, "c5xx": 0},
        "gpu": {"mode": "gpu", "train": {"tokens_per_s": 50000.0, "mfu": 0.21}, "serve": {"p50_ms": 40.0},
                "prefix": {"speedup": 9.0}, "memory": {"peak_allocated_gib": 12.5}},
    }
    commands = {n: f"rlcd bench {n} --json {rd}/{n}.json --marker-{n}" for n in payloads}
    for i, (name, res) in enumerate(payloads.items()):
        p = report.save_result(name, commands[name], res, rd, machine=_fake_machine(i))
        rec = json.loads(p.read_text())  # strict JSON: NaN became null
        assert p == rd / f"{name}.json"
        assert set(rec) >= {"bench", "command", "machine", "results", "created"}
        assert rec["bench"] == name and rec["command"] == commands[name]
    assert json.loads((rd / "train.json").read_text())["results"]["nan_is_dropped"] is None

    out = report.write_benchmarks_md(rd, tmp_path / "BENCHMARKS.md")
    md = out.read_text()
    for i, name in enumerate(payloads):
        assert commands[name] in md
        assert f"Machine: {report.machine_line(_fake_machine(i))}" in md
        assert f"## {name}" in md
    assert "Fake CPU model 2; 4 cores (2 usable); torch 2.12.0, 3 threads" in md
    assert "GPU NVIDIA H200, CUDA 12.8" in md
    assert md.index("## prefix") < md.index("## train") < md.index("## features") < md.index("## cut") < md.index("## serve") < md.index("## gpu")
    assert "| objective | 3 |" in md and "Not measured yet" not in md
    assert "| `train.mfu` | 0.21 |" in md  # gpu sections are tabulated
    assert "| `per_k.1.row_ratio` | 3.5 |" in md  # so are the cut bench's per-K fields
    # a result holding {"columns", "rows"} values shows each as a Markdown table (a peer suite beside published rows)
    report.save_result("peer", "bash peer.sh", {"table": {"columns": ["model", "score", "accuracy"],
                                                           "rows": [["ours", 72.25, None], ["uniform", 89.4, 0.398]]}},
                       rd, machine=_fake_machine(0))
    md_t = report.render_benchmarks_md(report.load_results(rd), rd)
    assert "| model | score | accuracy |\n|---|---|---|\n| ours | 72.25 | - |\n| uniform | 89.4 | 0.398 |" in md_t
    (rd / "peer.json").unlink()
    # a missing bench is listed with the command that makes it; junk JSON is refused
    (rd / "gpu.json").unlink()
    md2 = report.render_benchmarks_md(report.load_results(rd), rd)
    assert "Not measured yet" in md2 and "benchmarks/gpu.sh" in md2
    (rd / "junk.json").write_text('{"not": "a result"}')
    with pytest.raises(ValueError, match="not a bench result"):
        report.load_results(rd)
    with pytest.raises(ValueError):
        report.save_result("x", "", {}, rd)


def test_machine_info_describes_this_process():
    m = report.machine_info()
    assert m["cpu"] and m["cores"] >= 1 and m["torch"] == torch.__version__ and m["threads"] == torch.get_num_threads()
    line = report.machine_line(m)
    assert m["cpu"] in line and f"{m['threads']} threads" in line


def test_qwen35_08b_shape():
    from transformers import Qwen3_5ForConditionalGeneration

    from rlcd.bench.gpu import qwen35_08b_config
    from rlcd.model.tokenizer import qwen_tokenizer

    cfg = qwen35_08b_config(qwen_tokenizer())
    tc, vc = cfg.text_config, cfg.vision_config
    assert tc.layer_types == ["linear_attention"] * 3 + ["full_attention"] + tc.layer_types[4:]
    assert tc.layer_types.count("full_attention") == 6 and len(tc.layer_types) == 24
    assert (tc.hidden_size, tc.intermediate_size, tc.num_attention_heads, tc.num_key_value_heads, tc.head_dim) == \
        (1024, 3584, 8, 2, 256)
    assert (vc.depth, vc.hidden_size, vc.out_hidden_size) == (12, 768, 1024)
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert n == 852_985_920  # the 853M of the real checkpoint (QWEN35-NOTES.md)
    assert model.model.language_model.embed_tokens.weight.shape == (248320, 1024)


def test_gpu_script_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable)
    env.pop("RLCD_BENCH_COMMAND", None)
    p = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run", "--threads", "1"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=420)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "gpu.json").read_text())
    assert rec["bench"] == "gpu" and rec["command"] == "bash benchmarks/gpu.sh --dry-run --threads 1"
    res = rec["results"]
    assert res["mode"] == "dry-run" and res["device"] == "cpu"
    assert res["train"]["tokens_per_s"] > 0 and res["train"]["mfu"] > 0
    assert abs(sum(res["train"]["shares"].values()) - 1) < 0.02
    assert res["serve"]["questions"] == 5 and res["serve"]["p50_ms"] > 0 and res["serve"]["finite"]
    assert res["prefix"]["tol_ok"] and res["prefix"]["speedup"] > 0
    assert res["memory"]["peak_rss_gib"] > 0 and res["model"]["params_trainable"] > 0
    load = res["serve_load"]
    assert load["c5xx"] == 0 and load["crashes"] == 0 and set(load["modes"]) == {"batched", "unbatched"}
    assert load["batching_speedup_c16"] > 0 and load["p50_ratio_c1"] > 0
    policy = res["policy"]
    assert policy["auto"] == {"device": "cpu", "dtype": "float32"} and policy["all_recorded"]
    assert policy["evaluation_placement"] == policy["auto"] and policy["export_hf_written"]
    assert policy["max_abs_prob_diff_auto_vs_cpu_fp32"] == 0.0
    table = p.stdout.strip().splitlines()
    assert table[-1].startswith("time") and any(ln.startswith("== rlcd gpu bench: dry-run") for ln in table[-30:])


def test_a_bench_result_records_the_command_that_reproduces_it(tmp_path):
    """The saved command holds every flag given away from its default (and no default), then --json."""
    from typer.testing import CliRunner

    from rlcd.cli import app

    out = tmp_path / "data.json"
    res = CliRunner().invoke(app, ["bench", "data", "--cases", "3", "--easy-vqa", "0", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["command"] == f"rlcd bench data --cases 3 --easy-vqa 0 --json {out}"
