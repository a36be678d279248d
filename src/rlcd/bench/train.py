"""`rlcd bench train`: throughput of the real training loop and where an update's time goes.

Builds a session exactly as `rlcd train` does (`new_run` + `build_session` + `init_centring`) on
small generated data (`rlcd.data.synth.generate` + `rlcd.data.prepare.prepare` in a temporary
directory, unless `data_dir` names a processed directory), then runs the update of
`rlcd.train.train` -- the same calls in the same order -- with a timestamp between the parts
(`time.perf_counter`; on CUDA after `torch.cuda.synchronize()`, so a part owns the kernels it
launched):

* ``data``       `Session.microbatch(index)`: sampler draws + `shuffle_choice` + collation + `.to(device)`
* ``forward``    `wrapped(batch)` (backbone + LoRA + candidate scorer)
* ``objective``  `Session.objective(logits, batch, index)`: the logit noise draw and the `rlcd_loss` call
* ``backward``   `(loss / grad_accum).backward()`
* ``optimizer``  `clip_grad_norm_` + the finite check + `optimizer.step()` + the scorer's centring update
* ``other``      the rest of the update: `set_lr`, `zero_grad`, the per-type diagnostics
  (`TypeDiagnostics.add`, one host read per row), stats bookkeeping

The parts partition the update, so their shares of the measured wall time sum to 1 (checked).
Warm-up updates are run first and excluded. A separate micro-benchmark times
`Sampler(pool).microbatch` alone (rows/s over `sampler_calls` calls).

Targets (issue 9): objective < 1% of step time, sampler > 100,000 rows/s. The last printed line is
machine-readable:

    train: examples_per_s=... tokens_per_s=... objective_share=... sampler_rows_per_s=...

`run_case_vs_row` (`rlcd bench train --case-vs-row MODELS`): training examples/s with `batch_by=case`
against `row` on one session per model (the same update code, only the sampler and the forward path
differ), with the tokens each arm runs per row. Its ceiling is arithmetic: a micro-batch of B rows
drawn as six-question cases holds at least ceil(B/6) states (B=8: two, the second one split), so with
a P-token prefix and S-token suffixes the token ratio is at most B(P+S) / (2P + BS) -- 2.2x for the
synth rows on SmolLM2's tokenizer (P ~ 145, S ~ 55), 3x only from P ~ 8S (states of ~450 tokens).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

PARTS = ("data", "forward", "objective", "backward", "optimizer", "other")
OBJECTIVE_SHARE_TARGET = 0.01
SAMPLER_ROWS_TARGET = 100_000.0


# ----------------------------------------------------------------------------------------------
# data and session


def make_bench_data(out_dir: Path, *, cases: int = 80, seed: int = 0, state_tokens: int | None = None,
                    tokenizer: Any = None) -> Path:
    """Generate `cases` synthetic cases (six questions each) and prepare them into `out_dir/processed`.

    With `state_tokens`, every case's state is replaced by ticket-like text of about that many tokens
    (`rlcd.bench.prefix.make_state`, one text per case) so that rows reach realistic lengths; the
    questions, targets and posteriors stay those of the generator.
    """
    from rlcd.data import synth
    from rlcd.data.io import write_jsonl
    from rlcd.data.prepare import prepare

    out_dir = Path(out_dir)
    records = synth.generate(cases, seed)
    if state_tokens:
        if tokenizer is None:
            raise ValueError("state_tokens needs the tokenizer the model uses")
        from rlcd.bench.prefix import make_state

        texts: dict[str, str] = {}
        out = []
        for r in records:
            key = r.case_id or r.id
            if key not in texts:
                texts[key] = make_state(tokenizer, state_tokens, seed=len(texts) + 1000 * seed)
            out.append(r.model_copy(update={"state": texts[key]}))
        records = out
    raw = out_dir / "raw" / "synth.jsonl"
    write_jsonl(raw, records)
    prepare([raw], out_dir / "processed", seed=seed)
    return out_dir / "processed"


def bench_session(data_dir: Path, model: str, *, seed: int = 0, workdir: Path | None = None,
                  recipe: Any = None, placement: Any = None, backbone: Any = None) -> Any:
    """A training `Session` built by the same functions as `rlcd train` (recipe defaults: batch 8 x 4).

    `backbone`: a ready backbone handed to `build_model` (the GPU bench's 0.8B-shaped model)."""
    from rlcd.recipe import Recipe
    from rlcd.train import Dist, build_session, init_centring, new_run

    recipe = recipe or Recipe(seed=seed)
    run_dir = Path(workdir or tempfile.gettempdir()) / "bench-run"
    config, samples = new_run(run_dir, Path(data_dir), model, recipe)
    s = build_session(config, samples, Dist(), placement=placement, backbone=backbone)
    init_centring(s)
    s.bench_pool = samples["train"]  # for the sampler micro-benchmark
    return s


# ----------------------------------------------------------------------------------------------
# the instrumented update


def _clock(device: torch.device) -> Callable[[], float]:
    if device.type == "cuda":
        def tick() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return tick
    return time.perf_counter


def timed_update(s: Any, step: int, tick: Callable[[], float], trainable: list | None = None) -> dict[str, Any]:
    """One optimizer update -- `Session.update`, the very call `train()` makes -- with per-part times (s).

    `trainable` is the parameter list `train()` builds once before its loop (built here if not given).
    """
    t = dict.fromkeys(PARTS, 0.0)
    if trainable is None:
        trainable = [p for ps in s.model.param_groups().values() for p in ps]
    t0 = last = tick()

    def mark(part: str) -> None:
        nonlocal last
        now = tick()
        t[part] += now - last
        last = now

    stats = s.update(step, trainable, where=" (bench)", mark=mark)
    return {"parts": t, "wall": last - t0, "tokens": stats["_tokens"], "examples": stats["_examples"],
            "loss": stats.get("loss")}


def time_updates(s: Any, updates: int, warmup: int = 2, *, start_step: int = 0) -> dict[str, Any]:
    """Run `warmup` untimed-for-the-report updates, then `updates` measured ones; aggregate."""
    if updates < 1 or warmup < 0:
        raise ValueError("need updates >= 1 and warmup >= 0")
    tick = _clock(s.device)
    s.model.train()
    trainable = [p for ps in s.model.param_groups().values() for p in ps]  # once, as train() does
    for i in range(warmup):
        timed_update(s, start_step + i, tick, trainable)
    rows = []
    t_begin = tick()
    for i in range(updates):
        rows.append(timed_update(s, start_step + warmup + i, tick, trainable))
    t_end = tick()
    wall = t_end - t_begin
    parts = {p: sum(rw["parts"][p] for rw in rows) for p in PARTS}
    tokens = sum(rw["tokens"] for rw in rows)
    examples = sum(rw["examples"] for rw in rows)
    r = s.recipe
    return {
        "updates": updates,
        "warmup_updates": warmup,
        "batch_size": r.batch_size,
        "grad_accum": r.grad_accum,
        "examples": examples,
        "tokens": tokens,
        "mean_row_tokens": tokens / max(1, examples),
        "wall_s": wall,
        "step_ms": 1000.0 * wall / updates,
        "step_ms_median": 1000.0 * statistics.median(rw["wall"] for rw in rows),
        "examples_per_s": examples / wall,
        "tokens_per_s": tokens / wall,
        "parts_ms": {p: 1000.0 * v / updates for p, v in parts.items()},
        "shares": {p: v / wall for p, v in parts.items()},
        "objective_share": parts["objective"] / wall,
        "last_loss": rows[-1]["loss"],
        "device": str(s.device),
    }


# ----------------------------------------------------------------------------------------------
# the sampler micro-benchmark


def sampler_bench(pool: dict[str, list[str]], *, calls: int = 20_000, batch_size: int = 8, seed: int = 0) -> dict:
    """Rows/s of `Sampler(pool).microbatch` over `calls` consecutive microbatch indices."""
    from rlcd.data.sampling import Sampler

    if calls < 1:
        raise ValueError("calls must be >= 1")
    sampler = Sampler(pool)
    for i in range(min(100, calls)):  # warm-up (imports, numpy caches)
        sampler.microbatch(seed, i, batch_size)
    rows = 0
    t0 = time.perf_counter()
    for i in range(calls):
        rows += len(sampler.microbatch(seed, i, batch_size))
    dt = time.perf_counter() - t0
    return {"calls": calls, "batch_size": batch_size, "rows": rows, "wall_s": dt,
            "rows_per_s": rows / dt, "us_per_call": 1e6 * dt / calls,
            "groups": len(sampler.groups), "pool_rows": int(sum(len(v) for v in pool.values()))}


# ----------------------------------------------------------------------------------------------
# the whole benchmark


def _loadavg() -> float | None:
    try:
        import os

        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def run_train_bench(model: str = "tiny", updates: int = 20, seed: int = 0, data_dir: Path | str | None = None, *,
                    warmup: int = 2, cases: int = 80, sampler_calls: int = 20_000, threads: int | None = None,
                    placement: Any = None, print_fn: Callable[[str], None] | None = print) -> dict:
    """Build the session, time `updates` updates after `warmup`, run the sampler benchmark; return numbers."""
    if threads:
        torch.set_num_threads(int(threads))
    load_before = _loadavg()
    with tempfile.TemporaryDirectory(prefix="rlcd-bench-train-") as tmp:
        t0 = time.perf_counter()
        data = Path(data_dir) if data_dir is not None else make_bench_data(Path(tmp), cases=cases, seed=seed)
        s = bench_session(data, model, seed=seed, workdir=Path(tmp), placement=placement)
        build_s = time.perf_counter() - t0
        loop = time_updates(s, updates, warmup)
        samp = sampler_bench(s.bench_pool, calls=sampler_calls, batch_size=s.recipe.batch_size, seed=seed)
        info = s.model.info
    res = {
        "model": model,
        "hidden": info.get("hidden_size"),
        "layers": info.get("num_layers"),
        "vocab": info.get("vocab"),
        "data": "synth (generated)" if data_dir is None else str(data_dir),
        "cases": cases if data_dir is None else None,
        "seed": seed,
        "threads": torch.get_num_threads(),
        "load_avg_1m_before": load_before,
        "placement": s.model.placement,
        "build_s": build_s,
        **loop,
        "sampler": samp,
        "sampler_rows_per_s": samp["rows_per_s"],
        "targets": {"objective_share_lt": OBJECTIVE_SHARE_TARGET, "sampler_rows_per_s_gt": SAMPLER_ROWS_TARGET},
        "objective_pass": loop["objective_share"] < OBJECTIVE_SHARE_TARGET,
        "sampler_pass": samp["rows_per_s"] > SAMPLER_ROWS_TARGET,
    }
    if print_fn is not None:
        for line in format_report(res):
            print_fn(line)
    return res


def format_report(res: dict) -> list[str]:
    lines = [
        f"bench train: model={res['model']} hidden={res['hidden']} device={res['device']} threads={res['threads']} "
        f"batch {res['batch_size']} x {res['grad_accum']} accumulation; {res['updates']} updates timed after "
        f"{res['warmup_updates']} warm-up; mean row {res['mean_row_tokens']:.0f} tokens",
        f"{'part':<10} {'ms/update':>10} {'share':>8}",
    ]
    for p in PARTS:
        lines.append(f"{p:<10} {res['parts_ms'][p]:>10.2f} {100 * res['shares'][p]:>7.2f}%")
    lines.append(f"{'update':<10} {res['step_ms']:>10.2f} {100 * sum(res['shares'].values()):>7.2f}%")
    lines.append(f"throughput: {res['examples_per_s']:.1f} examples/s, {res['tokens_per_s']:.0f} tokens/s")
    s = res["sampler"]
    lines.append(f"sampler: {s['rows_per_s']:.0f} rows/s ({s['us_per_call']:.1f} us per microbatch of "
                 f"{s['batch_size']}, {s['calls']} calls)")
    lines.append(f"{'PASS' if res['objective_pass'] else 'FAIL'} objective share {100 * res['objective_share']:.3f}% "
                 f"(target < {100 * OBJECTIVE_SHARE_TARGET:.0f}%)")
    lines.append(f"{'PASS' if res['sampler_pass'] else 'FAIL'} sampler {s['rows_per_s']:.0f} rows/s "
                 f"(target > {SAMPLER_ROWS_TARGET:,.0f})")
    lines.append(f"train: examples_per_s={res['examples_per_s']:.2f} tokens_per_s={res['tokens_per_s']:.1f} "
                 f"objective_share={res['objective_share']:.5f} sampler_rows_per_s={s['rows_per_s']:.0f}")
    return lines


# ----------------------------------------------------------------------------------------------
# batch_by case vs row


def use_batch_by(s: Any, batch_by: str) -> None:
    """Switch a bench session's sampling between `row` and `case` (same model, same data)."""
    from rlcd.data.sampling import Sampler
    from rlcd.train import plan_sources

    s.recipe = s.recipe.with_(batch_by=batch_by)
    pool = s.bench_pool
    case_of = {i: s.records[i].case_id for ids in pool.values() for i in ids} if batch_by == "case" else None
    s.sampler = Sampler(pool, case_of)
    s.sources = plan_sources(s.recipe, collator=s.collator, device=s.device)


def _tokens_run(model: Any, b: Any) -> tuple[int, int, int]:
    """(rows, full-row tokens, tokens run) of batch `b`: a `CaseBatch` runs each unit's shared cut once."""
    from rlcd.model.case_train import unit_prefix_len

    lens = b.attention_mask.sum(1).tolist()
    if getattr(b, "units", None) is None:
        return len(lens), sum(lens), sum(lens)
    run = 0
    for u in b.units:
        cut = unit_prefix_len(model, b.rows[u.start:u.end], u.n_img) or 0
        run += cut + sum(lens[i] - cut for i in range(u.start, u.end))
    return len(lens), sum(lens), run


def processed_tokens(s: Any, indices: range) -> dict[str, float]:
    """Tokens the model runs for micro-batches `indices` under the session's `batch_by`, against full rows."""
    rows, full, run = (sum(x) for x in zip(*(_tokens_run(s.model, s.microbatch(i)) for i in indices)))
    return {"rows": rows, "full_tokens_per_row": full / rows, "run_tokens_per_row": run / rows,
            "token_ratio": full / run}


def whole_case_tokens(s: Any) -> dict[str, float]:
    """The same count if every case's state ran once for all its rows (no case split across micro-batches,
    the ceiling of any packing): full-row tokens over state-once tokens, over the training pool's cases."""
    from rlcd.model.case_scoring import group_cases
    from rlcd.model.case_train import collate_cases

    records = [s.records[i] for ids in s.bench_pool.values() for i in ids]
    counts = [_tokens_run(s.model, collate_cases(s.collator, [[records[i] for i in g]])) for g in group_cases(records)]
    rows, full, run = (sum(x) for x in zip(*counts))
    return {"whole_case_tokens_per_row": run / rows, "whole_case_token_ratio": full / run}


def run_case_vs_row(models: tuple[str, ...] = ("tiny",), *, updates: int = 4, warmup: int = 1, rounds: int = 2,
                    cases: int = 80, seed: int = 0, state_tokens: int | None = None, threads: int | None = None,
                    eval_cases: int = 10, placement: Any = None,
                    print_fn: Callable[[str], None] | None = print) -> dict:
    """Training examples/s with `batch_by=case` vs `row`, per model, on generated six-question synth cases,
    then evaluation rows/s through shared prefixes vs full rows on `eval_cases` synth cases (0: skipped).

    One session per model (built as `rlcd train` builds it); `rounds` alternating blocks of `updates`
    timed updates per arm (after `warmup` untimed ones each), so a change of machine load hits both arms.
    The ratio is of the summed times. `token_ratio`: full-row tokens over tokens run with shared prefixes
    (its upper bound on a compute-bound machine); `whole_case_token_ratio`: the same if no case were split
    across micro-batches. `evaluation`: `rlcd.bench.pipeline.evaluation_section` on the session's model."""
    from rlcd.bench.pipeline import evaluation_section
    from rlcd.model.backbone import load_backbone

    if threads:
        torch.set_num_threads(int(threads))
    out: dict[str, Any] = {"updates_per_round": updates, "rounds": rounds, "warmup_updates": warmup, "cases": cases,
                           "eval_cases": eval_cases, "state_tokens": state_tokens, "seed": seed,
                           "threads": torch.get_num_threads(),
                           "load_avg_1m_before": _loadavg(), "models": {}}
    for model in models:
        with tempfile.TemporaryDirectory(prefix="rlcd-bench-case-") as tmp:
            tok = load_backbone(model, seed=0).tokenizer if state_tokens else None
            data = make_bench_data(Path(tmp), cases=cases, seed=seed, state_tokens=state_tokens, tokenizer=tok)
            s = bench_session(data, model, seed=seed, workdir=Path(tmp), placement=placement)
            arms: dict[str, dict[str, Any]] = {"row": {"wall_s": 0.0, "examples": 0},
                                               "case": {"wall_s": 0.0, "examples": 0}}
            step = 0
            for _ in range(rounds):
                for arm in ("row", "case"):
                    use_batch_by(s, arm)
                    res = time_updates(s, updates, warmup, start_step=step)
                    step += updates + warmup
                    arms[arm]["wall_s"] += res["wall_s"]
                    arms[arm]["examples"] += res["examples"]
                    arms[arm]["mean_row_tokens"] = res["mean_row_tokens"]
            for arm in arms:
                arms[arm]["examples_per_s"] = arms[arm]["examples"] / arms[arm]["wall_s"]
            use_batch_by(s, "case")
            tokens = {**processed_tokens(s, range(10_000, 10_040)), **whole_case_tokens(s)}
            out["models"][model] = {**arms, "speedup": arms["case"]["examples_per_s"] / arms["row"]["examples_per_s"],
                                    **tokens, "placement": s.model.placement}
            if print_fn is not None:
                m = out["models"][model]
                print_fn(f"case vs row: {model}: row {m['row']['examples_per_s']:.2f} examples/s, case "
                         f"{m['case']['examples_per_s']:.2f} examples/s: {m['speedup']:.2f}x (tokens run per row "
                         f"{m['run_tokens_per_row']:.0f} of {m['full_tokens_per_row']:.0f}: bound "
                         f"{m['token_ratio']:.2f}x; {m['whole_case_token_ratio']:.2f}x if every case ran whole)")
            if eval_cases:
                if print_fn is not None:
                    print_fn(f"evaluation: {model}:")
                out["models"][model]["evaluation"] = evaluation_section(
                    s.model.eval(), cases=eval_cases, seed=seed, say=print_fn or (lambda _: None))
            del s
    out["load_avg_1m_after"] = _loadavg()
    return out


__all__ = ["run_train_bench", "run_case_vs_row", "use_batch_by", "processed_tokens", "whole_case_tokens",
           "time_updates", "timed_update", "sampler_bench", "make_bench_data", "bench_session", "PARTS"]
