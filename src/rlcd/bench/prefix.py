"""`rlcd bench prefix`: shared-prefix scoring vs row-by-row full forwards on one request.

Builds a model (default the random `tiny` preset, hidden >= 256), a request of N mixed-type
questions over one state of about L tokens, and scores it (a) row by row with one full forward per
question (batch 1) and (b) with `CaseRunner.score_case` (prefix once, suffixes batched). Reports
the largest absolute logit difference, the median times, the measured speedup and the token-count
bound `(B*L) / (P + B*(L-P))` (B rows, L mean row length, P shared prefix length), and
ratio = speedup / bound. The last printed line is machine-readable:

    prefix: max_abs_diff=... speedup=... bound=... ratio=...

Parity. In float32 the two paths must agree within atol 1e-4 + rtol 1e-5 (`tol_ok`). In a lower
precision (bfloat16) both paths round differently, so their mutual difference says little: the
bench also scores the rows with a float32 copy of the same weights (full rows) and reports each
path's error against it (`err_full`: the full low-precision rows, `err_prefix`: the shared-prefix
path); the prefix path passes (`parity_ok`) when err_prefix <= PARITY_FACTOR * err_full +
PARITY_ATOL, i.e. it adds no error beyond the precision's own. In float32 `parity_ok` = `tol_ok`.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any, Callable

import torch

from ..model.runner import CaseRunner
from ..schema import Question

PARITY_FACTOR = 1.5  # the prefix path may be this much further from float32 than full rows in the same dtype
PARITY_ATOL = 1e-4  # plus this (float32 noise of the reference itself)

_WORDS = (
    "order ticket customer account payment refund delivery parcel address invoice warehouse late damaged "
    "replacement courier tracking priority support agent message email phone call week month yesterday "
    "today urgent request issue problem solved pending escalated billing card bank transfer discount "
    "coupon product size colour blue red green large small fragile box label return policy store online"
).split()


def make_state(tokenizer: Any, n_tokens: int, seed: int = 0) -> str:
    """Deterministic ticket-like text of about `n_tokens` tokens (`State: ...` segment excluded)."""
    rng = random.Random(seed)
    parts: list[str] = []
    count = 0
    while count < n_tokens:
        sentence = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 14))).capitalize() + "."
        parts.append(sentence)
        count = len(tokenizer.encode(" ".join(parts), add_special_tokens=False))
    return " ".join(parts)


def make_questions(n: int, seed: int = 0) -> list[Question]:
    """N mixed-type questions (choice / noul / score in turn) with varied wording and K."""
    rng = random.Random(seed + 1)
    out: list[Question] = []
    for i in range(n):
        kind = ("choice", "noul", "score")[i % 3]
        topic = rng.choice(_WORDS)
        if kind == "choice":
            labels = rng.sample(_WORDS, rng.randint(3, 6))
            if i % 2:
                crit: Any = {lab: f"the ticket is mainly about {lab}" for lab in labels}
            else:
                crit = labels
            out.append(Question(type="choice", instructions=f"Which category fits the {topic} (#{i})?", criteria=crit))
        elif kind == "noul":
            out.append(Question(type="noul", instructions=f"Does the ticket mention {topic} (#{i})?"))
        else:
            k = rng.randint(3, 5)
            out.append(Question(type="score", instructions=f"How urgent is the {topic} issue (#{i})?",
                                criteria=[f"urgency {j} of {k - 1}" for j in range(k)]))
    return out


def run_prefix_bench(model: str = "tiny", questions: int = 32, state_tokens: int = 512, repeats: int = 5,
                     hidden: int | None = None, seed: int = 0, *, logit_std: float | None = None,
                     exact: bool = False,
                     print_fn: Callable[[str], None] | None = print, decision_model: Any = None,
                     placement: Any = None) -> dict:
    """Run the benchmark; returns the numbers (and prints them unless `print_fn` is None).

    The head is the model's own random head with its centring buffers set on a small synthetic batch.
    `logit_std` rescales W_d so the logits have that standard deviation (logits are linear in W_d, so
    differences scale with them: compare `rel_diff`, or `tol_ok` = within atol 1e-4 + rtol 1e-5).
    `exact` runs `score_case(exact=True)` (the shared prefix on the DeltaNet chunk grid).
    """
    dm = decision_model
    if dm is None:
        from ..device import resolve_placement
        from ..model.backbone import load_backbone
        from ..model.build import build_model

        pl = placement or resolve_placement("cpu")
        bb = load_backbone(model, seed=seed, hidden=hidden, dtype=pl.torch_dtype, device=pl.torch_device)
        dm = build_model({"model": model, "model_seed": seed, "recipe": {}}, device=pl.torch_device,
                         dtype=pl.torch_dtype, backbone=bb)
    dm.eval()
    with torch.no_grad():
        _centre_on_request(dm, seed, logit_std)
    state = make_state(dm.tokenizer, state_tokens, seed)
    qs = make_questions(questions, seed)
    qids = [f"q{i}" for i in range(len(qs))]

    # warm-up (allocator, lazy inits), then medians
    runner = CaseRunner(dm)
    runner.score_full(state, qs[:2], ids=qids[:2])
    runner.score_case(state, qs, ids=qids, exact=exact)
    # interleaved, so a load change on a shared machine hits both paths alike
    times_full, times_shared = [], []
    full = shared = usage = None
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        full = runner.score_full(state, qs, ids=qids, batch_size=1)
        t1 = time.perf_counter()
        shared, usage = runner.score_case(state, qs, ids=qids, exact=exact)
        t2 = time.perf_counter()
        times_full.append(t1 - t0)
        times_shared.append(t2 - t1)
    t_full, t_shared = statistics.median(times_full), statistics.median(times_shared)
    usage = dict(usage)

    diff = max(float((a - b).abs().max()) for a, b in zip(full, shared))
    max_logit = max(float(a.abs().max()) for a in full)
    tol_ok = all(bool(torch.allclose(b_, a_, atol=1e-4, rtol=1e-5)) for a_, b_ in zip(full, shared))
    parity = precision_parity(dm, state, qs, qids, full, shared, tol_ok)
    b = len(qs)
    p = usage["prefix_tokens"]
    mean_len = usage["full_tokens"] / b
    bound = (b * mean_len) / (p + b * (mean_len - p))
    speedup = t_full / t_shared
    res = {
        "model": model if decision_model is None else dm.info.get("preset"),
        "hidden": dm.info.get("hidden_size"),
        "placement": dm.placement,
        "questions": b,
        "state_tokens": state_tokens,
        "prefix_tokens": p,
        "mean_row_tokens": mean_len,
        "input_tokens_shared": usage["input_tokens"],
        "input_tokens_full": usage["full_tokens"],
        "calls": usage["calls"],
        "max_abs_logit": max_logit,
        "max_abs_diff": diff,
        "rel_diff": diff / max_logit if max_logit > 0 else 0.0,
        "tol_ok": tol_ok,
        **parity,
        "logit_std": logit_std,
        "exact": exact,
        "time_full_s": t_full,
        "time_shared_s": t_shared,
        "speedup": speedup,
        "bound": bound,
        "ratio": speedup / bound,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
    }
    if print_fn is not None:
        print_fn(f"model={res['model']} hidden={res['hidden']} questions={b} prefix_tokens={p} "
                 f"mean_row_tokens={mean_len:.1f} threads={res['threads']} repeats={repeats}")
        print_fn(f"full forwards (batch 1): median {t_full * 1000:.1f} ms; shared prefix: median "
                 f"{t_shared * 1000:.1f} ms ({usage['calls']} calls)")
        print_fn(f"max |logit| {max_logit:.3g}; max |diff| / max |logit| {res['rel_diff']:.2g}; "
                 f"within atol 1e-4 + rtol 1e-5: {tol_ok}")
        if parity["err_full"] is not None:
            print_fn(f"{res['placement']['dtype']} against float32 full rows: full rows {parity['err_full']:.3g}, "
                     f"shared prefix {parity['err_prefix']:.3g} (pass when <= {PARITY_FACTOR} x full + "
                     f"{PARITY_ATOL:g}): {'ok' if parity['parity_ok'] else 'FAIL'}")
        print_fn(f"prefix: max_abs_diff={diff:.3g} speedup={speedup:.2f} bound={bound:.2f} ratio={speedup / bound:.2f}")
    return res


def precision_parity(dm: Any, state: Any, qs: list[Question], qids: list[str], full: list[torch.Tensor],
                     shared: list[torch.Tensor], tol_ok: bool) -> dict:
    """{err_full, err_prefix, parity_ok}: each path's max abs logit error against full rows of a float32
    copy of the same weights (None in float32, where parity_ok is `tol_ok`); see the module docstring."""
    import copy

    dtype = next(dm.backbone.parameters()).dtype
    if dtype == torch.float32:
        return {"err_full": None, "err_prefix": None, "parity_ok": bool(tol_ok)}
    ref_model = copy.deepcopy(dm).to(torch.float32).eval()
    ref = CaseRunner(ref_model).score_full(state, qs, ids=qids, batch_size=1)
    del ref_model
    err_full = max(float((a - r).abs().max()) for a, r in zip(full, ref))
    err_prefix = max(float((b - r).abs().max()) for b, r in zip(shared, ref))
    return {"err_full": err_full, "err_prefix": err_prefix,
            "parity_ok": bool(err_prefix <= PARITY_FACTOR * err_full + PARITY_ATOL)}


def _centre_on_request(dm: Any, seed: int, logit_std: float | None = None) -> None:
    """Set the head's centring buffers on a small synthetic batch; optionally rescale W_d.

    A random scorer on a random backbone gives logits of ~0.03; with `logit_std` W_d is rescaled so
    that the logits on that batch have that standard deviation (trained heads reach |logits| of
    10-50, see QWEN35-NOTES.md).
    """
    from ..model.cases import CaseEncoder
    from ..model.collate import pad_rows

    state = make_state(dm.tokenizer, 64, seed + 7)
    qs = make_questions(6, seed + 7)
    rows = CaseEncoder.for_model(dm).rows(state, qs)
    batch = pad_rows(rows, pad_id=dm.encoder.pad_id, image_pad_id=dm.encoder.image_pad_id,
                     types=[q.type for q in qs])
    dm.init_centring([batch])
    if logit_std is None:
        return
    lg = dm(batch)
    std = float(lg[batch.cand_mask].std())
    if std > 0:
        dm.head.w_d.weight.mul_(logit_std / std)
