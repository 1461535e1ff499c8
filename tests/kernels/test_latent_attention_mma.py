"""The MMA pass (ckvp_compile/kernels/latent_attention_mma.py) on CPU.

Its Gluon kernel cannot run here (Triton's interpreter does not run Gluon), so these tests check what can be checked
without a GPU, and benchmarks/mma_attention_gpu.py checks the kernel itself against the reference on the H200
(benchmarks/results/2026-12-04-mma-h200):

* the dequantization asm, read instruction by instruction (:mod:`ckvp_compile.testing.ptx`), turns the product's
  packed latent rows into the centred codes of exactly the coordinates that ``key_coordinate`` /
  ``value_coordinate`` name (a wrong mask, shift, constant or map fails);
* the pass's arithmetic, emulated from those operands (folded query split into fp16 hi + lo and scaled by a power
  of two, centred codes, the 8 * sum(c) and min terms, fp16 hi + lo weights scaled per tile, the x16 columns), matches the
  fp32 latent attention over the dequantized latents, on random shapes (hypothesis);
* the same for ``int8/32`` latents (unit-major only, ``BITS=8``): the byte asm ``_DEQ_BYTES_ASM`` centres each byte
  of its two words by 128 exactly; the unit-major kernel's 8-bit operands hold the codes of the slot and coordinate
  its docstring names; the 8-bit arithmetic (query not divided by 16, codes - 128, the 128 * sum(c) and min terms,
  value column j = coordinate j) emulated from the quantized rows' unit-major words matches the fp32 latent
  attention, and a wrong centring constant is noticed;
* where it applies (``mma_layout``: int4, or int8 unit-major with int8 on both latents), the split plan, and that
  the launcher never picks it on CPU;
* the kernel compiles for sm_90a without spills, with and without shared-memory staging, and the unit-major kernel
  at ``bits=8`` (where Triton can compile for it here);
* the switches still off until a GPU check (``VPAIR``: 8-bit value slot pairs from one word in a permuted k order;
  ``PSCAN``: unmapped pages to the masked loop): the quad asm, the arithmetic with its operands, a numpy mirror of
  the permuted k order (P @ V equals the per-group products), and their sm_90a builds (no spills, shorter loop).
* the integer tensor-core switches, on by default since the H200 showed a gain (2026-12-07; ``IMMA``: the 8-bit key product as
  ``mma.m16n8k32`` on transposed u8 code words, the query as 16-bit s8 hi / lo rows; ``VIMMA``: the value product
  too, 16-bit weights packed from the scores' registers, the loaded value words as they are; ``FPAIR``: two slots'
  fp16 fields a ``prmt``): their asm read instruction by instruction, numpy mirrors of the kernel's operand code
  through the PTX fragment layouts (exact integer scores and products), the arithmetic within 1e-3 of the fp32
  attention at the score spreads of attention logits, and their sm_90a builds (no spills, shorter loops).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

lam = pytest.importorskip("ckvp_compile.kernels.latent_attention_mma")

from ckvp_compile.kernels.latent_format import dequantize_latent_ref, parse_latent_format, quantize_latent_ref  # noqa: E402
from ckvp_compile.testing.ptx import run_asm, run_dequant_asm  # noqa: E402

ASM = str(getattr(lam._DEQ_ASM, "value", lam._DEQ_ASM))


@pytest.fixture(autouse=True)
def _fp16_path_unless_asked(monkeypatch):
    """The tests below build each path on purpose: the integer tensor-core switches (IMMA, FPAIR, VIMMA; on by
    default since 2026-12-07) only where a test passes them, so the fp16 path's checks keep reading the fp16 path.
    The defaults themselves compile in tests/kernels/test_sm90_compile.py ('defaults')."""
    for env in ("CKVP_MMA_IMMA", "CKVP_MMA_FIELD_PAIRS", "CKVP_MMA_VIMMA"):
        monkeypatch.setenv(env, "0")
ASM8 = str(getattr(lam._DEQ_BYTES_ASM, "value", lam._DEQ_BYTES_ASM))
ASMQ = str(getattr(lam._DEQ_QUAD_ASM, "value", lam._DEQ_QUAD_ASM))


def _rows(hkv: int, t: int, seed: int, size: float = 1.0, fmt: str = "int4/32") -> tuple[torch.Tensor, list[int]]:
    """(t, W) uint8 ``fmt`` rows of ``hkv`` heads of rank 32 (the product's row layout) and the offsets."""
    gen = torch.Generator().manual_seed(seed)
    off = [32 * i for i in range(hkv + 1)]
    z = torch.randn(1, t, off[-1], generator=gen) * 2 * size
    return quantize_latent_ref(z, off, fmt)[0], off


def _word(row: torch.Tensor, byte: int) -> int:
    return int.from_bytes(bytes(row[byte:byte + 4].tolist()), "little")


def _half(row: torch.Tensor, byte: int) -> int:
    return int.from_bytes(bytes(row[byte:byte + 2].tolist()), "little")


def _codes(rows: torch.Tensor, off: list[int]) -> torch.Tensor:
    """(t, R) int codes, unpacked little-endian (low nibble first)."""
    f = parse_latent_format("int4/32")
    nbytes = sum(f.code_bytes(off))
    b = rows[:, :nbytes].long()
    return torch.stack((b & 0xF, b >> 4), -1).reshape(rows.shape[0], -1)


def _fp16_at(row: torch.Tensor, index: int) -> float:
    return float(row[2 * index:2 * index + 2].view(torch.float16)[0])


def test_coordinate_maps_are_permutations():
    assert sorted(lam.key_coordinate(k) for k in range(32)) == list(range(32))
    assert sorted(lam.value_coordinate(j) for j in range(32)) == list(range(32))


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), hkv=st.integers(1, 3))
def test_dequant_asm_reads_the_coordinates_the_maps_name(seed, hkv):
    """Keys: output 2j + e (op j = (s, h)) of head h's code word q is (code - 8) * 16^h of latent coordinate
    ``key_coordinate(16s + 8h + 2q + e)``. Values: of the pair word of half-word g of slots (2p, 2p + 1), output
    2i + e is (code - 8) * 16^(i % 2) of slot 2p + e at ``value_coordinate(g + 8i)``. Against the codes as
    quantized, through the real row layout (head h's codes at byte 16h)."""
    rows, off = _rows(hkv, 2, seed)
    codes = _codes(rows, off)
    head = seed % hkv
    for q in range(4):
        got = run_dequant_asm(ASM, _word(rows[0], 16 * head + 4 * q))
        for j in range(4):
            s, hb = divmod(j, 2)
            for e in range(2):
                k = 16 * s + 8 * hb + 2 * q + e
                assert got[2 * j + e] == (int(codes[0, 32 * head + lam.key_coordinate(k)]) - 8) * 16 ** hb, (q, j, e)
    for g in range(8):
        pair = _half(rows[0], 16 * head + 2 * g) | (_half(rows[1], 16 * head + 2 * g) << 16)
        got = run_dequant_asm(ASM, pair)
        for i in range(4):
            for e in range(2):
                want = (int(codes[e, 32 * head + lam.value_coordinate(g + 8 * i)]) - 8) * 16 ** (i % 2)
                assert got[2 * i + e] == want, (g, i, e)


def _fields(krows, vrows, head, k_sb, k_mb):
    """Per-slot fp16 fields of ``head`` read from the rows (scale / min fp16 indices ``k_sb`` / ``k_mb`` + head):
    (key scale, key min, value scale, value min), each (t,) fp32."""
    t = krows.shape[0]
    return tuple(torch.tensor([_fp16_at(rows[n], base + head) for n in range(t)])
                 for rows, base in ((krows, k_sb), (krows, k_mb), (vrows, k_sb), (vrows, k_mb)))


def _emulated_tile(x, v, fields, c, qf, center):
    """The pass's tile arithmetic from its operands: x (32, t) centred key codes and v (t, 32) centred value codes in
    mma order, c (G, 32) the query coefficients in the same order (divided where a column carries 16 * code), qf the
    (G, 32) folded query. The coefficients scaled into fp16's range and split hi + lo; scores with the
    ``center * sum(c)`` and min terms; the weights ``p * vscale * 2^ve`` split into fp16 hi + lo. Returns (value
    product / 2^ve (G, 32) before any column factor, the centred-min term (G, 1), the weights' sum (G, 1))."""
    ks, km, vs, vm = fields
    e_q = math.floor(math.log2(float(c.abs().max()))) - 13
    c = c * 2.0 ** -e_q
    hi = c.half()
    lo = (c - hi.float()).half()
    sc = (hi.float() @ x + lo.float() @ x) * 2.0 ** e_q  # sum_k c_k (code_k - center)
    sumc = qf.sum(-1, keepdim=True)
    s = (sc + center * sumc) * ks + km * sumc
    p = torch.exp2(s - s.amax(-1, keepdim=True))
    ve = 14 - math.floor(math.log2(float(vs.max())))
    w32 = p * (vs * 2.0 ** ve)
    w = w32.half().float() + (w32 - w32.half().float()).half().float()  # fp16 hi + lo rows
    return (w @ v) / 2.0 ** ve, (p * (vm + center * vs)).sum(-1, keepdim=True), p.sum(-1, keepdim=True)


def _emulate(krows, vrows, koff, voff, head, qf):
    """The pass's arithmetic for one (KV head, query token) over slots 0..t-1 as one tile (t even): (G, 32) value
    latent, in the latent's coordinate order, from the packed rows through the dequantization asm."""
    f = parse_latent_format("int4/32")
    hkv = len(koff) - 1
    t = krows.shape[0]
    code_bytes = sum(f.code_bytes(koff))
    k_sb, k_mb = code_bytes // 2, code_bytes // 2 + hkv  # fp16 indices of the scales and mins (one block per head)
    # key operand X (32 mma coordinates, t slots) and value operand V (t, 32 columns), as the asm makes them
    x = torch.zeros(32, t)
    for n in range(t):
        for q in range(4):
            got = run_dequant_asm(ASM, _word(krows[n], 16 * head + 4 * q))
            for j in range(4):
                s, hb = divmod(j, 2)
                for e in range(2):
                    x[16 * s + 8 * hb + 2 * q + e, n] = got[2 * j + e]
    v = torch.zeros(t, 32)
    for p in range(t // 2):
        for g in range(8):
            got = run_dequant_asm(ASM, _half(vrows[2 * p], 16 * head + 2 * g)
                                  | (_half(vrows[2 * p + 1], 16 * head + 2 * g) << 16))
            for i in range(4):
                for e in range(2):
                    v[2 * p + e, g + 8 * i] = got[2 * i + e]
    # the folded query in mma order, /16 on the h = 1 coordinates
    kk = torch.arange(32)
    c = qf[:, [lam.key_coordinate(int(k)) for k in kk]] * torch.where((kk // 8) % 2 == 1, 1 / 16, 1.0)
    wv, mins, l_sum = _emulated_tile(x, v, _fields(krows, vrows, head, k_sb, k_mb), c, qf, 8.0)
    jj = torch.arange(32)
    o = wv / torch.where((jj // 8) % 2 == 1, 16.0, 1.0) + mins  # odd column groups carry 16 * code
    out = torch.empty_like(o)
    out[:, [lam.value_coordinate(int(j)) for j in jj]] = o
    return out / l_sum


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), hkv=st.integers(1, 3), g=st.sampled_from([2, 4, 8]),
       t=st.sampled_from([8, 16, 32]), q_scale=st.sampled_from([0.3, 3.0, 300.0]),
       v_size=st.sampled_from([1.0, 1e-3]))
def test_emulated_arithmetic_matches_fp32_latent_attention(seed, hkv, g, t, q_scale, v_size):
    krows, koff = _rows(hkv, t, seed)
    vrows, voff = _rows(hkv, t, seed + 1, v_size)
    head = seed % hkv
    qf = torch.randn(g, 32, generator=torch.Generator().manual_seed(seed + 2)) * q_scale
    got = _emulate(krows, vrows, koff, voff, head, qf)
    kd = dequantize_latent_ref(krows[None], koff, "int4/32")[0, :, 32 * head:32 * head + 32].float()
    vd = dequantize_latent_ref(vrows[None], voff, "int4/32")[0, :, 32 * head:32 * head + 32].float()
    p = torch.softmax((qf.double() @ kd.double().T) * math.log(2.0), -1)
    want = (p @ vd.double()).float()
    err = float((got - want).norm() / want.norm())
    assert err <= 1e-3, err


def test_emulation_notices_a_wrong_coordinate_map(monkeypatch):
    """The emulation depends on the maps: a swapped pair of key coordinates moves its result past the bound."""
    krows, koff = _rows(1, 16, 3)
    vrows, voff = _rows(1, 16, 4)
    qf = torch.randn(4, 32, generator=torch.Generator().manual_seed(5)) * 3
    good = _emulate(krows, vrows, koff, voff, 0, qf)
    real = lam.key_coordinate
    monkeypatch.setattr(lam, "key_coordinate", lambda k: real({1: 2, 2: 1}.get(k, k)))
    bad = _emulate(krows, vrows, koff, voff, 0, qf)
    assert float((bad - good).norm() / good.norm()) > 1e-2


# ---- int8/32 latents (unit-major only, BITS=8): one code a byte column, centred by 128

@settings(max_examples=25, deadline=None)
@given(a=st.integers(0, 2**32 - 1), b=st.integers(0, 2**32 - 1))
@example(a=0, b=0xFFFFFFFF)
@example(a=0x807F01FE, b=0x7F80FE01)
def test_byte_dequant_asm_centres_each_byte(a, b):
    """``_DEQ_BYTES_ASM`` on words (a, b): output 2t is byte t of a minus 128, output 2t + 1 byte t of b minus 128,
    exactly (fp16 holds -128..127)."""
    want = []
    for t in range(4):
        want += [((a >> 8 * t) & 0xFF) - 128, ((b >> 8 * t) & 0xFF) - 128]
    assert run_asm(ASM8, [a, b], 8) == want


def _column_word(rows: torch.Tensor, byte: int, slot: int) -> int:
    """The unit-major word of byte column ``byte`` at slots ``slot .. slot + 3`` (little-endian, first slot lowest)."""
    return int.from_bytes(bytes(rows[slot:slot + 4, byte].tolist()), "little")


def _emulate8(krows, vrows, off, head, qf, center=128.0, quad_values=False):
    """The unit-major kernel's arithmetic at BITS 8 for one (KV head, query token) over slots 0..t-1 as one tile
    (t a multiple of 16): (G, 32) value latent in coordinate order, from ``int8/32`` rows (t, W) read as the kernel
    reads their unit-major byte columns (head ``head``'s code byte k = coordinate k), through the byte asm. Keys: the
    words of coordinates 2p, 2p + 1 at slots s0 .. s0 + 3 give outputs 2t / 2t + 1 = (coordinate 2p / 2p + 1, slot
    s0 + t); values: the words of one coordinate at slots 16q + 4d and 16q + 8 + 4d (d = 0, 1) give slots 16q + 4d +
    t / 16q + 8 + 4d + t. ``center``: the constant of the 128 * sum(c) and centred-min terms. ``quad_values``: the
    value operand of ``VPAIR`` instead (the quad asm, one word a slot pair; its slot order is what
    :func:`test_value_pairs_operands_multiply_to_the_named_products` checks)."""
    f = parse_latent_format("int8/32")
    hkv = len(off) - 1
    t = krows.shape[0]
    cb = f.code_bytes(off)
    c0 = sum(cb[:head])
    k_sb, k_mb = sum(cb) // 2, sum(cb) // 2 + hkv  # fp16 indices of the scales and mins (one block per head)
    x = torch.zeros(32, t)  # key operand: (coordinate, slot), centred codes
    for s0 in range(0, t, 4):
        for p in range(16):
            got = run_asm(ASM8, [_column_word(krows, c0 + 2 * p, s0), _column_word(krows, c0 + 2 * p + 1, s0)], 8)
            for u in range(4):
                x[2 * p, s0 + u], x[2 * p + 1, s0 + u] = got[2 * u], got[2 * u + 1]
    v = torch.zeros(t, 32)  # value operand: (slot, column = coordinate)
    for s0 in range(0, t, 4 if quad_values else 16):
        if quad_values:
            for k in range(32):
                v[s0:s0 + 4, k] = torch.tensor(run_asm(ASMQ, [_column_word(vrows, c0 + k, s0)], 4))
            continue
        for d in range(2):
            for k in range(32):
                got = run_asm(ASM8, [_column_word(vrows, c0 + k, s0 + 4 * d),
                                     _column_word(vrows, c0 + k, s0 + 8 + 4 * d)], 8)
                for u in range(4):
                    v[s0 + 4 * d + u, k], v[s0 + 8 + 4 * d + u, k] = got[2 * u], got[2 * u + 1]
    # the folded query in coordinate order (column k = coordinate k, none divided by 16); column j = coordinate j
    wv, mins, l_sum = _emulated_tile(x, v, _fields(krows, vrows, head, k_sb, k_mb), qf, qf, center)
    return (wv + mins) / l_sum


def _attention8(krows, vrows, off, head, qf):
    """fp32 (fp64) latent attention (base-2 scores) over the dequantized int8/32 latents of ``head``."""
    kd = dequantize_latent_ref(krows[None], off, "int8/32")[0, :, 32 * head:32 * head + 32].double()
    vd = dequantize_latent_ref(vrows[None], off, "int8/32")[0, :, 32 * head:32 * head + 32].double()
    p = torch.softmax((qf.double() @ kd.T) * math.log(2.0), -1)
    return (p @ vd).float()


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), hkv=st.integers(1, 3), g=st.sampled_from([2, 4, 8]),
       t=st.sampled_from([16, 32, 64]), q_scale=st.sampled_from([0.3, 3.0, 300.0]),
       v_size=st.sampled_from([1.0, 1e-3]))
def test_emulated_int8_arithmetic_matches_fp32_latent_attention(seed, hkv, g, t, q_scale, v_size):
    krows, off = _rows(hkv, t, seed, fmt="int8/32")
    vrows, _ = _rows(hkv, t, seed + 1, v_size, fmt="int8/32")
    head = seed % hkv
    qf = torch.randn(g, 32, generator=torch.Generator().manual_seed(seed + 2)) * q_scale
    got = _emulate8(krows, vrows, off, head, qf)
    want = _attention8(krows, vrows, off, head, qf)
    err = float((got - want).norm() / want.norm())
    assert err <= 1e-3, err


def test_int8_emulation_notices_a_wrong_centring_constant():
    """The 8-bit emulation depends on the centring constant: 8 (the 4-bit one) in place of 128 in the 128 * sum(c)
    and centred-min terms moves its result far past the bound; and the kernel uses 128 at BITS 8 in both places
    (``sumc8`` in ``_mma_unit_kernel``, ``_online_step``'s CENTER from ``_unit_step``)."""
    krows, off = _rows(2, 32, 3, fmt="int8/32")
    vrows, _ = _rows(2, 32, 4, fmt="int8/32")
    qf = torch.randn(4, 32, generator=torch.Generator().manual_seed(5)) * 3
    want = _attention8(krows, vrows, off, 1, qf)
    good = _emulate8(krows, vrows, off, 1, qf)
    assert float((good - want).norm() / want.norm()) <= 1e-3
    bad = _emulate8(krows, vrows, off, 1, qf, center=8.0)
    assert float((bad - want).norm() / want.norm()) > 1e-1
    assert "sumc * (128.0 if BITS == 8 else 8.0)" in lam._mma_unit_kernel.src
    assert "128.0 if BITS == 8 else 8.0, VPAIR, IMMA)" in lam._unit_step.src.split("return _online_step(")[-1]


def _layout(group=4, kfmt="int4/32", vfmt="int4/32", hkv=8, rk=32, rv=32, layouts=("row-major",) * 2, block_n=64,
            page=0, columns=4096):
    kf, vf = parse_latent_format(kfmt), parse_latent_format(vfmt)
    return lam._mma_layout(group, kf, vf, tuple(32 * i for i in range(hkv + 1)) if rk == 32 else
                           tuple(rk * i for i in range(hkv + 1)), tuple(32 * i for i in range(hkv + 1)), rk, rv,
                           tuple(layouts), block_n, page, columns)


def test_layout_applies_only_where_the_pass_packs():
    assert _layout() == dict(NT=4, GROUPS=2, BT=64, UNIT=False, BITS=4)
    assert _layout(group=2) == dict(NT=2, GROUPS=4, BT=64, UNIT=False, BITS=4)
    assert _layout(group=8) == dict(NT=8, GROUPS=1, BT=64, UNIT=False, BITS=4) and _layout(group=8, block_n=128) is None
    assert _layout(page=128) is not None and _layout(page=256, block_n=128) is not None
    um = ("unit-major",) * 2
    for g in (2, 4, 8):  # unit-major: 64-slot tiles whatever block_n says, NT = G
        assert _layout(group=g, layouts=um, block_n=128) == dict(NT=g, GROUPS=8 // g, BT=64, UNIT=True, BITS=4)
    assert _layout(layouts=um, page=64, columns=64) is not None
    for kw in (dict(group=1), dict(group=3), dict(group=16), dict(kfmt="int8/32"), dict(vfmt="int2/32"),
               dict(kfmt="int4/16"), dict(rk=64), dict(rk=16), dict(layouts=("row-major", "unit-major")),
               dict(layouts=(None, None)), dict(block_n=96), dict(block_n=32, group=2), dict(page=32), dict(page=96),
               dict(kfmt="float"), dict(layouts=um, columns=4000), dict(layouts=um, page=96, columns=96),
               dict(layouts=um, rk=16)):
        assert _layout(**kw) is None, kw
    cpu = torch.device("cpu")
    f = parse_latent_format("int4/32")
    assert lam.mma_layout(4, f, f, [0, 32], [0, 32], 32, 32, ("row-major",) * 2, 64, 0, cpu, False) is None


def test_layout_takes_int8_codes_only_unit_major_on_both_latents():
    """int8/32 (one code a byte): the unit-major kernel at BITS 8, whatever G, block_n or pages of 64 slots; never
    row-major, never with 4-bit codes on the other latent, and the int4 guards (rank, block, columns) still hold."""
    i8 = dict(kfmt="int8/32", vfmt="int8/32")
    um = ("unit-major",) * 2
    for g in (2, 4, 8):
        assert _layout(group=g, layouts=um, **i8) == dict(NT=g, GROUPS=8 // g, BT=64, UNIT=True, BITS=8)
    assert _layout(layouts=um, block_n=128, page=128, columns=128, **i8)["BITS"] == 8
    assert _layout(layouts=um, kfmt="int8/64", vfmt="int8/64")["BITS"] == 8  # one block per head (block >= 32)
    for kw in (dict(**i8), dict(block_n=128, **i8), dict(page=128, **i8),  # row-major int8: no kernel reads it
               dict(layouts=um, kfmt="int4/32", vfmt="int8/32"), dict(layouts=um, kfmt="int8/32", vfmt="int4/32"),
               dict(kfmt="int4/32", vfmt="int8/32"), dict(layouts=um, kfmt="int8/32", vfmt="int2/32"),
               dict(layouts=um, kfmt="int8/16", vfmt="int8/16"), dict(layouts=um, rk=64, **i8),
               dict(layouts=um, columns=4000, **i8), dict(layouts=um, page=96, columns=96, **i8),
               dict(layouts=("row-major", "unit-major"), **i8), dict(layouts=um, group=1, **i8)):
        assert _layout(**kw) is None, kw


def test_mma_layout_gates_int8_on_a_cuda_device(monkeypatch):
    """``mma_layout`` (the launcher's entry; ``_mma_layout`` behind the device checks) on a CUDA device of compute
    capability 9.0 (reported, as ``test_mma_unit_guards``' ``on_fake_gpu`` does): int8 unit-major taken with
    BITS 8, row-major int8 and int4 / int8 mixes refused; a mask, an sm_75 device or a CPU tensor refuse it too."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cap = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap[0])
    i4, i8 = parse_latent_format("int4/32"), parse_latent_format("int8/32")
    off = [32 * i for i in range(9)]
    um, rm = ("unit-major",) * 2, ("row-major",) * 2
    cuda = torch.device("cuda", 0)

    def lay(kf, vf, layouts, device=cuda, masked=False):
        return lam.mma_layout(4, kf, vf, off, off, 32, 32, layouts, 64, 0, device, masked, columns=4096)

    assert lay(i8, i8, um) == dict(NT=4, GROUPS=2, BT=64, UNIT=True, BITS=8)
    assert lay(i4, i4, um)["BITS"] == 4 and lay(i4, i4, rm)["BITS"] == 4
    assert lay(i8, i8, rm) is None and lay(i4, i8, um) is None and lay(i8, i4, um) is None
    assert lay(i8, i8, um, masked=True) is None and lay(i8, i8, um, device=torch.device("cpu")) is None
    cap[0] = (7, 5)
    assert lay(i8, i8, um) is None


@settings(max_examples=60, deadline=None)
@given(kv_len=st.integers(1, 300_000), block_n=st.sampled_from([64, 128]), rows=st.integers(1, 512),
       target=st.sampled_from([64, 1536, 3072]), fixed=st.one_of(st.none(), st.integers(1, 100)))
def test_split_plan_covers_the_context_without_empty_programs(kv_len, block_n, rows, target, fixed):
    n, per = lam.mma_splits(kv_len, block_n, rows, target, fixed)
    n_tiles = -(-kv_len // block_n)
    assert n >= 1 and per >= 1 and (n - 1) * per < n_tiles <= n * per
    if fixed is not None:
        assert n <= fixed


def test_split_plan_stays_inside_the_grid_limit():
    n, per = lam.mma_splits(70000 * 64, 64, 8, 3072, fixed=70000)
    assert n <= lam.MAX_GRID_Y and n * per >= 70000


def test_launcher_leaves_cpu_calls_to_the_other_passes():
    from ckvp_compile.bench.attention import make_inputs
    from ckvp_compile.kernels import latent_attention_triton as lat

    args = make_inputs(1, 128, "int4/32", 32, dev="cpu", heads=(8, 2), rope="none")
    assert lat._mma_layout(args[0], args[1], args[2], args[3], args[4], args[5], args[6], "int4/32", "int4/32",
                           None, None, lat.DecodeConfig(mma=True)) is None
    cfg = lat.default_config(4, 32, table_free=True, rank=32, rank_v=32, quantized_keys=True, code_bits=4)
    assert cfg.mma and cfg.block_n_m == 64
    cfg8 = lat.default_config(4, 32, table_free=True, rank=32, quantized_keys=True, code_bits=8)
    assert cfg8.mma and cfg8.block_n_m == 64 and not cfg8.words  # int8/32: the MMA pass (unit-major latents)
    assert not lat.default_config(4, 32, table_free=True, rank=32, quantized_keys=True, code_bits=2).mma
    args8 = make_inputs(1, 128, "int8/32", 32, dev="cpu", heads=(8, 2), rope="none")
    from ckvp_compile.kernels.latent_layout import to_layout

    uk, uv = to_layout(args8[1], "unit-major"), to_layout(args8[2], "unit-major")
    assert lat._mma_layout(args8[0], uk, uv, args8[3], args8[4], args8[5], args8[6], "int8/32", "int8/32", None,
                           None, lat.DecodeConfig(mma=True)) is None
    assert not lat.default_config(4, 64, table_free=True, rank=64, quantized_keys=True, code_bits=4).mma
    assert not lat.default_config(1, 32, table_free=True, rank=32, quantized_keys=True, code_bits=4).mma


@pytest.mark.parametrize("g,nt,page,unit,bits,stages", [
    (4, 4, 0, False, 4, 0), (2, 2, 0, False, 4, 0), (8, 8, 0, False, 4, 0), (4, 4, 128, False, 4, 0),
    (4, 8, 0, False, 4, 0), (2, 2, 0, True, 4, 0), (4, 4, 0, True, 4, 0), (8, 8, 0, True, 4, 0),
    (4, 4, 128, True, 4, 0), (4, 4, 0, True, 8, 0), (4, 4, 64, True, 8, 2), (8, 8, 0, True, 8, 4),
    (2, 2, 0, True, 4, 4), (4, 4, 128, True, 4, 2)])
def test_compiles_for_sm90_without_spills(g, nt, page, unit, bits, stages):
    from ckvp_compile.testing.sm90 import ptxas_stats, sm90_compile_available

    why = sm90_compile_available()
    if why:
        pytest.skip(why)
    k = lam.compile_for_sm90(g, nt, page, unit_major=unit, **({"bits": bits} if bits != 4 else {}),
                             **({"stages": stages} if stages else {}))
    ptx = k.asm["ptx"]
    stats = ptxas_stats(ptx)
    # the opt-in cp.async ring at 8 bits in 64-slot pages with the default switches (page scan, value pairs): Triton
    # 3.9's ptxas keeps 128 registers and spills one (4 bytes); 3.6's (the GPU machine's) spills none
    allowed = 4 if (stages and bits == 8 and page == 64) else 0
    assert (stats["spill_store_bytes"] or 0) <= allowed, stats["ptxas"]
    if not stages:
        assert k.metadata.shared <= 64  # no shared-memory staging (a few bytes of reduction scratch at most)
    else:  # the cp.async ring: per stage, a lane's key and value words (8 each a tile at 4 bits, 16 at 8) and its
        # four fields' words (4 each, 8 at G = 8), 32 lanes, 4 bytes each; nothing else in shared memory
        fields = 4 * (8 if g == 8 else 4)
        assert k.metadata.shared == stages * 32 * 4 * (16 * bits // 4 + fields), k.metadata.shared
        # 16-byte value copies (bypassing L1), 8-byte key copies, 4-byte field copies; vector reads back
        assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 0x10, 0x10;", ptx)
        assert re.search(r"cp\.async\.ca\.shared\.global \[[^]]+\], \[[^]]+\], 0x8, 0x8;", ptx)
        assert re.search(r"cp\.async\.ca\.shared\.global \[[^]]+\], \[[^]]+\], 0x4, 0x4;", ptx)
        assert "ld.shared.v4.b32" in ptx and "ld.shared.v2.b32" in ptx
        # the group accounting: STAGES - 1 groups in the prologue and one an iteration, each the copies of a tile
        # or empty past the last one (one commit after either branch), then the wait that leaves STAGES - 1 groups
        # in flight, and the drain before the masked tail
        assert ptx.count("cp.async.commit_group") == stages, ptx.count("cp.async.commit_group")
        assert re.search(rf"cp\.async\.wait_group\s+{stages - 1};", ptx)
        assert re.search(r"cp\.async\.wait_group\s+0;", ptx)
    if unit:  # each lane reads 16 bytes of a value column and 8 of a key column at once (the staged kernel's
        # masked tail tiles too)
        assert _vector_load(ptx, 4) and _vector_load(ptx, 2)
    # the byte asm (its lop3 keeping bytes 0 and 2 under 1024) exactly where the codes are 8-bit
    assert ("0x00ff00ff, 0x64006400, 0xea" in ptx) == (bits == 8)


def _vector_load(ptx: str, n: int) -> bool:
    """Whether ``ptx`` has an n-word global load (``ld.global[.nc][.<cache hints>].v<n>.b32``)."""
    return re.search(rf"ld\.global(?:\.[\w:]+)*\.v{n}\.b32", ptx) is not None


@pytest.mark.parametrize("g,page,bits", [(4, 64, 8), (4, 64, 4), (8, 64, 8), (2, 64, 4), (4, 0, 8)])
def test_lane_loads_compile_with_immediate_column_offsets(g, page, bits):
    """The unit-major kernel's lane loads (``LANES``): no spills, no shared memory, and the code loads of a tile
    share one address per lane (the column offsets are the loads' immediates: for 8-bit keys, columns 8b + e of
    ``page or 4096`` bytes each)."""
    from ckvp_compile.testing.sm90 import ptxas_stats, sm90_compile_available

    why = sm90_compile_available()
    if why:
        pytest.skip(why)
    k = lam.compile_for_sm90(g, g, page, unit_major=True, bits=bits, lanes=True)
    stats = ptxas_stats(k.asm["ptx"])
    assert stats["spill_store_bytes"] in (0, None)
    assert k.metadata.shared <= 64
    if not stats["sass"]:
        pytest.skip("no cuobjdump bundled with this Triton")
    col = page or 4096  # key codes: 8-byte loads of one column (two words a lane), offsets in bytes
    regs: dict = {}
    # (``.EF``: the latent loads' evict_first hint, latent_attention_mma.LOAD_HINT_GPU_CHECKED)
    for reg, off in re.findall(r"LDG\.E(?:\.EF)?\.64 R\d+, desc\[\w+\]\[(R\d+)\.64(?:\+0x([0-9a-f]+))?\]",
                               stats["sass"]):
        regs.setdefault(reg, set()).add(int(off or "0", 16))
    want = {(8 * b + e) * col for b in range(4) for e in range(2)} if bits == 8 else {4 * b * col for b in range(4)}
    assert any(want <= offs for offs in regs.values()), regs  # one lane address, the columns as immediates


def _np_tile_offsets(g, bits, ckw, cvw, k_col, v_col, fields):
    """The kernel's whole-tile word offsets (``koff``, ``voff``, ``foff_*`` of _mma_unit_kernel), in numpy."""
    import numpy as np

    nt, nws = g, (2 if g == 8 else 1)
    if bits == 8:
        w, q, c, b, e = np.ix_(range(2), range(4), range(8), range(4), range(2))
        koff = (k_col + 2 * q + 8 * b + e) * ckw + 2 * c + w
        d, q, n, m, e = np.ix_(range(4), range(4), range(8), range(2), range(2))
        voff = (v_col + n + 16 * m + 8 * e) * cvw + 4 * q + d
    else:
        w, q, c, b = np.ix_(range(2), range(4), range(8), range(4))
        koff = (k_col + q + 4 * b) * ckw + 2 * c + w
        d, q, n, m = np.ix_(range(4), range(4), range(8), range(2))
        voff = (v_col + n + 8 * m) * cvw + 4 * q + d
    r, q, e, i, lh = np.ix_(range(8), range(4), range(2), range(nws), range(2))
    fw = 4 * q + 2 * e + (r // g) * nt // 4 + i
    foff = [(2 * f + lh) * cw + fw for f, cw in zip(fields, (ckw, ckw, cvw, cvw))]
    return koff, voff, foff


def _np_lane_offsets(g, bits, ckw, cvw, k_col, v_col, fields):
    """The same words as _unit_lanes + _unit_load assemble them: each lane's first word plus constant column
    offsets, joined (np.stack on a new last axis, as gl.join) and permuted as the kernel does."""
    import numpy as np

    j = lambda a, b: np.stack([a, b], -1)  # noqa: E731 - gl.join
    nws = 2 if g == 8 else 1
    w, q, c = np.ix_(range(2), range(4), range(8))
    d, qv, n = np.ix_(range(4), range(4), range(8))
    vl = (v_col + n) * cvw + 4 * qv + d
    if bits == 8:
        kl = (k_col + 2 * q) * ckw + 2 * c + w
        x = _np_join4(*(j(kl + (8 * b) * ckw, kl + (8 * b + 1) * ckw) for b in range(4)))
        koff = x.transpose(0, 1, 2, 4, 3)
        y = j(j(vl, vl + 8 * cvw), j(vl + 16 * cvw, vl + 24 * cvw))
        voff = y.transpose(0, 1, 2, 4, 3)
    else:
        kl = (k_col + q) * ckw + 2 * c + w
        koff = _np_join4(kl, kl + 4 * ckw, kl + 8 * ckw, kl + 12 * ckw)
        voff = j(vl, vl + 8 * cvw)
    r, qf = np.ix_(range(8), range(4))
    fl = 4 * qf + (r // g) * g // 4
    foff = []
    for f, cw in zip(fields, (ckw, ckw, cvw, cvw)):
        t = fl + 2 * f * cw
        pair = lambda k: j(t + k, t + k + cw)  # noqa: E731 - _field_pair
        if nws == 1:
            z = j(pair(0).reshape(8, 4, 2, 1), pair(2).reshape(8, 4, 2, 1))
        else:
            z = j(j(pair(0), pair(1)), j(pair(2), pair(3)))
        foff.append(z.transpose(0, 1, 4, 3, 2))
    return koff, voff, foff


@pytest.mark.parametrize("g", [2, 4, 8])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("col", [64, 128, 4096])
def test_lane_loads_read_the_whole_tile_offsets(g, bits, col):
    """_unit_lanes + _unit_load (lane base + constant column offsets, joined and permuted) name exactly the words the
    whole-tile offsets name, element for element, for every head's first column and field units."""
    import numpy as np

    ckw = cvw = col // 4
    for k_col, v_col, fields in ((0, 0, (16, 17, 16, 17)), (32, 64, (40, 42, 72, 74)), (96, 32, (100, 103, 36, 39))):
        want = _np_tile_offsets(g, bits, ckw, cvw, k_col, v_col, fields)
        got = _np_lane_offsets(g, bits, ckw, cvw, k_col, v_col, fields)
        assert got[0].shape == want[0].shape and np.array_equal(got[0], want[0])
        assert got[1].shape == want[1].shape and np.array_equal(got[1], want[1])
        for a, b in zip(got[2], want[2]):
            assert a.shape == b.shape and np.array_equal(a, b)


# ---- unit-major latents (_mma_unit_kernel): the operands built from the loaded words, mirrored in numpy. gl.join
# stacks along a new last dim, gl.split unstacks it, gl.permute / gl.reshape are transpose / C-order reshape; the asm
# is executed by the PTX reader. Each operand must hold exactly the codes / fields of the slot and coordinate the
# kernel's docstring names (a swapped dim or a wrong selector fails).

def _np_join4(a, b, c, d):
    """``_join4``: (..., 4) from four arrays, in argument order, built as the kernel builds it (two joins)."""
    import numpy as np

    x = np.stack([np.stack([a, c], -1), np.stack([b, d], -1)], -1)
    return x.reshape(a.shape + (4,))


def _asm_map(asm, n_out, *words):
    """Run ``asm`` on each element of the int arrays ``words``: a list of ``n_out`` float arrays."""
    import numpy as np

    flat = [np.asarray(w).reshape(-1) for w in words]
    res = np.array([run_asm(asm, [int(w[i]) for w in flat], n_out) for i in range(flat[0].size)])
    return [res[:, k].reshape(np.asarray(words[0]).shape) for k in range(n_out)]


def _unit_columns(codes):
    """(64 slots, 32 coordinates) codes -> (16 byte columns, 16 words) of 4 slots each, as ints."""
    import numpy as np

    b = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint32)  # (slot, byte)
    col = b.T.reshape(16, 16, 4)
    return col[..., 0] | col[..., 1] << 8 | col[..., 2] << 16 | col[..., 3] << 24


@pytest.mark.parametrize("g", [2, 4, 8])
def test_unit_major_operands_hold_the_named_codes(g):
    import numpy as np

    nt, groups, bt = g, 8 // g, 64
    rng = np.random.default_rng(g)
    kc, vc = rng.integers(0, 16, (64, 32)), rng.integers(0, 16, (64, 32))
    kw, vw = _unit_columns(kc), _unit_columns(vc)
    centred = lambda x, odd: (x - 8.0) * np.where(odd, 16.0, 1.0)  # noqa: E731
    # keys: word (w, q, c, b) = column q + 4b, slots 8c + 4w
    w, q, c, b = np.meshgrid(range(2), range(4), range(8), range(4), indexing="ij")
    words = kw[q + 4 * b, 2 * c + w]
    d = _asm_map(str(getattr(lam._DEQ_COLUMN_ASM, "value", lam._DEQ_COLUMN_ASM)), 8, words)
    x = np.stack([_np_join4(d[0], d[2], d[4], d[6]), _np_join4(d[1], d[3], d[5], d[7])], -1)
    x = x.transpose(0, 4, 3, 1, 5, 2).reshape(groups, nt, 2, 2, 4, 2, 8)
    kb = x.transpose(0, 2, 3, 4, 5, 1, 6).reshape(32 * groups, 8 * nt)
    kk, col = np.meshgrid(range(32 * groups), range(8 * nt), indexing="ij")
    grp, k, j, cc = kk // 32, kk % 32, col // 8, col % 8
    assert np.array_equal(kb, centred(kc[8 * cc + grp * nt + j, k], k % 2 == 1))
    # values: word (d, q, n, m) = column n + 8m, slots 16q + 4d
    dd, q, n, m = np.meshgrid(range(4), range(4), range(8), range(2), indexing="ij")
    words = vw[n + 8 * m, 4 * q + dd]
    v = words.transpose(1, 2, 3, 0).reshape(4, 8, 2, 2, 2).transpose(0, 1, 2, 4, 3)
    va, vb_ = v[..., 0], v[..., 1]
    o = _asm_map(str(getattr(lam._DEQ_PAIRS_ASM, "value", lam._DEQ_PAIRS_ASM)), 16, va, vb_)
    ts = [np.stack([np.stack([o[4 * t], o[4 * t + 1]], -1), np.stack([o[4 * t + 2], o[4 * t + 3]], -1)], -1)
          for t in range(4)]
    y = _np_join4(*ts).transpose(0, 1, 2, 3, 6, 5, 4)
    y = y.transpose(3, 4, 0, 6, 2, 5, 1).reshape(groups, nt, 4, 2, 2, 2, 8)
    vb = y.transpose(1, 0, 2, 3, 4, 5, 6).reshape(bt, 32)
    kap, col = np.meshgrid(range(bt), range(32), indexing="ij")
    cc, grp, j = kap % 8, (kap // 8) % groups, kap // (8 * groups)
    i, n = col // 8, col % 8
    coord = 2 * (n + 8 * (i // 2)) + i % 2
    assert np.array_equal(vb, centred(vc[8 * cc + grp * nt + j, coord], i % 2 == 1))
    # the fp16 fields: two byte columns (low, high), word (r, q, e, wi, lh) at slots 16q + 8e + 4((grp NT) // 4 + wi)
    f = rng.standard_normal(64).astype(np.float16)
    fb = f.view(np.uint8).reshape(64, 2).T.reshape(2, 16, 4).astype(np.uint32)
    fcol = fb[..., 0] | fb[..., 1] << 8 | fb[..., 2] << 16 | fb[..., 3] << 24  # (lo / hi, 16 words)
    nws = 2 if nt == 8 else 1
    r, q, e, wi, lh = np.meshgrid(range(8), range(4), range(2), range(nws), range(2), indexing="ij")
    fw = fcol[lh, 4 * q + 2 * e + (r // g) * nt // 4 + wi]
    asm = "{ .reg .b32 t; .reg .b16 u; prmt.b32 t, $1, $2, $3; mov.b32 {$0, u}, t; }"
    assert asm in lam._fp16_of_bytes.src  # the kernel's own asm text
    rr = np.arange(8)[:, None, None] + np.zeros((8, 4, 2), int)
    vals = []
    for jj in range(nt):
        lo, hi = fw[..., 0], fw[..., 1]
        lo, hi = (lo[..., 0], hi[..., 0]) if nws == 1 else (lo[..., jj // 4], hi[..., jj // 4])
        t = ((rr // g) * nt + jj) % 4
        vals.append(_asm_map(asm, 1, lo, hi, t | ((4 + t) << 4))[0])
    if nt == 2:
        z = np.stack(vals, -1)
    elif nt == 4:
        z = _np_join4(*vals)
    else:
        z = np.stack([_np_join4(*vals[:4]), _np_join4(*vals[4:])], -1).transpose(0, 1, 2, 4, 3).reshape(8, 4, 2, 8)
    got = z.transpose(0, 3, 1, 2).reshape(8, 8 * nt)
    row, col = np.meshgrid(range(8), range(8 * nt), indexing="ij")
    slot = 8 * (col % 8) + (row // g) * nt + col // 8
    assert np.array_equal(got.astype(np.float16), f[slot])


def _unit_columns8(codes):
    """(64 slots, 32 coordinates) 8-bit codes -> (32 byte columns, 16 words) of 4 slots each, as ints."""
    import numpy as np

    col = codes.astype(np.uint32).T.reshape(32, 16, 4)
    return col[..., 0] | col[..., 1] << 8 | col[..., 2] << 16 | col[..., 3] << 24


@pytest.mark.parametrize("g", [2, 4, 8])
def test_unit_major_int8_operands_hold_the_named_codes(g):
    """``_unit_step`` at BITS 8, mirrored: key word (w, q, c, b, e) = column 8b + 2q + e at slots 8c + 4w, split on
    e into the byte asm's (a, b); value word (d, q, n, m, e) = column n + 16m + 8e at slots 16q + 4d, d = 0, 1
    paired with d + 2. The key operand's (row (grp, k), column 8j + c) must be code - 128 of slot 8c + grp NT + j at
    coordinate k, the value operand's (row, column j) that of the row's slot at coordinate j."""
    import numpy as np

    nt, groups, bt = g, 8 // g, 64
    rng = np.random.default_rng(10 + g)
    kc, vc = rng.integers(0, 256, (64, 32)), rng.integers(0, 256, (64, 32))
    kw, vw = _unit_columns8(kc), _unit_columns8(vc)
    # keys: gl.split(wk) on e; _dequant_bytes -> join(join4(d0, d2, d4, d6), join4(d1, d3, d5, d7))
    w, q, c, b, e = np.meshgrid(range(2), range(4), range(8), range(4), range(2), indexing="ij")
    words = kw[8 * b + 2 * q + e, 2 * c + w]
    d = _asm_map(ASM8, 8, words[..., 0], words[..., 1])
    x = np.stack([_np_join4(d[0], d[2], d[4], d[6]), _np_join4(d[1], d[3], d[5], d[7])], -1)
    x = x.transpose(0, 4, 3, 1, 5, 2).reshape(groups, nt, 2, 2, 4, 2, 8)
    kb = x.transpose(0, 2, 3, 4, 5, 1, 6).reshape(32 * groups, 8 * nt)
    kk, col = np.meshgrid(range(32 * groups), range(8 * nt), indexing="ij")
    grp, k, j, cc = kk // 32, kk % 32, col // 8, col % 8
    assert np.array_equal(kb, kc[8 * cc + grp * nt + j, k] - 128.0)
    # values
    dd, q, n, m, e = np.meshgrid(range(4), range(4), range(8), range(2), range(2), indexing="ij")
    words = vw[n + 16 * m + 8 * e, 4 * q + dd]
    v = words.transpose(1, 2, 3, 4, 0).reshape(4, 8, 2, 2, 2, 2).transpose(0, 1, 2, 3, 5, 4)
    o = _asm_map(ASM8, 8, v[..., 0], v[..., 1])
    y = np.stack([_np_join4(o[0], o[2], o[4], o[6]), _np_join4(o[1], o[3], o[5], o[7])], -1)
    y = y.transpose(0, 1, 2, 4, 5, 3, 6)  # (q, n, m, d, t, e, ab)
    y = y.transpose(3, 4, 0, 6, 2, 5, 1).reshape(groups, nt, 4, 2, 2, 2, 8)
    vb = y.transpose(1, 0, 2, 3, 4, 5, 6).reshape(bt, 32)
    kap, col = np.meshgrid(range(bt), range(32), indexing="ij")
    cc, grp, j = kap % 8, (kap // 8) % groups, kap // (8 * groups)
    assert np.array_equal(vb, vc[8 * cc + grp * nt + j, col] - 128.0)


def test_stages_outside_the_ring_sizes_are_refused():
    from ckvp_compile.kernels.latent_attention_triton import DecodeConfig

    for bad in (1, 3, 8, -2):
        with pytest.raises(ValueError, match="stages_m must be 0"):
            DecodeConfig(mma=True, stages_m=bad)
    assert DecodeConfig(stages_m=4).stages_m == 4


# ---- 8-bit value pairs from one word (VPAIR) and the page scan (PSCAN)

@settings(max_examples=25, deadline=None)
@given(a=st.integers(0, 2**32 - 1))
@example(a=0x807F01FE)
def test_quad_asm_centres_each_byte(a):
    """``_DEQ_QUAD_ASM`` on a word: output t is byte t minus 128, exactly (fp16 holds -128..127)."""
    assert run_asm(ASMQ, [a], 4) == [((a >> 8 * t) & 0xFF) - 128 for t in range(4)]


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), hkv=st.integers(1, 3), g=st.sampled_from([2, 4, 8]),
       t=st.sampled_from([16, 32, 64]), q_scale=st.sampled_from([0.03, 3.0, 300.0]),
       v_size=st.sampled_from([1.0, 1e-3]))
def test_emulated_value_pairs_arithmetic_matches_fp32_latent_attention(seed, hkv, g, t, q_scale, v_size):
    """The 8-bit arithmetic with ``VPAIR``'s value operand (the quad asm's codes) within the bound of the fp32 latent
    attention."""
    krows, off = _rows(hkv, t, seed, fmt="int8/32")
    vrows, _ = _rows(hkv, t, seed + 1, v_size, fmt="int8/32")
    head = seed % hkv
    qf = torch.randn(g, 32, generator=torch.Generator().manual_seed(seed + 2)) * q_scale
    got = _emulate8(krows, vrows, off, head, qf, quad_values=True)
    want = _attention8(krows, vrows, off, head, qf)
    err = float((got - want).norm() / want.norm())
    assert err <= 1e-3, err


def _np_group_pairs(p, g):
    """``_group_pairs`` in numpy: (8, 8 NT) weights in score-column order -> (8, 64) in VPAIR's k order."""
    import numpy as np

    nt, groups = g, 8 // g
    pe = p.reshape(8, nt // 2, 2, 4, 2).transpose(0, 1, 4, 3, 2)  # (r, m, h, q, e)
    r = (np.arange(8) // g)[:, None, None, None, None]
    keep = [pe * (r == k) for k in range(groups)]
    if groups == 1:
        out = pe
    elif groups == 2:
        out = np.stack(keep, -1).transpose(0, 5, 1, 2, 3, 4)
    else:
        out = np.stack([np.stack(keep[:2], -1), np.stack(keep[2:], -1)], -1).transpose(0, 6, 5, 1, 2, 3, 4)
    return out.reshape(8, 64)


@pytest.mark.parametrize("g", [2, 4, 8])
def test_value_pairs_operands_multiply_to_the_named_products(g):
    """``VPAIR`` mirrored (:func:`_unit_step`'s value words through the quad asm and its reshapes, and
    :func:`_group_pairs` for the weights): the value product ``P @ V`` over the permuted k order equals, for each
    row r and value coordinate, the sum over r's own slot group of weight (score column 8j + c) x (code - 128 of
    slot 8c + grp NT + j), the slot that score column read; and each thread's k pair (2q + e, e = 0, 1) is two
    adjacent slots of one 4-slot word."""
    import numpy as np

    nt, groups = g, 8 // g
    rng = np.random.default_rng(20 + g)
    vc = rng.integers(0, 256, (64, 32))
    vw = _unit_columns8(vc)
    dd, q, n, cm, ce = np.meshgrid(range(4), range(4), range(8), range(2), range(2), indexing="ij")
    words = vw[n + 16 * cm + 8 * ce, 4 * q + dd]
    quads = _asm_map(ASMQ, 4, words)
    y = _np_join4(*quads).reshape(2, 2, 4, 8, 2, 2, 4).transpose(0, 2, 3, 4, 5, 1, 6)
    y = y.reshape(2, 4, 8, 2, 2, groups, nt // 2, 2).transpose(5, 6, 0, 1, 7, 3, 4, 2)
    vb = y.reshape(64, 32)
    p = rng.random((8, 8 * nt))
    pa = _np_group_pairs(p, g)
    want = np.zeros((8, 32))
    for r in range(8):
        for col in range(8 * nt):
            j, c = divmod(col, 8)
            want[r] += p[r, col] * (vc[8 * c + (r // g) * nt + j] - 128.0)
    assert np.allclose(pa @ vb, want, rtol=1e-12, atol=0)
    # the k pair of each thread: rows 2q + e of each 16-row step are adjacent slots of one word
    slot_of = np.full(64, -1)
    for kap in range(64):
        col_match = [s for s in range(64) if np.array_equal(vb[kap], vc[s] - 128.0)]
        slot_of[kap] = col_match[0]
    pairs = slot_of.reshape(-1, 2)
    assert np.all(pairs[:, 1] == pairs[:, 0] + 1) and np.all(pairs[:, 0] % 2 == 0)


@pytest.mark.parametrize("kw", [dict(vpair=True, pscan=True), dict(pscan=True), dict(vpair=True, pscan=True, g=2),
                                dict(vpair=True, g=8, page=0)])
def test_fewer_instruction_variants_compile_for_sm90(kw):
    """``VPAIR`` / ``PSCAN`` compile for sm_90a without spills, without shared-memory staging, and each leaves its
    mark: VPAIR the quad asm's prmt with 0x64646464 and fewer ``lop3`` (the values'); the page scan's one vector
    load of page-table entries; fewer SASS instructions in the unmasked loop than the kernel without them, where
    cuobjdump is bundled."""
    from ckvp_compile.testing.sm90 import ptxas_stats, sm90_compile_available, tile_loop

    why = sm90_compile_available()
    if why:
        pytest.skip(why)
    kw = dict(kw)
    g, page = kw.pop("g", 4), kw.pop("page", 64)
    base = dict(vpair=False, pscan=False)
    k = lam.compile_for_sm90(g, g, page, unit_major=True, bits=8, lanes=True, **{**base, **kw})
    ptx = k.asm["ptx"]
    stats = ptxas_stats(ptx)
    assert stats["spill_store_bytes"] in (0, None), stats["ptxas"]
    assert k.metadata.shared <= 64
    base_ptx = lam.compile_for_sm90(g, g, page, unit_major=True, bits=8, lanes=True, **base).asm["ptx"]
    assert ("0x64646464" in ptx) == bool(kw.get("vpair"))
    assert (ptx.count("lop3.b32") < base_ptx.count("lop3.b32")) == bool(kw.get("vpair"))
    if kw.get("pscan") and page:
        assert _vector_load(ptx, 4)
    if not stats["sass"]:
        pytest.skip("no cuobjdump bundled with this Triton")
    old = ptxas_stats(base_ptx)

    assert len(tile_loop(stats["sass"])) < len(tile_loop(old["sass"]))


@pytest.mark.parametrize("g,bits,exact", [(4, 8, False), (8, 8, True), (4, 4, True)])
def test_fold_and_merge_in_pass_compile_for_sm90(g, bits, exact):
    """``FOLD`` + ``MERGE`` (the pass's own query fold and split merge) compile for sm_90a without spills in the tile
    loop (at most 32 bytes elsewhere), with the
    fold on the tensor cores (bf16 products: two per 32 channels where the bases are not bf16-exact, else one) and
    the merge behind one acquire-release atomic, and take no more registers than the pass without them where it
    fits 128 (G = 4, 8-bit: 16 one-warp programs an SM; elsewhere at most 4 more); their loops stay out of the tile
    loop (within 3% of its length: the fold costs up to 16 register moves a tile)."""
    from ckvp_compile.testing.sm90 import ptxas_stats, sm90_compile_available, tile_loop

    why = sm90_compile_available()
    if why:
        pytest.skip(why)
    kw = dict(unit_major=True, bits=bits, lanes=True, pscan=True, vpair=True)
    k = lam.compile_for_sm90(g, g, 64, fold=True, merge=True, exact_bases=exact, **kw)
    base = lam.compile_for_sm90(g, g, 64, **kw)
    ptx, base_ptx = k.asm["ptx"], base.asm["ptx"]
    st, st0 = ptxas_stats(ptx), ptxas_stats(base_ptx)
    assert (st["spill_store_bytes"] or 0) <= 32, st["ptxas"]  # (a few words in the prologue / merge at most)
    assert "atom.global.gpu.acq_rel.add" in ptx and "atom." not in base_ptx
    bf16_mma = ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
    # 8 a 32-channel step (4 n-tiles of 8, 2 k-steps), x2 for a hi / lo basis: the fold's 4 steps unrolled with bf16
    # bases (one loop body otherwise), and the projection's loop body
    assert bf16_mma == (4 * 8 + 8 if exact else 2 * 8 + 2 * 8)
    if st["registers"] is not None and st0["registers"] is not None:
        assert st["registers"] <= max(st0["registers"], 128) + 4 * (st0["registers"] > 128)
    if not st["sass"]:
        pytest.skip("no cuobjdump bundled with this Triton")
    loop = tile_loop(st["sass"])
    assert len(loop) <= 1.03 * len(tile_loop(st0["sass"]))
    assert not [t for t in loop if "LDL" in t or "STL" in t]  # no spill traffic in the tile loop


@pytest.mark.parametrize("hint,mark", [(1, "L1::evict_first"), (2, "ld.global.cg.")])
def test_load_hints_reach_the_latent_loads(hint, mark):
    """``HINT`` (``CKVP_MMA_HINT``) puts its cache modifier on the tile's latent loads (the 16-byte ones among them)
    and nowhere without it."""
    from ckvp_compile.testing.sm90 import sm90_compile_available

    why = sm90_compile_available()
    if why:
        pytest.skip(why)
    kw = dict(unit_major=True, bits=8, lanes=True, pscan=True, vpair=True)
    ptx = lam.compile_for_sm90(4, 4, 64, hint=hint, **kw).asm["ptx"]
    base = lam.compile_for_sm90(4, 4, 64, hint=0, **kw).asm["ptx"]
    assert any(mark in line and ".v4." in line for line in ptx.splitlines()) and mark not in base


def test_load_hint_reads_only_known_values(monkeypatch):
    for v, want in (("1", 1), ("2", 2), ("0", 0), ("3", 0), ("x", 0)):
        monkeypatch.setenv("CKVP_MMA_HINT", v)
        assert lam.load_hint() == want
    monkeypatch.delenv("CKVP_MMA_HINT")
    assert lam.load_hint() == lam.LOAD_HINT_GPU_CHECKED == 1  # evict_first since the H100 runs


@pytest.mark.parametrize("page", [64, 0])
def test_first_tile_prefetched_before_the_query(page):
    """``EARLY`` (``CKVP_MMA_EARLY``): the split's first tile goes into L2 before the programmatic wait for the
    fold and the folded query's loads: in 64-slot pages two bulk prefetches (the program's share of the key and
    value pages), otherwise 4 per-lane prefetches; no other change to the tile loop, and no more registers."""
    from ckvp_compile.testing.sm90 import ptxas_stats, sm90_compile_available, tile_loop

    why = sm90_compile_available()
    if why:
        pytest.skip(why)
    kw = dict(unit_major=True, bits=8, lanes=True, pscan=True, vpair=True, pdl=True, hint=1)
    ptx = lam.compile_for_sm90(4, 4, page, early=True, **kw).asm["ptx"]
    base = lam.compile_for_sm90(4, 4, page, early=False, **kw).asm["ptx"]
    mark = "cp.async.bulk.prefetch.L2.global" if page == 64 else "prefetch.global.L2 "
    lines = ptx.splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    at = [i for i, line in enumerate(lines) if mark in line]
    assert len(at) == (2 if page == 64 else 4) and max(at) < wait, (at, wait)
    assert mark not in base and "prefetch" not in base
    st, st0 = ptxas_stats(ptx), ptxas_stats(base)
    if st["registers"] is not None and st0["registers"] is not None:
        assert st["registers"] <= max(st0["registers"], 128)
    if st["sass"] and st0["sass"]:
        assert len(tile_loop(st["sass"])) == len(tile_loop(st0["sass"]))


def test_first_tile_prefetch_needs_aligned_latents(monkeypatch):
    """The launcher asks for the bulk prefetch only where both latents start on 16-byte boundaries; the switch
    reads ``CKVP_MMA_EARLY``."""
    from ckvp_compile.kernels import latent_attention_triton as lat

    buf = torch.zeros(4096, dtype=torch.uint8)
    monkeypatch.setenv("CKVP_MMA_EARLY", "1")
    assert lam.early_tile() and lat._prefetches(lam, buf, buf) == dict(EARLY=True)
    assert lat._prefetches(lam, buf[4:], buf) == dict(EARLY=False)
    monkeypatch.setenv("CKVP_MMA_EARLY", "0")
    assert lat._prefetches(lam, buf, buf) == dict(EARLY=False)


# ---- the 8-bit key product on the integer tensor cores (IMMA)

ASMT4 = str(getattr(lam._T4_ASM, "value", lam._T4_ASM))


@settings(max_examples=25, deadline=None)
@given(w=st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=4))
@example(w=[0x03020100, 0x13121110, 0x23222120, 0x33323130])
def test_transpose_asm_gathers_byte_t_of_each_word(w):
    """``_T4_ASM`` on words (a, b, c, d): output word t is (byte t of a, of b, of c, of d), lowest first."""
    got = run_asm(ASMT4, w, 4, words=True)
    assert got == [sum(((w[k] >> 8 * t) & 0xFF) << 8 * k for k in range(4)) for t in range(4)]


def _np_imma_query(qf, g):
    """``_imma_query`` mirrored in numpy (fp32 as the kernel computes it): (the A fragments per k-step: a list of
    GROUPS tuples of 4 (8 r, 4 q) int arrays, the rounded query ``ci`` (8 rows, 32 coordinates) int, the unit)."""
    import numpy as np

    groups = 8 // g
    r, q, sk, i = np.meshgrid(range(8), range(4), range(2), range(4), indexing="ij")
    coord = 16 * sk + 8 * (i // 2) + 2 * q + i % 2
    cf = qf.numpy().astype(np.float32)[r % g, coord]
    amax = np.float32(np.abs(cf).max())
    unit = np.float32(amax * np.float32(1.0 / 32512.0)) if amax > 0 else np.float32(1.0)
    ci = np.clip(np.floor((cf / unit).astype(np.float32) + np.float32(0.5)), -32512, 32512).astype(np.int64)
    hi = (ci + 128) >> 8
    lo = ci - hi * 256
    assert hi.min() >= -128 and hi.max() <= 127 and lo.min() >= -128 and lo.max() <= 127
    whi = ((hi & 255) << (8 * i)).sum(-1)  # (8, 4, 2)
    wlo = ((lo & 255) << (8 * i)).sum(-1)
    rg = np.arange(8)[:, None] // g
    frags = [tuple(np.where(rg == grp, x, 0) for x in (whi[..., 0], wlo[..., 0], whi[..., 1], wlo[..., 1]))
             for grp in range(groups)]
    ci_rows = np.zeros((8, 32), np.int64)
    ci_rows[r, coord] = ci
    return frags, ci_rows, unit


def _s8(x):
    return x - 256 if x >= 128 else x


def _np_imma_scores(words, frags, g):
    """``_imma_scores`` mirrored: the kernel's splits, byte transpose (its asm, read by :func:`run_asm`) and
    reshapes from the key words (2 w, 4 q, 8 c, 4 b, 2 e), then each n-tile's ``mma.m16n8k32`` (s8 A, u8 B, s32
    accumulate over the k-steps) from the fragments by the PTX ISA's layouts (lane 4 gid + tig: A words 0..3 rows
    gid, gid + 8, gid, gid + 8 at k 4 tig + i, the same, 16 + ..; B words 0, 1 at k 4 tig + i, 16 + 4 tig + i of
    column gid; D (gid, 2 tig), (gid, 2 tig + 1), (gid + 8, ..)), then ``256 d0 + d2``: (8 rows, 8 NT) ints."""
    import numpy as np

    nt, groups = g, 8 // g
    x = words.reshape(2, 4, 8, 2, 2, 2)  # (w, q, c, s, h, e)
    wa, wc = x[..., 0][..., 0], x[..., 0][..., 1]
    wb, wd = x[..., 1][..., 0], x[..., 1][..., 1]
    flat = [a.reshape(-1) for a in (wa, wb, wc, wd)]
    res = np.array([run_asm(ASMT4, [int(f[n]) for f in flat], 4, words=True) for n in range(flat[0].size)])
    ts = [res[:, t].reshape(wa.shape) for t in range(4)]
    y = _np_join4(*ts).transpose(0, 4, 2, 1, 3).reshape(groups, nt, 8, 4, 2)  # (grp, j, c, q, s)
    b0, b1 = y[..., 0], y[..., 1]
    s = np.zeros((8, 8 * nt), np.int64)
    for j in range(nt):
        d = np.zeros((16, 8), np.int64)
        for grp in range(groups):
            a = np.zeros((16, 32), np.int64)
            bm = np.zeros((32, 8), np.int64)
            for gid in range(8):
                for tig in range(4):
                    aw = [int(f[gid, tig]) & 0xFFFFFFFF for f in frags[grp]]
                    for i in range(4):
                        byte = lambda w: (w >> (8 * i)) & 0xFF  # noqa: E731
                        a[gid, 4 * tig + i] = _s8(byte(aw[0]))
                        a[gid + 8, 4 * tig + i] = _s8(byte(aw[1]))
                        a[gid, 16 + 4 * tig + i] = _s8(byte(aw[2]))
                        a[gid + 8, 16 + 4 * tig + i] = _s8(byte(aw[3]))
                        bm[4 * tig + i, gid] = byte(int(b0[grp, j, gid, tig]))
                        bm[16 + 4 * tig + i, gid] = byte(int(b1[grp, j, gid, tig]))
            d += a @ bm
        s[:, 8 * j:8 * j + 8] = d[:8] * 256 + d[8:]
    return s


@pytest.mark.parametrize("g", [2, 4, 8])
def test_imma_operands_give_the_exact_integer_scores(g):
    """The IMMA key product, mirrored from the kernel's code (query fragments, word splits, the transpose asm,
    reshapes, the mma fragment layouts): each score (row r, column 8j + c) is exactly ``sum_k ci[r, k] code[slot,
    k]`` for slot ``8c + (r // G) NT + j`` (the fp16 path's slot), the query rounded to 16 bits."""
    import numpy as np

    nt = g
    rng = np.random.default_rng(20 + g)
    kc = rng.integers(0, 256, (64, 32))
    kw = _unit_columns8(kc)
    w, q, c, b, e = np.meshgrid(range(2), range(4), range(8), range(4), range(2), indexing="ij")
    words = kw[8 * b + 2 * q + e, 2 * c + w]
    qf = torch.randn(g, 32, generator=torch.Generator().manual_seed(g)) * 5
    frags, ci, unit = _np_imma_query(qf, g)
    got = _np_imma_scores(words, frags, g)
    row, col = np.meshgrid(range(8), range(8 * nt), indexing="ij")
    slot = 8 * (col % 8) + (row // g) * nt + col // 8
    want = (ci[row] * kc[slot]).sum(-1)
    assert np.array_equal(got, want)
    # the rounded query is the folded one to 16 bits of its largest coefficient
    qrow = qf.numpy()[np.arange(8) % g]
    assert np.abs(ci * float(unit) - qrow).max() <= float(unit) * 0.5001


def test_imma_asm_is_one_mma_per_k_step_chained():
    """``_imma_asm``: GROUPS ``mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32``, the first from zero, each later
    one accumulating onto $0..$3; operands A = $(4 + 6g) .. +3, B = the next two."""
    for groups in (1, 2, 4):
        text = lam._imma_asm(groups)
        mmas = re.findall(r"mma\.sync\.aligned\.m16n8k32\.row\.col\.s32\.s8\.u8\.s32 ([^;]*);", text)
        assert len(mmas) == groups
        for grp, m in enumerate(mmas):
            a = 4 + 6 * grp
            want = (f"{{$0, $1, $2, $3}}, {{${a}, ${a + 1}, ${a + 2}, ${a + 3}}}, {{${a + 4}, ${a + 5}}}, "
                    + ("{z, z, z, z}" if grp == 0 else "{$0, $1, $2, $3}"))
            assert m == want
    assert str(getattr(lam._IMMA_CONSTRAINTS4, "value", lam._IMMA_CONSTRAINTS4)).count("r") == 28


def _imma_weights(krows, vrows, off, head, qf):
    """IMMA's softmax weights for one (KV head, query token) over ``int8/32`` rows: scores ``unit * sum_k ci_k
    code_k`` (exact in int32, uncentred codes: :func:`test_imma_operands_give_the_exact_integer_scores`) times the
    slot's scale, plus its minimum times ``unit * sum(ci)``; returns (p (G, t) unnormalised, value scale (t,),
    value min (t,), the head's first code byte)."""
    import numpy as np

    g = qf.shape[0]
    f = parse_latent_format("int8/32")
    hkv = len(off) - 1
    cb = f.code_bytes(off)
    c0 = sum(cb[:head])
    k_sb, k_mb = sum(cb) // 2, sum(cb) // 2 + hkv
    ks, km, vs, vm = _fields(krows, vrows, head, k_sb, k_mb)
    _frags, ci, unit = _np_imma_query(qf, g)
    codes = krows[:, c0:c0 + 32].numpy().astype(np.int64)  # (t, 32) uncentred
    raw = torch.tensor((ci[:g] @ codes.T).astype(np.float32)) * float(unit)  # (G, t), rows 0..G-1 = heads
    sumc = torch.tensor(ci[:g].sum(-1).astype(np.float32)) * float(unit)
    s = raw * ks + km * sumc[:, None]
    return torch.exp2(s - s.amax(-1, keepdim=True)), vs, vm, c0


def _emulate8_imma(krows, vrows, off, head, qf):
    """The 8-bit arithmetic with IMMA's key product: scores ``unit * sum_k ci_k code_k`` (exact in int32, uncentred
    codes: :func:`test_imma_operands_give_the_exact_integer_scores`), times the slot's scale, plus its minimum times
    ``unit * sum(ci)``; the value side as the fp16 path. (G, 32) value latent in coordinate order."""
    p, vs, vm, c0 = _imma_weights(krows, vrows, off, head, qf)
    vcodes = vrows[:, c0:c0 + 32].float() - 128.0
    ve = 14 - math.floor(math.log2(float(vs.max())))
    w32 = p * (vs * 2.0 ** ve)
    w = w32.half().float() + (w32 - w32.half().float()).half().float()
    wv = (w @ vcodes) / 2.0 ** ve
    mins = (p * (vm + 128.0 * vs)).sum(-1, keepdim=True)
    return (wv + mins) / p.sum(-1, keepdim=True)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), hkv=st.integers(1, 3), g=st.sampled_from([2, 4, 8]),
       t=st.sampled_from([16, 32, 64]), q_scale=st.sampled_from([0.03, 0.3, 3.0]),
       v_size=st.sampled_from([1.0, 1e-3]))
def test_emulated_imma_arithmetic_matches_fp32_latent_attention(seed, hkv, g, t, q_scale, v_size):
    """IMMA's 16-bit query and exact integer scores stay within the pass's 1e-3 of the fp32 latent attention while
    the scores' spread is that of attention logits (q_scale 3 here: a standard deviation of about 35 log2 units, 24
    nats). (Its error grows with the spread, about 2^-17 of it: the fp16 hi + lo path keeps 22 bits.)"""
    krows, off = _rows(hkv, t, seed, fmt="int8/32")
    vrows, _ = _rows(hkv, t, seed + 1, v_size, fmt="int8/32")
    head = seed % hkv
    qf = torch.randn(g, 32, generator=torch.Generator().manual_seed(seed + 2)) * q_scale
    got = _emulate8_imma(krows, vrows, off, head, qf)
    want = _attention8(krows, vrows, off, head, qf)
    err = float((got - want).norm() / want.norm())
    assert err <= 1e-3, err


@pytest.mark.parametrize("g,page", [(4, 64), (2, 64), (8, 0)])
def test_imma_compiles_for_sm90_with_fewer_instructions(g, page):
    """``IMMA`` compiles for sm_90a without spills in the tile loop, issues integer mma (8 a tile) and no more than
    the fp16 path's registers, and shortens the unmasked tile loop, where cuobjdump is bundled."""
    from ckvp_compile.testing.sm90 import ptxas_stats, sm90_compile_available, tile_loop

    why = sm90_compile_available()
    if why:
        pytest.skip(why)
    k = lam.compile_for_sm90(g, g, page, unit_major=True, bits=8, imma=True)
    base = lam.compile_for_sm90(g, g, page, unit_major=True, bits=8, imma=False)
    ptx = k.asm["ptx"]
    assert "mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32" in ptx
    assert "m16n8k32" not in base.asm["ptx"]
    stats, old = ptxas_stats(ptx), ptxas_stats(base.asm["ptx"])
    assert stats["spill_store_bytes"] in (0, None) or stats["spill_store_bytes"] <= 8, stats["ptxas"]
    if stats["registers"] is not None and old["registers"] is not None:
        assert stats["registers"] <= old["registers"]
    if not stats["sass"]:
        pytest.skip("no cuobjdump bundled with this Triton")
    loop = tile_loop(stats["sass"])
    assert len(loop) < len(tile_loop(old["sass"]))
    assert sum(1 for line in loop if "IMMA" in line) == 8


# ---- the fp16 fields two slots a prmt (FPAIR)

FPAIR_ASM = "{ .reg .b32 t; prmt.b32 t, $2, $3, $4; mov.b32 {$0, $1}, t; }"


@pytest.mark.parametrize("g", [2, 4, 8])
def test_field_pairs_read_the_named_slots(g):
    """``_unit_field_pair``'s prmt (its own asm text) with its selector gives, for column tiles j and j + 1, the
    fp16 field of slots ``16q + 8e + grp NT + j`` and ``.. + 1``: the same values as two ``_unit_field`` calls
    (:func:`test_unit_major_operands_hold_the_named_codes` names them)."""
    import numpy as np

    assert FPAIR_ASM in lam._fp16_pair_of_bytes.src
    assert "t | ((4 + t) << 4) | ((t + 1) << 8) | ((5 + t) << 12)" in lam._unit_field_pair.src
    nt = g
    rng = np.random.default_rng(30 + g)
    f = rng.standard_normal(64).astype(np.float16)
    fb = f.view(np.uint8).reshape(64, 2).T.reshape(2, 16, 4).astype(np.uint32)
    fcol = fb[..., 0] | fb[..., 1] << 8 | fb[..., 2] << 16 | fb[..., 3] << 24  # (lo / hi, 16 words)
    nws = 2 if nt == 8 else 1
    r, q, e, wi, lh = np.meshgrid(range(8), range(4), range(2), range(nws), range(2), indexing="ij")
    fw = fcol[lh, 4 * q + 2 * e + (r // g) * nt // 4 + wi]
    rr = np.arange(8)[:, None, None] + np.zeros((8, 4, 2), int)
    for j in range(0, nt, 2):
        lo, hi = fw[..., 0], fw[..., 1]
        lo, hi = (lo[..., 0], hi[..., 0]) if nws == 1 else (lo[..., j // 4], hi[..., j // 4])
        t = ((rr // g) * nt + j) % 4
        assert np.all(t % 2 == 0)
        a, b = _asm_map(FPAIR_ASM, 2, lo, hi, t | ((4 + t) << 4) | ((t + 1) << 8) | ((5 + t) << 12))
        for jj, got in ((j, a), (j + 1, b)):
            qq, ee = np.meshgrid(range(4), range(2), indexing="ij")
            slot = 16 * qq[None] + 8 * ee[None] + (np.arange(8)[:, None, None] // g) * nt + jj
            assert np.array_equal(np.asarray(got, np.float16), f[slot])


@pytest.mark.parametrize("g,imma", [(4, False), (4, True), (8, True)])
def test_field_pairs_compile_for_sm90_with_fewer_instructions(g, imma):
    """``FPAIR`` compiles for sm_90a without spills, halves the fields' ``prmt`` in the PTX, and shortens the
    unmasked tile loop, where cuobjdump is bundled."""
    from ckvp_compile.testing.sm90 import ptxas_stats, sm90_compile_available, tile_loop

    why = sm90_compile_available()
    if why:
        pytest.skip(why)
    k = lam.compile_for_sm90(g, g, 64, unit_major=True, bits=8, imma=imma, fpair=True)
    base = lam.compile_for_sm90(g, g, 64, unit_major=True, bits=8, imma=imma, fpair=False)
    assert k.asm["ptx"].count("prmt.b32") < base.asm["ptx"].count("prmt.b32")
    stats, old = ptxas_stats(k.asm["ptx"]), ptxas_stats(base.asm["ptx"])
    assert stats["spill_store_bytes"] in (0, None) or stats["spill_store_bytes"] <= 8, stats["ptxas"]
    if not stats["sass"]:
        pytest.skip("no cuobjdump bundled with this Triton")
    assert len(tile_loop(stats["sass"])) < len(tile_loop(old["sass"]))


# ---- the value product on the integer tensor cores too (VIMMA)

PACKW = str(getattr(lam._PACK_W_ASM, "value", lam._PACK_W_ASM))


@settings(max_examples=25, deadline=None)
@given(w=st.lists(st.integers(0, 32512), min_size=4, max_size=4))
@example(w=[0, 32512, 127, 128])
def test_weight_pack_asm_splits_each_weight_into_s8_bytes(w):
    """``_PACK_W_ASM`` on weights w0..w3: byte i of output 0 (lo) and of output 1 (hi) read as s8 give ``w_i = 256
    hi + lo`` with hi in [0, 127] and lo in [-128, 127]."""
    lo, hi = run_asm(PACKW, w, 2, words=True)
    for i in range(4):
        b_lo, b_hi = _s8((lo >> 8 * i) & 0xFF), _s8((hi >> 8 * i) & 0xFF)
        assert 0 <= b_hi <= 127 and 256 * b_hi + b_lo == w[i]


def _np_vimma(pw, words, g):
    """``_vimma_step``'s value product mirrored: the weights (8 rows, 8 NT) fp32 (the scores' layout) rounded per row
    to 16 bits, split and packed by the kernel's asm, masked by slot group, the value words (4 d, 4 q, 8 n, 2 m,
    2 e) split into the B fragments as the kernel splits them, and ``mma.m16n8k32`` by the PTX ISA's fragment
    layouts: ((8, 32) ints ``256 d_hi + d_lo``, column j = coordinate j; the rounded weights (8, 8 NT))."""
    import numpy as np

    nt = g
    pw = pw.astype(np.float32)
    wmax = pw.max(1)
    inv = np.where(wmax > 0, np.float32(32512.0) / np.where(wmax > 0, wmax, 1).astype(np.float32), 0).astype(np.float32)
    wi = np.floor((pw * inv[:, None]).astype(np.float32) + np.float32(0.5)).astype(np.int64)
    x = wi.reshape(8, nt // 4, 2, 2, 4, 2).transpose(0, 4, 5, 1, 2, 3)  # (row, tig, e, jh, jl1, jl0)
    xa, xb = x[..., 0], x[..., 1]
    xs = [xa[..., 0], xb[..., 0], xa[..., 1], xb[..., 1]]  # jl = 0, 1, 2, 3
    flat = [a.reshape(-1) for a in xs]
    res = np.array([run_asm(PACKW, [int(f[k]) for f in flat], 2, words=True) for k in range(flat[0].size)])
    lo, hi = res[:, 0].reshape(xs[0].shape), res[:, 1].reshape(xs[0].shape)  # (row, tig, e, jh)
    y = words.reshape(2, 2, 4, 8, 2, 2).transpose(4, 5, 3, 2, 0, 1).reshape(4, 8, 4, 2, 2)  # (nt, n, q, dh, dl)
    bs = [(y[..., 0][..., 0], y[..., 0][..., 1]), (y[..., 1][..., 0], y[..., 1][..., 1])]  # ks: (b0, b1)
    rows = np.arange(8)[:, None, None]
    if nt == 4:
        parts = [(lo[..., 0], hi[..., 0], rows // g == ks) for ks in range(2)]
    else:
        parts = [(lo[..., ks], hi[..., ks], rows >= 0) for ks in range(2)]
    out = np.zeros((8, 32), np.int64)
    for t in range(4):  # value n-tile: coordinates 8t ..
        d = np.zeros((16, 8), np.int64)
        for ks, (lo_k, hi_k, on) in enumerate(parts):
            hm, lm = np.where(on, hi_k, 0), np.where(on, lo_k, 0)  # (row, tig, e), as the kernel masks them
            frag = [hm[..., 0], lm[..., 0], hm[..., 1], lm[..., 1]]
            a = np.zeros((16, 32), np.int64)
            bm = np.zeros((32, 8), np.int64)
            for gid in range(8):
                for tig in range(4):
                    for i in range(4):
                        byte = lambda w_: (int(w_) >> (8 * i)) & 0xFF  # noqa: E731
                        a[gid, 4 * tig + i] = _s8(byte(frag[0][gid, tig]))
                        a[gid + 8, 4 * tig + i] = _s8(byte(frag[1][gid, tig]))
                        a[gid, 16 + 4 * tig + i] = _s8(byte(frag[2][gid, tig]))
                        a[gid + 8, 16 + 4 * tig + i] = _s8(byte(frag[3][gid, tig]))
                        bm[4 * tig + i, gid] = byte(bs[ks][0][t, gid, tig])
                        bm[16 + 4 * tig + i, gid] = byte(bs[ks][1][t, gid, tig])
            d += a @ bm
        out[:, 8 * t:8 * t + 8] = d[:8] * 256 + d[8:]
    return out, wi


@pytest.mark.parametrize("g", [4, 8])
def test_vimma_operands_give_the_exact_integer_products(g):
    """The value product on the integer tensor cores, mirrored from the kernel's code: output (row r, coordinate j)
    is exactly ``sum_slots w[r, slot] code[slot, j]`` over row r's slots (slot ``16 tig + 8e + (r // G) NT + jj``
    of its weight column ``8 jj + 2 tig + e``), the weights rounded to 16 bits of the row's largest."""
    import numpy as np

    nt = g
    rng = np.random.default_rng(40 + g)
    vc = rng.integers(0, 256, (64, 32))
    vw = _unit_columns8(vc)
    dd, q, n, m, e = np.meshgrid(range(4), range(4), range(8), range(2), range(2), indexing="ij")
    words = vw[n + 16 * m + 8 * e, 4 * q + dd]
    pw = rng.random((8, 8 * nt)) ** 3 * rng.choice([1.0, 1e-3, 1e3], (8, 1))
    got, wi = _np_vimma(pw, words, g)
    row, col = np.meshgrid(range(8), range(8 * nt), indexing="ij")
    jj, tig, ee = col // 8, (col % 8) // 2, col % 2
    slot = 16 * tig + 8 * ee + (row // g) * nt + jj
    want = np.zeros((8, 32), np.int64)
    for r in range(8):
        want[r] = (wi[r][:, None] * vc[slot[r]]).sum(0)
    assert np.array_equal(got, want)
    assert wi.max() <= 32512 and wi.min() >= 0


def _emulate8_vimma(krows, vrows, off, head, qf):
    """The 8-bit arithmetic with both products on the integer tensor cores: IMMA's scores (as
    :func:`_emulate8_imma`), the weights ``p * vscale`` rounded to 16 bits of their largest (one tile: t slots),
    the uncentred value codes, the minima through ``sum(p * vmin)``. (G, 32) value latent."""
    import numpy as np

    p, vs, vm, c0 = _imma_weights(krows, vrows, off, head, qf)
    pw = (p * vs).numpy().astype(np.float32)
    wmax = pw.max(1, keepdims=True)
    wi = np.floor(pw * (np.float32(32512.0) / wmax) + np.float32(0.5))
    vcodes = vrows[:, c0:c0 + 32].numpy().astype(np.float64)
    o = torch.tensor((wi @ vcodes) * (wmax / 32512.0))
    return ((o + (p * vm).sum(-1, keepdim=True)) / p.sum(-1, keepdim=True)).float()


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), hkv=st.integers(1, 3), g=st.sampled_from([4, 8]),
       t=st.sampled_from([16, 32, 64]), q_scale=st.sampled_from([0.03, 0.3, 3.0]),
       v_size=st.sampled_from([1.0, 1e-3]))
def test_emulated_vimma_arithmetic_matches_fp32_latent_attention(seed, hkv, g, t, q_scale, v_size):
    """Both products on the integer tensor cores (16-bit query, 16-bit weights) within 1e-3 of the fp32 latent
    attention (score spreads of attention logits, as :func:`test_emulated_imma_arithmetic_matches_fp32_latent_attention`)."""
    krows, off = _rows(hkv, t, seed, fmt="int8/32")
    vrows, _ = _rows(hkv, t, seed + 1, v_size, fmt="int8/32")
    head = seed % hkv
    qf = torch.randn(g, 32, generator=torch.Generator().manual_seed(seed + 2)) * q_scale
    got = _emulate8_vimma(krows, vrows, off, head, qf)
    want = _attention8(krows, vrows, off, head, qf)
    err = float((got - want).norm() / want.norm())
    assert err <= 1e-3, err


@pytest.mark.parametrize("g", [4, 8])
def test_vimma_compiles_for_sm90_with_fewer_instructions(g):
    """``VIMMA`` compiles for sm_90a without spills, issues 16 integer mma a tile (keys and values) and no fp16 mma
    in the tile loop, and shortens it against IMMA alone, where cuobjdump is bundled."""
    from ckvp_compile.testing.sm90 import ptxas_stats, sm90_compile_available, tile_loop

    why = sm90_compile_available()
    if why:
        pytest.skip(why)
    k = lam.compile_for_sm90(g, g, 64, unit_major=True, bits=8, imma=True, fpair=True, vimma=True)
    base = lam.compile_for_sm90(g, g, 64, unit_major=True, bits=8, imma=True, fpair=True, vimma=False)
    stats, old = ptxas_stats(k.asm["ptx"]), ptxas_stats(base.asm["ptx"])
    assert stats["spill_store_bytes"] in (0, None), stats["ptxas"]
    if not stats["sass"]:
        pytest.skip("no cuobjdump bundled with this Triton")
    loop = tile_loop(stats["sass"])
    assert len(loop) < len(tile_loop(old["sass"]))
    assert sum(1 for line in loop if "IMMA" in line) == 16
    assert not any("HMMA" in line for line in loop)


def test_one_token_launch_with_register_cap_compiles_without_spills():
    """As a one-token decode launch specialises it (``S = n_exact = 1``), the G = 4 kernel with IMMA, FPAIR and
    VIMMA takes 128 registers on its own and fits a cap of 112 without spills (18 one-warp programs an SM instead
    of 16: the ``maxnreg_m`` the H200 sweep of benchmarks/results/2026-12-07-session50 times)."""
    from ckvp_compile.testing.sm90 import ptxas_stats, sm90_compile_available

    why = sm90_compile_available()
    if why:
        pytest.skip(why)
    kw = dict(unit_major=True, bits=8, pdl=True, imma=True, fpair=True, vimma=True, one_token=True)
    free = ptxas_stats(lam.compile_for_sm90(4, 4, 64, **kw).asm["ptx"])
    capped = ptxas_stats(lam.compile_for_sm90(4, 4, 64, maxnreg=112, **kw).asm["ptx"])
    if free["registers"] is None or capped["registers"] is None:
        pytest.skip("ptxas did not report registers")
    assert capped["registers"] <= 112 < free["registers"], (free["ptxas"], capped["ptxas"])
    assert capped["spill_store_bytes"] in (0, None), capped["ptxas"]
