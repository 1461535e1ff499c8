"""Graph rewrites, in two stages: 'torch' passes on the Dynamo graph (the KV cache and attention), and
'post_grad' passes on Inductor's functional ATen graph (expert dispatch), run by one
:class:`~ckvp_compile.passes.manager.PostGradPassManager`.

:func:`build_passes` turns a :class:`~ckvp_compile.plan.Plan` into the passes of each stage. 'torch':
:class:`~ckvp_compile.passes.latent_kv_cache.LatentKVCachePass` (CKVP), then
:class:`~ckvp_compile.passes.expert_gemm.ExpertGemmPass` (``enable_expert_gemm``: each planned MoE site's routed
experts become one ``ckvp::moe_experts`` call; it runs on the Dynamo graph, where the analysis named the site's
nodes). 'post_grad': :class:`~ckvp_compile.passes.store_write_order.StoreWriteOrderPass` when the latent store is
rewritten (each functionalized store write after the reads of the value it overwrites, so that Inductor writes
the store in place instead of cloning it every step).
"""

from __future__ import annotations

from .base import CKVPPass, PassResult
from .manager import PostGradPassManager, failed_pass, package_source_hash, run_passes

__all__ = ["CKVPPass", "PassResult", "PostGradPassManager", "build_passes", "failed_pass", "package_source_hash",
           "run_passes"]


def build_passes(plan, analysis=None, binding=None) -> tuple[list[CKVPPass], list[CKVPPass]]:
    """Return ``(torch_passes, post_grad_passes)`` for ``plan`` (a :class:`ckvp_compile.plan.Plan`).

    Args:
        plan: the decisions. analysis: the graph's :class:`GraphAnalysis` (needed when a rewrite is planned).
        binding: the graph's latent-store binding (needed for the latent KV rewrite).
    Returns:
        The passes of each stage; both empty when nothing is rewritten.
    """
    torch_passes: list[CKVPPass] = []
    post_grad_passes: list[CKVPPass] = []
    if plan.latent_groups:
        from .latent_kv_cache import GroupRewrite, LatentKVCachePass, LatentRewritePlan

        sites = analysis.attention_by_layer()
        store = binding.store
        groups = [GroupRewrite(g, tuple(sites[layer] for layer in store.groups[g])) for g in plan.latent_groups]
        torch_passes.append(LatentKVCachePass(LatentRewritePlan(store, groups, binding.input_index)))
        from .store_write_order import StoreWriteOrderPass

        post_grad_passes.append(StoreWriteOrderPass())
    expert_layers = {d.layer for d in plan.decisions if d.kind == "moe" and d.rewrite}
    if expert_layers and analysis is not None:
        from .expert_gemm import ExpertGemmPass

        torch_passes.append(ExpertGemmPass([m for m in analysis.moe if m.layer in expert_layers]))
    return torch_passes, post_grad_passes
