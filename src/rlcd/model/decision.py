"""DecisionModel: a backbone (frozen, LoRA on the language linears) + shared candidate scorer: the nn.Module.

`forward(batch) -> logits [B, Kmax]` (float32, -inf on padded candidates) runs the inner decoder only
(last hidden states; vocabulary logits are never computed). The backbone's family adapter
(`rlcd.model.families`) drives the decoder with explicit positions, so no state is carried between
calls: Qwen3.5 gets token embeddings with image features scattered into the `<|image_pad|>` slots and
M-RoPE position ids (the vision tower runs once per image occurrence, without gradients); a text
decoder gets `input_ids` and `position_ids`. `forward` routes by the batch's type (DDP wraps it, so every
training batch goes through it): a `Batch` runs full rows, a `CaseBatch` shares each case's prefix
(`case_train.case_forward`), a `CutBatch` runs the layers above the cut on stored states
(`cut_forward.cut_features`), a `FeatureBatch` carries its features.

The module holds no inference policy: scoring cases (the plan, the prefix-or-full execution, the request caches,
the head call, usage) is `rlcd.model.runner.CaseRunner`'s, and `rlcd.model.cases.CaseEncoder` tokenises. What
outside code needs of the backbone is public: `causal_lm()`, `decoder()`, `decoder_forward(...)`, `hidden_states`,
`image_features`.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch
from torch import nn

from .backbone import Backbone, freeze_all
from .case_train import CaseBatch, case_forward
from .collate import Batch, Collator, FeatureBatch
from .cut_forward import CutBatch, cut_features
from .families.qwen35 import mrope_positions  # noqa: F401 (mrope_positions: public API)
from .head import CandidateScorer
from .prefix_forward import read_states
from .prompt import DEFAULT_MAX_TOKENS, DEFAULT_NOUL, PromptEncoder

LORA_DROPOUT = 0.0
PROMPT_VERSION = 1
_LORA_PREFIX = "base_model.model."


class DecisionModel(nn.Module):
    """Backbone + LoRA + CandidateScorer. Takes ownership of `backbone.model` (peft wraps it in place)."""

    def __init__(self, backbone: Backbone, *, lora: bool = True, lora_rank: int = 8, lora_alpha: float = 16,
                 proj_dim: int = 256, centring: str = "running_mean", seed: int = 0,
                 max_tokens: int = DEFAULT_MAX_TOKENS, lora_layers: int | None = None):
        super().__init__()
        self.family = backbone.family
        self.backbone_info = dict(backbone.info)
        self.tokenizer = backbone.tokenizer
        self.image_processor = backbone.image_processor
        self.encoder = PromptEncoder(backbone.tokenizer, max_tokens=max_tokens,
                                     spec=self.family.prompt_spec(backbone.tokenizer))
        model = backbone.model
        freeze_all(model)
        self.num_layers = self.family.num_layers(model)
        if lora_layers is not None and not 1 <= int(lora_layers) < self.num_layers:
            from ..errors import OptionError

            # K = every layer leaves nothing frozen below the cut to cache: that is plain LoRA on every layer
            raise OptionError(f"lora_layers={lora_layers}: this backbone has {self.num_layers} decoder layers; give "
                              f"1..{self.num_layers - 1} (top layers with LoRA above a frozen cut), or none for LoRA "
                              f"on every layer")
        # the first decoder layer with LoRA; everything below it is frozen (None: LoRA on every layer)
        self.cut_layer = self.num_layers - int(lora_layers) if lora_layers is not None else None
        self.lora_config: dict | None = None
        if lora:
            from peft import LoraConfig, get_peft_model

            targets = self.family.lora_targets(model)
            if self.cut_layer is not None:
                from .families.base import restrict_to_layers

                targets = restrict_to_layers(targets, list(range(self.cut_layer, self.num_layers)))
            cfg = LoraConfig(r=int(lora_rank), lora_alpha=lora_alpha, lora_dropout=LORA_DROPOUT, bias="none",
                             target_modules=targets)
            with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
                torch.manual_seed(seed)
                model = get_peft_model(model, cfg)
            self.lora_config = {"r": int(lora_rank), "alpha": lora_alpha, "dropout": LORA_DROPOUT,
                                "target_modules": targets,
                                **({"layers": [self.cut_layer, self.num_layers]} if self.cut_layer is not None else {})}
        self.backbone = model
        hidden = int(self.family.text_config(self.causal_lm()).hidden_size)
        dev = next(self.backbone.parameters()).device
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            self.head = CandidateScorer(hidden, proj_dim=proj_dim, centring=centring)
        self.head.to(dev)
        self.merged = False
        self.frozen_features = False  # set by the trainer while only the head learns
        self.seed = int(seed)
        if self.family.supports_images:
            self.image_token_id = self.family.image_token_id(self.causal_lm())
            self.merge_size = self.family.merge_size(self.causal_lm())
        else:
            self.image_token_id, self.merge_size = None, 1
        self.train(False)

    # ------------------------------------------------------------------ construction helpers
    def causal_lm(self) -> nn.Module:
        """The backbone's causal LM, under peft's wrapper when LoRA is unmerged (what the family methods take)."""
        m = self.backbone
        return m.get_base_model() if hasattr(m, "get_base_model") else m

    def decoder(self) -> nn.Module:
        """The inner decoder (no lm_head): Qwen3_5Model (vision + language), or a text decoder's model."""
        return self.family.decoder(self.causal_lm())

    @property
    def vision(self) -> nn.Module | None:
        """The frozen vision tower (None for a text-only backbone)."""
        return self.family.vision(self.causal_lm())

    @property
    def supports_images(self) -> bool:
        return bool(self.family.supports_images)

    @property
    def device(self) -> torch.device:
        return self.head.w_d.weight.device

    @property
    def placement(self) -> dict[str, str]:
        """Where the model runs: {"device": "cuda:0", "dtype": "bfloat16"} (the backbone's; the scorer is FP32)."""
        dtype = next(self.backbone.parameters()).dtype
        why = getattr(self, "placement_reason", "")  # why `--dtype auto` chose it (rlcd.device), set at load
        return {"device": str(self.device), "dtype": str(dtype).replace("torch.", ""),
                **({"reason": why} if why else {})}

    def train(self, mode: bool = True) -> "DecisionModel":
        super().train(mode)
        vision = self.vision
        if vision is not None:
            vision.eval()  # the vision tower stays frozen and in eval mode
        return self

    def collator(self, *, image_root: Any = None) -> Collator:
        """A `Collator` with this model's prompt frame (marker, chat template, image tokens)."""
        return Collator(self.tokenizer, self.image_processor, encoder=self.encoder, image_root=image_root)

    @property
    def info(self) -> dict:
        out = dict(self.backbone_info)
        out["head"] = self.head.config
        out["centring"] = self.head.centring
        out["lora"] = (dict(self.lora_config, merged=self.merged) if self.lora_config is not None else None)
        out["prompt"] = {"version": PROMPT_VERSION, "max_tokens": self.encoder.max_tokens,
                         "noul_defaults": dict(DEFAULT_NOUL), "marker": self.backbone_info.get("marker_token")}
        if self.encoder.spec.template is not None:
            out["prompt"]["frame"] = self.encoder.spec.template
            out["prompt"]["head"] = self.encoder.spec.head
        out["seed"] = self.seed
        return out

    # ------------------------------------------------------------------ parameters
    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        lora = [p for n, p in self.backbone.named_parameters() if "lora_" in n]
        head = list(self.head.parameters())
        n_trainable = sum(1 for p in self.parameters() if p.requires_grad)
        if n_trainable != sum(1 for p in lora + head if p.requires_grad):
            raise RuntimeError("a parameter outside the LoRA adapters and the head is trainable")
        return {"lora": lora, "head": head}

    @staticmethod
    def _lora_key(name: str) -> str:
        return "lora." + (name[len(_LORA_PREFIX):] if name.startswith(_LORA_PREFIX) else name)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """LoRA weights + head parameters and buffers, detached copies, with stable names."""
        sd = {self._lora_key(n): p.detach().clone() for n, p in self.backbone.named_parameters() if "lora_" in n}
        sd.update({f"head.{k}": v.detach().clone() for k, v in self.head.state_dict().items()})
        return sd

    @torch.no_grad()
    def load_trainable_state_dict(self, sd: dict[str, torch.Tensor], strict: bool = True) -> None:
        own: dict[str, torch.Tensor] = {self._lora_key(n): p for n, p in self.backbone.named_parameters() if "lora_" in n}
        head_sd = self.head.state_dict(keep_vars=True)
        own.update({f"head.{k}": v for k, v in head_sd.items()})
        missing = sorted(set(own) - set(sd))
        unexpected = sorted(set(sd) - set(own))
        if strict and (missing or unexpected):
            hint = " (LoRA is merged: load before merge())" if self.merged and any(k.startswith("lora.") for k in unexpected) else ""
            raise KeyError(f"trainable state mismatch{hint}: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for k, v in sd.items():
            if k in own:
                if own[k].shape != v.shape:
                    raise ValueError(f"{k}: shape {tuple(v.shape)} != {tuple(own[k].shape)}")
                own[k].copy_(v.to(own[k].device, own[k].dtype))

    def lora_is_zero(self) -> bool:
        """No LoRA, or every LoRA B zero (x A B = 0: the model computes what its base weights do)."""
        return not any(torch.count_nonzero(p) for n, p in self.backbone.named_parameters() if "lora_B" in n)

    def merge(self) -> "DecisionModel":
        """Fold LoRA into the base weights (peft merge_and_unload); idempotent. A zero LoRA (every B zero: a
        head-only run) is dropped instead (peft unload): adding its zero delta would turn the base weights' -0.0
        into +0.0 (Q4_K GGUF weights hold many), which changes their bytes and so `rlcd.features.weights_digest`,
        and the run's evaluation would then miss the feature cache it trained on and run the backbone."""
        if self.lora_config is not None and not self.merged:
            self.backbone = self.backbone.unload() if self.lora_is_zero() else self.backbone.merge_and_unload()
            freeze_all(self.backbone)
            self.merged = True
            self.train(self.training)
        return self

    # ------------------------------------------------------------------ backbone plumbing
    def image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Vision tower (frozen, no grad) -> merged features [n_image_tokens, hidden]."""
        return self.family.image_features(self.causal_lm(), pixel_values, image_grid_thw, self.device)

    def decoder_forward(self, ids: torch.Tensor | None, feats: torch.Tensor | None,
                        attention_mask: torch.Tensor | None, positions: torch.Tensor, cache: Any = None,
                        use_cache: bool = False, chunk_size: int | None = None, layers: tuple[int, int] | None = None,
                        inputs_embeds: torch.Tensor | None = None) -> Any:
        """The decoder's forward with explicit positions (`Family.run`): an output with `last_hidden_state` (and the
        cache with `use_cache`); `feats`: image features scattered into the image tokens; `layers` a stage."""
        return self.family.run(self.causal_lm(), ids, feats, attention_mask, positions, cache=cache,
                               use_cache=use_cache, chunk_size=chunk_size, layers=layers, inputs_embeds=inputs_embeds)

    def hidden_states(self, batch: Batch, layers: tuple[int, int] | None = None, *, cache: Any = None) -> torch.Tensor:
        """Last hidden states [B, T, H] of a full forward (`layers=(0, c)`: the states entering layer c, un-normed);
        `cache`: a cache the forward fills (the runner keeps a cold row's state from it)."""
        dev = self.device
        ids = batch.input_ids.to(dev)
        attn = batch.attention_mask.to(dev)
        feats = None
        if batch.pixel_values is not None:
            if not self.supports_images:
                raise ValueError(f"the {self.family.name} backbone is text-only: this batch holds images")
            feats = self.image_features(batch.pixel_values, batch.image_grid_thw)
        image_mask = batch.mm_token_type_ids.to(dev) if batch.mm_token_type_ids is not None else None
        pos = self.family.full_positions(ids, image_mask, batch.image_grid_thw, self.merge_size)
        return self.decoder_forward(ids, feats, attn, pos, cache=cache, use_cache=cache is not None,
                                    layers=layers).last_hidden_state

    def features(self, batch: Batch | FeatureBatch | CutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(h_decision [B,H], h_markers [B,Kmax,H]): a `FeatureBatch`'s own, a `CutBatch`'s through the layers above
        the cut (`cut_forward.cut_features`), else a full forward's."""
        if isinstance(batch, FeatureBatch):
            return batch.h_dec, batch.h_cand
        if isinstance(batch, CutBatch):
            return cut_features(self, batch)
        return read_states(self.hidden_states(batch), batch.decision_pos, batch.marker_pos)

    def forward(self, batch: Batch | CaseBatch | FeatureBatch | CutBatch) -> torch.Tensor:
        """Logits [B, Kmax]. While `frozen_features` is set (head-only training, the head warm-up) the
        backbone runs without gradients: only the head learns, and the features equal the cached ones.
        A `CaseBatch` (Recipe.batch_by="case") shares each state's prefix (`case_train.case_forward`)."""
        if isinstance(batch, CaseBatch):
            return case_forward(self, batch)
        if self.frozen_features:
            with torch.no_grad():
                h_dec, h_cand = self.features(batch)
        else:
            h_dec, h_cand = self.features(batch)
        return self.head(h_dec, h_cand, batch.cand_mask.to(h_dec.device))

    @torch.no_grad()
    def init_centring(self, batches: Iterable[Batch]) -> int:
        """Set the head's centring buffers from the features of `batches`; returns the row count."""
        decs, cands = [], []
        for b in batches:
            h_dec, h_cand = self.features(b)
            decs.append(h_dec.float())
            cands.append(h_cand.float()[b.cand_mask.to(h_cand.device)])
        if not decs:
            raise ValueError("init_centring needs at least one batch")
        self.head.init_centring(torch.cat(decs), torch.cat(cands))
        return sum(d.shape[0] for d in decs)

def num_params(module: nn.Module, trainable: bool | None = None) -> int:
    return sum(p.numel() for p in module.parameters() if trainable is None or p.requires_grad == trainable)


__all__ = ["DecisionModel", "mrope_positions", "num_params"]
