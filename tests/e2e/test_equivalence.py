"""Acceptance: with every rewrite disabled, ckvp-compiled logits equal eager ones (prefill + 8 decode steps,
static cache, fp32) on real MoE architectures, and the analysis finds exactly one attention site and one MoE
site per layer with the right layer index, GQA ratio, head_dim, RoPE form and experts form.

Compiles with ``compiler="aot_eager"`` (AOTAutograd + Inductor decompositions + the post-grad pass manager,
no code generation) to keep CI fast; ``test_fixture_model_full_inductor`` covers full Inductor once.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckvp_compile import CKVPBackend, CKVPConfig, CompileRecorder
from ckvp_compile.testing import (
    HF_FAMILIES,
    GptFastConfig,
    GptFastMoE,
    build_hf_moe,
    load_fixture_model,
    prefill_decode_logits,
)
from ckvp_compile.testing.strategies import moe_model_shapes

N_DECODE = 8
PROMPT_LEN = 7


def run_both(model, compiler: str = "aot_eager", batch: int = 1, vocab: int = 256):
    """Return (eager logits, ckvp logits, recorder) for prefill + N_DECODE steps."""
    ids = torch.randint(0, vocab, (batch, PROMPT_LEN))
    eager = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=32)
    rec = CompileRecorder()
    backend = CKVPBackend(CKVPConfig(compiler=compiler), recorder=rec)
    torch._dynamo.reset()
    compiled = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=32,
                                     compile_fn=lambda m: torch.compile(m, backend=backend, fullgraph=True))
    return eager, compiled, rec


def assert_logits_equal(eager, compiled):
    assert len(eager) == len(compiled) == N_DECODE + 1
    for step, (a, b) in enumerate(zip(eager, compiled)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=lambda m: f"step {step}: {m}")


def assert_sites(rec: CompileRecorder, *, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_form: str, experts_form: str, cache_form: str, top_k: int, num_experts: int):
    """Every captured graph (prefill, decode) has one attention and one MoE site per layer, all correct."""
    assert rec.graphs, "the backend saw no graph"
    for g in rec.graphs:
        a = g.analysis
        assert [s.layer for s in a.attention] == list(range(num_layers)), a.attention
        assert [s.layer for s in a.moe] == list(range(num_layers)), a.moe
        assert a.unsupported == ()
        for s in a.attention:
            assert (s.num_heads, s.num_kv_heads, s.head_dim) == (num_heads, num_kv_heads, head_dim)
            assert s.gqa_ratio == num_heads // num_kv_heads
            assert s.rope is not None and s.rope.form == rope_form and s.rope.rotary_dim == head_dim
            assert s.k_cache is not None and s.v_cache is not None
            assert s.k_cache.form == s.v_cache.form == cache_form
        for m in a.moe:
            assert m.experts_form == experts_form and m.top_k == top_k and m.num_experts == num_experts
        # nothing was rewritten: the rewrites are disabled
        assert g.dynamo_before == g.dynamo_after and g.plan.rewrites == ()


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_hf_families_equal_eager(family):
    shape = dict(num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4, top_k=2, ffn=32)
    model = build_hf_moe(family, **shape)
    eager, compiled, rec = run_both(model)
    assert_logits_equal(eager, compiled)
    assert_sites(rec, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_form="rotate_half",
                 experts_form="grouped_mm_fallback", cache_form="index_copy_", top_k=2, num_experts=4)


@given(shape=moe_model_shapes(max_layers=8, hidden_matches_heads=True), family=st.sampled_from(HF_FAMILIES))
@settings(max_examples=4)
def test_hf_random_shapes_equal_eager(shape, family):
    model = build_hf_moe(family, **shape)
    eager, compiled, rec = run_both(model)
    assert_logits_equal(eager, compiled)
    assert_sites(rec, num_layers=shape["num_layers"], num_heads=shape["num_heads"],
                 num_kv_heads=shape["num_kv_heads"], head_dim=shape["head_dim"], rope_form="rotate_half",
                 experts_form="grouped_mm_fallback", cache_form="index_copy_", top_k=shape["top_k"],
                 num_experts=shape["num_experts"])


@given(shape=moe_model_shapes(max_layers=6), rope=st.sampled_from(["complex", "rotate_half"]))
@settings(max_examples=3)
def test_gpt_fast_equal_eager(shape, rope):
    cfg = GptFastConfig(n_layer=shape["num_layers"], dim=shape["hidden"], n_head=shape["num_heads"],
                        n_local_heads=shape["num_kv_heads"], head_dim=shape["head_dim"],
                        num_experts=shape["num_experts"], num_activated_experts=shape["top_k"],
                        intermediate_size=shape["ffn"], rope_form=rope)
    torch.manual_seed(0)
    model = GptFastMoE(cfg).eval()
    eager, compiled, rec = run_both(model)
    assert_logits_equal(eager, compiled)
    assert_sites(rec, num_layers=cfg.n_layer, num_heads=cfg.n_head, num_kv_heads=cfg.n_local_heads,
                 head_dim=cfg.head_dim, rope_form=rope, experts_form="weight_gather_einsum", cache_form="setitem",
                 top_k=cfg.num_activated_experts, num_experts=cfg.num_experts)


def test_fixture_model_equal_eager_batch2():
    model = load_fixture_model()
    eager, compiled, rec = run_both(model, batch=2)
    assert_logits_equal(eager, compiled)
    assert_sites(rec, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=64, rope_form="rotate_half",
                 experts_form="grouped_mm_fallback", cache_form="index_copy_", top_k=2, num_experts=4)
    assert [g.layers for g in rec.graphs[-1].plan.groups] == [(0, 1, 2, 3), (4, 5, 6, 7)]


@pytest.mark.slow
def test_fixture_model_full_inductor():
    model = load_fixture_model()
    eager, compiled, rec = run_both(model, compiler="inductor")
    assert_logits_equal(eager, compiled)
    assert len(rec.graphs[0].analysis.attention) == 8 and len(rec.graphs[0].analysis.moe) == 8


def test_dynamic_cache_warns_and_stays_correct():
    """Acceptance 4: an unsupported pattern (HF DynamicCache) gives a warning with reason and fix, and the
    compiled model's output is the untouched eager one."""
    from ckvp_compile import UnsupportedPatternWarning

    model = build_hf_moe("mixtral", num_layers=2)
    ids = torch.randint(0, 256, (1, PROMPT_LEN))
    with torch.no_grad():
        eager = model(ids).logits
        compiled_model = torch.compile(model, backend="ckvp", options={"compiler": "aot_eager"})
        with pytest.warns(UnsupportedPatternWarning) as record:
            # a DynamicCache: transformers' default when use_cache=True and no cache is passed
            out = compiled_model(ids, use_cache=True).logits
    messages = [str(w.message) for w in record]
    assert any("cat" in m and "static" in m for m in messages), messages
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
