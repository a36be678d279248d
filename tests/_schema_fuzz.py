"""Schema-driven fuzzing of a real `rlcd serve` on loopback, with schemathesis' engine (what `st run` drives).

`start_server(run, api_key=...)` starts `python -m rlcd.cli serve RUN` on a free 127.0.0.1 port (the key through
`RLCD_API_KEY`, as the docs advise, never on the command line; stderr, the access log included, to a file).
`fuzz(url, ...)` loads the server's own `/openapi.json` and runs schemathesis' coverage phase (boundary and invalid
values of every body field, undeclared methods, requests without or with a wrong key) and its fuzzing phase
(Hypothesis-generated valid and invalid bodies and headers, `max_examples` per operation), derandomized from
`seed`, with every check that applies to a stateless API:

* `not_a_server_error`: no 5xx;
* `status_code_conformance`, `content_type_conformance`, `response_headers_conformance`,
  `response_schema_conformance`: every answer is one the document declares, in the declared shape;
* `negative_data_rejection`: a request the schema calls invalid is refused (413 counts as a refusal);
* `unsupported_method`, `missing_required_header`, `ignored_auth` (with a key: `/v1` needs it);
* `error_has_detail` (ours): every 4xx is JSON `{"detail": ...}`, the shape both client families parse.

`positive_data_acceptance` is off: the server's rules go beyond what JSON Schema says (a multipart image part
must be claimed by an asset, a label must not hold a reserved token, a request must fit `--max-tokens`), so a
schema-valid request may be refused by design. It returns a summary: requests, operations, status counts, 5xx,
and the distinct failures with a curl line that reproduces each.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import schemathesis

# a refusal of invalid data may be any of these (schemathesis' default list lacks 413, the server's size limits)
REFUSALS = (400, 401, 403, 404, 405, 406, 409, 413, 415, 422)
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance", "response_headers_conformance",
          "response_schema_conformance", "negative_data_rejection", "unsupported_method", "missing_required_header",
          "ignored_auth", "error_has_detail")
GOOD = {"state": "Order 1182: the parcel is two weeks late.", "questions": {
    "late": {"type": "noul", "instructions": "Is the parcel late?"},
    "team": {"type": "choice", "criteria": {"billing": None, "shipping": "parcels"}},
    "urgency": {"type": "score", "criteria": ["can wait", "today"]}}}


@schemathesis.check
def error_has_detail(ctx, response, case) -> bool | None:
    """Every 4xx is a JSON object with `detail`: FastAPI's and the official API's error shape."""
    if not 400 <= response.status_code < 500:
        return None
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"{response.status_code} without a JSON body: {response.content[:200]!r}") from None
    if not isinstance(body, dict) or "detail" not in body:
        raise AssertionError(f"{response.status_code} body has no 'detail': {response.content[:200]!r}")
    return True


@dataclass
class Server:
    """A `rlcd serve` subprocess on loopback; `log` holds its stderr (access lines, warnings, tracebacks)."""

    proc: subprocess.Popen
    url: str
    log: Path
    api_key: str | None

    def wait(self, timeout: float = 180.0) -> "Server":
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"rlcd serve did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)

    def problems(self) -> list[str]:
        """What says the server is not well after a run: not running, /health or a known-good request failing,
        a traceback or a 5xx access line in its log."""
        out = []
        if self.proc.poll() is not None:
            return [f"the server exited with {self.proc.returncode}"]
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        h = httpx.get(self.url + "/health", timeout=30, trust_env=False)
        if h.status_code != 200 or h.json().get("status") != "ok":
            out.append(f"/health answered {h.status_code} {h.text[:200]}")
        r = httpx.post(self.url + "/v1/systemone", json=GOOD, headers=headers, timeout=60, trust_env=False)
        if r.status_code != 200 or set(r.json().get("answers", {})) != set(GOOD["questions"]):
            out.append(f"a known-good request answered {r.status_code} {r.text[:300]}")
        log = self.log.read_text(errors="replace")
        if "Traceback" in log:
            out.append("traceback in the server log: " + log[log.index("Traceback"):][:1500])
        out += [f"5xx in the access log: {line}" for line in log.splitlines()
                if line.startswith("rlcd.access") and " status=5" in line][:5]
        return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(run: Path | str, *, api_key: str | None = None, log_dir: Path | str | None = None) -> Server:
    """`rlcd serve RUN` on a free loopback port (not yet waited for: call `.wait()`)."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="rlcd-serve-", suffix=".log", dir=log_dir)[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RLCD_API_KEY", None)
    if api_key is not None:
        env["RLCD_API_KEY"] = api_key
    cmd = [sys.executable, "-m", "rlcd.cli", "serve", str(run), "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu"]
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
    return Server(proc, f"http://127.0.0.1:{port}", log, api_key)


def config(*, api_key: str | None, max_examples: int, seed: int, phases: tuple[str, ...],
           checks: tuple[str, ...] = CHECKS) -> schemathesis.Config:
    enabled: dict[str, Any] = {"enabled": False, **{name: {"enabled": True} for name in checks}}
    if "negative_data_rejection" in enabled:
        enabled["negative_data_rejection"]["expected-statuses"] = list(REFUSALS)
    generation = {"mode": "all", "max-examples": max_examples, "deterministic": True, "no-shrink": True}
    data: dict[str, Any] = {
        "seed": seed, "workers": 1, "request-timeout": 60, "continue-on-failure": True, "checks": enabled,
        "generation": generation,
        # the GETs take no body, only the request-id headers: a tenth of the examples is plenty
        "operations": [{"include-method": "GET",
                        "generation": {**generation, "max-examples": max(5, max_examples // 10)}}],
        "phases": {name: {"enabled": name in phases} for name in ("examples", "coverage", "fuzzing", "stateful")},
        "output": {"truncation": {"enabled": True}}}
    if api_key is not None:
        data["auth"] = {"openapi": {"HTTPBearer": {"bearer": api_key}}}
    return schemathesis.Config.from_dict(data)


def fuzz(url: str, *, api_key: str | None = None, max_examples: int = 20, seed: int = 0,
         phases: tuple[str, ...] = ("coverage", "fuzzing"), checks: tuple[str, ...] = CHECKS) -> dict[str, Any]:
    """Run schemathesis against `url`'s own OpenAPI document; the summary of every request it sent."""
    from schemathesis.engine import events, from_schema

    if not url.startswith(("http://127.0.0.1:", "http://localhost:")):
        raise ValueError("fuzzing sends traffic to loopback only")
    t0 = time.perf_counter()
    schema = schemathesis.openapi.from_url(url + "/openapi.json",
                                           config=config(api_key=api_key, max_examples=max_examples, seed=seed,
                                                         phases=phases, checks=checks))
    statuses: collections.Counter = collections.Counter()
    by_phase: collections.Counter = collections.Counter()
    by_operation: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    operations: set[str] = set()
    failures: dict[tuple, dict[str, Any]] = {}
    errors: list[str] = []
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            rec = event.recorder
            operations.add(rec.label)
            for interaction in rec.interactions.values():
                status = interaction.response.status_code if interaction.response is not None else "none"
                statuses[status] += 1
                by_operation[rec.label][str(status)] += 1
                by_phase[str(event.phase.value)] += 1
            for case_id, nodes in rec.checks.items():
                for node in nodes:
                    if node.failure_info is None:
                        continue
                    f = node.failure_info.failure
                    sent = rec.interactions.get(case_id)
                    response = sent.response if sent is not None else None
                    key = (f.code, f.operation, f.title, getattr(f, "_unique_key", ""))
                    failures.setdefault(key, {
                        "check": node.name, "code": f.code, "title": f.title, "operation": f.operation,
                        "status": response.status_code if response is not None else None,
                        "message": f.message[:1500], "reproduce": node.failure_info.code_sample[:3000],
                        "response": None if response is None else response.content[:300].decode("utf-8", "replace")})
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            errors.append(str(getattr(event, "value", None) or getattr(event, "exception", None))[:1500])
    return {"url": url, "api_key": api_key is not None, "seed": seed, "max_examples": max_examples,
            "phases": list(phases), "requests": sum(statuses.values()), "requests_by_phase": dict(by_phase),
            "operations": sorted(operations),
            "status_counts": {str(k): v for k, v in sorted(statuses.items(), key=lambda kv: str(kv[0]))},
            "status_counts_by_operation": {op: dict(sorted(c.items())) for op, c in sorted(by_operation.items())},
            "c5xx": sum(v for k, v in statuses.items() if isinstance(k, int) and k >= 500),
            "failures": list(failures.values()), "errors": errors, "seconds": round(time.perf_counter() - t0, 1)}


# ---------------------------------------------------------------------------------------------- body encodings
CODINGS = ("gzip", "x-gzip", "zstd", "identity")
ODD_CODINGS = ("br", "deflate", "compress", "*", "GZIP", "gzip;q=1", "zstd, br", ",", "gzip,,zstd")
BOUNDARY = "fuzzb0und"


def _compress(data: bytes, coding: str) -> bytes:
    import gzip

    import zstandard

    if coding in ("gzip", "x-gzip"):
        return gzip.compress(data, mtime=0)
    return zstandard.ZstdCompressor().compress(data) if coding == "zstd" else data


def _multipart(request: bytes, parts: list[tuple[str, bytes]]) -> bytes:
    chunks = [f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="request"\r\n\r\n'.encode(), request, b"\r\n"]
    for name, data in parts:
        chunks += [f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"; filename="{name}"\r\n\r\n'.encode(),
                   data, b"\r\n"]
    return b"".join(chunks + [f"--{BOUNDARY}--\r\n".encode()])


def fuzz_encodings(url: str, *, api_key: str | None = None, max_examples: int = 60, seed: int = 0) -> dict[str, Any]:
    """Hypothesis-generated bodies, `Content-Type` and `Content-Encoding` headers the OpenAPI document only describes
    in words: a good request or random bytes, plain or multipart, compressed by any chain of the codings (or
    labelled with one it is not in, or an unknown one), then maybe truncated or with a byte flipped. No 5xx; every
    4xx JSON with `detail`; a good request correctly compressed is answered (200)."""
    import hypothesis
    from hypothesis import strategies as st

    if not url.startswith(("http://127.0.0.1:", "http://localhost:")):
        raise ValueError("fuzzing sends traffic to loopback only")
    good = json.dumps(GOOD).encode()
    statuses: collections.Counter = collections.Counter()
    failures: dict[tuple, dict[str, Any]] = {}
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    @hypothesis.seed(seed)
    @hypothesis.settings(max_examples=max_examples, derandomize=False, database=None, deadline=None,
                         phases=[hypothesis.Phase.generate], suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(payload=st.one_of(st.just(good), st.binary(max_size=512), st.just(good[: len(good) // 2])),
                      form=st.sampled_from(["json", "multipart", "multipart-part", "multipart-no-boundary", "text",
                                            "none"]),
                      chain=st.lists(st.sampled_from(CODINGS), max_size=3),
                      label=st.one_of(st.none(), st.sampled_from(ODD_CODINGS + CODINGS),
                                      st.text(st.characters(min_codepoint=32, max_codepoint=126),
                                              max_size=20).map(str.strip)),
                      damage=st.one_of(st.none(), st.integers(0, 4096)), junk=st.binary(max_size=64))
    def one(payload, form, chain, label, damage, junk):
        body = payload
        ctype = "application/json"
        if form.startswith("multipart"):
            body = _multipart(payload, [("asset-0", junk)] if form == "multipart-part" else [])
            ctype = "multipart/form-data" + ("" if form == "multipart-no-boundary" else f"; boundary={BOUNDARY}")
        elif form == "text":
            ctype = "text/plain"
        for coding in chain:
            body = _compress(body, coding)
        encoding = ", ".join(chain) if label is None else label
        if damage is not None and body:
            i = damage % len(body)
            body = body[:i] if damage % 2 else body[:i] + bytes([body[i] ^ 0xFF]) + body[i + 1:]
        headers = {**auth, **({"Content-Type": ctype} if form != "none" else {}),
                   **({"Content-Encoding": encoding} if encoding else {})}
        r = httpx.post(url + "/v1/systemone", content=body, headers=headers, timeout=60, trust_env=False)
        statuses[r.status_code] += 1
        problem = None
        if r.status_code >= 500:
            problem = "server error"
        elif r.status_code >= 400:
            try:
                detail_ok = isinstance(r.json(), dict) and "detail" in r.json()
            except ValueError:
                detail_ok = False
            problem = None if detail_ok else "4xx without a JSON detail"
        intact = payload == good and form in ("json", "multipart", "none") and damage is None and label is None
        if intact and r.status_code != 200:
            problem = "a good request, correctly encoded, was refused"
        if problem is not None:
            failures.setdefault((problem, r.status_code), {
                "check": "encodings", "code": "raw", "title": problem, "operation": "POST /v1/systemone",
                "status": r.status_code, "message": problem, "response": r.text[:300],
                "reproduce": f"form={form} chain={chain} Content-Encoding={encoding!r} damage={damage} "
                             f"payload={payload[:80]!r}"})

    t0 = time.perf_counter()
    one()
    return {"url": url, "api_key": api_key is not None, "seed": seed, "max_examples": max_examples,
            "requests": sum(statuses.values()), "status_counts": {str(k): v for k, v in sorted(statuses.items())},
            "c5xx": sum(v for k, v in statuses.items() if k >= 500), "failures": list(failures.values()),
            "errors": [], "seconds": round(time.perf_counter() - t0, 1)}


def report(summary: dict[str, Any]) -> str:
    """The failures and errors of a summary, readable in a test's assertion message."""
    lines = []
    for f in summary["failures"]:
        lines.append(f"[{f['code']}] {f['title']} on {f['operation']} (status {f['status']}, check {f['check']}):\n"
                     f"  {f['message'][:600]}\n  response: {(f.get('response') or '')[:300]}\n"
                     f"  reproduce: {f['reproduce'][:600]}")
    lines += [f"error: {e}" for e in summary["errors"]]
    return "\n".join(lines)


__all__ = ["Server", "start_server", "fuzz", "fuzz_encodings", "report", "error_has_detail", "CHECKS", "REFUSALS",
           "GOOD"]
