"""The portable export at serving time: onnxruntime + tokenizers + numpy, no torch.

`PortableModel(DIR)` is a `rlcd.serving.runner.Runner`, as the torch engine (`rlcd.model.runner.CaseRunner`) is, so
`load_portable(DIR)` is the same `Predictor` -- same validation, answers, usage and wire format (`rlcd serve
--export DIR`) -- on another engine:

* prompts: `rlcd.model.prompt.PromptEncoder` itself, on the `tokenizers` library's tokenizer.json and the
  frame recorded in the manifest (marker, reserved tokens, chat head, pad id): the same token ids as the
  torch model's encoder;
* features: the ONNX graph on the packed shared-prefix layout (`rlcd.portable.layout`);
* scorer: `logit_k = (W_c (c_k - mu_c)) . (W_d (d - mu_d)) / sqrt(P)` in float32 from scorer.safetensors
  (layernorm / none centring as `rlcd.model.head.CandidateScorer`), then the per-type temperatures stored
  beside it (`temperatures`, in `QUESTION_TYPES` order), applied by `Predictor.respond`.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from rlcd.errors import RunError, UserError
from rlcd.model.frame import PromptSpec
from rlcd.model.prompt import EncodedRow, PromptEncoder
from rlcd.portable import layout
from rlcd.schema import QUESTION_TYPES
from rlcd.serving.cache import ScopedStateCache
from rlcd.serving.runner import Usage

FORMAT = "rlcd.onnx/1"
MANIFEST, SCORER, TOKENIZER = "manifest.json", "scorer.safetensors", "tokenizer.json"
INPUTS = ("input_ids", "position_ids", "attention_mask", "read_positions")
OUTPUTS = ("hidden",)
log = logging.getLogger(__name__)  # what is loaded, and how long it took (the CLI shows INFO)
LN_EPS = 1e-5  # torch.nn.functional.layer_norm's default, as the torch scorer uses it


def require_onnx(*modules: str) -> None:
    """A one-line error naming the extra when a package of `rlcd[onnx]` is missing (the default install lacks it)."""
    import importlib.util

    missing = [m for m in ("onnxruntime", *modules) if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"the portable export needs {', '.join(missing)}: pip install 'rlcd[onnx]'")


REWRITE = "write it again with `rlcd export RUN --format onnx --out NEWDIR`"


def read_manifest(path: Path | str) -> dict[str, Any]:
    """DIR/manifest.json of a finished portable export (a refused one holds only PARITY-FAILED.json), checked
    before anything loads: valid JSON in this format, the sections the runtime reads, and the files it names
    (the graph, scorer.safetensors, tokenizer.json) present. Anything else is a one-line RunError."""
    path = Path(path)
    mf = path / MANIFEST
    if not path.is_dir():
        raise RunError(f"{path}: not a portable export (no such directory); write one with `rlcd export RUN "
                       "--format onnx --out DIR`")
    if not mf.is_file():
        failed = " (its export was refused: see PARITY-FAILED.json there)" if (path / "PARITY-FAILED.json").is_file() else ""
        raise RunError(f"{path}: not a portable export, no {MANIFEST}{failed}; write one with `rlcd export RUN "
                       "--format onnx --out DIR`")
    try:
        meta = json.loads(mf.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunError(f"{mf}: not valid JSON ({e}); the export is damaged or incomplete: {REWRITE}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise RunError(f"{mf}: unsupported format {found!r} (expected {FORMAT})")
    for section, keys in (("graph", ("file", "precision")), ("scorer", ("centring", "proj_dim")),
                          ("prompt", ("spec", "pad_id", "max_tokens"))):
        block = meta.get(section)
        missing = [k for k in keys if not isinstance(block, dict) or k not in block]
        if missing:
            raise RunError(f"{mf}: no {section}.{missing[0]}; the manifest is incomplete: {REWRITE}")
    for name in (meta["graph"]["file"], SCORER, TOKENIZER):
        if not (path / name).is_file():
            raise RunError(f"{path}: incomplete portable export, no {name}; {REWRITE}")
    return meta


@contextmanager
def _unreadable(path: Path):
    """A file of the export that its library cannot read becomes one line naming it. onnxruntime's and
    safetensors' errors derive from Exception alone, and tokenizers raises a bare Exception, so the test is where
    the error comes from (those libraries or Python's own), not its class; anything else stays a bug."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised below unless one of the readers raised it
        if isinstance(e, UserError) or type(e).__module__.split(".")[0] not in (
                "onnxruntime", "safetensors", "tokenizers", "builtins"):
            raise
        raise RunError(f"{path}: cannot be read ({_first_line(e)}); the export is damaged or incomplete: "
                       f"{REWRITE}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]


class _Tokenizer:
    """A `tokenizers.Tokenizer` with the surface `PromptEncoder` reads (`encode`, pad/eos ids, `_tokenizer`)."""

    def __init__(self, backend: Any, pad_id: int):
        self._tokenizer = backend
        self.pad_token_id = int(pad_id)
        self.eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)


@dataclass
class PortableCase:
    """One request's rows (`PortableModel.prepare_case`); `n_tokens` for the batcher's bounds."""

    rows: list[EncodedRow]

    @property
    def n_tokens(self) -> int:
        return sum(len(r) for r in self.rows)


def centre(h: np.ndarray, mu: np.ndarray, centring: str) -> np.ndarray:
    if centring == "running_mean":
        return h - mu
    if centring == "layernorm":
        m = h.mean(-1, keepdims=True)
        v = ((h - m) ** 2).mean(-1, keepdims=True)
        return (h - m) / np.sqrt(v + LN_EPS)
    return h


def default_threads() -> int:
    """The thread count torch's CPU backend starts with, computed without importing torch, so that `rlcd serve
    --export` and `rlcd serve RUN` run on as many threads by default: MKL_NUM_THREADS, else OMP_NUM_THREADS, when
    set to a positive integer, at most the physical cores this process may run on; else those cores (torch counts
    physical cores, not hyper-threads; `os.cpu_count()` where the topology cannot be read). onnxruntime's own
    default would take every core whatever OMP_NUM_THREADS says."""
    import os

    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    n_cores = max(1, len(cores))
    for var in ("MKL_NUM_THREADS", "OMP_NUM_THREADS"):  # torch reads both; MKL's wins
        value = os.environ.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return min(int(value), n_cores)
    return n_cores


class PortableModel:
    """A portable export loaded for scoring (see the module docstring). `threads`: onnxruntime's intra-op and
    inter-op threads (None: `default_threads()`, torch's default, so both servers start alike; onnxruntime's own
    default takes every core). `graph`: another .onnx file of DIR (the bench's fp32 twin). `spin`: let idle pool
    threads busy-wait (onnxruntime's default); off here, because a server shares its cores with its own HTTP threads
    and often with other processes, where spinning threads take the cores the work needs (at 2 threads on a busy
    2-core machine: benchmarks/onnx_spinning.py, docs/SERVING.md).

    A file that cannot be read (a truncated graph, scorer or tokenizer) or a graph whose hidden size is not the
    scorer's is a one-line RunError naming the file."""

    supports_images = False

    def __init__(self, path: Path | str, *, threads: int | None = None, graph: str | None = None,
                 spin: bool = False):
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        require_onnx()
        import onnxruntime as ort

        self.threads = int(threads) if threads is not None else default_threads()
        if self.threads < 1:
            raise UserError(f"threads {self.threads}: give 1 or more")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.threads
        opts.inter_op_num_threads = self.threads
        if not spin:  # idle pool threads sleep instead of busy-waiting for the next parallel section
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
        self.spin = bool(spin)
        graph = graph or self.manifest["graph"]["file"]
        self.graph = graph
        with _unreadable(self.path / graph):
            self.session = ort.InferenceSession(str(self.path / graph), opts, providers=["CPUExecutionProvider"])
        with _unreadable(self.path / SCORER):
            t = load_file(str(self.path / SCORER))
            self.tensors = {k: t[k].astype(np.float32) for k in ("w_d", "w_c", "mu_d", "mu_c")}
            self.temperatures = {q: float(v) for q, v in zip(QUESTION_TYPES, t["temperatures"].tolist())}
        scorer = self.manifest["scorer"]
        self.centring, self.proj_dim = scorer["centring"], int(scorer["proj_dim"])
        out_hidden = self.session.get_outputs()[0].shape[-1]
        want = self.tensors["w_d"].shape[1]
        if isinstance(out_hidden, int) and out_hidden != want:
            raise RunError(f"{self.path / graph}: the graph's hidden size {out_hidden} is not the scorer's {want} "
                           f"({SCORER}); the files come from different exports: {REWRITE}")
        prompt = self.manifest["prompt"]
        spec = dict(prompt["spec"])
        spec["reserved"] = tuple(spec["reserved"])
        if spec.get("image_tokens") is not None:
            spec["image_tokens"] = tuple(spec["image_tokens"])
        with _unreadable(self.path / TOKENIZER):
            tok = _Tokenizer(Tokenizer.from_file(str(self.path / TOKENIZER)), prompt["pad_id"])
        self.encoder = PromptEncoder(tok, max_tokens=int(prompt["max_tokens"]), spec=PromptSpec(**spec))
        self.max_rows = 64
        self._lock = threading.Lock()

    def eval(self) -> "PortableModel":
        return self

    @property
    def placement(self) -> dict[str, str]:
        return {"device": "cpu", "dtype": self.manifest["graph"]["precision"], "runtime": "onnxruntime",
                "threads": self.threads}

    def identity(self) -> dict[str, Any]:
        """What this engine's answers depend on (the request caches' scope; this engine reads no cache)."""
        return {"export": str(self.path.resolve()), "graph": self.graph, "placement": self.placement,
                "object": id(self)}

    def meta(self) -> dict[str, Any]:
        """What `Predictor` reads from an export's model.json: the source run's, with these temperatures."""
        src = dict(self.manifest.get("source") or {})
        return {**src, "temperatures": dict(self.temperatures)}

    # ------------------------------------------------------------------ the Runner surface
    def prepare_case(self, state: Any, questions: Sequence[Any], image: Any = None, ids: Sequence[str] | None = None,
                     *, case_id: str | None = None, max_tokens: int | None = None, keyed: bool = False) -> PortableCase:
        """Rows tokenised as `CaseEncoder.rows` does (the prefix once); images refused (text-only).
        `keyed` is accepted and means nothing: this engine reads no request cache."""
        if image is not None:
            self.encoder.refuse_image(case_id)
        qids = list(ids) if ids is not None else [f"q{i}" for i in range(len(questions))]
        prefix = self.encoder.prefix_ids(state, row=case_id if case_id is not None else
                                         (qids[0] if len(qids) == 1 else "request"))
        return PortableCase([self.encoder.encode(state, q, row=qid, prefix=prefix, max_tokens=max_tokens)
                             for q, qid in zip(questions, qids)])

    def score_cases(self, cases: Sequence[PortableCase], *, state_cache: ScopedStateCache | None = None,
                    row_cache: ScopedStateCache | None = None) -> list[tuple[list[np.ndarray], Usage]]:
        """[(logits per question [k] float32, usage)] per case; usage counts tokens as the torch path does. The
        request caches are accepted and not read: the graph takes whole packed rows, no decoder state to keep (a
        portable Predictor turns them off)."""
        feats = self.case_features(cases)
        out = []
        for c, fs in zip(cases, feats):
            logits = [self.scorer(hd, hc) for hd, hc in fs]
            n = layout.case_prefix_len(c.rows) if c.rows else None
            out.append((logits, Usage(input_tokens=layout.processed_tokens(c.rows) if c.rows else 0,
                                      prefix_tokens=n or 0, rows=len(c.rows), full_tokens=c.n_tokens,
                                      batched_requests=len(cases), path="prefix" if n is not None else "full")))
        return out

    # ------------------------------------------------------------------ features and scorer
    def case_features(self, cases: Sequence[PortableCase]) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        """Per case, per row: (h_dec [H], h_cand [k, H]) float32 from the graph (packed layout, grouped calls)."""
        seqs: list[tuple[int, layout.Sequence_]] = [(ci, s) for ci, c in enumerate(cases) if c.rows
                                                   for s in layout.pack_case(c.rows)]
        out: list[list[Any]] = [[None] * len(c.rows) for c in cases]
        for group in layout.group_sequences([len(s) for _, s in seqs], max_rows=self.max_rows):
            chunk = [seqs[j] for j in group]
            inputs = layout.feed([s for _, s in chunk], self.encoder.pad_id)
            with self._lock:
                (hidden,) = self.session.run(list(OUTPUTS), inputs)
            for b, (ci, s) in enumerate(chunk):
                at = 0
                for ri, reads in zip(s.rows, s.reads):
                    h = hidden[b, at: at + len(reads)]
                    out[ci][ri] = (h[0], h[1:])
                    at += len(reads)
        return out

    def scorer(self, h_dec: np.ndarray, h_cand: np.ndarray) -> np.ndarray:
        return score(h_dec, h_cand, self.tensors, self.centring, self.proj_dim)


def score(h_dec: np.ndarray, h_cand: np.ndarray, t: Mapping[str, np.ndarray], centring: str, proj_dim: int) -> np.ndarray:
    """h_dec [H], h_cand [K, H] -> logits [K] (float32), as `CandidateScorer.forward` on one row; `t`: scorer.safetensors."""
    d = centre(h_dec.astype(np.float32), t["mu_d"], centring) @ t["w_d"].T
    c = centre(h_cand.astype(np.float32), t["mu_c"], centring) @ t["w_c"].T
    return ((c @ d) / np.float32(math.sqrt(proj_dim))).astype(np.float32)


def load_portable(path: Path | str, *, name: str | None = None, limits: Any = None, strict_model: bool = False,
                  threads: int | None = None, order_votes: int = 1, canonical: bool = True,
                  vote_combine: str = "logmean") -> Any:
    """A `Predictor` on the portable export at `path` (torch-free); `order_votes`, `vote_combine`, `canonical` as
    `Predictor`'s."""
    from rlcd.predict import Predictor

    t0 = time.perf_counter()
    log.info("model: loading portable export %s (onnxruntime on the CPU)", path)
    model = PortableModel(path, threads=threads)
    log.info("model: ready in %.1f s (%s graph, %d threads)", time.perf_counter() - t0,
             model.manifest["graph"]["precision"], model.threads)
    p = Path(path).resolve()
    predictor = Predictor(model, model.meta(), name=name or p.name or "rlcd", limits=limits, strict_model=strict_model,
                          state_cache_mb=0,  # the graph takes whole packed rows: no decoder state to keep
                          order_votes=order_votes, canonical=canonical, vote_combine=vote_combine)
    predictor.release_date = (model.manifest.get("written") or "")[:10] or None
    return predictor


__all__ = ["require_onnx", "score", "FORMAT", "MANIFEST", "SCORER", "TOKENIZER", "INPUTS", "OUTPUTS", "PortableModel",
           "PortableCase", "load_portable", "read_manifest", "centre", "default_threads"]
