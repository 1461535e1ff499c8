"""Per-sequence (online) bases on the GPU, pre- and post-RoPE keys: the decode kernels against the reference, and a
compiled model that runs them.

1. Op level (the check): ``latent_attention_triton`` with per-sequence bases (B, Hkv, D, R), every sequence its own
   orthonormal basis, against ``latent_attention_ref`` per sequence (fp32), at batch 8 and 32k context: post-RoPE
   (no tables; the lane pass at 16:16, the word pass at 32:8 ranks 32 and 64/32, the absorbed pass at 32:8 rank 16)
   and pre-RoPE (RoPE tables: the per-head kernels), each with the shared-basis call of the same latents beside it
   (relative error and the time of one call in CUDA-graph replay, ``bench.attention.graph_bench``).
2. Compiled model (a smoke run): a random-weight Mixtral-family model (bf16, head_dim 128, 4 layers) compiled with
   the ckvp backend over ``online_bases(..., key_space=...)``, a 512-token prefill then 16 decode steps with the
   Triton kernels and again with the reference op over the same tokens (the prefill on the reference both times,
   so both fit bitwise the same bases). Reported: which kernel the last decode call ran, the greedy tokens'
   agreement and the largest logit difference relative to the logits' RMS. Not a tolerance: a random MoE's top-k
   routing and the int4 rounding of every later token's latent turn the kernels' 1e-4 differences into large logit
   differences after a few layers and steps (the op-level rows are the numerics check).

    PYTHONPATH=. python3 benchmarks/online_bases_gpu.py --json out/online.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch


def _per_sequence(args: tuple, seed: int) -> tuple:
    """``make_inputs`` arguments with the (Hkv, D, R) bases replaced by (B, Hkv, D, R) ones, one orthonormal basis
    per sequence (same scaling as the shared ones)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b = args[0].shape[0]
    a = list(args)
    for i in (3, 4):
        hkv, d, r = args[i].shape
        p = torch.linalg.qr(torch.randn(b, hkv, d, r, device="cuda", generator=gen)).Q
        a[i] = (p * math.sqrt(0.5)).to(torch.bfloat16).contiguous()
    return tuple(a)


def _reference(args: tuple) -> torch.Tensor:
    """``latent_attention_ref`` one sequence at a time (every per-sequence tensor and basis sliced)."""
    from ckvp_compile.kernels import reference as ref

    outs = []
    for i in range(args[0].shape[0]):
        a = list(args)
        for k in (0, 1, 2, 9, 12, 13) + ((3, 4) if args[3].dim() == 4 else ()):
            a[k] = args[k][i:i + 1]
        outs.append(ref.latent_attention_ref(*a))
    return torch.cat(outs)


def op_checks(b: int, t: int) -> list[dict]:
    from ckvp_compile.bench.attention import graph_bench, make_inputs, rel_err
    from ckvp_compile.kernels import latent_attention_triton as lat

    rows = []
    cases = (((16, 16), 32, 32, "none", "lanes"), ((16, 16), 64, 64, "none", "lanes"),
             ((32, 8), 32, 32, "none", "words"), ((32, 8), 64, 32, "none", "words"),
             ((32, 8), 16, 16, "none", "absorbed"), ((32, 8), 32, 32, "rotate_half", "per-head"),
             ((16, 16), 32, 32, "rotate_half", "per-head"))
    for heads, rk, rv, rope, want in cases:
        shared = make_inputs(b, t, "int4/32", rk, seed=1, heads=heads, group=1, rank_v=rv, rope=rope)
        online = _per_sequence(shared, seed=2)
        row = dict(heads=f"{heads[0]}:{heads[1]}", rank_k=rk, rank_v=rv, rope=rope, batch=b, context=t,
                   latent_format="int4/32", want=want)
        for name, args in (("shared", shared), ("online", online)):
            out = lat.latent_attention_triton(*args)
            launch = dict(lat._LAST_LAUNCH)
            kernel = ("words" if launch.get("words") else "lanes" if launch.get("lanes") else
                      "absorbed" if launch.get("absorbed") else "per-head")
            row[f"{name}_rel_err"] = rel_err(out, _reference(args))
            row[f"{name}_kernel"] = kernel
            row[f"{name}_ms"] = graph_bench(lambda: lat.latent_attention_triton(*args), rep=30)
            del out
        row["ok"] = row["online_rel_err"] <= 1e-3 and row["online_kernel"] == want == row["shared_kernel"]
        rows.append(row)
        print("op", json.dumps(row), flush=True)
        del shared, online
        torch.cuda.empty_cache()
    return rows


def _decode(model, ids, cache, steps: int, feed: list | None, decode_triton: bool):
    from ckvp_compile import ckvp_backend  # the backend="ckvp" entry point's function (works from the tree too)
    from ckvp_compile.latent.capture import hf_step_kwargs
    from ckvp_compile.ops import latent_attention_cuda

    step = torch.compile(model, backend=ckvp_backend, fullgraph=True)
    logits, tokens = [], []
    with torch.no_grad():
        latent_attention_cuda.USE_TRITON = False  # the same prefill both times: bitwise the same fitted bases
        out = step(**hf_step_kwargs(model, ids, cache, 0)).logits[:, -1]
        latent_attention_cuda.USE_TRITON = decode_triton
        for i in range(steps):
            tok = out.argmax(-1, keepdim=True) if feed is None else feed[i]
            tokens.append(tok)
            out = step(**hf_step_kwargs(model, tok, cache, ids.shape[1] + i)).logits[:, -1]
            logits.append(out.float())
    latent_attention_cuda.USE_TRITON = True
    return logits, tokens


def model_runs(batch: int, prompt: int, steps: int, layers: int) -> list[dict]:
    from ckvp_compile.kernels import latent_attention_triton as lat
    from ckvp_compile.latent import online_bases
    from ckvp_compile.runtime.hf_cache import CKVPStaticCache
    from ckvp_compile.testing import build_hf_moe

    rows = []
    for heads, kv_heads in ((16, 16), (32, 8)):
        model = build_hf_moe("mixtral", num_layers=layers, hidden=1024, num_heads=heads, num_kv_heads=kv_heads,
                             head_dim=128, num_experts=4, top_k=2, ffn=512, dtype=torch.bfloat16,
                             max_position_embeddings=prompt + steps + 8).cuda()
        ids = torch.randint(0, 256, (batch, prompt), generator=torch.Generator().manual_seed(0)).cuda()
        for space in ("pre_rope", "post_rope"):
            bases = online_bases(model, group_size=1, kv_ratio=4.0, key_space=space)
            res, launch = {}, {}
            for use in (True, False):
                torch._dynamo.reset()
                lat._LAST_LAUNCH.clear()
                cache = CKVPStaticCache(model.config, bases, max_cache_len=prompt + steps + 8, max_batch_size=batch,
                                        device="cuda", dtype=torch.bfloat16, latent_format="int4/32")
                res[use] = _decode(model, ids, cache, steps, None if use else res[True][1], use)
                if use:
                    launch = {k: v for k, v in lat._LAST_LAUNCH.items() if isinstance(v, (int, bool, float))}
            torch._dynamo.reset()
            tri, ref = res[True][0], res[False][0]
            row = dict(heads=f"{heads}:{kv_heads}", key_space=space, kv_ratio=4.0, latent_format="int4/32",
                       key_rank=bases.k_ranks[0][0],
                       kernel=("words" if launch.get("words") else "lanes" if launch.get("lanes") else
                               "absorbed" if launch.get("absorbed") else "per-head"),
                       finite=all(bool(torch.isfinite(x).all()) for x in tri),
                       argmax_agreement=sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(tri, ref))
                       / (steps * batch),
                       max_rel_logit_diff=max(float((a - b).abs().max() / b.pow(2).mean().sqrt())
                                              for a, b in zip(tri, ref)))
            rows.append(row)
            print("model", json.dumps(row), flush=True)
        del model
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--skip-model", action="store_true", help="only the op-level checks")
    args = p.parse_args(argv)

    import triton
    import transformers

    ops = op_checks(args.batch, args.context)
    models = [] if args.skip_model else model_runs(4, 512, 16, 4)
    ok = all(r["ok"] for r in ops) and all(r["finite"] for r in models)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__,
                command="python3 benchmarks/online_bases_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv))
    with open(args.json, "w") as f:
        json.dump(dict(meta=meta, ops=ops, models=models, ok=ok), f, indent=1)
    print("ok" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
