"""Pure-PyTorch references of the grouped expert GEMM path (no Triton import): routing, the two grouped GEMMs,
the combine, and the per-expert loop every other path is tested against.

Notation (the package's glossary): T tokens, A active experts per token (top-k), E experts, Dm model dim,
I expert FFN dim, P = T*A (token, slot) pairs. Pair ``p`` is token ``p // A``, slot ``p % A``.

Algorithm (the shape of vLLM ``fused_moe`` / MegaBlocks, written from their papers and docs, no code copied):

1. **Routing** (:func:`moe_align_ref`): sort the P pairs by expert (stable) and give each expert a segment of
   rows padded up to a multiple of the GEMM's M tile ``block_m``, so that every M tile belongs to exactly one
   expert. Sizes are worst-case, independent of the routing data, so there is no host synchronisation and the
   shapes are static under ``torch.compile``: at most ``min(E, P)`` experts are non-empty, each wastes at most
   ``block_m - 1`` rows, hence ``P_pad = round_up(P + min(E, P) * (block_m - 1), block_m)`` rows.
2. **gate/up GEMM with the SiLU epilogue** (:func:`grouped_gate_up_ref`): row r (pair p) of tile b computes
   ``silu(x[p // A] @ W_gate[e_b]^T) * (x[p // A] @ W_up[e_b]^T)``; pad rows are 0.
3. **down GEMM with the routing weight** (:func:`grouped_down_ref`): ``y[p] = w[p] * (h[r] @ W_down[e_b]^T)``,
   written (scattered) back to pair order, fp32.
4. **combine**: ``out[t] = sum_a y[t*A + a]`` in fp32, cast to the activations' dtype (deterministic: no atomics).

:func:`moe_experts_loop_ref` is the oracle: a loop over experts in the form of gpt-fast's
``ConditionalFeedForward`` / HF's eager experts, with data-dependent masks (fine for a reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "PAD_EXPERT",
    "grouped_down_ref",
    "grouped_gate_up_ref",
    "moe_align_ref",
    "moe_experts_loop_ref",
    "moe_experts_ref",
    "padded_rows",
]

#: ``block_expert`` value of an M tile past the last expert's segment (the kernels skip it).
PAD_EXPERT = -1


def padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Return P_pad, the worst-case row count of the sorted, padded pair list (a multiple of ``block_m``).

    Args:
        num_pairs: P = T*A. num_experts: E. block_m: the M tile (>= 1).
    Returns:
        ``round_up(P + min(E, P) * (block_m - 1), block_m)``; 0 when P == 0.
    """
    if num_pairs <= 0:
        return 0
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (token, slot) pairs by expert and pad each expert's rows to a multiple of ``block_m``, on device.

    Args:
        topk_ids: (T, A) int32|int64, expert of each (token, slot), values in [0, E).
        num_experts: E. block_m: the M tile of the grouped GEMMs.
    Returns:
        sorted_ids: (P_pad,) int32, the pair index ``t*A + a`` of each row, experts in ascending order, each
            expert's pairs in pair order; pad rows hold P (= T*A, out of range).
        block_expert: (P_pad // block_m,) int32, the expert of each M tile, :data:`PAD_EXPERT` for tiles past
            the last segment.
    Notes:
        Only static-shape ops (scatter_add, cumsum, a stable sort, index_put, searchsorted): no ``.item()``, no
        ``nonzero``, so no host synchronisation and no recompiles across routings. P_pad is
        :func:`padded_rows`. Ids out of [0, E) are not checked (that needs the data); they raise PyTorch's
        index error on CPU.
    Source: the routing metadata of vLLM ``moe_align_block_size`` and Liger ``compute_routing_metadata``
        (re-derived, no code copied).
    """
    device = topk_ids.device
    p = topk_ids.numel()
    p_pad = padded_rows(p, num_experts, block_m)
    flat = topk_ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)  # (E,) exclusive end row of each expert's padded segment
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts  # (E,) first sorted position of each expert
    order = torch.sort(flat, stable=True).indices  # (P,) pair ids, grouped by expert
    experts_sorted = flat[order]
    rank = torch.arange(p, device=device) - start[experts_sorted]
    dest = padded_start[experts_sorted] + rank
    sorted_ids = torch.full((p_pad,), p, dtype=torch.int32, device=device)
    sorted_ids.index_put_((dest,), order.to(torch.int32))
    tile_start = torch.arange(0, p_pad, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, tile_start, right=True)  # E past the last segment
    block_expert = torch.where(block_expert < num_experts, block_expert, PAD_EXPERT).to(torch.int32)
    return sorted_ids, block_expert


def _row_experts(block_expert: torch.Tensor, block_m: int) -> torch.Tensor:
    return block_expert.to(torch.int64).repeat_interleave(block_m)


def grouped_gate_up_ref(hidden: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                        w_gate: torch.Tensor, w_up: torch.Tensor, top_k: int, block_m: int) -> torch.Tensor:
    """Reference of the grouped gate/up GEMM with the fused ``silu(gate) * up`` epilogue.

    Args:
        hidden: (T, Dm) float. sorted_ids, block_expert: from :func:`moe_align_ref` with ``block_m``.
        w_gate, w_up: (E, I, Dm) hidden.dtype (may be views of HF's fused (E, 2I, Dm) ``gate_up_proj``).
        top_k: A. block_m: the M tile the routing was padded to.
    Returns:
        (P_pad, I) hidden.dtype, row r = ``silu(x @ W_gate[e]^T) * (x @ W_up[e]^T)`` for its pair's token x and
        its tile's expert e, computed in fp32; pad rows (and tiles of :data:`PAD_EXPERT`) are 0.
    Reference of: kernels/grouped_gemm.py::grouped_gate_up
    """
    num_pairs = hidden.shape[0] * top_k
    out = torch.zeros(sorted_ids.shape[0], w_gate.shape[1], dtype=hidden.dtype, device=hidden.device)
    row_expert = _row_experts(block_expert, block_m)
    valid = sorted_ids.to(torch.int64) < num_pairs
    for e in range(w_gate.shape[0]):
        rows = torch.nonzero(valid & (row_expert == e)).flatten()
        if rows.numel() == 0:
            continue
        x = hidden[sorted_ids[rows].to(torch.int64) // top_k].float()
        gate = x @ w_gate[e].float().T
        up = x @ w_up[e].float().T
        out[rows] = (F.silu(gate) * up).to(hidden.dtype)
    return out


def grouped_down_ref(act: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, w_down: torch.Tensor,
                     topk_weights: torch.Tensor, block_m: int) -> torch.Tensor:
    """Reference of the grouped down GEMM with the routing weight applied, scattered back to pair order.

    Args:
        act: (P_pad, I) from :func:`grouped_gate_up_ref`. sorted_ids, block_expert: the routing.
        w_down: (E, Dm, I) act.dtype. topk_weights: (T, A) float, the routing weight of each pair.
        block_m: the M tile the routing was padded to.
    Returns:
        (P, Dm) fp32, row p = ``topk_weights.flatten()[p] * (act[r] @ W_down[e]^T)`` for the row r holding p.
    Reference of: kernels/grouped_gemm.py::grouped_down
    """
    num_pairs = topk_weights.numel()
    weights = topk_weights.reshape(-1).float()
    out = torch.zeros(num_pairs, w_down.shape[1], dtype=torch.float32, device=act.device)
    row_expert = _row_experts(block_expert, block_m)
    valid = sorted_ids.to(torch.int64) < num_pairs
    for e in range(w_down.shape[0]):
        rows = torch.nonzero(valid & (row_expert == e)).flatten()
        if rows.numel() == 0:
            continue
        pairs = sorted_ids[rows].to(torch.int64)
        out[pairs] = (act[rows].float() @ w_down[e].float().T) * weights[pairs, None]
    return out


def moe_experts_ref(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                    w_up: torch.Tensor, w_down: torch.Tensor, block_m: int = 16) -> torch.Tensor:
    """The grouped path end to end in PyTorch: routing, gate/up + SiLU, down + routing weight, combine.

    Args:
        hidden: (T, Dm) float. topk_ids: (T, A) int, in [0, E). topk_weights: (T, A) float.
        w_gate, w_up: (E, I, Dm) hidden.dtype. w_down: (E, Dm, I) hidden.dtype.
        block_m: M tile of the routing (any value >= 1 gives the same result).
    Returns:
        (T, Dm) hidden.dtype: ``sum_a topk_weights[t, a] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, fp32 inside.
    Reference of: ops/moe.py::moe_experts (its CPU path).
    """
    t, a = topk_ids.shape
    sorted_ids, block_expert = moe_align_ref(topk_ids, w_gate.shape[0], block_m)
    act = grouped_gate_up_ref(hidden, sorted_ids, block_expert, w_gate, w_up, a, block_m)
    pairs = grouped_down_ref(act, sorted_ids, block_expert, w_down, topk_weights, block_m)
    return pairs.view(t, a, -1).sum(1).to(hidden.dtype)


def moe_experts_loop_ref(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The oracle: a plain loop over experts, as gpt-fast's ``ConditionalFeedForward`` and HF's eager experts.

    Args:
        hidden: (T, Dm) float. topk_ids: (T, A) int. topk_weights: (T, A) float.
        w_gate, w_up: (E, I, Dm). w_down: (E, Dm, I).
    Returns:
        (T, Dm) hidden.dtype, computed in fp64 on the inputs' values (the golden result for error bounds).
    Source: gpt-fast ``mixtral-moe/model.py`` and transformers ``MixtralExperts.forward`` (the eager loop).
    """
    x = hidden.double()
    out = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        token, slot = torch.where(topk_ids == e)
        if token.numel() == 0:
            continue
        xe = x[token]
        h = F.silu(xe @ w_gate[e].double().T) * (xe @ w_up[e].double().T)
        y = h @ w_down[e].double().T
        out.index_add_(0, token, y * topk_weights[token, slot, None].double())
    return out.to(hidden.dtype)
