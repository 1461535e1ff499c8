"""The offline layout measurement of the fidelity bench (bench/fidelity_layout.py): per-channel quantization,
reconstruction, the eager chunked evaluation (exactly dense with dense K / V) and the one-unit KL meter of the
'+measured' planner."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckvp_compile.bench import fidelity_layout as fl
from ckvp_compile.bench.fidelity import FidelityConfig, _collect_moments, dense_stats
from ckvp_compile.testing import build_hf_moe


@given(bits=st.sampled_from([2, 4, 8]), tokens=st.sampled_from([4, 8, 16]), seed=st.integers(0, 99))
@settings(max_examples=20, deadline=None)
def test_per_channel_blocks_are_within_half_a_step_of_their_channel(bits, tokens, seed):
    """Each latent coordinate is quantized over blocks of ``tokens`` tokens: the error is at most half the step of
    that (coordinate, token block), whose range is the coordinate's own, not the row's."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(2, 4 * tokens, 12, generator=g) * torch.logspace(1, -2, 12)  # channels of very unequal scale
    offsets = [0, 5, 12]
    out = fl.quantize_channels(z, offsets, f"int{bits}/8", tokens)
    blocks = z.view(2, 4, tokens, 12)
    step = (blocks.amax(2) - blocks.amin(2)) / ((1 << bits) - 1)  # (2, 4, 12)
    err = (out - z).abs().view(2, 4, tokens, 12)
    assert bool((err <= step[:, :, None] * 0.5 * (1 + 2e-3) + 1e-6).all())
    with pytest.raises(ValueError, match="multiple"):
        fl.quantize_channels(z[:, :tokens + 1], offsets, f"int{bits}", tokens)


def test_layout_bytes_match_when_the_block_is_the_token_group():
    """Per-token blocks of 32 coordinates and per-channel blocks of 32 tokens cost the same bytes per token when
    the ranks are multiples of 32 (a short last block makes per-token rows a little dearer)."""
    assert fl._layout_bytes("int4/32", [0, 64, 128], "token", 32, 2) == fl._layout_bytes("int4/32", [0, 64, 128],
                                                                                         "channel", 32, 2) == 80
    mix = "mix/32:4x32+2x32,4x64"
    assert fl._layout_bytes(mix, [0, 64, 128], "token", 32, 2) == fl._layout_bytes(mix, [0, 64, 128], "channel", 32, 2)
    assert fl._layout_bytes("int4/32", [0, 40], "token", 32, 2) > fl._layout_bytes("int4/32", [0, 40], "channel", 32, 2)


@pytest.fixture(scope="module")
def tiny():
    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    ids = torch.randint(0, 256, (6, 32), generator=torch.Generator().manual_seed(0))
    return model, ids[:4], ids[4:]


def test_layouts_run_and_dense_layouts_are_exact(tiny):
    """run_layouts checks that its chunked evaluation with dense K / V is the dense model (it raises otherwise);
    the dense layout then changes nothing, and quantized layouts keep their bytes and cost some fidelity."""
    model, calib, evals = tiny
    rows = fl.run_layouts(model, calib, evals, [FidelityConfig(2, 4.0, "uniform", "int4/8")],
                          [("dense", "dense"), ("token", "token"), ("channel", "token")], tokens=8, chunk=4,
                          batch_size=2, log=lambda s: None)
    dense, token, channel = rows
    assert dense.k_rel_err == dense.v_rel_err == 0.0 and abs(dense.kl_to_dense) < 1e-7  # fp32 rounding of a sum
    assert abs(dense.ppl_change_pct) < 1e-4  # percent: fp32 rounding of the chunked evaluation
    assert token.k_rel_err > 0 and token.kl_to_dense > 0 and token.k_bytes_per_token > 0
    assert channel.k_bytes_per_token <= token.k_bytes_per_token and channel.v_rel_err == token.v_rel_err


def test_unit_meter_is_zero_at_full_rank_and_grows_with_truncation(tiny):
    """The '+measured' planner's meter: one unit at full rank with exact latents and fp32 bases is the dense
    model (KL ~ 0); removing the unit (rank 0) or quantizing a block costs KL."""
    model, calib, _ = tiny
    mom = _collect_moments(model, calib, [2], 2, False)[2]
    full = mom.bases(1.0, "uniform")
    meter = fl.unit_kl_meter(model, calib[:2], full, basis_dtype=torch.float32, rotate=True, chunk=4, batch_size=2)
    rows = full.ranks("v")[0][0]
    assert abs(meter("v", 0, 1, rows, {}, 8)) < 1e-6
    assert meter("v", 0, 1, 0, {}, 8) > meter("v", 0, 1, rows // 2, {}, 8) >= 0
    assert meter("k", 0, 0, rows, {0: 2}, 8) > meter("k", 0, 0, rows, {0: 8}, 8) >= 0
    dense = dense_stats(model, calib[:2], 2)
    assert dense.stats.perplexity > 0


def test_unit_meter_measures_post_rope_bases_in_their_space(tiny, monkeypatch):
    """Post-RoPE key bases (LatentBases.key_space): the meter projects the keys as cached, after RoPE, and
    evaluates them without RoPE again: a key unit cut to rank r then loses exactly the discarded share of its
    calibration energy (projecting pre-RoPE keys onto these bases would lose another share)."""
    model, calib, _ = tiny
    w = calib[:2]
    full = _collect_moments(model, w, [2], 2, False, key_space="post_rope")[2].bases(1.0, "uniform")
    assert full.key_space == "post_rope"
    seen, real = [], fl._evaluate

    def spy(*args, **kwargs):
        seen.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(fl, "_evaluate", spy)
    meter = fl.unit_kl_meter(model, w, full, basis_dtype=torch.float32, rotate=False, chunk=4, batch_size=2)
    n = full.ranks("k")[0][1]
    assert abs(meter("k", 0, 1, n, {}, 8)) < 1e-6
    r = n // 4
    assert meter("k", 0, 1, r, {}, 8) > 0
    rec, post_rope = seen[-1][3], seen[-1][7]
    assert post_rope is True
    keys = {layer: fl._rope(model, k) for layer, (k, _) in fl.capture_kv(model, w, 2).items()}
    layers = full.groups[0]
    err = (sum(float((rec[i][0][:, 1] - keys[i][:, 1]).square().sum()) for i in layers)
           / sum(float(keys[i][:, 1].square().sum()) for i in layers))
    ev = full.eigenvalues("k")[0][1]
    assert err == pytest.approx(float(ev[r:].sum() / ev.sum()), rel=1e-3), err
