"""Read-only helpers over a Dynamo FX graph: canonical op names, shapes, layer indices, a networkx view.

The Dynamo graph is torch level: the same operation can appear as a function (``torch.topk``), a method
(``x.topk``), an operator (``operator.mul``) or, after AOTAutograd, an ATen overload (``aten.topk.default``).
:func:`op_name` maps all of them onto one lowercase name, so detectors match by structure, never by module
class names. Nothing here mutates a graph.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import networkx as nx
import torch
import torch.fx as fx

from .sites import UnsupportedSite

# Names that mean the same operation, folded onto one canonical name.
_ALIASES = {
    "scaled_dot_product_attention": "sdpa",
    "_scaled_dot_product_flash_attention_for_cpu": "sdpa",
    "_scaled_dot_product_efficient_attention": "sdpa",
    "_scaled_dot_product_flash_attention": "sdpa",
    "_scaled_dot_product_cudnn_attention": "sdpa",
    "truediv": "div",
    "itruediv": "div",
    "imul": "mul",
    "iadd": "add",
    "isub": "sub",
    "floordiv": "floordiv",
    "matmul": "matmul",
    "bmm": "matmul",
    "mm": "matmul",
    "_softmax": "softmax",
    "softmax": "softmax",
    "negative": "neg",
    "concat": "cat",
    "concatenate": "cat",
    "_grouped_mm": "grouped_mm",
}

#: Ops that only change the view, dtype or layout of a tensor (walked through when following data flow).
VIEW_LIKE = frozenset(
    {
        "view", "reshape", "_unsafe_view", "transpose", "permute", "contiguous", "to", "float", "half",
        "bfloat16", "type_as", "unsqueeze", "squeeze", "flatten", "unflatten", "clone", "expand",
        "_to_copy", "t", "alias", "detach",
    }
)


#: Ops that synchronise with the host inside, so a CUDA graph cannot capture them: op name (as :func:`op_name`
#: gives it) -> what does it and how to avoid it. transformers' fp32 expert path (``grouped_mm_fallback``, used
#: when ``torch._grouped_mm`` cannot run: non-bf16 weights under torch.compile) loops over ``offs.tolist()``.
CAPTURE_UNSAFE_OPS = {
    "transformers::grouped_mm_fallback": (
        "transformers' grouped_mm fallback for non-bf16 experts, which reads its group offsets on the host "
        "(offs.tolist())",
        "run the model in bfloat16 (transformers then calls torch._grouped_mm), or leave enable_expert_gemm at 'auto' "
        "(the default) or True and call the model without gradients (ckvp's device-side expert GEMM replaces it)",
    ),
}


def capture_unsafe_calls(graph: fx.Graph) -> dict[str, int]:
    """Op name -> number of calls in ``graph`` of each op in :data:`CAPTURE_UNSAFE_OPS` (empty: none)."""
    found: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_function":
            name = op_name(node)
            if name in CAPTURE_UNSAFE_OPS:
                found[name] = found.get(name, 0) + 1
    return found


def op_name(node: fx.Node) -> str:
    """Return a canonical lowercase name of what ``node`` computes.

    'placeholder' / 'output' / 'get_attr' for those ops; for calls, the function, method or ATen op name
    with aliases folded (``scaled_dot_product_attention`` -> 'sdpa', ``operator.truediv`` -> 'div',
    ``aten.bmm`` -> 'matmul'); a custom op keeps its namespace (``transformers::grouped_mm_fallback``).
    """
    if node.op in ("placeholder", "output", "get_attr"):
        return node.op
    if node.op == "call_module":
        return f"module:{node.target}"
    target = node.target
    if node.op == "call_method":
        name = str(target)
    elif isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        base = target._schema.name.split("::")[-1]
        name = base if ns in ("aten", "prims") else f"{ns}::{base}"
    elif isinstance(target, torch._ops.OpOverloadPacket):
        ns = target._qualified_op_name.split("::")[0]
        base = target._qualified_op_name.split("::")[-1]
        name = base if ns in ("aten", "prims") else f"{ns}::{base}"
    elif target is operator.getitem:
        name = "getitem"
    elif target is operator.setitem:
        name = "setitem"
    else:
        name = getattr(target, "__name__", None) or str(target)
        qual = getattr(target, "_qualified_op_name", None)
        if qual:
            name = qual if not qual.startswith("aten::") else qual.split("::")[-1]
    return _ALIASES.get(name, name)


def is_op(node: Any, *names: str) -> bool:
    """True when ``node`` is an FX node whose :func:`op_name` is one of ``names``."""
    return isinstance(node, fx.Node) and op_name(node) in names


def example_value(node: Any) -> Any:
    """Return the fake tensor (or value) Dynamo or AOT recorded for ``node``, or None."""
    if not isinstance(node, fx.Node):
        return None
    meta = node.meta
    if "example_value" in meta:
        return meta["example_value"]
    return meta.get("val")


def shape_of(node: Any) -> tuple[int, ...] | None:
    """Return the concrete shape of ``node``'s tensor; symbolic sizes become their hint (or -1)."""
    val = example_value(node)
    if isinstance(val, torch.Tensor):
        return tuple(_as_int(s) for s in val.shape)
    return None


def dtype_of(node: Any) -> torch.dtype | None:
    """Return the dtype of ``node``'s tensor, or None."""
    val = example_value(node)
    return val.dtype if isinstance(val, torch.Tensor) else None


def _as_int(size: Any) -> int:
    if isinstance(size, int):
        return size
    try:
        return int(size.node.hint) if size.node.hint is not None else -1
    except AttributeError:
        try:
            return int(size)
        except Exception:  # an unbacked symbol
            return -1


def placeholder_source(node: fx.Node) -> str | None:
    """Return the Dynamo source name of a placeholder (``L['self'].model.layers[0].mlp.gate.weight``)."""
    if node.op != "placeholder":
        return None
    grapharg = node.meta.get("grapharg")
    if grapharg is not None and getattr(grapharg, "source", None) is not None:
        return grapharg.source.name() if callable(grapharg.source.name) else str(grapharg.source.name)
    return node.target if isinstance(node.target, str) else None


def placeholder_attr_path(node: fx.Node) -> str | None:
    """Return the dotted attribute path, below the compiled function's root local, of the module parameter or buffer
    a Dynamo placeholder stands for: ``model.layers.0.self_attn.k_proj.weight`` for the source
    ``L['self']._modules['model']...._parameters['weight']`` (:func:`placeholder_source`); None for a node without
    a source or one that is not an attribute of a root local (``L['x']``, a global)."""
    source = placeholder_source(node)
    if not source or not source.startswith("L["):
        return None
    path = _normalise_path(re.sub(r"^L\[['\"][^'\"]+['\"]\]", "", source))
    parts = [p for p in path.split(".") if p and p not in ("_modules", "_parameters", "_buffers")]
    return ".".join(parts) or None


def module_path(node: fx.Node) -> str:
    """Return the innermost module path from ``nn_module_stack`` (``model.layers.3.self_attn``), or ''.

    Dynamo writes paths as ``L['self'].model.layers.3.self_attn`` (or ``L['self'].layers[3]``); the
    ``L['self']`` root and index brackets are normalised away.
    """
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return _normalise_path(str(path))


def _normalise_path(path: str) -> str:
    path = re.sub(r"^L\[['\"]self['\"]\]\.?", "", path)
    path = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path)
    path = re.sub(r"^_orig_mod\.", "", path)
    return path.strip(".")


def layer_prefix(path: str) -> str | None:
    """Return the layer identity of a module path: its prefix up to and including the LAST integer component.

    ``model.layers.3.self_attn`` -> ``'model.layers.3'``; ``stages.1.layers.0.attn`` -> ``'stages.1.layers.0'``;
    ``G.models.1.layers.0.attention`` -> ``'G.models.1.layers.0'``; a path without an integer component
    (``lm_head``, ``blocks.b0.attn``, ``''``) -> None.
    """
    parts = path.split(".") if path else []
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].isdigit():
            return ".".join(parts[: i + 1])
    return None


def node_layer_prefix(node: fx.Node) -> str | None:
    """Return :func:`layer_prefix` of ``node``'s module path (for a placeholder, of its Dynamo source name)."""
    path = module_path(node)
    if not path and node.op == "placeholder":
        path = _normalise_path(placeholder_source(node) or "")
    return layer_prefix(path)


def layer_index(node: fx.Node) -> int | None:
    """Return the integer that ends ``node``'s layer prefix (:func:`node_layer_prefix`), or None.

    ``model.layers.3.self_attn.k_proj`` -> 3; ``layers.0.attention`` -> 0; a node outside any numbered
    module (embedding, final norm) -> None. This is the raw number of one node; the ``layer`` of a site
    comes from :func:`assign_layer_indices`, which also handles nested paths (``stages.1.layers.0``).
    """
    prefix = node_layer_prefix(node)
    return int(prefix.rsplit(".", 1)[-1]) if prefix is not None else None


def _stem(prefix: str) -> str:
    return prefix.rsplit(".", 1)[0] if "." in prefix else ""


def assign_layer_indices(items: Sequence[tuple[int, str | None, str]]) -> list[int]:
    """Number the layers of a graph's findings, from their layer prefixes (:func:`layer_prefix`).

    Args:
        items: one ``(position, prefix, kind)`` per finding: its position in the graph (node order), its layer
            prefix (``'model.layers.3'``, None when its module path has no integer component) and its kind
            (``'attention'``, ``'moe'``).
    Returns:
        One layer index per item, in the order given:

        * when every prefix shares one stem (``model.layers.<i>``), the index is that integer ``i``;
        * otherwise (nested stages ``stages.<s>.layers.<j>``, several models ``models.<m>.layers.<j>``) the
          distinct prefixes are numbered 0, 1, ... in graph order (by their first position);
        * items without a prefix are numbered per kind in graph order with the integers not already used:
          the k-th such attention and the k-th such MoE get the same index.

        Items of the same prefix (a layer's attention and its MoE) always get the same index.
    """
    prefixes = {p for _, p, _ in items if p is not None}
    if len({_stem(p) for p in prefixes}) == 1:
        index_of = {p: int(p.rsplit(".", 1)[-1]) for p in prefixes}
    else:
        first: dict[str, int] = {}
        for pos, p, _ in items:
            if p is not None:
                first[p] = min(pos, first.get(p, pos))
        index_of = {p: i for i, p in enumerate(sorted(first, key=lambda q: (first[q], q)))}
    used = set(index_of.values())
    free: list[int] = []
    next_of_kind: dict[str, int] = {}
    out: list[int | None] = [index_of[p] if p is not None else None for _, p, _ in items]
    for i in sorted((i for i, (_, p, _) in enumerate(items) if p is None), key=lambda i: items[i][0]):
        k = next_of_kind.get(items[i][2], 0)
        next_of_kind[items[i][2]] = k + 1
        while len(free) <= k:
            candidate = free[-1] + 1 if free else 0
            while candidate in used:
                candidate += 1
            free.append(candidate)
        out[i] = free[k]
    return out  # type: ignore[return-value]


@dataclass
class LayerFinding:
    """What one detector found at one place in the graph, before layer numbering.

    Attributes:
        position: graph position (node order) of the finding's anchor node (the attention op, the router).
        prefix: the layer prefix of its module path (:func:`layer_prefix`), None when not numbered.
        kind: 'attention' or 'moe'.
        items: the sites and unsupported patterns found there (frozen dataclasses with a ``layer`` field).
    """

    position: int
    prefix: str | None
    kind: str
    items: list[Any] = field(default_factory=list)


def number_findings(findings: Sequence[LayerFinding]) -> list[list[Any]]:
    """Give every item of ``findings`` its layer index (:func:`assign_layer_indices`); aligned with ``findings``.

    A finding without a layer prefix that holds only unsupported patterns (no site) is not attributable to a
    layer: its items get ``layer=None`` and it takes no number from the sites.
    """
    numbered = [f for f in findings if f.prefix is not None or not all(isinstance(x, UnsupportedSite) for x in f.items)]
    index_of = dict(zip(map(id, numbered), assign_layer_indices([(f.position, f.prefix, f.kind) for f in numbered])))
    return [[dataclasses.replace(x, layer=index_of.get(id(f))) for x in f.items] for f in findings]


def has_numbered_layers(graph: fx.Graph) -> bool:
    """True when some call in ``graph`` runs inside a module path with an integer component (``layers.3``)."""
    return any(n.op.startswith("call_") and node_layer_prefix(n) is not None for n in graph.nodes)


def positions(graph: fx.Graph) -> dict[fx.Node, int]:
    """Map node -> its position in ``graph`` (node order)."""
    return {n: i for i, n in enumerate(graph.nodes)}


def node_map(graph: fx.Graph) -> dict[str, fx.Node]:
    """Map node name -> node for ``graph``."""
    return {n.name: n for n in graph.nodes}


def to_networkx(graph: fx.Graph) -> nx.DiGraph:
    """Return a networkx DiGraph of data flow: node names as vertices, an edge from each input to its user.

    Vertex attributes: ``op`` (:func:`op_name`), ``layer`` (:func:`layer_index`), ``shape``.
    """
    g = nx.DiGraph()
    for n in graph.nodes:
        g.add_node(n.name, op=op_name(n), layer=layer_index(n), shape=shape_of(n))
        for inp in n.all_input_nodes:
            g.add_edge(inp.name, n.name)
    return g


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """Return the node's FX-node arguments (positional then keyword), in order, flattening lists."""
    out: list[fx.Node] = []

    def visit(a: Any) -> None:
        if isinstance(a, fx.Node):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
        elif isinstance(a, dict):
            for x in a.values():
                visit(x)

    visit(node.args)
    visit(node.kwargs)
    return out


def arg(node: fx.Node, index: int, name: str | None = None, default: Any = None) -> Any:
    """Return argument ``index`` of a call, or keyword ``name``; ``default`` when absent.

    For call_method nodes index 0 is ``self``.
    """
    if index < len(node.args):
        return node.args[index]
    if name is not None and name in node.kwargs:
        return node.kwargs[name]
    return default


def strip_views(node: Any, extra: Iterable[str] = ()) -> Any:
    """Walk back from ``node`` through view / dtype / layout ops (``VIEW_LIKE`` plus ``extra``)."""
    skip = VIEW_LIKE | frozenset(extra)
    while isinstance(node, fx.Node) and op_name(node) in skip and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def users_through_views(
    node: fx.Node,
    extra: Iterable[str] = (),
    users: Callable[[fx.Node], Iterable[fx.Node]] = lambda n: n.users,
) -> Iterator[fx.Node]:
    """Yield the first non-view users of ``node``, looking through ``VIEW_LIKE`` ops (plus ``extra``), depth first.

    ``users`` chooses which users of a node count (default: all of them).
    """
    skip = VIEW_LIKE | frozenset(extra)
    seen: set[fx.Node] = set()
    stack = list(users(node))
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if op_name(u) in skip:
            stack.extend(users(u))
        else:
            yield u


def _nearest(start: Iterable[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]], pred: Callable[[fx.Node], bool],
             max_depth: int, through: Callable[[fx.Node], bool] | None) -> fx.Node | None:
    """Breadth-first search from ``start`` along ``step`` (inputs or users) for the nearest node satisfying
    ``pred``, walking on only through nodes ``through`` accepts (all when None), at most ``max_depth`` hops."""
    frontier = list(start)
    seen: set[fx.Node] = set(frontier)
    for _ in range(max_depth):
        nxt: list[fx.Node] = []
        for n in frontier:
            if pred(n):
                return n
            if through is None or through(n):
                for m in step(n):
                    if m not in seen:
                        seen.add(m)
                        nxt.append(m)
        if not nxt:
            return None
        frontier = nxt
    return None


def find_upstream(
    node: fx.Node, pred: Callable[[fx.Node], bool], max_depth: int = 32, through: Callable[[fx.Node], bool] | None = None
) -> fx.Node | None:
    """Breadth-first search over the inputs of ``node`` for the nearest node satisfying ``pred``.

    Args:
        node: start node (not tested itself).
        pred: the test.
        max_depth: how many producer hops to search.
        through: when given, only nodes for which it is True are walked through.
    Returns:
        The nearest matching node, or None.
    """
    return _nearest(node.all_input_nodes, lambda n: n.all_input_nodes, pred, max_depth, through)


def find_downstream(
    node: fx.Node, pred: Callable[[fx.Node], bool], max_depth: int = 32, through: Callable[[fx.Node], bool] | None = None
) -> fx.Node | None:
    """Breadth-first search over the users of ``node`` for the nearest node satisfying ``pred`` (arguments and
    result as :func:`find_upstream`)."""
    return _nearest(node.users, lambda n: n.users, pred, max_depth, through)


def ancestors(node: fx.Node, max_depth: int = 10_000) -> set[fx.Node]:
    """Return every node ``node`` depends on, up to ``max_depth`` hops."""
    out: set[fx.Node] = set()
    frontier = list(node.all_input_nodes)
    depth = 0
    while frontier and depth < max_depth:
        nxt = []
        for n in frontier:
            if n not in out:
                out.add(n)
                nxt.extend(n.all_input_nodes)
        frontier = nxt
        depth += 1
    return out
