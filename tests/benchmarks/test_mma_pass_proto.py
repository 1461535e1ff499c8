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
@given(seed=st.integers(0, 2**16), g=st.sampled_from([2, 4, 8]), t=st.sampled_from([16, 64, 192]))
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


from ckvp_compile.testing.ptx import run_dequant_asm as _run_dequant_asm  # noqa: E402


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_dequant_asm_yields_the_centred_codes_the_layout_promises(proto, seed):
    """Keys: output 2j + e of word q (op j = (s, h)) is (code - 8) * 16^h of coordinate 16s + 8h + 2q + e. Values:
    of the pair word of half-word g of tokens (2p, 2p + 1), output 2i + e is (code - 8) * 16^(i % 2) of coordinate
    g + 8i of token 2p + e. Checked against the codes that were packed, not against the unpackers."""
    asm = str(proto._DEQ_ASM.value if hasattr(proto._DEQ_ASM, "value") else proto._DEQ_ASM)
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (2, 32), generator=gen, dtype=torch.uint8)
    words = proto.pack_keys(codes)
    for q in range(4):
        got = _run_dequant_asm(asm, int(words[0, q]))
        for j in range(4):
            s, h = divmod(j, 2)
            for e in range(2):
                want = (int(codes[0, 16 * s + 8 * h + 2 * q + e]) - 8) * 16 ** h
                assert got[2 * j + e] == want, (q, j, e)
    pairs = proto.pair_values(proto.pack_values(codes))  # (1, 8): tokens 0 and 1
    for g in range(8):
        got = _run_dequant_asm(asm, int(pairs[0, g]))
        for i in range(4):
            for e in range(2):
                assert got[2 * i + e] == (int(codes[e, g + 8 * i]) - 8) * 16 ** (i % 2), (g, i, e)


@settings(max_examples=50, deadline=None)
@given(tiles=st.integers(1, 600), nsplit=st.integers(1, 64), bt=st.sampled_from([16, 32, 64, 128]))
def test_split_plan_covers_the_context_with_no_empty_split(proto, tiles, nsplit, bt):
    T = tiles * bt
    chunk, n = proto.split_plan(T, nsplit, bt)
    assert chunk % bt == 0 and (n - 1) * chunk < T <= n * chunk and n <= nsplit


def test_launch_refuses_what_the_prototype_does_not_pack(proto):
    for g, t, why in ((1, 256, "G = 2, 4 or 8"), (4, 200, "multiple of")):
        prep = proto.prepare(proto.make_case(1, 1, g, t, "cpu"))
        with pytest.raises(ValueError, match=why):
            proto.launch(prep, 2, nt=2)
