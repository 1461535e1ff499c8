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

A rotation is recognised by its sign: one of the two selections of the rotated tensor reaches a ``neg``,
or the right-hand side of a ``sub``. Every function here is read-only and returns None when it does not
recognise the pattern; none raises on unknown graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from .graph import arg, op_name, shape_of

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


def _is_negated(sel: fx.Node, region: set[fx.Node]) -> bool:
    """True when ``sel`` (or ``sel * table``) reaches a ``neg`` or the subtrahend of a ``sub`` in ``region``."""
    frontier = [sel]
    for _ in range(4):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u not in region:
                    continue
                kind = op_name(u)
                if kind == "neg" or (kind == "sub" and len(u.args) > 1 and u.args[1] is n):
                    return True
                if kind in _DTYPE_OPS or kind == "mul":
                    nxt.append(u)
        frontier = nxt
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


def rope_residue(m: RopeMatch) -> str | None:
    """Why ``m.out`` is not exactly the rotation of ``m.x_in``, or None when it is.

    The region :func:`match_rope` walks also takes in multiplies and adds applied after the rotation (a key
    scaled, normalised or offset after RoPE, e.g. HunYuan-MoE's ``key_layernorm``). A latent cache of the pre-RoPE
    key that rebuilds ``RoPE(x_in)`` would then drop them. Checked on the nodes between ``x_in`` and ``out``:
    every multiply takes one of them and a cos / sin table (a view of the identified tables, not depending on
    ``x_in``) or the scalar -1 / 1; every add or subtract takes two of them, with no ``alpha`` other than 1; no
    sign change (``neg``, a multiply by -1) follows an add or subtract, which would flip rotated terms already
    combined (rotate-half's ``neg`` comes before the table multiplies); every other input is a table, a shape /
    index argument, an empty tensor (a full-rotary model's empty pass-through, HF Phi-3) or the dtype reference of
    ``type_as`` / ``to`` (Gemma3's key norm). Returns a one-line reason naming the first offending node, or None.
    Never raises. A structural check, not a proof by evaluation; not detected (no known model writes them): a sign
    flip of the complex form or one placed before the combining add, the inverse rotation (``x*cos - rh(x)*sin``),
    swapped or repeated table factors, extra rotation terms, and a permutation after RoPE. Refused although exact
    (also unseen in models): a sign flip written around a subtraction, ``-(x2*s - x1*c)``.
    """
    try:
        return _rope_residue(m)
    except Exception:  # analysis never raises on unknown patterns
        return "the RoPE region could not be checked"


def _rope_residue(m: RopeMatch) -> str | None:
    region = set(_region(m.out))
    start = strip_dtype(m.x_in)
    path: set[fx.Node] = {m.x_in, start}
    for n in sorted(region):  # graph order: producers first
        if any(i in path for i in n.all_input_nodes):
            path.add(n)
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
