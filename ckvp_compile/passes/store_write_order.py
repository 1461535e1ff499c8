"""StoreWriteOrderPass: every functionalized ckvp store write goes after the last read of the value it overwrites,
so that Inductor writes the store in place instead of cloning it.

Runs on Inductor's functional post-grad graph ('post_grad' stage, as the ``post_grad_custom_post_pass``: after
Inductor's ``reorder_for_locality`` and pattern passes, before ``reinplace_inplaceable_ops``; the order of
``torch/_inductor/fx_passes/post_grad.py`` in torch 2.11 and 2.13).

Why: :class:`~ckvp_compile.passes.latent_kv_cache.LatentKVCachePass` puts each group's ``ckvp.latent_append``
(and ``ckvp.rope_table_update``, ``ckvp.online_basis_fit``, ``ckvp.residual_append``) after the group's last
``ckvp.latent_attention``, which reads the latent *before* the append (the call's own tokens are attended exactly).
AOTAutograd functionalizes the write into ``auto_functionalized_v2(latent_append, _all_bases=[latent])`` plus a
``latent.copy_(result)`` epilogue, and the read-before-write order is no data dependency any more: Inductor's
``reorder_for_locality`` moves the last attention of each group (a producer) down next to its consumers, past
the functional append. The reinplace pass then sees a read of the store placeholder after the write ("any use
of views after node") and keeps the functional form: a clone of the whole latent per group (and of the RoPE
tables) every decode step, copied back at the end of the graph, i.e. traffic proportional to the cache per step
and twice its memory at peak. This pass restores the order::

    before (after reorder_for_locality)              after
    -----------------------------------              -----
    w = auto_functionalized_v2(latent_append,        out3 = ckvp.latent_attention(q3, latent, ...)
            _all_bases=[latent])                     w = auto_functionalized_v2(latent_append,
    out3 = ckvp.latent_attention(q3, latent, ...)            _all_bases=[latent])
    ...                                              ...
    latent.copy_(getitem(w, 1))                      latent.copy_(getitem(w, 1))

A stable topological sort of the whole graph with one extra edge ``reader -> write`` for every node that reads
the storage a write overwrites (the base itself, any alias of it, found by fake-tensor storage as the reinplace
pass finds them) and does not itself depend on the write; otherwise the original order is kept (among ready
nodes, the earliest first). A write that a reader of its old value depends on cannot be ordered so: such a
graph (a cycle) is left unchanged, with the reason in :attr:`notes`, and Inductor clones as before (correct,
slower). The functional graph's meaning does not change: only independent nodes swap.

Reference: torch/_inductor/fx_passes/reinplace.py (``reinplace_inplaceable_ops_core``, ``can_inplace``);
torch/_inductor/fx_passes/post_grad.py (``reorder_for_locality``).
"""

from __future__ import annotations

import heapq
import logging
from collections import defaultdict

import torch.fx as fx

from .. import _compat
from .base import CKVPPass

logger = logging.getLogger(__name__)

#: the op namespace whose functionalized writes the pass orders (the latent store's ops)
NAMESPACE = "ckvp"


def store_writes(graph: fx.Graph) -> list[tuple[fx.Node, list[fx.Node]]]:
    """Return the functionalized ckvp writes of ``graph`` as ``(node, mutated nodes)``, in graph order.

    Args:
        graph: a post-grad (functional ATen) graph.
    Returns:
        One entry per ``auto_functionalized`` / ``auto_functionalized_v2`` node wrapping a ``ckvp::`` op.
    """
    out = []
    for node in graph.nodes:
        hit = _compat.functionalized_mutation(node)
        if hit is not None and getattr(hit[0], "namespace", "") == NAMESPACE:
            out.append((node, hit[1]))
    return out


class StoreWriteOrderPass(CKVPPass):
    """Order every functionalized ckvp store write after the reads of the value it overwrites (module docstring).

    ``apply`` returns the number of writes that had a read of their old value after them (0: the graph already
    had the order, and is left as it was).
    """

    name = "store_write_order"
    stage = "post_grad"

    def __init__(self) -> None:
        #: why the graph was left unchanged (key -1: the whole graph), '' when it was ordered
        self.notes: dict[int, str] = {}

    def is_applicable(self, graph: fx.Graph) -> str:
        return "" if store_writes(graph) else "no functionalized ckvp store write in the graph"

    def apply(self, graph: fx.Graph) -> int:
        nodes = [n for n in graph.nodes if n.op != "output"]
        pos = {n: i for i, n in enumerate(nodes)}
        by_storage: dict[object, list[fx.Node]] = defaultdict(list)
        for n in nodes:
            key = _compat.node_storage(n)
            if key is not None:
                by_storage[key].append(n)
        extra: dict[fx.Node, set[fx.Node]] = {}
        late = 0
        for write, bases in store_writes(graph):
            after = _descendants(write)
            readers: set[fx.Node] = set()
            for base in bases:
                key = _compat.node_storage(base)
                for alias in by_storage.get(key, [base]) if key is not None else [base]:
                    readers.update(u for u in alias.users if u is not write and u not in after)
            readers.discard(write)
            if readers:
                extra[write] = readers
                late += any(pos[r] > pos[write] for r in readers)
        if not late:
            return 0
        order = _stable_order(nodes, pos, extra)
        if order is None:
            self.notes[-1] = ("a read of a store tensor's old value depends on its write: left in Inductor's order "
                              "(the write is cloned)")
            logger.warning("ckvp: %s", self.notes[-1])
            return 0
        for a, b in zip(order, order[1:]):
            if a.next is not b:
                a.append(b)
        output = next(iter(graph.find_nodes(op="output")), None)
        if output is not None and order and order[-1].next is not output:
            order[-1].append(output)
        logger.debug("ckvp: %d store write(s) moved after the reads of their old values", late)
        return late


def _descendants(node: fx.Node) -> set[fx.Node]:
    """Every node that depends on ``node`` (through its users, transitively), ``node`` excluded."""
    seen: set[fx.Node] = set()
    stack = list(node.users)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.users)
    return seen


def _stable_order(nodes: list[fx.Node], pos: dict[fx.Node, int],
                  extra: dict[fx.Node, set[fx.Node]]) -> list[fx.Node] | None:
    """Topological order of ``nodes`` (the output node excluded) under their data edges plus ``extra`` (node ->
    nodes that must precede it), the earliest original position first among ready nodes; None on a cycle."""
    preds: dict[fx.Node, set[fx.Node]] = {}
    succs: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for n in nodes:
        p = {a for a in n.all_input_nodes if a in pos} | extra.get(n, set())
        preds[n] = p
        for a in p:
            succs[a].append(n)
    waiting = {n: len(p) for n, p in preds.items()}
    ready = [pos[n] for n in nodes if not waiting[n]]
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        n = nodes[heapq.heappop(ready)]
        order.append(n)
        for s in succs[n]:
            waiting[s] -= 1
            if not waiting[s]:
                heapq.heappush(ready, pos[s])
    return order if len(order) == len(nodes) else None
