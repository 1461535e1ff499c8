"""kernels.latent_layout: row- and unit-major storage of one logical latent cache.

The layout is strides only: the helpers keep every value, report the layout they made, and refuse unknown names
with the list of known ones; a store built unit-major holds its latents so (the ops and kernels are checked on
both layouts in tests/ops/test_paged_latent_ops.py, tests/kernels/test_latent_*_triton.py and
tests/e2e/test_paged_latent_kv.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckvp_compile.errors import CKVPConfigError
from ckvp_compile.kernels.latent_layout import (
    LAYOUTS,
    MIN_PADDED_ROW,
    ROW_ALIGN,
    STORE_LAYOUTS,
    empty_latent,
    held_units_per_row,
    key_value_layouts,
    layout_of,
    padded_units,
    to_layout,
)


@settings(max_examples=40, deadline=None)
@given(lead=st.lists(st.integers(1, 4), min_size=1, max_size=2), rows=st.integers(2, 9), width=st.integers(2, 9),
       layout=st.sampled_from(LAYOUTS), dtype=st.sampled_from((torch.uint8, torch.float32, torch.bfloat16)))
def test_layouts_keep_values_and_report_themselves(lead, rows, width, layout, dtype):
    x = (torch.arange(int(torch.tensor(lead).prod()) * rows * width) % 251).to(dtype).reshape(*lead, rows, width)
    y = to_layout(x, layout)
    assert torch.equal(y, x) and y.shape == x.shape and y.dtype == x.dtype
    assert layout_of(y) == layout
    assert torch.equal(to_layout(y, "row-major"), x) and to_layout(y, "row-major").is_contiguous()
    z = empty_latent((*lead, rows), width, layout, dtype, "cpu")
    assert z.shape == (*lead, rows, width) and layout_of(z) == layout and not z.any()
    if layout == "unit-major":  # each unit (column) is contiguous over the slots
        assert z.stride(-2) == 1 and z.stride(-1) == rows
    else:  # wide rows start every ROW_ALIGN units (the kernels' row loads vectorise), the padding never shows
        assert z.stride(-1) == 1 and z.stride(-2) == padded_units(width) == held_units_per_row(z)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(2, 5), width=st.integers(MIN_PADDED_ROW - 20, MIN_PADDED_ROW + 40),
       dtype=st.sampled_from((torch.uint8, torch.bfloat16, torch.float32)))
def test_wide_row_major_rows_are_padded_and_keep_their_values(rows, width, dtype):
    z = empty_latent((2, rows), width, "row-major", dtype, "cpu")
    assert z.shape == (2, rows, width) and layout_of(z) == "row-major" and not z.any()
    if width < MIN_PADDED_ROW:  # narrow rows stay packed
        assert z.is_contiguous()
    else:  # the row stride is a multiple of ROW_ALIGN units (Triton's divisibility hint), less than a unit more
        assert z.stride(-2) % ROW_ALIGN == 0 and width <= z.stride(-2) < width + ROW_ALIGN
    assert z.untyped_storage().nbytes() == 2 * rows * held_units_per_row(z) * z.element_size()
    x = (torch.arange(2 * rows * width) % 251).to(dtype).reshape(2, rows, width)
    z.copy_(x)
    assert torch.equal(z, x) and torch.equal(to_layout(z, "row-major"), x)
    assert held_units_per_row(to_layout(x, "unit-major")) == width  # unit-major slots are not padded


def test_padded_units_round_wide_rows_up_to_the_alignment():
    assert [padded_units(w) for w in (0, 1, 17, 127, 128, 129, 420, 500)] == [0, 1, 17, 127, 128, 144, 432, 512]
    assert padded_units(17, min_width=0) == 32 and padded_units(130, align=8) == 136
    for bad in ((-1,), (4, 0)):
        with pytest.raises(ValueError, match="width must be >= 0"):
            padded_units(*bad)
    # a sliced-off column is no padded row-major layout: its rows do not span the leading dims' strides whole
    assert layout_of(torch.zeros(2, 4, 6)[:, 1:, :4]) is None


def test_unknown_layouts_and_shapes_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="row-major"):
        to_layout(torch.zeros(2, 3), "column-major")
    with pytest.raises(ValueError, match="unit-major"):
        empty_latent((2, 3), 4, "col", torch.uint8, "cpu")
    with pytest.raises(ValueError, match="leading dim"):
        empty_latent((), 4, "row-major", torch.uint8, "cpu")
    with pytest.raises(ValueError, match=r"\(\.\.\., rows, W\)"):
        to_layout(torch.zeros(3), "unit-major")
    assert layout_of(torch.zeros(4, 6)[:, ::2]) is None


def test_a_unit_major_store_holds_unit_major_latents_and_refuses_unknown_layouts():
    from ckvp_compile.latent.bases import LatentBases
    from ckvp_compile.runtime.store import LatentKVStore

    gen = torch.Generator().manual_seed(0)
    basis = (torch.linalg.qr(torch.randn(2, 16, 4, generator=gen))[0],)  # one group of 2 layers, 2 KV heads, D 8
    eig = (torch.ones(2, 16, dtype=torch.float64),)
    bases = LatentBases(groups=((0, 1),), num_kv_heads=2, head_dim=8, group_size=2, target_ratio=2.0,
                        rank_allocation="uniform", k_basis=basis, v_basis=basis, k_ranks=((4, 4),), v_ranks=((4, 4),),
                        k_eigenvalues=eig, v_eigenvalues=eig, model_fingerprint={}, num_tokens=1)
    for page_size in (0, 4):
        store = LatentKVStore(bases, 2, 16, "cpu", torch.float32, "int4", "int4", page_size=page_size,
                              latent_layout="unit-major")
        assert all(layout_of(t) == "unit-major" for t in (*store.latent_k, *store.latent_v))
        assert store.layout()[-1] == "unit-major"
        assert store.layout() != LatentKVStore(bases, 2, 16, "cpu", torch.float32, "int4", "int4",
                                               page_size=page_size).layout()  # graphs compiled per layout
    # keys and values each their own layout ("KEYS/VALUES")
    store = LatentKVStore(bases, 2, 16, "cpu", torch.float32, "int4", "int4", latent_layout="row-major/unit-major")
    assert all(layout_of(t) == "row-major" for t in store.latent_k)
    assert all(layout_of(t) == "unit-major" for t in store.latent_v)
    assert store.layout()[-1] == "row-major/unit-major"
    for bad in ("columns", "unit-major/", "row-major/unit-major/row-major"):
        with pytest.raises(CKVPConfigError, match="latent_layout must be one of"):
            LatentKVStore(bases, 2, 16, "cpu", torch.float32, latent_layout=bad)


@pytest.mark.parametrize("fmt,page_size", [("float", 0), ("int4/32", 0), ("int4/32", 4), ("int8/32", 0)])
def test_a_store_pads_wide_rows_and_its_byte_budget_counts_the_padding(fmt, page_size):
    """Wide row-major latent rows (>= MIN_PADDED_ROW units) are padded to ROW_ALIGN units in the store; the
    planner's byte count (store_bytes), StoreBytes and latent_row_bytes all include the padding, so the ratio the
    planner meets is the one the device holds."""
    from ckvp_compile.latent.bases import LatentBases
    from ckvp_compile.latent.budget import store_bytes
    from ckvp_compile.runtime.store import LatentKVStore

    gen = torch.Generator().manual_seed(0)
    ranks = ((70, 65),) if fmt == "float" else ((128, 121),)  # 135 elements; int4 157 / int8 281 bytes
    # one group of 2 layers, 2 KV heads, D 64: bases (Hkv, 2 * D, largest rank)
    basis = (torch.linalg.qr(torch.randn(2, 128, max(ranks[0]), generator=gen))[0],)
    eig = (torch.ones(2, 128, dtype=torch.float64),)
    bases = LatentBases(groups=((0, 1),), num_kv_heads=2, head_dim=64, group_size=2, target_ratio=2.0,
                        rank_allocation="uniform", k_basis=basis, v_basis=basis, k_ranks=ranks, v_ranks=ranks,
                        k_eigenvalues=eig, v_eigenvalues=eig, model_fingerprint={}, num_tokens=1)
    store = LatentKVStore(bases, 2, 16, "cpu", torch.float32, fmt, fmt, page_size=page_size)
    for t in (*store.latent_k, *store.latent_v):
        assert layout_of(t) == "row-major" and not t.is_contiguous()  # these widths are not multiples of 16
        assert t.stride(-2) % ROW_ALIGN == 0 and t.shape[-1] < t.stride(-2) < t.shape[-1] + ROW_ALIGN
    k_bytes, v_bytes = store.latent_row_bytes(0)
    assert k_bytes == store.latent_k[0].stride(-2) * store.latent_k[0].element_size() and v_bytes == k_bytes
    nb = store.nbytes()
    assert store_bytes(bases, 2, 16, fmt, fmt, torch.float32, page_size=page_size) == nb.per_sequence_state + nb.bases


def test_a_store_layout_names_the_key_and_value_layouts():
    assert key_value_layouts("unit-major") == ("unit-major", "unit-major")
    assert key_value_layouts("row-major/unit-major") == ("row-major", "unit-major")
    assert {key_value_layouts(x) for x in STORE_LAYOUTS} == {(k, v) for k in LAYOUTS for v in LAYOUTS}
    with pytest.raises(ValueError, match="row-major/unit-major"):  # the message lists the choices
        key_value_layouts("values-unit-major")


def test_kernels_refuse_strided_latents_whose_offsets_pass_int32(monkeypatch):
    """The kernels index a row's units with int32 offsets: a strided latent (unit-major) whose last unit lies at
    2**31 elements or more is refused (attention: the reference serves it; append: the unfused path), a smaller one
    is accepted; so are RoPE tables whose last element lies past 2**31. Meta tensors stand in for the huge latents (only shapes and strides are read)."""
    pytest.importorskip("triton")
    from ckvp_compile.bench.attention import make_inputs
    from ckvp_compile.kernels import latent_attention_triton as lat
    from ckvp_compile.kernels import latent_quant_triton as lq

    monkeypatch.setattr(lat, "_interpreting", lambda: True)
    args = list(make_inputs(1, 16, "int4/32", 8, heads=(2, 2), head_dim=16, group=1, dev="cpu"))
    width = args[1].shape[-1]
    big = torch.empty_strided((1, 16, width), (1, 1, 2**31 // (width - 1) + 1), dtype=torch.uint8, device="meta")
    ok = torch.empty_strided((1, 16, width), (16 * width, 1, 16), dtype=torch.uint8, device="meta")

    def reason(lk):
        return lat.unsupported_reason(args[0], lk, args[2], args[3], args[4], args[10], None, args[7], args[12],
                                      "int4/32", "int4/32")

    assert reason(ok) is None
    assert "2**31" in reason(big)
    # the RoPE tables are indexed with int32 offsets too (positions times the row stride)
    huge_table = torch.empty_strided((2**20, 16), (2**11 + 16, 1), dtype=args[7].dtype, device="meta")
    assert "2**31" in lat.unsupported_reason(args[0], args[1], args[2], args[3], args[4], args[10], None, huge_table,
                                             args[12], "int4/32", "int4/32")
    x, basis = torch.zeros(1, 2, 1, 16), torch.zeros(2, 16, 8)
    assert lq.append_fusable(ok, x, basis) == ""
    assert "2**31" in lq.append_fusable(big, x, basis)
