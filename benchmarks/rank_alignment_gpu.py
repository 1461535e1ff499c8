"""Does a head's key / value rank that is not a multiple of the latent's alignment slow the fused decode attention?

The latent row holds every KV head's codes back to back, so a head's first byte is aligned only to the largest
power of two dividing every earlier head's bytes: at int4, rank 100 (50 bytes) leaves the heads 2-byte aligned and
the kernel's code loads go byte by byte, rank 96 (48 bytes) leaves them 16-byte aligned. Both pad to 128 on the
tensor cores, so any difference in time is the loads and the registers they take. This script times whole calls
(``latent_attention_triton``, the default config with paired tables, as a compiled model runs it) at ranks around
the ones a KV-ratio-16 plan picks, each checked against the reference.

    python3 benchmarks/rank_alignment_gpu.py --out DIR [--cases H:HKV:B:T:RANK,...]

head_dim 128, int4/32 latents (keys and values of one rank, bf16 bases). Writes DIR/rank_alignment.json (rows:
heads, batch, context, rank, head alignment in bytes, ms, rel_err, registers) with the GPU, torch and Triton
versions and this command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import latent_attention_gpu as lag  # noqa: E402

from ckvp_compile.kernels.latent_attention_triton import _head_meta, default_config  # noqa: E402

CASES = ",".join([f"32:8:8:32768:{r}" for r in (95, 96, 100, 112, 128)]
                 + [f"16:16:8:32768:{r}" for r in (40, 42, 48, 63, 64, 96, 104, 128)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default=CASES, help="comma-separated heads:kv_heads:batch:context:rank")
    ap.add_argument("--format", default="int4/32")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    import triton

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "head_dim": lag.D, "format": a.format, "command": "python3 " + " ".join(sys.argv)}
    rows = []
    for case in a.cases.split(","):
        h, hkv, b, t, rank = (int(x) for x in case.split(":"))
        lag.H, lag.HKV = h, hkv
        args = lag.make_inputs(b, t, a.format, rank, seed=7)
        want = lag.ref_chunked(args, 2)
        rank_pad = max(16, 1 << (rank - 1).bit_length())
        cfg = default_config(h // hkv, rank_pad, paired=True)
        cols = _head_meta(args[5], a.format, torch.device("cpu"))[3]  # each head's first byte in a row
        align = 0
        for c in cols[1:]:  # the largest power of two dividing every head's first byte
            align |= int(c)
        row = {"heads": f"{h}:{hkv}", "batch": b, "context": t, "rank": rank, "k_first_bytes": list(cols[:4]),
               "head_align_bytes": (align & -align) if align else None}
        row.update({k: v for k, v in lag.try_config(args, want, cfg).items() if k != "config"})
        rows.append(row)
        print(json.dumps(row), flush=True)
        del args, want
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, "rank_alignment.json"), "w") as fh:
        json.dump({"env": env, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
