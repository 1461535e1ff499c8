"""Decode attention at small batch x context (issue 9's batch 1, 4k row is latency-bound): launch configs and
the split of the time between the kernels.

    python3 benchmarks/latent_attention_small_gpu.py --out DIR      # about 2 minutes on an H200

One layer, head_dim 128, int4/32 latents of rank 256 (a 4-layer group), Qwen1.5-MoE-shaped (16:16) and
Mixtral-shaped (32:8) heads, batch 1 and 8 at context 4k. Per config: median ms of the whole call
(``triton.testing.do_bench`` over a CUDA-graph replay of the call, as a compiled decode step runs it: eager calls
at these sizes time the launcher's Python, kept as ``ms_eager``), of the key pass alone (``latent_scores_triton``) and the relative error against the
fp32 reference, with the compiled split kernel's registers and spills. Configs: the default; one pass; context
splits (``min_tiles`` 2, ``target_programs`` 528); tiles of 32 slots; 1 and 3 stages; the merge split over D. Dense
SDPA over bf16 K/V of the same context is timed in the same run for scale. Writes DIR/latent_attention_small.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ckvp_compile.bench.attention import bench, kernel_stats, make_inputs, ref_chunked, rel_err  # noqa: E402
from ckvp_compile.bench.output import run_env  # noqa: E402
from ckvp_compile.kernels.latent_attention_triton import (  # noqa: E402
    default_config,
    latent_attention_triton,
    latent_scores_triton,
)


def configs_v2(default) -> dict:
    """The runtime rank loop (``r_loop``) and the exact code-domain rebuild (``key_codes``): fewer live registers
    per program, and one tensor-core product per chunk instead of the hi/lo split's two."""
    r = dataclasses.replace
    codes = r(default, key_codes=True, r_loop=True, hoist_basis=False)
    return {"default": default, "reduce split over D": r(default, reduce_split_d=True),
            "codes r_loop": codes, "codes r_loop 8w": r(codes, num_warps=8),
            "codes r_loop 8w cap128": r(codes, num_warps=8, maxnreg=128),
            "codes r_loop 8w 1 tile": r(codes, num_warps=8, key_tiles=1),
            "codes r_loop 8w 3 stages": r(codes, num_warps=8, num_stages=3),
            "codes r_loop 4w cap168": r(codes, maxnreg=168),
            "codes r_loop bn128 8w": r(codes, block_n=128, num_warps=8),
            "r_loop 8w": r(default, r_loop=True, hoist_basis=False, num_warps=8),
            "codes r_loop 8w, split D": r(codes, num_warps=8, reduce_split_d=True)}


def configs_values(default) -> dict:
    """The value pass at one query head per KV head: the 2-D accumulation (default) against the row sum per tile,
    with the merge over D slices (default) and without."""
    r = dataclasses.replace
    return {"default": default, "row sum per tile, one merge program": r(default, fma_values_2d=False,
                                                                          reduce_split_d=False)}


def configs_b1(default) -> dict:
    """Batch 1: programs per pass, value tiles and warps, stages, hoisting (the latency-bound regime)."""
    r = dataclasses.replace
    return {"default": default, "key_tiles 1": r(default, key_tiles=1), "key_tiles 2": r(default, key_tiles=2),
            "1 stage": r(default, num_stages=1), "block_n_v 64": r(default, block_n_v=64),
            "block_n_v 16": r(default, block_n_v=16), "num_warps_v 2": r(default, num_warps_v=2),
            "min_tiles 1, target 528": r(default, min_tiles=1, target_programs=528),
            "8 warps": r(default, num_warps=8), "no hoist": r(default, hoist_basis=False)}


def configs_b1b(default) -> dict:
    """The batch-1 winners of ``b1`` combined, and the one-pass kernel (no scores round trip, one launch fewer)."""
    r = dataclasses.replace
    return {"default": default, "1 stage": r(default, num_stages=1),
            "1 stage, block_n_v 64": r(default, num_stages=1, block_n_v=64),
            "one pass": r(default, two_pass=False), "one pass, 1 stage": r(default, two_pass=False, num_stages=1)}


def configs_fuse(default) -> dict:
    """The merge fused into the value pass (the last-arriving split merges its row): one launch fewer."""
    r = dataclasses.replace
    return {"default": default, "fuse_merge": r(default, fuse_merge=True),
            "fuse_merge, one pass": r(default, fuse_merge=True, two_pass=False),
            "fuse_merge, 1 stage, block_n_v 64": r(default, fuse_merge=True, num_stages=1, block_n_v=64)}


def configs(default) -> dict:
    r = dataclasses.replace
    return {"default": default, "one pass": r(default, two_pass=False), "min_tiles 2": r(default, min_tiles=2),
            "target 528": r(default, target_programs=528), "block_n 32": r(default, block_n=32),
            "1 stage": r(default, num_stages=1), "3 stages": r(default, num_stages=3),
            "reduce split over D": r(default, reduce_split_d=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="", help="comma-separated contexts (default: --context)")
    ap.add_argument("--heads", default="16:16,32:8")
    ap.add_argument("--ranks", default="256", help="comma-separated latent ranks per KV head")
    ap.add_argument("--set", default="launch", choices=["launch", "v2", "values", "b1", "b1b", "fuse"], help="config set: launch configs, or the "
                    "runtime rank loop / code-domain rebuild variants")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip the remaining rows after this long")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    rows = []
    contexts = [int(x) for x in (a.contexts or str(a.context)).split(",")]
    shapes = [(tuple(int(x) for x in hs.split(":")), b, t, rank) for hs in a.heads.split(",")
              for rank in (int(x) for x in a.ranks.split(","))
              for t in contexts for b in (int(x) for x in a.batches.split(","))]
    for heads, b, context, rank in shapes:
        if time.time() - t0 > a.budget_s:
            print(json.dumps({"skipped": [heads, b, context, rank]}), flush=True)
            continue
        a.context = context
        args = make_inputs(b, a.context, "int4/32", rank, seed=0, dev="cuda", heads=heads, head_dim=128, group=4)
        want = ref_chunked(args, 1)
        q = args[0]
        k = torch.randn(b, heads[1], a.context, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        dense_ms = bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=heads[0] != heads[1]),
                         warmup=10, rep=30)
        sargs = (args[0], args[1], args[3], args[5], args[7], args[8], args[9], args[10], args[11], args[14],
                 args[15], args[16], args[17], args[18])
        default = default_config(heads[0] // heads[1], max(16, 1 << (rank - 1).bit_length()))
        for name, cfg in {"v2": configs_v2, "values": configs_values, "b1": configs_b1, "b1b": configs_b1b,
                           "fuse": configs_fuse}.get(a.set, configs)(default).items():
            row = {"heads": f"{heads[0]}:{heads[1]}", "batch": b, "context": a.context, "rank": rank, "config": name,
                   "dense_sdpa_ms": dense_ms}
            try:
                out = latent_attention_triton(*args, config=cfg)
                row["rel_err"] = rel_err(out, want)
                row["ms_eager"] = bench(lambda: latent_attention_triton(*args, config=cfg), warmup=10, rep=30)
                # the launcher's Python time dominates eager calls at these sizes: time a CUDA-graph replay
                # (what a compiled decode step runs) as "ms"
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    graph_out = latent_attention_triton(*args, config=cfg)
                row["ms"] = bench(graph.replay, warmup=10, rep=30)
                # the graph's output after every replay above (state left by a call, e.g. the fused merge's
                # arrival counters, must not change the next one)
                row["rel_err_after_replays"] = rel_err(graph_out, want)
                row.update(kernel_stats())
                if cfg.two_pass:
                    kgraph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(kgraph):
                        latent_scores_triton(*sargs, config=cfg)
                    row["key_pass_ms"] = bench(kgraph.replay, warmup=10, rep=30)
                row["config_fields"] = dataclasses.asdict(cfg)
            except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
                row["error"] = repr(e)[:300]
            print(json.dumps({k: v for k, v in row.items() if k != "config_fields"}), flush=True)
            rows.append(row)
        del args, want, k, v
        torch.cuda.empty_cache()
        with open(os.path.join(a.out, "latent_attention_small.json"), "w") as f:  # after each shape: kept if cut
            json.dump({"env": run_env(t0), "argv": sys.argv[1:], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
