"""Packing in the batch job (`rlcd.batch.packing`): a window's lines about one state scored as one case, several
states per model call. Each line's answer and usage must stay what it gets alone; the calls must be the packed ones
(one case per state, at most `batch_size` states, by length); a failing pack falls back to its lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from test_batch import TOL, max_diff, predictor, run_dir  # noqa: E402,F401 - fixtures
from test_predict import png  # noqa: E402,F401 - a fixture

from rlcd.batch.io import Row  # noqa: E402
from rlcd.batch.local import score_rows  # noqa: E402
from rlcd.batch.packing import Pack, blocks, merged, packs  # noqa: E402
from rlcd.model.plan import request_tokens  # noqa: E402
from rlcd.model.prompt import EncodedRow  # noqa: E402

SHORT = "Late parcel."
LONG = ("The customer writes that the parcel arrived two weeks late, the box was crushed on one side, two of the "
        "three items inside were broken, and the courier's tracking page still says it is in transit. " * 3)
QUESTIONS = {
    "dept": {"type": "choice", "instructions": "Which department?", "criteria": {"billing": None, "shipping": "parcels",
                                                                                 "returns": None}},
    "angry": {"type": "noul", "instructions": "Is the customer angry?"},
    "urgent": {"type": "score", "instructions": "How urgent is it?", "criteria": ["not", "a bit", "quite", "very"]},
}
MIDDLE = {"ticket": 7, "text": "Refund requested for a blue jacket, size L.", "priority": "high"}


def fake_row(n: int, prefix: int) -> EncodedRow:
    """A row of n tokens whose first `prefix` are its state's (ids 0..prefix-1), the rest its own."""
    return EncodedRow(ids=list(range(prefix)) + [1000 + n * 7 + j for j in range(n - prefix)], prefix_len=prefix,
                      decision_pos=n - 3, marker_pos=[n - 2, n - 1])


def fake_pack(i: int, width: int, rows: int = 2) -> Pack:
    from rlcd.model.cases import CaseInputs

    return Pack([i], CaseInputs([fake_row(width + 5 + j, width) for j in range(rows)]))


# --------------------------------------------------------------------------------------------- the plan of calls
def test_blocks_take_packs_by_length_within_both_bounds():
    widths = [40, 10, 30, 10, 20, 50, 25]
    items = [fake_pack(i, w) for i, w in enumerate(widths)]
    got = blocks(items, 3)
    assert sorted(p.members[0] for b in got for p in b) == list(range(len(widths)))  # every pack once
    flat = [p.width for b in got for p in b]
    assert flat == sorted(flat)  # by length, so a call's prefixes are alike
    assert [len(b) for b in got] == [3, 3, 1]
    tokens = [p.tokens for p in items]
    assert tokens[0] == 40 + 5 + 6  # request_tokens: the shared part once, each row's own
    cap = tokens[1] + tokens[3] + 1  # two short packs fit, a third does not
    got = blocks(items, 16, max_tokens=cap)
    assert all(sum(p.tokens for p in b) <= cap or len(b) == 1 for b in got)
    assert [p.members[0] for p in got[0]] == [1, 3]
    huge = blocks([fake_pack(0, 500)], 4, max_tokens=10)
    assert [[p.members[0] for p in b] for b in huge] == [[0]]  # larger than the bound: a call of its own
    with pytest.raises(ValueError, match="batch_size"):
        blocks(items, 0)


def test_a_pack_is_its_lines_rows_in_order():
    from types import SimpleNamespace

    from rlcd.model.cases import CaseInputs

    a, b, c = (CaseInputs([fake_row(12 + j, 9)]) for j in range(3))
    prepared = [SimpleNamespace(case=a), SimpleNamespace(case=None), SimpleNamespace(case=b),
                SimpleNamespace(case=c)]
    got = packs(prepared, ["s", "s", "t", "s"])
    assert [p.members for p in got] == [[0, 3], [2]]  # a line with nothing to score is in no pack
    assert got[0].case.rows == a.rows + c.rows and got[1].case is b
    assert merged([a]) is a


# --------------------------------------------------------------------------------------------- answers
def requests_about(states, per_state: int = 3) -> list[dict]:
    """Lines about `states`, each state's lines spread through the file, one to three questions each."""
    out = []
    names = list(QUESTIONS)
    for j in range(per_state):
        for i, st in enumerate(states):
            qs = {names[(i + j + k) % len(names)]: QUESTIONS[names[(i + j + k) % len(names)]]
                  for k in range(1 + (i + j) % 3)}
            out.append({"id": f"s{i}-r{j}", "state": st, "questions": qs})
    return out


def rows_of(requests, bad: dict[int, str] | None = None) -> list[Row]:
    """The batch job's rows of a JSONL file of `requests` (`bad`: {index: a line inserted there})."""
    import tempfile

    from rlcd.batch.io import scan

    lines = [json.dumps(r) for r in requests]
    for at, text in sorted((bad or {}).items()):
        lines.insert(at, text)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "in.jsonl"
        path.write_text("\n".join(lines) + "\n")
        return list(scan(path))


class Calls:
    """Counts the model calls a Predictor makes and the rows of each case in them."""

    def __init__(self, predictor, monkeypatch):
        self.calls: list[list[int]] = []
        real = predictor.scorer._call

        def spy(cases):
            self.calls.append([len(c.rows) for c in cases])
            return real(cases)

        monkeypatch.setattr(predictor.scorer, "_call", spy)


def test_packed_answers_equal_single_requests_and_each_state_is_one_case(predictor, monkeypatch, png):
    states = [SHORT, LONG, MIDDLE, "Customer asks whether the store ships to Norway.", LONG + " Second copy."]
    requests = requests_about(states)
    requests.insert(4, {"id": "img-1", "state": SHORT, "image": {"path": png.name},
                        "questions": {"angry": QUESTIONS["angry"]}})  # same text, an image: another state
    requests.append({"id": "img-2", "state": SHORT, "image": {"path": png.name},
                     "questions": {"dept": QUESTIONS["dept"], "urgent": QUESTIONS["urgent"]}})
    bad = {3: '{"id": "no-questions", "state": "x", "questions": {}}'}  # a rejected line in the middle
    rows = rows_of(requests, bad)
    predictor.clear_state_cache()
    calls = Calls(predictor, monkeypatch)
    out = score_rows(predictor, rows, batch_size=2, image_root=png.parent)
    assert [o.line for o in out] == [r.line for r in rows]
    rejected = [o for o in out if o.reject is not None]
    assert [(o.line, o.reject["field"]) for o in rejected] == [(4, "questions")]
    # one case per state (the image makes SHORT + image another state), at most 2 states a call
    n_states = len(states) + 1
    assert sum(len(c) for c in calls.calls) == n_states and all(len(c) <= 2 for c in calls.calls)
    assert len(calls.calls) == -(-n_states // 2)
    monkeypatch.undo()
    predictor.clear_state_cache()
    answered = {o.id: o.response for o in out if o.response is not None}
    for req in requests:
        body = {k: v for k, v in req.items() if k != "id"}
        want = predictor.predict(body, image_root=png.parent)
        assert max_diff(answered[req["id"]], want) < TOL, req["id"]  # usage included, exactly


def test_packing_with_order_votes_keeps_each_lines_votes(run_dir, monkeypatch):
    from rlcd.predict import Predictor

    voting = Predictor.from_run(run_dir, order_votes=3)
    requests = requests_about([SHORT, MIDDLE], per_state=3)
    calls = Calls(voting, monkeypatch)
    out = score_rows(voting, rows_of(requests), batch_size=4)
    assert calls.calls and len(calls.calls[0]) == 2  # both states in one call
    monkeypatch.undo()
    voting.clear_state_cache()
    for o, req in zip(out, requests):
        assert max_diff(o.response, voting.predict({k: v for k, v in req.items() if k != "id"})) < TOL, req["id"]


def test_a_failing_pack_is_scored_line_by_line(predictor, monkeypatch):
    """A pack whose call raises: each of its lines alone, so only the line at fault is rejected."""
    from rlcd.schema import RecordError

    requests = requests_about([SHORT, MIDDLE], per_state=3)
    poisoned = {"type": "noul", "instructions": "Poisoned question?"}
    requests[2]["questions"] = {"p": poisoned}  # s0-r1: a line about SHORT
    rows = rows_of(requests)
    bad_len = len(predictor.prepare({"state": SHORT, "questions": {"p": poisoned}}).case.rows[0])
    real = predictor.scorer._call

    def failing(cases):
        if any(len(r) == bad_len and r.ids[-8:] == bad_ids for c in cases for r in c.rows):
            raise RecordError("p", "question", "the model refused this row")
        return real(cases)

    bad_ids = predictor.prepare({"state": SHORT, "questions": {"p": poisoned}}).case.rows[0].ids[-8:]
    monkeypatch.setattr(predictor.scorer, "_call", failing)
    out = score_rows(predictor, rows, batch_size=4)
    monkeypatch.undo()
    assert [o.id for o in out if o.reject is not None] == ["s0-r1"]
    assert "refused" in next(o for o in out if o.reject is not None).reject["reason"]
    predictor.clear_state_cache()
    for o, req in zip(out, requests):
        if o.response is not None:
            assert max_diff(o.response, predictor.predict({k: v for k, v in req.items() if k != "id"})) < TOL


def test_a_state_split_across_windows_and_a_pack_over_the_token_bound(run_dir, predictor, tmp_path):
    """--chunk-rows 4: a state's lines land in several windows (each a pack of its own there); --batch-size 1 and a
    long state: every call is one state. Answers as single requests, every line once, in order."""
    from typer.testing import CliRunner

    from rlcd.batch.io import read_output
    from rlcd.cli import app

    requests = requests_about([LONG, SHORT, MIDDLE], per_state=4)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in requests))
    for extra in (["--chunk-rows", "4", "--batch-size", "2"], ["--chunk-rows", "64", "--batch-size", "1"]):
        out = tmp_path / f"out{extra[1]}.jsonl"
        res = CliRunner().invoke(app, ["predict", str(run_dir), "--input", str(src), "--output", str(out),
                                       "--device", "cpu", "--quiet", *extra])
        assert res.exit_code == 0, res.output
        answers = read_output(out)
        assert [a["id"] for a in answers] == [r["id"] for r in requests]
        predictor.clear_state_cache()
        for a, req in zip(answers, requests):
            assert max_diff(a, predictor.predict({k: v for k, v in req.items() if k != "id"})) < TOL, req["id"]


def test_a_lines_usage_is_its_own_request_tokens(predictor):
    """usage.input_tokens of a packed line: its own rows' prompt tokens, the shared part once (not the pack's)."""
    requests = requests_about([LONG], per_state=3)
    out = score_rows(predictor, rows_of(requests), batch_size=4)
    for o, req in zip(out, requests):
        prepared = predictor.prepare({k: v for k, v in req.items() if k != "id"})
        assert o.response["usage"]["input_tokens"] == request_tokens(prepared.case.rows)
    assert len({o.response["usage"]["input_tokens"] for o in out}) > 1
