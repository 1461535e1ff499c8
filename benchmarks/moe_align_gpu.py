"""The one-program MoE routing kernel (``kernels.grouped_gemm.moe_align``) at decode sizes, by warp count.

    python3 benchmarks/moe_align_gpu.py --out DIR          # about 30 s on an H200

Issue 9's batch 1, 4k Qwen1.5-MoE row spent 447 us per step in 24 routing launches (18.6 us each for 4 pairs over
60 experts). Each case is timed as a CUDA-graph replay (what a compiled decode step runs) with
``triton.testing.do_bench``, checked against ``moe_align_ref``. Writes DIR/moe_align.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ckvp_compile.bench.attention import bench  # noqa: E402
from ckvp_compile.bench.output import run_env  # noqa: E402
from ckvp_compile.kernels import grouped_gemm as gg  # noqa: E402
from ckvp_compile.kernels.moe_reference import moe_align_ref  # noqa: E402

#: (tokens, experts, top_k): Qwen1.5-MoE (60 experts, top-4) and Mixtral (8, top-2) at batch 1, 8, 32.
CASES = ((1, 60, 4), (8, 60, 4), (32, 60, 4), (1, 8, 2), (8, 8, 2), (32, 8, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    rows = []
    for t, e, k in CASES:
        g = torch.Generator(device="cuda").manual_seed(t * 100 + e)
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])
        bm = gg.block_m_for(t * k, e)
        want = moe_align_ref(ids, e, bm)
        for warps in (1, 2, 4):
            row = dict(tokens=t, experts=e, top_k=k, block_m=bm, num_warps=warps,
                       default_warps=gg.align_num_warps(triton_np2(t * k), triton_np2(e)))
            got = gg.moe_align(ids, e, bm, num_warps=warps)
            row["exact"] = all(bool(torch.equal(x, y)) for x, y in zip(got, want))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                gg.moe_align(ids, e, bm, num_warps=warps)
            row["us"] = 1000 * bench(graph.replay, warmup=20, rep=100)
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(os.path.join(a.out, "moe_align.json"), "w") as f:
        json.dump({"env": run_env(t0), "rows": rows}, f, indent=1)


def triton_np2(n: int) -> int:
    import triton

    return triton.next_power_of_2(max(n, 1))


if __name__ == "__main__":
    main()
