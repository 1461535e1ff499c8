"""The dense recent window (``recent_window=W``): the last W tokens' keys and values stay exact beside the latent.

Properties, end to end through ``backend="ckvp"`` on random MoE models:

* a window at least as long as the whole sequence makes even a low-rank latent cache exact: logits equal the
  dense model's through prefill and decode (every attended token comes from the ring or the call itself);
* a shorter window still reads older tokens from the latent, so it is lossy, but closer to dense than no window;
* the ring is emptied by ``cache.reset()`` and a rewound sequence (positions restarting without a reset) never
  reads the abandoned tokens;
* the window's bytes are per-sequence state in the store's accounting, and bad values are a clear error.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckvp_compile import CKVPBackend, CKVPConfig, CompileRecorder
from ckvp_compile.errors import CKVPConfigError
from ckvp_compile.latent import calibrate
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import HF_FAMILIES, build_hf_moe, prefill_decode_logits
from ckvp_compile.testing.decoding import hf_step_kwargs
from ckvp_compile.testing.strategies import moe_model_shapes

PROMPT = 6
N_DECODE = 10
CACHE = 24


def _latent_logits(model, ids, cache, rec=None, feed=None):
    """Prefill + N_DECODE steps through backend='ckvp'; each step feeds the previous argmax, or, with ``feed`` (a
    reference run's logits), the reference's argmax (teacher forcing: both runs see the same tokens)."""
    step = torch.compile(model, backend=CKVPBackend(CKVPConfig(compiler="aot_eager"), recorder=rec), fullgraph=True)
    outs = []
    with torch.no_grad():
        out = step(**hf_step_kwargs(model, ids, cache, 0)).logits
        outs.append(out)
        for i in range(N_DECODE):
            prev = out if feed is None else feed[i]
            out = step(**hf_step_kwargs(model, prev[:, -1:].argmax(-1), cache, ids.shape[1] + i)).logits
            outs.append(out)
    return outs


def _rel_err(outs, want):
    return max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(outs, want))


def _model(shape, family, group_size, seed=0):
    torch.manual_seed(seed)
    model = build_hf_moe(family, **shape)
    samples = [torch.randint(0, 256, (1, 20)) for _ in range(3)]
    bases = calibrate(model, samples, group_size=group_size, kv_ratio=8.0, progress=False)  # lossy: rank D/4
    return model, bases


@given(shape=moe_model_shapes(max_layers=3, hidden_matches_heads=True), family=st.sampled_from(HF_FAMILIES),
       group_size=st.sampled_from([1, 2]), batch=st.integers(1, 2))
@settings(max_examples=3, deadline=None)
def test_a_window_covering_the_sequence_is_exact_at_low_rank(shape, family, group_size, batch):
    model, bases = _model(shape, family, group_size)
    ids = torch.randint(0, 256, (batch, PROMPT))
    dense = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=CACHE)
    rec = CompileRecorder()
    cache = CKVPStaticCache(model.config, bases, max_cache_len=CACHE, max_batch_size=batch,
                            recent_window=PROMPT + N_DECODE)
    got = _latent_logits(model, ids, cache, rec)
    for i, (a, b) in enumerate(zip(got, dense)):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4, msg=lambda m: f"step {i}: {m}")
    for g in rec.graphs:  # every layer reads its ring and appends to it once
        assert not g.fell_back and g.dynamo_after.count("ckvp.window_append") == shape["num_layers"], g.fell_back


# two families, without and with q/k norms: the ring and its reads do not depend on the family (the covering-window
# property above runs random families)
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_short_window_is_lossy_but_closer_to_dense(family):
    shape = dict(head_dim=16, num_heads=4, num_kv_heads=2, hidden=64, num_experts=4, top_k=2, ffn=32, num_layers=2)
    model, bases = _model(shape, family, 2, seed=1)
    ids = torch.randint(0, 256, (2, PROMPT))
    dense = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=CACHE)
    errs = {}
    for w in (0, 4):
        cache = CKVPStaticCache(model.config, bases, max_cache_len=CACHE, max_batch_size=2, recent_window=w)
        errs[w] = _rel_err(_latent_logits(model, ids, cache, feed=dense), dense)
    assert errs[4] > 1e-4, errs  # older tokens still come from the low-rank latent
    assert errs[4] < errs[0], errs


def test_reset_and_a_rewound_sequence_never_read_old_tokens():
    shape = dict(head_dim=16, num_heads=2, num_kv_heads=2, hidden=32, num_experts=2, top_k=1, ffn=16, num_layers=2)
    model, bases = _model(shape, HF_FAMILIES[0], 1, seed=2)
    w = PROMPT + N_DECODE
    cache = CKVPStaticCache(model.config, bases, max_cache_len=CACHE, max_batch_size=1, recent_window=w)
    first = torch.randint(0, 256, (1, PROMPT))
    _latent_logits(model, first, cache)
    assert int(cache.store.window_slots[0].max()) == PROMPT + N_DECODE - 1
    ids = torch.randint(0, 256, (1, PROMPT))
    dense = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=CACHE)
    # rewound: the cache's write positions back to 0 without a store reset; the ring still holds the first
    # sequence's tokens, at slots the new one reaches later
    for layer in cache.layers:
        counter = getattr(layer, "cumulative_length", None)
        if isinstance(counter, torch.Tensor):
            counter.zero_()
    got = _latent_logits(model, ids, cache)
    assert _rel_err(got, dense) < 1e-4
    cache.reset()
    assert all(bool((t == -1).all()) for t in cache.store.window_slots.values())
    assert all(float(t.abs().sum()) == 0 for t in cache.store.window_k.values())
    assert _rel_err(_latent_logits(model, ids, cache), dense) < 1e-4


def test_window_bytes_are_per_sequence_state_and_bad_values_are_clear_errors():
    shape = dict(head_dim=16, num_heads=2, num_kv_heads=1, hidden=32, num_experts=2, top_k=1, ffn=16, num_layers=2)
    model, bases = _model(shape, HF_FAMILIES[0], 2, seed=3)
    plain = CKVPStaticCache(model.config, bases, max_cache_len=CACHE, max_batch_size=2).store.nbytes()
    held = CKVPStaticCache(model.config, bases, max_cache_len=CACHE, max_batch_size=2, recent_window=5).store
    nb = held.nbytes()
    # 2 sequences x 2 layers x (K and V) x 1 KV head x 5 tokens x 16 channels x 4 bytes, plus 2 rings of 5 int64
    assert nb.window == 2 * 2 * 2 * 1 * 5 * 16 * 4 + 2 * 5 * 8
    assert nb.per_sequence_state == plain.per_sequence_state + nb.window
    assert held.layout() != CKVPStaticCache(model.config, bases, max_cache_len=CACHE).store.layout()
    for bad in (-1, CACHE, 2.5):
        with pytest.raises(CKVPConfigError, match="recent_window"):
            CKVPStaticCache(model.config, bases, max_cache_len=CACHE, recent_window=bad)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_gpt_fast_window_covering_the_sequence_is_exact(compiler):
    """The same property on a gpt-fast model (``use_latent_cache``), also code-generated by Inductor (the ring's
    in-place ``ckvp::window_append`` after the attention that reads it)."""
    from ckvp_compile.runtime.hf_cache import use_latent_cache
    from ckvp_compile.testing import GptFastConfig, GptFastMoE

    torch.manual_seed(4)
    shape = dict(head_dim=16, num_heads=4, num_kv_heads=2, hidden=64, num_experts=2, top_k=1, ffn=16, num_layers=2)
    model = GptFastMoE(GptFastConfig.from_shape(shape, rope_form="rotate_half")).eval()
    bases = calibrate(model, [torch.randint(0, 256, (1, 20)) for _ in range(3)], group_size=2, kv_ratio=8.0,
                      progress=False)
    ids = torch.randint(0, 256, (1, PROMPT))
    dense = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=CACHE)
    backend = CKVPBackend(CKVPConfig(compiler=compiler))
    torch._dynamo.reset()

    def compile_latent(m):
        use_latent_cache(m, bases, recent_window=PROMPT + N_DECODE)
        return torch.compile(m, backend=backend, fullgraph=True)

    got = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=CACHE, compile_fn=compile_latent)
    for i, (a, b) in enumerate(zip(got, dense)):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4, msg=lambda m: f"step {i}: {m}")


def test_ring_in_another_dtype_than_the_model():
    """The ring is kept in latent_dtype: a bf16 model with fp32 latents (and ring) still gives its attention bf16
    exact tokens (the reconstruct + SDPA path would refuse mixed dtypes)."""
    from ckvp_compile.runtime.hf_cache import use_latent_cache
    from ckvp_compile.testing import GptFastConfig, GptFastMoE

    torch.manual_seed(5)
    shape = dict(head_dim=16, num_heads=2, num_kv_heads=2, hidden=32, num_experts=2, top_k=1, ffn=16, num_layers=2)
    model = GptFastMoE(GptFastConfig.from_shape(shape, rope_form="rotate_half")).eval()
    bases = calibrate(model, [torch.randint(0, 256, (1, 20)) for _ in range(3)], group_size=2, kv_ratio=1.0,
                      progress=False)
    model = model.to(torch.bfloat16)
    ids = torch.randint(0, 256, (1, PROMPT))
    dense = prefill_decode_logits(model, ids, 4, max_cache_len=CACHE)
    backend = CKVPBackend(CKVPConfig(compiler="aot_eager"))
    torch._dynamo.reset()

    def compile_latent(m):
        use_latent_cache(m, bases, latent_dtype=torch.float32, recent_window=4)
        return torch.compile(m, backend=backend, fullgraph=True)

    got = prefill_decode_logits(model, ids, 4, max_cache_len=CACHE, compile_fn=compile_latent)
    assert all(g.dtype == torch.bfloat16 for g in got)
    assert _rel_err(got, dense) < 2e-2  # full rank: only bf16 rounding apart


def test_recent_window_validation_names_the_fix():
    from ckvp_compile.latent.budget import window_bytes

    shape = dict(head_dim=16, num_heads=2, num_kv_heads=1, hidden=32, num_experts=2, top_k=1, ffn=16, num_layers=2)
    model, bases = _model(shape, HF_FAMILIES[0], 2, seed=6)
    for bad in (-5, True):
        with pytest.raises(CKVPConfigError, match="recent_window"):
            window_bytes(bases, 1, bad)
    with pytest.raises(CKVPConfigError, match="recent_window"):
        CKVPStaticCache(model.config, bases, max_cache_len=CACHE, recent_window=True)
    with pytest.raises(CKVPConfigError, match="latent_format"):
        calibrate(model, [torch.randint(0, 256, (1, 12))], group_size=2, kv_ratio=4.0, progress=False,
                  recent_window=8)
