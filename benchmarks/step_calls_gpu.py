"""Replay each latent attention call of a real decode step in isolation: where a step's attention time goes.

A compiled model's decode step calls ``latent_attention_triton`` once per layer with what the model and its cache
hold: per-head ranks from the calibration (often unequal within a layer), the static cache's whole length as
``kv_len`` and HF's attention mask over it. The per-call sweeps (``config_sweep_gpu.py``) time synthetic calls
with equal ranks and no mask. This script records the step's own calls (the decode bench's model, cache and
compiled step: ``ckvp-bench decode``'s arguments) and times each one, CUDA-graph replays, as recorded and in
variants that isolate one difference each:

- ``as recorded``: the call as the step made it;
- ``no mask``: the same call without the attention mask (slots past the current token are then attended: the
  time only, not the output, is comparable);
- ``trimmed``: ``kv_len`` cut to the current token's slot + 1 and the mask sliced to it (the same output);
- ``trimmed, no mask``: both (the same output: the mask only removed slots past the current token);
- ``bases bf16`` / ``tables bf16`` / ``latents contiguous`` / ``q contiguous``: that input replaced by a
  contiguous bf16 copy, as the synthetic sweeps pass it (only where the recorded one differs).

Per call and variant: ms, each kernel's device time (``torch.profiler``), the launcher's choices
(``_LAST_LAUNCH``), and the output's relative difference to the recorded call's.

    python3 benchmarks/step_calls_gpu.py --out DIR -- --shape qwen-moe-a2.7b --group-size 1 --batch 8 \
        --context 32768 --systems ckvp-16:reduce-overhead

Everything after ``--`` is ``ckvp-bench decode``'s command line (one ckvp system, one batch, one context).
Writes DIR/step_calls.json (GPU, torch, Triton versions, the command) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ckvp_compile.bench import decode as dec  # noqa: E402
from ckvp_compile.bench.attention import graph_bench, kernel_times  # noqa: E402
from ckvp_compile.kernels import latent_attention_triton as lat  # noqa: E402
from ckvp_compile.ops import latent_attention_cuda as cuda_op  # noqa: E402

MASK, KV_LEN = 15, 17  # positions of attn_mask and kv_len in latent_attention_triton's arguments
CLONED = (0, 12, 13, 14, 15)  # q, new_k, new_v, slots, attn_mask: the step's intermediates


def record_calls(decode_argv: list[str]) -> tuple[list[tuple], dict]:
    """Run the decode bench's row with ``latent_attention_triton`` wrapped; return the arguments of the last eager
    step's calls, one per layer (the step's graph intermediates cloned: query, new keys / values, exact slots,
    mask; the cache's latents, tables and bases by reference). The first step compiles (its autotuning may call
    the op with other inputs) and then runs eagerly (CUDA-graph trees' warm-up); later steps replay graphs and
    never enter Python, so the last recorded calls are that eager step's."""
    p = dec._parser()
    a = p.parse_args(decode_argv)
    dec._check(p, a)
    a.argv = decode_argv
    a.steps, a.warmup, a.profile_steps = 2, 2, 0
    runner = dec._Runner(a)
    system = next(s for s in (dec.parse_system(x) for x in a.systems) if s.kind == "ckvp")
    calls: collections.deque = collections.deque(maxlen=512)
    inner = cuda_op.latent_attention_triton

    def wrapped(*args, **kw):
        if not torch.cuda.is_current_stream_capturing():
            calls.append((tuple(t.clone() if i in CLONED and torch.is_tensor(t) else t for i, t in enumerate(args)),
                          dict(kw)))
        return inner(*args, **kw)

    cuda_op.latent_attention_triton = wrapped
    try:
        row = runner.run_row(system, int(a.batches[0]), a.contexts[0])
    finally:
        cuda_op.latent_attention_triton = inner
    n = runner.layers  # one call per decoder layer (a latent group of G layers serves G calls)
    return list(calls)[-n:] if row.status == "ok" else [], {
        "row_status": row.status, "row_error": row.error, "ms_per_step": row.ms_median, "ranks": row.ranks,
        "system": row.system, "batch": row.batch, "context": row.context, "calls_seen": len(calls),
        "env": runner.env}


def describe(args: tuple) -> dict[str, str]:
    """dtype, shape and strides of each tensor argument (and the data pointer's alignment)."""
    names = ["q", "latent_k", "latent_v", "basis_k", "basis_v", "k_offsets", "v_offsets", "cos", "sin", "slot_pos",
             "rope_form", "rotary_dim", "new_k", "new_v", "slots", "attn_mask", "scale", "kv_len", "k_fmt", "v_fmt"]
    return {n: (f"{str(t.dtype)[6:]} {tuple(t.shape)} stride {t.stride()} ptr%256={t.data_ptr() % 256}"
                if torch.is_tensor(t) else repr(t)[:80]) for n, t in zip(names, args)}


def swaps(args: tuple) -> dict[str, tuple]:
    """One input at a time replaced by a contiguous bf16 copy, as the synthetic sweeps pass it: bases, RoPE tables
    (declared paired again when the originals were), latents, query."""
    out = {}
    bk, bv = args[3], args[4]
    if bk.dtype != torch.bfloat16 or not bk.is_contiguous() or bv.dtype != torch.bfloat16 or not bv.is_contiguous():
        out["bases bf16"] = args[:3] + (bk.to(torch.bfloat16).contiguous(), bv.to(torch.bfloat16).contiguous()) \
            + args[5:]
    cos, sin = args[7], args[8]
    if cos.dtype != torch.bfloat16 or not cos.is_contiguous() or sin.dtype != torch.bfloat16 or not sin.is_contiguous():
        c2, s2 = cos.to(torch.bfloat16).contiguous(), sin.to(torch.bfloat16).contiguous()
        if lat.paired_tables_declared(cos, sin):
            lat.declare_paired_tables(c2, s2)
        out["tables bf16"] = args[:7] + (c2, s2) + args[9:]
    if not (args[1].is_contiguous() and args[2].is_contiguous()):
        out["latents contiguous"] = args[:1] + (args[1].contiguous(), args[2].contiguous()) + args[3:]
    if not args[0].is_contiguous():
        out["q contiguous"] = (args[0].contiguous(),) + args[1:]
    return out


def variants(args: tuple, current_slot: int) -> dict[str, tuple]:
    out = {"as recorded": args, **swaps(args)}
    mask = args[MASK]
    if mask is not None:
        out["no mask"] = args[:MASK] + (None,) + args[MASK + 1:]
    kv = current_slot + 1
    if kv < args[KV_LEN]:
        trimmed = list(args)
        trimmed[KV_LEN] = kv
        if mask is not None:
            trimmed[MASK] = mask[..., :kv].contiguous()
        out["trimmed"] = tuple(trimmed)
        if mask is not None:
            trimmed[MASK] = None
            out["trimmed, no mask"] = tuple(trimmed)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rep", type=int, default=40)
    ap.add_argument("--only", default=None, help="comma-separated call (layer) indices to replay (default: all)")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    decode_argv = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    calls, meta = record_calls(decode_argv)
    print(f"recorded {len(calls)} calls in {time.perf_counter() - t0:.0f} s; step {meta['ms_per_step']} ms")
    rows = []
    only = None if a.only is None else {int(x) for x in a.only.split(",")}
    for i, (args, kw) in enumerate(calls):
        if only is not None and i not in only:
            continue
        slots = args[14]
        current = int(slots.max().item())
        k_ranks = [b - a for a, b in zip(args[5][:-1], args[5][1:])]
        v_ranks = [b - a for a, b in zip(args[6][:-1], args[6][1:])]
        ref = None
        for name, v in variants(args, current).items():
            call = (lambda v=v: lat.latent_attention_triton(*v, **kw))  # noqa: E731
            try:
                out = call()
                torch.cuda.synchronize()
                launch = {k: (v2 if isinstance(v2, (int, float, bool, str)) else str(v2))
                          for k, v2 in lat._LAST_LAUNCH.items() if k in ("head_group", "n_split", "rot_basis",
                                                                          "batch_slices", "key_fp16")}
                if ref is None:
                    ref = out.float()
                diff = float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))
                ms = graph_bench(call, rep=a.rep)
                kt = kernel_times(call)
                row = {"call": i, "variant": name, "ms": ms, "args": describe(v), "kernels_us": kt,
                       "rel_diff_to_recorded": diff, "kv_len": v[KV_LEN], "mask": None if v[MASK] is None else
                       f"{tuple(v[MASK].shape)} {v[MASK].dtype}", "k_ranks": k_ranks, "v_ranks": v_ranks,
                       "k_fmt": v[18], "v_fmt": v[19], "batch": int(v[0].shape[0]), "launch": launch}
            except Exception as e:  # noqa: BLE001 - reported in the row
                row = {"call": i, "variant": name, "error": repr(e)[:300]}
            rows.append(row)
            keys = ("call", "variant", "ms", "kernels_us", "rel_diff_to_recorded", "kv_len", "launch", "error")
            print(json.dumps({k: row.get(k) for k in keys + (("args",) if name == "as recorded" else ())}),
                  flush=True)
    env = meta.pop("env", {})
    payload = {"command": "python3 " + " ".join(sys.argv), "env": env, "meta": meta, "rows": rows,
               "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": __import__("triton").__version__}
    with open(os.path.join(a.out, "step_calls.json"), "w") as f:
        json.dump(payload, f, indent=1, default=str)
    print(summarize(rows))
    return 0


def summarize(rows: list[dict]) -> str:
    """Markdown: one line per call, ms per variant, the kernels of the recorded call."""
    by_call: dict[int, dict] = {}
    for r in rows:
        by_call.setdefault(r["call"], {})[r["variant"]] = r
    names = ["as recorded", "no mask", "trimmed", "trimmed, no mask", "bases bf16", "tables bf16",
             "latents contiguous", "q contiguous"]
    lines = ["| call | key ranks | value ranks | " + " | ".join(names) + " | kernels (us, as recorded) |",
             "| --- | --- | --- | " + " | ".join("---" for _ in names) + " | --- |"]
    for i, vs in sorted(by_call.items()):
        rec = vs.get("as recorded", {})
        span = lambda rs: f"{min(rs)}-{max(rs)}" if rs and min(rs) != max(rs) else str(rs[0] if rs else "")  # noqa
        cells = [f"{vs[n]['ms']:.3f}" if n in vs and "ms" in vs[n] else "" for n in names]
        kern = ", ".join(f"{k.split('(')[0][-28:]} {v}" for k, v in (rec.get("kernels_us") or {}).items())
        lines.append(f"| {i} | {span(rec.get('k_ranks', []))} | {span(rec.get('v_ranks', []))} | "
                     + " | ".join(cells) + f" | {kern} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
