"""Triton row-scatter epilogues of the grouped_mm expert path (:mod:`ckvp_compile.kernels.moe_grouped_mm`).

Notation of :mod:`ckvp_compile.kernels.moe_reference`: P pairs, compact row c (expert-sorted, the rows
``torch._grouped_mm`` computes), ``rows[c]`` its row in the tile-padded layout, ``pairs[c]`` its pair id.

* ``_silu_mul_scatter_kernel``: ``out[rows[c], n] = silu(g[c, n]) * u[c, n]`` (fp32 math, cast on store): the
  gate/up epilogue in one pass over g and u (PyTorch ops would take three: silu, mul, index_copy).
* ``_scale_scatter_kernel``: ``out[pairs[c], n] = w[pairs[c]] * y[c, n]`` in fp32, w the (T, A) routing
  weights at pair p = (p // A, p % A): the down epilogue in one pass.

Grid (cdiv(P, BLOCK_R), cdiv(N, BLOCK_N)); each program moves a (BLOCK_R, BLOCK_N) tile (memory bound, no
reuse: the block sizes only set the work per program). The index vectors are distinct (a permutation into the
destination rows), so the stores never race; destination rows not named are left as they are.
Reference twins: ``moe_grouped_mm.silu_mul_scatter_ref`` / ``moe_grouped_mm.scale_scatter_ref``.
Source: written from scratch in the style of the Triton tutorial ``02-fused-softmax.py`` (row-wise pointers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["scale_scatter", "silu_mul_scatter"]

#: Rows and columns per program (elementwise: 2048 elements, 16 per thread with 4 warps). Retune only with a
#: profile of the gate/up epilogue at large P (Mixtral shape, batch 512: P x I = 1024 x 14336).
BLOCK_R, BLOCK_N, NUM_WARPS = 8, 256, 4


@triton.jit
def _silu_mul_scatter_kernel(
    # pointers: g, u (P, N) compact rows; rows (P,) destination row per compact row; out (R, N)
    g_ptr, u_ptr, rows_ptr, out_ptr,
    # sizes
    P, N,
    # strides
    stride_gm, stride_gn, stride_um, stride_un, stride_om, stride_on,
    # meta-parameters
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = offs_r < P
    mask = r_ok[:, None] & (offs_n[None, :] < N)
    src = offs_r.to(tl.int64)
    dest = tl.load(rows_ptr + offs_r, mask=r_ok, other=0).to(tl.int64)
    g = tl.load(g_ptr + src[:, None] * stride_gm + offs_n[None, :] * stride_gn, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + src[:, None] * stride_um + offs_n[None, :] * stride_un, mask=mask, other=0.0).to(tl.float32)
    act = g / (1.0 + tl.exp(-g)) * u  # silu(g) * u, as the gate/up template's epilogue
    tl.store(out_ptr + dest[:, None] * stride_om + offs_n[None, :] * stride_on,
             act.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_scatter_kernel(
    # pointers: y (P, N) compact rows; pairs (P,) pair id per compact row; w (T, A) weights; out (T*A, N) fp32
    y_ptr, pairs_ptr, w_ptr, out_ptr,
    # sizes
    P, N,
    # strides
    stride_ym, stride_yn, stride_wt, stride_wa, stride_om, stride_on,
    # meta-parameters
    TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = offs_r < P
    mask = r_ok[:, None] & (offs_n[None, :] < N)
    pair = tl.load(pairs_ptr + offs_r, mask=r_ok, other=0).to(tl.int64)
    weight = tl.load(w_ptr + (pair // TOP_K) * stride_wt + (pair % TOP_K) * stride_wa, mask=r_ok,
                     other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs_r.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn, mask=mask,
                other=0.0).to(tl.float32)
    tl.store(out_ptr + pair[:, None] * stride_om + offs_n[None, :] * stride_on, y * weight[:, None], mask=mask)


def _grid(p: int, n: int) -> tuple[int, int]:
    return (triton.cdiv(p, BLOCK_R), triton.cdiv(n, BLOCK_N))


def silu_mul_scatter(g: torch.Tensor, u: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Launch ``out[rows[c]] = silu(g[c]) * u[c]`` (fp32 math, cast to out.dtype).

    Args:
        g, u: (P, N) float, any strides (``torch._grouped_mm`` outputs). rows: (P,) int32|int64, distinct, in
            [0, R). out: (R, N) float, any strides; rows not in ``rows`` are not written.
    Returns:
        out.
    Raises:
        ValueError: the shapes disagree.
    Reference: kernels/moe_grouped_mm.py::silu_mul_scatter_ref
    """
    p, n = g.shape
    if u.shape != g.shape or rows.shape != (p,) or out.dim() != 2 or out.shape[1] != n:
        raise ValueError(f"silu_mul_scatter: g {tuple(g.shape)}, u {tuple(u.shape)}, rows {tuple(rows.shape)}, "
                         f"out {tuple(out.shape)}: expected g = u = (P, N), rows (P,), out (R, N)")
    if p and n:
        _silu_mul_scatter_kernel[_grid(p, n)](
            g, u, rows, out, p, n, g.stride(0), g.stride(1), u.stride(0), u.stride(1), out.stride(0), out.stride(1),
            BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS)
    return out


def scale_scatter(y: torch.Tensor, pairs: torch.Tensor, topk_weights: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    """Launch ``out[pairs[c]] = topk_weights.flatten()[pairs[c]] * y[c]`` (fp32).

    Args:
        y: (P, N) float, any strides. pairs: (P,) int32|int64, distinct, in [0, T*A). topk_weights: (T, A) float,
            any strides. out: (T*A, N) fp32, any strides.
    Returns:
        out.
    Raises:
        ValueError: the shapes disagree.
    Reference: kernels/moe_grouped_mm.py::scale_scatter_ref
    """
    p, n = y.shape
    if pairs.shape != (p,) or topk_weights.dim() != 2 or tuple(out.shape) != (topk_weights.numel(), n):
        raise ValueError(f"scale_scatter: y {tuple(y.shape)}, pairs {tuple(pairs.shape)}, topk_weights "
                         f"{tuple(topk_weights.shape)}, out {tuple(out.shape)}: expected y (P, N), pairs (P,), "
                         "out (T*A, N)")
    if p and n:
        _scale_scatter_kernel[_grid(p, n)](
            y, pairs, topk_weights, out, p, n, y.stride(0), y.stride(1), topk_weights.stride(0),
            topk_weights.stride(1), out.stride(0), out.stride(1),
            TOP_K=topk_weights.shape[1], BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS)
    return out
