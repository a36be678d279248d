"""`rlcd bench onnx RUN`: the portable export (fp32, int8 blockwise, int8 dynamic) against torch, with parity;
`rlcd bench onnx RUN --export DIR --http`: the two servers over HTTP at equal threads (`run_onnx_http_bench`).

One run measures, on the run's test split, the rows/s of the torch path (`case_scoring.score_records` on the
export rebuilt on the CPU in float32: what `rlcd predict` serves) and of onnxruntime on each graph
(`PortableModel`, what `rlcd serve --export` runs), at each thread count asked (intra-op threads for both
engines; default 1): one warm-up each, then `repeats` rounds in which every engine runs once in turn (a change
in the machine's load hits all alike), best time kept. Each ONNX row carries its parity against torch
(`portable.parity`: flips, max |dp|, NLL and ECE deltas) and its time ratio to torch measured in the same run.
The fp32 graph comes from `export_onnx` with the gate opened (`max_flips=1`): a bench reports, it does not refuse.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from rlcd.run import Run

SCHEMES = ("int8", "int8-dynamic")


def _interleaved(engines: dict[str, Callable[[], Any]], repeats: int) -> tuple[dict[str, float], dict[str, Any]]:
    """One warm-up each, then `repeats` rounds running every engine once in turn; per engine its best time and
    output. Taking turns spreads a change in the machine's load (other processes) over every engine alike."""
    got = {name: fn() for name, fn in engines.items()}
    best = {name: float("inf") for name in engines}
    for _ in range(repeats):
        for name, fn in engines.items():
            t0 = time.perf_counter()
            got[name] = fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best, got


def run_onnx_bench(run: Path | str, *, threads: Sequence[int] = (1,), repeats: int = 3, export: Path | None = None,
                   say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """`export`: an fp32 portable export of `run` to measure instead of exporting one (the export takes minutes on a
    real backbone); its manifest must name the run's checkpoint."""
    import torch

    from rlcd.export import load_export
    from rlcd.portable.exporter import export_onnx, onnx_logits, parity_rows, quantize_graph, test_records, torch_logits
    from rlcd.portable.parity import compare
    from rlcd.errors import OptionError
    from rlcd.portable.runtime import PortableModel, read_manifest

    run = run if isinstance(run, Run) else Run.open(run)
    records = test_records(run)
    rows = parity_rows(records)
    model, meta = load_export(run.export_dir)
    temps = meta["temperatures"]
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rlcd-bench-onnx-") as tmp:
        if export is None:
            fp32 = Path(tmp) / "fp32"
            say("bench onnx: exporting fp32")
            export_onnx(run, fp32, max_flips=1.0)
        else:
            fp32 = Path(export)
            found = read_manifest(fp32)
            if found["graph"]["precision"] != "float32" or \
                    found["source"].get("checkpoint_sha256") != meta.get("checkpoint_sha256"):
                raise OptionError(f"--export {fp32}: not an fp32 portable export of {run.root}'s export/")
        graphs = {"float32": str(fp32 / "model.onnx")}
        for scheme in SCHEMES:
            say(f"bench onnx: quantizing {scheme}")
            graphs[scheme] = str(Path(tmp) / f"model.{scheme}.onnx")
            quantize_graph(fp32 / "model.onnx", Path(graphs[scheme]), scheme)
        sizes = {name: Path(g).stat().st_size for name, g in graphs.items()}
        was = torch.get_num_threads()
        try:
            for n in threads:
                torch.set_num_threads(int(n))
                engines: dict[str, Callable[[], Any]] = {"torch": lambda: torch_logits(model, records)}
                for name, graph in graphs.items():
                    pm = PortableModel(fp32, threads=int(n), graph=graph)
                    engines[name] = (lambda pm=pm: onnx_logits(pm, records))
                say(f"bench onnx: {', '.join(engines)} in turn, {n} thread(s), {repeats} timed passes each")
                times, got = _interleaved(engines, repeats)
                ref = got["torch"]
                out.append({"engine": "torch", "precision": "float32", "threads": n, "seconds": times["torch"],
                            "rows_per_s": len(records) / times["torch"], "speedup_vs_torch": 1.0})
                for name in graphs:
                    p = compare(rows, ref, got[name], temps, resamples=200)
                    out.append({"engine": "onnxruntime", "precision": name, "threads": n, "seconds": times[name],
                                "rows_per_s": len(records) / times[name], "speedup_vs_torch": times["torch"] / times[name],
                                "graph_mb": sizes[name] / 2**20, "flips": p["flips"], "flip_rate": p["flip_rate"],
                                "max_abs_dp": p["max_abs_dp"], "nll_delta": p["nll"]["delta"],
                                "ece_delta": p["ece"]["delta"]})
        finally:
            torch.set_num_threads(was)
    return {"run": str(run.root), "model": meta.get("model"), "test_rows": len(records), "repeats": repeats,
            "load_average": os.getloadavg(), "rows": out}


def table(result: dict[str, Any]) -> str:
    """The result as aligned text lines (stdout of the command)."""
    head = f"{'engine':<12} {'precision':<13} {'thr':>3} {'rows/s':>9} {'x torch':>8} {'MB':>7} {'flips':>7} " \
           f"{'max|dp|':>9} {'dNLL':>10} {'dECE':>10}"
    lines = [f"{result['model']}: {result['test_rows']} test rows, best of {result['repeats']}", head]
    for r in result["rows"]:
        extra = (f"{r['graph_mb']:>7.1f} {r['flips']:>7} {r['max_abs_dp']:>9.2g} {r['nll_delta']:>+10.2g} "
                 f"{r['ece_delta']:>+10.2g}") if r["engine"] != "torch" else f"{'':>7} {'':>7} {'':>9} {'':>10} {'':>10}"
        lines.append(f"{r['engine']:<12} {r['precision']:<13} {r['threads']:>3} {r['rows_per_s']:>9.1f} "
                     f"{r['speedup_vs_torch']:>8.2f} {extra}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- over HTTP
def _serve_cmd(args: Sequence[str]) -> list[str]:
    import sys

    return [sys.executable, "-m", "rlcd.cli", "serve", *args]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Server:
    """`rlcd serve ...` in a child process on a loopback port, as a user starts it; one keep-alive connection."""

    def __init__(self, name: str, args: Sequence[str], log: Path):
        import subprocess

        self.name, self.port = name, _free_port()
        self.log = open(log, "w")
        self.proc = subprocess.Popen(_serve_cmd([*args, "--port", str(self.port), "--quiet"]), stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.conn: Any = None

    def wait_ready(self, timeout: float = 600.0) -> float:
        """Seconds until GET /ready answers 200 (the model loaded and warmed up)."""
        import http.client

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/ready")
                if conn.getresponse().status == 200:
                    conn.close()
                    self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
                    return time.perf_counter() - t0
                conn.close()
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} server not ready after {timeout:.0f} s; see {self.log.name}")

    def ask(self, body: bytes) -> tuple[float, dict[str, Any]]:
        """(milliseconds from sending the request to reading the whole answer, the answer)."""
        import json

        t0 = time.perf_counter()
        self.conn.request("POST", "/v1/systemone", body=body, headers={"content-type": "application/json"})
        resp = self.conn.getresponse()
        data = resp.read()
        ms = 1000 * (time.perf_counter() - t0)
        if resp.status != 200:
            raise RuntimeError(f"{self.name} server answered {resp.status}: {data[:300]!r}")
        return ms, json.loads(data)

    def stop(self) -> None:
        import signal

        if self.conn is not None:
            self.conn.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001 - a server that does not stop is killed
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _answer_gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    """max |p_torch - p_onnx| over the answers of one request (probabilities, and noul's P(true))."""
    gap = 0.0
    for qid, x in a["answers"].items():
        y = b["answers"][qid]
        for k, v in (x.get("probabilities") or {}).items():
            gap = max(gap, abs(float(v) - float(y["probabilities"][k])))
        if isinstance(x.get("noul"), (int, float)):
            gap = max(gap, abs(float(x["noul"]) - float(y["noul"])))
    return gap


def _pct(xs: Sequence[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(xs, dtype=float), q))


def run_onnx_http_bench(run: Path | str, export: Path | str, *, threads: Sequence[int] = (1, 2), repeats: int = 7,
                        sizes: Sequence[int] = (1, 5), seed: int = 0,
                        say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The torch server and the ONNX server over HTTP at equal threads, in one interleaved run.

    For every thread count N, `rlcd serve RUN --threads N` and `rlcd serve --export DIR --threads N` are started
    (child processes, as a user starts them), all of them up at once. Then `repeats` rounds: in each, for each size
    in `sizes`, one request of that many questions about a fresh synthetic state (`rlcd.bench.serve`'s generator,
    seed `seed`) goes to every server in turn, one request at a time over a keep-alive connection, the order
    rotated by one server each round -- so a change in the machine's load (other processes) falls on every server
    and thread count alike, and none always goes first. Every state is new, so the torch server's state cache never
    answers warm: these are cold requests. One untimed round first. Reported per N, server and size: p50 and p90 of
    the client-side latency (ms: sending the request to reading the answer) and the ONNX/torch ratio of p50s; and
    the largest |dp| between the servers' answers (the export's parity, over HTTP)."""
    import json
    import random
    import tempfile

    from rlcd.bench.serve import synthetic_questions, synthetic_state
    from rlcd.portable.runtime import read_manifest

    run, export = Path(run), Path(export)
    manifest = read_manifest(export)
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    gap = 0.0
    with tempfile.TemporaryDirectory(prefix="rlcd-bench-onnx-http-") as tmp:
        say(f"bench onnx --http: starting the torch and the onnx server at {', '.join(map(str, threads))} thread(s)")
        servers: list[_Server] = []
        try:
            for n in threads:
                servers += [_Server(f"torch-{n}", [str(run), "--threads", str(n)], Path(tmp) / f"torch-{n}.log"),
                            _Server(f"onnx-{n}", ["--export", str(export), "--threads", str(n)],
                                    Path(tmp) / f"onnx-{n}.log")]
            ready_s = {s.name: round(s.wait_ready(), 1) for s in servers}
            times: dict[tuple[str, int], list[float]] = {(s.name, k): [] for s in servers for k in sizes}
            for r in range(repeats + 1):
                turn = servers[r % len(servers):] + servers[:r % len(servers)]
                for k in sizes:
                    body = json.dumps({"state": synthetic_state(rng), "questions": synthetic_questions(k, rng)}).encode()
                    answers = {}
                    for s in turn:
                        ms, answers[s.name] = s.ask(body)
                        if r > 0:  # round 0 warms every server up
                            times[(s.name, k)].append(ms)
                    first = answers[servers[0].name]
                    gap = max([gap, *(_answer_gap(first, a) for a in answers.values())])
                if r:
                    say(f"bench onnx --http: round {r}/{repeats}")
        finally:
            for s in servers:
                s.stop()
    for n in threads:
        for k in sizes:
            p50 = {e: _pct(times[(f"{e}-{n}", k)], 50) for e in ("torch", "onnx")}
            for e in ("torch", "onnx"):
                ms = times[(f"{e}-{n}", k)]
                rows.append({"server": e, "threads": n, "questions": k, "requests": len(ms), "p50_ms": p50[e],
                             "p90_ms": _pct(ms, 90), "min_ms": min(ms), "onnx_over_torch_p50": p50["onnx"] / p50["torch"],
                             "ms": ms})
    return {"run": str(run), "export": str(export), "precision": manifest["graph"]["precision"],
            "model": (manifest.get("source") or {}).get("model"), "repeats": repeats, "sizes": list(sizes),
            "seed": seed, "ready_s": ready_s, "max_abs_dp_between_servers": gap, "load_average": os.getloadavg(),
            "rows": rows}


def http_table(result: dict[str, Any]) -> str:
    """The HTTP result as aligned text lines."""
    lines = [f"{result['model']} ({result['precision']} export): p50 / p90 ms over {result['repeats']} cold requests "
             f"per size, servers taking turns; max |dp| between them {result['max_abs_dp_between_servers']:.2g}",
             f"{'server':<6} {'thr':>3} {'questions':>9} {'p50 ms':>8} {'p90 ms':>8} {'onnx/torch p50':>15}"]
    for r in result["rows"]:
        lines.append(f"{r['server']:<6} {r['threads']:>3} {r['questions']:>9} {r['p50_ms']:>8.0f} {r['p90_ms']:>8.0f} "
                     f"{r['onnx_over_torch_p50']:>15.2f}")
    return "\n".join(lines)


__all__ = ["run_onnx_bench", "run_onnx_http_bench", "table", "http_table", "SCHEMES"]
