"""Text decoders: any `AutoModelForCausalLM` (Llama/SmolLM2, Qwen2.5/Qwen3, Gemma-style, ...).

* Loading: a hub id (with revision), a local `save_pretrained` directory, a GGUF file (transformers
  dequantises it through the `gguf` package, once: `dequantised_gguf` keeps a float32 safetensors copy under
  `$RLCD_CACHE/gguf/`), or a random-weight tiny Llama with SmolLM2's tokenizer.
* LoRA: every `nn.Linear` of the repeated decoder layers, found from the module tree
  (`base.layer_linear_regex`), never `lm_head`.
* Prompt: the tokenizer's own chat template frames the row: the text before the user content
  (system line, user turn header) is the row's `head`; a tokenizer without a template contributes
  its BOS token when it adds one. The marker is the lowest-id special token that is not BOS, EOS,
  PAD or UNK and that a rendered conversation does not contain (SmolLM2: `<repo_name>`); every
  special token of the tokenizer is rejected in inputs.
* Forward: `input_ids` + explicit `position_ids` [B, T] to the inner decoder (`get_decoder()`), last
  hidden states only. Prefix cache: a `DynamicCache`, its rows selected per suffix call
  (`fork_cache_rows` / `select_cache_rows`). Images are not supported (text-only backbones).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...errors import BackboneError
from ..tokenizer import atomic_save, cache_dir, smollm2_tokenizer
from .base import Family, PromptSpec, cache_kwarg, run_stage

log = logging.getLogger(__name__)

_SENTINEL = "RLCDUSERCONTENT0"  # stands for the user content when the chat template is rendered


# --------------------------------------------------------------------------------------------
# prompt frame


def special_tokens(tokenizer: Any) -> list[str]:
    """Every special token of `tokenizer`, by id (added tokens marked special, and the named ones)."""
    out: dict[str, int] = {}
    for i, t in sorted(getattr(tokenizer, "added_tokens_decoder", {}).items()):
        if getattr(t, "special", False):
            out.setdefault(str(t), int(i))
    for t in getattr(tokenizer, "all_special_tokens", []):
        i = tokenizer.convert_tokens_to_ids(t)
        if isinstance(i, int):
            out.setdefault(str(t), i)
    return [t for t, _ in sorted(out.items(), key=lambda kv: (kv[1], kv[0]))]


def _render(tokenizer: Any, messages: list[dict], **kw: Any) -> str | None:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    except Exception:  # templates may refuse a role (e.g. no system role)
        return None


def chat_frame(tokenizer: Any) -> tuple[str, str | None, str]:
    """(head, template kind, text of a whole rendered conversation) for `tokenizer`.

    With a chat template: the rendering of one user turn (with the generation prompt) cut at the
    user content. Without: the BOS token if encoding adds one, else nothing.
    """
    if getattr(tokenizer, "chat_template", None):
        one = _render(tokenizer, [{"role": "user", "content": _SENTINEL}], add_generation_prompt=True)
        if one is None or one.count(_SENTINEL) != 1:
            raise BackboneError("the tokenizer's chat template cannot frame one user message (it must render the "
                                "user content exactly once)")
        head = one.split(_SENTINEL)[0]
        convo = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                 {"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]
        full = _render(tokenizer, convo, add_generation_prompt=True) or ""
        return head, "chat", one + full
    with_special = tokenizer("x", add_special_tokens=True)["input_ids"]
    bare = tokenizer("x", add_special_tokens=False)["input_ids"]
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and len(with_special) > len(bare) and with_special[0] == bos:
        return tokenizer.bos_token, "bos", tokenizer.bos_token
    return "", None, ""


def pick_marker(tokenizer: Any, specials: list[str], used_text: str) -> str:
    """The lowest-id special token that is a single token, not BOS/EOS/PAD/UNK, unused by the template."""
    named = {getattr(tokenizer, a, None) for a in ("bos_token", "eos_token", "pad_token", "unk_token")}
    for t in specials:
        if t in named or t in used_text:
            continue
        if len(tokenizer.encode(t, add_special_tokens=False)) == 1:
            return t
    raise BackboneError("the tokenizer has no special token the chat template leaves unused, so no candidate "
                        f"marker can be chosen (special tokens: {specials[:20]})")


# --------------------------------------------------------------------------------------------
# configs


def tiny_llama_config(hidden: int, tokenizer: Any, *, layers: int = 4) -> Any:
    """A small LlamaConfig (SmolLM2's shape family: GQA 2:1, SiLU MLP 3x, tied embeddings)."""
    from transformers import LlamaConfig

    if hidden % 32 or hidden < 32:
        raise ValueError("tiny-llama hidden size must be a multiple of 32")
    head_dim = 32 if hidden >= 128 else 16
    heads = hidden // head_dim
    return LlamaConfig(
        vocab_size=int(math.ceil(len(tokenizer) / 64) * 64),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=head_dim,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


@contextlib.contextmanager
def _quiet_progress():
    """No tqdm bars while transformers loads weights or dequantises a GGUF file (its converter calls
    tqdm directly, outside transformers' progress-bar switch: silenced for the load only)."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    bar = gguf_utils.tqdm
    hf_logging.disable_progress_bar()
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar
        if was:
            hf_logging.enable_progress_bar()


# --------------------------------------------------------------------------------------------
# the family


class CausalLMFamily(Family):
    name = "causal-lm"
    supports_images = False

    # ---------------------------------------------------------------- loading
    def build_random(self, spec: dict, *, hidden: int, seed: int, dtype: torch.dtype, device: Any) -> tuple:
        from transformers import LlamaForCausalLM

        if spec["vocab"] != "smollm2":
            raise ValueError(f"unknown tiny-llama vocabulary {spec['vocab']!r}")
        tok = smollm2_tokenizer()
        cfg = tiny_llama_config(hidden, tok, layers=spec["layers"])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(cfg)
        model.to(device=device, dtype=dtype).eval()
        return model, tok, None

    def from_pretrained(self, source: str, *, local: bool, dtype: torch.dtype, device: Any,
                        revision: str | None = None, cache_dir: str | None = None,
                        gguf_file: str | None = None, tokenizer: Any = None, gguf_sha256: str | None = None) -> tuple:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kw: dict[str, Any] = {} if local else {"revision": revision, "cache_dir": cache_dir}
        if gguf_file is not None:
            kw["gguf_file"] = gguf_file
        with _quiet_progress():
            tok = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(source, **kw)
            if gguf_file is not None:
                model = dequantised_gguf(Path(source) / gguf_file, sha256=gguf_sha256).to(dtype)
            else:
                model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kw)
        model.to(device).eval()
        return model, tok, None

    # ---------------------------------------------------------------- architecture
    def decoder(self, lm: nn.Module) -> nn.Module:
        return lm.get_decoder()

    # ---------------------------------------------------------------- prompt
    def prompt_spec(self, tokenizer: Any) -> PromptSpec:
        specials = special_tokens(tokenizer)
        head, template, used = chat_frame(tokenizer)
        marker = pick_marker(tokenizer, specials, used)
        return PromptSpec(family=self.name, marker=marker, reserved=tuple(specials), head=head, template=template)

    # ---------------------------------------------------------------- forward
    def run(self, lm, input_ids, image_features, attention_mask, positions, *, cache=None, use_cache=False,
            chunk_size=None, layers=None, inputs_embeds=None):
        if image_features is not None:
            raise ValueError("a text-only backbone cannot take image features")
        dec = self.decoder(lm)
        if layers is not None:
            hidden = inputs_embeds if inputs_embeds is not None else dec.get_input_embeddings()(input_ids)
            return run_stage(dec, hidden, attention_mask, positions, layers, cache=cache, use_cache=use_cache)
        kw: dict[str, Any] = {cache_kwarg(dec): cache} if cache is not None else {}
        return dec(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=use_cache,
                   **kw)


def _drop_gguf_quantization(model: nn.Module) -> None:
    """A dequantised GGUF model holds plain float weights: forget the GGUF quantiser, so that
    `save_pretrained` writes an ordinary checkpoint (it refuses a model "quantized with gguf")."""
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None


def dequantised_gguf(path: Path, sha256: str | None = None) -> nn.Module:
    """The float32 model a GGUF file holds, dequantised once and kept as safetensors under
    `$RLCD_CACHE/gguf/<name>-<sha256 of the file>-tf<transformers version>/`.

    Why: transformers re-parses and dequantises the whole file on every load (30-60 s for SmolLM2-135M
    on a 2-core CPU, more than a head-only run on cached features trains); the safetensors copy loads
    in about a second with the same float32 values. Always dequantised in float32: asked for another
    dtype, transformers keeps the weights packed and casts every matmul, which is slower; callers cast after.
    A corrupt copy is rebuilt; the copy is written under a temporary name and renamed into place. `sha256`: the
    file's digest when the caller has already checked it (a packaged preset), so the file is not hashed again.
    """
    import transformers
    from transformers import AutoModelForCausalLM

    from ...data.io import sha256_file

    path = Path(path).expanduser().resolve()
    digest = sha256 or sha256_file(path)
    target = cache_dir() / "gguf" / f"{path.stem}-{digest[:16]}-tf{transformers.__version__}"
    if (target / "config.json").is_file():
        try:
            return AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
        except Exception:  # noqa: BLE001 - a damaged copy: rebuild it below
            shutil.rmtree(target, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    _drop_gguf_quantization(model)
    try:
        atomic_save(model, target)  # written under a temporary name, renamed into place
    except OSError as e:  # a read-only or full cache directory: the loaded model still serves
        log.warning("could not keep the dequantised %s under %s (%s); the next load dequantises again",
                    path.name, target.parent, e)
    return model


def gguf_source(path: Path) -> tuple[str, str]:
    """(directory, file name) of a GGUF file, as `from_pretrained(dir, gguf_file=name)` wants them."""
    path = Path(path).expanduser().resolve()
    return str(path.parent), path.name


CAUSAL_LM = CausalLMFamily()

__all__ = ["CAUSAL_LM", "CausalLMFamily", "chat_frame", "pick_marker", "special_tokens", "tiny_llama_config",
           "gguf_source", "dequantised_gguf"]
