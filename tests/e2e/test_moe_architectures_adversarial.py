"""The expert-dispatch (MoE) rewrite and expert offload on the MoE architectures of the installed transformers, beyond
the four families of ``testing.models.HF_FAMILIES``: each case must be exact (fp32 tolerance), or left as the model
computes it with the reason reported, or refused with an error naming the fix.

* Architectures whose experts the rewrite reads (GraniteMoE, GraniteMoE-shared, FlexOlmo, Cohere2-MoE, HunYuan-MoE,
  MiniMax-M2's routing aside): compiled logits (prefill + decode, static cache) equal eager ones, every MoE site is
  either rewritten into ``ckvp::moe_experts`` or named in a warning, and nothing is rewritten silently wrong.
* ``output_router_logits=True`` (HF's load-balancing loss): a second top-k over each router's scores, outside the
  experts. It was reported as ``unknown_experts_form`` in every layer, with a false fix (use
  ``experts_implementation="grouped_mm"``, which the model already used), and it blocked every layer's rewrite;
  with offloaded experts and the ``expert_offload`` option the backend refused the graph (offload the model first).
* A planned MoE site that the expert GEMM pass then leaves untouched: the reason must reach the pass's notes (what
  ckvp-inspect prints under "passes:"), not only a warning; and ckvp-inspect's decision line must not claim a rewrite.
* MoE layers without a top-k-dispatched expert GEMM (PhiMoE's sparsemixer, Llama-4's dense experts applied to
  score-scaled inputs) must be reported (a site or an unsupported pattern per layer), not passed over in silence
  (ckvp-inspect said "0 MoE sites", "unsupported: none").
* Expert offload (``ckvp_compile.offload_experts``): experts whose gate is not plain ``silu(gate) * up``
  (DeepSeek-V4's ``swiglu_limit`` clamp in ``_apply_gate``, MuseSpark's post-expert norm) must be refused or stay
  exact; option values of the wrong type must raise ``CKVPConfigError`` and leave the model usable.

All on CPU with ``compiler="aot_eager"``; each case builds a 2-layer model of hidden 64 with 6 experts (not a power
of two) and runs in a few seconds.

Status (2026-12-05): the aux-loss top-k, the pass notes and the PhiMoE / Llama-4 reports are fixed in the MoE files
(analysis/moe.py, passes/expert_gemm.py). Still failing, their fixes lie outside the MoE files:
``test_inspect_does_not_claim_a_rewrite_the_pass_did_not_make`` (plan / inspection report),
``test_offload_refuses_or_keeps_experts_that_are_not_plain_swiglu`` and
``test_offload_option_of_the_wrong_type_is_a_config_error_and_the_model_still_runs`` (runtime/offload.py).
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch

import ckvp_compile
from ckvp_compile import CKVPBackend, CKVPConfig, CKVPConfigError, CompileRecorder
from ckvp_compile.testing import prefill_decode_logits

OP_CALL = re.compile(r"torch\.ops\.ckvp\.moe_experts\.default\(")
E = 6
LAYERS = 2
COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False,
              bos_token_id=None, eos_token_id=None, pad_token_id=None, use_cache=True, intermediate_size=32)
#: per model type: the config fields that make it a tiny, all-sparse, full-attention MoE with E experts, top-2
FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=E, num_experts_per_tok=2, sliding_window=None),
    "qwen2_moe": dict(num_experts=E, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32, mlp_only_layers=[], use_sliding_window=False),
    "olmoe": dict(num_experts=E, num_experts_per_tok=2),
    "granitemoe": dict(num_local_experts=E, num_experts_per_tok=2),
    "granitemoeshared": dict(num_local_experts=E, num_experts_per_tok=2, shared_intermediate_size=32),
    "flex_olmo": dict(num_experts=E, num_experts_per_tok=2),
    "cohere2_moe": dict(num_experts=E, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1),
    "hunyuan_v1_moe": dict(num_experts=E, moe_topk=2, moe_intermediate_size=32),
    "minimax_m2": dict(num_local_experts=E, num_experts_per_tok=2),
    "phimoe": dict(num_local_experts=E, num_experts_per_tok=2, sliding_window=None, router_jitter_noise=0.0),
    "llama4_text": dict(num_local_experts=E, num_experts_per_tok=1, intermediate_size_mlp=32, no_rope_layers=[1, 1]),
}
#: model types whose experts class takes no experts_implementation
NO_EXPERTS_IMPLEMENTATION = {"llama4_text"}


def build(model_type: str, dtype: torch.dtype = torch.float32, experts_implementation: str = "grouped_mm",
          **overrides: Any) -> torch.nn.Module:
    """A tiny random-weight causal LM of ``model_type`` (a key of :data:`FAMILIES`), in eval mode on CPU.

    Args:
        model_type: the transformers model type. dtype: parameter dtype. experts_implementation: "grouped_mm" or
            "batched_mm" (ignored for :data:`NO_EXPERTS_IMPLEMENTATION`). overrides: further config fields.
    Returns:
        The ``*ForCausalLM`` (2 layers, hidden 64, 6 experts, vocabulary 256), seeded with 0.
    Raises:
        KeyError: an unknown ``model_type``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**COMMON, **FAMILIES[model_type], **overrides})
    kwargs = {} if model_type in NO_EXPERTS_IMPLEMENTATION else {"experts_implementation": experts_implementation}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa", **kwargs)
    return model.eval()


def run_both(model: torch.nn.Module, batch: int = 2, prompt: int = 5, n_decode: int = 2):
    """(eager logits, compiled logits, recorder, ckvp warning texts) over a static-cache prefill and decode steps,
    compiled with the expert GEMM rewrite on."""
    ids = torch.randint(0, 256, (batch, prompt), generator=torch.Generator().manual_seed(1))
    eager = prefill_decode_logits(model, ids, n_decode, max_cache_len=16)
    rec = CompileRecorder()
    backend = CKVPBackend(CKVPConfig(compiler="aot_eager", enable_expert_gemm=True), recorder=rec)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = prefill_decode_logits(model, ids, n_decode, max_cache_len=16,
                                         compile_fn=lambda m: torch.compile(m, backend=backend, fullgraph=True))
    return eager, compiled, rec, [str(w.message) for w in caught if str(w.message).startswith("ckvp")]


def assert_close_logits(eager, compiled):
    """Every step's compiled logits equal eager ones within fp32 tolerance (1e-4); the lists have one length."""
    for step, (a, b) in enumerate(zip(eager, compiled, strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {step}: {m}")


def expert_gemm_result(graph_record):
    """The expert_gemm pass's PassResult of one recorded graph (exactly one)."""
    (res,) = [r for r in graph_record.pass_results if r.name == "expert_gemm"]
    return res


# ------------------------------------------------------------------------------------------ architectures, exact
@pytest.mark.parametrize("model_type, impl, rewritten", [
    ("granitemoe", "grouped_mm", 1), ("granitemoe", "batched_mm", 1),
    ("granitemoeshared", "grouped_mm", 1),  # its fused-gate_up shared expert is left with a note
    ("flex_olmo", "grouped_mm", 1), ("cohere2_moe", "batched_mm", 2),  # routed + ungated shared expert
    ("hunyuan_v1_moe", "grouped_mm", 2),
    ("minimax_m2", "grouped_mm", 0),  # score-correction bias before the top-k: unsupported_router
])
def test_more_architectures_equal_eager_rewritten_or_reported(model_type, impl, rewritten):
    """Each architecture: compiled logits equal eager; each layer gets ``rewritten`` ckvp::moe_experts calls, or
    (0) every layer's MoE pattern is reported with its reason."""
    eager, compiled, rec, _ = run_both(build(model_type, experts_implementation=impl))
    assert_close_logits(eager, compiled)
    for g in rec.graphs:
        assert len(OP_CALL.findall(g.dynamo_after)) == LAYERS * rewritten, g.dynamo_after
        if not rewritten:
            assert sorted(u.layer for u in g.analysis.unsupported if u.kind == "unsupported_router") == [0, 1]


# ------------------------------------------------------------------------- output_router_logits (aux loss top-k)
@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "olmoe"])
def test_load_balancing_loss_topk_is_not_an_unsupported_moe_site(model_type):
    """``output_router_logits=True``: the load-balancing loss's top-k over each router's scores is not a MoE
    pattern; every layer is still rewritten, and the logits and aux loss equal eager ones."""
    model = build(model_type, output_router_logits=True)
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(2))
    rec = CompileRecorder()
    backend = CKVPBackend(CKVPConfig(compiler="aot_eager", enable_expert_gemm=True), recorder=rec)
    with torch.no_grad():
        want = model(ids, use_cache=False)
        got = torch.compile(model, backend=backend, fullgraph=True)(ids, use_cache=False)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=1e-6)
    (g,) = rec.graphs
    assert [u for u in g.analysis.unsupported if u.kind in ("unknown_experts_form", "eager_loop_graph_break")] == []
    calls = 2 if model_type == "qwen2_moe" else 1  # routed experts (+ the gated shared expert)
    assert len(OP_CALL.findall(g.dynamo_after)) == LAYERS * calls
    assert [d.rewrite for d in g.plan.decisions if d.kind == "moe"] == [True] * LAYERS


@torch.no_grad()
def test_offloaded_model_with_router_logits_compiles_with_expert_offload():
    """An offloaded model with ``output_router_logits=True`` compiled with ``expert_offload``: the load-balancing
    top-k is not an expert layer "computed from graph inputs" (it raised a CKVPConfigError telling the user to offload
    the model, which was offloaded); the logits and aux loss equal the plain model's."""
    model = build("mixtral", output_router_logits=True)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(5))
    want = model(ids, use_cache=False)  # an eager call first, as in use (the graph traced after one has the aux top-k)
    handle = ckvp_compile.offload_experts(model, resident=2)
    got = torch.compile(model, backend="ckvp", options={"compiler": "aot_eager", "expert_offload": 2})(
        ids, use_cache=False)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=1e-6)
    assert handle.stats().calls == LAYERS
    handle.close()


# -------------------------------------------------------------------- a planned site the pass leaves: reported
def test_site_the_pass_leaves_has_its_reason_in_the_pass_notes():
    """A GELU expert (planned for the rewrite, refused by the pass): the reason is in the pass result's notes per
    layer (ckvp-inspect's "passes:" section), and the logits equal eager."""
    eager, compiled, rec, warned = run_both(build("mixtral", hidden_act="gelu"))
    assert_close_logits(eager, compiled)
    assert sum("expert GEMM rewrite does not apply" in w for w in warned) >= LAYERS
    for g in rec.graphs:
        assert not OP_CALL.findall(g.dynamo_after)
        res = expert_gemm_result(g)
        assert res.matched == 0
        assert [layer for layer, _ in res.notes] == [0, 1], res.notes
        assert all("gelu" in note and "not rewritten" in note for _, note in res.notes), res.notes


def test_inspect_does_not_claim_a_rewrite_the_pass_did_not_make():
    """ckvp-inspect on the same model: its decisions must not say 'rewrite' for MoE layers the pass left as the model
    computes them (the plan is made before the pass runs; the report must reconcile the two)."""
    from ckvp_compile.inspection import inspect_model

    text = inspect_model(build("mixtral", hidden_act="gelu"), options={"enable_expert_gemm": True},
                         decode=False).to_text()
    assert "not rewritten" in text and "gelu" in text  # the pass note is printed
    moe_lines = [line for line in text.splitlines() if line.strip().startswith("moe [")]
    assert moe_lines and not any(": rewrite:" in line for line in moe_lines), moe_lines


# ------------------------------------------------------------ MoE layers with no top-k dispatch: reported, not silent
@pytest.mark.parametrize("model_type", ["phimoe", "llama4_text"])
def test_moe_layers_the_analysis_cannot_read_are_reported(model_type):
    """PhiMoE (sparsemixer routing) and Llama-4 (dense experts on score-scaled inputs): with the expert rewrite on,
    the logits equal eager and every MoE layer appears in the analysis, as a site or as an unsupported pattern with
    its reason; today neither appears and ckvp-inspect says '0 MoE sites, unsupported: none'."""
    eager, compiled, rec, _ = run_both(build(model_type))
    assert_close_logits(eager, compiled)
    for g in rec.graphs:
        seen = {s.layer for s in g.analysis.moe} | {u.layer for u in g.analysis.unsupported
                                                   if u.kind not in ("sliding_window", "post_rope_key",
                                                                     "unrecognised_attention", "dynamic_cache")}
        assert seen == {0, 1}, (g.analysis.moe, g.analysis.unsupported)


# ------------------------------------------------------------------------------------------------ expert offload
def _deepseek_v4_clamped():
    """A tiny DeepSeek-V4 causal LM whose experts clamp gate and up at swiglu_limit=0.05 (so the clamp bites)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "deepseek_v4", vocab_size=256, hidden_size=64, moe_intermediate_size=32, intermediate_size=64,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=1, head_dim=16, n_routed_experts=E,
        num_experts_per_tok=2, n_shared_experts=1, swiglu_limit=0.05, initializer_range=0.1, pad_token_id=None,
        bos_token_id=None, eos_token_id=None, max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _muse_spark_post_norm():
    """A tiny MuseSpark text model (experts with a post-expert RMSNorm)."""
    from transformers import AutoConfig, AutoModel
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "muse_spark_text" not in CONFIG_MAPPING_NAMES:  # added after transformers 5.17 (the GPU image's)
        pytest.skip("this transformers has no MuseSpark model")
    cfg = AutoConfig.for_model(
        "muse_spark_text", vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, moe_hidden_size=32,
        num_local_experts=E, num_experts_per_tok=2, max_position_embeddings=256, sliding_window=64,
        initializer_range=0.1, layer_types=["full_attention"] * LAYERS, mlp_layer_types=["sparse"] * LAYERS,
        layer_rope_theta=[10000.0] * LAYERS, bos_token_id=None, eos_token_id=None)
    return AutoModel.from_config(cfg, dtype=torch.float32).eval()


def _first_output(out) -> torch.Tensor:
    """Logits of a causal LM output, else the last hidden state of a base model output."""
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("make", [_deepseek_v4_clamped, _muse_spark_post_norm], ids=["deepseek_v4", "muse_spark"])
@torch.no_grad()
def test_offload_refuses_or_keeps_experts_that_are_not_plain_swiglu(make):
    """DeepSeek-V4's experts clamp gate and up (``_apply_gate`` with ``swiglu_limit``); MuseSpark's experts apply a
    norm after the down projection (``has_post_expert_norm``). ``offload_experts`` must refuse them with a
    CKVPConfigError, or compute what they compute; it replaced them with plain SwiGLU (logits off by ~1)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = make()
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(3))
    want = _first_output(model(ids, use_cache=False))
    try:
        handle = ckvp_compile.offload_experts(model, resident=3)
    except CKVPConfigError:
        return  # refused: fine
    got = _first_output(model(ids, use_cache=False))
    handle.close()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kwargs", [dict(resident=2.5), dict(resident=True), dict(resident="2"), dict(resident=None),
                                    dict(resident=2, margin=1.5), dict(resident=2, margin="1"),
                                    dict(resident=2, lookahead=2.5)],
                         ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items()))
@torch.no_grad()
def test_offload_option_of_the_wrong_type_is_a_config_error_and_the_model_still_runs(kwargs):
    """A non-int ``resident`` / ``margin`` / ``lookahead``: a CKVPConfigError naming the option, and the model runs as
    before. Today: raw TypeErrors from deep inside, and ``margin=1.5`` is accepted, after which every forward raises
    ``topk(): argument 'k' must be int`` (the experts already moved into the offloader)."""
    model = build("mixtral")
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(4))
    want = model(ids, use_cache=False).logits
    name = next(k for k in kwargs if k != "resident") if len(kwargs) > 1 else "resident"
    with pytest.raises(CKVPConfigError, match=name):
        ckvp_compile.offload_experts(model, **kwargs)
    torch.testing.assert_close(model(ids, use_cache=False).logits, want, rtol=0, atol=0)
