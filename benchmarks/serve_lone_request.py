"""Interleaved A/B of a lone client's 1-question request over HTTP (issue 73): p50 with batching on against off;
then the gain at 16 clients, interleaved the same way.

`rlcd bench serve` runs each mode's load in turn (~20 s each); on a shared 2-core machine the load drifts more
between them than the modes differ, and with batching off in *both* modes it read a 1.33x "ratio". Here the
servers run side by side around one loaded model and one client sends its requests to them in turn, the order
rotating each round, so drift hits every arm alike. Arms: `unbatched` (--batch-window-ms 0), `continuous` (this
tree's batcher, window 4 ms) and, with OLD_BATCHER (a copy of the batcher module before continuous batching:
`git show 9e5f79f:src/rlcd/serving/batcher.py > /tmp/old_batcher.py`), `window` (that batcher, window 4 ms).
Only one request is in flight at a time, so the model threads never compete. Then LOAD_ROUNDS rounds of 16
clients: each round sends `rlcd bench serve`'s plan (48 well-formed requests of 1, 5 and 50 questions, seed 0) to
each arm in turn (rotating order, one arm loaded at a time); decisions/s per arm over all its rounds, and the gain
of each batching arm over `unbatched`.

    .venv/bin/python benchmarks/serve_lone_request.py RUN ROUNDS LOAD_ROUNDS OUT.json [OLD_BATCHER]
"""
import asyncio, importlib.util, json, random, statistics, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import httpx
from rlcd import server as rlcd_server
from rlcd.bench.report import machine_info, save_result
from rlcd.bench.serve import (BackgroundServer, _load, plan_requests, serve_predictor, summarise,
                              synthetic_questions, synthetic_state)
from rlcd.serving.batcher import BatchingConfig

run, rounds, load_rounds, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
old = sys.argv[5] if len(sys.argv) > 5 else None
predictor, limits = serve_predictor(run, (1, 5, 50))
arms = {"unbatched": (rlcd_server.Batcher, BatchingConfig(window_ms=0.0)),
        "continuous": (rlcd_server.Batcher, BatchingConfig(window_ms=4.0))}
if old:
    spec = importlib.util.spec_from_file_location("old_batcher", old)
    mod = sys.modules["old_batcher"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    arms["window"] = (mod.Batcher, mod.BatchingConfig(window_ms=4.0))
apps = {}
for name, (cls, cfg) in arms.items():
    rlcd_server.Batcher = cls  # create_app builds the batcher it names
    apps[name] = rlcd_server.create_app(predictor, limits=limits, batching=cfg)
servers = {k: BackgroundServer(a).start() for k, a in apps.items()}
rng = random.Random(0)
bodies = [{"state": synthetic_state(rng), "questions": synthetic_questions(1, rng)} for _ in range(rounds + 10)]
ms = {k: [] for k in apps}


async def go():
    async with httpx.AsyncClient(timeout=60, trust_env=False) as c:
        names = list(apps)
        for r, body in enumerate(bodies):
            for k in names[r % len(names):] + names[: r % len(names)]:
                t0 = time.perf_counter()
                res = await c.post(servers[k].url + "/v1/systemone", json=body)
                dt = 1000 * (time.perf_counter() - t0)
                assert res.status_code == 200, res.text
                if r >= 10:  # the first rounds warm every arm up
                    ms[k].append(dt)

asyncio.run(go())
stats = {k: a.state.batcher.stats() for k, a in apps.items()}
plan = plan_requests(48, malformed=0.0, sizes=(1, 5, 50), seed=0, max_questions=limits.max_questions)
load = {k: {"decisions": 0, "wall_s": 0.0, "batches0": stats[k]["batches"], "requests0": stats[k]["requests"]}
        for k in apps}
names = list(apps)
for r in range(load_rounds + 1):  # round 0 warms every arm up at this concurrency
    for k in names[r % len(names):] + names[: r % len(names)]:
        results, wall = asyncio.run(_load(servers[k].url, plan, concurrency=16, timeout=120, total_timeout=900))
        s = summarise(results, wall, (1, 5, 50))
        assert s["c5xx"] == s["crashes"] == s["unexpected"] == 0, s
        if r:
            load[k]["decisions"] += s["decisions"]
            load[k]["wall_s"] += wall
        else:
            b = apps[k].state.batcher.stats()
            load[k]["batches0"], load[k]["requests0"] = b["batches"], b["requests"]
for k in apps:
    b = apps[k].state.batcher.stats()
    load[k]["decisions_per_s"] = load[k]["decisions"] / load[k]["wall_s"]
    load[k]["mean_batch"] = (b["requests"] - load[k].pop("requests0")) / max(1, b["batches"] - load[k].pop("batches0"))
for s in servers.values():
    s.stop()
p50 = {k: statistics.median(v) for k, v in ms.items()}
res = {"run": run, "rounds": rounds, "questions": 1, "concurrency": 1, "window_ms": 4.0,
       "p50_ms": p50, "mean_ms": {k: statistics.fmean(v) for k, v in ms.items()},
       "p50_ratio_vs_unbatched": {k: p50[k] / p50["unbatched"] for k in p50},
       "paired_median_ratio_vs_unbatched": {k: statistics.median(a / b for a, b in zip(ms[k], ms["unbatched"]))
                                            for k in ms},
       "mean_batch": {k: s["mean_batch"] for k, s in stats.items()},
       "c16": {"rounds": load_rounds, "requests_per_round": len(plan), "sizes": [1, 5, 50], "arms": load,
               "gain_vs_unbatched": {k: load[k]["decisions_per_s"] / load["unbatched"]["decisions_per_s"]
                                     for k in load}},
       "samples_ms": ms}
cmd = f"python benchmarks/serve_lone_request.py {run} {rounds} {load_rounds} {out}" + (f" {old}" if old else "")
save_result("serve-lone-request", cmd, res, path=out, machine=machine_info())
print(json.dumps({k: v for k, v in res.items() if k != "samples_ms"}, indent=1))
