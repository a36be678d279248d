"""DecisionModel: a backbone (frozen, LoRA on the language linears) + shared candidate scorer.

`forward(batch) -> logits [B, Kmax]` (float32, -inf on padded candidates) runs the inner decoder only
(last hidden states; vocabulary logits are never computed). The backbone's family adapter
(`rlcd.model.families`) drives the decoder with explicit positions, so no state is carried between
calls: Qwen3.5 gets token embeddings with image features scattered into the `<|image_pad|>` slots and
M-RoPE position ids (the vision tower runs once per image occurrence, without gradients); a text
decoder gets `input_ids` and `position_ids`.

`score_case(state, questions, image)` is the inference path for one request, `score_cases(cases)` for
several (the server's batches, evaluation; `prepare_case` / `case_inputs_from_records` do the
tokenising and image preprocessing first, off the model thread). `score_cases` is `case_features`
(the last hidden states at each row's decision and marker positions) followed by the head. The
planner (`plan_paths`) sends a case through full forwards when sharing saves less than one call's
overhead (a single question, or a short shared prefix); otherwise the common token prefix of each
case's rows is run once (capped at the smallest decision position, so every row's decision token is computed in its own suffix; several cases'
prefixes left-padded into one forward), and the suffixes run batched: one call when their lengths
are similar, otherwise a few calls of similar-length rows (`plan_suffix_groups`: fewest padded tokens
plus a per-call overhead; at most `max_rows` rows per call, on the family's chunk grid). Each call
gets the cache rows it needs from its own fork (`fork_cache_rows`: the selected rows copied, so the
in-place recurrent-state updates of one call cannot reach the next); the last call takes them from
the prefix cache itself (`Family.select_cache_rows`). With a state cache (`rlcd.model.state_cache`, the
Predictor's), the prefix ends where the state ends, prefixes already stored skip the forward and new
ones are stored; the suffix calls then read a cache stacked from copies of every case's prefix state. A cold
case that the cache-off planner runs as full rows (one question) still runs as full rows when the decoder's
cache is keys and values only: the forward keeps its cache and the state's first positions are stored from it
as they are (no second call, no copy), so a cold request costs what it cost without the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
import warnings
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from ..schema import Question
from .backbone import Backbone, freeze_all
from .collate import Batch, Collator, pad_rows
from .families.qwen35 import SUFFIX_CHUNK, mrope_positions  # noqa: F401 (mrope_positions: public API)
from .head import CandidateScorer
from .cases import CaseEncoder, CaseInputs
from .prefix_forward import left_pad, prefix_positions, run_prefixes, suffix_forward
from .plan import CALL_OVERHEAD, common_prefix_len, plan_paths, plan_suffix_groups, request_tokens, shared_prefix_len
from .prompt import DEFAULT_MAX_TOKENS, DEFAULT_NOUL, EncodedRow, PromptEncoder
from .state_cache import PrefixState, RowFeatures, max_state_tokens, prefix_key, row_key, snapshot_row, stack_states

LORA_DROPOUT = 0.0
SHAPE_GRANULE = 16  # batched calls round their padded lengths up to this (right pads are never read)
PROMPT_VERSION = 1
_LORA_PREFIX = "base_model.model."


def _kept_cache(config: Any) -> Any:
    """A DynamicCache for one forward whose layers keep their first keys and values as the attention computed them
    (new tensors, only read afterwards) instead of concatenating them onto an empty tensor: the cache a full forward
    returns then costs no copy and no extra allocation (a cold request with the state cache on, issue 58). The
    layers stay transformers' `DynamicLayer`s (`state_cache.SUPPORTED_LAYERS`); the override is per instance and
    removed after the forward."""
    import types

    from transformers.cache_utils import DynamicCache, DynamicLayer

    def keep_first(layer: Any, keys: torch.Tensor, values: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if layer.is_initialized:
            return DynamicLayer.update(layer, keys, values, *args, **kwargs)
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        return keys, values

    cache = DynamicCache(config=config)
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            layer.update = types.MethodType(keep_first, layer)
    return cache


def _cut_row(h: torch.Tensor, pos: torch.Tensor, i: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row i's hidden states [end - start, H] (float32, CPU) and per-token positions [end - start, P] from a
    call's states [B, T, H] and its positions ([B, T], or [P, B, T] for M-RoPE)."""
    p = pos[i, start:end, None] if pos.dim() == 2 else pos[:, i, start:end].T
    return h[i, start:end].float().cpu().clone(), p.to(torch.int32).cpu().clone()


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
        self.last_usage: dict = {}
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

    def hidden_states(self, batch: Batch, layers: tuple[int, int] | None = None, *, with_cache: bool = False) -> Any:
        """Last hidden states [B, T, H] of a full forward (`layers=(0, c)`: the states at cut c, un-normed);
        `with_cache`: (states, the forward's cache)."""
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
        if not with_cache:
            return self.decoder_forward(ids, feats, attn, pos, layers=layers).last_hidden_state
        cache = _kept_cache(self.family.text_decoder(self.causal_lm()).config)
        try:
            o = self.decoder_forward(ids, feats, attn, pos, cache=cache, use_cache=True, layers=layers)
        finally:
            for layer in cache.layers:
                vars(layer).pop("update", None)
        return o.last_hidden_state, cache

    def features(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(h_decision [B,H], h_markers [B,Kmax,H]) from a full forward (or as given by a cached
        `rlcd.features.FeatureBatch`)."""
        if hasattr(batch, "h_dec"):
            return batch.h_dec, batch.h_cand
        if hasattr(batch, "suffixes"):  # a CutBatch: the layers above the cut on cached cut states
            from .cut_forward import cut_features

            return cut_features(self, batch)
        h = self.hidden_states(batch)
        dev = h.device
        rows = torch.arange(h.shape[0], device=dev)
        h_dec = h[rows, batch.decision_pos.to(dev)]
        h_cand = h[rows[:, None], batch.marker_pos.to(dev)]
        return h_dec, h_cand

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits [B, Kmax]. While `frozen_features` is set (head-only training, the head warm-up) the
        backbone runs without gradients: only the head learns, and the features equal the cached ones.
        A `CaseBatch` (Recipe.batch_by="case") shares each state's prefix (`case_train.case_forward`)."""
        if getattr(batch, "units", None) is not None and not hasattr(batch, "suffixes"):
            from .case_train import case_forward

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

    # ------------------------------------------------------------------ inference on one request
    @property
    def cases(self) -> CaseEncoder:
        """This model's `CaseEncoder`: questions -> `CaseInputs` (tokenised, image preprocessed; no model call)."""
        return CaseEncoder.for_model(self)

    def encode_case(self, state: Any, questions: Sequence[Question], *, n_image_tokens: int = 0,
                    ids: Sequence[str] | None = None, case_id: str | None = None,
                    max_tokens: int | None = None) -> list[EncodedRow]:
        return self.cases.rows(state, questions, n_image_tokens=n_image_tokens, ids=ids, case_id=case_id,
                               max_tokens=max_tokens)

    def prepare_case(self, state: Any, questions: Sequence[Question], image: Any = None,
                     ids: Sequence[str] | None = None, *, case_id: str | None = None,
                     max_tokens: int | None = None, keyed: bool = False) -> CaseInputs:
        return self.cases.prepare(state, questions, image, ids, case_id=case_id, max_tokens=max_tokens, keyed=keyed)

    def score_case_with_usage(self, state: Any, questions: Sequence[Question], image: Any = None,
                              ids: Sequence[str] | None = None, *, max_rows: int = 64,
                              case_id: str | None = None, exact: bool = False,
                              path: str = "auto") -> tuple[list[torch.Tensor], dict]:
        """`score_case` plus usage: {input_tokens (processed), prefix_tokens, rows, full_tokens, calls, ...}.

        `exact=True` (Qwen3.5; a no-op for text decoders) moves the cut down to a multiple of the DeltaNet chunk (64) and runs the suffixes
        with the default chunk, so the recurrent state is accumulated over the same chunks as in a full
        forward: differences drop to plain-batching noise, at the cost of up to 63 extra tokens per
        row. The default is fast; its logits differ from full forwards by ~6e-6 relative (measured on
        the random tiny preset, whose DeltaNet decays are extreme).
        """
        questions = list(questions)
        if not questions:
            return [], {"input_tokens": 0, "prefix_tokens": 0, "rows": 0, "full_tokens": 0, "image_tokens": 0,
                        "calls": 0, "path": "full"}
        case = self.prepare_case(state, questions, image, ids, case_id=case_id)
        logits, usage = self.score_cases([case], max_rows=max_rows, exact=exact, path=path)[0]
        self.last_usage = usage
        return logits, usage

    def score_cases(self, cases: Sequence[CaseInputs], *, max_rows: int = 64, exact: bool = False,
                    path: str = "auto", state_cache: Any = None,
                    row_cache: Any = None) -> list[tuple[list[torch.Tensor], dict]]:
        """Several requests in one go: `case_features` (prefixes in one left-padded forward, all question
        rows as suffix calls from that cache; or full forwards where the planner finds them cheaper),
        then the head on every row at once. Returns [(logits per question [k] float32 CPU, usage)].

        Each request's logits equal those it gets alone up to float noise: a prefix's left padding is
        masked (attention) and zeroed (the linear-attention inputs, so its recurrent and conv states stay
        at their initial zeros), positions are each request's own, and every suffix row reads its own
        request's cache row (`Family.select_cache_rows`). `state_cache` (a `ScopedStateCache`): prefixes
        stored by earlier calls are reused, new ones stored (`case_features_with_usage`); same logits up to
        float noise. `row_cache`: rows answered by earlier calls take their stored features and do not run
        (`case_features_with_usage`); their logits are the earlier ones' up to the head's float noise.
        """
        feats, usages = self.case_features_with_usage(cases, max_rows=max_rows, exact=exact, path=path,
                                                      state_cache=state_cache, row_cache=row_cache)
        flat = [f for fs in feats for f in fs]
        if not flat:
            return [([], u) for u in usages]
        with torch.inference_mode():
            dev = self.device
            kmax = max(hc.shape[0] for _, hc in flat)
            n, hidden = len(flat), flat[0][0].shape[-1]
            h_cand = flat[0][1].new_zeros((n, kmax, hidden))
            cmask = torch.zeros((n, kmax), dtype=torch.bool, device=dev)
            for i, (_, hc) in enumerate(flat):
                h_cand[i, : hc.shape[0]] = hc
                cmask[i, : hc.shape[0]] = True
            lg = self.head(torch.stack([hd for hd, _ in flat]), h_cand, cmask, update=False).float().cpu()
        out, i = [], 0
        for fs, u in zip(feats, usages):
            out.append(([lg[i + j, : hc.shape[0]] for j, (_, hc) in enumerate(fs)], u))
            i += len(fs)
        return out

    def case_features(self, cases: Sequence[CaseInputs], *, max_rows: int = 64, exact: bool = False,
                      path: str = "auto") -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per case, per row: (h_dec [H], h_cand [k, H]), the last hidden states at the decision and marker
        positions (backbone dtype, on the model's device, inference mode), computed as `score_cases` does
        (one batched prefix forward + suffix calls, or full forwards where cheaper); the head is not run."""
        return self.case_features_with_usage(cases, max_rows=max_rows, exact=exact, path=path)[0]

    def case_cut_states(self, cases: Sequence[CaseInputs], cut: int, *, max_rows: int = 64
                        ) -> list[tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]]:
        """Per case: (prefix, rows) of the hidden states entering decoder layer `cut` -- what the cut-state cache
        stores. `prefix`: (states [c, H], positions [c, P]) of the shared prefix, or None when the case runs as
        full rows; `rows`: per row (states [n, H], positions [n, P]) of its tokens after the prefix. Float32, CPU.
        Computed as `case_features` would (prefix once, suffixes on its cache; `exact` chunk grid), layers
        [0, cut) only, so the rest of the stack costs nothing."""
        plan = self.plan_paths(cases, exact=True)
        rows: list[list[Any]] = [[None] * len(c.rows) for c in cases]
        prefixes: list[Any] = [None] * len(cases)
        with torch.inference_mode():
            pre = [i for i, c in enumerate(plan) if c is not None and cases[i].rows]
            full = [i for i, c in enumerate(plan) if c is None and cases[i].rows]
            if pre:
                got: list[Any] = [None] * len(pre)
                self._prefix_features([cases[i] for i in pre], [plan[i] for i in pre], [rows[i] for i in pre],
                                      max_rows=max_rows, exact=True, at_layer=cut, prefixes=got)
                for i, g in zip(pre, got):
                    prefixes[i] = g
            if full:
                self._full_features([cases[i] for i in full], [rows[i] for i in full], max_rows=max_rows,
                                    at_layer=cut)
        return list(zip(prefixes, rows))

    def plan_paths(self, cases: Sequence[CaseInputs], *, exact: bool = False, path: str = "auto",
                   overhead: int = CALL_OVERHEAD, state_cut: bool = False) -> list[int | None]:
        return plan_paths(cases, align=self.family.exact_align if exact else None, path=path, overhead=overhead,
                          state_prefix=state_cut, max_state_tokens=self.max_state_tokens).prefix_len

    def case_features_with_usage(self, cases: Sequence[CaseInputs], *, max_rows: int = 64, exact: bool = False,
                                 path: str = "auto", state_cache: Any = None, row_cache: Any = None
                                 ) -> tuple[list[list[tuple[torch.Tensor, torch.Tensor]]], list[dict]]:
        """`case_features` plus per-case usage: {input_tokens (`plan.request_tokens`: the request's tokens, the part
        its rows share once, whatever path, cache or batch),
        prefix_tokens (0 on the full path), cached_tokens (the prefix tokens the state cache supplied, not
        run), cached_rows (rows the row cache supplied), rows, full_tokens, image_tokens, calls (of the whole
        batch), batched_requests, path}.

        `state_cache` (a `state_cache.ScopedStateCache`, or None): prefixes are cut at the end of the state,
        looked up there (a hit skips that prefix's forward and its image encoding) and stored after they run.
        `row_cache` (a `ScopedStateCache` of `state_cache.RowFeatures`, or None): rows answered before (the same
        tokens, image and read positions) take their stored features and do not run; a case none of whose rows
        runs runs nothing, not even its prefix. Usage and the plan stay what they are without it."""
        plan = self.plan_paths(cases, exact=exact, path=path, state_cut=state_cache is not None)
        feats: list[list[Any]] = [[None] * len(c.rows) for c in cases]
        row_keys = [[None] * len(c.rows) for c in cases]
        if row_cache is not None:
            for c, ks, fs in zip(cases, row_keys, feats):
                for j, r in enumerate(c.rows):
                    ks[j] = row_key(r.ids, c.digest(), r.decision_pos, r.marker_pos, exact)
                    got = row_cache.get(ks[j])
                    if got is not None:
                        fs[j] = (got.h_dec, got.h_cand)
        todo = [[j for j, f in enumerate(fs) if f is None] for fs in feats]
        # what runs: each case's rows not answered before (a case as it is when all of them run)
        run = [c if len(t) == len(c.rows) else CaseInputs([c.rows[j] for j in t], c.pixel_values, c.grid, c.n_img,
                                                          c.image_digest) for c, t in zip(cases, todo)]
        out = [fs if len(t) == len(fs) else [None] * len(t) for fs, t in zip(feats, todo)]
        keys: list[Any] = [None] * len(cases)
        warm: list[PrefixState | None] = [None] * len(cases)
        with torch.inference_mode():
            pre = [i for i, cut in enumerate(plan) if cut is not None and cases[i].rows]
            keep, store = None, {}
            if state_cache is not None and pre:
                for i in pre:
                    keys[i] = prefix_key(cases[i].rows[0].ids[:plan[i]], cases[i].digest())
                    warm[i] = state_cache.get(keys[i])
                # a cold case the cache-off plan runs as full rows: full rows still, its state kept from their cache
                if path == "auto" and self.kv_only_cache:
                    cold = [i for i in pre if warm[i] is None]
                    off = self.plan_paths([cases[i] for i in cold], exact=exact, path=path)
                    store = {i: plan[i] for i, cut in zip(cold, off) if cut is None}
                    for i in store:
                        plan[i] = None
                    pre = [i for i in pre if i not in store]

                def keep(j: int, state: PrefixState) -> None:
                    state_cache.put(keys[pre[j]], state)
            full = [i for i, cut in enumerate(plan) if cut is None and cases[i].rows and todo[i]]
            pre = [i for i in pre if todo[i]]  # `keep` reads it: the cases as passed below
            calls = 0
            if pre:
                calls += self._prefix_features([run[i] for i in pre], [plan[i] for i in pre],
                                               [out[i] for i in pre], max_rows=max_rows, exact=exact,
                                               warm=[warm[i] for i in pre], keep=keep)
            if full:
                calls += self._full_features(
                    [run[i] for i in full], [out[i] for i in full], max_rows=max_rows,
                    keep={j: (store[i], lambda state, i=i: state_cache.put(keys[i], state))
                          for j, i in enumerate(full) if i in store} or None)
            for i, t in enumerate(todo):
                for j, f in zip(t, out[i]):
                    feats[i][j] = f
                    if row_cache is not None:
                        h_dec, h_cand = f[0].clone(), f[1].clone()  # their own storage: a view keeps its batch
                        row_cache.put(row_keys[i][j], RowFeatures(h_dec, h_cand, h_dec.nbytes + h_cand.nbytes))
        usages = []
        for c, cut, w, t in zip(cases, plan, warm, todo):
            full_tokens = sum(len(r) for r in c.rows)
            p = cut or 0
            usages.append({"input_tokens": request_tokens(c.rows),
                           "prefix_tokens": p, "cached_tokens": p if w is not None else 0,
                           "cached_rows": len(c.rows) - len(t), "rows": len(c.rows),
                           "full_tokens": full_tokens, "image_tokens": c.n_img, "calls": calls,
                           "batched_requests": len(cases), "path": "prefix" if cut is not None else "full"})
        return feats, usages

    @property
    def kv_only_cache(self) -> bool:
        """Whether the decoder's cache holds keys and values alone (every layer full attention: the config's
        `layer_types`, or no `sliding_window` where it has none): then the first positions of a full forward's cache
        are exactly a prefix's state (a causal decoder's keys and values at a position depend on the tokens up to it
        only). Qwen3.5's linear-attention layers carry a recurrent state of the whole row instead."""
        got = getattr(self, "_kv_only", None)
        if got is None:
            cfg = getattr(self.family.text_decoder(self.causal_lm()), "config", None)
            types = getattr(cfg, "layer_types", None)
            got = cfg is not None and (all(t == "full_attention" for t in types) if types  # what transformers builds
                                       else not getattr(cfg, "sliding_window", None))
            self._kv_only = got
        return got

    @property
    def max_state_tokens(self) -> int | None:
        """The longest prefix whose state the state cache can keep: `sliding_window - 1` when the decoder has
        sliding-window layers (they keep only their last `sliding_window - 1` positions: `state_cache.
        max_state_tokens`), None when every layer keeps every position."""
        if not hasattr(self, "_max_state"):
            cfg = getattr(self.family.text_decoder(self.causal_lm()), "config", None)
            types = getattr(cfg, "layer_types", None)
            window = getattr(cfg, "sliding_window", None)
            sliding = any(t == "sliding_attention" for t in types) if types else bool(window)
            self._max_state = int(window) - 1 if sliding and window else None
        return self._max_state

    def _full_features(self, cases: Sequence[CaseInputs], out: list[list[Any]], *, max_rows: int,
                       at_layer: int | None = None, keep: dict[int, tuple[int, Any]] | None = None) -> int:
        """Full forwards of the cases' rows (right padded, grouped by length); fills `out`; returns the call count.
        `at_layer`: instead of the features, every row's states entering that layer and their positions (`_cut_row`).
        `keep` {case index: (cut, put)}: that case's forward keeps its cache and `put` receives the state of its
        first `cut` positions (`snapshot_row`: the forward's own keys and values, not copied, when its row runs
        alone) -- what the prefix path would have stored, at no second call."""
        flat = [(ci, ri) for ci, c in enumerate(cases) for ri in range(len(c.rows))]
        groups = plan_suffix_groups([len(cases[ci].rows[ri]) for ci, ri in flat], max_rows=max_rows,
                                    granule=self.family.exact_align or 1)
        for group in groups:
            members = [flat[j] for j in group]
            chunk = [cases[ci].rows[ri] for ci, ri in members]
            pvs = [cases[ci].pixel_values for ci, _ in members if cases[ci].pixel_values is not None]
            grids = [cases[ci].grid for ci, _ in members if cases[ci].pixel_values is not None]
            b = pad_rows(chunk, pad_id=self.encoder.pad_id, image_pad_id=self.encoder.image_pad_id,
                         pixel_values=torch.cat(pvs) if pvs else None,
                         image_grid_thw=torch.cat(grids) if grids else None)
            if at_layer is not None:
                h = self.hidden_states(b, layers=(0, at_layer))
                pos = self.family.full_positions(b.input_ids.to(self.device), b.mm_token_type_ids.to(self.device),
                                                 b.image_grid_thw, self.merge_size)
                for i, (r, (ci, ri)) in enumerate(zip(chunk, members)):
                    out[ci][ri] = _cut_row(h, pos, i, 0, len(r))
                continue
            stored = {ci: (i, keep.pop(ci)) for i, (ci, _) in enumerate(members) if keep and ci in keep}
            if stored:
                h, cache = self.hidden_states(b, with_cache=True)
                rows = torch.arange(h.shape[0], device=h.device)
                h_dec = h[rows, b.decision_pos.to(h.device)]
                h_cand = h[rows[:, None], b.marker_pos.to(h.device)]
                for i, (cut, put) in stored.values():  # once per case (its first row here): the others only read
                    state = snapshot_row(cache, i, 0, cut)
                    if state is not None:
                        put(state)
            else:
                h_dec, h_cand = self.features(b)
            for i, (r, (ci, ri)) in enumerate(zip(chunk, members)):
                out[ci][ri] = (h_dec[i], h_cand[i, : r.k])
        return len(groups)

    def _prefix_features(self, cases: Sequence[CaseInputs], cuts: Sequence[int], out: list[list[Any]], *,
                         max_rows: int, exact: bool, at_layer: int | None = None,
                         prefixes: list[Any] | None = None, warm: Sequence[PrefixState | None] | None = None,
                         keep: Any = None) -> int:
        """One left-padded prefix forward for `cases` (cut at `cuts`), then the suffix calls; fills `out`
        with each row's (h_dec, h_cand); returns the call count. `at_layer` (a decoder layer): instead, the states
        entering that layer -- each case's prefix into `prefixes`, each row's suffix into `out` (`_cut_row`).

        The state cache: `warm[i]`, a stored `PrefixState` of case i's prefix, replaces its part of the prefix
        forward (which then runs for the other cases only, or not at all); `keep(i, state)` receives the
        state of every prefix computed here (`snapshot_row`: a lone prefix's keys and values as they are). With a
        warm case the suffix calls read a cache stacked from every case's state (`state_cache.stack_states`: copies, except a lone unpadded state's keys and values,
        which the forward only reads), padded and masked as the forward's own. A cold prefix longer than a stored
        state can be (`state_cache.max_state_tokens`: a sliding window) leaves no state to stack: with warm cases
        beside it, it runs as a batch of its own (its forward and suffix calls), the others as one."""
        layers = (0, at_layer) if at_layer is not None else None
        dev, family = self.device, self.family
        warm = list(warm) if warm is not None else [None] * len(cases)
        cold = [i for i, w in enumerate(warm) if w is None]
        if prefixes is not None and len(cold) < len(cases):
            raise ValueError("cut states are computed, never read from the state cache")
        limit = next((max_state_tokens(w) for w in warm if w is not None), None)
        long = [i for i in cold if limit is not None and cuts[i] > limit]
        if long:  # past a sliding window a cold prefix keeps no state to stack with stored ones: it runs apart
            parts = (long, [i for i in range(len(cases)) if i not in long])
            return sum(self._prefix_features(
                [cases[i] for i in p], [cuts[i] for i in p], [out[i] for i in p], max_rows=max_rows, exact=exact,
                at_layer=at_layer, warm=[warm[i] for i in p],
                keep=None if keep is None else (lambda j, st, p=p: keep(p[j], st))) for p in parts)
        positions = [prefix_positions(self, c.rows[0].ids[:n], c.grid) for c, n in zip(cases, cuts)]
        next_pos = [int(pos.max()) + 1 for pos in positions]
        calls, prefix_cache, width, pmask = 0, None, 0, None
        if cold:
            width = max(cuts[i] for i in cold)
            padded = any(cuts[i] != width for i in cold)
            if padded:  # few distinct shapes keep the allocator's and kernels' caches small under serving load
                width = -(-width // SHAPE_GRANULE) * SHAPE_GRANULE
            feats = [self.image_features(cases[i].pixel_values, cases[i].grid) for i in cold
                     if cases[i].pixel_values is not None]  # once per request
            pids, pmask, all_pos = left_pad(self, [cases[i].rows[0].ids[:cuts[i]] for i in cold],
                                            [positions[i] for i in cold], width)
            o, prefix_cache = run_prefixes(self, pmask if padded else None, all_pos, ids=pids,
                                           image_features=torch.cat(feats) if feats else None, layers=layers)
            calls += 1
            if prefixes is not None:
                for j, i in enumerate(cold):
                    prefixes[i] = _cut_row(o.last_hidden_state, all_pos, j, width - cuts[i], width)
        if keep is not None or len(cold) < len(cases):
            states = list(warm)
            for j, i in enumerate(cold):
                states[i] = snapshot_row(prefix_cache, j, width - cuts[i])
                if keep is not None and states[i] is not None:
                    keep(i, states[i])
            if len(cold) < len(cases):
                if any(s is None for s in states):
                    raise RuntimeError("a cold prefix's cache cannot be batched with cached states")
                width = max(cuts)
                if any(cut != width for cut in cuts):
                    width = -(-width // SHAPE_GRANULE) * SHAPE_GRANULE
                prefix_cache = stack_states(states, width)
                pmask = torch.zeros((len(cases), width), dtype=torch.long, device=dev)
                for i, cut in enumerate(cuts):
                    pmask[i, width - cut:] = 1
        # a causal decoder's reads end at a row's last marker: what follows it (its newline) is never run,
        # except when the states themselves are the output (`at_layer`: cut states keep whole rows)
        def run_len(r: EncodedRow) -> int:
            return len(r) if at_layer is not None else r.marker_pos[-1] + 1

        flat = [(ci, ri) for ci, c in enumerate(cases) for ri in range(len(c.rows))]
        groups = plan_suffix_groups([run_len(cases[ci].rows[ri]) - cuts[ci] for ci, ri in flat], max_rows=max_rows,
                                    granule=family.suffix_chunk or 1)
        for gi, group in enumerate(groups):
            members = [flat[j] for j in group]
            chunk = [cases[ci].rows[ri] for ci, ri in members]
            owner = torch.tensor([ci for ci, _ in members], dtype=torch.long, device=dev)
            n = len(chunk)
            # the linear-attention states are advanced in place: every call but the last gets its own rows
            if gi == len(groups) - 1:
                # rows already in order (one question per case, e.g. a warm question): nothing to select
                rows = "as_is" if [ci for ci, _ in members] == list(range(len(cases))) else "select"
            else:
                rows = "fork"
            suf = [r.ids[cuts[ci]: run_len(r)] for r, (ci, _) in zip(chunk, members)]
            s_max = max(len(x) for x in suf)
            if len(cases) > 1:
                s_max = -(-s_max // SHAPE_GRANULE) * SHAPE_GRANULE
            sids = torch.full((n, s_max), self.encoder.pad_id, dtype=torch.long, device=dev)
            smask = torch.zeros((n, s_max), dtype=torch.long, device=dev)
            for i, x in enumerate(suf):
                sids[i, : len(x)] = torch.tensor(x, dtype=torch.long, device=dev)
                smask[i, : len(x)] = 1
            pos = torch.cat([family.suffix_positions(1, s_max, next_pos[ci], dev) for ci, _ in members], dim=-2)
            h = suffix_forward(self, prefix_cache, pmask, owner, smask, pos, ids=sids, rows=rows, layers=layers,
                               chunk_size=None if exact else family.suffix_chunk)
            if at_layer is not None:
                for i, (r, (ci, ri)) in enumerate(zip(chunk, members)):
                    out[ci][ri] = _cut_row(h, pos, i, 0, len(r) - cuts[ci])
                continue
            for i, (r, (ci, ri)) in enumerate(zip(chunk, members)):
                cut = cuts[ci]
                out[ci][ri] = (h[i, r.decision_pos - cut].clone(),  # a copy: a view would keep all of h alive
                               h[i, torch.tensor([m - cut for m in r.marker_pos], dtype=torch.long, device=dev)])
        return calls + len(groups)

    def _cut(self, rows: Sequence[EncodedRow], n_img: int, exact: bool, state: bool = False) -> int:
        return shared_prefix_len(rows, n_img, align=self.family.exact_align if exact else None, state=state)

    def score_case(self, state: Any, questions: Sequence[Question], image: Any = None,
                   ids: Sequence[str] | None = None) -> list[torch.Tensor]:
        """Logits over each question's K candidates for one request (shared prefix, parallel suffixes)."""
        return self.score_case_with_usage(state, questions, image, ids)[0]

    def score_full(self, state: Any, questions: Sequence[Question], image: Any = None,
                   ids: Sequence[str] | None = None, *, batch_size: int = 1) -> list[torch.Tensor]:
        """Reference path: the same rows scored with full forwards (`batch_size` rows per forward)."""
        questions = list(questions)
        out: list[torch.Tensor] = []
        with torch.inference_mode():
            pv, grid, n_img = self.cases.image(image)
            rows = self.encode_case(state, questions, n_image_tokens=n_img, ids=ids)
            for c0 in range(0, len(rows), batch_size):
                chunk = rows[c0: c0 + batch_size]
                n = len(chunk)
                b = pad_rows(chunk, pad_id=self.encoder.pad_id, image_pad_id=self.encoder.image_pad_id,
                             types=[q.type for q in questions[c0: c0 + n]],
                             pixel_values=None if pv is None else torch.cat([pv] * n),
                             image_grid_thw=None if grid is None else grid.repeat(n, 1))
                h_dec, h_cand = self.features(b)
                lg = self.head(h_dec, h_cand, b.cand_mask.to(h_dec.device), update=False)
                out.extend(lg[i, : r.k].float().cpu() for i, r in enumerate(chunk))
        return out

    def n_tokens(self, state: Any, questions: Sequence[Question], image_tokens: int = 0) -> dict:
        """Token counts of a request without running the model: {input_tokens, full_tokens, prefix_tokens, rows,
        path} (`path`: the one `score_case` takes; prefix_tokens is 0 on the full path)."""
        rows = self.encode_case(state, list(questions), n_image_tokens=image_tokens)
        cut = self.plan_paths([CaseInputs(rows, n_img=image_tokens)])[0]
        full = sum(len(r) for r in rows)
        p = cut or 0
        return {"input_tokens": request_tokens(rows), "prefix_tokens": p,
                "full_tokens": full, "rows": len(rows), "path": "prefix" if cut is not None else "full"}

    # ------------------------------------------------------------------ records -> cases
    def case_inputs_from_records(self, records: Sequence[Any], image_root: Any = None) -> CaseInputs:
        return self.cases.from_records(records, image_root)


def num_params(module: nn.Module, trainable: bool | None = None) -> int:
    return sum(p.numel() for p in module.parameters() if trainable is None or p.requires_grad == trainable)


__all__ = ["DecisionModel", "CaseInputs", "mrope_positions", "common_prefix_len", "plan_suffix_groups", "num_params"]
