"""GPU check of the latent decode attention lowering (issue 5, acceptance 3): Inductor autotunes the key-pass
``TritonTemplate`` and the chosen kernel appears in the output code.

    python3 benchmarks/latent_attention_lowering_gpu.py --out $OUT/lowering [--budget-s 150]

1. Op level, one Mixtral-shaped layer (32 query heads, 8 KV heads, head_dim 128, rank 256 per KV head): a function
   calling ``torch.ops.ckvp.latent_attention`` compiled by Inductor with ``mode="max-autotune-no-cudagraphs"``;
   checks that a ``ckvp_latent_scores`` template kernel (or its extern choice) is in the output code, records every
   autotuning timing (Inductor's feedback saver), the relative error against the reference, and the time of the
   compiled call against the plain Triton launch (default config) in the same run.
2. Model level: the fixture model (bf16, CUDA), a CKVP latent cache at kv_ratio 4 (``mxint8`` latents, uniform
   ranks), forward compiled with ``backend="ckvp"`` and ``mode="max-autotune-no-cudagraphs"``; 16 greedy tokens;
   checks for the template in the output code and the agreement with eager dense generation.

Writes ``lowering.json`` and ``lowering.md`` (versions, the exact command) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "examples"))

from moe_lowering_gpu_check import _feedback  # noqa: E402  (records Inductor's autotuning timings)


_KERNEL_RE = re.compile(r"async_compile\.triton\('(\w+)', '''(.*?)'''", re.S)


def _template_kernels(code: str) -> list[str]:
    """Names of the generated kernels whose source holds the key-pass helper ``_tile_scores`` (Inductor names
    template kernels ``triton_tem_...``; a template's jit helpers are compiled with it)."""
    names = [m.group(1) for m in _KERNEL_RE.finditer(code) if "def _tile_scores(" in m.group(2)]
    if not names and "def _tile_scores(" in code:
        names.append("(template source present)")
    return sorted(set(names))


def op_level(b: int, t: int, fmt: str, rank: int) -> dict:
    from torch._inductor.utils import run_and_get_code
    from triton.testing import do_bench

    import latent_attention_gpu as lag
    from ckvp_compile.kernels import reference as ref
    from ckvp_compile.kernels.latent_attention_triton import latent_attention_triton

    args = lag.make_inputs(b, t, fmt, rank, seed=3)
    want = lag.ref_chunked(args, 4)
    (q, lk, lv, bk, bv, ko, vo, cos, sin, sp, rf, rd, nk, nv, sl, mk, sc, kv, kf, vf) = args

    def f(q, lk, lv, bk, bv, cos, sin, sp, nk, nv, sl):
        return torch.ops.ckvp.latent_attention(q, lk, lv, bk, bv, ko, vo, cos, sin, sp, rf, rd, nk, nv, sl, None, sc,
                                               kv, kf, vf)

    torch._dynamo.reset()
    comp = torch.compile(f, backend="inductor", mode="max-autotune-no-cudagraphs", fullgraph=True)
    t0 = time.time()
    out, codes = run_and_get_code(lambda: comp(q, lk, lv, bk, bv, cos, sin, sp, nk, nv, sl))
    compile_s = time.time() - t0
    code = "\n".join(codes)
    ms_compiled = float(do_bench(lambda: comp(q, lk, lv, bk, bv, cos, sin, sp, nk, nv, sl), rep=60))
    ms_plain = float(do_bench(lambda: latent_attention_triton(*args), rep=60))
    err_plain = lag.rel_err(latent_attention_triton(*args), want)  # the plain launch's default config, checked too
    templates = _template_kernels(code)
    return dict(check=f"op_{fmt}_r{rank}_B{b}_T{t}", ok=bool(templates or "ckvp_latent_scores_extern" in code)
                and lag.rel_err(out, want) <= 1e-3 and err_plain <= 1e-3, rel_err_plain_default=err_plain,
                template_kernels=templates,
                extern_in_code="ckvp_latent_scores_extern" in code, from_scores_in_code="latent_attention_from_scores" in code,
                rel_err=lag.rel_err(out, want), compile_s=compile_s, ms_compiled=ms_compiled, ms_plain_default=ms_plain)


def model_level() -> dict:
    from torch._inductor.utils import run_and_get_code

    import generate as gen

    torch._dynamo.reset()
    model_dir = REPO / "models" / "tiny-mixtral-pystdlib"
    model, encode, decode = gen.load(model_dir, "cuda", torch.bfloat16)
    ids = torch.tensor([encode(gen.DEFAULT_PROMPT)], device="cuda")
    eager_ids, _ = gen.generate(model, ids, 16)
    from ckvp_compile.latent import calibrate
    from ckvp_compile.runtime.hf_cache import CKVPStaticCache

    text = (model_dir / "eval_text.txt").read_text(encoding="utf-8", errors="replace")[-16 * 256:]
    toks = encode(text)
    samples = [torch.tensor([toks[i:i + 256]]) for i in range(0, len(toks) - 255, 256)][:8]
    bases = calibrate(model, samples, group_size=4, kv_ratio=4, rank_allocation="uniform", progress=False,
                      latent_format="mxint8", cache_len=4096, dense_dtype=torch.bfloat16, latent_dtype=torch.bfloat16)
    cache = CKVPStaticCache(model.config, bases, max_cache_len=ids.shape[1] + 16, max_batch_size=1, device="cuda",
                            dtype=torch.bfloat16, latent_format="mxint8", latent_dtype=torch.bfloat16)
    fwd = model.forward
    # max-autotune for the ckvp templates; the model's dense GEMMs stay on ATen (their Triton autotuning takes
    # minutes and is not what this checks)
    model.forward = torch.compile(fwd, backend="ckvp", options={
        "mode": "max-autotune-no-cudagraphs", "inductor": {"max_autotune_gemm_backends": "ATEN"}})
    try:
        (ckvp_ids, _), codes = run_and_get_code(lambda: gen.generate(model, ids, 16, cache))
    finally:
        model.forward = fwd
    code = "\n".join(codes)
    templates = _template_kernels(code)
    agree = sum(a == b for a, b in zip(eager_ids, ckvp_ids))
    return dict(check="fixture_model_bf16_kv4_mxint8", ok=bool(templates) and agree >= 12, template_kernels=templates,
                extern_in_code="ckvp_latent_scores_extern" in code, latent_attention_extern="latent_attention(" in code,
                agree=agree, tokens=len(eager_ids), ranks=str(getattr(bases, "ranks", ""))[:200])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=150)
    ap.add_argument("--jobs", default="op,model,op4k,op_int8",
                    help="comma-separated: op, model, op4k, op_int8, op_int4, op_int4_r12")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import transformers
    import triton

    from ckvp_compile.lowering import register_all

    register_all()
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               transformers=transformers.__version__, python=platform.python_version())
    feedback: list = []
    _feedback(feedback)
    rows = []
    start = time.time()
    jobs = {"op": lambda: op_level(8, 32768, "mxint8/32", 256), "model": model_level,
            "op4k": lambda: op_level(8, 4096, "mxint8/32", 256), "op_int8": lambda: op_level(8, 32768, "int8/32", 256),
            "op_int4": lambda: op_level(8, 32768, "int4/32", 256),
            "op_int4_r12": lambda: op_level(8, 32768, "int4/32", 12)}
    for job in (jobs[k] for k in a.jobs.split(",")):
        if time.time() - start > a.budget_s:
            rows.append(dict(check="skipped", ok=False, why="time budget"))
            continue
        try:
            rows.append(job())
        except Exception as e:  # a failing check is recorded, the others still run
            rows.append(dict(check=getattr(job, "__name__", "job"), ok=False, error=repr(e)[:500],
                             trace=traceback.format_exc()[-2000:]))
        print(json.dumps(rows[-1], default=str), flush=True)
        payload = dict(env=env, command="python3 " + " ".join(sys.argv), checks=rows, autotuning=feedback)
        (out / "lowering.json").write_text(json.dumps(payload, indent=1, default=str))
    md = [f"# Latent attention lowering: GPU check\n", f"Command: `python3 {' '.join(sys.argv)}`  ", f"Versions: {env}\n",
          "| check | ok | details |", "| --- | --- | --- |"]
    for r in rows:
        md.append(f"| {r['check']} | {r['ok']} | {json.dumps({k: v for k, v in r.items() if k not in ('check', 'ok', 'trace')}, default=str)[:600]} |")
    (out / "lowering.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
