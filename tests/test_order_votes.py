"""Order votes (issue 46): the pure math, the Predictor (predict / serve), evaluate --order-votes, the CLI, the bench.

The independent computations here are written out in float64 from the definitions (issue 55: two combinations)
``mean``: ``p_vote = mean_o softmax(z_o)[aligned]``; ``logmean``: ``p_vote ∝ exp(mean_o log softmax(z_o)[aligned])``,
with each permuted question scored on its own by a plain (N = 1) Predictor: they share no code with
`rlcd.order_votes.combine` beyond the model call.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from _tiny_export import tiny_export  # noqa: E402
from conftest import synth_processed, user_error  # noqa: E402

from rlcd.order_votes import COMBINES, MAX_VOTES, check_combine, check_votes, combine, vote_orders  # noqa: E402
from rlcd.predict import Predictor  # noqa: E402

STATE = "The parcel arrived two weeks late, the box was damaged and nobody answers the phone."
QUESTIONS = {
    "dept": {"type": "choice", "instructions": "Which department handles this?",
             "criteria": {"billing": None, "shipping": None, "returns": None, "sales": None}},
    "channel": {"type": "choice", "instructions": "Pick the channel",
                "criteria": {"email": "written message", "phone": "a call", "chat": "live chat"}},
    "angry": {"type": "noul", "instructions": "Is the customer angry?"},
    "urgency": {"type": "score", "instructions": "How urgent is it?",
                "criteria": ["not urgent", "somewhat", "urgent", "critical", "emergency"]},
    "pair": {"type": "choice", "instructions": "Refund or replace?", "criteria": {"refund": None, "replace": None}},
}
REQUEST = {"state": STATE, "questions": QUESTIONS}


# ------------------------------------------------------------------------------------------- the math
def test_vote_orders_shapes():
    assert vote_orders(4, 1) == [[0, 1, 2, 3]]
    assert vote_orders(4, 2) == [[0, 1, 2, 3], [3, 2, 1, 0]]  # N = 2: the reversal
    assert vote_orders(4, 3) == [[0, 1, 2, 3], [1, 2, 3, 0], [2, 3, 0, 1]]  # N >= 3: cyclic shifts
    assert vote_orders(3, 8) == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]  # capped at K orders
    assert vote_orders(2, 5) == [[0, 1], [1, 0]]  # K = 2: the shift is the reversal
    assert vote_orders(1, 4) == [[0]]  # K = 1: its own order only
    for k in range(1, 9):
        for n in range(1, MAX_VOTES + 1):
            orders = vote_orders(k, n)
            assert orders[0] == list(range(k)) and len(orders) == (min(n, k) if k > 1 else 1)
            assert all(sorted(o) == list(range(k)) for o in orders)
            assert len({tuple(o) for o in orders}) == len(orders)  # no order asked twice
    for bad in (0, MAX_VOTES + 1, 2.0, True, "3"):
        with pytest.raises(ValueError, match="order_votes"):
            check_votes(bad)


def _by_hand(zs, orders, how: str) -> list[float]:
    """The voted log-probabilities in float64 from the definitions, with plain Python math: option i of the question
    sits at position orders[o].index(i) in order o."""
    k = len(orders[0])
    if how == "mean":
        p = [0.0] * k
        for z, perm in zip(zs, orders):
            total = math.fsum(math.exp(float(x)) for x in z)
            for i in range(k):
                p[i] += math.exp(float(z[perm.index(i)])) / total / len(orders)
        return [math.log(x) for x in p]
    m = [0.0] * k
    for z, perm in zip(zs, orders):
        lse = math.log(math.fsum(math.exp(float(x)) for x in z))
        for i in range(k):
            m[i] += (float(z[perm.index(i)]) - lse) / len(orders)
    lse = math.log(math.fsum(math.exp(x) for x in m))
    return [x - lse for x in m]


@pytest.mark.parametrize("how", COMBINES)
def test_combine_equals_its_definition_in_candidate_space(how):
    rng = np.random.default_rng(0)
    for k, n in ((4, 2), (4, 3), (5, 4), (3, 8), (2, 3)):
        orders = vote_orders(k, n)
        zs = [rng.normal(size=k) * 3 for _ in orders]
        got = combine(zs, orders, how)
        assert np.allclose(got, _by_hand(zs, orders, how), rtol=0, atol=1e-12)
        assert math.isclose(math.fsum(math.exp(x) for x in got), 1.0, abs_tol=1e-12)  # normalised log-probabilities
    z = [0.3, -1.0, 2.0]
    assert np.allclose(np.exp(combine([z], [[0, 1, 2]], how)), np.exp(z) / np.exp(z).sum(), atol=1e-15)  # one order


def test_logmean_cancels_an_additive_position_bias_over_all_cyclic_shifts_and_mean_does_not():
    """z_o[j] = s[perm_o[j]] + b[j]: over the K cyclic shifts every option sits at every position once, so the
    log-mean is log softmax(s) exactly; the mean of probabilities is not."""
    rng = np.random.default_rng(1)
    for k in (2, 3, 5, 8):
        s, b = rng.normal(size=k), rng.normal(size=k) * 4
        orders = vote_orders(k, k)
        zs = [np.array([s[perm[j]] + b[j] for j in range(k)]) for perm in orders]
        want = s - np.log(np.exp(s).sum())
        assert np.allclose(combine(zs, orders, "logmean"), want, rtol=0, atol=1e-12)
        assert not np.allclose(combine(zs, orders, "mean"), want, rtol=0, atol=1e-3)
    assert combine([[0.0, 1.0]], [[0, 1]]) == combine([[0.0, 1.0]], [[0, 1]], "logmean")  # the default
    for bad in ("geo", "", None):
        with pytest.raises(ValueError, match="vote_combine must be one of logmean, mean"):
            check_combine(bad)


# ------------------------------------------------------------------------------------------- the Predictor
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return tiny_export(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def plain(run_dir) -> Predictor:
    # questions asked as sent: the votes here are over the caller's orders (canonical requests: tests/test_canonical.py)
    return Predictor.from_run(run_dir, state_cache_mb=0, canonical=False)


def _voted_predictor(plain: Predictor, n: int, **kw) -> Predictor:
    return Predictor(plain.model, plain.meta, name=plain.name, order_votes=n,
                     **{"state_cache_mb": 0, "canonical": False, **kw})


def _probs(answer: dict) -> np.ndarray:
    return np.array(list(answer["probabilities"].values()), dtype=np.float64)


def test_one_vote_is_the_plain_predictor_bit_for_bit(plain):
    one = _voted_predictor(plain, 1)
    prepared = one.prepare(REQUEST)
    assert prepared.votes is None and prepared.size()[0] == len(QUESTIONS)
    logits, usage = one.score(prepared)
    ref_logits, ref_usage = plain.runner.score_cases([plain.prepare(REQUEST).case])[0]  # the engine's call itself
    assert len(logits) == len(ref_logits) and all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
    assert usage["input_tokens"] == ref_usage["input_tokens"]
    assert one.predict(REQUEST) == plain.predict(REQUEST)
    assert one.info()["order_votes"] == 1 and _voted_predictor(plain, 3).info()["order_votes"] == 3


def _independent(plain: Predictor, qid: str, n: int, how: str = "mean") -> np.ndarray:
    """p_vote of question `qid` in float64: each order asked alone (a request with the permuted criteria) by the plain
    Predictor, its probabilities (mean) or log-probabilities (logmean, then renormalised) mapped back to the
    question's own options and averaged."""
    q = QUESTIONS[qid]
    labels = list(q["criteria"])
    p = np.zeros(len(labels), dtype=np.float64)
    orders = vote_orders(len(labels), n)
    for perm in orders:
        shown = {labels[i]: q["criteria"][labels[i]] for i in perm}
        prepared = plain.prepare({"state": STATE, "questions": {qid: {**q, "criteria": shown}}})
        (z,), _ = plain.score(prepared)
        z = z.double().numpy()
        e = np.exp(z - z.max())
        for j, i in enumerate(perm):
            p[i] += (e[j] / e.sum() if how == "mean" else np.log(e[j] / e.sum())) / len(orders)
    return p if how == "mean" else np.exp(p) / np.exp(p).sum()


@pytest.mark.parametrize("n, how", [(2, "mean"), (3, "mean"), (2, "logmean"), (3, "logmean")])
def test_votes_equal_an_independent_computation(plain, n, how):
    voter = _voted_predictor(plain, n, vote_combine=how)
    assert voter.info()["vote_combine"] == how
    prepared = voter.prepare(REQUEST)
    logits, _ = voter.score(prepared)
    by_qid = dict(zip(prepared.request.qids, logits))
    answers = voter.predict(REQUEST)["answers"]
    t = plain.temperatures["choice"]
    for qid in ("dept", "channel", "pair"):
        p = _independent(plain, qid, n, how)
        assert np.allclose(np.exp(np.asarray(by_qid[qid], dtype=np.float64)), p, rtol=0, atol=1e-6), qid
        want = p ** (1 / t) / (p ** (1 / t)).sum()  # softmax(log p / T): the answer from the voted logits
        assert np.allclose(_probs(answers[qid]), want, rtol=0, atol=1e-6), qid
        assert answers[qid]["choice"] == list(QUESTIONS[qid]["criteria"])[int(np.argmax(p))]
    plain_answers = plain.predict(REQUEST)["answers"]
    assert abs(answers["angry"]["noul"] - plain_answers["angry"]["noul"]) < 1e-6  # never voted
    assert np.allclose(_probs(answers["urgency"]), _probs(plain_answers["urgency"]), rtol=0, atol=1e-6)
    assert set(answers["urgency"]) == set(plain_answers["urgency"])
    assert list(answers) == list(plain_answers)  # same answer shapes, same order


def test_usage_counts_every_order(plain):
    tokens = {}
    for n in (1, 2, 3, 4):
        voter = _voted_predictor(plain, n)
        prepared = voter.prepare(REQUEST)
        out = voter.predict(REQUEST)
        tokens[n] = out["usage"]["input_tokens"]
        extra = sum(len(o) - 1 for o in prepared.votes) if prepared.votes else 0
        # the case holds one row per order asked; the batcher counts them; the model's own count is reported
        assert len(prepared.case.rows) == len(QUESTIONS) + extra and prepared.size()[0] == len(QUESTIONS) + extra
        assert tokens[n] == voter.runner.score_cases([prepared.case])[0][1]["input_tokens"]
        assert set(out) == {"model", "answers", "usage"} and set(out["usage"]) == {"input_tokens", "output_tokens",
                                                                                      "images"}
    assert tokens[1] < tokens[2] < tokens[3] < tokens[4]
    # dept (K=4) and channel (K=3) grow with N; pair (K=2) stops at its two orders
    assert [len(o) for o in _voted_predictor(plain, 4).prepare(REQUEST).votes] == [4, 3, 1, 1, 2]


def test_a_request_without_choice_questions_runs_as_plain(plain):
    req = {"state": STATE, "questions": {k: QUESTIONS[k] for k in ("angry", "urgency")}}
    voter = _voted_predictor(plain, 3)
    assert voter.prepare(req).votes is None
    assert voter.predict(req) == plain.predict(req)


def test_votes_share_the_state_cache(plain):
    voter = _voted_predictor(plain, 3, state_cache_mb=64)
    first = voter.predict(REQUEST)
    hits = voter.state_cache_stats()["hits"]
    again = voter.predict(REQUEST)
    assert voter.state_cache_stats()["hits"] == hits + 1 and voter.state_cache_stats()["entries"] == 1
    assert again["usage"] == first["usage"]
    for qid in ("dept", "channel", "pair"):
        assert np.allclose(_probs(again["answers"][qid]), _probs(first["answers"][qid]), rtol=0, atol=1e-6)
    cold = _voted_predictor(plain, 3).predict(REQUEST)
    assert np.allclose(_probs(again["answers"]["dept"]), _probs(cold["answers"]["dept"]), rtol=0, atol=1e-6)


def test_batched_voted_requests_equal_alone(plain):
    voter = _voted_predictor(plain, 3)
    other = {"state": "Invoice 1193 was paid twice.", "questions": {"dept": QUESTIONS["dept"],
                                                                    "angry": QUESTIONS["angry"]}}
    a, b = voter.prepare(REQUEST), voter.prepare(other)
    together = voter.score_many([a, b])
    for prepared, (logits, _) in zip((a, b), together):
        alone, _ = voter.score(prepared)
        assert all(np.allclose(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64), atol=1e-5)
                   for x, y in zip(logits, alone))


def test_the_server_votes_and_models_shows_it(plain):
    from fastapi.testclient import TestClient

    from rlcd.server import create_app

    voter = _voted_predictor(plain, 3)
    with TestClient(create_app(voter)) as client:
        models = client.get("/v1/models").json()
        assert models["data"][0]["order_votes"] == 3
        r = client.post("/v1/systemone", json=REQUEST)
    assert r.status_code == 200
    body, want = r.json(), voter.predict(REQUEST)
    assert set(body) == set(want) and body["usage"] == want["usage"]  # no field added to the answer
    for qid in ("dept", "channel", "pair"):
        assert set(body["answers"][qid]) == set(want["answers"][qid])
        assert np.allclose(_probs(body["answers"][qid]), _probs(want["answers"][qid]), rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------- the CLI
@pytest.mark.parametrize("value,contains", [("0", "--order-votes 0"), ("9", "--order-votes 9"),
                                            ("x", "order-votes")])
def test_bad_order_votes_are_user_errors(run_dir, tmp_path, value, contains):
    req = tmp_path / "req.json"
    req.write_text(json.dumps(REQUEST))
    user_error(["predict", run_dir, req, "--order-votes", value], contains=contains)
    user_error(["serve", run_dir, "--order-votes", value], contains=contains)
    user_error(["evaluate", run_dir, "--order-votes", value], contains=contains)
    user_error(["bench", "votes", run_dir, "--order-votes", f"1,{value}"], contains="order-votes")


def test_predict_cli_votes(run_dir, tmp_path, plain):
    from typer.testing import CliRunner

    from rlcd.cli import app

    req = tmp_path / "req.json"
    req.write_text(json.dumps(REQUEST))
    res = CliRunner().invoke(app, ["predict", str(run_dir), str(req), "--order-votes", "3", "--device", "cpu",
                                   "--as-asked"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    want = _voted_predictor(plain, 3).predict(REQUEST)
    assert got["usage"] == want["usage"]
    assert np.allclose(_probs(got["answers"]["dept"]), _probs(want["answers"]["dept"]), rtol=0, atol=1e-6)


def test_bench_votes_reports_time_and_tokens(run_dir, plain):
    from rlcd.bench.votes import run_votes_bench

    res = run_votes_bench(plain, votes=(1, 3), questions=3, repeats=1, state_tokens=40, say=lambda _: None)
    per = res["per_votes"]
    assert set(per) == {"1", "3"} and per["1"]["token_ratio"] == 1.0 and per["1"]["time_ratio"] == 1.0
    assert per["3"]["input_tokens"] > per["1"]["input_tokens"] and per["3"]["rows"] > per["1"]["rows"]
    assert per["3"]["p50_ms"] > 0 and res["choice_questions"] == 1


# ------------------------------------------------------------------------------------------- evaluate
@pytest.mark.parametrize("how", COMBINES)
def test_predict_rows_votes_equal_an_independent_computation(plain, tmp_path, how):
    from rlcd.data.synth import generate
    from rlcd.evaluate import predict_rows
    from rlcd.order_votes import permute_question

    model = plain.model
    records = generate(3, seed=2)
    records[0] = records[0].model_copy(update={"case_id": None})  # a voted row without a case of its own
    collator = model.collator()
    plain_rows = predict_rows(model, records, collator)
    rows = predict_rows(model, records, collator, order_votes=3, vote_combine=how)
    assert [r["id"] for r in rows] == [r.id for r in records] and rows[0].get("case_id") is None
    assert any(r.question.type == "choice" for r in records)
    for rec, row, ref in zip(records, rows, plain_rows):
        assert {k: v for k, v in row.items() if k != "logits"} == {k: v for k, v in ref.items() if k != "logits"}
        if rec.question.type != "choice":
            assert np.allclose(row["logits"], ref["logits"], rtol=0, atol=1e-5)
            continue
        orders = vote_orders(rec.question.k, 3)
        zs = []
        for perm in orders:  # each order scored alone, as its own one-row case
            alone = rec.model_copy(update={"question": permute_question(rec.question, perm), "case_id": None,
                                           "target": [rec.target[i] for i in perm], "posterior": None})
            zs.append(np.asarray(predict_rows(model, [alone], collator)[0]["logits"], dtype=np.float64))
        p = np.exp(_by_hand(zs, orders, how))
        assert np.allclose(np.exp(row["logits"]), p, rtol=0, atol=1e-6), rec.id
    with pytest.raises(ValueError, match="cache"):
        predict_rows(model, records, collator, order_votes=2, features=object())


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    from rlcd.recipe import Recipe
    from rlcd.train import train

    base = tmp_path_factory.mktemp("votes-eval")
    synth_processed(base, 40, seed=5)
    recipe = Recipe(steps=1, eval_every=1, checkpoint_every=1, log_every=1, diagnostics_every=1)
    train(base / "run", data_dir=base / "processed", model="tiny-toy", recipe=recipe, progress=False)
    return base / "run"


def test_evaluate_order_votes_writes_voted_logits_and_meta(trained):
    from typer.testing import CliRunner

    from rlcd.cli import app
    from rlcd.evaluate import predict_rows, scored_records
    from rlcd.export import load_checkpoint_model

    res = CliRunner().invoke(app, ["evaluate", str(trained), "--order-votes", "2", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "order votes: each choice question in 2 option orders" in res.stderr
    ev = json.loads((trained / "eval" / "evaluation.json").read_text())
    assert ev["meta"]["order_votes"] == 2
    temps = json.loads((trained / "eval" / "temperatures.json").read_text())
    assert temps["order_votes"] == 2
    assert not (trained / "export" / "model.json").exists()  # plain answers' export: not from voted temperatures
    model, config, _ = load_checkpoint_model(trained, "best")
    test = scored_records(Path(config["data_dir"]), "test")  # as evaluate asks them: canonical forms, then voted
    rows = [json.loads(x) for x in (trained / "eval" / "predictions-test.jsonl").read_text().splitlines()]
    want = predict_rows(model, test, model.collator(image_root=Path(config["data_dir"])), split="test", order_votes=2)
    plain_rows = predict_rows(model, test, model.collator(image_root=Path(config["data_dir"])), split="test")
    assert [r["id"] for r in rows] == [r["id"] for r in want]
    for got, w, p in zip(rows, want, plain_rows):
        assert np.allclose(got["logits"], w["logits"], rtol=0, atol=1e-6)
        if got["type"] == "choice":
            assert np.allclose(np.exp(got["logits"]).sum(), 1.0, atol=1e-6)  # log of mean probabilities
            assert not np.allclose(got["logits"], p["logits"], atol=1e-6)
        else:
            assert np.allclose(got["logits"], p["logits"], atol=1e-5)
    # `rlcd export` refuses temperatures fitted on voted answers
    user_error(["export", trained], contains="--order-votes")
    # a plain evaluation refits (the voted temperatures do not match) and writes the export and no votes in meta
    res = CliRunner().invoke(app, ["evaluate", str(trained), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "order_votes" not in json.loads((trained / "eval" / "evaluation.json").read_text())["meta"]
    assert "order_votes" not in json.loads((trained / "eval" / "temperatures.json").read_text())
    assert (trained / "export" / "model.json").is_file()
    # --data OTHER: voted there too; the run's plain temperatures are not reused for voted answers
    res = CliRunner().invoke(app, ["evaluate", str(trained), "--data", config["data_dir"], "--out", "other",
                                   "--order-votes", "3", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    other = json.loads((trained / "eval-other" / "evaluation.json").read_text())
    assert other["meta"]["order_votes"] == 3 and "fitted here" in other["meta"]["temperatures_source"]
    assert json.loads((trained / "eval-other" / "temperatures.json").read_text())["order_votes"] == 3
    rows = [json.loads(x) for x in (trained / "eval-other" / "predictions-test.jsonl").read_text().splitlines()]
    want = predict_rows(model, test, model.collator(image_root=Path(config["data_dir"])), split="test", order_votes=3)
    assert all(np.allclose(g["logits"], w["logits"], rtol=0, atol=1e-6) for g, w in zip(rows, want))
