"""The `export/` artefact: what the predictor needs to rebuild a trained model, and nothing more.

`export/trainable.safetensors` holds the LoRA + scorer weights (unmerged; merged at load), and
`export/model.json` the backbone (preset or local dir, revision, config hash, seed of a random
tiny backbone), the head and LoRA configuration, the per-type temperatures and the label
conventions. A tiny preset is random-weight but deterministic from its seed; the backbone's
parameter fingerprint is recorded and checked at load so a silent mismatch cannot happen.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from rlcd import checkpoint as ckpt
from rlcd.device import Placement, apply_attention, resolve_placement
from rlcd.errors import RunError
from rlcd.model.build import build_model
from rlcd.model.fingerprint import FINGERPRINT_DTYPE, backbone_fingerprint  # noqa: F401 (public API here too)
from rlcd.run import Run, find_export  # noqa: F401 (find_export: public API here too)

FORMAT = "rlcd.export/1"
LABEL_CONVENTIONS = {
    "choice": "candidates in the order given by the question's criteria",
    "noul": ["false", "true"],
    "score": "levels '0'..'K-1' ascending, as listed in criteria",
}


log = logging.getLogger(__name__)  # what is loaded from where, before the seconds it takes (the CLI shows INFO)


def load_checkpoint_model(run: Run | Path, which: str = "best", *, merge: bool = True,
                          placement: Placement | None = None, backbone=None):
    """The run's model with the `which` checkpoint's trainable weights (merged for inference)."""
    run = run if isinstance(run, Run) else Run.open(run)
    placement = placement or resolve_placement("cpu")
    config = run.config()
    path = run.require_checkpoint(which)
    t0 = time.perf_counter()
    log.info("model: loading %s (backbone %s) onto %s", path, config["model"], placement)
    model = build_model(config, device=placement.torch_device, dtype=placement.torch_dtype, backbone=backbone)
    loaded = ckpt.load(path, map_location=placement.device)
    model.load_trainable_state_dict(loaded["weights"])
    if merge:
        model.merge()
    model.eval()
    apply_attention(model, placement)
    log.info("model: ready in %.1f s (update %s)", time.perf_counter() - t0, loaded["state"].get("step"))
    return model, config, loaded["state"]


def checkpoint_identity(state: dict, which: str) -> dict[str, Any]:
    """Which checkpoint an artefact holds: the dev-selected one ("best": its step and dev score) or the
    last one ("last": the step it was written at and the latest dev score)."""
    if which == "best":
        return {"checkpoint": "best", "selected_step": state.get("best_step"), "selection_score": state.get("best_score")}
    return {"checkpoint": which, "selected_step": state.get("step"), "selection_score": state.get("score")}


def write_export(run: Run, *, temperatures: dict[str, float], model, config: dict, state: dict,
                 which: str = "best") -> Path:
    out = run.export_dir
    out.mkdir(parents=True, exist_ok=True)
    src = run.require_checkpoint(which)
    shutil.copyfile(src / ckpt.WEIGHTS, out / "trainable.safetensors")
    meta: dict[str, Any] = {
        "format": FORMAT,
        "model": config["model"],
        "model_seed": config.get("model_seed", 0),
        "backbone": {k: v for k, v in model.info.items() if isinstance(v, (str, int, float, bool, type(None), dict))},
        "backbone_fingerprint": backbone_fingerprint(model),
        "backbone_fingerprint_rounding": FINGERPRINT_DTYPE,
        "recipe": config["recipe"],
        "temperatures": temperatures,
        "label_conventions": LABEL_CONVENTIONS,
        **checkpoint_identity(state, which),
        "checkpoint_sha256": ckpt.weights_sha256(src),
        "versions": config.get("versions"),
    }
    (out / "model.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    return out


def read_export_meta(path: Path) -> dict:
    meta_path = find_export(path) / "model.json"
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise RunError(f"{meta_path}: unsupported export format {meta.get('format')!r} (expected {FORMAT})")
    return meta


def load_export(path: Path, *, placement: Placement | None = None, backbone=None):
    """Rebuild the merged inference model and its metadata from `export/` (or a run dir)."""
    export_dir = find_export(path)
    meta = read_export_meta(export_dir)
    placement = placement or resolve_placement("cpu")
    t0 = time.perf_counter()
    log.info("model: loading export %s (backbone %s, selected update %s) onto %s", export_dir, meta.get("model"),
             meta.get("selected_step"), placement)
    model = build_model(meta, device=placement.torch_device, dtype=placement.torch_dtype, backbone=backbone)
    found = backbone_fingerprint(model, meta.get("backbone_fingerprint_rounding"))
    if found != meta["backbone_fingerprint"]:
        raise RuntimeError(f"{export_dir / 'model.json'}: the backbone built from {meta['model']!r} does not match "
                           "the one the model was trained on (parameter fingerprint differs); point at the same weights")
    model.load_trainable_state_dict(load_file(str(export_dir / "trainable.safetensors"), device=placement.device))
    model.merge()
    model.eval()
    apply_attention(model, placement)
    model.placement_reason = placement.reason
    log.info("model: ready in %.1f s", time.perf_counter() - t0)
    return model, meta
