"""The Gluon tensor-core decode prototype (benchmarks/mma_pass_proto.py) on CPU: its packed code layout against the
bit positions its asm reads, its arithmetic (emulated in fp32 from the packed inputs) against the fp32 reference,
and, where Triton can compile for sm_90a here, a build with no shared memory and no spills. The GPU run (speed and
error at real shapes) is the script itself: benchmarks/results/2026-12-04-mma-pass-proto-h200."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "mma_pass_proto.py"


@pytest.fixture(scope="module")
def proto():
    pytest.importorskip("triton.experimental.gluon")
    spec = importlib.util.spec_from_file_location("mma_pass_proto", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), t=st.sampled_from([8, 24, 64]))
def test_pack_layout_round_trips(proto, seed, t):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (2, t, 32), generator=gen, dtype=torch.uint8)
    assert torch.equal(proto.unpack_keys(proto.pack_keys(codes)), codes.long())
    assert torch.equal(proto.unpack_values(proto.pack_values(codes)), codes.long())


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), g=st.sampled_from([2, 4, 8]), t=st.sampled_from([16, 64, 200]))
def test_emulated_arithmetic_matches_reference(proto, seed, g, t):
    """fp16 weights (no remainder): within 1e-3 of the fp32 reference, as on the H200 (1.4e-5 there)."""
    case = proto.make_case(1, 2, g, t, "cpu", seed=seed)
    ref = proto.reference(case)
    out = proto.emulate(proto.prepare(case))
    assert ((out - ref).norm() / ref.norm()).item() < 1e-3


def test_swapped_key_codes_move_the_output(proto):
    """A wrong nibble order would show here: swapping two key coordinates' codes moves the emulated output."""
    case = proto.make_case(1, 1, 4, 32, "cpu", seed=3)
    prep = proto.prepare(case)
    base = proto.emulate(prep)
    kc = case["kcodes"].clone()
    kc[..., [0, 1]] = kc[..., [1, 0]]
    prep2 = dict(prep, kw=proto.pack_keys(kc))
    assert not torch.allclose(proto.emulate(prep2), base, rtol=1e-4, atol=1e-5)


def test_compiles_for_sm90_without_shared_memory_or_spills(proto):
    from ckvp_compile.testing.sm90 import ptxas_stats, sm90_compile_available

    why = sm90_compile_available()
    if why:
        pytest.skip(why)
    k = proto.compile_only(nt=4, g=4, plo=False, prefetch=1, write=False)
    assert "local_alloc" not in k.asm["ttgir"]
    stats = ptxas_stats(k.asm["ptx"])
    assert stats["spill_store_bytes"] in (0, None) and stats["registers"] <= 128


def test_paired_value_words_hold_even_then_odd_token(proto):
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (3, 16, 32), generator=gen, dtype=torch.uint8)
    halves = proto.pack_values(codes).long() & 0xFFFF
    words = proto.pair_values(proto.pack_values(codes)).long() & 0xFFFFFFFF
    assert torch.equal(words & 0xFFFF, halves[:, 0::2]) and torch.equal(words >> 16, halves[:, 1::2])
