"""Paged latents on the H200: the fused decode kernel walking a page table against the same call on contiguous
latents (same rows, same kernel otherwise).

    python3 benchmarks/paged_attention_gpu.py --out DIR      # about 1-2 minutes

Per (heads, page size): Mixtral-shaped (32:8) and Qwen1.5-MoE-shaped (16:16) layers, head_dim 128, int4/32 latents
of rank 256, batch 8, context 32k; the contiguous (B, S_max, W) latents are cut into pages of P slots and scattered
over a pool in a random order (plus the trash page), and the page table points at them. Reports the paged output's
difference from the contiguous one (the same arithmetic in another memory order: expected 0) and from the fp32
reference over the contiguous latents (``ckvp_compile.bench.attention.ref_chunked``), and median ms of both
(triton.testing.do_bench, in the same run). Writes DIR/paged_attention_h200.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ckvp_compile.bench.attention import bench, make_inputs, ref_chunked, rel_err  # noqa: E402
from ckvp_compile.bench.output import run_env  # noqa: E402
from ckvp_compile.kernels.latent_attention_triton import latent_attention_triton  # noqa: E402


def paged(args: tuple, page: int, seed: int = 0) -> tuple[tuple, torch.Tensor]:
    """``args`` with latent_k / latent_v as page pools in a random page order, and the page table."""
    lk, lv = args[1], args[2]
    b, s_max = lk.shape[:2]
    n_log = s_max // page
    g = torch.Generator(device="cpu").manual_seed(seed)
    order = torch.randperm(b * n_log, generator=g).to(lk.device)
    table = order.view(b, n_log).to(torch.int32)

    def pool(t: torch.Tensor) -> torch.Tensor:
        rows = t[:, : n_log * page].reshape(b * n_log, page, t.shape[2])
        out = torch.empty(b * n_log + 1, page, t.shape[2], dtype=t.dtype, device=t.device)
        out[order] = rows
        out[-1] = 0
        return out

    return (args[0], pool(lk), pool(lv)) + tuple(args[3:]), table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--pages", default="16,64,256")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    rows = []
    for heads in ((32, 8), (16, 16)):
        args = make_inputs(a.batch, a.context, "int4/32", 256, seed=0, dev="cuda", heads=heads, head_dim=128,
                           group=4)
        want = ref_chunked(args, 1)
        base = latent_attention_triton(*args)
        ms_base = bench(lambda: latent_attention_triton(*args), warmup=10, rep=30)
        for page in (int(p) for p in a.pages.split(",")):
            row = {"heads": f"{heads[0]}:{heads[1]}", "batch": a.batch, "context": a.context, "page": page,
                   "contiguous_ms": ms_base, "contiguous_rel_err": rel_err(base, want)}
            try:
                pargs, table = paged(args, page)
                out = latent_attention_triton(*pargs, page_table=table)
                row.update(paged_vs_contiguous_max_abs=float((out.float() - base.float()).abs().max()),
                           paged_rel_err=rel_err(out, want),
                           paged_ms=bench(lambda: latent_attention_triton(*pargs, page_table=table), warmup=10,
                                          rep=30))
                row["paged_over_contiguous"] = row["paged_ms"] / ms_base
                del pargs, table
            except Exception as e:  # noqa: BLE001 - reported; the other rows still run
                row["error"] = repr(e)[:400]
            print(json.dumps(row), flush=True)
            rows.append(row)
        del args, want, base
        torch.cuda.empty_cache()
    env = run_env(t0)
    with open(os.path.join(a.out, "paged_attention_h200.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
