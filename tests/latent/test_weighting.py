"""Weighted (output-aware / query-aware) orthonormal latent bases: fast checks of the math."""

import torch

from ckvp_compile.latent.weighting import (key_query_weight, value_output_weight, weighted_objective,
                                           weighted_projection_basis, weighted_spectrum)


def _psd(n: int, seed: int, m: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, m or n, generator=g, dtype=torch.float64) * torch.logspace(0, -2, m or n, dtype=torch.float64)
    return a @ a.T / (m or n)


def test_weighted_basis_is_orthonormal_and_beats_pca() -> None:
    C, S = _psd(32, 0), _psd(32, 1)
    P = weighted_projection_basis(C, S, 8)
    assert P.shape == (32, 8)
    torch.testing.assert_close(P.T @ P, torch.eye(8, dtype=torch.float64), atol=1e-10, rtol=0)
    pca = torch.linalg.eigh(C).eigenvectors.flip(-1)[:, :8]
    assert float(weighted_objective(C, S, P)) <= float(weighted_objective(C, S, pca)) * (1 - 1e-3)
    # the oblique optimum (sum of discarded weighted eigenvalues) is a lower bound
    assert float(weighted_objective(C, S, P)) >= float(weighted_spectrum(C, S)[8:].sum()) * (1 - 1e-9)


def test_identity_weight_gives_pca() -> None:
    C = _psd(24, 2)
    P = weighted_projection_basis(C, 3.0 * torch.eye(24, dtype=torch.float64), 6)
    pca = torch.linalg.eigh(C).eigenvectors.flip(-1)[:, :6]
    torch.testing.assert_close(P @ P.T, pca @ pca.T, atol=1e-8, rtol=0)
    torch.testing.assert_close(weighted_spectrum(C, torch.eye(24, dtype=torch.float64)),
                               torch.linalg.eigvalsh(C).flip(-1), atol=1e-10, rtol=0)


def test_full_rank_is_identity() -> None:
    C, S = _psd(8, 3), _psd(8, 4)
    P = weighted_projection_basis(C, S, 8)
    assert float(weighted_objective(C, S, P)) < 1e-12


def test_value_output_weight_matches_definition() -> None:
    g = torch.Generator().manual_seed(5)
    H, Hkv, D, hidden = 4, 2, 3, 7
    w = torch.randn(hidden, H * D, generator=g, dtype=torch.float64)
    S = value_output_weight(w, H, Hkv)
    for h in range(Hkv):
        ref = sum(w[:, j * D:(j + 1) * D].T @ w[:, j * D:(j + 1) * D] for j in (2 * h, 2 * h + 1))
        torch.testing.assert_close(S[h], ref)
    # ||W_o[:, head block] dv||^2 summed over the KV head's query heads equals dv^T S dv
    dv = torch.randn(D, generator=g, dtype=torch.float64)
    direct = sum(float((w[:, j * D:(j + 1) * D] @ dv).square().sum()) for j in (0, 1))
    assert abs(direct - float(dv @ S[0] @ dv)) < 1e-9


def test_key_query_weight_is_rope_pair_average() -> None:
    q = torch.tensor([[1.0, 2.0, 3.0, 5.0], [0.0, 0.0, 4.0, 0.0]], dtype=torch.float64)  # H=2, D=4
    S = key_query_weight(q, 1, "rotate_half")  # pairs (0, 2), (1, 3), both heads summed, / D
    torch.testing.assert_close(torch.diagonal(S[0]), torch.tensor([4.0, 3.5, 4.0, 3.5], dtype=torch.float64) / 4)
    S = key_query_weight(q, 2, "interleaved")  # pairs (0, 1), (2, 3) per head
    torch.testing.assert_close(torch.diagonal(S[1]), torch.tensor([0.0, 0.0, 2.0, 2.0], dtype=torch.float64) / 4)
    # rotation invariance: the averaged weight of a rotated query's pairs is unchanged
    theta = torch.tensor(0.7, dtype=torch.float64)
    x = torch.tensor([1.0, 2.0, -1.0, 0.5], dtype=torch.float64)
    rot = torch.stack([x[0] * theta.cos() - x[2] * theta.sin(), x[1], x[0] * theta.sin() + x[2] * theta.cos(), x[3]])
    torch.testing.assert_close(key_query_weight((x * x)[None], 1), key_query_weight((rot * rot)[None], 1))


def test_build_latent_bases_weighted_keeps_ranks_and_orthonormality() -> None:
    from ckvp_compile.latent import build_latent_bases

    d, hkv, groups = 4, 2, ((0, 1),)
    k = [torch.stack([_psd(8, 10 + h, 40) * 40 for h in range(hkv)])]
    v = [torch.stack([_psd(8, 20 + h, 40) * 40 for h in range(hkv)])]
    w = [torch.stack([_psd(8, 30 + h) for h in range(hkv)])]
    kw = dict(num_kv_heads=hkv, head_dim=d, group_size=2, target_ratio=4.0, rank_allocation="uniform",
              model_fingerprint={})
    plain = build_latent_bases(groups, k, v, 40, **kw)
    weighted = build_latent_bases(groups, k, v, 40, k_weights=w, v_weights=w, **kw)
    assert weighted.k_ranks == plain.k_ranks and weighted.v_ranks == plain.v_ranks
    assert weighted.ratio() >= 4.0 and weighted.latent_elements_per_token() == 8
    for h in range(hkv):
        P = weighted.k_basis[0][h].double()
        torch.testing.assert_close(P.T @ P, torch.eye(P.shape[1], dtype=torch.float64), atol=1e-6, rtol=0)
        C = k[0][h] / 40
        assert float(weighted_objective(C, w[0][h], P)) <= float(weighted_objective(C, w[0][h],
                                                                                   plain.k_basis[0][h].double())) + 1e-9
