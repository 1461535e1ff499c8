"""Storage formats of the packed latent, and their pure-PyTorch quantize / dequantize references.

A latent row holds one token's coordinates for every KV head of a layer group (``R_tot`` values, head ``h`` in
columns ``offsets[h]:offsets[h+1]``; see :mod:`ckvp_compile.kernels.reference`). It is stored in one of these
formats, named by a string that the ops take as a compile-time constant:

==============  ==========================================================================================
``"float"``     the latent tensor's own float dtype, (B, S_max, R_tot)
``"int8/32"``   asymmetric ``bits``-bit codes (``int8``, ``int4``, ``int2``) in blocks of ``block`` coordinates
``"int4/32"``   of one token and one head (``/block`` is optional, default 32); a uint8 tensor
``"int2/32"``   (B, S_max, row_bytes)
``"tern/32"``    ternary codes {-1, 0, +1} times one fp16 scale per block (the block's absolute maximum, rounded up
                to fp16), five codes per byte (``sum_i (c_i + 1) * 3**i``, 1.6 bits per coordinate); no minimums
``"mxint8/32"``  symmetric two's-complement codes (``mxint8``: [-127, 127], ``mxint4``: [-7, 7]) times a per-block
``"mxint4/32"``  power-of-two scale ``2**e`` stored as one biased exponent byte (``e + 127``, OCP Microscaling's
                E8M0); no minimums. ``code * 2**e`` is exactly a bfloat16 value, so the decode kernel multiplies
                dequantized latents on bf16 tensor cores in one exact product (no hi/lo split, no per-block
                rescale after the product)
``"mix/32:..."`` a bit plan per KV head (``planner`` output): ``mix/<block>:<head 0>,<head 1>,...`` with each
                head a ``+``-joined list of ``<bits>x<count>`` segments in coordinate order (e.g.
                ``mix/32:8x32+4x64+2x32,8x32+4x32``); a head's counts sum to its rank. Bits 8, 4 or 2.
``"int4/32-f8"`` ``-f8`` after the block of an ``int`` or ``mix`` format (``"int8/32-f8"``, ``"mix/32-f8:..."``):
                each block's scale and minimum are one float8_e4m3fn byte each instead of fp16 (2 bytes of
                metadata per block instead of 4: at 4 bits and blocks of 32, 4.5 bits per coordinate instead
                of 5), the block scales of NVIDIA's NVFP4 and OCP MX formats, here with a minimum kept
==============  ==========================================================================================

Quantized row layout (per token; ``nb_h = ceil(r_h / block)`` blocks for head h, ``NB = sum_h nb_h``,
``cb_h = ceil(r_h * bits / 8)`` code bytes for head h)::

    [ codes: head 0 (cb_0 bytes), head 1 (cb_1 bytes), ... | scales: NB fp16 | mins: NB fp16 ]

Blocks never straddle heads (a decode kernel reads only its own head's bytes); a head's last block may be
shorter than ``block``, and only the byte holding its last code is padded. A ``mix`` format lays out every
(head, segment) *piece* the same way, in order: the piece's ``ceil(count*bits/8)`` code bytes, then all
pieces' scales, then all pieces' mins; a uniform format is the mix with one piece per head. Codes are little-endian within a
byte (``8/bits`` codes per byte, the first in the lowest bits). A block with minimum ``lo`` and maximum ``hi``
stores ``min = lo`` rounded down to fp16 and ``scale = (hi - min) / (2**bits - 1)`` rounded up to fp16, so
every value lies in ``[min, min + (2**bits-1)*scale]`` and ``|dequantize(quantize(x)) - x| <= scale / 2``
(KIVI's asymmetric per-token quantization, Liu et al., 2024; here along the latent coordinates of one token,
which streams: a token is final when written, and no dense residual window is needed).

An ``-f8`` block stores two float8_e4m3fn bytes, its *span* and its minimum, in the places of the fp16 scale and
minimum: ``min = lo`` rounded down to e4m3, ``span = hi - min`` rounded up to e4m3, and the step is
``scale = span * fp32(1 / (2**bits - 1))`` (:func:`f8_scale`; storing the span rather than the step keeps 8-bit
blocks of small values out of e4m3's subnormals). The bound ``|dequantize(quantize(x)) - x| <= scale / 2`` holds
as before, with a step at most 12.5% (e4m3's spacing) above the exact one: about 1.2x the fp16 format's squared
error for 2 bytes less per block. Values must lie within ``|x| <= 192`` (:data:`F8_MAX`: the span then fits
e4m3's 448): :func:`quantize_latent_ref` raises on CPU tensors; on a GPU, a block whose span or minimum e4m3 cannot
hold stores NaN, which propagates (never plausible numbers), like fp16's overflow.

A power-of-two (``mxint``) block with absolute maximum ``a`` takes ``e = ceil(log2(a / qmax))`` (clamped to
[-126, 127]) and ``code = round(x / 2**e)``, so again ``|dequantize(quantize(x)) - x| <= 2**e / 2``; its row is
``[ codes | exponents: NB uint8 ]`` (OCP Microscaling Formats (MX) v1.0, 2023, MXINT8: shared E8M0 scale per
block of 32; Rouhani et al., arXiv:2310.10537).

Values beyond fp16's range (|x| > 65504) are not representable: :func:`quantize_latent_ref` raises.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Sequence

import torch

from .device_cache import check_not_capturing

__all__ = ["F8_MAX", "LatentFormat", "TERNARY", "dequantize_latent_ref", "f8_block_range", "f8_scale", "pack_codes", "pack_ternary", "parse_latent_format",
           "quantize_latent_ref", "unpack_codes", "unpack_ternary"]

_FORMAT_RE = re.compile(r"^int(8|4|2)(?:/(\d+))?(-f8)?$")
_MX_RE = re.compile(r"^mxint(8|4)(?:/(\d+))?$")
_TERN_RE = re.compile(r"^tern(?:/(\d+))?$")
#: ``bits`` of the ternary format (a marker: its codes take 1.6 bits, five to a byte)
TERNARY = 1
_MIX_RE = re.compile(r"^mix/(\d+)(-f8)?:(.*)$")
_SEGMENT_RE = re.compile(r"^(8|4|2)x(\d+)$")
_FP16_MAX = 65504.0


@dataclass(frozen=True)
class LatentFormat:
    """A parsed latent storage format (see the module docstring).

    Attributes:
        name: the canonical string (``"float"`` or ``"int<bits>/<block>"``).
        bits: 8, 4 or 2; 16 means ``"float"`` (the tensor's own dtype, whatever its width).
        block: coordinates per scale / min (0 for ``"float"``).
    """

    name: str
    bits: int
    block: int
    #: mix formats: per KV head, ((bits, count), ...) in coordinate order; None for uniform formats (bits 0 marks
    #: a mix)
    segments: tuple[tuple[tuple[int, int], ...], ...] | None = None
    #: ``mxint`` formats: symmetric codes with one power-of-two scale (an exponent byte) per block, no minimum
    pow2: bool = False
    #: ``-f8`` formats: each block's scale and minimum are float8_e4m3fn bytes, not fp16
    meta_f8: bool = False

    @property
    def meta_bytes(self) -> int:
        """Bytes of metadata per block: 4 (fp16 scale and min), 2 (``-f8``: e4m3 scale and min), 1 (``mxint``:
        an exponent byte), 2 (``tern``: an fp16 scale), 0 (``float``)."""
        if not self.quantized:
            return 0
        return 1 if self.pow2 else 2 if (self.ternary or self.meta_f8) else 4

    @property
    def quantized(self) -> bool:
        """True for the integer formats (uniform or mix)."""
        return self.bits < 16

    @property
    def ternary(self) -> bool:
        """True for ``"tern/<block>"``."""
        return self.bits == TERNARY

    @property
    def mixed(self) -> bool:
        """True for a per-head bit plan (``mix/...``)."""
        return self.segments is not None

    def uniform_int_blocks(self, unit_bits: int = 8) -> bool:
        """True for a uniform 8/4/2-bit ``int`` format (not MX, mix, ternary or float) whose blocks are powers of two
        holding whole units of ``unit_bits`` bits of codes (8: bytes, 32: words): what the table-free one-pass
        decode kernels read (:mod:`.latent_attention_chunks`, :mod:`.latent_attention_absorbed`,
        :mod:`.latent_attention_lanes`). Raises nothing."""
        return (self.quantized and not self.mixed and not self.pow2 and not self.ternary and not self.meta_f8
                and self.bits in (8, 4, 2)
                and self.block > 0 and self.block & (self.block - 1) == 0 and self.block * self.bits >= unit_bits)

    def pieces(self, offsets: Sequence[int]) -> list[tuple[int, int, int, int]]:
        """(first packed column, count, bits, first block) of every (head, segment) piece, in row order.

        Raises:
            ValueError: a mix format whose heads or counts do not match ``offsets``.
        """
        ranks = [int(b) - int(a) for a, b in zip(offsets, offsets[1:])]
        if self.segments is None:
            segs = [((self.bits, r),) for r in ranks]
        else:
            segs = list(self.segments)
            if len(segs) != len(ranks) or [sum(c for _, c in hs) for hs in segs] != ranks:
                raise ValueError(f"latent format {self.name!r} plans {[sum(c for _, c in hs) for hs in segs]} "
                                 f"coordinates per head, but the ranks are {ranks}")
        out, block0 = [], 0
        for a, hs in zip(offsets, segs):
            col = int(a)
            for bits, count in hs:
                out.append((col, count, bits, block0))
                col += count
                block0 += -(-count // self.block)
        return out

    def padded_offsets(self, offsets: Sequence[int]) -> list[int]:
        """Return Hkv+1 offsets of each head's zero-padded coordinates (multiples of ``block``)."""
        out = [0]
        for a, b in zip(offsets, offsets[1:]):
            out.append(out[-1] + _ceil_to(int(b) - int(a), self.block))
        return out

    def num_blocks(self, offsets: Sequence[int]) -> int:
        """NB: quantization blocks per token row."""
        if self.mixed:
            return sum(-(-count // self.block) for _, count, _, _ in self.pieces(offsets))
        return self.padded_offsets(offsets)[-1] // self.block

    def code_bytes(self, offsets: Sequence[int]) -> list[int]:
        """Per head (per piece for a mix), the bytes of its codes: ``ceil(count * bits / 8)``."""
        if self.mixed or self.ternary or self.pow2:
            return [_code_bytes(count, bits) for _, count, bits, _ in self.pieces(offsets)]
        return [-(-(int(b) - int(a)) * self.bits // 8) for a, b in zip(offsets, offsets[1:])]

    def row_width(self, offsets: Sequence[int]) -> int:
        """Last-dim size of the stored latent: R_tot for ``"float"``, the row bytes for quantized formats."""
        if not self.quantized:
            return int(offsets[-1])
        return sum(self.code_bytes(offsets)) + self.meta_bytes * self.num_blocks(offsets)

    def bytes_per_token(self, offsets: Sequence[int], float_itemsize: int) -> int:
        """Bytes one token's row takes (``float_itemsize`` is the element size used for ``"float"``)."""
        return self.row_width(offsets) * (1 if self.quantized else float_itemsize)

    def storage_dtype(self, float_dtype: torch.dtype) -> torch.dtype:
        """dtype of the stored latent: ``float_dtype`` for ``"float"``, uint8 otherwise."""
        return torch.uint8 if self.quantized else float_dtype


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def parse_latent_format(fmt: "str | LatentFormat") -> LatentFormat:
    """Parse ``"float"``, ``"int8"``, ``"int4/64"`` ... into a :class:`LatentFormat`.

    Raises:
        ValueError: an unknown name, or a block that is not a positive multiple of ``8 / bits`` codes
            (a block must fill whole bytes).
    """
    if isinstance(fmt, LatentFormat):
        return fmt
    if fmt == "float":
        return LatentFormat("float", 16, 0)
    tern = _TERN_RE.match(str(fmt))
    if tern is not None:
        block = int(tern.group(1) or 32)
        if block < 1:
            raise ValueError(f"latent format {fmt!r}: the block must be >= 1")
        return LatentFormat(f"tern/{block}", TERNARY, block)
    mix = _MIX_RE.match(str(fmt))
    if mix is not None:
        block = int(mix.group(1))
        heads = []
        for head in mix.group(3).split(","):
            segs = []
            for seg in head.split("+"):
                m = _SEGMENT_RE.match(seg)
                if m is None or int(m.group(2)) < 1:
                    raise ValueError(f"latent format {fmt!r}: segment {seg!r} must be '<bits>x<count>' with bits 8, 4 "
                                     f"or 2 and count >= 1 (e.g. 'mix/32:8x32+4x64,8x32')")
                segs.append((int(m.group(1)), int(m.group(2))))
            heads.append(tuple(segs))
        if block < 8 or block % 8:
            raise ValueError(f"latent format {fmt!r}: the block must be a positive multiple of 8")
        return LatentFormat(str(fmt), 0, block, tuple(heads), meta_f8=mix.group(2) is not None)
    mx = _MX_RE.match(str(fmt))
    if mx is not None:
        bits, block = int(mx.group(1)), int(mx.group(2) or 32)
        if block < 1 or (block * bits) % 8:
            raise ValueError(f"latent format {fmt!r}: the block must be a positive multiple of {8 // bits} codes so "
                             f"that it fills whole bytes")
        return LatentFormat(f"mxint{bits}/{block}", bits, block, pow2=True)
    m = _FORMAT_RE.match(str(fmt))
    if m is None:
        raise ValueError(f"latent format must be 'float', 'int8', 'int4' or 'int2' (optionally '/block', e.g. "
                         f"'int4/64', and '-f8' for e4m3 block scales, e.g. 'int4/32-f8'), 'mxint8' or 'mxint4' "
                         f"(power-of-two block scales), 'tern' (ternary), or a 'mix/<block>[-f8]:...' bit plan, but "
                         f"got {fmt!r}")
    bits, block = int(m.group(1)), int(m.group(2) or 32)
    if block < 1 or (block * bits) % 8:
        raise ValueError(f"latent format {fmt!r}: the block must be a positive multiple of {8 // bits} codes so "
                         f"that it fills whole bytes")
    f8 = m.group(3) is not None
    return LatentFormat(f"int{bits}/{block}" + ("-f8" if f8 else ""), bits, block, meta_f8=f8)


def _pad_index(offsets: Sequence[int], fmt: LatentFormat, device: torch.device) -> torch.Tensor:
    """(R_tot,) long: padded column of every packed coordinate (built once per layout and device)."""
    return _layout_index("pad", tuple(int(o) for o in offsets), fmt, str(device))


def _code_byte_index(offsets: Sequence[int], fmt: LatentFormat, device: torch.device) -> torch.Tensor:
    """(sum_h cb_h,) long: the byte of the padded packed codes that each stored code byte is."""
    return _layout_index("code", tuple(int(o) for o in offsets), fmt, str(device))


@functools.lru_cache(maxsize=256)
def _layout_index(kind: str, offsets: tuple[int, ...], fmt: LatentFormat, device: str) -> torch.Tensor:
    """The index tensors above, cached: rebuilding them per call would copy host to device every decode step."""
    check_not_capturing(f"the {kind} index of {fmt.name}", device)
    padded = fmt.padded_offsets(offsets)
    if kind == "pad":
        cols = [torch.arange(a, b) - a + p for a, b, p in zip(offsets, offsets[1:], padded)]
    else:
        cols = [torch.arange(cb) + p * fmt.bits // 8 for cb, p in zip(fmt.code_bytes(offsets), padded)]
    return (torch.cat(cols) if cols else torch.zeros(0, dtype=torch.long)).to(device)


def _block_params(xb: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, scale) fp16 per block of ``xb`` (..., NB, block) fp32, rounded so the block's range is covered."""
    lo, hi = xb.amin(dim=-1), xb.amax(dim=-1)
    mn = lo.to(torch.float16)
    mn = torch.where(mn.float() > lo, torch.nextafter(mn, torch.full_like(mn, -math.inf)), mn)
    levels = (1 << bits) - 1
    scale = ((hi - mn.float()) / levels).to(torch.float16)
    short = mn.float() + levels * scale.float() < hi
    scale = torch.where(short, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)
    return mn, scale


#: largest latent magnitude an ``-f8`` block holds: its span (at most 2 * 192 plus the min's rounding, 16) stays
#: within float8_e4m3fn's 448
F8_MAX = 192.0


@functools.lru_cache(maxsize=16)
def _e4m3_grid(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(every finite float8_e4m3fn value ascending, fp32; its byte, uint8), -0 left out; built once per device."""
    check_not_capturing("the e4m3 rounding table", device)
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = raw.view(torch.float8_e4m3fn).float()
    keep = torch.isfinite(vals) & (raw != 0x80)
    vals, raw = vals[keep], raw[keep]
    order = torch.argsort(vals)
    return vals[order].to(device), raw[order].to(device)


def _e4m3_round(x: torch.Tensor, up: bool) -> torch.Tensor:
    """float8_e4m3fn bytes (uint8, shape of ``x``) of ``x`` rounded up (``up``) or down to an e4m3 value; NaN (byte
    0x7F) where ``x`` is NaN or has no e4m3 value on that side (above 448 rounding up, below -448 rounding down), so
    that an unrepresentable block decodes to NaN, never to plausible numbers."""
    vals, raw = _e4m3_grid(str(x.device))
    xs = x.float().contiguous()
    if up:
        i = torch.searchsorted(vals, xs, right=False)
        bad = i >= vals.numel()
    else:
        i = torch.searchsorted(vals, xs, right=True) - 1
        bad = i < 0
    out = raw[i.clamp_(0, vals.numel() - 1)]
    return torch.where(bad | torch.isnan(xs), torch.full_like(out, 0x7F), out)


def _e4m3_value(b: torch.Tensor) -> torch.Tensor:
    """fp32 values of float8_e4m3fn bytes ``b`` (uint8)."""
    return b.clone(memory_format=torch.contiguous_format).view(torch.float8_e4m3fn).float()


def f8_scale(span: torch.Tensor, bits: int) -> torch.Tensor:
    """The step of an ``-f8`` block from its stored span (fp32 values of the e4m3 bytes): ``span * fp32(1 / (2**bits
    - 1))``, one fp32 product (what every decode kernel computes, bit for bit). ``span``: any shape, fp32, in the
    latent's units; returns the same shape, fp32. Raises nothing. Source: e4m3 block scales as in OCP Microscaling
    Formats v1.0 (2023) and NVIDIA's NVFP4; here the span of an asymmetric (KIVI-style) block."""
    return span * torch.tensor(1.0 / ((1 << bits) - 1), dtype=torch.float32, device=span.device)


def f8_block_range(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                 torch.Tensor]:
    """An ``-f8`` block's stored minimum and span from its least and greatest values (any shape, fp32): ``(min,
    span)`` as fp32 values and as float8_e4m3fn bytes (uint8): min = ``lo`` rounded down, span = ``hi - min``
    rounded up (NaN where e4m3 holds no such value; see the module docstring). Raises nothing. Source: as
    :func:`f8_scale`."""
    mn = _e4m3_round(lo, up=False)
    mn_value = _e4m3_value(mn)
    span = _e4m3_round(hi - mn_value, up=True)
    return mn_value, _e4m3_value(span), mn, span


def _block_meta(xb: torch.Tensor, bits: int, f8: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block of ``xb`` (..., NB, block) fp32: (min, scale) as fp32 values, and the stored bytes of (scale,
    min): fp16 (two bytes each, (..., 2*NB)) or, with ``f8``, float8_e4m3fn bytes (one each, (..., NB)) of the
    block's span ``hi - min`` (rounded up) and min (rounded down), the step being :func:`f8_scale` of the span."""
    if f8:
        mn_value, span_value, mn, span = f8_block_range(xb.amin(dim=-1), xb.amax(dim=-1))
        return mn_value, f8_scale(span_value, bits), span, mn
    mn, sc = _block_params(xb, bits)
    return mn.float(), sc.float(), _fp16_bytes(sc), _fp16_bytes(mn)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``bits``-bit codes (..., N) uint8 (values < 2**bits, N a multiple of 8/bits) into (..., N*bits/8)
    uint8 bytes, the first code of each byte in its lowest bits."""
    per_byte = 8 // bits
    c = codes.view(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.uint8) * bits
    return (c << shifts).sum(dim=-1, dtype=torch.int32).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: (..., M) uint8 bytes -> (..., M*8/bits) uint8 codes."""
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits
    codes = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.to(torch.uint8).flatten(-2)


def quantize_latent_ref(z: torch.Tensor, offsets: Sequence[int], fmt: "str | LatentFormat") -> torch.Tensor:
    """Quantize packed latent rows into the stored byte layout of ``fmt``.

    Args:
        z: (..., R_tot) float, packed latent coordinates (``R_tot = offsets[-1]``).
        offsets: Hkv+1 ints.
        fmt: a quantized format (``"int8"``, ``"int4/64"``, ...).
    Returns:
        (..., row_bytes) uint8 (:meth:`LatentFormat.row_width`).
    Raises:
        ValueError: ``fmt`` is ``"float"`` or unknown, or (CPU tensors) a value is not finite or beyond fp16's
            range.
    """
    f = parse_latent_format(fmt)
    if not f.quantized:
        raise ValueError("quantize_latent_ref needs a quantized format, not 'float'")
    lead = z.shape[:-1]
    zf = z.float()
    # checked on the host only: on a GPU the check would synchronise every decode step (non-finite or
    # out-of-range latents then give non-finite scales, which propagate as NaN / inf, never plausible numbers)
    limit = F8_MAX if f.meta_f8 else _FP16_MAX
    if zf.numel() and not zf.is_cuda and not bool(torch.isfinite(zf).all() & (zf.abs() <= limit).all()):
        if f.meta_f8:
            raise ValueError(f"latent values must be finite and at most {F8_MAX:g} in magnitude to be quantized in "
                             f"{f.name!r} (its e4m3 block spans hold up to 448); use the format without '-f8' (fp16 "
                             f"block scales) for larger values")
        raise ValueError("latent values must be finite and within fp16 range (|x| <= 65504) to be quantized")
    if f.mixed or f.ternary or f.pow2:
        return _quantize_pieces(zf, offsets, f)
    padded = f.padded_offsets(offsets)
    nb = padded[-1] // f.block
    if nb == 0:
        return torch.zeros(*lead, 0, dtype=torch.uint8, device=z.device)
    xp = zf.new_zeros(*lead, padded[-1])
    xp[..., _pad_index(offsets, f, z.device)] = zf
    xb = xp.view(*lead, nb, f.block)
    mn, scale, scale_bytes, mn_bytes = _block_meta(xb, f.bits, f.meta_f8)
    levels = (1 << f.bits) - 1
    safe = torch.where(scale > 0, scale, 1.0)
    codes = torch.round((xb - mn[..., None]) / safe[..., None]).clamp_(0, levels).to(torch.uint8)
    packed = pack_codes(codes.view(*lead, nb * f.block), f.bits)[..., _code_byte_index(offsets, f, z.device)]
    return torch.cat((packed, scale_bytes, mn_bytes), dim=-1)


def dequantize_latent_ref(rows: torch.Tensor, offsets: Sequence[int], fmt: "str | LatentFormat") -> torch.Tensor:
    """Decode stored rows back to packed latent coordinates.

    Args:
        rows: (..., row_bytes) uint8 as written by :func:`quantize_latent_ref`.
        offsets: Hkv+1 ints.
        fmt: the format they were written with.
    Returns:
        (..., R_tot) fp32: ``code * scale + min`` per coordinate (padding dropped).
    Raises:
        ValueError: ``fmt`` is ``"float"``, or ``rows`` is not uint8 of the format's row width.
    """
    f = parse_latent_format(fmt)
    if not f.quantized:
        raise ValueError("dequantize_latent_ref needs a quantized format, not 'float'")
    width = f.row_width(offsets)
    if rows.dtype != torch.uint8 or rows.shape[-1] != width:
        raise ValueError(f"rows must be uint8 (..., {width}) for {f.name} with offsets {list(offsets)}, but got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    lead = rows.shape[:-1]
    if f.mixed or f.ternary or f.pow2:
        return _dequantize_pieces(rows, offsets, f)
    nb = f.num_blocks(offsets)
    if nb == 0:
        return torch.zeros(*lead, 0, dtype=torch.float32, device=rows.device)
    n_code_bytes = sum(f.code_bytes(offsets))
    packed = rows.new_zeros(*lead, nb * f.block * f.bits // 8)
    packed[..., _code_byte_index(offsets, f, rows.device)] = rows[..., :n_code_bytes]
    if f.meta_f8:
        scale = f8_scale(_e4m3_value(rows[..., n_code_bytes:n_code_bytes + nb]), f.bits)
        mn = _e4m3_value(rows[..., n_code_bytes + nb:])
    else:
        scale = _bytes_fp16(rows[..., n_code_bytes:n_code_bytes + 2 * nb])
        mn = _bytes_fp16(rows[..., n_code_bytes + 2 * nb:])
    codes = unpack_codes(packed, f.bits)
    x = codes.view(*lead, nb, f.block).float() * scale[..., None] + mn[..., None]
    return x.view(*lead, nb * f.block)[..., _pad_index(offsets, f, rows.device)]


def _code_bytes(count: int, bits: int) -> int:
    return -(-count // 5) if bits == TERNARY else -(-count * bits // 8)


def pack_ternary(codes: torch.Tensor) -> torch.Tensor:
    """Pack ternary codes (..., N) int8 in {-1, 0, 1} into (..., ceil(N/5)) uint8: ``sum_i (c_i + 1) * 3**i``
    over each five codes (zero-padded)."""
    n = codes.shape[-1]
    c = torch.nn.functional.pad(codes.to(torch.int32) + 1, (0, -(-n // 5) * 5 - n), value=1)
    c = c.view(*codes.shape[:-1], -(-n // 5), 5)  # explicit, so that zero rows reshape too
    weights = 3 ** torch.arange(5, dtype=torch.int32, device=codes.device)
    return (c * weights).sum(-1).to(torch.uint8)


def unpack_ternary(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_ternary`: (..., M) uint8 -> (..., n) int8 codes in {-1, 0, 1}."""
    v = packed.to(torch.int32)[..., None] // 3 ** torch.arange(5, dtype=torch.int32, device=packed.device)
    return ((v % 3) - 1).to(torch.int8).flatten(-2)[..., :n]


def _ternary_scale(xb: torch.Tensor) -> torch.Tensor:
    """fp16 per block of ``xb`` (..., NB, block): the absolute maximum, rounded up to fp16."""
    amax = xb.abs().amax(dim=-1)
    s = amax.to(torch.float16)
    return torch.where(s.float() < amax, torch.nextafter(s, torch.full_like(s, math.inf)), s)


def _pow2_exponent(xb: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 per block of ``xb`` (..., NB, block): the least ``e`` in [-126, 127] with ``amax <= qmax * 2**e``."""
    qmax = (1 << (bits - 1)) - 1
    mant, ex = torch.frexp(xb.abs().amax(dim=-1) / qmax)  # ratio = mant * 2**ex, mant in [0.5, 1) (0 for 0)
    e = torch.where(mant == 0.5, ex - 1, ex)  # ceil(log2(ratio)); an exact power of two needs no rounding up
    return torch.where(mant == 0, -126, e).clamp(-126, 127).to(torch.int32)


def _pow2_scale(e: torch.Tensor) -> torch.Tensor:
    """fp32 ``2**e`` of integer exponents, exactly."""
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)


def _fp16_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).view(*t.shape[:-1], 2 * t.shape[-1])


def _bytes_fp16(b: torch.Tensor) -> torch.Tensor:
    return b.clone(memory_format=torch.contiguous_format).view(torch.float16).float()


def _quantize_pieces(zf: torch.Tensor, offsets: Sequence[int], f: LatentFormat) -> torch.Tensor:
    """quantize_latent_ref for any format, one (head, segment) piece at a time (the layout of the docstring)."""
    lead = zf.shape[:-1]
    codes, scales, mins = [], [], []
    for col, count, bits, _ in f.pieces(offsets):
        nb = -(-count // f.block)
        xp = zf.new_zeros(*lead, nb * f.block)
        xp[..., :count] = zf[..., col:col + count]
        xb = xp.view(*lead, nb, f.block)
        if bits == TERNARY:
            scale = _ternary_scale(xb)
            safe = torch.where(scale.float() > 0, scale.float(), 1.0)
            c = torch.round(xb / safe[..., None]).clamp_(-1, 1).to(torch.int8)
            codes.append(pack_ternary(c.view(*lead, nb * f.block)[..., :count]))
            scales.append(_fp16_bytes(scale))
            continue
        if f.pow2:
            e = _pow2_exponent(xb, bits)
            qmax = (1 << (bits - 1)) - 1
            c = torch.round(xb / _pow2_scale(e)[..., None]).clamp_(-qmax, qmax).to(torch.int32)
            c = (c & ((1 << bits) - 1)).to(torch.uint8)  # two's complement in ``bits`` bits
            codes.append(pack_codes(c.view(*lead, nb * f.block), bits)[..., :-(-count * bits // 8)])
            scales.append((e + 127).to(torch.uint8))
            continue
        mn, scale, scale_bytes, mn_bytes = _block_meta(xb, bits, f.meta_f8)
        safe = torch.where(scale > 0, scale, 1.0)
        c = torch.round((xb - mn[..., None]) / safe[..., None]).clamp_(0, (1 << bits) - 1).to(torch.uint8)
        codes.append(pack_codes(c.view(*lead, nb * f.block), bits)[..., :-(-count * bits // 8)])
        scales.append(scale_bytes)
        mins.append(mn_bytes)
    if not codes:
        return torch.zeros(*lead, 0, dtype=torch.uint8, device=zf.device)
    return torch.cat(codes + scales + mins, dim=-1)


def _dequantize_pieces(rows: torch.Tensor, offsets: Sequence[int], f: LatentFormat) -> torch.Tensor:
    """dequantize_latent_ref for any format, one piece at a time."""
    lead = rows.shape[:-1]
    pieces = f.pieces(offsets)
    out = torch.zeros(*lead, int(offsets[-1]), dtype=torch.float32, device=rows.device)
    n_code = sum(f.code_bytes(offsets))
    nb_all = f.num_blocks(offsets)
    byte = 0
    for col, count, bits, block0 in pieces:
        if count == 0:  # a head of rank 0: no codes, no blocks (its empty byte slices cannot be viewed as fp16)
            continue
        nb, cb = -(-count // f.block), _code_bytes(count, bits)
        if bits == TERNARY:
            c = unpack_ternary(rows[..., byte:byte + cb], count).float()
            byte += cb
            scale = _bytes_fp16(rows[..., n_code + 2 * block0:n_code + 2 * (block0 + nb)])
            out[..., col:col + count] = c * scale.repeat_interleave(f.block, dim=-1)[..., :count]
            continue
        packed = rows.new_zeros(*lead, nb * f.block * bits // 8)
        packed[..., :cb] = rows[..., byte:byte + cb]
        byte += cb
        if f.pow2:
            u = unpack_codes(packed, bits).view(*lead, nb, f.block).to(torch.int32)
            c = u - ((u >> (bits - 1)) << bits)  # two's complement
            e = rows[..., n_code + block0:n_code + block0 + nb].to(torch.int32) - 127
            x = c.float() * _pow2_scale(e)[..., None]
            out[..., col:col + count] = x.view(*lead, nb * f.block)[..., :count]
            continue
        if f.meta_f8:
            scale = f8_scale(_e4m3_value(rows[..., n_code + block0:n_code + block0 + nb]), bits)
            mn = _e4m3_value(rows[..., n_code + nb_all + block0:n_code + nb_all + block0 + nb])
        else:
            scale = _bytes_fp16(rows[..., n_code + 2 * block0:n_code + 2 * (block0 + nb)])
            mn = _bytes_fp16(rows[..., n_code + 2 * (nb_all + block0):n_code + 2 * (nb_all + block0 + nb)])
        x = unpack_codes(packed, bits).view(*lead, nb, f.block).float() * scale[..., None] + mn[..., None]
        out[..., col:col + count] = x.view(*lead, nb * f.block)[..., :count]
    return out
