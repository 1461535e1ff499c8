"""Prototype (not wired into the backend): a Gluon decode pass over int4 latents whose codes reach the tensor cores
with no data movement, for Issue 5's bandwidth target at GQA shapes.

The word pass (ckvp_compile/kernels/latent_attention_words.py) spends ~10 instructions per code and thread, most in
moving operands between Triton's load layout and the tensor cores' register layout, and in a softmax over
(slots, query heads). This prototype fixes the layouts by hand (Gluon, Triton's layout-explicit dialect):

* keys: scores ``S = C @ K^T`` with the query heads as the 16 rows (rows 0..G-1 the folded query in fp16, rows
  8..8+G-1 its fp16 remainder: the two halves of each accumulator pair share a thread, so hi + lo is one add) and
  the tokens as columns. Each thread's operand for one token is one 32-bit word of that token's codes (a fixed
  nibble order chosen at pack time), turned into four fp16 pairs by ``lop3`` with 0x6400 (Marlin's conversion)
  and one ``sub.f16x2`` each;
* values: ``O = P @ V`` with P straight from the scores' accumulator layout (FlashAttention-2's register reuse) and
  V's operand built from half-words of two tokens (one ``prmt``, or none when the token pairs' half-words are
  stored interleaved: ``PAIRS``);
* at G = 4 (G = 2) two (four) groups of tokens share one score product through a block-diagonal folded query, so
  all 8 rows of the softmax are real;
* one warp per program, no shared memory, no cross-warp step; splits of the context merged afterwards; the next
  one or two tiles' loads are issued before the current tile is computed (``PREFETCH``).

Measured (H200, 32:8 heads, int4 rank 32, batch 8-32, 32k-128k): 61-72% of the copy bandwidth, 6.1-6.7x faster than
the word pass and 7.6-8.7x faster than dense SDPA in the same run (benchmarks/results/2026-12-04-mma-pass-proto-h200).
Not timed here: the query folding prologue and the split merge / value-basis projection; no page table, lengths or
exact-token window yet.

Layout of the packed cache (per (sequence, KV head), tokens contiguous): key words ``(T, 4)`` int32, value
half-words ``(T, 8)`` int16, per-token fp16 (scale, centred min) for keys and values. Int4 codes, key and value
rank 32, one quantization block per token and head (the ``int4/32`` format at rank 32).

Run on the GPU: ``PYTHONPATH=. python3 benchmarks/mma_pass_proto.py --check`` (numerics) and ``--out DIR`` (the
sweep); compile for sm_90a here (no GPU): ``python benchmarks/mma_pass_proto.py --compile-only``.

Sources (read, not copied): Marlin (arXiv:2408.11743) and FasterTransformer (the 0x6400 int4 -> fp16 conversion),
FlashAttention-2 (arXiv:2307.08691: online softmax, P reused from the accumulator layout), FlashDecoding (split-KV),
DeepSeek-V2 (arXiv:2405.04434: query absorption), the PTX ISA's ``mma.m16n8k16`` fragment layouts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

# The dequantization asm and the weight-tile helpers are the product's (the MMA pass grew from this prototype): one
# copy, in ckvp_compile/kernels/latent_attention_mma.py.
from ckvp_compile.kernels.latent_attention_mma import _DEQ_ASM, _dequant8, _group_tiles, _pair_words

RK_, RV_, ROWS_ = 32, 32, 16
RK = gl.constexpr(RK_)
RV = gl.constexpr(RV_)
ROWS = gl.constexpr(ROWS_)  # tensor-core rows: 8 for the query heads (hi), 8 for their remainders (lo)

@gluon.jit
def _load_tile(kw_ptr, vh_ptr, ks_ptr, kc_ptr, vs_ptr, vc_ptr, tok, koff, voff, tok_s, PAIRS: gl.constexpr):
    """One tile's raw registers: key words, the 4 per-token fp16 tensors (key scale, key centred min, value scale,
    value centred min; one array each: a record per token loads no wider, see the README of the results), the value
    half-words of even and odd tokens (PAIRS: the int32 words of token pairs, stored interleaved, twice)."""
    if PAIRS:
        wv = gl.load(vh_ptr + (tok // 2) * 8 + voff)
        vlo, vhi = wv, wv
    else:
        hoff = voff + (voff // 8) * 8  # half-word g of token 2p: 16 p + g
        vlo = gl.load(vh_ptr + tok * 8 + hoff)
        vhi = gl.load(vh_ptr + tok * 8 + hoff + 8)
    return (gl.load(kw_ptr + tok * 4 + koff), gl.load(ks_ptr + tok + tok_s), gl.load(kc_ptr + tok + tok_s),
            gl.load(vs_ptr + tok + tok_s), gl.load(vc_ptr + tok + tok_s), vlo, vhi)


@gluon.jit
def _tile_step(wk, ks16, kc16, vs16, vc16, vlo, vhi, ca, sumc, vexp, m_i, l_q, n_q, acc,
               L: gl.constexpr, AL: gl.constexpr, BL: gl.constexpr, LS: gl.constexpr, KS: gl.constexpr,
               BT: gl.constexpr, NT: gl.constexpr, G: gl.constexpr, GROUPS: gl.constexpr, PLO: gl.constexpr,
               PAIRS: gl.constexpr):
    """One tile: scores on the tensor cores, the online softmax, the value product. l_q / n_q: (8 rows, 4 lanes)
    per-lane partial sums of the weights and of weight x value centred min (summed over the lanes once, at the
    end)."""
    x = _dequant8(wk)  # (4, GROUPS, NT, 8, e, h, s)
    x = gl.reshape(gl.permute(x, [1, 6, 5, 0, 4, 2, 3]), [KS, 8 * NT])
    kb = gl.convert_layout(x, BL)
    s = mma_v2(ca, kb, gl.zeros([ROWS, 8 * NT], gl.float32, L))
    s = gl.sum(gl.reshape(s, [2, 8, 8 * NT]), axis=0)  # hi + lo, (8, 8 NT) in LS
    s = s * ks16.to(gl.float32) + kc16.to(gl.float32) * sumc[:, None]
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    # per-lane partials: columns 8 j + 2 q + e of a row -> (j, q, e); sum over the thread's own j and e
    al_q = gl.convert_layout(alpha, gl.SliceLayout(1, l_q.type.layout))[:, None]
    l_q = l_q * al_q + gl.convert_layout(gl.sum(gl.sum(gl.reshape(p, [8, NT, 4, 2]), axis=3), axis=1),
                                         l_q.type.layout)
    n_q = n_q * al_q + gl.convert_layout(
        gl.sum(gl.sum(gl.reshape(p * vc16.to(gl.float32), [8, NT, 4, 2]), axis=3), axis=1), n_q.type.layout)
    acc3 = gl.reshape(acc, [2, 8, RV])
    al3 = gl.convert_layout(alpha, gl.SliceLayout(0, gl.SliceLayout(2, acc3.type.layout)))
    acc = gl.convert_layout(gl.reshape(acc3 * al3[None, :, None], [ROWS, RV]), L)
    pw = p * (vs16.to(gl.float32) * vexp)
    p_hi = pw.to(gl.float16)
    if PLO:
        p_lo = (pw - p_hi.to(gl.float32)).to(gl.float16)
    else:
        p_lo = gl.zeros([8, 8 * NT], gl.float16, LS)
    ph = _group_tiles(gl.reshape(p_hi, [8, NT, 8]), GROUPS, G, NT)
    pl = _group_tiles(gl.reshape(p_lo, [8, NT, 8]), GROUPS, G, NT)
    pa = gl.convert_layout(gl.reshape(gl.permute(gl.join(ph, pl), [2, 0, 1]), [ROWS, BT]), AL)
    if PAIRS:
        wv = vlo
    else:
        wv = _pair_words(vlo, vhi)
    y = _dequant8(wv)  # (BT/2, 8, e, i_lo, i_hi)
    vb = gl.convert_layout(gl.reshape(gl.permute(y, [0, 2, 4, 3, 1]), [BT, RV]), BL)
    return m_new, l_q, n_q, mma_v2(pa, vb, acc)


@gluon.jit
def _mma_pass_kernel(kw_ptr, vh_ptr, ks_ptr, kc_ptr, vs_ptr, vc_ptr, ca_ptr, sumc_ptr, vexp_ptr,
                     m_out, l_out, o_out, T, CHUNK, NSPLIT,
                     NT: gl.constexpr, G: gl.constexpr, PLO: gl.constexpr, PREFETCH: gl.constexpr,
                     PAIRS: gl.constexpr):
    GROUPS: gl.constexpr = 8 // G
    KS: gl.constexpr = RK * GROUPS
    BT: gl.constexpr = 8 * NT * GROUPS
    split = gl.program_id(0)
    bh = gl.program_id(1)
    L: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L, k_width=2)
    BL: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=L, k_width=2)
    # key words (q, group, n8 tile, token g): lane = q + 4 g
    WL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 1], threads_per_warp=[4, 1, 1, 8],
                                        warps_per_cta=[1, 1, 1, 1], order=[0, 3, 2, 1])
    # value half-word pairs (pair, g)
    VL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[4, 8], warps_per_cta=[1, 1],
                                        order=[0, 1])

    # the folded query, block-diagonal over the token groups: (16, KS) fp16, the A operand
    ra = gl.arange(0, ROWS, layout=gl.SliceLayout(1, AL))
    ka = gl.arange(0, KS, layout=gl.SliceLayout(0, AL))
    ca = gl.load(ca_ptr + bh * ROWS * KS + ra[:, None] * KS + ka[None, :])

    zero_s = gl.zeros([ROWS, 8 * NT], gl.float32, L)
    LS: gl.constexpr = gl.sum(gl.reshape(zero_s, [2, 8, 8 * NT]), axis=0).type.layout
    zero_s0 = gl.zeros([8, 8 * NT], gl.float32, LS)
    rows = gl.arange(0, 8, layout=gl.SliceLayout(1, LS))
    cols = gl.arange(0, 8 * NT, layout=gl.SliceLayout(0, LS))
    # token of score (row, col) within the tile: 8 GROUPS j + 8 grp + c
    tok_s = (cols // 8)[None, :] * (8 * GROUPS) + (rows // G)[:, None] * 8 + (cols % 8)[None, :]
    sumc = gl.load(sumc_ptr + bh * 8 + rows)
    vexp = gl.load(vexp_ptr + bh)

    W4: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, WL)))
    qw = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, WL))))
    gw = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, WL))))
    jw = gl.arange(0, NT, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, WL))))
    cw = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, WL))))
    tok_k = (gw[None, :, None, None] * 8 + jw[None, None, :, None] * (8 * GROUPS) + cw[None, None, None, :])
    koff = tok_k * 4 + qw[:, None, None, None]
    pv = gl.arange(0, BT // 2, layout=gl.SliceLayout(1, VL))
    gv = gl.arange(0, 8, layout=gl.SliceLayout(0, VL))
    voff = pv[:, None] * 8 + gv[None, :]  # (pair, g): half-word 2 voff (+ 8) of the tile, or word voff (PAIRS)

    m_i = gl.full([8], -float("inf"), gl.float32, gl.SliceLayout(1, LS))
    LQ: gl.constexpr = gl.sum(gl.sum(gl.reshape(zero_s0, [8, NT, 4, 2]), axis=3), axis=1).type.layout
    l_q = gl.zeros([8, 4], gl.float32, LQ)
    n_q = gl.zeros([8, 4], gl.float32, LQ)
    acc = gl.zeros([ROWS, RV], gl.float32, L)

    start = split * CHUNK
    stop = gl.minimum(start + CHUNK, T)
    base = bh.to(gl.int64) * T
    last = gl.maximum(stop - BT, start)
    if PREFETCH >= 1:
        tile_a = _load_tile(kw_ptr, vh_ptr, ks_ptr, kc_ptr, vs_ptr, vc_ptr, base + start, koff, voff, tok_s,
                            PAIRS)
    if PREFETCH == 2:
        tile_b = _load_tile(kw_ptr, vh_ptr, ks_ptr, kc_ptr, vs_ptr, vc_ptr, base + gl.minimum(start + BT, last),
                            koff, voff, tok_s, PAIRS)
    for t0 in range(start, stop, BT):
        if PREFETCH == 0:
            wk, ks16, kc16, vs16, vc16, vlo, vhi = _load_tile(kw_ptr, vh_ptr, ks_ptr, kc_ptr, vs_ptr, vc_ptr,
                                                              base + t0, koff, voff, tok_s, PAIRS)
        elif PREFETCH == 1:
            wk, ks16, kc16, vs16, vc16, vlo, vhi = tile_a
            tile_a = _load_tile(kw_ptr, vh_ptr, ks_ptr, kc_ptr, vs_ptr, vc_ptr,
                                base + gl.minimum(t0 + BT, last), koff, voff, tok_s, PAIRS)
        else:
            wk, ks16, kc16, vs16, vc16, vlo, vhi = tile_a
            tile_a = tile_b
            tile_b = _load_tile(kw_ptr, vh_ptr, ks_ptr, kc_ptr, vs_ptr, vc_ptr,
                                base + gl.minimum(t0 + 2 * BT, last), koff, voff, tok_s, PAIRS)
        m_i, l_q, n_q, acc = _tile_step(wk, ks16, kc16, vs16, vc16, vlo, vhi, ca, sumc, vexp, m_i, l_q, n_q, acc,
                                        L, AL, BL, LS, KS, BT, NT, G, GROUPS, PLO, PAIRS)

    o = gl.sum(gl.reshape(acc, [2, 8, RV]), axis=0)
    LO: gl.constexpr = o.type.layout
    ho = gl.arange(0, 8, layout=gl.SliceLayout(1, LO))
    jo = gl.arange(0, RV, layout=gl.SliceLayout(0, LO))
    # columns 8..15 and 24..31 carry 16 * (code - 8); the weights carried vscale * vexp
    colf = gl.where((jo // 8) % 2 == 1, 1.0 / 16.0, 1.0) / vexp
    nsum = gl.convert_layout(gl.sum(n_q, axis=1), gl.SliceLayout(1, LO))
    o = o * colf[None, :] + nsum[:, None]
    out = bh * NSPLIT + split
    gl.store(o_out + out * 8 * RV + ho[:, None] * RV + jo[None, :], o)
    gl.store(m_out + out * 8 + rows, m_i)
    gl.store(l_out + out * 8 + rows, gl.convert_layout(gl.sum(l_q, axis=1), gl.SliceLayout(1, LS)))


# ---------------------------------------------------------------- host side: packing, reference, launch


def pack_keys(codes: torch.Tensor) -> torch.Tensor:
    """(..., T, 32) uint8 codes -> (..., T, 4) int32 words: word q, nibble 4e + 2s + h = coordinate 16s+8h+2q+e."""
    c = codes.to(torch.int64)
    words = torch.zeros(*codes.shape[:-1], 4, dtype=torch.int64, device=codes.device)
    for q in range(4):
        for s in range(2):
            for h in range(2):
                for e in range(2):
                    words[..., q] |= c[..., 16 * s + 8 * h + 2 * q + e] << (4 * (4 * e + 2 * s + h))
    return _to_i32(words)


def pack_values(codes: torch.Tensor) -> torch.Tensor:
    """(..., T, 32) uint8 codes -> (..., T, 8) int16 half-words: half-word g, nibble i = coordinate g + 8i."""
    c = codes.to(torch.int64)
    hw = torch.zeros(*codes.shape[:-1], 8, dtype=torch.int64, device=codes.device)
    for g in range(8):
        for i in range(4):
            hw[..., g] |= c[..., g + 8 * i] << (4 * i)
    hw = torch.where(hw >= 2 ** 15, hw - 2 ** 16, hw)
    return hw.to(torch.int16)


def unpack_keys(words: torch.Tensor) -> torch.Tensor:
    """(..., T, 4) words -> (..., T, 32) int64 codes: the inverse of :func:`pack_keys` as the kernel's ``lop3`` /
    ``shr`` steps read it (half e of op (s, h) is bits 16e + 4h of ``word >> 8s``). The asm text itself is checked
    against the packed codes in tests/benchmarks/test_mma_pass_proto.py."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros(*words.shape[:-1], 32, dtype=torch.int64, device=words.device)
    for q in range(4):
        for s in range(2):
            src = w[..., q] >> (8 * s)
            for h in range(2):
                for e in range(2):
                    out[..., 16 * s + 8 * h + 2 * q + e] = (src >> (16 * e + 4 * h)) & 0xF
    return out


def unpack_values(halves: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_values` as the kernel reads it: a token pair's half-words g form one word
    (``prmt``), whose op i = (shift 8 * (i // 2), mask nibble i % 2) yields coordinate g + 8i of both tokens."""
    hw = halves.to(torch.int64) & 0xFFFF
    out = torch.zeros(*halves.shape[:-1], 32, dtype=torch.int64, device=halves.device)
    for g in range(8):
        for i in range(4):
            out[..., g + 8 * i] = (hw[..., g] >> (8 * (i // 2) + 4 * (i % 2))) & 0xF
    return out


def emulate(prep) -> torch.Tensor:
    """The kernel's arithmetic in fp32 torch, one split, from the packed inputs: (BH, G, RV) value latent. Checks the
    packing, the block-diagonal folded query and the centring / x16 / vexp bookkeeping without a GPU."""
    G, BH, T = prep["G"], prep["BH"], prep["T"]
    groups = 8 // G
    col = torch.arange(RK_)
    fac = torch.where((col // 8) % 2 == 1, 16.0, 1.0)
    kcent = (unpack_keys(prep["kw"]).float() - 8) * fac  # what the fp16 operand holds
    ca = prep["ca"].float()  # (BH, 16, groups * RK)
    S = torch.einsum("brk,btk->brt", ca[:, :, :RK_], kcent)  # group 0's block serves every token here
    s = S[:, :G] + S[:, 8:8 + G]
    for grp in range(1, groups):  # every group's block holds the same query
        blk = ca[:, :, grp * RK_:(grp + 1) * RK_]
        assert torch.equal(blk[:, grp * G:(grp + 1) * G], ca[:, :G, :RK_])
    s = s * prep["ks"].float()[:, None] + prep["kc"].float()[:, None] * prep["sumc"][:, :G, None]
    p = torch.exp2(s - s.amax(-1, keepdim=True))
    vcent = (unpack_values(prep["vh"]).float() - 8) * fac
    w = (p * (prep["vs"].float() * prep["vexp"][:, None])[:, None]).half().float()
    o = torch.einsum("bht,btr->bhr", w, vcent) / fac / prep["vexp"][:, None, None]
    o = o + (p * prep["vc"].float()[:, None]).sum(-1, keepdim=True)
    return o / p.sum(-1, keepdim=True)


def pair_values(halves: torch.Tensor) -> torch.Tensor:
    """(..., T, 8) int16 half-words (:func:`pack_values`) -> (..., T / 2, 8) int32: word g of token pair p holds
    half-word g of token 2p (low) and of token 2p + 1 (high), the register the kernel's value operand needs."""
    h = halves.to(torch.int64) & 0xFFFF
    return _to_i32(h[..., 0::2, :] | (h[..., 1::2, :] << 16))


def _to_i32(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 2 ** 31, x - 2 ** 32, x).to(torch.int32)


def make_case(B, Hkv, G, T, device, seed=0):
    """A random int4 latent cache and folded query: codes (B*Hkv, T, 32) uint8 for keys and values, per-token
    fp16 scales (0.05-0.15) and centred mins, the folded query c (B*Hkv, G, 32) fp32 in log2 units."""
    gen = torch.Generator(device=device).manual_seed(seed)
    BH = B * Hkv
    kcodes = torch.randint(0, 16, (BH, T, RK_), generator=gen, device=device, dtype=torch.uint8)
    vcodes = torch.randint(0, 16, (BH, T, RV_), generator=gen, device=device, dtype=torch.uint8)
    ks = (0.05 + 0.1 * torch.rand(BH, T, generator=gen, device=device)).half()
    kc = (0.3 * torch.randn(BH, T, generator=gen, device=device)).half()
    vs = (0.05 + 0.1 * torch.rand(BH, T, generator=gen, device=device)).half()
    vc = (0.3 * torch.randn(BH, T, generator=gen, device=device)).half()
    c = 0.4 * torch.randn(BH, G, RK_, generator=gen, device=device)  # folded query, log2 units
    return dict(kcodes=kcodes, vcodes=vcodes, ks=ks, kc=kc, vs=vs, vc=vc, c=c, G=G)


def reference(case):
    """fp32 latent attention: (BH, G, RV_) value latent, softmax in base 2."""
    k = case["kc"].float()[..., None] + case["ks"].float()[..., None] * (case["kcodes"].float() - 8)
    v = case["vc"].float()[..., None] + case["vs"].float()[..., None] * (case["vcodes"].float() - 8)
    s = torch.einsum("bgr,btr->bgt", case["c"], k)
    p = torch.softmax(s * math.log(2.0), dim=-1)
    return torch.einsum("bgt,btr->bgr", p, v)


def prepare(case):
    """The kernel's inputs from :func:`make_case`: packed words, the block-diagonal (16, 32 * 8 / G) fp16 folded query
    (hi rows 0..7, fp16 remainder rows 8..15; columns of the x16 nibbles divided by 16), its row sums (BH, 8) and
    the per-head power of two ``vexp`` for the value weights."""
    c, G = case["c"], case["G"]
    BH = c.shape[0]
    col = torch.arange(RK_, device=c.device)
    cdiv = torch.where((col // 8) % 2 == 1, c / 16.0, c)  # the h = 1 nibbles carry 16 * code
    hi = cdiv.half()
    lo = (cdiv - hi.float()).half()
    groups = 8 // G
    ca = torch.zeros(BH, ROWS_, groups * RK_, dtype=torch.float16, device=c.device)
    for grp in range(groups):
        ca[:, grp * G:(grp + 1) * G, grp * RK_:(grp + 1) * RK_] = hi
        ca[:, 8 + grp * G:8 + (grp + 1) * G, grp * RK_:(grp + 1) * RK_] = lo
    sumc = c.sum(-1).repeat(1, groups)
    vmax = case["vs"].float().amax(-1).clamp_min(2.0 ** -24)  # all-zero scales: no inf
    vexp = torch.exp2(14 - torch.floor(torch.log2(vmax)))  # the largest weight p * vscale * vexp in [2^14, 2^15)
    return dict(kw=pack_keys(case["kcodes"]), vh=pack_values(case["vcodes"]), ks=case["ks"].contiguous(),
                kc=case["kc"].contiguous(), vs=case["vs"].contiguous(), vc=case["vc"].contiguous(),
                ca=ca.contiguous(), sumc=sumc.contiguous(), vexp=vexp.contiguous(), BH=BH, G=G,
                T=case["kcodes"].shape[1])


def split_plan(T: int, nsplit: int, bt: int) -> tuple[int, int]:
    """(tokens per split, splits): about ``nsplit`` splits of whole ``bt``-token tiles covering ``T`` tokens, none
    empty (an empty split would load its first tile past the cache)."""
    chunk = -(-T // max(1, nsplit) // bt) * bt
    return chunk, -(-T // chunk)


def launch(prep, nsplit, nt=2, plo=False, bufs=None, prefetch=1, pairs=False, maxnreg=None):
    """Run the kernel on ``prepare``'s inputs with about ``nsplit`` context splits (fewer where the rounded-up
    chunks cover the context sooner: no split is empty, none reads past the cache); returns (m, l, o) per split.

    Raises:
        ValueError: G outside (2, 4, 8), or a context that is not a whole number of tiles (the prototype has no
            masks; the real pass needs per-sequence lengths).
    """
    BH, T, G = prep["BH"], prep["T"], prep["G"]
    if G not in (2, 4, 8):
        raise ValueError(f"the prototype packs G = 2, 4 or 8 query heads per KV head, got {G}")
    bt = 64 // G * nt
    if T % bt:
        raise ValueError(f"the prototype needs the context to be a multiple of {bt} tokens, got {T}")
    chunk, nsplit = split_plan(T, nsplit, bt)
    dev = prep["kw"].device
    if bufs is None:
        bufs = (torch.empty(BH, nsplit, 8, device=dev), torch.empty(BH, nsplit, 8, device=dev),
                torch.empty(BH, nsplit, 8, RV_, device=dev))
    m, l, o = bufs
    if pairs and "vp" not in prep:
        prep["vp"] = pair_values(prep["vh"])
    kw = {"maxnreg": maxnreg} if maxnreg else {}
    _mma_pass_kernel[(nsplit, BH)](prep["kw"], prep["vp"] if pairs else prep["vh"], prep["ks"], prep["kc"],
                                   prep["vs"], prep["vc"],
                                   prep["ca"], prep["sumc"], prep["vexp"], m, l, o, T, chunk, nsplit,
                                   NT=nt, G=G, PLO=plo, PREFETCH=int(prefetch), PAIRS=bool(pairs),
                                   num_warps=1, **kw)
    return bufs


def merge(bufs, G):
    """Merge the per-split (m, l, o) of :func:`launch` (each row of 8 is one (token group, query head)) into the
    (BH, G, 32) value latent: FlashDecoding's reduction, in base 2."""
    m, l, o = bufs
    BH, ns = m.shape[:2]
    m, l, o = m.reshape(BH, ns * 8 // G, G), l.reshape(BH, ns * 8 // G, G), o.reshape(BH, ns * 8 // G, G, RV_)
    mx = m.amax(1, keepdim=True)
    w = torch.exp2(m - mx)
    out = (o * w[..., None]).sum(1) / (l * w).sum(1)[..., None]
    return out


def bench(fn, reps=200):
    """Median ms of ``fn`` from CUDA-graph replays of 10 calls (the timer every committed result of this script
    used). ``ckvp_compile.bench.attention.graph_bench`` is the project's equivalent (``do_bench_cudagraph``): use
    it when this pass is wired into the backend."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps // 10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 10)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth():
    """Device copy bandwidth in GB/s (read + write), measured as ``ckvp-bench attention`` measures it."""
    from ckvp_compile.bench.attention import copy_bandwidth as cb

    return cb("cuda") / 1e9  # GB/s, read + write, the attention benchmark's measure


def main():
    """The command line: ``--check``, ``--compile-only`` or a sweep over cases, tile sizes, splits and modes."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--check", action="store_true", help="GQA 2, 4, 8, both value layouts, 1k tokens: exit 1 past 1e-3")
    ap.add_argument("--cases", default="8:8:4:32768,32:8:4:32768,8:8:4:131072,32:8:4:131072")
    ap.add_argument("--splits", default="16,32,64")
    ap.add_argument("--nts", default="1,2,4")
    ap.add_argument("--modes", default="0/1/1", help="plo/prefetch/pairs[/maxnreg] tuples")
    args = ap.parse_args()
    if args.compile_only:
        return compile_only()
    if args.check:
        sys.exit(0 if check() else 1)
    rows = []
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s (read + write)", flush=True)
    for spec in args.cases.split(","):
        B, Hkv, G, T = map(int, spec.split(":"))
        case = make_case(B, Hkv, G, T, "cuda")
        ref = reference(case) if B * Hkv * T <= 8 * 8 * 32768 else None
        prep = prepare(case)
        del case
        nbytes = sum(prep[k].numel() * prep[k].element_size() for k in ("kw", "vh", "ks", "kc", "vs", "vc"))
        dense = B * Hkv * T * 2 * 128 * 2  # bf16 K and V, head_dim 128
        for nt in map(int, args.nts.split(",")):
            for plo, pf, pairs, mr in [tuple(map(int, (x + "/0").split("/")[:4])) for x in args.modes.split(",")]:
                for ns in map(int, args.splits.split(",")):
                    try:
                        bufs = launch(prep, ns, nt, plo, prefetch=pf, pairs=pairs, maxnreg=mr or None)
                        ns_run = bufs[0].shape[1]
                        torch.cuda.synchronize()
                        err = None
                        if ref is not None:
                            out = merge(bufs, G)
                            err = ((out - ref).norm() / ref.norm()).item()
                        ms = bench(lambda: launch(prep, ns, nt, plo, bufs=bufs, prefetch=pf, pairs=pairs,
                                                 maxnreg=mr or None))
                    except Exception as e:  # noqa: BLE001 - report and go on
                        print(f"{spec} nt={nt} ns={ns}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                        continue
                    gbs = nbytes / ms / 1e6
                    row = dict(case=spec, B=B, Hkv=Hkv, G=G, T=T, tokens_per_iter=64 // G * nt, nt=nt, plo=plo,
                               prefetch=pf, pairs=pairs, maxnreg=mr, nsplit=ns, nsplit_run=ns_run, ms=ms,
                               bytes=nbytes, gbs=gbs, pct_copy=100 * gbs / bw, rel_err=err, dense_bytes=dense,
                               byte_ratio=dense / nbytes)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        del prep
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "mma_pass_proto.json"), "w") as f:
            json.dump(dict(copy_gbs=bw, copy_gbs_end=copy_bandwidth(), gpu=torch.cuda.get_device_name(),
                           torch=torch.__version__, triton=triton.__version__, rows=rows,
                           command=" ".join(sys.argv)), f, indent=1)


def check() -> bool:
    """Each GQA ratio the kernel packs (2, 4, 8) and both value layouts, against the fp32 reference on the GPU."""
    ok = True
    for g in (4, 2, 8):
        case = make_case(1, 2, g, 1024, "cuda")
        prep, ref = prepare(case), reference(case)
        for pairs, pf in ((True, 1), (False, 1), (True, 2), (True, 0)):
            err = ((merge(launch(prep, 4, 4, pairs=pairs, prefetch=pf), g) - ref).norm() / ref.norm()).item()
            print(f"G={g} pairs={pairs} prefetch={pf}: rel err {err:.2e}", flush=True)
            ok &= err < 1e-3
    return ok


def compile_only(nt=4, g=4, plo=False, prefetch=1, write=True, pairs=True):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {n: "*i32" for n in ("kw_ptr",)}
    sig.update(PAIRS="constexpr", PREFETCH="constexpr", vh_ptr="*i32" if pairs else "*i16",
               ks_ptr="*fp16", kc_ptr="*fp16", vs_ptr="*fp16", vc_ptr="*fp16", ca_ptr="*fp16",
               sumc_ptr="*fp32", vexp_ptr="*fp32", m_out="*fp32", l_out="*fp32", o_out="*fp32", T="i32",
               CHUNK="i32", NSPLIT="i32", NT="constexpr", G="constexpr", PLO="constexpr")
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(15)}
    src = GluonASTSource(_mma_pass_kernel, sig, constexprs={"NT": nt, "G": g, "PLO": plo, "PREFETCH": int(prefetch),
                                                                    "PAIRS": pairs}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    if not write:
        return k
    ttgir = k.asm["ttgir"]
    print("convert_layout:", ttgir.count("convert_layout"), "local_alloc:", ttgir.count("local_alloc"),
          "shared bytes:", k.metadata.shared)
    with open("/tmp/mma_pass.ttgir", "w") as f:
        f.write(ttgir)
    with open("/tmp/mma_pass.ptx", "w") as f:
        f.write(k.asm["ptx"])
    return k


if __name__ == "__main__":
    main()
