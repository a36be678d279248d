"""`rlcd serve --api-key` (Bearer on /v1/*, /health open, OpenAPI scheme, workers) and the access log line."""

from __future__ import annotations

import json
import re

import pytest
import torch

torch.set_num_threads(1)

from _tiny_export import tiny_export, tiny_predictor  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from rlcd.server import create_app  # noqa: E402
from rlcd.serving.access import ACCESS_FIELDS, API_KEY_ENV  # noqa: E402

KEY = "k3y-Sx9q.7_secret"
WRONG = "k3y-Sx9q.7_secreT"  # one character off
STATE = "Order 1182: the courier left the parcel at the wrong address; SECRET-STATE-TEXT."
REQUEST = {"state": STATE, "questions": {
    "team": {"type": "choice", "instructions": "Which team?", "criteria": ["billing", "shipping", "returns"]},
    "upset": {"type": "noul", "instructions": "Is the customer upset?"},
    "only": {"type": "choice", "criteria": {"shipping": None}}}}
LINE = re.compile(r"^rlcd\.access " + " ".join(rf"{f}=(?P<{f}>\S+)" for f in ACCESS_FIELDS) + "$")


@pytest.fixture(scope="module")
def predictor(tmp_path_factory):
    return tiny_predictor(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def client(predictor):
    return TestClient(create_app(predictor, api_key=KEY, access_log=True))


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _lines(err: str) -> list[dict]:
    out = []
    for line in err.splitlines():
        if line.startswith("rlcd.access"):
            m = LINE.match(line)
            assert m, line
            out.append(m.groupdict())
    return out


def test_v1_needs_the_key_and_health_does_not(client, predictor, capsys):
    capsys.readouterr()
    for path, call in (("/v1/systemone", lambda h: client.post("/v1/systemone", json=REQUEST, headers=h)),
                       ("/v1/models", lambda h: client.get("/v1/models", headers=h))):
        for headers, why in (({}, "Not authenticated"), (_bearer(WRONG), "Invalid API key"),
                             ({"Authorization": f"Basic {KEY}"}, "must be 'Bearer"), (_bearer(""), "must be 'Bearer")):
            r = call(headers)
            assert r.status_code == 401, (path, headers)
            # the official API's shape: {"detail": {"error_type": "authentication_error", "message": ...}}
            assert set(r.json()) == {"detail"} and r.json()["detail"]["error_type"] == "authentication_error"
            assert why in r.json()["detail"]["message"]
            assert r.headers["www-authenticate"] == "Bearer" and r.headers["x-request-id"]
            assert KEY not in r.text and WRONG not in r.text
        assert call(_bearer(KEY)).status_code == 200
        assert call({"Authorization": f"bearer  {KEY} "}).status_code == 200  # scheme case, spaces: as RFC 7235
    assert client.post("/v1/systemone", json=REQUEST, headers=_bearer(KEY)).json() == predictor.predict(REQUEST)
    assert client.get("/v1/nothing").status_code == 401  # every /v1 path, even one that does not exist
    assert client.get("/v1/nothing", headers=_bearer(KEY)).status_code == 404
    for path in ("/health", "/healthz"):
        assert client.get(path).status_code == 200
    err = capsys.readouterr().err
    assert KEY not in err and WRONG not in err and "SECRET-STATE-TEXT" not in err
    assert len(_lines(err)) == 2 * 4 + 2 * 2 + 1 + 2 + 2


def test_openapi_declares_the_bearer_scheme(client, predictor):
    doc = client.get("/openapi.json").json()  # the docs stay open: they hold no secret
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert doc["paths"]["/v1/systemone"]["post"]["security"] == [{"HTTPBearer": []}]
    assert doc["paths"]["/v1/models"]["get"]["security"] == [{"HTTPBearer": []}]
    assert "401" in doc["paths"]["/v1/systemone"]["post"]["responses"]
    assert "security" not in doc["paths"]["/health"]["get"]
    assert KEY not in json.dumps(doc)
    plain = TestClient(create_app(predictor)).get("/openapi.json").json()
    assert "securitySchemes" not in plain["components"]  # no key, no scheme


def test_bad_keys_are_refused(predictor):
    for key in ("", "has space", "naïve"):
        with pytest.raises(ValueError, match="--api-key"):
            create_app(predictor, api_key=key)


def test_access_line_fields(client, predictor, capsys):
    capsys.readouterr()
    want = predictor.predict(REQUEST)
    r = client.post("/v1/systemone", json=REQUEST, headers={**_bearer(KEY), "X-Request-ID": "abc-123"})
    assert r.status_code == 200
    only = {"state": STATE, "questions": {"only": REQUEST["questions"]["only"]}}
    client.post("/v1/systemone", json=only, headers=_bearer(KEY))
    client.post("/v1/systemone", json={"state": STATE}, headers=_bearer(KEY))  # 422
    client.get("/health", headers={"X-Request-ID": "evil id\tstatus=200"})
    ok, fixed, bad, health = _lines(capsys.readouterr().err)
    assert ok["rid"] == "abc-123" and ok["method"] == "POST" and ok["path"] == "/v1/systemone"
    assert ok["status"] == "200" and ok["questions"] == "3"
    assert int(ok["input_tokens"]) == want["usage"]["input_tokens"] > 0
    assert float(ok["queue_ms"]) >= 0 and float(ok["model_ms"]) > 0
    assert float(ok["total_ms"]) >= float(ok["model_ms"]) + float(ok["queue_ms"]) - 0.2  # rounding to 0.1 ms
    assert (fixed["status"], fixed["questions"], fixed["input_tokens"], fixed["model_ms"]) == ("200", "1", "0", "0.0")
    assert bad["status"] == "422" and bad["questions"] == bad["input_tokens"] == bad["model_ms"] == "-"
    assert health["rid"] == "evil_id_status=200" and health["status"] == "200"  # one field, one line


def test_no_access_log_when_quiet(predictor, capsys):
    quiet = TestClient(create_app(predictor, api_key=KEY))  # access_log=False: what --quiet passes
    capsys.readouterr()
    assert quiet.post("/v1/systemone", json=REQUEST, headers=_bearer(KEY)).status_code == 200
    assert quiet.get("/health").status_code == 200
    assert "rlcd.access" not in capsys.readouterr().err


# ------------------------------------------------------------------------------- serve() and the CLI
@pytest.fixture
def no_uvicorn(monkeypatch, predictor):
    """serve() up to uvicorn.run: the calls it would make, with the tiny predictor instead of a load."""
    import uvicorn

    from rlcd.predict import Predictor

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append((app, kw)))
    monkeypatch.setattr(Predictor, "from_run", classmethod(lambda cls, *a, **kw: predictor))
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    return calls


def test_serve_warns_once_on_an_exposed_host_without_a_key(no_uvicorn, tmp_path, capsys):
    from rlcd.server import serve

    for host, key, warned in (("0.0.0.0", None, True), ("192.168.1.20", None, True), ("0.0.0.0", KEY, False),
                              ("127.0.0.1", None, False), ("::1", None, False), ("localhost", None, False)):
        serve(tmp_path, host=host, api_key=key)
        err = capsys.readouterr().err
        assert err.count("warning:") == (1 if warned else 0), (host, key, err)
        if warned:
            assert len(err.strip().splitlines()) == 1 and host in err and API_KEY_ENV in err
        assert no_uvicorn[-1][1]["access_log"] is False  # uvicorn's own line off: rlcd writes one, not two


def test_serve_passes_key_and_quiet_to_the_app(no_uvicorn, tmp_path, capsys):
    from rlcd.server import serve

    serve(tmp_path, api_key=KEY, quiet=True)
    app = no_uvicorn[-1][0]
    c = TestClient(app)
    assert c.get("/v1/models").status_code == 401 and c.get("/v1/models", headers=_bearer(KEY)).status_code == 200
    assert "rlcd.access" not in capsys.readouterr().err


def test_workers_get_the_key_through_the_environment(no_uvicorn, tmp_path_factory, monkeypatch):
    import os

    from rlcd.server import SERVE_ENV, app_from_env, serve

    monkeypatch.setenv(SERVE_ENV, "{}")  # restored afterwards
    run = tiny_export(tmp_path_factory.getbasetemp())
    serve(run, api_key=KEY, workers=2)
    target, kw = no_uvicorn[-1]
    assert target == "rlcd.server:app_from_env" and kw["workers"] == 2 and kw["factory"] is True
    assert os.environ[API_KEY_ENV] == KEY and KEY not in os.environ[SERVE_ENV] and KEY not in repr(kw)
    c = TestClient(app_from_env())  # what each worker process builds
    assert c.post("/v1/systemone", json=REQUEST).status_code == 401
    assert c.post("/v1/systemone", json=REQUEST, headers=_bearer(KEY)).status_code == 200
    serve(run, workers=2)  # no key now: a key left in the environment must not reach the workers
    assert API_KEY_ENV not in os.environ


def test_cli_reads_the_key_from_the_environment(monkeypatch, tmp_path_factory):
    from typer.testing import CliRunner

    import rlcd.server
    from rlcd.cli import app

    seen = {}
    monkeypatch.setattr(rlcd.server, "serve", lambda path, **kw: seen.update(kw))
    run = tiny_export(tmp_path_factory.getbasetemp())
    runner = CliRunner()
    res = runner.invoke(app, ["serve", "--run", str(run), "--quiet"], env={API_KEY_ENV: KEY})
    assert res.exit_code == 0, res.output
    assert seen["api_key"] == KEY and seen["quiet"] is True and KEY not in res.output
    res = runner.invoke(app, ["serve", "--run", str(run), "--api-key", "two words"], env={API_KEY_ENV: ""})
    assert res.exit_code == 2 and "visible ASCII" in res.stderr and "two words" not in res.stderr
    res = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "250"})
    assert "--api-key" in res.output and API_KEY_ENV in res.output and "--quiet" in res.output
