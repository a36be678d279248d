"""`rlcd evaluate --remote`: answers mapped to candidates, a client that respects Retry-After, every row accounted
for, and a served run scored remotely equal to its local evaluation."""

import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import synth_processed, user_error
from rlcd.remote.answers import map_answer
from rlcd.remote.client import SystemOneClient, base_url, retry_after
from rlcd.remote.evaluate import MAX_QUESTIONS, build_requests, evaluate_remote
from rlcd.schema import Question, Record
from rlcd.serving.answer import make_answer

CHOICE = Question(type="choice", instructions="Which queue?", criteria=["billing", "shipping", "returns"])
NOUL = Question(type="noul", instructions="Angry?")
SCORE = Question(type="score", instructions="How urgent?", criteria=["low", "mid", "high", "max"])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return synth_processed(tmp_path_factory.mktemp("data"), 60, seed=3)


# ------------------------------------------------------------------ answers -> candidates


@pytest.mark.parametrize("question", [CHOICE, NOUL, SCORE])
def test_an_rlcd_answer_maps_back_to_the_probabilities_it_was_made_from(question):
    z = np.array([0.3, -1.2, 2.0, 0.1][: question.k])
    p = np.exp(z / 1.7) / np.exp(z / 1.7).sum()
    m = map_answer(question, make_answer(question, z.tolist(), 1.7))
    assert m.reason is None and m.reconstructed is None
    np.testing.assert_allclose(m.probs, p, rtol=0, atol=1e-12)


def test_a_choice_without_probabilities_is_rebuilt_from_its_confidence_and_marked():
    z = [0.2, 1.9, -0.4]
    full = make_answer(CHOICE, z, 1.0)
    p = np.exp(z) / np.exp(z).sum()
    m = map_answer(CHOICE, {k: v for k, v in full.items() if k != "probabilities"})
    assert m.reconstructed and m.probs[1] == pytest.approx(p.max(), abs=1e-12)  # p_max comes back exactly
    assert m.probs[0] == m.probs[2] == pytest.approx((1 - p.max()) / 2, abs=1e-12)


def test_a_score_without_probabilities_is_the_two_levels_around_its_mean():
    m = map_answer(SCORE, {"type": "score", "score": 1.25, "legend": {}, "confidence": 0.5})
    assert m.reconstructed and m.probs == pytest.approx([0, 0.75, 0.25, 0])
    assert sum(i * p for i, p in enumerate(m.probs)) == pytest.approx(1.25)


@pytest.mark.parametrize("answer, reason", [
    ("yes", "not an object"),
    ({"type": "noul", "noul": 0.4}, "answer type 'noul' for a choice question"),
    ({"type": "choice", "probabilities": {"billing": 0.5, "shipping": 0.5}}, "missing ['returns']"),
    ({"type": "choice", "probabilities": {"billing": 0.5, "shipping": 0.3, "returns": 0.3}}, "sums to 1.1"),
    ({"type": "choice", "probabilities": {"billing": float("nan"), "shipping": 0.5, "returns": 0.5}}, "not a probability"),
    ({"type": "choice", "choice": "refunds", "confidence": 0.3}, "'refunds' is not one of the question's labels"),
    ({"type": "choice", "choice": "billing"}, "confidence is not a number"),
])
def test_an_unusable_choice_answer_says_why(answer, reason):
    m = map_answer(CHOICE, answer)
    assert m.probs is None and reason in m.reason


@pytest.mark.parametrize("question, answer", [(NOUL, {"type": "noul", "noul": 1.5}), (NOUL, {"type": "noul", "noul": True}),
                                              (SCORE, {"type": "score", "score": 4.0})])
def test_out_of_range_noul_and_score_answers_are_unusable(question, answer):
    assert map_answer(question, answer).probs is None


# ------------------------------------------------------------------ the client


def test_the_client_waits_as_long_as_retry_after_says_then_gets_the_answer():
    calls, slept = [], []

    def handler(request):
        calls.append(request.headers.get("authorization"))
        if len(calls) == 1:
            return httpx.Response(503, headers={"Retry-After": "2"}, json={"detail": "busy"})
        if len(calls) == 2:
            return httpx.Response(429, json={"detail": "slow down"})  # no header: back-off 0.5 * 2^1
        return httpx.Response(200, json={"answers": {}})

    with SystemOneClient("http://x/v1/systemone", api_key="k", sleep=slept.append,
                         transport=httpx.MockTransport(handler)) as c:
        reply = c.decide({"state": "s", "questions": {}})
    assert reply.body == {"answers": {}} and reply.attempts == 3
    assert slept == [2.0, 1.0] and calls == ["Bearer k"] * 3


def test_a_refusal_is_not_retried_and_a_dead_server_gives_up_after_the_retries():
    def refuse(request):
        return httpx.Response(422, json={"detail": [{"loc": ["body", "questions"], "msg": "bad"}]})

    slept = []
    with SystemOneClient("http://x", sleep=slept.append, transport=httpx.MockTransport(refuse)) as c:
        reply = c.decide({})
    assert reply.attempts == 1 and reply.error.startswith("HTTP 422") and slept == []

    def dead(request):
        raise httpx.ConnectError("refused")

    with SystemOneClient("http://x", retries=2, sleep=slept.append, transport=httpx.MockTransport(dead)) as c:
        reply = c.decide({})
    assert reply.status is None and reply.attempts == 3 and "ConnectError" in reply.error and len(slept) == 2


def test_retry_after_reads_seconds_and_dates_and_is_capped():
    assert retry_after("3", 0) == 3.0
    assert retry_after("999", 0) == 30.0
    assert retry_after(None, 2) == 2.0
    later = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 5))
    assert 3.0 <= retry_after(later, 0) <= 5.0
    assert base_url("http://h:1/v1/systemone/") == "http://h:1" and base_url("https://h/v1") == "https://h"
    with pytest.raises(ValueError, match="http://"):
        base_url("localhost:8000")


# ------------------------------------------------------------------ requests and accounting


def _record(i, q, case="c1", state="a state", image=None):
    return Record(id=f"{case}:{i}", case_id=case, source="t", task="t", state=state, question=q,
                  target=[1.0 / q.k] * q.k, image=image)


def test_one_request_per_state_at_most_64_questions_with_vote_orders_inside():
    recs = [_record(i, CHOICE) for i in range(50)] + [_record(0, NOUL, case="c2", state={"x": 1})]
    recs.append(_record(0, SCORE, case="c3", image="pic.png"))
    out, skipped = build_requests({"test": recs}, "m", votes=2)
    assert [len(o.body["questions"]) for o in out] == [64, 36, 1]  # 50 choice x 2 orders, then c2's noul
    assert all(len(o.body["questions"]) <= MAX_QUESTIONS for o in out)
    first = out[0].asked[0]
    assert first.orders == [[0, 1, 2], [2, 1, 0]]
    asked = out[0].body["questions"]
    # transformers' canonical choice form, label -> description (None: label only); a list is not taken everywhere
    assert asked[first.qids[0]]["criteria"] == {"billing": None, "shipping": None, "returns": None}
    assert list(asked[first.qids[1]]["criteria"]) == ["returns", "shipping", "billing"]
    assert out[2].body["state"] == {"x": 1} and "criteria" not in out[2].body["questions"]["q0"]
    assert skipped == [{"id": "c3:0", "split": "test", "kind": "not_sent",
                        "reason": "the row has an image; remote evaluation sends text states only"}]


def _fake_server(answer_for):
    """A MockTransport System One server answering each question with `answer_for(question dict)`."""
    def handler(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"models": [{"name": "fake"}]})
        body = json.loads(request.content)
        return httpx.Response(200, json={"model": body["model"], "usage": {"input_tokens": 1, "output_tokens": 0},
                                         "answers": {qid: answer_for(q) for qid, q in body["questions"].items()}})
    return httpx.MockTransport(handler)


def test_bad_answers_are_counted_and_listed_never_dropped(tmp_path, data_dir):
    def answer(q):
        if q["type"] == "noul":
            return {"type": "noul", "noul": 2.0}  # not a probability
        if q["type"] == "score":
            return {"type": "score", "score": 1.0, "legend": {}, "confidence": 0.2}  # no probabilities: rebuilt
        k = len(q["criteria"])
        return {"type": "choice", "probabilities": {lab: 1 / k for lab in q["criteria"]}}

    client = SystemOneClient("http://fake", transport=_fake_server(answer))
    ev = evaluate_remote("http://fake", data_dir, tmp_path / "out", client=client, progress=False, max_lost=1.0)
    remote = json.loads((tmp_path / "out" / "remote.json").read_text())
    unanswered = [json.loads(x) for x in (tmp_path / "out" / "eval" / "unanswered.jsonl").read_text().splitlines()]
    splits = [s for s in ("test", "calibration") if (data_dir / f"{s}.jsonl").read_text().strip()]
    assert splits == ["test", "calibration"], "the fixture has both splits"
    preds = {s: (tmp_path / "out" / "eval" / f"predictions-{s}.jsonl").read_text().splitlines() for s in splits}
    read = sum(len((data_dir / f"{s}.jsonl").read_text().splitlines()) for s in splits)
    assert remote["rows_read"] == read == sum(map(len, preds.values())) + len(unanswered)
    assert unanswered and all(u["kind"] == "malformed" and "noul is not a probability" in u["reason"] for u in unanswered)
    assert remote["unanswered_by_kind"] == {"malformed": len(unanswered)}
    n_score = sum(json.loads(x)["type"] == "score" for rows in preds.values() for x in rows)
    assert remote["reconstructed"] == {"score: expected level only": n_score} and n_score > 0
    assert ev["meta"]["remote"]["model"] == "fake"
    md = (tmp_path / "out" / "eval" / "report.md").read_text()
    assert "model `fake` at `http://fake`" in md and f"malformed {len(unanswered)}" in md


@pytest.mark.parametrize("how", ["mean", "logmean"])
def test_remote_order_votes_combine_the_orders_in_candidate_space(tmp_path, data_dir, how):
    """A server with a pure position bias (the first option listed gets 0.6): two orders voted give each end
    option 0.6 / 2 + rest / 2 back in its own place (mean), or sqrt(0.6 rest) renormalised (logmean)."""
    def answer(q):
        if q["type"] != "choice":
            k = 2 if q["type"] == "noul" else len(q["criteria"])
            return ({"type": "noul", "noul": 0.5} if q["type"] == "noul" else
                    {"type": "score", "probabilities": {str(i): 1 / k for i in range(k)}, "score": 0, "legend": {}})
        labels = list(q["criteria"])
        k = len(labels)
        return {"type": "choice", "probabilities": {lab: (0.6 if i == 0 else 0.4 / (k - 1)) for i, lab in enumerate(labels)}}

    client = SystemOneClient("http://fake", transport=_fake_server(answer))
    evaluate_remote("http://fake", data_dir, tmp_path / "v", client=client, progress=False, votes=2, vote_combine=how)
    rows = [json.loads(x) for x in (tmp_path / "v" / "eval" / "predictions-test.jsonl").read_text().splitlines()]
    for r in (r for r in rows if r["type"] == "choice"):
        k = len(r["labels"])
        rest = 0.4 / (k - 1)
        expect = [rest] * k  # a middle option is never listed first in either order
        if how == "mean":
            expect[0] = expect[-1] = (0.6 + rest) / 2
        else:
            expect[0] = expect[-1] = math.sqrt(0.6 * rest)
            expect = [x / sum(expect) for x in expect]
        assert [math.exp(x) for x in r["logits"]] == pytest.approx(expect, abs=1e-12), r["labels"]


# ------------------------------------------------------------------ what the numbers are compared with, lost rows


def _noul_only_server():
    """A System One stub that answers the noul questions only (p(yes) = 0.7); the others get no answer."""
    def handler(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"models": [{"name": "fake"}]})
        body = json.loads(request.content)
        return httpx.Response(200, json={"model": body["model"], "answers": {
            qid: {"type": "noul", "noul": 0.7} for qid, q in body["questions"].items() if q["type"] == "noul"}})
    return httpx.MockTransport(handler)


def _majority_accuracy(train, rows):
    """Independent majority baseline: per (group, instructions) the label most often the argmax of the training
    targets (ties: the smallest label), else the group's among the row's labels, else its first; accuracy on rows."""
    from collections import Counter, defaultdict

    by_key, by_group = defaultdict(Counter), defaultdict(Counter)
    for r in train:
        lab = r.question.labels[int(np.argmax(r.target))]
        by_key[(r.group, r.question.instructions)][lab] += 1
        by_group[r.group][lab] += 1

    def best(counter, labels):
        seen = [(-counter[lab], lab) for lab in labels if counter[lab]]
        return min(seen)[1] if seen else None

    hits = []
    for r in rows:
        labels = r.question.labels
        ans = best(by_key[(r.group, r.question.instructions)], labels) or best(by_group[r.group], labels) or labels[0]
        hits.append(labels.index(ans) == int(np.argmax(r.target)))
    return float(np.mean(hits))


def test_the_baseline_uniform_and_bayes_floor_are_scored_on_the_rows_the_model_answered(tmp_path, data_dir):
    from rlcd.data.io import load_split
    from rlcd.report import format_summary
    from rlcd.report.document import fmt

    client = SystemOneClient("http://fake", transport=_noul_only_server())
    ev = evaluate_remote("http://fake", data_dir, tmp_path / "out", client=client, progress=False, max_lost=1.0)
    train, test = load_split(data_dir, "train"), load_split(data_dir, "test")
    cal = load_split(data_dir, "calibration")
    answered = [r for r in test if r.question.type == "noul"]
    assert 0 < len(answered) < len(test) and ev["raw"]["n"] == len(answered)
    expect = _majority_accuracy(train, answered)
    assert expect != pytest.approx(_majority_accuracy(train, test), abs=1e-3), "the fixture: the rows matter"
    mb = ev["majority_baseline"]
    assert mb["n"] == len(answered) and mb["accuracy"] == pytest.approx(expect, abs=1e-12)
    post = ev["raw"]["overall"]["posterior"]
    t = np.array([r.target for r in answered], dtype=np.float64)
    q = np.array([r.posterior for r in answered], dtype=np.float64)
    assert post["n"] == len(answered)
    assert post["uniform_nll"] == pytest.approx(float(np.mean(-(t * np.log(0.5)).sum(axis=1))), abs=1e-12)
    assert post["bayes_nll"] == pytest.approx(float(np.mean(-(t * np.log(np.maximum(q, 1e-12))).sum(axis=1))), rel=1e-9)
    acc = ev["raw"]["overall"]["accuracy"]
    md = (tmp_path / "out" / "eval" / "report.md").read_text()
    assert f"{fmt(acc)}" in md and f"vs {fmt(expect)} for always answering the training majority" in md
    text = format_summary(ev)
    n_cal = sum(r.question.type == "noul" for r in cal)
    assert f"majority baseline accuracy: {fmt(expect)}   model accuracy: {fmt(acc)}" in text
    assert (f"note: remote: {len(answered) + n_cal} of {len(test) + len(cal)} rows read were answered "
            f"(test {len(answered)} of {len(test)}, calibration {n_cal} of {len(cal)})") in text


def test_a_stored_baseline_on_other_rows_is_not_called_a_verdict():
    """An evaluation.json written before the fix (model on 22 rows, baseline on 66) renders, but says the two are
    not comparable; on the same rows the verdict is judged as usual."""
    from types import SimpleNamespace

    from rlcd.report.verdict import learned_line

    raw = {"overall": {"n": 22, "accuracy": 0.4545, "ci95": {"accuracy": [0.30, 0.60]}}}
    old = learned_line(SimpleNamespace(raw=raw, ev={"majority_baseline": {"n": 66, "accuracy": 0.3636}}))
    assert "on 22 rows vs 0.3636 for the training majority on 66 rows: not comparable" in old
    assert "noise" not in old
    same = learned_line(SimpleNamespace(raw=raw, ev={"majority_baseline": {"n": 22, "accuracy": 0.6364}}))
    assert "vs 0.6364 for always answering the training majority: **below** the majority baseline beyond noise" in same


def _dying_server(answered_requests):
    """A stub that answers its first `answered_requests` requests (every question uniform), then is gone."""
    import threading

    seen, lock = [0], threading.Lock()

    def handler(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"models": [{"name": "fake"}]})
        with lock:
            seen[0] += 1
            if seen[0] > answered_requests:
                raise httpx.ConnectError("connection refused")
        return httpx.Response(200, json=_uniform_answers(json.loads(request.content)))

    return httpx.MockTransport(handler)


def test_a_server_that_dies_mid_run_is_said_and_fails_above_max_lost(tmp_path, data_dir, monkeypatch):
    """The test split's requests go first (concurrency 1): the server answers two of them and dies, so every
    calibration request fails. DIR is written, temperatures.json says why there are no temperatures, the summary
    says what was answered per split, and the command exits 3 -- unless --max-lost accepts the loss."""
    import rlcd.remote.evaluate as remote_eval
    from rlcd.data.io import load_split
    from rlcd.remote.evaluate import RowsLost, build_requests

    test, cal = load_split(data_dir, "test"), load_split(data_dir, "calibration")
    outgoing, _ = build_requests({"test": test, "calibration": cal}, "fake")
    n_test_answered = sum(len(o.asked) for o in outgoing[:2])
    assert outgoing[1].asked[0].split == "test" and n_test_answered < len(test)
    lost = len(test) + len(cal) - n_test_answered

    def client(retries=0):
        return SystemOneClient("http://fake", retries=retries, sleep=lambda _: None, transport=_dying_server(2))

    with pytest.raises(RowsLost) as err:
        evaluate_remote("http://fake", data_dir, tmp_path / "a", client=client(), progress=False, concurrency=1)
    msg = str(err.value)
    assert f"{lost} of {len(test) + len(cal)} rows" in msg and "request_failed" in msg and "not_sent" in msg
    assert "stopped sending once failed requests had lost" in msg, "sending stops once the bound is lost"
    assert f"test {n_test_answered} of {len(test)}, calibration 0 of {len(cal)}" in msg and "--max-lost 0.05" in msg
    temps = json.loads((tmp_path / "a" / "eval" / "temperatures.json").read_text())
    assert temps["temperatures"] == {"choice": 1.0, "noul": 1.0, "score": 1.0}
    assert temps["source"] == (f"none: none of the {len(cal)} rows of {data_dir / 'calibration.jsonl'} got a usable "
                               f"answer (not_sent {len(cal)}): T = 1"), "sending stopped before the calibration requests"
    remote = json.loads((tmp_path / "a" / "remote.json").read_text())
    assert remote["rows_by_split"] == {"test": {"read": len(test), "answered": n_test_answered},
                                       "calibration": {"read": len(cal), "answered": 0}}
    assert err.value.evaluation["majority_baseline"]["n"] == n_test_answered
    # the share is a bound: exactly at it passes, just under it fails (failures in a row would stop it first)
    monkeypatch.setattr(remote_eval, "FAILURES_IN_A_ROW", 10_000)
    share = lost / (len(test) + len(cal))
    evaluate_remote("http://fake", data_dir, tmp_path / "b", client=client(), progress=False, concurrency=1,
                    max_lost=share)
    with pytest.raises(RowsLost):
        evaluate_remote("http://fake", data_dir, tmp_path / "c", client=client(), progress=False, concurrency=1,
                        max_lost=share - 1e-9)
    # the CLI: the summary on stdout, one error line, exit 3; --max-lost 1 accepts it
    from typer.testing import CliRunner

    from rlcd.cli import app

    monkeypatch.setattr(remote_eval, "SystemOneClient", lambda url, **kw: client())
    args = ["evaluate", "--remote", "http://fake", "--data", str(data_dir), "--concurrency", "1"]
    res = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "d")])
    assert res.exit_code == 3, res.output
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("rlcd: error:")]
    assert len(errors) == 1 and "more than --max-lost 0.05 allows" in errors[0] and "Traceback" not in res.output
    assert (f"note: remote: {n_test_answered} of {len(test) + len(cal)} rows read were answered "
            f"(test {n_test_answered} of {len(test)}, calibration 0 of {len(cal)})") in res.stdout
    assert "none of the" in res.stderr and "the data has no calibration split" not in res.output
    res = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "e"), "--max-lost", "1"])
    assert res.exit_code == 0, res.output
    user_error([*args, "--out", tmp_path / "f", "--max-lost", "1.5"], contains="--max-lost")
    user_error(["evaluate", tmp_path, "--max-lost", "0.5"], contains="goes with --remote")


# ------------------------------------------------------------------ /v1/models and refusals (issue 58)

PAGE_404 = ("<!DOCTYPE html>\n<html><head><title>404 Not Found</title><style>body{font:x}</style></head>\n<body>"
            "<h1>Not Found</h1><p>The requested URL was not found on this server.</p>" + "<p>padding</p>" * 50
            + "</body></html>")


def _server(models=None, status_of_models=404, refuse=None):
    """A MockTransport System One server answering every question uniformly; `/v1/models` lists `models`, or
    answers `status_of_models` with an HTML page when `models` is None; `refuse` (a Response) answers everything."""
    def handler(request):
        if refuse is not None:
            return refuse
        if request.url.path == "/v1/models":
            if models is None:
                return httpx.Response(status_of_models, text=PAGE_404, headers={"content-type": "text/html"})
            return httpx.Response(200, json={"models": [{"name": m} for m in models]})
        body = json.loads(request.content)
        answers = {}
        for qid, q in body["questions"].items():
            k = 2 if q["type"] == "noul" else len(q["criteria"])
            answers[qid] = ({"type": "noul", "noul": 0.5} if q["type"] == "noul" else
                            {"type": q["type"], "probabilities": {str(lab): 1 / k for lab in
                             (q["criteria"] if q["type"] == "choice" else range(k))}, "score": 0, "legend": {}})
        return httpx.Response(200, json={"model": body["model"], "answers": answers})
    return httpx.MockTransport(handler)


def test_a_named_model_is_asked_without_v1_models_and_an_unlisted_name_warns_once(tmp_path, data_dir):
    said = []
    client = SystemOneClient("http://fake", transport=_server(models=None))
    ev = evaluate_remote("http://fake", data_dir, tmp_path / "a", client=client, progress=False, model="mine",
                         print_fn=said.append)
    remote = json.loads((tmp_path / "a" / "remote.json").read_text())
    assert remote["model"] == "mine" and remote["served_models"] is None and remote["rows_unanswered"] == 0
    assert ev["meta"]["model"] == "mine"
    (line,) = [x for x in said if "/v1/models" in x or "list" in x]
    assert line == "remote: http://fake does not list its models (HTTP 404 Not Found); asking 'mine'", line
    said.clear()
    client = SystemOneClient("http://fake", transport=_server(models=["fake"]))
    evaluate_remote("http://fake", data_dir, tmp_path / "b", client=client, progress=False, model="other",
                    print_fn=said.append)
    warnings = [x for x in said if "warning" in x]
    assert warnings == ["remote: warning: http://fake serves fake, not 'other'; asking 'other' anyway (--remote-model)"]
    said.clear()
    client = SystemOneClient("http://fake", transport=_server(models=["fake"]))
    evaluate_remote("http://fake", data_dir, tmp_path / "c", client=client, progress=False, model="fake",
                    print_fn=said.append)
    assert not [x for x in said if "warning" in x] and "remote: http://fake serves fake; asking 'fake'" in said


def test_without_a_model_name_v1_models_is_required_and_its_refusal_is_one_line(tmp_path, data_dir):
    from rlcd.errors import RunError

    client = SystemOneClient("http://fake", transport=_server(models=None))
    with pytest.raises(RunError) as e:
        evaluate_remote("http://fake", data_dir, tmp_path / "a", client=client, progress=False)
    msg = str(e.value)
    assert msg == ("--remote http://fake: GET http://fake/v1/models: HTTP 404 Not Found; give the model's name with "
                   "--remote-model NAME"), msg
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("keyed", [False, True])
def test_a_refused_key_names_the_option_in_one_line(tmp_path, data_dir, keyed):
    """rlcd serve's 401 body is a dict under `detail`: its message is quoted, never the dict's repr."""
    from rlcd.errors import RunError

    refuse = httpx.Response(401, json={"detail": {"error_type": "authentication_error", "message": "Invalid API key"}})
    client = SystemOneClient("http://fake", api_key="k" if keyed else None, transport=_server(refuse=refuse))
    with pytest.raises(RunError) as e:
        evaluate_remote("http://fake", data_dir, tmp_path / "a", client=client, progress=False, model="named")
    msg = str(e.value)
    assert "\n" not in msg and "{" not in msg and "HTTP 401 Unauthorized: Invalid API key" in msg, msg
    assert "--api-key-env" in msg and (("was refused" in msg) == keyed), msg


def test_refusals_are_summarised_in_one_line():
    from rlcd.remote.client import REASON_CHARS, summary

    def line(status, **kw):
        return summary(httpx.Response(status, **kw))

    assert line(404, text=PAGE_404, headers={"content-type": "text/html"}) == "HTTP 404 Not Found"
    assert line(502, text="<html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>") == \
        "HTTP 502 Bad Gateway"
    assert line(500, text="<html><body><h1>boom</h1></body></html>") == "HTTP 500 Internal Server Error"
    assert line(422, json={"detail": [{"loc": ["body", "questions", "q0"], "msg": "bad", "type": "x"}]}) == \
        "HTTP 422 Unprocessable Entity: questions.q0: bad"
    assert line(400, json={"error": {"message": "model not found", "type": "invalid_request_error"}}) == \
        "HTTP 400 Bad Request: model not found"
    assert line(503, json={"detail": "busy"}) == "HTTP 503 Service Unavailable: busy"
    assert line(403, json={"detail": "Forbidden"}).startswith("HTTP 403 Forbidden (the server wants an API key")
    long = line(500, text="x " * 1000)
    assert long == "HTTP 500 Internal Server Error", "a long plain page is not quoted"
    many = line(400, json={"detail": "why " * 100})
    assert len(many) <= len("HTTP 400 Bad Request: ") + REASON_CHARS + 1 and many.endswith("…")


# ------------------------------------------------------------------ the CLI's mistakes


def test_remote_cli_mistakes_are_one_line_and_write_nothing(tmp_path, data_dir):
    out = tmp_path / "out"
    user_error(["evaluate", "--remote", "localhost:9", "--data", data_dir, "--out", out], contains="http://")
    user_error(["evaluate", "--remote", "http://127.0.0.1:9"], contains="needs --data D")
    user_error(["evaluate", tmp_path, "--remote", "http://127.0.0.1:9", "--data", data_dir, "--out", out],
               contains="drop RUN")
    user_error(["evaluate", "--remote", "http://127.0.0.1:9", "--data", data_dir, "--out", out,
                "--api-key-env", "RLCD_TEST_UNSET_KEY"], contains="not set")
    user_error(["evaluate", tmp_path, "--split", "dev"], contains="goes with --remote")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    user_error(["evaluate", "--remote", f"http://127.0.0.1:{port}", "--data", data_dir, "--out", out],
               contains="/v1/models")
    assert not out.exists(), "nothing is written before the server answers"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x.txt").write_text("mine")
    user_error(["evaluate", "--remote", f"http://127.0.0.1:{port}", "--data", data_dir, "--out", tmp_path / "full"],
               contains="not empty")


# ------------------------------------------------------------------ a real rlcd serve


@pytest.fixture(scope="module")
def served_run(tmp_path_factory):
    """A tiny run trained, evaluated locally (temperatures fitted) and served by `rlcd serve` in a subprocess with
    its default settings: both ask each row in its canonical form (the synthetic choices' options reordered), so
    the served answers are the evaluation's."""
    from rlcd.data.io import write_jsonl
    from rlcd.data.prepare import prepare
    from rlcd.data.synth import generate
    from rlcd.evaluate import evaluate_run
    from rlcd.recipe import Recipe
    from rlcd.train import train

    base = tmp_path_factory.mktemp("remote")
    write_jsonl(base / "synth.jsonl", generate(80, seed=7))
    prepare([base / "synth.jsonl"], base / "processed", seed=0, fractions=(0.4, 0.1, 0.3, 0.2))
    train(base / "run", data_dir=base / "processed", model="tiny-toy", progress=False,
          recipe=Recipe(steps=3, eval_every=3, checkpoint_every=3, log_every=1, lr_head=5e-3))
    evaluate_run(base / "run", progress=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLCD_TEST_KEY": "sekret", "RLCD_API_KEY": "sekret"}
    proc = subprocess.Popen([sys.executable, "-m", "rlcd.cli", "serve", "--run", str(base / "run"), "--port", str(port),
                             "--quiet"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"rlcd serve did not come up: {proc.stdout.read()[-3000:]}")
            time.sleep(0.2)
    yield {"url": url, "base": base, "run": base / "run"}
    proc.terminate()
    proc.wait(30)


def _probs(row, temperature):
    z = np.asarray(row["logits"], dtype=np.float64) / temperature
    e = np.exp(z - z.max())
    return e / e.sum()


def test_a_served_run_scored_remotely_equals_its_local_evaluation(served_run, monkeypatch):
    from typer.testing import CliRunner

    from rlcd.cli import app

    base, run = served_run["base"], served_run["run"]
    monkeypatch.setenv("RLCD_TEST_KEY", "sekret")
    res = CliRunner().invoke(app, ["evaluate", "--remote", served_run["url"] + "/v1/systemone", "--data",
                                   str(base / "processed"), "--out", str(base / "remote"), "--api-key-env",
                                   "RLCD_TEST_KEY"])
    assert res.exit_code == 0, res.output
    local = json.loads((run / "eval" / "evaluation.json").read_text())
    remote = json.loads((base / "remote" / "eval" / "evaluation.json").read_text())
    temps = json.loads((run / "eval" / "temperatures.json").read_text())["temperatures"]
    assert any(abs(t - 1) > 0.05 for t in temps.values()), f"the fixture should fit real temperatures: {temps}"
    # what the server sends is the calibrated answer: the remote's raw rows are the local calibrated ones
    for split in ("test", "calibration"):
        mine = {r["id"]: r for r in map(json.loads, (run / "eval" / f"predictions-{split}.jsonl").read_text().splitlines())}
        theirs = [json.loads(x) for x in (base / "remote" / "eval" / f"predictions-{split}.jsonl").read_text().splitlines()]
        assert [r["id"] for r in theirs] == list(mine), "every row, in the data's order"
        for r in theirs:
            assert r["labels"] == mine[r["id"]]["labels"] and r["target"] == mine[r["id"]]["target"], "one form"
            np.testing.assert_allclose(_probs(r, 1.0), _probs(mine[r["id"]], temps[r["type"]]), atol=1e-6, rtol=0)
    assert remote["meta"]["remote"]["rows_unanswered"] == 0 and remote["meta"]["remote"]["model"] == "run"
    assert local["meta"]["requests"] == remote["meta"]["requests"] == "canonical"
    for metric in ("nll", "brier", "accuracy", "ece"):
        want = local["calibrated"]["overall"][metric]
        assert remote["raw"]["overall"][metric] == pytest.approx(want, abs=1e-6), metric
    # refitting on answers that are already calibrated moves little (T' near 1)
    assert remote["calibrated"]["overall"]["nll"] == pytest.approx(local["calibrated"]["overall"]["nll"], abs=2e-2)
    assert (base / "remote" / "eval" / "thresholds.json").is_file() and (base / "remote" / "eval" / "report.html").is_file()

    from rlcd.analysis.compare import compare_runs

    cmp = compare_runs([run], [base / "remote"], metric="nll", resamples=200)
    assert cmp["rows"]["compared"] == len(mine_test := (run / "eval" / "predictions-test.jsonl").read_text().splitlines())
    assert abs(cmp["mean_diff"]) < 1e-2 and len(mine_test) > 0


# ------------------------------------------------------------------ derived rows and canonical forms (issue 70)


def _uniform(q):
    if q["type"] == "noul":
        return {"type": "noul", "noul": 0.5}
    labels = list(q["criteria"]) if q["type"] == "choice" else [str(i) for i in range(len(q["criteria"]))]
    return {"type": q["type"], "probabilities": {lab: 1 / len(labels) for lab in labels}}


def test_remote_evaluation_scores_the_original_rows_in_canonical_form_as_rlcd_evaluate(tmp_path, data_dir):
    """On a derived data set, `evaluate --remote` reads the rows `rlcd evaluate` reads (originals, canonical form)
    and fits its temperatures on the original calibration rows; the derived rows are counted, not sent."""
    from rlcd.data.derive import derive_dir, parse_forms
    from rlcd.data.io import load_split
    from rlcd.evaluate import scored_records

    derived = tmp_path / "derived"
    derive_dir(data_dir, derived, parse_forms(None))
    sent: list[dict] = []

    def answer(q):
        sent.append(q)
        return _uniform(q)

    client = SystemOneClient("http://fake", transport=_fake_server(answer))
    evaluate_remote("http://fake", derived, tmp_path / "out", client=client, progress=False)
    remote = json.loads((tmp_path / "out" / "remote.json").read_text())
    temps = json.loads((tmp_path / "out" / "eval" / "temperatures.json").read_text())
    want = {s: scored_records(derived, s) for s in ("test", "calibration")}
    every = {s: load_split(derived, s) for s in ("test", "calibration")}
    assert all(len(every[s]) > len(want[s]) for s in want), "the fixture has derived rows"
    assert remote["rows_by_split"] == {s: {"read": len(want[s]), "answered": len(want[s])} for s in want}
    assert remote["derived_rows_left_out"] == {s: len(every[s]) - len(want[s]) for s in want}
    assert temps["n_rows"] == len(want["calibration"]) and temps["requests"] == remote["requests"] == "canonical"
    rows = [json.loads(x) for x in (tmp_path / "out" / "eval" / "predictions-test.jsonl").read_text().splitlines()]
    assert [(r["id"], r["labels"], r["target"]) for r in rows] == [
        (r.id, r.question.labels, r.target) for r in want["test"]]
    from rlcd.serving.canonical import canonical

    def as_sent(q):  # a question the server's canonical requests ask exactly as sent
        question = Question(**q)
        return canonical(question).asked is question

    assert sent and all(as_sent(q) for q in sent), "every question sent in its canonical form"
    assert not all(as_sent(r.question.model_dump(exclude_none=True)) for r in every["test"]), \
        "the fixture writes some questions in another form"
    sent.clear()
    evaluate_remote("http://fake", derived, tmp_path / "raw", client=client, progress=False, canonical=False)
    assert json.loads((tmp_path / "raw" / "remote.json").read_text())["requests"] == "as_asked"
    assert not all(as_sent(q) for q in sent), "--as-asked sends the rows as written"


# ------------------------------------------------------------------ issue 70: --out, a dead server, a wrong model


def _uniform_answers(body):
    out = {}
    for qid, q in body["questions"].items():
        if q["type"] == "noul":
            out[qid] = {"type": "noul", "noul": 0.5}
        else:
            k = len(q["criteria"])
            labels = list(q["criteria"]) if q["type"] == "choice" else [str(i) for i in range(k)]
            out[qid] = {"type": q["type"], "probabilities": {lab: 1 / k for lab in labels},
                        **({"score": (k - 1) / 2, "legend": {}} if q["type"] == "score" else {})}
    return {"model": body["model"], "answers": out, "usage": {"input_tokens": 1, "output_tokens": 0}}


def test_a_non_empty_out_is_refused_without_force_and_force_clears_the_old_evaluation(tmp_path, data_dir, monkeypatch):
    """A new user re-ran into the same DIR with another --split: the old predictions-dev.jsonl stayed beside the new
    files and `rlcd compare` paired it. Now a non-empty DIR is refused (nothing touched) and --force starts clean."""
    import rlcd.remote.evaluate as remote_eval

    monkeypatch.setattr(remote_eval, "SystemOneClient", lambda url, **kw: SystemOneClient(url, transport=_server(["m"])))
    out = tmp_path / "out"
    args = ["evaluate", "--remote", "http://fake", "--data", str(data_dir), "--out", str(out)]
    from typer.testing import CliRunner

    from rlcd.cli import app

    res = CliRunner().invoke(app, [*args, "--split", "dev"])
    assert res.exit_code == 0, res.output
    assert (out / "eval" / "predictions-dev.jsonl").is_file()
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    user_error([*args, "--split", "test"], contains="--force")
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before, "a refusal touches nothing"
    res = CliRunner().invoke(app, [*args, "--split", "test", "--force"])
    assert res.exit_code == 0, res.output
    assert not (out / "eval" / "predictions-dev.jsonl").exists(), "the earlier evaluation's files are gone"
    assert json.loads((out / "remote.json").read_text())["split"] == "test"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    user_error([*args[:-1], str(tmp_path / "mine"), "--force"], contains="not a remote evaluation")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine"
    user_error(["evaluate", tmp_path, "--force"], contains="goes with --remote")


def _loopback_server(answered_requests):
    """A real HTTP System One server on 127.0.0.1 that answers `/v1/models` and its first `answered_requests`
    requests, then shuts down (its port refuses connections): a server killed mid-run. Returns (url, thread)."""
    import http.server
    import threading

    seen = [0]

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send({"models": [{"name": "m"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            seen[0] += 1
            self._send(_uniform_answers(body))
            if seen[0] >= answered_requests:
                threading.Thread(target=die, daemon=True).start()

    def die():  # stop serving and close the port: later connections are refused
        server.shutdown()
        server.server_close()

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def close():
        thread.join(10)
    return f"http://127.0.0.1:{server.server_address[1]}", close


def test_a_server_killed_mid_run_stops_the_evaluation_with_exit_3_in_bounded_time(tmp_path, data_dir, monkeypatch):
    """The server answers 2 requests and dies. Before: every remaining request was retried 4 times with back-off,
    counted as progress, and with --max-lost 1 the command even exited 0. Now one line says requests fail, sending
    stops after FAILURES_IN_A_ROW failures in a row (the rest `not_sent`), DIR keeps what was answered, exit 3."""
    import rlcd.remote.evaluate as remote_eval
    from rlcd.data.io import load_split
    from typer.testing import CliRunner

    from rlcd.cli import app

    FAILURES_IN_A_ROW = 3  # the fixture's 7 requests: 2 answered, 3 failed, 2 never sent
    monkeypatch.setattr(remote_eval, "FAILURES_IN_A_ROW", FAILURES_IN_A_ROW)
    test, cal = load_split(data_dir, "test"), load_split(data_dir, "calibration")
    outgoing, _ = build_requests({"test": test, "calibration": cal}, "m")
    assert len(outgoing) > FAILURES_IN_A_ROW + 2, "the fixture has more requests than the stop needs"
    url, close = _loopback_server(2)
    real = SystemOneClient
    monkeypatch.setattr(remote_eval, "SystemOneClient",  # the CLI's client, with its back-off sleeps skipped
                        lambda u, **kw: real(u, **{**kw, "sleep": lambda _: None}))
    t0 = time.monotonic()
    res = CliRunner().invoke(app, ["evaluate", "--remote", url, "--data", str(data_dir), "--out", str(tmp_path / "d"),
                                   "--concurrency", "1", "--max-lost", "1"])
    close()
    assert time.monotonic() - t0 < 60
    assert res.exit_code == 3, res.output
    failing = [ln for ln in res.stderr.splitlines() if "requests are failing" in ln]
    assert len(failing) == 1 and "no response" in failing[0], res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("rlcd: error:")]
    assert len(errors) == 1 and f"stopped after {FAILURES_IN_A_ROW} requests in a row failed" in errors[0], res.stderr
    unanswered = [json.loads(x) for x in (tmp_path / "d" / "eval" / "unanswered.jsonl").read_text().splitlines()]
    kinds = {k: sum(u["kind"] == k for u in unanswered) for k in ("request_failed", "not_sent")}
    assert kinds["not_sent"] > 0 and all(u["reason"].startswith("not sent: stopped") for u in unanswered
                                         if u["kind"] == "not_sent")
    failed_requests = {u["id"] for u in unanswered if u["kind"] == "request_failed"}
    assert 0 < len(failed_requests) <= sum(len(o.asked) for o in outgoing[2:2 + FAILURES_IN_A_ROW])
    remote = json.loads((tmp_path / "d" / "remote.json").read_text())
    assert remote["rows_scored"] == sum(len(o.asked) for o in outgoing[:2])


def test_a_dead_server_loses_rows_past_max_lost_and_stops_sending(tmp_path, data_dir):
    """With the default --max-lost the failed requests alone decide it: sending stops once they lost more than the
    share allows (the rest are `not_sent`), long before FAILURES_IN_A_ROW would."""
    from rlcd.remote.evaluate import RowsLost

    calls = []

    def dying(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"models": [{"name": "m"}]})
        calls.append(1)
        if len(calls) > 1:
            raise httpx.ConnectError("connection refused")
        return httpx.Response(200, json=_uniform_answers(json.loads(request.content)))

    client = SystemOneClient("http://fake", retries=0, transport=httpx.MockTransport(dying))
    with pytest.raises(RowsLost) as err:
        evaluate_remote("http://fake", data_dir, tmp_path / "a", client=client, progress=False, concurrency=1,
                        failures_in_a_row=1000)
    assert "stopped sending once failed requests had lost" in str(err.value)
    assert "more than --max-lost 0.05 allows" in str(err.value)
    unanswered = [json.loads(x) for x in (tmp_path / "a" / "eval" / "unanswered.jsonl").read_text().splitlines()]
    assert any(u["kind"] == "not_sent" for u in unanswered)
    n_read = json.loads((tmp_path / "a" / "remote.json").read_text())["rows_read"]
    failed = sum(u["kind"] == "request_failed" for u in unanswered)
    assert failed > 0.05 * n_read and len(calls) < 10


def test_a_model_a_strict_server_does_not_serve_is_exit_2_and_nothing_written(tmp_path, data_dir, monkeypatch):
    """`rlcd serve --strict-model` answers 404 for another name: every request is refused alike, so the command
    stops after a few, says the server's reason in one line, exits 2 and writes nothing (SERVING.md says so)."""
    import rlcd.remote.evaluate as remote_eval
    from rlcd.remote.evaluate import FAILURES_IN_A_ROW

    calls = []

    def strict(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"models": [{"name": "run"}]})
        calls.append(1)
        return httpx.Response(404, json={"detail": [{"loc": ["body", "model"], "type": "value_error",
                                                     "msg": "unknown model 'other'; this server serves 'run'"}]})

    monkeypatch.setattr(remote_eval, "SystemOneClient",
                        lambda u, **kw: SystemOneClient(u, transport=httpx.MockTransport(strict)))
    out = tmp_path / "out"
    res = user_error(["evaluate", "--remote", "http://fake", "--data", data_dir, "--out", out, "--remote-model",
                      "other"], code=2, contains="unknown model 'other'; this server serves 'run'", max_lines=4)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("rlcd: error:")]
    assert len(errors) == 1 and "nothing written" in errors[0], res.stderr
    assert not out.exists()
    assert len(calls) <= FAILURES_IN_A_ROW + 4, "it stops asking once every request is refused alike"
