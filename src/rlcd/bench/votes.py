"""`rlcd bench votes RUN`: what order votes cost (`Predictor(order_votes=N)`, docs/SERVING.md "Order votes").

One loaded model, one Predictor per vote count N on it (state cache off, so every request pays its state). Each
repeat sends, for every N in turn, the same request (`questions` mixed-type questions, a choice question every
third, about a new state of about `state_tokens` tokens), so drift in the machine's load hits every N alike; the
first round warms kernels and is not recorded. Reported per N: p50 milliseconds per request, `usage.input_tokens`
per request (the state once, every order's suffix), the rows scored, and both as ratios to N = 1 measured in the
same run. The extra cost is suffixes only: a choice question of K options asked in N orders adds N - 1 suffixes
of about its own length (capped at K orders), on the prefix the request already ran.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from .pipeline import request_of
from .prefix import make_state

DEFAULT_VOTES = (1, 2, 3, 4)


def run_votes_bench(predictor: Any, *, votes: tuple[int, ...] = DEFAULT_VOTES, questions: int = 6,
                    repeats: int = 5, state_tokens: int = 250, seed: int = 0,
                    say: Callable[[str], None] = print) -> dict:
    """Time per request and tokens per request at each N of `votes` on `predictor`'s model (module docstring)."""
    from ..order_votes import check_votes
    from ..predict import Predictor

    votes = tuple(dict.fromkeys(check_votes(n) for n in votes))
    if 1 not in votes:
        votes = (1, *votes)  # the ratios' base
    runner = predictor.runner
    preds = {n: Predictor(runner, predictor.meta, name=predictor.name, limits=predictor.limits, state_cache_mb=0,
                          order_votes=n) for n in votes}
    qs = request_of("x", questions, seed)["questions"]
    times: dict[int, list[float]] = {n: [] for n in votes}
    tokens: dict[int, int] = {}
    rows: dict[int, int] = {}
    for r in range(repeats + 1):  # round 0 warms up: not recorded
        req = {"state": make_state(predictor.model.tokenizer, state_tokens, seed * 1_000_003 + r), "questions": qs}
        for n in votes:
            p = preds[n]
            t0 = time.perf_counter()
            prepared = p.prepare(req)
            logits, usage = p.score(prepared)
            answer = p.respond(prepared, logits, usage)
            ms = 1000 * (time.perf_counter() - t0)
            if r:
                times[n].append(ms)
            tokens[n] = int(answer["usage"]["input_tokens"])
            rows[n] = prepared.size()[0]
    p50 = {n: statistics.median(times[n]) for n in votes}
    kinds = [q["type"] for q in qs.values()]
    out: dict[str, Any] = {
        "model": predictor.name, "placement": runner.placement, "questions": questions,
        "choice_questions": kinds.count("choice"),
        "choice_options": [len(q["criteria"]) for q in qs.values() if q["type"] == "choice"],
        "state_tokens": state_tokens, "repeats": repeats, "votes": list(votes),
        "per_votes": {str(n): {"p50_ms": p50[n], "input_tokens": tokens[n], "rows": rows[n],
                               "time_ratio": p50[n] / p50[1], "token_ratio": tokens[n] / tokens[1]}
                      for n in votes},
    }
    for n in votes:
        v = out["per_votes"][str(n)]
        say(f"  order_votes={n}: p50 {v['p50_ms']:.1f} ms ({v['time_ratio']:.2f}x of N=1), {v['input_tokens']} "
            f"tokens ({v['token_ratio']:.2f}x), {v['rows']} rows")
    return out


__all__ = ["DEFAULT_VOTES", "run_votes_bench"]
