"""`rlcd bench onnx RUN`: the portable export (fp32, int8 blockwise, int8 dynamic) against torch, with parity.

One run measures, on the run's test split, the rows/s of the torch path (`case_scoring.score_records` on the
export rebuilt on the CPU in float32: what `rlcd predict` serves) and of onnxruntime on each graph
(`PortableModel`, what `rlcd serve --export` runs), at each thread count asked (intra-op threads for both
engines; default 1), best of `repeats` after one warm-up. Each ONNX row carries its parity against torch
(`portable.parity`: flips, max |dp|, NLL and ECE deltas) and its time ratio to torch measured in the same run.
The fp32 graph comes from `export_onnx` with the gate opened (`max_flips=1`): a bench reports, it does not refuse.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from rlcd.run import Run

SCHEMES = ("int8", "int8-dynamic")


def _best(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    out = fn()  # warm-up (allocations, kernels' first shapes)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def run_onnx_bench(run: Path | str, *, threads: Sequence[int] = (1,), repeats: int = 3,
                   say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    import torch

    from rlcd.export import load_export
    from rlcd.portable.exporter import export_onnx, onnx_logits, parity_rows, quantize_graph, test_records, torch_logits
    from rlcd.portable.parity import compare
    from rlcd.portable.runtime import PortableModel

    run = run if isinstance(run, Run) else Run.open(run)
    records = test_records(run)
    rows = parity_rows(records)
    model, meta = load_export(run.export_dir)
    temps = meta["temperatures"]
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rlcd-bench-onnx-") as tmp:
        fp32 = Path(tmp) / "fp32"
        say("bench onnx: exporting fp32")
        export_onnx(run, fp32, max_flips=1.0)
        graphs = {"float32": "model.onnx"}
        for scheme in SCHEMES:
            say(f"bench onnx: quantizing {scheme}")
            quantize_graph(fp32 / "model.onnx", fp32 / f"model.{scheme}.onnx", scheme)
            graphs[scheme] = f"model.{scheme}.onnx"
        sizes = {name: (fp32 / g).stat().st_size for name, g in graphs.items()}
        was = torch.get_num_threads()
        try:
            for n in threads:
                torch.set_num_threads(int(n))
                say(f"bench onnx: torch, {n} thread(s)")
                t_torch, ref = _best(lambda: torch_logits(model, records), repeats)
                out.append({"engine": "torch", "precision": "float32", "threads": n, "seconds": t_torch,
                            "rows_per_s": len(records) / t_torch, "speedup_vs_torch": 1.0})
                for name, graph in graphs.items():
                    say(f"bench onnx: onnxruntime {name}, {n} thread(s)")
                    pm = PortableModel(fp32, threads=int(n), graph=graph)
                    t, got = _best(lambda: onnx_logits(pm, records), repeats)
                    p = compare(rows, ref, got, temps, resamples=200)
                    out.append({"engine": "onnxruntime", "precision": name, "threads": n, "seconds": t,
                                "rows_per_s": len(records) / t, "speedup_vs_torch": t_torch / t,
                                "graph_mb": sizes[name] / 2**20, "flips": p["flips"], "flip_rate": p["flip_rate"],
                                "max_abs_dp": p["max_abs_dp"], "nll_delta": p["nll"]["delta"],
                                "ece_delta": p["ece"]["delta"]})
        finally:
            torch.set_num_threads(was)
    return {"run": str(run.root), "model": meta.get("model"), "test_rows": len(records), "repeats": repeats,
            "rows": out}


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
