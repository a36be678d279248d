"""What training logs besides the loss: output statistics and reward parts per question type, the
spread of the advantages, and proper scoring rules on the dev subset.

The accumulators sum on the device over the micro-batches of one update and are read once, in
``summary()``: no host transfer per micro-batch or per row. Under DDP ``summary(reduce=...)`` sums
the accumulators over ranks first, so every rank reports the pooled numbers of the whole update.

Keys written to metrics.jsonl (training rows at the diagnostics cadence, ``RewardDiagnostics``),
for each question type t present in the update and over its G x rows samples:

- ``reward/<t>/<c>/mean`` and ``reward/<t>/<c>/std`` (ddof 1) for the reward components c =
  ``log`` (floored log score), ``spherical`` and, for ordinal (score) rows, ``rps``;
- ``adv_std`` (std of the advantage A = r - mean_g r over all samples of the update, before
  normalisation) and ``adv_std/<t>``;
- ``adv_extreme_share`` (share of samples with |A_hat| > 3, A_hat the normalised advantage the
  update used) and ``adv_extreme_share/<t>``.

Evaluation rows (``dev_scores``): ``dev_nll``, ``dev_brier``, ``dev_ece`` over the dev subset and
``dev_nll/<t>``, ``dev_brier/<t>``, ``dev_ece/<t>`` per type, as ``rlcd.metrics`` defines them
(raw logits, T = 1).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping

import torch

from rlcd import metrics as M
from rlcd.schema import QUESTION_TYPES

COMPONENTS = ("log", "spherical", "rps")
EXTREME_ADVANTAGE = 3.0
DEV_METRICS = ("nll", "brier", "ece")

# RewardDiagnostics columns: per type, sums over samples
_COLS = ("n", "log", "log2", "spherical", "spherical2", "n_ord", "rps", "rps2", "adv", "adv2", "extreme")


def _std(s: float, s2: float, n: float) -> float:
    """Sample std (ddof 1) from a sum, a sum of squares and a count (0 for fewer than two values)."""
    if n < 2:
        return 0.0
    return math.sqrt(max(0.0, (s2 - s * s / n) / (n - 1)))


class TypeDiagnostics:
    """Per decision type: mean entropy, mean max probability, effective candidate count (exp H)."""

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None  # [types, 4]: entropy, max p, exp H, count

    def add(self, logits: torch.Tensor, batch) -> None:
        mask = batch.cand_mask
        z = logits.detach().float().masked_fill(~mask, float("-inf"))
        p = torch.softmax(z, dim=-1)
        ent = -(p * torch.log_softmax(z, dim=-1).masked_fill(~mask, 0.0)).sum(-1)
        per_row = torch.stack([ent, p.max(-1).values, torch.exp(ent), torch.ones_like(ent)], dim=-1)
        type_id = batch.type_id.to(per_row.device)
        sums = torch.zeros(len(QUESTION_TYPES), 4, device=per_row.device).index_add_(0, type_id, per_row)
        self.sums = sums if self.sums is None else self.sums + sums

    def summary(self, reduce: Callable[[torch.Tensor], Any] | None = None) -> dict[str, Any]:
        """``{"per_type": {t: {entropy, max_prob, effective_candidates, n}}}``; with ``reduce`` (an in-place
        sum over DDP ranks) the sums are pooled first, so the means cover every rank's rows."""
        if reduce is not None and self.sums is not None:
            reduce(self.sums)
        out = {}
        for t, (h, m, e, n) in zip(QUESTION_TYPES, self.sums.tolist() if self.sums is not None else []):
            if n:
                out[t] = {"entropy": h / n, "max_prob": m / n, "effective_candidates": e / n, "n": int(n)}
        return {"per_type": out}


class RewardDiagnostics:
    """Reward parts per question type (mean, std), advantage std and share of extreme advantages.

    ``add`` takes ``rlcd.objectives.reward_samples`` output (``[G, B]`` tensors) for one micro-batch;
    the per-type sums stay on the device until ``summary``.
    """

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None  # [types, len(_COLS)]

    def add(self, parts: Mapping[str, torch.Tensor], type_id: torch.Tensor, ordinal: torch.Tensor) -> None:
        log, sph, rps, adv = parts["log"], parts["spherical"], parts["rps"], parts["advantage"]
        ordf = ordinal.to(device=log.device, dtype=log.dtype).expand_as(log)
        extreme = (parts["a_hat"].abs() > EXTREME_ADVANTAGE).to(log.dtype)
        cols = (torch.ones_like(log), log, log.square(), sph, sph.square(), ordf, rps * ordf,
                rps.square() * ordf, adv, adv.square(), extreme)
        per_row = torch.stack([c.sum(0) for c in cols], dim=-1)  # [B, cols]: summed over the G samples
        sums = torch.zeros(len(QUESTION_TYPES), len(_COLS), device=log.device, dtype=log.dtype)
        sums.index_add_(0, type_id.to(log.device), per_row)
        self.sums = sums if self.sums is None else self.sums + sums

    def summary(self, reduce: Callable[[torch.Tensor], Any] | None = None) -> dict[str, float]:
        if self.sums is None:
            return {}
        if reduce is not None:
            reduce(self.sums)  # in-place sum over ranks
        rows = [dict(zip(_COLS, v)) for v in self.sums.tolist()]  # the one read of this update
        out: dict[str, float] = {}
        for t, c in zip(QUESTION_TYPES, rows):
            if not c["n"]:
                continue
            for comp in COMPONENTS:
                n = c["n_ord"] if comp == "rps" else c["n"]
                if n:
                    out[f"reward/{t}/{comp}/mean"] = c[comp] / n
                    out[f"reward/{t}/{comp}/std"] = _std(c[comp], c[comp + "2"], n)
            out[f"adv_std/{t}"] = _std(c["adv"], c["adv2"], c["n"])
            out[f"adv_extreme_share/{t}"] = c["extreme"] / c["n"]
        total = {k: sum(c[k] for c in rows) for k in _COLS}
        if total["n"]:
            out["adv_std"] = _std(total["adv"], total["adv2"], total["n"])
            out["adv_extreme_share"] = total["extreme"] / total["n"]
        return out


def dev_scores(rows: Iterable[Mapping[str, Any]]) -> dict[str, float | None]:
    """``dev_<m>`` and ``dev_<m>/<type>`` for m in nll, brier, ece, from prediction-like rows.

    Rows carry ``id``, ``group``, ``type``, ``target`` and raw ``logits`` (as in
    ``eval/predictions-*.jsonl``); scored by ``rlcd.metrics.summarize`` at T = 1.
    """
    summary = M.summarize(list(rows))
    out: dict[str, float | None] = {}
    if not summary["n"]:
        return out
    for m in DEV_METRICS:
        out[f"dev_{m}"] = summary["overall"].get(m)
    for t, block in summary["per_type"].items():
        for m in DEV_METRICS:
            out[f"dev_{m}/{t}"] = block.get(m)
    return out
