"""GPU check of the shared-expert rewrite (issue 6): the one-expert ``ckvp::moe_experts`` call on CUDA and a
compiled Qwen2-MoE model with full Inductor.

    python benchmarks/moe_shared_expert_gpu_check.py --out DIR      # H200: about 1-2 minutes

1. E=1 eager op on CUDA at T = 1, 7, 64, 600 tokens (Qwen1.5-MoE shared-expert width: Dm 2048, I 1408), fp32 and
   bf16, against the fp64 per-expert loop (bounds: 1e-5 fp32, 1e-2 bf16, issue 6 acceptance 1).
2. A tiny random Qwen2-MoE (2 layers, gated shared expert) compiled with ``backend="ckvp"`` (Inductor default
   mode): logits against eager (1e-3 fp32, 5e-2 bf16) and whether the grouped-GEMM kernels are in the output code.
Writes DIR/shared_expert_gpu.json and .md; exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import triton
    import transformers
    from torch._inductor.utils import run_and_get_code

    import ckvp_compile.ops as ops
    from ckvp_compile.kernels.moe_reference import moe_experts_loop_ref
    from ckvp_compile.testing import build_hf_moe
    from ckvp_compile.testing.moe_cases import make_moe_inputs

    ops.register_all()
    rows = []
    for t in (1, 7, 64, 600):
        for dt, bound in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            x = make_moe_inputs(dict(tokens=t, num_experts=1, top_k=1, hidden=2048, ffn=1408, mode="random", seed=t),
                                dtype=dt, device="cuda")
            a = (x["hidden"], x["topk_ids"].int(), torch.rand(t, 1, device="cuda"), x["w_gate"], x["w_up"], x["w_down"])
            ref = moe_experts_loop_ref(*(v.double() if v.is_floating_point() else v for v in a))
            err = float((torch.ops.ckvp.moe_experts(*a).double() - ref).norm() / ref.norm())
            rows.append({"check": f"E=1 op T={t} {dt}", "rel_err": err, "bound": bound, "ok": err <= bound})
            print(rows[-1], flush=True)
    for dt, bound in ((torch.float32, 1e-3), (torch.bfloat16, 5e-2)):
        torch._dynamo.reset()
        m = build_hf_moe("qwen2_moe", num_layers=2, hidden=128, num_heads=4, head_dim=32, num_experts=8, ffn=96,
                         shared_expert_intermediate_size=192, dtype=dt).cuda()
        ids = torch.randint(0, 256, (2, 9), device="cuda")
        with torch.no_grad():
            e = m(ids, use_cache=False).logits.float()
            c = torch.compile(m, backend="ckvp", options={"enable_expert_gemm": True})
            o, codes = run_and_get_code(lambda: c(ids, use_cache=False).logits.float())
        err = float((o - e).norm() / e.norm())
        code = "\n".join(codes)
        in_code = "_ckvp_gate_up_tile" in code or "moe_gate_up" in code
        rows.append({"check": f"compiled qwen2_moe {dt}", "rel_err": err, "bound": bound, "ok": err <= bound and in_code,
                     "ckvp_kernels_in_code": in_code, "moe_experts_calls_in_code": code.count("moe_align")})
        print(rows[-1], flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "command": "python " + " ".join(sys.argv)}
    (args.out / "shared_expert_gpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["# Shared-expert rewrite on the GPU", "", *[f"- {k}: {v}" for k, v in meta.items()], "",
             "| check | rel err | bound | ok |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['check']} | {r['rel_err']:.2e} | {r['bound']:g} | {r['ok']} |" for r in rows]
    (args.out / "shared_expert_gpu.md").write_text("\n".join(lines) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
