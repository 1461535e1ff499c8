"""Paged latents (a page pool and a page table, vLLM's PagedAttention layout) through the ckvp ops: the same
results as the contiguous latent, bit for bit, on random shapes, page sizes, page placements, formats and
layouts (row- or unit-major storage of either).

``latent_append`` / ``latent_reconstruct`` / ``latent_attention`` take an optional ``page_table`` (B, S_max / P):
the latent is then a pool (N_pages + 1, P, W) whose last page is the trash page (writes to unmapped slots), and
unmapped pages read as zero rows. The fused CUDA kernel's page walk is checked under the Triton interpreter in
tests/kernels/test_latent_attention_triton.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ckvp_compile import ops as ckvp_ops
from ckvp_compile.errors import CKVPShapeError
from ckvp_compile.kernels import reference as ref
from ckvp_compile.kernels.latent_format import parse_latent_format
from ckvp_compile.kernels.latent_layout import LAYOUTS, to_layout

ckvp_ops.register_all()
OPS = torch.ops.ckvp


def _offsets(ranks):
    out = [0]
    for r in ranks:
        out.append(out[-1] + r)
    return out


def _state(b, hkv, g, d, s_max, page, ranks, fmt, spare, seed):
    """(contiguous latent, pool, page table, basis, offsets): pages of every sequence scattered over a pool with
    ``spare`` extra pages; the pool starts as garbage (NaN / random bytes) that no mapped slot may read."""
    gen = torch.Generator().manual_seed(seed)
    offsets = _offsets(ranks)
    f = parse_latent_format(fmt)
    width = f.row_width(offsets) if f.quantized else offsets[-1]
    dtype = torch.uint8 if f.quantized else torch.float32
    n_log = s_max // page
    n_pages = b * n_log + spare
    table = torch.randperm(n_pages, generator=gen)[: b * n_log].view(b, n_log).to(torch.int32)
    if f.quantized:
        pool = torch.randint(0, 256, (n_pages + 1, page, width), generator=gen, dtype=torch.uint8)
    else:
        pool = torch.full((n_pages + 1, page, width), float("nan"))
    contiguous = torch.zeros(b, s_max, width, dtype=dtype)
    for i in range(b):  # both start from the same (zero) rows in the mapped pages
        for j in range(n_log):
            pool[table[i, j]] = 0
    basis = torch.zeros(hkv, g * d, max(ranks))
    for h, r in enumerate(ranks):
        q, _ = torch.linalg.qr(torch.randn(g * d, g * d, generator=gen, dtype=torch.float64))
        basis[h, :, :r] = q[:, :r].float()
    return contiguous, pool, table, basis, offsets


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_paged_ops_equal_contiguous(data):
    b, hkv, g = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    d, page = data.draw(st.sampled_from((8, 16))), data.draw(st.sampled_from((1, 2, 4, 8)))
    n_log = data.draw(st.integers(1, 4))
    s_max = n_log * page
    ranks = [data.draw(st.integers(1, g * d)) for _ in range(hkv)]
    fmt = data.draw(st.sampled_from(("float", "int8/8", "int4/32", "mxint4/8", "int2/4")))
    lat, pool, table, basis, offsets = _state(b, hkv, g, d, s_max, page, ranks, fmt,
                                              data.draw(st.integers(0, 3)), data.draw(st.integers(0, 2**16)))
    # either may be stored unit-major (kernels.latent_layout): the same values through every op
    lat = to_layout(lat, data.draw(st.sampled_from(LAYOUTS)))
    pool = to_layout(pool, data.draw(st.sampled_from(LAYOUTS)))
    pool_before = pool.clone()
    # a prefill then decode steps through latent_append, on both layouts
    written = 0
    while written < s_max:
        n = data.draw(st.integers(1, s_max - written))
        slots = torch.arange(written, written + n, dtype=data.draw(st.sampled_from((torch.int32, torch.int64))))
        x = torch.randn(b, hkv, n, g * d)
        OPS.latent_append(lat, x, basis, offsets, slots, fmt)
        OPS.latent_append(pool, x, basis, offsets, slots, fmt, table)
        written += n
    assert torch.equal(ref.paged_gather(pool, table), lat)  # bitwise, float and packed rows
    mapped = torch.zeros(pool.shape[0], dtype=torch.bool)
    mapped[table.long().flatten()] = True
    # spare and trash pages untouched (NaN stays NaN: compare as bytes)
    assert torch.equal(pool[~mapped].contiguous().view(torch.uint8), pool_before[~mapped].contiguous().view(torch.uint8))

    # reads: reconstruct and attention agree exactly with the contiguous latent
    form = data.draw(st.sampled_from(("none", "rotate_half", "complex")))
    rd = 0 if form == "none" else d
    w = ref.rope_table_width(form, rd) if form != "none" else 1
    cos, sin = torch.randn(64, w), torch.randn(64, w)
    slot_pos = torch.randint(0, 64, (b, s_max), dtype=torch.int32)
    j = data.draw(st.integers(0, g - 1))
    block = basis[:, j * d:(j + 1) * d]
    kv_len = data.draw(st.integers(1, s_max))
    n_new = data.draw(st.integers(1, min(3, kv_len)))
    slots = torch.arange(kv_len - n_new, kv_len)
    new = torch.randn(b, hkv, n_new, d)
    want = OPS.latent_reconstruct(lat, block, offsets, cos, sin, slot_pos, form, rd, new, slots, fmt)
    got = OPS.latent_reconstruct(pool, block, offsets, cos, sin, slot_pos, form, rd, new, slots, fmt, table)
    assert torch.equal(got, want)
    # pages wholly past kv_len may be unmapped: the attention never reads them
    first_free = -(-kv_len // page)
    sparse = table.clone()
    sparse[:, first_free:] = -1
    h = hkv * data.draw(st.sampled_from((1, 2)))
    q = torch.randn(b, h, n_new, d)
    args = (q, lat, lat, block, block, offsets, offsets, cos, sin, slot_pos, form, rd, new, new.clone(), slots,
            None, d ** -0.5, kv_len, fmt, fmt)
    want = OPS.latent_attention(*args)
    got = OPS.latent_attention(q, pool, pool, *args[3:], sparse)
    assert torch.equal(got, want)


def test_unmapped_writes_land_in_the_trash_page_only():
    """The reference (what a GPU does, unchecked) writes an unmapped slot into the trash page; the op refuses it
    on host tensors, naming the slot and the fix."""
    lat, pool, table, basis, offsets = _state(2, 1, 1, 8, 8, 4, [4], "float", 2, 0)
    table[1, 1] = -1  # sequence 1's second page is unmapped
    before = pool.clone()
    x = torch.randn(2, 1, 1, 8)
    with pytest.raises(CKVPShapeError, match=r"slot 5 of sequence 1 is written but its page is unmapped"):
        OPS.latent_append(pool, x, basis, offsets, torch.tensor([5]), "float", table)
    assert torch.equal(pool.view(torch.uint8), before.view(torch.uint8))  # refused before any write
    ref.latent_append_ref(pool, x, basis, offsets, torch.tensor([5]), "float", table)
    changed = (pool != before) & ~(pool.isnan() & before.isnan())
    pages = changed.flatten(1).any(1).nonzero().flatten().tolist()
    assert pages == sorted([int(table[0, 1]), pool.shape[0] - 1])  # sequence 0's page and the trash page


def test_unmapped_pages_read_as_zero_rows():
    lat, pool, table, basis, offsets = _state(1, 1, 1, 8, 8, 4, [4], "int4/32", 1, 1)
    table[0, 1] = -1
    got = ref.paged_gather(pool, table)
    assert torch.equal(got[0, 4:], torch.zeros_like(got[0, 4:]))


def test_opcheck_with_page_table():
    lat, pool, table, basis, offsets = _state(2, 2, 1, 8, 8, 4, [4, 3], "int4/32", 1, 2)
    slots = torch.tensor([0, 1, 2])
    OPS.latent_append(pool, torch.randn(2, 2, 3, 8), basis, offsets, slots, "int4/32", table)
    cos, sin = torch.randn(16, 8), torch.randn(16, 8)
    slot_pos = torch.randint(0, 16, (2, 8), dtype=torch.int32)
    new, q = torch.randn(2, 2, 1, 8), torch.randn(2, 4, 1, 8)
    torch.library.opcheck(OPS.latent_append, (pool, torch.randn(2, 2, 1, 8), basis, offsets, torch.tensor([3]),
                                              "int4/32", table))
    torch.library.opcheck(OPS.latent_reconstruct, (pool, basis, offsets, cos, sin, slot_pos, "rotate_half", 8, new,
                                                   torch.tensor([3]), "int4/32", table))
    torch.library.opcheck(OPS.latent_attention, (q, pool, pool, basis, basis, offsets, offsets, cos, sin, slot_pos,
                                                 "rotate_half", 8, new, new, torch.tensor([3]), None, 0.3, 4,
                                                 "int4/32", "int4/32", table))


@pytest.mark.parametrize("bad, expect", [
    (lambda t: t.float(), "int32 or int64"),
    (lambda t: t[0], "page_table"),
    (lambda t: t[:1], "page_table"),
])
def test_bad_page_tables_name_the_layout(bad, expect):
    lat, pool, table, basis, offsets = _state(2, 1, 1, 8, 8, 4, [4], "float", 0, 3)
    q, new = torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1, 8)
    with pytest.raises(CKVPShapeError, match=expect):
        OPS.latent_attention(q, pool, pool, basis, basis, offsets, offsets, torch.zeros(1), torch.zeros(1),
                             torch.zeros(2, 8, dtype=torch.int32), "none", 0, new, new, torch.tensor([3]), None, 0.3,
                             4, "float", "float", bad(table))


@pytest.mark.parametrize("edit, expect", [
    (lambda t, n: t.__setitem__((0, 0), n), "physical pages in"),       # the trash page as a data page
    (lambda t, n: t.__setitem__((0, 0), n + 5), "physical pages in"),   # beyond the pool
    (lambda t, n: t.__setitem__((0, 0), -5), "physical pages in"),      # not -1
    (lambda t, n: t.__setitem__((1, 0), int(t[0, 0])), "mapped twice"),  # two sequences share a page
])
def test_page_table_values_are_checked_on_host_tensors(edit, expect):
    lat, pool, table, basis, offsets = _state(2, 1, 1, 8, 8, 4, [4], "float", 1, 4)
    edit(table, pool.shape[0] - 1)
    q, new = torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1, 8)
    with pytest.raises(CKVPShapeError, match=expect):
        OPS.latent_attention(q, pool, pool, basis, basis, offsets, offsets, torch.zeros(1), torch.zeros(1),
                             torch.zeros(2, 8, dtype=torch.int32), "none", 0, new, new, torch.tensor([3]), None, 0.3,
                             4, "float", "float", table)
    with pytest.raises(CKVPShapeError, match=expect):
        OPS.latent_append(pool, torch.randn(2, 1, 1, 8), basis, offsets, torch.tensor([0]), "float", table)


def test_non_contiguous_pools_are_refused_with_the_fix():
    lat, pool, table, basis, offsets = _state(1, 1, 1, 8, 8, 4, [4], "float", 0, 5)
    wide = torch.zeros(pool.shape[0] * 2, *pool.shape[1:])[::2]
    with pytest.raises(CKVPShapeError, match=r"empty_latent"):
        OPS.latent_append(wide, torch.randn(1, 1, 1, 8), basis, offsets, torch.tensor([0]), "float", table)
    # a unit-major pool is a layout the ops take (kernels.latent_layout)
    OPS.latent_append(to_layout(pool, "unit-major"), torch.randn(1, 1, 1, 8), basis, offsets, torch.tensor([0]),
                      "float", table)

