"""The two halves of ``ckvp::latent_attention`` as ops of their own: ``latent_scores`` and
``latent_attention_from_scores``.

    ckvp::latent_scores(Tensor q, Tensor latent_k, Tensor basis_k_block, int[] k_offsets, Tensor cos_table,
        Tensor sin_table, Tensor slot_pos, str rope_form, int rotary_dim, Tensor slots, Tensor? attn_mask,
        float scale, SymInt kv_len, str k_fmt="float") -> Tensor                  (B, Hkv, S, G, kv_len) fp32
    ckvp::latent_attention_from_scores(Tensor scores, Tensor q, Tensor latent_v, Tensor basis_v_block,
        int[] v_offsets, Tensor new_k, Tensor new_v, Tensor slots, Tensor? attn_mask, float scale, SymInt kv_len,
        str v_fmt="float") -> Tensor                                               (B, H, S, D) q.dtype

``latent_attention_from_scores(latent_scores(...), ...)`` is ``latent_attention(...)`` (the same math, fp32
rounding apart). The split exists for Inductor: the key pass, where the work is (rebuilding and rotating every
cached key), is lowered to an autotuned ``TritonTemplate`` (:mod:`ckvp_compile.lowering.latent_attention`), while
the value pass and the merge stay one extern call. The scores cost 4 bytes per (slot, query head) of traffic,
written once and read once (3% of an 8-bit rank-256 latent row at 4 query heads per KV head).

Default kernels: the PyTorch references (:func:`ckvp_compile.kernels.reference.latent_scores_ref`,
:func:`~ckvp_compile.kernels.reference.latent_attention_from_scores_ref`); on CUDA the Triton kernels
(:mod:`ckvp_compile.ops.latent_attention_cuda`). Validation: the checks of ``ckvp::latent_attention`` (same
messages), plus the scores' shape.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..kernels import reference as ref
from .latent_kv import _check_latent_attention, _expect_shape, _fail, _shape

__all__ = ["OPS", "latent_attention_from_scores", "latent_scores"]


def _stand_in(q: torch.Tensor, hkv: int, n: Any) -> torch.Tensor:
    """A (B, Hkv, N, D) tensor like the exact keys, for the shared checks (never read; one element, expanded)."""
    b, _, _, d = q.shape
    return q.new_empty(()).expand(b, hkv, n, d)


def _check_scores_args(q, latent_k, basis_k_block, k_offsets, cos_table, sin_table, slot_pos, rope_form, rotary_dim,
                       slots, attn_mask, scale, kv_len, k_fmt) -> None:
    hkv = basis_k_block.shape[-3] if basis_k_block.dim() >= 3 else 1
    nk = _stand_in(q, hkv, slots.shape[0]) if q.dim() == 4 and slots.dim() == 1 else q
    _check_latent_attention(q, latent_k, latent_k, basis_k_block, basis_k_block, k_offsets, k_offsets, cos_table,
                            sin_table, slot_pos, rope_form, rotary_dim, nk, nk, slots, attn_mask, scale, kv_len, k_fmt,
                            k_fmt)


def _check_from_scores_args(scores, q, latent_v, basis_v_block, v_offsets, new_k, new_v, slots, attn_mask, scale,
                            kv_len, v_fmt) -> None:
    _check_latent_attention(q, latent_v, latent_v, basis_v_block, basis_v_block, v_offsets, v_offsets, q, q, q,
                            "none", 0, new_k, new_v, slots, attn_mask, scale, kv_len, v_fmt, v_fmt)
    b, h, s, _ = q.shape
    hkv = new_k.shape[1]
    _expect_shape("latent_attention_from_scores", "scores", scores, (b, hkv, s, h // hkv, kv_len),
                  "(B, Hkv, S, H/Hkv, kv_len) as ckvp::latent_scores returns it")
    if scores.dtype != torch.float32:
        _fail("latent_attention_from_scores", f"scores must be float32 (log2 units), but got {scores.dtype} "
                                              f"{_shape(scores)}")


@torch.library.custom_op(
    "ckvp::latent_scores",
    mutates_args=(),
    schema="(Tensor q, Tensor latent_k, Tensor basis_k_block, int[] k_offsets, Tensor cos_table, Tensor sin_table, "
    "Tensor slot_pos, str rope_form, int rotary_dim, Tensor slots, Tensor? attn_mask, float scale, SymInt kv_len, "
    "str k_fmt=\"float\") -> Tensor",
)
def latent_scores(q: torch.Tensor, latent_k: torch.Tensor, basis_k_block: torch.Tensor, k_offsets: Sequence[int],
                  cos_table: torch.Tensor, sin_table: torch.Tensor, slot_pos: torch.Tensor, rope_form: str,
                  rotary_dim: int, slots: torch.Tensor, attn_mask: torch.Tensor | None, scale: float, kv_len: int,
                  k_fmt: str = "float") -> torch.Tensor:
    """Scores of every query head over latent cache slots [0, kv_len): the key pass of ``ckvp::latent_attention``.

    Args: the key-side arguments of :func:`ckvp_compile.ops.latent_kv.latent_attention` (same shapes and dtypes):
        q (B, H, S, D) float post-RoPE queries, latent_k (B, S_max, Rk_tot) float or uint8 rows of ``k_fmt``,
        basis_k_block (Hkv, D, Rk_max) or per-sequence (B, Hkv, D, Rk_max), k_offsets (Hkv+1 ints), the RoPE
        tables and slot positions, slots (N,) of the exact tokens (-1: unused), attn_mask broadcastable to
        (B, H, S, kv_len),
        scale, kv_len.
    Returns:
        (B, Hkv, S, H/Hkv, kv_len) fp32, contiguous: ``scale * log2(e) * q.k`` plus an additive mask times log2(e)
        (log2 units); ``-inf`` where a bool mask is False and at the exact tokens' ``slots``.
    Raises:
        CKVPShapeError: a shape, dtype, device, RoPE or mask argument does not match.
    Reference: kernels/reference.py::latent_scores_ref
    """
    _check_scores_args(q, latent_k, basis_k_block, k_offsets, cos_table, sin_table, slot_pos, rope_form, rotary_dim,
                       slots, attn_mask, scale, kv_len, k_fmt)
    return ref.latent_scores_ref(q, latent_k, basis_k_block, k_offsets, cos_table, sin_table, slot_pos, rope_form,
                                 rotary_dim, slots, attn_mask, scale, kv_len, k_fmt)


@latent_scores.register_fake
def _(q, latent_k, basis_k_block, k_offsets, cos_table, sin_table, slot_pos, rope_form, rotary_dim, slots, attn_mask,
      scale, kv_len, k_fmt="float"):
    _check_scores_args(q, latent_k, basis_k_block, k_offsets, cos_table, sin_table, slot_pos, rope_form, rotary_dim,
                       slots, attn_mask, scale, kv_len, k_fmt)
    b, h, s, _ = q.shape
    hkv = basis_k_block.shape[-3]
    return q.new_empty((b, hkv, s, h // hkv, kv_len), dtype=torch.float32)


@torch.library.custom_op(
    "ckvp::latent_attention_from_scores",
    mutates_args=(),
    schema="(Tensor scores, Tensor q, Tensor latent_v, Tensor basis_v_block, int[] v_offsets, Tensor new_k, "
    "Tensor new_v, Tensor slots, Tensor? attn_mask, float scale, SymInt kv_len, str v_fmt=\"float\") -> Tensor",
)
def latent_attention_from_scores(scores: torch.Tensor, q: torch.Tensor, latent_v: torch.Tensor,
                                 basis_v_block: torch.Tensor, v_offsets: Sequence[int], new_k: torch.Tensor,
                                 new_v: torch.Tensor, slots: torch.Tensor, attn_mask: torch.Tensor | None,
                                 scale: float, kv_len: int, v_fmt: str = "float") -> torch.Tensor:
    """Softmax over ``scores`` and the exact tokens' keys, then values: the value pass of
    ``ckvp::latent_attention``.

    Args:
        scores: (B, Hkv, S, H/Hkv, kv_len) fp32 from ``ckvp::latent_scores``.
        q, latent_v, basis_v_block, v_offsets, new_k, new_v, slots, attn_mask, scale, kv_len, v_fmt: as
            :func:`ckvp_compile.ops.latent_kv.latent_attention`.
    Returns:
        (B, H, S, D) q.dtype, contiguous; latent values absorbed in latent space and projected once, the exact
        tokens' values exact; rows the mask removes entirely are 0.
    Raises:
        CKVPShapeError: a shape, dtype, device or mask argument does not match.
    Reference: kernels/reference.py::latent_attention_from_scores_ref
    """
    _check_from_scores_args(scores, q, latent_v, basis_v_block, v_offsets, new_k, new_v, slots, attn_mask, scale,
                            kv_len, v_fmt)
    return ref.latent_attention_from_scores_ref(scores, q, latent_v, basis_v_block, v_offsets, new_k, new_v, slots,
                                                attn_mask, scale, kv_len, v_fmt).contiguous()


@latent_attention_from_scores.register_fake
def _(scores, q, latent_v, basis_v_block, v_offsets, new_k, new_v, slots, attn_mask, scale, kv_len, v_fmt="float"):
    _check_from_scores_args(scores, q, latent_v, basis_v_block, v_offsets, new_k, new_v, slots, attn_mask, scale,
                            kv_len, v_fmt)
    return q.new_empty(q.shape)


#: op name -> its Python handle (read by :func:`ckvp_compile.ops.register_all`).
OPS = {"latent_scores": latent_scores, "latent_attention_from_scores": latent_attention_from_scores}
