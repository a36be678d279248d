"""bfloat16 on the CPU: the capability detection (mocked for both kinds of CPU), what `--dtype auto` picks, the
parity gate (`rlcd export RUN --precision bfloat16`), bf16 against fp32 on a tiny model, and bf16 training."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import synth_processed, user_error
from rlcd.run import Run

# /proc/cpuinfo lines of the two kinds of CPU (trimmed): AMD EPYC (Zen 4) and Intel Sapphire Rapids have bf16
# units, a Haswell-class server only AVX2; arm64 names FEAT_BF16 "bf16" in Features
EPYC = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
SPR = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8 avx512_vnni\n"
AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd crc32\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny-llama export with a test split (as the ONNX gate's tests build it)."""
    from _tiny_export import make_tiny_export_with_test_split

    return make_tiny_export_with_test_split(tmp_path_factory.mktemp("precision"))


@pytest.mark.parametrize("text,has,flag", [(EPYC, True, "avx512_bf16"), (SPR, True, "amx_bf16"), (AVX2, False, None),
                                           (ARM_BF16, True, "bf16"), (ARM, False, None)])
def test_detection_reads_the_cpu_flags(text, has, flag):
    from rlcd.device import cpu_bf16_units

    found, why = cpu_bf16_units(text)
    assert found is has
    assert (flag in why) if has else ("no bf16 units" in why)


def test_detection_without_cpu_flags_asks_torch(monkeypatch):
    from rlcd import device

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert device.cpu_bf16_units("") == (True, "the CPU has bf16 units (avx512_bf16, torch's probe)")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert device.cpu_bf16_units("")[0] is False
    monkeypatch.setattr(device, "CPUINFO", Path("/nonexistent/cpuinfo"))  # not Linux: the probe again
    assert device.cpu_bf16_units()[0] is False


def _cpu(monkeypatch, text: str) -> None:
    """This machine as the CPU `text` describes (no GPU)."""
    from rlcd import device

    monkeypatch.setattr(device, "_cuda_count", lambda: 0)
    monkeypatch.setattr(device, "cpu_bf16_units", lambda cpuinfo=None: device.__dict__["_real_units"](text))


@pytest.fixture(autouse=True)
def _keep_real_detection(monkeypatch):
    from rlcd import device

    monkeypatch.setitem(device.__dict__, "_real_units", device.cpu_bf16_units)
    monkeypatch.setattr(device, "_said", set())


def _pass_gate(run, monkeypatch, bound: float = 0.5):
    from rlcd.precision import check_precision

    return check_precision(run, max_flips=bound, max_dp=1.0)


def test_auto_on_an_avx2_cpu_stays_float32_and_says_so_once(run, monkeypatch, caplog):
    from rlcd.device import resolve_placement

    _cpu(monkeypatch, AVX2)
    with caplog.at_level(logging.INFO, logger="rlcd.device"):
        first = resolve_placement("auto", "auto", run=run)
        again = resolve_placement("cpu", "auto", run=run)
    assert first.dtype == again.dtype == "float32"
    assert first.reason.startswith("auto: float32, the CPU has no bf16 units")
    said = [r.getMessage() for r in caplog.records if "bf16 units" in r.getMessage()]
    assert len(said) == 1 and "--dtype bfloat16 forces it" in said[0]
    forced = resolve_placement("cpu", "bfloat16", run=run)  # asked for: given, whatever the CPU
    assert (forced.dtype, forced.reason) == ("bfloat16", "")
    assert resolve_placement("cpu", "float32", run=run).reason == ""


def test_auto_picks_bf16_only_with_the_units_and_a_passed_record(run, monkeypatch):
    from rlcd.device import Placement, resolve_placement
    from rlcd.precision import record_path

    _cpu(monkeypatch, EPYC)
    record_path(run).unlink(missing_ok=True)
    p = resolve_placement("auto", "auto", run=run)
    assert p.dtype == "float32" and "no bfloat16 parity record" in p.reason
    assert resolve_placement("auto", "auto").dtype == "float32"  # no run (training, evaluation): float32
    doc = _pass_gate(run, monkeypatch)
    p = resolve_placement("auto", "auto", run=run)
    r = doc["result"]
    assert p.dtype == "bfloat16" and p.reason == (f"auto: bfloat16, the CPU has bf16 units (avx512_bf16) and its "
                                                  f"bfloat16 parity passed ({r['counted_flips']}/{r['rows']} test "
                                                  f"decisions flipped beyond the noise floor {r['noise_floor']:.2g}; "
                                                  f"{r['flips'] - r['counted_flips']} near ties not counted)")
    assert str(p).startswith("cpu bfloat16 (auto: bfloat16") and p.to_dict()["reason"] == p.reason
    assert Placement(**p.to_dict()) == p  # the serve workers' config round trip
    _cpu(monkeypatch, AVX2)  # the same run on a CPU without the units
    assert resolve_placement("auto", "auto", run=run).dtype == "float32"
    # a record of another export (re-exported since) is not this export's
    _cpu(monkeypatch, EPYC)
    path = record_path(run)
    stale = json.loads(path.read_text())
    stale["export"]["checkpoint_sha256"] = "0" * 64
    path.write_text(json.dumps(stale))
    p = resolve_placement("auto", "auto", run=run)
    assert p.dtype == "float32" and "measured another export" in p.reason
    path.unlink()


def test_bf16_backbone_against_fp32_within_tolerance(run):
    """bf16 keeps 8 significand bits (relative rounding 2**-9 = 0.2% per op). Through the tiny decoder and the
    fp32 scorer the logits move by at most 5% of the largest logit magnitude over the rows and the temperature-scaled
    probabilities by at most 0.1 (measured: 0.16 against a largest |logit| of 6.1, max |dp| 0.06); the scorer and
    readout stay fp32."""
    from rlcd.data.io import load_split
    from rlcd.device import Placement
    from rlcd.export import load_export
    from rlcd.model.case_scoring import score_records

    records = load_split(json.loads((run / "config.json").read_text())["data_dir"], "test")[:24]
    out, models = {}, {}
    for dtype in ("float32", "bfloat16"):
        models[dtype], meta = load_export(run, placement=Placement("cpu", dtype))
        out[dtype] = score_records(models[dtype], records)
    m16 = models["bfloat16"]
    assert {p.dtype for p in m16.backbone.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in m16.head.parameters()} | {m16.head.mu_d.dtype} == {torch.float32}
    assert m16.placement == {"device": "cpu", "dtype": "bfloat16"}
    dp, moved = [], []
    scale = max(float(a.abs().max()) for a in out["float32"])
    for r, a, b in zip(records, out["float32"], out["bfloat16"]):
        assert a.dtype == b.dtype == torch.float32
        a64, b64 = a.double().numpy(), b.double().numpy()
        moved.append(np.max(np.abs(a64 - b64)))
        t = meta["temperatures"][r.question.type]
        pa, pb = np.exp(a64 / t - np.logaddexp.reduce(a64 / t)), np.exp(b64 / t - np.logaddexp.reduce(b64 / t))
        dp.append(np.max(np.abs(pa - pb)))
    assert 0 < max(moved) <= 0.05 * scale
    assert 0 < max(dp) <= 0.1  # bf16 moved something (it ran in bf16), within the bound
    # the state cache holds the backbone's states: bf16 ones take half the bytes of fp32 ones
    from rlcd.predict import Predictor

    req = {"state": "Order 77: the parcel is late.", "questions": {
        "late": {"type": "noul", "instructions": "Is it late?"},
        "team": {"type": "choice", "instructions": "Which team?", "criteria": ["billing", "shipping"]}}}
    sizes = {}
    for dtype, model in models.items():
        pred = Predictor(model, meta, state_cache_mb=64)
        pred.predict(req)
        sizes[dtype] = pred.state_cache.stats()["bytes"]
    assert sizes["float32"] > 0 and sizes["bfloat16"] * 2 == sizes["float32"]


def _logit(p: float) -> list[float]:
    """Two-class logits whose softmax (T = 1) is [p, 1 - p]."""
    return [float(np.log(p)), float(np.log(1 - p))]


def _hand(pairs: list[tuple[float, float]]) -> tuple[list, list, list]:
    """Rows (one case each, gold class 0) and float32 / bf16 logits from (p_float32, p_bf16) of class 0 per row."""
    rows = [{"id": f"c{i}:q", "case_id": f"c{i}", "type": "noul", "target": [1.0, 0.0]} for i in range(len(pairs))]
    return rows, [_logit(a) for a, _ in pairs], [_logit(b) for _, b in pairs]


LIMITS = {"max_flips": 0.005, "max_dp": 0.02, "max_nll_delta": 0.005}


def test_a_near_tie_flip_within_the_noise_floor_is_not_counted():
    """18 decisions (the issue's tiny-llama run): 17 kept, each moved by up to 1e-4, and one near tie (float32
    margin 1e-4) flipped by a dp of 1e-4. bf16 showed it moves margins by up to 2e-4 on decisions it kept, so
    a margin of 1e-4 is inside its noise: the flip is reported, not counted, and the gate passes (before this rule
    it refused: 1/18 = 5.6% > 0.5%)."""
    from rlcd.precision import judge

    kept = [(0.6 + 0.02 * i, 0.6 + 0.02 * i + (1e-4 if i % 2 else -1e-4)) for i in range(17)]
    rows, a, b = _hand(kept + [(0.50005, 0.49995)])
    report, refused = judge(rows, a, b, {}, **LIMITS)
    assert report["flips"] == 1 and report["noise_floor"] == pytest.approx(2e-4, rel=1e-6)
    (flip,) = report["flipped"]
    assert flip["id"] == "c17:q" and flip["margin"] == pytest.approx(1e-4, rel=1e-6) and flip["counted"] is False
    assert report["counted_flips"] == 0 and refused == []


def test_a_flip_with_a_margin_above_the_noise_floor_counts_and_refuses():
    """The same kept decisions (floor 2e-4) and a decision at p = 0.53 (margin 0.06) that bf16 turns to 0.49:
    far outside bf16's measured noise, a change of meaning: counted, and its |dp| 0.04 crosses --max-dp too."""
    from rlcd.precision import judge

    kept = [(0.6 + 0.02 * i, 0.6 + 0.02 * i + (1e-4 if i % 2 else -1e-4)) for i in range(17)]
    rows, a, b = _hand(kept + [(0.53, 0.49)])
    report, refused = judge(rows, a, b, {}, **LIMITS)
    assert report["flipped"][0]["counted"] is True and report["counted_flips"] == 1
    assert len(refused) == 2
    assert refused[0].startswith("1 flips beyond the noise floor 0.0002 (5.56% > --max-flips 0.50%)")
    assert refused[1] == "max |dp| 0.04 > --max-dp 0.02"
    _, loose = judge(rows, a, b, {}, **{**LIMITS, "max_dp": 0.05})
    assert loose == refused[:1]  # the flip alone still refuses


def test_the_floor_comes_from_kept_decisions_only():
    """Every decision flipped: no kept decision measured the noise, the floor is 0 and every flip counts (a flip
    never excuses itself, though its own margin is always below twice its own |dp|)."""
    from rlcd.precision import flip_rule

    rule = flip_rule([[0.5001, 0.4999], [0.51, 0.49]], [[0.4999, 0.5001], [0.49, 0.51]])
    assert rule["noise_floor"] == 0 and rule["counted"] == 2
    assert all(f["margin"] < 2 * f["dp"] for f in rule["flipped"])


def test_the_gate_refuses_a_measurably_worse_forecaster_and_a_large_dp_without_flips():
    """No flip at all, but bf16 moves every decision 0.03 towards the wrong class: max |dp| 0.03 > 0.02 refuses,
    and with --max-dp loosened the NLL delta (+0.06 nats on every case: its interval well above +0.005) still does."""
    from rlcd.precision import judge

    rows, a, b = _hand([(0.8, 0.77)] * 60)
    report, refused = judge(rows, a, b, {}, **LIMITS)
    assert report["flips"] == 0 and len(refused) == 2 and refused[0] == "max |dp| 0.03 > --max-dp 0.02"
    assert refused[1].startswith("NLL delta 95% interval above +0.005")
    _, loose = judge(rows, a, b, {}, **{**LIMITS, "max_dp": 0.05})
    assert len(loose) == 1 and loose[0].startswith("NLL delta 95% interval above +0.005")


def test_the_gate_passes_records_and_refuses(run, monkeypatch):
    """A random tiny model's decisions are near ties, and bf16 moves its probabilities by up to 0.06: the default
    limits refuse it (max |dp| > 0.02, whatever the flips), loose ones pass; both write the record `--dtype auto`
    reads, with every flip's margin, |dp| and whether it counted."""
    from typer.testing import CliRunner

    from rlcd.cli import app
    from rlcd.precision import parity_verdict, record_path

    _cpu(monkeypatch, EPYC)
    res = CliRunner().invoke(app, ["export", str(run), "--precision", "bfloat16"])
    assert res.exit_code == 1, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("rlcd: error:")]
    assert len(lines) == 1 and "bfloat16 backbone fails the parity gate (" in lines[0], res.stderr
    assert "> --max-dp 0.02" in lines[0] and "beyond the noise floor" in lines[0]
    assert "Traceback" not in res.output
    doc = json.loads(record_path(run).read_text())
    r = doc["result"]
    assert doc["passed"] is False and doc["max_flips"] == 0.005 and r["rows"] == 72 and r["flips"] > 0.005 * 72
    assert doc["limits"]["max_dp"] == 0.02 and doc["refused"] and lines[0].count(";") >= len(doc["refused"])
    assert set(r["nll"]) == {"float32", "bfloat16", "delta", "delta_95"}
    assert r["nll"]["delta"] == pytest.approx(r["nll"]["bfloat16"] - r["nll"]["float32"])
    assert r["nll"]["delta_95"][0] <= r["nll"]["delta"] <= r["nll"]["delta_95"][1]
    assert 0.02 < r["max_abs_dp"] <= 0.1
    assert len(r["flipped"]) == r["flips"] and all(0 <= f["margin"] <= 2 * f["dp"] for f in r["flipped"])
    assert r["counted_flips"] == sum(f["margin"] > r["noise_floor"] for f in r["flipped"]) == \
        sum(f["counted"] for f in r["flipped"])
    assert parity_verdict(run)[0] is False
    from rlcd.device import resolve_placement

    p = resolve_placement("auto", "auto", run=run)
    assert p.dtype == "float32" and "parity gate refused" in p.reason
    res = CliRunner().invoke(app, ["export", str(run), "--precision", "bfloat16", "--max-flips", "0.5",
                                   "--max-dp", "0.2"])
    assert res.exit_code == 0, res.output
    doc2 = json.loads(record_path(run).read_text())
    assert doc2["passed"] is True and doc2["refused"] == [] and doc2["result"]["flips"] == r["flips"]
    assert doc2["export"] == {k: json.loads((run / "export" / "model.json").read_text())[k]
                              for k in ("checkpoint_sha256", "backbone_fingerprint", "selected_step")}
    assert parity_verdict(run)[0] is True
    record_path(run).unlink()


def test_precision_mistakes_are_one_line_and_write_nothing(run, tmp_path):
    from rlcd.precision import record_path

    before = sorted(p.name for p in (run / "export").iterdir())
    user_error(["export", run, "--precision", "float16"], contains="--precision")
    user_error(["export", run, "--precision", "bfloat16", "--max-flips", "2"], contains="a fraction of the test rows")
    user_error(["export", run, "--format", "onnx", "--out", tmp_path / "o", "--precision", "bfloat16"],
               contains="--precision goes with the torch export")
    user_error(["export", run, "--max-flips", "0.1"], contains="--max-flips goes with --format onnx or --precision")
    user_error(["export", run, "--max-dp", "0.1"], contains="--max-dp goes with --precision")
    user_error(["export", run, "--precision", "bfloat16", "--max-dp", "1.5"], contains="a probability difference")
    assert sorted(p.name for p in (run / "export").iterdir()) == before and not record_path(run).exists()
    assert not (tmp_path / "o").exists()


def test_predictor_states_the_placement_and_its_reason(run, monkeypatch, caplog):
    from rlcd.device import resolve_placement
    from rlcd.predict import Predictor

    _cpu(monkeypatch, EPYC)
    _pass_gate(run, monkeypatch)
    where = resolve_placement("cpu", "auto", run=run)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rlcd.export"):
        info = Predictor.from_run(run, placement=where).info()
    assert info["placement"] == {"device": "cpu", "dtype": "bfloat16", "reason": where.reason}
    start = [r.getMessage() for r in caplog.records if "loading export" in r.getMessage()]
    assert len(start) == 1 and start[0].endswith(f"onto cpu bfloat16 ({where.reason})")
    from rlcd.precision import record_path

    record_path(run).unlink()


def _train(base: Path, dtype: str) -> Path:
    from rlcd.recipe import Recipe
    from rlcd.train import train

    torch.set_num_threads(1)
    data = synth_processed(base, 40, seed=11)
    recipe = Recipe(steps=2, lr_head=5e-3, head_only=False, log_every=1, eval_every=2, checkpoint_every=2,
                    diagnostics_every=2)
    train(base / "run", data_dir=data, model="tiny-llama", recipe=recipe, progress=False, device="cpu", dtype=dtype)
    return base / "run"


def test_bf16_training_keeps_lora_head_and_optimizer_in_fp32_and_says_so(tmp_path):
    """bf16 frozen weights with fp32 LoRA (peft keeps adapters fp32 over a bf16 base), fp32 scorer, fp32 AdamW state;
    the first two losses within 2% of the fp32 run's (the same sampled batches, bf16 activations)."""
    from rlcd import checkpoint as ckpt

    runs = {dtype: _train(tmp_path / dtype, dtype) for dtype in ("float32", "bfloat16")}
    cfg = {d: json.loads((r / "config.json").read_text()) for d, r in runs.items()}
    assert "precision_deviation" not in cfg["float32"]
    dev = cfg["bfloat16"]["precision_deviation"]
    assert dev["dtype"] == "bfloat16" and dev["default"] == "float32" and dev["device"] == "cpu"
    loaded = ckpt.load(runs["bfloat16"] / "checkpoints" / "last")
    weights = loaded["weights"]
    assert any("lora_" in k for k in weights) and {t.dtype for t in weights.values()} == {torch.float32}
    states = [t for s in loaded["optimizer"]["state"].values() for t in s.values()
              if isinstance(t, torch.Tensor) and t.dim() > 0]
    assert states and {t.dtype for t in states} == {torch.float32}
    losses = {}
    for d, r in runs.items():
        rows = [json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines()]
        losses[d] = [x["loss"] for x in rows if x["event"] == "train"]
    assert len(losses["bfloat16"]) == 2 and losses["bfloat16"] != losses["float32"]
    np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=0.02)


def test_state_cache_bench_takes_a_dtype_list(run, tmp_path):
    """`rlcd bench serve RUN --state-cache --dtype float32,bfloat16`: one model per dtype, interleaved; the speedup
    is the float32 p50 over the bfloat16 one, and a bf16 state takes half the bytes (no timing asserted)."""
    from typer.testing import CliRunner

    from rlcd.bench.state_cache import SCENARIOS
    from rlcd.cli import app

    out = tmp_path / "sc.json"
    res = CliRunner().invoke(app, ["bench", "serve", str(run), "--state-cache", "--dtype", "float32,bfloat16",
                                   "--device", "cpu", "--threads", "1", "--repeats", "1", "--state-tokens", "40",
                                   "--json", str(out)])
    assert res.exit_code == 0, res.output
    rec = json.loads(out.read_text())
    assert "--dtype float32,bfloat16" in rec["command"]
    r = rec["results"]
    assert r["dtypes"] == ["float32", "bfloat16"]
    by = r["by_dtype"]
    assert [by[d]["placement"]["dtype"] for d in r["dtypes"]] == ["float32", "bfloat16"]
    for sc in SCENARIOS:
        assert r["speedup"]["bfloat16"]["1"][sc] == pytest.approx(by["float32"]["p50_ms"]["1"][sc]
                                                                  / by["bfloat16"]["p50_ms"]["1"][sc])
    c32, c16 = by["float32"]["cache"], by["bfloat16"]["cache"]
    assert c32["entries"] == c16["entries"] > 0 and c16["bytes"] < c32["bytes"]
    user_error(["bench", "serve", run, "--dtype", "float32,bfloat16"], contains="goes with --state-cache")
    user_error(["bench", "serve", run, "--state-cache", "--dtype", "float32,float32", "--device", "cpu"],
               contains="float32 given twice")
    user_error(["bench", "serve", run, "--state-cache", "--dtype", "float16"], contains="--dtype 'float16'")


def test_cut_bench_by_dtype_ratios():
    """`rlcd bench cut --dtype float32,bfloat16`: updates/s of the later dtype over the first's, per update kind."""
    from rlcd.cli.bench import cut_by_dtype

    def res(a: float, k4: float) -> dict:
        u = lambda v: {"updates_per_s": v}  # noqa: E731
        return {"model": "m", "all_layers": {"row": u(a), "case": u(2 * a)}, "per_k": {"4": {"row": u(k4),
                                                                                            "case": u(3 * k4)}}}

    out = cut_by_dtype({"float32": res(0.1, 0.8), "bfloat16": res(0.25, 1.2)})
    assert out["dtypes"] == ["float32", "bfloat16"] and out["by_dtype"]["bfloat16"]["model"] == "m"
    assert out["speedup"]["bfloat16"] == pytest.approx({"all_layers.row": 2.5, "all_layers.case": 2.5,
                                                        "per_k.4.row": 1.5, "per_k.4.case": 1.5})
    user_error(["bench", "cut", "--model", "tiny", "--dtype", "float32,float32"], contains="float32 given twice")


def test_the_parity_gates_score_the_original_rows_as_the_server_asks_them(tmp_path):
    """Both export gates (bf16 and ONNX) read their rows from `test_records`: on a derived data set, the original
    test rows only (as `rlcd evaluate`), each in the canonical form `rlcd serve` asks it, targets folded alike."""
    from types import SimpleNamespace

    from rlcd.data.derive import derive_dir, parse_forms
    from rlcd.data.io import load_split
    from rlcd.portable.exporter import test_records
    from rlcd.serving.canonical import canonical

    data = synth_processed(tmp_path, 40, seed=3)
    derive_dir(data, tmp_path / "derived", parse_forms(None))
    every = load_split(tmp_path / "derived", "test")
    originals = [r for r in every if r.derived is None]
    got = test_records(SimpleNamespace(data_dir=tmp_path / "derived"))
    assert len(every) > len(originals) and [r.id for r in got] == [r.id for r in originals]
    moved = 0
    for r, o in zip(got, originals):
        c = canonical(o.question)
        assert r.question.type == c.asked.type and r.question.labels == c.asked.labels
        want = np.zeros(c.asked.k)
        np.add.at(want, list(c.source), o.target)
        np.testing.assert_allclose(r.target, want, atol=1e-12)
        moved += r.question.labels != o.question.labels
    assert moved > 0, "the fixture has rows written out of canonical order"


def test_batch_predict_under_dtype_auto_honours_the_gate_and_a_resume_keeps_its_placement(run, monkeypatch, tmp_path):
    """After a passed gate on a bf16 CPU, `rlcd predict --input` under `--dtype auto` runs in bfloat16 like single
    predict / serve (same answers within 1e-6), says why on its start-up line and records the placement in
    job.json; a resume that would change the placement (`--dtype float32`) is refused in one line."""
    from typer.testing import CliRunner

    from rlcd.batch.io import parts_dir, read_output
    from rlcd.cli import app
    from rlcd.device import resolve_placement
    from rlcd.precision import record_path
    from rlcd.predict import Predictor

    _cpu(monkeypatch, EPYC)
    _pass_gate(run, monkeypatch)
    where = resolve_placement("auto", "auto", run=run)
    assert where.dtype == "bfloat16"
    requests = [{"id": f"r{i}", "state": f"Ticket {i}: the parcel is late and nobody answers.",
                 "questions": {"q": {"type": "choice", "instructions": "Which team?",
                                     "criteria": {"shipping": "parcels", "billing": None, "support": "calls"}},
                               "n": {"type": "noul", "instructions": "Is it urgent?"}}} for i in range(4)]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in requests))
    res = CliRunner().invoke(app, ["predict", str(run), "--input", str(src), "--output", str(out),
                                   "--chunk-rows", "2"])
    assert res.exit_code == 0, res.output
    assert f"predict: the model runs on cpu bfloat16 ({where.reason})" in res.stderr
    single = Predictor.from_run(run, placement=where)
    worst = 0.0
    for got in read_output(out):
        want = single.predict({k: v for k, v in requests[int(got["id"][1:])].items() if k != "id"})
        for qid, a in want["answers"].items():
            g = got["answers"][qid]
            worst = max(worst, abs(g["noul"] - a["noul"]) if a["type"] == "noul" else
                        max(abs(g["probabilities"][k] - p) for k, p in a["probabilities"].items()))
    assert worst < 1e-6, worst
    # a job killed before its first part (its job.json as the command writes it): a resume that changes the
    # placement is refused, one that keeps it finishes
    from rlcd.batch.io import PartWriter, input_identity
    from rlcd.batch.local import PredictorSpec

    out2 = tmp_path / "out2.jsonl"
    spec = PredictorSpec(run=str(run)).resolved()
    PartWriter.check(out2, {"input": input_identity(src), **spec.identity()}, resume=False).start()
    job = json.loads((parts_dir(out2) / "job.json").read_text())
    assert (job["device"], job["dtype"]) == ("cpu", "bfloat16")
    user_error(["predict", run, "--input", src, "--output", out2, "--resume", "--dtype", "float32"],
               contains="dtype differs")
    res = CliRunner().invoke(app, ["predict", str(run), "--input", str(src), "--output", str(out2), "--resume"])
    assert res.exit_code == 0, res.output
    assert [a["answers"] for a in read_output(out2)] == [a["answers"] for a in read_output(out)]
    record_path(run).unlink()


def test_a_resume_in_another_precision_is_refused_so_config_json_never_lies(tmp_path):
    """A bf16 run resumed with `--dtype float32` (or an `auto` run resumed where auto means another dtype) is
    refused in one line before anything is written; a resume in its own precision goes on."""
    from rlcd.device import resolve_placement

    run = _train(tmp_path, "bfloat16")
    before = {p.name: p.read_bytes() for p in (run / "config.json", run / "metrics.jsonl")}
    user_error(["train", "--resume", run, "--dtype", "float32", "--steps", "3"], contains="one run is one precision")
    assert {p.name: p.read_bytes() for p in (run / "config.json", run / "metrics.jsonl")} == before
    res = _invoke(["train", "--resume", str(run), "--steps", "3"])  # auto: the run's bfloat16
    assert res.exit_code == 0, res.output
    from rlcd.train.setup import trained_dtype

    cfg = json.loads((run / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and trained_dtype(Run(run), cfg) == "bfloat16"
    sessions = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["dtype"] for s in sessions if s.get("event") == "session"] == ["bfloat16", "bfloat16"]
    # an `auto` run knows its precision from its sessions
    cfg["dtype"] = "auto"
    assert trained_dtype(Run(run), cfg) == "bfloat16" and resolve_placement("cpu", "auto").dtype == "float32"


def _invoke(args):
    from typer.testing import CliRunner

    from rlcd.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])
