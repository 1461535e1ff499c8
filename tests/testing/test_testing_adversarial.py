"""Adversarial tests of the public helpers of ckvp_compile.testing (a review, 2026-12-07): each case below was once
accepted silently, reported as a failure of the compiled model, or raised an error that did not name the fix.

* check_equivalence with ``bases`` that are a file path, of another model, of another layer count, or with an
  unknown ``latent_format``: every example failed, Hypothesis shrank the "failure", and the report blamed the
  compiled run; now a ``CKVPConfigError`` before the first example.
* ``rtol`` / ``atol`` with bases, ``latent_format`` without bases: silently ignored; ``rtol`` alone silently set
  ``atol`` to 0; a negative or string tolerance raised torch's ``RuntimeError`` with a tensor dump after shrinking.
* ``shrink="no"`` shrank (a truthy string).
* a model in training mode (dropout, router jitter): the eager and compiled runs sampled different noise and the
  check reported a mismatch of the compiler; now it runs in eval mode and puts each module's mode back.
* ``moe_model_shapes(2.5)`` failed only at the first draw, with Hypothesis' InvalidArgument.
"""

from __future__ import annotations

import pytest
import torch

from ckvp_compile.errors import CKVPConfigError
from ckvp_compile.latent import calibrate
from ckvp_compile.testing import build_hf_moe
from ckvp_compile.testing.bases import random_orthonormal_bases
from ckvp_compile.testing.equivalence import check_equivalence

FAST = {"compiler": "aot_eager"}
SMALL = dict(options=FAST, max_examples=2, max_prompt_len=4, max_decode_steps=1)


def _model(**overrides) -> torch.nn.Module:
    return build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, **overrides)


@pytest.fixture(scope="module")
def tiny():
    model = _model()
    bases = calibrate(model, [torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(i))
                              for i in range(2)], group_size=2, kv_ratio=4, progress=False)
    return model, bases


def _no_compile(monkeypatch):
    """Make any compile fail loudly: a refused argument must be refused before the first example runs."""
    def boom(*args, **kwargs):
        raise AssertionError("an example ran")

    monkeypatch.setattr(torch, "compile", boom)


def test_bases_that_cannot_serve_the_model_are_refused_before_any_example(tiny, tmp_path, monkeypatch):
    model, bases = tiny
    path = tmp_path / "bases.safetensors"
    bases.save(path)
    other_weights = _model(seed=1)
    three_layers = build_hf_moe("mixtral", num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16)
    _no_compile(monkeypatch)
    cases = [
        (model, dict(bases=str(path)), "bases must be the LatentBases of this model, got str.*LatentBases.load"),
        (other_weights, dict(bases=bases), "the bases were calibrated on another model"),
        (three_layers, dict(bases=bases), "the bases were calibrated on another model.*num_layers"),
        # bases built by hand carry no fingerprint: the latent cache built up front finds the layer count
        (three_layers, dict(bases=random_orthonormal_bases(layers=2, hkv=2, d=16)),
         "no latent cache of these bases fits the model.*3 layers"),
        (model, dict(bases=bases, latent_format="int5"), "no latent cache of these bases fits the model.*'int5'"),
    ]
    for m, kwargs, why in cases:
        with pytest.raises(CKVPConfigError, match=why):
            check_equivalence(m, max_logit_error=1.0, **kwargs, **SMALL)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(rtol=1e-3), "give both rtol and atol"),
    (dict(atol=1e-3), "give both rtol and atol"),
    (dict(rtol=-1.0, atol=0.0), "rtol must be None or a finite number >= 0"),
    (dict(rtol=0.0, atol="1e-3"), "atol must be None or a finite number >= 0"),
    (dict(rtol=0.0, atol=float("nan")), "atol must be None or a finite number >= 0"),
    (dict(latent_format="int4"), "no bases were given"),
    (dict(shrink="no"), "shrink must be True or False"),
    (dict(float32_referee=None), "float32_referee must be True or False"),
])
def test_options_that_would_be_ignored_or_misread_are_refused(tiny, monkeypatch, kwargs, needle):
    _no_compile(monkeypatch)
    with pytest.raises(CKVPConfigError, match=needle):
        check_equivalence(tiny[0], **kwargs, **SMALL)


def test_a_dense_tolerance_with_a_latent_cache_is_refused(tiny, monkeypatch):
    model, bases = tiny
    _no_compile(monkeypatch)
    with pytest.raises(CKVPConfigError, match="with bases .* bounded by max_logit_error alone"):
        check_equivalence(model, bases=bases, max_logit_error=100.0, rtol=0.0, atol=0.0, **SMALL)


def test_matching_bases_still_run_by_fingerprint_or_by_hand(tiny):
    model, bases = tiny
    assert check_equivalence(model, bases=bases, max_logit_error=100.0, **SMALL).passed
    full = random_orthonormal_bases(layers=2, hkv=2, d=16, rank=32)  # no fingerprint; full rank: exact
    report = check_equivalence(model, bases=full, max_logit_error=1e-3, **SMALL)
    assert report.passed, report.to_text()


def test_a_training_mode_model_is_checked_in_eval_mode_and_keeps_its_modes():
    model = _model(attention_dropout=0.5, router_jitter_noise=0.5)
    model.train()
    model.model.layers[1].eval()
    modes = {name: m.training for name, m in model.named_modules()}
    report = check_equivalence(model, **SMALL)
    assert report.passed, report.to_text()
    assert {name: m.training for name, m in model.named_modules()} == modes


def test_moe_model_shapes_refuses_a_non_int_layer_count():
    from ckvp_compile.testing.strategies import moe_model_shapes

    for bad in (0, 2.5, "3", None, True):
        with pytest.raises(ValueError, match="max_layers must be an int >= 1"):
            moe_model_shapes(bad)
    assert moe_model_shapes(2) is not None


# ---------------------------------------------------------------------------------------------------------------
# A review of the fixes above (2026-12-07): each case below was refused by them although it had worked before.


def test_numpy_tolerances_and_layer_counts_are_numbers():
    """The new checks took only Python ints / floats: ``atol=np.finfo(np.float32).eps`` (an ``np.float32``, which
    ``torch.testing.assert_close`` takes) was refused as "not a finite number", and ``moe_model_shapes(np.int64(3))``
    (which drew fine before) as "not an int"."""
    np = pytest.importorskip("numpy")
    from ckvp_compile.testing.strategies import moe_model_shapes

    report = check_equivalence(_model(), rtol=np.float32(1.3e-6), atol=np.float32(1e-5), **SMALL)
    assert report.passed, report.to_text()
    assert moe_model_shapes(np.int64(3)) is not None
    with pytest.raises(CKVPConfigError, match="rtol must be None or a finite number >= 0"):
        check_equivalence(_model(), rtol=np.float32(-1.0), atol=0.0, **SMALL)
