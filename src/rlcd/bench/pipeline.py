"""`rlcd bench pipeline`: rlcd's Predictor vs transformers' `pipeline("decision")`, and evaluation
rows/s through shared prefixes vs full rows, in one process.

1. **serving**: an untrained export of the backbone (`--model`; the scorer centred and rescaled so
   the probabilities are far from uniform) is written to a temporary run dir (`export/` and
   `export/hf/`); rlcd's `Predictor` and `pipeline("decision", model=export/hf,
   trust_remote_code=True)` answer the same requests of 1, 5 and 50 questions over one ~`state_tokens`
   state, interleaved (so load changes on a shared machine hit both alike): p50 ms each, the ratio
   pipeline / rlcd (> 1: rlcd is faster) and the largest probability difference between them.
2. **evaluation**: `predict_rows` on known-posterior synth cases (six questions about one state)
   through shared prefixes (the default) and as full rows (`shared=False`, the reference): rows/s
   each, the speedup and the largest logit difference.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..model.runner import CaseRunner
from .prefix import make_questions, make_state

TEMPERATURES = {"choice": 1.0, "noul": 1.0, "score": 1.0}


def write_untrained_export(run_dir: Path, model: str, *, seed: int = 0, logit_std: float = 2.0) -> Path:
    """A run dir holding `checkpoints/best`, `export/` and `export/hf/` of an untrained `model`."""
    from .. import checkpoint
    from ..evaluate import write_hf
    from ..export import write_export
    from ..model.build import build_model
    from ..recipe import Recipe
    from ..run import Run
    from .prefix import _centre_on_request

    run_dir.mkdir(parents=True, exist_ok=True)
    dm = build_model({"model": model, "model_seed": seed, "recipe": {}}).eval()
    with torch.no_grad():
        _centre_on_request(dm, seed, logit_std)
    config = {"model": model, "model_seed": seed, "recipe": Recipe().to_dict()}
    (run_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    state = {"best_step": 0, "best_score": 0.0}
    checkpoint.save(run_dir / "checkpoints" / "best", weights=dm.trainable_state_dict(), optimizer=None, state=state)
    write_export(Run(run_dir), temperatures=dict(TEMPERATURES), model=dm, config=config, state=state)
    write_hf(Run(run_dir))
    return run_dir


def request_of(state: str, n: int, seed: int = 0) -> dict:
    """A System One request of `n` mixed-type questions over `state`."""
    out = {}
    for i, q in enumerate(make_questions(n, seed)):
        raw = q.model_dump(exclude_none=True)
        if q.type == "choice" and isinstance(q.criteria, list):  # System One: choice criteria is a mapping
            raw["criteria"] = {label: None for label in q.criteria}
        out[f"q{i}"] = raw
    return {"state": state, "questions": out}


def max_prob_diff(ours: dict, theirs: dict) -> float | None:
    """Largest |p_rlcd - p_pipeline| over every question and option (None if the answers disagree in shape)."""
    worst = 0.0
    answers = ours["answers"]
    if list(answers) != list(theirs):
        return None
    for qid, ans in theirs.items():
        if ans.get("type") == "noul":  # a noul answer is the probability of "true"
            worst = max(worst, abs(float(answers[qid]["noul"]) - float(ans["noul"])))
            continue
        mine, other = answers[qid]["probabilities"], ans["probabilities"]
        if list(mine) != list(other):
            return None
        worst = max(worst, max(abs(float(mine[k]) - float(other[k])) for k in other))
    return worst


def serving_section(run_dir: Path, *, sizes: tuple[int, ...], repeats: int, state_tokens: int, seed: int,
                    say: Callable[[str], None], placement: Any) -> dict:
    from transformers import pipeline

    from ..predict import Predictor

    # default settings on both sides: the export's remote code asks canonical forms as rlcd serve does
    pred = Predictor.from_run(run_dir, placement=placement)
    pipe = pipeline("decision", model=str(run_dir / "export" / "hf"), trust_remote_code=True,
                    device=placement.torch_device, dtype=placement.torch_dtype)
    state = make_state(pred.model.tokenizer, state_tokens, seed)
    out: dict[str, Any] = {}
    for n in sizes:
        req = request_of(state, n, seed)
        ours, theirs = pred.predict(req), pipe(req)  # warm-up, and the answers compared
        t_ours, t_theirs = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            pred.predict(req)
            t1 = time.perf_counter()
            pipe(req)
            t2 = time.perf_counter()
            t_ours.append((t1 - t0) * 1000)
            t_theirs.append((t2 - t1) * 1000)
        p50_ours, p50_theirs = statistics.median(t_ours), statistics.median(t_theirs)
        usage = CaseRunner(pred.model).n_tokens(state, [q for q in make_questions(n, seed)])
        row = {"questions": n, "rlcd_p50_ms": p50_ours, "pipeline_p50_ms": p50_theirs,
               "ratio": p50_theirs / p50_ours, "max_prob_diff": max_prob_diff(ours, theirs),
               "rlcd_path": usage["path"], "rlcd_input_tokens": usage["input_tokens"],
               "full_tokens": usage["full_tokens"]}
        out[str(n)] = row
        say(f"  {n:3d} questions: rlcd p50 {p50_ours:8.1f} ms ({usage['path']} path), pipeline p50 "
            f"{p50_theirs:8.1f} ms, ratio {row['ratio']:.2f}, max |dp| "
            f"{'answers differ in shape' if row['max_prob_diff'] is None else format(row['max_prob_diff'], '.2g')}")
    out["rlcd_at_least_as_fast"] = all(out[str(n)]["ratio"] >= 1.0 for n in sizes)
    return out


def evaluation_section(model: Any, *, cases: int, seed: int, say: Callable[[str], None]) -> dict:
    from ..data.synth import generate
    from ..evaluate import predict_rows

    records = generate(cases, seed=seed)
    collator = model.collator()
    predict_rows(model, records[:12], collator)  # warm-up
    predict_rows(model, records[:12], collator, shared=False)
    t0 = time.perf_counter()
    full = predict_rows(model, records, collator, shared=False)
    t1 = time.perf_counter()
    shared = predict_rows(model, records, collator)
    t2 = time.perf_counter()
    diff = max(max(abs(a - b) for a, b in zip(s["logits"], f["logits"])) for s, f in zip(shared, full))
    from ..model.case_scoring import group_cases

    runner = CaseRunner(model)
    inputs = [runner.cases.from_records([records[i] for i in g]) for g in group_cases(records)]
    lens = runner.plan(inputs).prefix_len
    shared_tokens = sum((n or 0) + sum(len(r) - (n or 0) for r in c.rows) for c, n in zip(inputs, lens))
    full_tokens = sum(c.n_tokens for c in inputs)
    res = {"cases": cases, "rows": len(records), "questions_per_case": len(records) / cases,
           "full_tokens": full_tokens, "shared_tokens": shared_tokens, "token_bound": full_tokens / shared_tokens,
           "full_rows_per_s": len(records) / (t1 - t0), "shared_rows_per_s": len(records) / (t2 - t1),
           "max_abs_logit_diff": diff, "max_abs_logit": max(abs(x) for f in full for x in f["logits"])}
    res["speedup"] = res["shared_rows_per_s"] / res["full_rows_per_s"]
    res["rel_logit_diff"] = diff / res["max_abs_logit"] if res["max_abs_logit"] else 0.0
    say(f"  {len(records)} rows ({cases} cases): full rows {res['full_rows_per_s']:.1f} rows/s, shared prefixes "
        f"{res['shared_rows_per_s']:.1f} rows/s, speedup {res['speedup']:.2f}x (token bound "
        f"{res['token_bound']:.2f}x), max |dlogit| {diff:.2g} of max |logit| {res['max_abs_logit']:.3g}")
    return res


def run_pipeline_bench(model: str = "tiny", sizes: tuple[int, ...] = (1, 5, 50), repeats: int = 5,
                       state_tokens: int = 150, eval_cases: int = 20, seed: int = 0,
                       print_fn: Callable[[str], None] | None = print, placement: Any = None) -> dict:
    """Both sections on one backbone (module docstring); returns the numbers, prints a summary.
    `placement`: where both sides run (default CPU float32); the export is always written from float32."""
    from ..device import resolve_placement

    placement = placement or resolve_placement("cpu")
    say = print_fn or (lambda _: None)
    with tempfile.TemporaryDirectory(prefix="rlcd-bench-pipeline-") as tmp:
        run_dir = write_untrained_export(Path(tmp) / "run", model, seed=seed)
        say(f"model={model} threads={torch.get_num_threads()} repeats={repeats} state_tokens~{state_tokens}")
        say("serving: rlcd Predictor vs transformers pipeline('decision') on the same export/hf")
        serving = serving_section(run_dir, sizes=sizes, repeats=repeats, state_tokens=state_tokens, seed=seed,
                                  say=say, placement=placement)
        say("evaluation: predict_rows through shared prefixes vs full rows")
        from ..export import load_export

        dm, _ = load_export(run_dir, placement=placement)
        evaluation = evaluation_section(dm, cases=eval_cases, seed=seed, say=say)
    return {"model": model, "placement": placement.to_dict(), "threads": torch.get_num_threads(),
            "repeats": repeats, "state_tokens": state_tokens,
            "serving": serving, "evaluation": evaluation}


__all__ = ["run_pipeline_bench", "write_untrained_export", "request_of", "max_prob_diff"]
