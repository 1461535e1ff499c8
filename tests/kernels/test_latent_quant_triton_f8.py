"""Tests of the ``-f8`` latent formats (e4m3 block span and minimum) in the Triton quantize / dequantize / fused
append kernels (ckvp_compile/kernels/latent_quant_triton.py), on CPU under the Triton interpreter, against
``quantize_latent_ref`` / ``dequantize_latent_ref`` / ``latent_append_ref``.

As tests/kernels/test_latent_quant_triton.py: ``TRITON_INTERPRET=1`` must be set before Triton is imported, so the
checks run in a child process started with the variable set (this file executed as a script).

* e4m3 rounding: the kernels' ``_e4m3_byte`` (up and down) equals the reference's ``_e4m3_round`` byte for byte on
  every finite e4m3 value, its fp32 neighbours, points between neighbouring values, +-0, fp32 subnormals, the
  range edges (+-448 and beyond, inf, NaN), random values of magnitudes 1e-6 .. 1e4 and every fp32 sign, exponent
  and top 7 mantissa bits (262144 bit patterns, NaNs included); ``_e4m3_float`` decodes all 256 bytes as the
  reference (NaN for 0x7F / 0xFF).
* Property test (hypothesis, derandomized, tiny shapes): 1-3 rows of 1-2 leading dims; uniform ``int8`` / ``int4``
  / ``int2`` ``-f8`` formats with several blocks (non-powers of two included) and 1-3 heads of ranks 0-13, or
  ``mix/<8|16|24>-f8`` plans of 1-3 heads with 1-3 segments; values of one magnitude per case (1e-3 .. 100,
  within ``F8_MAX``), e4m3 grid values, quarter-integer grids (ties) and signed zeros (not canonicalised: ``-f8``
  stores zero as 0x00 either way), or constant heads (a span of 0 or of one e4m3 step). Checks: stored bytes equal
  the reference's; decoded fp32 equal bit for bit, from the reference's rows and from random rows (random code
  and metadata bytes, NaN bytes included: compared up to NaN payloads).
* Fused append (``latent_append_triton``) on -f8 int and mix formats, shared and per-sequence bases, contiguous
  and paged latents: with bases of signed powers of two, one per column (an exact projection in any summation
  order), the written rows equal the reference op's byte for byte; with a random basis, every decoded coordinate
  is within one code step of the reference's.
* Out of e4m3's range (spans above 448, minimums below -448; values a GPU does not check): the fused append stores
  the same span / min bytes as the reference computes past its host-only value check (NaN, 0x7F), those blocks
  decode to NaN (reference and Triton decoders) and every other block to the reference's values.
* Errors (values beyond ``F8_MAX`` on the host, NaN, a mix plan that does not match) and the CUDA
  ``ckvp::latent_append`` dispatch: an ``-f8`` format takes the reference quantizer while ``F8_GPU_CHECKED`` is
  False, and the Triton quantizer or the fused append (the reference's bytes) once it is set.
"""

from __future__ import annotations

import os

import pytest

INT_FORMATS = ("int8/32-f8", "int8/3-f8", "int8/8-f8", "int4/32-f8", "int4/6-f8", "int2/16-f8", "int2/4-f8")
MAGNITUDES = (1e-3, 1e-2, 1.0, 10.0, 100.0)


def _offsets(ranks):
    off = [0]
    for r in ranks:
        off.append(off[-1] + r)
    return off


def _same(a, b) -> bool:
    """Bit-equal fp32 tensors, NaN equal to NaN whatever its payload (x86 and CUDA propagate NaNs differently)."""
    import torch

    return a.shape == b.shape and bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())


def _check_e4m3_rounding() -> None:
    import torch
    import triton

    from ckvp_compile.kernels.latent_format import _e4m3_round, _e4m3_value

    g = torch.Generator().manual_seed(0)
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)]
    near = lambda t, d: torch.nextafter(t, torch.full_like(t, d))  # noqa: E731
    srt = grid.unique()
    special = [0.0, -0.0, 448.0, -448.0, 449.0, -449.0, 464.0, 480.0, 512.0, -513.0, 1e6, 1e30, -1e30, 3e38,
               float("inf"), -float("inf"), float("nan"), 2.0**-126, -2.0**-126, 2.0**-149, -2.0**-149, 2.0**-10]
    xs = torch.cat([grid, near(grid, float("inf")), near(grid, -float("inf")), (srt[1:] + srt[:-1]) / 2,
                    (srt[1:] * 0.25 + srt[:-1] * 0.75), torch.tensor(special),
                    torch.randn(3000, generator=g) * torch.logspace(-6, 4, 3000),
                    # every sign, exponent and top 7 mantissa bits, with low halves 0, 1, 0x8000 and 0xFFFF
                    ((torch.arange(1 << 16, dtype=torch.int32)[:, None] << 16) | torch.tensor([0, 1, 0x8000, 0xFFFF]))
                    .flatten().view(torch.float32)])
    n = xs.numel()
    up, down = (torch.empty(n, dtype=torch.int32) for _ in range(2))
    val = torch.empty(n)
    _e4m3_kernel[(triton.cdiv(n, 1 << 15),)](xs, up, down, val, n, BP=1 << 15)
    for got, want in ((up, _e4m3_round(xs, up=True)), (down, _e4m3_round(xs, up=False))):
        bad = got != want.int()
        assert not bool(bad.any()), (xs[bad][:8].tolist(), got[bad][:8].tolist(), want[bad][:8].tolist())
    ref = _e4m3_value(torch.arange(256, dtype=torch.int32).to(torch.uint8)).repeat(n // 256 + 1)[:n]
    assert _same(val, ref)


def _check_case(z, off, fmt):
    import torch

    from ckvp_compile.kernels.latent_format import dequantize_latent_ref, quantize_latent_ref
    from ckvp_compile.kernels.latent_quant_triton import dequantize_latent_triton, quantize_latent_triton

    a = quantize_latent_ref(z, off, fmt)
    b = quantize_latent_triton(z, off, fmt)
    assert a.shape == b.shape and a.dtype == b.dtype == torch.uint8
    assert torch.equal(a, b), (fmt, off, (a != b).nonzero()[:8].tolist())
    da, db = dequantize_latent_ref(a, off, fmt), dequantize_latent_triton(a, off, fmt)
    assert da.dtype == db.dtype == torch.float32 and da.shape == db.shape == z.shape
    assert torch.equal(da.view(torch.int32), db.view(torch.int32)), fmt


def _mix_plans(st):
    @st.composite
    def plan(draw):
        block = draw(st.sampled_from([8, 16, 24]))
        heads = draw(st.lists(st.lists(st.tuples(st.sampled_from([8, 4, 2]), st.integers(1, 12)), min_size=1,
                                       max_size=3), min_size=1, max_size=3))
        return (f"mix/{block}-f8:" + ",".join("+".join(f"{b}x{c}" for b, c in h) for h in heads),
                [sum(c for _, c in h) for h in heads])
    return plan()


def _check_property(n_examples: int) -> None:
    import torch
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ckvp_compile.kernels.latent_format import F8_MAX, dequantize_latent_ref, parse_latent_format
    from ckvp_compile.kernels.latent_quant_triton import dequantize_latent_triton

    e4m3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = [v for v in e4m3.tolist() if abs(v) <= F8_MAX]  # NaN dropped by the comparison

    @st.composite
    def case(draw):
        fmt, ranks = draw(st.one_of(st.tuples(st.sampled_from(INT_FORMATS),
                                              st.lists(st.integers(0, 13), min_size=1, max_size=3)), _mix_plans(st)))
        lead = draw(st.sampled_from([(1,), (2,), (3,), (2, 1), (1, 2)]))
        mag = draw(st.sampled_from(MAGNITUDES))
        grid = [v for v in e4m3 if abs(v) <= mag]  # e4m3 values (a span or min needing no rounding); +-0
        value = st.one_of(st.floats(-1, 1, width=32).map(lambda v: v * mag), st.sampled_from(grid),
                          st.sampled_from([0.0, -0.0]),
                          st.integers(-8, 8).map(lambda k: k * mag / 8))
        n = int(torch.tensor(lead).prod()) * sum(ranks)
        const = draw(st.booleans())  # every head one value (a span of 0, or of one e4m3 step)
        vals = draw(st.lists(value, min_size=len(ranks) if const else n, max_size=len(ranks) if const else n))
        return fmt, ranks, lead, vals, const, draw(st.integers(0, 2**16))

    @settings(max_examples=n_examples, deadline=None, derandomize=True, database=None)
    @given(case())
    def prop(c):
        fmt, ranks, lead, vals, const, seed = c
        off = _offsets(ranks)
        if const:
            z = torch.tensor([v for v, r in zip(vals, ranks) for _ in range(r)], dtype=torch.float32)
            z = z.expand(*lead, off[-1]).contiguous()
        else:
            z = torch.tensor(vals, dtype=torch.float32).reshape(*lead, off[-1])
        _check_case(z, off, fmt)
        # arbitrary rows: random code and e4m3 bytes (0x7F / 0xFF NaNs included)
        g = torch.Generator().manual_seed(seed)
        rows = torch.randint(0, 256, (*lead, parse_latent_format(fmt).row_width(off)), generator=g,
                             dtype=torch.uint8)
        assert _same(dequantize_latent_ref(rows, off, fmt), dequantize_latent_triton(rows, off, fmt)), fmt

    prop()


def _check_fixed() -> None:
    import torch

    from ckvp_compile.kernels.latent_format import parse_latent_format
    from ckvp_compile.kernels.latent_quant_triton import quantize_latent_triton, unsupported_reason

    g = torch.Generator().manual_seed(0)
    off, mix_off, mix = [0, 5, 5, 40, 47], [0, 5, 40, 47], "mix/8-f8:8x3+2x2,4x20+8x15,2x7"
    for fmt in ("int8/32-f8", "int4/6-f8", mix):  # (every int format: the property test)
        o = mix_off if fmt == mix else off
        assert unsupported_reason(fmt, torch.device("cpu")) is None
        assert parse_latent_format(fmt).meta_bytes == 2
        # a row per magnitude; range edges; constant rows: e4m3 values or not, below e4m3's least subnormal, zero
        z = torch.cat((torch.randn(len(MAGNITUDES), 47, generator=g) * torch.tensor(MAGNITUDES)[:, None],
                       torch.tensor([[192.0], [-192.0], [191.9], [-0.37], [2.0**-12], [0.0]]).expand(6, 47)))
        _check_case(z.clamp(-192, 192).reshape(1, 11, 47), o, fmt)
        _check_case(torch.zeros(0, 47), o, fmt)  # no rows
        _check_case((torch.randn(2, 47, generator=g) * 3).half(), o, fmt)  # fp16 input
    _check_case(torch.randn(2, 0), [0, 0, 0], "int4-f8")  # no blocks
    # errors: the host check of the reference (F8_MAX), a plan that does not match the offsets
    for bad in (192.5, -200.0, float("nan"), float("inf")):
        with _raises(ValueError, "at most 192"):
            quantize_latent_triton(torch.tensor([[bad, 0.0]]), [0, 2], "int8-f8")
    with _raises(ValueError, "coordinates per head"):
        quantize_latent_triton(torch.zeros(1, 47), mix_off, "mix/8-f8:8x3,4x20,2x7")


class _raises:
    def __init__(self, exc, text):
        self.exc, self.text = exc, text

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        assert et is not None and issubclass(et, self.exc) and self.text in str(ev), (et, ev)
        return True


def _exact_basis(g, lead, hkv, gd, ranks):
    """(*lead, Hkv, G*D, R_max) fp32: each real column one signed power of two (1/2, 1, 2) at a random row, zero
    elsewhere: the projection is exact in fp32 whatever the summation order."""
    import torch

    basis = torch.zeros(*lead, hkv, gd, max(ranks))
    for h, r in enumerate(ranks):
        rows = torch.randint(0, gd, (*lead, 1, r), generator=g)
        val = 2.0 ** torch.randint(-1, 2, (*lead, 1, r), generator=g) * (torch.randint(0, 2, (*lead, 1, r),
                                                                                      generator=g) * 2 - 1)
        basis[..., h, :, :r].scatter_(-2, rows, val.float())
    return basis


def _check_fused_append(n_examples: int) -> None:
    import torch
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ckvp_compile.kernels import reference as ref
    from ckvp_compile.kernels.latent_format import parse_latent_format
    from ckvp_compile.kernels.latent_quant_triton import latent_append_triton

    @st.composite
    def cases(draw):
        fmt, ranks = draw(st.one_of(st.tuples(st.sampled_from(INT_FORMATS),
                                              st.lists(st.integers(0, 13), min_size=1, max_size=3)
                                              .filter(lambda r: sum(r) > 0)), _mix_plans(st)))
        return dict(seed=draw(st.integers(0, 2**16)), b=draw(st.integers(1, 2)), ranks=ranks, fmt=fmt,
                    s=draw(st.integers(1, 3)), gd=draw(st.sampled_from((8, 24))), mag=draw(st.sampled_from(MAGNITUDES)),
                    online=draw(st.booleans()), page=draw(st.sampled_from((0, 4))))

    @settings(max_examples=n_examples, deadline=None, derandomize=True, database=None)
    @given(cases())
    def prop(p):
        g = torch.Generator().manual_seed(p["seed"])
        b, s, gd, ranks = p["b"], p["s"], p["gd"], p["ranks"]
        hkv, off, s_max = len(ranks), _offsets(ranks), 8
        basis = _exact_basis(g, (b,) if p["online"] else (), hkv, gd, ranks)
        x = (torch.randn(b, hkv, s, gd, generator=g) * p["mag"]).clamp(-90, 90)  # |z| <= 180 <= F8_MAX
        slots = torch.randperm(s_max, generator=g)[:s]
        width = parse_latent_format(p["fmt"]).row_width(off)
        table = None
        if p["page"]:
            table = torch.randperm(b * s_max // p["page"], generator=g).reshape(b, -1).int()
            got = torch.full((b * s_max // p["page"] + 1, p["page"], width), 7, dtype=torch.uint8)
        else:
            got = torch.full((b, s_max, width), 7, dtype=torch.uint8)
        want = got.clone()
        latent_append_triton(got, x, basis, off, slots, p["fmt"], table)
        ref.latent_append_ref(want, x, basis, off, slots, p["fmt"], table)
        assert torch.equal(got, want), p

    prop()
    # a random basis: the fp32 projections differ in summation order, so a code may move by one step at a tie
    g = torch.Generator().manual_seed(3)
    off, fmt = [0, 13, 20], "mix/8-f8:8x5+4x8,2x7"
    basis = torch.randn(2, 24, 13, generator=g) / 5
    basis[1, :, 7:] = 0.0
    x = torch.randn(2, 2, 3, 24, generator=g) * 4
    got, want = (torch.zeros(2, 8, parse_latent_format(fmt).row_width(off), dtype=torch.uint8) for _ in range(2))
    latent_append_triton(got, x, basis, off, torch.tensor([4, 0, 7]), fmt)
    ref.latent_append_ref(want, x, basis, off, torch.tensor([4, 0, 7]), fmt)
    dg, dw = ref.unpack_latent_ref(got, off, 13, fmt), ref.unpack_latent_ref(want, off, 13, fmt)
    assert float((dg - dw).abs().max()) <= float(dw.abs().amax()) * 2 / 3 * 1.125  # one int2 step of e4m3 spans
    assert float((dg == dw).float().mean()) >= 0.9


def _check_out_of_range() -> None:
    """Values no host check stops (a GPU's): spans beyond 448 / mins below -448 store e4m3 NaN and decode to NaN."""
    import numpy
    import torch

    from ckvp_compile.kernels.latent_format import _quantize_pieces, dequantize_latent_ref, parse_latent_format
    from ckvp_compile.kernels.latent_quant_triton import dequantize_latent_triton, latent_append_triton

    g = torch.Generator().manual_seed(9)
    off = [0, 13, 20]
    eye = torch.zeros(2, 13, 13)
    eye[:, range(13), range(13)] = 1.0  # z = x exactly
    eye[1, :, 7:] = 0.0
    x = torch.randn(1, 2, 4, 13, generator=g) * 30
    x[0, 0, 0, :4] = torch.tensor([-300.0, 300.0, 1.0, 2.0])  # span 600
    x[0, 0, 1, 8:] = -460.0  # min below -448
    x[0, 1, 2, :] = 440.0  # constant 440: min 440, span 0, in range
    x[0, 1, 3, :3] = torch.tensor([-0.5, 447.0, 448.5])  # span beyond 448 by rounding
    for fmt in ("int8/4-f8", "int2/8-f8", "mix/8-f8:8x5+4x8,2x7"):
        f = parse_latent_format(fmt)
        got = torch.zeros(1, 4, f.row_width(off), dtype=torch.uint8)
        with numpy.errstate(invalid="ignore"):  # the interpreter casts the NaN blocks' quotients (codes unused)
            latent_append_triton(got, x, eye, off, torch.arange(4), fmt)
        z = torch.cat((x[0, 0], x[0, 1, :, :7]), -1)  # (S, R_tot), packed
        want = _quantize_pieces(z, off, f)  # the reference past its host-only value check (what a GPU computes)
        n_code = sum(f.code_bytes(off))
        assert torch.equal(got[0, :, n_code:], want[..., n_code:]), fmt  # span and min bytes, 0x7F NaNs included
        assert bool((want[..., n_code:] == 0x7F).any()) and not bool((want[..., n_code:] == 0x7F).all())
        d = dequantize_latent_ref(want, off, fmt)
        assert _same(dequantize_latent_ref(got[0], off, fmt), d)
        assert _same(dequantize_latent_triton(got[0], off, fmt), d)
        assert bool(d.isnan().any()) and bool(d[3].isnan().any()) and not bool(d[2].isnan().any())


def _check_latent_append_path() -> None:
    """The CUDA kernel function of ckvp::latent_append (on CPU tensors under the interpreter) for -f8 formats: the
    reference quantizer while F8_GPU_CHECKED is False; once set, the Triton quantizer (unfused) or the fused append,
    the reference op's bytes either way (exact bases)."""
    import torch

    from ckvp_compile.kernels import latent_quant_triton as lq
    from ckvp_compile.kernels import reference as ref
    from ckvp_compile.kernels.latent_format import parse_latent_format
    from ckvp_compile.ops import register_all

    register_all()
    from ckvp_compile.ops.latent_attention_cuda import latent_append_cuda

    g = torch.Generator().manual_seed(5)
    off, s_max = [0, 13, 20], 9
    basis = _exact_basis(g, (), 2, 24, [13, 7])
    x = torch.randn(2, 2, 3, 24, generator=g) * 5
    slots = torch.tensor([4, 0, 7])
    calls = []
    saved = (lq.quantize_latent_triton, lq.latent_append_triton, lq.F8_GPU_CHECKED, lq.APPEND_GPU_CHECKED)
    lq.quantize_latent_triton = lambda *a: calls.append(("quantize", a[2])) or saved[0](*a)
    lq.latent_append_triton = lambda *a: calls.append(("fused", a[5])) or saved[1](*a)
    try:
        for f8_checked, fused in ((False, True), (True, False), (True, True)):
            lq.F8_GPU_CHECKED, lq.APPEND_GPU_CHECKED = f8_checked, fused
            for fmt in ("int4/8-f8", "mix/8-f8:8x5+2x8,4x7"):
                width = parse_latent_format(fmt).row_width(off)
                got, want = (torch.zeros(2, s_max, width, dtype=torch.uint8) for _ in range(2))
                latent_append_cuda(got, x, basis, off, slots, fmt)
                ref.latent_append_ref(want, x, basis, off, slots, fmt)
                assert torch.equal(got, want), (fmt, f8_checked, fused)
    finally:
        lq.quantize_latent_triton, lq.latent_append_triton, lq.F8_GPU_CHECKED, lq.APPEND_GPU_CHECKED = saved
    assert calls == [("quantize", "int4/8-f8"), ("quantize", "mix/8-f8:8x5+2x8,4x7"),
                     ("fused", "int4/8-f8"), ("fused", "mix/8-f8:8x5+2x8,4x7")], calls


def _main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _check_e4m3_rounding()
    _check_fixed()
    n = int(os.environ.get("CKVP_LATENT_QUANT_EXAMPLES", "30"))
    _check_property(n)
    _check_fused_append(max(8, n // 3))
    _check_out_of_range()
    _check_latent_append_path()
    print("ok", n)


def test_kernels_match_reference_under_interpreter():
    pytest.importorskip("triton")
    pytest.importorskip("hypothesis")
    from ckvp_compile.testing.interpreter import run_under_triton_interpreter

    proc = run_under_triton_interpreter(__file__, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("ok")


def test_f8_gate_without_interpreter():
    """-f8 formats are the kernels' formats (int and mix families), but the CUDA append quantizes them with the
    reference until F8_GPU_CHECKED is set; the fp16-metadata formats are unaffected."""
    pytest.importorskip("triton")
    import torch

    from ckvp_compile.kernels import latent_quant_triton as lq

    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        pytest.skip("needs a CPU-only process without the interpreter")
    cuda = torch.device("cuda")
    assert [lq.format_family(f) for f in ("int4/32-f8", "mix/8-f8:8x8")] == ["int", "mix"]
    assert lq.unsupported_reason("int4/32-f8", cuda) is None and lq.unsupported_reason("mix/8-f8:8x8", cuda) is None
    assert lq.use_triton("int4/32-f8", cuda) == lq.use_triton("mix/8-f8:8x8", cuda) == lq.F8_GPU_CHECKED
    assert lq.use_triton("int4/32", cuda) and lq.use_triton("mix/8:8x8", cuda)
    with pytest.raises(NotImplementedError, match="NYI"):
        lq.quantize_latent_triton(torch.zeros(1, 8), [0, 8], "int4/8-f8")


if __name__ == "__main__":
    import triton
    import triton.language as tl

    from ckvp_compile.kernels import latent_quant_triton as lq

    @triton.jit
    def _e4m3_kernel(x_ptr, up_ptr, down_ptr, val_ptr, n, BP: tl.constexpr):
        """The kernels' e4m3 helpers on (n,) fp32 x: bytes rounded up and down (int32), and the value of byte i % 256
        (a module-level kernel: the interpreter resolves a kernel's names in its module, not in a closure)."""
        i = tl.program_id(0) * BP + tl.arange(0, BP)
        ok = i < n
        x = tl.load(x_ptr + i, mask=ok, other=0.0)
        tl.store(up_ptr + i, lq._e4m3_byte(x, True), mask=ok)
        tl.store(down_ptr + i, lq._e4m3_byte(x, False), mask=ok)
        tl.store(val_ptr + i, lq._e4m3_float(i & 0xFF), mask=ok)

    _main()
