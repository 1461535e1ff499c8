"""Latent decode attention with the codes loaded straight into tensor-core operand registers: the MMA pass.

Applies to table-free calls (post-RoPE key bases, or no RoPE) over int4 key and value latents of rank 32 per KV head
in one quantization block (the ``int4/32`` format at rank 32; unit-major latents also ``int8/32``), at GQA ratios
G = 2, 4 or 8, without an attention mask, on CUDA devices with ``mma.sync`` (sm_80 and later). Elsewhere the
launcher runs the word pass (:mod:`.latent_attention_words`) or the other kernels. Written in Gluon (Triton's
layout-explicit dialect), so it runs on the GPU only; Triton's interpreter cannot run it (the CPU tests check its
arithmetic by emulation and compile it for sm_90a).

The math is the word pass's (DeepSeek-V2's absorption): with ``c = qk_scale * P_h^T q`` the query folded into the
key basis (log2 units), a slot's score is ``scale * (sum_k c_k (code_k - 8) + 8 sum(c)) + min * sum(c)`` and its
value latent ``scale * (code - 8) + (min + 8 * scale)``. What differs is where the codes go:

* keys: the scores ``S = C @ K^T`` take the query heads as the 16 tensor-core rows (rows 0..7 the folded query in
  fp16, rows 8..15 its fp16 remainder: the two halves of each accumulator pair share a thread, so hi + lo is one
  add) and the slots as columns. Each thread's B operand for one slot is exactly one 32-bit word of that slot's
  codes: the latent's word ``q`` (codes ``8q .. 8q+7``, little-endian nibbles) read as mma coordinates
  ``16s + 8h + 2q + e`` for its nibble ``4e + 2s + h``. ``lop3`` with 0x6400 and one ``sub.f16x2`` per pair
  turn a word into four fp16 pairs (Marlin's conversion; the ``h = 1`` nibbles carry ``16 * code``, so their query
  coefficients are divided by 16). The folded query is gathered in that order: no data moves for it;
* values: ``O = P @ V`` with P straight from the scores' accumulator layout (FlashAttention-2's register reuse) and
  V's operand built from one half-word of each of two slots (one ``prmt``): half-word ``g`` (latent coordinates
  ``4g .. 4g+3``) serves mma coordinates ``g + 8i``; the value latent is stored back in the latent's order;
* at G = 4 (G = 2) two (four) groups of slots share one score product through a block-diagonal folded query, so
  all 8 query rows are real; each group keeps its own softmax state, and the groups are merged (rescaled to the
  larger max) before the split is stored, for the merge kernel (``latent_attention_triton``'s
  ``_latent_attention_reduce_kernel`` or ``_merge_splits_kernel``) to combine with the other splits;
* one warp per program, no shared memory; the next tile's loads are issued before the current tile is computed.
  (A ``cp.async`` staging of the tiles through shared memory was 3-4x slower on the H200 with 4-byte copies,
  benchmarks/results/2026-12-04-mma-h200, r5, and 0-5% slower with 16-byte copies of every unit-major tile,
  benchmarks/results/2026-12-04-unit-major-h200, r15; both were removed. So was a TMA ring of 2-3 shared-memory
  stages a program, codes and fields by tensor copies: correct, 3-22% slower on an H100 at the acceptance shapes,
  benchmarks/results/2026-12-07-session48, its code at commit c90ff17. Nsight Compute there: ptxas issues the next
  tile's register loads near the end of the loop, so about 60% of the register path's stall samples wait for them.)

Two kernels read two latent layouts (:mod:`.latent_layout`):

* :func:`_mma_attention_kernel`, row-major rows (the maps above: :func:`key_coordinate`, :func:`value_coordinate`).
  One head's 16 code bytes and 4 scale / min bytes per slot share four 32-byte sectors with the other heads, so
  the 8 head programs of a sequence pull each sector through L2 separately: Nsight Compute put L2 at 70% of its
  peak and DRAM at 23% (a version at 100-128 registers was no faster than one at 234);
* :func:`_mma_unit_kernel`, unit-major latents (each byte column contiguous over the slots): the tile's slots are
  assigned to the scores' columns so that each lane reads 4 or 8 consecutive slots of one column (8- and 16-byte
  loads of whole sectors), mma coordinate k is latent coordinate k (byte k // 2, nibble k % 2), and the value
  operand's slot pairs come from two words of one column (one ``prmt``). 1.39-1.48x the row-major kernel.

Precision: the scores' coefficients and the weights ``p * scale`` are split into fp16 hi + lo (about 22 bits;
the lo rows fill tensor-core rows 8..15, which the 8 query rows leave free); the coefficients are scaled by a
power of two into fp16's range; the weights are scaled per tile by a power of two that brings the tile's largest value
scale to [2^14, 2^15) (the accumulator rescaled exactly when it changes), so small scales do not go subnormal in
fp16; the value accumulator stays in fp32 in the tensor cores across a split's tiles.

Programs: grid (Hkv, n_split, B * S): the programs of one sequence's KV heads are adjacent in launch order, so
the rows they share (each reads its head's 16 bytes of every slot) are read from DRAM once. A split's tiles of
``BT = block_n_m`` slots (64 unit-major) run unmasked while the whole tile lies below ``kv_len`` and below the first exact token
(the recent window kept in full precision); the tiles after that are masked per slot (length, exact slots, unmapped
pages, whose zero rows score 0 as in the other passes).

Measured (H200, Triton 3.6, 32:8 heads, int4/32 rank 32, one whole call in CUDA-graph replay;
benchmarks/results/2026-12-04-unit-major-h200, r18): unit-major batch 8, 32k 0.050 ms, batch 32, 128k 0.610 ms
(41.0% and 51.6% of the copy bandwidth, 4.9x and 6.1x dense SDPA); row-major about 1.45x slower; the word pass
0.199 and 2.914 ms. The pass is bound by its instructions (about 625 SASS a 64-slot tile) and each tile's dependent
chain, not by bytes in flight: a cp.async pipeline through shared memory was no faster (r14, r15). The prototype
(benchmarks/mma_pass_proto.py, its own head-major layout) read at 61-72% with its main pass alone.
8-bit codes (unit-major ``int8/32``, ``BITS = 8``): 701 SASS a tile for 1.8x the bytes, and the pass nears the
memory roofline when each tile's columns are contiguous (a unit-major pool of 64-slot pages): batch 8, 128k 0.186 ms
and batch 32, 128k 0.699 ms, 76.8% and 81.5% of the copy bandwidth, 5.1x and 5.4x dense SDPA (7.1x fewer bytes); in
a static unit-major cache (64-byte column runs S_max apart) 50-55% (benchmarks/results/2026-12-04-int8-mma-h200).
Its loads alone (the same bytes, addresses, occupancy and one tile ahead) read at 90-102% of the copy bandwidth
(benchmarks/unit_load_roofline.py), so the pass is bound by its instructions. Loads from one address per lane
(:data:`LANE_LOADS_GPU_CHECKED`) cut a tile's SASS from 765 to 619 (the 64-bit address of each of 29 loads): batch
8, 32k 0.054 ms (66.5%, 4.65x), batch 8, 128k 0.171 (83.4%, 5.51x), batch 32, 32k 0.170 (83.8%, 5.48x), batch 32,
128k 0.648 (87.8%, 5.64x) (benchmarks/results/2026-12-05-lane-loads-h200, r2). With the page scan, value pairs,
the fp32 merge and ``evict_first`` on the latent loads (:data:`LOAD_HINT_GPU_CHECKED`): batch 8, 32k 0.046 ms (78%,
5.14x), batch 8, 128k 0.159 (90%, 5.82x), batch 32, 32k 0.159-0.163 (88-90%, 5.65-5.79x), batch 32, 128k 0.625
(91%, 5.84x) (benchmarks/results/2026-12-06-fold-merge-in-pass, r5, two runs).

Sources (read, not copied): Marlin (arXiv:2408.11743) and FasterTransformer (the 0x6400 int4 -> fp16 conversion),
FlashAttention-2 (arXiv:2307.08691: online softmax, P reused from the accumulator layout), FlashDecoding (split-KV
+ reduction), DeepSeek-V2 (arXiv:2405.04434: query and value absorption), the PTX ISA's ``mma.m16n8k16`` fragment
layouts.
"""

from __future__ import annotations

import functools
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

__all__ = ["mma_layout", "mma_splits", "key_coordinate", "value_coordinate", "MMA_RANK", "MMA_GROUPS", "MAX_GRID_Y"]

#: The latent rank per KV head this pass reads (keys and values): one 32-bit word of int4 codes per mma k-step.
MMA_RANK = 32

#: GQA ratios the pass packs into the tensor cores' 8 query rows.
MMA_GROUPS = (2, 4, 8)

#: CUDA's limit on a grid's second dimension: the splits along the context (a fixed ``split`` past it is cut to it).
MAX_GRID_Y = 65535

#: The unit-major kernel's loads from one address per lane and tensor (``_unit_lanes`` / ``_unit_load``: 619 SASS a
#: 64-slot int8 tile instead of 765, offline sm_90a), instead of one 64-bit address per load (``_tile_load``).
#: Checked on the H200 (benchmarks/results/2026-12-05-lane-loads-h200, r2: 20 random cases at G = 2, 4, 8, int4 and
#: int8, static and paged, and the large int8 / int4 cases, errors as before) and 7-8% faster there (int8/32, 64-slot
#: pages: batch 8, 32k 0.054 ms, was 0.059; batch 32, 128k 0.648, was 0.699). ``CKVP_MMA_LANE_LOADS=0`` turns it off.
LANE_LOADS_GPU_CHECKED = True


#: In a paged cache a program first finds its split's first unmapped page (``PSCAN``: one vector load of up to 128
#: page-table entries, :func:`_mapped_end`) and leaves the tiles from there to the masked loop, so the unmasked tiles
#: run without the per-slot zeroing of the four fields for unmapped pages (32 ``FSEL`` of the 8-bit tile's 639 SASS,
#: Triton 3.6). A test of the page inside the loop instead took 200 registers. Checked on the H200
#: (benchmarks/results/2026-12-05-fewer-instructions, r1: random cases and int8 cases with an unmapped page below the
#: context, register path and cp.async ring): 128 registers instead of 168, so 2112 programs run in one wave (the
#: 8-bit default since): batch 8, 128k 0.165 ms against 0.199 at 2112 programs. ``CKVP_MMA_PAGE_SCAN=0`` turns it off.
PAGE_SCAN_GPU_CHECKED = True

#: The unit-major kernel's 8-bit value operand from one word a slot pair (``VPAIR``): the value product's k order is
#: permuted (:func:`_group_pairs`, free: a register choice in the weights' fp16 packing) so that a thread's k pair is
#: two adjacent slots of one code column; one ``prmt`` with 0x64 bytes and one ``sub.f16x2`` turn two codes into
#: fp16 ``code - 128`` (3 instructions a pair before: ``prmt`` of two words, ``lop3``, ``sub.f16x2``). The codes
#: stay centred: uncentred values would carry a 1152-a-code offset through the whole split's fp32 accumulator.
#: Checked on the H200 (benchmarks/results/2026-12-05-fewer-instructions, r1): at 2112 programs batch 32, 32k 0.159
#: ms a call against 0.164, batch 8 within 1%. ``CKVP_MMA_VPAIR=0`` turns it off.
VPAIR_GPU_CHECKED = True


#: The unit-major kernel folds the query into the key basis itself (:func:`_fold_rows`: two or four bf16 tensor-core
#: products per 32 channels, hi / lo splits of the query and of a non-bf16 basis), instead of reading the fold
#: kernel's output (``latent_attention_absorbed._fold_query_kernel``): one launch fewer a call. Checked on H100s
#: (benchmarks/results/2026-12-06-fold-merge-in-pass, r1 and r4: 78 cases within 1e-4) and slower there: batch 8,
#: 32k 65.2-65.4 us a call against 62.9-63.1 in r4, 0.5-1.8% at the larger shapes (each program's fold is a chain
#: of dependent steps before its first tile, and costs more than the fold launch). Off; ``CKVP_MMA_FOLD=1`` turns
#: it on.
FOLD_GPU_CHECKED = False

#: The unit-major kernel merges the splits itself: the last program of each (sequence, KV head, query token) to store
#: its split (an arrival counter, acquire-release atomics; the counter reset by that program) merges the row's
#: partials, scores and adds the exact tokens, projects the value latent through the value basis and stores the
#: output (:func:`_merge_in_pass`), instead of a merge launch. Checked on an H100 (same run: correct, CUDA-graph
#: replays bit-equal) and slower there: 67.9 us a call against 63.7 (one warp's serial chain over the row's partials,
#: about 8 us, where the merge launch's 1,024 warps take 3.6). Off; ``CKVP_MMA_MERGE=1`` turns it on.
MERGE_GPU_CHECKED = False


#: The unit-major kernel's latent loads carry ``evict_first`` (``L1::evict_first.L2::cache_hint``): the latent is
#: read once a call, and the hint leaves L2 to what the next launches read again (the folded query, the partials, the
#: bases, the next call's query). Measured on an H100 (benchmarks/results/2026-12-06-fold-merge-in-pass, r2 and r3,
#: two interleaved repeats; int8/32, 64-slot pages, CUDA-graph replay): batch 8, 32k 61.3-61.8 us a call against
#: 63.4-63.6 (the fold and merge kernels faster too: 1.8 / 3.3 us against 2.2 / 3.6), batch 8, 128k and batch 32,
#: 32k 1-1.2% faster, batch 32, 128k 0.3%; ``.cg`` (2) was 1-3% slower. Numerics unchanged (a cache hint).
LOAD_HINT_GPU_CHECKED = 1

#: The unit-major kernel prefetches its split's first tile into L2 before it reads the folded query (``EARLY``,
#: :func:`early_tile`): in 64-slot pages the programs of a page's KV heads each bulk-prefetch a share of it
#: (``cp.async.bulk.prefetch.L2``, two a program from lane 0), otherwise each lane its columns' runs; no registers
#: held (128 at G = 4, 8-bit, as without). The tile's DRAM latency then overlaps the query's loads and operand
#: build instead of following them. Checked on an H100 (benchmarks/results/2026-12-06-early-tile, r1 and r2: random
#: and unmapped-page cases within 1e-3, CUDA-graph replays bit-equal under PDL): two interleaved repeats at the four
#: int8/32 acceptance shapes, batch 8, 32k 59.0-60.2 us a call against 60.7-61.8 (-2.6%), batch 8, 128k -1%,
#: batch 32, 32k -0.6%, batch 32, 128k within 0.3%. The first tile loaded into registers there instead took 133
#: registers (15 programs an SM: +20%), and prefetching one or two tiles ahead inside the loop 5% more SASS a tile
#: (+7-14%).
EARLY_TILE_GPU_CHECKED = True

#: The unit-major kernel's 8-bit key product on the integer tensor cores (``IMMA``, :func:`int8_keys`): each lane's
#: four code words of a slot quad (one coordinate each, four slots) transposed by 8 ``prmt`` into four words of one
#: slot (four coordinates each), which are ``mma.m16n8k32``'s u8 B operand as they are; the folded query as 16-bit
#: fixed point, its high and low bytes the s8 A operand's rows 0..7 and 8..15 (the hi / lo rows of the fp16 path),
#: the score ``256 hi + lo`` exact in int32. Per 64-slot tile: 8 IMMA instead of 16 HMMA, 32 PRMT instead of 96
#: conversion instructions (prmt, lop3, sub.f16x2), plus one IMAD and one I2F a score: 485 SASS a tile instead of
#: 550 at G = 4, 128 registers (offline sm_90a, :func:`compile_for_sm90` with ``imma=True``;
#: benchmarks/results/2026-12-07-session49). The query carries 16 bits instead of the fp16 pair's 22 (a score's
#: error about 2^-17 of the scores' spread: within 1e-3 of the fp32 attention at the spreads of attention logits,
#: emulated on CPU). On an H100 (benchmarks/results/2026-12-07-session49, r2 and r3) correct with FPAIR and VIMMA
#: (17 cases, 1e-5 to 3.9e-4) and about 1% of a call faster at batch 8 and 32, 32k (2.7% / 1% of the pass). On the
#: H200 (benchmarks/results/2026-12-07-session51-h200; with FPAIR and VIMMA) correct (28 cases) and 5-13% faster
#: than the fp16 path in issue 5's acceptance bench (batch 8, 32k: 0.7999 / 0.802 of the byte ratio against 0.757;
#: batch 32, 32k: 0.885 against 0.793): on by default; ``CKVP_MMA_IMMA=0`` turns it off. Source: the PTX ISA's
#: ``mma.m16n8k32`` .s8 / .u8 fragment layouts.
IMMA_GPU_CHECKED = True

#: The unit-major kernel's four per-slot fp16 fields (key scale and min, value scale and min) built two slots a
#: ``prmt`` (``FPAIR``, :func:`field_pairs`): the slots of column tiles j and j + 1 are adjacent bytes of one word of
#: each byte column, so one ``prmt`` makes both fp16 (16 of a 64-slot tile's 32 ``prmt`` at G = 4). Checked with
#: IMMA and VIMMA on an H100 and the H200 (see :data:`IMMA_GPU_CHECKED`): on by default; ``CKVP_MMA_FIELD_PAIRS=0``
#: turns it off.
FIELD_PAIRS_GPU_CHECKED = True

#: With ``IMMA`` at G = 4 or 8, the value product on the integer tensor cores too (``VIMMA``, :func:`int8_values`):
#: the weights ``p * vscale`` as 16-bit fixed point per row and tile (the row's largest at 32512), packed by ``prmt``
#: from the scores' registers into the s8 A fragment (high bytes rows 0..7, low bytes 8..15), the value code words as
#: loaded the u8 B fragments (four slots of one coordinate a word: no conversion; the 64 ``prmt`` / ``sub.f16x2`` of
#: the fp16 path go), 8 IMMA a tile instead of 16 HMMA, the tile's int32 product scaled into an fp32 accumulator of
#: the true scale (no per-tile power of two). Checked with IMMA and FPAIR on an H100 and the H200 (see
#: :data:`IMMA_GPU_CHECKED`): on by default; ``CKVP_MMA_VIMMA=0`` turns it off.
VIMMA_GPU_CHECKED = True


def _switch(env_name: str, checked: bool) -> bool:
    """``checked``, unless the environment variable ``env_name`` is set (``1``: on, anything else: off)."""
    env = os.environ.get(env_name)
    return checked if env is None else env == "1"


def lane_loads() -> bool:
    """Whether the unit-major kernel loads from one address per lane (:data:`LANE_LOADS_GPU_CHECKED`, or the
    environment variable ``CKVP_MMA_LANE_LOADS=1`` / ``0`` for a GPU check either way). Raises nothing."""
    return _switch("CKVP_MMA_LANE_LOADS", LANE_LOADS_GPU_CHECKED)


def value_pairs() -> bool:
    """Whether the unit-major kernel's 8-bit value operand takes a slot pair from one word (:data:`VPAIR_GPU_CHECKED`,
    or ``CKVP_MMA_VPAIR=1`` / ``0``). Raises nothing."""
    return _switch("CKVP_MMA_VPAIR", VPAIR_GPU_CHECKED)


def fold_in_pass() -> bool:
    """Whether the unit-major kernel folds the query itself (:data:`FOLD_GPU_CHECKED`, or ``CKVP_MMA_FOLD=1`` /
    ``0``). Raises nothing."""
    return _switch("CKVP_MMA_FOLD", FOLD_GPU_CHECKED)


def merge_in_pass() -> bool:
    """Whether the unit-major kernel's last program of each row merges the splits (:data:`MERGE_GPU_CHECKED`, or
    ``CKVP_MMA_MERGE=1`` / ``0``). Raises nothing."""
    return _switch("CKVP_MMA_MERGE", MERGE_GPU_CHECKED)


def load_hint() -> int:
    """The unit-major kernel's cache hint for its latent loads: :data:`LOAD_HINT_GPU_CHECKED`, or
    ``CKVP_MMA_HINT`` (0 none; 1 ``evict_first``; 2 ``.cg``, L2 only). Raises nothing (other values read as
    0)."""
    v = os.environ.get("CKVP_MMA_HINT")
    if v is None:
        return LOAD_HINT_GPU_CHECKED
    return int(v) if v in ("0", "1", "2") else 0


def early_tile() -> bool:
    """Whether the unit-major kernel prefetches its first tile into L2 before it reads the folded query (``EARLY``):
    :data:`EARLY_TILE_GPU_CHECKED`, or ``CKVP_MMA_EARLY=1`` / ``0``. Raises nothing. Source: the PTX ISA's
    ``prefetch`` and ``cp.async.bulk.prefetch`` (sm_90)."""
    return _switch("CKVP_MMA_EARLY", EARLY_TILE_GPU_CHECKED)


def int8_keys() -> bool:
    """Whether the unit-major kernel's 8-bit key product runs on the integer tensor cores (:data:`IMMA_GPU_CHECKED`,
    or ``CKVP_MMA_IMMA=1`` / ``0``). Raises nothing."""
    return _switch("CKVP_MMA_IMMA", IMMA_GPU_CHECKED)


def field_pairs() -> bool:
    """Whether the unit-major kernel builds its fp16 fields two slots a ``prmt`` (:data:`FIELD_PAIRS_GPU_CHECKED`,
    or ``CKVP_MMA_FIELD_PAIRS=1`` / ``0``). Raises nothing."""
    return _switch("CKVP_MMA_FIELD_PAIRS", FIELD_PAIRS_GPU_CHECKED)


def int8_values() -> bool:
    """Whether the unit-major kernel's 8-bit value product also runs on the integer tensor cores where the key
    product does at G = 4 or 8 (:data:`VIMMA_GPU_CHECKED`, or ``CKVP_MMA_VIMMA=1`` / ``0``). Raises nothing."""
    return _switch("CKVP_MMA_VIMMA", VIMMA_GPU_CHECKED)


def page_scan() -> bool:
    """Whether the unit-major kernel leaves tiles from a split's first unmapped page to its masked loop instead of
    zeroing per slot (:data:`PAGE_SCAN_GPU_CHECKED`, or ``CKVP_MMA_PAGE_SCAN=1`` / ``0``). Raises nothing."""
    return _switch("CKVP_MMA_PAGE_SCAN", PAGE_SCAN_GPU_CHECKED)


RK = gl.constexpr(MMA_RANK)
RV = gl.constexpr(MMA_RANK)
ROWS = gl.constexpr(16)  # tensor-core rows: 8 for the query heads (hi), 8 for their remainders (lo)

# cp.async of a pointer tensor into shared memory: Gluon's ``async_load`` (Triton 3.9; 3.6 names it
# ``async_copy_global_to_shared``, which 3.9 keeps as a stub that raises)
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

# a CTA barrier: Gluon's ``barrier`` (Triton 3.9; 3.6 names it ``thread_barrier``)
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

# One 32-bit word of 8 int4 codes -> four fp16x2 registers, centred: op j = (s, h) reads bits 4h (half e = 0) and
# 16 + 4h (e = 1) of ``word >> 8s``; h = 1 carries 16 * code (1024 + 16 code - (1024 + 128)). Outputs: 2j + e.
_DEQ_ASM = gl.constexpr("""
{
.reg .b32 t0, t1, t2, t3, w8, b0, b1;
mov.b32 b0, 0x64086408;
mov.b32 b1, 0x64806480;
lop3.b32 t0, $8, 0x000f000f, 0x64006400, 0xea;
lop3.b32 t1, $8, 0x00f000f0, 0x64006400, 0xea;
shr.u32 w8, $8, 8;
lop3.b32 t2, w8, 0x000f000f, 0x64006400, 0xea;
lop3.b32 t3, w8, 0x00f000f0, 0x64006400, 0xea;
sub.f16x2 t0, t0, b0;
sub.f16x2 t1, t1, b1;
sub.f16x2 t2, t2, b0;
sub.f16x2 t3, t3, b1;
mov.b32 {$0, $1}, t0;
mov.b32 {$2, $3}, t1;
mov.b32 {$4, $5}, t2;
mov.b32 {$6, $7}, t3;
}
""")


def key_coordinate(k: int) -> int:
    """The latent key coordinate (0..31) that mma coordinate ``k = 16s + 8h + 2q + e`` of a slot holds: nibble
    ``4e + 2s + h`` of code word ``q``, i.e. coordinate ``8q + 4e + 2s + h``. Raises nothing. Source: the PTX ISA's
    ``mma.m16n8k16`` B-fragment layout (thread ``4c + q`` holds k = 2q, 2q + 1, 2q + 8, 2q + 9 of column c) and
    the bit positions ``_DEQ_ASM`` reads."""
    s, h, q, e = k // 16, (k // 8) % 2, (k // 2) % 4, k % 2
    return 8 * q + 4 * e + 2 * s + h


def value_coordinate(j: int) -> int:
    """The latent value coordinate (0..31) that output column ``j = g + 8i`` holds: nibble ``i`` of half-word ``g``,
    i.e. coordinate ``4g + i``. Raises nothing. Source: the PTX ISA's ``mma.m16n8k16`` B-fragment layout of the
    value product (threads ``4n .. 4n + 3`` hold column n of an n8 tile) and the bit positions ``_DEQ_ASM`` reads."""
    return 4 * (j % 8) + j // 8


@gluon.jit
def _dequant8(w):
    """The 8 codes of each int32 word of ``w``, centred (``code - 8``, times 16 for the h = 1 nibbles), as fp16:
    shape ``w.shape + (2, 2, 2)``, dims (e, h, s)."""
    d = gl.inline_asm_elementwise(_DEQ_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r", [w], dtype=(gl.float16,) * 8,
                                  is_pure=True, pack=1)
    return gl.join(gl.join(gl.join(d[0], d[1]), gl.join(d[2], d[3])),
                   gl.join(gl.join(d[4], d[5]), gl.join(d[6], d[7])))


@gluon.jit
def _pair_words(lo, hi):
    """One int32 word from two int16 half-words (``lo`` in bits 0..15): the value operand's slot pair."""
    return gl.inline_asm_elementwise("mov.b32 $0, {$1, $2};", "=r,h,h", [lo, hi], dtype=gl.int32, is_pure=True,
                                     pack=1)


@gluon.jit
def _keep_if(pe, r, k):
    """``pe`` (fp16) where ``r == k`` else 0, as a product with a 0 / 1 fp16 mask (no byte permutes)."""
    return pe * gl.where(r == k, 1.0, 0.0).to(gl.float16)


@gluon.jit
def _group_tiles(pe, GROUPS: gl.constexpr, G: gl.constexpr, NT: gl.constexpr):
    """(8 rows, NT, 8) weights -> (8, NT * GROUPS * 8): row r's weights at its own group's slots, 0 elsewhere."""
    r = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, pe.type.layout)))[:, None, None] // G
    if GROUPS == 1:
        out = pe
    elif GROUPS == 2:
        x = gl.join(_keep_if(pe, r, 0), _keep_if(pe, r, 1))  # (8, NT, 8, grp)
        out = gl.permute(x, [0, 1, 3, 2])
    else:
        x = gl.join(gl.join(_keep_if(pe, r, 0), _keep_if(pe, r, 1)),
                    gl.join(_keep_if(pe, r, 2), _keep_if(pe, r, 3)))  # (8, NT, 8, i0, i1)
        out = gl.permute(x, [0, 1, 4, 3, 2])
    return gl.reshape(out, [8, NT * GROUPS * 8])


@gluon.jit
def _group_pairs(p, GROUPS: gl.constexpr, G: gl.constexpr, NT: gl.constexpr):
    """(8 rows, 8 NT) weights in the scores' layout (column ``8j + c``) -> (8, 64) in the value product's k order of
    ``VPAIR``: k = ``16 (grp NT / 2 + m) + 8h + 2q + e`` holds column ``8(2m + e) + 2q + h`` of row r where r's group
    is grp, else 0. A thread's k pair (e = 0, 1) is then one score column of two adjacent column tiles, which read
    adjacent slots (``8c + grp NT + j``), so the value operand's pair comes from one word of a code column."""
    pe = gl.permute(gl.reshape(p, [8, NT // 2, 2, 4, 2]), [0, 1, 4, 3, 2])  # (r, m, h, q, e)
    L5: gl.constexpr = pe.type.layout
    r = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, L5)))))
    r = r[:, None, None, None, None] // G
    if GROUPS == 1:
        out = pe
    elif GROUPS == 2:
        out = gl.permute(gl.join(_keep_if(pe, r, 0), _keep_if(pe, r, 1)), [0, 5, 1, 2, 3, 4])
    else:
        x = gl.join(gl.join(_keep_if(pe, r, 0), _keep_if(pe, r, 1)),
                    gl.join(_keep_if(pe, r, 2), _keep_if(pe, r, 3)))  # (r, m, h, q, e, i0, i1): grp = 2 i1 + i0
        out = gl.permute(x, [0, 6, 5, 1, 2, 3, 4])
    return gl.reshape(out, [8, 64])


@gluon.jit
def _pow2(e):
    """fp32 2^e for int32 ``e`` in [-126, 127], exact."""
    return ((e + 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _exponent(x):
    """int32 ``floor(log2(x))`` of fp32 ``x >= 0`` (normal x), 0 for x == 0, clamped to [-112, 112]."""
    e = ((x.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127
    return gl.where(x > 0, gl.minimum(gl.maximum(e, -112), 112), 0)


@gluon.jit
def _is_exact(tok, slots_ptr, n_exact):
    """Which slots ``tok`` (any layout) hold an exact token (``slots`` (n_exact,), -1 unused): they come from
    new_k / new_v in the merge, not from the latent."""
    hit = tok < 0
    for j in range(0, n_exact):
        hit = hit | (tok == gl.load(slots_ptr + j))
    return hit


@gluon.jit
def _tile_base(t0, b, pt_ptr, stride_ptb, stride_lkb, stride_lks, stride_lvb, stride_lvs, PAGE: gl.constexpr):
    """Where the tile whose first slot is ``t0`` starts, in 4-byte words of the key and value latents (int64), and
    its page (-1: unmapped, read from page 0 and scored as zero rows; the batch index without a page table). PAGE >
    0 needs PAGE % BT == 0: one page per tile."""
    if PAGE > 0:
        idx = gl.load(pt_ptr + b.to(gl.int64) * stride_ptb + t0 // PAGE).to(gl.int64)
        row0 = (t0 % PAGE).to(gl.int64)
        at = gl.maximum(idx, 0)
    else:
        idx = b.to(gl.int64)
        row0 = t0.to(gl.int64)
        at = idx
    return at * stride_lkb + row0 * stride_lks, at * stride_lvb + row0 * stride_lvs, idx


@gluon.jit
def _load_tile(lk_w, lk_h, lv_h, kbase, vbase, koff, sk_off, sv_off, vlo_off, k_scale, k_min, v_scale, v_min, v_hi,
               sok, MASKED: gl.constexpr):
    """One row-major tile's raw registers: key code words, key scale / min and value scale / min (fp16, one per
    (row, slot) of the scores' layout), value half-words of the even and odd slot of each pair. Offsets: per element
    from the tile's first row (``koff`` in words, ``sk_off`` / ``sv_off`` / ``vlo_off`` in 16-bit units) plus the
    scalar field bases. The codes are always loaded (any bits are finite codes; the caller keeps every row in
    bounds); MASKED: the scales and mins only where ``sok`` holds, else 0 (rows past the context may hold anything).
    (Loading each field once per slot and handing it round the lanes with shuffles, or the value words once per
    row, took fewer registers but ran 5-15% slower on the H200: benchmarks/results/2026-12-04-unit-major-h200.)"""
    kh = lk_h + kbase * 2
    vh = lv_h + vbase * 2
    vw = vh.to(gl.pointer_type(gl.int16))
    wk = gl.load(lk_w + kbase + koff)
    if MASKED:
        ks = gl.load(kh + k_scale + sk_off, mask=sok, other=0.0)
        km = gl.load(kh + k_min + sk_off, mask=sok, other=0.0)
        vs = gl.load(vh + v_scale + sv_off, mask=sok, other=0.0)
        vm = gl.load(vh + v_min + sv_off, mask=sok, other=0.0)
    else:
        ks = gl.load(kh + k_scale + sk_off)
        km = gl.load(kh + k_min + sk_off)
        vs = gl.load(vh + v_scale + sv_off)
        vm = gl.load(vh + v_min + sv_off)
    vlo = gl.load(vw + vlo_off)
    vhi = gl.load(vw + v_hi + vlo_off)
    return wk, ks, km, vs, vm, vlo, vhi


@gluon.jit
def _tile_step(wk, ks16, km16, vs16, vm16, vlo, vhi, ok_s, ca, sumc, sumc8, k_unit, ve, m_i, l_q, n_q, acc,
               L: gl.constexpr, AL: gl.constexpr, BL: gl.constexpr, LS: gl.constexpr, KS: gl.constexpr,
               BT: gl.constexpr, NT: gl.constexpr, G: gl.constexpr, GROUPS: gl.constexpr, PLO: gl.constexpr,
               MASKED: gl.constexpr):
    """One row-major tile: the operands from the loaded registers, then :func:`_online_step`."""
    x = _dequant8(wk)  # (4, GROUPS, NT, 8, e, h, s)
    x = gl.reshape(gl.permute(x, [1, 6, 5, 0, 4, 2, 3]), [KS, 8 * NT])
    kb = gl.convert_layout(x, BL)
    y = _dequant8(_pair_words(vlo, vhi))  # (BT/2, 8, e, i_lo, i_hi)
    vb = gl.convert_layout(gl.reshape(gl.permute(y, [0, 2, 4, 3, 1]), [BT, RV]), BL)
    return _online_step(kb, vb, ks16.to(gl.float32), km16.to(gl.float32), vs16.to(gl.float32),
                        vm16.to(gl.float32), ok_s, ok_s, ca, sumc, sumc8, k_unit, ve, m_i, l_q, n_q, acc, L, AL, LS,
                        BT, NT, G, GROUPS, PLO, MASKED, False)


@gluon.jit
def _online_step(kb, vb, ksf, kmf, vsf, vmf, ok_s, sok, ca, sumc, sumc8, k_unit, ve, m_i, l_q, n_q, acc,
                 L: gl.constexpr, AL: gl.constexpr, LS: gl.constexpr, BT: gl.constexpr, NT: gl.constexpr,
                 G: gl.constexpr, GROUPS: gl.constexpr, PLO: gl.constexpr, MASKED: gl.constexpr, ZERO: gl.constexpr,
                 CENTER: gl.constexpr = 8.0, VPAIR: gl.constexpr = False, IMMA: gl.constexpr = False):
    """One tile: the scores on the tensor cores, the online softmax (base 2), the value product. kb / vb: the key
    and value B operands (centred codes, fp16); ksf .. vmf: the per-slot scale / min fields (8, 8 NT) fp32 in the
    scores' layout LS. l_q / n_q: (8 rows, 4 lanes) per-lane partial sums of the weights and of weight x the
    value's centred min; ``ve``: the exponent of the power of two the weights carry (chosen per tile; the
    accumulator is rescaled exactly). MASKED: slots outside ``ok_s`` score -inf; ZERO: the fields of slots outside
    ``sok`` read as 0 (rows past the context, unmapped pages: their bytes may be anything). CENTER: what the
    value codes had subtracted (8 for 4-bit codes, 128 for 8-bit; the caller's ``sumc8`` carries the key codes'
    own). VPAIR: the value product's k order of :func:`_group_pairs` (``vb`` built to match, :func:`_unit_step`).
    IMMA: ``kb`` is already the raw scores (8, 8 NT) fp32 in LS (:func:`_imma_scores`), ``ca`` unused."""
    if ZERO:
        ksf = gl.where(sok, ksf, 0.0)
        kmf = gl.where(sok, kmf, 0.0)
        vsf = gl.where(sok, vsf, 0.0)
        vmf = gl.where(sok, vmf, 0.0)
    if IMMA:
        s = kb
    else:
        s = mma_v2(ca, kb, gl.zeros([ROWS, 8 * NT], gl.float32, L))
        s = gl.sum(gl.reshape(s, [2, 8, 8 * NT]), axis=0)  # hi + lo, (8, 8 NT) in LS
    s = (s * k_unit + sumc8[:, None]) * ksf + kmf * sumc[:, None]
    if MASKED:
        s = gl.where(ok_s, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    if MASKED:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - m_use[:, None])
    ve_t = 14 - _exponent(gl.max(gl.max(vsf, axis=1), axis=0))
    vcc = vmf + CENTER * vsf  # the value's centred min
    # per-lane partials: columns 8 j + 2 q + e of a row -> (j, q, e); sum over the thread's own j and e
    al_q = gl.convert_layout(alpha, gl.SliceLayout(1, l_q.type.layout))[:, None]
    l_q = l_q * al_q + gl.convert_layout(gl.sum(gl.sum(gl.reshape(p, [8, NT, 4, 2]), axis=3), axis=1),
                                         l_q.type.layout)
    n_q = n_q * al_q + gl.convert_layout(
        gl.sum(gl.sum(gl.reshape(p * vcc, [8, NT, 4, 2]), axis=3), axis=1), n_q.type.layout)
    acc3 = gl.reshape(acc, [2, 8, RV])
    al3 = gl.convert_layout(alpha * _pow2(ve_t - ve), gl.SliceLayout(0, gl.SliceLayout(2, acc3.type.layout)))
    acc = gl.convert_layout(gl.reshape(acc3 * al3[None, :, None], [ROWS, RV]), L)
    pw = p * (vsf * _pow2(ve_t))
    p_hi = pw.to(gl.float16)
    if PLO:
        p_lo = (pw - p_hi.to(gl.float32)).to(gl.float16)
    else:
        p_lo = gl.zeros([8, 8 * NT], gl.float16, LS)
    if VPAIR:
        ph = _group_pairs(p_hi, GROUPS, G, NT)
        pl = _group_pairs(p_lo, GROUPS, G, NT)
    else:
        ph = _group_tiles(gl.reshape(p_hi, [8, NT, 8]), GROUPS, G, NT)
        pl = _group_tiles(gl.reshape(p_lo, [8, NT, 8]), GROUPS, G, NT)
    pa = gl.convert_layout(gl.reshape(gl.permute(gl.join(ph, pl), [2, 0, 1]), [ROWS, BT]), AL)
    return m_new, l_q, n_q, mma_v2(pa, vb, acc), ve_t


@gluon.jit
def _query_operand(q_row, G: gl.constexpr, GROUPS: gl.constexpr, KS: gl.constexpr, AL: gl.constexpr,
                   UNIT: gl.constexpr, BITS: gl.constexpr = 4):
    """The folded query as the scores' A operand: (16, KS) fp16 in AL, block-diagonal over the slot groups (row r =
    (hi / lo, group, g), column (group, k)), and the power of two it was scaled by (fp32). Column k reads latent
    coordinate ``8q + 4e + 2s + h`` for ``k = 16s + 8h + 2q + e`` (row-major codes; divided by 16 where h = 1) or
    k itself (UNIT, unit-major codes; divided by 16 where k is odd at BITS 4, the nibbles that carry 16 * code;
    not divided at BITS 8, one byte a code). The
    coefficients are split into fp16 hi (rows 0..7) + lo (rows 8..15) after scaling the largest to [2^13, 2^14).
    ``q_row``: the (G, 32) fp32 folded query of this (sequence, token, KV head)."""
    ra = gl.arange(0, ROWS, layout=gl.SliceLayout(1, AL))
    ka = gl.arange(0, KS, layout=gl.SliceLayout(0, AL))
    kk = ka % RK
    if UNIT:
        coord = kk
        if BITS == 8:
            x16 = kk * 0
        else:
            x16 = kk % 2
    else:
        x16 = (kk // 8) % 2
        coord = 8 * ((kk // 2) % 4) + 4 * (kk % 2) + 2 * (kk // 16) + x16
    r8 = ra % 8
    cf = gl.load(q_row + ((r8 % G) * RK)[:, None] + coord[None, :])
    cf = gl.where((r8 // G)[:, None] == (ka // RK)[None, :], cf * gl.where(x16 == 1, 0.0625, 1.0)[None, :], 0.0)
    return _hi_lo_operand(cf, AL)


@gluon.jit
def _hi_lo_operand(cf, AL: gl.constexpr):
    """(16, KS) fp32 coefficients in AL (rows 8..15 a copy of rows 0..7) -> the fp16 operand (rows 0..7 hi, 8..15
    the remainder lo) after scaling the largest to [2^13, 2^14), and that power of two's inverse (fp32)."""
    amax = gl.max(gl.max(gl.abs(cf), axis=1), axis=0)
    e_q = gl.where(amax > 0, ((amax.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127 - 13, 0)
    e_q = gl.minimum(gl.maximum(e_q, -126), 114)  # the largest coefficient to [2^13, 2^14): fp16, full precision
    cf = cf * _pow2(-e_q)
    c_hi = cf.to(gl.float16)
    c_lo = (cf - c_hi.to(gl.float32)).to(gl.float16)
    ra = gl.arange(0, ROWS, layout=gl.SliceLayout(1, AL))
    return gl.where((ra < 8)[:, None], c_hi, c_lo), _pow2(e_q)


@gluon.jit
def _query_sums(q_row, G: gl.constexpr, LS: gl.constexpr):
    """sum(c) per scores' row (its query head g = r % G): (8,) fp32 in LS's row layout."""
    QL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[1, 32], warps_per_cta=[1, 1],
                                        order=[1, 0])
    rq = gl.arange(0, 8, layout=gl.SliceLayout(1, QL))
    cq = gl.arange(0, RK, layout=gl.SliceLayout(0, QL))
    return gl.convert_layout(gl.sum(gl.load(q_row + ((rq % G) * RK)[:, None] + cq[None, :]), axis=1),
                             gl.SliceLayout(1, LS))


@gluon.jit
def _split_tiles(c, tiles_per_split, kv_len, slots_ptr, n_exact, BT: gl.constexpr):
    """Split c's tiles of BT slots: ``(t_start, t_end, fast_end)``; tiles before fast_end lie wholly below kv_len and
    below the first exact slot (``slots`` (n_exact,), -1 unused) and run unmasked."""
    lo_exact = kv_len + gl.program_id(0) * 0
    for j in range(0, n_exact):
        sl = gl.load(slots_ptr + j).to(gl.int32)
        lo_exact = gl.where(sl >= 0, gl.minimum(lo_exact, sl), lo_exact)
    n_tiles = (kv_len + BT - 1) // BT
    t_start = c * tiles_per_split
    t_end = gl.minimum(t_start + tiles_per_split, n_tiles)
    return t_start, t_end, gl.maximum(gl.minimum(t_end, gl.minimum(kv_len, lo_exact) // BT), t_start)


@gluon.jit
def _mapped_end(t_start, fast_end, b, pt_ptr, stride_ptb, PAGE: gl.constexpr):
    """The first 64-slot tile in ``[t_start, fast_end)`` whose page is unmapped (-1) in sequence b's page table, else
    ``fast_end``: 128 tiles' entries a vector load."""
    SL: gl.constexpr = gl.BlockedLayout(size_per_thread=[4], threads_per_warp=[32], warps_per_cta=[1], order=[0])
    end = fast_end
    for c0 in range(t_start, fast_end, 128):
        tt = c0 + gl.arange(0, 128, layout=SL)
        ok = tt < fast_end
        idx = gl.load(pt_ptr + b.to(gl.int64) * stride_ptb + tt // (PAGE // 64), mask=ok, other=0)
        end = gl.minimum(end, gl.min(gl.where(ok & (idx < 0), tt, fast_end), axis=0))
    return end


@gluon.jit
def _mma_attention_kernel(
    qf_ptr, lk_ptr, lv_ptr, slots_ptr, kmeta_ptr, vmeta_ptr, m_ptr, l_ptr, acc_ptr, pt_ptr, stride_ptb,
    Hkv, S, n_exact, kv_len, s_max, tiles_per_split, n_split,
    k_scale_base, k_min_base, v_scale_base, v_min_base,
    stride_lkb, stride_lvb,
    G: gl.constexpr, NT: gl.constexpr, RV_PAD: gl.constexpr, PAGE: gl.constexpr, PLO: gl.constexpr,
    ROW_K: gl.constexpr, ROW_V: gl.constexpr,
):
    """One context split of one (KV head, sequence, query token). Grid (Hkv, n_split, B * S); num_warps 1.

    Shapes: qf (B, S, Hkv, G, 32) fp32 from ``latent_attention_absorbed._fold_query_kernel`` (log2 units); latent_k
    / latent_v (B, S_max, W) uint8 rows of the ``int4`` format, one quantization block of 32 coordinates per head
    (PAGE > 0: page pools (N_pages + 1, PAGE, W) and the (B, S_max / PAGE) page table ``pt``, PAGE a multiple of
    the tile); ROW_K / ROW_V the rows' strides in 4-byte words (compile-time: the element offsets of a tile become
    immediates), stride_lkb / stride_lvb the sequences' (pages') strides in words, scale / min bases in fp16 units;
    kmeta / vmeta (Hkv, 3) int32 (first code byte, first block, rank); slots (n_exact,) exact tokens' slots (-1
    unused), skipped here. Stores m, l (rows, n_split, G) and acc (rows, n_split, G, RV_PAD) fp32 (rows =
    B*Hkv*S; the slot groups of a split merged, log2 units, the value latent unnormalised, in the latent's
    coordinate order): the workspace of ``latent_attention_triton``'s merge kernels. RV_PAD must be 32."""
    GROUPS: gl.constexpr = 8 // G
    KS: gl.constexpr = RK * GROUPS
    BT: gl.constexpr = 8 * NT * GROUPS
    h = gl.program_id(0)
    c = gl.program_id(1)
    bs = gl.program_id(2)
    b = bs // S
    s_q = bs % S
    L: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L, k_width=2)
    BL: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=L, k_width=2)
    # key words (q, group, n8 tile, slot c): lane = q + 4 c
    WL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 1], threads_per_warp=[4, 1, 1, 8],
                                        warps_per_cta=[1, 1, 1, 1], order=[0, 3, 2, 1])
    # value half-word pairs (pair, g): lane = p % 4 + 4 g, the lane of pair p's column g in the value product
    VL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[4, 8], warps_per_cta=[1, 1],
                                        order=[0, 1])

    lk_w = lk_ptr.to(gl.pointer_type(gl.int32))
    lk_h = lk_ptr.to(gl.pointer_type(gl.float16))
    lv_h = lv_ptr.to(gl.pointer_type(gl.float16))
    k_col = gl.load(kmeta_ptr + 3 * h) // 4
    k_blk = gl.load(kmeta_ptr + 3 * h + 1)
    v_col = gl.load(vmeta_ptr + 3 * h) // 2  # in half-words
    v_blk = gl.load(vmeta_ptr + 3 * h + 1)

    q_row = qf_ptr + (((b * S + s_q) * Hkv + h) * G).to(gl.int64) * RK
    ca, k_unit = _query_operand(q_row, G, GROUPS, KS, AL, False)

    zero_s = gl.zeros([ROWS, 8 * NT], gl.float32, L)
    LS: gl.constexpr = gl.sum(gl.reshape(zero_s, [2, 8, 8 * NT]), axis=0).type.layout
    zero_s0 = gl.zeros([8, 8 * NT], gl.float32, LS)
    rows = gl.arange(0, 8, layout=gl.SliceLayout(1, LS))
    cols = gl.arange(0, 8 * NT, layout=gl.SliceLayout(0, LS))
    sumc = _query_sums(q_row, G, LS)
    sumc8 = sumc * 8.0

    # ---- per-program offsets of each loaded element from the tile's first row, and its slot within the tile.
    # The scores' (row, col) read slot 8 GROUPS j + 8 grp + c (j = col // 8, c = col % 8, grp = row // G)
    tok_s = (cols // 8)[None, :] * (8 * GROUPS) + (rows // G)[:, None] * 8 + (cols % 8)[None, :]
    qw = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, WL))))
    gw = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, WL))))
    jw = gl.arange(0, NT, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, WL))))
    cw = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, WL))))
    tok_k = gw[None, :, None, None] * 8 + jw[None, None, :, None] * (8 * GROUPS) + cw[None, None, None, :]
    koff = tok_k * ROW_K + k_col + qw[:, None, None, None]
    sk_off = tok_s * (2 * ROW_K)
    sv_off = tok_s * (2 * ROW_V)
    k_scale = k_scale_base + k_blk
    k_min = k_min_base + k_blk
    v_scale = v_scale_base + v_blk
    v_min = v_min_base + v_blk
    v_hi = 2 * ROW_V
    pv = gl.arange(0, BT // 2, layout=gl.SliceLayout(1, VL))
    gv = gl.arange(0, 8, layout=gl.SliceLayout(0, VL))
    vlo_off = (2 * pv)[:, None] * (2 * ROW_V) + (v_col + gv)[None, :]

    m_i = gl.full([8], -float("inf"), gl.float32, gl.SliceLayout(1, LS))
    LQ: gl.constexpr = gl.sum(gl.sum(gl.reshape(zero_s0, [8, NT, 4, 2]), axis=3), axis=1).type.layout
    l_q = gl.zeros([8, 4], gl.float32, LQ)
    n_q = gl.zeros([8, 4], gl.float32, LQ)
    acc = gl.zeros([ROWS, RV], gl.float32, L)
    ve = 14 + gl.program_id(0) * 0  # int32 exponent of the weights' factor

    # ---- this split's tiles: unmasked while the whole tile lies below kv_len and the first exact slot
    t_start, t_end, fast_end = _split_tiles(c, tiles_per_split, kv_len, slots_ptr, n_exact, BT)
    all_s = tok_s >= 0
    if fast_end > t_start:
        kb0, vb0, idx0 = _tile_base(t_start * BT, b, pt_ptr, stride_ptb, stride_lkb, ROW_K, stride_lvb, ROW_V, PAGE)
        tile_a = _load_tile(lk_w, lk_h, lv_h, kb0, vb0, koff, sk_off, sv_off, vlo_off, k_scale, k_min, v_scale,
                            v_min, v_hi, all_s & (idx0 >= 0), PAGE > 0)
        for t in range(t_start, fast_end):
            wk, ks16, km16, vs16, vm16, vlo, vhi = tile_a
            kb1, vb1, idx1 = _tile_base(gl.minimum(t + 1, fast_end - 1) * BT, b, pt_ptr, stride_ptb, stride_lkb,
                                        ROW_K, stride_lvb, ROW_V, PAGE)
            tile_a = _load_tile(lk_w, lk_h, lv_h, kb1, vb1, koff, sk_off, sv_off, vlo_off, k_scale, k_min,
                                v_scale, v_min, v_hi, all_s & (idx1 >= 0), PAGE > 0)
            m_i, l_q, n_q, acc, ve = _tile_step(wk, ks16, km16, vs16, vm16, vlo, vhi, all_s, ca, sumc, sumc8,
                                                k_unit, ve, m_i, l_q, n_q, acc, L, AL, BL, LS, KS, BT, NT, G,
                                                GROUPS, PLO, False)
    # ---- the rest, masked per slot: past kv_len, exact slots, unmapped pages (zero rows: scales 0, scored). A
    # static cache's last tile starts early enough to stay inside its S_max rows, its slots before t0 masked
    for t in range(fast_end, t_end):
        t0 = t * BT
        if PAGE > 0:
            r0 = t0
        else:
            r0 = gl.minimum(t0, s_max - BT)
        kb1, vb1, idx1 = _tile_base(r0, b, pt_ptr, stride_ptb, stride_lkb, ROW_K, stride_lvb, ROW_V, PAGE)
        gs = r0 + tok_s
        ok_s = (gs >= t0) & (gs < kv_len) & ~_is_exact(gs, slots_ptr, n_exact)
        wk, ks16, km16, vs16, vm16, vlo, vhi = _load_tile(lk_w, lk_h, lv_h, kb1, vb1, koff, sk_off, sv_off, vlo_off,
                                                          k_scale, k_min, v_scale, v_min, v_hi, ok_s & (idx1 >= 0),
                                                          True)
        m_i, l_q, n_q, acc, ve = _tile_step(wk, ks16, km16, vs16, vm16, vlo, vhi, ok_s, ca, sumc, sumc8, k_unit,
                                            ve, m_i, l_q, n_q, acc, L, AL, BL, LS, KS, BT, NT, G, GROUPS, PLO, True)

    _store_split(acc, n_q, l_q, m_i, ve, acc_ptr, m_ptr, l_ptr, b, h, s_q, c, Hkv, S, n_split, LS, RV_PAD, False, G,
                 GROUPS)


@gluon.jit
def _store_split(acc, n_q, l_q, m_i, ve, acc_ptr, m_ptr, l_ptr, b, h, s_q, c, Hkv, S, n_split,
                 LS: gl.constexpr, RV_PAD: gl.constexpr, UNIT: gl.constexpr, G: gl.constexpr, GROUPS: gl.constexpr,
                 BITS: gl.constexpr = 4, VIMMA: gl.constexpr = False):
    """Store the split's value latent (unnormalised), in the latent's coordinate order, and m, l per query head,
    at split ``c`` of ``n_split`` (rows ``((b Hkv + h) S + s_q) n_split + c``, G heads each). The slot groups' rows
    (8 = GROUPS x G) are merged first (the max of their m; l and the value latent rescaled to it, FlashDecoding's
    merge), so the merge kernel reads one split per program. Output column ``8i + n`` holds coordinate ``4n + i``
    (row-major pass) or ``2(n + 8 (i // 2)) + i % 2`` (unit-major; odd i carry 16 * (code - 8)) or ``8i + n``
    (unit-major at BITS 8: column j is coordinate j); the weights carried vscale * 2^ve. VIMMA: ``acc`` is already
    the (8, RV) value latent in its true scale (:func:`_vimma_step`)."""
    if VIMMA:
        o = acc
    else:
        o = gl.sum(gl.reshape(acc, [2, 8, RV]), axis=0)
    LO: gl.constexpr = o.type.layout
    jo = gl.arange(0, RV, layout=gl.SliceLayout(0, LO))
    if VIMMA:
        colf = gl.where(jo >= 0, 1.0, 1.0)
    elif BITS == 8:
        colf = gl.where(jo >= 0, 1.0, 1.0) * _pow2(-ve)
    else:
        colf = gl.where((jo // 8) % 2 == 1, 0.0625, 1.0) * _pow2(-ve)
    nsum = gl.convert_layout(gl.sum(n_q, axis=1), gl.SliceLayout(1, LO))
    o = o * colf[None, :] + nsum[:, None]
    l8 = gl.convert_layout(gl.sum(l_q, axis=1), gl.SliceLayout(1, LS))
    m3 = gl.reshape(m_i, [GROUPS, G])
    l3 = gl.reshape(l8, [GROUPS, G])
    m_g = gl.max(m3, axis=0)  # (G,)
    w = gl.exp2(m3 - gl.where(m_g == float("-inf"), 0.0, m_g)[None, :])  # 0 for a group with no slot
    l_g = gl.sum(l3 * w, axis=0)
    o3 = gl.reshape(o, [GROUPS, G, RV])
    w3 = gl.convert_layout(w, gl.SliceLayout(2, o3.type.layout))
    o_g = gl.sum(o3 * w3[:, :, None], axis=0)  # (G, RV)
    LG: gl.constexpr = o_g.type.layout
    hg = gl.arange(0, G, layout=gl.SliceLayout(1, LG))
    jg = gl.arange(0, RV, layout=gl.SliceLayout(0, LG))
    if UNIT and BITS == 8:
        vcoord = jg
    elif UNIT:
        vcoord = 2 * (jg % 8 + 8 * (jg // 16)) + (jg // 8) % 2
    else:
        vcoord = 4 * (jg % 8) + jg // 8
    base = (((b * Hkv + h) * S + s_q) * n_split + c).to(gl.int64) * G
    gl.store(acc_ptr + (base + hg)[:, None] * RV_PAD + vcoord[None, :], o_g)
    gm = gl.arange(0, G, layout=m_g.type.layout)
    gl.store(m_ptr + base + gm, m_g)
    gl.store(l_ptr + base + gl.arange(0, G, layout=l_g.type.layout), l_g)


# ---- unit-major latents: each byte column of a latent contiguous over the slots of a sequence (of a page)

# One 32-bit word of a unit-major code column (bytes t = 0..3: slots s0 + t; low nibble coordinate 2i, high nibble
# 2i + 1) -> for each slot t one fp16 pair (code_lo - 8, 16 * (code_hi - 8)): prmt copies byte t into bytes 0 and 2,
# lop3 keeps bits 0..3 and 20..23 under 0x6400, sub.f16x2 centres. Outputs: 2t + e.
_DEQ_COLUMN_ASM = gl.constexpr(
    "\n{\n.reg .b32 x0, x1, x2, x3, b;\nmov.b32 b, 0x64806408;\n"
    + "".join(f"prmt.b32 x{t}, $8, $8, 0x0{t}0{t};\n" for t in range(4))
    + "".join(f"lop3.b32 x{t}, x{t}, 0x00f0000f, 0x64006400, 0xea;\n" for t in range(4))
    + "".join(f"sub.f16x2 x{t}, x{t}, b;\n" for t in range(4))
    + "".join(f"mov.b32 {{${2 * t}, ${2 * t + 1}}}, x{t};\n" for t in range(4))
    + "}\n")

# Two words of one unit-major code column (a: slots s0 .. s0+3, b: slots s1 .. s1+3) -> for each byte t the slot
# pair (s0 + t, s1 + t) as fp16x2, for the low nibble (code - 8) and the high nibble (16 * (code - 8)): prmt puts
# byte t of a and of b into bytes 0 and 2. Outputs: 4t + 2e + (0: slot of a, 1: slot of b).
_DEQ_PAIRS_ASM = gl.constexpr(
    "\n{\n.reg .b32 x, y, b0, b1;\nmov.b32 b0, 0x64086408;\nmov.b32 b1, 0x64806480;\n"
    + "".join(f"prmt.b32 x, $16, $17, 0x0{4 + t}0{t};\n"
              + "".join(f"lop3.b32 y, x, {mask}, 0x64006400, 0xea;\nsub.f16x2 y, y, b{e};\n"
                        f"mov.b32 {{${4 * t + 2 * e}, ${4 * t + 2 * e + 1}}}, y;\n"
                        for e, mask in enumerate(("0x000f000f", "0x00f000f0")))
              for t in range(4))
    + "}\n")

# 8-bit codes: two words of unit-major code columns (a, b: bytes t = 0..3, one slot each) -> for each t the fp16 pair
# (a_t - 128, b_t - 128): prmt puts byte t of a and of b into bytes 0 and 2, lop3 keeps them under 0x6400 (1024 +
# code, exact in fp16), sub.f16x2 centres. Keys: a and b are the columns of coordinates 2q + 8b and 2q + 8b + 1 (one
# slot's k pair); values: one coordinate's column at two slot words (the k pair of slots). Outputs: 2t + (0: a, 1: b).
_DEQ_BYTES_ASM = gl.constexpr(
    "\n{\n.reg .b32 x, b;\nmov.b32 b, 0x64806480;\n"
    + "".join(f"prmt.b32 x, $8, $9, 0x0{4 + t}0{t};\nlop3.b32 x, x, 0x00ff00ff, 0x64006400, 0xea;\n"
              f"sub.f16x2 x, x, b;\nmov.b32 {{${2 * t}, ${2 * t + 1}}}, x;\n" for t in range(4))
    + "}\n")


# 8-bit values, slot pairs within one word (``VPAIR``): one unit-major word (bytes t = 0..3: four slots of one
# coordinate) -> fp16 byte t - 128: a prmt with 0x64 bytes makes two fp16 1024 + code at once, one sub.f16x2 centres
# them (2 instructions a pair of codes, 3 from two words). Outputs: t.
_DEQ_QUAD_ASM = gl.constexpr(
    "\n{\n.reg .b32 c, b, x, y;\nmov.b32 c, 0x64646464;\nmov.b32 b, 0x64806480;\n"
    "prmt.b32 x, $4, c, 0x5140;\nprmt.b32 y, $4, c, 0x5342;\nsub.f16x2 x, x, b;\nsub.f16x2 y, y, b;\n"
    "mov.b32 {$0, $1}, x;\nmov.b32 {$2, $3}, y;\n}\n")

# 4 x 4 byte transpose (IMMA): words a, b, c, d ($4 .. $7; bytes t = 0..3, four slots of one coordinate each) ->
# word t ($t) = (a_t, b_t, c_t, d_t), the four coordinates of slot t. Eight prmt: pairs interleaved, then halves.
_T4_ASM = gl.constexpr(
    "\n{\n.reg .b32 x0, x1, x2, x3;\n"
    "prmt.b32 x0, $4, $5, 0x5140;\nprmt.b32 x1, $4, $5, 0x7362;\n"
    "prmt.b32 x2, $6, $7, 0x5140;\nprmt.b32 x3, $6, $7, 0x7362;\n"
    "prmt.b32 $0, x0, x2, 0x5410;\nprmt.b32 $1, x0, x2, 0x7632;\n"
    "prmt.b32 $2, x1, x3, 0x5410;\nprmt.b32 $3, x1, x3, 0x7632;\n}\n")


# Four fp32-rounded integer weights w0..w3 ($2 .. $5, 0 <= w <= 32512) -> the s8 A fragment words of one k-quad:
# $0 their low bytes (w & 255 read as s8 is w - 256 hi), $1 the low bytes of (w + 128) >> 8 (hi), byte i from w_i.
_PACK_W_ASM = gl.constexpr(
    "\n{\n.reg .b32 a, b, c, d, t0, t1;\n"
    "add.s32 a, $2, 128;\nadd.s32 b, $3, 128;\nadd.s32 c, $4, 128;\nadd.s32 d, $5, 128;\n"
    "prmt.b32 t0, $2, $3, 0x0040;\nprmt.b32 t1, $4, $5, 0x0040;\nprmt.b32 $0, t0, t1, 0x5410;\n"
    "prmt.b32 t0, a, b, 0x0051;\nprmt.b32 t1, c, d, 0x0051;\nprmt.b32 $1, t0, t1, 0x5410;\n}\n")


def _imma_asm(groups: int) -> str:
    """PTX of one n8 column tile's scores on the integer tensor cores over ``groups`` k-steps of 32 coordinates (the
    slot groups of the block-diagonal query), one ``mma.m16n8k32`` (s8 query, u8 codes, s32) each, accumulated:
    outputs $0..$3 (the accumulator fragment: rows 0..7 from the query's high bytes, 8..15 from its low bytes), then
    per k-step the A fragment (4 words) and the B fragment (2 words)."""
    lines = ["{", ".reg .b32 z;", "mov.b32 z, 0;"]
    for g in range(groups):
        a = 4 + 6 * g
        c = "{z, z, z, z}" if g == 0 else "{$0, $1, $2, $3}"
        lines.append(f"mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {{$0, $1, $2, $3}}, "
                     f"{{${a}, ${a + 1}, ${a + 2}, ${a + 3}}}, {{${a + 4}, ${a + 5}}}, {c};")
    return "\n".join(lines + ["}"]) + "\n"


_IMMA_ASM1 = gl.constexpr(_imma_asm(1))
_IMMA_ASM2 = gl.constexpr(_imma_asm(2))
_IMMA_ASM4 = gl.constexpr(_imma_asm(4))
_IMMA_CONSTRAINTS1 = gl.constexpr(",".join(["=r"] * 4 + ["r"] * 6))
_IMMA_CONSTRAINTS2 = gl.constexpr(",".join(["=r"] * 4 + ["r"] * 12))
_IMMA_CONSTRAINTS4 = gl.constexpr(",".join(["=r"] * 4 + ["r"] * 24))


@gluon.jit
def _gdc(op: gl.constexpr):
    """``griddepcontrol.<op>`` (``wait`` or ``launch_dependents``): programmatic dependent launch's two
    instructions (PTX ISA; a no-op in a grid launched without it)."""
    gl.inline_asm_elementwise("griddepcontrol." + op + "; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _prefetch_l2(p):
    """``prefetch.global.L2`` of the line holding each element's address (PTX ISA; no registers held, nothing
    returned): the data is on its way into L2 before the loads that read it are issued."""
    gl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [p], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _bulk_prefetch_l2(pk, nk, pv, nv):
    """``cp.async.bulk.prefetch.L2.global`` of ``nk`` bytes from ``pk`` and ``nv`` from ``pv`` (scalars: 16-byte
    aligned addresses, sizes multiples of 16), issued by lane 0 alone (PTX ISA, sm_90: the bulk copy engine fetches
    the runs into L2; no registers held, nothing returned)."""
    gl.inline_asm_elementwise(
        "{\n.reg .pred p;\n.reg .u32 l;\nmov.u32 l, %laneid;\nsetp.eq.u32 p, l, 0;\n"
        "@p cp.async.bulk.prefetch.L2.global [$1], $2;\n@p cp.async.bulk.prefetch.L2.global [$3], $4;\n}\n// $0",
        "=r,l,r,l,r", [pk, nk, pv, nv], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _prefetch_tile(lk_w, lv_w, kbase, vbase, k_col, v_col, k_fields, v_fields, share, CKW: gl.constexpr,
                   CVW: gl.constexpr, BITS: gl.constexpr):
    """Prefetch one unit-major tile (the words :func:`_unit_load` reads from ``kbase`` / ``vbase``) into L2. In
    64-slot pages (columns of 64 bytes, 16 words) the tile is the whole page, every head's columns: the programs of
    its KV heads share it out, ``share`` = (first byte, bytes) of this program's part of the key page and of the
    value page (:func:`_page_shares`), two bulk prefetches from lane 0. Otherwise this head's code columns' 64-byte
    runs and field byte columns (lane l: code column ``l % (4 * BITS)``, field column ``l % 4``; 4 prefetches a
    lane)."""
    if CKW == 16 and CVW == 16:
        _bulk_prefetch_l2((lk_w + kbase).to(gl.pointer_type(gl.int8)) + share[0], share[1],
                          (lv_w + vbase).to(gl.pointer_type(gl.int8)) + share[2], share[3])
    else:
        PL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[1], order=[0])
        lane = gl.arange(0, 32, layout=PL)
        col = lane % (4 * BITS)
        _prefetch_l2(lk_w + kbase + (k_col + col) * CKW)
        _prefetch_l2(lv_w + vbase + (v_col + col) * CVW)
        f = lane % 4
        _prefetch_l2(lk_w + kbase + (2 * gl.where(f < 2, k_fields[0], k_fields[1]) + f % 2) * CKW)
        _prefetch_l2(lv_w + vbase + (2 * gl.where(f < 2, v_fields[0], v_fields[1]) + f % 2) * CVW)


@gluon.jit
def _page_shares(h, Hkv, stride_lkb, stride_lvb):
    """KV head h's part of a key page and of a value page for :func:`_prefetch_tile` (strides in 4-byte words, pages
    of 64 slots: multiples of 64 bytes): (key first byte, key bytes, value first byte, value bytes), in 16-byte
    multiples, inside the page and never empty (the last parts shorter, or overlapping where a page has fewer
    16-byte runs than heads)."""
    pk = stride_lkb * 4
    pv = stride_lvb * 4
    ck = ((pk + Hkv - 1) // Hkv + 15) // 16 * 16
    cv = ((pv + Hkv - 1) // Hkv + 15) // 16 * 16
    k0 = gl.minimum(h * ck, pk - 16)
    v0 = gl.minimum(h * cv, pv - 16)
    return k0, gl.minimum(ck, pk - k0), v0, gl.minimum(cv, pv - v0)


@gluon.jit
def _join4(a, b, c, d):
    """(..., 4) from four tensors, in argument order."""
    return gl.reshape(gl.join(gl.join(a, c), gl.join(b, d)), a.shape + [4])


@gluon.jit
def _dequant_column(w):
    """:data:`_DEQ_COLUMN_ASM` on each int32 word of ``w``: shape ``w.shape + (4 t, 2 e)`` fp16."""
    d = gl.inline_asm_elementwise(_DEQ_COLUMN_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r", [w], dtype=(gl.float16,) * 8,
                                  is_pure=True, pack=1)
    return gl.join(_join4(d[0], d[2], d[4], d[6]), _join4(d[1], d[3], d[5], d[7]))


@gluon.jit
def _dequant_pairs(a, b):
    """:data:`_DEQ_PAIRS_ASM` on each pair of int32 words of 4-d ``a``, ``b``: shape ``a.shape + (4 t, 2 e, 2 ab)``
    fp16."""
    d = gl.inline_asm_elementwise(_DEQ_PAIRS_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,r,r", [a, b],
                                  dtype=(gl.float16,) * 16, is_pure=True, pack=1)
    t0 = gl.join(gl.join(d[0], d[1]), gl.join(d[2], d[3]))  # (ab, e)
    t1 = gl.join(gl.join(d[4], d[5]), gl.join(d[6], d[7]))
    t2 = gl.join(gl.join(d[8], d[9]), gl.join(d[10], d[11]))
    t3 = gl.join(gl.join(d[12], d[13]), gl.join(d[14], d[15]))
    x = _join4(t0, t1, t2, t3)  # (q, n, m, d, ab, e, t): gl.join stacks along a new last dim
    return gl.permute(x, [0, 1, 2, 3, 6, 5, 4])


@gluon.jit
def _dequant_bytes(a, b):
    """:data:`_DEQ_BYTES_ASM` on each pair of int32 words of ``a``, ``b``: shape ``a.shape + (4 t, 2 ab)`` fp16 (the
    centred 8-bit codes of byte t of a and of b)."""
    d = gl.inline_asm_elementwise(_DEQ_BYTES_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [a, b], dtype=(gl.float16,) * 8,
                                  is_pure=True, pack=1)
    return gl.join(_join4(d[0], d[2], d[4], d[6]), _join4(d[1], d[3], d[5], d[7]))


@gluon.jit
def _dequant_quads(w):
    """:data:`_DEQ_QUAD_ASM` on each int32 word of ``w``: shape ``w.shape + (4 t,)`` fp16 ``byte t - 128``."""
    d = gl.inline_asm_elementwise(_DEQ_QUAD_ASM, "=h,=h,=h,=h,r", [w], dtype=(gl.float16,) * 4, is_pure=True,
                                  pack=1)
    return _join4(d[0], d[1], d[2], d[3])


@gluon.jit
def _fp16_of_bytes(lo, hi, sel):
    """fp16 from byte ``sel`` of ``lo`` (low byte) and of ``hi`` (high byte), per element (sel = t | (4 + t) << 4)."""
    return gl.inline_asm_elementwise("{ .reg .b32 t; .reg .b16 u; prmt.b32 t, $1, $2, $3; mov.b32 {$0, u}, t; }",
                                     "=h,r,r,r", [lo, hi, sel], dtype=gl.float16, is_pure=True, pack=1)


@gluon.jit
def _field_words(w, j: gl.constexpr, NWS: gl.constexpr):
    """The low-byte and high-byte words (8 r, 4 q, 2 e) of a field's words ``w`` (8 r, 4 q, 2 e, NWS, 2 lo / hi)
    that hold column tile j's slots (word j // 4 of two at G = 8)."""
    lo, hi = gl.split(w)
    if NWS == 1:
        lo = gl.reshape(lo, lo.shape[:-1])
        hi = gl.reshape(hi, hi.shape[:-1])
    else:
        lo0, lo1 = gl.split(lo)
        hi0, hi1 = gl.split(hi)
        if j < 4:
            lo = lo0
            hi = hi0
        else:
            lo = lo1
            hi = hi1
    return lo, hi


@gluon.jit
def _unit_field(w, r, j: gl.constexpr, G: gl.constexpr, NT: gl.constexpr, NWS: gl.constexpr):
    """Column tile j's values of one fp16 field from its words ``w`` (8 r, 4 q, 2 e, NWS, 2 lo / hi byte): the slot
    ``16q + 8e + grp NT + j`` sits in word ``(grp NT + j) // 4`` (of the NWS loaded from ``(grp NT) // 4`` on),
    byte ``(grp NT + j) % 4``. Returns (8 r, 4 q, 2 e) fp16."""
    lo, hi = _field_words(w, j, NWS)
    t = ((gl.convert_layout(r, lo.type.layout) // G) * NT + j) % 4
    return _fp16_of_bytes(lo, hi, t | ((4 + t) << 4))


@gluon.jit
def _fp16_pair_of_bytes(lo, hi, sel):
    """Two fp16 from one ``prmt``: bytes ``sel`` of ``lo`` / ``hi`` per element (sel = t | (4 + t) << 4 | (t + 1) <<
    8 | (5 + t) << 12: the fields of slots t and t + 1)."""
    return gl.inline_asm_elementwise("{ .reg .b32 t; prmt.b32 t, $2, $3, $4; mov.b32 {$0, $1}, t; }",
                                     "=h,=h,r,r,r", [lo, hi, sel], dtype=(gl.float16, gl.float16), is_pure=True,
                                     pack=1)


@gluon.jit
def _unit_field_pair(w, r, j: gl.constexpr, G: gl.constexpr, NT: gl.constexpr, NWS: gl.constexpr):
    """:func:`_unit_field` of column tiles j and j + 1 (j even) by one ``prmt``: their slots are bytes t and t + 1
    of one word (t = (grp NT + j) % 4 is even)."""
    lo, hi = _field_words(w, j, NWS)
    t = ((gl.convert_layout(r, lo.type.layout) // G) * NT + j) % 4
    return _fp16_pair_of_bytes(lo, hi, t | ((4 + t) << 4) | ((t + 1) << 8) | ((5 + t) << 12))


@gluon.jit
def _unit_fields(w, r, LS: gl.constexpr, G: gl.constexpr, NT: gl.constexpr, NWS: gl.constexpr,
                 FPAIR: gl.constexpr = False):
    """One per-slot fp16 field in the scores' layout (8 rows, 8 NT) fp32 from its words (see :func:`_unit_field`):
    row r's column ``8j + 2q + e`` is slot ``8 (2q + e) + (r // G) NT + j``. FPAIR (:func:`field_pairs`): two
    column tiles a ``prmt`` (:func:`_unit_field_pair`)."""
    if FPAIR:
        f01 = _unit_field_pair(w, r, 0, G, NT, NWS)
        if NT == 2:
            z = gl.join(f01[0], f01[1])
        elif NT == 4:
            f23 = _unit_field_pair(w, r, 2, G, NT, NWS)
            z = _join4(f01[0], f01[1], f23[0], f23[1])
        else:
            f23 = _unit_field_pair(w, r, 2, G, NT, NWS)
            f45 = _unit_field_pair(w, r, 4, G, NT, NWS)
            f67 = _unit_field_pair(w, r, 6, G, NT, NWS)
            z = gl.join(_join4(f01[0], f01[1], f23[0], f23[1]), _join4(f45[0], f45[1], f67[0], f67[1]))
            z = gl.reshape(gl.permute(z, [0, 1, 2, 4, 3]), [8, 4, 2, 8])
    elif NT == 2:
        z = gl.join(_unit_field(w, r, 0, G, NT, NWS), _unit_field(w, r, 1, G, NT, NWS))
    elif NT == 4:
        z = _join4(_unit_field(w, r, 0, G, NT, NWS), _unit_field(w, r, 1, G, NT, NWS),
                   _unit_field(w, r, 2, G, NT, NWS), _unit_field(w, r, 3, G, NT, NWS))
    else:
        z = gl.join(_join4(_unit_field(w, r, 0, G, NT, NWS), _unit_field(w, r, 1, G, NT, NWS),
                           _unit_field(w, r, 2, G, NT, NWS), _unit_field(w, r, 3, G, NT, NWS)),
                    _join4(_unit_field(w, r, 4, G, NT, NWS), _unit_field(w, r, 5, G, NT, NWS),
                           _unit_field(w, r, 6, G, NT, NWS), _unit_field(w, r, 7, G, NT, NWS)))  # (.., j % 4, j // 4)
        z = gl.reshape(gl.permute(z, [0, 1, 2, 4, 3]), [8, 4, 2, 8])
    y = gl.reshape(gl.permute(z, [0, 3, 1, 2]), [8, 8 * NT])  # (r, j, q, e)
    return gl.convert_layout(y, LS).to(gl.float32)


@gluon.jit
def _unit_base(t, b, pt_ptr, stride_ptb, stride_lkb, stride_lvb, PAGE: gl.constexpr):
    """Where unit-major tile ``t`` (slots 64t ..) starts, in 4-byte words of the key and value latents (int64), and
    its page (-1: unmapped, read from page 0 and zeroed; the batch index without a page table)."""
    if PAGE > 0:
        idx = gl.load(pt_ptr + b.to(gl.int64) * stride_ptb + t // (PAGE // 64)).to(gl.int64)
        w0 = (t % (PAGE // 64)).to(gl.int64) * 16
        at = gl.maximum(idx, 0)
    else:
        idx = b.to(gl.int64)
        w0 = t.to(gl.int64) * 16
        at = idx
    return at * stride_lkb + w0, at * stride_lvb + w0, idx


@gluon.jit
def _tile_load(lk_w, lv_w, kbase, vbase, koff, voff, foff_k, foff_v):
    """:func:`_unit_load` from whole-tile word offsets (``koff``, ``voff``, ``foff_*``, of the tile's base): the same
    words in the same layouts, each load with its own 64-bit address (the kernel's loads while ``LANES`` is off)."""
    wk = gl.load(lk_w + kbase + koff)
    wv = gl.load(lv_w + vbase + voff)
    ks = gl.load(lk_w + kbase + foff_k[0])
    km = gl.load(lk_w + kbase + foff_k[1])
    vs = gl.load(lv_w + vbase + foff_v[0])
    vm = gl.load(lv_w + vbase + foff_v[1])
    return wk, wv, ks, km, vs, vm


@gluon.jit
def _ld(p, HINT: gl.constexpr):
    """``gl.load(p)`` with the latent loads' cache hint (:func:`load_hint`): 0 none, 1 ``evict_first``, 2 ``.cg``
    (L2 only; ptxas refuses the two together)."""
    if HINT == 1:
        x = gl.load(p, eviction_policy="evict_first")
    elif HINT == 2:
        x = gl.load(p, cache_modifier=".cg")
    else:
        x = gl.load(p)
    return x


@gluon.jit
def _unit_load(kp, vp, fp_k, fp_v, kbase, vbase, CKW: gl.constexpr, CVW: gl.constexpr, KL: gl.constexpr,
               VL: gl.constexpr, FL: gl.constexpr, NWS: gl.constexpr, BITS: gl.constexpr, HINT: gl.constexpr = 0):
    """One unit-major tile's words: key code columns (layout KL), value code columns (VL), and the four fp16 fields'
    byte columns (key scale, key min, value scale, value min; FL each). Unmasked (rows stay in bounds; the caller
    zeroes the fields of slots it must not read).

    ``kp``, ``vp``, ``fp_*`` point at each lane's first word (its part of the offsets: see :func:`_unit_lanes`); the
    tile's base (``kbase`` / ``vbase``, words) is added once per tensor and each load adds a constant column offset,
    which the compiler folds into the load's immediate. (Offsets built over whole tiles gave each load its own 64-bit
    address: 126 of the 8-bit loop's 765 SASS instructions; 15 of 619 this way. Registers: 128 instead of 167 with
    Triton 3.9's ptxas offline, 168 as before with Triton 3.6's on the H200.)"""
    t = kp + kbase
    u = vp + vbase
    if BITS == 8:  # keys (2 w, 4 q, 8 c, 4 b, 2 e) at columns 8b + e; values (4 d, 4 q, 8 n, 2 m, 2 e) at 16m + 8e
        x = _join4(gl.join(_ld(t, HINT), _ld(t + CKW, HINT)),
                   gl.join(_ld(t + 8 * CKW, HINT), _ld(t + 9 * CKW, HINT)),
                   gl.join(_ld(t + 16 * CKW, HINT), _ld(t + 17 * CKW, HINT)),
                   gl.join(_ld(t + 24 * CKW, HINT), _ld(t + 25 * CKW, HINT)))
        wk = gl.convert_layout(gl.permute(x, [0, 1, 2, 4, 3]), KL)
        y = gl.join(gl.join(_ld(u, HINT), _ld(u + 8 * CVW, HINT)),
                    gl.join(_ld(u + 16 * CVW, HINT), _ld(u + 24 * CVW, HINT)))
        wv = gl.convert_layout(gl.permute(y, [0, 1, 2, 4, 3]), VL)
    else:  # keys (2 w, 4 q, 8 c, 4 b) at columns 4b; values (4 d, 4 q, 8 n, 2 m) at 8m
        wk = gl.convert_layout(_join4(_ld(t, HINT), _ld(t + 4 * CKW, HINT), _ld(t + 8 * CKW, HINT),
                                      _ld(t + 12 * CKW, HINT)), KL)
        wv = gl.convert_layout(gl.join(_ld(u, HINT), _ld(u + 8 * CVW, HINT)), VL)
    ks = _field_load(fp_k[0] + kbase, CKW, NWS, FL, HINT)
    km = _field_load(fp_k[1] + kbase, CKW, NWS, FL, HINT)
    vs = _field_load(fp_v[0] + vbase, CVW, NWS, FL, HINT)
    vm = _field_load(fp_v[1] + vbase, CVW, NWS, FL, HINT)
    return wk, wv, ks, km, vs, vm


@gluon.jit
def _field_pair(t, k: gl.constexpr, CW: gl.constexpr, HINT: gl.constexpr = 0):
    """Word ``k`` of a field's low-byte column and of its high-byte column (CW words on): (8 r, 4 q, 2 lh)."""
    return gl.join(_ld(t + k, HINT), _ld(t + (k + CW), HINT))


@gluon.jit
def _field_load(t, CW: gl.constexpr, NWS: gl.constexpr, FL: gl.constexpr, HINT: gl.constexpr = 0):
    """A field's words (8 r, 4 q, 2 e, NWS, 2 lh) in layout FL from each lane's first word ``t``: word ``2e + i`` of
    the low-byte column (lh = 0) and of the high-byte column."""
    if NWS == 1:
        z = gl.join(gl.reshape(_field_pair(t, 0, CW, HINT), [8, 4, 2, 1]),
                    gl.reshape(_field_pair(t, 2, CW, HINT), [8, 4, 2, 1]))
    else:
        z = gl.join(gl.join(_field_pair(t, 0, CW, HINT), _field_pair(t, 1, CW, HINT)),
                    gl.join(_field_pair(t, 2, CW, HINT), _field_pair(t, 3, CW, HINT)))  # (8 r, 4 q, 2 lh, 2 i, 2 e)
    return gl.convert_layout(gl.permute(z, [0, 1, 4, 3, 2]), FL)


@gluon.jit
def _unit_lanes(lk_w, lv_w, k_col, v_col, k_fields, v_fields, CKW: gl.constexpr, CVW: gl.constexpr,
                KL: gl.constexpr, VL: gl.constexpr, FL: gl.constexpr, G: gl.constexpr, NT: gl.constexpr,
                BITS: gl.constexpr):
    """Each lane's first word of a tile (offsets from the tile's base, :func:`_unit_base`) for :func:`_unit_load`:
    keys (2 w, 4 q, 8 c) and values (4 d, 4 q, 8 n) in KL / VL without their last (register) dims, each field's low
    byte column (8 r, 4 q) in FL without (e, i, lh). ``k_fields`` / ``v_fields``: the (scale, min) byte columns'
    first fp16 units (``base + blk``). The same words as the kernel's whole-tile offsets (``koff``, ``voff``,
    ``foff_*``) minus the constant column offsets :func:`_unit_load` adds."""
    if BITS == 8:
        K3: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, KL))
        V3: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, VL))
        KC: gl.constexpr = 2  # key columns: 8b + 2q + e
    else:
        K3: gl.constexpr = gl.SliceLayout(3, KL)
        V3: gl.constexpr = gl.SliceLayout(3, VL)
        KC: gl.constexpr = 1  # key columns: 4b + q
    w = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, K3)))
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, K3)))
    c = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, K3)))
    kp = lk_w + ((k_col + KC * q[None, :, None]) * CKW + 2 * c[None, None, :] + w[:, None, None])
    d = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, V3)))
    qv = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, V3)))
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, V3)))
    vp = lv_w + ((v_col + n[None, None, :]) * CVW + 4 * qv[None, :, None] + d[:, None, None])
    F2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, FL)))
    r = gl.arange(0, 8, layout=gl.SliceLayout(1, F2))
    qf = gl.arange(0, 4, layout=gl.SliceLayout(0, F2))
    fl = 4 * qf[None, :] + ((r // G) * NT // 4)[:, None]
    fp_k = (lk_w + (fl + 2 * k_fields[0] * CKW), lk_w + (fl + 2 * k_fields[1] * CKW))
    fp_v = (lv_w + (fl + 2 * v_fields[0] * CVW), lv_w + (fl + 2 * v_fields[1] * CVW))
    return kp, vp, fp_k, fp_v


@gluon.jit
def _unit_issue(smem, st, lk_w, lv_w, kbase, vbase, koff, voff, foff_k, foff_v):
    """cp.async of one unit-major tile's words (the ones :func:`_unit_load` reads) into stage ``st`` of ``smem``
    (keys, values, and the four fields, each in its registers' shape), so each thread later reads back only what it
    copied (correct without a barrier; Triton adds some around the ring all the same). One commit group."""
    sk, sv, sks, skm, svs, svm = smem
    _async_load(sk.index(st), lk_w + kbase + koff)
    _async_load(sv.index(st), lv_w + vbase + voff)
    _async_load(sks.index(st), lk_w + kbase + foff_k[0])
    _async_load(skm.index(st), lk_w + kbase + foff_k[1])
    _async_load(svs.index(st), lv_w + vbase + foff_v[0])
    _async_load(svm.index(st), lv_w + vbase + foff_v[1])
    async_copy.commit_group()


@gluon.jit
def _unit_staged(smem, st, KL: gl.constexpr, VL: gl.constexpr, FL: gl.constexpr):
    """Stage ``st``'s words back in registers (the layouts :func:`_unit_load` gives)."""
    sk, sv, sks, skm, svs, svm = smem
    return (sk.index(st).load(KL), sv.index(st).load(VL), sks.index(st).load(FL), skm.index(st).load(FL),
            svs.index(st).load(FL), svm.index(st).load(FL))


@gluon.jit
def _transpose4(a, b, c, d):
    """:data:`_T4_ASM` on each element of four int32 tensors of one shape: four tensors, word t holding byte t of
    a, b, c and d (in that order)."""
    return gl.inline_asm_elementwise(_T4_ASM, "=r,=r,=r,=r,r,r,r,r", [a, b, c, d], dtype=(gl.int32,) * 4,
                                     is_pure=True, pack=1)


@gluon.jit
def _imma_a(h0, l0, h1, l1, rg, grp: gl.constexpr, IL: gl.constexpr):
    """k-step ``grp``'s s8 A fragment (4 words (1, 8 rows, 4 q) int32 in IL: high bytes k 0..15, low bytes k 0..15,
    high k 16..31, low k 16..31): the query rows of slot group grp, zero for the others (the block-diagonal
    query)."""
    AS: gl.constexpr = gl.SliceLayout(0, IL)
    on = rg == grp
    return (gl.convert_layout(gl.where(on, h0, 0), AS)[None, :, :], gl.convert_layout(gl.where(on, l0, 0), AS)[None, :, :],
            gl.convert_layout(gl.where(on, h1, 0), AS)[None, :, :], gl.convert_layout(gl.where(on, l1, 0), AS)[None, :, :])


@gluon.jit
def _imma_query(q_row, G: gl.constexpr, GROUPS: gl.constexpr, IL: gl.constexpr, LS: gl.constexpr):
    """The folded query as IMMA's s8 A fragments (``IMMA``, :data:`IMMA_GPU_CHECKED`): 16-bit fixed point ``ci = 256
    hi + lo`` (|ci| <= 32512: hi in [-127, 127], lo in [-128, 127]), per k-step (slot group) the tuple of
    :func:`_imma_a`; lane 4r + q's words hold k = 16s + 4q + i (byte i), which reads latent coordinate 16s + 8(i //
    2) + 2q + i % 2 (the order :func:`_imma_scores` transposes the codes into). Also the unit (fp32: a coefficient
    is ``ci * unit``) and ``sum(ci) * unit`` per scores' row ((8,) in LS's rows: what the score's minimum term
    multiplies, so a score is exactly that of the rounded query). ``q_row``: (G, 32) fp32."""
    QL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 2, 4], threads_per_warp=[8, 4, 1, 1],
                                        warps_per_cta=[1, 1, 1, 1], order=[3, 2, 1, 0])
    r = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, QL))))[:, None, None, None]
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, QL))))[None, :, None, None]
    sk = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, QL))))[None, None, :, None]
    i = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, QL))))[None, None, None, :]
    cf = gl.load(q_row + (r % G) * RK + (16 * sk + 8 * (i // 2) + 2 * q + i % 2))  # (8, 4, 2, 4) fp32
    amax = gl.max(gl.max(gl.max(gl.max(gl.abs(cf), axis=3), axis=2), axis=1), axis=0)
    unit = gl.where(amax > 0, amax * (1.0 / 32512.0), 1.0)
    ci = gl.minimum(gl.maximum(gl.floor(cf / unit + 0.5), -32512.0), 32512.0).to(gl.int32)
    hi = (ci + 128) >> 8
    lo = ci - hi * 256
    sh = 8 * i
    whi = gl.sum((hi & 255) << sh, axis=3)  # (8 r, 4 q, 2 s): four bytes a word (no carries: an OR)
    wlo = gl.sum((lo & 255) << sh, axis=3)
    sumc = gl.convert_layout(gl.sum(gl.sum(gl.sum(ci, axis=3), axis=2), axis=1).to(gl.float32) * unit,
                             gl.SliceLayout(1, LS))
    h0, h1 = gl.split(whi)
    l0, l1 = gl.split(wlo)
    rg = gl.arange(0, 8, layout=gl.SliceLayout(1, h0.type.layout))[:, None] // G
    if GROUPS == 1:
        qa = (_imma_a(h0, l0, h1, l1, rg, 0, IL),)
    elif GROUPS == 2:
        qa = (_imma_a(h0, l0, h1, l1, rg, 0, IL), _imma_a(h0, l0, h1, l1, rg, 1, IL))
    else:
        qa = (_imma_a(h0, l0, h1, l1, rg, 0, IL), _imma_a(h0, l0, h1, l1, rg, 1, IL),
              _imma_a(h0, l0, h1, l1, rg, 2, IL), _imma_a(h0, l0, h1, l1, rg, 3, IL))
    return qa, unit, sumc


@gluon.jit
def _imma_scores(wk, qa, GROUPS: gl.constexpr, NT: gl.constexpr, IL: gl.constexpr, LS: gl.constexpr):
    """A unit-major 8-bit tile's raw scores on the integer tensor cores: (8 rows, 8 NT) fp32 in LS, the exact
    ``sum_k ci_k code_k`` of :func:`_imma_query`'s rounded query (the score before its unit, the slot's scale and
    minimum). ``wk``: the key words (2 w, 4 q, 8 c, 4 b, 2 e) of :func:`_unit_load` (word: slots 8c + 4w + t of
    coordinate 8b + 2q + e); b = 2s + h, the words (h, e) = (0, 0), (0, 1), (1, 0), (1, 1) transposed give slot t's
    B word for k = 16s + 4q + i (byte i: coordinate 16s + 8(i // 2) + 2q + i % 2); slot ``8c + grp NT + j`` is
    column c of n-tile j in k-step grp, as in the fp16 path."""
    x = gl.reshape(wk, [2, 4, 8, 2, 2, 2])  # (w, q, c, s, h, e)
    xe0, xe1 = gl.split(x)  # (w, q, c, s, h)
    wa, wc = gl.split(xe0)
    wb, wd = gl.split(xe1)
    t0, t1, t2, t3 = _transpose4(wa, wb, wc, wd)  # (w, q, c, s): slot 8c + 4w + t
    y = gl.reshape(gl.permute(_join4(t0, t1, t2, t3), [0, 4, 2, 1, 3]), [GROUPS, NT, 8, 4, 2])  # (grp, j, c, q, s)
    b0, b1 = gl.split(y)  # (grp, j, c, q)
    if GROUPS == 1:
        a = qa[0]
        d = gl.inline_asm_elementwise(
            _IMMA_ASM1, _IMMA_CONSTRAINTS1,
            [a[0], a[1], a[2], a[3], gl.convert_layout(gl.reshape(b0, [NT, 8, 4]), IL),
             gl.convert_layout(gl.reshape(b1, [NT, 8, 4]), IL)], dtype=(gl.int32,) * 4, is_pure=True, pack=1)
    elif GROUPS == 2:
        p00, p10 = gl.split(gl.permute(b0, [1, 2, 3, 0]))  # (j, c, q) of grp 0, 1
        p01, p11 = gl.split(gl.permute(b1, [1, 2, 3, 0]))
        a = qa[0]
        e = qa[1]
        d = gl.inline_asm_elementwise(
            _IMMA_ASM2, _IMMA_CONSTRAINTS2,
            [a[0], a[1], a[2], a[3], gl.convert_layout(p00, IL), gl.convert_layout(p01, IL),
             e[0], e[1], e[2], e[3], gl.convert_layout(p10, IL), gl.convert_layout(p11, IL)],
            dtype=(gl.int32,) * 4, is_pure=True, pack=1)
    else:  # grp = 2 g1 + g0
        u0a, u0b = gl.split(gl.permute(gl.reshape(b0, [2, 2, NT, 8, 4]), [2, 3, 4, 0, 1]))  # g0 = 0, 1: (j, c, q, g1)
        u1a, u1b = gl.split(gl.permute(gl.reshape(b1, [2, 2, NT, 8, 4]), [2, 3, 4, 0, 1]))
        b0g0, b0g2 = gl.split(u0a)
        b0g1, b0g3 = gl.split(u0b)
        b1g0, b1g2 = gl.split(u1a)
        b1g1, b1g3 = gl.split(u1b)
        a0 = qa[0]
        a1 = qa[1]
        a2 = qa[2]
        a3 = qa[3]
        d = gl.inline_asm_elementwise(
            _IMMA_ASM4, _IMMA_CONSTRAINTS4,
            [a0[0], a0[1], a0[2], a0[3], gl.convert_layout(b0g0, IL), gl.convert_layout(b1g0, IL),
             a1[0], a1[1], a1[2], a1[3], gl.convert_layout(b0g1, IL), gl.convert_layout(b1g1, IL),
             a2[0], a2[1], a2[2], a2[3], gl.convert_layout(b0g2, IL), gl.convert_layout(b1g2, IL),
             a3[0], a3[1], a3[2], a3[3], gl.convert_layout(b0g3, IL), gl.convert_layout(b1g3, IL)],
            dtype=(gl.int32,) * 4, is_pure=True, pack=1)
    s0 = (d[0] * 256 + d[2]).to(gl.float32)  # (j, c = row, q): column 2q; hi rows + lo rows, one lane
    s1 = (d[1] * 256 + d[3]).to(gl.float32)  # column 2q + 1
    s = gl.reshape(gl.permute(gl.join(s0, s1), [1, 0, 2, 3]), [8, 8 * NT])  # (row, 8j + 2q + e)
    return gl.convert_layout(s, LS)


@gluon.jit
def _pack_weights(w0, w1, w2, w3):
    """:data:`_PACK_W_ASM` elementwise: (low-byte words, high-byte words) of four int32 weight tensors."""
    return gl.inline_asm_elementwise(_PACK_W_ASM, "=r,=r,r,r,r,r", [w0, w1, w2, w3], dtype=(gl.int32, gl.int32),
                                     is_pure=True, pack=1)


@gluon.jit
def _vimma_a(lo, hi, on, VIL: gl.constexpr):
    """One k-step's s8 A fragment for the value product from the (8 rows, 4 tig, 2 e) low / high byte words: (a0,
    a1, a2, a3) = (hi e=0, lo e=0, hi e=1, lo e=1) as (1, 8, 4) in VIL, zero where ``on`` (rows) is false."""
    AS: gl.constexpr = gl.SliceLayout(0, VIL)
    h0, h1 = gl.split(gl.where(on, hi, 0))
    l0, l1 = gl.split(gl.where(on, lo, 0))
    return (gl.convert_layout(h0, AS)[None, :, :], gl.convert_layout(l0, AS)[None, :, :],
            gl.convert_layout(h1, AS)[None, :, :], gl.convert_layout(l1, AS)[None, :, :])


@gluon.jit
def _vimma_step(s, wv, ksf, kmf, vsf, vmf, ok_s, sok, sumc, sumc8, k_unit, m_i, l_q, n_q, acc,
                LS: gl.constexpr, NT: gl.constexpr, G: gl.constexpr, MASKED: gl.constexpr, ZERO: gl.constexpr,
                VIL: gl.constexpr):
    """One unit-major 8-bit tile with both products on the integer tensor cores (``VIMMA``; G = 4 or 8): the online
    softmax of :func:`_online_step` on the raw scores ``s`` (:func:`_imma_scores`), then the value product with the
    weights ``p * vscale`` as 16-bit fixed point per row and tile (``w = 256 hi + lo``, the row's largest at 32512:
    s8 hi / lo rows of the A fragment, packed straight from the scores' registers) against the value code words as
    they were loaded (u8 B fragments, no conversion): the k-quad of lane tig in k-step ks is column tiles ``4 ks ..
    4 ks + 3`` (G = 8), or the slot group ks's four (G = 4, other rows zero), at column ``2 tig + e``: slots ``16 tig
    + 8e + 4 ks + i``, byte i of the value words ``d = ks + 2e``. ``wv``: (4 d, 4 q, 8 n, 2 m, 2 e) value words
    (coordinate ``n + 8 (2m + e)``, slots ``16 q + 4 d + t``). ``acc``: (8 rows, 32) fp32, column j = coordinate j,
    in its true scale (no power of two); ``n_q`` sums ``p * vmin`` (uncentred codes)."""
    if ZERO:
        ksf = gl.where(sok, ksf, 0.0)
        kmf = gl.where(sok, kmf, 0.0)
        vsf = gl.where(sok, vsf, 0.0)
        vmf = gl.where(sok, vmf, 0.0)
    s = (s * k_unit + sumc8[:, None]) * ksf + kmf * sumc[:, None]
    if MASKED:
        s = gl.where(ok_s, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    if MASKED:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - m_use[:, None])
    al_q = gl.convert_layout(alpha, gl.SliceLayout(1, l_q.type.layout))[:, None]
    l_q = l_q * al_q + gl.convert_layout(gl.sum(gl.sum(gl.reshape(p, [8, NT, 4, 2]), axis=3), axis=1),
                                         l_q.type.layout)
    n_q = n_q * al_q + gl.convert_layout(
        gl.sum(gl.sum(gl.reshape(p * vmf, [8, NT, 4, 2]), axis=3), axis=1), n_q.type.layout)
    pw = p * vsf
    wmax = gl.max(pw, axis=1)  # (8,): the row's largest weight this tile
    inv = gl.where(wmax > 0, 32512.0 / gl.where(wmax > 0, wmax, 1.0), 0.0)
    wi = (pw * inv[:, None] + 0.5).to(gl.int32)  # (8, 8 NT) in [0, 32512]
    # (row, j, tig, e) -> (row, tig, e, jh, jl1, jl0) with j = 4 jh + 2 jl1 + jl0
    x = gl.permute(gl.reshape(wi, [8, NT // 4, 2, 2, 4, 2]), [0, 4, 5, 1, 2, 3])
    xa, xb = gl.split(x)  # jl0 = 0, 1
    x0, x2 = gl.split(xa)  # jl = 0, 2
    x1, x3 = gl.split(xb)  # jl = 1, 3
    lo, hi = _pack_weights(x0, x1, x2, x3)  # (8 row, 4 tig, 2 e, NT // 4 jh)
    # value words -> per k-step the B fragment (words d = ks, d = 2 + ks): (nt = 2m + e, n, q)
    y = gl.permute(gl.reshape(wv, [2, 2, 4, 8, 2, 2]), [4, 5, 3, 2, 0, 1])  # (m, e, n, q, dh, dl)
    y = gl.reshape(y, [4, 8, 4, 2, 2])
    y0, y1 = gl.split(y)  # dl = 0, 1: (nt, n, q, dh)
    b00, b01 = gl.split(y0)  # ks 0: d = 0, 2
    b10, b11 = gl.split(y1)  # ks 1: d = 1, 3
    if NT == 4:  # k-step ks = slot group ks: its rows only
        lo0 = gl.reshape(lo, [8, 4, 2])
        hi0 = gl.reshape(hi, [8, 4, 2])
        lo1 = lo0
        hi1 = hi0
        rows = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, lo0.type.layout)))[:, None, None]
        on0 = rows // G == 0
        on1 = rows // G == 1
    else:  # G = 8: k-step ks = column tiles 4 ks .. 4 ks + 3
        lo0, lo1 = gl.split(lo)
        hi0, hi1 = gl.split(hi)
        rows = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, lo0.type.layout)))[:, None, None]
        on0 = rows >= 0
        on1 = on0
    a = _vimma_a(lo0, hi0, on0, VIL)
    e = _vimma_a(lo1, hi1, on1, VIL)
    d = gl.inline_asm_elementwise(
        _IMMA_ASM2, _IMMA_CONSTRAINTS2,
        [a[0], a[1], a[2], a[3], gl.convert_layout(b00, VIL), gl.convert_layout(b01, VIL),
         e[0], e[1], e[2], e[3], gl.convert_layout(b10, VIL), gl.convert_layout(b11, VIL)],
        dtype=(gl.int32,) * 4, is_pure=True, pack=1)
    o0 = (d[0] * 256 + d[2]).to(gl.float32)  # (nt, row, tig): coordinate 8 nt + 2 tig
    o1 = (d[1] * 256 + d[3]).to(gl.float32)  # + 1
    o = gl.reshape(gl.permute(gl.join(o0, o1), [1, 0, 2, 3]), [8, 32])  # (row, 8 nt + 2 tig + f)
    OA: gl.constexpr = o.type.layout
    unit = gl.convert_layout(wmax * (1.0 / 32512.0), gl.SliceLayout(1, OA))
    al_o = gl.convert_layout(alpha, gl.SliceLayout(1, OA))
    acc = gl.convert_layout(acc, OA) * al_o[:, None] + o * unit[:, None]
    return m_new, l_q, n_q, acc


@gluon.jit
def _unit_step(wk, wv, ks, km, vs, vm, r_f, ok_s, sok, ca, sumc, sumc8, k_unit, ve, m_i, l_q, n_q, acc,
               L: gl.constexpr, AL: gl.constexpr, BL: gl.constexpr, LS: gl.constexpr, KS: gl.constexpr,
               BT: gl.constexpr, NT: gl.constexpr, G: gl.constexpr, GROUPS: gl.constexpr, NWS: gl.constexpr,
               PLO: gl.constexpr, MASKED: gl.constexpr, ZERO: gl.constexpr, BITS: gl.constexpr = 4,
               VPAIR: gl.constexpr = False, IMMA: gl.constexpr = False, IL: gl.constexpr = None,
               FPAIR: gl.constexpr = False, VIMMA: gl.constexpr = False, VIL: gl.constexpr = None):
    """One unit-major tile: the operands from the loaded words, then :func:`_online_step`.

    Keys: word (w, q, c, b) holds slots ``8c + 4w + t`` (t = 0..3) of code byte ``q + 4b`` (coordinates 2(q + 4b) + e):
    slot ``8c + grp NT + j`` is column (j, c) of slot group grp, and byte ``q + 4b`` with b = 2s + h gives the mma
    coordinates ``k = 16s + 8h + 2q + e`` = the latent coordinate. Values: word (d, q, n, m) holds slots
    ``16q + 4d + t`` of code byte ``n + 8m``; the pair (slot 16q + 4d + t, slot 16q + 8 + 4d + t) for d = 0, 1 is
    the value operand's k pair (2q, 2q + 1) of key column index ``t' = 4d + t = grp NT + j``, and value column
    ``8(2m + e) + n`` holds coordinate ``2(n + 8m) + e``.

    BITS 8 (one code a byte): key word (w, q, c, b, e) holds slots ``8c + 4w + t`` of code byte (= coordinate)
    ``8b + 2q + e``, so the pair of words e = 0, 1 gives each slot's k pair as one fp16x2 (:func:`_dequant_bytes`)
    in the 4-bit path's order; value word (d, q, n, m, e) holds slots ``16q + 4d + t`` of coordinate
    ``n + 8(2m + e)``, value column ``8(2m + e) + n`` holds that coordinate (column j = coordinate j). VPAIR (BITS
    8): the value operand in the k order of :func:`_group_pairs`: word (d = 2h + dd, q, n, m, e) byte t is slot
    ``16q + 8h + u`` with ``u = 4 dd + t = grp NT + 2m' + e'``, so bytes (t, t + 1) are the k pair e' = 0, 1 of
    (grp, m', h, q) (:func:`_dequant_quads`: prmt + sub.f16x2 a pair). IMMA (BITS 8): the key product on the
    integer tensor cores (:func:`_imma_scores`; ``ca`` the tuple of :func:`_imma_query`, IL its instance layout).
    VIMMA (with IMMA, G = 4 or 8): the value product too (:func:`_vimma_step`; ``acc`` (8, 32) in its layout, VIL
    the value product's instance layout); returns ``ve`` unchanged."""
    ksf = _unit_fields(ks, r_f, LS, G, NT, NWS, FPAIR)
    kmf = _unit_fields(km, r_f, LS, G, NT, NWS, FPAIR)
    vsf = _unit_fields(vs, r_f, LS, G, NT, NWS, FPAIR)
    vmf = _unit_fields(vm, r_f, LS, G, NT, NWS, FPAIR)
    if VIMMA:
        gl.static_assert(BITS == 8 and IMMA, "VIMMA: with IMMA")
        kb = _imma_scores(wk, ca, GROUPS, NT, IL, LS)
        m_i, l_q, n_q, acc = _vimma_step(kb, wv, ksf, kmf, vsf, vmf, ok_s, sok, sumc, sumc8, k_unit, m_i, l_q, n_q,
                                         acc, LS, NT, G, MASKED, ZERO, VIL)
        out = (m_i, l_q, n_q, acc, ve)
    else:
        if IMMA:
            gl.static_assert(BITS == 8, "IMMA: 8-bit codes only")
            kb = _imma_scores(wk, ca, GROUPS, NT, IL, LS)
        else:
            if BITS == 8:
                ka, kb_ = gl.split(wk)  # (2 w, 4 q, 8 c, 4 b), e = 0 / 1
                x = _dequant_bytes(ka, kb_)  # (2 w, 4 q, 8 c, 4 b, 4 t, 2 e)
            else:
                x = _dequant_column(wk)  # (2 w, 4 q, 8 c, 4 b, 4 t, 2 e)
            x = gl.reshape(gl.permute(x, [0, 4, 3, 1, 5, 2]), [GROUPS, NT, 2, 2, 4, 2, 8])  # (grp, j, s, h, q, e, c)
            kb = gl.convert_layout(gl.reshape(gl.permute(x, [0, 2, 3, 4, 5, 1, 6]), [KS, 8 * NT]), BL)
        if BITS == 8 and VPAIR:  # value words (4 d, 4 q, 8 n, 2 cm, 2 ce): coordinate n + 16 cm + 8 ce
            y = gl.reshape(_dequant_quads(wv), [2, 2, 4, 8, 2, 2, 4])  # (h, dd, q, n, cm, ce, t)
            y = gl.reshape(gl.permute(y, [0, 2, 3, 4, 5, 1, 6]), [2, 4, 8, 2, 2, GROUPS, NT // 2, 2])  # u -> (grp, m, e)
            y = gl.permute(y, [5, 6, 0, 1, 7, 3, 4, 2])  # (grp, m, h, q, e, cm, ce, n)
            vb = gl.convert_layout(gl.reshape(y, [BT, RV]), BL)
        elif BITS == 8:  # value words (4 d, 4 q, 8 n, 2 m, 2 e) -> a: d = 0, 1; b: d = 2, 3
            v = gl.reshape(gl.permute(wv, [1, 2, 3, 4, 0]), [4, 8, 2, 2, 2, 2])  # (q, n, m, e, d // 2, d % 2)
            va, vb_ = gl.split(gl.permute(v, [0, 1, 2, 3, 5, 4]))  # (q, n, m, e, d % 2)
            y = gl.permute(_dequant_bytes(va, vb_), [0, 1, 2, 4, 5, 3, 6])  # (q, n, m, d, 4 t, 2 e, 2 ab)
        else:  # value words (4 d, 4 q, 8 n, 2 m) -> a: d = 0, 1; b: d = 2, 3
            v = gl.reshape(gl.permute(wv, [1, 2, 3, 0]), [4, 8, 2, 2, 2])  # (q, n, m, d // 2, d % 2)
            va, vb_ = gl.split(gl.permute(v, [0, 1, 2, 4, 3]))  # (q, n, m, d % 2)
            y = _dequant_pairs(va, vb_)  # (q, n, m, d, 4 t, 2 e, 2 ab)
        if not (BITS == 8 and VPAIR):
            y = gl.reshape(gl.permute(y, [3, 4, 0, 6, 2, 5, 1]), [GROUPS, NT, 4, 2, 2, 2, 8])  # (grp, j, q, ab, m, e, n)
            vb = gl.convert_layout(gl.reshape(gl.permute(y, [1, 0, 2, 3, 4, 5, 6]), [BT, RV]), BL)
        out = _online_step(kb, vb, ksf, kmf, vsf, vmf, ok_s, sok, ca, sumc, sumc8, k_unit, ve, m_i, l_q, n_q, acc, L,
                           AL, LS, BT, NT, G, GROUPS, PLO, MASKED, ZERO, 128.0 if BITS == 8 else 8.0, VPAIR, IMMA)
    return out


# ---- the fold and the merge inside the unit-major pass (FOLD, MERGE)


@gluon.jit
def _rows_of_heads(x, G: gl.constexpr):
    """(G, N) -> (8, N): row r holds head ``r % G`` (the scores' rows: 8 // G slot groups of G query heads)."""
    if G == 8:
        out = x
    elif G == 4:
        out = gl.reshape(gl.permute(gl.join(x, x), [2, 0, 1]), [8, x.shape[1]])
    else:
        out = gl.reshape(gl.permute(gl.join(gl.join(x, x), gl.join(x, x)), [2, 3, 0, 1]), [8, x.shape[1]])
    return out


@gluon.jit
def _bf16_rows(x, AL: gl.constexpr):
    """(8, K) fp32 -> (16, K) bf16 in AL: rows 0..7 ``bf16(x)``, rows 8..15 the remainder ``bf16(x - hi)`` (a tensor
    core product of both halves summed over the row pairs keeps about 16 bits of x)."""
    x_hi = x.to(gl.bfloat16)
    x_lo = (x - x_hi.to(gl.float32)).to(gl.bfloat16)
    return gl.convert_layout(gl.reshape(gl.permute(gl.join(x_hi, x_lo), [2, 0, 1]), [ROWS, x.shape[1]]), AL)


@gluon.jit
def _fold_chunk(acc, q_rows, bk_head, d0, D, stride_qd, stride_bkd, stride_bkr, WL: gl.constexpr, AL: gl.constexpr,
                BL: gl.constexpr, Q_EXACT: gl.constexpr, BK_EXACT: gl.constexpr):
    """One 32-channel step of :func:`_fold_rows`: ``acc`` (16, 32) fp32 plus q[:, d0:d0+32] @ P[d0:d0+32, :]."""
    r8 = gl.arange(0, 8, layout=gl.SliceLayout(1, WL))
    ka = d0 + gl.arange(0, 32, layout=gl.SliceLayout(0, WL))
    x = gl.load(q_rows[:, None] + (ka * stride_qd)[None, :], mask=(ka < D)[None, :] & (r8 >= 0)[:, None], other=0.0)
    if Q_EXACT:  # bf16: rows 8..15 zero
        x = x.to(gl.bfloat16)
        a = gl.convert_layout(gl.reshape(gl.permute(gl.join(x, gl.zeros_like(x)), [2, 0, 1]), [ROWS, 32]), AL)
    else:
        a = _bf16_rows(x.to(gl.float32), AL)
    dw = d0 + gl.arange(0, 32, layout=gl.SliceLayout(1, WL))
    rw = gl.arange(0, RK, layout=gl.SliceLayout(0, WL))
    w = gl.load(bk_head + (dw * stride_bkd)[:, None] + (rw * stride_bkr)[None, :],
                mask=(dw < D)[:, None] & (rw >= 0)[None, :], other=0.0)
    if BK_EXACT:  # vector loads along the basis rows, to the operand's layout through shared memory
        acc = mma_v2(a, gl.convert_layout(w.to(gl.bfloat16), BL), acc)
    else:
        w = w.to(gl.float32)
        w_hi = w.to(gl.bfloat16)
        acc = mma_v2(a, gl.convert_layout(w_hi, BL), acc)
        acc = mma_v2(a, gl.convert_layout((w - w_hi.to(gl.float32)).to(gl.bfloat16), BL), acc)
    return acc


@gluon.jit
def _fold_rows(q_ptr, bk_ptr, b, h, s_q, D, qk_scale, stride_qb, stride_qh, stride_qs, stride_qd, stride_bkb,
               stride_bkh, stride_bkd, stride_bkr, G: gl.constexpr, D_PAD: gl.constexpr, Q_EXACT: gl.constexpr,
               BK_EXACT: gl.constexpr, L: gl.constexpr, AL: gl.constexpr, BL: gl.constexpr):
    """The folded query ``qk_scale * P_h^T q`` of this (sequence, token, KV head) on the tensor cores: (8, 32) fp32,
    row r for query head ``h G + r % G`` (log2 units; ``_fold_query_kernel``'s values). q (B, H, S, D): bf16 as it
    is (Q_EXACT; rows 8..15 of the product zero), else split into bf16 hi (rows 0..7) + lo (rows 8..15); the basis
    block (Hkv, D, 32) or (B, Hkv, D, 32) in chunks of 32 channels (vector loads along its rows, then to the
    operand's layout), split into hi + lo (two products) unless bf16-exact (BK_EXACT). D <= D_PAD. With bf16 q and
    basis the chunks are unrolled (their loads issued together: one round trip, not D_PAD / 32); otherwise a loop
    (unrolled, the hi / lo splits took 142-180 registers)."""
    WL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[8, 4], warps_per_cta=[1, 1],
                                        order=[1, 0])
    r8 = gl.arange(0, 8, layout=gl.SliceLayout(1, WL))
    q_rows = q_ptr + b.to(gl.int64) * stride_qb + s_q * stride_qs + (h * G + r8 % G) * stride_qh
    bk_head = bk_ptr + b.to(gl.int64) * stride_bkb + h * stride_bkh
    acc = gl.zeros([ROWS, RK], gl.float32, L)
    if Q_EXACT and BK_EXACT:
        for d0 in gl.static_range(0, D_PAD, 32):
            acc = _fold_chunk(acc, q_rows, bk_head, d0, D, stride_qd, stride_bkd, stride_bkr, WL, AL, BL, Q_EXACT,
                              BK_EXACT)
    else:
        for d0 in range(0, D_PAD, 32):
            acc = _fold_chunk(acc, q_rows, bk_head, d0, D, stride_qd, stride_bkd, stride_bkr, WL, AL, BL, Q_EXACT,
                              BK_EXACT)
    return gl.sum(gl.reshape(acc, [2, 8, RK]), axis=0) * qk_scale


@gluon.jit
def _query_operand_regs(c8, G: gl.constexpr, GROUPS: gl.constexpr, KS: gl.constexpr, AL: gl.constexpr,
                        BITS: gl.constexpr):
    """:func:`_query_operand` (unit-major) from the folded query in registers: ``c8`` (8, 32) fp32, row r for head
    ``r % G`` (:func:`_fold_rows`). Returns the (16, KS) fp16 operand in AL and its power of two (fp32)."""
    if GROUPS == 1:
        x = c8
    elif GROUPS == 2:
        x = gl.reshape(gl.permute(gl.join(c8, c8), [0, 2, 1]), [8, KS])
    else:
        x = gl.reshape(gl.permute(gl.join(gl.join(c8, c8), gl.join(c8, c8)), [0, 2, 3, 1]), [8, KS])
    LX: gl.constexpr = x.type.layout
    r = gl.arange(0, 8, layout=gl.SliceLayout(1, LX))
    k = gl.arange(0, KS, layout=gl.SliceLayout(0, LX))
    if BITS == 8:
        f = gl.where(k >= 0, 1.0, 1.0)
    else:
        f = gl.where(k % 2 == 1, 0.0625, 1.0)
    cf = gl.where((r // G)[:, None] == (k // RK)[None, :], x * f[None, :], 0.0)
    ca, k_unit = _hi_lo_operand(gl.convert_layout(gl.reshape(gl.permute(gl.join(cf, cf), [2, 0, 1]), [ROWS, KS]), AL),
                                AL)
    # through shared memory: read back, the operand lands in the registers the tile loop's mma takes as they are
    # (built in registers, ptxas copied its 16 registers into place every tile)
    SH: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    sm = gl.allocate_shared_memory(gl.float16, [ROWS, KS], SH)
    sm.store(ca)
    return sm.load(AL), k_unit


@gluon.jit
def _rows_vec(x, G: gl.constexpr, LOUT: gl.constexpr):
    """(G,) -> (8,) in layout LOUT: element r holds head ``r % G``."""
    return gl.convert_layout(gl.reshape(_rows_of_heads(x[:, None], G), [8]), LOUT)


@gluon.jit
def _merge_in_pass(q_ptr, nk_ptr, nv_ptr, bv_ptr, slots_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, b, h, s_q, Hkv, S,
                   n_exact, n_split, D, qk_scale, stride_qb, stride_qh, stride_qs, stride_qd, stride_nkb,
                   stride_nkh, stride_nks, stride_nkd, stride_nvb, stride_nvh, stride_nvs, stride_nvd, stride_bvb,
                   stride_bvh, stride_bvd, stride_bvr, stride_ob, stride_oh, stride_os, stride_od,
                   G: gl.constexpr, D_PAD: gl.constexpr, RV_PAD: gl.constexpr, BV_EXACT: gl.constexpr,
                   L: gl.constexpr, AL: gl.constexpr, BL: gl.constexpr):
    """The merge of ``latent_attention_triton._merge_fma_kernel`` for one (sequence, KV head, query token), its G
    query heads at once in this warp: the row's n_split partials merged online (FlashDecoding; 32 / G splits a
    step, 4 lanes across them), the exact tokens (new_k / new_v at ``slots``, -1 unused) scored from q (a first pass for
    their max and sum, a second per 32 output channels for their values), the value latent weighted, split bf16 hi /
    lo and projected by the value basis block ((B,) Hkv, D, 32) on the tensor cores (hi / lo again unless
    BV_EXACT), normalised and stored into out (B, H, S, D). Rows with no token: 0. Scores in log2 units."""
    SB: gl.constexpr = 32 // G  # splits a step: 32 partial values a lane
    P3: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[4, 1, 8], warps_per_cta=[1, 1, 1],
                                        order=[2, 1, 0])
    M2: gl.constexpr = gl.SliceLayout(2, P3)
    row0 = (((b * Hkv + h) * S + s_q) * n_split).to(gl.int64)
    cs = gl.arange(0, SB, layout=gl.SliceLayout(1, M2))
    gs = gl.arange(0, G, layout=gl.SliceLayout(0, M2))
    js = gl.arange(0, RV, layout=gl.SliceLayout(0, gl.SliceLayout(1, P3)))
    m_p = gl.full([G], -float("inf"), gl.float32, gl.SliceLayout(0, M2))
    l_p = gl.zeros([G], gl.float32, gl.SliceLayout(0, M2))
    a_p = gl.zeros([G, RV], gl.float32, gl.SliceLayout(0, P3))
    for c0 in range(0, n_split, SB):
        c = c0 + cs
        ok = (c < n_split)[:, None] & (gs >= 0)[None, :]
        prow = (row0 + c)[:, None] * G + gs[None, :]
        m_c = gl.load(m_ptr + prow, mask=ok, other=-float("inf"))
        l_c = gl.load(l_ptr + prow, mask=ok, other=0.0)
        a_c = gl.load(acc_ptr + (prow * RV_PAD)[:, :, None] + js[None, None, :],
                      mask=ok[:, :, None] & (js >= 0)[None, None, :], other=0.0)
        m_new = gl.maximum(m_p, gl.max(m_c, axis=0))
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
        w = gl.exp2(m_c - m_use[None, :])  # 0 for masked-off and empty splits
        alpha = gl.exp2(m_p - m_use)
        l_p = l_p * alpha + gl.sum(w * l_c, axis=0)
        a_p = a_p * gl.convert_layout(alpha, gl.SliceLayout(1, gl.SliceLayout(0, P3)))[:, None] \
            + gl.sum(w[:, :, None] * a_c, axis=0)
        m_p = m_new

    # the exact tokens' max and sum (pass 1): q (G, D_PAD), one token a step
    QL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[1, 32], warps_per_cta=[1, 1],
                                        order=[1, 0])
    QR: gl.constexpr = gl.SliceLayout(1, QL)
    rq = gl.arange(0, G, layout=QR)
    dq = gl.arange(0, D_PAD, layout=gl.SliceLayout(0, QL))
    dq_ok = dq < D
    qg = gl.load(q_ptr + b.to(gl.int64) * stride_qb + s_q * stride_qs + ((h * G + rq) * stride_qh)[:, None]
                 + (dq * stride_qd)[None, :], mask=dq_ok[None, :] & (rq >= 0)[:, None], other=0.0).to(gl.float32)
    nk_head = nk_ptr + b.to(gl.int64) * stride_nkb + h * stride_nkh
    nv_head = nv_ptr + b.to(gl.int64) * stride_nvb + h * stride_nvh
    m_e = gl.full([G], -float("inf"), gl.float32, QR)
    l_e = gl.zeros([G], gl.float32, QR)
    for j in range(0, n_exact):
        used = gl.load(slots_ptr + j) >= 0
        kj = gl.load(nk_head + j * stride_nks + dq * stride_nkd, mask=dq_ok & used, other=0.0).to(gl.float32)
        sc = gl.where(used, gl.sum(qg * kj[None, :], axis=1) * qk_scale, -float("inf"))
        m_new = gl.maximum(m_e, sc)
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
        l_e = l_e * gl.exp2(m_e - m_use) + gl.exp2(sc - m_use)
        m_e = m_new

    # the row's max, the latent's weight, the normaliser (per head)
    m_pq = gl.convert_layout(m_p, QR)
    m_all = gl.maximum(m_pq, m_e)
    m_all = gl.where(m_all == -float("inf"), 0.0, m_all)
    w_p = gl.exp2(m_pq - m_all)
    l_all = gl.convert_layout(l_p, QR) * w_p + l_e * gl.exp2(m_e - m_all)
    inv = gl.where(l_all > 0, 1.0 / gl.where(l_all > 0, l_all, 1.0), 0.0)
    aw = a_p * gl.convert_layout(w_p, gl.SliceLayout(1, gl.SliceLayout(0, P3)))[:, None]
    av = _bf16_rows(_rows_of_heads(aw, G), AL)  # (16, 32): rows r, 8 + r for head r % G

    # per 32 output channels: the value latent projected (tensor cores) + the exact tokens' values (pass 2)
    zero_o = gl.zeros([ROWS, 32], gl.float32, L)
    LO: gl.constexpr = gl.sum(gl.reshape(zero_o, [2, 8, 32]), axis=0).type.layout
    LR: gl.constexpr = gl.SliceLayout(1, LO)
    ro = gl.arange(0, 8, layout=LR)
    kb = gl.arange(0, RV, layout=gl.SliceLayout(1, BL))
    bv_head = bv_ptr + b.to(gl.int64) * stride_bvb + h * stride_bvh
    inv_o = _rows_vec(inv, G, LR)
    out_rows = out_ptr + b.to(gl.int64) * stride_ob + s_q * stride_os + (h * G + ro) * stride_oh
    for d0 in range(0, D_PAD, 32):
        nb = d0 + gl.arange(0, 32, layout=gl.SliceLayout(0, BL))
        pv = gl.load(bv_head + (kb * stride_bvr)[:, None] + (nb * stride_bvd)[None, :],
                     mask=(nb < D)[None, :] & (kb >= 0)[:, None], other=0.0).to(gl.float32)
        pv_hi = pv.to(gl.bfloat16)
        o = mma_v2(av, pv_hi, zero_o)
        if not BV_EXACT:
            o = mma_v2(av, (pv - pv_hi.to(gl.float32)).to(gl.bfloat16), o)
        o = gl.sum(gl.reshape(o, [2, 8, 32]), axis=0)
        do = d0 + gl.arange(0, 32, layout=gl.SliceLayout(0, LO))
        for j in range(0, n_exact):
            used = gl.load(slots_ptr + j) >= 0
            kj = gl.load(nk_head + j * stride_nks + dq * stride_nkd, mask=dq_ok & used, other=0.0).to(gl.float32)
            pj = gl.where(used, gl.exp2(gl.sum(qg * kj[None, :], axis=1) * qk_scale - m_all), 0.0)
            vj = gl.load(nv_head + j * stride_nvs + do * stride_nvd, mask=(do < D) & used, other=0.0).to(gl.float32)
            o = o + _rows_vec(pj, G, LR)[:, None] * vj[None, :]
        gl.store(out_rows[:, None] + (do * stride_od)[None, :], (o * inv_o[:, None]).to(out_ptr.dtype.element_ty),
                 mask=(ro < G)[:, None] & (do < D)[None, :])


@gluon.jit
def _mma_unit_kernel(
    qf_ptr, lk_ptr, lv_ptr, slots_ptr, kmeta_ptr, vmeta_ptr, m_ptr, l_ptr, acc_ptr, pt_ptr, stride_ptb,
    Hkv, S, n_exact, kv_len, s_max, tiles_per_split, n_split,
    k_scale_base, k_min_base, v_scale_base, v_min_base,
    stride_lkb, stride_lvb,
    G: gl.constexpr, RV_PAD: gl.constexpr, PAGE: gl.constexpr, PLO: gl.constexpr, COL_K: gl.constexpr,
    COL_V: gl.constexpr, BITS: gl.constexpr = 4, STAGES: gl.constexpr = 0, LANES: gl.constexpr = False,
    PSCAN: gl.constexpr = False, VPAIR: gl.constexpr = False, PDL: gl.constexpr = False,
    q_ptr=None, bk_ptr=None, nk_ptr=None, nv_ptr=None, bv_ptr=None, out_ptr=None, cnt_ptr=None, D=0, qk_scale=1.0,
    stride_qb=0, stride_qh=0, stride_qs=0, stride_qd=0, stride_bkb=0, stride_bkh=0, stride_bkd=0, stride_bkr=0,
    stride_nkb=0, stride_nkh=0, stride_nks=0, stride_nkd=0, stride_nvb=0, stride_nvh=0, stride_nvs=0, stride_nvd=0,
    stride_bvb=0, stride_bvh=0, stride_bvd=0, stride_bvr=0, stride_ob=0, stride_oh=0, stride_os=0, stride_od=0,
    FOLD: gl.constexpr = False, MERGE: gl.constexpr = False, D_PAD: gl.constexpr = 128,
    Q_EXACT: gl.constexpr = True, BK_EXACT: gl.constexpr = True, BV_EXACT: gl.constexpr = True,
    HINT: gl.constexpr = 0, EARLY: gl.constexpr = 0, IMMA: gl.constexpr = False, FPAIR: gl.constexpr = False,
    VIMMA: gl.constexpr = False,
):
    """:func:`_mma_attention_kernel` for unit-major latents (``latent_layout.LAYOUTS``): each byte column of a
    sequence's (page's) slots contiguous, COL_K / COL_V bytes apart (S_max, or the page size; multiples of 64).
    Every load of a 64-slot tile reads whole 32-byte sectors of one head's columns (keys 8 words a lane, values 8,
    the four fp16 fields 4 or 8 each, G = 8 the more), where row-major rows spread one head's 40 bytes a slot over
    four sectors shared with the other heads. Same grid, arguments (strides of sequences / pages in 4-byte words;
    field bases in fp16 units) and outputs; tiles of 64 slots (NT = G column tiles a slot group), the next
    unmasked tile's loads issued before the current one is computed. (Two tiles ahead, two tiles a loop iteration,
    and a cp.async pipeline through shared memory 4 stages deep were each correct and 0-10% slower on the H200:
    benchmarks/results/2026-12-04-unit-major-h200, r13-r15.)

    BITS 8: latents of the ``int8`` format (one code a byte column; keys and values 16 words a lane a tile, see
    :func:`_unit_step`), else ``int4``. LANES (:func:`lane_loads`): the register path's and the masked tail's loads
    from one address per lane and tensor (:func:`_unit_load`), else from whole-tile offsets (:func:`_tile_load`).
    VPAIR (BITS 8; :func:`value_pairs`): the value operand's slot pairs from one word each, in :func:`_group_pairs`'
    k order. PSCAN (:func:`page_scan`): tiles from the
    split's first unmapped page on run in the masked loop (:func:`_mapped_end`), so the unmasked ones skip the
    per-slot zeroing of unmapped pages. PDL (``latent_attention_triton.pdl_launches``): launched as a programmatic
    dependent of the query fold: ``griddepcontrol.wait`` before the folded query is read, and
    ``griddepcontrol.launch_dependents`` after the tile loops (the merge may launch; triggered at the start instead,
    the merge's waiting programs made batch 8, 128k 16 us slower at 1536 programs on the H200,
    benchmarks/results/2026-12-05-fewer-instructions r1).

    STAGES > 0 (2 or 4; ``DecodeConfig.stages_m``): the unmasked tiles go through a ring of STAGES shared-memory
    buffers filled by cp.async (:func:`_unit_issue`), STAGES - 1 tiles in flight while one is computed, each thread
    copying the words it reads back (:func:`_unit_staged`; correct without the barriers Triton adds); the masked
    tail tiles keep the register path. The 8-bit pass is latency-bound in registers (Nsight Compute: 12 warps an SM
    at 166 registers, 40% of cycles without an eligible warp); staged, it takes 142 registers (G = 4, offline
    sm_90a) and 4 + 2 NWS KB of shared memory a stage (a lane's 32 key and value words and 16 NWS field words;
    2 + 2 NWS KB at 4 bits). Its speed on the H200 is still to be measured
    (benchmarks/results/2026-12-04-staged-mma-h200).

    FOLD (:func:`fold_in_pass`): the query folded here (:func:`_fold_rows`; q (B, H, S, D), the key basis block and
    ``qk_scale`` in log2 units), qf not read. MERGE (:func:`merge_in_pass`): after storing its split, each program
    adds 1 to its row's arrival counter (``cnt`` (B * Hkv * S,) int32, zero before the call and left zero after it);
    the last one resets it and merges the row into out (:func:`_merge_in_pass`; new_k / new_v (B, Hkv, n_exact, D),
    the value basis block, out (B, H, S, D)). D_PAD: D rounded up to a power of two >= 32; Q_EXACT: q is bf16;
    BK_EXACT / BV_EXACT: the bases are bf16-exact (one tensor-core product, not hi + lo). HINT (:func:`load_hint`):
    the cache hint of the latent loads (lane loads). EARLY (:func:`early_tile`): the split's first tile prefetched
    into L2 (:func:`_prefetch_tile`) before the folded query is read. IMMA (:func:`int8_keys`; BITS 8, not FOLD):
    the key product on the integer tensor cores (:func:`_imma_query`, :func:`_imma_scores`). FPAIR
    (:func:`field_pairs`): the per-slot fp16 fields two slots a ``prmt``. VIMMA (:func:`int8_values`; with IMMA, G
    = 4 or 8): the value product on the integer tensor cores too (:func:`_vimma_step`)."""
    NT: gl.constexpr = G
    GROUPS: gl.constexpr = 8 // G
    KS: gl.constexpr = RK * GROUPS
    BT: gl.constexpr = 64
    NWS: gl.constexpr = 2 if NT == 8 else 1
    CKW: gl.constexpr = COL_K // 4
    CVW: gl.constexpr = COL_V // 4
    h = gl.program_id(0)
    c = gl.program_id(1)
    bs = gl.program_id(2)
    b = bs // S
    s_q = bs % S
    L: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L, k_width=2)
    BL: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=L, k_width=2)
    # key words (2 w, 4 q, 8 c, 4 b): lane q + 4c, the two words of a column adjacent (one 8-byte load)
    KWL: gl.constexpr = gl.BlockedLayout(size_per_thread=[2, 1, 1, 4], threads_per_warp=[1, 4, 8, 1],
                                         warps_per_cta=[1, 1, 1, 1], order=[0, 1, 2, 3])
    # value words (4 d, 4 q, 8 n, 2 m): lane q + 4n, the four words of a column adjacent (one 16-byte load)
    VWL: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, 1, 1, 2], threads_per_warp=[1, 4, 8, 1],
                                         warps_per_cta=[1, 1, 1, 1], order=[0, 1, 2, 3])
    # BITS 8: the same with a last dim e of two columns (keys: coordinates 8b + 2q + e; values: n + 8(2m + e))
    KWL8: gl.constexpr = gl.BlockedLayout(size_per_thread=[2, 1, 1, 4, 2], threads_per_warp=[1, 4, 8, 1, 1],
                                          warps_per_cta=[1, 1, 1, 1, 1], order=[0, 1, 2, 3, 4])
    VWL8: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, 1, 1, 2, 2], threads_per_warp=[1, 4, 8, 1, 1],
                                          warps_per_cta=[1, 1, 1, 1, 1], order=[0, 1, 2, 3, 4])
    # field words (8 r, 4 q, 2 e, NWS, 2 lo / hi byte): lane q + 4r, the scores' layout
    FWL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 2, NWS, 2], threads_per_warp=[8, 4, 1, 1, 1],
                                         warps_per_cta=[1, 1, 1, 1, 1], order=[4, 3, 2, 1, 0])

    lk_w = lk_ptr.to(gl.pointer_type(gl.int32))
    lv_w = lv_ptr.to(gl.pointer_type(gl.int32))
    k_col = gl.load(kmeta_ptr + 3 * h)  # first code byte (column)
    k_blk = gl.load(kmeta_ptr + 3 * h + 1)
    v_col = gl.load(vmeta_ptr + 3 * h)
    v_blk = gl.load(vmeta_ptr + 3 * h + 1)

    zero_s = gl.zeros([ROWS, 8 * NT], gl.float32, L)
    LS: gl.constexpr = gl.sum(gl.reshape(zero_s, [2, 8, 8 * NT]), axis=0).type.layout
    zero_s0 = gl.zeros([8, 8 * NT], gl.float32, LS)
    rows = gl.arange(0, 8, layout=gl.SliceLayout(1, LS))
    cols = gl.arange(0, 8 * NT, layout=gl.SliceLayout(0, LS))
    gl.static_assert(BITS == 8 or not VPAIR, "VPAIR: 8-bit codes only")
    gl.static_assert(not IMMA or (BITS == 8 and not FOLD), "IMMA: 8-bit codes, the fold kernel's query")
    # IMMA's instance layout: (NT n-tiles, 8 c, 4 q), lane 4c + q (the B fragment's column c, the scores' row c)
    IL: gl.constexpr = gl.BlockedLayout(size_per_thread=[NT, 1, 1], threads_per_warp=[1, 8, 4],
                                        warps_per_cta=[1, 1, 1], order=[2, 1, 0])
    # VIMMA's: (4 n-tiles of value coordinates, 8 gid, 4 tig)
    VIL: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, 1, 1], threads_per_warp=[1, 8, 4],
                                         warps_per_cta=[1, 1, 1], order=[2, 1, 0])
    gl.static_assert(not VIMMA or (IMMA and (G == 4 or G == 8) and not MERGE), "VIMMA: with IMMA, G = 4 or 8")

    # ---- per-program word offsets from the tile's first slot. Scores' (row, col = 8j + c) read slot 8c + grp NT + j
    tok_s = (cols % 8)[None, :] * 8 + (rows // G)[:, None] * NT + (cols // 8)[None, :]
    if BITS == 8:
        K5: gl.constexpr = KWL8
        w_k = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, K5)))))
        q_k = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, K5)))))
        c_k = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, K5)))))
        b_k = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, K5)))))
        e_k = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, K5)))))
        kcol = (k_col + 2 * q_k[None, :, None, None, None] + 8 * b_k[None, None, None, :, None]
                + e_k[None, None, None, None, :])
        koff = kcol * CKW + 2 * c_k[None, None, :, None, None] + w_k[:, None, None, None, None]
        V5: gl.constexpr = VWL8
        d_v = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, V5)))))
        q_v = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, V5)))))
        n_v = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, V5)))))
        m_v = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, V5)))))
        e_v = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, V5)))))
        vcol = (v_col + n_v[None, None, :, None, None] + 16 * m_v[None, None, None, :, None]
                + 8 * e_v[None, None, None, None, :])
        voff = vcol * CVW + 4 * q_v[None, :, None, None, None] + d_v[:, None, None, None, None]
    else:
        wK: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, KWL)))
        w_k = gl.arange(0, 2, layout=wK)
        q_k = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, KWL))))
        c_k = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, KWL))))
        b_k = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, KWL))))
        koff = ((k_col + q_k[None, :, None, None] + 4 * b_k[None, None, None, :]) * CKW + 2 * c_k[None, None, :, None]
                + w_k[:, None, None, None])
        d_v = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, VWL))))
        q_v = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, VWL))))
        n_v = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, VWL))))
        m_v = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, VWL))))
        voff = ((v_col + n_v[None, None, :, None] + 8 * m_v[None, None, None, :]) * CVW + 4 * q_v[None, :, None, None]
                + d_v[:, None, None, None])
    F4: gl.constexpr = gl.SliceLayout(4, FWL)
    r_f = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, F4))))
    q_f = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, F4))))
    e_f = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, F4))))
    i_f = gl.arange(0, NWS, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, F4))))
    lh_f = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, FWL)))))
    fw = (4 * q_f[None, :, None, None] + 2 * e_f[None, None, :, None] + ((r_f // G) * NT // 4)[:, None, None, None]
          + i_f[None, None, None, :])
    fw5 = fw[:, :, :, :, None]
    lh5 = lh_f[None, None, None, None, :]
    # an fp16 field at fp16 unit u is byte columns 2u (low byte) and 2u + 1
    foff_k = ((2 * (k_scale_base + k_blk) + lh5) * CKW + fw5, (2 * (k_min_base + k_blk) + lh5) * CKW + fw5)
    foff_v = ((2 * (v_scale_base + v_blk) + lh5) * CVW + fw5, (2 * (v_min_base + v_blk) + lh5) * CVW + fw5)
    if BITS == 8:
        KREG: gl.constexpr = KWL8
        VREG: gl.constexpr = VWL8
    else:
        KREG: gl.constexpr = KWL
        VREG: gl.constexpr = VWL
    kp, vp, fp_k, fp_v = _unit_lanes(lk_w, lv_w, k_col, v_col, (k_scale_base + k_blk, k_min_base + k_blk),
                                     (v_scale_base + v_blk, v_min_base + v_blk), CKW, CVW, KREG, VREG, FWL, G, NT,
                                     BITS)
    r_sel = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, FWL)))))
    r_sel = r_sel[:, None, None] + gl.zeros([8, 4, 2], gl.int32, gl.SliceLayout(3, gl.SliceLayout(4, FWL)))

    m_i = gl.full([8], -float("inf"), gl.float32, gl.SliceLayout(1, LS))
    LQ: gl.constexpr = gl.sum(gl.sum(gl.reshape(zero_s0, [8, NT, 4, 2]), axis=3), axis=1).type.layout
    l_q = gl.zeros([8, 4], gl.float32, LQ)
    n_q = gl.zeros([8, 4], gl.float32, LQ)
    if VIMMA:  # (8 rows, 32) in the value product's output layout (_vimma_step)
        zv = gl.zeros([4, 8, 4], gl.float32, VIL)
        acc = gl.reshape(gl.permute(gl.join(zv, zv), [1, 0, 2, 3]), [8, 32])
    else:
        acc = gl.zeros([ROWS, RV], gl.float32, L)
    ve = 14 + gl.program_id(0) * 0

    t_start, t_end, fast_end = _split_tiles(c, tiles_per_split, kv_len, slots_ptr, n_exact, BT)
    if PSCAN and PAGE > 0:  # unmapped pages go to the masked tiles: the unmasked ones need no per-slot zeroing
        fast_end = _mapped_end(t_start, fast_end, b, pt_ptr, stride_ptb, PAGE)
        ZFAST: gl.constexpr = False
    else:
        ZFAST: gl.constexpr = PAGE > 0
    # EARLY (early_tile): the split's first tile prefetched into L2 before the (folded) query is read, whose loads
    # and operand build it overlaps (under PDL also the fold's end); no registers held. The tile is in bounds even
    # where it will run masked (an unmapped page: page 0). What is read here (latents, slots, page table) the call's
    # earlier launches wrote, finished before the fold started.
    if EARLY:
        kb0, vb0, _i0 = _unit_base(t_start, b, pt_ptr, stride_ptb, stride_lkb, stride_lvb, PAGE)
        _prefetch_tile(lk_w, lv_w, kb0, vb0, k_col, v_col, (k_scale_base + k_blk, k_min_base + k_blk),
                       (v_scale_base + v_blk, v_min_base + v_blk), _page_shares(h, Hkv, stride_lkb, stride_lvb),
                       CKW, CVW, BITS)
    if PDL:  # a programmatic dependent of the query fold: read qf only after the fold's grid
        _gdc("wait")
    if FOLD:
        c8 = _fold_rows(q_ptr, bk_ptr, b, h, s_q, D, qk_scale, stride_qb, stride_qh, stride_qs, stride_qd,
                        stride_bkb, stride_bkh, stride_bkd, stride_bkr, G, D_PAD, Q_EXACT, BK_EXACT, L, AL, BL)
        ca, k_unit = _query_operand_regs(c8, G, GROUPS, KS, AL, BITS)
        sumc = gl.convert_layout(gl.sum(c8, axis=1), gl.SliceLayout(1, LS))
        sumc8 = sumc * (128.0 if BITS == 8 else 8.0)
    elif IMMA:  # uncentred u8 codes: no centring term
        q_row = qf_ptr + (((b * S + s_q) * Hkv + h) * G).to(gl.int64) * RK
        ca, k_unit, sumc = _imma_query(q_row, G, GROUPS, IL, LS)
        sumc8 = sumc * 0.0
    else:
        q_row = qf_ptr + (((b * S + s_q) * Hkv + h) * G).to(gl.int64) * RK
        ca, k_unit = _query_operand(q_row, G, GROUPS, KS, AL, True, BITS)
        sumc = _query_sums(q_row, G, LS)
        sumc8 = sumc * (128.0 if BITS == 8 else 8.0)
    all_s = tok_s >= 0
    if STAGES == 0:  # the register path's first tile
        kb0, vb0, idx_a = _unit_base(t_start, b, pt_ptr, stride_ptb, stride_lkb, stride_lvb, PAGE)
        if LANES:
            tile_a = _unit_load(kp, vp, fp_k, fp_v, kb0, vb0, CKW, CVW, KREG, VREG, FWL, NWS, BITS, HINT)
        else:
            tile_a = _tile_load(lk_w, lv_w, kb0, vb0, koff, voff, foff_k, foff_v)
    if STAGES > 0:
        if fast_end > t_start:  # a cp.async ring of STAGES tiles, STAGES - 1 in flight while one computes
            if BITS == 8:
                KSH: gl.constexpr = [STAGES, 2, 4, 8, 4, 2]
                VSH: gl.constexpr = [STAGES, 4, 4, 8, 2, 2]
                KOR: gl.constexpr = [0, 1, 2, 3, 4]
            else:
                KSH: gl.constexpr = [STAGES, 2, 4, 8, 4]
                VSH: gl.constexpr = [STAGES, 4, 4, 8, 2]
                KOR: gl.constexpr = [0, 1, 2, 3]
            # (stage outermost) each thread's words contiguous (the word dim first), then the lanes: its vector loads
            # hit 32 banks; fields (8 r, 4 q, 2 e, NWS, 2 lh): the lo / hi byte pair, then the lanes q + 4r
            WORDS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, KOR)
            FIELDS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [4, 1, 0, 2, 3])
            FSH: gl.constexpr = [STAGES, 8, 4, 2, NWS, 2]
            smem = (gl.allocate_shared_memory(gl.int32, KSH, WORDS), gl.allocate_shared_memory(gl.int32, VSH, WORDS),
                    gl.allocate_shared_memory(gl.int32, FSH, FIELDS), gl.allocate_shared_memory(gl.int32, FSH, FIELDS),
                    gl.allocate_shared_memory(gl.int32, FSH, FIELDS), gl.allocate_shared_memory(gl.int32, FSH, FIELDS))
            # (past the last tile an empty group keeps the count: wait_group(STAGES - 1) then still means "tile t
            # landed")
            for i in gl.static_range(STAGES - 1):
                if t_start + i < fast_end:
                    kb0, vb0, _i0 = _unit_base(t_start + i, b, pt_ptr, stride_ptb, stride_lkb, stride_lvb, PAGE)
                    _unit_issue(smem, i, lk_w, lv_w, kb0, vb0, koff, voff, foff_k, foff_v)
                else:
                    async_copy.commit_group()
            for t in range(t_start, fast_end):
                j = t - t_start
                if t + STAGES - 1 < fast_end:
                    kb1, vb1, _i1 = _unit_base(t + STAGES - 1, b, pt_ptr, stride_ptb, stride_lkb, stride_lvb, PAGE)
                    _unit_issue(smem, (j + STAGES - 1) % STAGES, lk_w, lv_w, kb1, vb1, koff, voff, foff_k, foff_v)
                else:
                    async_copy.commit_group()
                _kb, _vb, idx_c = _unit_base(t, b, pt_ptr, stride_ptb, stride_lkb, stride_lvb, PAGE)
                async_copy.wait_group(STAGES - 1)
                wk, wv, ks, km, vs, vm = _unit_staged(smem, j % STAGES, KREG, VREG, FWL)
                m_i, l_q, n_q, acc, ve = _unit_step(wk, wv, ks, km, vs, vm, r_sel, all_s, all_s & (idx_c >= 0), ca,
                                                    sumc, sumc8, k_unit, ve, m_i, l_q, n_q, acc, L, AL, BL, LS, KS, BT,
                                                    NT, G, GROUPS, NWS, PLO, False, ZFAST, BITS, VPAIR, IMMA, IL, FPAIR, VIMMA, VIL)
            async_copy.wait_group(0)
    else:  # one tile loaded ahead of the one computed (the first before the query)
        for t in range(t_start, fast_end):
            wk, wv, ks, km, vs, vm = tile_a
            idx_c = idx_a
            kb1, vb1, idx_a = _unit_base(gl.minimum(t + 1, fast_end - 1), b, pt_ptr, stride_ptb, stride_lkb,
                                         stride_lvb, PAGE)
            if LANES:
                tile_a = _unit_load(kp, vp, fp_k, fp_v, kb1, vb1, CKW, CVW, KREG, VREG, FWL, NWS, BITS, HINT)
            else:
                tile_a = _tile_load(lk_w, lv_w, kb1, vb1, koff, voff, foff_k, foff_v)
            m_i, l_q, n_q, acc, ve = _unit_step(wk, wv, ks, km, vs, vm, r_sel, all_s, all_s & (idx_c >= 0), ca,
                                                sumc, sumc8, k_unit, ve, m_i, l_q, n_q, acc, L, AL, BL, LS, KS, BT,
                                                NT, G, GROUPS, NWS, PLO, False, ZFAST, BITS, VPAIR, IMMA, IL, FPAIR, VIMMA, VIL)
    for t in range(fast_end, t_end):
        t0 = t * BT
        if PAGE > 0:
            r0 = t0
        else:
            r0 = gl.minimum(t0, s_max - BT)
        kb1, vb1, idx1 = _unit_base(r0 // BT, b, pt_ptr, stride_ptb, stride_lkb, stride_lvb, PAGE)
        gs = r0 + tok_s
        ok_s = (gs >= t0) & (gs < kv_len) & ~_is_exact(gs, slots_ptr, n_exact)
        if LANES:
            wk, wv, ks, km, vs, vm = _unit_load(kp, vp, fp_k, fp_v, kb1, vb1, CKW, CVW, KREG, VREG, FWL, NWS, BITS,
                                                HINT)
        else:
            wk, wv, ks, km, vs, vm = _tile_load(lk_w, lv_w, kb1, vb1, koff, voff, foff_k, foff_v)
        m_i, l_q, n_q, acc, ve = _unit_step(wk, wv, ks, km, vs, vm, r_sel, ok_s, ok_s & (idx1 >= 0), ca, sumc, sumc8,
                                            k_unit, ve, m_i, l_q, n_q, acc, L, AL, BL, LS, KS, BT, NT, G, GROUPS, NWS,
                                            PLO, True, True, BITS, VPAIR, IMMA, IL, FPAIR, VIMMA, VIL)
    if PDL:  # the tiles are done: the merge may launch (it waits for this grid before it reads the partials)
        _gdc("launch_dependents")
    _store_split(acc, n_q, l_q, m_i, ve, acc_ptr, m_ptr, l_ptr, b, h, s_q, c, Hkv, S, n_split, LS, RV_PAD, True, G,
                 GROUPS, BITS, VIMMA)
    if MERGE:
        _barrier()  # every lane's partial stores precede the release below
        row = (b * Hkv + h) * S + s_q
        arrived = gl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
        if arrived == n_split - 1:  # the row's last split: reset its counter for the next call, then merge
            gl.store(cnt_ptr + row, 0)
            _merge_in_pass(q_ptr, nk_ptr, nv_ptr, bv_ptr, slots_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, b, h, s_q, Hkv,
                           S, n_exact, n_split, D, qk_scale, stride_qb, stride_qh, stride_qs, stride_qd, stride_nkb,
                           stride_nkh, stride_nks, stride_nkd, stride_nvb, stride_nvh, stride_nvs, stride_nvd,
                           stride_bvb, stride_bvh, stride_bvd, stride_bvr, stride_ob, stride_oh, stride_os, stride_od,
                           G, D_PAD, RV_PAD, BV_EXACT, L, AL, BL)


def mma_layout(group: int, k_fmt, v_fmt, k_offsets, v_offsets, rk_max: int, rv_max: int, layouts: tuple,
               block_n: int, page: int, device: torch.device, masked: bool, columns: int = 0) -> dict | None:
    """The MMA pass's layout for one table-free call, or None where it does not apply.

    Applies to int4 key and value formats (or int8 ones, unit-major only) of one quantization block per head (block
    >= 32) at rank 32 for every KV head, G in :data:`MMA_GROUPS`, no attention mask, on a CUDA device of compute
    capability 8.0 or later, and key and value latents both

    * row-major (:mod:`.latent_layout`), heads' code bytes on 4-byte words: :func:`_mma_attention_kernel`, tiles
      of ``block_n`` slots (64 or 128: ``NT = block_n / (8 * 8 / G)`` tensor-core column tiles per slot group, at
      most 8), pages (if any) a multiple of the tile. The caller checks the rows' byte strides and the scales' fp16
      alignment (``_word_rows``); or
    * unit-major: :func:`_mma_unit_kernel`, tiles of 64 slots (``block_n`` is not used), ``columns`` (the byte
      columns' length: S_max, or the page size) a multiple of 64. The caller checks the strides.

    Args:
        group: G; k_fmt / v_fmt: parsed :class:`~ckvp_compile.kernels.latent_format.LatentFormat`; k_offsets /
            v_offsets: (Hkv + 1,) latent coordinate offsets; rk_max / rv_max: the basis blocks' widths; layouts:
            the key and value latents' layouts (:func:`~ckvp_compile.kernels.latent_layout.layout_of`); block_n:
            slots per tile; page: slots per page (0: not paged); device: where the call runs; masked: an attention
            mask is given; columns: slots per byte column (unit-major).
    Returns:
        dict(NT, GROUPS, BT, UNIT, BITS) or None. Raises nothing: the launcher then runs the other kernels.
    """
    if masked or device.type != "cuda" or not torch.cuda.is_available() or torch.version.hip is not None:
        return None  # (ROCm reports "cuda" devices too; the kernels are inline PTX)
    if torch.cuda.get_device_capability(device)[0] < 8:
        return None
    return _mma_layout(int(group), k_fmt, v_fmt, tuple(int(o) for o in k_offsets), tuple(int(o) for o in v_offsets),
                       int(rk_max), int(rv_max), tuple(layouts), int(block_n), int(page), int(columns))


@functools.lru_cache(maxsize=256)
def _mma_layout(group: int, k_fmt, v_fmt, k_offsets: tuple, v_offsets: tuple, rk_max: int, rv_max: int,
                layouts: tuple, block_n: int, page: int, columns: int) -> dict | None:
    if group not in MMA_GROUPS or rk_max != MMA_RANK or rv_max != MMA_RANK or layouts[0] != layouts[1]:
        return None
    unit = layouts[0] == "unit-major"
    if not unit and layouts[0] != "row-major":
        return None
    if k_fmt.bits != v_fmt.bits or (k_fmt.bits == 8 and not unit):  # 8-bit codes: the unit-major kernel only
        return None
    for f, offsets in ((k_fmt, k_offsets), (v_fmt, v_offsets)):
        if not f.uniform_int_blocks(32) or f.bits not in (4, 8) or f.block < MMA_RANK:
            return None
        if any(b - a != MMA_RANK for a, b in zip(offsets, offsets[1:])):
            return None
        cb = f.code_bytes(list(offsets))
        if not unit and any(sum(cb[:i]) % 4 for i in range(len(cb))):
            return None
    groups = 8 // group
    if unit:
        if columns <= 0 or columns % 64 or (page and page % 64):
            return None
        return dict(NT=group, GROUPS=groups, BT=64, UNIT=True, BITS=k_fmt.bits)
    nt = block_n // (8 * groups)
    if block_n not in (64, 128) or nt > 8:  # (G = 8 at 128 slots: 16 column tiles a slot group, past the registers)
        return None
    if page and page % block_n:
        return None
    return dict(NT=nt, GROUPS=groups, BT=block_n, UNIT=False, BITS=4)


def mma_splits(kv_len: int, block_n: int, rows: int, target: int, fixed: int | None = None,
               min_tiles: int = 4) -> tuple[int, int]:
    """``(programs along the context, tiles per program)`` for the MMA pass: about ``target`` one-warp programs in
    all (``rows`` = B * Hkv * S of them per context position), at least ``min_tiles`` tiles each, none empty
    (``fixed``: that many splits, as ``DecodeConfig.split``), at most :data:`MAX_GRID_Y`. kv_len and block_n in
    slots. Raises nothing. Source:
    FlashDecoding's split-KV; the target from the H200 sweep (benchmarks/results/2026-12-04-mma-h200, r1 and r4)."""
    n_tiles = -(-kv_len // block_n)
    if fixed is not None:
        n = max(1, min(fixed, n_tiles, MAX_GRID_Y))
    else:
        n = max(1, min(max(1, target // max(rows, 1)), n_tiles // max(min_tiles, 1), MAX_GRID_Y))
    per = -(-n_tiles // n)
    return -(-n_tiles // per), per


def compile_for_sm90(group: int = 4, nt: int = 4, page: int = 0, row_k: int = 40, row_v: int = 40,
                     unit_major: bool = False, bits: int = 4, stages: int = 0, lanes: bool | None = None,
                     pscan: bool | None = None, vpair: bool | None = None,
                     maxnreg: int | None = None, pdl: bool = False, fold: bool = False, merge: bool = False,
                     exact_bases: bool = True, hint: int | None = None, early: bool | None = None,
                     imma: bool | None = None, fpair: bool | None = None, vimma: bool | None = None,
                     one_token: bool = False):
    """Compile the MMA kernel for sm_90a without a GPU (Triton's ahead-of-time path; for tests and SASS reading).

    Args:
        group: G (2, 4 or 8); nt: tensor-core column tiles per slot group (tile = 8 * nt * 8 / G slots); page: slots
            per page (0: a static cache); row_k / row_v: the latents' row strides in 4-byte words (40: 8 KV heads
            of rank 32 at int4/32, 160-byte rows); unit_major: the unit-major kernel (columns of 4096 slots, or of
            a page); bits: the codes' width (8: the unit-major kernel's ``int8`` path); stages: the unit-major
            kernel's cp.async ring (0: loads into registers one tile ahead); lanes: the unit-major kernel's
            loads from one address per lane (None: :func:`lane_loads`); pscan: unmapped pages to the masked loop
            (None: :func:`page_scan`); vpair: 8-bit value pairs from one word (None: :func:`value_pairs`; 4-bit kernels
            ignore it); maxnreg: ptxas's register cap (None: its own choice); pdl: the unit-major kernel's
            programmatic dependent launch instructions (``PDL``; the launch option is the launcher's); fold / merge:
            the unit-major kernel's query fold and split merge in the pass (``FOLD`` / ``MERGE``; bf16 q, bases, new
            tokens and output, head dim 128); exact_bases: bf16 bases (one tensor-core product, not hi + lo); hint:
            the latent loads' cache hint (``HINT``; None: :func:`load_hint`); early: the first tile before the folded
            query in L2 (``EARLY``; None: :func:`early_tile`); imma: the 8-bit key product on the integer tensor
            cores (``IMMA``; None: :func:`int8_keys`; 4-bit kernels and ``fold`` ignore it); fpair: the fp16
            fields two slots a ``prmt`` (``FPAIR``; None: :func:`field_pairs`); vimma: the value product on the
            integer tensor cores too (``VIMMA``; None: :func:`int8_values`; only with IMMA at G = 4 or 8); one_token:
            ``S`` and ``n_exact`` as the constant 1, as Triton specialises a one-query-token decode launch (its
            integer arguments equal to 1): the kernel such a launch runs, whose register count can differ (the
            unit-major 8-bit kernel with IMMA, FPAIR and VIMMA at G = 4: 106 registers without, 128 with).
    Returns:
        Triton's compiled kernel (``asm["ptx"]``, ``asm["ttgir"]``, ``metadata.shared``).
    Raises:
        ValueError: ``bits`` not 4 or 8, or 8 without ``unit_major`` (the row-major kernel reads 4-bit codes only).
        Whatever Triton's compiler raises for a kernel it cannot build.
    """
    if bits not in (4, 8) or (bits == 8 and not unit_major):
        raise ValueError(f"bits must be 4, or 8 with unit_major=True (the row-major kernel reads 4-bit codes), got "
                         f"bits={bits}, unit_major={unit_major}")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = dict(qf_ptr="*fp32", lk_ptr="*u8", lv_ptr="*u8", slots_ptr="*i64", kmeta_ptr="*i32", vmeta_ptr="*i32",
               m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", pt_ptr="*i32", stride_ptb="i32", Hkv="i32", S="i32",
               n_exact="i32", kv_len="i32", s_max="i32", tiles_per_split="i32", n_split="i32", k_scale_base="i32",
               k_min_base="i32", v_scale_base="i32", v_min_base="i32", stride_lkb="i32", stride_lvb="i32",
               G="constexpr", NT="constexpr", RV_PAD="constexpr", PAGE="constexpr", PLO="constexpr",
               ROW_K="constexpr", ROW_V="constexpr")
    attrs = {(i,): [["tt.divisibility", 16]] for i in (*range(10), 22, 23)}  # pointers; sequence / page strides
    if unit_major:  # columns of a 4096-slot static cache, or of a page
        sig = {k: v for k, v in sig.items() if k not in ("NT", "ROW_K", "ROW_V")}
        sig.update(COL_K="constexpr", COL_V="constexpr", BITS="constexpr", STAGES="constexpr", LANES="constexpr",
                   PSCAN="constexpr", VPAIR="constexpr", PDL="constexpr", IMMA="constexpr", FPAIR="constexpr",
                   VIMMA="constexpr")
        sig.update({n: "*bf16" for n in ("q_ptr", "bk_ptr", "nk_ptr", "nv_ptr", "bv_ptr", "out_ptr")})
        sig.update(cnt_ptr="*i32", D="i32", qk_scale="fp32")
        sig.update({f"stride_{t}{x}": "i32" for t, xs in (("q", "bhsd"), ("bk", "bhdr"), ("nk", "bhsd"), ("nv", "bhsd"),
                                                           ("bv", "bhdr"), ("o", "bhsd")) for x in xs})
        unit = ("stride_qd", "stride_bkr", "stride_nkd", "stride_nvd", "stride_bvr", "stride_od")
        sig.update({n: "constexpr" for n in unit})  # (a launch specialises unit strides the same way)
        sig.update(FOLD="constexpr", MERGE="constexpr", D_PAD="constexpr", Q_EXACT="constexpr", BK_EXACT="constexpr",
                   BV_EXACT="constexpr", HINT="constexpr", EARLY="constexpr")
        attrs.update({(i,): [["tt.divisibility", 16]] for i in range(36, 44)})  # q_ptr .. cnt_ptr, D
        col = page or 4096
        if one_token:  # (keys keep their order: the attributes above index the signature)
            sig.update(S="constexpr", n_exact="constexpr")
        src = GluonASTSource(_mma_unit_kernel, sig, attrs=attrs,
                             constexprs=dict(G=group, RV_PAD=32, PAGE=page, PLO=True, COL_K=col, COL_V=col,
                                             BITS=bits, STAGES=stages, **({"S": 1, "n_exact": 1} if one_token else {}),
                                             LANES=lane_loads() if lanes is None else lanes,
                                             PSCAN=page_scan() if pscan is None else pscan,
                                             VPAIR=bits == 8 and (value_pairs() if vpair is None else vpair),
                                             PDL=pdl, FOLD=fold, MERGE=merge, D_PAD=128, Q_EXACT=True,
                                             BK_EXACT=exact_bases, **{n: 1 for n in unit},
                                             HINT=load_hint() if hint is None else hint,
                                             EARLY=early_tile() if early is None else early,
                                             IMMA=bits == 8 and not fold and (int8_keys() if imma is None else imma),
                                             FPAIR=field_pairs() if fpair is None else fpair,
                                             VIMMA=bits == 8 and not fold and not merge and group in (4, 8)
                                             and (int8_keys() if imma is None else imma)
                                             and (int8_values() if vimma is None else vimma),
                                             BV_EXACT=exact_bases))
    else:
        src = GluonASTSource(_mma_attention_kernel, sig, attrs=attrs,
                             constexprs=dict(G=group, NT=nt, RV_PAD=32, PAGE=page, PLO=True, ROW_K=row_k,
                                             ROW_V=row_v))
    options = {"num_warps": 1} if maxnreg is None else {"num_warps": 1, "maxnreg": maxnreg}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
