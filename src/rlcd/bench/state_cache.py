"""`rlcd bench serve RUN --state-cache`: what the cross-request state cache saves, and what a question costs.

Scenarios (no HTTP: `Predictor.predict`, one loaded model, two Predictors on it -- cache on and off),
each on a fresh state of about `state_tokens` tokens per repeat, so "cold" is always cold:

* `cold_1q`: one question about a new state (cache on: it takes the prefix path and stores the state);
* `cold_1q_off`: the same with the cache off (a full forward: what a cold request cost before);
* `warm_1q`: a new question about the state `cold_1q` just stored;
* `one_request_5q`: five questions in one request (the within-request sharing that already existed);
* `five_requests_off` / `five_requests_on`: the same five questions in five requests, one after the
  other (off: each pays the state; on: the first pays it, four are warm), total time.

Every repeat runs every scenario at every torch thread count in turn, so drift in the machine's load
hits all alike. `scenarios` runs a subset (`--scenarios cold_1q_off,cold_1q,warm_1q`: the cold question's cost
with the cache on and off, in a fraction of the time). Printed: p50 per scenario and thread count and the ratios
of those that ran (`RATIOS`: `warm_1q / cold_1q_off`, `cold_1q / cold_1q_off`, `five_requests_on /
five_requests_off`, ...). `suffix_breakdown` counts which tokens a question adds after
the state, split into the template's own text and the question's content.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping

from .pipeline import request_of
from .prefix import make_questions, make_state

SCENARIOS = ("cold_1q_off", "cold_1q", "warm_1q", "one_request_5q", "five_requests_off", "five_requests_on")
RATIOS = {"warm_over_cold_off": ("warm_1q", "cold_1q_off"), "warm_over_cold_on": ("warm_1q", "cold_1q"),
          "cold_on_over_off": ("cold_1q", "cold_1q_off"),
          "five_requests_on_over_off": ("five_requests_on", "five_requests_off")}


def suffix_breakdown(encoder: Any, question: Any) -> dict[str, int]:
    """Tokens one question adds after the state (its suffix), split into `template` (what rlcd's frame writes:
    "{type} question: ", "\\nOptions:\\n", each option's "-", marker and newline, a score level's "level i: ",
    a noul option's "false: no" / "true: yes" when the question gives no descriptions) and `content` (the
    request's own text: instructions, choice labels, descriptions). Each segment is tokenised as the encoder
    does; the frame's share of a segment is its tokens minus those of the request's text alone."""
    from ..model.prompt import option_texts, stem_text
    from ..schema import text_of

    enc = encoder._encode
    stem = len(enc([stem_text(question)])[0])
    own = text_of(question.instructions)
    stem_frame = stem - (len(enc([f" {own}"])[0]) if own else 0)
    opts = option_texts(question)
    descs = question.descriptions()
    frame_after = 1 + len(encoder._newline)  # the marker and the newline after it
    options = opts_frame = 0
    for i, o in enumerate(opts):
        n = len(enc([f"- {o}"])[0])
        own = o if question.type == "choice" else ("" if descs[i] is None else text_of(descs[i]))
        options += n + frame_after
        opts_frame += n - (len(enc([f" {own}"])[0]) if own else 0) + frame_after
    template = stem_frame + opts_frame
    return {"suffix": stem + options, "template": template, "content": stem + options - template,
            "stem": stem, "stem_template": stem_frame, "options": len(opts), "option_tokens": options,
            "option_template": opts_frame}


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - t0)


def run_state_cache_bench(predictor: Any, *, threads: tuple[int, ...] = (1, 2), repeats: int = 5,
                          state_tokens: int = 250, seed: int = 0, say: Callable[[str], None] = print,
                          scenarios: tuple[str, ...] = SCENARIOS) -> dict:
    """The scenarios of the module docstring on `predictor`'s model; returns the p50s, ratios and the suffix
    breakdown of the five questions. `threads`: torch thread counts, interleaved per repeat; `scenarios`: the
    ones to run (a ratio is given when both its scenarios ran).

    `predictor` may be a mapping {label: Predictor} (`--dtype float32,bfloat16`: one model per dtype): every
    repeat then runs every label at every thread count in turn, and the result holds each label's result under
    `by_dtype` and, per thread count and scenario, `speedup` = p50 of the first label / p50 of each other."""
    import torch

    unknown = [x for x in scenarios if x not in SCENARIOS]
    if unknown or not scenarios:
        raise ValueError(f"scenarios: {', '.join(unknown) or 'none given'}; choose from {', '.join(SCENARIOS)}")
    scenarios = tuple(x for x in SCENARIOS if x in scenarios)

    from ..predict import Predictor

    many = isinstance(predictor, Mapping)
    labelled = dict(predictor) if many else {"": predictor}
    pairs = {k: (Predictor(p.runner, p.meta, name=p.name, limits=p.limits, state_cache_mb=1024),
                 Predictor(p.runner, p.meta, name=p.name, limits=p.limits, state_cache_mb=0))
             for k, p in labelled.items()}
    five = request_of("x", 5, seed)["questions"]
    qids = list(five)
    one = {q: {"x": five[q]} for q in qids}
    first = next(iter(labelled.values())).model
    times = {k: {s: {t: [] for t in threads} for s in scenarios} for k in labelled}
    old_threads = torch.get_num_threads()
    counter = [0]

    def state() -> str:  # a new state each time, the same length: "cold" is always cold
        counter[0] += 1
        return make_state(first.tokenizer, state_tokens, seed * 1_000_003 + counter[0])

    def req(s: str, qs: dict) -> dict:
        return {"state": s, "questions": qs}

    try:
        for r in range(repeats + 1):  # the first round warms kernels and allocator: not recorded
            for k, (on, off) in pairs.items():
                for t in threads:
                    torch.set_num_threads(t)
                    got: dict[str, float] = {}
                    if "cold_1q_off" in scenarios:
                        got["cold_1q_off"] = _timed(lambda: off.predict(req(state(), one[qids[0]])))
                    s = state()
                    if "cold_1q" in scenarios:
                        got["cold_1q"] = _timed(lambda: on.predict(req(s, one[qids[0]])))
                    if "warm_1q" in scenarios:
                        if "cold_1q" not in scenarios:
                            on.predict(req(s, one[qids[0]]))  # the state stored, untimed
                        got["warm_1q"] = _timed(lambda: on.predict(req(s, one[qids[1]])))
                    if "one_request_5q" in scenarios:
                        got["one_request_5q"] = _timed(lambda: on.predict(req(state(), five)))
                    s = state()
                    if "five_requests_off" in scenarios:
                        got["five_requests_off"] = _timed(lambda: [off.predict(req(s, one[q])) for q in qids])
                    s = state()
                    if "five_requests_on" in scenarios:
                        got["five_requests_on"] = _timed(lambda: [on.predict(req(s, one[q])) for q in qids])
                    if r:
                        for name, v in got.items():
                            times[k][name][t].append(v)
    finally:
        torch.set_num_threads(old_threads)
    results = {}
    for k, (on, _) in pairs.items():
        if many:
            say(f"  dtype {k}:")
        results[k] = _summary(on, labelled[k].name, times[k], threads=threads, repeats=repeats,
                              state_tokens=state_tokens, seed=seed, sample_state=state(), say=say,
                              scenarios=scenarios)
    if not many:
        return results[""]
    labels = list(labelled)
    base = labels[0]
    out: dict[str, Any] = {"model": results[base]["model"], "dtypes": labels, "threads": list(threads),
                           "repeats": repeats, "state_tokens": state_tokens, "by_dtype": results, "speedup": {}}
    for other in labels[1:]:
        out["speedup"][other] = {str(t): {sc: results[base]["p50_ms"][str(t)][sc] / results[other]["p50_ms"][str(t)][sc]
                                          for sc in scenarios} for t in threads}
        for t in threads:
            sp = out["speedup"][other][str(t)]
            say(f"  threads={t}: {base} p50 / {other} p50: " + ", ".join(f"{sc} {v:.2f}x" for sc, v in sp.items()))
    return out


def _summary(on: Any, name: str, times: dict, *, threads: tuple[int, ...], repeats: int, state_tokens: int,
             seed: int, sample_state: str, say: Callable[[str], None], scenarios: tuple[str, ...] = SCENARIOS) -> dict:
    runner = on.runner
    sample = runner.prepare_case(sample_state, [make_questions(5, seed)[0]]).rows[0]
    qids = list(request_of("x", 5, seed)["questions"])
    out: dict[str, Any] = {"model": name, "placement": runner.placement,
                           "state_tokens": state_tokens, "prefix_tokens": sample.prefix_len, "repeats": repeats,
                           "threads": list(threads), "p50_ms": {}, "ratios": {},
                           "suffixes": {q: suffix_breakdown(on.model.encoder, m)
                                        for q, m in zip(qids, make_questions(5, seed))},
                           "cache": on.state_cache_stats()}
    for t in threads:
        p50 = {k: statistics.median(times[k][t]) for k in scenarios}
        out["p50_ms"][str(t)] = p50
        ratios = {name: p50[a] / p50[b] for name, (a, b) in RATIOS.items() if a in p50 and b in p50}
        out["ratios"][str(t)] = ratios
        say(f"  threads={t}: p50 ms " + "  ".join(f"{k}={v:.1f}" for k, v in p50.items()))
        say(f"  threads={t}: " + "; ".join(f"{name} {v:.3f}" for name, v in ratios.items()))
    sizes = out["suffixes"]
    say(f"  prefix {out['prefix_tokens']} tokens; suffix per question: " + ", ".join(
        f"{v['suffix']} ({v['template']} template, {v['content']} content, {v['options']} options)"
        for v in sizes.values()))
    say(f"  cache: {out['cache']['entries']} entries, {out['cache']['bytes'] / (1 << 20):.1f} MiB, "
        f"{out['cache']['bytes'] / max(1, out['cache']['entries']) / (1 << 20):.2f} MiB per state")
    return out


__all__ = ["run_state_cache_bench", "suffix_breakdown", "SCENARIOS"]
