"""Registers, spills and shared memory of the fused latent decode attention kernels, compiled for sm_90a on any machine.

No GPU needed: Triton compiles ahead of time for a target (``triton.compile(..., target=GPUTarget("cuda", 90, 32))``)
and its bundled ``ptxas -v`` reports each kernel's registers per thread, spill stores / loads and shared memory.
The launcher (``kernels.latent_attention_triton._launch``) runs as usual on CPU tensors of the real shapes, with
every kernel launch replaced by a compile-only warm-up against a stand-in CUDA driver
(``ckvp_compile.testing.sm90``, which the tests use to compile the kernels too). Use it to iterate on register
pressure between GPU sessions (H200 run 8: 255 registers and spills at 2 programs per SM made the kernel
latency-bound). The local Triton may differ from the GPU machine's (3.9 here, 3.6 there): compare variants, not
absolute numbers, or run it under the GPU's Triton: in a separate virtual environment with ``torch==2.13.0`` and
``pip install --no-deps triton==3.6.0``, the grouped key pass at 16:16 heads, int4/32 rank 16, batch 8, 32k compiles
to what the H200 ran (255 registers, 152 spilled bytes, 110848 bytes of shared memory against Nsight Compute's 255
registers and 110.85 KB; benchmarks/results/2026-12-01-grid-ncu-h200); Triton 3.9 gives the same registers and
shared memory but spills 4 bytes. Batch and context matter more: the launcher picks the grouped key pass only where
its programs fill the grid (at the old defaults of batch 2, 1024 slots it compiled the per-head pass instead, 92
registers).

    python3 benchmarks/latent_attention_aot.py [--heads 16:16] [--format int4/32:256] [--configs "default;generic"]
        [--batch 8] [--context 32768] [--paired]
        [--keep DIR]   # also write each kernel's TTGIR and PTX there
        [--sass N]     # also print each kernel's N most frequent static SASS opcodes (cuobjdump)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def compile_call(args: tuple, cfg, keep: str | None = None, label: str = "", page_table=None) -> list[dict]:
    """Compile (never run) every kernel one ``latent_attention_triton(*args, config=cfg, page_table=...)`` call
    launches (:func:`ckvp_compile.testing.sm90.compile_latent_attention`) and read each one's ptxas statistics."""
    from ckvp_compile.testing.sm90 import compile_latent_attention, ptxas_stats

    rows = []
    for i, k in enumerate(compile_latent_attention(args, cfg, page_table=page_table)):
        st = ptxas_stats(k.compiled.asm["ptx"])
        st.update(kernel=k.name, grid=list(k.grid), shared_bytes=k.compiled.metadata.shared,
                  num_warps=k.compiled.metadata.num_warps, num_stages=k.compiled.metadata.num_stages)
        if keep:
            os.makedirs(keep, exist_ok=True)
            for ext in ("ttgir", "ptx"):
                with open(os.path.join(keep, f"{label}_{i}_{k.name.replace(' ', '_')}.{ext}"), "w") as f:
                    f.write(k.compiled.asm[ext])
        rows.append(st)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="16:16")
    ap.add_argument("--format", default="int4/32:256")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768,
                    help="slots; with --batch they decide which kernels run (the grouped key pass only where its "
                         "programs fill the grid), not the code of a kernel")
    ap.add_argument("--paired", action="store_true",
                    help="'default' as a compiled HF model gets it: RoPE tables declared paired (rotated and grouped "
                         "key passes at G = 1)")
    ap.add_argument("--configs", default="default;generic",
                    help='names separated by ;, each optionally NAME+{JSON DecodeConfig fields}, e.g. default+{"block_n": 32}')
    ap.add_argument("--keep", default=None, help="write each kernel's TTGIR and PTX here")
    ap.add_argument("--fp8-bases", action="store_true", help="bases in float8_e4m3fn (as the store's basis_dtype)")
    ap.add_argument("--page", type=int, default=0, help="paged latents: pools of pages of this many slots and a "
                    "page table (0: contiguous)")
    ap.add_argument("--sass", type=int, default=0, help="also print the N most frequent static SASS opcodes")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import latent_attention_gpu as lag

    from ckvp_compile.kernels.latent_attention_triton import DecodeConfig, default_config
    from ckvp_compile.kernels.latent_format import parse_latent_format

    lag.H, lag.HKV = (int(x) for x in a.heads.split(":"))
    fmt, rank = a.format.rsplit(":", 1)
    args = lag.make_inputs(a.batch, a.context, fmt, int(rank), seed=0, dev="cpu")
    if a.fp8_bases:
        args = args[:3] + (args[3].to(torch.float8_e4m3fn), args[4].to(torch.float8_e4m3fn)) + args[5:]
    table = None
    if a.page:  # the same rows as page pools (one spare page: the trash page) and an identity page table
        lk, lv = args[1], args[2]
        n_log = lk.shape[1] // a.page
        table = torch.arange(lk.shape[0] * n_log, dtype=torch.int32).view(lk.shape[0], n_log)

        def pool(t):
            rows = t[:, : n_log * a.page].reshape(-1, a.page, t.shape[2])
            return torch.cat((rows, rows[:1]))

        args = (args[0], pool(lk), pool(lv)) + args[3:]
    kf = parse_latent_format(fmt)
    default = default_config(lag.H // lag.HKV, max(16, 1 << (int(rank) - 1).bit_length()), paired=a.paired,
                             rank=int(rank), quantized_keys=kf.quantized and not kf.pow2)
    r = dataclasses.replace
    named = {"default": default, "generic": DecodeConfig(),
             "default, key_split=False": r(default, key_split=False),
             "default, key_fp16": r(default, key_fp16=True),
             "default, block_n_v 64": r(default, block_n_v=64),
             "default, block_n_v 16, 2 warps": r(default, block_n_v=16, num_warps_v=2),
             "default, fma_values": r(default, fma_values=True),
             "default, one pass": r(default, two_pass=False),
             "default, 1 stage": r(default, num_stages=1),
             "generic, 1 stage": r(DecodeConfig(), num_stages=1),
             "default, 3 stages": r(default, num_stages=3),
             "default, reduce_split_d": r(default, reduce_split_d=True),
             "default, fuse_merge": r(default, fuse_merge=True),
             "generic, fuse_merge": r(DecodeConfig(), fuse_merge=True),
             "key_codes": r(DecodeConfig(), key_codes=True),
             "key_codes, fma_scores": r(DecodeConfig(), key_codes=True, fma_scores=True),
             "key_codes, fma_scores, fma_values": r(DecodeConfig(), key_codes=True, fma_scores=True, fma_values=True),
             "r_loop": r(DecodeConfig(), r_loop=True),
             "r_loop, maxnreg 128": r(DecodeConfig(), r_loop=True, maxnreg=128),
             "r_loop, maxnreg 168": r(DecodeConfig(), r_loop=True, maxnreg=168),
             "key_codes, r_loop, maxnreg 128": r(DecodeConfig(), key_codes=True, r_loop=True, maxnreg=128),
             "key_codes, r_loop, maxnreg 168": r(DecodeConfig(), key_codes=True, r_loop=True, maxnreg=168),
             "key_codes, r_loop, block_r 32, 8 warps, maxnreg 128": r(DecodeConfig(), key_codes=True, r_loop=True,
                                                                        num_warps=8, maxnreg=128),
             "r_loop, fma_scores": r(DecodeConfig(), r_loop=True, fma_scores=True),
             "r_loop, 3 stages": r(DecodeConfig(), r_loop=True, num_stages=3),
             "r_loop, block_r 32": r(DecodeConfig(), r_loop=True, block_r=32),
             "r_loop, block_n 128, 8 warps": r(DecodeConfig(), r_loop=True, block_n=128, num_warps=8),
             "key_codes, r_loop": r(DecodeConfig(), key_codes=True, r_loop=True),
             "key_codes, r_loop, fma_scores": r(DecodeConfig(), key_codes=True, r_loop=True, fma_scores=True),
             "key_codes, r_loop, 3 stages": r(DecodeConfig(), key_codes=True, r_loop=True, num_stages=3),
             "key_codes, r_loop, block_n 128, 8 warps": r(DecodeConfig(), key_codes=True, r_loop=True, block_n=128,
                                                          num_warps=8)}
    out = []
    for name in a.configs.split(";"):
        base, plus, extra = name.partition("+")  # NAME+{"field": value, ...}: a named config with fields replaced
        cfg = r(named[base], **json.loads(extra)) if plus else named[name]
        for row in compile_call(args, cfg, a.keep, re.sub(r"\W+", "_", name), table):
            row["config"] = name
            out.append(row)
            print(f"{name:<32} {row['kernel']:<11} regs {row['registers']:>3}  spill st/ld "
                  f"{row['spill_store_bytes']}/{row['spill_load_bytes']} B  smem {row['shared_bytes']} B  "
                  f"warps {row['num_warps']} stages {row['num_stages']}  sass {row['sass_total']}", flush=True)
            if a.sass:
                print("    " + " ".join(f"{k}:{v}" for k, v in list(row["sass_ops"].items())[:a.sass]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"heads": a.heads, "format": a.format, "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
