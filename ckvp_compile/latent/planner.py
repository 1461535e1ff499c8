"""Rank and bits per (group, KV head, K/V): a byte budget spent where it removes the most error.

Transform coding (the reverse water-filling of rate-distortion theory): the latent coordinates of a unit (group
g, KV head h, K or V) are its principal components, with variances ``lambda_1 >= lambda_2 >= ...`` (the
calibration spectrum). Storing coordinate i costs bits and leaves an error; dropping it costs nothing and leaves
``lambda_i``. The planner splits every unit's coordinates into blocks of ``block`` consecutive components and
gives each block 0 (dropped), 2, 4 or 8 bits per coordinate, so that the total bytes per token meet the budget
and the summed, trace-normalised expected error is small:

* cost of a block kept at b bits, per token: ``n*b/8`` code bytes, 4 bytes of fp16 scale and minimum (2 of e4m3
  span and minimum with ``meta_f8``), and the block's share of the bases (``n * G*D * basis_itemsize /
  tokens_sharing_the_bases``);
* expected error of a block kept at b bits: ``n * E[step^2] / 12`` with ``step = (max - min) / (2^b - 1)`` over
  the block's coordinates of one token (the per-token asymmetric quantizer of
  :mod:`ckvp_compile.kernels.latent_format`), estimated by Monte Carlo for Gaussian coordinates of the
  block's variances; dropped: ``sum(lambda)``. Errors are divided by the unit's trace, as the 'energy' rank
  allocation does, so that large-norm layers do not take the whole budget.
* greedy: repeatedly apply the upgrade (a block from its bits to a higher one) with the largest error removed
  per byte, while it fits. Blocks are upgraded in any order, so a unit ends with high bits on its leading
  components, fewer bits on the next ones, and the tail dropped.

Two other error models replace the Gaussian one (same greedy, same costs):

* ``error_scales`` (:mod:`~ckvp_compile.latent.attention_noise`): per-coordinate factors on the quantization
  error and drop errors of the values, from the calibration's attention weights (token-independent value noise
  reaches the attention output scaled by ``sum_s p_s^2``; truncation measured at the output);
* ``block_errors`` (:func:`measured_block_errors`): every block's errors *measured* as the model's KL divergence
  to dense on calibration windows, one unit at a time (e.g. ``ckvp-bench fidelity --allocations
  planned+rot+fp8+measured``). On the fixture at 16x the Gaussian model put the first group's keys at 2 bits and
  spent the bytes on 2-bit value tails (+5.8% perplexity); the measured model keeps every key block at 4 bits
  (+2.6%; benchmarks/results/2026-11-29-ckvp-fidelity-16x).

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
from typing import Any, Callable, Sequence

import torch

from ..errors import CKVPConfigError
from .rotation import rotate_basis_blocks

__all__ = ["BIT_CHOICES", "measured_block_errors", "plan_bits", "plan_for_byte_ratio"]

#: Bits per coordinate a block may get (0 = dropped).
BIT_CHOICES = (0, 2, 4, 8)


def _block_errors(eig: torch.Tensor, block: int, samples: int, generator: torch.Generator,
                  weight: torch.Tensor | None = None, rotate: bool = False, noise: torch.Tensor | None = None,
                  drop: torch.Tensor | None = None, meta_f8: bool = False) -> list[dict[int, float]]:
    """Per block of ``eig`` (descending variances): expected squared error at each of BIT_CHOICES, each
    coordinate's error times its ``weight`` (1 without weights). ``rotate``: the block's coordinates are rotated
    by :func:`~ckvp_compile.latent.rotation.block_rotation` before quantization (the range is then that of the
    rotated coordinates; the error stays isotropic within the block, so the weighting is unchanged).
    ``noise``: per coordinate, a factor on its quantization error (the attention's averaging of token-independent
    noise, :mod:`~ckvp_compile.latent.attention_noise`; 1 without). ``drop``: per coordinate, the error of
    dropping it (default ``eig``). ``meta_f8``: the block's minimum and span are rounded to e4m3 as an ``-f8``
    format stores them (:func:`~ckvp_compile.kernels.latent_format.f8_block_range`). A kept block never costs more
    than dropping it."""
    from ..kernels.latent_format import f8_block_range
    from .rotation import block_rotation

    out = []
    for start in range(0, eig.numel(), block):
        lam = eig[start:start + block].double().clamp_min(0)
        w = torch.ones_like(lam) if weight is None else weight[start:start + block].double().clamp_min(0)
        nz = torch.ones_like(lam) if noise is None else noise[start:start + block].double().clamp_min(0)
        lost = lam if drop is None else drop[start:start + block].double().clamp_min(0)
        z = torch.randn(samples, lam.numel(), generator=generator, dtype=torch.float64) * lam.sqrt()
        if rotate:
            z = z @ block_rotation(lam.numel())
        if meta_f8:
            span = f8_block_range(z.amin(dim=1).float(), z.amax(dim=1).float())[1].double() ** 2
        else:
            span = (z.amax(dim=1) - z.amin(dim=1)) ** 2
        errs = {0: float((lost * w).sum())}
        for b in BIT_CHOICES[1:]:
            errs[b] = min(errs[0], float(span.mean()) / (12 * ((1 << b) - 1) ** 2) * float((w * nz).sum()))
        out.append(errs)
    return out


def _checked_errors(block_errors: dict, kind: str, g: int, h: int, rows: int, block: int) -> list[dict[int, float]]:
    """One unit's measured block errors, checked (one dict per block with every bits of BIT_CHOICES), each kept
    block's error capped at its dropped error (a kept block never costs more than dropping it)."""
    errs = block_errors.get((kind, g, h))
    nb = -(-rows // block)
    if errs is None or len(errs) != nb or any(set(e) != set(BIT_CHOICES) for e in errs):
        raise CKVPConfigError(f"block_errors[({kind!r}, {g}, {h})] must hold {nb} dicts {{bits: error}} for bits "
                              f"{list(BIT_CHOICES)} (one per block of {block} components)")
    return [{b: (float(e[0]) if b == 0 else min(float(e[0]), float(e[b]))) for b in BIT_CHOICES} for e in errs]


def measured_block_errors(bases: Any, measure: Callable[[str, int, int, int, dict[int, int], int], float], *,
                          block: int = 32, v_block: int | None = None,
                          progress: Callable[[str], None] | None = None) -> dict[tuple[str, int, int], list[dict[int, float]]]:
    """A measured error model for :func:`plan_bits` (``block_errors``): each unit's blocks, dropped or quantized,
    measured one unit at a time through ``measure``.

    With ``T(n)`` the error when only unit u is kept at rank ``n`` blocks with exact latents (``T(0)``: its K or
    V removed) and ``Q_i(b)`` the error when only unit u is at full rank with block i quantized to b bits (the
    rest exact), block i's errors are ``{0: T(i) - T(i+1), b: Q_i(b) - T(NB)}`` (clamped at 0): the error added
    by dropping it after the blocks before it, and by quantizing it. The planner sums them over blocks and units,
    which assumes the errors add: on the fixture the KL of all eight units compressed together was within 1% of
    the sum of their one-unit KLs (0.0968 vs 0.0973 nats/token), and the per-block sums predicted the measured
    KL of 440 whole-unit plans within 10% (median; 0.5x to 1.6x at the extremes, where the KL is tiny).
    ``NB + 1 + 3 * NB`` measurements per unit.

    Args:
        bases: full-rank :class:`~ckvp_compile.latent.LatentBases` (``moments.bases(1.0)``).
        measure: ``measure(kind, g, h, rank, {block index: bits}, block)`` -> the error (one unit for every
            unit, e.g. KL divergence to the dense model in nats per token) when only unit (kind, g, h) is
            compressed: its first ``rank`` principal components, the listed blocks of ``block`` components
            quantized (rotated per block when the plan will be), the others exact.
        block, v_block: the planner's blocks for K and V (``v_block`` default ``block``).
        progress: called with a line per unit measured.
    Returns:
        ``{(kind, g, h): [{bits: error} per block]}`` for :func:`plan_bits` (``block_errors``).
    Source: greedy bit allocation over an arbitrary set of quantizers with measured distortions (Shoham and
    Gersho 1988, "Efficient bit allocation for an arbitrary set of quantizers"); measured per-layer sensitivity of
    KV-cache precision on calibration data (KVTuner, Li et al. 2025, arXiv:2502.04420).
    """
    blocks = {"k": block, "v": block if v_block is None else v_block}
    out = {}
    for kind in ("k", "v"):
        b = blocks[kind]
        for g, layers in enumerate(bases.groups):
            rows = len(layers) * bases.head_dim
            nb = -(-rows // b)
            for h in range(bases.num_kv_heads):
                trunc = [float(measure(kind, g, h, min(n * b, rows), {}, b)) for n in range(nb + 1)]
                errs = []
                for i in range(nb):
                    e = {0: max(0.0, trunc[i] - trunc[i + 1])}
                    for bits in BIT_CHOICES[1:]:
                        e[bits] = max(0.0, float(measure(kind, g, h, rows, {i: bits}, b)) - trunc[nb])
                    errs.append(e)
                out[(kind, g, h)] = errs
                if progress is not None:
                    progress(f"measured {kind.upper()} group {g} head {h}: {nb} blocks")
    return out


def plan_bits(bases: Any, bytes_per_token: float, *, block: int = 32, tokens_sharing_bases: int = 2048,
              basis_itemsize: int = 2, samples: int = 512, seed: int = 0,
              weights: dict[str, Sequence[torch.Tensor]] | None = None, rotate: bool = False,
              error_scales: dict[str, Sequence[dict[str, torch.Tensor]]] | None = None,
              v_block: int | None = None,
              block_errors: dict[tuple[str, int, int], Sequence[dict[int, float]]] | None = None,
              meta_f8: bool = False) -> Any:
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
            the error model then measures the rotated block. Recorded as ``rotation="hadamard/<block>"``
            (``"hadamard/<block>,v<v_block>"`` when the value block differs).
        error_scales: optional per-coordinate error model of a kind (``"k"`` and / or ``"v"``), per group a dict
            with ``"noise"`` (Hkv, N): a factor on each principal component's quantization error, and optionally
            ``"drop"`` (Hkv, N): its error when dropped (default: its eigenvalue), e.g.
            :func:`~ckvp_compile.latent.attention_noise.value_error_scales` (the attention averages token-independent
            value noise over ``1 / sum p^2`` tokens). A unit's errors are then normalised by the sum of its
            (weighted) drop errors.
        v_block: coordinates per quantization block of the values (default ``block``; keys use ``block``).
        block_errors: optional *measured* error model replacing the Gaussian one: per unit ``(kind, g, h)``, per
            block of its principal components (``block`` / ``v_block`` coordinates, in order), ``{bits: error}``
            for every bits in :data:`BIT_CHOICES` (0: the block dropped), in one unit common to every unit (e.g.
            KL divergence to the dense model, nats per token, :func:`measured_block_errors`); errors are then not
            normalised per unit. ``weights`` and ``error_scales`` do not apply. See :func:`measured_block_errors`.
        meta_f8: plan ``mix/<block>-f8`` formats: e4m3 block spans and minimums, 2 bytes a block instead of 4
            (:mod:`~ckvp_compile.kernels.latent_format`); the Gaussian error model rounds them as stored, and
            ``block_errors`` must have been measured with them.
    Returns:
        :class:`~ckvp_compile.latent.LatentBases` with the planned ranks (the bases truncated, zero beyond each
        head's rank), ``rank_allocation="planned"`` and the ``mix/{block}[-f8]:...`` formats per group.
    Raises:
        CKVPConfigError: the bases are not full rank, or the budget cannot keep one block per unit at 2 bits.
    """
    v_block = block if v_block is None else v_block
    for name, b in (("block", block), ("v_block", v_block)):
        if b < 8 or b % 8:
            raise CKVPConfigError(f"{name} must be a positive multiple of 8, got {b}")
    blocks = {"k": block, "v": v_block}
    hkv, d = bases.num_kv_heads, bases.head_dim
    gen = torch.Generator().manual_seed(seed)
    units = []  # (kind, g, h, trace, rows, block errors)
    if block_errors is not None and (weights is not None or error_scales is not None):
        raise CKVPConfigError("block_errors (a measured error model) cannot be combined with weights or error_scales")
    for kind in ("k", "v"):
        scales = (error_scales or {}).get(kind)
        if scales is not None and len(scales) != len(bases.groups):
            raise CKVPConfigError(f"error_scales[{kind!r}] has {len(scales)} groups, the bases {len(bases.groups)}")
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
                noise = drop = None
                if scales is not None:
                    noise = scales[g]["noise"][h].cpu()
                    drop = scales[g]["drop"][h].cpu() if "drop" in scales[g] else None
                    if noise.shape != eig.shape or (drop is not None and drop.shape != eig.shape):
                        raise CKVPConfigError(f"error_scales[{kind!r}][{g}] must hold (Hkv, {eig.numel()}) tensors")
                if block_errors is not None:
                    units.append((kind, g, h, 1.0, rows, _checked_errors(block_errors, kind, g, h, rows,
                                                                        blocks[kind])))
                    continue
                lost = (eig if drop is None else drop).double().clamp_min(0)
                trace = float((lost * (1 if w is None else w)).sum()) or 1.0
                units.append((kind, g, h, trace, rows,
                              _block_errors(eig, blocks[kind], samples, gen, w, rotate, noise, drop, meta_f8)))

    def sizes(u: int) -> list[int]:
        rows, b = units[u][4], blocks[units[u][0]]
        return [min(b, rows - s) for s in range(0, rows, b)]

    meta = 2 if meta_f8 else 4  # bytes of a block's scale (span) and minimum

    def cost(u: int, i: int, bits: int) -> float:
        if bits == 0:
            return 0.0
        n = sizes(u)[i]
        return n * bits / 8 + meta + n * units[u][4] * basis_itemsize / tokens_sharing_bases

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

    low = BIT_CHOICES[1]
    for u in range(len(units)):  # every unit keeps its first block at the fewest bits (2) at least
        spent += cost(u, 0, low)
        state[u][0] = low
    if spent > bytes_per_token:
        what = f"{block}" if v_block == block else f"{block} (K) / {v_block} (V)"
        raise CKVPConfigError(f"a budget of {bytes_per_token:.1f} bytes per token cannot keep one block of {what} "
                              f"coordinates at {low} bits in each of the {len(units)} (group, head, K/V) units "
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
    return _planned_bases(bases, units, state, sizes, blocks, rotate, meta_f8)


def _planned_bases(bases: Any, units: Sequence, state: Sequence[list[int]], sizes: Any, blocks: dict[str, int],
                   rotate: bool = False, meta_f8: bool = False) -> Any:
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
            basis.append(rotate_basis_blocks(kept, r, blocks[kind]) if rotate else kept)
            ranks.append(tuple(r))
            formats.append(f"mix/{blocks[kind]}{'-f8' if meta_f8 else ''}:" + ",".join("+".join(f"{b}x{c}" for b, c in segs) for segs in heads))
        new[f"{kind}_basis"], new[f"{kind}_ranks"], new[f"{kind}_formats"] = tuple(basis), tuple(ranks), tuple(formats)
    rotation = ""
    if rotate:
        rotation = f"hadamard/{blocks['k']}" + (f",v{blocks['v']}" if blocks["v"] != blocks["k"] else "")
    return dataclasses.replace(bases, rank_allocation="planned", rotation=rotation, **new)


def plan_for_byte_ratio(full_bases: Any, kv_ratio: float, *, batch_size: int = 1, max_cache_len: int = 4096,
                        block: int = 32, dense_dtype: torch.dtype = torch.bfloat16,
                        latent_dtype: torch.dtype = torch.bfloat16, iterations: int = 8, refine: int = 6,
                        weights: dict[str, Sequence[torch.Tensor]] | None = None, rotate: bool = False,
                        basis_dtype: torch.dtype | None = None, residual_format: str = "",
                        error_scales: dict[str, Sequence[dict[str, torch.Tensor]]] | None = None,
                        v_block: int | None = None,
                        block_errors: dict[tuple[str, int, int], Sequence[dict[int, float]]] | None = None,
                        recent_window: int = 0, meta_f8: bool = False) -> Any:
    """:func:`plan_bits` at the budget that makes a store of these sequences hold ``kv_ratio`` times fewer bytes
    than a dense ``dense_dtype`` cache, counted as :func:`~ckvp_compile.latent.budget.store_bytes` counts them
    (latent rows with scales, slot positions, and the bases in ``latent_dtype`` padded to each group's largest
    rank). The budget is tightened until the measured ratio meets ``kv_ratio``, then (``refine`` bisection steps
    between the last budget that held too much and the first that fits) raised as far as the ratio allows: the
    planner spreads the bases' bytes over each group's heads, the store pads them to its largest rank. ``rotate``:
    as :func:`plan_bits`.
    ``basis_dtype``: the dtype the store keeps the bases in (default ``latent_dtype``; e.g.
    ``torch.float8_e4m3fn`` halves their bytes), counted at its size. ``residual_format``: the ALR-KVD residual's
    format (e.g. ``"int2/64"``), whose bytes come off the budget first (the plan's error model ignores it).
    ``error_scales``, ``v_block``, ``block_errors``, ``meta_f8``: as :func:`plan_bits`. ``recent_window``: the store's dense
    recent window (tokens), whose bytes also come off the budget first
    (:func:`~ckvp_compile.latent.budget.window_bytes`).

    Raises:
        CKVPConfigError: as :func:`plan_bits`, or the ratio is not met after ``iterations`` re-plans.
    """
    from .budget import dense_kv_bytes, store_bytes, window_bytes

    tokens = batch_size * max_cache_len
    dense = dense_kv_bytes(full_bases, batch_size, max_cache_len, dense_dtype)
    item = torch.empty((), dtype=basis_dtype or latent_dtype).element_size()
    resid = (store_bytes(full_bases, 1, 1, "float", "float", latent_dtype, with_bases=False,
                         residual_format=residual_format)
             - store_bytes(full_bases, 1, 1, "float", "float", latent_dtype, with_bases=False))
    window = window_bytes(full_bases, batch_size, recent_window, latent_dtype) / tokens
    budget = dense / kv_ratio / tokens - 4 - resid - window  # per token: minus slot position, residual, window

    def attempt(per_token: float) -> tuple[Any, int]:
        planned = plan_bits(full_bases, per_token, block=block, tokens_sharing_bases=tokens, basis_itemsize=item,
                            weights=weights, rotate=rotate, error_scales=error_scales, v_block=v_block,
                            block_errors=block_errors, meta_f8=meta_f8)
        planned = dataclasses.replace(planned, target_ratio=float(kv_ratio))
        return planned, store_bytes(planned, batch_size, max_cache_len, "auto", "auto", latent_dtype,
                                    basis_dtype=basis_dtype, residual_format=residual_format,
                                    recent_window=recent_window)

    too_much = None  # the smallest budget whose plan held too many bytes
    for i in range(iterations):
        planned, held = attempt(budget)
        if dense / held >= kv_ratio:
            break
        too_much = budget
        # the plan moves in whole blocks, so a shrink by the byte excess alone can leave it unchanged: the margin
        # doubles with each miss (0.1%, 0.2%, 0.4%, ..., at most 50%); the bisection below gives back what it
        # overshoots
        budget *= dense / held / kv_ratio * (1 - min(0.001 * 2**i, 0.5))
    else:
        raise CKVPConfigError(f"could not plan a byte ratio of {kv_ratio:g} (last {dense / held:.3f})")
    # the planner's cost spreads the bases over the heads; the store pads them to each group's largest rank, so a
    # plan can hold more than its budget: the shrink above may overshoot, and a bisection between the last budget
    # that held too much and the one that fits recovers the bytes (the ratio is still met)
    lo = budget
    for _ in range(refine if too_much is not None else 0):
        mid = (lo + too_much) / 2
        cand, cand_held = attempt(mid)
        if dense / cand_held >= kv_ratio:
            lo = mid
            if cand_held > held:
                planned, held = cand, cand_held
        else:
            too_much = mid
    return planned
