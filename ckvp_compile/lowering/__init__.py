"""Inductor lowerings of the ``ckvp`` ops: Triton templates with an extern (reference) fallback.

One lowering per op, in ``lowering/<op>.py``, registered by :func:`register_all` (called once by the
backend, never as an import side effect). No ``ckvp`` op exists yet in this release (the CKVP and expert
GEMM rewrites come next), so there is nothing to register. This directory's sources are part of the pass
manager's cache ``uuid()``.
"""

from __future__ import annotations


def register_all() -> list[str]:
    """Register every ckvp lowering with Inductor (idempotent); return the names of the ops lowered."""
    return []
