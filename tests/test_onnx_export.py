"""The portable ONNX export (issue 47): files and manifest, parity against torch computed here, the gate's
refusal, the command line's one-line mistakes, int8, and `rlcd serve --export` answering without torch.

One tiny-llama run (random Llama, SmolLM2 tokenizer; the perturbed scorer of `_tiny_export`) on a synthetic
processed data set is exported once per module.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from conftest import synth_processed, user_error  # noqa: E402

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
    from _tiny_export import make_tiny_export

    base = tmp_path_factory.mktemp("portable")
    data = synth_processed(base / "data", 120, 3)
    run = make_tiny_export(base / "run", model_spec="tiny-llama")
    cfg = json.loads((run / "config.json").read_text())
    cfg["data_dir"] = str(data)
    (run / "config.json").write_text(json.dumps(cfg))
    return run


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
    from rlcd.portable.runtime import PortableModel

    model, _ = load_export(run / "export")
    portable = PortableModel(exported, threads=1)
    records = load_split(Path(json.loads((run / "config.json").read_text())["data_dir"]), "test")
    by_case: dict = {}
    for r in records:
        by_case.setdefault(r.case_id, []).append(r)
    case = max(by_case.values(), key=len)
    assert len(case) >= 3
    ref = model.score_full(case[0].state, [r.question for r in case])
    prepared = portable.prepare_case(case[0].state, [r.question for r in case], None, [r.id for r in case])
    torch_rows = model.prepare_case(case[0].state, [r.question for r in case], None, [r.id for r in case]).rows
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

port, export, request = int(sys.argv[1]), sys.argv[2], sys.argv[3]
threading.Thread(target=lambda: app(["serve", "--export", export, "--port", str(port), "--quiet"]),
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
    proc = subprocess.run([sys.executable, "-c", SERVE, str(_free_port()), str(exported), json.dumps(REQUEST)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["torch"] is False and got["transformers"] is False
    assert got["models"]["data"][0]["placement"]["runtime"] == "onnxruntime"
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
