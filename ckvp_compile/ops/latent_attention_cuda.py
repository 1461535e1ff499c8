"""The CUDA kernel of ``ckvp::latent_attention``: the fused Triton decode kernel, the reference otherwise.

``torch.library.register_kernel("ckvp::latent_attention", "cuda", ...)`` overrides the op's default (reference)
kernel for CUDA tensors only: CPU behaviour is untouched. The same validation as the op's default kernel runs
first (``ops.latent_kv._check_latent_attention``); then, when :data:`USE_TRITON` is set,
:func:`ckvp_compile.kernels.latent_attention_triton.unsupported_reason` decides: None -> the Triton kernels;
a reason -> ``kernels.reference.latent_attention_ref`` (logged at DEBUG), so an unsupported combination is slow,
never wrong. The op stays opaque to Inductor (an extern call); the TritonTemplate lowering is separate.

:data:`USE_TRITON` is True: on the H200 (benchmarks/results/2026-11-29-latent-attention-h200/run3) the kernels,
with the reduce step's per-token 2-D merge of the current call's tokens, are 5.5e-5 to 5.6e-4 from the reference
at every measured row (int8/32, bf16 and int4/32 latents, batch 1-32, context 4k-32k), within the 1e-3 bound;
runs 1-2, before that fix, were 2e-3 to 1.5e-2 away. Set
``ckvp_compile.ops.latent_attention_cuda.USE_TRITON = False`` to force the reference.

Imported by :func:`ckvp_compile.ops.register_all` only when CUDA and Triton are available (after ``latent_kv``,
which defines the op). Defines no new op: ``OPS`` is empty.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from ..kernels import reference as ref
from ..kernels.latent_attention_triton import (
    latent_attention_from_scores_triton,
    latent_attention_triton,
    latent_scores_triton,
    unsupported_reason,
)
from ..kernels import latent_quant_triton as lq
from ..kernels.latent_format import quantize_latent_ref
from . import latent_attention_parts as parts
from . import latent_kv
from .latent_kv import _check_latent_attention

__all__ = ["OPS", "latent_append_cuda", "latent_attention_cuda", "latent_attention_from_scores_cuda",
           "latent_scores_cuda"]

logger = logging.getLogger(__name__)

#: No new ops here (this module adds device kernels to ``ckvp::latent_attention``, ``ckvp::latent_scores`` and
#: ``ckvp::latent_attention_from_scores``).
OPS: dict = {}

#: Run the Triton kernels for supported inputs (else always the reference). See the module docstring.
USE_TRITON = True


def latent_attention_cuda(q: torch.Tensor, latent_k: torch.Tensor, latent_v: torch.Tensor,
                          basis_k_block: torch.Tensor, basis_v_block: torch.Tensor, k_offsets: Sequence[int],
                          v_offsets: Sequence[int], cos_table: torch.Tensor, sin_table: torch.Tensor,
                          slot_pos: torch.Tensor, rope_form: str, rotary_dim: int, new_k: torch.Tensor,
                          new_v: torch.Tensor, slots: torch.Tensor, attn_mask: torch.Tensor | None, scale: float,
                          kv_len: int, k_fmt: str = "float", v_fmt: str = "float",
                          page_table: torch.Tensor | None = None) -> torch.Tensor:
    """``ckvp::latent_attention`` on CUDA tensors (arguments, result and errors as
    :func:`ckvp_compile.ops.latent_kv.latent_attention`): the Triton kernels where enabled and supported, else the
    reference.

    Raises:
        CKVPShapeError: a shape, dtype, device, RoPE or mask argument does not match the op's layout.
    Reference: kernels/reference.py::latent_attention_ref
    """
    args = (q, latent_k, latent_v, basis_k_block, basis_v_block, k_offsets, v_offsets, cos_table, sin_table,
            slot_pos, rope_form, rotary_dim, new_k, new_v, slots, attn_mask, scale, kv_len, k_fmt, v_fmt)
    _check_latent_attention(*args, page_table)
    reason = "USE_TRITON is False" if not USE_TRITON else unsupported_reason(
        q, latent_k, latent_v, basis_k_block, basis_v_block, rope_form, attn_mask, cos_table, new_k, k_fmt, v_fmt,
        page_table)
    if reason is None:
        return latent_attention_triton(*args, page_table=page_table)
    logger.debug("ckvp::latent_attention on %s: reference path (%s)", q.device, reason)
    return ref.latent_attention_ref(*args, page_table).contiguous()


latent_kv.latent_attention.register_kernel("cuda")(latent_attention_cuda)


def latent_scores_cuda(q, latent_k, basis_k_block, k_offsets, cos_table, sin_table, slot_pos, rope_form, rotary_dim,
                       slots, attn_mask, scale, kv_len, k_fmt="float") -> torch.Tensor:
    """``ckvp::latent_scores`` on CUDA tensors (arguments, result and errors as
    :func:`ckvp_compile.ops.latent_attention_parts.latent_scores`): the Triton key pass where enabled and
    supported, else the reference.

    Raises:
        CKVPShapeError: as the op.
    Reference: kernels/reference.py::latent_scores_ref
    """
    args = (q, latent_k, basis_k_block, k_offsets, cos_table, sin_table, slot_pos, rope_form, rotary_dim, slots,
            attn_mask, scale, kv_len, k_fmt)
    parts._check_scores_args(*args)
    reason = "USE_TRITON is False" if not USE_TRITON else unsupported_reason(
        q, latent_k, latent_k, basis_k_block, basis_k_block, rope_form, attn_mask, cos_table, q, k_fmt, k_fmt)
    if reason is None:
        return latent_scores_triton(*args)
    logger.debug("ckvp::latent_scores on %s: reference path (%s)", q.device, reason)
    return ref.latent_scores_ref(*args)


def latent_attention_from_scores_cuda(scores, q, latent_v, basis_v_block, v_offsets, new_k, new_v, slots, attn_mask,
                                      scale, kv_len, v_fmt="float") -> torch.Tensor:
    """``ckvp::latent_attention_from_scores`` on CUDA tensors (as
    :func:`ckvp_compile.ops.latent_attention_parts.latent_attention_from_scores`): the Triton value pass and merge
    where enabled and supported, else the reference.

    Raises:
        CKVPShapeError: as the op.
    Reference: kernels/reference.py::latent_attention_from_scores_ref
    """
    args = (scores, q, latent_v, basis_v_block, v_offsets, new_k, new_v, slots, attn_mask, scale, kv_len, v_fmt)
    parts._check_from_scores_args(*args)
    reason = "USE_TRITON is False" if not USE_TRITON else unsupported_reason(
        q, latent_v, latent_v, basis_v_block, basis_v_block, "none", attn_mask, q, new_k, v_fmt, v_fmt)
    if reason is None:
        return latent_attention_from_scores_triton(*args)
    logger.debug("ckvp::latent_attention_from_scores on %s: reference path (%s)", q.device, reason)
    return ref.latent_attention_from_scores_ref(*args).contiguous()


parts.latent_scores.register_kernel("cuda")(latent_scores_cuda)
parts.latent_attention_from_scores.register_kernel("cuda")(latent_attention_from_scores_cuda)


def latent_append_cuda(latent: torch.Tensor, x: torch.Tensor, basis: torch.Tensor, offsets: Sequence[int],
                       slots: torch.Tensor, fmt: str = "float", page_table: torch.Tensor | None = None) -> None:
    """``ckvp::latent_append`` on CUDA tensors (arguments and errors as
    :func:`ckvp_compile.ops.latent_kv.latent_append`): the reference projection, then the Triton quantizer
    (bit-equal to the reference, :mod:`ckvp_compile.kernels.latent_quant_triton`) for the formats
    :func:`~ckvp_compile.kernels.latent_quant_triton.use_triton` accepts (``USE_TRITON`` set and the format's family
    checked on the GPU: ``GPU_CHECKED``; an ``-f8`` format also ``F8_GPU_CHECKED``, else the reference quantizer
    writes its e4m3 metadata); the reference otherwise. Once ``APPEND_GPU_CHECKED`` is set, int and mix
    formats take :func:`~ckvp_compile.kernels.latent_quant_triton.latent_append_triton` instead (projection,
    quantization and store fused in one launch) for the input kinds a GPU run checked
    (:func:`~ckvp_compile.kernels.latent_quant_triton.append_gpu_checked`) where it loads the tensors
    (:func:`~ckvp_compile.kernels.latent_quant_triton.append_fusable`: a latent at positive strides, fp16 / bf16 /
    fp32 x, and a basis dtype it reads). On a GPU a slot outside the cache is not written by the fused kernel (the
    unfused path's indexing raised a device-side assert); the RoPE table update of the same graph still reports it.

    Raises:
        CKVPShapeError: as the op.
    Reference: kernels/reference.py::latent_append_ref
    """
    latent_kv._check_latent_append(latent, x, basis, offsets, slots, fmt, page_table)
    use = lq.use_triton(fmt, latent.device)
    if (use and lq.format_family(fmt) in ("int", "mix") and lq.append_gpu_checked(basis, page_table, latent)
            and not lq.append_fusable(latent, x, basis)):  # one fused launch per bit width
        lq.latent_append_triton(latent, x, basis, offsets, slots, fmt, page_table)
        return
    ref.latent_append_with(latent, x, basis, offsets, slots, fmt,
                           lq.quantize_latent_triton if use else quantize_latent_ref, page_table)


latent_kv.latent_append.register_kernel("cuda")(latent_append_cuda)
