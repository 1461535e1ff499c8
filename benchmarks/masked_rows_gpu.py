"""Fused latent decode attention with HF-style additive masks on the GPU: rows masked wholly by the finite
``finfo(float32).min`` (what HF builds for fp32 masks) must average uniformly as the reference does (the kernels
gave zeros before 06a564a), partly masked rows as usual. One call per path (pre-RoPE split kernels, table-free
absorbed pass at GQA, table-free lane pass at G = 1) at a modest real shape, compared with
``kernels.reference.latent_attention_ref`` (via tests/kernels/test_latent_attention_triton.py's ``_expected``).

    python3 benchmarks/masked_rows_gpu.py --out DIR      # writes DIR/masked_rows.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import triton

    import test_latent_attention_triton as base
    from ckvp_compile.kernels import latent_attention_triton as lat

    rows, ok = [], True
    base_p = dict(seed=1, b=2, hkv=8, ratio=4, d=128, kv_len=4096, s=2, extra=8, rk=[32] * 8, rv=[32] * 8,
                  kfmt="int4/32", vfmt="int4/32", rope="rotate_half", rd=128, mask="finfo", mask_shape="bhsk",
                  mask_p=0.3, dtype=torch.bfloat16, pos_dtype=torch.int32, win=3)
    cases = {"pre-RoPE, G=4 (split kernels)": base_p,
             "pre-RoPE, G=4, no mask (the same call's error without one)": dict(base_p, mask=None),
             "table-free, G=4 (absorbed pass)": dict(base_p, rope="none", rd=0),
             "table-free, G=1 (lane pass)": dict(base_p, rope="none", rd=0, hkv=16, ratio=1, rk=[32] * 16,
                                                 rv=[8] * 16)}
    for name, p in cases.items():
        args = base._inputs(p)
        want = base._expected(args).float()
        dev = [x.cuda() if isinstance(x, torch.Tensor) else x for x in args]
        lat._LAST_LAUNCH.pop("key_fp16", None)  # set by this call's launch only where it rebuilds keys
        out = lat.latent_attention_triton(*dev).float().cpu()
        err = float((out - want).norm() / want.norm())
        head0 = float((out[:, 0] - want[:, 0]).norm() / want[:, 0].norm())  # query head 0 (wholly masked)
        launch = {k: v for k, v in lat._LAST_LAUNCH.items() if isinstance(v, (int, float, str, bool))}
        rows.append(dict(case=name, rel_err=err, rel_err_masked_head=head0, finite=bool(torch.isfinite(out).all()),
                         lanes=launch.get("lanes"), absorbed=launch.get("absorbed"),
                         key_fp16=launch.get("key_fp16")))
        # 2e-3 where the keys were rebuilt with one fp16 dot (key_fp16: GQA's default over int latents; the bound
        # tests/kernels/test_latent_attention_triton.py gives it), else 1e-3
        tol = 2e-3 if launch.get("key_fp16") else 1e-3
        ok = ok and err <= tol and head0 <= tol
        print(rows[-1], flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                command="python3 benchmarks/masked_rows_gpu.py --out " + a.out)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "masked_rows.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
