"""Inductor lowerings of the ``ckvp`` ops: Triton templates with an extern (reference) fallback.

One lowering per op family, in ``lowering/<op>.py``, registered by :func:`register_all` (called once by the
backend before Inductor runs, never as an import side effect):

* :mod:`ckvp_compile.lowering.moe`: ``ckvp::moe_experts`` (and its parts ``ckvp::moe_gate_up`` /
  ``ckvp::moe_down``) as two autotuned grouped-GEMM ``TritonTemplate``\\ s plus the extern ops.
* :mod:`ckvp_compile.lowering.latent_attention`: ``ckvp::latent_attention`` (CUDA: the key pass
  ``ckvp::latent_scores`` as an autotuned ``TritonTemplate``, the value pass as an extern op) and
  ``ckvp::latent_scores``.

This directory's sources are part of the pass manager's cache ``uuid()``.
"""

from __future__ import annotations

import importlib.util
import logging

logger = logging.getLogger(__name__)

__all__ = ["register_all"]


def register_all() -> list[str]:
    """Register every ckvp lowering with Inductor (idempotent); return the names of the ops lowered.

    The MoE lowering needs Triton importable (its templates are built from the Triton kernels' sources); without
    it nothing is registered and Inductor calls the ops as opaque extern kernels.
    """
    from ..ops import register_all as register_ops

    register_ops()
    if importlib.util.find_spec("triton") is None:
        logger.info("ckvp: triton is not installed; the MoE lowering is not registered (extern ops only)")
        return []
    from . import latent_attention, moe

    return moe.register() + latent_attention.register()
