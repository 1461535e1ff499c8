"""Quantized latent storage formats (kernels/latent_format.py): round-trip bounds, packing, layout, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckvp_compile.kernels.latent_format import (
    dequantize_latent_ref,
    pack_codes,
    pack_ternary,
    unpack_ternary,
    parse_latent_format,
    quantize_latent_ref,
    unpack_codes,
)

FORMATS = ["int8", "int8/64", "int4", "int4/16", "int2/8", "int2", "tern", "tern/16"]


@st.composite
def latents(draw):
    ranks = draw(st.lists(st.integers(0, 40), min_size=1, max_size=4))
    offsets = [0]
    for r in ranks:
        offsets.append(offsets[-1] + r)
    lead = (draw(st.integers(1, 3)), draw(st.integers(1, 5)))
    scale = draw(st.sampled_from([1e-3, 1.0, 50.0]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(*lead, offsets[-1], generator=g) * scale
    if draw(st.booleans()) and z.numel():  # constant blocks (scale 0) and outliers
        z[..., : min(3, z.shape[-1])] = 7.0
    return z, offsets


def _step_per_coordinate(rows, offsets, fmt):
    """The block scale of every packed coordinate (for the half-step bound)."""
    f = parse_latent_format(fmt)
    nb = f.num_blocks(offsets)
    if nb == 0:
        return torch.zeros(*rows.shape[:-1], 0)
    n_code = sum(f.code_bytes(offsets))
    scale = rows[..., n_code:n_code + 2 * nb].clone(memory_format=torch.contiguous_format).view(torch.float16).float()
    padded = f.padded_offsets(offsets)
    block_of = torch.cat([(torch.arange(b - a) + p) // f.block
                          for a, b, p in zip(offsets, offsets[1:], padded)] or [torch.zeros(0, dtype=torch.long)])
    return scale[..., block_of]


@given(latents(), st.sampled_from(FORMATS))
@settings(max_examples=25)
def test_dequantize_quantize_within_half_a_step(data, fmt):
    z, offsets = data
    f = parse_latent_format(fmt)
    rows = quantize_latent_ref(z, offsets, fmt)
    assert rows.dtype == torch.uint8 and rows.shape == (*z.shape[:-1], f.row_width(offsets))
    x = dequantize_latent_ref(rows, offsets, fmt)
    assert x.shape == z.shape
    step = _step_per_coordinate(rows, offsets, fmt)
    err = (x - z).abs()
    # half a step, plus fp32 rounding of code * scale + min
    bound = step / 2 + 1e-6 * (z.abs() + step * (1 << f.bits))
    assert bool((err <= bound).all()), float((err - bound).max())


@given(st.sampled_from([8, 4, 2]), st.integers(1, 6), st.integers(0, 2**16))
@settings(max_examples=20)
def test_code_packing_round_trips_bit_exactly(bits, n_bytes, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (3, n_bytes * 8 // bits), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (3, n_bytes) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed, bits), codes)
    assert torch.equal(pack_codes(unpack_codes(packed, bits), bits), packed)


def test_row_layout_counts_every_byte():
    f = parse_latent_format("int4/32")
    # heads of rank 40 and 7 -> 20 + 4 code bytes (the last half byte padded), 2 + 1 blocks: 3 fp16 scales and
    # 3 fp16 mins
    assert f.row_width([0, 40, 47]) == 24 + 12
    assert parse_latent_format("int2/32").row_width([0, 5]) == 2 + 4
    assert parse_latent_format("int8").name == "int8/32"
    assert parse_latent_format("float").row_width([0, 5, 9]) == 9


@pytest.mark.parametrize("bad", ["int3", "fp8", "int4/3", "int2/2", "int8/0"])
def test_unknown_formats_are_refused_with_the_valid_names(bad):
    with pytest.raises(ValueError, match="int8|block"):
        parse_latent_format(bad)


def test_values_beyond_fp16_range_are_refused():
    with pytest.raises(ValueError, match="fp16 range"):
        quantize_latent_ref(torch.tensor([[1e6, 0.0]]), [0, 2], "int8")


@st.composite
def mixed_formats(draw):
    """A latent and a random per-head bit plan ('mix/<block>:...') whose counts sum to each head's rank."""
    block = draw(st.sampled_from([8, 16, 32]))
    heads, offsets = [], [0]
    for _ in range(draw(st.integers(1, 3))):
        segs = [(draw(st.sampled_from([8, 4, 2])), draw(st.integers(1, 40))) for _ in range(draw(st.integers(1, 3)))]
        heads.append("+".join(f"{b}x{c}" for b, c in segs))
        offsets.append(offsets[-1] + sum(c for _, c in segs))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    z = torch.randn(2, 3, offsets[-1], generator=g) * draw(st.sampled_from([0.01, 1.0, 30.0]))
    return z, offsets, f"mix/{block}:" + ",".join(heads)


@given(mixed_formats())
@settings(max_examples=25)
def test_mixed_bit_plans_round_trip_within_half_a_step(data):
    from ckvp_compile.kernels.latent_format import _quantize_pieces

    z, offsets, fmt = data
    f = parse_latent_format(fmt)
    rows = quantize_latent_ref(z, offsets, fmt)
    assert rows.shape[-1] == f.row_width(offsets)
    x = dequantize_latent_ref(rows, offsets, fmt)
    n_code, nb = sum(f.code_bytes(offsets)), f.num_blocks(offsets)
    scales = rows[..., n_code:n_code + 2 * nb].clone(memory_format=torch.contiguous_format).view(torch.float16).float()
    for col, count, bits, block0 in f.pieces(offsets):
        blocks = block0 + torch.arange(count) // f.block
        step = scales[..., blocks]
        err = (x[..., col:col + count] - z[..., col:col + count]).abs()
        assert bool((err <= step / 2 + 1e-6 * (z[..., col:col + count].abs() + step * (1 << bits))).all())
    # a uniform format laid out piece by piece is the same bytes as its vectorised layout
    uniform = "int4/" + str(f.block)
    assert torch.equal(_quantize_pieces(z.float(), offsets, parse_latent_format(uniform)),
                       quantize_latent_ref(z, offsets, uniform))


def test_mixed_plan_must_match_the_ranks():
    with pytest.raises(ValueError, match="plans"):
        parse_latent_format("mix/32:8x4+4x4").row_width([0, 9])
    with pytest.raises(ValueError, match="segment"):
        parse_latent_format("mix/32:3x4")


@given(st.integers(1, 23), st.integers(0, 2**16))
@settings(max_examples=20)
def test_ternary_codes_are_trits_and_pack_five_to_a_byte_bit_exactly(n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-1, 2, (2, n), generator=g, dtype=torch.int8)
    packed = pack_ternary(codes)
    assert packed.shape == (2, -(-n // 5)) and int(packed.max()) <= 242
    assert torch.equal(unpack_ternary(packed, n), codes)
    z = torch.randn(3, n, generator=g) * 5
    rows = quantize_latent_ref(z, [0, n], "tern/8")
    trits = unpack_ternary(rows[..., :-(-n // 5)], n)
    assert set(trits.unique().tolist()) <= {-1, 0, 1}
    x = dequantize_latent_ref(rows, [0, n], "tern/8")
    assert set((x / x.abs().amax(-1, keepdim=True).clamp_min(1e-30)).sign().unique().tolist()) <= {-1.0, 0.0, 1.0}


@given(latents(), st.sampled_from(["mxint8", "mxint8/16", "mxint4", "mxint4/8", "mxint4/64"]))
@settings(max_examples=30)
def test_power_of_two_formats_round_trip_within_half_a_step_and_exactly_in_bf16(data, fmt):
    """mxint: symmetric codes times 2**e; the error is at most half a step, and every dequantized value is a
    bfloat16 value (so the decode kernel multiplies it on bf16 tensor cores exactly)."""
    z, offsets = data
    f = parse_latent_format(fmt)
    rows = quantize_latent_ref(z, offsets, fmt)
    assert rows.dtype == torch.uint8 and rows.shape == (*z.shape[:-1], f.row_width(offsets))
    x = dequantize_latent_ref(rows, offsets, fmt)
    assert torch.equal(x.bfloat16().float(), x)
    n_code = sum(f.code_bytes(offsets))
    exps = rows[..., n_code:].to(torch.int32) - 127
    assert exps.shape[-1] == f.num_blocks(offsets) and bool(((exps >= -126) & (exps <= 127)).all())
    padded = f.padded_offsets(offsets)
    block_of = torch.cat([(torch.arange(b - a) + p) // f.block
                          for a, b, p in zip(offsets, offsets[1:], padded)] or [torch.zeros(0, dtype=torch.long)])
    e = exps[..., block_of]
    step = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)
    assert bool(((x - z).abs() <= step / 2).all())
    # codes are within [-qmax, qmax]: |x| / step <= qmax
    qmax = (1 << (f.bits - 1)) - 1
    assert bool(((x.abs() / step).round() <= qmax).all())
    # idempotent: quantizing the dequantized values stores the same bytes
    assert torch.equal(quantize_latent_ref(x, offsets, fmt), rows)


def test_power_of_two_row_layout():
    f = parse_latent_format("mxint4/32")
    # heads of rank 40 and 7 -> 20 + 4 code bytes, 3 blocks, one exponent byte each
    assert f.row_width([0, 40, 47]) == 24 + 3
    assert parse_latent_format("mxint8").name == "mxint8/32" and f.pow2 and f.quantized
    with pytest.raises(ValueError, match="mxint"):
        parse_latent_format("mxint2")


@pytest.mark.parametrize("fmt", ["tern", "tern/64", "int8", "int4/32", "int2", "mxint8", "mxint4/32"])
@pytest.mark.parametrize("offsets", [[0, 0, 7], [0, 7, 7], [0, 7, 20]])
def test_rank_zero_heads_and_zero_rows_round_trip(fmt, offsets):
    """A head of rank 0 (the planner may drop one) and an empty batch quantize and dequantize like any other
    layout (the ternary reference used to fail on both), within half a step per element."""
    import torch

    from ckvp_compile.kernels.latent_format import dequantize_latent_ref, parse_latent_format, quantize_latent_ref

    z = torch.randn(3, offsets[-1], generator=torch.Generator().manual_seed(0))
    rows = quantize_latent_ref(z, offsets, fmt)
    assert rows.shape == (3, parse_latent_format(fmt).row_width(offsets))
    back = dequantize_latent_ref(rows, offsets, fmt)
    # half a step, in units of the largest |z| (a block's own range is at most that): asymmetric int: range / levels
    # / 2 <= max|z| / levels; ternary: scale / 2; mxint: a power-of-two scale >= max|z| / max code, so <= twice that
    half_step = {"tern": 0.5, "int8": 1 / 255, "int4": 1 / 15, "int2": 1 / 3, "mxint8": 1 / 127, "mxint4": 1 / 7}
    bound = half_step[fmt.split("/")[0]] * z.abs().max() * 1.01 + 1e-6
    assert back.shape == z.shape and float((back - z).abs().max()) <= float(bound)
    empty = quantize_latent_ref(torch.zeros(0, offsets[-1]), offsets, fmt)
    assert empty.shape[0] == 0 and dequantize_latent_ref(empty, offsets, fmt).shape == (0, offsets[-1])


@pytest.mark.parametrize("fmt, unit_bits, expected", [
    ("int4/32", 32, True), ("int8/4", 32, True), ("int2/16", 32, True),  # blocks of whole 32-bit words
    ("int4/4", 32, False), ("int2/8", 32, False), ("int8/2", 32, False),  # blocks of part of a word
    ("int4/4", 8, True), ("int2/4", 8, True), ("int4/2", 8, True), ("int4/2", 32, False),  # whole bytes
    ("int4/6", 1, False),  # block not a power of two
    ("float", 1, False), ("mxint4/32", 8, False), ("tern/32", 8, False),  # not uniform int
])
def test_uniform_int_blocks_names_what_the_one_pass_kernels_read(fmt, unit_bits, expected):
    assert parse_latent_format(fmt).uniform_int_blocks(unit_bits) is expected


# ---------------------------------------------------------------------------------------------- '-f8' block scales

def _f8_steps(rows, offsets, fmt):
    """Per packed coordinate, the step of its ``-f8`` block (span * fp32(1/levels)), and its bits."""
    from ckvp_compile.kernels.latent_format import f8_scale

    f = parse_latent_format(fmt)
    n_code, nb = sum(f.code_bytes(offsets)), f.num_blocks(offsets)
    span = rows[..., n_code:n_code + nb].clone(memory_format=torch.contiguous_format).view(torch.float8_e4m3fn).float()
    steps, bits = torch.zeros(*rows.shape[:-1], int(offsets[-1])), torch.zeros(int(offsets[-1]))
    for col, count, b, block0 in f.pieces(offsets):
        blocks = block0 + torch.arange(count) // f.block
        steps[..., col:col + count] = f8_scale(span[..., blocks], b)
        bits[col:col + count] = b
    return steps, bits


@st.composite
def f8_latents(draw):
    """A latent within the ``-f8`` range and a uniform or mixed ``-f8`` format for it."""
    block = draw(st.sampled_from([8, 16, 32, 64]))
    ranks = draw(st.lists(st.integers(0, 40), min_size=1, max_size=3))
    offsets = [0]
    for r in ranks:
        offsets.append(offsets[-1] + r)
    if draw(st.booleans()) and sum(ranks):
        heads = []
        for r in ranks:
            cuts = sorted(draw(st.lists(st.integers(1, max(r - 1, 1)), max_size=2, unique=True))) if r > 1 else []
            counts = [b - a for a, b in zip([0, *cuts], [*cuts, r])] if r else []
            heads.append("+".join(f"{draw(st.sampled_from([8, 4, 2]))}x{c}" for c in counts if c))
        if all(heads):
            fmt = f"mix/{block}-f8:" + ",".join(heads)
        else:
            fmt = f"int{draw(st.sampled_from([8, 4, 2]))}/{block}-f8"
    else:
        fmt = f"int{draw(st.sampled_from([8, 4, 2]))}/{block}-f8"
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    scale = draw(st.sampled_from([1e-3, 0.05, 1.0, 30.0]))
    z = torch.randn(2, 3, offsets[-1], generator=g) * scale + draw(st.sampled_from([0.0, 0.5])) * scale
    if draw(st.booleans()) and z.numel():  # a constant run and an extreme value
        z[..., : min(3, z.shape[-1])] = 7.0
        z[..., -1] = -191.0
    return z, offsets, fmt


@given(f8_latents())
@settings(max_examples=40)
def test_f8_formats_round_trip_within_half_a_step(data):
    z, offsets, fmt = data
    f = parse_latent_format(fmt)
    assert f.meta_f8 and f.meta_bytes == 2 and not f.uniform_int_blocks()
    rows = quantize_latent_ref(z, offsets, fmt)
    assert rows.dtype == torch.uint8 and rows.shape == (*z.shape[:-1], f.row_width(offsets))
    assert f.row_width(offsets) == sum(f.code_bytes(offsets)) + 2 * f.num_blocks(offsets)
    x = dequantize_latent_ref(rows, offsets, fmt)
    step, bits = _f8_steps(rows, offsets, fmt)
    err = (x - z).abs()
    bound = step / 2 + 1e-6 * (z.abs() + step * (2 ** bits))
    assert bool((err <= bound).all()), float((err - bound).max())
    # the e4m3 span is at most one e4m3 spacing (12.5%) plus the minimum's rounding above the exact range
    levels = 2 ** bits - 1
    assert bool((step * levels <= 192 * 2 + 16).all())


def test_f8_rows_are_two_bytes_a_block_smaller_and_name_round_trips():
    off = [0, 40, 47]
    assert parse_latent_format("int4/32-f8").row_width(off) == parse_latent_format("int4/32").row_width(off) - 2 * 3
    assert parse_latent_format("int4/32-f8").name == "int4/32-f8"
    assert parse_latent_format("int8-f8").name == "int8/32-f8"
    mix = parse_latent_format("mix/16-f8:8x16+4x24,2x7")
    assert mix.meta_f8 and mix.block == 16 and mix.row_width(off) == 16 + 12 + 2 + 2 * (1 + 2 + 1)
    assert parse_latent_format(mix.name) == mix
    with pytest.raises(ValueError, match="-f8"):
        parse_latent_format("int4/32-f16")


def test_f8_metadata_is_the_rounded_span_and_minimum():
    from ckvp_compile.kernels.latent_format import f8_block_range

    z = torch.tensor([[-0.3, 0.1, 0.7, 0.05] * 8])  # one block of 32
    rows = quantize_latent_ref(z, [0, 32], "int4/32-f8")
    span, mn = rows[0, 16:17].view(torch.float8_e4m3fn).float(), rows[0, 17:18].view(torch.float8_e4m3fn).float()
    assert float(mn) <= -0.3 and float(mn) > -0.3 * 1.13  # rounded down, within e4m3's spacing
    assert float(mn + span) >= 0.7 and float(span) <= (0.7 - float(mn)) * 1.13
    lo, hi = torch.tensor([-500.0, -1.0, float("nan")]), torch.tensor([1.0, 500.0, 1.0])
    mn_v, span_v, _, _ = f8_block_range(lo, hi)
    assert torch.isnan(mn_v[0]) and torch.isnan(span_v[1]) and torch.isnan(mn_v[2])  # unrepresentable: NaN


def test_f8_values_beyond_its_range_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="without '-f8'"):
        quantize_latent_ref(torch.tensor([[300.0, 0.0]]), [0, 2], "int8/32-f8")
    quantize_latent_ref(torch.tensor([[300.0, 0.0]]), [0, 2], "int8/32")  # the fp16 format holds it
