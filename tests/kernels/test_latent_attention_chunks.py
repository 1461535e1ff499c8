"""Host-side tests of the one-pass head-chunk latent attention (ckvp_compile/kernels/latent_attention_chunks.py): the
chunk layout the launcher derives (heads per chunk, padded ranks, contiguity and alignment claims the kernel turns
into vector loads) and where the default config turns it on. What the kernel computes is checked against the
reference under the interpreter in test_latent_attention_triton.py (property and fixed cases), its sm_90a compile in
test_sm90_compile.py."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ckvp_compile.kernels.latent_attention_chunks import chunk_heads, chunk_layout
from ckvp_compile.kernels.latent_attention_triton import default_config
from ckvp_compile.kernels.latent_format import parse_latent_format

INT_FORMATS = ("int4/32", "int8/32", "int8/8", "int4/8", "int2/16", "int2/4")


def _offsets(ranks):
    off = [0]
    for r in ranks:
        off.append(off[-1] + r)
    return off


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(ranks=st.lists(st.integers(0, 140), min_size=1, max_size=20), vranks=st.data(),
       kfmt=st.sampled_from(INT_FORMATS), vfmt=st.sampled_from(INT_FORMATS),
       columns=st.sampled_from((16, 32, 64, 128, 256)), equal=st.booleans())
def test_chunk_layout_claims_hold(ranks, vranks, kfmt, vfmt, columns, equal):
    hkv = len(ranks)
    if equal:
        ranks = [ranks[0]] * hkv
    vr = vranks.draw(st.lists(st.integers(0, 140), min_size=hkv, max_size=hkv))
    kf, vf = parse_latent_format(kfmt), parse_latent_format(vfmt)
    ko, vo = _offsets(ranks), _offsets(vr)
    rk, rv = max(max(ranks), 1), max(max(vr), 1)
    lay = chunk_layout(columns, 1, kf, vf, ko, vo, rk, rv, hkv, 1, 1)
    assert lay is not None
    nh = lay["NH"]
    assert nh & (nh - 1) == 0 and lay["n_chunks"] * nh >= hkv > (lay["n_chunks"] - 1) * nh
    assert lay["RKP"] >= rk and lay["RVP"] >= rv and nh * lay["RKP"] >= 16  # the table product's N
    assert lay["RKP"] * kf.bits >= 8 and lay["RVP"] * vf.bits >= 8  # whole code bytes per padded head
    assert nh == 1 or nh * max(lay["RKP"], lay["RVP"]) <= columns
    for tag, f, off, rp in (("K", kf, ko, lay["RKP"]), ("V", vf, vo, lay["RVP"])):
        rr = [b - a for a, b in zip(off, off[1:])]
        cb = f.code_bytes(off)
        col0 = [sum(cb[:i]) for i in range(hkv)]
        nb = [-(-r // f.block) for r in rr]
        blk0 = [sum(nb[:i]) for i in range(hkv)]
        for h0 in range(0, hkv, nh):
            assert col0[h0] % lay[f"{tag}_ALIGN"] == 0 and blk0[h0] % lay[f"{tag}_BLK_ALIGN"] == 0
            if lay[f"{tag}_CONTIG"] and nh > 1:  # the kernel reads head h0 + i's codes at col0[h0] + i * rp*bits/8
                for i, h in enumerate(range(h0, min(h0 + nh, hkv))):
                    assert col0[h] == col0[h0] + i * rp * f.bits // 8
                    assert blk0[h] == blk0[h0] + i * -(-rp // f.block)  # and its blocks right after


def test_chunk_layout_refuses_what_the_kernel_does_not_read():
    off = _offsets([8] * 4)
    i4 = parse_latent_format("int4/32")
    assert chunk_layout(0, 1, i4, i4, off, off, 8, 8, 4, 1, 1) is None  # off
    assert chunk_layout(128, 4, i4, i4, off, off, 8, 8, 4, 1, 1) is None  # GQA
    assert chunk_layout(128, 1, i4, i4, off, off, 8, 8, 4, 4, 1) is None  # unit-major keys
    for fmt in ("float", "mxint4/32", "int4/24"):  # float, MX, a block that is not a power of two
        f = parse_latent_format(fmt)
        assert chunk_layout(128, 1, f, i4, off, off, 8, 8, 4, 1, 1) is None, fmt
        assert chunk_layout(128, 1, i4, f, off, off, 8, 8, 4, 1, 1) is None, fmt
    lay = chunk_layout(128, 1, i4, i4, off, off, 8, 8, 4, 1, 1)
    assert lay["NH"] == 4 and lay["K_CONTIG"] and lay["K_ALIGN"] == 16


def test_chunk_heads_is_the_widest_power_of_two_within_the_columns():
    assert chunk_heads(8, 128, 16) == 16
    assert chunk_heads(16, 128, 16) == 8
    assert chunk_heads(128, 128, 16) == 1
    assert chunk_heads(256, 128, 16) == 1  # one head even when it is wider
    assert chunk_heads(8, 128, 3) == 4  # rounded up past the heads: the last chunk masks its missing heads


def test_default_config_chunks_only_where_measured_faster():
    assert default_config(1, 16, paired=True, rank=8, rank_v=8).head_chunks == 128
    assert default_config(1, 16, paired=True, rank=8, rank_v=12).head_chunks == 0
    assert default_config(1, 16, paired=True, rank=12).head_chunks == 0
    assert default_config(1, 16, paired=False, rank=8).head_chunks == 0  # measured with paired tables only
    assert default_config(4, 16, paired=True, rank=8).head_chunks == 0
    # without RoPE tables (post-RoPE key bases): 256-column chunks up to rank 128 (the measured plan's ranks 8-96)
    assert default_config(1, 128, paired=True, rank=96, rank_v=64, table_free=True).head_chunks == 256
    assert default_config(1, 16, paired=True, rank=8, rank_v=8, table_free=True).head_chunks == 256
    assert default_config(1, 256, paired=True, rank=200, table_free=True).head_chunks == 0  # not measured
    assert default_config(4, 128, paired=True, rank=96, table_free=True).head_chunks == 0  # GQA: no chunk kernel


def test_chunk_layout_is_cached_per_call_shape_and_returns_copies():
    from ckvp_compile.kernels.latent_attention_chunks import _chunk_layout

    i4 = parse_latent_format("int4/32")
    off = [0, 8, 16, 24, 32]
    first = chunk_layout(128, 1, i4, i4, off, off, 8, 8, 4, 1, 1)
    first["NH"] = -1  # a caller's edit must not reach the cache
    hits = _chunk_layout.cache_info().hits
    again = chunk_layout(128, 1, i4, i4, tuple(off), tuple(off), 8, 8, 4, 1, 1)  # list or tuple: the same entry
    assert again["NH"] == 4 and again is not first
    assert _chunk_layout.cache_info().hits == hits + 1
    assert chunk_layout(128, 1, i4, i4, [0, 16, 32, 48, 64], [0, 8, 16, 24, 32], 16, 8, 4, 1, 1)["RKP"] == 16
