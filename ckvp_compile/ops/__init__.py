"""torch.library ops of ckvp_compile, namespace ``ckvp`` (``torch.ops.ckvp.<verb_object>``).

One module per op family; each defines its ops with ``torch.library.custom_op`` (eager kernel -> the
pure-PyTorch reference in :mod:`ckvp_compile.kernels.reference`, plus ``register_fake``) when it is imported.
Importing this package defines nothing: call :func:`register_all` (the backend does, once).

Families:
    latent_kv: ``latent_append``, ``rope_table_update``, ``latent_reconstruct``, ``latent_attention``,
        ``online_basis_fit`` (cross-layer latent KV cache, DESIGN.md "CKVP in numbers").
    latent_attention_parts: ``latent_scores``, ``latent_attention_from_scores`` (the key and value halves of
        ``latent_attention``; Inductor lowers the first to an autotuned Triton template).
    moe: ``moe_experts`` (the routed experts of one MoE layer as grouped GEMMs, DESIGN.md "Expert GEMM in
        numbers").
    offload: ``offload_experts`` (one MoE layer's experts from an expert offloader's device cache, with
        next-layer prefetch; state in :mod:`ckvp_compile.runtime.offload`).
    latent_attention_cuda: no new op; the Triton CUDA kernel of ``latent_attention``, imported only where CUDA
        and Triton are available (:data:`CUDA_MODULES`).
"""

from __future__ import annotations

import importlib

__all__ = ["OP_MODULES", "register_all"]

#: Modules under ``ckvp_compile.ops`` that define ops; :func:`register_all` imports each once.
OP_MODULES: tuple[str, ...] = ("latent_kv", "latent_attention_parts", "moe", "offload")
#: Modules that add CUDA kernels to ops defined above; imported after them, only with CUDA and Triton present.
CUDA_MODULES: tuple[str, ...] = ("latent_attention_cuda",)


def _cuda_and_triton() -> bool:
    import importlib.util

    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def register_all() -> list[str]:
    """Define every ckvp op (idempotent: a second call defines nothing and returns the same names).

    Returns:
        The qualified names of the ops defined, e.g. ``['ckvp::latent_append', ...]``, sorted.
    """
    names: list[str] = []
    for module in OP_MODULES + (CUDA_MODULES if _cuda_and_triton() else ()):
        mod = importlib.import_module(f"{__name__}.{module}")  # cached after the first import
        names.extend(f"ckvp::{name}" for name in getattr(mod, "OPS", {}))
    return sorted(names)
