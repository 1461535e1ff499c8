"""Tests of the expert GEMM rewrite (ckvp_compile/passes/expert_gemm.py) through the backend.

* Whole models with ``enable_expert_gemm=True`` (HF Mixtral / Qwen2-MoE with its gated shared expert /
  Qwen3-MoE / OLMoE, grouped_mm (fp32: the opaque fallback op) and batched_mm, a captured eager loop over
  range(E), gpt-fast einsum; Hypothesis shapes; fp32): logits equal eager for prefill and decode steps.
* The rewrite happened: one ``ckvp::moe_experts`` per layer in every graph, and the old expert GEMMs, sorts
  and gathers are gone from the graph (PassResult.replaced, the graph code).
* A site the pass does not understand (a GELU expert) is left untouched with an UnsupportedPatternWarning.
* The plan marks MoE sites as rewritten only when the option is on; the pass manager's uuid follows the option.
"""

from __future__ import annotations

import re
import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ckvp_compile import CKVPBackend, CKVPConfig, CompileRecorder, UnsupportedPatternWarning
from ckvp_compile.passes import PostGradPassManager
from ckvp_compile.testing import HF_FAMILIES, GptFastConfig, GptFastMoE, build_hf_moe, prefill_decode_logits
from ckvp_compile.testing.strategies import moe_model_shapes

N_DECODE = 3
PROMPT_LEN = 6
OP_CALL = re.compile(r"torch\.ops\.ckvp\.moe_experts\.default\(")
FAMILY_KW = {"qwen3_moe": {"norm_topk_prob": True}}


def run_both(model, batch: int = 2, dynamic_shapes: bool = False, **options):
    """(eager logits, compiled logits, recorder) over prefill + N_DECODE steps with the rewrite on."""
    ids = torch.randint(0, 256, (batch, PROMPT_LEN))
    eager = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=24)
    rec = CompileRecorder()
    backend = CKVPBackend(CKVPConfig(compiler="aot_eager", enable_expert_gemm=True, **options), recorder=rec)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=dynamic_shapes):
        compiled = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=24,
                                         compile_fn=lambda m: torch.compile(m, backend=backend, fullgraph=True))
    return eager, compiled, rec


def assert_equal_logits(eager, compiled):
    assert len(eager) == len(compiled) == N_DECODE + 1
    for step, (a, b) in enumerate(zip(eager, compiled)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=lambda m: f"step {step}: {m}")


def assert_rewritten(rec: CompileRecorder, num_layers: int, gone: tuple[str, ...]):
    """Every graph: one ckvp op per layer, the pass matched every layer, and the old expert ops are gone."""
    assert rec.graphs
    for g in rec.graphs:
        assert g.fell_back == ""
        assert len(OP_CALL.findall(g.dynamo_after)) == num_layers, g.dynamo_after
        assert not OP_CALL.findall(g.dynamo_before)
        res = [r for r in g.pass_results if r.name == "expert_gemm"]
        assert len(res) == 1 and res[0].matched == num_layers and res[0].skipped == ""
        removed = dict(res[0].replaced)
        for op in gone:
            assert removed.get(op, 0) >= num_layers, (op, removed)
        assert [d.rewrite for d in g.plan.decisions if d.kind == "moe"] == [True] * num_layers


# form -> (experts_implementation, ops that must disappear)
HF_FORMS = {
    "grouped_mm_fallback": ("grouped_mm", ("transformers::grouped_mm_fallback", "sort", "histc")),
    "batched_mm": ("batched_mm", ("matmul",)),
}


@pytest.mark.parametrize("family, form", [
    ("mixtral", "grouped_mm_fallback"), ("mixtral", "batched_mm"), ("qwen2_moe", "grouped_mm_fallback"),
    ("qwen3_moe", "batched_mm"), ("olmoe", "grouped_mm_fallback"),
])  # every family and every form; the Hypothesis test below draws the other pairs
def test_hf_families_rewritten_and_equal_eager(family, form):
    impl, gone = HF_FORMS[form]
    model = build_hf_moe(family, num_layers=2, experts_implementation=impl, **FAMILY_KW.get(family, {}))
    eager, compiled, rec = run_both(model)
    assert_equal_logits(eager, compiled)
    assert_rewritten(rec, 2, gone)
    if family == "qwen2_moe":  # the gated shared expert is kept, as the model computes it
        assert all(m.shared_expert is not None for m in rec.graphs[0].analysis.moe)
        assert "sigmoid" in rec.graphs[0].dynamo_after


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_top1_unnormalised_weights_stay_in_token_order(family):
    """Top-1 without renormalisation: the weights are not 1, and a (T*A, 1) column permuted by the grouped form's
    sort has the (T, A) shape too; the pass must take them before that gather (a past bug)."""
    model = build_hf_moe(family, num_layers=1, num_experts=4, top_k=1)
    eager, compiled, rec = run_both(model, batch=2)
    assert_equal_logits(eager, compiled)
    assert_rewritten(rec, 1, HF_FORMS["grouped_mm_fallback"][1])


@given(shape=moe_model_shapes(max_layers=3, hidden_matches_heads=True), family=st.sampled_from(HF_FAMILIES),
       form=st.sampled_from(list(HF_FORMS)))
@settings(max_examples=4)
def test_hf_random_shapes_rewritten_and_equal_eager(shape, family, form):
    impl, gone = HF_FORMS[form]
    model = build_hf_moe(family, experts_implementation=impl, **FAMILY_KW.get(family, {}), **shape)
    eager, compiled, rec = run_both(model, batch=1)
    assert_equal_logits(eager, compiled)
    assert_rewritten(rec, shape["num_layers"], gone)


def test_gpt_fast_einsum_rewritten_and_equal_eager():
    torch.manual_seed(0)
    model = GptFastMoE(GptFastConfig(n_layer=2, num_experts=6, num_activated_experts=3)).eval()
    eager, compiled, rec = run_both(model, batch=1)
    assert_equal_logits(eager, compiled)
    assert_rewritten(rec, 2, ("einsum",))


def _range_loop_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """HF experts as a loop over range(E) with torch.where (one graph with dynamic output shapes)."""
    final = torch.zeros_like(hidden_states)
    expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)  # (E, A, T)
    for e in range(self.num_experts):
        slot, token = torch.where(expert_mask[e])
        gate, up = F.linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
        h = F.linear(self.act_fn(gate) * up, self.down_proj[e])
        final.index_add_(0, token, (h * top_k_weights[token, slot, None]).to(final.dtype))
    return final


def test_eager_loop_rewritten_and_equal_eager():
    model = build_hf_moe("mixtral", num_layers=2)
    for layer in model.model.layers:
        layer.mlp.experts.forward = types.MethodType(_range_loop_experts_forward, layer.mlp.experts)
    eager, compiled, rec = run_both(model, batch=1, dynamic_shapes=True)
    assert_equal_logits(eager, compiled)
    assert_rewritten(rec, 2, ("linear", "index_add_", "where"))
    for g in rec.graphs:  # the loop, its data-dependent where and their size guards are all gone
        assert "torch.where(" not in g.dynamo_after and "_assert_scalar" not in g.dynamo_after


def test_unknown_activation_left_untouched_with_warning():
    model = build_hf_moe("mixtral", num_layers=1, hidden_act="gelu")
    with pytest.warns(UnsupportedPatternWarning, match="only silu"):
        eager, compiled, rec = run_both(model, batch=1)
    assert_equal_logits(eager, compiled)
    for g in rec.graphs:
        assert not OP_CALL.findall(g.dynamo_after)
        res = [r for r in g.pass_results if r.name == "expert_gemm"][0]
        assert res.matched == 0


def test_option_off_plans_no_rewrite_and_changes_the_uuid():
    model = build_hf_moe("olmoe", num_layers=1)
    ids = torch.randint(0, 256, (1, PROMPT_LEN))
    rec = CompileRecorder()
    backend = CKVPBackend(CKVPConfig(compiler="aot_eager"), recorder=rec)
    prefill_decode_logits(model, ids, 0, max_cache_len=24,
                          compile_fn=lambda m: torch.compile(m, backend=backend, fullgraph=True))
    (decision,) = [d for d in rec.graphs[0].plan.decisions if d.kind == "moe"]
    assert not decision.rewrite and decision.reason == "enable_expert_gemm is off"
    assert not OP_CALL.findall(rec.graphs[0].dynamo_after)
    on, off = CKVPConfig(enable_expert_gemm=True), CKVPConfig()
    assert PostGradPassManager([], on.compute_hash()).uuid() != PostGradPassManager([], off.compute_hash()).uuid()


def test_pass_uuid_is_stable_and_source_keyed():
    from ckvp_compile.passes.expert_gemm import ExpertGemmPass

    assert ExpertGemmPass(()).uuid() == ExpertGemmPass(()).uuid()
    assert ExpertGemmPass(()).uuid() != PostGradPassManager([], "x").uuid()
    assert ExpertGemmPass(()).is_applicable(torch.fx.Graph()) != ""


def _biased_cond_ffn_forward(self, x, expert_indices):
    """gpt-fast experts with a per-expert bias added in place to the gate projection or to the output (HF adds
    expert biases; gpt-oss has them): not on the data path the analysis follows, and the fused op has no bias."""
    w1, w3, w2 = self.w1[expert_indices], self.w3[expert_indices], self.w2[expert_indices]
    gate = torch.einsum("ti,taoi->tao", x, w1)
    if self.bias_at == "gate":
        gate.add_(self.bias[expert_indices])
    h = F.silu(gate) * torch.einsum("ti,taoi->tao", x, w3)
    out = torch.einsum("tao,taio->tai", h, w2)
    if self.bias_at == "down":
        out.add_(self.bias[expert_indices])
    return out


@pytest.mark.parametrize("bias_at", ["gate", "down"])
def test_in_place_expert_bias_left_untouched_with_warning(bias_at):
    torch.manual_seed(0)
    model = GptFastMoE(GptFastConfig(n_layer=1)).eval()
    for block in model.layers:
        ffn = block.block_sparse_moe.cond_ffn
        width = ffn.w1.shape[1] if bias_at == "gate" else ffn.w2.shape[1]
        ffn.bias = torch.nn.Parameter(torch.randn(ffn.w1.shape[0], width))
        ffn.bias_at = bias_at
        ffn.forward = types.MethodType(_biased_cond_ffn_forward, ffn)
    with pytest.warns(UnsupportedPatternWarning, match="add_ between the"):
        eager, compiled, rec = run_both(model, batch=1)
    assert_equal_logits(eager, compiled)
    assert all(not OP_CALL.findall(g.dynamo_after) for g in rec.graphs)


class _ModuleListMoE(torch.nn.Module):
    """transformers 4.x style: router, softmax, top-k, renormalise, an nn.ModuleList of SwiGLU experts in a loop."""

    def __init__(self, dim: int = 32, num_experts: int = 4, ffn: int = 16) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(dim, num_experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.ModuleDict({
            "w1": torch.nn.Linear(dim, ffn, bias=False), "w3": torch.nn.Linear(dim, ffn, bias=False),
            "w2": torch.nn.Linear(ffn, dim, bias=False)}) for _ in range(num_experts))

    def forward(self, x):
        w, idx = torch.topk(torch.softmax(self.gate(x), -1), 2, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        mask = F.one_hot(idx, num_classes=len(self.experts)).permute(2, 1, 0)  # (E, A, T)
        for e, ex in enumerate(self.experts):
            slot, token = torch.where(mask[e])
            h = x[token]
            out.index_add_(0, token, ex["w2"](F.silu(ex["w1"](h)) * ex["w3"](h)) * w[token, slot, None])
        return out


def test_module_list_experts_left_untouched_with_warning():
    model = _ModuleListMoE().eval()
    x = torch.randn(9, 32)
    backend = CKVPBackend(CKVPConfig(compiler="aot_eager", enable_expert_gemm=True))
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), \
            pytest.warns(UnsupportedPatternWarning, match="separate 2-D down weights"), torch.no_grad():
        out = torch.compile(model, backend=backend, fullgraph=True)(x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_dynamic_token_count_and_inner_compilers(compiler):
    """dynamic=True (one graph for every prompt length) and both cheap inner compilers: rewritten, equal to eager."""
    model = build_hf_moe("mixtral", num_layers=1)
    rec = CompileRecorder()
    backend = CKVPBackend(CKVPConfig(compiler=compiler, enable_expert_gemm=True), recorder=rec)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for n in (5, 9, 13):
            ids = torch.randint(0, 256, (2, n))
            torch.testing.assert_close(compiled(ids, use_cache=False).logits, model(ids, use_cache=False).logits,
                                       rtol=1e-5, atol=1e-5)
    assert rec.graphs and all(len(OP_CALL.findall(g.dynamo_after)) == 1 for g in rec.graphs)
    assert len(rec.graphs) < 3 and any("SymInt" in g.dynamo_before for g in rec.graphs)  # symbolic token count


def test_composes_with_the_latent_kv_rewrite():
    """Both rewrites on one graph (full-rank latent cache, exact): the latent pass runs first, then the expert
    pass, and prefill + decode logits equal the dense eager model's."""
    from ckvp_compile.latent import calibrate
    from ckvp_compile.runtime.hf_cache import CKVPStaticCache
    from ckvp_compile.testing.decoding import hf_step_kwargs

    model = build_hf_moe("qwen2_moe", num_layers=2)
    samples = [torch.randint(0, 256, (1, 20)) for _ in range(3)]
    bases = calibrate(model, samples, group_size=2, kv_ratio=1.0, progress=False)
    ids = torch.randint(0, 256, (1, PROMPT_LEN))
    eager = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=24)
    cache = CKVPStaticCache(model.config, bases, max_cache_len=24, max_batch_size=1)
    rec = CompileRecorder()
    backend = CKVPBackend(CKVPConfig(compiler="aot_eager", enable_expert_gemm=True), recorder=rec)
    step = torch.compile(model, backend=backend, fullgraph=True)
    outs = []
    with torch.no_grad():
        out = step(**hf_step_kwargs(model, ids, cache, 0)).logits
        outs.append(out)
        for i in range(N_DECODE):
            out = step(**hf_step_kwargs(model, out[:, -1:].argmax(-1), cache, PROMPT_LEN + i)).logits
            outs.append(out)
    assert_equal_logits(eager, outs)
    for g in rec.graphs:
        assert [(r.name, r.matched) for r in g.pass_results] == [("latent_kv_cache", 2), ("expert_gemm", 2)]


@pytest.mark.slow
def test_full_inductor_output_code_calls_the_ckvp_op():
    """Full Inductor (CPU): the rewritten graph compiles, the ckvp op's lowering is in the generated code (routing
    and the two GEMMs as extern calls: on CPU the reference parts run), the HF experts' grouped_mm fallback is not,
    and logits equal eager."""
    from torch._inductor.utils import run_and_get_code

    model = build_hf_moe("qwen2_moe", num_layers=1)
    ids = torch.randint(0, 256, (1, PROMPT_LEN))
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model, backend="ckvp", options={"enable_expert_gemm": True})
        out, codes = run_and_get_code(lambda: compiled(ids, use_cache=False).logits)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    code = "\n".join(codes)
    for part in ("torch.ops.ckvp.moe_align.default(", "extern_kernels.ckvp_moe_gate_up_extern(",
                 "extern_kernels.ckvp_moe_down_extern("):
        assert part in code, part
    assert "grouped_mm_fallback" not in code
