"""The post-grad pass manager: cache uuid identity, pass running, results."""

import torch
import torch.fx as fx

from ckvp_compile import CKVPConfig
from ckvp_compile.passes import CKVPPass, PostGradPassManager, package_source_hash, run_passes


class SinToCos(CKVPPass):
    name = "sin_to_cos"
    stage = "torch"

    def apply(self, graph):
        n = 0
        for node in graph.nodes:
            if node.op == "call_method" and node.target == "sin":
                node.target = "cos"
                n += 1
        return n


class NeverApplies(CKVPPass):
    name = "never"

    def is_applicable(self, graph):
        return "no site"


def test_uuid_stable_and_keyed_on_options_and_passes():
    h = CKVPConfig().compute_hash()
    a = PostGradPassManager([], h).uuid()
    assert a == PostGradPassManager([], h).uuid()
    assert a != PostGradPassManager([], CKVPConfig(group_size=2).compute_hash()).uuid()
    assert a != PostGradPassManager([SinToCos()], h).uuid()


def test_uuid_changes_with_package_sources(monkeypatch):
    from ckvp_compile.passes import manager

    h = CKVPConfig().compute_hash()
    before = PostGradPassManager([], h).uuid()
    monkeypatch.setattr(manager, "package_source_hash", lambda: "0" * 64)
    assert PostGradPassManager([], h).uuid() != before


def test_source_hash_covers_pass_files():
    import ckvp_compile.passes.manager as m

    assert len(package_source_hash()) == 64
    assert "passes" in m.HASHED_DIRS and "lowering" in m.HASHED_DIRS and "kernels" in m.HASHED_DIRS


def test_run_passes_rewrites_and_reports():
    gm = fx.symbolic_trace(lambda x: x.sin() + 1)
    seen = []
    results = run_passes([SinToCos(), NeverApplies()], gm.graph, lambda when, g: seen.append(when))
    gm.recompile()
    x = torch.randn(5)
    torch.testing.assert_close(gm(x), x.cos() + 1)
    assert results[0].matched == 1 and results[0].replaced == (("sin", 1),)
    assert results[1].matched == 0 and results[1].skipped == "no site"
    assert seen == ["before", "after"]


def test_manager_is_inductor_custom_pass():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    mgr = PostGradPassManager([], CKVPConfig().compute_hash())
    assert isinstance(mgr, CustomGraphPass)
    gm = fx.symbolic_trace(lambda x: x * 2)
    mgr(gm.graph)
    assert mgr.calls == 1
