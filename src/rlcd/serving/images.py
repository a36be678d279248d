"""Request images: decode a path, bytes or base64 (a data URL too) into a checked RGB PIL image.

Paths are resolved strictly inside the configured image root (absolute paths, `..` and symlinks
leading out are refused); every failure is a `PredictError` with its HTTP status (400 undecodable,
403 outside the root, 404 missing, 413 too many pixels, 422 a rule).
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

from rlcd.serving.errors import PredictError
from rlcd.serving.limits import Limits

MAX_ASPECT_RATIO = 200  # the Qwen image processor refuses images with a larger side ratio
IMAGE_KEYS = ("base64", "path")


def open_image(source: Any, *, field: str = "image", max_pixels: int = Limits.max_image_pixels) -> Any:
    """A decoded RGB PIL image from a path, bytes or a PIL image; PredictError when it is not one."""
    import io

    from PIL import Image

    if isinstance(source, Image.Image):
        im = source
        opened = None
    else:
        try:
            if isinstance(source, (bytes, bytearray)):
                opened = Image.open(io.BytesIO(bytes(source)))
            else:
                path = Path(source)
                if not path.is_file():
                    raise PredictError(field, f"image file not found: {path}", status=422)
                opened = Image.open(path)
        except PredictError:
            raise
        except Exception as e:
            raise PredictError(field, f"not a decodable image ({type(e).__name__}: {e})", status=400) from None
        im = opened
    try:
        w, h = im.size
        if w < 1 or h < 1:
            raise PredictError(field, f"image has no pixels ({w}x{h})", status=422)
        if w * h > max_pixels:
            raise PredictError(field, f"image has {w}x{h} = {w * h} pixels, more than max_image_pixels="
                                      f"{max_pixels}", status=413)
        if max(w, h) / min(w, h) >= MAX_ASPECT_RATIO:
            raise PredictError(field, f"image aspect ratio {max(w, h) / min(w, h):.0f} is not below "
                                      f"{MAX_ASPECT_RATIO}", status=422)
        try:
            im.load()
            rgb = im.convert("RGB")
            rgb.load()
        except Exception as e:
            raise PredictError(field, f"not a decodable image ({type(e).__name__}: {e})", status=400) from None
        return rgb
    finally:
        if opened is not None:
            opened.close()


def decode_base64_image(data: Any, *, field: str = "image.base64", max_pixels: int = Limits.max_image_pixels) -> Any:
    """base64 (optionally a data URL) -> decoded RGB PIL image; PredictError(400) when it is not one."""
    if not isinstance(data, str):
        raise PredictError(field, "must be a base64 string", status=400)
    s = data.strip()
    if s.startswith("data:"):
        head, sep, rest = s.partition(",")
        if not sep or ";base64" not in head:
            raise PredictError(field, "a data URL must look like data:image/png;base64,...", status=400)
        s = rest
    s = "".join(s.split())
    if not s:
        raise PredictError(field, "is empty", status=400)
    try:
        raw = base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError) as e:
        raise PredictError(field, f"is not valid base64 ({e})", status=400) from None
    return open_image(raw, field=field, max_pixels=max_pixels)


def resolve_image_path(value: Any, image_root: Path | None, *, field: str = "image.path") -> Path:
    """A path strictly inside `image_root` (after resolving `..` and symlinks) or PredictError."""
    if not isinstance(value, str) or not value.strip():
        raise PredictError(field, "must be a non-empty string (a path relative to the image root)")
    if image_root is None:
        raise PredictError(field, "this server has no image root; send the image as base64 or start the server "
                                  "with --image-root", status=403)
    if "\x00" in value:
        raise PredictError(field, "contains a NUL byte", status=400)
    pure = PurePosixPath(value)
    if pure.is_absolute() or Path(value).is_absolute() or value.startswith("~"):
        raise PredictError(field, "must be relative to the image root; absolute paths are refused", status=403)
    if ".." in pure.parts:
        raise PredictError(field, "must not contain '..'; paths outside the image root are refused", status=403)
    root = image_root.resolve()
    try:
        resolved = (root / pure).resolve(strict=False)
    except (OSError, RuntimeError) as e:  # symlink loops
        raise PredictError(field, f"cannot be resolved ({e})", status=403) from None
    if not resolved.is_relative_to(root):
        raise PredictError(field, "resolves outside the image root (symlinks may not leave it)", status=403)
    if not resolved.is_file():
        raise PredictError(field, f"no such image file under the image root: {value}", status=404)
    return resolved


def load_request_image(spec: Any, image_root: Path | None, limits: Limits) -> Any:
    """The request's `image` member -> PIL image or None."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise PredictError("image", 'must be an object: {"base64": "..."} or {"path": "relative/path.png"}')
    keys = [k for k in spec if k in IMAGE_KEYS]
    extra = sorted(k for k in spec if k not in IMAGE_KEYS)
    if extra:
        raise PredictError(f"image.{extra[0]}", 'unknown field; an image is {"base64": ...} or {"path": ...}')
    if len(keys) != 1:
        raise PredictError("image", 'give exactly one of "base64" or "path"')
    if keys[0] == "base64":
        return decode_base64_image(spec["base64"], max_pixels=limits.max_image_pixels)
    path = resolve_image_path(spec["path"], image_root)
    return open_image(path, field="image.path", max_pixels=limits.max_image_pixels)


ASSET_SOURCES = ("data_base64", "base64", "path", "url", "image", "image_url", "part")
ASSET_META = ("type", "format", "detail")


def load_image_spec(field: str, spec: Any, image_root: Path | None, limits: Limits,
                    parts: Mapping[str, bytes] | None = None) -> Any:
    """An image of a request -> decoded RGB PIL image, whatever way it came.

    `field == "image"` is rlcd's alias (`{"base64"}` or `{"path"}`); anything else is a System One asset
    or an image content part: `{"type": "image", "format": "png", "data_base64": ...}`, `{"path": ...}`
    (under the image root), `{"image": "data:image/png;base64,..." | path}`, or `{"type": "image", "part": NAME}`:
    the bytes of part NAME of a multipart body (`parts`, from `rlcd.serving.bodies`; as in the official API,
    `data_base64` beside `part` is ignored). URLs are refused: the server does not fetch (it may run offline);
    send the bytes.
    """
    if field == "image":
        return load_request_image(spec, image_root, limits)
    if not isinstance(spec, dict):
        raise PredictError(field, 'an image is an object, e.g. {"type": "image", "format": "png", "data_base64": "..."}')
    unknown = sorted(k for k in spec if k not in ASSET_SOURCES + ASSET_META)
    if unknown:
        raise PredictError(f"{field}.{unknown[0]}", f"unknown field; an image has one of {', '.join(ASSET_SOURCES)}")
    if "part" in spec:
        name = spec["part"]
        if parts is None or not isinstance(name, str) or name not in parts:
            raise PredictError(f"{field}.part", "names a part of a multipart/form-data body, and this body has no "
                                                "such part; send the image as that part, or as data_base64 in JSON")
        return open_image(parts[name], field=f"{field}.part", max_pixels=limits.max_image_pixels)
    sources = [k for k in ASSET_SOURCES if k in spec]
    if len(sources) != 1:
        raise PredictError(field, "give exactly one of data_base64, path or url (data_base64 is what System One sends)")
    key = sources[0]
    value = spec[key]
    if key == "image" and isinstance(value, str) and not value.startswith(("data:", "http://", "https://")):
        key = "path"
    if key == "image_url" or (isinstance(value, str) and value.startswith(("http://", "https://"))) or key == "url":
        raise PredictError(f"{field}.{key}", "URL images are not fetched (this server does not go online); send the "
                                             "bytes as data_base64, or a path under the server's image root")
    if key == "path":
        path = resolve_image_path(value, image_root, field=f"{field}.{key}")
        return open_image(path, field=f"{field}.{key}", max_pixels=limits.max_image_pixels)
    return decode_base64_image(value, field=f"{field}.{key}", max_pixels=limits.max_image_pixels)


def request_image(parsed: Any, image: Any = None, *, takes_images: bool, limits: Limits,
                  image_root: Path | None = None, parts: Mapping[str, bytes] | None = None) -> Any:
    """The one image a parsed request (`serving.request.ParsedRequest`) is about, decoded, or None: `image` passed
    beside the request (a path, bytes or PIL image; refused when the request carries one too, or the model reads
    no images), else the request's own (`load_image_spec`: its `image`, an asset or a multipart part)."""
    if image is not None:
        if parsed.images:
            raise PredictError(parsed.images[0][0], "the request carries an image and another was passed "
                                                    "beside it; this model reads one image per request")
        if not takes_images:
            raise PredictError("image", "this model's backbone is text-only (it reads no images); send text only")
        return open_image(image, max_pixels=limits.max_image_pixels)
    if parsed.images:
        field, spec = parsed.images[0]
        return load_image_spec(field, spec, image_root, limits, parts)
    return None
