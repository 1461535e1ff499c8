"""Bad input: every user mistake gets a clear error naming the reason (and, where there is one, the fix), and the
model stays usable afterwards.

Covered here (option validation itself is in tests/test_config.py, dtype / batch / grad-mode misuse in
tests/e2e/test_latent_kv*.py): bad backend options through ``torch.compile``, a kv ratio that cannot be met, bad
cache arguments, bases calibrated for a model of other shapes, and a context longer than the cache.
"""

from __future__ import annotations

import pytest
import torch

from ckvp_compile import CKVPConfigError
from ckvp_compile.latent import calibrate
from ckvp_compile.runtime.hf_cache import CKVPStaticCache, use_latent_cache
from ckvp_compile.testing import GptFastConfig, GptFastMoE, build_hf_moe, prefill_decode_logits
from ckvp_compile.testing.decoding import hf_step_kwargs

CACHE = 8


@pytest.fixture(scope="module")
def model_and_bases():
    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    bases = calibrate(model, [torch.randint(0, 256, (1, 12)) for _ in range(2)], group_size=2, kv_ratio=1.0,
                      progress=False)
    return model, bases


@pytest.mark.parametrize("options,message", [
    ({"group_sise": 2}, r"group_size"),                      # a misspelt name: the valid keys are listed
    ({"group_size": "4"}, r"group_size"),                    # a wrong type
    ({"group_size": 3}, r"\[1, 2, 4, 8\]"),                  # out of range
    ({"compiler": "tvm"}, r"inductor"),
    ({"strict": 1}, r"strict"),
])
def test_bad_options_through_torch_compile_are_clear_and_leave_the_model_usable(model_and_bases, options, message):
    model, _ = model_and_bases
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        with pytest.raises(Exception, match=message) as info:
            torch.compile(model, backend="ckvp", options=options)(ids, use_cache=False)
        assert isinstance(info.value, ValueError) or isinstance(info.value.__cause__, ValueError), info.value
        torch._dynamo.reset()
        torch.testing.assert_close(model(ids, use_cache=False).logits, want, rtol=0, atol=0)
        good = torch.compile(model, backend="ckvp", options={"compiler": "aot_eager"})
        torch.testing.assert_close(good(ids, use_cache=False).logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs,message", [
    (dict(kv_ratio=100.0), r"kv_ratio must be a number in \[1, 16\] for this model"),
    (dict(kv_ratio=3.0, latent_format="int4", cache_len=4), r"byte ratio of 3 is not reachable.*lower kv_ratio"),
    (dict(kv_ratio=float("nan")), r"kv_ratio must be a number >= 1"),
    (dict(kv_ratio="4"), r"kv_ratio must be a number >= 1"),
    (dict(kv_ratio=4.0, latent_format="int9", cache_len=64), r"latent format must be .*'int9'"),
    (dict(kv_ratio=2.0, latent_format="int8", cache_len=0), r"cache_len must be an int >= 1"),
    (dict(kv_ratio=2.0, latent_format="int8", batch_size=-1), r"batch_size must be an int >= 1"),
])
def test_a_kv_ratio_that_cannot_be_met_is_a_clear_error(model_and_bases, kwargs, message):
    model, _ = model_and_bases
    with pytest.raises(CKVPConfigError, match=message):
        calibrate(model, [torch.randint(0, 256, (1, 12))], group_size=1, progress=False, **kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_cache_len=0), r"max_cache_len must be >= 1"),
    (dict(max_cache_len=8, max_batch_size=0), r"batch_size .* must be >= 1"),
    (dict(max_cache_len=8, latent_format="int9"), r"'int9'"),
    (dict(max_cache_len=8, latent_format=("int8",)), r"\(K, V\) pair"),
    (dict(max_cache_len=8, latent_dtype=torch.int8), r"latent_dtype must be a floating torch.dtype.*latent_format"),
    (dict(max_cache_len=8, latent_dtype="bfloat16"), r"latent_dtype must be a floating torch.dtype"),
    (dict(max_cache_len=8, dtype=torch.int32), r"dtype must be a floating torch.dtype, the model's K/V dtype"),
    (dict(max_cache_len=8, dtype="float32"), r"dtype must be a floating torch.dtype, the model's K/V dtype"),
    (dict(max_cache_len=8, basis_dtype="float8_e4m3fn"), r"basis_dtype must be a floating torch.dtype"),
    (dict(max_cache_len=2.5), r"max_cache_len must be >= 1 and ints, got 1, 2.5"),
    pytest.param(dict(max_cache_len=8, device="cuda"), r"sees no CUDA device.*Fix: device='cpu'",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")),
])
def test_bad_cache_arguments_are_clear_errors(model_and_bases, kwargs, message):
    model, bases = model_and_bases
    with pytest.raises(CKVPConfigError, match=message):
        CKVPStaticCache(model.config, bases, **kwargs)


def test_bases_that_are_not_latent_bases_name_calibrate(model_and_bases):
    model, _ = model_and_bases
    with pytest.raises(CKVPConfigError, match=r"bases must be the LatentBases .*got NoneType.*calibrate"):
        CKVPStaticCache(model.config, None, max_cache_len=CACHE)


def test_calibration_ids_outside_the_vocabulary_name_the_tokenizer(model_and_bases):
    model, _ = model_and_bases
    vocab = model.get_input_embeddings().num_embeddings
    with pytest.raises(CKVPConfigError, match=rf"model embeds ids 0..{vocab - 1}.*tokenizer"):
        calibrate(model, [torch.full((1, 8), vocab + 3)], group_size=1, kv_ratio=1.0, progress=False)


@pytest.mark.parametrize("kwargs,message", [
    (dict(latent_format="int3"), r"latent_format: .*'int3'"),
    (dict(latent_format="int8", latent_dtype="bf16"), r"latent_dtype must be a floating torch.dtype"),
    (dict(latent_format="int8", dense_dtype=torch.bool), r"dense_dtype must be a floating torch.dtype"),
    (dict(max_cache_len=20.5), r"max_cache_len must be an int >= 1 .* or None"),
    (dict(max_cache_len="32"), r"max_cache_len must be an int >= 1"),
    (dict(group_size=4.0), r"group_size must be one of \[1, 2, 4, 8\] \(an int\)"),
])
def test_bad_calibrate_arguments_fail_before_the_first_sample(model_and_bases, kwargs, message):
    """A typo in calibrate()'s budget or cache arguments is refused before any sample runs: a one-shot iterable of
    samples is left unused (found by review: the format and dtypes were checked after the whole calibration run, a
    float max_cache_len failed inside transformers, group_size=4.0 was accepted)."""
    model, _ = model_and_bases
    taken = []

    def samples():
        for _ in range(3):
            taken.append(1)
            yield torch.randint(0, 256, (1, 12))

    with pytest.raises(CKVPConfigError, match=message):
        calibrate(model, samples(), **dict(dict(group_size=2, kv_ratio=1.0, progress=False), **kwargs))
    assert not taken


def test_bases_checked_against_something_other_than_a_model_is_a_clear_error(model_and_bases):
    _, bases = model_and_bases
    with pytest.raises(CKVPConfigError, match=r"model must be the torch.nn.Module .* got str"):
        bases.check_model("models/tiny-mixtral-pystdlib")


def test_inspect_of_something_other_than_a_model_names_what_it_takes():
    import ckvp_compile

    with pytest.raises(TypeError, match=r"torch.nn.Module .* or the path of a local Hugging Face model directory"):
        ckvp_compile.inspect(42)


def test_unknown_offload_options_list_the_valid_ones():
    import ckvp_compile

    model = build_hf_moe("mixtral", num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(CKVPConfigError, match=r"offload_options \['bogus'\] .*'lookahead'"):
        ckvp_compile.compile(model, expert_offload=2, offload_options={"bogus": 1})


@pytest.mark.parametrize("other", [dict(num_kv_heads=1), dict(head_dim=8), dict(num_layers=3)])
def test_bases_calibrated_for_a_model_of_other_shapes_are_refused(other):
    """KV heads, head dim or layer count differ: the HF cache and the gpt-fast binding both refuse, naming the
    shapes and calibrate() as the fix."""
    shape = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    model = build_hf_moe("mixtral", **shape)
    donor = build_hf_moe("mixtral", **{**shape, **other})
    bases = calibrate(donor, [torch.randint(0, 256, (1, 12))], group_size=1, kv_ratio=2.0, progress=False)
    with pytest.raises(CKVPConfigError, match=r"but the model has .*Fix: calibrate bases for this model"):
        CKVPStaticCache(model.config, bases, max_cache_len=CACHE)
    gpt = GptFastMoE(GptFastConfig(n_layer=2, n_head=4, n_local_heads=2, dim=64)).eval()
    gpt.setup_caches(1, CACHE)
    with pytest.raises(CKVPConfigError, match=r"but the model has .*Fix: calibrate"):
        use_latent_cache(gpt, bases)


def test_saved_bases_loaded_for_another_model_are_refused(tmp_path, model_and_bases):
    """Same shapes, other weights: LatentBases.load(path, model=...) compares the model fingerprint."""
    from ckvp_compile import LatentBases

    model, bases = model_and_bases
    bases.save(tmp_path / "b.safetensors")
    other = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=1)
    LatentBases.load(tmp_path / "b.safetensors", model=model)
    with pytest.raises(CKVPConfigError):
        LatentBases.load(tmp_path / "b.safetensors", model=other)


def _step(step, model, ids, cache, start):
    return step(**hf_step_kwargs(model, ids, cache, start)).logits


def test_a_context_longer_than_the_cache_is_an_error_never_a_wrong_result(model_and_bases):
    """A prompt longer than max_cache_len, and decoding past the last slot, raise (as a dense StaticCache does)
    instead of overwriting or wrapping around; afterwards reset() and the same cache gives the dense logits."""
    model, bases = model_and_bases
    step = torch.compile(model, backend="ckvp", options={"compiler": "aot_eager"}, fullgraph=True)
    cache = CKVPStaticCache(model.config, bases, max_cache_len=CACHE)
    with torch.no_grad():
        with pytest.raises(Exception, match=r"out of bounds|max_cache_len"):
            _step(step, model, torch.randint(0, 256, (1, CACHE + 2)), cache, 0)
        cache.reset()
        ids = torch.randint(0, 256, (1, CACHE - 2))
        out = _step(step, model, ids, cache, 0)
        for i in range(2):  # fills the cache exactly
            out = _step(step, model, out[:, -1:].argmax(-1), cache, CACHE - 2 + i)
        with pytest.raises(Exception, match=r"out of bounds|max_cache_len"):
            _step(step, model, out[:, -1:].argmax(-1), cache, CACHE)
        cache.reset()
        eager = prefill_decode_logits(model, ids, 2, max_cache_len=CACHE)
        got = [_step(step, model, ids, cache, 0)]
        for i in range(2):
            got.append(_step(step, model, got[-1][:, -1:].argmax(-1), cache, CACHE - 2 + i))
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4)


def test_a_context_longer_than_the_cache_names_max_cache_len(model_and_bases):
    """On host tensors the latent ops check the slots and name max_cache_len (on CUDA the indexing ops' device-side
    assert fires instead: benchmarks/reliability_gpu.py)."""
    model, bases = model_and_bases
    step = torch.compile(model, backend="ckvp", options={"compiler": "aot_eager"}, fullgraph=True)
    cache = CKVPStaticCache(model.config, bases, max_cache_len=CACHE)
    with torch.no_grad(), pytest.raises(Exception, match=r"max_cache_len"):
        _step(step, model, torch.randint(0, 256, (1, CACHE + 2)), cache, 0)
