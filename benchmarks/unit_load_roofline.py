"""How fast can the MMA unit pass's loads alone go? A load-only roofline of the 64-slot unit-major page pool.

Issue 5's acceptance 2 asks the decode attention for >= 70% of the copy bandwidth and a speedup over dense of at
least 0.8x the byte ratio. Dense decode reads at ~107% of the copy bandwidth on the H200 (a read-only stream), so
the latent pass must read at ~86% of it in its whole call. The 8-bit MMA pass reads at 61-81% (r1). This script asks
whether the access pattern itself allows more: it reads exactly the bytes the pass reads (per tile and head: 2 KB of
key codes, 2 KB of value codes, 256 B of key fields and 256 B of value fields, at the pass's addresses in a pool of
64-slot pages behind a shuffled page table) and only sums them, in plain Triton, with

* ``W`` programs of ``num_warps`` warps per SM (a persistent grid: ``W * SMs`` programs, each a contiguous run of
  the (sequence, head, tile) work items): the pass holds 12 one-warp programs an SM (166 registers);
* ``D`` tiles loaded per loop iteration, and the next iteration's tiles issued before the current ones are summed
  (``D = 1``: the pass's one tile ahead), so D to 2D tiles are in flight per program.

If the loads alone reach the bandwidth the acceptance needs at the pass's 12 warps and one tile ahead, the pass is
bound by its instructions; if they need more warps or more tiles in flight, by the bytes it keeps in flight.
Reports time (median of CUDA events), GB/s and share of the copy bandwidth (``ckvp-bench attention``'s
:func:`~ckvp_compile.bench.attention.copy_bandwidth`); the "contiguous read" rows are a naive one-block-per-program
sum of the key pool (its time doubled for both pools), a sanity check, not a roofline::

    PYTHONPATH=. python benchmarks/unit_load_roofline.py --json $OUT/roof.json --out $OUT/roof.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ckvp_compile.bench.attention import copy_bandwidth  # noqa: E402

TILE_WORDS = 512  # 2 KB of one head's codes (32 byte columns x 64 slots)
FIELD_WORDS = 64  # 256 B of one head's four fp16 fields (4 columns x 64 slots, stored as two 2-byte-wide runs)
HKV = 8


@triton.jit
def _roof_kernel(k_ptr, v_ptr, pt_ptr, out_ptr, n_tiles, work, per_prog, page_words, field_base,
                 HKV: tl.constexpr, D: tl.constexpr):
    """Sum the words of work items [p * per_prog, (p + 1) * per_prog) (item = (b * HKV + h) * n_tiles + t)."""
    p = tl.program_id(0)
    w0 = p * per_prog
    w1 = tl.minimum(w0 + per_prog, work)
    offs = tl.arange(0, 512)[None, :]
    foffs = tl.arange(0, 64)[None, :]
    acc = tl.zeros([D, 512], tl.int32)
    facc = tl.zeros([D, 64], tl.int32)
    ks, vs, fs, gs = _roof_group(k_ptr, v_ptr, pt_ptr, w0, w1, n_tiles, page_words, field_base, offs, foffs, HKV, D)
    for w in range(w0, w1, D):
        nks, nvs, nfs, ngs = _roof_group(k_ptr, v_ptr, pt_ptr, w + D, w1, n_tiles, page_words, field_base, offs,
                                         foffs, HKV, D)
        acc += ks ^ vs
        facc += fs ^ gs
        ks, vs, fs, gs = nks, nvs, nfs, ngs
    tl.store(out_ptr + p, tl.sum(tl.sum(acc, axis=1), axis=0) + tl.sum(tl.sum(facc, axis=1), axis=0))


@triton.jit
def _roof_group(k_ptr, v_ptr, pt_ptr, w, w1, n_tiles, page_words, field_base, offs, foffs, HKV: tl.constexpr,
                D: tl.constexpr):
    """Issue the loads of work items w .. w + D - 1 (those below w1): (D, 512) key and value code words, (D, 64)
    key and value field words."""
    it = w + tl.arange(0, D)
    ok = it < w1
    bh = it // n_tiles
    t = it % n_tiles
    h = bh % HKV
    b = bh // HKV
    page = tl.load(pt_ptr + b * n_tiles + t, mask=ok, other=0).to(tl.int64)
    base = (page * page_words)[:, None]
    m = ok[:, None]
    ks = tl.load(k_ptr + base + (h * 512)[:, None] + offs, mask=m, other=0)
    vs = tl.load(v_ptr + base + (h * 512)[:, None] + offs, mask=m, other=0)
    fs = tl.load(k_ptr + base + field_base + (h * 64)[:, None] + foffs, mask=m, other=0)
    gs = tl.load(v_ptr + base + field_base + (h * 64)[:, None] + foffs, mask=m, other=0)
    return ks, vs, fs, gs


@triton.jit
def _stream_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Sum words [p * BLOCK, (p + 1) * BLOCK) of ``x`` (n int32) into ``out[p]``."""
    p = tl.program_id(0)
    offs = p.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + p, tl.sum(x, axis=0))


def timed(fn, n: int = 30) -> float:
    """Median ms over ``n`` CUDA-event-timed calls after 3 warm-up calls."""
    for _ in range(3):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in ev)[n // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default="8x32768,8x131072,32x131072")
    ap.add_argument("--warps-per-sm", default="8,12,16,24,32")
    ap.add_argument("--depths", default="1,2,4")
    ap.add_argument("--num-warps", default="1,2")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    copy_bw = copy_bandwidth()
    rows = []
    t_start = time.time()
    for shape in args.shapes.split(","):
        B, T = (int(x) for x in shape.split("x"))
        n_tiles = T // 64
        n_pages = B * n_tiles
        page_words = HKV * (TILE_WORDS + FIELD_WORDS)  # codes of all heads, then their fields
        field_base = HKV * TILE_WORDS
        kpool = torch.randint(-2**31, 2**31 - 1, (n_pages, page_words), dtype=torch.int32, device=dev)
        vpool = torch.randint(-2**31, 2**31 - 1, (n_pages, page_words), dtype=torch.int32, device=dev)
        pt = torch.randperm(n_pages, device=dev, dtype=torch.int32).view(B, n_tiles).contiguous()
        nbytes = 2 * kpool.numel() * 4
        work = B * HKV * n_tiles
        # contiguous read of the same bytes (the read roofline)
        flat = kpool.view(-1)
        out = torch.empty(triton.cdiv(flat.numel(), 8192), dtype=torch.int32, device=dev)
        ms_stream = 2 * timed(lambda: _stream_kernel[(out.numel(),)](flat, out, flat.numel(), BLOCK=8192,
                                                                       num_warps=8))
        rows.append({"b": B, "t": T, "kind": "contiguous read", "ms": ms_stream, "gbs": nbytes / ms_stream / 1e6,
                     "copy_share": nbytes / ms_stream / 1e-3 / copy_bw})
        print(rows[-1], flush=True)
        for nw in (int(x) for x in args.num_warps.split(",")):
            for D in (int(x) for x in args.depths.split(",")):
                for W in (int(x) for x in args.warps_per_sm.split(",")):
                    progs = max(1, sms * W // nw)
                    per = triton.cdiv(work, progs)
                    progs = triton.cdiv(work, per)
                    res = torch.empty(progs, dtype=torch.int32, device=dev)
                    fn = lambda: _roof_kernel[(progs,)](kpool, vpool, pt, res, n_tiles, work, per, page_words,
                                                        field_base, HKV=HKV, D=D, num_warps=nw)
                    ms = timed(fn)
                    k = _roof_kernel.warmup(kpool, vpool, pt, res, n_tiles, work, per, page_words, field_base,
                                            HKV=HKV, D=D, num_warps=nw, grid=(progs,))
                    regs = getattr(k, "n_regs", None)
                    rows.append({"b": B, "t": T, "kind": "unit tiles", "num_warps": nw, "depth": D,
                                 "warps_per_sm": W, "programs": progs, "regs": regs, "ms": ms,
                                 "gbs": nbytes / ms / 1e6, "copy_share": nbytes / ms / 1e-3 / copy_bw})
                    print(rows[-1], flush=True)
        del kpool, vpool
        torch.cuda.empty_cache()
    env = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
           "copy_bandwidth_gbs": copy_bw / 1e9, "seconds": time.time() - t_start,
           "command": "python " + " ".join(sys.argv)}
    args.json.write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    lines = [f"# Load-only roofline of the unit-major 64-slot page pool ({env['gpu']})", "",
             f"    {env['command']}", "",
             f"torch {env['torch']}, triton {env['triton']}, copy bandwidth {copy_bw / 1e9:.0f} GB/s", "",
             "| batch | context | kind | num_warps | depth | warps/SM | programs | regs | ms | GB/s | % copy |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['b']} | {r['t']} | {r['kind']} | {r.get('num_warps', '')} | {r.get('depth', '')} | "
                     f"{r.get('warps_per_sm', '')} | {r.get('programs', '')} | {r.get('regs', '')} | {r['ms']:.4f} | "
                     f"{r['gbs']:.0f} | {100 * r['copy_share']:.1f}% |")
    args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
