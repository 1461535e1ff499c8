"""Tests of ckvp_compile.analysis.attention: attention, RoPE and KV-cache sites found by graph structure.

Graphs come from tiny random models (no hub access): the four HF MoE families and the gpt-fast model of
``ckvp_compile.testing``, DeepSeek-V3 (MLA), dynamic-cache and sliding-window configurations, and the
hand-written blocks of ``hand_attention.py`` (softmax(QK^T)V; interleaved, complex and partial RoPE; every
cache-write form). Besides the reported fields, ``k_in`` is checked by value: running the captured graph
through an ``fx.Interpreter`` must give exactly the pre-RoPE key the eager model computed.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from hypothesis import given, strategies as st

from ckvp_compile.analysis.attention import find_attention_sites
from ckvp_compile.analysis.graph import ancestors, layer_index, node_map, op_name, placeholder_source, shape_of
from ckvp_compile.analysis.sites import AttentionSite
from ckvp_compile.testing.decoding import hf_step_kwargs, make_static_cache
from ckvp_compile.testing.models import (
    HF_FAMILIES,
    GptFastConfig,
    GptFastMoE,
    build_hf_moe,
    capture_dynamo_graphs,
    capture_prefill_decode_graphs,
)
from ckvp_compile.testing.strategies import moe_model_shapes
from hand_attention import ClassicMLA, HandModel, HandSpec

SHAPE = dict(num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4, top_k=2, ffn=32)
PROMPT_LEN, CACHE_LEN = 5, 32
MODELS = HF_FAMILIES + ("gpt_fast_complex", "gpt_fast_rotate_half")
#: model -> (RoPE form, cache-write form)
EXPECTED = {
    "mixtral": ("rotate_half", "index_copy_"),
    "qwen2_moe": ("rotate_half", "index_copy_"),
    "qwen3_moe": ("rotate_half", "index_copy_"),
    "olmoe": ("rotate_half", "index_copy_"),
    "gpt_fast_complex": ("complex", "setitem"),
    "gpt_fast_rotate_half": ("rotate_half", "setitem"),
}
#: Ops that only occur inside RoPE (or its tables): none may lie between the key projection and k_in.
ROPE_ONLY_OPS = {"neg", "cat", "stack", "cos", "sin", "view_as_complex", "view_as_real", "polar"}


def _build(name: str, **shape):
    if name.startswith("gpt_fast"):
        torch.manual_seed(0)
        return GptFastMoE(GptFastConfig.from_shape(shape, rope_form=name.removeprefix("gpt_fast_"))).eval()
    return build_hf_moe(name, **shape)


def _prompt(seqlen: int = PROMPT_LEN) -> torch.Tensor:
    return torch.randint(0, 256, (1, seqlen), generator=torch.Generator().manual_seed(0))


@functools.lru_cache(maxsize=None)
def _captured(name: str) -> tuple[list[fx.GraphModule], list[fx.GraphModule]]:
    """(prefill graphs, decode graphs) of a static-cache run of model ``name`` (captured once per session)."""
    return capture_prefill_decode_graphs(_build(name, **SHAPE), _prompt(), max_cache_len=CACHE_LEN)


def _one_graph(graphs: list[fx.GraphModule]) -> fx.GraphModule:
    assert len(graphs) == 1, f"expected one graph (no breaks), got {len(graphs)}"
    return graphs[0]


class ValueBackend:
    """Records the graph and runs it through an ``fx.Interpreter``, keeping a copy of every tensor computed."""

    def __init__(self) -> None:
        self.graphs: list[fx.GraphModule] = []
        self.values: dict[str, torch.Tensor] = {}

    def __call__(self, gm: fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        values = self.values

        class Recorder(fx.Interpreter):
            def run_node(self, n):
                out = super().run_node(n)
                if isinstance(out, torch.Tensor):
                    values[n.name] = out.detach().clone()
                return out

        return lambda *args: Recorder(gm).run(*args)


def _run_recorded(model, *args, **kwargs) -> ValueBackend:
    torch._dynamo.reset()
    backend = ValueBackend()
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True, dynamic=False)(*args, **kwargs)
    return backend


def _rope_free_path(nodes: dict[str, fx.Node], k_proj: str, k_in: str) -> bool:
    """True when nothing between the key projection and k_in is a RoPE op (k_in is really pre-RoPE)."""
    proj, kin = nodes[k_proj], nodes[k_in]
    between = ({kin} | ancestors(kin)) - ({proj} | ancestors(proj))
    return not any(op_name(n) in ROPE_ONLY_OPS for n in between)


def check_site(gm: fx.GraphModule, s: AttentionSite, *, heads: int, kv_heads: int, head_dim: int,
               rope_form: str | None, rotary_dim: int | None = None, cache_form: str | None,
               cache_len: int | None = None) -> None:
    """Assert one site's fields, each against the graph it was found in."""
    nodes = node_map(gm.graph)
    attn = nodes[s.attention_node]
    assert op_name(attn) in (("sdpa",) if s.form == "sdpa" else ("matmul", "einsum"))
    assert layer_index(attn) in (s.layer, None)
    assert (s.num_heads, s.num_kv_heads, s.head_dim, s.gqa_ratio) == (heads, kv_heads, head_dim, heads // kv_heads)
    # gqa_form is what the graph does
    if heads == kv_heads:
        assert s.gqa_form == "none"
    elif s.gqa_form == "enable_gqa":
        assert attn.kwargs.get("enable_gqa") is True and shape_of(attn.args[1])[1] == kv_heads
    elif s.gqa_form == "repeat_kv":
        k_read = attn.args[1] if s.form == "sdpa" else None
        if k_read is not None:
            assert shape_of(k_read)[1] == heads
    else:
        assert s.gqa_form == "broadcast"
    # projections are linears (or weight matmuls); o_proj consumes the attention output
    for proj in (s.q_proj, s.k_proj, s.v_proj, s.o_proj):
        assert proj is not None and op_name(nodes[proj]) in ("linear", "matmul")
    assert attn in ancestors(nodes[s.o_proj])
    # RoPE
    if rope_form is None:
        assert s.rope is None
    else:
        r = s.rope
        assert r is not None and r.form == rope_form
        assert r.rotary_dim == (rotary_dim or head_dim) and r.partial == (r.rotary_dim < head_dim)
        kin = nodes[r.k_in]
        assert nodes[r.k_in] in ancestors(nodes[r.k_out])
        assert shape_of(kin)[-1] == head_dim and kv_heads in shape_of(kin)[1:3]
        assert _rope_free_path(nodes, s.k_proj, r.k_in), "k_in lies after a RoPE op"
        assert any(op_name(n) in ROPE_ONLY_OPS | {"mul"} for n in ancestors(nodes[r.k_out]) - ancestors(kin))
        assert r.q_out is not None and nodes[r.q_out] in ancestors(attn)
    # cache writes
    if cache_form is None:
        assert s.k_cache is None and s.v_cache is None
        return
    for c, kind in ((s.k_cache, "k"), (s.v_cache, "v")):
        assert c is not None and c.kind == kind and c.form == cache_form
        write, buf = nodes[c.write_node], nodes[c.cache_node]
        assert write.args[0] is buf and op_name(write) == cache_form
        assert write < attn
        assert c.cache_shape == shape_of(buf) and c.cache_shape[1] == kv_heads and c.cache_shape[-1] == head_dim
        if cache_len is not None:
            assert c.cache_shape[2] == cache_len
        assert c.itemsize == 4
        if buf.op == "placeholder":
            assert c.cache_source == placeholder_source(buf)
        else:
            assert c.cache_source == "graph" and op_name(buf) == "zeros"
        assert c.position_node is not None
    assert s.k_cache.cache_node != s.v_cache.cache_node
    if s.rope is not None:
        written = nodes[s.k_cache.value_node]
        assert written is nodes[s.rope.k_out] or nodes[s.rope.k_out] in ancestors(written)


# ------------------------------------------------------------------------------------------------------------------
# HF families and gpt-fast: one site per layer, prefill and decode


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("name", MODELS)
def test_one_site_per_layer(name, phase):
    pre, dec = _captured(name)
    gm = _one_graph(pre if phase == "prefill" else dec)
    sites, unsupported = find_attention_sites(gm.graph)
    assert unsupported == []
    assert [s.layer for s in sites] == [0, 1]
    rope_form, cache_form = EXPECTED[name]
    for s in sites:
        check_site(gm, s, heads=4, kv_heads=2, head_dim=16, rope_form=rope_form, cache_form=cache_form,
                   cache_len=CACHE_LEN)
        assert s.form == "sdpa" and s.module_path.endswith(str(s.layer) + (".self_attn" if name in HF_FAMILIES
                                                                                 else ".attention"))
        nodes = node_map(gm.graph)
        weight = placeholder_source(nodes[s.k_proj].args[1])
        assert ("k_proj" if name in HF_FAMILIES else "wqkv") in weight and str(s.layer) in weight
        assert "o_proj" in placeholder_source(nodes[s.o_proj].args[1]) or name not in HF_FAMILIES
        if name in HF_FAMILIES:
            # transformers 5.24 creates StaticCache buffers lazily inside the prefill graph
            buf = nodes[s.k_cache.cache_node]
            assert (buf.op == "placeholder") == (phase == "decode")
            if phase == "decode":
                assert s.k_cache.cache_source.endswith(f"layers[{s.layer}].keys")
                assert s.v_cache.cache_source.endswith(f"layers[{s.layer}].values")
        else:
            assert s.gqa_form == "repeat_kv"
            assert s.k_cache.cache_source.endswith("['k_cache']") and f"['{s.layer}']" in s.k_cache.cache_source


@pytest.mark.parametrize("name", MODELS)
def test_k_in_is_the_pre_rope_key_by_value(name):
    """Interpreting the prefill graph gives, at k_in, exactly the eager pre-RoPE key (after q/k norms)."""
    model, ids = _build(name, **SHAPE), _prompt()
    refs: dict[int, torch.Tensor] = {}
    hooks = []
    if name in HF_FAMILIES:
        for i, layer in enumerate(model.model.layers):
            mod = getattr(layer.self_attn, "k_norm", None) or layer.self_attn.k_proj
            hooks.append(mod.register_forward_hook(lambda m, a, out, i=i: refs.__setitem__(i, out.detach().clone())))

        def call(m):
            return m(**hf_step_kwargs(model, ids, make_static_cache(model, CACHE_LEN), 0))
    else:
        q_width = model.config.n_head * model.config.head_dim
        kv_width = model.config.n_local_heads * model.config.head_dim
        for i, layer in enumerate(model.layers):
            hooks.append(layer.attention.wqkv.register_forward_hook(
                lambda m, a, out, i=i: refs.__setitem__(i, out[..., q_width:q_width + kv_width].detach().clone())))

        def call(m):
            model.setup_caches(1, CACHE_LEN)
            return m(ids, torch.arange(PROMPT_LEN))
    with torch.no_grad():
        call(model)
    for h in hooks:
        h.remove()
    torch._dynamo.reset()
    backend = ValueBackend()
    with torch.no_grad():
        call(torch.compile(model, backend=backend, fullgraph=True, dynamic=False))
    sites, _ = find_attention_sites(_one_graph(backend.graphs).graph)
    assert len(sites) == 2
    for s in sites:
        got = backend.values[s.rope.k_in]
        ref = refs[s.layer].reshape(1, PROMPT_LEN, 2, 16)  # (B, S, Hkv, D)
        # bitwise equal on the CPU machines; other BLAS builds (the GPU image's CPU path) differ by ~5e-7
        torch.testing.assert_close(got if got.shape == ref.shape else got.transpose(1, 2), ref, rtol=1e-6, atol=1e-6)


@given(shape=moe_model_shapes(max_layers=4).filter(lambda s: s["head_dim"] in (8, 16, 32)))
def test_mixtral_shapes(shape):
    """Any Mixtral shape: one site per layer with H, Hkv, D, gqa read correctly, in prefill and decode."""
    pre, dec = capture_prefill_decode_graphs(build_hf_moe("mixtral", **shape), _prompt(4), max_cache_len=16)
    h, hkv, d = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    for gm in (_one_graph(pre), _one_graph(dec)):
        sites, unsupported = find_attention_sites(gm.graph)
        assert unsupported == []
        assert [s.layer for s in sites] == list(range(shape["num_layers"]))
        for s in sites:
            check_site(gm, s, heads=h, kv_heads=hkv, head_dim=d, rope_form="rotate_half",
                       cache_form="index_copy_", cache_len=16)


@given(shape=moe_model_shapes(max_layers=3).filter(lambda s: s["head_dim"] in (8, 16, 32)),
       rope_form=st.sampled_from(["complex", "rotate_half"]))
def test_gpt_fast_shapes(shape, rope_form):
    model = GptFastMoE(GptFastConfig.from_shape(shape, rope_form=rope_form)).eval()
    pre, dec = capture_prefill_decode_graphs(model, _prompt(4), max_cache_len=16)
    for gm in (_one_graph(pre), _one_graph(dec)):
        sites, unsupported = find_attention_sites(gm.graph)
        assert unsupported == [] and [s.layer for s in sites] == list(range(shape["num_layers"]))
        for s in sites:
            check_site(gm, s, heads=shape["num_heads"], kv_heads=shape["num_kv_heads"], head_dim=shape["head_dim"],
                       rope_form=rope_form, cache_form="setitem", cache_len=16)


def test_hf_eager_attention_is_softmax_qkv():
    """attn_implementation='eager' writes softmax(QK^T * scaling + mask) V out: found as softmax_qkv."""
    model = build_hf_moe("qwen3_moe", attn_implementation="eager", **SHAPE)
    pre, dec = capture_prefill_decode_graphs(model, _prompt(), max_cache_len=CACHE_LEN)
    for gm in (_one_graph(pre), _one_graph(dec)):
        sites, unsupported = find_attention_sites(gm.graph)
        assert unsupported == [] and [s.layer for s in sites] == [0, 1]
        for s in sites:
            assert s.form == "softmax_qkv" and s.scale == pytest.approx(0.25)
            check_site(gm, s, heads=4, kv_heads=2, head_dim=16, rope_form="rotate_half", cache_form="index_copy_")


# ------------------------------------------------------------------------------------------------------------------
# hand-written attention: the other RoPE, cache-write, product and GQA forms

HAND_CASES = [
    # spec, expected rope form, rotary_dim, gqa_form
    (HandSpec(), "interleaved", 16, "repeat_kv"),
    (HandSpec(rotary_dim=8), "interleaved", 8, "repeat_kv"),
    (HandSpec(rope="interleaved", rotary_dim=12, product="einsum", n_kv=1), "interleaved", 12, "repeat_kv"),
    (HandSpec(rope="pairs", cache="index_put_", product="einsum"), "interleaved", 16, "repeat_kv"),
    (HandSpec(rope="pairs", rotary_dim=8, cache="index_copy_", gqa="expand"), "interleaved", 8, "repeat_kv"),
    (HandSpec(rope="complex", rotary_dim=8, cache="index_copy_", product="bmm", gqa="expand"), "complex", 8,
     "repeat_kv"),
    (HandSpec(rope="complex", cache="index_put"), "complex", 16, "repeat_kv"),
    (HandSpec(rope="rotate_half_split", rotary_dim=8, cache="index_put", gqa="broadcast"), "rotate_half", 8,
     "broadcast"),
    (HandSpec(rope="halves_cat", cache=None), "rotate_half", 16, "repeat_kv"),
    (HandSpec(rope="none", n_kv=4), None, None, "none"),
]


@pytest.mark.parametrize("spec, rope_form, rotary_dim, gqa_form", HAND_CASES,
                         ids=[f"{c[0].rope}-rd{c[0].rotary_dim}-{c[0].cache}-{c[0].product}-{c[0].gqa}"
                              for c in HAND_CASES])
def test_hand_written_forms(spec, rope_form, rotary_dim, gqa_form):
    torch.manual_seed(0)
    model = HandModel(spec).eval()
    x, pos = torch.randn(1, PROMPT_LEN, spec.dim), torch.arange(PROMPT_LEN)
    with torch.no_grad():
        model(x, pos)  # eager: keeps each layer's pre-RoPE key in last_k_in
    backend = _run_recorded(model, x, pos)
    gm = _one_graph(backend.graphs)
    sites, unsupported = find_attention_sites(gm.graph)
    assert unsupported == [] and [s.layer for s in sites] == [0, 1]
    for s in sites:
        assert s.form == "softmax_qkv" and s.gqa_form == gqa_form
        assert s.scale == pytest.approx(spec.head_dim ** -0.5)
        assert s.module_path == f"layers.{s.layer}.attn"
        check_site(gm, s, heads=spec.n_head, kv_heads=spec.n_kv, head_dim=spec.head_dim, rope_form=rope_form,
                   rotary_dim=rotary_dim, cache_form=spec.cache, cache_len=spec.max_len)
        if s.rope is not None:
            ref = model.layers[s.layer].attn.last_k_in
            torch.testing.assert_close(backend.values[s.rope.k_in], ref, rtol=0, atol=0)


def test_unrecognised_rope_gives_no_site():
    """A key rotated in a form the analysis does not know must not be reported as a RoPE-free key: no site, and
    each layer's cache writes are reported with the reason (not left unexplained)."""
    model = HandModel(HandSpec(rope="signed_table")).eval()
    gm = _one_graph(capture_dynamo_graphs(model, torch.randn(1, PROMPT_LEN, 48), torch.arange(PROMPT_LEN)))
    sites, unsupported = find_attention_sites(gm.graph)
    assert sites == [] and [(u.kind, u.layer) for u in unsupported] == [("unrecognised_attention", 0),
                                                                         ("unrecognised_attention", 1)]
    assert all("transformed by a table" in u.reason for u in unsupported)


def test_plain_forward_has_sites_without_cache():
    """A forward without a cache: sites with k_cache=None, nothing unsupported."""
    model = build_hf_moe("mixtral", **SHAPE)
    gm = _one_graph(capture_dynamo_graphs(model, input_ids=_prompt(), use_cache=False))
    sites, unsupported = find_attention_sites(gm.graph)
    assert unsupported == [] and [s.layer for s in sites] == [0, 1]
    for s in sites:
        check_site(gm, s, heads=4, kv_heads=2, head_dim=16, rope_form="rotate_half", cache_form=None)


def test_layer_index_comes_from_the_module_path_not_graph_order():
    """Layers run in reverse: the first attention in the graph is layer 1 (from nn_module_stack)."""

    class Reversed(HandModel):
        def forward(self, x, pos):
            for layer in reversed(self.layers):
                x = layer(x, pos)
            return x

    gm = _one_graph(capture_dynamo_graphs(Reversed(HandSpec(n_layer=3)).eval(), torch.randn(1, PROMPT_LEN, 48),
                                          torch.arange(PROMPT_LEN)))
    sites, _ = find_attention_sites(gm.graph)
    assert [s.layer for s in sites] == [2, 1, 0]
    assert [s.module_path for s in sites] == ["layers.2.attn", "layers.1.attn", "layers.0.attn"]
    assert [s.k_cache.cache_source.count("['2']") for s in sites] == [1, 0, 0]


def test_layers_numbered_in_graph_order_without_module_paths():
    """Attention in a plain function (no nn_module_stack): sites numbered 0, 1, ... in graph order."""

    def two_attentions(x, wq, wk, wv, wo):
        for _ in range(2):
            q = F.linear(x, wq).view(1, 4, 2, 8).transpose(1, 2)
            k = F.linear(x, wk).view(1, 4, 2, 8).transpose(1, 2)
            v = F.linear(x, wv).view(1, 4, 2, 8).transpose(1, 2)
            x = x + F.linear(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, 4, 16), wo)
        return x

    w = [torch.randn(16, 16) for _ in range(4)]
    gm = _one_graph(capture_dynamo_graphs(two_attentions, torch.randn(1, 4, 16), *w))
    sites, unsupported = find_attention_sites(gm.graph)
    assert unsupported == [] and [s.layer for s in sites] == [0, 1]
    assert all(layer_index(node_map(gm.graph)[s.attention_node]) is None for s in sites)
    assert sites[0].attention_node != sites[1].attention_node
    assert all(s.rope is None and s.k_cache is None and s.num_heads == 2 for s in sites)


# ------------------------------------------------------------------------------------------------------------------
# unsupported patterns: reported with kind, reason and fix, and no site


def _kinds(unsupported) -> list[tuple[str, int]]:
    return [(u.kind, u.layer) for u in unsupported]


def test_dynamic_cache_is_unsupported():
    from transformers import DynamicCache

    model = build_hf_moe("mixtral", **SHAPE)
    cache = DynamicCache(config=model.config)
    ids = _prompt()
    prefill = capture_dynamo_graphs(model, **hf_step_kwargs(model, ids, cache, 0))
    decode = capture_dynamo_graphs(model, **hf_step_kwargs(model, ids[:, :1], cache, PROMPT_LEN))
    for gm in (_one_graph(prefill), _one_graph(decode)):
        sites, unsupported = find_attention_sites(gm.graph)
        assert sites == []
        assert _kinds(unsupported) == [("dynamic_cache", 0), ("dynamic_cache", 1)]
        nodes = node_map(gm.graph)
        for u in unsupported:
            assert "static" in u.fix and "StaticCache" in u.fix
            assert any(op_name(nodes[n]) == "cat" for n in u.nodes)


def _deepseek_v3():
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=128, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=0, n_group=1, topk_group=1,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def test_deepseek_v3_mla_is_unsupported():
    model = _deepseek_v3()
    pre, dec = capture_prefill_decode_graphs(model, _prompt(), max_cache_len=CACHE_LEN)
    plain = capture_dynamo_graphs(model, input_ids=_prompt(), use_cache=False)
    for gm in (_one_graph(pre), _one_graph(dec), _one_graph(plain)):
        sites, unsupported = find_attention_sites(gm.graph)
        assert sites == []
        assert _kinds(unsupported) == [("mla_attention", 0), ("mla_attention", 1)]
        assert all(u.fix == "nothing to do, ckvp leaves MLA as is." for u in unsupported)


def test_classic_mla_with_concatenated_rope_part_is_unsupported():
    """DeepSeek-V2-style keys cat(k_nope, k_pe.expand(...)): MLA, not a partial RoPE."""
    model = HandModel(HandSpec(), attn_cls=ClassicMLA).eval()
    gm = _one_graph(capture_dynamo_graphs(model, torch.randn(1, PROMPT_LEN, 48), torch.arange(PROMPT_LEN)))
    sites, unsupported = find_attention_sites(gm.graph)
    assert sites == [] and _kinds(unsupported) == [("mla_attention", 0), ("mla_attention", 1)]


def test_sliding_window_is_unsupported():
    model = build_hf_moe("mixtral", sliding_window=8, **SHAPE)
    pre, dec = capture_prefill_decode_graphs(model, _prompt(), max_cache_len=CACHE_LEN)
    for gm in (_one_graph(pre), _one_graph(dec)):
        sites, unsupported = find_attention_sites(gm.graph)
        assert sites == []
        assert _kinds(unsupported) == [("sliding_window", 0), ("sliding_window", 1)]
        assert all("window of 8" in u.reason for u in unsupported)


def test_sliding_window_only_on_the_layers_that_use_it():
    """Qwen2-MoE with max_window_layers=2: layer 0 slides, layer 1 attends fully (a site)."""
    model = build_hf_moe("qwen2_moe", use_sliding_window=True, sliding_window=4, max_window_layers=2, **SHAPE)
    pre, dec = capture_prefill_decode_graphs(model, _prompt(), max_cache_len=CACHE_LEN)
    for gm in (_one_graph(pre), _one_graph(dec)):
        sites, unsupported = find_attention_sites(gm.graph)
        assert _kinds(unsupported) == [("sliding_window", 0)] and "window of 4" in unsupported[0].reason
        assert [s.layer for s in sites] == [1]
        check_site(gm, sites[0], heads=4, kv_heads=2, head_dim=16, rope_form="rotate_half",
                   cache_form="index_copy_", cache_len=CACHE_LEN)


def test_hand_written_sliding_window_is_unsupported():
    model = HandModel(HandSpec(window=3)).eval()
    gm = _one_graph(capture_dynamo_graphs(model, torch.randn(1, PROMPT_LEN, 48), torch.arange(PROMPT_LEN)))
    sites, unsupported = find_attention_sites(gm.graph)
    assert sites == [] and _kinds(unsupported) == [("sliding_window", 0), ("sliding_window", 1)]
    assert "window of 3" in unsupported[0].reason


# ------------------------------------------------------------------------------------------------------------------
# read-only, idempotent, never raises


def _snapshot(gm: fx.GraphModule):
    return gm.code, [(n.name, n.op, n.target, n.args, n.kwargs, tuple(n.meta)) for n in gm.graph.nodes]


@pytest.mark.parametrize("name", ["mixtral", "gpt_fast_complex"])
def test_analysis_is_read_only_and_idempotent(name):
    pre, dec = _captured(name)
    for gm in (pre[0], dec[0]):
        before = _snapshot(gm)
        first = find_attention_sites(gm.graph)
        second = find_attention_sites(gm.graph)
        assert _snapshot(gm) == before
        assert first == second and len(first[0]) == 2


def test_analyze_reports_the_attention_findings():
    from ckvp_compile.analysis import analyze

    gm = _captured("qwen3_moe")[1][0]
    sites, unsupported = find_attention_sites(gm.graph)
    result = analyze(gm)
    assert result.attention == tuple(sorted(sites, key=lambda s: s.layer)) and len(result.attention) == 2
    assert set(unsupported) <= set(result.unsupported)
    assert result.attention_by_layer()[1].rope.k_in == sites[1].rope.k_in


def test_unknown_graphs_give_no_sites_and_do_not_raise():
    # sdpa over graph inputs (K from nowhere in particular), a softmax feeding topk (a router), an empty graph
    def router_and_bare_sdpa(x, w, q, k, v):
        probs = F.linear(x, w).softmax(-1)
        return probs.topk(2), F.scaled_dot_product_attention(q, k, v)

    q = torch.randn(1, 2, 3, 8)
    gm = _one_graph(capture_dynamo_graphs(router_and_bare_sdpa, torch.randn(3, 8), torch.randn(4, 8), q, q, q))
    assert find_attention_sites(gm.graph) == ([], [])
    assert find_attention_sites(fx.Graph()) == ([], [])
