"""Benchmark results as files, and `benchmarks/BENCHMARKS.md` generated from them.

Every bench command writes one JSON object

    {"bench": name, "command": "<the exact command line>", "machine": {...}, "results": {...},
     "created": "<UTC ISO time>", "git_revision": "..."}

with `save_result(name, command, results)` (default `benchmarks/results/<name>.json`).
`write_benchmarks_md()` turns every such file in a directory into one Markdown page: per bench the
command that produced it, the machine it ran on (CPU model from /proc/cpuinfo, cores, torch version
and threads, GPU when there was one), the headline numbers and then every recorded field. Nothing
in the page is typed by hand, so `rlcd bench report` regenerates it at any time.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
from pathlib import Path
import shlex
import sys
from typing import Any

RESULTS_DIR = Path("benchmarks/results")
BENCHMARKS_MD = Path("benchmarks/BENCHMARKS.md")
ORDER = ("prefix", "pipeline", "train", "features", "cut", "serve", "gpu")

# how to produce each known bench (shown when its JSON is missing)
HOW = {
    "prefix": "rlcd bench prefix --json benchmarks/results/prefix.json",
    "pipeline": "rlcd bench pipeline --model tiny-llama --json benchmarks/results/pipeline-tiny-llama.json",
    "train": "rlcd bench train --model tiny --json benchmarks/results/train.json",
    "features": "rlcd bench features --model tiny --json benchmarks/results/features-tiny.json",
    "cut": "rlcd bench cut --model smollm2-135m --threads 2 --json benchmarks/results/cut.json",
    "serve": "rlcd bench serve RUN --json benchmarks/results/serve.json",
    "gpu": "bash benchmarks/gpu.sh",
}
HOW_NOTE = {
    "serve": "needs a trained run, e.g. the demo's (runs/demo/run)",
    "gpu": "on a GPU machine with the wheels of `benchmarks/gpu-wheels.sh` carried; then copy `$OUT/gpu.json` to the results directory",
}

# headline fields per bench (dotted paths into "results"); every field is listed below them anyway
HEADLINE = {
    "prefix": ("model", "hidden", "questions", "state_tokens", "prefix_tokens", "mean_row_tokens", "max_abs_diff",
               "rel_diff", "tol_ok", "err_full", "err_prefix", "parity_ok", "time_full_s", "time_shared_s", "speedup", "bound", "ratio"),
    "pipeline": ("model", *(f"serving.{n}.{k}" for n in (1, 5, 50)
                            for k in ("rlcd_p50_ms", "pipeline_p50_ms", "ratio", "max_prob_diff")),
                 "serving.rlcd_at_least_as_fast", "evaluation.full_rows_per_s", "evaluation.shared_rows_per_s",
                 "evaluation.speedup", "evaluation.token_bound", "evaluation.max_abs_logit_diff"),
    "train": ("model", "hidden", "device", "batch_size", "grad_accum", "updates", "warmup_updates", "mean_row_tokens",
              "step_ms", "examples_per_s", "tokens_per_s", "objective_share", "objective_pass",
              "sampler_rows_per_s", "sampler_pass"),
    "vote-combine": ("run", "split", "type", *(f"{k}.{n}" for n in (2, 4) for k in ("lower_nll", "nll_paired")),
                     *(f"arms.{c}-{n}.{k}" for n in (2, 4) for c in ("logmean", "mean") for k in ("nll", "nll_ci95")),
                     *(f"probe.{c}.{n}.{k}" for c in ("logmean", "mean") for n in (1, 2, 4)
                       for k in ("flip_rate", "flip_rate95"))),
    "train-case": tuple(f"models.{m}.{k}" for m in ("tiny", "tiny-llama", "smollm2-135m")
                        for k in ("row.examples_per_s", "case.examples_per_s", "speedup", "full_tokens_per_row",
                                  "run_tokens_per_row", "token_ratio", "whole_case_token_ratio",
                                  "evaluation.full_rows_per_s", "evaluation.shared_rows_per_s", "evaluation.speedup",
                                  "evaluation.token_bound")),
    "features": ("model", "cases", "threads", "extract.ratio", "extract.shared.row_tokens_per_s",
                 "extract.per_row.row_tokens_per_s", "extract.shared.entries", "train.head_only_updates_per_s",
                 "train.lora_updates_per_s", "train.ratio"),
    "cut": ("model", "layers", "batch_size", "grad_accum", "all_layers.row.updates_per_s", "all_layers.case.updates_per_s",
            *(f"per_k.{k}.{f}" for k in (1, 2, 4, 8)
              for f in ("row.updates_per_s", "row_ratio", "case.updates_per_s", "case_ratio", "live_row_ratio",
                        "goal_ratio", "row_tokens_per_s", "bytes_per_row_token")),
            "storage.float32_max_abs_dlogit", "storage.bfloat16_max_abs_dlogit", "dtypes",
            *(f"by_dtype.{d}.{k}.updates_per_s" for d in ("float32", "bfloat16")
              for k in ("all_layers.row", "all_layers.case", "per_k.4.row", "per_k.4.case"))),
    "serve": ("model", "requests_per_level", "window_ms", "batching_speedup_c16", "p50_ratio_c1", "c5xx", "crashes",
              "unexpected", "peak_rss_mib",
              *(f"model_batching.{z}.gain" for z in (1, 5, 50)),
              *(f"modes.{m}.{c}.{k}" for m in ("batched", "unbatched") for c in (1, 4, 16, 64)
                for k in ("decisions_per_s", "p50_ms_1", "p99_ms_1", "p50_ms_50", "mean_batch", "model_busy"))),
    "batch": ("rows", "states", "rounds", "threads", "cpus",
              *(f"median.{a}.{k}" for a in ("http", "local", "ray_1", "ray_2")
                for k in ("rows_per_s", "scoring_rows_per_s", "rows_per_cpu_s", "peak_rss_mib")),
              "measured_scaling.ray_2_over_ray_1", "projection.label", "projection.rows_per_cpu_s_per_actor",
              *(f"projection.rows_per_s.{n}" for n in (1, 2, 4, 8, 16))),
    "serve-state-cache": ("model", "dtypes", *(f"by_dtype.{d}.p50_ms.{t}.{k}" for d in ("float32", "bfloat16")
                                                for t in (1, 2) for k in ("cold_1q_off", "warm_1q")),
                          *(f"speedup.bfloat16.{t}.{k}" for t in (1, 2) for k in ("cold_1q_off", "warm_1q")),
                          *(f"by_dtype.{d}.cache.bytes" for d in ("float32", "bfloat16"))),
    "fuzz-server": ("requests", "operations", "c5xx", "distinct_failures", "status_counts", "server_problems.key",
                    "server_problems.open", "rounds", "seconds", "schemathesis"),
    "gpu": ("mode", "model.params_total", "matmul.tflops", "train.tokens_per_s", "train.examples_per_s", "train.mfu",
            "train.step_ms", "serve.p50_ms", "serve.decisions_per_s", "prefix.speedup", "prefix.bound",
            "prefix.ratio", "prefix.max_abs_diff", "memory.peak_allocated_gib"),
}


# ----------------------------------------------------------------------------------------------
# machine description and result files


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_info() -> dict[str, Any]:
    """CPU model, cores, torch/transformers versions, torch threads, GPU (if any) of this process."""
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:  # other work on the machine while the bench ran (1-minute load average when the result was saved)
        info["load_avg_1m"] = float(os.getloadavg()[0])
    except (AttributeError, OSError):
        pass
    try:
        info["cores_usable"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        info["cores_usable"] = info["cores"]
    try:
        import torch

        info["torch"] = torch.__version__
        info["threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = torch.cuda.device_count()
            info["cuda"] = torch.version.cuda
    except Exception:  # noqa: BLE001 - a description, never a failure
        info.setdefault("torch", "missing")
    for mod in ("transformers", "peft"):
        try:
            import importlib.metadata as md

            info[mod] = md.version(mod)
        except Exception:  # noqa: BLE001
            info[mod] = "missing"
    return info


def machine_line(m: dict[str, Any]) -> str:
    """One line describing the machine of a result (used verbatim in BENCHMARKS.md)."""
    parts = [f"{m.get('cpu', 'unknown CPU')}", f"{m.get('cores', '?')} cores ({m.get('cores_usable', '?')} usable)"]
    if m.get("gpu"):
        parts.append(f"GPU {m['gpu']}" + (f" x{m['gpu_count']}" if m.get("gpu_count", 1) > 1 else "")
                     + (f", CUDA {m['cuda']}" if m.get("cuda") else ""))
    parts.append(f"torch {m.get('torch', '?')}, {m.get('threads', '?')} threads")
    if m.get("transformers"):
        parts.append(f"transformers {m['transformers']}")
    if m.get("python"):
        parts.append(f"Python {m['python']}")
    if m.get("load_avg_1m") is not None:
        parts.append(f"load average {m['load_avg_1m']:.2f} when saved")
    return "; ".join(parts)


def _clean(obj: Any) -> Any:
    """JSON-ready: tensors/numpy scalars to Python, non-finite floats to None, paths to str."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Path):
        return str(obj)
    item = getattr(obj, "item", None)
    if callable(item):
        try:
            return _clean(item())
        except Exception:  # noqa: BLE001
            pass
    return str(obj)


def result_record(name: str, command: str, results: dict, machine: dict | None = None) -> dict:
    from rlcd.train import git_revision

    return {
        "bench": name,
        "command": command,
        "machine": machine if machine is not None else machine_info(),
        "results": _clean(results),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_revision": git_revision(),
    }


def save_result(name: str, command: str, results: dict, results_dir: str | Path = RESULTS_DIR, *,
                path: str | Path | None = None, machine: dict | None = None) -> Path:
    """Write `{bench, command, machine, results, created}` to `path` or `results_dir/<name>.json`."""
    if not name or "/" in name:
        raise ValueError(f"bad bench name {name!r}")
    if not command:
        raise ValueError("the command that produced the result is required")
    out = Path(path) if path is not None else Path(results_dir) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rec = result_record(name, command, results, machine)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(rec, indent=2, sort_keys=False, allow_nan=False) + "\n")
    os.replace(tmp, out)
    return out


def load_results(results_dir: str | Path = RESULTS_DIR) -> list[dict]:
    """Every bench JSON (an object with "bench" and "results") in `results_dir`, in report order."""
    out = []
    for p in sorted(Path(results_dir).glob("*.json")):
        try:
            rec = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{p}: not a JSON bench result ({e})") from None
        if not isinstance(rec, dict) or "bench" not in rec or "results" not in rec:
            raise ValueError(f"{p}: not a bench result (needs 'bench' and 'results'; write it with save_result)")
        rec["_file"] = p.name
        out.append(rec)
    rank = {n: i for i, n in enumerate(ORDER)}
    return sorted(out, key=lambda r: (rank.get(r["bench"], len(ORDER)), r["bench"], r["_file"]))


# ----------------------------------------------------------------------------------------------
# Markdown


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10_000 else str(v)
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 10_000:
            return f"{v:,.0f}"
        if abs(v) >= 0.01:
            return f"{v:.4g}"
        return f"{v:.3g}"
    if isinstance(v, (list, dict)):
        s = json.dumps(v, ensure_ascii=False, separators=(",", ":"))
        return (s[:117] + "...") if len(s) > 120 else s
    return str(v).replace("|", "\\|").replace("\n", " ")


def _flatten(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(d, dict):
        out: list[tuple[str, Any]] = []
        for k, v in d.items():
            out.extend(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return [(prefix, d)]


def _get(d: dict, dotted: str) -> Any:
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return KeyError
        cur = cur[part]
    return cur


def _table(rows: list[tuple[str, Any]], head: tuple[str, str] = ("field", "value")) -> list[str]:
    lines = [f"| {head[0]} | {head[1]} |", "|---|---|"]
    lines += [f"| `{k}` | {_fmt(v)} |" for k, v in rows]
    return lines


def _parts_table(res: dict) -> list[str]:
    parts, ms = res.get("shares"), res.get("parts_ms")
    if not isinstance(parts, dict) or not isinstance(ms, dict):
        return []
    lines = ["| part | ms / update | share of update |", "|---|---:|---:|"]
    for k in parts:
        lines.append(f"| {k} | {_fmt(ms.get(k))} | {100 * parts[k]:.2f}% |")
    lines.append(f"| **update** | {_fmt(res.get('step_ms'))} | {100 * sum(parts.values()):.2f}% |")
    return lines


def _tables(res: dict) -> list[str]:
    """Every `{"columns": [...], "rows": [[...], ...]}` value of `res` (a result that is a table, e.g. a peer suite's
    scores beside published ones) as a Markdown table, titled by its key."""
    lines: list[str] = []
    for key, val in res.items():
        if isinstance(val, dict) and isinstance(val.get("columns"), list) and isinstance(val.get("rows"), list):
            lines += [f"`{key}`:", "", "| " + " | ".join(map(str, val["columns"])) + " |",
                      "|" + "---|" * len(val["columns"])]
            lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in val["rows"]] + [""]
    return lines


def render_benchmarks_md(records: list[dict], results_dir: str | Path = RESULTS_DIR) -> str:
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `rlcd bench report` (or `python -m rlcd.bench.report md`) from the JSON files in "
        f"`{Path(results_dir).as_posix()}/`; do not edit by hand. Each section names the command that produced it "
        "and the machine it ran on (with the load average, as the machine may be shared); rerun the command, then "
        "the report, to refresh it.",
        "",
    ]
    seen = {r["bench"] for r in records}
    missing = [n for n in ORDER if n not in seen]
    for rec in records:
        name, res, m = rec["bench"], rec.get("results") or {}, rec.get("machine") or {}
        stem = Path(str(rec.get("_file", name))).stem
        title = name if stem in ("", name) else f"{name} ({stem})"  # several files of one bench: say which
        lines += [f"## {title}", "", "Command:", "", "```", str(rec.get("command", "?")), "```", "",
                  f"Machine: {machine_line(m)}", "",
                  f"Created: {rec.get('created', '?')}" + (f", git {str(rec['git_revision'])[:12]}"
                                                           if rec.get("git_revision") else "")
                  + f" (`{rec.get('_file', '')}`)", ""]
        head = [(k, _get(res, k)) for k in HEADLINE.get(name, ())]
        head = [(k, v) for k, v in head if v is not KeyError]
        if head:
            lines += _table(head, ("result", "value")) + [""]
        lines += _tables(res)
        if name == "train":
            pt = _parts_table(res)
            if pt:
                lines += pt + [""]
        if name == "gpu":
            for sec, val in res.items():
                if isinstance(val, dict):
                    lines += [f"### gpu: {sec}", ""] + _table(_flatten(val)) + [""]
            rest = [(k, v) for k, v in res.items() if not isinstance(v, dict)]
            if rest:
                lines += ["### gpu: other fields", ""] + _table(rest) + [""]
        else:
            lines += ["<details><summary>all recorded fields</summary>", ""] + _table(_flatten(res)) + \
                     ["", "</details>", ""]
    if missing:
        lines += ["## Not measured yet", ""]
        lines += [f"- `{n}`: `{HOW[n]}`" + (f": {HOW_NOTE[n]}" if n in HOW_NOTE else "") for n in missing]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def write_benchmarks_md(results_dir: str | Path = RESULTS_DIR, out: str | Path = BENCHMARKS_MD) -> Path:
    """Regenerate `out` from every bench JSON in `results_dir`; returns the path written."""
    records = load_results(results_dir)
    text = render_benchmarks_md(records, results_dir)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out


def invocation(default: str) -> str:
    """The command line that is running now, when it is `rlcd ...` or `python -m rlcd.bench...`."""
    argv0 = Path(sys.argv[0]).name if sys.argv else ""
    if argv0 == "rlcd":
        return shlex.join(["rlcd", *sys.argv[1:]])
    if sys.argv and sys.argv[0].endswith("rlcd/bench/gpu.py"):
        mod = "rlcd.bench." + Path(sys.argv[0]).stem
        return shlex.join(["python", "-m", mod, *sys.argv[1:]])
    return default


__all__ = ["save_result", "result_record", "machine_info", "machine_line", "load_results", "write_benchmarks_md",
           "render_benchmarks_md", "invocation"]
