"""Dev predictions at every evaluation, kept compactly, and how each question's advantage magnitude moves.

The training loop (rank 0) writes ``RUN/dev-evals/step-N.jsonl.gz`` at each dev evaluation: one row per
question of the frozen dev subset with ``id``, ``group``, ``type``, ``target`` and the raw ``logits``
(gzip, no timestamp, so equal predictions give equal bytes). From these files alone the report answers
the cookbook's question "which questions get their advantages amplified over training?":

The **advantage magnitude** of a question at an evaluation is the standard deviation (ddof 1) of its
RLCD reward (``rlcd.objectives.reward_samples``: the run's sigma at that step, w_log, w_spherical,
w_rps) over M = ``N_SAMPLES`` Gaussian logit perturbations of its dev logits. The unnormalised
advantage of RLCD is ``A = r - mean_g r``, whose mean square over G samples is ``(G-1)/G`` times the
reward variance, so this std is (up to that constant) the RMS size of the advantages the question
would feed the policy gradient at that point of training. The perturbations of a question are drawn
from a generator seeded by its id, the same at every step (common random numbers), so a change in
magnitude comes from the model's logits, not from the draw.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping

import torch

N_SAMPLES = 32  # perturbations per question for the advantage magnitude
_STEP_FILE = re.compile(r"^step-(\d+)\.jsonl\.gz$")


def write_dev_eval(run, step: int, rows: list[dict[str, Any]]) -> Path:
    """``RUN/dev-evals/step-<step>.jsonl.gz`` from the dev scoring rows (atomic, byte-stable)."""
    path = run.dev_eval_path(step)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz:
        for r in rows:
            row = {"id": r["id"], "group": r.get("group"), "type": r["type"], "target": r["target"],
                   "logits": r["logits"]}
            gz.write((json.dumps(row, sort_keys=True) + "\n").encode("utf-8"))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)
    return path


def dev_eval_steps(run) -> list[int]:
    """Steps with a dev-evals file, ascending."""
    d = run.dev_evals_dir
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _STEP_FILE.match(p.name)))


def read_dev_eval(run, step: int) -> list[dict[str, Any]]:
    with gzip.open(run.dev_eval_path(step), "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def trim_dev_evals(run, step: int) -> None:
    """Drop the files of evaluations after `step` (written after the checkpoint a resume starts from)."""
    for s in dev_eval_steps(run):
        if s > step:
            run.dev_eval_path(s).unlink()


def _noise(qid: str, k: int, n: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(qid.encode("utf-8")).digest()[:8], "little") % (2**63 - 1)
    return torch.randn((n, k), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def advantage_magnitudes(rows: list[dict[str, Any]], *, sigma: float, w_log: float = 1.0,
                         w_spherical: float = 0.75, w_rps: float = 1.0,
                         n_samples: int = N_SAMPLES) -> dict[str, float]:
    """{question id: advantage magnitude} (module docstring) for dev-eval rows, one batch per type."""
    from rlcd.objectives import reward_samples

    out: dict[str, float] = {}
    by_type: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_type[r["type"]].append(r)
    for qtype, group in by_type.items():
        k = max(len(r["logits"]) for r in group)
        b = len(group)
        logits = torch.zeros(b, k, dtype=torch.float64)
        target = torch.zeros(b, k, dtype=torch.float64)
        mask = torch.zeros(b, k, dtype=torch.bool)
        noise = torch.zeros(n_samples, b, k, dtype=torch.float64)
        for i, r in enumerate(group):
            n = len(r["logits"])
            logits[i, :n] = torch.tensor(r["logits"], dtype=torch.float64)
            target[i, :n] = torch.tensor(r["target"], dtype=torch.float64)
            mask[i, :n] = True
            noise[:, i, :n] = _noise(r["id"], n, n_samples)
        ordinal = torch.full((b,), qtype == "score", dtype=torch.bool)
        reward = reward_samples(logits, mask, target, ordinal, sigma=sigma, noise=noise, n_perturbations=n_samples,
                                w_log=w_log, w_spherical=w_spherical, w_rps=w_rps)["reward"]
        for r, v in zip(group, reward.std(dim=0, correction=1).tolist()):
            out[r["id"]] = v
    return out


def amplified_questions(run, recipe: Mapping[str, Any], horizon: int | None = None,
                        top: int = 5) -> dict[str, Any] | None:
    """Per type, the `top` questions whose advantage magnitude grew most from the first to the last dev
    evaluation; None when fewer than two evaluations were kept."""
    from dataclasses import fields

    from rlcd.recipe import Recipe

    steps = dev_eval_steps(run)
    if len(steps) < 2:
        return None
    known = {f.name for f in fields(Recipe)}
    r = Recipe(**{k: v for k, v in recipe.items() if k in known})  # a config from another rlcd version reads too
    d = horizon or r.decay_horizon()
    first, last = steps[0], steps[-1]
    mags = {}
    rows_last = read_dev_eval(run, last)
    for step, rows in ((first, read_dev_eval(run, first)), (last, rows_last)):
        mags[step] = advantage_magnitudes(rows, sigma=r.sigma_at(step, d), w_log=r.w_log,
                                          w_spherical=r.w_spherical, w_rps=r.w_rps)
    per_type: dict[str, list[dict]] = defaultdict(list)
    for row in rows_last:
        qid = row["id"]
        if qid in mags[first]:
            a, b = mags[first][qid], mags[last][qid]
            per_type[row["type"]].append({"id": qid, "first": a, "last": b, "growth": b - a})
    return {"first_step": first, "last_step": last, "steps": steps,
            "per_type": {t: sorted(v, key=lambda x: (-x["growth"], x["id"]))[:top] for t, v in sorted(per_type.items())}}
