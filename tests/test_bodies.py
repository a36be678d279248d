"""Request bodies as the official SDK sends them (`rlcd.serving.bodies`): zstd/gzip, multipart image parts, bounds.

Bombs (a small compressed body that expands past `max_request_bytes`) are a 413 after at most that many decoded
bytes; multipart parts are bounded like `data_base64` images (the body limit, then `max_image_pixels`).
"""

from __future__ import annotations

import base64
import gzip
import io
import json

import pytest
import zstandard

from rlcd.serving.bodies import MAX_PARTS, read_request
from rlcd.serving.errors import PredictError
from rlcd.serving.limits import Limits

LIM = Limits(max_request_bytes=20_000, max_image_pixels=64 * 64)
REQ = {"model": "m", "state": "s", "questions": {"q": {"type": "noul"}}}


def _png(size=(8, 8)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _multipart(parts: list[tuple[str, str, bytes]], boundary: str = "b0und") -> tuple[bytes, str]:
    """The SDK's encoding (typesafe_sdk._core.multipart.encode_multipart)."""
    chunks = []
    for name, ctype, data in parts:
        chunks += [f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{name}"\r\n'
                   f"Content-Type: {ctype}\r\n\r\n".encode(), data, b"\r\n"]
    chunks.append(f"--{boundary}--\r\n".encode())
    return b"".join(chunks), f"multipart/form-data; boundary={boundary}"


def _err(call) -> PredictError:
    with pytest.raises(PredictError) as ei:
        call()
    return ei.value


def test_zstd_and_gzip_bodies_decode_to_the_same_request():
    raw = json.dumps({**REQ, "state": "x" * 5000}).encode()
    plain = read_request(raw, None, "application/json", LIM)
    assert read_request(zstandard.ZstdCompressor().compress(raw), "zstd", "application/json", LIM) == plain
    assert read_request(gzip.compress(raw), "gzip", None, LIM) == plain
    assert read_request(gzip.compress(zstandard.ZstdCompressor().compress(raw)), "zstd, gzip", None, LIM) == plain


@pytest.mark.parametrize("coding", ["zstd", "gzip"])
def test_a_compression_bomb_is_a_413_without_decoding_it_all(coding):
    huge = b"[" + b"0," * (5 << 20) + b"0]"  # 10 MiB of JSON, 500x the limit (gzip compresses ~1000:1 at most)
    packed = zstandard.ZstdCompressor(level=3).compress(huge) if coding == "zstd" else gzip.compress(huge, 9)
    assert len(packed) < LIM.max_request_bytes  # it passes the raw body limit
    e = _err(lambda: read_request(packed, coding, "application/json", LIM))
    assert e.status == 413 and "max_request_bytes=20000" in e.message


def test_corrupt_or_unknown_codings():
    assert _err(lambda: read_request(b"not zstd at all", "zstd", None, LIM)).status == 400
    assert _err(lambda: read_request(b"not gzip", "gzip", None, LIM)).status == 400
    assert _err(lambda: read_request(gzip.compress(b"{}")[:-4], "gzip", None, LIM)).status == 400
    assert _err(lambda: read_request(b"{}", "br", None, LIM)).status == 415


def test_not_json_is_a_422_json_invalid():
    e = _err(lambda: read_request(b'{"state": ', None, "application/json", LIM))
    assert e.status == 422 and e.to_json()["detail"][0]["type"] == "json_invalid"


def test_multipart_parts_are_claimed_by_assets():
    png = _png()
    req = {**REQ, "state": "look at img-1", "assets": {"img-1": {"type": "image", "part": "asset-0"}}}
    body, ctype = _multipart([("request", "application/json", json.dumps(req).encode()), ("asset-0", "image/png", png)])
    obj, parts = read_request(body, None, ctype, LIM)
    assert obj == req and parts == {"asset-0": png}
    obj2, parts2 = read_request(zstandard.ZstdCompressor().compress(body), "zstd", ctype, LIM)  # the SDK compresses it all
    assert (obj2, parts2) == (obj, parts)
    for assets, parts_, says in (
            ({"img-1": {"type": "image", "part": "asset-9"}}, [("asset-0", png)], "names no image part"),
            ({"a": {"part": "asset-0"}, "b": {"part": "asset-0"}}, [("asset-0", png)], "already used"),
            ({"img-1": {"type": "image", "part": "asset-0"}}, [("asset-0", png), ("asset-1", png)], "not used by any")):
        body, ctype = _multipart([("request", "application/json", json.dumps({**REQ, "assets": assets}).encode()),
                                  *((n, "image/png", d) for n, d in parts_)])
        e = _err(lambda: read_request(body, None, ctype, LIM))
        assert e.status == 422 and says in e.message, e
    body, ctype = _multipart([("asset-0", "image/png", png)])
    assert "part named 'request'" in _err(lambda: read_request(body, None, ctype, LIM)).message
    body, ctype = _multipart([("request", "application/json", b"{}")])
    assert _err(lambda: read_request(body[:-12], None, ctype, LIM)).status == 400  # no closing boundary
    assert _err(lambda: read_request(body, None, "multipart/form-data", LIM)).status == 400  # no boundary


def test_too_many_parts_is_a_413():
    body, ctype = _multipart([("request", "application/json", json.dumps(REQ).encode()),
                              *((f"asset-{i}", "image/png", b"x") for i in range(MAX_PARTS))])
    assert _err(lambda: read_request(body, None, ctype, LIM)).status == 413


# ------------------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def client(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    from _tiny_export import tiny_predictor
    from fastapi.testclient import TestClient

    from rlcd.server import create_app

    return TestClient(create_app(tiny_predictor(tmp_path_factory.getbasetemp()), limits=LIM))


def test_over_http_bombs_and_oversize_parts_are_413_and_images_agree(client):
    bomb = zstandard.ZstdCompressor().compress(b" " * (30 << 20) + json.dumps(REQ).encode())
    r = client.post("/v1/systemone", content=bomb, headers={"content-encoding": "zstd", "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["detail"][0]["loc"] == ["body"]
    q = {"what": {"type": "choice", "instructions": "What is in img-1?", "criteria": {"cat": None, "dog": None}}}
    big = _png((80, 80))  # 6,400 pixels > max_image_pixels
    req = {"state": "see img-1", "questions": q, "assets": {"img-1": {"type": "image", "part": "asset-0"}}}
    body, ctype = _multipart([("request", "application/json", json.dumps(req).encode()), ("asset-0", "image/png", big)])
    r = client.post("/v1/systemone", content=body, headers={"content-type": ctype})
    assert r.status_code == 413 and r.json()["detail"][0]["loc"] == ["body", "assets", "img-1", "part"]
    body, ctype = _multipart([("request", "application/json", json.dumps(req).encode()),
                              ("asset-0", "image/png", _png())])
    by_part = client.post("/v1/systemone", content=body, headers={"content-type": ctype})
    as_b64 = client.post("/v1/systemone", json={**req, "assets": {"img-1": {
        "type": "image", "format": "png", "data_base64": base64.b64encode(_png()).decode()}}})
    assert by_part.status_code == 200 and by_part.json() == as_b64.json() and by_part.json()["usage"]["images"] == 1
    r = client.post("/v1/systemone", json=req)  # a part named in a JSON body
    assert r.status_code == 422 and "multipart" in r.json()["detail"][0]["msg"]
