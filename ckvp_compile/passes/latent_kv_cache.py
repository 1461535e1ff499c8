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

once per group, after its last layer's reads and writes::

    ckvp.latent_append(latent_k[g], cat([k_pre(l0), ..., k_pre(lG-1)], -1), basis_k[g], slots)
    ckvp.latent_append(latent_v[g], cat([v(l0), ..., v(lG-1)], -1), basis_v[g], slots)

and once per graph, after the last group's appends (every group reads the same tables, and would write the same
rows: the call's own slots are attended from its exact keys, never rebuilt from the tables)::

    ckvp.rope_table_update(rope_cos, rope_sin, slot_pos, cos, sin, positions, slots)

Each store tensor is written by one op per graph, after every read of its old value, so that Inductor writes it
in place: a store tensor read after its functionalized write is cloned whole every step.
:class:`~ckvp_compile.passes.store_write_order.StoreWriteOrderPass` keeps that order through Inductor's own
reordering of the functional graph.

With a dense recent window (``LatentKVStore(recent_window=W)``), each layer l also reads its ring of the last W
tokens' exact keys and values, and the exact tokens of every op above become the ring's entries (those below the
call's first slot; the others are marked unused, -1) followed by the call's own::

    k_ex = cat([window_k[l], k_rot], 2)     slots_ex = cat([where(window_slots[l] < min(slots), window_slots[l], -1),
    v_ex = cat([window_v[l], v], 2)                         slots])
    ckvp.latent_reconstruct(..., k_ex, slots_ex) / ckvp.latent_attention(..., k_ex, v_ex, slots_ex, ...)

and after the group's appends, ``ckvp.window_append(window_k[l], window_v[l], window_slots[l], k_rot, v, slots)``
(after every read of the ring, as the other store writes).

With a paged store (``LatentKVStore(page_size=P)``), the store's page table is one more graph input, passed as the
last argument (``page_table``) of every ``ckvp.latent_append`` / ``latent_reconstruct`` / ``latent_attention``; the
latents are then page pools (N_pages + 1, P, W). The pass also records how to read the call's highest slot on the
host before the call (:attr:`LatentRewritePlan.slot_probe`), so that the backend maps the pages it will touch.

With bases of the keys as cached (``LatentBases.key_space == "post_rope"``) every layer is rewritten as a layer
without RoPE: ``k_pre`` is then the cached key itself, nothing is rotated at decode, and no tables are written.
Otherwise ``k_pre`` is the layer's pre-RoPE key (the analysis' ``rope.k_in``): the latent is projected from pre-RoPE
keys (DESIGN.md, "CKVP in numbers"), and RoPE is re-applied at each cached slot's own position when keys
are rebuilt. A factor the model applies after RoPE that is constant along the head dim (``rope.k_scale``:
Llama-4's weightless ``qk_norm``) scales ``k_pre`` instead, since RoPE is linear. Tokens of the current call are
attended exactly (``k_rot``/``v`` overwrite their slots); past tokens come from the latent. Every view, mask and GQA expansion the model applies after reading its cache
stays as it was, so the attention itself is untouched.

Attention over the cache (the default, ``absorb_attention=True``): where the layer's attention is one SDPA
call whose K and V come from the rebuilt caches through pure layout ops (views, GQA ``repeat_kv`` expansion,
a leading slice of the slots), the SDPA itself becomes ``ckvp.latent_attention``: keys rebuilt from the latent
with RoPE, scores for every query head of a KV head (GQA), and the values *absorbed* (softmax weights times the
value latent, projected by the layer's value basis block once per query), so dense values are never formed.
The layout chain is verified by replaying it on an index probe (it must map query head i to KV head
``i // (H/Hkv)`` and slot t to slot t); a chain that does anything else, ``is_causal=True``, dropout, or a
hand-written softmax(QK^T)V keeps the reconstruct-then-SDPA form, with the reason in :attr:`notes`.

Reference: DESIGN.md; xKV (Chang et al., 2025) for cross-layer shared low-rank KV; value absorption as in
DeepSeek-V2's MLA (DeepSeek-AI, 2024) and Palu (Chang et al., 2024).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from .. import _compat
from ..analysis.attention_ops import weight_source
from ..analysis.graph import dtype_of, find_upstream, node_map, op_name, placeholder_attr_path, shape_of
from ..analysis.rope import is_module_state, rope_positions, table_key
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
        fits_online_bases: filled by the pass: the graph fits online bases (a multi-token call), so running it
            may start a sequence; a graph that does not (decode) needs them fitted first.
        slot_probe: filled by the pass for a paged store: a small graph that computes, from the graph inputs
            at ``slot_inputs``, the cache slots every group writes (a tuple of (S,) int tensors), so that the
            runtime reads the call's highest slot before running it; None when the slots cannot be computed
            from the inputs alone (then :attr:`slot_probe_note` says why).
        slot_inputs: indices (among the graph's original inputs) of the probe's inputs, in its order.
        slot_probe_note: why there is no probe ('' when there is one).
        rope_writer: filled by the pass: None when the graph writes no RoPE tables, else whether the graph proves
            the tables it writes paired (:attr:`~ckvp_compile.analysis.sites.RopeSite.tables_paired`); every store
            the graph runs on records it (``LatentKVStore.note_rope_writer``).
        k_weight_input, k_weight_path: filled by the pass: index (among the graph's original inputs) and attribute
            path of the weight the key projection of the bases' first layer multiplies by, the weight their
            fingerprint hashes (``LatentBases.check_weight``, at the first call on each store); None when this graph
            does not rewrite that layer or the weight is not a graph input.
    """

    store: Any
    groups: list[GroupRewrite]
    store_input_index: int
    extra_inputs: list[str] = field(default_factory=list)
    fits_online_bases: bool = False
    slot_probe: fx.GraphModule | None = None
    slot_inputs: list[int] = field(default_factory=list)
    slot_probe_note: str = ""
    rope_writer: bool | None = None
    k_weight_input: int | None = None
    k_weight_path: str | None = None


class LatentKVCachePass(CKVPPass):
    """Rewrite the KV cache of the planned layer groups into the latent store (see the module docstring)."""

    name = "latent_kv_cache"
    stage = "torch"

    def __init__(self, plan: LatentRewritePlan, absorb_attention: bool = True) -> None:
        self.plan = plan
        self.absorb_attention = absorb_attention
        #: per layer, why its SDPA was not turned into ckvp.latent_attention ('' when it was)
        self.notes: dict[int, str] = {}

    def is_applicable(self, graph: fx.Graph) -> str:
        return "" if self.plan.groups else "no layer group has a latent store"

    def apply(self, graph: fx.Graph) -> int:
        from ..ops import latent_kv  # noqa: F401  registers torch.ops.ckvp.*

        store = self.plan.store
        if getattr(getattr(store, "bases", None), "key_space", "pre_rope") == "post_rope":
            # bases of the keys as cached (after RoPE): rewrite every layer as one without RoPE, so the latent
            # holds the cached key and decode scores it with no RoPE rebuild (LatentBases.key_space)
            self.plan.groups = [GroupRewrite(gr.group, tuple(dataclasses.replace(site, rope=None) for site in gr.sites))
                                for gr in self.plan.groups]
        nodes = node_map(graph)
        order = {n: i for i, n in enumerate(graph.nodes)}
        paged = bool(getattr(store, "page_size", 0))
        if paged:  # before any rewrite: the slots' inputs, as the caller passes them
            slot_nodes = [nodes[w.position_node] for gr in self.plan.groups for site in gr.sites
                          for w in (site.k_cache, site.v_cache)]
            probe, slot_inputs, note = _slot_probe(graph, list(dict.fromkeys(slot_nodes)))
            self.plan.slot_probe, self.plan.slot_inputs, self.plan.slot_probe_note = probe, slot_inputs, note
        sites = [site for gr in self.plan.groups for site in gr.sites]
        self.plan.k_weight_input, self.plan.k_weight_path = _fingerprint_weight(graph, nodes, store, sites)
        inputs = _StoreInputs(graph)
        first = next((site for site in sites if site.rope is not None), sites[0])  # (a no-RoPE layer has no tables)
        _check_one_rope_table(nodes, first, sites)
        cos_n, sin_n, pos_n, width = _rope_tables(nodes, first, graph)
        if first.rope is not None:
            store.ensure_rope_tables(width)
            if cos_n is not None:  # this graph writes the tables, from the first RoPE site's cos / sin
                self.plan.rope_writer = bool(first.rope.tables_paired)
                store.note_rope_writer(self.plan.rope_writer)
        rope_cos = inputs.add("ckvp_rope_cos")
        rope_sin = inputs.add("ckvp_rope_sin")
        slot_pos = inputs.add("ckvp_slot_pos")
        # a paged store's page table: the last argument of every latent op (backend._StoreArgs agrees on the order)
        pt = (inputs.add("ckvp_page_table"),) if paged else ()
        rewritten = 0
        group_ends: list[tuple[fx.Node, fx.Node]] = []  # per group: its last store write, its slots
        for gr in self.plan.groups:
            g = gr.group
            lat_k, lat_v = inputs.add(f"ckvp_latent_k_{g}"), inputs.add(f"ckvp_latent_v_{g}")
            bas_k, bas_v = inputs.add(f"ckvp_basis_k_{g}"), inputs.add(f"ckvp_basis_v_{g}")
            res_k = res_v = None
            if store.residual_format:  # ALR-KVD: the residual rows follow the bases (backend._StoreArgs agrees)
                res_k, res_v = inputs.add(f"ckvp_resid_k_{g}"), inputs.add(f"ckvp_resid_v_{g}")
            k_pre_nodes, v_nodes, last_write = [], [], None
            readers: list[fx.Node | None] = []  # the latent_attention nodes: the append goes after them
            windows: list[tuple[fx.Node, ...]] = []  # per site: (window k, v, slots inputs, k_rot, v, slots)
            for j, site in enumerate(gr.sites):
                d = site.head_dim
                form = site.rope.form if site.rope is not None else "none"
                rd = site.rope.rotary_dim if site.rope is not None else 0
                recons: dict[str, tuple[fx.Node, fx.Node, fx.Node, fx.Node]] = {}
                ring = None
                if store.recent_window:  # this layer's dense recent window (backend._StoreArgs agrees on the order)
                    ring = tuple(inputs.add(f"ckvp_window_{x}_{site.layer}") for x in ("k", "v", "slots"))
                    written: dict[str, fx.Node] = {}
                for kind, write, latent, basis, offsets, rope, fmt, resid in (
                    ("k", site.k_cache, lat_k, bas_k, store.k_offsets[g], form, store.k_formats[g], res_k),
                    ("v", site.v_cache, lat_v, bas_v, store.v_offsets[g], "none", store.v_formats[g], res_v),
                ):
                    w, cache, value = nodes[write.write_node], nodes[write.cache_node], nodes[write.value_node]
                    slots = nodes[write.position_node]
                    rows = (slice(None),) * (2 if store.online else 1) + (slice(j * d, (j + 1) * d), slice(None))
                    after = w
                    if ring is not None:  # exact tokens: the ring's (older slots only), then this call's
                        written[kind] = value
                        after, value, slots = _with_window(graph, w, ring[0 if kind == "k" else 1], ring[2], value,
                                                           slots)
                    with graph.inserting_after(after):
                        block = graph.call_function(operator.getitem, (basis, rows))
                    args = (latent, block, offsets, rope_cos, rope_sin, slot_pos, rope, rd if rope != "none" else 0,
                            value, slots, fmt)
                    with graph.inserting_after(block):
                        if resid is None:
                            recon = graph.call_function(torch.ops.ckvp.latent_reconstruct.default, args + pt)
                        else:
                            recon = graph.call_function(torch.ops.ckvp.latent_reconstruct_residual.default,
                                                        (*args, resid, store.group_of(site.layer)[1], len(store.groups[g]),
                                                         store.residual_format))
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
                    recons[kind] = (recon, block, value, slots)
                    last_write = recon if last_write is None or order[recon] > order[last_write] else last_write
                    if kind == "k":
                        k_pre_nodes.append(_pre_rope_key(graph, nodes, site, write, recon))
                    else:
                        v_nodes.append(nodes[write.value_node])
                if ring is not None:
                    windows.append((*ring, written["k"], written["v"], nodes[site.k_cache.position_node]))
                if store.residual_format:
                    self.notes[site.layer] = ("the store holds an ALR-KVD residual, which ckvp.latent_attention does "
                                              "not read: reconstruct (with the residual) + the model's attention")
                elif self.absorb_attention:
                    note, fused = _absorb_attention(graph, nodes[site.attention_node], site, recons,
                                                    (lat_k, lat_v, rope_cos, rope_sin, slot_pos), store, g, pt)
                    self.notes[site.layer] = note
                    readers.append(fused)
                else:
                    self.notes[site.layer] = "absorb_attention=False"
                rewritten += 1
            slots = nodes[gr.sites[-1].k_cache.position_node]
            involved = set(k_pre_nodes) | set(v_nodes) | {slots, last_write} | {r for r in readers if r is not None}
            if cos_n is not None:
                involved |= {cos_n, sin_n, pos_n}
            anchor = [n for n in graph.nodes if n in involved][-1]
            with graph.inserting_after(anchor):
                xk = graph.call_function(torch.cat, (k_pre_nodes, -1))
            with graph.inserting_after(xk):
                xv = graph.call_function(torch.cat, (v_nodes, -1))
            fit_after = xv
            new_tokens = shape_of(v_nodes[0])
            if store.online and new_tokens is not None and new_tokens[2] > 1:
                for lat_basis, x, offsets in ((bas_k, xk, store.k_offsets[g]), (bas_v, xv, store.v_offsets[g])):
                    with graph.inserting_after(fit_after):
                        fit_after = graph.call_function(
                            torch.ops.ckvp.online_basis_fit.default, (lat_basis, x, offsets, slots))
                self.plan.fits_online_bases = True
            with graph.inserting_after(fit_after):
                ak = graph.call_function(
                    torch.ops.ckvp.latent_append.default,
                    (lat_k, xk, bas_k, store.k_offsets[g], slots, store.k_formats[g], *pt)
                )
            with graph.inserting_after(ak):
                av = graph.call_function(
                    torch.ops.ckvp.latent_append.default,
                    (lat_v, xv, bas_v, store.v_offsets[g], slots, store.v_formats[g], *pt)
                )
            if store.residual_format:  # after the latent rows of the new tokens are written
                for res, lat, x, bas, offsets, fmt in ((res_k, lat_k, xk, bas_k, store.k_offsets[g], store.k_formats[g]),
                                                       (res_v, lat_v, xv, bas_v, store.v_offsets[g], store.v_formats[g])):
                    with graph.inserting_after(av):
                        av = graph.call_function(torch.ops.ckvp.residual_append.default,
                                                 (res, lat, x, bas, offsets, slots, fmt, store.residual_format,
                                                  len(store.groups[g])))
            for wk, wv, ws, k_rot, v, w_slots in windows:  # after every read of the rings (the group's attention)
                with graph.inserting_after(av):
                    av = graph.call_function(torch.ops.ckvp.window_append.default, (wk, wv, ws, k_rot, v, w_slots))
            group_ends.append((av, slots))
        if cos_n is not None:  # one write of the tables per graph: after every group's reads, with the same values
            position = {n: i for i, n in enumerate(graph.nodes)}
            end, slots = max(group_ends, key=lambda e: position[e[0]])
            with graph.inserting_after(end):
                graph.call_function(
                    torch.ops.ckvp.rope_table_update.default,
                    (rope_cos, rope_sin, slot_pos, cos_n, sin_n, pos_n, slots),
                )
        self.plan.extra_inputs = inputs.names
        return rewritten


_LAYOUT_METHODS = {"view", "reshape", "expand", "contiguous", "unsqueeze", "repeat_interleave", "flatten",
                   "transpose", "permute"}
_LAYOUT_FUNCTIONS = {operator.getitem, torch.reshape, torch.unsqueeze, torch.repeat_interleave, torch.flatten,
                     torch.transpose, torch.permute}


def _layout_chain(start: fx.Node, end: fx.Node) -> list[fx.Node] | None:
    """The nodes from ``start`` (exclusive) to ``end`` (inclusive) when ``end`` is reached from ``start`` through
    single-tensor layout ops (each taking the previous node and constants only); None otherwise."""
    chain, n = [], end
    while n is not start:
        if n.op == "call_method" and n.target in _LAYOUT_METHODS:
            pass
        elif n.op == "call_function" and n.target in _LAYOUT_FUNCTIONS:
            pass
        else:
            return None
        tensors = [a for a in n.all_input_nodes]
        if len(tensors) != 1:
            return None
        chain.append(n)
        n = tensors[0]
    return chain[::-1]


_PROBE_SLOTS = 8  # the probe's slot count: the layout chain is replayed with S_max shrunk to this
_FULL_PROBE_NUMEL = 1 << 22  # the largest unshrunk probe (float64 elements) when S_max equals another dim


def _replay(chain: list[fx.Node], x: torch.Tensor, prev: fx.Node, s_max: int, s_probe: int) -> torch.Tensor:
    """Run the layout ops of ``chain`` on ``x`` (standing for ``prev``), every int argument equal to ``s_max``
    replaced by ``s_probe`` (the probe has ``s_probe`` slots instead of S_max)."""

    def arg(a: Any) -> Any:
        if a is prev:
            return x
        return s_probe if isinstance(a, int) and not isinstance(a, bool) and a == s_max else a

    for n in chain:
        args, kwargs = map_arg((n.args, n.kwargs), arg)
        args = tuple(arg(a) if not isinstance(a, (tuple, list)) else type(a)(arg(v) for v in a) for a in args)
        x = getattr(x, n.target)(*args[1:], **kwargs) if n.op == "call_method" else n.target(*args, **kwargs)
        prev = n
    return x


def _chain_ints(chain: list[fx.Node]) -> tuple[set[int], set[int]]:
    """(int constants of the chain's arguments outside slices, slice bounds)."""
    ints: set[int] = set()
    bounds: set[int] = set()

    def visit(a: Any) -> None:
        if isinstance(a, bool):
            return
        if isinstance(a, int):
            ints.add(a)
        elif isinstance(a, slice):
            bounds.update(v for v in (a.start, a.stop, a.step) if isinstance(v, int) and not isinstance(v, bool))
        elif isinstance(a, (tuple, list)):
            for v in a:
                visit(v)
        elif isinstance(a, dict):
            for v in a.values():
                visit(v)

    for n in chain:
        visit(n.args)
        visit(n.kwargs)
    return ints, bounds


def _is_gqa_view(chain: list[fx.Node], start: fx.Node, shape: tuple[int, ...], num_heads: int,
                 enable_gqa: bool) -> int | None:
    """Replay ``chain`` on an index probe of shape (B, Hkv, s, D) standing for (B, Hkv, S_max, D), with a few slots
    s (so that the check costs little at any context length): return kv_len when the result is the probe with
    each KV head repeated H/Hkv times (or not at all with ``enable_gqa``) and the slots [0, kv_len); None otherwise.

    Conservative: a chain whose constants could mean something else after shrinking (S_max equal to another
    dim, a slice bound beyond the probe's slots or counted from the end (negative), or an int between s and S_max
    that is no known dim) is refused
    rather than guessed. Where S_max equals another dim (e.g. a cache as long as the head dim) the probe keeps
    all S_max slots instead, when that is at most :data:`_FULL_PROBE_NUMEL` elements: nothing is shrunk, so no
    constant needs reinterpreting, and the probe's distinct values still tell the slot axis from the other."""
    b, hkv, s_max, d = shape
    s_probe = min(s_max, _PROBE_SLOTS)
    dims = {b, hkv, num_heads, d, num_heads // max(hkv, 1), b * num_heads, b * hkv}
    if s_probe < s_max and s_max in dims and b * hkv * s_max * d <= _FULL_PROBE_NUMEL:
        s_probe = s_max
    if s_probe < s_max:
        ints, bounds = _chain_ints(chain)
        # a negative slice bound counts from the end: on the shrunk probe it would mean another slot than on S_max
        # (``k[:, :, :-1]`` keeps S_max - 1 slots, the probe's 7 of 8 would read as kv_len 7)
        if (s_max in dims or any(v < 0 or s_probe < v < s_max or v > s_max for v in bounds)
                or any(s_probe < abs(v) < s_max and abs(v) not in dims for v in ints)):
            return None
    probe = torch.arange(b * hkv * s_probe * d, dtype=torch.float64).view(b, hkv, s_probe, d)
    try:
        out = _replay(chain, probe, start, s_max, s_probe)
    except Exception:  # an op the probe cannot take: not a layout chain we understand
        return None
    heads = hkv if enable_gqa else num_heads
    if out.dim() != 4 or out.shape[0] != b or out.shape[1] != heads or out.shape[3] != d or heads % hkv:
        return None
    kv_len = out.shape[2]
    expected = probe.repeat_interleave(heads // hkv, dim=1)[:, :, :kv_len]
    if not (1 <= kv_len <= s_probe and torch.equal(out, expected)):
        return None
    return s_max if kv_len == s_probe else kv_len


def _absorb_attention(graph: fx.Graph, attn: fx.Node, site: AttentionSite,
                      recons: dict[str, tuple[fx.Node, fx.Node, fx.Node, fx.Node]], inputs: tuple, store: Any,
                      g: int, page_table: tuple = ()) -> tuple[str, fx.Node | None]:
    """Replace the site's SDPA by ``ckvp.latent_attention`` (see the module docstring); return ('', the new node)
    when done, else (the reason it was left as reconstruct-then-SDPA, None). ``page_table``: () or (the paged
    store's page table input,), appended to the op's arguments."""
    if site.form != "sdpa" or attn.target is not torch._C._nn.scaled_dot_product_attention:
        return f"attention form {site.form!r} is not one SDPA call", None
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, attn.args))
    bound.update(attn.kwargs)
    if bound.get("dropout_p", 0.0) not in (0, 0.0) or bound.get("is_causal", False):
        return "SDPA with dropout or is_causal=True", None
    q, k_in, v_in = bound.get("query"), bound.get("key"), bound.get("value")
    mask = bound.get("attn_mask")
    if not all(isinstance(t, fx.Node) for t in (q, k_in, v_in)) or (mask is not None and not isinstance(mask, fx.Node)):
        return "SDPA inputs are not graph tensors", None
    recon_k, block_k, new_k, slots = recons["k"]
    recon_v, block_v, new_v, _ = recons["v"]
    shape = (store.batch_size, store.num_kv_heads, store.max_cache_len, store.head_dim)
    gqa = bool(bound.get("enable_gqa", False))
    lens = []
    for start, end in ((recon_k, k_in), (recon_v, v_in)):
        chain = _layout_chain(start, end)
        kv_len = None if chain is None else _is_gqa_view(chain, start, shape, site.num_heads, gqa)
        if kv_len is None:
            return "K/V reach SDPA through ops other than a GQA expansion and a leading slot slice", None
        lens.append(kv_len)
    if lens[0] != lens[1]:
        return "K and V are sliced to different lengths", None
    scale = bound.get("scale")
    if isinstance(scale, fx.Node):  # a symbolic float (dynamic=True): the op takes a constant
        return "SDPA scale is a graph value (a symbolic float under dynamic shapes)", None
    scale = float(site.head_dim ** -0.5 if scale is None else scale)
    lat_k, lat_v, rope_cos, rope_sin, slot_pos = inputs
    form = site.rope.form if site.rope is not None else "none"
    rd = site.rope.rotary_dim if site.rope is not None else 0
    with graph.inserting_before(attn):
        out = graph.call_function(
            torch.ops.ckvp.latent_attention.default,
            (q, lat_k, lat_v, block_k, block_v, store.k_offsets[g], store.v_offsets[g], rope_cos, rope_sin,
             slot_pos, form, rd, new_k, new_v, slots, mask, scale, lens[0], store.k_formats[g], store.v_formats[g],
             *page_table),
        )
    out.meta.update({k: v for k, v in attn.meta.items() if k in ("val", "example_value", "tensor_meta",
                                                                  "nn_module_stack", "stack_trace")})
    attn.replace_all_uses_with(out)
    graph.erase_node(attn)
    for end in (k_in, v_in):  # the layout chains and the reconstructs, now unused
        n = end
        while isinstance(n, fx.Node) and not n.users and n.op != "placeholder":
            prev = n.all_input_nodes
            graph.erase_node(n)
            n = prev[0] if len(prev) == 1 else None
            if n in (block_k, block_v, new_k, new_v, slots):
                break
    return "", out


def _with_window(graph: fx.Graph, after: fx.Node, ring: fx.Node, ring_slots: fx.Node, value: fx.Node,
                 slots: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node]:
    """The exact tokens of a layer with a dense recent window, inserted after ``after``: ``cat(ring, value)``
    (B, Hkv, W+S, D) in ``value``'s dtype, and their slots (W+S,)
    ``cat(where(ring_slots < min(slots), ring_slots, -1), slots)``: ring entries at or past the call's first slot
    are its own tokens or abandoned ones (a rewound sequence) and are marked unused. Returns (the last node
    inserted, exact values, exact slots)."""
    with graph.inserting_after(after):
        first = graph.call_method("min", (slots,))
    with graph.inserting_after(first):
        keep = graph.call_function(operator.lt, (ring_slots, first))
    with graph.inserting_after(keep):
        older = graph.call_function(torch.where, (keep, ring_slots, -1))
    with graph.inserting_after(older):
        ex_slots = graph.call_function(torch.cat, ((older, slots),))
    with graph.inserting_after(ex_slots):  # the ring is kept in latent_dtype: the exact tokens in the model's
        ring_v = graph.call_method("type_as", (ring, value))
    with graph.inserting_after(ring_v):
        ex = graph.call_function(torch.cat, ((ring_v, value), 2))
    return ex, ex, ex_slots


_PROBE_MAX_NODES = 64  # a slot computation larger than this is not replayed on the host before each call
_PROBE_MAX_INPUT_NUMEL = 1 << 16  # nor one reading large inputs (parameters, activations)


_INPLACE_OPERATORS = (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv)


def _written(n: fx.Node) -> list[Any]:
    """The inputs ``n`` writes: ``self`` of an in-place method or function (``add_``, setitem, ``+=``), the
    mutable arguments of an op, an ``out=``."""
    out = [n.kwargs["out"]] if "out" in n.kwargs else []
    if n.op == "call_method" and n.target.endswith("_") and not n.target.startswith("__"):
        return out + list(n.args[:1])
    if n.op != "call_function":
        return out
    t = n.target
    schema = getattr(t, "_schema", None)
    if schema is not None:
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                out.append(n.args[i] if i < len(n.args) else n.kwargs.get(a.name))
        return out
    name = getattr(t, "__name__", "")
    if t in _INPLACE_OPERATORS or (name.endswith("_") and not name.startswith("__")):
        return out + list(n.args[:1])
    return out


#: Ops whose result may share its first argument's storage: an in-place write to it writes that argument. Casts
#: (``to``, ``float``...) share it only when they change nothing; listing them errs towards giving up the probe.
_ALIASING = frozenset({
    "getitem", "view", "reshape", "_unsafe_view", "squeeze", "unsqueeze", "select", "narrow", "slice", "expand",
    "expand_as", "as_strided", "t", "transpose", "permute", "movedim", "flatten", "unflatten", "view_as", "alias",
    "detach", "contiguous", "split", "chunk", "unbind", "diagonal", "real", "imag", "view_as_real",
    "view_as_complex", "__getitem__", "to", "type_as", "float", "long", "int",
})


def _alias_root(n: Any) -> Any:
    """The node whose storage ``n`` may share, following aliasing ops (views, getitem, no-op casts) back."""
    while isinstance(n, fx.Node) and n.op in ("call_function", "call_method") and n.args \
            and isinstance(n.args[0], fx.Node) and op_name(n) in _ALIASING:
        n = n.args[0]
    return n


def _mutates(n: fx.Node) -> bool:
    """Whether ``n`` writes one of its inputs (see :func:`_written`)."""
    return bool(_written(n))


def _fingerprint_weight(graph: fx.Graph, nodes: dict[str, fx.Node], store: Any,
                        sites: list[AttentionSite]) -> tuple[int | None, str | None]:
    """(input index, attribute path) of the key projection weight of the store's bases' first layer (the one their
    fingerprint hashes, ``calibrate``), when this graph rewrites that layer and the weight is a graph input (Dynamo
    lifts parameters to inputs); (None, None) otherwise."""
    groups = getattr(getattr(store, "bases", None), "groups", None)
    if not groups:
        return None, None
    site = next((s for s in sites if s.layer == groups[0][0]), None)
    w = weight_source(nodes.get(site.k_proj)) if site is not None and site.k_proj is not None else None
    if w is None or w.op != "placeholder":
        return None, None
    return graph.find_nodes(op="placeholder").index(w), placeholder_attr_path(w)


def _slot_probe(graph: fx.Graph, slot_nodes: list[fx.Node]) -> tuple[fx.GraphModule | None, list[int], str]:
    """A copy of the (small) part of ``graph`` that computes ``slot_nodes`` from its inputs, to run on the host
    before a call: ``(probe, input indices, '')``, the probe taking the graph's inputs at those indices (among its
    placeholders) and returning the slot tensors; ``(None, [], reason)`` when the slots depend on more than a
    few cheap ops over small inputs, or on an input the graph writes before reading it for the slots.

    HF ``StaticCache`` computes a call's slots as ``arange(S) + cumulative_length`` (a 0-d input the graph bumps
    after the write); a gpt-fast model passes them as ``input_pos`` (the probe is then the input itself)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    order = {n: i for i, n in enumerate(graph.nodes)}
    needed: set[fx.Node] = set()
    for s in slot_nodes:
        ancestors: set[fx.Node] = set()
        stack = [s]
        while stack:
            n = stack.pop()
            if n in ancestors:
                continue
            ancestors.add(n)
            if len(needed | ancestors) > _PROBE_MAX_NODES:
                return None, [], f"the slots are computed by more than {_PROBE_MAX_NODES} graph nodes"
            if n.op == "placeholder":
                shape = shape_of(n)
                if shape is not None and math.prod(shape) > _PROBE_MAX_INPUT_NUMEL:
                    return None, [], f"the slots are computed from the large input {n.name} {list(shape)}"
                continue
            if n.op not in ("call_function", "call_method") or _mutates(n):
                return None, [], f"the slots are computed through {n.op} {n.target} ({n.name})"
            stack.extend(n.all_input_nodes)
        # what the probe reads before the call must be what the graph reads: nothing on the way written before,
        # directly or through a view of it (HF bumps each layer's length counter in place, after that layer's write)
        roots = {_alias_root(n) for n in ancestors}
        for u in graph.nodes:
            if order[u] >= order[s]:
                break
            hit = next((w for w in _written(u) if w in ancestors or _alias_root(w) in roots), None)
            if hit is not None:
                return None, [], f"the slots ({s.name}) read {_alias_root(hit).name} after the graph writes it " \
                                 f"({u.name})"
        needed |= ancestors
    probe = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        if n in needed:
            env[n] = probe.node_copy(n, lambda a: env[a])
    probe.output(tuple(env[n] for n in slot_nodes))
    indices = [placeholders.index(n) for n in graph.nodes if n in needed and n.op == "placeholder"]
    return fx.GraphModule(torch.nn.Module(), probe), indices, ""


class _StoreInputs:
    """Appends placeholders for store tensors after the graph's existing placeholders."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self.names: list[str] = []
        self.last = [n for n in graph.nodes if n.op == "placeholder"][-1]

    def add(self, name: str) -> fx.Node:
        with self.graph.inserting_after(self.last):
            node = self.graph.placeholder(name)
        _compat.mark_static_placeholder(node)  # the store's tensors keep their addresses: CUDA graphs may bake them
        self.last = node
        self.names.append(node.name)
        return node


def _pre_rope_key(graph: fx.Graph, nodes: dict[str, fx.Node], site: AttentionSite, write: Any,
                  after: fx.Node) -> fx.Node:
    """The (B, Hkv, S, D) key CKVP projects for ``site``: the pre-RoPE key (``site.rope.k_in``), times the factor
    the model applies after RoPE (``site.rope.k_scale``, (..., 1) in ``k_in``'s layout; RoPE is linear, so the
    rebuilt rotation of the product is the model's scaled key), or the key written to the cache without RoPE. New
    nodes go after ``after``."""
    if site.rope is None:
        return _as_bhsd(graph, nodes[write.value_node], site, after)
    x = nodes[site.rope.k_in]
    if site.rope.k_scale is None:
        return _as_bhsd(graph, x, site, after)
    with graph.inserting_after(after):
        scaled = graph.call_function(operator.mul, (x, nodes[site.rope.k_scale]))
    return _as_bhsd(graph, scaled, site, scaled, perm=site.rope.k_in_perm)


def _as_bhsd(graph: fx.Graph, x: fx.Node, site: AttentionSite, after: fx.Node,
             perm: tuple[int, ...] | None = None) -> fx.Node:
    """Return ``x`` as (B, Hkv, S, D): transpose (B, S, Hkv, D) layouts (gpt-fast's pre-RoPE view).

    The pre-RoPE key is laid out as the analysis read off the graph (``site.rope.k_in_perm``); only where it was not
    decided do the sizes tell (which they cannot when S equals Hkv: a prompt as long as the KV heads are many)."""
    if perm is None:
        perm = site.rope.k_in_perm if site.rope is not None and x.name == site.rope.k_in else None
    if perm is not None:
        if tuple(perm) == (0, 1, 2, 3):
            return x
        with graph.inserting_after(after):
            return graph.call_method("permute", (x, *perm))
    shape = shape_of(x)
    if shape is not None and len(shape) == 4 and shape[1] != site.num_kv_heads and shape[2] == site.num_kv_heads:
        with graph.inserting_after(after):
            return graph.call_method("transpose", (x, 1, 2))
    return x


def _check_one_rope_table(nodes: dict[str, fx.Node], first: AttentionSite, sites: list[AttentionSite]) -> None:
    """Raise RuntimeError when a RoPE site's cos / sin are not ``first``'s (:func:`~..analysis.rope.table_key`): the
    store holds one set of tables per graph, and every layer's keys are rebuilt with it."""
    if first.rope is None:
        return

    def key(site: AttentionSite, by_value: bool) -> tuple:
        rope = site.rope
        return tuple(table_key(nodes[t], by_value) if t is not None else None for t in (rope.cos, rope.sin))

    want = key(first, False)
    for site in sites:  # (by value only where the graphs differ: per-layer copies of one buffer are the same tables)
        if site.rope is not None and key(site, False) != want and key(site, True) != key(first, True):
            raise RuntimeError(f"layer {site.layer} rotates its keys by other RoPE tables than layer {first.layer} "
                               f"({site.rope.cos} / {site.rope.sin}, not {first.rope.cos} / {first.rope.sin}); "
                               "the latent store holds one set of tables per graph")


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
    with graph.inserting_after(last):  # -1, not S: S may be symbolic (dynamic shapes), bc and W are not
        cos3 = graph.call_method("reshape", (cos_n, bc, -1, width))
    with graph.inserting_after(cos3):
        sin3 = graph.call_method("reshape", (sin_n, bc, -1, width))
    pos = rope_positions(cos, s)  # (the analysis checked that the tables take in no other position information)
    if pos is None:
        # a table from an earlier graph (not a module buffer such as inv_freq, which every RoPE reads)
        src = cos if cos.op == "placeholder" else find_upstream(
            cos, lambda n: n.op == "placeholder" and not is_module_state(n), max_depth=48)
        hint = "" if src is None else (
            f": the cos / sin tables come from the graph input {src.name}, computed in an earlier graph (a graph break "
            "before the layers, e.g. the data-dependent rescaling of dynamic or longrope RoPE; TORCH_LOGS=graph_breaks "
            "shows it), so the latent store cannot tell which position each row belongs to")
        raise RuntimeError(f"layer {site.layer}: RoPE positions not identified{hint}")
    with graph.inserting_after(max((pos, sin3), key=lambda n: list(graph.nodes).index(n))):
        pos2 = graph.call_method("reshape", (pos, 1, -1)) if len(shape_of(pos)) == 1 else pos  # (Bc or 1, S)
    return cos3, sin3, pos2, width
