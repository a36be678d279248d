"""CaseRunner: cases in, logits and `Usage` out -- the one way to score cases with a `DecisionModel`.

The model is the nn.Module (backbone, LoRA, head, the training `forward`); the runner is what inference does with
it, as vLLM's model runner is to its model: it owns the plan of a call, both request caches' keys and lookups, the
prefix or full-row execution and the head call. Serving drives it through `rlcd.serving.runner.Runner`; evaluation
(`case_scoring`), feature and cut-state extraction (`rlcd.features`, `rlcd.cut_cache`) and the benches call it
directly.

A call (`score_cases`): the plan first (`plan.plan_paths`, once per call) sends a case through full forwards when
sharing saves less than one call's overhead (a single question, or a short shared prefix); otherwise the common
token prefix of each case's rows is run once (capped at the smallest decision position, so every row's decision
token is computed in its own suffix; several cases' prefixes left-padded into one forward), and the suffixes run
batched: one call when their lengths are similar, otherwise a few calls of similar-length rows
(`plan.plan_suffix_groups`: fewest padded tokens plus a per-call overhead; at most `max_rows` rows per call, on the
family's chunk grid). Each call gets the cache rows it needs from its own fork (the selected rows copied, so the
in-place recurrent-state updates of one call cannot reach the next); the last call takes them from the prefix cache
itself (`prefix_forward.cache_rows`). Then the head on every row at once.

The request caches (their store is serving's, `rlcd.serving.cache`; what an entry is, `rlcd.model.state_cache`):
with a state cache the prefix ends where the state ends, prefixes already stored skip the forward and new ones are
stored; the suffix calls then read a cache stacked from copies of every case's prefix state. A cold case that the
cache-off plan runs as full rows (one question) still runs as full rows when the decoder's cache is keys and values
only: the forward keeps its cache and the state's first positions are stored from it as they are (no second call, no
copy), so a cold request costs what it cost without the cache. With a row cache, rows answered before (the same
tokens, image and read positions) take their stored features and do not run.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Sequence

import torch

from ..schema import Question
from ..serving.cache import ScopedStateCache
from ..serving.runner import Usage
from .cases import CaseEncoder, CaseInputs
from .collate import pad_rows
from .decision import DecisionModel
from .plan import CALL_OVERHEAD, Plan, plan_paths, plan_suffix_groups, request_tokens
from .prefix_forward import left_pad, prefix_positions, read_states, run_prefixes, suffix_forward
from .prompt import EncodedRow
from .state_cache import (PrefixState, RowFeatures, image_digest, max_state_tokens, prefix_key, row_key,
                          snapshot_row, stack_states)

SHAPE_GRANULE = 16  # batched calls round their padded lengths up to this (right pads are never read)
Features = list[list[tuple[torch.Tensor, torch.Tensor]]]  # per case, per row: (h_dec [H], h_cand [k, H])


class CaseRunner:
    """Scores cases with `model` (module docstring); implements `rlcd.serving.runner.Runner`."""

    def __init__(self, model: DecisionModel):
        self.model = model
        self.cases = CaseEncoder.for_model(model)
        self._kv_only: bool | None = None
        self._max_state: tuple[int | None] | None = None

    # ------------------------------------------------------------------ the Runner surface
    @property
    def supports_images(self) -> bool:
        return self.model.supports_images

    @property
    def placement(self) -> dict[str, str]:
        return self.model.placement

    def eval(self) -> "CaseRunner":
        self.model.eval()
        return self

    def identity(self) -> dict[str, Any]:
        """What a cached state depends on: the model's info (prompt frame and version, LoRA and merge state, head),
        its placement, its parameters' count and in-place version counters (a weight loaded or changed in place moves
        them) and the model object itself."""
        params = list(self.model.parameters())
        return {"info": self.model.info, "placement": self.model.placement,
                "params": [len(params), sum(p._version for p in params)], "object": id(self.model)}

    def prepare_case(self, state: Any, questions: Sequence[Question], image: Any = None,
                     ids: Sequence[str] | None = None, *, case_id: str | None = None, max_tokens: int | None = None,
                     keyed: bool = False) -> CaseInputs:
        """`CaseEncoder.prepare`: the CPU part of scoring one case (no model call)."""
        return self.cases.prepare(state, questions, image, ids, case_id=case_id, max_tokens=max_tokens, keyed=keyed)

    def score_cases(self, cases: Sequence[CaseInputs], *, max_rows: int = 64, exact: bool = False, path: str = "auto",
                    state_cache: ScopedStateCache | None = None,
                    row_cache: ScopedStateCache | None = None) -> list[tuple[list[torch.Tensor], Usage]]:
        """Several cases in one go: `features` (prefixes in one left-padded forward, all question rows as suffix
        calls from that cache; or full forwards where the plan finds them cheaper), then the head on every row at
        once. Returns [(logits per question [k] float32 CPU, usage)].

        Each case's logits equal those it gets alone up to float noise: a prefix's left padding is masked
        (attention) and zeroed (the linear-attention inputs, so its recurrent and conv states stay at their initial
        zeros), positions are each case's own, and every suffix row reads its own case's cache row. `exact=True`
        (Qwen3.5; a no-op for text decoders) moves the prefix down to a multiple of the DeltaNet chunk (64) and runs
        the suffixes with the default chunk, so the recurrent state is accumulated over the same chunks as in a full
        forward: differences drop to plain-batching noise, at the cost of up to 63 extra tokens per row (the
        default's logits differ from full forwards by ~6e-6 relative on the random tiny preset). `state_cache`,
        `row_cache`: the request caches (`features`); same logits up to float noise."""
        feats, usages = self.features(cases, max_rows=max_rows, exact=exact, path=path, state_cache=state_cache,
                                      row_cache=row_cache)
        flat = [f for fs in feats for f in fs]
        if not flat:
            return [([], u) for u in usages]
        model = self.model
        with torch.inference_mode():
            kmax = max(hc.shape[0] for _, hc in flat)
            n, hidden = len(flat), flat[0][0].shape[-1]
            h_cand = flat[0][1].new_zeros((n, kmax, hidden))
            cmask = torch.zeros((n, kmax), dtype=torch.bool, device=model.device)
            for i, (_, hc) in enumerate(flat):
                h_cand[i, : hc.shape[0]] = hc
                cmask[i, : hc.shape[0]] = True
            lg = model.head(torch.stack([hd for hd, _ in flat]), h_cand, cmask, update=False).float().cpu()
        out, i = [], 0
        for fs, u in zip(feats, usages):
            out.append(([lg[i + j, : hc.shape[0]] for j, (_, hc) in enumerate(fs)], u))
            i += len(fs)
        return out

    # ------------------------------------------------------------------ features, plans, cut states
    def plan(self, cases: Sequence[CaseInputs], *, exact: bool = False, path: str = "auto",
             overhead: int = CALL_OVERHEAD, state_prefix: bool = False) -> Plan:
        """The call's plan (`plan.plan_paths`) with this model's chunk grid and state bound."""
        return plan_paths(cases, align=self.model.family.exact_align if exact else None, path=path, overhead=overhead,
                          state_prefix=state_prefix, max_state_tokens=self.max_state_tokens)

    def features(self, cases: Sequence[CaseInputs], *, max_rows: int = 64, exact: bool = False, path: str = "auto",
                 state_cache: ScopedStateCache | None = None,
                 row_cache: ScopedStateCache | None = None) -> tuple[Features, list[Usage]]:
        """Per case, per row: (h_dec [H], h_cand [k, H]), the last hidden states at the decision and marker positions
        (backbone dtype, on the model's device, inference mode), and per case its `Usage`.

        `state_cache`: prefixes end at the end of the state, are looked up there (a hit skips that prefix's forward
        and its image encoding) and stored after they run. `row_cache`: rows answered before take their stored
        features (`RowFeatures`) and do not run; a case none of whose rows runs runs nothing, not even its prefix.
        Usage and the plan stay what they are without them."""
        plan = self.plan(cases, exact=exact, path=path, state_prefix=state_cache is not None)
        run_len = list(plan.prefix_len)
        feats: list[list[Any]] = [[None] * len(c.rows) for c in cases]
        row_keys: list[list[Any]] = [[None] * len(c.rows) for c in cases]
        if row_cache is not None:
            for c, ks, fs in zip(cases, row_keys, feats):
                for j, r in enumerate(c.rows):
                    ks[j] = row_key(r.ids, _image_key(c), r.decision_pos, r.marker_pos, exact)
                    got = row_cache.get(ks[j])
                    if got is not None:
                        fs[j] = (got.h_dec, got.h_cand)
        todo = [[j for j, f in enumerate(fs) if f is None] for fs in feats]
        run = [c.subset(t) for c, t in zip(cases, todo)]  # what runs: each case's rows not answered before
        out = [fs if len(t) == len(fs) else [None] * len(t) for fs, t in zip(feats, todo)]
        keys: list[Any] = [None] * len(cases)
        warm: list[PrefixState | None] = [None] * len(cases)
        with torch.inference_mode():
            pre = [i for i, n in enumerate(run_len) if n is not None and cases[i].rows]
            keep, store = None, {}
            if state_cache is not None and pre:
                for i in pre:
                    keys[i] = prefix_key(cases[i].rows[0].ids[:run_len[i]], _image_key(cases[i]))
                    warm[i] = state_cache.get(keys[i])
                # a cold case the cache-off plan runs as full rows: full rows still, its state kept from their cache
                if path == "auto" and self.kv_only_cache:
                    store = {i: run_len[i] for i in pre if warm[i] is None and plan.off[i] is None}
                    for i in store:
                        run_len[i] = None
                    pre = [i for i in pre if i not in store]

                def keep(j: int, state: PrefixState) -> None:
                    state_cache.put(keys[pre[j]], state)
            full = [i for i, n in enumerate(run_len) if n is None and cases[i].rows and todo[i]]
            pre = [i for i in pre if todo[i]]  # `keep` reads it: the cases as passed below
            calls = 0
            if pre:
                calls += prefix_path(self.model, [run[i] for i in pre], [run_len[i] for i in pre],
                                     [out[i] for i in pre], max_rows=max_rows, exact=exact,
                                     warm=[warm[i] for i in pre], keep=keep)
            if full:
                calls += full_rows(self.model, [run[i] for i in full], [out[i] for i in full], max_rows=max_rows,
                                   keep={j: (store[i], lambda state, i=i: state_cache.put(keys[i], state))
                                         for j, i in enumerate(full) if i in store} or None)
            for i, t in enumerate(todo):
                for j, f in zip(t, out[i]):
                    feats[i][j] = f
                    if row_cache is not None:
                        h_dec, h_cand = f[0].clone(), f[1].clone()  # their own storage: a view keeps its batch
                        row_cache.put(row_keys[i][j], RowFeatures(h_dec, h_cand, h_dec.nbytes + h_cand.nbytes))
        usages = []
        for c, n, w, t in zip(cases, run_len, warm, todo):
            p = n or 0
            usages.append(Usage(input_tokens=request_tokens(c.rows), prefix_tokens=p,
                                cached_tokens=p if w is not None else 0, cached_rows=len(c.rows) - len(t),
                                rows=len(c.rows), full_tokens=sum(len(r) for r in c.rows), image_tokens=c.n_img,
                                calls=calls, batched_requests=len(cases), path="prefix" if n is not None else "full"))
        return feats, usages

    def case_features(self, cases: Sequence[CaseInputs], *, max_rows: int = 64, exact: bool = False,
                      path: str = "auto") -> Features:
        """`features` without caches or usage (feature extraction, benches); the head is not run."""
        return self.features(cases, max_rows=max_rows, exact=exact, path=path)[0]

    def cut_states(self, cases: Sequence[CaseInputs], layer: int, *, max_rows: int = 64
                   ) -> list[tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]]:
        """Per case: (prefix, rows) of the hidden states entering decoder layer `layer` -- what the cut-state cache
        stores. `prefix`: (states [p, H], positions [p, P]) of the shared prefix, or None when the case runs as full
        rows; `rows`: per row (states [n, H], positions [n, P]) of its tokens after the prefix. Float32, CPU.
        Computed as `features` would (prefix once, suffixes on its cache; the `exact` chunk grid), layers [0, layer)
        only, so the rest of the stack costs nothing."""
        plan = self.plan(cases, exact=True).prefix_len
        rows: list[list[Any]] = [[None] * len(c.rows) for c in cases]
        prefixes: list[Any] = [None] * len(cases)
        with torch.inference_mode():
            pre = [i for i, n in enumerate(plan) if n is not None and cases[i].rows]
            full = [i for i, n in enumerate(plan) if n is None and cases[i].rows]
            if pre:
                got: list[Any] = [None] * len(pre)
                prefix_path(self.model, [cases[i] for i in pre], [plan[i] for i in pre], [rows[i] for i in pre],
                            max_rows=max_rows, exact=True, at_layer=layer, prefixes=got)
                for i, g in zip(pre, got):
                    prefixes[i] = g
            if full:
                full_rows(self.model, [cases[i] for i in full], [rows[i] for i in full], max_rows=max_rows,
                          at_layer=layer)
        return list(zip(prefixes, rows))

    @property
    def kv_only_cache(self) -> bool:
        """Whether the decoder's cache holds keys and values alone (every layer full attention: the config's
        `layer_types`, or no `sliding_window` where it has none): then the first positions of a full forward's cache
        are exactly a prefix's state (a causal decoder's keys and values at a position depend on the tokens up to it
        only). Qwen3.5's linear-attention layers carry a recurrent state of the whole row instead."""
        if self._kv_only is None:
            cfg = self._text_config()
            kinds = getattr(cfg, "layer_types", None)
            self._kv_only = cfg is not None and (all(t == "full_attention" for t in kinds) if kinds  # transformers'
                                                 else not getattr(cfg, "sliding_window", None))
        return self._kv_only

    @property
    def max_state_tokens(self) -> int | None:
        """The longest prefix whose state the state cache can keep: `sliding_window - 1` when the decoder has
        sliding-window layers (they keep only their last `sliding_window - 1` positions: `state_cache.
        max_state_tokens`), None when every layer keeps every position."""
        if self._max_state is None:
            cfg = self._text_config()
            kinds = getattr(cfg, "layer_types", None)
            window = getattr(cfg, "sliding_window", None)
            sliding = any(t == "sliding_attention" for t in kinds) if kinds else bool(window)
            self._max_state = (int(window) - 1 if sliding and window else None,)
        return self._max_state[0]

    def _text_config(self) -> Any:
        return getattr(self.model.family.text_decoder(self.model.causal_lm()), "config", None)

    # ------------------------------------------------------------------ one request
    def score_case(self, state: Any, questions: Sequence[Question], image: Any = None,
                   ids: Sequence[str] | None = None, *, max_rows: int = 64, case_id: str | None = None,
                   exact: bool = False, path: str = "auto") -> tuple[list[torch.Tensor], Usage]:
        """One request: (logits over each question's K candidates, usage) -- `prepare_case` + `score_cases`."""
        questions = list(questions)
        if not questions:
            return [], Usage()
        case = self.prepare_case(state, questions, image, ids, case_id=case_id)
        return self.score_cases([case], max_rows=max_rows, exact=exact, path=path)[0]

    def score_full(self, state: Any, questions: Sequence[Question], image: Any = None,
                   ids: Sequence[str] | None = None, *, batch_size: int = 1) -> list[torch.Tensor]:
        """The reference: the same rows scored with full forwards (`batch_size` rows per forward)."""
        questions = list(questions)
        model, out = self.model, []
        with torch.inference_mode():
            pv, grid, n_img = self.cases.image(image)
            rows = self.cases.rows(state, questions, n_image_tokens=n_img, ids=ids)
            for c0 in range(0, len(rows), batch_size):
                chunk = rows[c0: c0 + batch_size]
                n = len(chunk)
                b = pad_rows(chunk, pad_id=model.encoder.pad_id, image_pad_id=model.encoder.image_pad_id,
                             types=[q.type for q in questions[c0: c0 + n]],
                             pixel_values=None if pv is None else torch.cat([pv] * n),
                             image_grid_thw=None if grid is None else grid.repeat(n, 1))
                h_dec, h_cand = model.features(b)
                lg = model.head(h_dec, h_cand, b.cand_mask.to(h_dec.device), update=False)
                out.extend(lg[i, : r.k].float().cpu() for i, r in enumerate(chunk))
        return out

    def n_tokens(self, state: Any, questions: Sequence[Question], image_tokens: int = 0) -> dict:
        """Token counts of a request without running the model: {input_tokens, full_tokens, prefix_tokens, rows,
        path} (`path`: the one `score_case` takes; prefix_tokens is 0 on the full path)."""
        rows = self.cases.rows(state, list(questions), n_image_tokens=image_tokens)
        n = self.plan([CaseInputs(rows, n_img=image_tokens)]).prefix_len[0]
        return {"input_tokens": request_tokens(rows), "prefix_tokens": n or 0, "full_tokens": sum(len(r) for r in rows),
                "rows": len(rows), "path": "prefix" if n is not None else "full"}


def _image_key(case: CaseInputs) -> str | None:
    """The request caches' key of the case's image (`state_cache.image_digest`), kept on the case once computed
    (`CaseEncoder.prepare(keyed=True)` computes it before, off the model thread); None without an image."""
    if case.pixel_values is not None and case.image_digest is None:
        case.image_digest = image_digest(case.pixel_values, case.grid)
    return case.image_digest


# ---------------------------------------------------------------------------------------------- the executions
def _states_row(h: torch.Tensor, pos: torch.Tensor, i: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row i's hidden states [end - start, H] (float32, CPU) and per-token positions [end - start, P] from a
    call's states [B, T, H] and its positions ([B, T], or [P, B, T] for M-RoPE)."""
    p = pos[i, start:end, None] if pos.dim() == 2 else pos[:, i, start:end].T
    return h[i, start:end].float().cpu().clone(), p.to(torch.int32).cpu().clone()


def prefix_path(model: DecisionModel, cases: Sequence[CaseInputs], lens: Sequence[int], out: list[list[Any]], *,
                max_rows: int, exact: bool, at_layer: int | None = None, prefixes: list[Any] | None = None,
                warm: Sequence[PrefixState | None] | None = None, keep: Callable[[int, PrefixState], None] | None = None
                ) -> int:
    """One left-padded forward of the cases' prefixes (`lens` tokens each), then the suffix calls
    (`prefix_forward`); fills `out` with each row's (h_dec, h_cand); returns the call count. `at_layer` (a decoder
    layer): instead, the states entering that layer -- each case's prefix into `prefixes`, each row's suffix into
    `out` (`_states_row`).

    The state cache: `warm[i]`, a stored `PrefixState` of case i's prefix, replaces its part of the prefix forward
    (which then runs for the other cases only, or not at all); `keep(i, state)` receives the state of every prefix
    computed here (`snapshot_row`: a lone prefix's keys and values as they are). With a warm case the suffix calls
    read a cache stacked from every case's state (`state_cache.stack_states`: copies, except a lone unpadded state's
    keys and values, which the forward only reads), padded and masked as the forward's own. A cold prefix longer than
    a stored state can be (`state_cache.max_state_tokens`: a sliding window) leaves no state to stack: with warm cases
    beside it, it runs as a batch of its own (its forward and suffix calls), the others as one."""
    layers = (0, at_layer) if at_layer is not None else None
    dev, family = model.device, model.family
    warm = list(warm) if warm is not None else [None] * len(cases)
    cold = [i for i, w in enumerate(warm) if w is None]
    if prefixes is not None and len(cold) < len(cases):
        raise ValueError("cut states are computed, never read from the state cache")
    limit = next((max_state_tokens(w) for w in warm if w is not None), None)
    long = [i for i in cold if limit is not None and lens[i] > limit]
    if long:  # past a sliding window a cold prefix keeps no state to stack with stored ones: it runs apart
        parts = (long, [i for i in range(len(cases)) if i not in long])
        return sum(prefix_path(model, [cases[i] for i in p], [lens[i] for i in p], [out[i] for i in p],
                               max_rows=max_rows, exact=exact, at_layer=at_layer, warm=[warm[i] for i in p],
                               keep=None if keep is None else (lambda j, st, p=p: keep(p[j], st))) for p in parts)
    positions = [prefix_positions(model, c.rows[0].ids[:n], c.grid) for c, n in zip(cases, lens)]
    next_pos = [int(pos.max()) + 1 for pos in positions]
    calls, prefix_cache, width, pmask = 0, None, 0, None
    if cold:
        width = max(lens[i] for i in cold)
        padded = any(lens[i] != width for i in cold)
        if padded:  # few distinct shapes keep the allocator's and kernels' caches small under serving load
            width = -(-width // SHAPE_GRANULE) * SHAPE_GRANULE
        feats = [model.image_features(cases[i].pixel_values, cases[i].grid) for i in cold
                 if cases[i].pixel_values is not None]  # once per request
        pids, pmask, all_pos = left_pad(model, [cases[i].rows[0].ids[:lens[i]] for i in cold],
                                        [positions[i] for i in cold], width)
        o, prefix_cache = run_prefixes(model, pmask if padded else None, all_pos, ids=pids,
                                       image_features=torch.cat(feats) if feats else None, layers=layers)
        calls += 1
        if prefixes is not None:
            for j, i in enumerate(cold):
                prefixes[i] = _states_row(o.last_hidden_state, all_pos, j, width - lens[i], width)
    if keep is not None or len(cold) < len(cases):
        states = list(warm)
        for j, i in enumerate(cold):
            states[i] = snapshot_row(prefix_cache, j, width - lens[i])
            if keep is not None and states[i] is not None:
                keep(i, states[i])
        if len(cold) < len(cases):
            if any(s is None for s in states):
                raise RuntimeError("a cold prefix's cache cannot be batched with cached states")
            width = max(lens)
            if any(n != width for n in lens):
                width = -(-width // SHAPE_GRANULE) * SHAPE_GRANULE
            prefix_cache = stack_states(states, width)
            pmask = torch.zeros((len(cases), width), dtype=torch.long, device=dev)
            for i, n in enumerate(lens):
                pmask[i, width - n:] = 1

    # a causal decoder's reads end at a row's last marker: what follows it (its newline) is never run,
    # except when the states themselves are the output (`at_layer`: cut states keep whole rows)
    def run_len(r: EncodedRow) -> int:
        return len(r) if at_layer is not None else r.marker_pos[-1] + 1

    flat = [(ci, ri) for ci, c in enumerate(cases) for ri in range(len(c.rows))]
    groups = plan_suffix_groups([run_len(cases[ci].rows[ri]) - lens[ci] for ci, ri in flat], max_rows=max_rows,
                                granule=family.suffix_chunk or 1)
    for gi, group in enumerate(groups):
        members = [flat[j] for j in group]
        chunk = [cases[ci].rows[ri] for ci, ri in members]
        owner = torch.tensor([ci for ci, _ in members], dtype=torch.long, device=dev)
        n = len(chunk)
        # the linear-attention states are advanced in place: every call but the last gets its own rows; the last
        # reads the prefix cache itself (as it is when its rows are in order: one question per case, e.g. warm ones)
        rows = "fork" if gi < len(groups) - 1 else (
            "as_is" if [ci for ci, _ in members] == list(range(len(cases))) else "select")
        suf = [r.ids[lens[ci]: run_len(r)] for r, (ci, _) in zip(chunk, members)]
        s_max = max(len(x) for x in suf)
        if len(cases) > 1:
            s_max = -(-s_max // SHAPE_GRANULE) * SHAPE_GRANULE
        sids = torch.full((n, s_max), model.encoder.pad_id, dtype=torch.long, device=dev)
        smask = torch.zeros((n, s_max), dtype=torch.long, device=dev)
        for i, x in enumerate(suf):
            sids[i, : len(x)] = torch.tensor(x, dtype=torch.long, device=dev)
            smask[i, : len(x)] = 1
        pos = torch.cat([family.suffix_positions(1, s_max, next_pos[ci], dev) for ci, _ in members], dim=-2)
        h = suffix_forward(model, prefix_cache, pmask, owner, smask, pos, ids=sids, rows=rows, layers=layers,
                           chunk_size=None if exact else family.suffix_chunk)
        for i, (r, (ci, ri)) in enumerate(zip(chunk, members)):
            p = lens[ci]
            if at_layer is not None:
                out[ci][ri] = _states_row(h, pos, i, 0, len(r) - p)
            else:
                out[ci][ri] = (h[i, r.decision_pos - p].clone(),  # a copy: a view would keep all of h alive
                               h[i, torch.tensor([m - p for m in r.marker_pos], dtype=torch.long, device=dev)])
    return calls + len(groups)


def _kept_cache(config: Any) -> Any:
    """A DynamicCache for one forward whose layers keep their first keys and values as the attention computed them
    (new tensors, only read afterwards) instead of concatenating them onto an empty tensor: the cache a full forward
    returns then costs no copy and no extra allocation (a cold request with the state cache on, issue 58). The
    layers stay transformers' `DynamicLayer`s (`state_cache.SUPPORTED_LAYERS`); the override is per instance and
    removed after the forward (`_unkept`)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    def keep_first(layer: Any, keys: torch.Tensor, values: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if layer.is_initialized:
            return DynamicLayer.update(layer, keys, values, *args, **kwargs)
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        return keys, values

    cache = DynamicCache(config=config)
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            layer.update = types.MethodType(keep_first, layer)
    return cache


def _unkept(cache: Any) -> None:
    for layer in cache.layers:
        vars(layer).pop("update", None)


def full_rows(model: DecisionModel, cases: Sequence[CaseInputs], out: list[list[Any]], *, max_rows: int,
              at_layer: int | None = None, keep: dict[int, tuple[int, Any]] | None = None) -> int:
    """Full forwards of the cases' rows (right padded, grouped by length); fills `out`; returns the call count.
    `at_layer`: instead of the features, every row's states entering that layer and their positions (`_states_row`).
    `keep` {case index: (prefix_len, put)}: that case's forward keeps its cache and `put` receives the state of its
    first `prefix_len` positions (`snapshot_row`: the forward's own keys and values, not copied, when its row runs
    alone) -- what the prefix path would have stored, at no second call."""
    flat = [(ci, ri) for ci, c in enumerate(cases) for ri in range(len(c.rows))]
    groups = plan_suffix_groups([len(cases[ci].rows[ri]) for ci, ri in flat], max_rows=max_rows,
                                granule=model.family.exact_align or 1)
    for group in groups:
        members = [flat[j] for j in group]
        chunk = [cases[ci].rows[ri] for ci, ri in members]
        pvs = [cases[ci].pixel_values for ci, _ in members if cases[ci].pixel_values is not None]
        grids = [cases[ci].grid for ci, _ in members if cases[ci].pixel_values is not None]
        b = pad_rows(chunk, pad_id=model.encoder.pad_id, image_pad_id=model.encoder.image_pad_id,
                     pixel_values=torch.cat(pvs) if pvs else None, image_grid_thw=torch.cat(grids) if grids else None)
        if at_layer is not None:
            h = model.hidden_states(b, layers=(0, at_layer))
            pos = model.family.full_positions(b.input_ids.to(model.device), b.mm_token_type_ids.to(model.device),
                                              b.image_grid_thw, model.merge_size)
            for i, (r, (ci, ri)) in enumerate(zip(chunk, members)):
                out[ci][ri] = _states_row(h, pos, i, 0, len(r))
            continue
        stored = {ci: (i, keep.pop(ci)) for i, (ci, _) in enumerate(members) if keep and ci in keep}
        if stored:
            cache = _kept_cache(model.family.text_decoder(model.causal_lm()).config)
            try:
                h = model.hidden_states(b, cache=cache)
            finally:
                _unkept(cache)
            h_dec, h_cand = read_states(h, b.decision_pos, b.marker_pos)
            for i, (n, put) in stored.values():  # once per case (its first row here): the others only read
                state = snapshot_row(cache, i, 0, n)
                if state is not None:
                    put(state)
        else:
            h_dec, h_cand = model.features(b)
        for i, (r, (ci, ri)) in enumerate(zip(chunk, members)):
            out[ci][ri] = (h_dec[i], h_cand[i, : r.k])
    return len(groups)


__all__ = ["CaseRunner", "Features", "SHAPE_GRANULE", "full_rows", "prefix_path"]
