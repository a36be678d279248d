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


def test_batcher_gathers_what_queued_while_the_model_ran():
    seen = []

    def score_many(items):
        seen.append(list(items))
        time.sleep(0.2)
        return [(x, {}) for x in items]

    b = Batcher(score_many, BatchingConfig(window_ms=1.0, max_batch_questions=3), size_of=lambda p: (1, 0))
    futures = [b.submit(i) for i in range(7)]
    assert [f.result(10)[0] for f in futures] == list(range(7))  # every request gets its own result, in order
    assert seen[0] == [0, 1, 2] and all(len(x) <= 3 for x in seen) and sum(map(len, seen)) == 7
    b.close()
    off = Batcher(score_many, BatchingConfig(window_ms=0.0), size_of=lambda p: (1, 0))
    seen.clear()
    assert [f.result(10)[0] for f in [off.submit(i) for i in range(3)]] == [0, 1, 2]
    assert [len(x) for x in seen] == [1, 1, 1]  # window 0: no batching
    off.close()


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


def test_the_event_loop_stays_free_while_the_model_runs(predictor):
    app = create_app(_slow(predictor, 1.2), batching=BatchingConfig(window_ms=0.0))
    with BackgroundServer(app) as server:
        slow = threading.Thread(target=lambda: httpx.post(server.url + "/v1/systemone", json=REQ, timeout=30,
                                                          trust_env=False))
        slow.start()
        time.sleep(0.2)
        t0 = time.perf_counter()
        h = httpx.get(server.url + "/health", timeout=30, trust_env=False)
        assert h.status_code == 200 and time.perf_counter() - t0 < 0.5
        slow.join()


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


@pytest.mark.slow
def test_soak_5000_requests_10pct_malformed_64_in_flight(predictor):
    """0 5xx, 0 crashes, every malformed request a 4xx, RSS growth < 10% from the first to the last thousand."""
    from rlcd.bench.serve import summarise

    plan = plan_requests(5000, malformed=0.10, sizes=(1, 3), seed=7, max_questions=predictor.limits.max_questions)
    app = create_app(predictor, batching=BatchingConfig(max_queue=256, timeout_s=120))
    rss = []
    with BackgroundServer(app) as server:
        results = []
        for k in range(5):
            chunk, _ = asyncio.run(_load(server.url, plan[1000 * k: 1000 * (k + 1)], concurrency=64, timeout=120,
                                         total_timeout=600))
            results += chunk
            rss.append(_rss_mib())
    s = summarise(results, 1.0, (1, 3))
    assert s["requests"] == 5000 and s["c5xx"] == 0 and s["crashes"] == 0 and s["unexpected"] == 0
    bad = [r for r in results if r["kind"] != "ok"]
    assert len(bad) == 500 and all(400 <= r["status"] < 500 for r in bad)
    assert rss[-1] < 1.10 * rss[0], rss


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
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
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.5)
        want = predictor.predict(REQ)
        got = [httpx.post(url + "/v1/systemone", json=REQ, timeout=60, trust_env=False).json() for _ in range(6)]
        assert all(g["answers"] == want["answers"] for g in got)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert out.count("Started server process") == 2, out[-2000:]
