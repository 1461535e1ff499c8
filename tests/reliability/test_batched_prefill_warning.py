"""The open batched-prefill bug (benchmarks/results/2026-12-06-session-gpu): on CUDA under Inductor a latent cache's
prefill for 2+ sequences gave wrong logits. Until it is fixed the backend warns when it compiles such a graph; these
tests check when the warning fires (the GPU itself is not needed: the decision is made from the plan)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import ckvp_compile.backend as backend
from ckvp_compile.latent import calibrate
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import build_hf_moe
from ckvp_compile.testing import prefill_decode_logits


@pytest.mark.parametrize("device, batch, multi, compiler, risky", [
    ("cuda", 2, True, "inductor", True),
    ("cuda:0", 8, True, "inductor", True),
    ("cuda", 1, True, "inductor", False),  # one sequence: right on the GPU
    ("cuda", 2, False, "inductor", False),  # decode steps: right
    ("cuda", 2, True, "aot_eager", False),  # the ops' own kernels with eager layouts: right
    ("cpu", 2, True, "inductor", False),  # the PyTorch references: right
])
def test_when_the_batched_prefill_warning_fires(device, batch, multi, compiler, risky):
    plan = SimpleNamespace(store=SimpleNamespace(batch_size=batch, device=torch.device(device)), multi_token=multi)
    assert backend.batched_prefill_at_risk(plan, compiler) is risky


def test_the_pass_marks_prefill_graphs_multi_token(monkeypatch):
    """A batch-2 prefill graph writes several tokens per sequence, the decode graph one: the plan says so."""
    seen = []
    real = backend.batched_prefill_at_risk

    def recording(plan, compiler):
        seen.append((plan.multi_token, plan.store.batch_size))
        return real(plan, compiler)

    monkeypatch.setattr(backend, "batched_prefill_at_risk", recording)
    torch._dynamo.reset()
    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    bases = calibrate(model, [torch.randint(0, 256, (1, 12)) for _ in range(2)], group_size=2, kv_ratio=2,
                      progress=False)
    compiled = torch.compile(model, backend="ckvp", options={"compiler": "aot_eager"})
    try:
        cache = CKVPStaticCache(model.config, bases, max_cache_len=8, max_batch_size=2)
        prefill_decode_logits(model, torch.randint(0, 256, (2, 5)), 2, compile_fn=lambda m: compiled, max_cache_len=8,
                              cache=cache)
    finally:
        torch._dynamo.reset()
    assert seen[0] == (True, 2) and (False, 2) in seen[1:], seen
