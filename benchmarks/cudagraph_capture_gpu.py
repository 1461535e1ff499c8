"""Capture ONE compiled decode step of the fixture in a CUDA graph and, op by op, name what breaks the capture.

    python benchmarks/cudagraph_capture_gpu.py --out DIR                 # H200: about 1-2 minutes
    python benchmarks/cudagraph_capture_gpu.py --out DIR --device cpu    # CPU smoke run of the plumbing (no capture)

The setup of ``benchmarks/reliability_gpu.py`` (section ``reduce_overhead``): the fixture model in bf16, a
``CKVPStaticCache`` (calibrated bases, kv_ratio 4, int8 latents in bf16, G = 4), its forward compiled with
``torch.compile(backend="ckvp", mode="reduce-overhead")`` (Inductor, CUDA-graph trees), with
``CUDA_LAUNCH_BLOCKING=1`` (set before CUDA starts; ``--no-launch-blocking`` to leave it) so that a failing launch
raises where it happens. Steps, each preceded by ``torch.compiler.cudagraph_mark_step_begin()`` and run under
``torch.cuda.set_sync_debug_mode('warn')`` (the warnings are recorded with the calling line):

1. ``prefill`` (20 tokens): the prefill graph's warm-up;
2. ``decode_1``: the decode graph's warm-up;
3. ``decode_2``, ...: the decode graph is recorded (stream capture), then replayed; decode steps run until one
   replays (no ckvp op's Python launcher runs in it) or fails, at most ``--max-decode`` of them;
4. when the decode graph replayed: ``cache.reset()`` and ``prefill_2``, ``prefill_3``: the prefill graph is
   recorded, then replayed (as ``reliability_gpu.py`` does next).

Every ckvp op's kernel is wrapped (``register_kernel`` for the device, restored at the end) to count its
launches per step (and those made while the stream captures), to record, per op and step, the capture-unsafe
Python calls its code makes (:class:`ckvp_compile.testing.capture_safety.CaptureHazards`: host syncs, host data,
device transfers; in the recorded step these are the culprits), and in steps 1-2 to keep a host copy of its
arguments.

Per op (``--per-op always``, the default, or ``on-failure``): each recorded call of steps 1-2 alone, on fresh
device copies of its arguments: one eager call on a side stream (sync warnings and hazards recorded), then a
``torch.cuda.graph`` capture (``capture_error_mode="thread_local"``, as CUDA-graph trees) on *other* fresh copies
(Inductor passes new buffers each call; a cache keyed on tensor identity misses there), then one replay. A failing
capture prints the op, its call and the traceback. A trivial control capture runs first; if it fails with
``CUDA_LAUNCH_BLOCKING=1`` the script restarts itself without it.

Writes DIR/cudagraph_capture_gpu.json and DIR/cudagraph_capture_gpu.md (GPU, versions, command, each step, each
op). Exit status 0 when the decode and prefill graphs were captured and replayed and every op captured alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--cache-len", type=int, default=320, help="max_cache_len (not equal to a model dim: 64, 256)")
    p.add_argument("--kv-ratio", type=float, default=4.0)
    p.add_argument("--latent-format", default="int8")
    p.add_argument("--per-op", choices=("always", "on-failure", "never"), default="always")
    p.add_argument("--no-launch-blocking", action="store_true", help="leave CUDA_LAUNCH_BLOCKING unset")
    p.add_argument("--budget-s", type=float, default=110.0, help="skip the per-op phase past this wall time")
    p.add_argument("--max-decode", type=int, default=5, help="decode steps at most (warm-up, record, replay, ...)")
    return p.parse_args(argv)


ARGS = parse_args()
if ARGS.device.startswith("cuda") and not ARGS.no_launch_blocking:
    os.environ.setdefault("CUDA_LAUNCH_BLOCKING", "1")  # before CUDA is initialised

import torch  # noqa: E402

T0 = time.perf_counter()
#: host-only branches (CPU smoke run only): the slot and position range checks and the quantizers' value checks
HOST_ONLY = ("latent_kv.py:_check_slot_values", "latent_kv.py:_check_position_values", "latent_format.py:quantize_latent_ref",
             "latent_quant_triton.py:quantize_latent_triton")


def elapsed() -> float:
    return round(time.perf_counter() - T0, 1)


def short_tb(exc: BaseException, keep: int = 4000) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-keep:]


def ckvp_frame(exc: BaseException) -> str:
    """The innermost frame inside ckvp_compile of the exception or of those it was raised while handling (a failed
    capture surfaces as capture_end's error, raised while handling the op's own), as 'file:line function', or ''."""
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        for fr in reversed(traceback.extract_tb(exc.__traceback__)):
            if "ckvp_compile" in fr.filename:
                return f"{fr.filename.split('ckvp_compile', 1)[1].lstrip('/')}:{fr.lineno} {fr.name}"
        exc = exc.__cause__ or exc.__context__
    return ""


class SyncWarnings:
    """``torch.cuda.set_sync_debug_mode('warn')`` on CUDA, with the warnings recorded (message, file:line)."""

    def __init__(self, cuda: bool):
        self.cuda, self.items = cuda, []

    def __enter__(self):
        self._cm = warnings.catch_warnings(record=True)
        self._rec = self._cm.__enter__()
        warnings.simplefilter("always")
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
        self.items = [f"{str(w.message).splitlines()[0][:200]} @ {w.filename}:{w.lineno}" for w in self._rec
                      if "synchroniz" in str(w.message) and w.filename != __file__]  # not this script's copies
        self._cm.__exit__(*exc)
        return False


# ------------------------------------------------------------------------------------------- argument copies


def snap(x):
    """A host copy of an op argument (tensors keep size, stride and dtype; broadcast dims stay broadcast)."""
    if isinstance(x, torch.Tensor):
        expand = [i for i, (n, s) in enumerate(zip(x.shape, x.stride())) if s == 0 and n > 1]
        base = x.detach()
        for i in expand:
            base = base.narrow(i, 0, 1)
        return {"tensor": base.to("cpu", copy=True), "stride": tuple(base.stride()), "size": tuple(x.shape),
                "device": str(x.device)}
    if isinstance(x, (list, tuple)):
        return type(x)(snap(i) for i in x)
    return x


def restore(x, device):
    """A fresh device tensor (new storage, the recorded strides) from :func:`snap`'s copy."""
    if isinstance(x, dict) and "tensor" in x:
        cpu = x["tensor"]
        try:
            t = torch.empty_strided(cpu.shape, x["stride"], dtype=cpu.dtype, device=device).copy_(cpu)
        except RuntimeError:  # an overlapping layout: a contiguous copy
            t = cpu.to(device)
        return t.expand(x["size"]) if tuple(t.shape) != tuple(x["size"]) else t
    if isinstance(x, (list, tuple)):
        return type(x)(restore(i, device) for i in x)
    return x


def describe(x, top: bool = True):
    """A short text of a :func:`snap` copy: tensors as (size) dtype, lists of ints as they are."""
    if isinstance(x, dict) and "tensor" in x:
        return f"{tuple(x['size'])} {str(x['tensor'].dtype).replace('torch.', '')}"
    if isinstance(x, (list, tuple)):
        if not top and len(x) > 8:
            return f"[{len(x)} items]"
        return "[" + ", ".join(describe(i, False) for i in x) + "]"
    return repr(x)[:40]


# ------------------------------------------------------------------------------------------- op wrappers


class OpSpy:
    """Wraps every ckvp op's kernel for ``device_type``: counts launches per step, records capture hazards per
    (step, op), and keeps host copies of the arguments while ``keep_args``."""

    def __init__(self, device_type: str):
        from ckvp_compile import ops
        from ckvp_compile.testing.capture_safety import CaptureHazards

        ops.register_all()
        from ckvp_compile.ops import latent_attention_parts, latent_kv, moe, offload

        self.device_type, self.CaptureHazards = device_type, CaptureHazards
        # on CPU the host-only branches run (slot range check, quantizer value check); on CUDA they do not, and
        # anything recorded there is reported
        self.allow = () if device_type == "cuda" else HOST_ONLY
        self.step, self.keep_args = "", False
        self.counts: dict[str, dict[str, int]] = {}
        self.capturing: dict[str, int] = {}  # step -> launches made while the stream was capturing
        self.hazards: dict[str, dict[str, dict[str, int]]] = {}  # step -> op -> hazard -> calls
        self.calls: list[dict] = []  # recorded calls: step, op, args (host copies)
        self.originals: dict[str, tuple] = {}
        for mod in (latent_kv, latent_attention_parts, moe, offload):
            for name, op in mod.OPS.items():
                if name == "moe_experts_triton":  # a triton_op: Inductor traces its body, no kernel to wrap
                    continue
                fns = getattr(op, "_backend_fns", None)
                if fns is None:
                    raise RuntimeError("torch.library CustomOpDef has no _backend_fns: update OpSpy for this torch")
                orig = fns.get(device_type) or fns.get(None)
                self.originals[name] = (op, orig)
                op.register_kernel(device_type)(self._wrap(name, orig))

    def _wrap(self, name, fn):
        def run(*args, **kwargs):
            step = self.step or "outside"
            per = self.counts.setdefault(step, {})
            per[name] = per.get(name, 0) + 1
            if self.device_type == "cuda" and torch.cuda.is_current_stream_capturing():
                self.capturing[step] = self.capturing.get(step, 0) + 1
            if self.keep_args:
                self.calls.append({"step": step, "op": name, "index": per[name] - 1, "args": snap(args),
                                   "kwargs": snap(kwargs)})
            with self.CaptureHazards(allow=self.allow) as rec:
                out = fn(*args, **kwargs)
            seen = self.hazards.setdefault(step, {}).setdefault(name, {}) if rec.hazards else {}
            for h in {str(h).replace(str(REPO) + "/", "") for h in rec.hazards}:
                seen[h] = seen.get(h, 0) + 1
            return out
        return run

    def restore_kernels(self):
        for op, orig in self.originals.values():
            op.register_kernel(self.device_type)(orig)


# ------------------------------------------------------------------------------------------- phases


def control_capture() -> dict:
    """A trivial capture (x.add_(1)): whether capturing works at all in this process."""
    try:
        x = torch.zeros(4, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            x.add_(1)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            x.add_(1)
        g.replay()
        torch.cuda.synchronize()
        return {"ok": bool((x == 2).all().item())}
    except Exception as exc:  # noqa: BLE001 - reported
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}


def run_op_alone(call: dict, spy: OpSpy, device: str, cuda: bool) -> dict:
    """One recorded call alone: eager on fresh copies (side stream), then captured on other fresh copies."""
    op = getattr(torch.ops.ckvp, call["op"]).default
    res = {"step": call["step"], "op": call["op"], "index": call["index"],
           "args": describe(list(call["args"]))[:300]}
    label = f"alone:{call['step']}:{call['op']}#{call['index']}"
    spy.step, spy.keep_args = label, False
    a_args, a_kw = restore(call["args"], device), restore(call["kwargs"], device)
    b_args, b_kw = restore(call["args"], device), restore(call["kwargs"], device)
    try:
        with SyncWarnings(cuda) as sw:
            if cuda:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    op(*a_args, **a_kw)
                torch.cuda.current_stream().wait_stream(s)
                torch.cuda.synchronize()
            else:
                op(*a_args, **a_kw)
        res["eager"] = "ok"
        res["eager_sync_warnings"] = sw.items
    except Exception as exc:  # noqa: BLE001 - reported
        res.update(eager=f"{type(exc).__name__}: {exc}"[:400], eager_traceback=short_tb(exc))
        return res
    res["eager_hazards"] = sorted(spy.hazards.get(label, {}).get(call["op"], {}))
    if not cuda:
        res["capture"] = "skipped (no CUDA)"
        return res
    label_c = label + ":capture"
    spy.step = label_c
    g = torch.cuda.CUDAGraph()
    sw_capture = SyncWarnings(cuda)
    try:
        with sw_capture:
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                op(*b_args, **b_kw)
        g.replay()
        torch.cuda.synchronize()
        res["capture"] = "ok"
    except Exception as exc:  # noqa: BLE001 - reported
        res.update(capture=f"{type(exc).__name__}: {exc}"[:400], capture_traceback=short_tb(exc),
                   capture_frame=ckvp_frame(exc))
        print(f"[{elapsed():6.1f} s] CAPTURE FAILS: ckvp::{call['op']} (call {call['index']} of {call['step']}, args "
              f"{res['args'][:160]})\n{res['capture_traceback'][-2500:]}", flush=True)
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
    res["capture_sync_warnings"] = sw_capture.items
    res["capture_hazards"] = sorted(spy.hazards.get(label_c, {}).get(call["op"], {}))
    return res


def main() -> int:
    args = ARGS
    args.out.mkdir(parents=True, exist_ok=True)
    dev = args.device
    cuda = dev.startswith("cuda")
    report: dict = {"command": "python " + " ".join(sys.argv), "device": dev,
                    "CUDA_LAUNCH_BLOCKING": os.environ.get("CUDA_LAUNCH_BLOCKING", ""),
                    "python": platform.python_version(), "torch": torch.__version__}
    try:
        import transformers
        import triton

        report.update(triton=triton.__version__, transformers=transformers.__version__)
    except ImportError:
        pass
    if cuda:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --device cpu for the smoke run", flush=True)
            return 2
        report["gpu"] = torch.cuda.get_device_name()
        report["control_capture"] = control_capture()
        print(f"[{elapsed():6.1f} s] control capture: {report['control_capture']}", flush=True)
        if not report["control_capture"]["ok"]:
            if os.environ.get("CUDA_LAUNCH_BLOCKING") == "1" and not args.no_launch_blocking:
                print("control capture failed with CUDA_LAUNCH_BLOCKING=1: restarting without it", flush=True)
                os.environ.pop("CUDA_LAUNCH_BLOCKING")
                os.execv(sys.executable, [sys.executable, *sys.argv, "--no-launch-blocking"])
            return write(args, report, 1)

    from torch._dynamo.utils import counters

    import ckvp_compile
    from ckvp_compile.latent.capture import hf_step_kwargs
    from ckvp_compile.runtime.hf_cache import CKVPStaticCache
    from ckvp_compile.testing import FIXTURE_MODEL_DIR, load_fixture_model

    dtype = torch.bfloat16 if cuda else torch.float32
    model = load_fixture_model(dtype=dtype).to(dev)
    text = (FIXTURE_MODEL_DIR / "eval_text.txt").read_bytes()
    samples = [torch.tensor([list(text[i:i + 256])]) for i in range(0, 8 * 256, 256)]
    prompt = torch.tensor([list(text[-300:-280])], device=dev)  # 20 held-out bytes, as reliability_gpu.py
    bases = ckvp_compile.calibrate(model, samples, group_size=4, kv_ratio=args.kv_ratio,
                                   latent_format=args.latent_format, cache_len=4096, dense_dtype=torch.bfloat16,
                                   latent_dtype=torch.bfloat16, progress=False)
    cache = CKVPStaticCache(model.config, bases, max_cache_len=args.cache_len, device=dev, dtype=dtype,
                            latent_format=args.latent_format, latent_dtype=torch.bfloat16)
    store = cache.store
    report["layout"] = {"k_offsets": store.k_offsets, "v_offsets": store.v_offsets, "k_formats": store.k_formats,
                        "v_formats": store.v_formats, "max_cache_len": store.max_cache_len}
    print(f"[{elapsed():6.1f} s] model, bases and cache ready; layout {report['layout']}", flush=True)
    torch._dynamo.reset()
    counters.clear()
    kw = {"mode": "reduce-overhead"} if cuda else {"options": {"compiler": "aot_eager"}}
    fwd = torch.compile(model.forward, backend="ckvp", **kw)
    spy = OpSpy("cuda" if cuda else "cpu")
    steps: dict = {}
    tok, pos = prompt, 0
    names = ["prefill"] + [f"decode_{i}" for i in range(1, args.max_decode + 1)]
    i = 0
    with torch.no_grad():
        while i < len(names):
            name, i = names[i], i + 1
            if name.startswith("prefill_"):  # the decode graph replayed: now record and replay the prefill graph
                cache.reset()
                tok, pos = prompt, 0
            spy.step, spy.keep_args = name, name in ("prefill", "decode_1")
            t = time.perf_counter()
            if cuda:
                torch.compiler.cudagraph_mark_step_begin()
            res: dict = {}
            try:
                with SyncWarnings(cuda) as sw:
                    logits = fwd(**hf_step_kwargs(model, tok, cache, pos)).logits
                    nxt = logits[:, -1:].argmax(-1)
                if cuda:
                    torch.cuda.synchronize()
                res.update(status="ok", sync_warnings=sw.items)
                pos, tok = pos + tok.shape[1], nxt
            except Exception as exc:  # noqa: BLE001 - the point of the script
                res.update(status="error", error=f"{type(exc).__name__}: {exc}"[:600],
                           traceback=short_tb(exc, 6000), ckvp_frame=ckvp_frame(exc), sync_warnings=sw.items)
                print(f"[{elapsed():6.1f} s] step {name} FAILED: {res['error'][:300]}\n  innermost ckvp frame: "
                      f"{res['ckvp_frame']}\n{res['traceback'][-3000:]}", flush=True)
            spy.keep_args = False
            res["seconds"] = round(time.perf_counter() - t, 2)
            res["op_launches"] = spy.counts.get(name, {})
            res["launches_while_capturing"] = spy.capturing.get(name, 0)
            res["op_hazards"] = spy.hazards.get(name, {})
            steps[name] = res
            print(f"[{elapsed():6.1f} s] {name}: {res['status']} in {res['seconds']} s, ckvp launches "
                  f"{sum(res['op_launches'].values())} (while capturing: {res['launches_while_capturing']}) "
                  f"{res['op_launches']}" + (f", hazards {res['op_hazards']}" if res["op_hazards"] else "")
                  + (f", sync warnings {res['sync_warnings'][:3]}" if res["sync_warnings"] else ""), flush=True)
            if res["status"] != "ok":
                break
            if name.startswith("decode") and not res["op_launches"] and cuda:  # replayed: the decode graph
                names = names[:i] + ["prefill_2", "prefill_3"]
            elif name.startswith("prefill_") and not res["op_launches"]:
                break
    report["steps"] = steps
    report["cudagraph_skips"] = dict(counters["inductor"]).get("cudagraph_skips", 0)
    recorded = [n for n, r in steps.items() if r["launches_while_capturing"]]
    replayed = [n for n, r in steps.items() if n != "prefill" and r["status"] == "ok" and not r["op_launches"]]
    report["steps_recorded"], report["steps_replayed"] = recorded, replayed
    report["decode_step_captured_and_replayed"] = bool(
        cuda and any(n.startswith("decode") for n in recorded) and any(n.startswith("decode") for n in replayed)
        and report["cudagraph_skips"] == 0)
    report["prefill_captured_and_replayed"] = bool(
        cuda and any(n.startswith("prefill_") for n in recorded) and any(n.startswith("prefill_") for n in replayed))
    print(f"[{elapsed():6.1f} s] decode step captured and replayed: {report['decode_step_captured_and_replayed']}, "
          f"prefill: {report['prefill_captured_and_replayed']} (recorded in {recorded}, replayed in {replayed}, "
          f"cudagraph_skips {report['cudagraph_skips']})", flush=True)

    per_op: list[dict] = []
    whole_ok = report["decode_step_captured_and_replayed"] and report["prefill_captured_and_replayed"]
    run_per_op = args.per_op == "always" or (args.per_op == "on-failure" and not whole_ok)
    if run_per_op:
        for call in spy.calls:
            if elapsed() > args.budget_s:
                per_op.append({"skipped": f"time budget {args.budget_s:.0f} s spent", "remaining": len(spy.calls)
                               - len(per_op)})
                break
            per_op.append(run_op_alone(call, spy, dev, cuda))
    spy.restore_kernels()
    report["per_op"] = per_op
    report["ops_failing_capture_alone"] = sorted({f"{r['op']} ({r['step']})" for r in per_op
                                                  if r.get("capture") not in (None, "ok", "skipped (no CUDA)")})
    report["ops_with_hazards"] = sorted({f"{r['op']} ({r['step']})" for r in per_op
                                         if r.get("eager_hazards") or r.get("capture_hazards")})
    ok = (not cuda) or (whole_ok and not report["ops_failing_capture_alone"])
    return write(args, report, 0 if ok else 1)


def write(args, report: dict, status: int) -> int:
    report["seconds"] = elapsed()
    report["exit_status"] = status
    (args.out / "cudagraph_capture_gpu.json").write_text(json.dumps(report, indent=1, default=str))
    lines = [f"# CUDA-graph capture of one compiled decode step ({report.get('gpu', report['device'])})", "",
             f"Command: `{report['command']}`; torch {report['torch']}, triton {report.get('triton')}, transformers "
             f"{report.get('transformers')}, Python {report['python']}, CUDA_LAUNCH_BLOCKING="
             f"{report['CUDA_LAUNCH_BLOCKING'] or 'unset'}; {report['seconds']} s.", ""]
    if "control_capture" in report:
        lines.append(f"Control capture (x.add_(1)): {report['control_capture']}")
    if "steps" in report:
        lines += ["", "| step | status | s | ckvp launches (while capturing) | capture hazards | sync warnings | "
                      "innermost ckvp frame |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for name, r in report["steps"].items():
            haz = "; ".join(f"{op}: {h} (x{n})" for op, per in r["op_hazards"].items() for h, n in per.items())
            lines.append(f"| {name} | {r['status']} | {r['seconds']} | {sum(r['op_launches'].values())} "
                         f"({r['launches_while_capturing']}) | {haz or '-'} | "
                         f"{'; '.join(r.get('sync_warnings', [])[:3]) or '-'} | {r.get('ckvp_frame', '') or '-'} |")
        lines += ["", f"Decode step captured and replayed (launchers ran while capturing, none in a later step, "
                      f"cudagraph_skips 0): **{report['decode_step_captured_and_replayed']}**; prefill graph "
                      f"(after cache.reset()): **{report['prefill_captured_and_replayed']}** (recorded in "
                      f"{report['steps_recorded']}, replayed in {report['steps_replayed']}, cudagraph_skips "
                      f"{report['cudagraph_skips']})."]
        for name, r in report["steps"].items():
            if r["status"] != "ok":
                lines += ["", f"Step `{name}` error: `{r['error'][:300]}`", "", "```", r["traceback"][-2500:], "```"]
    if report.get("per_op"):
        lines += ["", "Each recorded ckvp op call alone (eager on fresh copies, then captured on other fresh copies):",
                  "", "| step | op | call | args | eager | capture | hazards | sync warnings |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in report["per_op"]:
            if "skipped" in r:
                lines.append(f"| - | {r['skipped']} ({r['remaining']} calls) | | | | | | |")
                continue
            haz = "; ".join(r.get("eager_hazards", []) + r.get("capture_hazards", [])) or "-"
            nsync = len(r.get("eager_sync_warnings", [])) + len(r.get("capture_sync_warnings", []))
            lines.append(f"| {r['step']} | {r['op']} | {r['index']} | {r['args'][:80]} | {r['eager'][:60]} | "
                         f"{r.get('capture', '-')[:80]} {r.get('capture_frame', '')} | {haz[:200]} | {nsync} |")
        lines += ["", f"Ops failing capture alone: {report['ops_failing_capture_alone'] or 'none'}; ops with "
                      f"capture hazards: {report['ops_with_hazards'] or 'none'}."]
        for r in report["per_op"]:
            if r.get("capture_traceback") or r.get("eager_traceback"):
                lines += ["", f"`ckvp::{r['op']}` call {r['index']} of {r['step']} ({r['args'][:200]}): "
                              f"{r.get('capture', r.get('eager'))[:300]}", "", "```",
                          (r.get("capture_traceback") or r.get("eager_traceback"))[-2500:], "```"]
    lines += ["", f"Exit status {status}."]
    (args.out / "cudagraph_capture_gpu.md").write_text("\n".join(lines) + "\n")
    print(f"[{elapsed():6.1f} s] wrote {args.out}/cudagraph_capture_gpu.{{json,md}}; exit {status}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
