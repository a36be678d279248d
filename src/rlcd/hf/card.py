"""The model card (`export/hf/README.md`), generated from the export metadata and eval/evaluation.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

METRICS = ("accuracy", "nll", "brier", "ece", "ece_target")


def _f(x: Any) -> str:
    return "–" if x is None else f"{x:.4f}" if isinstance(x, float) else str(x)


# the Hub's `license:` ids of the backbone licences rlcd's presets record (anything else: `other` + its name)
HUB_LICENSE_IDS = {"Apache-2.0": "apache-2.0", "Gemma Terms of Use": "gemma"}


def backbone_license(bb: Mapping[str, Any]) -> dict | None:
    """The licence the backbone's weights come under, as its preset recorded it ({name, url, file}), else None."""
    lic = bb.get("license")
    return dict(lic) if isinstance(lic, Mapping) and lic.get("name") else None


def licence_file(bb: Mapping[str, Any]) -> Path | None:
    """The backbone licence's bundled copy (its `file`), when it exists on this machine: what travels beside a card
    (`rlcd export`'s hf/ directory, `rlcd ship`)."""
    lic = backbone_license(bb)
    return Path(lic["file"]) if lic and lic.get("file") and Path(lic["file"]).is_file() else None


def _license_lines(bb: Mapping[str, Any], prompt: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(front-matter lines, Backbone-section lines) for the backbone's licence and prompt frame."""
    lic = backbone_license(bb)
    if lic is None:
        front = []
        body = ["- weights licence: not recorded by the backbone's loader; the weights keep the licence of their "
                "source, not rlcd's"]
    else:
        hub = HUB_LICENSE_IDS.get(lic["name"])
        front = [f"license: {hub}"] if hub else ["license: other", f"license_name: {lic['name']}"]
        if lic.get("url"):
            front.append(f"license_link: {lic['url']}")
        copy = f"; a copy: `{lic['file'].rsplit('/', 1)[-1]}` beside this card" if lic.get("file") else ""
        link = f"[{lic['name']}]({lic['url']})" if lic.get("url") else lic["name"]
        body = [f"- weights licence: {link}{copy}. The merged backbone weights keep it (rlcd's own code is MIT): "
                "using or redistributing this model means accepting it"]
    frame = prompt.get("frame")
    if frame == "bos":
        body.append("- prompt frame: a base model without a chat template: each row is the BOS token followed by "
                    "rlcd's prompt text (state, question, options), no chat turns")
    elif frame == "chat":
        body.append("- prompt frame: the backbone tokenizer's chat template (one user turn)")
    return front, body


def model_card(meta: Mapping[str, Any], evaluation: Mapping[str, Any] | None, *, run_name: str) -> str:
    bb = meta.get("backbone") or {}
    recipe = meta.get("recipe") or {}
    front, licence = _license_lines(bb, bb.get("prompt") or {})
    lines = ["---", "library_name: transformers", "pipeline_tag: decision", "tags: [rlcd, typed-decisions]", *front,
             "---", "",
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
              f"revision `{bb.get('revision')}`; config sha256 `{bb.get('config_hash')}`", *licence,
              f"- selected checkpoint sha256: `{meta.get('checkpoint_sha256')}`", "",
              "## Intended use and limits", "",
              "- Decisions of the kinds and distributions it was trained on; probabilities are calibrated per "
              "question type on the calibration split, not per group or per question: check calibration on your "
              "own traffic before gating on a threshold.",
              "- A random-weight preset (`tiny`, `tiny-toy`, `tiny-llama`) is a test model: its answers mean nothing.",
              "- Not for decisions about people without human review; the model cannot say \"none of the options\".",
              ""]
    return "\n".join(lines)
