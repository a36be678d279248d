"""Report section: per question type, the dev questions whose advantage magnitude grew most over training
(from ``RUN/dev-evals/``; the magnitude is defined in ``rlcd.dev_evals``)."""

from __future__ import annotations

from rlcd.dev_evals import N_SAMPLES, amplified_questions
from rlcd.report.context import Context
from rlcd.report.document import Section, Table, Text


def amplified(ctx: Context) -> Section | None:
    config = ctx.config or {}
    found = amplified_questions(ctx.run, config.get("recipe") or {}, config.get("decay_horizon"))
    if found is None:
        return None  # fewer than two dev evaluations kept (older runs, or no training)
    s = Section("Questions whose advantages grew", level=3)
    s.add(Text(f"From `dev-evals/` ({len(found['steps'])} dev evaluations). Advantage magnitude: the std of a "
               f"question's RLCD reward over {N_SAMPLES} fixed Gaussian perturbations of its dev logits (the run's "
               "sigma and reward weights), i.e. the size of the advantages it feeds the policy gradient; growth from "
               f"step {found['first_step']} to step {found['last_step']}, largest first."))
    rows = [[t, q["id"], q["first"], q["last"], q["growth"]] for t, qs in found["per_type"].items() for q in qs]
    return s.add(Table(["type", "question id", f"step {found['first_step']}", f"step {found['last_step']}",
                        "growth"], rows))
