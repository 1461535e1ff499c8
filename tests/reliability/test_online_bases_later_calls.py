"""Online latent bases are fitted at the first call after a reset; a later multi-token call is warned about.

``generate(prefill_chunk_size=N)`` prefills a prompt N tokens at a time, so online bases were fitted on the first
chunk alone and every later chunk was projected onto them, silently: one fixture prompt of 256 tokens at 2x, in
chunks of 64, agreed with dense on 3 of 24 greedy tokens against 10 in one call (an adversarial review, 2026-12-06).
Such a call now gives one CKVPWarning per cache naming the fix; one prefill call then decode steps gives none.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from ckvp_compile.errors import CKVPWarning
from ckvp_compile.latent import online_bases
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import build_hf_moe


def test_chunked_prefill_on_online_bases_warns_once():
    torch._dynamo.reset()
    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    bases = online_bases(model, group_size=2, kv_ratio=2)
    ids = torch.randint(1, 256, (1, 24), generator=torch.Generator().manual_seed(0))

    def run(**kw):
        with torch.no_grad():
            return model.generate(ids, past_key_values=CKVPStaticCache(model.config, bases, max_cache_len=40),
                                  max_new_tokens=3, do_sample=False, disable_compile=True, **kw)

    eager_forward = model.forward
    model.forward = torch.compile(eager_forward, backend="ckvp", options={"compiler": "aot_eager"})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", CKVPWarning)  # the whole prompt in one call, then decode: no warning
            run()
        with pytest.warns(CKVPWarning, match=r"fitted at the first call after cache\.reset\(\).*prefill_chunk_size"
                          ) as record:
            run(prefill_chunk_size=8)  # three chunks: the second and third are not refitted; one warning
        assert sum("online latent bases" in str(w.message) for w in record) == 1
    finally:
        model.forward = eager_forward
        torch._dynamo.reset()
