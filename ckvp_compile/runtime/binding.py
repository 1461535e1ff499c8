"""Find which latent store a captured graph's KV caches belong to (at compile time).

The Dynamo graph receives the model's cache tensors as inputs; under CKVP they are phantoms of a
:class:`~ckvp_compile.runtime.store.LatentKVStore` (:func:`~ckvp_compile.runtime.store.lookup_phantom`). This
module maps each attention site's K and V cache placeholders to (store, layer) and reports why a layer cannot
use the store, so the plan can decide per group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch.fx as fx

from ..analysis.kv_cache import positional_writes
from ..analysis.sites import ATTENTION_UNSUPPORTED_KINDS, GraphAnalysis
from .store import LatentKVStore, lookup_phantom


@dataclass
class LatentBinding:
    """The store a graph's caches belong to.

    Attributes:
        store: the store (one per graph; caches of two stores in one graph are not supported).
        input_index: index in the graph's inputs of one of the store's phantoms (the runtime wrapper looks the
            store of each call up through it).
        layers: layer indices whose K and V caches are both phantoms of ``store`` at the right layer.
        problems: layer -> reason it cannot use the store.
    """

    store: LatentKVStore
    input_index: int
    layers: set[int] = field(default_factory=set)
    problems: dict[int, str] = field(default_factory=dict)


def bind_latent_store(graph: fx.Graph, example_inputs: Sequence[Any], analysis: GraphAnalysis) -> LatentBinding | None:
    """Map the analysis' cache placeholders to a live latent store via the example inputs.

    Args:
        graph: the Dynamo graph (placeholders in the order of ``example_inputs``).
        example_inputs: the real tensors Dynamo passes to the backend.
        analysis: the graph's analysis.
    Returns:
        A :class:`LatentBinding`, or None when no cache of the graph is a phantom (a dense cache).
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    index = {n.name: i for i, n in enumerate(placeholders)}
    binding: LatentBinding | None = None
    for site in analysis.attention:
        hits = []
        for write in (site.k_cache, site.v_cache):
            i = index.get(write.cache_node) if write is not None else None
            hits.append((i, lookup_phantom(example_inputs[i]) if i is not None and i < len(example_inputs) else None))
        (ik, hk), (iv, hv) = hits
        if hk is None and hv is None:
            continue
        if binding is None:
            store = (hk or hv)[0]
            binding = LatentBinding(store, ik if hk is not None else iv)
        if hk is None or hv is None:
            binding.problems[site.layer] = "only one of its K / V caches is a latent-store phantom"
        elif hk[0] is not binding.store or hv[0] is not binding.store:
            binding.problems[site.layer] = "its caches belong to another latent store than the graph's first"
        elif (hk[1], hk[2], hv[1], hv[2]) != (site.layer, "k", site.layer, "v"):
            binding.problems[site.layer] = (
                f"its caches are the store's layer {hk[1]} {hk[2]} / {hv[1]} {hv[2]} phantoms, not layer {site.layer}'s"
            )
        elif (site.num_kv_heads, site.head_dim) != (binding.store.num_kv_heads, binding.store.head_dim):
            binding.problems[site.layer] = (
                f"Hkv/D {site.num_kv_heads}/{site.head_dim} differ from the bases' "
                f"{binding.store.num_kv_heads}/{binding.store.head_dim}"
            )
        else:
            binding.layers.add(site.layer)
    refused = {u.layer: u for u in analysis.unsupported
               if u.layer is not None and u.kind in ATTENTION_UNSUPPORTED_KINDS}
    if binding is None and refused:  # phantoms, but every attention site refused (e.g. post_rope_key): the refused
        # layers' writes into the phantoms stay in the graph, so the plan must report them as blocking
        for i in range(min(len(placeholders), len(example_inputs))):
            hit = lookup_phantom(example_inputs[i])
            if hit is not None:
                binding = LatentBinding(hit[0], i)
                break
    if binding is not None:
        for layer, u in refused.items():
            binding.problems.setdefault(  # with the fix: the error raised for it comes before the warnings would
                layer, f"its attention was refused ({u.kind}): {u.reason.rstrip('.')} (fix: {u.fix.rstrip('.')})")
    # a write into a phantom that no attention site of this graph reads: the graph was split between the cache write
    # and the attention (a graph break), so the rewrite cannot pair them and the write would hit the phantom
    for i, node in enumerate(placeholders[:len(example_inputs)]):
        hit = lookup_phantom(example_inputs[i])
        if hit is None or not positional_writes(node):
            continue
        store, layer, kind = hit
        if binding is None:
            binding = LatentBinding(store, i)
        if layer not in binding.layers and layer not in binding.problems:
            binding.problems[layer] = (
                f"its {kind.upper()} cache is written in this graph but no attention recognised here reads it: "
                "either the graph breaks between the cache write and the attention (e.g. "
                "generate(output_attentions=True) with SDPA, or a print / logging call in the attention forward; "
                "torch._dynamo.explain(model.forward)(...) lists the breaks): remove the break; or the attention is "
                "not one the analysis reads (see the warnings)")
    return binding
