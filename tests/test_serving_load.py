"""Serving under load: dynamic batching, back-pressure (503 + Retry-After), timeouts, graceful
shutdown, a free event loop, and a bounded soak on loopback."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch

torch.set_num_threads(1)

from _tiny_export import tiny_predictor  # noqa: E402

from rlcd.bench.serve import BackgroundServer, _load, plan_requests  # noqa: E402
from rlcd.predict import Predictor  # noqa: E402
from rlcd.server import create_app  # noqa: E402
from rlcd.serving.batcher import Batcher, BatchingConfig  # noqa: E402
from rlcd.model.runner import CaseRunner  # noqa: E402

STATE = "Order 1182: the courier left the parcel at the wrong address."
REQ = {"state": STATE, "questions": {"angry": {"type": "noul", "instructions": "Is the customer upset?"}}}


@pytest.fixture(scope="module")
def predictor(tmp_path_factory) -> Predictor:
    return tiny_predictor(tmp_path_factory.getbasetemp())


class Slow(Predictor):
    """The tiny predictor with a model that takes `delay` seconds per batch."""

    delay = 0.5

    def score_many(self, prepared):
        time.sleep(self.delay)
        return super().score_many(prepared)


def _slow(predictor, delay):
    p = Slow(predictor.model, predictor.meta, name=predictor.name)
    p.delay = delay
    return p


def _concurrent(url: str, n: int, body=REQ, timeout: float = 60.0) -> list[httpx.Response]:
    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=timeout, trust_env=False) as c:
            return await asyncio.gather(*(c.post("/v1/systemone", json=body) for _ in range(n)))

    return asyncio.run(go())


def _gated_scorer(seen: list):
    """A fake `score_many` that records each batch and holds the first until `release` is set."""
    started, release = threading.Event(), threading.Event()

    def score_many(items):
        seen.append(list(items))
        started.set()
        release.wait(30)
        return [(x, {}) for x in items]

    return score_many, started, release


def test_batcher_gathers_what_queued_while_the_model_ran():
    seen = []
    score_many, started, release = _gated_scorer(seen)
    b = Batcher(score_many, BatchingConfig(window_ms=1.0, max_batch_questions=3), size_of=lambda p: (1, 0))
    futures = [b.submit(0)]
    assert started.wait(10)  # the model is busy with request 0
    futures += [b.submit(i) for i in range(1, 7)]  # these queue while it runs
    release.set()
    assert [f.result(10)[0] for f in futures] == list(range(7))  # every request gets its own result, in order
    assert seen == [[0], [1, 2, 3], [4, 5, 6]]  # gathered into the next batches, up to max_batch_questions
    b.close()
    off = Batcher(score_many, BatchingConfig(window_ms=0.0), size_of=lambda p: (1, 0))
    seen.clear()
    assert [f.result(10)[0] for f in [off.submit(i) for i in range(3)]] == [0, 1, 2]
    assert [len(x) for x in seen] == [1, 1, 1]  # window 0: no batching
    off.close()


def test_an_idle_model_dispatches_a_lone_request_at_once():
    """Continuous batching: a request reaching an idle model is scored at once, even while another request is
    being prepared and the window is a minute long (before: the model thread waited the window for the one on its
    way, and this request's answer took 60 s)."""
    seen = []

    def score_many(items):
        seen.append(list(items))
        return [(x, {}) for x in items]

    b = Batcher(score_many, BatchingConfig(window_ms=60_000.0), size_of=lambda p: (1, 0))
    with b.arriving():  # another request on its way, never submitted while we wait
        with b.arriving():
            lone = b.submit("a")
        assert lone.result(10)[0] == "a"
    assert seen == [["a"]]
    b.close()


def test_a_busy_model_waits_the_window_for_requests_on_their_way():
    """Behind a busy model, the batch gathered next also waits (up to the window) for a request still being
    prepared: both share the next forward."""
    seen = []
    score_many, started, release = _gated_scorer(seen)
    b = Batcher(score_many, BatchingConfig(window_ms=60_000.0), size_of=lambda p: (1, 0))
    first = b.submit("a")
    assert started.wait(10)
    queued = b.submit("b")  # queued while "a" runs
    with b.arriving():  # "c" is being prepared when "a" ends
        release.set()
        time.sleep(0.3)
        late = b.submit("c")
    assert [f.result(10)[0] for f in (first, queued, late)] == ["a", "b", "c"]
    assert seen == [["a"], ["b", "c"]]
    b.close()


def test_a_full_queue_is_a_503_with_retry_after(predictor):
    app = create_app(_slow(predictor, 0.4), batching=BatchingConfig(window_ms=0.0, max_queue=2, timeout_s=60))
    with BackgroundServer(app) as server:
        rs = _concurrent(server.url, 10)
    codes = sorted(r.status_code for r in rs)
    assert codes.count(503) >= 5 and set(codes) <= {200, 503}, codes
    for r in rs:
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1
            assert "overloaded" in r.json()["detail"][0]["msg"]
        else:
            assert r.json()["answers"]["angry"]["type"] == "noul"


def test_a_request_waiting_past_its_timeout_is_a_503(predictor):
    app = create_app(_slow(predictor, 1.5), batching=BatchingConfig(window_ms=0.0, timeout_s=0.3))
    with BackgroundServer(app) as server:
        t0 = time.perf_counter()
        r = httpx.post(server.url + "/v1/systemone", json=REQ, timeout=30, trust_env=False)
        took = time.perf_counter() - t0
    assert r.status_code == 503 and "no answer within 0.3 s" in r.json()["detail"][0]["msg"]
    assert "retry-after" in r.headers and took < 1.4  # answered at the timeout, not after the model


class Gated(Predictor):
    """The tiny predictor with a model that holds each batch until `release` is set (`started` says it runs)."""

    def score_many(self, prepared):
        self.started.set()
        assert self.release.wait(30), "the test never released the model"
        return super().score_many(prepared)


def test_the_event_loop_stays_free_while_the_model_runs(predictor):
    """/health answers while a request is inside the model: the model holds until the health answer has come back, so
    a server that ran the model on its event loop would time the health request out (no wall-clock bound: on a
    loaded CI machine 0.5 s was missed without anything being wrong)."""
    gated = Gated(predictor.model, predictor.meta, name=predictor.name)
    gated.started, gated.release = threading.Event(), threading.Event()
    app = create_app(gated, batching=BatchingConfig(window_ms=0.0))
    out: list[httpx.Response] = []
    with BackgroundServer(app) as server:
        slow = threading.Thread(target=lambda: out.append(
            httpx.post(server.url + "/v1/systemone", json=REQ, timeout=60, trust_env=False)))
        slow.start()
        try:
            assert gated.started.wait(30), "the request never reached the model"
            h = httpx.get(server.url + "/health", timeout=10, trust_env=False)
            assert h.status_code == 200 and not out  # answered while the model still held the request
        finally:
            gated.release.set()
            slow.join(60)
    assert [r.status_code for r in out] == [200]


def test_graceful_shutdown_answers_what_is_in_flight(predictor):
    app = create_app(_slow(predictor, 0.3), batching=BatchingConfig(window_ms=0.0))
    server = BackgroundServer(app).start()
    out: list[httpx.Response] = []
    t = threading.Thread(target=lambda: out.extend(_concurrent(server.url, 4)))
    t.start()
    time.sleep(0.25)  # all four are in: one running, three queued
    server.stop()
    t.join(30)
    assert [r.status_code for r in out] == [200] * 4
    assert not app.state.batcher.thread.is_alive()


CACHE_MB = 16  # the soak's state cache bound (MiB)


@pytest.mark.slow
def test_soak_5000_requests_10pct_malformed_64_in_flight(tmp_path_factory):
    """Against a real `rlcd serve` process on loopback: 0 5xx, 0 crashes, every malformed request a 4xx,
    and the server's RSS after the last thousand requests within 10% of its RSS after the first thousand, plus the
    state cache's bound (it keeps up to CACHE_MB of decoder states by design; 256 MiB by default)."""
    import os
    import subprocess
    import sys

    from _tiny_export import tiny_export

    from rlcd.bench.serve import summarise

    run = tiny_export(tmp_path_factory.getbasetemp())
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "rlcd.cli", "serve", str(run), "--port", str(port), "--device",
                               "cpu", "--state-cache-mb", str(CACHE_MB)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, server)
        plan = plan_requests(5000, malformed=0.10, sizes=(1, 3), seed=7, max_questions=64)
        results, rss = [], []
        for k in range(5):
            chunk, _ = asyncio.run(_load(url, plan[1000 * k: 1000 * (k + 1)], concurrency=64, timeout=120,
                                         total_timeout=600))
            results += chunk
            rss.append(_rss_mib(server.pid))
    finally:
        server.terminate()
        server.wait(60)
    s = summarise(results, 1.0, (1, 3))
    assert s["requests"] == 5000 and s["c5xx"] == 0 and s["crashes"] == 0 and s["unexpected"] == 0, s["first_errors"]
    bad = [r for r in results if r["kind"] != "ok"]
    assert len(bad) == 500 and all(400 <= r["status"] < 500 for r in bad)
    assert rss[-1] < 1.10 * rss[0] + CACHE_MB, rss  # the state cache may fill up to its bound, nothing else may grow


def _wait_healthy(url: str, proc, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
        time.sleep(0.3)


def _rss_mib(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_with_two_uvicorn_workers(tmp_path_factory, predictor):
    """`rlcd serve RUN --workers 2`: uvicorn's process manager, two processes each with its own model."""
    import os
    import signal
    import subprocess
    import sys

    from _tiny_export import tiny_export

    run = tiny_export(tmp_path_factory.getbasetemp())
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rlcd.cli", "serve", str(run), "--workers", "2", "--port",
                             str(port), "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc)
        want = predictor.predict(REQ)
        got = [httpx.post(url + "/v1/systemone", json=REQ, timeout=60, trust_env=False).json() for _ in range(6)]
        assert all(g["answers"] == want["answers"] for g in got)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert out.count("Started server process") == 2, out[-2000:]


# ------------------------------------------------------------------------------ batched == solo
def _image(seed: int):
    from PIL import Image

    return Image.new("RGB", (32 + 8 * seed, 40), (50 * seed % 256, 90, 200))


def _questions(k: int, seed: int) -> list:
    from rlcd.schema import Question

    pool = [Question(type="choice", instructions=f"Which team (#{seed})?", criteria=["billing", "shipping", "returns"]),
            Question(type="noul", instructions="Is the customer upset about the long delay?"),
            Question(type="score", instructions="How urgent?", criteria=["low", "mid", "high", "very high"]),
            Question(type="choice", instructions="Which channel?", criteria={"mail": "an email", "phone": None})]
    return [pool[(seed + j) % len(pool)] for j in range(k)]


@pytest.mark.parametrize("spec", ["tiny-toy", "tiny-llama"])
def test_score_cases_equals_each_request_alone(spec):
    """Mixed sizes and states (and images on the vision backbone) in one batched call: every request's
    probabilities within 1e-4 of its solo call."""
    from rlcd.model.build import build_model

    model = build_model({"model": spec, "recipe": {}}).eval()
    with torch.no_grad():  # sharpen the random head so probabilities are far from uniform
        model.head.w_d.weight.mul_(8)
        model.head.w_c.weight.mul_(8)
    states = ["short", STATE * 3, {"ticket": 7, "text": "json state"}, "another one with more words in it", STATE]
    images = model.supports_images
    runner = CaseRunner(model)
    cases = [runner.prepare_case(st, _questions(1 + i % 4, i), _image(i) if images and i % 2 == 0 else None)
             for i, st in enumerate(states)]
    solo = [runner.score_cases([c])[0] for c in cases]
    batched = runner.score_cases(cases)
    assert len({u["calls"] for _, u in batched}) == 1 and batched[0][1]["batched_requests"] == len(cases)
    worst = 0.0
    for (s_logits, s_usage), (b_logits, b_usage) in zip(solo, batched):
        assert s_usage["input_tokens"] == b_usage["input_tokens"] and s_usage["image_tokens"] == b_usage["image_tokens"]
        for a, b in zip(s_logits, b_logits):
            worst = max(worst, float((a.softmax(-1) - b.softmax(-1)).abs().max()))
    assert worst < 1e-4
    spread = max(float(x.softmax(-1).max() - x.softmax(-1).min()) for lg, _ in solo for x in lg)
    assert spread > 0.2, "the check needs answers far from uniform"


def test_concurrent_requests_are_batched_and_each_gets_its_solo_answer(predictor):
    import base64
    import io

    def b64(seed):
        buf = io.BytesIO()
        _image(seed).save(buf, format="PNG")
        return base64.b64encode(buf.getvalue()).decode()

    requests = []
    for i in range(12):
        qs = {f"q{j}": q.model_dump(exclude_none=True) for j, q in enumerate(_questions(1 + i % 5, i))}
        req = {"state": f"{STATE} (case {i})" + " more words" * (i % 3), "questions": qs}
        if i % 3 == 0:
            req["image"] = {"base64": b64(i)}
        requests.append(req)
    solo = [predictor.predict(r if "image" not in r else {k: v for k, v in r.items() if k != "image"},
                              _image(i) if "image" in r else None) for i, r in enumerate(requests)]
    app = create_app(_slow(predictor, 0.05), batching=BatchingConfig(window_ms=20.0))

    async def go(url):
        async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as c:
            return await asyncio.gather(*(c.post("/v1/systemone", json=r) for r in requests))

    with BackgroundServer(app) as server:
        got = asyncio.run(go(server.url))
        stats = app.state.batcher.stats()
    assert stats["requests"] == 12 and stats["batches"] < 12, stats  # some requests shared a forward
    for r, want in zip(got, solo):
        assert r.status_code == 200, r.text
        body = r.json()
        for qid, w in want["answers"].items():
            g = body["answers"][qid]
            probs = (lambda a: [a["noul"]] if a["type"] == "noul" else list(a["probabilities"].values()))
            assert max(abs(x - y) for x, y in zip(probs(g), probs(w))) < 1e-4


def test_every_served_connection_turns_nagle_off(monkeypatch):
    """uvicorn's --workers mode binds with protocol 0, so asyncio leaves Nagle on and each response
    waited ~40 ms for a delayed ACK: rlcd's protocol sets TCP_NODELAY on every accepted connection,
    and `serve` uses it with and without workers."""
    import socket as S

    import uvicorn

    from rlcd import server as srv
    from rlcd.serving.transport import NoDelayH11Protocol, set_nodelay

    lsock = S.socket(S.AF_INET, S.SOCK_STREAM)  # protocol 0, as uvicorn binds for workers
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    client = S.create_connection(lsock.getsockname())
    conn, _ = lsock.accept()

    class Transport:
        def get_extra_info(self, name):
            return conn if name == "socket" else None

    try:
        assert conn.getsockopt(S.IPPROTO_TCP, S.TCP_NODELAY) == 0  # what asyncio would have left
        assert set_nodelay(Transport()) and conn.getsockopt(S.IPPROTO_TCP, S.TCP_NODELAY) == 1
    finally:
        for s in (client, conn, lsock):
            s.close()

    calls = []
    monkeypatch.setenv(srv.SERVE_ENV, "")  # serve(workers=2) sets it; monkeypatch puts it back
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: calls.append(k))
    monkeypatch.setattr(srv.Predictor, "from_run", classmethod(lambda cls, *a, **k: object()))
    monkeypatch.setattr(srv, "create_app", lambda *a, **k: object())
    srv.serve("some/run", workers=2)
    srv.serve("some/run", workers=1)
    assert [k["http"] for k in calls] == [NoDelayH11Protocol, NoDelayH11Protocol]


@pytest.mark.parametrize("spec", ["tiny-toy", "tiny-llama"])
def test_a_batch_whose_longest_rows_all_belong_to_the_first_request(spec):
    """The last suffix call reads the prefix cache itself; when all its rows are request 0's, each must
    still get request 0's row of a cache as wide as the batch (a one-row repeat of every row broke this:
    a shape error on the text decoder)."""
    from rlcd.model.build import build_model
    from rlcd.schema import Question

    model = build_model({"model": spec, "recipe": {}}).eval()
    crit = {f"option{i}": "a long description of this option with many many words in it" for i in range(8)}
    long_q = Question(type="choice", instructions="Which option fits the ticket best of all?", criteria=crit)
    short_q = Question(type="noul", instructions="Late?")
    runner = CaseRunner(model)
    cases = [runner.prepare_case("first state", [long_q, long_q]), runner.prepare_case("second state", [short_q] * 2)]
    batched = runner.score_cases(cases, path="prefix")  # short states: the planner alone would pick full rows
    assert batched[0][1]["calls"] >= 2, "the rows must split into calls by length for this check"
    for case, (b_logits, _) in zip(cases, batched):
        (s_logits, _), = runner.score_cases([case], path="prefix")
        for a, b in zip(s_logits, b_logits):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
