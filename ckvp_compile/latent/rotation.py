"""Block rotations of a latent basis: equal-variance coordinates inside every quantization block, for free.

A latent block of ``n`` consecutive principal components has variances ``lambda_1 >= ... >= lambda_n``. The
per-token block quantizer of :mod:`ckvp_compile.kernels.latent_format` spends the same bits on each coordinate
of the block, with a step set by the block's range, which the leading component dominates: the small-variance
coordinates use a sliver of the code range. Rotating the block's basis columns by an orthonormal ``n x n``
matrix ``Q`` with flat entries (``|Q_ij| ~ 1/sqrt(n)``) gives every new coordinate the variance
``mean(lambda)`` and spreads outliers over the block; the basis stays orthonormal and spans the same subspace,
so projection (``z = P^T x``), reconstruction (``P z``), the storage format, the store and the attention kernels
are unchanged: only the numbers in the basis move.

``Q`` is the normalised Sylvester-Hadamard matrix when ``n`` is a power of two, else the orthonormal DCT-II
(whose entries are all at most ``sqrt(2/n)``).

Sources: incoherence processing / Hadamard rotation before quantization (QuIP#, Tseng et al. 2024; QuaRot,
Ashkboos et al. 2024; SpinQuant, Liu et al. 2024), here applied per latent block of a PCA basis.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch

__all__ = ["block_rotation", "rotate_basis_blocks"]


@functools.lru_cache(maxsize=64)
def _rotation_f64(n: int) -> torch.Tensor:
    if n & (n - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return h / math.sqrt(n)
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    c = torch.cos(math.pi * (i + 0.5) * k / n) * math.sqrt(2.0 / n)
    c[0] /= math.sqrt(2.0)
    return c.T.contiguous()


def block_rotation(n: int) -> torch.Tensor:
    """Return an orthonormal (n, n) float64 matrix with flat entries (Hadamard for powers of two, else DCT-II).

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"a block rotation needs n >= 1, got {n}")
    return _rotation_f64(int(n)).clone()


def rotate_basis_blocks(basis: torch.Tensor, ranks: Sequence[int], block: int) -> torch.Tensor:
    """Rotate each head's kept basis columns in consecutive blocks of ``block`` (the last one may be shorter).

    Args:
        basis: (Hkv, N, R_max) float, head h's columns ``:ranks[h]`` kept (zero beyond).
        ranks: Hkv ints, each <= R_max.
        block: columns per rotated block (the latent format's quantization block, so that every block the
            quantizer sees is one rotated block).
    Returns:
        (Hkv, N, R_max) basis.dtype: columns ``a:a+n`` of head h replaced by ``basis[h, :, a:a+n] @ Q_n``
        (:func:`block_rotation`), computed in float64; zero columns stay zero. Still orthonormal.
    Raises:
        ValueError: ``block < 1``, or ``ranks`` do not match the basis.
    """
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if len(ranks) != basis.shape[0] or any(r > basis.shape[-1] or r < 0 for r in ranks):
        raise ValueError(f"ranks {list(ranks)} do not fit a basis of shape {tuple(basis.shape)}")
    out = basis.detach().double().clone()
    for h, r in enumerate(ranks):
        for a in range(0, int(r), block):
            n = min(block, int(r) - a)
            out[h, :, a:a + n] = out[h, :, a:a + n] @ block_rotation(n).to(out.device)
    return out.to(basis.dtype)
