"""What training logs besides the loss: output statistics, the objective and reward parts per question type, the
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

The objective split by question type (``ObjectiveDiagnostics``), for each type t present in the update;
``n_t`` is the number of t rows over the update's micro-batches (all ranks):

- ``ce/<t>`` (every training row): mean soft CE over the n_t rows. Weighted by the row counts the
  per-type means give the mean over all the update's rows, which is the logged ``ce_loss`` (a mean of
  micro-batch means) when every micro-batch holds the same number of rows, as row batching does.

At the diagnostics cadence, like the reward parts:

- ``policy_loss/<t>`` (objective rlcd): the policy term over the G x n_t samples,
  ``-(1/(G n_t)) sum A_hat logp`` (as noisy as ``policy_loss``, whose pooled value it splits);
- ``reward/<t>/mean``, ``reward/<t>/std`` (rlcd, ddof 1): the total reward r the objective optimises,
  over the G x n_t samples (its parts are the ``reward/<t>/<c>`` keys above);
- ``grad_norm/<t>``: ``||dL / dz_t||``, the norm of the update's loss ``L = (1/A) sum_i L_i`` (A
  micro-batches over all ranks, ``L_i`` a micro-batch's ``L_pg + ce_weight CE``, CE for objective ce)
  with respect to the logits z of the t rows: ``sqrt(sum_i sum_{b in t} ||dL_i / dz_ib||^2) / A``. The
  signal each type sends into the network, measured at the logits; not a split of the parameter
  ``grad_norm``, where the types mix through the shared weights;
- ``grad_share/<t>``: ``grad_norm/<t>^2 / sum_u grad_norm/<u>^2`` (absent when the whole gradient is 0).

Why two cadences: the CE rows are one log-softmax over [B, K]; the rest evaluates the [G, B, K] objective
stage again and backpropagates it (no network), more work than the ``rlcd_loss`` call itself, whose share of
a GPU update benchmarks/BENCHMARKS.md already puts near the 1% target, so it runs where the reward
diagnostics do.

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


class _TypeSums:
    """Per question type sums of the columns `COLS`, kept on the device over an update's micro-batches and read
    once, as one dict per type, by `summary` (after `reduce`, an in-place sum over DDP ranks)."""

    COLS: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None  # [types, len(COLS)]

    def _add(self, per_row: torch.Tensor, type_id: torch.Tensor, once: tuple[str, ...] = ()) -> None:
        """Add `per_row` ([B, len(COLS)]) into its rows' types; the columns `once` count 1 in every type's row
        (a per-micro-batch count)."""
        sums = torch.zeros(len(QUESTION_TYPES), len(self.COLS), device=per_row.device, dtype=per_row.dtype)
        sums.index_add_(0, type_id.to(per_row.device), per_row)
        for c in once:
            sums[:, self.COLS.index(c)] = 1.0
        self.sums = sums if self.sums is None else self.sums + sums

    def _rows(self, reduce: Callable[[torch.Tensor], Any] | None) -> list[dict[str, float]] | None:
        if self.sums is None:
            return None
        if reduce is not None:
            reduce(self.sums)  # in-place sum over ranks
        return [dict(zip(self.COLS, v)) for v in self.sums.tolist()]  # the one read of this update


class RewardDiagnostics(_TypeSums):
    """Reward parts per question type (mean, std), advantage std and share of extreme advantages.

    ``add`` takes ``rlcd.objectives.reward_samples`` output (``[G, B]`` tensors) for one micro-batch;
    the per-type sums stay on the device until ``summary``.
    """

    COLS = _COLS

    def add(self, parts: Mapping[str, torch.Tensor], type_id: torch.Tensor, ordinal: torch.Tensor) -> None:
        log, sph, rps, adv = parts["log"], parts["spherical"], parts["rps"], parts["advantage"]
        ordf = ordinal.to(device=log.device, dtype=log.dtype).expand_as(log)
        extreme = (parts["a_hat"].abs() > EXTREME_ADVANTAGE).to(log.dtype)
        cols = (torch.ones_like(log), log, log.square(), sph, sph.square(), ordf, rps * ordf,
                rps.square() * ordf, adv, adv.square(), extreme)
        self._add(torch.stack([c.sum(0) for c in cols], dim=-1), type_id)  # [B, cols]: summed over the G samples

    def summary(self, reduce: Callable[[torch.Tensor], Any] | None = None) -> dict[str, float]:
        rows = self._rows(reduce)
        if rows is None:
            return {}
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


# ObjectiveDiagnostics columns, per type: rows and their CE; rows with a policy term; samples and their reward
# (sum, sum of squares); rows with a gradient, its squared norm, and the micro-batches that gave one (the same
# in every type's row: the update's loss is the mean of its micro-batches' losses)
_OBJ_COLS = ("n", "ce", "n_policy", "policy", "n_samples", "reward", "reward2", "n_grad", "grad2", "micro")


class ObjectiveDiagnostics(_TypeSums):
    """The objective per question type: mean CE, policy term, total reward, and the logit-gradient norm and share.

    ``add`` takes ``rlcd.objectives.row_terms`` output for one micro-batch, whichever parts it holds (``ce``
    always; ``policy`` and ``reward`` for objective rlcd and ``grad`` when ``full``); a key is reported when
    its part was added. The per-type sums stay on the device until ``summary``, which reads them once (after
    ``reduce``, an in-place sum over DDP ranks, so every count and sum covers all ranks).
    """

    COLS = _OBJ_COLS

    def add(self, terms: Mapping[str, torch.Tensor], type_id: torch.Tensor) -> None:
        ce = terms["ce"].detach()
        dt = torch.float32 if ce.device.type == "mps" else torch.float64  # MPS has no float64
        ce = ce.to(dt)
        one, zero = torch.ones_like(ce), torch.zeros_like(ce)
        cols = dict.fromkeys(_OBJ_COLS, zero)
        cols.update(n=one, ce=ce)
        if "policy" in terms:
            reward = terms["reward"].detach().to(dt)
            cols.update(n_policy=one, policy=terms["policy"].detach().to(dt), n_samples=one * reward.shape[0],
                        reward=reward.sum(0), reward2=reward.square().sum(0))
        if "grad" in terms:
            cols.update(n_grad=one, grad2=terms["grad"].detach().to(dt).square().sum(-1))
        self._add(torch.stack([cols[c] for c in _OBJ_COLS], dim=-1), type_id,
                  once=("micro",) if "grad" in terms else ())

    def summary(self, reduce: Callable[[torch.Tensor], Any] | None = None) -> dict[str, float]:
        rows = self._rows(reduce)
        if rows is None:
            return {}
        total_grad2 = sum(c["grad2"] for c in rows if c["n_grad"])
        out: dict[str, float] = {}
        for t, c in zip(QUESTION_TYPES, rows):
            if c["n"]:
                out[f"ce/{t}"] = c["ce"] / c["n"]
            if c["n_policy"]:
                out[f"policy_loss/{t}"] = c["policy"] / c["n_policy"]
                out[f"reward/{t}/mean"] = c["reward"] / c["n_samples"]
                out[f"reward/{t}/std"] = _std(c["reward"], c["reward2"], c["n_samples"])
            if c["n_grad"]:
                out[f"grad_norm/{t}"] = math.sqrt(c["grad2"]) / c["micro"]
                if total_grad2 > 0:
                    out[f"grad_share/{t}"] = c["grad2"] / total_grad2
        return out


def dev_scores(rows: Iterable[Mapping[str, Any]]) -> dict[str, float | None]:
    """``dev_<m>`` and ``dev_<m>/<type>`` for m in nll, brier, ece, and ``dev_accuracy/<type>`` (top-1, pooled over
    the type's rows; the pooled ``dev_accuracy`` key is the per-group dict selection reads), from prediction-like rows.

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
        out[f"dev_accuracy/{t}"] = block.get("accuracy")
    return out
