"""End-to-end decode benchmark: ms per decode step, throughput, KV bytes and peak memory of eager, Inductor and the
ckvp backend on real MoE shapes with random weights, and greedy agreement with dense on the trained fixture.

    ckvp-bench decode --shape qwen-moe-a2.7b --systems inductor ckvp-16 --batch 1 8 max --context 4096 32768 \\
        --json out/qwen.json --out out/qwen.md --budget-s 240
    ckvp-bench decode --shape qwen-moe-a2.7b --cells eager@1@4096 inductor-max-autotune@8@32768 \\
        ckvp-16:reduce-overhead@max@32768 --json out/cells.json          # these rows only, in this order
    ckvp-bench decode --shape fixture --ratios 4 8 16 --json out/fixture.json      # greedy agreement (CPU or GPU)
    ckvp-bench decode --report out/*.json --markdown BENCHMARKS.md --plots benchmarks/plots

What a speed row measures (``--shape mixtral-8x7b | qwen-moe-a2.7b | tiny``):

1. The model is built from its config (:mod:`ckvp_compile.bench.decode_models`) with random bf16 weights created
   on the device. ``--layers N`` keeps the first N decoder layers (labelled in every row); the other layers'
   weights and KV are then stood in for by a *ballast* allocation of the same bytes (``--no-ballast`` turns it
   off), so memory and the largest batch that fits are those of the full model while the time per step is that
   of N layers.
2. Per row (system, batch B, context C): a static cache of ``S_max = C + warmup + steps`` slots is allocated and
   its first C slots are filled with random K/V (dense) or random quantized latents (ckvp), with the length
   counter set to C: **no prefill runs**; decode steps attend over C cached tokens exactly as after a prefill
   (the values are random, so only time and memory mean anything). The ckvp store's RoPE tables get the model's
   own cos / sin.
3. Systems: ``eager`` (the HF forward), ``inductor`` (``torch.compile`` default), ``inductor-max-autotune``
   (``mode="max-autotune"``, with CUDA graphs), ``inductor-reduce-overhead``, and ``ckvp-R`` (``backend="ckvp"``
   with a latent cache fitted to R times fewer KV bytes than bf16, counting latents, scales, slot positions and
   bases at this row's B and S_max; ``--latent-format``, default int4; inner compiler ``--compiler``). A
   ``:MODE`` suffix (``ckvp-16:reduce-overhead``) picks the Inductor mode. ckvp bases are calibrated on the
   random-weight model's own activations for random token ids (``--bases synthetic``: fitted to moments with a
   1/i spectrum, no model pass); their ranks set the cost, fidelity is measured on the fixture instead.
4. The first call (compilation included: ``compile_s``) and ``--warmup - 1`` more run untimed, then ``--steps``
   decode steps are timed one by one with CUDA events (wall clock on CPU); the row reports the median (and
   p10 / p90) ms per step and ``B * 1000 / median`` tokens per second.
5. Memory: ``kv_bytes_allocated`` (device bytes the cache took), ``kv_bytes_held`` (its tensors' bytes),
   ``kv_bytes_per_token`` (held / (B * S_max)), the dense bf16 equivalent, ``peak_bytes``
   (``torch.cuda.max_memory_allocated`` over the timed steps: everything held, weights and ballast included, plus
   the steps' transient memory) and ``peak_bytes_with_compile`` (the same from before the cache was built, through
   compilation and warm-up). ``output_finite``: the logits of an extra untimed step are finite (random weights whose
   activations overflowed would route every token to the same experts).
6. ``--batch max``: the largest batch that fits, per (system, context): estimated from the largest measured
   row's bytes per sequence and the free device memory (minus ``--margin-gb``), then verified by running the row
   at that batch; on out-of-memory the batch shrinks by 15% and the row is tried again.

Rows past ``--budget-s`` seconds are not started; they are recorded as ``skipped-budget``. A row that fails
(out of memory, compile error) is recorded with its error and the run goes on. The JSON is rewritten after every
row, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..errors import CKVPConfigError
from ..kernels.latent_layout import STORE_LAYOUTS
from .output import output_path_error, with_config_override

__all__ = ["DecodeRow", "System", "main", "parse_cell", "parse_system"]

REPO = Path(__file__).resolve().parents[2]
_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class System:
    """A system under test: ``kind`` 'eager' | 'inductor' | 'ckvp', Inductor ``mode``, ckvp KV ``ratio``."""

    name: str
    kind: str
    mode: str = "default"
    ratio: float | None = None


def parse_system(spec: str) -> System:
    """Parse ``eager``, ``inductor[-MODE]``, ``inductor:MODE``, ``ckvp-R`` or ``ckvp-R:MODE``.

    Raises:
        ValueError: anything else (the message lists the forms).
    """
    base, _, mode = spec.partition(":")
    if mode and mode not in _MODES:
        base = ""  # an unknown mode: refused below
    m = re.fullmatch(r"inductor(?:-(reduce-overhead|max-autotune(?:-no-cudagraphs)?))?", base)
    if m and not (m.group(1) and mode):
        return System(spec, "inductor", mode or m.group(1) or "default")
    m = re.fullmatch(r"ckvp-(\d+(?:\.\d+)?)", base)
    if m and float(m.group(1)) >= 1:
        return System(spec, "ckvp", mode or "default", float(m.group(1)))
    if base == "eager" and not mode:
        return System(spec, "eager")
    raise ValueError(f"unknown system {spec!r}: use eager, inductor, inductor-max-autotune, inductor-reduce-overhead, "
                     f"ckvp-R (R >= 1, e.g. ckvp-16), optionally with :MODE, MODE one of {list(_MODES)}")


def parse_cell(spec: str) -> tuple[str, int | str, int]:
    """Parse ``SYSTEM@BATCH@CONTEXT`` (``--cells``): the system spec (see :func:`parse_system`), the batch (an int
    >= 1 or ``'max'``) and the context (cached tokens, int >= 1).

    Raises:
        ValueError: another form (the message shows the expected one).
    """
    parts = spec.split("@")
    if (len(parts) != 3 or not (parts[1] == "max" or parts[1].isdigit() and int(parts[1]) >= 1)
            or not (parts[2].isdigit() and int(parts[2]) >= 1)):
        raise ValueError(f"--cells takes SYSTEM@BATCH@CONTEXT (BATCH an integer >= 1 or 'max', CONTEXT an integer "
                         f">= 1), e.g. ckvp-16:reduce-overhead@8@32768; got {spec!r}")
    return parts[0], parts[1] if parts[1] == "max" else int(parts[1]), int(parts[2])


@dataclass
class DecodeRow:
    """One measured (or skipped / failed) configuration; times in ms, memory in bytes, ``None`` = not measured."""

    shape: str
    layers: int
    layers_full: int
    system: str
    kind: str
    mode: str
    kv_ratio_requested: float | None
    latent_format: str | None
    batch: int
    context: int
    max_cache_len: int
    max_batch: bool = False
    status: str = "ok"  # ok | oom | error | skipped-budget
    error: str | None = None
    error_where: list[str] | None = None  # oom / error: the innermost frames (file:line function) that raised
    steps: int = 0
    ms_median: float | None = None
    ms_p10: float | None = None
    ms_p90: float | None = None
    tokens_per_s: float | None = None
    compile_s: float | None = None
    kv_bytes_held: int | None = None
    kv_bytes_allocated: int | None = None
    kv_bytes_per_token: float | None = None
    dense_kv_bytes_per_token: int | None = None
    kv_ratio_measured: float | None = None
    peak_bytes: int | None = None
    peak_bytes_with_compile: int | None = None
    weights_bytes: int | None = None
    ballast_bytes: int = 0
    ranks: dict[str, Any] | None = None
    attempts: list[dict[str, Any]] = field(default_factory=list)
    timing: str = "cuda-events"
    wall_s: float | None = None
    output_finite: bool | None = None
    profile_top: list[dict[str, Any]] | None = None  # --profile-steps: kernels by device time per step (us)
    #: --profile-steps: the latent attention kernels of the first profiled step in launch order, [name, us] each
    #: (layer by layer: which rank class costs what; :func:`kernel_sequence`)
    profile_calls: list[list[Any]] | None = None


# ------------------------------------------------------------------------------------------------ environment
def environment(device: str, argv: Sequence[str]) -> dict[str, Any]:
    """GPU, driver, torch, triton, transformers and Python versions, the git commit and the command line."""
    import transformers

    env: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                           "python": platform.python_version(), "device": device, "cpu": platform.processor() or
                           platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                           "command": with_config_override("ckvp-bench decode " + shlex.join(argv))}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
        env["cuda"] = torch.version.cuda
        env["driver"] = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    env["git_commit"] = _run(["git", "-C", str(REPO), "rev-parse", "HEAD"])
    return env


def _innermost_frames(exc: BaseException, n: int = 6) -> list[str]:
    """The ``n`` innermost frames of ``exc``'s traceback as ``file:line in function: code`` (where an OOM or error
    row was raised: the allocation's op, for a row that needs explaining)."""
    return [f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()[:160]}"
            for f in traceback.extract_tb(exc.__traceback__)[-n:]]


def _run(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout.strip().split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        return None


# ------------------------------------------------------------------------------------------------ speed rows
def kernel_sequence(events: Sequence[Any], steps: int, match: str = "_latent") -> list[list[Any]]:
    """The device kernels of the first of ``steps`` profiled steps whose name contains ``match``, in launch order:
    ``[[name, us], ...]``. ``events``: ``torch.profiler`` FunctionEvents (``prof.events()``); device kernels are
    those with a CUDA ``device_type``; the first step is the first ``1 / steps`` of the matching kernels by start
    time (every step launches the same kernels). Raises nothing: events it cannot read are skipped."""
    seq = []
    for ev in events:
        try:
            if "CUDA" not in str(ev.device_type) or match not in ev.name:
                continue
            seq.append((ev.time_range.start, ev.name[:80], round(ev.time_range.elapsed_us(), 2)))
        except AttributeError:
            continue
    seq.sort()
    per_step = len(seq) // max(steps, 1)
    return [[name, us] for _, name, us in seq[:per_step]]


def profile_kernels(fn: Callable, kwargs: Sequence[dict], top: int = 25,
                    sequence: list | None = None) -> list[dict[str, Any]]:
    """Device time per decode step of each kernel, from ``torch.profiler`` (CUPTI) over ``len(kwargs)`` calls.

    ``kwargs`` are the decode steps after the timed ones (fresh positions: caches may count their writes). Kernels inside
    CUDA-graph replays are reported by CUPTI like any other launch. Returns at most ``top`` entries
    ``{"name", "us_per_step", "calls_per_step", "share"}`` sorted by device time (``share``: of all kernels' time);
    the last entry is ``"(all kernels)"``. ``sequence``: a list that receives :func:`kernel_sequence` of the run
    (the latent attention kernels of one step, in launch order). Raises nothing the profiler does not.
    """
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for kw in kwargs:
            fn(**kw)
        torch.cuda.synchronize()
    n = max(len(kwargs), 1)
    if sequence is not None:
        sequence.extend(kernel_sequence(prof.events(), n))
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None)
        if t is None:
            t = getattr(ev, "self_cuda_time_total", 0.0)
        if t and getattr(ev, "device_type", None) is not None and "CUDA" in str(ev.device_type):
            rows.append({"name": ev.key[:160], "us_per_step": t / n, "calls_per_step": ev.count / n})
    total = sum(r["us_per_step"] for r in rows) or 1.0
    rows.sort(key=lambda r: -r["us_per_step"])
    out = [dict(r, us_per_step=round(r["us_per_step"], 2), share=round(r["us_per_step"] / total, 4))
           for r in rows[:top]]
    out.append({"name": "(all kernels)", "us_per_step": round(total, 2),
                "calls_per_step": round(sum(r["calls_per_step"] for r in rows), 1), "share": 1.0})
    return out


class _Runner:
    """Holds the model and what rows share (moments, budget, output files)."""

    def __init__(self, args: argparse.Namespace):
        from .decode_models import build_random_model, make_config, weight_bytes

        self.args = args
        self.device = args.device
        self.dtype = getattr(torch, args.dtype)
        self.t0 = time.perf_counter()
        need = max(args.contexts) + args.warmup + args.steps + args.profile_steps + 8
        self.config = make_config(args.shape, args.layers, need)
        full_config = make_config(args.shape, None, need)
        self.layers, self.layers_full = self.config.num_hidden_layers, full_config.num_hidden_layers
        t = time.perf_counter()
        self.model = build_random_model(self.config, self.device, self.dtype, seed=args.seed)
        self.build_s = time.perf_counter() - t
        self.weights = weight_bytes(self.model)
        with torch.device("meta"):
            from transformers import AutoModelForCausalLM

            full = AutoModelForCausalLM.from_config(full_config, dtype=self.dtype)
        self.missing_weights = weight_bytes(full) - self.weights if args.ballast else 0
        del full
        self.moments = None
        self.rows: list[DecodeRow] = []
        self.env = environment(self.device, args.argv)
        self.env.update(build_s=round(self.build_s, 2), weights_bytes=self.weights, layers=self.layers,
                        layers_full=self.layers_full, missing_weight_bytes=self.missing_weights)

    # -- helpers
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def sync(self) -> None:
        if self.cuda():
            torch.cuda.synchronize()

    def clean(self) -> None:
        torch._dynamo.reset()
        gc.collect()
        if self.cuda():
            torch.cuda.empty_cache()

    def bases(self, ratio: float, batch: int, max_len: int) -> Any:
        from ..latent.budget import bases_for_byte_ratio
        from .decode_models import DecomposedMoments, random_bases, synthetic_moments

        if self.moments is None:
            t = time.perf_counter()
            if self.args.bases == "synthetic":
                self.moments = synthetic_moments(self.model, self.args.group_size, seed=self.args.seed)
                self.moments.key_space = getattr(self.args, "key_space", "pre_rope")  # (a spectrum, no model pass)
            else:
                self.moments = DecomposedMoments.from_moments(
                    random_bases(self.model, self.args.group_size, seed=self.args.seed, tokens=self.args.calib_tokens,
                                 key_space=getattr(self.args, "key_space", "pre_rope")))
            self.env["calibration_s"] = round(time.perf_counter() - t, 2)
            self.clean()
        return bases_for_byte_ratio(self.moments, ratio, self.args.latent_format, batch_size=batch,
                                    max_cache_len=max_len, dense_dtype=self.dtype, latent_dtype=self.dtype,
                                    recent_window=self.args.recent_window,
                                    rank_block=getattr(self.args, "rank_block", None),
                                    max_key_rank=getattr(self.args, "max_key_rank", None))

    def step_fn(self, system: System) -> Callable:
        fwd = self.model.forward
        if system.kind == "eager":
            return fwd
        if system.kind == "inductor":
            return torch.compile(fwd, mode=None if system.mode == "default" else system.mode)
        options = {"compiler": self.args.compiler, "enable_expert_gemm": self.args.expert_gemm}
        if system.mode != "default":
            options["mode"] = system.mode
        return torch.compile(fwd, backend="ckvp", options=options)

    def ballast_for(self, kv_per_seq: float, batch: int) -> int:
        if not self.args.ballast or self.layers == self.layers_full:
            return 0
        return int(self.missing_weights + batch * kv_per_seq * (self.layers_full / self.layers - 1))

    # -- one row
    def run_row(self, system: System, batch: int, context: int, max_batch: bool = False) -> DecodeRow:
        from ..latent.capture import hf_step_kwargs
        from .decode_models import (dense_cache, dense_kv_bytes_per_token, fill_cache_, fill_rope_tables_,
                                    kv_bytes_held, latent_cache)

        a = self.args
        max_len = plan_len = context + a.warmup + a.steps + 1 + a.profile_steps
        page = getattr(a, "page_size", 0) if system.kind == "ckvp" else 0
        if page:  # a paged store's length is whole pages (the ranks are planned for the slots used, as unpaged)
            max_len = -(-max_len // page) * page
        row = DecodeRow(a.shape, self.layers, self.layers_full, self.row_name(system), system.kind, system.mode,
                        system.ratio, a.latent_format if system.kind == "ckvp" else None, batch, context, max_len,
                        max_batch,
                        dense_kv_bytes_per_token=dense_kv_bytes_per_token(self.config, self.dtype),
                        weights_bytes=self.weights, timing="cuda-events" if self.cuda() else "wall-clock (CPU)")
        if a.budget_s is not None and self.elapsed() > a.budget_s:
            row.status = "skipped-budget"
            return row
        t_row = time.perf_counter()
        cache = fn = ballast = None
        self.clean()
        try:
            bases = self.bases(system.ratio, batch, plan_len) if system.kind == "ckvp" else None
            if self.cuda():
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            dense_per_seq = row.dense_kv_bytes_per_token * max_len
            if bases is None:
                cache = dense_cache(self.config, batch, max_len, self.device, self.dtype)
            else:
                cache = latent_cache(self.config, bases, batch, max_len, self.device, self.dtype, a.latent_format,
                                     a.recent_window, getattr(a, "latent_layout", "row-major"), page)
                row.ranks = {"k": [list(r) for r in bases.k_ranks], "v": [list(r) for r in bases.v_ranks],
                             "group_size": a.group_size}
            fill_cache_(cache, context, seed=a.seed)
            self.sync()
            row.kv_bytes_held = kv_bytes_held(cache)
            if self.cuda():
                row.kv_bytes_allocated = torch.cuda.memory_allocated() - base
            row.kv_bytes_per_token = row.kv_bytes_held / (batch * max_len)
            row.kv_ratio_measured = dense_per_seq * batch / (row.kv_bytes_allocated or row.kv_bytes_held)
            row.ballast_bytes = self.ballast_for((row.kv_bytes_allocated or row.kv_bytes_held) / batch, batch)
            if row.ballast_bytes and self.cuda():  # the omitted layers' weights and KV
                ballast = torch.empty(row.ballast_bytes, dtype=torch.uint8, device=self.device)
            fn = self.step_fn(system)
            gen = torch.Generator().manual_seed(a.seed)
            total = a.warmup + a.steps + 1 + a.profile_steps  # then one untimed call checks the logits, then profiled ones
            ids = torch.randint(0, self.config.vocab_size, (total, batch, 1), generator=gen).to(self.device)
            kwargs = [hf_step_kwargs(self.model, ids[i], cache, context + i) for i in range(total)]
            with torch.no_grad():
                t = time.perf_counter()
                fn(**kwargs[0])
                self.sync()
                row.compile_s = round(time.perf_counter() - t, 3) if system.kind != "eager" else None
                if system.kind == "ckvp":
                    fill_rope_tables_(self.model, cache)
                for i in range(1, a.warmup):
                    fn(**kwargs[i])
                if self.cuda():
                    self.sync()
                    row.peak_bytes_with_compile = torch.cuda.max_memory_allocated()
                    torch.cuda.reset_peak_memory_stats()  # from here: the steady decode peak (all held + transient)
                row.steps = a.steps
                check = a.warmup + a.steps
                times = self.time_steps(fn, kwargs[a.warmup:check])
                # random weights: NaN / inf logits would mean NaN routing, i.e. unrepresentative expert loads
                row.output_finite = bool(torch.isfinite(fn(**kwargs[check]).logits).all())
                if a.profile_steps and self.cuda():
                    row.profile_calls = []
                    row.profile_top = profile_kernels(fn, kwargs[check + 1:], sequence=row.profile_calls)
            row.ms_median = statistics.median(times)
            q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else [times[0]] * 9
            row.ms_p10, row.ms_p90 = q[0], q[-1]
            row.tokens_per_s = batch * 1000.0 / row.ms_median
            if self.cuda():
                row.peak_bytes = torch.cuda.max_memory_allocated()
        except torch.OutOfMemoryError as e:
            row.status, row.error = "oom", str(e).split("\n")[0][:300]
            row.error_where = _innermost_frames(e)
        except Exception as e:  # noqa: BLE001  recorded in the row; the run goes on
            row.status, row.error = "error", f"{type(e).__name__}: {str(e)[:600]}"
            row.error_where = _innermost_frames(e)
        finally:
            del cache, fn, ballast
            self.clean()
        row.wall_s = round(time.perf_counter() - t_row, 2)
        return row

    def time_steps(self, fn: Callable, kwargs: Sequence[dict]) -> list[float]:
        if not self.cuda():
            out = []
            for kw in kwargs:
                t = time.perf_counter()
                fn(**kw)
                out.append((time.perf_counter() - t) * 1000.0)
            return out
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in kwargs]
        for (start, end), kw in zip(events, kwargs):
            start.record()
            fn(**kw)
            end.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in events]

    def row_name(self, system: System) -> str:
        """The rows' system name: ``system.name``, plus `` wN`` for a ckvp system with a recent window of N,
        `` K<=R`` with key ranks capped at R (``--max-key-rank``), the latent layout unless row-major
        (``--latent-layout``: `` unit-major``, `` row-major/unit-major``, ...), `` pP`` for latents in pages of P
        slots (``--page-size``) and `` post-RoPE`` for key bases of the cached keys (``--key-space post_rope``)."""
        if system.kind != "ckvp":
            return system.name
        w, cap = self.args.recent_window, getattr(self.args, "max_key_rank", None)
        lay = getattr(self.args, "latent_layout", "row-major")
        post = getattr(self.args, "key_space", "pre_rope") == "post_rope"
        page = getattr(self.args, "page_size", 0)
        return (system.name + (f" w{w}" if w else "") + (f" K<={cap}" if cap else "")
                + (f" {lay}" if lay != "row-major" else "") + (f" p{page}" if page else "")
                + (" post-RoPE" if post else ""))

    # -- largest batch
    def max_batch_row(self, system: System, context: int) -> DecodeRow:
        name = self.row_name(system)
        done = [r for r in self.rows if r.system == name and r.context == context and r.status == "ok"
                and not r.max_batch and r.peak_bytes]
        if not self.cuda():
            row = self.run_row(system, 1, context, max_batch=True)
            row.status, row.error = "error", "the largest batch that fits is measured on CUDA devices only"
            return row
        if not done:
            probe = self.run_row(system, 1, context)
            self.add(probe)
            done = [probe] if probe.status == "ok" else []
        if not done:
            row = self.run_row(system, 1, context, max_batch=True)
            row.status, row.error = "error", "no row of this system and context ran, so nothing to scale from"
            return row
        ref = max(done, key=lambda r: r.batch)
        best: DecodeRow | None = None
        attempts: list[dict[str, Any]] = []
        batch = self._estimate_batch(ref)
        for _ in range(self.args.max_batch_tries):
            if any(t["batch"] == batch for t in attempts):
                break
            row = self.run_row(system, batch, context, max_batch=True)
            attempts.append({"batch": batch, "status": row.status, "error": row.error, "where": row.error_where})
            if row.status == "ok":
                if best is None or row.batch > best.batch:
                    best = row
                again = self._estimate_batch(row)  # re-estimated at this larger batch: fixed costs weigh less
                if again <= batch * 1.1:
                    break
                batch = again
            elif row.status == "oom" and batch > 1:
                batch = max(1, int(batch * 0.85))
                if best is not None and batch <= best.batch:
                    break
            else:
                break
        row = best or row
        row.attempts = attempts
        return row

    def _estimate_batch(self, ref: DecodeRow) -> int:
        """The largest batch whose bytes fit the free memory, from a measured row: per sequence, its cache bytes
        plus its share of everything else the row added above the weights (an overestimate at small batches, so
        the estimate is refined from the larger row it leads to)."""
        kv_per_seq = (ref.kv_bytes_allocated or ref.kv_bytes_held) / ref.batch
        per_seq = (ref.peak_bytes - self.weights - ref.ballast_bytes) / ref.batch
        if self.layers < self.layers_full and self.args.ballast:
            per_seq += kv_per_seq * (self.layers_full / self.layers - 1)
        self.clean()
        free = torch.cuda.mem_get_info()[0] - self.args.margin_gb * 2**30 - self.missing_weights
        return max(1, min(self.args.max_batch_cap, int(free // per_seq)))

    def add(self, row: DecodeRow) -> None:
        self.rows.append(row)
        label = f"{row.system:<24} B={row.batch:<5} C={row.context:<7}" + (" [max batch]" if row.max_batch else "")
        if row.status == "ok":
            peak = f"{row.peak_bytes / 2**30:.1f} GiB" if row.peak_bytes else "-"
            print(f"{label} {row.ms_median:9.3f} ms/step  {row.tokens_per_s:10.1f} tok/s  KV "
                  f"{row.kv_bytes_per_token:9.1f} B/token (dense {row.dense_kv_bytes_per_token})  peak {peak}  "
                  + (f"compile {row.compile_s:.1f} s" if row.compile_s is not None else ""), flush=True)
            for k in row.profile_top or []:
                print(f"    {k['us_per_step']:10.1f} us/step {k['calls_per_step']:7.1f} calls {k['share']:6.1%}  "
                      f"{k['name'][:110]}", flush=True)
        else:
            print(f"{label} {row.status}: {row.error or ''}", flush=True)
        self.save()

    def save(self) -> None:
        a = self.args
        data = {"kind": "decode", "meta": {**self.env, "settings": _settings(a), "file": str(a.json or "")},
                "rows": [asdict(r) for r in self.rows]}
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(str(a.json) + ".tmp")
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(a.json)
        if a.out:
            from .decode_report import render_markdown

            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(render_markdown([data], plots=None))


def _settings(a: argparse.Namespace) -> dict[str, Any]:
    keep = ("shape", "systems", "batches", "contexts", "cells", "layers", "steps", "warmup", "latent_format",
            "group_size", "calib_tokens", "bases", "rank_block", "max_key_rank", "key_space", "latent_layout",
            "page_size", "compiler", "expert_gemm", "ballast", "budget_s", "margin_gb", "dtype", "seed")
    return {k: getattr(a, k) for k in keep if hasattr(a, k)}


def run_speed(args: argparse.Namespace) -> int:
    """Run the speed rows of ``ckvp-bench decode`` (a random-weight Mixtral-8x7B or Qwen1.5-MoE shape, CUDA): for each
    system (eager, Inductor modes, ckvp at each ratio) and each batch x context cell, decode steps timed with CUDA
    events (ms per step, median), tokens per second, KV bytes, peak device memory and compile time; the largest
    batch that fits per system and context; printed, and written as JSON / markdown where ``args`` asks.

    Args:
        args: the parsed ``ckvp-bench decode`` command line (``ckvp-bench decode --help``).
    Returns:
        the exit status: 0 when at least one row ran, else 1 (a row that fails or does not fit is recorded with
        its status, not raised).
    Raises:
        ValueError: an unknown system spec (:func:`parse_system`), before any model is built.
    """
    systems = [parse_system(s) for s in args.systems]
    runner = _Runner(args)
    print(f"{args.shape}: {runner.layers}/{runner.layers_full} layers, weights {runner.weights / 1e9:.2f} GB "
          f"(built on {args.device} in {runner.build_s:.1f} s)" +
          (f"; ballast {runner.missing_weights / 1e9:.1f} GB for the other layers' weights" if runner.missing_weights
           else ""), flush=True)
    if args.cells:  # these rows, in this order
        plan = [(parse_system(spec), batch, context) for spec, batch, context in map(parse_cell, args.cells)]
    else:  # the grid: every fixed batch, then the largest batch that fits, per context
        fixed = [int(b) for b in args.batches if b != "max"]
        plan = [(system, batch, context) for context in args.contexts for batch in fixed for system in systems]
        if "max" in args.batches:
            plan += [(system, "max", context) for context in args.contexts for system in systems]
    for system, batch, context in plan:
        runner.add(runner.max_batch_row(system, context) if batch == "max" else runner.run_row(system, batch, context))
    runner.save()
    print(f"done in {runner.elapsed():.0f} s" + (f"; JSON {args.json}" if args.json else ""))
    return 0 if any(r.status == "ok" for r in runner.rows) else 1


# ------------------------------------------------------------------------------------------------ CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckvp-bench decode", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["mixtral-8x7b", "qwen-moe-a2.7b", "tiny", "fixture"],
                   help="model shape (random bf16 weights) or 'fixture' (greedy agreement on the trained fixture)")
    p.add_argument("--systems", nargs="+", default=["eager", "inductor", "inductor-max-autotune", "ckvp-4", "ckvp-8",
                                                      "ckvp-16"],
                   help="systems, in order: eager, inductor, inductor-max-autotune, inductor-reduce-overhead, ckvp-R "
                        "(a latent cache of R times fewer bytes than bf16 K/V); inductor and ckvp-R take :MODE (e.g. "
                        "ckvp-16:reduce-overhead); python -m pydoc ckvp_compile.bench.decode has the details")
    p.add_argument("--batch", dest="batches", nargs="+", default=["1", "8", "32", "max"],
                   help="batch sizes; 'max' = the largest that fits, per system and context (CUDA)")
    p.add_argument("--context", dest="contexts", nargs="+", type=int, default=[4096, 32768],
                   help="cached tokens per sequence at the first timed step")
    p.add_argument("--cells", nargs="+", default=None, metavar="SYSTEM@BATCH@CONTEXT",
                   help="run exactly these rows, in this order, instead of the --systems x --batch x --context grid "
                        "(BATCH an integer or 'max'), e.g. inductor-max-autotune@8@32768 "
                        "ckvp-16:reduce-overhead@max@32768")
    p.add_argument("--layers", type=int, default=None, help="decoder layers to build (default: all; labelled)")
    p.add_argument("--no-ballast", dest="ballast", action="store_false",
                   help="with --layers: do not allocate the omitted layers' weights and KV as ballast")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per row (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (the first compiles)")
    p.add_argument("--latent-format", default="int4",
                   help="ckvp latent format: int4 (default), int8, int2, float; --shape fixture also takes 'planned' "
                        "(rank and bits per head from the planner, as ckvp-bench fidelity's 'planned' allocation), "
                        "optionally with '+rot' (Hadamard-rotated basis blocks), '+fp8' (bases stored in "
                        "float8_e4m3fn) and '+measured' (the planner's errors measured as the KL to dense on "
                        "--measure-windows calibration windows), e.g. planned+rot+fp8+measured")
    p.add_argument("--group-size", type=int, default=4, help="ckvp layers per latent group")
    p.add_argument("--bases", default="calibrated", choices=["calibrated", "synthetic"],
                   help="random-weight models: ckvp bases calibrated on the model's activations for random ids "
                        "(default), or fitted to synthetic moments with a 1/i spectrum (no model pass; speed and "
                        "memory only)")
    p.add_argument("--calib-tokens", type=int, default=256,
                   help="random-weight models: tokens per calibration sample (2 samples of random ids)")
    p.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager", "eager"],
                   help="inner compiler of the ckvp backend (aot_eager / eager: CPU smoke runs)")
    p.add_argument("--no-expert-gemm", dest="expert_gemm", action="store_false",
                   help="ckvp without its grouped expert GEMM rewrite (enable_expert_gemm=False)")
    p.add_argument("--budget-s", type=float, default=None, help="start no row after this many seconds")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="CUDA: profile this many extra decode steps per row and record the kernels by device time "
                        "(JSON 'profile_top')")
    p.add_argument("--margin-gb", type=float, default=3.0, help="device memory kept free by --batch max (GiB)")
    p.add_argument("--max-batch-cap", type=int, default=1024, help="upper bound of --batch max")
    p.add_argument("--max-batch-tries", type=int, default=4, help="attempts of --batch max before giving up")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="weights and KV dtype of the random models (fixture: float32 default via --fixture-dtype)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results as JSON (rewritten after every row)")
    p.add_argument("--out", type=Path, default=None, help="write a markdown summary of this run")
    p.add_argument("--rank-block", type=int, default=None,
                   help="ckvp: keep ranks in whole blocks of this many latent coordinates (1: any rank; default: the "
                        "quantization block of a uniform quantized --latent-format unless that lands more than 5%% "
                        "above the ratio; see ckvp_compile.latent.budget.bases_for_byte_ratio)")
    p.add_argument("--max-key-rank", type=int, default=None,
                   help="ckvp: cap every key unit's rank (per KV head and layer group) at this many coordinates and "
                        "spend the bytes on values and other units (decode speed for fidelity at the same bytes; "
                        "ckvp_compile.latent.ranks.key_rank_caps); default: no cap")
    p.add_argument("--key-space", default="pre_rope", choices=["pre_rope", "post_rope"],
                   help="ckvp: fit the key bases to the keys before RoPE (default; decode re-applies RoPE per cached "
                        "token) or to the keys as cached, after RoPE (decode scores them with no RoPE rebuild: "
                        "faster, lossier at the same rank; ckvp_compile.latent.LatentBases.key_space); ckvp rows are "
                        "then named '<system> post-RoPE' (--shape fixture: the fixture's calibration, its rows "
                        "labelled 'post-RoPE keys')")
    g = p.add_argument_group("fixture (--shape fixture)")
    g.add_argument("--model", type=Path, default=None, help="HF model directory (default: the bundled fixture)")
    g.add_argument("--ratios", nargs="*", type=float, default=[4.0, 8.0, 16.0],
                   help="KV byte ratios (none: only dense, its bf16-KV floor and the --baseline rows)")
    g.add_argument("--baseline", dest="baselines", nargs="+", default=None, metavar="kivi:BITS:GROUP:RESIDUAL",
                   help="baseline rows: KIVI (arXiv:2402.02750) over the dense cache, fake-quantized: keys per "
                        "channel, values per token, GROUP elements per fp16 scale and zero point, the RESIDUAL "
                        "newest tokens in bf16 (ckvp_compile.bench.kivi)")
    g.add_argument("--new-tokens", type=int, default=64, help="greedy tokens generated per prompt")
    g.add_argument("--prompts", type=int, default=4, help="prompts (held-out text after the calibration part)")
    g.add_argument("--prompt-len", type=int, default=128, help="prompt tokens")
    g.add_argument("--prompt-batch", type=int, default=16,
                   help="prompts decoded together, as the rows of one batch (default 16; 1: one at a time, as runs "
                        "before 2026-12-07 did; float rounding may then differ in the last bits)")
    g.add_argument("--calib-windows", type=int, default=16, help="calibration windows of 256 tokens")
    g.add_argument("--budget-len", type=int, default=4096,
                   help="cache length (one sequence) the byte ratio is met at, bases counted (as examples/generate.py)")
    g.add_argument("--fixture-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--latent-layout", default="row-major", choices=list(STORE_LAYOUTS),
                   help="ckvp: how the latents lie in memory (CKVPStaticCache(latent_layout=...), "
                        "kernels.latent_layout): each slot's row contiguous (default), or each byte column contiguous "
                        "over the slots (unit-major), for both or as KEYS/VALUES (row-major/unit-major: the value "
                        "latents only); ckvp rows are then named '<system> <layout>'")
    p.add_argument("--page-size", type=int, default=0, metavar="P",
                   help="ckvp (speed shapes): page the latents in pools of P slots (CKVPStaticCache(page_size=P); "
                        "each row's cache length rounded up to whole pages); ckvp rows are then named '<system> pP'. "
                        "64 with --latent-layout unit-major: each 64-slot tile's byte columns contiguous, the 8-bit "
                        "MMA pass's fastest layout (default 0: not paged)")
    p.add_argument("--recent-window", type=int, default=0,
                   help="ckvp: keep the last N tokens' keys and values exact beside the latent (CKVPStaticCache("
                        "recent_window=N)), their bytes counted in the ratio (at --budget-len for the fixture); "
                        "ckvp rows are then named '<system> wN' (default 0: none)")
    g.add_argument("--planned-format", default=None,
                   help="--latent-format planned: the bit plan's blocks, mix/<block> or mix/<block>v<value block> "
                        "(as ckvp-bench fidelity's --latent-formats; default mix/32), e.g. mix/32v64; '-f8' after "
                        "them keeps each block's span and minimum in e4m3 (2 bytes, not 4), e.g. mix/32-f8")
    g.add_argument("--measure-windows", type=int, default=None,
                   help="--latent-format planned+measured: the first calibration windows the planner's errors are "
                        "measured on (default 8, or --calib-windows when fewer)")
    r = p.add_argument_group("report (--report)")
    r.add_argument("--report", nargs="+", type=Path, default=None, help="JSON files to render (no run)")
    r.add_argument("--markdown", type=Path, default=None, help="with --report: the markdown file to write")
    r.add_argument("--plots", type=Path, default=None, help="with --report: directory of the PNG plots")
    return p


def _check(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.report is not None:
        if a.markdown is None:
            p.error("--report needs --markdown FILE")
        for f in a.report:  # each a ckvp-bench decode --json file (a bad one would fail half-way through the report)
            try:
                ok = isinstance(json.loads(Path(f).read_text()).get("rows"), list)
            except (OSError, ValueError, AttributeError):
                ok = False
            if not ok:
                p.error(f"--report {str(f)!r}: not a ckvp-bench decode --json file (no readable JSON with 'rows')")
        return
    if a.shape is None:
        p.error("--shape is required (or --report FILE...)")
    if bad_path := output_path_error({"--json": a.json, "--out": a.out}, make_dirs=True):
        p.error(bad_path)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda, but this torch has no CUDA device; use --device cpu")
    fmt, *opts = a.latent_format.split("+")
    from ..latent.ranks import max_key_rank_error

    if max_key_rank_error(a.max_key_rank):
        p.error("--max-key-rank: " + max_key_rank_error(a.max_key_rank))
    if a.max_key_rank is not None and fmt == "planned":
        p.error("--max-key-rank caps the ranks fitted to a uniform format; a planned bit plan chooses its own ranks")
    if fmt == "planned":
        if a.shape != "fixture":
            p.error("--latent-format planned is for --shape fixture (the fused decode kernel reads uniform formats)")
        bad = [o for o in opts if o not in ("rot", "fp8", "measured")]
        if bad or len(set(opts)) != len(opts):
            p.error(f"--latent-format planned takes the distinct options +rot, +fp8 and +measured (e.g. "
                    f"planned+rot+fp8+measured), got {a.latent_format!r}")
        from .fidelity import _mix_blocks

        a.planned_format = a.planned_format or "mix/32"
        try:
            _mix_blocks(a.planned_format)
        except ValueError as e:
            p.error(f"--planned-format: {e}")
    elif a.planned_format is not None:
        p.error("--planned-format is for --latent-format planned[+...]")
    if a.measure_windows is not None:
        if "measured" not in opts or fmt != "planned":
            p.error("--measure-windows is for --latent-format planned+measured")
        if a.calib_windows < 1:
            p.error(f"--calib-windows must be >= 1, got {a.calib_windows}")
        if not 1 <= a.measure_windows <= a.calib_windows:
            p.error(f"--measure-windows must be in 1..--calib-windows ({a.calib_windows}), got {a.measure_windows}")
    if a.baselines and a.shape != "fixture":
        p.error("--baseline is for --shape fixture")
    if a.page_size < 0:
        p.error(f"--page-size must be >= 0 (0: not paged), got {a.page_size}")
    if a.page_size and a.shape == "fixture":
        p.error("--page-size is for the speed shapes; the fixture's greedy check runs unpaged")
    if a.shape == "fixture":
        if any(not r >= 1 for r in a.ratios):  # (nan too)
            p.error("--ratios must be >= 1")
        for flag, n in (("--prompts", a.prompts), ("--new-tokens", a.new_tokens), ("--prompt-len", a.prompt_len),
                        ("--calib-windows", a.calib_windows), ("--prompt-batch", a.prompt_batch)):
            if n < 1:
                p.error(f"{flag} must be >= 1, got {n}")
        if a.model is not None and not (a.model / "config.json").is_file():
            p.error(f"--model {str(a.model)!r}: no config.json there (an HF model directory is expected)")
        if not a.ratios and not a.baselines:
            p.error("--ratios without a value runs no ckvp row: give --baseline kivi:BITS:GROUP:RESIDUAL")
        from .kivi import KIVIConfig

        for spec in a.baselines or ():
            try:
                KIVIConfig.parse(spec)
            except ValueError as e:
                p.error(f"--{e}")
        if not 0 <= a.recent_window < a.prompt_len + a.new_tokens:
            p.error(f"--recent-window must be in [0, --prompt-len + --new-tokens = {a.prompt_len + a.new_tokens})")
        return
    if a.recent_window < 0:
        p.error("--recent-window must be >= 0")
    try:
        [parse_system(s) for s in a.systems]
        cells = [parse_cell(c) for c in a.cells or ()]
        [parse_system(c[0]) for c in cells]
    except ValueError as e:
        p.error(str(e))
    if cells:  # the grid options then describe the cells (the model is built for the longest context)
        a.systems = list(dict.fromkeys(c[0] for c in cells))
        a.batches = list(dict.fromkeys(str(c[1]) for c in cells))
        a.contexts = list(dict.fromkeys(c[2] for c in cells))
    for b in a.batches:
        if b != "max" and not (b.isdigit() and int(b) >= 1):
            p.error(f"--batch takes positive integers or 'max', got {b!r}")
    if a.steps < 1 or a.warmup < 1 or any(c < 1 for c in a.contexts):
        p.error("--steps, --warmup and --context must be >= 1")
    if a.page_size and a.page_size > min(a.contexts):
        p.error(f"--page-size {a.page_size} is longer than the context {min(a.contexts)}: a page would hold mostly "
                f"unused slots; fix: a page size of at most the shortest --context (64 for the MMA kernel's tiles)")


def main(argv: Sequence[str] | None = None) -> int:
    """``ckvp-bench decode``: returns 0 on success, 1 when no row ran, 2 on a usage error."""
    p = _parser()
    try:
        a = p.parse_args(argv)
        _check(p, a)
        a.argv = list(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return int(e.code or 0)
    if a.report is not None:
        from .decode_report import write_report

        write_report(a.report, a.markdown, a.plots)
        print(f"wrote {a.markdown}" + (f" and plots in {a.plots}" if a.plots else ""))
        return 0
    if a.shape == "fixture":
        from .decode_fixture import run_fixture

        try:
            return run_fixture(a)
        except CKVPConfigError as e:  # arguments that only the model and its text can check
            print(f"ckvp-bench decode: error: {e}", file=sys.stderr)
            return 2
    return run_speed(a)


if __name__ == "__main__":
    sys.exit(main())
