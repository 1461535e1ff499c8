"""Find every layer's expert dispatch in a Dynamo FX graph: router -> scoring -> top-k -> experts -> combine.

Found by structure only (never by module class names), in four steps:

1. **Expert GEMMs.** Every node that multiplies by expert weights, in one of these forms:

   ========================  ==================================================================================
   experts_form              structure
   ========================  ==================================================================================
   ``grouped_mm``            ``torch._grouped_mm`` / ``F.grouped_mm(x, W, offs=...)`` (HF "grouped_mm", bf16)
   ``grouped_mm_fallback``   the opaque ``transformers::grouped_mm_fallback`` op (HF "grouped_mm", fp32 on CPU)
   ``batched_mm``            ``bmm`` / ``matmul`` with ``W[expert_ids]`` gathered per (token, slot) (HF
                             "batched_mm")
   ``weight_gather_einsum``  ``einsum`` with ``W[expert_indices]`` (gpt-fast ``ConditionalFeedForward``)
   ``eager_loop``            per-expert ``linear`` / ``matmul`` with ``W[e]`` (a stacked weight indexed by a
                             constant) or with a 2-D weight, applied to ``x[token_idx]`` where ``token_idx`` comes
                             from ``where`` / ``nonzero`` (a loop over ``range(E)``, captured with
                             ``torch._dynamo.config.capture_dynamic_output_shape_ops = True``)
   ========================  ==================================================================================

   ``W`` is a placeholder (a parameter) with a leading expert dimension, ``(E, ., .)``.
2. **Routing top-k.** Each expert GEMM belongs to the nearest ``topk`` upstream of it (through its activations,
   offsets or gather indices). The top-k's input is traced back through views / dtype casts and one scoring op
   (``softmax`` or ``sigmoid``) to the router ``linear`` (T, Dm) -> (T, E).
3. **Routing weights and combine.** From each last ("down") expert GEMM, the combine is the nearest ``mul`` /
   ``einsum`` with a second operand; that operand is traced back to the top-k values through views, gathers
   (``w[perm]``), an optional ``softmax`` (top-k on the logits, then softmax over the k) and an optional
   renormalisation ``w / w.sum(-1, keepdim=True)`` (``renormalize``). The weighted sum over the k slots
   (``sum``, ``index_add_``, or the combine ``einsum`` itself) is the routed output.
4. **Shared expert.** An ``add`` of the routed output and a dense MLP of the router's input (linears from the
   same tensor, a down linear back to Dm), optionally gated by ``sigmoid(linear(x))`` with one output
   (Qwen2-MoE); ungated for DeepSeek-V3.

Recognised but unusable patterns are returned as :class:`~.sites.UnsupportedSite` and get no site:

=========================  ========================================================================================
kind                       structure
=========================  ========================================================================================
``eager_loop_graph_break`` a router -> top-k whose indices leave the graph with no experts in it (HF "eager": the
                           loop over hit experts calls ``nonzero`` and Dynamo breaks the graph there)
``unsupported_router``     routing that :class:`~.sites.MoESite` cannot express: ops between the router and the
                           top-k (a score-correction bias, group-limited masking: DeepSeek-V3), routing weights
                           not equal to the top-k values (gathered from the scores, scaled by a factor), no
                           softmax / sigmoid, or expert GEMMs whose ids come from no top-k (PhiMoE's sparsemixer:
                           ``max`` and a masked second ``max``), reported per layer without a top-k finding
``unknown_experts_form``   a router -> top-k whose indices are used in the graph, but not by a known expert GEMM,
                           or expert GEMMs of several forms under one top-k
``unknown_combine``        expert GEMMs whose outputs are never multiplied by the routing weights
=========================  ========================================================================================

A top-k without expert GEMMs is only reported when it looks like a router: k < E <= 1024, a linear producing
the E scores and a softmax / sigmoid, E not the vocabulary size (the rows of an embedding table in the graph),
and, when the graph has numbered layers, the router linear inside one (``model.layers.3.mlp.gate``, not
``lm_head``), and not when its router linear is also the router of a top-k that feeds experts found in the graph
(a second top-k over the same scores: HF's load-balancing loss with ``output_router_logits=True``, which reads
only the router's output). This keeps a sampling top-k over vocabulary logits out of the report. Layer indices come from
the module paths (:func:`~.graph.assign_layer_indices`). :func:`find_moe_sites` never raises: a candidate
whose analysis fails unexpectedly is logged at DEBUG and reported as ``UnsupportedSite(kind='analysis_error')``.

Dimension glossary: T tokens, Dm model dim, E experts, A active experts per token (top-k), I expert FFN dim.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.fx as fx

from .graph import (
    VIEW_LIKE,
    users_through_views,
    ancestors,
    arg,
    find_downstream,
    dtype_of,
    find_upstream,
    has_numbered_layers,
    LayerFinding,
    layer_prefix,
    module_path,
    node_layer_prefix,
    number_findings,
    op_name,
    placeholder_source,
    positions,
    shape_of,
    strip_views,
    tensor_args,
)
from .sites import ExpertsForm, MoESite, SharedExpertSite, UnsupportedSite

__all__ = ["find_moe_sites", "MAX_ROUTER_EXPERTS"]

logger = logging.getLogger(__name__)

#: A top-k with no expert GEMMs is only reported as a router when its E is at most this (vocab-sized
#: top-k's are sampling, not routing; the largest routers in use have 512 experts).
MAX_ROUTER_EXPERTS = 1024

#: View / dtype ops walked through on routing paths (graph.VIEW_LIKE plus the spellings routers use).
_PASS = VIEW_LIKE | {"type", "double", "squeeze", "unsqueeze", "view_as", "reshape_as"}
_EXTRA_VIEWS = ("type", "double", "squeeze", "view_as", "reshape_as")
_SCORING = {"softmax": "softmax", "sigmoid": "sigmoid"}
_GROUPED = {"grouped_mm": "grouped_mm", "transformers::grouped_mm_fallback": "grouped_mm_fallback"}
_GATHERS = {"getitem", "index_select", "index", "embedding"}
_DYNAMIC_INDEX = {"where", "nonzero", "argwhere"}
#: Ops between an expert's gathered input and its later GEMMs (activations, gating, splits).
_EXPERT_BODY = VIEW_LIKE | {"getitem", "chunk", "split", "unbind", "mul", "silu", "gelu", "relu", "sigmoid",
                            "tanh", "linear", "matmul", "type", "squeeze"}
#: Ops between a down GEMM and the combine multiply (views, un-sorting gathers, an in-place bias add).
_TO_COMBINE = _PASS | {"getitem", "add_", "masked_fill"}
#: Reductions over the k slots; the in-place ones accumulate into their first argument.
_REDUCE = {"sum", "index_add_", "index_add", "scatter_add_", "scatter_add", "index_put_", "index_put"}
_INPLACE_ACCUMULATE = {"index_add_", "scatter_add_", "index_put_"}
_OUT_OF_PLACE_ACCUMULATE = {"index_add", "scatter_add", "index_put"}
_LINEARS = {"linear", "matmul"}
_ROUTER_OP_HINTS = {
    "add": "a bias added to the scores before selection (e.g. DeepSeek-V3's e_score_correction_bias)",
    "masked_fill": "masked scores (group-limited routing, e.g. DeepSeek-V3 n_group/topk_group)",
    "where": "masked scores (group-limited routing)",
    "topk": "a second top-k before the routing top-k (group-limited routing)",
    "mul": "scaled routing weights (e.g. DeepSeek-V3's routed_scaling_factor)",
    "gather": "routing weights gathered from the scores instead of taken from the top-k values",
}

_GRAPH_BREAK_FIX = (
    'use experts_implementation="grouped_mm" (from_config / from_pretrained kwarg, or '
    'model.set_experts_implementation("grouped_mm")); a loop over range(E) with torch.where also compiles '
    "into one graph with torch._dynamo.config.capture_dynamic_output_shape_ops = True."
)
_ROUTER_FIX = "NYI: this routing is left as captured (ckvp rewrites softmax/sigmoid -> top-k [-> renormalise] only)."
_FORM_FIX = (
    'use a supported experts form: HF experts_implementation="grouped_mm" or "batched_mm", or a gpt-fast '
    "style weight-gather einsum."
)


@dataclass(frozen=True)
class _ExpertGemm:
    """One expert GEMM: the node, its form, and its weight (placeholder, or the node it was gathered from)."""

    node: fx.Node
    form: ExpertsForm
    weight: fx.Node


def find_moe_sites(graph: fx.Graph) -> tuple[list[MoESite], list[UnsupportedSite]]:
    """Find every expert-dispatch site of a Dynamo (torch-level) FX graph.

    Args:
        graph: the graph Dynamo hands to a backend (parameters are placeholders with ``grapharg`` sources,
            ``example_value`` fake tensors, ``nn_module_stack`` metadata). Read only: nothing is modified.
    Returns:
        (sites, unsupported): one :class:`MoESite` per understood router -> top-k -> experts -> combine, in
        graph order, ``layer`` from the site's module path (:func:`~.graph.assign_layer_indices`; numbered in
        graph order when the graph has no numbered module paths); and the recognised-but-unusable patterns
        (see the module docstring).
    Raises:
        Nothing: unknown patterns are not reported; unexpected failures become ``analysis_error`` entries.
    """
    sites: list[MoESite] = []
    unsupported: list[UnsupportedSite] = []
    for items in number_findings(moe_findings(graph)):
        for x in items:
            (sites if isinstance(x, MoESite) else unsupported).append(x)
    return sites, unsupported


def moe_findings(graph: fx.Graph) -> list[LayerFinding]:
    """The MoE sites and unsupported patterns of ``graph``, one :class:`~.graph.LayerFinding` per top-k that
    gave either, with layer -1 until :func:`~.graph.number_findings` numbers them."""
    nodes = list(graph.nodes)
    topks = [n for n in nodes if op_name(n) == "topk"]
    owned: dict[fx.Node, list[_ExpertGemm]] = {t: [] for t in topks}
    orphans: list[_ExpertGemm] = []  # expert GEMMs under no top-k (routing by other means, e.g. PhiMoE's sparsemixer)
    for n in nodes:
        gemm = _classify_expert_gemm(n)
        if gemm is None:
            continue
        owner = find_upstream(n, lambda m: op_name(m) == "topk", max_depth=64) if topks else None
        if owner is not None:
            owned[owner].append(gemm)
        else:
            orphans.append(gemm)
    if not topks and not orphans:
        return []

    where = positions(graph)
    context = _GraphContext(numbered=has_numbered_layers(graph), vocab=_vocabulary_sizes(nodes),
                            site_routers=_site_routers(t for t in topks if owned[t] or _offloaded(t)))
    findings: list[LayerFinding] = []
    for t in topks:
        anchor, path = t, module_path(t)
        try:
            if owned[t]:
                items, anchor, path = _analyse_site(t, owned[t])
            else:
                items, anchor, path = _analyse_routerless_experts(t, context)
        except Exception as exc:  # analysis must never break compilation
            logger.debug("ckvp: MoE analysis of %s failed", t.name, exc_info=True)
            items = [UnsupportedSite(
                "analysis_error", -1, f"MoE analysis of top-k {t.name} failed ({exc!r}).",
                "please report this graph; the layer is left as captured.", (t.name,),
            )]
        if items:
            findings.append(LayerFinding(where[anchor], _layer_prefix_of(path, anchor), "moe", items))
    return findings + _orphan_gemm_findings(orphans, findings, where)


def _orphan_gemm_findings(orphans: list[_ExpertGemm], findings: list[LayerFinding],
                          where: dict[fx.Node, int]) -> list[LayerFinding]:
    """Report expert GEMMs that no top-k routes, one ``unsupported_router`` finding per layer prefix.

    Args:
        orphans: expert GEMMs (:func:`_classify_expert_gemm`) with no ``topk`` upstream of them.
        findings: the findings already made from top-ks; a layer prefix among them gets nothing more (those
            findings speak for the layer), and GEMMs without a layer prefix are reported only when there are none
            (in an unnumbered graph a finding of its own would shift the positional numbering of the others).
        where: node -> graph position.
    Returns:
        New :class:`~.graph.LayerFinding` objects (layer -1 until numbered), in graph order; [] when there are no
        orphans. Nothing is rewritten for them: the layer runs as the model computes it.
    """
    taken = {f.prefix for f in findings if f.prefix is not None}
    groups: dict[str | None, list[_ExpertGemm]] = {}
    for g in orphans:
        prefix = node_layer_prefix(g.node)
        if (prefix is None and not findings) or (prefix is not None and prefix not in taken):
            groups.setdefault(prefix, []).append(g)
    out = []
    for prefix, gemms in groups.items():
        forms = sorted({g.form for g in gemms})
        names = tuple(g.node.name for g in gemms)
        out.append(LayerFinding(where[gemms[0].node], prefix, "moe", [UnsupportedSite(
            "unsupported_router", -1,
            f"expert GEMMs {list(names)} ({', '.join(forms)}) are routed by expert ids that do not come from a "
            "top-k (e.g. PhiMoE's sparsemixer, which picks experts with max and a masked second max); only "
            "softmax/sigmoid -> top-k routing is read.",
            "none: the layer runs as the model computes it (routing other than top-k is NYI).", names)]))
    return out


@dataclass(frozen=True)
class _GraphContext:
    """Facts about the whole graph that decide whether a top-k without experts can be a router.

    numbered: some call runs inside a numbered module path (``layers.3``): routers then live in numbered layers.
    vocab: the row counts of the embedding tables used in the graph (the vocabulary sizes).
    """

    numbered: bool
    vocab: frozenset[int]
    site_routers: frozenset[fx.Node] = frozenset()


def _site_routers(topks: Iterable[fx.Node]) -> frozenset[fx.Node]:
    """The router linears of the top-ks that own expert GEMMs or feed an expert offloader (the MoE sites' routers).

    Args:
        topks: ``topk`` nodes that have expert GEMMs (or a ``ckvp::offload_experts`` call) downstream.
    Returns:
        The set of router ``linear`` / ``matmul`` nodes those top-ks read (through views and one scoring op); a
        top-k whose router cannot be traced contributes nothing. Never raises.
    """
    found = set()
    for t in topks:
        shape = shape_of(t.args[0]) if t.args and isinstance(t.args[0], fx.Node) else None
        if shape:
            linear = _trace_router(t, shape[-1]).linear
            if linear is not None:
                found.add(linear)
    return frozenset(found)


def _offloaded(topk: fx.Node) -> bool:
    """True when the top-k's expert indices feed an expert offloader's op (``ckvp::offload_experts``)."""
    indices = _topk_indices(topk)
    return indices is not None and any(op_name(u) == "ckvp::offload_experts" for u in _through_views(indices))


def _vocabulary_sizes(nodes: Iterable[fx.Node]) -> frozenset[int]:
    """Rows V of every embedding table (V, D) looked up in the graph (``F.embedding`` / ``aten.embedding``)."""
    sizes = set()
    for n in nodes:
        if op_name(n) != "embedding":
            continue
        for a in tensor_args(n):
            shape = shape_of(a)
            if shape is not None and len(shape) == 2 and (dtype_of(a) or torch.int64).is_floating_point:
                sizes.add(shape[0])
                break
    return frozenset(s for s in sizes if s > 0)


def _layer_prefix_of(path: str, anchor: fx.Node) -> str | None:
    """The layer prefix of a MoE finding: from its (common) module path, else from its anchor node's."""
    prefix = layer_prefix(path)
    return prefix if prefix is not None else node_layer_prefix(anchor)


# ----------------------------------------------------------------------------------------------------------------
# Step 1: expert GEMMs


def _stacked_weight(node: object) -> fx.Node | None:
    """Return the placeholder / get_attr behind ``node`` when it is a weight with >= 3 dims (E, ., .)."""
    w = strip_views(node, _EXTRA_VIEWS)
    if isinstance(w, fx.Node) and w.op in ("placeholder", "get_attr"):
        shape = shape_of(w)
        if shape is not None and len(shape) >= 3:
            return w
    return None


def _index_nodes(index: object) -> list[fx.Node]:
    if isinstance(index, fx.Node):
        return [index]
    if isinstance(index, (tuple, list)):
        return [i for i in index if isinstance(i, fx.Node)]
    return []


def _is_topk_index(node: fx.Node) -> bool:
    """True when ``node`` is computed (within 4 hops) from a top-k's indices."""
    return op_name(node) == "topk" or find_upstream(node, lambda m: op_name(m) == "topk", 4) is not None


def _weight_gather(node: object) -> fx.Node | None:
    """``W[idx]`` / ``index_select(W, 0, idx)`` with a stacked weight W and ``idx`` computed from a top-k's
    indices: return W. (A cache gathered through a page table is not an expert weight.)"""
    n = strip_views(node, _EXTRA_VIEWS)
    if not isinstance(n, fx.Node) or op_name(n) not in _GATHERS or not n.args:
        return None
    if op_name(n) == "embedding":  # F.embedding(idx, W)
        base, index = (n.args[1], n.args[0]) if len(n.args) > 1 else (None, None)
    elif op_name(n) == "index_select":
        base, index = n.args[0], arg(n, 2, "index")
    else:
        base, index = n.args[0], (n.args[1] if len(n.args) > 1 else None)
    if any(_is_topk_index(i) for i in _index_nodes(index)):
        return _stacked_weight(base)
    return None


def _weight_select(node: object) -> fx.Node | None:
    """``W[e]`` / ``W.select(0, e)`` with a constant e and a stacked weight W: return W."""
    n = strip_views(node, _EXTRA_VIEWS)
    if not isinstance(n, fx.Node) or not n.args:
        return None
    name = op_name(n)
    if name == "getitem" and len(n.args) > 1:
        index = n.args[1]
        lead = index[0] if isinstance(index, tuple) and index else index
        if isinstance(lead, numbers.Integral) and not isinstance(lead, bool):
            return _stacked_weight(n.args[0])
    if name == "select" and isinstance(arg(n, 2, "index"), numbers.Integral):
        return _stacked_weight(n.args[0])
    return None


def _is_dynamic_index_gather(node: fx.Node) -> bool:
    """``x[idx]`` where ``idx`` comes (within 3 hops) from ``where`` / ``nonzero`` (tokens routed to one expert)."""
    if op_name(node) != "getitem" or len(node.args) < 2:
        return False
    return any(op_name(i) in _DYNAMIC_INDEX or find_upstream(i, lambda m: op_name(m) in _DYNAMIC_INDEX, 3)
               for i in _index_nodes(node.args[1]))


def _routed_tokens(x: object) -> bool:
    """True when ``x`` holds the tokens routed to one expert: ``h[token_idx]`` with ``token_idx`` from
    ``where`` / ``nonzero``, possibly through the expert's earlier GEMMs and activation."""
    return isinstance(x, fx.Node) and (
        _is_dynamic_index_gather(x)
        or find_upstream(x, _is_dynamic_index_gather, 8, through=lambda m: op_name(m) in _EXPERT_BODY) is not None
    )


def _classify_expert_gemm(node: fx.Node) -> _ExpertGemm | None:
    """Return the expert GEMM ``node`` is, or None (see the forms table in the module docstring)."""
    if node.op not in ("call_function", "call_method"):
        return None
    name = op_name(node)
    if name in _GROUPED:
        w = arg(node, 1, "mat_b") if name == "grouped_mm" else arg(node, 1, "weight")
        w = w if w is not None else arg(node, 1, "mat2")
        if isinstance(w, fx.Node):
            return _ExpertGemm(node, _GROUPED[name], strip_views(w, _EXTRA_VIEWS))
        return None
    if name not in ("matmul", "einsum", "linear"):
        return None
    operands = tensor_args(node)
    if name in ("matmul", "einsum"):
        for a in operands:
            w = _weight_gather(a)
            if w is not None:
                return _ExpertGemm(node, "batched_mm" if name == "matmul" else "weight_gather_einsum", w)
    if name in ("linear", "matmul") and len(operands) >= 2 and _routed_tokens(operands[0]):
        for a in operands[1:]:
            w = _weight_select(a)
            if w is None and name == "linear":
                plain = strip_views(a, _EXTRA_VIEWS)
                w = plain if plain.op in ("placeholder", "get_attr") else None
            if w is not None:
                return _ExpertGemm(node, "eager_loop", w)
    return None


# ----------------------------------------------------------------------------------------------------------------
# Step 2: router


@dataclass
class _Router:
    """What lies between the router linear and the top-k."""

    linear: fx.Node | None = None
    scoring: fx.Node | None = None  # softmax / sigmoid before the top-k
    other_ops: list[fx.Node] = dataclasses.field(default_factory=list)


def _topk_k(topk: fx.Node) -> int | None:
    k = arg(topk, 1, "k")
    if isinstance(k, numbers.Integral):
        return int(k)
    shape = shape_of(topk.users and next(iter(topk.users)))
    return shape[-1] if shape else None


def _topk_values(topk: fx.Node) -> fx.Node | None:
    return next((u for u in topk.users if op_name(u) == "getitem" and u.args[1] == 0), None)


def _topk_indices(topk: fx.Node) -> fx.Node | None:
    return next((u for u in topk.users if op_name(u) == "getitem" and u.args[1] == 1), None)


def _main_input(node: fx.Node) -> fx.Node | None:
    """The data operand of a unary-ish op: the first tensor argument that is not a parameter, else the first."""
    args = tensor_args(node)
    computed = [a for a in args if a.op != "placeholder"]
    return (computed or args or [None])[0]


def _trace_router(topk: fx.Node, num_experts: int) -> _Router:
    """Walk from the top-k's input up to the router linear, (T, Dm) -> (T, E), recording what lies between."""
    router = _Router()
    n = topk.args[0] if topk.args and isinstance(topk.args[0], fx.Node) else None
    for _ in range(24):
        if n is None or n.op in ("placeholder", "get_attr", "output"):
            break
        name = op_name(n)
        shape = shape_of(n)
        if name in _LINEARS and shape and shape[-1] == num_experts:
            router.linear = n
            break
        if name in _PASS:
            n = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            continue
        if name in _SCORING and router.scoring is None:
            router.scoring = n
        else:
            router.other_ops.append(n)
            if name == "topk":
                break
        n = _main_input(n)
    return router


# ----------------------------------------------------------------------------------------------------------------
# Step 3: routing weights, combine and routed output


@dataclass
class _Weights:
    """The path from the combine's weight operand back to the top-k values."""

    reached_topk: bool = False
    scoring: fx.Node | None = None  # softmax / sigmoid after the top-k
    renorm: fx.Node | None = None
    other_ops: list[fx.Node] = dataclasses.field(default_factory=list)


def _is_sum_of(divisor: object, x: object) -> bool:
    """True when ``divisor`` is ``x.sum(-1, keepdim=True)`` (optionally ``+ eps``), looking through views."""
    d = strip_views(divisor, _EXTRA_VIEWS)
    if isinstance(d, fx.Node) and op_name(d) == "add":
        tensors = tensor_args(d)
        if len(tensors) == 1:
            d = strip_views(tensors[0], _EXTRA_VIEWS)
    return (isinstance(d, fx.Node) and op_name(d) == "sum" and bool(d.args)
            and strip_views(d.args[0], _EXTRA_VIEWS) is strip_views(x, _EXTRA_VIEWS))


def _trace_weights(operand: fx.Node, topk: fx.Node) -> _Weights:
    """Walk from the combine's weight operand up to ``topk[0]``, recording softmax, renormalisation and the rest."""
    w = _Weights()
    n: fx.Node | None = operand
    for _ in range(32):
        if n is None or n.op in ("placeholder", "get_attr"):
            break
        name = op_name(n)
        if name == "getitem" and n.args[0] is topk:
            w.reached_topk = n.args[1] == 0
            break
        if name in ("topk", "linear", "matmul", "gather"):
            if name == "gather":
                w.other_ops.append(n)
            break
        if name in _PASS or (name == "getitem" and isinstance(n.args[0], fx.Node)):
            n = n.args[0]
            continue
        if name in _SCORING and w.scoring is None:
            w.scoring = n
        elif name == "div" and w.renorm is None and len(n.args) > 1 and _is_sum_of(n.args[1], n.args[0]):
            w.renorm = n
        else:
            w.other_ops.append(n)
        n = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else _main_input(n)
    return w


def _down_gemms(gemms: list[_ExpertGemm]) -> list[_ExpertGemm]:
    """The expert GEMMs whose output feeds no other expert GEMM (the down projections)."""
    nodes = {g.node for g in gemms}
    fed: set[fx.Node] = set()
    for g in gemms:
        fed |= ancestors(g.node, max_depth=16) & nodes
    return [g for g in gemms if g.node not in fed]


def _depends_on(node: object, target: fx.Node, depth: int = 12) -> bool:
    return node is target or (isinstance(node, fx.Node) and find_upstream(node, lambda m: m is target, depth) is not None)


def _find_combine(down: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """Return (combine node, its routing-weight operand): the nearest mul / einsum after ``down`` with a second
    tensor operand that does not come from ``down``."""

    def is_combine(n: fx.Node) -> bool:
        return op_name(n) in ("mul", "einsum") and len(tensor_args(n)) >= 2

    combine = find_downstream(down, is_combine, max_depth=10, through=lambda n: op_name(n) in _TO_COMBINE)
    if combine is None:
        return None
    others = [a for a in tensor_args(combine) if not _depends_on(a, down)]
    return (combine, others[0]) if others else None


def _routed_output(combine: fx.Node) -> fx.Node:
    """The routed experts' output: the weighted sum over the k slots after ``combine`` (the accumulator of an
    in-place ``index_add_``; the last link of a chain of out-of-place ones, ``acc = acc.index_add(...)`` per
    expert), or ``combine`` itself when it already sums (``einsum('tai,ta->ti')``). What the accumulations start
    from and add is checked by the rewrite (``passes.expert_gemm._check_accumulation``)."""
    reduce = find_downstream(combine, lambda n: op_name(n) in _REDUCE, max_depth=8,
                             through=lambda n: op_name(n) in _PASS | {"getitem"})
    if op_name(combine) == "einsum" and (reduce is None or len(shape_of(combine) or ()) == 2):
        return combine
    if reduce is None:
        return combine
    if op_name(reduce) in _INPLACE_ACCUMULATE and isinstance(reduce.args[0], fx.Node):
        return reduce.args[0]
    return _accumulation_chain_end(reduce)


def _accumulation_chain_end(node: fx.Node) -> fx.Node:
    """Follow out-of-place accumulations (``acc = acc.index_add(...)``, each link the only reader of the one
    before) from ``node`` to the last one; ``node`` itself when nothing accumulates into it that way."""
    for _ in range(4096):
        nxt = [u for u in node.users if op_name(u) in _OUT_OF_PLACE_ACCUMULATE and u.args and u.args[0] is node]
        if len(nxt) != 1 or len(node.users) != 1:
            return node
        node = nxt[0]
    return node


def _consumers(node: fx.Node) -> list[fx.Node]:
    """Users of ``node`` other than in-place accumulations into it."""
    return [u for u in node.users if not (op_name(u) in _INPLACE_ACCUMULATE and u.args and u.args[0] is node)]


def _through_views(node: fx.Node) -> Iterable[fx.Node]:
    """Non-view consumers of ``node``, looking through view / dtype ops."""
    return users_through_views(node, _PASS - VIEW_LIKE, users=_consumers)


def _extend_views(node: fx.Node) -> fx.Node:
    """Follow a chain of single-consumer view / dtype ops forward (to the tensor the rest of the model reads)."""
    while True:
        users = _consumers(node)
        if len(users) != 1 or op_name(users[0]) not in _PASS:
            return node
        node = users[0]


# ----------------------------------------------------------------------------------------------------------------
# Step 4: shared expert


def _find_shared_expert(routed: fx.Node, x_root: fx.Node, router: fx.Node,
                        hidden: int) -> tuple[SharedExpertSite, fx.Node] | None:
    """Return (site, its add) for an ``add`` joining ``routed`` with a dense MLP of ``x_root``: linears from
    ``x_root`` feeding a down linear back to Dm, optionally scaled by ``sigmoid(linear(x_root))`` of width 1."""
    for add in _through_views(routed):
        if op_name(add) != "add":
            continue
        others = [a for a in tensor_args(add) if strip_views(a, _EXTRA_VIEWS) is not strip_views(routed, _EXTRA_VIEWS)
                  and not _depends_on(a, routed, 4)]
        if len(others) != 1:
            continue
        out = strip_views(others[0], _EXTRA_VIEWS)
        gate = None
        if op_name(out) == "mul":
            factors = [strip_views(a, _EXTRA_VIEWS) for a in tensor_args(out)]
            for i, f in enumerate(factors):
                if op_name(f) == "sigmoid" and len(factors) == 2:
                    lin = strip_views(_main_input(f), _EXTRA_VIEWS)
                    if op_name(lin) in _LINEARS and (shape_of(lin) or (0,))[-1] == 1 and _root(lin) is x_root:
                        gate, out = lin, factors[1 - i]
                        break
        if op_name(out) not in _LINEARS or (shape_of(out) or (0,))[-1] != hidden:
            continue
        found = {a for a in ancestors(out, max_depth=6)
                 if op_name(a) in _LINEARS and a is not router and a is not gate and _root(a) is x_root}
        ups = [n for n in out.graph.nodes if n in found]  # graph order
        if ups:
            return SharedExpertSite(
                gate_up_nodes=tuple(a.name for a in ups), down_node=out.name,
                gate_node=gate.name if gate is not None else None, combine_node=add.name,
            ), add
    return None


def _root(linear: fx.Node) -> fx.Node | None:
    x = linear.args[0] if linear.args else None
    return strip_views(x, _EXTRA_VIEWS) if isinstance(x, fx.Node) else None


# ----------------------------------------------------------------------------------------------------------------
# Assembling a site


def _analyse_site(topk: fx.Node, gemms: list[_ExpertGemm]) -> tuple[list[MoESite | UnsupportedSite], fx.Node, str]:
    """Build the MoESite of ``topk`` and its expert GEMMs, or say why it cannot be used.

    Returns ([the site] or the problems, the anchor node (router linear, else the top-k), the module path
    common to the router and the expert GEMMs). Layer fields are -1 (numbered later).
    """
    in_shape = shape_of(topk.args[0]) or ()
    num_experts = in_shape[-1] if in_shape else 0
    top_k = _topk_k(topk) or 0
    router = _trace_router(topk, num_experts)
    anchor = router.linear if router.linear is not None else topk
    path = _common_path(anchor, *(g.node for g in gemms))
    layer = -1
    gemm_names = tuple(g.node.name for g in gemms)
    where = f"top-k {topk.name} (E={num_experts}, A={top_k})"

    forms = sorted({g.form for g in gemms})
    if len(forms) > 1:
        return [UnsupportedSite(
            "unknown_experts_form", layer, f"{where} feeds expert GEMMs of several forms ({', '.join(forms)}).",
            _FORM_FIX, (topk.name, *gemm_names))], anchor, path
    form = forms[0]

    downs = _down_gemms(gemms)
    combines = [c for c in (_find_combine(d.node) for d in downs) if c is not None]
    if not combines:
        return [UnsupportedSite(
            "unknown_combine", layer,
            f"{where}: the outputs of its {form} expert GEMMs are never multiplied by the routing weights.",
            "NYI: routing weights applied before or inside the experts (not to their outputs) are not supported.",
            (topk.name, *gemm_names))], anchor, path
    combine, weight_operand = combines[0]
    weights = _trace_weights(weight_operand, topk)

    problems = _router_problems(router, weights)
    if problems:
        nodes = tuple(n.name for n in (router.linear, topk) if n is not None) + gemm_names
        return [UnsupportedSite(
            "unsupported_router", layer,
            f"{where} with {form} experts: routing not expressible as softmax/sigmoid -> top-k "
            f"[-> renormalise]: {'; '.join(problems)}.", _ROUTER_FIX, nodes)], anchor, path
    assert router.linear is not None  # _router_problems reports a missing router

    scoring = router.scoring if router.scoring is not None else weights.scoring
    routed = _routed_output(combine)
    x = router.linear.args[0]
    hidden = _hidden_dim(router.linear)
    found = _find_shared_expert(routed, strip_views(x, _EXTRA_VIEWS), router.linear, hidden)
    shared, out = (found[0], _extend_views(found[1])) if found else (None, _extend_views(routed))
    down_weight = (sorted(downs, key=lambda g: _position(g.node))[-1] if downs else gemms[-1]).weight
    site = MoESite(
        layer=layer,
        module_path=path,
        router_node=router.linear.name,
        scoring=_SCORING[op_name(scoring)],
        scoring_node=scoring.name,
        topk_node=topk.name,
        num_experts=num_experts,
        top_k=top_k,
        softmax_before_topk=router.scoring is not None,
        renormalize=weights.renorm is not None,
        experts_form=form,
        expert_nodes=gemm_names,
        expert_weights=tuple(dict.fromkeys(_source(g.weight) for g in gemms)),
        hidden_dim=hidden,
        ffn_dim=_ffn_dim(down_weight, hidden),
        shared_expert=shared,
        output_node=out.name,
    )
    return [site], anchor, path


def _router_problems(router: _Router, weights: _Weights) -> list[str]:
    """Why the routing of a site is not expressible as a MoESite (empty when it is)."""
    problems = []
    if router.linear is None:
        problems.append("no router linear (T, Dm) -> (T, E) upstream of the top-k")
    for n in router.other_ops:
        problems.append(f"{n.name} ({op_name(n)}) between router and top-k: "
                        f"{_ROUTER_OP_HINTS.get(op_name(n), 'an unknown op')}")
    if not weights.reached_topk:
        problems.append("the routing weights are not the top-k values "
                        f"({_ROUTER_OP_HINTS['gather'] if _has_gather(weights) else 'unknown source'})")
    for n in weights.other_ops:
        if op_name(n) != "gather":
            problems.append(f"{n.name} ({op_name(n)}) applied to the routing weights: "
                            f"{_ROUTER_OP_HINTS.get(op_name(n), 'an unknown op')}")
    if router.scoring is not None and weights.scoring is not None:
        problems.append("scoring both before and after the top-k")
    if router.scoring is None and weights.scoring is None:
        problems.append("no softmax or sigmoid scoring")
    for s in (router.scoring, weights.scoring):
        if s is not None and op_name(s) == "softmax" and arg(s, 1, "dim", -1) not in (-1, len(shape_of(s) or ()) - 1):
            problems.append(f"{s.name} is a softmax over dim {arg(s, 1, 'dim')}, not over the experts")
    return problems


def _has_gather(weights: _Weights) -> bool:
    return any(op_name(n) == "gather" for n in weights.other_ops)


def _analyse_routerless_experts(topk: fx.Node, context: _GraphContext) -> tuple[list[UnsupportedSite], fx.Node, str]:
    """A router -> top-k without expert GEMMs: a graph break before the experts, or an unknown experts form.

    With no expert weights gathered, only the routing itself says this is MoE, so a top-k is taken for a
    router only when it looks like one: ``k < E <= MAX_ROUTER_EXPERTS``, a linear producing the E scores, a
    softmax / sigmoid, E not the vocabulary size (an embedding table's rows: top-k over vocabulary logits is
    sampling), and, in a graph with numbered layers, the linear inside a numbered layer (an LM head is not).
    Returns (the patterns found, the anchor node, its module path).
    """
    none: tuple[list[UnsupportedSite], fx.Node, str] = ([], topk, "")
    indices = _topk_indices(topk)
    in_shape = shape_of(topk.args[0]) if topk.args else None
    k = _topk_k(topk)
    if indices is None or not indices.users or not in_shape or k is None:
        return none
    if any(op_name(u) == "ckvp::offload_experts" for u in _through_views(indices)):
        return none  # experts served by an expert offloader (runtime/offload.py): nothing to rewrite or report
    num_experts = in_shape[-1]
    if not (0 < k < num_experts <= MAX_ROUTER_EXPERTS) or num_experts in context.vocab:
        return none
    router = _trace_router(topk, num_experts)
    if router.linear is None or (router.scoring is None and not _has_scoring_after(topk)):
        return none
    if router.linear in context.site_routers:
        # a second top-k over the scores of a router whose own top-k feeds experts found in this graph (or an expert
        # offloader): HF's load-balancing loss (output_router_logits=True) or routing statistics. It reads the
        # router's output only, which the expert rewrite keeps, so it is neither a MoE site nor a reason to leave
        # the layer's site alone.
        return none
    if context.numbered and node_layer_prefix(router.linear) is None:
        return none
    layer = -1
    nodes = (router.linear.name, topk.name)
    where = f"router {router.linear.name} -> top-k {topk.name} (E={num_experts}, A={k})"
    out: list[UnsupportedSite] = []
    if any(u.op == "output" for u in _through_views(indices)):
        out.append(UnsupportedSite(
            "eager_loop_graph_break", layer,
            f"{where}: the expert indices leave the graph and no experts are in it (a graph break before the "
            "experts, e.g. HF experts_implementation=\"eager\", whose loop over hit experts calls nonzero).",
            _GRAPH_BREAK_FIX, nodes))
    elif any(op_name(u) in _SCATTERS for u in _through_views(indices)):
        out.append(UnsupportedSite(
            "unknown_experts_form", layer,
            f"{where}: the top-k scores are scattered back over all {num_experts} experts and no expert GEMM is "
            "gathered by the expert indices (dense experts: every expert computes every token, scaled by its "
            "score, e.g. Llama-4).", "none: the layer runs as the model computes it (dense experts are NYI).", nodes))
    else:
        out.append(UnsupportedSite(
            "unknown_experts_form", layer,
            f"{where}: the expert indices are used, but by no known expert GEMM form.", _FORM_FIX, nodes))
    if router.other_ops:
        out.append(UnsupportedSite(
            "unsupported_router", layer,
            f"{where}: " + "; ".join(f"{n.name} ({op_name(n)}) between router and top-k: "
                                    f"{_ROUTER_OP_HINTS.get(op_name(n), 'an unknown op')}"
                                    for n in router.other_ops) + ".",
            _ROUTER_FIX, nodes))
    return out, router.linear, module_path(router.linear)


#: In-place and out-of-place scatters (scores written back over all E experts: Llama-4's dense experts).
_SCATTERS = ("scatter", "scatter_")


def _has_scoring_after(topk: fx.Node) -> bool:
    """True when the top-k values are scored after the selection: ``softmax`` / ``sigmoid`` of them, or of them
    scattered back over all E experts (Llama-4: ``full_like(logits, -inf).scatter_(1, ids, values).sigmoid()``)."""
    values = _topk_values(topk)
    if values is None:
        return False
    for u in _through_views(values):
        if op_name(u) in _SCORING:
            return True
        if op_name(u) in _SCATTERS and any(op_name(v) in _SCORING for v in _through_views(u)):
            return True
    return False


# ----------------------------------------------------------------------------------------------------------------
# Small helpers


def _hidden_dim(router: fx.Node) -> int:
    """Dm from the router weight (E, Dm), else from its input (T, Dm); 0 when unknown."""
    for a in (arg(router, 1, "weight"), router.args[0] if router.args else None):
        shape = shape_of(a)
        if shape:
            return max(shape[-1], 0)
    return 0


def _ffn_dim(down_weight: fx.Node, hidden: int) -> int:
    """I from the down projection's weight: of its last two dims {Dm, I}, the one that is not Dm."""
    shape = shape_of(down_weight)
    if not shape or len(shape) < 2 or hidden <= 0:
        return 0
    a, b = shape[-2:]
    if a == hidden:
        return max(b, 0)
    return max(a, 0) if b == hidden else 0


def _source(weight: fx.Node) -> str:
    """The Dynamo source of a weight placeholder, else the node name."""
    return placeholder_source(weight) or weight.name


def _position(node: fx.Node) -> int:
    for i, n in enumerate(node.graph.nodes):
        if n is node:
            return i
    return -1


def _common_path(*nodes: fx.Node) -> str:
    """The longest common module path of ``nodes`` (``model.layers.0.mlp`` for its gate and experts)."""
    paths = [p.split(".") for p in (module_path(n) for n in nodes) if p]
    if not paths:
        return ""
    common = paths[0]
    for p in paths[1:]:
        i = 0
        while i < min(len(common), len(p)) and common[i] == p[i]:
            i += 1
        common = common[:i]
    return ".".join(common)
