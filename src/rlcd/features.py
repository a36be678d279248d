"""The frozen-feature cache: `(h_dec, h_cand)` of every row of a processed data directory, computed once.

While the backbone is frozen (a head-only run, or the head warm-up of an LP-FT run) the scorer's inputs
are a pure function of the row and of the frozen weights -- LoRA included when it is not zero (a head-only
run started with `--init` from a run whose LoRA moved reads that LoRA's features) -- so they are computed
once and shared by every run whose key matches -- the pattern of `datasets`' fingerprinted cache files: the key says
everything the content depends on, so a match is a proof and a mismatch a rebuild.

    DATA/features/<KEY>/
      manifest.json          {"key": {...}, "key_id", "complete": true, "splits": {split: n_entries}, "seconds"
                             (extraction seconds summed over its attempts), "attempts", ...}
      <split>.safetensors    h_dec [N, H], h_cand [C, H] (all candidates, row after row), cand_start [N],
                             k [N], n_tokens [N]  (N entries: one per row, n_orders(K) per train choice row)
      <split>.index.json     [[id, order], ...] in entry order

KEY = sha256 of {feature_version, backbone (family, config hash, vocabulary, marker), a digest of every
frozen weight, a digest of the LoRA weights when any LoRA B is non-zero (no field for a zero LoRA: it adds
nothing), the prompt frame, the four split files' sha256, the dtype, ORDERS_SCHEME, and -- for features computed
from a cut-state cache (the layers above its cut run on stored states: they differ from a full forward's by
~1e-4) -- `from_cut_states` {cut, storage[, precision]}; no such field: the full backbone ran; and -- only when not
float32 -- the `precision` of the frozen layers below the top (`Recipe.frozen_precision`: "bfloat16" is the full
backbone under bfloat16 autocast, or the layers above a bfloat16 cut-state cache in float32)}. A cache built before that
field existed whose manifest says it came from cut states is never read (nor re-keyed). The directory is
written under a temporary name and renamed into place as the last step, so a killed extraction publishes
nothing that a reader opens (its `.tmp-*` directory is removed by the next extraction); a directory whose
manifest does not say `complete` or whose key differs is never read.

Extraction is resumable (`rlcd.partial`): the calls of a split are grouped in chunks of 8, each committed
(fsync'd, renamed into place) to `DATA/features/.partial-<KEY_ID>/` as `<split>-<chunk>.safetensors`
(h_dec, h_cand, k, n_tokens of the chunk's entries) and listed in its `progress.json`. A later extraction
of the same key -- after a kill, Ctrl-C, a full disk -- computes only the chunks not listed there, assembles
each split from the chunks' files, and publishes the bytes an uninterrupted extraction publishes; the
partial is then removed. Another key never reads it; a second extraction of the same key waits on its lock.

Choice rows: the candidate features depend on the option order, so a train choice row is cached in
balanced fixed orders (`rlcd.data.sampling.fixed_order`, the identity among them): all K! orders for
K <= 3, where a position prior is learnable, else the rows of a Latin square that put every candidate in
every position once (at most MAX_ORDERS = 8 rows; above 8 candidates, 8 rows spread evenly). A draw uses
order `perm_seed mod n_orders(K)` (`order_of_draw`), so every cached order of a row is equally likely.
Dev, calibration and test rows are scored in their given order only.

Extraction runs all questions of one state from one prefix forward (`CaseRunner.case_features`,
the serving path) when the model has it, several cases per call. A zero LoRA is switched off for it (peft's
`disable_adapter`): the same features bit for bit, 1.2x faster on SmolLM2-135M.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import shutil
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from rlcd.data.sampling import ORDERS_SCHEME, orders_of, orders_scheme, with_fixed_order
from rlcd.errors import OptionError
from rlcd.files import pid_alive, plain_mode
from rlcd.model.collate import FeatureBatch  # noqa: F401 (defined beside the other batches; importable here as before)
from rlcd.partial import Partial, chunk_digest, chunk_entries, drop_finished, plan_chunks
from rlcd.schema import TYPE_ID, Record

FEATURE_VERSION = 1
SPLITS = ("train", "dev", "calibration", "test")
FEATURES_DIR = "features"
_TENSORS = ("h_dec", "h_cand", "cand_start", "k", "n_tokens")


# ----------------------------------------------------------------------------------------------
# the key


def weights_digest(model) -> str:
    """sha256 over every frozen backbone weight (LoRA excluded), name-independent of the peft wrapper.

    Per tensor: its normalised name, shape, dtype, float64 sum and ~4k strided values -- any real change
    of a weight (another seed, another checkpoint, a merged non-zero LoRA) changes it; it costs well under
    a second on a 0.8B backbone.
    """
    h = hashlib.sha256()
    for name, p in model.backbone.named_parameters():
        if "lora_" in name:
            continue
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        t = p.detach().reshape(-1)
        stride = max(1, t.numel() // 4096)
        sample = t[::stride].float().cpu().contiguous()
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|{float(t.double().sum()):.17g}|".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()


def lora_digest(model) -> str | None:
    """sha256 over the LoRA tensors when any LoRA B is non-zero; None when the model has no LoRA or a zero one."""
    if model.lora_is_zero():
        return None
    h = hashlib.sha256()
    for name, p in sorted((n, p) for n, p in model.backbone.named_parameters() if "lora_" in n):
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|".encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def _zero_lora_off(model):
    """peft's adapters switched off while they add nothing (every LoRA B zero), else nothing changes. peft's
    re-enabling sets requires_grad on every adapter weight, so each parameter's flag is put back as it was (a
    head-only run's LoRA stays frozen, and DDP sees the same parameters on every rank)."""
    if not (hasattr(model.backbone, "disable_adapter") and model.lora_is_zero()):
        yield
        return
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        with model.backbone.disable_adapter():
            yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def feature_key(model, data_dir: Path, cut_states=None, choice_orders: str = "balanced",
                precision: str = "float32") -> dict[str, Any]:
    """Everything the cached features depend on (see the module docstring); `cut_states`: the cut-state cache
    (`rlcd.cut_cache.CutCache`) they are computed from, else the full backbone; `choice_orders`: which candidate
    orders of a train choice row it keeps (`Recipe.choice_orders`; the key's "orders"); `precision`: of the frozen
    layers (`Recipe.frozen_precision`; a field only when not float32)."""
    from rlcd.data.io import sha256_file

    info = model.backbone_info
    dtype = str(next(model.backbone.parameters()).dtype).replace("torch.", "")
    lora = lora_digest(model)
    return {
        "feature_version": FEATURE_VERSION,
        "backbone": {k: info.get(k) for k in ("family", "config_hash", "vocab", "vocab_size", "marker_id",
                                              "hidden_size", "num_layers")},
        "weights": weights_digest(model),
        "prompt": model.info["prompt"],
        "splits": {f"{s}.jsonl": sha256_file(Path(data_dir) / f"{s}.jsonl") for s in SPLITS
                   if (Path(data_dir) / f"{s}.jsonl").is_file()},
        "dtype": dtype,
        "orders": orders_scheme(choice_orders),
        **({"lora": lora} if lora is not None else {}),  # absent for a zero LoRA: caches built before it stay valid
        **({"from_cut_states": cut_source(cut_states)} if cut_states is not None else {}),
        **({"precision": precision} if precision != "float32" else {}),
    }


def cut_source(cut_states) -> dict[str, Any]:
    """What of a cut-state cache its features depend on beyond the model, the data and the dtype: the cut layer,
    the storage dtype of its states and the precision they were computed in (its weights below the cut are the
    model's: `find_cut_states`)."""
    precision = cut_states.key.get("precision")
    return {"cut": int(cut_states.key["cut"]), "storage": str(cut_states.key["storage"]),
            **({"precision": precision} if precision else {})}


def key_id(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


# ----------------------------------------------------------------------------------------------
# what a training step reads


class FeatureCache:
    """A complete cache directory, loaded into memory (CPU tensors)."""

    def __init__(self, root: Path, manifest: dict, tensors: dict[str, dict[str, torch.Tensor]],
                 index: dict[str, dict[tuple[str, int], int]]):
        self.root, self.manifest, self.tensors, self.index = root, manifest, tensors, index

    @property
    def key(self) -> dict:
        return self.manifest["key"]

    @classmethod
    def load(cls, root: Path, key: dict | None = None) -> "FeatureCache | None":
        """The cache at `root` if it is complete and (when given) holds exactly `key`; else None."""
        from safetensors.torch import load_file

        manifest = read_manifest(root, key)
        if manifest is None:
            return None
        tensors, index = {}, {}
        try:
            for split, n in manifest["splits"].items():
                t = load_file(str(root / f"{split}.safetensors"))
                entries = json.loads((root / f"{split}.index.json").read_text())
                if len(entries) != n or any(t[name].shape[0] != n for name in ("h_dec", "cand_start", "k")):
                    return None
                tensors[split] = t
                index[split] = {(i, int(o)): j for j, (i, o) in enumerate(entries)}
        except (OSError, ValueError, KeyError):
            return None
        return cls(root, manifest, tensors, index)

    def has(self, split: str, ids: Iterable[str]) -> bool:
        idx = self.index.get(split, {})
        return all((i, 0) in idx for i in ids)

    def rows(self, split: str, keys: Sequence[tuple[str, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(h_dec [B,H], h_cand [B,Kmax,H], cand_mask [B,Kmax]) of entries `(id, order)` of `split` (one gather)."""
        t = self.tensors[split]
        idx = self.index[split]
        try:
            js = torch.tensor([idx[key] for key in keys], dtype=torch.long)
        except KeyError as e:
            raise KeyError(f"feature cache {self.root} has no entry {e.args[0]} in {split}") from None
        ks = t["k"][js]
        kmax = int(ks.max())
        offs = torch.arange(kmax)
        mask = offs[None, :] < ks[:, None]
        pos = torch.where(mask, t["cand_start"][js][:, None] + offs[None, :], 0)
        h_cand = t["h_cand"][pos] * mask[..., None].to(t["h_cand"].dtype)
        return t["h_dec"][js], h_cand, mask

    def batch(self, split: str, records: Sequence[Record], orders: Sequence[int]) -> FeatureBatch:
        """A FeatureBatch of `records` (already in their fixed orders `orders`: targets are read from them)."""
        keys = [(r.id, o) for r, o in zip(records, orders)]
        h_dec, h_cand, mask = self.rows(split, keys)
        idx = self.index[split]
        n_tok = int(self.tensors[split]["n_tokens"][[idx[key] for key in keys]].sum())
        kmax = mask.shape[1]
        target = torch.tensor([list(r.target) + [0.0] * (kmax - len(r.target)) for r in records], dtype=torch.float32)
        types = [r.question.type for r in records]
        return FeatureBatch(h_dec=h_dec, h_cand=h_cand, cand_mask=mask, target=target,
                            ordinal=torch.tensor([ty == "score" for ty in types], dtype=torch.bool),
                            type_id=torch.tensor([TYPE_ID[ty] for ty in types], dtype=torch.long),
                            ids=[r.id for r in records], groups=[r.group or r.sampling_group for r in records],
                            types=types, n_tokens=n_tok)


# ----------------------------------------------------------------------------------------------
# extraction


def cache_root(data_dir: Path) -> Path:
    return Path(data_dir) / FEATURES_DIR


def cache_entries(split: str, records: Sequence[Record], choice_orders: str = "balanced") -> list[tuple[Record, int]]:
    """(record in its fixed order, order) for every cached entry of a split."""
    out = []
    for r in records:
        out.extend((with_fixed_order(r, o), o) for o in orders_of(r, split, choice_orders))
    return out


def entries_by_case(entries: list[tuple[Record, int]]) -> list[list[int]]:
    cases: dict[str, list[int]] = defaultdict(list)
    for j, (r, _) in enumerate(entries):
        cases[r.case_id if r.case_id is not None else f"\0{r.id}"].append(j)
    return list(cases.values())


ROWS_PER_CALL = 64
_CHUNK_SUFFIX = ("safetensors",)


def _shares_prefixes(model: Any) -> bool:
    """Whether `extract_split` runs a case's rows on one prefix forward for this model (a `DecisionModel`)."""
    from rlcd.model.decision import DecisionModel

    return isinstance(model, DecisionModel)


@torch.no_grad()
def extract_split(model, records: Sequence[Record], collator, split: str, *, rows_per_call: int | None = None,
                  progress: Callable[[int], None] | None = None, shared: bool = True,
                  lora_off: bool = True, cut_states=None, partial=None,
                  choice_orders: str = "balanced", precision: str = "float32") -> tuple[dict[str, torch.Tensor], list]:
    """The tensors and index of one split: every entry's (h_dec, h_cand) from the frozen backbone.

    Rows of one case (one state) share a prefix forward (`CaseRunner.case_features`) for a `DecisionModel`;
    otherwise (or `shared=False`, the per-row reference of `rlcd bench features`) full rows are run,
    `rows_per_call` (default ROWS_PER_CALL) at a time. A zero LoRA is switched off unless `lora_off=False`
    (what the bench compares). `cut_states`: a `rlcd.cut_cache.CutCache` this model matches below its cut: only
    the layers above it run (the same features to float noise, at a fraction of the cost).

    The calls are grouped in chunks (`rlcd.partial.plan_chunks`). `partial`: a locked `rlcd.partial.Partial`:
    chunks it holds are read back instead of computed, each computed one is committed to it as
    `<split>-<chunk>.safetensors` (h_dec [n, H], h_cand [c, H], k [n], n_tokens [n] in the chunk's entry order),
    and the split is assembled from its files (one split in memory plus one chunk). Without it the chunks stay in
    memory. Either way the tensors are those of one pass over the same calls. `choice_orders`: "given" keeps one
    entry per row (`Recipe.choice_orders`). `precision` "bfloat16": a full backbone pass runs under bfloat16
    autocast (`rlcd.frozen_precision.lower_precision`); the layers above cut states always run as the model is.
    """
    entries = cache_entries(split, records, choice_orders)
    n = len(entries)
    was = model.training
    model.eval()
    from rlcd.model.decision import DecisionModel
    from rlcd.model.runner import CaseRunner

    runner = CaseRunner(model) if shared and cut_states is None and isinstance(model, DecisionModel) else None
    by_case = shared and (runner is not None or cut_states is not None)  # a case's rows in one call, one prefix
    shared = runner.case_features if runner is not None else None
    groups = entries_by_case(entries) if by_case else [[j] for j in range(n)]
    chunks = plan_chunks(groups, rows_per_call or ROWS_PER_CALL)
    digests = [chunk_digest(c, entries) for c in chunks]
    todo = [i for i, d in enumerate(digests) if partial is None or not partial.has(split, i, d, _CHUNK_SUFFIX)]
    done = n - sum(len(chunk_entries(chunks[i])) for i in todo)
    if done and progress:
        progress(done)
    kept: dict[int, dict[str, torch.Tensor]] = {}

    def features_of(call: list[list[int]]) -> list[tuple[int, torch.Tensor, torch.Tensor, int]]:
        """(entry, h_dec [H], h_cand [k, H], row tokens) of every entry of one call."""
        out = []
        if cut_states is not None:
            flat = [j for g in call for j in g]
            # each case a unit: its stored prefix runs once through the layers above the cut, its rows' suffixes on
            # it (2.6x fewer tokens than full rows on Gemma's 1k benchmark); a unit that cannot share runs as rows
            starts = list(itertools.accumulate((len(g) for g in call), initial=0))
            units = [list(range(a, b)) for a, b in zip(starts, starts[1:])] if by_case else None
            batch = cut_states.batch(split, [entries[j][0] for j in flat], [entries[j][1] for j in flat], units=units)
            d, cand = model.features(batch)
            for b, j in enumerate(flat):
                k = entries[j][0].question.k
                out.append((j, d[b].float().cpu(), cand[b, :k].float().cpu(),
                            int(batch.suffixes[b][0].shape[0]) + (int(batch.prefixes[batch.prefix_of[b]][0].shape[0])
                                                                  if batch.prefix_of[b] is not None else 0)))
        elif shared is not None:
            cases = [runner.cases.from_records([entries[j][0] for j in g], collator.image_root) for g in call]
            for g, c, feats in zip(call, cases, shared(cases)):
                for j, row, (d, cand) in zip(g, c.rows, feats):
                    out.append((j, d.float().cpu(), cand.float().cpu(), len(row)))
        else:
            flat = [j for g in call for j in g]
            batch = collator([entries[j][0] for j in flat])
            d, cand = model.features(batch)
            for b, j in enumerate(flat):
                k = entries[j][0].question.k
                out.append((j, d[b].float().cpu(), cand[b, :k].float().cpu(), int(batch.attention_mask[b].sum())))
        return out

    from rlcd.frozen_precision import lower_precision

    frozen = lower_precision(model, precision if cut_states is None else "float32")
    with _zero_lora_off(model) if lora_off else contextlib.nullcontext():
        for i in todo:
            rows = []
            for call in chunks[i]:
                with frozen:
                    rows.extend(features_of(call))
                done += sum(len(g) for g in call)
                if progress:
                    progress(done)
            t = {"h_dec": torch.stack([r[1] for r in rows]), "h_cand": torch.cat([r[2] for r in rows]),
                 "k": torch.tensor([r[2].shape[0] for r in rows], dtype=torch.long),
                 "n_tokens": torch.tensor([r[3] for r in rows], dtype=torch.long)}
            if partial is None:
                kept[i] = t
                continue
            from safetensors.torch import save_file

            save_file(t, str(partial.tmp(split, i, "safetensors")))
            partial.commit(split, i, digests[i], len(rows), _CHUNK_SUFFIX)
    model.train(was)

    def chunk(i: int, names: tuple[str, ...]) -> dict[str, Any]:
        """Tensors `names` of chunk `i` (and "hidden": its feature width)."""
        if partial is None:
            return {**kept[i], "hidden": kept[i]["h_dec"].shape[1]}
        from safetensors import safe_open

        path = partial.file(split, i, "safetensors")
        try:
            with safe_open(str(path), framework="pt") as f:
                return {**{name: f.get_tensor(name) for name in names}, "hidden": f.get_slice("h_dec").get_shape()[1]}
        except Exception as e:  # noqa: BLE001 - a chunk that cannot be read: name it
            raise RuntimeError(f"feature chunk {path} cannot be read ({e}); delete {partial.dir} and extract "
                               "again") from None

    hidden = int(model.head.hidden)
    js = [torch.tensor(chunk_entries(c), dtype=torch.long) for c in chunks]
    ks = torch.zeros(n, dtype=torch.long)
    for i in range(len(chunks)):
        meta = chunk(i, ("k",))
        ks[js[i]] = meta["k"]
        hidden = int(meta["hidden"])
    starts = torch.cumsum(ks, 0) - ks
    tensors = {"h_dec": torch.zeros((n, hidden)), "h_cand": torch.zeros((int(ks.sum()), hidden)),
               "cand_start": starts, "k": ks, "n_tokens": torch.zeros(n, dtype=torch.long)}
    for i in range(len(chunks)):
        t = chunk(i, ("h_dec", "h_cand", "n_tokens"))
        if t["h_dec"].shape != (len(js[i]), hidden) or t["h_cand"].shape[0] != int(ks[js[i]].sum()):
            raise RuntimeError(f"feature chunk {i} of {split} does not hold its entries "
                               f"({tuple(t['h_dec'].shape)}, {tuple(t['h_cand'].shape)})")
        tensors["h_dec"][js[i]] = t["h_dec"]
        tensors["n_tokens"][js[i]] = t["n_tokens"]
        rows = torch.cat([torch.arange(int(starts[j]), int(starts[j] + ks[j])) for j in js[i]]) if len(js[i]) else \
            torch.zeros(0, dtype=torch.long)
        tensors["h_cand"][rows] = t["h_cand"]
        kept.pop(i, None)
    return tensors, [[r.id, o] for r, o in entries]


def check_writable(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise OptionError(f"feature cache directory {root} is not writable ({e.strerror or e}); make it writable "
                          f"or run with --no-cache") from None


def ensure_features(model, data_dir: Path, *, progress: bool = True, say: Callable[[str], None] | None = None,
                    records: dict[str, list[Record]] | None = None, cut_states=None,
                    choice_orders: str = "balanced", precision: str = "float32") -> FeatureCache:
    """The cache of `model`'s frozen features over `data_dir`: loaded when a complete one with the same key
    exists, else extracted (all four splits) and published atomically. The extraction is resumable: its chunks
    are committed to `DATA/features/.partial-<KEY_ID>/` (`rlcd.partial`), a later call with the same key computes
    only the missing ones, and the directory is removed once the cache is published; a second extraction of the
    same key waits for the first. Dead `.tmp-*` directories of killed publications are removed first (an
    extraction in progress elsewhere keeps its own). `cut_states`: a cut-state cache this model matches
    (`rlcd.cut_cache.find_cut_states(any_cut=True)`), or a function that looks one up, called only when
    extraction is needed: extraction then runs only the layers above its cut. `choice_orders`: the candidate orders
    kept per train choice row (`Recipe.choice_orders`; in the key). `precision` (`Recipe.frozen_precision`):
    "bfloat16" reads only features of that precision -- from a bfloat16 cut-state cache (`cut_states` must be one
    of that precision) or the full backbone under bfloat16 autocast."""
    from safetensors.torch import save_file

    from rlcd.frozen_precision import check_precision

    say = say or (lambda _: None)
    data_dir = Path(data_dir)
    key = feature_key(model, data_dir, choice_orders=choice_orders, precision=check_precision(precision))
    root = cache_root(data_dir)
    found = FeatureCache.load(root / key_id(key), key) or _derived(key, root)
    if found is not None:
        drop_finished(root, found.root.name)
        say(f"features: reusing {found.root}" + (f" (computed from the cut states at layer {found.key['from_cut_states']['cut']})"
                                                 if "from_cut_states" in found.key else ""))
        return found
    if callable(cut_states):
        cut_states = cut_states()
    if cut_states is not None:
        if cut_states.key.get("precision", "float32") != precision:
            raise ValueError(f"cut states {cut_states.root} were computed in {cut_states.key.get('precision', 'float32')}, "
                             f"not in {precision}")
        key = {**key, "from_cut_states": cut_source(cut_states)}
        say(f"features: from the cut states {cut_states.root} (layers {cut_states.key['cut']}.."
            f"{model.num_layers - 1} run)")
    kid = key_id(key)
    final = root / kid
    check_writable(root)
    recs = split_records(data_dir, records)
    collator = model.collator(image_root=data_dir)
    with Partial(root, kid, key, ROWS_PER_CALL).held(say, "features") as partial:
        again = partial.published_meanwhile(lambda: FeatureCache.load(final, key), say, "features", final)
        if again is not None:
            return again
        resumed(partial, recs, "features", say, choice_orders)
        counts, tokens = {}, 0
        with building(root, final) as tmp:
            for split, split_recs, bar in each_split(recs, "features", progress, partial, choice_orders):
                with bar:
                    tensors, index = extract_split(model, split_recs, collator, split, progress=bar.update,
                                                   cut_states=cut_states, partial=partial, choice_orders=choice_orders,
                                                   precision=precision)
                save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / f"{split}.safetensors"))
                plain_mode(tmp / f"{split}.safetensors")  # safetensors writes 600 (rlcd.files)
                (tmp / f"{split}.index.json").write_text(json.dumps(index))
                counts[split] = len(index)
                tokens += int(tensors["n_tokens"].sum())
                del tensors
            seconds = partial.seconds()
            manifest = {"key": key, "key_id": kid, "complete": True, "splits": counts, "row_tokens": tokens,
                        "seconds": round(seconds, 3), "attempts": partial.attempts,
                        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        "shared_prefix": _shares_prefixes(model),
                        "from_cut_states": str(cut_states.root) if cut_states is not None else None}
            publish(tmp, final, manifest)
        partial.remove()
    out = FeatureCache.load(final, key)
    if out is None:
        raise RuntimeError(f"feature cache {final} could not be read back after writing it")
    say(f"features: {sum(counts.values())} entries ({tokens} row tokens) in {seconds:.1f} s"
        + (f" over {partial.attempts} attempts" if partial.attempts > 1 else "") + f" -> {final}")
    return out


def find_features(model, data_dir: Path) -> FeatureCache | None:
    """The complete cache for `model` over `data_dir` if one exists (never extracts): the full backbone's, else
    one computed from cut states (its key's `from_cut_states` says so); a `choice_orders=given` cache serves too
    (its held-out rows and every order-0 entry are the balanced cache's). Without a features directory nothing is
    hashed: evaluating a LoRA run pays no weights digest."""
    root = cache_root(Path(data_dir))
    if not root.is_dir():
        return None
    key = feature_key(model, Path(data_dir))
    found = FeatureCache.load(root / key_id(key), key) or _derived(key, root)
    if found is None:
        given = {**key, "orders": orders_scheme("given")}
        found = FeatureCache.load(root / key_id(given), given)
    return found


def remove_dead_tmp(root: Path) -> None:
    """Remove `.tmp-*` directories whose writer process is gone (a killed extraction). Names are
    `.tmp-<cache name>-<pid>-<random>` (`building`)."""
    for d in root.glob(".tmp-*"):
        try:
            pid = int(d.name.rsplit("-", 2)[1])
        except (IndexError, ValueError):
            pid = -1
        if pid > 0 and pid != os.getpid() and pid_alive(pid):
            continue
        shutil.rmtree(d, ignore_errors=True)


def fsync_files(d: Path) -> None:
    for f in d.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def split_records(data_dir: Path, records: dict[str, list[Record]] | None) -> dict[str, list[Record]]:
    """The records of the four splits: `records[split]` when given, else the data directory's file (no file: no
    rows)."""
    from rlcd.data.io import load_split

    out = {}
    for split in SPLITS:
        recs = (records or {}).get(split)
        if recs is None:
            recs = load_split(data_dir, split) if (data_dir / f"{split}.jsonl").is_file() else []
        out[split] = recs
    return out


def each_split(recs: dict[str, list[Record]], what: str, progress: bool, partial=None,
               choice_orders: str = "balanced"):
    """(split, its records, its progress bar, not yet entered) for the four splits in order; a bar starts at the
    entries `partial` (`rlcd.partial.Partial`) already holds."""
    from rlcd.progress import Progress

    for split in SPLITS:
        n = len(cache_entries(split, recs[split], choice_orders))
        start = min(n, partial.entries_done(split)) if partial is not None else 0
        yield split, recs[split], Progress(f"{what} {split}", n, unit="rows", start=start, enabled=progress and n > 0)


def resumed(partial, recs: dict[str, list[Record]], what: str, say: Callable[[str], None],
            choice_orders: str = "balanced") -> None:
    """Say what an earlier attempt left in `partial` (resumed from there), and which partials of other keys are
    kept beside it (never read for this key, never removed silently)."""
    done = partial.entries_done()
    if done:
        total = sum(len(cache_entries(s, r, choice_orders)) for s, r in recs.items())
        say(f"{what}: resuming {partial.dir}: {done} of {total} entries already extracted")
    others = partial.others()
    if others:
        say(f"{what}: {len(others)} partial extraction(s) of other keys kept in {partial.root} "
            f"({', '.join(d.name for d in others)}): resumed by an extraction with their key, else delete them")


def read_manifest(root: Path, key: dict | None = None) -> dict | None:
    """The manifest of the cache at `root` when `publish` completed it and (when given) it holds exactly `key`;
    else None (a missing, partial or foreign cache is never read)."""
    try:
        manifest = json.loads((root / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if not manifest.get("complete") or (key is not None and manifest.get("key") != key):
        return None
    if manifest.get("from_cut_states") and "from_cut_states" not in manifest.get("key", {}):
        return None  # built from cut states before the key said so: never read as the full backbone's
    return manifest


def _derived(model_key: dict[str, Any], root: Path) -> "FeatureCache | None":
    """A complete cache in `root` computed from cut states for `model_key` (the full-backbone key): its key is
    that key plus `from_cut_states`; the deepest cut when there are several. No cut-state cache is looked up."""
    found = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        m = read_manifest(d)
        key = (m or {}).get("key")
        if isinstance(key, dict) and "from_cut_states" in key and {
                k: v for k, v in key.items() if k != "from_cut_states"} == model_key:
            found.append((int(key["from_cut_states"]["cut"]), d, key))
    for _, d, key in sorted(found, key=lambda x: -x[0]):
        cache = FeatureCache.load(d, key)
        if cache is not None:
            return cache
    return None


@contextlib.contextmanager
def building(root: Path, final: Path):
    """A fresh temporary directory under `root` to build the cache that `publish` turns into `final`.

    `root` is checked writable first (one line, exit 2), dead temporaries of killed builds are removed, and
    whatever stands at `final` (incomplete, or another key under this name) is never read but rebuilt. On any
    error, a full disk or Ctrl-C included, the temporary directory is removed: nothing half-written stays."""
    check_writable(root)
    remove_dead_tmp(root)
    if final.exists():
        shutil.rmtree(final, ignore_errors=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish(tmp: Path, final: Path, manifest: dict) -> None:
    """Write `manifest` (what marks a cache complete) last, fsync every file, then rename `tmp` to `final` in one
    step: a reader sees a whole cache or none. Another process that published the same key first keeps its own."""
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    fsync_files(tmp)
    try:
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def cached_logits(model, cache: FeatureCache, split: str, records: Sequence[Record],
                  batch_size: int = 256) -> list[torch.Tensor]:
    """Per-record logits over its K candidates from cached features (given order), the head in eval mode."""
    out: list[torch.Tensor] = []
    dev = model.device
    with torch.no_grad():
        for i in range(0, len(records), batch_size):
            chunk = records[i:i + batch_size]
            h_dec, h_cand, mask = cache.rows(split, [(r.id, 0) for r in chunk])
            lg = model.head(h_dec.to(dev), h_cand.to(dev), mask.to(dev), update=False).float().cpu()
            out.extend(lg[j, : r.question.k] for j, r in enumerate(chunk))
    return out


__all__ = ["FeatureBatch", "FeatureCache", "ensure_features", "find_features", "feature_key", "key_id",
           "weights_digest", "cached_logits", "extract_split", "FEATURE_VERSION"]
