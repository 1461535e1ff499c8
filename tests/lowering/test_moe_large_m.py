"""Tests of the large-M path of the ``ckvp::moe_experts`` lowering (ckvp_compile/lowering/moe.py) on CPU.

The path (compact expert-sorted rows built in Inductor IR, Inductor's own ``aten._grouped_mm`` lowering for the
GEMMs) is taken only on CUDA in bf16 with max-autotune and large M; on CPU it never is (checked), so it is tested
here by forcing it (``FORCE_LARGE_M_PATH``): Inductor's grouped_mm lowering then has only its aten extern, which
runs ``torch._grouped_mm`` eagerly, and the rest (one-hot scan, sort, gathers, SiLU, the weighted top-k sum) is
Inductor's generated C++ code. Checked against the eager op (fp32, relative error <= 1e-5): Hypothesis routings
with empty experts, every token on one expert, 1..40 experts, int32 / int64 ids, strided routing weights, gate/up
as the halves of one HF gate_up_proj (one GEMM) or as separate tensors (two GEMMs); a tiny HF Mixtral compiled
with ``backend="ckvp"``. The GPU side (Inductor's TMA template chosen by autotuning, the time at Mixtral shape)
is benchmarks/moe_lowering_gpu_check.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ckvp_compile.testing.moe_cases import make_moe_inputs, moe_routing_cases

pytest.importorskip("triton")


def _lm():
    from ckvp_compile.lowering import register_all

    register_all()
    from ckvp_compile.lowering import moe

    return moe


def _rel(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out - want).norm() / want.norm().clamp_min(1e-30))


def _compile_and_run(fn, *args):
    """Full Inductor on CPU, static shapes, no FX graph cache (it does not key on FORCE_LARGE_M_PATH); returns
    (output, generated code)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        out, codes = run_and_get_code(torch.compile(fn, backend="inductor", dynamic=False, fullgraph=True), *args)
    return out, "\n".join(codes)


def test_compat_finds_inductors_grouped_mm_lowering():
    from ckvp_compile import _compat

    lm = _lm()
    fn, why = _compat.grouped_mm_lowering()
    assert why is None and fn is lm._api.lowerings[torch.ops.aten._grouped_mm.default]
    assert lm._api.ReinterpretView is not None and lm._api.TensorBox is not None


def test_large_m_reason_names_each_condition(monkeypatch):
    lm = _lm()
    e, i, dm = 8, 14336, 4096  # Mixtral: gate and up are the halves of HF's (E, 2I, Dm) gate_up_proj
    metas = [((e, i, dm), (2 * i * dm, dm, 1), 0), ((e, i, dm), (2 * i * dm, dm, 1), i * dm),
             ((e, dm, i), (dm * i, i, 1), 0)]
    cuda, bf16 = torch.device("cuda", 0), torch.bfloat16
    monkeypatch.setattr(lm, "_cuda_capability", lambda device: (9, 0))

    def reason(device=cuda, dtype=bf16, mode="autotune", route_m=128, k=(dm, i), weights=metas):
        return lm.large_m_path_reason(device, dtype, mode, route_m, *k, lambda: weights)

    assert lm.LARGE_M_ROUTE_M == 128
    assert reason() is None
    assert reason(device=torch.device("cpu")).startswith("device cpu")
    assert reason(mode="template").startswith("not max-autotune")
    assert reason(route_m=64).startswith("route_m 64")
    for dtype in (torch.float16, torch.float32):  # torch._grouped_mm is fused (no host sync) in bf16 only
        assert reason(dtype=dtype).startswith("torch._grouped_mm not fused")
    assert reason(k=(dm + 4, i)) is not None and reason(k=(dm, i + 4)) is not None  # rows not 16-byte aligned
    assert reason(weights=metas[:2] + [None]) is not None  # a weight that may be misaligned
    monkeypatch.setattr(lm, "_cuda_capability", lambda device: (8, 0))
    assert reason() is not None
    monkeypatch.setattr(lm, "FORCE_LARGE_M_PATH", True)
    assert reason() is None and reason(device=torch.device("cpu"), dtype=torch.float32, route_m=16) is None
    # a torch whose Inductor has no usable grouped_mm lowering: the padded path, with the reason, even when forced
    monkeypatch.setattr(lm._compat, "grouped_mm_lowering", lambda: (None, "no aten._grouped_mm lowering here"))
    assert reason() == "no aten._grouped_mm lowering here"


def test_cpu_never_takes_the_large_m_path():
    """CPU behaviour is unchanged: even at route_m 128 (200 tokens, 2 experts) the padded path with the extern
    parts."""
    lm = _lm()
    x = make_moe_inputs(dict(tokens=200, num_experts=2, top_k=1, hidden=16, ffn=16, mode="random", seed=3))
    args = (x["hidden"], x["topk_ids"], x["topk_weights"], x["w_gate"], x["w_up"], x["w_down"])
    out, code = _compile_and_run(lambda *a: torch.ops.ckvp.moe_experts(*a), *args)
    d = lm.DECISIONS[-1]
    assert d["path"] == "padded" and d["route_m"] == 128 and d["reason"].startswith("device cpu"), d
    assert "moe_align" in code and "_grouped_mm(" not in code
    torch.testing.assert_close(out, torch.ops.ckvp.moe_experts(*args), rtol=1e-6, atol=1e-6)


@given(case=moe_routing_cases(max_experts=40, max_tokens=40, dims=(8, 16, 24, 40)), fused=st.booleans(),
       int32_ids=st.booleans(), strided_weights=st.booleans())
@example(case=dict(tokens=13, num_experts=4, top_k=1, hidden=16, ffn=24, mode="one_expert", seed=1), fused=True,
         int32_ids=False, strided_weights=False).via("every token on expert 0, experts 1-3 empty")
@example(case=dict(tokens=9, num_experts=40, top_k=3, hidden=24, ffn=8, mode="skewed", seed=2), fused=False,
         int32_ids=True, strided_weights=True).via("40 experts, 34 of them empty; no unrolled E-sum")
@settings(max_examples=3, deadline=None)
def test_forced_large_m_path_matches_eager(case, fused, int32_ids, strided_weights):
    lm = _lm()
    x = make_moe_inputs(case, fused_gate_up=fused)
    ids = x["topk_ids"].to(torch.int32) if int32_ids else x["topk_ids"]
    weights = x["topk_weights"].t().contiguous().t() if strided_weights else x["topk_weights"]
    i = case["ffn"]
    want = torch.ops.ckvp.moe_experts(x["hidden"], ids, weights, x["w_gate"], x["w_up"], x["w_down"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lm, "FORCE_LARGE_M_PATH", True)
        if fused:  # gate and up sliced inside the graph from one (E, 2I, Dm) tensor, as the expert pass writes them
            gate_up = torch.cat([x["w_gate"], x["w_up"]], 1)  # (E, 2I, Dm), HF's gate_up_proj layout
            out, code = _compile_and_run(
                lambda h, k, w, gu, d: torch.ops.ckvp.moe_experts(h, k, w, gu[:, :i], gu[:, i:], d),
                x["hidden"], ids, weights, gate_up, x["w_down"])
        else:
            out, code = _compile_and_run(lambda *a: torch.ops.ckvp.moe_experts(*a),
                                         x["hidden"], ids, weights, x["w_gate"], x["w_up"], x["w_down"])
    d = lm.DECISIONS[-1]
    assert d["path"] == "large_m" and d["reason"] is None and d["fused_gate_up"] == fused, d
    assert "moe_align" not in code and "ckvp_moe_" not in code
    assert code.count("_grouped_mm(") == (2 if fused else 3), code[-3000:]
    assert out.dtype == want.dtype and out.shape == want.shape
    assert _rel(out, want) <= 1e-5, (case, _rel(out, want))


def test_forced_large_m_path_in_a_compiled_hf_mixtral(monkeypatch):
    """The expert pass's graph (HF Mixtral, ``gate_up_proj`` halves) takes the path with one gate/up GEMM, and the
    logits equal eager."""
    from ckvp_compile.testing import build_hf_moe

    lm = _lm()
    monkeypatch.setattr(lm, "FORCE_LARGE_M_PATH", True)
    model = build_hf_moe("mixtral", num_layers=1, hidden=64, num_heads=4, head_dim=16, num_experts=4, ffn=32)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        eager = model(ids, use_cache=False).logits
        compiled = torch.compile(model, backend="ckvp", options={"enable_expert_gemm": True})
        out, codes = run_and_get_code(lambda: compiled(ids, use_cache=False).logits)
    code = "\n".join(codes)
    d = lm.DECISIONS[-1]
    assert d["path"] == "large_m" and d["fused_gate_up"] and (d["tokens"], d["top_k"], d["experts"]) == (14, 2, 4), d
    assert code.count("_grouped_mm(") == 2 and "moe_align" not in code
    assert _rel(out, eager) <= 1e-5, _rel(out, eager)


@settings(max_examples=60, deadline=None)
@given(pairs=st.integers(0, 20000), groups=st.integers(1, 128), alignment=st.sampled_from([1, 8, 16]))
def test_representative_group_sizes_properties(pairs, groups, alignment):
    """The large-M path's autotuning routing: E sizes, non-negative, summing to P; all but the last aligned, ascending;
    spread like a multinomial's (within 3 standard deviations plus the rounding) when the mean is a few alignments."""
    sizes = _lm().representative_group_sizes(pairs, groups, alignment)
    assert len(sizes) == groups and sum(sizes) == pairs and min(sizes) >= 0 and sizes[:-1] == sorted(sizes[:-1])
    assert all(s % alignment == 0 for s in sizes[:-1])
    mean = pairs / groups
    if mean >= 4 * alignment and groups > 1:
        std = (pairs * (1 / groups) * (1 - 1 / groups)) ** 0.5
        assert all(abs(s - mean) <= 3 * std + 2 * alignment for s in sizes)
        assert sizes[-1] > sizes[0] or std < alignment  # imbalanced, unlike Inductor's balanced ends


def test_representative_group_sizes_mixtral_batch_512():
    """1024 pairs over 8 experts: some experts above the 128-row tile (the case balanced ends hide)."""
    sizes = _lm().representative_group_sizes(1024, 8)
    assert sizes == [112, 120, 120, 128, 128, 136, 136, 144]
    with pytest.raises(ValueError, match="groups >= 1"):
        _lm().representative_group_sizes(8, 0)


class _Box:
    """A stand-in for a realized IR node (name, dtype, device)."""

    def __init__(self, name: str):
        self.name = name

    def realize(self):
        return self.name

    def get_name(self):
        return self.name

    def get_dtype(self):
        return torch.int32

    def get_device(self):
        return torch.device("cpu")


def test_autotune_group_sizes_hook_only_touches_registered_offsets(monkeypatch):
    """The wrapped ``create_offsets`` returns cumsum(sizes) for the registered buffer of the graph being lowered, and
    defers to Inductor's own function for any other buffer or graph (the baselines keep balanced ends)."""
    import torch._inductor.kernel.mm_grouped as mm_grouped

    from ckvp_compile import _compat

    calls = []

    def inductor_create_offsets(offs_box, *args):  # stands in for Inductor's (needs a real graph's sizevars)
        calls.append(offs_box.get_name())
        return "balanced"

    graph, other_graph = type("G", (), {})(), type("G", (), {})()
    current = [graph]
    monkeypatch.setattr(mm_grouped, "create_offsets", inductor_create_offsets)
    monkeypatch.setattr(_compat, "_current_graph", lambda: current[0])
    assert _compat.autotune_grouped_mm_with_group_sizes(_Box("buf7"), [3, 0, 5]) is None
    wrapped = mm_grouped.create_offsets
    assert wrapped is not inductor_create_offsets
    assert wrapped(_Box("buf7"), True, False, 8, 16, 32, 8).tolist() == [3, 3, 8]
    assert wrapped(_Box("buf8"), True, False, 8, 16, 32, 8) == "balanced"
    current[0] = other_graph
    assert wrapped(_Box("buf7"), True, False, 8, 16, 32, 8) == "balanced"
    assert calls == ["buf8", "buf7"]
    # registering again does not wrap twice
    current[0] = graph
    assert _compat.autotune_grouped_mm_with_group_sizes(_Box("buf9"), [1, 1]) is None
    assert mm_grouped.create_offsets is wrapped
    monkeypatch.setattr(_compat, "_current_graph", lambda: None)
    assert "no Inductor graph" in _compat.autotune_grouped_mm_with_group_sizes(_Box("buf1"), [1])
