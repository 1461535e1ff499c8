"""Rank and bits per (group, KV head, K/V): a byte budget spent where it removes the most error.

Transform coding (the reverse water-filling of rate-distortion theory): the latent coordinates of a unit (group
g, KV head h, K or V) are its principal components, with variances ``lambda_1 >= lambda_2 >= ...`` (the
calibration spectrum). Storing coordinate i costs bits and leaves an error; dropping it costs nothing and leaves
``lambda_i``. The planner splits every unit's coordinates into blocks of ``block`` consecutive components and
gives each block 0 (dropped), 2, 4 or 8 bits per coordinate, so that the total bytes per token meet the budget
and the summed, trace-normalised expected error is small:

* cost of a block kept at b bits, per token: ``n*b/8`` code bytes, 4 bytes of fp16 scale and minimum, and the
  block's share of the bases (``n * G*D * basis_itemsize / tokens_sharing_the_bases``);
* expected error of a block kept at b bits: ``n * E[step^2] / 12`` with ``step = (max - min) / (2^b - 1)`` over
  the block's coordinates of one token (the per-token asymmetric quantizer of
  :mod:`ckvp_compile.kernels.latent_format`), estimated by Monte Carlo for Gaussian coordinates of the
  block's variances; dropped: ``sum(lambda)``. Errors are divided by the unit's trace, as the 'energy' rank
  allocation does, so that large-norm layers do not take the whole budget.
* greedy: repeatedly apply the upgrade (a block from its bits to a higher one) with the largest error removed
  per byte, while it fits. Blocks are upgraded in any order, so a unit ends with high bits on its leading
  components, fewer bits on the next ones, and the tail dropped.

The result is a :class:`~ckvp_compile.latent.LatentBases` whose ranks are the kept coordinates, with the bit
plan of every group as ``mix/...`` formats in ``k_formats`` / ``v_formats`` (a cache built with
``latent_format="auto"`` uses them; :meth:`LatentBases.save` keeps them).

Sources: KIVI (Liu et al. 2024) for asymmetric per-block quantization of KV; Palu (Chang et al. 2024) and xKV
(Chang et al. 2025) for low-rank KV; classical bit allocation (Huang and Schultheiss 1963; Gersho and Gray,
"Vector Quantization and Signal Compression", ch. 8).
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any, Sequence

import torch

from ..errors import CKVPConfigError
from .rotation import rotate_basis_blocks

__all__ = ["BIT_CHOICES", "plan_bits", "plan_for_byte_ratio"]

#: Bits per coordinate a block may get (0 = dropped).
BIT_CHOICES = (0, 2, 4, 8)


def _block_errors(eig: torch.Tensor, block: int, samples: int, generator: torch.Generator,
                  weight: torch.Tensor | None = None, rotate: bool = False) -> list[dict[int, float]]:
    """Per block of ``eig`` (descending variances): expected squared error at each of BIT_CHOICES, each
    coordinate's error times its ``weight`` (1 without weights). ``rotate``: the block's coordinates are rotated
    by :func:`~ckvp_compile.latent.rotation.block_rotation` before quantization (the range is then that of the
    rotated coordinates; the error stays isotropic within the block, so the weighting is unchanged)."""
    from .rotation import block_rotation

    out = []
    for start in range(0, eig.numel(), block):
        lam = eig[start:start + block].double().clamp_min(0)
        w = torch.ones_like(lam) if weight is None else weight[start:start + block].double().clamp_min(0)
        z = torch.randn(samples, lam.numel(), generator=generator, dtype=torch.float64) * lam.sqrt()
        if rotate:
            z = z @ block_rotation(lam.numel())
        span = (z.amax(dim=1) - z.amin(dim=1)) ** 2
        errs = {0: float((lam * w).sum())}
        for b in BIT_CHOICES[1:]:
            errs[b] = min(errs[0], float(span.mean()) / (12 * ((1 << b) - 1) ** 2) * float(w.sum()))
        out.append(errs)
    return out


def plan_bits(bases: Any, bytes_per_token: float, *, block: int = 32, tokens_sharing_bases: int = 2048,
              basis_itemsize: int = 2, samples: int = 512, seed: int = 0,
              weights: dict[str, Sequence[torch.Tensor]] | None = None, rotate: bool = False) -> Any:
    """Choose rank and bits per (group, KV head, K/V) for a byte budget (see the module docstring).

    Args:
        bases: full-rank :class:`~ckvp_compile.latent.LatentBases` (``kv_ratio=1``: every eigenvector and
            eigenvalue), e.g. ``moments.bases(1.0)``.
        bytes_per_token: the budget: latent bytes per token of one sequence, all groups, K and V (scales
            included; slot positions not), plus the bases' share.
        block: coordinates per quantization block (a multiple of 8).
        tokens_sharing_bases: batch x cache length the bases are shared by (their bytes are spread over
            these tokens); a large number makes the bases free.
        basis_itemsize: bytes per basis element on the device (2 for bf16).
        samples, seed: Monte Carlo samples per block for the error model, and their seed.
        weights: optional ``{"k": [...], "v": [...]}``, per group a (Hkv, G*D, G*D) PSD matrix W of the error
            measure ``e^T W e`` (e.g. :meth:`KVMoments.weights`: the query energy for keys, ``W_o^T W_o`` for
            values); each principal component i is weighted by ``p_i^T W p_i``, and a unit's errors are
            normalised by its weighted trace.
        rotate: rotate every kept block of ``block`` basis columns by an orthonormal flat matrix
            (:mod:`~ckvp_compile.latent.rotation`), so each quantization block holds equal-variance coordinates;
            the error model then measures the rotated block. Recorded as ``rotation="hadamard/<block>"``.
    Returns:
        :class:`~ckvp_compile.latent.LatentBases` with the planned ranks (the bases truncated, zero beyond each
        head's rank), ``rank_allocation="planned"`` and the ``mix/{block}:...`` formats per group.
    Raises:
        CKVPConfigError: the bases are not full rank, or the budget cannot keep one block per unit at 2 bits.
    """
    if block < 8 or block % 8:
        raise CKVPConfigError(f"block must be a positive multiple of 8, got {block}")
    hkv, d = bases.num_kv_heads, bases.head_dim
    gen = torch.Generator().manual_seed(seed)
    units = []  # (kind, g, h, trace, rows, block errors)
    for kind in ("k", "v"):
        for g, layers in enumerate(bases.groups):
            rows = len(layers) * d
            if any(r != rows for r in bases.ranks(kind)[g]):
                raise CKVPConfigError("plan_bits needs full-rank bases (calibrate / moments.bases with kv_ratio=1)")
            for h in range(hkv):
                eig = bases.eigenvalues(kind)[g][h].detach().cpu()
                w = None
                if weights is not None:
                    p = bases.basis(kind)[g][h].detach().cpu().double()
                    w = torch.einsum("ni,nm,mi->i", p, weights[kind][g][h].cpu().double(), p)
                trace = float((eig.double() * (1 if w is None else w)).sum()) or 1.0
                units.append((kind, g, h, trace, rows, _block_errors(eig, block, samples, gen, w, rotate)))

    def sizes(u: int) -> list[int]:
        rows = units[u][4]
        return [min(block, rows - s) for s in range(0, rows, block)]

    def cost(u: int, i: int, bits: int) -> float:
        if bits == 0:
            return 0.0
        n = sizes(u)[i]
        return n * bits / 8 + 4 + n * units[u][4] * basis_itemsize / tokens_sharing_bases

    state = [[0] * len(u[5]) for u in units]
    spent = 0.0
    heap: list[tuple[float, int, int, int]] = []

    def push(u: int, i: int) -> None:
        if i >= len(state[u]) or (i > 0 and state[u][i - 1] == 0):
            return  # kept coordinates stay a prefix of the components
        cur = state[u][i]
        errs, trace = units[u][5][i], units[u][3]
        best = None
        for b in BIT_CHOICES:
            if b <= cur:
                continue
            gain = (errs[cur] - errs[b]) / trace
            extra = cost(u, i, b) - cost(u, i, cur)
            if extra > 0 and (best is None or gain / extra > best[0]):
                best = (gain / extra, b)
        if best is not None and best[0] > 0:
            heapq.heappush(heap, (-best[0], u, i, best[1]))

    for u in range(len(units)):  # every unit keeps its first block at 2 bits at least
        spent += cost(u, 0, 2)
        state[u][0] = 2
    if spent > bytes_per_token:
        raise CKVPConfigError(f"a budget of {bytes_per_token:.1f} bytes per token cannot keep one block of {block} "
                              f"coordinates at 2 bits in each of the {len(units)} (group, head, K/V) units "
                              f"({spent:.1f} bytes); lower kv_ratio or use a smaller block")
    for u in range(len(units)):
        push(u, 0)
        push(u, 1)
    while heap:
        _, u, i, b = heapq.heappop(heap)
        extra = cost(u, i, b) - cost(u, i, state[u][i])
        if state[u][i] >= b or spent + extra > bytes_per_token:
            continue
        spent += extra
        was = state[u][i]
        state[u][i] = b
        push(u, i)
        if was == 0:
            push(u, i + 1)
    return _planned_bases(bases, units, state, sizes, block, rotate)


def _planned_bases(bases: Any, units: Sequence, state: Sequence[list[int]], sizes: Any, block: int,
                   rotate: bool = False) -> Any:
    """LatentBases truncated to the kept coordinates (blocks reordered by nothing: kept blocks keep their order,
    dropped blocks inside a unit's kept range are not allowed, so a dropped block ends the unit's rank)."""
    plans: dict[tuple[str, int], list[list[tuple[int, int]]]] = {}
    for u, (kind, g, h, *_rest) in enumerate(units):
        segs: list[tuple[int, int]] = []
        for i, bits in enumerate(state[u]):
            if bits == 0:
                break  # the kept coordinates are a prefix of the components
            n = sizes(u)[i]
            if segs and segs[-1][0] == bits:
                segs[-1] = (bits, segs[-1][1] + n)
            else:
                segs.append((bits, n))
        plans.setdefault((kind, g), []).append(segs)
    new: dict[str, Any] = {}
    for kind in ("k", "v"):
        basis, ranks, formats = [], [], []
        for g in range(len(bases.groups)):
            heads = plans[(kind, g)]
            r = [sum(c for _, c in segs) for segs in heads]
            full = bases.basis(kind)[g]
            rmax = max(r)
            keep = torch.arange(rmax, device=full.device)[None, :] < torch.tensor(r, device=full.device)[:, None]
            kept = full[:, :, :rmax] * keep[:, None, :].to(full.dtype)
            basis.append(rotate_basis_blocks(kept, r, block) if rotate else kept)
            ranks.append(tuple(r))
            formats.append(f"mix/{block}:" + ",".join("+".join(f"{b}x{c}" for b, c in segs) for segs in heads))
        new[f"{kind}_basis"], new[f"{kind}_ranks"], new[f"{kind}_formats"] = tuple(basis), tuple(ranks), tuple(formats)
    return dataclasses.replace(bases, rank_allocation="planned", rotation=f"hadamard/{block}" if rotate else "",
                               **new)


def plan_for_byte_ratio(full_bases: Any, kv_ratio: float, *, batch_size: int = 1, max_cache_len: int = 4096,
                        block: int = 32, dense_dtype: torch.dtype = torch.bfloat16,
                        latent_dtype: torch.dtype = torch.bfloat16, iterations: int = 8,
                        weights: dict[str, Sequence[torch.Tensor]] | None = None, rotate: bool = False,
                        basis_dtype: torch.dtype | None = None, residual_format: str = "") -> Any:
    """:func:`plan_bits` at the budget that makes a store of these sequences hold ``kv_ratio`` times fewer bytes
    than a dense ``dense_dtype`` cache, counted as :func:`~ckvp_compile.latent.budget.store_bytes` counts them
    (latent rows with scales, slot positions, and the bases in ``latent_dtype`` padded to each group's largest
    rank). The budget is tightened until the measured ratio meets ``kv_ratio``. ``rotate``: as :func:`plan_bits`.
    ``basis_dtype``: the dtype the store keeps the bases in (default ``latent_dtype``; e.g.
    ``torch.float8_e4m3fn`` halves their bytes), counted at its size. ``residual_format``: the ALR-KVD residual's
    format (e.g. ``"int2/64"``), whose bytes come off the budget first (the plan's error model ignores it).

    Raises:
        CKVPConfigError: as :func:`plan_bits`, or the ratio is not met after ``iterations`` re-plans.
    """
    from .budget import dense_kv_bytes, store_bytes

    tokens = batch_size * max_cache_len
    dense = dense_kv_bytes(full_bases, batch_size, max_cache_len, dense_dtype)
    item = torch.empty((), dtype=basis_dtype or latent_dtype).element_size()
    resid = (store_bytes(full_bases, 1, 1, "float", "float", latent_dtype, with_bases=False,
                         residual_format=residual_format)
             - store_bytes(full_bases, 1, 1, "float", "float", latent_dtype, with_bases=False))
    budget = dense / kv_ratio / tokens - 4 - resid  # per token, minus the int32 slot position and the residual
    for _ in range(iterations):
        planned = plan_bits(full_bases, budget, block=block, tokens_sharing_bases=tokens, basis_itemsize=item,
                            weights=weights, rotate=rotate)
        planned = dataclasses.replace(planned, target_ratio=float(kv_ratio))
        held = store_bytes(planned, batch_size, max_cache_len, "auto", "auto", latent_dtype, basis_dtype=basis_dtype,
                           residual_format=residual_format)
        if dense / held >= kv_ratio:
            return planned
        budget *= dense / held / kv_ratio * 0.999
    raise CKVPConfigError(f"could not plan a byte ratio of {kv_ratio:g} (last {dense / held:.3f})")
