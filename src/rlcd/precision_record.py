"""The bf16 parity record `export/precision-<precision>.json`: where it lives and whether it passed for the export
that is there now. Split from `rlcd.precision` (the gate, which scores through the model) so that `rlcd.device`,
low in the import order, can read a verdict without importing the model."""

from __future__ import annotations

import json
from pathlib import Path

FORMAT = "rlcd.precision/1"
PRECISIONS = ("bfloat16",)
IDENTITY = ("checkpoint_sha256", "backbone_fingerprint", "selected_step")


def record_name(precision: str = "bfloat16") -> str:
    return f"precision-{precision}.json"


def record_path(run: str | Path, precision: str = "bfloat16") -> Path:
    """`export/precision-<precision>.json` of a run directory (or of an export directory)."""
    from rlcd.run import find_export

    return find_export(Path(run)) / record_name(precision)


def parity_verdict(run: str | Path, precision: str = "bfloat16") -> tuple[bool, str]:
    """(passed, why) of the run's parity record: False when there is none, it is unreadable, it measured another
    export than the one there now, or its gate refused."""
    from rlcd.run import find_export

    try:
        export_dir = find_export(Path(run))
    except Exception:  # noqa: BLE001 - no export: nothing to serve in bf16 either
        return False, "the run has no export"
    path = export_dir / record_name(precision)
    if not path.is_file():
        return False, f"no {precision} parity record (rlcd export RUN --precision {precision})"
    try:
        doc = json.loads(path.read_text())
        meta = json.loads((export_dir / "model.json").read_text())
    except (OSError, ValueError):
        return False, f"{path.name} is unreadable"
    if any(doc.get("export", {}).get(k) != meta.get(k) for k in IDENTITY):
        return False, (f"its {precision} parity record measured another export (rerun rlcd export RUN "
                       f"--precision {precision})")
    r = doc.get("result") or {}
    counts = f"{r.get('flips')}/{r.get('rows')} test decisions flipped"
    if r.get("counted_flips") is not None:  # the flip rule: a flip within the noise floor is a near tie, not counted
        counts = (f"{r['counted_flips']}/{r.get('rows')} test decisions flipped beyond the noise floor "
                  f"{float(r.get('noise_floor') or 0.0):.2g}; {int(r.get('flips') or 0) - int(r['counted_flips'])} "
                  "near ties not counted")
    if not doc.get("passed"):
        return False, f"its {precision} parity gate refused ({counts})"
    return True, f"its {precision} parity passed ({counts})"
