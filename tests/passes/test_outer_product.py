"""OuterProductPass: ``bmm`` / ``mm`` over a contraction of length 1 as a broadcast multiply, bit-equal.

Hypothesis draws the product's sizes, its dtype and the operands' layouts (an expanded view, a transposed copy,
a slice), traces it to an ATen graph with fake tensors, runs the pass and compares the rewritten graph with the
function on the same inputs (``torch.equal``: one rounding per element either way). Products over a longer
contraction and integer ones are left alone; the fixture's rotary embedding (HF's ``inv_freq @ position_ids``) is
left without a ``bmm`` in a compiled model (torch 2.13 decomposes it itself, 2.11 keeps it for the pass), whose
logits stay those of eager (fp32, within the decompositions' summation order).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from ckvp_compile import CKVPBackend, CKVPConfig, CompileRecorder
from ckvp_compile.passes.outer_product import OuterProductPass, outer_product_operands

aten = torch.ops.aten


def _rewritten(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    n = OuterProductPass().apply(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm, n


def _targets(gm):
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 4), m=st.integers(1, 40), n=st.integers(1, 9), batched=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), layout=st.sampled_from(
           ["contiguous", "expanded", "transposed", "sliced"]), seed=st.integers(0, 2**16))
def test_outer_products_become_equal_multiplies(b, m, n, batched, dtype, layout, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(b, m, 1, generator=g).to(dtype)
    pos = torch.randint(0, 4096, (b, n), generator=g).to(dtype)

    def fn(a, pos):
        if layout == "expanded":  # HF's rotary embedding: inv_freq[None, :, None].expand(B, -1, 1)
            x = a[:1].expand(a.shape[0], -1, 1)
        elif layout == "transposed":
            x = a.transpose(1, 2).contiguous().transpose(1, 2)
        elif layout == "sliced":
            x = torch.cat([a, a], dim=1)[:, ::2]
        else:
            x = a
        y = pos[:, None, :]
        return torch.bmm(x, y) if batched else torch.mm(x[0], y[0])

    gm, count = _rewritten(fn, a, pos)
    assert count == 1
    assert aten.bmm.default not in _targets(gm) and aten.mm.default not in _targets(gm)
    want, got = fn(a, pos), gm(a, pos)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want)


@pytest.mark.parametrize("case", ["contraction 2", "integer", "matmul of vectors"])
def test_other_products_are_left_alone(case):
    if case == "contraction 2":
        def fn(x, y):
            return torch.bmm(x, y)
        args = (torch.randn(2, 3, 2), torch.randn(2, 2, 4))
    elif case == "integer":
        def fn(x, y):
            return torch.mm(x, y)
        args = (torch.randint(0, 9, (3, 1)), torch.randint(0, 9, (1, 4)))
    else:
        def fn(x, y):
            return torch.mm(x[None], y[:, None])  # (1, 5) @ (5, 1): contraction 5
        args = (torch.randn(5), torch.randn(5))
    gm = make_fx(fn, tracing_mode="fake")(*args)
    assert not any(outer_product_operands(n) for n in gm.graph.nodes)
    assert OuterProductPass().is_applicable(gm.graph)
    assert OuterProductPass().apply(gm.graph) == 0


def test_fixture_rotary_embedding_is_rewritten_and_logits_unchanged():
    from ckvp_compile.testing import load_fixture_model

    model = load_fixture_model().eval()
    ids = torch.tensor([[0, 5, 9], [7, 1, 3]])
    torch._dynamo.reset()
    rec = CompileRecorder()
    comp = torch.compile(model, backend=CKVPBackend(CKVPConfig(compiler="aot_eager"), recorder=rec))
    with torch.no_grad():
        want = model(ids).logits
        got = comp(ids).logits
    torch._dynamo.reset()
    # torch 2.13's Inductor decomposes these products itself (its bmm decomposition's outer-product case); 2.11
    # keeps a bmm, which the pass rewrites: either way none is left for the ATen matmul kernels
    results = [r for g in rec.graphs for r in g.pass_results if r.name == "outer_product"]
    assert results and all(r.matched >= 1 or r.skipped for r in results)
    assert all("bmm" not in g.post_grad_after for g in rec.graphs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)  # fp32; AOT's decompositions sum in their order
