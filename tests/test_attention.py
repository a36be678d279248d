"""--attention (issue 73): the decoder's attention kernel at inference. With eager attention, padding (the batch job's
packs, the batching server's batches: states left-padded to their width) adds exact zeros; sdpa's blocking follows
the padded length. On these requests (3 questions a line, 4 states of different lengths in one call) packed and
lone answers were 2.8e-6 apart under sdpa and 7.3e-7 under eager (tiny-llama, one thread), so the bound below fails
when the kernel is not applied."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from conftest import user_error  # noqa: E402
from test_batch import max_diff  # noqa: E402
from test_packing import LONG, MIDDLE, SHORT, requests_about, rows_of  # noqa: E402

from rlcd.device import DeviceError, Placement, resolve_placement  # noqa: E402


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory) -> Path:
    from _tiny_export import make_tiny_export

    return make_tiny_export(tmp_path_factory.mktemp("attention") / "run", model_spec="tiny-llama")


def test_a_kernel_not_offered_is_refused_naming_the_choices():
    with pytest.raises(DeviceError, match=r"--attention 'flash' is not one of sdpa, eager"):
        resolve_placement("cpu", "float32", attention="flash")
    assert resolve_placement("cpu", "float32", attention=" Eager ").attention == "eager"


def test_the_placement_says_its_kernel_only_when_it_is_not_the_default():
    assert "attention" not in Placement("cpu", "float32").to_dict()  # earlier records stay as they were
    eager = Placement("cpu", "float32", attention="eager")
    assert eager.to_dict()["attention"] == "eager" and "eager attention" in str(eager)
    assert eager != Placement("cpu", "float32")


def test_eager_packed_answers_equal_lone_ones_below_1e_6(llama_run):
    """The batch job packs four states of different lengths (left-padded) with batch_size 4; each line sent alone.
    The loaded decoder must run the kernel asked for."""
    from rlcd.batch.local import score_rows
    from rlcd.predict import Predictor

    p = Predictor.from_run(llama_run, placement=resolve_placement("cpu", "float32", attention="eager"))
    assert p.runner.model.backbone.config._attn_implementation == "eager"
    requests = requests_about([SHORT, MIDDLE, LONG, "Invoice 1193 was paid twice."], per_state=3)
    out = score_rows(p, rows_of(requests), batch_size=4)
    worst = 0.0
    for o, req in zip(out, requests):
        p.clear_state_cache()
        worst = max(worst, max_diff(o.response, p.predict({k: v for k, v in req.items() if k != "id"})))
    assert worst < 1e-6, worst


def test_the_default_kernel_is_sdpa(llama_run):
    from rlcd.predict import Predictor

    p = Predictor.from_run(llama_run, placement=resolve_placement("cpu", "float32"))
    assert p.runner.model.backbone.config._attn_implementation == "sdpa"


def test_cli_mistakes_are_one_line(llama_run, tmp_path):
    q = json.dumps({"id": "angry", "type": "noul", "instructions": "Is the customer angry?"})
    user_error(["predict", llama_run, "--state", "Late parcel.", "-q", q, "--attention", "flash"],
               contains="--attention 'flash' is not one of sdpa, eager")
    user_error(["predict", "--export", tmp_path, "--state", "Late parcel.", "-q", q, "--attention", "eager"],
               contains="portable export")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "state": "Late parcel.", "questions": {"angry": json.loads(q)}}) + "\n")
    out = tmp_path / "out.jsonl"
    user_error(["predict", llama_run, "--input", src, "--output", out, "--attention", "flash"],
               contains="--attention 'flash'")
    from rlcd.batch.io import parts_dir

    assert not out.exists() and not parts_dir(out).exists()  # nothing written before the check


def test_a_resumed_job_keeps_its_kernel(llama_run, tmp_path):
    """Answers differ by float noise between kernels: a job started with eager is resumed with eager or refused."""
    from rlcd.batch.io import input_identity
    from rlcd.batch.local import PredictorSpec

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "state": "Late parcel.",
                               "questions": {"angry": {"type": "noul", "instructions": "Angry?"}}}) + "\n")
    spec = PredictorSpec(run=str(llama_run), device="cpu", dtype="float32", attention="eager")
    assert spec.identity()["attention"] == "eager"
    assert "attention" not in PredictorSpec(run=str(llama_run), device="cpu", dtype="float32").identity()
    from rlcd.batch.io import parts_dir

    out = tmp_path / "out.jsonl"
    parts = parts_dir(out)
    parts.mkdir()
    (parts / "job.json").write_text(json.dumps({"input": input_identity(src), **spec.identity()}))
    user_error(["predict", llama_run, "--input", src, "--output", out, "--resume", "--device", "cpu", "--dtype",
                "float32"], contains="attention")
