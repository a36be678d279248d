"""Schema-driven fuzzing of a real `rlcd serve` on loopback (schemathesis against its own /openapi.json).

Two servers of the tiny export, one with `--api-key` (through RLCD_API_KEY) and one without, each fuzzed over every
operation: schemathesis' coverage phase (boundary and invalid values, undeclared methods, missing or wrong keys)
and its fuzzing phase (valid and invalid bodies, JSON and multipart, and the request-id headers), derandomized.
No 5xx, every 4xx JSON with `detail`, every answer in the declared shape; the server healthy afterwards.
`tests/_schema_fuzz.py` has the checks; `benchmarks/fuzz_server.py` runs the same for ~10,000 requests.
Bounded: EXAMPLES generated requests per operation and phase mode, on top of the coverage phase's fixed set.
"""

from __future__ import annotations

import httpx
import jsonschema_rs
import pytest

from _schema_fuzz import fuzz, report, start_server
from _tiny_export import tiny_export

KEY = "fuzz-key-Q7x.9_k"
EXAMPLES = 25
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
    assert summary["operations"] == OPERATIONS
    counts = summary["status_counts"]
    # what the run reached: answers, refusals of invalid bodies, undeclared methods, and (with a key) refusals
    assert {"200", "422", "405"} <= set(counts) and counts["200"] >= 5, counts
    assert ("401" in counts) == (config == "key"), counts
    assert server.problems() == []


def test_descriptions_and_levels_of_any_json_value_are_in_the_schema(servers):
    """Found by the fuzzer (negative_data_rejection, 200 for a "schema-violating" body): a description or score
    level that is a number, a boolean or null is answered -- the prompt reads its JSON text -- and the document
    allowed only text or content. The document now says what the server reads."""
    server = servers["open"]
    doc = httpx.get(server.url + "/openapi.json", timeout=30, trust_env=False).json()
    request = jsonschema_rs.validator_for({"$ref": "#/components/schemas/SystemOneRequest",
                                           "components": doc["components"]})
    body = {"state": "Order 1182.", "questions": {
        "team": {"type": "choice", "criteria": {"k": True, "j": 163725}},
        "late": {"type": "noul", "criteria": {"true": 1.5}},
        "size": {"type": "score", "criteria": [0, None, False]}}}
    assert request.is_valid(body)
    r = httpx.post(server.url + "/v1/systemone", json=body, timeout=60, trust_env=False)
    assert r.status_code == 200 and r.json()["answers"]["size"]["legend"] == {"0": 0, "1": "null", "2": False}
    assert not request.is_valid({**body, "questions": {"team": {"type": "choice", "criteria": [1, 2]}}})
