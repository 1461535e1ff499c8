"""Expert offload on CPU: the cache / prediction / miss logic (identical to CUDA's, where only the copies become
asynchronous) is exact for any routing and cache size, its statistics are consistent, and an offloaded fixture
model computes the plain model's logits, eagerly and compiled with the ckvp backend."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ckvp_compile.errors import CKVPConfigError
from ckvp_compile.ops import register_all
from ckvp_compile.runtime.offload import ExpertOffloader, fold_norm_predictor, offload_experts
from ckvp_compile.runtime.offload_policy import LayerCache, OffloadPlanner
from ckvp_compile.runtime.prediction import capture_routing_trace, prediction_recall, replay_trace
from ckvp_compile.testing.models import FIXTURE_MODEL_DIR, load_fixture_model

register_all()


def _weights(layers, e, i, dm, seed):
    g = torch.Generator().manual_seed(seed)
    gu = [torch.randn(e, 2 * i, dm, generator=g) for _ in range(layers)]
    dn = [torch.randn(e, dm, i, generator=g) for _ in range(layers)]
    return gu, dn


def _check_invariants(off: ExpertOffloader) -> None:
    s = off.stats()
    assert s.hits + s.misses == s.lookups
    assert s.bytes_copied == (s.misses + s.prefetch_copies) * s.expert_bytes
    assert s.bytes_demand == s.misses * s.expert_bytes
    assert s.prefetch_useful + s.prefetch_wasted <= s.prefetch_copies
    assert s.recall_topk_hits <= s.recall_margin_hits <= s.recall_actual
    for n, cache in enumerate(off.planner.caches):
        assert len(cache.slots) == cache.capacity and len(set(cache.slots)) == cache.capacity
        assert cache.where == {e: s for s, e in enumerate(cache.slots)}
        for slot, e in enumerate(cache.slots):  # the device slot really holds the expert the planner says
            assert torch.equal(off.slot_gate_up[n][slot], off.host_gate_up[n][e])
            assert torch.equal(off.slot_down[n][slot], off.host_down[n][e])


@given(layers=st.integers(1, 3), e=st.integers(2, 6), data=st.data(), prefetch=st.booleans(),
       policy=st.sampled_from(["lru", "lfu"]), predict=st.booleans())
def test_any_routing_any_capacity_equals_all_resident(layers, e, data, prefetch, policy, predict):
    a = data.draw(st.integers(1, e), label="top_k")
    c = data.draw(st.integers(1, e), label="resident")
    margin = data.draw(st.integers(0, e - a), label="margin")
    lookahead = data.draw(st.integers(1, 2), label="lookahead")
    dm, i = 8, 6
    gu, dn = _weights(layers, e, i, dm, seed=e * 7 + layers)
    g = torch.Generator().manual_seed(c)
    # predictors unrelated to the (random) routing: mispredictions all the time, outputs must stay exact
    preds = [[torch.randn(e, dm, generator=g) for _ in range(lookahead)] for _ in range(layers)]
    off = ExpertOffloader(gu, dn, resident=c, top_k=a, device="cpu", predictors=preds if predict else None,
                          prefetch=prefetch, margin=margin, lookahead=lookahead, policy=policy)
    for step in range(4):
        for layer in range(layers):
            t = data.draw(st.integers(1, 4), label="tokens")
            ids = torch.stack([torch.randperm(e, generator=g)[:a] for _ in range(t)])
            h = torch.randn(t, dm, generator=g)
            w = torch.rand(t, a, generator=g)
            out = off.forward(layer, h, ids, w)
            ref = torch.ops.ckvp.moe_experts(h, ids, w, gu[layer][:, :i], gu[layer][:, i:], dn[layer])
            assert torch.equal(out, ref), (step, layer, (out - ref).abs().max())
    _check_invariants(off)
    s = off.stats()
    if c == e:
        assert s.misses == 0 and s.prefetch_copies == 0
    if not (prefetch and predict):
        assert s.prefetch_copies == 0
    if not predict:
        assert s.recall_actual == 0
    off.close()


def test_bf16_multi_round_within_rounding_and_single_round_bitwise():
    gu, dn = _weights(1, 4, 16, 32, seed=3)
    gu, dn = [w.bfloat16() for w in gu], [w.bfloat16() for w in dn]
    off = ExpertOffloader(gu, dn, resident=2, top_k=2, device="cpu")
    h = torch.randn(6, 32).bfloat16()
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3], [3, 1], [2, 0]])
    w = torch.rand(6, 2)
    ref = torch.ops.ckvp.moe_experts(h, ids, w, gu[0][:, :16], gu[0][:, 16:], dn[0])
    out = off.forward(0, h, ids, w)  # 4 experts, 2 slots: two rounds
    assert off.stats().rounds == 1
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    one = off.forward(0, h[:1], ids[:1], w[:1])  # fits: bitwise
    assert torch.equal(one, torch.ops.ckvp.moe_experts(h[:1], ids[:1], w[:1], gu[0][:, :16], gu[0][:, 16:], dn[0]))


def test_planner_rounds_protect_and_policies():
    p = OffloadPlanner(num_layers=1, num_experts=5, top_k=3, capacity=2, policy="lru", prefetch=False)
    rounds = p.demand(0, [[4, 0, 2]])  # expert 0 resident (slots hold 0, 1); 2 and 4 missing; C=2 < 3 needed
    assert [r.experts for r in rounds] == [(0, 2), (4,)]
    assert rounds[0].loads == ((2, 1),)  # 1 evicted, 0 protected
    assert p.stats.hits == 1 and p.stats.misses == 2 and p.stats.rounds == 1
    lru = LayerCache(4, 3, "lru")
    for e in (0, 0, 0, 1, 2):
        lru.touch(e, demand=True)
    assert lru.allocate(3, protected=set()) == (0, 0)  # 0 used most but longest ago
    lfu = LayerCache(4, 3, "lfu")
    for e in (0, 0, 0, 1, 2):
        lfu.touch(e, demand=True)
    assert lfu.allocate(3, protected=set()) == (1, 1)  # fewest uses, then oldest
    with pytest.raises(RuntimeError, match="protected"):
        lfu.allocate(0, protected={3, 0, 2})
    with pytest.raises(CKVPConfigError, match=r"\[1, E=4\]"):
        LayerCache(4, 0)
    with pytest.raises(CKVPConfigError, match="policy"):
        LayerCache(4, 2, "fifo")


def test_prediction_refreshes_and_counts_recall():
    p = OffloadPlanner(num_layers=2, num_experts=4, top_k=1, capacity=2, prefetch=True, margin=1)
    loads = p.predict(0, {1: [[3, 0]]})  # layer 1 holds 0, 1: prefetch 3 into 1's slot
    assert loads == [(1, 3, 1)]
    p.demand(1, [[0]])
    assert (p.stats.recall_actual, p.stats.recall_topk_hits, p.stats.recall_margin_hits) == (1, 0, 1)
    assert p.stats.prefetch_copies == 1 and p.stats.prefetch_useful == 0
    p.predict(0, {1: [[2, 1]]})  # evicts the unused prefetch of 3 (0 was just used)
    assert p.stats.prefetch_wasted == 1


def test_errors():
    gu, dn = _weights(1, 4, 4, 8, seed=0)
    with pytest.raises(CKVPConfigError, match=r"\[1, E=4\]"):
        ExpertOffloader(gu, dn, resident=5, top_k=2, device="cpu")
    off = ExpertOffloader(gu, dn, resident=2, top_k=2, device="cpu")
    with pytest.raises(CKVPConfigError, match="outside"):
        off.forward(0, torch.randn(1, 8), torch.tensor([[0, 7]]), torch.rand(1, 2))
    with pytest.raises(CKVPConfigError, match="layer"):
        off.forward(3, torch.randn(1, 8), torch.tensor([[0, 1]]), torch.rand(1, 2))
    off.close()
    with pytest.raises(CKVPConfigError, match="closed"):
        torch.ops.ckvp.offload_experts(torch.randn(1, 8), torch.tensor([[0, 1]]), torch.rand(1, 2), off.handle, 0)
    with pytest.raises(CKVPConfigError, match="nothing to offload"):
        offload_experts(torch.nn.Linear(2, 2), resident=1)
    model = load_fixture_model()
    offload_experts(model, resident=1).close()
    with pytest.raises(CKVPConfigError, match="already offloaded"):
        offload_experts(model, resident=1)


def test_fold_norm_predictor_is_next_router_on_next_norm():
    g = torch.Generator().manual_seed(0)
    r, w_this, w_next = torch.randn(4, 16, generator=g), torch.rand(16, generator=g) + 0.5, torch.randn(16, generator=g)
    x = torch.randn(3, 16, generator=g)
    xhat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    p = fold_norm_predictor(r, w_next, w_this)
    torch.testing.assert_close((w_this * xhat) @ p.T, (w_next * xhat) @ r.T)


@pytest.fixture(scope="module")
def fixture_windows():
    text = (FIXTURE_MODEL_DIR / "eval_text.txt").read_bytes()
    return [torch.tensor([list(text[i * 5000: i * 5000 + 32])]) for i in range(2)]


@torch.no_grad()
def test_fixture_offloaded_logits_equal_plain_eager_and_compiled(fixture_windows):
    plain = load_fixture_model()
    model = load_fixture_model()
    handle = offload_experts(model, resident=2, margin=1)
    assert all(not n.endswith(("gate_up_proj", "down_proj")) for n, _ in model.named_parameters())
    for ids in fixture_windows:
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)
    s = handle.stats()
    assert s.calls == 8 * len(fixture_windows) and s.misses > 0 and s.hits + s.misses == s.lookups
    compiled = torch.compile(model.forward, backend="ckvp", options={"compiler": "aot_eager"})
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(fixture_windows[0]).logits
    assert not [w for w in caught if "expert" in str(w.message)]  # the offloaded experts are not "unknown"
    torch.testing.assert_close(out, plain(fixture_windows[0]).logits, rtol=1e-4, atol=1e-4)
    assert handle.stats().calls == s.calls + 8  # the compiled graph really ran the offloader
    handle.close()


@torch.no_grad()
def test_replay_of_the_real_routing_matches_the_offloader(fixture_windows):
    model = load_fixture_model()
    handle = offload_experts(model, resident=3, margin=1, policy="lru")
    trace = capture_routing_trace(model, fixture_windows, lookahead=1, predictors=("norm",))
    stats = handle.stats()  # the capture ran the offloaded model: its stats come from the same calls
    replay = replay_trace(trace, capacity=3, policy="lru", prefetch=True, margin=1, lookahead=1, predictor="norm",
                          tokens_per_call=32)
    for f in ("lookups", "hits", "misses", "prefetch_copies", "prefetch_useful", "prefetch_wasted",
              "recall_actual", "recall_topk_hits", "recall_margin_hits"):
        assert getattr(replay, f) == getattr(stats, f), f
    r = prediction_recall(trace, "norm", 1, 0)
    assert 0.5 < r <= prediction_recall(trace, "norm", 1, 1) <= 1.0
    handle.close()


def _expected_predictors(model, predictor):
    from ckvp_compile.runtime.offload import _find_moe_layers

    layers = _find_moe_layers(model)
    out = []
    for n, info in enumerate(layers[:-1]):
        nxt = layers[n + 1]
        norms = (nxt["norm"], info["norm"]) if predictor == "norm" else (None, None)
        out.append(fold_norm_predictor(nxt["router"], *norms))
    return out


@pytest.mark.parametrize("predictor", ["norm", "router"])
@torch.no_grad()
def test_predictors_follow_new_router_and_norm_weights(fixture_windows, predictor):
    """load_state_dict, an in-place edit and a replaced Parameter of a router or norm refold the predictors at
    the next layer call (stale ones would prefetch the wrong experts); outputs stay the plain model's."""
    model = load_fixture_model()
    handle = offload_experts(model, resident=2, margin=1, predictor=predictor)
    other = load_fixture_model()
    g = torch.Generator().manual_seed(3)
    for name, p in other.named_parameters():
        if name.endswith(("gate.weight", "post_attention_layernorm.weight")):
            p.copy_(torch.randn(p.shape, generator=g))
    before = [p[0].clone() for p in handle.predictors[:-1]]
    model.load_state_dict(other.state_dict())
    model(fixture_windows[0])
    want = _expected_predictors(model, predictor)
    for n, w in enumerate(want):
        torch.testing.assert_close(handle.predictors[n][0], w)
        assert not torch.equal(handle.predictors[n][0], before[n])
    torch.testing.assert_close(model(fixture_windows[1]).logits, other(fixture_windows[1]).logits,
                               rtol=1e-4, atol=1e-4)
    layer1 = model.model.layers[1]
    layer1.mlp.gate.weight.mul_(-1.0)  # in place
    model(fixture_windows[0])
    torch.testing.assert_close(handle.predictors[0][0], _expected_predictors(model, predictor)[0])
    layer2 = model.model.layers[2]
    layer2.mlp.gate.weight = torch.nn.Parameter(torch.randn(layer2.mlp.gate.weight.shape, generator=g))  # replaced
    model(fixture_windows[0])
    torch.testing.assert_close(handle.predictors[1][0], _expected_predictors(model, predictor)[1])
    handle.refold_predictors()  # explicit: a no-op here, every source is current
    torch.testing.assert_close(handle.predictors[1][0], _expected_predictors(model, predictor)[1])
    handle.close()


def test_refold_without_sources_names_the_fix():
    gu, dn = _weights(2, 3, 4, 8, 0)
    off = ExpertOffloader(gu, dn, resident=2, top_k=1, device="cpu", predictors=[[torch.randn(3, 8)], []])
    with pytest.raises(CKVPConfigError, match="offload_experts"):
        off.refold_predictors()
    with pytest.raises(Exception, match="nesting of predictors"):
        ExpertOffloader(gu, dn, resident=2, top_k=1, device="cpu", predictors=[[torch.randn(3, 8)], []],
                        predictor_sources=[[], []])
    off.close()


def test_predictor_sources_may_be_inference_tensors():
    """Router / norm weights made under torch.inference_mode() have no version counter: the stamp check must not
    raise, and a replaced tensor is still seen (object and storage)."""
    gu, dn = _weights(2, 3, 4, 8, 1)
    with torch.inference_mode():
        router = [torch.randn(3, 8)]
    src = lambda: (router[0], None, None)  # noqa: E731
    off = ExpertOffloader(gu, dn, resident=2, top_k=1, device="cpu", predictors=[[fold_norm_predictor(router[0], None,
                          None)], []], predictor_sources=[[src], []])
    hidden, ids, w = torch.randn(5, 8), torch.randint(0, 3, (5, 1)), torch.ones(5, 1)
    off.forward(0, hidden, ids, w)
    with torch.inference_mode():
        router[0] = torch.randn(3, 8)
    off.forward(0, hidden, ids, w)
    torch.testing.assert_close(off.predictors[0][0], router[0])
    off.close()


@torch.no_grad()
def test_predictors_follow_swapped_storage_and_replaced_modules(fixture_windows):
    """Two ``.data`` swaps between calls (the allocator may hand the first freed block back) and a replaced router
    module are seen; an in-place write through ``.data`` needs refold_predictors() (documented); bad layers and a
    closed offloader are refused by name."""
    model = load_fixture_model()
    handle = offload_experts(model, resident=2, margin=1)
    ids = fixture_windows[0]
    model(ids)
    w = model.model.layers[1].mlp.gate.weight
    for _ in range(3):
        w.data = w.data * 2.0
        w.data = w.data * 2.0
        model(ids)
        torch.testing.assert_close(handle.predictors[0][0], _expected_predictors(model, "norm")[0])
    layer2 = model.model.layers[2]
    new_gate = copy.deepcopy(layer2.mlp.gate)  # a new router module (e.g. a quantisation utility's swap)
    new_gate.weight.mul_(-1.0)
    layer2.mlp.gate = new_gate
    model(ids)
    torch.testing.assert_close(handle.predictors[1][0], _expected_predictors(model, "norm")[1])
    layer3 = model.model.layers[3]
    layer3.post_attention_layernorm = type(layer3.post_attention_layernorm)(layer3.post_attention_layernorm.weight.shape[0])
    model(ids)
    want = _expected_predictors(model, "norm")
    torch.testing.assert_close(handle.predictors[2][0], want[2])  # layer 3's norm is the next norm of predictor 2
    torch.testing.assert_close(handle.predictors[3][0], want[3])  # ... and this layer's norm of predictor 3
    model.model.layers[4].mlp.gate.weight.data.mul_(-1.0)  # through .data: not seen until refolded by hand
    model(ids)
    handle.refold_predictors(3)
    torch.testing.assert_close(handle.predictors[3][0], _expected_predictors(model, "norm")[3])
    with pytest.raises(CKVPConfigError, match=r"layer must be in \[0, 8\)"):
        handle.refold_predictors(8)
    handle.close()
    with pytest.raises(CKVPConfigError, match="closed"):
        handle.refold_predictors()


@torch.no_grad()
def test_router_without_a_weight_keeps_the_last_fold(fixture_windows):
    """A router module swapped for one without an (E, Dm) weight (as a quantisation utility might): the layer keeps
    its last predictor instead of failing, and the outputs stay the plain model's."""
    model = load_fixture_model()
    handle = offload_experts(model, resident=2, margin=1)
    ids = fixture_windows[0]
    model(ids)
    before = handle.predictors[0][0].clone()
    gate = model.model.layers[1].mlp.gate

    class NoWeight(torch.nn.Module):  # same routing, its weight kept under another name
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    model.model.layers[1].mlp.gate = NoWeight(gate)
    plain = load_fixture_model()
    torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(handle.predictors[0][0], before)
    handle.close()


def test_copies_grads_and_casts_of_an_offloaded_model_name_the_fix(fixture_windows):
    """What an offloaded model cannot do fails with an error that names the fix, and the model stays usable: a deep
    copy or a pickle (they would share, or lose, the offloader), a backward (inference-only op), a forward after
    ``model.to(dtype)`` (the experts keep their offload-time dtype)."""
    import pickle

    from ckvp_compile.errors import CKVPError, CKVPShapeError

    plain = load_fixture_model()
    model = load_fixture_model()
    handle = offload_experts(model, resident=2)
    ids = fixture_windows[0]
    with pytest.raises(CKVPConfigError, match="copy the model before ckvp_compile.offload_experts"):
        copy.deepcopy(model)
    with pytest.raises(CKVPConfigError, match=r"save model.state_dict\(\)"):
        pickle.dumps(model)
    out = model(ids).logits  # grad mode on: the forward runs, a backward is refused
    assert out.requires_grad
    with pytest.raises(CKVPConfigError, match=r"inference-only.*torch.no_grad\(\)"):
        out.sum().backward()
    compiled = torch.compile(model.forward, backend="ckvp",
                             options={"compiler": "aot_eager", "expert_offload": 2})
    with pytest.raises(CKVPError, match=r"expert offload is inference-only.*torch.no_grad\(\)"):
        compiled(ids)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)  # still usable
        with pytest.raises(CKVPShapeError, match="cast or move the model before ckvp_compile.offload_experts"):
            model.to(torch.bfloat16)(ids)
    handle.close()
