"""The report's error analysis from prediction rows: confusion matrices, accuracy by K, worst rows."""

import numpy as np

from rlcd.report.error_analysis import MIN_CHOICE_ROWS, accuracy_by_k, confusion_matrices, worst_rows


def row(i, type_, labels, target, logits, **extra):
    return {"id": f"r{i:02d}", "group": "g", "type": type_, "labels": labels, "target": target, "logits": logits,
            **extra}


def test_confusion_counts_by_hand():
    noul = [row(0, "noul", ["false", "true"], [0.0, 1.0], [0.0, 2.0]),   # true -> true
            row(1, "noul", ["false", "true"], [0.2, 0.8], [1.0, 0.0]),   # true -> false
            row(2, "noul", ["false", "true"], [1.0, 0.0], [3.0, 0.0])]   # false -> false
    score = [row(3 + i, "score", ["bad", "ok", "good"], np.eye(3)[t].tolist(), np.eye(3)[p].tolist())
             for i, (t, p) in enumerate([(0, 0), (0, 1), (2, 1), (2, 2), (2, 2)])]
    labels = ["cat", "dog", "fox"]
    choice = [row(10 + i, "choice", labels, np.eye(3)[i % 3].tolist(), np.eye(3)[0].tolist())
              for i in range(MIN_CHOICE_ROWS)]
    big = [row(30, "choice", [f"l{j}" for j in range(9)], np.eye(9)[0].tolist(), np.eye(9)[0].tolist())]
    few = [row(40, "choice", ["a", "b"], [1.0, 0.0], [0.0, 1.0])]  # a label set with too few rows
    out = confusion_matrices(noul + score + choice + big + few)
    assert [m["type"] for m in out] == ["choice", "noul", "score"]  # K = 9 and the one-row set are left out
    c, n, s = out
    assert c["labels"] == labels and c["counts"] == [[2, 0, 0], [2, 0, 0], [1, 0, 0]] and c["n"] == MIN_CHOICE_ROWS
    assert n["labels"] == ["false", "true"] and n["counts"] == [[1, 0], [1, 1]]  # rows: target argmax
    assert s["labels"] == ["bad", "ok", "good"] and s["counts"] == [[1, 1, 0], [0, 0, 0], [0, 1, 2]]
    mixed = score + [row(20, "score", ["1", "2", "3"], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0])]
    assert confusion_matrices(mixed)[0]["labels"] == ["level 0", "level 1", "level 2"]


def test_accuracy_by_k_and_temperatures():
    rows = [row(0, "noul", ["false", "true"], [0.0, 1.0], [0.0, 2.0]),
            row(1, "noul", ["false", "true"], [1.0, 0.0], [0.0, 2.0]),
            row(2, "choice", ["a", "b", "c"], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0])]
    by_k = accuracy_by_k(rows, {"noul": 2.0})
    assert [r["k"] for r in by_k] == [2, 3]
    two, three = by_k
    assert two["n"] == 2 and two["accuracy"] == 0.5 and two["chance"] == 0.5 and two["types"] == {"noul": 2}
    p = 1 / (1 + np.exp(-2.0))  # P(true) at T = 1
    assert np.isclose(two["nll_raw"], (-np.log(p) - np.log(1 - p)) / 2)
    q = 1 / (1 + np.exp(-1.0))  # at T = 2
    assert np.isclose(two["nll_calibrated"], (-np.log(q) - np.log(1 - q)) / 2)
    assert three["accuracy"] == 0.0 and np.isclose(three["nll_raw"], np.log(3))  # ties go to the first label


def test_worst_rows_order_and_old_prediction_files():
    rows = [row(i, "noul", ["false", "true"], [0.0, 1.0], [i / 2, 0.0]) for i in range(30)]
    rows[3]["instructions"] = {"ask": "is it spam?"}
    rows[3]["state_excerpt"] = "Hello " * 40
    worst = worst_rows(rows, None)
    assert len(worst) == 20 and [w["id"] for w in worst[:3]] == ["r29", "r28", "r27"]
    assert all(a["nll"] >= b["nll"] for a, b in zip(worst, worst[1:]))
    assert worst[0]["prediction"] == "false 1.00" and np.isclose(worst[0]["nll"], 14.5 + np.log1p(np.exp(-14.5)), rtol=1e-12) and worst[0]["target"] == "true 1.00"
    assert worst[0]["question"] is None and worst[0]["state"] is None  # rows written before they were stored
    full = worst_rows(rows, None, n=30)
    r3 = next(w for w in full if w["id"] == "r03")
    assert r3["question"] == '{"ask": "is it spam?"}' and r3["state"].endswith("…") and len(r3["state"]) == 120
