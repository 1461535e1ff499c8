"""A latent cache that does not fit the model: a clear error, and the compiled model still works afterwards.

``CKVPStaticCache.update`` raises its dtype / batch-size errors while torch.compile traces the forward. Dynamo
treats an uncaught error there as a graph break and keeps the frames it split at it, so (before the fix) every later
call, with a correct cache too, ran the cache update outside the graph and failed with the eager-use error. Found by
an adversarial review (2026-12-05); the next ``CKVPStaticCache(...)`` then reset Dynamo after such an error, which
missed a cache built before it (found by the next review, 2026-12-06: the write into the latent cache's placeholder
failed); now the error itself resets Dynamo before it is raised.
"""

from __future__ import annotations

import pytest
import torch

from ckvp_compile.errors import CKVPConfigError
from ckvp_compile.latent import calibrate
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import build_hf_moe

CACHE = 24


def test_compiled_model_works_after_a_mismatched_cache():
    """Without fullgraph (the HF recipe): the error, then a correct cache gives dense's tokens (fullgraph=True never
    kept split frames)."""
    from transformers import StaticCache

    torch._dynamo.reset()
    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    bases = calibrate(model, [torch.randint(0, 256, (1, 12)) for _ in range(2)], group_size=2, kv_ratio=1.0,
                      progress=False)
    ids = torch.randint(1, 256, (1, 5))

    def run(cache, batch_ids=ids):
        with torch.no_grad():
            return model.generate(batch_ids, past_key_values=cache, max_new_tokens=4, do_sample=False,
                                  disable_compile=True, pad_token_id=0)

    dense = run(StaticCache(config=model.config, max_cache_len=CACHE))
    eager_forward = model.forward
    model.forward = torch.compile(eager_forward, backend="ckvp", options={"compiler": "aot_eager"})
    try:
        # a cache of another K/V dtype than the model's (fp32): the error names the dtype to pass
        built_before = CKVPStaticCache(model.config, bases, max_cache_len=CACHE)
        bad = CKVPStaticCache(model.config, bases, max_cache_len=CACHE, dtype=torch.float16)
        with pytest.raises(Exception, match=r"dtype=torch\.float32"):
            run(bad)
        assert run(built_before).tolist() == dense.tolist()  # a cache built before the error works too
        assert run(CKVPStaticCache(model.config, bases, max_cache_len=CACHE)).tolist() == dense.tolist()
        # a cache for one sequence, a batch of two: the error names max_batch_size
        two = ids.repeat(2, 1)
        built_before.reset()
        with pytest.raises(Exception, match=r"max_batch_size=2"):
            run(CKVPStaticCache(model.config, bases, max_cache_len=CACHE, max_batch_size=1), two)
        assert run(built_before).tolist() == dense.tolist()
        assert run(CKVPStaticCache(model.config, bases, max_cache_len=CACHE)).tolist() == dense.tolist()
        with pytest.raises(CKVPConfigError):  # the error itself, not a Dynamo wrapper
            run(CKVPStaticCache(model.config, bases, max_cache_len=CACHE, dtype=torch.float16))
    finally:
        model.forward = eager_forward
        torch._dynamo.reset()
