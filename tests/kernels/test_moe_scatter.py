"""Tests of the Triton row-scatter epilogues (ckvp_compile/kernels/moe_scatter.py) under the Triton interpreter,
against their PyTorch twins (kernels/moe_grouped_mm.py), and of the grouped_mm expert parts with those kernels.

As tests/kernels/test_grouped_gemm.py: the checks run in a child process with ``TRITON_INTERPRET=1`` (this file
executed as a script). Covered: partial row and column blocks, GEMM outputs with a padded row stride (what
``torch._grouped_mm`` returns for N not a multiple of 8), column-major routing weights, bf16 and fp32, rows of the
destination that no index names left untouched, and ``moe_gate_up_grouped_mm`` / ``moe_down_grouped_mm`` run
with the Triton epilogues (as on CUDA) against the references on real routings (empty experts, one expert).
"""

from __future__ import annotations

import os

import pytest


def _check() -> None:
    import torch

    from ckvp_compile.kernels import moe_grouped_mm as gm
    from ckvp_compile.kernels import moe_reference as ref
    from ckvp_compile.kernels import moe_scatter as ms
    from ckvp_compile.testing.moe_cases import make_moe_inputs

    assert os.environ.get("TRITON_INTERPRET") == "1"
    g = torch.Generator().manual_seed(0)
    for p, n, r, dtype in ((13, 12, 40, torch.float32), (9, 300, 9, torch.bfloat16), (1, 5, 3, torch.float32)):
        gate = torch.randn(p, 16 * (n // 16 + 1), generator=g).to(dtype)[:, :n]  # padded row stride
        up = torch.randn(p, n, generator=g).to(dtype)
        rows = torch.randperm(r, generator=g)[:p]
        got = ms.silu_mul_scatter(gate, up, rows, torch.full((r, n), 7.0, dtype=dtype))
        want = gm.silu_mul_scatter_ref(gate, up, rows, torch.full((r, n), 7.0, dtype=dtype))
        # bf16: the interpreter casts fp32 -> bf16 toward zero (the GPU rounds to nearest): one ulp apart
        tol = dict(rtol=2 ** -7, atol=1e-6) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got, want, **tol)
        untouched = torch.ones(r, dtype=torch.bool)
        untouched[rows] = False
        assert bool((got[untouched] == 7).all())
        t, a = max(1, p // 2 + 1), 2
        weights = torch.rand(a, t, generator=g).t()  # (T, A) column-major
        pairs = torch.randperm(t * a, generator=g)[:p]
        got = ms.scale_scatter(gate, pairs, weights, torch.full((t * a, n), 7.0))
        want = gm.scale_scatter_ref(gate, pairs, weights, torch.full((t * a, n), 7.0))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # the grouped_mm parts with the Triton epilogues, as they run on CUDA
    gm._scatters = lambda device: (ms.silu_mul_scatter, ms.scale_scatter)
    cases = ((7, 4, 2, 16, 24, "random", 0, 16), (9, 6, 3, 24, 16, "one_expert", 1, 4),
             (5, 12, 2, 16, 40, "skewed", 2, 1))
    for t, e, a, dm, i, mode, seed, block_m in cases:
        x = make_moe_inputs(dict(tokens=t, num_experts=e, top_k=a, hidden=dm, ffn=i, mode=mode, seed=seed))
        sorted_ids, tiles = ref.moe_align_ref(x["topk_ids"], e, block_m)
        valid = sorted_ids.long() < t * a
        act = gm.moe_gate_up_grouped_mm(x["hidden"], sorted_ids, tiles, x["w_gate"], x["w_up"], a, block_m)
        act_ref = ref.grouped_gate_up_ref(x["hidden"], sorted_ids, tiles, x["w_gate"], x["w_up"], a, block_m)
        torch.testing.assert_close(act[valid], act_ref[valid], rtol=1e-5, atol=1e-6)
        act[~valid] = float("nan")
        pairs = gm.moe_down_grouped_mm(act, sorted_ids, tiles, x["w_down"], x["topk_weights"], block_m)
        pairs_ref = ref.grouped_down_ref(act_ref, sorted_ids, tiles, x["w_down"], x["topk_weights"], block_m)
        torch.testing.assert_close(pairs, pairs_ref, rtol=1e-5, atol=1e-6)
    print("ok", len(cases))


def test_scatter_kernels_match_twins_under_interpreter():
    pytest.importorskip("triton")
    from ckvp_compile.testing.interpreter import run_under_triton_interpreter

    proc = run_under_triton_interpreter(__file__, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.strip().endswith("ok 3")


def test_launchers_reject_mismatched_shapes():
    pytest.importorskip("triton")
    import torch

    from ckvp_compile.kernels import moe_scatter as ms

    with pytest.raises(ValueError, match="silu_mul_scatter"):
        ms.silu_mul_scatter(torch.zeros(3, 4), torch.zeros(3, 5), torch.arange(3), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="scale_scatter"):
        ms.scale_scatter(torch.zeros(3, 4), torch.arange(3), torch.ones(2, 2), torch.zeros(3, 4))


if __name__ == "__main__":
    _check()
