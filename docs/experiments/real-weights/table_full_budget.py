"""Tables, summary JSON and plots of the full-budget section of docs/experiments/real-weights.md (issue 44).

    bash docs/experiments/real-weights/collect-full-budget.sh      # runs/rw6 -> full-budget/
    python docs/experiments/real-weights/table_full_budget.py [DIR]

DIR (default: `full-budget/` beside this script) holds what the collect script copied from runs/rw6: per run
(`head`, `control`, `top4`; `top4-h200`, the GPU's unfinished arm, has no evaluation) `<run>.evaluation.json.gz`, `<run>.metrics.jsonl.gz` and `<run>.config.json`, and the
`compare-A-vs-B-METRIC[-TYPE].json` files of `rlcd compare`. The earlier rows on the same benchmark seed come from
`top-layers/confirm/` (the issue-34 confirmation: unbalanced candidate orders, 1,200 updates). Prints the tables
(markdown), writes `summary.json` (every number the page quotes), `dev_curves.png` and `gaps.png` into DIR.
Works on a partial DIR (a run still training: its dev curve only).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
from table_head_only import TYPES, get

HERE = Path(__file__).resolve().parent
RUNS = {"head": "head only, RL+CE, head LR 5e-3 (the init)",
        "control": "matched control: head only, CE, head LR 5e-4 kept",
        "top4": "top-4 LoRA, CE, head LR 5e-4 kept, LoRA LR 1e-3",
        "top4-h200": "the same top-4 arm on the H200, stopped at 1,440 updates (dev curve only)"}
EARLIER = {"head": "issue 34: head only (4 unbalanced orders)",
           "top4-ce-head5e4-lora1e3": "issue 34: top-4 LoRA, 1,200 updates"}
GOAL = {"overall": 0.30, "choice": 0.50, "score": 0.50}


def read_gz(path: Path) -> str:
    return gzip.decompress(path.read_bytes()).decode()


def evaluation(d: Path, run: str) -> dict | None:
    p = d / f"{run}.evaluation.json.gz"
    return json.loads(read_gz(p)) if p.exists() else None


def evals_of(d: Path, run: str) -> list[dict]:
    p = d / f"{run}.metrics.jsonl.gz"
    rows = [json.loads(x) for x in read_gz(p).splitlines() if x.strip()] if p.exists() else []
    return [r for r in rows if r.get("event") == "eval"]


def updates_of(d: Path, run: str) -> int | None:
    """The updates a run made: the last train line's step (its metrics.jsonl)."""
    p = d / f"{run}.metrics.jsonl.gz"
    if not p.exists():
        return None
    steps = [json.loads(x).get("step", 0) for x in read_gz(p).splitlines() if '"event": "train"' in x]
    return max(steps) if steps else 0


def row(label: str, ev: dict, updates) -> dict:
    cal, raw = ev["calibrated"], ev["raw"]
    out = {"label": label, "updates": updates, "selected_step": get(ev, "meta.selected_step"),
           "selection": (get(ev, "meta.recipe_deviations.select_by.value") or "macro_accuracy"),
           "test_looks": get(ev, "meta.test_looks"), "n_test": get(ev, "n_rows.test") or cal["overall"]["n"],
           "bayes_nll": raw["overall"]["posterior"]["bayes_nll"], "uniform_gap": raw["overall"]["posterior"]["uniform_gap"]}
    for name, block in (("cal", cal), ("raw", raw)):
        out[name] = {"overall": {m: block["overall"][m] for m in ("accuracy", "nll", "brier", "ece")}
                     | {"gap": block["overall"]["posterior"]["bayes_gap"]}}
        for t in TYPES:
            b = block["per_type"][t]
            out[name][t] = {m: b[m] for m in ("accuracy", "nll", "brier", "ece")} | {"gap": b["posterior"]["bayes_gap"]}
    out["temperatures"] = ev["temperatures"]
    return out


def dev_floor(d: Path) -> dict[str, float] | None:
    """The frozen dev subset's Bayes floor, overall and per type: the mean entropy of its rows' posteriors (the dev
    NLL's targets), from the step-0 dev predictions the collect script copies (`dev-step-0.jsonl.gz`)."""
    p = d / "dev-step-0.jsonl.gz"
    if not p.exists():
        return None
    rows = [json.loads(x) for x in read_gz(p).splitlines() if x.strip()]
    ent = {t: [] for t in TYPES}
    for r in rows:
        q = np.asarray(r["target"], float)
        ent[r["type"]].append(float(-(q[q > 0] * np.log(q[q > 0])).sum()))
    out = {t: float(np.mean(v)) for t, v in ent.items() if v}
    out["overall"] = float(np.mean([e for v in ent.values() for e in v]))
    return out


def slope(evals: list[dict], key: str, window: int = 800) -> float | None:
    """Least-squares slope of `key` against the update over the evaluations of the last `window` updates, per
    1,000 updates (negative: still falling)."""
    pts = [(e["step"], e[key]) for e in evals if isinstance(e.get(key), (int, float))]
    if len(pts) < 2:
        return None
    last = pts[-1][0]
    xs, ys = zip(*[(s, v) for s, v in pts if s >= last - window])
    if len(xs) < 2:
        return None
    return float(np.polyfit(np.array(xs, float), np.array(ys, float), 1)[0] * 1000)


def compares(d: Path) -> list[dict]:
    out = []
    for p in sorted(d.glob("compare-*.json")):
        c = json.loads(p.read_text())
        pair = p.stem.removeprefix("compare-").split(f"-{c['metric']}")[0]
        out.append({"pair": pair, "metric": c["metric"], "type": c.get("type"), "a": c["mean_a"], "b": c["mean_b"],
                    "diff": c["mean_diff"], "ci": [c["ci_low"], c["ci_high"]], "p": c["p_value"], "cases": c["n_groups"],
                    "rows": c["n"]})
    return out


def fmt_gap(v: float, goal: float | None) -> str:
    return f"{v:.4f}" + ("" if goal is None else (" ✓" if v <= goal else " ✗"))


def tables(rows: dict[str, dict], curves: dict[str, list[dict]], comps: list[dict], floor: dict | None) -> None:
    print("| run | updates | selected step (selection) | test acc | NLL cal | gap cal | gap raw | "
          + " | ".join(f"gap cal {t}" for t in TYPES) + " | Brier cal |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(TYPES) + "---|")
    for r in rows.values():
        c = r["cal"]
        print(f"| {r['label']} | {r['updates']:,} | {r['selected_step']} ({r['selection']}) | {c['overall']['accuracy']:.4f} | "
              f"{c['overall']['nll']:.4f} | {fmt_gap(c['overall']['gap'], GOAL['overall'])} | {r['raw']['overall']['gap']:.4f} | "
              + " | ".join(fmt_gap(c[t]["gap"], GOAL.get(t)) for t in TYPES) + f" | {c['overall']['brier']:.4f} |")
    print("\nGoal (issue 44): calibrated gap <= 0.30 overall, <= 0.50 for choice and score (✓ met, ✗ missed).\n")
    print("| run | " + " | ".join(f"acc {t} (raw / cal)" for t in TYPES) + " | "
          + " | ".join(f"T {t}" for t in TYPES) + " |")
    print("|---|" + "---|" * (2 * len(TYPES)))
    for r in rows.values():
        print(f"| {r['label']} | " + " | ".join(f"{r['raw'][t]['accuracy']:.4f} / {r['cal'][t]['accuracy']:.4f}"
                                               for t in TYPES)
              + " | " + " | ".join(f"{r['temperatures'][t]:.3f}" for t in TYPES) + " |")
    print()
    for run, evals in curves.items():
        if not evals:
            continue
        print(f"Dev curve, {RUNS[run]} (raw, T = 1, the frozen dev subset):\n")
        print("| update | dev NLL | " + " | ".join(f"NLL {t}" for t in TYPES) + " | "
              + " | ".join(f"acc {t}" for t in TYPES) + " | macro acc |")
        print("|---|---|" + "---|" * (2 * len(TYPES)) + "---|")
        for e in evals:
            print(f"| {e['step']} | {e['dev_nll']:.4f} | " + " | ".join(f"{e[f'dev_nll/{t}']:.4f}" for t in TYPES) + " | "
                  + " | ".join(f"{e[f'dev_accuracy/{t}']:.4f}" if f"dev_accuracy/{t}" in e else "—" for t in TYPES)
                  + f" | {e['dev_macro_accuracy']:.4f} |")
        if floor:
            e = evals[-1]
            print(f"\nDev gap at update {e['step']} (dev NLL minus the dev subset's floor, overall {floor['overall']:.4f}): "
                  f"{e['dev_nll'] - floor['overall']:.4f}; " + ", ".join(
                      f"{t} {e[f'dev_nll/{t}'] - floor[t]:.4f}" for t in TYPES if f"dev_nll/{t}" in e))
        sl = {k: slope(evals, k) for k in ["dev_nll"] + [f"dev_nll/{t}" for t in TYPES]}
        print("\nSlope over the last 800 updates (nats per 1,000 updates): "
              + ", ".join(f"{k} {v:+.4f}" for k, v in sl.items() if v is not None) + "\n")
    if comps:
        print("| comparison (B - A) | metric | rows | A | B | B - A | 95% CI (by case) | p | cases |")
        print("|---|---|---|---|---|---|---|---|---|")
        for c in comps:
            print(f"| {c['pair']} | {c['metric']} (cal) | {c['type'] or 'all'} | {c['a']:.4f} | {c['b']:.4f} | "
                  f"{c['diff']:+.4f} | [{c['ci'][0]:+.4f}, {c['ci'][1]:+.4f}] | {c['p']:.4f} | {c['cases']} |")
        print()


def plots(d: Path, rows: dict[str, dict], curves: dict[str, list[dict]], floor: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(14, 6.2), sharex=True)
    for run, style in (("control", "--"), ("top4", "-"), ("top4-h200", "-.")):
        evals = curves.get(run) or []
        if not evals:
            continue
        steps = [e["step"] for e in evals]
        for ax, key in zip(axes[0], ["dev_nll"] + [f"dev_nll/{t}" for t in TYPES]):
            ax.plot(steps, [e[key] for e in evals], style, marker="o", ms=3, label=RUNS[run])
            ax.set_title(key.replace("dev_nll", "dev NLL (raw)").replace("/", " "), fontsize=9)
        for ax, key in zip(axes[1], ["dev_macro_accuracy"] + [f"dev_accuracy/{t}" for t in TYPES]):
            if all(key in e for e in evals):
                ax.plot(steps, [e[key] for e in evals], style, marker="o", ms=3, label=RUNS[run])
            ax.set_title(key.replace("dev_", "dev ").replace("_", " ").replace("/", " "), fontsize=9)
    if floor:  # the goal, drawn on the dev subset: its floor + the issue's gap bar
        for ax, t in zip(axes[0], ["overall", *TYPES]):
            if t in GOAL:
                ax.axhline(floor[t] + GOAL[t], color="k", ls=":", lw=1, label="dev floor + goal gap")
    for ax in axes[1]:
        ax.set_xlabel("update (0 = the head-only init)")
    axes[0][0].set_ylabel("nats")
    axes[1][0].set_ylabel("top-1 accuracy")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(d / "dev_curves.png", dpi=110)

    if rows:
        fig, ax = plt.subplots(figsize=(10, 3.8))
        cols = ["overall", *TYPES]
        width = 0.8 / len(rows)
        for i, r in enumerate(rows.values()):
            ax.bar(np.arange(len(cols)) + i * width, [r["cal"][c]["gap"] for c in cols], width, label=r["label"])
        for j, c in enumerate(cols):
            if c in GOAL:
                ax.hlines(GOAL[c], j - 0.1, j + 0.8, colors="k", linestyles=":", lw=1.2)
        ax.set_xticks(np.arange(len(cols)) + 0.4 - width / 2, cols)
        ax.set_ylabel("calibrated NLL above the Bayes floor (nats)")
        ax.set_title("test split, data seed 1 (dotted: the issue's goal)", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(d / "gaps.png", dpi=110)


def main() -> None:
    d = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "full-budget"
    earlier = HERE / "top-layers" / "confirm"
    rows: dict[str, dict] = {}
    for run, label in EARLIER.items():
        ev = evaluation(earlier, run)
        if ev is not None:
            rows[f"earlier/{run}"] = row(label, ev, updates_of(earlier, run))
    for run, label in RUNS.items():
        ev = evaluation(d, run)
        if ev is not None:
            rows[run] = row(label, ev, updates_of(d, run))
    curves = {run: evals_of(d, run) for run in ("control", "top4", "top4-h200")}
    comps = compares(d)
    floor = dev_floor(d)
    tables(rows, curves, comps, floor)
    summary = {"rows": rows, "compare": comps, "dev_floor": floor,
               "dev_nll_slope_last_800_per_1000": {run: {k: slope(ev, k) for k in ["dev_nll"] + [f"dev_nll/{t}" for t in TYPES]}
                                                   for run, ev in curves.items() if ev},
               "goal": GOAL}
    (d / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    plots(d, {k: v for k, v in rows.items()}, curves, floor)


if __name__ == "__main__":
    main()
