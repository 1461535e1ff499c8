"""The ``expert_offload`` backend option and ``ckvp_compile.compile``: the option is validated (an int, 0 or 1..E, the
message naming the fix), the backend refuses a graph whose experts are not offloaded (naming the call that offloads
them) or are offloaded with another resident count, and a model compiled with offloaded experts computes exactly the
logits of the same model with all experts resident, for any cache size, with its statistics available."""

from __future__ import annotations

import pytest
import torch

import ckvp_compile
from ckvp_compile import CKVPConfig, CKVPConfigError
from ckvp_compile.runtime.offload import offload_experts
from ckvp_compile.testing.models import build_hf_moe

E, LAYERS = 4, 2
AOT = {"compiler": "aot_eager"}  # AOTAutograd + the post-grad passes without codegen: seconds to compile


def _model():
    return build_hf_moe("mixtral", num_layers=LAYERS, num_experts=E, top_k=2, use_cache=False)


def _inputs(seed):
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------- the option
@pytest.mark.parametrize("bad", [True, 2.5, "4", None, -1])
def test_option_validation_names_the_range(bad):
    with pytest.raises(CKVPConfigError, match=r"expert_offload.*1\.\.E") as err:
        CKVPConfig.from_options({"expert_offload": bad})
    assert "no offload" in str(err.value)


def test_option_values_describe_and_hash():
    assert CKVPConfig().expert_offload == 0
    assert CKVPConfig.from_options({"expert_offload": 4}).expert_offload == 4
    row = {r[0]: r for r in CKVPConfig.describe()}["expert_offload"]
    assert row[1:3] == ("int", "0") and "ckvp_compile.compile(model, expert_offload=C)" in row[3]
    assert CKVPConfig(expert_offload=4).compute_hash() != CKVPConfig().compute_hash()


@torch.no_grad()
def test_backend_refuses_experts_that_are_not_offloaded():
    with pytest.raises(CKVPConfigError, match=r"ckvp_compile\.compile\(model, expert_offload=2.*offload_experts\("
                                              r"model, resident=2\).*1\.\.4"):
        torch.compile(_model(), backend="ckvp", options={**AOT, "expert_offload": 2})(_inputs(0))


@torch.no_grad()
def test_backend_checks_the_resident_count_of_an_offloaded_model():
    model = _model()
    handle = offload_experts(model, resident=2)
    with pytest.raises(CKVPConfigError, match="offloaded with 2 resident"):
        torch.compile(model, backend="ckvp", options={**AOT, "expert_offload": 3})(_inputs(0))
    torch._dynamo.reset()
    plain = _model()
    out = torch.compile(model, backend="ckvp", options={**AOT, "expert_offload": 2})(_inputs(0)).logits  # agrees
    torch.testing.assert_close(out, plain(_inputs(0)).logits, rtol=1e-5, atol=1e-5)
    assert handle.stats().calls == LAYERS
    handle.close()


# ---------------------------------------------------------------------------------------------------- the wrapper
@torch.no_grad()
def test_compiled_offloaded_logits_equal_all_resident_and_stats_are_available():
    plain = _model()
    batches = [_inputs(1), _inputs(2)]
    resident = ckvp_compile.compile(_model(), expert_offload=E, options=AOT)
    want = [resident(ids).logits for ids in batches]
    assert ckvp_compile.offloader_of(resident).stats().misses == 0
    for ids, w in zip(batches, want):  # all resident through the offloader = the plain model, up to fp32 sums
        torch.testing.assert_close(w, plain(ids).logits, rtol=1e-5, atol=1e-5)
    for c in range(1, E):
        torch._dynamo.reset()
        model = _model()
        if c % 2:  # the module form
            compiled = ckvp_compile.compile(model, expert_offload=c, options=AOT, offload_options={"margin": 1})
        else:  # the bound-method form that HF generate() uses
            model.forward = ckvp_compile.compile(model.forward, expert_offload=c, options=AOT)
            compiled = model
        assert not any(n.endswith(("gate_up_proj", "down_proj")) for n, _ in model.named_parameters())
        for n, (ids, w) in enumerate(zip(batches, want)):
            assert torch.equal(compiled(ids).logits, w), (c, n)
            s = ckvp_compile.offloader_of(compiled).stats()
            assert s.calls == LAYERS * (n + 1)  # the compiled graph ran the offloader, once per layer
        assert s.misses > 0 and s.hits + s.misses == s.lookups
        assert s.bytes_copied == (s.misses + s.prefetch_copies) * s.expert_bytes > 0
        assert ckvp_compile.offloader_of(model).planner.capacity == c
        ckvp_compile.offloader_of(model).close()


def test_wrapper_errors_name_the_fix():
    with pytest.raises(CKVPConfigError, match=r"1\.\.4 .*got 5"):
        ckvp_compile.compile(_model(), expert_offload=5)
    with pytest.raises(CKVPConfigError, match=r"must be an int.*1\.\.E"):
        ckvp_compile.compile(_model(), expert_offload=2.0)
    with pytest.raises(CKVPConfigError, match="always uses backend='ckvp'"):
        ckvp_compile.compile(_model(), expert_offload=2, backend="inductor")
    with pytest.raises(CKVPConfigError, match="conflicts"):
        ckvp_compile.compile(_model(), expert_offload=2, options={"expert_offload": 3})
    with pytest.raises(CKVPConfigError, match="conflicts"):
        ckvp_compile.compile(_model(), mode="reduce-overhead", options={"mode": "default"})
    with pytest.raises(CKVPConfigError, match="offload_options .* expert_offload is 0"):
        ckvp_compile.compile(_model(), offload_options={"margin": 1})
    with pytest.raises(CKVPConfigError, match="nn.Module or a bound method"):
        ckvp_compile.compile(lambda x: x, expert_offload=2)
    with pytest.raises(CKVPConfigError, match="nothing to offload"):
        ckvp_compile.compile(torch.nn.Linear(2, 2), expert_offload=1)
    model = _model()
    handle = offload_experts(model, resident=2)
    with pytest.raises(CKVPConfigError, match="already offloaded with 2"):
        ckvp_compile.compile(model, expert_offload=3)
    ckvp_compile.compile(model, expert_offload=2)  # the same count: used as it is
    assert ckvp_compile.offloader_of(model) is handle
    assert ckvp_compile.offloader_of(_model()) is None
    handle.close()


@torch.no_grad()
def test_readme_form_generates_what_the_plain_model_generates():
    """README's form: the compiled forward of an offloaded fixture model under HF generate() with a static cache."""
    from ckvp_compile.testing.models import load_fixture_model

    ids = torch.tensor([list(b"def main(")])
    kw = dict(max_new_tokens=8, do_sample=False, cache_implementation="static", disable_compile=True)
    want = load_fixture_model().generate(ids, **kw)
    model = load_fixture_model()
    model.forward = ckvp_compile.compile(model.forward, expert_offload=2, offload_options={"margin": 1}, options=AOT)
    assert torch.equal(model.generate(ids, **kw), want)
    s = ckvp_compile.offloader_of(model).stats()
    assert s.calls == 8 * model.config.num_hidden_layers and s.misses > 0 and s.prefetch_copies > 0
    ckvp_compile.offloader_of(model).close()
