"""DecisionModel: Qwen3.5 backbone (frozen, LoRA on the language linears) + shared candidate scorer.

`forward(batch) -> logits [B, Kmax]` (float32, -inf on padded candidates) runs the inner model only
(last hidden states; vocabulary logits are never computed). The model is driven "by hand": token
embeddings, image features scattered into the `<|image_pad|>` slots, and explicit M-RoPE position
ids go straight to the language model, so no state is carried between calls (`rope_deltas` is
never consulted) and the vision tower runs exactly once per image occurrence, without gradients.

`score_case(state, questions, image)` is the inference path for one request: the common token
prefix of its rows is run once (capped at the smallest decision position, so every row's decision
token is computed in its own suffix), the hybrid cache is deep-copied and expanded to the rows with
`reorder_cache(torch.zeros(k))`, and the suffixes run batched: one call when their lengths are
similar, otherwise a few calls of similar-length rows (`plan_suffix_groups`: fewest padded tokens
plus a per-call overhead; at most `max_rows` rows per call), each from its own copy of the cache.
"""

from __future__ import annotations

import copy
import inspect
import math
import warnings
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from ..schema import Question
from .backbone import LORA_TARGET_REGEX, Backbone, freeze_all
from .collate import Batch, n_image_tokens, pad_rows, process_images
from .head import CandidateScorer
from .prompt import DEFAULT_MAX_TOKENS, DEFAULT_NOUL, EncodedRow, PromptEncoder

LORA_DROPOUT = 0.0
# DeltaNet chunk length for the short suffix calls of score_case (transformers' reference kernel
# defaults to 64 and pads every row to a multiple of it; 32 is 10-18% faster for 30-80 token
# suffixes on CPU). Passed through the model's **kwargs; ignored by kernels that do not take it.
SUFFIX_CHUNK = 32
EXACT_ALIGN = 64  # transformers' default DeltaNet chunk (score_case(exact=True) cuts on its grid)
PROMPT_VERSION = 1
_LORA_PREFIX = "base_model.model."


def _cache_kwarg(language_model: nn.Module) -> str:
    """transformers >= 5.24 calls the cache argument `cache`; 5.17-5.23 `past_key_values`."""
    try:
        params = inspect.signature(language_model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _out_cache(out: Any) -> Any:
    c = getattr(out, "cache", None)
    return c if c is not None else getattr(out, "past_key_values", None)


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


def plan_suffix_groups(lengths: Sequence[int], *, max_rows: int = 64, overhead: int = 48,
                       granule: int = SUFFIX_CHUNK) -> list[list[int]]:
    """Split rows into batched calls by suffix length, minimising padded work + a per-call overhead.

    Rows are sorted by length; a dynamic programme picks contiguous groups (at most `max_rows` rows)
    minimising sum(rows_in_group * padded_longest_in_group + overhead), where lengths are rounded up
    to the DeltaNet chunk (`granule`; the CPU reference kernel pads every row to it) and `overhead`
    is the measured fixed cost of one call in token equivalents (~6 ms = ~50 tokens on 2 CPU cores,
    hidden 256). Similar lengths give one call; mixed lengths (e.g. 27..82 tokens) a few.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    ls = [-(-lengths[i] // granule) * granule for i in order]
    n = len(ls)
    best = [0.0] + [math.inf] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(max(0, j - max_rows), j):
            c = best[i] + (j - i) * ls[j - 1] + overhead
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    first = seqs[0]
    n = min(len(s) for s in seqs)
    for i in range(n):
        x = first[i]
        if any(s[i] != x for s in seqs):
            return i
    return n


class DecisionModel(nn.Module):
    """Backbone + LoRA + CandidateScorer. Takes ownership of `backbone.model` (peft wraps it in place)."""

    def __init__(self, backbone: Backbone, *, lora: bool = True, lora_rank: int = 8, lora_alpha: float = 16,
                 proj_dim: int = 256, centring: str = "running_mean", seed: int = 0,
                 max_tokens: int = DEFAULT_MAX_TOKENS):
        super().__init__()
        self.backbone_info = dict(backbone.info)
        self.tokenizer = backbone.tokenizer
        self.image_processor = backbone.image_processor
        self.encoder = PromptEncoder(backbone.tokenizer, max_tokens=max_tokens)
        model = backbone.model
        freeze_all(model)
        self.lora_config: dict | None = None
        if lora:
            from peft import LoraConfig, get_peft_model

            cfg = LoraConfig(r=int(lora_rank), lora_alpha=lora_alpha, lora_dropout=LORA_DROPOUT, bias="none",
                             target_modules=LORA_TARGET_REGEX)
            with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
                torch.manual_seed(seed)
                model = get_peft_model(model, cfg)
            self.lora_config = {"r": int(lora_rank), "alpha": lora_alpha, "dropout": LORA_DROPOUT,
                                "target_modules": LORA_TARGET_REGEX}
        self.backbone = model
        hidden = int(self._core().config.text_config.hidden_size)
        dev = next(self.backbone.parameters()).device
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            self.head = CandidateScorer(hidden, proj_dim=proj_dim, centring=centring)
        self.head.to(dev)
        self.merged = False
        self.seed = int(seed)
        self.last_usage: dict = {}
        core = self._core()
        self._cache_kw = _cache_kwarg(core.language_model)
        self._chunk_kw_ok = True
        self.image_token_id = int(core.config.image_token_id)
        self.merge_size = int(core.config.vision_config.spatial_merge_size)
        self.train(False)

    # ------------------------------------------------------------------ construction helpers
    def _causal_lm(self) -> nn.Module:
        m = self.backbone
        return m.get_base_model() if hasattr(m, "get_base_model") else m

    def _core(self) -> nn.Module:
        """The inner Qwen3_5Model (vision tower + language model, no lm_head)."""
        return self._causal_lm().model

    @property
    def vision(self) -> nn.Module:
        return self._core().visual

    @property
    def device(self) -> torch.device:
        return self.head.w_d.weight.device

    @property
    def takes_images(self) -> bool:
        """Whether the backbone has a vision tower (a request image is refused otherwise)."""
        return getattr(self._core(), "visual", None) is not None

    @property
    def placement(self) -> dict[str, str]:
        """Where the model runs: {"device": "cuda:0", "dtype": "bfloat16"} (the backbone's; the scorer is FP32)."""
        dtype = next(self.backbone.parameters()).dtype
        return {"device": str(self.device), "dtype": str(dtype).replace("torch.", "")}

    def train(self, mode: bool = True) -> "DecisionModel":
        super().train(mode)
        self.vision.eval()  # the vision tower stays frozen and in eval mode
        return self

    @property
    def info(self) -> dict:
        out = dict(self.backbone_info)
        out["head"] = self.head.config
        out["centring"] = self.head.centring
        out["lora"] = (dict(self.lora_config, merged=self.merged) if self.lora_config is not None else None)
        out["prompt"] = {"version": PROMPT_VERSION, "max_tokens": self.encoder.max_tokens,
                         "noul_defaults": dict(DEFAULT_NOUL), "marker": self.backbone_info.get("marker_token")}
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

    def merge(self) -> "DecisionModel":
        """Fold LoRA into the base weights (peft merge_and_unload); idempotent."""
        if self.lora_config is not None and not self.merged:
            self.backbone = self.backbone.merge_and_unload()
            freeze_all(self.backbone)
            self.merged = True
            self.train(self.training)
        return self

    # ------------------------------------------------------------------ backbone plumbing
    def image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Vision tower (frozen, no grad) -> merged features [n_image_tokens, hidden]."""
        core = self._core()
        dev = self.device
        with torch.no_grad():
            out = core.get_image_features(pixel_values.to(dev), image_grid_thw.to(dev))
        po = getattr(out, "pooler_output", out)
        if isinstance(po, (list, tuple)):
            po = torch.cat(list(po), 0)
        return po

    def _embed(self, input_ids: torch.Tensor, image_feats: torch.Tensor | None) -> torch.Tensor:
        core = self._core()
        emb = core.get_input_embeddings()(input_ids)
        if image_feats is not None:
            mask = input_ids == self.image_token_id
            n = int(mask.sum())
            if n != image_feats.shape[0]:
                raise ValueError(f"{n} <|image_pad|> tokens but {image_feats.shape[0]} image features")
            emb = emb.masked_scatter(mask.unsqueeze(-1), image_feats.to(emb.dtype))
        return emb

    def _lm(self, emb: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
            cache: Any = None, use_cache: bool = False, chunk_size: int | None = None) -> Any:
        core = self._core()
        core.rope_deltas = None  # never let a previous image prompt shift positions
        kw: dict[str, Any] = {self._cache_kw: cache} if cache is not None else {}
        if chunk_size is not None and self._chunk_kw_ok and emb.device.type == "cpu":
            try:
                return core.language_model(inputs_embeds=emb, attention_mask=attention_mask,
                                           position_ids=position_ids, use_cache=use_cache, chunk_size=chunk_size, **kw)
            except TypeError:  # this transformers version does not pass it through: use the default
                self._chunk_kw_ok = False
        return core.language_model(inputs_embeds=emb, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=use_cache, **kw)

    def hidden_states(self, batch: Batch) -> torch.Tensor:
        """Last hidden states [B, T, H] of a full forward."""
        dev = self.device
        ids = batch.input_ids.to(dev)
        attn = batch.attention_mask.to(dev)
        feats = None
        if batch.pixel_values is not None:
            feats = self.image_features(batch.pixel_values, batch.image_grid_thw)
        emb = self._embed(ids, feats)
        image_mask = batch.mm_token_type_ids.to(dev) if batch.mm_token_type_ids is not None else ids == self.image_token_id
        pos = mrope_positions(ids, image_mask, batch.image_grid_thw, self.merge_size)
        return self._lm(emb, attn, pos).last_hidden_state

    def features(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(h_decision [B,H], h_markers [B,Kmax,H]) from a full forward."""
        h = self.hidden_states(batch)
        dev = h.device
        rows = torch.arange(h.shape[0], device=dev)
        h_dec = h[rows, batch.decision_pos.to(dev)]
        h_cand = h[rows[:, None], batch.marker_pos.to(dev)]
        return h_dec, h_cand

    def forward(self, batch: Batch) -> torch.Tensor:
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
    def encode_case(self, state: Any, questions: Sequence[Question], *, n_image_tokens: int = 0,
                    ids: Sequence[str] | None = None, case_id: str | None = None) -> list[EncodedRow]:
        qids = list(ids) if ids is not None else [f"q{i}" for i in range(len(questions))]
        if len(qids) != len(questions):
            raise ValueError(f"{len(qids)} ids for {len(questions)} questions")
        prefix = self.encoder.prefix_ids(state, n_image_tokens=n_image_tokens,
                                         row=case_id if case_id is not None else (qids[0] if len(qids) == 1 else "request"))
        return [self.encoder.encode(state, q, n_image_tokens=n_image_tokens, row=qid, prefix=prefix)
                for q, qid in zip(questions, qids)]

    def _image_inputs(self, image: Any) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        if image is None:
            return None, None, 0
        pv, grid = process_images(self.image_processor, [image])
        return pv, grid, n_image_tokens(grid[0].tolist(), self.merge_size)

    def score_case_with_usage(self, state: Any, questions: Sequence[Question], image: Any = None,
                              ids: Sequence[str] | None = None, *, max_rows: int = 64,
                              case_id: str | None = None, exact: bool = False) -> tuple[list[torch.Tensor], dict]:
        """`score_case` plus usage: {input_tokens (processed), prefix_tokens, rows, full_tokens, calls, ...}.

        `exact=True` moves the cut down to a multiple of the DeltaNet chunk (64) and runs the suffixes
        with the default chunk, so the recurrent state is accumulated over the same chunks as in a full
        forward: differences drop to plain-batching noise, at the cost of up to 63 extra tokens per
        row. The default is fast; its logits differ from full forwards by ~6e-6 relative (measured on
        the random tiny preset, whose DeltaNet decays are extreme).
        """
        questions = list(questions)
        if not questions:
            return [], {"input_tokens": 0, "prefix_tokens": 0, "rows": 0, "full_tokens": 0, "image_tokens": 0,
                        "calls": 0}
        dev = self.device
        with torch.inference_mode():
            pv, grid, n_img = self._image_inputs(image)
            rows = self.encode_case(state, questions, n_image_tokens=n_img, ids=ids, case_id=case_id)
            cut = self._cut(rows, n_img, exact)
            if n_img and cut < n_img + 2:  # the image is encoded once, so it must lie inside the prefix
                raise RuntimeError("shared prefix does not cover the image")
            # positions of a full row: the suffix is plain text, so only the offset after the prefix matters
            prefix_ids = torch.tensor([rows[0].ids[:cut]], dtype=torch.long, device=dev)
            img_mask = prefix_ids == self.image_token_id
            pos_p = mrope_positions(prefix_ids, img_mask, grid, self.merge_size)
            next_pos = int(pos_p.max()) + 1
            feats = self.image_features(pv, grid) if pv is not None else None  # once per request
            out = self._lm(self._embed(prefix_ids, feats), None, pos_p, use_cache=True)
            prefix_cache = _out_cache(out)
            if prefix_cache is None:
                raise RuntimeError("the language model returned no cache")
            logits: list[torch.Tensor | None] = [None] * len(rows)
            groups = plan_suffix_groups([len(r) - cut for r in rows], max_rows=max_rows)
            for gi, group in enumerate(groups):
                chunk = [rows[i] for i in group]
                n = len(chunk)
                # the linear-attention states are advanced in place: every call gets its own copy
                cache = prefix_cache if gi == len(groups) - 1 else copy.deepcopy(prefix_cache)
                cache.reorder_cache(torch.zeros(n, dtype=torch.long, device=dev))
                suf = [r.ids[cut:] for r in chunk]
                s_max = max(len(s) for s in suf)
                sids = torch.full((n, s_max), self.encoder.pad_id, dtype=torch.long, device=dev)
                attn = torch.zeros((n, cut + s_max), dtype=torch.long, device=dev)
                attn[:, :cut] = 1
                for i, s in enumerate(suf):
                    sids[i, : len(s)] = torch.tensor(s, dtype=torch.long, device=dev)
                    attn[i, cut: cut + len(s)] = 1
                pos = (torch.arange(s_max, device=dev) + next_pos).view(1, 1, -1).expand(3, n, s_max)
                h = self._lm(self._embed(sids, None), attn, pos, cache=cache, use_cache=True,
                             chunk_size=None if exact else SUFFIX_CHUNK).last_hidden_state
                kmax = max(r.k for r in chunk)
                mpos = torch.zeros((n, kmax), dtype=torch.long, device=dev)
                cmask = torch.zeros((n, kmax), dtype=torch.bool, device=dev)
                for i, r in enumerate(chunk):
                    mpos[i, : r.k] = torch.tensor([m - cut for m in r.marker_pos], device=dev)
                    cmask[i, : r.k] = True
                ridx = torch.arange(n, device=dev)
                dpos = torch.tensor([r.decision_pos - cut for r in chunk], dtype=torch.long, device=dev)
                lg = self.head(h[ridx, dpos], h[ridx[:, None], mpos], cmask, update=False)
                for i, (ri, r) in enumerate(zip(group, chunk)):
                    logits[ri] = lg[i, : r.k].float().cpu()
        usage = {
            "input_tokens": cut + sum(len(r) - cut for r in rows),
            "prefix_tokens": cut,
            "rows": len(rows),
            "full_tokens": sum(len(r) for r in rows),
            "image_tokens": n_img,
            "calls": 1 + len(groups),
        }
        self.last_usage = usage
        return logits, usage  # type: ignore[return-value]

    @staticmethod
    def _cut(rows: Sequence[EncodedRow], n_img: int, exact: bool) -> int:
        """Shared-prefix length: the common token prefix, never past any row's decision position."""
        cut = min(common_prefix_len([r.ids for r in rows]), min(r.decision_pos for r in rows))
        if exact:
            aligned = (cut // EXACT_ALIGN) * EXACT_ALIGN
            if aligned >= (n_img + 2 if n_img else 1):
                cut = aligned
        return cut

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
            pv, grid, n_img = self._image_inputs(image)
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
        """Token counts of a request without running the model: {input_tokens, full_tokens, prefix_tokens}."""
        rows = self.encode_case(state, list(questions), n_image_tokens=image_tokens)
        cut = self._cut(rows, image_tokens, False)
        return {"input_tokens": cut + sum(len(r) - cut for r in rows), "prefix_tokens": cut,
                "full_tokens": sum(len(r) for r in rows), "rows": len(rows)}


def num_params(module: nn.Module, trainable: bool | None = None) -> int:
    return sum(p.numel() for p in module.parameters() if trainable is None or p.requires_grad == trainable)


__all__ = ["DecisionModel", "mrope_positions", "common_prefix_len", "plan_suffix_groups", "num_params"]
