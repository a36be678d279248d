"""What the model gets wrong, from the prediction rows alone: confusion matrices, accuracy by the
number of candidates K, and the worst rows by NLL.

- Confusion (rows = target argmax, columns = predicted argmax; temperatures do not move an argmax):
  noul over (false, true); score per K over the levels 0..K-1 (named by the labels when every row
  with that K has the same ones); choice per label set, for label sets with at most ``MAX_CHOICE_K``
  candidates and at least ``MIN_CHOICE_ROWS`` rows, the ``MAX_CHOICE_SETS`` most frequent.
- Accuracy by K: n, accuracy, chance 1/K, mean NLL raw and calibrated, per exact K.
- Worst rows: the ``N_WORST`` rows with the highest calibrated NLL, with what a reader needs to see
  why: id, group, type, the question and a state excerpt (prediction files written before these
  were stored show an em dash), target, prediction and the top probabilities.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Mapping, Sequence

import numpy as np

from rlcd import metrics as M
from rlcd.schema import text_of

MAX_CHOICE_K = 6
MAX_CHOICE_SETS = 4
MIN_CHOICE_ROWS = 5
N_WORST = 20
TOP_P = 3
LABEL_CHARS = 24


def short(text: Any, n: int, *, word: int = 32) -> str:
    """``text`` on one line, at most ``n`` characters; words longer than ``word`` (hashes, paths) elided."""
    words = [w if len(w) <= word else w[: word - 10] + "…" + w[-9:] for w in str(text).split()]
    s = " ".join(words)
    return s if len(s) <= n else s[: n - 1] + "…"


def _argmax(x: Sequence[float]) -> int:
    return int(np.argmax(np.asarray(x, dtype=np.float64)))


def confusion_matrices(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``[{"type", "title", "labels", "counts" [[int]], "n"}]`` in type order (see the module docstring)."""
    families: dict[tuple, list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        labels = tuple(str(x) for x in (r.get("labels") or range(len(r["logits"]))))
        key = ("score", len(labels)) if r["type"] == "score" else (r["type"], labels)
        families[key].append(r)
    out = []
    for qtype in M.QUESTION_TYPES:
        keys = [k for k in families if k[0] == qtype]
        if qtype == "choice":
            keys = [k for k in keys if len(k[1]) <= MAX_CHOICE_K and len(families[k]) >= MIN_CHOICE_ROWS]
            keys = sorted(keys, key=lambda k: (-len(families[k]), k))[:MAX_CHOICE_SETS]
        else:
            keys = sorted(keys, key=lambda k: (len(k[1]) if qtype != "score" else k[1], str(k)))
        for key in keys:
            fam = families[key]
            k = len(fam[0]["logits"])
            if qtype == "score":
                names = {tuple(str(x) for x in (r.get("labels") or range(k))) for r in fam}
                labels = list(names.pop()) if len(names) == 1 else [f"level {i}" for i in range(k)]
                title = f"score, {k} levels"
            else:
                labels = list(key[1])
                title = "noul" if qtype == "noul" else "choice: " + ", ".join(short(x, 16) for x in labels)
            counts = np.zeros((k, k), dtype=int)
            for r in fam:
                counts[_argmax(r["target"]), _argmax(r["logits"])] += 1
            out.append({"type": qtype, "title": title, "labels": [short(x, LABEL_CHARS) for x in labels],
                        "counts": counts.tolist(), "n": len(fam)})
    return out


def accuracy_by_k(rows: Sequence[Mapping[str, Any]], temperatures: Mapping[str, float] | None) -> list[dict[str, Any]]:
    """One entry per exact K: ``{"k", "n", "types", "accuracy", "chance", "nll_raw", "nll_calibrated"}``."""
    by_k: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        by_k[len(r["logits"])].append(r)
    out = []
    for k in sorted(by_k):
        rs = by_k[k]
        acc = [M.accuracy(r["logits"], r["target"]) for r in rs]
        raw = [M.nll(M.row_probabilities(r), r["target"]) for r in rs]
        cal = [M.nll(M.row_probabilities(r, temperatures), r["target"]) for r in rs]
        types = Counter(str(r["type"]) for r in rs)
        out.append({"k": k, "n": len(rs), "types": dict(sorted(types.items())), "accuracy": float(np.mean(acc)),
                    "chance": 1.0 / k, "nll_raw": float(np.mean(raw)), "nll_calibrated": float(np.mean(cal))})
    return out


def _dist(labels: Sequence[str], p: np.ndarray, top: int = TOP_P) -> str:
    """The ``top`` largest entries as ``label p``, leaving out those that round to 0.00 (but never all)."""
    order = [i for i in np.argsort(-p, kind="stable")[:top]]
    shown = [i for i in order if p[i] >= 0.005] or order[:1]
    return ", ".join(f"{short(labels[i], LABEL_CHARS)} {p[i]:.2f}" for i in shown)


def worst_rows(rows: Sequence[Mapping[str, Any]], temperatures: Mapping[str, float] | None,
               n: int = N_WORST) -> list[dict[str, Any]]:
    """The ``n`` rows with the highest calibrated NLL (ties by id), each as display strings and the NLL."""
    scored = []
    for r in M.sorted_rows(rows):
        p = M.row_probabilities(r, temperatures)
        scored.append((M.nll(p, r["target"]), r, p))
    scored.sort(key=lambda x: -x[0])  # stable: canonical order among equal NLL
    out = []
    for value, r, p in scored[:n]:
        t = np.asarray(r["target"], dtype=np.float64)
        labels = [str(x) for x in (r.get("labels") or range(len(p)))]
        pred = int(np.argmax(p))
        out.append({"id": str(r["id"]), "group": str(r.get("group")), "type": str(r["type"]),
                    "question": short(text_of(r["instructions"]), 80) if r.get("instructions") is not None else None,
                    "state": short(r["state_excerpt"], 120) if r.get("state_excerpt") is not None else None,
                    "target": _dist(labels, t, top=2), "prediction": f"{short(labels[pred], LABEL_CHARS)} {p[pred]:.2f}",
                    "probabilities": _dist(labels, p), "nll": value})
    return out
