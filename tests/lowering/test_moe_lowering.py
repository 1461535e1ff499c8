"""Tests of the Inductor lowering of ``ckvp::moe_experts`` (ckvp_compile/lowering/moe.py) on CPU.

* In process: the lowering registers (idempotently) and full Inductor on CPU decomposes the op into the routing
  extern, the two extern GEMM choices (the reference parts: the only choice on CPU) and a fused sum, and stays
  exact against the eager op (Hypothesis: any routing, empty experts, one expert, top-k 1..8, up to 64 experts,
  strided weights).
* Under the Triton interpreter (child process, as tests/kernels/test_grouped_gemm.py): both ``TritonTemplate``\\ s
  are rendered by the installed Inductor (``TritonTemplate.generate`` in a bare ``GraphLowering``, CPU layouts,
  ``cpu_backend='triton'``; Triton's driver hash stubbed, no GPU), and the generated kernels run on CPU tensors
  against the PyTorch references: every template config shape class (sub-tiles of the routing tile, partial
  tiles, HF fused gate_up halves as strided inputs with an offset, fp32 IEEE dots; the down template reads NaN pad
  rows of ``act`` into no stored row).
* Autotune mode (forced on CPU): the ``torch._grouped_mm`` extern choices are offered exactly where
  ``grouped_mm_choice_ok`` allows (CUDA bf16, aligned operands), and the compiled graph that picks them is exact.
"""

from __future__ import annotations

import os as _os
import sys as _sys

_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))  # template_render

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckvp_compile.testing.moe_cases import make_moe_inputs, moe_routing_cases

CASES = [  # (tokens, experts, top_k, hidden, ffn, mode, seed, route_m, block_m)
    (7, 4, 2, 16, 24, "random", 0, 32, 16),
    (9, 6, 1, 24, 16, "one_expert", 1, 16, 16),
    (5, 8, 4, 40, 24, "skewed", 2, 32, 32),
    (3, 3, 3, 16, 40, "duplicate", 3, 64, 16),
]


def _args(x: dict) -> tuple:
    return x["hidden"], x["topk_ids"], x["topk_weights"], x["w_gate"], x["w_up"], x["w_down"]


def test_register_all_is_idempotent_and_names_the_ops():
    pytest.importorskip("triton")
    from ckvp_compile.lowering import register_all

    first = register_all()
    assert first == register_all()
    assert {"ckvp::moe_experts", "ckvp::moe_gate_up", "ckvp::moe_down"} <= set(first)
    from ckvp_compile.lowering import moe

    for kind in ("gate_up", "down"):
        for route_m in (16, 32, 64, 128):
            cfgs = moe.template_configs(kind, route_m, 2)
            assert cfgs and all(c.split_k == 1 and route_m % c.rows(route_m) == 0 for c in cfgs)


@given(kind=st.sampled_from(["gate_up", "down"]), route_m=st.sampled_from([16, 32]),
       pairs=st.integers(1, 4096), experts=st.integers(1, 128), n=st.integers(8, 16384),
       sms=st.lists(st.integers(1, 4096), min_size=2, max_size=2))
@settings(max_examples=60, deadline=None)
def test_default_template_config_properties(kind, route_m, pairs, experts, n, sms):
    """Without max-autotune one config is compiled: always one of the candidates; the first (the tuned default)
    when one SM is enough; the narrowest N tiles when no grid can fill the GPU; and a larger GPU never moves the
    choice back to an earlier (wider-tiled) candidate. (Small M buckets: every candidate there has the bucket's
    rows, so the programs differ by their N tiles only.)"""
    pytest.importorskip("triton")
    from ckvp_compile.lowering import moe

    cfgs = moe.template_configs(kind, route_m, 2)
    pick = lambda n_sms: moe.default_template_config(cfgs, route_m, pairs, experts, n, n_sms)  # noqa: E731
    assert all(pick(x) in cfgs for x in sms)
    assert pick(1) == cfgs[0]
    narrowest = -(-n // min(c.block_n for c in cfgs))
    assert -(-n // pick(10**9).block_n) == narrowest
    lo, hi = sorted(sms)
    first_lo, first_hi = cfgs.index(pick(lo)), cfgs.index(pick(hi))
    rows = max(min(experts, pairs), -(-pairs // route_m))
    if rows * narrowest >= hi:  # both GPUs can be filled: the choice only moves later in the list
        assert first_lo <= first_hi


def test_default_template_config_at_decode_shapes():
    """Qwen1.5-MoE at batch 1 (4 of 60 experts, I = 1408; the shared expert I = 5632) gets narrow gate/up tiles
    (176 programs, not 44); Mixtral-8x7B (2 of 8 experts, I = 14336) keeps the tuned first config."""
    pytest.importorskip("triton")
    from ckvp_compile.lowering import moe

    gate_up = moe.template_configs("gate_up", 16, 2)
    assert moe.default_template_config(gate_up, 16, 4, 60, 1408, 132).block_n == 32
    assert moe.default_template_config(gate_up, 16, 1, 1, 5632, 132).block_n == 32
    assert moe.default_template_config(gate_up, 16, 2, 8, 14336, 132) == gate_up[0]
    down = moe.template_configs("down", 16, 2)
    assert moe.default_template_config(down, 16, 2, 8, 4096, 132) == down[0]


def _compiled_inductor(fn):
    # plain Inductor: its FX graph cache does not key on this package's lowerings (the ckvp backend's does)
    torch._dynamo.reset()
    return torch.compile(fn, backend="inductor", dynamic=False, fullgraph=True,
                         options={"fx_graph_cache": False})


@given(case=moe_routing_cases(max_tokens=24, dims=(8, 16, 24)))
@settings(max_examples=4, deadline=None)
def test_cpu_inductor_picks_the_extern_parts_and_stays_exact(case):
    """On CPU the only choice is the extern (reference) part: exactly the eager op's numbers."""
    pytest.importorskip("triton")
    from torch._inductor.utils import run_and_get_code

    from ckvp_compile.lowering import register_all

    register_all()
    x = make_moe_inputs(case)

    def f(h, ids, w, g, u, d):
        return torch.ops.ckvp.moe_experts(h, ids, w, g, u, d)

    out, codes = run_and_get_code(_compiled_inductor(f), *_args(x))
    code = "\n".join(codes)
    assert "ckvp_moe_gate_up_extern" in code and "ckvp_moe_down_extern" in code, code[-2000:]
    # one expert (a shared expert): the identity routing is built in IR, no moe_align call
    assert ("torch.ops.ckvp.moe_align.default" in code) == (case["num_experts"] > 1)
    want = torch.ops.ckvp.moe_experts(*_args(x))
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    if case["top_k"] <= 2:  # a sum of at most two rows has one rounding order
        assert torch.equal(out, want)


@given(tokens=st.integers(1, 70), route_m=st.sampled_from((16, 32, 64, 128)))
@settings(max_examples=8, deadline=None)
def test_one_expert_routing_ir_equals_moe_align(tokens, route_m):
    """E = 1 (a shared expert run as a one-expert MoE): the routing the lowering builds in Inductor IR, without
    reading the ids, equals ``moe_align_ref`` (pad rows hold P; tiles past P carry the pad expert)."""
    pytest.importorskip("triton")
    from ckvp_compile.kernels import moe_reference as moe_ref
    from ckvp_compile.lowering import register_all

    register_all()  # the ckvp ops and their lowerings (lowering.moe reads the ops when imported)
    from ckvp_compile.lowering import moe

    def f(ids):  # ids are unread: the routing of E = 1 is fixed by P alone
        return torch.ops.ckvp.moe_align(ids, 1, route_m)

    def lowered(gm, example_inputs):
        from torch._inductor import lowering as L

        def one_expert(ids, num_experts, block_m):
            return moe._one_expert_routing(int(ids.get_size()[0]) * int(ids.get_size()[1]), block_m,
                                           ids.get_device())

        saved = L.lowerings.get(torch.ops.ckvp.moe_align.default)
        L.lowerings[torch.ops.ckvp.moe_align.default] = one_expert
        try:
            from torch._inductor import config as inductor_config
            from torch._inductor.compile_fx import compile_fx

            with inductor_config.patch(fx_graph_cache=False):  # its key does not see the patched lowering
                return compile_fx(gm, example_inputs)
        finally:
            if saved is None:
                L.lowerings.pop(torch.ops.ckvp.moe_align.default, None)
            else:
                L.lowerings[torch.ops.ckvp.moe_align.default] = saved

    ids = torch.zeros(tokens, 1, dtype=torch.int64)
    torch._dynamo.reset()
    got = torch.compile(f, backend=lowered, dynamic=False, fullgraph=True)(ids)
    want = moe_ref.moe_align_ref(ids, 1, route_m)
    assert all(a.dtype == torch.int32 and torch.equal(a, b) for a, b in zip(got, want)), (got, want)


def test_cpu_inductor_symbolic_sizes_keep_the_whole_op():
    pytest.importorskip("triton")
    from torch._inductor.utils import run_and_get_code

    from ckvp_compile.lowering import register_all

    register_all()
    x = make_moe_inputs(dict(tokens=5, num_experts=4, top_k=2, hidden=16, ffn=16, mode="random", seed=1))
    torch._dynamo.reset()
    f = torch.compile(lambda *a: torch.ops.ckvp.moe_experts(*a), backend="inductor", dynamic=True)
    out, codes = run_and_get_code(f, *_args(x))
    assert "torch.ops.ckvp.moe_experts.default" in "\n".join(codes)
    torch.testing.assert_close(out, torch.ops.ckvp.moe_experts(*_args(x)))


def test_grouped_mm_choice_only_on_cuda_bf16_with_aligned_operands(monkeypatch):
    pytest.importorskip("triton")
    from ckvp_compile.lowering import register_all

    register_all()
    from ckvp_compile.lowering import moe as lm

    e, i, dm = 8, 14336, 4096  # Mixtral: gate and up are the halves of HF's (E, 2I, Dm) gate_up_proj
    gate = ((e, i, dm), (2 * i * dm, dm, 1), 0)
    up = ((e, i, dm), (2 * i * dm, dm, 1), i * dm)
    cuda = torch.device("cuda", 0)
    assert not lm.grouped_mm_choice_ok(torch.device("cpu"), torch.bfloat16, dm, [gate, up])
    monkeypatch.setattr(lm, "_cuda_capability", lambda device: (9, 0))
    assert lm.grouped_mm_choice_ok(cuda, torch.bfloat16, dm, [gate, up])
    assert not lm.grouped_mm_choice_ok(torch.device("cpu"), torch.bfloat16, dm, [gate, up])
    for dtype in (torch.float16, torch.float32):  # torch._grouped_mm loops over the groups with a host sync
        assert not lm.grouped_mm_choice_ok(cuda, dtype, dm, [gate, up])
    assert not lm.grouped_mm_choice_ok(cuda, torch.bfloat16, dm + 4, [gate, up])  # compact rows not 16-byte aligned
    assert not lm.grouped_mm_choice_ok(cuda, torch.bfloat16, dm, [gate, None])  # a symbolic size or stride
    assert not lm.grouped_mm_choice_ok(cuda, torch.bfloat16, dm, [gate, (up[0], up[1], i * dm + 4)])
    monkeypatch.setattr(lm, "_cuda_capability", lambda device: (8, 0))
    assert not lm.grouped_mm_choice_ok(cuda, torch.bfloat16, dm, [gate, up])


def test_autotune_mode_offers_the_grouped_mm_choices_where_supported(monkeypatch):
    """The choice lists of both GEMMs in autotune mode (forced on CPU, templates left out): the extern alone where
    ``grouped_mm_choice_ok`` says no; extern + grouped_mm where it says yes. With the grouped_mm choices picked,
    Inductor's output calls them and equals the eager op."""
    pytest.importorskip("triton")
    from torch._inductor.utils import run_and_get_code

    from ckvp_compile.lowering import register_all

    register_all()
    from ckvp_compile.lowering import moe as lm

    seen: list[list[str]] = []
    select = lm._api.autotune_select_algorithm

    def only_grouped_mm(name, choices, *args, **kwargs):
        seen.append([c.name for c in choices])
        keep = [c for c in choices if c.name in lm.GROUPED_MM_NAMES] or choices
        return select(name, keep, *args, **kwargs)

    monkeypatch.setattr(lm, "_mode", lambda layout: "autotune")
    monkeypatch.setattr(lm, "template_configs", lambda *args: [])
    monkeypatch.setattr(lm._api, "autotune_select_algorithm", only_grouped_mm)
    x = make_moe_inputs(dict(tokens=11, num_experts=6, top_k=2, hidden=16, ffn=24, mode="skewed", seed=5))

    def f(h, ids, w, g, u, d):
        return torch.ops.ckvp.moe_experts(h, ids, w, g, u, d)

    with torch._inductor.config.patch(force_disable_caches=True):
        _compiled_inductor(f)(*_args(x))
        assert seen == [[lm.EXTERN_NAMES[0]], [lm.EXTERN_NAMES[1]]]  # CPU: no grouped_mm choice
        seen.clear()
        asked: list[tuple] = []
        aligned: list[bool] = []
        buffer_aligned = lm._buffer_aligned
        monkeypatch.setattr(lm, "grouped_mm_choice_ok", lambda *args: asked.append(args) or True)
        monkeypatch.setattr(lm, "_buffer_aligned", lambda node: aligned.append(buffer_aligned(node)) or True)
        out, codes = run_and_get_code(_compiled_inductor(f), *_args(x))
    assert seen == [[lm.EXTERN_NAMES[0], lm.GROUPED_MM_NAMES[0]], [lm.EXTERN_NAMES[1], lm.GROUPED_MM_NAMES[1]]]
    assert aligned == [False] * 3  # Inductor assumes no CPU input 16-byte aligned (GPU: from the example inputs)
    # each weight is its own graph input: its sizes and strides, offset 0 from its own (aligned) pointer
    metas = [(tuple(w.shape), w.stride(), 0) for w in (x["w_gate"], x["w_up"], x["w_down"])]
    assert [(a[1], a[2], a[3]) for a in asked] == [(torch.float32, 16, metas[:2]), (torch.float32, 24, metas[2:])]
    code = "\n".join(codes)
    assert lm.GROUPED_MM_NAMES[0] in code and lm.GROUPED_MM_NAMES[1] in code, code[-2000:]
    torch.testing.assert_close(out, torch.ops.ckvp.moe_experts(*_args(x)), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ templates


def _render(template, inputs: dict[str, torch.Tensor], layout_shape, layout_dtype, call_sizes=None, **meta):
    """The generated kernel of ``template`` for these CPU inputs (tests/lowering/template_render.py)."""
    from template_render import render_template

    return render_template(template, inputs, layout_shape, layout_dtype, call_sizes=call_sizes, **meta)


def _check_templates() -> None:
    """Render both templates for every case and compare their kernels with the references."""
    import triton

    from ckvp_compile.kernels import moe_reference as ref
    from ckvp_compile.lowering import register_all

    assert os.environ.get("TRITON_INTERPRET") == "1"
    register_all()
    from ckvp_compile.lowering import moe as lm

    for t, e, a, dm, i, mode, seed, route_m, bm in CASES:
        x = make_moe_inputs(dict(tokens=t, num_experts=e, top_k=a, hidden=dm, ffn=i, mode=mode, seed=seed))
        sorted_ids, tile_expert = ref.moe_align_ref(x["topk_ids"], e, route_m)
        p_pad = sorted_ids.shape[0]
        gate, up = x["w_gate"], x["w_up"]  # halves of one (E, 2I, Dm) tensor: strided, up with an offset
        assert up.storage_offset() > 0
        meta = dict(num_stages=2, num_warps=1, TOP_K=a, ROUTE_M=route_m, BLOCK_M=bm, BLOCK_N=16, BLOCK_K=16,
                    NUM_PAIRS=t * a, PRECISION="'ieee'")
        # gate and up are views of one buffer: give the template two inputs with their own offsets, as Inductor
        # would (the generated code adds each view's offset to the shared argument)
        fn, src = _render(lm.gate_up_template, dict(hidden=x["hidden"], sorted=sorted_ids, tiles=tile_expert,
                                                     wg=gate, wu=up), (p_pad, i), torch.float32, **meta)
        assert "def _ckvp_gate_up_tile(" in src
        act = torch.full((p_pad, i), float("nan"))
        grid = (p_pad // bm, triton.cdiv(i, 16))
        storage = torch.empty(0, dtype=gate.dtype).set_(gate.untyped_storage())  # what Inductor passes for a view
        fn[grid](x["hidden"], sorted_ids, tile_expert, storage, storage, act)
        want = ref.grouped_gate_up_ref(x["hidden"], sorted_ids, tile_expert, gate, up, a, route_m)
        written = ~act.isnan().any(1)
        valid_rows = sorted_ids.long() < t * a
        assert bool(written[valid_rows].all()), (t, e, a, route_m, bm)  # every real pair's row is computed
        torch.testing.assert_close(act[written], want[written], rtol=1e-5, atol=1e-6)

        pairs_want = ref.grouped_down_ref(want, sorted_ids, tile_expert, x["w_down"], x["topk_weights"], route_m)
        weights = x["topk_weights"].t().contiguous().t()  # column-major (T, A): strides honoured
        fn, src = _render(lm.down_template, dict(act=want, sorted=sorted_ids, tiles=tile_expert, wd=x["w_down"],
                                                  topk_w=weights), (t * a, dm), torch.float32,
                          call_sizes=[p_pad, dm], **meta)
        assert "def _ckvp_down_tile(" in src
        pairs = torch.full((t * a, dm), float("nan"))
        poisoned = want.clone()  # pad rows of act are unspecified (the grouped_mm choice leaves them unwritten)
        poisoned[~valid_rows] = float("nan")
        fn[(p_pad // bm, triton.cdiv(dm, 16))](poisoned, sorted_ids, tile_expert, x["w_down"], weights, pairs)
        torch.testing.assert_close(pairs, pairs_want, rtol=1e-5, atol=1e-6)  # no NaN reaches a stored row
    print("ok", len(CASES))


def test_templates_render_and_match_references_under_interpreter():
    pytest.importorskip("triton")
    from ckvp_compile.testing.interpreter import run_under_triton_interpreter

    proc = run_under_triton_interpreter(__file__, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.strip().endswith(f"ok {len(CASES)}")


if __name__ == "__main__":
    _check_templates()
