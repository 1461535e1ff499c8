"""The KIVI baseline of the fixture bench (:mod:`ckvp_compile.bench.kivi`, arXiv:2402.02750): the group quantizer's
round-trip bound, keys per channel and values per token, which tokens a cache holds in full precision step by step,
the byte accounting, the option string, and the fixture CLI with a baseline-only run (tiny settings)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ckvp_compile.bench.cli import main as bench_cli
from ckvp_compile.bench.kivi import (KIVIConfig, dequantize_groups, kivi_cache, kivi_kv_bytes, kivi_ratio,
                                     kivi_state_lengths, quantize_groups, quantize_keys, quantize_values)
from ckvp_compile.testing import build_hf_moe


def _groups_within_half_scale(x: torch.Tensor, bits: int) -> None:
    """x (..., G): every element within scale / 2 of its dequantized value (float32 slack only)."""
    codes, scale, zero = quantize_groups(x, bits)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 2 ** bits - 1
    assert scale.dtype == zero.dtype == torch.float16 and scale.shape == x.shape[:-1] + (1,)
    err = (x.float() - dequantize_groups(codes, scale, zero)).abs()
    slack = 1e-6 * x.float().abs().amax(-1, keepdim=True) + 1e-30
    assert (err <= scale.float() / 2 + slack).all()


@given(bits=st.integers(1, 8), groups=st.integers(1, 4), g=st.sampled_from([1, 4, 32]),
       mag=st.sampled_from([1e-3, 1.0, 300.0]), offset=st.sampled_from([0.0, 5.0, -1000.0]),
       seed=st.integers(0, 2 ** 16))
def test_round_trip_within_half_a_scale_per_group(bits, groups, g, mag, offset, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, groups, g, generator=gen) * mag + offset
    _groups_within_half_scale(x, bits)
    _groups_within_half_scale(x.to(torch.bfloat16), bits)


def test_constant_group_and_range_errors():
    codes, scale, zero = quantize_groups(torch.full((2, 8), 0.5), 2)  # a float16 constant: exact, scale 0
    assert float(scale.abs().max()) == 0.0 and torch.equal(dequantize_groups(codes, scale, zero), torch.full((2, 8), 0.5))
    with pytest.raises(ValueError, match="float16"):
        quantize_groups(torch.tensor([[1e6, -1e6]]), 4)
    with pytest.raises(ValueError, match="1..8"):
        quantize_groups(torch.ones(1, 4), 0)


@given(bits=st.sampled_from([2, 3, 4]), g=st.sampled_from([2, 8, 16]), h=st.integers(1, 3),
       n=st.integers(1, 3), seed=st.integers(0, 2 ** 16))
def test_keys_per_channel_values_per_token(bits, g, h, n, seed):
    gen = torch.Generator().manual_seed(seed)
    d = 2 * g
    x = torch.randn(2, h, n * g, d, generator=gen)
    x[..., :, 1] = 0.5  # a constant channel
    k, v = quantize_keys(x, bits, g), quantize_values(x, bits, g)
    assert k.shape == v.shape == x.shape and k.dtype == v.dtype == x.dtype
    # keys: one group = one channel of one head over g consecutive tokens
    kg = x.reshape(2, h, n, g, d).transpose(-1, -2)
    assert torch.equal(k, dequantize_groups(*quantize_groups(kg, bits)).transpose(-1, -2).reshape(x.shape))
    # values: one group = g consecutive channels of one token (heads one after the other)
    vg = x.permute(0, 2, 1, 3).reshape(2, n * g, h * d // g, g)
    assert torch.equal(v, dequantize_groups(*quantize_groups(vg, bits)).reshape(2, n * g, h, d).permute(0, 2, 1, 3))
    # a constant channel is one constant group per token group for the keys (exact), not for the values
    assert torch.equal(k[..., 1], x[..., 1]) and not torch.equal(v[..., 1], x[..., 1])
    with pytest.raises(ValueError, match="whole groups"):
        quantize_keys(x[:, :, :g - 1], bits, g)
    with pytest.raises(ValueError, match="whole groups"):
        quantize_values(x[:, :1, :, :g - 1], bits, g)


@pytest.mark.parametrize("spec,prompt", [("kivi:2:8:8", 21), ("kivi:4:8:4", 16), ("kivi:3:4:10", 3)])
def test_cache_keeps_the_residual_exact_and_quantizes_the_rest_once(spec, prompt):
    """A prefill then decode steps through the hooked StaticCache: at each step the tokens written before it are
    quantized exactly where kivi_state_lengths says (keys per channel in whole groups, values per token), the
    rest, the step's own tokens included, are the bf16-rounded states; quantized tokens are not requantized."""
    cfg = KIVIConfig.parse(spec)
    model = build_hf_moe("mixtral", num_layers=1, hidden=32, num_heads=2, num_kv_heads=2, head_dim=16)
    steps, gen = 12, torch.Generator().manual_seed(0)
    cache = kivi_cache(model, prompt + steps, cfg)
    ks = torch.randn(1, 2, prompt + steps, 16, generator=gen) * 3
    vs = torch.randn(1, 2, prompt + steps, 16, generator=gen)
    kr, vr = ks.to(torch.bfloat16).float(), vs.to(torch.bfloat16).float()
    before, prev_k = 0, None
    for n in [prompt] + [1] * steps:
        keys, values = cache.update(ks[:, :, before:before + n], vs[:, :, before:before + n], 0)
        nk, nv = kivi_state_lengths(cfg, before)
        after = before + n
        assert nk % cfg.group == 0 and nk <= before and (before - nk) < cfg.key_flush
        assert torch.equal(keys[:, :, nk:after], kr[:, :, nk:after])  # the residual and the new tokens: exact
        assert torch.equal(values[:, :, nv:after], vr[:, :, nv:after])
        assert torch.equal(values[:, :, :nv], quantize_values(vr[:, :, :nv], cfg.bits, cfg.group))
        expect_k = torch.cat([quantize_keys(kr[:, :, i:i + cfg.group], cfg.bits, cfg.group)
                              for i in range(0, nk, cfg.group)] or [kr[:, :, :0]], dim=2)
        assert torch.equal(keys[:, :, :nk], expect_k)
        if prev_k is not None:  # quantized once: what was quantized is unchanged
            assert torch.equal(keys[:, :, :prev_k], expect_k[:, :, :prev_k])
        if nk:
            assert not torch.equal(keys[:, :, :nk], kr[:, :, :nk])
        prev_k, before = nk, after


def test_byte_accounting_and_the_issue_ratios():
    """4-bit g32: 4 + 2 * 16 / 32 = 5 bits, 3.2x; 2-bit g32: 3 bits, 5.33x; 4-bit g128: 4.25 bits, 3.76x."""
    assert [round(KIVIConfig.parse(s).format_ratio, 3) for s in ("kivi:4:32:16", "kivi:2:32:32", "kivi:4:128:32",
                                                                  "kivi:3:32:32")] == [3.2, 5.333, 3.765, 4.0]
    cfg = KIVIConfig.parse("kivi:4:32:16")
    assert cfg.key_flush == 32 and KIVIConfig.parse("kivi:4:32:64").key_flush == 64
    assert kivi_state_lengths(cfg, 192) == (192, 176) and kivi_state_lengths(cfg, 200) == (192, 184)
    # 192 tokens, 2 heads x 64: keys 192 x 128 x 4 bits + 6 groups x 128 channels x 4 bytes; values 176 tokens x
    # (128 x 4 bits + 4 groups x 4 bytes) + 16 bf16 tokens
    assert kivi_kv_bytes(cfg, 192, 2, 64) == 192 * 64 + 6 * 128 * 4 + 176 * (64 + 16) + 16 * 128 * 2
    assert kivi_ratio(cfg, 2 ** 20, 2, 64) == pytest.approx(3.2, rel=1e-3)  # the residual vanishes
    with pytest.raises(ValueError, match="whole groups"):
        kivi_kv_bytes(KIVIConfig.parse("kivi:4:48:0"), 64, 1, 64)


@given(bits=st.integers(1, 8), g=st.sampled_from([8, 32, 128]), r=st.integers(0, 160), tokens=st.integers(0, 600),
       h=st.integers(1, 4))
def test_bytes_count_every_stored_element(bits, g, r, tokens, h):
    cfg, d = KIVIConfig(bits, g, r), 128
    nk, nv = kivi_state_lengths(cfg, tokens)
    c = h * d
    # keys: a (scale, zero) per channel per token group; values: per token per channel group; 2 bytes otherwise
    bits_total = nk * c * bits + (nk // g) * c * 32 + nv * c * bits + nv * (c // g) * 32 + (2 * tokens - nk - nv) * c * 16
    assert kivi_kv_bytes(cfg, tokens, h, d) == math.ceil(bits_total / 8)
    assert nv == max(0, tokens - r) and tokens - nk < cfg.key_flush and nk % g == 0
    if tokens:
        assert 1.0 <= kivi_ratio(cfg, tokens, h, d) <= 16 / bits


def test_option_errors():
    for bad, msg in [("kivi:4:32", "kivi:BITS:GROUP:RESIDUAL"), ("kvq:4:32:16", "kivi:BITS"),
                     ("kivi:4:x:16", "integers"), ("kivi:0:32:16", "1..8"), ("kivi:4:0:16", "GROUP"),
                     ("kivi:4:32:-1", "RESIDUAL")]:
        with pytest.raises(ValueError, match=msg):
            KIVIConfig.parse(bad)
    assert KIVIConfig.parse("kivi:4:32:16") == KIVIConfig(4, 32, 16) and KIVIConfig(4, 32, 16).spec == "kivi:4:32:16"


def test_cli_baseline_only_fixture_run(tmp_path, capsys):
    out = tmp_path / "kivi.json"
    assert bench_cli(["decode", "--shape", "fixture", "--ratios", "--baseline", "kivi:2:32:16", "kivi:4:32:16",
                      "--prompts", "1", "--new-tokens", "3", "--prompt-len", "64", "--calib-windows", "1",
                      "--device", "cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["latent_format"] for r in rows] == [None, "dense, bf16 KV", "KIVI-2 g32 r16 (baseline)",
                                                  "KIVI-4 g32 r16 (baseline)"]
    two = rows[2]
    assert two["baseline"] == "kivi:2:32:16" and two["ratio_requested"] is None and two["ratio_format"] == 5.333
    assert two["ratio_state_only"] == round(kivi_ratio(KIVIConfig(2, 32, 16), 67, 2, 64), 3)
    assert 5.0 < two["ratio_measured_at_budget"] < 5.333 and two["tokens"] == 3 and 0 <= two["agreement"] <= 1
    for argv, msg in [(["--baseline", "kivi:4:32"], "kivi:BITS:GROUP:RESIDUAL"), (["--ratios"], "--baseline"),
                      (["--baseline", "kivi:9:32:16"], "1..8")]:
        assert bench_cli(["decode", "--shape", "fixture", *argv]) == 2
        assert msg in capsys.readouterr().err
    assert bench_cli(["decode", "--shape", "tiny", "--baseline", "kivi:4:32:16"]) == 2
    assert "--baseline is for --shape fixture" in capsys.readouterr().err
