"""Print the 1,000-case tables of the top-layer section of docs/experiments/real-weights.md and draw its curves.

    bash docs/experiments/real-weights/collect-top-layers.sh     # runs/rw4 -> top-layers/full
    python docs/experiments/real-weights/table_top_layers.py [DIR]

DIR (default: `top-layers/full/` beside this script) holds what the collect script copied from runs/rw4: per run
`<run>.evaluation.json.gz` (its eval/evaluation.json) and `<run>.metrics.jsonl.gz`, the `compare-*.json` files
`rlcd compare` wrote, `timing.json` and `cut-states.json`. One seed per arm: every cell is that run's test split. The two `probe` runs come from
run-top-layers-probes.sh.
Writes `dev_curves.png` (dev NLL per type against the update, per arm) and `train_ce.png` into DIR.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

from table_head_only import TYPES, compare_table, get

HERE = Path(__file__).resolve().parent
RUNS = ("head", "top4-ce", "top4-rlcd", "top4-ce-head5e4", "top4-ce-head5e4-lora1e3")
LABELS = {"head": "head only (RL+CE, head LR 5e-3, 3,600 x 32)", "top4-ce": "+ top-4 LoRA, CE",
          "top4-rlcd": "+ top-4 LoRA, RL+CE", "top4-ce-head5e4": "probe: + top-4 LoRA, CE, head LR 5e-4",
          "top4-ce-head5e4-lora1e3": "probe: + top-4 LoRA, CE, head LR 5e-4, LoRA LR 1e-3"}
STYLES = ("--", "-", ":", "-.")


def read_gz(path: Path):
    return gzip.decompress(path.read_bytes()).decode()


def evaluations(d: Path) -> dict[str, dict]:
    return {r: json.loads(read_gz(d / f"{r}.evaluation.json.gz")) for r in RUNS if (d / f"{r}.evaluation.json.gz").exists()}


def metrics(d: Path, run: str) -> list[dict]:
    p = d / f"{run}.metrics.jsonl.gz"
    return [json.loads(x) for x in read_gz(p).splitlines() if x.strip()] if p.exists() else []


def headline(evs: dict[str, dict], d: Path) -> None:
    print("| run | selected step | test acc | majority | NLL cal | Bayes floor | gap cal | gap raw | "
          + " | ".join(f"gap cal {t}" for t in TYPES) + " |")
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(TYPES))
    for run, ev in evs.items():
        step = get(ev, "meta.selected_step")
        print(f"| {LABELS[run]} | {step} | {get(ev, 'calibrated.overall.accuracy'):.4f} | "
              f"{get(ev, 'majority_baseline.accuracy'):.4f} | {get(ev, 'calibrated.overall.nll'):.4f} | "
              f"{get(ev, 'raw.overall.posterior.bayes_nll'):.4f} | "
              f"{get(ev, 'calibrated.overall.posterior.bayes_gap'):.4f} | {get(ev, 'raw.overall.posterior.bayes_gap'):.4f} | "
              + " | ".join(f"{get(ev, f'calibrated.per_type.{t}.posterior.bayes_gap'):.4f}" for t in TYPES) + " |")
    print()
    print("| run | " + " | ".join(f"T {t} [95% CI]" for t in TYPES) + " |")
    print("|---|" + "---|" * len(TYPES))
    for run, ev in evs.items():
        ci = ev.get("temperatures_ci95") or {}
        print(f"| {LABELS[run]} | " + " | ".join(
            f"{ev['temperatures'][t]:.2f} [{ci[t][0]:.2f}, {ci[t][1]:.2f}]" if t in ci else f"{ev['temperatures'][t]:.2f}"
            for t in TYPES) + " |")
    print()


def dev_table(d: Path) -> None:
    print("| run | step | dev NLL | " + " | ".join(f"dev NLL {t}" for t in TYPES) + " | dev macro acc |")
    print("|---|---|---|" + "---|" * len(TYPES) + "---|")
    for run in RUNS[1:]:
        for r in (r for r in metrics(d, run) if r["event"] == "eval"):
            print(f"| {LABELS[run]} | {r['step']} | {r['dev_nll']:.4f} | "
                  + " | ".join(f"{r[f'dev_nll/{t}']:.4f}" for t in TYPES) + f" | {r['dev_macro_accuracy']:.4f} |")
    print()


def plots(d: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(13, 3.4), sharex=True)
    for run, style in zip(RUNS[1:], STYLES):
        rows = [r for r in metrics(d, run) if r["event"] == "eval"]
        if not rows:
            continue
        steps = [r["step"] for r in rows]
        for ax, key in zip(axes, ["dev_nll"] + [f"dev_nll/{t}" for t in TYPES]):
            ax.plot(steps, [r[key] for r in rows], style, marker="o", ms=3, label=LABELS[run])
            ax.set_title(key.replace("dev_nll", "dev NLL (raw)").replace("/", " "), fontsize=9)
    axes[0].set_ylabel("nats")
    for ax in axes:
        ax.set_xlabel("update (step 0 = the head-only run's head)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(d / "dev_curves.png", dpi=110)

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2), sharex=True)
    for run, style in zip(RUNS[1:], STYLES):
        rows = [r for r in metrics(d, run) if r["event"] == "train"]
        if not rows:
            continue
        for ax, t in zip(axes, TYPES):
            pts = [(r["step"], r[f"ce/{t}"]) for r in rows if f"ce/{t}" in r]
            window = 10  # logged updates (one every 10 updates)
            smooth = [sum(v for _, v in pts[max(0, i - window + 1):i + 1]) / len(pts[max(0, i - window + 1):i + 1])
                      for i in range(len(pts))]
            ax.plot([s for s, _ in pts], smooth, style, label=LABELS[run])
            ax.set_title(f"train CE {t} (mean of the last {window} logged updates of 32)", fontsize=8)
            ax.set_xlabel("update")
    axes[0].set_ylabel("nats")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(d / "train_ce.png", dpi=110)


def main() -> None:
    d = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "top-layers" / "full"
    headline(evaluations(d), d)
    dev_table(d)
    compare_table(d)
    for name in ("timing.json", "cut-states.json"):
        if (d / name).exists():
            print(f"{name}: {(d / name).read_text().strip()[:600]}\n")
    plots(d)


if __name__ == "__main__":
    main()
