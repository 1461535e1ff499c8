"""Which (slots per tile, warps) shapes multiply sub-byte latent codes on the tensor cores correctly on this GPU.

The review of 2026-11-30 (benchmarks/results/2026-11-30-head-groups-h200/README.md) found the per-head key rebuild
of ``latent_attention_triton`` wrong on the H200 (Triton 3.6) for int4 / int2 key latents at 16-slot tiles or 1 warp
(scores off by up to 14), while the default shape (64 slots, 4 warps) was right; 16-slot tensor-core value tiles
had failed the same way before (``MIN_TC_VALUE_BLOCK``). Since then CUDA launches these passes only at
``SUBBYTE_DOT_SHAPES``. This script lifts that guard for its own calls and checks a grid of shapes against the
reference, for sub-byte formats and an 8-bit control: the key pass alone (``latent_scores_triton``, max abs score
error, log2 units), and whole calls with the tensor-core value pass (relative error). A shape may join
``SUBBYTE_DOT_SHAPES`` only where every row of it passes.

    python3 benchmarks/subbyte_shapes_gpu.py --out DIR        # DIR/subbyte_shapes.json

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

from ckvp_compile.bench.attention import make_inputs, ref_chunked, rel_err
from ckvp_compile.kernels import latent_attention_triton as lat
from ckvp_compile.kernels import reference as ref

FORMATS = ("int4/32", "int2/16", "int8/32")
RANKS = (12, 40, 256)
KEY_SHAPES = [(bn, w) for bn in (16, 32, 64, 128) for w in (1, 2, 4, 8)]
VALUE_SHAPES = [(bn, w) for bn in (16, 32, 64) for w in (1, 2, 4, 8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=4096)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    import triton

    lat._subbyte_shapes = lambda cfg, kf, vf, g: (cfg, {})  # this script's calls run the shapes they ask for
    lat.MIN_TC_VALUE_BLOCK = 16  # 16-slot value tiles too (the launcher raises them to 32 otherwise)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "heads": "32:8", "head_dim": 128, "batch": 2, "context": a.context,
           "command": "python3 " + " ".join(sys.argv)}
    rows = []

    def dump() -> None:
        with open(os.path.join(a.out, "subbyte_shapes.json"), "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)

    base = lat.DecodeConfig()
    for fmt in FORMATS:
        for rank in RANKS:
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
            for bn, w in VALUE_SHAPES:
                row = {"format": fmt, "rank": rank, "pass": "value (tensor cores)", "block_n_v": bn, "num_warps_v": w}
                try:
                    out = lat.latent_attention_triton(*args, config=dataclasses.replace(base, block_n_v=bn,
                                                                                        num_warps_v=w))
                    err = rel_err(out, want)
                    row.update(rel_err=err, ok=err <= 1e-3)
                except Exception as e:  # noqa: BLE001
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
