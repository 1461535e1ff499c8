"""GPU check of the Triton latent quantize / dequantize kernels (kernels/latent_quant_triton.py) at real shapes.

    python benchmarks/latent_quant_gpu.py --out benchmarks/results/<date>-latent-quant-h200 [--budget-s 120]

For every uniform format the kernels support (int8/int4/int2 at blocks 32 and 64, as ``unsupported_reason``
accepts) and every shape (B=8 x 4096 slots; ranks 256 as Hkv=2 heads of 128, 8 heads of 32, and uneven heads
100+156), on random latents (Gaussian, and rotated Gaussian with outliers), it checks:

* quantize: ``quantize_latent_triton(z) == quantize_latent_ref(z)`` byte for byte (the rows the store holds);
* dequantize: ``dequantize_latent_triton(rows) == dequantize_latent_ref(rows)`` bit for bit (fp32);
* the largest round-trip error |dequantize(quantize(z)) - z| (reported; the half-step bound per block is a CPU property test).

Formats the kernels refuse (ternary, mix plans, mxint) are listed with the refusal reason. Writes
``results.json`` and ``README.md`` (GPU name, torch / triton versions, the exact command, a table of every
check) into ``--out``; exit status 1 when any check fails, so ``USE_TRITON`` stays False until this passes.
Finishes in well under 2 minutes on an H200 (the reference path dominates); ``--budget-s`` stops early with
the rows done so far marked.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

FORMATS = ("int8/32", "int4/32", "int2/32", "int8/64", "int4/64", "int2/64")
REFUSED = ("tern/32", "mix/32:8x32+4x64+2x32,8x32+4x96")
SHAPES = (("B8 S4096 Hkv2x128", 8, 4096, (128, 128)), ("B8 S4096 Hkv8x32", 8, 4096, (32,) * 8),
          ("B8 S4096 100+156", 8, 4096, (100, 156)))


def _offsets(ranks):
    out = [0]
    for r in ranks:
        out.append(out[-1] + r)
    return out


def _latents(b, s, r, kind, gen, device):
    z = torch.randn(b, s, r, generator=gen, device=device)
    if kind == "outliers":  # heavy tails and a per-coordinate scale spread, as unrotated PCA latents have
        z = z * torch.logspace(1, -2, r, device=device) + (torch.rand(b, s, r, generator=gen, device=device) < 1e-3) * 40
    return z


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for results.json and README.md")
    p.add_argument("--budget-s", type=float, default=110.0, help="stop starting new checks after this many seconds")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="B=1 x 4 slots (a CPU smoke run under TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    shapes = tuple((n + " (tiny: B1 S4)", 1, 4, r) for n, _, _, r in SHAPES) if args.tiny else SHAPES
    from ckvp_compile.kernels.latent_format import dequantize_latent_ref, quantize_latent_ref
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
    for fmt in FORMATS:
        for name, b, s, ranks in shapes:
            for kind in ("gaussian", "outliers"):
                row = {"format": fmt, "shape": name, "data": kind}
                if time.perf_counter() - t0 > args.budget_s:
                    row["status"] = "skipped (time budget)"
                    rows.append(row)
                    continue
                reason = lq.unsupported_reason(fmt, device)
                if reason is not None:
                    row.update(status="refused", reason=reason)
                    ok = False  # a uniform format must run
                    rows.append(row)
                    continue
                offs = _offsets(ranks)
                z = _latents(b, s, offs[-1], kind, gen, device)
                ref_rows = quantize_latent_ref(z, offs, fmt)
                tri_rows = lq.quantize_latent_triton(z, offs, fmt)
                q_diff = int((ref_rows != tri_rows).sum())
                ref_z = dequantize_latent_ref(ref_rows, offs, fmt)
                tri_z = lq.dequantize_latent_triton(ref_rows, offs, fmt)
                dq_equal = bool(torch.equal(ref_z.view(torch.int32), tri_z.view(torch.int32)))
                err = (ref_z - z).abs().max().item()
                torch.cuda.synchronize(device) if device.type == "cuda" else None
                row.update(status="ok" if q_diff == 0 and dq_equal else "FAIL", quantize_bytes_differing=q_diff,
                           dequantize_bit_equal=dq_equal, max_roundtrip_abs_err=err, row_bytes=int(ref_rows.shape[-1]))
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
             "| format | shape | data | status | quantize bytes differing | dequantize bit-equal | max round-trip error |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['format']} | {r['shape']} | {r['data']} | {r['status']}"
                     f"{(': ' + r['reason']) if r.get('reason') else ''} | {r.get('quantize_bytes_differing', '-')} | "
                     f"{r.get('dequantize_bit_equal', '-')} | {r.get('max_roundtrip_abs_err', '-')} |")
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
