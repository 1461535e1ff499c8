"""CKVP memory on the GPU: device bytes of a dense StaticCache vs a CKVPStaticCache, measured with
torch.cuda.memory_allocated, for the fixture model after a compiled generate() at each ratio.

    python benchmarks/ckvp_memory_gpu.py --out DIR

Writes DIR/memory.json and prints a markdown table. Everything is measured on the device in this run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("out"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-cache-len", type=int, default=4096)
    p.add_argument("--ratios", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--latent-format", default="float", help="float, int8, int4, int2 (optionally /block)")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--allocation", default="energy", choices=["energy", "uniform"])
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, StaticCache

    import ckvp_compile
    from ckvp_compile.runtime.hf_cache import CKVPStaticCache

    dev, dtype = "cuda", getattr(torch, args.dtype)
    model_dir = REPO / "models" / "tiny-mixtral-pystdlib"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(dev).eval()
    text = (model_dir / "eval_text.txt").read_bytes()
    samples = [torch.tensor([list(text[i:i + 256])]) for i in range(0, 16 * 256, 256)]
    prompt = torch.tensor([list(text[-200:-100])] * args.batch, device=dev)
    rows = []

    def measure(make_cache, label, ratio):
        torch.cuda.synchronize()
        torch._dynamo.reset()
        base = torch.cuda.memory_allocated()
        cache = make_cache()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        fwd = model.forward
        model.forward = torch.compile(model.forward, backend="ckvp", options={"compiler": "aot_eager"})
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, past_key_values=cache, max_new_tokens=32, do_sample=False,
                                 disable_compile=True, pad_token_id=0)
        torch.cuda.synchronize()
        model.forward = fwd
        after = torch.cuda.memory_allocated() - base
        row = {"cache": label, "requested_ratio": ratio, "batch": args.batch, "max_cache_len": args.max_cache_len,
               "cache_bytes_allocated": held, "allocated_after_generate": after,
               "generate_s_incl_compile": round(time.perf_counter() - t0, 2), "tokens": out[:, prompt.shape[1]:].tolist()}
        if hasattr(cache, "store"):
            nb = cache.store.nbytes()
            row.update(latent_state_bytes=nb.per_sequence_state, model_constant_bytes=nb.bases + nb.rope_tables)
        rows.append(row)
        del cache
        return row

    def dense_cache():
        cache = StaticCache(config=model.config, max_cache_len=args.max_cache_len)
        cfg = model.config
        probe = torch.empty(args.batch, cfg.num_key_value_heads, 0, cfg.head_dim, device=dev, dtype=dtype)
        for layer in cache.layers:  # allocate now (transformers allocates lazily at the first update)
            layer.lazy_initialization(probe, probe)
        return cache

    dense = measure(dense_cache, "dense StaticCache", 1.0)
    dense_bytes = dense["cache_bytes_allocated"]
    from ckvp_compile.latent import collect_kv_moments
    from ckvp_compile.latent.budget import bases_for_byte_ratio

    moments = collect_kv_moments(model.float(), samples, group_size=args.group_size, progress=False)
    model.to(dtype)
    fmt = args.latent_format
    for ratio in args.ratios:  # every byte the store holds but the RoPE tables, against the dense cache's dtype
        bases = bases_for_byte_ratio(moments, ratio, fmt, batch_size=args.batch, max_cache_len=args.max_cache_len,
                                     rank_allocation=args.allocation, dense_dtype=dtype, latent_dtype=dtype)
        measure(lambda: CKVPStaticCache(model.config, bases, max_cache_len=args.max_cache_len,
                                        max_batch_size=args.batch, device=dev, dtype=dtype, latent_format=fmt),
                f"CKVPStaticCache {fmt}", ratio)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "command": f"python benchmarks/ckvp_memory_gpu.py --out $OUT --dtype {args.dtype} --latent-format {fmt} "
                       f"--batch {args.batch} --group-size {args.group_size} --allocation {args.allocation}",
            "dense_cache_bytes": dense_bytes}
    (args.out / f"memory_{args.dtype}_{fmt.replace('/', '-')}_b{args.batch}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"| cache | requested ratio | device bytes held by the cache | dense / this | agreement with dense tokens |")
    print("| --- | --- | --- | --- | --- |")
    ref = rows[0]["tokens"]
    for r in rows:
        held = r["cache_bytes_allocated"]
        agree = sum(a == b for x, y in zip(ref, r["tokens"]) for a, b in zip(x, y)) / sum(len(x) for x in ref)
        print(f"| {r['cache']} | {r['requested_ratio']} | {held} | {dense_bytes / max(1, held):.2f} | {agree:.1%} |")


if __name__ == "__main__":
    main()
