"""Triton grouped expert GEMMs over tile-padded, expert-sorted (token, slot) rows.

Algorithm (notation of :mod:`ckvp_compile.kernels.moe_reference`: T tokens, A top-k, E experts, Dm model dim,
I FFN dim, P = T*A pairs, P_pad padded rows, BLOCK_M the M tile):

* routing: ``_moe_align_kernel`` (one program, one launch; :func:`moe_align`) sorts the pairs by expert (stable:
  a pair's rank is a cumulative sum over a one-hot (E, P) tile) and pads each expert's segment to BLOCK_M, so
  every M tile belongs to one expert (``block_expert[tile]``, -1 for the unused tail tiles, which exit at once).
  Sizes are worst-case static: no host sync. Routings too large for one program's registers use
  :func:`~ckvp_compile.kernels.moe_reference.moe_align_ref` (static-shape torch ops, several launches);
* ``_grouped_gate_up_kernel``: grid (tiles, cdiv(I, BLOCK_N)). Each program gathers its BLOCK_M tokens' rows of
  ``hidden`` (row = pair // A) and multiplies them by the BLOCK_N rows of ``W_gate[e]`` and ``W_up[e]`` in one
  K loop (both accumulators in fp32), then stores ``silu(gate) * up``: the activation never goes to memory
  unfused;
* ``_grouped_down_kernel``: grid (tiles, cdiv(Dm, BLOCK_N), SPLIT_K). Multiplies the activation rows by
  ``W_down[e]``, scales each row by its pair's routing weight and writes (or, split-K, atomically adds) it to the
  pair's row of an fp32 (P, Dm) buffer; ``_combine_kernel`` then sums each token's A rows in slot order and
  casts (deterministic unless SPLIT_K > 1, whose atomic adds may change the last bits between runs).

Software pipelining: the K loops are plain ``for`` loops over K tiles; Triton's ``num_stages`` pipelines them
(the next weight tile is loading while the current one is in the tensor cores), TMA-free so it runs on any GPU
and in the interpreter. Small M (decode): BLOCK_M = 16 rows per tile (the smallest ``tl.dot`` M) and at most
``min(E, P)`` non-empty tiles, narrow N tiles and split-K candidates for the down projection so that a batch-1
layer still spreads over all SMs (at Mixtral shape on the H200 the tuner chose 32-wide N tiles, no split-K).

The kernels are written once here. Inductor sees them through the ``triton_op`` ``ckvp::moe_experts_triton``
(traced: the kernels appear in its output code, launched with the config lists' first entries); an autotuned
TritonTemplate lowering that would reuse these bodies is not built.
Source: the tiling of the Triton tutorials ``03-matrix-multiplication.py`` / ``08-grouped-gemm.py`` and the
routing layout of vLLM ``fused_moe`` (tokens sorted by expert, padded to the M tile), written from scratch.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .moe_reference import moe_align_ref

__all__ = ["GemmConfig", "block_m_for", "combine", "down_configs", "gate_up_configs", "grouped_down",
           "grouped_gate_up", "moe_align", "moe_experts_triton", "prune_configs"]


# ------------------------------------------------------------------------------------------------ configs


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of a grouped GEMM kernel.

    ``block_m``: rows per program, a power of two >= 16 that divides the routing's M tile (``ROUTE_M``, the tile
    each expert's rows are padded to); None means the routing tile itself. A smaller ``block_m`` spreads one
    expert's rows over several programs (sub-tiles of pad rows load nothing)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    block_m: int | None = None

    def rows(self, route_m: int) -> int:
        """The rows per program for a routing tile of ``route_m`` rows (``block_m`` clipped to it)."""
        return route_m if self.block_m is None else min(self.block_m, route_m)


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Pick the routing's M tile from the mean rows per non-empty expert, P / min(E, P), so that most experts fit
    in one tile (each extra M tile of an expert re-reads its weights, from L2 at best).

    Rules: (1) up to 8 rows (decode, small batches): 16, the smallest ``tl.dot`` M; (2) up to 20: 32; (3) up to
    48: 64; (4) else 128. This is the M bucket the configs are keyed by; the kernels may work on sub-tiles of
    it (:attr:`GemmConfig.block_m`, chosen by the Inductor template's autotuning).
    Retune: measured on an H200 (benchmarks/results/2026-11-29-moe-h200); raise the thresholds where routing is
    skewed (the busiest expert sets the tile count).
    """
    rows = num_pairs / max(1, min(num_experts, num_pairs))
    if rows <= 8:
        return 16
    if rows <= 20:
        return 32
    if rows <= 48:
        return 64
    return 128


#: Shared memory a config may use, in bytes (H100/H200: 227 KB per block). The estimate counts ``num_stages``
#: buffers; Triton allocates about one fewer, which leaves room for its own scratch.
SMEM_BUDGET = 224 * 1024


def prune_configs(configs: list[GemmConfig], block_m: int, itemsize: int, b_tiles: int) -> list[GemmConfig]:
    """Drop configs that cannot run: (1) pipelined tiles over :data:`SMEM_BUDGET` (``num_stages`` copies of the
    A tile and ``b_tiles`` B tiles); (2) sub-tiles that do not divide the routing tile ``block_m``; (3) duplicates.
    Keeps the order (the first survivor is the untuned default)."""
    out = []
    for c in configs:
        rows = c.rows(block_m)
        smem = c.num_stages * (rows * c.block_k + b_tiles * c.block_k * c.block_n) * itemsize
        if smem <= SMEM_BUDGET and block_m % rows == 0 and rows >= 16 and c not in out:
            out.append(c)
    return out or [GemmConfig(32, 32, 4, 2)]


def gate_up_configs(block_m: int, itemsize: int = 2) -> list[GemmConfig]:
    """Candidate configs of the gate/up kernel (two B tiles per stage) for routing tile ``block_m`` (the M
    bucket), pruned by :func:`prune_configs`; the Inductor template autotunes over all of them.

    Small M (<= 32, bandwidth bound): deep K tiles and 3-5 stages to keep many weight bytes in flight. Large M
    (compute relevant: at Mixtral shape and batch 512 an expert holds ~128 rows): 8 warps, and sub-tiles of 64
    rows besides the full tile. The first entry of each list is the untuned default (the eager op's first
    guess): the H200 tuning winner at Mixtral shape (batch 8 and 64 for small M, 512 for M = 128;
    benchmarks/results/2026-11-29-moe-h200/run2_moe.json)."""
    if block_m <= 32:
        cands = [GemmConfig(128, 128, 4, 3), GemmConfig(64, 128, 4, 4), GemmConfig(32, 256, 4, 4),
                 GemmConfig(64, 128, 4, 5), GemmConfig(32, 128, 4, 5), GemmConfig(64, 64, 4, 4)]
    elif block_m == 64:
        cands = [GemmConfig(64, 64, 4, 4), GemmConfig(128, 64, 8, 3), GemmConfig(64, 128, 4, 3),
                 GemmConfig(128, 64, 4, 4), GemmConfig(128, 128, 4, 3, block_m=32), GemmConfig(64, 128, 4, 4, block_m=32)]
    else:
        cands = [GemmConfig(128, 64, 8, 3), GemmConfig(64, 64, 8, 4), GemmConfig(64, 128, 8, 3),
                 GemmConfig(64, 64, 4, 3), GemmConfig(128, 64, 8, 4), GemmConfig(128, 32, 8, 5),
                 GemmConfig(128, 64, 4, 4, block_m=64), GemmConfig(64, 128, 4, 3, block_m=64)]
    return prune_configs(cands, block_m, itemsize, b_tiles=2)


def down_configs(block_m: int, itemsize: int = 2) -> list[GemmConfig]:
    """Candidate configs of the down kernel (one B tile per stage), pruned by :func:`prune_configs`. Small M adds
    split-K (eager launcher only: Dm / BLOCK_N programs per expert are too few to fill the GPU at batch 1); large
    M adds narrow N tiles and 64-row sub-tiles: at Mixtral shape, batch 512, 256-wide N tiles gave ~16 tiles x
    16 = 256 programs, under two waves on 132 SMs (52% of the weight floor, run 2)."""
    if block_m <= 32:
        cands = [GemmConfig(32, 256, 4, 4), GemmConfig(64, 128, 4, 4), GemmConfig(64, 128, 4, 4, split_k=4),
                 GemmConfig(128, 128, 4, 4, split_k=4), GemmConfig(32, 256, 4, 4, split_k=2),
                 GemmConfig(32, 128, 4, 5), GemmConfig(64, 256, 4, 3), GemmConfig(16, 256, 4, 4)]
    elif block_m == 64:
        cands = [GemmConfig(64, 64, 4, 4), GemmConfig(128, 64, 8, 3), GemmConfig(64, 128, 4, 4),
                 GemmConfig(128, 128, 8, 3), GemmConfig(64, 128, 4, 4, block_m=32), GemmConfig(32, 256, 4, 4, block_m=32)]
    else:
        cands = [GemmConfig(256, 64, 8, 3), GemmConfig(128, 64, 8, 4), GemmConfig(128, 128, 8, 3),
                 GemmConfig(64, 64, 4, 4), GemmConfig(64, 128, 8, 3), GemmConfig(64, 64, 8, 4),
                 GemmConfig(128, 64, 4, 4, block_m=64), GemmConfig(64, 128, 4, 4, block_m=64)]
    return prune_configs(cands, block_m, itemsize, b_tiles=1)


# ------------------------------------------------------------------------------------------------ kernels


@triton.jit
def _ckvp_gate_up_tile(
    # pointers
    x_ptr, wg_ptr, wu_ptr, sorted_ids_ptr, block_expert_ptr,
    # program ids: pid_m indexes BLOCK_M-row sub-tiles of the routing's ROUTE_M-row tiles
    pid_m, pid_n,
    # sizes: N = I (output columns), K = Dm, num_pairs = P
    N, K, num_pairs,
    # strides
    stride_xm, stride_xk,
    stride_ge, stride_gn, stride_gk,
    stride_ue, stride_un, stride_uk,
    # meta-parameters
    TOP_K: tl.constexpr, ROUTE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile of silu(x @ W_gate[e]^T) * (x @ W_up[e]^T), fp32.

    Returns (act, rows, cols, live): rows (BLOCK_M,) are the sorted-row indices, cols (BLOCK_N,) the output
    columns, live (BLOCK_M,) bool: False on every row of a sub-tile with no pair (a tile past the last expert,
    or a sub-tile of pad rows), which loads nothing and must not be stored. Shared by the plain kernel and the Inductor
    template (ckvp_compile/lowering/moe.py), which includes this function's source."""
    first_row = pid_m * BLOCK_M
    expert = tl.load(block_expert_ptr + first_row // ROUTE_M).to(tl.int64)
    first_pair = tl.load(sorted_ids_ptr + first_row)
    active = (expert >= 0) & (first_pair < num_pairs)  # pad rows end each expert's segment
    rows = first_row + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows)
    valid = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    expert = tl.maximum(expert, 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :] * stride_xk
    g_ptrs = wg_ptr + expert * stride_ge + cols[None, :] * stride_gn + offs_k[:, None] * stride_gk
    u_ptrs = wu_ptr + expert * stride_ue + cols[None, :] * stride_un + offs_k[:, None] * stride_uk
    n_ok = cols[None, :] < N
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.where(active, tl.cdiv(K, BLOCK_K), 0)
    for k in range(0, k_tiles):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok, other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok, other=0.0)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_gk
        u_ptrs += BLOCK_K * stride_uk
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up, fp32
    live = tl.where(active, rows >= 0, rows < 0)  # (BLOCK_M,): every row of an active sub-tile is stored
    return act, rows, cols, live


@triton.jit
def _ckvp_down_tile(
    # pointers
    a_ptr, wd_ptr, sorted_ids_ptr, block_expert_ptr, weights_ptr,
    # program ids (pid_k: the split-K slice)
    pid_m, pid_n, pid_k,
    # sizes: N = Dm (output columns), K = I, num_pairs = P
    N, K, num_pairs,
    # strides (weights: the (T, A) routing weights)
    stride_am, stride_ak,
    stride_we, stride_wn, stride_wk,
    stride_tt, stride_ta,
    # meta-parameters
    TOP_K: tl.constexpr, ROUTE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile of w[p] * (act[r] @ W_down[e]^T), fp32, over split-K slice pid_k.

    Returns (acc, pair, cols): pair (BLOCK_M,) is the output row of each tile row (P for pad rows, which must not
    be stored), cols (BLOCK_N,) the output columns. Shared by the plain kernel and the Inductor template."""
    first_row = pid_m * BLOCK_M
    expert = tl.load(block_expert_ptr + first_row // ROUTE_M).to(tl.int64)
    first_pair = tl.load(sorted_ids_ptr + first_row)
    active = (expert >= 0) & (first_pair < num_pairs)
    rows = first_row + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows)
    valid = pair < num_pairs
    expert = tl.maximum(expert, 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tiles_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_first = pid_k * tiles_per_split * BLOCK_K
    offs_k = k_first + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = wd_ptr + expert * stride_we + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    n_ok = cols[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.where(active, tiles_per_split, 0)
    for k in range(0, k_tiles):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    pair64 = pair.to(tl.int64)
    w_ptrs_t = weights_ptr + (pair64 // TOP_K) * stride_tt + (pair64 % TOP_K) * stride_ta
    weight = tl.load(w_ptrs_t, mask=valid, other=0.0).to(tl.float32)
    return acc * weight[:, None], pair, cols


@triton.jit
def _grouped_gate_up_kernel(
    # pointers
    x_ptr, wg_ptr, wu_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr,
    # sizes: N = I (output columns), K = Dm, num_pairs = P
    N, K, num_pairs,
    # strides
    stride_xm, stride_xk,
    stride_ge, stride_gn, stride_gk,
    stride_ue, stride_un, stride_uk,
    stride_om, stride_on,
    # meta-parameters
    TOP_K: tl.constexpr, ROUTE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    act, rows, cols, live = _ckvp_gate_up_tile(
        x_ptr, wg_ptr, wu_ptr, sorted_ids_ptr, block_expert_ptr, tl.program_id(0), tl.program_id(1),
        N, K, num_pairs, stride_xm, stride_xk, stride_ge, stride_gn, stride_gk, stride_ue, stride_un, stride_uk,
        TOP_K, ROUTE_M, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=live[:, None] & (cols[None, :] < N))


@triton.jit
def _grouped_down_kernel(
    # pointers
    a_ptr, wd_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, weights_ptr,
    # sizes: N = Dm (output columns), K = I, num_pairs = P
    N, K, num_pairs,
    # strides (out is the fp32 (P, Dm) pair buffer, weights the (T, A) routing weights)
    stride_am, stride_ak,
    stride_we, stride_wn, stride_wk,
    stride_tt, stride_ta,
    stride_om, stride_on,
    # meta-parameters
    TOP_K: tl.constexpr, ROUTE_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PRECISION: tl.constexpr,
):
    acc, pair, cols = _ckvp_down_tile(
        a_ptr, wd_ptr, sorted_ids_ptr, block_expert_ptr, weights_ptr, tl.program_id(0), tl.program_id(1),
        tl.program_id(2), N, K, num_pairs, stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_tt,
        stride_ta, TOP_K, ROUTE_M, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, PRECISION)
    out_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
    mask = (pair[:, None] < num_pairs) & (cols[None, :] < N)
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=mask)


@triton.jit
def _moe_align_kernel(
    # pointers: topk_ids (P,) flattened, outputs sorted_ids (P_pad,) and block_expert (P_pad / BLOCK_M,)
    ids_ptr, sorted_ids_ptr, block_expert_ptr,
    # sizes
    num_pairs, num_experts, p_pad, num_tiles,
    # meta-parameters: P_BLOCK >= P and E_BLOCK >= E (powers of two)
    BLOCK_M: tl.constexpr, P_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr, FILL_BLOCK: tl.constexpr,
    TILE_BLOCK: tl.constexpr,
):
    """One program: the routing of ``moe_align_ref`` (stable sort by expert, segments padded to BLOCK_M)."""
    offs_p = tl.arange(0, P_BLOCK)
    p_ok = offs_p < num_pairs
    ids = tl.load(ids_ptr + offs_p, mask=p_ok, other=num_experts).to(tl.int32)  # padding lanes: no expert
    offs_e = tl.arange(0, E_BLOCK)
    onehot = (offs_e[:, None] == ids[None, :]).to(tl.int32)  # (E_BLOCK, P_BLOCK)
    counts = tl.sum(onehot, axis=1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    rank = tl.sum(onehot * tl.cumsum(onehot, axis=1), axis=0) - 1  # earlier pairs of the same expert
    dest = tl.sum(onehot * padded_start[:, None], axis=0) + rank
    for off in range(0, p_pad, FILL_BLOCK):  # pad rows hold P
        rows = off + tl.arange(0, FILL_BLOCK)
        tl.store(sorted_ids_ptr + rows, tl.full([FILL_BLOCK], 0, tl.int32) + num_pairs, mask=rows < p_pad)
    tl.debug_barrier()  # the pad fill lands before the pairs overwrite their rows
    tl.store(sorted_ids_ptr + dest, offs_p, mask=p_ok)
    for off in range(0, num_tiles, TILE_BLOCK):
        tiles = off + tl.arange(0, TILE_BLOCK)
        expert = tl.sum((padded_end[None, :] <= (tiles * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        expert = tl.where(expert < num_experts, expert, -1)
        tl.store(block_expert_ptr + tiles, expert, mask=tiles < num_tiles)


@triton.jit
def _combine_kernel(
    pairs_ptr, out_ptr,  # (T*A, N) fp32 -> (T, N) out dtype
    N, stride_pm, stride_om,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[t] = sum_a pairs[t*A + a], fp32 sum in slot order (deterministic), cast on store."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = offs < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for a in tl.static_range(TOP_K):
        acc += tl.load(pairs_ptr + (t * TOP_K + a) * stride_pm + offs, mask=ok, other=0.0)
    tl.store(out_ptr + t * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


#: Largest E_BLOCK * P_BLOCK the one-program routing kernel takes (its one-hot tile lives in registers); larger
#: routings use the static-shape torch ops of moe_align_ref (several launches, amortised at those sizes).
ALIGN_MAX_TILE = 8192


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Device-side routing, one launch when small: same outputs as :func:`~.moe_reference.moe_align_ref`.

    Args:
        topk_ids: (T, A) int32|int64 on the GPU (or on CPU under the interpreter). num_experts: E. block_m: M tile.
        num_warps: of the one program (None: :func:`align_num_warps`).
    Returns:
        sorted_ids (P_pad,) int32 and block_expert (P_pad / block_m,) int32 (-1 for unused tiles).
    Reference: kernels/moe_reference.py::moe_align_ref
    """
    from .moe_reference import padded_rows

    p = topk_ids.numel()
    p_block, e_block = triton.next_power_of_2(max(p, 1)), triton.next_power_of_2(num_experts)
    if p == 0 or p_block * e_block > ALIGN_MAX_TILE:
        return moe_align_ref(topk_ids, num_experts, block_m)
    p_pad = padded_rows(p, num_experts, block_m)
    num_tiles = p_pad // block_m
    sorted_ids = torch.empty(p_pad, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(num_tiles, dtype=torch.int32, device=topk_ids.device)
    _wrap(_moe_align_kernel, topk_ids)[(1,)](
        topk_ids.reshape(-1), sorted_ids, block_expert, p, num_experts, p_pad, num_tiles, BLOCK_M=block_m,
        P_BLOCK=p_block, E_BLOCK=e_block, FILL_BLOCK=min(256, triton.next_power_of_2(p_pad)),
        TILE_BLOCK=min(64, triton.next_power_of_2(num_tiles)),
        num_warps=num_warps or align_num_warps(p_block, e_block))
    return sorted_ids, block_expert


def align_num_warps(p_block: int, e_block: int) -> int:
    """Warps of the routing program: one for decode-sized routings (its scans and sums stay inside a warp, no
    block-wide barriers), four above :data:`ALIGN_ONE_WARP_TILE` one-hot entries."""
    return 1 if p_block * e_block <= ALIGN_ONE_WARP_TILE else 4


#: Largest one-hot tile (pairs x experts, powers of two) routed by one warp.
ALIGN_ONE_WARP_TILE = 1024


def combine(pairs: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """Sum each token's A rows of the (T*A, N) fp32 pair buffer, in slot order, into a (T, N) ``dtype`` tensor."""
    n = pairs.shape[1]
    out = torch.empty(pairs.shape[0] // top_k, n, dtype=dtype, device=pairs.device)
    if out.shape[0]:
        grid = (out.shape[0], triton.cdiv(n, 1024))
        _wrap(_combine_kernel, pairs)[grid](pairs, out, n, pairs.stride(0), out.stride(0), TOP_K=top_k,
                                            BLOCK_N=1024, num_warps=4)
    return out


# ------------------------------------------------------------------------------------------------ launchers


def _wrap(kernel, *tensors: torch.Tensor):
    """The kernel to launch: ``torch.library.wrap_triton(kernel)`` while tracing (inside a ``triton_op`` under
    ``torch.compile``: Inductor then emits the kernel), the plain kernel otherwise: on the H200 machine the eager
    op took 1.84 ms per Mixtral layer with every launch through wrap_triton against 1.06 ms with plain launches
    (and more kernels), batch 1, benchmarks/results/2026-11-29-moe-h200.
    Interpreted kernels (TRITON_INTERPRET=1) always launch as they are (torch 2.11's wrap_triton rejects them)."""
    if not _tracing(*tensors):
        return kernel
    try:
        return torch.library.wrap_triton(kernel)
    except RuntimeError:
        return kernel


def _tracing(*tensors: torch.Tensor) -> bool:
    """True under torch.compile / fake-tensor tracing, where nothing can be launched or timed."""
    from torch._subclasses.fake_tensor import is_fake

    return torch.compiler.is_compiling() or any(is_fake(t) for t in tensors)



def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in IEEE fp32 (exact parity with the reference); 16-bit inputs use the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def grouped_gate_up(hidden: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                    w_gate: torch.Tensor, w_up: torch.Tensor, top_k: int, block_m: int,
                    config: GemmConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the gate/up kernel: ``out[r] = silu(x @ W_gate[e]^T) * (x @ W_up[e]^T)`` per sorted row.

    Args:
        hidden: (T, Dm) fp32|bf16|fp16. sorted_ids: (P_pad,) int32, block_expert: (P_pad/block_m,) int32 from
            ``moe_align_ref(topk_ids, E, block_m)``. w_gate, w_up: (E, I, Dm) hidden.dtype, any strides.
        top_k: A. block_m: the routing's M tile (>= 16, a power of two). config: tile sizes.
        out: optional (P_pad, I) hidden.dtype buffer.
    Returns:
        (P_pad, I) hidden.dtype; rows of (sub-)tiles without a pair (expert -1, or all pad rows) are left
        unwritten, other pad rows are 0.
    Reference: kernels/moe_reference.py::grouped_gate_up_ref
    """
    p_pad, (e, n, k) = sorted_ids.shape[0], w_gate.shape
    if out is None:
        out = hidden.new_empty(p_pad, n)
    rows = config.rows(block_m)
    grid = (p_pad // rows, triton.cdiv(n, config.block_n))
    _wrap(_grouped_gate_up_kernel, hidden)[grid](
        hidden, w_gate, w_up, out, sorted_ids, block_expert,
        n, k, hidden.shape[0] * top_k,
        hidden.stride(0), hidden.stride(1),
        w_gate.stride(0), w_gate.stride(1), w_gate.stride(2),
        w_up.stride(0), w_up.stride(1), w_up.stride(2),
        out.stride(0), out.stride(1),
        TOP_K=top_k, ROUTE_M=block_m, BLOCK_M=rows, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        PRECISION=_precision(hidden.dtype), num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def grouped_down(act: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, w_down: torch.Tensor,
                 topk_weights: torch.Tensor, block_m: int, config: GemmConfig,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the down kernel: ``out[p] = w[p] * (act[r] @ W_down[e]^T)`` for the row r holding pair p.

    Args:
        act: (P_pad, I) from :func:`grouped_gate_up`. sorted_ids, block_expert: the routing. w_down: (E, Dm, I)
            act.dtype, any strides. topk_weights: (T, A) float, any strides. block_m, config: as for gate/up.
        out: optional zero-filled (P, Dm) fp32 buffer (must be zero when ``config.split_k > 1``).
    Returns:
        (P, Dm) fp32 (P = topk_weights.numel()).
    Reference: kernels/moe_reference.py::grouped_down_ref
    """
    num_pairs = topk_weights.numel()
    e, n, k = w_down.shape
    if out is None:
        out = torch.zeros(num_pairs, n, dtype=torch.float32, device=act.device)
    rows = config.rows(block_m)
    grid = (sorted_ids.shape[0] // rows, triton.cdiv(n, config.block_n), config.split_k)
    _wrap(_grouped_down_kernel, act)[grid](
        act, w_down, out, sorted_ids, block_expert, topk_weights,
        n, k, num_pairs,
        act.stride(0), act.stride(1),
        w_down.stride(0), w_down.stride(1), w_down.stride(2),
        topk_weights.stride(0), topk_weights.stride(1),
        out.stride(0), out.stride(1),
        TOP_K=topk_weights.shape[1], ROUTE_M=block_m, BLOCK_M=rows, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=config.split_k,
        PRECISION=_precision(act.dtype), num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


_TUNED: dict[tuple, GemmConfig] = {}


def _tune(key: tuple, candidates: list[GemmConfig], launch, tracing: bool = False) -> GemmConfig:
    """Return the fastest of ``candidates`` for ``key`` (timed once per process with triton.testing.do_bench on
    scratch outputs; cached). While tracing, under the interpreter, or with CKVP_MOE_NO_TUNE=1: the first
    candidate (the configs lists are ordered so that it is a good default). While a CUDA graph is being captured:
    the first candidate, not cached, never timed (do_bench synchronises the device, which invalidates a capture;
    a CUDA-graph-trees warm-up, which runs before each recording, times and caches the key first)."""
    if key in _TUNED:
        return _TUNED[key]
    if tracing or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return candidates[0]  # not cached: a later eager call still tunes
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("CKVP_MOE_NO_TUNE") == "1" or len(candidates) == 1:
        best = candidates[0]
    else:
        from triton.testing import do_bench

        times = []
        for cfg in candidates:
            try:
                times.append((do_bench(functools.partial(launch, cfg), warmup=5, rep=20), cfg))
            except Exception:  # a config the GPU cannot run (too much shared memory): skip it
                continue
        best = min(times, key=lambda tc: tc[0])[1] if times else candidates[0]
    _TUNED[key] = best
    return best


def moe_experts_triton(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                       gate_up_config: GemmConfig | None = None, down_config: GemmConfig | None = None,
                       block_m: int | None = None) -> torch.Tensor:
    """The routed experts on the GPU: device-side routing, gate/up + SiLU kernel, down + weight kernel, combine.

    Args:
        hidden: (T, Dm), topk_ids: (T, A) int, topk_weights: (T, A) float, w_gate / w_up: (E, I, Dm),
            w_down: (E, Dm, I), all on one device (inputs validated by ``ckvp::moe_experts``).
        gate_up_config, down_config: fixed configs; default: tuned once per (E, I, Dm, M tile, dtype).
        block_m: the M tile; default :func:`block_m_for`.
    Returns:
        (T, Dm) hidden.dtype. No host synchronisation (the routing's sizes are worst-case static).
    Reference: kernels/moe_reference.py::moe_experts_ref
    """
    t, a = topk_ids.shape
    e, i, dm = w_gate.shape
    bm = block_m or block_m_for(t * a, e)
    sorted_ids, block_expert = moe_align(topk_ids, e, bm)
    key = (e, i, dm, bm, triton.next_power_of_2(t * a), hidden.dtype, str(hidden.device))
    itemsize = hidden.element_size()
    tracing = _tracing(hidden)
    if gate_up_config is None:
        gate_up_config = _tune(("gate_up",) + key, gate_up_configs(bm, itemsize), lambda c: grouped_gate_up(
            hidden, sorted_ids, block_expert, w_gate, w_up, a, bm, c,
            out=hidden.new_empty(sorted_ids.shape[0], i)), tracing)
    act = grouped_gate_up(hidden, sorted_ids, block_expert, w_gate, w_up, a, bm, gate_up_config)
    if down_config is None:
        scratch = None if tracing else torch.zeros(t * a, dm, dtype=torch.float32, device=hidden.device)
        down_config = _tune(("down",) + key, down_configs(bm, itemsize), lambda c: grouped_down(
            act, sorted_ids, block_expert, w_down, topk_weights, bm, c, out=scratch), tracing)
    alloc = torch.zeros if down_config.split_k > 1 else torch.empty  # split-K accumulates atomically
    pairs = alloc(t * a, dm, dtype=torch.float32, device=hidden.device)
    grouped_down(act, sorted_ids, block_expert, w_down, topk_weights, bm, down_config, out=pairs)
    return combine(pairs, a, hidden.dtype)
