"""Rewrite each MoE layer's routed experts into one ``ckvp::moe_experts`` call (grouped expert GEMMs).

Runs on the Dynamo graph (stage 'torch'), where the analysis found the :class:`~ckvp_compile.analysis.sites.
MoESite` and named its nodes; every experts form the analysis reports is handled the same way, because only
the ends of the experts computation are read, never its middle::

    before (any form: HF grouped_mm / grouped_mm_fallback / batched_mm / eager loop, gpt-fast einsum)
        x           = <router input>                        (T, Dm)
        vals, ids   = topk(scores(router(x)), A)             (T, A)
        w           = <routing weights as the model uses them>    (T, A)   e.g. vals / vals.sum(-1)
        routed      = sum_a w * down(silu(gate(x)) * up(x))  (T, Dm)   sort / gather / bmm / einsum / loop ...
        out         = routed [+ shared_expert(x)] ...
    after
        routed      = ckvp.moe_experts(x, ids, w, W_gate, W_up, W_down)   (lowered by lowering/moe.py)
        out         = routed [+ shared_expert(x)] ...        (the router, scoring and shared expert untouched)

``w`` is the tensor the model multiplies its expert outputs by, traced back from the combine to its (T, A)
form, so softmax placement, renormalisation and dtype casts are exactly the model's. W_gate / W_up / W_down
are the stacked weight placeholders the site names, given to the op as views (HF's fused ``gate_up_proj``
(E, 2I, Dm) as ``narrow`` halves, gate first or second as the graph's ``chunk`` says). The old experts
computation is then dead and removed (including in-place accumulations into a buffer nothing else reads).

A site is left untouched, with an :class:`~ckvp_compile.errors.UnsupportedPatternWarning` giving the reason,
when any of these is not found exactly: the weights' roles and layouts ((E, I, Dm) gate / up or (E, 2I, Dm)
fused, (E, Dm, I) down), a ``silu(gate) * up`` activation (no other activation, no biases), the routing-weight
tensor, the routed output, or experts fed by the router's input.

Prior art: vLLM ``FusedMoE`` (one op for the experts of a layer); the pattern-docstring form of vLLM's
compilation passes.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..analysis import moe as moe_analysis
from ..analysis.graph import ancestors, node_map, op_name, shape_of, strip_views
from ..analysis.sites import MoESite
from ..errors import UnsupportedPatternWarning
from .base import CKVPPass

logger = logging.getLogger(__name__)

__all__ = ["ExpertGemmPass", "SkippedSite"]

_VIEWS = moe_analysis._PASS  # view / dtype ops the analysis walks through on routing paths
_ACTIVATIONS = {"silu", "gelu", "relu", "sigmoid", "tanh", "gelu_tanh", "softplus"}
_INPLACE = {"index_add_", "scatter_add_", "index_put_", "add_", "copy_", "masked_fill_", "zero_", "fill_",
            "setitem", "iadd", "itruediv", "imul", "div_", "mul_"}


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
    """

    name = "expert_gemm"
    stage = "torch"

    def __init__(self, sites: tuple[MoESite, ...] | list[MoESite]) -> None:
        self.sites = tuple(sites)
        self.skipped: list[SkippedSite] = []

    def is_applicable(self, graph: fx.Graph) -> str:
        """'' when there are sites to rewrite, else the reason."""
        return "" if self.sites else "no MoE site planned for the expert GEMM rewrite"

    def apply(self, graph: fx.Graph) -> int:
        """Rewrite every site it fully understands; return how many were rewritten."""
        from ..ops import register_all

        register_all()
        self.skipped = []
        count = 0
        for site in self.sites:
            try:
                rw = _understand(graph, site)
            except _Skip as why:
                self.skipped.append(SkippedSite(site.layer, str(why)))
                warnings.warn(f"ckvp: layer {site.layer}: the expert GEMM rewrite does not apply: {why}. Left "
                              "untouched (the model's own experts run). Fix: report the model with the output of "
                              "ckvp-inspect.", UnsupportedPatternWarning, stacklevel=2)
                continue
            _rewrite(graph, rw, site)
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
    x_root = strip_views(x, moe_analysis._EXTRA_VIEWS)
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
        raise _Skip(f"down weight {down.name} is {_shape(down)}, expected (E, Dm, I) = {(e, dm, i)} (a transposed "
                    "experts layout is NYI)")
    gate, up = _gate_up_roles(ups, e, dm, i)
    combine = [c for c in (moe_analysis._find_combine(g.node) for g in downs) if c is not None]
    if not combine:
        raise _Skip("the combine (expert outputs times routing weights) was not found")
    for g in ups:
        for d in downs:
            extra = _ops_between(g.node, d.node) - {"chunk", "split", "silu", "mul"} if \
                d.node in _descendants(g.node, 12) else set()
            if extra:
                raise _Skip(f"{', '.join(sorted(extra))} between the expert GEMMs {g.node.name} and {d.node.name} "
                            "(an expert bias or another activation: NYI in the fused op; only silu(gate) * up)")
    for g in downs:
        extra = _ops_between(g.node, combine[0][0])
        if extra:
            raise _Skip(f"{', '.join(sorted(extra))} between the down GEMM {g.node.name} and the combine (an expert "
                        "bias or output norm: NYI in the fused op)")
    weights = _routing_weights(combine[0][1], topk, t, t_shape[1])
    routed = moe_analysis._routed_output(combine[0][0])
    r_shape = shape_of(routed)
    if r_shape is None or int(torch.Size(r_shape).numel()) != t * dm:
        raise _Skip(f"the routed output {routed.name} has shape {r_shape}, expected T*Dm = {t * dm} elements")
    if r_shape != _shape(x) and _symbolic(routed):
        raise _Skip(f"the routed output {routed.name} has another shape than the router input and dynamic sizes "
                    "(a symbolic reshape is NYI); compile with dynamic=False")
    return _Rewrite(x, ids, weights, gate, up, down, routed, i)


def _ops_between(start: fx.Node, end: fx.Node) -> set[str]:
    """Names of the compute ops (not views, gathers or masks) on the paths from ``start`` forward to ``end``, and of
    in-place ops that modify a tensor on those paths (``out.add_(bias)`` is not on the data path, but changes it)."""
    allowed = _VIEWS | {"getitem", "masked_fill", "index", "index_select"}
    path = {start} | {n for n in _descendants(start, 12) if n is not end and end in _descendants(n, 12)}
    found = {op_name(n) for n in path if n is not start and op_name(n) not in allowed}
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
            raise _Skip(f"fused gate/up weight {w.name} is {_shape(w)}, expected (E, 2I, Dm) = {(e, 2 * i, dm)}")
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
                raise _Skip(f"gate/up weight {w.name} is {_shape(w)}, expected (E, I, Dm) = {(e, i, dm)}")
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
    gathers = [k for k, m in enumerate(path) if _is_gather(m)]
    above = path[gathers[-1] + 1:] if gathers else path
    for m in above:
        if _shape(m) == (t, a):
            return m
    raise _Skip(f"the routing weights multiplied into the expert outputs ({operand.name}) do not come from a "
                f"(T, A) = {(t, a)} tensor through views and gathers")


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
                val = node.target(*args)
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
