"""Report sections on the run itself: its data and recipe, and its training log (curves and the
RLCD diagnostics)."""

from __future__ import annotations

import math

from collections import Counter
from typing import Any, Callable

from rlcd.bootstrap import group_key
from rlcd.report import plots
from rlcd.report.context import Context
from rlcd.report.document import Bullets, Section, Table, Text, fmt
from rlcd.report.evaluation import evaluation_json
from rlcd.report.training_log import (has, has_diagnostics, last_value, mean_value, objective_types, reward_keys,
                                      selected_step, series, type_stat_series, type_stat_types)

ARM_FIELDS = ("objective", "sigma", "sigma_end", "ce_weight", "n_perturbations", "w_log", "w_spherical", "w_rps",
              "advantage_norm", "steps", "seed")


def data_and_recipe(ctx: Context) -> Section:
    s = Section("Data and recipe")
    s.add(Table(["split", "rows", "cases", "choice", "noul", "score", "groups", "headline"],
                [[split, len(rows), len({group_key(r) for r in rows}),
                  *(Counter(r["type"] for r in rows).get(t, 0) for t in ("choice", "noul", "score")),
                  len({r.get("group") for r in rows}), "yes" if split == ctx.head else ""]
                 for split, rows in ctx.preds.items()]))
    notes = list(ctx.notes)
    if ctx.stored is not None:
        same = evaluation_json(ctx.stored) == evaluation_json(ctx.ev)
        notes.append("`eval/evaluation.json` " + ("matches the prediction files exactly." if same else
                     "**differs** from what the prediction files give now (stale, edited, or written by an older "
                     "rlcd); the tables below are recomputed from the prediction files."))
    if notes:
        s.add(Bullets(notes))
    remote = _remote(ctx)
    if remote is not None:
        s.add(*remote)
    s.add(_recipe(ctx))
    init = _init(ctx)
    if init is not None:
        s.add(init)
    scalars = [(k, v) for k, v in sorted(ctx.meta.items()) if not isinstance(v, (dict, list))]
    if scalars:
        s.add(Text("Metadata:"), Table(["key", "value"], [[k, str(v)] for k, v in scalars]))
    hashes = ctx.meta.get("data_hashes")
    if isinstance(hashes, dict) and hashes:
        s.add(Text("Data hashes:"), Table(["file", "sha256"], [[k, f"`{v}`"] for k, v in sorted(hashes.items())]))
    return s


def _remote(ctx: Context) -> tuple[Text, Table] | None:
    """Who answered (`rlcd evaluate --remote`): the server, the model, when, and where every row went."""
    r = ctx.meta.get("remote")
    if not isinstance(r, dict):
        return None
    lost = ", ".join(f"{k} {v}" for k, v in (r.get("unanswered_by_kind") or {}).items()) or "none"
    rebuilt = ", ".join(f"{k}: {v}" for k, v in (r.get("reconstructed") or {}).items()) or "none"
    return (Text(f"A remote System One server answered these rows: model `{r.get('model')}` at `{r.get('url')}`, "
                 f"{r.get('started')} to {r.get('finished')} ({r.get('requests')} requests, {r.get('attempts')} "
                 f"attempts). Rows without a usable answer are listed in `unanswered.jsonl`; answers rebuilt without "
                 "probabilities are scored and counted."),
            Table(["rows read", "scored", "unanswered", "unanswered by kind", "reconstructed", "order votes"],
                  [[r.get("rows_read"), r.get("rows_scored"), r.get("rows_unanswered"), lost, rebuilt,
                    r.get("order_votes", 1)]]))


def _init(ctx: Context) -> Text | None:
    """Where the weights started (`rlcd train --init RUN`), from config.json; None for a fresh start."""
    init = (ctx.config or {}).get("init")
    if not isinstance(init, dict):
        return None
    return Text(f"Initialised from run `{init.get('run')}`: its `{init.get('checkpoint')}` checkpoint (update "
                f"{init.get('step')}, trainable weights sha256 `{init.get('weights_sha256')}`), with a fresh optimizer "
                "and learning-rate schedule.")


def _recipe(ctx: Context) -> Any:
    """The RLCD arm and every deviation from the pinned recipe (config.json; the metadata when it is gone)."""
    config = ctx.config or {}
    recipe = config.get("recipe") or {}
    deviations = config.get("recipe_deviations", ctx.meta.get("recipe_deviations")) or {}
    source = "`config.json`" if recipe else "the evaluation metadata (no `config.json` next to the predictions)"
    values = recipe or ctx.meta
    rows = [[k, str(values[k]), "pinned" if k not in deviations else f"deviates (pinned {deviations[k]['pinned']})"]
            for k in ARM_FIELDS if k in values]
    rows += [[k, str(d["value"]), f"deviates (pinned {d['pinned']})"] for k, d in sorted(deviations.items())
             if k not in ARM_FIELDS and isinstance(d, dict)]
    if config.get("model"):
        rows.insert(0, ["model", str(config["model"]), ""])
    if not rows:
        return Section("Recipe", level=3).add(Text("No recipe was recorded (no `config.json` next to the predictions "
                                                   "and no recipe fields in the evaluation metadata)."))
    return Section("Recipe", level=3).add(Text(f"From {source}:"), Table(["field", "value", ""], rows))


def training(ctx: Context) -> Section:
    s = Section("Training")
    if ctx.training is None:
        return s.add(Text("`metrics.jsonl` is missing: no training curves."))
    train, evals, bad = ctx.training
    s.add(Text(f"`metrics.jsonl`: {len(train)} training lines, {len(evals)} dev evaluations"
               + (f", {bad} unreadable line(s) skipped" if bad else "") + "."))
    select_by = ((ctx.config or {}).get("recipe") or {}).get("select_by", "macro_accuracy")
    chosen = selected_step(evals, ctx.meta, select_by)
    if train or evals:
        s.add(ctx.figures.add("training_curves", plots.training(train, evals, chosen, select_by), "training curves",
                              "Raw values faint, their exponential moving average solid (span: a tenth of the "
                              "points); the dotted line marks the selected step."))
    if evals:
        if select_by == "nll":
            best = min(evals, key=lambda e: (e.get("dev_nll", math.inf), e["step"]))
            line = f"Selection by dev NLL (`select_by=nll`): lowest dev NLL {fmt(best.get('dev_nll'))} at step {best['step']}"
        else:
            best = max(evals, key=lambda e: (e.get("dev_macro_accuracy") or -1.0, -e["step"]))
            line = f"Best dev macro accuracy {fmt(best.get('dev_macro_accuracy'))} at step {best['step']}"
        s.add(Text(line + (f"; selected step {ctx.meta['selected_step']}" if "selected_step" in ctx.meta else "") + "."))
        at = next((e for e in evals if e["step"] == chosen), None)
        if at is not None and "dev_nll" in at:
            types = sorted({k.split("/", 1)[1] for k in at if k.startswith("dev_nll/")})
            s.add(Table(["dev subset at the selected step", "NLL", "Brier", "ECE"],
                        [["all types", at.get("dev_nll"), at.get("dev_brier"), at.get("dev_ece")]]
                        + [[t, at.get(f"dev_nll/{t}"), at.get(f"dev_brier/{t}"), at.get(f"dev_ece/{t}")] for t in types]))
    return s.add(_dev_per_type(ctx, evals, chosen), _type_stats(ctx, train, chosen), _objective_per_type(ctx, train, chosen),
                 _diagnostics(ctx, train, chosen))


def _dev_per_type(ctx: Context, evals: list[dict], chosen: int | None) -> Section | None:
    """The dev curve per question type (accuracy and NLL at every evaluation), with its first and last values."""
    types = sorted({k.split("/", 1)[1] for e in evals for k in e if k.startswith("dev_nll/")})
    s = _figure_section(ctx, types, "Dev curve per type", "dev_per_type", lambda: plots.dev_per_type(evals, types, chosen),
                        "dev accuracy and NLL per type", "The frozen dev subset at every evaluation, per question type: "
                        "top-1 accuracy and NLL (raw, T = 1); the dotted line marks the selected step.")
    if s is None:
        return None
    return s.add(Table(["type", "dev accuracy (first → last)", "dev NLL (first → last)"],
                       [[t, _first_last(evals, f"dev_accuracy/{t}"), _first_last(evals, f"dev_nll/{t}")] for t in types]))


def _type_stats(ctx: Context, train: list[dict], chosen: int | None) -> Section | None:
    """Per-type entropy, max probability and effective candidate count over training (every objective)."""
    types = type_stat_types(train)
    s = _figure_section(ctx, types, "Output sharpness per type", "type_stats", lambda: plots.type_stats(train, chosen),
                        "per-type entropy, max p and effective K",
                        "Over each logged update's training rows (pooled over every DDP rank): mean entropy of the "
                        "predicted distribution, mean max probability, and the effective number of candidates "
                        "exp(H); EMA solid, raw faint.")
    if s is None:
        return None
    rows = []
    for t in types:
        first = [type_stat_series(train, t, k)[1] for k in ("entropy", "max_prob", "effective_candidates")]
        rows.append([t] + [f"{fmt(v[0], 3)} → {fmt(v[-1], 3)}" if v else "—" for v in first])
    return s.add(Table(["type", "entropy (first → last logged)", "max p", "effective candidates"], rows))


def _figure_section(ctx: Context, types: list[str], title: str, name: str, figure: Callable[[], Any], alt: str,
                    caption: str) -> Section | None:
    """A per-type subsection opening with its figure (drawn only when some type was logged), else None."""
    if not types:
        return None
    return Section(title, level=3).add(ctx.figures.add(name, figure(), alt, caption))


def _first_last(lines: list[dict], key: str) -> str:
    ys = series(lines, key)[1]
    return f"{fmt(ys[0], 3)} → {fmt(ys[-1], 3)}" if ys else "—"


def _objective_per_type(ctx: Context, train: list[dict], chosen: int | None) -> Section | None:
    """Which type drives the gradient: CE, policy term, reward and the logit-gradient split per type."""
    types = objective_types(train)
    s = _figure_section(ctx, types, "Objective per type", "objective_per_type",
                        lambda: plots.objective_per_type(train, chosen), "objective per type",
                        "Over each logged update's rows, pooled over every DDP rank: mean soft CE (every logged "
                        "update), and at the diagnostics cadence the mean total reward, the norm of the update loss's "
                        "gradient with respect to that type's logits and its share of the squared norm; EMA solid, "
                        "raw faint.")
    if s is None:
        return None
    rl = any(has(train, f"policy_loss/{t}") for t in types)
    head = ["type", "CE (first → last logged)"] + (["policy term (mean)", "reward (first → last)"] if rl else [])
    rows = []
    for t in types:
        row = [t, _first_last(train, f"ce/{t}")]
        if rl:
            row += [mean_value(train, f"policy_loss/{t}"), _first_last(train, f"reward/{t}/mean")]
        rows.append(row + [mean_value(train, f"grad_norm/{t}"), mean_value(train, f"grad_share/{t}")])
    s.add(Table(head + ["logit-gradient norm (mean)", "gradient share (mean)"], rows))
    return s.add(Text("The gradient is taken at the logits (d loss / d logits of the type's rows: policy + ce_weight "
                      "x CE for RLCD, CE alone for the CE arm), the signal each type sends into the network; the "
                      "shares of one update sum to 1. The parameter gradient norm of the curves above mixes the "
                      "types through the shared weights and is not split."))


def _diagnostics(ctx: Context, train: list[dict], chosen: int | None) -> Section:
    s = Section("RLCD diagnostics", level=3)
    if not has_diagnostics(train):
        return s.add(Text("No reward parts, advantage std or gradient diagnostics were logged (e.g. a CE-only run)."))
    s.add(ctx.figures.add("rlcd_diagnostics", plots.diagnostics(train, chosen), "RLCD diagnostics",
                          "Reward components per question type (line: mean over the update's samples, band: ± one "
                          "std), the advantage spread before normalisation, the share of normalised advantages "
                          "beyond ±3, and how the policy gradient relates to the CE gradient."))
    per_type = reward_keys(train)
    if per_type:
        rows = [[t, comp, last_value(train, f"reward/{t}/{comp}/mean"), last_value(train, f"reward/{t}/{comp}/std")]
                for t, comps in per_type.items() for comp in comps]
        s.add(Table(["type", "reward component", "mean (last logged)", "std (last logged)"], rows))
        s.add(Bullets([f"advantage std (last logged update): {fmt(last_value(train, 'adv_std'))}",
                       f"share of |normalised advantage| > 3: {fmt(last_value(train, 'adv_extreme_share'))}",
                       f"cos(RL grad, CE grad): {fmt(last_value(train, 'grad_cosine'))}"]))
    return s
