"""`rlcd bench batch RUN`: rows/s of offline scoring several ways on one machine, in one interleaved run.

The rows are a processed split's records (default: the run's test split), one question each. Arms, each round
in this order, `rounds` rounds:

* `http`: one HTTP request per state (all of its questions in it, as a client would send them) against
  `rlcd serve RUN` (a separate process, started once before the first round, model loaded and warmed; its
  start is not timed), sequential, on one keep-alive connection, `--batch-window-ms 0`;
* `local`: `rlcd predict RUN --input FILE --output FILE` in one process (the file: one request per row; the job
  packs each window's rows about one state into one case, `rlcd.batch.packing`);
* `local_Nt`: the same at N = (largest actor count) x threads torch threads: what the Ray arm with that many
  single-thread actors is compared with, end to end;
* `ray_N`: the same with `--ray --num-actors N --cpus-per-actor 1` (a local Ray cluster started by the job);
* `floor`: in this process, the decoder's own forwards of the same shapes and nothing else -- per state, its
  prefix once (1 x p tokens) and then its rows' suffixes on that cache (n x s, to each row's last marker, at most
  64 rows a call) -- no plan, no head, no JSON, no process: the work no path can skip, as rows per CPU-second.
  Text decoders (a keys-and-values cache) only.

After the rounds, `singles` rows are each sent alone to the server (not timed) and every job arm's answers to them
are compared: `max_dp_vs_single`, the largest |p_job - p_single| over their options (noul: P(true)).

Every process runs with `OMP_NUM_THREADS=threads` and `--threads threads`. Per arm and round: `wall_s` (the
process from spawn to exit, with imports, model loading and for Ray the cluster's start; for `http`, the
requests), `rows_per_s` = rows / wall_s, `scoring_rows_per_s` (the job's own `scoring_rows_per_s`: rows over
the time from its model(s) loaded to the last row scored -- for Ray, the first actor call's start to the last
one's end --, so start-up excluded; for `http`, the same as `rows_per_s`: the server was loaded and warm) and
`rows_per_cpu_s`: rows over the CPU seconds the scoring took (the job's `rows_per_cpu_s`: the scoring
process's, or the actors' summed, over the scoring span; for `http`, the server process's over the requests),
which the machine's other load does not change much, and `peak_rss_mib`: the largest sum of resident memory over the process and all its descendants (Ray's GCS,
raylet and workers included), sampled every 0.2 s (for `http`: the server's, over its life). The result
gives the median over rounds, and the machine's load average before and after (the CPUs may be shared).

The projection is arithmetic, not a measurement: the smallest Ray arm's rows per CPU-second per actor times N
actors, i.e. what N single-thread actors would do, each on a core of this machine to itself, if nothing else
limited them.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

PAGE = os.sysconf("SC_PAGE_SIZE")
PROJECTED_ACTORS = (1, 2, 4, 8, 16)


# ------------------------------------------------------------------------------------------------ memory
def _tree(root: int) -> list[int]:
    """`root` and its descendants, from /proc/*/stat's parent ids."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def tree_rss(root: int) -> tuple[int, int]:
    """(bytes resident, processes) of `root`'s process tree now."""
    total, n = 0, 0
    for pid in _tree(root):
        try:
            with open(f"/proc/{pid}/statm") as fh:
                total += int(fh.read().split()[1]) * PAGE
            n += 1
        except OSError:
            continue
    return total, n


class PeakRss:
    """Samples `tree_rss(pid)` every `every_s` seconds in a thread; `peak` bytes, `processes` at most."""

    def __init__(self, pid: int, every_s: float = 0.2):
        self.pid, self.every_s = pid, every_s
        self.peak = self.processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, n = tree_rss(self.pid)
            self.peak, self.processes = max(self.peak, rss), max(self.processes, n)
            self._stop.wait(self.every_s)

    def stop(self) -> "PeakRss":
        self._stop.set()
        self._thread.join()
        return self


# ------------------------------------------------------------------------------------------------ inputs
def bench_inputs(data: Path, splits: tuple[str, ...], rows: int | None, out: Path) -> tuple[Path, list[dict], int]:
    """The rows as a JSONL file of requests (one per record, id = record id) and the same rows as one request per
    state (for `http`); returns (file, per-state requests, rows)."""
    from ..batch.io import split_request
    from ..data.io import load_split

    records = [r for s in splits for r in load_split(data, s)]
    if rows is not None:
        records = records[:rows]
    if any(r.image for r in records):
        raise ValueError("the batch bench reads text states only")
    path = out / "requests.jsonl"
    per_state: dict[str, dict] = {}
    with open(path, "w", encoding="utf-8") as fh:
        for rec in records:
            req = split_request(rec)
            fh.write(json.dumps({"id": rec.id, **req}, ensure_ascii=False) + "\n")
            key = json.dumps(rec.state, sort_keys=True, ensure_ascii=False)
            grouped = per_state.setdefault(key, {"state": rec.state, "questions": {}})
            grouped["questions"][f"q{len(grouped['questions'])}"] = req["questions"]["q1"]
    return path, list(per_state.values()), len(records)


# ------------------------------------------------------------------------------------------------ arms
def _env(threads: int) -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": os.pathsep.join(
        [src, *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])])}


def job_arm(python: str, run: Path, src: Path, out: Path, extra: list[str], threads: int, timeout: float) -> dict:
    """`rlcd predict RUN --input src --output out EXTRA` as a process: wall, peak tree RSS, its summary."""
    for p in (out, out.with_name(out.name + ".rejects.jsonl")):
        p.unlink(missing_ok=True)
    cmd = [python, "-m", "rlcd.cli", "predict", str(run), "--input", str(src), "--output", str(out), "--quiet",
           "--threads", str(threads), "--device", "cpu", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=_env(threads), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rss = PeakRss(proc.pid)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        rss.stop()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {stderr[-2000:]}")
    summary = json.loads(stdout)
    return {"wall_s": wall, "rows": summary["rows"], "answered": summary["answered"],
            "rows_per_s": summary["rows"] / wall, "scoring_rows_per_s": summary["scoring_rows_per_s"],
            "rows_per_cpu_s": summary["rows_per_cpu_s"],
            "job_seconds": summary["seconds"], "peak_rss_mib": rss.peak / 2 ** 20, "processes": rss.processes}


class Server:
    """`rlcd serve RUN` on a free loopback port, ready (model loaded, warm-up answered), RSS sampled all along."""

    def __init__(self, python: str, run: Path, threads: int, timeout: float = 300, dtype: str = "auto"):
        import socket

        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([python, "-m", "rlcd.cli", "serve", str(run), "--port", str(self.port),
                                      "--quiet", "--batch-window-ms", "0", "--device", "cpu", "--dtype", dtype],
                                     env=_env(threads),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.rss = PeakRss(self.proc.pid)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rlcd serve exited {self.proc.returncode}: {self.proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=5, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("rlcd serve was not ready in time")
            time.sleep(0.5)

    def stop(self) -> None:
        self.rss.stop()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used, all its threads."""
    with open(f"/proc/{pid}/stat", "rb") as fh:
        stat = fh.read()
    fields = stat[stat.rindex(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def http_arm(server: Server, requests: list[dict], rows: int, timeout: float) -> dict:
    """One request per state, sequential, one keep-alive connection."""
    import httpx

    times = []
    cpu0 = process_cpu(server.proc.pid)
    with httpx.Client(base_url=server.url, timeout=timeout, trust_env=False) as client:
        t0 = time.perf_counter()
        for req in requests:
            r = client.post("/v1/systemone", json=req)
            if r.status_code != 200 or len(r.json()["answers"]) != len(req["questions"]):
                raise RuntimeError(f"rlcd serve answered {r.status_code}: {r.text[:300]}")
            times.append(time.perf_counter())
    wall, cpu = times[-1] - t0, process_cpu(server.proc.pid) - cpu0
    return {"rows_per_cpu_s": rows / cpu if cpu > 0 else None, "wall_s": wall, "rows": rows, "answered": rows, "requests": len(requests), "rows_per_s": rows / wall,
            "scoring_rows_per_s": rows / wall, "peak_rss_mib": server.rss.peak / 2 ** 20, "processes": server.rss.processes}


def floor_arm(model: Any, requests: list[dict], threads: int, max_rows: int = 64) -> dict:
    """The `floor` arm (module docstring) on `model` (a loaded `DecisionModel`): the bare decoder forwards of each
    state's prefix and its rows' suffixes, timed by this process's CPU and wall clock."""
    import torch

    torch.set_num_threads(threads)
    dec = model.family.text_decoder(model.causal_lm())
    cases = [model_rows(model, req) for req in requests]
    n_rows = sum(len(c) for c in cases)
    t0, c0 = time.perf_counter(), time.process_time()
    for rows in cases:
        state_forwards(model, dec, rows, max_rows)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"rows": n_rows, "answered": n_rows, "wall_s": wall, "rows_per_s": n_rows / wall,
            "scoring_rows_per_s": n_rows / wall, "rows_per_cpu_s": n_rows / cpu if cpu > 0 else None,
            "peak_rss_mib": tree_rss(os.getpid())[0] / 2 ** 20, "processes": 1}


def state_forwards(model: Any, dec: Any, rows: list[Any], max_rows: int = 64) -> list[Any]:
    """One state's bare forwards: its prefix once, then its rows' suffixes (to each row's last marker) on copies of
    that cache, `max_rows` a call. Returns each call's last hidden states [n, s, H] (a suffix position j is row
    token p + j, p = `model.plan.shared_prefix_len(rows)`: their common prefix, up to a decision token)."""
    import torch

    from ..model.families.base import cache_kwarg, out_cache
    from ..model.plan import shared_prefix_len

    dev = model.device
    with torch.inference_mode():
        p = shared_prefix_len(rows)
        cache = out_cache(dec(input_ids=torch.tensor([rows[0].ids[:p]], device=dev), use_cache=True))
        out = []
        for c in range(0, len(rows), max_rows):
            chunk = rows[c: c + max_rows]
            suf = [r.ids[p: r.marker_pos[-1] + 1] for r in chunk]
            s_max = max(len(x) for x in suf)
            sids = torch.full((len(chunk), s_max), model.encoder.pad_id, dtype=torch.long, device=dev)
            mask = torch.zeros((len(chunk), p + s_max), dtype=torch.long, device=dev)
            mask[:, :p] = 1
            for i, x in enumerate(suf):
                sids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
                mask[i, p: p + len(x)] = 1
            out.append(dec(input_ids=sids, attention_mask=mask, use_cache=True,
                           **{cache_kwarg(dec): _repeated(cache, len(chunk))}).last_hidden_state)
    return out


def _repeated(cache: Any, n: int) -> Any:
    """A copy of a one-row DynamicCache with its row repeated n times (the suffix call appends to its own)."""
    import copy

    out = copy.copy(cache)
    out.layers = []
    for layer in cache.layers:
        new = copy.copy(layer)
        new.keys = layer.keys.expand(n, *layer.keys.shape[1:]).contiguous()
        new.values = layer.values.expand(n, *layer.values.shape[1:]).contiguous()
        out.layers.append(new)
    return out


def model_rows(model: Any, request: dict) -> list[Any]:
    """A per-state request's rows as the engine renders them (canonical forms, the model's prompt frame)."""
    from ..serving.canonical import asked_forms
    from ..serving.limits import Limits
    from ..serving.request import parse_request

    parsed = parse_request(request, Limits(), served=(), strict_model=False, takes_images=False)
    _, asking = asked_forms(parsed.questions, True)
    from ..model.cases import CaseEncoder

    return CaseEncoder.for_model(model).rows(parsed.state, [q for q in asking if q.k > 1])


def answer_diff(got: dict, want: dict) -> float:
    """Largest |p_got - p_want| over every question's options (noul: P(true)) of two System One responses."""
    worst = 0.0
    for qid, w in want["answers"].items():
        g = got["answers"][qid]
        if w["type"] == "noul":
            worst = max(worst, abs(g["noul"] - w["noul"]))
        else:
            worst = max(worst, max(abs(g["probabilities"][k] - w["probabilities"][k]) for k in w["probabilities"]))
    return worst


def singles(server: Server, src: Path, n: int, timeout: float) -> dict[str, dict]:
    """The first `n` rows of the input file, each sent alone to the server: {id: response}."""
    import httpx

    out = {}
    with httpx.Client(base_url=server.url, timeout=timeout, trust_env=False) as client, open(src) as fh:
        for line in list(fh)[:n]:
            obj = json.loads(line)
            r = client.post("/v1/systemone", json={k: v for k, v in obj.items() if k != "id"})
            r.raise_for_status()
            out[obj["id"]] = r.json()
    return out


# ------------------------------------------------------------------------------------------------ the bench
def run_batch_bench(run: Path, *, data: Path | None = None, splits: tuple[str, ...] = ("test",),
                    rows: int | None = None, rounds: int = 2, actors: tuple[int, ...] = (1, 2), threads: int = 1,
                    chunk_rows: int = 256, batch_size: int = 16, python: str | None = None, timeout: float = 1800,
                    floor: bool = True, n_singles: int = 200, dtype: str = "float32", only: tuple[str, ...] = (),
                    say: Callable[[str], None] = print) -> dict[str, Any]:
    """The arms of the module docstring, interleaved over `rounds`; returns per-arm runs, medians and the
    projection. `python`: the interpreter of the processes (default: this one; it needs ray for the Ray arms)."""
    from ..run import Run

    python = python or sys.executable
    run = Path(run)
    data = Path(data) if data is not None else Run(run).data_dir
    wide = max(actors) * threads if actors and max(actors) > 1 else None
    arms = ["http", "local", *([f"local_{wide}t"] if wide else []), *(f"ray_{n}" for n in actors),
            *(["floor"] if floor else [])]
    if only:
        unknown = sorted(set(only) - set(arms))
        if unknown:
            raise ValueError(f"no arm {', '.join(unknown)}: the arms are {', '.join(arms)}")
        arms = [a for a in arms if a in only]
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="rlcd-bench-batch-") as tmp:
        tmp = Path(tmp)
        src, per_state, n_rows = bench_inputs(data, splits, rows, tmp)
        say(f"batch bench: {n_rows} rows ({len(per_state)} states) from {data} {','.join(splits)}; "
            f"{rounds} rounds of {', '.join(arms)}; {threads} thread(s) a process, {dtype}")
        job = ["--chunk-rows", str(chunk_rows), "--batch-size", str(batch_size), "--dtype", dtype]
        model = None
        if floor:  # loaded once, not timed
            from ..device import Placement
            from ..export import load_export

            model = load_export(run, placement=Placement("cpu", dtype, "the bench's --dtype"))[0]
        server = Server(python, run, threads, dtype=dtype)  # also answers the singles
        outputs: dict[str, Path] = {}
        try:
            for r in range(rounds):
                for arm in arms:
                    if arm == "http":
                        got = http_arm(server, per_state, n_rows, timeout)
                    elif arm == "floor":
                        got = floor_arm(model, per_state, threads)
                    elif arm.startswith("local"):
                        n = wide if arm != "local" else threads
                        outputs[arm] = tmp / f"{arm}.jsonl"
                        got = job_arm(python, run, src, outputs[arm], job, n, timeout)
                    else:
                        n = int(arm.split("_")[1])
                        outputs[arm] = tmp / f"{arm}.jsonl"
                        got = job_arm(python, run, src, outputs[arm],
                                      [*job, "--ray", "--num-actors", str(n), "--cpus-per-actor", "1"], threads, timeout)
                    got["round"] = r
                    runs[arm].append(got)
                    steady = got["scoring_rows_per_s"]
                    cpu = got["rows_per_cpu_s"]
                    say(f"  round {r} {arm}: {got['rows_per_s']:.2f} rows/s end to end ({got['wall_s']:.1f} s), "
                        f"{'-' if cpu is None else f'{cpu:.2f}'} rows per CPU-second, "
                        f"scoring {'-' if steady is None else f'{steady:.2f}'} rows/s, peak RSS "
                        f"{got['peak_rss_mib']:.0f} MiB ({got['processes']} processes)")
            single = singles(server, src, n_singles, timeout) if n_singles else {}
            agree = {}
            for arm, path in outputs.items():
                from ..batch.io import read_output

                got_by_id = {a["id"]: a for a in read_output(path)}
                agree[arm] = max((answer_diff(got_by_id[i], w) for i, w in single.items()), default=None)
        finally:
            server.stop()
    median = {a: {k: statistics.median(x[k] for x in runs[a]) if all(x[k] is not None for x in runs[a]) else None
                  for k in ("rows_per_s", "scoring_rows_per_s", "rows_per_cpu_s", "wall_s", "peak_rss_mib")} for a in arms}
    out: dict[str, Any] = {"run": str(run), "rows": n_rows, "states": len(per_state), "splits": list(splits),
                           "rounds": rounds, "threads": threads, "dtype": dtype, "chunk_rows": chunk_rows,
                           "batch_size": batch_size, "cpus": os.cpu_count(), "loadavg_before": list(load_before),
                           "loadavg_after": list(os.getloadavg()), "arms": arms, "median": median, "runs": runs,
                           "singles": len(single), "max_dp_vs_single": agree}

    def ratio(a: str, b: str, key: str) -> float | None:
        x, y = median.get(a, {}).get(key), median.get(b, {}).get(key)
        return x / y if x and y else None

    out["ratios"] = {"local_over_http_rows_per_cpu_s": ratio("local", "http", "rows_per_cpu_s"),
                     "local_over_floor_rows_per_cpu_s": ratio("local", "floor", "rows_per_cpu_s"),
                     "http_over_floor_rows_per_cpu_s": ratio("http", "floor", "rows_per_cpu_s")}
    if wide:
        out["ratios"][f"ray_{max(actors)}_over_local_{wide}t_rows_per_s"] = ratio(f"ray_{max(actors)}",
                                                                               f"local_{wide}t", "rows_per_s")
        out["ratios"][f"ray_{max(actors)}_over_local_{wide}t_scoring_rows_per_s"] = ratio(
            f"ray_{max(actors)}", f"local_{wide}t", "scoring_rows_per_s")
    base = median.get(f"ray_{min(actors)}", {}).get("scoring_rows_per_s") if actors else None
    per_cpu = median.get(f"ray_{min(actors)}", {}).get("rows_per_cpu_s") if actors else None
    if base and per_cpu:
        out["projection"] = {
            "label": f"PROJECTION, not a measurement: rows per CPU-second of a ray_{min(actors)} actor ({threads} "
                     "thread) x actors, i.e. N actors each with a core of this machine to itself and nothing "
                     "else (input, output, the driver) limiting",
            "rows_per_cpu_s_per_actor": per_cpu,
            "rows_per_s": {str(n): per_cpu * n for n in PROJECTED_ACTORS}}
        if len(actors) > 1:
            top = median[f"ray_{max(actors)}"]["scoring_rows_per_s"]
            out["measured_scaling"] = {f"ray_{max(actors)}_over_ray_{min(actors)}": (top / base) if top else None}
    for a in arms:
        m = median[a]
        say(f"{a}: median {m['rows_per_s']:.2f} rows/s end to end, "
            f"{'-' if m['rows_per_cpu_s'] is None else format(m['rows_per_cpu_s'], '.2f')} rows per CPU-second, scoring "
            f"{'-' if m['scoring_rows_per_s'] is None else format(m['scoring_rows_per_s'], '.2f')} rows/s, "
            f"peak RSS {m['peak_rss_mib']:.0f} MiB")
    say("ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in out["ratios"].items() if v is not None))
    say("max |p_job - p_single| over " + f"{len(single)} rows: " + ", ".join(
        f"{a} {'-' if v is None else f'{v:.2e}'}" for a, v in agree.items()))
    if "projection" in out:
        p = out["projection"]
        say("projection (not measured): " + ", ".join(f"{n} actors {v:.1f} rows/s" for n, v in p["rows_per_s"].items()))
    return out


__all__ = ["run_batch_bench", "bench_inputs", "floor_arm", "state_forwards", "answer_diff", "tree_rss", "PeakRss",
           "PROJECTED_ACTORS"]
