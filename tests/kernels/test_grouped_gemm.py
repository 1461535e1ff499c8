"""Tests of the Triton grouped expert GEMMs (ckvp_compile/kernels/grouped_gemm.py) on CPU, under the Triton
interpreter, against the PyTorch references (kernels/moe_reference.py) and the fp64 per-expert loop.

``TRITON_INTERPRET=1`` must be set before Triton is imported, and the pytest process may already have imported
it (Inductor does), so the checks run in a child process started with the variable set: this file executed as
a script. Shapes are tiny (the interpreter runs each program in Python): the whole child takes a few seconds.
Covered: partial N and K tiles, empty experts, every token on one expert, top-k 1..4, strided (HF fused
gate_up) weights, split-K down, the M tiles 16 and 32 and 16-row sub-tiles of a 32-row routing tile, fp32 exactness (IEEE dots), the full launcher, the
one-program routing kernel (vs the torch routing, and its fallback size), the combine kernel, and config
pruning (the untuned default fits shared memory in fp32 and bf16).
"""

from __future__ import annotations

import os

import pytest

CASES = [  # (tokens, experts, top_k, hidden, ffn, mode, seed)
    (3, 4, 2, 24, 40, "random", 0),
    (9, 6, 1, 16, 16, "one_expert", 1),
    (5, 8, 4, 40, 24, "skewed", 2),
    (1, 3, 3, 16, 8, "duplicate", 3),
]


def _check_cases() -> None:
    """Run every case through both kernels and the launcher; raise AssertionError on a mismatch."""
    import torch

    from ckvp_compile.kernels import grouped_gemm as gg
    from ckvp_compile.kernels import moe_reference as ref
    from ckvp_compile.testing.moe_cases import make_moe_inputs

    assert os.environ.get("TRITON_INTERPRET") == "1"
    for t, e, a, dm, i, mode, seed in CASES:
        x = make_moe_inputs(dict(tokens=t, num_experts=e, top_k=a, hidden=dm, ffn=i, mode=mode, seed=seed))
        args = (x["hidden"], x["topk_ids"], x["topk_weights"], x["w_gate"], x["w_up"], x["w_down"])
        for block_m, split_k, sub in ((16, 1, None), (32, 2, None), (32, 1, 16)):
            sorted_ids, block_expert = ref.moe_align_ref(x["topk_ids"], e, block_m)
            cfg = gg.GemmConfig(block_n=16, block_k=16, num_warps=1, num_stages=2, split_k=split_k, block_m=sub)
            act = gg.grouped_gate_up(x["hidden"], sorted_ids, block_expert, x["w_gate"], x["w_up"], a, block_m, cfg)
            act_ref = ref.grouped_gate_up_ref(x["hidden"], sorted_ids, block_expert, x["w_gate"], x["w_up"], a,
                                              block_m)
            rows = cfg.rows(block_m)  # rows of (sub-)tiles without a pair are not written
            first_pair = sorted_ids[::rows].long()
            used = ((block_expert.long().repeat_interleave(block_m // rows) >= 0) & (first_pair < t * a))
            used = used.repeat_interleave(rows)
            torch.testing.assert_close(act[used], act_ref[used], rtol=1e-5, atol=1e-6)
            pairs = gg.grouped_down(act_ref, sorted_ids, block_expert, x["w_down"], x["topk_weights"], block_m, cfg)
            pairs_ref = ref.grouped_down_ref(act_ref, sorted_ids, block_expert, x["w_down"], x["topk_weights"],
                                             block_m)
            torch.testing.assert_close(pairs, pairs_ref, rtol=1e-5, atol=1e-6)
            out = gg.moe_experts_triton(*args, gate_up_config=cfg, down_config=cfg, block_m=block_m)
            golden = ref.moe_experts_loop_ref(*(v.double() if v.is_floating_point() else v for v in args))
            err = (out.double() - golden).abs().max() / golden.abs().max()
            assert err <= 1e-5, (t, e, a, dm, i, mode, block_m, float(err))
    # the one-program routing kernel equals the torch routing, including pad tiles and the fallback size
    for t, e, a, bm, seed in ((1, 8, 2, 16, 0), (13, 5, 3, 16, 1), (30, 60, 4, 16, 2), (100, 16, 4, 32, 4),
                              (1, 1, 1, 16, 5), (7, 1, 1, 16, 6), (2000, 8, 2, 128, 3)):
        ids = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(seed + k))[:a]
                           for k in range(t)])
        for got, want in zip(gg.moe_align(ids, e, bm), ref.moe_align_ref(ids, e, bm)):
            assert torch.equal(got, want), (t, e, a, bm)
    # more tiles than one tile block (68 > 64), repeated experts in a token's row, both warp counts
    for t, e, a, bm, seed in ((60, 64, 2, 16, 7), (9, 6, 3, 16, 8)):
        ids = torch.randint(0, e, (t, a), generator=torch.Generator().manual_seed(seed))
        for warps in (1, 4):
            for got, want in zip(gg.moe_align(ids, e, bm, num_warps=warps), ref.moe_align_ref(ids, e, bm)):
                assert torch.equal(got, want), (t, e, a, bm, warps)
    assert gg.align_num_warps(4, 64) == 1 and gg.align_num_warps(32, 64) == 4
    pairs = torch.randn(12, 40)
    torch.testing.assert_close(gg.combine(pairs, 3, torch.float32), pairs.view(4, 3, 40).sum(1))
    # configs: the first survivor fits shared memory for fp32 too (it is the untuned default)
    for bm in (16, 32, 64, 128):
        for itemsize in (2, 4):
            for cfgs, tiles in ((gg.gate_up_configs(bm, itemsize), 2), (gg.down_configs(bm, itemsize), 1)):
                c = cfgs[0]
                assert c.num_stages * (bm * c.block_k + tiles * c.block_k * c.block_n) * itemsize <= gg.SMEM_BUDGET
    # an autotuned launch picks the first candidate under the interpreter and stays correct
    x = make_moe_inputs(dict(tokens=2, num_experts=2, top_k=1, hidden=16, ffn=16, mode="random", seed=4))
    args = (x["hidden"], x["topk_ids"], x["topk_weights"], x["w_gate"], x["w_up"], x["w_down"])
    torch.testing.assert_close(gg.moe_experts_triton(*args), ref.moe_experts_ref(*args), rtol=1e-5, atol=1e-6)
    print("ok", len(CASES))


def test_kernels_match_references_under_interpreter():
    pytest.importorskip("triton")
    from ckvp_compile.testing.interpreter import run_under_triton_interpreter

    proc = run_under_triton_interpreter(__file__, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.strip().endswith(f"ok {len(CASES)}")


if __name__ == "__main__":
    _check_cases()
