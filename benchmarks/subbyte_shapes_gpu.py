"""Which (slots per tile, warps) shapes multiply sub-byte latent codes on the tensor cores correctly on this GPU.

The review of 2026-11-30 (benchmarks/results/2026-11-30-head-groups-h200/README.md) found the per-head key rebuild
of ``latent_attention_triton`` wrong on the H200 (Triton 3.6) for int4 / int2 key latents at 16-slot tiles or 1 warp
(scores off by up to 14), and 16-slot tensor-core value tiles had failed the same way. This script checks a grid of
(slots per tile, warps) shapes against the reference, for sub-byte formats and an 8-bit control: the key pass alone
(``latent_scores_triton``, max abs score error, log2 units), and whole calls with the tensor-core value pass and
with the one-pass kernel (relative error; the one-pass rows were added after the 2026-11-30 runs). Its probe found
the cause (the ``tl.join`` / ``tl.reshape`` unpack feeding a K = 16 product); since the fix (``_latent_raw_codes``'
GATHER) every row of the grid passes and the launcher no longer restricts the shapes
(benchmarks/results/2026-11-30-subbyte-h200). Rerun it on a new GPU or Triton version.

    python3 benchmarks/subbyte_shapes_gpu.py --out DIR        # DIR/subbyte_shapes.json
    python3 benchmarks/subbyte_shapes_gpu.py --out DIR --formats int4/32,int8/32 --ranks 12,40   # a smaller grid

First a probe of the smallest form: codes unpacked from bytes (the library's ``_unpack_codes``, or a
per-coordinate gather) and fed to one ``tl.dot``, per (rows, warps) shape.

Shapes: 32 query / 8 KV heads (G = 4, the rebuild path), head_dim 128, ranks 12 (inside one block of 32), 40 and
256, batch 2, 4096 slots; generic config (rebuild, tensor-core values) with the key pass's or value pass's shape
replaced. Pass: score error <= 1e-3 * max |score| + 1e-4, output rel err <= 1e-3.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import triton
import triton.language as tl

from ckvp_compile.bench.attention import make_inputs, ref_chunked, rel_err
from ckvp_compile.kernels import latent_attention_triton as lat
from ckvp_compile.kernels import reference as ref
from ckvp_compile.kernels.latent_attention_triton import _unpack_codes

FORMATS = ("int4/32", "int2/16", "int8/32")
RANKS = (12, 40, 256)
KEY_SHAPES = [(bn, w) for bn in (16, 32, 64, 128) for w in (1, 2, 4, 8)]
VALUE_SHAPES = [(bn, w) for bn in (16, 32, 64) for w in (1, 2, 4, 8)]
ONE_PASS_SHAPES = [(bn, w) for bn in (16, 32, 64) for w in (1, 2, 4, 8)]


@triton.jit
def _probe_kernel(raw_ptr, b_ptr, out_ptr, BN: tl.constexpr, NC: tl.constexpr, NO: tl.constexpr,
                  BITS: tl.constexpr, GATHER: tl.constexpr, VALUE: tl.constexpr):
    """Codes (BN, NC) unpacked from (BN, NC*BITS/8) bytes, with the library's ``_unpack_codes`` (tl.join /
    tl.reshape) or, GATHER, each coordinate reading its own byte; then one bf16 tensor-core product: the key form
    out (BN, NO) fp32 = codes @ b (NC, NO), or VALUE: out (NO, NC) = b (NO, BN) @ codes (the codes as the B
    operand, K = BN rows, as in the value pass)."""
    PER: tl.constexpr = 8 // BITS
    rows = tl.arange(0, BN)
    if GATHER:
        cols = tl.arange(0, NC)
        raw = tl.load(raw_ptr + rows[:, None] * (NC // PER) + (cols // PER)[None, :]).to(tl.int32)
        code = (raw >> ((cols % PER) * BITS)[None, :]) & ((1 << BITS) - 1)
    else:
        hb = tl.arange(0, NC // PER)
        raw = tl.load(raw_ptr + rows[:, None] * (NC // PER) + hb[None, :]).to(tl.int32)
        code = _unpack_codes(raw, BN, NC, BITS)
    oc = tl.arange(0, NO)
    if VALUE:
        bm = tl.load(b_ptr + oc[:, None] * BN + rows[None, :])
        acc = tl.dot(bm, code.to(tl.bfloat16))
        tl.store(out_ptr + oc[:, None] * NC + tl.arange(0, NC)[None, :], acc)
    else:
        bm = tl.load(b_ptr + tl.arange(0, NC)[:, None] * NO + oc[None, :])
        acc = tl.dot(code.to(tl.bfloat16), bm)
        tl.store(out_ptr + rows[:, None] * NO + oc[None, :], acc)


def probe(rows: list) -> None:
    """The smallest form of the failure: sub-byte codes unpacked and fed to one tensor-core product, per (rows,
    columns, warps) shape, in the key form and the value form, with the library's unpack and with a
    per-coordinate gather (root cause: the unpack's layout, or the product)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for bits in (4, 2):
        for bn in (16, 32, 64, 128):
            for nc in (16, 32, 64):
                raw = torch.randint(0, 256, (bn, nc * bits // 8), generator=g, device="cuda", dtype=torch.uint8)
                shifts = torch.arange(0, 8, bits, device="cuda")
                codes = ((raw.long()[:, :, None] >> shifts) & ((1 << bits) - 1)).reshape(bn, nc).float()
                for value in (False, True):
                    no = 16 if value else 64
                    bm = torch.randn(*((no, bn) if value else (nc, no)), generator=g, device="cuda")
                    bm = bm.to(torch.bfloat16)
                    want = bm.float() @ codes if value else codes @ bm.float()
                    for w in (1, 2, 4, 8):
                        for gather in (False, True):
                            out = torch.empty(*want.shape, device="cuda")
                            row = {"pass": "probe", "form": "value" if value else "key", "bits": bits,
                                   "block_n": bn, "ncols": nc, "num_warps": w,
                                   "unpack": "gather" if gather else "join/reshape"}
                            try:
                                _probe_kernel[(1,)](raw, bm, out, BN=bn, NC=nc, NO=no, BITS=bits, GATHER=gather,
                                                    VALUE=value, num_warps=w)
                                err = float((out - want).abs().max())
                                row.update(max_abs_err=err, ok=err <= 1e-3 * float(want.abs().max()))
                            except Exception as e:  # noqa: BLE001 - reported, the others still run
                                row["error"] = repr(e)[:300]
                            rows.append(row)
                            if not row.get("ok"):
                                print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated latent formats")
    ap.add_argument("--ranks", default=",".join(map(str, RANKS)), help="comma-separated key/value ranks")
    ap.add_argument("--probe-only", action="store_true", help="only the minimal unpack-then-dot probe")
    ap.add_argument("--skip-probe", action="store_true", help="the library's kernels only")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "heads": "32:8", "head_dim": 128, "batch": 2, "context": a.context,
           "command": "python3 " + " ".join(sys.argv)}
    rows = []

    def dump() -> None:
        with open(os.path.join(a.out, "subbyte_shapes.json"), "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)

    if not a.skip_probe:
        probe(rows)
        dump()
    base = lat.DecodeConfig()
    for fmt in ([] if a.probe_only else a.formats.split(",")):
        for rank in map(int, a.ranks.split(",")):
            args = make_inputs(2, a.context, fmt, rank, seed=5, heads=(32, 8))
            q, lk, lv, bk, bv, ko, vo, cos, sin, sp, rf, rd, nk, nv, sl, mk, sc_, kv, kf, vf = args
            sw = ref.latent_scores_ref(q, lk, bk, ko, cos, sin, sp, rf, rd, sl, mk, sc_, kv, kf)
            fin = torch.isfinite(sw)
            tol = 1e-3 * float(sw[fin].abs().max()) + 1e-4
            want = ref_chunked(args, 1)
            for bn, w in KEY_SHAPES:
                row = {"format": fmt, "rank": rank, "pass": "key", "block_n": bn, "num_warps": w}
                try:
                    s = lat.latent_scores_triton(q, lk, bk, ko, cos, sin, sp, rf, rd, sl, mk, sc_, kv, kf,
                                                 config=dataclasses.replace(base, block_n=bn, num_warps=w))
                    err = float((s[fin] - sw[fin]).abs().max())
                    row.update(max_abs_score_err=err, ok=err <= tol)
                except Exception as e:  # noqa: BLE001 - reported, the others still run
                    row["error"] = repr(e)[:300]
                rows.append(row)
                print(json.dumps(row), flush=True)
            whole = [({"pass": "value (tensor cores)", "block_n_v": bn, "num_warps_v": w},
                      dict(block_n_v=bn, num_warps_v=w)) for bn, w in VALUE_SHAPES]
            # the one-pass kernel (the GQA default up to rank 128): keys and values in one launch
            whole += [({"pass": "one pass", "block_n": bn, "num_warps": w}, dict(two_pass=False, block_n=bn,
                                                                                num_warps=w))
                      for bn, w in ONE_PASS_SHAPES]
            for fields, changes in whole:
                row = {"format": fmt, "rank": rank, **fields}
                try:
                    out = lat.latent_attention_triton(*args, config=dataclasses.replace(base, **changes))
                    err = rel_err(out, want)
                    row.update(rel_err=err, ok=err <= 1e-3)
                except Exception as e:  # noqa: BLE001 - reported, the others still run
                    row["error"] = repr(e)[:300]
                rows.append(row)
                print(json.dumps(row), flush=True)
            dump()
            del args, want, sw
            torch.cuda.empty_cache()
    bad = [r for r in rows if not r.get("ok")]
    print(f"{len(rows) - len(bad)} of {len(rows)} rows pass")


if __name__ == "__main__":
    main()
