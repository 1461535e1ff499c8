"""The attention statistics calibration measures (KVMoments.attn_sumsq, KVMoments.v_attended), checked against
the model's own attention weights, and the planner's value-noise model built from them
(latent/attention_noise.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckvp_compile.errors import CKVPConfigError
from ckvp_compile.latent import collect_kv_moments
from ckvp_compile.latent.attention_noise import value_error_scales
from ckvp_compile.latent.bases import build_latent_bases
from ckvp_compile.latent.calibrate import KVMoments
from ckvp_compile.testing import build_hf_moe

H, HKV, D = 4, 2, 16


@pytest.fixture(scope="module")
def measured():
    """A 4-layer tiny Mixtral (eager attention: it returns its weights), one batch of 2 x 20 tokens: the moments
    collected at G=4 and G=2, and the model's own attention weights and values."""
    model = build_hf_moe("mixtral", num_layers=4, num_heads=H, num_kv_heads=HKV, head_dim=D,
                         attn_implementation="eager")
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    mom4 = collect_kv_moments(model, [ids], group_size=4, progress=False, attended_values=True)
    mom2 = collect_kv_moments(model, [ids], group_size=2, progress=False, attended_values=True)
    plain = collect_kv_moments(model, [ids], group_size=4, progress=False)  # attended values are opt-in
    assert plain.v_attended == [] and sorted(plain.attn_sumsq) == [0, 1, 2, 3]
    values = {}
    hooks = [layer.self_attn.v_proj.register_forward_hook(
        lambda _m, _i, out, i=i: values.__setitem__(i, out.detach().double().view(2, 20, HKV, D).transpose(1, 2)))
        for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        attn = model(ids, output_attentions=True, use_cache=False).attentions
    for h in hooks:
        h.remove()
    return mom4, mom2, [a.double() for a in attn], values


def _expected(attn, values, layers, layer):
    """sum_{s<t} p^2 per KV head and the mean y y^T of the stacked attended values, from the model's weights."""
    p = attn[layer].tril(-1)  # (B, H, S, S): weights on earlier tokens
    sumsq = p.square().sum(-1)[..., 1:].mean(dim=(0, 2)).view(HKV, H // HKV).mean(1)
    x = torch.cat([values[m] for m in layers], -1).repeat_interleave(H // HKV, dim=1)  # (B, H, S, G*D)
    y = (p[..., 1:, :] @ x)  # (B, H, S-1, G*D)
    y = y.view(2, HKV, H // HKV, 19, -1).transpose(0, 1).reshape(HKV, -1, x.shape[-1])
    return sumsq, y.mT @ y / y.shape[1]


def test_attention_statistics_match_the_models_own_attention_weights(measured):
    mom4, _, attn, values = measured
    assert sorted(mom4.attn_sumsq) == [0, 1, 2, 3] and len(mom4.v_attended) == 1
    assert mom4.v_attended[0].shape == (4, HKV, 4 * D, 4 * D)
    for layer in range(4):
        sumsq, m = _expected(attn, values, (0, 1, 2, 3), layer)
        torch.testing.assert_close(mom4.attn_sumsq[layer].double(), sumsq, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(mom4.v_attended[0][layer], m, rtol=1e-4, atol=1e-6)
        assert bool(((sumsq > 0) & (sumsq <= 1)).all())


def test_regrouped_attention_statistics_equal_a_collection_at_the_smaller_group(measured):
    mom4, mom2, _, _ = measured
    re2 = mom4.regroup(2)
    assert re2.groups == mom2.groups and len(re2.v_attended) == len(mom2.v_attended) == 2
    for a, b in zip(re2.v_attended, mom2.v_attended):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    assert all(torch.equal(re2.attn_sumsq[k], mom2.attn_sumsq[k]) for k in mom2.attn_sumsq)


def test_value_error_scales_are_the_layer_shares_of_the_measured_kappa(measured):
    mom4, _, _, _ = measured
    full = mom4.bases(1.0, "uniform")
    noise = value_error_scales(mom4, full, "noise")["v"][0]
    out = value_error_scales(mom4, full, "output")["v"][0]
    kappa = torch.stack([mom4.attn_sumsq[layer].double() for layer in range(4)], 1)  # (Hkv, G)
    for h in range(HKV):
        n = noise["noise"][h]
        assert bool(((n >= kappa[h].min() - 1e-9) & (n <= kappa[h].max() + 1e-9)).all())  # a convex mix of kappa_l
        torch.testing.assert_close(noise["drop"][h], full.eigenvalues("v")[0][h].double())
        torch.testing.assert_close(out["noise"][h], n)
        # truncation at the output: each component's attended energy, at most its per-token energy in sum
        assert float(out["drop"][h].sum()) <= float(full.eigenvalues("v")[0][h].sum()) * (1 + 1e-9)
    with pytest.raises(CKVPConfigError, match="mode"):
        value_error_scales(mom4, full, "coherent")
    with pytest.raises(CKVPConfigError, match="groups"):
        value_error_scales(mom4.regroup(2), full)


def _synthetic(kappas, seed, attended_is_x):
    """KVMoments of one group of len(kappas) layers and one KV head, with given kappa per layer; the attended
    moments equal the per-token moments (an attention that picks one token) when ``attended_is_x``."""
    g = torch.Generator().manual_seed(seed)
    n = len(kappas) * 4
    a = torch.randn(1, n, n, generator=g, dtype=torch.float64)
    c = a @ a.mT + 0.1 * torch.eye(n, dtype=torch.float64)
    layers = tuple(range(len(kappas)))
    attended = [torch.stack([c / 10 if attended_is_x else 0.5 * c / 10 for _ in layers])]
    return KVMoments(groups=(layers,), num_kv_heads=1, head_dim=4, group_size=len(kappas), k=[c.clone()], v=[c],
                     num_tokens=10, model_fingerprint={}, attn_sumsq={i: torch.tensor([k]) for i, k in enumerate(kappas)},
                     v_attended=attended)


@given(kappas=st.lists(st.floats(0.01, 1.0), min_size=1, max_size=4), seed=st.integers(0, 50))
@settings(max_examples=20, deadline=None)
def test_value_error_scales_reduce_to_the_per_token_model_without_averaging(kappas, seed):
    """kappa = 1 everywhere and attended values equal to the values (one attended token): the per-token model
    (noise factor 1, truncation error the eigenvalue). Otherwise the noise factor is a convex mix of the kappas
    weighted by each component's energy per layer, and a halved attended moment halves the truncation error."""
    mom = _synthetic([1.0] * len(kappas), seed, True)
    full = build_latent_bases(mom.groups, mom.k, mom.v, mom.num_tokens, num_kv_heads=1, head_dim=4,
                              group_size=len(kappas), target_ratio=1.0, rank_allocation="uniform",
                              model_fingerprint={})
    out = value_error_scales(mom, full, "output")["v"][0]
    torch.testing.assert_close(out["noise"][0], torch.ones(4 * len(kappas), dtype=torch.float64), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["drop"][0], full.eigenvalues("v")[0][0].double(), rtol=1e-5, atol=1e-8)
    mom = _synthetic(kappas, seed, False)
    out = value_error_scales(mom, full, "output")["v"][0]
    torch.testing.assert_close(out["drop"][0], 0.5 * full.eigenvalues("v")[0][0].double(), rtol=1e-5, atol=1e-8)
    p = full.basis("v")[0][0].double().view(len(kappas), 4, -1).square().sum(1)  # (G, N) layer shares
    torch.testing.assert_close(out["noise"][0], (p * torch.tensor(kappas, dtype=torch.float64)[:, None]).sum(0),
                               rtol=1e-5, atol=1e-8)


def test_value_error_scales_need_the_attention_statistics():
    mom = _synthetic([0.5, 0.5], 0, True)
    full = mom.bases(1.0, "uniform")
    mom.attn_sumsq.pop(1)
    with pytest.raises(CKVPConfigError, match=r"layers \[1\]"):
        value_error_scales(mom, full)
    mom = _synthetic([0.5, 0.5], 0, True)
    mom.v_attended.clear()
    value_error_scales(mom, full, "noise")  # the noise model needs only kappa
    with pytest.raises(CKVPConfigError, match="mode='noise'"):
        value_error_scales(mom, full, "output")
