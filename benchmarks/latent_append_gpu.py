"""GPU check and timing of the fused latent append (``latent_quant_triton.latent_append_triton``) at real shapes.

    python3 benchmarks/latent_append_gpu.py --out DIR

``ckvp::latent_append`` on CUDA runs, unfused: fp32 copies of the new keys and of the basis, an einsum, a column
gather, the Triton quantizer and a row scatter. That is about 6 kernels per call, two calls per layer.
On the H200 at batch 1, 4k these took about 0.65 ms of a 4.7 ms Qwen1.5-MoE decode step
(benchmarks/results/2026-11-30-small-rank-h200, run 8 profile). ``latent_append_triton`` does the same in one
launch per bit width.

For each case it writes the rows twice: with the unfused path (``latent_append_cuda`` with
``APPEND_GPU_CHECKED`` off) and with the fused kernel. Cases:
- batch 1 and 8, one new token;
- a 512-token prefill chunk at batch 1;
- 16 KV heads of uneven ranks 60-110;
- ``G*D`` of 128 (one layer per latent) and 512 (four);
- int4/32, int8/32 and a mix plan.

It reports:
- the fraction of coordinates that decode bit-equal to the unfused path's;
- the largest difference in code steps;
- whether the other rows stayed untouched;
- both paths' time per call (``triton.testing.do_bench`` median, ms).

Writes ``DIR/latent_append.json`` with the GPU, torch and Triton versions and this command. A case passes when
all of these hold:
- at least 99% of coordinates are bit-equal (the two paths sum the G*D-long projection in different fp32
  orders, so a block's scale or a code at a rounding tie may move: at G*D = 512 about 0.2% of coordinates do);
- no coordinate is more than one step apart;
- the fused path's RMS error against the fp64 projection is no larger than the unfused path's (x 1.001);
- nothing else was written.

Flip ``APPEND_GPU_CHECKED`` only after every case passes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def _plan(ranks: list[int]) -> str:
    return "mix/32:" + ",".join(f"8x{r // 4}+4x{r - r // 4}" for r in ranks)


def main() -> None:
    import triton

    from ckvp_compile.kernels import latent_quant_triton as lq
    from ckvp_compile.kernels import reference as ref
    from ckvp_compile.kernels.latent_format import parse_latent_format
    from ckvp_compile.ops import register_all
    from ckvp_compile.ops.latent_attention_cuda import latent_append_cuda

    register_all()
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    hkv, s_max = 16, 4096
    ranks = [int(r) for r in torch.randint(60, 111, (hkv,), generator=torch.Generator().manual_seed(1))]
    off = [0]
    for r in ranks:
        off.append(off[-1] + r)
    rows = []
    for b, s, gd in ((1, 1, 128), (8, 1, 128), (1, 512, 128), (8, 1, 512)):
        basis = torch.linalg.qr(torch.randn(hkv, gd, max(ranks), device=dev, generator=g)).Q
        for h, r in enumerate(ranks):
            basis[h, :, r:] = 0.0
        basis = basis.to(torch.bfloat16)
        x = torch.randn(b, hkv, s, gd, device=dev, generator=g).to(torch.bfloat16)
        slots = torch.randperm(s_max, device=dev, generator=g)[:s]
        for fmt in ("int4/32", "int8/32", _plan(ranks)):
            f = parse_latent_format(fmt)
            width = f.row_width(off)
            row = {"batch": b, "tokens": s, "gd": gd, "format": fmt if not f.mixed else "mix/32 (8x r/4 + 4x rest)"}
            try:
                lq.APPEND_GPU_CHECKED = False
                want = torch.full((b, s_max, width), 7, dtype=torch.uint8, device=dev)
                latent_append_cuda(want, x, basis, off, slots, fmt)
                got = torch.full_like(want, 7)
                lq.latent_append_triton(got, x, basis, off, slots, fmt)
                torch.cuda.synchronize()
                other = torch.ones(s_max, dtype=torch.bool, device=dev)
                other[slots] = False
                row["others_untouched"] = bool(torch.equal(got[:, other], want[:, other]))
                dw = ref.unpack_latent_ref(want[:, slots], off, max(ranks), fmt)
                dg = ref.unpack_latent_ref(got[:, slots], off, max(ranks), fmt)
                eq = (dg == dw).float().mean().item()
                # a code step is a block's range / levels: bounded above by each head's whole range / levels (mix
                # plans: the 4-bit pieces' levels, the coarser)
                levels = 255 if fmt.startswith("int8") else 15
                step = (dw.amax(-1, keepdim=True) - dw.amin(-1, keepdim=True)) / levels
                row["bit_equal_fraction"] = eq
                row["max_diff_steps"] = float(((dg - dw).abs() / step.clamp_min(1e-12)).amax())
                # quantization error of each path against the fp64 projection (B, Hkv, s, R): where the two paths
                # differ (fp32 summation order of the G*D-long projection moves a block's scale or a near-tie code),
                # the fused one must be no less accurate
                y64 = torch.einsum("bhsg,hgr->bhsr", x.double(), basis.double())
                err_w = (dw.double() - y64).pow(2).mean().sqrt().item()
                err_g = (dg.double() - y64).pow(2).mean().sqrt().item()
                row["rms_err_unfused"], row["rms_err_fused"] = err_w, err_g
                row["unfused_ms"] = triton.testing.do_bench(
                    lambda: latent_append_cuda(want, x, basis, off, slots, fmt), warmup=10, rep=50)
                row["fused_ms"] = triton.testing.do_bench(
                    lambda: lq.latent_append_triton(got, x, basis, off, slots, fmt), warmup=10, rep=50)
                row["pass"] = (row["others_untouched"] and eq >= 0.99 and row["max_diff_steps"] <= 1.0 + 1e-6
                               and err_g <= err_w * 1.001 + 1e-9)
            except Exception as e:  # noqa: BLE001 - reported; the other cases still run
                row["error"] = repr(e)[:400]
                row["pass"] = False
            rows.append(row)
            print(json.dumps(row), flush=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "ranks": ranks, "command": "python3 " + " ".join(sys.argv)}
    with open(os.path.join(a.out, "latent_append.json"), "w") as fh:
        json.dump({"env": env, "rows": rows, "all_pass": all(r["pass"] for r in rows)}, fh, indent=1)
    print("all pass:", all(r["pass"] for r in rows))


if __name__ == "__main__":
    main()
