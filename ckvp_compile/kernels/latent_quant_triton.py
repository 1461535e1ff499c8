"""Triton quantize / dequantize kernels for the uniform latent storage formats (``int8``, ``int4``, ``int2``).

Layout, rounding rules and PyTorch references: :mod:`ckvp_compile.kernels.latent_format`
(:func:`~ckvp_compile.kernels.latent_format.quantize_latent_ref`,
:func:`~ckvp_compile.kernels.latent_format.dequantize_latent_ref`). One stored row per token::

    [ codes: head 0 (cb_0 bytes), head 1 (cb_1 bytes), ... | scales: NB fp16 | mins: NB fp16 ]

Kernels (grid ``(N, NB)``, one program per (row, block); a block never straddles heads):

* ``_quant_kernel``: loads the block's ``block`` coordinates of one head (a head's last block may be ragged: its
  missing coordinates are read as 0.0, exactly the reference's zero padding, so they take part in the block's
  min / max and their codes fill the last code byte just as in the reference), computes
  ``lo = min``, ``hi = max``; ``min = fp16(lo)`` round-to-nearest-even, stepped one fp16 ulp down when it lies
  above ``lo``; ``scale = fp16((hi - min) / levels)`` stepped one fp16 ulp up when ``min + levels * scale < hi``
  (the fp16 neighbours are taken on the raw 16-bit pattern, as ``torch.nextafter`` does, signed zeros included);
  ``code = round_half_even((x - min) / scale)`` clamped to ``[0, levels]`` (scale 0 divides by 1), packs
  ``8 / bits`` codes per byte little-endian (first code in the lowest bits) and stores the block's code bytes
  (only those inside the head's ``cb_h``), its fp16 scale and fp16 min (little-endian bytes).
* ``_dequant_kernel``: unpacks each coordinate's code from its byte, ``x = code * scale + min`` in fp32, and
  writes only the head's real coordinates (padding dropped).

Exactness (what is bit-exact against the reference and why):

* fp32 -> fp16 casts use Triton's default round-to-nearest-even (``fp_downcast_rounding`` ``"rtne"``), as
  ``Tensor.to(torch.float16)``.
* The two divisions use :func:`triton.language.math.div_rn` (IEEE round-to-nearest; plain ``/`` on fp32 may lower
  to an approximate ``div.full.f32`` on NVIDIA), as PyTorch's fp32 division.
* ``levels * scale`` (levels <= 255, fp16 scale: <= 19 significant bits) and ``code * scale`` are exact in fp32,
  so a fused multiply-add (Triton contracts by default) rounds exactly as PyTorch's separate multiply and add.
* Round-half-to-even is computed from exact operations (``floor``, the exact difference ``y - floor(y)`` for
  ``0 <= y < 2**23``, comparisons with 0.5, the parity of the floor), equal to ``torch.round``.

So the bytes are equal to ``quantize_latent_ref`` and the decoded values to ``dequantize_latent_ref`` bit for bit,
with one documented exception: when a block's minimum is a signed zero and the block holds both ``-0.0`` and
``+0.0`` (a ragged block's padding is ``+0.0``), which zero ``amin`` / ``tl.min`` return is unspecified in both
implementations, so the stored min may be ``0x0000`` vs ``0x8000`` (same value; the codes, the scale and every
decoded value are equal). The tests compare inputs with ``-0.0`` canonicalised and separately check that case up
to the zero's sign.

Status: exact under ``TRITON_INTERPRET=1`` (tests/kernels/test_latent_quant_triton.py) and on the H200 at real
shapes (B=8 x 4096 slots, rank 256 in three head splits, int8/int4/int2 at blocks 32 and 64, Gaussian and outlier
latents: every stored byte and every decoded bit equal; benchmarks/results/2026-11-29-latent-quant-h200), so
:data:`USE_TRITON` is True: the CUDA kernel of ``ckvp::latent_append`` (``ops.latent_attention_cuda``) quantizes
with :func:`quantize_latent_triton` for the formats it supports.

Errors: :class:`ValueError` for a format that is not a uniform ``int8`` / ``int4`` / ``int2`` format, a wrong
dtype / width of ``rows``, or (as the reference) a value that is not finite or beyond fp16's range;
:class:`NotImplementedError` for a CPU tensor without the interpreter.

Sources (read, not copied): KIVI (Liu et al., 2024, arXiv:2402.02750: asymmetric per-token / per-channel
quantization with a scale and zero point per group); Triton documentation (``triton.language``: ``reshape``,
``sum``, ``min`` / ``max`` reductions, ``math.div_rn``, ``tensor.to(bitcast=True)``,
https://triton-lang.org/main/python-api/triton.language.html).
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

import torch
import triton
import triton.language as tl

from .latent_format import LatentFormat, parse_latent_format

__all__ = ["USE_TRITON", "dequantize_latent_triton", "quantize_latent_triton", "unsupported_reason"]

#: Checked bit-equal on the H200 (module docstring): the CUDA ``ckvp::latent_append`` quantizes with these kernels.
#: Set False to force the reference quantizer.
USE_TRITON = True

_FP16_MAX = 65504.0


def unsupported_reason(fmt: "str | LatentFormat", device: torch.device) -> str | None:
    """None when these kernels handle ``fmt`` on ``device``, else why not (a string).

    Supported: uniform quantized formats (``int8`` / ``int4`` / ``int2`` with any valid block) on CUDA, or any
    device under ``TRITON_INTERPRET=1``. Not: ``"float"``, ``tern``, ``mix`` formats.
    """
    f = parse_latent_format(fmt)
    if not f.quantized or f.mixed or f.ternary or f.pow2:
        return f"format {f.name!r} is not a uniform int8/int4/int2 format"
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"device {torch.device(device).type!r} needs CUDA (or TRITON_INTERPRET=1)"
    return None


@functools.lru_cache(maxsize=256)
def _block_table(offsets: tuple[int, ...], name: str) -> tuple[torch.Tensor, int, int]:
    """(NB, 4) int32 per block: (first packed column, real coordinates, first code byte, code bytes stored);
    and the row's total code bytes and row width."""
    f = parse_latent_format(name)
    rows, byte = [], 0
    bpb = f.block * f.bits // 8
    for a, b in zip(offsets, offsets[1:]):
        r = int(b) - int(a)
        cb = -(-r * f.bits // 8)
        for k in range(-(-r // f.block)):
            rows.append((int(a) + k * f.block, min(f.block, r - k * f.block), byte + k * bpb,
                         min(bpb, cb - k * bpb)))
        byte += cb
    t = torch.tensor(rows, dtype=torch.int32).reshape(-1, 4)
    return t, byte, f.row_width(offsets)


def _check(fmt, device) -> LatentFormat:
    f = parse_latent_format(fmt)
    reason = unsupported_reason(f, device)
    if reason is not None:
        if reason.startswith("device"):
            raise NotImplementedError(f"latent quant Triton kernels NYI here: {reason}")
        raise ValueError(reason)
    return f


@triton.jit
def _quant_kernel(z_ptr, out_ptr, tab_ptr, z_stride, out_stride, n_code, NB,
                  BITS: tl.constexpr, BLOCK: tl.constexpr, BP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    zcol = tl.load(tab_ptr + blk * 4)
    nval = tl.load(tab_ptr + blk * 4 + 1)
    byte0 = tl.load(tab_ptr + blk * 4 + 2)
    nbytes = tl.load(tab_ptr + blk * 4 + 3)
    LEVELS: tl.constexpr = (1 << BITS) - 1
    PER: tl.constexpr = 8 // BITS

    j = tl.arange(0, BP)
    inblk = j < BLOCK
    x = tl.load(z_ptr + row * z_stride + zcol + j, mask=j < nval, other=0.0)  # ragged tail: 0.0 (the padding)
    lo = tl.min(tl.where(inblk, x, float("inf")), axis=0)
    hi = tl.max(tl.where(inblk, x, float("-inf")), axis=0)

    # min: fp16(lo) rtne, one ulp down if above lo (nextafter towards -inf on the bit pattern)
    mn16 = lo.to(tl.float16)
    mu = mn16.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    down = tl.where((mu & 0x7FFF) == 0, 0x8001, tl.where((mu & 0x8000) != 0, mu + 1, mu - 1))
    mu = tl.where(mn16.to(tl.float32) > lo, down, mu)
    mnf = mu.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    # scale: fp16((hi - min) / levels) rtne, one ulp up if the range is not covered
    s16 = tl.math.div_rn(hi - mnf, LEVELS * 1.0).to(tl.float16)
    su = s16.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    up = tl.where(su == 0x8000, 1, tl.where((su & 0x8000) != 0, su - 1, su + 1))
    su = tl.where(mnf + LEVELS * s16.to(tl.float32) < hi, up, su)
    sf = su.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    safe = tl.where(sf > 0, sf, 1.0)
    y = tl.math.div_rn(x - mnf, safe)
    fl = tl.floor(y)
    d = y - fl
    odd = (fl.to(tl.int32) & 1) == 1
    r = fl + tl.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)
    codes = tl.minimum(tl.maximum(r, 0.0), LEVELS * 1.0).to(tl.int32)

    c2 = tl.reshape(codes, (BP // PER, PER))
    shifts = tl.arange(0, PER) * BITS
    packed = tl.sum(c2 << shifts[None, :], axis=1)
    k = tl.arange(0, BP // PER)
    base = out_ptr + row * out_stride
    tl.store(base + byte0 + k, packed.to(tl.uint8), mask=k < nbytes)

    two = tl.arange(0, 2)
    tl.store(base + n_code + 2 * blk + two, ((su >> (8 * two)) & 0xFF).to(tl.uint8))
    tl.store(base + n_code + 2 * NB + 2 * blk + two, ((mu >> (8 * two)) & 0xFF).to(tl.uint8))


@triton.jit
def _dequant_kernel(rows_ptr, out_ptr, tab_ptr, rows_stride, out_stride, n_code, NB,
                    BITS: tl.constexpr, BP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    zcol = tl.load(tab_ptr + blk * 4)
    nval = tl.load(tab_ptr + blk * 4 + 1)
    byte0 = tl.load(tab_ptr + blk * 4 + 2)
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1

    base = rows_ptr + row * rows_stride
    j = tl.arange(0, BP)
    ok = j < nval
    byte = tl.load(base + byte0 + j // PER, mask=ok, other=0).to(tl.int32)
    code = (byte >> ((j % PER) * BITS)) & MASK

    two = tl.arange(0, 2)
    sb = tl.load(base + n_code + 2 * blk + two).to(tl.int32)
    mb = tl.load(base + n_code + 2 * NB + 2 * blk + two).to(tl.int32)
    su = tl.sum(sb << (8 * two), axis=0)
    mu = tl.sum(mb << (8 * two), axis=0)
    sf = su.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    mnf = mu.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    x = code.to(tl.float32) * sf + mnf  # code * scale is exact: FMA or not, one rounding
    tl.store(out_ptr + row * out_stride + zcol + j, x, mask=ok)


def quantize_latent_triton(z: torch.Tensor, offsets: Sequence[int], fmt: "str | LatentFormat") -> torch.Tensor:
    """Triton :func:`~ckvp_compile.kernels.latent_format.quantize_latent_ref` for uniform formats.

    Args:
        z: (..., R_tot) float (any float dtype; computed in fp32), packed latent coordinates, ``R_tot = offsets[-1]``.
        offsets: Hkv+1 ints (non-decreasing; head h owns columns ``offsets[h]:offsets[h+1]``).
        fmt: ``"int8"``, ``"int4/64"``, ``"int2/8"``, ... (uniform quantized formats only).
    Returns:
        (..., row_bytes) uint8, bit-equal to the reference (see the module docstring for the signed-zero min).
    Raises:
        ValueError: ``fmt`` is not a uniform int format, ``z``'s last dim is not ``offsets[-1]``, or a value is not
            finite or beyond fp16's range (|x| > 65504).
        NotImplementedError: a non-CUDA tensor without ``TRITON_INTERPRET=1``.
    Reference: kernels/latent_format.py::quantize_latent_ref
    """
    f = _check(fmt, z.device)
    offsets = tuple(int(o) for o in offsets)
    if z.shape[-1] != offsets[-1]:
        raise ValueError(f"z must be (..., {offsets[-1]}) for offsets {list(offsets)}, but got {tuple(z.shape)}")
    lead = z.shape[:-1]
    zf = z.float().reshape(lead.numel(), offsets[-1]).contiguous()
    # checked for host tensors only, as the reference does: on a GPU the check would synchronise every decode step
    if zf.numel() and not zf.is_cuda and not bool(torch.isfinite(zf).all() & (zf.abs() <= _FP16_MAX).all()):
        raise ValueError("latent values must be finite and within fp16 range (|x| <= 65504) to be quantized")
    tab, n_code, width = _block_table(offsets, f.name)
    n, nb = zf.shape[0], tab.shape[0]
    out = torch.empty(n, width, dtype=torch.uint8, device=z.device)
    if n and nb:
        _quant_kernel[(n, nb)](zf, out, tab.to(z.device), zf.stride(0), out.stride(0), n_code, nb,
                               BITS=f.bits, BLOCK=f.block, BP=triton.next_power_of_2(f.block))
    return out.view(*lead, width)


def dequantize_latent_triton(rows: torch.Tensor, offsets: Sequence[int], fmt: "str | LatentFormat") -> torch.Tensor:
    """Triton :func:`~ckvp_compile.kernels.latent_format.dequantize_latent_ref` for uniform formats.

    Args:
        rows: (..., row_bytes) uint8 as written by the quantizer.
        offsets: Hkv+1 ints.
        fmt: the uniform format they were written with.
    Returns:
        (..., R_tot) fp32, ``code * scale + min`` per coordinate, bit-equal to the reference.
    Raises:
        ValueError: ``fmt`` is not a uniform int format, or ``rows`` is not uint8 of the format's row width.
        NotImplementedError: a non-CUDA tensor without ``TRITON_INTERPRET=1``.
    Reference: kernels/latent_format.py::dequantize_latent_ref
    """
    f = _check(fmt, rows.device)
    offsets = tuple(int(o) for o in offsets)
    tab, n_code, width = _block_table(offsets, f.name)
    if rows.dtype != torch.uint8 or rows.shape[-1] != width:
        raise ValueError(f"rows must be uint8 (..., {width}) for {f.name} with offsets {list(offsets)}, but got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    lead = rows.shape[:-1]
    r2 = rows.reshape(lead.numel(), width).contiguous()
    n, nb = r2.shape[0], tab.shape[0]
    out = torch.empty(n, offsets[-1], dtype=torch.float32, device=rows.device)
    if n and nb:
        _dequant_kernel[(n, nb)](r2, out, tab.to(rows.device), r2.stride(0), out.stride(0), n_code, nb,
                                 BITS=f.bits, BP=triton.next_power_of_2(f.block))
    return out.view(*lead, offsets[-1])
