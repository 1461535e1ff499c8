"""ALR-KVD residual: what the (quantized) low-rank latent misses, stored per element at 2 bits; pure PyTorch.

The latent of group g, KV head h stores ``z_t = Q(P^T x_t)`` (``Q`` the latent format's quantizer, see
:mod:`ckvp_compile.kernels.latent_format`); the *residual* is the rest of the stacked pre-RoPE keys (or values),
``e_t = x_t - P dequant(z_t)`` in R^(G*D), stored with its own per-block scales in a quantized format (default
``"int2/64"``: 2-bit asymmetric codes, an fp16 scale and minimum per 64 elements). Layer j's key is then rebuilt as
``RoPE(P_j z_t + e_t[j*D:(j+1)*D])``; values likewise without RoPE. So the reconstruction error is the residual's
quantization error alone (at most half a step per element), whatever the rank.

Residual row layout (per token): the latent-format row of ``G_g * Hkv`` segments of D elements, segment
``j * Hkv + h`` = layer j, KV head h (:func:`residual_offsets`); e.g. ``int2/64`` with D = 64 takes
``G*Hkv*(16 + 4)`` bytes per token. A dense residual costs 2 bits per cached element plus its scales whatever
the rank: it caps the KV ratio below 16 / 2.5 = 6.4x (int2/64 against a 16-bit cache), so it is an option for
ratios of about 4x, where it removes most of the low-rank error.

Source: ALR-KVD (adaptive low-rank + residual KV decomposition) as DESIGN.md states it; the residual-quantization
idea follows GEAR (Kang et al., 2024: quantization + low-rank of the residual) with the roles swapped (low rank
first, the residual quantized), and KIVI's (Liu et al., 2024) asymmetric per-block quantizer.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .latent_format import dequantize_latent_ref, parse_latent_format, quantize_latent_ref

__all__ = ["latent_reconstruct_residual_ref", "residual_append_ref", "residual_offsets"]


def residual_offsets(group_layers: int, num_kv_heads: int, head_dim: int) -> list[int]:
    """Return the ``G_g*Hkv + 1`` segment offsets of a residual row (segment ``j*Hkv + h``, D elements each)."""
    return [i * head_dim for i in range(group_layers * num_kv_heads + 1)]


def residual_append_ref(resid: torch.Tensor, latent: torch.Tensor, x: torch.Tensor, basis: torch.Tensor,
                        offsets: Sequence[int], slots: torch.Tensor, fmt: str, resid_fmt: str,
                        group_layers: int) -> None:
    """Write the residual of the new tokens, after their latent rows were written (``latent_append_ref``).

    Args:
        resid: (B, S_max, W) uint8, W = the row width of ``resid_fmt`` over :func:`residual_offsets`; mutated at
            ``resid[:, slots]``.
        latent: (B, S_max, R_tot) float or (B, S_max, row_bytes) uint8, already holding the new tokens' rows.
        x: (B, Hkv, S, G*D) float, the group's stacked new pre-RoPE keys (or values), layer-major.
        basis: (Hkv, G*D, R_max) float (or (B, Hkv, G*D, R_max) per sequence), the basis the latent was made with.
        offsets: Hkv+1 ints of the latent. slots: (S,) int, the new tokens' slots.
        fmt: the latent's format. resid_fmt: the residual's quantized format (e.g. ``"int2/64"``).
        group_layers: G_g, layers in the group (D = G*D / G_g).
    Returns:
        None; ``resid[:, slots]`` = quantized ``x - P dequant(latent[:, slots])`` in the layout above.
    Raises:
        ValueError: ``resid_fmt`` is not a quantized format.
    """
    from .reference import unpack_latent_ref

    rf = parse_latent_format(resid_fmt)
    if not rf.quantized:
        raise ValueError(f"the residual format must be quantized (e.g. 'int2/64'), got {resid_fmt!r}")
    b, hkv, s, gd = x.shape
    idx = slots.long()
    z = unpack_latent_ref(latent[:, idx], offsets, basis.shape[-1], fmt)  # (B, Hkv, S, R_max)
    eq = "bhsr,bhnr->bhsn" if basis.dim() == 4 else "bhsr,hnr->bhsn"
    err = x.float() - torch.einsum(eq, z, basis.float())  # (B, Hkv, S, G*D)
    d = gd // group_layers
    rows = err.view(b, hkv, s, group_layers, d).permute(0, 2, 3, 1, 4).reshape(b, s, gd * hkv)  # segment j*Hkv+h
    resid[:, idx] = quantize_latent_ref(rows, residual_offsets(group_layers, hkv, d), rf)


def latent_reconstruct_residual_ref(latent: torch.Tensor, basis_block: torch.Tensor, offsets: Sequence[int],
                                    cos_table: torch.Tensor, sin_table: torch.Tensor, slot_pos: torch.Tensor,
                                    rope_form: str, rotary_dim: int, new: torch.Tensor, slots: torch.Tensor,
                                    fmt: str, resid: torch.Tensor, layer: int, group_layers: int,
                                    resid_fmt: str) -> torch.Tensor:
    """As :func:`~ckvp_compile.kernels.reference.latent_reconstruct_ref`, with layer ``layer``'s residual added
    before RoPE.

    Args:
        latent .. fmt: as ``latent_reconstruct_ref`` (basis_block: (Hkv, D, R_max), this layer's rows).
        resid: (B, S_max, W) uint8, the group's residual rows (:func:`residual_append_ref`).
        layer: j, this layer's position in its group (0 <= j < group_layers).
        group_layers: G_g, layers in the group.
        resid_fmt: the residual's format.
    Returns:
        (B, Hkv, S_max, D) new.dtype: ``RoPE(P_j z + e_j)`` per head and slot, slots ``slots`` replaced by ``new``.
    """
    from .reference import apply_rope_ref, exact_slots, unpack_latent_ref

    b, s_max = latent.shape[0], latent.shape[1]
    hkv, d = basis_block.shape[-3], basis_block.shape[-2]
    z = unpack_latent_ref(latent, offsets, basis_block.shape[-1], fmt)
    pre = torch.einsum("bhtr,bhdr->bhtd" if basis_block.dim() == 4 else "bhtr,hdr->bhtd", z, basis_block.float())
    e = dequantize_latent_ref(resid, residual_offsets(group_layers, hkv, d), resid_fmt)
    pre = pre + e.view(b, s_max, group_layers, hkv, d)[:, :, layer].permute(0, 2, 1, 3)
    if rope_form != "none":
        pos = slot_pos.long()
        pre = apply_rope_ref(pre, cos_table.float()[pos][:, None], sin_table.float()[pos][:, None], rope_form,
                             rotary_dim)
    _, idx, _ = exact_slots(slots, pre.shape[2])  # -1: an unused entry (a recent window not full yet)
    pre = torch.cat((pre, pre.new_zeros(*pre.shape[:2], 1, pre.shape[3])), 2)
    pre[:, :, idx] = new.float()
    return pre[:, :, :-1].to(new.dtype)
