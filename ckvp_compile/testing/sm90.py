"""Compile the fused latent decode attention's Triton kernels for the H100/H200 (sm_90a) on a machine without a GPU.

Triton compiles ahead of time for a target it is told about: :func:`compile_latent_attention` runs the real launcher
(:func:`~ckvp_compile.kernels.latent_attention_triton.latent_attention_triton`) on CPU tensors of the real shapes,
with a stand-in CUDA driver (an sm_90 target) and every kernel launch replaced by a compile-only warm-up. It
returns what Triton built (PTX and, through its bundled ``ptxas``, the cubin), so that

* tests catch kernels that the interpreter runs but the compiler rejects (the interpreter evaluates constexpr
  branches on runtime values eagerly, where the compiler demands equal types in both arms), and
* benchmarks/latent_attention_aot.py reads registers, spills, shared memory and the static SASS mix of any config
  between GPU sessions (:func:`ptxas_stats`).

Nothing runs: no result is computed, only code, and what only a launch checks is not checked (shared memory
beyond the device's limit: read ``compiled.metadata.shared``; see :data:`SM90_MAX_SHARED_BYTES`). The local Triton
may differ from the GPU machine's; compare variants, not absolute numbers. Needs a Triton build with its NVIDIA
backend (the standard wheels); the process must not run under ``TRITON_INTERPRET=1``. It patches module globals of
``kernels.latent_attention_triton`` and Triton's active driver for the duration of a call (not thread-safe) and
gives each kernel a private compile cache meanwhile, so a process that also launches on a real GPU keeps its own.
Written against Triton 3.6-3.9 (``triton.runtime.driver.set_active``, ``JITFunction.warmup`` and
``JITFunction.device_caches``).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SM90_MAX_SHARED_BYTES", "CompiledKernel", "compile_latent_attention", "ptxas_stats",
           "sm90_compile_available", "tile_loop"]

#: Shared memory one block may use on sm_90 (H100 / H200: 227 KiB), in bytes; a kernel compiled past it is refused at
#: launch (Triton's ``OutOfResources``), which a compile-only warm-up never reaches.
SM90_MAX_SHARED_BYTES = 232448


class _FakeCudaDriver:
    """Just enough of a Triton driver for compile-only warm-ups: an sm_90 target, device 0, stream 0."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty):  # pragma: no cover - only for launchers, never built here
        return ty


class _CompileOnly:
    """Stands in for a ``@triton.jit`` kernel: ``k[grid](*args, **kw)`` compiles (warm-up) and records the result."""

    def __init__(self, fn, sink: list, tag: str):
        self.fn, self.sink, self.tag = fn, sink, tag

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            compiled = self.fn.warmup(*args, grid=grid, **kwargs)
            self.sink.append((self.tag, kwargs.get("PHASE", None), grid, compiled))
            return compiled
        return call


@dataclass
class CompiledKernel:
    """One kernel a launch would have run. name: 'one-pass', 'key pass', 'value pass' (the split kernel by its
    PHASE), 'grouped key pass' or 'reduce'; grid: the launch grid; compiled: Triton's ``CompiledKernel`` (``asm``
    holds 'ttgir', 'ptx', 'cubin'; ``metadata`` the warps, stages and shared bytes)."""

    name: str
    grid: tuple
    compiled: Any


def sm90_compile_available() -> str | None:
    """None if this process can compile Triton kernels for sm_90a, else why not (for a test's skip reason)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "TRITON_INTERPRET is set: kernels would be interpreted, not compiled"
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as e:  # pragma: no cover - triton is a dependency
        return f"Triton is not importable ({e})"
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not any(os.path.exists(os.path.join(bin_dir, exe)) for exe in ("ptxas", "ptxas-blackwell")):
        return f"this Triton build has no bundled ptxas under {bin_dir}"
    return None


def compile_latent_attention(args: tuple, config, page_table: torch.Tensor | None = None) -> list[CompiledKernel]:
    """Compile, for sm_90a and without running them, every kernel that
    ``latent_attention_triton(*args, config=config, page_table=page_table)`` would launch.

    Args:
        args: the launcher's positional arguments, as CPU tensors of the shapes to compile for (their values are
            never read by a kernel; the launcher reads metadata such as slot counts); e.g.
            :func:`ckvp_compile.bench.attention.make_inputs` with ``dev="cpu"``.
        config: a :class:`~ckvp_compile.kernels.latent_attention_triton.DecodeConfig`.
        page_table: as the launcher's.
    Returns:
        The kernels in launch order.
    Raises:
        triton.compiler.errors.CompilationError: a kernel does not compile (the point of the tests that call this);
            ``triton.runtime.errors.PTXASError`` where ptxas rejects the PTX.
        NotImplementedError / ValueError: the launcher refuses the inputs (as it would on a GPU; only its device
            check is bypassed).
        RuntimeError: :func:`sm90_compile_available` gives a reason.
    """
    why = sm90_compile_available()
    if why:
        raise RuntimeError(f"cannot compile for sm_90a here: {why}")
    from triton.runtime import driver as triton_driver  # the DriverConfig instance

    from ..kernels import latent_attention_absorbed as laa
    from ..kernels import latent_attention_chunks as lac
    from ..kernels import latent_attention_lanes as lal
    from ..kernels import latent_attention_triton as lat
    from ..kernels import latent_attention_words as law

    sink: list = []
    names = ("_latent_attention_split_kernel", "_latent_attention_reduce_kernel", "_latent_scores_heads_kernel",
             "_merge_splits_kernel", "_merge_fma_kernel")
    tags = ("split", "reduce", "grouped key pass", "one-pass merge", "fma merge")
    saved = {n: getattr(lat, n) for n in names + ("_interpreting", "unsupported_reason")}
    saved_caches = {n: saved[n].device_caches for n in names if hasattr(saved[n], "device_caches")}
    saved_driver = getattr(triton_driver, "_active", None)
    saved_record = dict(lat._LAST_LAUNCH)
    # (module, name) -> (kernel, tag): the one-pass kernels over chunks of KV heads and their query folds
    chunk_kernels = {(mod, n): (getattr(mod, n), tag) for mod, n, tag in (
        (lac, "_latent_attention_chunks_kernel", "one pass over head chunks"),
        (lac, "_fold_query_kernel", "fold query"),
        (laa, "_absorbed_attention_kernel", "absorbed pass"), (laa, "_fold_query_kernel", "absorbed fold"),
        (lal, "_lanes_attention_kernel", "lane pass"), (law, "_words_attention_kernel", "word pass"))}
    chunk_caches = {key: k.device_caches for key, (k, _) in chunk_kernels.items() if hasattr(k, "device_caches")}
    real_unsupported = saved["unsupported_reason"]

    def unsupported(*a, **k):  # the launcher's own checks, with CPU tensors standing for the faked device
        lat._interpreting = lambda: True
        try:
            return real_unsupported(*a, **k)
        finally:
            lat._interpreting = lambda: False

    try:
        triton_driver.set_active(_FakeCudaDriver())
        for n, tag in zip(names, tags):
            if n in saved_caches:  # a private cache: device 0 here is the fake sm_90, not a real GPU's
                saved[n].device_caches = defaultdict(saved[n].create_binder)
            setattr(lat, n, _CompileOnly(saved[n], sink, tag))
        for (mod, n), (k, tag) in chunk_kernels.items():
            if (mod, n) in chunk_caches:
                k.device_caches = defaultdict(k.create_binder)
            setattr(mod, n, _CompileOnly(k, sink, tag))
        lat._interpreting = lambda: False
        lat.unsupported_reason = unsupported
        lat.latent_attention_triton(*args, config=config, page_table=page_table)
    finally:
        for n, fn in saved.items():
            setattr(lat, n, fn)
        for n, caches in saved_caches.items():
            saved[n].device_caches = caches
        for (mod, n), (k, _) in chunk_kernels.items():
            setattr(mod, n, k)
            if (mod, n) in chunk_caches:
                k.device_caches = chunk_caches[(mod, n)]
        lat._LAST_LAUNCH.clear()
        lat._LAST_LAUNCH.update(saved_record)
        triton_driver._active = saved_driver  # reset_active() would build the default driver (none on CPU)
    out = []
    for tag, phase, grid, compiled in sink:
        name = {0: "one-pass", 1: "key pass", 2: "value pass"}.get(phase, tag) if tag == "split" else tag
        out.append(CompiledKernel(name, tuple(grid), compiled))
    return out


def ptxas_stats(ptx: str, arch: str = "sm_90a") -> dict:
    """Registers, spill stores / loads (bytes) and the static SASS opcode counts of one kernel's PTX, from Triton's
    bundled ``ptxas -v`` (the newest one that reads this PTX version: ``ptxas-blackwell`` first) and ``cuobjdump``.

    Args:
        ptx: the kernel's PTX (``compiled.asm["ptx"]`` of a :class:`CompiledKernel`).
        arch: the ptxas target (default ``sm_90a``, the H100 / H200).
    Returns:
        dict with 'registers', 'spill_store_bytes', 'spill_load_bytes' (None where ptxas printed none),
        'sass_total' and 'sass_ops' (opcode -> count, most frequent first; predicates stripped; empty without
        cuobjdump), 'sass' (the listing; "" without cuobjdump) and 'ptxas' (its last lines).
    """
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    text, sass = "", ""
    for exe in ("ptxas-blackwell", "ptxas"):
        path = os.path.join(bin_dir, exe)
        if not os.path.exists(path):
            continue
        with tempfile.TemporaryDirectory() as d:
            src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
            with open(src, "w") as f:
                f.write(ptx)
            out = subprocess.run([path, f"-arch={arch}", "-v", src, "-o", cubin], capture_output=True, text=True)
            dump = os.path.join(bin_dir, "cuobjdump")
            if out.returncode == 0 and os.path.exists(dump):
                sass = subprocess.run([dump, "-sass", cubin], capture_output=True, text=True).stdout
        text = out.stdout + out.stderr
        if out.returncode == 0:
            break
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    ops: dict = {}
    for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass):
        ops[m.group(1)] = ops.get(m.group(1), 0) + 1
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(spill.group(1)) if spill else None,
            "spill_load_bytes": int(spill.group(2)) if spill else None,
            "sass_total": sum(ops.values()) or None,
            "sass_ops": dict(sorted(ops.items(), key=lambda kv: -kv[1])), "sass": sass,
            "ptxas": text.strip().splitlines()[-3:]}


def tile_loop(sass: str, min_len: int = 300) -> list[str]:
    """The instructions of the first loop of at least ``min_len`` instructions in a ``cuobjdump -sass`` listing (a
    backward branch's target through the branch; the MMA pass's unmasked tile loop), predicates kept.

    Args:
        sass: the listing (``ptxas_stats(ptx)["sass"]``); min_len: the shortest loop taken (shorter ones are the
            prologue's and the merge's helpers).
    Returns:
        The loop body's instructions, in address order.
    Raises:
        ValueError: no loop that long.
    """
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    for addr, text in ins:
        m = re.search(r"BRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr and (addr - int(m.group(1), 16)) // 16 + 1 >= min_len:
            lo = int(m.group(1), 16)
            return [t for a, t in ins if lo <= a <= addr]
    raise ValueError(f"no loop of {min_len} or more instructions in the listing")
