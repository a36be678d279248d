"""Backbone presets: Qwen3.5 vision-language models from the hub, a local directory, or random tiny ones.

`load_backbone(spec)` accepts

* a preset name from `PRESETS`:
  - `qwen3.5-0.8b` / `qwen3.5-2b`: `Qwen3_5ForConditionalGeneration.from_pretrained(hub_id,
    revision=...)`; with no network and no local hub cache this raises a `RuntimeError` that says how
    to point `--model` at a local copy;
  - `tiny`: a random-weight Qwen3.5 VLM (same classes; 4 text layers in the 3:1 linear/full
    attention pattern, hidden 256, 2 small vision blocks) with the real Qwen3.5 tokenizer built
    offline (`rlcd.model.tokenizer.qwen_tokenizer`);
  - `tiny-toy`: the same classes, hidden 64, with a 1,024-rank toy vocabulary plus the Qwen special
    tokens (fast unit tests);
* a local directory written by `save_backbone()` (or any `save_pretrained` copy of a Qwen3.5 VLM);
* a hub id `owner/name` or `owner/name@revision` (only then is the hub contacted).

Random weights are a deterministic function of `seed`. `Backbone.info` records preset, hub id,
revision and a sha256 of the model config, and is copied into every artefact.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from ..schema import MARKER_TOKEN
from .tokenizer import fix_tokenizer, load_tokenizer, qwen_tokenizer, special_ids, toy_tokenizer, vocab_name

INFO_FILE = "rlcd_backbone.json"

log = logging.getLogger(__name__)  # what is loaded from where (the CLI shows INFO on stderr)

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.5-0.8b": {
        "kind": "hub",
        "hub_id": "Qwen/Qwen3.5-0.8B",
        "revision": "2fc06364715b967f1860aea9cf38778875588b17",
    },
    "qwen3.5-2b": {
        "kind": "hub",
        "hub_id": "Qwen/Qwen3.5-2B",
        "revision": "15852e8c16360a2fea060d615a32b45270f8a8fc",
    },
    "tiny": {"kind": "random", "hidden": 256, "vocab": "qwen", "layers": 4, "vision_depth": 2},
    "tiny-toy": {"kind": "random", "hidden": 64, "vocab": "toy", "layers": 4, "vision_depth": 2},
}
DEFAULT_PRESET = "qwen3.5-0.8b"

# Every nn.Linear of the language model, nothing of the vision tower, never lm_head. peft
# full-matches a string `target_modules` against module names relative to the model it wraps
# (Qwen3_5ForConditionalGeneration: `model.language_model.layers.N.<block>.<name>`).
LORA_LINEAR_NAMES = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "linear_attn": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
LORA_TARGET_REGEX = (
    r"model\.language_model\.layers\.\d+\.(?:"
    + "|".join(f"{blk}\\.(?:{'|'.join(names)})" for blk, names in LORA_LINEAR_NAMES.items())
    + r")"
)

# The image processor values shared by every Qwen3.5 size (patch 16, temporal patch 2, merge 2,
# mean/std 0.5). Pixel bounds: the processor's defaults (56*56 .. 28*28*1280 pixels).
IMAGE_PROCESSOR_KW = dict(
    patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]
)

_VOLATILE_CONFIG_KEYS = {
    "transformers_version", "_name_or_path", "dtype", "torch_dtype", "_attn_implementation",
    "_attn_implementation_autoset", "_attn_implementation_internal", "_commit_hash", "architectures",
    "output_attentions", "output_hidden_states", "use_cache", "_experts_implementation",
}


class BackboneError(UserError, ValueError, RuntimeError):
    """A backbone that cannot be found or loaded as named (unknown preset, missing dir, hub offline)."""


@dataclass
class Backbone:
    """A Qwen3.5 VLM with its tokenizer, PIL image processor and provenance `info`."""

    model: Any
    tokenizer: Any
    image_processor: Any
    info: dict = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# configs


def _mrope_section(n: int) -> list[int]:
    a = math.ceil(n / 3)
    b = math.ceil((n - a) / 2)
    return [a, b, n - a - b]


def tiny_config(hidden: int, tokenizer: Any, *, layers: int = 4, vision_depth: int = 2) -> Any:
    """A small Qwen3_5Config with the real layer pattern (3 linear : 1 full attention)."""
    from transformers import Qwen3_5Config

    if hidden % 32 or hidden < 64:
        raise ValueError("tiny hidden size must be a multiple of 32 and at least 64")
    if layers % 4:
        raise ValueError("tiny layer count must be a multiple of 4 (3 linear : 1 full attention)")
    ids = special_ids(tokenizer)
    head_dim = 64 if hidden >= 256 else 32
    heads = max(2, hidden // head_dim)
    lin_heads = 4
    vocab_size = 248320 if len(tokenizer) > 200_000 else int(math.ceil(len(tokenizer) / 64) * 64)
    rotary_half = int(head_dim * 0.25) // 2
    text = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=head_dim,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=hidden // lin_heads,
        linear_value_head_dim=hidden // lin_heads,
        linear_num_key_heads=lin_heads,
        linear_num_value_heads=lin_heads,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=True,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        rope_parameters=dict(
            rope_type="default",
            rope_theta=10_000_000.0,
            partial_rotary_factor=0.25,
            mrope_section=_mrope_section(rotary_half),
            mrope_interleaved=True,
        ),
        eos_token_id=ids["<|endoftext|>"],
    )
    vision = dict(
        depth=vision_depth,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        in_channels=3,
        patch_size=IMAGE_PROCESSOR_KW["patch_size"],
        spatial_merge_size=IMAGE_PROCESSOR_KW["merge_size"],
        temporal_patch_size=IMAGE_PROCESSOR_KW["temporal_patch_size"],
        out_hidden_size=hidden,
        num_position_embeddings=64,
        hidden_act="gelu_pytorch_tanh",
    )
    return Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )


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


def make_image_processor() -> Any:
    """The PIL Qwen2-VL image processor with the Qwen3.5 values (torchvision is not needed)."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR_KW)


def _check_image_processor(ip: Any, model: Any) -> None:
    vc = model.config.vision_config
    for a, b in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                 ("temporal_patch_size", "temporal_patch_size")):
        if getattr(ip, a, None) != getattr(vc, b, None):
            raise RuntimeError(f"image processor {a}={getattr(ip, a, None)} but vision config {b}={getattr(vc, b, None)}")


# --------------------------------------------------------------------------------------------
# freezing / LoRA helpers


def freeze_all(model: nn.Module) -> None:
    for p in model.parameters():
        p.requires_grad_(False)


def vision_module(model: nn.Module) -> nn.Module:
    """The vision tower of a (possibly peft-wrapped) Qwen3.5 VLM."""
    for name, mod in model.named_modules():
        if name.endswith("model.visual") or name == "visual":
            return mod
    raise RuntimeError("model has no vision tower (`model.visual`)")


def language_linear_names(model: nn.Module) -> list[str]:
    """Names of every nn.Linear in the language model (the LoRA targets)."""
    import re

    out = []
    for name, mod in model.named_modules():
        if ".lora_" in name or name.endswith(".base_layer"):
            continue  # peft internals
        if (isinstance(mod, nn.Linear) or hasattr(mod, "base_layer")) and ".language_model." in f".{name}" \
                and re.search(r"layers\.\d+\.", name):
            out.append(name)
    return out


# --------------------------------------------------------------------------------------------
# loading


def _info(preset: str, source: str, model: Any, tok: Any, **extra: Any) -> dict:
    tc = model.config.text_config
    info = {
        "preset": preset,
        "source": source,
        "hub_id": None,
        "revision": None,
        "config_hash": config_hash(model.config),
        "hidden_size": int(tc.hidden_size),
        "num_layers": int(tc.num_hidden_layers),
        "marker_token": MARKER_TOKEN,
        "marker_id": int(tok.convert_tokens_to_ids(MARKER_TOKEN)),
        "vocab": vocab_name(tok),
        "vocab_size": int(len(tok)),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }
    info.update(extra)
    return info


def _check_marker(tok: Any) -> None:
    ids = tok.encode(MARKER_TOKEN, add_special_tokens=False)
    if len(ids) != 1:
        raise RuntimeError(f"the marker {MARKER_TOKEN} is not a single token in this tokenizer ({ids})")


def build_random(preset: str = "tiny", *, hidden: int | None = None, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Backbone:
    """Build a random-weight preset (`tiny`, `tiny-toy`); weights are deterministic from `seed`."""
    from transformers import Qwen3_5ForConditionalGeneration

    spec = PRESETS[preset]
    if spec["kind"] != "random":
        raise ValueError(f"{preset} is not a random preset")
    hidden = int(hidden or spec["hidden"])
    tok = qwen_tokenizer() if spec["vocab"] == "qwen" else toy_tokenizer()
    cfg = tiny_config(hidden, tok, layers=spec["layers"], vision_depth=spec["vision_depth"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5ForConditionalGeneration(cfg)
    model.to(device=device, dtype=dtype).eval()
    ip = make_image_processor()
    _check_marker(tok)
    return Backbone(model, tok, ip, _info(preset, "random", model, tok, seed=int(seed)))


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


def _load_hub(name: str, hub_id: str, revision: str | None, *, dtype: torch.dtype, device: Any,
              cache_dir: str | None) -> Backbone:
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3_5ForConditionalGeneration

    kw = {"revision": revision, "cache_dir": cache_dir}
    try:
        tok = fix_tokenizer(AutoTokenizer.from_pretrained(hub_id, **kw))
        model = Qwen3_5ForConditionalGeneration.from_pretrained(hub_id, dtype=dtype, **kw)
    except Exception as e:  # offline, not cached, unreachable: all end here
        raise _hub_error(name, hub_id, revision, e) from e
    try:
        ip = Qwen2VLImageProcessorPil.from_pretrained(hub_id, **kw)
    except Exception:
        ip = make_image_processor()
    model.to(device).eval()
    _check_image_processor(ip, model)
    _check_marker(tok)
    return Backbone(model, tok, ip, _info(name, "hub", model, tok, hub_id=hub_id, revision=revision))


def _load_local(path: Path, *, dtype: torch.dtype, device: Any) -> Backbone:
    from transformers import Qwen2VLImageProcessorPil, Qwen3_5ForConditionalGeneration

    if not (path / "config.json").is_file():
        raise BackboneError(f"{path} is not a model directory (no config.json); make one with save_backbone()")
    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(path), dtype=dtype)
    model.to(device).eval()
    tok = load_tokenizer(path)
    try:
        ip = Qwen2VLImageProcessorPil.from_pretrained(str(path))
    except Exception:
        ip = make_image_processor()
    _check_image_processor(ip, model)
    _check_marker(tok)
    saved: dict = {}
    if (path / INFO_FILE).is_file():
        saved = json.loads((path / INFO_FILE).read_text())
    info = _info(saved.get("preset", "local"), "local", model, tok, path=str(path.resolve()))
    for k in ("hub_id", "revision", "seed", "vocab"):
        if saved.get(k) is not None:
            info[k] = saved[k]
    if saved.get("config_hash") and saved["config_hash"] != info["config_hash"]:
        info["saved_config_hash"] = saved["config_hash"]
    return Backbone(model, tok, ip, info)


def load_backbone(spec: str = DEFAULT_PRESET, *, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu", seed: int = 0, hidden: int | None = None,
                  cache_dir: str | None = None) -> Backbone:
    """Load a backbone from a preset name, a local directory, or a hub id (`owner/name[@rev]`).

    `seed` (and `hidden`) only apply to the random presets; `cache_dir` only to hub loads.
    """
    onto = f"{device} {str(dtype).removeprefix('torch.')}"
    if isinstance(spec, Path) or (isinstance(spec, str) and spec not in PRESETS and Path(spec).expanduser().is_dir()):
        log.info("backbone: loading local directory %s onto %s", Path(spec).expanduser(), onto)
        return _load_local(Path(spec).expanduser(), dtype=dtype, device=device)
    if spec in PRESETS:
        p = PRESETS[spec]
        if p["kind"] == "random":
            log.info("backbone: building preset %s (random weights, seed %s) on %s", spec, seed, onto)
            return build_random(spec, hidden=hidden, seed=seed, dtype=dtype, device=device)
        log.info("backbone: loading preset %s = %s@%s from the Hugging Face hub (or its local cache) onto %s", spec,
                 p["hub_id"], p["revision"][:12], onto)
        return _load_hub(spec, p["hub_id"], p["revision"], dtype=dtype, device=device, cache_dir=cache_dir)
    if isinstance(spec, str) and spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        hub_id, _, rev = spec.partition("@")
        log.info("backbone: loading %s from the Hugging Face hub (or its local cache) onto %s", spec, onto)
        try:
            return _load_hub(spec, hub_id, rev or None, dtype=dtype, device=device, cache_dir=cache_dir)
        except BackboneError as e:
            raise BackboneError(f"{e} (if {spec!r} was meant as a local directory: it does not exist)") from e.__cause__
    raise BackboneError(unknown_backbone_message(spec))


def unknown_backbone_message(spec: Any) -> str:
    return (f"unknown backbone {str(spec)!r}: use a preset ({', '.join(PRESETS)}), a local model directory, "
            "or a hub id owner/name[@revision]")


def check_backbone_spec(spec: str) -> str:
    """Cheap check that `spec` names a backbone (no loading): preset, existing directory or hub id."""
    if spec in PRESETS or Path(spec).expanduser().is_dir():
        return spec
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")) and not spec.endswith("/"):
        return spec  # a hub id; whether it loads offline is only known when loading
    if Path(spec).expanduser().exists():
        raise BackboneError(f"{spec} is not a model directory")
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
    backbone.image_processor.save_pretrained(str(directory))
    info = dict(backbone.info)
    info["config_hash"] = config_hash(model.config)
    (directory / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return directory
