"""Tests for :func:`ckvp_compile.analysis.moe.find_moe_sites` on real Dynamo graphs.

Graphs come from tiny random models (``ckvp_compile.testing``: HF Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE with
each experts implementation, the gpt-fast style model) and from small MoE blocks written here for the routing
and experts variants those models do not cover (top-k before softmax, sigmoid routers, ungated shared experts,
a loop over ``nn.ModuleList`` experts, dense all-experts compute, weights applied before the experts). Captures
are cached per model, so each is compiled once per session.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from ckvp_compile.analysis import analyze
from ckvp_compile.analysis.moe import find_moe_sites
from ckvp_compile.testing import (
    GptFastConfig,
    GptFastMoE,
    build_hf_moe,
    capture_dynamo_graphs,
    capture_prefill_decode_graphs,
)

PROMPT = torch.arange(5)[None] * 7 % 256  # (1, 5)

# family -> (renormalize, shared expert, config overrides)
FAMILIES = {
    "mixtral": (True, False, {}),
    "qwen2_moe": (False, True, {}),
    "qwen3_moe": (True, False, {"norm_topk_prob": True}),
    "olmoe": (False, False, {}),
}
# form id -> (experts_implementation, dtype, expected experts_form)
FORMS = {
    "grouped_mm-fp32": ("grouped_mm", torch.float32, "grouped_mm_fallback"),
    "grouped_mm-bf16": ("grouped_mm", torch.bfloat16, "grouped_mm"),
    "batched_mm": ("batched_mm", torch.float32, "batched_mm"),
    "eager-range-loop": ("eager", torch.float32, "eager_loop"),
}


# ----------------------------------------------------------------------------------------------------------------
# Model builders and cached captures


def _range_loop_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """HF experts forward as a loop over range(E) with torch.where (one graph with dynamic output shapes)."""
    final = torch.zeros_like(hidden_states)
    expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)  # (E, A, T)
    for e in range(self.num_experts):
        slot, token = torch.where(expert_mask[e])
        gate, up = F.linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
        h = F.linear(self.act_fn(gate) * up, self.down_proj[e])
        final.index_add_(0, token, (h * top_k_weights[token, slot, None]).to(final.dtype))
    return final


def _hf_model(family: str, form: str, **shape):
    impl, dtype, _ = FORMS[form]
    model = build_hf_moe(family, experts_implementation=impl, dtype=dtype, **FAMILIES[family][2], **shape)
    if form == "eager-range-loop":
        for layer in model.model.layers:
            layer.mlp.experts.forward = types.MethodType(_range_loop_experts_forward, layer.mlp.experts)
    return model


@functools.lru_cache(maxsize=None)
def hf_graphs(family: str, form: str) -> tuple:
    """Prefill and decode graphs of a 2-layer model (one graph each: the captures compile without breaks)."""
    model = _hf_model(family, form)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=form == "eager-range-loop"):
        prefill, decode = capture_prefill_decode_graphs(model, PROMPT)
    return tuple(prefill + decode)


def hf_eager_graphs(family: str, capture_dynamic: bool, whole_model: bool = False) -> list:
    """Graphs of HF experts_implementation="eager" (the loop over hit experts breaks the graph): of a prefill
    of the whole 1-layer model, or (cheaper) of its MoE block alone on a (1, 5, Dm) input."""
    model = build_hf_moe(family, experts_implementation="eager", num_layers=1, **FAMILIES[family][2])
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=capture_dynamic):
        if whole_model:
            return capture_dynamo_graphs(model, input_ids=PROMPT)
        return capture_dynamo_graphs(model.model.layers[0].mlp, torch.randn(1, 5, 64))


@functools.lru_cache(maxsize=None)
def gpt_fast_graphs() -> tuple:
    torch.manual_seed(0)
    prefill, decode = capture_prefill_decode_graphs(GptFastMoE(GptFastConfig()), PROMPT)
    return tuple(prefill + decode)


def _deepseek_v3(n_group: int, topk_group: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "deepseek_v3", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=32, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_group=n_group, topk_group=topk_group, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, max_position_embeddings=128, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return AutoModelForCausalLM.from_config(config, experts_implementation="grouped_mm").eval()


class _GatherEinsumExperts(nn.Module):
    """gpt-fast ConditionalFeedForward: w[expert_indices] gathers, then einsum."""

    def __init__(self, dim: int, num_experts: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, ffn, dim) * 0.1)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, ffn) * 0.1)
        self.w3 = nn.Parameter(torch.randn(num_experts, ffn, dim) * 0.1)

    def forward(self, x, indices, weights, weights_first=False):  # (T, Dm), (T, A), (T, A) -> (T, Dm)
        x1 = F.silu(torch.einsum("ti,taoi->tao", x, self.w1[indices]))
        x3 = torch.einsum("ti,taoi->tao", x, self.w3[indices])
        if weights_first:  # scale the hidden activations, then just sum the k outputs
            out = torch.einsum("tao,taio->tai", x1 * x3 * weights[..., None], self.w2[indices])
            return out.sum(dim=1)
        out = torch.einsum("tao,taio->tai", x1 * x3, self.w2[indices])  # (T, A, Dm)
        return torch.einsum("tai,ta->ti", out, weights)


class _ModuleListLoopExperts(nn.Module):
    """transformers 4.x Mixtral style: an nn.ModuleList of SwiGLU experts, a loop over range(E) with where."""

    def __init__(self, dim: int, num_experts: int, ffn: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(
            nn.ModuleDict({"w1": nn.Linear(dim, ffn, bias=False), "w3": nn.Linear(dim, ffn, bias=False),
                           "w2": nn.Linear(ffn, dim, bias=False)}) for _ in range(num_experts))

    def forward(self, x, indices, weights):
        out = torch.zeros_like(x)
        mask = F.one_hot(indices, num_classes=len(self.experts)).permute(2, 1, 0)  # (E, A, T)
        for e, ex in enumerate(self.experts):
            slot, token = torch.where(mask[e])
            h = x[None, token].reshape(-1, x.shape[-1])
            h = ex["w2"](F.silu(ex["w1"](h)) * ex["w3"](h)) * weights[token, slot, None]
            out.index_add_(0, token, h)
        return out


class _DenseMaskedExperts(nn.Module):
    """Every expert on every token, masked by the routing: not a known experts form."""

    def __init__(self, dim: int, num_experts: int, ffn: int) -> None:
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(dim, ffn, bias=False) for _ in range(num_experts))
        self.down = nn.ModuleList(nn.Linear(ffn, dim, bias=False) for _ in range(num_experts))

    def forward(self, x, indices, weights):
        dense = torch.zeros(x.shape[0], len(self.up), device=x.device).scatter(1, indices, weights)  # (T, E)
        return sum(d(F.silu(u(x))) * dense[:, e, None] for e, (u, d) in enumerate(zip(self.up, self.down)))


class _Block(nn.Module):
    """A MoE block with a configurable router, experts form and shared expert."""

    def __init__(self, dim=64, num_experts=4, top_k=2, ffn=32, *, routing="softmax_topk", renorm=True,
                 experts="einsum", shared="none", weights_first=False, paged_read=False) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        if paged_read:  # a (P, Dm, Dm) table gathered by a page index buffer, like a paged KV-cache read
            self.pages = nn.Parameter(torch.randn(3, dim, dim) * 0.01)
            self.register_buffer("page_table", torch.tensor([2, 0, 1, 1, 0, 2] * 4))
        self.paged_read = paged_read
        self.experts = {"einsum": _GatherEinsumExperts, "module_list_loop": _ModuleListLoopExperts,
                        "dense_masked": _DenseMaskedExperts}[experts](dim, num_experts, ffn)
        self.top_k, self.routing, self.renorm, self.weights_first = top_k, routing, renorm, weights_first
        if shared != "none":
            self.shared_gate_proj = nn.Linear(dim, ffn, bias=False)
            self.shared_up_proj = nn.Linear(dim, ffn, bias=False)
            self.shared_down_proj = nn.Linear(ffn, dim, bias=False)
        self.shared_gate = nn.Linear(dim, 1, bias=False) if shared == "gated" else None
        self.shared = shared

    def forward(self, x):  # (B, S, Dm)
        shape = x.shape
        x = x.view(-1, shape[-1])
        if self.paged_read:
            x = x + torch.einsum("ti,tij->tj", x, self.pages[self.page_table[: x.shape[0]]])
        logits = self.gate(x)  # (T, E)
        if self.routing == "softmax_topk":
            w, idx = torch.topk(F.softmax(logits, dim=-1), self.top_k, dim=-1)
        elif self.routing == "topk_softmax":
            w, idx = torch.topk(logits, self.top_k, dim=-1)
            w = F.softmax(w, dim=-1)
        else:  # sigmoid_topk
            w, idx = torch.topk(torch.sigmoid(logits), self.top_k, dim=-1)
        if self.renorm:
            w = w / w.sum(dim=-1, keepdim=True)
        out = self.experts(x, idx, w, weights_first=True) if self.weights_first else self.experts(x, idx, w)
        if self.shared != "none":
            s = self.shared_down_proj(F.silu(self.shared_gate_proj(x)) * self.shared_up_proj(x))
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(x)) * s
            out = out + s
        return out.view(shape)


class _Stack(nn.Module):
    def __init__(self, num_layers=2, **block_kwargs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(**block_kwargs) for _ in range(num_layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def _block_graphs(model: nn.Module, tokens: int = 6, dynamic_shapes: bool = False) -> list:
    torch.manual_seed(0)
    x = torch.randn(1, tokens, 64)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=dynamic_shapes):
        return capture_dynamo_graphs(model, x)


def _only_graph(graphs) -> torch.fx.GraphModule:
    assert len(graphs) == 1, f"expected one graph (no graph breaks), got {len(graphs)}"
    return graphs[0]


# ----------------------------------------------------------------------------------------------------------------
# HF families x experts forms


# The families differ in their routers (and Qwen2-MoE in its shared expert, added to the routed experts' output);
# their experts are the same code (identical experts classes behind transformers' experts_implementation dispatch,
# or this file's range loop). Qwen2-MoE runs every form; each other family runs its router in bf16 (grouped_mm) and
# in fp32 (one of the three other forms, each of which runs with two families)
@pytest.mark.parametrize("family,form", [
    ("mixtral", "grouped_mm-bf16"), ("mixtral", "eager-range-loop"),
    ("qwen2_moe", "grouped_mm-fp32"), ("qwen2_moe", "grouped_mm-bf16"), ("qwen2_moe", "batched_mm"),
    ("qwen2_moe", "eager-range-loop"),
    ("qwen3_moe", "grouped_mm-bf16"), ("qwen3_moe", "grouped_mm-fp32"),
    ("olmoe", "grouped_mm-bf16"), ("olmoe", "batched_mm")])
def test_hf_family_and_form(family, form):
    renorm, has_shared, _ = FAMILIES[family]
    graphs = hf_graphs(family, form)
    assert len(graphs) == 2, "prefill and decode should each be one graph"
    for gm in graphs:
        sites, unsupported = find_moe_sites(gm.graph)
        assert unsupported == []
        assert [s.layer for s in sites] == [0, 1]
        for s in sites:
            assert s.module_path == f"model.layers.{s.layer}.mlp"
            assert (s.num_experts, s.top_k, s.hidden_dim, s.ffn_dim) == (4, 2, 64, 32)
            assert s.scoring == "softmax" and s.softmax_before_topk
            assert s.renormalize is renorm
            assert s.experts_form == FORMS[form][2]
            assert (s.shared_expert is not None) is has_shared
            assert s.expert_weights[0].endswith("['gate_up_proj']")
            assert s.expert_weights[-1].endswith("['down_proj']")
            assert f"['{s.layer}']" in s.expert_weights[0]
            nodes = {n.name: n for n in gm.graph.nodes}
            assert nodes[s.router_node].meta["example_value"].shape[-1] == 4
            assert s.output_node in nodes and nodes[s.output_node].meta["example_value"].shape[-1] == 64
            n_gemms = 2 * 4 if form == "eager-range-loop" else 2
            assert len(s.expert_nodes) == n_gemms
            if has_shared:
                assert s.shared_expert.gate_node is not None and len(s.shared_expert.gate_up_nodes) == 2
                assert s.output_node.startswith("expert_output")  # the add of routed + shared, reshaped


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_eager_loop_graph_break_is_reported(family):
    graphs = hf_eager_graphs(family, False)
    assert len(graphs) > 1, "HF eager experts are expected to graph-break"
    reports = [u for gm in graphs for u in find_moe_sites(gm.graph)[1]]
    assert all(find_moe_sites(gm.graph)[0] == [] for gm in graphs)
    assert [u.kind for u in reports] == ["eager_loop_graph_break"]
    assert "E=4, A=2" in reports[0].reason
    assert 'experts_implementation="grouped_mm"' in reports[0].fix


def test_hf_eager_loop_still_breaks_with_dynamic_output_shapes():
    """HF's loop iterates over a data-dependent tensor, so capture_dynamic_output_shape_ops does not help."""
    graphs = hf_eager_graphs("mixtral", True, whole_model=True)
    reports = [(u.kind, u.layer) for gm in graphs for u in find_moe_sites(gm.graph)[1]]
    assert reports == [("eager_loop_graph_break", None)]  # the block is its own frame: no layer path
    assert all(find_moe_sites(gm.graph)[0] == [] for gm in graphs)


def test_gpt_fast_weight_gather_einsum():
    graphs = gpt_fast_graphs()
    assert len(graphs) == 2
    for gm in graphs:
        sites, unsupported = find_moe_sites(gm.graph)
        assert unsupported == []
        assert [s.layer for s in sites] == [0, 1]
        for s in sites:
            assert s.experts_form == "weight_gather_einsum"
            assert s.module_path == f"layers.{s.layer}.block_sparse_moe"
            assert (s.num_experts, s.top_k, s.hidden_dim, s.ffn_dim) == (4, 2, 64, 32)
            assert s.softmax_before_topk and s.renormalize and s.scoring == "softmax"
            assert [w.split("'")[-2] for w in s.expert_weights] == ["w1", "w3", "w2"]
            assert len(s.expert_nodes) == 3 and s.shared_expert is None


def test_deepseek_v3_group_limited_router_is_unsupported():
    graphs = capture_dynamo_graphs(_deepseek_v3(n_group=2, topk_group=1), input_ids=PROMPT)
    gm = _only_graph(graphs)
    sites, unsupported = find_moe_sites(gm.graph)
    assert sites == []
    assert [(u.kind, u.layer) for u in unsupported] == [("unsupported_router", 1)]  # layer 0 is dense
    reason = unsupported[0].reason
    for what in ("masked_fill", "e_score_correction_bias", "gathered from the scores", "routed_scaling_factor",
                 "grouped_mm_fallback experts"):
        assert what in reason


def test_dense_model_has_no_moe_sites():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    model = AutoModelForCausalLM.from_config(config).eval()
    for gm in capture_prefill_decode_graphs(model, PROMPT)[0]:
        assert any(n.target is F.scaled_dot_product_attention for n in gm.graph.nodes)
        assert find_moe_sites(gm.graph) == ([], [])


# ----------------------------------------------------------------------------------------------------------------
# Routing and experts variants


@pytest.mark.parametrize(
    "routing, renorm, scoring, before",
    [("softmax_topk", True, "softmax", True), ("softmax_topk", False, "softmax", True),
     ("topk_softmax", False, "softmax", False), ("sigmoid_topk", True, "sigmoid", True)],
)
def test_routing_variants(routing, renorm, scoring, before):
    gm = _only_graph(_block_graphs(_Stack(routing=routing, renorm=renorm)))
    sites, unsupported = find_moe_sites(gm.graph)
    assert unsupported == []
    assert [(s.layer, s.scoring, s.softmax_before_topk, s.renormalize) for s in sites] == [
        (0, scoring, before, renorm), (1, scoring, before, renorm)]
    nodes = {n.name: n for n in gm.graph.nodes}
    assert all(nodes[s.scoring_node].target in (F.softmax, torch.sigmoid) for s in sites)


@pytest.mark.parametrize("shared", ["gated", "ungated"])
def test_shared_expert(shared):
    gm = _only_graph(_block_graphs(_Stack(shared=shared)))
    sites, _ = find_moe_sites(gm.graph)
    assert len(sites) == 2
    for s in sites:
        se = s.shared_expert
        assert se is not None and len(se.gate_up_nodes) == 2 and se.down_node is not None
        assert (se.gate_node is not None) is (shared == "gated")
        assert s.output_node == se.combine_node or s.output_node.startswith("view")


def test_module_list_eager_loop_is_one_graph_and_detected():
    gm = _only_graph(_block_graphs(_Stack(experts="module_list_loop"), dynamic_shapes=True))
    sites, unsupported = find_moe_sites(gm.graph)
    assert unsupported == []
    assert [s.layer for s in sites] == [0, 1]
    for s in sites:
        assert s.experts_form == "eager_loop" and len(s.expert_nodes) == 4 * 3
        assert len(s.expert_weights) == 4 * 3 and "['w1']" in s.expert_weights[0]
        assert (s.hidden_dim, s.ffn_dim, s.renormalize) == (64, 32, True)


def test_dense_masked_experts_reported_as_unknown_form():
    gm = _only_graph(_block_graphs(_Stack(experts="dense_masked", num_layers=1)))
    sites, unsupported = find_moe_sites(gm.graph)
    assert sites == []
    assert [(u.kind, u.layer) for u in unsupported] == [("unknown_experts_form", 0)]


def test_weights_applied_inside_the_experts_reported():
    gm = _only_graph(_block_graphs(_Stack(weights_first=True, num_layers=1)))
    sites, unsupported = find_moe_sites(gm.graph)
    assert sites == []
    assert [(u.kind, u.layer) for u in unsupported] == [("unknown_combine", 0)]
    assert "weight_gather_einsum" in unsupported[0].reason


def test_gathers_not_indexed_by_the_router_are_not_experts():
    gm = _only_graph(_block_graphs(_Stack(paged_read=True)))
    sites, unsupported = find_moe_sites(gm.graph)
    assert unsupported == []
    assert [(s.layer, len(s.expert_nodes)) for s in sites] == [(0, 3), (1, 3)]
    assert not any("pages" in w for s in sites for w in s.expert_weights)


def test_layer_index_comes_from_the_module_path():
    """Qwen3-MoE with decoder_sparse_step=2: layers 1 and 3 are sparse, 0 and 2 dense."""
    model = build_hf_moe("qwen3_moe", num_layers=4, decoder_sparse_step=2, norm_topk_prob=True)
    sites, unsupported = find_moe_sites(_only_graph(capture_dynamo_graphs(model, input_ids=PROMPT)).graph)
    assert unsupported == []
    assert [(s.layer, s.module_path) for s in sites] == [(1, "model.layers.1.mlp"), (3, "model.layers.3.mlp")]


def test_never_raises_on_graphs_without_metadata():
    """symbolic_trace gives no example values, no sources and call_module linears: nothing is found."""
    gm = torch.fx.symbolic_trace(_Stack(num_layers=1).layers[0])
    assert any(n.target is torch.topk for n in gm.graph.nodes)
    assert find_moe_sites(gm.graph) == ([], [])


def test_fallback_layer_numbering_without_numbered_modules():
    class TwoBlocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = _Block(top_k=1), _Block(top_k=3)

        def forward(self, x):
            return self.second(x + self.first(x))

    gm = _only_graph(_block_graphs(TwoBlocks()))
    sites, _ = find_moe_sites(gm.graph)
    assert [(s.layer, s.top_k, s.module_path) for s in sites] == [(0, 1, "first"), (1, 3, "second")]


# ----------------------------------------------------------------------------------------------------------------
# Properties


@given(
    family=st.sampled_from(["gpt_fast", "mixtral", "qwen2_moe"]),
    num_experts=st.integers(2, 16),
    data=st.data(),
    num_layers=st.integers(1, 4),
)
def test_sites_follow_the_config(family, num_experts, data, num_layers):
    top_k = data.draw(st.integers(1, min(8, num_experts)), label="top_k")
    if family == "gpt_fast":
        torch.manual_seed(0)
        model = GptFastMoE(GptFastConfig(n_layer=num_layers, num_experts=num_experts,
                                         num_activated_experts=top_k))
        graphs = capture_dynamo_graphs(model, PROMPT)  # a cacheless full forward
    else:
        model = build_hf_moe(family, num_layers=num_layers, num_experts=num_experts, top_k=top_k)
        graphs = capture_dynamo_graphs(model, input_ids=PROMPT)
    sites, unsupported = find_moe_sites(_only_graph(graphs).graph)
    assert unsupported == []
    assert [s.layer for s in sites] == list(range(num_layers))
    assert {(s.num_experts, s.top_k) for s in sites} == {(num_experts, top_k)}
    assert all((s.shared_expert is not None) is (family == "qwen2_moe") for s in sites)


@pytest.mark.parametrize("which", ["qwen2_moe/grouped_mm-bf16", "mixtral/eager-range-loop", "gpt_fast"])
def test_analysis_is_read_only_and_idempotent(which):
    graphs = gpt_fast_graphs() if which == "gpt_fast" else hf_graphs(*which.split("/"))
    for gm in graphs:
        code = gm.code
        before = [(n.name, n.op, n.target, n.args, n.kwargs, tuple(n.meta)) for n in gm.graph.nodes]
        first = find_moe_sites(gm.graph)
        second = find_moe_sites(gm.graph)
        assert first == second and len(first[0]) == 2
        assert gm.code == code
        assert [(n.name, n.op, n.target, n.args, n.kwargs, tuple(n.meta)) for n in gm.graph.nodes] == before
        assert analyze(gm).moe == tuple(first[0])
