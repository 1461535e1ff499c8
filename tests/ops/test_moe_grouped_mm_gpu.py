"""GPU tests of the ``torch._grouped_mm`` expert parts (``ckvp::moe_gate_up_grouped_mm`` /
``ckvp::moe_down_grouped_mm``, ckvp_compile/kernels/moe_grouped_mm.py), skipped without a CUDA device whose
``torch._grouped_mm`` runs fused in bf16 (sm90 / sm100):

* property: both parts chained (pad rows of the activations poisoned with NaN in between) against the fp64
  per-expert loop for any routing (empty experts, every token on one expert, top-k 1..8, up to 64 experts),
  relative error ||out - ref|| / ||ref|| <= 1e-2 in bf16, and the fused path is the one taken;
* the parts run inside a CUDA graph capture (which fails on any host synchronisation) and replay correctly.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from ckvp_compile import ops as ckvp_ops
from ckvp_compile.kernels import moe_grouped_mm as gm
from ckvp_compile.kernels import moe_reference as moe_ref
from ckvp_compile.testing.moe_cases import make_moe_inputs, moe_routing_cases


def _fast_path_device() -> bool:
    return torch.cuda.is_available() and gm.supports_grouped_mm(
        torch.device("cuda"), torch.bfloat16, torch.cuda.get_device_capability())


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _fast_path_device(),
                                                  reason="needs a CUDA device with the fused bf16 _grouped_mm")]
ckvp_ops.register_all()


def _parts(x: dict, case: dict, block_m: int) -> torch.Tensor:
    sorted_ids, tiles = moe_ref.moe_align_ref(x["topk_ids"], case["num_experts"], block_m)
    act = torch.ops.ckvp.moe_gate_up_grouped_mm(x["hidden"], sorted_ids, tiles, x["w_gate"], x["w_up"],
                                                case["top_k"], block_m)
    act.masked_fill_((sorted_ids >= x["topk_ids"].numel())[:, None], float("nan"))  # no nonzero: no sync
    pairs = torch.ops.ckvp.moe_down_grouped_mm(act, sorted_ids, tiles, x["w_down"], x["topk_weights"], block_m)
    return pairs.view(case["tokens"], case["top_k"], -1).sum(1)


def _rel(out: torch.Tensor, x: dict) -> float:
    args = (x["hidden"], x["topk_ids"], x["topk_weights"], x["w_gate"], x["w_up"], x["w_down"])
    ref = moe_ref.moe_experts_loop_ref(*(t.double() if t.is_floating_point() else t for t in args))
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


@given(case=moe_routing_cases(dims=(16, 64, 128)))
@settings(max_examples=12, deadline=None)
def test_parts_match_the_loop_bf16(case):
    x = make_moe_inputs(case, dtype=torch.bfloat16, device="cuda")
    assert gm.grouped_mm_fast_path(x["hidden"][:1].contiguous(), x["w_gate"])
    assert _rel(_parts(x, case, 16), x) <= 1e-2


def test_no_host_sync_and_cuda_graph_capture():
    case = dict(tokens=40, num_experts=8, top_k=2, hidden=128, ffn=64, mode="random", seed=6)
    x = make_moe_inputs(case, dtype=torch.bfloat16, device="cuda")
    _parts(x, case, 16)  # compile the Triton epilogues outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _parts(x, case, 16)
    new = make_moe_inputs(dict(case, seed=7), dtype=torch.bfloat16, device="cuda")
    for k in ("hidden", "topk_ids", "topk_weights"):
        x[k].copy_(new[k])
    graph.replay()
    assert _rel(out, x) <= 1e-2
