"""LatentKVCachePass: dense KV-cache writes and reads -> the ckvp cross-layer latent store (CKVP).

Runs on the Dynamo graph ('torch' stage), for every layer group whose cache tensors are phantoms of one
:class:`~ckvp_compile.runtime.store.LatentKVStore` (see ``runtime/binding.py``). Per layer l of a group
(position j in it), with the group's store tensors added as new graph inputs::

    before                                           after
    ------                                           -----
    cache_k.index_copy_(2, slots, k_rot)             (write removed; the phantom is no longer read)
    ... = sdpa(q, view(cache_k), view(cache_v))      k_all = ckvp.latent_reconstruct(latent_k[g],
                                                         basis_k[g][:, j*D:(j+1)*D], rope tables, k_rot, slots)
                                                     v_all = ckvp.latent_reconstruct(latent_v[g], ..., v, slots)
                                                     ... = sdpa(q, view(k_all), view(v_all))

and once per group, after its last layer's writes::

    ckvp.latent_append(latent_k[g], cat([k_pre(l0), ..., k_pre(lG-1)], -1), basis_k[g], slots)
    ckvp.latent_append(latent_v[g], cat([v(l0), ..., v(lG-1)], -1), basis_v[g], slots)
    ckvp.rope_table_update(rope_cos, rope_sin, slot_pos, cos, sin, positions, slots)

``k_pre`` is the layer's pre-RoPE key (the analysis' ``rope.k_in``): the latent is projected from pre-RoPE
keys (DESIGN.md, "CKVP in numbers"), and RoPE is re-applied at each cached slot's own position when keys
are rebuilt. Tokens of the current call are attended exactly (``k_rot``/``v`` overwrite their slots); past
tokens come from the latent. Every view, mask and GQA expansion the model applies after reading its cache
stays as it was, so the attention itself is untouched.

Reference: DESIGN.md; xKV (Chang et al., 2025) for cross-layer shared low-rank KV.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..analysis.graph import dtype_of, find_upstream, node_map, shape_of
from ..analysis.sites import AttentionSite
from .base import CKVPPass

logger = logging.getLogger(__name__)


@dataclass
class GroupRewrite:
    """What to rewrite for one layer group: its store index, layers, and their attention sites (layer order)."""

    group: int
    sites: tuple[AttentionSite, ...]


@dataclass
class LatentRewritePlan:
    """Input of :class:`LatentKVCachePass`: the groups to rewrite and the store tensors they read.

    Attributes:
        store: the :class:`LatentKVStore` found at compile time (for shapes and offsets).
        groups: one :class:`GroupRewrite` per rewritten group.
        store_input_index: index (among the graph's original inputs) of a phantom of the store; the runtime
            wrapper finds the store of each call through it.
        extra_inputs: filled by the pass: names of the store tensors appended as graph inputs, in order.
    """

    store: Any
    groups: list[GroupRewrite]
    store_input_index: int
    extra_inputs: list[str] = field(default_factory=list)


class LatentKVCachePass(CKVPPass):
    """Rewrite the KV cache of the planned layer groups into the latent store (see the module docstring)."""

    name = "latent_kv_cache"
    stage = "torch"

    def __init__(self, plan: LatentRewritePlan) -> None:
        self.plan = plan

    def is_applicable(self, graph: fx.Graph) -> str:
        return "" if self.plan.groups else "no layer group has a latent store"

    def apply(self, graph: fx.Graph) -> int:
        from ..ops import latent_kv  # noqa: F401  registers torch.ops.ckvp.*

        store = self.plan.store
        nodes = node_map(graph)
        order = {n: i for i, n in enumerate(graph.nodes)}
        inputs = _StoreInputs(graph)
        first = self.plan.groups[0].sites[0]
        cos_n, sin_n, pos_n, width = _rope_tables(nodes, first, graph)
        if first.rope is not None:
            store.ensure_rope_tables(width)
        rope_cos = inputs.add("ckvp_rope_cos")
        rope_sin = inputs.add("ckvp_rope_sin")
        slot_pos = inputs.add("ckvp_slot_pos")
        rewritten = 0
        for gr in self.plan.groups:
            g = gr.group
            lat_k, lat_v = inputs.add(f"ckvp_latent_k_{g}"), inputs.add(f"ckvp_latent_v_{g}")
            bas_k, bas_v = inputs.add(f"ckvp_basis_k_{g}"), inputs.add(f"ckvp_basis_v_{g}")
            k_pre_nodes, v_nodes, last_write = [], [], None
            for j, site in enumerate(gr.sites):
                d = site.head_dim
                form = site.rope.form if site.rope is not None else "none"
                rd = site.rope.rotary_dim if site.rope is not None else 0
                for kind, write, latent, basis, offsets, rope, fmt in (
                    ("k", site.k_cache, lat_k, bas_k, store.k_offsets[g], form, store.k_format),
                    ("v", site.v_cache, lat_v, bas_v, store.v_offsets[g], "none", store.v_format),
                ):
                    w, cache, value = nodes[write.write_node], nodes[write.cache_node], nodes[write.value_node]
                    slots = nodes[write.position_node]
                    with graph.inserting_after(w):
                        block = graph.call_function(
                            operator.getitem, (basis, (slice(None), slice(j * d, (j + 1) * d), slice(None)))
                        )
                    with graph.inserting_after(block):
                        recon = graph.call_function(
                            torch.ops.ckvp.latent_reconstruct.default,
                            (latent, block, offsets, rope_cos, rope_sin, slot_pos, rope, rd if rope != "none" else 0,
                             value, slots, fmt),
                        )
                    for user in list(cache.users):
                        if user is not w and order.get(user, len(order)) > order[w]:
                            user.replace_input_with(cache, recon)
                    w.replace_all_uses_with(recon)
                    graph.erase_node(w)
                    if cache.users:
                        raise RuntimeError(
                            f"layer {site.layer}: the {kind} cache is read before its write; cannot rewrite"
                        )
                    order[recon] = order.pop(w)
                    last_write = recon if last_write is None or order[recon] > order[last_write] else last_write
                    if kind == "k":
                        k_pre_nodes.append(_as_bhsd(graph, nodes[site.rope.k_in] if site.rope else value, site, recon))
                    else:
                        v_nodes.append(value)
                rewritten += 1
            slots = nodes[gr.sites[-1].k_cache.position_node]
            involved = set(k_pre_nodes) | set(v_nodes) | {slots, last_write}
            if cos_n is not None:
                involved |= {cos_n, sin_n, pos_n}
            anchor = [n for n in graph.nodes if n in involved][-1]
            with graph.inserting_after(anchor):
                xk = graph.call_function(torch.cat, (k_pre_nodes, -1))
            with graph.inserting_after(xk):
                xv = graph.call_function(torch.cat, (v_nodes, -1))
            with graph.inserting_after(xv):
                ak = graph.call_function(
                    torch.ops.ckvp.latent_append.default, (lat_k, xk, bas_k, store.k_offsets[g], slots, store.k_format)
                )
            with graph.inserting_after(ak):
                av = graph.call_function(
                    torch.ops.ckvp.latent_append.default, (lat_v, xv, bas_v, store.v_offsets[g], slots, store.v_format)
                )
            if cos_n is not None:
                with graph.inserting_after(av):
                    graph.call_function(
                        torch.ops.ckvp.rope_table_update.default,
                        (rope_cos, rope_sin, slot_pos, cos_n, sin_n, pos_n, slots),
                    )
        self.plan.extra_inputs = inputs.names
        return rewritten


class _StoreInputs:
    """Appends placeholders for store tensors after the graph's existing placeholders."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self.names: list[str] = []
        self.last = [n for n in graph.nodes if n.op == "placeholder"][-1]

    def add(self, name: str) -> fx.Node:
        with self.graph.inserting_after(self.last):
            node = self.graph.placeholder(name)
        self.last = node
        self.names.append(node.name)
        return node


def _as_bhsd(graph: fx.Graph, x: fx.Node, site: AttentionSite, after: fx.Node) -> fx.Node:
    """Return ``x`` as (B, Hkv, S, D): transpose (B, S, Hkv, D) layouts (gpt-fast's pre-RoPE view)."""
    shape = shape_of(x)
    if shape is not None and len(shape) == 4 and shape[1] != site.num_kv_heads and shape[2] == site.num_kv_heads:
        with graph.inserting_after(after):
            return graph.call_method("transpose", (x, 1, 2))
    return x


def _rope_tables(nodes: dict[str, fx.Node], site: AttentionSite, graph: fx.Graph):
    """Find the graph's cos / sin tables for the new tokens as (Bc, S, W) and their positions (Bc or 1, S).

    Returns (cos, sin, positions, W); (None, None, None, 0) when the site has no RoPE.
    Raises:
        RuntimeError: the tables or positions cannot be identified (the backend then compiles the graph
            unchanged, with a warning).
    """
    rope = site.rope
    if rope is None:
        return None, None, None, 0
    if rope.cos is None:
        raise RuntimeError(f"layer {site.layer}: RoPE tables not identified")
    cos = nodes[rope.cos]
    k_shape = shape_of(nodes[site.k_cache.value_node])
    s = k_shape[2]
    if rope.form == "complex" or (dtype_of(cos) is not None and dtype_of(cos).is_complex):
        src = cos
        with graph.inserting_after(src):
            c = graph.call_function(torch.real, (src,))
        with graph.inserting_after(c):
            sn = graph.call_function(torch.imag, (src,))
        width = rope.rotary_dim // 2
        c_shape = shape_of(src)
        cos_n, sin_n, last = c, sn, sn
    else:
        if rope.sin is None:
            raise RuntimeError(f"layer {site.layer}: RoPE sine table not identified")
        cos_n, sin_n = cos, nodes[rope.sin]
        c_shape = shape_of(cos)
        width = c_shape[-1]
        last = max((cos_n, sin_n), key=lambda n: list(graph.nodes).index(n))
    numel = 1
    for x in c_shape:
        numel *= x
    bc = numel // (s * width)
    with graph.inserting_after(last):
        cos3 = graph.call_method("reshape", (cos_n, bc, s, width))
    with graph.inserting_after(cos3):
        sin3 = graph.call_method("reshape", (sin_n, bc, s, width))
    pos = find_upstream(
        cos,
        lambda n: dtype_of(n) in (torch.int64, torch.int32)
        and shape_of(n) is not None
        and len(shape_of(n)) in (1, 2)
        and shape_of(n)[-1] == s,
        max_depth=48,
    )
    if pos is None:
        raise RuntimeError(f"layer {site.layer}: RoPE positions not identified")
    with graph.inserting_after(max((pos, sin3), key=lambda n: list(graph.nodes).index(n))):
        pos2 = graph.call_method("reshape", (pos, -1, s))  # (Bc or 1, S)
    return cos3, sin3, pos2, width
