"""``ckvp-bench attention``: one layer's fused latent decode attention against dense bf16 attention, in one run.

    ckvp-bench attention [--heads 32:8] [--batches 1 8 32] [--contexts 4096 32768 131072]
                         [--formats int4/32:256 int8/32:256] [--flex] [--budget-s 900] [--json OUT.json]
                         [--out OUT.md] [--device cuda] [--cuda-graphs] [--tiny] [--seed 0]
                         [--key-space pre_rope|post_rope] [--latent-layout row-major|unit-major] [--page-size P]

The layer: Mixtral-8x7B-shaped by default (``--heads 32:8``: 32 query heads, 8 KV heads, head_dim 128; ``16:16``
for Qwen1.5-MoE), rotate_half RoPE over all 128 channels, one new token per sequence at the last slot; the cache
holds latents of a group of G=4 layers, ``rank`` coordinates per KV head for K and for V, in each requested
storage format (``--formats FORMAT:RANK``, :mod:`ckvp_compile.kernels.latent_format`). Data: random codes and
fp16 block scales/mins written directly in the storage layout (no quantisation pass), random orthonormal basis
blocks, N(0, 1) queries: the scores are O(1).

For every (batch, context, format) row:

* numerics: relative error ``||out - ref|| / ||ref||`` (Frobenius) of the kernel
  (:func:`ckvp_compile.kernels.latent_attention_triton.latent_attention_triton`, its default config for the head
  ratio and rank) against :func:`ckvp_compile.kernels.reference.latent_attention_ref` on the same inputs (bf16
  inputs, fp32 math in both; the reference runs in batch chunks to bound its memory); on CUDA also through the op
  (``torch.ops.ckvp.latent_attention``, which must dispatch to the kernel);
* time (CUDA only): median of ``triton.testing.do_bench`` after a warm-up (launches: at small shapes the
  launcher's host work dominates), or with ``--cuda-graphs`` of CUDA-graph replay (:func:`graph_bench`), as a
  decode step under CUDA graphs runs it;
* bytes read by one call (:func:`kernel_bytes`: the latent rows once, slot positions, the cos/sin rows, q, the new
  tokens, the basis blocks, the split workspaces written and read back, and the two-pass scores written and read
  back), the achieved bandwidth (bytes / time) and its share of the device-to-device copy bandwidth measured at
  the start of the same run (read + write bytes / time, :func:`copy_bandwidth`);
* dense bf16 decode attention over the same context and heads (K and V of (B, Hkv, T, 128) bf16): SDPA with
  ``enable_gqa`` eager and under ``torch.compile``, and with ``--flex`` FlexAttention (its decoding kernel for one
  query token) under ``torch.compile``; the dense time is the fastest of those measured, and ``speedup`` is
  dense time / latent time, next to the dense/latent byte ratio (the speedup a purely bandwidth-bound pair
  would show).

The kernel splits the context over programs and merges the partial softmax results in a second step: the
flash-decoding scheme (Dao et al., "Flash-Decoding for long-context inference", 2023,
https://crfm.stanford.edu/2023/10/12/flashdecoding.html); dense FlexAttention decoding does the same.

Rows that would not fit in device memory (an estimate made before allocating, :func:`estimate_bytes`) are
recorded as skipped with the reason, as are rows after ``--budget-s`` seconds; nothing is dropped silently.

``--tiny`` runs the same code on tiny shapes (4:2 heads, head_dim 32) for a CPU smoke test. On CPU nothing is
timed; the kernel runs only under the Triton interpreter, which must be switched on before ``triton`` is imported
(``TRITON_INTERPRET=1 ckvp-bench attention --tiny --device cpu``; see
:mod:`ckvp_compile.testing.interpreter`); without it each row runs the reference only and says so.
``--device cpu`` requires ``--tiny`` (a usage error, exit status 2, otherwise): the full shapes would run the
PyTorch reference for minutes in GBs of memory and time nothing. ``--batches``, ``--contexts``, ``--heads`` and
``--formats`` still choose the rows under ``--tiny`` (head_dim stays 32).
Source: the method of ``benchmarks/latent_attention_gpu.py`` (H200 runs in
``benchmarks/results/2026-11-29-latent-attention-h200``), which imports its helpers from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from ckvp_compile.bench.output import output_path_error, write_result
from ckvp_compile.kernels import reference as ref
from ckvp_compile.kernels.latent_format import f8_block_range, parse_latent_format

__all__ = ["copy_bandwidth", "dense_times", "estimate_bytes", "kernel_bytes", "kernel_stats", "launch_shape",
           "main", "make_inputs", "make_latent", "paged_latents", "ref_chunked", "rel_err", "run", "to_markdown"]

#: Mixtral-8x7B's attention: (query heads, KV heads); Qwen1.5-MoE is (16, 16)
MIXTRAL_HEADS = (32, 8)
HEAD_DIM = 128
#: layers per latent group (the basis block is this layer's D rows of a (GROUP * D, rank) basis)
GROUP = 4
DEFAULT_FORMATS = ("int4/32:256", "int8/32:256")
TINY = dict(heads=(4, 2), head_dim=32, batches=(1, 2), contexts=(40, 72), formats=("int4/32:32", "float:24"))
#: the batch chunk of the reference (fewer when it would not fit)
REF_CHUNK = 4


def make_latent(b: int, t: int, ranks: list[int], fmt: str, gen: torch.Generator, dev: str) -> tuple:
    """Random latent rows in the storage layout of ``fmt``, without a quantisation pass.

    Args:
        b, t: batch and slots.
        ranks: latent coordinates per KV head (the packed row holds them head after head).
        fmt: a latent format (``"float"``, ``"int4/32"``, ``"mxint8/32"``, ``"mix/32:..."``;
            :mod:`ckvp_compile.kernels.latent_format`).
        gen: the generator every draw takes (on ``dev``).
        dev: the device.
    Returns:
        ``(latent, offsets)``: ``latent`` is (b, t, R_tot) bf16 N(0, 1) for ``"float"``, else (b, t, row_bytes)
        uint8 with random codes and per-block fp16 scales / minimums (e4m3 spans / minimums for ``-f8``, exponent
        bytes for ``mxint``) whose values span about [-2, 2]; ``offsets`` the Hkv+1 packed column offsets.
    Raises:
        ValueError: ``fmt`` does not parse, or a mix plan does not match ``ranks``.
    """
    off = [0]
    for r in ranks:
        off.append(off[-1] + r)
    f = parse_latent_format(fmt)
    if not f.quantized:
        return torch.randn(b, t, off[-1], device=dev, dtype=torch.bfloat16, generator=gen), off
    ncode, nb = sum(f.code_bytes(off)), f.num_blocks(off)
    rows = torch.empty(b, t, f.row_width(off), dtype=torch.uint8, device=dev)
    rows[..., :ncode] = torch.randint(0, 256, (b, t, ncode), device=dev, dtype=torch.uint8, generator=gen)
    if f.pow2:  # random two's-complement codes; exponents so that values span about [-2, 2]
        qmax = (1 << (f.bits - 1)) - 1
        rows[..., ncode:] = (127 + 1 - (qmax + 1).bit_length() + torch.randint(0, 2, (b, t, nb), device=dev,
                                                                                 generator=gen)).to(torch.uint8)
        if f.bits == 8:  # -128 is not a valid code
            codes = rows[..., :ncode]
            codes[codes == 128] = 0
        return rows, off
    levels = (1 << f.bits) - 1 if f.bits else 15  # a mix plan: any levels (kernel and reference read the same bytes)
    scale = (4.0 / levels) * (0.5 + torch.rand(b, t, nb, device=dev, generator=gen))  # range ~[2, 6] per block
    mins = -scale * levels / 2 + 0.2 * torch.randn(b, t, nb, device=dev, generator=gen)
    if f.meta_f8:  # e4m3 span and minimum bytes (kernels/latent_format.py)
        _, _, mn_bytes, span_bytes = f8_block_range(mins.float(), (mins + scale * levels).float())
        rows[..., ncode:ncode + nb], rows[..., ncode + nb:] = span_bytes, mn_bytes
        return rows, off
    rows[..., ncode:ncode + 2 * nb] = scale.half().view(torch.uint8)
    rows[..., ncode + 2 * nb:] = mins.half().view(torch.uint8)
    return rows, off


def make_inputs(b: int, t: int, fmt: str, rank: "int | Sequence[int]", seed: int = 0, dev: str = "cuda",
                heads: tuple[int, int] = MIXTRAL_HEADS, head_dim: int = HEAD_DIM, group: int = GROUP,
                rank_v: "int | Sequence[int] | None" = None, rope: str = "rotate_half") -> tuple:
    """The 20 arguments of ``latent_attention_triton`` / ``latent_attention_ref`` for one decode step.

    Args:
        b, t: batch and context (slots 0..t-1 attended; the new token is at slot t-1, position t-1).
        fmt: the latent format of K and V; rank: latent coordinates per KV head (<= ``group * head_dim``) of K,
            and of V unless ``rank_v`` is given; a sequence gives the heads' ranks in turn, repeated over the KV
            heads (``[32, 64]``: unequal ranks within a layer, as calibrated plans have them; the bases are as wide
            as the largest).
        seed: seeds one generator on ``dev`` (same arguments, same inputs).
        heads: (query heads H, KV heads Hkv), H a multiple of Hkv.
        head_dim: D; group: layers per latent group (the basis block is D rows of a (group * D, rank) basis).
        rope: ``"rotate_half"`` (pre-RoPE key bases: the kernel rotates the rebuilt keys) or ``"none"`` (post-RoPE
            key bases, ``LatentBases.key_space``: no table is read; cos / sin are then stand-ins).
    Returns:
        ``(q (b, H, 1, D) bf16, latent_k, latent_v, basis_k (Hkv, D, rank) bf16, basis_v, k_offsets, v_offsets,
        cos (t, D) bf16, sin, slot_pos (b, t) int32, rope, D (0 without RoPE), new_k (b, Hkv, 1, D) bf16, new_v,
        slots (1,) int64, None (no mask), D**-0.5, t, fmt, fmt)``; the basis columns are orthonormal over the
        group's rows, scaled so that rebuilt keys have std ~1.
    Raises:
        ValueError: ``fmt`` does not parse or ``rope`` is neither form; RuntimeError (from QR) for rank >
            group * head_dim.
    """
    if rope not in ("rotate_half", "none"):
        raise ValueError(f"rope must be 'rotate_half' or 'none', got {rope!r}")
    h, hkv = heads
    d = head_dim
    gen = torch.Generator(device=dev).manual_seed(seed)
    k_ranks = [int(r) for r in (rank if isinstance(rank, Sequence) else [rank])]
    v_ranks = k_ranks if rank_v is None else [int(r) for r in (rank_v if isinstance(rank_v, Sequence) else [rank_v])]
    lk, ko = make_latent(b, t, [k_ranks[i % len(k_ranks)] for i in range(hkv)], fmt, gen, dev)
    lv, vo = make_latent(b, t, [v_ranks[i % len(v_ranks)] for i in range(hkv)], fmt, gen, dev)

    def basis_block(r: int) -> torch.Tensor:
        p = torch.linalg.qr(torch.randn(hkv, group * d, r, device=dev, generator=gen)).Q  # orthonormal columns
        return (p[:, :d] * math.sqrt(group / 2)).to(torch.bfloat16).contiguous()  # keys of std ~1

    bk, bv = basis_block(max(k_ranks)), basis_block(max(v_ranks))
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=dev).float() / d))
    ang = torch.arange(t, device=dev).float()[:, None] * inv[None]
    ang = torch.cat((ang, ang), dim=-1)
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    slot_pos = torch.arange(t, device=dev, dtype=torch.int32).expand(b, t).contiguous()
    q = torch.randn(b, h, 1, d, device=dev, dtype=torch.bfloat16, generator=gen)
    nk = torch.randn(b, hkv, 1, d, device=dev, dtype=torch.bfloat16, generator=gen)
    nv = torch.randn(b, hkv, 1, d, device=dev, dtype=torch.bfloat16, generator=gen)
    slots = torch.tensor([t - 1], device=dev)
    return (q, lk, lv, bk, bv, ko, vo, cos, sin, slot_pos, rope, d if rope != "none" else 0, nk, nv, slots, None,
            d**-0.5, t, fmt, fmt)


def ref_chunked(args: tuple, chunk: int) -> torch.Tensor:
    """``latent_attention_ref`` over batch chunks of ``chunk`` sequences (every per-sequence tensor sliced).

    Args:
        args: a :func:`make_inputs` tuple; chunk: sequences per reference call (bounds its fp32 intermediates).
    Returns:
        (B, H, 1, D) in q's dtype, fp32 math: equal to one call over the whole batch.
    """
    b = args[0].shape[0]
    outs = []
    for i in range(0, b, chunk):
        sl = slice(i, i + chunk)
        a = list(args)
        for k in (0, 1, 2, 9, 12, 13):
            a[k] = args[k][sl]
        outs.append(ref.latent_attention_ref(*a))
    return torch.cat(outs)


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    """``||out - want|| / ||want||`` (Frobenius, in fp32) as a float."""
    return float((out.float() - want.float()).norm() / want.float().norm())


def bench(fn: Callable[[], Any], warmup: int = 20, rep: int = 60) -> float:
    """Median milliseconds of ``fn()`` by ``triton.testing.do_bench`` (``warmup`` / ``rep`` in ms of calls).

    CUDA only: the benchmark never times on CPU (no timing claims there).

    Raises:
        RuntimeError: no CUDA device.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("bench times CUDA work only (no timing on CPU)")
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))  # ms


#: How the last :func:`graph_bench` call timed: "cuda-graph replay" or "launches (<why capture failed>)".
LAST_TIMING: dict = {}


def paged_latents(args: tuple, page: int, layout: str = "row-major", seed: int = 0) -> tuple[tuple, torch.Tensor]:
    """:func:`make_inputs`' arguments with the static latents (B, T, W) moved into page pools of ``page`` slots.

    The pools are ``(B * T / page + 1, page, W)`` in ``layout`` (:data:`~ckvp_compile.kernels.latent_layout.LAYOUTS`;
    ``CKVPStaticCache(page_size=page, latent_layout=layout)`` stores them so), each sequence's pages at a random
    permutation of the pool's pages (a long-running server's pool; the last page unused, as the store's trash page).
    A unit-major pool of 64-slot pages holds each 64-slot tile's byte columns side by side: the MMA pass reads one
    head's tile as one contiguous run per latent.

    Args:
        args: the 20 arguments of :func:`make_inputs` (latents (B, T, W), uint8 or float, on any device).
        page: P, slots per page; layout: the pools' layout; seed: the page permutation's seed (a CPU generator).
    Returns:
        (the arguments with the pools (same dtype and device as the latents) in place of the latents, the
        (B, T / page) int32 page table on the latents' device).
    Raises:
        ValueError: ``page`` < 1 or not dividing T, or a layout not in ``LAYOUTS`` (from ``to_layout``).
    Source: vLLM's page table (Kwon et al., SOSP 2023), as :mod:`ckvp_compile.runtime.store` pages its latents.
    """
    from ckvp_compile.kernels.latent_layout import to_layout

    lk = args[1]
    b, t, w = lk.shape
    if page < 1 or t % page:
        raise ValueError(f"page size must be >= 1 and divide the context {t}, got {page}")
    n = b * t // page
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(lk.device)

    def pool(x: torch.Tensor) -> torch.Tensor:
        p = torch.zeros(n + 1, page, w, dtype=x.dtype, device=x.device)
        p[perm] = x.reshape(n, page, w)
        return to_layout(p, layout)

    return (args[0], pool(args[1]), pool(args[2])) + tuple(args[3:]), perm.view(b, t // page).to(torch.int32)


def graph_bench(fn: Callable[[], Any], rep: int = 60) -> float:
    """Median milliseconds of ``fn()`` replayed in a CUDA graph (``triton.testing.do_bench_cudagraph``): device
    time without the host's launch overhead, as a decode step under CUDA graphs sees it. Falls back to
    :func:`bench` (launches) when capture fails; :data:`LAST_TIMING` says which.

    Raises:
        RuntimeError: no CUDA device.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("graph_bench times CUDA work only (no timing on CPU)")
    from triton.testing import do_bench_cudagraph

    fn()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    try:
        ms = float(do_bench_cudagraph(fn, rep=rep, return_mode="median"))
        LAST_TIMING["how"] = "cuda-graph replay"
        return ms
    except Exception as e:  # noqa: BLE001 - a callable that cannot be captured is timed by launches instead
        torch.cuda.synchronize()
        LAST_TIMING["how"] = f"launches ({type(e).__name__}: {str(e)[:120]})"
        return bench(fn)


def kernel_times(fn: Callable[[], Any], n: int = 10) -> dict[str, float]:
    """Device microseconds of each kernel launch of ``fn()``, in launch order: ``{"<i>:<name>": us}`` (mean over
    ``n`` profiled calls after one untimed call; ``torch.profiler``, CUPTI; names cut to 60 characters). Launch
    order tells apart the launches of one kernel (the two passes of the per-head path are both
    ``_latent_attention_split_kernel``).

    Raises:
        RuntimeError: no CUDA device, or calls that did not launch the same number of kernels.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("kernel_times profiles CUDA kernels only")
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    seq = sorted((ev.time_range.start, ev.name[:60], ev.time_range.elapsed_us()) for ev in prof.events()
                 if "CUDA" in str(getattr(ev, "device_type", "")))
    if len(seq) % n:
        raise RuntimeError(f"{len(seq)} kernel launches over {n} calls: not the same kernels per call")
    per = len(seq) // n
    return {f"{i}:{seq[i][1]}": round(sum(seq[c * per + i][2] for c in range(n)) / n, 2) for i in range(per)}


def copy_bandwidth(device: str = "cuda", gib: float = 2.0) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written per second), copying ``gib`` GiB of fp32
    (median of :func:`bench`); 0.0 on CPU (not measured)."""
    if device != "cuda":
        return 0.0
    src = torch.randn(int(gib * 2**30) // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3)


def launch_shape(config, b: int, h: int, hkv: int, kv_len: int, s: int = 1) -> dict:
    """How ``latent_attention_triton`` launches with ``config`` (a ``DecodeConfig``) at this shape, as its launcher
    decides: ``two_pass`` (False when one sequence's scores would exceed ``MAX_SCORES_BYTES``), ``batch_slices``
    (how many slices of the batch the two passes run on, each within that cap) and ``n_split``, the programs along
    the context of the pass that writes the split workspaces (flash-decoding's split count) in the largest slice
    (``slice_batch`` sequences)."""
    from ckvp_compile.kernels import latent_attention_triton as lat

    slices = lat.score_batch_slices(b, h, s, int(kv_len)) if config.two_pass else None
    two_pass = slices is not None
    rows = max(b1 - b0 for b0, b1 in slices) if two_pass else b  # the largest slice
    block_n = (config.block_n_v or config.block_n) if two_pass else config.block_n
    target = ((getattr(config, "target_programs_v", None) or config.target_programs) if two_pass
              else config.target_programs)
    n_split, _ = lat.context_splits(config, int(kv_len), block_n, rows * hkv * s, target)
    return {"two_pass": two_pass, "batch_slices": len(slices) if two_pass else 1, "slice_batch": rows,
            "n_split": n_split}


def kernel_bytes(args: tuple, n_split: int, rv_pad: int, two_pass: bool = False) -> dict:
    """Bytes one ``latent_attention_triton`` call reads or writes through memory, counted from its inputs.

    Args:
        args: a :func:`make_inputs` tuple (heads taken from q and the basis blocks).
        n_split: programs along the context (:func:`launch_shape`); rv_pad: the value rank padded to a power of 2.
        two_pass: the scores (B, H, T) fp32 are written by the key pass and read by the value pass.
    Returns:
        ``{"latent": bytes of the K and V latent rows (each read once), "total": latent + slot positions + the
        cos/sin rows + the basis blocks + q, new K/V and the output + the split workspaces (m, l, acc: written,
        then read by the merge) + the two-pass scores (written, then read)}``, in bytes.
    """
    q, lk, lv, bk, bv, _, _, cos, sin, slot_pos, _, _, nk, nv, *_ = args
    b, t = lk.shape[0], lk.shape[1]
    h, hkv = q.shape[1], bk.shape[0]
    latent = lk.numel() * lk.element_size() + lv.numel() * lv.element_size()
    tables = args[10] != "none"  # without RoPE neither the slot positions nor the tables are read
    other = (tables * (slot_pos.numel() * slot_pos.element_size() + 2 * t * cos.shape[1] * cos.element_size())
             + (bk.numel() + bv.numel()) * 2 + (q.numel() + nk.numel() + nv.numel() + q.numel()) * 2
             + 2 * b * hkv * n_split * (h // hkv) * (rv_pad + 2) * 4
             + (2 * b * h * t * 4 if two_pass else 0))  # the two-pass scores, written then read
    return {"latent": latent, "total": latent + other}


def kernel_stats() -> dict:
    """Registers per thread, spilled registers and shared memory of the last launched split, head-chunk, absorbed,
    lane, word or MMA (and, two-pass, key pass: ``scores_`` keys; the merge kernel, unless the merge is fused: ``reduce_`` keys)
    kernel, as Triton reports them for a compiled CUDA kernel, and ``batch_slices``: how many slices of the batch
    the two passes ran on (:func:`~ckvp_compile.kernels.latent_attention_triton.score_batch_slices`); clears the
    record."""
    from ckvp_compile.kernels import latent_attention_triton as lat

    out = {}
    for kind, prefix in (("split", ""), ("chunks", ""), ("absorbed_kernel", ""), ("lanes_kernel", ""),
                         ("words_kernel", ""), ("mma_kernel", ""),
                         ("scores", "scores_"), ("reduce", "reduce_")):
        k = lat._LAST_LAUNCH.get(kind)
        for name in ("n_regs", "n_spills", "shared"):
            v = getattr(k, name, None)
            if isinstance(v, (int, float)):
                out[prefix + name] = v
    if "batch_slices" in lat._LAST_LAUNCH:
        out["batch_slices"] = lat._LAST_LAUNCH["batch_slices"]
    lat._LAST_LAUNCH.clear()
    return out


def dense_times(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sdpa: Callable | None = None, flex: bool = False,
                timer: Callable[[Callable[[], Any]], float] = bench) -> dict:
    """Time dense decode attention of ``q`` (B, H, 1, D) over ``k``, ``v`` (B, Hkv, T, D) (CUDA, bf16).

    Args:
        sdpa: the compiled SDPA to time (``torch.compile`` of ``F.scaled_dot_product_attention(q, k, v,
            enable_gqa=True)``); None: compile one here (``dynamic=False``).
        flex: also FlexAttention under ``torch.compile(dynamic=False)`` (its flash-decoding kernel for short
            queries), compiled on the first call (``flex_compile_s``).
        timer: ms of a callable (:func:`bench`).
    Returns:
        ``sdpa_eager_ms``, ``sdpa_compiled_ms`` (or ``sdpa_compiled_error``), with ``flex``: ``flex_compile_s``,
        ``flex_compiled_ms`` (or ``flex_error``); a failing baseline is recorded, never raised.
    """
    if sdpa is None:
        sdpa = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), dynamic=False)
    dense = {"sdpa_eager_ms": timer(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))}
    try:
        dense["sdpa_compiled_ms"] = timer(lambda: sdpa(q, k, v))
    except Exception as e:  # noqa: BLE001 - a baseline that does not compile is reported
        dense["sdpa_compiled_error"] = repr(e)[:300]
    if flex:
        try:
            from torch.nn.attention.flex_attention import flex_attention

            fx = torch.compile(flex_attention, dynamic=False)
            t0 = time.time()
            fx(q, k, v, enable_gqa=True)
            dense["flex_compile_s"] = time.time() - t0
            dense["flex_compiled_ms"] = timer(lambda: fx(q, k, v, enable_gqa=True))
        except Exception as e:  # noqa: BLE001
            dense["flex_error"] = repr(e)[:300]
    return dense


def estimate_bytes(b: int, t: int, fmt: str, rank: int, heads: tuple[int, int] = MIXTRAL_HEADS,
                   head_dim: int = HEAD_DIM, ref_chunk: int = REF_CHUNK) -> dict:
    """Peak memory (bytes) one row allocates, estimated before allocating anything.

    Returns:
        ``{"latents", "tables" (cos/sin, slot positions, q, new K/V, bases), "kernel" (two-pass scores,
        split workspaces, output), "reference" (one batch chunk's fp32 intermediates of ``latent_attention_ref``:
        dequantized latents, rebuilt keys and the RoPE temporaries, scores and weights, about 1.5x the tensors
        counted), "rows" (the sum: the latent-attention phase), "dense" (K and V of the dense baseline, bf16, plus
        q and the output; a separate phase)}``.
    Raises:
        ValueError: ``fmt`` does not parse.
    """
    from ckvp_compile.kernels.latent_attention_triton import _np2, default_config

    h, hkv = heads
    d = head_dim
    f = parse_latent_format(fmt)
    off = [r * rank for r in range(hkv + 1)]
    latents = 2 * b * t * f.row_width(off) * (1 if f.quantized else 2)
    tables = 2 * t * d * 2 + b * t * 4 + 4 * b * h * d * 2 + 2 * hkv * d * rank * 2
    rpad = _np2(rank)  # the launcher's padded rank (a power of 2, >= 16)
    cfg = default_config(h // hkv, rpad)
    shape = launch_shape(cfg, b, h, hkv, t)
    kernel = ((shape["slice_batch"] * h * t * 4 if shape["two_pass"] else 0)  # one slice's scores at a time
              + b * h * shape["n_split"] * (rpad + 2) * 4
              + b * h * d * 4)
    c = min(ref_chunk, b)
    reference = int(1.5 * c * t * (5 * hkv * d * 4 + 2 * d * 4 + 4 * hkv * rank * 4 + 3 * h * 4))
    dense = 2 * b * hkv * t * d * 2 + 2 * b * h * d * 2
    return {"latents": latents, "tables": tables, "kernel": kernel, "reference": reference,
            "rows": latents + tables + kernel + reference, "dense": dense}


def _free_bytes(device: str) -> int:
    """Bytes the process could still allocate: CUDA free memory (after emptying torch's cache), else the host's
    MemAvailable."""
    if device == "cuda":
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _versions(device: str) -> dict:
    import ckvp_compile

    v = {"torch": torch.__version__, "ckvp_compile": ckvp_compile.__version__, "python": platform.python_version()}
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:  # pragma: no cover
        v["triton"] = None
    if device == "cuda":
        v["gpu"] = torch.cuda.get_device_name()
        v["sm_count"] = torch.cuda.get_device_properties(0).multi_processor_count
    else:
        v["cpu"] = platform.processor() or platform.machine() or "cpu"
        v["triton_interpreter"] = _interpreting()
    return v


def run(formats: Sequence[tuple[str, int]], batches: Sequence[int], contexts: Sequence[int],
        heads: tuple[int, int] = MIXTRAL_HEADS, head_dim: int = HEAD_DIM, group: int = GROUP, device: str = "cuda",
        flex: bool = False, budget_s: float = 900.0, seed: int = 0, mem_fraction: float = 0.9,
        log: Callable[[str], None] = print, cuda_graphs: bool = False, key_space: str = "pre_rope",
        latent_layout: str = "row-major", page_size: int = 0) -> dict:
    """Run the benchmark (see the module docstring); rows in order batch, context, format.

    Args:
        formats: (latent format, rank per KV head) pairs, e.g. ``[("int4/32", 256)]``.
        batches, contexts: the grid (sequences; cached slots, the new token's included).
        heads: (H, Hkv); head_dim: D; group: layers per latent group.
        device: ``"cuda"`` (timed) or ``"cpu"`` (never timed; the kernel runs only under the Triton interpreter,
            else the reference alone).
        flex: time FlexAttention decoding as a dense baseline too.
        budget_s: rows starting after this many seconds are recorded as skipped.
        mem_fraction: a row runs only if its :func:`estimate_bytes` is within this share of the free memory.
        log: where progress lines go.
        cuda_graphs: time by CUDA-graph replay (:func:`graph_bench`; each row's ``timing_how`` says whether the
            kernel's capture worked) instead of launches: at small shapes the launcher's host work otherwise
            dominates (H200: ~0.5 ms per call at batch 1-8, 4k, against 0.02-0.05 ms for eager SDPA).
        key_space: ``"pre_rope"`` (keys rebuilt and rotated in the kernel) or ``"post_rope"`` (key bases of the
            keys as cached, ``LatentBases.key_space``: a call without RoPE, the absorbed kernel for int latents).
        latent_layout: how the latents lie in memory (:data:`~ckvp_compile.kernels.latent_layout.LAYOUTS`, as
            ``CKVPStaticCache(latent_layout=...)`` stores them): ``"row-major"`` or ``"unit-major"`` (each byte
            column contiguous over the slots: the MMA pass's 16-byte column reads).
        page_size: P > 0: the latents in page pools of P slots at randomly permuted pages (:func:`paged_latents`,
            as ``CKVPStaticCache(page_size=P)``); every context must be a multiple of P. 0: static latents. The
            reference is computed from the static rows; ``op_rel_err`` checks the op on the timed layout / pool.
    Returns:
        ``{"versions": {torch, triton, gpu or cpu, ...}, "copy_bandwidth_GBps" (0 on CPU), "heads", "head_dim",
        "group", "key_space", "latent_layout", "page_size", "device", "elapsed_s", "rows": [...]}``; a row has
        format, rank, heads, batch, context and either ``skipped`` (the reason: memory, time budget) or ``error``,
        or bytes_latent / bytes_total (bytes one call reads, :func:`kernel_bytes`), dense_bytes, byte_ratio (dense /
        latent bytes), n_split, two_pass, config, ``kernel`` ("triton", "triton interpreter" or "not run: ..."),
        rel_err (and on CUDA op_rel_err) against the reference, and on CUDA ms, GBps, copy_share, the dense timings,
        dense_best_ms / dense_best, dense_GBps, speedup (dense ms / latent ms), mem_estimate_bytes and
        mem_peak_bytes.
    Raises:
        ValueError: a bad format, rank, head split, page size (negative, or not dividing a context) or an
            unavailable device.
    """
    from ckvp_compile.kernels.latent_attention_triton import default_config, latent_attention_triton

    if page_size < 0 or (page_size and any(t % page_size for t in contexts)):
        raise ValueError(f"page_size must be >= 0 and divide every context {list(contexts)}, got {page_size}")

    h, hkv = heads
    if hkv < 1 or h < hkv or h % hkv:
        raise ValueError(f"heads must be H:Hkv with H a multiple of Hkv >= 1, got {h}:{hkv}")
    for fmt, rank in formats:
        f = parse_latent_format(fmt)
        if f.quantized and not f.mixed and f.bits not in (8, 4, 2):
            raise ValueError(f"format {fmt!r}: the kernel reads float, int8/4/2, mxint8/4 and mix formats")
        if not 1 <= rank <= min(512, group * head_dim):
            raise ValueError(f"rank {rank} of {fmt!r} must be in [1, {min(512, group * head_dim)}]")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but CUDA is not available")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda or cpu, got {device!r}")
    if key_space not in ("pre_rope", "post_rope"):
        raise ValueError(f"key_space must be 'pre_rope' or 'post_rope', got {key_space!r}")
    from ckvp_compile.kernels.latent_layout import LAYOUTS

    if latent_layout not in LAYOUTS:
        raise ValueError(f"latent_layout must be one of {LAYOUTS}, got {latent_layout!r}")
    on_cuda = device == "cuda"
    kernel_note = "triton" if on_cuda else "triton interpreter" if _interpreting() else (
        "not run: CPU without the Triton interpreter (set TRITON_INTERPRET=1 before triton is imported); "
        "reference only")
    if on_cuda:
        from ckvp_compile.ops import latent_attention_cuda, register_all

        register_all()
        latent_attention_cuda.USE_TRITON = True  # the op's CUDA kernel runs the Triton kernels (checked: op_rel_err)
    start = time.perf_counter()
    versions = _versions(device)
    bw = copy_bandwidth(device)
    log(f"versions {versions}; copy bandwidth " + (f"{bw / 1e9:.0f} GB/s" if bw else "not measured (CPU)"))
    label = f"{h}:{hkv}"
    timer = graph_bench if cuda_graphs else bench
    rows: list[dict] = []
    for b in batches:
        for t in contexts:
            dense: dict | None = None
            for fmt, rank in formats:
                row: dict = {"format": fmt, "rank": rank, "heads": label, "batch": b, "context": t,
                             "key_space": key_space, "latent_layout": latent_layout, "page_size": page_size}
                rows.append(row)
                if time.perf_counter() - start > budget_s:
                    row["skipped"] = f"time budget ({budget_s:g} s) spent"
                    log(json.dumps(row))
                    continue
                free = _free_bytes(device)
                chunk = next((c for c in (REF_CHUNK, 2, 1) if estimate_bytes(b, t, fmt, rank, heads, head_dim, c)[
                    "rows"] <= mem_fraction * free), None)
                est = estimate_bytes(b, t, fmt, rank, heads, head_dim, chunk or 1)
                if chunk is None:
                    row["skipped"] = (f"memory: needs about {est['rows'] / 2**30:.1f} GiB, "
                                      f"{free / 2**30:.1f} GiB free")
                    log(json.dumps(row))
                    continue
                if on_cuda and dense is None:  # the dense baseline once per (batch, context), before the latents
                    dense = _dense_phase(b, t, heads, head_dim, est["dense"], free, mem_fraction, flex, seed,
                                         timer)
                try:
                    _latent_row(row, b, t, fmt, rank, heads, head_dim, group, seed, device, chunk, est, bw, dense,
                                default_config, latent_attention_triton, kernel_note, timer,
                                "none" if key_space == "post_rope" else "rotate_half", latent_layout, page_size)
                except Exception as exc:  # noqa: BLE001 - record and go on: one failure must not lose the run
                    row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                log(json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "config"}, default=str))
    return {"versions": versions, "copy_bandwidth_GBps": round(bw / 1e9, 1), "heads": label, "head_dim": head_dim,
            "group": group, "key_space": key_space, "latent_layout": latent_layout, "page_size": page_size,
            "device": device,
            "elapsed_s": round(time.perf_counter() - start, 1), "rows": rows}


def _dense_phase(b: int, t: int, heads: tuple[int, int], d: int, need: int, free: int, mem_fraction: float,
                 flex: bool, seed: int, timer: Callable[[Callable[[], Any]], float] = bench) -> dict:
    """Dense bf16 K/V of one (batch, context), timed by :func:`dense_times` (fresh compiles), then freed."""
    h, hkv = heads
    if need > mem_fraction * free:
        return {"skipped": f"memory: dense K/V need about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"}
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    torch._dynamo.reset()  # one compile per shape, never the recompile limit's eager fallback
    out = dense_times(q, k, v, flex=flex, timer=timer)
    del q, k, v
    torch.cuda.empty_cache()
    return out


def _latent_row(row: dict, b: int, t: int, fmt: str, rank: int, heads: tuple[int, int], d: int, group: int,
                seed: int, device: str, chunk: int, est: dict, bw: float, dense: dict | None, default_config,
                latent_attention_triton, kernel_note: str,
                timer: Callable[[Callable[[], Any]], float] = bench, rope: str = "rotate_half",
                latent_layout: str = "row-major", page_size: int = 0) -> None:
    """Fill one row: inputs, reference, kernel, bytes and (CUDA) times; see :func:`run`."""
    h, hkv = heads
    on_cuda = device == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated()
    args = make_inputs(b, t, fmt, rank, seed=seed + b * 7 + t, dev=device, heads=heads, head_dim=d, group=group,
                       rope=rope)
    kw: dict = {}
    want = ref_chunked(args, chunk)  # from the static rows: the same values as any layout or page pool holds
    # the byte count's view of the static rows (shapes only: a pool holds the same rows plus a spare page)
    static = ((args[0],) + tuple(torch.empty(x.shape, dtype=x.dtype, device="meta") for x in args[1:3])
              + tuple(args[3:]))
    if page_size:
        args, kw["page_table"] = paged_latents(args, page_size, latent_layout, seed)
    elif latent_layout != "row-major":
        from ckvp_compile.kernels.latent_layout import to_layout

        args = (args[0], to_layout(args[1], latent_layout), to_layout(args[2], latent_layout)) + tuple(args[3:])
    from ckvp_compile.kernels.latent_attention_triton import _np2

    rpad = _np2(rank)  # the launcher's padded rank (a power of 2, >= 16): its default config and workspace width
    lf = parse_latent_format(fmt)
    cfg = default_config(h // hkv, rpad, table_free=rope == "none", rank=rank, rank_v=rank,
                         quantized_keys=lf.quantized and not lf.pow2, code_bits=lf.bits if lf.quantized else None)
    # (the launcher's own default for this call: latent_attention_triton's _launch builds it the same way)
    shape = launch_shape(cfg, b, h, hkv, t)
    nbytes = kernel_bytes(static, shape["n_split"], rpad, shape["two_pass"])
    dense_bytes = 2 * b * hkv * t * d * 2
    row.update(bytes_latent=nbytes["latent"], bytes_total=nbytes["total"], dense_bytes=dense_bytes,
               byte_ratio=dense_bytes / nbytes["latent"], **shape, config=dataclasses.asdict(cfg), kernel=kernel_note,
               mem_estimate_bytes=est["rows"])
    if not row["kernel"].startswith("not run"):
        from ckvp_compile.kernels import latent_attention_triton as lat

        out = latent_attention_triton(*args, config=cfg, **kw)
        one_pass = {k_: lat._LAST_LAUNCH.get(k_, 0) for k_ in ("lanes", "absorbed", "head_chunks")}
        per_head = {k_: bool(lat._LAST_LAUNCH.get(k_)) for k_ in ("words", "mma")}  # one KV head per program
        if any(one_pass.values()) or any(per_head.values()):  # a one-pass kernel ran: no scores, its own split
            row.update(two_pass=False, n_split=lat._LAST_LAUNCH["n_split"], batch_slices=1,
                       **{f"{k_}_heads": v_ for k_, v_ in one_pass.items()}, **{f"{k_}_pass": v_ for k_, v_ in
                                                                                per_head.items()})
            nbytes = kernel_bytes(static, row["n_split"], rpad, False)
            row.update(bytes_latent=nbytes["latent"], bytes_total=nbytes["total"])
        row["rel_err"] = rel_err(out, want)
        if on_cuda:
            op_out = torch.ops.ckvp.latent_attention(*args, page_table=kw.get("page_table"))  # the timed layout / pool
            row["op_rel_err"] = rel_err(op_out, want)
        del out
    del want
    if not on_cuda:
        row["timing"] = "none on CPU"
        return
    ms = timer(lambda: latent_attention_triton(*args, config=cfg, **kw))
    if timer is graph_bench:
        row["timing_how"] = LAST_TIMING.get("how")
    row.update(kernel_stats())
    row["mem_peak_bytes"] = torch.cuda.max_memory_allocated() - base_mem
    gbps = nbytes["total"] / (ms * 1e-3)
    row.update(ms=ms, GBps=gbps / 1e9, copy_share=gbps / bw if bw else None)
    if dense and "skipped" not in dense:
        row.update(dense)
        timed = {k_[:-3]: v_ for k_, v_ in dense.items() if k_.endswith("_ms")}
        best = min(timed, key=timed.get)
        row.update(dense_best=best, dense_best_ms=timed[best], dense_GBps=dense_bytes / (timed[best] * 1e-3) / 1e9,
                   speedup=timed[best] / ms, speedup_over_byte_ratio=(timed[best] / ms) / row["byte_ratio"])
    elif dense:
        row["dense_skipped"] = dense["skipped"]


def to_markdown(result: dict, command: str) -> str:
    """The result as a markdown report: device, command, versions, copy bandwidth, definitions, one table row per
    (batch, context, format) with time, bytes read, GB/s, share of copy bandwidth, dense time, speedup, the byte
    ratio and the speedup's share of it."""
    v = result["versions"]
    dev = v.get("gpu") or f"CPU ({v.get('cpu')}), no timing"
    bw = result["copy_bandwidth_GBps"]
    copy = f"{bw} GB/s (read + write)" if bw else "not measured (CPU)"
    lines = [f"# ckvp-bench attention: one layer's latent decode attention ({dev})", "",
             f"Command: `{command}`  ", f"Versions: {v}  ",
             f"Heads {result['heads']}, head_dim {result['head_dim']}, latents of a group of {result['group']} layers "
             f"(rank per KV head for K and for V), {result.get('key_space', 'pre_rope')} key bases, "
             f"{result.get('latent_layout', 'row-major')} latents"
             + (f" in pools of {result['page_size']}-slot pages (random page order)" if result.get("page_size")
                else "") + "; "
             f"copy bandwidth {copy}; "
             f"run took {result['elapsed_s']} s.  ",
             "Bytes: what one kernel call reads and writes (latent rows once, positions, RoPE rows, bases, q, new "
             "tokens, split workspaces, two-pass scores); % copy: achieved GB/s over the copy bandwidth; dense: the "
             "fastest of SDPA (eager, torch.compile) and FlexAttention decoding (torch.compile, with --flex) over "
             "bf16 K/V of the same context; speedup: dense ms / latent ms; dense/latent bytes: the K/V bytes over "
             "the latent bytes; of byte ratio: speedup / (dense/latent bytes), the kernel's goal >= 0.8 (its bytes "
             "read at 80% of dense's bandwidth or more).", "",
             "| format | rank | B | T | rel err | ms | MB read | GB/s | % copy | dense ms | speedup | "
             "dense/latent bytes | of byte ratio | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def num(r: dict, key: str, spec: str, scale: float = 1.0) -> str:
        return format(r[key] * scale, spec) if r.get(key) is not None else "-"

    for r in result["rows"]:
        note = r.get("skipped") or r.get("error") or r.get("dense_skipped") or ""
        if not note and r.get("kernel", "").startswith("not run"):
            note = r["kernel"]
        elif not note and "dense_best" in r:
            failed = [k_[:-len("_error")] for k_ in ("sdpa_compiled_error", "flex_error") if k_ in r]
            note = f"dense: {r['dense_best']}" + (f" ({', '.join(failed)} failed: see the JSON)" if failed else "")
        elif not note and "timing" in r:
            note = f"{r['kernel']}; {r['timing']}"
        mb = num(r, "bytes_total", ".4g" if r.get("bytes_total", 0) < 1e9 else ".0f", 1e-6)
        lines.append(f"| {r['format']} | {r['rank']} | {r['batch']} | {r['context']} | {num(r, 'rel_err', '.1e')} | "
                     f"{num(r, 'ms', '.3f')} | {mb} | {num(r, 'GBps', '.0f')} | "
                     f"{num(r, 'copy_share', '.1f', 100)} | {num(r, 'dense_best_ms', '.3f')} | "
                     f"{num(r, 'speedup', '.2f')} | {num(r, 'byte_ratio', '.2f')} | "
                     f"{num(r, 'speedup_over_byte_ratio', '.3f')} | {note} |")
    return "\n".join(lines) + "\n"


def _format_rank(text: str) -> tuple[str, int]:
    fmt, sep, rank = text.rpartition(":")
    if not sep or not rank.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not FORMAT:RANK (e.g. int4/32:256)")
    try:
        parse_latent_format(fmt)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return fmt, int(rank)


def _heads(text: str) -> tuple[int, int]:
    a, sep, b = text.partition(":")
    if not (sep and a.isdigit() and b.isdigit()) or int(b) < 1 or int(a) < int(b) or int(a) % int(b):
        raise argparse.ArgumentTypeError(f"{text!r} is not H:HKV with H a multiple of HKV >= 1 (e.g. 32:8)")
    return int(a), int(b)


def main(argv: Sequence[str] | None = None) -> int:
    """``ckvp-bench attention [args]``; returns the exit status (argparse exits with 2 for a usage error)."""
    p = argparse.ArgumentParser(prog="ckvp-bench attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=_heads, help="query heads:KV heads (default 32:8, Mixtral-8x7B; 16:16 for "
                   "Qwen1.5-MoE; --tiny: 4:2)")
    p.add_argument("--batches", nargs="+", type=int, help="default 1 8 32 (--tiny: 1 2)")
    p.add_argument("--contexts", nargs="+", type=int, help="default 4096 32768 131072 (--tiny: 40 72)")
    p.add_argument("--formats", nargs="+", type=_format_rank, metavar="FORMAT:RANK",
                   help=f"latent format and rank per KV head (default {' '.join(DEFAULT_FORMATS)}; --tiny: "
                        f"{' '.join(TINY['formats'])})")
    p.add_argument("--flex", action="store_true", help="also time FlexAttention decoding (torch.compile) as dense")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="time the kernel and the dense baselines by CUDA-graph replay (no host launch overhead, as in "
                        "a decode step under CUDA graphs); default: launches (triton.testing.do_bench)")
    p.add_argument("--budget-s", type=float, default=900.0, help="record rows starting after this long as skipped")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"],
                   help="default: cuda where available, else cpu; cpu requires --tiny (the full shapes would run "
                        "the PyTorch reference only: minutes, GBs of memory, no timing); --batches/--contexts/"
                        "--heads/--formats still choose the rows under --tiny")
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes (4:2 heads, head_dim 32): CPU smoke test; no timing on CPU, the kernel runs "
                        "only under TRITON_INTERPRET=1")
    p.add_argument("--key-space", choices=["pre_rope", "post_rope"], default="pre_rope",
                   help="pre_rope (default): latents of pre-RoPE keys, rebuilt and rotated in the kernel; post_rope: "
                        "latents of the keys as cached (LatentBases.key_space), a call that reads no RoPE table")
    p.add_argument("--latent-layout", choices=["row-major", "unit-major"], default="row-major",
                   help="how the latents lie in memory (CKVPStaticCache(latent_layout=...)): each slot's row "
                        "contiguous, or each byte column contiguous over the slots (the MMA pass's column reads)")
    p.add_argument("--page-size", type=int, default=0, metavar="P",
                   help="page the latents in pools of P slots at random page order (CKVPStaticCache(page_size=P)); "
                        "every context must be a multiple of P. 64 with unit-major: each tile's columns contiguous")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the full result as JSON here")
    p.add_argument("--out", type=Path, help="write the markdown report here")
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.device == "cpu" and not args.tiny:
        p.error("--device cpu needs --tiny: on CPU nothing is timed and the full Mixtral shapes would run the PyTorch "
                "reference for minutes in GBs of memory. Fix: add --tiny for the CPU smoke test (--batches/"
                "--contexts/--heads/--formats still apply), or run with --device cuda on a GPU machine")
    heads = args.heads or (TINY["heads"] if args.tiny else MIXTRAL_HEADS)
    head_dim = TINY["head_dim"] if args.tiny else HEAD_DIM
    batches = args.batches or list(TINY["batches"] if args.tiny else (1, 8, 32))
    contexts = args.contexts or list(TINY["contexts"] if args.tiny else (4096, 32768, 131072))
    formats = args.formats or [_format_rank(f) for f in (TINY["formats"] if args.tiny else DEFAULT_FORMATS)]
    if any(b < 1 for b in batches):
        p.error(f"--batches must be >= 1, got {batches}")
    if any(t < 1 for t in contexts):
        p.error(f"--contexts must be >= 1, got {contexts}")
    if args.page_size < 0 or (args.page_size and any(t % args.page_size for t in contexts)):
        common = math.gcd(*contexts)
        p.error(f"--page-size {args.page_size}: must be >= 0 and divide every context ({contexts}); fix: a divisor "
                f"of {common} (the contexts' greatest common divisor), e.g. --page-size "
                f"{64 if common % 64 == 0 else common}")
    for fmt, rank in formats:
        f = parse_latent_format(fmt)
        if f.quantized and not f.mixed and f.bits not in (8, 4, 2):
            p.error(f"--formats {fmt}: the kernel reads float, int8/4/2, mxint8/4 and mix formats")
        if not 1 <= rank <= min(512, GROUP * head_dim):
            p.error(f"--formats {fmt}:{rank}: the rank must be in [1, {min(512, GROUP * head_dim)}]")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available (--device cpu --tiny runs the smoke test)")
    if bad_path := output_path_error({"--json": args.json, "--out": args.out}):
        p.error(bad_path)
    command = "ckvp-bench attention " + " ".join(sys.argv[2:] if argv is None else argv)
    result = run(formats, batches, contexts, heads, head_dim, GROUP, args.device, args.flex, args.budget_s, args.seed,
                 cuda_graphs=args.cuda_graphs, key_space=args.key_space, latent_layout=args.latent_layout,
                 page_size=args.page_size)
    result["command"] = command
    write_result(result, to_markdown(result, command), args.json, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
