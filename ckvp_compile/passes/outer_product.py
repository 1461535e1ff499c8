"""OuterProductPass: a matrix product over a contraction of length 1 (an outer product) becomes a broadcast multiply.

Runs on Inductor's functional post-grad graph ('post_grad' stage, with the other ckvp post-grad passes)::

    aten.bmm(a (B, M, 1), b (B, 1, N))   ->   aten.mul(a, b)   (B, M, N)
    aten.mm(a (M, 1), b (1, N))          ->   aten.mul(a, b)   (M, N)

Why: every HF rotary embedding computes its angles as such a product, ``inv_freq[None, :, None] @
position_ids[:, None, :]`` (B, D/2, 1) x (B, 1, S). Under Inductor on CUDA (torch 2.11, an H100) the ``bmm`` extern
got operands laid out by Inductor with padded strides on their size-1 dimensions ((B, 32, 1) at strides (32, 1, 64),
(B, 1, S) at (S, 4, 1)), and the compiled fixture's prefill of 2 sequences of 2+ tokens was wrong by up to 10
logits (benchmarks/results/2026-12-06-prefill-bug) with a dense cache as with a latent one; batch 1 was right.
A multiply computes each element with the one rounding the product has (fp32 inputs: the same value cuBLAS gives
without TF32; with TF32 on, the unrounded product), reads nothing twice, and Inductor fuses it into the cos / sin
kernel that follows: no cuBLAS call, no layout to get wrong.

Sizes must be static and the operands floating point; anything else is left as it was.
Reference: torch/_inductor/fx_passes/post_grad.py (the custom post-grad pass hook).
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from .base import CKVPPass

logger = logging.getLogger(__name__)

aten = torch.ops.aten


def _val(node: object):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def outer_product_operands(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(a, b)`` when ``node`` is an ``aten.bmm`` / ``aten.mm`` over a contraction of static length 1 between
    floating-point operands of static shapes, else None."""
    if node.op != "call_function" or node.target not in (aten.bmm.default, aten.mm.default) or len(node.args) != 2:
        return None
    a, b = node.args
    va, vb = _val(a), _val(b)
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return None
    if not (va.dtype.is_floating_point and vb.dtype.is_floating_point and va.dtype == vb.dtype):
        return None
    if not all(isinstance(s, int) for s in (*va.shape, *vb.shape)):
        return None
    if va.shape[-1] != 1 or vb.shape[-2] != 1:
        return None
    return a, b


class OuterProductPass(CKVPPass):
    """Rewrite ``bmm`` / ``mm`` over a contraction of length 1 as a broadcast ``mul`` (module docstring).

    ``apply`` returns the number of products rewritten.
    """

    name = "outer_product"
    stage = "post_grad"

    def is_applicable(self, graph: fx.Graph) -> str:
        return "" if any(outer_product_operands(n) for n in graph.nodes) else "no matrix product over a length-1 contraction"

    def apply(self, graph: fx.Graph) -> int:
        count = 0
        for node in list(graph.nodes):
            ops = outer_product_operands(node)
            if ops is None:
                continue
            a, b = ops
            with graph.inserting_before(node):
                mul = graph.call_function(aten.mul.Tensor, (a, b))
            mul.meta.update(node.meta)
            mul.meta["val"] = _val(a) * _val(b)
            node.replace_all_uses_with(mul)
            graph.erase_node(node)
            count += 1
        if count:
            logger.debug("ckvp: %d outer product(s) as broadcast multiplies", count)
        return count
