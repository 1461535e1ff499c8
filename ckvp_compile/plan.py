"""The plan: which sites are rewritten, how layers group for the cross-layer latent, and why anything is not.

analysis -> **plan** -> rewrite. The plan is a pure function of the :class:`GraphAnalysis` and the
:class:`CKVPConfig`; it never touches the graph. Every site gets a :class:`SiteDecision` with a reason, so
``ckvp-inspect`` can say why each site was or was not rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .analysis.sites import ATTENTION_UNSUPPORTED_KINDS, AttentionSite, GraphAnalysis, UnsupportedSite
from .config import CKVPConfig


#: Why a dense-cache attention site is kept when ``enable_latent_kv`` is off, and how to turn the rewrite on.
LATENT_KV_OFF = ("enable_latent_kv is off: set enable_latent_kv=True and give the model a ckvp latent cache "
                 "(CKVPStaticCache or use_latent_cache; README, 'Latent KV cache') to compress it")
#: Why a MoE site is kept when ``enable_expert_gemm`` is False, and how to turn the rewrite on.
EXPERT_GEMM_OFF = ("enable_expert_gemm is off: set enable_expert_gemm=True to rewrite its routed experts into "
                   "ckvp::moe_experts (grouped expert GEMM)")
#: Why a MoE site is kept when ``enable_expert_gemm='auto'`` (the default) resolves to off: a graph not on CUDA.
EXPERT_GEMM_AUTO_OFF = ("enable_expert_gemm='auto' rewrites routed experts only in graphs on CUDA (elsewhere "
                        "ckvp::moe_experts runs its PyTorch reference, no faster): set enable_expert_gemm=True to "
                        "rewrite them here anyway (in calls without gradients: the op is inference-only)")


@dataclass(frozen=True)
class LayerGroup:
    """Adjacent attention layers that share one latent KV cache (DESIGN.md: a group of G layers).

    Attributes:
        index: group number, from 0. layers: the layer indices, ascending and consecutive.
        num_kv_heads (Hkv) and head_dim (D): shared by every layer of the group.
    """

    index: int
    layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class SiteDecision:
    """Whether one site is rewritten, and why.

    Attributes:
        kind: 'attention' or 'moe'. layer: its layer index. rewrite: True when a pass will rewrite it.
        reason: one sentence, e.g. 'enable_latent_kv is off' or 'no KV-cache write found'.
    """

    kind: Literal["attention", "moe"]
    layer: int
    rewrite: bool
    reason: str


@dataclass(frozen=True)
class Plan:
    """The result of planning one graph.

    Attributes:
        groups: the layer groups of cache-carrying attention layers (last may be shorter than G): the latent
            store's calibrated groups when the caches are latent caches, else grouped by ``config.group_size``.
        decisions: one per attention and MoE site, in layer order.
        unsupported: recognised patterns left untouched (from the analysis).
        kv_bytes_per_token_dense: bytes of K and V cached per token over all layers, as the model stores
            them (2 * Hkv * D * itemsize per layer); 0 when no cache write was found.
        kv_bytes_per_token_planned: the same after the planned rewrites (== dense when none): latent rows in
            their storage formats plus the int32 slot position; the bases (shared) are not included.
        config_hash: :meth:`CKVPConfig.compute_hash` of the options the plan was made with.
        latent_groups: indices of the latent store's groups to rewrite (empty without a store).
        blocking: reasons the graph cannot be compiled at all (a latent-store cache the rewrite cannot
            take over: left untouched it would read a phantom); the backend raises them as errors.
    """

    groups: tuple[LayerGroup, ...]
    decisions: tuple[SiteDecision, ...]
    unsupported: tuple[UnsupportedSite, ...]
    kv_bytes_per_token_dense: int
    kv_bytes_per_token_planned: int
    config_hash: str
    latent_groups: tuple[int, ...] = ()
    blocking: tuple[str, ...] = ()

    @property
    def rewrites(self) -> tuple[SiteDecision, ...]:
        """The decisions that rewrite a site."""
        return tuple(d for d in self.decisions if d.rewrite)


def make_layer_groups(sites: tuple[AttentionSite, ...], group_size: int) -> tuple[LayerGroup, ...]:
    """Split cache-carrying attention sites into groups of ``group_size`` adjacent, same-shape layers.

    A group is cut early when the next layer is not adjacent (a layer without a usable site lies between)
    or has another KV shape (Hkv, D); so every group holds consecutive layers of one shape.

    Args:
        sites: attention sites sorted by layer; those without both K and V cache writes are ignored.
        group_size: G, the largest group.
    Returns:
        The groups, numbered from 0 in layer order.
    """
    usable = [s for s in sites if s.k_cache is not None and s.v_cache is not None]
    groups: list[LayerGroup] = []
    current: list[AttentionSite] = []

    def flush() -> None:
        if current:
            groups.append(
                LayerGroup(len(groups), tuple(s.layer for s in current), current[0].num_kv_heads, current[0].head_dim)
            )
            current.clear()

    for s in usable:
        if current and (
            len(current) == group_size
            or s.layer != current[-1].layer + 1
            or (s.num_kv_heads, s.head_dim) != (current[0].num_kv_heads, current[0].head_dim)
        ):
            flush()
        current.append(s)
    flush()
    return tuple(groups)


def _dense_kv_bytes_per_token(site: AttentionSite) -> int:
    """Bytes one token adds to this layer's K and V caches (batch 1), from the cache buffers' dtypes."""
    if site.k_cache is None or site.v_cache is None:
        return 0
    return site.num_kv_heads * site.head_dim * (site.k_cache.itemsize + site.v_cache.itemsize)


#: The decision of a layer whose KV-cache writes no understood attention reads (an ``unrecognised_attention``).
UNRECOGNISED_ATTENTION = ("attention not recognised: its KV-cache writes are left as written, the cache stays dense "
                          "(see unsupported for what was found and why)")


def _missing_site_reason(layer: int, graph_layers: list[int], groups: tuple) -> str:
    """Why a latent-cache layer has no attention site in a graph, with the likely causes and their fixes."""
    cache_layers = sorted(x for layers in groups for x in layers)
    return (f"layer {layer} of the group has no attention site in this graph (attention found here: layers "
            f"{graph_layers or 'none'}; the cache's layers: {cache_layers[0]}..{cache_layers[-1]}). Either the cache "
            "was built for another model (another number of layers), or a graph break splits the model's layers "
            "over several graphs: HF experts_implementation='eager' (use 'grouped_mm'), a print or logging call in "
            "a forward, or Dynamo skipping the model's frames after an earlier failed compile of the same model "
            "class in this process (call torch._dynamo.reset()); torch._dynamo.explain(model.forward)(...) lists "
            "the breaks")


def make_plan(analysis: GraphAnalysis, config: CKVPConfig, binding=None) -> Plan:
    """Decide, for every site of ``analysis``, whether it is rewritten under ``config``, and group layers.

    The latent KV rewrite applies to the layers whose caches are phantoms of a latent store (``binding``,
    from :func:`ckvp_compile.runtime.binding.bind_latent_store`), a whole store group at a time. A
    store-backed layer that cannot be rewritten is *blocking*: its dense cache holds no data.

    Args:
        analysis: the findings of :func:`ckvp_compile.analysis.analyze` on one graph.
        config: the options in force; ``enable_expert_gemm='auto'`` must already be resolved for the graph's device
            (:func:`ckvp_compile.backend.resolve_expert_gemm`): left as 'auto' it plans no expert rewrite.
        binding: the graph's :class:`~ckvp_compile.runtime.binding.LatentBinding`, or None (dense caches).
    Returns:
        A frozen :class:`Plan`.
    """
    # an unsupported pattern blocks the rewrites of its own kind in its layer (a router the expert rewrite cannot
    # read leaves the layer's attention free to use a latent cache, and the other way round)
    unsupported_attention = {u.layer for u in analysis.unsupported
                             if u.layer is not None and u.kind in ATTENTION_UNSUPPORTED_KINDS}
    unsupported_moe = {u.layer for u in analysis.unsupported
                       if u.layer is not None and u.kind not in ATTENTION_UNSUPPORTED_KINDS}
    sites = analysis.attention_by_layer()
    latent_groups: list[int] = []
    layer_reason: dict[int, str] = {}
    blocking: list[str] = []
    if binding is not None:
        store = binding.store
        for g, layers in enumerate(store.groups):
            reason = ""
            if not config.enable_latent_kv:
                reason = "enable_latent_kv is off but the cache is a ckvp latent cache"
            for layer in layers:
                if reason:
                    break
                site = sites.get(layer)
                if site is None:
                    reason = _missing_site_reason(layer, sorted(sites), store.groups)
                elif layer in binding.problems:
                    reason = f"layer {layer}: {binding.problems[layer]}"
                elif layer not in binding.layers:
                    reason = f"layer {layer}'s cache is not the store's"
                elif layer in unsupported_attention:
                    reason = f"layer {layer}'s attention has an unsupported pattern (see the warnings)"
                elif site.k_cache.position_node is None or site.v_cache.position_node is None:
                    reason = f"layer {layer}: cache write positions not identified"
                elif site.rope is not None and (site.rope.k_in is None or site.rope.cos is None):
                    reason = f"layer {layer}: RoPE tables or pre-RoPE key not identified"
            if reason:
                present = [layer for layer in layers if layer in binding.layers]
                if present:
                    blocking.append(f"latent group {g} (layers {list(layers)}): {reason}")
                for layer in layers:
                    layer_reason[layer] = reason
            else:
                latent_groups.append(g)
                for layer in layers:
                    layer_reason[layer] = f"latent group {g}"
        for layer, why in binding.problems.items():
            if not any(layer in store.groups[g] for g in latent_groups):
                blocking.append(f"layer {layer}: {why}")
    decisions: list[SiteDecision] = []
    for s in analysis.attention:
        if s.layer in layer_reason:
            rewrite = layer_reason[s.layer].startswith("latent group")
            decisions.append(SiteDecision("attention", s.layer, rewrite, layer_reason[s.layer]))
            continue
        if s.k_cache is None and s.v_cache is None:
            reason = "no KV-cache write found (a forward without a static cache): nothing to compress"
        elif s.k_cache is None or s.v_cache is None:
            found, missing = ("value", "key") if s.k_cache is None else ("key", "value")
            reason = (f"the {found}s come from a cache write but the {missing}s were not traced to one: the layer is "
                      "left as written")
        elif s.layer in unsupported_attention:
            reason = "an unsupported attention pattern was found in this layer (see the warnings)"
        elif not config.enable_latent_kv:
            reason = LATENT_KV_OFF
        else:
            reason = "dense cache: give the model a ckvp latent cache to compress it (README, 'Latent KV cache')"
        decisions.append(SiteDecision("attention", s.layer, False, reason))
    for layer in sorted({u.layer for u in analysis.unsupported if u.kind == "unrecognised_attention"
                         and u.layer is not None} - {s.layer for s in analysis.attention}):
        decisions.append(SiteDecision("attention", layer, False, UNRECOGNISED_ATTENTION))
    for m in analysis.moe:
        if config.enable_expert_gemm is not True:  # False, or 'auto' not resolved to on (backend: not on CUDA)
            off = EXPERT_GEMM_AUTO_OFF if config.enable_expert_gemm == "auto" else EXPERT_GEMM_OFF
            decisions.append(SiteDecision("moe", m.layer, False, off))
        elif m.layer in unsupported_moe:
            decisions.append(SiteDecision("moe", m.layer, False,
                                          "an unsupported MoE pattern was found in this layer (see the warnings)"))
        else:
            decisions.append(SiteDecision("moe", m.layer, True,
                                          f"grouped expert GEMM (ckvp::moe_experts, from {m.experts_form})"))
    decisions.sort(key=lambda d: (d.layer, d.kind))
    dense = sum(_dense_kv_bytes_per_token(s) for s in analysis.attention)
    planned = dense
    if binding is not None and latent_groups:
        store = binding.store
        saved_layers = {layer for g in latent_groups for layer in store.groups[g]}
        planned = sum(_dense_kv_bytes_per_token(s) for s in analysis.attention if s.layer not in saved_layers)
        # latent rows as the store holds them (codes + scales, and the row-major rows' alignment padding)
        planned += sum(sum(store.latent_row_bytes(g)) for g in latent_groups)
        planned += 4  # slot position (int32) per token
    groups = make_layer_groups(analysis.attention, config.group_size)
    if binding is not None:  # the store's calibrated grouping is the one in force
        groups = tuple(
            LayerGroup(g, tuple(layers), binding.store.num_kv_heads, binding.store.head_dim)
            for g, layers in enumerate(binding.store.groups)
        )
    return Plan(
        groups=groups,
        decisions=tuple(decisions),
        unsupported=analysis.unsupported,
        kv_bytes_per_token_dense=dense,
        kv_bytes_per_token_planned=planned,
        config_hash=config.compute_hash(),
        latent_groups=tuple(latent_groups),
        blocking=tuple(blocking),
    )
