"""The whole chain on a text decoder (`tiny-llama`): train, resume, evaluate, export, predict, serve, probes."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
import torch
from conftest import synth_processed

from rlcd import checkpoint as ckpt
from rlcd.recipe import Recipe
from rlcd.train import train

torch.set_num_threads(1)

MODEL = "tiny-llama"
RECIPE = Recipe(steps=3, grad_accum=1, eval_every=1, checkpoint_every=1, log_every=1, diagnostics_every=1,
                lr_head=5e-3)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return synth_processed(tmp_path_factory.mktemp("chain-data"), 40, seed=11)


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir) -> Path:
    """Three updates, killed after two and resumed (the resume must reproduce an uninterrupted run)."""
    run = tmp_path_factory.mktemp("chain") / "run"
    train(run, data_dir=data_dir, model=MODEL, recipe=RECIPE, progress=False, stop_after=2)
    assert ckpt.load(run / "checkpoints" / "last")["state"]["step"] == 2
    train(run, resume=True, progress=False)
    return run


@pytest.fixture(scope="module")
def evaluated(run):
    from rlcd.evaluate import evaluate_run

    return evaluate_run(run)


@pytest.fixture(scope="module")
def predictor(run, evaluated):
    from rlcd.predict import Predictor

    return Predictor.from_run(run, canonical=False)  # as asked: the stored predictions score rows as trained


def test_resume_on_a_text_decoder_matches_an_uninterrupted_run(run, data_dir, tmp_path):
    full = tmp_path / "full"
    train(full, data_dir=data_dir, model=MODEL, recipe=RECIPE, progress=False)
    a = ckpt.load(full / "checkpoints" / "last")["weights"]
    b = ckpt.load(run / "checkpoints" / "last")["weights"]
    assert a.keys() == b.keys() and any(k.startswith("lora.") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    config = json.loads((run / "config.json").read_text())
    assert config["model"] == MODEL


def test_evaluate_writes_the_artefacts_and_an_export_of_the_family(run, evaluated):
    ev = json.loads((run / "eval" / "evaluation.json").read_text())
    assert {"accuracy", "nll", "brier", "ece", "ece_target"} <= set(ev["calibrated"]["overall"])
    meta = json.loads((run / "export" / "model.json").read_text())
    bb = meta["backbone"]
    assert meta["model"] == MODEL and bb["family"] == "causal-lm" and bb["marker_token"] == "<repo_name>"
    assert bb["chat_template"] == "chat" and bb["vocab"] == "smollm2"
    lora = bb["lora"]
    assert lora["merged"] is True and "self_attn" in lora["target_modules"] and "lm_head" not in lora["target_modules"]


def test_export_refuses_a_text_decoder_of_another_seed(run, evaluated, tmp_path):
    import shutil

    from rlcd.export import load_export

    copy = tmp_path / "export"
    shutil.copytree(run / "export", copy)
    meta = json.loads((copy / "model.json").read_text())
    meta["model_seed"] += 1
    (copy / "model.json").write_text(json.dumps(meta))
    with pytest.raises(RuntimeError, match="fingerprint"):
        load_export(copy)


def test_predict_answers_and_matches_the_stored_test_predictions(run, evaluated, predictor, data_dir):
    from rlcd.data.io import load_split
    from rlcd.predict import probabilities

    rec = load_split(data_dir, "test")[0]
    req = {"state": rec.state, "questions": {"q": rec.question.model_dump(exclude_none=True)}}
    out = predictor.predict(req)
    ans = out["answers"]["q"]
    assert ans["type"] == rec.question.type and out["usage"]["input_tokens"] > 0
    stored = {json.loads(x)["id"]: json.loads(x) for x in (run / "eval" / "predictions-test.jsonl").read_text().splitlines()}
    p = probabilities(stored[rec.id]["logits"], predictor.temperatures[rec.question.type])
    if rec.question.type == "noul":
        assert ans["noul"] == pytest.approx(float(p[1]), abs=1e-4)
    else:
        assert list(ans["probabilities"].values()) == pytest.approx(p.tolist(), abs=1e-4)


def test_an_image_sent_to_a_text_backbone_is_refused_naming_the_field(predictor, run, data_dir):
    from PIL import Image

    from rlcd.data.io import load_split
    from rlcd.schema import RecordError
    from rlcd.serving.errors import PredictError

    img = Image.new("RGB", (64, 64), (10, 200, 10))
    req = {"state": "a parcel", "questions": {"q": {"type": "noul", "instructions": "Is it late?"}}}
    with pytest.raises(PredictError) as ei:
        predictor.predict(req, image=img)
    assert ei.value.field == "image" and "text-only" in ei.value.rule
    # a training/evaluation row with an image: the collator names the row
    rec = load_split(data_dir, "test")[0].model_copy(update={"image": "x.png"})
    with pytest.raises(RecordError) as ei:
        predictor.model.collator()([rec])
    assert ei.value.row == rec.id and ei.value.field == "image" and "text-only" in str(ei.value)


def test_the_tokenizers_special_tokens_are_refused_in_requests(predictor):
    from rlcd.serving.errors import PredictError

    for state, token in (("hello <|im_start|>system", "<|im_start|>"), ({"note": "see <repo_name>"}, "<repo_name>")):
        with pytest.raises(PredictError) as ei:
            predictor.predict({"state": state, "questions": {"q": {"type": "noul", "instructions": "x"}}})
        assert ei.value.field == "state" and token in ei.value.rule


def test_serve_answers_and_refuses_an_image(predictor):
    from fastapi.testclient import TestClient
    from PIL import Image

    from rlcd.server import create_app

    client = TestClient(create_app(predictor))
    body = {"state": "The parcel is two weeks late.", "questions": {"late": {"type": "noul", "instructions": "Late?"}}}
    r = client.post("/v1/systemone", json=body)
    assert r.status_code == 200, r.text
    assert set(r.json()["answers"]) == {"late"}
    buf = io.BytesIO()
    Image.new("RGB", (32, 32)).save(buf, format="PNG")
    r = client.post("/v1/systemone", json={**body, "image": {"base64": base64.b64encode(buf.getvalue()).decode()}})
    assert r.status_code == 422, r.text
    (err,) = r.json()["detail"]
    assert err["loc"][-1] == "image" and "text-only" in err["msg"]


def test_order_probe_runs_on_the_text_decoder(run, evaluated):
    from rlcd.analysis.probes import probe_order_run

    out = probe_order_run(run, split="dev", limit=3, max_perms=2)
    assert out["placement"] == {"device": "cpu", "dtype": "float32"}
    assert out["per_type"]["choice"]["n_rows"] == 3 and out["n_records"] >= 3
