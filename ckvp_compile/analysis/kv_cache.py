"""Follow an attention's key or value input back to where it comes from: a KV cache, a grown cache, or fresh K/V.

Walking back from the K (or V) an attention reads, through views, cache slicing (``keys[:, :, :S]``) and
GQA expansion (``x[:, :, None].expand(...).reshape(...)``, ``repeat_interleave``, ``repeat``), ends at a
*base* node. The base tells what the K/V are:

===========================================  ===================================================================
base                                         meaning
===========================================  ===================================================================
buffer with an in-place positional write     static KV cache. Writes: ``buf.index_copy_(2, pos, k)`` (HF
                                             ``StaticCache``), ``buf[:, :, pos] = k`` (``operator.setitem``,
                                             gpt-fast), ``buf.index_put_((..., pos), k)``
``torch.index_put(buf, idx, k)``             functional write; the attention reads the returned tensor
``cat([past, k], dim=-2)``                   dynamic cache (HF ``DynamicCache``): K/V grow every step
anything else                                K/V computed in this forward, no cache (e.g. a plain forward)
===========================================  ===================================================================

The buffer is a placeholder (a cache tensor Dynamo lifted as an input) or, on the first (prefill) call of
a lazily initialised cache (transformers 5.x ``StaticCache``), a ``torch.zeros`` created in the graph.
Read-only; nothing here raises on unknown graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from .attention_ops import is_projection
from .graph import VIEW_LIKE, arg, dtype_of, op_name, placeholder_source, shape_of, strip_views
from .rope import _writers, last_dim_selection, match_rope
from .sites import CacheWriteSite

#: Ops that repeat KV heads for grouped-query attention.
_EXPAND_OPS = frozenset({"expand", "expand_as", "repeat_interleave", "repeat"})
#: In-place positional cache writes and their CacheWriteSite form.
_WRITE_FORMS = {"index_copy_": "index_copy_", "setitem": "setitem", "index_put_": "index_put_"}
#: Ops that allocate a fresh buffer in the graph.
ALLOC_OPS = frozenset(
    {"zeros", "empty", "full", "ones", "new_zeros", "new_empty", "new_full", "zeros_like", "empty_like", "full_like"}
)


@dataclass(frozen=True)
class KVTrace:
    """Where an attention's K or V input comes from (see the module docstring).

    Attributes:
        base: the first node that is not a view, slice or head expansion.
        expand_factor: how many times the heads were repeated on the way (1 when none; GQA H / Hkv).
        expanded: True when an expand / repeat_interleave / repeat was walked through.
    """

    base: fx.Node
    expand_factor: int
    expanded: bool


def _numel(shape: tuple[int, ...] | None) -> int:
    out = 1
    for s in shape or ():
        out *= s
    return out


def _is_view_getitem(node: fx.Node) -> bool:
    """True for ``x[idx]`` where idx holds only slices / None / Ellipsis (a view of a tensor ``x``)."""
    if op_name(node) != "getitem" or len(node.args) < 2 or shape_of(node.args[0]) is None:
        return False
    idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    return all(i is None or i is Ellipsis or isinstance(i, slice) for i in idx)


def trace_kv(node: fx.Node) -> KVTrace:
    """Walk back from an attention K/V input through views, cache slices and GQA head expansion.

    Args:
        node: the key or value an attention reads, e.g. SDPA's ``key`` (B, H or Hkv, T, D).
    Returns:
        A :class:`KVTrace` with the base node and the head expansion factor (numel after / before).
    """
    factor, expanded = 1, False
    while isinstance(node, fx.Node) and node.args and isinstance(node.args[0], fx.Node):
        kind = op_name(node)
        if kind in _EXPAND_OPS:
            before, after = _numel(shape_of(node.args[0])), _numel(shape_of(node))
            if before > 0 and after % before == 0:
                factor *= after // before
            expanded = True
        elif not (kind in VIEW_LIKE or kind in ("narrow", "slice") or _is_view_getitem(node)):
            break
        node = node.args[0]
    return KVTrace(base=node, expand_factor=factor, expanded=expanded)


def positional_writes(buffer: fx.Node) -> list[fx.Node]:
    """Return the in-place positional writes into ``buffer`` (index_copy_ / setitem / index_put_), graph order.

    Writes into a view of the buffer (``buf[:B][:, :, pos] = k``) count too.
    """
    out: list[fx.Node] = []
    targets = [buffer] + [u for u in buffer.users if _is_view_getitem(u) or op_name(u) in ("narrow", "slice")]
    for t in targets:
        for u in t.users:
            if op_name(u) in _WRITE_FORMS and u.args and u.args[0] is t and _position_arg(u) is not None:
                out.append(u)
    return sorted(out)


def _position_arg(write: fx.Node) -> fx.Node | None:
    """The position tensor of a write: index_copy_'s index, or the seq-dim (or last) tensor of an index tuple."""
    kind = op_name(write)
    if kind == "index_copy_":
        pos = arg(write, 2, "index")
        return pos if isinstance(pos, fx.Node) else None
    idx = arg(write, 1, "indices")
    if isinstance(idx, fx.Node):
        return idx
    if not isinstance(idx, (tuple, list)):
        return None
    tensors = [i for i in idx if isinstance(i, fx.Node)]
    if not tensors:
        return None
    rank = len(shape_of(write.args[0]) or ())
    if rank >= 2 and len(idx) >= rank - 1 and isinstance(idx[rank - 2], fx.Node):
        return idx[rank - 2]
    return tensors[-1]


def _written_value(write: fx.Node) -> fx.Node | None:
    kind = op_name(write)
    val = arg(write, 3, "source") if kind == "index_copy_" else arg(write, 2, "values")
    return val if isinstance(val, fx.Node) else None


def cache_write_site(kind: str, trace: KVTrace, before: fx.Node) -> CacheWriteSite | None:
    """Describe the cache write that feeds an attention's K or V, or return None when there is none.

    Args:
        kind: 'k' or 'v'.
        trace: :func:`trace_kv` of the attention's K or V input.
        before: the attention node; only writes that precede it count (the last one is taken).
    Returns:
        A :class:`CacheWriteSite` (node names, Dynamo source of the buffer or 'graph' when it is allocated
        in the graph, the buffer shape (B, Hkv, S_max, D)), or None.
    """
    base = trace.base
    if op_name(base) == "index_put" and isinstance(base.args[0], fx.Node):
        buffer, write, form = strip_views(base.args[0]), base, "index_put"
    else:
        writes = [w for w in positional_writes(base) if w < before]
        if not writes:
            return None
        buffer, write, form = base, writes[-1], _WRITE_FORMS[op_name(writes[-1])]
    value = _written_value(write)
    pos = _position_arg(write)
    while pos is not None and (_is_view_getitem(pos) or op_name(pos) in VIEW_LIKE) and isinstance(pos.args[0], fx.Node):
        pos = pos.args[0]  # pos[None, None, :] -> pos
    if value is None:
        return None
    source = placeholder_source(buffer) if buffer.op == "placeholder" else "graph"
    return CacheWriteSite(
        kind=kind,  # type: ignore[arg-type]
        form=form,  # type: ignore[arg-type]
        write_node=write.name,
        cache_node=buffer.name,
        cache_source=source or buffer.name,
        value_node=value.name,
        position_node=pos.name if pos is not None else None,
        cache_shape=shape_of(buffer) or (),
        itemsize=_itemsize(buffer),
    )


def stray_cache_writes(trace: KVTrace, site: CacheWriteSite, nodes: dict[str, fx.Node]) -> list[fx.Node]:
    """The in-place writes into the cache buffer of ``site`` (or a view of it, or of the tensor the attention reads,
    ``trace.base``) other than the write ``site`` describes: ``k.mul_(s)`` / ``v[:, :, :n].add_(b)`` /
    ``k[:, :, 0] = 0`` on the cache read back, a ``zero_()`` of it, a second positional write (before the attention,
    or after it: ``k_cache[:, :, pos] = k * s`` for the next calls). A latent cache keeps only the one write it
    rewrites, so such a change, which persists in a dense cache from one call to the next, would be lost."""
    buffer = nodes[site.cache_node]
    found = _writers(buffer) + (_writers(trace.base) if trace.base is not buffer else [])
    return sorted(set(found) - {nodes[site.write_node]})


#: Ops whose result holds the same elements as their input (a write through one changes all of them, and only them).
_SAME_ELEMENTS = frozenset({"view", "reshape", "_unsafe_view", "transpose", "permute", "t", "contiguous", "unsqueeze",
                            "squeeze", "flatten", "unflatten", "alias", "detach", "view_as", "movedim", "swapaxes",
                            "expand", "to", "type_as", "float", "half", "bfloat16", "double"})


def late_value_writes(site: CacheWriteSite, nodes: dict[str, fx.Node]) -> list[fx.Node]:
    """The in-place writes, after the cache write of ``site``, into the value it wrote (or a view of it, or the tensor
    it is a view of): ``k.mul_(2)`` after ``k_cache[:, :, pos] = k``. The dense cache holds the value before the
    change; the latent rewrite appends the value node later in the graph, so a latent would hold it after."""
    write, value = nodes[site.write_node], nodes[site.value_node]
    chain = [value]
    while op_name(chain[-1]) in _SAME_ELEMENTS and chain[-1].args and isinstance(chain[-1].args[0], fx.Node) \
            and len(chain) < 16:
        chain.append(chain[-1].args[0])
    return sorted({w for n in chain for w in _writers(n) if w > write})


def written_cache_buffers(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """Map each 4-D KV-cache-like buffer (a placeholder or a buffer allocated in the graph) written in place at
    positions (``index_copy_`` / ``setitem`` / ``index_put_``) to its writes."""
    out: dict[fx.Node, list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr") or op_name(n) in ALLOC_OPS:
            if len(shape_of(n) or ()) == 4:
                writes = positional_writes(n)
                if writes:
                    out[n] = writes
    return out


def buffers_read(k: fx.Node, v: fx.Node) -> set[fx.Node]:
    """The nodes an attention reads its keys ``k`` and values ``v`` from: the :func:`trace_kv` bases, the buffer of a
    functional ``index_put``, and the tensor under an up-projection (MLA)."""
    out: set[fx.Node] = set()
    for x in (k, v):
        base = trace_kv(x).base
        out.add(base)
        if op_name(base) == "index_put" and isinstance(base.args[0], fx.Node):
            out.add(strip_views(base.args[0]))
        proj = _through_splits(base)
        if is_projection(proj) and proj.args and isinstance(proj.args[0], fx.Node):
            out.add(trace_kv(proj.args[0]).base)
    return out


def _itemsize(node: fx.Node) -> int:
    """Bytes per element of ``node``'s tensor (2 when unknown)."""
    dtype = dtype_of(node)
    return dtype.itemsize if dtype is not None else 2


def grown_cache(trace: KVTrace) -> fx.Node | None:
    """Return the ``cat`` node when K/V grow along the sequence dim (a dynamic cache), else None.

    Matches ``cat([past, new], dim=-2)`` of two or more tensors (``past`` may be an empty tensor created
    in the graph on the first call), on (B, H, T, D) keys.
    """
    base = trace.base
    if op_name(base) != "cat":
        return None
    shape = shape_of(base)
    dim = arg(base, 1, "dim", 0)
    parts = base.args[0] if base.args else ()
    if not shape or not isinstance(dim, int) or not isinstance(parts, (list, tuple)) or len(parts) < 2:
        return None
    rank = len(shape)
    if rank >= 3 and dim % rank == rank - 2:
        return base
    return None


def is_cache_buffer(node: fx.Node) -> bool:
    """True when ``node`` is a tensor with positional writes (placeholder cache or one allocated in-graph)."""
    return bool(positional_writes(node))


def mla_evidence(kt: KVTrace, vt: KVTrace) -> list[fx.Node]:
    """Nodes showing multi-head latent attention, or [] when there are none.

    Two structural signs, either suffices: (1) K or V is an up-projection (linear / matmul by a weight) of
    a cache buffer, i.e. the cache holds a latent; (2) K is assembled along the head dim from several
    parts (``cat(..., dim=-1)``, or a fresh buffer filled by ``copy_`` into last-dim slices) that is not a
    partial RoPE of one tensor (DeepSeek's ``cat(k_nope, k_pe.expand(...))``).
    """
    out: list[fx.Node] = []
    for t in (kt, vt):
        proj = _through_splits(t.base)
        if is_projection(proj) and proj.args and isinstance(proj.args[0], fx.Node):
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
