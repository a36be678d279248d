"""`rlcd export RUN --precision bfloat16`: the bf16 parity gate, and the record `--dtype auto` reads on the CPU.

The run's test split is scored by its `export/` on the CPU twice, backbone in float32 (the reference: what
`rlcd predict` serves without the record) and in bfloat16 (scorer and readout float32 in both, as on the GPU
path), with `case_scoring.score_records` (what `rlcd evaluate` runs). `portable.parity.compare` reports what the
ONNX gate reports: decision flips, max |dp|, and the NLL and ECE deltas with 95% case-bootstrap intervals.

The gate judges meaning, not rounding. Per test row, p = float32's probabilities, q = bfloat16's (softmax of the
logits over the run's temperature), dp = max_k |p_k - q_k| and m = float32's top-two margin p(1) - p(2):

* **Noise floor** F = 2 x max dp over the rows whose decision did *not* flip (0 when every row flipped): on the
  decisions it kept, bf16 moved a probability by up to max dp, so a top-two margin can move by up to twice that
  (the top loses dp, the runner-up gains it). The floor is measured on kept decisions, so a flip never excuses
  itself (a flipped row always has m < 2 dp of its own).
* **A counted flip**: argmax p != argmax q *and* m > F. A flip with m <= F is a near tie that the precision's own
  measured noise resolves either way: reported (`flipped`, `counted: false`), not counted.
* **Refused** when any of: counted flips / rows > `max_flips` (default 0.5%, the ONNX gate's bound); max dp over
  all rows > `max_dp` (default 0.02: two points of a calibrated probability is a change a gate reading it sees);
  the NLL delta's 95% interval lies wholly above `max_nll_delta` (default 0.005 nats per row: bf16 measurably the
  worse forecaster by more than rounding). Exit 1 with one line naming every limit crossed, as the ONNX gate.

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

MAX_DP = 0.02
MAX_NLL_DELTA = 0.005

from rlcd.precision_record import FORMAT, IDENTITY, PRECISIONS, parity_verdict, record_name, record_path  # noqa: F401


def flip_rule(reference: list, candidate: list) -> dict[str, Any]:
    """The flip rule (module docstring) on per-row probabilities (float32's, the candidate's): the noise floor, and
    per flipped row its index, float32 top-two margin, dp and whether it counts."""
    import numpy as np

    flipped, kept_dp = [], [0.0]
    for i, (p, q) in enumerate(zip(reference, candidate)):
        p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
        dp = float(np.max(np.abs(p - q)))
        if int(np.argmax(p)) == int(np.argmax(q)):
            kept_dp.append(dp)
            continue
        top = np.sort(p)[::-1]
        flipped.append({"row": i, "margin": float(top[0] - top[1]), "dp": dp})
    floor = 2 * max(kept_dp)
    for f in flipped:
        f["counted"] = f["margin"] > floor
    return {"noise_floor": floor, "flipped": flipped, "counted": sum(f["counted"] for f in flipped)}


def refusals(report: dict, *, max_flips: float, max_dp: float, max_nll_delta: float) -> list[str]:
    """The limits `report` crosses (empty: the gate passes): counted flip rate, max |dp|, the NLL delta's interval."""
    out = []
    rate = report["counted_flips"] / report["rows"]
    if rate > max_flips:
        out.append(f"{report['counted_flips']} flips beyond the noise floor {report['noise_floor']:.2g} "
                   f"({100 * rate:.2f}% > --max-flips {100 * max_flips:.2f}%)")
    if report["max_abs_dp"] > max_dp:
        out.append(f"max |dp| {report['max_abs_dp']:.2g} > --max-dp {max_dp:g}")
    low = report["nll"]["delta_95"][0]
    if low > max_nll_delta:
        out.append(f"NLL delta 95% interval above +{max_nll_delta:g} (from {low:+.2g})")
    return out


def judge(rows: list, reference: list, candidate: list, temperatures: dict, *, max_flips: float, max_dp: float,
          max_nll_delta: float, names: tuple[str, str] = ("float32", "bfloat16")) -> tuple[dict, list[str]]:
    """(report, refusals) for two scorings of `rows` (each with `id`, `case_id`, `type`, `target`; raw logits per row):
    `portable.parity.compare`'s report plus the flip rule's noise floor, counted flips and each flipped row with its
    float32 top-two margin, |dp| and whether it counts (what a reader of the record needs to judge the flips)."""
    import numpy as np

    from rlcd import metrics as M
    from rlcd.portable.parity import compare

    def probs(logits: list) -> list:
        return [M.softmax(np.asarray(a, dtype=np.float64), float(temperatures.get(r["type"], 1.0)))
                for r, a in zip(rows, logits)]

    report = compare(rows, reference, candidate, temperatures, names=names)
    rule = flip_rule(probs(reference), probs(candidate))
    report["flipped"] = [{"id": rows[f["row"]]["id"], "type": rows[f["row"]]["type"], "k": len(reference[f["row"]]),
                          "margin": f["margin"], "dp": f["dp"], "counted": f["counted"]} for f in rule["flipped"]]
    report["noise_floor"] = rule["noise_floor"]
    report["counted_flips"] = rule["counted"]
    report["counted_flip_rate"] = rule["counted"] / report["rows"]
    return report, refusals(report, max_flips=max_flips, max_dp=max_dp, max_nll_delta=max_nll_delta)


def check_precision(run: Any, precision: str = "bfloat16", *, max_flips: float | None = None,
                    max_dp: float | None = None, max_nll_delta: float | None = None,
                    say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Score the run's test split in float32 and in `precision` on the CPU, write the record, refuse past a limit
    (the module docstring: counted flips, max |dp|, the NLL delta's interval).

    Returns the record. Raises a one-line UserError (exit 2) before scoring anything on a bad option or a run
    without export/ or test rows, and `ParityRefused` (exit 1) after writing the record when the gate refuses."""
    from rlcd.device import Placement, cpu_bf16_units
    from rlcd.export import load_export, read_export_meta
    from rlcd.portable.exporter import MAX_FLIPS, ParityRefused, parity_rows, test_records, torch_logits
    from rlcd.portable.parity import describe
    from rlcd.run import Run, write_json

    say = say or (lambda msg: log.info("%s", msg))
    max_flips = MAX_FLIPS if max_flips is None else float(max_flips)
    max_dp = MAX_DP if max_dp is None else float(max_dp)
    max_nll_delta = MAX_NLL_DELTA if max_nll_delta is None else float(max_nll_delta)
    if precision not in PRECISIONS:
        raise OptionError(f"--precision {precision}: choose {', '.join(PRECISIONS)} (float32 is the reference)")
    if not 0.0 <= max_flips <= 1.0:
        raise OptionError(f"--max-flips {max_flips}: a fraction of the test rows in [0, 1] (0.005 = 0.5%)")
    if not 0.0 <= max_dp <= 1.0:
        raise OptionError(f"--max-dp {max_dp}: a probability difference in [0, 1] (0.02 = two points)")
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
    report, refused = judge(parity_rows(records), logits["float32"], logits[precision], meta["temperatures"],
                            max_flips=max_flips, max_dp=max_dp, max_nll_delta=max_nll_delta,
                            names=("float32", precision))
    doc = {
        "format": FORMAT, "precision": precision, "device": "cpu", "cpu": {"bf16_units": units, "detected": why},
        "split": "test", "rows": "original, canonical (as the server asks them)",
        "split_file": str(run.data_dir / "test.jsonl"), "max_flips": max_flips,
        "limits": {"max_flips": max_flips, "max_dp": max_dp, "max_nll_delta": max_nll_delta,
                   "flip_rule": "a flip counts when float32's top-two margin > noise_floor = 2 x max |dp| over the "
                                "rows whose decision did not flip"},
        "reference": "the run's export/ on the CPU, backbone float32 (scorer float32 in both)",
        "export": {k: meta.get(k) for k in IDENTITY}, "result": report, "passed": not refused, "refused": refused,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    path = write_json(run.export_dir / record_name(precision), doc)
    counted = f"{report['counted_flips']} of {report['flips']} flips beyond the noise floor {report['noise_floor']:.2g}"
    if refused:
        raise ParityRefused(f"the {precision} backbone fails the parity gate ({'; '.join(refused)}): "
                            f"{describe(report)}; {counted}; --dtype auto stays float32 (the record: {path})")
    say(f"precision: {precision} passed the gate: {describe(report)}; {counted}")
    return doc


__all__ = ["check_precision", "flip_rule", "refusals", "judge", "MAX_DP", "MAX_NLL_DELTA", "parity_verdict", "record_path", "record_name", "PRECISIONS", "FORMAT"]
