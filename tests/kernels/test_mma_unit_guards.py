"""Applicability guards and argument plumbing of the unit-major MMA kernel (``_mma_unit_kernel``), on CPU.

The Gluon kernel cannot run here, so these tests drive the real launcher (``latent_attention_triton._launch``) with
CPU tensors, only the device checks bypassed (``lam.mma_layout`` is handed a CUDA device of compute capability 9.0)
and the kernels replaced by recorders. Then:

* the launcher's ``_mma_layout`` refuses the unit-major kernel for latents it cannot address (slot slices of a
  unit-major cache, S_max / page sizes off 64, mixed layouts, misaligned data, masks, too many grid rows) and
  accepts the ones it can (batch slices, pages of 64 / 128 slots);
* the recorded launch arguments, put through the kernel's own address arithmetic (``_unit_base`` and the column
  offsets of ``_mma_unit_kernel``: 4-byte words, fp16 field units, COL bytes per column, PAGE // 64 tiles per page),
  read exactly the bytes the latent format names for every (sequence, slot, head): codes, scale and min; for
  ``int4/32`` and for ``int8/32`` (``BITS=8`` in the recorded arguments; the 8-bit key and value word offsets, one
  byte column a coordinate, inverted per slot and coordinate);
* ``layout_of`` never labels a tensor so that the unit-major kernel's addressing would differ from its strides.
"""

from __future__ import annotations

import pytest
import torch

lam = pytest.importorskip("ckvp_compile.kernels.latent_attention_mma")

from ckvp_compile.bench.attention import make_inputs  # noqa: E402
from ckvp_compile.kernels import latent_attention_triton as lat  # noqa: E402
from ckvp_compile.kernels.latent_format import parse_latent_format  # noqa: E402
from ckvp_compile.kernels.latent_layout import layout_of, to_layout  # noqa: E402

FMT = "int4/32"
FMT8 = "int8/32"


# ---- helpers -------------------------------------------------------------------------------------------------------

@pytest.fixture
def on_fake_gpu(monkeypatch):
    """The launcher's MMA choice as on an sm_90 device: the real ``mma_layout`` with q's CPU device swapped for a
    CUDA one (and CUDA reported available, capability 9.0). Nothing else is bypassed."""
    real = lam.mma_layout

    def fake(*a, **k):
        a = list(a)
        a[10] = torch.device("cuda", 0)
        return real(*a, **k)

    monkeypatch.setattr(lam, "mma_layout", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def _unit_from(x: torch.Tensor, pad_front: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (N, R, W) copied unit-major into a flat byte buffer (``pad_front`` bytes before it); (view, buffer)."""
    n, r, w = x.shape
    buf = torch.zeros(pad_front + n * r * w, dtype=torch.uint8)
    view = buf[pad_front:].view(n, w, r).transpose(1, 2)
    view.copy_(x)
    return view, buf


def _inputs(b=2, s_max=128, hkv=2, g=4, fmt=FMT):
    """make_inputs (table-free, latents of ``fmt``) with random bytes everywhere in the latents (scales included:
    any misread byte differs from the right one with high probability)."""
    args = list(make_inputs(b, s_max, fmt, 32, dev="cpu", heads=(g * hkv, hkv), rope="none"))
    gen = torch.Generator().manual_seed(1)
    for i in (1, 2):
        args[i] = torch.randint(0, 256, args[i].shape, dtype=torch.uint8, generator=gen)
    return args


def _launcher_layout(args, latent_k, latent_v, page_table=None, attn_mask=None, q=None, fmt=FMT):
    return lat._mma_layout(args[0] if q is None else q, latent_k, latent_v, args[3], args[4], args[5], args[6],
                           fmt, fmt, attn_mask, page_table, lat.DecodeConfig(mma=True))


class _Recorder:
    """Stands in for a kernel: ``k[grid](*args, **kw)`` records the call."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.calls.append((tuple(grid), args, kwargs))
        return call


@pytest.fixture
def recorded(monkeypatch, on_fake_gpu):
    """Run the real ``_launch`` on CPU tensors, every kernel it could reach replaced by a recorder."""
    saved = dict(lat._LAST_LAUNCH)
    rec = dict(unit=_Recorder(), row=_Recorder(), reduce=_Recorder(), fma=_Recorder())
    monkeypatch.setattr(lam, "_mma_unit_kernel", rec["unit"])
    monkeypatch.setattr(lam, "_mma_attention_kernel", rec["row"])
    monkeypatch.setattr(lat, "_latent_attention_reduce_kernel", rec["reduce"])
    monkeypatch.setattr(lat, "_merge_fma_kernel", rec["fma"])
    monkeypatch.setattr(lat, "_interpreting", lambda: False)
    monkeypatch.setattr(lat, "unsupported_reason", lambda *a, **k: None)
    monkeypatch.setattr(lat, "_fold_query", lambda q, *a, **k: torch.zeros(1))
    yield rec
    lat._LAST_LAUNCH.clear()
    lat._LAST_LAUNCH.update(saved)


def _launch(args, latent_k, latent_v, page_table=None, kv_len=None):
    a = list(args)
    a[1], a[2] = latent_k, latent_v
    if kv_len is not None:
        a[17] = kv_len
        a[14] = torch.tensor([kv_len - 1])  # the exact token's slot, inside the context as the op requires
    cfg = lat.default_config(a[0].shape[1] // a[3].shape[-3], 32, table_free=True, rank=32, rank_v=32,
                             quantized_keys=True, code_bits=parse_latent_format(a[18]).bits)
    assert cfg.mma
    return lat._launch("all", *a, config=cfg, page_table=page_table)


def _kernel_reads(call, which: str, b: int, s: int, h: int) -> dict:
    """The byte addresses (relative to the latent's data pointer) that ``_mma_unit_kernel`` reads for sequence b,
    slot s, KV head h, computed from the recorded arguments with the kernel's own arithmetic. Codes: at BITS 4
    the head's 16 code byte columns in order; at BITS 8 its 32, indexed by coordinate, found by inverting the
    kernel's word offsets (keys: word (w, q, c, b, e) at ``(col + 2q + 8b + e) CKW + 2c + w`` holds slots
    ``8c + 4w + t`` of coordinate ``8b + 2q + e``; values: word (d, q, n, m, e) at ``(col + n + 16m + 8e) CVW + 4q
    + d`` holds slots ``16q + 4d + t`` of coordinate ``n + 8(2m + e)``; byte t of a word is its slot t)."""
    _, a, kw = call
    meta = a[4] if which == "k" else a[5]
    scale_base, min_base = (a[18], a[19]) if which == "k" else (a[20], a[21])
    stride_b = a[22] if which == "k" else a[23]  # 4-byte words
    col = kw["COL_K"] if which == "k" else kw["COL_V"]  # bytes per column
    page, pt, stride_ptb = kw["PAGE"], a[9], a[10]
    t = s // 64  # tiles of 64 slots
    if page > 0:  # _unit_base: PAGE // 64 tiles per page, 16 words a tile
        idx = int(pt.reshape(-1)[b * stride_ptb + t // (page // 64)])
        w0 = (t % (page // 64)) * 16 + max(idx, 0) * stride_b
    else:
        w0 = b * stride_b + t * 16
    byte0 = 4 * w0 + s % 64
    first, blk = int(meta[h, 0]), int(meta[h, 1])
    if kw["BITS"] == 8:
        sl, cw = s % 64, col // 4  # slot in the tile; CKW / CVW (words a column)
        codes = []
        for k in range(32):
            if which == "k":
                c, w, t = sl // 8, (sl % 8) // 4, sl % 4
                bb, q, e = k // 8, (k % 8) // 2, k % 2
                word = (first + 2 * q + 8 * bb + e) * cw + 2 * c + w
            else:
                q, d, t = sl // 16, (sl % 16) // 4, sl % 4
                n, m, e = k % 8, k // 16, (k // 8) % 2
                word = (first + n + 16 * m + 8 * e) * cw + 4 * q + d
            codes.append(4 * (w0 + word) + t)
    else:
        codes = [byte0 + (first + i) * col for i in range(16)]
    return dict(codes=codes,
                scale=[byte0 + (2 * (scale_base + blk) + e) * col for e in (0, 1)],
                min=[byte0 + (2 * (min_base + blk) + e) * col for e in (0, 1)])


def _format_columns(offsets, h: int, fmt: str = FMT) -> dict:
    """Head h's byte columns in a row of ``fmt`` (latent_format's row layout, computed independently): 16 code
    bytes at int4 (two coordinates each), 32 at int8 (byte i = coordinate i)."""
    f = parse_latent_format(fmt)
    n_code, nb = sum(f.code_bytes(offsets)), f.num_blocks(offsets)
    c0 = sum(f.code_bytes(offsets)[:h])
    return dict(codes=list(range(c0, c0 + 32 * f.bits // 8)), scale=[n_code + 2 * h, n_code + 2 * h + 1],
                min=[n_code + 2 * (nb + h), n_code + 2 * (nb + h) + 1])


def _check_reads(call, which, latent, buf, offsets, logical, fmt=FMT):
    """Every (sequence, slot < kv_len, head): the kernel's bytes equal the logical row's bytes (``logical(b, s)``)
    of latents in ``fmt``."""
    base = latent.data_ptr() - buf.data_ptr()
    flat = buf
    grid, a, _ = call
    kv_len, hkv, n_seq = a[14], a[11], grid[2] // a[12]
    for b in range(n_seq):
        for s in range(kv_len):
            row = logical(b, s)
            if row is None:  # an unmapped page
                continue
            for h in range(hkv):
                got = _kernel_reads(call, which, b, s, h)
                want = _format_columns(offsets, h, fmt)
                for field in ("codes", "scale", "min"):
                    kb = [int(flat[base + x]) for x in got[field]]
                    assert kb == [int(row[c]) for c in want[field]], (which, field, b, s, h)


# ---- the launcher's guards ---------------------------------------------------------------------------------------

def test_unit_major_static_cache_is_taken_and_its_slices_are_not(on_fake_gpu):
    args = _inputs(b=3, s_max=128)
    uk, _ = _unit_from(args[1])
    uv, _ = _unit_from(args[2])
    assert layout_of(uk) == "unit-major"
    assert _launcher_layout(args, uk, uv)["UNIT"] is True
    # row-major latents: the row-major kernel
    assert _launcher_layout(args, args[1], args[2])["UNIT"] is False
    # a batch slice keeps every stride: still readable
    q2 = args[0][1:]
    assert _launcher_layout(args, uk[1:], uv[1:], q=q2)["UNIT"] is True
    # a slot slice of a unit-major cache: columns stay S_max apart, rows are not S_max long -> never the unit kernel
    assert _launcher_layout(args, uk[:, :64], uv[:, :64]) is None
    assert _launcher_layout(args, uk[:, 64:], uv[:, 64:]) is None
    # one latent unit-major, the other row-major (a "row-major/unit-major" store): neither MMA kernel
    assert _launcher_layout(args, args[1], uv) is None
    assert _launcher_layout(args, uk, args[2]) is None
    # key and value latents of unequal lengths
    uv_long, _ = _unit_from(torch.cat((args[2], args[2]), dim=1))
    assert _launcher_layout(args, uk, uv_long) is None
    # an attention mask
    mask = torch.ones(3, 1, 1, 128, dtype=torch.bool)
    assert _launcher_layout(args, uk, uv, attn_mask=mask) is None


@pytest.mark.parametrize("s_max", [96, 160, 32])
def test_unit_major_columns_off_64_slots_are_refused(on_fake_gpu, s_max):
    args = _inputs(b=2, s_max=s_max)
    uk, _ = _unit_from(args[1])
    uv, _ = _unit_from(args[2])
    assert layout_of(uk) == "unit-major" and _launcher_layout(args, uk, uv) is None


@pytest.mark.parametrize("pad", [1, 2, 4, 8])
def test_unit_major_data_off_16_bytes_is_refused(on_fake_gpu, pad):
    args = _inputs(b=2, s_max=128)
    uk, _ = _unit_from(args[1], pad_front=pad)
    uv, _ = _unit_from(args[2])
    assert layout_of(uk) == "unit-major" and uk.data_ptr() % 16 == pad % 16
    assert _launcher_layout(args, uk, uv) is None and _launcher_layout(args, uv, uk) is None
    uk16, _ = _unit_from(args[1], pad_front=16)
    assert _launcher_layout(args, uk16, uv)["UNIT"] is True


def test_unit_major_grid_rows_are_capped(on_fake_gpu):
    args = _inputs(b=2, s_max=128)
    uk, _ = _unit_from(args[1])
    uv, _ = _unit_from(args[2])
    q = args[0]
    # the grid's third dim is B * S (query tokens): 2 * 32768 = 65536 rows are one too many
    big = q[:, :, :1].expand(2, q.shape[1], 32768, q.shape[3])
    assert _launcher_layout(args, uk, uv, q=big) is None
    ok = q[:, :, :1].expand(2, q.shape[1], 32767, q.shape[3])
    assert _launcher_layout(args, uk, uv, q=ok)["UNIT"] is True


@pytest.mark.parametrize("page,taken", [(64, True), (128, True), (32, False), (96, False)])
def test_unit_major_pages_must_hold_whole_tiles(on_fake_gpu, page, taken):
    args = _inputs(b=2, s_max=2 * page)
    n_pages = 4
    pool = torch.randint(0, 256, (n_pages + 1, page, args[1].shape[-1]), dtype=torch.uint8)
    pk, _ = _unit_from(pool)
    pv, _ = _unit_from(pool)
    pt = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    lay = _launcher_layout(args, pk, pv, page_table=pt)
    assert (lay is not None and lay["UNIT"]) if taken else lay is None


def test_int8_latents_take_the_unit_kernel_only_unit_major(on_fake_gpu):
    """int8/32 latents through the launcher's guard: unit-major -> the unit kernel at BITS 8 (static and paged);
    row-major -> neither MMA kernel (the row-major kernel reads 4-bit codes only)."""
    args = _inputs(b=2, s_max=128, fmt=FMT8)
    uk, _ = _unit_from(args[1])
    uv, _ = _unit_from(args[2])
    lay = _launcher_layout(args, uk, uv, fmt=FMT8)
    assert lay["UNIT"] is True and lay["BITS"] == 8
    assert _launcher_layout(args, args[1], args[2], fmt=FMT8) is None
    pool = torch.randint(0, 256, (5, 64, args[1].shape[-1]), dtype=torch.uint8)
    pk, _ = _unit_from(pool)
    lay = _launcher_layout(args, pk, _unit_from(pool)[0], page_table=torch.tensor([[2, 0], [1, 3]]), fmt=FMT8)
    assert lay["UNIT"] is True and lay["BITS"] == 8


def test_cpu_calls_never_take_the_pass():
    args = _inputs(b=2, s_max=128)
    uk, _ = _unit_from(args[1])
    uv, _ = _unit_from(args[2])
    assert _launcher_layout(args, uk, uv) is None


# ---- the arguments the launcher passes, read through the kernel's address arithmetic -----------------------------

@pytest.mark.parametrize("fmt,g,hkv", [(FMT, 4, 2), (FMT, 2, 1), (FMT, 8, 3), (FMT8, 8, 3)])
def test_static_cache_launch_reads_the_named_bytes(recorded, fmt, g, hkv):
    args = _inputs(b=3, s_max=192, hkv=hkv, g=g, fmt=fmt)
    uk, bk = _unit_from(args[1], pad_front=64)
    uv, bv = _unit_from(args[2], pad_front=512)
    # a batch slice: the kernel gets the slice's own data pointer and strides
    args[0] = args[0][1:]
    for i in (12, 13):
        args[i] = args[i][1:]
    kv_len = 150
    _launch(args, uk[1:], uv[1:], kv_len=kv_len)
    assert not recorded["row"].calls and len(recorded["unit"].calls) == 1
    call = recorded["unit"].calls[0]
    grid, a, kw = call
    assert a[1].data_ptr() == uk[1].data_ptr() and a[2].data_ptr() == uv[1].data_ptr()
    assert kw["G"] == g and kw["PAGE"] == 0 and a[15] == 192 and a[14] == kv_len
    assert kw["BITS"] == parse_latent_format(fmt).bits
    n_split_m, per = a[17], a[16]
    assert grid == (hkv, n_split_m, 2 * 1) and (n_split_m - 1) * per < -(-kv_len // 64) <= n_split_m * per
    # the kernel merges its slot groups before it stores: one split of G rows per program, all the merge reads
    # (the fma merge where lat.fma_merge_on(), the default: m, l, acc and the split count one argument earlier than
    # the per-head merge's, which also takes the mask)
    merges = recorded["fma"].calls + recorded["reduce"].calls
    assert len(merges) == 1 and (recorded["fma"].calls != []) == lat.fma_merge_on()
    (_, ra, _), = merges
    o = 5 if recorded["fma"].calls else 6
    assert ra[o] is a[6] and ra[o + 1] is a[7] and ra[o + 2] is a[8] and ra[o + 7] == n_split_m
    assert a[6].numel() == 2 * hkv * 1 * n_split_m * g and a[8].numel() == a[6].numel() * 32
    _check_reads(call, "k", uk[1:], bk, args[5], lambda b, s: args[1][1 + b, s], fmt)
    _check_reads(call, "v", uv[1:], bv, args[6], lambda b, s: args[2][1 + b, s], fmt)


@pytest.mark.parametrize("fmt,page", [(FMT, 64), (FMT, 128), (FMT8, 128)])
def test_paged_launch_reads_the_named_bytes(recorded, fmt, page):
    hkv, g, b = 2, 4, 2
    args = _inputs(b=b, s_max=2 * page, hkv=hkv, g=g, fmt=fmt)
    w = args[1].shape[-1]
    gen = torch.Generator().manual_seed(2)
    pool_k = torch.randint(0, 256, (5, page, w), dtype=torch.uint8, generator=gen)
    pool_v = torch.randint(0, 256, (5, page, w), dtype=torch.uint8, generator=gen)
    pk, bk = _unit_from(pool_k)
    pv, bv = _unit_from(pool_v)
    pt = torch.tensor([[3, 0], [1, -1]], dtype=torch.int64)
    kv_len = page + page // 2 + 3
    _launch(args, pk, pv, page_table=pt, kv_len=kv_len)
    assert not recorded["row"].calls and len(recorded["unit"].calls) == 1
    call = recorded["unit"].calls[0]
    assert call[2]["PAGE"] == page == call[2]["COL_K"] == call[2]["COL_V"]
    assert call[2]["BITS"] == parse_latent_format(fmt).bits

    def logical(pool):
        def row(bb, s):
            p = int(pt[bb, s // page])
            return None if p < 0 else pool[p, s % page]
        return row

    _check_reads(call, "k", pk, bk, args[5], logical(pool_k), fmt)
    _check_reads(call, "v", pv, bv, args[6], logical(pool_v), fmt)


def test_row_major_latents_go_to_the_row_major_kernel(recorded):
    args = _inputs(b=2, s_max=128)
    _launch(args, args[1], args[2])
    assert len(recorded["row"].calls) == 1 and not recorded["unit"].calls


# ---- layout_of on degenerate shapes ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 1, 20), (3, 1, 20), (3, 64, 1), (1, 64, 1), (1, 128, 20), (4, 2, 2)])
def test_layout_of_agrees_with_the_strides_it_stands_for(shape):
    """Whatever layout_of reports, addressing the tensor as that layout (row-major: (b S + s) W' + w with its row
    stride; unit-major: b S W + w S + s) gives the addresses its strides give: a label never moves a byte."""
    x = (torch.arange(int(torch.tensor(shape).prod())) % 251).to(torch.uint8).reshape(shape)
    for layout in ("row-major", "unit-major"):
        y = to_layout(x, layout)
        got = layout_of(y)
        assert got in ("row-major", "unit-major")
        n, r, w = y.shape
        base = y.data_ptr()
        for bi in range(n):
            for s in range(r):
                for c in range(w):
                    addr = y[bi, s, c].data_ptr() - base
                    if got == "unit-major":
                        assert addr == bi * r * w + c * r + s
                    else:
                        row = y.stride(1) if r > 1 else (y.stride(0) if n > 1 else w)
                        assert addr == (bi * r + s) * row + c
        if got == "unit-major":  # the unit kernel's stride guard holds then too
            assert y.stride(-1) == y.shape[1] or y.shape[-1] == 1


# ---- the pass's own query fold and split merge (CKVP_MMA_FOLD / CKVP_MMA_MERGE) -----------------------------------

@pytest.mark.parametrize("fold,merge", [(True, False), (False, True), (True, True), (False, False)])
def test_fold_and_merge_in_pass_replace_their_launches(recorded, monkeypatch, fold, merge):
    """With the switches on, the launcher skips the fold kernel and / or the merge launch and hands the pass what
    they read: q, the bases, the exact tokens, the output, the strides, and (merge) a zeroed int32 counter a row
    that the kernel leaves zeroed; off, none of it (the kernel's defaults stand in)."""
    monkeypatch.setenv("CKVP_MMA_FOLD", "1" if fold else "0")
    monkeypatch.setenv("CKVP_MMA_MERGE", "1" if merge else "0")
    monkeypatch.setattr(lat, "_COUNTERS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    folds = []
    monkeypatch.setattr(lat, "_fold_query", lambda q, *a, **k: folds.append(q) or torch.zeros(1))
    hkv, g, b = 2, 4, 3
    args = _inputs(b=b, s_max=128, hkv=hkv, g=g, fmt=FMT8)
    uk, _ = _unit_from(args[1])
    uv, _ = _unit_from(args[2])
    out = _launch(args, uk, uv, kv_len=100)
    (grid, a, kw), = recorded["unit"].calls
    merges = recorded["fma"].calls + recorded["reduce"].calls
    assert (len(folds) == 0) == fold and (len(merges) == 0) == merge
    assert lat._LAST_LAUNCH["mma_fold"] is fold and lat._LAST_LAUNCH["mma_merge"] is merge
    if not (fold or merge):
        assert "FOLD" not in kw and "q_ptr" not in kw
        return
    assert kw["FOLD"] is fold and kw["MERGE"] is merge and kw["D_PAD"] == 128 and kw["D"] == 128
    q = args[0]
    assert kw["q_ptr"] is q and (a[0] is q) == fold  # qf: the fold kernel's output, or q where it is not read
    assert kw["bk_ptr"] is args[3] and kw["bv_ptr"] is args[4] and kw["nk_ptr"] is args[12]
    assert kw["nv_ptr"] is args[13]
    assert (kw["stride_qb"], kw["stride_qh"], kw["stride_qs"], kw["stride_qd"]) == q.stride()
    assert (kw["stride_nkb"], kw["stride_nkh"], kw["stride_nks"], kw["stride_nkd"]) == args[12].stride()
    assert kw["Q_EXACT"] == (q.dtype == torch.bfloat16)
    assert kw["BK_EXACT"] == (args[3].dtype in lat.BASIS_BF16_EXACT)
    assert abs(kw["qk_scale"] - args[16] * 1.4426950408889634) < 1e-9
    o = kw["out_ptr"]
    assert o.shape == q.shape and (kw["stride_ob"], kw["stride_oh"], kw["stride_os"], kw["stride_od"]) == o.stride()
    if merge:
        assert out is o  # the pass's last programs write the output; nothing runs after it
        cnt = kw["cnt_ptr"]
        assert cnt.dtype == torch.int32 and cnt.numel() == b * hkv * 1 and not cnt.any()
        # kept for the next call (the kernel leaves it zeroed), and grown, never shrunk, for a larger one
        assert lat._arrival_counters(b * hkv, torch.device("cpu")).data_ptr() == cnt.data_ptr()


def test_arrival_counters_are_fresh_while_a_graph_is_captured(monkeypatch):
    """During CUDA-graph capture without a large enough kept buffer: a fresh zeroed one (a buffer kept from inside
    the capture would come from the graph's private pool); outside it the kept one grows."""
    monkeypatch.setattr(lat, "_COUNTERS", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    dev = torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    a = lat._arrival_counters(10, dev)
    assert a.numel() == 10 and not a.any() and lat._COUNTERS == {}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    kept = lat._arrival_counters(10, dev)
    assert kept.numel() == 10 and lat._COUNTERS[0].numel() >= 4096
    monkeypatch.setattr(lat, "_RETIRED_COUNTERS", [])
    big = lat._arrival_counters(10_000, dev)
    assert big.numel() == 10_000 and lat._COUNTERS[0].numel() == 10_000 and not big.any()
    # the grown-out buffer stays alive: a CUDA graph captured with it still writes it on every replay
    assert [t.data_ptr() for t in lat._RETIRED_COUNTERS] == [kept.data_ptr()]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert lat._arrival_counters(500, dev).data_ptr() == big.data_ptr()  # large enough: the kept one, in capture too


@pytest.mark.parametrize("env,want", [({}, (True, True, True)), ({"CKVP_MMA_IMMA": "0"}, (False, True, False)),
                                      ({"CKVP_MMA_VIMMA": "0", "CKVP_MMA_FIELD_PAIRS": "0"}, (True, False, False))])
def test_integer_tensor_core_switches_are_on_by_default(recorded, monkeypatch, env, want):
    """IMMA, FPAIR and VIMMA are the 8-bit unit-major launch's defaults since the H200 check of 2026-12-07
    (benchmarks/results/2026-12-07-session51-h200); each ``CKVP_MMA_*=0`` turns its part off (VIMMA needs IMMA)."""
    for name in ("CKVP_MMA_IMMA", "CKVP_MMA_FIELD_PAIRS", "CKVP_MMA_VIMMA"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = _inputs(b=2, s_max=128, hkv=2, g=4, fmt=FMT8)
    uk, _ = _unit_from(args[1])
    uv, _ = _unit_from(args[2])
    _launch(args, uk, uv, kv_len=100)
    kw = recorded["unit"].calls[-1][2]
    assert (kw["IMMA"], kw["FPAIR"], kw["VIMMA"]) == want, kw
