"""The portable export at serving time: onnxruntime + tokenizers + numpy, no torch.

`PortableModel(DIR)` has the surface `Predictor` drives on a `DecisionModel` (`prepare_case`, `score_cases`,
`supports_images`, `placement`, `eval`), so `load_portable(DIR)` is the same `Predictor` -- same validation,
answers, usage and wire format (`rlcd serve --export DIR`) -- on another engine:

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
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from rlcd.errors import RunError, UserError
from rlcd.model.frame import PromptSpec
from rlcd.model.prompt import EncodedRow, PromptEncoder
from rlcd.portable import layout
from rlcd.schema import QUESTION_TYPES

FORMAT = "rlcd.onnx/1"
MANIFEST, SCORER, TOKENIZER = "manifest.json", "scorer.safetensors", "tokenizer.json"
INPUTS = ("input_ids", "position_ids", "attention_mask", "read_positions")
OUTPUTS = ("hidden",)
LN_EPS = 1e-5  # torch.nn.functional.layer_norm's default, as the torch scorer uses it


def require_onnx(*modules: str) -> None:
    """A one-line error naming the extra when a package of `rlcd[onnx]` is missing (the default install lacks it)."""
    import importlib.util

    missing = [m for m in ("onnxruntime", *modules) if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"the portable export needs {', '.join(missing)}: pip install 'rlcd[onnx]'")


def read_manifest(path: Path | str) -> dict[str, Any]:
    """DIR/manifest.json of a finished portable export (a refused one holds only PARITY-FAILED.json)."""
    path = Path(path)
    mf = path / MANIFEST
    if not mf.is_file():
        failed = " (its export was refused: see PARITY-FAILED.json there)" if (path / "PARITY-FAILED.json").is_file() else ""
        raise RunError(f"{path}: not a portable export, no {MANIFEST}{failed}; write one with `rlcd export RUN "
                       "--format onnx --out DIR`")
    meta = json.loads(mf.read_text(encoding="utf-8"))
    if meta.get("format") != FORMAT:
        raise RunError(f"{mf}: unsupported format {meta.get('format')!r} (expected {FORMAT})")
    return meta


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


class PortableModel:
    """A portable export loaded for scoring (see the module docstring). `threads`: onnxruntime's intra-op
    threads (None: its default, every core). `graph`: another .onnx file of DIR (the bench's fp32 twin)."""

    supports_images = False

    def __init__(self, path: Path | str, *, threads: int | None = None, graph: str | None = None):
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        require_onnx()
        import onnxruntime as ort

        opts = ort.SessionOptions()
        if threads is not None:
            opts.intra_op_num_threads = int(threads)
            opts.inter_op_num_threads = 1
        graph = graph or self.manifest["graph"]["file"]
        self.session = ort.InferenceSession(str(self.path / graph), opts, providers=["CPUExecutionProvider"])
        self.graph = graph
        t = load_file(str(self.path / SCORER))
        self.tensors = {k: t[k].astype(np.float32) for k in ("w_d", "w_c", "mu_d", "mu_c")}
        self.temperatures = {q: float(v) for q, v in zip(QUESTION_TYPES, t["temperatures"].tolist())}
        scorer = self.manifest["scorer"]
        self.centring, self.proj_dim = scorer["centring"], int(scorer["proj_dim"])
        prompt = self.manifest["prompt"]
        spec = dict(prompt["spec"])
        spec["reserved"] = tuple(spec["reserved"])
        if spec.get("image_tokens") is not None:
            spec["image_tokens"] = tuple(spec["image_tokens"])
        tok = _Tokenizer(Tokenizer.from_file(str(self.path / TOKENIZER)), prompt["pad_id"])
        self.encoder = PromptEncoder(tok, max_tokens=int(prompt["max_tokens"]), spec=PromptSpec(**spec))
        self.max_rows = 64
        self._lock = threading.Lock()

    def eval(self) -> "PortableModel":
        return self

    @property
    def placement(self) -> dict[str, str]:
        return {"device": "cpu", "dtype": self.manifest["graph"]["precision"], "runtime": "onnxruntime"}

    def meta(self) -> dict[str, Any]:
        """What `Predictor` reads from an export's model.json: the source run's, with these temperatures."""
        src = dict(self.manifest.get("source") or {})
        return {**src, "temperatures": dict(self.temperatures)}

    # ------------------------------------------------------------------ the Predictor surface
    def prepare_case(self, state: Any, questions: Sequence[Any], image: Any = None, ids: Sequence[str] | None = None,
                     *, case_id: str | None = None, max_tokens: int | None = None) -> PortableCase:
        """Rows tokenised as `DecisionModel.encode_case` does (the prefix once); images refused (text-only)."""
        if image is not None:
            self.encoder.refuse_image(case_id)
        qids = list(ids) if ids is not None else [f"q{i}" for i in range(len(questions))]
        prefix = self.encoder.prefix_ids(state, row=case_id if case_id is not None else
                                         (qids[0] if len(qids) == 1 else "request"))
        return PortableCase([self.encoder.encode(state, q, row=qid, prefix=prefix, max_tokens=max_tokens)
                             for q, qid in zip(questions, qids)])

    def score_cases(self, cases: Sequence[PortableCase], **_: Any) -> list[tuple[list[np.ndarray], dict]]:
        """[(logits per question [k] float32, usage)] per case; usage counts tokens as the torch path does."""
        feats = self.case_features(cases)
        out = []
        for c, fs in zip(cases, feats):
            logits = [self.scorer(hd, hc) for hd, hc in fs]
            cut = layout.case_cut(c.rows) if c.rows else None
            out.append((logits, {"input_tokens": layout.processed_tokens(c.rows) if c.rows else 0,
                                 "prefix_tokens": cut or 0, "rows": len(c.rows), "full_tokens": c.n_tokens,
                                 "image_tokens": 0, "batched_requests": len(cases),
                                 "path": "prefix" if cut is not None else "full"}))
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

    model = PortableModel(path, threads=threads)
    p = Path(path).resolve()
    predictor = Predictor(model, model.meta(), name=name or p.name or "rlcd", limits=limits, strict_model=strict_model,
                          state_cache_mb=0,  # the graph takes whole packed rows: no decoder state to keep
                          order_votes=order_votes, canonical=canonical, vote_combine=vote_combine)
    predictor.release_date = (model.manifest.get("written") or "")[:10] or None
    return predictor


__all__ = ["require_onnx", "score", "FORMAT", "MANIFEST", "SCORER", "TOKENIZER", "INPUTS", "OUTPUTS", "PortableModel",
           "PortableCase", "load_portable", "read_manifest", "centre"]
