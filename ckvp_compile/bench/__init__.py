"""Benchmarks of ckvp_compile, runnable as modules.

* :mod:`ckvp_compile.bench.fidelity` (``python -m ckvp_compile.bench.fidelity``): perplexity and next-token
  agreement of a model whose KV cache is the CKVP latent store (through the real compiled rewrite), against
  the dense model, per (group size, kv ratio, rank allocation), with the measured storage ratio.
"""

from __future__ import annotations

__all__ = ["fidelity"]
