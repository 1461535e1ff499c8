"""Random latent bases for store and kernel tests: no calibration, no model.

:func:`random_orthonormal_bases` builds a :class:`~ckvp_compile.latent.bases.LatentBases` whose every KV head of
every layer group has ``rank`` random orthonormal columns (QR of a seeded Gaussian), the same basis for keys and
values, and flat eigenvalues. Tests use it where only the store's shapes, bytes and bookkeeping matter.
"""

from __future__ import annotations

import torch

from ..latent.bases import LatentBases


def random_orthonormal_bases(layers: int = 2, group: int = 2, hkv: int = 2, d: int = 8, rank: int = 4, *,
                             target_ratio: float = 2.0, online: bool = False, seed: int = 0) -> LatentBases:
    """Latent bases with random orthonormal columns.

    Args:
        layers: decoder layers covered; grouped ``group`` at a time (the last group may be shorter).
        group: layers per latent group (the CKVP group size G).
        hkv: KV heads per layer.
        d: head dimension.
        rank: latent coordinates per KV head and group, for keys and values alike; at most ``group * d``.
        target_ratio: recorded as the bases' ``target_ratio`` (not enforced).
        online: mark the bases as per-sequence (online) bases.
        seed: seed of the CPU generator.

    Returns:
        ``LatentBases`` with fp32 bases of shape ``(hkv, len(g) * d, rank)`` per group ``g`` and float64
        eigenvalues of ones, ``(hkv, len(g) * d)``.

    Raises:
        ValueError: if ``rank`` exceeds ``group * d`` (QR cannot give more orthonormal columns than rows).
    """
    if rank > group * d:
        raise ValueError(f"rank {rank} exceeds group * d = {group * d}: lower the rank or widen the group")
    gen = torch.Generator().manual_seed(seed)
    groups = tuple(tuple(range(i, min(i + group, layers))) for i in range(0, layers, group))
    basis = tuple(torch.linalg.qr(torch.randn(hkv, len(g) * d, rank, generator=gen))[0] for g in groups)
    ranks = tuple((rank,) * hkv for _ in groups)
    eig = tuple(torch.ones(hkv, len(g) * d, dtype=torch.float64) for g in groups)
    return LatentBases(groups=groups, num_kv_heads=hkv, head_dim=d, group_size=group, target_ratio=target_ratio,
                       rank_allocation="uniform", k_basis=basis, v_basis=basis, k_ranks=ranks, v_ranks=ranks,
                       k_eigenvalues=eig, v_eigenvalues=eig, model_fingerprint={}, num_tokens=1, online=online)
