"""The code-domain key rebuild (``DecodeConfig.key_codes``) against the default dequantized rebuild, at GQA.

With several query heads per KV head (Mixtral-8x7B's 32:8) the kernel rebuilds each tile of keys from its latent:
dequantized fp32 latents times a bf16 basis take two tensor-core products (the hi / lo split of the latent), the
bulk of the call's tensor work. ``key_codes`` multiplies the integer codes (exact in bf16) by the basis instead,
one product per quantization block, then each row's scale, plus its min times the basis columns' sums: exact, with
half the rebuild's tensor work. This script times whole calls (``latent_attention_triton``) in the one-pass
(default up to rank 128 at G > 1) and two-pass forms, with and without it, each checked against the reference.

    python3 benchmarks/key_codes_gpu.py --out DIR [--cases 8:32768:100,64:32768:100]

Shape: 32 query heads, 8 KV heads, head_dim 128, int4/32 latents (keys and values of one rank, bf16 bases).
Writes DIR/key_codes.json (rows: case, variant, ms, rel_err, registers) with the GPU, torch and Triton versions
and this command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import latent_attention_gpu as lag  # noqa: E402

from ckvp_compile.kernels.latent_attention_triton import default_config  # noqa: E402


def variants(rank_pad: int) -> dict:
    """The GQA default and its two-pass form, each with and without the code-domain rebuild."""
    r = dataclasses.replace
    base = default_config(4, rank_pad)
    other = r(base, two_pass=not base.two_pass)
    one, two = (base, other) if not base.two_pass else (other, base)
    return {"one pass (default)" if one is base else "one pass": one,
            "one pass, key_codes": r(one, key_codes=True),
            "two pass (default)" if two is base else "two pass": two,
            "two pass, key_codes": r(two, key_codes=True)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="8:32768:100,64:32768:100,1:4096:100",
                    help="comma-separated batch:context:rank")
    ap.add_argument("--format", default="int4/32")
    a = ap.parse_args()
    lag.H, lag.HKV = 32, 8
    os.makedirs(a.out, exist_ok=True)
    import triton

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "heads": "32:8", "head_dim": lag.D, "format": a.format, "command": "python3 " + " ".join(sys.argv)}
    rows = []
    for case in a.cases.split(","):
        b, t, rank = (int(x) for x in case.split(":"))
        args = lag.make_inputs(b, t, a.format, rank, seed=5)
        want = lag.ref_chunked(args, 2)
        rank_pad = max(16, 1 << (rank - 1).bit_length())
        for name, c in variants(rank_pad).items():
            row = {"batch": b, "context": t, "rank": rank, "variant": name}
            row.update({k: v for k, v in lag.try_config(args, want, c).items() if k != "config"})
            rows.append(row)
            print(json.dumps(row), flush=True)
        del args, want
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, "key_codes.json"), "w") as fh:
        json.dump({"env": env, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
