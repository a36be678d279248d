"""Schema-driven fuzzing of a real `rlcd serve` on loopback (schemathesis against its own /openapi.json).

Two servers of the tiny export, one with `--api-key` (through RLCD_API_KEY) and one without, each fuzzed over every
operation: schemathesis' coverage phase (boundary and invalid values, undeclared methods, missing or wrong keys)
and its fuzzing phase (valid and invalid bodies, JSON and multipart, and the request-id headers), derandomized.
No 5xx, every 4xx JSON with `detail`, every answer in the declared shape; the server healthy afterwards.
`tests/_schema_fuzz.py` has the checks; `benchmarks/fuzz_server.py` runs the same for ~10,000 requests.
Bounded: EXAMPLES generated requests for the POST (a tenth for each GET) on top of the coverage phase's fixed set,
~230 requests per server; then 60 bodies with generated encodings and content types.
"""

from __future__ import annotations

import socket

import httpx
import jsonschema_rs
import pytest

from _schema_fuzz import fuzz, fuzz_encodings, report, start_server
from _tiny_export import tiny_export

KEY = "fuzz-key-Q7x.9_k"
EXAMPLES = 50
OPERATIONS = ["GET /health", "GET /v1/models", "POST /v1/systemone"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Both configurations, started together (each loads its model in its own process)."""
    run = tiny_export(tmp_path_factory.getbasetemp())
    logs = tmp_path_factory.mktemp("serve-logs")
    started = {"key": start_server(run, api_key=KEY, log_dir=logs), "open": start_server(run, log_dir=logs)}
    try:
        yield {name: s.wait() for name, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


@pytest.mark.parametrize("config", ["key", "open"])
def test_schemathesis_finds_no_failure(servers, config):
    server = servers[config]
    summary = fuzz(server.url, api_key=server.api_key, max_examples=EXAMPLES, seed=0)
    assert summary["c5xx"] == 0 and not summary["failures"] and not summary["errors"], report(summary)
    assert summary["operations"] == OPERATIONS and summary["requests"] >= 200, summary["requests"]
    counts = summary["status_counts"]
    # what the run reached: answers, refusals of invalid bodies, undeclared methods, and (with a key) refusals
    assert {"200", "422", "405"} <= set(counts) and counts["200"] >= 5, counts
    assert ("401" in counts) == (config == "key"), counts
    assert server.problems() == []


def test_bodies_encodings_and_content_types(servers):
    """What the document only describes in words: gzip/zstd chains (right, wrong, unknown, damaged), multipart with
    and without a boundary, random bytes. No 5xx, every 4xx with `detail`, a good body correctly encoded answered."""
    server = servers["key"]
    summary = fuzz_encodings(server.url, api_key=KEY, max_examples=60, seed=0)
    assert summary["c5xx"] == 0 and not summary["failures"], report(summary)
    assert {"200", "400", "415", "422"} <= set(summary["status_counts"]), summary["status_counts"]
    assert server.problems() == []


def test_a_request_id_with_control_characters_comes_back_parseable(servers):
    """Found fuzzing the request-id headers on a raw socket (schemathesis sends no control characters in headers):
    uvicorn's h11 lets most control characters into a header value (\\x01, ESC, DEL, ...), and the id came back as
    sent -- a response header no field value may hold, which strict clients (h11, so httpx) refuse. They become `_`."""
    port = int(servers["open"].url.rsplit(":", 1)[1])
    for header in (b"X-Request-ID", b"x-typesafe-request-id"):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
            c.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + header
                      + b": a\x01b\x1bc\td\r\n\r\n")
            answer = b""
            while chunk := c.recv(65536):
                answer += chunk
        head = answer.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
        assert head[0] == b"HTTP/1.1 200 OK", head
        assert b"x-request-id: a_b_c\td" in head and b"x-typesafe-request-id: a_b_c\td" in head, head
        assert all(ch >= 0x20 or ch == 0x09 for line in head for ch in line), head


NOUL = {"type": "noul"}
# bodies the server answers that the document refused (found by negative_data_rejection: a 200 for a "schema-violating"
# body): a description or score level that is a number, a boolean or null (the prompt reads its JSON text), and
# `"assets": null` (no assets, as `"image": null` is no image)
READ = [{"team": {"type": "choice", "criteria": {"k": True, "j": 163725}},
         "late": {"type": "noul", "criteria": {"true": 1.5}},
         "size": {"type": "score", "criteria": [0, None, False]}}]
# bodies the server refuses that the document allowed (found by positive_data_acceptance: a 4xx for a "schema-valid"
# body): blank or too long question ids, no or repeated labels, no levels, an image alias that is not one of its forms
REFUSED = [{"questions": {"": NOUL}}, {"questions": {"q" * 257: NOUL}},
           *({"questions": {"team": {"type": "choice", "criteria": c}}}
             for c in ({}, [], ["a", "a"], [""], {"": None})),
           {"questions": {"size": {"type": "score", "criteria": []}}},
           *({"image": i} for i in ({}, {"base64": "eA==", "path": "a.png"}, {"path": ""}, {"base64": ""},
                                    {"url": "x"}))]


def test_the_document_says_what_the_server_reads(servers):
    """Every schema fix the fuzzer led to, both ways: what the server answers the document allows, and what it
    refuses the document refuses (so generated clients and the fuzzer's valid bodies agree with the server)."""
    server = servers["open"]
    doc = httpx.get(server.url + "/openapi.json", timeout=30, trust_env=False).json()
    request = jsonschema_rs.validator_for({"$ref": "#/components/schemas/SystemOneRequest",
                                           "components": doc["components"]})
    base = {"state": "Order 1182: the parcel is late.", "questions": {"late": NOUL}}
    for body in [{**base, "questions": q} for q in READ] + [{**base, "assets": None}]:
        r = httpx.post(server.url + "/v1/systemone", json=body, timeout=60, trust_env=False)
        assert r.status_code == 200 and request.is_valid(body), (body, r.text)
    legend = httpx.post(server.url + "/v1/systemone", json={**base, "questions": READ[0]}, timeout=60, trust_env=False)
    assert legend.json()["answers"]["size"]["legend"] == {"0": 0, "1": "null", "2": False}
    for change in REFUSED:
        body = {**base, **change}
        r = httpx.post(server.url + "/v1/systemone", json=body, timeout=60, trust_env=False)
        assert 400 <= r.status_code < 500 and not request.is_valid(body), (body, r.status_code)
    multipart = doc["paths"]["/v1/systemone"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert multipart["additionalProperties"] is False  # parts: the request and the images its assets name
