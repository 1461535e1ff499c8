"""A graph that calls an op which syncs with the host gets CUDA graphs turned off, with a warning naming the op
and the fix, instead of failing at capture.

On the H200 an fp32 HF Mixtral compiled with ``backend="ckvp"`` and ``mode="reduce-overhead"`` stopped with
"Cannot copy between CPU and CUDA tensors during CUDA graph capture": transformers' fp32 expert path
(``transformers::grouped_mm_fallback``) loops over ``offs.tolist()`` (benchmarks/results/2026-11-30-max-batch-h200).
The decision is made on the graph, so it is checked here on CPU; the GPU run is benchmarks/capture_fp32_gpu.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from ckvp_compile.analysis.graph import CAPTURE_UNSAFE_OPS, capture_unsafe_calls
from ckvp_compile.backend import _cudagraphs_off_for_host_syncs
from ckvp_compile.errors import UnsupportedPatternWarning
from ckvp_compile.latent.capture import hf_step_kwargs, make_static_cache
from ckvp_compile.testing import build_hf_moe


def _dynamo_graph(dtype: torch.dtype):
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model = build_hf_moe("mixtral", num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, hidden=64).to(dtype)
    cache = make_static_cache(model, 16)
    with torch.no_grad():
        torch.compile(model, backend=keep, fullgraph=True)(**hf_step_kwargs(model, torch.randint(0, 256, (2, 3)),
                                                                            cache, 0))
    return graphs[0]


def test_fp32_hf_experts_turn_cuda_graphs_off_with_the_reason_and_fix():
    gm = _dynamo_graph(torch.float32)
    found = capture_unsafe_calls(gm.graph)
    assert found == {"transformers::grouped_mm_fallback": 2}  # gate_up and down of the one MoE layer
    patches = {"triton.cudagraphs": True}
    with pytest.warns(UnsupportedPatternWarning) as caught:
        _cudagraphs_off_for_host_syncs(gm, patches)
    assert patches["triton.cudagraphs"] is False
    msg = str(caught[0].message)
    assert "transformers::grouped_mm_fallback x2" in msg and "offs.tolist()" in msg
    assert "enable_expert_gemm" in msg and "bfloat16" in msg


def test_bf16_hf_experts_keep_cuda_graphs():
    gm = _dynamo_graph(torch.bfloat16)
    assert capture_unsafe_calls(gm.graph) == {}
    patches = {"triton.cudagraphs": True}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _cudagraphs_off_for_host_syncs(gm, patches)
    assert patches["triton.cudagraphs"] is True


def test_every_listed_op_names_a_reason_and_a_fix():
    for name, (why, fix) in CAPTURE_UNSAFE_OPS.items():
        assert "::" in name and why and fix.startswith(("run ", "pass ", "use "))
