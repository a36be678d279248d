"""Tables and summary JSON of the bfloat16-training section of docs/experiments/real-weights.md (issue 60).

    bash docs/experiments/real-weights/run-bf16.sh > runs/rw6/bf16.log 2>&1
    python docs/experiments/real-weights/table_bf16.py [DIR]

DIR (default: `bf16/` beside this script) holds what run-bf16.sh copied: per arm (`top4-fp32`, `top4-bf16`)
`<arm>.config.json`, `<arm>.metrics.jsonl.gz`, `<arm>.evaluation.json.gz`, and the paired
`compare-fp32-vs-bf16-<split>-nll[-<type>].json` of `rlcd compare` (B - A = bf16 - fp32). Prints markdown and
writes `summary.json` (every number the page quotes) into DIR. Updates/s is the median of the train events'
`examples_per_s` over the batch size (each arm's own log, its own precision); the dev NLL per type at the last
update is the training's own dev evaluation (in the arm's precision) and, paired, `rlcd compare --split dev --raw`
of both arms evaluated in float32 at that update.
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARMS = ("top4-fp32", "top4-bf16")
TYPES = ("choice", "noul", "score")


def metrics(d: Path, arm: str) -> list[dict]:
    text = gzip.decompress((d / f"{arm}.metrics.jsonl.gz").read_bytes()).decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def arm_summary(d: Path, arm: str) -> dict:
    config = json.loads((d / f"{arm}.config.json").read_text())
    rows = metrics(d, arm)
    batch = int((config.get("recipe") or {}).get("batch_size", 32))
    rates = [r["examples_per_s"] / batch for r in rows if r.get("event") == "train" and r.get("examples_per_s")]
    evals = [r for r in rows if r.get("event") == "eval"]
    last = evals[-1] if evals else {}
    return {"precision_deviation": config.get("precision_deviation"),
            "updates_per_s": statistics.median(rates) if rates else None,
            "train_events": len(rates), "last_eval_step": last.get("step"),
            "dev_nll_own_precision": {t: last.get(f"dev_nll/{t}") for t in TYPES} | {"all": last.get("dev_nll")}}


def paired(d: Path, split: str, t: str | None) -> dict | None:
    p = d / (f"compare-fp32-vs-bf16-{split}-nll" + (f"-{t}" if t else "") + ".json")
    if not p.exists():
        return None
    c = json.loads(p.read_text())
    return {k: c[k] for k in ("mean_a", "mean_b", "mean_diff", "ci_low", "ci_high", "p_value", "n", "n_groups")}


def main(d: Path) -> dict:
    arms = {a: arm_summary(d, a) for a in ARMS if (d / f"{a}.config.json").exists()}
    cmp = {split: {t or "all": paired(d, split, t) for t in (None, *TYPES)} for split in ("dev", "test")}
    out = {"arms": arms, "paired": cmp}
    fp, bf = arms.get("top4-fp32", {}), arms.get("top4-bf16", {})
    if fp.get("updates_per_s") and bf.get("updates_per_s"):
        out["updates_per_s_ratio_bf16_over_fp32"] = bf["updates_per_s"] / fp["updates_per_s"]
    print("| arm | updates/s (median) | dev NLL at the last update, own precision: choice / noul / score / all |")
    print("|---|---|---|")
    for a, s in arms.items():
        n = s["dev_nll_own_precision"]
        ups = f"{s['updates_per_s']:.3f}" if s["updates_per_s"] else "-"
        print(f"| {a} | {ups} | " + " / ".join(f"{n[t]:.4f}" if n[t] is not None else "-" for t in (*TYPES, "all"))
              + " |")
    if "updates_per_s_ratio_bf16_over_fp32" in out:
        print(f"\nbf16 / fp32 updates/s: {out['updates_per_s_ratio_bf16_over_fp32']:.2f}x\n")
    print("| split | type | fp32 NLL | bf16 NLL | bf16 - fp32 [95% CI, by case] | rows |")
    print("|---|---|---|---|---|---|")
    for split, per in cmp.items():
        for t, c in per.items():
            if c:
                print(f"| {split}{' (raw)' if split == 'dev' else ' (calibrated)'} | {t} | {c['mean_a']:.4f} | "
                      f"{c['mean_b']:.4f} | {c['mean_diff']:+.4f} [{c['ci_low']:+.4f}, {c['ci_high']:+.4f}] | {c['n']} |")
    (d / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "bf16")
