"""The cross-request state cache: warm answers equal cold ones, keys never cross, the byte bound holds.

The reference is always a Predictor with the cache off (`state_cache_mb=0`) on the same model: what a
cached prefix must not change. Tolerance 1e-4 in probability, as for batching; the measured differences
are float noise (~1e-7).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from _tiny_export import TEMPERATURES, build_tiny_model, tiny_predictor  # noqa: E402
from conftest import answer_gap  # noqa: E402

from rlcd.model.state_cache import PrefixState, snapshot_row  # noqa: E402
from rlcd.serving.cache import StateCache  # noqa: E402
from rlcd.predict import Predictor, _cache_scope  # noqa: E402
from rlcd.model.runner import CaseRunner  # noqa: E402

TOL = 1e-4
LONG = ("Order 5521: the parcel arrived two weeks late, the box was crushed, two of the three plates inside "
        "were broken and the courier left it in the rain. The customer wrote twice and called once; nobody "
        "answered. She wants a refund for the plates and the shipping, and says she will not order again.")
SHORT = "Invoice 1193 was paid twice by bank transfer and the customer asks for one payment back."
Q = {
    "dept": {"type": "choice", "instructions": "Which department handles this?",
             "criteria": ["billing", "shipping", "returns", "sales"]},
    "chan": {"type": "choice", "instructions": "Pick the channel",
             "criteria": {"email": "written message", "phone": "a call", "chat": "live chat"}},
    "angry": {"type": "noul", "instructions": "Is the customer angry?"},
    "late": {"type": "noul", "instructions": "Was the parcel late?", "criteria": {"false": "on time", "true": "late"}},
    "urgency": {"type": "score", "instructions": "How urgent is it?",
                "criteria": ["not urgent", "somewhat", "urgent", "critical"]},
    "worth": {"type": "score", "instructions": "How much is at stake?", "criteria": ["little", "some", "a lot"]},
}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Predictor:
    return tiny_predictor(tmp_path_factory.getbasetemp())


def _pair(base: Predictor, mb: float = 64) -> tuple[Predictor, Predictor]:
    """(with a fresh cache, without one) on the same loaded model."""
    return (Predictor(base.model, base.meta, name=base.name, state_cache_mb=mb),
            Predictor(base.model, base.meta, name=base.name, state_cache_mb=0))


@pytest.fixture(scope="module")
def pngs(tmp_path_factory) -> tuple[Path, Path]:
    from PIL import Image

    root = tmp_path_factory.mktemp("sc-img")
    out = []
    for k, (w, h) in enumerate([(40, 28), (40, 28)]):  # the same size: the same image tokens, other pixels
        im = Image.new("RGB", (w, h))
        for x in range(w):
            for y in range(h):
                im.putpixel((x, y), ((x * 6 + 90 * k) % 256, (y * 9 * (k + 1)) % 256, (x * y + 50 * k) % 256))
        out.append(root / f"im{k}.png")
        im.save(out[-1])
    return out[0], out[1]



def _req(state, *qids):
    return {"state": state, "questions": {q: Q[q] for q in qids}}


# --------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("with_image", [False, True])
def test_a_new_question_about_a_cached_state_gets_the_cold_answer(base, pngs, with_image):
    warm, cold = _pair(base)
    image = pngs[0] if with_image else None
    first = warm.predict(_req(LONG, "angry"), image)
    assert warm.state_cache_stats()["entries"] == 1 and warm.state_cache_stats()["misses"] == 1
    assert answer_gap(first, cold.predict(_req(LONG, "angry"), image)) < TOL
    for qids in (("dept",), ("urgency",), ("late",), ("chan", "worth", "angry"), tuple(Q)):  # every type, 1 and n
        hits = warm.state_cache_stats()["hits"]
        got, want = warm.predict(_req(LONG, *qids), image), cold.predict(_req(LONG, *qids), image)
        assert warm.state_cache_stats()["hits"] == hits + 1, qids  # the prefix came from the cache
        assert answer_gap(got, want) < TOL, qids
        assert got["usage"] == want["usage"]  # usage counts the request's tokens, cached or not
        for q in qids:
            if Q[q]["type"] == "choice":
                assert got["answers"][q]["choice"] == want["answers"][q]["choice"]
    assert warm.state_cache_stats()["entries"] == 1


def test_a_warm_answer_is_the_same_answer_every_time(base, pngs):
    """A lone request reads the same stored state each time: bit-identical answers, the cold one included."""
    warm, _ = _pair(base)
    for image in (None, pngs[1]):
        req = _req(LONG, "dept", "angry", "urgency")
        first = warm.predict(req, image)
        assert all(warm.predict(req, image) == first for _ in range(3))


def test_mixed_warm_and_cold_cases_in_one_batch(base, pngs):
    """One `score_many` call holding warm and cold states, text and images, one and several questions,
    different prefix lengths (left padding), and the same cold state twice: each request's answers equal
    its cold answers alone."""
    warm, cold = _pair(base)
    im0, im1 = pngs
    warm.predict(_req(LONG, "angry"))
    warm.predict(_req(SHORT + " " + LONG, "dept"))
    warm.predict(_req(LONG, "late"), im0)
    batch = [
        (_req(LONG, "dept", "urgency"), None),  # warm
        (_req(LONG + " Again.", "angry"), None),  # cold, a longer prefix
        (_req(SHORT + " " + LONG, "worth"), None),  # warm, another length
        (_req(LONG, "chan", "late", "urgency"), im0),  # warm image
        (_req(LONG, "chan", "late"), im1),  # cold: the same state and image size, another image
        (_req(LONG + " Again.", "dept"), None),  # the same cold state twice in one batch
        (_req(SHORT, *Q), None),  # cold, many questions
    ]
    expect_hits = 3
    hits = warm.state_cache_stats()["hits"]
    prepared = [warm.prepare(r, img) for r, img in batch]
    results = warm.score_many(prepared)
    assert warm.state_cache_stats()["hits"] == hits + expect_hits
    for (req, img), p, (logits, usage) in zip(batch, prepared, results):
        got = warm.respond(p, logits, usage)
        assert answer_gap(got, cold.predict(req, img)) < TOL, req["state"][:20]
    # and the same batch again, now every state warm
    results = warm.score_many([warm.prepare(r, img) for r, img in batch])
    assert warm.state_cache_stats()["hits"] == hits + expect_hits + len(batch)
    for (req, img), p, (logits, usage) in zip(batch, prepared, results):
        assert answer_gap(warm.respond(p, logits, usage), cold.predict(req, img)) < TOL


def test_another_image_never_hits(base, pngs):
    warm, cold = _pair(base)
    im0, im1 = pngs
    req = _req(LONG, "dept", "angry", "urgency")
    a, b = cold.predict(req, im0), cold.predict(req, im1)
    assert answer_gap(a, b) > 1e-3  # the images change the answers, so a wrong hit would show
    warm.predict(req, im0)
    misses = warm.state_cache_stats()["misses"]
    assert answer_gap(warm.predict(req, im1), b) < TOL
    assert warm.state_cache_stats()["misses"] == misses + 1
    assert answer_gap(warm.predict(req), cold.predict(req)) < TOL  # nor does the same state without an image


def test_stored_states_are_never_changed_by_later_calls(base, pngs):
    """The suffix calls advance their cache in place (Qwen3.5's conv and recurrent states): they must work on
    copies, never on the stored tensors."""
    warm, _ = _pair(base)
    warm.predict(_req(LONG, "angry"), pngs[0])
    (key,) = warm.state_cache.keys()
    stored = warm.state_cache._entries[key].cache

    def tensors(cache):
        out = []
        for layer in cache.layers:
            for name in ("keys", "values"):
                if isinstance(getattr(layer, name, None), torch.Tensor):
                    out.append(getattr(layer, name).clone())
            for name in ("conv_states", "recurrent_states"):
                for v in (getattr(layer, name, None) or {}).values():
                    if isinstance(v, torch.Tensor):
                        out.append(v.clone())
        return out

    before = tensors(stored)
    assert before and any(t.dim() == 3 for t in before)  # conv states are there to be checked
    for qids in (tuple(Q), ("dept",), ("angry", "late")):
        warm.predict(_req(LONG, *qids), pngs[0])
        warm.score_many([warm.prepare(_req(LONG, *qids), pngs[0]), warm.prepare(_req(SHORT, "dept"))])
    after = tensors(stored)
    assert all(torch.equal(x, y) for x, y in zip(before, after))


@pytest.mark.parametrize("layer,window", [("DynamicLayer", None), ("LinearAttentionAndFullAttentionLayer", None),
                                          ("DynamicSlidingWindowLayer", 16), ("DynamicSlidingWindowLayer", 6)])
def test_transformers_cache_update_never_writes_into_lent_keys(layer, window):
    """`stack_states` lends a lone state's keys and values to the forward uncopied, on the word of the cache
    layers' `update` (it concatenates into a new tensor; the sliding-window layer then keeps a view of the new
    tensor's last positions, here within and past its window). If a transformers release starts writing into
    them, this fails before a stored state is silently changed."""
    import transformers.cache_utils as cu

    from rlcd.model.state_cache import SUPPORTED_LAYERS

    assert layer in SUPPORTED_LAYERS
    lay = getattr(cu, layer)(**({"sliding_window": window} if window else {}))
    keys, values = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    lay.lazy_initialization(keys, values)
    lay.keys, lay.values = keys, values
    if window:
        lay.cumulative_length = 5
    before = keys.clone(), values.clone()
    for _ in range(2):  # and again, onto what the first update kept
        k, v = lay.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
        assert k.data_ptr() != keys.data_ptr() and v.data_ptr() != values.data_ptr()
        assert torch.equal(keys, before[0]) and torch.equal(values, before[1])
    assert k.shape[-2] == (11 if not window or window > 8 else window - 1 + 3)


def test_stack_states_lends_a_lone_state_and_pads_a_batch_with_one_copy():
    from rlcd.model.state_cache import stack_states

    model = build_tiny_model(model_spec="tiny-llama")
    warm = Predictor(model, {"model": "tiny-llama", "temperatures": dict(TEMPERATURES)}, state_cache_mb=64)
    for state in (LONG, SHORT):
        warm.predict(_req(state, "angry"))
    a, b = (warm.state_cache._entries[k] for k in warm.state_cache.keys())
    lone = stack_states([a], a.tokens)
    assert all(x.keys is y.keys and x.values is y.values for x, y in zip(lone.layers, a.cache.layers))
    width = max(a.tokens, b.tokens) + 3
    both = stack_states([a, b], width)
    for li, layer in enumerate(both.layers):
        for i, s in enumerate((a, b)):
            got, want = layer.keys[i], s.cache.layers[li].keys[0]
            assert torch.equal(got[:, width - s.tokens:], want) and not got[:, : width - s.tokens].any()
            assert got.data_ptr() != want.data_ptr()
    padded = stack_states([a], a.tokens + 2)
    assert padded.layers[0].keys.data_ptr() != a.cache.layers[0].keys.data_ptr()


def test_text_decoder_family_warm_equals_cold():
    """A text decoder (tiny-llama: keys and values only, a chat-template head in the prefix)."""
    model = build_tiny_model(model_spec="tiny-llama")
    meta = {"model": "tiny-llama", "temperatures": dict(TEMPERATURES)}
    warm = Predictor(model, meta, state_cache_mb=64)
    cold = Predictor(model, meta, state_cache_mb=0)
    warm.predict(_req(LONG, "angry"))
    (stored,) = (warm.state_cache._entries[k].cache for k in warm.state_cache.keys())
    before = [(layer.keys.clone(), layer.values.clone()) for layer in stored.layers]
    for qids in (("dept",), ("urgency", "late"), tuple(Q)):
        assert answer_gap(warm.predict(_req(LONG, *qids)), cold.predict(_req(LONG, *qids))) < TOL
    assert warm.state_cache_stats()["hits"] == 3
    # a lone warm question reads the stored keys and values uncopied: they are as they were
    assert all(torch.equal(k, layer.keys) and torch.equal(v, layer.values)
               for (k, v), layer in zip(before, stored.layers))
    batch = [(_req(LONG, "worth"), None), (_req(SHORT, "dept", "chan"), None), (_req(LONG + " More.", "angry"), None)]
    results = warm.score_many([warm.prepare(r, i) for r, i in batch])
    for (req, img), (logits, usage) in zip(batch, results):
        assert answer_gap(warm.respond(warm.prepare(req, img), logits, usage), cold.predict(req, img)) < TOL


def test_a_cold_question_costs_what_it_cost_without_the_cache():
    """Issue 58: a cold single question with the cache on ran the prefix path (two calls) and copied its state,
    1.13x-1.17x the cache-off time. On a keys-and-values decoder it now runs as the cache-off plan does (one
    full forward: the same answer bit for bit) and keeps its state from that forward's own cache, uncopied; the
    next question about the state is warm and gets the cold answer."""
    model = build_tiny_model(model_spec="tiny-llama")
    assert CaseRunner(model).kv_only_cache
    meta = {"model": "tiny-llama", "temperatures": dict(TEMPERATURES)}
    warm = Predictor(model, meta, state_cache_mb=64)
    cold = Predictor(model, meta, state_cache_mb=0)
    for state in (LONG, SHORT + " " + LONG):
        case = warm.prepare(_req(state, "angry")).case
        (_, usage), = CaseRunner(model).score_cases([case], state_cache=StateCache(64 << 20).scoped("probe"))
        (_, off), = CaseRunner(model).score_cases([case])
        assert usage["calls"] == off["calls"] == 1 and usage["path"] == off["path"] == "full"
        assert warm.predict(_req(state, "angry")) == cold.predict(_req(state, "angry")), "the cache-off answer"
    stats = warm.state_cache_stats()
    assert stats["misses"] == 2 and stats["stores"] == 2 and stats["hits"] == 0
    for key in warm.state_cache.keys():
        stored = warm.state_cache._entries[key]
        layer = stored.cache.layers[0]
        assert layer.keys.shape[-2] == stored.tokens and not layer.keys.is_contiguous(), "a view of the forward's keys"
        assert stored.nbytes == sum(t.untyped_storage().nbytes() for lay in stored.cache.layers
                                    for t in (lay.keys, lay.values))
    for qids in (("dept",), ("urgency", "late")):
        hits = warm.state_cache_stats()["hits"]
        assert answer_gap(warm.predict(_req(LONG, *qids)), cold.predict(_req(LONG, *qids))) < TOL
        assert warm.state_cache_stats()["hits"] == hits + 1


def test_a_cold_case_of_several_rows_run_as_full_rows_stores_its_state_once():
    """Two questions about a short state: the cache-off plan runs them as full rows (sharing saves less than a
    call), the cache-on plan would take the prefix path to store the state. They run as full rows, in one call,
    the state is stored once, and the next request about it is warm and gets the cold answers."""
    from rlcd.model.plan import CALL_OVERHEAD

    model = build_tiny_model(model_spec="tiny-llama")
    meta = {"model": "tiny-llama", "temperatures": dict(TEMPERATURES)}
    warm = Predictor(model, meta, state_cache_mb=64)
    cold = Predictor(model, meta, state_cache_mb=0)
    words = LONG.split()
    for n in range(1, len(words)):
        state = " ".join(words[:n])
        case = warm.prepare(_req(state, "angry", "late")).case
        plan = CaseRunner(model).plan([case], state_prefix=True)
        on, off = plan.prefix_len[0], plan.off[0]
        if on is not None and off is None:
            break
    else:
        pytest.fail("no state length where only the cache-on plan shares the prefix")
    assert on * 2 > CALL_OVERHEAD
    (_, usage), = CaseRunner(model).score_cases([case], state_cache=StateCache(64 << 20).scoped("probe"))
    assert usage["path"] == "full" and usage["calls"] == 1 and usage["cached_tokens"] == 0
    assert warm.predict(_req(state, "angry", "late")) == cold.predict(_req(state, "angry", "late"))
    assert warm.state_cache_stats()["stores"] == 1
    assert answer_gap(warm.predict(_req(state, "dept", "worth")), cold.predict(_req(state, "dept", "worth"))) < TOL
    assert warm.state_cache_stats()["hits"] == 1


# --------------------------------------------------------------------------------------- keys
def test_changed_lora_weights_or_a_merge_never_hit():
    """The scope follows the model as it is: weights changed in place or LoRA merged is a new scope."""
    model = build_tiny_model()
    meta = {"model": "tiny-toy", "temperatures": dict(TEMPERATURES)}
    warm = Predictor(model, meta, state_cache_mb=64)
    cold = Predictor(model, meta, state_cache_mb=0)
    req = _req(LONG, "dept", "angry", "urgency")
    before = cold.predict(req)
    warm.predict(req)
    sd = model.trainable_state_dict()
    model.load_trainable_state_dict({k: v * 3 if "lora_B" in k else v for k, v in sd.items()})
    changed = cold.predict(req)
    assert answer_gap(before, changed) > 1e-3  # the new weights change the answers, so a wrong hit would show
    misses = warm.state_cache_stats()["misses"]
    assert answer_gap(warm.predict(req), changed) < TOL
    assert warm.state_cache_stats()["misses"] == misses + 1
    model.merge()
    assert answer_gap(warm.predict(req), cold.predict(req)) < TOL
    assert warm.state_cache_stats()["misses"] == misses + 2


def test_scopes_differ_by_model_export_and_frame(base):
    other = build_tiny_model(seed=1)
    llama = build_tiny_model(model_spec="tiny-llama")
    scopes = {_cache_scope(base.runner, base.meta), _cache_scope(CaseRunner(other), base.meta),
              _cache_scope(CaseRunner(llama), base.meta),
              _cache_scope(base.runner, {**base.meta, "checkpoint_sha256": "0" * 64})}
    assert len(scopes) == 4
    assert _cache_scope(base.runner, base.meta) == _cache_scope(base.runner, dict(base.meta))  # and is stable
    assert _cache_scope(base.runner, base.meta) == _cache_scope(CaseRunner(base.model), base.meta)  # the model's


def test_one_cache_shared_by_two_models_never_crosses(base):
    """Even one StateCache under two models' scopes: the same request on each misses, and each answer is
    its own model's cold answer."""
    other = build_tiny_model(seed=1)
    shared = StateCache(64 << 20)
    from rlcd.schema import Question

    q = Question(type="choice", instructions="Which department?", criteria=["billing", "shipping"])
    for m in (base.model, other):
        runner = CaseRunner(m)
        case = runner.prepare_case(LONG, [q], None, ["dept"])
        runner.score_cases([case], state_cache=shared.scoped(_cache_scope(runner, base.meta)))
    assert shared.stats()["misses"] == 2 and shared.stats()["hits"] == 0 and shared.stats()["entries"] == 2


# --------------------------------------------------------------------------------------- LRU
def _state(nbytes: int) -> PrefixState:
    return PrefixState(cache=None, tokens=1, nbytes=nbytes)


def test_lru_bound_order_and_counters():
    c = StateCache(100)
    assert c.put("a", _state(40)) and c.put("b", _state(40))
    assert c.get("a") is not None  # a is now the most recent: b goes first
    assert c.put("c", _state(40))
    assert c.keys() == ["a", "c"] and c.stats()["evictions"] == 1 and c.stats()["bytes"] == 80
    assert c.get("b") is None
    assert not c.put("huge", _state(101))  # larger than the bound: not stored, nothing evicted
    assert c.keys() == ["a", "c"] and c.stats()["too_large"] == 1
    assert c.put("d", _state(100))  # exactly the bound: everything else goes
    assert c.keys() == ["d"] and c.stats()["bytes"] == 100 and c.stats()["evictions"] == 3
    assert c.put("d", _state(10))  # replacing an entry counts its bytes once
    assert c.stats()["bytes"] == 10
    assert {k: c.stats()[k] for k in ("hits", "misses", "entries", "max_bytes")} == {
        "hits": 1, "misses": 1, "entries": 1, "max_bytes": 100}


def test_zero_disables_and_bad_sizes_are_refused(base):
    off = StateCache(0)
    assert not off.put("a", _state(1)) and off.get("a") is None
    assert off.stats() == {"hits": 0, "misses": 0, "entries": 0, "bytes": 0, "max_bytes": 0, "evictions": 0,
                           "stores": 0, "too_large": 0}
    p = Predictor(base.model, base.meta, state_cache_mb=0)
    p.predict(_req(LONG, "dept"))
    p.predict(_req(LONG, "angry"))
    assert p.state_cache_stats()["entries"] == 0 and p.state_cache_stats()["misses"] == 0
    for bad in (-1, float("nan"), float("inf"), "12", True):
        with pytest.raises(ValueError, match="state_cache_mb"):
            Predictor(base.model, base.meta, state_cache_mb=bad)


def test_predictor_cache_keeps_its_byte_bound_and_counts(base):
    """Real states: a bound of two and a half entries keeps two, drops the least recently used, and the
    counters match the requests (one lookup per state on the prefix path)."""
    probe, _ = _pair(base)
    states = [f"{LONG} Case {i}." for i in range(4)]  # the same token count each
    probe.predict(_req(states[0], "dept"))
    size = probe.state_cache_stats()["bytes"]
    assert size > 0
    p = Predictor(base.model, base.meta, state_cache_mb=2.5 * size / (1 << 20))
    bound = p.state_cache_stats()["max_bytes"]
    seen = []
    for s in (states[0], states[1], states[0], states[2], states[1], states[0]):
        p.predict(_req(s, "angry"))
        seen.append(p.state_cache_stats())
        assert seen[-1]["bytes"] <= bound and seen[-1]["entries"] <= 2
    # s0 miss, s1 miss, s0 hit, s2 miss (evicts s1), s1 miss (evicts s0), s0 miss (evicts s2)
    assert [s["hits"] for s in seen] == [0, 0, 1, 1, 1, 1]
    assert [s["misses"] for s in seen] == [1, 2, 2, 3, 4, 5]
    assert [s["evictions"] for s in seen] == [0, 0, 0, 1, 2, 3]
    small = Predictor(base.model, base.meta, state_cache_mb=0.5 * size / (1 << 20))
    small.predict(_req(states[0], "dept"))
    assert small.state_cache_stats()["entries"] == 0 and small.state_cache_stats()["too_large"] == 1


def test_a_short_state_asked_once_is_not_cached(base):
    """Planning: a prefix shorter than one call's overhead is not worth a forward of its own."""
    p, _ = _pair(base)
    p.predict(_req("Late.", "dept"))
    assert p.state_cache_stats()["entries"] == 0 and p.state_cache_stats()["misses"] == 0
    p.predict(_req(LONG, "dept"))
    assert p.state_cache_stats()["entries"] == 1


def test_unsupported_cache_layouts_are_not_stored():
    class Layer:  # not one of transformers' known layer classes
        def __init__(self):
            self.keys = self.values = torch.zeros(1, 1, 3, 2)

    class Cache:
        layers = [Layer()]

    assert snapshot_row(Cache(), 0, 0) is None


# --------------------------------------------------------------------------------------- sliding window (Gemma 3)
WINDOW = 48  # the tiny Gemma 3's sliding window: a stored state holds at most 47 prefix tokens
# prefix tokens (byte-level: `<bos>State: {"t": "` + the text + `"}` + newline = 18 + len(text))
G_A, G_B, G_C = "Box crushed.", "Parcel late, vase broken", "Late parcel"  # 30, 42, 29 tokens
G_E, G_F = "Vase broken, parcel late", "Box wet, lid"  # 42, 30: cold together, a padded width of 48
G_LONG = "Parcel late, vase broken, box crushed, refund wanted."  # 71 tokens: past the window


@pytest.fixture(scope="module")
def gemma():
    """A random-weight Gemma 3 (3 sliding-window layers of window 48, 1 global), its head scaled so that the
    probabilities differ visibly between states."""
    from _tiny_decoders import tiny_gemma3
    from test_model_families import liven

    from rlcd.model.backbone import _backbone
    from rlcd.model.decision import DecisionModel
    from rlcd.model.families import CAUSAL_LM

    model, tok = tiny_gemma3(sliding_window=WINDOW)
    return liven(DecisionModel(_backbone(CAUSAL_LM, (model, tok, None), "test", "random"), seed=0))


def _gcase(dm, text: str, qs: slice):
    from test_model_families import QS

    return CaseRunner(dm).prepare_case({"t": text}, QS[qs])


def _assert_cold_answers(dm, cases, results):
    """Each case's probabilities equal those it gets alone with no cache, within TOL (float64 softmax)."""
    for case, (logits, _) in zip(cases, results):
        (want, _), = CaseRunner(dm).score_cases([case])
        assert max(float(w.abs().max()) for w in want) > 0.5, "logits too small for a meaningful comparison"
        for g, w in zip(logits, want):
            gap = (torch.softmax(g.double(), -1) - torch.softmax(w.double(), -1)).abs().max()
            assert float(gap) < TOL, (case.rows[0].prefix_len, float(gap))


def _kv(state: PrefixState) -> list[torch.Tensor]:
    return [t.clone() for layer in state.cache.layers for t in (layer.keys, layer.values)]


def test_gemma3_states_shorter_than_the_window_are_served_from_the_cache(gemma):
    """Gemma 3's local layers (`DynamicSlidingWindowLayer`) keep every position of a prefix shorter than the
    window, so its state is stored and later requests about it run only their suffixes, alone, beside a new state
    (a padded width under the window), beside one that pads the batch to the window (the stacked local layers
    cropped as the forward crops them) and several warm states at once; every answer is the cold one."""
    dm, cache = gemma, StateCache(64 << 20)
    sc = cache.scoped("gemma")
    assert not CaseRunner(dm).kv_only_cache  # the prefix path stores it (no full-row shortcut)
    a = _gcase(dm, G_A, slice(0, 2))
    assert CaseRunner(dm).plan([a], state_prefix=True).prefix_len == [30]
    _assert_cold_answers(dm, [a], CaseRunner(dm).score_cases([a], state_cache=sc))
    assert cache.stats()["stores"] == 1 and cache.stats()["hits"] == 0
    (stored,) = cache._entries.values()
    kinds = [type(layer).__name__ for layer in stored.cache.layers]
    assert kinds == ["DynamicSlidingWindowLayer"] * 3 + ["DynamicLayer"] and stored.tokens == 30
    assert all(layer.keys.shape[-2] == 30 for layer in stored.cache.layers)
    assert [layer.cumulative_length for layer in stored.cache.layers[:3]] == [30] * 3
    before = _kv(stored)
    batches = [
        [_gcase(dm, G_A, slice(2, 4))],  # lone warm: its keys and values lent, unpadded
        [_gcase(dm, G_A, slice(3, 5)), _gcase(dm, G_C, slice(0, 2))],  # + a new state of 29: width 32 < 48
        [_gcase(dm, G_A, slice(1, 3)), _gcase(dm, G_B, slice(0, 2))],  # + a new state of 42: width 48 = window
        [_gcase(dm, t, slice(2, 5)) for t in (G_A, G_B, G_C)],  # every state warm, width 48
    ]
    for batch, hits, stores in zip(batches, (1, 2, 3, 6), (1, 2, 3, 3)):
        results = CaseRunner(dm).score_cases(batch, state_cache=sc)
        assert cache.stats()["hits"] == hits and cache.stats()["stores"] == stores
        assert results[0][1]["cached_tokens"] == 30  # the first case's prefix came from the cache
        _assert_cold_answers(dm, batch, results)
    assert all(torch.equal(x, y) for x, y in zip(before, _kv(stored))), "a stored state was changed"


def test_gemma3_short_prefixes_of_a_batch_padded_past_the_window_are_stored(gemma):
    """Two new states in one prefix forward padded to 48 >= the window: the local layers keep only the last 47
    positions, which still hold both states (42 and 30 tokens), so both are stored and later answer warm."""
    dm, cache = gemma, StateCache(64 << 20)
    sc = cache.scoped("gemma")
    batch = [_gcase(dm, G_E, slice(0, 2)), _gcase(dm, G_F, slice(0, 2))]
    assert [c.rows[0].prefix_len for c in batch] == [42, 30]
    _assert_cold_answers(dm, batch, CaseRunner(dm).score_cases(batch, state_cache=sc))
    assert cache.stats()["stores"] == 2
    assert sorted(s.tokens for s in cache._entries.values()) == [30, 42]
    later = [_gcase(dm, G_F, slice(2, 4)), _gcase(dm, G_E, slice(3, 5))]
    _assert_cold_answers(dm, later, CaseRunner(dm).score_cases(later, state_cache=sc))
    assert cache.stats()["hits"] == 2


def test_gemma3_a_state_longer_than_the_window_is_not_stored_and_answers_cold(gemma):
    """A prefix the window has cropped is not kept (the local layers lost its first positions): it misses each
    time and answers as without the cache, alone and in a batch beside a warm state (where it runs apart: its
    cache cannot be stacked with a stored one)."""
    dm, cache = gemma, StateCache(64 << 20)
    sc = cache.scoped("gemma")
    long = _gcase(dm, G_LONG, slice(0, 2))
    assert long.rows[0].prefix_len == 71 > WINDOW
    for qs in (slice(0, 2), slice(2, 5)):
        case = _gcase(dm, G_LONG, qs)
        _assert_cold_answers(dm, [case], CaseRunner(dm).score_cases([case], state_cache=sc))
    assert cache.stats()["stores"] == 0 and cache.stats()["misses"] == 2 and cache.stats()["hits"] == 0
    CaseRunner(dm).score_cases([_gcase(dm, G_A, slice(0, 2))], state_cache=sc)
    assert cache.stats()["stores"] == 1
    batch = [_gcase(dm, G_A, slice(2, 4)), _gcase(dm, G_LONG, slice(1, 4)), _gcase(dm, G_C, slice(0, 2))]
    results = CaseRunner(dm).score_cases(batch, state_cache=sc)
    assert cache.stats()["hits"] == 1 and cache.stats()["stores"] == 2  # the short new state stored, not the long
    assert [u["cached_tokens"] for _, u in results] == [30, 0, 0]
    _assert_cold_answers(dm, batch, results)


def test_gemma3_a_lone_question_about_a_state_past_the_window_runs_as_one_full_forward(gemma):
    """A single question about a state the window crops (71 tokens > 47): its state can never be stored, so the
    planner counts no later reuse and runs it as with the cache off -- one full forward, not a prefix forward to
    store nothing plus a suffix call (before: path "prefix", 2 calls)."""
    dm, cache = gemma, StateCache(64 << 20)
    sc = cache.scoped("gemma")
    long = _gcase(dm, G_LONG, slice(0, 1))
    assert CaseRunner(dm).plan([long], state_prefix=True).prefix_len == CaseRunner(dm).plan([long]).prefix_len == [None]
    assert CaseRunner(dm).max_state_tokens == WINDOW - 1
    results = CaseRunner(dm).score_cases([long], state_cache=sc)
    (_, usage), = results
    assert usage["path"] == "full" and usage["calls"] == 1 and usage["cached_tokens"] == 0
    assert cache.stats()["stores"] == 0
    _assert_cold_answers(dm, [long], results)


def test_max_state_tokens_is_none_without_sliding_layers():
    from _tiny_export import build_tiny_model

    assert CaseRunner(build_tiny_model(0, "tiny-llama")).max_state_tokens is None


def _sliding_cache(sliding_window: int, keys: torch.Tensor):
    """A DynamicCache of one sliding-window layer and one full-attention layer after a forward of `keys`."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache()
    cache.layers = [DynamicSlidingWindowLayer(sliding_window=sliding_window), DynamicLayer()]
    for layer in cache.layers:
        layer.update(keys, keys + 1)
    return cache


def test_snapshot_row_keeps_a_sliding_layer_only_while_it_holds_the_whole_state():
    keys = torch.randn(2, 1, 10, 4)
    cache = _sliding_cache(8, keys)  # the window keeps positions 3..9 of 10
    assert cache.layers[0].keys.shape[-2] == 7 and cache.layers[0].cumulative_length == 10
    got = snapshot_row(cache, 1, 5)  # row 1's positions 5..9: all held
    assert got is not None and got.tokens == 5
    sw, full = got.cache.layers
    assert torch.equal(sw.keys, keys[1:, :, 5:]) and torch.equal(sw.values, keys[1:, :, 5:] + 1)
    assert torch.equal(full.keys, keys[1:, :, 5:]) and sw.cumulative_length == 5 == sw.get_seq_length()
    assert cache.layers[0].cumulative_length == 10  # the batch's own layer untouched
    assert snapshot_row(cache, 0, 3) is not None and snapshot_row(cache, 0, 2) is None  # position 2 is gone
    assert snapshot_row(cache, 0, 0, 4) is None  # a full row's first positions, dropped by the window
    short = _sliding_cache(8, keys[:1, :, :6])  # one row of 6 < 8: nothing dropped
    got = snapshot_row(short, 0, 0, 4)
    assert got.tokens == 4 and torch.equal(got.cache.layers[0].keys, keys[:1, :, :4])
    assert got.cache.layers[0].cumulative_length == 4


@pytest.mark.parametrize("width", [11, 12, 16])
def test_stack_states_builds_the_sliding_layer_a_batched_prefix_forward_leaves(width):
    """The reference is transformers' own `DynamicSlidingWindowLayer.update` on the left-padded batch."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from rlcd.model.state_cache import max_state_tokens, stack_states

    window, lens = 12, (9, 5, 11)
    rows = [torch.randn(1, 2, n, 4) for n in lens]
    states = [snapshot_row(_sliding_cache(window, r), 0, 0) for r in rows]
    assert [s.tokens for s in states] == list(lens) and max_state_tokens(states[0]) == window - 1
    pk, pv = torch.zeros(len(rows), 2, width, 4), torch.zeros(len(rows), 2, width, 4)  # left padding zero
    for i, r in enumerate(rows):
        pk[i: i + 1, :, width - r.shape[-2]:] = r
        pv[i: i + 1, :, width - r.shape[-2]:] = r + 1  # `_sliding_cache`'s values
    ref = DynamicSlidingWindowLayer(sliding_window=window)
    ref.update(pk, pv)
    got = stack_states(states, width).layers[0]
    assert got.cumulative_length == ref.cumulative_length == width
    assert got.keys.shape == ref.keys.shape and torch.equal(got.keys, ref.keys)
    assert torch.equal(got.values, ref.values)
    assert got.get_mask_sizes(3) == ref.get_mask_sizes(3)
    assert got.keys.shape[-2] == (width if width < window else window - 1)


def test_stack_states_lends_a_lone_sliding_state_that_needs_no_padding():
    from rlcd.model.state_cache import stack_states

    state = snapshot_row(_sliding_cache(12, torch.randn(1, 2, 7, 4)), 0, 0)
    lone = stack_states([state], 7)
    assert all(x.keys is y.keys and x.values is y.values for x, y in zip(lone.layers, state.cache.layers))
    assert lone.layers[0].cumulative_length == 7
    with pytest.raises(ValueError, match="does not fit"):
        stack_states([state], 5)


# --------------------------------------------------------------------------------------- threads
def test_concurrent_predicts_on_a_shared_predictor(base, pngs):
    warm, cold = _pair(base)
    reqs = [(_req(f"{LONG} #{i}", *list(Q)[i: i + 2 + i % 3]), pngs[i % 2] if i % 3 == 0 else None)
            for i in range(6)]
    expected = [cold.predict(r, img) for r, img in reqs]
    first = [warm.predict(r, img) for r, img in reqs]  # stores every state
    got: dict[tuple[int, int], dict] = {}
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for k in range(4):
                i = (t + k) % len(reqs)
                got[t, k] = (i, warm.predict(*reqs[i]))
                _ = warm.state_cache_stats()  # read while others write
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(got) == 24
    for i, answer in got.values():
        assert answer == first[i]  # the same stored state, the same answer, whatever ran beside it
        assert answer_gap(answer, expected[i]) < TOL
    assert warm.state_cache_stats()["hits"] == 24 and warm.state_cache_stats()["entries"] == len(reqs)


ROUNDS = 8000


def test_the_cache_itself_is_thread_safe():
    """Many threads putting and getting at once (the GIL switching as often as it can): the counters add up,
    the bytes held equal the entries' bytes and never pass the bound."""
    import sys

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        c = StateCache(1000)
        seen_over: list[int] = []

        def worker(t: int) -> None:
            for k in range(ROUNDS):
                key = (t * 7 + k) % 23
                if k % 3:
                    c.get(key)
                else:
                    c.put(key, _state(10 + key * 5))
                if c.stats()["bytes"] > 1000:
                    seen_over.append(k)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(old)
    s = c.stats()
    n_gets = sum(1 for _ in range(8) for k in range(ROUNDS) if k % 3)
    n_puts = 8 * ROUNDS - n_gets
    assert s["hits"] + s["misses"] == n_gets
    assert s["stores"] == n_puts
    assert s["bytes"] == sum(c._entries[k].nbytes for k in c.keys()) <= 1000
    assert not seen_over


# --------------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("command", ["predict", "serve"])
@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_bad_state_cache_size_is_one_line_and_exit_2(base, tmp_path, command, value):
    from typer.testing import CliRunner

    from rlcd.cli import app

    res = CliRunner().invoke(app, [command, str(tmp_path), "--state-cache-mb", value])
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith("rlcd: error: --state-cache-mb") and len(res.stderr.splitlines()) == 1


def test_the_cli_default_is_the_predictors(tmp_path_factory):
    import inspect

    from rlcd.cli import serve as cli
    from rlcd.predict import DEFAULT_STATE_CACHE_MB
    from rlcd.server import serve

    assert cli.STATE_CACHE_MB == DEFAULT_STATE_CACHE_MB == inspect.signature(serve).parameters["state_cache_mb"].default
    assert inspect.signature(Predictor).parameters["state_cache_mb"].default == DEFAULT_STATE_CACHE_MB


@pytest.mark.parametrize("mb", ["0", "3.5"])
def test_predict_command_takes_the_cache_size(base, tmp_path_factory, monkeypatch, mb):
    """`rlcd predict RUN --state-cache-mb N` builds its Predictor with that cache and answers as it does."""
    import json

    from typer.testing import CliRunner

    from _tiny_export import tiny_export
    from rlcd.cli import app

    built: list[Predictor] = []
    original = Predictor.from_run.__func__

    def spy(cls, *a, **kw):
        built.append(original(cls, *a, **kw))
        return built[-1]

    monkeypatch.setattr(Predictor, "from_run", classmethod(spy))
    run = tiny_export(tmp_path_factory.getbasetemp())
    req = _req(LONG, "dept")
    path = tmp_path_factory.mktemp("sc-cli") / "req.json"
    path.write_text(json.dumps(req))
    res = CliRunner().invoke(app, ["predict", str(run), str(path), "--state-cache-mb", mb, "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert built[0].state_cache_stats()["max_bytes"] == int(float(mb) * (1 << 20))
    want = Predictor(base.model, base.meta, name=base.name, state_cache_mb=float(mb)).predict(req)
    assert json.loads(res.stdout) == want


# --------------------------------------------------------------------------------------- bench
def test_state_cache_bench_runs_and_counts_suffixes(base):
    """`rlcd bench serve RUN --state-cache` on the tiny export (one repeat, one thread; no timing asserted):
    every scenario measured, the warm ones hit, and the suffix breakdown adds up to the real rows."""
    from rlcd.bench.prefix import make_questions
    from rlcd.bench.state_cache import SCENARIOS, run_state_cache_bench, suffix_breakdown

    res = run_state_cache_bench(base, threads=(1,), repeats=1, state_tokens=60, say=lambda _: None)
    assert set(res["p50_ms"]["1"]) == set(SCENARIOS) and all(v > 0 for v in res["p50_ms"]["1"].values())
    assert res["cache"]["hits"] == 2 * (1 + 4)  # warm_1q + the four later requests of five_requests_on, 2 rounds
    enc = base.model.encoder
    for q in make_questions(5):
        b = suffix_breakdown(enc, q)
        row = enc.encode(LONG, q)
        assert b["suffix"] == len(row) - row.prefix_len
        assert b["template"] + b["content"] == b["suffix"] and b["options"] == q.k


def test_state_cache_bench_runs_a_subset_of_its_scenarios(base):
    """`--scenarios cold_1q_off,cold_1q,warm_1q`: those only (the warm one hits the state its cold one stored), the
    ratios between them; an unknown name is refused."""
    from rlcd.bench.state_cache import run_state_cache_bench

    res = run_state_cache_bench(base, threads=(1,), repeats=1, state_tokens=60, say=lambda _: None,
                                scenarios=("warm_1q", "cold_1q_off"))
    assert set(res["p50_ms"]["1"]) == {"cold_1q_off", "warm_1q"}
    assert set(res["ratios"]["1"]) == {"warm_over_cold_off"} and res["cache"]["hits"] == 2
    with pytest.raises(ValueError, match="cold_2q"):
        run_state_cache_bench(base, threads=(1,), repeats=1, scenarios=("cold_2q",))
