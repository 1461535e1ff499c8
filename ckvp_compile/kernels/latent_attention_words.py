"""Table-free latent decode attention on the tensor cores with fp16 codes made two per logic op: the word pass.

Applies where the lane pass (:mod:`.latent_attention_lanes`) applies (calls without RoPE tables over uniform
8/4/2-bit ``int`` latents whose heads start on 4-byte words and whose quantization blocks hold whole words), at
GQA ratios G >= 2 (G = 1 runs the lane pass, 3.4x faster there on the H200). One program takes one (sequence, KV
head, query token) and one split of the context; its query heads share every read of the code tile, and both
products run on the tensor cores, as in the absorbed pass (:mod:`.latent_attention_absorbed`): with ``c =
qk_scale * P_h^T q`` the query folded into the key basis (DeepSeek-V2's absorption), the score of a slot is ``sum_k
scale_k * (codes . c)_k + min_k * sum(c)_k`` over its quantization blocks ``k``, and the value latent is ``sum_t
p_t * (scale * code + min)``.

What differs is how codes reach the tensor cores. Each tile loads whole 32-bit words of codes and turns them into
fp16 operands with logic operations: ``(word >> 8h) & (mask << k*BITS) | 0x64006400`` holds two fp16 numbers,
``1024 + code * 2^(k*BITS)``, one per 16-bit half (the code sits in the mantissa of 1024; Marlin's and
FasterTransformer's int4 -> fp16 conversion). One fp16 subtraction per pair then leaves the centred code
``(code - 2^(BITS-1)) * 2^(k*BITS)``, exact. The factor ``2^(k*BITS)`` divides the folded query's coefficient of
that coordinate (exact, a power of two) and each value coordinate once at the end; the centring moves into the
blocks' mins. (Leaving the 1024 inside the tensor-core product and taking ``1024 * sum(c)`` off afterwards was
6e-3 off on the H200, whose tensor cores truncate when they add: benchmarks/results/2026-12-03-words-h200.)

The codes of a word come out as parts (the two halves of each logic op's result) that ``tl.join`` interleaves
into the tile's columns in a fixed order, the two halves of one result side by side (one 32-bit register, no byte
permutes), not the latent's coordinate order; the folded query is gathered, and the value latent stored, in that
same order (:func:`_word_labels`, built by the same join tree), so no data moves for it.

Programs: grid (n_split, B * Hkv, S). A tile is ``NG * BLOCK_N`` slots: tensor-core row n carries the NG slots
``n * NG + grp`` side by side along K (their codes in columns ``grp * RKP ..``, the coefficients block-diagonal), so
that the scores' ``NG * blocks * GP`` columns fill the tensor cores' 16 with real (slot group, block, query head)
entries (GP: G padded to a power of two). The coefficients and softmax weights are split into fp16 hi + lo (22
mantissa bits; the folded query scaled by a power of two into fp16's range); each tile's value product is added
to the accumulator in fp32 on the CUDA cores. It stores the split's (max, sum, value latent) in the workspace
layout of ``latent_attention_triton._latent_attention_split_kernel``, which ``_latent_attention_reduce_kernel``
merges (adding the exact tokens, projecting with the value basis).

Measured (H200, Triton 3.6, int4/32, 32:8 heads, batch 8, 32k, one call in CUDA-graph replay): rank 32 0.198 ms
against 0.230 for the absorbed pass, ranks 64/32 0.302 and 96 0.689 against 0.583 and 1.062 for the one-pass
kernel; 8-bit codes slower than those (1.27-1.46x), so the default takes it for codes of at most 4 bits
(benchmarks/results/2026-12-03-words-h200). About 10% of the copy bandwidth at rank 32.

Sources (read, not copied): DeepSeek-V2 (arXiv:2405.04434: query and value absorption), FlashDecoding (split-KV +
reduction), FlashAttention-2 (arXiv:2307.08691: online softmax), Marlin (arXiv:2408.11743) and
FasterTransformer's ``cutlass_extensions`` interleaved int4 -> fp16 conversion (the 0x6400 exponent trick),
KIVI / QServe (scale and zero point applied after the integer product).
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .latent_attention_triton import _masked_tile_scores, _split_tiles, _tile_rows

__all__ = ["words_layout", "MAX_VIRTUAL_COLUMNS", "MAX_KEY_WIDTH", "MAX_SLOT_GROUPS"]

#: Most virtual columns (quantization blocks x padded query heads) per program: the (virtual columns, value rank)
#: fp32 accumulator and the (rank, virtual columns) coefficients grow with it.
MAX_VIRTUAL_COLUMNS = 64

#: Most slot groups per tensor-core row: G = 1 at one quantization block per head would need 16, whose (slots,
#: value rank) tiles spill at every tile size (ptxas, sm_90a): such calls take the lane pass.
MAX_SLOT_GROUPS = 4

#: Most key code columns per tensor-core row (slot groups x padded key rank): the coefficient operands are this many
#: rows of 16+ fp16 columns, twice (hi and lo).
MAX_KEY_WIDTH = 512

#: Two fp16 1024.0 in one 32-bit word: ``bits | code << s`` in a half is ``1024 + code * 2^s`` for ``code * 2^s <
#: 1024``.
_MAGIC = tl.constexpr(0x64006400)


@triton.jit
def _word_parts(words, BITS: tl.constexpr):
    """The 32 / BITS parts of each int32 word of ``words`` (any shape), each the same shape, in part order ``i =
    half * (16 // BITS) + hb * (8 // BITS) + k``: fp16 ``1024 + code * 2^(k*BITS)`` of code ``(hb + 2*half) *
    (8 // BITS) + k`` of the word (byte ``hb + 2*half``, bits ``k*BITS ..`` of the byte; codes are little-endian,
    low bits first). Parts ``i`` and ``i + 16 // BITS`` are the two halves of one logic op's result, which
    :func:`_join_parts` puts side by side: one 32-bit register, no byte permutes."""
    PB: tl.constexpr = 8 // BITS
    LOW: tl.constexpr = ((1 << BITS) - 1) * 0x00010001
    los = ()
    his = ()
    for hb in tl.static_range(2):
        if hb == 0:
            y = words
        else:
            y = words >> 8  # arithmetic: the bits it drags in land outside every mask
        for k in tl.static_range(PB):
            x = (y & (LOW << (k * BITS))) | _MAGIC
            los = los + (x.to(tl.int16).to(tl.float16, bitcast=True),)
            his = his + ((x >> 16).to(tl.int16).to(tl.float16, bitcast=True),)
    return los + his


@triton.jit
def _join_parts(parts, N: tl.constexpr):
    """Interleave N (4, 8 or 16) same-shape tensors into one with N new minor elements (a ``tl.join`` tree:
    element f of the flattened minor dims holds part ``bitreverse(f)``), so that the parts of one word stay in one
    thread, next to each other."""
    t = ()
    for i in tl.static_range(N // 2):
        t = t + (tl.join(parts[2 * i], parts[2 * i + 1]),)
    u = ()
    for i in tl.static_range(N // 4):
        u = u + (tl.join(t[2 * i], t[2 * i + 1]),)
    if N == 4:
        out = u[0]
    else:
        w = ()
        for i in tl.static_range(N // 8):
            w = w + (tl.join(u[2 * i], u[2 * i + 1]),)
        if N == 8:
            out = w[0]
        else:
            out = tl.join(w[0], w[1])
    return out


@triton.jit
def _codes_fp16(words, BN: tl.constexpr, W: tl.constexpr, BITS: tl.constexpr):
    """(BN, W * 32 / BITS) fp16 operand of (BN, W) int32 code words: column ``w * PW + f`` holds part
    ``bitreverse(f)`` of word ``w`` (:func:`_word_parts`); :func:`_word_labels` says which coordinate."""
    PW: tl.constexpr = 32 // BITS
    return tl.reshape(_join_parts(_word_parts(words, BITS), PW), (BN, W * PW))


@triton.jit
def _word_labels(W: tl.constexpr, BITS: tl.constexpr):
    """For each column of :func:`_codes_fp16`'s operand of W words, (W * 32 / BITS,) int32: the latent coordinate it
    holds (``word * 32 / BITS + code``) and the exponent ``k * BITS`` of its factor. Built by the same join tree on
    labels in :func:`_word_parts`' part order, so the two always agree."""
    PB: tl.constexpr = 8 // BITS
    PW: tl.constexpr = 32 // BITS
    word = tl.arange(0, W)[None, :]
    coords = ()
    shifts = ()
    for half in tl.static_range(2):
        for hb in tl.static_range(2):
            for k in tl.static_range(PB):
                coords = coords + (word * PW + (hb + 2 * half) * PB + k,)
                shifts = shifts + (tl.zeros((1, W), tl.int32) + k * BITS,)
    coord = tl.reshape(_join_parts(coords, PW), (W * PW,))
    shift = tl.reshape(_join_parts(shifts, PW), (W * PW,))
    return coord, shift


@triton.jit
def _pow2(e):
    """fp32 2^e for int32 ``e`` in [-126, 127], exact (the exponent field set directly)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _exponent(x):
    """int32 exponent of fp32 ``x >= 0`` (``floor(log2(x))`` for normal x), 0 for x == 0 and clamped to [-112,
    112]: with the offset callers subtract (at most 14) ``_pow2`` of it and of its negation stays in range."""
    e = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    return tl.where(x > 0, tl.minimum(tl.maximum(e, -112), 112), 0)


@triton.jit
def _split_fp16(x):
    """fp16 hi + lo of fp32 ``x`` (about 22 mantissa bits together; x within fp16's range)."""
    hi = x.to(tl.float16)
    return hi, (x - hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _block_scales(rows_h, ld_ok, blk0, rank, scale_base, min_base, NB: tl.constexpr, SEG: tl.constexpr,
                  BITS: tl.constexpr):
    """(TN, NB) fp32 scale and min of each quantization block of the head at each slot row (``rows_h`` (TN,)
    fp16-word pointers), the min for centred codes (``min + scale * 2^(BITS-1)``); 0 for blocks past the head's
    rank and rows not loaded."""
    blk = tl.arange(0, NB)
    ok = ld_ok[:, None] & (blk * SEG < rank)[None, :]
    ptrs = rows_h[:, None] + (blk0 + blk)[None, :]
    sc = tl.load(ptrs + scale_base, mask=ok, other=0).to(tl.float16, bitcast=True).to(tl.float32)
    mn = tl.load(ptrs + min_base, mask=ok, other=0).to(tl.float16, bitcast=True).to(tl.float32)
    return sc, mn + sc * (1 << (BITS - 1))


@triton.jit
def _words_attention_kernel(
    qf_ptr, lk_ptr, lv_ptr, slots_ptr, mask_ptr, kmeta_ptr, vmeta_ptr, m_ptr, l_ptr, acc_ptr, pt_ptr, stride_ptb,
    Hkv, S, n_exact, kv_len, tiles_per_split, n_split,
    k_scale_base, k_min_base, v_scale_base, v_min_base,
    stride_lkb, stride_lks, stride_lvb, stride_lvs,
    stride_mb, stride_mh, stride_ms, stride_mt,
    G: tl.constexpr, GP: tl.constexpr, NG: tl.constexpr, RKP: tl.constexpr, RVP: tl.constexpr,
    RV_PAD: tl.constexpr, K_BITS: tl.constexpr, K_QBLOCK: tl.constexpr, V_BITS: tl.constexpr,
    V_QBLOCK: tl.constexpr, MASK: tl.constexpr, MASK_HEADS: tl.constexpr, BLOCK_N: tl.constexpr,
    SLOT_BLOCK: tl.constexpr, PAGE: tl.constexpr = 0, LOOP_STAGES: tl.constexpr = None,
):
    """One context split of one (sequence, KV head, query token). Grid (n_split, B * Hkv, S).

    Shapes: qf (B, S, Hkv, G, RKP) fp32 from ``latent_attention_absorbed._fold_query_kernel`` (log2 units, 0 past
    each head's rank); latent_k / latent_v (B, S_max, W) uint8 rows of a uniform ``int`` format, rows and heads'
    first code bytes 4-byte aligned, scales and mins as fp16 words (PAGE > 0: page pools and the page table
    ``pt``); strides of the rows in 4-byte words; slots (n_exact,) exact tokens' slots (-1 unused), skipped here;
    mask (B, H, S, kv_len) by strides (MASK 1: bool as uint8, 2: additive); kmeta / vmeta (Hkv, 3) int32 (first
    code byte, first block, rank). Stores m, l (rows, n_split, G) and acc (rows, n_split, G, RV_PAD) fp32, rows =
    B*Hkv*S (acc zero past the head's rank and past RVP). RKP / RVP: padded ranks (powers of two, >= 16 and >= one
    word of codes); blocks of ``min(R*P, QBLOCK)`` coordinates, each whole words; GP: G padded to a power of two.

    A tile is NG * BLOCK_N slots: tensor-core row n carries the NG slots ``n * NG + grp``, side by side along K
    (the codes of slot group grp in columns ``grp * RKP ..``, the coefficients block-diagonal), so that the
    scores' NG * NBK * GP >= 16 columns are all real (the tensor cores' N is at least 16; with one slot per row
    a G = 4 head would leave 3/4 of every elementwise op of the softmax to padding)."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    s = tl.program_id(2)
    b = bh // Hkv
    h = bh % Hkv
    PWK: tl.constexpr = 32 // K_BITS
    PWV: tl.constexpr = 32 // V_BITS
    WK: tl.constexpr = RKP // PWK  # words per padded head
    WV: tl.constexpr = RVP // PWV
    SEGK: tl.constexpr = RKP if RKP < K_QBLOCK else K_QBLOCK
    SEGV: tl.constexpr = RVP if RVP < V_QBLOCK else V_QBLOCK
    NBK: tl.constexpr = RKP // SEGK
    NBV: tl.constexpr = RVP // SEGV
    CK: tl.constexpr = NBK * GP  # key columns per slot group: (block, query head)
    NVK: tl.constexpr = NG * CK
    CV: tl.constexpr = NBV * GP  # value rows: (block, query head)
    RCOPY: tl.constexpr = 16 // CV if CV < 16 else 1  # the value rows repeated to the tensor cores' 16
    TN: tl.constexpr = NG * BLOCK_N  # slots per tile

    k_rank = tl.load(kmeta_ptr + 3 * h + 2)
    k_blk0 = tl.load(kmeta_ptr + 3 * h + 1)
    k_col = tl.load(kmeta_ptr + 3 * h) // 4
    k_words = (k_rank * K_BITS + 31) // 32
    v_rank = tl.load(vmeta_ptr + 3 * h + 2)
    v_blk0 = tl.load(vmeta_ptr + 3 * h + 1)
    v_col = tl.load(vmeta_ptr + 3 * h) // 4
    v_words = (v_rank * V_BITS + 31) // 32

    # ---- the key operand's coefficients, block-diagonal over slot groups, rows in the code columns' order: row i
    # (slot group kg[i], coordinate kc[i], factor 2^ks[i]), column v = (group, block, g): qf[g, kc[i]] / 2^ks[i]
    # where the groups match and kc[i] lies in the block, else 0
    lab, ks = _word_labels(NG * WK, K_BITS)
    kc = lab % RKP
    kg = lab // RKP
    vk = tl.arange(0, NVK)
    vk_g = vk % GP
    sel = ((kg[:, None] == (vk // CK)[None, :]) & ((kc // SEGK)[:, None] == ((vk % CK) // GP)[None, :])
           & (vk_g < G)[None, :])
    qf_row = qf_ptr + ((b * S + s) * Hkv + h).to(tl.int64) * G * RKP
    qv = tl.load(qf_row + vk_g[None, :] * RKP + kc[:, None], mask=sel, other=0.0)  # (NG * RKP, NVK)
    # each (block, g)'s sum(c), for its block's min (every slot group's columns hold the same: group 0's)
    c_blk = tl.sum(tl.where(tl.arange(0, NG)[:, None, None] == 0,
                            tl.reshape(tl.sum(qv, axis=0), (NG, NBK, GP)), 0.0), axis=0)
    coef = qv * _pow2(-ks)[:, None]
    # a power of two e brings the largest coefficient to [2^13, 2^14): fp16's range, full precision
    amax = tl.max(tl.max(tl.abs(coef), axis=1), axis=0)
    e = tl.where(amax > 0, ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - 13, 0)
    e = tl.minimum(tl.maximum(e, -126), 114)  # (2^114 * 2^13 is fp32's largest power of two; _pow2 in range)
    c_hi, c_lo = _split_fp16(coef * _pow2(-e))
    k_unit = _pow2(e)
    # each column's offset: 1024 and the centring 2^(BITS-1) of its code, times its factor (subtracted in fp16,
    # exact, before the tensor cores: an offset inside their product would be truncated there, not rounded)
    k_cent = (1024.0 + _pow2(ks + (K_BITS - 1))).to(tl.float16)
    # ---- the value operand's columns: coordinate vc[i], factor 2^vs[i]
    vc, vs = _word_labels(WV, V_BITS)
    v_cent = (1024.0 + _pow2(vs + (V_BITS - 1))).to(tl.float16)

    q_g = tl.arange(0, GP)
    q_ok = q_g < G
    mask_cols = mask_ptr + b.to(tl.int64) * stride_mb + s * stride_ms + (h * G + q_g).to(tl.int64) * stride_mh
    m_i = tl.full((GP,), float("-inf"), tl.float32)
    # per (slot lane, column) partial sums, summed over the lanes once at the end (no cross-warp sum per tile):
    l_i = tl.zeros((TN, GP), tl.float32)  # sum_t p
    acc_min = tl.zeros((TN, CV), tl.float32)  # sum_t p * min
    acc = tl.zeros((RCOPY * CV, RVP), tl.float32)  # sum_t p * scale * code * 2^vs per value row (block, g)
    lk_w = lk_ptr.to(tl.pointer_type(tl.int32))
    lv_w = lv_ptr.to(tl.pointer_type(tl.int32))
    wk = tl.arange(0, WK)
    wv = tl.arange(0, WV)

    t_start, t_end, lo_exact = _split_tiles(c, tiles_per_split, kv_len, slots_ptr, n_exact, TN, SLOT_BLOCK)
    for t in tl.range(t_start, t_end, num_stages=LOOP_STAGES):
        offs, _, slot_ok, row_idx, slot_row, ld_ok = _tile_rows(t, kv_len, lo_exact, slots_ptr, n_exact, pt_ptr,
                                                                stride_ptb, b, TN, SLOT_BLOCK, PAGE)
        k_offw = row_idx * stride_lkb + slot_row * stride_lks  # (TN,) in 4-byte words
        v_offw = row_idx * stride_lvb + slot_row * stride_lvs
        # keys: row n holds slots n * NG + grp side by side
        kptr = tl.reshape(lk_w + k_offw, (BLOCK_N, NG))[:, :, None] + (k_col + wk)[None, None, :]
        kok = tl.reshape(ld_ok, (BLOCK_N, NG))[:, :, None] & (wk < k_words)[None, None, :]
        kw = tl.reshape(tl.load(kptr, mask=kok, other=0), (BLOCK_N, NG * WK))
        codes = _codes_fp16(kw, BLOCK_N, NG * WK, K_BITS) - k_cent[None, :]  # centred code * 2^ks
        # (BLOCK_N, NVK): sum (code - 2^(BITS-1)) * qf per (slot, block, g)
        part = tl.dot(codes, c_lo, tl.dot(codes, c_hi)) * k_unit
        ksc, kmn = _block_scales((lk_ptr + 4 * k_offw).to(tl.pointer_type(tl.uint16)), ld_ok, k_blk0, k_rank,
                                 k_scale_base, k_min_base, NBK, SEGK, K_BITS)  # (TN, NBK)
        part = tl.reshape(part, (TN, NBK, GP))
        scores = tl.sum(ksc[:, :, None] * part + kmn[:, :, None] * c_blk[None, :, :], axis=1)  # (TN, GP)
        scores = _masked_tile_scores(scores, mask_ptr, mask_cols, b, s, offs, slot_ok, q_ok, stride_mb, stride_ms,
                                     stride_mt, MASK, MASK_HEADS)
        # online softmax per query head
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(scores - m_use[None, :])  # (TN, GP)
        l_i = l_i * alpha[None, :] + p
        m_i = m_new
        # the value latent in the code domain per value row (block, g): slots along the tensor cores' K
        vsc, vmn = _block_scales((lv_ptr + 4 * v_offw).to(tl.pointer_type(tl.uint16)), ld_ok, v_blk0, v_rank,
                                 v_scale_base, v_min_base, NBV, SEGV, V_BITS)  # (TN, NBV)
        alpha_v = tl.reshape(tl.broadcast_to(alpha[None, :], (NBV, GP)), (CV,))
        acc_min = acc_min * alpha_v[None, :] + tl.reshape(p[:, None, :] * vmn[:, :, None], (TN, CV))
        # the weights p * scale scaled per block by a power of two that brings the tile's largest scale to
        # [2^14, 2^15): small scales (e.g. 7e-5) would leave p * scale subnormal in fp16 (absolute, not relative
        # error), large ones stay in range (p <= 1)
        v_e = _exponent(tl.max(vsc, axis=0)) - 14  # (NBV,)
        v_unit = tl.reshape(tl.broadcast_to(_pow2(v_e)[:, None], (NBV, GP)), (CV,))
        w = tl.trans(tl.reshape(p[:, None, :] * (vsc * _pow2(-v_e)[None, :])[:, :, None], (TN, CV)))  # (CV, TN)
        w_hi, w_lo = _split_fp16(tl.reshape(tl.broadcast_to(w[None], (RCOPY, CV, TN)), (RCOPY * CV, TN)))
        vw = tl.load(lv_w + v_offw[:, None] + (v_col + wv)[None, :], mask=ld_ok[:, None] & (wv < v_words)[None, :],
                     other=0)
        vcodes = _codes_fp16(vw, TN, WV, V_BITS) - v_cent[None, :]  # centred code * 2^vs, exact in fp16
        alpha_r = tl.reshape(tl.broadcast_to(alpha_v[None, :], (RCOPY, CV)), (RCOPY * CV,))
        unit_r = tl.reshape(tl.broadcast_to(v_unit[None, :], (RCOPY, CV)), (RCOPY * CV,))
        # each tile's product from zero, added in fp32 here: carried inside the tensor-core product across tiles
        # the accumulator would be truncated at every tile (as latent_attention_absorbed found on the H200)
        acc = acc * alpha_r[:, None] + tl.dot(w_lo, vcodes, tl.dot(w_hi, vcodes)) * unit_r[:, None]

    # ---- each coordinate from its block's value row (the first copy), the factor divided out, the min term added
    l_q = tl.sum(l_i, axis=0)
    val = tl.reshape(acc, (RCOPY, CV, RVP))
    val = tl.sum(tl.where(tl.arange(0, RCOPY)[:, None, None] == 0, val, 0.0), axis=0)  # (CV, RVP)
    val = val * _pow2(-vs)[None, :] + tl.sum(acc_min, axis=0)[:, None]
    blk_of = vc // SEGV  # (RVP,)
    val = tl.sum(tl.where(tl.arange(0, NBV)[:, None, None] == blk_of[None, None, :],
                          tl.reshape(val, (NBV, GP, RVP)), 0.0), axis=0)  # (GP, RVP)
    ws_row = ((b * Hkv + h) * S + s) * n_split + c
    q_row = ws_row * G + q_g  # (GP,)
    acc_row = acc_ptr + q_row.to(tl.int64) * RV_PAD
    tl.store(acc_row[:, None] + vc[None, :], tl.where((vc < v_rank)[None, :], val, 0.0),
             mask=q_ok[:, None] & (vc < RV_PAD)[None, :])
    zc = tl.arange(0, RVP)
    for z0 in tl.static_range(RVP, RV_PAD, RVP):  # the workspace row's padding: zeros (the merge reads it all)
        tl.store(acc_row[:, None] + z0 + zc[None, :], tl.zeros((GP, RVP), tl.float32), mask=q_ok[:, None])
    tl.store(m_ptr + q_row, m_i, mask=q_ok)
    tl.store(l_ptr + q_row, l_q, mask=q_ok)


def words_layout(group: int, k_fmt, v_fmt, k_offsets, v_offsets, rk_max: int, rv_max: int,
                 k_unit_stride: int, v_unit_stride: int) -> dict | None:
    """The word pass's layout for one table-free call, or None where it does not apply.

    Applies to uniform 8/4/2-bit ``int`` key and value formats (not MX, mix or ternary) whose blocks are powers of
    two holding whole 32-bit words of codes (``block * bits >= 32``), every head with codes starting on a 4-byte
    word, row-major latents (unit stride 1), ``group`` (G) >= 2 whose columns (quantization blocks per padded rank
    x G padded) stay within :data:`MAX_VIRTUAL_COLUMNS` and need at most :data:`MAX_SLOT_GROUPS` slot groups to fill
    16 (with one block per head: G >= 4; G = 2-3 with two or more key blocks), and whose slot groups' key columns
    stay within :data:`MAX_KEY_WIDTH`. The caller checks the rows' byte strides and the scales' fp16 alignment (as
    for the lane pass).

    Args:
        group: G; k_fmt / v_fmt: parsed :class:`~ckvp_compile.kernels.latent_format.LatentFormat`; k_offsets /
            v_offsets: (Hkv + 1,) latent coordinate offsets; rk_max / rv_max: the basis blocks' widths;
            *_unit_stride: the latents' last strides.
    Returns:
        dict(RKP, RVP (padded ranks: powers of two, >= 16, >= one word of codes), GP (G padded to a power of two),
        NG (slots side by side per tensor-core row: 16 / (GP x key blocks per head), at most
        :data:`MAX_SLOT_GROUPS`)) or None. Raises nothing: the launcher then runs the other kernels. Source: the
        row layout of :func:`~ckvp_compile.kernels.latent_attention_triton._head_meta`.
    """
    return _words_layout(int(group), k_fmt, v_fmt, tuple(int(o) for o in k_offsets), tuple(int(o) for o in v_offsets),
                         int(rk_max), int(rv_max), int(k_unit_stride), int(v_unit_stride))


@functools.lru_cache(maxsize=256)
def _words_layout(group: int, k_fmt, v_fmt, k_offsets: tuple, v_offsets: tuple, rk_max: int, rv_max: int,
                  k_unit_stride: int, v_unit_stride: int) -> dict | None:
    if group < 2 or k_unit_stride != 1 or v_unit_stride != 1:  # G = 1: the lane pass (3.4x faster on the H200)
        return None
    out = {}
    blocks = []
    for tag, f, offsets, r_max in (("K", k_fmt, k_offsets, rk_max), ("V", v_fmt, v_offsets, rv_max)):
        if not f.uniform_int_blocks(32):
            return None
        cb = f.code_bytes(list(offsets))
        col0 = [sum(cb[:i]) for i in range(len(cb))]
        if any(c % 4 for c, n in zip(col0, cb) if n):  # (a rank-0 head reads no word)
            return None
        rp = max(16, triton.next_power_of_2(max(r_max, 32 // f.bits, 1)))
        out[f"R{tag}P"] = rp
        blocks.append(rp // min(rp, f.block))
    gp = triton.next_power_of_2(group)
    ng = max(1, 16 // (blocks[0] * gp))  # slot groups per tensor-core row: the key columns fill 16
    if ng > MAX_SLOT_GROUPS or ng * out["RKP"] > MAX_KEY_WIDTH:
        return None
    if blocks[0] * gp * ng < 16 or max(blocks) * gp > MAX_VIRTUAL_COLUMNS:
        return None
    out.update(GP=gp, NG=ng)
    return out
