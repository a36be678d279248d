"""The cut-state cache: every token's hidden state entering decoder layer `cut` (= L - lora_layers), computed once.

With LoRA on the top K decoder layers only, the layers below the cut are frozen, so each row's states at
the cut are a pure function of the row -- the feature cache (`rlcd.features`) one level down. An update
then runs only the K layers above it (`rlcd.model.cut_forward`). Same discipline as the feature cache:

    DATA/features/cut-<KEY>/
      manifest.json        {"key", "key_id", "complete": true, "splits": {split: {entries, segments, tokens}},
                            "storage", "hidden", "positions", "bytes", "row_tokens", "seconds" (summed over
                            its attempts), "attempts", ...}
      <split>.states.bin   [T, H] raw, row-major, in the storage dtype (float32; bfloat16 as its uint16 bits)
      <split>.pos.bin      [T, P] int32 per-token positions (P = 1 for a text decoder, 3 for Qwen3.5's M-RoPE)
      <split>.index.json   {"segments": [[offset, length], ...], "entries": [[id, order, prefix | -1, suffix,
                            decision_pos, [marker_pos, ...]], ...]}

Storage is prefix-shared like the extraction: a case's state prefix (the common token prefix of its rows,
capped at the smallest decision position) is one segment, each row's remaining tokens another; a row
is its prefix segment followed by its suffix segment, exactly the full row's states because the layers
below the cut are frozen. A train choice row is stored in the feature cache's balanced candidate orders (`orders_of`).
The states are memory-mapped when read (`CutCache`), so the cache can exceed RAM.

KEY = sha256 of {cut_version, backbone, a digest of every weight the states depend on (embeddings, vision
tower, the layers below the cut; not the layers above, which LoRA and its merge change), the prompt frame,
the four split files' sha256, the compute dtype, the storage dtype, ORDERS_SCHEME, the cut and the layer count,
and -- only when it is not float32 -- the `precision` the layers below the cut ran in}.

Precision (`Recipe.frozen_precision`, `rlcd features --frozen-precision`): "bfloat16" runs the layers below the cut
under bfloat16 autocast (matrix products in bfloat16, norms and the residual stream in float32) and stores the states
in bfloat16. On a CPU with AVX512-BF16 that extraction is ~2x faster for a relative error of ~1-2% per state (Gemma 3
270M, measured in docs/experiments/real-weights/); the layers above the cut, which LoRA trains, still run in float32.
A float32 run never reads such a cache: the key differs.
Written under a temporary name and renamed into place; an incomplete directory or another key is never read.
Resumable like the feature cache (`rlcd.partial`): chunks of 8 calls committed to
`DATA/features/.partial-cut-<KEY_ID>/` (`<split>-<chunk>.states.bin`, `.pos.bin`, `.index.json` with offsets
and segment numbers from the chunk's start); the split's files are the chunks' files end to end, renumbered, so
a resumed cache is byte for byte an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from rlcd import features as _features
from rlcd.data.sampling import ORDERS_SCHEME
from rlcd.features import (building, cache_entries, cache_root, check_writable, each_split, entries_by_case,
                           key_id, publish, read_manifest, resumed, split_records)
from rlcd.files import need_space
from rlcd.frozen_precision import PRECISIONS, check_precision, lower_precision
from rlcd.partial import Partial, chunk_digest, chunk_entries, drop_finished, plan_chunks
from rlcd.schema import TYPE_ID, Record

CUT_VERSION = 1
SPLITS = ("train", "dev", "calibration", "test")
STORAGE = ("float32", "bfloat16")
PREFIX = "cut-"


# ----------------------------------------------------------------------------------------------
# the key


def lower_weights_digest(model, cut: int) -> str:
    """sha256 over every backbone weight below decoder layer `cut` (embeddings, vision tower, layers 0..cut-1;
    LoRA there when any of it is non-zero), names normalised as in `features.weights_digest`. The layers
    above the cut and the final norm after them are left out: merging their LoRA changes nothing here."""
    dec = model.family.text_decoder(model.causal_lm())
    above = {id(p) for layer in list(dec.layers)[cut:] for p in layer.parameters()}
    above |= {id(p) for p in dec.norm.parameters()}
    params = [(n, p) for n, p in model.backbone.named_parameters() if id(p) not in above]
    if not any(torch.count_nonzero(p) for n, p in params if "lora_B" in n):
        params = [(n, p) for n, p in params if "lora_" not in n]  # a zero LoRA adds nothing
    h = hashlib.sha256()
    for name, p in params:
        t = p.detach().reshape(-1)
        stride = max(1, t.numel() // 4096)
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|{float(t.double().sum()):.17g}|".encode())
        h.update(t[::stride].float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def cut_key(model, data_dir: Path, storage: str = "float32", cut: int | None = None,
            precision: str = "float32") -> dict[str, Any]:
    """Everything the cut states depend on (see the module docstring); `cut`: another layer than the model's own
    (any model whose weights below it match can read such a cache: `find_cut_states(any_cut=True)`); `precision`:
    the layers below the cut in float32 or under bfloat16 autocast (a field only when not float32, so the keys of
    float32 caches are those they always were)."""
    from rlcd.data.io import sha256_file

    cut = model.cut_layer if cut is None else cut
    info = model.backbone_info
    return {
        "cut_version": CUT_VERSION,
        "backbone": {k: info.get(k) for k in ("family", "config_hash", "vocab", "vocab_size", "marker_id",
                                              "hidden_size", "num_layers")},
        "weights_below_cut": lower_weights_digest(model, cut),
        "prompt": model.info["prompt"],
        "splits": {f"{s}.jsonl": sha256_file(Path(data_dir) / f"{s}.jsonl") for s in SPLITS
                   if (Path(data_dir) / f"{s}.jsonl").is_file()},
        "dtype": str(next(model.backbone.parameters()).dtype).replace("torch.", ""),
        "storage": storage,
        "orders": ORDERS_SCHEME,
        "cut": int(cut),
        "num_layers": int(model.num_layers),
        **({"precision": precision} if precision != "float32" else {}),
    }


# ----------------------------------------------------------------------------------------------
# reading


def _to_storage(t: torch.Tensor, storage: str) -> np.ndarray:
    if storage == "bfloat16":
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return t.float().numpy()


def _from_storage(a: np.ndarray, storage: str) -> torch.Tensor:
    if storage == "bfloat16":
        return torch.from_numpy(np.array(a).view(np.int16)).view(torch.bfloat16).float()
    return torch.from_numpy(np.array(a, dtype=np.float32))


class CutCache:
    """A complete cut-state directory: the index in memory, the states memory-mapped."""

    def __init__(self, root: Path, manifest: dict, index: dict[str, dict], maps: dict[str, tuple[np.memmap, np.memmap]]):
        self.root, self.manifest, self.maps = root, manifest, maps
        self.storage = manifest["storage"]
        self.segments = {s: idx["segments"] for s, idx in index.items()}
        self.entries = {s: {(e[0], int(e[1])): e for e in idx["entries"]} for s, idx in index.items()}

    @property
    def key(self) -> dict:
        return self.manifest["key"]

    @property
    def nbytes(self) -> int:
        return int(self.manifest["bytes"])

    @classmethod
    def load(cls, root: Path, key: dict | None = None) -> "CutCache | None":
        """The cache at `root` if it is complete, its files have the sizes the manifest says and (when given)
        it holds exactly `key`; else None."""
        manifest = read_manifest(root, key)
        if manifest is None:
            return None
        hidden, npos = int(manifest["hidden"]), int(manifest["positions"])
        item = 2 if manifest["storage"] == "bfloat16" else 4
        index, maps = {}, {}
        try:
            for split, info in manifest["splits"].items():
                idx = json.loads((root / f"{split}.index.json").read_text())
                t = int(info["tokens"])
                states, pos = root / f"{split}.states.bin", root / f"{split}.pos.bin"
                if (len(idx["entries"]) != info["entries"] or states.stat().st_size != t * hidden * item
                        or pos.stat().st_size != t * npos * 4):
                    return None
                dtype = np.uint16 if item == 2 else np.float32
                maps[split] = (np.memmap(states, dtype=dtype, mode="r", shape=(t, hidden)) if t else
                               np.zeros((0, hidden), dtype=dtype),
                               np.memmap(pos, dtype=np.int32, mode="r", shape=(t, npos)) if t else
                               np.zeros((0, npos), dtype=np.int32))
                index[split] = idx
        except (OSError, ValueError, KeyError):
            return None
        return cls(root, manifest, index, maps)

    def has(self, split: str, ids) -> bool:
        e = self.entries.get(split, {})
        return all((i, 0) in e for i in ids)

    def _segment(self, split: str, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        off, n = self.segments[split][j]
        states, pos = self.maps[split]
        return _from_storage(states[off:off + n], self.storage), torch.from_numpy(np.array(pos[off:off + n]))

    def batch(self, split: str, records: Sequence[Record], orders: Sequence[int],
              units: list[list[int]] | None = None):
        """A CutBatch of `records` (already in their fixed orders `orders`: targets are read from them);
        `units`: row indices grouped by case (batch_by="case"), else rows."""
        from rlcd.model.cut_forward import CutBatch

        try:
            entries = [self.entries[split][(r.id, int(o))] for r, o in zip(records, orders)]
        except KeyError as e:
            raise KeyError(f"cut-state cache {self.root} has no entry {e.args[0]} in {split}") from None
        prefixes, where, prefix_of, suffixes = [], {}, [], []
        for e in entries:
            if e[2] < 0:
                prefix_of.append(None)
            else:
                if e[2] not in where:
                    where[e[2]] = len(prefixes)
                    prefixes.append(self._segment(split, e[2]))
                prefix_of.append(where[e[2]])
            suffixes.append(self._segment(split, e[3]))
        kmax = max(len(e[5]) for e in entries)
        marker = torch.zeros((len(entries), kmax), dtype=torch.long)
        mask = torch.zeros((len(entries), kmax), dtype=torch.bool)
        for i, e in enumerate(entries):
            marker[i, :len(e[5])] = torch.tensor(e[5], dtype=torch.long)
            mask[i, :len(e[5])] = True
        target = torch.tensor([list(r.target) + [0.0] * (kmax - len(r.target)) for r in records], dtype=torch.float32)
        types = [r.question.type for r in records]
        n_tok = sum(int(s.shape[0]) + (int(prefixes[p][0].shape[0]) if p is not None else 0)
                    for (s, _), p in zip(suffixes, prefix_of))
        return CutBatch(prefixes=prefixes, prefix_of=prefix_of, suffixes=suffixes,
                        decision_pos=torch.tensor([e[4] for e in entries], dtype=torch.long), marker_pos=marker,
                        cand_mask=mask, target=target,
                        ordinal=torch.tensor([t == "score" for t in types], dtype=torch.bool),
                        type_id=torch.tensor([TYPE_ID[t] for t in types], dtype=torch.long),
                        ids=[r.id for r in records], groups=[r.group or r.sampling_group for r in records],
                        types=types, n_tokens=n_tok, units=units, stored_dtype=self.storage,
                        cut_layer=int(self.key["cut"]))


# ----------------------------------------------------------------------------------------------
# extraction


_CHUNK_SUFFIXES = ("states.bin", "pos.bin", "index.json")


@torch.no_grad()
def extract_split(model, records: Sequence[Record], collator, split: str, out: Path, *, partial,
                  storage: str = "float32", precision: str = "float32", rows_per_call: int | None = None,
                  progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Write one split's states, positions and index under `out`; returns {entries, segments, tokens, row_tokens}.

    The calls are grouped in chunks (`rlcd.partial.plan_chunks`); each chunk not yet in `partial` (a locked
    `rlcd.partial.Partial`) is computed and committed there as `<split>-<chunk>.states.bin`, `.pos.bin` and
    `.index.json` ({"segments": [[offset, length], ...] from the chunk's start, "rows": [[entry, id, order,
    prefix | -1, suffix, decision_pos, [marker_pos, ...]], ...]} with the chunk's own segment numbers); the split's
    files are then the chunks' files end to end, offsets and segment numbers shifted: the bytes one pass writes.
    `precision`: "bfloat16" runs the layers below the cut under bfloat16 autocast (`lower_precision`).
    """
    entries = cache_entries(split, records)
    chunks = plan_chunks(entries_by_case(entries), rows_per_call or _features.ROWS_PER_CALL)
    digests = [chunk_digest(c, entries) for c in chunks]
    todo = [i for i, d in enumerate(digests) if not partial.has(split, i, d, _CHUNK_SUFFIXES)]
    done = len(entries) - sum(len(chunk_entries(chunks[i])) for i in todo)
    if done and progress:
        progress(done)
    from rlcd.model.runner import CaseRunner

    runner = CaseRunner(model)
    was = model.training
    model.eval()
    for i in todo:
        segments: list[list[int]] = []
        rows: list[list[Any]] = []
        offset = 0
        with open(partial.tmp(split, i, "states.bin"), "wb") as fs, open(partial.tmp(split, i, "pos.bin"), "wb") as fp:
            def write(states: torch.Tensor, pos: torch.Tensor) -> int:
                nonlocal offset
                fs.write(_to_storage(states, storage).tobytes())
                fp.write(pos.to(torch.int32).numpy().tobytes())
                segments.append([offset, int(states.shape[0])])
                offset += int(states.shape[0])
                return len(segments) - 1

            for call in chunks[i]:
                cases = [runner.cases.from_records([entries[j][0] for j in g], collator.image_root) for g in call]
                with lower_precision(model, precision):
                    got = runner.cut_states(cases, model.cut_layer)
                for g, case, (prefix, states) in zip(call, cases, got):
                    p = write(*prefix) if prefix is not None else -1
                    for j, enc, row in zip(g, case.rows, states):
                        rec, order = entries[j]
                        rows.append([j, rec.id, order, p, write(*row), enc.decision_pos, list(enc.marker_pos)])
                done += sum(len(g) for g in call)
                if progress:
                    progress(done)
        partial.tmp(split, i, "index.json").write_text(json.dumps({"segments": segments, "rows": rows}))
        partial.commit(split, i, digests[i], len(rows), _CHUNK_SUFFIXES)
    model.train(was)
    segments, index = [], [None] * len(entries)
    offset = 0
    row_bytes = int(model.head.hidden) * (2 if storage == "bfloat16" else 4)
    pos_bytes = _n_positions(model) * 4
    need_space(out.parent, sum(partial.file(split, i, sfx).stat().st_size for i in range(len(chunks))
                               for sfx in ("states.bin", "pos.bin")),
               f"assembling the {split} split's cut states",
               f"the extracted chunks in {partial.dir} are kept: only the assembly runs again")
    with open(out / f"{split}.states.bin", "wb") as fs, open(out / f"{split}.pos.bin", "wb") as fp:
        for i in range(len(chunks)):
            part = json.loads(partial.file(split, i, "index.json").read_text())
            base = len(segments)
            segments.extend([off + offset, n] for off, n in part["segments"])
            for j, rid, order, p, sfx, dpos, marker in part["rows"]:
                index[j] = [rid, order, p + base if p >= 0 else -1, sfx + base, dpos, marker]
            tokens = sum(n for _, n in part["segments"])
            for suffix, f, width in (("states.bin", fs, row_bytes), ("pos.bin", fp, pos_bytes)):
                path = partial.file(split, i, suffix)
                if path.stat().st_size != tokens * width:
                    raise RuntimeError(f"cut-state chunk {path} does not hold its {tokens} tokens; delete "
                                       f"{partial.dir} and extract again")
                with open(path, "rb") as src:
                    shutil.copyfileobj(src, f, 1 << 24)
            offset += tokens
    if any(e is None for e in index):
        raise RuntimeError(f"the cut-state chunks of {split} in {partial.dir} do not cover its entries")
    (out / f"{split}.index.json").write_text(json.dumps({"segments": segments, "entries": index}))
    return {"entries": len(index), "segments": len(segments), "tokens": offset,
            "row_tokens": sum(segments[e[3]][1] + (segments[e[2]][1] if e[2] >= 0 else 0) for e in index)}


def _root(data_dir: Path, key: dict) -> Path:
    return cache_root(Path(data_dir)) / f"{PREFIX}{key_id(key)}"


def ensure_cut_states(model, data_dir: Path, *, storage: str = "float32", progress: bool = True,
                      say: Callable[[str], None] | None = None,
                      records: dict[str, list[Record]] | None = None, precision: str = "float32") -> CutCache:
    """The cut-state cache of `model` (its `cut_layer`) over `data_dir`: loaded when a complete one with the
    same key exists, else extracted (all four splits) and published atomically; resumable like
    `rlcd.features.ensure_features` (chunks in `DATA/features/.partial-cut-<KEY_ID>/`, `rlcd.partial`).
    `precision` "bfloat16": the layers below the cut under bfloat16 autocast, the states stored in bfloat16
    (`storage` must then be bfloat16 too)."""
    from rlcd.errors import OptionError

    if model.cut_layer is None:
        raise ValueError("this model has LoRA on every layer: there is no cut to cache")
    if storage not in STORAGE:
        raise OptionError(f"cut-state storage must be one of {', '.join(STORAGE)}, got {storage!r}")
    check_precision(precision)
    if precision == "bfloat16" and storage != "bfloat16":
        raise OptionError(f"cut states computed in bfloat16 are stored in bfloat16 (float32 storage would keep no more "
                          f"than they hold), got storage {storage!r}")
    say = say or (lambda _: None)
    data_dir = Path(data_dir)
    key = cut_key(model, data_dir, storage, precision=precision)
    final = _root(data_dir, key)
    root = cache_root(data_dir)
    found = CutCache.load(final, key)
    if found is not None:
        drop_finished(root, final.name)
        say(f"cut states: reusing {final} ({found.nbytes / 2**20:.1f} MiB)")
        return found
    check_writable(root)
    recs = split_records(data_dir, records)
    splits: dict[str, dict] = {}
    collator = model.collator(image_root=data_dir)
    with Partial(root, final.name, key, _features.ROWS_PER_CALL).held(say, "cut states") as partial:
        again = partial.published_meanwhile(lambda: CutCache.load(final, key), say, "cut states", final)
        if again is not None:
            return again
        resumed(partial, recs, "cut states", say)
        with building(root, final) as tmp:
            for split, split_recs, bar in each_split(recs, "cut states", progress, partial):
                with bar:
                    splits[split] = extract_split(model, split_recs, collator, split, tmp, partial=partial,
                                                  storage=storage, precision=precision, progress=bar.update)
            seconds = partial.seconds()
            nbytes = sum(f.stat().st_size for f in tmp.iterdir())
            manifest = {"key": key, "key_id": key_id(key), "complete": True, "splits": splits, "storage": storage,
                        "precision": precision,
                        "hidden": int(model.head.hidden), "positions": _n_positions(model), "bytes": nbytes,
                        "row_tokens": sum(s["row_tokens"] for s in splits.values()),
                        "stored_tokens": sum(s["tokens"] for s in splits.values()), "seconds": round(seconds, 3),
                        "attempts": partial.attempts, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            publish(tmp, final, manifest)
        partial.remove()
    out = CutCache.load(final, key)
    if out is None:
        raise RuntimeError(f"cut-state cache {final} could not be read back after writing it")
    m = out.manifest
    say(f"cut states: layer {model.cut_layer} of {model.num_layers}, {sum(s['entries'] for s in splits.values())} "
        f"entries, {m['stored_tokens']} stored tokens for {m['row_tokens']} row tokens, {m['bytes'] / 2**20:.1f} MiB "
        f"{storage}" + (" (computed in bfloat16)" if precision != "float32" else "") + f", in {seconds:.1f} s" + (f" over {partial.attempts} attempts" if partial.attempts > 1 else "")
        + f" -> {final}")
    return out


def _n_positions(model) -> int:
    return 3 if model.family.name == "qwen3.5" else 1


def find_cut_states(model, data_dir: Path, storage: str = "float32", *, any_cut: bool = False,
                    precision: str = "float32") -> CutCache | None:
    """The complete cut-state cache for `model` (its cut) over `data_dir` if one exists (never extracts).
    `any_cut`: any complete cache, at whatever cut, whose key this model matches there (its weights below that
    cut, its prompt, the data, the dtype): the layers above it then yield this model's final features cheaply
    (`rlcd.features` extraction uses it); the deepest such cut is taken (fewest layers to run). `precision`: of the
    layers below the cut; with `any_cut`, a "bfloat16" lookup reads bfloat16-stored caches of that precision only,
    a float32 one float32-stored caches only."""
    root = cache_root(Path(data_dir))
    if not root.is_dir():
        return None
    if not any_cut:
        if getattr(model, "cut_layer", None) is None:
            return None
        key = cut_key(model, Path(data_dir), storage, precision=precision)
        return CutCache.load(_root(Path(data_dir), key), key)
    storage = "bfloat16" if precision == "bfloat16" else "float32"
    found = []
    for d in root.glob(f"{PREFIX}*"):
        try:
            key = json.loads((d / "manifest.json").read_text())["key"]
        except (OSError, ValueError, KeyError):
            continue
        if (key.get("num_layers") != getattr(model, "num_layers", None) or key.get("storage") != storage
                or key.get("precision", "float32") != precision):
            continue
        cache = CutCache.load(d, cut_key(model, Path(data_dir), storage, cut=int(key["cut"]), precision=precision))
        if cache is not None:
            found.append(cache)
    return max(found, key=lambda c: int(c.key["cut"]), default=None)


__all__ = ["CUT_VERSION", "PRECISIONS", "CutCache", "check_precision", "cut_key", "lower_precision",
           "ensure_cut_states", "extract_split", "find_cut_states",
           "lower_weights_digest"]
