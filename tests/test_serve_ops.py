"""What an operator runs `rlcd serve` with: /ready (warm-up), /drain (with a request in flight), /metrics (scraped and
parsed with prometheus_client's own parser), and the JSON access log."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch

torch.set_num_threads(1)

from _tiny_export import tiny_export, tiny_predictor  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from rlcd.bench.serve import BackgroundServer  # noqa: E402
from rlcd.predict import Predictor  # noqa: E402
from rlcd.server import create_app  # noqa: E402
from rlcd.serving.gating import Gates  # noqa: E402

KEY = "ops-key-7Qx.2_k"
STATE = "Order 1182: the courier left the parcel at the wrong address."
REQ = {"state": STATE, "questions": {"angry": {"type": "noul", "instructions": "Is the customer upset?"}}}
MIXED = {"state": STATE, "questions": {
    "team": {"type": "choice", "instructions": "Which team?", "criteria": ["billing", "shipping", "returns"]},
    "only": {"type": "choice", "criteria": {"shipping": None}},  # one option: a fixed answer, not the model's
    "upset": {"type": "noul", "instructions": "Is the customer upset?"},
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high"]}}}
# per-type gates: every choice answer is auto (threshold 0), every noul escalates (1.01 > any confidence), no score gate
GATES = {"version": 1, "model": "tiny-run", "questions": {}, "definitions": {},
         "x_rlcd": {"types": {"choice": {"threshold": 0.0}, "noul": {"threshold": 1.01}}}}


@pytest.fixture(scope="module")
def predictor(tmp_path_factory) -> Predictor:
    return tiny_predictor(tmp_path_factory.getbasetemp())


class Held(Predictor):
    """The tiny predictor whose model waits for the test: `entered` is set when a batch reaches the model, which
    then waits for `release` (events, not sleeps: the checks hold however slow the machine is)."""

    calls = 0

    def score_many(self, prepared):
        self.calls += 1
        self.entered.set()
        assert self.release.wait(120), "the test never released the model"
        return super().score_many(prepared)


def _held(predictor, released: bool) -> Held:
    p = _like(Held, predictor, entered=threading.Event(), release=threading.Event())
    if released:
        p.release.set()
    return p


class Broken(Predictor):
    def score_many(self, prepared):
        raise RuntimeError("the device is gone")


def _like(cls, predictor, **attrs):
    p = cls(predictor.model, predictor.meta, name=predictor.name)
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def _bearer(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _samples(text: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of a scrape, read by prometheus_client's own parser."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict, name: str, **labels) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def _wait_ready(get, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while get("/ready").status_code != 200:
        assert time.monotonic() < deadline, "never ready"
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------------ /ready
def test_ready_waits_for_the_warm_up_and_health_does_not(predictor):
    held = _held(predictor, released=False)
    app = create_app(held, batching=_no_window())
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=30, trust_env=False) as http:
        assert held.entered.wait(60)  # the warm-up is in the model, which waits
        assert http.get("/health").status_code == 200  # alive meanwhile
        r = http.get("/ready")
        assert r.status_code == 503 and r.json()["ready"] is False and "warming up" in r.json()["reason"]
        held.release.set()
        _wait_ready(http.get)
        assert http.get("/ready").json() == {"ready": True, "model": predictor.name}
        assert held.calls == 1  # the warm-up went through the model thread...
        assert app.state.batcher.stats()["requests"] == 0  # ...and is not in the numbers of the served requests
        assert http.post("/v1/systemone", json=REQ).json() == predictor.predict(REQ)


def test_ready_says_when_the_model_is_not_loaded_yet(predictor):
    loading = threading.Event()

    def load():
        assert loading.wait(120)
        return predictor.model

    lazy = Predictor(None, predictor.meta, name=predictor.name, loader=load)
    with TestClient(create_app(lazy)) as c:  # `with`: the lifespan runs, and with it the warm-up
        r = c.get("/ready")
        assert r.status_code == 503 and r.json()["reason"] == "the model is not loaded yet"
        assert not lazy.loaded
        loading.set()
        _wait_ready(c.get)
        assert lazy.loaded


def test_a_failed_warm_up_keeps_the_server_unready_with_the_reason(predictor):
    with TestClient(create_app(_like(Broken, predictor))) as c:
        deadline = time.monotonic() + 30
        while "failed" not in c.get("/ready").json().get("reason", ""):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = c.get("/ready")
        assert r.status_code == 503
        assert r.json()["reason"] == "the warm-up request failed: RuntimeError: the device is gone"
        assert c.get("/health").status_code == 200


# ------------------------------------------------------------------------------------------------ /drain
def test_drain_finishes_the_request_in_flight_then_refuses_and_unreadies(predictor):
    held = _held(predictor, released=True)
    app = create_app(held, api_key=KEY, batching=_no_window())
    done: dict[str, tuple[float, httpx.Response]] = {}

    def post(name, path, **kw):
        with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as c:
            r = c.post(path, headers=_bearer(), **kw)
        done[name] = (time.monotonic(), r)

    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=30, trust_env=False) as http:
        _wait_ready(http.get)
        assert http.post("/drain").status_code == 401  # the key guards it: nobody else takes the server out
        held.release.clear()
        held.entered.clear()
        in_flight = threading.Thread(target=post, args=("request", "/v1/systemone"), kwargs={"json": REQ})
        in_flight.start()
        assert held.entered.wait(60)  # the request is in the model, which waits
        assert _value(_samples(http.get("/metrics").text), "rlcd_http_requests_in_flight") == 1
        drain = threading.Thread(target=post, args=("drain", "/drain"))
        drain.start()
        deadline = time.monotonic() + 60
        while http.get("/ready").json().get("reason", "") != "draining: this server takes no new requests":
            assert time.monotonic() < deadline, "the drain did not start"
            time.sleep(0.02)
        refused = http.post("/v1/systemone", json=REQ, headers=_bearer())
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["detail"][0]["type"] == "draining" and "draining" in refused.json()["detail"][0]["msg"]
        ready = http.get("/ready")
        assert ready.status_code == 503 and ready.json()["reason"].startswith("draining")
        assert http.get("/health").status_code == 200  # still alive: liveness is not readiness
        time.sleep(0.2)
        assert drain.is_alive() and "drain" not in done  # the drain waits for the request the model holds
        released_at = time.monotonic()
        held.release.set()
        in_flight.join(60)
        drain.join(60)
        assert "drain" in done, "the drain did not return"
        r = done["request"][1]
        assert r.status_code == 200 and r.json()["answers"] == predictor.predict(REQ)["answers"]  # not dropped
        # the drain answered only once the model let the request go, with nothing left in flight (the two client
        # threads' own clocks after their responses can land in either order: that was a race, not the server's)
        assert done["drain"][0] >= released_at
        assert done["drain"][1].status_code == 200 and done["drain"][1].json() == {"status": "drained", "in_flight": 0}
        assert http.get("/ready").status_code == 503  # for good
        assert http.get("/v1/models", headers=_bearer()).status_code == 503


# ------------------------------------------------------------------------------------------------ /metrics
def test_metrics_count_the_requests_answers_and_gate_decisions_sent(predictor):
    n, bad = 5, 2
    with TestClient(create_app(predictor, thresholds=Gates(GATES))) as c:
        _wait_ready(c.get)
        answers = [c.post("/v1/systemone", json=MIXED).json()["answers"] for _ in range(n)]
        for _ in range(bad):
            assert c.post("/v1/systemone", json={"state": STATE}).status_code == 422
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    s = _samples(r.text)
    latency = "rlcd_http_request_duration_seconds_count"
    assert _value(s, latency, route="/v1/systemone", status_class="2xx") == n
    assert _value(s, latency, route="/v1/systemone", status_class="4xx") == bad
    # one model-scored question per type per request; the one-option choice is fixed, so not counted
    for t in ("choice", "noul", "score"):
        assert _value(s, "rlcd_answer_confidence_count", type=t) == n, t
    choice_sum = sum(a["team"]["confidence"] for a in answers)
    assert _value(s, "rlcd_answer_confidence_sum", type="choice") == pytest.approx(choice_sum)
    assert _value(s, "rlcd_answer_confidence_sum", type="noul") == pytest.approx(
        sum(abs(a["upset"]["noul"] - 0.5) * 2 for a in answers))
    assert _value(s, "rlcd_gate_decisions_total", type="choice", decision="auto") == n
    assert _value(s, "rlcd_gate_decisions_total", type="noul", decision="escalate") == n
    assert _value(s, "rlcd_gate_decisions_total", type="score", decision="ungated") == n
    assert _value(s, "rlcd_gate_decisions_total", type="choice", decision="escalate") == 0
    # batches: every answered request once, the warm-up not at all; 4 questions per request
    assert _value(s, "rlcd_batch_requests_sum") == n and _value(s, "rlcd_batch_questions_sum") == 4 * n
    assert 1 <= _value(s, "rlcd_batch_requests_count") <= n
    assert _value(s, "rlcd_batch_duration_seconds_count") == _value(s, "rlcd_batch_requests_count")
    assert _value(s, "rlcd_queue_depth") == 0 and _value(s, "rlcd_http_requests_in_flight") == 0
    assert _value(s, "rlcd_ready") == 1
    # the Predictor's own state cache (on by default), read at the scrape: the same counters it reports itself
    stats = predictor.state_cache_stats()
    assert stats["max_bytes"] > 0 and stats["hits"] + stats["misses"] > 0
    assert _value(s, "rlcd_state_cache_hits_total") == stats["hits"]
    assert _value(s, "rlcd_state_cache_misses_total") == stats["misses"]
    assert _value(s, "rlcd_state_cache_bytes") == stats["bytes"]


def test_metrics_export_the_state_cache_and_each_app_has_its_own_registry(predictor):
    stats = {"hits": 7, "misses": 3, "entries": 2, "bytes": 4096, "evictions": 1, "note": "not a number"}
    cached = _like(Predictor, predictor, state_cache_stats=lambda: dict(stats))
    with TestClient(create_app(cached)) as a, TestClient(create_app(predictor)) as b:
        _wait_ready(a.get)
        _wait_ready(b.get)
        a.post("/v1/systemone", json=REQ)
        a.post("/v1/systemone", json=REQ)
        sa, sb = _samples(a.get("/metrics").text), _samples(b.get("/metrics").text)
    assert _value(sa, "rlcd_state_cache_hits_total") == 7 and _value(sa, "rlcd_state_cache_misses_total") == 3
    assert _value(sa, "rlcd_state_cache_evictions_total") == 1
    assert _value(sa, "rlcd_state_cache_entries") == 2 and _value(sa, "rlcd_state_cache_bytes") == 4096
    assert not any("note" in name for name, _ in sa)
    assert "rlcd_gate_decisions_total" not in {name for name, _ in sa}  # no thresholds file, no gate metrics
    two = "rlcd_http_request_duration_seconds_count"
    assert _value(sa, two, route="/v1/systemone", status_class="2xx") == 2
    assert _value(sb, two, route="/v1/systemone", status_class="2xx") is None  # b saw none of a's requests
    assert _value(sb, "rlcd_answer_confidence_count", type="noul") == 0


def test_made_up_paths_share_one_route_label(predictor):
    with TestClient(create_app(predictor)) as c:
        for i in range(5):
            c.get(f"/scan/{i}")
        s = _samples(c.get("/metrics").text)
    routes = {dict(labels).get("route") for name, labels in s if name == "rlcd_http_request_duration_seconds_count"}
    assert _value(s, "rlcd_http_request_duration_seconds_count", route="other", status_class="4xx") == 5
    assert not any(r and r.startswith("/scan") for r in routes)


# ------------------------------------------------------------------------------------------------ JSON access log
def test_json_access_log_one_object_per_line(predictor, capsys):
    c = TestClient(create_app(predictor, api_key=KEY, access_log="json"))
    capsys.readouterr()
    want = predictor.predict(MIXED)
    c.post("/v1/systemone", json=MIXED, headers={**_bearer(), "X-Request-ID": 'r-1", "status": 999'})
    c.post("/v1/systemone", json={"state": STATE}, headers=_bearer())
    c.get("/health")
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("{")]
    ok, bad, health = (json.loads(ln) for ln in lines)
    assert list(ok) == ["time", "request_id", "client", "method", "path", "status", "questions", "tokens", "queue_ms",
                        "model_ms", "latency_ms"]
    assert ok["request_id"] == 'r-1", "status": 999' and ok["status"] == 200  # a forged id stays one value
    assert (ok["method"], ok["path"], ok["questions"]) == ("POST", "/v1/systemone", 4)
    assert ok["tokens"] == want["usage"]["input_tokens"] > 0 and ok["latency_ms"] >= ok["model_ms"] > 0
    assert ok["time"].endswith("+00:00") and "T" in ok["time"]
    assert bad["status"] == 422 and bad["questions"] is None and bad["tokens"] is None
    assert health["path"] == "/health" and health["status"] == 200 and len(health["request_id"]) == 32
    assert KEY not in "\n".join(lines) and STATE not in "\n".join(lines)
    with pytest.raises(ValueError, match="text, json"):
        create_app(predictor, access_log="xml")


@pytest.fixture
def no_uvicorn(monkeypatch, predictor):
    import uvicorn

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append((app, kw)))
    monkeypatch.setattr(Predictor, "from_run", classmethod(lambda cls, *a, **kw: predictor))
    return calls


def test_serve_passes_the_format_to_the_app_and_the_workers(no_uvicorn, tmp_path, monkeypatch, capsys):
    import os

    from rlcd.server import SERVE_ENV, app_from_env, serve

    monkeypatch.setenv(SERVE_ENV, "{}")
    serve(tmp_path, access_log="json")
    capsys.readouterr()
    TestClient(no_uvicorn[-1][0]).get("/health")
    assert json.loads(capsys.readouterr().err.strip())["path"] == "/health"
    serve(tmp_path, quiet=True, access_log="json")
    TestClient(no_uvicorn[-1][0]).get("/health")
    assert capsys.readouterr().err == ""
    run = tiny_export(tmp_path.parent)
    serve(run, access_log="json", workers=2)
    assert json.loads(os.environ[SERVE_ENV])["access_log"] == "json"
    TestClient(app_from_env()).get("/health")
    assert json.loads(capsys.readouterr().err.strip())["status"] == 200


def test_cli_access_log_option(monkeypatch, tmp_path_factory):
    from typer.testing import CliRunner

    import rlcd.server
    from rlcd.cli import app

    seen = {}
    monkeypatch.setattr(rlcd.server, "serve", lambda path, **kw: seen.update(kw))
    run = str(tiny_export(tmp_path_factory.getbasetemp()))
    runner = CliRunner()
    assert runner.invoke(app, ["serve", "--run", run]).exit_code == 0 and seen["access_log"] == "text"
    assert runner.invoke(app, ["serve", "--run", run, "--access-log", "json"]).exit_code == 0
    assert seen["access_log"] == "json"
    for args, why in ((["--access-log", "xml"], "'xml' is not one of"),
                      (["--quiet", "--access-log", "json"], "give --quiet or --access-log, not both")):
        res = runner.invoke(app, ["serve", "--run", run, *args])
        assert res.exit_code == 2 and why in res.stderr, res.stderr
        error, *rest = res.stderr.strip().splitlines()  # the error, then the CLI's "Try '... --help'." hint
        assert " serve: error: " in error and why in error and len(rest) <= 1 and "Traceback" not in res.stderr


def _no_window():
    from rlcd.serving.batcher import BatchingConfig

    return BatchingConfig(window_ms=0.0)
