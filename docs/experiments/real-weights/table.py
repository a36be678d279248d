"""Print the tables of docs/experiments/real-weights.md from the JSON files beside this script.

    python docs/experiments/real-weights/table.py

Reads `<arm>/evaluation.json[.gz]`, `<arm>/dev-evals.jsonl` and `compare-*.json` (all copied by `run.sh`
and `run-last.sh` from the commands' own output); prints markdown.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARMS = ("smollm2-rlcd", "smollm2-ce", "tiny-rlcd", "tiny-ce",
        "smollm2-rlcd-last", "smollm2-ce-last", "tiny-rlcd-last", "tiny-ce-last")


def f(x, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def evaluation(arm: str) -> dict:
    """`<arm>/evaluation.json`, stored gzipped (`gzip -9n`; 300 KB of per-split detail each)."""
    gz = HERE / arm / "evaluation.json.gz"
    return json.loads(gzip.decompress(gz.read_bytes()) if gz.is_file() else (HERE / arm / "evaluation.json").read_text())


def main() -> None:
    evs = {a: evaluation(a) for a in ARMS if (HERE / a).is_dir()}
    print("| arm | test acc | group-macro acc | majority acc | majority group-macro | NLL raw | NLL cal | "
          "Bayes floor | gap raw | gap cal | Brier raw | Brier cal | ECE raw | ECE cal | tECE raw | tECE cal |")
    print("|---|" + "---|" * 15)
    for a, ev in evs.items():
        r, c = ev["raw"], ev["calibrated"]
        ro, co = r["overall"], c["overall"]
        pr, pc = ro.get("posterior") or {}, co.get("posterior") or {}
        mb = ev.get("majority_baseline") or {}
        print(f"| {a} | {f(co['accuracy'])} | {f(c['group_macro']['accuracy'])} | {f(mb.get('accuracy'))} | "
              f"{f(mb.get('group_macro_accuracy'))} | {f(ro['nll'])} | {f(co['nll'])} | {f(pc.get('bayes_nll'))} | "
              f"{f(pr.get('bayes_gap'))} | {f(pc.get('bayes_gap'))} | {f(ro['brier'])} | {f(co['brier'])} | "
              f"{f(ro['ece'])} | {f(co['ece'])} | {f(ro['ece_target'])} | {f(co['ece_target'])} |")
    print()
    print("| arm | T choice | T noul | T score | checkpoint (step) | dev macro accuracy per evaluation (step: acc) |")
    print("|---|---|---|---|---|---|")
    for a, ev in evs.items():
        t = ev["temperatures"]
        evals = [json.loads(x) for x in (HERE / a / "dev-evals.jsonl").read_text().splitlines()]
        curve = ", ".join(f"{e['step']}: {e['dev_macro_accuracy']:.3f}" for e in evals)
        print(f"| {a} | {f(t['choice'], 2)} | {f(t['noul'], 2)} | {f(t['score'], 2)} | "
              f"{ev['meta'].get('checkpoint', 'best')} ({ev['meta'].get('selected_step')}) | {curve} |")
    print()
    print("| comparison (B - A) | metric | A | B | B - A | 95% CI | p | groups |")
    print("|---|---|---|---|---|---|---|---|")
    for p in sorted(HERE.glob("compare-*.json")):
        c = json.loads(p.read_text())
        name = p.stem.removeprefix("compare-").rsplit("-", 1)[0]
        print(f"| {name} | {c['metric']} ({'cal' if c['calibrated'] else 'raw'}) | {f(c['mean_a'], 4)} | "
              f"{f(c['mean_b'], 4)} | {c['mean_diff']:+.4f} | [{c['ci_low']:+.4f}, {c['ci_high']:+.4f}] | "
              f"{c['p_value']:.3g} | {c['n_groups']} |")


if __name__ == "__main__":
    main()
