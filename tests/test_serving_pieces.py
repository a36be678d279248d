"""The Predictor's pieces, each on its own (no Predictor): state encoding with the state cache, scoring with its
one-by-one fallback, mapping answers back (canonical forms, fixed answers, temperatures) and the canonical plan.

The model is the tiny-toy test model (`_tiny_export.build_tiny_model`, built here: the tests change a parameter in
place). References are independent: a case scored alone by the model itself, and float64 numpy softmaxes.
Tolerances: 1e-6 where the same numbers are computed twice (the fallback's alone calls, the mapping's arithmetic);
1e-4 in probability where a batched or cached call is compared with a lone cold one (float noise, as in
tests/test_state_cache.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from _tiny_export import TEMPERATURES, build_tiny_model  # noqa: E402

from rlcd.model.runner import CaseRunner  # noqa: E402
from rlcd.schema import Question, RecordError  # noqa: E402
from rlcd.serving.canonical import asked_forms  # noqa: E402
from rlcd.serving.errors import PredictError  # noqa: E402
from rlcd.serving.limits import Limits  # noqa: E402
from rlcd.serving.mapping import answers, check_temperatures, respond  # noqa: E402
from rlcd.serving.prepared import Prepared  # noqa: E402
from rlcd.serving.request import parse_request  # noqa: E402
from rlcd.serving.runner import Runner, Usage  # noqa: E402
from rlcd.serving.scoring import Scorer  # noqa: E402
from rlcd.serving.state_encoding import StateEncoder, cache_scope, from_record_error, state_cache_bytes  # noqa: E402

META = {"model": "tiny-toy", "model_seed": 0, "temperatures": dict(TEMPERATURES)}
PROB_TOL = 1e-4
EXACT_TOL = 1e-6
LONG = ("Order 5521: the parcel arrived two weeks late, the box was crushed, two of the three plates inside were "
        "broken and the courier left it in the rain. The customer wrote twice and called once; nobody answered. "
        "She wants a refund for the plates and the shipping, and says she will not order again.")
SHORT = "Invoice 1193 was paid twice by bank transfer."
DEPT = Question(type="choice", instructions="Which department handles this?",
                criteria=["billing", "shipping", "returns", "sales"])
ANGRY = Question(type="noul", instructions="Is the customer angry?")
URGENT = Question(type="score", instructions="How urgent is it?", criteria=["not", "somewhat", "very"])


@pytest.fixture(scope="module")
def model():
    """The engine serving drives (`Runner`): the tiny model under a `CaseRunner`."""
    return CaseRunner(build_tiny_model())


def _softmax(z, t: float = 1.0) -> np.ndarray:
    y = np.asarray(z, dtype=np.float64) / t
    e = np.exp(y - y.max())
    return e / e.sum()


def _probs(answer: dict) -> dict[str, float]:
    return {"false": 1 - answer["noul"], "true": answer["noul"]} if answer["type"] == "noul" else answer["probabilities"]


def _parse(questions: dict) -> object:
    return parse_request({"state": LONG, "questions": questions}, Limits())


# ------------------------------------------------------------------------------------------- state encoding
def test_state_cache_bytes_and_an_off_cache():
    assert state_cache_bytes(0) == 0 and state_cache_bytes(1.5) == 3 << 19 and state_cache_bytes(256) == 256 << 20
    for bad in (-1, float("nan"), float("inf"), "8", True, None):
        with pytest.raises(ValueError, match="state_cache_mb must be a number >= 0"):
            state_cache_bytes(bad)
    off = StateEncoder(META, 0)
    assert off.cache_kw(object()) == {} and off.stats()["max_bytes"] == 0


def test_encode_builds_one_case_with_the_vote_orders_as_extra_rows(model):
    enc = StateEncoder(META, 0)
    case, votes = enc.encode(model, LONG, [DEPT, ANGRY], ["dept", "angry"], max_tokens=512)
    assert votes is None and len(case.rows) == 2
    case3, votes3 = enc.encode(model, LONG, [DEPT, ANGRY], ["dept", "angry"], max_tokens=512, order_votes=3)
    assert [len(o) for o in votes3] == [3, 1]  # the choice in 3 orders, the noul never voted
    assert len(case3.rows) == 2 + 2 and case3.n_tokens > case.n_tokens
    # the first rows are the questions as asked: the same tokens as without votes
    assert [r.ids for r in case3.rows[:2]] == [r.ids for r in case.rows]


def test_encode_names_the_question_of_a_row_over_the_token_limit(model):
    enc = StateEncoder(META, 0)
    with pytest.raises(PredictError) as e:
        enc.encode(model, LONG, [ANGRY, DEPT], ["angry", "dept"], max_tokens=20)
    assert e.value.status == 413 and e.value.question in ("angry", "dept")
    assert e.value.field == f"questions.{e.value.question}"


@pytest.mark.parametrize("err,field,qid,status", [
    (RecordError("q1", "tokens", "too long"), "questions.q1", "q1", 413),
    (RecordError("q1", "question.criteria", "bad"), "questions.q1.criteria", "q1", 422),
    (RecordError("q1", "instructions", "bad"), "questions.q1.instructions", "q1", 422),
    (RecordError("q1", "state", "bad"), "state", "q1", 422),
    (RecordError(None, "image", "bad"), "image", None, 422),
    (RecordError("other", "tokens", "too long"), "request", None, 413),
    (RecordError(None, "question.type", "bad"), "request.question.type", None, 422),
])
def test_from_record_error_names_the_request_field(err, field, qid, status):
    got = from_record_error(err, ["q1", "q2"])
    assert (got.field, got.question, got.status, got.message) == (field, qid, status, err.rule)


def test_the_scope_moves_when_a_parameter_changes_in_place(model):
    enc = StateEncoder(META, 64)
    before = cache_scope(model, META)
    assert before == cache_scope(model, dict(META))  # stable
    assert before != cache_scope(model, {**META, "checkpoint_sha256": "0" * 64})  # another export
    case, _ = enc.encode(model, LONG, [ANGRY], ["angry"], max_tokens=512)
    model.score_cases([case], **enc.cache_kw(model))
    assert enc.stats()["misses"] == 1 and enc.stats()["entries"] == 1
    p = next(model.model.parameters())
    with torch.no_grad():
        p.add_(0.0)  # the same values, a new in-place version
    assert cache_scope(model, META) != before
    case, _ = enc.encode(model, LONG, [ANGRY], ["angry"], max_tokens=512)
    model.score_cases([case], **enc.cache_kw(model))
    assert enc.stats()["misses"] == 2 and enc.stats()["hits"] == 0  # the old state is never hit


def test_a_hit_skips_the_prefix_and_gives_the_cold_answer(model):
    warm, cold = StateEncoder(META, 64), StateEncoder(META, 0)
    first, _ = warm.encode(model, LONG, [ANGRY], ["angry"], max_tokens=512)
    (_, u0), = model.score_cases([first], **warm.cache_kw(model))
    assert u0["cached_tokens"] == 0 and warm.stats()["entries"] == 1
    case, _ = warm.encode(model, LONG, [DEPT, URGENT], ["dept", "urgent"], max_tokens=512)
    (got, usage), = model.score_cases([case], **warm.cache_kw(model))
    assert warm.stats()["hits"] == 1
    assert usage["path"] == "prefix" and usage["cached_tokens"] == usage["prefix_tokens"] > 0  # the prefix not run
    ref_case, _ = cold.encode(model, LONG, [DEPT, URGENT], ["dept", "urgent"], max_tokens=512)
    (want, ref_usage), = model.score_cases([ref_case], **cold.cache_kw(model))
    assert usage["input_tokens"] == ref_usage["input_tokens"]  # a hit skips the prefix's forward, not its count
    for g, w in zip(got, want):
        assert np.abs(_softmax(g.tolist()) - _softmax(w.tolist())).max() < PROB_TOL


# ------------------------------------------------------------------------------------------- scoring
class Poisoned:
    """The model, except that any call holding the `bad` case raises (alone or batched), and calls are counted."""

    def __init__(self, model, bad):
        self.model, self.bad, self.calls = model, bad, []

    def score_cases(self, cases, **kw):
        self.calls.append(len(cases))
        if any(c is self.bad for c in cases):
            raise ValueError("this case cannot be scored")
        return self.model.score_cases(cases, **kw)


def _prepared(model, state, questions, qids, votes_n: int = 1) -> Prepared:
    enc = StateEncoder(META, 0)
    case, votes = enc.encode(model, state, questions, qids, max_tokens=512, order_votes=votes_n)
    return Prepared(_parse({q: {"type": "noul"} for q in qids}), None, case, votes)


def test_the_fallback_keeps_a_failing_requests_error_in_its_slot(model):
    reqs = [_prepared(model, LONG, [DEPT, ANGRY], ["dept", "angry"]), _prepared(model, SHORT, [URGENT], ["u"]),
            _prepared(model, LONG + " Again.", [ANGRY], ["angry"])]
    poisoned = Poisoned(model, reqs[1].case)
    out = Scorer(lambda: poisoned).score_many(reqs)
    assert poisoned.calls == [3, 1, 1, 1]  # the batch failed: each request alone
    assert isinstance(out[1], ValueError) and str(out[1]) == "this case cannot be scored"
    for i in (0, 2):
        logits, usage = out[i]
        (want, want_usage), = model.score_cases([reqs[i].case])  # an independent lone call
        assert usage["input_tokens"] == want_usage["input_tokens"]
        for g, w in zip(logits, want):
            assert np.abs(np.asarray(g.tolist()) - np.asarray(w.tolist())).max() <= EXACT_TOL


def test_a_batch_gives_each_request_its_lone_logits_and_skips_empty_ones(model):
    reqs = [_prepared(model, LONG, [DEPT], ["dept"]), Prepared(_parse({"x": {"type": "noul"}}), None, None),
            _prepared(model, SHORT, [ANGRY, URGENT], ["a", "u"])]
    counted = Poisoned(model, None)
    out = Scorer(lambda: counted).score_many(reqs)
    assert counted.calls == [2]  # one batched call, the empty request not in it
    assert out[1] == ([], Usage())
    for i in (0, 2):
        (want, _), = model.score_cases([reqs[i].case])
        for g, w in zip(out[i][0], want):
            assert np.abs(_softmax(g.tolist()) - _softmax(w.tolist())).max() < PROB_TOL


def test_a_lone_failing_request_raises_and_nothing_to_score_needs_no_model(model):
    bad = _prepared(model, SHORT, [ANGRY], ["a"])
    with pytest.raises(ValueError, match="cannot be scored"):
        Scorer(lambda: Poisoned(model, bad.case)).score_many([bad])

    def no_model():
        raise AssertionError("the model was asked for")

    empty = Prepared(_parse({"x": {"type": "choice", "criteria": ["only"]}}), None, None)
    assert Scorer(no_model).score_many([empty, empty]) == [([], Usage())] * 2


def test_voted_logits_are_the_normalised_mean_log_probability_of_the_orders(model):
    """An independent float64 computation: each order asked alone, log-softmaxed, aligned back by option label,
    averaged, renormalised ("logmean"); and the log of the mean probability ("mean")."""
    p = _prepared(model, LONG, [DEPT, ANGRY], ["dept", "angry"], votes_n=3)
    orders = p.votes[0]
    for how in ("logmean", "mean"):
        (logits, _), = Scorer(lambda: model).score_many([p], how)
        per_order = []
        for perm in orders:
            q = Question(type="choice", instructions=DEPT.instructions, criteria=[DEPT.criteria[i] for i in perm])
            case, _ = StateEncoder(META, 0).encode(model, LONG, [q], ["dept"], max_tokens=512)
            (z,), _ = model.score_cases([case])[0]
            lp = np.log(_softmax(z.tolist()))
            back = np.empty(len(perm))
            back[list(perm)] = lp  # row j asked option perm[j]
            per_order.append(back)
        if how == "logmean":
            m = np.mean(per_order, axis=0)
            want = m - np.log(np.exp(m).sum())
        else:
            want = np.log(np.mean(np.exp(per_order), axis=0))
        assert np.abs(_softmax(logits[0]) - _softmax(want)).max() < PROB_TOL, how
        (alone,), _ = model.score_cases([_prepared(model, LONG, [ANGRY], ["angry"]).case])[0]
        assert np.abs(_softmax(logits[1].tolist()) - _softmax(alone.tolist())).max() < PROB_TOL  # the noul not voted


# ------------------------------------------------------------------------------------------- mapping
def _answers_asked(model, questions: dict) -> tuple[dict, dict]:
    """(answers with canonical forms, answers of each canonical form asked directly as its own request)."""
    parsed = _parse(questions)
    canon, asking = asked_forms(parsed.questions, True)
    scored = [i for i, q in enumerate(asking) if q.k > 1]
    case, _ = StateEncoder(META, 0).encode(model, LONG, [asking[i] for i in scored],
                                           [parsed.qids[i] for i in scored], max_tokens=512)
    logits = model.score_cases([case])[0][0]
    got = answers(parsed, canon, logits, TEMPERATURES)
    direct_req = _parse({qid: _wire(asking[i]) for i, qid in enumerate(parsed.qids)})
    direct = answers(direct_req, None, logits, TEMPERATURES)  # the asked forms as sent, with the same logits
    return got, direct


def _wire(q: Question) -> dict:
    return q.model_dump(exclude_none=True)


def test_a_permuted_choice_answers_as_its_canonical_order_asked_directly(model):
    q = {"type": "choice", "instructions": "Which channel?",
         "criteria": {"phone": "a call", "email": "a written message", "chat": "live chat"}}
    got, direct = _answers_asked(model, {"ch": q})
    assert list(got["ch"]["probabilities"]) == ["phone", "email", "chat"]  # the caller's ids, the caller's order
    for label in ("phone", "email", "chat"):
        assert abs(got["ch"]["probabilities"][label] - direct["ch"]["probabilities"][label]) < EXACT_TOL
    assert got["ch"]["choice"] == direct["ch"]["choice"]
    assert abs(sum(got["ch"]["probabilities"].values()) - 1) < EXACT_TOL


def test_duplicated_options_share_the_asked_options_mass(model):
    q = {"type": "choice", "instructions": "Which channel?",
         "criteria": {"mail": "a written message", "phone": "a call", "email": "a written message"}}
    got, direct = _answers_asked(model, {"ch": q})
    asked = direct["ch"]["probabilities"]  # asked once under "email" (the first id in canonical order)
    assert set(asked) == {"email", "phone"}
    p = got["ch"]["probabilities"]
    assert abs(p["mail"] - asked["email"] / 2) < EXACT_TOL and abs(p["email"] - asked["email"] / 2) < EXACT_TOL
    assert abs(p["phone"] - asked["phone"]) < EXACT_TOL


@pytest.mark.parametrize("q", [
    {"type": "choice", "instructions": "Is the customer angry?", "criteria": {"n": "No", "y": "yes "}},
    {"type": "choice", "instructions": "Is the customer angry?", "criteria": ["true", "false"]},
    {"type": "score", "instructions": "Is the customer angry?", "criteria": ["no", "yes"]},
])
def test_a_yes_no_question_answers_as_the_noul_under_the_noul_temperature(model, q):
    got, direct = _answers_asked(model, {"x": q})
    p_true = direct["x"]["noul"]
    parsed = _parse({"x": q})
    labels = parsed.questions[0].labels
    truth = [lab for lab, d in zip(labels, parsed.questions[0].descriptions())
             if (d if d is not None else lab).strip().casefold() in ("yes", "true")]
    (t,) = truth
    assert abs(got["x"]["probabilities"][t] - p_true) < EXACT_TOL
    assert got["x"]["type"] == q["type"]


def test_answers_apply_the_types_temperature(model):
    parsed = _parse({"d": _wire(DEPT), "a": _wire(ANGRY), "u": _wire(URGENT)})
    z = [np.array([0.4, -1.0, 2.2, 0.0]), np.array([-0.3, 0.9]), np.array([1.0, 0.2, -0.5])]
    got = answers(parsed, None, z, TEMPERATURES)
    assert np.abs(np.array(list(got["d"]["probabilities"].values())) - _softmax(z[0], TEMPERATURES["choice"])).max() < 1e-12
    assert abs(got["a"]["noul"] - _softmax(z[1], TEMPERATURES["noul"])[1]) < 1e-12
    pu = _softmax(z[2], TEMPERATURES["score"])
    assert abs(got["u"]["score"] - float(np.dot(np.arange(3), pu))) < 1e-12


def test_one_option_questions_have_the_fixed_answer_and_use_no_logits():
    parsed = _parse({"c": {"type": "choice", "criteria": {"only": "the one option"}},
                     "s": {"type": "score", "instructions": "How?", "criteria": ["a single level"]}})
    got = answers(parsed, asked_forms(parsed.questions)[0], iter(()), TEMPERATURES)  # no logits to read
    assert got["c"] == {"type": "choice", "choice": "only", "confidence": 1.0, "probabilities": {"only": 1.0}}
    assert got["s"] == {"type": "score", "score": 0.0, "legend": {"0": "a single level"}, "confidence": 1.0,
                        "probabilities": {"0": 1.0}}
    out = respond(Prepared(parsed, image=object(), case=None), [], {"input_tokens": 0}, temperatures=TEMPERATURES,
                  name="served")
    assert out["model"] == "served" and out["usage"] == {"input_tokens": 0, "output_tokens": 0, "images": 0}
    assert "warnings" not in out


def test_respond_echoes_the_model_and_counts_the_image_only_when_read():
    parsed = parse_request({"model": "asked-name", "state": SHORT, "questions": {"a": _wire(ANGRY)}}, Limits())
    parsed.warnings.append("asset 'x' is not referred to")
    out = respond(Prepared(parsed, image=object(), case=object()), [np.array([0.0, 1.0])], {"input_tokens": 17.0},
                  temperatures=TEMPERATURES, name="served")
    assert out["model"] == "asked-name" and out["usage"] == {"input_tokens": 17, "output_tokens": 0, "images": 1}
    assert out["warnings"] == ["asset 'x' is not referred to"]


@pytest.mark.parametrize("temps,match", [({"choice": 1.0, "noul": 1.0}, "no temperature for \\['score'\\]"),
                                         ({"choice": 1.0, "noul": 0.0, "score": 1.0}, "temperature for noul"),
                                         ({"choice": math.nan, "noul": 1.0, "score": 1.0}, "temperature for choice")])
def test_check_temperatures_refuses_a_missing_or_bad_one(temps, match):
    with pytest.raises(ValueError, match=match):
        check_temperatures({"temperatures": temps})
    assert check_temperatures(META) == TEMPERATURES


def test_asked_forms_off_asks_every_question_as_sent():
    qs = [Question(type="choice", criteria={"b": "second", "a": "first"}), ANGRY]
    canon, asking = asked_forms(qs, False)
    assert canon is None and asking == qs
    canon, asking = asked_forms(qs, True)
    assert asking[0].labels == ["a", "b"] and canon[0].source == (1, 0) and asking[1] is ANGRY


# ------------------------------------------------------------------------------------------- the engines
def _members(protocol: type) -> set[str]:
    return {k for k in vars(protocol) if not k.startswith("_")} | set(getattr(protocol, "__annotations__", {}))


def _missing(cls: type, protocol: type) -> list[str]:
    """What `cls` lacks of `protocol`: a member, or a method parameter the protocol passes (by name and kind)."""
    import inspect

    out = []
    for name in sorted(_members(protocol)):
        if not hasattr(cls, name):
            out.append(name)
            continue
        want = vars(protocol).get(name)
        if not inspect.isfunction(want):
            continue
        have = inspect.signature(getattr(cls, name)).parameters
        for p in inspect.signature(want).parameters.values():
            if p.name == "self":
                continue
            got = have.get(p.name)
            if got is None or (got.kind != p.kind and got.kind != inspect.Parameter.POSITIONAL_OR_KEYWORD):
                out.append(f"{name}({p.name})")
    return out


def test_both_engines_are_runners(model):
    """`Predictor`, `Scorer` and `StateEncoder` drive a `Runner`: the torch engine (`CaseRunner`) and the portable
    runtime (`PortableModel`, checked on its class: loading one needs an export) both implement it, member by
    member and parameter by parameter; the check fails on what does not."""
    from rlcd.portable.runtime import PortableModel

    assert isinstance(model, Runner)
    assert not isinstance(model.model, Runner)  # the nn.Module is not an engine: the Predictor wraps it
    assert _missing(CaseRunner, Runner) == [] and _missing(PortableModel, Runner) == []

    class Old:  # the engine surface before the protocol: no identity(), no `keyed`
        supports_images, placement = False, {}

        def eval(self):
            return self

        def prepare_case(self, state, questions, image=None, ids=None, *, case_id=None, max_tokens=None):
            return None

        def score_cases(self, cases, **_):
            return []

    assert _missing(Old, Runner) == ["identity", "prepare_case(keyed)", "score_cases(state_cache)",
                                     "score_cases(row_cache)"]
    assert not isinstance(Old(), Runner)
