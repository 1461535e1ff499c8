"""Launch configurations of the fused latent decode attention at the small per-head ranks of one latent per layer.

With ``--group-size 1`` a Qwen1.5-MoE-shaped model at KV ratio 16 keeps int4 key ranks of about 10-100 per head
(benchmarks/results/2026-11-30-decode-e2e-h200/group-size-1), and the whole call at rank 32 (1.67 ms at batch 8,
32k) took 3.5x dense SDPA while reading 1/12 of its bytes: H200 Nsight Compute showed 256 programs in both
passes (``target_programs`` 264), the key pass at 254 registers (2 programs per SM) and the value pass at 40
registers but 0.16 waves. This script times whole calls (``latent_attention_triton``) under configs that change
the programs per pass, the key tile and the RoPE table loads, each checked against the reference.

    python3 benchmarks/latent_attention_small_rank_gpu.py --out DIR

Shape: 16 query heads, 16 KV heads, head_dim 128, int4/32 latents (keys and values of one rank), batch 8 and 32k
unless told; per rank a list of variants. Writes DIR/small_rank.json (rows: rank, batch, context, variant, ms,
rel_err, registers) with the GPU, torch and Triton versions and this command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import latent_attention_gpu as lag  # noqa: E402

from ckvp_compile.kernels.latent_attention_triton import default_config, latent_attention_triton  # noqa: E402


def variants(cfg, full: bool) -> dict:
    """Configs of one case; ``full`` adds the key-pass tile and program-count sweep of the first run."""
    r = dataclasses.replace
    vp = r(cfg, target_programs_v=2112)
    v = {"default": cfg,
         "value programs 2112": vp,
         "value programs 2112, rotate_basis": r(vp, rotate_basis=True),
         "value programs 2112, rotate_basis, block_n 32": r(vp, rotate_basis=True, block_n=32),
         "value programs 2112, rotate_basis, block_n 32, key_tiles 8": r(vp, rotate_basis=True, block_n=32,
                                                                         key_tiles=8),
         "value programs 2112, rotate_basis, paired tables": r(vp, rotate_basis=True, paired_tables=True),
         "value programs 2112, rotate_basis, 8 warps": r(vp, rotate_basis=True, num_warps=8)}
    if full:
        v.update({
            "value programs 2112, rotate_basis, block_n 128, 8 warps": r(vp, rotate_basis=True, block_n=128,
                                                                         num_warps=8),
            "value programs 2112, rotate_basis, block_n 32, paired tables": r(vp, rotate_basis=True, block_n=32,
                                                                              paired_tables=True),
            "value programs 2112, rotate_basis, 1 stage": r(vp, rotate_basis=True, num_stages=1),
            "value programs 2112, key block_n 32, key_tiles 8": r(vp, block_n=32, key_tiles=8),
        })
    return v


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="8:32768:32:full,8:32768:12,8:32768:64,1:4096:32,1:4096:12",
                    help="comma-separated batch:context:rank[:full]")
    a = ap.parse_args()
    lag.H, lag.HKV, lag.GROUP = 16, 16, 1
    os.makedirs(a.out, exist_ok=True)
    import triton

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "heads": "16:16", "head_dim": lag.D, "format": "int4/32", "command": "python3 " + " ".join(sys.argv)}
    rows = []
    for case in a.cases.split(","):
        b, t, rank, *full = case.split(":")
        b, t, rank = int(b), int(t), int(rank)
        args = lag.make_inputs(b, t, "int4/32", rank, seed=3)
        want = lag.ref_chunked(args, 2)
        cfg = default_config(1, max(16, 1 << (rank - 1).bit_length()))
        for name, c in variants(cfg, bool(full)).items():
            row = {"batch": b, "context": t, "rank": rank, "variant": name}
            try:
                out = latent_attention_triton(*args, config=c)
                row["rel_err"] = lag.rel_err(out, want)
                row["ms"] = round(lag.bench(lambda c=c: latent_attention_triton(*args, config=c), warmup=5, rep=30), 4)
                row.update(lag.kernel_stats())
            except Exception as e:  # noqa: BLE001 - reported, the others still run
                row["error"] = repr(e)[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(a.out, "small_rank.json"), "w") as f:
                json.dump({"env": env, "rows": rows}, f, indent=1)
        del args, want
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
