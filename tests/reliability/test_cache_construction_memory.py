"""Building a ``CKVPStaticCache`` never allocates a dense K/V cache, not even one layer's for a moment.

HF's ``StaticLayer.lazy_initialization`` allocates the dense (B, Hkv, S_max, D) keys and values on the device of the
tensors it is given. The cache once passed it real probes and freed the dense tensors right after: at batch x context
where only the latent fits (the capacity the latent cache exists for), that transient allocation ran out of memory on
the H200 (Qwen1.5-MoE shape, batch 214 at 32k: 26.8 GiB for one layer's dense keys;
benchmarks/results/2026-11-30-max-batch-h200).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ckvp_compile.latent import calibrate
from ckvp_compile.latent.capture import hf_step_kwargs
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import build_hf_moe


class _Allocations(TorchDispatchMode):
    """Records (op, storage bytes, device) of every op whose result is a tensor on a real device (a view reports its
    base's storage, so a broadcast view of a small tensor stays small)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.device.type != "meta":
            self.seen.append((str(func), out.untyped_storage().nbytes(), str(out.device)))
        return out


def test_cache_construction_allocates_no_dense_layer_and_decodes():
    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    bases = calibrate(model, [torch.randint(0, 256, (1, 12))], group_size=2, kv_ratio=4.0, progress=False)
    batch, max_len, num_kv, head_dim = 3, 40, 2, 16
    dense_layer = batch * num_kv * max_len * head_dim * 4  # bytes of one layer's fp32 keys
    with _Allocations() as allocs:
        cache = CKVPStaticCache(model.config, bases, max_cache_len=max_len, max_batch_size=batch)
    big = [a for a in allocs.seen if a[1] >= dense_layer]
    assert not big, f"dense-sized allocations while building the cache: {big}"
    for layer in cache.layers:
        assert layer.device == torch.device("cpu")
        counter = getattr(layer, "cumulative_length", None)
        assert counter is None or counter.device.type == "cpu"
    # the cache still serves a compiled prefill and decode step
    torch._dynamo.reset()
    step = torch.compile(model, backend="ckvp", options={"compiler": "aot_eager"}, fullgraph=True)
    ids = torch.randint(0, 256, (batch, 5))
    with torch.no_grad():
        out = step(**hf_step_kwargs(model, ids, cache, 0)).logits
        out = step(**hf_step_kwargs(model, out[:, -1:].argmax(-1), cache, 5)).logits
    assert torch.isfinite(out).all()
