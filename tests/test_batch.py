"""`rlcd predict --input/--output` (rlcd.batch): batch answers equal the Predictor's per-request answers, rejects
counted with their line and reason, a SIGKILLed job resumed to the same output, command-line mistakes in one line,
and the same job through a real local Ray cluster (skipped where ray is not installed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from _tiny_export import tiny_export, tiny_predictor  # noqa: E402
from conftest import user_error  # noqa: E402

from rlcd.batch.io import parts_dir, read_output, rejects_path  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"
# |p_batch - p_single|: the job packs a state's lines into one case (`rlcd.batch.packing`), so a line's suffix runs
# on the tiny Qwen3.5's prefix path while alone it may run as a full row: another DeltaNet chunk grid and batch shape,
# equal up to float noise (~6e-6 relative in logits, the engines' contract); measured up to 1.5e-6 in probability.
# A line given another line's rows is off by 1e-2 or more. On the demo's SmolLM2, `rlcd bench batch` measures it.
TOL = 1e-5
STATES = [
    "The parcel arrived two weeks late and the box was damaged.",
    {"ticket": 7, "text": "Refund requested for a blue jacket, size L.", "priority": "high"},
    "Customer asks whether the store ships to Norway.",
    "Invoice 1193 was paid twice by bank transfer.",
    "The app crashes on login since the last update.",
]
QUESTIONS = [
    {"type": "choice", "instructions": "Which department?", "criteria": {"billing": None, "shipping": "parcels",
                                                                          "returns": None}},
    {"type": "noul", "instructions": "Is the customer angry?"},
    {"type": "score", "instructions": "How urgent is it?", "criteria": ["not", "a bit", "quite", "very"]},
    {"type": "choice", "instructions": "Only one way", "criteria": {"only": None}},  # a fixed answer, no model
]


def good_requests(n_states: int = len(STATES), per_state: int = 3) -> list[dict]:
    """Requests about a few states, the same state's requests spread out (the job regroups them)."""
    out = []
    for j in range(per_state):
        for i in range(n_states):
            qs = {f"q{k}": QUESTIONS[(i + j + k) % len(QUESTIONS)] for k in range(1 + (i + j) % 3)}
            out.append({"id": f"s{i}-r{j}", "state": STATES[i], "questions": qs})
    return out


# (line text, expected reject field, a piece of the reason)
BAD = [
    ('{"id": "broken", "state": "x", "questions": ', "request", "not valid JSON"),
    ('["not", "an", "object"]', "request", "JSON object"),
    ('{"state": "no id", "questions": {"q": {"type": "noul"}}}', "id", "needs an \"id\""),
    ('{"id": "s0-r0", "state": "a repeated id", "questions": {"q": {"type": "noul"}}}', "id", "already given"),
    ('{"id": "bad-type", "state": "x", "questions": {"q": {"type": "ranking"}}}', "questions.q.type", ""),
    ('{"id": "no-questions", "state": "x", "questions": {}}', "questions", ""),
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return tiny_export(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def predictor(run_dir):
    return tiny_predictor(run_dir.parent)


def write_input(path: Path, requests: list[dict], bad: list[tuple] = ()) -> dict[int, tuple]:
    """JSONL with the bad lines slotted in every third line; returns {line: (field, reason piece)} of the bad."""
    lines, where = [], {}
    bad = list(bad)
    for i, req in enumerate(requests):
        lines.append(json.dumps(req))
        if bad and i % 3 == 1:
            text, field, piece = bad.pop(0)
            lines.append(text)
            where[len(lines)] = (field, piece)
    for text, field, piece in bad:
        lines.append(text)
        where[len(lines)] = (field, piece)
    path.write_text("\n".join(lines) + "\n")
    return where


def max_diff(got: dict, want: dict) -> float:
    """Largest |p_batch - p_single| over every question and option; the answers' other fields must be equal."""
    assert set(got["answers"]) == set(want["answers"])
    assert got["usage"] == want["usage"] and got["model"] == want["model"]
    worst = 0.0
    for qid, w in want["answers"].items():
        g = got["answers"][qid]
        assert g["type"] == w["type"]
        if w["type"] == "noul":
            worst = max(worst, abs(g["noul"] - w["noul"]))
            continue
        assert list(g["probabilities"]) == list(w["probabilities"])
        if w["type"] == "choice":
            assert g["choice"] == w["choice"]
        else:  # a score answer is the expected level
            worst = max(worst, abs(g["score"] - w["score"]) / len(w["probabilities"]))
        worst = max(worst, max(abs(g["probabilities"][k] - w["probabilities"][k]) for k in w["probabilities"]),
                    abs(g["confidence"] - w["confidence"]))
    return worst


def invoke(args):
    from typer.testing import CliRunner

    from rlcd.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def check_against_predictor(predictor, requests, answers):
    by_id = {a["id"]: a for a in answers}
    assert set(by_id) == {r["id"] for r in requests}
    for req in requests:
        body = {k: v for k, v in req.items() if k != "id"}
        assert max_diff(by_id[req["id"]], predictor.predict(body)) < TOL, req["id"]


# ------------------------------------------------------------------------------------------------- local
def test_batch_answers_equal_the_predictor_and_rejects_are_counted(run_dir, predictor, tmp_path):
    requests = good_requests()
    bad_lines = write_input(tmp_path / "in.jsonl", requests, BAD)
    out = tmp_path / "out.jsonl"
    res = invoke(["predict", run_dir, "--input", tmp_path / "in.jsonl", "--output", out, "--batch-size", 2,
                  "--chunk-rows", 7, "--device", "cpu"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    n = len(requests) + len(BAD)
    assert (summary["rows"], summary["answered"], summary["rejected"]) == (n, len(requests), len(BAD))
    assert f"{n} rows read = {len(requests)} answered + {len(BAD)} rejected" in res.stderr
    assert "rows/s" in res.stderr  # the progress lines
    answers = read_output(out)
    assert [a["line"] for a in answers] == sorted(a["line"] for a in answers)  # input order
    check_against_predictor(predictor, requests, answers)
    rejects = [json.loads(ln) for ln in rejects_path(out).read_text().splitlines()]
    assert {r["line"] for r in rejects} == set(bad_lines)
    for r in rejects:
        field, piece = bad_lines[r["line"]]
        assert r["field"] == field and piece in r["reason"], r
    assert not parts_dir(out).exists()
    lines = tmp_path.joinpath("in.jsonl").read_text().splitlines()
    for a in answers:  # an answer's line is the line its request was on
        assert json.loads(lines[a["line"] - 1])["id"] == a["id"]


def test_parquet_in_and_out(run_dir, predictor, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    requests = good_requests(3, 2)
    table = pa.table({"id": [r["id"] for r in requests] + [None],
                      "request": [json.dumps({k: v for k, v in r.items() if k != "id"}) for r in requests] + ["{}"]})
    pq.write_table(table, tmp_path / "in.parquet")
    out = tmp_path / "out.parquet"
    res = invoke(["predict", run_dir, "--input", tmp_path / "in.parquet", "--output", out, "--device", "cpu",
                  "--quiet"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["rejected"] == 1 and "rows/s" not in res.stderr  # --quiet: no progress lines
    assert pq.read_schema(out).names == ["id", "line", "response"]
    check_against_predictor(predictor, requests, read_output(out))
    (reject,) = [json.loads(ln) for ln in rejects_path(out).read_text().splitlines()]
    assert reject["line"] == len(requests) + 1 and reject["field"] == "id"


def _column_requests():
    """Requests whose question sets differ row to row (Parquet gives every row every key of a struct column)."""
    noul = {"type": "noul", "instructions": "Is the customer angry?"}
    score = {"type": "score", "instructions": "How urgent is it?", "criteria": ["not", "a bit", "quite", "very"]}
    choice = {"type": "choice", "instructions": "Which department?", "criteria": ["billing", "shipping", "returns"]}
    sets = [{"a": noul}, {"a": noul, "b": score}, {"b": score, "c": choice}, {"c": choice}, {"a": noul, "c": choice}]
    return [{"id": f"r{i}", "state": STATES[i % len(STATES)] if i % len(STATES) != 1 else "a text state",
             "questions": qs} for i, qs in enumerate(sets * 2)]


@pytest.mark.parametrize("questions_as", ["json text", "struct"])
def test_parquet_with_the_request_fields_as_columns(run_dir, predictor, tmp_path, questions_as):
    """A new user's Parquet: `id`, `state` and `questions` columns. A JSON-text `questions` column was rejected
    ("must be an object"), and in a struct column Parquet fills the keys a row lacks with null, so rows whose
    question sets differ were rejected (6 of 9). JSON text is parsed; null-filled questions and fields dropped."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    requests = _column_requests()
    questions = [r["questions"] for r in requests]
    column = [json.dumps(q) for q in questions] if questions_as == "json text" else questions
    table = pa.table({"id": [r["id"] for r in requests], "state": [r["state"] for r in requests],
                      "questions": column})
    if questions_as == "struct":
        assert pa.types.is_struct(table.schema.field("questions").type)
        assert table.column("questions").to_pylist()[0]["b"] is None, "Parquet fills a missing question with null"
    pq.write_table(table, tmp_path / "in.parquet")
    out = tmp_path / "out.jsonl"
    res = invoke(["predict", run_dir, "--input", tmp_path / "in.parquet", "--output", out, "--device", "cpu",
                  "--quiet"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert (summary["answered"], summary["rejected"]) == (len(requests), 0), rejects_path(out).read_text()
    answers = read_output(out)
    assert [sorted(a["answers"]) for a in answers] == [sorted(q) for q in questions]
    check_against_predictor(predictor, requests, answers)


def test_a_processed_split_is_one_request_per_record(run_dir, predictor, tmp_path):
    from conftest import synth_processed

    from rlcd.batch.io import split_request
    from rlcd.data.io import load_split

    data = synth_processed(tmp_path / "data", 4, 1)
    out = tmp_path / "split.jsonl"
    res = invoke(["predict", run_dir, "--data", data, "--split", "test", "--output", out, "--device", "cpu"])
    assert res.exit_code == 0, res.output
    records = load_split(data, "test")
    answers = read_output(out)
    assert [a["id"] for a in answers] == [r.id for r in records]
    for rec, ans in zip(records, answers):
        assert max_diff(ans, predictor.predict(split_request(rec), image_root=data)) < TOL


@pytest.mark.slow
def test_a_killed_job_resumes_to_the_uninterrupted_output(run_dir, tmp_path):
    """SIGKILL a real `rlcd predict` once two parts are committed; --resume finishes it: every id once, and the
    same output as a job never killed."""
    requests = good_requests(5, 8)
    write_input(tmp_path / "in.jsonl", requests, BAD[:3])
    whole, killed = tmp_path / "whole.jsonl", tmp_path / "killed.jsonl"
    args = ["--input", tmp_path / "in.jsonl", "--batch-size", 2, "--chunk-rows", 3, "--device", "cpu", "--quiet"]
    assert invoke(["predict", run_dir, "--output", whole, *args]).exit_code == 0
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rlcd.cli", "predict", str(run_dir), "--output", str(killed),
                             *map(str, args)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    parts = parts_dir(killed)
    deadline = time.monotonic() + 300
    try:
        while len(list(parts.glob("part-*.jsonl"))) < 2:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not killed.exists() and parts.is_dir()
    n_rows = len(requests) + 3
    assert len(list(parts.glob("part-*.jsonl"))) < -(-n_rows // 3)  # killed before the end
    user_error(["predict", run_dir, "--output", killed, *args], contains="--resume")  # no silent restart
    res = invoke(["predict", run_dir, "--output", killed, *args, "--resume"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["rows"] == n_rows and 0 < summary["session_rows"] < n_rows
    a, b = read_output(whole), read_output(killed)
    assert [x["id"] for x in b] == [x["id"] for x in a]  # none lost, none twice, same order
    for x, y in zip(a, b):
        assert x["line"] == y["line"] and max_diff(y, x) < TOL
    assert rejects_path(killed).read_text() == rejects_path(whole).read_text()


def test_command_line_mistakes_are_one_line_and_exit_2(run_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    write_input(src, good_requests(1, 1))
    out = tmp_path / "out.jsonl"
    run = str(run_dir)
    user_error(["predict", run, "--output", out], contains="--input")
    user_error(["predict", run, "--input", tmp_path / "missing.jsonl", "--output", out], contains="no such file")
    user_error(["predict", run, "--input", src], contains="--output")
    user_error(["predict", run, "--input", src, "--output", src], contains="overwrite")
    user_error(["predict", run, "--input", src, "--data", tmp_path, "--output", out], contains="not both")
    user_error(["predict", run, "--data", tmp_path, "--output", out], contains="--split")
    user_error(["predict", run, "--input", src, "--output", out, "--num-actors", 2], contains="--ray")
    user_error(["predict", run, "--input", src, "--output", out, "--state", "x"], contains="one request")
    user_error(["predict", run, "--input", src, "--output", tmp_path / "out.csv"], contains=".parquet")
    user_error(["predict", run, "--input", src, "--output", out, "--batch-size", 0])
    user_error(["predict", run, "--input", src, "--output", out, "--resume"], contains="no unfinished job")
    user_error(["predict", run, "--input", src, "--output", tmp_path / "nodir" / "o.jsonl"], contains="no such dir")
    user_error(["predict", run, "--export", tmp_path, "--input", src, "--output", out], contains="not both")
    out.write_text("")
    user_error(["predict", run, "--input", src, "--output", out], contains="exists")
    assert out.read_text() == "" and not parts_dir(out).exists()  # nothing written before the inputs are checked


def test_a_resume_with_other_options_is_refused(run_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    write_input(src, good_requests(1, 1))
    out = tmp_path / "out.jsonl"
    parts = parts_dir(out)
    parts.mkdir()
    from rlcd.batch.io import input_identity
    from rlcd.batch.local import PredictorSpec

    job = {"input": input_identity(src), **PredictorSpec(run=str(run_dir)).identity()}
    (parts / "job.json").write_text(json.dumps(job))
    user_error(["predict", run_dir, "--input", src, "--output", out, "--resume", "--order-votes", 2],
               contains="order_votes differs")
    src.write_text(src.read_text() + "\n")
    os.utime(src, ns=(1, 1))
    user_error(["predict", run_dir, "--input", src, "--output", out, "--resume"], contains="input differs")


# ------------------------------------------------------------------------------------------------- Ray
@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(SRC), *([old] if old else [])])  # the actors import rlcd
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


@pytest.mark.slow
def test_ray_predict_dataset_equals_the_predictor(ray_cluster, run_dir, predictor):
    from rlcd.batch.local import PredictorSpec
    from rlcd.batch.ray import predict_dataset

    requests = good_requests(4, 2)
    items = [{"id": r["id"], "request": json.dumps({k: v for k, v in r.items() if k != "id"})} for r in requests]
    items.append({"id": "bad", "request": json.dumps({"state": "x", "questions": {"q": {"type": "ranking"}}})})
    ds = ray_cluster.data.from_items(items)
    rows = predict_dataset(ds, PredictorSpec(run=str(run_dir), device="cpu", threads=1), rows_per_call=3,
                           num_actors=1).take_all()
    assert len(rows) == len(items)
    out = {r["id"]: json.loads(r["outcome"]) for r in rows}
    assert out["bad"]["reject"]["field"] == "questions.q.type"
    answers = [{"id": r["id"], **out[r["id"]]["response"]} for r in requests]
    check_against_predictor(predictor, requests, answers)


@pytest.mark.slow
def test_ray_cli_job_has_the_same_answers_rejects_and_layout(ray_cluster, run_dir, predictor, tmp_path):
    requests = good_requests(3, 3)
    bad = write_input(tmp_path / "in.jsonl", requests, BAD[:3])
    out = tmp_path / "ray.jsonl"
    res = invoke(["predict", run_dir, "--input", tmp_path / "in.jsonl", "--output", out, "--ray", "--num-actors", 1,
                  "--chunk-rows", 4, "--threads", 1, "--device", "cpu"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert (summary["answered"], summary["rejected"]) == (len(requests), len(bad))
    answers = read_output(out)
    assert [a["line"] for a in answers] == sorted(a["line"] for a in answers)
    check_against_predictor(predictor, requests, answers)
    assert {json.loads(ln)["line"] for ln in rejects_path(out).read_text().splitlines()} == set(bad)
    assert not parts_dir(out).exists()


def test_a_ray_address_where_nothing_listens_is_one_line_in_bounded_time_and_writes_nothing(run_dir, tmp_path):
    """`--ray --ray-address 127.0.0.1:PORT` with nothing there hung minutes in Ray's retry warnings and left
    FILE.parts behind (blocking the next run). Now: one line, exit 2, in seconds, nothing written. A subprocess
    with a timeout, so the old hang fails the test instead of stalling it."""
    import socket
    import subprocess
    import sys
    import time

    pytest.importorskip("ray")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    write_input(src, good_requests(1, 1))
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "rlcd.cli", "predict", str(run_dir), "--input", str(src), "--output",
                          str(out), "--ray", "--ray-address", f"127.0.0.1:{port}"], capture_output=True, text=True,
                         timeout=90, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert time.monotonic() - t0 < 60
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "no Ray cluster answers there" in lines[0], res.stderr
    assert "Traceback" not in res.stderr
    assert not out.exists() and not parts_dir(out).exists()


def test_the_ray_job_asks_for_its_actors_with_compute_not_the_deprecated_concurrency():
    pytest.importorskip("ray")
    from ray.data import ActorPoolStrategy

    from rlcd.batch.local import PredictorSpec
    from rlcd.batch.ray import predict_dataset

    class Dataset:
        def map_batches(self, fn, **kw):
            self.kw = kw
            return self

    ds = predict_dataset(Dataset(), PredictorSpec(run="r"), num_actors=3)
    assert "concurrency" not in ds.kw, "Ray 2.51+ warns that `concurrency` is deprecated"
    assert isinstance(ds.kw["compute"], ActorPoolStrategy) and ds.kw["compute"].min_size == 3 == ds.kw["compute"].max_size


def test_without_ray_the_ray_option_is_one_line(run_dir, tmp_path):
    import importlib.util

    if importlib.util.find_spec("ray") is not None:
        pytest.skip("ray is installed here")
    src = tmp_path / "in.jsonl"
    write_input(src, good_requests(1, 1))
    user_error(["predict", run_dir, "--input", src, "--output", tmp_path / "o.jsonl", "--ray"],
               contains="rlcd[ray]")


# ------------------------------------------------------------------------------------------------- --export
@pytest.mark.slow
def test_export_runs_the_same_job_on_onnx(tmp_path_factory):
    pytest.importorskip("onnxruntime")
    from _tiny_export import make_tiny_export

    from rlcd.portable.exporter import export_onnx
    from rlcd.portable.runtime import load_portable

    base = tmp_path_factory.mktemp("batch-onnx")
    from conftest import synth_processed

    run = make_tiny_export(base / "run", model_spec="tiny-llama")
    cfg = json.loads((run / "config.json").read_text())
    cfg["data_dir"] = str(synth_processed(base / "data", 40, 3))  # the export's parity check scores its test split
    (run / "config.json").write_text(json.dumps(cfg))
    export_onnx(run, base / "onnx")
    requests = good_requests(3, 2)
    write_input(base / "in.jsonl", requests, BAD[4:5])
    out = base / "out.jsonl"
    res = invoke(["predict", "--export", base / "onnx", "--input", base / "in.jsonl", "--output", out, "--threads", 1])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["rejected"] == 1
    check_against_predictor(load_portable(base / "onnx", threads=1), requests, read_output(out))


# ------------------------------------------------------------------------------------------------- the bench
def test_bench_inputs_are_the_same_rows_per_row_and_per_state(tmp_path):
    from conftest import synth_processed

    from rlcd.batch.io import scan
    from rlcd.bench.batch import bench_inputs
    from rlcd.data.io import load_split

    data = synth_processed(tmp_path / "data", 6, 2)
    path, per_state, n = bench_inputs(data, ("test", "dev"), None, tmp_path)
    records = load_split(data, "test") + load_split(data, "dev")
    rows = list(scan(path))
    assert n == len(records) == len(rows) and [r.id for r in rows] == [r.id for r in records]
    assert sum(len(req["questions"]) for req in per_state) == n  # every row asked once, in its state's request
    assert len(per_state) == len({json.dumps(r.state, sort_keys=True) for r in records})
    for req in per_state:
        mine = [r for r in rows if r.request["state"] == req["state"]]
        assert list(req["questions"].values()) == [r.request["questions"]["q1"] for r in mine]


def test_tree_rss_counts_a_child(tmp_path):
    from rlcd.bench.batch import tree_rss

    alone, n = tree_rss(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; b = b'x' * (64 << 20); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 30
        while True:
            rss, m = tree_rss(os.getpid())
            if rss - alone > 60 << 20 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert m == n + 1 and rss - alone > 60 << 20  # the child's 64 MiB buffer is in the tree's sum
    finally:
        child.kill()
        child.wait()


def test_bench_batch_mistakes_are_one_line(run_dir, tmp_path):
    user_error(["bench", "batch", run_dir, "--actors", "x"], contains="--actors")
    user_error(["bench", "batch", run_dir, "--actors", "0"], contains="--actors")
    user_error(["bench", "batch", tmp_path], contains="export")
    user_error(["bench", "batch", run_dir, "--actors", "", "--dtype", "half"], contains="--dtype")


def test_the_floor_arm_runs_the_rows_true_forwards():
    """The floor's prefix-then-suffix forwards are the real computation: each row's hidden state at its decision
    token equals the decoder's full forward of the row (float32, 1e-4), and the arm counts every row once."""
    from _tiny_export import build_tiny_model

    from rlcd.bench.batch import floor_arm, model_rows, state_forwards
    from rlcd.model.plan import shared_prefix_len

    model = build_tiny_model(model_spec="tiny-llama")
    dec = model.family.text_decoder(model.causal_lm())
    request = {"state": STATES[1], "questions": {f"q{k}": QUESTIONS[k] for k in range(3)}}
    rows = model_rows(model, request)
    assert len(rows) == 3  # the fixed-answer question has no row
    p = shared_prefix_len(rows)
    (h,) = state_forwards(model, dec, rows)
    (h_small, *_rest) = state_forwards(model, dec, rows, max_rows=2)
    assert len(_rest) == 1 and torch.allclose(h_small[:, :4], h[:2, :4], atol=1e-5)
    with torch.inference_mode():
        for i, r in enumerate(rows):
            full = dec(input_ids=torch.tensor([r.ids])).last_hidden_state[0]
            assert torch.allclose(h[i, r.decision_pos - p], full[r.decision_pos], atol=1e-4, rtol=1e-4)
    got = floor_arm(model, [request, {"state": STATES[2], "questions": {"a": QUESTIONS[1]}}], threads=1)
    assert got["rows"] == 4 and got["rows_per_cpu_s"] > 0


def test_answer_diff_is_the_largest_probability_gap():
    from rlcd.bench.batch import answer_diff

    want = {"answers": {"a": {"type": "noul", "noul": 0.25},
                        "b": {"type": "choice", "probabilities": {"x": 0.5, "y": 0.5}}}}
    got = {"answers": {"a": {"type": "noul", "noul": 0.2501},
                       "b": {"type": "choice", "probabilities": {"x": 0.497, "y": 0.503}}}}
    assert abs(answer_diff(got, want) - 0.003) < 1e-12
    assert answer_diff(want, want) == 0.0


def test_ray_blocks_give_every_actor_work_and_stay_within_a_part():
    from rlcd.batch.ray import rows_per_block

    assert rows_per_block(1200, 256, 2) == 150  # 8 blocks: 4 an actor (one block was one actor's alone)
    assert rows_per_block(1_000_000, 256, 8) == 256  # a part's rows at most
    assert rows_per_block(3, 256, 4) == 1 and rows_per_block(0, 256, 2) == 1
    for n, chunk, actors in [(1200, 256, 2), (999, 64, 3), (10, 256, 16), (5000, 256, 1)]:
        per = rows_per_block(n, chunk, actors)
        assert 1 <= per <= chunk and -(-n // per) >= min(n, 4 * actors) or per == chunk
