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

Source: the stacked cross-layer spectrum is xKV's (Chang et al. 2025, "xKV: Cross-Layer SVD for KV-Cache
Compression", arXiv:2503.18893); Palu (Chang et al. 2024, arXiv:2407.21118)
searches ranks per layer group by Fisher information. The trace-normalised greedy rule is ours (DESIGN.md).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Literal, Sequence

import torch

__all__ = ["RANK_ALLOCATIONS", "RankAllocation", "allocate_ranks", "rank_budget", "retained_fraction"]

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


def allocate_ranks(spectra: Sequence[torch.Tensor], budget: int, mode: RankAllocation = "energy",
                   unit_weights: Sequence[float] | None = None) -> list[int]:
    """Choose one rank per unit so that the ranks sum to at most ``budget`` (see the module docstring).

    Args:
        spectra: per unit, (N_u,) eigenvalues, descending and >= 0; N_u is the unit's largest rank (G_g*D).
        budget: latent elements per token, ``len(spectra) <= budget <= sum(N_u)``.
        mode: "energy" (greedy on trace-normalised eigenvalues; spends the budget exactly) or "uniform" (one
            rank r for all, ``min(r, N_u)`` per unit, the largest r that fits) or "entropy" ("energy" with
            each unit's normalised eigenvalues times ``unit_weights[u]``).
        unit_weights: per unit, > 0 (required for "entropy").
    Returns:
        Ranks, one per unit, each in 1..N_u. Ties in "energy" go to the earlier unit, lower index first, so
        the result is deterministic.
    Raises:
        ValueError: budget outside ``[len(spectra), sum(N_u)]`` or an unknown mode (callers validate first and
            raise CKVPConfigError with the achievable range).
    """
    caps = [int(s.numel()) for s in spectra]
    if not len(spectra) <= budget <= sum(caps):
        raise ValueError(f"budget must be in [{len(spectra)}, {sum(caps)}], but got {budget}")
    if mode == "uniform":
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
        values.append(tail)
        owners.append(torch.full((tail.numel(),), u, dtype=torch.long))
    values_t, owners_t = torch.cat(values), torch.cat(owners)
    # Stable sort: among equal values the earlier unit / lower index wins, so each unit's picks are a prefix.
    order = torch.sort(values_t, descending=True, stable=True).indices[: budget - len(spectra)]
    extra = torch.bincount(owners_t[order], minlength=len(spectra))
    return [1 + int(e) for e in extra]
