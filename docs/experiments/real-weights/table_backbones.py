"""Tables and summary JSON of the "Backbones (issue 56)" section of docs/experiments/real-weights.md: head-only on
each backbone's frozen features, the page's head recipe (RL+CE) and its matched CE control, paired by case against
the reference backbone (SmolLM2-135M) on the same test rows.

    bash docs/experiments/real-weights/run-backbones.sh        # runs/rw6 -> backbones/, then this script
    python docs/experiments/real-weights/table_backbones.py [DIR]

DIR (default: `backbones/` beside this script) holds what run-backbones.sh copied: `backbones.json` (reference,
names, steps, threads), per backbone NAME `NAME.features.json` (`rlcd features`' JSON: entries, row tokens,
extraction seconds) and per run NAME-head / NAME-ce its `.config.json`, `.metrics.jsonl.gz` and
`.evaluation.json.gz`, and the `compare-A-vs-B-METRIC[-TYPE].json` files of `rlcd compare` (A, B: NAME-head or
NAME-ce). Prints markdown tables and writes `summary.json` into DIR. Works on a partial DIR: a backbone or run not
there is shown as not run.

The calibrated gap is the page's (rlcd.metrics `bayes_gap`, as in table_full_budget.py): the calibrated test NLL
minus the mean Bayes-floor NLL of the same rows. Two runs on the same rows share the floor, so a compare's NLL
difference B - A is their gap difference; `same_rows` checks it (each side's compared rows are all its evaluation's
rows of that type, and each side's mean NLL is the NLL its evaluation reports).
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

from table_full_budget import row
from table_head_only import TYPES

HERE = Path(__file__).resolve().parent
DEFAULT = {"ref": "smollm2-135m", "backbones": ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]}
OBJECTIVES = {"head": "RL+CE (the page's head recipe)", "ce": "CE (matched control)"}
NOTES = {"smollm2-135m": "Apache-2.0", "qwen2.5-coder-0.5b": "no licence in its PyPI packages; upstream Apache-2.0",
         "gemma3-270m": "Gemma Terms of Use"}
TOPK = re.compile(r"^(?P<name>.+)-top(?P<k>[1-9][0-9]*)$")
COMPARE = re.compile(r"^compare-(?P<a>.+-(?:head|ce|top[0-9]+))-vs-(?P<b>.+-(?:head|ce|top[0-9]+))"
                     r"-(?P<metric>nll|brier|accuracy)"
                     r"(?:-(?P<type>choice|noul|score))?$")
TOL = 1e-9


def read_json(p: Path) -> dict | None:
    if not p.exists():
        return None
    raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    return json.loads(raw)


def metrics_rows(p: Path) -> list[dict]:
    if not p.exists():
        return []
    return [json.loads(x) for x in gzip.decompress(p.read_bytes()).decode().splitlines() if x.strip()]


def train_rate(rows: list[dict]) -> dict | None:
    """Updates per second of the run's last build (from its last `"resume": false` session on, resumed sessions
    included): the train rows' throughput windows (`examples_per_s` over the updates since the previous logged
    row; dev evaluations inside a window count), summed: updates / seconds."""
    start = max((i for i, r in enumerate(rows) if r.get("event") == "session" and not r.get("resume")), default=None)
    if start is None:
        return None
    updates, seconds, prev = 0, 0.0, rows[start].get("step", 0)
    for r in rows[start:]:
        if r.get("event") == "session":
            prev = r.get("step", prev)
        elif r.get("event") == "train" and r.get("examples_per_s"):
            n = r["step"] - prev
            seconds += n * r["examples"] / r["examples_per_s"]
            updates += n
            prev = r["step"]
    return {"updates": updates, "seconds": seconds, "updates_per_s": updates / seconds} if seconds > 0 else None


def whole_pass(d: Path, n: str, f: dict | None) -> dict | None:
    """The extraction record that measured a whole backbone pass over the benchmark. A cache made from cut states
    (`from_cut_states` in `rlcd features`' JSON) ran only the layers above the cut: its seconds are not that, so the
    record is `NAME.full-features.json` (an earlier whole-backbone extraction of the same entries), else none."""
    if f is None or not f.get("from_cut_states"):
        return f
    full = read_json(d / f"{n}.full-features.json")
    if full is None or full.get("from_cut_states") or full["entries"] != f["entries"] or full["row_tokens"] != f["row_tokens"]:
        return None
    return {**full, "source": f"{n}.full-features.json"}


def names_of(d: Path) -> tuple[str, list[str], dict]:
    meta = read_json(d / "backbones.json") or {}
    ref = meta.get("ref", DEFAULT["ref"])
    names = list(meta.get("backbones") or DEFAULT["backbones"])
    for p in sorted(d.glob("*.features.json")):
        n = p.name.removesuffix(".features.json")
        if n not in names:
            names.append(n)
    return ref, names, meta


def topk_runs(d: Path) -> list[str]:
    """The top-K LoRA arms run-backbone-topk.sh copied (`NAME-topK.config.json`), in name order."""
    return sorted(n for p in d.glob("*.config.json") if TOPK.match(n := p.name.removesuffix(".config.json")))


def load_compares(d: Path, evals: dict[str, dict]) -> list[dict]:
    out = []
    for p in sorted(d.glob("compare-*.json")):
        m = COMPARE.match(p.stem)
        if not m:
            continue
        c = json.loads(p.read_text())
        t = c.get("type")
        rec = {"a": m["a"], "b": m["b"], "metric": c["metric"], "type": t, "mean_a": c["mean_a"], "mean_b": c["mean_b"],
               "diff": c["mean_diff"], "ci": [c["ci_low"], c["ci_high"]], "p": c["p_value"], "cases": c["n_groups"],
               "rows": c["n"], "calibrated": c["calibrated"], "split": c["split"], "same_rows": None}
        if c["metric"] == "nll" and m["a"] in evals and m["b"] in evals:
            rec["same_rows"] = all(_covers(evals[k], t, mean, c["n"]) for k, mean in ((m["a"], c["mean_a"]),
                                                                                      (m["b"], c["mean_b"])))
            if rec["same_rows"]:  # the gap difference is the NLL difference; the gaps themselves for the reader
                rec["gap_a"], rec["gap_b"] = (_gap(evals[k], t) for k in (m["a"], m["b"]))
        out.append(rec)
    return out


def _block(ev: dict, t: str | None) -> dict:
    return ev["calibrated"]["overall"] if t is None else ev["calibrated"]["per_type"][t]


def _covers(ev: dict, t: str | None, mean_nll: float, n: int) -> bool:
    b = _block(ev, t)
    return b["n"] == n and abs(b["nll"] - mean_nll) < 1e-6 and b["posterior"]["n"] == n


def _gap(ev: dict, t: str | None) -> float:
    return _block(ev, t)["posterior"]["bayes_gap"]


def ci(c: dict, d: int = 4) -> str:
    return f"{c['diff']:+.{d}f} [{c['ci'][0]:+.{d}f}, {c['ci'][1]:+.{d}f}]"


def verdict(c: dict) -> str:
    lo, hi = c["ci"]
    if lo <= 0 <= hi:
        return "CI holds 0"
    lower_better = c["metric"] != "accuracy"
    return "B better" if (hi < 0) == lower_better else "A better"


def main() -> None:
    d = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "backbones"
    ref, names, meta = names_of(d)
    evals: dict[str, dict] = {}
    runs: dict[str, dict] = {}
    for n in names:
        for obj in OBJECTIVES:
            ev = read_json(d / f"{n}-{obj}.evaluation.json.gz")
            rate = train_rate(metrics_rows(d / f"{n}-{obj}.metrics.jsonl.gz"))
            if ev is not None:
                evals[f"{n}-{obj}"] = ev
            runs[f"{n}-{obj}"] = {"backbone": n, "objective": obj,
                                  "eval": None if ev is None else row(f"{n} {obj}", ev, rate and rate["updates"]),
                                  "train": rate}
    arms = topk_runs(d)
    for a in arms:
        ev = read_json(d / f"{a}.evaluation.json.gz")
        rate = train_rate(metrics_rows(d / f"{a}.metrics.jsonl.gz"))
        if ev is not None:
            evals[a] = ev
        m = TOPK.match(a)
        runs[a] = {"backbone": m["name"], "objective": f"top{m['k']}",
                   "eval": None if ev is None else row(a, ev, rate and rate["updates"]), "train": rate,
                   "cut_states": read_json(d / f"{m['name']}.cut{m['k']}.json")}
    comps = load_compares(d, evals)
    feats = {n: read_json(d / f"{n}.features.json") for n in names}

    print(f"Reference: {ref}. Steps {meta.get('steps', '?')}, {meta.get('threads', '?')} threads, "
          f"{meta.get('device', '?')}, float32. Test split, calibrated (temperatures per type from the calibration "
          "split); gap = calibrated NLL - the rows' Bayes floor.\n")
    print("| backbone | recipe | test acc | NLL cal | gap cal | gap raw | " + " | ".join(f"gap {t}" for t in TYPES)
          + " | T " + " / ".join(TYPES) + " | rows |")
    print("|---|---|---|---|---|---|" + "---|" * len(TYPES) + "---|---|")
    lines = [(n, f"{n}-{obj}", label) for n in names for obj, label in OBJECTIVES.items()]
    lines += [(runs[a]["backbone"], a, f"top-{runs[a]['objective'][3:]} LoRA (CE, from its CE head)") for a in arms]
    for n, key, label in lines:
        r = runs[key]["eval"]
        if r is None:
            print(f"| {n} | {label} | not run |" + " |" * (5 + len(TYPES)))
            continue
        c = r["cal"]
        print(f"| {n} | {label} | {c['overall']['accuracy']:.4f} | {c['overall']['nll']:.4f} | "
              f"{c['overall']['gap']:.4f} | {r['raw']['overall']['gap']:.4f} | "
              + " | ".join(f"{c[t]['gap']:.4f}" for t in TYPES) + " | "
              + " / ".join(f"{r['temperatures'][t]:.3f}" for t in TYPES) + f" | {r['n_test']} |")
    print()

    def pair_table(title: str, pairs: list[tuple[str, str]]) -> None:
        print(f"{title}\n")
        print("| A -> B | rows | gap A | gap B | NLL = gap B - A [95% CI] | p | cases | Brier B - A [95% CI] | "
              "accuracy B - A [95% CI] | verdict (gap) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for a, b in pairs:
            if not any(c["a"] == a and c["b"] == b for c in comps):
                print(f"| {a} -> {b} | all | not run |" + " |" * 7)
                continue
            for t in (None, *TYPES):
                got = {c["metric"]: c for c in comps if c["a"] == a and c["b"] == b and c["type"] == t}
                nll = got.get("nll")
                if nll is None:
                    print(f"| {a} -> {b} | {t or 'all'} | not run |" + " |" * 7)
                    continue
                gaps = (f"{nll['gap_a']:.4f} | {nll['gap_b']:.4f}" if nll["same_rows"]
                        else "rows differ | rows differ")
                other = " | ".join(ci(got[m]) if m in got else "—" for m in ("brier", "accuracy"))
                print(f"| {a} -> {b} | {t or 'all'} | {gaps} | {ci(nll)} | {nll['p']:.4f} | {nll['cases']} | {other} | "
                      f"{verdict(nll)} |")
        print()

    others = [n for n in names if n != ref]
    pair_table(f"Paired against {ref}, the same recipe (`rlcd compare {ref}-RUN NAME-RUN [--type T]`, by case):",
               [(f"{ref}-{obj}", f"{n}-{obj}") for obj in OBJECTIVES for n in others])
    pair_table("RL+CE against CE within each backbone (`rlcd compare NAME-ce NAME-head`):",
               [(f"{n}-ce", f"{n}-head") for n in names])

    for a in arms:
        n = runs[a]["backbone"]
        pair_table(f"The top-{runs[a]['objective'][3:]} LoRA arm on {n} against its init (its CE head) and against "
                   f"{ref}'s CE head (`rlcd compare A {a}`, by case):", [(f"{n}-ce", a), (f"{ref}-ce", a)])
        tr, cut = runs[a]["train"], runs[a]["cut_states"]
        print(f"{a}: " + ("no training logged" if tr is None else
                          f"{tr['updates']:,} updates in {tr['seconds']:,.0f} s, {tr['updates_per_s']:.3f} updates/s")
              + ("" if cut is None else
                 f"; cut-state cache {sum(cut['entries'].values()):,} entries in {cut['extract_seconds']:,.0f} s") + "\n")

    print("What capacity bought per second of CPU (features: `rlcd features`' extraction seconds of the cache, "
          "recorded when it was built; updates/s: the run's own throughput windows, dev evaluations included):\n")
    print("| backbone | licence | cache entries | row tokens | extraction s | s per 1,000 entries | head updates/s | "
          "CE updates/s | head gap | vs ref: gap lowered [95% CI] | extra extraction h | nats per extra hour |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    cost = {}
    passes = {n: whole_pass(d, n, feats.get(n)) for n in names}
    rf = passes.get(ref)
    for n in names:
        f = passes.get(n)
        h, c = runs[f"{n}-head"], runs[f"{n}-ce"]
        rec = {"features": f, "features_used": feats.get(n), "head_train": h["train"], "ce_train": c["train"],
               "head_gap": h["eval"] and h["eval"]["cal"]["overall"]["gap"]}
        vs = next((x for x in comps if x["a"] == f"{ref}-head" and x["b"] == f"{n}-head" and x["metric"] == "nll"
                   and x["type"] is None), None)
        rec["gap_lowered"] = None if vs is None or not vs["same_rows"] else {"diff": -vs["diff"],
                                                                             "ci": [-vs["ci"][1], -vs["ci"][0]]}
        rec["extra_extraction_h"] = (None if f is None or rf is None or n == ref
                                     else (f["extract_seconds"] - rf["extract_seconds"]) / 3600)
        per_h = None
        if rec["gap_lowered"] is not None and rec["extra_extraction_h"] and rec["extra_extraction_h"] > 0:
            per_h = rec["gap_lowered"]["diff"] / rec["extra_extraction_h"]
        rec["nats_per_extra_hour"] = per_h
        cost[n] = rec
        entries = sum(f["entries"].values()) if f else None
        cells = (["not run"] * 4 if feats.get(n) is None else
                 [f"{sum(feats[n]['entries'].values()):,}", f"{feats[n]['row_tokens']:,}",
                  "from cut states, no whole pass recorded", "—"]) if f is None else [
            f"{entries:,}", f"{f['row_tokens']:,}", f"{f['extract_seconds']:,.0f}",
            f"{1000 * f['extract_seconds'] / entries:.1f}"]
        lowered = rec["gap_lowered"]
        print(f"| {n} | {NOTES.get(n, '')} | " + " | ".join(cells) + " | "
              + " | ".join("not run" if x is None else f"{x['updates_per_s']:.1f}" for x in (h["train"], c["train"]))
              + f" | {'not run' if rec['head_gap'] is None else format(rec['head_gap'], '.4f')} | "
              + ("(reference)" if n == ref else "—" if lowered is None else
                 f"{lowered['diff']:+.4f} [{lowered['ci'][0]:+.4f}, {lowered['ci'][1]:+.4f}]")
              + f" | {'—' if rec['extra_extraction_h'] is None else format(rec['extra_extraction_h'], '+.3f')}"
              + f" | {'—' if per_h is None else format(per_h, '+.4f')} |")
    print("\nnats per extra hour: the head-recipe gap lowered against the reference (paired), divided by the extra "
          "wall hours of feature extraction (the same thread count; '—' when it is not more expensive or not run).")
    for n in names:
        if passes.get(n) is not None and "source" in passes[n]:
            print(f"{n}: its cache here was made from cut states (only the layers above the cut ran); the extraction "
                  f"seconds are those of a whole-backbone extraction of the same entries, {passes[n]['source']}.")
    summary = {"ref": ref, "backbones": names, "topk": arms, "meta": meta, "runs": runs, "compare": comps, "cost": cost}
    (d / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
