"""`rlcd bench onnx RUN`: the portable export (fp32, int8 blockwise, int8 dynamic) against torch, with parity.

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


__all__ = ["run_onnx_bench", "table", "SCHEMES"]
