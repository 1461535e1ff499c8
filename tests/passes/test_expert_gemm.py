"""Tests of the expert GEMM rewrite (ckvp_compile/passes/expert_gemm.py) through the backend.

* Whole models with ``enable_expert_gemm=True`` (HF Mixtral / Qwen2-MoE with its gated shared expert /
  Qwen3-MoE / OLMoE, grouped_mm (fp32: the opaque fallback op) and batched_mm, a captured eager loop over
  range(E), gpt-fast einsum; Hypothesis shapes; fp32): logits equal eager for prefill and decode steps.
* The rewrite happened: one ``ckvp::moe_experts`` per layer in every graph (two with a shared expert), and the
  old expert GEMMs, sorts and gathers are gone from the graph (PassResult.replaced, the graph code).
* Shared experts (Hypothesis: shapes, weights, shared width, gated (Qwen2-MoE) or ungated on the 2-D or the
  (B, S, Dm) input (DeepSeek-V3 / HunYuan-MoE form), both experts forms; dynamic token counts; HunYuan-MoE):
  rewritten into a second ``ckvp::moe_experts`` call with one expert, logits equal eager, the shared expert's
  nodes gone. A shared expert of another form (GELU, a biased gate) is left with a warning and a pass note.
* A site the pass does not understand (a GELU expert) is left untouched with an UnsupportedPatternWarning.
* Eager-loop accumulators: summed from zeros (in place, out-of-place chains, index_put / scatter_add) rewritten;
  an initial value, an alpha, an overwriting index_put or a write between the accumulations left with the reason.
* The plan marks MoE sites as rewritten only when the option is on ('auto': graphs on CUDA, without gradients);
  the pass manager's uuid follows the option.
"""

from __future__ import annotations

import re
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ckvp_compile import CKVPBackend, CKVPConfig, CompileRecorder, UnsupportedPatternWarning
from ckvp_compile import backend as ckvp_backend
from ckvp_compile.backend import EXPERT_GEMM_GRAD, resolve_expert_gemm
from ckvp_compile.passes import PostGradPassManager
from ckvp_compile.plan import EXPERT_GEMM_AUTO_OFF, EXPERT_GEMM_OFF
from ckvp_compile.testing import HF_FAMILIES, GptFastConfig, GptFastMoE, build_hf_moe, prefill_decode_logits
from ckvp_compile.testing.strategies import moe_model_shapes

N_DECODE = 3
PROMPT_LEN = 6
OP_CALL = re.compile(r"torch\.ops\.ckvp\.moe_experts\.default\(")
FAMILY_KW = {"qwen3_moe": {"norm_topk_prob": True}}
#: ckvp::moe_experts calls per layer after the rewrite: the routed experts, and the shared expert where there is one.
CALLS_PER_LAYER = {"qwen2_moe": 2}


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


def assert_rewritten(rec: CompileRecorder, num_layers: int, gone: tuple[str, ...], calls_per_layer: int = 1):
    """Every graph: ``calls_per_layer`` ckvp ops per layer, the pass matched every layer, and the old expert ops are
    gone."""
    assert rec.graphs
    for g in rec.graphs:
        assert g.fell_back == ""
        assert len(OP_CALL.findall(g.dynamo_after)) == num_layers * calls_per_layer, g.dynamo_after
        assert not OP_CALL.findall(g.dynamo_before)
        res = [r for r in g.pass_results if r.name == "expert_gemm"]
        assert len(res) == 1 and res[0].matched == num_layers and res[0].skipped == ""
        removed = dict(res[0].replaced)
        for op in gone:
            assert removed.get(op, 0) >= num_layers, (op, removed)
        assert [d.rewrite for d in g.plan.decisions if d.kind == "moe"] == [True] * num_layers


def assert_shared_expert_gone(rec: CompileRecorder, gated: bool):
    """Every graph: every site has a shared expert, and its gate / up / down linears are no longer defined in the
    rewritten graph (nor any silu); the gate's linear stays when gated (its sigmoid is the op's routing weight); the
    pass left no note."""
    for g in rec.graphs:
        after = g.dynamo_after
        assert g.analysis.moe and all(m.shared_expert is not None for m in g.analysis.moe)
        for m in g.analysis.moe:
            sh = m.shared_expert
            assert (sh.gate_node is not None) == gated, sh
            for name in (*sh.gate_up_nodes, sh.down_node):
                assert not re.search(rf"^\s+{name} = ", after, re.M), (name, after)
            if gated:
                assert re.search(rf"^\s+{sh.gate_node} = ", after, re.M), (sh.gate_node, after)
        assert "silu" not in after
        (res,) = [r for r in g.pass_results if r.name == "expert_gemm"]
        assert res.notes == () and dict(res.replaced).get("linear", 0) >= 3 * len(g.analysis.moe)


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
    assert_rewritten(rec, 2, gone, CALLS_PER_LAYER.get(family, 1))
    if family == "qwen2_moe":  # the gated shared expert is the second call; its gate's sigmoid is kept as weights
        assert_shared_expert_gone(rec, gated=True)


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_top1_unnormalised_weights_stay_in_token_order(family):
    """Top-1 without renormalisation: the weights are not 1, and a (T*A, 1) column permuted by the grouped form's
    sort has the (T, A) shape too; the pass must take them before that gather (a past bug)."""
    model = build_hf_moe(family, num_layers=1, num_experts=4, top_k=1)
    eager, compiled, rec = run_both(model, batch=2)
    assert_equal_logits(eager, compiled)
    assert_rewritten(rec, 1, HF_FORMS["grouped_mm_fallback"][1], CALLS_PER_LAYER.get(family, 1))


@given(shape=moe_model_shapes(max_layers=3, hidden_matches_heads=True), family=st.sampled_from(HF_FAMILIES),
       form=st.sampled_from(list(HF_FORMS)))
@settings(max_examples=3)
def test_hf_random_shapes_rewritten_and_equal_eager(shape, family, form):
    impl, gone = HF_FORMS[form]
    model = build_hf_moe(family, experts_implementation=impl, **FAMILY_KW.get(family, {}), **shape)
    eager, compiled, rec = run_both(model, batch=1)
    assert_equal_logits(eager, compiled)
    assert_rewritten(rec, shape["num_layers"], gone, CALLS_PER_LAYER.get(family, 1))


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


@pytest.mark.parametrize("value, reason", [(False, EXPERT_GEMM_OFF), ("auto", EXPERT_GEMM_AUTO_OFF)])
def test_option_off_plans_no_rewrite_and_changes_the_uuid(value, reason):
    """False, and the default 'auto' on CPU, keep the experts; the decision names the option that turns the rewrite
    on; the pass manager's uuid follows the option."""
    model = build_hf_moe("olmoe", num_layers=1)
    ids = torch.randint(0, 256, (1, PROMPT_LEN))
    rec = CompileRecorder()
    backend = CKVPBackend(CKVPConfig(compiler="aot_eager", enable_expert_gemm=value), recorder=rec)
    prefill_decode_logits(model, ids, 0, max_cache_len=24,
                          compile_fn=lambda m: torch.compile(m, backend=backend, fullgraph=True))
    (decision,) = [d for d in rec.graphs[0].plan.decisions if d.kind == "moe"]
    assert not decision.rewrite and decision.reason == reason
    assert "set enable_expert_gemm=True" in decision.reason  # the decision names the option that turns it on
    assert not OP_CALL.findall(rec.graphs[0].dynamo_after)
    on, off = CKVPConfig(enable_expert_gemm=True), CKVPConfig(enable_expert_gemm=value)
    assert PostGradPassManager([], on.compute_hash()).uuid() != PostGradPassManager([], off.compute_hash()).uuid()


def test_auto_resolves_on_for_cuda_inference_graphs_only():
    """'auto' turns the rewrite on where a graph input is a CUDA tensor and no gradients are needed; True and False
    are kept as given."""
    cuda, cpu = types.SimpleNamespace(device=torch.device("cuda")), torch.zeros(1)
    weight = torch.zeros(1, requires_grad=True)
    auto = CKVPConfig()
    assert resolve_expert_gemm(auto, [cpu, cuda]).enable_expert_gemm is True
    assert resolve_expert_gemm(auto, [cpu]).enable_expert_gemm == "auto"
    with torch.no_grad():
        assert resolve_expert_gemm(auto, [cuda, weight]).enable_expert_gemm is True
    assert resolve_expert_gemm(auto, [cuda, weight]).enable_expert_gemm == "auto"  # grad mode on, a parameter
    for value in (True, False):
        assert resolve_expert_gemm(CKVPConfig(enable_expert_gemm=value), [cuda]).enable_expert_gemm is value


def test_auto_on_cuda_rewrites_and_stays_equal(monkeypatch):
    """The default 'auto' on a graph taken for CUDA (its device test patched, so the CPU reference op runs):
    every MoE layer rewritten, logits equal eager; the same call needing gradients keeps the experts and says why
    (torch.no_grad()), with no warning about an option the user never set."""
    monkeypatch.setattr(ckvp_backend, "_on_cuda", lambda example_inputs: True)
    model = build_hf_moe("mixtral", num_layers=2)
    ids = torch.randint(0, 256, (2, PROMPT_LEN))
    eager = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=24)
    rec = CompileRecorder()
    backend = CKVPBackend(CKVPConfig(compiler="aot_eager"), recorder=rec)
    torch._dynamo.reset()
    compiled = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=24,
                                     compile_fn=lambda m: torch.compile(m, backend=backend, fullgraph=True))
    assert_equal_logits(eager, compiled)
    assert_rewritten(rec, 2, ())
    rec = CompileRecorder()
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model, backend=CKVPBackend(CKVPConfig(compiler="aot_eager"), recorder=rec))(ids, use_cache=False)
    # (transformers 5.17 with torch 2.11 runs grouped_mm experts that need gradients through a fallback that breaks
    # the graph before the experts: its own warning, about no option)
    assert not [w for w in caught if "enable_expert_gemm" in str(w.message)]
    reasons = {d.reason for d in rec.graphs[0].plan.decisions if d.kind == "moe"}
    assert reasons == {EXPERT_GEMM_GRAD} or (not reasons and {u.kind for u in rec.graphs[0].plan.unsupported}
                                             == {"eager_loop_graph_break"}), (reasons, rec.graphs[0].plan.unsupported)
    torch._dynamo.reset()


def test_option_on_but_grad_mode_decision_names_no_grad_not_the_option():
    """With the option on, a call that needs gradients keeps the experts (inference-only op): the decision says
    so and names torch.no_grad(), not the option the user already set."""
    model = build_hf_moe("olmoe", num_layers=1)
    rec = CompileRecorder()
    compiled = torch.compile(model, backend=CKVPBackend(CKVPConfig(compiler="aot_eager", enable_expert_gemm=True),
                                                        recorder=rec))
    with pytest.warns(UnsupportedPatternWarning, match="inference-only"):
        compiled(torch.randint(0, 256, (1, PROMPT_LEN)), use_cache=False)
    (decision,) = [d for d in rec.graphs[0].plan.decisions if d.kind == "moe"]
    assert not decision.rewrite and decision.reason == EXPERT_GEMM_GRAD
    assert "torch.no_grad()" in decision.reason and "enable_expert_gemm" not in decision.reason


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


class _EinsumMoE(torch.nn.Module):
    """A gpt-fast-style einsum MoE layer (weights gathered by the top-k ids) with one change to its expert body or
    wiring, by ``variant``; 'swiglu' is the form the op computes. Weights (E, I, Dm) gate / up and (E, Dm, I) down,
    or transposed where the variant says so (I == Dm, so the shapes cannot tell)."""

    def __init__(self, variant: str, dim: int = 24, num_experts: int = 5, ffn: int = 24) -> None:
        super().__init__()
        self.variant = variant
        self.gate = torch.nn.Linear(dim, num_experts, bias=False)
        self.w1 = torch.nn.Parameter(torch.randn(num_experts, ffn, dim) * 0.2)
        self.w2 = torch.nn.Parameter(torch.randn(num_experts, dim, ffn) * 0.2)
        self.w3 = torch.nn.Parameter(torch.randn(num_experts, ffn, dim) * 0.2)
        self.scale = torch.nn.Parameter(torch.rand(ffn) + 0.5)
        self.perm = torch.nn.Parameter(torch.randperm(num_experts), requires_grad=False)
        self.register_buffer("feature_perm", torch.randperm(dim))
        self.register_buffer("ffn_perm", torch.randperm(ffn))
        self.register_buffer("keep", torch.tensor([True, False, True, True, False, True, True]))  # 7 tokens
        self.register_buffer("slot_perm", torch.tensor([1, 0]))

    def forward(self, x):
        v, e = self.variant, self.w1.shape[0]
        w, idx = torch.topk(F.softmax(self.gate(x), dim=-1), 2, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        w = w[:, self.slot_perm] if v == "weights_perm" else w
        xe = x * 2 if v == "input_scaled" else x[:, self.feature_perm] if v == "input_perm" else x
        gidx = {"ids_perm": self.perm[idx], "ids_shift": (idx + 1) % e}.get(v, idx)
        gate = torch.einsum("ti,taio->tao" if v == "gate_transposed" else "ti,taoi->tao", xe, self.w1[gidx])
        up = torch.einsum("ti,taoi->tao", xe, self.w3[gidx])
        up = up[..., self.ffn_perm] if v == "up_perm" else up
        h = F.silu(gate) * (F.silu(up) if v == "silu_both" else up)
        h = {"times_const": h * 0.5, "times_param": h * self.scale}.get(v, h)
        eq = "tao,taoi->tai" if v == "down_transposed" else "tao,taio->tai"
        out = torch.einsum(eq, h, self.w2[gidx])
        out = out.masked_fill(~self.keep[:, None, None], 0.0) if v == "out_masked" else out
        return torch.einsum("tai,ta->ti", out, w)


@pytest.mark.parametrize("variant, reason", [
    ("times_const", "product of two tensors"),
    ("times_param", "silu outputs"),
    ("silu_both", "2 silu outputs"),
    ("input_scaled", "not the router's input"),
    ("ids_perm", "not the top-k's indices"),
    ("ids_shift", "not the top-k's indices"),
    ("gate_transposed", "does not contract the last dimension"),
    ("down_transposed", "does not contract the last dimension"),
    ("input_perm", "not the router's input"),
    ("up_perm", "getitem between the expert GEMMs"),
    ("out_masked", "masked_fill between the down GEMM"),
    ("weights_perm", "not computed from the top-k's indices"),
])
def test_expert_body_other_than_swiglu_left_untouched(variant, reason):
    """Anything but down(silu(x W_gate) * (x W_up)) with the top-k's own ids and (E, out, in) weights is left as the
    model computes it, with the reason (each of these was once rewritten as plain SwiGLU: wrong logits; a feature
    permutation by tensor indexing and a padding mask were taken for token gathers and the sentinel mask, and the
    routing weights were taken from above a fixed permutation of the slots)."""
    torch.manual_seed(0)
    x = torch.randn(7, 24)
    rec = CompileRecorder()
    backend = CKVPBackend(CKVPConfig(compiler="aot_eager", enable_expert_gemm=True), recorder=rec)
    model = _EinsumMoE("swiglu").eval()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=backend, fullgraph=True)(x), model(x),
                                   rtol=1e-5, atol=1e-5)
    assert [len(OP_CALL.findall(g.dynamo_after)) for g in rec.graphs] == [1]  # the plain form is rewritten
    torch._dynamo.reset()
    rec = CompileRecorder()
    backend = CKVPBackend(CKVPConfig(compiler="aot_eager", enable_expert_gemm=True), recorder=rec)
    model = _EinsumMoE(variant).eval()
    with pytest.warns(UnsupportedPatternWarning, match=reason), torch.no_grad():
        out = torch.compile(model, backend=backend, fullgraph=True)(x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    assert all(not OP_CALL.findall(g.dynamo_after) for g in rec.graphs)


class _Fp32RouterMoE(torch.nn.Module):
    """A bf16 einsum MoE layer whose router runs in fp32 (``F.linear(x.float(), W.float())``, as DeepSeek-V3 and
    others compute router logits): the router's input is fp32, the experts' input and weights bf16."""

    def __init__(self, dim: int = 16, num_experts: int = 4, ffn: int = 8) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(dim, num_experts, bias=False, dtype=torch.bfloat16)
        self.w1, self.w3 = (torch.nn.Parameter(torch.randn(num_experts, ffn, dim, dtype=torch.bfloat16) * 0.3)
                            for _ in range(2))
        self.w2 = torch.nn.Parameter(torch.randn(num_experts, dim, ffn, dtype=torch.bfloat16) * 0.3)

    def forward(self, x):
        w, idx = torch.topk(F.softmax(F.linear(x.float(), self.gate.weight.float()), dim=-1), 2, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        h = F.silu(torch.einsum("ti,taoi->tao", x, self.w1[idx])) * torch.einsum("ti,taoi->tao", x, self.w3[idx])
        return torch.einsum("tai,ta->ti", torch.einsum("tao,taio->tai", h, self.w2[idx]), w)


def test_fp32_router_on_bf16_experts_rewritten_with_the_experts_input():
    """The op's input is the tensor the experts read in their weights' dtype, not the router's fp32 cast of it (the
    op refused the fp32 input against bf16 weights, and the compile failed with a CKVPShapeError)."""
    torch.manual_seed(0)
    model = _Fp32RouterMoE().eval()
    x = torch.randn(7, 16, dtype=torch.bfloat16)
    rec = CompileRecorder()
    backend = CKVPBackend(CKVPConfig(compiler="aot_eager", enable_expert_gemm=True), recorder=rec)
    with torch.no_grad():
        out = torch.compile(model, backend=backend, fullgraph=True)(x)
        ref = model(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    assert [len(OP_CALL.findall(g.dynamo_after)) for g in rec.graphs] == [1]


class _AccumulatingLoopMoE(torch.nn.Module):
    """A loop over range(E) (torch.where) whose expert outputs are summed into an accumulator in the way ``variant``
    says; the first four sum from zeros (the op computes that), the others do something else with the accumulator."""

    def __init__(self, variant: str, dim: int = 16, num_experts: int = 4, ffn: int = 8) -> None:
        super().__init__()
        self.variant = variant
        self.gate = torch.nn.Linear(dim, num_experts, bias=False)
        self.gate_up = torch.nn.Parameter(torch.randn(num_experts, 2 * ffn, dim) * 0.3)
        self.down = torch.nn.Parameter(torch.randn(num_experts, dim, ffn) * 0.3)

    def forward(self, x):
        v = self.variant
        w, idx = torch.topk(F.softmax(self.gate(x), -1), 2, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        acc = x.clone() if v == "init_clone" else torch.ones_like(x) if v == "init_ones" else torch.zeros_like(x)
        mask = F.one_hot(idx, num_classes=self.gate_up.shape[0]).permute(2, 1, 0)  # (E, A, T)
        for e in range(self.gate_up.shape[0]):
            slot, token = torch.where(mask[e])
            g, u = F.linear(x[token], self.gate_up[e]).chunk(2, dim=-1)
            out = F.linear(F.silu(g) * u, self.down[e]) * w[token, slot, None]
            if v == "index_add":
                acc = acc.index_add(0, token, out)
            elif v == "index_put_accumulate":
                acc.index_put_((token,), out, accumulate=True)
            elif v == "scatter_add_":
                acc.scatter_add_(0, token[:, None].expand(-1, x.shape[1]), out)
            elif v == "alpha":
                acc.index_add_(0, token, out, alpha=2.0)
            elif v == "index_put_overwrite":
                acc.index_put_((token,), out)
            else:
                acc.index_add_(0, token, out)
                if v == "scaled_between" and e == 1:
                    acc.mul_(0.5)
        return acc


@pytest.mark.parametrize("variant, reason", [
    ("index_add_", None), ("index_add", None), ("index_put_accumulate", None), ("scatter_add_", None),
    ("init_clone", "not a fresh zero tensor"), ("init_ones", "not a fresh zero tensor"),
    ("alpha", "not a plain sum"), ("index_put_overwrite", "not a plain sum"),
    ("scaled_between", "between its accumulations"),
])
def test_eager_loop_accumulation_summed_from_zeros_or_left(variant, reason):
    """An eager loop's accumulator is replaced by the op's output, so it must hold exactly the sum of the weighted
    expert outputs: a fresh zero tensor with one plain accumulation per expert (in place or a chain of out-of-place
    ones). An initial value, an alpha, an overwriting index_put or a write between the accumulations is refused
    with the reason (each was once rewritten, with wrong outputs)."""
    torch.manual_seed(0)
    model = _AccumulatingLoopMoE(variant).eval()
    x = torch.randn(7, 16)
    rec = CompileRecorder()
    backend = CKVPBackend(CKVPConfig(compiler="aot_eager", enable_expert_gemm=True), recorder=rec)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), torch.no_grad(), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(model, backend=backend, fullgraph=True)(x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    messages = [str(w.message) for w in caught if issubclass(w.category, UnsupportedPatternWarning)]
    calls = [len(OP_CALL.findall(g.dynamo_after)) for g in rec.graphs]
    if reason is None:
        assert calls == [1] and not messages, messages
    else:
        assert calls == [0] and any(reason in m for m in messages), messages


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
        assert [(r.name, r.matched) for r in g.pass_results if r.stage == "torch"] == [("latent_kv_cache", 2),
                                                                                       ("expert_gemm", 2)]
        assert [r.name for r in g.pass_results if r.stage == "post_grad"] == ["store_write_order"]


@pytest.mark.parametrize("failure", ["raises", "malformed"])
def test_expert_pass_failure_in_a_latent_graph_keeps_the_latent_rewrite(monkeypatch, failure):
    """A latent-cache graph cannot run unrewritten, so an expert pass that fails there (raises, or leaves a graph
    that fails FX's lint: a node used before it is defined) is dropped: the graph compiles with the latent KV rewrite
    alone and the experts as written, with a warning naming the failure and the option, and none of the failed
    attempt's own warnings (layer 0's skipped shared expert says its routed experts are rewritten: they are not);
    the record keeps the reason, ckvp-inspect's text shows it and its decisions say the experts were kept; the
    logits equal the latent cache's without the expert rewrite. With strict=True the failure is an error naming the
    option instead."""
    import warnings

    from ckvp_compile import CompileRecorder
    from ckvp_compile.backend import CKVPBackend
    from ckvp_compile.config import CKVPConfig
    from ckvp_compile.errors import UnsupportedGraphError, UnsupportedPatternWarning
    from ckvp_compile.inspection.render import _graph_text
    from ckvp_compile.inspection.report import GraphReport
    from ckvp_compile.latent import calibrate
    from ckvp_compile.passes import expert_gemm
    from ckvp_compile.runtime.hf_cache import CKVPStaticCache
    from ckvp_compile.testing.decoding import hf_step_kwargs

    true_rewrite = expert_gemm._rewrite

    def rewrite(graph, rw, site):
        if site.layer == 0:
            return true_rewrite(graph, rw, site)
        if failure == "raises":
            raise RuntimeError("a rewrite bug (test)")
        true_rewrite(graph, rw, site)
        last = [n for n in graph.nodes if n.op == "call_function"][-1]
        with graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder")):
            graph.call_function(torch.neg, (last,))  # a rewrite bug (test): used before it is defined

    def understand_shared(graph, site):
        raise expert_gemm._Skip("a shared expert of another form (test)")

    model = build_hf_moe("qwen2_moe", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    bases = calibrate(model, [torch.randint(0, 256, (1, 12)) for _ in range(2)], group_size=2, kv_ratio=1.0,
                      progress=False)
    ids = torch.randint(0, 256, (1, PROMPT_LEN))

    def run(options, rec=None):
        torch._dynamo.reset()
        backend = CKVPBackend(CKVPConfig(compiler="aot_eager", **options), recorder=rec)
        step = torch.compile(model, backend=backend, fullgraph=True)
        with torch.no_grad():
            return step(**hf_step_kwargs(model, ids, CKVPStaticCache(model.config, bases, 24), 0)).logits

    without = run({"enable_expert_gemm": False})
    monkeypatch.setattr(expert_gemm, "_rewrite", rewrite)
    monkeypatch.setattr(expert_gemm, "_understand_shared", understand_shared)
    bug = "a rewrite bug (test)" if failure == "raises" else "used before it has been defined"
    rec = CompileRecorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dropped = run({"enable_expert_gemm": True}, rec)
    msgs = [str(w.message) for w in caught if issubclass(w.category, UnsupportedPatternWarning)]
    assert any("the expert GEMM rewrite failed" in m and bug in m
               and "'enable_expert_gemm': False" in m for m in msgs), msgs
    assert not any("another form (test)" in m for m in msgs), msgs
    torch.testing.assert_close(dropped, without, rtol=0, atol=0)
    (g,) = rec.graphs
    assert not g.fell_back and bug in g.dropped_passes["expert_gemm"]
    assert [(r.name, r.matched) for r in g.pass_results if r.stage == "torch"] == [("latent_kv_cache", 2)]
    assert g.dynamo_after.count("ckvp.latent_append") >= 2
    report = GraphReport.from_record(g, "prefill")
    text = "\n".join(_graph_text(report, False))
    assert "DROPPED the expert_gemm pass" in text and bug in text
    assert [ln for ln in report.decision_lines() if ln.startswith("moe")] == [
        f"moe [0-1]: kept: the expert GEMM pass failed and was dropped: {g.dropped_passes['expert_gemm']}"]
    with pytest.raises(UnsupportedGraphError, match="the expert GEMM rewrite failed") as e:
        run({"enable_expert_gemm": True, "strict": True})
    assert "'enable_expert_gemm': False" in str(e.value) and bug in str(e.value)
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------ shared experts


def _ungated_shared_forward(self, hidden_states):
    """Qwen2-MoE's block with an ungated shared expert on the (B, S, Dm) input, added to the routed output after it
    is reshaped back (the DeepSeek-V3 / HunYuan-MoE form)."""
    b, s, d = hidden_states.shape
    flat = hidden_states.view(-1, d)
    _, weights, ids = self.gate(flat)
    return self.experts(flat, ids, weights).reshape(b, s, d) + self.shared_expert(hidden_states)


def _ungated_flat_shared_forward(self, hidden_states):
    """Qwen2-MoE's block with an ungated shared expert on the flattened (T, Dm) input."""
    b, s, d = hidden_states.shape
    flat = hidden_states.view(-1, d)
    _, weights, ids = self.gate(flat)
    return (self.experts(flat, ids, weights) + self.shared_expert(flat)).reshape(b, s, d)


#: shared-expert form -> the Qwen2-MoE block forward that computes it (None: the model's own, sigmoid-gated)
SHARED_FORMS = {"gated": None, "ungated_3d": _ungated_shared_forward, "ungated_2d": _ungated_flat_shared_forward}


def build_shared(form: str, **kwargs):
    """A tiny Qwen2-MoE whose MoE blocks compute their shared expert in ``form`` (:data:`SHARED_FORMS`)."""
    model = build_hf_moe("qwen2_moe", **kwargs)
    if SHARED_FORMS[form] is not None:
        for layer in model.model.layers:
            layer.mlp.forward = types.MethodType(SHARED_FORMS[form], layer.mlp)
    return model


@given(shape=moe_model_shapes(max_layers=2), form=st.sampled_from(list(SHARED_FORMS)),
       shared_ffn=st.sampled_from([8, 24, 48, 72]), seed=st.integers(0, 2**16), experts=st.sampled_from(list(HF_FORMS)),
       batch=st.integers(1, 2))
@settings(max_examples=6)
def test_shared_expert_rewritten_and_equal_eager(shape, form, shared_ffn, seed, experts, batch):
    """Random shapes, weights and shared width, gated or not: the shared expert becomes a second ckvp::moe_experts
    call (one expert) and the logits of prefill and decode steps stay within fp32 rounding of eager."""
    impl, gone = HF_FORMS[experts]
    model = build_shared(form, experts_implementation=impl, seed=seed, shared_expert_intermediate_size=shared_ffn,
                         **shape)
    eager, compiled, rec = run_both(model, batch=batch)
    assert_equal_logits(eager, compiled)
    for a, b in zip(eager, compiled):
        assert float((b - a).norm() / a.norm()) <= 1e-5
    assert_rewritten(rec, shape["num_layers"], gone, calls_per_layer=2)
    assert_shared_expert_gone(rec, gated=form == "gated")


@pytest.mark.parametrize("form", ["gated", "ungated_3d"])
def test_shared_expert_with_a_dynamic_token_count(form):
    """dynamic=True: the one-expert call's ids / weights / reshapes follow the symbolic token count."""
    model = build_shared(form, num_layers=1)
    rec = CompileRecorder()
    backend = CKVPBackend(CKVPConfig(compiler="aot_eager", enable_expert_gemm=True), recorder=rec)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for n in (5, 9, 13):
            ids = torch.randint(0, 256, (2, n))
            torch.testing.assert_close(compiled(ids, use_cache=False).logits, model(ids, use_cache=False).logits,
                                       rtol=1e-5, atol=1e-5)
    assert any("SymInt" in g.dynamo_before for g in rec.graphs)
    assert all(len(OP_CALL.findall(g.dynamo_after)) == 2 for g in rec.graphs)
    assert_shared_expert_gone(rec, gated=form == "gated")


def _gelu_shared_expert(model) -> None:
    for layer in model.model.layers:
        layer.mlp.shared_expert.act_fn = torch.nn.GELU()


def _biased_shared_gate(model) -> None:
    for layer in model.model.layers:
        layer.mlp.shared_expert_gate = torch.nn.Linear(model.config.hidden_size, 1, bias=True)


@pytest.mark.parametrize("change, reason", [(_gelu_shared_expert, "only silu(gate) * up"),
                                            (_biased_shared_gate, "has a bias")])
def test_shared_expert_of_another_form_left_with_a_note(change, reason):
    """The analysis reports these shared experts, but the op computes SwiGLU with a bias-free gate only: the routed
    experts are rewritten, the shared expert runs as the model writes it, with a warning and a pass note."""
    model = build_hf_moe("qwen2_moe", num_layers=2)
    change(model)
    with pytest.warns(UnsupportedPatternWarning, match="shared expert is left as the model computes it"):
        eager, compiled, rec = run_both(model, batch=1)
    assert_equal_logits(eager, compiled)
    assert_rewritten(rec, 2, HF_FORMS["grouped_mm_fallback"][1], calls_per_layer=1)
    for g in rec.graphs:
        (res,) = [r for r in g.pass_results if r.name == "expert_gemm"]
        assert [layer for layer, _ in res.notes] == [0, 1], res.notes
        assert all(reason in note for _, note in res.notes), res.notes
        assert all(re.search(rf"^\s+{m.shared_expert.down_node} = ", g.dynamo_after, re.M) for m in g.analysis.moe)


def test_hunyuan_moe_ungated_shared_expert():
    """A transformers model with an ungated shared expert (HunYuan-MoE: ``shared_mlp`` on the (B, S, Dm) hidden
    states, added to the reshaped routed output): rewritten, equal to eager."""
    pytest.importorskip("transformers.models.hunyuan_v1_moe")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "hunyuan_v1_moe", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=32, num_experts=4, moe_topk=2,
        max_position_embeddings=128, initializer_range=0.1, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="grouped_mm").eval()
    rec = CompileRecorder()
    backend = CKVPBackend(CKVPConfig(compiler="aot_eager", enable_expert_gemm=True), recorder=rec)
    ids = torch.randint(0, 256, (2, PROMPT_LEN))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        got = torch.compile(model, backend=backend, fullgraph=True)(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert_rewritten(rec, 2, HF_FORMS["grouped_mm_fallback"][1], calls_per_layer=2)
    assert_shared_expert_gone(rec, gated=False)


@pytest.mark.slow
def test_full_inductor_output_code_calls_the_ckvp_op():
    """Full Inductor (CPU): the rewritten graph compiles, the ckvp op's lowering is in the generated code (routing
    and the two GEMMs as extern calls: on CPU the reference parts run), for the routed experts and for the shared
    expert (E = 1, whose routing is Inductor IR, no moe_align call), the HF experts' grouped_mm fallback is not,
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
    for part in ("extern_kernels.ckvp_moe_gate_up_extern(", "extern_kernels.ckvp_moe_down_extern("):
        assert code.count(part) == 2, part  # the routed experts and the shared expert (one expert)
    # the shared expert's routing (one expert: the identity) is built in Inductor IR, without a moe_align call
    assert code.count("torch.ops.ckvp.moe_align.default(") == 1
    assert "grouped_mm_fallback" not in code
