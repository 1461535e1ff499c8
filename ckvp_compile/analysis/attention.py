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
``cache_written_    the cache read back (or the buffer, or a view of it) is also written in place besides its
in_place``          positional write (``k.mul_(s)``, ``v[:, :, :n].add_(b)``, ``k[:, :, 0] = 0``, ``zero_()``, a
                    second positional write): the change persists in a dense cache, a latent keeps only one write
``written_after_    the key / value written into the cache is changed in place after the write (``k.mul_(s)``
cache_write``       after ``k_cache[:, :, pos] = k``): the dense cache holds the value before, a latent after
``rope_positions``  the cached key's RoPE tables are not a function of one position per token
                    (:func:`~.rope.rope_position_reason`): multimodal RoPE (mrope, Qwen-VL / GLM-4V / ERNIE-VL)
                    fed several position streams, (3, B, S) or (4, B, S) position ids, or positions shifted per
                    sequence (Qwen-VL's ``rope_deltas``); the latent store keeps one table row per position
``unrecognised_     a KV-cache buffer (4-D, written in place: ``index_copy_`` / ``setitem`` /
attention``         ``index_put_``) that no understood attention reads: the attention op was not recognised
                    (e.g. scores from ``baddbmm``), or it was found but its heads / RoPE / key path could
                    not be read (the reason says which), or it lies in another graph (a graph break)
==================  ============================================================================

Anything else that is not understood (e.g. K read from a buffer that is never written in the graph, or an
attention without a cache whose key path is not understood) is skipped silently; :func:`find_attention_sites`
never raises.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

import torch.fx as fx

from .attention_ops import AttentionOp, find_attention_ops, is_projection, is_weight, op_heads
from .graph import (
    VIEW_LIKE,
    ancestors,
    find_downstream,
    find_upstream,
    LayerFinding,
    layer_prefix,
    module_path,
    node_map,
    number_findings,
    op_name,
    placeholder_source,
    positions,
    shape_of,
    strip_views,
)
from .kv_cache import (
    ALLOC_OPS,
    KVTrace,
    buffers_read,
    cache_write_site,
    grown_cache,
    late_value_writes,
    mla_evidence,
    positional_writes,
    stray_cache_writes,
    trace_kv,
    written_cache_buffers,
)
from .masks import sliding_window
from .rope import (
    RopeMatch,
    RowScale,
    cached_key_layout,
    match_rope,
    match_row_scale,
    rope_position_reason,
    rope_residue,
    tables_paired,
)
from .sites import AttentionSite, RopeSite, UnsupportedSite

logger = logging.getLogger(__name__)

#: Ops walked through between an input projection and the tensor fed to RoPE / attention (views, norms, splits).
_PROJ_PATH_OPS = VIEW_LIKE | {
    "getitem", "split", "chunk", "unbind", "mul", "add", "sub", "div", "neg", "cat", "stack", "pow", "mean",
    "rsqrt", "sqrt", "var", "layer_norm", "rms_norm", "float", "to", "type_as", "view_as_complex",
    "view_as_real", "select",
}

_DYNAMIC_FIX = (
    "use a static cache: generate(..., cache_implementation=\"static\"), or pass a transformers StaticCache "
    "as the model's cache argument (past_key_values; named cache in transformers >= 5.24)."
)
_MLA_FIX = "nothing to do, ckvp leaves MLA as is."
_POST_ROPE_FIX = (
    "NYI: keys changed after RoPE (a norm or scale, e.g. HunYuan-MoE's key_layernorm) cannot use the latent cache; "
    "with a dense cache the model compiles and runs as before."
)
_ROPE_POSITIONS_FIX = (
    "NYI: the layer keeps the model's own attention and a dense cache (a ckvp latent cache cannot be used with these "
    "positions). For text-only input to a multimodal-RoPE model, pass position_ids of shape (B, S) (one stream: "
    "the streams are then equal, plain RoPE, which the latent cache rebuilds exactly); with images or video, use a "
    "dense cache (transformers StaticCache) with backend=\"ckvp\"."
)
_UNRECOGNISED_FIX = (
    "NYI: the layer is left as written and runs as before with a dense cache (a ckvp latent cache cannot be used); "
    "with a Hugging Face model, attn_implementation=\"sdpa\" gives an attention the analysis reads."
)
_IN_PLACE_FIX = (
    "NYI: a cache changed in place besides its positional write stays dense (a ckvp latent cache cannot be used); "
    "change the keys / values before writing them, or change copies of them (k = k * s, not k.mul_(s))."
)
_STEPS_FIX = (
    "compile the model's one-step forward and loop over the steps outside the compiled function (as "
    "transformers' generate() does); or keep a dense cache for this function."
)
_SLIDING_FIX = (
    "NYI: sliding-window layers stay dense; keep them out of ckvp, or run the model without a sliding "
    "window if it allows (sliding_window=None / use_sliding_window=False)."
)


def find_attention_sites(graph: fx.Graph) -> tuple[list[AttentionSite], list[UnsupportedSite]]:
    """Find one :class:`AttentionSite` per attention in a Dynamo (torch-level) graph.

    Args:
        graph: the FX graph Dynamo hands a backend (call_function / call_method nodes, parameters and
            buffers as placeholders, ``example_value`` fake tensors, ``nn_module_stack``).
    Returns:
        ``(sites, unsupported)``: sites in graph order (one per attention op understood); unsupported
        patterns (dynamic cache, MLA, sliding window) with reason and fix, which get no site.
        Layer indices come from the attention's module path (:func:`~.graph.assign_layer_indices`:
        ``model.layers.3.self_attn`` -> 3; nested paths numbered in graph order); when no attention has
        a numbered path, attentions are numbered in graph order.
    Raises:
        Nothing: an attention that cannot be analysed is skipped (logged at DEBUG).
    """
    findings = attention_findings(graph)
    sites: list[AttentionSite] = []
    unsupported: list[UnsupportedSite] = []
    for items in number_findings(findings):
        for x in items:
            (sites if isinstance(x, AttentionSite) else unsupported).append(x)
    logger.debug("ckvp: %d attention sites, %d unsupported", len(sites), len(unsupported))
    return sites, unsupported


def attention_findings(graph: fx.Graph) -> list[LayerFinding]:
    """The attention sites and unsupported patterns of ``graph``, one :class:`~.graph.LayerFinding` per
    attention op that gave either, with layer -1 until :func:`~.graph.number_findings` numbers them."""
    try:
        candidates = find_attention_ops(graph)
    except Exception:  # analysis never raises on unknown graphs
        logger.debug("ckvp: attention candidate search failed", exc_info=True)
        return []
    nodes = node_map(graph)
    where = positions(graph)
    findings: list[LayerFinding] = []
    written = written_cache_buffers(graph)
    claimed: set[fx.Node] = set()  # the written buffers an attention op reads, reported by a site or a pattern
    own_writes: set[str] = set()  # the cache writes (node names) of the sites found so far, in graph order
    readers: dict[fx.Node, int] = {}  # attention ops reading each written buffer (two or more: several steps)
    for cand in candidates:
        for b in buffers_read(cand.k, cand.v) & written.keys():
            readers[b] = readers.get(b, 0) + 1
    for cand in candidates:
        reads = buffers_read(cand.k, cand.v) & written.keys()
        try:
            site, bad, why = _analyse(cand, -1, nodes, readers)
        except Exception:
            logger.debug("ckvp: attention at %s not analysed", cand.node.name, exc_info=True)
            site, bad, why = None, [], "its analysis failed (an unexpected graph form)"
        if site is not None and site.k_cache is not None and site.v_cache is not None:
            writes = (site.k_cache.write_node, site.v_cache.write_node)
            if any(w in own_writes for w in writes):
                # KV sharing (Gemma-4's num_kv_shared_layers): this attention reads the cache an earlier layer's
                # attention writes and reads; it has no cache of its own (the earlier site carries the writes)
                site = dataclasses.replace(site, k_cache=None, v_cache=None)
            else:
                own_writes.update(writes)
        items = list(bad) + ([site] if site is not None else [])
        if not items and reads:
            items = [UnsupportedSite(
                kind="unrecognised_attention", layer=-1,
                reason=f"the attention {cand.form} at {cand.node.name} reads the KV cache written by "
                       f"{_writes_text(reads, written)}, but {why or 'it was not understood'}.",
                fix=_UNRECOGNISED_FIX, nodes=(cand.node.name,) + tuple(w.name for b in reads for w in written[b]))]
        if items:
            claimed |= reads | _layer_buffers_under(cand, written)
            findings.append(LayerFinding(where[cand.node], layer_prefix(module_path(cand.node)), "attention", items))
    findings.extend(_unread_cache_findings(written, claimed, {f.prefix for f in findings} - {None}, where))
    return findings


def _layer_buffers_under(c: AttentionOp, written: dict[fx.Node, list[fx.Node]]) -> set[fx.Node]:
    """The written buffers that the attention's K or V depend on and that are written in the attention's own layer
    (e.g. MLA's second cached tensor, read through up-projections and concatenations); none outside numbered layers."""
    prefix = layer_prefix(module_path(c.node))
    if prefix is None:
        return set()
    up = ancestors(c.k) | ancestors(c.v) | {c.k, c.v}
    return {b for b, writes in written.items() if b in up and layer_prefix(module_path(writes[0])) == prefix}


def _writes_text(buffers: Iterable[fx.Node], written: dict[fx.Node, list[fx.Node]]) -> str:
    """'index_copy_ into l_kwargs_cache_layers_0_keys (...), ...' for the writes into ``buffers``."""
    parts = []
    for b in sorted(buffers):
        src = placeholder_source(b) if b.op == "placeholder" else None
        forms = ", ".join(dict.fromkeys(op_name(w) for w in written[b]))
        parts.append(f"{forms} into {b.name}" + (f" ({src})" if src else ""))
    return "; ".join(parts)


def _unread_cache_findings(written: dict[fx.Node, list[fx.Node]], claimed: set[fx.Node], reported: set[str],
                           where: dict[fx.Node, int]) -> list[LayerFinding]:
    """One ``unrecognised_attention`` finding per layer whose written cache buffers no attention op reads; a layer
    (prefix) in ``reported`` already has its attention's site or pattern (e.g. MLA's prefill, which writes a buffer
    its attention does not read back)."""
    by_prefix: dict[str | None, list[fx.Node]] = {}
    for buf, writes in written.items():
        prefix = layer_prefix(module_path(writes[0]))
        if buf not in claimed and prefix not in reported:
            by_prefix.setdefault(prefix, []).append(buf)
    out = []
    for prefix, bufs in by_prefix.items():
        writes = sorted(w for b in bufs for w in written[b])
        out.append(LayerFinding(where[writes[0]], prefix, "attention", [UnsupportedSite(
            kind="unrecognised_attention", layer=-1,
            reason=f"KV-cache writes were found ({_writes_text(bufs, written)}), but no attention op that reads these "
                   "buffers was recognised in this graph (neither one scaled_dot_product_attention call nor "
                   "softmax(Q K^T [scaled, masked]) V through matmul / bmm / einsum, e.g. scores from baddbmm are "
                   "not matched), or it lies in another graph (a graph break).",
            fix=_UNRECOGNISED_FIX, nodes=tuple(w.name for w in writes))]))
    return out


# ----------------------------------------------------------------------------------------------------------
# one attention


def _analyse(c: AttentionOp, layer: int, nodes: dict[str, fx.Node], readers: dict[fx.Node, int] | None = None,
             ) -> tuple[AttentionSite | None, list[UnsupportedSite], str | None]:
    """Interpret one attention op: (its site, [], None), (None, the unsupported patterns it shows, None), or
    (None, [], why it is not understood). ``readers``: how many attention ops of the graph read each written cache
    buffer (several decode steps in one graph write and read each cache once a step)."""
    kt, vt = trace_kv(c.k), trace_kv(c.v)
    bad = _unsupported(c, kt, vt, layer)
    if bad:
        return None, bad, None
    k_cache = cache_write_site("k", kt, c.node)
    v_cache = cache_write_site("v", vt, c.node)
    if k_cache is None and (kt.base.op in ("placeholder", "get_attr") or op_name(kt.base) in ALLOC_OPS):
        return None, [], f"its keys come from {kt.base.name}, a buffer with no positional write before it"
    for cache, trace in ((k_cache, kt), (v_cache, vt)):
        stray = stray_cache_writes(trace, cache, nodes) if cache is not None else []
        buffer = nodes[cache.cache_node] if cache is not None else None
        if stray and (readers or {}).get(buffer, 1) > 1 and set(stray) <= set(positional_writes(buffer)):
            writes = sorted(stray + [nodes[cache.write_node]])
            return None, [UnsupportedSite(
                kind="cache_written_in_place", layer=layer,
                reason=f"the {'key' if cache.kind == 'k' else 'value'} cache {cache.cache_node} is written at "
                       f"positions {len(writes)} times in this graph ({', '.join(w.name for w in writes)}) and read "
                       f"by {readers[buffer]} attention ops: the compiled call holds several steps (a loop over "
                       "decode steps, or draft and verify, traced into one graph), and the latent cache is rewritten "
                       "for one positional write per layer and call.",
                fix=_STEPS_FIX, nodes=(c.node.name,) + tuple(w.name for w in writes))], None
        if stray:
            return None, [UnsupportedSite(
                kind="cache_written_in_place", layer=layer,
                reason=f"the {'key' if cache.kind == 'k' else 'value'} cache {cache.cache_node} is also written in "
                       f"place by {', '.join(f'{op_name(w)} ({w.name})' for w in stray)}, besides its positional "
                       f"write {cache.write_node}: a change that persists in the dense cache from one call to the "
                       "next, which a latent cache (it keeps only the written keys / values) would lose.",
                fix=_IN_PLACE_FIX, nodes=(c.node.name, cache.write_node) + tuple(w.name for w in stray))], None
        late = late_value_writes(cache, nodes) if cache is not None else []
        if late:
            return None, [UnsupportedSite(
                kind="written_after_cache_write", layer=layer,
                reason=f"the {'key' if cache.kind == 'k' else 'value'} {cache.value_node} written into the cache by "
                       f"{cache.write_node} is changed in place after that write, by "
                       f"{', '.join(f'{op_name(w)} ({w.name})' for w in late)}: the dense cache holds it before the "
                       "change, a latent cache would be appended it after.",
                fix=_IN_PLACE_FIX, nodes=(c.node.name, cache.write_node) + tuple(w.name for w in late))], None
    new_k = nodes[k_cache.value_node] if k_cache is not None else kt.base
    new_v = nodes[v_cache.value_node] if v_cache is not None else vt.base

    h, hk, d = c.heads if c.heads is not None else op_heads(c.q, c.k)
    hkv = hk // kt.expand_factor if kt.expand_factor and hk % kt.expand_factor == 0 else 0
    if min(h, hkv, d) <= 0 or h % hkv != 0:
        return None, [], (f"its heads could not be read off the query and key shapes (H={h}, KV heads={hkv}, "
                          f"D={d})")

    # a factor constant along the head dim after RoPE (Llama-4's weightless qk_norm): RoPE(k) * s == RoPE(k * s)
    row_scale = match_row_scale(strip_views(new_k)) if k_cache is not None else None
    rope_k = match_rope(strip_views(row_scale.rotated if row_scale is not None else new_k))
    if rope_k is not None and (shape_of(rope_k.x_in) or (0,))[-1] != d:
        return None, [], (f"the RoPE at {rope_k.out.name} rotates part of the head and the pass-through part was "
                          "not found")
    residue = rope_residue(rope_k) if rope_k is not None and k_cache is not None else None
    k_in_perm = None
    if residue is None and rope_k is not None and k_cache is not None:  # the views / casts from RoPE to the cache
        k_in_perm, residue = cached_key_layout(rope_k, new_k, row_scale)
        if residue is None and row_scale is not None and k_in_perm is None:
            residue = (f"{row_scale.mul.name} scales the rotated key after RoPE, and the layout in which it does could "
                       "not be read off the graph")
    if residue is not None:  # (without a cache write there is nothing a latent would rebuild)
        return None, [UnsupportedSite(
            kind="post_rope_key", layer=layer,
            reason=f"the cached key is not exactly RoPE of the projected key: {residue}; a latent of the pre-RoPE key "
                   "would rebuild keys without it.",
            fix=_POST_ROPE_FIX, nodes=(c.node.name, rope_k.out.name))], None
    k_shape = shape_of(new_k)
    positions_why = (rope_position_reason(rope_k, k_shape[2])
                     if rope_k is not None and k_cache is not None and k_shape and len(k_shape) == 4 else None)
    if positions_why is not None:  # (without a cache write nothing is rebuilt from the tables)
        return None, [UnsupportedSite(
            kind="rope_positions", layer=layer, reason=positions_why, fix=_ROPE_POSITIONS_FIX,
            nodes=(c.node.name, rope_k.out.name) + tuple(t.name for t in (rope_k.cos, rope_k.sin) if t is not None))
        ], None
    k_in = rope_k.x_in if rope_k is not None else new_k
    k_proj = _projection_upstream(k_in)
    if rope_k is None and (k_proj is None or _has_table_input(k_proj, new_k)):
        why = (f"its key is transformed by a table between the projection {k_proj.name} and the cache write (a RoPE "
               "form not recognised)" if k_proj is not None else
               f"no projection producing its key {new_k.name} was found")
        return None, [], why
    rope_q = match_rope(strip_views(c.q))
    return AttentionSite(
        layer=layer,
        module_path=module_path(c.node),
        form=c.form,  # type: ignore[arg-type]
        attention_node=c.node.name,
        q_proj=_name(_projection_upstream(rope_q.x_in if rope_q is not None else c.q)),
        k_proj=_name(k_proj),
        v_proj=_name(_projection_upstream(new_v)),
        o_proj=_name(find_downstream(c.node, is_projection, max_depth=8,
                                     through=lambda n: op_name(n) in VIEW_LIKE | {"getitem"})),
        num_heads=h,
        num_kv_heads=hkv,
        head_dim=d,
        gqa_ratio=h // hkv,
        gqa_form=_gqa_form(c, kt, h, hkv),  # type: ignore[arg-type]
        rope=_rope_site(rope_k, rope_q, d, k_in_perm, row_scale),
        k_cache=k_cache,
        v_cache=v_cache,
        is_causal=c.is_causal,
        scale=c.scale,
    ), [], None


def _unsupported(c: AttentionOp, kt: KVTrace, vt: KVTrace, layer: int) -> list[UnsupportedSite]:
    """The recognised-but-unusable patterns of one attention (MLA, dynamic cache, sliding window)."""
    bad: list[UnsupportedSite] = []
    mla = mla_evidence(kt, vt)
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
    return bad


def _gqa_form(c: AttentionOp, kt: KVTrace, h: int, hkv: int) -> str:
    if h == hkv:
        return "none"
    if c.enable_gqa:
        return "enable_gqa"
    return "repeat_kv" if kt.expanded else "broadcast"


def _rope_site(rope_k: RopeMatch | None, rope_q: RopeMatch | None, head_dim: int,
               k_in_perm: tuple[int, ...] | None = None, row_scale: RowScale | None = None) -> RopeSite | None:
    if rope_k is None:
        return None
    return RopeSite(
        form=rope_k.form,  # type: ignore[arg-type]
        rotary_dim=rope_k.rotary_dim,
        partial=rope_k.rotary_dim < head_dim,
        q_out=rope_q.out.name if rope_q is not None else None,
        k_out=rope_k.out.name,
        k_in=rope_k.x_in.name,
        cos=_name(rope_k.cos),
        sin=_name(rope_k.sin),
        tables_paired=tables_paired(rope_k.cos, rope_k.form) and tables_paired(rope_k.sin, rope_k.form),
        k_in_perm=k_in_perm,
        k_scale=row_scale.scale.name if row_scale is not None else None,
    )


def _name(n: fx.Node | None) -> str | None:
    return n.name if n is not None else None


def _projection_upstream(node: fx.Node) -> fx.Node | None:
    """The nearest input projection that produces ``node`` through views, norms, splits and RoPE."""
    if is_projection(node):
        return node
    return find_upstream(node, is_projection, max_depth=24, through=lambda n: op_name(n) in _PROJ_PATH_OPS)


def _has_table_input(proj: fx.Node, out: fx.Node, max_depth: int = 32) -> bool:
    """True when the path from ``proj`` to ``out`` takes in a side tensor of rank >= 2 that is not a weight.

    Such a side input (a cos/sin or frequency table, a position-dependent mask) means the key is rotated
    or otherwise position-dependent; a norm's weight (rank 1) or a scalar does not count.
    """
    seen: set[fx.Node] = set()
    frontier = [out]
    for _ in range(max_depth):  # everything out depends on, up to proj
        nxt = []
        for n in frontier:
            if n in seen or n is proj:
                continue
            seen.add(n)
            nxt.extend(n.all_input_nodes)
        frontier = nxt
    path = {proj}
    changed = True
    while changed:  # the nodes of `seen` that depend on proj
        changed = False
        for n in seen - path:
            if any(i in path for i in n.all_input_nodes):
                path.add(n)
                changed = True
    for n in path - {proj}:
        for i in n.all_input_nodes:
            shape = shape_of(i)
            if i not in path and shape is not None and len(shape) >= 2 and not is_weight(i):
                return True
    return False
