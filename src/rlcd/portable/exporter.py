"""`rlcd export RUN --format onnx --out DIR [--quantize int8|int8-dynamic] [--max-flips F]`.

Writes DIR (all or nothing):

    model.onnx          the merged backbone's forward (`layout`'s inputs -> hidden states at the read positions),
                        fp32, or int8 when asked and it passes the gate
    scorer.safetensors  w_d, w_c, mu_d, mu_c (float32) and temperatures [3] (choice, noul, score)
    tokenizer.json      the backbone's tokenizer for the `tokenizers` library
    manifest.json       format, the run's fingerprint (backbone fingerprint, checkpoint sha256, selected step:
                        the export's model.json), opset, input/output names and axes as the graph declares them
                        (a name where it takes any size, the size where it fixes one: hidden), the prompt frame,
                        and the parity report on the run's test split

The graph comes from `torch.onnx.export(dynamo=True)` (torch's default exporter since 2.9; the TorchScript one
is deprecated) on the run's `export/` rebuilt on the CPU in float32 -- the model `rlcd predict` serves. The
attention mask is an input, so the shared-prefix layout runs without a KV cache (`layout`).

**The gate.** The run's test rows are scored by torch (`case_scoring.score_records`, what `rlcd evaluate` runs)
and by onnxruntime on the written files (`runtime.PortableModel`, what `rlcd serve --export` runs); `parity`
reports flips, max |dp|, NLL and ECE deltas. A flip rate above `max_flips` (default 0.5%) refuses the export:
DIR then holds only PARITY-FAILED.json, and the command exits 1 with one line. int8 (`quantize`) is tried after
the fp32 graph passed and shipped only if it passes too:

* `int8`: weight-only blockwise int8 (onnxruntime's MatMulNBits, 8 bits, blocks of 32, symmetric: Q8_0-like),
  activations in float32;
* `int8-dynamic`: onnxruntime's dynamic quantization (int8 weights per channel with `reduce_range`, int8
  activations per tensor at run time), which moved hidden states furthest in the measurements.

Text decoders only: a Qwen3.5 backbone (hybrid Gated-DeltaNet layers with a recurrent state, vision tower,
M-RoPE) is refused in one line: the recurrent layers cannot read the packed layout, and the chunked kernels and
the vision tower are not exported.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from rlcd.errors import OptionError, RunError, UserError
from rlcd.portable import layout
from rlcd.portable.parity import compare, describe
from rlcd.portable.runtime import FORMAT, INPUTS, MANIFEST, OUTPUTS, SCORER, TOKENIZER, PortableModel, require_onnx
from rlcd.run import Run, write_json
from rlcd.schema import QUESTION_TYPES

log = logging.getLogger(__name__)

OPSET = 18
MAX_FLIPS = 0.005
FAILED = "PARITY-FAILED.json"
QUANTIZE = ("int8", "int8-dynamic")
GRAPH = "model.onnx"
DYNAMIC_AXES = {"input_ids": {0: "batch", 1: "tokens"}, "position_ids": {0: "batch", 1: "tokens"},
                "attention_mask": {0: "batch", 1: "tokens", 2: "tokens"}, "read_positions": {0: "batch", 1: "reads"},
                "hidden": {0: "batch", 1: "reads"}}
IO_TYPES = {"input_ids": "int64", "position_ids": "int64", "attention_mask": "bool", "read_positions": "int64",
            "hidden": "float32"}


class ParityRefused(UserError):
    """The exported graph moved the run's test decisions more than the bound allows (exit 1: not a usage error)."""

    exit_code = 1


class HiddenAt(nn.Module):
    """The graph: the decoder's forward with an explicit [B, T, T] mask, gathered at the read positions."""

    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids, position_ids, attention_mask, read_positions):
        bias = torch.where(attention_mask[:, None], 0.0, torch.finfo(torch.float32).min)
        h = self.decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=bias,
                         use_cache=False).last_hidden_state
        return torch.gather(h, 1, read_positions[..., None].expand(-1, -1, h.shape[-1]))


# ---------------------------------------------------------------------------------------- checks
def check_out(out: Path) -> None:
    """--out must be new, empty, or a refused export's (only PARITY-FAILED.json)."""
    if out.exists() and (not out.is_dir() or {p.name for p in out.iterdir()} - {FAILED}):
        raise OptionError(f"--out {out}: exists and is not empty; choose a new directory")


def check_supported(meta: dict) -> None:
    family = (meta.get("backbone") or {}).get("family")
    if family != "causal-lm":
        raise OptionError(f"--format onnx exports text decoders only; this run's backbone {meta.get('model')!r} is "
                          f"{family}: its hybrid Gated-DeltaNet layers keep a recurrent state the packed shared-prefix "
                          "layout cannot feed, and its vision tower is not exported")


def test_records(run: Run) -> list:
    """The test rows a parity gate scores: those `rlcd evaluate` scores (`rlcd.evaluate.scored_records`: original
    rows only, derived forms left out, each in the canonical form `rlcd serve` asks it), so the gate's rows and the
    export's temperatures, fitted on the same kind of rows, describe what the server answers."""
    from rlcd.evaluate import scored_records

    path = run.data_dir / "test.jsonl"
    records = scored_records(run.data_dir, "test")
    if not records:
        raise RunError(f"{path}: no test rows to check the export against; the parity gate scores the run's "
                       "test split")
    return records


# ---------------------------------------------------------------------------------------- writing
def remove_dead_temps(out: Path) -> None:
    """Remove `.tmp-<out>-<pid>` directories of exports whose process is gone (killed before its cleanup)."""
    from rlcd.files import pid_alive

    for tmp in out.parent.glob(f".tmp-{out.name}-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or (int(pid) != os.getpid() and pid_alive(int(pid))):
            continue  # not ours to judge, or a live export writes there
        shutil.rmtree(tmp, ignore_errors=True)


def scorer_tensors(model: Any, temperatures: dict[str, float]) -> dict[str, np.ndarray]:
    head = model.head
    t = {k: getattr(head, k).detach().float().cpu().numpy() for k in ("mu_d", "mu_c")}
    t["w_d"] = head.w_d.weight.detach().float().cpu().numpy()
    t["w_c"] = head.w_c.weight.detach().float().cpu().numpy()
    t["temperatures"] = np.array([float(temperatures[q]) for q in QUESTION_TYPES], dtype=np.float32)
    return t


def example_inputs(model: Any, records: list) -> tuple[torch.Tensor, ...]:
    """Two sequences of real rows (no dimension of size 1: torch.export would specialise it)."""
    rows = [model.encoder.encode(r.state, r.question, row=r.id) for r in records[:2]]
    while len(rows) < 2:
        rows.append(rows[0])
    seqs = [s for r in rows for s in layout.pack_case([r])]
    return tuple(torch.from_numpy(v) for v in layout.feed(seqs, model.encoder.pad_id).values())


def export_graph(model: Any, path: Path, example: tuple[torch.Tensor, ...], *, opset: int = OPSET) -> None:
    """`torch.onnx.export(dynamo=True)` of `HiddenAt` with the dynamic axes of `DYNAMIC_AXES`."""
    from torch.export import Dim

    batch, tokens, reads = Dim("batch"), Dim("tokens"), Dim("reads")
    shapes = {"input_ids": {0: batch, 1: tokens}, "position_ids": {0: batch, 1: tokens},
              "attention_mask": {0: batch, 1: tokens, 2: tokens}, "read_positions": {0: batch, 1: reads}}
    wrapper = HiddenAt(model.family.decoder(model.causal_lm())).eval()
    big = sum(p.numel() * p.element_size() for p in wrapper.parameters()) > (3 << 29)  # protobuf's 2 GiB
    noisy = logging.getLogger("torch.onnx._internal.exporter._registration")  # "torchvision is not installed"
    level = noisy.level
    noisy.setLevel(logging.ERROR)
    try:
        with torch.no_grad(), contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's deprecation notes about transformers internals
            torch.onnx.export(wrapper, example, str(path), dynamo=True, opset_version=opset, input_names=list(INPUTS),
                              output_names=list(OUTPUTS), dynamic_shapes=shapes, external_data=big, verbose=False)
    finally:
        noisy.setLevel(level)


def quantize_graph(src: Path, dst: Path, scheme: str) -> dict[str, Any]:
    """int8 copy of `src` (module docstring); returns what the manifest says about it."""
    # onnxruntime's quantizers log a line per tensor: on the root logger, which importing the MatMulNBits quantizer
    # configures (`logging.basicConfig(level=INFO)`), and on that module's own; imported first, then quieted
    import onnxruntime.quantization.matmul_nbits_quantizer  # noqa: F401

    loggers = [logging.getLogger(), logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        return _quantize(src, dst, scheme)
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _quantize(src: Path, dst: Path, scheme: str) -> dict[str, Any]:
    import onnx

    if scheme == "int8":
        from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

        cfg = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, bits=8)
        q = MatMulNBitsQuantizer(onnx.load(str(src)), algo_config=cfg)
        q.process()
        q.model.save_model_to_file(str(dst), False)
        return {"scheme": "weight-only blockwise int8 (MatMulNBits, bits 8, block 32, symmetric)",
                "activations": "float32"}
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=True, reduce_range=True)
    return {"scheme": "onnxruntime dynamic int8 (weights per channel, reduce_range)", "activations": "int8, dynamic"}


def versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import onnxscript
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__, "onnxscript": onnxscript.__version__}


def graph_axes(path: Path) -> dict[str, dict[int, str | int]]:
    """Per input and output of the written graph, its axes as the graph declares them: a dynamic axis by the name
    `DYNAMIC_AXES` gives it, a fixed one by its size (the output's hidden axis: the backbone's width). Read from
    the file, so the manifest cannot call an axis dynamic that the graph fixes."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    out: dict[str, dict[int, str | int]] = {}
    for value in [*graph.input, *graph.output]:
        names = DYNAMIC_AXES.get(value.name, {})
        axes: dict[int, str | int] = {}
        for i, dim in enumerate(value.type.tensor_type.shape.dim):
            axes[i] = int(dim.dim_value) if dim.HasField("dim_value") else names.get(i, dim.dim_param or f"d{i}")
        out[value.name] = axes
    return out


def manifest(meta: dict, model: Any, *, opset: int, precision: str, quant: dict | None, graph_bytes: int,
             axes: dict[str, dict[int, str | int]]) -> dict:
    """manifest.json; `axes`: `graph_axes` of the written graph (dynamic axes by name, fixed ones by size)."""
    enc = model.encoder
    keep = ("model", "model_seed", "backbone", "backbone_fingerprint", "backbone_fingerprint_rounding", "checkpoint",
            "selected_step", "selection_score", "checkpoint_sha256", "temperatures", "label_conventions", "format")
    source = {k: meta.get(k) for k in keep}
    source["export_format"] = source.pop("format")
    return {
        "format": FORMAT,
        "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": source,
        "graph": {"file": GRAPH, "bytes": graph_bytes, "precision": precision, "quantization": quant, "opset": opset,
                  "exporter": "torch.onnx.export(dynamo=True)",
                  "inputs": [{"name": n, "dtype": IO_TYPES[n], "axes": axes[n]} for n in INPUTS],
                  "outputs": [{"name": n, "dtype": IO_TYPES[n], "axes": axes[n]} for n in OUTPUTS],
                  "axes": "per axis: a name when the graph takes any size there, the size when the graph fixes it",
                  "hidden_size": int(model.head.hidden),
                  "layout": "packed shared prefix: see rlcd.portable.layout (attention_mask[b, i, j]: token i reads j)"},
        "scorer": {"file": SCORER, "centring": model.head.centring, "proj_dim": int(model.head.proj_dim),
                   "hidden": int(model.head.hidden), "temperature_order": list(QUESTION_TYPES)},
        "tokenizer": {"file": TOKENIZER, "library": "tokenizers"},
        "prompt": {"spec": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(enc.spec).items()},
                   "pad_id": int(enc.pad_id), "max_tokens": int(enc.max_tokens)},
        "versions": versions(),
    }


# ---------------------------------------------------------------------------------------- scoring both ways
def onnx_logits(portable: PortableModel, records: list, *, max_rows: int = 64) -> list[np.ndarray]:
    """Logits per record through the portable runtime, case by case (as `score_records` groups them)."""
    from rlcd.model.case_scoring import group_cases, pack_cases

    groups = group_cases(records)
    cases = [portable.prepare_case(records[g[0]].state, [records[i].question for i in g], None,
                                   [records[i].id for i in g], case_id=records[g[0]].case_id) for g in groups]
    out: list[Any] = [None] * len(records)
    sizes = [(len(c.rows), c.n_tokens) for c in cases]
    for call in pack_cases(sizes, max_rows=max_rows, max_tokens=16384):
        for c, (logits, _) in zip(call, portable.score_cases([cases[c] for c in call])):
            for i, lg in zip(groups[c], logits):
                out[i] = lg
    return out


def torch_logits(model: Any, records: list) -> list[np.ndarray]:
    from rlcd.model.case_scoring import score_records

    return [lg.float().numpy() for lg in score_records(model, records)]


def parity_rows(records: list) -> list[dict]:
    return [{"id": r.id, "case_id": r.case_id, "type": r.question.type, "target": r.target} for r in records]


# ---------------------------------------------------------------------------------------- the command
def export_onnx(run: Run | Path, out: Path, *, quantize: str | None = None, max_flips: float = MAX_FLIPS,
                opset: int = OPSET, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Write the portable export of `run` into `out` behind the parity gate (module docstring); returns the manifest.
    Raises a one-line UserError (exit 2) before writing anything, ParityRefused (exit 1) when the gate refuses."""
    from rlcd.export import load_export, read_export_meta

    say = say or (lambda msg: log.info("%s", msg))
    run = run if isinstance(run, Run) else Run.open(run)
    out = Path(out)
    if quantize is not None and quantize not in QUANTIZE:
        raise OptionError(f"--quantize {quantize}: choose one of {', '.join(QUANTIZE)}")
    if not 0.0 <= max_flips <= 1.0:
        raise OptionError(f"--max-flips {max_flips}: a fraction of the test rows in [0, 1] (0.005 = 0.5%)")
    check_out(out)
    require_onnx("onnx", "onnxscript")
    run.require_export()
    meta = read_export_meta(run.export_dir)
    check_supported(meta)
    records = test_records(run)

    model, meta = load_export(run.export_dir)  # CPU, float32: what `rlcd predict` serves
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    remove_dead_temps(out)
    tmp.mkdir(parents=True)
    try:
        say(f"onnx: exporting the merged backbone (opset {opset})")
        export_graph(model, tmp / GRAPH, example_inputs(model, records), opset=opset)
        from safetensors.numpy import save_file

        from rlcd.files import plain_mode

        save_file(scorer_tensors(model, meta["temperatures"]), str(tmp / SCORER))
        plain_mode(tmp / SCORER)  # safetensors writes 600: another user (a container) could not read it
        model.tokenizer._tokenizer.save(str(tmp / TOKENIZER))
        doc = manifest(meta, model, opset=opset, precision="float32", quant=None,
                       graph_bytes=(tmp / GRAPH).stat().st_size, axes=graph_axes(tmp / GRAPH))
        write_json(tmp / MANIFEST, doc)

        say(f"onnx: parity gate on {len(records)} original test rows, as the server asks them (torch vs onnxruntime)")
        ref = torch_logits(model, records)
        rows, temps = parity_rows(records), meta["temperatures"]
        reports = {"float32": compare(rows, ref, onnx_logits(PortableModel(tmp), records), temps)}
        refused = _refusal("float32", reports["float32"], max_flips)
        if refused is None and quantize is not None:
            say(f"onnx: {quantize} quantization, then its gate")
            quant = quantize_graph(tmp / GRAPH, tmp / "model.int8.onnx", quantize)
            reports[quantize] = compare(rows, ref, onnx_logits(PortableModel(tmp, graph="model.int8.onnx"), records),
                                        temps)
            refused = _refusal(quantize, reports[quantize], max_flips)
            if refused is None:
                os.replace(tmp / "model.int8.onnx", tmp / GRAPH)
                doc["graph"].update(precision="int8", quantization={"name": quantize, **quant},
                                    bytes=(tmp / GRAPH).stat().st_size)
        parity = {"split": "test", "split_file": str(run.data_dir / "test.jsonl"), "max_flips": max_flips,
                  "reference": "torch: the run's export/ on the CPU in float32 (rlcd predict)", "results": reports,
                  "passed": refused is None}
        if refused is not None:
            shutil.rmtree(tmp)
            out.mkdir(parents=True, exist_ok=True)
            write_json(out / FAILED, {"status": "refused", "reason": refused, "run": str(run.root), "parity": parity})
            raise ParityRefused(f"{refused}; nothing exported (the report: {out / FAILED})")
        doc["parity"] = parity
        write_json(tmp / MANIFEST, doc)
        if out.exists():
            shutil.rmtree(out)  # empty, or a refused export's report
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"onnx: {doc['graph']['precision']} passed the gate: {describe(reports[quantize or 'float32'])}")
    return doc


def _refusal(name: str, report: dict, bound: float) -> str | None:
    if report["flip_rate"] <= bound:
        return None
    return f"the {name} graph fails the parity gate (--max-flips {100 * bound:.2f}%): {describe(report)}"


__all__ = ["export_onnx", "ParityRefused", "HiddenAt", "OPSET", "MAX_FLIPS", "FAILED", "QUANTIZE"]
