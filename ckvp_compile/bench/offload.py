"""``ckvp-bench offload``: expert offload with next-layer prefetch against on-demand fetching and all-resident.

    ckvp-bench offload --out DIR [--recall-only] [--model DIR] [--text FILE] [--layers 8] [--resident 2 4 6]
        [--batch 1 8] [--steps 16] [--budget-s 330]

Two parts, both written to ``DIR/offload.json`` and ``DIR/offload.md`` (with the exact command, torch / triton
versions and the GPU name):

* **recall** (CPU, about 20 s): the fixture model's real routing over windows of its held-out text
  (:func:`~ckvp_compile.runtime.prediction.capture_routing_trace`): top-k recall of the next layer's (and the one
  after's) experts for each predictor and margin, and the planner replayed token by token (batch-1 decoding) for
  every capacity, policy and prefetch setting: hit rate and expert copies per token (the policy choice).
* **speed** (CUDA only; skipped by ``--recall-only``): ``--layers`` Mixtral-8x7B-shaped MoE layers (RMSNorm, router
  softmax top-2, 8 SwiGLU experts of 4096 x 14336, bf16, random weights, residual), their experts in pinned host
  memory; batch 1 and 8 decode steps on i.i.d. random inputs (routing with no temporal locality: the hardest
  case for a cache), each mode in the same process on the same inputs: all experts resident
  (``ckvp::moe_experts``), the offloader with C of 8 resident and prefetch, and with on-demand fetching only.
  Tokens per second from CUDA events over ``--steps`` steps after warm-up, the offloader's statistics per token,
  the measured pinned copy bandwidth, and a GPU exactness check of the stream path against all-resident.

The layers are MoE layers only (no attention): the expert copies are what offloading adds, and a Mixtral
attention block at batch 1 is about 40 us of weights, small beside the 0.2 ms expert GEMM.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

__all__ = ["main", "recall_report", "speed_report"]

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-mixtral-pystdlib"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckvp-bench offload", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for offload.json and offload.md")
    p.add_argument("--recall-only", action="store_true", help="only the CPU recall / policy part")
    p.add_argument("--skip-recall", action="store_true", help="only the GPU speed part")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="HF MoE model directory (recall part)")
    p.add_argument("--text", default=None, help="held-out text file (default: MODEL/eval_text.txt); bytes = ids")
    p.add_argument("--windows", type=int, default=16, help="text windows for the recall part")
    p.add_argument("--window-len", type=int, default=256, help="tokens per window (the fixture trained on 512)")
    p.add_argument("--layers", type=int, default=8, help="Mixtral-shaped MoE layers in the speed part")
    p.add_argument("--resident", type=int, nargs="+", default=[2, 4, 6], help="experts resident per layer (of 8)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per configuration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=330.0, help="stop starting new configurations after this")
    p.add_argument("--dm", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    return p


# ---------------------------------------------------------------------------------------------------- recall


def recall_report(model_dir: str, text_path: str | None, windows: int, window_len: int) -> dict:
    """Measure next-layer prediction recall and replay the planner on the model's real routing (CPU).

    Returns:
        dict with ``recall`` rows (predictor, distance, margin, recall) and ``policy`` rows (capacity, policy,
        prefetch, margin, lookahead, hit_rate, demand / prefetch / wasted copies per token).
    Raises:
        CKVPModelLoadError: no model at ``model_dir``. ValueError: the text is shorter than the windows.
    """
    from ..runtime.prediction import capture_routing_trace, prediction_recall, replay_trace
    from ..testing.models import load_fixture_model

    model = load_fixture_model(model_dir)
    text_path = text_path or str(Path(model_dir) / "eval_text.txt")
    data = Path(text_path).read_bytes()
    stride = max(window_len, (len(data) - window_len) // max(1, windows))
    if len(data) < window_len * windows:
        raise ValueError(f"{text_path} has {len(data)} bytes, fewer than {windows} windows of {window_len}")
    wins = [torch.tensor([list(data[i * stride: i * stride + window_len])]) for i in range(windows)]
    trace = capture_routing_trace(model, wins, lookahead=2)
    recall = [dict(predictor=p, distance=d, margin=m, recall=prediction_recall(trace, p, d, m))
              for p in trace.ranked for d in (1, 2) for m in range(0, trace.num_experts - trace.top_k + 1)]
    policy = []
    for c in range(1, trace.num_experts):
        for pol in ("lru", "lfu"):
            for prefetch, margin, lookahead in ((False, 0, 1), (True, 0, 1), (True, 1, 1), (True, 0, 2)):
                s = replay_trace(trace, capacity=c, policy=pol, prefetch=prefetch, margin=margin, lookahead=lookahead)
                n = trace.tokens
                policy.append(dict(capacity=c, policy=pol, prefetch=prefetch, margin=margin, lookahead=lookahead,
                                   hit_rate=s.hit_rate, demand_per_token=s.misses / n,
                                   prefetch_per_token=s.prefetch_copies / n, wasted_per_token=s.prefetch_wasted / n,
                                   copies_per_token=(s.misses + s.prefetch_copies) / n))
    return dict(model=str(model_dir), text=str(text_path), windows=windows, window_len=window_len,
                tokens=trace.tokens, layers=trace.num_layers, experts=trace.num_experts, top_k=trace.top_k,
                recall=recall, policy=policy)


# ---------------------------------------------------------------------------------------------------- speed


class _Layers:
    """Mixtral-shaped MoE layers with random bf16 weights: device copies (all-resident) and pinned host copies."""

    def __init__(self, n: int, dm: int, ffn: int, e: int, device: torch.device) -> None:
        g = torch.Generator(device=device).manual_seed(0)
        self.norm = [1 + 0.1 * torch.randn(dm, device=device, generator=g) for _ in range(n)]
        self.router = [torch.randn(e, dm, device=device, generator=g) * dm ** -0.5 for _ in range(n)]
        self.gate_up, self.down, self.host_gate_up, self.host_down = [], [], [], []
        for _ in range(n):
            gu = (torch.randn(e, 2 * ffn, dm, device=device, generator=g) * dm ** -0.5).to(torch.bfloat16)
            dn = (torch.randn(e, dm, ffn, device=device, generator=g) * ffn ** -0.5).to(torch.bfloat16)
            self.gate_up.append(gu)
            self.down.append(dn)
            self.host_gate_up.append(torch.empty(gu.shape, dtype=gu.dtype, pin_memory=True).copy_(gu))
            self.host_down.append(torch.empty(dn.shape, dtype=dn.dtype, pin_memory=True).copy_(dn))
        self.norm = [w.to(torch.bfloat16) for w in self.norm]
        self.router = [w.to(torch.bfloat16) for w in self.router]
        self.ffn = ffn

    def predictors(self, lookahead: int = 1):
        from ..runtime.offload import fold_norm_predictor

        n = len(self.router)
        return [[fold_norm_predictor(self.router[j], self.norm[j], self.norm[l]) for j in range(l + 1, min(n, l + 1 + lookahead))]
                for l in range(n)]

    def step(self, x: torch.Tensor, top_k: int, offloader=None) -> torch.Tensor:
        """One decode step through every layer: (B, Dm) bf16 -> (B, Dm) bf16."""
        h = x
        for l in range(len(self.router)):
            var = h.float().pow(2).mean(-1, keepdim=True)
            y = (self.norm[l] * (h.float() * torch.rsqrt(var + 1e-5)).to(h.dtype))
            probs = torch.softmax((y @ self.router[l].T).float(), dim=-1)
            w, ids = probs.topk(top_k, dim=-1)
            w = w / w.sum(-1, keepdim=True)
            if offloader is None:
                gu = self.gate_up[l]
                out = torch.ops.ckvp.moe_experts(y, ids, w, gu[:, :self.ffn], gu[:, self.ffn:], self.down[l])
            else:
                out = offloader.forward(l, y, ids, w)
            h = h + out
        return h


def _time_steps(layers: _Layers, inputs: list[torch.Tensor], top_k: int, offloader, warmup: int) -> tuple[float, torch.Tensor]:
    for x in inputs[:warmup]:
        layers.step(x, top_k, offloader)
    torch.cuda.synchronize()
    if offloader is not None:
        offloader.reset_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    last = None
    for x in inputs[warmup:]:
        last = layers.step(x, top_k, offloader)
    end.record()
    end.synchronize()
    return start.elapsed_time(end), last


def speed_report(args: argparse.Namespace, log=print) -> dict:
    """Run the GPU part (see the module docstring). Raises RuntimeError without CUDA."""
    from ..ops import register_all
    from ..runtime.offload import ExpertOffloader

    if not torch.cuda.is_available():
        raise RuntimeError("the speed part of ckvp-bench offload needs a CUDA GPU (use --recall-only on CPU)")
    register_all()
    t0 = time.time()
    dev = torch.device("cuda")
    e, a = args.experts, args.top_k
    layers = _Layers(args.layers, args.dm, args.ffn, e, dev)
    torch.cuda.synchronize()
    expert_bytes = 3 * args.dm * args.ffn * 2
    log(f"[offload] {args.layers} layers built in {time.time() - t0:.1f} s; one expert {expert_bytes / 1e6:.0f} MB")
    # pinned H2D bandwidth, one expert on a side stream (what every miss costs)
    buf = torch.empty_like(layers.gate_up[0][0])
    s = torch.cuda.Stream()
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        with torch.cuda.stream(s):
            ev0.record(s)
            buf.copy_(layers.host_gate_up[0][1], non_blocking=True)
            ev1.record(s)
        ev1.synchronize()
        times.append(ev0.elapsed_time(ev1))
    gbps = buf.numel() * 2 / (min(times) / 1e3) / 1e9
    del buf
    log(f"[offload] pinned H2D {gbps:.1f} GB/s -> {expert_bytes / gbps / 1e6:.2f} ms per expert")
    rows, checks = [], []
    gen = torch.Generator(device=dev).manual_seed(1)
    for b in args.batch:
        inputs = [torch.randn(b, args.dm, device=dev, generator=gen).to(torch.bfloat16)
                  for _ in range(args.warmup + args.steps)]
        ms, ref_out = _time_steps(layers, inputs, a, None, args.warmup)
        rows.append(dict(batch=b, resident=e, mode="all_resident", ms_per_step=ms / args.steps,
                         tokens_per_s=b * args.steps / (ms / 1e3)))
        log(f"[offload] B={b} all resident: {rows[-1]['tokens_per_s']:.1f} tok/s")
        for c in list(args.resident) + [e]:
            for mode in (("prefetch", "on_demand") if c < e else ("offloader_all_resident",)):
                if time.time() - t0 > args.budget_s:
                    log(f"[offload] budget {args.budget_s} s reached: skipping B={b} C={c} {mode}")
                    continue
                off = ExpertOffloader(layers.host_gate_up, layers.host_down, resident=c, top_k=a, device=dev,
                                      predictors=layers.predictors(), prefetch=mode == "prefetch")
                ms, out = _time_steps(layers, inputs, a, off, args.warmup)
                st = off.stats()
                diff = (out.float() - ref_out.float()).abs().max().item()
                scale = ref_out.float().abs().max().item()
                checks.append(dict(batch=b, resident=c, mode=mode, bitwise_equal=bool(torch.equal(out, ref_out)),
                                   max_abs_diff=diff, max_abs_ref=scale))
                n_tok = args.steps  # decode steps (each step: b tokens)
                rows.append(dict(batch=b, resident=c, mode=mode, ms_per_step=ms / args.steps,
                                 tokens_per_s=b * args.steps / (ms / 1e3), hit_rate=st.hit_rate,
                                 demand_copies_per_step=st.misses / n_tok, prefetch_copies_per_step=st.prefetch_copies / n_tok,
                                 wasted_per_step=st.prefetch_wasted / n_tok, gb_copied_per_step=st.bytes_copied / n_tok / 1e9,
                                 stall_ms_per_step=st.stall_ms / n_tok, recall_topk=st.recall_topk,
                                 multi_round_calls=st.rounds, stats=st.to_dict()))
                log(f"[offload] B={b} C={c} {mode}: {rows[-1]['tokens_per_s']:.2f} tok/s, hit {st.hit_rate:.3f}, "
                    f"{rows[-1]['gb_copied_per_step']:.2f} GB/step, stall {rows[-1]['stall_ms_per_step']:.1f} ms/step, "
                    f"max|diff| {diff:.3g} (bitwise {checks[-1]['bitwise_equal']})")
                off.close()
                del off
                torch.cuda.empty_cache()
    speedups = []
    for b in args.batch:
        for c in args.resident:
            pf = [r for r in rows if r["batch"] == b and r["resident"] == c and r["mode"] == "prefetch"]
            od = [r for r in rows if r["batch"] == b and r["resident"] == c and r["mode"] == "on_demand"]
            if pf and od:
                speedups.append(dict(batch=b, resident=c, prefetch_over_on_demand=pf[0]["tokens_per_s"] / od[0]["tokens_per_s"]))
    return dict(layers=args.layers, dm=args.dm, ffn=args.ffn, experts=e, top_k=a, steps=args.steps, warmup=args.warmup,
                expert_bytes=expert_bytes, h2d_gb_per_s=gbps, ms_per_expert_copy=expert_bytes / gbps / 1e6,
                rows=rows, speedups=speedups, exactness=checks, seconds=time.time() - t0)


# ---------------------------------------------------------------------------------------------------- output


def _markdown(result: dict) -> str:
    env = result["environment"]
    out = [f"# ckvp-bench offload", "", f"Command: `{env['command']}`", "",
           f"torch {env['torch']}, triton {env['triton']}, Python {env['python']}, device: {env['device']}", ""]
    rec = result.get("recall")
    if rec:
        out += [f"## Prediction recall on {rec['model']} ({rec['tokens']} held-out tokens, {rec['windows']} windows of "
                f"{rec['window_len']}; L={rec['layers']}, E={rec['experts']}, A={rec['top_k']})", "",
                "| predictor | layers ahead | margin | recall of used experts |", "| --- | --- | --- | --- |"]
        out += [f"| {r['predictor']} | {r['distance']} | {r['margin']} | {r['recall']:.4f} |" for r in rec["recall"]]
        out += ["", "Planner replayed token by token (batch-1 decoding) on the same routing:", "",
                "| resident C | policy | prefetch | margin | lookahead | hit rate | demand copies/token | "
                "prefetch copies/token | wasted/token | all copies/token |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        out += [f"| {r['capacity']} | {r['policy']} | {r['prefetch']} | {r['margin']} | {r['lookahead']} | "
                f"{r['hit_rate']:.3f} | {r['demand_per_token']:.2f} | {r['prefetch_per_token']:.2f} | "
                f"{r['wasted_per_token']:.2f} | {r['copies_per_token']:.2f} |" for r in rec["policy"]]
    sp = result.get("speed")
    if sp:
        out += ["", f"## Speed: {sp['layers']} Mixtral-8x7B-shaped MoE layers (Dm {sp['dm']}, I {sp['ffn']}, "
                f"E {sp['experts']}, top-{sp['top_k']}, bf16, random weights, i.i.d. random inputs)", "",
                f"Pinned H2D {sp['h2d_gb_per_s']:.1f} GB/s: {sp['ms_per_expert_copy']:.2f} ms per expert "
                f"({sp['expert_bytes'] / 1e6:.0f} MB). {sp['steps']} timed steps after {sp['warmup']} warm-up.", "",
                "| batch | resident | mode | tokens/s | ms/step | hit rate | demand copies/step | prefetch copies/step "
                "| GB copied/step | stall ms/step | recall |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in sp["rows"]:
            f = lambda k, fmt: (format(r[k], fmt) if k in r else "")  # noqa: E731
            out.append(f"| {r['batch']} | {r['resident']} | {r['mode']} | {r['tokens_per_s']:.2f} | {r['ms_per_step']:.2f} | "
                       f"{f('hit_rate', '.3f')} | {f('demand_copies_per_step', '.2f')} | "
                       f"{f('prefetch_copies_per_step', '.2f')} | {f('gb_copied_per_step', '.2f')} | "
                       f"{f('stall_ms_per_step', '.1f')} | {f('recall_topk', '.3f')} |")
        out += ["", "| batch | resident | prefetch / on-demand tokens/s |", "| --- | --- | --- |"]
        out += [f"| {s['batch']} | {s['resident']} | {s['prefetch_over_on_demand']:.3f}x |" for s in sp["speedups"]]
        out += ["", "Exactness (final hidden state vs all-resident, same inputs):", "",
                "| batch | resident | mode | bitwise equal | max abs diff | max abs ref |", "| --- | --- | --- | --- | --- | --- |"]
        out += [f"| {c['batch']} | {c['resident']} | {c['mode']} | {c['bitwise_equal']} | {c['max_abs_diff']:.3g} | "
                f"{c['max_abs_ref']:.3g} |" for c in sp["exactness"]]
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ckvp-bench offload``; returns the exit status (2 for a usage error)."""
    args = _parser().parse_args(argv)
    if args.recall_only and args.skip_recall:
        sys.stderr.write("ckvp-bench offload: error: --recall-only and --skip-recall exclude each other\n")
        return 2
    if not args.recall_only and not torch.cuda.is_available():
        sys.stderr.write("ckvp-bench offload: error: the speed part needs CUDA; use --recall-only on a CPU machine\n")
        return 2
    for flag, n in (("--windows", args.windows), ("--window-len", args.window_len)):
        if n < 1:
            sys.stderr.write(f"ckvp-bench offload: error: {flag} must be >= 1, got {n}\n")
            return 2
    out_dir = Path(args.out)
    if out_dir.exists() and not out_dir.is_dir():
        sys.stderr.write(f"ckvp-bench offload: error: --out {args.out!r} is a file; --out names the directory for "
                         f"offload.json and offload.md\n")
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # pragma: no cover
        triton_version = "none"
    env = dict(command="ckvp-bench offload " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
               torch=torch.__version__, triton=triton_version, python=platform.python_version(),
               device=torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or platform.machine()})")
    result: dict = dict(environment=env)
    if not args.skip_recall:
        t = time.time()
        result["recall"] = recall_report(args.model, args.text, args.windows, args.window_len)
        print(f"[offload] recall part in {time.time() - t:.1f} s", flush=True)
    if not args.recall_only:
        result["speed"] = speed_report(args, log=lambda m: print(m, flush=True))
    (out_dir / "offload.json").write_text(json.dumps(result, indent=2, default=float))
    md = _markdown(result)
    (out_dir / "offload.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
