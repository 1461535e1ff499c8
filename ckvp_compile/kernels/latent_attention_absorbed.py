"""Table-free latent decode attention on the tensor cores: the query absorbed into the key basis, any GQA ratio.

Applies to calls without RoPE tables (rope form ``'none'``: post-RoPE key bases, ``LatentBases.key_space``, or a
model without RoPE) over uniform 8/4/2-bit ``int`` latents. Then the score of cached slot ``t`` for query head
``(h, g)`` is ``q_hg . (P_h z_t) = c_hg . z_t`` with ``c_hg = P_h^T q_hg`` (rank ``r_h``, the query absorbed into
the key basis as in DeepSeek-V2's MLA), and the latent never has to be rebuilt into keys. Two launches before the
usual merge:

* ``_fold_query_kernel``, grid (B*S, Hkv): ``c = qk_scale * P_h^T q`` for the G query heads of each KV head, fp32
  (a hi/lo-split tensor-core product), zero past the head's rank.
* ``_absorbed_attention_kernel``, grid (n_split, B * n_chunks, S): one context split of NH KV heads of one sequence
  and query token. Each tile of BLOCK_N slots loads the chunk's packed code bytes once per row (a contiguous window
  when the heads are packed back to back) and does

  - scores on the tensor cores in the code domain: with ``z = code * scale + min`` per quantization block, the part
    of block ``k`` is ``scale_k * (codes . c)_k + min_k * sum(c)_k``. The integer codes (centred, exact in bf16)
    multiply a block-diagonal coefficient matrix whose columns are the "virtual heads" (KV head, block, query
    head): per code part of a byte (1, 2 or 4 of them) one (BLOCK_N, code bytes) x (code bytes, NVK) product with
    bf16 hi + lo coefficients, then each column's scale and min, then a 0/1 product that sums a query head's
    blocks;
  - the online softmax (FlashAttention-2) per query head;
  - the value latent absorbed (DeepSeek-V2) in the code domain: ``acc[v, :] += (p * scale_v)^T @ codes`` on the
    tensor cores per code part (the weights as bf16 hi + lo, the codes exact), ``acc_min[v] += sum_t p * min_v``,
    each virtual row keeping only its own block's columns at the end.

  It stores the split's (max, sum, value latent) per query head in the workspace layout of
  ``latent_attention_triton._latent_attention_split_kernel``, which ``_latent_attention_reduce_kernel`` merges,
  adding the exact tokens and projecting with the value basis.

Why: the CUDA-core chunk pass (:mod:`.latent_attention_chunks`) does 2 multiply-adds per coordinate and slot and
sums segments through layout conversions; at the Qwen1.5-MoE shape (16:16 heads, post-RoPE bases, batch 8, 32k) it
took ~266 us per layer, ~10x the time to read its latent bytes. Here the multiply-adds run on the tensor cores, the
CUDA cores only unpack codes and handle (slot, virtual head) scalars, and GQA's query heads share one latent read.

Precision: codes are centred (``code - 2^(bits-1)``) and exact in bf16; coefficients and softmax weights are split
into bf16 hi + lo parts (about 16 mantissa bits); scales and mins are applied in fp32, and each tile's value
product is added to the accumulator on the CUDA cores. Within 1e-3 of ``kernels.reference.latent_attention_ref``
under the interpreter (tests/kernels/test_latent_attention_absorbed.py) and on the H200: 6.4e-5 to 2.2e-4 at 32:8
heads, batch 8 / 32, 32k / 128k (accumulated inside the tensor-core product across tiles it had reached 1.005e-3 at
batch 32).

Measured (H200, Triton 3.6, int4/32, batch 8, 32k, CUDA-graph replays of one call;
benchmarks/results/2026-12-03-absorbed-h200): Mixtral's 32:8 heads at rank 32, 0.227 ms with 64-column chunks and
64-slot tiles against 0.501 ms for the GQA one-pass default (0.45x) and 0.244 ms for dense bf16 SDPA over the same
context (12.8x the bytes); rank 16 0.134 against 0.754 ms; rank 96 1.13 against 1.06 ms; Qwen1.5-MoE's 16:16 heads
slower than the CUDA-core chunk pass (rank 16 0.27 against 0.19 ms). About 9% of the copy bandwidth at int4 (17% at
int8, batch 8-32, 32k-128k): the CUDA cores' code
unpacking, byte permutes and index work (ptxas: 136-250 registers), not the bytes, bound it. Two findings on the
way: interleaving sub-byte codes with ``tl.join`` as a tensor-core operand gave wrong products at 16-slot tiles
(as ``_latent_raw_codes`` notes for K = 16), hence the separate code parts; 0..2^bits-1 codes against the min's
term lost 1e-3 to cancellation, hence the centred codes.

Sources (read, not copied): DeepSeek-V2 (arXiv:2405.04434: query and value absorption), FlashDecoding (split-KV +
reduction), FlashAttention-2 (arXiv:2307.08691: online softmax), KIVI / QServe (code-domain dequantization: the
scale and zero point applied after the integer product).
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .latent_attention_triton import _dot_split, _masked_tile_scores, _mm, _split_bf16, _split_tiles, _tile_rows

__all__ = ["absorbed_layout", "absorbed_heads"]

#: Largest number of virtual value rows (KV head x quantization block x query head) one program accumulates: its
#: (rows, NCV) fp32 value accumulator is the kernel's largest register tensor.
MAX_VIRTUAL_ROWS = 32


def absorbed_heads(rank_pad_k: int, rank_pad_v: int, blocks_k: int, blocks_v: int, group_pad: int, columns: int,
                   hkv: int) -> int:
    """KV heads per program: the most (a power of two, at most ``hkv`` rounded up) whose padded key and value
    columns fit in ``columns`` and whose virtual rows (heads x blocks per head x query heads) stay within
    :data:`MAX_VIRTUAL_ROWS`; at least one.

    Args:
        rank_pad_k / rank_pad_v: padded key / value ranks per head (powers of two); blocks_k / blocks_v:
            quantization blocks per padded head; group_pad: query heads per KV head rounded up to a power of two;
            columns: the chunk's target width (``DecodeConfig.absorbed``); hkv: KV heads.
    Returns:
        int >= 1. Raises nothing.
    """
    nh = 1
    width = max(rank_pad_k, rank_pad_v)
    rows = max(blocks_k, blocks_v) * group_pad
    while nh < hkv and 2 * nh * width <= columns and 2 * nh * rows <= MAX_VIRTUAL_ROWS:
        nh *= 2
    return nh


@triton.jit
def _fold_query_kernel(qf_ptr, q_ptr, bk_ptr, kmeta_ptr, Hkv, S, G, D, qk_scale,
                       stride_qb, stride_qh, stride_qs, stride_qd, stride_bkb, stride_bkh, stride_bkd, stride_bkr,
                       QP: tl.constexpr, D_PAD: tl.constexpr, RKP: tl.constexpr, RKF: tl.constexpr,
                       Q_EXACT: tl.constexpr, BK_EXACT: tl.constexpr, F32_DOT: tl.constexpr,
                       PDL: tl.constexpr = False, PDL_WAIT: tl.constexpr = False):
    """``qf[b, s, h, g, j] = qk_scale * sum_d q[b, h*G+g, s, d] * basis_k[(b,) h, d, j]`` (fp32; 0 for j >= the
    head's rank), qf (B, S, Hkv, G, RKP) contiguous. Grid (B*S, Hkv). QP / RKF: the product's rows and columns
    padded to the tensor cores' 16. PDL: let the next launch (a programmatic dependent: the MMA pass) start at once
    (``griddepcontrol.launch_dependents``; it waits for this grid before reading qf). PDL_WAIT: this launch is itself
    a programmatic dependent of the kernel before it: ``griddepcontrol.wait`` first (before the trigger, so that the
    MMA pass's reads before its own wait still follow every earlier kernel)."""
    if PDL_WAIT:
        tl.extra.cuda.gdc_wait()
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    bs = tl.program_id(0)
    h = tl.program_id(1)
    b = bs // S
    s = bs % S
    g = tl.arange(0, QP)
    d = tl.arange(0, D_PAD)
    j = tl.arange(0, RKF)
    rank = tl.load(kmeta_ptr + 3 * h + 2)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + s * stride_qs + ((h * G + g) * stride_qh)[:, None]
                + (d * stride_qd)[None, :], mask=(g < G)[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
    bk = tl.load(bk_ptr + b.to(tl.int64) * stride_bkb + h * stride_bkh + (d * stride_bkd)[:, None]
                 + (j * stride_bkr)[None, :], mask=(d < D)[:, None] & (j < rank)[None, :], other=0.0)
    c = _dot_split(q, bk.to(tl.float32), tl.zeros((QP, RKF), tl.float32), Q_EXACT, BK_EXACT, F32_DOT) * qk_scale
    out = qf_ptr + ((bs * Hkv + h) * G).to(tl.int64) * RKP
    tl.store(out + g[:, None] * RKP + j[None, :], c, mask=(g < G)[:, None] & (j < RKP)[None, :])


@triton.jit
def _chunk_code_bytes(rows, ld_ok, meta_ptr, h0, Hkv, stride_w, NH: tl.constexpr, RP: tl.constexpr,
                      BITS: tl.constexpr, CONTIG: tl.constexpr, FULL: tl.constexpr, ALIGN: tl.constexpr):
    """(BLOCK_N, NH * RP * BITS / 8) int32 code bytes of the chunk's heads (byte u: byte ``u % (RP*BITS/8)`` of head
    ``h0 + u // (RP*BITS/8)``); 0 where ``~ld_ok``, past a head's code bytes or past the last head. CONTIG: the heads'
    code bytes are one run from head h0's first byte (a multiple of ALIGN); FULL: and every head of the chunk exists
    and fills RP coordinates (no column mask: vector loads)."""
    PER: tl.constexpr = 8 // BITS
    KU: tl.constexpr = RP // PER  # code bytes per padded head
    u = tl.arange(0, NH * KU)
    uh = u // KU
    ub = u % KU
    head = h0 + uh
    if CONTIG:
        col = tl.multiple_of(tl.load(meta_ptr + 3 * h0), ALIGN) + u
    else:
        col = tl.load(meta_ptr + 3 * head, mask=head < Hkv, other=0) + ub
    if FULL:
        ok = ld_ok[:, None]
    else:
        rank = tl.load(meta_ptr + 3 * head + 2, mask=head < Hkv, other=0)
        ok = ld_ok[:, None] & ((head < Hkv) & (ub < (rank + PER - 1) // PER))[None, :]
    return tl.load(rows[:, None] + (col * stride_w)[None, :], mask=ok, other=0).to(tl.int32)


@triton.jit
def _code_part(raw, k: tl.constexpr, BITS: tl.constexpr):
    """bf16 centred codes ``code - 2^(BITS-1)`` (exact) of part ``k`` of each byte of ``raw``: bits
    ``k*BITS .. k*BITS + BITS - 1``, the byte's coordinate ``k`` (low bits first). Parts stay separate operands (no
    ``tl.join`` interleave: on the H200 with Triton 3.6 interleaved sub-byte codes made wrong tensor-core products,
    errors of 1.7-190 at 16-slot tiles, benchmarks/results/2026-12-03-absorbed-h200). Centred, the integer product
    stays near the dequantized value's size instead of cancelling against ``min * sum(c)`` (with 0..2^BITS-1 codes
    and the hi / lo coefficients' 2^-17 relative error the H200 missed 1e-3 by 1.3-4x); the offset moves into the
    min (:func:`_virtual_scales`). (Via fp32: the interpreter casts int32 to bf16 wrongly.)"""
    if BITS == 8:
        code = raw
    else:
        code = (raw >> (k * BITS)) & ((1 << BITS) - 1)
    return (code - (1 << (BITS - 1))).to(tl.float32).to(tl.bfloat16)


@triton.jit
def _part_coefficients(qf_ptr, qf_row, k: tl.constexpr, vk_hl, vk_blk, vk_g, vk_ok, G: tl.constexpr,
                       RKP: tl.constexpr, SEGK: tl.constexpr, PER: tl.constexpr, NB: tl.constexpr):
    """(NB, NVK) block-diagonal coefficients of code part ``k``: row u (byte ``u % KU`` of head ``u // KU``, KU =
    RKP / PER, coordinate ``j = (u % KU) * PER + k``) holds, in virtual column v, the folded query of (head, query
    head g[v]) at j when v is that head's block of j, else 0. Returns (bf16 hi, bf16 lo, fp32 column sums)."""
    KU: tl.constexpr = RKP // PER
    u = tl.arange(0, NB)
    u_hl = u // KU
    j = (u % KU) * PER + k
    sel = (u_hl[:, None] == vk_hl[None, :]) & ((j // SEGK)[:, None] == vk_blk[None, :]) & vk_ok[None, :]
    coef = tl.load(qf_ptr + qf_row + ((u_hl[:, None] * G + vk_g[None, :]) * RKP + j[:, None]), mask=sel, other=0.0)
    hi, lo = _split_bf16(coef)
    return hi, lo, tl.sum(coef, axis=0)


@triton.jit
def _store_value_part(acc_ptr, accp, k: tl.constexpr, vmeta_ptr, b, h0, Hkv, S, s, n_split, c, G: tl.constexpr,
                      GP: tl.constexpr, NH: tl.constexpr, RVP: tl.constexpr, SEGV: tl.constexpr, NBV: tl.constexpr,
                      NVVP: tl.constexpr, RV_PAD: tl.constexpr, PER: tl.constexpr):
    """Store the value latent coordinates of code part ``k`` from ``accp`` (NVVP, NH * RVP / PER) (each virtual row
    (head, block, query head) against every byte column, the block's min term included): each byte column's
    coordinate ``(u % KU) * PER + k`` of head ``h0 + u // KU`` takes its own virtual row; 0 past the head's rank;
    nothing past RV_PAD (the workspace row; RVP may be padded beyond it to give the tensor cores 16 columns)."""
    NHB: tl.constexpr = NVVP // GP
    KU: tl.constexpr = RVP // PER
    NB: tl.constexpr = NH * KU
    acc3 = tl.reshape(accp, (NHB, GP, NB))
    u = tl.arange(0, NB)
    u_hl = u // KU
    j = (u % KU) * PER + k
    hb = tl.arange(0, NHB)
    val = tl.sum(tl.where(hb[:, None, None] == (u_hl * NBV + j // SEGV)[None, None, :], acc3, 0.0), axis=0)
    vhead = h0 + u_hl
    vrank = tl.load(vmeta_ptr + 3 * vhead + 2, mask=vhead < Hkv, other=0)
    gg = tl.arange(0, GP)
    ws_row = ((b * Hkv + vhead) * S + s) * n_split + c  # (NB,)
    tl.store(acc_ptr + (ws_row[None, :] * G + gg[:, None]) * RV_PAD + j[None, :],
             tl.where((j < vrank)[None, :], val, 0.0),
             mask=(gg < G)[:, None] & ((vhead < Hkv) & (j < RV_PAD))[None, :])


@triton.jit
def _virtual_scales(rows, ld_ok, meta_ptr, h0, Hkv, scale_base, min_base, hl, blk, v_ok, stride_w,
                    SEG: tl.constexpr, WORDS: tl.constexpr, BITS: tl.constexpr):
    """(BLOCK_N, NV) fp32 scale and min of virtual column v = (head h0 + hl[v], block blk[v]) at each slot row, the
    min for centred codes (``min + scale * 2^(BITS-1)``, see :func:`_code_part`); 0 where ``~v_ok[v]``, the
    block lies past the head's rank or the row is not loaded. Bases in fp16 words (WORDS) or bytes."""
    head = h0 + hl
    h_ok = v_ok & (head < Hkv)
    rank = tl.load(meta_ptr + 3 * head + 2, mask=h_ok, other=0)
    blk0 = tl.load(meta_ptr + 3 * head + 1, mask=h_ok, other=0)
    ok = ld_ok[:, None] & (h_ok & (blk * SEG < rank))[None, :]
    if WORDS:
        words = rows.to(tl.pointer_type(tl.uint16))
        sc = tl.load(words[:, None] + (scale_base + blk0 + blk)[None, :], mask=ok, other=0)
        mn = tl.load(words[:, None] + (min_base + blk0 + blk)[None, :], mask=ok, other=0)
    else:
        sp = rows[:, None] + ((scale_base + 2 * (blk0 + blk)) * stride_w)[None, :]
        mp = rows[:, None] + ((min_base + 2 * (blk0 + blk)) * stride_w)[None, :]
        sc = tl.load(sp, mask=ok, other=0).to(tl.uint16) | (
            tl.load(sp + stride_w, mask=ok, other=0).to(tl.uint16) << 8)
        mn = tl.load(mp, mask=ok, other=0).to(tl.uint16) | (
            tl.load(mp + stride_w, mask=ok, other=0).to(tl.uint16) << 8)
    sc = sc.to(tl.float16, bitcast=True).to(tl.float32)
    mn = mn.to(tl.float16, bitcast=True).to(tl.float32) + sc * (1 << (BITS - 1))  # for centred codes
    return sc, mn


@triton.jit
def _absorbed_attention_kernel(
    qf_ptr, lk_ptr, lv_ptr, slots_ptr, mask_ptr, kmeta_ptr, vmeta_ptr, m_ptr, l_ptr, acc_ptr, pt_ptr, stride_ptb,
    Hkv, S, n_chunks, n_exact, kv_len, tiles_per_split, n_split,
    k_scale_base, k_min_base, v_scale_base, v_min_base,
    stride_lkb, stride_lks, stride_lkw,
    stride_lvb, stride_lvs, stride_lvw,
    stride_mb, stride_mh, stride_ms, stride_mt,
    G: tl.constexpr, GP: tl.constexpr, NH: tl.constexpr, RKP: tl.constexpr, RVP: tl.constexpr,
    RV_PAD: tl.constexpr, K_BITS: tl.constexpr, K_QBLOCK: tl.constexpr, V_BITS: tl.constexpr,
    V_QBLOCK: tl.constexpr, K_CONTIG: tl.constexpr, V_CONTIG: tl.constexpr, K_FULL: tl.constexpr,
    V_FULL: tl.constexpr, K_ALIGN: tl.constexpr, V_ALIGN: tl.constexpr, K_WORDS: tl.constexpr,
    V_WORDS: tl.constexpr, MASK: tl.constexpr,
    MASK_HEADS: tl.constexpr, F32_DOT: tl.constexpr, BLOCK_N: tl.constexpr, SLOT_BLOCK: tl.constexpr,
    PAGE: tl.constexpr = 0, LOOP_STAGES: tl.constexpr = None,
):
    """One context split of one (sequence, chunk of NH KV heads, query token). Grid (n_split, B * n_chunks, S).

    Shapes: qf (B, S, Hkv, G, RKP) fp32 from :func:`_fold_query_kernel` (log2 units); latent_k / latent_v
    (B, S_max, W) uint8 rows of a uniform ``int`` format (PAGE > 0: page pools and the page table ``pt``); slots
    (n_exact,) exact tokens' slots (-1 unused), skipped here; mask (B, H, S, kv_len) by strides (MASK 1: bool as
    uint8, 2: additive); kmeta / vmeta (Hkv, 3) int32 (first code byte, first block, rank). Stores m, l
    (rows, n_split, G) and acc (rows, n_split, G, RV_PAD) fp32, rows = B*Hkv*S (acc zero past each head's rank).
    Column sets: NCK = NH*RKP key coordinates, NVK = NH*(RKP/SEGK)*GP virtual key heads (KV head, block, query
    head), NQ = NH*GP query heads, NVV likewise for the values; each padded to the tensor cores' 16."""
    c = tl.program_id(0)
    bc = tl.program_id(1)
    s = tl.program_id(2)
    b = bc // n_chunks
    h0 = (bc % n_chunks) * NH
    SEGK: tl.constexpr = RKP if RKP < K_QBLOCK else K_QBLOCK
    SEGV: tl.constexpr = RVP if RVP < V_QBLOCK else V_QBLOCK
    NBK: tl.constexpr = RKP // SEGK
    NBV: tl.constexpr = RVP // SEGV
    NCK: tl.constexpr = NH * RKP
    NCV: tl.constexpr = NH * RVP
    NVK: tl.constexpr = NH * NBK * GP
    NVV: tl.constexpr = NH * NBV * GP
    NQ: tl.constexpr = NH * GP
    NVKP: tl.constexpr = NVK if NVK > 16 else 16
    NVVP: tl.constexpr = NVV if NVV > 16 else 16
    NQP: tl.constexpr = NQ if NQ > 16 else 16

    # ---- query heads of the chunk: column q = hq * GP + g
    qc = tl.arange(0, NQP)
    q_hl = qc // GP
    q_g = qc % GP
    q_ok = (qc < NQ) & (q_g < G) & (h0 + q_hl < Hkv)

    # ---- virtual key heads: column v = (hl * NBK + blk) * GP + g; the block-diagonal coefficients, (code bytes,
    # NVKP) per code part of a byte
    vk = tl.arange(0, NVKP)
    vk_hb = vk // GP
    vk_hl = vk_hb // NBK
    vk_blk = vk_hb % NBK
    vk_g = vk % GP
    vk_ok = (vk < NVK) & (vk_g < G) & (h0 + vk_hl < Hkv)
    PERK: tl.constexpr = 8 // K_BITS
    PERV: tl.constexpr = 8 // V_BITS
    NBYK: tl.constexpr = NCK // PERK  # code bytes per row of the chunk
    NBYV: tl.constexpr = NCV // PERV
    qf_row = ((b * S + s) * Hkv + h0).to(tl.int64) * G * RKP
    c0_hi, c0_lo, c_sum = _part_coefficients(qf_ptr, qf_row, 0, vk_hl, vk_blk, vk_g, vk_ok, G, RKP, SEGK, PERK, NBYK)
    if PERK > 1:
        c1_hi, c1_lo, c_s = _part_coefficients(qf_ptr, qf_row, 1, vk_hl, vk_blk, vk_g, vk_ok, G, RKP, SEGK, PERK,
                                               NBYK)
        c_sum += c_s
    if PERK > 2:
        c2_hi, c2_lo, c_s = _part_coefficients(qf_ptr, qf_row, 2, vk_hl, vk_blk, vk_g, vk_ok, G, RKP, SEGK, PERK,
                                               NBYK)
        c_sum += c_s
        c3_hi, c3_lo, c_s = _part_coefficients(qf_ptr, qf_row, 3, vk_hl, vk_blk, vk_g, vk_ok, G, RKP, SEGK, PERK,
                                               NBYK)
        c_sum += c_s
    if NBK > 1:  # 0/1 (NVKP, NQP): a query head's blocks summed
        fold_k = ((vk_hl[:, None] == q_hl[None, :]) & (vk_g[:, None] == q_g[None, :]) & vk_ok[:, None]
                  ).to(tl.float32).to(tl.bfloat16)

    # ---- virtual value rows: v = (hl * NBV + blk) * GP + g
    vv = tl.arange(0, NVVP)
    vv_hb = vv // GP
    vv_hl = vv_hb // NBV
    vv_blk = vv_hb % NBV
    vv_g = vv % GP
    vv_ok = (vv < NVV) & (vv_g < G) & (h0 + vv_hl < Hkv)
    if NBV > 1:  # 0/1 (NQP, NVVP): a query head's weights copied to its blocks' rows
        expand_v = ((q_hl[:, None] == vv_hl[None, :]) & (q_g[:, None] == vv_g[None, :]) & vv_ok[None, :]
                    ).to(tl.float32).to(tl.bfloat16)

    mask_cols = mask_ptr + b.to(tl.int64) * stride_mb + s * stride_ms + ((h0 + q_hl) * G + q_g).to(tl.int64) * stride_mh
    m_i = tl.full((NQP,), float("-inf"), tl.float32)
    l_i = tl.zeros((NQP,), tl.float32)
    acc0 = tl.zeros((NVVP, NBYV), tl.float32)  # one value accumulator per code part of a byte
    if PERV > 1:
        acc1 = tl.zeros((NVVP, NBYV), tl.float32)
    if PERV > 2:
        acc2 = tl.zeros((NVVP, NBYV), tl.float32)
        acc3 = tl.zeros((NVVP, NBYV), tl.float32)
    acc_min = tl.zeros((NVVP,), tl.float32)

    t_start, t_end, lo_exact = _split_tiles(c, tiles_per_split, kv_len, slots_ptr, n_exact, BLOCK_N, SLOT_BLOCK)
    for t in tl.range(t_start, t_end, num_stages=LOOP_STAGES):
        offs, _, slot_ok, row_idx, slot_row, ld_ok = _tile_rows(t, kv_len, lo_exact, slots_ptr, n_exact, pt_ptr,
                                                                stride_ptb, b, BLOCK_N, SLOT_BLOCK, PAGE)
        k_rows = lk_ptr + row_idx * stride_lkb + slot_row * stride_lks
        v_rows = lv_ptr + row_idx * stride_lvb + slot_row * stride_lvs
        # scores: (codes @ c) per virtual head, then its block's scale and min, then summed per query head
        kraw = _chunk_code_bytes(k_rows, ld_ok, kmeta_ptr, h0, Hkv, stride_lkw, NH, RKP, K_BITS, K_CONTIG, K_FULL,
                                 K_ALIGN)
        kc = _code_part(kraw, 0, K_BITS)
        part = _mm(kc, c0_hi, tl.zeros((BLOCK_N, NVKP), tl.float32), F32_DOT)
        part = _mm(kc, c0_lo, part, F32_DOT)
        if PERK > 1:
            kc = _code_part(kraw, 1, K_BITS)
            part = _mm(kc, c1_lo, _mm(kc, c1_hi, part, F32_DOT), F32_DOT)
        if PERK > 2:
            kc = _code_part(kraw, 2, K_BITS)
            part = _mm(kc, c2_lo, _mm(kc, c2_hi, part, F32_DOT), F32_DOT)
            kc = _code_part(kraw, 3, K_BITS)
            part = _mm(kc, c3_lo, _mm(kc, c3_hi, part, F32_DOT), F32_DOT)
        ksc, kmn = _virtual_scales(k_rows, ld_ok, kmeta_ptr, h0, Hkv, k_scale_base, k_min_base, vk_hl, vk_blk, vk_ok,
                                   stride_lkw, SEGK, K_WORDS, K_BITS)
        part = ksc * part + kmn * c_sum[None, :]
        if NBK > 1:
            p_hi, p_lo = _split_bf16(part)
            scores = _mm(p_hi, fold_k, tl.zeros((BLOCK_N, NQP), tl.float32), F32_DOT)
            scores = _mm(p_lo, fold_k, scores, F32_DOT)
        else:
            scores = part  # virtual key heads are the query heads
        scores = _masked_tile_scores(scores, mask_ptr, mask_cols, b, s, offs, slot_ok, q_ok, stride_mb, stride_ms,
                                     stride_mt, MASK, MASK_HEADS)
        # online softmax per query head
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(scores - m_use[None, :])  # (BLOCK_N, NQP)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
        # the value latent in the code domain: acc[v, :] += (p * scale_v)^T @ codes, acc_min[v] += sum_t p * min_v
        if NBV > 1:
            pw_hi, pw_lo = _split_bf16(p)
            pv = _mm(pw_hi, expand_v, tl.zeros((BLOCK_N, NVVP), tl.float32), F32_DOT)
            pv = _mm(pw_lo, expand_v, pv, F32_DOT)
            alpha_v = tl.sum(tl.where((q_hl[:, None] == vv_hl[None, :]) & (q_g[:, None] == vv_g[None, :]),
                                      alpha[:, None], 0.0), axis=0)
            alpha_v = tl.where(vv_ok, alpha_v, 1.0)
        else:
            pv = p
            alpha_v = alpha
        vsc, vmn = _virtual_scales(v_rows, ld_ok, vmeta_ptr, h0, Hkv, v_scale_base, v_min_base, vv_hl, vv_blk,
                                   vv_ok, stride_lvw, SEGV, V_WORDS, V_BITS)
        vraw = _chunk_code_bytes(v_rows, ld_ok, vmeta_ptr, h0, Hkv, stride_lvw, NH, RVP, V_BITS, V_CONTIG, V_FULL,
                                 V_ALIGN)
        u_hi, u_lo = _split_bf16(tl.trans(pv * vsc))  # (NVVP, BLOCK_N)
        # each tile's product from a zero accumulator, added in fp32 on the CUDA cores: accumulated inside the
        # tensor-core product across tiles, the error doubled from batch 8 to 32 (splits of 4x the tiles) and
        # passed 1e-3 on the H200 (benchmarks/results/2026-12-03-absorbed-h200)
        zero = tl.zeros((NVVP, NBYV), tl.float32)
        vc = _code_part(vraw, 0, V_BITS)
        acc0 = acc0 * alpha_v[:, None] + _mm(u_lo, vc, _mm(u_hi, vc, zero, F32_DOT), F32_DOT)
        if PERV > 1:
            vc = _code_part(vraw, 1, V_BITS)
            acc1 = acc1 * alpha_v[:, None] + _mm(u_lo, vc, _mm(u_hi, vc, zero, F32_DOT), F32_DOT)
        if PERV > 2:
            vc = _code_part(vraw, 2, V_BITS)
            acc2 = acc2 * alpha_v[:, None] + _mm(u_lo, vc, _mm(u_hi, vc, zero, F32_DOT), F32_DOT)
            vc = _code_part(vraw, 3, V_BITS)
            acc3 = acc3 * alpha_v[:, None] + _mm(u_lo, vc, _mm(u_hi, vc, zero, F32_DOT), F32_DOT)
        acc_min = acc_min * alpha_v + tl.sum(pv * vmn, axis=0)

    # ---- each value coordinate from its own virtual row (the block's min term added), then the row's padding
    _store_value_part(acc_ptr, acc0 + acc_min[:, None], 0, vmeta_ptr, b, h0, Hkv, S, s, n_split, c, G, GP, NH, RVP,
                      SEGV, NBV, NVVP, RV_PAD, PERV)
    if PERV > 1:
        _store_value_part(acc_ptr, acc1 + acc_min[:, None], 1, vmeta_ptr, b, h0, Hkv, S, s, n_split, c, G, GP, NH,
                          RVP, SEGV, NBV, NVVP, RV_PAD, PERV)
    if PERV > 2:
        _store_value_part(acc_ptr, acc2 + acc_min[:, None], 2, vmeta_ptr, b, h0, Hkv, S, s, n_split, c, G, GP, NH,
                          RVP, SEGV, NBV, NVVP, RV_PAD, PERV)
        _store_value_part(acc_ptr, acc3 + acc_min[:, None], 3, vmeta_ptr, b, h0, Hkv, S, s, n_split, c, G, GP, NH,
                          RVP, SEGV, NBV, NVVP, RV_PAD, PERV)
    cv = tl.arange(0, NCV)
    vhead = h0 + cv // RVP
    gg = tl.arange(0, GP)
    ws_row = ((b * Hkv + vhead) * S + s) * n_split + c  # (NCV,)
    st_ok = (gg < G)[:, None] & (vhead < Hkv)[None, :]
    for z0 in tl.static_range(RVP, RV_PAD, RVP):  # the workspace row's padding: zeros (the merge reads it all)
        tl.store(acc_ptr + (ws_row[None, :] * G + gg[:, None]) * RV_PAD + z0 + (cv % RVP)[None, :],
                 tl.zeros((GP, NCV), tl.float32), mask=st_ok)
    q_row = (((b * Hkv + h0 + q_hl) * S + s) * n_split + c) * G + q_g
    tl.store(m_ptr + q_row, m_i, mask=q_ok)
    tl.store(l_ptr + q_row, l_i, mask=q_ok)


def absorbed_layout(columns: int, group: int, k_fmt, v_fmt, k_offsets, v_offsets, rk_max: int, rv_max: int,
                    hkv: int, k_unit_stride: int, v_unit_stride: int) -> dict | None:
    """The absorbed kernel's layout for one table-free call, or None where it does not apply.

    Applies to uniform 8/4/2-bit ``int`` key and value formats (not MX, mix or ternary) whose blocks are powers of
    two holding whole code bytes, row-major latents (unit stride 1) and ``columns`` > 0; any ``group`` (G).

    Args:
        columns: target key / value columns per program (``DecodeConfig.absorbed``); group: G; k_fmt / v_fmt:
            parsed :class:`~ckvp_compile.kernels.latent_format.LatentFormat`; k_offsets / v_offsets: (Hkv + 1,)
            latent coordinate offsets; rk_max / rv_max: the basis blocks' widths; hkv: KV heads; *_unit_stride: the
            latents' last strides.
    Returns:
        dict(NH heads per program, n_chunks, RKP, RVP (padded ranks), GP (G padded to a power of two), and per K / V:
        CONTIG, FULL, ALIGN (bytes)) or None. Raises nothing: the launcher then runs the other kernels.
        Source: the row layout of :func:`~ckvp_compile.kernels.latent_attention_triton._head_meta`.
    """
    return _absorbed_layout(int(columns), int(group), k_fmt, v_fmt, tuple(int(o) for o in k_offsets),
                            tuple(int(o) for o in v_offsets), int(rk_max), int(rv_max), int(hkv), int(k_unit_stride),
                            int(v_unit_stride))


@functools.lru_cache(maxsize=256)
def _absorbed_layout(columns: int, group: int, k_fmt, v_fmt, k_offsets: tuple, v_offsets: tuple, rk_max: int,
                     rv_max: int, hkv: int, k_unit_stride: int, v_unit_stride: int) -> dict | None:
    if columns <= 0 or group < 1 or k_unit_stride != 1 or v_unit_stride != 1:
        return None
    if not (k_fmt.uniform_int_blocks(8) and v_fmt.uniform_int_blocks(8)):
        return None
    gp = triton.next_power_of_2(group)
    rkp = triton.next_power_of_2(max(rk_max, 8 // k_fmt.bits, 1))
    rvp = triton.next_power_of_2(max(rv_max, 8 // v_fmt.bits, 1))
    nbk, nbv = max(1, rkp // k_fmt.block), max(1, rvp // v_fmt.block)
    if max(nbk, nbv) * gp > MAX_VIRTUAL_ROWS:
        return None
    nh = absorbed_heads(rkp, rvp, nbk, nbv, gp, columns, hkv)
    # the tensor cores' K (key code bytes) and N (value code bytes) are at least 16
    rkp = max(rkp, 16 * (8 // k_fmt.bits) // nh)
    rvp = max(rvp, 16 * (8 // v_fmt.bits) // nh)
    out = dict(NH=nh, n_chunks=-(-hkv // nh), RKP=rkp, RVP=rvp, GP=gp)
    for tag, f, offsets, rp in (("K", k_fmt, k_offsets, rkp), ("V", v_fmt, v_offsets, rvp)):
        ranks = [b - a for a, b in zip(offsets, offsets[1:])]
        cb = f.code_bytes(list(offsets))
        col0 = [sum(cb[:i]) for i in range(len(ranks))]
        contig = nh == 1 or all(x == rp * f.bits // 8 for x in cb)
        out[f"{tag}_CONTIG"] = contig
        out[f"{tag}_FULL"] = contig and hkv % nh == 0 and all(r == rp for r in ranks)
        align = 16
        while align > 1 and any(col0[h] % align for h in range(0, hkv, nh)):
            align //= 2
        out[f"{tag}_ALIGN"] = align
    return out
