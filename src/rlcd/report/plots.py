"""The report's figures, drawn with matplotlib's Agg canvas (no pyplot, no global backend switch).

Each function returns PNG bytes; ``rlcd.report.build`` saves them under ``eval/plots/`` for
report.md and inlines the same bytes in report.html.
"""

from __future__ import annotations

import io
import math
from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from rlcd import metrics as M
from rlcd.report.training_log import (COMPONENTS, REWARD_PARTS, TYPE_STATS, ema, has, objective_types, reward_keys,
                                      series, type_stat_series, type_stat_types)

Z95 = 1.959963984540054
COLORS = {"raw": "tab:red", "calibrated": "tab:blue"}
TYPE_COLORS = {"choice": "tab:blue", "noul": "tab:orange", "score": "tab:green"}
FEW = 5  # reliability bins with fewer rows are drawn hollow


def png(fig: Figure, **margins: float) -> bytes:
    """PNG bytes of ``fig``; ``margins`` go to ``subplots_adjust`` (tight_layout would double the drawing time)."""
    FigureCanvasAgg(fig)
    fig.subplots_adjust(**{"left": 0.07, "right": 0.98, "top": 0.93, "bottom": 0.1, "hspace": 0.35, "wspace": 0.25,
                           **margins})
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def wilson(p: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``p`` observed on ``n`` rows (always holding ``p``: at
    p = 0 or 1 the formula's end equals p only up to rounding)."""
    if n <= 0:
        return (float("nan"), float("nan"))
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(max(0.0, p * (1 - p) / n + z * z / (4 * n * n))) / denom
    return min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half))


def reliability(raw_block: Mapping, cal_block: Mapping, title: str, height: float = 6.0) -> bytes:
    """Hard-label and target-referenced reliability, raw vs calibrated, with 95% bin intervals and counts.

    Top row: mean accuracy per confidence bin against the bin's mean confidence; error bars are the
    Wilson interval of the bin (for the target-referenced mean of ``t[argmax p]`` in [0, 1] this
    bounds the binomial spread); bins with fewer than 5 rows are hollow. Bottom row: rows per bin.
    ``height`` (inches at 100 dpi): the headline's compact copy is lower than the full one.
    """
    fig = Figure(figsize=(11, height))
    axes = fig.subplots(2, 2, gridspec_kw={"height_ratios": [3, 1]}, sharex="col")
    width = 1 / M.N_BINS
    for col, (ref, name) in enumerate((("accuracy", "hard-label accuracy"),
                                       ("target_accuracy", "target-referenced accuracy t[argmax p]"))):
        ax, hist = axes[0, col], axes[1, col]
        ax.plot([0, 1], [0, 1], color="0.6", ls="--", lw=1, label="perfect")
        for offset, (label, block) in zip((-0.2, 0.2), (("raw", raw_block), ("calibrated", cal_block))):
            color = COLORS[label]
            bins = [b for b in block["reliability"] if b["count"]]
            xs = np.array([b["confidence"] for b in bins])
            ys = np.array([b[ref] for b in bins])
            ns = np.array([b["count"] for b in bins])
            lo_hi = np.array([wilson(y, n) for y, n in zip(ys, ns)]).reshape(-1, 2)
            ece = block["ece"] if ref == "accuracy" else block["ece_target"]
            ax.plot(xs, ys, color=color, lw=1.2, label=f"{label} (ECE {ece:.3f})")
            ax.errorbar(xs, ys, yerr=[ys - lo_hi[:, 0], lo_hi[:, 1] - ys], fmt="none", ecolor=color, alpha=0.5,
                        capsize=2)
            few = ns < FEW
            ax.scatter(xs[~few], ys[~few], s=28, color=color, zorder=3)
            ax.scatter(xs[few], ys[few], s=28, facecolors="white", edgecolors=color, zorder=3)
            centres = np.array([(b["lo"] + b["hi"]) / 2 for b in bins])
            bars = hist.bar(centres + offset * width, ns, width=0.4 * width, color=color, alpha=0.7, label=label)
            if len(bins) <= 15:
                hist.bar_label(bars, labels=[str(n) for n in ns], fontsize=6, padding=1)
        ax.set(xlim=(0, 1), ylim=(0, 1.02), ylabel=name)
        ax.set_title(f"{title}: {name.split(' t[')[0]}", fontsize=10)
        ax.legend(fontsize=8, loc="upper left")
        hist.set(xlim=(0, 1), xlabel="confidence (max p), 15 bins", ylabel="rows")
        hist.margins(y=0.3)
    return png(fig, hspace=0.08, bottom=0.54 / height, top=1 - 0.42 / height)


def coverage_risk(curves: Mapping[str, tuple[np.ndarray, np.ndarray]], title: str) -> bytes:
    fig = Figure(figsize=(6, 4.5))
    ax = fig.subplots()
    for (label, (cov, risk)), color in zip(curves.items(), ("tab:red", "tab:blue", "tab:green")):
        ax.step(cov, risk, where="post", color=color, label=f"{label} (AURC {M.aurc(cov, risk):.3f})")
    ax.set(xlim=(0, 1), ylim=(0, None), xlabel="coverage (fraction kept, thresholding max p)",
           ylabel="error rate of kept decisions", title=title)
    ax.legend(fontsize=8)
    return png(fig, left=0.12, bottom=0.12, top=0.92)


def group_accuracy(per_group: Mapping[str, Mapping], majority: Mapping[str, float] | None, title: str) -> bytes:
    groups = list(per_group)
    y = np.arange(len(groups))
    fig = Figure(figsize=(8, max(2.5, 0.45 * len(groups) + 1.5)))
    ax = fig.subplots()
    h = 0.4 if majority else 0.7
    ax.barh(y - (h / 2 if majority else 0), [per_group[g]["accuracy"] for g in groups], height=h,
            color="tab:blue", label="model top-1 accuracy")
    if majority:
        ax.barh(y + h / 2, [majority.get(g) or 0.0 for g in groups], height=h, color="0.6", label="majority baseline")
    ax.set_yticks(y, groups, fontsize=8)
    ax.invert_yaxis()
    ax.set(xlim=(0, 1), xlabel="accuracy", title=title)
    ax.legend(fontsize=8, loc="lower right")
    longest = max((len(g) for g in groups), default=10)
    return png(fig, left=min(0.5, 0.05 + 0.0115 * longest), bottom=0.7 / fig.get_figheight(),
               top=1 - 0.45 / fig.get_figheight())


def _curve(ax, lines: list[dict], key: str, label: str | None = None, color: str | None = None) -> bool:
    """One series: raw values faint, their EMA solid (points marked when there are few)."""
    xs, ys = series(lines, key)
    if not xs:
        return False
    line = ax.plot(xs, ys, lw=0.8, alpha=0.3, color=color, marker="." if len(xs) < 30 else None)[0]
    if len(xs) >= 10:
        ax.plot(xs, ema(ys), lw=1.4, color=line.get_color(), label=label or key)
    else:
        line.set_alpha(1.0)
        line.set_label(label or key)
    return True


def _panel(ax, lines: list[dict], keys: Sequence[str], title: str, selected: int | None,
           labels: Sequence[str] | None = None) -> bool:
    drawn = False
    for i, key in enumerate(keys):
        drawn |= _curve(ax, lines, key, labels[i] if labels else None)
    _finish(ax, title, drawn, selected, legend=len(keys) > 1)
    return drawn


def _finish(ax, title: str, drawn: bool, selected: int | None, legend: bool = True) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    if drawn:
        if selected is not None:
            ax.axvline(selected, color="0.3", ls=":", lw=1.2, label=f"selected step {selected}")
        if legend or selected is not None:
            ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="0.5")


def training(train: list[dict], evals: list[dict], selected: int | None, select_by: str = "macro_accuracy") -> bytes:
    """Loss, reward, dev accuracy, dev scoring rules, learning rates and gradient norm against the step; the panel
    of the score the run selects on (`select_by`) says so."""
    fig = Figure(figsize=(14, 7.5))
    axes = fig.subplots(2, 3).ravel()
    loss_keys = [k for k in ("ce_loss", "loss") if has(train, k)]
    _panel(axes[0], train, loss_keys or ["loss"], "cross-entropy / loss (EMA, raw faint)", selected)
    _panel(axes[1], train, ["reward_mean"], "reward (mean)", selected)
    by_nll = select_by == "nll"
    _panel(axes[2], evals, ["dev_macro_accuracy"], "dev macro accuracy" + ("" if by_nll else " (selection score)"),
           selected)
    _panel(axes[3], evals, ["dev_nll", "dev_brier", "dev_ece"],
           "dev NLL / Brier / ECE" + (" (selection: NLL)" if by_nll else ""), selected)
    _panel(axes[4], train, ["lr_lora", "lr_head"], "learning rate", selected)
    _panel(axes[5], train, ["grad_norm"], "gradient norm (before clipping)", selected)
    return png(fig, left=0.06, wspace=0.22, bottom=0.08, hspace=0.3)


def dev_per_type(evals: list[dict], types: Sequence[str], selected: int | None) -> bytes:
    """The dev curve per question type: top-1 accuracy and NLL at every dev evaluation."""
    fig = Figure(figsize=(11, 3.8))
    axes = fig.subplots(1, 2).ravel()
    for ax, metric, title in ((axes[0], "accuracy", "dev accuracy per type"), (axes[1], "nll", "dev NLL per type")):
        _panel(ax, evals, [f"dev_{metric}/{t}" for t in types], title, selected, labels=list(types))
    return png(fig, left=0.07, wspace=0.22, bottom=0.14)


def diagnostics(train: list[dict], selected: int | None) -> bytes:
    """RLCD diagnostics: reward components per type (mean +- std), advantage spread, gradient geometry."""
    fig = Figure(figsize=(14, 7.5))
    axes = fig.subplots(2, 4).ravel()
    per_type = reward_keys(train)
    for ax, comp in zip(axes[:3], COMPONENTS):
        drawn = False
        for t, comps in per_type.items():
            if comp not in comps:
                continue
            xs, mean = series(train, f"reward/{t}/{comp}/mean")
            _, std = series(train, f"reward/{t}/{comp}/std")
            color = TYPE_COLORS.get(t)
            ax.plot(xs, mean, color=color, lw=1.3, marker="." if len(xs) < 30 else None, label=t)
            if len(std) == len(mean):
                m, s = np.asarray(mean), np.asarray(std)
                ax.fill_between(xs, m - s, m + s, color=color, alpha=0.15)
            drawn = True
        if not drawn and not per_type:  # an older log: pooled means only
            drawn = _curve(ax, train, REWARD_PARTS[COMPONENTS.index(comp)], "all types (pooled)")
        _finish(ax, f"reward: {comp} (mean ± std per type)", drawn, selected)
    _panel(axes[3], train, ["adv_std", "advantage_std"], "advantage std (before normalising)", selected,
           labels=["update (pooled)", "mean over micro-batches"])
    _panel(axes[4], train, ["adv_extreme_share"], "share of |normalised advantage| > 3", selected)
    type_keys = [f"adv_std/{t}" for t in per_type]
    _panel(axes[5], train, type_keys, "advantage std per type", selected, labels=list(per_type))
    _panel(axes[6], train, ["grad_cosine"], "cos(RL grad, CE grad)", selected)
    _panel(axes[7], train, ["grad_norm_ratio"], "|RL grad| / |CE grad|", selected)
    return png(fig, left=0.05, wspace=0.28, bottom=0.08, hspace=0.3)


def type_stats(train: list[dict], selected: int | None) -> bytes:
    """Entropy, max probability and effective candidate count exp(H) of the training rows, per type."""
    fig = Figure(figsize=(14, 3.6))
    axes = fig.subplots(1, 3)
    titles = {"entropy": "mean entropy H (nats)", "max_prob": "mean max probability",
              "effective_candidates": "effective candidates exp(H)"}
    types = type_stat_types(train)
    for ax, stat in zip(axes, TYPE_STATS):
        drawn = False
        for t in types:
            xs, ys = type_stat_series(train, t, stat)
            if not xs:
                continue
            color = TYPE_COLORS.get(t)
            ax.plot(xs, ys, lw=0.8, alpha=0.3 if len(xs) >= 10 else 1.0, color=color,
                    marker="." if len(xs) < 30 else None, label=None if len(xs) >= 10 else t)
            if len(xs) >= 10:
                ax.plot(xs, ema(ys), lw=1.4, color=color, label=t)
            drawn = True
        _finish(ax, f"{titles[stat]} per type", drawn, selected)
    return png(fig, left=0.05, wspace=0.22, bottom=0.15, top=0.88)


def objective_per_type(train: list[dict], selected: int | None) -> bytes:
    """CE, total reward, logit-gradient norm and gradient share per question type against the step."""
    fig = Figure(figsize=(14, 3.6))
    axes = fig.subplots(1, 4)
    types = objective_types(train)
    panels = (("ce/{}", "soft CE per type"), ("reward/{}/mean", "total reward per type (mean)"),
              ("grad_norm/{}", "‖dL/dlogits‖ per type"), ("grad_share/{}", "share of ‖dL/dlogits‖² per type"))
    for ax, (key, title) in zip(axes, panels):
        drawn = False
        for t in types:
            drawn |= _curve(ax, train, key.format(t), t, TYPE_COLORS.get(t))
        _finish(ax, title, drawn, selected)
    axes[3].set_ylim(0, 1)
    return png(fig, left=0.05, wspace=0.25, bottom=0.15, top=0.88)


def accuracy_by_k(table: Sequence[Mapping[str, Any]]) -> bytes:
    """Accuracy per number of candidates K with its 95% interval, against chance 1/K."""
    fig = Figure(figsize=(7, 3.8))
    ax = fig.subplots()
    ks = np.array([r["k"] for r in table], dtype=float)
    acc = np.array([r["accuracy"] for r in table])
    lo_hi = np.array([wilson(r["accuracy"], r["n"]) for r in table]).reshape(-1, 2)
    ax.errorbar(ks, acc, yerr=[acc - lo_hi[:, 0], lo_hi[:, 1] - acc], fmt="o-", color="tab:blue", capsize=3,
                label="model (Wilson 95%)")
    ax.plot(ks, 1 / ks, "k--", lw=1, label="chance 1/K")
    for k, a, r in zip(ks, acc, table):
        ax.annotate(f"n={r['n']}", (k, a), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set(ylim=(0, 1.05), xlabel="number of candidates K", ylabel="top-1 accuracy", title="accuracy by K")
    ax.legend(fontsize=8)
    return png(fig, left=0.1, bottom=0.14, top=0.9)


def learning_curve(steps: Sequence[int], dev_gap: Sequence[float], dev_uniform: float, test: Mapping[str, Any],
                   selected: int | None, split: str = "test") -> bytes:
    """Dev NLL above the Bayes floor against the update, the floor (0) and the uniform answer as lines, and the
    final calibrated `split` point with its 95% interval (at the selected step, else the last)."""
    fig = Figure(figsize=(7.5, 4.2))
    ax = fig.subplots()
    ax.plot(steps, dev_gap, marker="o", ms=3, lw=1.4, color="C0", label="dev NLL (raw) above the floor")
    ax.axhline(dev_uniform, color="C3", ls="--", lw=1.2, label=f"uniform answer (dev) {dev_uniform:.3f}")
    ax.axhline(0.0, color="0.2", ls="-", lw=1.0, label="Bayes floor")
    x = selected if selected is not None else steps[-1]
    lo, hi = test.get("ci95") or (None, None)
    gap = float(test["gap"])
    err = None if lo is None or hi is None else [[gap - lo], [hi - gap]]
    ax.errorbar([x], [gap], yerr=err, fmt="s", color="C2", ms=7, capsize=5, lw=1.6,
                label=f"{split}, calibrated {gap:.3f} (95% CI)")
    ax.plot([x], [float(test["uniform_gap"])], marker="x", color="C3", ms=8, ls="none",
            label=f"uniform answer ({split}) {float(test['uniform_gap']):.3f}")
    ax.set(xlabel="update", ylabel="NLL above the Bayes floor (nats)",
           title="Learning curve: the model against no learning (uniform) and all there is to learn (floor)")
    ax.title.set_fontsize(9)
    top = max([*dev_gap, dev_uniform, gap if hi is None else hi])
    ax.set_ylim(-0.05, min(top, 3 * dev_uniform) * 1.1 + 0.05)
    ax.legend(fontsize=7, loc="upper right")
    return png(fig, left=0.1, bottom=0.12)
