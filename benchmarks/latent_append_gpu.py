"""GPU check and timing of the fused latent append (``latent_quant_triton.latent_append_triton``) at real shapes.

    python3 benchmarks/latent_append_gpu.py --out DIR

``ckvp::latent_append`` on CUDA runs, unfused: fp32 copies of the new keys and of the basis, an einsum, a column
gather, the Triton quantizer and a row scatter. That is about 6 kernels per call, two calls per layer.
On the H200 at batch 1, 4k these took about 0.65 ms of a 4.7 ms Qwen1.5-MoE decode step
(benchmarks/results/2026-11-30-small-rank-h200, run 8 profile). ``latent_append_triton`` does the same in one
launch per bit width.

For each case it writes the rows with the reference's math (``latent_append_ref``, what the unfused CUDA path
computes) and with the fused kernel. Cases (``CASES``): decode at batch 1 and 8, prefill chunks, G*D of 128 and 512,
fp16 / fp32 keys, and the input kinds behind their own flags: paged pools, per-sequence (online) bases, fp8 bases;
int4/32, int8/32 and a mix plan each. 16 KV heads of ranks 60-110.

It reports, over each head's real coordinates (not the padding past its rank):
- the fraction that decode bit-equal;
- the largest difference in code steps of the coordinate's own block (8-bit pieces of the mix plan: 255 levels);
- whether the other rows stayed untouched;
- both paths' RMS error against an fp64 projection;
- the fused kernel's time per call (and the unfused path's for the shared-basis cases).

Writes ``DIR/latent_append.json`` (rows, and for each flag whether all its cases passed) with the GPU, torch and
Triton versions and this command. A case passes when all of these hold:
- at least 99% of real coordinates are bit-equal (the two paths sum the G*D-long projection in different fp32
  orders, so a block's scale or a code at a rounding tie may move);
- no coordinate is more than one step of its block apart;
- the fused path's RMS error against the fp64 projection is within 1% of the reference math's;
- nothing else was written.

Flip a flag (``APPEND_GPU_CHECKED``, ``APPEND_PAGED_GPU_CHECKED``, ``APPEND_ONLINE_GPU_CHECKED``,
``APPEND_FP8_GPU_CHECKED``, ``APPEND_STRIDED_GPU_CHECKED``: the unit-major cases write into a unit-major latent,
``kernels.latent_layout``) only after all its cases pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def _plan(ranks: list[int]) -> str:
    return "mix/32:" + ",".join(f"8x{r // 4}+4x{r - r // 4}" for r in ranks)


#: (label, batch, new tokens, G*D, x dtype, basis kind, page size, the flag the case checks)
CASES = (
    ("decode", 1, 1, 128, torch.bfloat16, "shared", 0, "APPEND_GPU_CHECKED"),
    ("decode", 8, 1, 128, torch.bfloat16, "shared", 0, "APPEND_GPU_CHECKED"),
    ("prefill chunk", 1, 512, 128, torch.bfloat16, "shared", 0, "APPEND_GPU_CHECKED"),
    ("prefill chunks, batch 4", 4, 64, 128, torch.bfloat16, "shared", 0, "APPEND_GPU_CHECKED"),
    ("four layers per latent", 8, 1, 512, torch.bfloat16, "shared", 0, "APPEND_GPU_CHECKED"),
    ("fp16 keys", 8, 1, 128, torch.float16, "shared", 0, "APPEND_GPU_CHECKED"),
    ("fp32 keys, fp32 basis", 8, 1, 128, torch.float32, "fp32", 0, "APPEND_GPU_CHECKED"),
    ("paged pool", 8, 1, 128, torch.bfloat16, "shared", 16, "APPEND_PAGED_GPU_CHECKED"),
    ("paged pool, prefill chunks", 2, 48, 128, torch.bfloat16, "shared", 16, "APPEND_PAGED_GPU_CHECKED"),
    ("online bases", 8, 1, 128, torch.bfloat16, "online", 0, "APPEND_ONLINE_GPU_CHECKED"),
    ("online bases, paged", 4, 8, 128, torch.bfloat16, "online", 16, "APPEND_ONLINE_GPU_CHECKED"),
    ("fp8 e4m3 bases", 8, 1, 128, torch.bfloat16, "e4m3", 0, "APPEND_FP8_GPU_CHECKED"),
    ("fp8 e5m2 bases", 8, 1, 128, torch.bfloat16, "e5m2", 0, "APPEND_FP8_GPU_CHECKED"),
    ("unit-major latent", 8, 1, 128, torch.bfloat16, "shared", 0, "APPEND_STRIDED_GPU_CHECKED"),
    ("unit-major latent, prefill chunk", 1, 512, 128, torch.bfloat16, "shared", 0, "APPEND_STRIDED_GPU_CHECKED"),
    ("unit-major paged pool", 8, 1, 128, torch.bfloat16, "shared", 16, "APPEND_STRIDED_GPU_CHECKED"),
)


def main() -> None:
    import triton

    from ckvp_compile.kernels import latent_quant_triton as lq
    from ckvp_compile.kernels import reference as ref
    from ckvp_compile.kernels.latent_format import parse_latent_format
    from ckvp_compile.kernels.latent_layout import to_layout
    from ckvp_compile.ops import register_all
    from ckvp_compile.ops.latent_attention_cuda import latent_append_cuda

    register_all()
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true",
                    help="tiny shapes on the CPU (run with TRITON_INTERPRET=1): checks this script, not the GPU")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cpu" if a.small else "cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    hkv, s_max = (3, 64) if a.small else (16, 4096)
    lo, hi = (5, 40) if a.small else (60, 111)
    ranks = [int(r) for r in torch.randint(lo, hi, (hkv,), generator=torch.Generator().manual_seed(1))]
    cases = [(lb, b, min(s, 8), min(gd, 64), xdt, bk, min(pg, 8)) + (fl,) for lb, b, s, gd, xdt, bk, pg, fl in CASES] \
        if a.small else CASES
    off = [0]
    for r in ranks:
        off.append(off[-1] + r)
    r_max = max(ranks)
    below_rank = torch.zeros(hkv, r_max, dtype=torch.bool, device=dev)  # the real coordinates, not the padding
    for h, r in enumerate(ranks):
        below_rank[h, :r] = True
    rows = []
    for label, b, s, gd, xdt, bkind, page, flag in cases:
        lead = (b,) if bkind == "online" else ()
        basis = torch.linalg.qr(torch.randn(*lead, hkv, gd, r_max, device=dev, generator=g)).Q
        for h, r in enumerate(ranks):
            basis[..., h, :, r:] = 0.0
        bdt = {"shared": torch.bfloat16, "online": torch.bfloat16, "fp32": torch.float32,
               "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[bkind]
        basis = basis.to(bdt)
        x = torch.randn(b, hkv, s, gd, device=dev, generator=g).to(xdt)
        slots = torch.randperm(s_max, device=dev, generator=g)[:s]
        table = None
        if page:
            n_pages = b * s_max // page
            table = torch.randperm(n_pages, device=dev, generator=g).int().reshape(b, -1)
        for fmt in ("int4/32", "int8/32", _plan(ranks)):
            f = parse_latent_format(fmt)
            width = f.row_width(off)
            row = {"case": label, "batch": b, "tokens": s, "gd": gd, "x": str(xdt), "basis": str(bdt),
                   "page": page, "flag": flag, "format": fmt if not f.mixed else "mix/32 (8x r/4 + 4x rest)"}
            try:
                shape = (b * s_max // page + 1, page, width) if page else (b, s_max, width)
                want = torch.full(shape, 7, dtype=torch.uint8, device=dev)
                ref.latent_append_ref(want, x, basis, off, slots, fmt, table)  # the unfused path's math
                got = torch.full_like(want, 7)
                if flag == "APPEND_STRIDED_GPU_CHECKED":  # the same values, stored unit-major
                    got = to_layout(got, "unit-major")
                lq.latent_append_triton(got, x, basis, off, slots, fmt, table)
                if not a.small:
                    torch.cuda.synchronize()
                flat = lambda t: t.reshape(-1, width)  # noqa: E731
                written = (flat(want) != 7).any(-1)
                row["others_untouched"] = bool(torch.equal(flat(got)[~written], flat(want)[~written]))
                dw = ref.unpack_latent_ref(flat(want)[written][None], off, r_max, fmt)[0]  # (Hkv, n, R)
                dg = ref.unpack_latent_ref(flat(got)[written][None], off, r_max, fmt)[0]
                real = below_rank[:, None, :].expand_as(dw)
                eq = (dg == dw)[real].float().mean().item()
                # a code step of each coordinate's own block: the block's decoded range over its real coordinates /
                # its levels; mix plans: of its piece (8-bit: the first r // 4 coordinates of each head)
                row["max_diff_steps"] = float(((dg - dw).abs() / _steps(dw, real, ranks, f, fmt))[real].amax())
                row["bit_equal_fraction"] = eq
                # accuracy of each path against the fp64 projection, over the real coordinates
                bb = basis.double() if basis.dim() == 4 else basis.double()[None].expand(b, *basis.shape)
                y64 = torch.einsum("bhsg,bhgr->bhsr", x.double(), bb)  # (B, Hkv, s, R)
                y64 = y64.permute(1, 0, 2, 3).reshape(hkv, b * s, r_max)
                order = _written_order(want, table, slots, b, s, page, width)
                y64 = y64[:, order]
                err_w = (dw.double() - y64)[real].pow(2).mean().sqrt().item()
                err_g = (dg.double() - y64)[real].pow(2).mean().sqrt().item()
                row["rms_err_unfused"], row["rms_err_fused"] = err_w, err_g
                if not a.small:
                    row["fused_ms"] = triton.testing.do_bench(
                        lambda: lq.latent_append_triton(got, x, basis, off, slots, fmt, table), warmup=10, rep=50)
                if flag == "APPEND_GPU_CHECKED" and not page and bkind != "online" and not a.small:
                    lq_saved = lq.APPEND_GPU_CHECKED
                    lq.APPEND_GPU_CHECKED = False
                    row["unfused_ms"] = triton.testing.do_bench(
                        lambda: latent_append_cuda(want, x, basis, off, slots, fmt), warmup=10, rep=50)
                    lq.APPEND_GPU_CHECKED = lq_saved
                row["pass"] = (row["others_untouched"] and eq >= 0.99 and row["max_diff_steps"] <= 1.0 + 1e-3
                               and err_g <= err_w * 1.01 + 1e-9)
            except Exception as e:  # noqa: BLE001 - reported; the other cases still run
                row["error"] = repr(e)[:400]
                row["pass"] = False
            rows.append(row)
            print(json.dumps(row), flush=True)
    flags = sorted({r["flag"] for r in rows})
    verdict = {fl: all(r["pass"] for r in rows if r["flag"] == fl) for fl in flags}
    env = {"gpu": torch.cuda.get_device_name() if not a.small else "cpu (TRITON_INTERPRET=1)", "torch": torch.__version__, "triton": triton.__version__,
           "ranks": ranks, "command": "python3 " + " ".join(sys.argv)}
    with open(os.path.join(a.out, "latent_append.json"), "w") as fh:
        json.dump({"env": env, "rows": rows, "flags_passed": verdict, "all_pass": all(verdict.values())}, fh,
                  indent=1)
    for fl, ok in verdict.items():
        print(f"{fl}: {'all cases pass' if ok else 'FAILED'}")
    print("all pass:", all(verdict.values()))


def _steps(dw: torch.Tensor, real: torch.Tensor, ranks: list, f, fmt: str) -> torch.Tensor:
    """(Hkv, n, R) code step of each coordinate: its quantization block's decoded range (over real coordinates) /
    levels; for a mix plan the range of its piece (8-bit: coordinates [0, r // 4) of head h; 4-bit: the rest)."""
    hkv, n, r_max = dw.shape
    big, small = torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max
    if f.mixed:
        step = torch.empty_like(dw)
        for h, r in enumerate(ranks):
            for lo_, hi_, levels in ((0, r // 4, 255), (r // 4, r, 15)):
                if hi_ > lo_:
                    piece = dw[h, :, lo_:hi_]
                    step[h, :, lo_:hi_] = (piece.amax(-1, keepdim=True) - piece.amin(-1, keepdim=True)) / levels
        return step.clamp_min(1e-12)
    levels = 255 if fmt.startswith("int8") else 15
    blk = f.block
    r_pad = -(-r_max // blk) * blk
    pad = torch.nn.functional.pad
    hi = pad(torch.where(real, dw, small), (0, r_pad - r_max), value=small).reshape(hkv, n, r_pad // blk, blk)
    lo = pad(torch.where(real, dw, big), (0, r_pad - r_max), value=big).reshape(hkv, n, r_pad // blk, blk)
    rng = (hi.amax(-1, keepdim=True) - lo.amin(-1, keepdim=True)).clamp_min(0).expand(-1, -1, -1, blk)
    return (rng.reshape(hkv, n, r_pad)[..., :r_max] / levels).clamp_min(1e-12)


def _written_order(want: torch.Tensor, table, slots: torch.Tensor, b: int, s: int, page: int,
                   width: int) -> torch.Tensor:
    """For each written row of ``want`` (in storage order, as ``(want != 7).any(-1)`` selects them), the index
    ``b_i * s + s_i`` of the (sequence, token) whose row it is."""
    flat_index = []
    for bi in range(b):
        for si, slot in enumerate(slots.tolist()):
            if page:
                row = int(table[bi, slot // page]) * page + slot % page
            else:
                row = bi * want.shape[1] + slot
            flat_index.append((row, bi * s + si))
    flat_index.sort()
    return torch.tensor([i for _, i in flat_index], device=want.device)


if __name__ == "__main__":
    main()
