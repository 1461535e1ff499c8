"""Where the fused latent decode attention spends its time: stage differences, then Nsight Compute on the key pass.

Without hardware counters, time variants that leave one stage out and take differences (device/H200.md); with
them (``--ncu``: run this script under ``ncu``), profile one key-pass launch. Shape: one Qwen1.5-MoE-shaped layer
(16 query heads, 16 KV heads, head_dim 128; latents of a group of 2 layers), int4/32 rank 256 unless told.

    python3 benchmarks/latent_attention_stages_gpu.py --out DIR [--batch 8] [--context 32768]
    ncu --clock-control none -k regex:_latent_attention_split_kernel --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
        python3 benchmarks/latent_attention_stages_gpu.py --out DIR --ncu

Variants (ms by ``triton.testing.do_bench``, median): the whole call with the default config; the key pass alone
(``latent_scores_triton``); the key pass without RoPE (rope_form 'none'), with bf16 latents ('float') instead of
int4, with one bf16 rebuild dot (key_split=False); the whole call with the generic (run-5) config.
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

from ckvp_compile.kernels.latent_attention_triton import (  # noqa: E402
    DecodeConfig,
    default_config,
    latent_attention_triton,
    latent_scores_triton,
)


def scores_args(args: tuple) -> tuple:
    """latent_scores_triton's arguments from a latent_attention_triton argument tuple (make_inputs layout)."""
    (q, lk, _lv, bk, _bv, ko, _vo, cos, sin, pos, rope, rd, _nk, _nv, slots, mask, scale, kv_len, kf, _vf) = args
    return (q, lk, bk, ko, cos, sin, pos, rope, rd, slots, mask, scale, kv_len, kf)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--format", default="int4/32:256")
    ap.add_argument("--heads", default="16:16")
    ap.add_argument("--ncu", action="store_true", help="only the two calls ncu profiles (no timing)")
    ap.add_argument("--whole-only", action="store_true", help="only the whole-call variants (and dense SDPA)")
    ap.add_argument("--value-sweep", action="store_true", help="with --whole-only: value-pass configs instead")
    ap.add_argument("--fp8-bases", action="store_true", help="bases in float8_e4m3fn")
    ap.add_argument("--paired", action="store_true",
                    help="the default config for RoPE tables declared paired (as HF models' are in a compiled model)")
    a = ap.parse_args()
    lag.H, lag.HKV = (int(x) for x in a.heads.split(":"))
    fmt, rank = a.format.rsplit(":", 1)
    rank = int(rank)
    args = lag.make_inputs(a.batch, a.context, fmt, rank, seed=3)
    if a.fp8_bases:  # the store's basis_dtype=float8_e4m3fn (key_codes then multiplies e4m3 operands)
        args = args[:3] + (args[3].to(torch.float8_e4m3fn), args[4].to(torch.float8_e4m3fn)) + args[5:]
    cfg = default_config(lag.H // lag.HKV, max(16, 1 << (rank - 1).bit_length()), paired=a.paired)
    if a.ncu:  # first call compiles and runs (2 launches), the second is the one ncu skips to
        latent_attention_triton(*args, config=cfg)
        latent_attention_triton(*args, config=cfg)
        torch.cuda.synchronize()
        return
    os.makedirs(a.out, exist_ok=True)
    rows = []

    want = lag.ref_chunked(args, 2)

    def time_it(name: str, fn, check: bool = False) -> None:
        try:
            out = fn()
            err = lag.rel_err(out, want) if check else None
            ms = lag.bench(fn, warmup=5, rep=30)
            rows.append({"variant": name, "ms": round(ms, 4), "rel_err": err, **lag.kernel_stats()})
        except Exception as e:  # noqa: BLE001 - a variant that fails is reported, the others still run
            rows.append({"variant": name, "error": repr(e)[:300]})
        print(json.dumps(rows[-1]), flush=True)

    sa = scores_args(args)
    no_rope = list(sa)
    no_rope[7] = "none"
    float_args = lag.make_inputs(a.batch, a.context, "float", rank, seed=3)
    whole = {"default config": cfg, "generic config": DecodeConfig(),
             "fma_values=False": dataclasses.replace(cfg, fma_values=False),
             "key_fp16": dataclasses.replace(cfg, key_fp16=True),
             "key_fp16, paired_tables": dataclasses.replace(cfg, key_fp16=True, paired_tables=True),
             "key_fp16, paired_tables, block_n 128, 8 warps": dataclasses.replace(
                 cfg, key_fp16=True, paired_tables=True, block_n=128, num_warps=8),
             "key_fp16, paired_tables, no hoist": dataclasses.replace(
                 cfg, key_fp16=True, paired_tables=True, hoist_basis=False),
             "key_codes (generic)": dataclasses.replace(DecodeConfig(), key_codes=True),
             "key_codes, fma_scores": dataclasses.replace(DecodeConfig(), key_codes=True, fma_scores=True),
             "key_codes, fma_scores, fma_values": dataclasses.replace(DecodeConfig(), key_codes=True, fma_scores=True,
                                                                      fma_values=True),
             "fma_values (G=1 default + fma_values)": dataclasses.replace(cfg, fma_values=True),
             "key_fp16, paired_tables, fma_values": dataclasses.replace(cfg, key_fp16=True, paired_tables=True,
                                                                         fma_values=True),
             "paired_tables": dataclasses.replace(cfg, paired_tables=True),
             "one pass (two_pass=False)": dataclasses.replace(cfg, two_pass=False),
             "one pass, block_n 32": dataclasses.replace(cfg, two_pass=False, block_n=32)}
    if a.value_sweep:  # the value pass's tile, warps and split count (the key pass is the same in all of them)
        r = dataclasses.replace
        whole = {"default config": cfg,
                 "block_n_v 16, 2 warps": r(cfg, block_n_v=16, num_warps_v=2),
                 "block_n_v 64, 4 warps": r(cfg, block_n_v=64, num_warps_v=4),
                 "block_n_v 64, 8 warps": r(cfg, block_n_v=64, num_warps_v=8),
                 "block_n_v 128, 8 warps": r(cfg, block_n_v=128, num_warps_v=8),
                 "block_n_v 64, 4 warps, fma_values": r(cfg, block_n_v=64, num_warps_v=4, fma_values=True),
                 "target_programs 528": r(cfg, target_programs=528),
                 "target_programs 528, block_n_v 64": r(cfg, target_programs=528, block_n_v=64)}
    for name, c in whole.items():
        time_it("whole call, " + name, lambda c=c: latent_attention_triton(*args, config=c), check=True)
    if a.whole_only:
        rows.append({"variant": "dense SDPA (compiled)", "ms": round(lag.bench(dense_fn(args)), 4)})
        print(json.dumps(rows[-1]), flush=True)
        dump(a, cfg, rows)
        return
    time_it("key pass", lambda: latent_scores_triton(*sa, config=cfg))
    time_it("key pass, no RoPE", lambda: latent_scores_triton(*no_rope, config=cfg))
    time_it("key pass, bf16 latent", lambda: latent_scores_triton(*scores_args(float_args), config=cfg))
    time_it("key pass, key_split=False",
            lambda: latent_scores_triton(*sa, config=dataclasses.replace(cfg, key_split=False)))
    time_it("key pass, block_n 128 8 warps",
            lambda: latent_scores_triton(*sa, config=dataclasses.replace(cfg, block_n=128, num_warps=8)))
    rows.append({"variant": "dense SDPA (compiled)", "ms": round(lag.bench(dense_fn(args)), 4)})
    print(json.dumps(rows[-1]), flush=True)
    dump(a, cfg, rows)


def dense_fn(args: tuple):
    """Dense bf16 decode attention over the same context (SDPA with GQA, torch.compile), as the main script."""
    q, kv_len = args[0], args[17]
    b, hkv, d = q.shape[0], lag.HKV, q.shape[-1]
    k = torch.randn(b, hkv, kv_len, d, device=q.device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    f = torch.compile(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    return lambda: f(q, k, v)


def dump(a, cfg, rows: list) -> None:
    import triton

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "batch": a.batch, "context": a.context, "format": a.format, "heads": a.heads,
           "default_config": dataclasses.asdict(cfg), "command": "python3 " + " ".join(sys.argv)}
    with open(os.path.join(a.out, f"stages_{a.heads.replace(':', '-')}.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
