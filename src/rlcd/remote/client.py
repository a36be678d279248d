"""A small System One client for evaluation: `/v1/models` and `/v1/systemone`, with retries that respect the server.

Any server counts (rlcd serve, transformers serve, a peer): the base URL may be given with or without
``/v1/systemone``. A 503 or 429 is retried after its ``Retry-After`` (seconds or an HTTP date; capped at
MAX_WAIT_S), a dropped connection or a 502/504 after an exponential back-off, at most `retries` times; anything
else is an answer (a 4xx is the server refusing that request: no retry). The key, when given, goes as
``Authorization: Bearer`` (the official SDK's header).

A refusal is summarised in one line (`summary`): the status, its reason phrase and a short reason taken from the
body (FastAPI's ``detail`` string, list or object, OpenAI's ``error.message``, an HTML page's title; never the page
or a dict's repr); a 401/403 names ``--api-key-env``. `pick_model`: ``GET /v1/models`` is required only when no
model name is given; with one, a server without the route is still asked, and one that lists other names is
asked anyway with a warning.
"""

from __future__ import annotations

import email.utils
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx

RETRY_STATUS = (429, 502, 503, 504)
MAX_WAIT_S = 30.0
USER_AGENT = "rlcd-evaluate-remote"
REASON_CHARS = 160  # the most of a server's reason one line quotes


def base_url(url: str) -> str:
    """`url` without a trailing ``/v1/systemone``, ``/v1`` or ``/``: where `/v1/...` routes hang."""
    u = url.strip().rstrip("/")
    for tail in ("/v1/systemone", "/v1"):
        if u.endswith(tail):
            u = u[: -len(tail)]
    if not u.startswith(("http://", "https://")):
        raise ValueError(f"--remote {url!r}: give an http:// or https:// URL (e.g. http://127.0.0.1:8000)")
    return u


def retry_after(value: str | None, attempt: int) -> float:
    """Seconds to wait: the server's Retry-After (seconds or HTTP date), else 0.5 * 2^attempt; at most MAX_WAIT_S."""
    wait = None
    if value:
        try:
            wait = float(value)
        except ValueError:
            parsed = email.utils.parsedate_to_datetime(value) if value else None
            if parsed is not None:
                wait = parsed.timestamp() - time.time()
    if wait is None or wait != wait:
        wait = 0.5 * 2 ** attempt
    return min(max(wait, 0.0), MAX_WAIT_S)


@dataclass
class Reply:
    """One request's outcome: the parsed JSON body (status 200), or the status and reason it failed."""

    status: int | None
    body: Any = None
    error: str | None = None
    attempts: int = 1


class SystemOneClient:
    """Thread-safe (one `httpx.Client`): `models()`, `decide(body)`."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 120.0, retries: int = 4,
                 sleep: Callable[[float], None] = time.sleep, transport: httpx.BaseTransport | None = None):
        self.base = base_url(url)
        headers = {"User-Agent": USER_AGENT}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.retries, self._sleep, self._keyed = retries, sleep, bool(api_key)
        self._http = httpx.Client(base_url=self.base, headers=headers, timeout=timeout_s, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "SystemOneClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw: Any) -> Reply:
        for attempt in range(self.retries + 1):
            try:
                r = self._http.request(method, path, **kw)
            except httpx.TransportError as e:
                if attempt == self.retries:
                    return Reply(None, error=f"no response ({type(e).__name__}: {e})", attempts=attempt + 1)
                self._sleep(retry_after(None, attempt))
                continue
            if r.status_code in RETRY_STATUS and attempt < self.retries:
                self._sleep(retry_after(r.headers.get("retry-after"), attempt))
                continue
            if r.status_code != 200:
                return Reply(r.status_code, error=summary(r, keyed=self._keyed), attempts=attempt + 1)
            try:
                return Reply(200, body=r.json(), attempts=attempt + 1)
            except ValueError:
                return Reply(200, error="HTTP 200 with a body that is not JSON", attempts=attempt + 1)
        raise AssertionError("unreachable")

    def models(self) -> list[str]:
        """The served model names: System One's ``{"models": [{"name"}]}`` or OpenAI's ``{"data": [{"id"}]}``.
        Raises ConnectionError when the server cannot be reached or refuses."""
        reply = self._call("GET", "/v1/models")
        if reply.error is not None:
            raise ConnectionError(f"GET {self.base}/v1/models: {reply.error}")
        return _served(reply.body)

    def pick_model(self, name: str | None) -> tuple[str, list[str] | None, str]:
        """(the model name to ask for, the served names or None when the server does not list them, a line saying
        so). Without `name` the server's list is required (its first name is asked; ConnectionError when it cannot
        be read). With `name`, ``GET /v1/models`` is only a check: a server that does not answer it (404, 405, ...)
        is asked for `name` all the same; one whose list lacks `name` too, with a warning. No response at all, or a
        refused key (401/403), is a ConnectionError either way: no request would get through."""
        reply = self._call("GET", "/v1/models")
        where = f"GET {self.base}/v1/models"
        if reply.error is not None:
            if name is None:
                hint = "; give the model's name with --remote-model NAME" if reply.status not in (None, 401, 403) else ""
                raise ConnectionError(f"{where}: {reply.error}{hint}")
            if reply.status is None or reply.status in (401, 403):
                raise ConnectionError(f"{where}: {reply.error}")
            return name, None, f"remote: {self.base} does not list its models ({reply.error}); asking {name!r}"
        served = _served(reply.body)
        listed = ", ".join(served) or "no listed model"
        if name is None:
            name = served[0] if served else "default"
        elif served and name not in served:
            return name, served, (f"remote: warning: {self.base} serves {listed}, not {name!r}; asking {name!r} "
                                  "anyway (--remote-model)")
        return name, served, f"remote: {self.base} serves {listed}; asking {name!r}"

    def decide(self, body: dict[str, Any]) -> Reply:
        return self._call("POST", "/v1/systemone", json=body)


def _served(body: Any) -> list[str]:
    """The names in a ``/v1/models`` body: System One's ``{"models": [{"name"}]}`` or OpenAI's ``{"data": [{"id"}]}``."""
    body = body if isinstance(body, dict) else {}
    names = [m.get("name") for m in body.get("models") or [] if isinstance(m, dict)]
    names += [m.get("id") for m in body.get("data") or [] if isinstance(m, dict)]
    return list(dict.fromkeys(str(n) for n in names if n))  # rlcd serves both shapes: once each


def summary(r: httpx.Response, *, keyed: bool = False) -> str:
    """One line for a refused request: ``HTTP <status> <reason phrase>``, then the body's short reason when it has
    one (`reason`); a 401/403 says which option gives the key (`keyed`: one was sent)."""
    head = f"HTTP {r.status_code}" + (f" {r.reason_phrase}" if r.reason_phrase else "")
    why = reason(r)
    line = head + (f": {why}" if why and why.lower() not in head.lower() else "")
    if r.status_code in (401, 403):
        line += (" (the key from --api-key-env was refused)" if keyed else
                 " (the server wants an API key: put it in an environment variable and name it with --api-key-env VAR)")
    return line


def reason(r: httpx.Response) -> str | None:
    """The short reason a refusal's body gives, on one line (at most REASON_CHARS): FastAPI's ``detail`` (a string;
    a list of ``{loc, msg}``; an object's ``message``/``msg``/``error``), OpenAI's ``error.message``, a top-level
    ``message``; an HTML page's ``<title>``; a short plain-text body. None when there is none."""
    text = None
    try:
        body = r.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        text = _said(body.get("detail")) or _said(body.get("error")) or _said(body.get("message"))
    elif body is None:
        raw = r.text or ""
        if "<" in raw and re.search(r"<\s*(html|!doctype|head|body|title)\b", raw, re.I):
            m = re.search(r"<title[^>]*>(.*?)</title>", raw, re.I | re.S)
            text = m.group(1) if m else None
        elif raw.strip() and len(raw) <= 4 * REASON_CHARS:
            text = raw
    if not text:
        return None
    text = " ".join(str(text).split())
    return text[:REASON_CHARS] + ("…" if len(text) > REASON_CHARS else "")


def _said(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict):
        for k in ("message", "msg", "error", "detail"):
            got = _said(v.get(k))
            if got:
                return got
        return None
    if isinstance(v, list) and v:
        parts = []
        for item in v[:2]:
            if isinstance(item, dict) and item.get("msg"):
                loc = ".".join(str(x) for x in item.get("loc") or [] if x != "body")
                parts.append(f"{loc}: {item['msg']}" if loc else str(item["msg"]))
            elif isinstance(item, str):
                parts.append(item)
        return "; ".join(parts) + (f" (+{len(v) - 2} more)" if len(v) > 2 and parts else "") if parts else None
    return None


__all__ = ["Reply", "SystemOneClient", "base_url", "reason", "retry_after", "summary"]
