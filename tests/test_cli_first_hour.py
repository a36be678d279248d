"""What a new user meets in the first hour (issue 25, "The command line"): one-line errors instead of
tracebacks or minute-long waits, results alone on stdout (one JSON object under torchrun too), no
library noise on a CPU or in a pipe, and a progress line that shows the score the run ends with."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import synth_processed, torchrun
from typer.testing import CliRunner

from rlcd.cli import app

runner = CliRunner()
HERE = Path(__file__).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return synth_processed(tmp_path_factory.mktemp("data"), 60, seed=3)


def _invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_train_data_naming_a_records_file_suggests_prepare_into_a_new_directory(tmp_path):
    records = tmp_path / "tickets.jsonl"
    records.write_text("{}\n")
    res = _invoke("train", tmp_path / "runs" / "a", "--data", records, "--model", "tiny-toy")
    assert res.exit_code == 2, res.output
    assert res.stderr.strip() == (f"rlcd: error: --data {records} is a file; --data takes a processed data "
                                  f"directory: make one with `rlcd data prepare {records} --out "
                                  f"{tmp_path / 'tickets-processed'}` and pass that")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "tickets-processed").exists()


def test_serve_on_a_port_in_use_is_one_line_before_the_model_loads(tmp_path):
    # export/model.json is no model at all: loading it would fail otherwise, so the port check comes first
    (tmp_path / "run" / "export").mkdir(parents=True)
    (tmp_path / "run" / "export" / "model.json").write_text("{}")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = _invoke("serve", tmp_path / "run", "--port", port)
    assert res.exit_code == 2, res.output
    assert res.stderr.strip() == (f"rlcd: error: port {port} on 127.0.0.1 is already in use (another server?); "
                                  "stop it or choose another --port")


def test_serve_port_check_lets_a_free_port_through():
    from rlcd.cli.serve import check_port
    from rlcd.errors import UserError

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    check_port("127.0.0.1", port)  # free: no error
    with pytest.raises(UserError, match="cannot serve on --host no-such-host.invalid"):
        check_port("no-such-host.invalid", port)


def test_train_help_shows_the_tracking_extra():
    res = _invoke("train", "--help")
    assert res.exit_code == 0
    assert "rlcd[tracking]" in re.sub(r"[\s│]+", "", res.stdout)  # the help box wraps lines


def test_a_hub_model_neither_cached_nor_reachable_fails_at_once(tmp_path, monkeypatch):
    """No local copy and no network: one BackboneError within seconds naming --model and the offline presets,
    without handing the hub id to transformers (whose retries take ~50 s)."""
    from rlcd.errors import BackboneError
    from rlcd.model import backbone
    from rlcd.model.families import family_named

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the suite runs offline; here the probe decides
    calls = []
    family = family_named("qwen3.5")
    monkeypatch.setattr(type(family), "from_pretrained", lambda *a, **k: calls.append(a) or 1 / 0)
    monkeypatch.setattr(backbone, "hub_reachable", lambda *a, **k: False)
    t0 = time.perf_counter()
    with pytest.raises(BackboneError) as err:
        backbone.load_backbone("qwen3.5-0.8b", cache_dir=str(tmp_path))
    assert time.perf_counter() - t0 < 5 and not calls
    message = str(err.value)
    assert "'qwen3.5-0.8b' (Qwen/Qwen3.5-0.8B@2fc06364715b)" in message and "not in the local hub cache" in message
    assert "cannot be reached" in message and "--model /path/to/local/copy" in message
    assert "smollm2-135m" in message and "\n" not in message


def test_hub_offline_setting_needs_no_probe(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from rlcd.errors import BackboneError
    from rlcd.model import backbone

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(backbone, "hub_reachable", lambda *a, **k: pytest.fail("probed the network"))
    with pytest.raises(BackboneError, match="HF_HUB_OFFLINE is set"):
        backbone.load_backbone("Qwen/Qwen3.5-0.8B@abc", cache_dir=str(tmp_path))


QUIET = """
import sys, tempfile
from rlcd.cli._common import quiet_progress_bars
quiet_progress_bars()  # what `rlcd ...` does first
import torch
from rlcd.model.backbone import load_backbone, save_backbone
bb = load_backbone("tiny-toy")
save_backbone(bb, tempfile.mkdtemp())  # transformers' "Writing model shards" bar
with torch.no_grad():
    bb.model(input_ids=torch.tensor([[1, 2, 3]]))  # the CUDA-kernel hints of the linear-attention layers
print("done")
"""


def test_cpu_kernel_hints_are_filtered_and_other_transformers_warnings_kept():
    import logging

    from rlcd.model.backbone import quiet_cpu_kernel_hints

    quiet_cpu_kernel_hints("cpu")
    quiet_cpu_kernel_hints("cpu")
    hub_kernels = logging.getLogger("transformers.integrations.hub_kernels")
    assert len(hub_kernels.filters) == 1

    def record(msg):
        return logging.LogRecord(hub_kernels.name, logging.WARNING, __file__, 1, msg, None, None)

    assert not hub_kernels.filter(record("`causal_conv1d_fn` is falling back to its reference PyTorch "
                                         "implementation because `causal_conv1d` is not installed."))
    assert hub_kernels.filter(record("kernel repo refused: not trusted"))


@pytest.mark.slow
def test_cpu_backbones_and_pipes_get_no_library_noise():
    res = subprocess.run([sys.executable, "-c", QUIET], capture_output=True, text=True, timeout=300, env=ENV)
    assert res.returncode == 0 and res.stdout == "done\n", res.stderr[-2000:]
    assert "Writing model shards" not in res.stderr and "falling back to its reference" not in res.stderr
    assert "causal_conv1d" not in res.stderr and "flash-linear-attention" not in res.stderr


def test_the_last_progress_line_shows_the_final_dev_score(tmp_path, data_dir, capsys):
    from rlcd.recipe import Recipe
    from rlcd.train import train

    # a large head LR so the dev score moves between evaluations (else a stale score would look right)
    recipe = Recipe(steps=2, batch_size=4, grad_accum=1, lr_head=0.05, lr_lora=0.01, eval_every=1,
                    checkpoint_every=2, log_every=1, diagnostics_every=2)
    state = train(tmp_path / "run", data_dir=data_dir, model="tiny-toy", recipe=recipe)
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    assert [e["step"] for e in evals] == [0, 1, 2]
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("train: ")]
    shown = [float(re.search(r"dev (\S+)$", x).group(1)) for x in lines if "updates" in x]
    scores = [e["dev_macro_accuracy"] for e in evals]
    assert scores[0] != scores[1] or scores[1] != scores[2], "the test needs evaluations that change the score"
    assert shown == pytest.approx(scores[1:], abs=5e-5)  # update N's line shows the evaluation at update N
    assert state["step"] == 2


@pytest.mark.slow
def test_torchrun_two_processes_print_one_json_object(tmp_path, data_dir):
    """The README's DDP line (RUN positional) under 2 gloo ranks: stdout holds exactly rank 0's JSON result."""
    res = torchrun("-m", "rlcd.cli", "train", tmp_path / "runs" / "ddp", "--data", data_dir, "--model", "tiny-toy",
                   "--steps", "2", cwd=tmp_path, env=ENV)
    obj, end = json.JSONDecoder().raw_decode(res.stdout.lstrip())
    assert res.stdout.lstrip()[end:].strip() == "", res.stdout  # nothing after the one object
    assert set(obj) == {"step", "best_step", "best_score"} and obj["step"] == 2
    config = json.loads((tmp_path / "runs" / "ddp" / "config.json").read_text())
    assert config["world_size"] == 2
    assert res.stderr.count("backbone: building preset tiny-toy") == 1, res.stderr  # rank 0 tells, once
    assert res.stderr.count("train: ") >= 1 and "2 process(es)" in res.stderr
