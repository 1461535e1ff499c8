"""A paged latent cache end to end on the GPU, under CUDA graphs: the same logits as the unpaged cache.

    python3 benchmarks/paged_decode_gpu.py --out DIR        # about 1 minute on an H200

A small bf16 HF Mixtral-shaped model (2 layers, 4:2 heads, head_dim 32), calibrated bases (groups of 2, kv_ratio 4),
int4 latents; prefill compiled with ``backend="ckvp"``, decode steps with ``options={"mode": "reduce-overhead"}``
(CUDA-graph trees). Runs once with the unpaged ``CKVPStaticCache`` and once with ``page_size=4`` and a pool of
exactly the pages the run needs (teacher-forced on the unpaged run's tokens), and reports per step the largest
absolute logit difference, the pages mapped, and the ckvp warnings. Writes DIR/paged_decode_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ckvp_compile.bench.output import run_env  # noqa: E402


def run(model, bases, ids, steps, page_size: int, num_pages: int | None, tokens=None) -> dict:
    from ckvp_compile.latent.capture import hf_step_kwargs
    from ckvp_compile.runtime.hf_cache import CKVPStaticCache

    torch._dynamo.reset()
    kw = dict(page_size=page_size, num_pages=num_pages) if page_size else {}
    cache = CKVPStaticCache(model.config, bases, max_cache_len=32, max_batch_size=ids.shape[0], device="cuda",
                            dtype=torch.bfloat16, latent_format="int4", **kw)
    pre = torch.compile(model, backend="ckvp", fullgraph=True)
    step = torch.compile(model, backend="ckvp", fullgraph=True, options={"mode": "reduce-overhead"})
    logits, toks, mapped = [], [], []
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = pre(**hf_step_kwargs(model, ids, cache, 0)).logits[:, -1:].float()
        logits.append(out.clone())
        tok = out.argmax(-1)
        for i in range(steps):
            tok = tok if tokens is None else tokens[i]
            toks.append(tok)
            torch.compiler.cudagraph_mark_step_begin()
            out = step(**hf_step_kwargs(model, tok, cache, ids.shape[1] + i)).logits[:, -1:].float()
            logits.append(out.clone())
            tok = out.argmax(-1)
            if page_size:
                mapped.append(cache.store.mapped_pages)
    torch.cuda.synchronize()
    return {"logits": logits, "tokens": toks, "mapped": mapped,
            "warnings": [str(w.message)[:300] for w in caught if "ckvp" in str(w.message).lower()]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    from ckvp_compile.latent import calibrate
    from ckvp_compile.testing import build_hf_moe

    t0 = time.time()
    torch.manual_seed(0)
    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, hidden=128)
    model = model.to("cuda", torch.bfloat16).eval()
    bases = calibrate(model, [torch.randint(0, 256, (1, 24), device="cuda") for _ in range(3)], group_size=2,
                      kv_ratio=4.0, progress=False)
    ids = torch.randint(0, 256, (2, 9), device="cuda")
    steps = 10
    row: dict = {}
    try:
        base = run(model, bases, ids, steps, 0, None)
        need = 2 * -(-(ids.shape[1] + steps) // 4)  # 2 sequences x pages for prompt + steps
        paged = run(model, bases, ids, steps, 4, need, tokens=base["tokens"])
        row = {"steps": steps + 1, "pages_needed": need, "mapped_per_step": paged["mapped"],
               "max_abs_logit_diff_per_step": [float((x - y).abs().max()) for x, y in zip(paged["logits"],
                                                                                           base["logits"])],
               "warnings_unpaged": base["warnings"], "warnings_paged": paged["warnings"]}
        row["equal"] = max(row["max_abs_logit_diff_per_step"]) == 0.0
    except Exception as e:  # noqa: BLE001 - reported
        import traceback

        row["error"] = repr(e)[:600]
        row["traceback"] = traceback.format_exc()[-4000:]
    print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
    env = run_env(t0)
    with open(os.path.join(a.out, "paged_decode_gpu.json"), "w") as f:
        json.dump({"env": env, "row": row}, f, indent=1)


if __name__ == "__main__":
    main()
