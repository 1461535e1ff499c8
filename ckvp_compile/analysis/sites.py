"""Frozen findings of the graph analysis: what was found, where, and what could not be used.

Findings refer to FX nodes by name (``node.name``), so they are hashable, printable and stay valid
for the graph they were computed on; :func:`ckvp_compile.analysis.graph.node_map` turns a name back into
a node. Shapes use the dimension glossary of the package: ``H`` query heads, ``Hkv`` KV heads,
``D`` head dim, ``E`` experts, ``A`` active experts per token (top-k), ``Dm`` model dim, ``I`` expert FFN dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

RopeForm = Literal["rotate_half", "interleaved", "complex"]
CacheWriteForm = Literal["index_copy_", "setitem", "index_put_", "index_put"]
AttentionForm = Literal["sdpa", "softmax_qkv"]
ExpertsForm = Literal[
    "grouped_mm",  # torch._grouped_mm / F.grouped_mm with offsets (HF 'grouped_mm' on bf16)
    "grouped_mm_fallback",  # the opaque transformers.grouped_mm_fallback custom op (HF 'grouped_mm' on fp32)
    "batched_mm",  # weights gathered per (token, slot) then bmm (HF 'batched_mm')
    "eager_loop",  # a loop over experts with per-expert masks (HF 'eager', when captured)
    "weight_gather_einsum",  # gpt-fast: w[expert_indices] then einsum
]


@dataclass(frozen=True)
class RopeSite:
    """The rotary position embedding applied to one layer's queries and keys.

    Attributes:
        form: 'rotate_half' (HF/Llama: ``x*cos + cat(-x2, x1)*sin``), 'interleaved' (GPT-J: pairs
            (x0,x1),(x2,x3)... rotated, e.g. through ``stack(-x_odd, x_even)``), or 'complex'
            (gpt-fast/Meta: ``view_as_complex(x) * freqs_cis``).
        rotary_dim: how many leading channels of each head are rotated (== head_dim unless partial).
        partial: True when ``rotary_dim < head_dim`` (the rest pass through, as in Phi / GLM / Qwen3-Next).
        q_out: node name of the rotated query; k_out: node name of the rotated key.
        k_in: node name of the key before RoPE (the pre-RoPE key CKVP projects).
        cos: node name of the cosine table (or the complex frequencies), None if not identified.
        sin: node name of the sine table, None for the complex form.
        tables_paired: the graph builds both tables with one angle per rotated pair (HF's
            ``cat((freqs, freqs), -1)``; :func:`~.rope.tables_paired`), so a kernel may read half of each.
        k_in_perm: the permutation ``p`` with the tensor written to the cache equal to ``rotation(k_in).permute(p)``:
            ``(0, 1, 2, 3)`` (Hugging Face: (B, Hkv, S, D) before RoPE) or ``(0, 2, 1, 3)`` (gpt-fast: RoPE on
            (B, S, Hkv, D), transposed after), read off values by :func:`~.rope.cached_key_layout`; None when not
            decided (the rewrite then goes by sizes).
        k_scale: node name of a factor applied to the rotated key after RoPE, constant along the head dim, (..., 1)
            in ``k_in``'s layout (:func:`~.rope.match_row_scale`; Llama-4's weightless ``qk_norm``): the cached key
            is ``(rotation(k_in) * k_scale).permute(k_in_perm)``, so CKVP projects ``k_in * k_scale`` (RoPE is
            linear); None when there is none.
    """

    form: RopeForm
    rotary_dim: int
    partial: bool
    q_out: str | None
    k_out: str | None
    k_in: str | None
    cos: str | None = None
    sin: str | None = None
    tables_paired: bool = False
    k_in_perm: tuple[int, ...] | None = None
    k_scale: str | None = None


@dataclass(frozen=True)
class CacheWriteSite:
    """One in-place write of new keys or values into a KV-cache buffer.

    Attributes:
        kind: 'k' or 'v'.
        form: how the write is written: 'index_copy_' (HF StaticCache), 'setitem' (gpt-fast
            ``k_cache[:, :, pos] = k``), 'index_put_' / 'index_put'.
        write_node: node name of the write. cache_node: node name of the buffer written (a placeholder, or
            a tensor created in the graph on a lazily initialised cache's first call).
        cache_source: Dynamo source of the buffer (``L['self'].layers[0].attention.kv_cache.k_cache``) or
            'graph' when created in the graph.
        value_node: node name of the (B, Hkv, S, D) tensor written. position_node: the positions (or None).
        cache_shape: (B, Hkv, S_max, D) of the buffer.
        itemsize: bytes per element of the buffer (4 fp32, 2 bf16/fp16).
    """

    kind: Literal["k", "v"]
    form: CacheWriteForm
    write_node: str
    cache_node: str
    cache_source: str
    value_node: str
    position_node: str | None
    cache_shape: tuple[int, ...]
    itemsize: int = 2


@dataclass(frozen=True)
class AttentionSite:
    """One layer's attention: the op, its Q/K/V/O projections, RoPE, GQA and the KV-cache writes.

    Attributes:
        layer: layer index (from ``nn_module_stack``; falls back to order of appearance).
        module_path: module path of the attention (``model.layers.3.self_attn``).
        form: 'sdpa' (one scaled_dot_product_attention node) or 'softmax_qkv' (hand-written).
        attention_node: node name of the SDPA call, or of the final ``P @ V`` matmul.
        q_proj, k_proj, v_proj, o_proj: node names of the projections (linear / matmul), None when not found.
        num_heads (H), num_kv_heads (Hkv), head_dim (D), gqa_ratio (H // Hkv; 1 is MHA, H is MQA).
        gqa_form: 'none' (H == Hkv), 'repeat_kv' (K/V expanded in the graph), 'enable_gqa' (SDPA flag),
            'broadcast' (grouped einsum/matmul).
        rope: the RoPE site, None when the layer applies none.
        k_cache, v_cache: the cache writes, None for attention without a cache (e.g. a forward without
            past_key_values).
        is_causal: the SDPA ``is_causal`` flag, or None when a mask is passed.
        scale: the softmax scale when given explicitly, else None (1/sqrt(D)).
    """

    layer: int
    module_path: str
    form: AttentionForm
    attention_node: str
    q_proj: str | None
    k_proj: str | None
    v_proj: str | None
    o_proj: str | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    gqa_ratio: int
    gqa_form: Literal["none", "repeat_kv", "enable_gqa", "broadcast"]
    rope: RopeSite | None
    k_cache: CacheWriteSite | None
    v_cache: CacheWriteSite | None
    is_causal: bool | None = None
    scale: float | None = None


@dataclass(frozen=True)
class SharedExpertSite:
    """An always-active shared expert (Qwen2-MoE), optionally gated by ``sigmoid(linear(x))``.

    Attributes:
        gate_up_nodes: node names of its input projections; down_node: its output projection.
        gate_node: node name of the sigmoid gate's linear, None when ungated.
        combine_node: node name of the add that joins it to the routed experts' output.
    """

    gate_up_nodes: tuple[str, ...]
    down_node: str | None
    gate_node: str | None
    combine_node: str | None


@dataclass(frozen=True)
class MoESite:
    """One layer's expert dispatch: router -> scoring -> top-k -> (renormalise) -> experts -> combine.

    Attributes:
        layer, module_path: as for AttentionSite.
        router_node: node name of the router linear, (T, Dm) -> (T, E).
        scoring: 'softmax' or 'sigmoid'. scoring_node: its node name.
        topk_node: node name of the top-k; top_k (A) and num_experts (E) from its shapes.
        softmax_before_topk: True for Mixtral (softmax over all E then top-k), False for top-k on logits
            then softmax over the k.
        renormalize: True when the top-k weights are divided by their sum (Mixtral, Qwen3 norm_topk_prob).
        experts_form: how the expert FFNs are computed (see ``ExpertsForm``).
        expert_nodes: node names of the expert GEMMs (grouped_mm / bmm / einsum / per-expert linears).
        expert_weights: Dynamo sources (or node names) of the stacked expert weights, gate_up first.
        hidden_dim (Dm), ffn_dim (I): from the weight shapes, 0 when unknown.
        shared_expert: the shared expert, None when the layer has none.
        output_node: node name of the combined MoE output (routed plus shared).
    """

    layer: int
    module_path: str
    router_node: str
    scoring: Literal["softmax", "sigmoid"]
    scoring_node: str
    topk_node: str
    num_experts: int
    top_k: int
    softmax_before_topk: bool
    renormalize: bool
    experts_form: ExpertsForm
    expert_nodes: tuple[str, ...]
    expert_weights: tuple[str, ...]
    hidden_dim: int
    ffn_dim: int
    shared_expert: SharedExpertSite | None
    output_node: str | None


@dataclass(frozen=True)
class UnsupportedSite:
    """A pattern that was recognised but cannot be rewritten; it is left untouched.

    Attributes:
        kind: short tag, e.g. 'dynamic_cache', 'mla_attention', 'sliding_window', 'eager_loop_graph_break',
            'no_cache_write', 'unknown_experts_form', 'unrecognised_attention' (a KV-cache
            write that no understood attention reads), 'cache_written_in_place' (a KV cache also written in
            place besides its positional write), 'written_after_cache_write' (a key / value changed in
            place after its cache write), 'rope_positions' (RoPE tables not a function of one position per token:
            multimodal RoPE fed several position streams).
        layer: layer index, or None when not attributable to a layer.
        reason: one sentence saying what was found and why it cannot be used.
        fix: one sentence saying what the user can do.
        nodes: node names involved.
    """

    kind: str
    layer: int | None
    reason: str
    fix: str
    nodes: tuple[str, ...] = ()

    def message(self) -> str:
        """Return the one-line warning text: layer, reason and fix."""
        where = f"layer {self.layer}: " if self.layer is not None else ""
        return f"ckvp: {where}{self.reason} Left untouched. Fix: {self.fix}"


def format_layers(layers: Sequence[int]) -> str:
    """Return layer indices as compact ranges: ``[0, 1, 2, 3, 5]`` -> ``'0-3,5'`` (``''`` when empty)."""
    out: list[str] = []
    items = sorted(set(layers))
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(out)


#: The :class:`UnsupportedSite` kinds the attention analysis reports: they block a layer's KV-cache rewrite only.
#: Every other kind (router, experts form, combine, analysis errors of a MoE) blocks the layer's expert rewrite only.
ATTENTION_UNSUPPORTED_KINDS = frozenset({"mla_attention", "dynamic_cache", "sliding_window", "post_rope_key",
                                         "unrecognised_attention", "cache_written_in_place",
                                         "written_after_cache_write", "rope_positions"})


@dataclass(frozen=True)
class GraphAnalysis:
    """Everything the analysis found in one graph. Never raises on 'not found': lists are just empty.

    Attributes:
        attention: attention sites sorted by layer. moe: MoE sites sorted by layer.
        unsupported: recognised patterns that cannot be used, with reasons.
        num_nodes: nodes in the analysed graph (for reports).
    """

    attention: tuple[AttentionSite, ...] = ()
    moe: tuple[MoESite, ...] = ()
    unsupported: tuple[UnsupportedSite, ...] = ()
    num_nodes: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def layers(self) -> tuple[int, ...]:
        """Sorted layer indices that hold an attention or a MoE site."""
        return tuple(sorted({s.layer for s in self.attention} | {s.layer for s in self.moe}))

    def attention_by_layer(self) -> dict[int, AttentionSite]:
        """Map layer index -> attention site."""
        return {s.layer: s for s in self.attention}

    def moe_by_layer(self) -> dict[int, MoESite]:
        """Map layer index -> MoE site."""
        return {s.layer: s for s in self.moe}
