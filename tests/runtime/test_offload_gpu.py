"""Expert offload on CUDA: the side copy stream, the per-slot events and the prefetches give exactly the
all-resident output for any routing and cache size (skipped without CUDA; the lead runs it on the H200)."""

from __future__ import annotations

import pytest
import torch

from ckvp_compile.ops import register_all
from ckvp_compile.runtime.offload import ExpertOffloader

register_all()

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("resident", [1, 2, 4, 6, 8])
def test_streams_equal_all_resident(dtype, resident):
    e, a, dm, i, layers = 8, 2, 256, 512, 3
    g = torch.Generator(device="cuda").manual_seed(resident)
    gu = [(torch.randn(e, 2 * i, dm, device="cuda", generator=g) * dm ** -0.5).to(dtype) for _ in range(layers)]
    dn = [(torch.randn(e, dm, i, device="cuda", generator=g) * i ** -0.5).to(dtype) for _ in range(layers)]
    preds = [[torch.randn(e, dm, device="cuda", generator=g)] for _ in range(layers)]
    host_gu = [torch.empty(w.shape, dtype=dtype, pin_memory=True).copy_(w) for w in gu]
    host_dn = [torch.empty(w.shape, dtype=dtype, pin_memory=True).copy_(w) for w in dn]
    for prefetch in (True, False):
        off = ExpertOffloader(host_gu, host_dn, resident=resident, top_k=a, device="cuda", predictors=preds,
                              prefetch=prefetch, margin=1)
        for step in range(6):
            for layer in range(layers):
                t = (1, 3, 8)[step % 3]
                ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:a] for _ in range(t)])
                h = torch.randn(t, dm, device="cuda", generator=g).to(dtype)
                w = torch.rand(t, a, device="cuda", generator=g)
                out = off.forward(layer, h, ids, w)
                ref = torch.ops.ckvp.moe_experts(h, ids, w, gu[layer][:, :i], gu[layer][:, i:], dn[layer])
                if dtype == torch.float32:  # ieee fp32 dots: equal up to split-K atomic order
                    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
                elif len(set(ids.flatten().tolist())) <= resident:  # one round: same rows per expert, <= 1 bf16 ulp
                    torch.testing.assert_close(out.float(), ref.float(), rtol=8e-3, atol=1e-3)
                else:  # rounds: each pair output rounded to bf16 before the fp32 sum
                    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
        torch.cuda.synchronize()
        s = off.stats()
        assert s.hits + s.misses == s.lookups and s.bytes_copied == (s.misses + s.prefetch_copies) * s.expert_bytes
        assert s.stall_ms >= 0.0
        for n, cache in enumerate(off.planner.caches):  # the slots hold what the planner says, after all copies
            for slot, ex in enumerate(cache.slots):
                assert torch.equal(off.slot_gate_up[n][slot].cpu(), host_gu[n][ex])
        off.close()
