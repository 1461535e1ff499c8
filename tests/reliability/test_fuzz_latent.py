"""Fuzzing: random tiny Mixtral models and random valid options, never a silently wrong result.

Hypothesis draws the model (layers, heads, KV heads, head_dim, hidden, experts, top-k, FFN width, attention and
experts implementation), the options (group size, the expert GEMM rewrite, inner compiler) and the run (batch,
prompt length, cache slack). At full rank (``kv_ratio=1``, float latents) the latent cache is exact, so every
logit of the prefill and of the decode steps must be within fp32 tolerance of the eager model with a dense
StaticCache, or the call must raise a :class:`CKVPError` (a clear error). Anything else fails.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckvp_compile import CKVPBackend, CKVPConfig, CKVPError
from ckvp_compile.config import GROUP_SIZES
from ckvp_compile.latent import calibrate
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import build_hf_moe, prefill_decode_logits
from ckvp_compile.testing.decoding import hf_step_kwargs
from ckvp_compile.testing.strategies import moe_model_shapes

N_DECODE = 3
TOL = 2e-4  # fp32: the latent path reorders sums (basis products, absorbed values)


@st.composite
def _cases(draw):
    shape = draw(moe_model_shapes(max_layers=4))
    options = dict(group_size=draw(st.sampled_from(GROUP_SIZES)), enable_expert_gemm=draw(st.booleans()),
                   compiler=draw(st.sampled_from(["aot_eager", "eager"])))
    run = dict(batch=draw(st.integers(1, 2)), prompt=draw(st.integers(1, 8)), slack=draw(st.integers(0, 4)),
               attn=draw(st.sampled_from(["sdpa", "eager"])),
               experts=draw(st.sampled_from(["grouped_mm", "batched_mm"])))
    return shape, options, run


@given(case=_cases())
@settings(max_examples=6)
def test_random_models_and_options_are_exact_at_full_rank_or_a_clear_error(case):
    check_case(case)


def check_case(case) -> None:
    """Run one drawn case; fail unless the logits match eager (fp32) or a CKVPError is raised."""
    shape, options, run = case
    torch._dynamo.reset()  # every example is a new model: keep Dynamo's per-code-object recompile limit out of it
    model = build_hf_moe("mixtral", attn_implementation=run["attn"], experts_implementation=run["experts"], **shape)
    samples = [torch.randint(0, 256, (1, 12)) for _ in range(2)]
    bases = calibrate(model, samples, group_size=options["group_size"], kv_ratio=1.0, progress=False)
    ids = torch.randint(0, 256, (run["batch"], run["prompt"]))
    cache_len = run["prompt"] + N_DECODE + run["slack"]
    eager = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=cache_len)
    cache = CKVPStaticCache(model.config, bases, max_cache_len=cache_len, max_batch_size=run["batch"])
    step = torch.compile(model, backend=CKVPBackend(CKVPConfig(**options)), fullgraph=True)
    got = []
    try:
        with torch.no_grad():
            out = step(**hf_step_kwargs(model, ids, cache, 0)).logits
            got.append(out)
            for i in range(N_DECODE):
                out = step(**hf_step_kwargs(model, out[:, -1:].argmax(-1), cache, run["prompt"] + i)).logits
                got.append(out)
    except CKVPError as exc:  # allowed: a clear error that says what to do
        assert "ckvp" in str(exc).lower() and len(str(exc)) > 40, exc
        return
    except Exception as exc:  # Dynamo wraps backend errors: accept only a CKVPError underneath
        cause = exc
        while cause is not None and not isinstance(cause, CKVPError):
            cause = cause.__cause__
        assert cause is not None, f"not a clear ckvp error: {type(exc).__name__}: {exc}"
        return
    for i, (a, b) in enumerate(zip(got, eager)):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL, msg=lambda m: f"step {i} of {case}: {m}")
