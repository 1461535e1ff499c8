"""transformers' grouped_mm experts compiled by Inductor on CUDA gave wrong logits in GPU checks (torch 2.11, an
H100 and an H200: benchmarks/results/2026-12-06-prefill-bug; plain torch.compile too), ckvp's expert GEMM rewrite
right in all 8 runs. The backend warns when it hands such experts to Inductor for CUDA; these tests check when
(the decision is made from the analysis, the plan and the inputs' devices: no GPU needed), and that a real HF
graph's grouped_mm experts are the ones found."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

import ckvp_compile.backend as backend
from ckvp_compile.testing import build_hf_moe


def _site(layer, form="grouped_mm"):
    return SimpleNamespace(layer=layer, experts_form=form)


def _decision(layer, rewrite):
    return SimpleNamespace(kind="moe", layer=layer, rewrite=rewrite)


@pytest.mark.parametrize("device, compiler, forms, rewrites, want", [
    ("cuda", "inductor", ["grouped_mm"] * 3, [False] * 3, [0, 1, 2]),
    ("cuda:0", "inductor", ["grouped_mm", "grouped_mm"], [True, False], [1]),  # layer 0 rewritten
    ("cuda", "inductor", ["grouped_mm"], [True], []),  # enable_expert_gemm: ckvp's own GEMM
    ("cuda", "inductor", ["batched_mm", "loop"], [False, False], []),  # other forms were not seen wrong
    ("cuda", "aot_eager", ["grouped_mm"], [False], []),  # no Inductor codegen
    ("cpu", "inductor", ["grouped_mm"], [False], []),  # CPU: right in every CPU test
])
def test_which_layers_are_at_risk(device, compiler, forms, rewrites, want):
    analysis = SimpleNamespace(moe=[_site(i, f) for i, f in enumerate(forms)])
    plan = SimpleNamespace(decisions=[_decision(i, r) for i, r in enumerate(rewrites)])
    inputs = [3, torch.empty(2), SimpleNamespace(device=torch.device(device))]  # (a device without a GPU)
    assert backend.grouped_mm_experts_at_risk(analysis, plan, inputs, compiler) == want


def test_layer_list_text():
    assert backend._layer_list([0, 1, 2, 3]) == "layers 0-3"
    assert backend._layer_list([0, 2]) == "layers 0, 2" and backend._layer_list([4]) == "layer 4"


def test_hf_grouped_mm_experts_are_found_and_the_warning_names_them(monkeypatch):
    """A Mixtral graph with grouped_mm experts (bf16: aten._grouped_mm) compiled as if by Inductor for CUDA (the
    backend's device test patched; the CPU reference op runs): with enable_expert_gemm=False the warning names every
    layer and the option as the fix; with the default ('auto', resolved on for CUDA) or True, none; for a call that
    needs gradients (the expert rewrite is inference-only) the fix named is compiler='aot_eager'."""
    monkeypatch.setattr(backend, "_on_cuda", lambda example_inputs: True)
    monkeypatch.setattr(backend, "grouped_mm_experts_at_risk",
                        lambda a, p, x, c, real=backend.grouped_mm_experts_at_risk, **kw: real(
                            a, p, x, "inductor" if c == "aot_eager" else c, **kw))
    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16).to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 5))
    for options, grad, want in (({"enable_expert_gemm": False}, False, backend.GROUPED_MM_FIX),
                                ({}, False, None), ({"enable_expert_gemm": True}, False, None),
                                ({}, True, backend.GROUPED_MM_FIX_GRAD)):
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.set_grad_enabled(grad):
                torch.compile(model, backend="ckvp", options={"compiler": "aot_eager", **options})(ids, use_cache=False)
        texts = [str(w.message) for w in caught if issubclass(w.category, backend.CKVPWarning)]
        hit = [t for t in texts if "grouped_mm experts" in t]
        assert bool(hit) is (want is not None), (options, grad, texts)
        if want:
            assert hit[0].startswith("ckvp: the experts of layers 0, 1 stay transformers' grouped_mm experts")
            assert f"Fix: {want};" in hit[0], hit[0]
    torch._dynamo.reset()


def test_layers_the_passes_left_are_at_risk_despite_the_plan():
    """A layer the plan rewrites but the expert pass left as written (or a graph compiled unchanged after a failed
    rewrite) still hands grouped_mm experts to Inductor."""
    analysis = SimpleNamespace(moe=[_site(0), _site(1)])
    plan = SimpleNamespace(decisions=[_decision(0, True), _decision(1, True)])
    inputs = [SimpleNamespace(device=torch.device("cuda"))]
    assert backend.grouped_mm_experts_at_risk(analysis, plan, inputs, "inductor") == []
    assert backend.grouped_mm_experts_at_risk(analysis, plan, inputs, "inductor", left_by_passes={1}) == [1]


@pytest.mark.parametrize("failure", ["skip", "raise"])
def test_warning_when_the_expert_pass_leaves_planned_layers(monkeypatch, failure):
    """The default 'auto' on CUDA (device test patched) plans the rewrite; when the pass cannot read a site (skip) or
    fails (the graph is compiled unchanged), the grouped_mm warning still comes, naming compiler='aot_eager' (the
    option is already on)."""
    from ckvp_compile.passes import expert_gemm

    monkeypatch.setattr(backend, "_on_cuda", lambda example_inputs: True)
    monkeypatch.setattr(backend, "grouped_mm_experts_at_risk",
                        lambda a, p, x, c, real=backend.grouped_mm_experts_at_risk, **kw: real(
                            a, p, x, "inductor" if c == "aot_eager" else c, **kw))
    if failure == "skip":
        def understand(graph, site):
            raise expert_gemm._Skip("a pattern the pass cannot read (test)")
        monkeypatch.setattr(expert_gemm, "_understand", understand)
    else:
        def rewrite(*args, **kwargs):
            raise RuntimeError("a rewrite bug (test)")
        monkeypatch.setattr(expert_gemm, "_rewrite", rewrite)
    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16).to(torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            torch.compile(model, backend="ckvp", options={"compiler": "aot_eager"})(torch.randint(0, 256, (2, 5)),
                                                                                   use_cache=False)
    hit = [str(w.message) for w in caught if issubclass(w.category, backend.CKVPWarning)
           and "grouped_mm experts" in str(w.message)]
    assert hit and hit[0].startswith("ckvp: the experts of layers 0, 1 stay"), [str(w.message) for w in caught]
    assert f"Fix: {backend.GROUPED_MM_FIX_KEPT};" in hit[0]
    torch._dynamo.reset()


def test_resolving_auto_warns_nothing_again():
    """'auto' resolved for a CUDA graph: no second copy of the config's own warnings (no re-validation)."""
    with pytest.warns(backend.CKVPWarning, match="ignored"):
        config = backend.CKVPConfig(compiler="aot_eager", mode="max-autotune")  # warns once: mode ignored
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolved = backend.resolve_expert_gemm(config, [SimpleNamespace(device=torch.device("cuda"))])
    assert resolved.enable_expert_gemm is True and config.enable_expert_gemm == "auto"
    assert resolved.mode == "max-autotune" and resolved.compute_hash() != config.compute_hash()
