"""Output-aware (weighted) orthonormal bases for the cross-layer latent.

The runtime rebuilds a stacked key (value) ``x`` in R^N, N = G_g*D, as the orthogonal projection ``P P^T x`` with
``P`` (N, r) orthonormal in the ORIGINAL coordinates (DESIGN.md, "CKVP in numbers"); plain PCA minimises the
unweighted error ``E||x - P P^T x||^2``. What the model sees is not that error but a linear image of it: for a
value, the attention output error of layer l is ``W_o,l (v_l - v_hat_l)`` (Palu, Chang et al. 2024,
arXiv:2407.21118, and SVD-LLM, Wang et al. 2024, arXiv:2403.07378, whiten by the input/output statistics for
the same reason); for a key the score error is ``q . RoPE(k - k_hat)``. With a symmetric PSD weight ``S``
(block-diagonal over the group's layers) the objective becomes

    f(P) = E||S^(1/2) (I - P P^T) x||^2 = tr(S (I - Q) C (I - Q)),   Q = P P^T,  C = E[x x^T].

Because ``Q`` must stay an orthogonal projection, the minimiser is NOT the top-r eigenvectors of
``S^(1/2) C S^(1/2)`` (those are optimal only for an oblique reconstruction ``S^(-1/2) U U^T S^(1/2)``, which the
runtime cannot apply); when ``S`` and ``C`` commute (e.g. ``S = I``) it is PCA. :func:`weighted_projection_basis`
minimises ``f`` on the Grassmann manifold (Riemannian gradient descent, QR retraction, backtracking; Edelman,
Arias and Smith 1998, "The geometry of algorithms with orthogonality constraints", SIAM J. Matrix Anal. Appl.
20(2)), started from the better of PCA and the top-r eigenvectors of ``(S C + C S)/2``, so it never does worse
than PCA on the calibration moments. The eigenvalues of ``S^(1/2) C S^(1/2)`` (:func:`weighted_spectrum`) are
the error of the best oblique rank-r reconstruction: a lower bound on ``f`` used as the rank-allocation proxy.

Weights (:func:`value_output_weight`, :func:`key_query_weight`):

* values: ``S_l = sum over the query heads j sharing KV head h of W_o[:, j]^T W_o[:, j]`` (D x D), where
  ``W_o[:, j]`` are the output projection's columns of query head j: the squared norm of the output error of
  one token's value error (attention weights sum to one; cross-head correlations dropped);
* keys: the score error ``q_t . R_(t) dk_s`` with RoPE rotations R; averaged over relative positions, the
  cross-frequency terms of ``R^T q q^T R`` cancel and each rotated pair (i, i + D/2 in the rotate_half form)
  keeps its isotropic energy: ``S_l = diag over pairs of (E q_i^2 + E q_(i+D/2)^2) / 2``, summed over the
  query heads of KV head h and divided by D (the softmax scale 1/sqrt(D), squared). The pair energy is
  invariant under RoPE, so it can be read from pre- or post-RoPE queries alike (RoFormer, Su et al. 2021,
  arXiv:2104.09864; query-aware key compression as in Loki, Singhania et al. 2024, arXiv:2406.02542).
"""

from __future__ import annotations

import torch

__all__ = ["key_query_weight", "value_output_weight", "weighted_objective", "weighted_projection_basis",
           "weighted_spectrum"]


def weighted_objective(C: torch.Tensor, S: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """``tr(S (I - P P^T) C (I - P P^T))`` for (N, N) C, S and (N, r) orthonormal P (float64 scalar)."""
    E = torch.eye(C.shape[-1], dtype=C.dtype, device=C.device) - P @ P.mT
    return ((S @ E) * (C @ E).mT).sum()


def _psd_sqrt(S: torch.Tensor) -> torch.Tensor:
    w, U = torch.linalg.eigh(S)
    return (U * w.clamp_min(0).sqrt()) @ U.mT


def weighted_spectrum(C: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """Eigenvalues of ``S^(1/2) C S^(1/2)``, descending, >= 0: ``sum(lambda[r:])`` is the weighted error of the
    best rank-r (oblique) reconstruction, a lower bound on :func:`weighted_objective` at rank r."""
    R = _psd_sqrt(S)
    return torch.linalg.eigvalsh(R @ C @ R).flip(-1).clamp_min(0)


def _top(M: torch.Tensor, r: int) -> torch.Tensor:
    w, U = torch.linalg.eigh((M + M.mT) / 2)
    return U.flip(-1)[:, :r].contiguous()


def weighted_projection_basis(C: torch.Tensor, S: torch.Tensor, r: int, *, iters: int = 300,
                              tol: float = 1e-10) -> torch.Tensor:
    """Orthonormal (N, r) P minimising ``tr(S (I - PP^T) C (I - PP^T))`` (see the module docstring).

    Args:
        C: (N, N) second moment, symmetric PSD. S: (N, N) weight, symmetric PSD. r: rank, 1..N.
        iters: at most this many gradient steps. tol: stop when the relative decrease of a step is below it.
    Returns:
        P, float64, orthonormal columns ordered by decreasing weighted captured energy ``diag(P^T S C P)``,
        signs fixed (largest-magnitude entry positive). ``f(P) <= f(PCA basis)`` always; S = c*I gives PCA.
    """
    # small (N <= a few hundred) LAPACK calls: one thread is faster and avoids oversubscription stalls
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _solve(C.double(), S.double(), r, iters, tol)
    finally:
        torch.set_num_threads(threads)


def _solve(C: torch.Tensor, S: torch.Tensor, r: int, iters: int, tol: float) -> torch.Tensor:
    n = C.shape[-1]
    eye = torch.eye(n, dtype=C.dtype, device=C.device)
    if r >= n:
        return eye
    cands = [_top(C, r), _top(S @ C + C @ S, r)]
    vals = [float(weighted_objective(C, S, p)) for p in cands]
    P = cands[int(torch.tensor(vals).argmin())]
    f = min(vals)
    step = 1.0 / max(float(torch.linalg.matrix_norm(C, 2) * torch.linalg.matrix_norm(S, 2)), 1e-300)
    for _ in range(iters):
        E = eye - P @ P.mT
        M = C @ E @ S + S @ E @ C
        D = E @ (M @ P)  # minus half the Riemannian gradient
        if float(D.norm()) == 0:
            break
        while True:
            Pn = torch.linalg.qr(P + step * D).Q
            fn = float(weighted_objective(C, S, Pn))
            if fn <= f or step < 1e-30:
                break
            step *= 0.5
        if fn > f:
            break
        done = f - fn <= tol * max(abs(f), 1e-300)
        P, f, step = Pn, fn, step * 1.5
        if done:
            break
    # order the columns by weighted captured energy inside span(P) (a rotation: f unchanged)
    w, U = torch.linalg.eigh(P.mT @ ((S @ C + C @ S) / 2) @ P)
    P = P @ U.flip(-1)
    idx = P.abs().argmax(dim=0, keepdim=True)
    sign = torch.sign(torch.gather(P, 0, idx))
    return P * torch.where(sign == 0, torch.ones_like(sign), sign)


def value_output_weight(w_o: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Per KV head, ``sum_j W_o[:, j]^T W_o[:, j]`` over its query heads j: (Hkv, D, D) float64.

    Args:
        w_o: (hidden, H*D) output projection weight (``nn.Linear`` layout), query head j in columns j*D:(j+1)*D.
        num_heads, num_kv_heads: H and Hkv (query heads h*H/Hkv .. (h+1)*H/Hkv - 1 share KV head h).
    """
    w = w_o.detach().double()
    d = w.shape[1] // num_heads
    blocks = w.view(w.shape[0], num_heads, d).permute(1, 2, 0)  # (H, D, hidden)
    per_head = blocks @ blocks.mT  # (H, D, D)
    return per_head.view(num_kv_heads, num_heads // num_kv_heads, d, d).sum(1)


def key_query_weight(q_moment: torch.Tensor, num_kv_heads: int, form: str = "rotate_half") -> torch.Tensor:
    """Rotation-averaged query weight per KV head: (Hkv, D, D) float64, diagonal (see the module docstring).

    Args:
        q_moment: (H, D) mean squared query channel ``E[q_i^2]`` per query head (pre- or post-RoPE), or
            (H, D, D) second moments (their diagonal is used).
        num_kv_heads: Hkv. form: 'rotate_half' (pairs i, i+D/2) or 'interleaved' / 'complex' (pairs 2i, 2i+1).
    """
    q = q_moment.double()
    if q.dim() == 3:
        q = torch.diagonal(q, dim1=-2, dim2=-1)
    h, d = q.shape
    if form == "rotate_half":
        pair = (q[:, : d // 2] + q[:, d // 2:]) / 2
        diag = torch.cat([pair, pair], dim=-1)
    else:
        pair = (q[:, 0::2] + q[:, 1::2]) / 2
        diag = pair.repeat_interleave(2, dim=-1)
    diag = diag.view(num_kv_heads, h // num_kv_heads, d).sum(1) / d
    return torch.diag_embed(diag)
