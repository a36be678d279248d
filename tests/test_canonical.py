"""Canonical requests (issue 55): each rule against a request and its permuted / renamed / duplicated / re-typed twin.

The twins are answered by the tiny random-weight export (`_tiny_export`), each alone in its own request: with
canonical requests on, a twin is asked as exactly the same rows as the request, so the answers agree within 1e-6,
mapped back to the twin's own ids. With them off (`canonical=False`, `--as-asked`) the same twins move, which is
what each rule fixes.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from _tiny_export import TEMPERATURES, tiny_export, tiny_predictor  # noqa: E402

from rlcd.predict import Predictor  # noqa: E402
from rlcd.schema import Question  # noqa: E402
from rlcd.serving.canonical import answer_logits, canonical, yes_no  # noqa: E402

STATE = "The parcel arrived two weeks late, the box was damaged and nobody answers the phone."
INSTR = "Which team should handle this ticket?"
CHANNEL = {"email": "a written message", "phone": "a call", "chat": "a live chat", "post": "a letter"}
TOL = 1e-6


@pytest.fixture(scope="module")
def on(tmp_path_factory) -> Predictor:
    return tiny_predictor(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def off(on) -> Predictor:
    return Predictor(on.model, on.meta, name=on.name, canonical=False)


def _ask(p: Predictor, question: dict) -> dict:
    return p.predict({"state": STATE, "questions": {"q": question}})["answers"]["q"]


def _choice(criteria) -> dict:
    return {"type": "choice", "instructions": INSTR, "criteria": criteria}


def _noul() -> dict:
    return {"type": "noul", "instructions": "Is the customer angry?"}


def _softmax(z, t) -> np.ndarray:
    y = np.asarray(z, dtype=np.float64) / t
    e = np.exp(y - y.max())
    return e / e.sum()


# ------------------------------------------------------------------------------------------------ the pure rules
def test_a_choice_is_asked_sorted_by_description_then_id():
    q = Question(type="choice", instructions="x", criteria={"b": "same", "z": "alpha", "a": "same", "c": None})
    c = canonical(q)
    # sorted: c (no description: ""), z (alpha), a (same), b (same, a duplicate of a)
    assert list(c.asked.criteria) == ["c", "z", "a"] and c.asked.instructions == "x"
    assert c.source == (2, 1, 2, 0) and c.shares == (2, 1, 2, 1)
    listed = canonical(Question(type="choice", criteria=["sales", "billing", "returns"]))
    assert listed.asked.criteria == ["billing", "returns", "sales"] and listed.source == (2, 0, 1)


def test_questions_already_canonical_are_asked_as_sent():
    for q in (Question(type="choice", criteria={"a": "x", "b": "y"}), Question(type="choice", criteria=["a", "b"]),
              Question(type="noul", criteria={"true": "late", "false": "on time"}),
              Question(type="score", criteria=["low", "mid", "high"]), Question(type="score", criteria=["no", "maybe"])):
        c = canonical(q)
        assert c.asked is q and c.direct


@pytest.mark.parametrize("meanings, truth", [
    (["yes", "no"], (1, 0)), (["No", " YES "], (0, 1)), (["true", "false"], (1, 0)), (["False", "True"], (0, 1)),
    (["yes", "false"], None), (["yes.", "no"], None), (["y", "n"], None), (["yes", "yes"], None), (["yes"], None),
    (["yes", "no", "maybe"], None), ([None, "no"], None)])
def test_the_yes_no_rule_is_exactly_no_yes_or_false_true_case_folded(meanings, truth):
    assert yes_no([m.strip().casefold() if m is not None else None for m in meanings]) == truth


@pytest.mark.parametrize("criteria, source", [
    ({"yes": "Yes", "no": "No"}, (1, 0)), ({"a": "no", "b": "YES"}, (0, 1)), (["true", "false"], (1, 0)),
    ({"Yes": None, "No": None}, (1, 0)), ({"x": "True", "y": "False", "z": "True"}, (1, 0, 1))])
def test_a_yes_no_choice_is_asked_as_the_noul(criteria, source):
    c = canonical(Question(type="choice", instructions="Is it late?", criteria=criteria))
    assert c.asked == Question(type="noul", instructions="Is it late?") and c.source == source


@pytest.mark.parametrize("criteria", [{"yes": "the customer is angry", "no": "calm"}, {"yes": None, "maybe": None},
                                      {"yes": "Yes", "no": "No", "maybe": "Maybe"}])
def test_a_choice_that_does_not_mean_yes_no_stays_a_choice(criteria):
    assert canonical(Question(type="choice", criteria=criteria)).asked.type == "choice"


@pytest.mark.parametrize("levels, source", [(["No", "Yes"], (0, 1)), (["false", "true"], (0, 1)),
                                            (["Yes", "No"], (1, 0))])
def test_a_yes_no_score_is_asked_as_the_noul(levels, source):
    c = canonical(Question(type="score", instructions="Late?", criteria=levels))
    assert c.asked == Question(type="noul", instructions="Late?") and c.source == source


def test_answer_logits_map_the_asked_probabilities_back_exactly():
    """Against an independent float64 computation: p_caller[i] = softmax(z / T_asked)[source[i]] / shares[i]."""
    rng = np.random.default_rng(3)
    q = Question(type="choice", criteria={"d": "x", "b": "y", "c": "x", "a": "w", "e": "x"})
    c = canonical(q)
    z = rng.normal(size=c.asked.k) * 3
    got_z, t = answer_logits(c, z, TEMPERATURES)
    got = _softmax(got_z, t)
    p = _softmax(z, TEMPERATURES["choice"])
    assert list(c.asked.criteria) == ["a", "c", "b"]  # w; x asked once, under its first id c (of c, d, e); y
    want = [p[1] / 3, p[2], p[1] / 3, p[0], p[1] / 3]
    assert np.allclose(got, want, rtol=0, atol=1e-12) and math.isclose(got.sum(), 1.0, abs_tol=1e-12)
    one, t1 = answer_logits(canonical(Question(type="choice", criteria={"a": "s", "b": "s"})), None, TEMPERATURES)
    assert np.allclose(_softmax(one, t1), [0.5, 0.5], atol=1e-15)


# ---------------------------------------------------------------------------------------------- the Predictor
def test_permuted_twin_gets_the_same_answer_mapped_to_its_ids(on, off):
    base = _ask(on, _choice(CHANNEL))
    order = ["post", "chat", "email", "phone"]
    twin = _ask(on, _choice({k: CHANNEL[k] for k in order}))
    assert list(twin["probabilities"]) == order  # the caller's ids, in the caller's order
    for k in CHANNEL:
        assert abs(twin["probabilities"][k] - base["probabilities"][k]) < TOL
    assert twin["choice"] == base["choice"] and abs(twin["confidence"] - base["confidence"]) < TOL
    # asked as sent, the same twins move: the rule is what makes them agree
    a, b = _ask(off, _choice(CHANNEL)), _ask(off, _choice({k: CHANNEL[k] for k in order}))
    assert max(abs(a["probabilities"][k] - b["probabilities"][k]) for k in CHANNEL) > 1e-3


def test_listed_ids_permuted_get_the_same_answer(on):
    base = _ask(on, _choice(["billing", "shipping", "returns", "sales"]))
    twin = _ask(on, _choice(["sales", "returns", "billing", "shipping"]))
    assert all(abs(twin["probabilities"][k] - base["probabilities"][k]) < TOL for k in base["probabilities"])


def test_duplicated_twin_shares_the_mass_evenly(on, off):
    base = _ask(on, _choice(CHANNEL))
    dup = {"email": CHANNEL["email"], "phone": CHANNEL["phone"], "phone_alt": CHANNEL["phone"],
           "chat": CHANNEL["chat"], "post": CHANNEL["post"]}
    twin = _ask(on, _choice(dup))
    p = twin["probabilities"]
    assert list(p) == list(dup)
    assert abs(p["phone"] - base["probabilities"]["phone"] / 2) < TOL and abs(p["phone"] - p["phone_alt"]) < 1e-15
    for k in ("email", "chat", "post"):
        assert abs(p[k] - base["probabilities"][k]) < TOL
    assert math.isclose(sum(p.values()), 1.0, abs_tol=1e-9)
    assert twin["confidence"] == pytest.approx(max(0.0, (max(p.values()) - 1 / 5) / (1 - 1 / 5)), abs=1e-12)
    offp = _ask(off, _choice(dup))["probabilities"]
    assert abs(offp["phone"] + offp["phone_alt"] - _ask(off, _choice(CHANNEL))["probabilities"]["phone"]) > 1e-3


def test_a_choice_of_copies_only_is_answered_without_the_model(on):
    out = on.predict({"state": STATE, "questions": {"q": _choice({"a": "same", "b": "same", "c": "same"})}})
    assert out["usage"]["input_tokens"] == 0
    assert all(abs(v - 1 / 3) < 1e-12 for v in out["answers"]["q"]["probabilities"].values())


@pytest.mark.parametrize("twin, key", [
    (_choice({"yes": "Yes", "no": "No"}) | {"instructions": "Is the customer angry?"}, "yes"),
    (_choice({"no": "No", "yes": "Yes"}) | {"instructions": "Is the customer angry?"}, "yes"),
    (_choice({"a": "no", "b": "yes"}) | {"instructions": "Is the customer angry?"}, "b"),  # renamed ids
    (_choice(["True", "False"]) | {"instructions": "Is the customer angry?"}, "True"),
    (_choice({"y": "Yes", "n": "No", "y2": "Yes"}) | {"instructions": "Is the customer angry?"}, ("y", "y2")),
    ({"type": "score", "instructions": "Is the customer angry?", "criteria": ["No", "Yes"]}, "1"),
    ({"type": "score", "instructions": "Is the customer angry?", "criteria": ["false", "true"]}, "1"),
    ({"type": "score", "instructions": "Is the customer angry?", "criteria": ["Yes", "No"]}, "0"),
])
def test_retyped_yes_no_twins_get_the_nouls_probability(on, off, twin, key):
    p_true = _ask(on, _noul())["noul"]
    ans = _ask(on, twin)
    assert ans["type"] == twin["type"]
    keys = key if isinstance(key, tuple) else (key,)
    assert abs(sum(ans["probabilities"][k] for k in keys) - p_true) < TOL
    assert math.isclose(sum(ans["probabilities"].values()), 1.0, abs_tol=1e-9)
    if twin["type"] == "score":
        assert ans["legend"] == {str(i): v for i, v in enumerate(twin["criteria"])}  # the caller's levels
        assert abs(ans["score"] - ans["probabilities"]["1"]) < 1e-12
    # asked as sent, a choice or score is another question (its own temperature and prompt)
    alone = _ask(off, twin)
    assert abs(sum(alone["probabilities"][k] for k in keys) - _ask(off, _noul())["noul"]) > 1e-3


def test_a_request_mixing_the_rules_answers_every_question_in_the_callers_ids(on):
    qs = {"channel": _choice({k: CHANNEL[k] for k in ["chat", "post", "email", "phone"]}),
          "angry": _noul(), "angry_choice": _choice({"no": "No", "yes": "Yes"}) | {"instructions": _noul()["instructions"]},
          "one": _choice({"only": None}),
          "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high"]}}
    out = on.predict({"state": STATE, "questions": qs})
    a = out["answers"]
    assert list(a) == list(qs) and list(a["channel"]["probabilities"]) == ["chat", "post", "email", "phone"]
    assert abs(a["angry_choice"]["probabilities"]["yes"] - a["angry"]["noul"]) < 1e-4  # batched rows: float noise
    assert a["one"]["probabilities"] == {"only": 1.0}
    alone = _ask(on, qs["urgency"])
    assert all(abs(alone["probabilities"][k] - a["urgency"]["probabilities"][k]) < 1e-4 for k in alone["probabilities"])


def test_votes_run_on_the_canonical_question(on):
    voter = Predictor(on.model, on.meta, name=on.name, order_votes=3)
    order = ["post", "chat", "email", "phone"]
    a, b = _ask(voter, _choice(CHANNEL)), _ask(voter, _choice({k: CHANNEL[k] for k in order}))
    assert all(abs(a["probabilities"][k] - b["probabilities"][k]) < TOL for k in CHANNEL)


def test_models_and_the_command_line_say_whether_requests_are_canonical(on, off, tmp_path):
    from fastapi.testclient import TestClient
    from typer.testing import CliRunner

    from rlcd.cli import app
    from rlcd.server import create_app

    assert TestClient(create_app(on)).get("/v1/models").json()["data"][0]["canonical_requests"] is True
    assert TestClient(create_app(off)).get("/v1/models").json()["data"][0]["canonical_requests"] is False
    run = tiny_export(tmp_path)
    req = tmp_path / "req.json"
    twin = {"state": STATE, "questions": {"q": _choice({k: CHANNEL[k] for k in ["post", "chat", "email", "phone"]})}}
    req.write_text(json.dumps(twin))
    for flags, p in (([], on), (["--as-asked"], off)):
        res = CliRunner().invoke(app, ["predict", str(run), str(req), "--device", "cpu", *flags])
        assert res.exit_code == 0, res.output
        got = json.loads(res.stdout)["answers"]["q"]["probabilities"]
        want = p.predict(twin)["answers"]["q"]["probabilities"]
        assert all(abs(got[k] - want[k]) < 1e-5 for k in want)
