"""The shared candidate scorer.

    logit_k = (W_c c_k) . (W_d d) / sqrt(P)

with `d` the hidden state at the decision position and `c_k` the hidden state at candidate k's
marker, both bias-free projections hidden -> P (256), always computed in FP32 whatever the backbone
dtype; the parameter count does not depend on K; padded candidates get -inf.

Centring (`centring=`):
* `"running_mean"` (default): the scorer's inputs are centred with *buffers* `mu_d`, `mu_c` (never
  with batch statistics, so a row's logits do not depend on the other rows of its batch).
  `init_centring(h_dec, h_cand)` sets them from given features (the trainer calls
  `DecisionModel.init_centring(batches)` once before training). Training forwards only *accumulate*
  detached feature sums; `apply_centring_update()` (called by the trainer once per optimizer update,
  after summing the accumulators over DDP ranks) moves the buffers by EMA (momentum 0.01) towards
  the update's mean. So every micro-batch of one update sees the same buffers, on every rank, and
  N ranks x A micro-batches equal 1 process x N*A micro-batches exactly. Buffers travel with
  `state_dict()` (resume-exact); the accumulators are plain attributes, not buffers.
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
        self.reset_pending()

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

    def reset_pending(self) -> None:
        self.pending = None  # [sum_d (H), sum_c (H), n_d, n_c] accumulated since the last update

    @torch.no_grad()
    def _accumulate(self, h_dec: torch.Tensor, h_cand: torch.Tensor, cand_mask: torch.Tensor) -> None:
        m = cand_mask.to(torch.float32).unsqueeze(-1)
        sum_d = h_dec.detach().float().sum(0)
        sum_c = (h_cand.detach().float() * m).sum((0, 1))
        counts = torch.stack([torch.tensor(float(h_dec.shape[0]), device=m.device), m.sum()])
        add = torch.cat([sum_d, sum_c, counts])
        self.pending = add if self.pending is None else self.pending + add

    @torch.no_grad()
    def apply_centring_update(self, reduce=None) -> None:
        """EMA-move the buffers towards the mean of the features accumulated since the last call.

        `reduce(tensor)` sums the accumulator across processes in place (DDP all_reduce).
        """
        if self.centring != "running_mean" or self.pending is None:
            self.reset_pending()
            return
        acc = self.pending.clone()
        if reduce is not None:
            reduce(acc)
        h = self.hidden
        md = acc[:h] / acc[2 * h].clamp_min(1.0)
        mc = acc[h:2 * h] / acc[2 * h + 1].clamp_min(1.0)
        ready = self.centring_ready > 0.5  # branch-free: no host sync on accelerators
        self.mu_d.copy_(torch.where(ready, torch.lerp(self.mu_d, md, self.momentum), md))
        self.mu_c.copy_(torch.where(ready, torch.lerp(self.mu_c, mc, self.momentum), mc))
        self.centring_ready.fill_(1.0)
        self.reset_pending()

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
            self._accumulate(h_dec, h_cand, cand_mask)
        return logits
