"""A /v1/systemone request from command-line pieces: a request file (or stdin), --state, --question."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rlcd.errors import OptionError
from rlcd.serving.images import decode_base64_image


def _parse_state(text: str) -> Any:
    s = text.strip()
    if s.startswith(("{", "[")):
        try:
            return json.loads(s)
        except json.JSONDecodeError:
            return text
    return text


def _json_arg(text: str, what: str) -> Any:
    """json.loads(text), or an OptionError (a ValueError) naming the -q value (`what`) and where its JSON breaks."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise OptionError(f"-q {what}: not valid JSON ({e.msg} at column {e.colno}); give qid=JSON, e.g. "
                         "-q 'late={\"type\": \"noul\", \"instructions\": \"Is it late?\"}'") from None


def _parse_question_arg(text: str, index: int) -> tuple[str, Any]:
    """`{"id": "q1", "type": ...}` or `q1={"type": ...}` -> (qid, question dict)."""
    s = text.strip()
    if not s.startswith("{") and "=" in s:
        qid, _, body = s.partition("=")
        obj = _json_arg(body, repr(text))
        if not isinstance(obj, dict):
            raise ValueError(f"--question {qid}: the part after '=' must be a JSON object")
        return qid.strip(), obj
    obj = _json_arg(s, repr(text))
    if not isinstance(obj, dict):
        raise ValueError(f"--question #{index + 1} must be a JSON object (with an \"id\") or qid=JSON")
    obj = dict(obj)
    qid = obj.pop("id", None) or f"q{index + 1}"
    return str(qid), obj


def pending_stdin(stream: Any = None) -> str | None:
    """What stdin holds when it can be read without waiting: a redirected file's or a finished pipe's text, ''
    for /dev/null; None for a terminal or a pipe nothing has been written to yet (never blocks on it). A stream
    without a file descriptor (a test runner's) is read."""
    import io
    import select

    stream = sys.stdin if stream is None else stream
    if stream is None or stream.closed:
        return None
    try:
        if stream.isatty():
            return None
        fd = stream.fileno()
    except (io.UnsupportedOperation, AttributeError, ValueError, OSError):
        return stream.read()
    try:
        ready, _, _ = select.select([fd], [], [], 0)
    except (OSError, ValueError):  # select() takes no files on some platforms
        return None
    return stream.read() if ready else None


def build_cli_request(request: Path | None, state: str | None, question: list[str] | None) -> tuple[dict, Any]:
    """The request dict (and an image source from the request file, if any) from the CLI options."""
    image = None
    if request is not None:
        text = sys.stdin.read() if str(request) == "-" else Path(request).read_text()
        if not text.strip():
            where = "stdin" if str(request) == "-" else str(request)
            raise OptionError(f"the request ({where}) is empty; send a JSON object")
        req = json.loads(text)
        if not isinstance(req, dict):
            raise ValueError("the request file must hold a JSON object")
        req = dict(req)
        img = req.pop("image", None)
        if isinstance(img, dict) and "path" in img:
            p = Path(img["path"])
            image = p if p.is_absolute() or str(request) == "-" else Path(request).parent / p
        elif isinstance(img, dict) and "base64" in img:
            image = decode_base64_image(img["base64"])
        elif img is not None:
            raise ValueError('request "image" must be {"path": ...} or {"base64": ...}')
    else:
        req = {}
    if state is not None:
        req["state"] = _parse_state(state)
    if question:
        qs = dict(req.get("questions") or {})
        for i, q in enumerate(question):
            qid, obj = _parse_question_arg(q, i)
            qs[qid] = obj
        req["questions"] = qs
    return req, image
