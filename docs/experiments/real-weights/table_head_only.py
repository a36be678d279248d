"""Print tables 1-3 of docs/experiments/real-weights.md (head-only on SmolLM2 features) and draw the sigma plots.

    python docs/experiments/real-weights/table_head_only.py [HO_DIR]

HO_DIR (default: `head-only/` beside this script) holds what `collect.sh` copied from runs/rw3: per run
`<sweep>/<run>/evaluation.json.gz` (the run's own eval/evaluation.json, gzipped) and the `compare-*.json`
files `rlcd compare` wrote. Every cell is the mean ± sample std over an arm's seeds of the test split.
Writes `T_vs_sigma.png` and `nll_vs_sigma.png` into HO_DIR.
"""

from __future__ import annotations

import gzip
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
TYPES = ("choice", "noul", "score")


def load(ho: Path) -> dict[str, dict[str, list[dict]]]:
    """{sweep: {arm: [evaluation per seed]}}."""
    out: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for gz in sorted(ho.glob("*/*/evaluation.json.gz")):
        sweep, run = gz.parent.parent.name, gz.parent.name
        arm = re.sub(r"-s\d+$", "", run)
        out[sweep][arm].append(json.loads(gzip.decompress(gz.read_bytes())))
    return out


def ms(values: list[float], digits: int = 3) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def get(ev: dict, path: str):
    cur = ev
    for k in path.split("."):
        if not isinstance(cur, dict) or k not in cur:
            return None
        cur = cur[k]
    return cur


COLUMNS = [
    ("acc", "calibrated.overall.accuracy"), ("group-macro acc", "calibrated.group_macro.accuracy"),
    ("majority", "majority_baseline.accuracy"), ("majority group-macro", "majority_baseline.group_macro_accuracy"),
    ("NLL raw", "raw.overall.nll"), ("NLL cal", "calibrated.overall.nll"),
    ("Brier raw", "raw.overall.brier"), ("Brier cal", "calibrated.overall.brier"),
    ("ECE raw", "raw.overall.ece"), ("ECE cal", "calibrated.overall.ece"),
    ("tECE raw", "raw.overall.ece_target"), ("tECE cal", "calibrated.overall.ece_target"),
    ("Bayes floor", "raw.overall.posterior.bayes_nll"),
    ("gap raw", "raw.overall.posterior.bayes_gap"), ("gap cal", "calibrated.overall.posterior.bayes_gap"),
]


def metrics_table(arms: dict[str, list[dict]]) -> None:
    print("| arm | seeds | " + " | ".join(c for c, _ in COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for arm, evs in arms.items():
        print(f"| `{arm}` | {len(evs)} | " + " | ".join(ms([get(e, p) for e in evs]) for _, p in COLUMNS) + " |")
    print()
    print("| arm | " + " | ".join(f"gap cal {t}" for t in TYPES) + " | "
          + " | ".join(f"T {t} (95% CI per seed)" for t in TYPES) + " |")
    print("|---|" + "---|" * (2 * len(TYPES)))
    for arm, evs in arms.items():
        gaps = [ms([get(e, f"calibrated.per_type.{t}.posterior.bayes_gap") for e in evs]) for t in TYPES]
        temps = []
        for t in TYPES:
            ts = [e["temperatures"].get(t) for e in evs]
            cis = [(e.get("temperatures_ci95") or {}).get(t) for e in evs]
            shown = "; ".join(f"[{c[0]:.2f}, {c[1]:.2f}]" for c in cis if c)
            temps.append(f"{ms(ts, 2)} ({shown})")
        print(f"| `{arm}` | " + " | ".join(gaps) + " | " + " | ".join(temps) + " |")
    print()


def compare_table(ho: Path) -> None:
    files = sorted(ho.glob("compare-*.json"))
    if not files:
        return
    print("| comparison (B - A) | metric | A | B | B - A | 95% CI | p | cases | verdict |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in files:
        c = json.loads(p.read_text())
        name = p.stem.removeprefix("compare-").rsplit("-", 1)[0]
        lo, hi = c["ci_low"], c["ci_high"]
        better = (hi < 0) if c.get("lower_is_better", True) else (lo > 0)
        verdict = "no difference shown (CI holds 0)" if lo <= 0 <= hi else ("B better" if better else "A better")
        print(f"| {name} | {c['metric']} ({'cal' if c['calibrated'] else 'raw'}) | {c['mean_a']:.4f} | "
              f"{c['mean_b']:.4f} | {c['mean_diff']:+.4f} | [{lo:+.4f}, {hi:+.4f}] | {c['p_value']:.3g} | "
              f"{c['n_groups']} | {verdict} |")
    print()


def sigma_plots(arms: dict[str, list[dict]], ho: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = sorted((float(re.search(r"sigma([0-9.]+)", a).group(1)), evs) for a, evs in arms.items() if "sigma" in a)
    ce = arms.get("ce", [])
    if not series:
        return
    sig = [s for s, _ in series]

    def band(ax, key, label, color):
        means = [statistics.mean([get(e, key) for e in evs]) for _, evs in series]
        sds = [statistics.stdev([get(e, key) for e in evs]) if len(evs) > 1 else 0.0 for _, evs in series]
        ax.errorbar(sig, means, yerr=sds, marker="o", capsize=3, label=label, color=color)
        if ce:
            ax.axhline(statistics.mean([get(e, key) for e in ce]), ls="--", color=color, alpha=0.6, label=f"{label}, CE")

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for t, color in zip(TYPES, ("C0", "C1", "C2")):
        band(ax, f"temperatures.{t}", f"T {t}", color)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training sigma (RLCD logit perturbation std)")
    ax.set_ylabel("fitted temperature (mean ± sd over seeds)")
    ax.set_title("SmolLM2-135M head-only: fitted temperature vs sigma")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(ho / "T_vs_sigma.png", dpi=110)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    band(ax, "raw.overall.nll", "test NLL raw", "C3")
    band(ax, "calibrated.overall.nll", "test NLL calibrated", "C4")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training sigma")
    ax.set_ylabel("NLL (nats, mean ± sd over seeds)")
    ax.set_title("SmolLM2-135M head-only: NLL vs sigma")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ho / "nll_vs_sigma.png", dpi=110)


def main() -> None:
    ho = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "head-only"
    data = load(ho)
    for sweep, arms in data.items():
        print(f"### {sweep}\n")
        metrics_table(dict(arms))
    compare_table(ho)
    if "sigma" in data:
        arms = dict(data["sigma"])
        if "ce" not in arms and "ce" in data.get("ablation", {}):
            arms["ce"] = data["ablation"]["ce"][:3]
        sigma_plots(arms, ho)


if __name__ == "__main__":
    main()
