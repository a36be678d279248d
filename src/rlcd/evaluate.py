"""Final evaluation of a run: merged best model -> raw predictions -> temperatures -> metrics.

Writes `eval/predictions-{dev,calibration,test}.jsonl` (raw logits, enough to regenerate every
number), fits one temperature per type on the calibration split only, writes
`eval/evaluation.json` (raw and calibrated side by side, with bootstrap intervals), `export/`,
`eval/report.md` and `eval/report.html`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from rlcd import checkpoint as ckpt
from rlcd.calibrate import fit_per_type
from rlcd.device import Placement, resolve_placement
from rlcd.export import load_checkpoint_model, write_export
from rlcd.run import Run, write_json
from rlcd.schema import Record, text_of

SPLITS = ("dev", "calibration", "test")
STATE_EXCERPT = 240  # characters of the state kept in a prediction row (the report's error analysis)


def state_excerpt(rec: Record) -> str:
    """The first STATE_EXCERPT characters of the state's prompt text (+ its image file, if any)."""
    text = " ".join(text_of(rec.state).split())
    text = text if len(text) <= STATE_EXCERPT else text[: STATE_EXCERPT - 1] + "…"
    return f"{text} [image {rec.image}]" if rec.image else text


@torch.no_grad()
def predict_rows(model, records: list[Record], collator, *, device="cpu", batch_size: int = 32,
                 split: str | None = None) -> list[dict[str, Any]]:
    """One prediction row per record: id, group, type, labels, target, posterior, raw logits, and for
    reading the errors the question's ``instructions`` and a ``state_excerpt`` (older prediction files
    lack these two; every reader treats them as optional)."""
    rows = []
    for i in range(0, len(records), batch_size):
        chunk = records[i:i + batch_size]
        logits = model(collator(chunk).to(device)).float().cpu()
        for j, rec in enumerate(chunk):
            k = rec.question.k
            row = {"id": rec.id, "group": rec.group, "type": rec.question.type, "labels": rec.question.labels,
                   "target": rec.target, "posterior": rec.posterior, "logits": logits[j, :k].tolist(),
                   "instructions": rec.question.instructions, "state_excerpt": state_excerpt(rec)}
            if split is not None:
                row["split"] = split
            if rec.case_id is not None:
                row["case_id"] = rec.case_id
            rows.append(row)
    # round-trip through JSON so in-memory rows equal what the files hold, bit for bit
    return json.loads(json.dumps(rows))


def _collator(model, data_dir: Path):
    from rlcd.model.collate import Collator

    return Collator(model.tokenizer, model.image_processor, image_root=data_dir)


def _records(config: dict, split: str) -> list[Record]:
    from rlcd.data.io import load_split

    data_dir = Path(config["data_dir"])
    return load_split(data_dir, split) if (data_dir / f"{split}.jsonl").is_file() else []


def _score(model, config: dict, split: str, records: list[Record], placement: Placement) -> list[dict]:
    return predict_rows(model, records, _collator(model, Path(config["data_dir"])), split=split,
                        device=placement.torch_device)


def _calibration_key(run: Run, placement: Placement) -> dict[str, Any]:
    """What the temperatures depend on: the selected checkpoint, the calibration data, the placement."""
    from rlcd.data.io import sha256_file

    cal = run.data_dir / "calibration.jsonl"
    return {"checkpoint_sha256": ckpt.weights_sha256(run.require_checkpoint("best")),
            "calibration_sha256": sha256_file(cal) if cal.is_file() else None, **placement.to_dict()}


def fit_temperatures(run: Run, calibration_rows: list[dict], placement: Placement) -> dict[str, Any]:
    """Fit the per-type temperatures on the calibration predictions and store them in eval/temperatures.json.

    The one calibration path: `rlcd calibrate RUN` ends here, and `rlcd evaluate RUN` reuses the stored
    temperatures when they were fitted on the same checkpoint, calibration data and placement (else it
    fits them here and stores them); the export carries the same numbers.
    """
    temps, infos = fit_per_type(calibration_rows)
    out = {"temperatures": temps, "calibration": infos, "n_rows": len(calibration_rows),
           **_calibration_key(run, placement)}
    write_json(run.temperatures_path, out)
    return out


def stored_temperatures(run: Run, placement: Placement) -> dict[str, Any] | None:
    """eval/temperatures.json when it matches this checkpoint, calibration data and placement."""
    if not run.temperatures_path.is_file():
        return None
    stored = json.loads(run.temperatures_path.read_text())
    key = _calibration_key(run, placement)
    return stored if all(stored.get(k) == v for k, v in key.items()) else None


def calibrate_run(run: Run | Path, *, placement: Placement | None = None) -> dict[str, Any]:
    """Fit per-type temperatures on the calibration partition with the merged best model."""
    run = run if isinstance(run, Run) else Run.open(run)
    placement = placement or resolve_placement("cpu")
    model, config, _ = load_checkpoint_model(run, "best", placement=placement)
    rows = _score(model, config, "calibration", _records(config, "calibration"), placement)
    return fit_temperatures(run, rows, placement)


def evaluate_run(run: Run | Path, *, placement: Placement | None = None,
                 print_fn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Score every held-out split, calibrate, write eval/ and export/, and render the report."""
    from rlcd.data.io import write_jsonl
    from rlcd.metrics import majority_baseline
    from rlcd.report import evaluation_from_predictions, write_evaluation, write_report
    from rlcd.train import data_hashes

    run = run if isinstance(run, Run) else Run.open(run)
    placement = placement or resolve_placement("cpu")
    say = print_fn or (lambda _: None)
    model, config, state = load_checkpoint_model(run, "best", placement=placement)
    records = {split: _records(config, split) for split in SPLITS}
    preds = {split: _score(model, config, split, records[split], placement) for split in SPLITS}
    for split, rows in preds.items():
        write_jsonl(run.predictions_path(split), rows)
    stored = stored_temperatures(run, placement)
    if stored is not None:
        say(f"temperatures: {run.temperatures_path} (fitted by `rlcd calibrate` on this checkpoint)")
    cal = stored or fit_temperatures(run, preds["calibration"], placement)
    temps, infos = cal["temperatures"], cal["calibration"]
    data_dir = Path(config["data_dir"])
    baseline = majority_baseline(_records(config, "train"), records["test"]) if records["test"] else None
    meta = {
        "run": str(run.root),
        "model": config["model"],
        "objective": config["recipe"]["objective"],
        "sigma": config["recipe"]["sigma"],
        "ce_weight": config["recipe"]["ce_weight"],
        "seed": config["recipe"]["seed"],
        "steps": config["recipe"]["steps"],
        "recipe_deviations": config.get("recipe_deviations", {}),
        "selected_step": state.get("best_step"),
        "selection_score": state.get("best_score"),
        "checkpoint_sha256": ckpt.weights_sha256(run.require_checkpoint("best")),
        "data_hashes": data_hashes(data_dir),
        "calibration": infos,
        "temperatures_source": str(run.temperatures_path.relative_to(run.root)),
        "placement": placement.to_dict(),
    }
    ev = evaluation_from_predictions(preds, temps, meta, majority_baseline=baseline)
    write_evaluation(run, ev)
    write_export(run, temperatures=temps, model=model, config=config, state=state)
    write_report(run, ev=ev)
    return ev


def print_summary(ev: dict[str, Any]) -> None:
    from rlcd.report import format_summary

    print(format_summary(ev))
