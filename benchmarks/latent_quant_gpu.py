"""GPU check of the Triton latent quantize / dequantize kernels (kernels/latent_quant_triton.py) at real shapes.

    python benchmarks/latent_quant_gpu.py --out benchmarks/results/<date>-latent-quant-h200 [--budget-s 50]

For every format family the kernels support (uniform int8/int4/int2 at blocks 32 and 64; ternary ``tern`` at
blocks 32 and 64; a ``mix`` bit plan at block 32, each head split 8-bit x r/4 + 4-bit x r/2 + 2-bit x the rest,
so every head has three pieces with ragged last blocks) and every shape (B=8 x 4096 slots; ranks 256 as Hkv=2
heads of 128, 8 heads of 32, and uneven heads 100+156), on random latents (Gaussian, and rotated Gaussian with
outliers), it checks:

* quantize: ``quantize_latent_triton(z) == quantize_latent_ref(z)`` byte for byte (the rows the store holds);
  ternary rows also have every code byte < 243 (five base-3 digits, codes in {-1, 0, 1});
* dequantize: ``dequantize_latent_triton(rows) == dequantize_latent_ref(rows)`` bit for bit (fp32), for the
  reference's rows and for random rows (random code bytes, random finite fp16 scales / mins);
* the largest round-trip error |dequantize(quantize(z)) - z| (reported; the half-step bound per block is a CPU property test).

Formats the kernels refuse (mxint) are listed with the refusal reason. Writes ``results.json`` and ``README.md``
(GPU name, torch / triton versions, the exact command, a table of every check) into ``--out``; exit status 1 when
any check fails or is skipped. A family joins ``latent_quant_triton.GPU_CHECKED`` (the CUDA
``ckvp::latent_append`` then quantizes it with these kernels) only after its rows here pass on the GPU. About
10 s on an H200 (the reference path and the first launches' compilation dominate); ``--budget-s`` stops early
with the rows not run marked.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

#: "mix/32" stands for the shape's plan (:func:`_mix_plan`)
FORMATS = ("int8/32", "int4/32", "int2/32", "int8/64", "int4/64", "int2/64", "tern/32", "tern/64", "mix/32")
REFUSED = ("mxint8/32", "mxint4/32")
SHAPES = (("B8 S4096 Hkv2x128", 8, 4096, (128, 128)), ("B8 S4096 Hkv8x32", 8, 4096, (32,) * 8),
          ("B8 S4096 100+156", 8, 4096, (100, 156)))


def _offsets(ranks):
    out = [0]
    for r in ranks:
        out.append(out[-1] + r)
    return out


def _mix_plan(ranks, block=32):
    """``mix/<block>:...`` with each head of rank r split 8-bit x r//4, 4-bit x r//2, 2-bit x the rest."""
    heads = []
    for r in ranks:
        segs = [(8, r // 4), (4, r // 2), (2, r - r // 4 - r // 2)]
        heads.append("+".join(f"{b}x{c}" for b, c in segs if c))
    return f"mix/{block}:" + ",".join(heads)


def _latents(b, s, r, kind, gen, device):
    z = torch.randn(b, s, r, generator=gen, device=device)
    if kind == "outliers":  # heavy tails and a per-coordinate scale spread, as unrotated PCA latents have
        z = z * torch.logspace(1, -2, r, device=device) + (torch.rand(b, s, r, generator=gen, device=device) < 1e-3) * 40
    return z


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for results.json and README.md")
    p.add_argument("--budget-s", type=float, default=50.0, help="stop starting new checks after this many seconds")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="B=1 x 4 slots (a CPU smoke run under TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    shapes = tuple((n + " (tiny: B1 S4)", 1, 4, r) for n, _, _, r in SHAPES) if args.tiny else SHAPES
    from ckvp_compile.kernels.latent_format import dequantize_latent_ref, parse_latent_format, quantize_latent_ref
    from ckvp_compile.kernels import latent_quant_triton as lq

    import triton

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    t0 = time.perf_counter()
    rows, ok = [], True
    for fmt in REFUSED:
        rows.append({"format": fmt, "shape": "-", "data": "-", "status": "refused",
                     "reason": lq.unsupported_reason(fmt, device)})
    for fmt_name in FORMATS:
        for name, b, s, ranks in shapes:
            fmt = _mix_plan(ranks, int(fmt_name.split("/")[1])) if fmt_name.startswith("mix") else fmt_name
            for kind in ("gaussian", "outliers"):
                row = {"format": fmt, "shape": name, "data": kind}
                if time.perf_counter() - t0 > args.budget_s:
                    row["status"] = "skipped (time budget)"
                    ok = False  # every row must run before a family counts as checked
                    rows.append(row)
                    continue
                reason = lq.unsupported_reason(fmt, device)
                if reason is not None:
                    row.update(status="refused", reason=reason)
                    ok = False  # a supported format must run
                    rows.append(row)
                    continue
                offs = _offsets(ranks)
                z = _latents(b, s, offs[-1], kind, gen, device)
                ref_rows = quantize_latent_ref(z, offs, fmt)
                tri_rows = lq.quantize_latent_triton(z, offs, fmt)
                q_diff = int((ref_rows != tri_rows).sum())
                f = parse_latent_format(fmt)
                # ternary: every code byte a valid five-digit base-3 number (codes in {-1, 0, 1}); "-" otherwise
                codes_ok = bool((tri_rows[..., :sum(f.code_bytes(offs))] < 243).all()) if f.ternary else None
                ref_z = dequantize_latent_ref(ref_rows, offs, fmt)
                tri_z = lq.dequantize_latent_triton(ref_rows, offs, fmt)
                dq_equal = bool(torch.equal(ref_z.view(torch.int32), tri_z.view(torch.int32)))
                err = (ref_z - z).abs().max().item()
                # decoding arbitrary rows: random code bytes (> 242 for ternary), random finite fp16 scales / mins
                rnd = torch.randint(0, 256, ref_rows.shape, generator=gen, device=device, dtype=torch.uint8)
                n_code = sum(f.code_bytes(offs))
                meta = (torch.randn(b, s, (ref_rows.shape[-1] - n_code) // 2, generator=gen, device=device) * 100)
                rnd[..., n_code:] = meta.to(torch.float16).view(torch.uint8)
                rnd_equal = bool(torch.equal(dequantize_latent_ref(rnd, offs, fmt).view(torch.int32),
                                             lq.dequantize_latent_triton(rnd, offs, fmt).view(torch.int32)))
                torch.cuda.synchronize(device) if device.type == "cuda" else None
                good = q_diff == 0 and dq_equal and rnd_equal and codes_ok is not False
                row.update(status="ok" if good else "FAIL", quantize_bytes_differing=q_diff,
                           dequantize_bit_equal=dq_equal, dequantize_random_rows_bit_equal=rnd_equal,
                           tern_code_bytes_valid=codes_ok, max_roundtrip_abs_err=err,
                           row_bytes=int(ref_rows.shape[-1]))
                ok &= row["status"] == "ok"
                rows.append(row)
                print(row, flush=True)
    elapsed = time.perf_counter() - t0
    cmd = "python " + " ".join([sys.argv[0]] + list(sys.argv[1:] if argv is None else argv))
    env = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
           "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "command": cmd, "seconds": round(elapsed, 1), "all_ok": ok}
    (out / "results.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
    lines = [f"# Latent quantize / dequantize Triton kernels vs the reference ({env['gpu']})", "",
             f"    {cmd}", "",
             f"torch {env['torch']}, triton {env['triton']}, Python {env['python']}; {elapsed:.1f} s. "
             f"All supported checks bit-exact: **{ok}**.", "",
             "| format | shape | data | status | quantize bytes differing | dequantize bit-equal | "
             "dequantize random rows bit-equal | ternary code bytes < 243 | max round-trip error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r.get(k) for k in ("quantize_bytes_differing", "dequantize_bit_equal",
                                    "dequantize_random_rows_bit_equal", "tern_code_bytes_valid",
                                    "max_roundtrip_abs_err")]
        lines.append(f"| {r['format']} | {r['shape']} | {r['data']} | {r['status']}"
                     f"{(': ' + r['reason']) if r.get('reason') else ''} | "
                     + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
