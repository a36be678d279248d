"""Final evaluation of a run: merged best model -> raw predictions -> temperatures -> metrics.

Writes `eval/predictions-{dev,calibration,test}.jsonl` (raw logits, enough to regenerate every
number), fits one temperature per type on the calibration split only, writes
`eval/evaluation.json` (raw and calibrated side by side), `export/` and `eval/report.md`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from rlcd import checkpoint as ckpt
from rlcd.calibrate import fit_per_type
from rlcd.export import load_checkpoint_model, write_export
from rlcd.schema import Record

SPLITS = ("dev", "calibration", "test")


@torch.no_grad()
def predict_rows(model, records: list[Record], collator, *, device="cpu", batch_size: int = 32,
                 split: str | None = None) -> list[dict[str, Any]]:
    """One prediction row per record: id, group, type, labels, target, posterior, raw logits."""
    rows = []
    for i in range(0, len(records), batch_size):
        chunk = records[i:i + batch_size]
        logits = model(collator(chunk).to(device)).float().cpu()
        for j, rec in enumerate(chunk):
            k = rec.question.k
            row = {"id": rec.id, "group": rec.group, "type": rec.question.type, "labels": rec.question.labels,
                   "target": rec.target, "posterior": rec.posterior, "logits": logits[j, :k].tolist()}
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


def _score(model, config: dict, split: str, records: list[Record]) -> list[dict]:
    return predict_rows(model, records, _collator(model, Path(config["data_dir"])), split=split)


def calibrate_run(run_dir: Path) -> dict[str, Any]:
    """Fit per-type temperatures on the calibration partition with the merged best model."""
    run_dir = Path(run_dir)
    model, config, _ = load_checkpoint_model(run_dir, "best")
    rows = _score(model, config, "calibration", _records(config, "calibration"))
    temps, infos = fit_per_type(rows)
    out = {"temperatures": temps, "calibration": infos, "n_rows": len(rows)}
    (run_dir / "eval").mkdir(parents=True, exist_ok=True)
    (run_dir / "eval" / "temperatures.json").write_text(json.dumps(out, indent=2, sort_keys=True))
    return out


def evaluate_run(run_dir: Path) -> dict[str, Any]:
    """Score every held-out split, calibrate, write eval/ and export/, and render the report."""
    from rlcd.data.io import write_jsonl
    from rlcd.metrics import majority_baseline
    from rlcd.report import evaluation_from_predictions, write_evaluation, write_report
    from rlcd.train import data_hashes

    run_dir = Path(run_dir)
    model, config, state = load_checkpoint_model(run_dir, "best")
    records = {split: _records(config, split) for split in SPLITS}
    preds = {split: _score(model, config, split, records[split]) for split in SPLITS}
    for split, rows in preds.items():
        write_jsonl(run_dir / "eval" / f"predictions-{split}.jsonl", rows)
    temps, infos = fit_per_type(preds["calibration"])
    data_dir = Path(config["data_dir"])
    baseline = majority_baseline(_records(config, "train"), records["test"]) if records["test"] else None
    meta = {
        "run": str(run_dir),
        "model": config["model"],
        "objective": config["recipe"]["objective"],
        "sigma": config["recipe"]["sigma"],
        "ce_weight": config["recipe"]["ce_weight"],
        "seed": config["recipe"]["seed"],
        "steps": config["recipe"]["steps"],
        "selected_step": state.get("best_step"),
        "selection_score": state.get("best_score"),
        "checkpoint_sha256": ckpt.weights_sha256(run_dir / "checkpoints" / "best"),
        "data_hashes": data_hashes(data_dir),
        "calibration": infos,
    }
    ev = evaluation_from_predictions(preds, temps, meta, majority_baseline=baseline)
    write_evaluation(run_dir, ev)
    write_export(run_dir, temperatures=temps, model=model, config=config, state=state)
    write_report(run_dir)
    return ev


def print_summary(ev: dict[str, Any]) -> None:
    from rlcd.report import format_summary

    print(format_summary(ev))
