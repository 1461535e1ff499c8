"""Triton quantize / dequantize kernels for the latent storage formats ``int8`` / ``int4`` / ``int2``, ``tern`` and
``mix`` (not ``mxint``), int and mix also with ``-f8`` block metadata.

Layout, rounding rules and PyTorch references: :mod:`ckvp_compile.kernels.latent_format`
(:func:`~ckvp_compile.kernels.latent_format.quantize_latent_ref`,
:func:`~ckvp_compile.kernels.latent_format.dequantize_latent_ref`). One stored row per token, one *piece* per head
(uniform formats) or per (head, segment) (``mix``)::

    int / mix:  [ codes: piece 0 (cb_0 bytes), piece 1, ... | scales: NB fp16 | mins: NB fp16 ]
    ... -f8:    [ codes: piece 0 (cb_0 bytes), piece 1, ... | spans: NB e4m3 | mins: NB e4m3 ]
    tern:       [ codes: head 0 (ceil(r_0 / 5) bytes), head 1, ... | scales: NB fp16 ]

Integer kernels (grid ``(N, blocks)``, one program per (row, block); a block never straddles pieces):

* ``_quant_kernel``: loads the block's ``block`` coordinates of one piece (a piece's last block may be ragged: its
  missing coordinates are read as 0.0, exactly the reference's zero padding, so they take part in the block's
  min / max and their codes fill the last code byte just as in the reference), computes
  ``lo = min``, ``hi = max``; ``min = fp16(lo)`` round-to-nearest-even, stepped one fp16 ulp down when it lies
  above ``lo``; ``scale = fp16((hi - min) / levels)`` stepped one fp16 ulp up when ``min + levels * scale < hi``
  (the fp16 neighbours are taken on the raw 16-bit pattern, as ``torch.nextafter`` does, signed zeros included);
  ``code = round_half_even((x - min) / scale)`` clamped to ``[0, levels]`` (scale 0 divides by 1), packs
  ``8 / bits`` codes per byte little-endian (first code in the lowest bits) and stores the block's code bytes
  (only those inside the piece's ``cb``), its fp16 scale and fp16 min (little-endian bytes). ``-f8`` (constexpr
  ``F8``): ``min = lo`` rounded down and ``span = hi - min`` rounded up to float8_e4m3fn (``_e4m3_byte``, 0x7F NaN
  where e4m3 holds no such value), ``scale = span * fp32(1 / levels)``, codes as above; one byte each.
* ``_dequant_kernel``: unpacks each coordinate's code from its byte, ``x = code * scale + min`` in fp32 (``-f8``:
  ``scale = span * fp32(1 / levels)``), and writes only the piece's real coordinates (padding dropped).

``mix`` formats: one launch of the same two kernels per bit width present (at most three: 8, 4, 2), each over the
blocks of that width. The kernels are table-driven already (each block's column, real coordinates, first code
byte, code bytes and index in the row come from a small int32 table), so a mix plan only changes the tables; the
bit width is the one per-piece parameter that must be a compile-time constant (it sets the codes per byte and the
``tl.reshape`` that packs them). This is simpler than a kernel with per-head format parameters (runtime bit
widths would need masked variants of the packing) and than one launch per head slice (``Hkv x segments``
launches, each with its own byte / scale offsets); it is bit-exact for the same reason the uniform kernels are,
since every block is quantized exactly as a uniform block of its width.

Ternary kernels (``tern/<block>``: codes {-1, 0, +1}, one fp16 scale per block, five base-3 digits per byte
``sum_i (c_i + 1) * 3**i``, the digits of one head packed densely across its blocks). A byte may hold codes of
two blocks (5 does not divide ``block``), so quantization takes two launches:

* ``_tern_scale_kernel`` (grid ``(N, NB)``): ``scale = fp16(amax |x|)`` round-to-nearest-even, stepped one ulp up
  (bit pattern + 1, the value is >= +0) when below ``amax``; stores the fp16 scale.
* ``_tern_pack_kernel`` (grid ``(N, tiles)``, a tile is <= ``TERN_TILE_BYTES`` code bytes of one head): for each
  (byte k, digit i < 5) reads coordinate ``5k + i`` and its block's scale (stored by the previous launch, same
  stream), ``y = x / scale`` (scale 0 divides by 1), ``code = +1 if y > 0.5, -1 if y < -0.5, else 0`` (equal to
  the reference's ``round_half_even(y).clamp(-1, 1)`` for every non-NaN y), codes past the head's rank are 0 (the
  reference's padding digit 1), and stores ``sum_i (code_i + 1) * 3**i``.
* ``_tern_dequant_kernel`` (grid ``(N, NB)``): digit ``(byte // 3**(j % 5)) % 3 - 1`` of byte ``j // 5`` (as the
  reference also for bytes > 242), ``x = code * scale`` in fp32.

Exactness (what is bit-exact against the reference and why):

* fp32 -> fp16 casts use Triton's default round-to-nearest-even (``fp_downcast_rounding`` ``"rtne"``), as
  ``Tensor.to(torch.float16)``.
* The divisions use :func:`triton.language.math.div_rn` (IEEE round-to-nearest; plain ``/`` on fp32 may lower
  to an approximate ``div.full.f32`` on NVIDIA), as PyTorch's fp32 division.
* ``levels * scale`` (levels <= 255, fp16 scale: <= 19 significant bits) and ``code * scale`` are exact in fp32,
  so a fused multiply-add (Triton contracts by default) rounds exactly as PyTorch's separate multiply and add.
* Round-half-to-even is computed from exact operations (``floor``, the exact difference ``y - floor(y)`` for
  ``0 <= y < 2**23``, comparisons with 0.5, the parity of the floor), equal to ``torch.round``.
* ``-f8``: e4m3 rounding is integer arithmetic on the fp32 bit pattern and decoding an integer times a power of
  two (no fp8 conversion: Triton's saturates on the GPU and needs compute capability >= 8.9), equal to the
  reference's search of the e4m3 grid (tests/kernels/test_latent_quant_triton_f8.py: every e4m3 value and its
  fp32 neighbours, every fp32 exponent and top 7 mantissa bits, +-0, subnormals, beyond +-448, inf, NaN); a zero
  is always stored as 0x00, so there is no signed-zero case. ``span * fp32(1 / levels)`` is one product
  (the constant rounded from fp64 as ``torch.tensor(1 / levels, dtype=torch.float32)``); ``code * scale`` is
  then not exact, so ``_dequant_kernel`` runs with ``enable_fp_fusion=False`` for ``-f8`` (a multiply and an add,
  as PyTorch), while the quantizer has no multiply feeding an add that is not exact.
* Ternary: ``amax`` of absolute values is exact and sign-free (no signed-zero case); the code is a comparison of
  the correctly rounded quotient with +-0.5.

So the bytes are equal to ``quantize_latent_ref`` and the decoded values to ``dequantize_latent_ref`` bit for bit,
with one documented exception (int and mix only): when a block's minimum is a signed zero and the block holds both
``-0.0`` and ``+0.0`` (a ragged block's padding is ``+0.0``), which zero ``amin`` / ``tl.min`` return is
unspecified in both implementations, so the stored min may be ``0x0000`` vs ``0x8000`` (same value; the codes, the
scale and every decoded value are equal). The tests compare inputs with ``-0.0`` canonicalised and separately
check that case up to the zero's sign.

Status: int8/int4/int2 are exact under ``TRITON_INTERPRET=1`` (tests/kernels/test_latent_quant_triton.py) and on
the H200 at real shapes (B=8 x 4096 slots, rank 256 in three head splits, blocks 32 and 64, Gaussian and outlier
latents: every stored byte and every decoded bit equal; benchmarks/results/2026-11-29-latent-quant-h200), so the
CUDA kernel of ``ckvp::latent_append`` (``ops.latent_attention_cuda``) quantizes them with
:func:`quantize_latent_triton` (:func:`use_triton`). ``tern`` and ``mix`` are exact under the interpreter
(tests/kernels/test_latent_quant_triton_tern_mix.py) and on the H200 at the same real shapes (tern/32, tern/64 and
a mix/32 plan per head split: benchmarks/results/2026-11-29-latent-quant-h200/run2), so they are in
:data:`GPU_CHECKED` too. ``-f8`` formats: see :data:`F8_GPU_CHECKED`.

Errors: :class:`ValueError` for ``"float"`` or an ``mxint`` format, a wrong dtype / width of ``rows``, or (as the
reference) a value that is not finite or beyond fp16's range (``-f8``: beyond ``F8_MAX`` = 192; on a GPU values are
not checked, and an ``-f8`` block beyond e4m3's range stores NaN and decodes to NaN); :class:`NotImplementedError`
for a CPU tensor without the interpreter.

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

from .device_cache import check_not_capturing
from .latent_format import F8_MAX, LatentFormat, parse_latent_format

__all__ = ["APPEND_FP8_GPU_CHECKED", "APPEND_GPU_CHECKED", "APPEND_ONLINE_GPU_CHECKED", "APPEND_PAGED_GPU_CHECKED",
           "APPEND_STRIDED_GPU_CHECKED", "F8_GPU_CHECKED",
           "GPU_CHECKED", "TERN_TILE_BYTES", "USE_TRITON", "append_fusable", "append_gpu_checked",
           "dequantize_latent_triton", "format_family", "latent_append_triton", "quantize_latent_triton",
           "unsupported_reason", "use_triton"]

#: The CUDA ``ckvp::latent_append`` quantizes with these kernels (for the families in :data:`GPU_CHECKED`). Set
#: False to force the reference quantizer.
USE_TRITON = True
#: Format families (:func:`format_family`) checked bit-equal against the reference on the H200 at real shapes by
#: ``benchmarks/latent_quant_gpu.py`` (int, tern, mix: benchmarks/results/2026-11-29-latent-quant-h200/run2);
#: :func:`use_triton` is False for the others.
GPU_CHECKED = frozenset({"int", "tern", "mix"})
#: ``-f8`` formats (e4m3 block metadata) of the int and mix families: bit-equal to the reference under the
#: interpreter (tests/kernels/test_latent_quant_triton_f8.py) and on the H200 (``benchmarks/f8_meta_gpu.py``,
#: benchmarks/results/2026-12-05-f8-meta-h200: quantize / dequantize 60/60 bit-equal at 16k-64k rows, random bytes
#: included, r2; the fused ``ckvp::latent_append`` 48/48 within its one-step rule, r1). While False, :func:`use_triton`
#: is False for them and the CUDA ``ckvp::latent_append`` quantizes them with the reference.
F8_GPU_CHECKED = True
#: :func:`latent_append_triton` (projection, quantization and row store fused) for the CUDA ``ckvp::latent_append``
#: of int and mix formats: bit-equal under the interpreter, and checked on the H200 at real shapes by
#: ``benchmarks/latent_append_gpu.py`` (benchmarks/results/2026-11-30-fused-append-h200: at G*D = 128 bit-equal;
#: at G*D = 512, 99.8% bit-equal, the rest moved by the fp32 summation order, with RMS errors against an fp64
#: projection within 0.06% of the unfused path's). False puts CUDA back on the unfused path (the reference
#: projection, then :func:`quantize_latent_triton`).
APPEND_GPU_CHECKED = True
#: Input kinds of the fused append, each checked on its own: paged pools, per-sequence (online) bases and fp8
#: (e4m3, e5m2) bases. Bit-equal to the reference under the interpreter, and on the H200 every case of
#: ``benchmarks/latent_append_gpu.py`` passed (benchmarks/results/2026-11-30-append-kinds-h200). Setting one False
#: sends that kind back to the unfused path on CUDA (:func:`append_gpu_checked`).
APPEND_PAGED_GPU_CHECKED = True
APPEND_ONLINE_GPU_CHECKED = True
APPEND_FP8_GPU_CHECKED = True
#: Latents whose units are not contiguous within a row (the unit-major layout, :mod:`.latent_layout`): the fused
#: append writes them at their strides, bit-equal to the reference under the interpreter; on the H200
#: ``benchmarks/latent_append_gpu.py``'s unit-major cases pass (benchmarks/results/2026-12-01-largebatch-h200).
APPEND_STRIDED_GPU_CHECKED = True
#: Code bytes per ``_tern_pack_kernel`` program (power of two; 64 bytes = 320 coordinates covers a head of rank
#: <= 320 in one program; raise it for larger heads to launch fewer programs, at more registers per program).
TERN_TILE_BYTES = 64

_FP16_MAX = 65504.0


def format_family(fmt: "str | LatentFormat") -> str:
    """``"float"``, ``"int"`` (uniform int8/int4/int2), ``"mxint"``, ``"tern"`` or ``"mix"`` (an ``-f8`` format is in
    its ``int`` or ``mix`` family).

    Raises:
        ValueError: an unknown format (from :func:`~ckvp_compile.kernels.latent_format.parse_latent_format`).
    """
    f = parse_latent_format(fmt)
    if not f.quantized:
        return "float"
    return "mix" if f.mixed else "tern" if f.ternary else "mxint" if f.pow2 else "int"


def unsupported_reason(fmt: "str | LatentFormat", device: torch.device) -> str | None:
    """None when these kernels handle ``fmt`` on ``device``, else why not (a string).

    Supported: uniform ``int8`` / ``int4`` / ``int2``, ``tern`` and ``mix`` formats (any valid block; int and mix
    also ``-f8``) on CUDA, or any device under ``TRITON_INTERPRET=1``. Not: ``"float"``, ``mxint`` formats.
    """
    f = parse_latent_format(fmt)
    if format_family(f) in ("float", "mxint"):
        return f"format {f.name!r} is not one of these kernels' formats (uniform int8/int4/int2, tern, mix)"
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"device {torch.device(device).type!r} needs CUDA (or TRITON_INTERPRET=1)"
    return None


def use_triton(fmt: "str | LatentFormat", device: torch.device) -> bool:
    """True when the CUDA ``ckvp::latent_append`` should quantize ``fmt`` with these kernels: :data:`USE_TRITON`,
    the format's family in :data:`GPU_CHECKED` (an ``-f8`` format also :data:`F8_GPU_CHECKED`), and
    :func:`unsupported_reason` None. Raises ValueError for an unknown format."""
    f = parse_latent_format(fmt)
    return (USE_TRITON and format_family(f) in GPU_CHECKED and (F8_GPU_CHECKED or not f.meta_f8)
            and unsupported_reason(f, device) is None)


@functools.lru_cache(maxsize=256)
def _tables(offsets: tuple[int, ...], name: str, device: str):
    """The kernels' int32 tables for one layout, on ``device`` (cached: built once, not copied every decode step).

    Returns ``(groups, tern_pack, n_code, nb, width)``:
      * ``groups``: int / mix: ``((bits, (blocks, 5) table), ...)`` per bit width; tern: ``((1, table),)``. A row
        per block: (first packed column, real coordinates, first code byte, int: code bytes stored / tern: the
        block's first coordinate within its head, block index in the row).
      * ``tern_pack``: tern: (tiles, 6) per code-byte tile (head column, head rank, first code byte of the tile,
        first byte within the head, bytes in the tile, the head's first block); None otherwise.
      * ``n_code``: code bytes per row; ``nb``: blocks per row; ``width``: row bytes.
    Prepared when the store is built (:func:`~ckvp_compile.kernels.device_cache.prepare_device_tables`).
    """
    check_not_capturing(f"the {name} quantization tables", device)
    f = parse_latent_format(name)
    by_bits: dict[int, list] = {}
    tiles, byte = [], 0
    for col, count, bits, block0 in f.pieces(offsets):
        nblk = -(-count // f.block)
        if f.ternary:
            cb = -(-count // 5)
            for k in range(nblk):
                by_bits.setdefault(bits, []).append((col + k * f.block, min(f.block, count - k * f.block), byte,
                                                     k * f.block, block0 + k))
            for t in range(-(-cb // TERN_TILE_BYTES)):
                tiles.append((col, count, byte + t * TERN_TILE_BYTES, t * TERN_TILE_BYTES,
                              min(TERN_TILE_BYTES, cb - t * TERN_TILE_BYTES), block0))
        else:
            cb, bpb = -(-count * bits // 8), f.block * bits // 8
            for k in range(nblk):
                by_bits.setdefault(bits, []).append((col + k * f.block, min(f.block, count - k * f.block),
                                                     byte + k * bpb, min(bpb, cb - k * bpb), block0 + k))
        byte += cb
    groups = tuple((bits, torch.tensor(rows, dtype=torch.int32).reshape(-1, 5).to(device))
                   for bits, rows in sorted(by_bits.items()))
    pack = torch.tensor(tiles, dtype=torch.int32).reshape(-1, 6).to(device) if f.ternary else None
    return groups, pack, byte, f.num_blocks(offsets), f.row_width(offsets)


def _check(fmt, device) -> LatentFormat:
    f = parse_latent_format(fmt)
    reason = unsupported_reason(f, device)
    if reason is not None:
        if reason.startswith("device"):
            raise NotImplementedError(f"latent quant Triton kernels NYI here: {reason}")
        raise ValueError(reason)
    return f


@triton.jit
def _e4m3_byte(x, UP: tl.constexpr):
    """float8_e4m3fn byte (int32) of fp32 ``x`` rounded up (``UP``) or down to an e4m3 value, as the reference's
    ``_e4m3_round``: 0x7F (NaN) for NaN or with no e4m3 value on that side; zero is 0x00 (never -0). Integer
    arithmetic on the fp32 bit pattern (exact on any GPU, no fp8 conversion, no flush of subnormals): |x| is
    ``sig * 2**(e - 23)``; in its e4m3 binade ``b = max(e, -6)`` the e4m3 step is ``2**(b - 3)``, so the magnitude
    byte is ``8 * (b + 6) + (sig >> (20 + b - e))``, plus one rounding the magnitude up past a nonzero remainder."""
    bits = tl.minimum(tl.abs(x), 512.0).to(tl.int32, bitcast=True)  # beyond 448: 448 down, NaN up
    ef = bits >> 23
    sig = (bits & 0x7FFFFF) | tl.where(ef > 0, 0x800000, 0)
    e = tl.maximum(ef, 1) - 127
    b = tl.maximum(e, -6)
    sh = tl.minimum(20 + b - e, 25)  # sig < 2**24: a shift of 25 or more leaves 0
    n = sig >> sh
    if UP:
        mag_up = x > 0
    else:
        mag_up = x < 0
    mag = 8 * (b + 6) + n + tl.where(mag_up & ((n << sh) != sig), 1, 0)
    mag = tl.where(mag_up, mag, tl.minimum(mag, 0x7E))
    byte = tl.where((x < 0) & (mag > 0), mag | 0x80, mag)
    return tl.where((mag >= 0x7F) | (x != x), 0x7F, byte)


@triton.jit
def _e4m3_float(b):
    """fp32 value of float8_e4m3fn bytes ``b`` (int32 in [0, 255]) by integer arithmetic (any GPU): magnitude
    ``(8 * (E > 0) + M) * 2**(max(E, 1) - 10)`` of exponent field E and mantissa M, NaN for 0x7F / 0xFF. The sign
    bit is set by an integer OR: Triton 3.6 compiles ``-v`` as ``0 - v``, which decodes 0x80 (-0.0) as +0.0 (fixed
    upstream by triton-lang/triton#10270; the interpreter negates correctly, so only a GPU shows it)."""
    m = b & 0x7F
    e = m >> 3
    v = (tl.where(e > 0, 8, 0) + (m & 7)).to(tl.float32) * ((tl.maximum(e, 1) + 117) << 23).to(tl.float32, bitcast=True)
    v = tl.where(m == 0x7F, float("nan"), v)
    return (v.to(tl.int32, bitcast=True) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _quant_block_store(x, j, base, byte0, nbytes, blk, n_code, NB,
                       BITS: tl.constexpr, BLOCK: tl.constexpr, BP: tl.constexpr, F8: tl.constexpr, stride_w=1):
    """Quantize one block ``x`` (BP,) fp32 (entries past the block's real coordinates already 0.0, the reference's
    padding; ``j`` = arange(BP)) and store its code bytes, scale and min (fp16; ``F8``: e4m3 span and min) into the
    row at ``base``, byte i of the row at ``base + i * stride_w`` (1: row-major; the slot count of a unit-major
    latent, :mod:`~ckvp_compile.kernels.latent_layout`)."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    PER: tl.constexpr = 8 // BITS
    inblk = j < BLOCK
    lo = tl.min(tl.where(inblk, x, float("inf")), axis=0)
    hi = tl.max(tl.where(inblk, x, float("-inf")), axis=0)

    if F8:  # min = lo rounded down, span = hi - min rounded up (e4m3 bytes); step = span * fp32(1 / levels)
        mu = _e4m3_byte(lo, False)
        mnf = _e4m3_float(mu)
        su = _e4m3_byte(hi - mnf, True)
        sf = _e4m3_float(su) * (1.0 / LEVELS)
    else:
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
    tl.store(base + (byte0 + k) * stride_w, packed.to(tl.uint8), mask=k < nbytes)

    if F8:
        tl.store(base + (n_code + blk) * stride_w, su.to(tl.uint8))
        tl.store(base + (n_code + NB + blk) * stride_w, mu.to(tl.uint8))
    else:
        two = tl.arange(0, 2)
        tl.store(base + (n_code + 2 * blk + two) * stride_w, ((su >> (8 * two)) & 0xFF).to(tl.uint8))
        tl.store(base + (n_code + 2 * NB + 2 * blk + two) * stride_w, ((mu >> (8 * two)) & 0xFF).to(tl.uint8))


@triton.jit
def _quant_kernel(z_ptr, out_ptr, tab_ptr, z_stride, out_stride, n_code, NB,
                  BITS: tl.constexpr, BLOCK: tl.constexpr, BP: tl.constexpr, F8: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    zcol = tl.load(tab_ptr + t * 5)
    nval = tl.load(tab_ptr + t * 5 + 1)
    byte0 = tl.load(tab_ptr + t * 5 + 2)
    nbytes = tl.load(tab_ptr + t * 5 + 3)
    blk = tl.load(tab_ptr + t * 5 + 4)
    j = tl.arange(0, BP)
    x = tl.load(z_ptr + row * z_stride + zcol + j, mask=j < nval, other=0.0)  # ragged tail: 0.0 (the padding)
    _quant_block_store(x, j, out_ptr + row * out_stride, byte0, nbytes, blk, n_code, NB, BITS, BLOCK, BP, F8)


@triton.jit
def _append_kernel(x_ptr, basis_ptr, slots_ptr, out_ptr, pt_ptr, tab_ptr, head_ptr, n_code, NB, S, K, trash, n_slots,
                   stride_xb, stride_xh, stride_xs, stride_xk, stride_bb, stride_bh, stride_bk, stride_br,
                   stride_ob, stride_os, stride_ow, stride_sl, stride_ptb, stride_ptp,
                   BITS: tl.constexpr, BLOCK: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr,
                   PAGE: tl.constexpr, F8: tl.constexpr):
    """One (token, block): project the token's stacked keys (or values) of the block's head onto the block's basis
    columns in fp32, quantize, store into the token's latent row (its slot, or its page's row when PAGE > 0). A
    slot outside [0, n_slots) is not written (no row of another sequence or outside the cache is touched)."""
    row = tl.program_id(0)
    t = tl.program_id(1)
    b = (row // S).to(tl.int64)
    s = row % S
    nval = tl.load(tab_ptr + t * 5 + 1)
    byte0 = tl.load(tab_ptr + t * 5 + 2)
    nbytes = tl.load(tab_ptr + t * 5 + 3)
    blk = tl.load(tab_ptr + t * 5 + 4)
    h = tl.load(head_ptr + t * 2)
    j0 = tl.load(head_ptr + t * 2 + 1)
    j = tl.arange(0, BP)
    ok = j < nval
    x_row = x_ptr + b * stride_xb + h * stride_xh + s * stride_xs
    b_cols = basis_ptr + b * stride_bb + h * stride_bh + ((j0 + j) * stride_br)[None, :]
    z = tl.zeros((BP,), tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        k_ok = kk < K
        xv = tl.load(x_row + kk * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
        bv = tl.load(b_cols + (kk * stride_bk)[:, None], mask=k_ok[:, None] & ok[None, :], other=0.0)
        z += tl.sum(xv[:, None] * bv.to(tl.float32), axis=0)
    z = tl.where(ok, z, 0.0)  # ragged tail: 0.0 (the padding)
    slot = tl.load(slots_ptr + s * stride_sl).to(tl.int64)
    if (slot >= 0) & (slot < n_slots):
        if PAGE > 0:  # the slot's page (unmapped: the trash page), then its row in the page
            page = tl.load(pt_ptr + b * stride_ptb + (slot // PAGE) * stride_ptp).to(tl.int64)
            page = tl.where(page >= 0, page, trash)
            base = out_ptr + page * stride_ob + (slot % PAGE) * stride_os
        else:
            base = out_ptr + b * stride_ob + slot * stride_os
        _quant_block_store(z, j, base, byte0, nbytes, blk, n_code, NB, BITS, BLOCK, BP, F8, stride_ow)


@triton.jit
def _dequant_kernel(rows_ptr, out_ptr, tab_ptr, rows_stride, out_stride, n_code, NB,
                    BITS: tl.constexpr, BP: tl.constexpr, F8: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    zcol = tl.load(tab_ptr + t * 5)
    nval = tl.load(tab_ptr + t * 5 + 1)
    byte0 = tl.load(tab_ptr + t * 5 + 2)
    blk = tl.load(tab_ptr + t * 5 + 4)
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1

    base = rows_ptr + row * rows_stride
    j = tl.arange(0, BP)
    ok = j < nval
    byte = tl.load(base + byte0 + j // PER, mask=ok, other=0).to(tl.int32)
    code = (byte >> ((j % PER) * BITS)) & MASK

    if F8:  # code * scale is not exact here: launched without FMA contraction (enable_fp_fusion=False)
        sf = _e4m3_float(tl.load(base + n_code + blk).to(tl.int32)) * (1.0 / MASK)
        mnf = _e4m3_float(tl.load(base + n_code + NB + blk).to(tl.int32))
    else:
        two = tl.arange(0, 2)
        sb = tl.load(base + n_code + 2 * blk + two).to(tl.int32)
        mb = tl.load(base + n_code + 2 * NB + 2 * blk + two).to(tl.int32)
        su = tl.sum(sb << (8 * two), axis=0)
        mu = tl.sum(mb << (8 * two), axis=0)
        sf = su.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        mnf = mu.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    x = code.to(tl.float32) * sf + mnf  # fp16: code * scale is exact, so FMA or not, one rounding
    tl.store(out_ptr + row * out_stride + zcol + j, x, mask=ok)


@triton.jit
def _pow3(m):
    """3**m for int32 m in [0, 4] (0 elsewhere above 4: the unused digits of a padded byte)."""
    return tl.where(m == 0, 1, tl.where(m == 1, 3, tl.where(m == 2, 9, tl.where(m == 3, 27,
                    tl.where(m == 4, 81, 0)))))


@triton.jit
def _tern_scale_kernel(z_ptr, out_ptr, tab_ptr, z_stride, out_stride, n_code, BP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    zcol = tl.load(tab_ptr + t * 5)
    nval = tl.load(tab_ptr + t * 5 + 1)
    blk = tl.load(tab_ptr + t * 5 + 4)

    j = tl.arange(0, BP)
    x = tl.load(z_ptr + row * z_stride + zcol + j, mask=j < nval, other=0.0)
    amax = tl.max(tl.abs(x), axis=0)
    # fp16(amax) rtne, one ulp up (the bit pattern + 1: amax >= +0) if below amax
    s16 = amax.to(tl.float16)
    su = s16.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    su = tl.where(s16.to(tl.float32) < amax, su + 1, su)
    two = tl.arange(0, 2)
    tl.store(out_ptr + row * out_stride + n_code + 2 * blk + two, ((su >> (8 * two)) & 0xFF).to(tl.uint8))


@triton.jit
def _tern_pack_kernel(z_ptr, out_ptr, tab_ptr, z_stride, out_stride, n_code,
                      BLOCK: tl.constexpr, KB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    zcol = tl.load(tab_ptr + t * 6)
    count = tl.load(tab_ptr + t * 6 + 1)
    byte0 = tl.load(tab_ptr + t * 6 + 2)
    k0 = tl.load(tab_ptr + t * 6 + 3)
    nbytes = tl.load(tab_ptr + t * 6 + 4)
    blk0 = tl.load(tab_ptr + t * 6 + 5)

    k = tl.arange(0, KB)
    i = tl.arange(0, 8)
    jj = (k0 + k[:, None]) * 5 + i[None, :]  # (KB, 8): coordinate within the head of digit i of byte k
    ok = (i[None, :] < 5) & (k[:, None] < nbytes) & (jj < count)
    x = tl.load(z_ptr + row * z_stride + zcol + jj, mask=ok, other=0.0)
    obase = out_ptr + row * out_stride
    sp = obase + n_code + 2 * (blk0 + jj // BLOCK)  # the block's fp16 scale, stored by _tern_scale_kernel
    su = tl.load(sp, mask=ok, other=0).to(tl.int32) | (tl.load(sp + 1, mask=ok, other=0).to(tl.int32) << 8)
    sf = su.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    y = tl.math.div_rn(x, tl.where(sf > 0, sf, 1.0))
    code = tl.where(y > 0.5, 1, tl.where(y < -0.5, -1, 0))  # round_half_even(y).clamp(-1, 1)
    digit = tl.where(ok, code + 1, 1)  # past the rank: code 0, the reference's padding
    packed = tl.sum(digit * _pow3(i)[None, :], axis=1)
    tl.store(obase + byte0 + k, packed.to(tl.uint8), mask=k < nbytes)


@triton.jit
def _tern_dequant_kernel(rows_ptr, out_ptr, tab_ptr, rows_stride, out_stride, n_code, BP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    zcol = tl.load(tab_ptr + t * 5)
    nval = tl.load(tab_ptr + t * 5 + 1)
    hbyte = tl.load(tab_ptr + t * 5 + 2)
    first = tl.load(tab_ptr + t * 5 + 3)
    blk = tl.load(tab_ptr + t * 5 + 4)

    base = rows_ptr + row * rows_stride
    j = tl.arange(0, BP)
    ok = j < nval
    jj = first + j
    byte = tl.load(base + hbyte + jj // 5, mask=ok, other=0).to(tl.int32)
    code = (byte // _pow3(jj % 5)) % 3 - 1
    two = tl.arange(0, 2)
    su = tl.sum(tl.load(base + n_code + 2 * blk + two).to(tl.int32) << (8 * two), axis=0)
    sf = su.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    tl.store(out_ptr + row * out_stride + zcol + j, code.to(tl.float32) * sf, mask=ok)


def quantize_latent_triton(z: torch.Tensor, offsets: Sequence[int], fmt: "str | LatentFormat") -> torch.Tensor:
    """Triton :func:`~ckvp_compile.kernels.latent_format.quantize_latent_ref` for int, tern and mix formats.

    Args:
        z: (..., R_tot) float (any float dtype; computed in fp32), packed latent coordinates, ``R_tot = offsets[-1]``.
        offsets: Hkv+1 ints (non-decreasing; head h owns columns ``offsets[h]:offsets[h+1]``).
        fmt: ``"int8"``, ``"int4/64"``, ``"int2/8"``, ``"tern/32"``, ``"mix/32:8x32+4x64,..."``, ``"int4/32-f8"``,
            ``"mix/32-f8:..."``, ...
    Returns:
        (..., row_bytes) uint8, bit-equal to the reference (see the module docstring for the signed-zero min).
        Launches: int 1, mix one per bit width present, tern 2.
    Raises:
        ValueError: ``fmt`` is ``"float"`` or ``mxint``, a mix plan does not match ``offsets``, ``z``'s last dim is
            not ``offsets[-1]``, or (host tensors) a value is not finite or beyond fp16's range (|x| > 65504;
            ``-f8``: |x| > 192, :data:`~ckvp_compile.kernels.latent_format.F8_MAX`).
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
    limit = F8_MAX if f.meta_f8 else _FP16_MAX
    if zf.numel() and not zf.is_cuda and not bool(torch.isfinite(zf).all() & (zf.abs() <= limit).all()):
        if f.meta_f8:
            raise ValueError(f"latent values must be finite and at most {F8_MAX:g} in magnitude to be quantized in "
                             f"{f.name!r} (its e4m3 block spans hold up to 448)")
        raise ValueError("latent values must be finite and within fp16 range (|x| <= 65504) to be quantized")
    groups, pack, n_code, nb, width = _tables(offsets, f.name, str(z.device))
    n = zf.shape[0]
    out = torch.empty(n, width, dtype=torch.uint8, device=z.device)
    bp = triton.next_power_of_2(f.block)
    for bits, tab in (groups if n else ()):
        if f.ternary:
            _tern_scale_kernel[(n, tab.shape[0])](zf, out, tab, zf.stride(0), out.stride(0), n_code, BP=bp)
            _tern_pack_kernel[(n, pack.shape[0])](zf, out, pack, zf.stride(0), out.stride(0), n_code,
                                                  BLOCK=f.block, KB=TERN_TILE_BYTES)
        else:
            _quant_kernel[(n, tab.shape[0])](zf, out, tab, zf.stride(0), out.stride(0), n_code, nb,
                                             BITS=bits, BLOCK=f.block, BP=bp, F8=f.meta_f8)
    return out.view(*lead, width)


@functools.lru_cache(maxsize=256)
def _head_tables(offsets: tuple[int, ...], name: str, device: str):
    """Per bit-width group of :func:`_tables`, a (blocks, 2) int32 table of each block's (KV head, first coordinate
    within the head), for :func:`latent_append_triton` (cached per layout and device, as :func:`_tables`)."""
    check_not_capturing(f"the {name} append tables", device)
    groups, _, _, _, _ = _tables(offsets, name, device)
    out = []
    for bits, tab in groups:
        rows = []
        for zcol in tab[:, 0].tolist():
            h = max(i for i in range(len(offsets) - 1) if offsets[i] <= zcol)
            rows.append((h, zcol - offsets[h]))
        out.append(torch.tensor(rows, dtype=torch.int32).reshape(-1, 2).to(device))
    return tuple(out)


#: dtypes :func:`latent_append_triton` loads: x in fp16 / bf16 / fp32; bases also in fp8 e5m2, and e4m3fn on GPUs of
#: compute capability >= 8.9 (Triton's fp8e4nv); others (fp64, the fnuz / e8m0 fp8 variants) take the unfused path
APPEND_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
APPEND_BASIS_DTYPES = APPEND_X_DTYPES + (torch.float8_e5m2,)


def append_fusable(latent: torch.Tensor, x: torch.Tensor, basis: torch.Tensor) -> str:
    """Why :func:`latent_append_triton` cannot take these tensors ('' when it can): the latent's bytes at positive
    strides (row-major or unit-major, :mod:`~ckvp_compile.kernels.latent_layout`) and x / basis of a dtype it loads
    (:data:`APPEND_X_DTYPES`, :data:`APPEND_BASIS_DTYPES`, e4m3fn bases on CUDA capability >= 8.9 or under the
    interpreter)."""
    if latent.dim() != 3 or min(latent.stride()) < 1:
        return f"the latent is not (rows..., W) at positive strides (strides {tuple(latent.stride())})"
    if (latent.shape[-1] - 1) * latent.stride(-1) >= 2**31:  # the kernel's unit offsets are int32
        return f"the latent's unit offsets pass 2**31 (strides {tuple(latent.stride())})"
    if x.dtype not in APPEND_X_DTYPES:
        return f"x is {x.dtype}"
    if basis.dtype == torch.float8_e4m3fn:
        if basis.device.type == "cuda" and torch.cuda.get_device_capability(basis.device) < (8, 9):
            return "float8_e4m3fn bases need compute capability >= 8.9"
    elif basis.dtype not in APPEND_BASIS_DTYPES:
        return f"the basis is {basis.dtype}"
    return ""


def append_gpu_checked(basis: torch.Tensor, page_table: torch.Tensor | None,
                       latent: torch.Tensor | None = None) -> bool:
    """Whether a CUDA ``ckvp::latent_append`` of these inputs may take :func:`latent_append_triton`: the kinds a
    GPU run has checked (:data:`APPEND_GPU_CHECKED`, :data:`APPEND_PAGED_GPU_CHECKED`,
    :data:`APPEND_ONLINE_GPU_CHECKED`, :data:`APPEND_FP8_GPU_CHECKED`, and for a ``latent`` whose row units are
    strided, e.g. unit-major, :data:`APPEND_STRIDED_GPU_CHECKED`)."""
    if not APPEND_GPU_CHECKED:
        return False
    if latent is not None and latent.stride(-1) != 1 and not APPEND_STRIDED_GPU_CHECKED:
        return False
    if page_table is not None and not APPEND_PAGED_GPU_CHECKED:
        return False
    if basis.dim() == 4 and not APPEND_ONLINE_GPU_CHECKED:
        return False
    return basis.element_size() > 1 or APPEND_FP8_GPU_CHECKED


def latent_append_triton(latent: torch.Tensor, x: torch.Tensor, basis: torch.Tensor, offsets: Sequence[int],
                         slots: torch.Tensor, fmt: "str | LatentFormat",
                         page_table: torch.Tensor | None = None) -> None:
    """``ckvp::latent_append`` in one launch per bit width: project, quantize and store, fused.

    Each program takes one (token, quantization block): the block's coordinates are the token's stacked keys (or
    values) of the block's KV head times the block's basis columns, summed over ``G*D`` in fp32 (the reference's
    einsum in another order), then quantized exactly as :func:`quantize_latent_triton` (same code,
    ``_quant_block_store``) and stored straight into the token's latent row. This replaces the unfused CUDA path's
    fp32 copies of ``x`` and the basis, the einsum, the column gather, the quantizer and the row scatter (about 6
    kernels per call; H200, Qwen1.5-MoE batch 1: about 0.65 ms of a 4.7 ms decode step).

    Args: as :func:`ckvp_compile.kernels.reference.latent_append_ref`: latent (B, S_max, row_bytes) uint8 (or a
        page pool (N_pages + 1, P, row_bytes) with ``page_table``), x (B, Hkv, S, G*D) float, basis (Hkv, G*D,
        R_max) or (B, Hkv, G*D, R_max) float, offsets Hkv+1 ints, slots (S,) int, fmt an ``int`` or ``mix`` format
        (``-f8`` included: an ``-f8`` block beyond e4m3's range stores NaN metadata, values are not checked).
    Returns:
        None; ``latent`` written in place at the slots' rows. Equal to the reference's bytes wherever the two fp32
        projections round a coordinate alike; elsewhere a code may differ by one step at a rounding tie, never
        more (tests/kernels/test_latent_quant_triton.py). A slot outside the cache ([0, S_max); paged: the page
        table's slots) is not written: on a GPU the slots are not read back to the host (that would synchronise
        every step), so, unlike the reference's indexing, it raises nothing here; the op's host-tensor check and
        the RoPE table update of the same graph (``ckvp::rope_table_update``, device-side assert) report it.
    Raises:
        ValueError: ``fmt`` is not an int or mix format, ``latent`` is not uint8 of the format's row width or
            not 3-d at positive strides, or x / basis have a dtype the kernel does not load (:func:`append_fusable`).
        NotImplementedError: a non-CUDA tensor without ``TRITON_INTERPRET=1``.
    Reference: kernels/reference.py::latent_append_ref
    """
    f = _check(fmt, latent.device)
    if format_family(f) not in ("int", "mix"):
        raise ValueError(f"latent_append_triton takes int and mix formats, not {f.name!r}")
    offsets = tuple(int(o) for o in offsets)
    groups, _, n_code, nb, width = _tables(offsets, f.name, str(latent.device))
    if latent.dtype != torch.uint8 or latent.shape[-1] != width:
        raise ValueError(f"latent must be uint8 (..., {width}) for {f.name} with offsets {list(offsets)}, but got "
                         f"{latent.dtype} {tuple(latent.shape)}")
    why = append_fusable(latent, x, basis)
    if why:
        raise ValueError(f"latent_append_triton: {why}; use the unfused path (ckvp::latent_append does)")
    heads = _head_tables(offsets, f.name, str(latent.device))
    b, _, s, k = x.shape
    if b * s == 0:
        return
    bstr = basis.stride() if basis.dim() == 4 else (0, *basis.stride())
    if page_table is None:
        pt, pt_strides, page, trash = slots, (0, 0), 0, 0
        n_slots = latent.shape[1]
    else:
        pt, pt_strides, page, trash = page_table, page_table.stride(), latent.shape[1], latent.shape[0] - 1
        n_slots = page_table.shape[1] * page
    bp = triton.next_power_of_2(f.block)
    bk = min(128, triton.next_power_of_2(k))
    for (bits, tab), head in zip(groups, heads):
        _append_kernel[(b * s, tab.shape[0])](
            x, basis, slots, latent, pt, tab, head, n_code, nb, s, k, trash, n_slots, *x.stride(), *bstr,
            *latent.stride(),
            slots.stride(0), *pt_strides,
            BITS=bits, BLOCK=f.block, BP=bp, BK=bk, PAGE=page, F8=f.meta_f8)


def dequantize_latent_triton(rows: torch.Tensor, offsets: Sequence[int], fmt: "str | LatentFormat") -> torch.Tensor:
    """Triton :func:`~ckvp_compile.kernels.latent_format.dequantize_latent_ref` for int, tern and mix formats.

    Args:
        rows: (..., row_bytes) uint8 as written by the quantizer.
        offsets: Hkv+1 ints.
        fmt: the format they were written with.
    Returns:
        (..., R_tot) fp32, ``code * scale + min`` (tern: ``code * scale``; ``-f8``: ``scale = span * fp32(1 /
        levels)``, NaN for a NaN span or min byte) per coordinate, bit-equal to the reference (NaN payloads aside).
    Raises:
        ValueError: ``fmt`` is ``"float"`` or ``mxint``, a mix plan does not match ``offsets``, or ``rows`` is not
            uint8 of the format's row width.
        NotImplementedError: a non-CUDA tensor without ``TRITON_INTERPRET=1``.
    Reference: kernels/latent_format.py::dequantize_latent_ref
    """
    f = _check(fmt, rows.device)
    offsets = tuple(int(o) for o in offsets)
    groups, _, n_code, nb, width = _tables(offsets, f.name, str(rows.device))
    if rows.dtype != torch.uint8 or rows.shape[-1] != width:
        raise ValueError(f"rows must be uint8 (..., {width}) for {f.name} with offsets {list(offsets)}, but got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    lead = rows.shape[:-1]
    r2 = rows.reshape(lead.numel(), width).contiguous()
    n = r2.shape[0]
    out = torch.empty(n, offsets[-1], dtype=torch.float32, device=rows.device)
    bp = triton.next_power_of_2(f.block)
    opts = {"enable_fp_fusion": False} if f.meta_f8 else {}  # -f8: code * scale + min in two roundings, as torch
    for bits, tab in (groups if n else ()):
        if f.ternary:
            _tern_dequant_kernel[(n, tab.shape[0])](r2, out, tab, r2.stride(0), out.stride(0), n_code, BP=bp)
        else:
            _dequant_kernel[(n, tab.shape[0])](r2, out, tab, r2.stride(0), out.stride(0), n_code, nb,
                                               BITS=bits, BP=bp, F8=f.meta_f8, **opts)
    return out.view(*lead, offsets[-1])
