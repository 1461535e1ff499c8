"""Fused Triton attention over the cross-layer latent KV cache (flash-decoding over packed, quantized latents).

Notation and layout: :mod:`ckvp_compile.kernels.reference` (``B, H, Hkv, S, D``, ``G = H/Hkv`` query heads per KV
head, latent ranks ``r_h``, ``R_max`` basis width) and :mod:`ckvp_compile.kernels.latent_format` (storage rows).

Algorithm, two launches, no host synchronisation:

* ``_latent_attention_split_kernel``, grid (n_split, B*Hkv, S). Program (c, b*Hkv+h, s) walks its contiguous
  range of BLOCK_N-slot tiles of [0, kv_len) for sequence b, KV head h, query token s. Per tile it loads the key
  and value latent rows of head h (float, or packed codes dequantized in registers with their block's fp16
  scale and min), rebuilds the tile's pre-RoPE keys with ``tl.dot`` against the layer's basis block
  (R x D, in BLOCK_R chunks), rotates them at each slot's position (cos/sin rows gathered from the tables through
  ``slot_pos``), scores the G query heads of h at once (GQA: one latent read serves G heads), applies the mask,
  and folds the tile into an fp32 online softmax (FlashAttention-2's running max / sum) whose accumulator is the
  softmax-weighted VALUE LATENT, (G, Rv): value absorption as in DeepSeek-V2's MLA, so dense values are never
  formed. The exact tokens' slots (``slots``: the current call's, and a recent window's kept dense; -1 marks an
  unused entry) are skipped here. It stores (max, sum, accumulator) per program. Paged latents (``page_table``:
  page pools (N_pages + 1, P, W)): each tile looks up its slots' pages in the table and reads row ``t % P`` of page
  ``table[b, t // P]`` (H200: bit-identical to the contiguous layout, 1.4-8% slower;
  benchmarks/results/2026-11-30-paged-attention-h200).
* ``_latent_attention_reduce_kernel``, grid (B*Hkv, S): merges the splits' partial softmaxes (FlashDecoding's
  second step), adds the exact tokens from ``new_k`` / ``new_v`` (tiles of NB tokens), projects the absorbed
  latent once with the basis_v block, ``out = (acc @ P_v^T + w_new @ new_v) / sum``, and stores (G, D) per program.

RoPE without register shuffles: each form pairs channel ``i1(j)`` with ``i2(j)``, j < rotary_dim/2
(rotate_half: j and j + rd/2; interleaved / complex: 2j and 2j+1), and
``out[i1] = x[i1] cos1 - x[i2] sin1``, ``out[i2] = x[i2] cos2 + x[i1] sin2`` with table columns c1(j), c2(j)
(rotate_half: j, j + rd/2; interleaved: 2j, 2j+1; complex: j, j). So the basis rows i1(.), i2(.) and the rest
(rd:D) are loaded as three separate (R, ·) operands, the keys come out of ``tl.dot`` already split in the pairs'
halves, and the query is loaded split the same way; scores are the sum of three dots.

Precision: every product runs on bf16 tensor cores with fp32 accumulation; an operand that is not exactly
bf16 (fp32 or fp16 data, dequantized latents, softmax weights, rebuilt keys) is split into bf16 hi + lo parts
and multiplied twice (``_dot_split``: about 16 mantissa bits, error ~1e-5 relative), which keeps the kernel
within 1e-3 of the fp32 reference; a bf16 latent against a bf16 basis is one exact bf16 dot.

Loads: a quantized block's fp16 scale and min (``-f8`` formats: its e4m3 span and min bytes, constexpr META8) are
loaded once per row and broadcast over its coordinates; int4 / int2 codes are loaded as whole bytes and unpacked
with ``tl.join``; host-checked alignments of the heads' columns, ranks and rotary half are passed as constexprs so
that row loads vectorise (``cp.async`` 16 B).

Status (benchmarks/results/2026-11-29-latent-attention-h200, runs 3-7): exact under the interpreter; on the H200
within 1e-3 of the reference at every measured row, but slow. Run 5 (two-pass, mxint8/32 rank 256): 10-12% of
copy bandwidth at batch >= 8 (0.09-0.10x dense SDPA, whose bytes are 0.97x the latent's); run 6 (16 query and 16
KV heads, int4/32 rank 256, batch 8, 32k): 5.1-8.8 ms against 0.49 ms for dense SDPA; run 8 (whole waves, G = 1
defaults): 5.0 ms (16:16) and 3.9 ms (32:8, dense 0.26 ms). Nsight Compute (run 8): 255 registers, 2 programs per
SM, 0.34 eligible warps per scheduler, spills: latency- and issue-bound, DRAM at 5% of peak. Registers, spills and
shared memory can be read without a GPU (``benchmarks/latent_attention_aot.py``: compiled for sm_90a with the
H200's Triton 3.6): int4 tiles were read one byte per load until the column masks moved to byte units. Since then
(runs 10-11 and benchmarks/results/2026-11-30-recent-window-h200): 4.33 ms (16:16, with the value latent on the
CUDA cores and the exact-slot check only on tiles that reach an exact slot) and 2.86 ms (32:8), still 9-11x dense;
a dense recent window of up to 128 tokens adds at most 0.12 ms. At one query head per KV head the value pass now
sums its weighted rows elementwise and reduces once per program (4.32 -> 3.29 ms at 16:16;
benchmarks/results/2026-11-30-latent-attention-v2-h200, which also records the negative result of a runtime
rank-chunk loop with the exact code-domain rebuild: 1.3-2x slower).
``ckvp::latent_attention``'s CUDA kernel runs it (``ops.latent_attention_cuda.USE_TRITON``); fp8 bases and
``mix`` plans too, since run 7 checked them on the H200 (:data:`FP8_BASES_GPU_CHECKED`, :data:`MIX_GPU_CHECKED`:
within 1e-3 at batch 8, 32k; mix plans about 2x slower than uniform int4).
Roofline: rebuilding keys costs 2*D FLOP per latent coordinate and token, so at D = 128 the work is 256 FLOP per
byte read for 8-bit latents and 512 for 4-bit (twice that with the hi/lo split), against the H200's bf16 ridge of
about 231 FLOP per byte (989 TFLOP/s over a measured 4.28 TB/s copy): low-bit latents make this kernel
compute-bound unless the rebuild gets cheaper.

The ``@triton.jit`` helpers (``_latent_tile``, ``_dot_split``, ``_rope_rows``, ``_exact_scores``) and both kernels are
the single source a future Inductor ``TritonTemplate`` lowering is meant to call. Sources (read, not copied):
FlashDecoding (Dao et al., 2023, https://crfm.stanford.edu/2023/10/12/flashdecoding.html: split-KV + reduction),
FlashAttention-2 (Dao, 2023, arXiv:2307.08691: online softmax), DeepSeek-V2 (arXiv:2405.04434: latent absorption),
xKV (arXiv:2503.18893) / Palu (arXiv:2407.21118): RoPE re-applied to low-rank keys inside the kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from .device_cache import check_not_capturing
from .latent_format import parse_latent_format
from .latent_layout import layout_of
from .reference import ROPE_FORMS

__all__ = ["DecodeConfig", "context_splits", "declare_paired_tables", "default_config", "head_group_window",
           "latent_attention_from_scores_triton", "latent_attention_triton", "latent_scores_triton",
           "paired_tables_declared", "rope_tables_paired", "score_batch_slices", "unsupported_reason"]

_ROPE_CODE = {"none": 0, "rotate_half": 1, "interleaved": 2, "complex": 3}
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
#: Basis dtypes whose values are exact in bf16 (one tensor-core product, no hi/lo split): bf16 and the fp8 formats
#: (``LatentKVStore(basis_dtype=torch.float8_e4m3fn)``; 3 or 2 mantissa bits, exponents inside bf16's range).
BASIS_BF16_EXACT = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
_BASIS_DTYPES = _FLOATS + BASIS_BF16_EXACT[1:]
#: Inputs first checked under the interpreter (tests/kernels), then on the H200 (benchmarks/latent_attention_gpu.py
#: --check-extras, run 7: fp8 bases and mix 8/4/2 plans within 1e-3 at batch 8, 32k). While False, CUDA calls with
#: them go to the reference; a new input kind gets its own flag, False until a GPU run checks it.
FP8_BASES_GPU_CHECKED = True
MIX_GPU_CHECKED = True
#: Latents whose row units are strided (the unit-major layout, :mod:`.latent_layout`): equal to the row-major results
#: under the interpreter (tests/kernels) and on the H200 (``benchmarks/config_sweep_gpu.py`` cases ending in ``:u``,
#: 16:16 ranks 8-96 and 32:8 rank 96 at batch 8, 32k, each call's error that of the row-major call;
#: benchmarks/results/2026-12-01-largebatch-h200), though 1.14-1.94x slower there.
STRIDED_LATENTS_GPU_CHECKED = True
#: ``-f8`` latent formats (one e4m3 span and one e4m3 min byte per block): read by this module's kernels, equal to the
#: reference under the interpreter (tests/kernels/test_latent_attention_f8.py) and on the H200
#: (benchmarks/f8_meta_gpu.py; benchmarks/results/2026-12-05-f8-meta-h200/r1: 21 cases of int4/32-f8, int8/32-f8 and a
#: mix/32-f8 plan, ranks 32 and 64, batch 1 and 8, 4k and 32k, static and paged, largest relative error 5.5e-4).
F8_META_GPU_CHECKED = True
#: Register limits of one program (how to retune: raise only with a GPU run that checks spills and numerics).
#: MAX_ROTATED_RANK: widest padded key rank DecodeConfig.rotate_basis applies to (its (rank, D/2) coefficient
#: blocks stay on chip across the tile loop; at 128, paired, the key pass spills 54 registers and is still 1.4x
#: faster than the rebuild).
MAX_ROTATED_RANK = 128
MAX_HEAD_DIM = 256
MAX_RANK = 512
MAX_GROUP = 64

#: Programmatic dependent launch (PDL, sm_90+) along the MMA pass's three launches: the query fold lets the pass's
#: programs start at once (``griddepcontrol.launch_dependents``), the pass reads the folded query only after
#: ``griddepcontrol.wait`` and lets the merge launch after its tile loops, and the merge loads the value basis, the
#: query (and, the fma merge, the exact tokens) before it waits for the partials: each launch's latency and prologue
#: overlap the kernel before it. Every write stays after its kernel's wait. Checked on the H200 with the pass
#: triggering at its start (benchmarks/results/2026-12-05-fewer-instructions, r1: correct, CUDA-graph replays bit-equal
#: to eager calls) but mixed there: batch 8, 32k -1 us at 2112 programs, batch 8, 128k +16 us at 1536; off
#: (``CKVP_PDL=1`` turns it on) except for short splits (:data:`PDL_MAX_TILES`).
PDL_GPU_CHECKED = False

#: PDL on by default where the MMA pass's splits have at most this many 64-slot tiles, i.e. where the launches' fixed
#: costs are a large share of a call. With the pass triggering after its tile loops and its first tile prefetched
#: (H100, benchmarks/results/2026-12-06-early-tile, r3 and r4, two interleaved repeats each, int8/32 at 2112
#: programs): batch 8, 32k (16 tiles a split) 58.5-58.7 us a call against 59.2-59.4 without; at 64 tiles a split
#: (batch 8, 128k; batch 32, 32k and 128k) -0.3% to +0.8%.
PDL_MAX_TILES = 16

#: The MMA pass's merge in fp32 multiply-adds, one warp per query head (:func:`_merge_fma_kernel`: no tensor-core
#: tiles padded to 16 heads, no hi / lo splits, no per-head loop) instead of the per-head and one-pass
#: merges, which take 7-8 us at every batch and context on the H200 (2,200 instructions a warp at 9.4 cycles each:
#: batch 8, 32k, 8 us of a 54 us call). Checked on the H200 (benchmarks/results/2026-12-05-fewer-instructions, r1:
#: 24 int8 cases at GQA 2-8, batch 2 and 20, errors <= 5e-7 with fp32 outputs): 3.6-4.7 us a call where the others
#: took 7.2-8.5 (batch 8, 32k: 52.3 against 56.7 us a call). ``CKVP_FMA_MERGE=0`` turns it off.
FMA_MERGE_GPU_CHECKED = True

#: Warps of a :func:`_merge_fma_kernel` program (one: its reductions stay in the warp, no shared memory or barriers).
FMA_MERGE_WARPS = 1

#: Splits of the partials :func:`_merge_fma_kernel` reads per step and head (the MMA pass's default grid makes about
#: 24 a row at 8 KV heads: one step).
FMA_MERGE_SPLITS = 32


def fma_merge_on() -> bool:
    """Whether the MMA pass's calls without an attention mask merge with :func:`_merge_fma_kernel`
    (:data:`FMA_MERGE_GPU_CHECKED`, or ``CKVP_FMA_MERGE=1`` / ``0``). Raises nothing."""
    env = os.environ.get("CKVP_FMA_MERGE")
    return FMA_MERGE_GPU_CHECKED if env is None else env == "1"


def _prefetches(lam, latent_k: torch.Tensor, latent_v: torch.Tensor) -> dict:
    """The unit-major pass's L2 prefetch of its first tile (``EARLY``: latent_attention_mma.early_tile), off unless
    the latents start on 16-byte boundaries (the bulk prefetch's alignment)."""
    aligned = latent_k.data_ptr() % 16 == 0 and latent_v.data_ptr() % 16 == 0
    return dict(EARLY=lam.early_tile() and aligned)


#: The query fold itself launched as a programmatic dependent of whatever kernel precedes the call (its
#: ``griddepcontrol.wait`` before it reads q), where the MMA pass's launches chain by PDL: the launch's latency then
#: overlaps that kernel's end. Off until measured on the GPU (``CKVP_PDL_FOLD=1`` turns it on).
PDL_FOLD_GPU_CHECKED = False


def pdl_fold() -> bool:
    """Whether the query fold is launched as a programmatic dependent of the kernel before it, where the MMA pass's
    launches chain by PDL (:data:`PDL_FOLD_GPU_CHECKED`, or ``CKVP_PDL_FOLD=1`` / ``0``). Raises nothing. Source:
    the CUDA Programming Guide's programmatic dependent launch."""
    env = os.environ.get("CKVP_PDL_FOLD")
    return PDL_FOLD_GPU_CHECKED if env is None else env == "1"


def pdl_launches(device: torch.device, tiles_per_split: int | None = None) -> bool:
    """Whether the MMA pass's launches chain by programmatic dependent launch on ``device``: ``CKVP_PDL=1`` / ``0``,
    else :data:`PDL_GPU_CHECKED`, or splits of ``tiles_per_split`` <= :data:`PDL_MAX_TILES` tiles; CUDA devices of
    compute capability 9.0 and later only, never under the interpreter. Raises nothing. Source: the CUDA Programming
    Guide's programmatic dependent launch (``cudaLaunchAttributeProgrammaticStreamSerialization``, Triton's
    ``launch_pdl``) and the PTX ISA's ``griddepcontrol``."""
    env = os.environ.get("CKVP_PDL")
    if env is not None:
        on = env == "1"
    else:
        on = PDL_GPU_CHECKED or (tiles_per_split is not None and tiles_per_split <= PDL_MAX_TILES)
    return (on and device.type == "cuda" and not _interpreting()
            and torch.cuda.get_device_capability(device)[0] >= 9)


@dataclass(frozen=True)
class DecodeConfig:
    """Launch configuration. block_n: slots per tile; block_r: latent coordinates per rebuild chunk;
    split: programs per (sequence, KV head, query) along the context (None: enough to fill ``target_programs``);
    min_tiles: fewest tiles per split (bounds the partial-result traffic at short contexts);
    key_split: rebuild keys from a non-bf16 latent (quantized, fp16, fp32) with the hi/lo split (two bf16 dots,
    ~fp32 accurate); False rounds the latent to bf16 once (one dot, about 2x less tensor work, ~2^-9 relative
    error per coordinate); hoist_basis: load the whole basis block once per program, before the tile loop (one
    rebuild dot over all of R per tile; needs registers or shared memory for it), instead of a BLOCK_R chunk per
    tile from L2; f32_dots: multiply the bf16 parts as fp32 (tf32 tensor cores, same products; always on under
    the interpreter); align_hint: tell the compiler how the heads' first columns are aligned (vector loads);
    fma_scores: score the rebuilt keys against the query heads on the CUDA cores in fp32 when a KV head serves at
    most ``fma_max_heads`` query heads (else a tensor-core product padded to 16 heads with a hi/lo split of the
    keys); p_bf16: round the softmax weights to bf16 once for the value product (FlashAttention-2's practice,
    ~2^-9 relative per weight) instead of a hi/lo split (two products); two_pass: score every tile first (keys
    only), then softmax and value product in a second launch (tiles of ``block_n_v`` slots, ``num_warps_v`` warps;
    None: as the first), which keeps far fewer registers live than the one-pass kernel (``False``; the default
    at G > 1 up to rank 128, measured faster there);
    paired_tables: the caller guarantees that the cos/sin tables hold one angle per rotated pair (HF's
    ``cat((freqs, freqs))`` for rotate_half, ``repeat_interleave`` for interleaved; check once with
    :func:`rope_tables_paired`), so the kernel loads half of the table bytes; wrong results if they do not. Off by
    default: the launcher never decides it from the tables' values (see :func:`rope_tables_paired`);
    fma_values: when a KV head serves at most ``fma_max_heads`` query heads, accumulate the value latent on the CUDA
    cores in fp32 (one weighted row sum per head; exact products) instead of the padded tensor-core product (off:
    run 8 measured it no faster at G = 1, 5.04 against 5.00 ms, and 1.6x slower at G = 4; since then it compiles to
    128 registers instead of 233 at G = 1, not yet timed). The split count is the largest that keeps the grid within
    ``target_programs`` (whole waves; H200 run 8's ncu: 384 programs of 2 per SM ran 1.45 waves); key_fp16:
    rebuild keys from a non-bf16 latent with one fp16 dot (latent and basis rounded to fp16: 2^-11 relative per
    coordinate, about 8x less error than key_split=False, at its cost; latent values beyond fp16's 65504 would
    overflow); key_codes: rebuild keys from a uniform ``int`` latent in the code domain, exactly, one quantization
    block per chunk: integer codes times the basis on the tensor cores (e4m3 operands for <= 4-bit codes and e4m3
    bases: twice the bf16 rate), then each row's block scale, plus its min times the basis columns' sums; one dot
    instead of the hi/lo split's two (no hoisted basis; off: on the H200 it spilled 84-318 bytes and took 1.2-3.4x
    the one-pass default's time at 32:8 heads, ranks 100-128, batch 1-64; benchmarks/results/2026-12-01-checks-h200);
    reduce_split_d: the merge kernel
    runs one program per 32-channel slice of the output as well (at batch 1 the merge has only B*Hkv*S programs,
    16 for a 16-KV-head model; H200, benchmarks/results/2026-11-30-latent-attention-v2-h200: 6% faster calls at
    batch 1, 4k, neutral at batch 8, 32k); None (the default): split where the B*Hkv*S rows are fewer than the
    device's SMs (and always off CUDA), since each slice repeats the whole merge (H200, 32:8 heads, the MMA pass's
    partials: 8.4 us split against 11.1 not at batch 8, 12.2 not split against 16.5 at batch 32;
    benchmarks/results/2026-12-04-unit-major-h200, r15); one_pass_merge: merge the splits with
    ``_merge_splits_kernel`` (one pass over the partials, each exact token's score computed once) where the call has
    no attention mask; None (the default): for the MMA pass where the merge is not split over D (H200, batch 32,
    32:8 heads: 7.1 us against 12.0; split over D at batch 8 the per-head merge is faster, 8.3 us against 12.6;
    r17 of the same results); fma_merge: merge with ``_merge_fma_kernel`` (fp32 multiply-adds per query head on the
    CUDA cores, one program per query head and 32-channel slice; it takes precedence over ``one_pass_merge``) where
    the call has no attention mask; None (the default): for the MMA pass where :func:`fma_merge_on`; r_loop: rebuild
    keys over the rank chunks in a runtime loop (one ``block_r`` chunk of latent and basis live at a time, its loads
    software-pipelined over ``num_stages``, and only the chunks the KV head's rank reaches: rank 96 in chunks of 32
    runs 3, not the padded 128's 4)
    instead of an unrolled one (no effect with a hoisted basis, which is one chunk); key_tiles: tiles per key-pass
    program (two-pass form; None: the value pass's split of the context); maxnreg: the register cap of each
    thread of the key pass (ptxas ``.maxnreg``: more programs per SM, spills past it; None: the compiler's choice);
    fma_values_2d: with fma_values and one query head per KV head, the value pass sums the weighted value rows
    elementwise into a (block_n_v, R) fp32 accumulator and reduces its rows once per program, instead of a row sum
    across threads per tile; fuse_merge: the last value-pass program of each (sequence, KV head, query) merges the
    splits itself (an arrival counter per row, acquire-release atomics) instead of a third launch, the merge
    kernel (``reduce_split_d`` then has no effect). Off: correct on the H200, but the merge code doubles the value
    pass's registers (96 -> 214 at G = 1), which costs more than the launch it saves (0.055 -> 0.061 ms per call at
    16:16, batch 1, 4k; Qwen1.5-MoE step 4.75 -> 4.95 ms; benchmarks/results/2026-11-30-fused-merge-h200);
    target_programs_v: the value pass's own ``target_programs`` (two-pass form; None: ``target_programs``). Its
    programs hold few registers (40 at G = 1), so many more of them fit on an SM than of the key pass's: at
    ``target_programs`` = 264 a batch-8, 16-KV-head call ran 256 value programs, 0.16 waves (H200 Nsight Compute,
    benchmarks/results/2026-11-30-small-rank-h200); rotate_basis: with one query head per KV head and the basis
    hoisted, score slots without rebuilding keys: the query is folded into the basis once per program and the
    RoPE tables multiply those coefficients on the tensor cores (``_tile_scores_rotated``), so the CUDA cores do
    rank, not head_dim, multiply-adds per slot (H200, batch 8, 32k, int4/32: rank 32 1.22 -> 0.92 ms, 0.77 with
    paired tables; rank 64 1.44 -> 1.51 unpaired but 0.78 paired, so the default enables it up to rank 32, or up to
    :data:`MAX_ROTATED_RANK` with tables declared paired; needs ``fma_scores``, padded rank <=
    :data:`MAX_ROTATED_RANK`, dequantized, non-mix latents, else ignored); head_group: the key pass scores this
    many KV heads per program (``_latent_scores_heads_kernel``: each row's window of the group's bytes read once,
    each RoPE table tile loaded once for the group, the tables multiplied with N = the group's coordinates) instead
    of one; 0: one head per program. Applies to the two-pass form with one query head per KV head and float or
    uniform ``int`` key latents whose heads each fit in one quantization block (rank <= block), and where the
    groups' programs still fill ``target_programs``, not with ``fuse_merge`` (whose counters the per-head key pass
    zeroes), else ignored. (A value pass over groups of heads was tried twice and dropped: on the
    tensor cores, acc (16, NCOLS) += (p * scale)^T @ codes, it ran 2x slower than the per-head value pass on the
    H200 and missed 1e-3; on the CUDA cores it was right but slower, 26.3 against 22.2 ms per Qwen1.5-MoE step;
    benchmarks/results/2026-11-30-head-groups-h200.) rotate_fp16: the rotated and grouped key passes multiply the
    RoPE tables (rounded to fp16, exact for bf16 tables down to 2^-14) with the folded coefficients rounded once
    to fp16 (2^-11 relative), one tensor-core product per table instead of the hi / lo split's two: half the
    tensor work of those passes. An fp64 emulation at the Qwen layer shape (16:16 heads, int4/32, 4k-32k slots)
    puts its added output error at 6e-5 (rank 12) to 1.8e-4 (rank 104), against ~1e-6 for the split, but the error
    is relative to the logits: at large logits it passes 1e-3 (1.4e-3 in an interpreter case, bf16, head_dim 32),
    so it is a lossy option like ``key_fp16``; coefficients (query x basis) beyond fp16's 65504 would overflow.
    Off: on the H200 (benchmarks/results/2026-12-01-checks-h200) one call at rank 12 ran 30% faster (0.53 -> 0.37
    ms, batch 8, 32k) but ranks 32-104 gained nothing, and the Qwen1.5-MoE decode step did not change (22.13 ->
    22.09 ms), at 5e-4 to 9e-4 output error against ~1e-4 (ptxas for sm_90a at rank 104: the per-head key pass's
    104-byte spill and half of its 100 KB of shared memory go away; benchmarks/results/2026-12-01-rotate-fp16-cpu).
    loop_stages / loop_stages_v: software-pipeline the slot-tile loop of the key pass, one-pass and grouped kernels /
    of the value pass this many stages deep (``tl.range(..., num_stages=N)``: Triton then prefetches every load of
    the loop it can issue asynchronously, not only the loads that feed a tensor-core product; e.g. the value pass's
    scores and code rows, which otherwise wait out a full memory latency per tile: compiled for sm_90a, the value
    pass at rank 8 gains cp.async loads at the same 40 registers, ``benchmarks/latent_attention_aot.py --sass``).
    None: Triton's default for the loop (the kernel's ``num_stages`` for tensor-core operands only). Off here;
    :func:`default_config` turns them on where the H200 measured them faster (CUDA-graph replays of one call,
    benchmarks/results/2026-12-01-defaults-h200): the key pass at 3 stages up to rank 32 (0.86-0.96x) and GQA's one
    pass (0.97x), the value pass at 2 stages at ranks 65-128 (rank 96: 0.92x).
    head_chunks: with one query head per KV head and uniform ``int`` key and value latents, run the whole call as
    one pass over chunks of KV heads (:mod:`.latent_attention_chunks`: each program folds the query into the basis
    for every head of its chunk, multiplies each table tile once for all of them, and keeps each head's online
    softmax and value latent) whose padded key ranks fill about this many columns; 0: off. ``rotate_fp16`` then
    makes the table product one fp16 dot instead of the bf16 hi / lo pair; ``block_n_c`` (slots per tile, rounded
    up to a power of two >= 16, the tensor cores' M), ``loop_stages_c`` (its tile loop's pipeline depth),
    ``num_warps``, ``num_stages`` and ``target_programs`` apply to it. Like ``head_group``, only where its programs
    still fill ``target_programs``, and while the folded query fits ``MAX_SCORES_BYTES``. H200, 16:16 heads,
    int4/32, batch 8, 32k, one call in CUDA-graph replay (benchmarks/results/2026-12-02-head-chunks-h200): rank 8
    0.186 ms against 0.228 for the two-pass default (0.82x); rank 16 0.289 against 0.273; rank 96 1.61 against
    1.18; so :func:`default_config` turns it on only at key and value ranks <= 8.
    absorbed: for calls without RoPE tables (rope form 'none': post-RoPE key bases, or no RoPE) over uniform
    8/4/2-bit ``int`` latents, at any G, run the absorbed pass (:mod:`.latent_attention_absorbed`: the query folded
    into the key basis once per step, scores and the value latent on the tensor cores in the code domain, GQA's
    query heads sharing one read of each code tile) over chunks of KV heads whose padded ranks fill about this many
    columns; 0: off; it takes precedence over ``head_chunks``. ``block_n_a`` (slots per tile, a power of two >= 16),
    ``loop_stages_a`` and ``num_warps_a`` (None: ``num_warps``) apply to it. H200, int4/32, batch 8, 32k, one call
    (benchmarks/results/2026-12-03-absorbed-h200): 32:8 heads rank 32 0.226 ms (64 columns, 64-slot tiles) against
    0.501 for the one-pass default; rank 96 1.13 against 1.06; at 16:16 heads slower than the chunk pass (rank 16
    0.27 against 0.19, unequal ranks 24/96 1.67 against 0.95); so :func:`default_config` turns it on for table-free
    GQA calls up to rank 32 only.
    lanes: for the same table-free calls (uniform ``int`` latents whose heads start on 4-byte words and whose blocks
    hold whole 32-bit words of codes), run the lane pass (:mod:`.latent_attention_lanes`: the query folded into the
    key basis, one CUDA-core lane per (slot, query head) with its own online softmax and value latent, codes
    placed in the mantissa of 1.0 by a shift and a logic op, no cross-thread sums inside the tile loop) over chunks
    of KV heads holding
    about this many query heads; 0: off; it takes precedence over ``absorbed`` and ``head_chunks``. ``block_n_l``
    (slots per tile, rounded up to a power of two >= 16), ``loop_stages_l`` and ``num_warps_l`` (None:
    ``num_warps``) apply to it.
    words: for the same table-free calls as ``lanes`` at G >= 2, run the word pass
    (:mod:`.latent_attention_words`: one KV head per program, whole 32-bit words of codes turned into fp16 tensor-core
    operands by logic ops, two codes each, several slots side by side per tensor-core row so that GQA's few query
    heads fill the product's 16 columns); it takes precedence over ``lanes``, ``absorbed`` and ``head_chunks``.
    ``block_n_w`` (tensor-core rows per tile, rounded up to a power of two >= 16; each row holds 16 / (G padded x
    quantization blocks per head) slots, at most 4), ``loop_stages_w`` and ``num_warps_w`` (None: ``num_warps``)
    apply to it.
    mma: for table-free calls over int4 latents (or int8 ones, unit-major) of rank 32 per KV head in one quantization
    block, at G = 2, 4 or 8,
    without a mask, on CUDA devices (sm_80+), run the MMA pass (:mod:`.latent_attention_mma`: one warp per (KV head,
    context split), the code words loaded straight into the tensor cores' operand registers, no shared memory; its
    own kernel for unit-major latents, 1.4x faster there); it takes precedence over ``words`` and the rest.
    ``block_n_m`` (slots per tile of row-major latents: 64 or 128; unit-major tiles are 64), ``programs_m`` (about
    this many one-warp programs in all; ``split`` fixes the count instead), ``min_tiles_m`` (tiles per program
    at least), ``maxnreg_m`` (ptxas's register cap per thread; None: the compiler's choice) and ``stages_m`` (the
    unit-major kernel's cp.async ring through shared memory, 2 or 4 tiles; 0: each tile's words loaded into
    registers one tile ahead) apply to it.
    The chunk, absorbed, lane, word and MMA passes read fp16 block metadata only: for ``-f8`` latents (e4m3 block
    spans and mins) their layouts refuse, and the launcher runs the per-head kernels (which read both) instead.

    Raises:
        ValueError: ``stages_m`` other than 0, 2 or 4."""

    block_n: int = 64
    block_r: int = 64
    num_warps: int = 4
    num_stages: int = 2
    split: int | None = None
    min_tiles: int = 4
    target_programs: int = 264
    key_split: bool = True
    hoist_basis: bool = False
    f32_dots: bool = False
    align_hint: bool = True
    fma_scores: bool = False
    fma_max_heads: int = 8
    p_bf16: bool = False
    two_pass: bool = True
    block_n_v: int | None = 32
    num_warps_v: int | None = 4
    paired_tables: bool = False
    fma_values: bool = False
    key_fp16: bool = False
    key_codes: bool = False
    reduce_split_d: bool | None = None
    one_pass_merge: bool | None = None
    fma_merge: bool | None = None
    r_loop: bool = False
    key_tiles: int | None = None
    maxnreg: int | None = None
    fma_values_2d: bool = True
    fuse_merge: bool = False
    target_programs_v: int | None = None
    rotate_basis: bool = False
    head_group: int = 0
    rotate_fp16: bool = False
    loop_stages: int | None = None
    loop_stages_v: int | None = None
    head_chunks: int = 0
    block_n_c: int = 32
    loop_stages_c: int | None = 2
    absorbed: int = 0
    block_n_a: int = 16
    loop_stages_a: int | None = 2
    num_warps_a: int | None = None
    lanes: int = 0
    block_n_l: int = 32
    loop_stages_l: int | None = 2
    num_warps_l: int | None = None
    words: bool = False
    block_n_w: int = 64
    loop_stages_w: int | None = 2
    num_warps_w: int | None = None
    mma: bool = False
    block_n_m: int = 64
    programs_m: int = 3072
    min_tiles_m: int = 4
    maxnreg_m: int | None = None
    stages_m: int = 0

    def __post_init__(self):
        if self.stages_m not in (0, 2, 4):  # (shared memory grows by 4-8 KB a stage for each one-warp program)
            raise ValueError(f"DecodeConfig.stages_m must be 0 (loads into registers), 2 or 4 (a cp.async ring of "
                             f"that many tiles), got {self.stages_m!r}")


def default_config(group: int | None = None, rank_pad: int | None = None, paired: bool = False,
                   rank: int | None = None, rank_v: int | None = None,
                   quantized_keys: bool = False, table_free: bool = False,
                   code_bits: int | None = None) -> DecodeConfig:
    """The default for ``group`` query heads per KV head and key ranks padded to ``rank_pad``: the fastest config
    within 1e-3 of the reference in the H200 sweeps (benchmarks/results/2026-11-29-latent-attention-h200).

    ``paired``: the call's cos / sin tables are declared paired (:func:`declare_paired_tables`): ``paired_tables``
    on, and the rotated basis up to :data:`MAX_ROTATED_RANK` instead of 32. ``rank``: the call's largest key rank
    before padding (None: ``rank_pad``); it sizes the grouped key pass's head groups. ``rank_v``: the largest value
    rank (None: as the keys); the value pass's tiles and pipelining follow it. ``quantized_keys``: the key latent is
    a uniform or mixed ``int`` format (not MX, not float), whose dequantized values fp16 holds; GQA's one pass then
    rebuilds keys with one fp16 dot (``key_fp16``). ``table_free``: the call reads no RoPE table (rope form
    'none': a model without RoPE, or post-RoPE key bases, ``LatentBases.key_space``). ``code_bits``: the widest code
    of the key and value latents' uniform ``int`` formats (8, 4 or 2; None: not known); 8-bit codes keep the table-free
    GQA calls off the word pass, which the H200 measured slower there. Table-free rank-32 calls at G = 2, 4, 8 with
    4- or 8-bit codes get ``mma`` (3072 programs at 4 bits, 1536 at 8; the launcher runs the MMA pass where its layout
    applies: 8-bit codes only over unit-major latents, else the absorbed pass).

    G = 1 (Qwen1.5-MoE's 16:16 heads) and rank_pad <= 256: the basis block hoisted out of the tile loop, scores and
    value latent on the CUDA cores (run 10: 4.60 ms, rel err 4.0e-5, against 4.81 ms and 4.7e-4 with the value
    latent on the tensor cores, and 5.87 ms for the generic config; int4/32 rank 256, batch 8, 32k), the value
    pass on 8x the programs (``target_programs_v``) and, up to rank 32, RoPE moved onto the basis
    (``rotate_basis``; benchmarks/results/2026-11-30-small-rank-h200); with paired tables up to rank 32, the key pass
    over groups of KV heads (``head_group``; benchmarks/results/2026-11-30-head-groups-h200): 4 to 16 heads, as many
    as keep the group within 128 columns (:func:`_head_group`); up to rank 32 also 64-slot value tiles and a 3-stage
    key-pass loop, at ranks 65-128 a 2-stage value loop (benchmarks/results/2026-12-01-defaults-h200: Qwen1.5-MoE
    decode, batch 8, 32k, 18.43 -> 16.45 ms per step); at key and value ranks <= 8 the one pass over chunks of KV
    heads (``head_chunks``; rank 8: 0.82x the two-pass call, benchmarks/results/2026-12-02-head-chunks-h200); without
    RoPE tables (``table_free``) up to rank 128 the lane pass (``lanes``: 8 query heads per program at key ranks
    past 32, else 16 with 8 warps at value ranks <= 16; 0.37-0.43x the chunk pass's time per call, Qwen1.5-MoE decode
    at batch 8, 32k 12.08 -> 7.73 ms per step; benchmarks/results/2026-12-03-lanes-v2-h200), with the chunk pass for
    the calls its layout does not take. Otherwise
    (e.g. Mixtral's G = 4) the generic config (the fastest of run 5), up to rank 128 in its one-pass form, which the
    decode of Mixtral-8x7B at 32k (key ranks 95-101) measured 1.36-1.9x faster than the two-pass one at batch 8-195
    (benchmarks/results/2026-11-30-batch-slices-h200), its loop pipelined 3 stages deep, and with quantized keys
    the rebuild as one fp16 dot (``key_fp16``: the dequantized latent rounded once to fp16, 2^-11 relative, far below
    the int codes' own step; a 32:8 rank-96 call at batch 64, 32k 9.14 -> 8.24 ms at rel err 7.6e-4 -> 9.2e-4,
    Mixtral-8x7B's largest batch at 32k 757 -> 856 tokens/s; benchmarks/results/2026-12-01-largebatch-h200);
    without RoPE tables, the absorbed pass up to rank 32 and the word pass (``words``, 64-row tiles) at padded key
    ranks 32-128 with codes of at most 4 bits (32:8 heads, int4/32, batch 8, 32k, one call: rank 32 0.198 against
    0.230 ms for the absorbed pass, ranks 64/32 0.302 against 0.583 and 96 0.689 against 1.062 for the one-pass
    kernel; rank 16 stays with the absorbed pass, 0.134 against 0.149, and 8-bit codes with the others, 1.27-1.46x
    faster there; benchmarks/results/2026-12-03-words-h200).

    Tuning override: the environment variable :data:`CONFIG_ENV` (``CKVP_DECODE_CONFIG``) holds a JSON object of
    :class:`DecodeConfig` fields applied over this default, e.g. ``{"num_warps": 8}``, read by every call without an
    explicit config. In a model compiled with Inductor on CUDA whose heads share one key rank, the key pass is the
    autotuned Inductor template instead (``lowering.latent_attention.TEMPLATE_CONFIGS``): there the override reaches
    the value pass and the merge only; with unequal per-head ranks (calibrated plans) the whole call reads it.

    Raises:
        ValueError: the variable is not a JSON object of DecodeConfig fields with values of their types (the
            message names the bad field).
    """
    if group == 1 and rank_pad is not None and rank_pad <= 256:
        # RoPE on the basis up to rank 32, and 8x the value programs: at batch 8, 32k the whole call at rank 32
        # went 1.61 -> 0.92 ms, rank 12 2.14 -> 1.21, rank 64 (value programs only) 1.84 -> 1.44
        # (benchmarks/results/2026-11-30-small-rank-h200)
        # (paired tables: rank 64 0.78 ms against 1.44, rank 104 1.33 against 1.85, and up to rank 32 the key pass
        # on 396 programs, 3 per SM at its 137 registers: rank 32 0.77 -> 0.58 ms, rank 12 1.10 -> 0.91)
        rotate = rank_pad <= (MAX_ROTATED_RANK if paired else 32)
        # up to rank 32 with paired tables, the key pass takes 4 KV heads per program on 264 programs (H200, batch
        # 8, 32k, int4/32: key pass rank 12 0.377 -> 0.211 ms, rank 16 0.370 -> 0.219, rank 32 0.410 -> 0.362,
        # against one head per program on 396; benchmarks/results/2026-11-30-head-groups-h200)
        group = _head_group(rank or rank_pad) if paired and rank_pad <= 32 else 0
        cfg = DecodeConfig(hoist_basis=True, fma_scores=True, fma_values=True, target_programs_v=2112,
                           rotate_basis=rotate, head_group=group)
        # CUDA-graph replays of one call, batch 8, 32k, int4/32 (benchmarks/results/2026-12-01-defaults-h200):
        # up to rank 32, 64-slot value tiles (0.90-0.92x) and a 3-stage pipelined key-pass loop (0.86-0.96x);
        # at ranks 65-128 a 2-stage value loop (rank 96: 0.92x; rank 64 lost 6% with it, so not below 65)
        v_pad = rank_pad if rank_v is None else max(16, _np2(rank_v))  # measured at equal key and value ranks
        if rank_pad <= 32:
            cfg = dataclasses.replace(cfg, loop_stages=3)
        if paired and max(rank or rank_pad, rank_v or rank or rank_pad) <= 8:
            # one pass over chunks of 16 heads (latent_attention_chunks): rank 8 0.228 -> 0.186 ms per call at
            # batch 8, 32k (benchmarks/results/2026-12-02-head-chunks-h200); wider ranks measured slower
            cfg = dataclasses.replace(cfg, head_chunks=128)
        if table_free and rank_pad <= 128 and v_pad <= 128:
            # without tables the chunk pass has no (KT, NCK) coefficient operand nor table product, so it pays at
            # every measured rank: Qwen1.5-MoE decode, post-RoPE bases (key ranks 16-96, value ranks 8-64), batch
            # 8, 32k, 16.22 ms per step with the two passes, 13.52 with 128-column chunks, 12.08 with 256 (512:
            # 14.62; 256 with 16- or 64-slot tiles 13.37 / 12.96; 8 warps 14.30)
            # (benchmarks/results/2026-12-03-post-rope-h200)
            cfg = dataclasses.replace(cfg, head_chunks=256)
            # the lane pass (latent_attention_lanes) where its layout applies, else the chunk pass above: one call
            # at batch 8, 32k, int4/32, against the chunk pass in the same run: key/value ranks 24-32/8 0.077
            # against 0.205 ms (8 warps; 4 warps 0.091), 16/16 0.075 against 0.191 (4 warps 0.116), 32/32 0.119
            # against 0.276 (4 warps), 32-64/32 0.180 against 0.488 and 64-96/64 0.408 against 0.962 (8 query heads
            # per program; 16: 0.217 and 1.355); Qwen1.5-MoE decode, post-RoPE bases, batch 8, 32k: 12.08 -> 7.73
            # ms per step (benchmarks/results/2026-12-03-lanes-v2-h200; the sweep of these configs on the kernel's
            # first version: benchmarks/results/2026-12-03-lanes-h200)
            if rank_pad >= 64:
                cfg = dataclasses.replace(cfg, lanes=8, block_n_l=16, loop_stages_l=None)
            else:
                cfg = dataclasses.replace(cfg, lanes=16, block_n_l=16, loop_stages_l=None,
                                          num_warps_l=8 if v_pad <= 16 else None)
        if v_pad <= 32:
            cfg = dataclasses.replace(cfg, block_n_v=64)
        elif v_pad == 128:
            cfg = dataclasses.replace(cfg, loop_stages_v=2)
    else:
        # G > 1 up to rank 128 (Mixtral's 32:8 at ckvp-16: key ranks 95-101): the one-pass kernel. Mixtral-8x7B
        # decode at 32k on the H200, 8 layers, ms per step one-pass against two-pass: batch 8 19.4 / 26.3, 16
        # 32.8 / 49.5, 32 62.5 / 97.1, 64 117 / 189 (benchmarks/results/2026-11-30-batch-slices-h200). At rank 256
        # one 32:8 call at batch 8, 32k took 3.37 ms one-pass against 2.41 for the two-pass template
        # (benchmarks/results/2026-11-30-subbyte-h200): there the two-pass form stays.
        # (measured at key and value ranks 95-101; a much wider value rank would make the one-pass kernel's
        # registers the limit, untested)
        gqa = group is not None and group > 1
        one_pass = gqa and rank_pad is not None and rank_pad <= 128
        # the one-pass loop pipelined 3 deep: 32:8 rank 96 batch 8, 32k 1.21 -> 1.18 ms per call, Mixtral-8x7B
        # decode (8 layers, batch 8, 32k) 17.10 -> 16.81 ms per step (benchmarks/results/2026-12-01-defaults-h200)
        # (the fp16 rebuild: benchmarks/results/2026-12-01-largebatch-h200)
        # past rank 256 (Mixtral at ratio 4 with G = 4: key ranks 384-416, padded to 512) the unrolled rebuild's
        # basis and latent tiles need 316 KB of shared memory on sm_90a, past the H200's 227 KB, and the launch
        # failed; the rank loop keeps one 64-wide chunk live: 46 KB (Triton 3.6 offline compile,
        # benchmarks/latent_attention_aot.py --heads 32:8 --format int4/32:416)
        cfg = DecodeConfig(two_pass=not one_pass, loop_stages=3 if one_pass else None,
                           key_fp16=one_pass and quantized_keys, r_loop=rank_pad is not None and rank_pad > 256)
        if table_free and gqa and rank_pad <= 32 and (rank_v is None or rank_v <= 32):
            # without tables, GQA's query heads share one read of the code tile on the tensor cores
            # (latent_attention_absorbed): 32:8 heads, int4/32 rank 32, batch 8, 32k, one call 0.501 -> 0.226 ms
            # with 64-column chunks and 64-slot tiles (256 columns 0.262, 8 warps 0.468); at rank 96 1.13 against
            # 1.06 ms, so not there (benchmarks/results/2026-12-03-absorbed-h200)
            cfg = dataclasses.replace(cfg, absorbed=64, block_n_a=64)
        if (table_free and gqa and 32 <= rank_pad <= 128 and (rank_v is None or rank_v <= 128)
                and (code_bits is None or code_bits <= 4)):
            # the word pass (latent_attention_words; the absorbed pass above where its layout does not apply):
            # 32:8 heads, int4/32, batch 8, 32k, one call with 64-row tiles: rank 32 0.230 -> 0.198 ms, 64/32
            # 0.583 -> 0.302, 96 1.062 -> 0.689, int2/16 rank 64 0.809 -> 0.482 (weight-scaling/). Before that
            # fix: 32-row tiles 0.221 / 0.404 / 0.898, 128 rows 0.280 / 0.330 / 0.761, 8 warps slower at every
            # rank; rank 16 0.134 -> 0.149, so not there; 16:8 heads 0.669 -> 0.394; but int8/32 rank 32 0.219 ->
            # 0.278 and rank 96 1.047 -> 1.527, so not for 8-bit codes (benchmarks/results/2026-12-03-words-h200)
            cfg = dataclasses.replace(cfg, words=True, block_n_w=64)
        if (table_free and group in (2, 4, 8) and rank == 32 and rank_v in (None, 32) and code_bits in (4, 8)):
            # the MMA pass (latent_attention_mma; the word pass where its layout does not apply): 32:8 heads,
            # int4/32 rank 32, one whole call in CUDA-graph replay: batch 8, 32k 0.200 -> 0.079 ms, 128k 0.738 ->
            # 0.235; batch 32, 32k 0.749 -> 0.240, 128k 2.93 -> 0.858 (benchmarks/results/2026-12-04-mma-h200);
            # int8/32 (unit-major latents only; row-major ones keep the absorbed pass): batch 32, 128k 0.70 ms in
            # 64-slot unit-major pages, 1.03 ms static (the word pass 4.63; benchmarks/results/2026-12-04-int8-mma-h200);
            # 8-bit codes at 1536 programs: batch 8, 32k 0.0598 against 0.0621 ms at 3072, the rest within 1% (r3);
            # at 2112 since the page scan took the kernel to 128 registers (16 one-warp programs an SM, 2112 one wave
            # of the H200's 132 SMs): 64-slot pages, batch 8, 32k 0.0519 -> 0.0491 ms, 128k 0.170 -> 0.160; batch 32,
            # 32k 0.171 -> 0.159 (benchmarks/results/2026-12-05-fewer-instructions, r1)
            cfg = dataclasses.replace(cfg, mma=True, block_n_m=64, programs_m=2112 if code_bits == 8 else 3072)
    if paired:
        cfg = dataclasses.replace(cfg, paired_tables=True)
    override = _env_override(os.environ.get(CONFIG_ENV, ""))
    return dataclasses.replace(cfg, **override) if override else cfg


def _head_group(rank: int) -> int:
    """KV heads per program of the grouped key pass at largest key rank ``rank``: the most (4 to 16, a power of
    two) whose columns stay within 128. H200, 16:16 heads, batch 8, 32k, one call in CUDA-graph replay: rank 8
    with 16 heads 0.84x the 4-head time, 8 heads 0.83x; rank 16 with 8 heads 0.96x, 16 heads (256 columns) 1.87x;
    rank 32 with 8 heads 1.43x (benchmarks/results/2026-12-01-defaults-h200)."""
    return max(4, min(16, 1 << max(0, (128 // max(rank, 1)).bit_length() - 1)))


#: The environment variable of :func:`default_config`'s tuning override.
CONFIG_ENV = "CKVP_DECODE_CONFIG"


@functools.lru_cache(maxsize=8)
def _env_override(text: str) -> dict:
    """The DecodeConfig fields of a CKVP_DECODE_CONFIG value (empty: none)."""
    if not text.strip():
        return {}
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{CONFIG_ENV} must be a JSON object of DecodeConfig fields, e.g. '{{\"num_warps\": 8}}', "
                         f"but {text!r} is not JSON ({e})") from None
    types = {f.name: str(f.type) for f in dataclasses.fields(DecodeConfig)}
    if not isinstance(fields, dict) or set(fields) - set(types):
        bad = sorted(set(fields) - set(types)) if isinstance(fields, dict) else fields
        raise ValueError(f"{CONFIG_ENV}: unknown DecodeConfig field(s) {bad}; the fields are {sorted(types)}")
    for name, value in fields.items():
        ann = types[name]
        ok = ((value is None and "None" in ann) or (isinstance(value, bool) and ann.startswith("bool"))
              or (isinstance(value, int) and not isinstance(value, bool) and ann.startswith("int")))
        if not ok:
            raise ValueError(f"{CONFIG_ENV}: field {name!r} takes {ann}, but got {value!r}")
    return fields


# ------------------------------------------------------------------------------------------------ jit helpers


@triton.jit
def _fp16_at(ptr, step, mask):
    """fp32 value of the little-endian fp16 stored in the two bytes at ``ptr`` and ``ptr + step``."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + step, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scale_min(rows, blk, scale_base, min_base, stride_w, mask, BITS: tl.constexpr, WORDS: tl.constexpr,
               META8: tl.constexpr):
    """fp32 (scale, min) of quantization blocks ``blk`` of the rows at ``rows`` (broadcast together; 0 where
    ``~mask``): the fp16 scale and min at bytes ``scale_base + 2*blk`` and ``min_base + 2*blk`` (WORDS: loaded as the
    16-bit words ``scale_base // 2 + blk``, ``min_base // 2 + blk`` of unit-stride rows), or META8 (``-f8`` formats)
    the float8_e4m3fn span and min at bytes ``scale_base + blk`` and ``min_base + blk``, the scale being ``span *
    fp32(1 / (2**BITS - 1))`` (one fp32 product, :func:`~ckvp_compile.kernels.latent_format.f8_scale`)."""
    if META8:
        sp = tl.load(rows + (scale_base + blk) * stride_w, mask=mask, other=0).to(tl.float8e4nv, bitcast=True)
        mn = tl.load(rows + (min_base + blk) * stride_w, mask=mask, other=0).to(tl.float8e4nv, bitcast=True)
        sc = sp.to(tl.float32) * (1.0 / ((1 << BITS) - 1))
        mn = mn.to(tl.float32)
    elif WORDS:
        words = rows.to(tl.pointer_type(tl.uint16))
        sc = tl.load(words + (scale_base // 2 + blk), mask=mask, other=0).to(tl.float16, bitcast=True)
        mn = tl.load(words + (min_base // 2 + blk), mask=mask, other=0).to(tl.float16, bitcast=True)
        sc = sc.to(tl.float32)
        mn = mn.to(tl.float32)
    else:
        sc = _fp16_at(rows + (scale_base + 2 * blk) * stride_w, stride_w, mask)
        mn = _fp16_at(rows + (min_base + 2 * blk) * stride_w, stride_w, mask)
    return sc, mn


@triton.jit
def _latent_raw_codes(row_ptr, row_ok, col0, rank, lo, stride_w, C0: tl.constexpr, NROWS: tl.constexpr,
                      NCOLS: tl.constexpr, BITS: tl.constexpr, RANK_ALIGN: tl.constexpr, GATHER: tl.constexpr = False):
    """(NROWS, NCOLS) int32 codes of coordinates j = C0 + [0, NCOLS) of a quantized row (8, 4 or 2 bits; the code
    of j is bits ``(j % (8/BITS)) * BITS`` of byte ``col0 + j*BITS/8``), 0 where ``~row_ok`` and, to byte
    granularity, outside [lo, rank): the caller masks the coordinates of a partly used byte. The masks are written
    in byte units (``hb < ceil(rank / 2)``, not ``2 * hb < rank``), so that Triton sees them constant over aligned
    runs of bytes and uses vector loads (Triton 3.6 PTX: one byte per load otherwise).

    GATHER (sub-byte codes bound for a tensor-core product whose K dimension is 16): each coordinate loads its own
    byte and shifts its code out, instead of loading each byte once and interleaving its codes with
    :func:`_unpack_codes` (``tl.join`` / ``tl.reshape``). On the H200 with Triton 3.6 the interleaved codes gave
    wrong products at K = 16 (as the A operand, 16 columns: at 16- and 32-slot tiles with any warps, at 64-128
    with 1-2 warps; as the B operand: 16-slot tiles), while the gathered ones were right at every shape
    (``benchmarks/subbyte_shapes_gpu.py`` probe, benchmarks/results/2026-11-30-subbyte-h200)."""
    if BITS == 8:
        cols = C0 + tl.arange(0, NCOLS)
        ok = row_ok[:, None] & ((cols < rank) & (cols >= lo))[None, :]
        code = tl.load(row_ptr[:, None] + ((col0 + cols) * stride_w)[None, :], mask=ok, other=0).to(tl.int32)
    elif GATHER:
        PER: tl.constexpr = 8 // BITS
        cols = C0 + tl.arange(0, NCOLS)
        ok = row_ok[:, None] & ((cols < rank) & (cols >= lo))[None, :]
        raw = tl.load(row_ptr[:, None] + ((col0 + cols // PER) * stride_w)[None, :], mask=ok, other=0).to(tl.int32)
        code = (raw >> ((cols % PER) * BITS)[None, :]) & ((1 << BITS) - 1)
    else:  # BITS 4 or 2: byte i holds the PER = 8/BITS codes PER*i .. PER*i+PER-1; load each byte once
        PER: tl.constexpr = 8 // BITS
        hb = C0 // PER + tl.arange(0, NCOLS // PER)
        if RANK_ALIGN % PER == 0:
            h_end = rank // PER
        else:
            h_end = (rank + PER - 1) // PER
        h_ok = row_ok[:, None] & ((hb < h_end) & (hb >= (lo + PER - 1) // PER))[None, :]
        raw = tl.load(row_ptr[:, None] + ((col0 + hb) * stride_w)[None, :], mask=h_ok, other=0).to(tl.int32)
        code = _unpack_codes(raw, NROWS, NCOLS, BITS)
    return code


@triton.jit
def _unpack_codes(raw, NROWS: tl.constexpr, NCOLS: tl.constexpr, BITS: tl.constexpr):
    """(NROWS, NCOLS) int32 codes of (NROWS, NCOLS * BITS / 8) int32 bytes ``raw`` of 4- or 2-bit codes, in
    coordinate order: code ``i`` of a byte is its bits ``i*BITS .. i*BITS + BITS - 1`` (low nibble first)."""
    if BITS == 4:  # interleave the nibbles
        code = tl.join(raw & 15, raw >> 4)
    else:  # bits 0-1, 2-3, 4-5, 6-7
        code = tl.join(tl.join(raw & 3, (raw >> 4) & 3), tl.join((raw >> 2) & 3, (raw >> 6) & 3))
    return tl.reshape(code, (NROWS, NCOLS))


@triton.jit
def _latent_tile(row_ptr, row_ok, col0, blk0, rank, scale_base, min_base, stride_w, C0: tl.constexpr,
                 NROWS: tl.constexpr, NCOLS: tl.constexpr, BITS: tl.constexpr, QBLOCK: tl.constexpr,
                 BLOCKWISE: tl.constexpr, COL_ALIGN: tl.constexpr, RANK_ALIGN: tl.constexpr,
                 HALF_WORDS: tl.constexpr, MX: tl.constexpr = False, lo=0, GATHER: tl.constexpr = False,
                 META8: tl.constexpr = False):
    """(NROWS, NCOLS) fp32 latent coordinates j = C0 + [0, NCOLS) of one head, rows starting at ``row_ptr``.

    Float format (BITS == 16): columns ``col0 + j``. Quantized: the code of coordinate j is bits
    ``(j % (8/BITS)) * BITS`` of byte ``col0 + j*BITS/8``; block ``blk0 + j // QBLOCK`` holds its fp16 scale at
    byte ``scale_base + 2*blk`` and min at ``min_base + 2*blk`` (META8, ``-f8`` formats: its e4m3 span at byte
    ``scale_base + blk`` and min at ``min_base + blk``, :func:`_scale_min`); value = code * scale + min.
    BLOCKWISE (QBLOCK divides NCOLS and C0): each block's scale and min are loaded once per row and broadcast over
    its QBLOCK coordinates; a tile inside one block (NCOLS <= QBLOCK, e.g. a rank-12 head of int4/32): that block's,
    once per row, likewise; otherwise gathered per coordinate. COL_ALIGN / RANK_ALIGN: powers of two dividing
    ``col0`` / ``rank`` (the compiler can then vectorise the row loads); HALF_WORDS: the fp16 scales and mins start
    at even bytes of even-strided rows (loaded as 16-bit words; not with META8). Zero where ``~row_ok``,
    ``j >= rank`` or ``j < lo`` (``lo``: a mix piece's first coordinate, a multiple of QBLOCK; ``col0`` / ``blk0``
    are then the byte and block the head's coordinate 0 would have in that piece)."""
    if COL_ALIGN > 1:
        col0 = (col0 // COL_ALIGN) * COL_ALIGN  # exact (the host checked it); tells the compiler the alignment
    if RANK_ALIGN > 1:
        rank = (rank // RANK_ALIGN) * RANK_ALIGN
    cols = C0 + tl.arange(0, NCOLS)
    ok = row_ok[:, None] & ((cols < rank) & (cols >= lo))[None, :]
    # every coordinate of the tile in one quantization block (e.g. ranks <= 16 with blocks of 32): its scale and
    # min are loaded once per row and broadcast, not gathered per coordinate (H200 Nsight Compute at rank 12: the
    # per-coordinate byte gathers of the fp16 scales were the largest stall of both passes)
    ONE_BLOCK: tl.constexpr = (not BLOCKWISE) and (C0 // QBLOCK) == ((C0 + NCOLS - 1) // QBLOCK)
    B_START: tl.constexpr = (C0 // QBLOCK) * QBLOCK  # that block's first coordinate
    if BITS == 16:
        z = tl.load(row_ptr[:, None] + ((col0 + cols) * stride_w)[None, :], mask=ok, other=0.0).to(tl.float32)
    else:
        code = _latent_raw_codes(row_ptr, row_ok, col0, rank, lo, stride_w, C0, NROWS, NCOLS, BITS, RANK_ALIGN,
                                 GATHER)
        if MX:  # two's-complement codes times 2**(byte - 127), built from its bits (exact; no exp2 rounding)
            code = code.to(tl.int32)
            code = code - ((code >> (BITS - 1)) << BITS)
            code = code.to(tl.float32)
            if BLOCKWISE:
                kb = tl.arange(0, NCOLS // QBLOCK)
                blk = blk0 + C0 // QBLOCK + kb
                b_ok = row_ok[:, None] & (((C0 + kb * QBLOCK) < rank) & ((C0 + kb * QBLOCK) >= lo))[None, :]
                ex = tl.load(row_ptr[:, None] + ((scale_base + blk) * stride_w)[None, :], mask=b_ok, other=127)
                sc = (ex.to(tl.int32) << 23).to(tl.float32, bitcast=True)
                sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (NROWS, NCOLS // QBLOCK, QBLOCK)), (NROWS, NCOLS))
            elif ONE_BLOCK:
                b_ok = row_ok & (tl.full((NROWS,), B_START, tl.int32) < rank) & (tl.full((NROWS,), B_START, tl.int32) >= lo)
                ex = tl.load(row_ptr + (scale_base + blk0 + C0 // QBLOCK) * stride_w, mask=b_ok, other=127)
                sc = ((ex.to(tl.int32) << 23).to(tl.float32, bitcast=True))[:, None]
            else:
                blk = blk0 + cols // QBLOCK
                ex = tl.load(row_ptr[:, None] + ((scale_base + blk) * stride_w)[None, :], mask=ok, other=127)
                sc = (ex.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            z = tl.where(ok, code * sc, 0.0)
        else:
            code = code.to(tl.float32)
            if BLOCKWISE:
                kb = tl.arange(0, NCOLS // QBLOCK)
                blk = blk0 + C0 // QBLOCK + kb
                b_ok = row_ok[:, None] & (((C0 + kb * QBLOCK) < rank) & ((C0 + kb * QBLOCK) >= lo))[None, :]
                sc, mn = _scale_min(row_ptr[:, None], blk[None, :], scale_base, min_base, stride_w, b_ok, BITS,
                                    HALF_WORDS, META8)
                sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (NROWS, NCOLS // QBLOCK, QBLOCK)), (NROWS, NCOLS))
                mn = tl.reshape(tl.broadcast_to(mn[:, :, None], (NROWS, NCOLS // QBLOCK, QBLOCK)), (NROWS, NCOLS))
            elif ONE_BLOCK:
                blk = blk0 + C0 // QBLOCK
                b_ok = row_ok & (tl.full((NROWS,), B_START, tl.int32) < rank) & (tl.full((NROWS,), B_START, tl.int32) >= lo)
                sc, mn = _scale_min(row_ptr, blk, scale_base, min_base, stride_w, b_ok, BITS, HALF_WORDS, META8)
                sc = sc[:, None]
                mn = mn[:, None]
            else:
                blk = blk0 + cols // QBLOCK
                sc, mn = _scale_min(row_ptr[:, None], blk[None, :], scale_base, min_base, stride_w, ok, BITS, False,
                                    META8)
            z = tl.where(ok, code * sc + mn, 0.0)
    return z


@triton.jit
def _latent_codes(row_ptr, row_ok, col0, blk0, rank, scale_base, min_base, stride_w, C0: tl.constexpr,
                  NROWS: tl.constexpr, NCOLS: tl.constexpr, BITS: tl.constexpr, COL_ALIGN: tl.constexpr,
                  RANK_ALIGN: tl.constexpr, HALF_WORDS: tl.constexpr, GATHER: tl.constexpr = False,
                  META8: tl.constexpr = False):
    """One quantization block of a uniform ``int`` format, undecoded: ``(codes, scale, min)`` with codes (NROWS,
    NCOLS) fp32 holding the exact integer codes (0 where ``~row_ok`` or ``j >= rank``) and scale, min (NROWS,) fp32
    (0 where ``~row_ok``) of block ``blk0 + C0 // NCOLS``, so that :func:`_latent_tile` = ``codes * scale + min``
    on the valid coordinates. NCOLS is the format's block (C0 a multiple of it); META8: ``-f8`` block metadata
    (:func:`_scale_min`)."""
    if COL_ALIGN > 1:
        col0 = (col0 // COL_ALIGN) * COL_ALIGN
    if RANK_ALIGN > 1:
        rank = (rank // RANK_ALIGN) * RANK_ALIGN
    code = _latent_raw_codes(row_ptr, row_ok, col0, rank, 0, stride_w, C0, NROWS, NCOLS, BITS, RANK_ALIGN, GATHER)
    cols = C0 + tl.arange(0, NCOLS)
    code = tl.where(row_ok[:, None] & (cols < rank)[None, :], code.to(tl.float32), 0.0)  # odd ranks: no pad code
    blk = blk0 + C0 // NCOLS
    b_ok = row_ok & (tl.full((NROWS,), C0, tl.int32) < rank)  # the block holds valid coordinates
    sc, mn = _scale_min(row_ptr, blk, scale_base, min_base, stride_w, b_ok, BITS, HALF_WORDS, META8)
    return code, sc, mn


@triton.jit
def _mm_codes(code, sc, mn, p, p_colsum, acc, FP8: tl.constexpr, F32_DOT: tl.constexpr):
    """``acc + (code * sc + mn) @ p`` for one quantization block, exactly: the integer codes times the basis on the
    tensor cores (every product exact: codes are small integers, bases bf16- or e4m3-exact; FP8 uses e4m3 operands,
    for codes of at most 4 bits and e4m3 bases), then each row's scale, plus its min times the basis columns' sums
    ``p_colsum``. Replaces the hi/lo split of a dequantised fp32 latent (two dots) by one dot."""
    if F32_DOT:
        d = tl.dot(code, p.to(tl.float32))
    elif FP8:
        d = tl.dot(code.to(tl.float8e4nv), p.to(tl.float32).to(tl.float8e4nv))
    else:
        d = tl.dot(code.to(tl.bfloat16), p.to(tl.float32).to(tl.bfloat16))
    return acc + sc[:, None] * d + mn[:, None] * p_colsum[None, :]


@triton.jit
def _latent_load(row_ptr, row_ok, col0, blk0, rank, mix_row, scale_base, min_base, stride_w, C0: tl.constexpr,
                 NROWS: tl.constexpr, NCOLS: tl.constexpr, BITS: tl.constexpr, QBLOCK: tl.constexpr,
                 BLOCKWISE: tl.constexpr, COL_ALIGN: tl.constexpr, RANK_ALIGN: tl.constexpr,
                 HALF_WORDS: tl.constexpr, MX: tl.constexpr, GATHER: tl.constexpr = False,
                 META8: tl.constexpr = False):
    """:func:`_latent_tile` of a uniform format (BITS 16, 8, 4, 2), or of a ``mix`` bit plan (BITS 0): the sum of
    the head's 8-, 4- and 2-bit pieces, each read with its own constexpr width; ``mix_row`` points at the head's 12
    int32 (col0, blk0, lo, hi) for bits 8, 4, 2 (an empty range where the head has no such piece). META8: ``-f8``
    block metadata (e4m3 span and min bytes)."""
    if BITS == 0:
        z = _latent_tile(row_ptr, row_ok, tl.load(mix_row), tl.load(mix_row + 1), tl.load(mix_row + 3), scale_base,
                         min_base, stride_w, C0, NROWS, NCOLS, 8, QBLOCK, BLOCKWISE, COL_ALIGN, 1, HALF_WORDS,
                         False, tl.load(mix_row + 2), GATHER, META8)
        z += _latent_tile(row_ptr, row_ok, tl.load(mix_row + 4), tl.load(mix_row + 5), tl.load(mix_row + 7),
                          scale_base, min_base, stride_w, C0, NROWS, NCOLS, 4, QBLOCK, BLOCKWISE, COL_ALIGN, 1,
                          HALF_WORDS, False, tl.load(mix_row + 6), GATHER, META8)
        z += _latent_tile(row_ptr, row_ok, tl.load(mix_row + 8), tl.load(mix_row + 9), tl.load(mix_row + 11),
                          scale_base, min_base, stride_w, C0, NROWS, NCOLS, 2, QBLOCK, BLOCKWISE, COL_ALIGN, 1,
                          HALF_WORDS, False, tl.load(mix_row + 10), GATHER, META8)
    else:
        z = _latent_tile(row_ptr, row_ok, col0, blk0, rank, scale_base, min_base, stride_w, C0, NROWS, NCOLS, BITS,
                         QBLOCK, BLOCKWISE, COL_ALIGN, RANK_ALIGN, HALF_WORDS, MX, 0, GATHER, META8)
    return z


@triton.jit
def _mm(x, y, acc, F32_DOT: tl.constexpr):
    """``acc + x @ y`` for bf16 x, y; F32_DOT: as an fp32 dot of the same values (exact products on tf32 tensor
    cores; required under the interpreter, whose bf16 dot is wrong)."""
    if F32_DOT:
        acc = tl.dot(x.to(tl.float32), y.to(tl.float32), acc)
    else:
        acc = tl.dot(x, y, acc)
    return acc


@triton.jit
def _mm16(x16, y, acc, F32_DOT: tl.constexpr):
    """``acc + x16 @ fp16(y)`` on fp16 tensor cores (fp32 accumulation); F32_DOT as in :func:`_mm`."""
    y16 = y.to(tl.float32).to(tl.float16)
    if F32_DOT:
        acc = tl.dot(x16.to(tl.float32), y16.to(tl.float32), acc)
    else:
        acc = tl.dot(x16, y16, acc)
    return acc


@triton.jit
def _dot_split(a, b, acc, A_EXACT: tl.constexpr, B_EXACT: tl.constexpr, F32_DOT: tl.constexpr):
    """``acc + a @ b`` on bf16 tensor cores: an operand whose values are not exactly bf16 (``*_EXACT`` False) is
    split into ``hi = bf16(x)`` and ``lo = bf16(x - hi)``; the lo x lo term (~2^-16 relative) is dropped."""
    a_hi = a.to(tl.bfloat16)
    b_hi = b.to(tl.bfloat16)
    acc = _mm(a_hi, b_hi, acc, F32_DOT)
    if not A_EXACT:
        acc = _mm((a - a_hi.to(tl.float32)).to(tl.bfloat16), b_hi, acc, F32_DOT)
    if not B_EXACT:
        acc = _mm(a_hi, (b - b_hi.to(tl.float32)).to(tl.bfloat16), acc, F32_DOT)
    return acc


@triton.jit
def _split_bf16(x):
    """(hi, lo) bf16 parts of fp32 ``x``: ``hi = bf16(x)``, ``lo = bf16(x - hi)`` (about 16 mantissa bits)."""
    hi = x.to(tl.bfloat16)
    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _rotated_coefficients(p1, p2, q1, q2, ROPE: tl.constexpr, PAIRED_TABLE: tl.constexpr,
                          FP16: tl.constexpr = False):
    """The query folded into the basis as the coefficients of each RoPE table column (see
    :func:`_tile_scores_rotated`): from the basis rows of the pairs' halves ``p1``, ``p2`` (HALF, N) fp32 and the
    query's halves ``q1``, ``q2`` (HALF, N or 1) fp32, the (HALF, N) blocks ``Ea = P1 q1``, ``Eb = -P2 q1``,
    ``Ec = P2 q2``, ``Ed = P1 q2`` (one angle per pair, ROPE 3 or PAIRED_TABLE: ``Ea + Ec`` and ``Eb + Ed`` only;
    the last four returned are then placeholders), each as bf16 hi + lo parts (:func:`_split_bf16`); FP16: each
    rounded once to fp16 instead (``*_lo`` are then placeholders; one tensor-core product per table, see
    :func:`_table_coefficients`)."""
    if FP16:  # one return below: Triton wants the same return types on every path
        if ROPE == 3 or PAIRED_TABLE:
            ea_hi = (p1 * q1 + p2 * q2).to(tl.float16)
            eb_hi = (p1 * q2 - p2 * q1).to(tl.float16)
            ec_hi, ed_hi = ea_hi, eb_hi
        else:
            ea_hi = (p1 * q1).to(tl.float16)
            eb_hi = (-(p2 * q1)).to(tl.float16)
            ec_hi = (p2 * q2).to(tl.float16)
            ed_hi = (p1 * q2).to(tl.float16)
        ea_lo, eb_lo, ec_lo, ed_lo = ea_hi, eb_hi, ec_hi, ed_hi
    elif ROPE == 3 or PAIRED_TABLE:  # cos1 == cos2 and sin1 == sin2: two coefficient blocks
        ea_hi, ea_lo = _split_bf16(p1 * q1 + p2 * q2)
        eb_hi, eb_lo = _split_bf16(p1 * q2 - p2 * q1)
        ec_hi, ec_lo, ed_hi, ed_lo = ea_hi, ea_lo, eb_hi, eb_lo
    else:
        ea_hi, ea_lo = _split_bf16(p1 * q1)  # cos1
        eb_hi, eb_lo = _split_bf16(-(p2 * q1))  # sin1
        ec_hi, ec_lo = _split_bf16(p2 * q2)  # cos2
        ed_hi, ed_lo = _split_bf16(p1 * q2)  # sin2
    return ea_hi, ea_lo, eb_hi, eb_lo, ec_hi, ec_lo, ed_hi, ed_lo


@triton.jit
def _table_pair(w, cos_ptr, sin_ptr, pos, cols, tab_ok, e_cos_hi, e_cos_lo, e_sin_hi, e_sin_lo, stride_cp, stride_cw,
                stride_sp, stride_sw, COS_EXACT: tl.constexpr, F32_DOT: tl.constexpr, FP16: tl.constexpr):
    """``w`` plus the cos and sin table columns ``cols`` at positions ``pos`` times their coefficient blocks (see
    :func:`_table_coefficients`): bf16 tables as loaded against hi + lo parts, or FP16: both in fp16, one product
    each."""
    cos = tl.load(cos_ptr + pos[:, None] * stride_cp + (cols * stride_cw)[None, :], mask=tab_ok, other=0.0)
    sin = tl.load(sin_ptr + pos[:, None] * stride_sp + (cols * stride_sw)[None, :], mask=tab_ok, other=0.0)
    if FP16:
        w = _mm16(cos.to(tl.float32).to(tl.float16), e_cos_hi, w, F32_DOT)
        w = _mm16(sin.to(tl.float32).to(tl.float16), e_sin_hi, w, F32_DOT)
    else:
        if not COS_EXACT:  # exact (bf16) tables go to the tensor cores as loaded
            cos = cos.to(tl.float32)
            sin = sin.to(tl.float32)
        w = _dot_presplit(cos, e_cos_hi, e_cos_lo, w, COS_EXACT, F32_DOT)
        w = _dot_presplit(sin, e_sin_hi, e_sin_lo, w, COS_EXACT, F32_DOT)
    return w


@triton.jit
def _table_coefficients(w, cos_ptr, sin_ptr, pos_ptr, b, offs, slot_ok, rot_ok, c1, c2, ea_hi, ea_lo, eb_hi, eb_lo,
                        ec_hi, ec_lo, ed_hi, ed_lo, stride_cp, stride_cw, stride_sp, stride_sw, stride_pb, stride_ps,
                        ROPE: tl.constexpr, PAIRED_TABLE: tl.constexpr, COS_EXACT: tl.constexpr,
                        F32_DOT: tl.constexpr, FP16: tl.constexpr = False):
    """``w`` (BLOCK_N, N) plus each latent coordinate's coefficient at the slots' positions: the cos / sin table rows
    of ``offs`` (gathered through ``slot_pos``; zero where ``~slot_ok``) times the :func:`_rotated_coefficients`
    blocks on the tensor cores (tables exact in bf16, COS_EXACT: as loaded; else split hi / lo). FP16: the
    coefficient blocks are fp16 (:func:`_rotated_coefficients`) and each table is rounded to fp16 (exact for bf16
    values of magnitude >= 2^-14): one product per table instead of two or four."""
    # int32 positions (the launcher refuses tables whose offsets pass 2**31): 64-bit table offsets cost the grouped
    # key pass spilled registers (ptxas for sm_90a, Triton 3.6, rank 16: 152 -> 60 bytes)
    pos = tl.load(pos_ptr + b.to(tl.int64) * stride_pb + offs * stride_ps, mask=slot_ok, other=0).to(tl.int32)
    tab_ok = slot_ok[:, None] & rot_ok[None, :]
    w = _table_pair(w, cos_ptr, sin_ptr, pos, c1, tab_ok, ea_hi, ea_lo, eb_hi, eb_lo, stride_cp, stride_cw, stride_sp,
                    stride_sw, COS_EXACT, F32_DOT, FP16)
    if not (ROPE == 3 or PAIRED_TABLE):
        w = _table_pair(w, cos_ptr, sin_ptr, pos, c2, tab_ok, ec_hi, ec_lo, ed_hi, ed_lo, stride_cp, stride_cw,
                        stride_sp, stride_sw, COS_EXACT, F32_DOT, FP16)
    return w


@triton.jit
def _additive_log2(mv):
    """An additive attention mask (natural-log units, any float dtype) in log2 units, fp32. Finite values are clamped
    at -2.3e38 first, so that a large finite mask (HF fills masked positions with ``finfo(float32).min``) stays
    finite after the conversion instead of overflowing to -inf: a row masked wholly by such values then averages
    its slots uniformly, as eager attention and the reference do, instead of coming out as zeros. -inf stays -inf."""
    x = mv.to(tl.float32)
    return tl.where(x == float("-inf"), x, tl.maximum(x, -2.3e38)) * 1.4426950408889634


@triton.jit
def _masked_tile_scores(scores, mask_ptr, mask_cols, b, s, offs, slot_ok, col_ok, stride_mb, stride_ms, stride_mt,
                        MASK: tl.constexpr, MASK_HEADS: tl.constexpr):
    """``scores`` (BLOCK_N, NC) (log2 units) of the slots ``offs`` (BLOCK_N,) against NC query heads, with the
    attention mask applied (MASK 1: bool as uint8, where 0 gives -inf; 2: additive, converted to log2 units) and
    -inf wherever ``slot_ok[n] & col_ok[c]`` fails. MASK_HEADS: the mask differs per head, ``mask_cols`` (NC,) the
    heads' mask rows at (b, s); else one row for every head, loaded once per slot. Used by the one-pass kernels over
    chunks of heads (chunk, absorbed and lane passes)."""
    ok2 = slot_ok[:, None] & col_ok[None, :]
    if MASK_HEADS:
        m_ptrs = mask_cols[None, :] + (offs * stride_mt)[:, None]
        m_ok = ok2
    else:  # one mask row for every head (stride 0 over heads): one load per slot
        m_ptrs = (mask_ptr + b.to(tl.int64) * stride_mb + s * stride_ms + offs * stride_mt)[:, None]
        m_ok = slot_ok[:, None]
    if MASK == 1:
        mv = tl.load(m_ptrs, mask=m_ok, other=0)
        scores = tl.where(mv != 0, scores, float("-inf"))
    if MASK == 2:
        mv = tl.load(m_ptrs, mask=m_ok, other=0.0)
        scores = scores + _additive_log2(mv)
    return tl.where(ok2, scores, float("-inf"))


@triton.jit
def _first_exact_slot(slots_ptr, n_exact, kv_len, SLOT_BLOCK: tl.constexpr):
    """The lowest slot of a used exact token (``slots`` (n_exact,), -1: unused), or ``kv_len``: tiles wholly below
    it skip :func:`_exact_in_tile` (reduced from a vector, so its type stays int64 whatever Triton specialises
    kv_len to)."""
    lo_vec = tl.full((SLOT_BLOCK,), kv_len, tl.int64)
    for j0 in range(0, n_exact, SLOT_BLOCK):
        sj = j0 + tl.arange(0, SLOT_BLOCK)
        sl = tl.load(slots_ptr + sj, mask=sj < n_exact, other=-1).to(tl.int64)
        lo_vec = tl.minimum(lo_vec, tl.where(sl >= 0, sl, lo_vec))
    return tl.min(lo_vec, axis=0)


@triton.jit
def _slot_rows(pt_ptr, stride_ptb, b, offs, row_ok, slot_ok, PAGE: tl.constexpr):
    """Where the slots ``offs`` (BLOCK_N,) of sequence ``b`` live in a latent: ``(index, row, ld_ok)``, so that slot
    t's row starts at ``base + index * stride_b + row * stride_s`` (int64 offsets; ``stride_b`` and ``stride_s`` are
    the latent's first two strides) and loads only where ``ld_ok``.

    PAGE > 0 (page pools (N_pages + 1, PAGE, W) and the (B, S_max / PAGE) int32 page table ``pt``, row stride
    ``stride_ptb``; vLLM's PagedAttention layout): index is page table[b, t // PAGE] (-1: unmapped, not loaded,
    read as zero rows), row is t % PAGE. Otherwise (a static cache (B, S_max, W)): index is b (a scalar), row is t.
    ``row_ok`` bounds the page-table read; ``slot_ok`` (subset of it) the slots whose rows are wanted."""
    if PAGE > 0:
        index = tl.load(pt_ptr + b.to(tl.int64) * stride_ptb + offs // PAGE, mask=row_ok, other=-1).to(tl.int64)
        row = (offs % PAGE).to(tl.int64)
        ld_ok = slot_ok & (index >= 0)
    else:
        index = b.to(tl.int64)
        row = offs.to(tl.int64)
        ld_ok = slot_ok
    return index, row, ld_ok


@triton.jit
def _exact_in_tile(offs, tile_end, lo_exact, slots_ptr, n_exact, SLOT_BLOCK: tl.constexpr):
    """(BLOCK_N,) bool: which slots ``offs`` of a tile ending at ``tile_end`` hold an exact token (their keys and
    values come from new_k / new_v, not the latent); checked only if the tile reaches ``lo_exact``."""
    is_new = offs < 0
    if tile_end > lo_exact:
        for j0 in range(0, n_exact, SLOT_BLOCK):
            sj = j0 + tl.arange(0, SLOT_BLOCK)
            sl = tl.load(slots_ptr + sj, mask=sj < n_exact, other=-1)
            is_new = is_new | (tl.sum((offs[:, None] == sl[None, :]).to(tl.int32), axis=1) > 0)
    return is_new


@triton.jit
def _split_tiles(c, tiles_per_split, kv_len, slots_ptr, n_exact, BLOCK_N: tl.constexpr, SLOT_BLOCK: tl.constexpr):
    """The tiles of context split ``c`` (``tiles_per_split`` tiles of BLOCK_N slots each, the last split shorter):
    ``(t_start, t_end, lo_exact)``, with ``lo_exact`` from :func:`_first_exact_slot` for :func:`_tile_rows`."""
    t_start = c * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, tl.cdiv(kv_len, BLOCK_N))
    return t_start, t_end, _first_exact_slot(slots_ptr, n_exact, kv_len, SLOT_BLOCK)


@triton.jit
def _tile_rows(t, kv_len, lo_exact, slots_ptr, n_exact, pt_ptr, stride_ptb, b, BLOCK_N: tl.constexpr,
               SLOT_BLOCK: tl.constexpr, PAGE: tl.constexpr):
    """The slots of tile ``t`` of sequence ``b``: ``(offs, row_ok, slot_ok, index, row, ld_ok)``: offs (BLOCK_N,)
    the slots, row_ok those below kv_len, slot_ok those of them that are not exact tokens (:func:`_exact_in_tile`:
    those come from new_k / new_v), and where their latent rows are (:func:`_slot_rows`)."""
    offs = t * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs < kv_len
    slot_ok = row_ok & ~_exact_in_tile(offs, t * BLOCK_N + BLOCK_N, lo_exact, slots_ptr, n_exact, SLOT_BLOCK)
    index, row, ld_ok = _slot_rows(pt_ptr, stride_ptb, b, offs, row_ok, slot_ok, PAGE)
    return offs, row_ok, slot_ok, index, row, ld_ok


@triton.jit
def _dot_presplit(a, b_hi, b_lo, acc, A_EXACT: tl.constexpr, F32_DOT: tl.constexpr):
    """:func:`_dot_split` with ``b`` already split (:func:`_split_bf16`, e.g. once per program, not per tile)."""
    a_hi = a.to(tl.bfloat16)  # a no-op for bf16 ``a`` (A_EXACT)
    acc = _mm(a_hi, b_hi, acc, F32_DOT)
    if not A_EXACT:
        acc = _mm((a - a_hi.to(tl.float32)).to(tl.bfloat16), b_hi, acc, F32_DOT)
    acc = _mm(a_hi, b_lo, acc, F32_DOT)
    return acc


@triton.jit
def _fma_scores(scores, x, q_row0, cols, cols_ok, G, stride_qh, stride_qd, G_PAD: tl.constexpr,
                G_LOOP: tl.constexpr):
    """``scores`` (G_PAD, N) plus, for each query head g < G of the KV head, ``x (N, C) @ q_g[cols]`` in fp32 on the
    CUDA cores (exact fp32 products; for a few heads per KV head this beats a tensor-core product padded to 16
    rows, which would also need a hi/lo split of ``x``). G_LOOP: a power of two >= G."""
    gi = tl.arange(0, G_PAD)
    for g in tl.static_range(G_LOOP):
        qg = tl.load(q_row0 + g * stride_qh + cols * stride_qd, mask=cols_ok & (cols * 0 + g < G),
                     other=0.0).to(tl.float32)
        sg = tl.sum(x * qg[None, :], axis=1)
        scores += tl.where(gi[:, None] == g, sg[None, :], 0.0)
    return scores


@triton.jit
def _fma_scores_pair(scores, x1, x2, q_row0, cols1, cols2, cols_ok, G, stride_qh, stride_qd, G_PAD: tl.constexpr,
                     G_LOOP: tl.constexpr):
    """:func:`_fma_scores` of the two halves of the rotated pairs in one row sum per head (``x1 @ q_g[cols1] +
    x2 @ q_g[cols2]``): one reduction, so one layout change of its result, instead of two."""
    gi = tl.arange(0, G_PAD)
    for g in tl.static_range(G_LOOP):
        q1 = tl.load(q_row0 + g * stride_qh + cols1 * stride_qd, mask=cols_ok & (cols1 * 0 + g < G),
                     other=0.0).to(tl.float32)
        q2 = tl.load(q_row0 + g * stride_qh + cols2 * stride_qd, mask=cols_ok & (cols2 * 0 + g < G),
                     other=0.0).to(tl.float32)
        sg = tl.sum(x1 * q1[None, :] + x2 * q2[None, :], axis=1)
        scores += tl.where(gi[:, None] == g, sg[None, :], 0.0)
    return scores


@triton.jit
def _fma_values(acc, p, zv, G_PAD: tl.constexpr, G_LOOP: tl.constexpr):
    """``acc (G_PAD, R) + p (G_PAD, N) @ zv (N, R)`` for the first ``G_LOOP`` rows in fp32 on the CUDA cores: one
    weighted row sum per query head, instead of a tensor-core product padded to 16 rows with hi/lo splits of both
    operands (three dots). Rows >= G_LOOP are left as they are (padding heads)."""
    gi = tl.arange(0, G_PAD)
    for g in tl.static_range(G_LOOP):
        pg = tl.sum(tl.where(gi[:, None] == g, p, 0.0), axis=0)  # (N,) this head's softmax weights
        vg = tl.sum(pg[:, None] * zv, axis=0)  # (R,)
        acc += tl.where(gi[:, None] == g, vg[None, :], 0.0)
    return acc


@triton.jit
def _rope_rows(half, rot_dim, d_model, HALF: tl.constexpr, REST: tl.constexpr, ROPE: tl.constexpr):
    """Channel indices (i1, i2) of the rotated pairs, j < HALF, with their table columns (c1, c2) and validity,
    and the pass-through channels (rest, rest_ok); see the module docstring."""
    j = tl.arange(0, HALF)
    if ROPE == 1:
        i1 = j
        i2 = j + half
        c1 = j
        c2 = j + half
    else:
        i1 = 2 * j
        i2 = 2 * j + 1
        if ROPE == 2:
            c1 = 2 * j
            c2 = 2 * j + 1
        else:
            c1 = j
            c2 = j
    rest = rot_dim + tl.arange(0, REST)
    return i1, i2, c1, c2, j < half, rest, rest < d_model


# ------------------------------------------------------------------------------------------------ kernels


@triton.jit
def _latent_attention_split_kernel(
    # pointers
    q_ptr, lk_ptr, lv_ptr, bk_ptr, cos_ptr, sin_ptr, pos_ptr, slots_ptr, mask_ptr, kmeta_ptr, vmeta_ptr,
    m_ptr, l_ptr, acc_ptr, sc_ptr, stride_scr, pt_ptr, stride_ptb,
    # the fused merge (FUSE_MERGE): arrival counters, exact tokens, value basis, output
    cnt_ptr, nk_ptr, nv_ptr, bv_ptr, out_ptr,
    # sizes and scalars
    Hkv, S, n_exact, kv_len, tiles_per_split, n_split, qk_scale, G, D, half, rk_max,
    k_scale_base, k_min_base, v_scale_base, v_min_base, rv_max,
    # strides
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_lkb, stride_lks, stride_lkw,
    stride_lvb, stride_lvs, stride_lvw,
    stride_bkb, stride_bkh, stride_bkd, stride_bkr,
    stride_cp, stride_cw, stride_sp, stride_sw,
    stride_pb, stride_ps,
    stride_mb, stride_mh, stride_ms, stride_mt,
    stride_nkb, stride_nkh, stride_nks, stride_nkd,
    stride_nvb, stride_nvh, stride_nvs, stride_nvd,
    stride_bvb, stride_bvh, stride_bvd, stride_bvr,
    stride_ob, stride_oh, stride_os, stride_od,
    # meta-parameters
    G_PAD: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr, HAS_ROT: tl.constexpr, HAS_REST: tl.constexpr,
    ROPE: tl.constexpr, RK_PAD: tl.constexpr, RV_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, SLOT_BLOCK: tl.constexpr, K_BITS: tl.constexpr, K_QBLOCK: tl.constexpr,
    V_BITS: tl.constexpr, V_QBLOCK: tl.constexpr, MASK: tl.constexpr, Q_EXACT: tl.constexpr,
    ZK_EXACT: tl.constexpr, BK_EXACT: tl.constexpr, ZV_EXACT: tl.constexpr, F32_DOT: tl.constexpr,
    K_BLOCKWISE: tl.constexpr, V_BLOCKWISE: tl.constexpr, HOIST: tl.constexpr, K_ALIGN: tl.constexpr,
    V_ALIGN: tl.constexpr, K_RALIGN: tl.constexpr, V_RALIGN: tl.constexpr, K_WORDS: tl.constexpr,
    V_WORDS: tl.constexpr, HALF_ALIGN: tl.constexpr, K_MX: tl.constexpr, V_MX: tl.constexpr,
    PAIRED_TABLE: tl.constexpr, FMA_SCORES: tl.constexpr, G_LOOP: tl.constexpr, P_BF16: tl.constexpr,
    PHASE: tl.constexpr, FMA_VALUES: tl.constexpr = False, KEY_FP16: tl.constexpr = False,
    KEY_CODES: tl.constexpr = False, KEY_FP8: tl.constexpr = False, PAGE: tl.constexpr = 0,
    R_LOOP: tl.constexpr = False, FMA_VALUES_2D: tl.constexpr = True, FUSE_MERGE: tl.constexpr = False,
    D_PAD: tl.constexpr = 16, BLOCK_D: tl.constexpr = 16, BV_EXACT: tl.constexpr = False, NB: tl.constexpr = 16,
    MERGE_G_PAD: tl.constexpr = 16, ROT_BASIS: tl.constexpr = False, COS_EXACT: tl.constexpr = False,
    MERGE_SPLIT_BLOCK: tl.constexpr = 1, ROT_FP16: tl.constexpr = False, LOOP_STAGES: tl.constexpr = None,
    K_META8: tl.constexpr = False, V_META8: tl.constexpr = False,
):
    """One split of one (sequence, KV head, query token): partial (max, sum, absorbed value latent) in log2 units.

    Shapes: q (B, H, S, D); latent_k (B, S_max, Wk), latent_v (B, S_max, Wv) (float, or uint8 rows); basis_k
    (Hkv, D, Rk_max); cos/sin (P_max, W); slot_pos (B, S_max); slots (n_exact,) the exact tokens' slots (-1:
    unused), skipped here; mask (B, H, S, kv_len) by strides; PAGE > 0: latent_k / latent_v are page pools
    (N_pages + 1, PAGE, W) and ``pt_ptr`` the (B, S_max / PAGE) int32 page table (row stride ``stride_ptb``): slot t
    of sequence b is row t % PAGE of page table[b, t // PAGE], an unmapped page (-1) reads as zero rows;
    kmeta / vmeta (Hkv, 3) int32 = (first column or code byte, first block, rank); m / l (rows, n_split, G) and
    acc (rows, n_split, G, RV_PAD) fp32 with rows = B*Hkv*S. K_META8 / V_META8: ``-f8`` key / value latents (one
    e4m3 span and one e4m3 min byte per block, at ``*_scale_base + blk`` and ``*_min_base + blk``).

    PHASE 0 does it all in one pass. The two-pass form (PHASE 1, then PHASE 2) keeps far fewer values live per
    program: PHASE 1 only rebuilds keys and stores the tile's scores (log2 units, masked and the exact tokens'
    slots at -inf) into the workspace ``sc`` (rows*G, stride_scr) fp32; PHASE 2 reads them back and only runs the
    online softmax and the value-latent product. The scores cost 4*G bytes per slot and KV head of extra traffic
    (about 3% of an int8 rank-256 latent row).

    FUSE_MERGE (PHASE 0 or 2): the program that stores a row's last partial also merges the row
    (:func:`_merge_row`, every D slice) instead of a separate ``_latent_attention_reduce_kernel`` launch: each
    program counts its arrival in ``cnt`` (B*Hkv*S,) int32 with an acquire-release atomic after its partial
    stores (the CUDA threadFenceReduction pattern); the last arrival (count n_split - 1) reads the partials
    through L2 (in MERGE_G_PAD rows: at least 16, the tensor cores' M; MERGE_SPLIT_BLOCK splits per tile of
    partials, :func:`merge_split_block`). The counters are fresh per call and must
    be 0 at launch: PHASE 1 of the same call zeroes them (split c == 0), otherwise the launcher does (torch.zeros).
    Shapes of new_k / new_v / basis_v / out: as for the merge kernel."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    s = tl.program_id(2)
    b = bh // Hkv
    h = bh % Hkv
    heads = h * G + tl.arange(0, G_PAD)
    head_ok = tl.arange(0, G_PAD) < G
    q_row0 = q_ptr + b.to(tl.int64) * stride_qb + s * stride_qs + (h * G) * stride_qh  # query head h*G
    q_row = q_row0 + tl.arange(0, G_PAD) * stride_qh  # (G_PAD,)
    k_col0 = tl.load(kmeta_ptr + 3 * h)
    k_blk0 = tl.load(kmeta_ptr + 3 * h + 1)
    k_rank = tl.load(kmeta_ptr + 3 * h + 2)
    v_col0 = tl.load(vmeta_ptr + 3 * h)
    v_blk0 = tl.load(vmeta_ptr + 3 * h + 1)
    v_rank = tl.load(vmeta_ptr + 3 * h + 2)
    if HALF_ALIGN > 1:
        half = (half // HALF_ALIGN) * HALF_ALIGN  # exact (host-checked): aligned, vectorisable row loads
    i1, i2, c1, c2, rot_ok, rest, rest_ok = _rope_rows(half, 2 * half, D, HALF, REST, ROPE)
    q1 = tl.load(q_row[:, None] + (i1 * stride_qd)[None, :], mask=head_ok[:, None] & rot_ok[None, :], other=0.0)
    q2 = tl.load(q_row[:, None] + (i2 * stride_qd)[None, :], mask=head_ok[:, None] & rot_ok[None, :], other=0.0)
    q3 = tl.load(q_row[:, None] + (rest * stride_qd)[None, :], mask=head_ok[:, None] & rest_ok[None, :], other=0.0)
    q1 = q1.to(tl.float32)
    q2 = q2.to(tl.float32)
    q3 = q3.to(tl.float32)
    bk_head = bk_ptr + b.to(tl.int64) * stride_bkb + h * stride_bkh
    mask_row = mask_ptr + b.to(tl.int64) * stride_mb + s * stride_ms + heads.to(tl.int64) * stride_mh

    p1 = 0.0  # the basis block (HOIST); otherwise loaded per chunk inside _tile_scores
    p2 = 0.0
    p3 = 0.0
    if HOIST and PHASE != 2:  # the whole (RK_PAD, .) basis block stays on chip across the tile loop (BLOCK_R == RK_PAD)
        p1, p2, p3 = _basis_rows(bk_head, tl.arange(0, RK_PAD), rk_max, i1, i2, rot_ok, rest, rest_ok, stride_bkr,
                                 stride_bkd, p1, p2, p3, HAS_ROT, HAS_REST)
        if KEY_FP16:  # converted once, not per tile
            if HAS_ROT:
                p1 = p1.to(tl.float32).to(tl.float16)
                p2 = p2.to(tl.float32).to(tl.float16)
            if HAS_REST:
                p3 = p3.to(tl.float32).to(tl.float16)
    # ROT_BASIS (one query head per KV head, hoisted basis): the query folded into the basis once per program, as
    # the coefficients of each table column (see _tile_scores_rotated); (RK_PAD, HALF) fp32 each, c3 (RK_PAD,)
    # (transposed to (HALF, RK_PAD) and split into bf16 hi + lo parts here, not per tile)
    ea_hi = 0.0
    ea_lo = 0.0
    eb_hi = 0.0
    eb_lo = 0.0
    ec_hi = 0.0
    ec_lo = 0.0
    ed_hi = 0.0
    ed_lo = 0.0
    c3 = 0.0
    if ROT_BASIS and PHASE != 2:
        if HAS_ROT:
            ea_hi, ea_lo, eb_hi, eb_lo, ec_hi, ec_lo, ed_hi, ed_lo = _rotated_coefficients(
                tl.trans(p1.to(tl.float32)), tl.trans(p2.to(tl.float32)), tl.trans(q1), tl.trans(q2), ROPE,
                PAIRED_TABLE, ROT_FP16)
        if HAS_REST:
            c3 = tl.sum(p3.to(tl.float32) * q3, axis=1)

    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, RV_PAD), tl.float32)
    # one query head per KV head, value pass: the weighted value rows are summed elementwise into a (BLOCK_N, R)
    # accumulator and reduced across its rows once, after the loop, instead of a cross-thread row sum per tile
    VALUES_2D: tl.constexpr = FMA_VALUES and FMA_VALUES_2D and G_PAD == 1 and PHASE == 2
    if VALUES_2D:
        acc2 = tl.zeros((BLOCK_N, RV_PAD), tl.float32)
    else:
        acc2 = tl.zeros((1, 1), tl.float32)
    t_start, t_end, lo_exact = _split_tiles(c, tiles_per_split, kv_len, slots_ptr, n_exact, BLOCK_N, SLOT_BLOCK)
    # LOOP_STAGES (DecodeConfig.loop_stages / loop_stages_v): explicit software pipelining of every pipelineable
    # load of the tile loop (None: Triton's default, which pipelines only the loads that feed a tensor-core product)
    for t in tl.range(t_start, t_end, num_stages=LOOP_STAGES):
        # col_ok: not an exact token (those come from new_k / new_v); each slot's row: its page's row when the
        # latents are page pools (PAGE > 0), else the sequence's
        offs, row_ok, col_ok, row_idx, slot_row, ld_ok = _tile_rows(t, kv_len, lo_exact, slots_ptr, n_exact, pt_ptr,
                                                                    stride_ptb, b, BLOCK_N, SLOT_BLOCK, PAGE)
        lk_rows = lk_ptr + row_idx * stride_lkb + slot_row * stride_lks
        lv_rows = lv_ptr + row_idx * stride_lvb + slot_row * stride_lvs
        sc_rows = sc_ptr + ((bh * S + s) * G + tl.arange(0, G_PAD)).to(tl.int64) * stride_scr  # (G_PAD,)
        if PHASE == 2:
            scores = tl.load(sc_rows[:, None] + offs[None, :], mask=head_ok[:, None] & row_ok[None, :],
                             other=float("-inf"))
        elif ROT_BASIS:
            scores = _tile_scores_rotated(
                lk_rows, ld_ok, cos_ptr, sin_ptr, pos_ptr, mask_row, ea_hi, ea_lo, eb_hi, eb_lo, ec_hi, ec_lo, ed_hi,
                ed_lo, c3, b, offs, col_ok, head_ok,
                k_col0, k_blk0, k_rank, kmeta_ptr + 12 * h, k_scale_base, k_min_base, qk_scale, c1, c2, rot_ok,
                stride_lkw, stride_cp, stride_cw, stride_sp, stride_sw, stride_pb, stride_ps, stride_mt,
                HALF, HAS_ROT, HAS_REST, ROPE, RK_PAD, BLOCK_N, K_BITS, K_QBLOCK, MASK, F32_DOT, K_BLOCKWISE,
                K_ALIGN, K_RALIGN, K_WORDS, K_MX, PAIRED_TABLE, COS_EXACT, ROT_FP16, K_META8)
        else:
            scores = _tile_scores(
                lk_rows, ld_ok, bk_head, cos_ptr, sin_ptr, pos_ptr, mask_row, q_row0, q1, q2, q3, p1, p2, p3, b, offs,
                col_ok, head_ok, k_col0, k_blk0, k_rank, kmeta_ptr + 12 * h, k_scale_base, k_min_base, rk_max,
                qk_scale, G,
                i1, i2, c1, c2, rot_ok, rest, rest_ok,
                stride_lkw, stride_bkd, stride_bkr, stride_cp, stride_cw, stride_sp,
                stride_sw, stride_pb, stride_ps, stride_mt, stride_qh, stride_qd,
                G_PAD, HALF, REST, HAS_ROT, HAS_REST, ROPE, RK_PAD, BLOCK_N, BLOCK_R, K_BITS, K_QBLOCK, MASK,
                Q_EXACT, ZK_EXACT, BK_EXACT, F32_DOT, K_BLOCKWISE, HOIST, K_ALIGN, K_RALIGN, K_WORDS, K_MX,
                PAIRED_TABLE, FMA_SCORES, G_LOOP, KEY_FP16, KEY_CODES, KEY_FP8, R_LOOP, K_META8)
        if PHASE == 1:
            tl.store(sc_rows[:, None] + offs[None, :], scores, mask=head_ok[:, None] & row_ok[None, :])
        else:
            # online softmax (FlashAttention-2) over the absorbed value latent
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(scores - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            V_GATHER: tl.constexpr = (BLOCK_N <= 16) and not (FMA_VALUES or VALUES_2D)  # K = BLOCK_N
            zv = _latent_load(lv_rows, ld_ok, v_col0, v_blk0, v_rank, vmeta_ptr + 12 * h, v_scale_base, v_min_base,
                              stride_lvw, 0, BLOCK_N, RV_PAD, V_BITS, V_QBLOCK, V_BLOCKWISE, V_ALIGN, V_RALIGN,
                              V_WORDS, V_MX, V_GATHER, V_META8)
            if VALUES_2D:
                acc2 = acc2 * tl.sum(alpha, axis=0) + tl.sum(p, axis=0)[:, None] * zv
            elif FMA_VALUES:  # few query heads per KV head: exact fp32 products on the CUDA cores
                acc = _fma_values(acc * alpha[:, None], p, zv, G_PAD, G_LOOP)
            else:
                acc = _dot_split(p, zv, acc * alpha[:, None], P_BF16, ZV_EXACT, F32_DOT)
            m_i = m_new

    if VALUES_2D:
        acc = tl.sum(acc2, axis=0)[None, :]
    if PHASE == 1:
        if FUSE_MERGE:  # the value pass's arrival counters start at 0 (stream order: it runs after this launch)
            if c == 0:
                tl.store(cnt_ptr + bh * S + s, 0)
    else:
        row = (bh * S + s) * n_split + c
        g = tl.arange(0, G_PAD)
        tl.store(m_ptr + row * G + g, m_i, mask=head_ok)
        tl.store(l_ptr + row * G + g, l_i, mask=head_ok)
        rv = tl.arange(0, RV_PAD)
        tl.store(acc_ptr + (row * G + g)[:, None] * RV_PAD + rv[None, :], acc, mask=head_ok[:, None])
        if FUSE_MERGE:
            tl.debug_barrier()  # every thread's partial stores precede the release below
            arrived = tl.atomic_add(cnt_ptr + bh * S + s, 1, sem="acq_rel", scope="gpu")
            if arrived == n_split - 1:  # the last split of this row: merge it here
                _merge_row(bh, s, 0,
                           q_ptr, nk_ptr, nv_ptr, bv_ptr, slots_ptr, mask_ptr, m_ptr, l_ptr, acc_ptr, out_ptr,
                           Hkv, S, n_exact, n_split, qk_scale, G, D, rv_max,
                           stride_qb, stride_qh, stride_qs, stride_qd,
                           stride_nkb, stride_nkh, stride_nks, stride_nkd,
                           stride_nvb, stride_nvh, stride_nvs, stride_nvd,
                           stride_bvb, stride_bvh, stride_bvd, stride_bvr,
                           stride_mb, stride_mh, stride_ms, stride_mt,
                           stride_ob, stride_oh, stride_os, stride_od,
                           MERGE_G_PAD, D_PAD, RV_PAD, BLOCK_D, MASK, BV_EXACT, F32_DOT, NB, G_LOOP,
                           MERGE_SPLIT_BLOCK, False, True)


@triton.jit
def _basis_rows(bk_head, r, r_end, i1, i2, rot_ok, rest, rest_ok, stride_bkr, stride_bkd, p1, p2, p3,
                HAS_ROT: tl.constexpr, HAS_REST: tl.constexpr):
    """Rows ``r`` (< ``r_end``; 0 beyond) of a KV head's basis block, split as the keys are: the rotated pairs'
    halves (columns ``i1``, ``i2``) and the pass-through channels (``rest``); ``p1``, ``p2``, ``p3`` are returned
    unchanged where the head has no such channels."""
    b_ok = (r < r_end)[:, None]
    b_rows = bk_head + (r * stride_bkr)[:, None]
    if HAS_ROT:
        p1 = tl.load(b_rows + (i1 * stride_bkd)[None, :], mask=b_ok & rot_ok[None, :], other=0.0)
        p2 = tl.load(b_rows + (i2 * stride_bkd)[None, :], mask=b_ok & rot_ok[None, :], other=0.0)
    if HAS_REST:
        p3 = tl.load(b_rows + (rest * stride_bkd)[None, :], mask=b_ok & rest_ok[None, :], other=0.0)
    return p1, p2, p3


@triton.jit
def _rebuild_chunk(lk_rows, ld_ok, bk_head, r0, x1, x2, x3, p1, p2, p3, k_col0, k_blk0, k_rank, kmix_row,
                   k_scale_base, k_min_base, rk_max, i1, i2, rot_ok, rest, rest_ok, stride_lkw, stride_bkd, stride_bkr,
                   HAS_ROT: tl.constexpr, HAS_REST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   K_BITS: tl.constexpr, K_QBLOCK: tl.constexpr, ZK_EXACT: tl.constexpr, BK_EXACT: tl.constexpr,
                   F32_DOT: tl.constexpr, K_BLOCKWISE: tl.constexpr, HOIST: tl.constexpr, K_ALIGN: tl.constexpr,
                   K_RALIGN: tl.constexpr, K_WORDS: tl.constexpr, K_MX: tl.constexpr, KEY_FP16: tl.constexpr,
                   KEY_CODES: tl.constexpr, KEY_FP8: tl.constexpr, K_META8: tl.constexpr = False):
    """Add rank chunk [r0, r0 + BLOCK_R) of a tile's pre-RoPE key rebuild to ``x1``, ``x2``, ``x3`` (the rotated pairs'
    halves and the pass-through channels): the chunk of the latent times the same rows of the basis block (``p1``,
    ``p2``, ``p3`` when HOIST, which has one chunk; loaded here otherwise). K_META8: ``-f8`` key latents."""
    if KEY_CODES:  # one quantization block per chunk (BLOCK_R == K_QBLOCK), rebuilt in the code domain
        code, sc, mn = _latent_codes(lk_rows, ld_ok, k_col0, k_blk0, k_rank, k_scale_base, k_min_base,
                                     stride_lkw, r0, BLOCK_N, BLOCK_R, K_BITS, K_ALIGN, K_RALIGN, K_WORDS,
                                     BLOCK_R <= 16, K_META8)  # K = BLOCK_R: see _latent_raw_codes' GATHER
        # this head's rows only (< k_rank), whatever the padding holds
        p1, p2, p3 = _basis_rows(bk_head, r0 + tl.arange(0, BLOCK_R), k_rank, i1, i2, rot_ok, rest, rest_ok,
                                 stride_bkr, stride_bkd, p1, p2, p3, HAS_ROT, HAS_REST)
        if HAS_ROT:
            x1 = _mm_codes(code, sc, mn, p1, tl.sum(p1.to(tl.float32), axis=0), x1, KEY_FP8, F32_DOT)
            x2 = _mm_codes(code, sc, mn, p2, tl.sum(p2.to(tl.float32), axis=0), x2, KEY_FP8, F32_DOT)
        if HAS_REST:
            x3 = _mm_codes(code, sc, mn, p3, tl.sum(p3.to(tl.float32), axis=0), x3, KEY_FP8, F32_DOT)
    else:
        z = _latent_load(lk_rows, ld_ok, k_col0, k_blk0, k_rank, kmix_row, k_scale_base, k_min_base, stride_lkw,
                         r0, BLOCK_N, BLOCK_R, K_BITS, K_QBLOCK, K_BLOCKWISE, K_ALIGN, K_RALIGN, K_WORDS, K_MX,
                         BLOCK_R <= 16, K_META8)  # K = BLOCK_R: see _latent_raw_codes' GATHER
        if not HOIST:  # this chunk of the basis, from L2 (HOIST: the whole basis, loaded before the loop)
            p1, p2, p3 = _basis_rows(bk_head, r0 + tl.arange(0, BLOCK_R), rk_max, i1, i2, rot_ok, rest, rest_ok,
                                     stride_bkr, stride_bkd, p1, p2, p3, HAS_ROT, HAS_REST)
        if KEY_FP16:  # one fp16 dot: latent and basis rounded to fp16 (2^-11 relative; fp8 bases exact)
            z16 = z.to(tl.float16)
            if HAS_ROT:
                x1 = _mm16(z16, p1, x1, F32_DOT)
                x2 = _mm16(z16, p2, x2, F32_DOT)
            if HAS_REST:
                x3 = _mm16(z16, p3, x3, F32_DOT)
        else:
            if HAS_ROT:
                x1 = _dot_split(z, p1.to(tl.float32), x1, ZK_EXACT, BK_EXACT, F32_DOT)
                x2 = _dot_split(z, p2.to(tl.float32), x2, ZK_EXACT, BK_EXACT, F32_DOT)
            if HAS_REST:
                x3 = _dot_split(z, p3.to(tl.float32), x3, ZK_EXACT, BK_EXACT, F32_DOT)
    return x1, x2, x3


@triton.jit
def _mask_tile(scores, mask_row, offs, col_ok, head_ok, stride_mt, MASK: tl.constexpr):
    """Apply the attention mask to a tile's (G_PAD, BLOCK_N) log2-unit scores (MASK 1: bool, 2: additive, in natural
    log units, converted) and ``-inf`` where ``~col_ok`` (past the context, or the exact tokens' slots)."""
    if MASK == 1:
        mv = tl.load(mask_row[:, None] + (offs * stride_mt)[None, :], mask=head_ok[:, None] & col_ok[None, :],
                     other=0)
        scores = tl.where(mv != 0, scores, float("-inf"))
    if MASK == 2:
        mv = tl.load(mask_row[:, None] + (offs * stride_mt)[None, :], mask=head_ok[:, None] & col_ok[None, :],
                     other=0.0)
        scores = scores + _additive_log2(mv)
    return tl.where(col_ok[None, :], scores, float("-inf"))


@triton.jit
def _tile_scores(
    lk_rows, ld_ok, bk_head, cos_ptr, sin_ptr, pos_ptr, mask_row, q_row0, q1, q2, q3, p1, p2, p3, b, offs,
    col_ok, head_ok, k_col0, k_blk0, k_rank, kmix_row, k_scale_base, k_min_base, rk_max, qk_scale, G,
    i1, i2, c1, c2, rot_ok, rest, rest_ok,
    stride_lkw, stride_bkd, stride_bkr, stride_cp, stride_cw, stride_sp,
    stride_sw, stride_pb, stride_ps, stride_mt, stride_qh, stride_qd,
    G_PAD: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr, HAS_ROT: tl.constexpr, HAS_REST: tl.constexpr,
    ROPE: tl.constexpr, RK_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, K_BITS: tl.constexpr,
    K_QBLOCK: tl.constexpr, MASK: tl.constexpr, Q_EXACT: tl.constexpr, ZK_EXACT: tl.constexpr,
    BK_EXACT: tl.constexpr, F32_DOT: tl.constexpr, K_BLOCKWISE: tl.constexpr, HOIST: tl.constexpr,
    K_ALIGN: tl.constexpr, K_RALIGN: tl.constexpr, K_WORDS: tl.constexpr, K_MX: tl.constexpr,
    PAIRED_TABLE: tl.constexpr, FMA_SCORES: tl.constexpr, G_LOOP: tl.constexpr, KEY_FP16: tl.constexpr,
    KEY_CODES: tl.constexpr = False, KEY_FP8: tl.constexpr = False, R_LOOP: tl.constexpr = False,
    K_META8: tl.constexpr = False,
):
    """(G_PAD, BLOCK_N) fp32 scores in log2 units of one tile of slots ``offs``: rebuild the pre-RoPE keys from the key
    latent and the basis block, rotate them at each slot's position, score the KV head's query heads, mask
    (``-inf`` where ``~col_ok``: past the context, or the exact tokens' slots). ``lk_rows``: the slots' latent row
    pointers (BLOCK_N,), loaded where ``ld_ok`` (zero rows elsewhere: an unmapped page). K_META8: ``-f8`` key
    latents (e4m3 block spans and mins)."""
    # rebuild the tile's pre-RoPE keys, split into the rotated pairs' halves and the pass-through channels
    x1 = tl.zeros((BLOCK_N, HALF), tl.float32)
    x2 = tl.zeros((BLOCK_N, HALF), tl.float32)
    x3 = tl.zeros((BLOCK_N, REST), tl.float32)
    if R_LOOP:  # a runtime loop over the rank chunks: one chunk live at a time, its loads software-pipelined;
        # it stops after the head's last chunk (rank 96 in chunks of 32: 3, not RK_PAD's 4; coordinates past the
        # rank are zero in the latent load, so the chunks it skips would add nothing). A mix plan (K_BITS 0) has
        # no rank in its head table (it holds pieces): all of RK_PAD
        if K_BITS == 0:
            r_end = RK_PAD
        else:
            r_end = tl.minimum(k_rank, RK_PAD)
        for r0 in range(0, r_end, BLOCK_R):
            x1, x2, x3 = _rebuild_chunk(
                lk_rows, ld_ok, bk_head, r0, x1, x2, x3, p1, p2, p3, k_col0, k_blk0, k_rank, kmix_row, k_scale_base,
                k_min_base, rk_max, i1, i2, rot_ok, rest, rest_ok, stride_lkw, stride_bkd, stride_bkr, HAS_ROT,
                HAS_REST, BLOCK_N, BLOCK_R, K_BITS, K_QBLOCK, ZK_EXACT, BK_EXACT, F32_DOT, K_BLOCKWISE, HOIST,
                K_ALIGN, K_RALIGN, K_WORDS, K_MX, KEY_FP16, KEY_CODES, KEY_FP8, K_META8)
    else:
        for r0 in tl.static_range(0, RK_PAD, BLOCK_R):
            x1, x2, x3 = _rebuild_chunk(
                lk_rows, ld_ok, bk_head, r0, x1, x2, x3, p1, p2, p3, k_col0, k_blk0, k_rank, kmix_row, k_scale_base,
                k_min_base, rk_max, i1, i2, rot_ok, rest, rest_ok, stride_lkw, stride_bkd, stride_bkr, HAS_ROT,
                HAS_REST, BLOCK_N, BLOCK_R, K_BITS, K_QBLOCK, ZK_EXACT, BK_EXACT, F32_DOT, K_BLOCKWISE, HOIST,
                K_ALIGN, K_RALIGN, K_WORDS, K_MX, KEY_FP16, KEY_CODES, KEY_FP8, K_META8)
    scores = tl.zeros((G_PAD, BLOCK_N), tl.float32)
    if HAS_ROT:
        pos = tl.load(pos_ptr + b.to(tl.int64) * stride_pb + offs * stride_ps, mask=col_ok, other=0).to(tl.int64)
        tab_ok = col_ok[:, None] & rot_ok[None, :]
        cos1 = tl.load(cos_ptr + pos[:, None] * stride_cp + (c1 * stride_cw)[None, :], mask=tab_ok, other=0.0)
        sin1 = tl.load(sin_ptr + pos[:, None] * stride_sp + (c1 * stride_sw)[None, :], mask=tab_ok, other=0.0)
        if ROPE == 3 or PAIRED_TABLE:  # one angle per pair (complex form, or tables the caller declared paired)
            cos2 = cos1
            sin2 = sin1
        else:
            cos2 = tl.load(cos_ptr + pos[:, None] * stride_cp + (c2 * stride_cw)[None, :], mask=tab_ok,
                           other=0.0)
            sin2 = tl.load(sin_ptr + pos[:, None] * stride_sp + (c2 * stride_sw)[None, :], mask=tab_ok,
                           other=0.0)
        o1 = x1 * cos1.to(tl.float32) - x2 * sin1.to(tl.float32)
        o2 = x2 * cos2.to(tl.float32) + x1 * sin2.to(tl.float32)
        if FMA_SCORES:
            scores = _fma_scores_pair(scores, o1, o2, q_row0, i1, i2, rot_ok, G, stride_qh, stride_qd, G_PAD, G_LOOP)
        else:
            scores = _dot_split(q1, tl.trans(o1), scores, Q_EXACT, False, F32_DOT)
            scores = _dot_split(q2, tl.trans(o2), scores, Q_EXACT, False, F32_DOT)
    if HAS_REST:
        if FMA_SCORES:
            scores = _fma_scores(scores, x3, q_row0, rest, rest_ok, G, stride_qh, stride_qd, G_PAD, G_LOOP)
        else:
            scores = _dot_split(q3, tl.trans(x3), scores, Q_EXACT, False, F32_DOT)
    scores = scores * qk_scale  # log2 units: qk_scale = scale * log2(e)
    return _mask_tile(scores, mask_row, offs, col_ok, head_ok, stride_mt, MASK)


@triton.jit
def _tile_scores_rotated(
    lk_rows, ld_ok, cos_ptr, sin_ptr, pos_ptr, mask_row, ea_hi, ea_lo, eb_hi, eb_lo, ec_hi, ec_lo, ed_hi, ed_lo, c3,
    b, offs, col_ok, head_ok, k_col0, k_blk0, k_rank, kmix_row, k_scale_base, k_min_base, qk_scale, c1, c2, rot_ok,
    stride_lkw, stride_cp, stride_cw, stride_sp, stride_sw, stride_pb, stride_ps, stride_mt,
    HALF: tl.constexpr, HAS_ROT: tl.constexpr, HAS_REST: tl.constexpr, ROPE: tl.constexpr, RK_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, K_BITS: tl.constexpr, K_QBLOCK: tl.constexpr, MASK: tl.constexpr, F32_DOT: tl.constexpr,
    K_BLOCKWISE: tl.constexpr, K_ALIGN: tl.constexpr, K_RALIGN: tl.constexpr, K_WORDS: tl.constexpr,
    K_MX: tl.constexpr, PAIRED_TABLE: tl.constexpr, COS_EXACT: tl.constexpr, ROT_FP16: tl.constexpr = False,
    K_META8: tl.constexpr = False,
):
    """:func:`_tile_scores` for one query head per KV head without rebuilding keys: RoPE moved onto the basis.

    With x1 = z P1, x2 = z P2 (the pairs' halves) the score of slot t is
    ``sum_j q1_j (x1 cos1 - x2 sin1)_tj + q2_j (x2 cos2 + x1 sin2)_tj + q3 . x3_t``, which regrouped over the
    latent coordinates r is ``sum_r z_tr W_tr`` with ``W = cos1 @ Ea^T + sin1 @ Eb^T + cos2 @ Ec^T + sin2 @ Ed^T +
    c3`` and ``Ea = P1 diag(q1)``, ``Eb = -P2 diag(q1)``, ``Ec = P2 diag(q2)``, ``Ed = P1 diag(q2)``, ``c3 = P3 q3``
    (paired tables: two blocks, ``Ea + Ec`` and ``Eb + Ed``), built once per program and passed transposed,
    (HALF, RK_PAD), as bf16 hi + lo parts (``_split_bf16``). Per slot this is
    (BLOCK_N, HALF) x (HALF, RK_PAD) tensor-core products of the RoPE tables (hi/lo split, ~2^-16 relative) plus
    RK_PAD fp32 multiply-adds against the dequantized latent, instead of rebuilding D channels, rotating them
    and reducing D products: the rotation costs the tensor cores HALF*RK_PAD per table and slot, the CUDA cores
    only RK_PAD. c3: (RK_PAD,) fp32. K_META8: ``-f8`` key latents. Returns (1, BLOCK_N) fp32 log2-unit scores."""
    z = _latent_load(lk_rows, ld_ok, k_col0, k_blk0, k_rank, kmix_row, k_scale_base, k_min_base, stride_lkw, 0,
                     BLOCK_N, RK_PAD, K_BITS, K_QBLOCK, K_BLOCKWISE, K_ALIGN, K_RALIGN, K_WORDS, K_MX, False, K_META8)
    w = tl.zeros((BLOCK_N, RK_PAD), tl.float32)
    if HAS_ROT:
        w = _table_coefficients(w, cos_ptr, sin_ptr, pos_ptr, b, offs, col_ok, rot_ok, c1, c2, ea_hi, ea_lo, eb_hi,
                                eb_lo, ec_hi, ec_lo, ed_hi, ed_lo, stride_cp, stride_cw, stride_sp, stride_sw,
                                stride_pb, stride_ps, ROPE, PAIRED_TABLE, COS_EXACT, F32_DOT, ROT_FP16)
    if HAS_REST:
        w = w + c3[None, :]
    scores = tl.sum(z * w, axis=1)[None, :] * qk_scale  # (1, BLOCK_N), log2 units
    return _mask_tile(scores, mask_row, offs, col_ok, head_ok, stride_mt, MASK)


@triton.jit
def _exact_scores(q, head_ok, nk_head, slots_ptr, mask_row, j0, n_exact, D, qk_scale, stride_nks, stride_nkd,
                  stride_mt, D_PAD: tl.constexpr, NB: tl.constexpr, MASK: tl.constexpr, F32_DOT: tl.constexpr):
    """(G_PAD, NB) fp32 log2-unit scores of q (G_PAD, D_PAD) against exact keys j0 .. j0+NB-1, each masked at its
    slot's column; ``-inf`` past ``n_exact`` and for unused entries (slot < 0). One tensor-core product with hi/lo
    splits (2-D tiles only: a (G, tokens, D) broadcast form computed wrong sums on the H200 in run 3)."""
    j = j0 + tl.arange(0, NB)
    sl = tl.load(slots_ptr + j, mask=j < n_exact, other=-1)
    used = sl >= 0
    d = tl.arange(0, D_PAD)
    k = tl.load(nk_head + j[:, None] * stride_nks + (d * stride_nkd)[None, :], mask=used[:, None] & (d < D)[None, :],
                other=0.0).to(tl.float32)
    sc = _dot_split(q, tl.trans(k), tl.zeros((q.shape[0], NB), tl.float32), False, False, F32_DOT) * qk_scale
    col = tl.maximum(sl, 0)  # an unused entry reads column 0, then scores -inf
    return _mask_tile(sc, mask_row, col, used, head_ok, stride_mt, MASK)  # each token's mask at its slot's column


@triton.jit
def _load_part(ptrs, mask, other, CG: tl.constexpr):
    """``tl.load(ptrs, mask, other)`` of split partials; CG: through L2 only (``.cg``), for partials other programs
    of the same launch wrote (see :func:`_merge_row`'s PARTS_CG)."""
    if CG:
        x = tl.load(ptrs, mask=mask, other=other, cache_modifier=".cg")
    else:
        x = tl.load(ptrs, mask=mask, other=other)
    return x


@triton.jit
def _merge_row(
    bh, s, pid_d,
    q_ptr, nk_ptr, nv_ptr, bv_ptr, slots_ptr, mask_ptr, m_ptr, l_ptr, acc_ptr, out_ptr,
    Hkv, S, n_exact, n_split, qk_scale, G, D, rv_max,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_nkb, stride_nkh, stride_nks, stride_nkd,
    stride_nvb, stride_nvh, stride_nvs, stride_nvd,
    stride_bvb, stride_bvh, stride_bvd, stride_bvr,
    stride_mb, stride_mh, stride_ms, stride_mt,
    stride_ob, stride_oh, stride_os, stride_od,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, RV_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    MASK: tl.constexpr, BV_EXACT: tl.constexpr, F32_DOT: tl.constexpr, NB: tl.constexpr,
    G_LOOP: tl.constexpr, SPLIT_BLOCK: tl.constexpr, SPLIT_D: tl.constexpr, PARTS_CG: tl.constexpr,
):
    """Merge the splits of row (sequence ``bh // Hkv``, KV head ``bh % Hkv``, query token ``s``), add the exact
    tokens, project, normalise, store (D slice ``pid_d`` when SPLIT_D, else every slice).

    The row's partials (m, l: (n_split, G) fp32; acc: (n_split, G, RV_PAD) fp32, from row ``(bh*S + s)*n_split``)
    are read SPLIT_BLOCK splits at a time (:func:`merge_split_block`), as tiles: a loop with one dependent load
    per split, twice, made the merge latency-bound at batch 1. First the max over (SPLIT_BLOCK, G_PAD) tiles of m;
    then, per tile step and query head ``gi`` (a static loop over G_LOOP = next_pow2(G) >= G heads: its loads are
    independent, SPLIT_BLOCK * G_LOOP * RV_PAD fp32 values live), that head's m, l (SPLIT_BLOCK,) and acc
    (SPLIT_BLOCK, RV_PAD) tiles, weighted and summed over the splits into row ``gi`` of the (G_PAD, RV_PAD)
    accumulator. 2-D tiles only (see :func:`_exact_scores`). The same fp32 products as the per-split loop; only
    the order of the fp32 sums differs. G_PAD: the projection's tile rows (at least 16, the tensor cores' M).
    PARTS_CG: read the partials through L2 only (``.cg``), as the fused merge must: they
    were written by other programs of the same launch, and this SM's L1 may hold the same workspace addresses from
    an earlier call."""
    b = bh // Hkv
    h = bh % Hkv
    g = tl.arange(0, G_PAD)
    head_ok = g < G
    heads = h * G + g
    d = tl.arange(0, D_PAD)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + s * stride_qs + (heads * stride_qh)[:, None]
                + (d * stride_qd)[None, :], mask=head_ok[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
    nk_head = nk_ptr + b.to(tl.int64) * stride_nkb + h * stride_nkh
    nv_head = nv_ptr + b.to(tl.int64) * stride_nvb + h * stride_nvh
    mask_row = mask_ptr + b.to(tl.int64) * stride_mb + s * stride_ms + heads.to(tl.int64) * stride_mh
    row0 = (bh * S + s) * n_split
    cb = tl.arange(0, SPLIT_BLOCK)
    m_all = tl.full((G_PAD,), float("-inf"), tl.float32)
    for c0 in range(0, n_split, SPLIT_BLOCK):
        c = c0 + cb
        m_t = _load_part(m_ptr + ((row0 + c) * G)[:, None] + g[None, :], (c < n_split)[:, None] & head_ok[None, :],
                         float("-inf"), PARTS_CG)  # (SPLIT_BLOCK, G_PAD)
        m_all = tl.maximum(m_all, tl.max(m_t, axis=0))
    for j0 in range(0, n_exact, NB):
        sc = _exact_scores(q, head_ok, nk_head, slots_ptr, mask_row, j0, n_exact, D, qk_scale, stride_nks,
                           stride_nkd, stride_mt, D_PAD, NB, MASK, F32_DOT)
        m_all = tl.maximum(m_all, tl.max(sc, axis=1))
    m_use = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.zeros((G_PAD,), tl.float32)
    rv = tl.arange(0, RV_PAD)
    acc = tl.zeros((G_PAD, RV_PAD), tl.float32)
    for c0 in range(0, n_split, SPLIT_BLOCK):
        c = c0 + cb
        c_ok = c < n_split
        for gi in tl.static_range(G_LOOP):
            ok = c_ok & (tl.full((SPLIT_BLOCK,), gi, tl.int32) < G)  # G_LOOP rounds G up to a power of two
            p_row = (row0 + c) * G + gi  # (SPLIT_BLOCK,) this head's partials
            m_c = _load_part(m_ptr + p_row, ok, float("-inf"), PARTS_CG)
            l_c = _load_part(l_ptr + p_row, ok, 0.0, PARTS_CG)
            part = _load_part(acc_ptr + p_row[:, None] * RV_PAD + rv[None, :], ok[:, None], 0.0, PARTS_CG)
            sel = g == gi
            w = tl.exp2(m_c - tl.sum(tl.where(sel, m_use, 0.0), axis=0))  # 0 past n_split (m_use is finite)
            l_all = tl.where(sel, l_all + tl.sum(w * l_c, axis=0), l_all)
            acc = tl.where(sel[:, None], acc + tl.sum(w[:, None] * part, axis=0)[None, :], acc)
    for j0 in range(0, n_exact, NB):
        sc = _exact_scores(q, head_ok, nk_head, slots_ptr, mask_row, j0, n_exact, D, qk_scale, stride_nks,
                           stride_nkd, stride_mt, D_PAD, NB, MASK, F32_DOT)
        l_all += tl.sum(tl.exp2(sc - m_use[:, None]), axis=1)
    inv = tl.where(l_all > 0, 1.0 / tl.where(l_all > 0, l_all, 1.0), 0.0)
    out_row = out_ptr + b.to(tl.int64) * stride_ob + s * stride_os + heads * stride_oh
    bv_head = bv_ptr + b.to(tl.int64) * stride_bvb + h * stride_bvh
    for d0 in tl.static_range(0, BLOCK_D if SPLIT_D else D_PAD, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        if SPLIT_D:
            dd += pid_d * BLOCK_D
        pv = tl.load(bv_head + (rv * stride_bvr)[:, None] + (dd * stride_bvd)[None, :],
                     mask=(rv < rv_max)[:, None] & (dd < D)[None, :], other=0.0).to(tl.float32)
        o = _dot_split(acc, pv, tl.zeros((G_PAD, BLOCK_D), tl.float32), False, BV_EXACT, F32_DOT)
        for j0 in range(0, n_exact, NB):
            sc = _exact_scores(q, head_ok, nk_head, slots_ptr, mask_row, j0, n_exact, D, qk_scale, stride_nks,
                               stride_nkd, stride_mt, D_PAD, NB, MASK, F32_DOT)
            p = tl.exp2(sc - m_use[:, None])
            j = j0 + tl.arange(0, NB)
            used = tl.load(slots_ptr + j, mask=j < n_exact, other=-1) >= 0  # unused entries: never read
            v = tl.load(nv_head + j[:, None] * stride_nvs + (dd * stride_nvd)[None, :],
                        mask=used[:, None] & (dd < D)[None, :], other=0.0).to(tl.float32)
            o = _dot_split(p, v, o, False, False, F32_DOT)
        tl.store(out_row[:, None] + (dd * stride_od)[None, :], (o * inv[:, None]).to(out_ptr.dtype.element_ty),
                 mask=head_ok[:, None] & (dd < D)[None, :])


@triton.jit
def _latent_attention_reduce_kernel(
    # pointers
    q_ptr, nk_ptr, nv_ptr, bv_ptr, slots_ptr, mask_ptr, m_ptr, l_ptr, acc_ptr, out_ptr,
    # sizes and scalars
    Hkv, S, n_exact, n_split, qk_scale, G, D, rv_max,
    # strides
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_nkb, stride_nkh, stride_nks, stride_nkd,
    stride_nvb, stride_nvh, stride_nvs, stride_nvd,
    stride_bvb, stride_bvh, stride_bvd, stride_bvr,
    stride_mb, stride_mh, stride_ms, stride_mt,
    stride_ob, stride_oh, stride_os, stride_od,
    # meta-parameters
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, RV_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    MASK: tl.constexpr, BV_EXACT: tl.constexpr, F32_DOT: tl.constexpr, NB: tl.constexpr,
    G_LOOP: tl.constexpr, SPLIT_BLOCK: tl.constexpr, SPLIT_D: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Merge the splits of one (sequence, KV head, query token), add the exact tokens, project, normalise
    (:func:`_merge_row`). PDL: launched as a programmatic dependent of the pass (:data:`PDL_GPU_CHECKED`): it waits
    (``griddepcontrol.wait``) before anything else.

    Shapes: new_k / new_v (B, Hkv, n_exact, D) at slots (n_exact,) (-1: unused entry); basis_v (Hkv, D, Rv_max);
    out (B, H, S, D) q.dtype; the rest as in ``_latent_attention_split_kernel``. The exact tokens are taken NB at a
    time (:func:`_exact_scores`): a recent window of W tokens costs W/NB tile products per pass. Rows whose every
    score is masked get 0 (torch SDPA's math path). SPLIT_D: grid (B*Hkv, S, D_PAD / BLOCK_D), each program merges
    the splits and projects one BLOCK_D slice of the output (more programs at small batch; the merge is repeated
    per slice); otherwise one program per (sequence, KV head, query token) projects every slice. G_LOOP:
    next_pow2(G); SPLIT_BLOCK: splits per tile of partials (:func:`merge_split_block`).
    """
    if PDL:
        tl.extra.cuda.gdc_wait()
    _merge_row(tl.program_id(0), tl.program_id(1), tl.program_id(2),
               q_ptr, nk_ptr, nv_ptr, bv_ptr, slots_ptr, mask_ptr, m_ptr, l_ptr, acc_ptr, out_ptr,
               Hkv, S, n_exact, n_split, qk_scale, G, D, rv_max,
               stride_qb, stride_qh, stride_qs, stride_qd,
               stride_nkb, stride_nkh, stride_nks, stride_nkd,
               stride_nvb, stride_nvh, stride_nvs, stride_nvd,
               stride_bvb, stride_bvh, stride_bvd, stride_bvr,
               stride_mb, stride_mh, stride_ms, stride_mt,
               stride_ob, stride_oh, stride_os, stride_od,
               G_PAD, D_PAD, RV_PAD, BLOCK_D, MASK, BV_EXACT, F32_DOT, NB, G_LOOP, SPLIT_BLOCK, SPLIT_D,
               False)


@triton.jit
def _merge_splits_kernel(
    # pointers
    q_ptr, nk_ptr, nv_ptr, bv_ptr, slots_ptr, m_ptr, l_ptr, acc_ptr, out_ptr,
    # sizes and scalars
    Hkv, S, n_exact, n_split, qk_scale, G, D, rv_max,
    # strides
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_nkb, stride_nkh, stride_nks, stride_nkd,
    stride_nvb, stride_nvh, stride_nvs, stride_nvd,
    stride_bvb, stride_bvh, stride_bvd, stride_bvr,
    stride_ob, stride_oh, stride_os, stride_od,
    # meta-parameters
    G_PAD: tl.constexpr, G_SMALL: tl.constexpr, D_PAD: tl.constexpr, RV_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    BV_EXACT: tl.constexpr, F32_DOT: tl.constexpr, NB: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
    SPLIT_D: tl.constexpr, PDL: tl.constexpr = False,
):
    """The merge of :func:`_latent_attention_reduce_kernel` for calls without an attention mask, in one pass over
    the partials (the MMA pass's merge). Same grid (B*Hkv, S, D_PAD / BLOCK_D if SPLIT_D else 1), workspaces, exact
    tokens and output.

    Each (split, query head, value coordinate) is one element of a (SPLIT_BLOCK, G_SMALL * RV_PAD) tile (the head's m
    and l read per element, from L1): an online merge over the splits, SPLIT_BLOCK at a time, with no per-head loop
    and no second pass for the max. The exact tokens' scores are computed once per block of NB tokens, their values
    accumulated online in a (G_PAD, D) tile of their own, and the two parts combined at the end (FlashDecoding's
    merge; Dao et al., 2023). Scores are in log2 units (``qk_scale`` includes log2 e), as in the partials.
    G_SMALL: next_pow2(G), the partials' tile; G_PAD (>= 16, the tensor cores' M): the products' rows. PDL: launched
    as a programmatic dependent of the pass (:data:`PDL_GPU_CHECKED`): the value basis and the query are loaded
    first, then ``griddepcontrol.wait`` before the partials (every write comes after it)."""
    bh = tl.program_id(0)
    s = tl.program_id(1)
    pid_d = tl.program_id(2)
    b = bh // Hkv
    h = bh % Hkv
    # the value basis slice and the query heads: inputs of the call, not of the pass (loaded before PDL's wait)
    g = tl.arange(0, G_PAD)
    head_ok = g < G
    heads = h * G + g
    d = tl.arange(0, D_PAD)
    if SPLIT_D:
        dd = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    else:
        dd = tl.arange(0, BLOCK_D)
    rv = tl.arange(0, RV_PAD)
    bv_head = bv_ptr + b.to(tl.int64) * stride_bvb + h * stride_bvh
    pv = tl.load(bv_head + (rv * stride_bvr)[:, None] + (dd * stride_bvd)[None, :],
                 mask=(rv < rv_max)[:, None] & (dd < D)[None, :], other=0.0).to(tl.float32)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + s * stride_qs + (heads * stride_qh)[:, None]
                + (d * stride_qd)[None, :], mask=head_ok[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    GR: tl.constexpr = G_SMALL * RV_PAD
    gr = tl.arange(0, GR)
    gc = gr // RV_PAD  # each column's query head
    col_ok = gc < G
    row0 = (bh * S + s) * n_split
    cb = tl.arange(0, SPLIT_BLOCK)
    m_run = tl.full((GR,), float("-inf"), tl.float32)
    l_run = tl.zeros((GR,), tl.float32)
    a_run = tl.zeros((GR,), tl.float32)
    for c0 in range(0, n_split, SPLIT_BLOCK):
        c = c0 + cb
        ok = (c < n_split)[:, None] & col_ok[None, :]
        p_row = (row0 + c)[:, None] * G + gc[None, :]  # (SPLIT_BLOCK, GR): the partials' (split, head) rows
        m_t = tl.load(m_ptr + p_row, mask=ok, other=float("-inf"))
        l_t = tl.load(l_ptr + p_row, mask=ok, other=0.0)
        a_t = tl.load(acc_ptr + p_row.to(tl.int64) * RV_PAD + (gr % RV_PAD)[None, :], mask=ok, other=0.0)
        m_new = tl.maximum(m_run, tl.max(m_t, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_use)  # 0 while m_run is -inf
        w = tl.exp2(m_t - m_use[None, :])  # 0 for masked-off and empty splits
        l_run = l_run * alpha + tl.sum(w * l_t, axis=0)
        a_run = a_run * alpha + tl.sum(w * a_t, axis=0)
        m_run = m_new
    # per head: max and sum (equal over a head's columns) and value latent, as G_PAD rows (rows >= G_SMALL empty)
    REP: tl.constexpr = G_PAD // G_SMALL
    m_p = tl.reshape(tl.broadcast_to(tl.max(tl.reshape(m_run, (G_SMALL, RV_PAD)), axis=1)[None, :], (REP, G_SMALL)),
                     (G_PAD,))
    m_p = tl.where(g < G_SMALL, m_p, float("-inf"))
    l_p = tl.reshape(tl.broadcast_to(tl.max(tl.reshape(l_run, (G_SMALL, RV_PAD)), axis=1)[None, :], (REP, G_SMALL)),
                     (G_PAD,))
    l_p = tl.where(g < G_SMALL, l_p, 0.0)
    acc = tl.reshape(tl.broadcast_to(tl.reshape(a_run, (G_SMALL, RV_PAD))[None, :, :], (REP, G_SMALL, RV_PAD)),
                     (G_PAD, RV_PAD))
    acc = tl.where((g < G_SMALL)[:, None], acc, 0.0)
    o = _dot_split(acc, pv, tl.zeros((G_PAD, BLOCK_D), tl.float32), False, BV_EXACT, F32_DOT)
    # the exact tokens, online in their own (max, sum, values)
    nk_head = nk_ptr + b.to(tl.int64) * stride_nkb + h * stride_nkh
    nv_head = nv_ptr + b.to(tl.int64) * stride_nvb + h * stride_nvh
    m_e = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_e = tl.zeros((G_PAD,), tl.float32)
    o_e = tl.zeros((G_PAD, BLOCK_D), tl.float32)
    for j0 in range(0, n_exact, NB):
        sc = _exact_scores(q, head_ok, nk_head, slots_ptr, q_ptr, j0, n_exact, D, qk_scale, stride_nks, stride_nkd,
                           0, D_PAD, NB, 0, F32_DOT)
        m_new = tl.maximum(m_e, tl.max(sc, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_e - m_use)
        p = tl.exp2(sc - m_use[:, None])
        j = j0 + tl.arange(0, NB)
        used = tl.load(slots_ptr + j, mask=j < n_exact, other=-1) >= 0  # unused entries: never read
        v = tl.load(nv_head + j[:, None] * stride_nvs + (dd * stride_nvd)[None, :],
                    mask=used[:, None] & (dd < D)[None, :], other=0.0).to(tl.float32)
        l_e = l_e * alpha + tl.sum(p, axis=1)
        o_e = _dot_split(p, v, o_e * alpha[:, None], False, False, F32_DOT)
        m_e = m_new
    m_all = tl.maximum(m_p, m_e)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w_p = tl.exp2(m_p - m_all)
    w_e = tl.exp2(m_e - m_all)
    l_all = l_p * w_p + l_e * w_e
    o = o * w_p[:, None] + o_e * w_e[:, None]
    inv = tl.where(l_all > 0, 1.0 / tl.where(l_all > 0, l_all, 1.0), 0.0)  # rows with no token: 0 (SDPA's math path)
    out_row = out_ptr + b.to(tl.int64) * stride_ob + s * stride_os + heads * stride_oh
    tl.store(out_row[:, None] + (dd * stride_od)[None, :], (o * inv[:, None]).to(out_ptr.dtype.element_ty),
             mask=head_ok[:, None] & (dd < D)[None, :])


@triton.jit
def _merge_fma_kernel(
    # pointers
    q_ptr, nk_ptr, nv_ptr, bv_ptr, slots_ptr, m_ptr, l_ptr, acc_ptr, out_ptr,
    # sizes and scalars
    Hkv, S, n_exact, n_split, qk_scale, G, D, rv_max,
    # strides
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_nkb, stride_nkh, stride_nks, stride_nkd,
    stride_nvb, stride_nvh, stride_nvs, stride_nvd,
    stride_bvb, stride_bvh, stride_bvd, stride_bvr,
    stride_ob, stride_oh, stride_os, stride_od,
    # meta-parameters
    D_PAD: tl.constexpr, RV_PAD: tl.constexpr, BLOCK_D: tl.constexpr, NB: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    """The merge of :func:`_merge_splits_kernel` (calls without an attention mask; same workspaces, exact tokens
    and output) with one program per (sequence, KV head, query token x query head, BLOCK_D output channels): grid
    (B*Hkv, S*G, D_PAD / BLOCK_D), in fp32 multiply-adds on the CUDA cores of one warp (FMA_MERGE_WARPS). No
    tensor-core tiles padded to 16 heads, no hi / lo splits, no per-head loop; every reduction stays in the warp.
    The per-head merge (``_latent_attention_reduce_kernel``) executed about 2,200 instructions a warp at 9.4 cycles
    each, 2 warps a scheduler (H200 Nsight Compute, batch 8, 32k: 8 us of a 54 us call;
    benchmarks/results/2026-12-04-unit-major-h200, r14-ncu); here each program does one head's share.

    Order: the value basis slice and the query head, then the exact tokens (keys and values loaded with their slots,
    not after them: an unused entry's row is read and zeroed, never used), scored and accumulated online; these
    are inputs of the call, so with PDL (:data:`PDL_GPU_CHECKED`) all of it runs before ``griddepcontrol.wait``.
    Then the head's partials (m, l (SPLIT_BLOCK,), value latent (SPLIT_BLOCK, RV_PAD)) merged online over the splits
    (FlashDecoding's merge; Dao et al., 2023), projected by the value basis (RV_PAD x BLOCK_D multiply-adds),
    combined with the exact tokens' part, normalised and stored. Scores in log2 units (``qk_scale`` includes log2
    e), as in the partials. Rows with no token: 0 (SDPA's math path)."""
    bh = tl.program_id(0)
    sg = tl.program_id(1)
    pid_d = tl.program_id(2)
    b = bh // Hkv
    h = bh % Hkv
    s = sg // G
    g = sg % G
    head = h * G + g
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    dd = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    dd_ok = dd < D
    rv = tl.arange(0, RV_PAD)
    bv_head = bv_ptr + b.to(tl.int64) * stride_bvb + h * stride_bvh
    pv = tl.load(bv_head + (rv * stride_bvr)[:, None] + (dd * stride_bvd)[None, :],
                 mask=(rv < rv_max)[:, None] & dd_ok[None, :], other=0.0).to(tl.float32)
    qg = tl.load(q_ptr + b.to(tl.int64) * stride_qb + s * stride_qs + head * stride_qh + d * stride_qd, mask=d_ok,
                 other=0.0).to(tl.float32)
    nk_head = nk_ptr + b.to(tl.int64) * stride_nkb + h * stride_nkh
    nv_head = nv_ptr + b.to(tl.int64) * stride_nvb + h * stride_nvh
    # the exact tokens, online: max, sum, values
    m_e = tl.max(tl.full((NB,), float("-inf"), tl.float32), axis=0)
    l_e = tl.sum(tl.zeros((NB,), tl.float32), axis=0)
    o_e = tl.zeros((BLOCK_D,), tl.float32)
    for j0 in range(0, n_exact, NB):
        j = j0 + tl.arange(0, NB)
        j_ok = j < n_exact
        used = tl.load(slots_ptr + j, mask=j_ok, other=-1) >= 0
        k = tl.load(nk_head + (j * stride_nks)[:, None] + (d * stride_nkd)[None, :],
                    mask=j_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        v = tl.load(nv_head + (j * stride_nvs)[:, None] + (dd * stride_nvd)[None, :],
                    mask=j_ok[:, None] & dd_ok[None, :], other=0.0).to(tl.float32)
        v = tl.where(used[:, None], v, 0.0)  # unused entries: whatever their rows hold, never a NaN product
        sc = tl.where(used, tl.sum(tl.where(used[:, None], k, 0.0) * qg[None, :], axis=1) * qk_scale,
                      float("-inf"))  # (NB,)
        m_new = tl.maximum(m_e, tl.max(sc, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_e - m_use)  # 0 while m_e is -inf
        p = tl.exp2(sc - m_use)
        l_e = l_e * alpha + tl.sum(p, axis=0)
        o_e = o_e * alpha + tl.sum(p[:, None] * v, axis=0)
        m_e = m_new
    if PDL:
        tl.extra.cuda.gdc_wait()
    # the head's partials, online over the splits
    row0 = (bh * S + s) * n_split
    cb = tl.arange(0, SPLIT_BLOCK)
    m_p = tl.max(tl.full((SPLIT_BLOCK,), float("-inf"), tl.float32), axis=0)
    l_p = tl.sum(tl.zeros((SPLIT_BLOCK,), tl.float32), axis=0)
    a_p = tl.zeros((RV_PAD,), tl.float32)
    for c0 in range(0, n_split, SPLIT_BLOCK):
        c = c0 + cb
        c_ok = c < n_split
        p_row = (row0 + c) * G + g  # (SPLIT_BLOCK,) this head's partials
        m_c = tl.load(m_ptr + p_row, mask=c_ok, other=float("-inf"))
        l_c = tl.load(l_ptr + p_row, mask=c_ok, other=0.0)
        a_c = tl.load(acc_ptr + p_row.to(tl.int64)[:, None] * RV_PAD + rv[None, :], mask=c_ok[:, None], other=0.0)
        m_new = tl.maximum(m_p, tl.max(m_c, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_p - m_use)
        w = tl.exp2(m_c - m_use)  # 0 for masked-off and empty splits
        l_p = l_p * alpha + tl.sum(w * l_c, axis=0)
        a_p = a_p * alpha + tl.sum(w[:, None] * a_c, axis=0)
        m_p = m_new
    o_p = tl.sum(a_p[:, None] * pv, axis=0)  # (BLOCK_D,): the value latent projected
    m_all = tl.maximum(m_p, m_e)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w_p = tl.exp2(m_p - m_all)
    w_e = tl.exp2(m_e - m_all)
    l_all = l_p * w_p + l_e * w_e
    inv = tl.where(l_all > 0, 1.0 / tl.where(l_all > 0, l_all, 1.0), 0.0)
    o = (o_p * w_p + o_e * w_e) * inv
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + s * stride_os + head * stride_oh + dd * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=dd_ok)


# ------------------------------------------------------------------------------------------------ launcher


# ------------------------------------------------------------------ key pass over groups of KV heads (small ranks)


@triton.jit
def _group_columns(kmeta_ptr, h0, n_heads, base, PER: tl.constexpr, NCOLS: tl.constexpr, HB: tl.constexpr):
    """The (head, coordinate) of each column of a KV-head group's row window: column n is code ``n % PER`` of byte
    (element, for float latents) ``base + n // PER``. Returns (hl, j, ok) (NCOLS,) int32 / bool: the head's index
    in the group, its latent coordinate, and whether the column holds one (j < the head's rank; not padding)."""
    n = tl.arange(0, NCOLS)
    unit = base + n // PER
    hi = tl.arange(0, HB)
    h_ok = hi < n_heads
    col0 = tl.load(kmeta_ptr + 3 * (h0 + hi), mask=h_ok, other=0)
    rank = tl.load(kmeta_ptr + 3 * (h0 + hi) + 2, mask=h_ok, other=0)
    # the group's heads are in row order: a column's head is the last one starting at or before it
    starts = h_ok[None, :] & (col0[None, :] <= unit[:, None])
    hl = tl.sum(starts.to(tl.int32), axis=1) - 1
    own = hi[None, :] == hl[:, None]
    c0 = tl.sum(tl.where(own, col0[None, :], 0), axis=1)
    r = tl.sum(tl.where(own, rank[None, :], 0), axis=1)
    j = (unit - c0) * PER + n % PER
    return hl, j, (hl >= 0) & (j < r)


@triton.jit
def _latent_scores_heads_kernel(
    q_ptr, lk_ptr, bk_ptr, cos_ptr, sin_ptr, pos_ptr, slots_ptr, mask_ptr, kmeta_ptr, sc_ptr, pt_ptr,
    Hkv, S, n_groups, heads_per_group, n_exact, kv_len, tiles_per_split, qk_scale, D, half, k_scale_base,
    k_min_base, row_units, stride_scr, stride_ptb,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_lkb, stride_lks, stride_lkw,
    stride_bkb, stride_bkh, stride_bkd, stride_bkr,
    stride_cp, stride_cw, stride_sp, stride_sw,
    stride_pb, stride_ps,
    stride_mb, stride_mh, stride_ms, stride_mt,
    HB: tl.constexpr, NUNITS: tl.constexpr, UNIT_ALIGN: tl.constexpr, BITS: tl.constexpr, HALF: tl.constexpr,
    REST: tl.constexpr, HAS_ROT: tl.constexpr, HAS_REST: tl.constexpr, ROPE: tl.constexpr,
    PAIRED_TABLE: tl.constexpr, COS_EXACT: tl.constexpr, MASK: tl.constexpr, F32_DOT: tl.constexpr,
    WORDS: tl.constexpr, BLOCK_N: tl.constexpr, SLOT_BLOCK: tl.constexpr, PAGE: tl.constexpr = 0,
    ROT_FP16: tl.constexpr = False, LOOP_STAGES: tl.constexpr = None, META8: tl.constexpr = False,
):
    """The key pass (two-pass form, one query head per KV head) for a GROUP of KV heads: scores of every slot of
    one context split, for ``heads_per_group`` KV heads at once. Grid (n_split, B * n_groups, S).

    Why: at small key ranks one head's part of a latent row is a few bytes (rank 12, int4/32: 6 code bytes and
    a 2-byte scale and min), so a program per head reads mostly other heads' bytes of every sector, and multiplies
    the RoPE tables on the tensor cores with N = its padded rank (16). A program per group reads the group's
    contiguous window of each row once (``NUNITS`` bytes, or elements for float latents, from ``base``, the
    group's first byte rounded down to ``UNIT_ALIGN``), loads each RoPE table tile once for all its heads, and
    multiplies it with N = the window's coordinates.

    Math (as :func:`_tile_scores_rotated`, per column): with the query folded into the basis once per program,
    column n of head h(n) and coordinate j(n) gets the coefficient ``W_tn = cos_t . Ea_n + sin_t . Eb_n (+ the
    unpaired tables' + c3_n)``; a uniform ``int`` latent whose heads each fit in one quantization block (rank <=
    block) has ``z_tn = code_tn * scale_th + min_th``, so the score of head h at slot t is
    ``scale_th * sum_{n in h} code_tn W_tn + min_th * sum_{n in h} W_tn``: two (BLOCK_N, NCOLS) x (NCOLS, HB)
    products with the 0/1 head-membership matrix (hi/lo split of the fp32 operand; the codes are exact).
    Float latents: ``sum_{n in h} z_tn W_tn``. Columns that are padding (an odd rank's last nibble, bytes of a
    neighbouring group) have W = 0 and no membership.

    A non-finite float latent value of one of the group's heads makes the scores of every head of the group NaN
    at that slot (0 * inf in the membership product), where the reference makes its own head's NaN; columns of the
    window outside the group's heads are masked before the product, so other groups are not affected.

    Shapes and strides: as ``_latent_attention_split_kernel`` (G = 1); scores stored to ``sc`` rows
    ``(b * Hkv + h) * S + s`` (stride_scr), log2 units, masked, ``-inf`` at the exact tokens' slots.
    HB: a power of two >= 16 (the products' N) and >= heads_per_group. META8: ``-f8`` key latents (each block's
    scale and min from its e4m3 span and min bytes, :func:`_scale_min`)."""
    c = tl.program_id(0)
    bg = tl.program_id(1)
    s = tl.program_id(2)
    b = bg // n_groups
    h0 = (bg % n_groups) * heads_per_group
    n_heads = tl.minimum(heads_per_group, Hkv - h0)
    PER: tl.constexpr = 1 if BITS == 16 else 8 // BITS
    NCOLS: tl.constexpr = NUNITS * PER
    base = tl.load(kmeta_ptr + 3 * h0)
    base = (base // UNIT_ALIGN) * UNIT_ALIGN
    hl, j, col_ok = _group_columns(kmeta_ptr, h0, n_heads, base, PER, NCOLS, HB)
    head = h0 + tl.maximum(hl, 0)
    # the query folded into the basis (see _tile_scores_rotated), per column: (HALF, NCOLS) coefficient blocks
    i1, i2, c1, c2, rot_ok, rest, rest_ok = _rope_rows(half, 2 * half, D, HALF, REST, ROPE)
    q_col = q_ptr + b.to(tl.int64) * stride_qb + s * stride_qs + head * stride_qh  # (NCOLS,), G = 1
    b_col = bk_ptr + b.to(tl.int64) * stride_bkb + head * stride_bkh + j * stride_bkr
    ea_hi = tl.zeros((HALF, NCOLS), tl.bfloat16)
    ea_lo = ea_hi
    eb_hi = ea_hi
    eb_lo = ea_hi
    ec_hi = ea_hi
    ec_lo = ea_hi
    ed_hi = ea_hi
    ed_lo = ea_hi
    if HAS_ROT:
        r_ok = rot_ok[:, None] & col_ok[None, :]
        p1 = tl.load(b_col[None, :] + (i1 * stride_bkd)[:, None], mask=r_ok, other=0.0).to(tl.float32)
        p2 = tl.load(b_col[None, :] + (i2 * stride_bkd)[:, None], mask=r_ok, other=0.0).to(tl.float32)
        q1 = tl.load(q_col[None, :] + (i1 * stride_qd)[:, None], mask=r_ok, other=0.0).to(tl.float32)
        q2 = tl.load(q_col[None, :] + (i2 * stride_qd)[:, None], mask=r_ok, other=0.0).to(tl.float32)
        ea_hi, ea_lo, eb_hi, eb_lo, ec_hi, ec_lo, ed_hi, ed_lo = _rotated_coefficients(p1, p2, q1, q2, ROPE,
                                                                                       PAIRED_TABLE, ROT_FP16)
    c3 = tl.zeros((NCOLS,), tl.float32)
    if HAS_REST:
        x_ok = rest_ok[:, None] & col_ok[None, :]
        p3 = tl.load(b_col[None, :] + (rest * stride_bkd)[:, None], mask=x_ok, other=0.0).to(tl.float32)
        q3 = tl.load(q_col[None, :] + (rest * stride_qd)[:, None], mask=x_ok, other=0.0).to(tl.float32)
        c3 = tl.sum(p3 * q3, axis=0)
    hb = tl.arange(0, HB)
    sel = tl.where((hl[:, None] == hb[None, :]) & col_ok[:, None], 1.0, 0.0).to(tl.bfloat16)  # (NCOLS, HB) membership
    head_ok = hb < n_heads
    mask_row = mask_ptr + b.to(tl.int64) * stride_mb + s * stride_ms + (h0 + hb).to(tl.int64) * stride_mh
    sc_rows = sc_ptr + ((b * Hkv + h0 + hb) * S + s).to(tl.int64) * stride_scr  # (HB,)
    units = base + tl.arange(0, NUNITS)
    if BITS != 16:
        blk = tl.load(kmeta_ptr + 3 * (h0 + hb) + 1, mask=head_ok, other=0)  # each head's one block
        # a rank-0 head has no block (its index is the next head's, or past the row's last): never read
        has_blk = head_ok & (tl.load(kmeta_ptr + 3 * (h0 + hb) + 2, mask=head_ok, other=0) > 0)

    t_start, t_end, lo_exact = _split_tiles(c, tiles_per_split, kv_len, slots_ptr, n_exact, BLOCK_N, SLOT_BLOCK)
    for t in tl.range(t_start, t_end, num_stages=LOOP_STAGES):  # see _latent_attention_split_kernel
        offs, row_ok, slot_ok, row_idx, slot_row, ld_ok = _tile_rows(t, kv_len, lo_exact, slots_ptr, n_exact, pt_ptr,
                                                                     stride_ptb, b, BLOCK_N, SLOT_BLOCK, PAGE)
        rows = lk_ptr + row_idx * stride_lkb + slot_row * stride_lks
        # the coefficients of every column at each slot's position
        w = tl.zeros((BLOCK_N, NCOLS), tl.float32)
        if HAS_ROT:
            w = _table_coefficients(w, cos_ptr, sin_ptr, pos_ptr, b, offs, slot_ok, rot_ok, c1, c2, ea_hi, ea_lo,
                                    eb_hi, eb_lo, ec_hi, ec_lo, ed_hi, ed_lo, stride_cp, stride_cw, stride_sp,
                                    stride_sw, stride_pb, stride_ps, ROPE, PAIRED_TABLE, COS_EXACT, F32_DOT,
                                    ROT_FP16)
        if HAS_REST:
            w = w + c3[None, :]
        # the group's window of each row, read once (contiguous: vector loads)
        u_ok = ld_ok[:, None] & (units < row_units)[None, :]
        raw = tl.load(rows[:, None] + (units * stride_lkw)[None, :], mask=u_ok, other=0)
        acc = tl.zeros((BLOCK_N, HB), tl.float32)
        if BITS == 16:  # other heads' columns never enter (a non-finite value there would, through 0 * inf)
            z = tl.where(col_ok[None, :], raw.to(tl.float32), 0.0)
            acc = _dot_split(z * w, sel, acc, False, True, F32_DOT)
        else:
            raw = raw.to(tl.int32)
            if BITS == 8:
                code = raw
            else:
                code = _unpack_codes(raw, BLOCK_N, NCOLS, BITS)
            b_ok = ld_ok[:, None] & has_blk[None, :]
            sc, mn = _scale_min(rows[:, None], blk[None, :], k_scale_base, k_min_base, stride_lkw, b_ok, BITS, WORDS,
                                META8)
            cw = _dot_split(code.to(tl.float32) * w, sel, tl.zeros((BLOCK_N, HB), tl.float32), False, True, F32_DOT)
            ws = _dot_split(w, sel, tl.zeros((BLOCK_N, HB), tl.float32), False, True, F32_DOT)
            acc = sc * cw + mn * ws
        scores = tl.trans(acc) * qk_scale  # (HB, BLOCK_N), log2 units
        scores = _mask_tile(scores, mask_row, offs, slot_ok, head_ok, stride_mt, MASK)
        tl.store(sc_rows[:, None] + offs[None, :], scores, mask=head_ok[:, None] & row_ok[None, :])


#: Most columns (latent coordinates, padding included) of a head group's row window: above it the group's
#: coefficient blocks spill (ptxas for sm_90a: 256 columns, 8 heads of rank 32, spill 800 bytes and ran 2.3x slower
#: than one head per program on the H200), and the per-head key pass runs.
MAX_GROUP_COLUMNS = 128


def head_group_window(offsets: Sequence[int], fmt: str, heads: int, elem_bytes: int = 2) -> tuple[int, int] | None:
    """The row window of ``_latent_scores_heads_kernel`` for key latents of ``offsets`` in format ``fmt`` and groups
    of ``heads`` KV heads: ``(units, align)``, the window's width in bytes (elements for float latents; a power of
    two >= 16) and the alignment its start is rounded down to; None where the grouped key pass does not apply (a
    format other than float or uniform ``int``, a head wider than one quantization block, or a window of more than
    :data:`MAX_GROUP_COLUMNS` coordinates). ``offsets``: (Hkv + 1,) ints, the heads' latent column offsets;
    ``elem_bytes``: a float latent's element size. Cached per arguments (the launcher asks once per call).

    Raises:
        ValueError: an unknown format (as :func:`~ckvp_compile.kernels.latent_format.parse_latent_format`).
    """
    return _head_group_window(tuple(int(o) for o in offsets), fmt, int(heads), int(elem_bytes))


@functools.lru_cache(maxsize=256)
def _head_group_window(offsets: tuple, fmt: str, heads: int, elem_bytes: int) -> tuple[int, int] | None:
    f = parse_latent_format(fmt)
    ranks = _ranks(offsets)
    if heads < 1 or not ranks:
        return None
    if f.quantized:
        if f.mixed or f.pow2 or f.ternary or f.bits not in (8, 4, 2) or max(ranks) > f.block:
            return None
        cb = f.code_bytes(offsets)
        col0 = [sum(cb[:i]) for i in range(len(ranks))]
        width, per, align = cb, 8 // f.bits, 16
    else:
        col0, width, per, align = offsets[:-1], ranks, 1, max(1, 16 // elem_bytes)

    def window(a: int) -> int:  # the widest group's window when its start is rounded down to a multiple of a
        span = 0
        for h0 in range(0, len(ranks), heads):
            last = min(h0 + heads, len(ranks)) - 1
            span = max(span, col0[last] + width[last] - (col0[h0] // a) * a)
        return _np2(span)

    # the widest alignment (vector loads) that does not widen the window: rounding a group's start down to 16
    # bytes could double it (4 heads of 5 code bytes: 20 bytes, up to 35 with the rounding, 64 after next_pow2)
    units = window(1)
    while align > 1 and window(align) > units:
        align //= 2
    return None if units * per > MAX_GROUP_COLUMNS else (units, align)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def unsupported_reason(q: torch.Tensor, latent_k: torch.Tensor, latent_v: torch.Tensor, basis_k_block: torch.Tensor,
                       basis_v_block: torch.Tensor, rope_form: str, attn_mask: torch.Tensor | None,
                       cos_table: torch.Tensor, new_k: torch.Tensor, k_fmt: str = "float",
                       v_fmt: str = "float", page_table: torch.Tensor | None = None) -> str | None:
    """Why :func:`latent_attention_triton` cannot run these (already validated) inputs, or None if it can.

    The op's CUDA kernel calls the reference whenever this returns a reason, so nothing unsupported runs wrong.
    ``-f8`` formats (e4m3 block metadata) are read by the per-head, grouped and one-pass kernels of this module (the
    chunk, absorbed, lane, word and MMA passes refuse them in their layouts, and the launcher then runs these); on
    CUDA only once :data:`F8_META_GPU_CHECKED`.
    """
    if not (q.is_cuda or (_interpreting() and q.device.type == "cpu")):
        return f"device {q.device} (Triton needs CUDA, or TRITON_INTERPRET=1 on CPU)"
    if rope_form not in ROPE_FORMS:
        return f"rope_form {rope_form!r}"
    for name, fmt, lat in (("k_fmt", k_fmt, latent_k), ("v_fmt", v_fmt, latent_v)):
        f = parse_latent_format(fmt)
        if f.mixed:
            if q.is_cuda and not MIX_GPU_CHECKED:
                return f"{name} {fmt!r} (mix plans are not yet checked on a GPU: MIX_GPU_CHECKED)"
            if not _mix_supported(f):
                return f"{name} {fmt!r} (a mix plan with two pieces of one width in a head, or off a block boundary)"
        elif f.quantized and f.bits not in (8, 4, 2):
            return f"{name} {fmt!r} (uniform int8/int4/int2, mxint8/mxint4 and mix formats only)"
        if f.meta_f8 and q.is_cuda and not F8_META_GPU_CHECKED:
            return f"{name} {fmt!r} (-f8 block metadata is not yet checked on a GPU: F8_META_GPU_CHECKED)"
        if not f.quantized and lat.dtype not in _FLOATS:
            return f"{name} 'float' with latent dtype {lat.dtype}"
        if lat.stride(-1) != 1:
            if q.is_cuda and not STRIDED_LATENTS_GPU_CHECKED:
                return (f"{name[0]} latent with strided row units {tuple(lat.stride())} (e.g. unit-major; not yet "
                        "checked on a GPU: STRIDED_LATENTS_GPU_CHECKED)")
            if (lat.shape[-1] - 1) * lat.stride(-1) >= 2**31:  # unit offsets are int32 in the kernels
                return f"{name[0]} latent whose unit offsets pass 2**31 (strides {tuple(lat.stride())})"
    for name, t in (("q", q), ("new_k", new_k)):
        if t.dtype not in _FLOATS:
            return f"{name} dtype {t.dtype}"
    for name, t in (("basis_k_block", basis_k_block), ("basis_v_block", basis_v_block)):
        if t.dtype not in _BASIS_DTYPES:
            return f"{name} dtype {t.dtype}"
        if t.dtype not in _FLOATS and q.is_cuda and not FP8_BASES_GPU_CHECKED:
            return f"{name} dtype {t.dtype} (fp8 bases are not yet checked on a GPU: FP8_BASES_GPU_CHECKED)"
    if rope_form != "none" and cos_table.dtype not in _FLOATS:
        return f"cos/sin table dtype {cos_table.dtype}"
    if rope_form != "none" and sum((n - 1) * st for n, st in zip(cos_table.shape, cos_table.stride())) >= 2**31:
        return f"cos/sin tables whose element offsets pass 2**31 (shape {tuple(cos_table.shape)})"  # int32 in kernels
    if attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.dtype not in _FLOATS:
        return f"attn_mask dtype {attn_mask.dtype}"
    if page_table is not None and page_table.dtype not in (torch.int32, torch.int64):
        return f"page_table dtype {page_table.dtype}"
    b, h, s, d = q.shape
    hkv = basis_k_block.shape[-3]
    if b == 0 or s == 0:
        return "an empty batch or query"
    if d > MAX_HEAD_DIM or h // hkv > MAX_GROUP:
        return f"head_dim {d} > {MAX_HEAD_DIM} or {h // hkv} query heads per KV head > {MAX_GROUP}"
    rk, rv = basis_k_block.shape[-1], basis_v_block.shape[-1]
    if not (1 <= rk <= MAX_RANK and 1 <= rv <= MAX_RANK):
        return f"basis widths Rk_max = {rk}, Rv_max = {rv} outside [1, {MAX_RANK}]"
    return None


#: Largest two-pass scores workspace (bytes) ``latent_attention_triton`` allocates. A larger batch runs the two
#: passes on slices of its sequences, each within this (:func:`score_batch_slices`); where one sequence's scores
#: alone exceed it (long prefills: S query tokens x kv_len slots) it runs the one-pass kernel, which keeps no
#: per-slot state.
MAX_SCORES_BYTES = 1 << 28


def _scores_bytes(q: torch.Tensor, kv_len: int) -> int:
    """Bytes of the two-pass scores, (B, Hkv, S, H/Hkv, kv_len) fp32 = B * H * S * kv_len * 4."""
    b, h, s, _ = q.shape
    return b * h * s * int(kv_len) * 4


def score_batch_slices(b: int, h: int, s: int, kv_len: int) -> list[tuple[int, int]] | None:
    """How the two-pass form splits a batch so that each slice's scores fit :data:`MAX_SCORES_BYTES`.

    Args:
        b, h, s: batch, query heads, query tokens per sequence; kv_len: slots attended.
    Returns:
        ``[(b0, b1), ...]``: consecutive slices covering [0, b), sizes within one of each other (one slice when
        the whole batch's scores fit); None when one sequence's scores (h * s * kv_len fp32) alone exceed the cap
        (the launcher then runs the one-pass kernel).

    At Qwen1.5-MoE's largest batch at 32k (289 sequences, 16 heads: 606 MB of scores) the launcher used to fall
    back to the one-pass kernel, which has no grouped key pass; slices of 96-97 sequences keep the two-pass
    kernels (issue 9's largest-batch throughput).
    """
    per_seq = h * s * int(kv_len) * 4
    if per_seq > MAX_SCORES_BYTES:
        return None
    n = -(-b // (MAX_SCORES_BYTES // per_seq))  # fewest slices of at most cap // per_seq sequences
    return [(i * b // n, (i + 1) * b // n) for i in range(n)]  # sizes within one: at most ceil(b / n)


def _batch_slice(t: torch.Tensor | None, b: int, b0: int, b1: int, dims: int) -> torch.Tensor | None:
    """Sequences [b0, b1) of ``t`` when it has ``dims`` dimensions and a batch dimension of size ``b`` (a view);
    ``t`` itself when it is shared across the batch (None, fewer dimensions, or a broadcast batch of 1)."""
    if t is None or t.dim() != dims or t.shape[0] != b or b == 1:
        return t
    return t[b0:b1]


_META: dict[tuple, torch.Tensor] = {}
#: the last launch: its compiled kernels ("scores", "split", "reduce"; benchmarks read their register counts and
#: spills) and choices ("rot_basis", "paired_tables", "n_split", "merge_split_block")
_LAST_LAUNCH: dict[str, object] = {}


def _head_meta(offsets: Sequence[int], fmt: str, device: torch.device) -> tuple[torch.Tensor, int, int, list]:
    """((Hkv, 3) int32 per head: first column (float) or code byte, first block, rank; scale base; min base (the
    bytes where the blocks' scales, or ``-f8`` spans, and their mins start); the first columns as ints).

    Cached per (offsets, format, device): the tensor is built once, when the store is built for a store's layouts
    (:func:`~ckvp_compile.kernels.device_cache.prepare_device_tables`: outside any CUDA-graph memory pool).
    """
    f = parse_latent_format(fmt)
    offsets = [int(o) for o in offsets]
    ranks = [b - a for a, b in zip(offsets, offsets[1:])]
    if f.mixed:
        return _mix_meta(offsets, f, device)
    if f.quantized:
        cb = f.code_bytes(offsets)
        nb = [-(-r // f.block) for r in ranks]
        col0 = [sum(cb[:i]) for i in range(len(ranks))]
        blk0 = [sum(nb[:i]) for i in range(len(ranks))]
        scale_base = sum(cb)
        min_base = scale_base + f.meta_bytes // 2 * sum(nb)  # fp16 scales (2 bytes a block) or -f8 spans (1)
    else:
        col0, blk0, scale_base, min_base = offsets[:-1], [0] * len(ranks), 0, 0
    key = (tuple(offsets), f.name, str(device))
    if key not in _META:
        check_not_capturing("the latent attention head table", device)
        _META[key] = torch.tensor([[c, k, r] for c, k, r in zip(col0, blk0, ranks)], dtype=torch.int32,
                                  device=device).reshape(-1, 3)
    return _META[key], scale_base, min_base, list(col0)


def _mix_meta(offsets: list[int], f, device: torch.device) -> tuple[torch.Tensor, int, int, list]:
    """The head table of a ``mix`` bit plan: (Hkv, 12) int32, per head and for bits 8, 4, 2 its piece's
    (col0, blk0, lo, hi): coordinates [lo, hi) of the head, whose code bytes start at ``col0 + lo*bits/8`` and
    blocks at ``blk0 + lo/block`` (so ``_latent_tile`` indexes them from the head's coordinate 0); an empty range
    where the head has no piece of that width. Needs at most one piece per width and head, starting on a block
    boundary (:func:`unsupported_reason` checks). Returns as :func:`_head_meta`; the columns list holds every
    piece's col0 (for the alignment hint)."""
    hkv = len(offsets) - 1
    rows = [[0, 0, 0, 0] * 3 for _ in range(hkv)]
    byte, head = 0, 0
    for col, count, bits, blk in f.pieces(offsets):
        while col >= offsets[head + 1]:
            head += 1
        lo = col - offsets[head]
        slot = (8, 4, 2).index(bits)
        rows[head][4 * slot:4 * slot + 4] = [byte - lo * bits // 8, blk - lo // f.block, lo, lo + count]
        byte += -(-count * bits // 8)
    scale_base = byte
    min_base = byte + f.meta_bytes // 2 * f.num_blocks(offsets)  # fp16 scales, or -f8 spans (one byte a block)
    key = (tuple(offsets), f.name, str(device))
    if key not in _META:
        check_not_capturing("the latent attention head table", device)
        _META[key] = torch.tensor(rows, dtype=torch.int32, device=device).reshape(hkv, 12)
    return _META[key], scale_base, min_base, [r[4 * i] for r in rows for i in range(3)]


def _mix_supported(f) -> bool:
    """A ``mix`` plan the kernel reads: per head at most one piece of each width, each starting on a block
    boundary (the planner's plans: descending widths over whole blocks)."""
    for segs in f.segments:
        widths = [b for b, _ in segs]
        if len(set(widths)) != len(widths):
            return False
        start = 0
        for _, count in segs:
            if start % f.block:
                return False
            start += count
    return True


def _basis_strides(basis: torch.Tensor) -> tuple:
    """(batch, head, D, R) strides of a (Hkv, D, R) shared or (B, Hkv, D, R) per-sequence (online) basis block."""
    return tuple(basis.stride()) if basis.dim() == 4 else (0, *basis.stride())


def _align(cols: list) -> int:
    """The largest power of two <= 16 dividing every head's first column (element or byte index)."""
    a = 16
    while a > 1 and any(int(c) % a for c in cols):
        a //= 2
    return a


def _ranks(offsets: Sequence[int]) -> list:
    return [int(b) - int(a) for a, b in zip(offsets, offsets[1:])]


def _words(f, latent: torch.Tensor, scale_base: int, min_base: int) -> bool:
    """Quantized rows whose fp16 scales / mins sit at even byte addresses (even base, row and batch strides); never
    ``-f8`` rows (one e4m3 byte each)."""
    return (f.quantized and not f.pow2 and not f.meta_f8 and latent.stride(-1) == 1 and scale_base % 2 == 0
            and min_base % 2 == 0 and latent.stride(0) % 2 == 0 and latent.stride(1) % 2 == 0
            and latent.data_ptr() % 2 == 0)


def _word_rows(latent_k: torch.Tensor, latent_v: torch.Tensor, k_fmt: str, v_fmt: str, k_offsets, v_offsets) -> bool:
    """Rows that the word-loading passes (lane and word passes) can read: row and batch strides on 4-byte words
    and 4-byte aligned data (a dim of size 1 is never stepped along), scales and mins on fp16 words."""
    return all((x.shape[0] == 1 or x.stride(0) % 4 == 0) and (x.shape[1] == 1 or x.stride(1) % 4 == 0)
               and x.data_ptr() % 4 == 0 and _words(parse_latent_format(fm), x, *_head_meta(o, fm, x.device)[1:3])
               for x, o, fm in ((latent_k, k_offsets, k_fmt), (latent_v, v_offsets, v_fmt)))


def _mma_layout(q: torch.Tensor, latent_k: torch.Tensor, latent_v: torch.Tensor, basis_k_block: torch.Tensor,
                basis_v_block: torch.Tensor, k_offsets, v_offsets, k_fmt: str, v_fmt: str,
                attn_mask: torch.Tensor | None, page_table: torch.Tensor | None, cfg: "DecodeConfig") -> dict | None:
    """The MMA pass's layout (:func:`~ckvp_compile.kernels.latent_attention_mma.mma_layout`, plus ``module``) for a
    table-free call where it applies and its rows can be read (:func:`_word_rows`; key and value latents of equal
    length, a static cache at least one tile long, at most 65535 (sequence, query token) rows), else None. None
    too where Triton has no Gluon (the pass is written in it). Raises nothing."""
    try:
        from . import latent_attention_mma as lam
    except ImportError:  # a Triton without Gluon: the other passes
        return None
    paged = page_table is not None
    layouts = (layout_of(latent_k), layout_of(latent_v))
    lay = lam.mma_layout(q.shape[1] // basis_k_block.shape[-3], parse_latent_format(k_fmt), parse_latent_format(v_fmt),
                         k_offsets, v_offsets, basis_k_block.shape[-1], basis_v_block.shape[-1], layouts,
                         cfg.block_n_m, latent_k.shape[1] if paged else 0, q.device, attn_mask is not None,
                         columns=latent_k.shape[1])
    if lay is None or latent_k.shape[1] != latent_v.shape[1] or latent_k.shape[1] < lay["BT"]:
        return None
    if q.shape[0] * q.shape[2] > 65535:  # the grid's third dim (sequences x query tokens): a long prefill elsewhere
        return None
    if lay["UNIT"]:
        # byte columns of S_max (P) slots, 16-byte aligned: the kernel reads 16-byte runs of a column
        if not all(x.stride(0) % 16 == 0 and x.stride(-1) == x.shape[1] and x.data_ptr() % 16 == 0
                   for x in (latent_k, latent_v)):
            return None
    elif not _word_rows(latent_k, latent_v, k_fmt, v_fmt, k_offsets, v_offsets):
        return None
    return dict(lay, module=lam)


def _key_codes_ok(cfg: "DecodeConfig", f, basis: torch.Tensor, rk_pad: int) -> bool:
    """Whether ``cfg.key_codes`` applies: a uniform 8/4/2-bit ``int`` key format with blocks of 16..rk_pad (a power
    of two, the tensor cores' K) and bases exact in bf16 (bf16 or fp8)."""
    return (cfg.key_codes and f.quantized and not (f.mixed or f.ternary or f.pow2) and f.bits in (8, 4, 2)
            and f.block & (f.block - 1) == 0 and 16 <= f.block <= rk_pad and basis.dtype in BASIS_BF16_EXACT)


def _blockwise(f, ncols: int) -> bool:
    """A quantized format whose blocks tile every chunk of ``ncols`` coordinates (power-of-two block <= ncols)."""
    return f.quantized and f.block & (f.block - 1) == 0 and f.block <= ncols


def rope_tables_paired(cos_table: torch.Tensor, sin_table: torch.Tensor, rope_form: str, rotary_dim: int) -> bool:
    """Whether both cos/sin tables hold one angle per rotated pair (HF's ``cat((freqs, freqs))`` for rotate_half,
    ``repeat_interleave`` for interleaved): then ``DecodeConfig(paired_tables=True)`` is exact for them.

    Args:
        cos_table, sin_table: (P_max, W) float, as the kernels take them. rope_form: one of ``ROPE_FORMS``.
        rotary_dim: channels rotated.
    Returns:
        True when every row pairs its columns (False for 'none' / 'complex', which have nothing to pair).
    Notes:
        One device comparison per table: a host synchronisation. Call it once, outside any compiled step or CUDA
        graph, on tables whose rows are written. The launcher itself never checks (it used to, lazily, per table
        object: under ``torch.compile`` the tables of later layer groups were fresh per-call copies made by
        Inductor until ``passes/store_write_order.py``, so the check ran, and synchronised, at every decode step,
        and it answered differently during
        CUDA-graph capture than in the warm-up, a new Triton specialization compiled while capturing, which the
        driver refuses: benchmarks/results/2026-11-29-reliability-h200).
    """
    rope = _ROPE_CODE[rope_form]
    half = (0 if rope == 0 else int(rotary_dim)) // 2
    if rope not in (1, 2) or half == 0:
        return False
    i1 = torch.arange(half) if rope == 1 else 2 * torch.arange(half)
    i2 = i1 + half if rope == 1 else i1 + 1
    return all(bool(torch.equal(t.index_select(-1, i1.to(t.device)), t.index_select(-1, i2.to(t.device))))
               for t in (cos_table, sin_table))


#: Tables declared paired by their owner (:func:`declare_paired_tables`): (cos ptr, sin ptr) -> weak references.
_PAIRED_TABLES: dict[tuple[int, int], tuple[weakref.ref, weakref.ref]] = {}


def declare_paired_tables(cos_table: torch.Tensor, sin_table: torch.Tensor, paired: bool = True) -> None:
    """Declare (or, ``paired=False``, withdraw) that these cos / sin tables hold one angle per rotated pair.

    The latent KV store declares its own tables when every graph that writes them builds its tables paired (proven
    from the graph: :func:`ckvp_compile.analysis.rope.tables_paired`). A launch without an explicit config whose
    tables are these tensors (same storage, alive) then reads half of each table (``paired_tables``) and, at one
    query head per KV head, moves RoPE onto the basis up to rank 128 (``default_config``). Nothing compares
    values, so no device synchronisation; tables never declared (or copies of them) run the unpaired kernel.

    Args:
        cos_table, sin_table: (P_max, W) tables, as the kernels take them. paired: declare (True) or withdraw.
    """
    key = (cos_table.data_ptr(), sin_table.data_ptr())
    if paired:
        _PAIRED_TABLES[key] = (weakref.ref(cos_table), weakref.ref(sin_table))
        weakref.finalize(cos_table, _PAIRED_TABLES.pop, key, None)  # no stale entry once the table is gone
    else:
        _PAIRED_TABLES.pop(key, None)


def paired_tables_declared(cos_table: torch.Tensor, sin_table: torch.Tensor) -> bool:
    """Whether :func:`declare_paired_tables` declared these tables (the same storage, still alive) paired."""
    refs = _PAIRED_TABLES.get((cos_table.data_ptr(), sin_table.data_ptr()))
    if refs is None:
        return False
    cos0, sin0 = refs[0](), refs[1]()
    return (cos0 is not None and sin0 is not None and cos0.data_ptr() == cos_table.data_ptr()
            and sin0.data_ptr() == sin_table.data_ptr() and cos0.shape == cos_table.shape
            and sin0.shape == sin_table.shape and cos0.stride() == cos_table.stride()
            and sin0.stride() == sin_table.stride())


def _reg_cap(maxnreg: int | None) -> dict:
    """The launch option capping registers per thread (none under the interpreter, which has no such option)."""
    return {} if maxnreg is None or _interpreting() else {"maxnreg": int(maxnreg)}


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; off CUDA (the interpreter) a count no row count reaches."""
    if device.type != "cuda":
        return 1 << 30
    return torch.cuda.get_device_properties(device).multi_processor_count


def _np2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(max(int(x), 1)))


#: fp32 values of split partials one merge program holds per tile step (:func:`merge_split_block`): 64 registers a
#: thread for the merge kernel's 4 warps. The fused merge runs inside the value pass, already near the 255-register
#: cap: its tiles are 4x smaller (ptxas for sm_90a, int4/32 rank 256: its spills 8/8 bytes at 16:16 and 32:8 heads,
#: against 24/88 and 48/112 at 8192 values, and 16/56, 32/96 with the per-split loop before the tiles).
MERGE_TILE_VALUES = 8192
FUSED_MERGE_TILE_VALUES = 2048
#: Most splits per tile of partials in the merge.
MAX_MERGE_SPLIT_BLOCK = 64
#: Splits per tile of partials in the one-pass merge (:func:`_merge_splits_kernel`): fixed, so that a context that
#: grows (and with it the split count) compiles no new merge kernel.
MERGE_SPLITS_BLOCK = 32


def merge_split_block(group: int, rv_pad: int, fused: bool = False) -> int:
    """Splits per tile of partials in the merge: :func:`_merge_row`'s SPLIT_BLOCK, for the merge kernel and (``fused``)
    the merge fused into the value pass.

    Args:
        group: query heads per KV head (G). rv_pad: the partials' padded value rank (RV_PAD). fused: the fused
            merge's budget, :data:`FUSED_MERGE_TILE_VALUES`, instead of :data:`MERGE_TILE_VALUES`.
    Returns:
        The largest power of two <= :data:`MAX_MERGE_SPLIT_BLOCK` whose next_pow2(G) heads' (SPLIT_BLOCK, rv_pad)
        fp32 tiles (loaded together) hold at most the budget's values; at least 1 (wide ranks with many heads: one
        split per step, as the per-split loop it replaced). It depends on the shapes only, not on the split count,
        which moves with kv_len: a SPLIT_BLOCK following it would compile a new kernel as the context grows. Rows
        with more splits loop over the tiles.
    """
    budget = FUSED_MERGE_TILE_VALUES if fused else MERGE_TILE_VALUES
    fit = max(1, budget // (_np2(group, 1) * int(rv_pad)))
    return min(MAX_MERGE_SPLIT_BLOCK, 1 << (fit.bit_length() - 1))


def context_splits(config: DecodeConfig, kv_len: int, block_n: int, rows: int, target: int) -> tuple[int, int]:
    """How a pass divides the context among programs: ``(programs along the context, tiles per program)``.

    Args:
        config: its ``split`` (fixed count) or ``min_tiles``. kv_len: slots attended. block_n: slots per tile.
        rows: B * Hkv * S, the programs per context position. target: the programs wanted in all (whole waves:
            ``target_programs``, or ``target_programs_v`` for the value pass).
    Returns:
        (n, per) with ``n * per >= ceil(kv_len / block_n)`` and no empty program.
    """
    n_tiles = triton.cdiv(kv_len, block_n)
    if config.split is not None:
        n = max(1, min(config.split, n_tiles))
    else:
        want = target // max(rows, 1)  # whole waves: 256 programs, not 384, for B*Hkv = 128
        n = max(1, min(want, n_tiles // max(config.min_tiles, 1)))
    per = triton.cdiv(n_tiles, n)
    return triton.cdiv(n_tiles, per), per


def balanced_splits(rows: int, n_tiles: int, target: int, min_tiles: int = 1, max_split: int = 8) -> int:
    """Programs along the context for a grid of ``rows`` programs per context position that already fills
    ``target`` (one wave): the count in 1..``max_split`` (and at most ``n_tiles // min_tiles``) whose last wave is
    fullest (``ceil(w) / w`` smallest, w = rows * n / target waves; the smaller count on ties). E.g. 280 rows on 264
    slots: 1 split runs 1.06 waves in the time of 2; 8 splits run 8.5 waves in the time of 9.

    Args:
        rows: B * chunks * S; n_tiles: slot tiles of the context; target: programs per wave; min_tiles: fewest
            tiles per program; max_split: the most splits considered.
    Returns:
        int >= 1. Raises nothing.
    """
    best, best_loss = 1, float("inf")
    for n in range(1, max(1, min(max_split, n_tiles // max(min_tiles, 1))) + 1):
        waves = rows * n / max(target, 1)
        loss = math.ceil(waves) / waves
        if loss < best_loss - 1e-9:
            best, best_loss = n, loss
    return best


def latent_scores_triton(
    q: torch.Tensor, latent_k: torch.Tensor, basis_k_block: torch.Tensor, k_offsets: Sequence[int],
    cos_table: torch.Tensor, sin_table: torch.Tensor, slot_pos: torch.Tensor, rope_form: str, rotary_dim: int,
    slots: torch.Tensor, attn_mask: torch.Tensor | None, scale: float, kv_len: int, k_fmt: str = "float",
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """The key pass alone: ``ckvp::latent_scores`` (the math of ``kernels.reference.latent_scores_ref``).

    Returns:
        (B, Hkv, S, G, kv_len) fp32, contiguous: scores in log2 units (``scale * log2(e) * q.k``, plus an
        additive mask times log2(e)); ``-inf`` where a bool mask is False and at the exact tokens' ``slots``.
    Raises:
        NotImplementedError: ``NYI: ...`` for inputs :func:`unsupported_reason` refuses.
    """
    return _launch("scores", q, latent_k, latent_k, basis_k_block, basis_k_block, k_offsets, k_offsets, cos_table,
                   sin_table, slot_pos, rope_form, rotary_dim, q, q, slots, attn_mask, scale, kv_len, k_fmt, k_fmt,
                   config)


def latent_attention_from_scores_triton(
    scores: torch.Tensor, q: torch.Tensor, latent_v: torch.Tensor, basis_v_block: torch.Tensor,
    v_offsets: Sequence[int], new_k: torch.Tensor, new_v: torch.Tensor, slots: torch.Tensor,
    attn_mask: torch.Tensor | None, scale: float, kv_len: int, v_fmt: str = "float",
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """The value pass and the merge: ``ckvp::latent_attention_from_scores`` (math of
    ``kernels.reference.latent_attention_from_scores_ref``) on the scores of :func:`latent_scores_triton`.

    Returns:
        (B, H, S, D) q.dtype, contiguous.
    Raises:
        NotImplementedError: ``NYI: ...`` for inputs :func:`unsupported_reason` refuses.
    """
    return _launch("from_scores", q, latent_v, latent_v, basis_v_block, basis_v_block, v_offsets, v_offsets, q, q,
                   q, "none", 0, new_k, new_v, slots, attn_mask, scale, kv_len, v_fmt, v_fmt, config,
                   scores=scores)


def latent_attention_triton(
    q: torch.Tensor, latent_k: torch.Tensor, latent_v: torch.Tensor, basis_k_block: torch.Tensor,
    basis_v_block: torch.Tensor, k_offsets: Sequence[int], v_offsets: Sequence[int], cos_table: torch.Tensor,
    sin_table: torch.Tensor, slot_pos: torch.Tensor, rope_form: str, rotary_dim: int, new_k: torch.Tensor,
    new_v: torch.Tensor, slots: torch.Tensor, attn_mask: torch.Tensor | None, scale: float, kv_len: int,
    k_fmt: str = "float", v_fmt: str = "float", config: DecodeConfig | None = None,
    page_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attend over latent cache slots [0, kv_len) with the fused kernels: the math of ``latent_attention_ref``.

    Args: exactly those of ``torch.ops.ckvp.latent_attention`` (shapes, dtypes and layout there), already
        validated; ``config`` picks tile sizes, warps, stages and the context split; ``page_table`` (B, S_max / P)
        int: paged latents, page pools (N_pages + 1, P, W) whose pages the split kernel looks up per tile.
    Returns:
        (B, H, S, D) q.dtype, contiguous; fp32 softmax and accumulation; rows the mask removes entirely are 0.
    Raises:
        NotImplementedError: ``NYI: ...`` for inputs :func:`unsupported_reason` refuses (the op falls back to the
            reference before calling this).
    Notes:
        Workspace: (B*Hkv*S*n_split*G) * (2 + next_pow2(Rv_max)) fp32, and with ``two_pass`` the scores
        (B*Hkv*S*G*kv_len fp32). Bytes read per call: the latent rows of [0, kv_len) once per query token,
        slot_pos, the cos/sin rows of their positions, q, new_k/new_v and the basis blocks (from L2 after the
        first program).
    Reference: kernels/reference.py::latent_attention_ref
    """
    return _launch("all", q, latent_k, latent_v, basis_k_block, basis_v_block, k_offsets, v_offsets, cos_table,
                   sin_table, slot_pos, rope_form, rotary_dim, new_k, new_v, slots, attn_mask, scale, kv_len, k_fmt,
                   v_fmt, config, page_table=page_table)


#: Arrival counters of the unit-major pass's own merge, per CUDA device: (n,) int32, zero between calls (each row's
#: last program resets its counter), allocated outside CUDA-graph capture and grown as needed. A grown-out buffer is
#: kept too (_RETIRED_COUNTERS): a graph captured with it still writes it on every replay.
_COUNTERS: dict = {}
_RETIRED_COUNTERS: list = []


def _arrival_counters(n: int, device: torch.device) -> torch.Tensor:
    """(n,) int32 zeros for ``latent_attention_mma._mma_unit_kernel``'s MERGE: a kept buffer of the device (the
    kernel leaves it zeroed), or, while a CUDA graph is being captured on a device without a large enough one, a
    fresh ``torch.zeros`` (its memset is captured; a buffer allocated now would come from the graph's private pool).
    Calls that run at the same time on two streams of one device must not both use the pass's merge (they would
    share counters): ``CKVP_MMA_MERGE=0``. Raises nothing beyond allocation errors."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if torch.cuda.is_current_stream_capturing():
            return torch.zeros(n, dtype=torch.int32, device=device)
        if key in _COUNTERS:
            _RETIRED_COUNTERS.append(_COUNTERS[key])
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf[:n]


def _fold_query(q: torch.Tensor, basis_k_block: torch.Tensor, kmeta: torch.Tensor, rkp: int, qk_scale: float,
                f32_dot: bool, pdl: bool = False) -> torch.Tensor:
    """The query folded into the key basis for the table-free one-pass kernels (absorbed and lane passes):
    ``latent_attention_absorbed._fold_query_kernel``'s (B, S, Hkv, G, rkp) fp32 ``qk_scale * P_h^T q`` (log2
    units, 0 past each head's rank) for q (B, H, S, D) and basis_k_block (Hkv, D, R) or (B, Hkv, D, R). ``pdl``: the
    next launch is its programmatic dependent (:func:`pdl_launches`), and with :func:`pdl_fold` this launch is one of
    the kernel before it. Records the launch as ``_LAST_LAUNCH["fold"]``.
    Raises nothing beyond the kernel launch's own errors."""
    from . import latent_attention_absorbed as laa  # (that module imports this one's jit helpers)

    b, h, s, d = q.shape
    hkv = basis_k_block.shape[-3]
    g = h // hkv
    qf = torch.empty(b, s, hkv, g, rkp, dtype=torch.float32, device=q.device)
    _LAST_LAUNCH["fold"] = laa._fold_query_kernel[(b * s, hkv)](
        qf, q, basis_k_block, kmeta, hkv, s, g, d, qk_scale, *q.stride(), *_basis_strides(basis_k_block),
        QP=max(16, _np2(g)), D_PAD=_np2(d), RKP=rkp, RKF=max(16, rkp), Q_EXACT=q.dtype == torch.bfloat16,
        BK_EXACT=basis_k_block.dtype in BASIS_BF16_EXACT, F32_DOT=f32_dot, PDL=pdl, num_warps=4,
        **({"PDL_WAIT": True, "launch_pdl": True} if pdl and pdl_fold() else {}))
    return qf


def _launch(
    mode: str, q: torch.Tensor, latent_k: torch.Tensor, latent_v: torch.Tensor, basis_k_block: torch.Tensor,
    basis_v_block: torch.Tensor, k_offsets: Sequence[int], v_offsets: Sequence[int], cos_table: torch.Tensor,
    sin_table: torch.Tensor, slot_pos: torch.Tensor, rope_form: str, rotary_dim: int, new_k: torch.Tensor,
    new_v: torch.Tensor, slots: torch.Tensor, attn_mask: torch.Tensor | None, scale: float, kv_len: int,
    k_fmt: str = "float", v_fmt: str = "float", config: DecodeConfig | None = None,
    scores: torch.Tensor | None = None, page_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernels of one call. mode 'all': key pass (two-pass config) or one pass, then the merge; 'scores': the
    key pass only, returning the scores; 'from_scores': the value pass over ``scores`` and the merge (the K
    arguments are then stand-ins, never read)."""
    reason = unsupported_reason(q, latent_k, latent_v, basis_k_block, basis_v_block, rope_form, attn_mask,
                                cos_table, new_k, k_fmt, v_fmt, page_table)
    if page_table is not None and mode != "all":
        reason = f"paged latents in mode {mode!r}"
    if reason is not None:
        raise NotImplementedError(f"NYI: latent_attention_triton does not support {reason}; call "
                                  f"kernels.reference.latent_attention_ref instead")
    if config is None:
        # the complex form's tables hold one angle per pair by layout; the others only when declared so; without
        # RoPE (post-RoPE key bases included) no table is read, so nothing limits the table-free paths
        paired = rope_form in ("complex", "none") or (rope_form in ("rotate_half", "interleaved")
                                                      and paired_tables_declared(cos_table, sin_table))
        kf, vf = parse_latent_format(k_fmt), parse_latent_format(v_fmt)
        config = default_config(q.shape[1] // basis_k_block.shape[-3], _np2(basis_k_block.shape[-1]), paired,
                                rank=basis_k_block.shape[-1], rank_v=basis_v_block.shape[-1],
                                quantized_keys=kf.quantized and not kf.pow2, table_free=rope_form == "none",
                                code_bits=max(kf.bits, vf.bits) if kf.quantized and vf.quantized else None)
    cfg = config
    chunks = absorbed = lanes = words = mma = None
    table_free_one_pass = mode == "all" and rope_form == "none" and not cfg.fuse_merge
    if table_free_one_pass and cfg.mma and not _interpreting():
        mma = _mma_layout(q, latent_k, latent_v, basis_k_block, basis_v_block, k_offsets, v_offsets, k_fmt, v_fmt,
                          attn_mask, page_table, cfg)
    if mma is None and table_free_one_pass and cfg.words:
        from .latent_attention_words import words_layout  # (that module imports this one's jit helpers)

        words = words_layout(q.shape[1] // basis_k_block.shape[-3], parse_latent_format(k_fmt),
                             parse_latent_format(v_fmt), k_offsets, v_offsets, basis_k_block.shape[-1],
                             basis_v_block.shape[-1], latent_k.stride(-1), latent_v.stride(-1))
        if words is not None and not _word_rows(latent_k, latent_v, k_fmt, v_fmt, k_offsets, v_offsets):
            words = None
    if mma is None and words is None and table_free_one_pass and cfg.lanes > 0:
        from .latent_attention_lanes import lanes_layout  # (that module imports this one's jit helpers)

        lanes = lanes_layout(cfg.lanes, q.shape[1] // basis_k_block.shape[-3], parse_latent_format(k_fmt),
                             parse_latent_format(v_fmt), k_offsets, v_offsets, basis_k_block.shape[-1],
                             basis_v_block.shape[-1], basis_k_block.shape[-3], latent_k.stride(-1),
                             latent_v.stride(-1))
        if lanes is not None and not _word_rows(latent_k, latent_v, k_fmt, v_fmt, k_offsets, v_offsets):
            lanes = None
    if mma is None and words is None and lanes is None and table_free_one_pass and cfg.absorbed > 0:
        from .latent_attention_absorbed import absorbed_layout  # (that module imports this one's jit helpers)

        absorbed = absorbed_layout(cfg.absorbed, q.shape[1] // basis_k_block.shape[-3], parse_latent_format(k_fmt),
                                   parse_latent_format(v_fmt), k_offsets, v_offsets, basis_k_block.shape[-1],
                                   basis_v_block.shape[-1], basis_k_block.shape[-3], latent_k.stride(-1),
                                   latent_v.stride(-1))
    if (mma is None and words is None and lanes is None and absorbed is None and mode == "all" and cfg.head_chunks > 0
            and not cfg.fuse_merge):
        from .latent_attention_chunks import chunk_layout  # (that module imports this one's jit helpers)

        chunks = chunk_layout(cfg.head_chunks, q.shape[1] // basis_k_block.shape[-3], parse_latent_format(k_fmt),
                              parse_latent_format(v_fmt), k_offsets, v_offsets, basis_k_block.shape[-1],
                              basis_v_block.shape[-1], basis_k_block.shape[-3], latent_k.stride(-1),
                              latent_v.stride(-1))
        # only where the chunks' programs fill the target (batch 1, 4k: 32 programs against 256 per head), and
        # while the folded query (two (KT, NCK) bf16 blocks per sequence, chunk and query token: 64 KiB per token
        # at the Qwen shape) fits the scores' cap: a long prefill takes the other passes
        rows_c = 0 if chunks is None else q.shape[0] * chunks["n_chunks"] * q.shape[2]
        fold_bytes = 0 if chunks is None else rows_c * 2 * 4 * _np2(q.shape[-1] // 2) * chunks["NH"] * chunks["RKP"] * 2
        if chunks is not None and (fold_bytes > MAX_SCORES_BYTES or rows_c * max(
                1, triton.cdiv(kv_len, _np2(cfg.block_n_c)) // max(cfg.min_tiles, 1)) < cfg.target_programs):
            chunks = None
    if mode != "all" and not cfg.two_pass:
        cfg = dataclasses.replace(cfg, two_pass=True)
    elif (mode == "all" and chunks is None and absorbed is None and lanes is None and words is None and mma is None
          and cfg.two_pass
          and _scores_bytes(q, kv_len) > MAX_SCORES_BYTES):
        slices = score_batch_slices(q.shape[0], q.shape[1], q.shape[2], kv_len)
        if slices is None:
            cfg = dataclasses.replace(cfg, two_pass=False)  # a long prefill: the scores would not fit; one pass
        else:  # a large batch: the two passes on slices of its sequences (each slice's scores within the cap)
            bt = q.shape[0]
            paged = page_table is not None
            outs = [_launch(mode, q[b0:b1], latent_k if paged else latent_k[b0:b1],
                            latent_v if paged else latent_v[b0:b1], _batch_slice(basis_k_block, bt, b0, b1, 4),
                            _batch_slice(basis_v_block, bt, b0, b1, 4), k_offsets, v_offsets, cos_table, sin_table,
                            _batch_slice(slot_pos, bt, b0, b1, 2) if rope_form != "none" else slot_pos, rope_form,
                            rotary_dim, new_k[b0:b1], new_v[b0:b1], slots, _batch_slice(attn_mask, bt, b0, b1, 4),
                            scale, kv_len, k_fmt, v_fmt, cfg, page_table=None if not paged else page_table[b0:b1])
                    for b0, b1 in slices]
            _LAST_LAUNCH["batch_slices"] = len(slices)
            return torch.cat(outs, dim=0)
    b, h, s, d = q.shape
    n_exact = slots.shape[0]
    hkv = basis_k_block.shape[-3]
    g = h // hkv
    kf, vf = parse_latent_format(k_fmt), parse_latent_format(v_fmt)
    kmeta, k_sb, k_mb, kmeta_cols = _head_meta(k_offsets, k_fmt, q.device)
    vmeta, v_sb, v_mb, vmeta_cols = _head_meta(v_offsets, v_fmt, q.device)
    rk_max, rv_max = basis_k_block.shape[-1], basis_v_block.shape[-1]
    rope = _ROPE_CODE[rope_form]
    rd = 0 if rope == 0 else int(rotary_dim)
    half = rd // 2
    g_pad = _np2(g)
    rk_pad, rv_pad = _np2(rk_max), _np2(rv_max)
    key_codes = _key_codes_ok(cfg, kf, basis_k_block, rk_pad)
    if key_codes:  # one quantization block per chunk, the basis chunk loaded per tile (no hoisting)
        block_r, cfg = kf.block, dataclasses.replace(cfg, hoist_basis=False)
    else:
        block_r = rk_pad if cfg.hoist_basis else min(cfg.block_r, rk_pad)
    f32_dot = _interpreting() or cfg.f32_dots

    def splits(block_n: int, target: int) -> tuple[int, int]:  # (programs along the context, tiles per program)
        return context_splits(cfg, kv_len, block_n, b * hkv * s, target)

    fma_values = cfg.fma_values and g <= cfg.fma_max_heads
    block_n_v = cfg.block_n_v or cfg.block_n
    block_n_one = cfg.block_n  # one pass: its tiles carry the values too
    target_v = (cfg.target_programs_v or cfg.target_programs) if cfg.two_pass else cfg.target_programs
    if mma is not None:  # the MMA pass, one KV head per one-warp program (its slot groups merged in the kernel)
        n_split_m, tiles_per_split = mma["module"].mma_splits(kv_len, mma["BT"], b * hkv * s, cfg.programs_m,
                                                              cfg.split, cfg.min_tiles_m)
        n_split = n_split_m  # (the kernel merges its slot groups before it stores a split)
    elif words is not None:  # the word pass, one KV head per program: its own split of the context
        n_split, tiles_per_split = context_splits(cfg, kv_len, words["NG"] * _np2(max(16, cfg.block_n_w)),
                                                  b * hkv * s, cfg.target_programs)
    elif lanes is not None:  # the lane pass over chunks of KV heads: its own split of the context
        rows_l = b * lanes["n_chunks"] * s
        n_tiles_l = triton.cdiv(kv_len, _np2(cfg.block_n_l))
        if cfg.split is None and rows_l > cfg.target_programs:  # a large batch: whole waves, not 1.06 of them
            n_split = balanced_splits(rows_l, n_tiles_l, cfg.target_programs, cfg.min_tiles)
            tiles_per_split = triton.cdiv(n_tiles_l, n_split)
            n_split = triton.cdiv(n_tiles_l, tiles_per_split)
        else:
            n_split, tiles_per_split = context_splits(cfg, kv_len, _np2(cfg.block_n_l), rows_l, cfg.target_programs)
    elif absorbed is not None:  # the absorbed pass over chunks of KV heads: its own split of the context
        n_split, tiles_per_split = context_splits(cfg, kv_len, _np2(cfg.block_n_a), b * absorbed["n_chunks"] * s,
                                                  cfg.target_programs)
    elif chunks is not None:  # one pass over chunks of KV heads: its own split of the context
        n_split, tiles_per_split = context_splits(cfg, kv_len, _np2(cfg.block_n_c), b * chunks["n_chunks"] * s,
                                                  cfg.target_programs)
    else:
        n_split, tiles_per_split = splits(block_n_v if cfg.two_pass else block_n_one, target_v)
    if attn_mask is None:
        mask_kind, mask, mstrides = 0, q, (0, 0, 0, 0)
    else:
        mask = attn_mask.expand(b, h, s, kv_len)
        mask_kind = 1 if mask.dtype == torch.bool else 2
        if mask_kind == 1:
            mask = mask.view(torch.uint8)
        mstrides = mask.stride()
    if rope == 0:
        cos_table = sin_table = slot_pos = q  # never read
        cstr = sstr = pstr = (0, 0)
    else:
        cstr, sstr, pstr = cos_table.stride(), sin_table.stride(), slot_pos.stride()
    rows = b * hkv * s
    m_ws = torch.empty(rows * n_split * g, dtype=torch.float32, device=q.device)
    l_ws = torch.empty_like(m_ws)
    acc_ws = torch.empty(rows * n_split * g * rv_pad, dtype=torch.float32, device=q.device)
    # the interpreter casts stores by truncation; there, store fp32 and round to q.dtype in torch (as the reference)
    out = torch.empty(b, h, s, d, dtype=torch.float32 if _interpreting() else q.dtype, device=q.device)
    qk_scale = float(scale) * math.log2(math.e)
    bf16 = torch.bfloat16
    if mode == "from_scores":
        sc_ws = scores.contiguous()
        t_pad = kv_len
    elif cfg.two_pass and chunks is None and absorbed is None and lanes is None and words is None and mma is None:
        # the scores: (B, Hkv, S, G, kv_len) fp32, rows of kv_len
        t_pad = kv_len
        sc_ws = torch.empty(b, hkv, s, g, kv_len, dtype=torch.float32, device=q.device)
    else:
        t_pad, sc_ws = 0, m_ws  # never read
    common = dict(
        G_PAD=g_pad, HALF=_np2(half), REST=_np2(d - rd), HAS_ROT=rope != 0, HAS_REST=d > rd, ROPE=rope,
        RK_PAD=rk_pad, RV_PAD=rv_pad, BLOCK_R=block_r,
        SLOT_BLOCK=16, K_BITS=kf.bits, K_QBLOCK=max(kf.block, 1),
        V_BITS=vf.bits, V_QBLOCK=max(vf.block, 1), MASK=mask_kind, Q_EXACT=q.dtype == bf16,
        ZK_EXACT=(not kf.quantized and latent_k.dtype == bf16) or kf.pow2 or not cfg.key_split,
        BK_EXACT=basis_k_block.dtype in BASIS_BF16_EXACT,
        ZV_EXACT=(not vf.quantized and latent_v.dtype == bf16) or vf.pow2, F32_DOT=f32_dot,
        K_BLOCKWISE=_blockwise(kf, block_r), V_BLOCKWISE=_blockwise(vf, rv_pad), HOIST=cfg.hoist_basis,
        K_ALIGN=_align(kmeta_cols) if cfg.align_hint else 1, V_ALIGN=_align(vmeta_cols) if cfg.align_hint else 1,
        K_RALIGN=_align(_ranks(k_offsets)) if cfg.align_hint and not kf.mixed else 1,
        V_RALIGN=_align(_ranks(v_offsets)) if cfg.align_hint and not vf.mixed else 1,
        K_WORDS=cfg.align_hint and _words(kf, latent_k, k_sb, k_mb),
        V_WORDS=cfg.align_hint and _words(vf, latent_v, v_sb, v_mb), HALF_ALIGN=_align([half]) if cfg.align_hint else 1,
        # a launch-time constant only (never decided from the tables' values here: see rope_tables_paired)
        K_MX=kf.pow2, V_MX=vf.pow2, PAIRED_TABLE=rope in (1, 2) and half > 0 and cfg.paired_tables,
        FMA_SCORES=cfg.fma_scores and g <= cfg.fma_max_heads, G_LOOP=_np2(g, 1), P_BF16=cfg.p_bf16,
        FMA_VALUES=fma_values,
        KEY_FP16=cfg.key_fp16 and not key_codes and not ((not kf.quantized and latent_k.dtype == bf16) or kf.pow2),
        KEY_CODES=key_codes,
        KEY_FP8=key_codes and kf.bits <= 4 and basis_k_block.dtype == torch.float8_e4m3fn and not f32_dot,
        K_META8=kf.meta_f8, V_META8=vf.meta_f8,
        PAGE=0 if page_table is None else latent_k.shape[1], num_stages=cfg.num_stages,
        # (a runtime chunk start must be a quantization block's first coordinate: the sub-block tile forms
        # decide their scale loads from it at compile time)
        R_LOOP=(cfg.r_loop and not cfg.hoist_basis and rk_pad > block_r
                and (not kf.quantized or block_r % max(kf.block, 1) == 0)),
        FMA_VALUES_2D=cfg.fma_values_2d,
    )
    if page_table is not None:
        page_table = page_table.contiguous()  # the kernel steps along a row by 1
    pt, pt_stride = (slots, 0) if page_table is None else (page_table, page_table.stride(0))  # slots: never read
    # a pass that scores and accumulates on the CUDA cores has no tl.dot over the query heads: its tiles need only
    # next_pow2(G) rows, not the 16 a dot needs (G = 1: 16x fewer registers for the scores and the value latent)
    fma_k, fma_v = common["FMA_SCORES"], common["FMA_VALUES"]
    # the rotated basis (DecodeConfig.rotate_basis): one query head per KV head, the basis hoisted, dequantized
    # (not code-domain) latents, ranks within MAX_ROTATED_RANK
    rot_basis = (cfg.rotate_basis and g == 1 and cfg.hoist_basis and not key_codes and not kf.mixed
                 and rk_pad <= MAX_ROTATED_RANK and fma_k and (cfg.two_pass or fma_v))
    if rot_basis:
        common.update(COS_EXACT=rope != 0 and cos_table.dtype == bf16 and sin_table.dtype == bf16,
                      ROT_FP16=cfg.rotate_fp16)
    g_small = _np2(g, 1)
    d_pad, block_d = _np2(d), min(32, _np2(d))
    nb = 16 if n_exact <= 16 else 32
    bv_exact = basis_v_block.dtype in BASIS_BF16_EXACT
    # the fused merge (cfg.fuse_merge): arrival counters zeroed by this call's key pass, or here without one
    fuse = cfg.fuse_merge and mode != "scores"
    if fuse:
        zeroed_by_key_pass = cfg.two_pass and mode != "from_scores"
        cnt = (torch.empty if zeroed_by_key_pass else torch.zeros)(rows, dtype=torch.int32, device=q.device)
    else:
        cnt = m_ws  # never read
    merge_args = (cnt, new_k, new_v, basis_v_block, out)
    merge_strides = (*new_k.stride(), *new_v.stride(), *_basis_strides(basis_v_block), *out.stride())
    split_block = merge_split_block(g, rv_pad, fuse)
    if fuse:  # the merge's meta-parameters only where it runs (no extra specialisations of the default kernel)
        common.update(FUSE_MERGE=True, D_PAD=d_pad, BLOCK_D=block_d, BV_EXACT=bv_exact, NB=nb, MERGE_G_PAD=g_pad,
                      MERGE_SPLIT_BLOCK=split_block)
    _LAST_LAUNCH.clear()
    _LAST_LAUNCH["batch_slices"] = 1
    _LAST_LAUNCH["rot_basis"] = rot_basis
    _LAST_LAUNCH["paired_tables"] = common["PAIRED_TABLE"]
    _LAST_LAUNCH["key_fp16"] = common["KEY_FP16"]
    _LAST_LAUNCH["n_split"] = n_split
    _LAST_LAUNCH["merge_split_block"] = split_block
    _LAST_LAUNCH["head_chunks"] = 0 if chunks is None else chunks["NH"]
    _LAST_LAUNCH["absorbed"] = 0 if absorbed is None else absorbed["NH"]
    _LAST_LAUNCH["lanes"] = 0 if lanes is None else lanes["NH"]
    _LAST_LAUNCH["words"] = words is not None
    _LAST_LAUNCH["mma"] = mma is not None
    # fold -> MMA pass -> merge as programmatic dependent launches (each waits for its predecessor's grid before
    # reading what it wrote; nothing runs between them)
    # the unit-major pass's own query fold and split merge (latent_attention_mma.fold_in_pass / merge_in_pass)
    fold_in = mma is not None and mma["UNIT"] and mma["module"].fold_in_pass()
    merge_in = mma is not None and mma["UNIT"] and mma["module"].merge_in_pass()
    _LAST_LAUNCH["mma_fold"] = fold_in
    _LAST_LAUNCH["mma_merge"] = merge_in
    pdl = (mma is not None and mma["UNIT"] and not fuse and not (fold_in or merge_in)
           and pdl_launches(q.device, tiles_per_split))
    _LAST_LAUNCH["pdl"] = pdl
    if mma is not None:
        lam = mma["module"]
        qf = q if fold_in else _fold_query(q, basis_k_block, kmeta, lam.MMA_RANK, qk_scale, f32_dot, pdl)
        in_pass = {}
        if fold_in or merge_in:  # (read only where on: the kernel's defaults stand in otherwise)
            in_pass = dict(
                q_ptr=q, bk_ptr=basis_k_block, nk_ptr=new_k, nv_ptr=new_v, bv_ptr=basis_v_block, out_ptr=out,
                cnt_ptr=_arrival_counters(rows, q.device) if merge_in else slots, D=d, qk_scale=qk_scale,
                **dict(zip(("stride_qb", "stride_qh", "stride_qs", "stride_qd"), q.stride())),
                **dict(zip(("stride_bkb", "stride_bkh", "stride_bkd", "stride_bkr"), _basis_strides(basis_k_block))),
                **dict(zip(("stride_nkb", "stride_nkh", "stride_nks", "stride_nkd"), new_k.stride())),
                **dict(zip(("stride_nvb", "stride_nvh", "stride_nvs", "stride_nvd"), new_v.stride())),
                **dict(zip(("stride_bvb", "stride_bvh", "stride_bvd", "stride_bvr"), _basis_strides(basis_v_block))),
                **dict(zip(("stride_ob", "stride_oh", "stride_os", "stride_od"), out.stride())),
                FOLD=fold_in, MERGE=merge_in, D_PAD=max(32, _np2(d)), Q_EXACT=q.dtype == bf16,
                BK_EXACT=basis_k_block.dtype in BASIS_BF16_EXACT, BV_EXACT=basis_v_block.dtype in BASIS_BF16_EXACT)
        common_args = (qf, latent_k, latent_v, slots, kmeta, vmeta, m_ws, l_ws, acc_ws, pt, pt_stride,
                       hkv, s, n_exact, kv_len, latent_k.shape[1], tiles_per_split, n_split_m,
                       k_sb // 2, k_mb // 2, v_sb // 2, v_mb // 2, latent_k.stride(0) // 4, latent_v.stride(0) // 4)
        if mma["UNIT"]:
            imma = mma["BITS"] == 8 and not fold_in and lam.int8_keys()
            vimma = imma and g in (4, 8) and not merge_in and lam.int8_values()
            _LAST_LAUNCH["mma_imma"] = imma
            _LAST_LAUNCH["mma_vimma"] = vimma
            _LAST_LAUNCH["mma_kernel"] = lam._mma_unit_kernel[(hkv, n_split_m, b * s)](
                *common_args, G=g, RV_PAD=rv_pad, PAGE=common["PAGE"], PLO=True, COL_K=latent_k.stride(-1),
                COL_V=latent_v.stride(-1), BITS=mma["BITS"], STAGES=cfg.stages_m, LANES=lam.lane_loads(),
                PSCAN=lam.page_scan(),
                VPAIR=mma["BITS"] == 8 and lam.value_pairs(), PDL=pdl, num_warps=1,
                IMMA=imma, FPAIR=lam.field_pairs(), VIMMA=vimma,
                **({"launch_pdl": True} if pdl else {}),
                **_reg_cap(cfg.maxnreg_m), **in_pass, HINT=lam.load_hint(),
                **_prefetches(lam, latent_k, latent_v))
            if merge_in:  # the pass's last program of each row merged it into out
                _LAST_LAUNCH["fma_merge"] = _LAST_LAUNCH["one_pass_merge"] = False
                return out.to(q.dtype)
        else:
            _LAST_LAUNCH["mma_kernel"] = lam._mma_attention_kernel[(hkv, n_split_m, b * s)](
                *common_args, G=g, NT=mma["NT"], RV_PAD=rv_pad, PAGE=common["PAGE"], PLO=True,
                ROW_K=latent_k.stride(1) // 4, ROW_V=latent_v.stride(1) // 4, num_warps=1, **_reg_cap(cfg.maxnreg_m))
    elif words is not None:
        from . import latent_attention_words as law

        rkp = words["RKP"]
        qf = _fold_query(q, basis_k_block, kmeta, rkp, qk_scale, f32_dot)
        _LAST_LAUNCH["words_kernel"] = law._words_attention_kernel[(n_split, b * hkv, s)](
            qf, latent_k, latent_v, slots, mask, kmeta, vmeta, m_ws, l_ws, acc_ws, pt, pt_stride,
            hkv, s, n_exact, kv_len, tiles_per_split, n_split,
            k_sb // 2, k_mb // 2, v_sb // 2, v_mb // 2,
            latent_k.stride(0) // 4, latent_k.stride(1) // 4, latent_v.stride(0) // 4, latent_v.stride(1) // 4,
            *mstrides,
            G=g, GP=words["GP"], NG=words["NG"], RKP=rkp, RVP=words["RVP"], RV_PAD=rv_pad,
            K_BITS=kf.bits, K_QBLOCK=kf.block, V_BITS=vf.bits, V_QBLOCK=vf.block,
            MASK=mask_kind, MASK_HEADS=mask_kind != 0 and mstrides[1] != 0, BLOCK_N=_np2(max(16, cfg.block_n_w)),
            SLOT_BLOCK=16, PAGE=common["PAGE"], LOOP_STAGES=cfg.loop_stages_w,
            num_warps=cfg.num_warps_w or cfg.num_warps, num_stages=cfg.num_stages, **_reg_cap(cfg.maxnreg))
    elif lanes is not None:
        from . import latent_attention_lanes as lal

        rkp = lanes["RKP"]
        qf = _fold_query(q, basis_k_block, kmeta, rkp, qk_scale, f32_dot)
        _LAST_LAUNCH["lanes_kernel"] = lal._lanes_attention_kernel[(n_split, b * lanes["n_chunks"], s)](
            qf, latent_k, latent_v, slots, mask, kmeta, vmeta, m_ws, l_ws, acc_ws, pt, pt_stride,
            hkv, s, lanes["n_chunks"], n_exact, kv_len, tiles_per_split, n_split,
            k_sb // 2, k_mb // 2, v_sb // 2, v_mb // 2,
            latent_k.stride(0) // 4, latent_k.stride(1) // 4, latent_v.stride(0) // 4, latent_v.stride(1) // 4,
            *mstrides,
            G=g, GP=lanes["GP"], NH=lanes["NH"], RKP=rkp, RVP=lanes["RVP"], RV_PAD=rv_pad,
            K_BITS=kf.bits, K_QBLOCK=kf.block, V_BITS=vf.bits, V_QBLOCK=vf.block,
            MASK=mask_kind,
            MASK_HEADS=mask_kind != 0 and mstrides[1] != 0, BLOCK_N=_np2(cfg.block_n_l), SLOT_BLOCK=16,
            PAGE=common["PAGE"], LOOP_STAGES=cfg.loop_stages_l, num_warps=cfg.num_warps_l or cfg.num_warps,
            num_stages=cfg.num_stages, **_reg_cap(cfg.maxnreg))
    elif absorbed is not None:
        from . import latent_attention_absorbed as laa

        rkp = absorbed["RKP"]
        qf = _fold_query(q, basis_k_block, kmeta, rkp, qk_scale, f32_dot)
        kw, vw = _words(kf, latent_k, k_sb, k_mb), _words(vf, latent_v, v_sb, v_mb)  # (scale bases in words)
        _LAST_LAUNCH["absorbed_kernel"] = laa._absorbed_attention_kernel[(n_split, b * absorbed["n_chunks"], s)](
            qf, latent_k, latent_v, slots, mask, kmeta, vmeta, m_ws, l_ws, acc_ws, pt, pt_stride,
            hkv, s, absorbed["n_chunks"], n_exact, kv_len, tiles_per_split, n_split,
            *(x // 2 if kw else x for x in (k_sb, k_mb)), *(x // 2 if vw else x for x in (v_sb, v_mb)),
            *latent_k.stride(), *latent_v.stride(), *mstrides,
            G=g, GP=absorbed["GP"], NH=absorbed["NH"], RKP=rkp, RVP=absorbed["RVP"], RV_PAD=rv_pad,
            K_BITS=kf.bits, K_QBLOCK=kf.block, V_BITS=vf.bits, V_QBLOCK=vf.block,
            K_CONTIG=absorbed["K_CONTIG"], V_CONTIG=absorbed["V_CONTIG"], K_FULL=absorbed["K_FULL"],
            V_FULL=absorbed["V_FULL"], K_ALIGN=absorbed["K_ALIGN"], V_ALIGN=absorbed["V_ALIGN"], K_WORDS=kw,
            V_WORDS=vw, MASK=mask_kind,
            MASK_HEADS=mask_kind != 0 and mstrides[1] != 0, F32_DOT=f32_dot, BLOCK_N=_np2(cfg.block_n_a),
            SLOT_BLOCK=16, PAGE=common["PAGE"], LOOP_STAGES=cfg.loop_stages_a,
            num_warps=cfg.num_warps_a or cfg.num_warps, num_stages=cfg.num_stages, **_reg_cap(cfg.maxnreg))
    elif chunks is not None:
        from . import latent_attention_chunks as lac

        nck = chunks["NH"] * chunks["RKP"]
        kt = (2 if common["PAIRED_TABLE"] or rope == 3 else 4) * common["HALF"]
        e_rows = b * chunks["n_chunks"] * s
        e_split = not cfg.rotate_fp16
        e_dtype = torch.bfloat16 if e_split else torch.float16
        e_hi = torch.empty(e_rows * kt * nck if rope != 0 else 1, dtype=e_dtype, device=q.device)
        e_lo = torch.empty_like(e_hi) if e_split and rope != 0 else e_hi
        c3 = torch.empty(e_rows * nck if d > rd else 1, dtype=torch.float32, device=q.device)
        fold_rows = 16
        t_exact = rope != 0 and cos_table.dtype == bf16 and sin_table.dtype == bf16
        kw, vw = _words(kf, latent_k, k_sb, k_mb), _words(vf, latent_v, v_sb, v_mb)  # (scale bases in words)
        _LAST_LAUNCH["fold"] = lac._fold_query_kernel[(e_rows, triton.cdiv(kt, fold_rows))](
            e_hi, e_lo, c3, q, basis_k_block, kmeta, hkv, s, chunks["n_chunks"], d, half,
            *q.stride(), *_basis_strides(basis_k_block),
            NH=chunks["NH"], RKP=chunks["RKP"], HALF=common["HALF"], REST=common["REST"], HAS_ROT=rope != 0,
            HAS_REST=d > rd, ROPE=rope, PAIRED_TABLE=common["PAIRED_TABLE"], E_SPLIT=e_split, FB=fold_rows,
            num_warps=4)
        _LAST_LAUNCH["chunks"] = lac._latent_attention_chunks_kernel[(n_split, b * chunks["n_chunks"], s)](
            e_hi, e_lo, c3, q, latent_k, latent_v, basis_k_block, cos_table, sin_table, slot_pos, slots, mask, kmeta,
            vmeta,
            m_ws, l_ws, acc_ws, pt, pt_stride,
            hkv, s, chunks["n_chunks"], n_exact, kv_len, tiles_per_split, n_split, qk_scale, d, half,
            *(x // 2 if kw else x for x in (k_sb, k_mb)), *(x // 2 if vw else x for x in (v_sb, v_mb)),
            *q.stride(), *latent_k.stride(), *latent_v.stride(), *_basis_strides(basis_k_block), *cstr, *sstr,
            *pstr, *mstrides,
            NH=chunks["NH"], RKP=chunks["RKP"], RVP=chunks["RVP"], RV_PAD=rv_pad, K_BITS=kf.bits, K_QBLOCK=kf.block,
            V_BITS=vf.bits,
            V_QBLOCK=vf.block, K_CONTIG=chunks["K_CONTIG"], V_CONTIG=chunks["V_CONTIG"],
            K_WORDS=kw, V_WORDS=vw, K_BLK_ALIGN=chunks["K_BLK_ALIGN"], V_BLK_ALIGN=chunks["V_BLK_ALIGN"],
            MASK_HEADS=mask_kind != 0 and mstrides[1] != 0,
            K_ALIGN=chunks["K_ALIGN"], V_ALIGN=chunks["V_ALIGN"], HALF=common["HALF"], REST=common["REST"],
            HAS_ROT=rope != 0, HAS_REST=d > rd, ROPE=rope, PAIRED_TABLE=common["PAIRED_TABLE"],
            T_EXACT=t_exact, E_SPLIT=e_split,
            MASK=mask_kind, F32_DOT=f32_dot, BLOCK_N=_np2(cfg.block_n_c), SLOT_BLOCK=16, PAGE=common["PAGE"],
            LOOP_STAGES=cfg.loop_stages_c, VALUES_2D=cfg.fma_values_2d, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **_reg_cap(cfg.maxnreg))
    elif cfg.two_pass and mode != "from_scores":
        window = None
        per_group = min(int(cfg.head_group), hkv)
        n_groups = triton.cdiv(hkv, max(per_group, 1))
        # only where the groups' programs can still fill the target (batch 1, 4k: 4 groups would run 64 programs,
        # against 256 per head)
        fills = b * n_groups * s * max(1, triton.cdiv(kv_len, cfg.block_n) // max(cfg.min_tiles, 1)) \
            >= cfg.target_programs
        if per_group > 0 and fills and g == 1 and not fuse and (kf.quantized or latent_k.dtype in _FLOATS):
            window = head_group_window(k_offsets, k_fmt, per_group, latent_k.element_size())
        _LAST_LAUNCH["head_group"] = 0 if window is None else per_group
        if window is not None:  # a program per group of KV heads (small ranks: whole row windows)
            if cfg.key_tiles:
                k_per = max(1, int(cfg.key_tiles))
                k_split = triton.cdiv(triton.cdiv(kv_len, cfg.block_n), k_per)
            else:
                k_split, k_per = context_splits(cfg, kv_len, cfg.block_n, b * n_groups * s, cfg.target_programs)
            _LAST_LAUNCH["scores"] = _latent_scores_heads_kernel[(k_split, b * n_groups, s)](
                q, latent_k, basis_k_block, cos_table, sin_table, slot_pos, slots, mask, kmeta, sc_ws, pt,
                hkv, s, n_groups, per_group, n_exact, kv_len, k_per, qk_scale, d, half, k_sb, k_mb,
                latent_k.shape[-1], t_pad, pt_stride,
                *q.stride(), *latent_k.stride(), *_basis_strides(basis_k_block), *cstr, *sstr, *pstr, *mstrides,
                HB=_np2(per_group), NUNITS=window[0], UNIT_ALIGN=window[1], BITS=kf.bits, HALF=common["HALF"],
                REST=common["REST"], HAS_ROT=rope != 0, HAS_REST=d > rd, ROPE=rope,
                PAIRED_TABLE=common["PAIRED_TABLE"],
                COS_EXACT=rope != 0 and cos_table.dtype == bf16 and sin_table.dtype == bf16, MASK=mask_kind,
                F32_DOT=f32_dot, WORDS=common["K_WORDS"], BLOCK_N=cfg.block_n, SLOT_BLOCK=16,
                PAGE=common["PAGE"], ROT_FP16=cfg.rotate_fp16, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                LOOP_STAGES=cfg.loop_stages, META8=kf.meta_f8, **_reg_cap(cfg.maxnreg))
        else:
            if cfg.key_tiles:
                k_per = max(1, int(cfg.key_tiles))
                k_split = triton.cdiv(triton.cdiv(kv_len, cfg.block_n), k_per)
            else:
                k_split, k_per = splits(cfg.block_n, cfg.target_programs)
            _LAST_LAUNCH["scores"] = _latent_attention_split_kernel[(k_split, b * hkv, s)](
                q, latent_k, latent_v, basis_k_block, cos_table, sin_table, slot_pos, slots, mask, kmeta, vmeta,
                m_ws, l_ws, acc_ws, sc_ws, t_pad, pt, pt_stride, *merge_args,
                hkv, s, n_exact, kv_len, k_per, k_split, qk_scale, g, d, half, rk_max, k_sb, k_mb, v_sb, v_mb,
                rv_max, *q.stride(), *latent_k.stride(), *latent_v.stride(), *_basis_strides(basis_k_block), *cstr,
                *sstr, *pstr, *mstrides, *merge_strides, BLOCK_N=cfg.block_n, PHASE=1, num_warps=cfg.num_warps,
                LOOP_STAGES=cfg.loop_stages,
                **dict(common, G_PAD=g_small if fma_k else g_pad, ROT_BASIS=rot_basis and fma_k),
                **_reg_cap(cfg.maxnreg))
        if mode == "scores":
            return sc_ws
    if chunks is None and absorbed is None and lanes is None and words is None and mma is None:
        _LAST_LAUNCH["split"] = _latent_attention_split_kernel[(n_split, b * hkv, s)](
            q, latent_k, latent_v, basis_k_block, cos_table, sin_table, slot_pos, slots, mask, kmeta, vmeta,
            m_ws, l_ws, acc_ws, sc_ws, t_pad, pt, pt_stride, *merge_args,
            hkv, s, n_exact, kv_len, tiles_per_split, n_split, qk_scale, g, d, half, rk_max, k_sb, k_mb, v_sb, v_mb,
            rv_max,
            *q.stride(), *latent_k.stride(), *latent_v.stride(), *_basis_strides(basis_k_block), *cstr, *sstr, *pstr,
            *mstrides, *merge_strides, BLOCK_N=block_n_v if cfg.two_pass else block_n_one,
            PHASE=2 if cfg.two_pass else 0,
            num_warps=(cfg.num_warps_v or cfg.num_warps) if cfg.two_pass else cfg.num_warps,
            LOOP_STAGES=cfg.loop_stages_v if cfg.two_pass else cfg.loop_stages,
            **dict(common, G_PAD=g_small if fma_v and (fma_k or cfg.two_pass) else g_pad,
                   ROT_BASIS=rot_basis and not cfg.two_pass and fma_v and fma_k))
    one_pass_merge = split_d = fma_merge = False
    if not fuse:
        split_d = cfg.reduce_split_d
        if split_d is None:
            split_d = rows < _sm_count(q.device)
        one_pass_merge = cfg.one_pass_merge
        if one_pass_merge is None:  # the MMA pass's many splits, where the output is not split over D
            one_pass_merge = mma is not None and not split_d
        one_pass_merge = one_pass_merge and attn_mask is None
        fma_merge = cfg.fma_merge
        if fma_merge is None:
            fma_merge = mma is not None and fma_merge_on()
        fma_merge = fma_merge and attn_mask is None
        one_pass_merge = one_pass_merge and not fma_merge
        _LAST_LAUNCH["reduce_split_d"] = split_d
        _LAST_LAUNCH["one_pass_merge"] = one_pass_merge
        _LAST_LAUNCH["fma_merge"] = fma_merge
    if not fuse and fma_merge:
        _LAST_LAUNCH["reduce"] = _merge_fma_kernel[(b * hkv, s * g, d_pad // block_d if split_d else 1)](
            q, new_k, new_v, basis_v_block, slots, m_ws, l_ws, acc_ws, out,
            hkv, s, n_exact, n_split, qk_scale, g, d, rv_max,
            *q.stride(), *new_k.stride(), *new_v.stride(), *_basis_strides(basis_v_block), *out.stride(),
            D_PAD=d_pad, RV_PAD=rv_pad, BLOCK_D=block_d if split_d else d_pad, NB=nb,
            SPLIT_BLOCK=FMA_MERGE_SPLITS, PDL=pdl, num_warps=FMA_MERGE_WARPS,
            **({"launch_pdl": True} if pdl else {}),
        )
    elif not fuse and one_pass_merge:
        _LAST_LAUNCH["reduce"] = _merge_splits_kernel[(b * hkv, s, d_pad // block_d if split_d else 1)](
            q, new_k, new_v, basis_v_block, slots, m_ws, l_ws, acc_ws, out,
            hkv, s, n_exact, n_split, qk_scale, g, d, rv_max,
            *q.stride(), *new_k.stride(), *new_v.stride(), *_basis_strides(basis_v_block), *out.stride(),
            G_PAD=g_pad, G_SMALL=g_small, D_PAD=d_pad, RV_PAD=rv_pad, BLOCK_D=block_d if split_d else d_pad,
            BV_EXACT=bv_exact,
            F32_DOT=f32_dot, NB=nb, SPLIT_BLOCK=MERGE_SPLITS_BLOCK, SPLIT_D=split_d, PDL=pdl, num_warps=4,
            **({"launch_pdl": True} if pdl else {}),
        )
    elif not fuse:
        _LAST_LAUNCH["reduce"] = _latent_attention_reduce_kernel[
            (b * hkv, s, d_pad // block_d if split_d else 1)](
            q, new_k, new_v, basis_v_block, slots, mask, m_ws, l_ws, acc_ws, out,
            hkv, s, n_exact, n_split, qk_scale, g, d, rv_max,
            *q.stride(), *new_k.stride(), *new_v.stride(), *_basis_strides(basis_v_block), *mstrides, *out.stride(),
            G_PAD=g_pad, D_PAD=d_pad, RV_PAD=rv_pad, BLOCK_D=block_d, SPLIT_D=split_d,
            MASK=mask_kind, BV_EXACT=bv_exact, F32_DOT=f32_dot, num_warps=4, NB=nb, G_LOOP=_np2(g, 1),
            SPLIT_BLOCK=split_block, PDL=pdl, **({"launch_pdl": True} if pdl else {}),
        )
    return out.to(q.dtype)
