"""The model card (`export/hf/README.md`), generated from the export metadata and eval/evaluation.json."""

from __future__ import annotations

from typing import Any, Mapping

METRICS = ("accuracy", "nll", "brier", "ece", "ece_target")


def _f(x: Any) -> str:
    return "–" if x is None else f"{x:.4f}" if isinstance(x, float) else str(x)


def model_card(meta: Mapping[str, Any], evaluation: Mapping[str, Any] | None, *, run_name: str) -> str:
    bb = meta.get("backbone") or {}
    recipe = meta.get("recipe") or {}
    lines = ["---", "library_name: transformers", "pipeline_tag: decision", "tags: [rlcd, typed-decisions]", "---", "",
             f"# {run_name}: calibrated typed decisions (rlcd)", "",
             f"A `{meta.get('model')}` backbone (LoRA merged) with rlcd's candidate scorer, trained with the "
             f"`{recipe.get('objective')}` objective (sigma {recipe.get('sigma')}, ce_weight {recipe.get('ce_weight')}) "
             f"for {recipe.get('steps')} updates; the checkpoint of update {meta.get('selected_step')} was selected on "
             "dev group-macro accuracy. It answers `choice`, `noul` (yes/no) and `score` questions about a state with "
             "a probability for every option, in one forward pass per question, no text generated.", "",
             "## Use", "", "```python",
             "from transformers import pipeline", "",
             'decide = pipeline("decision", model="PATH/export/hf", trust_remote_code=True)',
             'decide({"state": "Order 1182: the parcel went to the wrong address.",',
             '        "questions": {"team": {"type": "choice", "instructions": "Which team?",',
             '                               "criteria": {"billing": None, "shipping": None}}}})',
             "```", "",
             "`rlcd serve RUN` answers the same requests over HTTP (`POST /v1/systemone`) faster: it runs the shared "
             "state once for all questions. Images are only supported there (the transformers path is text-only here).",
             "", "## Temperatures", "",
             "One temperature per question type, fitted on the calibration split (LBFGS on the soft cross-entropy), "
             "stored in `decision.json` and applied by transformers' decision API:", "",
             "| type | T |", "|---|---|"]
    lines += [f"| {t} | {v:.4f} |" for t, v in (meta.get("temperatures") or {}).items()]
    lines += [""]
    if evaluation:
        head = evaluation.get("headline_split", "test")
        raw, cal = evaluation.get("raw", {}).get("overall", {}), evaluation.get("calibrated", {}).get("overall", {})
        lines += [f"## Evaluation ({head} split, n = {evaluation.get('raw', {}).get('n')})", "",
                  "| metric | raw | calibrated |", "|---|---|---|"]
        lines += [f"| {m} | {_f(raw.get(m))} | {_f(cal.get(m))} |" for m in METRICS]
        mb = evaluation.get("majority_baseline") or {}
        if mb:
            lines += ["", f"Majority baseline accuracy: {_f(mb.get('accuracy'))}."]
        hashes = (evaluation.get("meta") or {}).get("data_hashes") or {}
        if hashes:
            lines += ["", "Data (sha256):", ""] + [f"- `{k}`: `{v}`" for k, v in sorted(hashes.items())]
        lines += [""]
    lines += ["## Recipe", "", "| field | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(recipe.items())]
    lines += ["", "## Backbone", "", f"- spec: `{meta.get('model')}`; preset `{bb.get('preset')}`, "
              f"revision `{bb.get('revision')}`; config sha256 `{bb.get('config_hash')}`",
              f"- selected checkpoint sha256: `{meta.get('checkpoint_sha256')}`", "",
              "## Intended use and limits", "",
              "- Decisions of the kinds and distributions it was trained on; probabilities are calibrated per "
              "question type on the calibration split, not per group or per question: check calibration on your "
              "own traffic before gating on a threshold.",
              "- A random-weight preset (`tiny`, `tiny-toy`, `tiny-llama`) is a test model: its answers mean nothing.",
              "- Not for decisions about people without human review; the model cannot say \"none of the options\".",
              ""]
    return "\n".join(lines)
