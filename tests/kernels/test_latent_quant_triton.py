"""Tests of the latent quantize / dequantize Triton kernels (ckvp_compile/kernels/latent_quant_triton.py) on CPU,
under the Triton interpreter, against ``quantize_latent_ref`` / ``dequantize_latent_ref``.

``TRITON_INTERPRET=1`` must be set before Triton is imported, so the kernel checks run in a child process started
with the variable set (this file executed as a script), as tests/kernels/test_latent_attention_triton.py does.

Property test (hypothesis, derandomized, tiny shapes): 1-3 rows of 1-2 leading dims, 1-3 heads with ranks 0-13
(zero-rank heads and ragged last blocks), uniform formats int8 / int4 / int2 with several block sizes (including a
non-power-of-two block), values mixing wide fp32 draws up to fp16's range, subnormal-sized draws, fp16 grid
values (constant blocks: scale 0) and quarter-integer grids (exact half-step ties: round-half-to-even). Checks:
stored bytes equal the reference's byte for byte; the decoded fp32 equals the reference's bit for bit, both from
the kernel's own rows and from random rows (random code bytes, random finite fp16 scales / mins).
Inputs have ``-0.0`` canonicalised to ``+0.0``; a fixed case checks a signed-zero block minimum up to the sign of
the stored zero (the one documented difference). Error cases: non-finite / out-of-range values, wrong formats,
wrong row widths; on CPU without the interpreter the kernels refuse with NotImplementedError.
"""

from __future__ import annotations

import os

import pytest

FORMATS = ("int8/32", "int8/3", "int8/8", "int4/32", "int4/6", "int4/2", "int2/8", "int2/4", "int2/16")


def _offsets(ranks):
    off = [0]
    for r in ranks:
        off.append(off[-1] + r)
    return off


def _check_case(z, off, fmt):
    import torch

    from ckvp_compile.kernels.latent_format import dequantize_latent_ref, quantize_latent_ref
    from ckvp_compile.kernels.latent_quant_triton import dequantize_latent_triton, quantize_latent_triton

    a = quantize_latent_ref(z, off, fmt)
    b = quantize_latent_triton(z, off, fmt)
    assert a.shape == b.shape and a.dtype == b.dtype == torch.uint8
    assert torch.equal(a, b), (fmt, off, (a != b).nonzero()[:8].tolist())
    da = dequantize_latent_ref(a, off, fmt)
    db = dequantize_latent_triton(a, off, fmt)
    assert da.dtype == db.dtype == torch.float32 and da.shape == db.shape == z.shape
    assert torch.equal(da.view(torch.int32), db.view(torch.int32)), fmt


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

    @st.composite
    def case(draw):
        fmt = draw(st.sampled_from(FORMATS))
        ranks = draw(st.lists(st.integers(0, 13), min_size=1, max_size=3))
        lead = draw(st.sampled_from([(1,), (2,), (3,), (2, 1), (1, 2)]))
        n = int(torch.tensor(lead).prod()) * sum(ranks)
        vals = draw(st.lists(value, min_size=n, max_size=n))
        seed = draw(st.integers(0, 2**16))
        return fmt, ranks, lead, vals, seed

    @settings(max_examples=n_examples, deadline=None, derandomize=True, database=None)
    @given(case())
    def prop(c):
        fmt, ranks, lead, vals, seed = c
        off = _offsets(ranks)
        z = torch.tensor(vals, dtype=torch.float32).reshape(*lead, off[-1]) + 0.0  # -0.0 -> +0.0
        _check_case(z, off, fmt)
        # decoding arbitrary rows: random code bytes, random finite fp16 scales and mins
        f = parse_latent_format(fmt)
        g = torch.Generator().manual_seed(seed)
        width, nb = f.row_width(off), f.num_blocks(off)
        rows = torch.randint(0, 256, (*lead, width), generator=g, dtype=torch.uint8)
        sm = (torch.randn(*lead, 2 * nb, generator=g) * 100).to(torch.float16)
        rows[..., width - 4 * nb:] = sm.view(torch.uint8)
        da, db = dequantize_latent_ref(rows, off, fmt), dequantize_latent_triton(rows, off, fmt)
        assert torch.equal(da.view(torch.int32), db.view(torch.int32)), fmt

    prop()


def _check_fixed() -> None:
    import torch

    from ckvp_compile.kernels.latent_format import quantize_latent_ref
    from ckvp_compile.kernels.latent_quant_triton import (dequantize_latent_triton, quantize_latent_triton,
                                                          unsupported_reason)

    g = torch.Generator().manual_seed(0)
    off = [0, 5, 5, 40, 47]
    for fmt in FORMATS:
        _check_case(torch.randn(2, 3, 47, generator=g) * 3, off, fmt)  # leading dims, zero-rank head
        _check_case(torch.tensor([[65504.0], [-65504.0]]).expand(2, 47).contiguous(), off, fmt)  # range edges (per row)
        _check_case(torch.zeros(0, 47), off, fmt)  # no rows
    _check_case(torch.randn(2, 0), [0, 0, 0], "int4")  # no blocks
    # signed-zero minimum: equal up to the stored zero's sign; codes, scales and values equal
    z = torch.tensor([[-0.0, 0.0, 1.0, 2.0, -0.0, 3.0]])
    for fmt in ("int8/8", "int4/4", "int2/4"):
        a, b = quantize_latent_ref(z, [0, 6], fmt), quantize_latent_triton(z, [0, 6], fmt)
        na = a.shape[-1]
        n_min = 2 * (-(-6 // int(fmt.split("/")[1])))
        assert torch.equal(a[..., :na - n_min], b[..., :na - n_min]), fmt
        ma, mb = (t[..., na - n_min:].clone(memory_format=torch.contiguous_format).view(torch.float16) for t in (a, b))
        assert torch.equal(ma.float(), mb.float()), fmt
        assert torch.equal(dequantize_latent_triton(a, [0, 6], fmt), dequantize_latent_triton(b, [0, 6], fmt))
    # errors
    for bad in (float("nan"), float("inf"), 70000.0):
        with _raises(ValueError, "finite"):
            quantize_latent_triton(torch.tensor([[bad, 0.0]]), [0, 2], "int8")
    for fmt in ("float", "mxint8"):  # tern and mix: tests/kernels/test_latent_quant_triton_tern_mix.py
        assert unsupported_reason(fmt, torch.device("cpu")) is not None
        with _raises(ValueError, "uniform"):
            quantize_latent_triton(torch.zeros(1, 2), [0, 2], fmt)
    with _raises(ValueError, "rows must be uint8"):
        dequantize_latent_triton(torch.zeros(1, 3, dtype=torch.uint8), [0, 2], "int8")
    with _raises(ValueError, "must be"):
        quantize_latent_triton(torch.zeros(1, 3), [0, 2], "int8")


class _raises:
    def __init__(self, exc, text):
        self.exc, self.text = exc, text

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        assert et is not None and issubclass(et, self.exc) and self.text in str(ev), (et, ev)
        return True


def _check_latent_append_path() -> None:
    """The CUDA kernel function of ckvp::latent_append (run here on CPU tensors under the interpreter) writes the
    same bytes as the reference op for uniform int formats, and the reference's for the others."""
    import torch

    from ckvp_compile.kernels import reference as ref
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
    from ckvp_compile.kernels import latent_quant_triton as lq

    saved = lq.APPEND_GPU_CHECKED
    lq.APPEND_GPU_CHECKED = False  # first the unfused path: reference projection, then the Triton quantizer
    for fmt in ("int8/8", "int4", "int2/8", "mxint8/8", "float"):
        from ckvp_compile.kernels.latent_format import parse_latent_format

        f = parse_latent_format(fmt)
        width = f.row_width(off)
        mk = (lambda: torch.zeros(b, s_max, width, dtype=torch.uint8)) if f.quantized else \
            (lambda: torch.zeros(b, s_max, off[-1]))
        got, want = mk(), mk()
        latent_append_cuda(got, x, basis, off, slots, fmt)
        ref.latent_append_ref(want, x, basis, off, slots, fmt)
        if f.quantized:
            # the Triton quantizer may store a zero minimum as -0.0 where the reference stores +0.0 (module doc)
            assert torch.equal(ref.unpack_latent_ref(got, off, 13, fmt), ref.unpack_latent_ref(want, off, 13, fmt)), fmt
            code_bytes = sum(f.code_bytes(off))
            assert torch.equal(got[..., :code_bytes], want[..., :code_bytes]), fmt  # the codes themselves
        else:
            assert torch.equal(got, want), fmt
    # the fused kernel behind the same op function (APPEND_GPU_CHECKED, the default since the H200 check)
    lq.APPEND_GPU_CHECKED = True
    calls = []
    real = lq.latent_append_triton
    lq.latent_append_triton = lambda *a: (calls.append(a[5]), real(*a))
    try:
        for fmt in ("int4/8", "mxint8/8"):
            width = parse_latent_format(fmt).row_width(off)
            got, want = (torch.zeros(b, s_max, width, dtype=torch.uint8) for _ in range(2))
            latent_append_cuda(got, x, basis, off, slots, fmt)
            ref.latent_append_ref(want, x, basis, off, slots, fmt)
            assert torch.equal(ref.unpack_latent_ref(got, off, 13, fmt), ref.unpack_latent_ref(want, off, 13, fmt))
    finally:
        lq.APPEND_GPU_CHECKED, lq.latent_append_triton = saved, real
    assert calls == ["int4/8"]  # mxint stays on the reference


def _check_fused_append(n_examples: int) -> None:
    """latent_append_triton (projection, quantization and store in one launch per bit width) against the reference
    op on random shapes: ranks 0-13 per head (ragged blocks, empty heads), G*D up to 136 (more than one chunk of
    the projection), shared and per-sequence (online) bases, contiguous and paged latents, row- and unit-major, int and mix formats.
    Every decoded coordinate is within one code step of the reference's (the fp32 projections differ in summation
    order), untouched rows stay untouched, and over all examples at least 99% of the coordinates decode
    bit-equal."""
    import torch
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ckvp_compile.kernels import reference as ref
    from ckvp_compile.kernels.latent_format import parse_latent_format
    from ckvp_compile.kernels.latent_layout import to_layout
    from ckvp_compile.kernels.latent_quant_triton import latent_append_triton

    stats = {"coords": 0, "equal": 0}

    @st.composite
    def cases(draw):
        hkv = draw(st.integers(1, 3))
        ranks = draw(st.lists(st.integers(0, 13), min_size=hkv, max_size=hkv).filter(lambda r: sum(r) > 0))
        fmt = draw(st.sampled_from(("int8/8", "int4/32", "int4/6", "int2/8", "mix")))
        if fmt == "mix":  # 8-bit then 4-bit coordinates of each head, blocks of 8
            fmt = "mix/8:" + ",".join(f"8x{r // 2}+4x{r - r // 2}" if r > 1 else f"4x{r}" for r in ranks)
        return dict(seed=draw(st.integers(0, 2**16)), b=draw(st.integers(1, 2)), hkv=hkv, ranks=ranks,
                    s=draw(st.integers(1, 3)), gd=draw(st.sampled_from((8, 24, 136))), fmt=fmt,
                    online=draw(st.booleans()), page=draw(st.sampled_from((0, 0, 4))),
                    layout=draw(st.sampled_from(("row-major", "unit-major"))))

    @settings(max_examples=n_examples, deadline=None, derandomize=True, database=None)
    @given(cases())
    def prop(p):
        g = torch.Generator().manual_seed(p["seed"])
        b, hkv, s, gd, ranks = p["b"], p["hkv"], p["s"], p["gd"], p["ranks"]
        off = _offsets(ranks)
        r_max = max(ranks)
        lead = (b,) if p["online"] else ()
        basis = torch.randn(*lead, hkv, gd, r_max, generator=g) / gd ** 0.5
        for h, r in enumerate(ranks):
            basis[..., h, :, r:] = 0.0
        x = torch.randn(b, hkv, s, gd, generator=g) * 3
        s_max = 8
        slots = torch.randperm(s_max, generator=g)[:s]
        slots = torch.stack((slots, slots), -1)[:, 0]  # a strided view (stride 2), as the op accepts
        f = parse_latent_format(p["fmt"])
        width = f.row_width(off)
        table = None
        if p["page"]:
            n_pages = b * s_max // p["page"]
            table = torch.randperm(n_pages, generator=g)[:b * s_max // p["page"]].reshape(b, -1).int()
            table[0, 0] = -1  # an unmapped page: its slots go to the trash page
            table = torch.stack((table, table), -1)[..., 0]  # strided columns
            got = torch.full((n_pages + 1, p["page"], width), 7, dtype=torch.uint8)
        else:
            got = torch.full((b, s_max, width), 7, dtype=torch.uint8)
        want = got.clone()
        got = to_layout(got, p["layout"])  # the kernel writes at the latent's strides (kernels.latent_layout)
        latent_append_triton(got, x, basis, off, slots, p["fmt"], table)
        ref.latent_append_ref(want, x, basis, off, slots, p["fmt"], table)
        flat = lambda t: t.reshape(-1, width)  # noqa: E731
        written = (flat(want) != 7).any(-1) | (flat(got) != 7).any(-1)
        assert torch.equal(flat(got)[~written], flat(want)[~written])  # nothing else touched
        dg = ref.unpack_latent_ref(flat(got)[written][None], off, r_max, p["fmt"])
        dw = ref.unpack_latent_ref(flat(want)[written][None], off, r_max, p["fmt"])
        step = dw.abs().amax().clamp_min(1e-6) * 2 / 3  # at most one int2 step of the largest block's range
        assert float((dg - dw).abs().max()) <= float(step), p
        stats["coords"] += dw.numel()
        stats["equal"] += int((dg == dw).sum())

    prop()
    assert stats["equal"] >= 0.99 * stats["coords"], stats
    print("fused append:", stats)


def _check_append_guards() -> None:
    """The fused append never writes where the reference would not: a slot outside the cache (contiguous: rows
    [0, S_max); paged: the page table's slots) is skipped, not written into another sequence's row or past the
    latent; a strided latent row is written at its strides; tensors it cannot load (a zero-stride latent, fp64 x)
    are refused by latent_append_triton and sent to the unfused path by the op's CUDA function, which then writes
    the reference's bytes."""
    import torch

    from ckvp_compile.kernels import latent_quant_triton as lq
    from ckvp_compile.kernels import reference as ref
    from ckvp_compile.kernels.latent_format import parse_latent_format
    from ckvp_compile.ops import register_all

    register_all()
    from ckvp_compile.ops.latent_attention_cuda import latent_append_cuda

    g = torch.Generator().manual_seed(11)
    b, hkv, gd, s_max, fmt = 2, 2, 16, 8, "int4/8"
    off = [0, 13, 20]
    width = parse_latent_format(fmt).row_width(off)
    basis = torch.randn(hkv, gd, 13, generator=g) / 4
    x = torch.randn(b, hkv, 2, gd, generator=g)
    # contiguous: slot s_max would be sequence 1's row 0 (and past the buffer for sequence 1); -1 the row before
    buf = torch.full((b + 1, s_max, width), 7, dtype=torch.uint8)  # a spare sequence after the latent
    lq.latent_append_triton(buf[:b], x, basis, off, torch.tensor([s_max, -1]), fmt)
    assert bool((buf == 7).all()), "an out-of-range slot was written"
    # paged: slot s_max of sequence 0 would read past its page-table row into sequence 1's pages
    page = 4
    table = torch.arange(b * s_max // page, dtype=torch.int32).reshape(b, -1)
    pool = torch.full((b * s_max // page + 1, page, width), 7, dtype=torch.uint8)
    lq.latent_append_triton(pool, x, basis, off, torch.tensor([s_max, 3]), fmt, table)
    want = torch.full_like(pool, 7)
    ref.latent_append_ref(want, x[:, :, 1:], basis, off, torch.tensor([3]), fmt, table)  # the valid token only
    assert torch.equal(pool, want), "the paged append wrote outside the valid slot's row"
    # a strided latent row: written by the kernel at its strides, the bytes between untouched; a latent with a
    # zero stride (an expanded view) is refused, for the unfused path of the op
    wide = torch.full((b, s_max, 2 * width), 7, dtype=torch.uint8)
    assert lq.append_fusable(wide[..., ::2], x, basis) == ""
    got = wide.clone()
    lq.latent_append_triton(got[..., ::2], x, basis, off, torch.tensor([1, 4]), fmt)
    exp = wide.clone()
    ref.latent_append_ref(exp[..., ::2], x, basis, off, torch.tensor([1, 4]), fmt)
    assert torch.equal(got[..., 1::2], wide[..., 1::2]), "bytes between the strided view's were written"
    d_got = ref.unpack_latent_ref(got[..., ::2].contiguous(), off, 13, fmt)
    d_exp = ref.unpack_latent_ref(exp[..., ::2].contiguous(), off, 13, fmt)
    assert float((d_got - d_exp).abs().max()) <= float(d_exp.abs().amax()) / 3  # at most one rounding step
    assert "positive strides" in lq.append_fusable(wide[:1, :, :width].expand(b, -1, -1), x, basis)
    assert "float64" in lq.append_fusable(wide[..., :width], x.double(), basis)
    try:
        lq.latent_append_triton(wide[:1, :, :width].expand(b, -1, -1), x, basis, off, torch.tensor([1, 4]), fmt)
        raise AssertionError("an expanded latent was accepted")
    except ValueError as e:
        assert "unfused" in str(e)
    saved = lq.APPEND_GPU_CHECKED
    lq.APPEND_GPU_CHECKED = True
    try:  # fp64 x: the op's unfused path, the reference's bytes
        got = wide.clone()
        latent_append_cuda(got[..., ::2], x.double(), basis, off, torch.tensor([1, 4]), fmt)
    finally:
        lq.APPEND_GPU_CHECKED = saved
    exp = wide.clone()
    ref.latent_append_ref(exp[..., ::2], x.double(), basis, off, torch.tensor([1, 4]), fmt)
    assert torch.equal(ref.unpack_latent_ref(got[..., ::2], off, 13, fmt), ref.unpack_latent_ref(exp[..., ::2], off, 13, fmt))
    assert torch.equal(got[..., 1::2], wide[..., 1::2]), "bytes between the strided view's were written"


def _main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _check_fixed()
    n = int(os.environ.get("CKVP_LATENT_QUANT_EXAMPLES", "60"))
    _check_property(n)
    _check_latent_append_path()
    _check_append_guards()
    _check_fused_append(max(8, n // 3))
    print("ok", n)


def test_kernels_match_reference_under_interpreter():
    pytest.importorskip("triton")
    pytest.importorskip("hypothesis")
    from ckvp_compile.testing.interpreter import run_under_triton_interpreter

    proc = run_under_triton_interpreter(__file__, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("ok")


def test_cpu_without_interpreter_is_refused_and_nothing_is_enabled():
    """On CPU (no interpreter) the kernels refuse with NotImplementedError; mxint formats are refused anywhere."""
    pytest.importorskip("triton")
    import torch

    from ckvp_compile.kernels import latent_quant_triton as lq

    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        pytest.skip("needs a CPU-only process without the interpreter")
    assert lq.USE_TRITON is True  # checked on the H200 (module docstring)
    assert "device" in lq.unsupported_reason("int8", torch.device("cpu"))
    assert "uniform" in lq.unsupported_reason("mxint8", torch.device("cuda"))  # power-of-two layout: not these kernels
    with pytest.raises(NotImplementedError, match="NYI"):
        lq.quantize_latent_triton(torch.zeros(1, 8), [0, 8], "int8")
    with pytest.raises(NotImplementedError, match="NYI"):
        lq.dequantize_latent_triton(torch.zeros(1, 12, dtype=torch.uint8), [0, 8], "int8")


if __name__ == "__main__":
    _main()


def test_fused_append_takes_only_gpu_checked_input_kinds(monkeypatch):
    """CUDA's ckvp::latent_append fuses only the input kinds a GPU run checked, each behind its own flag: paged
    pools, per-sequence bases and fp8 bases (all checked on the H200), unit-major latents (not yet), and the fused
    append as a whole."""
    pytest.importorskip("triton")
    import torch

    from ckvp_compile.kernels import latent_quant_triton as lq

    shared, online = torch.zeros(2, 16, 8, dtype=torch.bfloat16), torch.zeros(3, 2, 16, 8, dtype=torch.bfloat16)
    table = torch.zeros(3, 4, dtype=torch.int32)
    assert lq.append_gpu_checked(shared, None)
    assert lq.append_gpu_checked(online.to(torch.float8_e4m3fn), table)
    for flag, args in (("APPEND_PAGED_GPU_CHECKED", (shared, table)), ("APPEND_ONLINE_GPU_CHECKED", (online, None)),
                       ("APPEND_FP8_GPU_CHECKED", (shared.to(torch.float8_e5m2), None))):
        monkeypatch.setattr(lq, flag, False)
        assert not lq.append_gpu_checked(*args), flag
        assert lq.append_gpu_checked(shared, None), flag
        monkeypatch.setattr(lq, flag, True)
    # a unit-major latent (strided row units): not yet run on a GPU, so the unfused path until its flag is set
    from ckvp_compile.kernels.latent_layout import empty_latent

    unit, row = (empty_latent((2, 8), 12, lay, torch.uint8, "cpu") for lay in ("unit-major", "row-major"))
    assert lq.append_gpu_checked(shared, None, row)
    assert lq.append_gpu_checked(shared, None, unit) == lq.APPEND_STRIDED_GPU_CHECKED
    monkeypatch.setattr(lq, "APPEND_STRIDED_GPU_CHECKED", True)
    assert lq.append_gpu_checked(shared, table, unit)
    monkeypatch.setattr(lq, "APPEND_GPU_CHECKED", False)
    assert not lq.append_gpu_checked(shared, None)
