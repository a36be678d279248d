"""What JevBench's requests cost `rlcd serve` of a run: questions, rows and backbone tokens per request, and where a
request's time goes (in rlcd's venv; the requests from `capture_requests.py`).

    python benchmarks/peers/jevbench/request_cost.py RUN requests.jsonl [--time N] [--as-asked]
        [--state-cache-mb MB]

Counts, over every request (tokenised as the server does, `Predictor.prepare`, no model call): questions, rows
(the questions the model scores: a one-option question runs nothing), the rows' full tokens, and the tokens the
backbone runs in the requests' order: each row's suffix up to its last marker, plus the state's prefix when the
state cache (an LRU of the same byte bound, simulated: 2 x layers x kv heads x head dim x 4 bytes a prefix token)
does not hold it. `repeat_rows`: rows whose exact tokens a request about the same state already ran.

`--time N`: the first N requests answered in process (`prepare`, `score`, `respond` timed; the state cache on as
served) and, right after each, bare decoder forwards of the same shapes as the backbone calls `score` made (random
ids, no cache): `score / bare` is what rlcd adds around the model, whatever else the machine is running at the
time. `--row-cache N --row-cache-mb MB`: the first N requests sent in turn to two Predictors on the one loaded model,
the row cache off and on (`rlcd serve --row-cache-mb`), each with its own state cache: their `score` times and the
largest gap between their answers' probabilities. One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path


def wire(r: dict) -> dict:
    return {"state": r["state"], "questions": r["questions"]}


def count(predictor, requests: list[dict], cache_bytes: int, bytes_per_token: int) -> dict:
    lru: collections.OrderedDict = collections.OrderedDict()
    used, seen_rows = 0, set()
    n = collections.Counter({k: 0 for k in ("requests", "questions", "rows", "row_tokens", "state_hits",
                                            "prefix_tokens_run", "suffix_tokens", "repeat_rows",
                                            "repeat_suffix_tokens")})
    for r in requests:
        prep = predictor.prepare(wire(r))
        n["requests"] += 1
        n["questions"] += len(r["questions"])
        if prep.case is None:
            continue
        rows = prep.case.rows
        cut = min(x.prefix_len for x in rows)
        key = tuple(rows[0].ids[:cut])
        n["rows"] += len(rows)
        n["row_tokens"] += sum(len(x) for x in rows)
        if key in lru:
            lru.move_to_end(key)
            n["state_hits"] += 1
        else:
            n["prefix_tokens_run"] += cut
            size = cut * bytes_per_token
            while lru and used + size > cache_bytes:
                used -= lru.popitem(last=False)[1]
            if size <= cache_bytes:
                lru[key] = size
                used += size
        for x in rows:
            run = x.marker_pos[-1] + 1
            n["suffix_tokens"] += run - cut
            rk = (key, tuple(x.ids[cut:run]))
            if rk in seen_rows:
                n["repeat_rows"] += 1
                n["repeat_suffix_tokens"] += run - cut
            seen_rows.add(rk)
    req = max(1, n["requests"])
    run_now = n["prefix_tokens_run"] + n["suffix_tokens"]
    return {**n, "questions_per_request": round(n["questions"] / req, 2),
            "backbone_tokens_per_request": round(run_now / req, 1),
            "backbone_tokens_per_request_without_repeat_rows": round((run_now - n["repeat_suffix_tokens"]) / req, 1),
            "state_hit_rate": round(n["state_hits"] / req, 3),
            "repeat_row_rate": round(n["repeat_rows"] / max(1, n["rows"]), 3)}


def timed(predictor, requests: list[dict]) -> dict:
    import torch

    model = predictor.model
    decoder = model.family.text_decoder(model.causal_lm())
    shapes: list = []
    lm = model.decoder_forward

    def counted(ids, *a, **k):
        shapes.append(tuple(ids.shape))
        return lm(ids, *a, **k)

    model.decoder_forward = counted

    def bare(shape) -> float:
        ids = torch.randint(100, 1000, shape)
        with torch.inference_mode():
            t = time.perf_counter()
            decoder(input_ids=ids, use_cache=False)
            return time.perf_counter() - t

    per = []
    try:
        for r in requests:
            shapes.clear()
            t0 = time.perf_counter()
            prep = predictor.prepare(wire(r))
            t1 = time.perf_counter()
            logits, usage = predictor.score(prep)
            t2 = time.perf_counter()
            predictor.respond(prep, logits, usage)
            t3 = time.perf_counter()
            calls = list(shapes)
            b = sum(bare(s) for s in calls)
            per.append({"questions": len(r["questions"]), "calls": calls, "tokens": sum(x * y for x, y in calls),
                        "cached_prefix": usage.get("cached_tokens", 0), "prepare_s": round(t1 - t0, 4),
                        "score_s": round(t2 - t1, 3), "respond_s": round(t3 - t2, 4), "bare_s": round(b, 3),
                        "score_over_bare": round((t2 - t1) / b, 3) if b else None})
    finally:
        model.decoder_forward = lm
    ratios = [p["score_over_bare"] for p in per if p["score_over_bare"]]
    return {"requests": per, "median_score_over_bare": statistics.median(ratios) if ratios else None,
            "mean_score_s": round(statistics.mean(p["score_s"] for p in per), 3),
            "mean_prepare_s": round(statistics.mean(p["prepare_s"] for p in per), 4),
            "threads": torch.get_num_threads()}


def row_cache_ab(predictor, requests: list[dict], mb: float) -> dict:
    import torch

    from rlcd.predict import Predictor

    off = Predictor(predictor.model, predictor.meta, name=predictor.name, canonical=predictor.canonical,
                    state_cache_mb=predictor.state_cache_stats()["max_bytes"] / (1 << 20))
    on = Predictor(predictor.model, predictor.meta, name=predictor.name, canonical=predictor.canonical,
                   state_cache_mb=predictor.state_cache_stats()["max_bytes"] / (1 << 20), row_cache_mb=mb)
    times, gap = {"off": 0.0, "on": 0.0}, 0.0
    for r in requests:
        got = {}
        for name, p in (("off", off), ("on", on)):
            prep = p.prepare(wire(r))
            t = time.perf_counter()
            got[name], _ = p.score(prep)
            times[name] += time.perf_counter() - t
        for a, b in zip(got["off"], got["on"]):
            gap = max(gap, float((torch.softmax(a.double(), -1) - torch.softmax(b.double(), -1)).abs().max()))
    return {"requests": len(requests), "row_cache_mb": mb, "score_s_off": round(times["off"], 4),
            "score_s_on": round(times["on"], 4), "on_over_off": round(times["on"] / times["off"], 3),
            "max_probability_gap": gap, "rows": on.row_cache_stats(), "states_on": on.state_cache_stats(),
            "states_off": off.state_cache_stats()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("requests", type=Path)
    ap.add_argument("--time", type=int, default=0, help="time the first N requests in process")
    ap.add_argument("--as-asked", action="store_true", help="canonical requests off (rlcd serve --as-asked)")
    ap.add_argument("--row-cache", type=int, default=0, help="the first N requests with the row cache off and on")
    ap.add_argument("--row-cache-mb", type=float, default=64.0, help="the row cache's size for --row-cache")
    ap.add_argument("--state-cache-mb", type=float, default=None, help="default: the server's")
    args = ap.parse_args()
    from rlcd.predict import DEFAULT_STATE_CACHE_MB, Predictor
    from rlcd.serving.state_encoding import state_cache_bytes

    mb = DEFAULT_STATE_CACHE_MB if args.state_cache_mb is None else args.state_cache_mb
    predictor = Predictor.from_run(args.run, canonical=not args.as_asked, state_cache_mb=mb)
    requests = [json.loads(line) for line in args.requests.open()]
    cfg = predictor.model.family.text_decoder(predictor.model.causal_lm()).config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * getattr(cfg, "num_key_value_heads", cfg.num_attention_heads) * head_dim * 4
    out = {"run": str(args.run), "requests_file": str(args.requests), "canonical": not args.as_asked,
           "state_cache_mb": mb, "state_bytes_per_token": per_token,
           "count": count(predictor, requests, state_cache_bytes(mb), per_token)}
    if args.time:
        predictor.clear_state_cache()
        out["timed"] = timed(predictor, requests[: args.time])
    if args.row_cache:
        out["row_cache"] = row_cache_ab(predictor, requests[: args.row_cache], args.row_cache_mb)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
