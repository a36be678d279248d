"""The `export/` artefact: what the predictor needs to rebuild a trained model, and nothing more.

`export/trainable.safetensors` holds the LoRA + scorer weights (unmerged; merged at load), and
`export/model.json` the backbone (preset or local dir, revision, config hash, seed of a random
tiny backbone), the head and LoRA configuration, the per-type temperatures and the label
conventions. A tiny preset is random-weight but deterministic from its seed; the backbone's
parameter fingerprint is recorded and checked at load so a silent mismatch cannot happen.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from rlcd import checkpoint as ckpt
from rlcd.device import Placement, resolve_placement
from rlcd.errors import RunError
from rlcd.model.build import build_model
from rlcd.run import Run, find_export  # noqa: F401 (find_export: public API here too)

FORMAT = "rlcd.export/1"
LABEL_CONVENTIONS = {
    "choice": "candidates in the order given by the question's criteria",
    "noul": ["false", "true"],
    "score": "levels '0'..'K-1' ascending, as listed in criteria",
}


FINGERPRINT_DTYPE = "bfloat16"

log = logging.getLogger(__name__)  # what is loaded from where, before the seconds it takes (the CLI shows INFO)


def backbone_fingerprint(model, rounding: str | None = FINGERPRINT_DTYPE) -> str:
    """sha256 over a few tensors neither LoRA nor merging touches (embeddings, vision tower if any).

    Catches a different random init or base model; identical before and after `merge()`. The values
    are rounded to bfloat16 first, so a model evaluated on a GPU in bfloat16 and served on a CPU in
    float32 has one fingerprint (`rounding=None`: the float32 bytes of exports written before that).
    """
    h = hashlib.sha256()
    named = [(n, p) for n, p in model.backbone.named_parameters()
             if "lora_" not in n and ("embed_tokens" in n or "visual" in n)]
    if not named:  # a decoder that names its embeddings otherwise (wte, word_embeddings, ...)
        named = [("input_embeddings", model.backbone.get_input_embeddings().weight)]
    for _, p in named[:4]:  # names differ with and without the peft wrapper; bytes do not
        t = p.detach()
        if rounding:
            t = t.to(getattr(torch, rounding))
        h.update(t.float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


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
    log.info("model: ready in %.1f s", time.perf_counter() - t0)
    return model, meta
