"""The routed expert GEMMs on ``torch._grouped_mm`` over compact expert-sorted rows (no padding compute).

Notation of :mod:`ckvp_compile.kernels.moe_reference`: T tokens, A top-k, E experts, Dm model dim, I FFN dim,
P = T*A pairs, P_pad rows of the tile-padded routing of ``moe_align`` (each expert's rows padded to ROUTE_M,
``block_m`` here), ``sorted_ids`` / ``tile_expert`` its outputs.

The tile-padded Triton kernels (:mod:`ckvp_compile.kernels.grouped_gemm`) compute every row of every used tile:
at Mixtral shape, batch 512 (about 128 pairs per expert, ROUTE_M 128) about 1.5x the pair rows. This module
computes the same two GEMMs on the P pair rows only, with PyTorch's grouped GEMM (ragged M through int32 group
ends ``offs``; on sm90/sm100 in bf16 a CUTLASS kernel with TMA, no host synchronisation), and moves the rows
between the padded layout and the compact one around it:

1. :func:`compact_routing` (static shapes, no host sync): ``valid = sorted_ids < P``; ``csum = cumsum(valid)``;
   compact row c lives in padded row ``rows[c] = searchsorted(csum, c + 1)`` (the (c+1)-th valid row); its pair
   ``pairs[c] = sorted_ids[rows[c]]`` and its expert ``tile_expert[rows[c] // block_m]``, ascending in c, so
   ``offs[e] = #{c : expert(c) <= e}`` (``searchsorted(..., right=True)``) are the group ends.
2. gate/up (:func:`moe_gate_up_grouped_mm`): ``x = hidden[pairs // A]`` (P, Dm); ``g = x @ W_gate[e]^T`` and
   ``u = x @ W_up[e]^T`` per group; ``act[rows[c]] = silu(g[c]) * u[c]`` (fp32 math, one rounding), scattered
   into a (P_pad, I) buffer. Pad rows are not written (unspecified; see the function).
3. down (:func:`moe_down_grouped_mm`): ``a = act[rows]`` (P, I); ``y = a @ W_down[e]^T`` per group;
   ``out[pairs[c]] = topk_weights.flatten()[pairs[c]] * y[c]``, fp32 (P, Dm), every row written once.

The GEMM (:func:`grouped_mm`) is ``torch._grouped_mm(x, W.transpose(-2, -1), offs=offs)`` where it runs as the
fused kernel (:func:`grouped_mm_fast_path`: CUDA, bf16, compute capability 9.x or 10.x, 16-byte aligned
operands); elsewhere a loop over the experts (``torch.mm`` per group, one host read of ``offs``: the CPU path and
the tests). The scatters (step 2's epilogue and step 3's) run as the Triton kernels of
:mod:`ckvp_compile.kernels.moe_scatter` on CUDA (one pass over the GEMM outputs) and as the PyTorch twins
:func:`silu_mul_scatter_ref` / :func:`scale_scatter_ref` elsewhere. This module imports no Triton.

Requirements of ``torch._grouped_mm`` (read in torch 2.13: ``_meta_registrations._meta_grouped_mm_common`` and
``aten/src/ATen/native/GroupedMMUtils.h``; the same checks in 2.11's ``GroupedBlas.cpp``): inputs bf16 (the meta
kernel and the fast path; fp16/fp32 fall back to a per-group loop that copies ``offs`` to the host), output dtype
= input dtype, mat_a (M, K) and mat_b (E, K, N) each with one unit stride among the last two dims and the other a
multiple of 16 bytes, data pointers 16-byte aligned on CUDA, ``offs`` (E,) int32 non-decreasing group ends (empty
groups allowed), output (M, N) with its row stride padded to 16 bytes. Rows past ``offs[-1]`` are not written.
Source: the grouped-GEMM MoE form of transformers ``integrations/moe.py::grouped_mm_experts_forward`` (sort by
expert, ``_grouped_mm`` with cumulative counts), re-derived for ckvp's padded routing; no code copied.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["CompactRouting", "compact_routing", "grouped_mm", "grouped_mm_fast_path", "moe_down_grouped_mm",
           "moe_gate_up_grouped_mm", "scale_scatter_ref", "silu_mul_scatter_ref", "supports_grouped_mm",
           "weight_operand_ok"]

#: Compute capabilities (major) whose ``torch._grouped_mm`` runs the fused bf16 kernel without a host sync.
FAST_PATH_MAJORS = (9, 10)
#: Byte alignment of the operands' strides and data pointers that ``torch._grouped_mm`` requires.
ALIGN_BYTES = 16


class CompactRouting(NamedTuple):
    """The compact view of a tile-padded routing (P = number of pairs).

    rows: (P,) int64, the padded row of each compact row, ascending. pairs: (P,) int64, the pair id of each
    compact row (experts ascending, each expert's pairs in pair order). offs: (E,) int32, exclusive end of each
    expert's compact rows (``torch._grouped_mm``'s ``offs``)."""

    rows: torch.Tensor
    pairs: torch.Tensor
    offs: torch.Tensor


def compact_routing(sorted_ids: torch.Tensor, tile_expert: torch.Tensor, num_pairs: int, num_experts: int,
                    block_m: int) -> CompactRouting:
    """Map the tile-padded routing of ``moe_align`` to compact expert-sorted rows, on device, no host sync.

    Args:
        sorted_ids: (P_pad,) int32, pair id per padded row, pad rows hold ``num_pairs``.
        tile_expert: (P_pad / block_m,) int32, expert per tile, -1 past the last expert's segment.
        num_pairs: P = T*A (every pair appears exactly once in ``sorted_ids``). num_experts: E.
        block_m: the routing tile (ROUTE_M) ``sorted_ids`` was padded to.
    Returns:
        :class:`CompactRouting` (rows, pairs, offs).
    Notes:
        Static-shape ops only (compare, cumsum, searchsorted, index_select): about ten small launches on CUDA.
    Reference: the per-expert masks of kernels/moe_reference.py::grouped_gate_up_ref (same rows, same order).
    """
    device = sorted_ids.device
    valid = sorted_ids < num_pairs
    csum = torch.cumsum(valid, 0)  # (P_pad,) int64: valid rows up to and including each row
    rows = torch.searchsorted(csum, torch.arange(1, num_pairs + 1, device=device))  # the (c+1)-th valid row
    pairs = sorted_ids.index_select(0, rows).to(torch.int64)
    expert = tile_expert.index_select(0, torch.div(rows, block_m, rounding_mode="floor"))  # ascending
    offs = torch.searchsorted(expert, torch.arange(num_experts, device=device, dtype=expert.dtype), right=True,
                              out_int32=True)
    return CompactRouting(rows, pairs, offs)


# ------------------------------------------------------------------------------------------------ the GEMM


def weight_operand_ok(size: tuple[int, ...], stride: tuple[int, ...], offset: int, itemsize: int) -> bool:
    """True when a weight W (E, N, K) with these strides and storage offset (elements), transposed to (E, K, N),
    is a valid ``torch._grouped_mm`` mat_b with 16-byte aligned groups.

    Rules (``check_valid_strides_and_return_transposed`` of GroupedMMUtils.h, plus the group base pointers the
    kernel forms): (1) one of the last two strides is 1 and the other is >= the size it steps over and a multiple
    of 16 bytes; (2) the expert stride and (3) the storage offset are multiples of 16 bytes (a view of HF's fused
    (E, 2I, Dm) ``gate_up_proj`` passes when I*Dm is a multiple of 8 in bf16).
    """
    if len(size) != 3 or len(stride) != 3 or itemsize <= 0 or ALIGN_BYTES % itemsize:
        return False
    align = ALIGN_BYTES // itemsize
    _, n, k = size
    s_e, s_n, s_k = stride
    if s_k == 1 and s_n >= max(1, k):
        ok = s_n % align == 0
    elif s_n == 1 and s_k >= max(1, n):
        ok = s_k % align == 0
    else:
        ok = False
    return ok and s_e % align == 0 and offset % align == 0


def supports_grouped_mm(device: torch.device, dtype: torch.dtype, capability: tuple[int, int] | None) -> bool:
    """True when ``torch._grouped_mm`` runs its fused kernel (no host sync) for ``dtype`` on ``device``.

    Args:
        device: the tensors' device. dtype: of the inputs. capability: the CUDA compute capability (major, minor)
            of ``device`` (None when unknown or not CUDA).
    Returns:
        CUDA, bf16, major in :data:`FAST_PATH_MAJORS`, and ``torch._grouped_mm`` present (torch >= 2.8).
    """
    return (torch.device(device).type == "cuda" and dtype == torch.bfloat16 and capability is not None
            and capability[0] in FAST_PATH_MAJORS and hasattr(torch, "_grouped_mm"))


def grouped_mm_fast_path(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when ``grouped_mm(x, w, offs)`` can call the fused ``torch._grouped_mm`` kernel: the device and dtype
    (:func:`supports_grouped_mm`), x (M, K) row-major with a 16-byte row stride and data pointer, w per
    :func:`weight_operand_ok` with a 16-byte aligned data pointer."""
    if not x.is_cuda or x.dtype != w.dtype:
        return False
    if not supports_grouped_mm(x.device, x.dtype, torch.cuda.get_device_capability(x.device)):
        return False
    align = ALIGN_BYTES // x.element_size()
    x_ok = x.dim() == 2 and x.stride(1) == 1 and x.stride(0) % align == 0 and x.stride(0) >= x.shape[1]
    ptr_ok = x.data_ptr() % ALIGN_BYTES == 0 and w.data_ptr() % ALIGN_BYTES == 0
    return x_ok and ptr_ok and weight_operand_ok(tuple(w.shape), tuple(w.stride()), 0, w.element_size())


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-expert ``x[rows of e] @ W[e]^T`` over compact expert-sorted rows.

    Args:
        x: (M, K), rows of expert e in ``[offs[e-1], offs[e])``. w: (E, N, K) x.dtype, any strides (as stored:
            (E, I, Dm) gate/up, (E, Dm, I) down). offs: (E,) int32 non-decreasing group ends, ``offs[-1] == M``.
    Returns:
        (M, N) x.dtype (fp32 accumulation); the row stride may be padded to 16 bytes (``torch._grouped_mm``).
    Notes:
        :func:`grouped_mm_fast_path`: ``torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)`` (no host sync).
        Otherwise one ``torch.mm`` per non-empty expert after one host read of ``offs`` (CPU, other dtypes).
    """
    if grouped_mm_fast_path(x, w):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(x[start:end], w[e].transpose(0, 1), out=out[start:end])
        start = end
    return out


# ------------------------------------------------------------------------------------------------ epilogues


def silu_mul_scatter_ref(g: torch.Tensor, u: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[rows[c]] = silu(g[c]) * u[c]`` (fp32 math, cast to out.dtype); other rows of ``out`` untouched.

    Args: g, u: (P, I) float. rows: (P,) int64 distinct. out: (R, I). Returns: out.
    Twin of: kernels/moe_scatter.py::silu_mul_scatter
    """
    return out.index_copy_(0, rows, (F.silu(g.float()) * u.float()).to(out.dtype))


def scale_scatter_ref(y: torch.Tensor, pairs: torch.Tensor, topk_weights: torch.Tensor,
                      out: torch.Tensor) -> torch.Tensor:
    """``out[pairs[c]] = topk_weights.flatten()[pairs[c]] * y[c]`` in fp32.

    Args: y: (P, N) float. pairs: (P,) int64 distinct, in [0, T*A). topk_weights: (T, A) float, any strides.
        out: (T*A, N) fp32. Returns: out.
    Twin of: kernels/moe_scatter.py::scale_scatter
    """
    weights = topk_weights.reshape(-1).float().index_select(0, pairs)
    return out.index_copy_(0, pairs, y.float() * weights[:, None])


def _scatters(device: torch.device):
    """The epilogue implementations for ``device``: the Triton kernels on CUDA, the PyTorch twins elsewhere."""
    if device.type == "cuda":
        from . import moe_scatter

        return moe_scatter.silu_mul_scatter, moe_scatter.scale_scatter
    return silu_mul_scatter_ref, scale_scatter_ref


# ------------------------------------------------------------------------------------------------ the two GEMMs


def moe_gate_up_grouped_mm(hidden: torch.Tensor, sorted_ids: torch.Tensor, tile_expert: torch.Tensor,
                           w_gate: torch.Tensor, w_up: torch.Tensor, top_k: int, block_m: int) -> torch.Tensor:
    """The gate/up GEMMs with the SiLU epilogue on the compact pair rows, scattered into the padded layout.

    Args:
        hidden: (T, Dm) float, any strides. sorted_ids, tile_expert: ``moe_align(topk_ids, E, block_m)``.
        w_gate, w_up: (E, I, Dm) hidden.dtype, any strides (the fused kernel where :func:`grouped_mm_fast_path`).
        top_k: A. block_m: the routing tile.
    Returns:
        (P_pad, I) hidden.dtype, contiguous: a row holding pair p is ``silu(x @ W_gate[e]^T) * (x @ W_up[e]^T)``
        for token x = hidden[p // A] and its tile's expert e. Pad rows (``sorted_ids >= P``) are unspecified:
        on CUDA they are not written (possibly NaN), elsewhere they are 0 (as the reference). Every consumer of
        the padded layout (the down template and kernel, ``ckvp::moe_down``, :func:`moe_down_grouped_mm`) reads
        pad rows into no stored result.
    Notes:
        Workspace: x (P, Dm), g and u (P, I). The GEMM outputs are in hidden.dtype (``torch._grouped_mm``
        returns its input dtype), so bf16 rounds g and u once before the fp32 epilogue (the Triton template
        does not).
    Reference: kernels/moe_reference.py::grouped_gate_up_ref (equal on the pair rows).
    """
    num_pairs = hidden.shape[0] * top_k
    alloc = torch.empty if hidden.is_cuda else torch.zeros  # CPU: deterministic pad rows, as the reference
    out = alloc(sorted_ids.shape[0], w_gate.shape[1], dtype=hidden.dtype, device=hidden.device)
    if num_pairs == 0:
        return out
    route = compact_routing(sorted_ids, tile_expert, num_pairs, w_gate.shape[0], block_m)
    x = hidden.index_select(0, torch.div(route.pairs, top_k, rounding_mode="floor"))  # (P, Dm) contiguous
    g = grouped_mm(x, w_gate, route.offs)
    u = grouped_mm(x, w_up, route.offs)
    silu_mul_scatter, _ = _scatters(hidden.device)
    return silu_mul_scatter(g, u, route.rows, out)


def moe_down_grouped_mm(act: torch.Tensor, sorted_ids: torch.Tensor, tile_expert: torch.Tensor,
                        w_down: torch.Tensor, topk_weights: torch.Tensor, block_m: int) -> torch.Tensor:
    """The down GEMM on the compact pair rows times each pair's routing weight, in pair order.

    Args:
        act: (P_pad, I) in the padded layout (pad rows are never read). sorted_ids, tile_expert: the routing.
        w_down: (E, Dm, I) act.dtype, any strides. topk_weights: (T, A) float, any strides. block_m: the tile.
    Returns:
        (P, Dm) fp32, contiguous, row p = ``topk_weights.flatten()[p] * (act[r] @ W_down[e]^T)`` for the padded
        row r holding p (every row written).
    Notes:
        Workspace: a (P, I) gather of act and the (P, Dm) act.dtype GEMM output (rounded once in bf16 before
        the fp32 weight multiply).
    Reference: kernels/moe_reference.py::grouped_down_ref
    """
    num_pairs = topk_weights.numel()
    out = torch.empty(num_pairs, w_down.shape[1], dtype=torch.float32, device=act.device)
    if num_pairs == 0:
        return out
    route = compact_routing(sorted_ids, tile_expert, num_pairs, w_down.shape[0], block_m)
    y = grouped_mm(act.index_select(0, route.rows), w_down, route.offs)
    _, scale_scatter = _scatters(act.device)
    return scale_scatter(y, route.pairs, topk_weights, out)
