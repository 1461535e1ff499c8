"""Latent bases kept in memory and handed to a cache for another model of the same shape are refused.

``LatentBases.load(path, model=...)`` checks the saved fingerprint; bases passed in memory reach the backend only
through the cache (``CKVPStaticCache(config, bases)``), which never sees the model. The backend checks them at the
first call of a compiled graph on each cache: the graph's input that the bases' first layer's key projection
multiplies by must hash as the weight they were calibrated with (``LatentBases.check_weight``). Without the
check another checkpoint of the same config (a fine-tune, another seed) ran with bases that do not fit its keys.
"""

from __future__ import annotations

import pytest
import torch

from ckvp_compile import CKVPBackend, CKVPConfig, CKVPConfigError
from ckvp_compile.latent import calibrate
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import build_hf_moe
from ckvp_compile.testing.decoding import hf_step_kwargs

SHAPE = dict(num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, num_experts=4, top_k=2, ffn=16)


def _prefill(model, bases, ids):
    cache = CKVPStaticCache(model.config, bases, max_cache_len=16)
    step = torch.compile(model, backend=CKVPBackend(CKVPConfig(compiler="eager")), fullgraph=True)
    with torch.no_grad():
        return step(**hf_step_kwargs(model, ids, cache, 0)).logits


def test_bases_of_another_checkpoint_are_refused_at_the_first_call():
    torch._dynamo.reset()
    model_a = build_hf_moe("mixtral", seed=0, **SHAPE)
    model_b = build_hf_moe("mixtral", seed=1, **SHAPE)  # same config, other weights
    bases = calibrate(model_a, [torch.randint(0, 256, (1, 12)) for _ in range(2)], kv_ratio=1.0, progress=False)
    ids = torch.randint(0, 256, (1, 5))
    assert torch.isfinite(_prefill(model_a, bases, ids)).all()  # its own model: runs
    torch._dynamo.reset()
    with pytest.raises(CKVPConfigError, match="calibrated on another model") as e:
        _prefill(model_b, bases, ids)
    assert "k_proj" in str(e.value) and "calibrate" in str(e.value)
    # the documented opt-out: the same bases run on model_b
    bases.model_fingerprint["k_weight_sha256"] = None
    assert torch.isfinite(_prefill(model_b, bases, ids)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_same_weights_in_another_dtype_pass(dtype):
    """The calibrated (fp32) model cast to bf16 or fp16 keeps its bases. Regression (fp16): the hash of the values
    rounded to bf16 differed for the fp16 copy (fp32 -> fp16 -> bf16 rounds ~6% of the values otherwise than
    fp32 -> bf16), so the model's own bases were refused; the fingerprint also hashes the fp16 rounding."""
    torch._dynamo.reset()
    model = build_hf_moe("mixtral", seed=2, **SHAPE)
    bases = calibrate(model, [torch.randint(0, 256, (1, 12)) for _ in range(2)], kv_ratio=1.0, progress=False)
    model = model.to(dtype)
    bases.check_model(model)  # the saved-file path (LatentBases.load(path, model=)) agrees
    cache = CKVPStaticCache(model.config, bases, max_cache_len=16, dtype=dtype)
    step = torch.compile(model, backend=CKVPBackend(CKVPConfig(compiler="eager")), fullgraph=True)
    with torch.no_grad():
        out = step(**hf_step_kwargs(model, torch.randint(0, 256, (1, 5)), cache, 0)).logits
    assert torch.isfinite(out).all()
