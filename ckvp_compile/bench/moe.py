"""``ckvp-bench moe``: one MoE layer's routed experts, ckvp vs Inductor max-autotune vs Hugging Face, in one run.

    ckvp-bench moe [--shapes mixtral qwen2_moe olmoe] [--batches 1 8 64 512] [--systems ckvp inductor_grouped_mm
                   batched_mm eager] [--dtype bfloat16] [--budget-s 360] [--json OUT.json] [--out OUT.md]
                   [--device cuda] [--tiny]

Shapes (hidden Dm, expert FFN I, experts E, top-k A), bf16, random weights scaled by 1/sqrt(fan-in), random router
logits (softmax, top-k, renormalised), the same weights and routing for every system:

* ``mixtral``: Mixtral-8x7B, (4096, 14336, 8, 2);
* ``qwen2_moe``: Qwen1.5-MoE-A2.7B / Qwen2-MoE, (2048, 1408, 60, 4); its shared expert (a dense FFN with a
  sigmoid gate, 5632 wide) is outside the routed experts and not timed, as for every system;
* ``olmoe``: OLMoE-1B-7B, (2048, 1024, 64, 8).

Systems (the routed experts only; router, top-k and shared expert are outside):

* ``ckvp``: ``torch.ops.ckvp.moe_experts`` compiled by Inductor with ``mode="max-autotune-no-cudagraphs"``
  (its lowering: routing kernel + two autotuned grouped-GEMM templates, ckvp_compile/lowering/moe.py);
* ``inductor_grouped_mm``: transformers' ``grouped_mm`` experts (``aten._grouped_mm``) compiled the same way
  (Inductor autotunes its persistent grouped-GEMM template);
* ``batched_mm``: transformers' decode default on GPU (weights gathered per (token, slot); skipped when the
  gather exceeds ``--max-gather-gb``); ``eager``: transformers' loop over the experts hit (host syncs).

Timing: median of ``triton.testing.do_bench_cudagraph`` (CUDA-graph replay: no launch gaps, as in a
``reduce-overhead`` deployment; ``eager`` cannot be captured and uses ``do_bench``). Compile (and autotune) time
is measured separately, on the first call. Floor: the bytes of the distinct experts the routing touches
(3 x I x Dm x itemsize each), read once, over the device-to-device copy bandwidth measured at the start of the
run (read + write bytes / time): ``share of floor = floor_us / us``. Speedups are the other system's time over
ckvp's. rel err: ||out - ref|| / ||ref|| against an fp64 per-expert loop on the same inputs.

Time budget: rows run in order (shape, batch, system); once ``--budget-s`` seconds have passed, the remaining
rows are recorded as skipped (never silently dropped). Compiles use dynamic=False (one autotune per batch);
Inductor's local autotune cache makes a second run faster.

``--tiny`` runs the same code path on tiny shapes (CPU smoke test: Inductor on CPU, no timing claims);
``--device cpu`` requires it (a usage error, exit status 2, otherwise).
Source: the method of benchmarks/moe_gpu.py (H200 runs in benchmarks/results/2026-11-29-moe-h200).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .output import output_path_error, write_result

__all__ = ["SHAPES", "SYSTEMS", "main", "run"]

SHAPES = {  # name -> (Dm, I, E, A)
    "mixtral": (4096, 14336, 8, 2),
    "qwen2_moe": (2048, 1408, 60, 4),
    "olmoe": (2048, 1024, 64, 8),
}
TINY_SHAPES = {"mixtral": (64, 96, 8, 2), "qwen2_moe": (32, 48, 12, 4), "olmoe": (32, 32, 16, 8)}
SYSTEMS = ("ckvp", "inductor_grouped_mm", "batched_mm", "eager")


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


def copy_bandwidth(device: str, gib: float = 2.0) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), median of do_bench; 0 on CPU."""
    if device != "cuda":
        return 0.0
    from triton.testing import do_bench

    n = int(gib * 2**30) // 2
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    del src, dst
    return 2 * n * 2 / (ms * 1e-3)


def _routing(t: int, e: int, a: int, seed: int, device: str, dtype: torch.dtype):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(t, e, device=device, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), a, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True)).to(dtype)


def _time_us(fn: Callable[[], Any], device: str, graph: bool) -> float | None:
    """Median microseconds (CUDA-graph replay when ``graph``); None on CPU (no timing claims there)."""
    if device != "cuda":
        return None
    from triton.testing import do_bench, do_bench_cudagraph

    if graph:
        return do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
    return do_bench(fn, warmup=5, rep=50, return_mode="median") * 1e3


def run(shapes: Sequence[str], batches: Sequence[int], systems: Sequence[str], dtype: torch.dtype, device: str,
        budget_s: float, max_gather_gb: float = 8.0, tiny: bool = False, seed: int = 0,
        log: Callable[[str], None] = print, profile_calls: int = 0) -> dict:
    """Run the benchmark; return dict(versions, copy_bandwidth_tbs, rows) (rows: one per shape x batch x system).

    ``profile_calls`` > 0 (CUDA): after timing, profile that many more calls of each row with ``torch.profiler``
    and record the kernels by device time per call (row key ``profile_top``, as ``ckvp-bench decode``).

    Raises:
        ValueError: an unknown shape or system name.
    """
    import ckvp_compile
    from ckvp_compile.kernels.moe_reference import moe_experts_loop_ref
    from ckvp_compile.lowering import register_all

    bad = [s for s in shapes if s not in SHAPES] + [s for s in systems if s not in SYSTEMS]
    if bad:
        raise ValueError(f"unknown shape or system {bad}; shapes: {list(SHAPES)}, systems: {list(SYSTEMS)}")
    register_all()
    import transformers

    versions = dict(torch=torch.__version__, transformers=transformers.__version__,
                    ckvp_compile=ckvp_compile.__version__, python=platform.python_version(),
                    device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu")
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:  # pragma: no cover
        pass
    start = time.perf_counter()
    bw = copy_bandwidth(device)
    log(f"versions {versions}; copy bandwidth {bw / 1e12:.2f} TB/s")
    table = TINY_SHAPES if tiny else SHAPES
    rows: list[dict] = []
    for shape in shapes:
        dm, i, e, a = table[shape]
        g = torch.Generator(device=device).manual_seed(seed)
        gate_up = (torch.randn(e, 2 * i, dm, device=device, generator=g) / dm ** 0.5).to(dtype)
        down = (torch.randn(e, dm, i, device=device, generator=g) / i ** 0.5).to(dtype)
        w_gate, w_up = gate_up[:, :i], gate_up[:, i:]
        mods = {impl: hf_experts(impl, dm, i, e, a, gate_up, down) for impl in ("grouped_mm", "batched_mm", "eager")}
        for t in batches:
            x = torch.randn(t, dm, device=device, generator=g).to(dtype)
            ids, wts = _routing(t, e, a, seed + t, device, dtype)
            hit = int(torch.unique(ids).numel())
            floor_us = hit * 3 * i * dm * gate_up.element_size() / bw * 1e6 if bw else None
            ref = moe_experts_loop_ref(x, ids, wts, w_gate, w_up, down).double()
            base = dict(shape=shape, batch=t, dims=dict(Dm=dm, I=i, E=e, A=a), experts_hit=hit,
                        floor_us=round(floor_us, 1) if floor_us else None)
            for system in systems:
                row = dict(base, system=system)
                rows.append(row)
                if time.perf_counter() - start > budget_s:
                    row["skipped"] = f"time budget ({budget_s:.0f} s) spent"
                    continue
                fn: Callable[[], Any]
                if system == "ckvp":
                    torch._dynamo.reset()
                    op = torch.compile(lambda h, k, w: torch.ops.ckvp.moe_experts(h, k, w, w_gate, w_up, down),
                                       mode="max-autotune-no-cudagraphs", fullgraph=True, dynamic=False)
                    fn = lambda c=op: c(x, ids, wts)  # noqa: E731
                elif system == "inductor_grouped_mm":
                    torch._dynamo.reset()
                    comp = torch.compile(mods["grouped_mm"], mode="max-autotune-no-cudagraphs", fullgraph=True,
                                         dynamic=False)
                    fn = lambda c=comp: c(x, ids, wts)  # noqa: E731
                elif system == "batched_mm":
                    gather_gb = t * a * 3 * i * dm * gate_up.element_size() / 1e9
                    if gather_gb > max_gather_gb:
                        row["skipped"] = f"gathers {gather_gb:.0f} GB (> --max-gather-gb {max_gather_gb:g})"
                        continue
                    fn = lambda: mods["batched_mm"](x, ids, wts)  # noqa: E731
                else:
                    fn = lambda: mods["eager"](x, ids, wts)  # noqa: E731
                try:
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        out = fn()
                    if device == "cuda":
                        torch.cuda.synchronize()
                    row["first_call_s"] = round(time.perf_counter() - t0, 2)  # compile + autotune for compiled ones
                    row["rel_err"] = float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))
                    with torch.no_grad():
                        us = _time_us(fn, device, graph=system != "eager")
                except Exception as exc:  # noqa: BLE001 - record and go on: one failure must not lose the run
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    log(f"{shape} b={t} {system}: FAILED {row['error']}")
                    continue
                if profile_calls and device == "cuda":
                    from .decode import profile_kernels

                    with torch.no_grad():
                        row["profile_top"] = profile_kernels(lambda: fn(), [{}] * profile_calls, top=12)
                if us is not None:
                    row["us"] = round(us, 1)
                    row["timing"] = "cuda-graph replay" if system != "eager" else "launches"
                    if floor_us:
                        row["floor_share"] = round(floor_us / us, 3)
                log(json.dumps(row))
            if device == "cuda":
                torch.cuda.empty_cache()
        del mods, gate_up, down, w_gate, w_up
    for r in rows:  # speedups of ckvp over each other system, same shape and batch
        ck = next((c for c in rows if c["shape"] == r["shape"] and c["batch"] == r["batch"]
                   and c["system"] == "ckvp" and "us" in c), None)
        if ck is not None and "us" in r and r["system"] != "ckvp":
            r["ckvp_speedup"] = round(r["us"] / ck["us"], 2)
    return dict(versions=versions, copy_bandwidth_tbs=round(bw / 1e12, 3), elapsed_s=round(time.perf_counter() - start),
                floor="bytes of the distinct experts the routing touches (3*I*Dm*itemsize each), read once, over "
                      "the measured device-to-device copy bandwidth", rows=rows)


def to_markdown(result: dict, command: str) -> str:
    """The result as a markdown report (versions, command, floor definition, one table row per measurement)."""
    lines = [f"# ckvp-bench moe: one MoE layer's routed experts ({result['versions'].get('device')})", "",
             f"Command: `{command}`  ", f"Versions: {result['versions']}  ",
             f"Copy bandwidth: {result['copy_bandwidth_tbs']} TB/s; floor: {result['floor']}; run took "
             f"{result['elapsed_s']} s", "",
             "| shape | batch | system | us | share of floor | ckvp speedup | first call s | rel err | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        share = f"{100 * r['floor_share']:.0f}%" if "floor_share" in r else "-"
        note = r.get("skipped") or r.get("error") or r.get("timing", "")
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else "-"
        lines.append(f"| {r['shape']} | {r['batch']} | {r['system']} | {r.get('us', '-')} | {share} | "
                     f"{r.get('ckvp_speedup', '-')} | {r.get('first_call_s', '-')} | {err} | {note} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``ckvp-bench moe [args]``; returns the exit status (2 for a usage error)."""
    p = argparse.ArgumentParser(prog="ckvp-bench moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 512])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget-s", type=float, default=360.0, help="stop starting new rows after this many seconds")
    p.add_argument("--max-gather-gb", type=float, default=8.0, help="skip batched_mm above this gather size")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test; no timing on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile-calls", type=int, default=0,
                   help="CUDA: profile this many extra calls per row; JSON 'profile_top' = kernels by device time")
    p.add_argument("--json", type=Path, help="write the full result as JSON here")
    p.add_argument("--out", type=Path, help="write the markdown report here")
    args = p.parse_args(list(argv) if argv is not None else None)
    if any(b < 1 for b in args.batches):
        p.error(f"--batches must be >= 1, got {args.batches}")
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        p.error(f"--device {args.device!r}: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available (--device cpu --tiny runs the smoke test)")
    if device.type == "cpu" and not args.tiny:
        p.error("--device cpu needs --tiny: on CPU nothing is timed and the full expert shapes (e.g. OLMoE's 64 "
                "experts at batch 64) would run for minutes in GBs of memory. Fix: add --tiny for the CPU smoke "
                "test, or run with --device cuda on a GPU machine")
    if bad_path := output_path_error({"--json": args.json, "--out": args.out}):
        p.error(bad_path)
    command = "ckvp-bench moe " + " ".join(sys.argv[2:] if argv is None else argv)
    result = run(args.shapes, args.batches, args.systems, getattr(torch, args.dtype), args.device, args.budget_s,
                 args.max_gather_gb, args.tiny, args.seed, profile_calls=args.profile_calls)
    result["command"] = command
    write_result(result, to_markdown(result, command), args.json, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
