"""Find the rotary position embedding (RoPE) that produced a query or key, by graph structure.

Given the node a RoPE computation ends in (the rotated key that is written into the cache or fed to the
attention), walk back through the small set of ops RoPE is written with and classify it:

================  ===================================================================================
form              how it is written (all detected in any operand order, with dtype casts in between)
================  ===================================================================================
``rotate_half``   HF / Llama: ``x*cos + cat(-x[..., D/2:], x[..., :D/2])*sin``; also written out as
                  ``cat(x1*cos - x2*sin, x2*cos + x1*sin)`` with ``x1, x2`` the two halves
``interleaved``   GPT-J / gpt-fast real form: pairs (x0, x1), (x2, x3)... rotated, through
                  ``x[..., ::2]`` / ``x[..., 1::2]`` (e.g. ``stack(-x_odd, x_even).flatten(-2)``), or
                  ``x.reshape(..., D/2, 2)`` then ``[..., 0]`` / ``[..., 1]`` or ``unbind(-1)``
``complex``       Meta / gpt-fast: ``view_as_real(view_as_complex(x.reshape(..., D/2, 2)) * freqs_cis)``
================  ===================================================================================

Partial rotary (Phi, GLM, Qwen3-Next): only the first ``rotary_dim`` channels are rotated, the rest pass
through, ``cat(rope(x[..., :rd]), x[..., rd:])`` (or through ``split([rd, D - rd], -1)``); then
``k_in`` is the whole ``x`` and ``partial`` is True.

A rotation is recognised by its sign: one of the two selections of the rotated tensor enters the output with a
minus sign (an odd number of ``neg``, ``sub`` subtrahends and multiplies by -1 on its way). :func:`rope_residue`
then checks that the output is exactly that rotation of the pre-RoPE tensor (what a latent cache rebuilds), by
structure and by running the region on random inputs; :func:`cached_key_layout` checks the views and casts from there
to the tensor written to the cache, and reads its layout. Every function here is read-only and returns None when it
does not recognise the pattern; none raises on unknown graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from .graph import VIEW_LIKE, arg, dtype_of, find_upstream, op_name, placeholder_source, shape_of, strip_views

#: Ops a RoPE computation is written with (walked through when collecting its region).
_ROPE_OPS = frozenset(
    {
        "mul", "add", "sub", "neg", "cat", "stack", "getitem", "flatten", "reshape", "view", "float", "to",
        "type_as", "half", "bfloat16", "unsqueeze", "squeeze", "view_as_complex", "view_as_real",
        "unflatten", "unbind", "split", "chunk", "contiguous", "clone", "_to_copy", "expand", "select",
    }
)
#: Ops that change only dtype or memory layout, never values' positions.
_DTYPE_OPS = frozenset({"float", "to", "type_as", "half", "bfloat16", "contiguous", "clone", "_to_copy", "alias"})
#: Ops that carry the negated half of a rotation on to the sine multiply.
_ROT_CARRIERS = frozenset({"neg", "cat", "stack", "flatten", "reshape", "view"}) | _DTYPE_OPS
#: How many producer hops a RoPE region may span.
_MAX_REGION_DEPTH = 16


@dataclass(frozen=True)
class RopeMatch:
    """What :func:`match_rope` found (nodes, not names; :class:`~.sites.RopeSite` holds the names).

    Attributes:
        form: 'rotate_half', 'interleaved' or 'complex'.
        rotary_dim: channels rotated; partial: rotary_dim < head dim of ``k_in``.
        out: the last RoPE node (the node :func:`match_rope` was given, views stripped).
        x_in: the tensor entering RoPE (the whole head when partial); for a key this is the pre-RoPE key.
        cos: the cosine table (or complex frequencies), None if not identified. sin: the sine table or None.
    """

    form: str
    rotary_dim: int
    partial: bool
    out: fx.Node
    x_in: fx.Node
    cos: fx.Node | None
    sin: fx.Node | None


def strip_dtype(node: Any) -> Any:
    """Walk back from ``node`` through dtype / layout-only ops (``float``, ``to``, ``type_as``, ``contiguous``)."""
    while isinstance(node, fx.Node) and op_name(node) in _DTYPE_OPS and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def last_dim_selection(node: fx.Node) -> tuple[fx.Node, int, int, int, bool] | None:
    """Describe ``node`` as a selection along the last dim of another tensor, or return None.

    Recognises ``x[..., a:b:c]``, ``x[:, :, :, a:b:c]`` (all other dims full), ``x[..., i]``, and
    ``getitem(split(x, sizes, -1), i)`` / ``chunk(x, n, -1)`` / ``unbind(x, -1)``.

    Returns:
        ``(x, start, stop, step, squeezed)`` with non-negative ``start``/``stop`` resolved against
        ``x.shape[-1]``; ``squeezed`` is True for an integer index (the last dim disappears).
    """
    if op_name(node) != "getitem" or len(node.args) < 2:
        return None
    base, idx = node.args[0], node.args[1]
    if not isinstance(base, fx.Node):
        return None
    if op_name(base) in ("split", "chunk", "unbind", "split_with_sizes") and isinstance(idx, int):
        return _split_selection(base, idx)
    shape = shape_of(base)
    if shape is None or not shape:
        return None
    if not isinstance(idx, tuple):
        idx = (idx,)
    if any(isinstance(i, fx.Node) or i is None for i in idx):
        return None
    if idx and idx[0] is Ellipsis:
        if len(idx) != 2:
            return None
        sel = idx[1]
    else:
        if len(idx) != len(shape) or any(i != slice(None) for i in idx[:-1]):
            return None
        sel = idx[-1]
    size = shape[-1]
    if isinstance(sel, int):
        i = sel + size if sel < 0 else sel
        return base, i, i + 1, 1, True
    if isinstance(sel, slice) and all(isinstance(v, (int, type(None))) for v in (sel.start, sel.stop, sel.step)):
        start, stop, step = sel.indices(size) if size > 0 else (sel.start or 0, sel.stop or 0, sel.step or 1)
        return base, start, stop, step, False
    return None


def _split_selection(split: fx.Node, i: int) -> tuple[fx.Node, int, int, int, bool] | None:
    x = split.args[0] if split.args else None
    shape = shape_of(x)
    if not isinstance(x, fx.Node) or not shape:
        return None
    kind = op_name(split)
    dim = arg(split, 2, "dim", 0) if kind != "unbind" else arg(split, 1, "dim", 0)
    if not isinstance(dim, int) or dim not in (-1, len(shape) - 1):
        return None
    size = shape[-1]
    if kind == "unbind":
        return x, i, i + 1, 1, True
    spec = arg(split, 1, "split_size_or_sections" if kind == "split" else "chunks", None)
    if kind == "chunk" and isinstance(spec, int) and spec > 0:
        sizes = [-(-size // spec)] * spec
    elif isinstance(spec, int) and spec > 0:
        sizes = [spec] * (-(-size // spec))
    elif isinstance(spec, (list, tuple)) and all(isinstance(s, int) for s in spec):
        sizes = list(spec)
    else:
        return None
    if i >= len(sizes):
        return None
    start = sum(sizes[:i])
    return x, start, min(start + sizes[i], size), 1, False


def _region(top: fx.Node) -> list[fx.Node]:
    """Nodes reachable backwards from ``top`` through RoPE ops (``top`` first, then breadth first)."""
    out: list[fx.Node] = []
    seen: set[fx.Node] = set()
    frontier = [top]
    for _ in range(_MAX_REGION_DEPTH):
        nxt: list[fx.Node] = []
        for n in frontier:
            if n in seen or op_name(n) not in _ROPE_OPS:
                continue
            seen.add(n)
            out.append(n)
            nxt.extend(n.all_input_nodes)
        if not nxt:
            break
        frontier = nxt
    return out


#: Ops that carry a whole term on, with its sign (walked by :func:`_is_negated`; a selection picks a part instead).
_SIGN_CARRIERS = _DTYPE_OPS | frozenset({"mul", "neg", "add", "sub", "cat", "stack", "flatten", "view", "reshape",
                                         "unsqueeze", "squeeze", "unflatten", "expand"})


def _is_negated(sel: fx.Node, region: set[fx.Node]) -> bool:
    """True when a term of ``sel`` leaves the sign-carrying ops of ``region`` (at the region's output, or at a
    selection or other op) with a minus sign: along some path of users in ``region`` through
    :data:`_SIGN_CARRIERS`, an odd number of ``neg``, subtrahends of ``sub`` and multiplies by the scalar -1.

    Counting the signs (not stopping at the first one) keeps the rotated half right when a sign is written around
    the subtraction: in ``-(x2*s - x1*c)`` it is ``x2`` that is negated, not ``x1`` (the tables :func:`_tables`
    reads off the negated half would swap).
    """
    seen: set[tuple[fx.Node, int]] = set()
    stack = [(sel, 1)]
    while stack:
        n, sign = stack.pop()
        if (n, sign) in seen:
            continue
        seen.add((n, sign))
        users = [u for u in n.users if u in region]
        if sign < 0 and (not users or any(op_name(u) not in _SIGN_CARRIERS for u in users)):
            return True
        for u in users:
            kind = op_name(u)
            if kind not in _SIGN_CARRIERS:
                continue
            flip = kind == "neg" or (kind == "sub" and len(u.args) > 1 and u.args[1] is n and u.args[0] is not n) \
                or (kind == "mul" and any(a in (-1, -1.0) for a in u.args if not isinstance(a, fx.Node)))
            stack.append((u, -sign if flip else sign))
    return False


def _other_operand(mul: fx.Node, node: fx.Node) -> fx.Node | None:
    a, b = (mul.args + (None, None))[:2]
    other = b if a is node else a if b is node else None
    return other if isinstance(other, fx.Node) else None


def _tables(x: fx.Node, negated: fx.Node, region: list[fx.Node]) -> tuple[fx.Node | None, fx.Node | None]:
    """Best-effort cos / sin tables.

    cos: the other operand of the first multiply (graph order) of ``x`` or of a non-negated selection of
    ``x``; sin: the other operand of the first multiply of the negated selection (or of what it becomes
    through ``neg`` / ``cat`` / ``stack``).
    """
    rot = {negated}
    for n in sorted(region):
        if op_name(n) in _ROT_CARRIERS and any(
            i in rot for i in n.all_input_nodes
        ):
            rot.add(n)
    cos = sin = None
    for n in sorted(region):
        if op_name(n) != "mul":
            continue
        for operand in n.all_input_nodes:
            if sin is None and operand in rot:
                sin = _other_operand(n, operand)
                break
            sel = last_dim_selection(operand)
            plain = strip_dtype(operand) is x or (sel is not None and strip_dtype(sel[0]) is x)
            if cos is None and plain and operand not in rot:
                cos = _other_operand(n, operand)
                break
    return cos, sin


def _pairs_base(node: fx.Node) -> fx.Node | None:
    """If ``node`` is ``x.reshape(..., D/2, 2)`` (through dtype ops), return ``x``."""
    shape = shape_of(node)
    n = strip_dtype(node)
    if shape is None or len(shape) < 2 or shape[-1] != 2:
        return None
    if op_name(n) in ("reshape", "view", "unflatten") and isinstance(n.args[0], fx.Node):
        src = n.args[0]
        src_shape = shape_of(src)
        if src_shape and src_shape[-1] == 2 * shape[-2]:
            return strip_dtype(src)
    return None


@dataclass(frozen=True)
class RowScale:
    """A rotated key multiplied, after RoPE, by a factor constant along the head dim (:func:`match_row_scale`).

    RoPE is linear, so ``RoPE(k) * s == RoPE(k * s)`` for any ``s`` that is constant along the rotated (last) dim:
    a latent of the scaled pre-RoPE key ``k * s`` rebuilds the scaled rotated key exactly. The case in practice is
    a weightless RMS / L2 norm after RoPE, ``s = rsqrt(mean(RoPE(k)**2, -1, keepdim=True) + eps)`` (Llama-4's
    ``qk_norm``, ``Llama4TextL2Norm``). A norm with a weight (HunYuan-MoE's ``key_layernorm``) scales each channel
    differently and is not a row scale.

    Attributes:
        mul: the multiply, e.g. ``x.float() * rsqrt(...)``; (..., D).
        rotated: its operand carrying the rotated key (views / casts of RoPE's output); (..., D).
        scale: its other operand, the factor; (..., 1), broadcasting against ``rotated`` along the last dim only.
    """

    mul: fx.Node
    rotated: fx.Node
    scale: fx.Node


def match_row_scale(node: fx.Node) -> RowScale | None:
    """``node`` as a rotated key times a factor constant along its last dim, or None.

    Args:
        node: the tensor written to the cache with its views and dtype casts stripped, (..., D).
    Returns:
        A :class:`RowScale` when ``node`` is a ``mul`` of two tensors, one shaped (..., 1) (broadcasting against the
        other, of last dim D > 1) and the other carrying a rotation (:func:`match_rope` finds one in it); else None.
        Never raises. Source: RoFormer (arXiv:2104.09864), RoPE as a linear map per position.
    """
    try:
        if op_name(node) != "mul" or len(node.args) != 2 or node.kwargs:
            return None
        a, b = node.args
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            return None
        for rot, scale in ((a, b), (b, a)):
            rs, ss = shape_of(rot), shape_of(scale)
            if not rs or not ss or len(ss) > len(rs) or ss[-1] != 1 or rs[-1] <= 1:
                continue
            if any(x not in (1, y) for x, y in zip(reversed(ss), reversed(rs))):
                continue
            if match_rope(strip_views(rot)) is not None:
                return RowScale(node, rot, scale)
    except Exception:  # analysis never raises on unknown patterns
        return None
    return None


def match_rope(out: fx.Node) -> RopeMatch | None:
    """Classify the RoPE that ends in ``out`` (a rotated query or key), or return None when there is none.

    Args:
        out: the rotated tensor, views already stripped (e.g. HF ``k_embed``; gpt-fast's ``stack`` /
            ``view_as_real``; a ``cat`` for partial rotary). Typically (B, Hkv, S, D) or (B, S, Hkv, D).
    Returns:
        A :class:`RopeMatch`: form, rotary_dim, partial, the pre-RoPE tensor ``x_in`` and the tables;
        None when no rotation pattern is found (e.g. a NoPE layer). Never raises.
    """
    try:
        return _match_rope(out)
    except Exception:  # analysis never raises on unknown patterns
        return None


def _match_rope(out: fx.Node) -> RopeMatch | None:
    region = _region(out)
    region_set = set(region)
    form: str | None = None
    x: fx.Node | None = None
    cos = sin = None
    for n in region:
        if op_name(n) == "view_as_complex" and isinstance(n.args[0], fx.Node):
            x = _pairs_base(n.args[0])
            if x is None:
                continue
            form = "complex"
            for u in n.users:
                if op_name(u) == "mul" and u in region_set:
                    cos = _other_operand(u, n)
                    break
            break
    if form is None:
        for n in region:
            sel = last_dim_selection(n)
            if sel is None or not _is_negated(n, region_set):
                continue
            base, start, stop, step, squeezed = sel
            base_shape = shape_of(base)
            if base_shape is None:
                continue
            size = base_shape[-1]
            if step == 2 and stop - start >= 1:
                form, x = "interleaved", strip_dtype(base)
            elif squeezed and size == 2:
                pairs = _pairs_base(base)
                if pairs is None:
                    continue
                form, x = "interleaved", pairs
            elif step == 1 and not squeezed and size % 2 == 0 and {start, stop} <= {0, size // 2, size}:
                form, x = "rotate_half", strip_dtype(base)
            else:
                continue
            cos, sin = _tables(strip_dtype(base), n, region)
            break
    if form is None or x is None:
        return None
    x_shape = shape_of(x)
    if not x_shape:
        return None
    rotary_dim = x_shape[-1]
    x_in, partial = x, False
    whole = _partial_source(x, out)
    if whole is not None:
        x_in, partial = whole, True
    return RopeMatch(form, rotary_dim, partial, out, x_in, cos, sin)


#: Ops a table operand may pass through between the table and its multiply (shape, dtype and selection only).
_TABLE_VIEW_OPS = _DTYPE_OPS | frozenset({"getitem", "unsqueeze", "squeeze", "expand", "view", "reshape", "flatten",
                                          "unflatten", "select", "chunk", "split", "unbind", "detach"})


def _table_root(node: fx.Node) -> fx.Node:
    """``node`` with shape, dtype and selection ops stripped (the table it views)."""
    for _ in range(_MAX_REGION_DEPTH):
        if op_name(node) not in _TABLE_VIEW_OPS or not node.args or not isinstance(node.args[0], fx.Node):
            break
        node = node.args[0]
    return node


def table_key(node: fx.Node | None, by_value: bool = False, _memo: dict[fx.Node, Any] | None = None,
              _depth: int = 0) -> Any:
    """A hashable description of how a RoPE table node is computed: the node itself for a graph input, a constant or
    anything past ``_MAX_PAIR_DEPTH`` producer hops; else its op, target and arguments, each node argument described
    the same way. Two tables of one graph with equal keys hold the same values: every layer's own
    ``cos[..., :rd // 2].repeat_interleave(2, -1)`` of HF's shared cos (GLM, GPT-J), or its ``cos.unsqueeze(1)``,
    while tables computed apart (a per-layer theta) differ.

    With ``by_value``, a graph input that is a module buffer or parameter whose value Dynamo recorded
    (``meta['grapharg'].example``, a real tensor of at most ``_TABLE_VALUE_ELEMENTS`` elements) is described by its
    dtype, shape and bytes instead: per-layer copies of one table (a rotary module per layer) then compare equal.
    Buffers hold the same values at every call unless the model rewrites them. None for None; never raises (the
    node itself when its arguments cannot be described)."""
    if node is None:
        return None
    memo: dict[fx.Node, Any] = {} if _memo is None else _memo
    if node in memo:
        return memo[node]
    key: Any = node
    if node.op == "placeholder" and by_value:
        key = _buffer_value_key(node)
    elif node.op in ("call_function", "call_method") and _depth < _MAX_PAIR_DEPTH and not _impure(node):
        try:
            args = fx.node.map_aggregate((node.args, dict(node.kwargs)), lambda a: (
                _SubKey(table_key(a, by_value, memo, _depth + 1)) if isinstance(a, fx.Node) else a))
            key = (node.op, node.target, _freeze(args))
            hash(key)
        except Exception:  # analysis never raises on unknown patterns
            key = node
    memo[node] = key
    return key


class _SubKey:
    """An argument's :func:`table_key` inside its user's key, as it is: hashed once and not frozen again. (Frozen again
    at every level, a key grew by a factor of about 2.6 per producer hop: 16 hops of Qwen3-VL's multimodal RoPE
    tables took 30 s per graph to describe.)"""

    __slots__ = ("key", "_hash")

    def __init__(self, key: Any) -> None:
        self.key = key
        self._hash = hash(key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, _SubKey) and self._hash == other._hash and self.key == other.key)

    def __repr__(self) -> str:
        return repr(self.key)


#: Largest module buffer :func:`table_key` compares by value (elements).
_TABLE_VALUE_ELEMENTS = 1 << 24


def _buffer_value_key(node: fx.Node) -> Any:
    """``('value', dtype, shape, digest)`` of a placeholder that is a module buffer or parameter with a recorded real
    value (see :func:`table_key`), else the node itself."""
    try:
        grapharg = node.meta.get("grapharg")
        name = grapharg.source.name  # a property (a method in older torch)
        source = name() if callable(name) else str(name)
        value = grapharg.example
        if ("._buffers[" not in source and "._parameters[" not in source) or type(value) not in (
                torch.Tensor, torch.nn.Parameter) or value.numel() > _TABLE_VALUE_ELEMENTS:
            return node
        import hashlib

        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return "value", str(value.dtype), tuple(value.shape), hashlib.sha1(data).hexdigest()
    except Exception:  # no recorded value (a fake, a user input, an older Dynamo): the node itself
        return node


def _impure(node: fx.Node) -> bool:
    """Random ops, and ops that write in place: equal arguments do not give equal values."""
    name = op_name(node)
    return name.startswith(("rand", "normal", "bernoulli", "dropout", "multinomial")) or (
        name.endswith("_") and not name.endswith("__")) or name == "setitem"


def rope_residue(m: RopeMatch) -> str | None:
    """Why ``m.out`` is not exactly the rotation of ``m.x_in``, or None when it is.

    The region :func:`match_rope` walks also takes in multiplies and adds applied after the rotation (a key
    scaled, normalised or offset after RoPE, e.g. HunYuan-MoE's ``key_layernorm``). A latent cache of the pre-RoPE
    key that rebuilds ``RoPE(x_in)`` would then drop them. Two checks, on the nodes between ``x_in`` (the pre-RoPE
    key, (..., D), e.g. (B, Hkv, S, D) or gpt-fast's (B, S, Hkv, D)) and ``out``:

    * structure: every multiply takes one of them and a cos / sin table (a view of the identified tables, not
      depending on ``x_in``) or the scalar -1 / 1; every add or subtract takes two of them, with no ``alpha`` other
      than 1; no sign change (``neg``, a multiply by -1) follows an add or subtract, which would flip rotated terms
      already combined (rotate-half's ``neg`` comes before the table multiplies); every other input is a table, a
      shape / index argument, an empty tensor (a full-rotary model's empty pass-through, HF Phi-3) or the dtype
      reference of ``type_as`` / ``to`` (Gemma3's key norm);
    * evaluation (:func:`_rope_proof`): the nodes ``out``, ``m.cos`` and ``m.sin`` are computed by within the
      region are copied out of the graph and run on the CPU, twice (once when ``x_in`` has more than
      ``_EVAL_ONE_DRAW`` elements), on random float64 inputs of the shapes recorded in ``meta['example_value']``
      (symbolic sizes at their hints, never guarded): ``x_in`` uniform in [-1, 1); each table root
      (:func:`_table_root`) the cosine (cos root) or sine (sin root) of its own uniform random angles, so no identity
      between the two tables is assumed (complex roots ``r * e^(i*angle)``, ``r`` in [0.5, 1.5]; angles paired along
      the last dim, ``cat((a, a))`` / ``repeat_interleave(a, 2)``, only where :func:`tables_paired` proves the
      model's root is); any other float input random; an integer input, allowed only as a ``getitem`` index (e.g.
      ``rope_cos[input_pos]``), random in range; numbers as recorded. ``out`` (or its pairs, (..., D/2, 2),
      flattened) must equal :func:`_rotation` of ``x_in`` with the values the region gives ``m.cos`` / ``m.sin``,
      the keys the latent cache rebuilds (``kernels/reference.py`` ``apply_rope_ref``, with the tables
      ``passes/latent_kv_cache.py`` records), to a relative ``_EVAL_TOL``. Dtype casts run as float64 / complex128
      identities (exactness is up to rounding). Equal regions (every layer of a model) share one run (memoised).

    Two refusals come first and stand whatever the evaluation says, because values of the dataflow cannot show them:
    an in-place write of a node of the rotation, or, after the rotation started, of what it reads (``x_in``, the
    tensors it views, the tables; :func:`_in_place_reason`); and an ``out`` not shaped like the rotation of ``x_in``
    (part of its heads or positions kept; :func:`_shape_reason`).

    The evaluation decides whenever it can be set up: it refuses what the structure missed (a sign flip of the
    complex form or one before the combining add, the inverse rotation ``x*cos - rh(x)*sin``, a table factor
    swapped or repeated, an extra rotation term, a permutation after RoPE) and accepts exact forms the structure
    refused (a sign flip written around a subtraction, ``-(x2*s - x1*c)``). It is not set up, and the structural
    answer stands, when ``m.cos`` (or, but for the complex form, ``m.sin``) is missing, a size has no hint, an
    input is not a float / complex tensor, a number or an index of a ``getitem``, a region node or input is written
    in place (refused above when it matters), ``x_in`` is empty or over ``_EVAL_MAX_ELEMENTS`` elements, ``out`` is
    complex or empty, or the run raises (an ``out`` shaped otherwise than the rotation is refused). Still not proven:
    exactness at sizes other than the hints of a dynamic shape; changes the region walk does not reach (ops outside
    ``_ROPE_OPS``; the views and casts between ``m.out`` and the cache write are :func:`cached_key_layout`'s); that
    the rebuild can take the tables as they are (a table of width rotary_dim / 2, one angle
    per pair as written-out forms use, is widened here, while the latent ops want width rotary_dim and fail loudly
    on it); and, by nature, with vanishing probability, a wrong form that agrees on every random draw. Tables
    swapped wholesale (``x*sin + rh(x)*cos``) count as exact: the rebuild takes each table by its role in the
    formula.

    Args:
        m: a :func:`match_rope` result for a key (``form``, ``rotary_dim``, ``x_in``, ``out``, ``cos``, ``sin``).
    Returns:
        A one-line reason naming the first offending node (the structural reason when both checks refuse), or None.
        Never raises: an unexpected error in the structural check is a refusal, in the evaluation a fallback.
    """
    try:
        hard = _in_place_reason(m) or _shape_reason(m)
    except Exception:  # analysis never raises on unknown patterns
        hard = "the RoPE region could not be checked"
    if hard is not None:  # not a question of values: the evaluation cannot overrule it
        return hard
    try:
        structural = _rope_residue(m)
    except Exception:  # analysis never raises on unknown patterns
        structural = "the RoPE region could not be checked"
    proof = _rope_proof(m)
    if proof is None:  # not evaluable: the structural answer stands
        return structural
    if proof <= _EVAL_TOL:
        return None
    if structural is not None:
        return structural
    cos = m.cos.name if m.cos is not None else "?"
    tables = cos if m.sin is None else f"{cos} / {m.sin.name}"
    return (f"{m.out.name} is not the rotation of {m.x_in.name} by the tables {tables}: run on random inputs it "
            f"differs from it by up to {proof:.3g} (e.g. a sign flip, the inverse rotation, a swapped or repeated "
            "table, an extra term or a permutation after RoPE)")


def _path(m: RopeMatch, region: set[fx.Node]) -> set[fx.Node]:
    """``x_in`` (and the node it is a dtype cast of) and the region's nodes that depend on it."""
    path: set[fx.Node] = {m.x_in, strip_dtype(m.x_in)}
    for n in sorted(region):  # graph order: producers first
        if any(i in path for i in n.all_input_nodes):
            path.add(n)
    return path


def _in_place_reason(m: RopeMatch) -> str | None:
    """Why in-place writes make the region's dataflow differ from the values the cache and a latent get, or None.

    The structural check and the evaluation read producers only; a write in place is invisible to both. Refused:

    * any write of a node that depends on the pre-RoPE key (the rotated key or a term of it: ``k.mul_(s)``,
      ``k[..., 0] = 0``, ``k.clamp_()`` after RoPE; through views too): the cache gets the change, a latent rebuild
      would not;
    * a write, after the rotation has started (graph order), of what it reads: ``x_in``, the tensors it is a view of,
      the cos / sin tables and the region's other nodes. A latent (or the tables the rewrite records, views of the
      model's) would hold the new values, the cached key was rotated from the old ones. A write before the rotation
      (an in-place scale of the pre-RoPE key) is seen by RoPE and by the latent alike, and stands.
    """
    region = set(_region(m.out))
    path = _path(m, region)
    start = strip_dtype(m.x_in)
    rotation = sorted(path - {m.x_in, start})
    for n in rotation:
        writers = _writers(n)
        if writers:
            return (f"{writers[0].name} writes {n.name}, a node of the rotation, in place (a change of the rotated "
                    "key that a latent of the pre-RoPE key would rebuild without)")
    if not rotation:
        return None
    first = rotation[0]
    read: list[fx.Node] = [m.x_in, start]
    node = start
    for _ in range(_MAX_REGION_DEPTH):  # the tensors x_in is a view of (written through them, it changes too)
        if op_name(node) not in _VIEW_OPS or not node.args or not isinstance(node.args[0], fx.Node):
            break
        node = node.args[0]
        read.append(node)
    for table in (m.cos, m.sin):
        node = table
        for _ in range(_MAX_REGION_DEPTH):  # each table, down to its root (what the evaluation draws)
            if not isinstance(node, fx.Node):
                break
            read.append(node)
            if op_name(node) not in _TABLE_VIEW_OPS or not node.args:
                break
            node = node.args[0]
    read.extend(sorted(region - path))
    for n in dict.fromkeys(read):
        late = [w for w in _writers(n) if w > first]
        if late:
            return (f"{late[0].name} writes {n.name} in place after RoPE read it (a latent, or the tables recorded "
                    "for the rebuild, would hold values the cached key was not rotated from)")
    return None


def _shape_reason(m: RopeMatch) -> str | None:
    """Why ``m.out`` is not shaped like the rotation of ``m.x_in``, or None (also when a size has no hint).

    The rotation has ``x_in``'s shape (its pairs, (..., D/2, 2), for the complex and stacked forms), broadcast only
    where ``x_in`` has size 1 (tables with more leading dims). Anything else keeps part of the heads or positions
    (``k[:, :1]``, ``k[:, :, :3]``), which a rebuild of the whole pre-RoPE key cannot give."""
    x_val, out_val = _example(m.x_in), _example(m.out)
    if not isinstance(x_val, torch.Tensor) or not isinstance(out_val, torch.Tensor):
        return None
    try:
        hx, ho = _hinted_shape(x_val), _hinted_shape(out_val)
    except _NotEvaluable:
        return None
    flat = ho[:-2] + (2 * ho[-2],) if len(ho) == len(hx) + 1 and len(ho) >= 2 and ho[-1] == 2 else ho
    if len(flat) == len(hx) and flat[-1:] == hx[-1:] and all(o == x or x == 1 for o, x in zip(flat, hx)):
        return None
    return (f"{m.out.name} is shaped {tuple(ho)}, not as the rotation of {m.x_in.name} {tuple(hx)} (part of its "
            "heads or positions kept after RoPE)")


def _rope_residue(m: RopeMatch) -> str | None:
    region = set(_region(m.out))
    start = strip_dtype(m.x_in)
    path = _path(m, region)
    if m.out not in path:
        return f"{m.out.name} does not depend on the rotated input {start.name}"
    roots = {_table_root(t) for t in (m.cos, m.sin) if t is not None}
    if not roots:
        return "no cos / sin table was identified"

    def is_table(i: fx.Node) -> bool:
        if _table_root(i) not in roots:
            return False
        return not (path & ancestors_within(i, region))

    combined: set[fx.Node] = set()  # nodes at or after an add / subtract of rotation terms
    for n in sorted(path - {m.x_in, start}):
        kind = op_name(n)
        inside = [a for a in n.args if isinstance(a, fx.Node) and a in path]
        # not data: the dtype reference of type_as / to(tensor), and empty tensors (a partial RoPE's pass-through
        # when the rotary dim is the head dim, e.g. HF Phi-3's cat((k_embed, k[..., D:])))
        refs = n.args[1:2] if kind in ("type_as", "to") else ()
        outside = [a for a in n.all_input_nodes if a not in path and a not in refs and not _is_empty(a)]
        if any(a in combined for a in n.all_input_nodes):
            combined.add(n)
        if kind == "mul":
            scalars = [a for a in n.args if not isinstance(a, fx.Node)]
            if len(inside) != 1 or any(a not in (1, -1, 1.0, -1.0) for a in scalars) \
                    or not all(is_table(a) for a in outside):
                return (f"{n.name} multiplies the rotation by something other than a cos / sin table (e.g. a scale "
                        "or norm applied after RoPE)")
            if n in combined and any(a in (-1, -1.0) for a in scalars):
                return f"{n.name} flips the sign of the combined rotation terms (a change applied after RoPE)"
        elif kind in ("add", "sub"):
            if len(inside) != 2 or outside:
                return f"{n.name} adds a term that is not part of the rotation (e.g. a bias applied after RoPE)"
            if n.kwargs.get("alpha", 1) != 1 or len(n.args) > 2:
                return f"{n.name} scales a rotation term by its alpha (a change applied after RoPE)"
            combined.add(n)
        elif kind == "neg" and n in combined:
            return f"{n.name} flips the sign of the combined rotation terms (a change applied after RoPE)"
        else:
            tensors = [a for a in outside if _is_tensor(a)]  # sizes (SymInts of a dynamic shape) are shape arguments
            if tensors and not all(is_table(a) for a in tensors):
                return f"{n.name} combines the rotation with {tensors[0].name}, which is not a cos / sin table"
    return None


def _is_empty(node: fx.Node) -> bool:
    """True when the node's recorded value is a tensor of no elements (statically known)."""
    val = node.meta.get("example_value", node.meta.get("val"))
    try:
        return isinstance(val, torch.Tensor) and any(isinstance(d, int) and d == 0 for d in val.shape)
    except Exception:  # a symbolic size that cannot be decided: not known empty
        return False


def _is_tensor(node: fx.Node) -> bool:
    """True unless the node's recorded value is a (symbolic) number: a size, not data."""
    val = node.meta.get("example_value", node.meta.get("val"))
    return val is None or isinstance(val, torch.Tensor)


def ancestors_within(node: fx.Node, region: set[fx.Node]) -> set[fx.Node]:
    """``node``'s producers reachable through ``region`` (``node`` excluded unless it is its own producer)."""
    out: set[fx.Node] = set()
    frontier = list(node.all_input_nodes)
    while frontier:
        n = frontier.pop()
        if n in out:
            continue
        out.add(n)
        if n in region:
            frontier.extend(n.all_input_nodes)
    return out


# ----------------------------------------------------------------------------------------------------------
# from the rotated key to the tensor written to the cache


def cached_key_layout(m: RopeMatch, cached: fx.Node,
                      row_scale: RowScale | None = None) -> tuple[tuple[int, ...] | None, str | None]:
    """How the tensor written to the cache is laid out from the rotation of ``m.x_in``, or why it is not that.

    :func:`match_rope` is given ``cached`` with its views and dtype casts stripped (``graph.VIEW_LIKE``: gpt-fast's
    ``.type_as(x).transpose(1, 2)`` after RoPE on (B, S, Hkv, D)); :func:`rope_residue` judges the region above
    ``m.out`` only. The rewrite projects ``x_in`` and rebuilds its rotation in the cache's (B, Hkv, S, D) layout, so
    the ops from ``m.out`` to ``cached`` must be that layout change and nothing more. They are run on a tensor of
    distinct values shaped like ``m.out`` (symbolic sizes at their hints): the result must be the tensor itself or
    its transpose of dims 1 and 2 (pairs (..., D/2, 2) of the complex / stacked forms flattened first). Dtype casts
    between float types count as the identity (exact up to rounding, as in the proof).

    With ``row_scale`` (:func:`match_row_scale`) the walk from ``cached`` goes through its multiply to the rotated
    operand and on to ``m.out``; the factor must meet the rotation in the layout of ``m.x_in`` (the rewrite scales
    the pre-RoPE key by it), which the same run checks.

    Args:
        m: a :func:`match_rope` result for ``strip_views(cached)`` (or for ``strip_views(row_scale.rotated)``).
        cached: the (B, Hkv, S, D) tensor written to the cache.
        row_scale: the factor applied after RoPE, or None.
    Returns:
        ``(perm, None)``: ``cached == rotation(x_in).permute(perm)``, perm ``(0, 1, 2, 3)`` (Hugging Face) or
        ``(0, 2, 1, 3)`` (gpt-fast); read off values, so a prompt as long as the KV heads are many is no question.
        ``(None, reason)``: the ops change the key (a reordering of its channels, heads or positions through views,
        a cast to an integer type, or a write in place of one of them). ``(None, None)``: not decided (``cached``
        not reached through views from ``m.out``, a size without a hint, a tensor over ``_EVAL_MAX_ELEMENTS``
        elements, a rank other than 4, anything raising). Never raises.
    """
    try:
        return _cached_key_layout(m, cached, row_scale)
    except Exception:  # analysis never raises on unknown patterns
        return None, None


#: Layouts already read: the chain (pure data) -> the result. Bounded: cleared when full.
_LAYOUTS: dict[Any, tuple[int, ...] | str | None] = {}


def _cached_key_layout(m: RopeMatch, cached: fx.Node,
                       row_scale: RowScale | None = None) -> tuple[tuple[int, ...] | None, str | None]:
    chain: list[fx.Node] = []
    node = cached
    while node is not m.out:
        if row_scale is not None and node is row_scale.mul:  # the factor: checked as a step of its own
            chain.append(node)
            node = row_scale.rotated
            continue
        if not (isinstance(node, fx.Node) and op_name(node) in VIEW_LIKE and node.args
                and isinstance(node.args[0], fx.Node)) or len(chain) > 64:
            return None, None
        chain.append(node)
        node = node.args[0]
    if row_scale is not None and row_scale.mul not in chain:
        return None, None
    for n in chain:
        writers = _writers(n)
        if writers:
            return None, (f"{writers[0].name} writes {n.name} in place between RoPE and the cache write (a change "
                          "of the rotated key that a latent of the pre-RoPE key would rebuild without)")
    out_val, x_val = _example(m.out), _example(m.x_in)
    if not isinstance(out_val, torch.Tensor) or not isinstance(x_val, torch.Tensor):
        return None, None
    shape, x_rank = _hinted_shape(out_val), x_val.dim()
    steps: list[tuple] = []
    for n in reversed(chain):  # producers first
        kind = op_name(n)
        if row_scale is not None and n is row_scale.mul:
            steps.append(("rows",))
            continue
        if kind in _EVAL_CASTS:
            val = _example(n)
            if not isinstance(val, torch.Tensor):
                return None, None
            if not (val.dtype.is_floating_point or val.dtype.is_complex):
                return None, f"{n.name} casts the rotated key to {val.dtype} (its values change, a rebuild's would not)"
            steps.append(("cast",))
            continue
        if n.op not in ("call_function", "call_method"):
            return None, None
        rest = fx.node.map_aggregate((n.args[1:], dict(n.kwargs)), _layout_arg)
        steps.append((n.op, n.target, rest))
    key = (tuple(shape), x_rank, _freeze(steps))
    if key not in _LAYOUTS:
        if len(_LAYOUTS) >= _MAX_PROOFS:
            _LAYOUTS.clear()
        _LAYOUTS[key] = _run_layout(shape, x_rank, steps)
    perm = _LAYOUTS[key]
    if perm == "scaled apart":
        return None, (f"{row_scale.mul.name} scales the rotated key in another layout than the pre-RoPE key's "
                      f"{m.x_in.name} (a permutation between RoPE and the scale), which the rewrite does not follow")
    if perm != "reordered":
        return perm, None
    names = ", ".join(n.name for n in reversed(chain))
    return None, (f"the key written to the cache, {cached.name}, is {m.out.name} reordered or broadcast by {names}, "
                  "not laid out as the (B, Hkv, S, D) rotation of the pre-RoPE key that a latent rebuilds (e.g. its "
                  "channels permuted through views after RoPE)")


def _layout_arg(a: Any) -> Any:
    if isinstance(a, fx.Node):  # a size (a symbolic int of a dynamic shape) at its hint; a tensor is not modelled
        val = _example(a)
        if isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
            return _hint(val)
        raise _NotEvaluable(f"{a.name} is not a size")
    return _hint(a)


def _run_layout(shape: tuple[int, ...], x_rank: int, steps: list[tuple]) -> tuple[int, ...] | str | None:
    """:func:`cached_key_layout`'s evaluation (memoised by the caller): the permutation, 'reordered', 'scaled apart'
    (a ``("rows",)`` step met the rotation in another layout than the pre-RoPE key's), or None when not decided."""
    if not 0 < _numel(shape) <= _EVAL_MAX_ELEMENTS:
        return None
    try:
        with torch.no_grad():
            t = torch.arange(_numel(shape), dtype=torch.float64).reshape(shape)
            got = t
            base = t.flatten(-2) if t.dim() == x_rank + 1 and t.shape[-1] == 2 else t
            for step in steps:
                if step[0] == "cast":
                    continue
                if step[0] == "rows":  # a row scale meets the rotation here: in the pre-RoPE key's layout only
                    if got.shape != base.shape or not torch.equal(got, base):
                        return "scaled apart"
                    continue
                op, target, (args, kwargs) = step
                got = getattr(got, target)(*args, **kwargs) if op == "call_method" else target(got, *args, **kwargs)
    except Exception:
        return None
    base = t.flatten(-2) if t.dim() == x_rank + 1 and t.shape[-1] == 2 else t  # the pairs of a complex / stacked form
    if not isinstance(got, torch.Tensor) or got.dim() != 4 or base.dim() != 4:
        return None
    for perm in ((0, 1, 2, 3), (0, 2, 1, 3)):
        view = base.permute(perm)
        if view.shape == got.shape and torch.equal(view, got):
            return perm
    return "reordered"


# ----------------------------------------------------------------------------------------------------------
# the proof by evaluation (rope_residue's second check)

#: Largest error of the region's output against the rotation, relative to max(1, the rotation's largest value),
#: still counted exact. Inputs are O(1) and all arithmetic is float64, so an exact form is off by ~1e-15 and a wrong
#: one by ~0.1 or more.
_EVAL_TOL = 1e-9
#: Random draws per region; a single one when ``x_in`` has more than ``_EVAL_ONE_DRAW`` elements (a draw then
#: already holds that many independent samples, and the proof runs at compile time on every attention site).
_EVAL_DRAWS = 2
_EVAL_ONE_DRAW = 1 << 16
#: Above this many elements of ``x_in`` (or of any other input) the region is not evaluated and the structural answer
#: stands. A draw costs ~50 ns per element of ``x_in`` on 2 CPU cores (measured: 0.1 s at the limit, once per graph
#: thanks to the memo) and 16 MiB per float64 intermediate; at the limit: a prefill graph of 2048 tokens with 8 KV
#: heads of 128 channels (its decode graph, S = 1, is always proven).
_EVAL_MAX_ELEMENTS = 1 << 21
#: Seed of the evaluation's own generator (the global RNG is left alone, so compiling does not shift the model's
#: random stream).
_EVAL_SEED = 20240607
#: Ops run as a float64 / complex128 identity in the evaluation (a cast only rounds; the region may cast to half).
_EVAL_CASTS = frozenset({"float", "to", "type_as", "half", "bfloat16", "_to_copy"})
#: Proofs already run: the evaluation program (pure data, see _rope_program) -> its error or None. Every layer of a
#: model has the same program, so a graph evaluates it once. Bounded: cleared when full.
_PROOFS: dict[Any, float | None] = {}
_MAX_PROOFS = 256


class _NotEvaluable(Exception):
    """The region cannot be run on concrete inputs (an op, a value or a size the evaluation does not model)."""


@dataclass(frozen=True)
class _Ref:
    """The value of an evaluation slot, standing for an FX node in a copied node's arguments."""

    slot: int


@dataclass(frozen=True)
class _Program:
    """A RoPE region copied out of its graph, as pure data (hashable once frozen, so equal regions share a proof).

    Attributes:
        leaves: ``(slot, kind, spec)`` per input: kind 'x' (the pre-RoPE key, spec its shape), 'table' (spec:
            shape, complex, role 'cos' / 'sin', pairing form or None), 'randn' (shape, complex), 'index' (shape,
            dtype, exclusive bound), 'const' (a number).
        steps: ``(slot, kind, target, args, kwargs)`` in graph order; kind 'call_function', 'call_method' or 'cast'
            (target: True for a complex result), arguments with nodes replaced by :class:`_Ref`.
        x, out, cos, sin: the slots of ``x_in``, ``out`` and the tables (``sin`` -1 for the complex form).
        form, rotary_dim: as :class:`RopeMatch`.
    """

    leaves: tuple
    steps: tuple
    x: int
    out: int
    cos: int
    sin: int
    form: str
    rotary_dim: int


def _rope_proof(m: RopeMatch) -> float | None:
    """Run the region of ``m`` on random inputs (see :func:`rope_residue`): the largest error of ``m.out`` against
    :func:`_rotation` of ``m.x_in`` over the draws, relative to max(1, the rotation's largest magnitude) (0.0 when
    exact, ``inf`` for NaN), or None when the evaluation cannot be set up or raises. Never raises; memoised per
    program in ``_PROOFS``."""
    try:
        program = _rope_program(m)
    except Exception:  # _NotEvaluable, or anything unexpected in a graph we do not know
        return None
    try:
        key: Any = _freeze(program)
        if key in _PROOFS:
            return _PROOFS[key]
    except Exception:  # an argument that cannot be hashed or compared: evaluate without the memo
        key = None
    try:
        err = _run_program(program)
    except Exception:
        err = None
    if key is not None:
        if len(_PROOFS) >= _MAX_PROOFS:
            _PROOFS.clear()
        _PROOFS[key] = err
    return err


def _rope_program(m: RopeMatch) -> _Program:
    """Copy the nodes ``m.out``, ``m.cos`` and ``m.sin`` are computed by within the RoPE region into a
    :class:`_Program`; the inputs are ``x_in`` (and the node it is a dtype cast of), the table roots and every node
    outside the region. Raises _NotEvaluable (or anything) when that is not possible."""
    if m.cos is None or (m.form != "complex" and m.sin is None):
        raise _NotEvaluable("tables not identified")
    region = set(_region(m.out))
    x_nodes = {m.x_in, strip_dtype(m.x_in)}
    paired: dict[fx.Node, bool] = {}
    roles: dict[fx.Node, str] = {}
    for table, role in ((m.cos, "cos"), (m.sin, "sin")):
        if table is None:
            continue
        root = _table_root(table)  # its angles are paired when the root's are (the values are drawn there)
        paired[root] = paired.get(root, True) and m.form != "complex" and tables_paired(root, m.form)
        roles.setdefault(root, role)
    if x_nodes & set(roles):
        raise _NotEvaluable("a table is the pre-RoPE key")

    copied: set[fx.Node] = set()
    inputs: set[fx.Node] = set()
    stack = [t for t in (m.out, m.cos, m.sin) if t is not None]
    while stack:
        n = stack.pop()
        if n in copied or n in inputs:
            continue
        if n in x_nodes or n in roles or n not in region:
            inputs.add(n)
            continue
        copied.add(n)
        stack.extend(n.all_input_nodes)
    if any(_mutated(n) for n in copied | inputs | x_nodes):
        raise _NotEvaluable("written in place")

    slots = dict.fromkeys(x_nodes, 0)  # slot 0: x_in (a dtype cast runs as the identity)
    x_val = _example(m.x_in)
    if not isinstance(x_val, torch.Tensor) or not x_val.dtype.is_floating_point:
        raise _NotEvaluable("x_in is not a float tensor")
    x_shape = _hinted_shape(x_val)
    if not 0 < _numel(x_shape) <= _EVAL_MAX_ELEMENTS:
        raise _NotEvaluable("x_in is empty or too large")
    leaves: list[tuple] = [(0, "x", x_shape)]
    for i, n in enumerate(sorted(inputs - x_nodes), start=1):
        slots[n] = i
        leaves.append((i, *_leaf_spec(n, roles, m.form if paired.get(n) else None, copied)))
    steps: list[tuple] = []
    for i, n in enumerate(sorted(copied), start=len(leaves)):  # graph order: producers first
        slots[n] = i
        steps.append((i, *_step(n, slots)))
    sin = slots[m.sin] if m.sin is not None else -1
    return _Program(tuple(leaves), tuple(steps), 0, slots[m.out], slots[m.cos], sin, m.form, m.rotary_dim)


def _example(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _hint(v: Any) -> Any:
    """A concrete int / float / bool for ``v``, symbolic values at their hint (never guarding); raises
    _NotEvaluable for a symbolic value without a hint."""
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        h = getattr(v.node, "hint", None)
        if h is None and isinstance(v, torch.SymInt):
            try:
                from torch.fx.experimental.symbolic_shapes import optimization_hint

                h = optimization_hint(v)
            except Exception:
                h = None
        if not isinstance(h, (bool, int, float)):
            raise _NotEvaluable(f"no hint for {v}")
        return h
    return v


def _hinted_shape(val: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(_hint(d)) for d in val.shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _leaf_spec(n: fx.Node, roles: dict[fx.Node, str], pairing: str | None, copied: set[fx.Node]) -> tuple:
    """``(kind, spec)`` of an input ``n`` of the program (see :class:`_Program`); ``pairing``: the RoPE form whose
    angle pairs a table root holds (proven by :func:`tables_paired`), or None."""
    val = _example(n)
    if isinstance(val, (bool, int, float, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return "const", _hint(val)
    if not isinstance(val, torch.Tensor):
        raise _NotEvaluable(f"input {n.name} is not a tensor or a number")
    shape, cplx = _hinted_shape(val), val.dtype.is_complex
    if _numel(shape) > _EVAL_MAX_ELEMENTS:  # (the hinted shape: val.numel() of a symbolic shape would guard)
        raise _NotEvaluable(f"input {n.name} is too large")
    if n in roles:
        if not (cplx or val.dtype.is_floating_point):
            raise _NotEvaluable(f"table {n.name} is not float")
        pair = pairing if pairing is not None and shape and shape[-1] % 2 == 0 else None
        return "table", (shape, cplx, roles[n], pair)
    if cplx or val.dtype.is_floating_point:
        return "randn", (shape, cplx)
    if val.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        return "index", (shape, val.dtype, _index_bound(n, copied))
    raise _NotEvaluable(f"input {n.name} of dtype {val.dtype}")


def _index_bound(n: fx.Node, copied: set[fx.Node]) -> int:
    """The exclusive bound of random values for an integer input used only as an index of ``getitem`` (the
    smallest size of a dim it indexes, e.g. gpt-fast's ``rope_cos[input_pos]``); raises _NotEvaluable for any
    other use."""
    bound: int | None = None
    for u in n.users:
        if u not in copied:
            continue
        base = u.args[0] if u.args else None
        idx = u.args[1] if len(u.args) > 1 else None
        if op_name(u) != "getitem" or base is n or not isinstance(base, fx.Node):
            raise _NotEvaluable(f"integer input {n.name} is not only an index")
        items = idx if isinstance(idx, tuple) else (idx,)
        dims = [d for d, i in enumerate(items) if i is n]
        if not dims or any(isinstance(i, bool) or not isinstance(i, (slice, int)) for i in items[:max(dims)]
                           if i is not n):
            raise _NotEvaluable(f"integer input {n.name} indexes {u.name} in a way not modelled")
        base_val = _example(base)
        if not isinstance(base_val, torch.Tensor):
            raise _NotEvaluable(f"{base.name} has no recorded shape")
        shape = _hinted_shape(base_val)
        for d in dims:
            if d >= len(shape):
                raise _NotEvaluable(f"integer input {n.name} indexes past {base.name}'s dims")
            bound = shape[d] if bound is None else min(bound, shape[d])
    if not bound:
        raise _NotEvaluable(f"integer input {n.name} indexes nothing")
    return bound


def _mutated(node: fx.Node) -> bool:
    """Whether a user writes ``node`` (or a view of it) in place (see :func:`_writers`)."""
    return bool(_writers(node))


def _writers(node: fx.Node, depth: int = 0) -> list[fx.Node]:
    """The users that write ``node`` (or a view of it) in place: ``setitem`` on it, an in-place op (name ending in
    ``_``) with it as ``self``, or ``out=`` it. Unlike :func:`_written_in_place`, a cache write that only reads
    ``node`` (``index_copy_(cache, 2, pos, node)``) does not count. A chain of views too deep to follow counts as
    written (its first view is returned)."""
    found: list[fx.Node] = []
    for user in node.users:
        out = user.kwargs.get("out")
        if out is node or (isinstance(out, (tuple, list)) and node in out):
            found.append(user)
            continue
        if not user.args or user.args[0] is not node:  # (checked first: op_name is the costly part)
            continue
        name = op_name(user)
        if name == "setitem" or (name.endswith("_") and not name.endswith("__")):
            found.append(user)
        elif name in _ALIASING_OPS:
            found.extend([user] if depth >= 8 else _writers(user, depth + 1))
    return found


def _step(n: fx.Node, slots: dict[fx.Node, int]) -> tuple:
    """``(kind, target, args, kwargs)`` of a copied node (see :class:`_Program`)."""
    if n.op not in ("call_function", "call_method"):
        raise _NotEvaluable(f"{n.name} is a {n.op}")
    if op_name(n) in _EVAL_CASTS:
        val, src = _example(n), n.args[0] if n.args else None
        if not isinstance(val, torch.Tensor) or not isinstance(src, fx.Node) or not (
                val.dtype.is_floating_point or val.dtype.is_complex):
            raise _NotEvaluable(f"{n.name} is not a cast between float types")
        return "cast", val.dtype.is_complex, (_Ref(slots[src]),), {}

    def ref(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return _Ref(slots[a])
        return _hint(a)

    return n.op, n.target, fx.node.map_aggregate(n.args, ref), fx.node.map_aggregate(dict(n.kwargs), ref)


def _freeze(a: Any) -> Any:
    """A hashable image of a program or argument: containers become tagged tuples, slices too (not hashable before
    Python 3.12), and each constant keeps its type (``x[..., True]`` is not ``x[..., 1]``)."""
    if isinstance(a, _Program):
        return ("program", _freeze(a.leaves), _freeze(a.steps), a.x, a.out, a.cos, a.sin, a.form, a.rotary_dim)
    if isinstance(a, (tuple, list)):
        return (type(a).__name__, *(_freeze(v) for v in a))
    if isinstance(a, dict):
        return ("dict", *((k, _freeze(v)) for k, v in sorted(a.items(), key=lambda kv: str(kv[0]))))
    if isinstance(a, slice):
        return ("slice", _freeze(a.start), _freeze(a.stop), _freeze(a.step))
    return (type(a), a)


def _run_program(p: _Program) -> float:
    """The largest relative error of ``p``'s output against :func:`_rotation` over the draws (see
    :func:`_rope_proof`). Runs on the CPU in float64 under ``torch.no_grad()``, with its own seeded generator."""
    gen = torch.Generator().manual_seed(_EVAL_SEED)
    worst = 0.0

    def value(a: Any, env: dict[int, Any]) -> Any:
        return fx.node.map_aggregate(a, lambda v: env[v.slot] if isinstance(v, _Ref) else v)

    with torch.no_grad():
        for _ in range(_EVAL_DRAWS if _numel(p.leaves[0][2]) <= _EVAL_ONE_DRAW else 1):
            env: dict[int, Any] = {slot: _leaf_value(kind, spec, gen) for slot, kind, spec in p.leaves}
            for slot, kind, target, args, kwargs in p.steps:
                if kind == "cast":
                    env[slot] = _widen(env[args[0].slot], target)
                elif kind == "call_method":
                    self_, *rest = value(args, env)
                    env[slot] = getattr(self_, target)(*rest, **value(kwargs, env))
                else:
                    env[slot] = target(*value(args, env), **value(kwargs, env))
            got, x, cos = env[p.out], env[p.x], env[p.cos]
            sin = env[p.sin] if p.sin >= 0 else None
            if not all(type(t) is torch.Tensor for t in (got, x, cos) + ((sin,) if sin is not None else ())):
                raise _NotEvaluable("not plain tensors (a fake or traced mode is active)")
            want = _rotation(x, cos, sin, p.form, p.rotary_dim)
            if got.shape != want.shape and got.dim() >= 2 and got.shape[:-2] == want.shape[:-1] \
                    and got.shape[-2] * got.shape[-1] == want.shape[-1]:
                got = got.flatten(-2)  # the pairs (..., D/2, 2) of the complex / real-pairs forms
            if got.is_complex() or got.numel() == 0:
                raise _NotEvaluable("the output is complex or empty")
            if got.shape != want.shape:  # (caught by _shape_reason first, where the recorded shapes have hints)
                return float("inf")
            err = (torch.sub(got, want).abs_().max() / want.abs().max().clamp(min=1.0)).item()
            worst = max(worst, err) if err == err else float("inf")
    return worst


def _leaf_value(kind: str, spec: Any, gen: torch.Generator) -> Any:
    """A random value of a program input (see :class:`_Program` and :func:`rope_residue`)."""
    f64 = torch.float64
    if kind == "const":
        return spec
    if kind == "x":  # uniform in [-1, 1): as good a random point as a normal one, and 3x faster to draw
        return torch.rand(spec, dtype=f64, generator=gen).mul_(2).sub_(1)
    if kind == "randn":
        shape, cplx = spec
        return torch.randn(shape, dtype=torch.complex128 if cplx else f64, generator=gen)
    if kind == "index":
        shape, dtype, bound = spec
        return torch.randint(0, bound, shape, dtype=dtype, generator=gen)
    shape, cplx, role, pairing = spec  # a table root
    if pairing is None:
        angle = (torch.rand(shape, dtype=f64, generator=gen) * 2 - 1) * torch.pi
    else:  # one angle per rotated pair, laid out as the model's tables are (proven by tables_paired)
        half = (torch.rand((*shape[:-1], shape[-1] // 2), dtype=f64, generator=gen) * 2 - 1) * torch.pi
        angle = torch.cat((half, half), -1) if pairing == "rotate_half" else half.repeat_interleave(2, -1)
    if cplx:
        radius = torch.rand(shape, dtype=f64, generator=gen) + 0.5
        return torch.polar(radius, angle)
    return angle.cos() if role == "cos" else angle.sin()


def _widen(t: Any, cplx: bool) -> torch.Tensor:
    """A dtype cast of the region, run in the evaluation's precision: float64, or complex128 for a complex result."""
    if not isinstance(t, torch.Tensor) or t.is_complex() != cplx:
        raise _NotEvaluable("a cast between real and complex, or of a non-tensor")
    return t.to(torch.complex128 if cplx else torch.float64)


def _rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor | None, form: str, rotary_dim: int) -> torch.Tensor:
    """RoPE of the first ``rotary_dim`` channels of ``x``, the rest passing through: the keys the latent cache
    rebuilds.

    The formula of ``kernels/reference.py`` ``apply_rope_ref`` (which the Triton / CUDA latent-attention kernels
    follow), restated because analysis does not import kernels; the tables are what ``passes/latent_kv_cache.py``
    ``_rope_tables`` records from :attr:`RopeMatch.cos` / ``.sin`` per position (complex form: the real and
    imaginary parts of ``cos``).

    Args:
        x: (..., D) float64, D >= rotary_dim.
        cos, sin: broadcastable to (..., W) float64, W = rotary_dim (rotate_half / interleaved; a table of width
            rotary_dim / 2, one angle per pair as the written-out forms use, is widened as the model's pairing:
            ``cat((t, t))`` / ``repeat_interleave(t, 2)``); complex: ``cos`` (..., rotary_dim / 2) complex128,
            ``sin`` None.
        form: 'rotate_half', 'interleaved' or 'complex'.
    Returns:
        (..., D) float64, broadcast over the tables' leading dims. Raises (ValueError, RuntimeError) on shapes that
        do not broadcast.
    """
    rd = rotary_dim
    rot, rest = x[..., :rd], x[..., rd:]
    even, odd = rot[..., 0::2], rot[..., 1::2]
    if form == "complex":
        if not cos.is_complex():
            raise _NotEvaluable("complex form with a real table")
        c, s = cos.real, cos.imag
        out = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    else:
        if sin is None or cos.is_complex() or sin.is_complex():
            raise _NotEvaluable("real form without real tables")
        tables = []
        for t in (cos, sin):
            if t.shape[-1] * 2 == rd:
                t = torch.cat((t, t), -1) if form == "rotate_half" else t.repeat_interleave(2, -1)
            tables.append(t)
        c, s = tables
        if form == "rotate_half":
            x1, x2 = rot[..., : rd // 2], rot[..., rd // 2:]
            out = rot * c + torch.cat((-x2, x1), dim=-1) * s
        elif form == "interleaved":
            out = rot * c + torch.stack((-odd, even), dim=-1).flatten(-2) * s
        else:
            raise _NotEvaluable(f"RoPE form {form!r}")
    rest = rest.expand(*out.shape[:-1], rest.shape[-1])
    return torch.cat((out, rest), dim=-1)


def _partial_source(x: fx.Node, out: fx.Node) -> fx.Node | None:
    """If ``x`` is ``y[..., :rd]`` and ``out`` concatenates the pass-through ``y[..., rd:]``, return ``y``."""
    sel = last_dim_selection(x)
    if sel is None:
        return None
    y, start, stop, step, squeezed = sel
    y_shape = shape_of(y)
    if squeezed or step != 1 or start != 0 or not y_shape or stop >= y_shape[-1]:
        return None
    # the pass-through part must be concatenated back (through views) into the output
    top = out
    while op_name(top) != "cat" and top.args and isinstance(top.args[0], fx.Node) and op_name(top) in _DTYPE_OPS | {
        "view", "reshape", "flatten"
    }:
        top = top.args[0]
    if op_name(top) != "cat":
        return None
    for part in top.all_input_nodes:
        psel = last_dim_selection(strip_dtype(part))
        if psel is not None and strip_dtype(psel[0]) is strip_dtype(y) and psel[1] == stop:
            return strip_dtype(y)
    return None


#: Ops that map each table entry to a value of that entry alone (or keep the tensor as is), so that a table whose
#: paired columns are equal keeps them equal: what HF's rotary embedding applies after ``cat((freqs, freqs))``.
_PAIR_PRESERVING = frozenset({"cos", "sin", "float", "to", "type_as", "half", "bfloat16", "_to_copy", "contiguous",
                              "clone", "alias", "detach", "expand"})
#: How many producer hops :func:`tables_paired` walks from a table back to the ``cat`` that pairs it.
_MAX_PAIR_DEPTH = 24


def tables_paired(table: fx.Node | None, form: str) -> bool:
    """Whether a RoPE cos or sin table holds, by construction, one angle per rotated pair.

    Proves it from the graph, never from values: walking back from ``table`` through per-entry ops (``cos``,
    ``sin``, multiplication by a Python number such as HF's ``attention_scaling``, dtype casts, ``contiguous``,
    ``expand``, ``unsqueeze`` / ``getitem`` / ``view`` / ``reshape`` that keep the last dim) to

    * ``rotate_half``: ``cat((f, f), dim=-1)`` with the same node twice (HF's ``emb = cat((freqs, freqs), -1)``);
    * ``interleaved``: ``repeat_interleave(f, 2, dim=-1)`` (GPT-J's ``duplicate_interleave``) or
      ``stack((f, f), -1)`` flattened over its last two dims.

    Args:
        table: the table node (e.g. :attr:`RopeMatch.cos`), or None. form: the RoPE form.
    Returns:
        True only when proven; False for other forms ('complex' has one angle per pair by layout), for tables
        that enter the graph as inputs, and for anything not recognised.
    """
    node, depth = table, 0
    while isinstance(node, fx.Node) and depth < _MAX_PAIR_DEPTH:
        depth += 1
        if _written_in_place(node):  # e.g. emb[..., 0] = 0 after the cat: the graph's values are not its dataflow
            return False
        name = op_name(node)
        if form == "rotate_half" and name == "cat":
            parts, dim = arg(node, 0, "tensors"), arg(node, 1, "dim", 0)
            shape = shape_of(node)
            return (isinstance(parts, (list, tuple)) and len(parts) == 2 and parts[0] is parts[1]
                    and isinstance(parts[0], fx.Node) and shape is not None
                    and dim in (-1, len(shape) - 1))
        if form == "interleaved" and name == "repeat_interleave":
            shape = shape_of(node)
            reps, dim = arg(node, 1, "repeats"), arg(node, 2, "dim")
            return shape is not None and reps == 2 and dim in (-1, len(shape) - 1)
        if form == "interleaved" and name in ("flatten", "view", "reshape") and _flattens_pair_stack(node):
            return True
        if name in _PAIR_PRESERVING or (name in ("mul", "div", "truediv") and _by_number(node)):
            nxt = node.args[0] if node.args else None
            if name in ("mul",) and not isinstance(nxt, fx.Node):  # 2.0 * t
                nxt = node.args[1] if len(node.args) > 1 else None
            node = nxt
            continue
        if name in ("unsqueeze", "getitem", "view", "reshape", "squeeze", "select", "slice") and _keeps_last_dim(node):
            node = node.args[0]
            continue
        return False
    return False


#: View ops whose result shares the input's storage (an in-place write through them changes the input).
_VIEW_OPS = frozenset({"view", "reshape", "getitem", "select", "slice", "narrow", "unsqueeze", "squeeze", "expand",
                       "transpose", "permute", "t", "flatten", "unflatten", "as_strided", "alias", "detach",
                       "view_as", "split", "chunk", "unbind", "diagonal", "movedim", "swapaxes", "contiguous"})


def _written_in_place(node: fx.Node, depth: int = 0) -> bool:
    """Whether a user of ``node`` (or of a view of it) writes it in place: a method or function whose name ends
    in ``_`` (``mul_``, ``index_fill_``, ``copy_``), ``operator.setitem``, or an ``out=`` argument."""
    if depth > 8:
        return True  # too deep to follow: assume written
    for user in node.users:
        name = op_name(user)
        if name == "setitem" or (name.endswith("_") and not name.endswith("__")) or "out" in user.kwargs:
            return True
        if name in _VIEW_OPS and _written_in_place(user, depth + 1):
            return True
    return False


#: Ops whose result may share its input's storage: views, and casts that return the input when the dtype is already
#: the one asked for (``to``, ``type_as``, ``float``...).
_ALIASING_OPS = _VIEW_OPS | frozenset({"to", "type_as", "float", "half", "bfloat16", "double"})


def _by_number(node: fx.Node) -> bool:
    """``t * c`` / ``c * t`` / ``t / c`` with ``c`` a Python number (not a tensor)."""
    a = node.args
    return (len(a) == 2 and isinstance(a[0], fx.Node) != isinstance(a[1], fx.Node)
            and all(isinstance(v, (int, float)) for v in a if not isinstance(v, fx.Node))
            and (op_name(node) == "mul" or isinstance(a[0], fx.Node)))


def _keeps_last_dim(node: fx.Node) -> bool:
    """A view or selection whose output's last dim is its input's whole last dim, unchanged."""
    src = node.args[0] if node.args else None
    s_in, s_out = shape_of(src), shape_of(node)
    if not isinstance(src, fx.Node) or not s_in or not s_out or s_in[-1] != s_out[-1]:
        return False
    name = op_name(node)
    if name in ("select", "squeeze", "unsqueeze", "slice"):  # an op on the last dim itself never keeps it
        dim = arg(node, 1, "dim", None)
        if name == "squeeze" and dim is None:  # squeeze(): drops size-1 dims, never the last (W >= 2)
            return True
        if not isinstance(dim, int):
            return False
        last = len(s_out) - 1 if name == "unsqueeze" else len(s_in) - 1
        return dim not in (-1, last)
    if name == "getitem":  # leading-dim indexing only: ints, full slices, None; no Ellipsis
        idx = node.args[1] if len(node.args) > 1 else None
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(not (i is None or isinstance(i, int) or i == slice(None)) for i in idx):
            return False
        real = [i for i in idx if i is not None]
        return len(real) < len(s_in) or real[-1] == slice(None)
    return True


def _flattens_pair_stack(node: fx.Node) -> bool:
    """``stack((f, f), -1)`` (the same node twice) with its last two dims merged by flatten / view / reshape."""
    src = node.args[0] if node.args else None
    if not isinstance(src, fx.Node) or op_name(src) != "stack":
        return False
    parts, dim = arg(src, 0, "tensors"), arg(src, 1, "dim", 0)
    s_src, s_out = shape_of(src), shape_of(node)
    return (isinstance(parts, (list, tuple)) and len(parts) == 2 and parts[0] is parts[1]
            and s_src is not None and s_out is not None and dim in (-1, len(s_src) - 1)
            and len(s_out) == len(s_src) - 1 and s_out[-1] == 2 * s_src[-2]
            and tuple(s_out[:-1]) == tuple(s_src[:-2]))


# ----------------------------------------------------------------------------------------------------------
# the positions the RoPE tables are computed from


#: Dtypes of position information (position ids, offsets such as Qwen-VL's rope_deltas, masks).
_INDEX_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool})
#: Ops that read only the metadata (dtype, device, shape) of the operands at these argument positions.
_META_ARGS = {"type_as": (1,), "to": (1,), "expand_as": (1,), "view_as": (1,), "reshape_as": (1,),
              "zeros_like": (0,), "ones_like": (0,), "empty_like": (0,), "full_like": (0,), "new_zeros": (0,),
              "new_ones": (0,), "new_empty": (0,), "new_full": (0,), "new_tensor": (0,)}
#: How many nodes :func:`rope_position_reason` visits above the tables before it gives up (and refuses).
_MAX_TABLE_NODES = 4096


def rope_positions(table: fx.Node | None, seq_len: int) -> fx.Node | None:
    """The positions a RoPE table of the new tokens is computed from: the nearest int32 / int64 tensor shaped (S,)
    or (B, S) above ``table`` (Hugging Face's ``position_ids``, gpt-fast's ``input_pos``), or None.

    What the latent store keys the tables by (``ckvp.rope_table_update``: one row per position); whether the tables
    are a function of these positions alone is :func:`rope_position_reason`'s question.
    """
    if not isinstance(table, fx.Node):
        return None

    def is_positions(n: fx.Node) -> bool:
        shape = shape_of(n)
        return dtype_of(n) in (torch.int64, torch.int32) and shape is not None and len(shape) in (1, 2) \
            and shape[-1] == seq_len

    return find_upstream(table, is_positions, max_depth=48)


def rope_position_reason(m: RopeMatch, seq_len: int) -> str | None:
    """Why the latent store cannot key ``m``'s tables by one position per token, or None when it can (or when the
    positions are not found at all, which the rewrite reports itself).

    The store keeps one cos / sin row per position, shared by the batch and by every call on the cache
    (``ckvp.rope_table_update``: ``cos_table[positions] = cos``), and rebuilds a cached key with the row of its
    slot's position. That is exact when the tables are a function of the positions :func:`rope_positions` finds.
    Walking up from ``m.cos`` and ``m.sin`` (data arguments only: not the dtype reference of ``type_as`` / ``to``,
    nor sizes; including the values written in place into a node of the way, e.g. Qwen3-VL's
    ``freqs_thw[..., idx] = freq[dim, ..., idx]``) and stopping at those positions, no other position information
    may enter: no integer or bool tensor that is a graph input, a module buffer or constant, or made in the graph
    from no tensor (float buffers such as ``inv_freq`` are the model's, the same for every position). Refused:

    * multimodal RoPE (mrope: Qwen2/2.5/3-VL, Qwen3-VL-MoE, GLM-4V(-MoE), ERNIE-4.5-VL-MoE, Qwen3-Omni-MoE) fed
      position ids of several streams, (3, B, S) or (4, B, S) with the text positions first: no (B, S) positions
      are found, or the ones found are not all of it (``arange(...).expand(3, B, -1) + rope_deltas``, Qwen-VL's
      decode positions after an image, where two sequences of the batch write the same position with different
      tables). With streams that differ a token's tables are not a function of one position.
    * any other table that takes in position information besides the positions found.

    Args:
        m: the :func:`match_rope` result of a cached key; ``m.cos`` (and ``m.sin``) its tables.
        seq_len: S, the new tokens of the call (dim 2 of the key written to the cache).
    Returns:
        A sentence (ending with a period) naming the position streams and the inputs found, or None. Never raises:
        an unexpected graph form is a refusal.
    """
    try:
        return _rope_position_reason(m, seq_len)
    except Exception:  # analysis never raises on unknown patterns
        return "the positions its RoPE tables are computed from could not be checked."


def _rope_position_reason(m: RopeMatch, seq_len: int) -> str | None:
    tables = [t for t in (m.cos, m.sin) if isinstance(t, fx.Node)]
    if not tables:
        return None
    pos = rope_positions(m.cos, seq_len)
    visited = _table_inputs(tables, pos)
    if visited is None:
        return "the computation of its RoPE tables is too large to check which positions it takes in."
    streams = []
    for n in visited:
        shape = shape_of(n)
        if n is not pos and dtype_of(n) in _INDEX_DTYPES and shape and len(shape) >= 3 and shape[-1] == seq_len \
                and shape[0] > 1:
            streams.append(n)
    foreign = [n for n in visited if n is not pos and _position_input(n)]
    if pos is None and not streams:
        return None  # no positions at all: the rewrite says so ("RoPE positions not identified")
    if pos is not None and not foreign:
        return None
    tables_text = " / ".join(t.name for t in tables)
    inputs = ", ".join(f"{n.name} {tuple(shape_of(n) or ())}" for n in sorted(foreign)[:4])
    if streams:
        s = max(streams, key=lambda n: len(shape_of(n) or ()))
        shape = shape_of(s)
        head = (f"its RoPE tables {tables_text} are computed from {shape[0]} position streams ({s.name}, shaped "
                f"{tuple(shape)}): multimodal RoPE (mrope, e.g. temporal / height / width positions of an image or "
                "video)")
        if pos is None:
            found = ", with no single position per token"
        else:
            found = f"; the positions {pos.name} {tuple(shape_of(pos) or ())} are not all of it"
        found += f" (position inputs: {inputs})" if inputs else ""
    else:
        head = f"its RoPE tables {tables_text} take in {inputs} besides the positions {pos.name}"
        found = ""
    return (f"{head}{found}. The latent cache keeps one RoPE table row per position, shared by the sequences of "
            "the batch, and rebuilds each cached key from its position's row: with position streams that differ (or "
            "positions shifted per sequence) a token's tables are not its position's, and the rebuilt keys would "
            "differ from the cached ones.")


def _position_input(n: fx.Node) -> bool:
    """``n`` brings position information into a table: an integer / bool tensor that is a graph input, a module
    buffer or constant (a shift per sequence is no less one for being constant) or made in the graph from no tensor
    (``arange``, ``tensor``)."""
    if dtype_of(n) not in _INDEX_DTYPES:
        return False
    return n.op in ("placeholder", "get_attr") or (n.op in ("call_function", "call_method") and not n.all_input_nodes)


def is_module_state(node: fx.Node) -> bool:
    """True for a ``get_attr`` node, or a placeholder that is a module buffer or parameter (by its Dynamo source,
    ``..._buffers['inv_freq']``, or, the source gone, its name, ``l_self_modules_rotary_emb_buffers_inv_freq_``):
    model state, the same at every call, unlike the call's inputs."""
    if node.op == "get_attr":
        return True
    if node.op != "placeholder":
        return False
    source = placeholder_source(node) or node.name
    return "_buffers" in source or "_parameters" in source


def _table_inputs(tables: list[fx.Node], stop: fx.Node | None) -> set[fx.Node] | None:
    """The nodes the tables' values depend on, up to ``stop`` (not walked through): data arguments only (see
    :data:`_META_ARGS`; nodes whose value is a number, sizes, are not walked through), and the values written in place
    into a node of the way (:func:`_writers`). None past :data:`_MAX_TABLE_NODES` nodes."""
    seen: set[fx.Node] = set()
    frontier = list(tables)
    while frontier:
        n = frontier.pop()
        if n in seen:
            continue
        seen.add(n)
        if len(seen) > _MAX_TABLE_NODES:
            return None
        if n is stop or isinstance(_example(n), (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
            continue  # (a size is no data; a split's tuple of tensors, or a node without a value, is walked)
        meta = _META_ARGS.get(op_name(n), ())
        for i, a in enumerate(n.args):
            if i not in meta:
                fx.node.map_arg(a, frontier.append)
        fx.node.map_arg(n.kwargs, frontier.append)
        for w in _writers(n):
            frontier.extend(x for x in w.all_input_nodes if x is not n)
    return seen
