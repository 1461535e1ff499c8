"""Tests of ckvp_compile.testing: tiny models, the static-cache driver, graph capture, shape strategies."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from ckvp_compile.analysis.graph import op_name, placeholder_source
from ckvp_compile.testing.models import (
    FIXTURE_MODEL_DIR,
    HF_FAMILIES,
    GptFastConfig,
    GptFastMoE,
    build_hf_moe,
    capture_dynamo_graphs,
    capture_prefill_decode_graphs,
    load_fixture_model,
    prefill_decode_logits,
)
from ckvp_compile.testing.strategies import MAX_PARAMS, estimate_moe_params, moe_model_shapes

MODELS = HF_FAMILIES + ("gpt_fast_complex", "gpt_fast_rotate_half")
PROMPT_LEN, N_DECODE, CACHE_LEN = 6, 3, 16


def _build(name: str, **shape):
    if name.startswith("gpt_fast"):
        torch.manual_seed(0)
        return GptFastMoE(GptFastConfig.from_shape(shape, rope_form=name.removeprefix("gpt_fast_")))
    return build_hf_moe(name, **shape)


def _prompt(batch: int = 2, seqlen: int = PROMPT_LEN, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


def _full_forward(model, ids: torch.Tensor) -> torch.Tensor:
    """Cacheless forward over the whole sequence: (B, S, V)."""
    with torch.no_grad():
        if isinstance(model, GptFastMoE):
            return model(ids)
        return model(input_ids=ids, use_cache=False).logits


def _check_cache_path(model, ids: torch.Tensor, outs: list[torch.Tensor]) -> None:
    seq = torch.cat([ids] + [o[:, -1].argmax(-1, keepdim=True) for o in outs[:-1]], dim=1)
    full = _full_forward(model, seq)
    s = ids.shape[1]
    torch.testing.assert_close(outs[0], full[:, :s], atol=1e-5, rtol=1e-5)
    for i, step in enumerate(outs[1:]):
        assert step.shape == (ids.shape[0], 1, full.shape[-1])
        torch.testing.assert_close(step[:, 0], full[:, s + i], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_cached_decode_matches_full_forward(name):
    model = _build(name)
    ids = _prompt()
    outs = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=CACHE_LEN)
    assert len(outs) == 1 + N_DECODE
    assert outs[0].shape == (2, PROMPT_LEN, 256)
    assert outs[0].std() > 0.3  # weights large enough that attention and routing are not uniform
    _check_cache_path(model, ids, outs)
    # A second call starts from a fresh cache and reproduces the first.
    again = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=CACHE_LEN)
    for a, b in zip(outs, again):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("name", MODELS)
def test_prefill_decode_graphs(name):
    model = _build(name, num_layers=2)
    prefill, decode = capture_prefill_decode_graphs(model, _prompt(), max_cache_len=CACHE_LEN)
    assert len(prefill) == 1 and len(decode) == 1, "graph break"
    for gm in (prefill[0], decode[0]):
        assert sum(op_name(n) == "sdpa" for n in gm.graph.nodes) == 2  # one per layer
        assert all("grapharg" in n.meta for n in gm.graph.find_nodes(op="placeholder"))
    decode_sources = [placeholder_source(n) for n in decode[0].graph.find_nodes(op="placeholder")]
    if name.startswith("gpt_fast"):
        for gm in (prefill[0], decode[0]):
            assert sum(op_name(n) == "setitem" for n in gm.graph.nodes) == 4  # K and V per layer
        assert sum("k_cache" in s or "v_cache" in s for s in decode_sources) == 4
    else:
        # StaticCache creates its buffers lazily: torch.zeros inside the prefill graph, placeholders at decode.
        assert sum(op_name(n) == "zeros" for n in prefill[0].graph.nodes) == 4
        assert sum(op_name(n) == "index_copy_" for n in decode[0].graph.nodes) == 4
        # the cache argument is `cache` in transformers >= 5.24, `past_key_values` before
        assert sum(s.startswith(("L['kwargs']['cache']", "L['kwargs']['past_key_values']"))
                   and s.endswith((".keys", ".values"))
                   for s in decode_sources) == 4


@pytest.mark.parametrize("name", ["mixtral", "gpt_fast_complex"])  # the others: one graph per phase above
def test_eager_backend_fullgraph_matches_uncompiled(name):
    model = _build(name)
    ids = _prompt(seed=1)
    torch._dynamo.reset()
    compiled = prefill_decode_logits(model, ids, 2, max_cache_len=CACHE_LEN,
                                     compile_fn=lambda m: torch.compile(m, backend="eager", fullgraph=True))
    plain = prefill_decode_logits(model, ids, 2, max_cache_len=CACHE_LEN)
    for a, b in zip(compiled, plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_build_hf_moe_shapes_are_exact(family):
    hidden = 48 if family != "olmoe" else 3 * 8
    model = build_hf_moe(family, num_layers=3, hidden=hidden, num_heads=3, num_kv_heads=1, head_dim=8,
                         num_experts=5, top_k=3, ffn=24)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim, cfg.num_experts_per_tok) == (3, hidden, 8, 3)
    assert cfg.vocab_size == 256 and cfg.max_position_embeddings >= 512 and not model.training
    layer = model.model.layers[2]
    assert layer.self_attn.q_proj.weight.shape == (3 * 8, hidden)
    assert layer.self_attn.k_proj.weight.shape == (8, hidden)
    assert layer.mlp.experts.gate_up_proj.shape == (5, 2 * 24, hidden)
    assert layer.mlp.experts.down_proj.shape == (5, hidden, 24)
    assert hasattr(layer.mlp, "shared_expert") == (family == "qwen2_moe")


def test_build_hf_moe_rejects_bad_arguments():
    with pytest.raises(ValueError, match="mixtral.*qwen2_moe.*qwen3_moe.*olmoe"):
        build_hf_moe("llama")
    with pytest.raises(ValueError, match="grouped_mm"):
        build_hf_moe("mixtral", experts_implementation="triton")
    with pytest.raises(ValueError, match="num_kv_heads"):
        build_hf_moe("mixtral", num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="hidden == num_heads"):
        build_hf_moe("olmoe", hidden=48)


def test_experts_implementations_agree():
    ids = _prompt(seqlen=5)
    logits = {}
    for impl in ("grouped_mm", "batched_mm", "eager"):
        model = build_hf_moe("qwen3_moe", experts_implementation=impl)
        assert model.config._experts_implementation == impl
        logits[impl] = _full_forward(model, ids)
    torch.testing.assert_close(logits["batched_mm"], logits["grouped_mm"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits["eager"], logits["grouped_mm"], atol=1e-5, rtol=1e-5)


def test_capture_dynamo_graphs_gpt_fast_cacheless():
    graphs = capture_dynamo_graphs(_build("gpt_fast_complex", num_layers=3), _prompt())
    assert len(graphs) == 1
    names = [op_name(n) for n in graphs[0].graph.nodes]
    assert names.count("sdpa") == 3 and names.count("setitem") == 0
    assert names.count("einsum") == 3 * 4 and "view_as_complex" in names and "topk" in names


@pytest.mark.skipif(not (FIXTURE_MODEL_DIR / "model.safetensors").is_file(), reason="fixture model missing")
def test_fixture_model_predicts_held_out_text():
    model = load_fixture_model()
    assert type(model).__name__ == "MixtralForCausalLM" and model.dtype == torch.float32
    text = (FIXTURE_MODEL_DIR / "eval_text.txt").read_bytes()[:129]
    ids = torch.tensor(list(text))[None]
    logits = _full_forward(model, ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:])
    assert loss < 2.0  # byte perplexity about 2.3 (loss 0.85); random weights would give ln 256 = 5.5


@settings(max_examples=6, deadline=None, derandomize=True)
@given(shape=moe_model_shapes(max_layers=3))
def test_drawn_shapes_build_and_decode(shape):
    assert estimate_moe_params(shape) <= MAX_PARAMS
    model = _build("gpt_fast_complex", **shape)
    assert sum(p.numel() for p in model.parameters()) <= estimate_moe_params(shape)
    ids = _prompt(batch=1, seqlen=3)
    _check_cache_path(model, ids, prefill_decode_logits(model, ids, 2, max_cache_len=8))


def test_eager_prefill_then_compiled_decode_matches():
    model = _build("qwen2_moe")
    ids = _prompt(seed=2)
    torch._dynamo.reset()
    outs = prefill_decode_logits(model, ids, 2, max_cache_len=CACHE_LEN, compile_prefill=False,
                                 compile_fn=lambda m: torch.compile(m, backend="eager", fullgraph=True))
    _check_cache_path(model, ids, outs)


def test_prefill_decode_logits_refuses_bad_lengths_with_the_fix():
    """Too long for the cache, a negative step count, or fewer teacher-forced tokens than steps: a ValueError that
    names the numbers, before anything runs."""
    model = GptFastMoE(GptFastConfig(n_layer=1)).eval()
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="max_cache_len=5"):
        prefill_decode_logits(model, ids, 2, max_cache_len=5)
    with pytest.raises(ValueError, match="n_decode=-1"):
        prefill_decode_logits(model, ids, -1)
    with pytest.raises(ValueError, match="holds 1 steps but n_decode=2"):
        prefill_decode_logits(model, ids, 2, tokens=[torch.zeros(1, 1, dtype=torch.long)])
