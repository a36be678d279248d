"""A small System One client for evaluation: `/v1/models` and `/v1/systemone`, with retries that respect the server.

Any server counts (rlcd serve, transformers serve, a peer): the base URL may be given with or without
``/v1/systemone``. A 503 or 429 is retried after its ``Retry-After`` (seconds or an HTTP date; capped at
MAX_WAIT_S), a dropped connection or a 502/504 after an exponential back-off, at most `retries` times; anything
else is an answer (a 4xx is the server refusing that request: no retry). The key, when given, goes as
``Authorization: Bearer`` (the official SDK's header).
"""

from __future__ import annotations

import email.utils
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx

RETRY_STATUS = (429, 502, 503, 504)
MAX_WAIT_S = 30.0
USER_AGENT = "rlcd-evaluate-remote"


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
        self.retries, self._sleep = retries, sleep
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
                return Reply(r.status_code, error=f"HTTP {r.status_code}: {_detail(r)}", attempts=attempt + 1)
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
        body = reply.body if isinstance(reply.body, dict) else {}
        names = [m.get("name") for m in body.get("models") or [] if isinstance(m, dict)]
        names += [m.get("id") for m in body.get("data") or [] if isinstance(m, dict)]
        return list(dict.fromkeys(str(n) for n in names if n))  # rlcd serves both shapes: once each

    def decide(self, body: dict[str, Any]) -> Reply:
        return self._call("POST", "/v1/systemone", json=body)


def _detail(r: httpx.Response) -> str:
    try:
        detail = r.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    text = str(detail) if detail is not None else r.text
    text = " ".join(text.split())
    return text[:300] + ("…" if len(text) > 300 else "")


__all__ = ["Reply", "SystemOneClient", "base_url", "retry_after"]
