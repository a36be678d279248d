"""Request bodies as the official System One SDK sends them: compressed, and multipart when they carry images.

Why this module: `typesafe-sdk` (and every client built on it) compresses any body of 1 KiB or more with
`Content-Encoding: zstd` when zstd is importable, and sends every image as `multipart/form-data`: a part named
`request` holding the JSON, and one part per image (`asset-0`, `asset-1`, ...) that the JSON's `assets` entry
names (`{"type": "image", "part": "asset-0"}`). transformers' clients send plain JSON, which goes through here
unchanged.

* **Content-Encoding**: `identity`, `gzip` (`x-gzip`) or `zstd`. The decoded body is read through a streaming
  decoder that stops one byte past `Limits.max_request_bytes` -- the same limit the raw body has -- so a small
  compressed body that would expand to gigabytes (a "bomb") costs at most that many bytes of memory and is
  answered 413. Corrupt compressed data is a 400, an unknown coding a 415.
* **multipart/form-data** (RFC 7578; python-multipart's streaming parser, in memory: the decoded body is already
  bounded): at most `1 + MAX_ASSETS` parts (413 past that), each named once; the `request` part is parsed as
  strict JSON (`parse_body`). Every other part must be claimed by exactly one asset's `part` (as the official API
  requires); an asset's `part` must name one of them. A part's bytes count against `max_request_bytes` with the
  rest of the body, and its decoded image against `max_image_pixels`, exactly like a `data_base64` image.

`read_request(body, content_encoding, content_type, limits)` returns `(request object, parts)`: `parts` maps
part name -> bytes (empty for a JSON body) and goes to `Predictor.prepare(..., parts=parts)`.
"""

from __future__ import annotations

import json
import zlib
from typing import Any, Mapping

from rlcd.serving.errors import PredictError
from rlcd.serving.limits import Limits
from rlcd.serving.request import MAX_ASSETS

ENCODINGS = ("identity", "gzip", "x-gzip", "zstd")
REQUEST_PART = "request"
MAX_PARTS = 1 + MAX_ASSETS
_CHUNK = 64 << 10


# ---------------------------------------------------------------------------------------------- strict JSON
def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _invalid(message: str, field: str = "body") -> PredictError:
    """Undecodable JSON: 422 with `type: json_invalid`, as FastAPI (and so `transformers serve`) answers it."""
    return PredictError(field, message, status=422, kind="json_invalid")


def parse_body(body: bytes, field: str = "body") -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity, no duplicate keys, an object. PredictError(422, json_invalid) otherwise."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _invalid(f"is not UTF-8 ({e.reason} at byte {e.start})", field) from None
    if not text.strip():
        raise _invalid("is empty; send a JSON object", field)
    try:
        obj = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise _invalid(f"is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})", field) from None
    except ValueError as e:
        raise _invalid(f"is not valid JSON: {e}", field) from None
    except RecursionError:
        raise _invalid("is nested too deeply", field) from None
    if not isinstance(obj, dict):
        raise PredictError(field, f"must be a JSON object, got {type(obj).__name__}", status=422, kind="model_attributes_type")
    return obj


# ---------------------------------------------------------------------------------------------- decompression
def _too_large(cap: int) -> PredictError:
    return PredictError("body", f"decompresses to more than max_request_bytes={cap} bytes", status=413)


def _gunzip(body: bytes, cap: int) -> bytes:
    d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    out = bytearray()
    data = body
    try:
        while True:
            out += d.decompress(data, cap + 1 - len(out))
            if len(out) > cap:
                raise _too_large(cap)
            data = d.unconsumed_tail
            if d.eof:
                if d.unused_data.strip(b"\x00"):
                    raise PredictError("body", "has bytes after the end of its gzip stream", status=400)
                return bytes(out)
            if not data:
                raise PredictError("body", "ends before its gzip stream does", status=400)
    except zlib.error as e:
        raise PredictError("body", f"is not valid gzip data ({e})", status=400) from None


def _unzstd(body: bytes, cap: int) -> bytes:
    try:
        import zstandard
    except ImportError:  # pragma: no cover - a dependency of rlcd[serve]
        raise PredictError("Content-Encoding", "zstd bodies need the zstandard package on the server "
                                               "(pip install 'rlcd[serve]')", status=415) from None
    import io

    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body), read_across_frames=True) as reader:
            while True:
                chunk = reader.read(min(_CHUNK, cap + 1 - len(out)))
                if not chunk:
                    return bytes(out)
                out += chunk
                if len(out) > cap:
                    raise _too_large(cap)
    except zstandard.ZstdError as e:
        raise PredictError("body", f"is not valid zstd data ({e})", status=400) from None


def decode_content(body: bytes, encoding: str | None, cap: int) -> bytes:
    """The body with its Content-Encoding undone, never more than `cap` bytes (413 past it)."""
    codings = [c.strip().lower() for c in (encoding or "").split(",") if c.strip()]
    unknown = [c for c in codings if c not in ENCODINGS]
    if unknown:
        raise PredictError("Content-Encoding", f"{unknown[0]!r} is not supported; send identity, gzip or zstd",
                           status=415)
    for coding in reversed(codings):  # applied in the order listed, so undone from the last
        if coding in ("gzip", "x-gzip"):
            body = _gunzip(body, cap)
        elif coding == "zstd":
            body = _unzstd(body, cap)
    return body


# ---------------------------------------------------------------------------------------------- multipart
def _disposition_name(value: bytes) -> str | None:
    from python_multipart.multipart import parse_options_header

    kind, params = parse_options_header(value)
    name = params.get(b"name")
    return name.decode("utf-8", "replace") if kind == b"form-data" and name is not None else None


def parse_multipart(body: bytes, content_type: str) -> dict[str, bytes]:
    """The parts of a multipart/form-data body by name (at most MAX_PARTS, each name once)."""
    from python_multipart.exceptions import MultipartParseError
    from python_multipart.multipart import MultipartParser, parse_options_header

    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise PredictError("Content-Type", "multipart/form-data needs a boundary parameter", status=400)
    parts: list[tuple[dict[bytes, bytes], bytearray]] = []
    field, value, ended = bytearray(), bytearray(), [False]

    def begin() -> None:
        if len(parts) >= MAX_PARTS:
            raise PredictError("body", f"has more than {MAX_PARTS} parts (the request and at most {MAX_ASSETS} "
                                       "images)", status=413)
        parts.append(({}, bytearray()))

    def header_end() -> None:
        parts[-1][0][bytes(field).strip().lower()] = bytes(value).strip()
        field.clear()
        value.clear()

    callbacks = {
        "on_part_begin": begin,
        "on_header_field": lambda d, s, e: field.extend(d[s:e]),
        "on_header_value": lambda d, s, e: value.extend(d[s:e]),
        "on_header_end": header_end,
        "on_part_data": lambda d, s, e: parts[-1][1].extend(d[s:e]),
        "on_end": lambda: ended.__setitem__(0, True),
    }
    try:
        parser = MultipartParser(boundary, callbacks)
        parser.write(body)
        parser.finalize()
    except MultipartParseError as e:
        raise PredictError("body", f"is not valid multipart/form-data ({e})", status=400) from None
    if not ended[0]:
        raise PredictError("body", "ends before the closing multipart boundary", status=400)
    out: dict[str, bytes] = {}
    for i, (headers, data) in enumerate(parts):
        name = _disposition_name(headers.get(b"content-disposition", b""))
        if not name:
            raise PredictError("body", f"multipart part {i} has no 'Content-Disposition: form-data; name=...'",
                               status=400)
        if name in out:
            raise PredictError("body", f"multipart part name {name!r} is used twice")
        out[name] = bytes(data)
    return out


def claim_parts(request: Any, parts: Mapping[str, bytes]) -> None:
    """Every image part claimed by exactly one asset's `part`, and every `part` naming an image part (422 else).

    Only checked when `request` has an `assets` object; other shapes are `parse_request`'s to refuse."""
    assets = request.get("assets") if isinstance(request, Mapping) else None
    claims: dict[str, str] = {}
    if isinstance(assets, Mapping):
        for name, spec in assets.items():
            part = spec.get("part") if isinstance(spec, Mapping) else None
            if part is None:
                continue
            where = f"assets.{name}.part"
            if not isinstance(part, str) or part == REQUEST_PART or part not in parts:
                have = ", ".join(sorted(p for p in parts if p != REQUEST_PART)) or "none"
                raise PredictError(where, f"names no image part of this body (parts: {have})")
            if part in claims:
                raise PredictError(where, f"part {part!r} is already used by asset {claims[part]!r}; each part "
                                          "belongs to exactly one asset")
            claims[part] = str(name)
    unclaimed = sorted(p for p in parts if p != REQUEST_PART and p not in claims)
    if unclaimed:
        raise PredictError("body", f"multipart part {unclaimed[0]!r} is not used by any asset "
                                   '(an asset names it as {"type": "image", "part": ...})')


def read_request(body: bytes, content_encoding: str | None, content_type: str | None,
                 limits: Limits) -> tuple[Any, dict[str, bytes]]:
    """(the request object, its image parts by name) from the raw HTTP body and its two headers."""
    body = decode_content(body, content_encoding, limits.max_request_bytes)
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "multipart/form-data":
        return parse_body(body), {}
    parts = parse_multipart(body, content_type or "")
    if REQUEST_PART not in parts:
        raise PredictError("body", f"a multipart request needs a part named {REQUEST_PART!r} holding the JSON request")
    request = parse_body(parts.pop(REQUEST_PART), field=REQUEST_PART)
    claim_parts(request, parts)
    return request, parts


__all__ = ["read_request", "decode_content", "parse_multipart", "claim_parts", "parse_body", "ENCODINGS", "MAX_PARTS"]
