"""Reliability on the GPU (issue 8): CUDA graphs with the latent cache, no host sync per decode step, no device
memory growth over 1000 decode steps, step time against eager, and what a context longer than the cache does.

    python benchmarks/reliability_gpu.py --out DIR            # H200: about 2-3 minutes
    python benchmarks/reliability_gpu.py --out DIR --device cpu --steps 20 --budget-s 300   # CPU smoke run

The fixture model (``models/tiny-mixtral-pystdlib``, bf16) with a ``CKVPStaticCache`` (calibrated bases, kv_ratio 4,
int8 latents in bf16), its forward compiled with ``torch.compile(backend="ckvp", mode="reduce-overhead")``
(Inductor + CUDA graph trees). Sections, each timed and recorded even when it fails:

1. ``eager_dense``: the eager model with a dense ``StaticCache``: greedy tokens and ms per decode step.
2. ``reduce_overhead``: prefill + warm-up, then ``--steps`` (1000) decode steps, of which every step after the
   warm-up runs under ``torch.cuda.set_sync_debug_mode("error")`` (any host synchronisation inside a decode step
   raises); checks: Inductor's ``cudagraph_skips`` counter is 0, no graph compiled during the measured steps,
   ``torch.cuda.memory_allocated()`` the same after the last step as after the warm-up (and the peak in between),
   the store tensors not reallocated, and the greedy tokens' agreement with ``eager_dense``. Step time = CUDA-event
   time of ``--time-steps`` consecutive steps / their number.
3. ``default_mode``: the same cache with ``backend="ckvp"`` without CUDA graphs (Inductor default): ms per step.
4. ``overflow``: in a child process, a tiny random model whose latent cache holds 8 slots is asked for a 10th
   token: records whether the child raised (and the message), crashed (device-side assert) or returned logits
   (silently wrong). Run last and isolated, because a device-side assert poisons the CUDA context.

Writes DIR/reliability_gpu.json and DIR/reliability_gpu.md (GPU name, torch / triton / transformers versions, the
exact command, each section's verdict). Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

OVERFLOW_CHILD = r"""
import sys, torch
from ckvp_compile.latent import calibrate
from ckvp_compile.latent.capture import hf_step_kwargs
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import build_hf_moe
dev = sys.argv[1]
model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16).to(dev)
bases = calibrate(model, [torch.randint(0, 256, (1, 12))], group_size=2, kv_ratio=1.0, progress=False)
cache = CKVPStaticCache(model.config, bases, max_cache_len=8, device=dev)
step = torch.compile(model, backend="ckvp", options={"compiler": "aot_eager"}, fullgraph=True)
with torch.no_grad():
    out = step(**hf_step_kwargs(model, torch.randint(0, 256, (1, 8), device=dev), cache, 0)).logits
    print("FILLED", flush=True)
    out = step(**hf_step_kwargs(model, out[:, -1:].argmax(-1), cache, 8)).logits
    if dev == "cuda":
        torch.cuda.synchronize()
    print("RETURNED finite=%s" % bool(torch.isfinite(out).all()), flush=True)
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=1000, help="decode steps in the memory / sync check")
    p.add_argument("--warmup", type=int, default=8, help="decode steps before the checks start")
    p.add_argument("--time-steps", type=int, default=200, help="decode steps timed per configuration")
    p.add_argument("--compare-tokens", type=int, default=48, help="greedy tokens compared with eager")
    p.add_argument("--kv-ratio", type=float, default=4.0)
    p.add_argument("--latent-format", default="int8")
    p.add_argument("--budget-s", type=float, default=170.0, help="skip later sections past this wall time")
    return p.parse_args(argv)


class Run:
    """Section bookkeeping: results, verdicts, time budget."""

    def __init__(self, args):
        self.args, self.t0, self.sections = args, time.perf_counter(), {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def section(self, name, fn):
        if self.elapsed() > self.args.budget_s:
            self.sections[name] = {"status": "skipped", "reason": f"time budget {self.args.budget_s:.0f} s spent"}
            return None
        start = time.perf_counter()
        try:
            res = fn()
            res.setdefault("status", "ok" if all(res.get("checks", {}).values()) else "FAILED")
        except Exception as exc:  # record and go on: the other sections still say something
            res = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        res["seconds"] = round(time.perf_counter() - start, 1)
        self.sections[name] = res
        print(f"[{self.elapsed():6.1f} s] {name}: {res['status']} "
              f"{json.dumps({k: v for k, v in res.items() if k not in ('traceback', 'tokens')})[:600]}", flush=True)
        return res


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from torch._dynamo.utils import counters
    from transformers import StaticCache

    import ckvp_compile
    from ckvp_compile.latent.capture import hf_step_kwargs
    from ckvp_compile.runtime.hf_cache import CKVPStaticCache
    from ckvp_compile.testing import FIXTURE_MODEL_DIR, load_fixture_model

    dev = args.device
    cuda = dev.startswith("cuda")
    run = Run(args)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = load_fixture_model(dtype=dtype).to(dev)
    text = (FIXTURE_MODEL_DIR / "eval_text.txt").read_bytes()
    samples = [torch.tensor([list(text[i:i + 256])]) for i in range(0, 8 * 256, 256)]
    prompt = torch.tensor([list(text[-300:-280])], device=dev)  # 20 held-out bytes
    cache_len = prompt.shape[1] + max(args.compare_tokens, args.warmup + args.steps) + args.time_steps + 8
    bases = ckvp_compile.calibrate(model, samples, group_size=4, kv_ratio=args.kv_ratio,
                                   latent_format=args.latent_format, cache_len=4096, dense_dtype=torch.bfloat16,
                                   latent_dtype=torch.bfloat16, progress=False)
    eager_forward = model.forward

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def mark_step():
        if cuda:
            torch.compiler.cudagraph_mark_step_begin()

    def decode(fwd, cache, n, *, start_token=None, start_pos=None, tokens=None, check_sync=False):
        """Greedy decode n steps from start_token at start_pos; returns the next token (device tensor)."""
        tok, pos = start_token, start_pos
        for _ in range(n):
            mark_step()
            if check_sync and cuda:
                torch.cuda.set_sync_debug_mode("error")
            try:
                logits = fwd(**hf_step_kwargs(model, tok, cache, pos)).logits
                tok = logits[:, -1:].argmax(-1)
            finally:
                if check_sync and cuda:
                    torch.cuda.set_sync_debug_mode("default")
            if tokens is not None:
                tokens.append(tok)
            pos += 1
        return tok, pos

    def timed(fwd, cache, tok, pos, n):
        sync()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        tok, pos = decode(fwd, cache, n, start_token=tok, start_pos=pos)
        if cuda:
            end.record()
        sync()
        ms = start.elapsed_time(end) / n if cuda else (time.perf_counter() - t) * 1e3 / n
        return ms, tok, pos

    def greedy(fwd, cache):
        with torch.no_grad():
            logits = fwd(**hf_step_kwargs(model, prompt, cache, 0)).logits
            tok, toks = logits[:, -1:].argmax(-1), []
            toks.append(tok)
            tok, pos = decode(fwd, cache, args.compare_tokens - 1, start_token=tok, start_pos=prompt.shape[1],
                              tokens=toks)
        return torch.cat(toks, 1)[0].tolist(), tok, pos

    eager_tokens: list[int] = []

    def eager_dense():
        cache = StaticCache(config=model.config, max_cache_len=cache_len)
        toks, tok, pos = greedy(eager_forward, cache)
        eager_tokens.extend(toks)
        with torch.no_grad():
            ms, _, _ = timed(eager_forward, cache, tok, pos, min(args.time_steps, cache_len - pos - 1))
        return {"ms_per_step": round(ms, 4), "tokens": toks}

    def latent_section(mode):
        def body():
            torch._dynamo.reset()
            counters.clear()
            cache = CKVPStaticCache(model.config, bases, max_cache_len=cache_len, device=dev, dtype=dtype,
                                    latent_format=args.latent_format, latent_dtype=torch.bfloat16)
            kw = {"mode": mode} if (cuda and mode != "default") else {}
            if not cuda:
                kw = {"options": {"compiler": "aot_eager"}}
            fwd = torch.compile(eager_forward, backend="ckvp", **kw)
            t = time.perf_counter()
            toks, tok, pos = greedy(fwd, cache)
            sync()
            first_s = time.perf_counter() - t
            agree = sum(a == b for a, b in zip(toks, eager_tokens))
            res = {"mode": mode, "first_generation_s_incl_compile": round(first_s, 1),
                   "greedy_agreement_with_eager_dense": f"{agree}/{len(toks)}", "tokens": toks}
            checks = {}
            with torch.no_grad():
                cache.reset()
                cache_pos = 0
                logits = fwd(**hf_step_kwargs(model, prompt, cache, 0)).logits
                tok, pos = logits[:, -1:].argmax(-1), prompt.shape[1]
                tok, pos = decode(fwd, cache, args.warmup, start_token=tok, start_pos=pos)
                if mode == "reduce-overhead" or not cuda:
                    sync()
                    graphs = counters["stats"]["unique_graphs"]
                    store_ptrs = [t.data_ptr() for t in (*cache.store.latent_k, *cache.store.latent_v,
                                                          cache.store.slot_pos)]
                    if cuda:
                        torch.cuda.reset_peak_memory_stats()
                        mem0 = torch.cuda.memory_allocated()
                    try:  # every step under set_sync_debug_mode('error'): a host synchronisation raises
                        tok, pos = decode(fwd, cache, args.steps, start_token=tok, start_pos=pos, check_sync=True)
                        checks["no_host_sync_in_decode_steps"] = True
                    except RuntimeError as exc:
                        if "synchroniz" not in str(exc):
                            raise
                        checks["no_host_sync_in_decode_steps"] = False
                        res["host_sync"] = f"{exc}"[:500]
                        res["host_sync_traceback"] = traceback.format_exc()[-3000:]  # which call synchronised
                        res["host_sync_at_step"] = pos
                        mark_step()  # finish the run without the sync check, for the memory numbers
                        tok, pos = decode(fwd, cache, args.steps - (pos - prompt.shape[1] - args.warmup),
                                          start_token=tok, start_pos=pos + 1)
                    sync()
                    checks["no_graph_compiled_during_decode"] = counters["stats"]["unique_graphs"] == graphs
                    checks["store_not_reallocated"] = store_ptrs == [
                        t.data_ptr() for t in (*cache.store.latent_k, *cache.store.latent_v, cache.store.slot_pos)]
                    res["decode_steps_checked"] = args.steps
                    res["graphs_compiled"] = counters["stats"]["unique_graphs"]
                    if cuda:
                        mem1, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
                        res.update(memory_allocated_after_warmup=mem0, memory_allocated_after_steps=mem1,
                                   peak_during_steps=peak, memory_growth_bytes=mem1 - mem0)
                        checks["no_device_memory_growth"] = mem1 == mem0
                    if cuda and mode == "reduce-overhead":
                        skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
                        res["cudagraph_skips"] = skips
                        checks["cuda_graphs_used"] = skips == 0
                    cache_pos = pos
                n = min(args.time_steps, cache_len - max(pos, cache_pos) - 1)
                if n > 0:
                    ms, _, _ = timed(fwd, cache, tok, pos, n)
                    res["ms_per_step"] = round(ms, 4)
                    eager_ms = run.sections.get("eager_dense", {}).get("ms_per_step")
                    if eager_ms:
                        res["speedup_vs_eager_dense"] = round(eager_ms / ms, 2)
            res["checks"] = checks
            return res
        return body

    def overflow():
        try:
            proc = subprocess.run([sys.executable, "-c", OVERFLOW_CHILD, dev], capture_output=True, text=True,
                                  timeout=max(30.0, args.budget_s + 60 - run.elapsed()), cwd=REPO)
        except subprocess.TimeoutExpired:
            return {"status": "skipped", "reason": "child timed out"}
        out, err = proc.stdout, proc.stderr
        tail = "\n".join(err.strip().splitlines()[-6:])
        if "FILLED" not in out:
            return {"status": "error", "error": "the child failed before the cache was full", "stderr_tail": tail}
        if "RETURNED" in out:
            verdict = "SILENT: logits returned for a token past the last slot"
        elif "device-side assert" in err or "CUDA error" in err:
            verdict = "device-side assert (the CUDA context is lost; the process must restart)"
        else:
            verdict = "raised"
        return {"verdict": verdict, "returncode": proc.returncode, "stderr_tail": tail,
                "checks": {"not_silent": "RETURNED" not in out}}

    run.section("eager_dense", eager_dense)
    run.section("reduce_overhead", latent_section("reduce-overhead"))
    run.section("default_mode", latent_section("default"))
    run.section("overflow", overflow)

    import transformers
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    env = {"gpu": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
           "torch": torch.__version__, "triton": triton_version, "transformers": transformers.__version__,
           "python": platform.python_version(), "command": " ".join([sys.executable, *sys.argv]),
           "total_seconds": round(run.elapsed(), 1), "args": {k: str(v) for k, v in vars(args).items()}}
    result = {"env": env, "sections": run.sections}
    (args.out / "reliability_gpu.json").write_text(json.dumps(result, indent=2))
    lines = ["# ckvp reliability on the GPU", "", *[f"- {k}: {v}" for k, v in env.items() if k != "args"], "",
             "| section | status | ms/step | details |", "| --- | --- | --- | --- |"]
    for name, res in run.sections.items():
        details = {k: v for k, v in res.items()
                   if k not in ("status", "ms_per_step", "traceback", "tokens", "seconds")}
        lines.append(f"| {name} | {res['status']} | {res.get('ms_per_step', '')} | "
                     f"{json.dumps(details)[:900].replace('|', '/')} |")
    (args.out / "reliability_gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["status"] in ("ok",) for r in run.sections.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
