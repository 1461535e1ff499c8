"""A latent KV cache on Hugging Face attn_implementation="eager" attention (softmax(QK^T)V written out): the model's
own attention runs over keys and values rebuilt by ckvp::latent_reconstruct. At full rank the latent store is exact,
so logits equal the dense model's through prefill and the decode steps (GPT-2: no RoPE, fused c_attn projection;
Llama: RoPE, GQA through repeat_kv)."""

from __future__ import annotations

import pytest
import torch

from ckvp_compile import CKVPBackend, CKVPConfig, CompileRecorder
from ckvp_compile.latent import calibrate
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import prefill_decode_logits
from ckvp_compile.testing.dense import build_hf_dense
from test_latent_kv import CACHE, PROMPT, assert_close_all, calib_samples, hf_latent_logits


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_eager_attention_full_rank_latent_equals_dense(arch):
    model = build_hf_dense(arch, attn_implementation="eager")
    bases = calibrate(model, calib_samples(), group_size=2, kv_ratio=1.0, progress=False)
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    dense = prefill_decode_logits(model, ids, 16, max_cache_len=CACHE)
    rec = CompileRecorder()
    cache = CKVPStaticCache(model.config, bases, max_cache_len=CACHE, max_batch_size=1)
    latent = hf_latent_logits(model, ids, cache, CKVPBackend(CKVPConfig(compiler="aot_eager"), recorder=rec))
    assert_close_all(dense, latent)
    assert rec.graphs
    for g in rec.graphs:
        assert [s.form for s in g.analysis.attention] == ["softmax_qkv", "softmax_qkv"]
        assert g.plan.latent_groups == (0,) and g.plan.blocking == ()
        assert [(d.kind, d.rewrite) for d in g.plan.decisions] == [("attention", True)] * 2
        assert [(r.name, r.matched) for r in g.pass_results if r.stage == "torch"] == [("latent_kv_cache", 2)]
