"""The error analysis section: confusion matrices, accuracy by K, the worst rows (headline split)."""

from __future__ import annotations

from rlcd.report import error_analysis as E
from rlcd.report import plots
from rlcd.report.context import Context
from rlcd.report.document import Section, Table, Text, fmt


def _confusion_table(m: dict) -> Table:
    """Counts with the row-normalised share beside them; HTML shades each cell by that share."""
    rows, shade = [], []
    for label, counts in zip(m["labels"], m["counts"]):
        total = sum(counts)
        shares = [c / total if total else None for c in counts]
        rows.append([label, total] + [f"{c} ({100 * p:.0f}%)" if p is not None else str(c)
                                      for c, p in zip(counts, shares)])
        shade.append([None, None] + shares)
    return Table(["target \\ predicted", "n"] + m["labels"], rows, shade=shade,
                 caption=f"{m['title']} ({m['n']} rows): count (share of the target's row)")


def error_analysis(ctx: Context) -> Section:
    head, rows = ctx.head, ctx.preds[ctx.head]
    s = Section(f"Error analysis ({head})")
    if not rows:
        return s.add(Text(f"The {head} split has no rows."))
    conf = Section("Confusion matrices", level=3)
    matrices = E.confusion_matrices(rows)
    conf.add(Text(f"Rows: the target's argmax; columns: the prediction's (temperatures do not change it). Choice "
                  f"questions are shown per label set with at most {E.MAX_CHOICE_K} candidates (the "
                  f"{E.MAX_CHOICE_SETS} most frequent); score questions per number of levels."))
    conf.add(*[_confusion_table(m) for m in matrices] or [Text("No question family small enough to tabulate.")])
    s.add(conf)

    by_k = E.accuracy_by_k(rows, ctx.temperatures)
    ks = Section("Accuracy by number of candidates K", level=3)
    ks.add(Table(["K", "n", "types", "accuracy", "chance 1/K", "NLL raw", "NLL cal"],
                 [[r["k"], r["n"], ", ".join(f"{t} {n}" for t, n in r["types"].items()), r["accuracy"], r["chance"],
                   r["nll_raw"], r["nll_calibrated"]] for r in by_k]))
    ks.add(ctx.figures.add("accuracy_by_k", plots.accuracy_by_k(by_k), "accuracy by K"))
    s.add(ks)

    worst = E.worst_rows(rows, ctx.temperatures)
    w = Section(f"The {len(worst)} worst rows by calibrated NLL", level=3)
    w.add(Table(["NLL", "id", "group", "type", "question", "state (excerpt)", "target", "prediction",
                 "probabilities (top 3)"],
                [[fmt(r["nll"], 3), f"`{r['id']}`", r["group"], r["type"], r["question"] or "—", r["state"] or "—",
                  r["target"], r["prediction"], r["probabilities"]] for r in worst]))
    if any(r["question"] is None for r in worst):
        w.add(Text("Rows without question or state text come from prediction files written before rlcd stored them; "
                   "`rlcd evaluate` writes them again."))
    return s.add(w)
