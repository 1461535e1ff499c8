"""Graph rewrites, in two stages: 'torch' passes on the Dynamo graph (the KV cache and attention), and
'post_grad' passes on Inductor's functional ATen graph (expert dispatch), run by one
:class:`~ckvp_compile.passes.manager.PostGradPassManager`.

:func:`build_passes` turns a :class:`~ckvp_compile.plan.Plan` into the passes of each stage. In this release
the CKVP latent-KV rewrite and the grouped-expert-GEMM rewrite are not built yet (their options raise a
clear NYI error), so the plan never asks for them and both stage lists are empty: the pipeline runs, the
graphs go to the inner compiler unchanged.
"""

from __future__ import annotations

from .base import CKVPPass, PassResult
from .manager import PostGradPassManager, package_source_hash, run_passes

__all__ = ["CKVPPass", "PassResult", "PostGradPassManager", "build_passes", "package_source_hash", "run_passes"]


def build_passes(plan) -> tuple[list[CKVPPass], list[CKVPPass]]:
    """Return ``(torch_passes, post_grad_passes)`` for ``plan`` (a :class:`ckvp_compile.plan.Plan`).

    Only sites whose decision says ``rewrite=True`` get a pass; with every rewrite disabled both lists are
    empty.
    """
    torch_passes: list[CKVPPass] = []
    post_grad_passes: list[CKVPPass] = []
    return torch_passes, post_grad_passes
