"""Attention variants of real architectures against the latent KV cache: exact at full rank, or refused with the reason.

Tiny random-weight Hugging Face models (no downloads) of the MoE families in the installed transformers and a few
dense ones whose attention differs in a way the rewrite must respect (scores multiplier, partial or interleaved
rotary, q/k norms, attention biases, rope scaling types, attention sinks, logit soft-capping, MLA). For each, the
latent cache at full rank (``kv_ratio=1``, float latents, where the store is exact) must give the dense model's
logits through a prefill and decode steps, or ``calibrate()`` / the backend must refuse with a
:class:`~ckvp_compile.errors.CKVPError` that says why. Never different numbers.

Also the regressions found by trying to break the rewrite (each test names what it caught).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ckvp_compile import CKVPBackend, CKVPConfig, CKVPConfigError, CKVPError, CompileRecorder
from ckvp_compile.latent import calibrate
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import build_hf_moe, prefill_decode_logits
from ckvp_compile.testing.decoding import hf_step_kwargs

CACHE = 32
PROMPT = 6
N_DECODE = 8
TOL = 2e-4  # fp32 full rank, as tests/e2e/test_latent_kv.py

#: shapes every tiny model shares (random weights large enough that cache bugs show in logits)
COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, intermediate_size=32, max_position_embeddings=512, initializer_range=0.1,
              tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None, use_cache=True)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)


def _build(family: str, attn: str = "sdpa", drop: tuple[str, ...] = (), **overrides):
    """A tiny random ``family`` causal LM (seed 0, eval, fp32) from :data:`COMMON` minus ``drop``, plus
    ``overrides``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {k: v for k, v in COMMON.items() if k not in drop}
    config = AutoConfig.for_model(family, **{**kwargs, **overrides})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


def _latent_logits(model, ids: torch.Tensor, bases, teacher: list[torch.Tensor], rec=None) -> list[torch.Tensor]:
    """Prefill ``ids`` and N_DECODE steps through a full-rank latent cache, the model compiled with the ckvp
    backend (aot_eager); each step feeds ``teacher``'s argmax token (dense's), so both runs see the same tokens."""
    cache = CKVPStaticCache(model.config, bases, max_cache_len=CACHE, max_batch_size=ids.shape[0])
    step = torch.compile(model, backend=CKVPBackend(CKVPConfig(compiler="aot_eager"), recorder=rec))
    outs = []
    with torch.no_grad():
        outs.append(step(**hf_step_kwargs(model, ids, cache, 0)).logits)
        for i in range(N_DECODE):
            tok = teacher[i][:, -1:].argmax(-1)
            outs.append(step(**hf_step_kwargs(model, tok, cache, ids.shape[1] + i)).logits)
    return outs


def _assert_exact_or_refused(model, refused: str | None, batch: int = 1) -> None:
    """Full-rank latent logits equal dense ones (``refused`` None), or calibrate() / the compiled call raises a
    CKVPError matching ``refused``; either way, the model then still runs eagerly with a dense cache."""
    torch._dynamo.reset()
    ids = torch.randint(0, 256, (batch, PROMPT), generator=torch.Generator().manual_seed(1))
    dense = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=CACHE)
    samples = [torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    if refused is not None:
        with pytest.raises(CKVPError, match=refused):
            bases = calibrate(model, samples, group_size=2, kv_ratio=1.0, progress=False)
            _latent_logits(model, ids, bases, dense)
        torch._dynamo.reset()
        again = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=CACHE)
        for a, b in zip(again, dense):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        return
    bases = calibrate(model, samples, group_size=2, kv_ratio=1.0, progress=False)
    rec = CompileRecorder()
    latent = _latent_logits(model, ids, bases, dense, rec)
    assert len(latent) == len(dense)
    for i, (a, b) in enumerate(zip(latent, dense)):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL, msg=lambda m: f"step {i}: {m}")
    # the cache was really rewritten (the latent store, not a dense fallback, produced these logits)
    assert all("ckvp.latent_append.default(" in g.dynamo_after for g in rec.graphs)


def _mixtral(**overrides):
    return _build("mixtral", sliding_window=None, router_jitter_noise=0.0, **MOE, **overrides)


#: name -> (builder, the reason a refusal must name, or None: exact at full rank)
ARCHITECTURES = {
    # scores multiplier (SDPA scale=), embedding / residual / logits multipliers
    "granitemoe_attention_multiplier": (lambda: _build(
        "granitemoe", **MOE, attention_multiplier=0.3, embedding_multiplier=3.0, residual_multiplier=0.5,
        logits_scaling=2.0, drop=("head_dim",)), None),
    # partial rotary (half the head dim), per-head q/k RMSNorm, q/k/v biases; its DeepSeek-style router is left as is
    "glm4_moe_partial_rotary_qk_norm_bias": (lambda: _build(
        "glm4_moe", moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=0,
        partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True), None),
    # rope scaling types whose tables are static (computed once): each slot's cos / sin are the model's
    "mixtral_rope_linear": (lambda: _mixtral(rope_parameters=dict(rope_type="linear", factor=2.0,
                                                                  rope_theta=10000.0)), None),
    "mixtral_rope_yarn": (lambda: _mixtral(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=10000.0,
                                                                original_max_position_embeddings=128)), None),
    "mixtral_rope_llama3": (lambda: _mixtral(rope_parameters=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, rope_theta=10000.0,
        original_max_position_embeddings=8)), None),
    # MHA and MQA with q/k/v biases and head_dim 8 != hidden / heads
    "qwen2_moe_mha_bias_head_dim_8": (lambda: build_hf_moe("qwen2_moe", num_heads=4, num_kv_heads=4, head_dim=8),
                                      None),
    "qwen2_moe_mqa_gqa8_bias": (lambda: build_hf_moe("qwen2_moe", num_heads=8, num_kv_heads=1, head_dim=8), None),
    # dense: fused QKV per head, rotary on a quarter of the head dim
    "gpt_neox_rotary_pct_quarter": (lambda: _build("gpt_neox", rotary_pct=0.25,
                                                   drop=("num_key_value_heads", "head_dim")), None),
    # dense: interleaved rotary (x[..., ::2]) with q/k LayerNorm and a logit scale
    "cohere_interleaved_rope_qk_norm": (lambda: _build("cohere", use_qk_norm=True, logit_scale=0.5), None),
    # attention sinks: a learned logit per head concatenated to the scores; dropping it would change every row
    "gpt_oss_attention_sinks": (lambda: _gpt_oss_with_sinks(), r"no attention op"),
    # attention logit soft-capping (tanh) in a hand-written attention
    "gemma2_logit_softcap": (lambda: _build("gemma2", attn="eager", attn_logit_softcapping=5.0,
                                            final_logit_softcapping=None, sliding_window=64,
                                            layer_types=["full_attention"] * 2, query_pre_attn_scalar=8),
                             r"no attention op"),
    # MLA: the cache already holds a latent
    "deepseek_v3_mla": (lambda: _build(
        "deepseek_v3", num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, drop=("head_dim",)), r"multi-head latent attention"),
    # longrope switches its tables on the prompt length (a data-dependent branch: a graph break before the layers,
    # the tables reach the layers' graph as inputs): refused naming the break (it said only "RoPE positions not
    # identified"); the dense model still runs afterwards
    "phimoe_longrope": (lambda: _build(
        "phimoe", **MOE, router_jitter_noise=0.0, sliding_window=None, drop=("head_dim",),
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=8,
                             short_factor=[1.0 + 0.1 * i for i in range(8)],
                             long_factor=[2.0 + 0.3 * i for i in range(8)], short_mscale=1.1, long_mscale=1.3)),
        r"RoPE positions not identified: .*graph break before the layers"),
    # differential attention: two SDPA calls per layer over a chunked, repeated value cache; the refusal said "no
    # layer wrote its keys and values ... Fix: check that each attention layer calls past_key_values.update", which
    # it does: it now names the values' path
    "diffllama_differential_attention": (lambda: _build("diffllama"),
                                         r"values reach the attention through ops the analysis does not follow"),
    # a sliding window on every layer (Mixtral's config field): refused before anything is computed
    "mixtral_sliding_window_4": (lambda: _mixtral_sliding(), r"sliding window of 4 keys"),
}


def _gpt_oss_with_sinks():
    model = _build("gpt_oss", attn="eager", **MOE, layer_types=["full_attention"] * 2,
                   rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "sinks"):
                module.sinks.normal_(0.0, 2.0)
    return model


def _mixtral_sliding():
    return _build("mixtral", router_jitter_noise=0.0, **MOE, sliding_window=4)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_attention_variant_is_exact_at_full_rank_or_refused_with_its_reason(name):
    builder, refused = ARCHITECTURES[name]
    _assert_exact_or_refused(builder(), refused, batch=2 if name.startswith("qwen2") else 1)


@pytest.mark.parametrize("family", ["mixtral_eager_experts", "dbrx"])
def test_calibrate_refuses_a_forward_traced_as_one_graph_per_layer(family):
    """Regression: a graph break inside every layer (HF ``experts_implementation="eager"``; DBRX's own expert loop,
    which has no other implementation) traces each layer's attention into its own graph, numbered by position, so
    every layer was "layer 0": calibrate() returned bases of one layer (fitted on whichever layer ran last) without
    a word, and ``CKVPStaticCache`` then said "the bases cover layers [0] ... Fix: calibrate bases for this model",
    which the user had just done. calibrate() now names the graph break and the fix."""
    if family == "dbrx":
        model = _build("dbrx", d_model=64, n_heads=4, n_layers=3, max_seq_len=512,
                       attn_config=dict(clip_qkv=8.0, kv_n_heads=2, rope_theta=10000.0),
                       ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
                       drop=tuple(k for k in COMMON if k not in ("vocab_size", "initializer_range",
                                                                 "tie_word_embeddings", "bos_token_id",
                                                                 "eos_token_id", "pad_token_id", "use_cache")))
        fix = r"remove the graph break .*TORCH_LOGS=graph_breaks"
    else:
        model = build_hf_moe("mixtral", num_layers=3, experts_implementation="eager")
        fix = r"experts_implementation='grouped_mm'"
    with pytest.raises(CKVPConfigError, match=r"traced as several graphs, with attention layers in 3 of them.*" + fix):
        calibrate(model, [torch.randint(0, 256, (1, 12))], group_size=2, kv_ratio=1.0, progress=False)


def _sdpa_without_the_last_slot(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An HF attention function: SDPA over every cache slot but the last one (a scratch slot), GQA by
    ``repeat_interleave``. query (B, H, S, D), key / value (B, Hkv, S_max, D); returns ((B, S, H, D), None)."""
    n_rep = query.shape[1] // key.shape[1]
    key = key[:, :, :-1].repeat_interleave(n_rep, dim=1)
    value = value[:, :, :-1].repeat_interleave(n_rep, dim=1)
    mask = attention_mask[:, :, :, :key.shape[2]] if attention_mask is not None else None
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def test_a_slot_slice_counted_from_the_end_is_not_read_on_the_shrunk_probe():
    """Regression: the layout check replays the chain from the cache to SDPA on a probe of 8 slots standing for
    S_max; ``key[:, :, :-1]`` (S_max - 1 slots) read there as 7 slots, so ckvp.latent_attention attended slots
    [0, 7) only and the 8th token failed with "exact token at slot 7, but only slots [0, kv_len = 7) are attended"
    (a model unusable past 7 tokens, for a reason not its own). A negative bound now keeps the model's own SDPA
    over rebuilt keys and values: exact at full rank."""
    from transformers import AttentionInterface

    AttentionInterface.register("ckvp_test_sdpa_without_last_slot", _sdpa_without_the_last_slot)
    model = build_hf_moe("mixtral", num_layers=2)
    model.set_attn_implementation("ckvp_test_sdpa_without_last_slot")
    _assert_exact_or_refused(model, None)


def _gemma4_text(num_kv_shared_layers: int):
    """A tiny Gemma-4 text model with its MoE block: a heterogeneous config (per-layer head_dim: global access
    raises transformers' AmbiguousGlobalPerLayerAttributeError), q/k/v norms, attention scale 1, and its last
    ``num_kv_shared_layers`` layers attending over an earlier layer's keys and values (no cache of their own: HF's
    StaticCache gives them a DummyLayer)."""
    rope = dict(rope_type="default", rope_theta=10000.0)
    return _build("gemma4_text", num_hidden_layers=2, layer_types=["full_attention"] * 2, global_head_dim=32,
                  num_kv_shared_layers=num_kv_shared_layers, hidden_size_per_layer_input=0,
                  vocab_size_per_layer_input=256, enable_moe_block=True, num_experts=4, top_k_experts=2,
                  moe_intermediate_size=32, rope_parameters={"full_attention": rope, "sliding_attention": rope})


@pytest.mark.parametrize("num_kv_shared_layers", [0, 1])
def test_gemma4_per_layer_config_and_kv_shared_layers_full_rank_equal_dense(num_kv_shared_layers):
    """Regressions, one behind the other: calibrate() failed in ``model_fingerprint`` with transformers'
    AmbiguousGlobalPerLayerAttributeError (reading ``config.head_dim`` of a per-layer config), and so did
    ``CKVPStaticCache``; then ``CKVPStaticCache`` failed with "'DummyLayer' object has no attribute
    'lazy_initialization'" on a KV-shared layer; then the analysis gave the KV-shared layer the earlier layer's cache
    writes as its own, so calibrate() fitted bases for a cache that does not exist and the cache refused them with
    "Fix: calibrate bases for this model". Now the shared layer attends over the rebuilt cache of the layer it
    shares: exact at full rank."""
    model = _gemma4_text(num_kv_shared_layers)
    if num_kv_shared_layers:  # the last layer reads the first one's keys and values (transformers 5.17 and later)
        assert [layer.self_attn.is_kv_shared_layer for layer in model.model.layers] == [False, True]
    _assert_exact_or_refused(model, None)
