"""The portable ONNX export (issue 47): files and manifest, parity against torch computed here, the gate's
refusal, the command line's one-line mistakes, int8, and `rlcd serve --export` answering without torch.

One tiny-llama run (random Llama, SmolLM2 tokenizer; the perturbed scorer of `_tiny_export`) on a synthetic
processed data set is exported once per module.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from conftest import user_error  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"
REQUEST = {
    "model": "portable",
    "state": "Order 1182: the courier left the parcel at the wrong address and the customer is furious.",
    "questions": {
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "shipping": "parcels",
                                                                              "returns": None}},
        "upset": {"type": "noul", "instructions": "Is the customer upset?"},
        "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["can wait", "this week", "today"]},
        "fixed": {"type": "choice", "instructions": "Only one way", "criteria": ["this"]},
    },
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from _tiny_export import make_tiny_export_with_test_split

    return make_tiny_export_with_test_split(tmp_path_factory.mktemp("portable"))


@pytest.fixture(scope="module")
def exported(run):
    from rlcd.portable.exporter import export_onnx

    out = run.parent / "onnx"
    export_onnx(run, out)
    return out


def test_the_export_holds_what_it_says(run, exported):
    import onnxruntime as ort

    from rlcd.export import read_export_meta

    assert sorted(p.name for p in exported.iterdir()) == ["manifest.json", "model.onnx", "scorer.safetensors",
                                                          "tokenizer.json"]
    m = json.loads((exported / "manifest.json").read_text())
    src = read_export_meta(run / "export")
    assert m["source"]["backbone_fingerprint"] == src["backbone_fingerprint"]
    assert m["source"]["checkpoint_sha256"] == src["checkpoint_sha256"]
    assert m["graph"]["opset"] == 18 and m["graph"]["precision"] == "float32"
    sess = ort.InferenceSession(str(exported / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == [i["name"] for i in m["graph"]["inputs"]]
    assert [o.name for o in sess.get_outputs()] == [o["name"] for o in m["graph"]["outputs"]]
    assert all(isinstance(d, str) for i in sess.get_inputs() for d in i.shape)  # every axis dynamic
    parity = m["parity"]
    assert parity["passed"] and parity["max_flips"] == 0.005
    fp32 = parity["results"]["float32"]
    assert fp32["rows"] == len((Path(json.loads((run / "config.json").read_text())["data_dir"]) / "test.jsonl")
                               .read_text().splitlines())
    assert fp32["flips"] == 0 and fp32["max_abs_dp"] < 1e-4
    assert fp32["nll"]["delta_95"][0] <= fp32["nll"]["delta"] <= fp32["nll"]["delta_95"][1]


def test_onnx_logits_equal_torch_full_rows(run, exported):
    """Against torch's reference path (every question a full row, `score_full`): the packed shared prefix gives
    each row its own tokens and positions."""
    from rlcd.data.io import load_split
    from rlcd.export import load_export
    from rlcd.model.runner import CaseRunner
    from rlcd.portable.runtime import PortableModel

    model, _ = load_export(run / "export")
    portable = PortableModel(exported, threads=1)
    records = load_split(Path(json.loads((run / "config.json").read_text())["data_dir"]), "test")
    by_case: dict = {}
    for r in records:
        by_case.setdefault(r.case_id, []).append(r)
    case = max(by_case.values(), key=len)
    assert len(case) >= 3
    ref = CaseRunner(model).score_full(case[0].state, [r.question for r in case])
    prepared = portable.prepare_case(case[0].state, [r.question for r in case], None, [r.id for r in case])
    torch_rows = CaseRunner(model).prepare_case(case[0].state, [r.question for r in case], None,
                                                [r.id for r in case]).rows
    assert [r.ids for r in prepared.rows] == [r.ids for r in torch_rows]  # same tokens as the torch encoder
    (logits, usage), = portable.score_cases([prepared])
    assert usage["path"] == "prefix" and usage["input_tokens"] < usage["full_tokens"]
    for a, b in zip(ref, logits):
        np.testing.assert_allclose(b, a.numpy(), rtol=0, atol=2e-4)
    # a single question runs as a full row
    (one, usage1), = portable.score_cases([portable.prepare_case(case[0].state, [case[0].question])])
    assert usage1["path"] == "full"
    np.testing.assert_allclose(one[0], ref[0].numpy(), rtol=0, atol=2e-4)


def test_packed_suffixes_read_the_prefix_and_themselves_only():
    from rlcd.model.prompt import EncodedRow
    from rlcd.portable import layout

    prefix = list(range(100, 160))  # long enough for sharing to pay
    rows = [EncodedRow(prefix + [1, 2, 3], 60, 60, [61, 62]), EncodedRow(prefix + [4, 5], 60, 60, [61])]
    (seq,) = layout.pack_case(rows)
    assert seq.ids == prefix + [1, 2, 3, 4, 5] and seq.positions == list(range(63)) + [60, 61]
    mask = layout.feed([seq], 0)["attention_mask"][0]
    assert mask[63, :60].all() and not mask[63, 60:63].any() and mask[63, 63] and not mask[63, 64]
    assert seq.reads == [[60, 61, 62], [63, 64]]


@pytest.mark.parametrize("centring", ["running_mean", "layernorm", "none"])
def test_the_numpy_scorer_is_the_torch_scorer(centring):
    import torch

    from rlcd.model.head import CandidateScorer
    from rlcd.portable.runtime import score

    torch.manual_seed(0)
    head = CandidateScorer(48, proj_dim=16, centring=centring).eval()
    head.init_centring(torch.randn(5, 48) + 2, torch.randn(9, 48) - 1)
    h_dec, h_cand = torch.randn(48) * 3, torch.randn(4, 48) * 3
    want = head(h_dec[None], h_cand[None], update=False)[0].detach().numpy()
    t = {"w_d": head.w_d.weight.detach().numpy(), "w_c": head.w_c.weight.detach().numpy(),
         "mu_d": head.mu_d.numpy(), "mu_c": head.mu_c.numpy()}
    np.testing.assert_allclose(score(h_dec.numpy(), h_cand.numpy(), t, centring, 16), want, rtol=1e-5, atol=1e-5)


def test_the_gate_refuses_a_perturbed_scorer(run, monkeypatch):
    from typer.testing import CliRunner

    from rlcd.cli import app
    from rlcd.portable import exporter

    real = exporter.scorer_tensors

    def flipped(model, temperatures):
        t = real(model, temperatures)
        t["w_c"] = -t["w_c"]  # every logit negated: the decision becomes the least likely candidate
        return t

    monkeypatch.setattr(exporter, "scorer_tensors", flipped)
    out = run.parent / "refused"
    res = CliRunner().invoke(app, ["export", str(run), "--format", "onnx", "--out", str(out)])
    assert res.exit_code == 1, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("rlcd: error:")]
    assert len(lines) == 1 and "test decisions" in lines[0] and "--max-flips 0.50%" in lines[0], res.stderr
    assert "Traceback" not in res.output
    assert [p.name for p in out.iterdir()] == ["PARITY-FAILED.json"]
    report = json.loads((out / "PARITY-FAILED.json").read_text())
    assert report["status"] == "refused" and report["parity"]["results"]["float32"]["flips"] > 0
    assert not [p for p in run.parent.iterdir() if p.name.startswith(".tmp-")]


def test_command_line_mistakes_are_one_line_and_write_nothing(run, tmp_path, monkeypatch):
    import importlib.util

    from _tiny_export import tiny_export

    user_error(["export", run, "--quantize", "int8"], contains="--quantize goes with --format onnx")
    user_error(["export", run, "--format", "onnx"], contains="needs --out DIR")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    user_error(["export", run, "--format", "onnx", "--out", full], contains="not empty")
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
    user_error(["export", run, "--format", "onnx", "--out", tmp_path / "a", "--max-flips", "2"],
               contains="--max-flips 2.0")
    user_error(["export", tiny_export(tmp_path), "--format", "onnx", "--out", tmp_path / "b"],
               contains="text decoders only")
    user_error(["serve", "--export", tmp_path / "nothing"], contains="not a portable export")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxscript" else real(name, *a))
    user_error(["export", run, "--format", "onnx", "--out", tmp_path / "c"], contains="pip install 'rlcd[onnx]'")
    assert not [p for p in tmp_path.iterdir() if p.name in ("a", "b", "c")]


def test_int8_ships_only_through_the_gate(run):
    import onnx

    from rlcd.portable.exporter import export_onnx

    out = run.parent / "onnx-int8"
    # a random model's decisions are near ties: int8 flips a few of them (2 of 72 here) within max |dp| ~ 0.002,
    # so this test states a looser bound than the default's 0.5%
    m = export_onnx(run, out, quantize="int8", max_flips=0.1)
    assert m["graph"]["precision"] == "int8" and set(m["parity"]["results"]) == {"float32", "int8"}
    int8 = m["parity"]["results"]["int8"]
    assert int8["flip_rate"] <= 0.1 and int8["max_abs_dp"] < 0.05 and m["parity"]["max_flips"] == 0.1
    ops = {n.op_type for n in onnx.load(str(out / "model.onnx")).graph.node}
    assert "MatMulNBits" in ops
    assert json.loads((out / "manifest.json").read_text())["graph"]["precision"] == "int8"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVE = r"""
import json, sys, threading, time, urllib.request
from rlcd.cli import app

port, export, request, extra = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
threading.Thread(target=lambda: app(["serve", "--export", export, "--port", str(port), "--quiet", *extra]),
                 daemon=True).start()
for _ in range(600):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
        break
    except OSError:
        time.sleep(0.1)
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/systemone", data=request.encode(),
                             headers={"content-type": "application/json"})
body = json.loads(urllib.request.urlopen(req, timeout=60).read())
models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10).read())
print(json.dumps({"body": body, "models": models, "torch": "torch" in sys.modules,
                  "transformers": "transformers" in sys.modules}))
sys.stdout.flush()
import os
os._exit(0)
"""


def test_serve_export_answers_like_torch_without_torch(run, exported):
    from rlcd.predict import Predictor

    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SERVE, str(_free_port()), str(exported), json.dumps(REQUEST),
                           "--threads", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["torch"] is False and got["transformers"] is False
    assert got["models"]["data"][0]["placement"] == {"device": "cpu", "dtype": "float32", "runtime": "onnxruntime",
                                                     "threads": 2}
    # the startup line the torch path prints (rlcd.export.load_export), before the seconds of loading and after
    assert re.search(r"^model: loading portable export .+$", proc.stderr, re.M), proc.stderr[-2000:]
    assert re.search(r"^model: ready in \d+\.\d s \(float32 graph, 2 threads\)$", proc.stderr, re.M), proc.stderr[-2000:]
    want = Predictor.from_run(run).predict(REQUEST)
    body = got["body"]
    assert body["model"] == want["model"] and body["usage"] == want["usage"]
    assert set(body["answers"]) == set(want["answers"])
    for qid, a in want["answers"].items():
        b = body["answers"][qid]
        assert {k for k in a} == {k for k in b}
        if "probabilities" in a:
            assert max(abs(a["probabilities"][k] - b["probabilities"][k]) for k in a["probabilities"]) < 1e-4
            assert a.get("choice") == b.get("choice")
        if "noul" in a:
            assert abs(a["noul"] - b["noul"]) < 1e-4


def test_bench_onnx_measures_every_graph_with_parity(run, exported):
    from rlcd.bench.onnx import run_onnx_bench, table

    result = run_onnx_bench(run, threads=(1,), repeats=1, export=exported)
    rows = {r["precision"] if r["engine"] == "onnxruntime" else "torch": r for r in result["rows"]}
    assert set(rows) == {"torch", "float32", "int8", "int8-dynamic"}
    assert rows["torch"]["speedup_vs_torch"] == 1.0 and rows["float32"]["flips"] == 0
    assert rows["float32"]["max_abs_dp"] < 1e-4 and rows["int8-dynamic"]["graph_mb"] < rows["float32"]["graph_mb"]
    assert all(r["rows_per_s"] > 0 for r in result["rows"]) and "int8-dynamic" in table(result)


def test_the_manifest_declares_the_axes_the_graph_has(run, exported, tmp_path):
    """Issue 58: the manifest named the output's hidden axis dynamic ("hidden") where the graph fixes it to the
    backbone's width. Every axis of every input and output now reads as the graph declares it: a name where the
    graph takes any size, the size where it fixes one. A manifest of the old form still loads."""
    import shutil

    import onnxruntime as ort

    from rlcd.portable.runtime import PortableModel

    m = json.loads((exported / "manifest.json").read_text())
    sess = ort.InferenceSession(str(exported / "model.onnx"), providers=["CPUExecutionProvider"])
    declared = {e["name"]: e["axes"] for e in m["graph"]["inputs"] + m["graph"]["outputs"]}
    graph = {v.name: v.shape for v in sess.get_inputs() + sess.get_outputs()}
    assert set(declared) == set(graph)
    for name, shape in graph.items():
        assert len(declared[name]) == len(shape), name
        for i, dim in enumerate(shape):
            axis = declared[name][str(i)]
            assert isinstance(axis, str) == isinstance(dim, str), (name, i, axis, dim)
            if isinstance(dim, int):
                assert axis == dim, (name, i)
    assert declared["hidden"]["2"] == m["graph"]["hidden_size"] == m["scorer"]["hidden"]
    assert [declared["hidden"][k] for k in ("0", "1")] == ["batch", "reads"]
    old = tmp_path / "old"
    shutil.copytree(exported, old)
    m["graph"]["outputs"][0]["axes"] = {"0": "batch", "1": "reads", "2": "hidden"}  # what exports wrote before
    m["graph"].pop("axes", None)
    (old / "manifest.json").write_text(json.dumps(m))
    assert PortableModel(old, threads=1).manifest["graph"]["outputs"][0]["axes"]["2"] == "hidden"


def _broken_copy(exported, tmp_path, name, how):
    import shutil

    d = tmp_path / name
    shutil.copytree(exported, d)
    how(d)
    return d


def test_an_incomplete_export_is_one_line_not_a_traceback(exported, tmp_path):
    """Issue 58: `serve --export` on an export missing a file or with a truncated one printed a 60-96-line
    traceback and exited 1; each is one line naming the file, exit 2 (nothing bound, nothing written)."""
    from rlcd.portable.runtime import PortableModel

    def truncate(name, keep):
        return lambda d: (d / name).write_bytes((d / name).read_bytes()[:keep])

    cases = [
        ("no-graph", lambda d: (d / "model.onnx").unlink(), "no model.onnx"),
        ("no-scorer", lambda d: (d / "scorer.safetensors").unlink(), "no scorer.safetensors"),
        ("no-tokenizer", lambda d: (d / "tokenizer.json").unlink(), "no tokenizer.json"),
        ("cut-manifest", truncate("manifest.json", 200), "manifest.json: not valid JSON"),
        ("no-prompt", lambda d: (d / "manifest.json").write_text(json.dumps(
            {k: v for k, v in json.loads((d / "manifest.json").read_text()).items() if k != "prompt"})),
         "no prompt.spec"),
        ("cut-graph", truncate("model.onnx", 4096), "model.onnx: cannot be read"),
        ("cut-scorer", truncate("scorer.safetensors", 64), "scorer.safetensors: cannot be read"),
        ("cut-tokenizer", truncate("tokenizer.json", 100), "tokenizer.json: cannot be read"),
    ]
    for name, how, needle in cases:
        d = _broken_copy(exported, tmp_path, name, how)
        # a file present but unreadable is found while loading, after the "model: loading ..." status line
        res = user_error(["serve", "--export", d, "--port", _free_port()], contains=needle,
                         max_lines=2 if "cannot be read" in needle else 1)
        errors = [ln for ln in res.stderr.splitlines() if ln.startswith("rlcd: error:")]
        assert len(errors) == 1 and "rlcd export RUN --format onnx" in errors[0], res.stderr
        with pytest.raises(Exception, match=re.escape(needle)):
            PortableModel(d, threads=1)


def test_serve_export_refuses_what_it_cannot_honour(tmp_path):
    """Issue 58: --device cuda, --dtype (any but the default) and a state cache were silently ignored by
    `serve --export`; each is one line, exit 2, checked before the export is read (here: a directory with no
    export at all, whose own error would otherwise come first)."""
    nothing = tmp_path / "no-export-here"
    for args, needle in ((["--device", "cuda"], "--device cuda: a portable export runs on onnxruntime's CPU"),
                         (["--device", "cuda:1"], "--device cuda:1"),
                         (["--dtype", "bfloat16"], "--dtype bfloat16: a portable export's precision"),
                         (["--dtype", "float32"], "--dtype float32"),
                         (["--state-cache-mb", "512"], "--state-cache-mb 512: a portable export keeps no"),
                         (["--state-cache-mb", "256"], "--state-cache-mb 256")):
        user_error(["serve", "--export", nothing, *args], contains=needle, max_lines=1)
    # what it can honour passes these checks (and then meets the missing export)
    for args in (["--device", "cpu"], ["--device", "auto"], ["--state-cache-mb", "0"], ["--dtype", "auto"],
                 ["--threads", "2"]):
        user_error(["serve", "--export", nothing, *args], contains="not a portable export", max_lines=1)
    user_error(["serve", "--export", nothing, "--threads", "0"], contains="--threads")


def test_portable_threads_default_to_torchs(exported):
    """Issue 58: onnxruntime's default took every core where torch takes OMP_NUM_THREADS or the physical cores;
    `default_threads()` (torch-free) is torch's own count, with and without OMP_NUM_THREADS."""
    from rlcd.portable.runtime import PortableModel

    code = ("import torch, json; from rlcd.portable.runtime import default_threads; "
            "print(json.dumps([torch.get_num_threads(), default_threads()]))")
    many = str(2 * (os.cpu_count() or 1))  # more than the cores: torch takes the cores
    for setting in ({}, {"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": many}, {"MKL_NUM_THREADS": "1",
                                                                            "OMP_NUM_THREADS": many}):
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        env.update(setting, PYTHONPATH=str(SRC))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        torch_n, ours = json.loads(out.stdout)
        assert ours == torch_n, (setting, torch_n, ours)
    pm = PortableModel(exported, threads=3)
    opts = pm.session.get_session_options()
    assert (opts.intra_op_num_threads, opts.inter_op_num_threads, pm.threads) == (3, 3, 3)
    # idle pool threads sleep (benchmarks/onnx_spinning.py); spin=True keeps onnxruntime's busy-wait
    assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    spinning = PortableModel(exported, threads=2, spin=True).session.get_session_options()
    with pytest.raises(RuntimeError, match="does not have configuration"):  # onnxruntime's default left alone
        spinning.get_session_config_entry("session.intra_op.allow_spinning")


def test_bench_onnx_http_times_both_servers_in_turn(run, exported, monkeypatch):
    """`rlcd bench onnx RUN --export DIR --http`: both servers started as a user starts them, asked the same cold
    requests in turn; the ratio is the p50s' and the two servers' answers agree within the export's parity."""
    from rlcd.bench.onnx import http_table, run_onnx_http_bench

    monkeypatch.setenv("PYTHONPATH", str(SRC))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    result = run_onnx_http_bench(run, exported, threads=(1,), repeats=2, sizes=(1, 3))
    rows = {(r["server"], r["questions"]): r for r in result["rows"]}
    assert set(rows) == {("torch", 1), ("onnx", 1), ("torch", 3), ("onnx", 3)}
    for (server, k), r in rows.items():
        assert r["requests"] == 2 and len(r["ms"]) == 2 and r["threads"] == 1
        assert r["p50_ms"] == pytest.approx(float(np.median(r["ms"]))) and min(r["ms"]) == r["min_ms"] > 0
        assert r["onnx_over_torch_p50"] == pytest.approx(rows[("onnx", k)]["p50_ms"] / rows[("torch", k)]["p50_ms"])
    assert result["max_abs_dp_between_servers"] < 1e-4
    assert set(result["ready_s"]) == {"torch-1", "onnx-1"} and "onnx/torch p50" in http_table(result)
    user_error(["bench", "onnx", run, "--http"], contains="--http serves a portable export of RUN: give --export DIR")


def test_serve_threads_reach_torch_too(run):
    """`rlcd serve RUN --threads N` sets torch's intra-op threads (the torch server's side of an equal-threads
    comparison); without it torch keeps its own default."""
    import torch

    from rlcd.server import load_predictor

    was = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        load_predictor(run)
        assert torch.get_num_threads() == 2
        load_predictor(run, threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(was)


def test_every_file_of_the_portable_export_is_readable_like_the_rest(exported):
    """The scorer was written 600 by safetensors while the rest was 644: every file now has the mode a plain open()
    gives it under the process's umask (issue 58)."""
    import stat

    old = os.umask(0o022)
    os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in exported.iterdir()}
    assert modes and modes == {name: 0o666 & ~old for name in modes}, oct(old)


def test_the_portable_predictor_asks_canonical_requests(exported):
    """The ONNX runtime's Predictor runs the same canonical requests (rlcd.serving.canonical): a permuted choice and a
    yes/no choice get the answers of the request and of the noul, within 1e-6; --as-asked (canonical=False) is kept."""
    from rlcd.portable.runtime import load_portable

    p = load_portable(exported)
    assert p.info()["canonical_requests"] is True and load_portable(exported, canonical=False).info()[
        "canonical_requests"] is False
    crit = {"email": "a written message", "phone": "a call", "chat": "a live chat"}

    def ask(q):
        return p.predict({"state": "The parcel arrived late.", "questions": {"q": q}})["answers"]["q"]

    base = ask({"type": "choice", "instructions": "Which channel?", "criteria": crit})
    twin = ask({"type": "choice", "instructions": "Which channel?",
                "criteria": {k: crit[k] for k in ("chat", "phone", "email")}})
    assert list(twin["probabilities"]) == ["chat", "phone", "email"]
    assert all(abs(twin["probabilities"][k] - base["probabilities"][k]) < 1e-6 for k in crit)
    noul = ask({"type": "noul", "instructions": "Is it late?"})["noul"]
    yes = ask({"type": "choice", "instructions": "Is it late?", "criteria": {"n": "No", "y": "Yes"}})
    assert abs(yes["probabilities"]["y"] - noul) < 1e-6
