"""The Qwen3.5 family: vision-language models driven by hand (M-RoPE positions, image features).

The model is a `Qwen3_5ForConditionalGeneration`. Token embeddings, image features scattered into
the `<|image_pad|>` slots and explicit M-RoPE position ids go straight to the language model, so no
state is carried between calls (`rope_deltas` is reset, never consulted) and the vision tower runs
once per image occurrence, without gradients. The prompt is the project's own (no chat template),
the candidate marker is `<|fim_suffix|>`. The hybrid cache (Gated DeltaNet + full attention) is
expanded by row selection (`reorder_cache(index)` on a fork; `batch_repeat_interleave` fails on it).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ...schema import RESERVED_TOKENS
from ..tokenizer import QWEN_MARKER, fix_tokenizer, load_tokenizer, qwen_tokenizer, special_ids, toy_tokenizer
from .base import Family, PromptSpec, cache_kwarg, run_stage

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
IMAGE_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
EXACT_ALIGN = 64  # transformers' default DeltaNet chunk (score_case(exact=True) cuts on its grid)
# DeltaNet chunk length for the short suffix calls of score_case (transformers' reference kernel
# defaults to 64 and pads every row to a multiple of it; 32 is 10-18% faster for 30-80 token
# suffixes on CPU). Passed through the model's **kwargs; ignored by kernels that do not take it.
SUFFIX_CHUNK = 32


# --------------------------------------------------------------------------------------------
# configs and parts


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


def _check_marker(tok: Any) -> None:
    ids = tok.encode(QWEN_MARKER, add_special_tokens=False)
    if len(ids) != 1:
        raise RuntimeError(f"the marker {QWEN_MARKER} is not a single token in this tokenizer ({ids})")


def mrope_positions(input_ids: torch.Tensor, image_mask: torch.Tensor, image_grid_thw: torch.Tensor | None,
                    merge_size: int) -> torch.Tensor:
    """Qwen3.5 M-RoPE position ids [3, B, T] (text: t=h=w=index; images: their t/h/w grid).

    Same values as `Qwen3_5Model.get_rope_index` for right-padded rows (tested), computed without
    model state. Image runs are matched to `image_grid_thw` rows in batch order.
    """
    b, t = input_ids.shape
    dev = input_ids.device
    pos = torch.arange(t, device=dev).view(1, 1, t).expand(3, b, t).clone()
    if image_grid_thw is None or not bool(image_mask.any()):
        return pos
    grids = image_grid_thw.tolist()
    g = 0
    for i in range(b):
        row = image_mask[i].bool()
        if not bool(row.any()):
            continue
        idx = torch.nonzero(row).flatten().tolist()
        runs, start, prev = [], idx[0], idx[0]
        for j in idx[1:]:
            if j != prev + 1:
                runs.append((start, prev + 1))
                start = j
            prev = j
        runs.append((start, prev + 1))
        cur, j = 0, 0
        p = pos[:, i]
        for s, e in runs:
            p[:, j:s] = torch.arange(cur, cur + (s - j), device=dev)
            cur += s - j
            gt, gh, gw = (int(x) for x in grids[g])
            g += 1
            hh, ww = gh // merge_size, gw // merge_size
            if e - s != gt * hh * ww:
                raise ValueError(f"row {i}: {e - s} image tokens but grid {grids[g - 1]} needs {gt * hh * ww}")
            p[0, s:e] = torch.arange(gt, device=dev).repeat_interleave(hh * ww) + cur
            p[1, s:e] = torch.arange(hh, device=dev).repeat_interleave(ww).repeat(gt) + cur
            p[2, s:e] = torch.arange(ww, device=dev).repeat(gt * hh) + cur
            cur += max(gh, gw) // merge_size
            j = e
        p[:, j:] = torch.arange(cur, cur + (t - j), device=dev)
    if g != len(grids):
        raise ValueError(f"{len(grids)} image grids given but {g} image runs found in the batch")
    return pos


# --------------------------------------------------------------------------------------------
# the family


class Qwen35Family(Family):
    name = "qwen3.5"
    supports_images = True
    exact_align = EXACT_ALIGN
    suffix_chunk = SUFFIX_CHUNK

    def __init__(self) -> None:
        self._chunk_kw_ok = True

    # ---------------------------------------------------------------- loading
    def build_random(self, spec: dict, *, hidden: int, seed: int, dtype: torch.dtype, device: Any) -> tuple:
        from transformers import Qwen3_5ForConditionalGeneration

        tok = qwen_tokenizer() if spec["vocab"] == "qwen" else toy_tokenizer()
        cfg = tiny_config(hidden, tok, layers=spec["layers"], vision_depth=spec["vision_depth"])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3_5ForConditionalGeneration(cfg)
        model.to(device=device, dtype=dtype).eval()
        _check_marker(tok)
        return model, tok, make_image_processor()

    def from_pretrained(self, source: str, *, local: bool, dtype: torch.dtype, device: Any,
                        revision: str | None = None, cache_dir: str | None = None) -> tuple:
        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3_5ForConditionalGeneration

        kw = {} if local else {"revision": revision, "cache_dir": cache_dir}
        if local:
            model = Qwen3_5ForConditionalGeneration.from_pretrained(source, dtype=dtype)
            tok = load_tokenizer(source)
        else:
            tok = fix_tokenizer(AutoTokenizer.from_pretrained(source, **kw))
            model = Qwen3_5ForConditionalGeneration.from_pretrained(source, dtype=dtype, **kw)
        try:
            ip = Qwen2VLImageProcessorPil.from_pretrained(source, **kw)
        except Exception:
            ip = make_image_processor()
        model.to(device).eval()
        _check_image_processor(ip, model)
        _check_marker(tok)
        return model, tok, ip

    # ---------------------------------------------------------------- architecture
    def decoder(self, lm: nn.Module) -> nn.Module:
        """The inner Qwen3_5Model (vision tower + language model, no lm_head)."""
        return lm.model

    def vision(self, lm: nn.Module) -> nn.Module:
        return lm.model.visual

    def lora_targets(self, lm: nn.Module) -> str:
        return LORA_TARGET_REGEX

    def image_token_id(self, lm: nn.Module) -> int:
        return int(lm.model.config.image_token_id)

    def merge_size(self, lm: nn.Module) -> int:
        return int(lm.model.config.vision_config.spatial_merge_size)

    # ---------------------------------------------------------------- prompt
    def prompt_spec(self, tokenizer: Any) -> PromptSpec:
        special_ids(tokenizer)  # every reserved token must exist
        return PromptSpec(family=self.name, marker=QWEN_MARKER, reserved=tuple(RESERVED_TOKENS),
                          image_tokens=IMAGE_TOKENS, pad="<|endoftext|>")

    # ---------------------------------------------------------------- forward
    def image_features(self, lm: nn.Module, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                       device: Any) -> torch.Tensor:
        """Vision tower (frozen, no grad) -> merged features [n_image_tokens, hidden]."""
        core = lm.model
        with torch.no_grad():
            out = core.get_image_features(pixel_values.to(device), image_grid_thw.to(device))
        po = getattr(out, "pooler_output", out)
        if isinstance(po, (list, tuple)):
            po = torch.cat(list(po), 0)
        return po

    def embed(self, lm: nn.Module, input_ids: torch.Tensor, image_feats: torch.Tensor | None) -> torch.Tensor:
        core = lm.model
        emb = core.get_input_embeddings()(input_ids)
        if image_feats is not None:
            mask = input_ids == self.image_token_id(lm)
            n = int(mask.sum())
            if n != image_feats.shape[0]:
                raise ValueError(f"{n} <|image_pad|> tokens but {image_feats.shape[0]} image features")
            emb = emb.masked_scatter(mask.unsqueeze(-1), image_feats.to(emb.dtype))
        return emb

    def full_positions(self, input_ids, image_mask, image_grid_thw, merge_size):
        if image_mask is None:
            image_mask = torch.zeros_like(input_ids)
        return mrope_positions(input_ids, image_mask, image_grid_thw, merge_size)

    def suffix_positions(self, n, length, start, device):
        return (torch.arange(length, device=device) + start).view(1, 1, -1).expand(3, n, length)

    def text_decoder(self, lm: nn.Module) -> nn.Module:
        return lm.model.language_model

    def run(self, lm, input_ids, image_features, attention_mask, positions, *, cache=None, use_cache=False,
            chunk_size=None, layers=None, inputs_embeds=None):
        core = lm.model
        emb = inputs_embeds if inputs_embeds is not None else self.embed(lm, input_ids, image_features)
        core.rope_deltas = None  # never let a previous image prompt shift positions
        if layers is not None:
            kw = {"chunk_size": chunk_size} if chunk_size is not None and self._chunk_kw_ok and emb.device.type == "cpu" else {}
            types = core.language_model.config.layer_types[layers[0]:layers[1]]
            if "full_attention" not in types:  # transformers sizes a causal mask from a full-attention cache layer
                from transformers.masking_utils import create_recurrent_attention_mask

                attention_mask = {"full_attention": None, "linear_attention": create_recurrent_attention_mask(
                    core.language_model.config, emb, attention_mask, cache)}
            return run_stage(core.language_model, emb, attention_mask, positions, layers, cache=cache,
                             use_cache=use_cache, **kw)
        kw: dict[str, Any] = {cache_kwarg(core.language_model): cache} if cache is not None else {}
        if chunk_size is not None and self._chunk_kw_ok and emb.device.type == "cpu":
            try:
                return core.language_model(inputs_embeds=emb, attention_mask=attention_mask,
                                           position_ids=positions, use_cache=use_cache, chunk_size=chunk_size, **kw)
            except TypeError:  # this transformers version does not pass it through: use the default
                self._chunk_kw_ok = False
        return core.language_model(inputs_embeds=emb, attention_mask=attention_mask, position_ids=positions,
                                   use_cache=use_cache, **kw)


QWEN35 = Qwen35Family()

__all__ = ["QWEN35", "Qwen35Family", "LORA_TARGET_REGEX", "LORA_LINEAR_NAMES", "IMAGE_PROCESSOR_KW",
           "IMAGE_TOKENS", "tiny_config", "make_image_processor", "mrope_positions"]
