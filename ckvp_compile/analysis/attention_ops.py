"""Find the attention ops of a Dynamo FX graph and read their raw operands: Q, K, V, mask, scale, heads.

Two forms are recognised by structure:

* ``sdpa``: one ``scaled_dot_product_attention`` call (query, key, value, attn_mask, is_causal, scale,
  enable_gqa read from its arguments);
* ``softmax_qkv``: ``softmax(scores) @ V`` (``matmul`` / ``bmm`` / ``@`` / ``einsum``, through views,
  dtype casts and dropout), where ``scores`` comes from ``Q @ K^T`` through ``* scale`` / ``/ scale``,
  ``+ mask``, ``masked_fill`` or ``where``. Both products must be of two activations, not a weight: a
  router's ``softmax(x @ W^T)`` feeding ``topk`` is not an attention.

Heads: Q is (B, H..., S, D) and K (B, Hk..., T, D); every dim between batch and sequence counts as heads
(so a (B, Hkv, G, S, D) grouped query gives H = Hkv*G), 3-D ``bmm`` operands are looked through to their
4-D source, and an einsum is read from its subscripts. Read-only; nothing here raises.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from .graph import VIEW_LIKE, arg, find_downstream, find_upstream, op_name, shape_of, strip_views
from .rope import strip_dtype

#: Casts (and inference-time dropout) walked through around the softmax: ``Tensor.type(dtype)`` is GPT-2's
#: ``attn_weights.type(value.dtype)`` after the softmax, a cast like ``.to(dtype)``.
_CASTS = frozenset({"dropout", "float", "to", "type_as", "type", "half", "bfloat16", "double"})
#: Ops walked through between QK^T and softmax, or between softmax and P @ V.
_SCORE_OPS = VIEW_LIKE | _CASTS | {"mul", "div", "add", "sub", "masked_fill", "where"}

@dataclass
class AttentionOp:
    """An attention op and its raw operands, before any interpretation.

    Attributes:
        node: the SDPA call, or the ``P @ V`` product. form: 'sdpa' or 'softmax_qkv'.
        q, k, v: the tensors the op reads; ``k`` un-transposed ((B, Hk, T, D) for the usual layouts).
        mask_roots: mask tensors combined with the scores (SDPA ``attn_mask``; added / masked_fill'ed).
        is_causal: SDPA's flag when no mask is passed, else None. scale: explicit softmax scale or None.
        enable_gqa: SDPA's ``enable_gqa``. heads: (H, Hk, D) when read from einsum subscripts, else None.
    """

    node: fx.Node
    form: str
    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask_roots: list[fx.Node] = field(default_factory=list)
    is_causal: bool | None = None
    scale: float | None = None
    enable_gqa: bool = False
    heads: tuple[int, int, int] | None = None  # (H, Hk as read by the op, D) when known from an einsum


def find_attention_ops(graph: fx.Graph) -> list[AttentionOp]:
    """Return every SDPA call and every softmax(QK^T)V of ``graph``, in graph order."""
    out: list[AttentionOp] = []
    for n in graph.nodes:
        kind = op_name(n)
        if kind == "sdpa" and n.op == "call_function":
            c = _sdpa_candidate(n)
        elif kind == "softmax" and n.op in ("call_function", "call_method"):
            c = _softmax_candidate(n)
        else:
            continue
        if c is not None:
            out.append(c)
    return out


def _sdpa_candidate(n: fx.Node) -> AttentionOp | None:
    q, k, v = arg(n, 0, "query"), arg(n, 1, "key"), arg(n, 2, "value")
    if not all(isinstance(x, fx.Node) for x in (q, k, v)):
        return None
    mask = arg(n, 3, "attn_mask")
    scale = arg(n, 6, "scale")
    return AttentionOp(
        node=n, form="sdpa", q=q, k=k, v=v,
        mask_roots=[mask] if isinstance(mask, fx.Node) else [],
        is_causal=bool(arg(n, 5, "is_causal", False)) if mask is None else None,
        scale=float(scale) if isinstance(scale, (int, float)) else None,
        enable_gqa=bool(arg(n, 7, "enable_gqa", False)),
    )


def is_weight(node: Any) -> bool:
    """True for a parameter-like operand: a placeholder / get_attr of rank <= 2 (through views)."""
    base = strip_views(node)
    shape = shape_of(base)
    return isinstance(base, fx.Node) and base.op in ("placeholder", "get_attr") and shape is not None and len(shape) <= 2


def weight_source(proj: fx.Node | None) -> fx.Node | None:
    """The placeholder / get_attr node of the weight a projection node (linear / matmul) multiplies by, through
    views; None when ``proj`` is None or has no parameter-like operand (:func:`is_weight`)."""
    if proj is None:
        return None
    for n in proj.all_input_nodes:
        if is_weight(n):
            while n.op not in ("placeholder", "get_attr") and n.args and isinstance(n.args[0], fx.Node):
                n = n.args[0]
            return n
    return None


def product_operands(n: fx.Node) -> tuple[str | None, list[fx.Node]]:
    """(einsum equation or None, the two tensor operands) of a matmul / einsum node."""
    if op_name(n) == "einsum":
        eq = n.args[0] if n.args and isinstance(n.args[0], str) else None
        ops = list(n.args[1]) if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else list(n.args[1:])
        return eq, [o for o in ops if isinstance(o, fx.Node)]
    return None, [a for a in n.args[:2] if isinstance(a, fx.Node)]


def is_activation_product(n: Any) -> bool:
    """A matmul / einsum of two activations (not a projection by a weight)."""
    if not isinstance(n, fx.Node) or op_name(n) not in ("matmul", "einsum"):
        return False
    _, ops = product_operands(n)
    return len(ops) == 2 and not any(is_weight(o) for o in ops)


def is_projection(n: Any) -> bool:
    """A ``linear``, or a ``matmul`` / ``mm`` / ``addmm`` / ``einsum`` with a weight placeholder operand."""
    if not isinstance(n, fx.Node):
        return False
    kind = op_name(n)
    if kind == "linear":
        return True
    if kind in ("matmul", "addmm", "einsum"):
        _, ops = product_operands(n) if kind != "addmm" else (None, list(n.all_input_nodes))
        return any(is_weight(o) for o in ops)
    return False


def _softmax_candidate(s: fx.Node) -> AttentionOp | None:
    """Match ``softmax(scores) @ V`` whose scores come from ``Q @ K^T`` (optionally scaled and masked)."""
    pv = find_downstream(s, lambda u: op_name(u) in ("matmul", "einsum"), max_depth=4,
                         through=lambda u: op_name(u) in VIEW_LIKE | _CASTS)
    if pv is None or not is_activation_product(pv):
        return None
    _, pv_ops = product_operands(pv)
    if strip_dtype(strip_views(pv_ops[0], _CASTS)) is not s and pv_ops[0] is not s:
        return None
    scored = _scores(s.args[0] if s.args else None)
    if scored is None:
        return None
    qk, mask_roots, scale = scored
    eq, (q, kt) = product_operands(qk)
    heads = None
    if eq is not None:
        heads = _einsum_heads(eq, q, kt)
        k = kt
        if heads is None:
            return None
    else:
        k = _untranspose(kt)
    return AttentionOp(node=pv, form="softmax_qkv", q=q, k=k, v=pv_ops[1], mask_roots=mask_roots,
                      scale=scale, heads=heads)


def _scores(x: Any) -> tuple[fx.Node, list[fx.Node], float | None] | None:
    """Walk from a softmax input back to the ``Q @ K^T`` product; collect mask operands and the scale."""
    mask_roots: list[fx.Node] = []
    scale: float | None = None
    for _ in range(12):
        if not isinstance(x, fx.Node):
            return None
        kind = op_name(x)
        if is_activation_product(x):
            return x, mask_roots, scale
        if kind not in _SCORE_OPS:
            return None
        if kind in VIEW_LIKE or kind in _CASTS:
            x = x.args[0]
            continue
        nodes = [a for a in (list(x.args) + list(x.kwargs.values())) if isinstance(a, fx.Node)]
        path = [a for a in nodes if _leads_to_scores(a)]
        if len(path) != 1:
            return None
        consts = [a for a in x.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        if kind in ("mul", "div") and consts and consts[0] != 0:
            scale = (scale or 1.0) * (float(consts[0]) if kind == "mul" else 1.0 / float(consts[0]))
        mask_roots.extend(a for a in nodes if a is not path[0])
        x = path[0]
    return None


def _leads_to_scores(a: fx.Node) -> bool:
    if is_activation_product(a):
        return True
    return find_upstream(a, is_activation_product, max_depth=10, through=lambda n: op_name(n) in _SCORE_OPS) is not None


def _untranspose(kt: fx.Node) -> fx.Node:
    """K from K^T: undo a transpose / permute of the last two dims (else return ``kt`` unchanged)."""
    kind = op_name(kt)
    shape = shape_of(kt)
    rank = len(shape) if shape else 0
    if kind in ("transpose", "swapaxes") and len(kt.args) >= 3:
        dims = {d % rank for d in kt.args[1:3] if isinstance(d, int)} if rank else set()
        if dims == {rank - 1, rank - 2}:
            return kt.args[0]
    if kind in ("t", "mT") and isinstance(kt.args[0], fx.Node):
        return kt.args[0]
    if kind == "permute" and rank:
        perm = kt.args[1] if len(kt.args) == 2 and isinstance(kt.args[1], (list, tuple)) else kt.args[1:]
        perm = [p % rank for p in perm if isinstance(p, int)]
        if perm == list(range(rank - 2)) + [rank - 1, rank - 2]:
            return kt.args[0]
    return kt


def op_heads(q: fx.Node, k: fx.Node) -> tuple[int, int, int]:
    """(H, Hk, D) from Q (B, H..., S, D) and K (B, Hk..., T, D): every dim between batch and sequence is heads.

    3-D operands of a ``bmm`` over (B*H, S, D) are looked through (views) to their 4-D source.
    """
    qs, ks = shape_of(_four_d(q)), shape_of(_four_d(k))
    if not qs or not ks or len(qs) < 4 or len(ks) < 4:
        return 0, 0, 0
    return math.prod(qs[1:-2]), math.prod(ks[1:-2]), qs[-1]


def _four_d(node: fx.Node) -> fx.Node:
    """``node``, or the nearest rank >= 4 tensor it is a view of (for (B*H, S, D) bmm operands)."""
    n = node
    for _ in range(6):
        shape = shape_of(n)
        if shape is not None and len(shape) >= 4:
            return n
        if op_name(n) not in VIEW_LIKE or not n.args or not isinstance(n.args[0], fx.Node):
            break
        n = n.args[0]
    return node


def _einsum_heads(eq: str, q: fx.Node, k: fx.Node) -> tuple[int, int, int] | None:
    """(H, Hk, D) from a scores einsum such as ``bhqd,bhkd->bhqk`` or ``bqhd,bkhd->bhqk``.

    D is the contracted letter, the query / key sequence letters are those only in Q / only in K (and the
    output), the batch is the first letter of Q; every other letter of Q (K) counts as heads.
    """
    m = re.fullmatch(r"\s*([a-zA-Z]+)\s*,\s*([a-zA-Z]+)\s*->\s*([a-zA-Z]+)\s*", eq)
    qs, ks = shape_of(q), shape_of(k)
    if m is None or qs is None or ks is None:
        return None
    ql, kl, out = m.groups()
    if len(ql) != len(qs) or len(kl) != len(ks):
        return None
    contracted = [c for c in ql if c in kl and c not in out]
    if len(contracted) != 1:
        return None
    d = contracted[0]
    batch = ql[0]
    q_heads = [i for i, c in enumerate(ql) if c not in (d, batch) and c in kl]
    k_heads = [i for i, c in enumerate(kl) if c not in (d, batch) and c in ql]
    q_group = [i for i, c in enumerate(ql) if c not in kl and c in out and i != _seq_index(ql, kl, out)]
    h = math.prod(qs[i] for i in q_heads + q_group)
    hk = math.prod(ks[i] for i in k_heads)
    return h, hk, qs[ql.index(d)]


def _seq_index(ql: str, kl: str, out: str) -> int:
    """Index in Q of the query-sequence letter: the last Q letter that is in the output but not in K."""
    idx = [i for i, c in enumerate(ql) if c not in kl and c in out]
    return idx[-1] if idx else -1
