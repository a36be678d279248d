"""The shared candidate scorer.

    logit_k = (W_c c_k) . (W_d d) / sqrt(P)

with `d` the hidden state at the decision position and `c_k` the hidden state at candidate k's
marker, both bias-free projections hidden -> P (256), always computed in FP32 whatever the backbone
dtype; the parameter count does not depend on K; padded candidates get -inf.

Centring (`centring=`):
* `"running_mean"` (default): the scorer's inputs are centred with *buffers* `mu_d`, `mu_c` (never
  with batch statistics, so a row's logits do not depend on the other rows of its batch).
  `init_centring(h_dec, h_cand)` sets them from given features (the trainer calls
  `DecisionModel.init_centring(batches)` once before training); in training mode every forward then
  updates them by EMA (momentum 0.01, detached batch means). If a training forward runs before
  `init_centring`, that forward sets the buffers to its batch means instead (its own logits are
  still computed with the previous buffers). Buffers travel with `state_dict()` (resume-exact) and
  DDP's buffer broadcast keeps ranks in sync.
* `"layernorm"`: LayerNorm without affine parameters on both inputs.
* `"none"`: raw features.

Why: the final hidden states of a random-weight backbone share one dominant direction (99% of the
decision feature), and without centring the bilinear head stalls (measured in QWEN35-NOTES.md).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

CENTRINGS = ("running_mean", "layernorm", "none")


class CandidateScorer(nn.Module):
    def __init__(self, hidden: int, proj_dim: int = 256, centring: str = "running_mean", momentum: float = 0.01):
        super().__init__()
        if centring not in CENTRINGS:
            raise ValueError(f"centring must be one of {CENTRINGS}, got {centring!r}")
        self.hidden, self.proj_dim, self.centring, self.momentum = int(hidden), int(proj_dim), centring, float(momentum)
        self.w_d = nn.Linear(hidden, proj_dim, bias=False, dtype=torch.float32)
        self.w_c = nn.Linear(hidden, proj_dim, bias=False, dtype=torch.float32)
        self.register_buffer("mu_d", torch.zeros(hidden, dtype=torch.float32))
        self.register_buffer("mu_c", torch.zeros(hidden, dtype=torch.float32))
        self.register_buffer("centring_ready", torch.zeros((), dtype=torch.float32))

    @property
    def config(self) -> dict:
        return {"proj_dim": self.proj_dim, "centring": self.centring, "momentum": self.momentum,
                "hidden": self.hidden}

    # ------------------------------------------------------------------ centring
    @staticmethod
    def _cand_mean(h_cand: torch.Tensor, cand_mask: torch.Tensor | None) -> torch.Tensor:
        h = h_cand.detach().float()
        if h.dim() == 2:
            return h.mean(0)
        if cand_mask is None:
            return h.reshape(-1, h.shape[-1]).mean(0)
        m = cand_mask.to(h.device, torch.float32).unsqueeze(-1)
        return (h * m).sum((0, 1)) / m.sum().clamp_min(1.0)

    @torch.no_grad()
    def init_centring(self, h_dec: torch.Tensor, h_cand: torch.Tensor, cand_mask: torch.Tensor | None = None) -> None:
        """Set the centring buffers from features: h_dec [N,H]; h_cand [M,H] or [N,K,H] (+ cand_mask)."""
        self.mu_d.copy_(h_dec.detach().float().reshape(-1, self.hidden).mean(0))
        self.mu_c.copy_(self._cand_mean(h_cand, cand_mask))
        self.centring_ready.fill_(1.0)

    @torch.no_grad()
    def _update(self, h_dec: torch.Tensor, h_cand: torch.Tensor, cand_mask: torch.Tensor) -> None:
        md = h_dec.detach().float().mean(0)
        mc = self._cand_mean(h_cand, cand_mask)
        ready = self.centring_ready > 0.5  # branch-free: no host sync on accelerators
        self.mu_d.copy_(torch.where(ready, torch.lerp(self.mu_d, md, self.momentum), md))
        self.mu_c.copy_(torch.where(ready, torch.lerp(self.mu_c, mc, self.momentum), mc))
        self.centring_ready.fill_(1.0)

    def _centre(self, h: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
        if self.centring == "running_mean":
            return h - mu
        if self.centring == "layernorm":
            return F.layer_norm(h, (h.shape[-1],))
        return h

    # ------------------------------------------------------------------ forward
    def forward(self, h_dec: torch.Tensor, h_cand: torch.Tensor, cand_mask: torch.Tensor | None = None,
                update: bool | None = None) -> torch.Tensor:
        """h_dec [B,H], h_cand [B,K,H], cand_mask [B,K] bool -> logits [B,K] float32 (-inf on padding)."""
        if cand_mask is None:
            cand_mask = torch.ones(h_cand.shape[:2], dtype=torch.bool, device=h_cand.device)
        cand_mask = cand_mask.to(h_cand.device, torch.bool)
        dev_type = h_dec.device.type
        with torch.autocast(device_type=dev_type, enabled=False):
            d = self._centre(h_dec.float(), self.mu_d)
            c = self._centre(h_cand.float(), self.mu_c)
            pd = F.linear(d, self.w_d.weight.float())  # [B,P]
            pc = F.linear(c, self.w_c.weight.float())  # [B,K,P]
            logits = torch.einsum("bkp,bp->bk", pc, pd) / math.sqrt(self.proj_dim)
            logits = logits.masked_fill(~cand_mask, float("-inf"))
        if self.centring == "running_mean" and self.training and update is not False:
            self._update(h_dec, h_cand, cand_mask)
        return logits
