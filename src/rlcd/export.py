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
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from rlcd import checkpoint as ckpt

FORMAT = "rlcd.export/1"
LABEL_CONVENTIONS = {
    "choice": "candidates in the order given by the question's criteria",
    "noul": ["false", "true"],
    "score": "levels '0'..'K-1' ascending, as listed in criteria",
}


def backbone_fingerprint(model) -> str:
    """sha256 over a few tensors neither LoRA nor merging touches (embeddings, vision tower).

    Catches a different random init or base model; identical before and after `merge()`.
    """
    h = hashlib.sha256()
    named = [(n, p) for n, p in model.backbone.named_parameters()
             if "lora_" not in n and ("embed_tokens" in n or "visual" in n)]
    for _, p in named[:4]:  # names differ with and without the peft wrapper; bytes do not
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def build_model(config: dict, *, device: str | torch.device = "cpu", dtype=torch.float32):
    from rlcd.model.decision import DecisionModel

    recipe = config["recipe"]
    model = DecisionModel.from_backbone_spec(config["model"], seed=config.get("model_seed", 0), dtype=dtype,
                                             proj_dim=recipe["proj_dim"], centring=recipe["centring"])
    return model.to(device)


def load_checkpoint_model(run_dir: Path, which: str = "best", *, merge: bool = True, device="cpu"):
    """The run's model with the `which` checkpoint's trainable weights (merged for inference)."""
    run_dir = Path(run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    model = build_model(config, device=device)
    loaded = ckpt.load(run_dir / "checkpoints" / which, map_location=str(device))
    model.load_trainable_state_dict(loaded["weights"])
    if merge:
        model.merge()
    model.eval()
    return model, config, loaded["state"]


def write_export(run_dir: Path, *, temperatures: dict[str, float], model, config: dict, state: dict,
                 which: str = "best") -> Path:
    run_dir = Path(run_dir)
    out = run_dir / "export"
    out.mkdir(parents=True, exist_ok=True)
    src = ckpt.resolve(run_dir / "checkpoints" / which)
    shutil.copyfile(src / ckpt.WEIGHTS, out / "trainable.safetensors")
    meta: dict[str, Any] = {
        "format": FORMAT,
        "model": config["model"],
        "model_seed": config.get("model_seed", 0),
        "backbone": {k: v for k, v in model.info.items() if isinstance(v, (str, int, float, bool, type(None), dict))},
        "backbone_fingerprint": backbone_fingerprint(model),
        "recipe": config["recipe"],
        "temperatures": temperatures,
        "label_conventions": LABEL_CONVENTIONS,
        "selected_step": state.get("best_step"),
        "selection_score": state.get("best_score"),
        "checkpoint_sha256": ckpt.weights_sha256(run_dir / "checkpoints" / which),
        "versions": config.get("versions"),
    }
    (out / "model.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    return out


def load_export(export_dir: Path, *, device="cpu"):
    """Rebuild the merged inference model and its metadata from `export/` (or a run dir)."""
    export_dir = Path(export_dir)
    if (export_dir / "export" / "model.json").is_file():
        export_dir = export_dir / "export"
    meta_path = export_dir / "model.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{export_dir} has no model.json: run `rlcd evaluate RUN` first to write export/")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path}: unsupported export format {meta.get('format')!r} (expected {FORMAT})")
    model = build_model(meta, device=device)
    found = backbone_fingerprint(model)
    if found != meta["backbone_fingerprint"]:
        raise RuntimeError(f"{meta_path}: the backbone built from {meta['model']!r} does not match the one the "
                           "model was trained on (parameter fingerprint differs); point at the same weights")
    model.load_trainable_state_dict(load_file(str(export_dir / "trainable.safetensors"), device=str(device)))
    model.merge()
    model.eval()
    return model, meta
