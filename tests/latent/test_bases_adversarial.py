"""Adversarial tests of calibration inputs and of the bases file: each case below was once accepted silently or
failed with a misleading message (an adversarial review, 2026-12-06).

* calibrate() on a model in training mode: dropout / router jitter were sampled into the bases (two runs on the
  same samples disagreed); now it runs in eval mode and puts each module's mode back.
* calibrate() and ``LatentBases.load(model=...)`` on a ``torch.compile(model)`` wrapper: "no KV-cache write" and
  "calibrated on another model"; now the wrapped module is used.
* a model whose weights are on the meta device: a bare ``RuntimeError`` from ``.item()``.
* ``LatentBases.load`` of a file whose bases are NaN, integer or not orthonormal, whose ranks are fractional, whose
  formats are unknown or not one per group: loaded, then generated wrong tokens or failed later.
* the bf16 and fp16 copies of one checkpoint: refused as "another model" (their roundings hash differently).
* ``bases_for_byte_ratio`` with batch_size / max_cache_len < 1 or non-float dtypes: an unreachable-ratio message or
  a bare ``TypeError``.
"""

from __future__ import annotations

import json

import pytest
import torch

from ckvp_compile import CKVPConfigError, LatentBases, calibrate
from ckvp_compile.latent import collect_kv_moments, model_fingerprint
from ckvp_compile.latent.budget import bases_for_byte_ratio
from ckvp_compile.testing import build_hf_moe


def _model(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    return build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=seed).to(dtype)


def _samples(n: int = 2, s: int = 24) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (1, s), generator=g) for _ in range(n)]


def _assert_same_bases(a: LatentBases, b: LatentBases) -> None:
    assert (a.k_ranks, a.v_ranks) == (b.k_ranks, b.v_ranks)
    for x, y in zip(a.k_basis + a.v_basis, b.k_basis + b.v_basis):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_calibrate_runs_a_training_mode_model_in_eval_mode_and_restores_its_modes():
    # training mode matters: router jitter and dropout on the attention probabilities
    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, router_jitter_noise=0.5,
                         attention_dropout=0.5)
    want = calibrate(model, _samples(), group_size=2, kv_ratio=2.0, progress=False)
    model.train()
    model.model.layers[1].eval()  # a mixed state must come back as it was
    modes = {name: m.training for name, m in model.named_modules()}
    got = calibrate(model, _samples(), group_size=2, kv_ratio=2.0, progress=False)
    _assert_same_bases(got, want)
    assert {name: m.training for name, m in model.named_modules()} == modes


def test_calibrate_and_load_see_through_a_compiled_module(tmp_path):
    model = _model()
    want = calibrate(model, _samples(), group_size=2, kv_ratio=2.0, progress=False)
    compiled = torch.compile(model, backend="ckvp", options={"compiler": "aot_eager"})
    got = calibrate(compiled, _samples(), group_size=2, kv_ratio=2.0, progress=False)
    _assert_same_bases(got, want)
    assert got.model_fingerprint == want.model_fingerprint
    path = tmp_path / "bases.safetensors"
    got.save(path)
    LatentBases.load(path, model=compiled)  # the compiled wrapper is the calibrated model


def test_a_model_without_loaded_weights_is_a_clear_error():
    with torch.device("meta"):
        model = _model()
    with pytest.raises(CKVPConfigError, match="weights are not loaded.*meta device.*Fix: load the weights"):
        calibrate(model, _samples(1), progress=False)


def _tampered(tmp_path, bases: LatentBases, tensors=None, meta=None) -> str:
    """``bases`` saved, then re-written with some tensors / metadata fields replaced."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = tmp_path / "src.safetensors"
    bases.save(src)
    with safe_open(str(src), framework="pt") as f:
        header = dict(f.metadata())
        data = {k: f.get_tensor(k) for k in f.keys()}
    data.update({k: t.contiguous() for k, t in (tensors or {}).items()})
    fields = json.loads(header["meta"])
    fields.update(meta or {})
    header["meta"] = json.dumps(fields)
    out = tmp_path / "tampered.safetensors"
    save_file(data, str(out), metadata=header)
    return str(out)


def test_load_refuses_corrupt_values_and_keeps_sound_files(tmp_path):
    model = _model()
    bases = calibrate(model, _samples(), group_size=2, kv_ratio=2.0, progress=False, latent_format="int4/16")
    k0 = bases.k_basis[0]
    nan = k0.clone()
    nan[0, 0, 0] = float("nan")
    cases = {
        "not a finite float tensor": dict(tensors={"k_basis.0": nan}),
        "not a finite float tensor \\(dtype torch.int32\\)": dict(tensors={"k_basis.0": k0.round().to(torch.int32)}),
        "are not orthonormal": dict(tensors={"v_basis.0": bases.v_basis[0] * 3}),
        "k_ranks .* are not all ints": dict(meta={"k_ranks": [[r + 0.5 for r in bases.k_ranks[0]]]}),
        "k_formats: latent format must be": dict(meta={"k_formats": ["int5"]}),
        "v_formats 'int4' is not a list of one format per group": dict(meta={"v_formats": "int4"}),
        "group_size 0 is not an int": dict(meta={"group_size": 0}),
        "target_ratio nan": dict(meta={"target_ratio": float("nan")}),
        "max_key_rank -5 < 1": dict(meta={"max_key_rank": -5}),
    }
    for why, change in cases.items():
        with pytest.raises(CKVPConfigError, match=f"holds corrupt ckvp latent bases .*{why}"):
            LatentBases.load(_tampered(tmp_path, bases, **change))
    # sound files of every basis dtype still load (an fp8 copy of an orthonormal basis is within the tolerance)
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn):
        path = tmp_path / f"b_{dtype}.safetensors".replace("torch.", "")
        bases.to(dtype=dtype).save(path)
        assert LatentBases.load(path, model=model).k_basis[0].dtype == dtype


def test_the_bf16_and_fp16_copies_of_one_checkpoint_share_bases(tmp_path):
    """Bases calibrated on either 16-bit copy of an fp32 checkpoint load for the other (their roundings hash
    differently, the sampled values agree within 2^-8); another checkpoint of the same shape is still refused."""
    for a, b in ((torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)):
        bases = calibrate(_model(a), _samples(1), group_size=2, kv_ratio=2.0, progress=False)
        path = tmp_path / "bases.safetensors"
        bases.save(path)
        other = _model(b)
        fp = model_fingerprint(other, bases.model_fingerprint["k_weight"])
        assert fp["k_weight_sha256"] != bases.model_fingerprint["k_weight_sha256"]  # the hashes alone would refuse
        LatentBases.load(path, model=other)
        w = other.model.layers[0].self_attn.k_proj.weight
        bases.check_weight(w, "model.layers.0.self_attn.k_proj.weight")  # the backend's check at the first call
        with pytest.raises(CKVPConfigError, match="calibrated on another model"):
            LatentBases.load(path, model=_model(b, seed=1))
        with pytest.raises(CKVPConfigError, match="calibrated on another model"):
            bases.check_weight(w * 1.01, "model.layers.0.self_attn.k_proj.weight")


def test_byte_ratio_arguments_are_checked():
    moments = collect_kv_moments(_model(), _samples(1), group_size=2, progress=False)
    for kwargs, why in (({"batch_size": 0}, "batch_size must be an int >= 1"),
                        ({"batch_size": 2.5}, "batch_size must be an int >= 1"),
                        ({"max_cache_len": -5}, "max_cache_len must be an int >= 1"),
                        ({"dense_dtype": "bf16"}, "dense_dtype must be a floating torch.dtype"),
                        ({"latent_dtype": torch.int8}, "latent_dtype must be a floating torch.dtype"),
                        ({"basis_dtype": torch.int8}, "basis_dtype must be a floating torch.dtype")):
        with pytest.raises(CKVPConfigError, match=why):
            bases_for_byte_ratio(moments, 2.0, "int4", **kwargs)
    with pytest.raises(CKVPConfigError, match="cache_len must be an int >= 1"):
        calibrate(_model(), _samples(1), progress=False, latent_format="int4", cache_len=0)


def test_samples_past_the_models_positions_warn_once_per_length():
    """A sample longer than config.max_position_embeddings runs (RoPE extends) but its keys are out of distribution:
    one CKVPWarning per such length, naming the limit; samples within it warn nothing."""
    import warnings

    from ckvp_compile import CKVPWarning

    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calibrate(model, _samples(2, 16), group_size=2, kv_ratio=2.0, progress=False)
        assert not [w for w in caught if issubclass(w.category, CKVPWarning)]
        calibrate(model, [*_samples(2, 24), *_samples(1, 20)], group_size=2, kv_ratio=2.0, progress=False)
    got = [str(w.message) for w in caught if issubclass(w.category, CKVPWarning)]
    assert len(got) == 2 and all("max_position_embeddings (16)" in m for m in got), got
    assert "a sample of 24 tokens" in got[0] and "a sample of 20 tokens" in got[1]
