"""Per-(group, head, K/V) ranks of the cross-layer latent under one budget of latent elements per token.

Notation (DESIGN.md, "CKVP in numbers"): a *unit* u is one (group g, KV head h, kind K or V); its spectrum
lambda_u (length G_g*D, descending) holds the eigenvalues of the uncentered second moment of the stacked
pre-RoPE keys (or values) of the group's layers. Keeping rank r_u costs r_u latent elements per token and
discards ``sum(lambda_u[r_u:])`` of energy.

* budget: ``floor(dense / rho)`` latent elements per token for a target ratio rho, where dense = L*Hkv*D*2 is
  what the dense cache stores per token; so the measured ratio ``dense / sum(r_u)`` is >= rho, never below.
* ``"energy"``: maximise the sum over units of the retained *fraction* ``sum(lambda_u[:r_u]) / trace_u`` (each
  unit's energy normalised by its trace, so large-norm layers do not take the whole budget), with r_u >= 1.
  Because every spectrum is sorted, the greedy choice (take the largest remaining normalised eigenvalue
  anywhere, repeatedly) is optimal, and it spends the budget exactly.
* ``"uniform"``: the same rank r everywhere (capped at each unit's G_g*D), the largest r whose total fits.
* ``"entropy"``: as ``"energy"``, with each unit's normalised eigenvalues multiplied by its weight, the mean
  normalised attention entropy of the unit's heads (``H / log(context)``, in [0, 1]) measured at calibration:
  heads that attend sharply to a few tokens get low rank, broad heads high (the ALR-KVD heuristic).
* ``rank_block`` b > 1 (any mode): a unit keeps rank 1, a multiple of ``min(8, b)`` up to b, or a multiple of b
  (or its full G_g*D). For a quantized latent whose block is b, a head past rank b then fills whole quantization
  blocks, and the heads' codes start on aligned bytes of the latent row (4-byte steps at int4 below the block),
  so the decode kernel loads them as vectors: on the H200
  a batch-8, 32k call at int4/32 took 1.46 ms at rank 100 against 1.20 at rank 96 (32:8 heads), and 1.17 ms at
  rank 63 against 0.77 at rank 64 (16:16; benchmarks/results/2026-12-01-rank-blocks-h200). The greedy then
  takes steps between allowed ranks by their energy per coordinate and may leave fewer than b elements of the
  budget unspent.

Source: the stacked cross-layer spectrum is xKV's (Chang et al. 2025, "xKV: Cross-Layer SVD for KV-Cache
Compression", arXiv:2503.18893); Palu (Chang et al. 2024, arXiv:2407.21118)
searches ranks per layer group by Fisher information. The trace-normalised greedy rule is ours (DESIGN.md).
"""

from __future__ import annotations

import bisect
import math
from fractions import Fraction
from typing import Literal, Sequence

import torch

__all__ = ["RANK_ALLOCATIONS", "RankAllocation", "allocate_ranks", "key_rank_caps", "max_key_rank_error",
           "rank_block_error", "rank_budget", "rank_steps", "retained_fraction"]

RankAllocation = Literal["energy", "uniform", "entropy"]
#: Valid values of ``rank_allocation``.
RANK_ALLOCATIONS: tuple[str, ...] = ("energy", "uniform", "entropy")


def rank_budget(dense_elements: int, target_ratio: float) -> int:
    """Return ``floor(dense_elements / target_ratio)``, computed exactly (no float rounding).

    Args:
        dense_elements: elements per token the dense cache stores (> 0).
        target_ratio: rho >= 1, a finite float or int.
    Returns:
        The largest integer budget b with ``dense_elements / b >= target_ratio``.
    """
    return math.floor(Fraction(dense_elements) / Fraction(target_ratio))


def retained_fraction(eigenvalues: torch.Tensor, rank: int) -> float:
    """Return ``sum(eigenvalues[:rank]) / sum(eigenvalues)`` (1.0 when the trace is 0).

    Args:
        eigenvalues: (N,) descending, >= 0 (any float dtype).
        rank: kept directions, 0..N.
    """
    total = float(eigenvalues.sum())
    return float(eigenvalues[:rank].sum()) / total if total > 0 else 1.0


def rank_block_error(rank_block: object) -> str | None:
    """Why ``rank_block`` is not a valid block of ranks (an int >= 1), naming the fix, or None."""
    if isinstance(rank_block, bool) or not isinstance(rank_block, int) or rank_block < 1:
        return (f"rank_block must be an int >= 1 (1: any rank; e.g. 32, the int4 format's quantization block), "
                f"got {rank_block!r}")
    return None


def max_key_rank_error(max_key_rank: object) -> str | None:
    """Why ``max_key_rank`` is not a valid cap on the key ranks (None, or an int >= 1), naming the fix, or None."""
    if max_key_rank is None:
        return None
    if isinstance(max_key_rank, bool) or not isinstance(max_key_rank, int) or max_key_rank < 1:
        return (f"max_key_rank must be None (no cap) or an int >= 1, e.g. 64 (keys of at most 64 coordinates per KV "
                f"head and layer group), got {max_key_rank!r}")
    return None


def key_rank_caps(spectra: Sequence[torch.Tensor], num_key_units: int, max_key_rank: int | None,
                  budget: int, rank_block: int = 1) -> tuple[list[int] | None, int]:
    """``allocate_ranks``' ``max_ranks`` for ``spectra`` ((N_u,) eigenvalues each, descending, the K units first) and
    a cap on the first ``num_key_units`` units (the K units) at
    ``max_key_rank`` (rounded down to a whole-block rank, :func:`rank_steps`, with ``rank_block``), and
    ``budget`` lowered to what the capped units can hold in all (a cap can leave a low ratio's budget unspent).
    ``max_key_rank`` None: ``(None, budget)``.

    Why: the decode attention rebuilds (or rotates) keys at their rank padded to a power of two, per KV head,
    several times the work per coordinate of the value pass; capping the key rank and letting
    :func:`allocate_ranks` spend the bytes on values and other units trades fidelity for decode speed at the same
    bytes (e.g. keys 64 and values 128 instead of 96 and 96).

    Raises:
        ValueError: ``max_key_rank`` is not None or an int >= 1.
    Source: ours (DESIGN.md, "Compute floor").
    """
    err = max_key_rank_error(max_key_rank)
    if err:
        raise ValueError(err)
    if max_key_rank is None:
        return None, budget
    caps = [max(r for r in rank_steps(int(s.numel()), rank_block) if r <= max_key_rank) if u < num_key_units
            else int(s.numel()) for u, s in enumerate(spectra)]
    return caps, min(budget, sum(caps))


def rank_steps(n: int, rank_block: int = 1) -> list[int]:
    """The ranks a unit of ``n`` coordinates may keep under ``rank_block`` b (see the module docstring), ascending:
    1, the multiples of ``min(8, b)`` up to b, then the multiples of b, and n; every rank 1..n when b = 1.

    Raises:
        ValueError: ``n < 1`` or ``rank_block`` not an int >= 1.
    Source: ours (DESIGN.md, "Whole-block ranks"), from the H200 timings of misaligned and partial blocks.
    """
    err = rank_block_error(rank_block)
    if err:
        raise ValueError(err)
    if n < 1:
        raise ValueError(f"a unit needs at least one coordinate, got {n}")
    small = min(8, rank_block)
    out = {1, n}
    out.update(r for r in range(small, min(rank_block, n) + 1, small))
    out.update(r for r in range(rank_block, n + 1, rank_block))
    return sorted(r for r in out if r <= n)


def allocate_ranks(spectra: Sequence[torch.Tensor], budget: int, mode: RankAllocation = "energy",
                   unit_weights: Sequence[float] | None = None, rank_block: int = 1,
                   max_ranks: Sequence[int] | None = None) -> list[int]:
    """Choose one rank per unit so that the ranks sum to at most ``budget`` (see the module docstring).

    Args:
        spectra: per unit, (N_u,) eigenvalues, descending and >= 0; N_u is the unit's largest rank (G_g*D).
        budget: latent elements per token, ``len(spectra) <= budget <= sum(N_u)``.
        mode: "energy" (greedy on trace-normalised eigenvalues; spends the budget exactly) or "uniform" (one
            rank r for all, ``min(r, N_u)`` per unit, the largest r that fits) or "entropy" ("energy" with
            each unit's normalised eigenvalues times ``unit_weights[u]``).
        unit_weights: per unit, > 0 (required for "entropy").
        rank_block: b >= 1; above 1 every rank is one of :func:`rank_steps` (whole quantization blocks of b
            coordinates, aligned in the latent row), and the budget may be under-spent by less than a step.
        max_ranks: per unit, the largest rank it may keep (>= 1; :func:`key_rank_caps`); the units' energies stay
            normalised by their whole spectra, so a cap removes options without reweighting the rest.
    Returns:
        Ranks, one per unit, each in 1..min(N_u, max_ranks[u]). Ties in "energy" go to the earlier unit, lower
        index first, so the result is deterministic.
    Raises:
        ValueError: budget outside ``[len(spectra), sum(c_u)]`` (c_u: the unit's largest allowed rank, at most
            ``max_ranks[u]``), an unknown mode, a bad ``rank_block`` or ``max_ranks`` (callers validate first and
            raise CKVPConfigError with the achievable range).
    """
    if max_ranks is not None and (len(max_ranks) != len(spectra) or any(
            isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in max_ranks)):
        raise ValueError(f"max_ranks must hold one int >= 1 per unit ({len(spectra)}), got {max_ranks!r}")
    # a unit's allowed ranks: its steps up to its cap (with whole blocks, the cap rounds down to a step)
    steps = [rank_steps(int(s.numel()), rank_block) for s in spectra]  # validates rank_block
    if max_ranks is not None:
        steps = [[r for r in st if r <= m] for st, m in zip(steps, max_ranks)]
    caps = [st[-1] for st in steps]
    if not len(spectra) <= budget <= sum(caps):
        raise ValueError(f"budget must be in [{len(spectra)}, {sum(caps)}], but got {budget}")
    if rank_block > 1 and mode != "uniform":
        return _allocate_in_steps(spectra, budget, steps, mode, unit_weights)
    if mode == "uniform":
        if rank_block > 1:
            def kept(r: int) -> list[int]:  # each unit's largest allowed rank <= r
                return [st[bisect.bisect_right(st, r) - 1] for st in steps]

            allowed = sorted({r for st in steps for r in st})
            best = 1
            for r in allowed:  # the total kept grows with r: stop at the first that does not fit
                if sum(kept(r)) > budget:
                    break
                best = r
            return kept(best)
        r = 1
        while r < max(caps) and sum(min(r + 1, c) for c in caps) <= budget:
            r += 1
        return [min(r, c) for c in caps]
    if mode not in ("energy", "entropy"):
        raise ValueError(f"rank_allocation must be one of {RANK_ALLOCATIONS}, but got {mode!r}")
    if mode == "entropy" and (unit_weights is None or len(unit_weights) != len(spectra)):
        raise ValueError("rank_allocation 'entropy' needs one weight per unit (the attention entropies)")
    scale = list(unit_weights) if mode == "entropy" else [1.0] * len(spectra)
    values, owners = [], []
    for u, s in enumerate(spectra):
        s = s.detach().to("cpu", torch.float64)
        total = float(s.sum())
        tail = s[1:] / total * scale[u] if total > 0 else torch.zeros(s.numel() - 1, dtype=torch.float64)
        tail = tail[: caps[u] - 1]  # normalised by the whole spectrum, then cut at the cap
        values.append(tail)
        owners.append(torch.full((tail.numel(),), u, dtype=torch.long))
    values_t, owners_t = torch.cat(values), torch.cat(owners)
    # Stable sort: among equal values the earlier unit / lower index wins, so each unit's picks are a prefix.
    order = torch.sort(values_t, descending=True, stable=True).indices[: budget - len(spectra)]
    extra = torch.bincount(owners_t[order], minlength=len(spectra))
    return [1 + int(e) for e in extra]


def _allocate_in_steps(spectra: Sequence[torch.Tensor], budget: int, steps: Sequence[Sequence[int]], mode: str,
                       unit_weights: Sequence[float] | None) -> list[int]:
    """The "energy" / "entropy" greedy over steps between allowed ranks: every unit starts at rank 1; steps are
    taken in descending energy per coordinate while they fit in the budget. A unit's steps must come in order: its
    spectrum is sorted, so their means do not increase, but rounding in the normalised cumulative sums can make a
    later step of a flat stretch look denser, so each step's density is capped by the ones before it (ties go to
    the earlier unit, lower rank first). A unit whose next step does not fit stays where it is: its later steps
    start beyond it."""
    if mode not in ("energy", "entropy"):
        raise ValueError(f"rank_allocation must be one of {RANK_ALLOCATIONS}, but got {mode!r}")
    if mode == "entropy" and (unit_weights is None or len(unit_weights) != len(spectra)):
        raise ValueError("rank_allocation 'entropy' needs one weight per unit (the attention entropies)")
    items = []  # (-density, unit, lo, hi)
    for u, (s, st) in enumerate(zip(spectra, steps)):
        s = s.detach().to("cpu", torch.float64)
        total = float(s.sum())
        w = float(unit_weights[u]) if mode == "entropy" else 1.0
        csum = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(s, 0)]) / total * w if total > 0 \
            else torch.zeros(s.numel() + 1, dtype=torch.float64)
        density = math.inf
        for lo, hi in zip(st[:-1], st[1:]):
            density = min(density, float(csum[hi] - csum[lo]) / (hi - lo))  # non-increasing along the unit
            items.append((-density, u, lo, hi))
    items.sort()  # on (density, unit, lo): a unit's steps in order, also among equal densities
    ranks = [1] * len(spectra)
    left = budget - len(spectra)
    for _, u, lo, hi in items:
        if ranks[u] == lo and hi - lo <= left:
            ranks[u], left = hi, left - (hi - lo)
    return ranks
