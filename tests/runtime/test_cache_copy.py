"""A latent KV cache refuses ``copy.deepcopy`` (HF's prompt-reuse recipe) with an error that names the fix, and the
cache and the compiled model keep working: a copy's tensors would not be registered with the compiled graphs, which
find a store by its tensors' addresses (before, a copied cache failed inside the compiler with no fix named)."""

from __future__ import annotations

import copy

import pytest
import torch

from ckvp_compile import CKVPBackend, CKVPConfig, CKVPConfigError
from ckvp_compile.latent import calibrate
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import build_hf_moe
from ckvp_compile.testing.decoding import hf_step_kwargs

SHAPE = dict(num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, num_experts=4, top_k=2, ffn=16)


def test_deepcopy_of_a_latent_cache_is_refused_and_the_cache_stays_usable():
    torch._dynamo.reset()
    model = build_hf_moe("mixtral", seed=0, **SHAPE)
    bases = calibrate(model, [torch.randint(0, 256, (1, 12)) for _ in range(2)], kv_ratio=1.0, progress=False)
    step = torch.compile(model, backend=CKVPBackend(CKVPConfig(compiler="eager")), fullgraph=True)
    ids = torch.randint(0, 256, (1, 6))
    cache, fresh = (CKVPStaticCache(model.config, bases, max_cache_len=16) for _ in range(2))
    with torch.no_grad():
        step(**hf_step_kwargs(model, ids[:, :5], cache, 0))
        with pytest.raises(CKVPConfigError, match="build a new cache with the same arguments and prefill"):
            copy.deepcopy(cache)
        with pytest.raises(CKVPConfigError, match="build a new cache"):
            copy.deepcopy(cache.store)
        after = step(**hf_step_kwargs(model, ids[:, 5:], cache, 5)).logits  # the original decodes on
        step(**hf_step_kwargs(model, ids[:, :5], fresh, 0))
        again = step(**hf_step_kwargs(model, ids[:, 5:], fresh, 5)).logits
    torch.testing.assert_close(after, again)
