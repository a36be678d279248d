"""Who may call the server (`--api-key`) and what it answered (the access log line).

* The key: every `/v1/*` request needs `Authorization: Bearer KEY`, compared in constant time
  (`hmac.compare_digest`); `/health` stays open for load balancers. The key comes from `--api-key` or
  the `RLCD_API_KEY` environment variable (which keeps it out of shell history and `ps`), and reaches
  `--workers` processes through the environment, never a command line.
* The access log: one line per request on stderr, `key=value` pairs (logfmt) so it greps and parses:
  `rlcd.access rid=<X-Request-ID> client=<ip> method=POST path=/v1/systemone status=200 questions=3
  input_tokens=97 queue_ms=0.4 model_ms=31.2 total_ms=40.9` (`-` where a value does not apply); or, with
  `--access-log json`, one JSON object per line (`access_json`), for log pipelines that parse JSON without a
  grammar per source. Never the state, the questions' text, the query string or any header but the request id.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import sys
from typing import Any

API_KEY_ENV = "RLCD_API_KEY"
BEARER = "HTTPBearer"  # the OpenAPI security scheme's name (as FastAPI's HTTPBearer names it)
ACCESS_FIELDS = ("rid", "client", "method", "path", "status", "questions", "input_tokens", "queue_ms", "model_ms",
                 "total_ms")
ACCESS_FORMATS = ("text", "json")
# the JSON line's keys, from the text line's fields (time first; null where the text line has `-`)
JSON_KEYS = {"rid": "request_id", "client": "client", "method": "method", "path": "path", "status": "status",
             "questions": "questions", "input_tokens": "tokens", "queue_ms": "queue_ms", "model_ms": "model_ms",
             "total_ms": "latency_ms"}
MAX_ID_CHARS = 128
TYPESAFE_REQUEST_ID = "x-typesafe-request-id"  # the official SDK reads the request id here
REQUEST_ID_HEADERS = ("X-Request-ID", TYPESAFE_REQUEST_ID)  # transformers' and the official SDK's
OPERATOR_PATHS = ("/drain",)  # besides /v1: what takes a server out of rotation needs the key too
_KEY_CHARS = re.compile(r"[\x21-\x7e]+")  # visible ASCII: what an HTTP header carries unchanged
_SAFE = re.compile(r"[^A-Za-z0-9._:/@+=-]")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # no HTTP field value holds them (RFC 9110 5.5; HTAB may)


def check_api_key(key: str, source: str = "--api-key") -> str:
    """`key` if it can be sent in a header as is; ValueError naming `source` otherwise."""
    if not key:
        raise ValueError(f"{source} is empty; pass a key or leave it unset")
    if not _KEY_CHARS.fullmatch(key):
        raise ValueError(f"{source} must be visible ASCII characters without spaces (it travels in an HTTP header)")
    return key


def is_api(path: str) -> bool:
    """Whether a path is the API: everything under /v1 (what a drain refuses and the in-flight count holds)."""
    return path == "/v1" or path.startswith("/v1/")


def is_protected(path: str) -> bool:
    """Whether a path needs the key: the API and /drain (/health, /ready, /metrics and the docs stay open: probes
    and scrapers hold no secret, and none of them reveals a request)."""
    return is_api(path) or path in OPERATOR_PATHS


def refusal(authorization: str | None, key: str) -> str | None:
    """None when `authorization` is `Bearer <key>`; else the 401's detail (which never echoes what was sent)."""
    if not authorization:
        return "Not authenticated: send the header 'Authorization: Bearer <api key>'"
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return "Not authenticated: the Authorization header must be 'Bearer <api key>'"
    if not hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"), key.encode("utf-8")):
        return "Invalid API key"
    return None


def echoed_request_id(value: str | None) -> str | None:
    """The client's request id as the response headers echo it: control characters (uvicorn's h11 lets in most of
    them; no field value may hold them) become `_`, so every client can parse the answer."""
    return _CONTROL.sub("_", value) if value else None


def is_loopback(host: str) -> bool:
    """Whether binding `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def exposed_warning(host: str) -> str:
    return (f"rlcd serve: warning: listening on {host} without an API key: anyone who can reach it can query the "
            f"model; set --api-key or {API_KEY_ENV}")


def _value(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}"
    s = _SAFE.sub("_", str(v))[:128]  # a client's request id cannot forge fields or lines
    return s or "-"


def access_line(**fields: Any) -> str:
    """The log line of one request (`ACCESS_FIELDS`, in that order; missing ones are `-`)."""
    return "rlcd.access " + " ".join(f"{k}={_value(fields.get(k))}" for k in ACCESS_FIELDS)


def access_json(**fields: Any) -> str:
    """The JSON line of one request: `time` (UTC, ISO 8601, ms), then `JSON_KEYS` (null where a value does not
    apply). JSON escaping keeps a client's request id from forging keys or lines; it is cut at 128 characters."""
    import datetime
    import json

    out: dict[str, Any] = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")}
    for key, name in JSON_KEYS.items():
        v = fields.get(key)
        out[name] = round(v, 2) if isinstance(v, float) else (v[:MAX_ID_CHARS] if isinstance(v, str) else v)
    return json.dumps(out, ensure_ascii=False)


def access_record(fmt: str, **fields: Any) -> str:
    """The access line of one request in `fmt` ("text": logfmt, `access_line`; "json": `access_json`)."""
    if fmt not in ACCESS_FORMATS:
        raise ValueError(f"access log format must be one of {', '.join(ACCESS_FORMATS)}, got {fmt!r}")
    return access_json(**fields) if fmt == "json" else access_line(**fields)


def write_access(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # sys.stderr read at call time (uvicorn workers, test capture)


__all__ = ["API_KEY_ENV", "ACCESS_FIELDS", "ACCESS_FORMATS", "REQUEST_ID_HEADERS", "TYPESAFE_REQUEST_ID",
           "check_api_key", "is_api", "is_protected", "refusal", "echoed_request_id", "is_loopback", "exposed_warning",
           "access_line", "access_json", "access_record", "write_access"]
