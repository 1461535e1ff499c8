"""Online latent bases: ranks fixed up front, bases fitted per sequence from its own prompt.

    bases = ckvp_compile.latent.online_bases(model, group_size=4, kv_ratio=4)
    cache = CKVPStaticCache(model.config, bases, max_cache_len=32768, latent_format="int8")

No calibration data is needed. At each sequence's prefill (the first compiled call of the sequence, which must
hold at least two tokens) the backend fits, for every layer group and KV head, the top-``r`` eigenvectors of the
prompt's stacked pre-RoPE keys (``key_space="post_rope"``: the keys as cached, after RoPE, so that decode scores
them with no RoPE rebuild, as calibrated post-RoPE bases do) and of its values, ``ckvp::online_basis_fit``, as xKV
does per prompt; later chunks and decode steps project onto that basis. The bases are per-sequence state
(B x Hkv x G*D x r per group and kind), counted in :meth:`~ckvp_compile.runtime.store.LatentKVStore.nbytes` with
the latents, so they pay off only at contexts much longer than G*D tokens. Not built: refreshing the basis during decode.

Source: xKV (Chang et al. 2025, arXiv:2503.18893), per-prompt cross-layer SVD.
"""

from __future__ import annotations

import math

import torch

from ..errors import CKVPConfigError
from .bases import LatentBases, check_target_ratio, key_space_error, model_fingerprint

__all__ = ["online_bases"]


def online_bases(model: torch.nn.Module, group_size: int = 4, kv_ratio: float = 4.0,
                 key_space: str = "pre_rope") -> LatentBases:
    """Return :class:`LatentBases` with ``online=True``: groups and uniform ranks, no fitted bases.

    Args:
        model: a Hugging Face causal LM or a gpt-fast style model (its config gives L, Hkv and D).
        group_size: G, layers per group (1, 2, 4 or 8); a last group may be shorter.
        kv_ratio: dense / latent elements per token (rho >= 1): every (group, head, K/V) keeps
            ``floor(G_g*D / rho)`` (at least 1) latent coordinates. The per-sequence bases are extra bytes.
        key_space: 'pre_rope' (default: RoPE re-applied at decode) or 'post_rope' (the key bases are fitted to the
            keys as cached; :attr:`LatentBases.key_space`).
    Returns:
        LatentBases whose basis tensors are zero placeholders (Hkv, G_g*D, r) and whose eigenvalues are zero.
    Raises:
        CKVPConfigError: the model's config has no layer count, KV heads or head dim, or a bad
            group_size / kv_ratio / key_space.
    """
    if key_space_error(key_space):
        raise CKVPConfigError(key_space_error(key_space))
    if group_size not in (1, 2, 4, 8):
        raise CKVPConfigError(f"group_size must be one of 1, 2, 4, 8, got {group_size!r}")
    fp = model_fingerprint(model)
    layers, hkv, d = fp.get("num_layers"), fp.get("num_kv_heads") or fp.get("num_heads"), fp.get("head_dim")
    if not (layers and hkv and d):
        raise CKVPConfigError("online_bases needs the model's config to give its layer count, KV heads and head dim "
                              f"(found num_layers={layers}, num_kv_heads={hkv}, head_dim={d}); calibrate() instead")
    groups = tuple(tuple(range(i, min(i + group_size, layers))) for i in range(0, layers, group_size))
    if isinstance(kv_ratio, bool) or not isinstance(kv_ratio, (int, float)):
        raise CKVPConfigError(f"kv_ratio must be a number >= 1, got {kv_ratio!r}")
    check_target_ratio(kv_ratio, layers * hkv * d * 2, 2 * len(groups) * hkv)
    ranks = tuple(tuple(max(1, math.floor(len(g) * d / kv_ratio)) for _ in range(hkv)) for g in groups)
    def zeros() -> tuple[torch.Tensor, ...]:  # K and V get their own tensors (safetensors refuses shared ones)
        return tuple(torch.zeros(hkv, len(g) * d, r[0]) for g, r in zip(groups, ranks))

    def eig() -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(hkv, len(g) * d, dtype=torch.float64) for g in groups)

    return LatentBases(groups=groups, num_kv_heads=hkv, head_dim=d, group_size=group_size, target_ratio=kv_ratio,
                       rank_allocation="uniform", k_basis=zeros(), v_basis=zeros(), k_ranks=ranks, v_ranks=ranks,
                       k_eigenvalues=eig(), v_eigenvalues=eig(), model_fingerprint=fp, num_tokens=0, online=True,
                       key_space=key_space)
