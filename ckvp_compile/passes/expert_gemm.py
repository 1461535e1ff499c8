"""Rewrite each MoE layer's routed experts, and its shared expert, into ``ckvp::moe_experts`` calls (grouped
expert GEMMs).

Runs on the Dynamo graph (stage 'torch'), where the analysis found the :class:`~ckvp_compile.analysis.sites.
MoESite` and named its nodes; every experts form the analysis reports is handled the same way, because only
the ends of the experts computation are read, never its middle::

    before (any form: HF grouped_mm / grouped_mm_fallback / batched_mm / eager loop, gpt-fast einsum)
        x           = <router input>                        (T, Dm)
        vals, ids   = topk(scores(router(x)), A)             (T, A)
        w           = <routing weights as the model uses them>    (T, A)   e.g. vals / vals.sum(-1)
        routed      = sum_a w * down(silu(gate(x)) * up(x))  (T, Dm)   sort / gather / bmm / einsum / loop ...
        shared      = [sigmoid(x @ Ws^T) *] (silu(x @ Wg^T) * (x @ Wu^T)) @ Wd^T     (T, Dm)   when present
        out         = routed [+ shared]
    after
        routed      = ckvp.moe_experts(x, ids, w, W_gate, W_up, W_down)   (lowered by lowering/moe.py)
        shared      = ckvp.moe_experts(x, zeros_like(g, int32), g, Wg[None], Wu[None], Wd[None])   one expert (E=1)
                      with g = sigmoid(x @ Ws^T) (T, 1), or ones (T, 1) when ungated
        out         = routed [+ shared]                      (the router and scoring untouched)

``w`` is the tensor the model multiplies its expert outputs by, traced back from the combine to its (T, A)
form, so softmax placement, renormalisation and dtype casts are exactly the model's. W_gate / W_up / W_down
are the stacked weight placeholders the site names, given to the op as views (HF's fused ``gate_up_proj``
(E, 2I, Dm) as ``narrow`` halves, gate first or second as the graph's ``chunk`` says). The old experts
computation is then dead and removed (including in-place accumulations into a buffer nothing else reads).

The shared expert (Qwen2-MoE's sigmoid-gated ``shared_expert``, a block Qwen3-Next repeats; ungated: HunYuan-MoE's
``shared_mlp``, the DeepSeek-V3 form) is the same op with one expert: every token's id is 0 and its weight the gate
``sigmoid(linear(x))`` (T, 1) the model computes (kept in the graph), or ones; its (I, Dm) / (Dm, I) weights are
``unsqueeze(0)`` views, so the grouped-GEMM kernels, templates and lowering serve it unchanged. An input with
leading dims (B, S, Dm) is flattened to (T, Dm) and the result viewed back. Its linears, silu and products are
removed. It is rewritten only together with its site's routed experts, and only when exactly this form is found:
bias-free ``F.linear`` projections on 2-D parameters ((I, Dm) gate and up reading one tensor, (Dm, I) down), the
down projection reading ``silu(gate) * up`` directly, the gate a (1, Dm) linear of the same input whose sigmoid
multiplies the down output directly, no dtype change or broadcast, and no other reader of its intermediates.
Otherwise it is left as the model computes it, with an :class:`~ckvp_compile.errors.UnsupportedPatternWarning`
and the reason in the pass's ``notes`` (:class:`~ckvp_compile.passes.base.PassResult`, shown by ckvp-inspect).

A site is left untouched, with an :class:`~ckvp_compile.errors.UnsupportedPatternWarning` giving the reason,
when any of these is not found exactly: the weights' roles and layouts ((E, I, Dm) gate / up or (E, 2I, Dm)
fused, (E, Dm, I) down), a ``silu(gate) * up`` activation (no other activation, no biases), the routing-weight
tensor, the routed output, or experts fed by the router's input. :func:`_check_body` then proves the body is
exactly that: the down GEMM reads ``mul(silu(gate GEMM), up GEMM)`` of one expert and nothing else, the up GEMMs
read the router's input through views and token gathers only, weights are gathered with the top-k's own ids
(through views and no-op clamps), and each GEMM contracts its stored weight's last dimension (which shapes alone
cannot tell when I == Dm). Views count as no-ops on the data path only when they keep every token's feature row
(:func:`_keeps_rows`: ``x.view(T, 2, Dm // 2).transpose(1, 2).reshape(T, Dm)`` is a feature permutation).
:func:`_check_row_order` proves each expert row pairs one (token, slot)'s token, expert and weight and is summed
back into that token: for the sorted (grouped) forms, the token gather ``x[P // A]``, the weight gather ``w[P]``, the
offsets (counts of the sorted ids) and the un-sort (``P``'s inverse) all use one ascending sort ``P`` of the ids; for the
(token, slot) grid forms (einsums, matmuls with ``W[ids]``), :func:`_check_grid_dims` follows which dim of each tensor
is the token and which the slot through every equation, broadcast and sum (shapes alone cannot tell them when
T == A: ``einsum('tai,at->ti')``, ``.sum(0)``); for eager loops, :func:`_check_loop_rows` proves each expert e
gathers its tokens, its routing weights ``w[token, slot]`` and accumulates at the coordinates of one
``where(ids == e)`` (token coordinate first), and that the loop visits every expert once. Where the expert outputs are accumulated (an eager loop's ``acc.index_add_`` per
expert, or a chain of ``acc = acc.index_add(...)``), :func:`_check_accumulation` proves the accumulator is a fresh
zero tensor that receives each weighted expert output once, by a plain sum at its tokens, and nothing else before
the last one (the op's output replaces it).

Prior art: vLLM ``FusedMoE`` (one op for the experts of a layer); the pattern-docstring form of vLLM's compilation
passes. Shared-expert fusion in SGLang (sgl-project/sglang PR 4918, after vllm-project/vllm PR 15502) appends the
shared expert to the routed ones as expert E (top-(A+1), weight 1); here it is a second call with E = 1 instead,
because appending to the model's stacked expert parameters would copy them.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..analysis import moe as moe_analysis
from ..analysis.graph import (ancestors, arg, dtype_of, find_upstream, node_map, op_name, shape_of, strip_views,
                              tensor_args)
from ..analysis.sites import MoESite
from ..errors import UnsupportedPatternWarning
from .base import CKVPPass

logger = logging.getLogger(__name__)

__all__ = ["ExpertGemmPass", "SkippedSite"]

_VIEWS = moe_analysis._PASS  # view / dtype ops the analysis walks through on routing paths
_ACTIVATIONS = {"silu", "gelu", "relu", "sigmoid", "tanh", "gelu_tanh", "softplus"}
_INPLACE = {"index_add_", "scatter_add_", "index_put_", "add_", "copy_", "masked_fill_", "zero_", "fill_",
            "setitem", "iadd", "itruediv", "imul", "div_", "mul_"}


#: How a note of :class:`ExpertGemmPass` starts when the whole site was left as the model computes it (its other
#: notes speak of a rewritten site's shared expert): reports reconcile the plan's "rewrite" with it.
SKIPPED_SITE_NOTE = "experts left as the model computes them (not rewritten)"

#: Shape guards Dynamo emits for data-dependent sizes; dead with the tensor they check.
_GUARDS = {"getitem", "sym_size", "ge", "le", "gt", "lt", "eq", "and_", "_assert_scalar", "_check_is_size",
           "sym_constrain_range", "sym_constrain_range_for_size", "_check"}


@dataclass(frozen=True)
class SkippedSite:
    """A MoE site the pass left untouched. layer: its layer; reason: one sentence naming what was missing."""

    layer: int
    reason: str


class _Skip(Exception):
    pass


@dataclass
class _Rewrite:
    x: fx.Node
    ids: fx.Node
    weights: fx.Node
    gate: tuple[fx.Node, int | None]  # (weight placeholder, which half of a fused gate_up or None)
    up: tuple[fx.Node, int | None]
    down: fx.Node
    routed: fx.Node
    ffn: int


class ExpertGemmPass(CKVPPass):
    """Replace the routed experts of each given :class:`MoESite` with ``torch.ops.ckvp.moe_experts``.

    Args:
        sites: the MoE sites the plan decided to rewrite (from the analysis of the graph this pass runs on).
    Attributes:
        skipped: the sites left untouched by the last :meth:`apply`, with reasons (also warned).
        notes: layer -> what the last :meth:`apply` left as the model computes it there and why: the whole site
            (the reason in ``skipped``) or, for a rewritten site, its shared expert (also warned;
            :class:`~ckvp_compile.passes.base.PassResult` ``notes``, printed by ckvp-inspect).
    """

    name = "expert_gemm"
    stage = "torch"

    def __init__(self, sites: tuple[MoESite, ...] | list[MoESite]) -> None:
        self.sites = tuple(sites)
        self.skipped: list[SkippedSite] = []
        self.notes: dict[int, str] = {}

    def is_applicable(self, graph: fx.Graph) -> str:
        """'' when there are sites to rewrite, else the reason."""
        return "" if self.sites else "no MoE site planned for the expert GEMM rewrite"

    def apply(self, graph: fx.Graph) -> int:
        """Rewrite every site it fully understands; return how many were rewritten."""
        from ..ops import register_all

        register_all()
        self.skipped = []
        self.notes = {}
        count = 0
        for site in self.sites:
            try:
                rw = _understand(graph, site)
            except _Skip as why:
                self.skipped.append(SkippedSite(site.layer, str(why)))
                # also a note, so the PassResult (ckvp-inspect's "passes:" section) says why this planned site kept
                # the model's own experts; the warning alone leaves the report claiming nothing about it
                self.notes[site.layer] = f"{SKIPPED_SITE_NOTE}: {why}"
                warnings.warn(f"ckvp: layer {site.layer}: the expert GEMM rewrite does not apply: {why}. Left "
                              "untouched (the model's own experts run). Fix: report the model with the output of "
                              "ckvp-inspect.", UnsupportedPatternWarning, stacklevel=2)
                continue
            shared = None
            if site.shared_expert is not None:
                try:
                    shared = _understand_shared(graph, site)
                except _Skip as why:
                    self.notes[site.layer] = f"shared expert left as the model computes it: {why}"
                    warnings.warn(f"ckvp: layer {site.layer}: the shared expert is left as the model computes it: "
                                  f"{why}. The routed experts are rewritten. Fix: report the model with the output "
                                  "of ckvp-inspect.", UnsupportedPatternWarning, stacklevel=2)
            _rewrite(graph, rw, site)
            if shared is not None:
                _rewrite_shared(graph, shared, site)
            count += 1
        return count


# ------------------------------------------------------------------------------------------------ reading a site


def _understand(graph: fx.Graph, site: MoESite) -> _Rewrite:
    """Find what the op needs for ``site`` or raise _Skip with the reason."""
    nodes = node_map(graph)
    missing = [n for n in (site.topk_node, site.router_node, *site.expert_nodes) if n not in nodes]
    if missing:
        raise _Skip(f"nodes {missing} of the site are no longer in the graph")
    topk, router = nodes[site.topk_node], nodes[site.router_node]
    gemms = [moe_analysis._classify_expert_gemm(nodes[n]) for n in site.expert_nodes]
    if any(g is None for g in gemms):
        raise _Skip("an expert GEMM of the site is not recognised any more")
    ids = moe_analysis._topk_indices(topk)
    if ids is None:
        raise _Skip("the top-k's indices are not used")
    x = router.args[0] if router.args and isinstance(router.args[0], fx.Node) else None
    t_shape = shape_of(ids)
    if x is None or shape_of(x) is None or len(shape_of(x)) != 2 or t_shape is None or len(t_shape) != 2:
        raise _Skip(f"the router input is not a (T, Dm) tensor (shape {shape_of(x) if x is not None else None}) "
                    f"or the top-k indices are not (T, A) (shape {t_shape})")
    t, dm = shape_of(x)
    if t_shape[0] != t or dm != site.hidden_dim:
        raise _Skip(f"router input (T, Dm) = {(t, dm)} does not match the top-k's T = {t_shape[0]} / Dm = "
                    f"{site.hidden_dim}")
    x_root = _row_root(x)
    for g in gemms:
        if x_root not in ancestors(g.node, max_depth=24) and not _is_down(g, gemms):
            raise _Skip(f"expert GEMM {g.node.name} is not fed by the router's input {x.name}")

    downs = [g for g in gemms if _is_down(g, gemms)]
    ups = [g for g in gemms if not _is_down(g, gemms)]
    down_w = {g.weight for g in downs}
    if len(down_w) > 1 and all(len(_shape(w) or ()) == 2 for w in down_w):
        raise _Skip(f"the experts keep {len(down_w)} separate 2-D down weights (an nn.ModuleList of experts, "
                    "transformers 4.x style); the fused op reads stacked (E, ...) weights and stacking them on every "
                    "call would copy all expert weights: NYI (transformers 5 stores them stacked)")
    if len(down_w) != 1:
        raise _Skip(f"expected one stacked down weight, found {len(down_w)}")
    down = down_w.pop()
    i = site.ffn_dim
    e = site.num_experts
    if _shape(down) != (e, dm, i):
        raise _Skip(_weight_shape_reason(f"down weight {down.name}", _shape(down), (e, dm, i), "(E, Dm, I)"))
    gate, up = _gate_up_roles(ups, e, dm, i)
    x = _experts_input(x, down)
    combine = [c for c in (moe_analysis._find_combine(g.node) for g in downs) if c is not None]
    if not combine:
        raise _Skip("the combine (expert outputs times routing weights) was not found")
    for g in ups:
        for d in downs:
            extra = _ops_between(g.node, d.node) - {"chunk", "split", "silu", "mul"} if \
                d.node in _descendants(g.node, 12) else set()
            if extra:
                raise _Skip(f"{', '.join(sorted(extra))} between the expert GEMMs {g.node.name} and {d.node.name} "
                            "(an expert bias, another activation, a feature gather or a mask: NYI in the fused op; only "
                            "silu(gate) * up)")
    for g in downs:
        extra = _ops_between(g.node, combine[0][0])
        if extra:
            raise _Skip(f"{', '.join(sorted(extra))} between the down GEMM {g.node.name} and the combine (an expert "
                        "bias, output norm, feature gather or mask: NYI in the fused op)")
    _check_body(gemms, ups, downs, gate, up, x_root, ids, e, i == dm or 2 * i == dm)
    if len(combine) != len(downs):
        raise _Skip(f"{len(downs) - len(combine)} of the {len(downs)} down GEMMs are not multiplied by routing weights")
    weights = _routing_weights(combine[0][1], topk, t, t_shape[1])
    for c, operand in combine[1:]:
        if _routing_weights(operand, topk, t, t_shape[1]) is not weights:
            raise _Skip(f"the combine {c.name} multiplies by other routing weights than {combine[0][0].name} "
                        f"({operand.name}, not from {weights.name})")
    routed = moe_analysis._routed_output(combine[0][0])
    _check_accumulation(routed, [c for c, _ in combine], ups)
    _check_row_order(site.experts_form, ups, downs, combine[0], weights, routed, ids, x_root, t, t_shape[1], e)
    r_shape = shape_of(routed)
    if r_shape is None or int(torch.Size(r_shape).numel()) != t * dm:
        raise _Skip(f"the routed output {routed.name} has shape {r_shape}, expected T*Dm = {t * dm} elements")
    if r_shape != _shape(x) and _symbolic(routed):
        raise _Skip(f"the routed output {routed.name} has another shape than the router input and dynamic sizes "
                    "(a symbolic reshape is NYI); compile with dynamic=False")
    rw = _Rewrite(x, ids, weights, gate, up, down, routed, i)
    _check_op_inputs(rw)
    return rw


def _experts_input(x: fx.Node, down: fx.Node) -> fx.Node:
    """The op's ``hidden``: the router's input ``x``, or the tensor it was cast from, whichever has the expert
    weights' dtype and ``x``'s shape (a router computed in fp32 on a bf16 model reads ``x.float()``, its experts
    read ``x``). Raise _Skip when neither has it."""
    want, n = _dtype(down), x
    for _ in range(8):
        if _dtype(n) == want and _same_shape(n, x):
            return n
        if op_name(n) not in _VIEWS or not n.args or not isinstance(n.args[0], fx.Node) or not _keeps_rows(n):
            break
        n = n.args[0]
    raise _Skip(f"the router's input {x.name} is {_dtype(x)} and was not cast from a tensor of the expert weights' "
                f"dtype {want} (experts computed in another dtype than their weights are NYI)")


def _check_op_inputs(rw: _Rewrite) -> None:
    """Raise _Skip when the op would refuse its inputs (:func:`~ckvp_compile.ops.moe.check_moe_experts` on the
    recorded fake values): a rewrite must not turn a model that runs into one that fails to compile."""
    from ..errors import CKVPShapeError
    from ..ops.moe import check_moe_experts

    def value(spec):
        w, half = spec if isinstance(spec, tuple) else (spec, None)
        v = w.meta.get("example_value")
        return v if half is None or v is None else v.narrow(1, half * rw.ffn, rw.ffn)

    args = [value(n) for n in (rw.x, rw.ids, rw.weights, rw.gate, rw.up, rw.down)]
    if not all(isinstance(a, torch.Tensor) for a in args):
        return  # no recorded values to check (AOT tracing checks again)
    try:
        check_moe_experts(*args)
    except CKVPShapeError as exc:
        raise _Skip(str(exc)) from None


# ------------------------------------------------------------------------------------------------ the exact body
# The op computes down(silu(x W_gate^T) * (x W_up^T)) per routed (token, expert) with the top-k's own ids. The checks
# below prove the graph computes that and nothing else: each factor's producer, the experts' input, the gather
# indices and the contracted weight dimension (the shape checks above cannot tell a transposed layout when I == Dm).

#: Ops a value passes through unchanged in the expert body: views, dtype casts, token gathers / permutations, the
#: halves of a chunk / split, and transformers 5.17's zero ``masked_fill`` of expert-parallel sentinel rows. The
#: gathers and the mask only under the conditions of :func:`_keeps_values`.
_SAME_VALUES = _VIEWS | {"getitem", "chunk", "split", "index", "index_select", "masked_fill", "repeat_interleave"}


def _keeps_values(n: fx.Node) -> bool:
    """For a gather or mask of :data:`_SAME_VALUES`: True when it only selects or repeats whole rows (tokens,
    pairs) and leaves every row's features as they are; a ``masked_fill`` only when it fills 0 under a mask that is
    all False (:func:`_is_sentinel_mask`). A feature permutation (``up[..., perm]``) or a padding mask
    (``out.masked_fill(~keep[:, None], 0)``) changes values the op would not. Other ops: True."""
    name = op_name(n)
    if name in _VIEWS:
        return _keeps_rows(n)
    if name == "masked_fill":
        mask = n.args[1] if len(n.args) > 1 else n.kwargs.get("mask")
        return _fills_zero(n) and _is_sentinel_mask(mask)
    if name not in ("getitem", "index", "index_select", "repeat_interleave") or not n.args \
            or not isinstance(n.args[0], fx.Node):
        return True
    base = n.args[0]
    if name == "getitem" and op_name(base) in ("chunk", "split", "unbind", "split_with_sizes", "tensor_split"):
        return True  # a piece of a tuple (which half of a chunk is checked by the roles)
    nd = len(_shape(base) or ())
    if not nd:
        return False
    if name in ("index_select", "repeat_interleave"):
        dim = arg(n, 1 if name == "index_select" else 2, "dim")
        return isinstance(dim, int) and dim % nd != nd - 1
    index = n.args[1] if len(n.args) > 1 else n.kwargs.get("indices")
    items = list(index) if isinstance(index, (tuple, list)) else [index]
    if name == "index":  # aten.index: a list with None for a full slice, one entry per leading dim
        items = [slice(None) if i is None else i for i in items]
    return nd - 1 not in _indexed_dims(items, nd)


def _indexed_dims(items: list, nd: int) -> set[int]:
    """The dims of an ``nd``-dim tensor that a basic / advanced index (``x[items]``) selects in (anything but a full
    slice or None), Ellipsis expanded; a bool mask selects in as many dims as it has."""
    def width(i) -> int:
        if i is None or i is Ellipsis:
            return 0
        if isinstance(i, fx.Node) and dtype_of(i) == torch.bool:
            return len(shape_of(i) or (1,))
        return 1

    if Ellipsis in items:
        k = items.index(Ellipsis)
        head, tail = items[:k], items[k + 1:]
    else:
        head, tail = items, []
    out, dim = set(), 0
    for i in head:
        if not (i is None or i == slice(None)):
            out.update(range(dim, dim + width(i)))
        dim += width(i)
    dim = nd
    for i in reversed(tail):
        dim -= width(i)
        if not (i is None or i == slice(None)):
            out.update(range(dim, dim + width(i)))
    return out


def _is_sentinel_mask(mask: object) -> bool:
    """True for ``ids >= c`` (``ids > c - 1``) with ``ids`` a top-k's expert indices (through views, sorts and
    clamps that keep them in [0, E)) and c >= E: all False (transformers' expert-parallel sentinel mask)."""
    m = _unsqueezed(mask) if isinstance(mask, fx.Node) else None
    if m is None or op_name(m) not in ("ge", "gt") or len(m.args) < 2 or not isinstance(m.args[1], int) \
            or isinstance(m.args[1], bool):
        return False
    bound = m.args[1] if op_name(m) == "ge" else m.args[1] + 1
    n = m.args[0]
    for _ in range(16):
        if not isinstance(n, fx.Node) or not n.args:
            return False
        name = op_name(n)
        if name == "getitem" and op_name(n.args[0]) == "topk":
            num_experts = (shape_of(n.args[0].args[0]) or (None,))[-1] if n.args[1] == 1 else None
            return isinstance(num_experts, int) and bound >= num_experts
        if name in ("clamp", "clip", "clamp_", "clip_"):
            lo = arg(n, 1, "min")
            if not (lo is None or (isinstance(lo, int) and lo <= 0)):
                return False
        elif name == "getitem" and op_name(n.args[0]) == "sort":
            if n.args[1] != 0:
                return False
        elif name not in _VIEWS and name != "sort":
            return False
        n = n.args[0]
    return False


def _producer(node: object, stop: set[fx.Node] = frozenset()) -> fx.Node | None:
    """The first node at or above ``node`` (following each op's data input, ``args[0]``) that is not a value-
    preserving op of :data:`_SAME_VALUES`, or is in ``stop``."""
    n = node
    for _ in range(24):
        if not isinstance(n, fx.Node):
            return None
        name = op_name(n)
        if n in stop or name not in _SAME_VALUES or not n.args or not isinstance(n.args[0], fx.Node):
            return n
        if not _keeps_values(n):
            return n
        n = n.args[0]
    return None


def _half(node: object) -> int | None:
    """Which chunk ``node`` takes (``getitem(chunk(.., 2), k)`` through value-preserving ops), or None."""
    n = node
    for _ in range(24):
        if not isinstance(n, fx.Node) or op_name(n) not in _SAME_VALUES or not n.args:
            return None
        if op_name(n) == "getitem" and isinstance(n.args[0], fx.Node) and op_name(n.args[0]) in ("chunk", "split") \
                and isinstance(n.args[1], int):
            return n.args[1]
        n = n.args[0]
    return None


def _data_operand(g) -> fx.Node | None:
    """The activation operand of expert GEMM ``g`` (not its weight, not grouped_mm's offsets), or None."""
    name = op_name(g.node)
    if name in moe_analysis._GROUPED or name == "linear":
        a = arg(g.node, 0, "mat_a" if name == "grouped_mm" else "input")
        return a if isinstance(a, fx.Node) else None
    data = [a for a in tensor_args(g.node) if _weight_path(a, g.weight) is None]
    return data[0] if len(data) == 1 else None


def _weight_path(node: object, weight: fx.Node) -> list[fx.Node] | None:
    """The nodes from ``weight`` to ``node`` (weight first) when ``node`` is the weight through views, selections
    and gathers, else None."""
    path, n = [], node
    for _ in range(24):
        if not isinstance(n, fx.Node):
            return None
        path.append(n)
        if n is weight:
            return path[::-1]
        if op_name(n) == "embedding" and len(n.args) > 1:  # F.embedding(idx, W)
            n = n.args[1]
        elif op_name(n) in _VIEWS | {"getitem", "index", "index_select", "select", "t", "mT", "swapaxes"} and n.args:
            n = n.args[0]
        else:
            return None
    return None


def _check_body(gemms, ups, downs, gate, up, x_root: fx.Node, ids: fx.Node, e: int, ambiguous: bool) -> None:
    """Raise _Skip unless the experts compute exactly ``down(silu(gate(x)) * up(x))`` with the top-k's ids.

    ``ambiguous``: the weights' shapes cannot tell their layout (I == Dm, or 2I == Dm for a fused gate_up), so an
    unknown contraction is refused too.
    """
    up_gemms = {g.node: g for g in ups}
    for g in ups:
        src = _producer(_data_operand(g))
        if src is None or _row_root(src) is not x_root:
            raise _Skip(f"expert GEMM {g.node.name} reads {src.name if src is not None else 'an unknown input'}, not the "
                        f"router's input {x_root.name} (through views and token gathers only)")
    for g in gemms:
        _check_ids(g, ids, e)
        _check_contraction(g, ambiguous)
    for d in downs:
        m = _producer(_data_operand(d))
        if m is None or op_name(m) != "mul" or len(m.args) != 2 or m.kwargs or \
                not all(isinstance(a, fx.Node) for a in m.args):
            raise _Skip(f"the down GEMM {d.node.name} does not read a product of two tensors (silu(gate) * up); "
                        f"found {m.name if m is not None else 'an unknown input'}")
        a, b = (_producer(x) for x in m.args)
        silus = [x for x in (a, b) if x is not None and op_name(x) == "silu"]
        if len(silus) != 1:
            raise _Skip(f"{m.name} multiplies {len(silus)} silu outputs; only silu(gate) * up is fused")
        s = silus[0]
        other = b if s is a else a
        if other not in up_gemms:
            raise _Skip(f"{m.name}'s factor beside the silu is {other.name if other is not None else 'unknown'}, not an "
                        "up GEMM's output (another factor or op in the expert body is NYI)")
        if len(s.args) != 1 or s.kwargs.get("inplace"):
            raise _Skip(f"{s.name}: a silu with extra arguments")
        g_src = _producer(s.args[0])
        if g_src not in up_gemms or up_gemms[g_src].weight is not gate[0] or up_gemms[other].weight is not up[0] \
                or _selected_expert(up_gemms[g_src]) != _selected_expert(up_gemms[other]):
            raise _Skip(f"{m.name} is not silu(gate GEMM) * up GEMM of one expert")
        if gate[1] is not None and (_half(s.args[0]) != gate[1] or _half(m.args[1 if s is a else 0]) != up[1]):
            raise _Skip(f"{m.name} does not take the gate and up halves of the fused gate_up GEMM once each")


#: Accumulations that add a source into their first argument (in place or not): op -> (source position, keyword).
_ACCUMULATIONS = {"index_add_": (3, "source"), "index_add": (3, "source"), "scatter_add_": (3, "src"),
                  "scatter_add": (3, "src"), "index_put_": (2, "values"), "index_put": (2, "values")}
#: Ops that make a fresh tensor of zeros (``full`` ones only with a fill value of 0).
_ZEROS = {"zeros", "zeros_like", "new_zeros"}
_FULLS = {"full": (1, "fill_value"), "full_like": (1, "fill_value"), "new_full": (2, "fill_value")}


def _check_accumulation(routed: fx.Node, combines: list[fx.Node], ups) -> None:
    """Raise _Skip unless ``routed``, when the experts' outputs are accumulated into it (an eager loop's
    ``acc.index_add_(0, token, out * w)`` per expert, or ``acc = acc.index_add(...)``), is exactly the sum of the
    combines: a fresh zero tensor, and one plain accumulation (``index_add`` with alpha 1 over dim 0,
    ``index_put`` with ``accumulate=True``, ``scatter_add`` over dim 0 with a token index broadcast over the
    features) of each combine, at the token indices its expert's input was gathered with; in place, nothing else
    reads or writes the accumulator before the last accumulation. The op's output replaces ``routed``, so an initial
    value, a scale or a write in between would be lost. Forms that sum without accumulating are not checked here.
    """
    inplace = [u for u in routed.users if op_name(u) in _ACCUMULATIONS and op_name(u).endswith("_")
               and u.args and u.args[0] is routed]
    if inplace:
        start, links = routed, inplace
    elif op_name(routed) in _ACCUMULATIONS and not op_name(routed).endswith("_"):
        links, start = [], routed
        while op_name(start) in _ACCUMULATIONS and not op_name(start).endswith("_") and start.args \
                and isinstance(start.args[0], fx.Node):
            links.append(start)
            start = start.args[0]
        links.reverse()
    else:
        return
    if not _is_zeros(start):
        raise _Skip(f"the experts' outputs are accumulated into {start.name} ({op_name(start)}), not a fresh zero "
                    "tensor (its initial value would be lost)")
    token_indices = {_unsqueezed(i) for g in ups for i in _token_indices(_data_operand(g))}
    added = []
    for link in links:
        name = op_name(link)
        pos, key = _ACCUMULATIONS[name]
        source = link.args[pos] if len(link.args) > pos else link.kwargs.get(key)
        src = _row_root(source) if isinstance(source, fx.Node) else None
        if src not in combines:
            raise _Skip(f"{link.name} ({name}) accumulates {getattr(source, 'name', source)}, not an expert output "
                        "times its routing weight")
        if name.startswith("index_put"):
            index = link.args[1] if len(link.args) > 1 else link.kwargs.get("indices")
            index = index[0] if isinstance(index, (tuple, list)) and len(index) == 1 else None
            plain = (link.args[3] if len(link.args) > 3 else link.kwargs.get("accumulate", False)) is True
        else:
            dim = arg(link, 1, "dim")
            index = arg(link, 2, "index")
            plain = dim == 0
            if name.startswith("index_add"):
                alpha = link.args[4] if len(link.args) > 4 else link.kwargs.get("alpha", 1)
                plain = plain and alpha == 1
            elif isinstance(index, fx.Node) and op_name(index) in ("expand", "expand_as"):
                column = index.args[0] if isinstance(index.args[0], fx.Node) else None
                plain = plain and column is not None and (_shape(column) or (0,))[-1] == 1
                index = column
            else:
                plain = False
        if not plain:
            raise _Skip(f"{link.name} ({name}) is not a plain sum over tokens (index_add with alpha 1 over dim 0, "
                        "index_put with accumulate=True, scatter_add over dim 0 with a token index broadcast over "
                        "the features)")
        if not isinstance(index, fx.Node) or _unsqueezed(index) not in token_indices:
            raise _Skip(f"{link.name} ({name}) accumulates at indices {getattr(index, 'name', index)}, not the token "
                        "indices the experts' inputs were gathered with")
        added.append(src)
    if sorted(c.name for c in added) != sorted(c.name for c in combines):
        raise _Skip(f"the accumulations {[n.name for n in links]} do not add each expert output once "
                    f"(they add {[c.name for c in added]}; the expert outputs are {[c.name for c in combines]})")
    if inplace:
        order = {n: k for k, n in enumerate(routed.graph.nodes)}
        last = max(order[n] for n in links)
        early = [u.name for u in routed.users if u not in links and order[u] < last]
        if early:
            raise _Skip(f"{early} read or write the accumulator {routed.name} between its accumulations")


def _unsqueezed(node: fx.Node) -> fx.Node:
    """``node`` through views and ``x[:, None]``-style indexing (full slices, None and Ellipsis only)."""
    for _ in range(16):
        node = strip_views(node, moe_analysis._EXTRA_VIEWS)
        index = node.args[1] if op_name(node) == "getitem" and len(node.args) > 1 else 0
        items = index if isinstance(index, tuple) else (index,)
        if not isinstance(node.args[0] if node.args else None, fx.Node) or not all(
                i is None or i is Ellipsis or i == slice(None) for i in items):
            return node
        node = node.args[0]
    return node


def _is_zeros(node: fx.Node) -> bool:
    """``zeros`` / ``zeros_like`` / ``new_zeros``, or a ``full`` / ``full_like`` / ``new_full`` of 0."""
    name = op_name(node)
    if name in _ZEROS:
        return True
    if name in _FULLS:
        pos, key = _FULLS[name]
        value = node.args[pos] if len(node.args) > pos else node.kwargs.get(key)
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0
    return False


def _token_indices(node: object) -> list[fx.Node]:
    """The index tensors of the token gathers (``x[idx]``, ``index_select(x, 0, idx)``) on the value-preserving
    path from an expert GEMM's input up to its producer."""
    out, n = [], node
    for _ in range(24):
        if not isinstance(n, fx.Node) or op_name(n) not in _SAME_VALUES or not n.args:
            return out
        name = op_name(n)
        if name == "index_select":
            out += moe_analysis._index_nodes(arg(n, 2, "index"))
        elif name in ("getitem", "index") and len(n.args) > 1 and isinstance(n.args[0], fx.Node) \
                and op_name(n.args[0]) not in ("chunk", "split", "unbind"):
            out += moe_analysis._index_nodes(n.args[1])
        n = n.args[0]
    return out


def _selected_expert(g) -> int | None:
    """The constant expert index an eager loop's GEMM selects its weight with (``W[e]``), or None."""
    a = _data_operand(g)
    for w in (tensor_args(g.node)):
        if w is a:
            continue
        n = strip_views(w, moe_analysis._EXTRA_VIEWS)
        if op_name(n) == "getitem" and len(n.args) > 1:
            index = n.args[1]
            lead = index[0] if isinstance(index, tuple) and index else index
            if isinstance(lead, int):
                return lead
        if op_name(n) == "select" and isinstance(arg(n, 2, "index"), int):
            return arg(n, 2, "index")
    return None


def _ids_root(node: fx.Node, e: int) -> fx.Node:
    """``node`` through views and clamps to a range holding every expert id 0..E-1 (no-ops on top-k ids;
    transformers' ``batched_mm`` clamps expert-parallel sentinels that way)."""
    for _ in range(16):
        node = _order_root(node)
        if op_name(node) not in ("clamp", "clip", "clamp_", "clip_") or not node.args:
            return node
        lo, hi = arg(node, 1, "min"), arg(node, 2, "max")
        if not ((lo is None or (isinstance(lo, int) and lo <= 0)) and (hi is None or (isinstance(hi, int) and hi >= e - 1))):
            return node
        node = node.args[0]
    return node


def _check_ids(g, ids: fx.Node, e: int) -> None:
    """Raise _Skip when ``g``'s weight is gathered with indices other than the top-k's own (views and no-op clamps
    allowed)."""
    if op_name(g.node) in moe_analysis._GROUPED:
        b = arg(g.node, 1, "mat_b")
        path = _weight_path(b if b is not None else arg(g.node, 1, "weight"), g.weight)
    else:
        path = next((p for p in (_weight_path(a, g.weight) for a in tensor_args(g.node)) if p is not None), None)
    for n in path or ():
        name = op_name(n)
        index = (n.args[0] if name == "embedding" else arg(n, 2, "index") if name == "index_select"
                 else n.args[1] if name in ("getitem", "index") and len(n.args) > 1 else None)
        nodes = moe_analysis._index_nodes(index)
        if nodes and any(_ids_root(i, e) is not _ids_root(ids, e) for i in nodes):
            raise _Skip(f"the expert weights of {g.node.name} are gathered with {nodes[0].name}, not the top-k's "
                        f"indices {ids.name} (remapped expert ids are NYI)")


def _check_contraction(g, ambiguous: bool) -> None:
    """Raise _Skip unless ``g`` contracts its stored weight's last dimension (the (E, out, in) layout every
    accepted form stores); an unknown contraction is refused only when ``ambiguous``."""
    name = op_name(g.node)
    if name in moe_analysis._GROUPED:
        operand = arg(g.node, 1, "mat_b")
        operand = operand if operand is not None else arg(g.node, 1, "weight")
        want = -2
    elif name == "linear":
        operand, want = arg(g.node, 1, "weight"), -1
    else:
        operands = tensor_args(g.node)
        k = next((j for j, a in enumerate(operands) if _weight_path(a, g.weight) is not None), None)
        operand = operands[k] if k is not None else None
        want = None if name == "einsum" else (-2 if k == 1 else -1)
    path = _weight_path(operand, g.weight) if isinstance(operand, fx.Node) else None
    pos = _last_dim_position(path) if path else None
    why = None
    if pos is None:
        why = "its weight reaches the GEMM through reshapes this check cannot follow"
    elif name == "einsum":
        spec = g.node.args[0] if g.node.args and isinstance(g.node.args[0], str) else None
        letters = _einsum_letters(spec, len(tensor_args(g.node)), k) if spec else None
        if letters is None:
            why = f"einsum {spec!r} is not a plain explicit equation"
        elif not letters[1].get(letters[0][pos], False):
            raise _Skip(f"einsum {spec!r} of {g.node.name} does not contract the last dimension of its stored weight "
                        f"{g.weight.name} (a transposed experts layout is NYI)")
    elif pos != want:
        raise _Skip(f"{g.node.name} contracts dimension {want} of its weight operand, which holds dimension {pos} of "
                    f"the stored weight {g.weight.name}, not the last (a transposed experts layout is NYI)")
    if why is not None and ambiguous:
        raise _Skip(f"cannot tell the weight layout of {g.node.name} from shapes (I == Dm): {why}")


def _last_dim_position(path: list[fx.Node]) -> int | None:
    """Where (a negative index) the stored weight's last dimension sits after ``path`` (weight first), or None."""
    shape = _shape(path[0])
    if not shape:
        return None
    pos = -1
    for prev, n in zip(path, path[1:]):
        name, nd = op_name(n), len(_shape(n) or ())
        before = _shape(prev)
        if name in ("transpose", "swapaxes"):
            a, b = (arg(n, 1, "dim0"), arg(n, 2, "dim1"))
            nd_prev = len(before or ())
            if not isinstance(a, int) or not isinstance(b, int) or not nd_prev:
                return None
            a, b = a % nd_prev - nd_prev, b % nd_prev - nd_prev
            pos = b if pos == a else a if pos == b else pos
        elif name in ("t", "mT"):
            pos = -2 if pos == -1 else -1 if pos == -2 else pos
        elif name == "permute":
            dims = n.args[1:] if len(n.args) > 2 else n.args[1] if len(n.args) > 1 else None
            nd_prev = len(before or ())
            if not isinstance(dims, (list, tuple)) or len(dims) != nd_prev:
                return None
            src = [d % nd_prev - nd_prev for d in dims]
            if pos not in src:
                return None
            pos = src.index(pos) - nd_prev
        elif name in ("getitem", "index", "index_select", "select", "embedding") or name in _DTYPE_KEEPING:
            pass  # gathers and selections act on the leading (expert) dimension; casts keep every dimension
        else:  # a view: safe only while it keeps the trailing dimensions as they were
            after = _shape(n)
            if before is None or after is None or before[pos:] != after[pos:] or len(after) < -pos:
                return None
        if not nd:
            return None
    return pos


_DTYPE_KEEPING = frozenset({"to", "float", "half", "bfloat16", "type_as", "contiguous", "clone", "_to_copy", "alias",
                            "detach", "type", "double"})


def _einsum_letters(spec: str, n_operands: int, k: int) -> tuple[str, dict[str, bool]] | None:
    """For an explicit ``einsum`` equation: the weight operand's (``k``) subscript letters and, per letter, whether
    the equation contracts it (absent from the output, present in another operand); None otherwise."""
    spec = spec.replace(" ", "")
    if "->" not in spec or "." in spec:
        return None
    lhs, out = spec.split("->")
    terms = lhs.split(",")
    if len(terms) != n_operands or not 0 <= k < len(terms):
        return None
    others = "".join(t for j, t in enumerate(terms) if j != k)
    return terms[k], {c: c not in out and c in others for c in terms[k]}


def _path_between(start: fx.Node, end: fx.Node) -> set[fx.Node]:
    """``start`` and the nodes on the paths from it forward to ``end`` (not ``end``), within 12 hops."""
    return {start} | {n for n in _descendants(start, 12) if n is not end and end in _descendants(n, 12)}


def _ops_between(start: fx.Node, end: fx.Node) -> set[str]:
    """Names of the compute ops (not views, gathers or masks) on the paths from ``start`` forward to ``end``, and of
    in-place ops that modify a tensor on those paths (``out.add_(bias)`` is not on the data path, but changes it)."""
    allowed = _VIEWS | {"getitem", "masked_fill", "index", "index_select"}
    path = _path_between(start, end)
    found = {op_name(n) for n in path if n is not start and (op_name(n) not in allowed or not _keeps_values(n))}
    for n in path:
        for u in n.users:
            name = op_name(u)
            if u.args and u.args[0] is n and (name in _INPLACE or (name.endswith("_") and not name.startswith("_"))):
                found.add(name)
    return found


def _descendants(node: fx.Node, depth: int) -> set[fx.Node]:
    out, frontier = set(), [node]
    for _ in range(depth):
        frontier = [u for n in frontier for u in n.users if u not in out]
        out.update(frontier)
    return out


def _symbolic(node: fx.Node) -> bool:
    """True when the node's recorded shape has a symbolic (dynamic) size."""
    val = node.meta.get("example_value")
    return isinstance(val, torch.Tensor) and any(not isinstance(d, int) for d in val.shape)


def _is_down(g, gemms) -> bool:
    """A down GEMM's output feeds no other expert GEMM (analysis step 3)."""
    return g in moe_analysis._down_gemms(gemms)


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    s = shape_of(node)
    return tuple(s) if s is not None else None


def _weight_shape_reason(what: str, shape: tuple | None, want: tuple[int, int, int], dims: str) -> str:
    """Why a stacked expert weight of ``shape`` is not the ``want`` = (E, ., .) the site's router and GEMMs imply."""
    if shape is not None and len(shape) == 3 and tuple(shape[1:]) == want[1:] and shape[0] < want[0]:
        return (f"the router scores E = {want[0]} experts but {what} stacks {shape[0]}: router outputs without "
                "expert weights (null / zero-computation experts, as in MoE++ or LongCat-Flash) are NYI")
    transposed = shape is not None and sorted(shape) == sorted(want)
    return (f"{what} is {shape}, expected {dims} = {want}"
            + (" (a transposed experts layout is NYI)" if transposed else ""))


def _gate_up_roles(ups, e: int, dm: int, i: int) -> tuple[tuple[fx.Node, int | None], tuple[fx.Node, int | None]]:
    """Return ((gate weight, half), (up weight, half)) from the activation structure ``silu(gate) * up``."""
    weights = list(dict.fromkeys(g.weight for g in ups))
    acts = {}
    for g in ups:
        for act in _activations_after(g.node):
            acts.setdefault(op_name(act), act)
    if set(acts) != {"silu"}:
        raise _Skip(f"activation {sorted(acts) or 'none'} found between the expert GEMMs; only silu(gate) * up "
                    "(SwiGLU) is fused")
    silu = acts["silu"]
    if len(weights) == 1:  # fused gate_up (E, 2I, Dm): which chunk feeds the silu
        w = weights[0]
        if _shape(w) != (e, 2 * i, dm):
            raise _Skip(_weight_shape_reason(f"fused gate/up weight {w.name}", _shape(w), (e, 2 * i, dm),
                                             "(E, 2I, Dm)"))
        src = strip_views(silu.args[0], moe_analysis._EXTRA_VIEWS)
        if not (op_name(src) == "getitem" and isinstance(src.args[0], fx.Node) and op_name(src.args[0]) == "chunk"
                and src.args[1] in (0, 1) and _chunks_in_two_last_dim(src.args[0])):
            raise _Skip("the gate and up halves are not split with chunk(2, dim=-1) (an interleaved or other "
                        "gate/up layout is NYI)")
        half = src.args[1]
        return (w, half), (w, 1 - half)
    if len(weights) == 2:
        gate_w = [w for w in weights if _feeds(w, silu, ups)]
        if len(gate_w) != 1:
            raise _Skip("could not tell the gate weight (the one under the silu) from the up weight")
        up_w = [w for w in weights if w is not gate_w[0]][0]
        for w in (gate_w[0], up_w):
            if _shape(w) != (e, i, dm):
                raise _Skip(_weight_shape_reason(f"gate/up weight {w.name}", _shape(w), (e, i, dm), "(E, I, Dm)"))
        return (gate_w[0], None), (up_w, None)
    raise _Skip(f"expected a fused gate_up weight or separate gate and up weights, found {len(weights)} weights")


def _chunks_in_two_last_dim(chunk: fx.Node) -> bool:
    n = chunk.args[1] if len(chunk.args) > 1 else chunk.kwargs.get("chunks")
    dim = chunk.args[2] if len(chunk.args) > 2 else chunk.kwargs.get("dim", 0)
    nd = len(shape_of(chunk.args[0]) or ())
    return n == 2 and dim in (-1, nd - 1)


def _activations_after(gemm: fx.Node) -> list[fx.Node]:
    """Activation ops within a few hops after an up-stage GEMM (through views, getitem, chunk, and a zero
    ``masked_fill``: transformers 5.17's ``grouped_mm`` experts zero the expert-parallel sentinel rows,
    ``proj_out.masked_fill(expert_ids >= E, 0.0)``, between the up GEMM and the gate; without expert parallelism
    no id reaches E, so the mask is all False, the same no-op :func:`_ops_between` already allows)."""
    out, frontier, seen = [], [gemm], set()
    for _ in range(6):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u in seen:
                    continue
                seen.add(u)
                name = op_name(u)
                if name in _ACTIVATIONS:
                    out.append(u)
                elif name in _VIEWS or name in ("getitem", "chunk", "split") or (
                        name == "masked_fill" and u.args and u.args[0] is n and _fills_zero(u)):
                    nxt.append(u)
        frontier = nxt
    return out


def _fills_zero(node: fx.Node) -> bool:
    """A ``masked_fill(x, mask, 0)`` (the value positional or by keyword)."""
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value")
    return isinstance(value, (int, float)) and value == 0


def _feeds(weight: fx.Node, silu: fx.Node, ups) -> bool:
    return any(g.weight is weight and g.node in ancestors(silu, max_depth=8) for g in ups)


def _routing_weights(operand: fx.Node, topk: fx.Node, t: int, a: int) -> fx.Node:
    """Walk from the combine's weight operand up through views and gathers to the (T, A) routing weights.

    The weights are taken above the last data-dependent gather on the path (``w[perm]`` of the grouped forms,
    ``w[token, slot]`` of an eager loop), where they are still in (token, slot) order: below it they are
    permuted (and at top-1 a permuted (T*A, 1) column has the (T, A) shape too).
    """
    path, n = [], operand
    for _ in range(16):
        path.append(n)
        name = op_name(n)
        if (name in _VIEWS or name in ("getitem", "index", "index_select")) and n.args \
                and isinstance(n.args[0], fx.Node) and n.args[0] is not topk:
            n = n.args[0]
            continue
        break
    for m in path:
        _check_routing_gather(m, topk)
    gathers = [k for k, m in enumerate(path) if _is_gather(m)]
    above = path[gathers[-1] + 1:] if gathers else path
    for m in above:
        if _shape(m) == (t, a):
            return m
    raise _Skip(f"the routing weights multiplied into the expert outputs ({operand.name}) do not come from a "
                f"(T, A) = {(t, a)} tensor through views and gathers")


def _check_routing_gather(n: fx.Node, topk: fx.Node) -> None:
    """Raise _Skip when ``n``, on the path from the routing weights to the combine, indexes them other than by the
    routing itself: every tensor index must be computed from the top-k's indices (``w[perm]`` with ``perm`` from
    sorting them, ``w[token, slot]`` from ``where(one_hot(ids))``), every other index item None or a full slice.
    A fixed permutation (``w[:, perm]``) or a slot selection (``w[:, :1]``) would be undone by taking the weights
    above it."""
    name = op_name(n)
    if name not in ("getitem", "index", "index_select"):
        return
    base = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    if name == "getitem" and base is not None and op_name(base) in _FRESH_TUPLES | {"chunk", "split", "unbind"}:
        return  # an output of a tuple op (the top-k's values), not an index into the weights
    if name == "index_select":
        items = [arg(n, 2, "index")]
    else:
        index = n.args[1] if len(n.args) > 1 else None
        items = list(index) if isinstance(index, (tuple, list)) else [index]
    for i in items:
        if isinstance(i, fx.Node):
            if find_upstream(i, lambda m: m is topk, 12) is None:
                raise _Skip(f"the routing weights are indexed by {i.name} in {n.name}, which is not computed from the "
                            "top-k's indices (a fixed permutation of the weights is NYI)")
        elif not (i is None or i is Ellipsis or i == slice(None)):
            raise _Skip(f"{n.name} indexes the routing weights with {i!r}; only the whole (token, slot) weights, "
                        "gathered by the routing, are fused")


def _is_gather(n: fx.Node) -> bool:
    """True for indexing by a tensor (a data-dependent gather), False for views (ints, slices, None)."""
    name = op_name(n)
    if name in ("index", "index_select"):
        return True
    if name != "getitem" or len(n.args) < 2:
        return False
    index = n.args[1]
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, fx.Node) for i in items)


# ------------------------------------------------------------------------------------------------ layouts and row order
# The op reads each token's feature row as stored, and pairs row (t, a) of the experts with ids[t, a], w[t, a] and
# token t. Views on the experts' data path must therefore keep every feature row intact (a reshape that splits the
# features, then a transpose, is a feature permutation), and every gather of rows (the grouped forms' sort) must be
# undone by the same permutation.

#: Views that reshape (row-major: the flat element order is kept) and views that move dimensions.
_RESHAPES = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as",
                       "reshape_as"})
_DIM_MOVES = frozenset({"transpose", "swapaxes", "swapdims", "permute", "t", "mT"})


def _moved_dims(n: fx.Node, nd: int) -> list[int] | None:
    """For a dim-moving view of an ``nd``-dim tensor: output dim j holds input dim ``result[j]``; None if unknown."""
    name = op_name(n)
    order = list(range(nd))
    if name in ("t", "mT"):
        if nd < 2:
            return order
        order[-2], order[-1] = order[-1], order[-2]
        return order
    if name == "permute":
        dims = list(n.args[1:]) if len(n.args) > 2 else n.args[1] if len(n.args) > 1 else n.kwargs.get("dims")
        if not isinstance(dims, (list, tuple)) or len(dims) != nd or not all(isinstance(d, int) for d in dims):
            return None
        return [d % nd for d in dims]
    a, b = arg(n, 1, "dim0"), arg(n, 2, "dim1")
    if not isinstance(a, int) or not isinstance(b, int) or not nd:
        return None
    a, b = a % nd, b % nd
    order[a], order[b] = order[b], order[a]
    return order


def _keeps_order(n: fx.Node) -> bool:
    """For a view / dtype op (:data:`_VIEWS`): True when it keeps the flat (row-major) order of its input's elements
    without repeating any: dtype casts, reshapes, and dim moves that only move size-1 dims. An ``expand`` (repeats)
    or a transpose of two dims of size > 1 (a reordering) is False; so is an op this check does not know."""
    name = op_name(n)
    if name in _DTYPE_KEEPING:
        return True
    if name in _RESHAPES:
        return True
    if name in _DIM_MOVES and n.args and isinstance(n.args[0], fx.Node):
        dims = _dims(n.args[0])
        moved = _moved_dims(n, len(dims)) if dims is not None else None
        if moved is None:
            return False
        big = [d for d in moved if dims[d] != "1"]
        return big == sorted(big)
    return False


def _last_big_dim(dims: list[str] | None) -> str | None:
    big = [d for d in dims or () if d != "1"]
    return big[-1] if big else "1"


def _keeps_rows(n: fx.Node) -> bool:
    """For a view / dtype op: True when every feature row of its input (the last dim of size > 1) is a feature row of
    its output, unchanged and in the same flat order: :func:`_keeps_order` and, for a reshape, the same last dim
    (size-1 dims ignored: ``x.unsqueeze(-1)`` keeps rows, ``x.view(T, 2, Dm // 2)`` splits them). An ``expand`` keeps
    rows (it repeats whole ones; who reads which row is the row-order check's business)."""
    name = op_name(n)
    if not n.args or not isinstance(n.args[0], fx.Node):
        return False
    if name in _RESHAPES or name in ("expand", "expand_as"):
        before, after = _dims(n.args[0]), _dims(n)
        return before is not None and after is not None and _last_big_dim(before) == _last_big_dim(after)
    return _keeps_order(n)


def _row_root(node: object) -> object:
    """``node`` up through the views and dtype casts that keep its feature rows (:func:`_keeps_rows`)."""
    n = node
    for _ in range(32):
        if not (isinstance(n, fx.Node) and op_name(n) in _VIEWS and n.args and isinstance(n.args[0], fx.Node)
                and _keeps_rows(n)):
            return n
        n = n.args[0]
    return n


def _order_root(node: object) -> object:
    """``node`` up through the views and dtype casts that keep its flat element order (:func:`_keeps_order`)."""
    n = node
    for _ in range(32):
        if not (isinstance(n, fx.Node) and op_name(n) in _VIEWS and n.args and isinstance(n.args[0], fx.Node)
                and _keeps_order(n)):
            return n
        n = n.args[0]
    return n


#: Forms whose expert rows are the flat (token, slot) pairs s = t * A + a, in some order.
_PAIR_FORMS = frozenset({"grouped_mm", "grouped_mm_fallback", "batched_mm"})


@dataclass
class _Perm:
    """The one row permutation P a flat-pairs site may use (``sort(ids.reshape(-1))``'s indices), once found."""

    ids: fx.Node
    node: fx.Node | None = None

    def power(self, index: object) -> int | None:
        """``index`` (a 1-D gather index over the pairs) as P^k: 1 for P, -1 for its inverse; None when unknown."""
        i = _order_root(index)
        if not isinstance(i, fx.Node):
            return None
        if self._is_sort_perm(i):
            return 1
        src = _inverse_of(i)
        if src is not None and self._is_sort_perm(_order_root(src)):
            return -1
        return None

    def _is_sort_perm(self, n: fx.Node) -> bool:
        """``sort(ids_flat)[1]`` / ``argsort(ids_flat)`` (ascending) of the top-k ids, the first one met fixing P."""
        if self.node is not None:
            return n is self.node
        src = None
        if op_name(n) == "getitem" and len(n.args) > 1 and n.args[1] == 1 and op_name(n.args[0]) == "sort":
            src = n.args[0]
        elif op_name(n) == "argsort":
            src = n
        if src is None or not src.args or _descending(src):
            return False
        flat = src.args[0]
        if _order_root(flat) is not _order_root(self.ids) or len(_dims(flat) or ()) != 1:
            return False
        self.node = n
        return True


def _descending(sort: fx.Node) -> bool:
    """True unless the sort / argsort is plainly ascending (``descending`` absent or False)."""
    d = sort.kwargs.get("descending", sort.args[2] if len(sort.args) > 2 and isinstance(sort.args[2], bool) else False)
    return d is not False


def _inverse_of(n: fx.Node) -> fx.Node | None:
    """The permutation Q that ``n`` is the inverse of, or None: ``argsort(Q)`` (ascending), or a fresh buffer ``inv``
    written once, before anything else reads it, by ``inv[Q] = arange(len(Q))`` (HF's un-sort)."""
    name = op_name(n)
    if name == "argsort" and n.args and isinstance(n.args[0], fx.Node) and not _descending(n):
        return n.args[0]
    if name == "getitem" and len(n.args) > 1 and n.args[1] == 1 and op_name(n.args[0]) == "sort" \
            and not _descending(n.args[0]) and isinstance(n.args[0].args[0], fx.Node):
        return n.args[0].args[0]
    if name not in ("empty_like", "zeros_like", "empty", "zeros", "new_empty", "new_zeros"):
        return None
    writes = [u for u in n.users if _writes_in_place(u) or op_name(u) == "setitem"]
    if len(writes) != 1 or op_name(writes[0]) != "setitem" or writes[0].args[0] is not n:
        return None
    w = writes[0]
    q, src = w.args[1], w.args[2]
    if not isinstance(q, fx.Node) or not isinstance(src, fx.Node) or not _is_arange_of(src, q) \
            or not _same_shape(n, q):
        return None
    order = {m: k for k, m in enumerate(n.graph.nodes)}
    if any(order[u] < order[w] for u in n.users if u is not w):
        return None
    return q


def _is_arange_of(n: fx.Node, like: fx.Node) -> bool:
    """``arange(len(like))`` (start 0, step 1) with ``like``'s (1-D) shape."""
    if op_name(n) != "arange" or not _same_shape(n, like) or len(_dims(like) or ()) != 1:
        return False
    pos = [a for a in n.args]
    start = n.kwargs.get("start", pos[0] if len(pos) > 1 else 0)
    step = n.kwargs.get("step", pos[2] if len(pos) > 2 else 1)
    return start == 0 and step == 1


def _row_gather(n: fx.Node) -> fx.Node | None:
    """For a gather of whole rows (``x[idx]``, ``x[idx, :]``, ``index_select(x, 0, idx)``): its index; None for any
    other op. Raise _Skip for a gather of another kind (several tensor indices, another dim)."""
    name = op_name(n)
    if name == "index_select":
        if arg(n, 1, "dim") not in (0,):
            raise _Skip(f"{n.name} gathers along dim {arg(n, 1, 'dim')}, not whole rows")
        i = arg(n, 2, "index")
        return i if isinstance(i, fx.Node) else None
    if name not in ("getitem", "index") or len(n.args) < 2 or not isinstance(n.args[0], fx.Node) \
            or op_name(n.args[0]) in ("chunk", "split", "unbind", "split_with_sizes", "tensor_split"):
        return None
    index = n.args[1]
    items = list(index) if isinstance(index, (tuple, list)) else [index]
    tensors = [i for i in items if isinstance(i, fx.Node)]
    if not tensors:
        return None
    if len(tensors) != 1 or items[0] is not tensors[0] or any(i not in (None, slice(None), Ellipsis) for i in items[1:]) \
            or dtype_of(tensors[0]) == torch.bool:
        raise _Skip(f"{n.name} indexes rows other than by one integer index over dim 0 (a mask, several indices or "
                    "another dim)")
    return tensors[0]


def _value_path(node: object, stop: fx.Node | None = None) -> list[fx.Node]:
    """The nodes from ``node`` up through value-preserving ops (:data:`_SAME_VALUES`, as :func:`_producer` walks),
    ``node`` first, the producer (or ``stop``) last."""
    out, n = [], node
    for _ in range(24):
        if not isinstance(n, fx.Node):
            break
        out.append(n)
        if n is stop or op_name(n) not in _SAME_VALUES or not n.args or not isinstance(n.args[0], fx.Node) \
                or not _keeps_values(n):
            break
        n = n.args[0]
    return out


def _check_body_rows(ups, downs) -> None:
    """Raise _Skip when rows are gathered or repeated inside the expert body (between the up GEMMs and the down GEMM):
    ``silu(gate) * up`` must multiply the rows of one (token, slot) pair."""
    for d in downs:
        m = _producer(_data_operand(d))
        paths = _value_path(_data_operand(d))
        if m is not None and op_name(m) == "mul":
            for f in m.args:
                paths += _value_path(f)
                s = _producer(f)
                if s is not None and op_name(s) == "silu" and s.args:
                    paths += _value_path(s.args[0])
        for n in paths:
            if op_name(n) in ("repeat_interleave", "expand", "expand_as") or _row_gather(n) is not None:
                raise _Skip(f"{n.name} ({op_name(n)}) gathers or repeats rows inside the expert body (between the "
                            "up and down GEMMs); only silu(gate) * up of one (token, slot) row is fused")


def _check_row_order(form: str, ups, downs, combine: tuple[fx.Node, fx.Node], weights: fx.Node, routed: fx.Node,
                     ids: fx.Node, x_root: fx.Node, t: int, a: int, e: int) -> None:
    """Raise _Skip unless each expert row reads the token, expert and routing weight of one (token, slot) pair and its
    output is summed into that token, with the rows in whatever order the model chose.

    Flat-pairs forms (grouped_mm, batched_mm with 1-D gathers): the rows are the pairs s = t * A + a permuted by
    P^k, with P the ascending ``sort`` / ``argsort`` of ``ids.reshape(-1)`` (one node) and its inverse (``argsort(P)``
    or HF's ``inv[P] = arange(S)``). The tokens are gathered as ``x[P^k // A]`` or ``x.repeat_interleave(A, 0)``
    (k = 0); the grouped forms' rows must be in sorted order (k = 1, with offsets the cumulative counts of the ids),
    batched_mm's in pair order (k = 0: its weights are gathered with the ids as they are); the routing weights,
    ``w.reshape(-1)`` gathered by P^j, must meet the expert output in the same order; and the sum over slots,
    ``y.view(T, A, Dm).sum(1)``, must read the pairs in order (the un-sort undoes P). Other forms: no row gather
    on the experts' input, their outputs or the routing weights (the (T, A) grid forms broadcast the token over its
    slots); an eager loop's token gathers are checked with its accumulation (:func:`_check_accumulation`).
    ``combine``: (the combine node, its routing-weight operand); ``weights``: the (T, A) tensor the op will read.
    """
    _check_body_rows(ups, downs)
    if form == "eager_loop":
        _check_loop_rows(ups, downs, weights, ids, e)
        return
    flat = form in _PAIR_FORMS and not any(len(_dims(i) or ()) > 1 for g in ups + downs for i in _weight_indices(g))
    if not flat:
        for g in ups:
            for n in _value_path(_data_operand(g), x_root):
                if op_name(n) in ("repeat_interleave",) or _row_gather(n) is not None:
                    raise _Skip(f"{n.name} gathers or repeats the experts' input rows in a (token, slot) grid form")
        between = {n for d in downs for n in _path_between(d.node, combine[0])}
        n = combine[1]
        for _ in range(16):  # the routing weights: from the combine's operand up to the (T, A) tensor the op reads
            between.add(n)
            if n is weights or not n.args or not isinstance(n.args[0], fx.Node):
                break
            n = n.args[0]
        for n in between:
            if n is not weights and _is_gather(n) and op_name(n.args[0]) not in _FRESH_TUPLES:
                raise _Skip(f"{n.name} gathers rows of the expert outputs or routing weights in a (token, slot) grid "
                            "form (they would meet other (token, slot) rows than the op pairs)")
        _check_grid_dims(routed, x_root, ids, weights, {g.weight for g in ups + downs}, e)
        return
    perm = _Perm(ids)
    states = {_token_order(g, x_root, perm, a) for g in ups}
    if len(states) != 1:
        raise _Skip(f"the up GEMMs read the tokens in different orders ({sorted(states)})")
    k = states.pop()
    grouped = form in ("grouped_mm", "grouped_mm_fallback")
    want = 1 if grouped else 0
    if k != want:
        raise _Skip(f"the experts' input rows are in order P^{k} of the pairs, with P the sort of the expert ids, but "
                    f"the {form} experts take their rows in order P^{want} (a gather and an un-sort by different "
                    "permutations)")
    if grouped:
        for g in ups + downs:
            _check_offsets(g, ids, perm, e)
    got = _output_order(routed, downs, weights, perm, want, a)
    if got != 0:
        raise _Skip(f"the expert outputs reach the sum over slots in order P^{got} of the pairs, not in pair order "
                    "(the un-sort is not the inverse of the permutation the tokens were gathered with)")


def _weight_indices(g) -> list[fx.Node]:
    """The index tensors that gather ``g``'s expert weights (``W[ids]``)."""
    path = next((p for p in (_weight_path(a, g.weight) for a in tensor_args(g.node)) if p is not None), None)
    out = []
    for n in path or ():
        name = op_name(n)
        index = (n.args[0] if name == "embedding" else arg(n, 2, "index") if name == "index_select"
                 else n.args[1] if name in ("getitem", "index") and len(n.args) > 1 else None)
        out += moe_analysis._index_nodes(index)
    return out


def _token_order(g, x_root: fx.Node, perm: _Perm, a: int) -> int:
    """The order P^k of the pairs in which up GEMM ``g`` reads the tokens (see :func:`_check_row_order`)."""
    path = _value_path(_data_operand(g), x_root)
    if not path or path[-1] is not x_root:
        raise _Skip(f"expert GEMM {g.node.name}'s input is not the router's input through views and row gathers")
    state: int | None = None  # None: token rows (T, Dm); k: pair rows in order P^k
    for n in reversed(path[:-1]):
        name = op_name(n)
        if name == "repeat_interleave":
            reps, dim = arg(n, 1, "repeats"), arg(n, 2, "dim")
            if state is not None or reps != a or dim not in (0, -len(_dims(n) or (0, 0))):
                raise _Skip(f"{n.name} repeats the rows other than each token A = {a} times along dim 0")
            state = 0
            continue
        if name in ("expand", "expand_as"):
            raise _Skip(f"{n.name} broadcasts the experts' input rows in a flat (token, slot) form")
        index = _row_gather(n)
        if index is None:
            continue
        if len(_dims(n.args[0]) or ()) != 2:
            raise _Skip(f"{n.name} gathers rows of a {len(_dims(n.args[0]) or ())}-D tensor, not of (rows, Dm)")
        i = _order_root(index)
        if state is None and op_name(i) in ("floordiv", "floor_divide", "div") and len(i.args) > 1 \
                and i.args[1] == a and (op_name(i) != "div" or i.kwargs.get("rounding_mode") == "floor"):
            k = perm.power(i.args[0])
        elif state is not None:
            k = perm.power(i)
        else:
            k = None
        if k is None:
            raise _Skip(f"{n.name} gathers the experts' input with {index.name}, which is neither P // A nor a pair "
                        "permutation by P (the sort of the expert ids) or its inverse")
        state = k if state is None else state + k
    if state is None:
        raise _Skip(f"expert GEMM {g.node.name} reads token rows, not (token, slot) pair rows, in a flat form")
    return state


def _check_offsets(g, ids: fx.Node, perm: _Perm, e: int) -> None:
    """Raise _Skip unless grouped GEMM ``g``'s offsets are ``cumsum(histc(v, bins=E, min=0, max=E-1))`` (or of
    ``bincount(v, minlength=E)``) with ``v`` the sorted ids of P's sort or the flat ids: the rows in P order are
    then grouped by expert 0..E-1."""
    offs = arg(g.node, 2, "offs")
    c = _order_root(offs) if isinstance(offs, fx.Node) else None
    ok = op_name(c) == "cumsum" and arg(c, 1, "dim") in (0, -1) if isinstance(c, fx.Node) else False
    counts = _order_root(c.args[0]) if ok else None
    v = None
    if isinstance(counts, fx.Node) and op_name(counts) == "histc":
        bins, lo, hi = arg(counts, 1, "bins", 100), arg(counts, 2, "min", 0), arg(counts, 3, "max", 0)
        if bins == e and lo == 0 and hi == e - 1:
            v = counts.args[0]
    elif isinstance(counts, fx.Node) and op_name(counts) == "bincount" and arg(counts, 2, "minlength") == e:
        v = counts.args[0]
    for _ in range(8):  # casts of the ids: .float() (histc on CPU), .int() (CUDA)
        if isinstance(v, fx.Node) and op_name(v) in ("int", "long", "float", "to", "double") and v.args:
            v = v.args[0]
        v = _order_root(v) if isinstance(v, fx.Node) else None
    sort = perm.node.args[0] if perm.node is not None and op_name(perm.node) == "getitem" else None
    sorted_ids = isinstance(v, fx.Node) and op_name(v) == "getitem" and v.args[0] is sort and v.args[1] == 0
    if not (sorted_ids or (v is not None and v is _order_root(ids))):
        raise _Skip(f"the offsets of {g.node.name} are not the cumulative counts of the sorted expert ids "
                    "(cumsum(histc(ids, bins=E, min=0, max=E-1))): its row groups may not be experts 0..E-1")


def _output_order(routed: fx.Node, downs, weights: fx.Node, perm: _Perm, expert_order: int, a: int) -> int:
    """The order P^k in which the pairs reach the sum over slots of ``routed`` (a (T, A, Dm) view summed over dim 1),
    following the expert outputs (in ``expert_order``) and the routing ``weights`` (T, A) (flat: pair order) through
    order-keeping views, the combine ``mul`` and gathers by P^j; raise _Skip for anything else on the way."""
    if op_name(routed) != "sum" or not routed.args or not isinstance(routed.args[0], fx.Node):
        raise _Skip(f"the routed output {routed.name} ({op_name(routed)}) is not a sum over the slots of the "
                    "(token, slot) rows (an accumulation in a flat form is NYI)")
    dim = arg(routed, 1, "dim")
    dim = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
    src = routed.args[0]
    dims = _dims(src)
    if dims is None or len(dims) != 3 or dims[1] != str(a) or dim not in (1, -2) or arg(routed, 2, "keepdim", False):
        raise _Skip(f"{routed.name} does not sum a (T, A, Dm) view over dim 1 (the slots)")
    downs = {d.node for d in downs}
    memo: dict[fx.Node, int] = {}

    def order(n: object, depth: int = 0) -> int:
        if not isinstance(n, fx.Node) or depth > 32:
            raise _Skip("the path from the expert outputs to the sum over slots could not be followed")
        if n in memo:
            return memo[n]
        name = op_name(n)
        if n in downs:
            k = expert_order
        elif n is weights:
            k = 0  # (T, A): its flat order is the pair order
        elif name in _VIEWS and n.args and isinstance(n.args[0], fx.Node):
            if not _keeps_order(n) and not (name in ("expand", "expand_as") and _keeps_rows(n)):
                raise _Skip(f"{n.name} ({name}) reorders the (token, slot) rows or their features on the way to the "
                            "sum over slots")
            k = order(n.args[0], depth + 1)
        elif name == "masked_fill" and n.args and isinstance(n.args[0], fx.Node) and _keeps_values(n):
            k = order(n.args[0], depth + 1)
        elif name == "mul":
            ks = {order(x, depth + 1) for x in tensor_args(n)}
            if len(ks) != 1:
                raise _Skip(f"{n.name} multiplies expert outputs and routing weights in different row orders "
                            "(gathered by different permutations)")
            k = ks.pop()
        elif _row_gather(n) is not None:
            j = perm.power(_row_gather(n))
            if j is None:
                raise _Skip(f"{n.name} gathers the (token, slot) rows with {_row_gather(n).name}, which is neither "
                            "the sort permutation of the expert ids nor its inverse")
            k = order(n.args[0], depth + 1) + j
        else:
            raise _Skip(f"{n.name} ({name}) on the way from the expert outputs to the sum over slots")
        memo[n] = k
        return k

    return order(src)


# ------------------------------------------------------------------------------------------------ grid forms' dims
# In the (token, slot) grid forms (gpt-fast einsums, matmuls with the weights gathered by the (T, A) ids) nothing is
# gathered: which dim of each tensor is the token and which the slot is set by the equations, broadcasts and sums
# alone, and with T == A shapes cannot tell them apart. :func:`_check_grid_dims` follows those roles from the
# router's input (token, feature), the routing weights and the ids (token, slot) to the routed output.

#: Dim roles: the token, the slot (one of the A routed experts), a feature (model / ffn / weight dim), or a
#: broadcast (size 1, or expanded from size 1: it matches any role).
_TOKEN, _SLOT, _FEATURE, _BCAST = "token", "slot", "feature", "broadcast"
_ROLE_WORDS = {_TOKEN: "tokens", _SLOT: "slots", _FEATURE: "features", _BCAST: "a broadcast"}
_ELEMENTWISE = frozenset({"mul", "add", "sub", "div"})


def _check_grid_dims(routed: fx.Node, x_root: fx.Node, ids: fx.Node, weights: fx.Node, expert_weights: set,
                     e: int) -> None:
    """Raise _Skip unless the grid form pairs every (token, slot) as the op does: each einsum letter, broadcast-
    aligned dim (``mul``, ``matmul`` batch dims) and contracted dim holds one role (never the tokens of one operand
    against the slots of another, nor the tokens / slots contracted in a GEMM), no tensor has two dims of tokens or
    of slots (an outer product over the slots), the slots are summed only by the routed output (the combine
    ``einsum('tai,ta->ti')`` or ``.sum(1)``), the tokens never, and the routed output is (tokens, features).

    ``x_root``: the router's input (T, Dm) = (tokens, features); ``ids`` / ``weights``: the top-k indices and the
    routing weights the op reads, (T, A) = (tokens, slots); ``expert_weights``: the stacked weight placeholders,
    whose gathers ``W[ids]`` are (tokens, slots, features...). Ops other than views, dtype casts, activations,
    elementwise products, ``matmul`` / ``bmm``, explicit ``einsum`` equations and ``sum`` are refused.
    """
    memo: dict[fx.Node, tuple[str, ...]] = {}
    ids_root = _ids_root(ids, e)
    token_dims = [(_dims(ids) or ["?"])[0], (_dims(x_root) or ["?"])[-1]]

    def base_roles(n: fx.Node, roles: tuple[str, ...]) -> tuple[str, ...]:
        dims = _dims(n)
        if dims is None or len(dims) != len(roles):
            raise _Skip(f"{n.name} has no recorded shape of {len(roles)} dims (the tokens and slots of a grid form "
                        "cannot be followed)")
        return tuple(_BCAST if d == "1" else r for d, r in zip(dims, roles))

    def merge(n: fx.Node, column: list[str]) -> str:
        """One role for dims that line up (one einsum letter, broadcast-aligned dims)."""
        found = sorted({r for r in column if r != _BCAST})
        if len(found) > 1:
            raise _Skip(f"{n.name} ({op_name(n)}) lines up the {' with the '.join(_ROLE_WORDS[r] for r in found)} "
                        "of its operands (a grid form that pairs a token with another token's slot, or a slot's "
                        "weight with another token: not the (token, slot) pairs the op computes)")
        return found[0] if found else _BCAST

    def reduced(n: fx.Node, roles: list[str], features_ok: bool) -> None:
        """Raise _Skip unless summing over dims of these roles is what the op does there."""
        for r in roles:
            if r == _BCAST or (r == _SLOT and n is routed) or (r == _FEATURE and features_ok):
                continue
            raise _Skip(f"{n.name} ({op_name(n)}) sums over the {_ROLE_WORDS[r]} (only each token's sum over its "
                        "slots, in the routed output, and the expert GEMMs' contractions over features are fused)")

    def roles_of(n: object, depth: int = 0) -> tuple[str, ...]:
        if not isinstance(n, fx.Node) or depth > 64:
            raise _Skip("the path from the experts' input to the routed output could not be followed")
        if n in memo:
            return memo[n]
        name, dims = op_name(n), _dims(n)
        if dims is None:
            raise _Skip(f"{n.name} ({name}) has no recorded shape (the tokens and slots of a grid form cannot be "
                        "followed)")
        if _token_rows(n, x_root, token_dims):
            out = base_roles(n, (_TOKEN, _FEATURE))
        elif n is weights:
            out = base_roles(n, (_TOKEN, _SLOT))
        elif name in moe_analysis._GATHERS and moe_analysis._weight_gather(n) in expert_weights:
            index = n.args[0] if name == "embedding" else arg(n, 2, "index") if name == "index_select" else n.args[1]
            if not isinstance(index, fx.Node) or _ids_root(index, e) is not ids_root or _dims(index) != _dims(ids):
                raise _Skip(f"{n.name} gathers expert weights with {getattr(index, 'name', index)}, not the (T, A) "
                            "top-k indices as they are")
            out = base_roles(n, (_TOKEN, _SLOT) + (_FEATURE,) * (len(dims) - 2))
        elif name in _DTYPE_KEEPING or name in _ACTIVATIONS or name == "masked_fill":
            out = roles_of(n.args[0], depth + 1)
        elif name == "getitem" and isinstance(n.args[0], fx.Node) and op_name(n.args[0]) in ("chunk", "split"):
            piece = n.args[0]
            src = roles_of(piece.args[0], depth + 1)
            d = arg(piece, 2, "dim", 0)
            if not isinstance(d, int) or src[d % len(src)] in (_TOKEN, _SLOT):
                raise _Skip(f"{piece.name} splits along the {_ROLE_WORDS.get(src[d % len(src)], 'unknown dim')}"
                            if isinstance(d, int) else f"{piece.name} splits along an unknown dim")
            out = src
        elif name == "getitem":
            out = _indexed_roles(n, roles_of(n.args[0], depth + 1))
        elif name in _DIM_MOVES:
            src = roles_of(n.args[0], depth + 1)
            moved = _moved_dims(n, len(src))
            if moved is None:
                raise _Skip(f"{n.name} ({name}) moves dims this check cannot follow")
            out = tuple(src[d] for d in moved)
        elif name in _RESHAPES:
            out = _reshaped_roles(n, roles_of(n.args[0], depth + 1))
        elif name in ("expand", "expand_as"):
            src = roles_of(n.args[0], depth + 1)
            before = _dims(n.args[0]) or []
            lead = len(dims) - len(src)
            out = (_BCAST,) * lead + tuple(r if b == d else _BCAST for r, b, d in zip(src, before, dims[lead:]))
        elif name in _ELEMENTWISE:
            ops = [roles_of(a, depth + 1) for a in tensor_args(n)]
            out = tuple(merge(n, [o[len(o) - len(dims) + j] for o in ops if len(o) - len(dims) + j >= 0])
                        for j in range(len(dims)))
        elif name == "matmul":
            a, b = (roles_of(x, depth + 1) for x in tensor_args(n)[:2])
            if len(a) < 2 or len(b) < 2 or len(tensor_args(n)) != 2:
                raise _Skip(f"{n.name} ({name}) is not a product of two (batched) matrices")
            reduced(n, [merge(n, [a[-1], b[-2]])], True)
            batch = len(dims) - 2
            out = tuple(merge(n, [o[len(o) - 2 - batch + j] for o in (a, b) if len(o) - 2 - batch + j >= 0])
                        for j in range(batch)) + (a[-2], b[-1])
        elif name == "einsum":
            out = _einsum_roles(n, [roles_of(x, depth + 1) for x in tensor_args(n)], merge, reduced)
        elif name == "sum":
            src = roles_of(n.args[0], depth + 1)
            d = arg(n, 1, "dim")
            d = list(d) if isinstance(d, (list, tuple)) else list(range(len(src))) if d is None else [d]
            if not all(isinstance(k, int) for k in d):
                raise _Skip(f"{n.name} sums over dims this check cannot follow")
            d = {k % len(src) for k in d}
            reduced(n, [src[k] for k in sorted(d)], False)
            keep = arg(n, 2, "keepdim", False)
            out = tuple(_BCAST if k in d else r for k, r in enumerate(src)) if keep else \
                tuple(r for k, r in enumerate(src) if k not in d)
        else:
            raise _Skip(f"{n.name} ({name}) on the way from the experts' input to the routed output (which of its "
                        "dims are the tokens and which the slots cannot be followed)")
        if len(out) != len(dims):
            raise _Skip(f"{n.name} ({name}): its dims could not be followed (got {len(out)} roles for {len(dims)} dims)")
        out = tuple(_BCAST if d == "1" else r for d, r in zip(dims, out))
        for r in (_TOKEN, _SLOT):
            if out.count(r) > 1:
                raise _Skip(f"{n.name} ({name}) has {out.count(r)} dims of {_ROLE_WORDS[r]} (an outer product over "
                            f"the {_ROLE_WORDS[r]}, not one (token, slot) pair per row)")
        if _SLOT in out and n is routed:
            raise _Skip(f"the routed output {n.name} keeps the slots (they are not summed)")
        memo[n] = out
        return out

    got = roles_of(routed)
    want = tuple(_BCAST if d == "1" else r for d, r in zip(token_dims, (_TOKEN, _FEATURE)))
    if got != want:
        raise _Skip(f"the routed output {routed.name} holds ({', '.join(_ROLE_WORDS[r] for r in got)}), not (tokens, "
                    "features) like the router's input (a transposed or token-summed combine)")


def _token_rows(n: fx.Node, x_root: fx.Node, token_dims: list[str]) -> bool:
    """True when ``n`` is the (T, Dm) token rows of the router's input: ``x_root`` itself or a view of it (through
    views that keep every feature row and repeat none) with ``token_dims`` = [T, Dm] as its shape."""
    if _dims(n) != token_dims:
        return False
    for _ in range(32):
        if n is x_root:
            return True
        if not (op_name(n) in _VIEWS and op_name(n) not in ("expand", "expand_as") and n.args
                and isinstance(n.args[0], fx.Node) and _keeps_rows(n)):
            return False
        n = n.args[0]
    return False


def _indexed_roles(n: fx.Node, src: tuple[str, ...]) -> tuple[str, ...]:
    """Roles after ``x[items]`` with ints, slices, None and Ellipsis (no tensor index); raise _Skip otherwise or when
    it selects some of the tokens or slots."""
    index = n.args[1] if len(n.args) > 1 else None
    items = list(index) if isinstance(index, (tuple, list)) else [index]
    if any(isinstance(i, fx.Node) for i in items):
        raise _Skip(f"{n.name} gathers by a tensor index in a (token, slot) grid form")
    used = sum(1 for i in items if i is not None and i is not Ellipsis)
    if items.count(Ellipsis) > 1 or used > len(src):
        raise _Skip(f"{n.name}: an index this check cannot follow")
    k = items.index(Ellipsis) if Ellipsis in items else len(items)
    items = items[:k] + [slice(None)] * (len(src) - used) + items[k + 1:]
    out, d = [], 0
    for i in items:
        if i is None:
            out.append(_BCAST)
            continue
        r = src[d]
        d += 1
        if i == slice(None):
            out.append(r)
        elif r in (_TOKEN, _SLOT):
            raise _Skip(f"{n.name} selects some of the {_ROLE_WORDS[r]} ({i!r})")
        elif isinstance(i, slice):
            out.append(r)
    return tuple(out)


def _reshaped_roles(n: fx.Node, src: tuple[str, ...]) -> tuple[str, ...]:
    """Roles after a reshape: dims of size 1 come and go freely; the others must be the same sizes in the same order,
    or merge / split only features."""
    before, after = _dims(n.args[0]), _dims(n)
    big_before = [(d, r) for d, r in zip(before, src) if d != "1"]
    big_after = [d for d in after if d != "1"]
    if [d for d, _ in big_before] == big_after:
        roles = iter(r for _, r in big_before)
        return tuple(_BCAST if d == "1" else next(roles) for d in after)
    k = 0  # otherwise: the tokens / slots lead, unchanged, and only the features after them are merged or split
    while k < len(big_before) and big_before[k][1] in (_TOKEN, _SLOT):
        k += 1
    if all(r not in (_TOKEN, _SLOT) for _, r in big_before[k:]) and big_after[:k] == [d for d, _ in big_before[:k]]:
        lead, out = [r for _, r in big_before[:k]], []
        for d in after:
            out.append(_BCAST if d == "1" else lead.pop(0) if lead else _FEATURE)
        return tuple(out)
    raise _Skip(f"{n.name} ({op_name(n)}) reshapes {before} -> {after}, merging or splitting the tokens or slots")


def _einsum_roles(n: fx.Node, operands: list[tuple[str, ...]], merge, reduced) -> tuple[str, ...]:
    """Roles of an explicit ``einsum``'s output: one role per letter (:func:`_check_grid_dims`' ``merge``), the
    summed letters' roles checked by ``reduced``; each of tokens and slots held by one letter at most."""
    spec = n.args[0] if n.args and isinstance(n.args[0], str) else None
    spec = spec.replace(" ", "") if spec else None
    if not spec or "->" not in spec or "." in spec:
        raise _Skip(f"{n.name}: einsum {spec!r} is not an explicit equation without '...'")
    lhs, rhs = spec.split("->")
    terms = lhs.split(",")
    if len(terms) != len(operands) or any(len(t) != len(o) for t, o in zip(terms, operands)):
        raise _Skip(f"{n.name}: einsum {spec!r} does not match its operands' dims")
    letters: dict[str, list[str]] = {}
    for t, o in zip(terms, operands):
        for c, r in zip(t, o):
            letters.setdefault(c, []).append(r)
    role = {c: merge(n, rs) for c, rs in letters.items()}
    for r in (_TOKEN, _SLOT):
        held = [c for c, x in role.items() if x == r]
        if len(held) > 1:
            raise _Skip(f"{n.name}: einsum {spec!r} gives the {_ROLE_WORDS[r]} {len(held)} letters "
                        f"({', '.join(held)}): an outer product over the {_ROLE_WORDS[r]}")
    reduced(n, [role[c] for c in role if c not in rhs], True)
    return tuple(role[c] for c in rhs)


# ------------------------------------------------------------------------------------------------ eager loops' rows
# An eager loop's expert e reads the tokens ``where(ids == e)`` (or a one-hot mask of the ids) found, weights each
# with ``w[token, slot]`` at that same where's coordinates, and is summed back at its tokens: the op pairs row (t, a)
# with token t, expert ids[t, a] and weight w[t, a] only when every step uses the same where, the right coordinate
# for the token and for the slot, and the expert whose weights the GEMMs select.

_CLASS = "expert"


def _check_loop_rows(ups, downs, weights: fx.Node, ids: fx.Node, e: int) -> None:
    """Raise _Skip unless each expert of an eager loop reads, weights and accumulates the (token, slot) pairs that
    one ``where`` of its own expert mask found, and the loop visits every expert 0..E-1 once.

    Per down GEMM (one per expert): the GEMMs select expert ``c`` (``W[c]``); its up GEMMs gather the tokens
    ``x[token]``, its combine multiplies by ``weights[token, slot]`` (one gather of the (T, A) routing weights the op
    reads, then views only) and its accumulation adds at ``token``, where ``token`` / ``slot`` are the outputs of one
    ``torch.where(mask)`` (or ``nonzero(mask, as_tuple=True)``) at the mask's token and slot dims, and ``mask`` is
    ``ids == c`` or ``one_hot(ids, E)[..]`` selected at class ``c`` (through transposes / permutes, whose dims are
    followed).
    """
    experts = []
    for d in downs:
        c = _selected_expert(d)
        if c is None:
            raise _Skip(f"the eager loop's down GEMM {d.node.name} does not select its expert by a constant (W[e])")
        feeding = [g for g in ups if g.node in ancestors(d.node, max_depth=24)]
        tokens = {_order_root(_unsqueezed(i)) for g in feeding for i in _token_indices(_data_operand(g))}
        if len(tokens) != 1:
            raise _Skip(f"the up GEMMs of {d.node.name} gather the tokens with {len(tokens)} indices, not the one "
                        "token coordinate of a where")
        coords, mask_expert, role = _where_coords(tokens.pop(), ids, e)
        if role != _TOKEN or mask_expert != c:
            raise _Skip(f"the eager loop's expert {c} gathers the tokens with the {role} coordinate of "
                        f"a where over the mask of expert {mask_expert} (its rows must be the token coordinate of "
                        f"where(ids == {c}))")
        found = moe_analysis._find_combine(d.node)
        if found is None:
            raise _Skip(f"the combine of the eager loop's expert {c} was not found")
        combine, operand = found
        _check_loop_weight_gather(operand, weights, coords, c)
        for link in _descendants(combine, 4):
            if op_name(link) not in _ACCUMULATIONS:
                continue
            pos, key = _ACCUMULATIONS[op_name(link)]
            source = link.args[pos] if len(link.args) > pos else link.kwargs.get(key)
            if not isinstance(source, fx.Node) or _row_root(source) is not combine:
                continue  # a later expert's accumulation into the chain
            index = _accumulation_index(link)
            if index is None or _order_root(_unsqueezed(index)) is not coords[0]:
                raise _Skip(f"{link.name} accumulates the expert {c}'s output at {getattr(index, 'name', index)}, "
                            "not at the token coordinate of its where")
        experts.append(c)
    if sorted(experts) != list(range(e)):
        raise _Skip(f"the eager loop visits the experts {sorted(experts)}, not each of the E = {e} experts once "
                    "(the op computes every routed expert)")


def _accumulation_index(link: fx.Node) -> fx.Node | None:
    """The token index of an accumulation of :data:`_ACCUMULATIONS` (a scatter's broadcast column), or None."""
    name = op_name(link)
    if name.startswith("index_put"):
        index = link.args[1] if len(link.args) > 1 else link.kwargs.get("indices")
        index = index[0] if isinstance(index, (tuple, list)) and len(index) == 1 else None
    else:
        index = arg(link, 2, "index")
        if name.startswith("scatter_add") and isinstance(index, fx.Node) and op_name(index) in ("expand", "expand_as"):
            index = index.args[0]
    return index if isinstance(index, fx.Node) else None


def _where_coords(index: fx.Node, ids: fx.Node, e: int) -> tuple[tuple[fx.Node | None, fx.Node | None], int, str]:
    """For ``index`` = output k of ``torch.where(mask)`` (or ``nonzero(mask, as_tuple=True)``): ((the where's
    token output, its slot output), the expert c of ``mask``, the role of output k). Raise _Skip when ``index`` is
    not such an output or the mask is not one expert's mask of the top-k ids (:func:`_mask_roles`)."""
    if not (op_name(index) == "getitem" and len(index.args) > 1 and isinstance(index.args[1], int)
            and isinstance(index.args[0], fx.Node)):
        raise _Skip(f"the eager loop's token index {index.name} is not an output of torch.where(mask)")
    w = index.args[0]
    name = op_name(w)
    if not ((name == "where" and len(w.args) == 1 and not w.kwargs)
            or (name == "nonzero" and w.kwargs.get("as_tuple") is True and len(w.args) == 1)):
        raise _Skip(f"the eager loop's token index {index.name} is not an output of torch.where(mask)")
    roles, c = _mask_roles(w.args[0], ids, e)
    if _CLASS in roles or c is None or sorted(roles) != sorted((_TOKEN, _SLOT)):
        raise _Skip(f"the mask of {w.name} is not one expert's (token, slot) mask of the top-k ids")
    outs = {u.args[1]: u for u in w.users if op_name(u) == "getitem" and isinstance(u.args[1], int)}
    by_role = {r: outs.get(k) for k, r in enumerate(roles)}
    return (by_role[_TOKEN], by_role[_SLOT]), c, roles[index.args[1]]


def _mask_roles(mask: object, ids: fx.Node, e: int) -> tuple[tuple[str, ...], int | None]:
    """The roles (token, slot, expert class) of ``mask``'s dims and the expert it selects: ``ids == c``,
    ``one_hot(ids, E)``, a constant index ``[c]`` / ``select`` of the class dim, transposes / permutes and dtype
    casts of those; raise _Skip for anything else."""
    n = mask
    if not isinstance(n, fx.Node):
        raise _Skip("an eager loop's where has no mask tensor")
    name = op_name(n)
    if name in _DTYPE_KEEPING or name in ("bool", "int", "long"):
        return _mask_roles(n.args[0], ids, e)
    if name in _DIM_MOVES:
        src, c = _mask_roles(n.args[0], ids, e)
        moved = _moved_dims(n, len(src))
        if moved is None:
            raise _Skip(f"{n.name} ({name}) moves the mask's dims in a way this check cannot follow")
        return tuple(src[d] for d in moved), c
    if name == "eq" and len(n.args) == 2:
        tensor, c = (n.args[0], n.args[1]) if isinstance(n.args[0], fx.Node) else (n.args[1], n.args[0])
        if isinstance(c, int) and not isinstance(c, bool) and isinstance(tensor, fx.Node):
            return _ids_roles(tensor, ids, e), c
    if name == "one_hot" and n.args and arg(n, 1, "num_classes") == e:
        return _ids_roles(n.args[0], ids, e) + (_CLASS,), None
    if name in ("getitem", "select") and len(n.args) > 1:
        index = n.args[1] if name == "getitem" else None
        if name == "select":
            dim, c = arg(n, 1, "dim"), arg(n, 2, "index")
        elif isinstance(index, int):
            dim, c = 0, index
        elif isinstance(index, tuple) and len(index) == 1 and isinstance(index[0], int):
            dim, c = 0, index[0]
        else:
            dim, c = None, None
        if isinstance(dim, int) and isinstance(c, int) and not isinstance(c, bool):
            src, prev = _mask_roles(n.args[0], ids, e)
            if prev is None and src[dim % len(src)] == _CLASS and 0 <= c < e:
                return tuple(r for k, r in enumerate(src) if k != dim % len(src)), c
    raise _Skip(f"{n.name} ({name}): an eager loop's where mask other than ids == e or a one-hot of the ids at "
                "expert e")


def _ids_roles(n: fx.Node, ids: fx.Node, e: int) -> tuple[str, ...]:
    """(token, slot) for the top-k ids (through casts and no-op clamps), with transposes followed."""
    if op_name(n) in _DIM_MOVES and n.args and isinstance(n.args[0], fx.Node):
        src = _ids_roles(n.args[0], ids, e)
        moved = _moved_dims(n, len(src))
        if moved is not None:
            return tuple(src[d] for d in moved)
    if _ids_root(n, e) is _ids_root(ids, e) and _dims(n) == _dims(ids) and len(_dims(ids) or ()) == 2:
        return _TOKEN, _SLOT
    raise _Skip(f"{n.name}: an eager loop's expert mask is not computed from the top-k ids {ids.name} as they are")


def _check_loop_weight_gather(operand: fx.Node, weights: fx.Node, coords: tuple, c: int) -> None:
    """Raise _Skip unless the combine's routing operand is ``weights[token, slot]`` (then views that keep the order:
    ``[..., None]``, casts) with ``token`` / ``slot`` = ``coords`` (the expert's where outputs)."""
    n = operand
    for _ in range(16):
        if _is_gather(n):
            break
        name = op_name(n)
        index = n.args[1] if name == "getitem" and len(n.args) > 1 else None
        items = index if isinstance(index, tuple) else (index,)
        if name in _VIEWS and _keeps_order(n) or (name == "getitem" and all(
                i is None or i is Ellipsis or i == slice(None) for i in items)):
            n = n.args[0]
            continue
        raise _Skip(f"{n.name} ({name}) between the expert {c}'s routing weights and its combine")
    else:
        raise _Skip(f"the expert {c}'s routing weights could not be followed to their gather")
    index = n.args[1] if op_name(n) in ("getitem", "index") and len(n.args) > 1 else None
    items = list(index) if isinstance(index, (tuple, list)) else []
    if n.args[0] is not weights or len(items) < 2 or not all(isinstance(i, fx.Node) for i in items[:2]) \
            or any(not (i is None or i is Ellipsis or i == slice(None)) for i in items[2:]):
        raise _Skip(f"{n.name} is not one gather weights[token, slot] of the (T, A) routing weights {weights.name} "
                    "(by two index tensors)")
    got = tuple(_order_root(i) for i in items[:2])
    if got != tuple(coords):
        words = []
        for i, want, role in zip(got, coords, ("token", "slot")):
            if i is not want:
                what = ("the token coordinate" if i is coords[0] else "the slot coordinate" if i is coords[1]
                        else f"{i.name}, not a coordinate")
                words.append(f"the {role} index is {what} of the expert's where")
        raise _Skip(f"{n.name} gathers the expert {c}'s routing weights at other (token, slot) pairs than its where "
                    f"found ({'; '.join(words)})")


# ------------------------------------------------------------------------------------------------ rewriting


def _rewrite(graph: fx.Graph, rw: _Rewrite, site: MoESite) -> None:
    routed = rw.routed
    consumers = moe_analysis._consumers(routed)
    order = {n: k for k, n in enumerate(graph.nodes)}
    first = min(consumers, key=order.__getitem__) if consumers else routed.next
    stack = routed.meta.get("nn_module_stack")
    new: list[fx.Node] = []
    with graph.inserting_before(first):
        def weight(spec: tuple[fx.Node, int | None]) -> fx.Node:
            w, half = spec
            if half is None:
                return w
            n = graph.call_function(torch.narrow, (w, 1, half * rw.ffn, rw.ffn))
            new.append(n)
            return n

        out = graph.call_function(_op_for(rw.x),
                                  (rw.x, rw.ids, rw.weights, weight(rw.gate), weight(rw.up), rw.down))
        new.append(out)
        r_shape, r_dtype = _shape(routed), _dtype(routed)
        if r_shape is not None and r_shape != _shape(rw.x):
            out = graph.call_function(torch.reshape, (out, tuple(r_shape)))
            new.append(out)
        if r_dtype is not None and _dtype(rw.x) is not None and r_dtype != _dtype(rw.x):
            out = graph.call_method("to", (out, r_dtype))
            new.append(out)
    for n in new:
        if stack is not None:
            n.meta["nn_module_stack"] = dict(stack)
        _set_example_value(n)
    for c in consumers:
        c.replace_input_with(routed, out)
    _remove_dead(graph, routed, site)
    logger.debug("ckvp expert_gemm: layer %d (%s) -> %s", site.layer, site.experts_form, out.name)


def _op_for(x: fx.Node):
    """The op to call: ``ckvp::moe_experts`` on every device. Under Inductor its lowering
    (``ckvp_compile/lowering/moe.py``) turns it into the routing kernel and two autotuned grouped-GEMM templates on
    CUDA (the reference parts elsewhere); under ``aot_eager`` / eager it runs its own kernels or the reference.
    ``ckvp::moe_experts_triton`` (the traceable triton_op with fixed configs) stays available for direct use."""
    return torch.ops.ckvp.moe_experts.default


def _dtype(node: fx.Node):
    from ..analysis.graph import dtype_of

    return dtype_of(node)


def _set_example_value(node: fx.Node) -> None:
    """Give a new node the fake value Dynamo would have recorded (analysis and inspection read shapes)."""
    from torch._guards import detect_fake_mode

    args = [a.meta.get("example_value") if isinstance(a, fx.Node) else a for a in node.args]
    fake_mode = detect_fake_mode([a for a in args if isinstance(a, torch.Tensor)])
    if fake_mode is None or any(isinstance(a, fx.Node) and a.meta.get("example_value") is None for a in node.args):
        return
    try:
        with fake_mode:
            if node.op == "call_method":
                val = getattr(args[0], node.target)(*args[1:])
            else:
                val = node.target(*args, **node.kwargs)
    except Exception:  # shapes are informational here; AOT tracing recomputes them
        return
    node.meta["example_value"] = val


def _remove_dead(graph: fx.Graph, routed: fx.Node, site: MoESite) -> None:
    """Erase the old experts computation: nodes that lead only to ``routed`` and now have no users, plus in-place
    accumulations into buffers that nothing reads any more. Placeholders and anything still used stay."""
    candidates = ancestors(routed, max_depth=64) | {routed}
    accumulations = {u for u in routed.users if op_name(u) in _INPLACE}  # an eager loop's index_add_ into routed
    for u in accumulations:
        candidates |= ancestors(u, max_depth=64) | {u}
    inplace = {u for n in list(candidates) for u in n.users if _writes_in_place(u) and u.args[0] is n}
    for u in inplace:  # with what only they read (transformers 5.17: the sentinel mask of masked_fill_ / clamp_)
        candidates |= ancestors(u, max_depth=8) | {u}
    frontier = list(candidates)  # size guards of data-dependent shapes (where / nonzero in an eager loop)
    for _ in range(4):
        frontier = [u for n in frontier for u in n.users if op_name(u) in _GUARDS and u not in candidates]
        candidates |= set(frontier)
    changed = True
    while changed:
        changed = False
        for n in reversed(list(graph.nodes)):
            if n not in candidates or n.op in ("placeholder", "output", "get_attr") or n.users:
                continue
            name = op_name(n)
            if name in _GUARDS:
                if not all(i in candidates for i in n.all_input_nodes):
                    continue
            elif _writes_in_place(n) or n.name.endswith("_") or _impure(n):
                target = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
                root = _view_root(target) if target is not None else None
                if root is None or root.op in ("placeholder", "get_attr") or root is not target \
                        or any(not _writes_in_place(u) for u in target.users):
                    continue  # a write into a graph input (or a view of one) is never dead
            graph.erase_node(n)
            candidates.discard(n)
            changed = True


def _view_root(n: fx.Node) -> fx.Node:
    """The tensor ``n`` is a view of (through view ops and basic-indexing getitem), itself when it is not a view.

    A getitem with a tensor index (a gather: ``x[perm]``) or of a fresh op's tuple (``torch.sort(x)[0]``,
    :data:`_FRESH_TUPLES`) makes a new tensor, so the walk stops there; a getitem of ``split`` / ``chunk`` /
    ``unbind`` pieces is a view of their input."""
    while n.args and isinstance(n.args[0], fx.Node):
        name = op_name(n)
        if name == "getitem":
            src, idx = n.args[0], n.args[1] if len(n.args) > 1 else None
            if op_name(src) in ("split", "chunk", "unbind", "split_with_sizes", "tensor_split"):
                n = src.args[0] if src.args and isinstance(src.args[0], fx.Node) else src
                continue
            if op_name(src) in _FRESH_TUPLES or _has_node(idx):
                return n
            n = src
        elif name in _VIEWS | {"narrow", "select", "slice"}:
            n = n.args[0]
        else:
            return n
    return n


#: Ops whose tuple outputs are new tensors (``getitem`` of them is not a view of anything).
_FRESH_TUPLES = {"sort", "topk", "max", "min", "kthvalue", "median", "mode"}


def _has_node(idx) -> bool:
    """True when an index holds a graph value (a tensor index: advanced indexing copies)."""
    if isinstance(idx, fx.Node):
        return True
    if isinstance(idx, (tuple, list)):
        return any(_has_node(i) for i in idx)
    return False


def _writes_in_place(n: fx.Node) -> bool:
    """An in-place method or op on its first argument (``add_``, ``clamp_``, ``masked_fill_``, ...)."""
    name = op_name(n)
    return name in _INPLACE or (name.endswith("_") and not name.startswith("_") and bool(n.args)
                                and isinstance(n.args[0], fx.Node))


def _impure(n: fx.Node) -> bool:
    try:
        return n.is_impure()
    except Exception:
        return True


# ------------------------------------------------------------------------------------------------ the shared expert


@dataclass
class _SharedRewrite:
    x: fx.Node  # the shared expert's input, (*lead, Dm) with T = prod(lead) tokens
    gate_w: fx.Node  # (I, Dm) parameter
    up_w: fx.Node  # (I, Dm) parameter
    down_w: fx.Node  # (Dm, I) parameter
    weights: fx.Node | None  # sigmoid(gate logits), (*lead, 1); None when ungated
    out: fx.Node  # the value the op replaces: sigmoid(gate) * down(...), or down(...) when ungated
    dead: tuple[fx.Node, ...]  # the old expert nodes, users before inputs


def _understand_shared(graph: fx.Graph, site: MoESite) -> _SharedRewrite:
    """Verify the site's shared expert is exactly ``[sigmoid(x @ Ws^T) *] ((silu(x @ Wg^T) * (x @ Wu^T)) @ Wd^T)``
    (bias-free linears on 2-D parameters, Ws (1, Dm), Wg / Wu (I, Dm), Wd (Dm, I), no dtype change, nothing else
    reading its intermediates) and return what the one-expert op needs, or raise _Skip with the reason."""
    sh = site.shared_expert
    nodes = node_map(graph)
    names = [n for n in (*sh.gate_up_nodes, sh.down_node, sh.gate_node, sh.combine_node) if n is not None]
    missing = [n for n in names if n not in nodes]
    if missing or sh.down_node is None or sh.combine_node is None:
        raise _Skip(f"nodes {missing or names} of the shared expert are not in the graph")
    if len(sh.gate_up_nodes) != 2:
        raise _Skip(f"{len(sh.gate_up_nodes)} input projection(s) {list(sh.gate_up_nodes)}; only separate gate and "
                    "up linears are read (a fused gate_up linear is NYI)")
    down = nodes[sh.down_node]
    down_w = _linear_weight(down)
    h = down.args[0]
    if not (isinstance(h, fx.Node) and op_name(h) == "mul" and len(h.args) == 2 and not h.kwargs
            and all(isinstance(a, fx.Node) for a in h.args)):
        raise _Skip(f"the down projection {down.name} does not read act(gate) * up directly (it reads "
                    f"{op_name(h) if isinstance(h, fx.Node) else h})")
    acts = [a for a in h.args if op_name(a) in _ACTIVATIONS]
    if len(acts) != 1 or op_name(acts[0]) != "silu":
        raise _Skip(f"activation {sorted(op_name(a) for a in acts) or 'none'} in the shared expert; only "
                    "silu(gate) * up (SwiGLU) is fused")
    silu = acts[0]
    up = h.args[1] if h.args[0] is silu else h.args[0]
    gate = silu.args[0] if silu.args else None
    if {gate, up} != {nodes[n] for n in sh.gate_up_nodes}:
        raise _Skip(f"silu(gate) * up is not made of the input projections {list(sh.gate_up_nodes)} directly")
    gate_w, up_w = _linear_weight(gate), _linear_weight(up)
    x = gate.args[0]
    if up.args[0] is not x or not isinstance(x, fx.Node):
        raise _Skip(f"the gate and up projections read different tensors ({gate.args[0]}, {up.args[0]})")
    dm, x_shape = site.hidden_dim, _shape(x)
    i = (_shape(gate_w) or (0,))[0]
    if not x_shape or x_shape[-1] != dm or _symbolic_dim(x, -1):
        raise _Skip(f"the shared expert's input {x.name} is {x_shape}, expected (..., Dm = {dm})")
    for w, want in ((gate_w, (i, dm)), (up_w, (i, dm)), (down_w, (dm, i))):
        if _shape(w) != want:
            raise _Skip(f"shared expert weight {w.name} is {_shape(w)}, expected {want} (I = {i}, Dm = {dm})")
    internal = {gate: {silu}, up: {h}, silu: {h}, h: {down}}
    weights, out = None, down
    if sh.gate_node is not None:
        lin = nodes[sh.gate_node]
        gw = _linear_weight(lin)
        if _shape(gw) != (1, dm) or lin.args[0] is not x:
            raise _Skip(f"the shared expert gate {lin.name} is not a linear (1, Dm) of the expert's input {x.name} "
                        f"(weight {_shape(gw)}, input {lin.args[0]})")
        muls = [(u, _other_factor(u, down)) for u in down.users]
        muls = [(u, f) for u, f in muls if f is not None and op_name(f) == "sigmoid"]
        out, sig = muls[0] if len(muls) == 1 else (None, None)
        if sig is None or sig.args != (lin,) or sig.kwargs:
            raise _Skip(f"the shared expert's output {down.name} is not multiplied by sigmoid({lin.name}) directly")
        weights = sig
        internal[down] = {out}
        if not _same_shape(sig, lin) or _dims(sig) != _dims(x)[:-1] + ["1"]:
            raise _Skip(f"the gate sigmoid({lin.name}) is {_shape(sig)}, expected the input's leading dims and 1 "
                        f"(input {x_shape})")
    combine = nodes[sh.combine_node]
    if not any(strip_views(a, moe_analysis._EXTRA_VIEWS) is out for a in combine.args):
        raise _Skip(f"the add {combine.name} does not read the shared expert's output {out.name}")
    if not _same_shape(out, x) or _dtype(out) != _dtype(x):
        raise _Skip(f"the shared expert's output {out.name} is {_shape(out)} {_dtype(out)}, not its input's "
                    f"{x_shape} {_dtype(x)} (a dtype cast or broadcast inside it)")
    for w in (gate_w, up_w, down_w):
        if _dtype(w) != _dtype(x):
            raise _Skip(f"shared expert weight {w.name} is {_dtype(w)}, its input {_dtype(x)}")
    for n, allowed in internal.items():
        others = [u.name for u in n.users if u not in allowed]
        if others:
            raise _Skip(f"{n.name} inside the shared expert is also read by {others}")
    return _SharedRewrite(x, gate_w, up_w, down_w, weights, out, tuple(dict.fromkeys((out, down, h, silu, up, gate))))


def _other_factor(mul: fx.Node, factor: fx.Node) -> fx.Node | None:
    """For ``mul(a, b)`` (two graph values, no other arguments) with ``factor`` one of them: the other one."""
    if op_name(mul) != "mul" or len(mul.args) != 2 or mul.kwargs or factor not in mul.args:
        return None
    other = mul.args[1] if mul.args[0] is factor else mul.args[0]
    return other if isinstance(other, fx.Node) else None


def _linear_weight(node: fx.Node) -> fx.Node:
    """The 2-D parameter of a bias-free ``F.linear`` / ``nn.Linear`` call, or raise _Skip."""
    if not isinstance(node, fx.Node) or op_name(node) != "linear":
        raise _Skip(f"{getattr(node, 'name', node)} is {op_name(node) if isinstance(node, fx.Node) else 'no node'}, "
                    "not a linear (the shared expert is read as F.linear / nn.Linear projections)")
    w = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    if bias is not None:
        raise _Skip(f"{node.name} has a bias (NYI in the fused op)")
    if not isinstance(w, fx.Node) or w.op not in ("placeholder", "get_attr") or len(_shape(w) or ()) != 2:
        raise _Skip(f"the weight of {node.name} is not a 2-D parameter")
    return w


def _dims(node: fx.Node) -> list[str] | None:
    """The recorded shape with every size as its expression string (symbolic sizes compare without a guard)."""
    val = node.meta.get("example_value")
    return [str(d) for d in val.shape] if isinstance(val, torch.Tensor) else None


def _same_shape(a: fx.Node, b: fx.Node) -> bool:
    """Equal recorded shapes, symbolic sizes compared as expressions (no guard is added)."""
    return _dims(a) is not None and _dims(a) == _dims(b)


def _symbolic_dim(node: fx.Node, dim: int) -> bool:
    val = node.meta.get("example_value")
    return not isinstance(val, torch.Tensor) or not isinstance(val.shape[dim], int)


def _rewrite_shared(graph: fx.Graph, rw: _SharedRewrite, site: MoESite) -> None:
    """Replace the shared expert with ``ckvp.moe_experts`` over one expert: ids all 0, weights the sigmoid gate
    (ones when ungated), the weights unsqueezed to (1, I, Dm) / (1, Dm, I) views; leading dims flattened to T."""
    dm = site.hidden_dim
    flat = len(_shape(rw.x)) != 2
    stack = rw.out.meta.get("nn_module_stack")
    new: list[fx.Node] = []

    def call(fn, *args, **kwargs) -> fx.Node:
        n = graph.call_method(fn, args) if isinstance(fn, str) else graph.call_function(fn, args, kwargs)
        new.append(n)
        return n

    with graph.inserting_before(rw.out):
        x = call(torch.reshape, rw.x, (-1, dm)) if flat else rw.x  # (T, Dm)
        if rw.weights is None:
            w = call(torch.ones_like, call(torch.narrow, x, 1, 0, 1))  # (T, 1) x.dtype
        else:
            w = call(torch.reshape, rw.weights, (-1, 1)) if flat else rw.weights  # (T, 1)
        ids = call(torch.zeros_like, w, dtype=torch.int32)  # (T, 1): every token's one expert is expert 0
        weights = [call(torch.unsqueeze, p, 0) for p in (rw.gate_w, rw.up_w, rw.down_w)]  # (1, I, Dm) x2, (1, Dm, I)
        out = call(_op_for(x), x, ids, w, *weights)
        if flat:
            out = call("view_as", out, rw.x)
    for n in new:
        if stack is not None:
            n.meta["nn_module_stack"] = dict(stack)
        _set_example_value(n)
    rw.out.replace_all_uses_with(out)
    for n in rw.dead:
        if not n.users:
            graph.erase_node(n)
    logger.debug("ckvp expert_gemm: layer %d shared expert -> %s", site.layer, out.name)
