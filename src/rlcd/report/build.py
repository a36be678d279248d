"""``write_report``: eval/report.md, eval/report.html and eval/plots/*.png from a run's files.

Inputs (all under the run directory):

- ``eval/predictions-<split>.jsonl`` (required): prediction rows (docs/ARCHITECTURE.md).
- ``eval/evaluation.json`` (optional): read for ``temperatures``, ``meta`` and ``majority_baseline``,
  the inputs that are not in the prediction files. Without it the report fits temperatures on
  ``predictions-calibration.jsonl`` (or uses T = 1 when that is missing too) and says so.
- ``metrics.jsonl`` (optional): the training log (``rlcd.report.training_log``).
- ``config.json`` (optional): the recipe section.
- ``eval/thresholds.json`` (optional): the gating section (``rlcd gate``), read as written.
- ``eval/probe-order.json`` (optional): the order-fragile questions (``rlcd probe order``), read as written.
- ``eval/probe-coherence.json`` (optional): the coherence of derived forms (``rlcd probe coherence``), read as written.

Every number is recomputed from these files, so ``rlcd report RUN`` regenerates the whole report
without a model. Both documents come from the same sections (``rlcd.report.document``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from rlcd.errors import RunError
from rlcd.report import (advantage_sections, coherence_sections, error_sections, gate_sections, learning_sections,
                         metrics_sections, order_sections, run_sections, verdict)
from rlcd.report.notes import result_notes
from rlcd.report.context import Context, FigureWriter, read_config
from rlcd.report.document import Section, Text, to_html, to_markdown
from rlcd.report.evaluation import as_run, evaluation_from_predictions, load_predictions
from rlcd.report.training_log import read_training_log
from rlcd.run import Run
from rlcd.schema import QUESTION_TYPES

# The headline (verdict lines, headline table, overall reliability) leads: one screen says what the run
# achieved; the details follow, and what the run was (data, recipe, metadata, hashes) comes last. Where the rows
# carry a known posterior (synth data, `make demo`) the learning curve comes first: dev NLL against updates between
# the uniform answer and the Bayes floor, and the final test point.
SECTIONS = (
    learning_sections.learning_curve,
    verdict.summary,
    metrics_sections.temperatures,
    metrics_sections.per_type,
    metrics_sections.ordinal,
    metrics_sections.majority,
    metrics_sections.posterior,
    metrics_sections.per_group,
    metrics_sections.other_splits,
    metrics_sections.reliability,
    gate_sections.gates,
    order_sections.fragile,
    coherence_sections.coherence,
    error_sections.error_analysis,
    run_sections.training,
    advantage_sections.amplified,
    run_sections.data_and_recipe,
)


def _stored_inputs(run: Run, preds: Mapping[str, list]) -> tuple[dict, dict, Any, list[str], dict | None]:
    """(temperatures, meta, majority baseline, notes, stored evaluation) for the report."""
    notes: list[str] = []
    path = run.evaluation_path
    if path.exists():
        stored = json.loads(path.read_text(encoding="utf-8"))
        return (stored.get("temperatures") or {}, stored.get("meta") or {}, stored.get("majority_baseline"),
                notes, stored)
    notes.append("`eval/evaluation.json` is missing: no metadata and no majority baseline;")
    if preds.get("calibration"):
        from rlcd.calibrate import fit_per_type

        temps, infos = fit_per_type(preds["calibration"])
        notes.append("temperatures were fitted here on `predictions-calibration.jsonl`.")
        return temps, {"calibration": infos}, None, notes, None
    notes.append("no calibration predictions either, so calibrated = raw (T = 1).")
    return {t: 1.0 for t in QUESTION_TYPES}, {}, None, notes, None


def _out_flag(run: Run) -> str:
    """` --out NAME` for an eval-NAME/ directory (`rlcd evaluate RUN --data OTHER`), else nothing."""
    return f" --out {run.eval_name[len('eval-'):]}" if run.eval_name.startswith("eval-") else ""


def write_report(run: Run | str | Path, *, ev: Mapping[str, Any] | None = None) -> Path:
    """Write ``eval/plots/*.png``, ``eval/report.md`` and ``eval/report.html``; returns the report.md path.

    Needs at least one ``eval/predictions-<split>.jsonl``; every other input is optional and its
    section says what is missing. ``ev``: the evaluation content when the caller has just built it
    from the same prediction rows (``rlcd evaluate``), so the bootstrap does not run twice.
    """
    run = as_run(run)
    preds = load_predictions(run)
    if not preds:
        raise RunError(f"{run.eval_dir}: no predictions-<split>.jsonl files; run `rlcd evaluate {run.root}` first")
    temps, meta, majority, notes, stored = _stored_inputs(run, preds)
    if ev is None:
        ev = evaluation_from_predictions(preds, temps, meta, majority_baseline=majority)
    notes = [*(f"**Note:** {n}." for n in result_notes(ev.get("meta"))), *notes]
    log = run.metrics_path
    ctx = Context(run=run, preds=preds, ev=dict(ev), notes=notes, stored=stored, figures=FigureWriter(run.plots_dir),
                  training=read_training_log(log) if log.exists() else None, config=read_config(run))
    sections = [s for s in (fn(ctx) for fn in SECTIONS) if s is not None]
    intro = Section("About this report").add(Text(
        f"Regenerate with `rlcd report {ctx.name}{_out_flag(run)}`; every number and plot comes from `eval/predictions-*.jsonl`, the "
        "temperatures, `metrics.jsonl` and `config.json`. `report.md` links the PNGs under `plots/`; `report.html` "
        "holds the same content in one file (images inline, no network)."))
    sections = sections + [intro]
    title = f"rlcd evaluation report: {ctx.name}"
    run.report_md.write_text(to_markdown(title, sections), encoding="utf-8")
    lead = 2 if sections and sections[0].title == "Learning curve" else 1  # ... and the verdict: before the contents
    run.report_html.write_text(to_html(title, sections, lead=lead), encoding="utf-8")
    return run.report_md
