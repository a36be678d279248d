"""Predictor: response schema, temperatures vs the evaluation's logits, batching, determinism, validation, CLI."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from _tiny_export import TEMPERATURES, tiny_export, tiny_predictor  # noqa: E402

from rlcd.predict import Limits, PredictError, Predictor  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return tiny_export(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def predictor(run_dir) -> Predictor:
    return tiny_predictor(run_dir.parent)


@pytest.fixture(scope="module")
def as_asked(predictor) -> Predictor:
    """The tiny export's Predictor with canonical requests off: every question asked as sent, as evaluation does."""
    return Predictor(predictor.model, predictor.meta, name=predictor.name, canonical=False)


@pytest.fixture(scope="module")
def png(tmp_path_factory) -> Path:
    from PIL import Image

    root = tmp_path_factory.mktemp("img")
    im = Image.new("RGB", (40, 28))
    for x in range(40):
        for y in range(28):
            im.putpixel((x, y), ((x * 6) % 256, (y * 9) % 256, (x * y) % 256))
    path = root / "a.png"
    im.save(path)
    return path


QUESTIONS = {
    "dept": {"type": "choice", "instructions": "Which department handles this?",
             "criteria": ["billing", "shipping", "returns", "sales"]},
    "dept2": {"type": "choice", "instructions": "Pick the channel",
              "criteria": {"email": "written message", "phone": "a call", "chat": "live chat"}},
    "angry": {"type": "noul", "instructions": "Is the customer angry?"},
    "late": {"type": "noul", "instructions": "Was the parcel late?",
             "criteria": {"false": "on time", "true": "late"}},
    "urgency": {"type": "score", "instructions": "How urgent is it?",
                "criteria": ["not urgent", "somewhat", "urgent", "critical", "emergency"]},
}
STATE = "The parcel arrived two weeks late, the box was damaged and nobody answers the phone."


def _mixed_questions(n: int) -> dict:
    out = {}
    words = ["billing", "shipping", "returns", "sales", "refund", "invoice", "courier", "label", "store"]
    for i in range(n):
        kind = ("choice", "noul", "score")[i % 3]
        if kind == "choice":
            k = 2 + i % 5
            out[f"q{i}"] = {"type": "choice", "instructions": f"Which topic (#{i})?",
                            "criteria": [f"{words[(i + j) % len(words)]}{j}" for j in range(k)]}
        elif kind == "noul":
            out[f"q{i}"] = {"type": "noul", "instructions": f"Does it mention {words[i % len(words)]}?"}
        else:
            out[f"q{i}"] = {"type": "score", "instructions": f"Severity #{i}?",
                            "criteria": ["none", "low", "mid", "high"][: 2 + i % 3]}
    return out


def _probs(answer: dict) -> list[float]:
    if answer["type"] == "noul":
        return [1.0 - answer["noul"], answer["noul"]]
    return list(answer["probabilities"].values())


# ------------------------------------------------------------------------------------- schema
def _transformers_confidence(kind: str, p: list[float]) -> float | None:
    """transformers.decision.Question.answer's confidence, written out independently in float64."""
    k = len(p)
    best = max(range(k), key=p.__getitem__)
    if kind == "choice":
        return max(0.0, (p[best] - 1 / k) / (1 - 1 / k))
    if kind == "score":
        distance = sum(x * abs(i - best) for i, x in enumerate(p))
        uniform = sum(abs(i - (k - 1) / 2) for i in range(k)) / k
        return max(0.0, 1 - distance / uniform)
    return None


def test_response_schema_for_each_type(predictor):
    out = predictor.predict({"model": predictor.name, "state": STATE, "questions": QUESTIONS})
    assert set(out) == {"model", "answers", "usage"}
    assert out["model"] == predictor.name == "tiny-run"
    assert list(out["answers"]) == list(QUESTIONS)
    assert isinstance(out["usage"]["input_tokens"], int) and out["usage"]["input_tokens"] > 0
    assert out["usage"]["images"] == 0 and out["usage"]["output_tokens"] == 0
    spread = 0.0
    for qid, ans in out["answers"].items():
        q = QUESTIONS[qid]
        assert ans["type"] == q["type"]
        p = _probs(ans)
        assert all(0.0 < x < 1.0 for x in p)
        assert math.isclose(sum(p), 1.0, abs_tol=1e-9)
        spread = max(spread, max(p) - min(p))
        if q["type"] == "choice":
            assert list(ans) == ["type", "choice", "confidence", "probabilities"]  # transformers' keys
            labels = list(q["criteria"])
            assert list(ans["probabilities"]) == labels
            assert ans["choice"] == labels[max(range(len(p)), key=p.__getitem__)]
            assert ans["confidence"] == pytest.approx(_transformers_confidence("choice", p), abs=1e-12)
        elif q["type"] == "noul":
            assert list(ans) == ["type", "noul"]
            assert isinstance(ans["noul"], float)
        else:
            assert list(ans) == ["type", "score", "legend", "confidence", "probabilities"]
            assert list(ans["probabilities"]) == [str(i) for i in range(len(q["criteria"]))]
            assert ans["legend"] == {str(i): level for i, level in enumerate(q["criteria"])}
            assert ans["score"] == pytest.approx(sum(i * x for i, x in enumerate(p)), abs=1e-12)
            assert ans["confidence"] == pytest.approx(_transformers_confidence("score", p), abs=1e-12)
            assert 0.0 <= ans["score"] <= len(q["criteria"]) - 1
    assert spread > 0.1, "the tiny export should give non-trivial predictions"
    json.dumps(out)  # JSON-serialisable as is


def test_confidence_at_the_extremes():
    """Uniform answers have confidence 0, certain ones 1 (transformers' definitions)."""
    from rlcd.schema import Question
    from rlcd.serving.answer import make_answer

    choice = Question(type="choice", criteria=["a", "b", "c"])
    assert make_answer(choice, [0.0, 0.0, 0.0], 1.0)["confidence"] == pytest.approx(0.0, abs=1e-12)
    assert make_answer(choice, [60.0, 0.0, 0.0], 1.0)["confidence"] == pytest.approx(1.0, abs=1e-12)
    score = Question(type="score", criteria=["l", "m", "h", "x"])
    assert make_answer(score, [0.0] * 4, 1.0)["confidence"] == pytest.approx(0.0, abs=1e-12)
    assert make_answer(score, [0.0, 60.0, 0.0, 0.0], 1.0)["confidence"] == pytest.approx(1.0, abs=1e-12)
    assert make_answer(score, [0.0, 1.0, 0.0, 0.0], 1.0, levels=[{"type": "text", "text": "l"}, "m", "h", "x"])[
        "legend"]["0"] == {"type": "text", "text": "l"}  # the level as the request gave it


# ------------------------------------------------------------------------------------- temperatures
@pytest.mark.parametrize("with_image", [False, True])
def test_probabilities_are_softmax_of_evaluation_logits_over_temperature(as_asked, png, with_image):
    predictor = as_asked  # evaluation scores each row as it is; canonical requests: tests/test_canonical.py
    from rlcd.evaluate import predict_rows
    from rlcd.model.collate import Collator
    from rlcd.schema import Record, parse_question

    records = []
    for qid, raw in QUESTIONS.items():
        q = parse_question(raw, qid=qid)
        records.append(Record(id=qid, source="t", task="t", state=STATE, question=q, target=[1.0 / q.k] * q.k,
                              image=png.name if with_image else None))
    collator = Collator(predictor.model.tokenizer, predictor.model.image_processor, image_root=png.parent)
    rows = predict_rows(predictor.model, records, collator)
    out = predictor.predict({"state": STATE, "questions": QUESTIONS}, png if with_image else None)
    assert out["usage"]["images"] == int(with_image)
    for row in rows:
        ans = out["answers"][row["id"]]
        t = TEMPERATURES[row["type"]]
        logits = torch.tensor(row["logits"], dtype=torch.float64)
        expected = torch.softmax(logits / t, -1).tolist()
        got = _probs(ans)
        assert got == pytest.approx(expected, abs=1e-5), row["id"]
        # the temperature matters: the raw softmax is measurably different
        raw = torch.softmax(logits, -1).tolist()
        assert max(abs(a - b) for a, b in zip(raw, got)) > 1e-3, row["id"]


def test_temperatures_come_from_the_export(run_dir, predictor):
    meta = json.loads((run_dir / "export" / "model.json").read_text())
    assert meta["temperatures"] == TEMPERATURES
    assert predictor.temperatures == TEMPERATURES
    assert Predictor.from_run(run_dir / "export").temperatures == TEMPERATURES


# ------------------------------------------------------------------------------------- batching
@pytest.mark.parametrize("with_image", [False, True])
def test_one_request_of_20_equals_20_single_requests(predictor, png, with_image):
    qs = _mixed_questions(20)
    image = png if with_image else None
    batched = predictor.predict({"state": STATE, "questions": qs}, image)
    assert batched["usage"]["images"] == int(with_image)
    single_tokens = 0
    for qid, q in qs.items():
        one = predictor.predict({"state": STATE, "questions": {qid: q}}, image)
        a, b = batched["answers"][qid], one["answers"][qid]
        assert a["type"] == b["type"]
        assert _probs(a) == pytest.approx(_probs(b), abs=1e-5), qid
        if a["type"] == "score":
            assert a["score"] == pytest.approx(b["score"], abs=1e-5)
        if a["type"] == "choice":
            assert a["choice"] == b["choice"]
        single_tokens += one["usage"]["input_tokens"]
    # the shared prefix is processed once in the batched request
    assert batched["usage"]["input_tokens"] < single_tokens


def test_same_request_same_answer_whatever_came_before(predictor, png):
    a = {"state": STATE, "questions": QUESTIONS}
    b = {"state": {"ticket": 7, "text": "Refund for a blue jacket"}, "questions": _mixed_questions(7)}
    first = predictor.predict(a)
    predictor.predict(b, png)
    predictor.predict(b)
    again = predictor.predict(a)
    assert again == first
    first_img = predictor.predict(a, png)
    predictor.predict(b)
    assert predictor.predict(a, png) == first_img
    assert first_img["answers"] != first["answers"]  # the image is used


def test_concurrent_requests_are_serialised_and_identical(predictor):
    reqs = [{"state": f"{STATE} #{i}", "questions": _mixed_questions(3 + i)} for i in range(4)]
    expected = [predictor.predict(r) for r in reqs]
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for _ in range(3):
                results[i] = predictor.predict(reqs[i])
                assert results[i] == expected[i]
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert [results[i] for i in range(4)] == expected


def test_model_calls_never_overlap(predictor):
    """Requests are serialised: at most one thread is inside the model at any time."""
    import time

    class Probe:
        def __init__(self, model):
            self._model, self.inside, self.most = model, 0, 0
            self._count = threading.Lock()

        def __getattr__(self, name):
            return getattr(self._model, name)

        def score_cases(self, *args, **kw):
            with self._count:
                self.inside += 1
                self.most = max(self.most, self.inside)
            time.sleep(0.02)
            try:
                return self._model.score_cases(*args, **kw)
            finally:
                with self._count:
                    self.inside -= 1

    probe = Probe(predictor.runner)
    shared = Predictor(probe, predictor.meta, name=predictor.name)
    req = {"state": STATE, "questions": {"a": QUESTIONS["angry"]}}
    want = predictor.predict(req)
    got: list[dict] = []
    threads = [threading.Thread(target=lambda: got.append(shared.predict(req))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 6 and all(g == want for g in got)
    assert probe.most == 1


# ------------------------------------------------------------------------------------- images
def test_image_as_path_or_pil_gives_the_same_answer(predictor, png):
    from PIL import Image

    req = {"state": STATE, "questions": QUESTIONS}
    by_path = predictor.predict(req, png)
    by_str = predictor.predict(req, str(png))
    with Image.open(png) as im:
        by_pil = predictor.predict(req, im.copy())
    assert by_path == by_str == by_pil
    assert by_path["usage"]["images"] == 1
    assert by_path["usage"]["input_tokens"] > predictor.predict(req)["usage"]["input_tokens"]


@pytest.mark.parametrize("kind", ["missing", "garbage", "aspect"])
def test_bad_images_are_refused(predictor, tmp_path, kind):
    from PIL import Image

    if kind == "missing":
        path = tmp_path / "nope.png"
    elif kind == "garbage":
        path = tmp_path / "g.png"
        path.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    else:
        path = tmp_path / "thin.png"
        Image.new("RGB", (400, 1)).save(path)
    with pytest.raises(PredictError) as ei:
        predictor.predict({"state": STATE, "questions": {"a": QUESTIONS["angry"]}}, path)
    assert ei.value.field == "image"
    assert 400 <= ei.value.status < 500


# ------------------------------------------------------------------------------------- validation
def _req(**kw):
    r = {"state": STATE, "questions": {"q1": dict(QUESTIONS["dept"])}}
    r.update(kw)
    return r


VALIDATION_CASES = [
    ("not_object", ["state", "questions"], {}, "body", None),
    ("unknown_field", _req(temperature=0.5), {}, "temperature", None),
    ("model_not_text", _req(model=7), {}, "model", None),
    ("missing_state", {"questions": {"q1": QUESTIONS["dept"]}}, {}, "state", None),
    ("state_not_text", _req(state=42), {}, "state", None),
    ("missing_questions", {"state": STATE}, {}, "questions", None),
    ("questions_not_object", _req(questions=[QUESTIONS["dept"]]), {}, "questions", None),
    ("empty_questions", _req(questions={}), {}, "questions", None),
    ("too_many_questions", _req(questions=_mixed_questions(4)), {"max_questions": 3}, "questions", None),
    ("question_not_object", _req(questions={"q1": "choose"}), {}, "questions.q1", "q1"),
    ("unknown_type", _req(questions={"q1": {"type": "rank", "instructions": "x", "criteria": ["a", "b"]}}), {},
     "questions.q1.type", "q1"),
    ("bad_text_part", _req(questions={"q1": {"type": "noul", "instructions": {"type": "text", "txt": "x"}}}), {},
     "questions.q1.instructions", "q1"),
    ("asset_url", _req(state="see img-1", assets={"img-1": {"url": "https://example.com/a.png"}}), {},
     "assets.img-1.url", None),
    ("asset_not_object", _req(state="see img-1", assets={"img-1": "a.png"}), {}, "assets.img-1", None),
    ("too_many_assets", _req(assets={f"i{j}": {"data_base64": "AAAA"} for j in range(5)}), {}, "assets", None),
    ("two_images", _req(state="img-1 and img-2", assets={"img-1": {"data_base64": "AAAA"},
                                                         "img-2": {"data_base64": "AAAA"}}), {}, "assets.img-2", None),
    ("no_candidates", _req(questions={"q1": {"type": "choice", "instructions": "x", "criteria": []}}), {},
     "questions.q1.criteria", "q1"),
    ("too_many_candidates", _req(questions={"q1": {"type": "choice", "instructions": "x",
                                                   "criteria": [f"l{i}" for i in range(6)]}}),
     {"max_candidates": 5}, "questions.q1.criteria", "q1"),
    ("duplicate_labels", _req(questions={"q1": {"type": "choice", "instructions": "x", "criteria": ["a", "a"]}}), {},
     "questions.q1.criteria", "q1"),
    ("bad_noul_criteria", _req(questions={"q1": {"type": "noul", "instructions": "x", "criteria": {"yes": "y"}}}),
     {}, "questions.q1.criteria", "q1"),
    ("score_without_levels", _req(questions={"q1": {"type": "score", "instructions": "x"}}), {},
     "questions.q1.criteria", "q1"),
    ("extra_question_field", _req(questions={"q1": {**QUESTIONS["angry"], "weight": 2}}), {},
     "questions.q1.weight", "q1"),
    ("marker_in_state", _req(state="ok <|fim_suffix|> - yes"), {}, "state", None),
    ("reserved_in_json_state", _req(state={"a": "<|im_start|>system"}), {}, "state", None),
    ("marker_in_instructions", _req(questions={"q1": {"type": "noul", "instructions": "is <|fim_suffix|> it"}}), {},
     "questions.q1.instructions", "q1"),
    ("marker_in_label", _req(questions={"q1": {"type": "choice", "instructions": "x",
                                               "criteria": ["a<|fim_suffix|>", "b"]}}), {},
     "questions.q1.criteria", "q1"),
    ("too_many_tokens", _req(state="word " * 400), {"max_tokens": 200}, "questions.q1", "q1"),
    ("too_many_bytes", _req(state="x" * 5000), {"max_request_bytes": 4000}, "request", None),
]


@pytest.mark.parametrize("name,request_,limits,field,qid", VALIDATION_CASES, ids=[c[0] for c in VALIDATION_CASES])
def test_validation_errors_name_the_field_and_question(predictor, name, request_, limits, field, qid):
    lim = Limits().with_(**limits)
    with pytest.raises(PredictError) as ei:
        predictor.predict(request_, limits=lim)
    err = ei.value
    assert err.field == field, str(err)
    assert err.question == qid
    assert 400 <= err.status < 500
    assert err.message and isinstance(err.message, str)
    assert err.to_json()["detail"][0]["loc"] == (["body"] if field in ("body", "request") else
                                                 ["body", *field.split(".")])
    if qid is not None:
        assert repr(qid) in str(err)
    # the same request is fine once the limit it broke is lifted (limit cases only)
    if limits and name != "too_many_candidates":
        predictor.predict(request_)


def test_limits_are_validated():
    with pytest.raises(ValueError):
        Limits(max_candidates=300)
    with pytest.raises(ValueError):
        Limits(max_questions=0)
    assert Limits().with_(max_questions=5, max_tokens=None).max_questions == 5


# ------------------------------------------------------------------------------------- CLI
def test_predict_command(run_dir, predictor, png, tmp_path):
    from typer.testing import CliRunner

    from rlcd.cli import app

    runner = CliRunner()

    req = {"state": STATE, "questions": QUESTIONS, "image": {"path": png.name}}
    (png.parent / "req.json").write_text(json.dumps(req))
    res = runner.invoke(app, ["predict", "--run", str(run_dir), "--request", str(png.parent / "req.json")])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == predictor.predict({"state": STATE, "questions": QUESTIONS}, png)

    res = runner.invoke(app, ["predict", "--run", str(run_dir), "--state", STATE,
                              "--question", json.dumps({"id": "angry", **QUESTIONS["angry"]}),
                              "-q", "dept=" + json.dumps(QUESTIONS["dept"]), "--image", str(png)])
    assert res.exit_code == 0, res.output
    want = predictor.predict({"state": STATE, "questions": {"angry": QUESTIONS["angry"], "dept": QUESTIONS["dept"]}},
                             png)
    assert json.loads(res.stdout) == want

    res = runner.invoke(app, ["predict", "--run", str(run_dir), "--state", "x <|fim_suffix|>",
                              "-q", "a=" + json.dumps(QUESTIONS["angry"])])
    assert res.exit_code == 2
    assert res.stderr.startswith("rlcd: error:") and "'state'" in res.stderr and len(res.stderr.splitlines()) == 1


# ------------------------------------------------------------------------------- stdin, for real
SRC = Path(__file__).resolve().parent.parent / "src"


def _rlcd(*args: str, stdin: str) -> subprocess.CompletedProcess:
    """`echo STDIN | python -m rlcd.cli ARGS` in a fresh process of this checkout (stdin a pipe, not a terminal)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "rlcd.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=300, env=env)


def test_predict_answers_a_piped_request(run_dir, predictor):
    """`echo '{...}' | rlcd predict RUN`: the request comes from stdin; stdout is the JSON response alone."""
    req = {"state": STATE, "questions": {"angry": QUESTIONS["angry"], "dept": QUESTIONS["dept"]}}
    out = _rlcd("predict", str(run_dir), "--device", "cpu", stdin=json.dumps(req))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == predictor.predict(req)
    assert "model: loading export" in out.stderr and "model: ready in" in out.stderr  # said on stderr


def test_predict_takes_the_request_file_after_the_run(tmp_path, run_dir, predictor):
    """`rlcd predict RUN request.json` (what most people type first) answers like `--request request.json`."""
    from typer.testing import CliRunner

    from rlcd.cli import app

    req = {"state": STATE, "questions": {"angry": QUESTIONS["angry"]}}
    path = tmp_path / "request.json"
    path.write_text(json.dumps(req))
    out = CliRunner().invoke(app, ["predict", str(run_dir), str(path), "--device", "cpu"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout) == predictor.predict(req)


@pytest.mark.parametrize("stdin, needle", [
    ("{not json", "(stdin) is not valid JSON"),
    ("", "the request (stdin) is empty; send a JSON object"),  # as the server says (issue 58)
    (json.dumps({"state": "s", "questions": {"q1": {"type": "maybe", "instructions": "x"}}}), "unknown question type"),
])
def test_a_malformed_piped_request_fails_before_the_model_loads(tmp_path, stdin, needle):
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.json").write_text("{}")  # loading this would fail differently ("unsupported export format")
    out = _rlcd("predict", str(export), stdin=stdin)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("rlcd: error:") and needle in out.stderr and len(out.stderr.splitlines()) == 1
    assert "model:" not in out.stderr  # nothing was loaded


# ------------------------------------------------------------------------------- one-option questions
ONE_OPTION = {
    "only": {"type": "choice", "instructions": "Which team?", "criteria": {"shipping": "parcels and couriers"}},
    "level": {"type": "score", "instructions": "How urgent?", "criteria": [{"type": "text", "text": "whenever"}]},
}


def _transformers_answer(name: str, question: dict, probabilities: list[float]) -> dict:
    """transformers' own answer (`Question.answer`) for a question of a request, from its probabilities."""
    from transformers.decision import DecisionConfig
    from transformers.decision.template_utils import Question as TQuestion

    return TQuestion.from_request(name, question, DecisionConfig()).answer(probabilities)


def test_one_option_questions_get_transformers_answers_without_the_model(predictor):
    """A one-option choice / one-level score answers as transformers does (p = 1 is softmax of any single
    logit); the model scores only the others, and only their tokens are counted."""
    mixed = {"state": STATE, "questions": {"only": ONE_OPTION["only"], "angry": QUESTIONS["angry"],
                                           "level": ONE_OPTION["level"], "dept": QUESTIONS["dept"]}}
    got = predictor.predict(mixed)
    assert list(got["answers"]) == ["only", "angry", "level", "dept"]
    for qid in ONE_OPTION:
        assert got["answers"][qid] == _transformers_answer(qid, ONE_OPTION[qid], [1.0])
    assert got["answers"]["only"]["probabilities"] == {"shipping": 1.0} and got["answers"]["level"]["score"] == 0.0
    without = predictor.predict({"state": STATE, "questions": {"angry": QUESTIONS["angry"], "dept": QUESTIONS["dept"]}})
    assert {q: got["answers"][q] for q in ("angry", "dept")} == without["answers"]
    assert got["usage"] == without["usage"]  # the one-option rows are not run, so not counted
    alone = predictor.predict({"state": STATE, "questions": ONE_OPTION})
    assert alone["usage"] == {"input_tokens": 0, "output_tokens": 0, "images": 0}
    assert alone["answers"] == {q: _transformers_answer(q, v, [1.0]) for q, v in ONE_OPTION.items()}


def test_records_still_need_two_candidates():
    from rlcd.schema import RecordError, parse_record

    row = {"id": "r", "source": "s", "task": "t", "state": "x", "target": [1.0],
           "question": {"type": "choice", "criteria": ["only"]}}
    with pytest.raises(RecordError, match=r"choice needs 2\.\.255 labels, got 1"):
        parse_record(row)
    with pytest.raises(RecordError, match=r"2\.\.255 level"):
        parse_record({**row, "question": {"type": "score", "criteria": ["only"]}})


def test_predict_command_answers_one_option_questions(run_dir, predictor):
    from typer.testing import CliRunner

    from rlcd.cli import app

    res = CliRunner().invoke(app, ["predict", "--run", str(run_dir), "--state", STATE,
                                   "-q", "only=" + json.dumps(ONE_OPTION["only"]),
                                   "-q", "angry=" + json.dumps(QUESTIONS["angry"])])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["answers"]["only"] == _transformers_answer("only", ONE_OPTION["only"], [1.0])
    assert out == predictor.predict({"state": STATE, "questions": {"only": ONE_OPTION["only"],
                                                                   "angry": QUESTIONS["angry"]}})


def test_predict_command_loads_no_model_when_every_question_has_one_option(run_dir, predictor, monkeypatch):
    """`rlcd predict` on a request of only one-option questions answers from the export's metadata alone; a
    request that needs the model loads it (a lazy Predictor)."""
    from typer.testing import CliRunner

    import rlcd.export
    from rlcd.cli import app

    loads = []
    real = rlcd.export.load_export
    monkeypatch.setattr(rlcd.export, "load_export", lambda *a, **k: loads.append(a) or real(*a, **k))
    args = ["predict", str(run_dir), "--device", "cpu", "--state", STATE]
    res = CliRunner().invoke(app, args + [x for qid, q in ONE_OPTION.items() for x in ("-q", f"{qid}={json.dumps(q)}")])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == predictor.predict({"state": STATE, "questions": ONE_OPTION})
    assert loads == []
    res = CliRunner().invoke(app, args + ["-q", "angry=" + json.dumps(QUESTIONS["angry"])])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == predictor.predict({"state": STATE, "questions": {"angry": QUESTIONS["angry"]}})
    assert len(loads) == 1


def test_predict_names_the_bad_q_value_says_empty_and_refuses_two_requests(tmp_path):
    """Issue 58: `-q 'late=notjson'` said "the request (None) is not valid JSON"; empty stdin said "not valid JSON"
    where the server says "is empty"; --state with a request piped in silently dropped the piped one. Checked before
    the model loads (the export's model.json would fail loudly)."""
    from typer.testing import CliRunner

    from conftest import user_error
    from rlcd.cli import app

    export = tmp_path / "export"
    export.mkdir()
    (export / "model.json").write_text("{}")
    res = user_error(["predict", export, "--state", "x", "-q", "late=notjson"], max_lines=1,
                     contains="-q 'late=notjson': not valid JSON (Expecting value at column 1)")
    assert "None" not in res.stderr
    user_error(["predict", export, "--state", "x", "-q", '{"id": "a", "type": '], max_lines=1,
               contains="""-q '{"id": "a", "type": ': not valid JSON""")
    for text in ("", "  \n"):
        res = CliRunner().invoke(app, ["predict", str(export)], input=text)
        assert res.exit_code == 2 and res.stderr.strip() == (
            "rlcd: error: the request (stdin) is empty; send a JSON object"), res.stderr
    empty = tmp_path / "empty.json"
    empty.write_text("")
    user_error(["predict", export, empty], contains=f"the request ({empty}) is empty", max_lines=1)
    q = json.dumps({"type": "noul", "instructions": "Late?"})
    piped = json.dumps({"state": "s", "questions": {"a": {"type": "noul", "instructions": "x"}}})
    res = CliRunner().invoke(app, ["predict", str(export), "--state", "x", "-q", f"late={q}"], input=piped)
    assert res.exit_code == 2 and res.stderr.startswith("rlcd: error: a request on stdin and --state/-q"), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_pending_stdin_reads_what_is_there_and_never_waits():
    """The check behind refusing --state with a piped request: a pipe nobody wrote to is not waited for."""
    import io

    from rlcd.serving.cli_request import pending_stdin

    r, w = os.pipe()
    with os.fdopen(r) as reader, os.fdopen(w, "w") as writer:
        assert pending_stdin(reader) is None  # open, empty: no blocking read
        writer.write('{"state": "s"}')
        writer.close()
        assert pending_stdin(reader) == '{"state": "s"}'
    with open(os.devnull) as null:
        assert pending_stdin(null) == ""
    assert pending_stdin(io.StringIO("abc")) == "abc"


def test_flags_beside_a_really_piped_request_are_refused_and_an_empty_pipe_is_not(tmp_path):
    """`echo REQ | rlcd predict RUN --state x -q ...` in a real process (stdin a pipe): refused in one line; an empty
    pipe (`</dev/null`-like) is no request, so the flags' request goes on (to the export, whose model.json fails)."""
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.json").write_text("{}")
    q = json.dumps({"type": "noul", "instructions": "Late?"})
    piped = json.dumps({"state": "s", "questions": {"a": {"type": "noul", "instructions": "x"}}})
    out = _rlcd("predict", str(export), "--state", "x", "-q", f"late={q}", stdin=piped)
    assert out.returncode == 2 and out.stderr.startswith("rlcd: error: a request on stdin and --state/-q")
    assert len(out.stderr.splitlines()) == 1
    out = _rlcd("predict", str(export), "--state", "x", "-q", f"late={q}", stdin="")
    assert out.returncode == 2 and "a request on stdin" not in out.stderr and "unsupported export format" in out.stderr
