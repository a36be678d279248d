"""The row cache (`rlcd.serving.state_encoding`): a question already answered about the same state and image runs no
backbone forward again, and gets the answer it got, which is the cache-off answer.

It is off by default (its answers equal fresh ones up to float noise, not bit for bit); `ROWS` MiB turn it on here.
The backbone forwards are counted by wrapping `DecisionModel.decoder_forward` (every prefix, suffix and full-row call goes
through it). The reference is a Predictor with the row cache off (the default; the state cache on): what the row
cache must not change, usage included. Tolerance 1e-4 in probability, as for the state cache and batching.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from _tiny_export import TEMPERATURES, build_tiny_model, tiny_export, tiny_predictor  # noqa: E402
from conftest import answer_gap  # noqa: E402

from rlcd.predict import Predictor  # noqa: E402

TOL = 1e-4
LONG = ("Order 5521: the parcel arrived two weeks late, the box was crushed, two of the three plates inside "
        "were broken and the courier left it in the rain. The customer wrote twice and called once; nobody "
        "answered. She wants a refund for the plates and the shipping, and says she will not order again.")
DEPT = {"type": "choice", "instructions": "Which department handles this?",
        "criteria": {"billing": "money", "shipping": "parcels", "returns": "goods sent back"}}
DEPT_PERMUTED = {"type": "choice", "instructions": "Which department handles this?",
                 "criteria": {"returns": "goods sent back", "shipping": "parcels", "billing": "money"}}
ANGRY = {"type": "noul", "instructions": "Is the customer angry?"}
URGENCY = {"type": "score", "instructions": "How urgent is it?", "criteria": ["not urgent", "urgent", "critical"]}
LATE = {"type": "noul", "instructions": "Was the parcel late?"}
META = {"model": "tiny-llama", "temperatures": dict(TEMPERATURES)}
ROWS = 16  # MiB


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(model_spec="tiny-llama")


@contextlib.contextmanager
def forwards(model):
    """[(batch, tokens)] of every backbone call made inside the block."""
    calls: list[tuple[int, int]] = []
    lm = model.decoder_forward

    def counted(ids, *a, **k):
        calls.append(tuple(ids.shape))
        return lm(ids, *a, **k)

    model.decoder_forward = counted
    try:
        yield calls
    finally:
        del model.decoder_forward  # the class's method again



def _req(state=LONG, **questions):
    return {"state": state, "questions": questions}


def test_a_request_asked_again_runs_no_forward_and_gets_its_answer(model):
    warm, cold = Predictor(model, META, row_cache_mb=ROWS), Predictor(model, META)
    req = _req(dept=DEPT, angry=ANGRY, urgency=URGENCY)
    with forwards(model) as calls:
        first = warm.predict(req)
    assert calls and warm.row_cache_stats()["entries"] == 3 and warm.row_cache_stats()["misses"] == 3
    with forwards(model) as calls:
        again = warm.predict(req)
    assert calls == []  # nothing ran: every row came from the row cache
    assert again == first  # the same answers, bit for bit, and the same usage
    assert warm.row_cache_stats()["hits"] == 3
    want = cold.predict(req)
    assert answer_gap(again, want) < TOL and again["usage"] == want["usage"]


def test_only_the_new_question_runs(model):
    """A request with one question not asked before about its state runs that row alone (JevBench's tests: a
    case's batch again with a question rewritten); the others take their stored features."""
    warm, cold = Predictor(model, META, row_cache_mb=ROWS), Predictor(model, META)
    warm.predict(_req(dept=DEPT, angry=ANGRY))
    req = _req(renamed_dept=DEPT, angry=ANGRY, late=LATE)  # another key: the same rendered row
    late_row = warm.prepare(_req(late=LATE)).case.rows[0]
    with forwards(model) as calls:
        got = warm.predict(req)
    assert warm.row_cache_stats()["hits"] == 2
    # one suffix call of one row (the state's prefix came from the state cache), no longer than its row
    assert len(calls) == 1 and calls[0][0] == 1 and calls[0][1] <= len(late_row) - late_row.prefix_len
    want = cold.predict(req)
    assert answer_gap(got, want) < TOL and got["usage"] == want["usage"]


def test_a_permuted_choice_is_the_same_row_in_canonical_form_only(model):
    canonical, as_asked = (Predictor(model, META, row_cache_mb=ROWS),
                          Predictor(model, META, canonical=False, row_cache_mb=ROWS))
    for p in (canonical, as_asked):
        p.predict(_req(dept=DEPT))
    with forwards(model) as on:
        got = canonical.predict(_req(dept=DEPT_PERMUTED))
    with forwards(model) as off:
        as_asked.predict(_req(dept=DEPT_PERMUTED))
    assert on == [] and off != []
    assert answer_gap(got, Predictor(model, META).predict(_req(dept=DEPT_PERMUTED))) < TOL


def test_a_batch_of_an_answered_and_a_new_request(model):
    warm, cold = Predictor(model, META, row_cache_mb=ROWS), Predictor(model, META)
    warm.predict(_req(dept=DEPT))
    reqs = [_req(dept=DEPT), _req(LONG + " She paid by card.", angry=ANGRY, urgency=URGENCY), _req(late=LATE)]
    prepared = [warm.prepare(r) for r in reqs]
    with forwards(model) as calls:
        results = warm.score_many(prepared)
    assert calls and sum(b for b, _ in calls) >= 3  # the new rows ran
    for req, prep, (logits, usage) in zip(reqs, prepared, results):
        got = warm.respond(prep, logits, usage)
        assert answer_gap(got, cold.predict(req)) < TOL and got["usage"] == cold.predict(req)["usage"]
    assert results[0][1]["cached_rows"] == 1 and results[1][1]["cached_rows"] == 0


def test_changed_weights_never_hit(model):
    warm = Predictor(model, META, row_cache_mb=ROWS)
    req = _req(angry=ANGRY)
    warm.predict(req)
    p = next(model.parameters())
    with torch.no_grad():
        p.add_(0.0)  # the same values, a new in-place version: another scope
    with forwards(model) as calls:
        warm.predict(req)
    assert calls and warm.row_cache_stats()["hits"] == 0


def test_another_image_never_hits(tmp_path_factory):
    from PIL import Image

    base = tiny_predictor(tmp_path_factory.getbasetemp())
    warm = Predictor(base.model, base.meta, name=base.name, row_cache_mb=ROWS)
    root = tmp_path_factory.mktemp("row-img")
    paths = []
    for k in range(2):  # the same size, other pixels: the same tokens
        im = Image.new("RGB", (40, 28), ((60 * k) % 256, 90, 30))
        paths.append(root / f"im{k}.png")
        im.save(paths[-1])
    req = _req(angry=ANGRY)
    warm.predict(req, paths[0])
    with forwards(base.model) as calls:
        warm.predict(req, paths[1])
    assert calls and warm.row_cache_stats()["hits"] == 0
    with forwards(base.model) as calls:
        got = warm.predict(req, paths[0])
    assert calls == [] and warm.row_cache_stats()["hits"] == 1
    assert answer_gap(got, Predictor(base.model, base.meta, name=base.name).predict(req, paths[0])) < TOL


def test_bounds_and_switches(model):
    assert Predictor(model, META, row_cache_mb=1).row_cache_stats()["max_bytes"] == 1 << 20
    assert Predictor(model, META, row_cache_mb=1).info()["row_cache_mb"] == 1.0
    off = Predictor(model, META)  # the default
    assert off.info()["row_cache_mb"] == 0 and off.encoder.cache_kw(off.runner).keys() == {"state_cache"}
    req = _req(angry=ANGRY)
    off.predict(req)
    with forwards(model) as calls:
        off.predict(req)
    assert calls and off.row_cache_stats()["entries"] == 0 and off.row_cache_stats()["max_bytes"] == 0
    rows_only = Predictor(model, META, state_cache_mb=0, row_cache_mb=ROWS)  # each cache on its own switch
    assert rows_only.encoder.cache_kw(rows_only.runner).keys() == {"row_cache"}
    want = rows_only.predict(req)
    with forwards(model) as calls:
        assert rows_only.predict(req) == want
    assert calls == [] and rows_only.state_cache_stats()["entries"] == 0
    for bad in (-1, float("nan"), "8"):
        with pytest.raises(ValueError, match="row_cache_mb must be a number >= 0 \\(0 turns the row cache off\\)"):
            Predictor(model, META, row_cache_mb=bad)
    probe = Predictor(model, META, row_cache_mb=ROWS)
    probe.predict(_req(angry=ANGRY))
    one = probe.row_cache_stats()["bytes"]
    hidden = model.family.text_decoder(model.causal_lm()).config.hidden_size
    assert one == 3 * hidden * 4  # a noul row: the decision's and two markers' hidden states, float32
    small = Predictor(model, META, row_cache_mb=2.5 * one / (1 << 20))
    for q in (ANGRY, LATE, {"type": "noul", "instructions": "Was the box crushed?"}):
        small.predict(_req(q=q))
        assert small.row_cache_stats()["bytes"] <= small.row_cache_stats()["max_bytes"]
    assert small.row_cache_stats()["entries"] == 2 and small.row_cache_stats()["evictions"] == 1


# --------------------------------------------------------------------------------------- serve
@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_bad_row_cache_size_is_one_line_and_exit_2(tmp_path, value):
    from typer.testing import CliRunner

    from rlcd.cli import app

    res = CliRunner().invoke(app, ["serve", str(tmp_path), "--row-cache-mb", value])
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith(f"rlcd: error: --row-cache-mb {value}: give a size in MiB >= 0 (0 turns the row "
                                 "cache off)") and len(res.stderr.splitlines()) == 1


def test_serve_takes_the_row_cache_size_and_a_portable_export_refuses_it(tmp_path_factory, monkeypatch):
    import socket

    from conftest import user_error
    from typer.testing import CliRunner

    import rlcd.server
    from rlcd.cli import app

    run = tiny_export(tmp_path_factory.getbasetemp())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    seen = {}
    monkeypatch.setattr(rlcd.server, "serve", lambda path, **kw: seen.update(kw))
    for flags, mb in (([], 0.0), (["--row-cache-mb", "12.5"], 12.5)):
        res = CliRunner().invoke(app, ["serve", str(run), "--port", port, "--device", "cpu", *flags])
        assert res.exit_code == 0, res.output
        assert seen["row_cache_mb"] == mb
    monkeypatch.undo()
    assert rlcd.server.load_predictor(run, row_cache_mb=3).row_cache_stats()["max_bytes"] == 3 << 20
    assert rlcd.server.load_predictor(run).row_cache_stats()["max_bytes"] == 0
    user_error(["serve", "--export", tmp_path_factory.mktemp("none"), "--row-cache-mb", "8"],
               contains="--row-cache-mb 8: a portable export keeps no row features", max_lines=1)
