"""`usage.input_tokens` is a function of the request alone (issue 70): the same request reports the same count cold
and warm (state cache), with any cache size or none, alone or batched, and a batch job's counts do not move with
`--state-cache-mb`. The count: the request's prompt tokens with the part its rows share counted once
(`rlcd.model.plan.request_tokens`, docs/SERVING.md "Usage")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from _tiny_export import make_tiny_export  # noqa: E402

from rlcd.model.plan import request_tokens  # noqa: E402
from rlcd.predict import Predictor  # noqa: E402

STATE = ("Order 1182: the courier left the parcel at the wrong address, the tracking page still says in transit, "
         "and nobody answers at the depot. I want my money back or the parcel delivered this week.")
QUESTIONS = {"team": {"type": "choice", "instructions": "Which team?", "criteria": {"shipping": "parcels",
                                                                                   "billing": "money"}},
             "refund": {"type": "noul", "instructions": "Is a refund requested?"},
             "urgent": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high"]}}


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-toy"])
def run(request, tmp_path_factory) -> Path:
    """A text decoder (keys and values only: a cold request runs full rows, a warm one its suffixes) and the hybrid
    Qwen3.5 tiny (always the prefix path)."""
    return make_tiny_export(tmp_path_factory.mktemp(request.param) / "run", model_spec=request.param)


def _tokens(p: Predictor, req: dict) -> int:
    return p.predict(req)["usage"]["input_tokens"]


TWO = {"refund": QUESTIONS["refund"], "angry": {"type": "noul", "instructions": "Is a refund requested angrily?"}}


@pytest.mark.parametrize("state, questions", [(STATE, QUESTIONS), (STATE, {"refund": QUESTIONS["refund"]}),
                                              ("Late parcel.", TWO), (STATE, TWO)])
def test_the_same_request_counts_the_same_tokens_cold_warm_and_without_caches(run, state, questions):
    """Among them a short state with two questions (without a cache full rows pay, with one the state is kept) and
    questions whose common prefix runs past the state (a cache cuts at the state's end)."""
    req = {"state": state, "questions": questions}
    cached = Predictor.from_run(run, state_cache_mb=64)
    cold, warm = _tokens(cached, req), _tokens(cached, req)
    if state == STATE:
        assert cached.state_cache_stats()["hits"] >= 1, "the second request found the state"
    off = Predictor.from_run(run, state_cache_mb=0)
    rows_cached = Predictor.from_run(run, row_cache_mb=16)
    counts = {"cold": cold, "warm": warm, "no cache": _tokens(off, req), "row cache cold": _tokens(rows_cached, req),
              "row cache warm": _tokens(rows_cached, req)}
    prepared = off.prepare(req)
    assert set(counts.values()) == {request_tokens(prepared.case.rows)}, counts
    # batched with another request: the same count
    other = {"state": "Another state entirely.", "questions": questions}
    both = cached.score_many([cached.prepare(req), cached.prepare(other)])
    assert both[0][1]["input_tokens"] == cold


def test_the_count_is_the_shared_part_once_plus_every_suffix(run):
    p = Predictor.from_run(run, state_cache_mb=0)
    rows = p.prepare({"state": STATE, "questions": QUESTIONS}).case.rows
    full = sum(len(r.ids) for r in rows)
    n = request_tokens(rows)
    lone = request_tokens(rows[:1])
    assert lone == len(rows[0].ids) and n < full
    shared = (full - n) // (len(rows) - 1)
    assert n == shared + sum(len(r.ids) - shared for r in rows)
    assert all(r.ids[:shared] == rows[0].ids[:shared] for r in rows) and shared <= min(r.decision_pos for r in rows)


def test_a_batch_jobs_counts_do_not_move_with_the_state_cache(run, tmp_path):
    from typer.testing import CliRunner

    from rlcd.batch.io import read_output
    from rlcd.cli import app

    src = tmp_path / "in.jsonl"
    reqs = [{"id": f"r{i}", "state": [STATE, "Late parcel.", f"State {i // 3}: {STATE}"][i % 3],
             "questions": [QUESTIONS, TWO][i % 2]} for i in range(12)]
    src.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    counts = {}
    for mb in ("0", "64"):
        out = tmp_path / f"out-{mb}.jsonl"
        res = CliRunner().invoke(app, ["predict", str(run), "--input", str(src), "--output", str(out),
                                       "--state-cache-mb", mb, "--quiet"])
        assert res.exit_code == 0, res.output
        counts[mb] = {a["id"]: a["usage"]["input_tokens"] for a in read_output(out)}
    assert counts["0"] == counts["64"]
    single = Predictor.from_run(run, state_cache_mb=0)
    assert counts["0"] == {r["id"]: _tokens(single, {k: v for k, v in r.items() if k != "id"}) for r in reqs}
