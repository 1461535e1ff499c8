"""Post-RoPE key bases (``LatentBases.key_space == "post_rope"``): the key latent holds the keys as the model caches
them (after RoPE) and the rewrite treats every layer as one without RoPE.

Properties: at full rank the latent cache is exact (HF families and gpt-fast, both RoPE forms) and no graph writes
RoPE tables; at a reduced rank that spans the post-RoPE keys exactly it is still exact, while the same rank that
spans only the pre-RoPE keys is exact for pre-RoPE bases and lossy for post-RoPE ones (RoPE spreads a pair's energy
over both channels); calibration sums the keys held in a dense cache; at a real compression the logits stay finite,
move off dense, and the store's bytes really shrink.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckvp_compile import CKVPBackend, CKVPConfig, CompileRecorder
from ckvp_compile.latent import calibrate, collect_kv_moments
from ckvp_compile.latent.capture import make_static_cache
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import HF_FAMILIES, GptFastConfig, GptFastMoE, build_hf_moe, prefill_decode_logits
from ckvp_compile.testing.decoding import hf_step_kwargs
from ckvp_compile.testing.strategies import moe_model_shapes

from test_latent_kv import (CACHE, N_DECODE, PROMPT, assert_close_all, calib_samples, gpt_fast_latent_logits,
                            hf_latent_logits)

POST = "post_rope"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: these tiny models run several times slower with 2 OpenMP threads on a busy 2-core
    machine (as in tests/latent/test_bases_calibrate.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _assert_no_rope_rebuild(rec: CompileRecorder, num_layers: int) -> None:
    """Every recorded graph was rewritten in all ``num_layers`` layers as layers without RoPE: no
    ``ckvp.rope_table_update`` (nothing writes the tables) and every latent op's RoPE form is 'none'."""
    assert rec.graphs
    for g in rec.graphs:
        assert not g.fell_back, g.fell_back
        assert [(r.name, r.matched) for r in g.pass_results if r.stage == "torch"] == [
            ("latent_kv_cache", num_layers)]
        text = g.dynamo_after
        assert "torch.ops.ckvp.latent_append.default(" in text
        assert "rope_table_update" not in text
        for form in ("'rotate_half'", "'interleaved'", "'complex'"):
            assert form not in text, form


@given(shape=moe_model_shapes(max_layers=4, hidden_matches_heads=True), family=st.sampled_from(HF_FAMILIES),
       group_size=st.sampled_from([1, 2, 4]), batch=st.integers(1, 2))
@settings(max_examples=2)
def test_hf_post_rope_full_rank_equals_dense(shape, family, group_size, batch):
    """Full-rank post-RoPE bases on random HF-family models: prefill + 16 decode steps give the dense eager logits
    (2e-4), the bases say 'post_rope', and no graph writes RoPE tables or rebuilds RoPE (the store never saw a
    RoPE writer)."""
    model = build_hf_moe(family, **shape)
    bases = calibrate(model, calib_samples(), group_size=group_size, kv_ratio=1.0, progress=False, key_space=POST)
    assert bases.key_space == POST
    ids = torch.randint(0, 256, (batch, PROMPT))
    eager = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=CACHE)
    rec = CompileRecorder()
    cache = CKVPStaticCache(model.config, bases, max_cache_len=CACHE, max_batch_size=batch)
    latent = hf_latent_logits(model, ids, cache, CKVPBackend(CKVPConfig(compiler="aot_eager"), recorder=rec))
    assert_close_all(eager, latent)
    assert cache.store.rope_paired is None
    _assert_no_rope_rebuild(rec, shape["num_layers"])


@given(shape=moe_model_shapes(max_layers=4), rope=st.sampled_from(["complex", "rotate_half"]),
       group_size=st.sampled_from([1, 2, 4]))
@settings(max_examples=3)
def test_gpt_fast_post_rope_full_rank_equals_dense(shape, rope, group_size):
    """gpt-fast models (complex and rotate_half RoPE): full-rank post-RoPE bases give the dense logits through
    prefill + 16 decode steps, and no store sees a RoPE-table writer."""
    torch.manual_seed(0)
    model = GptFastMoE(GptFastConfig.from_shape(shape, rope_form=rope)).eval()
    bases = calibrate(model, calib_samples(), group_size=group_size, kv_ratio=1.0, progress=False, key_space=POST)
    assert bases.key_space == POST
    ids = torch.randint(0, 256, (1, PROMPT))
    eager = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=CACHE)
    rec = CompileRecorder()
    backend = CKVPBackend(CKVPConfig(compiler="aot_eager"), recorder=rec)
    latent, stores = gpt_fast_latent_logits(model, ids, bases, backend)
    assert_close_all(eager, latent)
    assert stores and all(s.rope_paired is None for s in stores)
    _assert_no_rope_rebuild(rec, shape["num_layers"])


def _keep_key_channels(model, channels: tuple[int, ...]) -> None:
    """Zero every k_proj output row (and bias entry) of every KV head except ``channels``: each head's pre-RoPE key
    then lives in span{e_c : c in channels} (q/k RMSNorms keep zero channels zero)."""
    cfg = model.config
    d, hkv = cfg.head_dim, cfg.num_key_value_heads
    keep = torch.zeros(d, dtype=torch.bool)
    keep[list(channels)] = True
    for layer in model.model.layers:
        proj = layer.self_attn.k_proj
        proj.weight.data.view(hkv, d, -1)[:, ~keep] = 0
        if proj.bias is not None:
            proj.bias.data.view(hkv, d)[:, ~keep] = 0


def _make_v_low_rank(model, rank: int) -> None:
    """Give every layer's V projection rank ``rank`` per KV head (truncated SVD; the bias, if any, is zeroed)."""
    cfg = model.config
    d, hkv = cfg.head_dim, cfg.num_key_value_heads
    for layer in model.model.layers:
        proj = layer.self_attn.v_proj
        w = proj.weight.data.view(hkv, d, -1)
        for h in range(hkv):
            u, s, vt = torch.linalg.svd(w[h], full_matrices=False)
            w[h] = (u[:, :rank] * s[:rank]) @ vt[:rank]
        if proj.bias is not None:
            proj.bias.data.zero_()


def _latent_run(model, ids, eager, key_space: str, group_size: int, max_key_rank: int):
    """Calibrate ``key_space`` bases at kv_ratio 4 with key ranks capped at ``max_key_rank`` and decode ``ids`` through
    them, fed ``eager``'s tokens; returns (bases, logits)."""
    bases = calibrate(model, calib_samples(), group_size=group_size, kv_ratio=4.0, progress=False,
                      key_space=key_space, max_key_rank=max_key_rank)
    assert bases.key_space == key_space and bases.ratio() >= 4.0
    cache = CKVPStaticCache(model.config, bases, max_cache_len=CACHE, max_batch_size=ids.shape[0])
    return bases, hf_latent_logits(model, ids, cache, CKVPBackend(CKVPConfig(compiler="aot_eager")), teacher=eager)


@given(family=st.sampled_from(HF_FAMILIES), head_dim=st.sampled_from([8, 16]), freq=st.integers(0, 3),
       group_size=st.sampled_from([1, 2]))
@settings(max_examples=3)
def test_post_rope_reduced_rank_exact_on_keys_in_rotary_planes(family, head_dim, freq, group_size):
    """Keys confined to one rotary frequency's channel pair (rotate_half: channels i and i + D/2) per head, values of
    rank 2: the post-RoPE keys of a layer span 2 dims, so post-RoPE bases whose key ranks are 2 G of G D (capped by
    max_key_rank, checked on ``k_ranks``) lose nothing and the logits equal dense (1e-3). This checks the wiring at
    reduced rank (layer blocks, head offsets, K vs V), which full rank cannot."""
    d = head_dim
    model = build_hf_moe(family, num_layers=2, hidden=4 * d, num_heads=4, num_kv_heads=2, head_dim=d)
    _keep_key_channels(model, (freq, freq + d // 2))
    _make_v_low_rank(model, 2)
    ids = torch.randint(0, 256, (2, PROMPT))
    eager = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=CACHE)
    bases, latent = _latent_run(model, ids, eager, POST, group_size, max_key_rank=2 * group_size)
    assert all(r == 2 * len(layers) for layers, rs in zip(bases.groups, bases.k_ranks) for r in rs), bases.k_ranks
    assert all(r < len(layers) * d for layers, rs in zip(bases.groups, bases.v_ranks) for r in rs), bases.v_ranks
    assert_close_all(eager, latent, tol=1e-3)


def test_rope_spreads_a_one_channel_key_over_its_pair():
    """Pre-RoPE keys on one channel (i = 0) per head: a key rank of one per layer spans them, so pre-RoPE bases at
    that rank are exact; RoPE rotates the key into the (0, D/2) plane, so post-RoPE bases at that rank are lossy
    (logits move by > 1e-2) and need two per layer, where they are exact again (G = 2: the ranks are per group of
    two layers). The post-RoPE path really
    compresses the keys after RoPE, and the fidelity cost ``LatentBases.key_space`` documents is real."""
    d = 16
    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=d)
    _keep_key_channels(model, (0,))
    _make_v_low_rank(model, 2)
    ids = torch.randint(0, 256, (2, PROMPT))
    eager = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=CACHE)
    g = 2  # two layers stacked in one group
    pre, pre_logits = _latent_run(model, ids, eager, "pre_rope", g, max_key_rank=g)
    narrow, narrow_logits = _latent_run(model, ids, eager, POST, g, max_key_rank=g)
    wide, wide_logits = _latent_run(model, ids, eager, POST, g, max_key_rank=2 * g)
    assert {r for rs in pre.k_ranks + narrow.k_ranks for r in rs} == {g}
    assert {r for rs in wide.k_ranks for r in rs} == {2 * g}
    assert_close_all(eager, pre_logits, tol=1e-3)
    assert_close_all(eager, wide_logits, tol=1e-3)
    assert max((a - b).abs().max().item() for a, b in zip(eager, narrow_logits)) > 1e-2


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_post_rope_moments_sum_the_cached_keys(family):
    """collect_kv_moments(key_space='post_rope') sums x x^T of the keys a dense StaticCache holds after the same
    prefill run eagerly ((B, Hkv, S, D), stacked over a group's layers: G = 2 over 3 layers, so one group of two
    and one of one; B = 2), the values likewise; the pre-RoPE moments differ from them but have the same trace
    (RoPE rotates each token's key, keeping its norm)."""
    model = build_hf_moe(family, num_layers=3, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8)
    ids = torch.randint(0, 256, (2, 12))
    post = collect_kv_moments(model, [ids], group_size=2, progress=False, key_space=POST)
    pre = collect_kv_moments(model, [ids], group_size=2, progress=False)
    assert post.key_space == POST and pre.key_space == "pre_rope" and post.groups == ((0, 1), (2,))
    cache = make_static_cache(model, ids.shape[1])
    with torch.no_grad():
        model(**hf_step_kwargs(model, ids, cache, 0))
    for g, layers in enumerate(post.groups):
        for kind, got in (("keys", post.k[g]), ("values", post.v[g])):
            x = torch.cat([getattr(cache.layers[layer], kind) for layer in layers], dim=-1)  # (B, Hkv, S, G_g D)
            assert x.shape == (2, 2, 12, 8 * len(layers))
            x = x.double().transpose(0, 1).reshape(2, 2 * 12, -1)  # (Hkv, B S, G_g D)
            torch.testing.assert_close(got, x.mT @ x, rtol=1e-5, atol=1e-5, msg=lambda m: f"{kind} {g}: {m}")
        torch.testing.assert_close(pre.v[g], post.v[g], rtol=1e-10, atol=1e-10)
        diag = torch.diagonal
        torch.testing.assert_close(diag(pre.k[g], dim1=-2, dim2=-1).sum(-1), diag(post.k[g], dim1=-2, dim2=-1).sum(-1),
                                   rtol=1e-6, atol=1e-6)
        assert (pre.k[g] - post.k[g]).abs().max() > 1e-2 * post.k[g].abs().max()


@given(shape=moe_model_shapes(max_layers=3, hidden_matches_heads=True), family=st.sampled_from(HF_FAMILIES),
       group_size=st.sampled_from([1, 2, 4]))
@settings(max_examples=2)
def test_post_rope_at_ratio_2_is_lossy_and_smaller(shape, family, group_size):
    """Post-RoPE bases at kv_ratio 2 on random HF-family models: the decode logits stay finite, move off dense (the
    compression really drops directions: the prompt is not in the calibration data), and the store's latents take
    at most half the dense cache's bytes (with the rows' alignment padding, 10%)."""
    model = build_hf_moe(family, **shape)
    bases = calibrate(model, calib_samples(), group_size=group_size, kv_ratio=2.0, progress=False, key_space=POST)
    assert bases.key_space == POST and bases.ratio() >= 2.0
    ids = torch.randint(0, 256, (1, PROMPT))
    eager = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=CACHE)
    cache = CKVPStaticCache(model.config, bases, max_cache_len=CACHE, max_batch_size=1)
    latent = hf_latent_logits(model, ids, cache, CKVPBackend(CKVPConfig(compiler="aot_eager")), teacher=eager)
    assert all(bool(torch.isfinite(x).all()) for x in latent)
    assert max((a - b).abs().max().item() for a, b in zip(eager[1:], latent[1:])) > 1e-4
    nb = cache.store.nbytes()
    assert nb.latent * 2 <= nb.dense_equivalent * 1.1, (nb.latent, nb.dense_equivalent)
    assert cache.store.rope_paired is None


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_online_post_rope_bases_full_rank_equal_dense_without_rope_rebuild(family):
    """Online bases fitted to the keys as cached (``online_bases(key_space='post_rope')``): at full rank the
    per-sequence bases span every post-RoPE key, so logits equal dense, and no graph rebuilds RoPE; a bad key_space
    names the valid ones."""
    from ckvp_compile.errors import CKVPConfigError
    from ckvp_compile.latent import online_bases

    model = build_hf_moe(family, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16)
    bases = online_bases(model, group_size=2, kv_ratio=1.0, key_space=POST)
    assert bases.online and bases.key_space == POST
    ids = torch.randint(0, 256, (2, PROMPT))
    eager = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=CACHE)
    rec = CompileRecorder()
    cache = CKVPStaticCache(model.config, bases, max_cache_len=CACHE, max_batch_size=2)
    latent = hf_latent_logits(model, ids, cache, CKVPBackend(CKVPConfig(compiler="aot_eager"), recorder=rec))
    assert_close_all(eager, latent)
    assert cache.store.rope_paired is None
    _assert_no_rope_rebuild(rec, 3)
    assert sum(g.dynamo_after.count("ckvp.online_basis_fit.default(") for g in rec.graphs[:1]) == 4
    with pytest.raises(CKVPConfigError, match="post_rope"):
        online_bases(model, group_size=2, kv_ratio=1.0, key_space="after_rope")


def test_online_post_rope_bases_under_partial_rope_full_rank_equal_dense():
    """GPT-J rotates 8 of its 16 key channels per head (partial RoPE, ``rotary_dim=8``, interleaved pairs): online
    post-RoPE bases at full rank span every cached key, rotated channels or not, so logits equal dense, and no graph
    rebuilds RoPE (the rewrite treats the layers as ones without RoPE whatever part of the head rotates)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ckvp_compile.latent import online_bases

    config = AutoConfig.for_model("gptj", hidden_size=64, rotary_dim=8, vocab_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=128, pad_token_id=None,
                                  bos_token_id=None, eos_token_id=None, initializer_range=0.1,
                                  tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    bases = online_bases(model, group_size=2, kv_ratio=1.0, key_space=POST)
    assert bases.online and bases.key_space == POST
    ids = torch.randint(0, 128, (2, PROMPT))
    eager = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=CACHE)
    rec = CompileRecorder()
    cache = CKVPStaticCache(model.config, bases, max_cache_len=CACHE, max_batch_size=2)
    latent = hf_latent_logits(model, ids, cache, CKVPBackend(CKVPConfig(compiler="aot_eager"), recorder=rec))
    assert_close_all(eager, latent)
    _assert_no_rope_rebuild(rec, 2)


def test_online_bases_fit_the_keys_of_their_key_space():
    """Online bases at rank 1 per layer (D = 16, ratio 16) on keys confined to channel 0 and values of rank 1: the
    pre-RoPE keys of a prompt span one direction, so online pre-RoPE bases are exact; RoPE rotates them over the
    (0, D/2) plane, so online post-RoPE bases fitted to the cached keys at that rank are lossy (logits move by
    > 1e-2), and at rank 2 per layer (ratio 8, values of rank 2) exact again: the online fit really sees the keys
    of its key space."""
    from ckvp_compile.latent import online_bases

    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    _keep_key_channels(model, (0,))
    _make_v_low_rank(model, 1)
    ids = torch.randint(0, 256, (2, PROMPT))
    eager = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=CACHE)

    def run(space, ratio):
        bases = online_bases(model, group_size=1, kv_ratio=ratio, key_space=space)
        cache = CKVPStaticCache(model.config, bases, max_cache_len=CACHE, max_batch_size=2)
        return bases, hf_latent_logits(model, ids, cache, CKVPBackend(CKVPConfig(compiler="aot_eager")))

    pre, pre_logits = run("pre_rope", 16.0)
    narrow, narrow_logits = run(POST, 16.0)
    wide, wide_logits = run(POST, 8.0)
    assert {r for rs in pre.k_ranks + narrow.k_ranks for r in rs} == {1}
    assert {r for rs in wide.k_ranks for r in rs} == {2}
    assert_close_all(eager, pre_logits, tol=1e-3)
    assert_close_all(eager, wide_logits, tol=1e-3)
    assert max((a - b).abs().max().item() for a, b in zip(eager, narrow_logits)) > 1e-2
