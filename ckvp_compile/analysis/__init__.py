"""Read-only analysis of a Dynamo FX graph: the attention / KV-cache and expert-dispatch sites of each layer.

Sites are found by graph structure (SDPA or softmax(QK^T)V, in-place writes into cache buffers, router
linear -> softmax -> top-k -> experts), never by module class names. :func:`analyze` never raises on a
pattern it does not know: it returns empty findings, and lists recognised-but-unusable patterns in
``GraphAnalysis.unsupported`` with the reason and the fix.
"""

from __future__ import annotations

import torch.fx as fx

from .attention import attention_findings
from .graph import layer_prefix, number_findings
from .moe import moe_findings
from .sites import (
    AttentionSite,
    CacheWriteSite,
    GraphAnalysis,
    MoESite,
    RopeSite,
    SharedExpertSite,
    UnsupportedSite,
)

__all__ = [
    "analyze",
    "UNNUMBERED_NOTE",
    "AttentionSite",
    "CacheWriteSite",
    "GraphAnalysis",
    "MoESite",
    "RopeSite",
    "SharedExpertSite",
    "UnsupportedSite",
]

#: The note of a graph whose sites have no layer number in their module paths.
UNNUMBERED_NOTE = (
    "sites have no layer index in their module paths: this graph may be reused for several layers (a graph "
    "break inside a layer, or a compiled submodule); layer numbers are positions in this graph"
)


def analyze(gm: fx.GraphModule | fx.Graph) -> GraphAnalysis:
    """Find every layer's attention site and MoE site in a Dynamo (torch-level) FX graph.

    Args:
        gm: the graph module Dynamo hands to a backend (parameters and buffers are placeholders with
            ``grapharg`` metadata; ``nn_module_stack`` names the module path), or its graph.
    Returns:
        A frozen :class:`GraphAnalysis`: attention and MoE sites sorted by layer, and the unsupported
        patterns found, each with its reason and fix. Attention and MoE sites are numbered together
        (:func:`~.graph.assign_layer_indices`), so a layer's attention and MoE share an index. ``notes``
        holds :data:`UNNUMBERED_NOTE` when no site has a numbered module path. The graph is not modified.
    Raises:
        Nothing for unknown patterns (they are simply not reported as sites).
    """
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    attention: list[AttentionSite] = []
    moe: list[MoESite] = []
    unsupported: list[UnsupportedSite] = []
    findings = attention_findings(graph) + moe_findings(graph)  # numbered together: a layer's two sites agree
    for items in number_findings(findings):
        for x in items:
            if isinstance(x, AttentionSite):
                attention.append(x)
            elif isinstance(x, MoESite):
                moe.append(x)
            else:
                unsupported.append(x)
    notes = []
    if (attention or moe) and all(layer_prefix(s.module_path) is None for s in (*attention, *moe)):
        notes.append(UNNUMBERED_NOTE)
    return GraphAnalysis(
        attention=tuple(sorted(attention, key=lambda s: s.layer)),
        moe=tuple(sorted(moe, key=lambda s: s.layer)),
        unsupported=tuple(unsupported),
        num_nodes=len(graph.nodes),
        notes=tuple(notes),
    )
