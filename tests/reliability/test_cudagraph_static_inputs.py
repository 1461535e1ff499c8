"""CUDA graphs (``mode="reduce-overhead"``) need static inputs: the CPU-side prerequisite, checked on every machine.

Inductor's CUDA-graph trees copy every non-static input into the graph's own buffers at each replay and skip the
graph ("mutated inputs") when a non-static input is written in place, which a KV cache is at every step.
AOTAutograd computes the static input indices only for a graph it recognises as Dynamo's (``gm.meta`` holds
``dynamo_compile_id``, every placeholder has ``_dynamo_source``); the backend's rewritten copy lost that
metadata, so on the H200 every decode graph ran without CUDA graphs (benchmarks/results/2026-11-29-reliability-h200,
first run). The GPU half of this check (no skip, no host sync, step time) is ``benchmarks/reliability_gpu.py``.
"""

from __future__ import annotations

import torch

import ckvp_compile._compat as compat
from ckvp_compile.latent import calibrate
from ckvp_compile.latent.capture import hf_step_kwargs
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import build_hf_moe


def test_rewritten_graph_keeps_dynamo_metadata_and_marks_the_store_static(monkeypatch):
    """The graph handed to AOTAutograd after the latent rewrite: Dynamo's metadata kept, every original
    placeholder with its Dynamo source, the appended store inputs marked static, and the cache / parameter inputs
    still static (as Dynamo marked them)."""
    seen: list = []
    real = compat.compile_with_aot_eager

    def spy(gm, example_inputs, manager):
        seen.append(gm)
        return real(gm, example_inputs, manager)

    monkeypatch.setattr(compat, "compile_with_aot_eager", spy)
    torch._dynamo.reset()
    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    bases = calibrate(model, [torch.randint(0, 256, (1, 12))], group_size=2, kv_ratio=1.0, progress=False)
    cache = CKVPStaticCache(model.config, bases, max_cache_len=16)
    step = torch.compile(model, backend="ckvp", options={"compiler": "aot_eager"}, fullgraph=True)
    with torch.no_grad():
        step(**hf_step_kwargs(model, torch.randint(0, 256, (1, 4)), cache, 0))
    assert seen, "the backend did not compile through aot_eager"
    gm = seen[-1]
    assert "dynamo_compile_id" in gm.meta
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    assert all(hasattr(n, "_dynamo_source") for n in placeholders)
    static = [n for n in placeholders if n.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")]
    appended = [n for n in placeholders if n._dynamo_source is None]
    assert appended and all(n in static for n in appended)  # the store's tensors
    # everything but the per-call tensors (token ids, positions) is static: parameters, phantoms, counters, store
    assert len(placeholders) - len(static) <= 3, [n.name for n in placeholders if n not in static]
