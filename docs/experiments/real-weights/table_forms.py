"""Paired coherence table of issue 54: two runs' `rlcd probe coherence` results, forms arm minus the arm without.

    python docs/experiments/real-weights/table_forms.py A.json B.json [--out paired.json] \
        [--order A-order.json B-order.json]

A and B are the `--json-out` files (or `RUN/eval/probe-coherence.json`) of the arm without forms and the arm with
them. Both probes asked the same derived questions (the probe re-derives the test split's original rows, a pure
function of each row), so rows pair by id. Per family and per form: the violation rate at the probes' tolerance
and the gap to the exact target of each arm, and the difference B - A with a 95% percentile bootstrap over whole
cases (`rlcd.bootstrap.bootstrap_means` on the per-row differences, 2,000 resamples, seed 0). With --order (the two
arms' `rlcd probe order` JSONs), also the flip rate per type, paired by (row, order): a comparison flips when the
reordered question's top answer differs, and the rate is over comparisons, as the probe reports it. Prints markdown,
writes the numbers as JSON with --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from rlcd.bootstrap import bootstrap_means

RESAMPLES = 2000


def interval(d: np.ndarray, cases: list[str]) -> list[float]:
    s = bootstrap_means(d, resamples=RESAMPLES, seed=0, groups=np.asarray(cases, dtype=object).astype(str))
    return [float(np.quantile(s, 0.025)), float(np.quantile(s, 0.975))]


def paired(a: dict, b: dict) -> dict:
    tol = a["tol"]
    if b["tol"] != tol:
        raise SystemExit(f"the two probes used different tolerances ({tol} vs {b['tol']})")
    ra = {r["id"]: r for r in a["rows"]}
    rb = {r["id"]: r for r in b["rows"]}
    if set(ra) != set(rb):
        raise SystemExit(f"the probes asked different questions ({len(set(ra) ^ set(rb))} ids differ): "
                         "same data and forms needed")
    out: dict = {"tol": tol, "resamples": RESAMPLES, "per_family": {}, "per_form": {}}
    for key, field in (("per_family", "family"), ("per_form", "form")):
        for name in sorted({r[field] for r in ra.values()}):
            ids = sorted(i for i, r in ra.items() if r[field] == name)
            cases = [ra[i]["case"] for i in ids]
            row = {"n_rows": len(ids), "n_cases": len(set(cases))}
            for stat, value in (("violation_rate", lambda r: float(r["deviation"] > tol)),
                                ("mean_gap", lambda r: r["gap"]), ("mean_deviation", lambda r: r["deviation"])):
                xa = np.array([value(ra[i]) for i in ids])
                xb = np.array([value(rb[i]) for i in ids])
                row[stat] = {"a": float(xa.mean()), "b": float(xb.mean()), "b_minus_a": float((xb - xa).mean()),
                             "b_minus_a95": interval(xb - xa, cases)}
            out[key][name] = row
    return out


def paired_order(a: dict, b: dict) -> dict:
    """Flip rates of two `rlcd probe order` results per type, B - A with a case-bootstrap interval. Both probes must
    have asked the same reorderings of the same rows (they are seeded by the row id)."""
    ca = {(r["id"], c["perm"]): (r["type"], r["case"], c["flip"]) for r in a["rows"] for c in r["comparisons"]}
    cb = {(r["id"], c["perm"]): c["flip"] for r in b["rows"] for c in r["comparisons"]}
    if set(ca) != set(cb):
        raise SystemExit(f"the order probes asked different reorderings ({len(set(ca) ^ set(cb))} differ): "
                         "same data, split and probe settings needed")
    out = {}
    for t in sorted({v[0] for v in ca.values()}):
        keys = sorted(k for k, v in ca.items() if v[0] == t)
        xa = np.array([float(ca[k][2]) for k in keys])
        xb = np.array([float(cb[k]) for k in keys])
        cases = [ca[k][1] for k in keys]
        out[t] = {"n_comparisons": len(keys), "n_rows": len({k[0] for k in keys}), "n_cases": len(set(cases)),
                  "a": float(xa.mean()), "b": float(xb.mean()), "b_minus_a": float((xb - xa).mean()),
                  "b_minus_a95": interval(xb - xa, cases)}
    return out


def order_markdown(res: dict) -> str:
    lines = ["| type | comparisons | rows | cases | flip rate A | B | B - A [95% CI] |", "|---|---|---|---|---|---|---|"]
    for t, r in res.items():
        lines.append(f"| {t} | {r['n_comparisons']} | {r['n_rows']} | {r['n_cases']} | {r['a']:.3f} | {r['b']:.3f} | "
                     f"{r['b_minus_a']:+.3f} [{r['b_minus_a95'][0]:+.3f}, {r['b_minus_a95'][1]:+.3f}] |")
    return "\n".join(lines)


def markdown(res: dict, names: dict) -> str:
    lines = ["| family | rows | cases | violation rate A | B | B - A [95% CI] | gap A | B | B - A [95% CI] |",
             "|---|---|---|---|---|---|---|---|---|"]
    for fam, r in res["per_family"].items():
        v, g = r["violation_rate"], r["mean_gap"]
        lines.append(f"| {names.get(fam, fam)} | {r['n_rows']} | {r['n_cases']} | {v['a']:.3f} | {v['b']:.3f} | "
                     f"{v['b_minus_a']:+.3f} [{v['b_minus_a95'][0]:+.3f}, {v['b_minus_a95'][1]:+.3f}] | {g['a']:.3f} | "
                     f"{g['b']:.3f} | {g['b_minus_a']:+.3f} [{g['b_minus_a95'][0]:+.3f}, {g['b_minus_a95'][1]:+.3f}] |")
    lines += ["", "| form | rows | gap A | gap B | B - A [95% CI] |", "|---|---|---|---|---|"]
    for form, r in res["per_form"].items():
        g = r["mean_gap"]
        lines.append(f"| {form} | {r['n_rows']} | {g['a']:.3f} | {g['b']:.3f} | {g['b_minus_a']:+.3f} "
                     f"[{g['b_minus_a95'][0]:+.3f}, {g['b_minus_a95'][1]:+.3f}] |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="probe-coherence JSON of the arm without forms")
    ap.add_argument("b", type=Path, help="probe-coherence JSON of the arm with forms")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--order", type=Path, nargs=2, metavar=("A_ORDER", "B_ORDER"),
                    help="the two arms' `rlcd probe order` JSONs: adds the paired flip rates per type")
    args = ap.parse_args()
    missing = [str(p) for p in (args.a, args.b, *(args.order or ())) if not p.is_file()]
    if missing:
        ap.error(f"no such file: {', '.join(missing)} (run `rlcd probe coherence` / `rlcd probe order` first)")
    a, b = (json.loads(p.read_text(encoding="utf-8")) for p in (args.a, args.b))
    res = paired(a, b)
    print(markdown(res, a.get("families") or {}))
    if args.order:
        oa, ob = (json.loads(p.read_text(encoding="utf-8")) for p in args.order)
        res["order_flips"] = paired_order(oa, ob)
        print("\n" + order_markdown(res["order_flips"]))
    if args.out:
        args.out.write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
