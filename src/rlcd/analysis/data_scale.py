"""What N cases buy: the calibrated gap to the Bayes floor against the training set's size (issue 69's picture).

Each arm is a run trained on N cases of one known-posterior generator and scored once on a common held-out set
(`rlcd evaluate RUN --data SEALED --out NAME`, temperatures from the run's own calibration split). Per arm and
per block (overall, then each question type) the gap is the mean over rows with a posterior of
NLL(calibrated model) - NLL(posterior), with a case-resampled 95% interval (`uncertainty.bayes_gap_interval`),
beside the uniform answer's gap on the same rows. The picture draws the gap against N on a log axis, the Bayes
floor (0) and each block's uniform gap as lines; `scale_sentence` is the line a user reads: "N cases buy this gap
on this backbone for this much CPU".

    python -m rlcd.analysis.data_scale --arm 1000=runs/ds/d1000-top2 --arm 4000=runs/ds/d4000-top2 \\
        --eval sealed --costs runs/ds/costs.tsv --backbone gemma3-270m --out docs/.../data-scale
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

BLOCKS = ("overall", "choice", "noul", "score")
TRAINING_STAGES = ("cut", "features", "train")  # run-data-scale.sh's stage labels that build the model


def arm_gaps(run: str | Path, eval_name: str) -> dict[str, Any]:
    """`{block: {"gap", "ci95", "uniform_gap", "n"}}` for one run's `RUN/eval-<eval_name>/` test predictions,
    at the temperatures that evaluation used (the run's own calibration split). A block without rows with a
    posterior is left out."""
    from rlcd.data.io import read_jsonl
    from rlcd.uncertainty import bayes_gap_interval

    ev_dir = Path(run) / f"eval-{eval_name}"
    ev_path, pred_path = ev_dir / "evaluation.json", ev_dir / "predictions-test.jsonl"
    for p in (ev_path, pred_path):
        if not p.is_file():
            raise FileNotFoundError(f"{p}: missing (score the run first: rlcd evaluate {run} --data DATA --out "
                                    f"{eval_name})")
    temps = json.loads(ev_path.read_text())["temperatures"]
    rows = [row for _, row in read_jsonl(pred_path)]
    out: dict[str, Any] = {}
    for block in BLOCKS:
        sel = rows if block == "overall" else [r for r in rows if r.get("type") == block]
        g = bayes_gap_interval(sel, temps)
        if g is not None:
            out[block] = g
    return out


def stage_costs(costs_tsv: str | Path | None, arm_label: str) -> dict[str, float]:
    """CPU seconds (user + sys) and wall seconds of the stages whose label names `arm_label` (e.g. "d4000") in a
    run script's costs.tsv (`stage <TAB> wall_s <TAB> user_s <TAB> sys_s <TAB> exit`), all of them and those that
    train (`train_cpu_s`: the `cut`, `features` and `train` stages -- what a user who trains at that size pays; the
    evaluations and probes are this experiment's measurements); a stage stopped and resumed counts every try."""
    if costs_tsv is None or not Path(costs_tsv).is_file():
        return {}
    cpu = wall = train = 0.0
    with open(costs_tsv, newline="") as f:
        for row in csv.DictReader(f, delimiter="\t"):
            words = (row.get("stage") or "").split()
            if arm_label in words or any(w.startswith(arm_label + "-") for w in words):
                cpu += float(row["user_s"]) + float(row["sys_s"])
                wall += float(row["wall_s"])
                if words[:1] and words[0] in TRAINING_STAGES:
                    train += float(row["user_s"]) + float(row["sys_s"])
    return {"cpu_s": round(cpu, 1), "wall_s": round(wall, 1), "train_cpu_s": round(train, 1)}


def scale_table(arms: Sequence[tuple[int, str | Path]], eval_name: str, costs_tsv: str | Path | None = None
                ) -> list[dict[str, Any]]:
    """One entry per arm, in order of cases: cases, run, the gaps per block and the arm's stage costs."""
    table = [{"cases": int(n), "run": str(run), "gaps": arm_gaps(run, eval_name),
              "costs": stage_costs(costs_tsv, f"d{int(n)}")} for n, run in arms]
    return sorted(table, key=lambda a: a["cases"])


def scale_sentence(table: Sequence[Mapping[str, Any]], backbone: str, eval_name: str) -> str:
    """The line a user needs, for the arm with the smallest overall gap."""
    best = min(table, key=lambda a: a["gaps"]["overall"]["gap"])
    g = best["gaps"]["overall"]
    cpu = best["costs"].get("train_cpu_s")
    cost = f"{cpu / 3600:.1f} CPU hours of training" if cpu else "CPU not recorded"
    return (f"{best['cases']:,} cases buy a calibrated gap of {g['gap']:.3f} nats [{g['ci95'][0]:.3f}, "
            f"{g['ci95'][1]:.3f}] above the Bayes floor (uniform {g['uniform_gap']:.3f}) on {backbone} for {cost}, "
            f"on {g['n']:,} {eval_name} rows")


def plot_scale(table: Sequence[Mapping[str, Any]], out_png: str | Path, title: str) -> Path:
    """Gap against cases (log axis) per block with 95% interval bars; the Bayes floor at 0 and each block's
    uniform gap as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [a["cases"] for a in table]
    for i, block in enumerate(BLOCKS):
        pts = [(a["cases"], a["gaps"][block]) for a in table if block in a["gaps"]]
        if not pts:
            continue
        color = f"C{i}"
        x = [p[0] for p in pts]
        y = [p[1]["gap"] for p in pts]
        err = [[p[1]["gap"] - p[1]["ci95"][0] for p in pts], [p[1]["ci95"][1] - p[1]["gap"] for p in pts]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=4, color=color, lw=2 if block == "overall" else 1,
                    label=f"{block} (uniform {pts[-1][1]['uniform_gap']:.2f}, dashed)")
        ax.axhline(pts[-1][1]["uniform_gap"], color=color, ls="--", lw=0.8)
    ax.axhline(0.0, color="black", lw=1)
    ax.text(xs[0], 0.01, "Bayes floor", va="bottom", fontsize=8)
    ax.set_xscale("log")
    ax.set_xticks(xs, [f"{x:,}" for x in xs])
    ax.minorticks_off()
    ax.set_xlabel("training cases (six questions each; log scale)")
    ax.set_ylabel("calibrated NLL gap to the Bayes floor (nats)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlcd.analysis.data_scale", description=__doc__.splitlines()[0])
    ap.add_argument("--arm", action="append", required=True, metavar="N=RUN", help="cases=run directory (repeat)")
    ap.add_argument("--eval", dest="eval_name", default="sealed", help="the RUN/eval-NAME/ every arm was scored in")
    ap.add_argument("--costs", default=None, help="the run script's costs.tsv")
    ap.add_argument("--backbone", default="the backbone")
    ap.add_argument("--out", required=True, help="directory for data-scale.json and data-scale.png")
    a = ap.parse_args(argv)
    arms = []
    for spec in a.arm:
        n, sep, run = spec.partition("=")
        if not sep or not n.isdigit() or not run:
            ap.error(f"--arm {spec!r}: give CASES=RUN, e.g. 1000=runs/ds/d1000-top2")
        arms.append((int(n), run))
    try:
        table = scale_table(arms, a.eval_name, a.costs)
    except FileNotFoundError as e:
        ap.error(str(e))
    sentence = scale_sentence(table, a.backbone, a.eval_name)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from rlcd.run import write_json

    write_json(out / "data-scale.json", {"eval": a.eval_name, "backbone": a.backbone, "arms": table,
                                         "sentence": sentence})
    plot_scale(table, out / "data-scale.png", f"{a.backbone}: calibrated gap on the {a.eval_name} set vs cases")
    print(sentence)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
