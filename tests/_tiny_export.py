"""A tiny `export/` artefact built without training, for the predictor / server / bench tests.

`make_tiny_export(run_dir)` builds `DecisionModel.from_backbone_spec("tiny-toy", seed=0)`, sets the
scorer's centring buffers from a few fixed rows, perturbs every trainable tensor deterministically
(LoRA B matrices get small Gaussian values, the scorer projections are scaled up) so predictions are
far from uniform, writes a minimal run dir (`config.json`, `checkpoints/best`) and then
`export/` with `write_export` and the temperatures {choice 1.7, noul 0.6, score 2.3}.

`tiny_export(base)` / `tiny_predictor(base)` memoise the run dir and the loaded `Predictor` per
process, so several test modules share one build.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TEMPERATURES = {"choice": 1.7, "noul": 0.6, "score": 2.3}
MODEL = "tiny-toy"
SEED = 0

_STATES = [
    "The parcel arrived two weeks late and the box was damaged.",
    {"ticket": 42, "text": "Refund requested for a blue jacket, size L.", "priority": "high"},
    "Customer asks whether the store ships to Norway.",
    "Invoice 1193 was paid twice by bank transfer.",
]


def _calibration_records():
    from rlcd.schema import Question, Record

    qs = [
        Question(type="choice", instructions="Which department should handle this?",
                 criteria=["billing", "shipping", "returns", "sales"]),
        Question(type="noul", instructions="Is the customer angry?"),
        Question(type="score", instructions="How urgent is it?", criteria=["not", "a bit", "quite", "very"]),
    ]
    out = []
    for i, st in enumerate(_STATES):
        for j, q in enumerate(qs):
            out.append(Record(id=f"c{i}-{j}", source="toy", task="t", state=st, question=q,
                              target=[1.0 / q.k] * q.k))
    return out


@torch.no_grad()
def build_tiny_model(seed: int = SEED, model_spec: str = MODEL):
    """The perturbed tiny-toy DecisionModel (unmerged, eval mode)."""
    from rlcd.model.build import build_model

    model = build_model({"model": model_spec, "model_seed": seed, "recipe": {}})
    model.eval()
    gen = torch.Generator().manual_seed(1234 + seed)
    sd = model.trainable_state_dict()
    new = {}
    for name in sorted(sd):
        t = sd[name]
        if "lora_B" in name:
            t = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype) * 0.05
        elif name.startswith("head.w_"):
            t = t * 6.0
        new[name] = t
    model.load_trainable_state_dict(new)
    collator = model.collator()
    model.init_centring([collator(_calibration_records())])
    model.eval()
    return model


def make_tiny_export(run_dir: Path, *, seed: int = SEED, model_spec: str = MODEL) -> Path:
    """Write a minimal run dir with `checkpoints/best` and `export/`; returns `run_dir`."""
    from rlcd import checkpoint
    from rlcd.export import write_export
    from rlcd.recipe import Recipe
    from rlcd.run import Run

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(seed, model_spec)
    config = {"model": model_spec, "model_seed": seed, "recipe": Recipe().to_dict()}
    (run_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    state = {"best_step": 0, "best_score": 0.0}
    checkpoint.save(run_dir / "checkpoints" / "best", weights=model.trainable_state_dict(), optimizer=None,
                    state=state)
    write_export(Run(run_dir), temperatures=dict(TEMPERATURES), model=model, config=config, state=state)
    return run_dir


def make_tiny_export_with_test_split(base: Path) -> Path:
    """A tiny-llama export whose config names a synthesised processed data dir (120 cases, seed 3): what the
    parity gates (ONNX, bf16) score their test split on."""
    from conftest import synth_processed

    data = synth_processed(Path(base) / "data", 120, 3)
    run = make_tiny_export(Path(base) / "run", model_spec="tiny-llama")
    cfg = json.loads((run / "config.json").read_text())
    cfg["data_dir"] = str(data)
    (run / "config.json").write_text(json.dumps(cfg))
    return run


_RUNS: dict[str, Path] = {}
_PREDICTORS: dict[str, object] = {}


def tiny_export(base: Path) -> Path:
    """The process-wide tiny run dir (built under `base` on first use)."""
    if "run" not in _RUNS:
        _RUNS["run"] = make_tiny_export(Path(base) / "tiny-run")
    return _RUNS["run"]


def tiny_predictor(base: Path):
    """The process-wide `Predictor` on the tiny export (loaded once)."""
    from rlcd.predict import Predictor

    if "p" not in _PREDICTORS:
        _PREDICTORS["p"] = Predictor.from_run(tiny_export(base))
    return _PREDICTORS["p"]
