"""Time DecodeConfig variants of one fused latent decode attention call at real shapes, each checked against the
reference (H200 work between sessions: which knob moves a given layer shape).

    python3 benchmarks/config_sweep_gpu.py --out DIR --cases 32:8:8:32768:96,32:8:64:32768:96 \
        --configs 'default;default+{"block_n": 32};default+{"r_loop": true, "block_r": 32}' [--paired] [--format int4/32]
    ncu ... python3 benchmarks/config_sweep_gpu.py --out DIR --cases 32:8:8:32768:96 --configs default --ncu

A case is heads:kv_heads:batch:context:rank (head_dim 128; keys and values of that rank; latents of
``latent_attention_gpu.make_inputs``). A config is ``default`` (the launcher's default for the case's group and
padded rank, with ``--paired`` as a compiled HF model declares its tables) or ``generic`` (``DecodeConfig()``),
optionally followed by ``+`` and a JSON object of DecodeConfig fields replaced over it. Each row: ms (median of
``do_bench``), rel_err against ``latent_attention_ref``, and the last launch's registers / spills. ``--ncu`` runs
each config twice without timing (profile the second launch). Writes DIR/config_sweep.json with the GPU, torch and
Triton versions and this command.
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

from ckvp_compile.kernels.latent_attention_triton import DecodeConfig, default_config, latent_attention_triton  # noqa: E402


def parse_config(text: str, group: int, rank_pad: int, paired: bool) -> DecodeConfig:
    """``default`` / ``generic`` [+ JSON of DecodeConfig fields] -> the DecodeConfig it names."""
    name, _, extra = text.partition("+")
    base = {"default": lambda: default_config(group, rank_pad, paired=paired),
            "generic": lambda: dataclasses.replace(DecodeConfig(), paired_tables=paired)}[name.strip()]()
    return dataclasses.replace(base, **json.loads(extra)) if extra.strip() else base


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", required=True, help="comma-separated heads:kv_heads:batch:context:rank")
    ap.add_argument("--configs", default="default", help="';'-separated default|generic[+{JSON fields}]")
    ap.add_argument("--format", default="int4/32")
    ap.add_argument("--paired", action="store_true", help="tables declared paired (as in a compiled HF model)")
    ap.add_argument("--ncu", action="store_true", help="two untimed launches per config, for Nsight Compute")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    import triton

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "head_dim": lag.D, "format": a.format, "paired": a.paired, "command": "python3 " + " ".join(sys.argv)}
    rows = []
    for case in a.cases.split(","):
        h, hkv, b, t, rank = (int(x) for x in case.split(":"))
        lag.H, lag.HKV = h, hkv
        args = lag.make_inputs(b, t, a.format, rank, seed=11)
        want = None if a.ncu else lag.ref_chunked(args, 2)
        rank_pad = max(16, 1 << (rank - 1).bit_length())
        for text in a.configs.split(";"):
            row = {"heads": f"{h}:{hkv}", "batch": b, "context": t, "rank": rank, "config": text}
            try:
                cfg = parse_config(text, h // hkv, rank_pad, a.paired)
                out = latent_attention_triton(*args, config=cfg)
                if a.ncu:
                    latent_attention_triton(*args, config=cfg)
                    torch.cuda.synchronize()
                else:
                    row["rel_err"] = lag.rel_err(out, want)
                    row["ms"] = round(lag.bench(lambda c=cfg, x=args: latent_attention_triton(*x, config=c), warmup=5,
                                                rep=30), 4)
                    row.update(lag.kernel_stats())
            except Exception as e:  # noqa: BLE001 - reported, the others still run
                row["error"] = repr(e)[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
        del args, want
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, "config_sweep.json"), "w") as fh:
        json.dump({"env": env, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
