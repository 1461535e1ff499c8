"""Triton kernels, one family per file, each with a pure-PyTorch twin in ``kernels/reference.py``.

The kernels arrive with the rewrites that need them (the latent decode attention and the grouped expert
GEMM); this directory's sources are part of the pass manager's cache ``uuid()``.
"""
