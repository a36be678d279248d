"""`rlcd bench batch RUN`: rows/s of offline scoring four ways on one machine, in one interleaved run.

The rows are a processed split's records (default: the run's test split), one question each. Arms, each round
in this order, `rounds` rounds:

* `http`: one HTTP request per state (all of its questions in it, as a client would send them) against
  `rlcd serve RUN` (a separate process, started once before the first round, model loaded and warmed; its
  start is not timed), sequential, on one keep-alive connection, `--batch-window-ms 0`;
* `local`: `rlcd predict RUN --input FILE --output FILE` in one process (the file: one request per row);
* `ray_N`: the same with `--ray --num-actors N --cpus-per-actor 1` (a local Ray cluster started by the job).

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

    def __init__(self, python: str, run: Path, threads: int, timeout: float = 300):
        import socket

        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([python, "-m", "rlcd.cli", "serve", str(run), "--port", str(self.port),
                                      "--quiet", "--batch-window-ms", "0", "--device", "cpu"], env=_env(threads),
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


# ------------------------------------------------------------------------------------------------ the bench
def run_batch_bench(run: Path, *, data: Path | None = None, splits: tuple[str, ...] = ("test",),
                    rows: int | None = None, rounds: int = 2, actors: tuple[int, ...] = (1, 2), threads: int = 1,
                    chunk_rows: int = 8, batch_size: int = 16, python: str | None = None, timeout: float = 600,
                    say: Callable[[str], None] = print) -> dict[str, Any]:
    """The arms of the module docstring, interleaved over `rounds`; returns per-arm runs, medians and the
    projection. `python`: the interpreter of the processes (default: this one; it needs ray for the Ray arms)."""
    from ..run import Run

    python = python or sys.executable
    run = Path(run)
    data = Path(data) if data is not None else Run(run).data_dir
    arms = ["http", "local", *(f"ray_{n}" for n in actors)]
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="rlcd-bench-batch-") as tmp:
        tmp = Path(tmp)
        src, per_state, n_rows = bench_inputs(data, splits, rows, tmp)
        say(f"batch bench: {n_rows} rows ({len(per_state)} states) from {data} {','.join(splits)}; "
            f"{rounds} rounds of {', '.join(arms)}; {threads} thread(s) a process")
        job = ["--chunk-rows", str(chunk_rows), "--batch-size", str(batch_size)]
        server = Server(python, run, threads)
        try:
            for r in range(rounds):
                for arm in arms:
                    if arm == "http":
                        got = http_arm(server, per_state, n_rows, timeout)
                    elif arm == "local":
                        got = job_arm(python, run, src, tmp / "local.jsonl", job, threads, timeout)
                    else:
                        n = int(arm.split("_")[1])
                        got = job_arm(python, run, src, tmp / f"{arm}.jsonl",
                                      [*job, "--ray", "--num-actors", str(n), "--cpus-per-actor", "1"], threads, timeout)
                    got["round"] = r
                    runs[arm].append(got)
                    steady = got["scoring_rows_per_s"]
                    cpu = got["rows_per_cpu_s"]
                    say(f"  round {r} {arm}: {got['rows_per_s']:.2f} rows/s end to end ({got['wall_s']:.1f} s), "
                        f"{'-' if cpu is None else f'{cpu:.2f}'} rows per CPU-second, "
                        f"scoring {'-' if steady is None else f'{steady:.2f}'} rows/s, peak RSS "
                        f"{got['peak_rss_mib']:.0f} MiB ({got['processes']} processes)")
        finally:
            server.stop()
    median = {a: {k: statistics.median(x[k] for x in runs[a]) if all(x[k] is not None for x in runs[a]) else None
                  for k in ("rows_per_s", "scoring_rows_per_s", "rows_per_cpu_s", "wall_s", "peak_rss_mib")} for a in arms}
    out: dict[str, Any] = {"run": str(run), "rows": n_rows, "states": len(per_state), "splits": list(splits),
                           "rounds": rounds, "threads": threads, "chunk_rows": chunk_rows, "batch_size": batch_size,
                           "cpus": os.cpu_count(), "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg()), "arms": arms, "median": median, "runs": runs}
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
    if "projection" in out:
        p = out["projection"]
        say("projection (not measured): " + ", ".join(f"{n} actors {v:.1f} rows/s" for n, v in p["rows_per_s"].items()))
    return out


__all__ = ["run_batch_bench", "bench_inputs", "tree_rss", "PeakRss", "PROJECTED_ACTORS"]
