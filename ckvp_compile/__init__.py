"""ckvp_compile: a torch.compile backend for Mixture-of-Experts inference.

    torch.compile(model, backend="ckvp", options={...})
    ckvp_compile.compile(model, expert_offload=4, options={...})   # the same, with experts offloaded first

The backend finds each layer's attention / KV-cache and expert-dispatch subgraphs in the captured FX
graph and rewrites them (cross-layer latent KV caching; grouped expert GEMMs), then hands the graph to
Inductor. See README.md and DESIGN.md.

Dimension glossary used in every docstring: ``B`` batch, ``S`` query length, ``T`` tokens (= B*S),
``L`` layers, ``H`` query heads, ``Hkv`` KV heads, ``D`` head dim, ``R`` latent rank, ``G`` layers per
group, ``E`` experts, ``A`` active experts per token (top-k), ``Dm`` model dim, ``I`` expert FFN dim;
GEMMs use ``M, N, K``.
"""

from __future__ import annotations

from .analysis import GraphAnalysis, analyze
from .api import compile  # noqa: A001 (ckvp_compile.compile, like torch.compile; not in __all__)
from .backend import CKVPBackend, CompileRecorder, ckvp_backend
from .config import CKVPConfig
from .errors import (
    CKVPConfigError,
    CKVPError,
    CKVPModelLoadError,
    CKVPShapeError,
    CKVPWarning,
    UnsupportedGraphError,
    UnsupportedPatternWarning,
)
from .latent import LatentBases, calibrate
from .plan import Plan, make_plan

__version__ = "0.1.0"

__all__ = [
    "CKVPBackend",
    "CKVPConfig",
    "CKVPConfigError",
    "CKVPError",
    "CKVPModelLoadError",
    "CKVPShapeError",
    "CKVPWarning",
    "CompileRecorder",
    "GraphAnalysis",
    "LatentBases",
    "Plan",
    "UnsupportedGraphError",
    "UnsupportedPatternWarning",
    "analyze",
    "calibrate",
    "ckvp_backend",
    "inspect",
    "make_plan",
    "offload_experts",
    "offloader_of",
    "__version__",
]


def inspect(*args, **kwargs):
    """Compile a model with the ckvp backend while recording, and return the inspection report.

    See :func:`ckvp_compile.inspection.inspect_model` for the arguments.
    """
    from .inspection import inspect_model

    return inspect_model(*args, **kwargs)


def offload_experts(*args, **kwargs):
    """Keep an HF MoE model's experts in host memory with a device cache and next-layer prefetch; returns the
    offloader (``.stats()``). See :func:`ckvp_compile.runtime.offload.offload_experts` for the arguments.
    """
    from .runtime.offload import offload_experts as _offload_experts

    return _offload_experts(*args, **kwargs)


def offloader_of(model):
    """Return the expert offloader serving ``model`` (``.stats()``, ``.reset_stats()``, ``.close()``), or None.
    See :func:`ckvp_compile.runtime.offload.offloader_of`.
    """
    from .runtime.offload import offloader_of as _offloader_of

    return _offloader_of(model)
