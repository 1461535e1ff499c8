"""One MoE layer's routed experts on the GPU: ckvp grouped GEMMs vs the Hugging Face implementations.

    python benchmarks/moe_gpu.py --out DIR [--shapes mixtral qwen2_moe olmoe] [--batches 1 8 64 512]
                                 [--impls ckvp grouped_mm_autotune grouped_mm batched_mm eager]

Implementations (same weights, same routing, bf16):

* ``ckvp``: ``torch.ops.ckvp.moe_experts`` (device-side routing + the Triton grouped GEMMs of
  ``ckvp_compile/kernels/grouped_gemm.py``), configs tuned once per shape before timing;
* ``ckvp_compiled``: ``torch.ops.ckvp.moe_experts_triton`` compiled by Inductor (default mode): the kernels are
  traced into Inductor's graph, with the configs lists' first entries (no tuning while tracing);
* ``grouped_mm_autotune``: transformers' ``grouped_mm`` experts (``aten._grouped_mm``) compiled by Inductor with
  ``mode="max-autotune-no-cudagraphs"``;
* ``grouped_mm``: the same, eager; ``batched_mm``: transformers' decode default on GPU (weights gathered per
  (token, slot); skipped when the gather would exceed ``--max-gather-gb``); ``eager``: transformers' loop over
  hit experts (host syncs; never CUDA-graphed).

Timing: median of ``triton.testing.do_bench_cudagraph`` (CUDA-graph replay: launch gaps removed, as in a
``reduce-overhead`` deployment) and of ``do_bench`` (plain launches); the weight-read floor is the bytes of the
experts the routing hits, read once, over the device-to-device copy bandwidth measured in the same run.
Correctness: every output against an fp64 per-expert loop (``kernels/moe_reference.py::moe_experts_loop_ref``),
relative error ||out - ref|| / ||ref||.

Writes DIR/moe.json and DIR/moe.md (versions, command, table).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

SHAPES = {  # name -> (Dm, I, E, A)
    "mixtral": (4096, 14336, 8, 2),
    "qwen2_moe": (2048, 1408, 60, 4),
    "olmoe": (2048, 1024, 64, 8),
}
IMPLS = ("ckvp", "ckvp_compiled", "grouped_mm_autotune", "grouped_mm", "batched_mm", "eager")


def hf_experts(impl: str, dm: int, i: int, e: int, a: int, gate_up: torch.Tensor, down: torch.Tensor):
    """transformers' MixtralExperts with the given weights and experts implementation (the baselines' code)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=dm, intermediate_size=i, num_local_experts=e, num_experts_per_tok=a)
    cfg._experts_implementation = impl
    with torch.device("meta"):
        mod = MixtralExperts(cfg)
    mod.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
    mod.down_proj = torch.nn.Parameter(down, requires_grad=False)
    return mod.eval()


def copy_bandwidth(gib: float = 4.0) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), median of do_bench."""
    from triton.testing import do_bench

    n = int(gib * 2**30) // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    del src, dst
    return 2 * n * 2 / (ms * 1e-3)


def routing(t: int, e: int, a: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(t, e, device="cuda", generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), a, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("out"))
    p.add_argument("--shapes", nargs="+", default=["mixtral"], choices=list(SHAPES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 512])
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--autotune-batches", nargs="+", type=int, default=None,
                   help="batches for grouped_mm_autotune (its autotuning costs ~25 s per shape); default all")
    p.add_argument("--compiled-batches", nargs="+", type=int, default=None,
                   help="batches for ckvp_compiled (an Inductor compile each); default all")
    p.add_argument("--max-gather-gb", type=float, default=40.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import transformers
    import triton
    from triton.testing import do_bench, do_bench_cudagraph

    import ckvp_compile
    from ckvp_compile import ops as ckvp_ops
    from ckvp_compile.kernels import grouped_gemm as gg
    from ckvp_compile.kernels.moe_reference import moe_experts_loop_ref

    ckvp_ops.register_all()
    versions = dict(torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
                    ckvp_compile=ckvp_compile.__version__, cuda=torch.version.cuda, python=platform.python_version(),
                    gpu=torch.cuda.get_device_name())
    bw = copy_bandwidth()
    print(f"versions {versions}\ncopy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for shape in args.shapes:
        dm, i, e, a = SHAPES[shape]
        g = torch.Generator(device="cuda").manual_seed(args.seed)
        gate_up = (torch.randn(e, 2 * i, dm, device="cuda", generator=g) / dm ** 0.5).to(torch.bfloat16)
        down = (torch.randn(e, dm, i, device="cuda", generator=g) / i ** 0.5).to(torch.bfloat16)
        w_gate, w_up = gate_up[:, :i], gate_up[:, i:]
        mods = {impl: hf_experts(impl, dm, i, e, a, gate_up, down) for impl in ("grouped_mm", "batched_mm", "eager")}
        for t in args.batches:
            x = torch.randn(t, dm, device="cuda", generator=g).to(torch.bfloat16)
            ids, wts = routing(t, e, a, args.seed + t)
            hit = int(torch.unique(ids).numel())
            floor_us = hit * 3 * i * dm * 2 / bw * 1e6
            ref = moe_experts_loop_ref(x, ids, wts, w_gate, w_up, down).double()
            fns = {}
            if "ckvp" in args.impls:
                fns["ckvp"] = lambda: torch.ops.ckvp.moe_experts(x, ids, wts, w_gate, w_up, down)
            if "ckvp_compiled" in args.impls and (args.compiled_batches is None or t in args.compiled_batches):
                op = torch.compile(lambda h, k, w: torch.ops.ckvp.moe_experts_triton(h, k, w, w_gate, w_up, down),
                                   fullgraph=True, dynamic=False)
                fns["ckvp_compiled"] = lambda c=op: c(x, ids, wts)
            if "grouped_mm" in args.impls:
                fns["grouped_mm"] = lambda: mods["grouped_mm"](x, ids, wts)
            if "grouped_mm_autotune" in args.impls and (args.autotune_batches is None or t in args.autotune_batches):
                compiled = torch.compile(mods["grouped_mm"], mode="max-autotune-no-cudagraphs", fullgraph=True,
                                         dynamic=False)
                fns["grouped_mm_autotune"] = lambda c=compiled: c(x, ids, wts)
            gather_gb = t * a * 3 * i * dm * 2 / 1e9
            if "batched_mm" in args.impls:
                if gather_gb <= args.max_gather_gb:
                    fns["batched_mm"] = lambda: mods["batched_mm"](x, ids, wts)
                else:
                    rows.append(dict(shape=shape, batch=t, impl="batched_mm", skipped=f"gathers {gather_gb:.0f} GB"))
            if "eager" in args.impls:
                fns["eager"] = lambda: mods["eager"](x, ids, wts)
            for impl, fn in fns.items():
                start = time.perf_counter()
                try:
                    out = fn()  # warm-up: compiles, tunes
                    torch.cuda.synchronize()
                    setup_s = time.perf_counter() - start
                    err = rel_err(out, ref)
                    us = do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3
                    graph_us = None
                    if impl != "eager":
                        graph_us = do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3
                except Exception as exc:  # noqa: BLE001 - record and go on: one failure must not lose the run
                    rows.append(dict(shape=shape, batch=t, impl=impl, error=f"{type(exc).__name__}: {exc}"[:300]))
                    print(f"{shape} b={t} {impl}: FAILED {exc}", flush=True)
                    continue
                best = min(v for v in (us, graph_us) if v is not None)
                row = dict(shape=shape, batch=t, impl=impl, us=round(us, 1),
                           graph_us=round(graph_us, 1) if graph_us is not None else None,
                           floor_us=round(floor_us, 1), floor_share=round(floor_us / best, 3),
                           rel_err=err, experts_hit=hit, setup_s=round(setup_s, 1))
                if impl == "ckvp":
                    row["configs"] = {k[0]: vars(v) for k, v in gg._TUNED.items() if k[1:4] == (e, i, dm)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
        del mods, gate_up, down, w_gate, w_up
        torch.cuda.empty_cache()

    result = dict(versions=versions, copy_bandwidth_tbs=round(bw / 1e12, 3), command=" ".join(sys.argv), rows=rows)
    (args.out / "moe.json").write_text(json.dumps(result, indent=1))
    lines = [f"# MoE layer, routed experts, bf16 ({versions['gpu']})", "",
             f"Command: `python {' '.join(sys.argv)}`  ", f"Versions: {versions}  ",
             f"Copy bandwidth (floor's denominator): {bw / 1e12:.2f} TB/s", "",
             "| shape | batch | impl | graph us | launch us | floor us | share of floor | rel err |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "us" not in r:
            why = r.get("skipped") or r.get("error")
            lines.append(f"| {r['shape']} | {r['batch']} | {r['impl']} | {why} | | | | |")
            continue
        lines.append(f"| {r['shape']} | {r['batch']} | {r['impl']} | {r['graph_us'] or '-'} | {r['us']} | "
                     f"{r['floor_us']} | {100 * r['floor_share']:.0f}% | {r['rel_err']:.1e} |")
    (args.out / "moe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
