"""Tests of the ternary and mix Triton quantize / dequantize kernels (ckvp_compile/kernels/latent_quant_triton.py)
on CPU, under the Triton interpreter, against ``quantize_latent_ref`` / ``dequantize_latent_ref``.

As tests/kernels/test_latent_quant_triton.py: ``TRITON_INTERPRET=1`` must be set before Triton is imported, so the
checks run in a child process started with the variable set (this file executed as a script).

Property test (hypothesis, derandomized, tiny shapes): 1-3 rows of 1-2 leading dims; ``tern`` with blocks 1, 3, 5,
8, 32 (bytes holding codes of two blocks when 5 does not divide the block) and 1-3 heads of ranks 0-13; ``mix``
plans of 1-3 heads with 1-3 segments each (bits 8 / 4 / 2, counts 1-12, blocks 8, 16, 24: ragged blocks per
segment, a non-power-of-two block). Values as the int tests: wide fp32 draws up to fp16's range, subnormal-sized
draws, quarter-integer grids (ties and constant blocks) and fp16 grid values, or (half the cases) all values on
the half-integer grid -2..2 (ternary ties y = +-0.5 in most blocks). Checks: stored bytes equal the reference's
byte for byte; the decoded fp32 equals the reference's bit for bit, from the kernel's
own rows and from random rows (random code bytes, bytes > 242 included, random finite fp16 scales / mins);
ternary: every code byte is a valid five-digit base-3 number (< 243), the digits past a head's rank are code 0,
and every decoded value is ``code * scale`` with ``code`` in {-1, 0, 1}. Mix inputs have ``-0.0`` canonicalised
(the documented signed-zero minimum, tested for the int kernels); ternary inputs keep it (no exception there).

Fixed cases: range edges, subnormal block maxima (scale rounds up to the least fp16 subnormal), a head of rank
700 (several pack tiles), fp16 input, mix plans that do not match the offsets, and the CUDA ``ckvp::latent_append``
kernel function: the reference quantizer for tern / mix until they are in ``GPU_CHECKED``, the same bytes as the
reference op once they are.

The reference's ternary dequantizer fails on a zero-rank head (``_bytes_fp16`` of an empty slice), so decoded
ternary values are compared with the reference run on the offsets without zero-rank heads (the same row layout);
its ternary quantizer fails on zero rows (``pack_ternary``'s reshape), so that case checks the kernels' shapes only.
"""

from __future__ import annotations

import os

import pytest

TERN_FORMATS = ("tern/1", "tern/3", "tern/5", "tern/8", "tern/32")


def _offsets(ranks):
    off = [0]
    for r in ranks:
        off.append(off[-1] + r)
    return off


def _ref_dequant_offsets(off):
    """``off`` without zero-rank heads (same row layout; see the module docstring)."""
    return [off[0]] + [b for a, b in zip(off, off[1:]) if b > a]


def _check_tern_codes(rows, dz, off, fmt) -> None:
    """Code bytes < 243, padding digits are code 0, decoded values are code * scale with code in {-1, 0, 1}."""
    import torch

    from ckvp_compile.kernels.latent_format import parse_latent_format, unpack_ternary

    f = parse_latent_format(fmt)
    n_code, nb = sum(f.code_bytes(off)), f.num_blocks(off)
    assert rows.shape[-1] == n_code + 2 * nb
    assert bool((rows[..., :n_code] < 243).all()), fmt
    if nb == 0:
        return
    scales = rows[..., n_code:].clone(memory_format=torch.contiguous_format).view(torch.float16).float()
    byte = 0
    for col, count, _, block0 in f.pieces(off):
        cb = -(-count // 5)
        digits = unpack_ternary(rows[..., byte:byte + cb], 5 * cb)
        assert bool((digits[..., count:] == 0).all()), fmt  # padding: code 0
        byte += cb
        nblk = -(-count // f.block)
        s = scales[..., block0:block0 + nblk].repeat_interleave(f.block, dim=-1)[..., :count]
        v = dz[..., col:col + count]
        assert bool(((v == 0) | (v == s) | (v == -s)).all()), fmt


def _check_case(z, off, fmt):
    import torch

    from ckvp_compile.kernels.latent_format import dequantize_latent_ref, parse_latent_format, quantize_latent_ref
    from ckvp_compile.kernels.latent_quant_triton import dequantize_latent_triton, quantize_latent_triton

    tern = parse_latent_format(fmt).ternary
    a = quantize_latent_ref(z, off, fmt)
    b = quantize_latent_triton(z, off, fmt)
    assert a.shape == b.shape and a.dtype == b.dtype == torch.uint8
    assert torch.equal(a, b), (fmt, off, (a != b).nonzero()[:8].tolist())
    da = dequantize_latent_ref(a, _ref_dequant_offsets(off) if tern else off, fmt)
    db = dequantize_latent_triton(a, off, fmt)
    assert da.dtype == db.dtype == torch.float32 and da.shape == db.shape == z.shape
    assert torch.equal(da.view(torch.int32), db.view(torch.int32)), fmt
    if tern:
        _check_tern_codes(b, db, off, fmt)


def _check_property(n_examples: int) -> None:
    import torch
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ckvp_compile.kernels.latent_format import dequantize_latent_ref, parse_latent_format
    from ckvp_compile.kernels.latent_quant_triton import dequantize_latent_triton

    value = st.one_of(
        st.floats(-65504, 65504, width=32, allow_nan=False),
        st.floats(-2.0**-20, 2.0**-20, width=32, allow_nan=False),  # fp16 subnormals and below
        st.integers(-64, 64).map(lambda k: k * 0.25),  # grids: half-step ties, constant blocks
        st.floats(-4, 4, width=16, allow_nan=False).map(float),  # exactly fp16 values
    )

    small_grid = st.integers(-4, 4).map(lambda k: k * 0.5)  # whole cases on it: ternary ties x = +-scale / 2

    @st.composite
    def tern_layout(draw):
        return draw(st.sampled_from(TERN_FORMATS)), draw(st.lists(st.integers(0, 13), min_size=1, max_size=3))

    @st.composite
    def mix_layout(draw):
        block = draw(st.sampled_from([8, 16, 24]))
        heads = draw(st.lists(st.lists(st.tuples(st.sampled_from([8, 4, 2]), st.integers(1, 12)), min_size=1,
                                       max_size=3), min_size=1, max_size=3))
        fmt = f"mix/{block}:" + ",".join("+".join(f"{b}x{c}" for b, c in h) for h in heads)
        return fmt, [sum(c for _, c in h) for h in heads]

    @st.composite
    def case(draw):
        fmt, ranks = draw(st.one_of(tern_layout(), mix_layout()))
        lead = draw(st.sampled_from([(1,), (2,), (3,), (2, 1), (1, 2)]))
        n = int(torch.tensor(lead).prod()) * sum(ranks)
        vals = draw(st.lists(draw(st.sampled_from([value, small_grid])), min_size=n, max_size=n))
        seed = draw(st.integers(0, 2**16))
        return fmt, ranks, lead, vals, seed

    @settings(max_examples=n_examples, deadline=None, derandomize=True, database=None)
    @given(case())
    def prop(c):
        fmt, ranks, lead, vals, seed = c
        f = parse_latent_format(fmt)
        off = _offsets(ranks)
        z = torch.tensor(vals, dtype=torch.float32).reshape(*lead, off[-1])
        _check_case(z if f.ternary else z + 0.0, off, fmt)  # mix: -0.0 -> +0.0
        # decoding arbitrary rows: random code bytes, random finite fp16 scales (and mins)
        g = torch.Generator().manual_seed(seed)
        width, nb = f.row_width(off), f.num_blocks(off)
        meta = 2 * nb if f.ternary else 4 * nb
        rows = torch.randint(0, 256, (*lead, width), generator=g, dtype=torch.uint8)
        sm = (torch.randn(*lead, meta // 2, generator=g) * 100).to(torch.float16)
        rows[..., width - meta:] = sm.view(torch.uint8)
        da = dequantize_latent_ref(rows, _ref_dequant_offsets(off) if f.ternary else off, fmt)
        db = dequantize_latent_triton(rows, off, fmt)
        assert torch.equal(da.view(torch.int32), db.view(torch.int32)), fmt

    prop()


def _check_fixed() -> None:
    import torch

    from ckvp_compile.kernels.latent_format import parse_latent_format
    from ckvp_compile.kernels.latent_quant_triton import (dequantize_latent_triton, quantize_latent_triton,
                                                          unsupported_reason)

    g = torch.Generator().manual_seed(0)
    off = [0, 5, 40, 47]
    mix = "mix/8:8x3+2x2,4x20+8x15,2x7"
    for fmt in TERN_FORMATS + ("tern/64", mix):
        assert unsupported_reason(fmt, torch.device("cpu")) is None
        _check_case(torch.randn(2, 3, 47, generator=g) * 3, off, fmt)  # leading dims
        _check_case(torch.tensor([[65504.0], [-65504.0]]).expand(2, 47).contiguous(), off, fmt)  # range edges (per row)
        _check_case(torch.full((2, 47), 2.0**-26), off, fmt)  # below fp16's least subnormal: scale steps up
        _check_case(torch.zeros(2, 47), off, fmt)  # scale 0
        if fmt == mix:
            _check_case(torch.zeros(0, 47), off, fmt)  # no rows
        else:  # the reference's pack_ternary cannot reshape zero rows (module docstring): shapes only
            rows = quantize_latent_triton(torch.zeros(0, 47), off, fmt)
            assert rows.shape == (0, parse_latent_format(fmt).row_width(off)) and rows.dtype == torch.uint8
            assert dequantize_latent_triton(rows, off, fmt).shape == (0, 47)
        _check_case((torch.randn(2, 47, generator=g) * 3).half(), off, fmt)  # fp16 input
    _check_case(torch.randn(2, 700, generator=g), [0, 700], "tern/32")  # 140 code bytes: three pack tiles
    _check_case(torch.randn(1, 333, generator=g), [0, 3, 333], "tern/7")
    z = torch.tensor([[1.0, 0.5, -0.5, 0.25, -1.0, 0.75, -0.75, 0.0, -0.0]])  # ties at +-0.5 -> 0
    _check_case(z, [0, 9], "tern/9")
    # errors
    with _raises(ValueError, "coordinates per head"):
        quantize_latent_triton(torch.zeros(1, 47), off, "mix/8:8x3,4x20,2x7")
    with _raises(ValueError, "rows must be uint8"):
        dequantize_latent_triton(torch.zeros(1, 3, dtype=torch.uint8), [0, 9], "tern/9")
    with _raises(ValueError, "finite"):
        quantize_latent_triton(torch.tensor([[float("nan"), 0.0]]), [0, 2], "tern")


class _raises:
    def __init__(self, exc, text):
        self.exc, self.text = exc, text

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        assert et is not None and issubclass(et, self.exc) and self.text in str(ev), (et, ev)
        return True


def _check_latent_append_path() -> None:
    """The CUDA kernel function of ckvp::latent_append (on CPU tensors under the interpreter): tern and mix take
    the reference quantizer when they are not in GPU_CHECKED, the Triton one (same bytes) when they are."""
    import torch

    from ckvp_compile.kernels import latent_quant_triton as lq
    from ckvp_compile.kernels import reference as ref
    from ckvp_compile.kernels.latent_format import parse_latent_format
    from ckvp_compile.ops import register_all

    register_all()
    from ckvp_compile.ops.latent_attention_cuda import latent_append_cuda

    g = torch.Generator().manual_seed(5)
    b, hkv, s, gd, s_max = 2, 2, 3, 24, 9
    off = [0, 13, 20]
    basis = torch.linalg.qr(torch.randn(hkv, gd, 13, generator=g)).Q
    basis[1, :, 7:] = 0.0
    x = torch.randn(b, hkv, s, gd, generator=g)
    slots = torch.tensor([4, 0, 7])
    calls = []
    real = lq.quantize_latent_triton
    lq.quantize_latent_triton = lambda *a: calls.append(a[2]) or real(*a)
    saved = lq.GPU_CHECKED
    saved_fused = lq.APPEND_GPU_CHECKED
    lq.APPEND_GPU_CHECKED = False  # the unfused path's quantizer dispatch (the fused append: test_latent_quant_triton)
    try:
        for checked in (frozenset({"int"}), frozenset({"int", "tern", "mix"})):
            lq.GPU_CHECKED = checked
            for fmt in ("tern/8", "tern", "mix/8:8x5+2x8,4x7"):
                width = parse_latent_format(fmt).row_width(off)
                got = torch.zeros(b, s_max, width, dtype=torch.uint8)
                want = torch.zeros(b, s_max, width, dtype=torch.uint8)
                n_calls = len(calls)
                latent_append_cuda(got, x, basis, off, slots, fmt)
                ref.latent_append_ref(want, x, basis, off, slots, fmt)
                assert len(calls) == n_calls + (lq.format_family(fmt) in checked), (fmt, checked)
                assert torch.equal(got, want), fmt
    finally:
        lq.quantize_latent_triton, lq.GPU_CHECKED, lq.APPEND_GPU_CHECKED = real, saved, saved_fused
    assert calls == ["tern/8", "tern", "mix/8:8x5+2x8,4x7"]


def _main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _check_fixed()
    n = int(os.environ.get("CKVP_LATENT_QUANT_EXAMPLES", "60"))
    _check_property(n)
    _check_latent_append_path()
    print("ok", n)


def test_kernels_match_reference_under_interpreter():
    pytest.importorskip("triton")
    pytest.importorskip("hypothesis")
    from ckvp_compile.testing.interpreter import run_under_triton_interpreter

    proc = run_under_triton_interpreter(__file__, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("ok")


def test_gate_without_interpreter():
    """On CPU (no interpreter) tern / mix are refused with NotImplementedError; the append path keeps them on the
    reference until the GPU check adds them to GPU_CHECKED; mxint and float are never these kernels' formats."""
    pytest.importorskip("triton")
    import torch

    from ckvp_compile.kernels import latent_quant_triton as lq

    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        pytest.skip("needs a CPU-only process without the interpreter")
    assert [lq.format_family(f) for f in ("float", "int4/8", "mxint8", "tern", "mix/8:8x8")] == \
        ["float", "int", "mxint", "tern", "mix"]
    assert lq.GPU_CHECKED == frozenset({"int", "tern", "mix"})  # all three passed benchmarks/latent_quant_gpu.py
    assert "device" in lq.unsupported_reason("tern", torch.device("cpu"))
    assert lq.unsupported_reason("tern/8", torch.device("cuda")) is None
    assert lq.unsupported_reason("mix/8:8x8", torch.device("cuda")) is None
    assert "mxint" in lq.unsupported_reason("mxint4", torch.device("cuda"))
    assert lq.use_triton("tern", torch.device("cuda")) and lq.use_triton("mix/8:8x8", torch.device("cuda"))
    with pytest.raises(NotImplementedError, match="NYI"):
        lq.quantize_latent_triton(torch.zeros(1, 8), [0, 8], "tern")
    with pytest.raises(NotImplementedError, match="NYI"):
        lq.dequantize_latent_triton(torch.zeros(1, 4, dtype=torch.uint8), [0, 8], "mix/8:8x8")


if __name__ == "__main__":
    _main()
