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

from ckvp_compile.kernels import latent_attention_triton as lat  # noqa: E402
from ckvp_compile.kernels.latent_attention_triton import default_config, latent_attention_triton  # noqa: E402


def variants(rank_pad: int, full: bool, batch: int = 8) -> dict:
    """Configs of one case: the defaults with unpaired and paired tables (the tables are HF's paired layout, so
    both are exact), then key-pass program counts and stages over the paired default; ``full`` adds the rotated
    basis past :data:`MAX_ROTATED_RANK` (as a variant, by raising the limit for that call). At batch 1 instead:
    launches per call (one pass, the merge fused) and split counts, over the paired default."""
    r = dataclasses.replace
    base, paired = default_config(1, rank_pad), default_config(1, rank_pad, paired=True)
    if batch == 1:
        return {"default": base, "default, paired tables": paired,
                "paired, one pass": r(paired, two_pass=False),
                "paired, one pass, fused merge": r(paired, two_pass=False, fuse_merge=True),
                "paired, fused merge": r(paired, fuse_merge=True),
                "paired, value programs 528": r(paired, target_programs_v=528),
                "paired, min_tiles 2": r(paired, min_tiles=2),
                "paired, merge not split over D": r(paired, reduce_split_d=False)}
    v = {"default": base, "default, paired tables": paired,
         "paired, key programs 396": r(paired, target_programs=396),
         "paired, key programs 528": r(paired, target_programs=528),
         "paired, key_tiles 4": r(paired, key_tiles=4),
         "paired, 3 stages": r(paired, num_stages=3)}
    if full:
        v["paired, rotate_basis past the limit"] = r(paired, rotate_basis=True)
    return v


def occupancy_variants(rank_pad: int) -> dict:
    """``--set occupancy``: over the paired default, the knobs Nsight Compute points at
    (benchmarks/results/2026-11-30-small-rank-ncu-h200): the key pass is latency-bound at 137 registers and 12 warps
    per SM (register caps and stages; ptxas for sm_90a: a cap of 96 spills at rank 12, and 8 warps take 164
    registers); the value pass at small ranks is L1-bound on byte loads (its tile, warps and program count)."""
    r = dataclasses.replace
    paired = default_config(1, rank_pad, paired=True)
    return {"default, paired tables": paired,
            "key maxnreg 128 (4 programs per SM)": r(paired, maxnreg=128),
            "key 1 stage": r(paired, num_stages=1),
            "key 3 stages": r(paired, num_stages=3),
            "key programs 528, maxnreg 128": r(paired, target_programs=528, maxnreg=128),
            "value block_n_v 64": r(paired, block_n_v=64),
            "value block_n_v 16, 2 warps": r(paired, block_n_v=16, num_warps_v=2),
            "value 8 warps": r(paired, num_warps_v=8),
            "value programs 1056": r(paired, target_programs_v=1056),
            "value programs 4224": r(paired, target_programs_v=4224)}


def group_variants(rank_pad: int) -> dict:
    """``--set groups``: the key pass over groups of KV heads (``DecodeConfig.head_group``: one program reads the
    group's window of each row and loads each RoPE table tile once for the group) against one head per program,
    and the group sizes, tiles and program counts around the paired default."""
    r = dataclasses.replace
    paired = default_config(1, rank_pad, paired=True)
    return {"one head per program (head_group 0)": r(paired, head_group=0, target_programs=396),
            "default, paired tables": paired,
            "key 8 heads": r(paired, head_group=8),
            "key 16 heads (whole rows up to 128 columns)": r(paired, head_group=16),
            "key 2 heads": r(paired, head_group=2),
            "key programs 396": r(paired, target_programs=396),
            "key block_n 128, 8 warps": r(paired, block_n=128, num_warps=8)}


def fp16_variants(rank_pad: int) -> dict:
    """``--set fp16``: the rotated and grouped key passes with one fp16 product per RoPE table
    (``DecodeConfig.rotate_fp16``) against the hi / lo split's two, over the paired default."""
    paired = default_config(1, rank_pad, paired=True)
    return {"default, paired tables": paired, "paired, rotate_fp16": dataclasses.replace(paired, rotate_fp16=True)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", default="launch", choices=("launch", "occupancy", "default", "groups", "fp16"),
                    help="launch: the variants of run 2-7; occupancy: occupancy_variants; default: the paired default; "
                         "groups: group_variants; fp16: fp16_variants")
    ap.add_argument("--cases", default="8:32768:32,8:32768:64,8:32768:104:full,8:32768:12",
                    help="comma-separated batch:context:rank[:full]")
    a = ap.parse_args()
    lag.H, lag.HKV, lag.GROUP = 16, 16, 1
    os.makedirs(a.out, exist_ok=True)
    import triton

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "heads": "16:16", "head_dim": lag.D, "format": "int4/32", "command": "python3 " + " ".join(sys.argv)}
    rows = []
    saved_limit = lat.MAX_ROTATED_RANK
    for case in a.cases.split(","):
        b, t, rank, *full = case.split(":")
        b, t, rank = int(b), int(t), int(rank)
        args = lag.make_inputs(b, t, "int4/32", rank, seed=3)
        want = lag.ref_chunked(args, 2)
        rank_pad = max(16, 1 << (rank - 1).bit_length())
        vs = {"occupancy": lambda: occupancy_variants(rank_pad),
              "default": lambda: {"default, paired tables": default_config(1, rank_pad, paired=True)},
              "groups": lambda: group_variants(rank_pad), "fp16": lambda: fp16_variants(rank_pad),
              "launch": lambda: variants(rank_pad, bool(full), b)}[a.set]()
        for name, c in vs.items():
            row = {"batch": b, "context": t, "rank": rank, "variant": name}
            lat.MAX_ROTATED_RANK = 256 if "past the limit" in name else saved_limit
            try:
                out = latent_attention_triton(*args, config=c)
                row["rel_err"] = lag.rel_err(out, want)
                row["ms"] = round(lag.bench(lambda c=c: latent_attention_triton(*args, config=c), warmup=5, rep=30), 4)
                row.update(lag.kernel_stats())
                if a.set in ("groups", "fp16"):  # the key pass alone
                    ka = (args[0], args[1], args[3], args[5], args[7], args[8], args[9], args[10], args[11], args[14],
                          args[15], args[16], args[17], args[18])
                    row["key_ms"] = round(lag.bench(lambda c=c: lat.latent_scores_triton(*ka, config=c), warmup=5,
                                                    rep=30), 4)
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
