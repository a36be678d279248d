"""Dev evaluation and checkpoint selection: the frozen dev subset, scored every `eval_every` updates.

Selection (`Recipe.select_by`, test never selects): the pinned recipe's unweighted group-macro top-1 accuracy,
compared as exact rationals, or the pooled dev NLL (lowest wins; a user gating on probabilities may want the
checkpoint whose probabilities are best, which accuracy can miss). `patience` evaluations without strict
improvement stop a run early. Rank 0 alone evaluates.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import torch

from rlcd.diagnostics import dev_scores
from rlcd.schema import Record

from .distributed import Dist, broadcast_flag


@torch.no_grad()
def dev_accuracy(model, dev: dict[str, list[Record]], collator, device, batch_size: int = 16, *,
                 shared: bool = True, features=None, keep: list | None = None, source=None) -> dict[str, Any]:
    """Top-1 accuracy per sampling group and the unweighted group macro (the selection score), plus the
    dev scoring rules of `rlcd.diagnostics.dev_scores` (NLL, Brier, ECE overall and per type) from the same
    forward. `source` (what training passes): the `rlcd.train.sources` source that scores the rows. Without
    one: `features`, a `FeatureCache` holding the dev rows, read instead of running the (frozen) backbone;
    else `shared` (default) runs every dev case's state once, its questions as suffixes on its cache
    (`rlcd.model.case_scoring.score_records`, logits equal to full rows up to float32 noise); False: full
    rows, `batch_size` per forward. `keep`: a list that receives the scored rows (id, group, type, target, logits)."""
    from rlcd.model.case_scoring import full_row_logits

    from .sources import CachedFeatures, LiveSource

    was_training = model.training
    model.eval()
    flat = [(group, rec) for group in sorted(dev) for rec in dev[group]]
    recs = [rec for _, rec in flat]
    if source is None and features is not None:
        source = CachedFeatures(features, device)
    elif source is None and shared:
        source = LiveSource(collator, device)
    logits = (source.logits(model, "dev", recs) if source is not None
              else full_row_logits(model, collator, recs, batch_size=batch_size, device=device))
    model.train(was_training)
    correct: dict[str, int] = {group: 0 for group in dev}
    scored = []
    for (group, rec), lg in zip(flat, logits):
        correct[group] += int(int(lg.argmax()) == int(torch.tensor(rec.target).argmax()))
        scored.append({"id": rec.id, "group": group, "type": rec.question.type, "target": rec.target,
                       "logits": lg.tolist()})
    per_group = {group: correct[group] / max(1, len(dev[group])) for group in sorted(dev)}
    if keep is not None:
        keep.extend(scored)
    macro = sum(per_group.values()) / max(1, len(per_group))
    return {"dev_accuracy": per_group, "dev_macro_accuracy": macro, **dev_scores(scored)}


def improves_on(per_group: dict[str, float], dev: dict[str, list], best_score: float | None) -> bool:
    """Whether this dev evaluation beats the best so far, compared as exact rationals, not floats.

    Float macro averages of the same counts can differ by an ulp (0.3611111111111111 vs
    0.36111111111111116), which must not select a new checkpoint. Each group's accuracy is
    correct / n with n = its frozen dev size, so the macro is a fraction with denominator at most
    D = groups * lcm(n); the stored best (a float) is read back as the nearest such fraction.
    """
    if best_score is None:
        return True
    sizes = {g: max(1, len(dev.get(g, ()))) for g in per_group}
    new = sum((Fraction(round(acc * sizes[g]), sizes[g]) for g, acc in per_group.items()), Fraction(0))
    new /= max(1, len(per_group))
    denom = max(1, len(per_group)) * math.lcm(*sizes.values(), 1)
    if denom > 10**7:  # too fine to recover exactly from a float: compare at 12 decimals
        return round(float(new), 12) > round(best_score, 12)
    return new > Fraction(best_score).limit_denominator(denom)


def selection_score(ev: dict[str, Any], select_by: str) -> float:
    """The dev score a run selects on: ``dev_macro_accuracy`` or ``dev_nll``."""
    return float(ev["dev_nll"] if select_by == "nll" else ev["dev_macro_accuracy"])


def improves(ev: dict[str, Any], dev: dict[str, list], best_score: float | None, select_by: str) -> bool:
    """Whether dev evaluation `ev` strictly beats the best so far on the run's selection score: a higher macro
    accuracy (`improves_on`, exact), or a lower NLL (compared at 12 decimals, so float noise selects nothing)."""
    if select_by != "nll":
        return improves_on(ev["dev_accuracy"], dev, best_score)
    return best_score is None or round(float(ev["dev_nll"]), 12) < round(best_score, 12)


def patience_exhausted(patience: int | None, evals_since_best: int, d: Dist) -> bool:
    """Whether `patience` dev evaluations in a row brought no strict improvement (rank 0 decides, every
    rank gets its answer); None is the recipe's fixed budget: never."""
    if patience is None:
        return False
    return broadcast_flag(evals_since_best >= patience, d)


class DevSelection:
    """Evaluate the dev subset after `step` updates, keep its logits, select `best`, count toward patience.

    Rank 0 scores (through the plan's source for that step), writes `dev-evals/step-N.jsonl.gz`, logs the
    "eval" event and checkpoints `best` on a strict improvement; every rank then learns whether patience
    ran out (the "stopped_early" event)."""

    def __init__(self, run, session, state, writer):
        self.run, self.s, self.state, self.writer = run, session, state, writer

    def __call__(self, step: int) -> None:
        from rlcd.dev_evals import write_dev_eval

        s, state, r = self.s, self.state, self.s.recipe
        if s.dist.main:
            scored: list[dict] = []
            ev = dev_accuracy(s.model, s.dev, s.collator, s.device, source=s.sources.for_eval(step), keep=scored)
            write_dev_eval(self.run, step, scored)
            state.score = selection_score(ev, r.select_by)
            self.writer.log({"event": "eval", "step": step, **ev})
            if improves(ev, s.dev, state.best_score, r.select_by):
                state.best_score, state.best_step = state.score, step
                state.evals_since_best = 0
                self.writer.checkpoint("best", s, state)
            else:
                state.evals_since_best += 1
        s.dist.barrier()
        if patience_exhausted(r.patience, state.evals_since_best, s.dist):
            state.stopped_early = step
            self.writer.log({"event": "stopped_early", "step": step, "patience": r.patience,
                             "best_step": state.best_step, "best_score": state.best_score})


__all__ = ["dev_accuracy", "improves", "improves_on", "patience_exhausted", "selection_score", "DevSelection"]
