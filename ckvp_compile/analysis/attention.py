"""Find every layer's attention in a Dynamo FX graph: the op, Q/K/V/O projections, RoPE, GQA and KV-cache writes.

Found by structure only (never by module class names):

* the attention op: one ``scaled_dot_product_attention`` node, or a hand-written
  ``softmax(Q K^T [* scale | / scale] [+ mask | masked_fill | where]) V`` through ``matmul`` / ``bmm`` /
  ``@`` / ``einsum`` (the ``P @ V`` product is the attention node);
* K/V: each input is traced back through views, cache slices and GQA head expansion
  (:mod:`.kv_cache`) to a cache buffer with a positional write (the :class:`~.sites.CacheWriteSite`), a
  growing ``cat`` (dynamic cache), or the freshly computed K/V (no cache);
* RoPE on the key that is written (or read), by :mod:`.rope`; its input is the pre-RoPE key ``k_in``;
* projections: the nearest ``linear`` (or ``matmul`` / ``einsum`` with a weight placeholder) upstream of
  Q, ``k_in`` and V, and downstream of the attention for O;
* shapes: H and D from Q (B, H, S, D); Hkv from K before head expansion; ``gqa_form`` from how K reaches
  the op.

Recognised but unusable patterns are returned as :class:`~.sites.UnsupportedSite` and get no site:

==================  ============================================================================
kind                structure
==================  ============================================================================
``dynamic_cache``   K/V grow by ``cat([past, new], dim=-2)`` (HF ``DynamicCache``)
``mla_attention``   K/V rebuilt by an up-projection of what the cache holds, or K assembled along the
                    head dim from separate parts (DeepSeek-V2/V3 multi-head latent attention)
``sliding_window``  the attention mask compares key and query positions with a constant offset
                    (``kv > q - W``) next to the causal comparison, or uses ``tril``/``triu`` with a
                    negative diagonal
==================  ============================================================================

Anything else that is not understood (e.g. K read from a buffer that is never written in the graph) is
skipped silently; :func:`find_attention_sites` never raises.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from .graph import (
    VIEW_LIKE,
    arg,
    find_downstream,
    find_upstream,
    layer_index,
    module_path,
    node_map,
    op_name,
    shape_of,
    strip_views,
)
from .kv_cache import ALLOC_OPS, KVTrace, cache_write_site, grown_cache, is_cache_buffer, trace_kv
from .rope import last_dim_selection, match_rope, strip_dtype
from .sites import AttentionSite, RopeSite, UnsupportedSite

logger = logging.getLogger(__name__)

#: Ops walked through between QK^T and softmax, or between softmax and P @ V.
_SCORE_OPS = VIEW_LIKE | {"mul", "div", "add", "sub", "masked_fill", "where", "dropout", "float", "to", "type_as"}
#: Ops walked through between an input projection and the tensor fed to RoPE / attention (views, norms, splits).
_PROJ_PATH_OPS = VIEW_LIKE | {
    "getitem", "split", "chunk", "unbind", "mul", "add", "sub", "div", "neg", "cat", "stack", "pow", "mean",
    "rsqrt", "sqrt", "var", "layer_norm", "rms_norm", "float", "to", "type_as", "view_as_complex",
    "view_as_real", "select",
}
_COMPARE_OPS = frozenset({"gt", "ge", "lt", "le"})

_DYNAMIC_FIX = (
    "use a static cache: generate(..., cache_implementation=\"static\"), or pass a transformers StaticCache "
    "as past_key_values."
)
_MLA_FIX = "nothing to do, ckvp leaves MLA as is."
_SLIDING_FIX = (
    "NYI: sliding-window layers stay dense; keep them out of ckvp, or run the model without a sliding "
    "window if it allows (sliding_window=None / use_sliding_window=False)."
)


@dataclass
class _Candidate:
    """An attention op and its raw inputs, before any interpretation."""

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


def find_attention_sites(graph: fx.Graph) -> tuple[list[AttentionSite], list[UnsupportedSite]]:
    """Find one :class:`AttentionSite` per attention in a Dynamo (torch-level) graph.

    Args:
        graph: the FX graph Dynamo hands a backend (call_function / call_method nodes, parameters and
            buffers as placeholders, ``example_value`` fake tensors, ``nn_module_stack``).
    Returns:
        ``(sites, unsupported)``: sites in graph order (one per attention op understood); unsupported
        patterns (dynamic cache, MLA, sliding window) with reason and fix, which get no site.
        Layer indices come from ``nn_module_stack`` (:func:`~.graph.layer_index`); when no attention has
        one, attentions are numbered in graph order.
    Raises:
        Nothing: an attention that cannot be analysed is skipped (logged at DEBUG).
    """
    try:
        candidates = _candidates(graph)
    except Exception:  # analysis never raises on unknown graphs
        logger.debug("ckvp: attention candidate search failed", exc_info=True)
        return [], []
    layers = _layers(candidates)
    nodes = node_map(graph)
    sites: list[AttentionSite] = []
    unsupported: list[UnsupportedSite] = []
    for cand, layer in zip(candidates, layers):
        try:
            site, bad = _analyse(cand, layer, nodes)
        except Exception:
            logger.debug("ckvp: attention at %s not analysed", cand.node.name, exc_info=True)
            continue
        unsupported.extend(bad)
        if site is not None:
            sites.append(site)
    logger.debug("ckvp: %d attention sites, %d unsupported", len(sites), len(unsupported))
    return sites, unsupported


def _layers(candidates: list[_Candidate]) -> list[int]:
    found = [layer_index(c.node) for c in candidates]
    if all(x is None for x in found):
        return list(range(len(candidates)))
    used = {x for x in found if x is not None}
    out, nxt = [], 0
    for x in found:
        if x is None:
            while nxt in used:
                nxt += 1
            used.add(nxt)
            x = nxt
        out.append(x)
    return out


# ----------------------------------------------------------------------------------------------------------
# attention ops


def _candidates(graph: fx.Graph) -> list[_Candidate]:
    out: list[_Candidate] = []
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


def _sdpa_candidate(n: fx.Node) -> _Candidate | None:
    q, k, v = arg(n, 0, "query"), arg(n, 1, "key"), arg(n, 2, "value")
    if not all(isinstance(x, fx.Node) for x in (q, k, v)):
        return None
    mask = arg(n, 3, "attn_mask")
    scale = arg(n, 6, "scale")
    return _Candidate(
        node=n, form="sdpa", q=q, k=k, v=v,
        mask_roots=[mask] if isinstance(mask, fx.Node) else [],
        is_causal=bool(arg(n, 5, "is_causal", False)) if mask is None else None,
        scale=float(scale) if isinstance(scale, (int, float)) else None,
        enable_gqa=bool(arg(n, 7, "enable_gqa", False)),
    )


def _is_weight(node: Any) -> bool:
    """True for a parameter-like operand: a placeholder / get_attr of rank <= 2 (through views)."""
    base = strip_views(node)
    shape = shape_of(base)
    return isinstance(base, fx.Node) and base.op in ("placeholder", "get_attr") and shape is not None and len(shape) <= 2


def _product_operands(n: fx.Node) -> tuple[str | None, list[fx.Node]]:
    """(einsum equation or None, the two tensor operands) of a matmul / einsum node."""
    if op_name(n) == "einsum":
        eq = n.args[0] if n.args and isinstance(n.args[0], str) else None
        ops = list(n.args[1]) if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else list(n.args[1:])
        return eq, [o for o in ops if isinstance(o, fx.Node)]
    return None, [a for a in n.args[:2] if isinstance(a, fx.Node)]


def _is_activation_product(n: Any) -> bool:
    """A matmul / einsum of two activations (not a projection by a weight)."""
    if not isinstance(n, fx.Node) or op_name(n) not in ("matmul", "einsum"):
        return False
    _, ops = _product_operands(n)
    return len(ops) == 2 and not any(_is_weight(o) for o in ops)


def _softmax_candidate(s: fx.Node) -> _Candidate | None:
    """Match ``softmax(scores) @ V`` whose scores come from ``Q @ K^T`` (optionally scaled and masked)."""
    pv = find_downstream(s, lambda u: op_name(u) in ("matmul", "einsum"), max_depth=4,
                         through=lambda u: op_name(u) in VIEW_LIKE | {"dropout", "float", "to", "type_as"})
    if pv is None or not _is_activation_product(pv):
        return None
    _, pv_ops = _product_operands(pv)
    if strip_dtype(strip_views(pv_ops[0], ("dropout",))) is not s and pv_ops[0] is not s:
        return None
    scored = _scores(s.args[0] if s.args else None)
    if scored is None:
        return None
    qk, mask_roots, scale = scored
    eq, (q, kt) = _product_operands(qk)
    heads = None
    if eq is not None:
        heads = _einsum_heads(eq, q, kt)
        k = kt
        if heads is None:
            return None
    else:
        k = _untranspose(kt)
    return _Candidate(node=pv, form="softmax_qkv", q=q, k=k, v=pv_ops[1], mask_roots=mask_roots,
                      scale=scale, heads=heads)


def _scores(x: Any) -> tuple[fx.Node, list[fx.Node], float | None] | None:
    """Walk from a softmax input back to the ``Q @ K^T`` product; collect mask operands and the scale."""
    mask_roots: list[fx.Node] = []
    scale: float | None = None
    for _ in range(12):
        if not isinstance(x, fx.Node):
            return None
        kind = op_name(x)
        if _is_activation_product(x):
            return x, mask_roots, scale
        if kind not in _SCORE_OPS:
            return None
        if kind in VIEW_LIKE or kind in ("dropout", "float", "to", "type_as"):
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
    if _is_activation_product(a):
        return True
    return find_upstream(a, _is_activation_product, max_depth=10, through=lambda n: op_name(n) in _SCORE_OPS) is not None


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


# ----------------------------------------------------------------------------------------------------------
# one attention


def _analyse(c: _Candidate, layer: int, nodes: dict[str, fx.Node]) -> tuple[AttentionSite | None, list[UnsupportedSite]]:
    kt, vt = trace_kv(c.k), trace_kv(c.v)
    bad: list[UnsupportedSite] = []
    mla = _mla_evidence(kt, vt)
    if mla:
        bad.append(UnsupportedSite(
            kind="mla_attention", layer=layer,
            reason="keys/values are rebuilt from a low-rank latent (an up-projection of the cached tensor, or "
                   "keys assembled from a no-RoPE part and a separate decoupled-RoPE part): multi-head latent "
                   "attention, whose KV cache is already latent.",
            fix=_MLA_FIX, nodes=(c.node.name,) + tuple(n.name for n in mla)))
    grown = [g for g in (grown_cache(kt), grown_cache(vt)) if g is not None]
    if grown and not mla:
        bad.append(UnsupportedSite(
            kind="dynamic_cache", layer=layer,
            reason="keys/values grow by torch.cat with the past tensors every step (a dynamic cache): there is "
                   "no fixed cache buffer to rewrite.",
            fix=_DYNAMIC_FIX, nodes=(c.node.name,) + tuple(g.name for g in grown)))
    window = sliding_window(c.mask_roots)
    if window is not None:
        bad.append(UnsupportedSite(
            kind="sliding_window", layer=layer,
            reason=f"the attention mask limits each query to a sliding window of {window} keys; the latent "
                   "cache assumes attention over the whole cache.",
            fix=_SLIDING_FIX, nodes=(c.node.name,)))
    if bad:
        return None, bad

    k_cache = cache_write_site("k", kt, c.node)
    v_cache = cache_write_site("v", vt, c.node)
    if k_cache is None and (kt.base.op in ("placeholder", "get_attr") or op_name(kt.base) in ALLOC_OPS):
        return None, []  # K read from a buffer that is not written here: not understood
    new_k = nodes[k_cache.value_node] if k_cache is not None else kt.base
    new_v = nodes[v_cache.value_node] if v_cache is not None else vt.base

    h, hk, d = c.heads if c.heads is not None else _heads(c.q, c.k)
    hkv = hk // kt.expand_factor if kt.expand_factor and hk % kt.expand_factor == 0 else 0
    if min(h, hkv, d) <= 0 or h % hkv != 0:
        return None, []
    if h == hkv:
        gqa = "none"
    elif c.enable_gqa:
        gqa = "enable_gqa"
    elif kt.expanded:
        gqa = "repeat_kv"
    else:
        gqa = "broadcast"

    rope_k = match_rope(strip_views(new_k))
    rope_q = match_rope(strip_views(c.q))
    k_in = rope_k.x_in if rope_k is not None else new_k
    rope = None
    if rope_k is not None:
        rope = RopeSite(
            form=rope_k.form,  # type: ignore[arg-type]
            rotary_dim=rope_k.rotary_dim,
            partial=rope_k.rotary_dim < d,
            q_out=rope_q.out.name if rope_q is not None else None,
            k_out=rope_k.out.name,
            k_in=rope_k.x_in.name,
            cos=rope_k.cos.name if rope_k.cos is not None else None,
            sin=rope_k.sin.name if rope_k.sin is not None else None,
        )
    q_start = rope_q.x_in if rope_q is not None else c.q
    return AttentionSite(
        layer=layer,
        module_path=module_path(c.node),
        form=c.form,  # type: ignore[arg-type]
        attention_node=c.node.name,
        q_proj=_name(_projection_upstream(q_start)),
        k_proj=_name(_projection_upstream(k_in)),
        v_proj=_name(_projection_upstream(new_v)),
        o_proj=_name(find_downstream(c.node, _is_projection, max_depth=8,
                                     through=lambda n: op_name(n) in VIEW_LIKE | {"getitem"})),
        num_heads=h,
        num_kv_heads=hkv,
        head_dim=d,
        gqa_ratio=h // hkv,
        gqa_form=gqa,  # type: ignore[arg-type]
        rope=rope,
        k_cache=k_cache,
        v_cache=v_cache,
        is_causal=c.is_causal,
        scale=c.scale,
    ), []


def _name(n: fx.Node | None) -> str | None:
    return n.name if n is not None else None


def _heads(q: fx.Node, k: fx.Node) -> tuple[int, int, int]:
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


def _is_projection(n: Any) -> bool:
    """A ``linear``, or a ``matmul`` / ``mm`` / ``addmm`` / ``einsum`` with a weight placeholder operand."""
    if not isinstance(n, fx.Node):
        return False
    kind = op_name(n)
    if kind == "linear":
        return True
    if kind in ("matmul", "addmm", "einsum"):
        _, ops = _product_operands(n) if kind != "addmm" else (None, list(n.all_input_nodes))
        return any(_is_weight(o) for o in ops)
    return False


def _projection_upstream(node: fx.Node) -> fx.Node | None:
    """The nearest input projection that produces ``node`` through views, norms, splits and RoPE."""
    if _is_projection(node):
        return node
    return find_upstream(node, _is_projection, max_depth=24, through=lambda n: op_name(n) in _PROJ_PATH_OPS)


# ----------------------------------------------------------------------------------------------------------
# unsupported patterns


def _mla_evidence(kt: KVTrace, vt: KVTrace) -> list[fx.Node]:
    """Nodes showing multi-head latent attention, or [] when there are none.

    Two structural signs, either suffices: (1) K or V is an up-projection (linear / matmul by a weight) of
    a cache buffer, i.e. the cache holds a latent; (2) K is assembled along the head dim from several
    parts (``cat(..., dim=-1)``, or a fresh buffer filled by ``copy_`` into last-dim slices) that is not a
    partial RoPE of one tensor (DeepSeek's ``cat(k_nope, k_pe.expand(...))``).
    """
    out: list[fx.Node] = []
    for t in (kt, vt):
        proj = _through_splits(t.base)
        if _is_projection(proj) and proj.args and isinstance(proj.args[0], fx.Node):
            if is_cache_buffer(trace_kv(proj.args[0]).base):
                out.append(proj)
    base = kt.base
    kind = op_name(base)
    shape = shape_of(base)
    if kind == "cat" and shape:
        dim = arg(base, 1, "dim", 0)
        parts = base.args[0] if base.args and isinstance(base.args[0], (list, tuple)) else ()
        if isinstance(dim, int) and dim % len(shape) == len(shape) - 1 and len(parts) >= 2:
            rope = match_rope(base)  # a RoPE that ends in this cat (halves written out, or partial) is fine
            if rope is None or not (rope.partial or rope.rotary_dim == shape[-1]):
                out.append(base)
    elif kind in ALLOC_OPS:
        fills = [u for u in base.users if last_dim_selection(u) is not None
                 and any(op_name(w) == "copy_" and w.args[0] is u for w in u.users)]
        if len(fills) >= 2:
            out.append(base)
    return out


def _through_splits(n: fx.Node) -> fx.Node:
    """Walk back from ``getitem(split(x))`` / views to the producer of ``x``."""
    for _ in range(8):
        if op_name(n) == "getitem" and isinstance(n.args[0], fx.Node) and op_name(n.args[0]) in ("split", "chunk", "unbind"):
            n = n.args[0].args[0]
        elif op_name(n) in VIEW_LIKE and n.args and isinstance(n.args[0], fx.Node):
            n = n.args[0]
        else:
            break
    return n


def sliding_window(mask_roots: list[fx.Node], max_depth: int = 48) -> int | None:
    """Return the window size when an attention mask encodes a sliding window, else None.

    Looks through everything the mask depends on for (1) a position comparison (``gt/ge/lt/le``) with one
    side offset by a non-zero constant (``kv_idx > q_idx - W``), next to at least one other comparison (the
    causal one), as transformers' ``sliding_window_causal_mask`` builds it; or (2) ``tril``/``triu`` with a
    negative diagonal.

    Args:
        mask_roots: the mask tensors fed to the attention (SDPA ``attn_mask``; added / masked_fill'ed masks).
    Returns:
        W (the constant offset) or None.
    """
    seen: set[fx.Node] = set()
    frontier = list(mask_roots)
    compares: list[fx.Node] = []
    window: int | None = None
    for _ in range(max_depth):
        nxt: list[fx.Node] = []
        for n in frontier:
            if n in seen:
                continue
            seen.add(n)
            kind = op_name(n)
            if kind in _COMPARE_OPS:
                compares.append(n)
                for a in n.args[:2]:
                    w = _const_offset(a)
                    if w:
                        window = w
            elif kind in ("tril", "triu"):
                diag = arg(n, 1, "diagonal", 0)
                if isinstance(diag, int) and diag < 0:
                    return -diag
            nxt.extend(n.all_input_nodes)
        if not nxt:
            break
        frontier = nxt
    return window if window is not None and len(compares) >= 2 else None


def _const_offset(a: Any) -> int | None:
    """|c| when ``a`` is ``x - c`` or ``x + c`` (through views) with a non-zero integer constant c."""
    a = strip_views(a)
    if not isinstance(a, fx.Node) or op_name(a) not in ("sub", "add"):
        return None
    consts = [x for x in a.args if isinstance(x, int) and not isinstance(x, bool)]
    nodes = [x for x in a.args if isinstance(x, fx.Node)]
    if len(consts) == 1 and len(nodes) == 1 and consts[0] != 0:
        return abs(consts[0])
    return None
