"""CUDA-graph capture of a small fp32 Mixtral-shaped decode step: where it broke, and that it now runs.

    python3 benchmarks/capture_fp32_gpu.py --out DIR        # H200, about 1-2 minutes

benchmarks/recent_window_gpu.py's end-to-end check (HF Mixtral-shaped model, 2 layers, 4:2 heads, D 32, fp32,
float latents, decode steps under ``mode="reduce-overhead"``) stopped with "Cannot copy between CPU and CUDA tensors
during CUDA graph capture". The first run of this script located it: transformers' fp32 expert path
(``transformers::grouped_mm_fallback``, ``offs.tolist()``), left in the graph because the expert rewrite is off by
default. Since then the backend turns CUDA graphs off for a graph that calls such an op, with a warning naming the
fix (``analysis.graph.CAPTURE_UNSAFE_OPS``). This runs the decode steps for several variants (fp32 / bf16 model,
``backend="ckvp"`` / ``"inductor"``, with and without ``enable_expert_gemm``), records the ckvp warnings and, on a
failure, the full Python traceback with the source lines around each generated-code frame:
DIR/capture_fp32_gpu.json and DIR/capture_fp32_gpu.md.
"""

from __future__ import annotations

import argparse
import json
import linecache
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from ckvp_compile.bench.output import run_env  # noqa: E402


def frames_with_source(exc: BaseException, context: int = 6) -> list[dict]:
    """Each traceback frame's file, line and function, with the surrounding source of generated-code frames."""
    out = []
    for fr in traceback.extract_tb(exc.__traceback__):
        item = {"file": fr.filename, "line": fr.lineno, "function": fr.name, "code": fr.line}
        generated = "torchinductor" in fr.filename or fr.filename.startswith("<eval_with_key")
        if generated or "ckvp_compile" in fr.filename:
            lines = []
            for n in range(max(1, fr.lineno - context), fr.lineno + context + 1):
                text = linecache.getline(fr.filename, n)
                if text:
                    lines.append(f"{n:6d}{'>' if n == fr.lineno else ' '} {text.rstrip()}")
            item["source"] = lines
        out.append(item)
    return out


def run_variant(name: str, dtype: torch.dtype, backend: str, window: int, expert_pass: bool = False) -> dict:
    from ckvp_compile.latent import calibrate
    from ckvp_compile.runtime.hf_cache import CKVPStaticCache
    from ckvp_compile.testing import build_hf_moe
    from ckvp_compile.latent.capture import hf_step_kwargs, make_static_cache

    dev = "cuda"
    torch.manual_seed(0)
    prompt, n_decode, cache_len = 12, 6, 32
    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, hidden=128)
    model = model.to(dev, dtype).eval()
    caught: list = []
    row: dict = {"variant": name, "dtype": str(dtype), "backend": backend, "window": window}
    try:
        torch._dynamo.reset()
        if backend == "ckvp":
            bases = calibrate(model, [torch.randint(0, 256, (1, 24), device=dev) for _ in range(3)], group_size=2,
                              kv_ratio=8.0, progress=False)
            cache = CKVPStaticCache(model.config, bases, max_cache_len=cache_len, max_batch_size=2, device=dev,
                                    recent_window=window, dtype=dtype)
            opts = {"enable_expert_gemm": expert_pass}
            pre = torch.compile(model, backend=backend, fullgraph=True, options=dict(opts))
            step = torch.compile(model, backend=backend, fullgraph=True, options={**opts, "mode": "reduce-overhead"})
        else:
            cache = make_static_cache(model, cache_len)
            pre = torch.compile(model, backend=backend, fullgraph=True)
            step = torch.compile(model, backend=backend, mode="reduce-overhead", fullgraph=True)
        ids = torch.randint(0, 256, (2, prompt), device=dev)
        steps = []
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tok = pre(**hf_step_kwargs(model, ids, cache, 0)).logits[:, -1:].argmax(-1)
            for i in range(n_decode):
                torch.compiler.cudagraph_mark_step_begin()
                tok = step(**hf_step_kwargs(model, tok, cache, prompt + i)).logits[:, -1:].argmax(-1)
                steps.append(i)
        torch.cuda.synchronize()
        row["warnings"] = [str(w.message)[:600] for w in caught if "ckvp" in str(w.message).lower()]
        row["ok"] = True
        row["cudagraphs_off_warned"] = any("CUDA graphs are off" in w for w in row["warnings"])
        row["decode_steps"] = len(steps)
    except Exception as e:  # noqa: BLE001 - recorded, the other variants still run
        row["warnings"] = [str(w.message)[:600] for w in caught if "ckvp" in str(w.message).lower()]
        row["ok"] = False
        row["error"] = repr(e)[:800]
        row["frames"] = frames_with_source(e)
        row["traceback"] = traceback.format_exc()[-6000:]
    print(json.dumps({k: v for k, v in row.items() if k not in ("frames", "traceback")})[:3000], flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    rows = [
        run_variant("fp32 ckvp (HF experts: CUDA graphs off, warned)", torch.float32, "ckvp", 0, expert_pass=False),
        run_variant("fp32 ckvp, enable_expert_gemm", torch.float32, "ckvp", 0, expert_pass=True),
        run_variant("fp32 ckvp, enable_expert_gemm, window 18", torch.float32, "ckvp", 18, expert_pass=True),
        run_variant("fp32 inductor", torch.float32, "inductor", 0),
        run_variant("bf16 ckvp", torch.bfloat16, "ckvp", 0),
    ]
    env = run_env(t0)
    with open(os.path.join(a.out, "capture_fp32_gpu.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    with open(os.path.join(a.out, "capture_fp32_gpu.md"), "w") as f:
        f.write(f"# fp32 decode capture ({env['gpu']}, torch {env['torch']}, triton {env['triton']})\n\n")
        f.write(f"    {env['command']}\n\n")
        for r in rows:
            f.write(f"## {r['variant']}: {'ok' if r['ok'] else 'FAILED'}\n\n")
            for w in r.get("warnings", []):
                f.write(f"- warning: {w}\n")
            if not r["ok"]:
                f.write("```\n" + r["traceback"] + "\n```\n\n")
                for fr in r["frames"]:
                    if "source" in fr:
                        f.write(f"{fr['file']}:{fr['line']} in {fr['function']}\n```\n" + "\n".join(fr["source"])
                                + "\n```\n\n")


if __name__ == "__main__":
    main()
