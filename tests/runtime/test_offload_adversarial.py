"""Expert offload used the way users break it: a call interrupted mid-way (Ctrl-C, out of memory), offloading under
``torch.inference_mode()``, deleting the model, a wrapped Qwen-MoE model, ``ckvp_compile.compile`` with options that
cannot apply, a closed offloader, a transposed experts layout; and the uses that must keep working (``generate``
with batches, beams and sampling, equal to the plain model). Each test of a defect failed before its fix."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckvp_compile
from ckvp_compile.errors import CKVPConfigError
from ckvp_compile.ops import offload as offload_ops
from ckvp_compile.ops import register_all
from ckvp_compile.runtime.offload import ExpertOffloader, fold_norm_predictor, offload_experts, offloader_of
from ckvp_compile.testing.models import build_hf_moe

register_all()

AOT = {"compiler": "aot_eager"}


def _model(family: str = "mixtral", seed: int = 0, **kw):
    return build_hf_moe(family, num_layers=3, num_experts=4, top_k=2, use_cache=False, seed=seed, **kw)


def _ids(batch: int = 2, length: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def _all_resident(gu: torch.Tensor, dn: torch.Tensor, x, ids, w) -> torch.Tensor:
    i = dn.shape[2]
    return torch.ops.ckvp.moe_experts(x, ids, w, gu[:, :i], gu[:, i:], dn)


class _Boom(Exception):
    pass


class _Logits(torch.nn.Module):
    """A user's wrapper module around an HF model (no ``config`` of its own): ``forward(ids)`` -> the logits."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, ids):
        return self.inner(ids).logits


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), resident=st.integers(1, 3), fail_at=st.integers(0, 6), interrupt=st.booleans())
def test_a_call_that_fails_mid_way_leaves_later_calls_exact(data, resident, fail_at, interrupt):
    """An exception inside a layer call after the planner placed its experts (an interrupt or an out-of-memory in
    a demand copy, a compute round or a prefetch copy) used to leave slots the planner believed filled holding
    other experts: every later call reading them was silently wrong (logits off by ~10). Now the next call of each
    layer the failed call planned refills its slots first, and equals the all-resident output."""
    e, a, i, dm, layers = 4, 2, 8, 16, 2
    g = torch.Generator().manual_seed(fail_at)
    gu = [torch.randn(e, 2 * i, dm, generator=g) for _ in range(layers)]
    dn = [torch.randn(e, dm, i, generator=g) for _ in range(layers)]
    preds = [[fold_norm_predictor(torch.randn(e, dm, generator=g), None, None)], []]
    off = ExpertOffloader(gu, dn, resident=resident, top_k=a, device="cpu", predictors=preds, margin=1)

    def call():
        t = data.draw(st.integers(1, 4), label="tokens")
        rows = [data.draw(st.lists(st.integers(0, e - 1), min_size=a, max_size=a, unique=True)) for _ in range(t)]
        x, ids, w = torch.randn(t, dm, generator=g), torch.tensor(rows), torch.rand(t, a, generator=g)
        return x, ids, w

    copies, compute = off._copy, off._finish
    count = [0]
    error = KeyboardInterrupt if interrupt else _Boom

    def failing(real):
        def step(*args):
            count[0] += 1
            if count[0] == fail_at + 1:
                raise error
            return real(*args)
        return step

    off._copy, off._finish = failing(copies), failing(compute)
    for layer in (0, 0, 1):  # a failure somewhere in these calls (or none, when fail_at is past them)
        x, ids, w = call()
        try:
            off.forward(layer, x, ids, w)
        except (KeyboardInterrupt, _Boom):
            break
    off._copy, off._finish = copies, compute
    for layer in (0, 1, 0, 1):
        x, ids, w = call()
        assert torch.equal(off.forward(layer, x, ids, w), _all_resident(gu[layer], dn[layer], x, ids, w))
    off.close()


def test_offloaded_under_inference_mode_runs_outside_it():
    """``offload_experts`` under ``torch.inference_mode()`` made the host store and slots inference tensors: every
    later call outside inference mode (``generate()`` runs under ``no_grad``) and ``load_state_dict`` raised
    "Inplace update to inference tensor outside InferenceMode"."""
    model, plain, other = _model(), _model(), _model(seed=1)
    ids = _ids()
    with torch.inference_mode():
        handle = offload_experts(model, resident=1)
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False),
                       plain.generate(ids, max_new_tokens=4, do_sample=False))
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, other(ids).logits, rtol=1e-5, atol=1e-5)
    handle.close()


@pytest.mark.parametrize("predictor", ["norm", "router"])
def test_offloading_frees_the_original_expert_weights_and_deleting_the_model_frees_the_offloader(predictor):
    """The predictors' live sources held the layer records of ``offload_experts``, and with them the original
    experts modules: their weights (on the device, for a CUDA model) were never freed, so offloading saved no device
    memory; the registry also kept every offloader (host store and slots) after ``del model``."""
    model = _model()
    originals = [weakref.ref(layer.mlp.experts.gate_up_proj) for layer in model.model.layers]
    handle = offload_experts(model, resident=2, predictor=predictor)
    gc.collect()
    assert [r() is None for r in originals] == [True] * len(originals)
    with torch.no_grad():
        model(_ids())  # the predictors still follow the model's router and norm weights
    assert offloader_of(model) is handle
    handle_id, offloader = handle.handle, weakref.ref(handle)
    del model, handle
    gc.collect()
    assert handle_id not in offload_ops._OFFLOADERS and offloader() is None


def test_deleting_a_compiled_offloaded_model_frees_its_offloader():
    model = _model()
    compiled = ckvp_compile.compile(model, expert_offload=2, options=AOT)
    with torch.no_grad():
        compiled(_ids(1, 5))
    handle_id = offloader_of(model).handle
    del model, compiled
    gc.collect()
    assert handle_id not in offload_ops._OFFLOADERS


def test_wrapped_qwen_moe_finds_the_routers_top_k():
    """Qwen2-MoE's block has no ``top_k`` (its router has): inside a user's wrapper module without ``config``,
    ``offload_experts`` raised "cannot find the top-k"."""

    model, plain = _Logits(_model("qwen2_moe")), _model("qwen2_moe")
    handle = offload_experts(model, resident=1, margin=1)
    assert handle.top_k == 2
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()), plain(_ids()).logits, rtol=1e-5, atol=1e-5)
    handle.close()


def test_compile_refuses_offload_options_an_offloaded_model_would_ignore():
    """``ckvp_compile.compile(model, expert_offload=C, offload_options=...)`` on a model already offloaded with C
    resident silently kept its old options (policy, prefetch, margin); now they must match (or be left out)."""
    model = _model()
    offload_experts(model, resident=2, policy="lru", prefetch=False)
    with pytest.raises(CKVPConfigError, match=r"offload_options .*'policy': 'lfu'.* differ .*'policy': 'lru'"):
        ckvp_compile.compile(model, expert_offload=2, offload_options={"policy": "lfu"}, options=AOT)
    ckvp_compile.compile(model, expert_offload=2, offload_options={"policy": "lru", "prefetch": False}, options=AOT)
    ckvp_compile.compile(model, expert_offload=2, options=AOT)
    with pytest.raises(CKVPConfigError, match=r"\['foo'\] are not options of ckvp_compile.offload_experts"):
        ckvp_compile.compile(model, expert_offload=2, offload_options={"foo": 1}, options=AOT)
    planner = offloader_of(model).planner
    assert (planner.policy, planner.prefetch) == ("lru", False)
    offloader_of(model).close()


def test_compile_with_a_bad_torch_compile_argument_leaves_the_model_as_it_was():
    """A keyword ``torch.compile`` does not take used to raise only after the experts were offloaded."""
    model = _model()
    with pytest.raises(TypeError, match="bogus"):
        ckvp_compile.compile(model, expert_offload=2, options=AOT, bogus=1)
    assert offloader_of(model) is None
    compiled = ckvp_compile.compile(model, expert_offload=3, options=AOT, fullgraph=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(_ids()).logits, _model()(_ids()).logits, rtol=1e-5, atol=1e-5)
    assert offloader_of(model).planner.capacity == 3
    offloader_of(model).close()


def test_load_weights_after_close_names_the_fix():
    """It raised a bare IndexError ("list index out of range")."""
    model = _model()
    handle = offload_experts(model, resident=2)
    gu, dn = handle.host_weights(0)
    handle.close()
    with pytest.raises(CKVPConfigError, match="closed.*offload it again"):
        handle.load_weights(0, gu, dn)


def test_forward_after_close_names_a_fix_that_works():
    """After close(), a forward said "call offload_experts(model, ...) again", which then raised "already
    offloaded": the message now says to load the model again and offload the fresh copy, and doing so works."""
    model = _model()
    offload_experts(model, resident=2)
    ids = torch.randint(0, model.config.vocab_size, (1, 5))
    offloader_of(model).close()
    with pytest.raises(CKVPConfigError, match="load the model again") as err:
        model(ids)
    assert "call ckvp_compile.offload_experts(model" not in str(err.value)
    with pytest.raises(CKVPConfigError, match="already offloaded"):
        offload_experts(model, resident=2)
    fresh = _model()
    want = fresh(ids).logits
    offload_experts(fresh, resident=2)
    torch.testing.assert_close(fresh(ids).logits, want)
    offloader_of(fresh).close()


def test_transposed_experts_layout_is_refused_as_unsupported():
    """Llama-4 stores its experts transposed, (E, Dm, 2I) and (E, I, Dm) (and calls them with one argument): it was
    refused with a CKVPShapeError about (E, 2I, Dm), not the documented CKVPConfigError naming the module."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Llama4TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=16, intermediate_size_mlp=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
        max_position_embeddings=128)
    model = transformers.Llama4ForCausalLM(config).eval()
    with pytest.raises(CKVPConfigError, match=r"'model.layers.0.feed_forward.experts'.*\(4, 64, 32\) and down_proj "
                                              r"\(4, 16, 64\) are not \(E, 2I, Dm\)"):
        offload_experts(model, resident=2)
    with torch.no_grad():
        model(_ids())  # untouched


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_generate_batches_beams_and_sampling_equal_the_plain_model(family):
    """What worked already and must keep working: left-padded batches, beam search and sampling through an
    offloaded model (1 of 4 experts resident, prefetch two layers ahead) give the plain model's tokens."""
    model, plain = _model(family), _model(family)
    offload_experts(model, resident=1, margin=1, lookahead=2)
    ids = _ids(2, 7, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    for kwargs in (dict(do_sample=False), dict(num_beams=3, do_sample=False), dict(do_sample=True, top_k=5)):
        torch.manual_seed(0)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, **kwargs)
        torch.manual_seed(0)
        assert torch.equal(out, plain.generate(ids, attention_mask=mask, max_new_tokens=6, **kwargs)), kwargs
    stats = offloader_of(model).stats()
    assert stats.hits + stats.misses == stats.lookups > 0
    offloader_of(model).close()


# ---------------------------------------------------------------------------------------------------------------
# A review of the fixes above (2026-12-07): each case below failed with them and passes now.


def test_an_exported_program_runs_while_the_caller_holds_the_offloader():
    """The lease unregistered the handle once the model's modules were collected, even while the caller still held
    the offloader: a ``torch.export`` program of the model (it holds the parameters it uses, and the handle as a
    constant, not the experts modules) failed after ``del model`` ("it was closed") whatever the caller kept. The
    registry now holds the offloader while the modules or the caller do, and frees it once neither does."""

    model, ids = _model(), _ids(1, 5)
    with torch.no_grad():
        want = model(ids).logits
        handle = offload_experts(model, resident=2)
        program = torch.export.export(_Logits(model), (ids,))
    handle_id, offloader = handle.handle, weakref.ref(handle)
    del model
    gc.collect()
    with torch.no_grad():
        torch.testing.assert_close(program.module()(ids), want, rtol=1e-5, atol=1e-5)
    del handle
    gc.collect()
    assert handle_id not in offload_ops._OFFLOADERS and offloader() is None
    with pytest.raises(CKVPConfigError, match="freed with its model .* torch.export program"):
        with torch.no_grad():
            program.module()(ids)
