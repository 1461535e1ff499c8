"""One-pass latent decode attention over chunks of KV heads (one query head per KV head): RoPE folded into the basis.

The per-head kernels of :mod:`.latent_attention_triton` give each program one KV head, or score a group of heads and
leave the softmax and value latent to a second launch. Here a program takes a chunk of ``NH`` KV heads of one
sequence and one context split, and does the whole flash-decoding split for all of them in one pass:

* Columns. Key column ``n`` of the chunk is coordinate ``j = n % RKP`` of head ``h0 + n // RKP`` (every head padded to
  ``RKP``, the layer's largest key rank rounded up to a power of two; coordinates past a head's rank have zero
  coefficients). Values likewise with ``RVP``.
* Scores without rebuilding keys (as ``_tile_scores_rotated``, for many heads at once). With the key latent
  ``z`` and the basis rows of the rotated pairs' halves ``P1``, ``P2``, the score of slot ``t`` is
  ``sum_n z_tn W_tn`` with ``W = T_t @ E``: ``T_t`` (KT,) the cos / sin table entries at the slot's position
  (paired tables: ``[cos | sin]`` of the HALF angles, KT = 2 HALF; else ``[cos1 | sin1 | cos2 | sin2]``), and ``E``
  (KT, NCK) the query folded into the basis (``Ea = P1 q1 + P2 q2``, ``Eb = P1 q2 - P2 q1`` when paired; four
  blocks otherwise; plus ``c3 = P3 q3`` for channels past the rotary dimension), built once per (sequence, chunk,
  query token) by ``_fold_query_kernel``, a small launch before the attention kernel. ``W`` is one
  (BLOCK_N, KT) x (KT, NCK) tensor-core product per tile for every head of the chunk: ``E`` as bf16 hi + lo
  parts against the table as loaded (exact when the table is bf16; fp32 / fp16 tables are split too), or, with
  ``E_SPLIT`` off, one fp16 product (2^-11 relative per coefficient).
* Dequantization after the product. A uniform ``int`` latent has ``z = code * scale + min`` per quantization block
  of a head, so per segment of ``SEGK = min(RKP, block)`` columns the score part is ``scale * sum(code W) +
  min * sum(W)``: the CUDA cores do two multiply-adds per column and slot, and the segments' parts are summed per
  head. Values: ``acc[h, j] += sum_t p_th (code_tj * scale + min)`` in fp32 on the CUDA cores (value absorption).
* Output: the split's partial (max, sum, absorbed value latent) per head in the workspace layout of
  ``_latent_attention_split_kernel``'s one-pass form (G = 1), which ``_latent_attention_reduce_kernel`` merges,
  adding the exact tokens and projecting with the value basis.

Why: at the Qwen1.5-MoE shape (16 KV heads of 128 channels, int4/32 latents) a per-head program reads a few bytes
of each row and multiplies the tables with N = its own rank; the chunk reads whole row windows once, multiplies
the table tile once for all its heads, and skips the scores' round trip through memory of the two-pass form.

Measured (H200, 16:16 heads, int4/32, batch 8, 32k, CUDA-graph replays of one call;
benchmarks/results/2026-12-02-head-chunks-h200): rank 8, 32-slot tiles, 0.186 ms against 0.228 for the two-pass
default (the Qwen1.5-MoE decode step at batch 8, 32k: 15.62 -> 14.70 ms with it in the rank-8 layers); rank 16
1.06x, rank 96 1.37x, unequal ranks 32 / 64 1.78x the default's time, so it is the default at ranks <= 8 only.
Nsight Compute (rank 8, before the vector scale loads): 255 registers (2 programs per SM), L1 / shared memory 82%
busy (spills, the per-slot scale gathers, the layout conversions of the reshaped segment sums), DRAM 6%. As
committed (benchmarks/results/2026-12-02-mixtral-group1-h200/ncu): 174 us, 2 programs per SM, no eligible warp in
68% of cycles, 1.22 M local-memory spill requests: latency-bound. Timed there and slower: the table product with
swapped operands (E^T as a warpgroup product's A operand; 1.05x), 16-slot tiles (no spills; 1.04x), a 168-register
cap (3 programs per SM; 1.17x), 8 warps (no spills; 1.2x).

Sources (read, not copied): FlashDecoding (split-KV + reduction), FlashAttention-2 (online softmax), DeepSeek-V2
(arXiv:2405.04434: value absorption), RoFormer (arXiv:2104.09864: the rotation written as cos / sin products).
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .latent_attention_triton import _fp16_at, _masked_tile_scores, _mm, _split_tiles, _tile_rows, _unpack_codes

__all__ = ["chunk_heads", "chunk_layout"]


def chunk_heads(rank_pad: int, columns: int, hkv: int) -> int:
    """KV heads per chunk: the most (a power of two, at most ``hkv`` rounded up) whose ``rank_pad``-wide column
    blocks fit in ``columns`` (at least one head).

    Args:
        rank_pad: padded key rank per head (power of two); columns: the chunk's target width; hkv: KV heads.
    Returns:
        int >= 1. Raises nothing.
    """
    nh = 1
    while nh * 2 * rank_pad <= columns and nh < hkv:
        nh *= 2
    return nh


@triton.jit
def _chunk_codes(rows, ld_ok, meta_ptr, h0, Hkv, stride_w, NH: tl.constexpr, RP: tl.constexpr, BITS: tl.constexpr,
                 BLOCK_N: tl.constexpr, CONTIG: tl.constexpr, ALIGN: tl.constexpr):
    """(BLOCK_N, NH * RP) int32 codes of the chunk's heads h0 .. h0+NH-1: column n is coordinate ``n % RP`` of head
    ``h0 + n // RP``; 0 where ``~ld_ok``, past a head's rank (to byte granularity; the caller masks the rest) or past
    the last head. CONTIG: the heads' code bytes are one contiguous run from head h0's first byte (each head's
    code bytes exactly RP * BITS / 8, or one head), loaded as one window whose start is a multiple of ALIGN bytes
    (vector loads)."""
    PER: tl.constexpr = 8 // BITS
    KU: tl.constexpr = RP // PER  # code bytes per padded head
    u = tl.arange(0, NH * KU)
    uh = u // KU
    ub = u % KU
    head = h0 + uh
    h_ok = head < Hkv
    rank = tl.load(meta_ptr + 3 * head + 2, mask=h_ok, other=0)
    u_ok = h_ok & (ub < (rank + PER - 1) // PER)
    if CONTIG:
        col = tl.multiple_of(tl.load(meta_ptr + 3 * h0), ALIGN) + u
    else:
        col = tl.load(meta_ptr + 3 * head, mask=h_ok, other=0) + ub
    raw = tl.load(rows[:, None] + (col * stride_w)[None, :], mask=ld_ok[:, None] & u_ok[None, :], other=0)
    raw = raw.to(tl.int32)
    # one return: Triton compiles the statements after a returning constexpr branch too (an early return at
    # BITS 8 still built the sub-byte unpack and failed to compile; the interpreter does not)
    if BITS == 8:
        code = raw
    else:
        code = _unpack_codes(raw, BLOCK_N, NH * RP, BITS)
    return code


@triton.jit
def _chunk_scales(rows, ld_ok, meta_ptr, h0, Hkv, scale_base, min_base, stride_w, NH: tl.constexpr,
                  RP: tl.constexpr, QBLOCK: tl.constexpr, SEG: tl.constexpr, WORDS: tl.constexpr,
                  CONTIG: tl.constexpr, BLK_ALIGN: tl.constexpr):
    """(BLOCK_N, NH * RP / SEG) fp32 scales and mins of the chunk's segments (SEG = min(RP, QBLOCK) columns, one
    quantization block each); 0 for segments past a head's rank or the last head. CONTIG (every head of rank RP):
    the segments' blocks are consecutive from head h0's first block (a multiple of BLK_ALIGN), so with WORDS each
    row's scales are one contiguous run of fp16 words (vector loads) instead of a gather."""
    NS: tl.constexpr = NH * RP // SEG
    sg = tl.arange(0, NS)
    sh = (sg * SEG) // RP
    sj = (sg * SEG) % RP
    head = h0 + sh
    h_ok = head < Hkv
    rank = tl.load(meta_ptr + 3 * head + 2, mask=h_ok, other=0)
    if CONTIG:
        blk = tl.multiple_of(tl.load(meta_ptr + 3 * h0 + 1), BLK_ALIGN) + sg
    else:
        blk = tl.load(meta_ptr + 3 * head + 1, mask=h_ok, other=0) + sj // QBLOCK
    ok = ld_ok[:, None] & (h_ok & (sj < rank))[None, :]
    if WORDS:  # scale_base, min_base: in fp16 words here
        words = rows.to(tl.pointer_type(tl.uint16))
        sc = tl.load(words[:, None] + (scale_base + blk)[None, :], mask=ok, other=0)
        mn = tl.load(words[:, None] + (min_base + blk)[None, :], mask=ok, other=0)
        sc = sc.to(tl.float16, bitcast=True).to(tl.float32)
        mn = mn.to(tl.float16, bitcast=True).to(tl.float32)
    else:
        sc = _fp16_at(rows[:, None] + ((scale_base + 2 * blk) * stride_w)[None, :], stride_w, ok)
        mn = _fp16_at(rows[:, None] + ((min_base + 2 * blk) * stride_w)[None, :], stride_w, ok)
    return sc, mn


@triton.jit
def _table_columns(f, half, HALF: tl.constexpr, ROPE: tl.constexpr):
    """For rows ``f`` of the folded coefficients E: the RoPE table column each multiplies, whether it is a sin
    column, and whether it is a real pair (< half). Rows are [cos | sin] of the pairs' angles (PARTS 2) or
    [cos1 | sin1 | cos2 | sin2] (PARTS 4), HALF rows each."""
    part = f // HALF
    ff = f % HALF
    if ROPE == 1:
        fc1 = ff
        fc2 = ff + half
    elif ROPE == 2:
        fc1 = 2 * ff
        fc2 = 2 * ff + 1
    else:
        fc1 = ff
        fc2 = ff
    return tl.where(part < 2, fc1, fc2), (part % 2) == 1, ff < half


@triton.jit
def _fold_query_kernel(
    ehi_ptr, elo_ptr, c3_ptr, q_ptr, bk_ptr, kmeta_ptr, Hkv, S, n_chunks, D, half,
    stride_qb, stride_qh, stride_qs, stride_qd, stride_bkb, stride_bkh, stride_bkd, stride_bkr,
    NH: tl.constexpr, RKP: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr, HAS_ROT: tl.constexpr,
    HAS_REST: tl.constexpr, ROPE: tl.constexpr, PAIRED_TABLE: tl.constexpr, E_SPLIT: tl.constexpr,
    FB: tl.constexpr,
):
    """The query folded into the key basis for every column of one (sequence, chunk, query token): rows
    [f0, f0 + FB) of E (KT, NCK) (see the module docstring; bf16 hi and lo parts, or E_SPLIT off: fp16) and, from
    the first row block, c3 (NCK,) fp32 (channels past the rotary dimension). Grid (B * n_chunks * S, KT / FB).
    A separate launch: built inside the attention kernel, the (KT, NCK) fp32 operands set its register count for
    the whole kernel (ptxas for sm_90a: 255 and spills at NCK = 128)."""
    row = tl.program_id(0)
    f0 = tl.program_id(1) * FB
    s = row % S
    bc = row // S
    b = bc // n_chunks
    h0 = (bc % n_chunks) * NH
    NCK: tl.constexpr = NH * RKP
    n = tl.arange(0, NCK)
    head_n = h0 + n // RKP
    j_n = n % RKP
    hn_ok = head_n < Hkv
    krank_n = tl.load(kmeta_ptr + 3 * head_n + 2, mask=hn_ok, other=0)
    kcol_ok = hn_ok & (j_n < krank_n)
    b_col = bk_ptr + b.to(tl.int64) * stride_bkb + head_n * stride_bkh + j_n * stride_bkr  # (NCK,)
    q_col = q_ptr + b.to(tl.int64) * stride_qb + s * stride_qs + head_n * stride_qh  # (NCK,)
    PARTS: tl.constexpr = 2 if (PAIRED_TABLE or ROPE == 3) else 4
    KT: tl.constexpr = PARTS * HALF
    out = row.to(tl.int64) * KT * NCK
    if HAS_ROT:
        f = f0 + tl.arange(0, FB)
        part = f // HALF
        ff = f % HALF
        if ROPE == 1:
            fi1 = ff
            fi2 = ff + half
        else:
            fi1 = 2 * ff
            fi2 = 2 * ff + 1
        r_ok = (ff < half)[:, None] & kcol_ok[None, :]
        p1 = tl.load(b_col[None, :] + (fi1 * stride_bkd)[:, None], mask=r_ok, other=0.0).to(tl.float32)
        p2 = tl.load(b_col[None, :] + (fi2 * stride_bkd)[:, None], mask=r_ok, other=0.0).to(tl.float32)
        q1 = tl.load(q_col[None, :] + (fi1 * stride_qd)[:, None], mask=r_ok, other=0.0).to(tl.float32)
        q2 = tl.load(q_col[None, :] + (fi2 * stride_qd)[:, None], mask=r_ok, other=0.0).to(tl.float32)
        if PARTS == 2:  # one angle per pair: cos (Ea + Ec), sin (Eb + Ed)
            e = tl.where((part == 0)[:, None], p1 * q1 + p2 * q2, p1 * q2 - p2 * q1)
        else:  # cos1, sin1, cos2, sin2
            e = tl.where((part == 0)[:, None], p1 * q1,
                         tl.where((part == 1)[:, None], -(p2 * q1), tl.where((part == 2)[:, None], p2 * q2, p1 * q2)))
        offs = out + f[:, None] * NCK + n[None, :]
        if E_SPLIT:
            e_hi = e.to(tl.bfloat16)
            tl.store(ehi_ptr + offs, e_hi)
            tl.store(elo_ptr + offs, (e - e_hi.to(tl.float32)).to(tl.bfloat16))
        else:
            tl.store(ehi_ptr + offs, e.to(tl.float16))
    if HAS_REST:
        if f0 == 0:
            rest = 2 * half + tl.arange(0, REST)
            x_ok = (rest < D)[:, None] & kcol_ok[None, :]
            p3 = tl.load(b_col[None, :] + (rest * stride_bkd)[:, None], mask=x_ok, other=0.0).to(tl.float32)
            q3 = tl.load(q_col[None, :] + (rest * stride_qd)[:, None], mask=x_ok, other=0.0).to(tl.float32)
            tl.store(c3_ptr + row.to(tl.int64) * NCK + n, tl.sum(p3 * q3, axis=0))


@triton.jit
def _latent_attention_chunks_kernel(
    ehi_ptr, elo_ptr, c3_ptr, q_ptr, lk_ptr, lv_ptr, bk_ptr, cos_ptr, sin_ptr, pos_ptr, slots_ptr, mask_ptr,
    kmeta_ptr, vmeta_ptr,
    m_ptr, l_ptr, acc_ptr, pt_ptr, stride_ptb,
    Hkv, S, n_chunks, n_exact, kv_len, tiles_per_split, n_split, qk_scale, D, half,
    k_scale_base, k_min_base, v_scale_base, v_min_base,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_lkb, stride_lks, stride_lkw,
    stride_lvb, stride_lvs, stride_lvw,
    stride_bkb, stride_bkh, stride_bkd, stride_bkr,
    stride_cp, stride_cw, stride_sp, stride_sw,
    stride_pb, stride_ps,
    stride_mb, stride_mh, stride_ms, stride_mt,
    NH: tl.constexpr, RKP: tl.constexpr, RVP: tl.constexpr, RV_PAD: tl.constexpr, K_BITS: tl.constexpr,
    K_QBLOCK: tl.constexpr,
    V_BITS: tl.constexpr, V_QBLOCK: tl.constexpr, K_CONTIG: tl.constexpr, V_CONTIG: tl.constexpr,
    K_WORDS: tl.constexpr, V_WORDS: tl.constexpr, K_ALIGN: tl.constexpr, V_ALIGN: tl.constexpr,
    HALF: tl.constexpr, REST: tl.constexpr, HAS_ROT: tl.constexpr,
    HAS_REST: tl.constexpr, ROPE: tl.constexpr, PAIRED_TABLE: tl.constexpr, T_EXACT: tl.constexpr,
    E_SPLIT: tl.constexpr, MASK: tl.constexpr, F32_DOT: tl.constexpr, BLOCK_N: tl.constexpr,
    SLOT_BLOCK: tl.constexpr, PAGE: tl.constexpr = 0, LOOP_STAGES: tl.constexpr = None,
    VALUES_2D: tl.constexpr = False, MASK_HEADS: tl.constexpr = True, K_BLK_ALIGN: tl.constexpr = 1,
    V_BLK_ALIGN: tl.constexpr = 1,
):
    """One context split of one (sequence, chunk of NH KV heads, query token), one pass. Grid (n_split,
    B * n_chunks, S).

    Shapes (as ``_latent_attention_split_kernel``, G = 1): q (B, H, S, D); latent_k / latent_v (B, S_max, W) uint8
    rows of a uniform ``int`` format (PAGE > 0: page pools and the (B, S_max / PAGE) page table ``pt``);
    basis_k (Hkv, D, Rk_max) or (B, Hkv, D, Rk_max) by strides; cos / sin (P_max, W_t); slot_pos (B, S_max); slots
    (n_exact,) exact tokens' slots (-1 unused), skipped here; mask (B, H, S, kv_len) by strides; kmeta / vmeta
    (Hkv, 3) int32 (first code byte, first block, rank); ehi / elo (B*n_chunks*S, KT, NCK) and c3 (B*n_chunks*S,
    NCK) from ``_fold_query_kernel``; scale / min bases in bytes, or in fp16 words with K_WORDS / V_WORDS. Stores m,
    l (rows, n_split) and acc (rows, n_split, RV_PAD) fp32, rows = B*Hkv*S, log2 units (acc zero past RVP). RKP /
    RVP: padded ranks (powers of two). MASK_HEADS: the mask differs per head (else one row, loaded once per
    slot)."""
    c = tl.program_id(0)
    bc = tl.program_id(1)
    s = tl.program_id(2)
    b = bc // n_chunks
    h0 = (bc % n_chunks) * NH
    NCK: tl.constexpr = NH * RKP
    NCV: tl.constexpr = NH * RVP
    SEGK: tl.constexpr = RKP if RKP < K_QBLOCK else K_QBLOCK
    SEGV: tl.constexpr = RVP if RVP < V_QBLOCK else V_QBLOCK
    NSK: tl.constexpr = NCK // SEGK
    NSV: tl.constexpr = NCV // SEGV

    # ---- the query folded into the basis (E (KT, NCK), c3 (NCK,): written by _fold_query_kernel)
    n = tl.arange(0, NCK)
    head_n = h0 + n // RKP
    hn_ok = head_n < Hkv
    krank_n = tl.load(kmeta_ptr + 3 * head_n + 2, mask=hn_ok, other=0)
    kcol_ok = hn_ok & ((n % RKP) < krank_n)
    PARTS: tl.constexpr = 2 if (PAIRED_TABLE or ROPE == 3) else 4
    KT: tl.constexpr = PARTS * HALF
    f = tl.arange(0, KT)
    tcol, is_sin, f_ok = _table_columns(f, half, HALF, ROPE)
    e_row = (bc * S + s).to(tl.int64)
    e_off = e_row * KT * NCK + f[:, None] * NCK + n[None, :]
    if HAS_ROT:
        e_hi = tl.load(ehi_ptr + e_off)
        if E_SPLIT:
            e_lo = tl.load(elo_ptr + e_off)
    if HAS_REST:
        c3 = tl.load(c3_ptr + e_row * NCK + n)

    # ---- per-head state
    hh = h0 + tl.arange(0, NH)
    hh_ok = hh < Hkv
    mask_cols = mask_ptr + b.to(tl.int64) * stride_mb + s * stride_ms + hh.to(tl.int64) * stride_mh  # (NH,) G = 1
    vc = tl.arange(0, NCV)
    vhead = h0 + vc // RVP
    vrank = tl.load(vmeta_ptr + 3 * vhead + 2, mask=vhead < Hkv, other=0)
    vcol_ok = (vhead < Hkv) & ((vc % RVP) < vrank)  # (NCV,)
    m_i = tl.full((NH,), float("-inf"), tl.float32)
    l_i = tl.zeros((NH,), tl.float32)
    acc = tl.zeros((NH, RVP), tl.float32)
    acc2 = tl.zeros((BLOCK_N, NCV), tl.float32)

    t_start, t_end, lo_exact = _split_tiles(c, tiles_per_split, kv_len, slots_ptr, n_exact, BLOCK_N, SLOT_BLOCK)
    for t in tl.range(t_start, t_end, num_stages=LOOP_STAGES):
        offs, _, slot_ok, row_idx, slot_row, ld_ok = _tile_rows(t, kv_len, lo_exact, slots_ptr, n_exact, pt_ptr,
                                                                stride_ptb, b, BLOCK_N, SLOT_BLOCK, PAGE)
        k_rows = lk_ptr + row_idx * stride_lkb + slot_row * stride_lks
        v_rows = lv_ptr + row_idx * stride_lvb + slot_row * stride_lvs
        # W (BLOCK_N, NCK): each column's coefficient at each slot's position
        w = tl.zeros((BLOCK_N, NCK), tl.float32)
        if HAS_ROT:
            pos = tl.load(pos_ptr + b.to(tl.int64) * stride_pb + offs * stride_ps, mask=slot_ok, other=0)
            pos = pos.to(tl.int32)
            t_ok = slot_ok[:, None] & f_ok[None, :]
            cos_p = cos_ptr + pos[:, None] * stride_cp + (tcol * stride_cw)[None, :]
            sin_p = sin_ptr + pos[:, None] * stride_sp + (tcol * stride_sw)[None, :]
            tab = tl.load(tl.where(is_sin[None, :], sin_p, cos_p), mask=t_ok, other=0.0)
            if E_SPLIT:
                if T_EXACT:  # bf16 tables: exact tensor-core operands as loaded
                    w = _mm(tab, e_hi, w, F32_DOT)
                    w = _mm(tab, e_lo, w, F32_DOT)
                else:  # (fp16 / fp32 tables: split too)
                    tab32 = tab.to(tl.float32)
                    t_hi = tab32.to(tl.bfloat16)
                    w = _mm(t_hi, e_hi, w, F32_DOT)
                    w = _mm(t_hi, e_lo, w, F32_DOT)
                    w = _mm((tab32 - t_hi.to(tl.float32)).to(tl.bfloat16), e_hi, w, F32_DOT)
            else:
                w = _mm(tab.to(tl.float32).to(tl.float16), e_hi, w, F32_DOT)  # e_hi: fp16 here
        if HAS_REST:
            w = w + c3[None, :]
        # scores (BLOCK_N, NH): per segment scale * sum(code W) + min * sum(W), summed per head
        kcode = _chunk_codes(k_rows, ld_ok, kmeta_ptr, h0, Hkv, stride_lkw, NH, RKP, K_BITS, BLOCK_N, K_CONTIG,
                             K_ALIGN).to(tl.float32)
        kcode = tl.where(kcol_ok[None, :], kcode, 0.0)
        ksc, kmn = _chunk_scales(k_rows, ld_ok, kmeta_ptr, h0, Hkv, k_scale_base, k_min_base, stride_lkw, NH, RKP,
                                 K_QBLOCK, SEGK, K_WORDS, K_CONTIG, K_BLK_ALIGN)
        cw = tl.sum(tl.reshape(kcode * w, (BLOCK_N, NSK, SEGK)), axis=2)
        ws = tl.sum(tl.reshape(w, (BLOCK_N, NSK, SEGK)), axis=2)
        part_sc = ksc * cw + kmn * ws  # (BLOCK_N, NSK)
        if NSK == NH:
            scores = part_sc
        else:
            scores = tl.sum(tl.reshape(part_sc, (BLOCK_N, NH, NSK // NH)), axis=2)
        scores = scores * qk_scale
        scores = _masked_tile_scores(scores, mask_ptr, mask_cols, b, s, offs, slot_ok, hh_ok, stride_mb, stride_ms,
                                     stride_mt, MASK, MASK_HEADS)
        # online softmax per head
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(scores - m_use[None, :])  # (BLOCK_N, NH)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
        # the value latent, absorbed: acc[h, j] += sum_t p_th z_thj
        vcode = _chunk_codes(v_rows, ld_ok, vmeta_ptr, h0, Hkv, stride_lvw, NH, RVP, V_BITS, BLOCK_N, V_CONTIG,
                             V_ALIGN).to(tl.float32)
        vsc, vmn = _chunk_scales(v_rows, ld_ok, vmeta_ptr, h0, Hkv, v_scale_base, v_min_base, stride_lvw, NH, RVP,
                                 V_QBLOCK, SEGV, V_WORDS, V_CONTIG, V_BLK_ALIGN)
        zv = tl.reshape(tl.reshape(vcode, (BLOCK_N, NSV, SEGV)) * vsc[:, :, None] + vmn[:, :, None],
                        (BLOCK_N, NCV))
        zv = tl.where(vcol_ok[None, :], zv, 0.0)
        if VALUES_2D:  # elementwise per slot row; the rows are summed once, after the loop
            p_col = tl.reshape(tl.broadcast_to(p[:, :, None], (BLOCK_N, NH, RVP)), (BLOCK_N, NCV))
            a_col = tl.reshape(tl.broadcast_to(alpha[:, None], (NH, RVP)), (NCV,))
            acc2 = acc2 * a_col[None, :] + p_col * zv
        else:
            pz = tl.reshape(zv, (BLOCK_N, NH, RVP)) * p[:, :, None]
            acc = acc * alpha[:, None] + tl.sum(pz, axis=0)

    if VALUES_2D:
        acc = tl.reshape(tl.sum(acc2, axis=0), (NH, RVP))

    row = ((b * Hkv + hh) * S + s) * n_split + c  # (NH,)
    tl.store(m_ptr + row, m_i, mask=hh_ok)
    tl.store(l_ptr + row, l_i, mask=hh_ok)
    rv = tl.arange(0, RVP)
    tl.store(acc_ptr + row[:, None] * RV_PAD + rv[None, :], acc, mask=hh_ok[:, None])
    for z0 in tl.static_range(RVP, RV_PAD, RVP):  # the workspace row's padding: zeros (the merge reads it all)
        tl.store(acc_ptr + row[:, None] * RV_PAD + (z0 + rv)[None, :], tl.zeros((NH, RVP), tl.float32),
                 mask=hh_ok[:, None])


def chunk_layout(head_chunks: int, group: int, k_fmt, v_fmt, k_offsets, v_offsets, rk_max: int, rv_max: int,
                 hkv: int, k_unit_stride: int, v_unit_stride: int) -> dict | None:
    """The chunk kernel's layout for one call, or None where it does not apply.

    Applies with one query head per KV head (``group`` 1), uniform 8/4/2-bit ``int`` key and value formats with
    power-of-two blocks (not MX, mix or ternary), row-major latents (unit stride 1) and ``head_chunks`` > 0.

    Args:
        head_chunks: target columns per chunk (``DecodeConfig.head_chunks``); group: G; k_fmt / v_fmt: parsed
            :class:`~ckvp_compile.kernels.latent_format.LatentFormat`; k_offsets / v_offsets: (Hkv + 1,) latent
            coordinate offsets; rk_max / rv_max: the basis blocks' widths; hkv: KV heads; *_unit_stride: the
            latents' last strides.
    Returns:
        dict(NH heads per chunk, n_chunks, RKP, RVP (padded ranks), K_CONTIG, V_CONTIG, K_ALIGN, V_ALIGN (bytes),
        K_BLK_ALIGN, V_BLK_ALIGN (blocks)) or None. Raises nothing: inputs it does not read give None, and the
        launcher then runs the per-head passes. Source: the row layout of
        :func:`~ckvp_compile.kernels.latent_attention_triton._head_meta` (first code byte and block per head).
    """
    layout = _chunk_layout(int(head_chunks), int(group), k_fmt, v_fmt, tuple(int(o) for o in k_offsets),
                           tuple(int(o) for o in v_offsets), int(rk_max), int(rv_max), int(hkv), int(k_unit_stride),
                           int(v_unit_stride))
    return None if layout is None else dict(layout)  # a copy: the cached one stays as computed


@functools.lru_cache(maxsize=256)
def _chunk_layout(head_chunks: int, group: int, k_fmt, v_fmt, k_offsets: tuple, v_offsets: tuple, rk_max: int,
                  rv_max: int, hkv: int, k_unit_stride: int, v_unit_stride: int) -> dict | None:
    """:func:`chunk_layout`, cached per call shape (host work of every eager decode call otherwise)."""
    if head_chunks <= 0 or group != 1 or k_unit_stride != 1 or v_unit_stride != 1:
        return None
    if not (k_fmt.uniform_int_blocks(1) and v_fmt.uniform_int_blocks(1)):
        return None
    # each padded head holds whole code bytes (8 / bits coordinates at least: an int4 rank-1 head is one byte)
    rkp = triton.next_power_of_2(max(rk_max, 8 // k_fmt.bits, 1))
    rvp = triton.next_power_of_2(max(rv_max, 8 // v_fmt.bits, 1))
    nh = chunk_heads(max(rkp, rvp), head_chunks, hkv)
    rkp = max(rkp, 16 // nh)  # the table product's N (NH * RKP) is at least 16
    out = dict(NH=nh, n_chunks=-(-hkv // nh), RKP=rkp, RVP=rvp)
    for tag, f, offsets, rp in (("K", k_fmt, k_offsets, rkp), ("V", v_fmt, v_offsets, rvp)):
        ranks = [int(b) - int(a) for a, b in zip(offsets, offsets[1:])]
        cb = f.code_bytes([int(o) for o in offsets])
        col0 = [sum(cb[:i]) for i in range(len(ranks))]
        out[f"{tag}_CONTIG"] = nh == 1 or all(c == rp * f.bits // 8 for c in cb)
        starts = [col0[h] for h in range(0, hkv, nh)]
        align = 16
        while align > 1 and any(c % align for c in starts):
            align //= 2
        out[f"{tag}_ALIGN"] = align
        nb = [-(-r // f.block) for r in ranks]
        blk_starts = [sum(nb[:h]) for h in range(0, hkv, nh)]
        a = 8
        while a > 1 and any(x % a for x in blk_starts):
            a //= 2
        out[f"{tag}_BLK_ALIGN"] = a
    return out
