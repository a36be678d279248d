"""`rlcd export RUN --precision bfloat16`: the bf16 parity gate, and the record `--dtype auto` reads on the CPU.

The run's test split is scored by its `export/` on the CPU twice, backbone in float32 (the reference: what
`rlcd predict` serves without the record) and in bfloat16 (scorer and readout float32 in both, as on the GPU
path), with `case_scoring.score_records` (what `rlcd evaluate` runs). `portable.parity.compare` reports what the
ONNX gate reports: decision flips, max |dp|, and the NLL and ECE deltas with 95% case-bootstrap intervals. A flip
rate above `max_flips` (default 0.5%, the ONNX gate's) refuses: exit 1 with one line, as the ONNX gate.

The record, `export/precision-bfloat16.json`, is written whether the gate passed or refused, and names the export
it measured (checkpoint sha256, backbone fingerprint): `parity_verdict` accepts it only for that export, so a
re-export must pass the gate again before `--dtype auto` serves it in bf16 (`rlcd.device.cpu_auto_dtype`).
"""

from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path
from typing import Any, Callable

from rlcd.errors import OptionError

log = logging.getLogger(__name__)

from rlcd.precision_record import FORMAT, IDENTITY, PRECISIONS, parity_verdict, record_name, record_path  # noqa: F401

def flipped_rows(records: list, reference: list, candidate: list, temperatures: dict) -> list[dict]:
    """The rows whose decision flipped, each with the reference's top-two margin p(1) - p(2) (a near tie flips at a
    small |dp|): what a reader of the record needs to judge the flips."""
    import numpy as np

    from rlcd import metrics as M

    out = []
    for r, a, b in zip(records, reference, candidate):
        t = float(temperatures.get(r.question.type, 1.0))
        p, q = M.softmax(np.asarray(a, dtype=np.float64), t), M.softmax(np.asarray(b, dtype=np.float64), t)
        if int(np.argmax(p)) != int(np.argmax(q)):
            top = np.sort(p)[::-1]
            out.append({"id": r.id, "type": r.question.type, "k": len(p), "margin": float(top[0] - top[1]),
                        "dp": float(np.max(np.abs(p - q)))})
    return out


def check_precision(run: Any, precision: str = "bfloat16", *, max_flips: float | None = None,
                    say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Score the run's test split in float32 and in `precision` on the CPU, write the record, refuse above the bound.

    Returns the record. Raises a one-line UserError (exit 2) before scoring anything on a bad option or a run
    without export/ or test rows, and `ParityRefused` (exit 1) after writing the record when the gate refuses."""
    from rlcd.device import Placement, cpu_bf16_units
    from rlcd.export import load_export, read_export_meta
    from rlcd.portable.exporter import MAX_FLIPS, ParityRefused, parity_rows, test_records, torch_logits
    from rlcd.portable.parity import compare, describe
    from rlcd.run import Run, write_json

    say = say or (lambda msg: log.info("%s", msg))
    max_flips = MAX_FLIPS if max_flips is None else float(max_flips)
    if precision not in PRECISIONS:
        raise OptionError(f"--precision {precision}: choose {', '.join(PRECISIONS)} (float32 is the reference)")
    if not 0.0 <= max_flips <= 1.0:
        raise OptionError(f"--max-flips {max_flips}: a fraction of the test rows in [0, 1] (0.005 = 0.5%)")
    run = run if isinstance(run, Run) else Run.open(run)
    run.require_export()
    meta = read_export_meta(run.export_dir)
    records = test_records(run)
    units, why = cpu_bf16_units()
    say(f"precision: scoring {len(records)} original test rows, as the server asks them, on the CPU in float32, "
        f"then {precision} ({why})")
    logits = {}
    for dtype in ("float32", precision):
        model, _ = load_export(run.export_dir, placement=Placement("cpu", dtype))
        logits[dtype] = torch_logits(model, records)
        del model
    report = compare(parity_rows(records), logits["float32"], logits[precision], meta["temperatures"],
                     names=("float32", precision))
    report["flipped"] = flipped_rows(records, logits["float32"], logits[precision], meta["temperatures"])
    passed = report["flip_rate"] <= max_flips
    doc = {
        "format": FORMAT, "precision": precision, "device": "cpu", "cpu": {"bf16_units": units, "detected": why},
        "split": "test", "rows": "original, canonical (as the server asks them)",
        "split_file": str(run.data_dir / "test.jsonl"), "max_flips": max_flips,
        "reference": "the run's export/ on the CPU, backbone float32 (scorer float32 in both)",
        "export": {k: meta.get(k) for k in IDENTITY}, "result": report, "passed": passed,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    path = write_json(run.export_dir / record_name(precision), doc)
    if not passed:
        raise ParityRefused(f"the {precision} backbone fails the parity gate (--max-flips {100 * max_flips:.2f}%): "
                            f"{describe(report)}; --dtype auto stays float32 (the record: {path})")
    say(f"precision: {precision} passed the gate: {describe(report)}")
    return doc


__all__ = ["check_precision", "parity_verdict", "record_path", "record_name", "PRECISIONS", "FORMAT"]
