"""docs/experiments/real-weights/table_forms.py: issue 54's paired tables. The flip-rate comparison pairs the two
arms' order probes by (row, reordering), reports each arm's rate over comparisons as `rlcd probe order` does, and
refuses probes that asked different reorderings (a difference between them would mean nothing)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "experiments" / "real-weights"))
import table_forms  # noqa: E402


def _probe(flips: dict[tuple[str, str], bool]) -> dict:
    """A probe-order result: rows of the ids in `flips` (id -> case and type from the id), one comparison per perm."""
    rows: dict[str, dict] = {}
    for (rid, perm), flip in flips.items():
        case, t = rid.split(":")
        rows.setdefault(rid, {"id": rid, "type": t, "case": case, "comparisons": []})["comparisons"].append(
            {"perm": perm, "flip": flip})
    return {"rows": list(rows.values())}


A = {("c1:choice", "p1"): True, ("c1:choice", "p2"): False, ("c2:choice", "p1"): True, ("c2:choice", "p2"): True,
     ("c3:choice", "p1"): False, ("c1:score", "rev"): True, ("c2:score", "rev"): True}
B = {("c1:choice", "p1"): False, ("c1:choice", "p2"): False, ("c2:choice", "p1"): True, ("c2:choice", "p2"): False,
     ("c3:choice", "p1"): False, ("c1:score", "rev"): False, ("c2:score", "rev"): True}


def test_flip_rates_are_over_comparisons_and_paired_by_row_and_order():
    res = table_forms.paired_order(_probe(A), _probe(B))
    assert set(res) == {"choice", "score"}
    ch = res["choice"]
    assert (ch["n_comparisons"], ch["n_rows"], ch["n_cases"]) == (5, 3, 3)
    assert ch["a"] == pytest.approx(3 / 5) and ch["b"] == pytest.approx(1 / 5)
    assert ch["b_minus_a"] == pytest.approx(-2 / 5)
    lo, hi = ch["b_minus_a95"]
    assert lo <= ch["b_minus_a"] <= hi
    # by case: c1 -1/2 per comparison, c2 -1/2, c3 0; a case resample can hold only c3 (0) or only c1/c2 (-1/2 each)
    assert -0.5 - 1e-12 <= lo and hi <= 1e-12
    sc = res["score"]
    assert (sc["a"], sc["b"], sc["b_minus_a"]) == (1.0, 0.5, -0.5)


def test_a_difference_of_zero_has_a_zero_interval():
    res = table_forms.paired_order(_probe(A), _probe(A))
    for r in res.values():
        assert r["b_minus_a"] == 0 and r["b_minus_a95"] == [0.0, 0.0]


def test_probes_that_asked_different_reorderings_are_refused():
    other = dict(B)
    other[("c3:choice", "p9")] = False
    with pytest.raises(SystemExit, match="different reorderings"):
        table_forms.paired_order(_probe(A), _probe(other))


def test_markdown_shows_each_type_with_its_interval():
    md = table_forms.order_markdown(table_forms.paired_order(_probe(A), _probe(B)))
    assert "| choice | 5 | 3 | 3 | 0.600 | 0.200 | -0.400 [" in md
    assert np.isfinite(float(md.split("| score |")[1].split("|")[4]))
