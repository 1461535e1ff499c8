"""Table-free latent decode attention on the CUDA cores, one lane per (cached slot, query head).

Applies to calls without RoPE tables (rope form ``'none'``: post-RoPE key bases, ``LatentBases.key_space``, or a
model without RoPE) over uniform 8/4/2-bit ``int`` latents whose heads start on 4-byte words and whose quantization
blocks hold whole 32-bit words of codes. As in :mod:`.latent_attention_absorbed`, the query is folded into the key
basis once per step (``c_hg = qk_scale * P_h^T q_hg``, that module's ``_fold_query_kernel``), so the score of slot
``t`` is ``c_hg . z_t`` and no key is rebuilt. The difference is where the work runs:

* ``_lanes_attention_kernel``, grid (n_split, B * n_chunks, S): one context split of NH KV heads (NQ = NH * GP query
  heads) of one sequence and query token. Each tile of BLOCK_N slots is a (BLOCK_N, NQ) grid of lanes; a lane loads
  its KV head's code words of its slot (32-bit loads, adjacent heads' words adjacent, so a warp's loads are one run
  of the row), turns each code into the fp32 unit ``u = 1 + code / 2^bits`` with one shift and one logic op (the
  code moved to the top of the mantissa of 1.0: exact, no int->float conversion, which runs at a quarter of the
  FMA rate, and no subtraction), and does

  - the score per quantization block ``scale_k * 2^bits * (u . c - 1.5 sum(c))_k + (min_k + scale_k * 2^(bits-1))
    * sum(c)_k`` in fp32 multiply-adds (the block's ``sum(c)`` computed once per program; the dot starts from
    ``-1.5 sum(c)``, so it carries the centred codes' product), the sums over a block's words within the lane;
  - an online softmax per lane (FlashAttention-2's update, but with the running max kept per lane, not per head:
    no reduction across threads in the tile loop, at the price of a second exp2 per lane and tile);
  - the value latent per lane, one (BLOCK_N, NQ) accumulator per coordinate, ``acc_j += (p * scale_v * 2^bits) *
    u_j``, and per block ``acc_min += p * (min_v - scale_v * 2^bits)`` (DeepSeek-V2's value absorption, in the code
    domain as KIVI applies its scales). Every tensor of the loop is (BLOCK_N, NQ): per-word (BLOCK_N, NQ, codes)
    tensors made Triton move each tile's weights through shared memory (8 barriers a tile).

  After the loop the lanes of each query head are merged once (max, rescale, sum across the tile's slots) and the
  split's (max, sum, value latent) go to the workspace of
  ``latent_attention_triton._latent_attention_split_kernel``, which ``_latent_attention_reduce_kernel`` merges,
  adding the exact tokens and projecting with the value basis.

Why: at one query head per KV head (Qwen1.5-MoE's 16:16 heads) the tensor-core kernels pad the query side to 16
rows and the chunk pass moves segments between layouts; here a key code costs three CUDA-core instructions
(shift, logic op, multiply-add) and a value code four (and the rescale), with every sum inside a thread (0.3-0.4x
the chunk pass's time; still instruction-bound, see below). GQA's query heads each take a lane and unpack their KV head's codes themselves (the loads of one warp's lanes
of a KV head coalesce into one request).

Precision: units are exact in fp32; the dot starts from ``-1.5 sum(c)``, so it carries ``(u - 1.5) . c``, the
centred codes' product (``(code - 2^(bits-1)) / 2^bits``), and a block's min term does not cancel it for a
latent centred on zero; products and sums in fp32 (the value accumulators' ``scale * 2^bits`` part cancels
against ``acc_min`` once, in fp32, at the merge). Within 1e-3 of ``kernels.reference.latent_attention_ref`` under the
interpreter (tests/kernels/test_latent_attention_lanes.py); 1.1e-4 to 1.9e-4 on the H200.

Measured (H200, Triton 3.6, int4/32, batch 8, 32k, CUDA-graph replays of one call;
benchmarks/results/2026-12-03-lanes-v2-h200): Qwen1.5-MoE's 16:16 heads, key / value ranks 24-32 / 8, 0.077 ms
against 0.205 for the chunk pass in the same run (the first version of this kernel, exponent trick and per-word
accumulators: 0.105, benchmarks/results/2026-12-03-lanes-h200); ranks 32-64 / 32 0.180 against 0.488; ranks
64-96 / 64 0.408 against 0.962; the Qwen1.5-MoE decode step (post-RoPE bases, G = 1) 12.08 (chunk pass) -> 8.45
(first version) -> 7.73 ms. Mixtral's 32:8 heads at rank 32: 0.325 (16 query heads a program, 4 warps) against 0.229
for the absorbed pass, so GQA
keeps that one. 1.37-1.45 TB/s of latent bytes at 16:16 ranks 16-32 (a third of the copy bandwidth): instructions
per code (integer shifts and logic ops issue at half the FMA rate on sm_90) and the per-tile row, mask and
exact-slot work bound it, not the bytes; 32-slot tiles, pipelined loops and register caps were slower (first
version).

Sources (read, not copied): DeepSeek-V2 (arXiv:2405.04434: query and value absorption), FlashDecoding (split-KV +
reduction), FlashAttention-2 (arXiv:2307.08691: online softmax), KIVI (arXiv:2402.02750: scale and zero point after
the integer product), the exponent-bits int->float conversion of FasterTransformer / Marlin's dequantizers
(arXiv:2211.10017, LUT-free conversion: codes placed in a float's mantissa under a fixed exponent).
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .latent_attention_triton import _masked_tile_scores, _split_tiles, _tile_rows

__all__ = ["lanes_layout", "lanes_heads"]

#: Most 32-bit words of value codes per head (int4 rank 64, int8 rank 32, int2 rank 128): the kernel keeps one fp32
#: (slots, query heads) accumulator per value coordinate.
MAX_VALUE_WORDS = 8

#: fp32 bit pattern of 1.0: ``float(bits(1.0) | n << (23 - BITS)) == 1 + n / 2^BITS`` exactly for 0 <= n < 2^BITS.
_ONE = tl.constexpr(0x3F800000)


def lanes_heads(group_pad: int, lanes: int, hkv: int) -> int:
    """KV heads per program: the most (a power of two, at most ``hkv`` rounded up) whose query heads (``heads *
    group_pad``) stay within ``lanes``; at least one.

    Args:
        group_pad: query heads per KV head rounded up to a power of two; lanes: the target query heads per program
            (``DecodeConfig.lanes``); hkv: KV heads.
    Returns:
        int >= 1. Raises nothing.
    """
    nh = 1
    while nh < hkv and 2 * nh * group_pad <= lanes:
        nh *= 2
    return nh


@triton.jit
def _code_unit(word, k: tl.constexpr, BITS: tl.constexpr):
    """fp32 ``1 + code / 2^BITS`` of code number ``k`` of each int32 ``word`` (bits ``k*BITS ..``: little-endian
    bytes, low bits first, the latent's coordinate order): one shift moves the code to the top of an fp32 mantissa
    and one logic op sets the exponent of 1.0 (``bits(1.0) | code << (23 - BITS)``), exact, no int->float
    conversion (which runs at a quarter of the FMA rate) and no subtraction: the kernel takes the offset (1.5, for
    centred codes) out of whole blocks (``sum(c)``)."""
    TOP: tl.constexpr = 23 - BITS
    SH: tl.constexpr = TOP - k * BITS
    if SH > 0:
        x = word << SH
    elif SH < 0:
        x = word >> (-SH)  # arithmetic: the bits above the code are masked off
    else:
        x = word
    return ((x & (((1 << BITS) - 1) << TOP)) | _ONE).to(tl.float32, bitcast=True)


@triton.jit
def _lane_word(rows_w, ld_ok, col_w, n_words, lane_ok, w: tl.constexpr):
    """(BLOCK_N, NQ) int32: word ``w`` of each lane's KV-head codes in its slot's row (``rows_w`` (BLOCK_N,) int32
    pointers to the rows, ``col_w`` (NQ,) the heads' first code words); 0 where the row is not loaded, past the
    head's code words (a last partial word reads into the next head's or the scales' bytes, whose coefficients are
    0) or for lanes off."""
    ok = ld_ok[:, None] & (lane_ok & (w < n_words))[None, :]
    return tl.load(rows_w[:, None] + (col_w + w)[None, :], mask=ok, other=0)


@triton.jit
def _lane_scale(rows, ld_ok, blk0, rank, lane_ok, scale_base, min_base, blk: tl.constexpr, SEG: tl.constexpr,
                BITS: tl.constexpr):
    """(BLOCK_N, NQ) fp32 ``scale * 2^BITS`` and min of block ``blk`` of each lane's KV head at each slot row
    (``rows`` (BLOCK_N,) byte pointers; scales and mins in fp16 words), so that a coordinate is
    ``scale * 2^BITS * u + min - scale * 2^BITS`` for its :func:`_code_unit` ``u``; 0 for a block past the head's
    rank, rows not loaded and lanes off."""
    ok = ld_ok[:, None] & (lane_ok & (blk * SEG < rank))[None, :]
    ptrs = rows.to(tl.pointer_type(tl.uint16))[:, None] + (blk0 + blk)[None, :]
    sc = tl.load(ptrs + scale_base, mask=ok, other=0).to(tl.float16, bitcast=True).to(tl.float32)
    mn = tl.load(ptrs + min_base, mask=ok, other=0).to(tl.float16, bitcast=True).to(tl.float32)
    return sc * (1 << BITS), mn


@triton.jit
def _lanes_attention_kernel(
    qf_ptr, lk_ptr, lv_ptr, slots_ptr, mask_ptr, kmeta_ptr, vmeta_ptr, m_ptr, l_ptr, acc_ptr, pt_ptr, stride_ptb,
    Hkv, S, n_chunks, n_exact, kv_len, tiles_per_split, n_split,
    k_scale_base, k_min_base, v_scale_base, v_min_base,
    stride_lkb, stride_lks, stride_lvb, stride_lvs,
    stride_mb, stride_mh, stride_ms, stride_mt,
    G: tl.constexpr, GP: tl.constexpr, NH: tl.constexpr, RKP: tl.constexpr, RVP: tl.constexpr,
    RV_PAD: tl.constexpr, K_BITS: tl.constexpr, K_QBLOCK: tl.constexpr, V_BITS: tl.constexpr,
    V_QBLOCK: tl.constexpr, MASK: tl.constexpr, MASK_HEADS: tl.constexpr, BLOCK_N: tl.constexpr,
    SLOT_BLOCK: tl.constexpr, PAGE: tl.constexpr = 0, LOOP_STAGES: tl.constexpr = None,
):
    """One context split of one (sequence, chunk of NH KV heads, query token). Grid (n_split, B * n_chunks, S).

    Shapes: qf (B, S, Hkv, G, RKP) fp32 from ``latent_attention_absorbed._fold_query_kernel`` (log2 units, 0 past
    each head's rank); latent_k / latent_v (B, S_max, W) uint8 rows of a uniform ``int`` format, rows and heads'
    first code bytes 4-byte aligned, scales and mins as fp16 words (PAGE > 0: page pools and the page table ``pt``);
    strides of the rows in 4-byte words; slots (n_exact,) exact tokens' slots (-1 unused), skipped here; mask (B, H,
    S, kv_len) by strides (MASK 1: bool as uint8, 2: additive); kmeta / vmeta (Hkv, 3) int32 (first code byte,
    first block, rank). Stores m, l (rows, n_split, G) and acc (rows, n_split, G, RV_PAD) fp32, rows = B*Hkv*S (acc
    zero past each head's rank, and past RVP where the workspace row is wider: the merge reads all RV_PAD). RKP /
    RVP: padded ranks (powers of two, at least one word of codes; RVP at most :data:`MAX_VALUE_WORDS` words);
    blocks of ``min(R*P, QBLOCK)`` coordinates, each whole words.

    Every tensor of the tile loop is (BLOCK_N, NQ) lanes (the value latent a tuple of RVP of them): the sums over a
    lane's codes never cross threads."""
    c = tl.program_id(0)
    bc = tl.program_id(1)
    s = tl.program_id(2)
    b = bc // n_chunks
    h0 = (bc % n_chunks) * NH
    NQ: tl.constexpr = NH * GP
    PWK: tl.constexpr = 32 // K_BITS  # codes per word
    PWV: tl.constexpr = 32 // V_BITS
    SEGK: tl.constexpr = RKP if RKP < K_QBLOCK else K_QBLOCK
    SEGV: tl.constexpr = RVP if RVP < V_QBLOCK else V_QBLOCK
    NBK: tl.constexpr = RKP // SEGK
    NBV: tl.constexpr = RVP // SEGV
    WPBK: tl.constexpr = SEGK // PWK  # words per block
    WPBV: tl.constexpr = SEGV // PWV

    # ---- lanes: query head q = hl * GP + g of the chunk, and their KV heads' metadata
    qc = tl.arange(0, NQ)
    q_g = qc % GP
    head = h0 + qc // GP
    q_ok = (q_g < G) & (head < Hkv)
    head = tl.where(q_ok, head, 0)
    k_rank = tl.load(kmeta_ptr + 3 * head + 2, mask=q_ok, other=0)
    k_blk0 = tl.load(kmeta_ptr + 3 * head + 1, mask=q_ok, other=0)
    k_col = tl.load(kmeta_ptr + 3 * head, mask=q_ok, other=0) // 4
    k_words = (k_rank * K_BITS + 31) // 32
    v_rank = tl.load(vmeta_ptr + 3 * head + 2, mask=q_ok, other=0)
    v_blk0 = tl.load(vmeta_ptr + 3 * head + 1, mask=q_ok, other=0)
    v_col = tl.load(vmeta_ptr + 3 * head, mask=q_ok, other=0) // 4
    v_words = (v_rank * V_BITS + 31) // 32
    qf_lane = qf_ptr + (((b * S + s) * Hkv + head) * G + q_g).to(tl.int64) * RKP  # (NQ,) the folded query rows
    # each key block's sum(c), once per program: the offset of every code unit is taken out through it
    # (one 2-D load per block, not the tile loop's scalar loads: the compiler would keep all RKP of those in
    # registers)
    c_sums = ()
    for blk in tl.static_range(NBK):
        cj = blk * SEGK + tl.arange(0, SEGK)
        c_sums = c_sums + (tl.sum(tl.load(qf_lane[:, None] + cj[None, :], mask=q_ok[:, None], other=0.0), axis=1),)

    mask_cols = mask_ptr + b.to(tl.int64) * stride_mb + s * stride_ms + (head * G + q_g).to(tl.int64) * stride_mh
    m_i = tl.full((BLOCK_N, NQ), float("-inf"), tl.float32)  # per lane
    l_i = tl.zeros((BLOCK_N, NQ), tl.float32)
    accs = ()  # the value latent per lane: sum_t p * scale * 2^BITS * unit, one (BLOCK_N, NQ) tensor per coordinate
    for j in tl.static_range(RVP):
        accs = accs + (tl.zeros((BLOCK_N, NQ), tl.float32),)
    mins = ()  # per value block: sum_t p * (min - scale * 2^BITS)
    for blk in tl.static_range(NBV):
        mins = mins + (tl.zeros((BLOCK_N, NQ), tl.float32),)
    lk_w = lk_ptr.to(tl.pointer_type(tl.int32))
    lv_w = lv_ptr.to(tl.pointer_type(tl.int32))

    t_start, t_end, lo_exact = _split_tiles(c, tiles_per_split, kv_len, slots_ptr, n_exact, BLOCK_N, SLOT_BLOCK)
    for t in tl.range(t_start, t_end, num_stages=LOOP_STAGES):
        offs, _, slot_ok, row_idx, slot_row, ld_ok = _tile_rows(t, kv_len, lo_exact, slots_ptr, n_exact, pt_ptr,
                                                                stride_ptb, b, BLOCK_N, SLOT_BLOCK, PAGE)
        k_off = row_idx * stride_lkb + slot_row * stride_lks  # in 4-byte words
        v_off = row_idx * stride_lvb + slot_row * stride_lvs
        k_rows_w = lk_w + k_off
        # scores: per block scale * 2^BITS * (units . c - 1.5 * sum(c)) + (min + scale * 2^(BITS-1)) * sum(c), the
        # block's codes unrolled; the dot starts from -1.5 * sum(c), so it carries the centred codes' product
        scores = tl.zeros((BLOCK_N, NQ), tl.float32)
        for blk in tl.static_range(NBK):
            dot = tl.zeros((BLOCK_N, NQ), tl.float32) - 1.5 * c_sums[blk][None, :]
            for i in tl.static_range(WPBK):
                word = _lane_word(k_rows_w, ld_ok, k_col, k_words, q_ok, blk * WPBK + i)
                for k in tl.static_range(PWK):
                    cf = tl.load(qf_lane + ((blk * WPBK + i) * PWK + k), mask=q_ok, other=0.0)  # (NQ,)
                    dot += _code_unit(word, k, K_BITS) * cf[None, :]
            ksc, kmn = _lane_scale(lk_ptr + 4 * k_off, ld_ok, k_blk0, k_rank, q_ok, k_scale_base, k_min_base, blk,
                                   SEGK, K_BITS)
            scores += ksc * dot + (kmn + 0.5 * ksc) * c_sums[blk][None, :]
        scores = _masked_tile_scores(scores, mask_ptr, mask_cols, b, s, offs, slot_ok, q_ok, stride_mb, stride_ms,
                                     stride_mt, MASK, MASK_HEADS)
        # online softmax per lane (no reduction across threads inside the loop)
        m_new = tl.maximum(m_i, scores)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(scores - m_use)
        l_i = l_i * alpha + p
        m_i = m_new
        # the value latent per lane in the code domain, a coordinate per (BLOCK_N, NQ) accumulator
        v_rows_w = lv_w + v_off
        v_rows = lv_ptr + 4 * v_off
        new_accs = ()
        new_mins = ()
        for blk in tl.static_range(NBV):
            vsc, vmn = _lane_scale(v_rows, ld_ok, v_blk0, v_rank, q_ok, v_scale_base, v_min_base, blk, SEGV, V_BITS)
            pw = p * vsc
            new_mins = new_mins + (mins[blk] * alpha + p * (vmn - vsc),)
            for i in tl.static_range(WPBV):
                word = _lane_word(v_rows_w, ld_ok, v_col, v_words, q_ok, blk * WPBV + i)
                for k in tl.static_range(PWV):
                    new_accs = new_accs + (accs[(blk * WPBV + i) * PWV + k] * alpha
                                           + pw * _code_unit(word, k, V_BITS),)
        accs = new_accs
        mins = new_mins

    # ---- merge the lanes of each query head: max, rescale, sum over the tile's slots
    m_q = tl.max(m_i, axis=0)  # (NQ,)
    m_q_use = tl.where(m_q == float("-inf"), 0.0, m_q)
    wgt = tl.exp2(m_i - m_q_use[None, :])  # 0 for lanes that saw no slot
    q_row = (((b * Hkv + head) * S + s) * n_split + c) * G + q_g  # (NQ,)
    acc_row = acc_ptr + q_row.to(tl.int64) * RV_PAD
    for blk in tl.static_range(NBV):
        for jj in tl.static_range(SEGV):
            val = tl.sum((accs[blk * SEGV + jj] + mins[blk]) * wgt, axis=0)  # (NQ,)
            # past the head's rank: other heads' codes
            tl.store(acc_row + (blk * SEGV + jj), tl.where(blk * SEGV + jj < v_rank, val, 0.0), mask=q_ok)
    zc = tl.arange(0, RVP)
    for z0 in tl.static_range(RVP, RV_PAD, RVP):  # the workspace row's padding: zeros (the merge reads it all)
        tl.store(acc_row[:, None] + z0 + zc[None, :], tl.zeros((NQ, RVP), tl.float32), mask=q_ok[:, None])
    tl.store(m_ptr + q_row, m_q, mask=q_ok)
    tl.store(l_ptr + q_row, tl.sum(l_i * wgt, axis=0), mask=q_ok)


def lanes_layout(lanes: int, group: int, k_fmt, v_fmt, k_offsets, v_offsets, rk_max: int, rv_max: int, hkv: int,
                 k_unit_stride: int, v_unit_stride: int) -> dict | None:
    """The lane kernel's layout for one table-free call, or None where it does not apply.

    Applies to uniform 8/4/2-bit ``int`` key and value formats (not MX, mix or ternary) whose blocks are powers of
    two holding whole 32-bit words of codes (``block * bits >= 32``), every head with codes starting on a 4-byte word,
    row-major latents (unit stride 1) and ``lanes`` > 0; any ``group`` (G). The caller checks the rows' byte strides
    and the scales' fp16 alignment.

    Args:
        lanes: target query heads per program (``DecodeConfig.lanes``); group: G; k_fmt / v_fmt: parsed
            :class:`~ckvp_compile.kernels.latent_format.LatentFormat`; k_offsets / v_offsets: (Hkv + 1,) latent
            coordinate offsets; rk_max / rv_max: the basis blocks' widths; hkv: KV heads; *_unit_stride: the
            latents' last strides.
    Returns:
        dict(NH heads per program, n_chunks, RKP, RVP (padded ranks, at least one word of codes), GP (G padded to a
        power of two)) or None (also for value ranks past :data:`MAX_VALUE_WORDS` words). Raises nothing: the
        launcher then runs the other kernels. Source: the row layout of
        :func:`~ckvp_compile.kernels.latent_attention_triton._head_meta`.
    """
    return _lanes_layout(int(lanes), int(group), k_fmt, v_fmt, tuple(int(o) for o in k_offsets),
                         tuple(int(o) for o in v_offsets), int(rk_max), int(rv_max), int(hkv), int(k_unit_stride),
                         int(v_unit_stride))


@functools.lru_cache(maxsize=256)
def _lanes_layout(lanes: int, group: int, k_fmt, v_fmt, k_offsets: tuple, v_offsets: tuple, rk_max: int,
                  rv_max: int, hkv: int, k_unit_stride: int, v_unit_stride: int) -> dict | None:
    if lanes <= 0 or group < 1 or k_unit_stride != 1 or v_unit_stride != 1:
        return None
    out = {}
    for tag, f, offsets, r_max in (("K", k_fmt, k_offsets, rk_max), ("V", v_fmt, v_offsets, rv_max)):
        if not f.uniform_int_blocks(32):
            return None
        cb = f.code_bytes(list(offsets))
        col0 = [sum(cb[:i]) for i in range(len(cb))]
        if any(c % 4 for c, n in zip(col0, cb) if n):  # (a rank-0 head reads no word)
            return None
        out[f"R{tag}P"] = triton.next_power_of_2(max(r_max, 32 // f.bits, 1))
    if out["RVP"] * v_fmt.bits > 32 * MAX_VALUE_WORDS:
        return None
    gp = triton.next_power_of_2(group)
    nh = lanes_heads(gp, lanes, hkv)
    out.update(NH=nh, n_chunks=-(-hkv // nh), GP=gp)
    return out
