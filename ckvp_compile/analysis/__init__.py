"""Read-only analysis of a Dynamo FX graph: the attention / KV-cache and expert-dispatch sites of each layer.

Sites are found by graph structure (SDPA or softmax(QK^T)V, in-place writes into cache buffers, router
linear -> softmax -> top-k -> experts), never by module class names. :func:`analyze` never raises on a
pattern it does not know: it returns empty findings, and lists recognised-but-unusable patterns in
``GraphAnalysis.unsupported`` with the reason and the fix.
"""

from __future__ import annotations

import torch.fx as fx

from .attention import find_attention_sites
from .moe import find_moe_sites
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
    "AttentionSite",
    "CacheWriteSite",
    "GraphAnalysis",
    "MoESite",
    "RopeSite",
    "SharedExpertSite",
    "UnsupportedSite",
]


def analyze(gm: fx.GraphModule | fx.Graph) -> GraphAnalysis:
    """Find every layer's attention site and MoE site in a Dynamo (torch-level) FX graph.

    Args:
        gm: the graph module Dynamo hands to a backend (parameters and buffers are placeholders with
            ``grapharg`` metadata; ``nn_module_stack`` names the module path), or its graph.
    Returns:
        A frozen :class:`GraphAnalysis`: attention and MoE sites sorted by layer, and the unsupported
        patterns found, each with its reason and fix. The graph is not modified.
    Raises:
        Nothing for unknown patterns (they are simply not reported as sites).
    """
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    attention, attn_unsupported = find_attention_sites(graph)
    moe, moe_unsupported = find_moe_sites(graph)
    return GraphAnalysis(
        attention=tuple(sorted(attention, key=lambda s: s.layer)),
        moe=tuple(sorted(moe, key=lambda s: s.layer)),
        unsupported=tuple(attn_unsupported) + tuple(moe_unsupported),
        num_nodes=len(graph.nodes),
    )
