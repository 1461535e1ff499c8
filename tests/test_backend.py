"""The ckvp backend: registration, options, modes, inner compilers, strictness, fallback, recording."""

import subprocess
import sys
import warnings

import pytest
import torch

import ckvp_compile
from ckvp_compile import CKVPBackend, CKVPConfig, CompileRecorder, UnsupportedGraphError, UnsupportedPatternWarning
from ckvp_compile import _compat
from ckvp_compile.analysis.sites import GraphAnalysis, UnsupportedSite
from ckvp_compile.passes import CKVPPass


def f(x):
    return x.sin() + 1


def test_entry_point_without_import():
    """Acceptance 1: the backend resolves by name in a fresh interpreter that never imports ckvp_compile."""
    code = (
        "import sys, torch\n"
        "out = torch.compile(lambda x: x.sin() + 1, backend='ckvp')(torch.ones(3))\n"
        "print(out.tolist())\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    vals = eval(res.stdout.strip().splitlines()[-1])
    assert vals == pytest.approx([1.8414709848] * 3)


def test_source_tree_import_registers_the_name():
    """Run from a source tree (``PYTHONPATH=.``, as on the GPU image), no entry point names 'ckvp': importing the
    package registers it, so ``backend="ckvp"`` resolves; with the entry point present it does not register (a
    second registration would make the entry point's load fail with "duplicate name")."""
    code = (
        "import importlib.metadata as md, torch\n"
        "real = md.entry_points\n"
        "md.entry_points = lambda **kw: real(**kw).select(name='no-such-backend') if kw else real()\n"
        "import ckvp_compile\n"
        "from ckvp_compile.backend import _register_from_source_tree\n"
        "assert not _register_from_source_tree(['ckvp'])\n"
        "out = torch.compile(lambda x: x.sin() + 1, backend='ckvp')(torch.ones(3))\n"
        "assert torch._dynamo.lookup_backend('ckvp') is ckvp_compile.ckvp_backend\n"
        "print(out.tolist())\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert eval(res.stdout.strip().splitlines()[-1]) == pytest.approx([1.8414709848] * 3)


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_inner_compilers_match_eager(compiler):
    x = torch.randn(4, 5)
    out = torch.compile(f, backend="ckvp", options={"compiler": compiler})(x)
    torch.testing.assert_close(out, f(x), rtol=0, atol=0)


def test_bad_option_is_a_value_error_naming_valid_keys():
    with pytest.raises(ValueError) as e:
        torch.compile(f, backend="ckvp", options={"grup_size": 4})(torch.ones(2))
    assert "grup_size" in str(e.value) and "group_size" in str(e.value)
    # the function is still usable, eagerly and through a plain torch.compile
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, backend="eager")(torch.ones(2)), f(torch.ones(2)))


def test_mode_and_inductor_options_reach_compile_fx(monkeypatch):
    seen = {}

    def fake_compile(gm, example_inputs, patches):
        seen.update(patches)
        return gm.forward

    monkeypatch.setattr(_compat, "compile_with_inductor", fake_compile)
    torch.compile(f, backend="ckvp", mode="max-autotune")(torch.ones(2))
    assert seen["max_autotune"] is True and seen["triton.cudagraphs"] is True
    assert isinstance(seen["post_grad_custom_post_pass"], ckvp_compile.passes.PostGradPassManager)
    seen.clear()
    torch._dynamo.reset()
    torch.compile(f, backend="ckvp", options={"inductor": {"epilogue_fusion": False}, "mode": "reduce-overhead"})(
        torch.ones(2)
    )
    assert seen["epilogue_fusion"] is False and seen["triton.cudagraphs"] is True and "max_autotune" not in seen


def _fake_unsupported_analysis(monkeypatch):
    site = UnsupportedSite("dynamic_cache", 0, "the KV cache grows by torch.cat (DynamicCache).", "use a StaticCache.")
    monkeypatch.setattr(ckvp_compile.backend, "analyze", lambda gm: GraphAnalysis(unsupported=(site,)))


def test_unsupported_pattern_warns_and_leaves_result_untouched(monkeypatch):
    _fake_unsupported_analysis(monkeypatch)
    x = torch.randn(3)
    with pytest.warns(UnsupportedPatternWarning, match="layer 0: the KV cache grows.*Fix: use a StaticCache"):
        out = torch.compile(f, backend="ckvp", options={"compiler": "eager"})(x)
    torch.testing.assert_close(out, f(x))


def test_the_same_unsupported_pattern_in_many_layers_warns_once(monkeypatch):
    """A DynamicCache in every layer of an 8-layer model gave 8 near-identical warnings per graph (24 for a
    generate() call): one warning now names the layers; a different kind still warns on its own."""
    sites = tuple(UnsupportedSite("dynamic_cache", layer, f"the KV cache of layer {layer} grows by torch.cat.",
                                  "use a StaticCache.") for layer in range(8))
    other = UnsupportedSite("sliding_window", 3, "a sliding window of 4 keys.", "use full attention.")
    monkeypatch.setattr(ckvp_compile.backend, "analyze", lambda gm: GraphAnalysis(unsupported=sites + (other,)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(f, backend="ckvp", options={"compiler": "eager"})(torch.randn(3))
    messages = [str(w.message) for w in caught if issubclass(w.category, UnsupportedPatternWarning)]
    assert len(messages) == 2, messages
    assert messages[0].startswith("ckvp: layers 0-7: the KV cache of layer 0 grows") and "differ in detail" in messages[0]
    assert messages[0].endswith("Fix: use a StaticCache.")
    assert messages[1] == other.message()


def test_strict_raises_unsupported(monkeypatch):
    _fake_unsupported_analysis(monkeypatch)
    with pytest.raises(UnsupportedGraphError, match="strict=True"):
        torch.compile(f, backend="ckvp", options={"compiler": "eager", "strict": True})(torch.ones(2))


class Broken(CKVPPass):
    name = "broken"
    stage = "torch"

    def apply(self, graph):
        for node in graph.nodes:
            if node.op == "call_method":
                node.target = "sin_that_does_not_exist"
        raise RuntimeError("bug in a rewrite")


def test_failing_rewrite_falls_back_to_the_original_graph():
    rec = CompileRecorder()
    backend = CKVPBackend(CKVPConfig(compiler="eager"), recorder=rec, extra_passes=[Broken()])
    x = torch.randn(3)
    with pytest.warns(UnsupportedPatternWarning, match="bug in a rewrite"):
        out = torch.compile(f, backend=backend)(x)
    torch.testing.assert_close(out, f(x))
    assert "bug in a rewrite" in rec.graphs[0].fell_back


class Doubler(CKVPPass):
    """Post-grad test pass: x + 1 -> x + 2 (changes the numbers, so we can see it ran)."""

    name = "doubler"
    stage = "post_grad"

    def apply(self, graph):
        n = 0
        for node in graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.aten.add.Tensor and node.args[1] == 1:
                node.args = (node.args[0], 2)
                n += 1
        return n


def test_post_grad_pass_runs_under_aot_eager_and_is_recorded():
    rec = CompileRecorder()
    backend = CKVPBackend(CKVPConfig(compiler="aot_eager"), recorder=rec, extra_passes=[Doubler()])
    x = torch.randn(3)
    out = torch.compile(f, backend=backend)(x)
    torch.testing.assert_close(out, x.sin() + 2)
    g = rec.graphs[0]
    assert [r.name for r in g.pass_results] == ["doubler"] and g.pass_results[0].matched == 1
    assert "add" in g.post_grad_before and g.post_grad_before != g.post_grad_after


@pytest.mark.slow
def test_post_grad_pass_runs_under_inductor():
    backend = CKVPBackend(CKVPConfig(compiler="inductor", inductor={"fx_graph_cache": False}), extra_passes=[Doubler()])
    x = torch.randn(3)
    torch.testing.assert_close(torch.compile(f, backend=backend)(x), x.sin() + 2)
