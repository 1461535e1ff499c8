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


def test_source_hash_covers_every_source_but_testing_and_inspection():
    import ckvp_compile.passes.manager as m

    assert len(package_source_hash()) == 64
    hashed = {str(p.relative_to(m._PACKAGE_DIR)) for p in m.hashed_source_files()}
    for sub in ("passes", "lowering", "kernels", "ops", "runtime", "latent", "analysis"):
        assert any(h.startswith(sub + "/") for h in hashed), sub
    assert {"config.py", "backend.py", "plan.py", "_compat.py"} <= hashed
    assert "inspection/templates/report.html.jinja" not in hashed
    assert not any(h.startswith(("testing/", "inspection/")) or "__pycache__" in h for h in hashed)
    assert set(m.UNHASHED_DIRS) == {"testing", "inspection"}


def test_source_hash_sees_edits_within_the_process(tmp_path, monkeypatch):
    """No stale cache: editing, adding or removing a hashed source changes the hash in the same process;
    testing/ and inspection/ do not count."""
    from ckvp_compile.passes import manager

    for rel in ("passes/a.py", "runtime/store.py", "ops/fake.py", "kernels/t.jinja", "config.py",
                "testing/models.py", "inspection/templates/page.jinja", "notes.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n")
    monkeypatch.setattr(manager, "_PACKAGE_DIR", tmp_path)
    seen = [package_source_hash()]
    assert package_source_hash() == seen[0]  # stable

    def changes(edit) -> bool:
        edit()
        seen.append(package_source_hash())
        return seen[-1] != seen[-2]

    append = lambda rel: lambda: (tmp_path / rel).write_text((tmp_path / rel).read_text() + "x = 1\n")  # noqa: E731
    assert changes(append("runtime/store.py"))
    assert changes(append("ops/fake.py"))
    assert changes(append("passes/a.py"))
    assert changes(append("kernels/t.jinja"))
    assert changes(append("config.py"))
    assert changes(lambda: (tmp_path / "latent").mkdir() or (tmp_path / "latent" / "new.py").write_text("y = 2\n"))
    assert changes(lambda: (tmp_path / "ops" / "fake.py").unlink())
    assert not changes(append("testing/models.py"))
    assert not changes(append("inspection/templates/page.jinja"))
    assert not changes(append("notes.txt"))
    assert len(set(seen)) == 8
    h = CKVPConfig().compute_hash()
    before = PostGradPassManager([], h).uuid()
    (tmp_path / "plan.py").write_text("z = 3\n")
    assert PostGradPassManager([], h).uuid() != before  # the manager's uuid follows


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
