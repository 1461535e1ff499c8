"""ckvp_compile.testing.check_equivalence: the property-based check users run on their own models.

It must pass where the backend is exact (a dense cache, the expert rewrite on, HF and gpt-fast models) and at
full rank, find a real discrepancy (a perturbed expert op; a lossy latent cache under a tight bound), shrink it to
the smallest example, say so in its report and error, refuse bad arguments naming the fix, and leave the model as
it was. Tiny models and ``compiler="aot_eager"`` keep it fast.
"""

from __future__ import annotations

import pytest
import torch

from ckvp_compile.errors import CKVPConfigError
from ckvp_compile.latent import calibrate
from ckvp_compile.testing import GptFastConfig, GptFastMoE, build_hf_moe
from ckvp_compile.testing.equivalence import EquivalenceError, check_equivalence

FAST = {"compiler": "aot_eager"}


@pytest.fixture(scope="module")
def tiny():
    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    bases = calibrate(model, [torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(i))
                              for i in range(2)], group_size=2, kv_ratio=4, progress=False)
    return model, bases


def test_dense_cache_with_the_expert_rewrite_passes_and_leaves_the_model(tiny):
    model, _ = tiny
    forward = model.forward
    report = check_equivalence(model, options={**FAST, "enable_expert_gemm": True}, max_examples=2,
                               max_prompt_len=6, max_decode_steps=2)
    assert report.raise_if_failed() is report and report.passed and report.examples == 2
    assert report.failure is None and report.max_abs_error < 1e-4 and "passed" in report.to_text()
    assert model.forward == forward  # the model is not rewritten: eager calls still run eagerly
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.parametrize("how", ["forward", "module"])
def test_an_already_compiled_model_is_checked_through_the_ckvp_backend(how, monkeypatch):
    """A model whose forward is already ``torch.compile``d (the README's recipe), here by a backend that adds 1 to
    the logits, or a ``torch.compile(model)`` wrapper: the check compiles the model's own forward with ckvp and
    compares it with the eager one (it ran the compiled forward on both sides and compared it with itself), and
    the compiled forward is put back after."""
    import ckvp_compile.backend as backend_mod

    calls = []
    real_call = backend_mod.CKVPBackend.__call__
    monkeypatch.setattr(backend_mod.CKVPBackend, "__call__",
                        lambda self, *a, **k: calls.append(1) or real_call(self, *a, **k))

    def plus_one(gm, example_inputs):
        def run(*args):
            return [o + 1.0 if isinstance(o, torch.Tensor) and o.is_floating_point() and o.dim() == 3 else o
                    for o in gm(*args)]
        return run

    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    torch._dynamo.reset()
    if how == "forward":
        compiled = model.forward = torch.compile(model.forward, backend=plus_one)
        checked = model
    else:
        checked = torch.compile(model, backend=plus_one)
    report = check_equivalence(checked, options=FAST, max_examples=2, max_prompt_len=6, max_decode_steps=1)
    assert report.passed and report.max_abs_error < 1e-4 and calls
    if how == "forward":
        assert model.__dict__["forward"] is compiled


def test_bf16_model_with_the_expert_rewrite_passes_at_the_default_tolerance():
    """In bf16 the grouped expert GEMM sums in another order than the model's loop (about one bf16 unit of a
    logit): the default 16-bit tolerance accepts that; an atol of 0 does not (it can fail)."""
    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16).to(torch.bfloat16)
    opts = {**FAST, "enable_expert_gemm": True}
    report = check_equivalence(model, options=opts, max_examples=2, max_prompt_len=6, max_decode_steps=2)
    assert report.passed, report.to_text()
    strict = check_equivalence(model, options=opts, max_examples=2, max_prompt_len=6, max_decode_steps=2, atol=0.0,
                               rtol=0.0, shrink=False, float32_referee=False)
    assert not strict.passed and "Tensor-likes are not equal" in strict.failure.message


class _RoundedHead(torch.nn.Module):
    """An LM head that errs on purpose. ``eager_shift``: bf16 eager adds it to every logit of sequence 0 (the 16-bit
    eager run's own rounding error, as another expert picked at a bf16 router near-tie gives: a whole token's logits
    move; neither the compiled run nor the float32 model has it). ``compiled_bug``: only under torch.compile, added to
    logit 7 of sequence 0 (a compiler bug). ``sixteen_bit_only``: refuses float32 inputs (as flash-attention does)."""

    def __init__(self, inner: torch.nn.Module, eager_shift: float = 0.0, compiled_bug: float = 0.0,
                 sixteen_bit_only: bool = False):
        super().__init__()
        self.inner, self.eager_shift, self.compiled_bug = inner, eager_shift, compiled_bug
        self.sixteen_bit_only = sixteen_bit_only

    def forward(self, x):
        if self.sixteen_bit_only and x.dtype == torch.float32:
            raise RuntimeError("this kernel only supports fp16 and bf16")
        y = self.inner(x)
        row0 = (torch.arange(y.shape[0], device=y.device) == 0).view(-1, 1, 1).to(y.dtype)
        if self.eager_shift and not torch.compiler.is_compiling() and y.dtype == torch.bfloat16:
            y = y + row0 * self.eager_shift
        if self.compiled_bug and torch.compiler.is_compiling():
            y = y + row0 * torch.nn.functional.one_hot(torch.tensor(7), y.shape[-1]).to(y.dtype) * self.compiled_bug
        return y


@pytest.mark.parametrize("eager_shift, compiled_bug", [(1.0, 0.0), (0.0, 1.0), (1.0, 0.9)])
def test_float32_referee_tells_eager_rounding_from_a_compiler_error(eager_shift, compiled_bug):
    """A 16-bit call outside the tolerance is judged, token by token, against the eager logits or the model upcast to
    float32: the eager run's own error (bf16 eager off by 1.0 on a token, compiled and float32 not) passes, counted in
    the report; a compiler error fails, alone or on a token where eager is off too (a 0.9 error inside eager's 1.0 is
    no closer to either); without the referee every case fails."""
    model = build_hf_moe("mixtral", num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16).to(torch.bfloat16)
    model.lm_head = _RoundedHead(model.lm_head, eager_shift, compiled_bug)
    kw = dict(options=FAST, max_examples=2, max_prompt_len=4, max_decode_steps=1, shrink=False)
    report = check_equivalence(model, **kw)
    assert model.lm_head.inner.weight.dtype == torch.bfloat16  # the float32 referee is a copy
    if not compiled_bug:
        assert report.passed and report.refereed >= 2, report.to_text()
        assert report.max_abs_error < 0.5 and 0 < report.refereed_max_abs_error < 0.5
        assert "matched the float32 model" in report.to_text()
    else:
        assert not report.passed, report.to_text()
        assert "outside the tolerance of both the eager and the float32 logits; at logit 7" in report.failure.message
        # the bug is under any torch.compile: the inner compiler alone shows it too, and the failure says so
        assert "torch.compile(backend='aot_eager') without ckvp gives, at that token, logits within the tolerance of " \
               "ckvp's" in report.failure.message
    plain = check_equivalence(model, float32_referee=False, **kw)
    assert not plain.passed and plain.refereed == 0 and "float32 referee" not in plain.failure.message


def test_a_ckvp_error_is_not_blamed_on_the_inner_compiler(monkeypatch):
    """ckvp's own expert op off by 50% in a bf16 model: the float32 referee fails, and the inner compiler alone
    (torch.compile without ckvp) does not reproduce the error, so the failure says how far it is from ckvp's."""
    import ckvp_compile.kernels.moe_reference as moe_ref

    model = build_hf_moe("mixtral", num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16).to(torch.bfloat16)
    true_ref = moe_ref.moe_experts_ref
    monkeypatch.setattr(moe_ref, "moe_experts_ref", lambda *a, **k: true_ref(*a, **k) * 1.5)
    report = check_equivalence(model, options={**FAST, "enable_expert_gemm": True}, max_examples=1, max_prompt_len=4,
                               max_decode_steps=0, shrink=False)
    assert not report.passed
    msg = report.failure.message
    assert "float32 referee: token" in msg and "torch.compile(backend='aot_eager') without ckvp gives" in msg, msg
    assert "away from ckvp's" in msg and "inner compiler's own arithmetic" not in msg, msg


def test_float32_referee_that_cannot_run_is_reported_not_raised():
    """A model whose float32 copy cannot run (a 16-bit-only kernel) keeps the 16-bit check's failure, naming why the
    referee did not judge it; check_equivalence itself does not raise."""
    model = build_hf_moe("mixtral", num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16).to(torch.bfloat16)
    model.lm_head = _RoundedHead(model.lm_head, compiled_bug=1.0, sixteen_bit_only=True)
    report = check_equivalence(model, options=FAST, max_examples=1, max_prompt_len=3, max_decode_steps=0,
                               shrink=False)
    assert not report.passed
    assert "the float32 referee could not run: RuntimeError: this kernel only supports fp16" in report.failure.message


def test_a_wrong_expert_op_is_found_and_shrunk(tiny, monkeypatch):
    """The compiled model's expert op perturbed by 1e-3 relative: the dense check (exact) must fail, at the prefill
    of the smallest example (one sequence, one token)."""
    import ckvp_compile.kernels.moe_reference as moe_ref

    model, _ = tiny
    true_ref = moe_ref.moe_experts_ref
    monkeypatch.setattr(moe_ref, "moe_experts_ref", lambda *a, **k: true_ref(*a, **k) * 1.001)
    report = check_equivalence(model, options={**FAST, "enable_expert_gemm": True}, max_examples=2, max_batch=2,
                               max_prompt_len=3, max_decode_steps=1)
    assert not report.passed
    f = report.failure
    assert (f.batch, len(f.prompt[0]), f.call) == (1, 1, 0) and f.max_abs_error > 0
    assert "Tensor-likes are not close" in f.message
    with pytest.raises(EquivalenceError, match=r"smallest failing example: batch 1, prompt length 1"):
        report.raise_if_failed()


def test_latent_cache_error_bound(tiny):
    """At 4x the latent cache's logits differ from dense's (a lossy cache): a bound of 1e-4 fails at the first decode
    step (the prefill attends its own tokens exactly), a bound of 20 passes; no shrinking here (fast)."""
    model, bases = tiny
    tight = check_equivalence(model, options=FAST, bases=bases, max_logit_error=1e-4, max_examples=2,
                              max_prompt_len=4, max_decode_steps=2, shrink=False, seed=1)
    assert not tight.passed and tight.failure.call >= 1 and "> max_logit_error 0.0001" in tight.failure.message
    loose = check_equivalence(model, options=FAST, bases=bases, max_logit_error=20.0, max_examples=2,
                              max_prompt_len=4, max_decode_steps=2, seed=1)
    assert loose.passed and 0 < loose.max_abs_error <= 20.0 and "latent cache (bound 20)" in loose.to_text()


def test_full_rank_latent_cache_is_near_exact(tiny):
    model, _ = tiny
    full = calibrate(model, [torch.randint(0, 256, (1, 12)) for _ in range(2)], group_size=2, kv_ratio=1.0,
                     progress=False)
    report = check_equivalence(model, options=FAST, bases=full, max_logit_error=1e-3, max_examples=2,
                               max_prompt_len=5, max_decode_steps=2)
    assert report.passed, report.to_text()


def test_gpt_fast_model_dense_cache():
    """Also: the user's cache setup (batch 3, 40 slots) comes back: the same buffers, not the drawn sizes' caches."""
    model = GptFastMoE(GptFastConfig(vocab_size=128)).eval()
    model.setup_caches(3, 40)
    buffer = model.layers[0].attention.kv_cache.k_cache
    report = check_equivalence(model, options=FAST, max_examples=2, max_prompt_len=5, max_decode_steps=2)
    assert report.passed, report.to_text()
    assert model.layers[0].attention.kv_cache.k_cache is buffer and (model.max_batch_size, model.max_seq_length) == (3, 40)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(model="not a model"), "must be a torch.nn.Module"),
    (dict(max_examples=0), "max_examples must be an int >= 1"),
    (dict(max_decode_steps=-1), "max_decode_steps must be an int >= 0"),
    (dict(max_logit_error=0.5), "with a dense cache (bases=None) the check is exact"),
    (dict(bases="B"), "pass max_logit_error"),
    (dict(bases="B", max_logit_error=float("inf")), "pass max_logit_error"),
    (dict(options={"group_size": 3}), "group_size"),
])
def test_bad_arguments_name_the_fix(tiny, kwargs, needle):
    kwargs = {"model": tiny[0], **kwargs}
    with pytest.raises(CKVPConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        check_equivalence(kwargs.pop("model"), **kwargs)


def test_nothing_is_written_to_the_working_directory(tmp_path):
    """Hypothesis keeps a cache of source constants under ``<cwd>/.hypothesis`` even with its example database off;
    the check sends it to a temporary directory. Run in a fresh interpreter whose working directory is ``tmp_path``
    (Hypothesis fixes its default home at import), with enough examples to make Hypothesis read constants."""
    import os
    import subprocess
    import sys

    code = ("import torch\n"
            "from ckvp_compile.testing import build_hf_moe\n"
            "from ckvp_compile.testing.equivalence import check_equivalence\n"
            "m = build_hf_moe('mixtral', num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)\n"
            "print(check_equivalence(m, options={'compiler': 'aot_eager'}, max_examples=4).passed)\n")
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_STORAGE_DIRECTORY"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("True"), out.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == []
