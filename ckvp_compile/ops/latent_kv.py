"""The cross-layer latent KV ops: ``torch.ops.ckvp.{latent_append, rope_table_update, latent_reconstruct,
latent_attention, window_append}`` (and online_basis_fit, residual_append, latent_reconstruct_residual below).

Each op is a ``torch.library.custom_op`` (opaque to Inductor: an extern call) whose eager kernel validates its
inputs and calls the pure-PyTorch twin in :mod:`ckvp_compile.kernels.reference`; a ``register_fake`` kernel
runs the same validation on shapes only, so a wrong shape fails at trace time with the same message.
Notation and the packed latent layout: the docstring of :mod:`ckvp_compile.kernels.reference`.

Schemas (``int[]`` offsets are compile-time constants; ``SymInt kv_len`` may be symbolic)::

    ckvp::latent_append(Tensor(a!) latent, Tensor x, Tensor basis, int[] offsets, Tensor slots,
        str fmt="float") -> ()
    ckvp::rope_table_update(Tensor(a!) cos_table, Tensor(b!) sin_table, Tensor(c!) slot_pos, Tensor cos,
        Tensor sin, Tensor position_ids, Tensor slots) -> ()
    ckvp::latent_reconstruct(Tensor latent, Tensor basis_block, int[] offsets, Tensor cos_table,
        Tensor sin_table, Tensor slot_pos, str rope_form, int rotary_dim, Tensor new, Tensor slots,
        str fmt="float") -> Tensor
    ckvp::latent_attention(Tensor q, Tensor latent_k, Tensor latent_v, Tensor basis_k_block,
        Tensor basis_v_block, int[] k_offsets, int[] v_offsets, Tensor cos_table, Tensor sin_table,
        Tensor slot_pos, str rope_form, int rotary_dim, Tensor new_k, Tensor new_v, Tensor slots,
        Tensor? attn_mask, float scale, SymInt kv_len, str k_fmt="float", str v_fmt="float") -> Tensor
    ckvp::window_append(Tensor(a!) window_k, Tensor(b!) window_v, Tensor(c!) window_slots, Tensor k, Tensor v,
        Tensor slots) -> ()

``new`` / ``new_k`` / ``new_v`` and ``slots`` are the exact tokens (N of them: the call's, and a dense recent
window's; slot -1 marks an unused entry), which need not be as many as the queries.

``fmt`` / ``k_fmt`` / ``v_fmt`` name the latent's storage format (:mod:`ckvp_compile.kernels.latent_format`):
``"float"`` (a float latent of width R_tot) or a quantized one such as ``"int8/32"`` (a uint8 latent whose
width is the format's row bytes).

Not checked (they need the data, which fake tensors do not have, and a host sync on GPU): slot and position
values in range (``slots < S_max`` and ``< kv_len``, ``position_ids < P_max``, ``slot_pos < P_max``), and
``slots`` being distinct. Out-of-range indices raise PyTorch's own index error on CPU.

Imported by :func:`ckvp_compile.ops.register_all`; importing this module defines the ops.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..errors import CKVPShapeError
from ..kernels import reference as ref
from ..kernels.latent_layout import layout_of
from ..kernels.latent_format import parse_latent_format

__all__ = ["OPS", "latent_append", "latent_attention", "latent_reconstruct", "online_basis_fit", "rope_table_update",
           "window_append"]

_INDEX_DTYPES = (torch.int32, torch.int64)


# ------------------------------------------------------------------------------------------------ validation


def _fail(op: str, msg: str) -> None:
    raise CKVPShapeError(f"ckvp::{op}: {msg}")


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _expect_shape(op: str, name: str, t: torch.Tensor, expected: Sequence[Any], layout: str) -> None:
    """Fail unless ``t.shape`` equals ``expected`` (None entries match anything); ``layout`` names the dims."""
    shape = _shape(t)
    if len(shape) != len(expected) or any(e is not None and s != e for s, e in zip(shape, expected)):
        want = "(" + ", ".join("*" if e is None else str(e) for e in expected) + ("," if len(expected) == 1 else "") + ")"
        _fail(op, f"{name} must be {layout} = {want}, but got {shape}")


def _expect_ndim(op: str, name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        _fail(op, f"{name} must be {ndim}-D {layout}, but got shape {_shape(t)}")


def _expect_float(op: str, name: str, t: torch.Tensor) -> None:
    if not t.is_floating_point():
        _fail(op, f"{name} must be a floating-point tensor, but got {t.dtype}")


def _expect_index(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in _INDEX_DTYPES:
        _fail(op, f"{name} must be int32 or int64, but got {t.dtype}")


def _expect_same_device(op: str, **tensors: torch.Tensor | None) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        _fail(op, f"all tensors must be on one device, but got {devices}")


def _check_latent(op: str, name: str, latent: torch.Tensor, fmt: str) -> None:
    """A float latent for 'float', a uint8 one for a quantized format; an unknown format fails."""
    try:
        f = parse_latent_format(fmt)
    except ValueError as e:
        _fail(op, str(e))
    if f.quantized and latent.dtype != torch.uint8:
        _fail(op, f"{name} must be uint8 for the quantized format {f.name!r}, but got {latent.dtype}")
    if not f.quantized:
        _expect_float(op, name, latent)


def _check_offsets(op: str, name: str, offsets: Sequence[int], hkv: int, r_tot: Any, r_pad: Any,
                   fmt: str = "float") -> None:
    """offsets: Hkv+1 non-decreasing ints from 0 to R_tot, every rank <= R_max (basis width); the latent width
    ``r_tot`` must be R_tot ('float') or the format's row bytes."""
    offsets = list(offsets)
    if len(offsets) != hkv + 1:
        _fail(op, f"{name} must have Hkv+1 = {hkv + 1} entries (Hkv from the basis), but got {len(offsets)}: "
                  f"{offsets}")
    if offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
        _fail(op, f"{name} must be non-decreasing and start at 0, but got {offsets}")
    f = parse_latent_format(fmt)
    try:
        width = f.row_width(offsets)
    except ValueError as e:
        _fail(op, f"{name}: {e}")
    if f.quantized and width != r_tot:
        _fail(op, f"the latent width {r_tot} must equal the {f.name} row bytes {width} of {name} = "
                  f"{offsets}")
    if not f.quantized and offsets[-1] != r_tot:
        _fail(op, f"{name}[-1] must equal the latent width R_tot = {r_tot}, but got {offsets[-1]}")
    ranks = [b - a for a, b in zip(offsets, offsets[1:])]
    if ranks and max(ranks) > r_pad:
        _fail(op, f"every head's rank {ranks} (from {name}) must be <= the basis width R_max = {r_pad}")


def _check_rope(op: str, form: str, rotary_dim: int, d: Any, cos_table: torch.Tensor, sin_table: torch.Tensor,
                slot_pos: torch.Tensor, b: Any, s_max: Any) -> None:
    if form not in ref.ROPE_FORMS:
        _fail(op, f"rope_form must be one of {ref.ROPE_FORMS}, but got {form!r}")
    if form == "none":
        return
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > d:
        _fail(op, f"rotary_dim must be even and in [2, D = {d}], but got {rotary_dim}")
    w = ref.rope_table_width(form, rotary_dim)
    _expect_shape(op, "cos_table", cos_table, (None, w), f"(P_max, W) with W = {w} for {form!r}")
    _expect_shape(op, "sin_table", sin_table, _shape(cos_table), "cos_table's shape")
    _expect_float(op, "cos_table", cos_table)
    _expect_float(op, "sin_table", sin_table)
    _expect_shape(op, "slot_pos", slot_pos, (b, s_max), "(B, S_max)")
    _expect_index(op, "slot_pos", slot_pos)


def _logical_dims(op: str, name: str, latent: torch.Tensor, page_table: torch.Tensor | None) -> tuple[Any, Any]:
    """(B, S_max) that ``latent`` stands for: its first two dims, or with a page table, the table's B and
    pages x page size (``latent`` is then a page pool (N_pages + 1, P, W), the last page the trash page)."""
    if page_table is None:
        return latent.shape[0], latent.shape[1]
    _expect_ndim(op, "page_table", page_table, 2, "(B, S_max / P)")
    _expect_index(op, "page_table", page_table)
    if latent.shape[0] < 2:
        _fail(op, f"a paged {name} is a page pool (N_pages + 1, P, W) with at least one page and the trash page, "
                  f"but got {_shape(latent)}")
    if layout_of(latent) is None:  # pages are addressed as blocks of the whole pool
        _fail(op, f"a paged {name} must be a page pool (N_pages + 1, P, W) stored row-major (contiguous) or "
                  f"unit-major, but got strides {tuple(latent.stride())}; allocate the pool with "
                  f"kernels.latent_layout.empty_latent (a copy made by to_layout serves reads only: writes to it "
                  f"do not reach the original)")
    _expect_same_device(op, **{name: latent, "page_table": page_table})
    return page_table.shape[0], page_table.shape[1] * latent.shape[1]


def _check_page_values(op: str, latent: torch.Tensor, page_table: torch.Tensor | None,
                       written: torch.Tensor | None = None) -> None:
    """On host tensors (a GPU check would synchronise every call): entries are -1 or pages of the pool below its
    trash page, no physical page is mapped twice, and the slots ``written`` (an append's) are mapped in every
    sequence (an unmapped write would land in the trash page and be lost)."""
    if page_table is None or page_table.device.type != "cpu" or page_table.numel() == 0:
        return
    n = latent.shape[0] - 1
    lo, hi = int(page_table.min()), int(page_table.max())
    if lo < -1 or hi >= n:
        raise CKVPShapeError(f"ckvp::{op}: page_table entries must be physical pages in [0, {n}) or -1 (unmapped); "
                             f"page {n} is the pool's trash page; got {lo if lo < -1 else hi}")
    mapped = page_table[page_table >= 0]
    if mapped.numel() != torch.unique(mapped).numel():
        raise CKVPShapeError(f"ckvp::{op}: a physical page is mapped twice in page_table: each page holds one "
                             f"(sequence, logical page); use LatentKVStore.ensure_mapped to map pages")
    if written is not None and written.numel():
        pages = page_table.long().index_select(1, written.long() // latent.shape[1])  # (B, S)
        if bool((pages < 0).any()):
            b, j = (int(x) for x in (pages < 0).nonzero()[0])
            raise CKVPShapeError(f"ckvp::{op}: slot {int(written[j])} of sequence {b} is written but its page is "
                                 f"unmapped (page_table[{b}, {int(written[j]) // latent.shape[1]}] = -1); map it "
                                 f"first (LatentKVStore.ensure_mapped; the backend does it before each call)")


def _check_slots(op: str, slots: torch.Tensor, layout: str = "(S,)") -> Any:
    _expect_ndim(op, "slots", slots, 1, layout)
    _expect_index(op, "slots", slots)
    return slots.shape[0]


def _check_slot_values(op: str, slots: torch.Tensor, s_max: int, unused_ok: bool = False,
                       kv_len: int | None = None) -> None:
    """Slots beyond the cache mean a context longer than the cache: a clear error on host tensors (on a GPU the
    check would synchronise every step; there the indexing ops fail with a device-side assert instead).
    ``unused_ok``: -1 marks an unused exact-token entry (a recent window that is not full yet); ``kv_len``: the
    exact tokens must also lie inside the attended slots [0, kv_len)."""
    if slots.device.type != "cpu" or slots.numel() == 0:
        return
    lo, hi = int(slots.min()), int(slots.max())
    if kv_len is not None and s_max > hi >= kv_len:
        raise CKVPShapeError(f"ckvp::{op}: exact token at slot {hi}, but only slots [0, kv_len = {kv_len}) are "
                             f"attended: exact tokens must lie inside them")
    if lo < (-1 if unused_ok else 0) or hi >= s_max:
        raise CKVPShapeError(f"ckvp::{op}: slot {hi if hi >= s_max else lo} is outside the cache's {s_max} slots: the "
                             f"context is longer than the cache. Build it with CKVPStaticCache(max_cache_len=...) at "
                             f"least as long as prompt + new tokens, or call cache.reset() before a new sequence")


def _check_position_values(position_ids: torch.Tensor, p_max: int) -> None:
    """RoPE positions outside the cache's tables: a clear error on host tensors (like :func:`_check_slot_values`,
    not checked on a GPU, where it would synchronise every step)."""
    if position_ids.device.type != "cpu" or position_ids.numel() == 0:
        return
    lo, hi = int(position_ids.min()), int(position_ids.max())
    if lo < 0 or hi >= p_max:
        raise CKVPShapeError(
            f"ckvp::rope_table_update: RoPE position {hi if hi >= p_max else lo} is outside the latent cache's {p_max} "
            "positions (its RoPE tables hold max_cache_len rows). Build the cache with CKVPStaticCache(max_cache_len="
            "...) above the largest position id, or pass positions from 0")


def _basis_dims(op: str, name: str, basis: torch.Tensor, b: Any, layout: str) -> tuple[Any, Any, Any]:
    """(Hkv, N, R_max) of a shared (Hkv, N, R_max) basis or a per-sequence (B, Hkv, N, R_max) one."""
    if basis.dim() == 4:
        if basis.shape[0] != b:
            _fail(op, f"{name} must be (B, {layout}) with B = {b} for per-sequence (online) bases, but got "
                      f"{_shape(basis)}")
        return basis.shape[1], basis.shape[2], basis.shape[3]
    _expect_ndim(op, name, basis, 3, f"({layout}) or (B, {layout})")
    return basis.shape[0], basis.shape[1], basis.shape[2]


def _check_latent_append(latent, x, basis, offsets, slots, fmt="float", page_table=None) -> None:
    op = "latent_append"
    _expect_ndim(op, "latent", latent, 3, "(B, S_max, R_tot), or a page pool (N_pages + 1, P, R_tot)")
    s = _check_slots(op, slots)
    b, _ = _logical_dims(op, "latent", latent, page_table)
    hkv, gd, r_pad = _basis_dims(op, "basis", basis, b, "Hkv, G*D, R_max")
    _expect_shape(op, "x", x, (b, hkv, s, gd), "(B, Hkv, S, G*D) from latent, basis and slots")
    _check_latent(op, "latent", latent, fmt)
    for name, t in (("x", x), ("basis", basis)):
        _expect_float(op, name, t)
    _check_offsets(op, "offsets", offsets, hkv, latent.shape[2], r_pad, fmt)
    _expect_same_device(op, latent=latent, x=x, basis=basis, slots=slots)


def _check_rope_table_update(cos_table, sin_table, slot_pos, cos, sin, position_ids, slots) -> None:
    op = "rope_table_update"
    _expect_ndim(op, "cos_table", cos_table, 2, "(P_max, W)")
    _expect_shape(op, "sin_table", sin_table, _shape(cos_table), "cos_table's shape (P_max, W)")
    _expect_ndim(op, "slot_pos", slot_pos, 2, "(B, S_max)")
    _expect_index(op, "slot_pos", slot_pos)
    s = _check_slots(op, slots)
    b, w = slot_pos.shape[0], cos_table.shape[1]
    _expect_ndim(op, "cos", cos, 3, "(B or 1, S, W)")
    if cos.shape[0] not in (1, b):
        _fail(op, f"cos must be (B or 1, S, W) with B = {b} (slot_pos.shape[0]), but got {_shape(cos)}")
    _expect_shape(op, "cos", cos, (cos.shape[0], s, w), "(B or 1, S, W) from slots and cos_table")
    _expect_shape(op, "sin", sin, _shape(cos), "cos's shape (B or 1, S, W)")
    _expect_ndim(op, "position_ids", position_ids, 2, "(B or 1, S)")
    if position_ids.shape[0] not in (1, b):
        _fail(op, f"position_ids must be (B or 1, S) with B = {b} (slot_pos.shape[0]), but got "
                  f"{_shape(position_ids)}")
    _expect_shape(op, "position_ids", position_ids, (position_ids.shape[0], s), "(B or 1, S) from slots")
    _expect_index(op, "position_ids", position_ids)
    for name, t in (("cos_table", cos_table), ("sin_table", sin_table), ("cos", cos), ("sin", sin)):
        _expect_float(op, name, t)
    _expect_same_device(op, cos_table=cos_table, sin_table=sin_table, slot_pos=slot_pos, cos=cos, sin=sin,
                        position_ids=position_ids, slots=slots)


def _check_latent_reconstruct(latent, basis_block, offsets, cos_table, sin_table, slot_pos, rope_form, rotary_dim,
                              new, slots, fmt="float", page_table=None) -> None:
    op = "latent_reconstruct"
    _expect_ndim(op, "latent", latent, 3, "(B, S_max, R_tot), or a page pool (N_pages + 1, P, R_tot)")
    n = _check_slots(op, slots, "(N,)")
    b, s_max = _logical_dims(op, "latent", latent, page_table)
    hkv, d, r_pad = _basis_dims(op, "basis_block", basis_block, b, "Hkv, D, R_max")
    _expect_shape(op, "new", new, (b, hkv, n, d), "(B, Hkv, N, D) from latent, basis_block and slots")
    _check_latent(op, "latent", latent, fmt)
    for name, t in (("basis_block", basis_block), ("new", new)):
        _expect_float(op, name, t)
    _check_offsets(op, "offsets", offsets, hkv, latent.shape[2], r_pad, fmt)
    _check_rope(op, rope_form, rotary_dim, d, cos_table, sin_table, slot_pos, b, s_max)
    _expect_same_device(op, latent=latent, basis_block=basis_block, new=new, slots=slots,
                        **({} if rope_form == "none" else dict(cos_table=cos_table, sin_table=sin_table,
                                                                slot_pos=slot_pos)))


def _check_latent_attention(q, latent_k, latent_v, basis_k_block, basis_v_block, k_offsets, v_offsets, cos_table,
                            sin_table, slot_pos, rope_form, rotary_dim, new_k, new_v, slots, attn_mask, scale,
                            kv_len, k_fmt="float", v_fmt="float", page_table=None) -> None:
    op = "latent_attention"
    _expect_ndim(op, "q", q, 4, "(B, H, S, D)")
    b, h, s, d = q.shape
    hkv, dk, rk_pad = _basis_dims(op, "basis_k_block", basis_k_block, b, "Hkv, D, Rk_max")
    hv, dv, rv_pad = _basis_dims(op, "basis_v_block", basis_v_block, b, "Hkv, D, Rv_max")
    if dk != d:
        _fail(op, f"basis_k_block must be (Hkv, D, Rk_max) with D = {d} from q, but got {_shape(basis_k_block)}")
    if (hv, dv) != (hkv, d) or basis_v_block.dim() != basis_k_block.dim():
        _fail(op, f"basis_v_block must be like basis_k_block {_shape(basis_k_block)} up to its rank, but got "
                  f"{_shape(basis_v_block)}")
    if hkv == 0 or h % hkv:
        _fail(op, f"the query heads H = {h} (q.shape[1]) must be a multiple of the KV heads Hkv = {hkv} "
                  f"(from basis_k_block)")
    if page_table is None:
        _expect_shape(op, "latent_k", latent_k, (b, None, None), "(B, S_max, Rk_tot) with B from q")
        s_max = latent_k.shape[1]
        _expect_shape(op, "latent_v", latent_v, (b, s_max, None), "(B, S_max, Rv_tot) from q and latent_k")
    else:
        _expect_ndim(op, "latent_k", latent_k, 3, "a page pool (N_pages + 1, P, Rk_tot)")
        _expect_shape(op, "latent_v", latent_v, (latent_k.shape[0], latent_k.shape[1], None),
                      "a page pool (N_pages + 1, P, Rv_tot) with latent_k's pages")
        _expect_shape(op, "page_table", page_table, (b, None), "(B, S_max / P) with B from q")
        s_max = _logical_dims(op, "latent_k", latent_k, page_table)[1]
    n = _check_slots(op, slots, "(N,)")
    _expect_shape(op, "new_k", new_k, (b, hkv, n, d), "(B, Hkv, N, D) from q, basis_k_block and slots (N,)")
    _expect_shape(op, "new_v", new_v, (b, hkv, n, d), "(B, Hkv, N, D) from q, basis_k_block and slots (N,)")
    _check_latent(op, "latent_k", latent_k, k_fmt)
    _check_latent(op, "latent_v", latent_v, v_fmt)
    for name, t in (("q", q), ("basis_k_block", basis_k_block), ("basis_v_block", basis_v_block), ("new_k", new_k),
                    ("new_v", new_v)):
        _expect_float(op, name, t)
    _check_offsets(op, "k_offsets", k_offsets, hkv, latent_k.shape[2], rk_pad, k_fmt)
    _check_offsets(op, "v_offsets", v_offsets, hkv, latent_v.shape[2], rv_pad, v_fmt)
    _check_rope(op, rope_form, rotary_dim, d, cos_table, sin_table, slot_pos, b, s_max)
    if not 1 <= kv_len <= s_max:
        _fail(op, f"kv_len must be in [1, S_max = {s_max}] (latent_k.shape[1]), but got {kv_len}")
    if attn_mask is not None:
        target = (b, h, s, kv_len)
        mshape = _shape(attn_mask)
        if len(mshape) > 4 or any(m != 1 and m != t for m, t in zip(reversed(mshape), reversed(target))):
            _fail(op, f"attn_mask must be broadcastable to (B, H, S, kv_len) = {target}, but got {mshape}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            _fail(op, f"attn_mask must be bool (True = attend) or an additive float mask, but got {attn_mask.dtype}")
    _expect_same_device(op, q=q, latent_k=latent_k, latent_v=latent_v, basis_k_block=basis_k_block,
                        basis_v_block=basis_v_block, new_k=new_k, new_v=new_v, slots=slots, attn_mask=attn_mask,
                        **({} if rope_form == "none" else dict(cos_table=cos_table, sin_table=sin_table,
                                                                slot_pos=slot_pos)))


# ------------------------------------------------------------------------------------------------------- ops


@torch.library.custom_op(
    "ckvp::latent_append",
    mutates_args=("latent",),
    schema="(Tensor(a!) latent, Tensor x, Tensor basis, int[] offsets, Tensor slots, str fmt=\"float\", "
    "Tensor? page_table=None) -> ()",
)
def latent_append(latent: torch.Tensor, x: torch.Tensor, basis: torch.Tensor, offsets: Sequence[int],
                  slots: torch.Tensor, fmt: str = "float", page_table: torch.Tensor | None = None) -> None:
    """Project the group's stacked new keys (or values) onto each head's basis and write them into the latent.

    Args:
        latent: (B, S_max, R_tot) float, or (B, S_max, row_bytes) uint8 for a quantized ``fmt``; mutated at
            ``latent[:, slots]``.
        x: (B, Hkv, S, G*D) float, the group's G layers' new pre-RoPE keys (or values), layer-major.
        basis: (Hkv, G*D, R_max) float, orthonormal columns, zero beyond each head's rank.
        offsets: Hkv+1 ints, head h owns latent columns offsets[h]:offsets[h+1].
        slots: (S,) int32|int64, distinct cache slots < S_max.
        fmt: the latent's storage format ('float', 'int8/32', 'int4/32', 'int2/32', ...).
        page_table: None, or (B, S_max / P) int32|int64 for a paged latent: ``latent`` is then a page pool
            (N_pages + 1, P, W), row- or unit-major (:mod:`~ckvp_compile.kernels.latent_layout`), and slot t of
            sequence b is row ``t % P`` of page
            ``page_table[b, t // P]`` (-1: unmapped); entries are distinct pages below the last one (the trash
            page). Writing an unmapped slot is an error: raised for host tensors; on a GPU (no check without a
            sync) the write lands in the trash page and is lost. See kernels/reference.py.
    Returns:
        None; ``latent[:, slots, offsets[h]:offsets[h+1]] = x[:, h] @ basis[h, :, :r_h]`` (fp32, then cast or
        quantized per token and block).
    Raises:
        CKVPShapeError: a shape, dtype or device does not match the layout above; for host tensors also a slot
            beyond the cache, and with a page table an entry out of range, a page mapped twice or an unmapped
            written slot.
    Reference: kernels/reference.py::latent_append_ref
    """
    _check_latent_append(latent, x, basis, offsets, slots, fmt, page_table)
    _check_slot_values("latent_append", slots, _logical_dims("latent_append", "latent", latent, page_table)[1])
    _check_page_values("latent_append", latent, page_table, slots)
    ref.latent_append_ref(latent, x, basis, offsets, slots, fmt, page_table)


@latent_append.register_fake
def _(latent, x, basis, offsets, slots, fmt="float", page_table=None) -> None:
    _check_latent_append(latent, x, basis, offsets, slots, fmt, page_table)


@torch.library.custom_op(
    "ckvp::rope_table_update",
    mutates_args=("cos_table", "sin_table", "slot_pos"),
    schema="(Tensor(a!) cos_table, Tensor(b!) sin_table, Tensor(c!) slot_pos, Tensor cos, Tensor sin, "
    "Tensor position_ids, Tensor slots) -> ()",
)
def rope_table_update(cos_table: torch.Tensor, sin_table: torch.Tensor, slot_pos: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, position_ids: torch.Tensor, slots: torch.Tensor) -> None:
    """Record the model's RoPE tables at the new tokens' positions, and each new slot's position per sequence.

    Args:
        cos_table, sin_table: (P_max, W) float, position-indexed; mutated at rows ``position_ids``.
        slot_pos: (B, S_max) int32|int64, RoPE position of every slot; mutated at columns ``slots``.
        cos, sin: (B or 1, S, W) float, the model's tables for the new tokens (W per
            :func:`~ckvp_compile.kernels.reference.rope_table_width`).
        position_ids: (B or 1, S) int32|int64, the new tokens' positions (< P_max; per sequence with left
            padding).
        slots: (S,) int32|int64, the new tokens' slots.
    Returns:
        None; ``cos_table[position_ids] = cos``, ``sin_table[position_ids] = sin``,
        ``slot_pos[:, slots] = position_ids``.
    Raises:
        CKVPShapeError: a shape, dtype or device does not match the layout above; a slot or (on the CPU) a position
            outside the cache.
    Reference: kernels/reference.py::rope_table_update_ref
    """
    _check_rope_table_update(cos_table, sin_table, slot_pos, cos, sin, position_ids, slots)
    _check_slot_values("rope_table_update", slots, slot_pos.shape[1])
    _check_position_values(position_ids, cos_table.shape[0])
    ref.rope_table_update_ref(cos_table, sin_table, slot_pos, cos, sin, position_ids, slots)


@rope_table_update.register_fake
def _(cos_table, sin_table, slot_pos, cos, sin, position_ids, slots) -> None:
    _check_rope_table_update(cos_table, sin_table, slot_pos, cos, sin, position_ids, slots)


@torch.library.custom_op(
    "ckvp::latent_reconstruct",
    mutates_args=(),
    schema="(Tensor latent, Tensor basis_block, int[] offsets, Tensor cos_table, Tensor sin_table, "
    "Tensor slot_pos, str rope_form, int rotary_dim, Tensor new, Tensor slots, str fmt=\"float\", "
    "Tensor? page_table=None) -> Tensor",
)
def latent_reconstruct(latent: torch.Tensor, basis_block: torch.Tensor, offsets: Sequence[int],
                       cos_table: torch.Tensor, sin_table: torch.Tensor, slot_pos: torch.Tensor, rope_form: str,
                       rotary_dim: int, new: torch.Tensor, slots: torch.Tensor, fmt: str = "float",
                       page_table: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuild one layer's dense K (or V) cache from the group latent, RoPE applied, current-call tokens exact.

    Args:
        latent: (B, S_max, R_tot) float, or (B, S_max, row_bytes) uint8 for a quantized ``fmt``.
        basis_block: (Hkv, D, R_max) float, this layer's rows ``basis[:, j*D:(j+1)*D]`` of the group basis.
        offsets: Hkv+1 ints.
        cos_table, sin_table: (P_max, W) float, position-indexed (any tensors for rope_form 'none').
        slot_pos: (B, S_max) int32|int64, each slot's RoPE position (any tensor for 'none').
        rope_form: 'none' (values), 'rotate_half', 'interleaved' or 'complex'.
        rotary_dim: channels rotated, even, <= D (ignored for 'none').
        new: (B, Hkv, N, D) float, the exact tokens (post-RoPE keys, or values): this call's, and a recent
            window's when the store keeps one.
        slots: (N,) int32|int64, their slots; -1 marks an unused entry (kernels.reference.exact_slots).
        fmt: the latent's storage format.
        page_table: None, or (B, S_max / P) int for a paged latent (a page pool; see :func:`latent_append`).
    Returns:
        (B, Hkv, S_max, D) new.dtype, computed in fp32.
    Raises:
        CKVPShapeError: a shape, dtype, device or RoPE argument does not match the layout above (host tensors:
            also a page table entry out of range or a page mapped twice).
    Reference: kernels/reference.py::latent_reconstruct_ref
    """
    _check_latent_reconstruct(latent, basis_block, offsets, cos_table, sin_table, slot_pos, rope_form, rotary_dim,
                              new, slots, fmt, page_table)
    s_max = _logical_dims("latent_reconstruct", "latent", latent, page_table)[1]
    _check_slot_values("latent_reconstruct", slots, s_max, unused_ok=True)
    _check_page_values("latent_reconstruct", latent, page_table)
    out = ref.latent_reconstruct_ref(latent, basis_block, offsets, cos_table, sin_table, slot_pos, rope_form,
                                     rotary_dim, new, slots, fmt, page_table)
    return out.contiguous()  # the fake promises contiguous strides


@latent_reconstruct.register_fake
def _(latent, basis_block, offsets, cos_table, sin_table, slot_pos, rope_form, rotary_dim, new, slots, fmt="float",
      page_table=None):
    _check_latent_reconstruct(latent, basis_block, offsets, cos_table, sin_table, slot_pos, rope_form, rotary_dim,
                              new, slots, fmt, page_table)
    b, s_max = _logical_dims("latent_reconstruct", "latent", latent, page_table)
    return new.new_empty((b, basis_block.shape[-3], s_max, basis_block.shape[-2]))


@torch.library.custom_op(
    "ckvp::latent_attention",
    mutates_args=(),
    schema="(Tensor q, Tensor latent_k, Tensor latent_v, Tensor basis_k_block, Tensor basis_v_block, "
    "int[] k_offsets, int[] v_offsets, Tensor cos_table, Tensor sin_table, Tensor slot_pos, str rope_form, "
    "int rotary_dim, Tensor new_k, Tensor new_v, Tensor slots, Tensor? attn_mask, float scale, SymInt kv_len, "
    "str k_fmt=\"float\", str v_fmt=\"float\", Tensor? page_table=None) -> Tensor",
)
def latent_attention(q: torch.Tensor, latent_k: torch.Tensor, latent_v: torch.Tensor, basis_k_block: torch.Tensor,
                     basis_v_block: torch.Tensor, k_offsets: Sequence[int], v_offsets: Sequence[int],
                     cos_table: torch.Tensor, sin_table: torch.Tensor, slot_pos: torch.Tensor, rope_form: str,
                     rotary_dim: int, new_k: torch.Tensor, new_v: torch.Tensor, slots: torch.Tensor,
                     attn_mask: torch.Tensor | None, scale: float, kv_len: int, k_fmt: str = "float",
                     v_fmt: str = "float", page_table: torch.Tensor | None = None) -> torch.Tensor:
    """Attend over latent cache slots [0, kv_len): keys rebuilt with RoPE, values absorbed, new tokens exact.

    Args:
        q: (B, H, S, D) float, post-RoPE queries; query head i reads KV head i // (H/Hkv).
        latent_k, latent_v: (B, S_max, Rk_tot) / (B, S_max, Rv_tot) float, or uint8 rows of a quantized
            ``k_fmt`` / ``v_fmt``.
        basis_k_block, basis_v_block: (Hkv, D, Rk_max) / (Hkv, D, Rv_max) float, this layer's rows.
        k_offsets, v_offsets: Hkv+1 ints each.
        cos_table, sin_table, slot_pos, rope_form, rotary_dim: the keys' RoPE, as in
            :func:`latent_reconstruct`.
        new_k, new_v: (B, Hkv, N, D) float, the exact keys (post-RoPE) and values: this call's tokens, and a
            recent window's when the store keeps one (N may differ from S).
        slots: (N,) int32|int64, their slots, distinct and < kv_len; -1 marks an unused entry
            (kernels.reference.exact_slots).
        attn_mask: broadcastable to (B, H, S, kv_len), bool (True = attend) or additive float; None = no mask.
        scale: score scale (1/sqrt(D) for standard attention).
        kv_len: slots attended, 1 <= kv_len <= S_max.
        k_fmt, v_fmt: the latents' storage formats.
        page_table: None, or (B, S_max / P) int for paged latents: ``latent_k`` / ``latent_v`` are then page
            pools (N_pages + 1, P, W) sharing the table (see :func:`latent_append`); every slot < kv_len of every
            sequence must be mapped (an unmapped page reads as zero latents).
    Returns:
        (B, H, S, D) q.dtype, fp32 accumulation. Rows the mask removes entirely are 0, as in torch SDPA.
    Raises:
        CKVPShapeError: a shape, dtype, device, RoPE or mask argument does not match the layout above (host
            tensors: also a page table entry out of range or a page mapped twice).
    Reference: kernels/reference.py::latent_attention_ref
    """
    _check_latent_attention(q, latent_k, latent_v, basis_k_block, basis_v_block, k_offsets, v_offsets, cos_table,
                            sin_table, slot_pos, rope_form, rotary_dim, new_k, new_v, slots, attn_mask, scale, kv_len,
                            k_fmt, v_fmt, page_table)
    s_max = _logical_dims("latent_attention", "latent_k", latent_k, page_table)[1]
    _check_slot_values("latent_attention", slots, s_max, unused_ok=True, kv_len=kv_len)
    _check_page_values("latent_attention", latent_k, page_table)
    out = ref.latent_attention_ref(q, latent_k, latent_v, basis_k_block, basis_v_block, k_offsets, v_offsets,
                                   cos_table, sin_table, slot_pos, rope_form, rotary_dim, new_k, new_v, slots,
                                   attn_mask, scale, kv_len, k_fmt, v_fmt, page_table)
    return out.contiguous()  # the fake promises contiguous strides


@latent_attention.register_fake
def _(q, latent_k, latent_v, basis_k_block, basis_v_block, k_offsets, v_offsets, cos_table, sin_table, slot_pos,
      rope_form, rotary_dim, new_k, new_v, slots, attn_mask, scale, kv_len, k_fmt="float", v_fmt="float",
      page_table=None):
    _check_latent_attention(q, latent_k, latent_v, basis_k_block, basis_v_block, k_offsets, v_offsets, cos_table,
                            sin_table, slot_pos, rope_form, rotary_dim, new_k, new_v, slots, attn_mask, scale, kv_len,
                            k_fmt, v_fmt, page_table)
    return q.new_empty(q.shape)


def _check_online_basis_fit(basis, x, offsets, slots) -> None:
    op = "online_basis_fit"
    _expect_ndim(op, "basis", basis, 4, "(B, Hkv, G*D, R_max)")
    s = _check_slots(op, slots)
    b, hkv, gd, r_pad = basis.shape
    _expect_shape(op, "x", x, (b, hkv, s, gd), "(B, Hkv, S, G*D) from basis and slots")
    _expect_float(op, "basis", basis)
    _expect_float(op, "x", x)
    _check_offsets(op, "offsets", offsets, hkv, list(offsets)[-1] if len(offsets) else 0, r_pad)
    _expect_same_device(op, basis=basis, x=x, slots=slots)


@torch.library.custom_op("ckvp::online_basis_fit", mutates_args=("basis",),
                         schema="(Tensor(a!) basis, Tensor x, int[] offsets, Tensor slots) -> ()")
def online_basis_fit(basis: torch.Tensor, x: torch.Tensor, offsets: Sequence[int], slots: torch.Tensor) -> None:
    """Fit each sequence's latent basis from this call's tokens when the call starts the sequence (slot 0).

    Args:
        basis: (B, Hkv, G*D, R_max) float, per-sequence bases; mutated when ``slots`` holds slot 0.
        x: (B, Hkv, S, G*D) float, the group's stacked new pre-RoPE keys (or values), layer-major.
        offsets: Hkv+1 ints; head h keeps ``offsets[h+1] - offsets[h]`` eigenvectors.
        slots: (S,) int32|int64, the new tokens' slots.
    Returns:
        None; see :func:`~ckvp_compile.kernels.reference.online_basis_fit_ref` (decided on the device).
    Raises:
        CKVPShapeError: a shape, dtype or device does not match the layout above.
    Reference: kernels/reference.py::online_basis_fit_ref; xKV (Chang et al. 2025).
    """
    _check_online_basis_fit(basis, x, offsets, slots)
    ref.online_basis_fit_ref(basis, x, offsets, slots)


@online_basis_fit.register_fake
def _(basis, x, offsets, slots) -> None:
    _check_online_basis_fit(basis, x, offsets, slots)


def _check_window_append(window_k, window_v, window_slots, k, v, slots) -> None:
    op = "window_append"
    _expect_ndim(op, "window_k", window_k, 4, "(B, Hkv, W, D)")
    b, hkv, w, d = window_k.shape
    _expect_shape(op, "window_v", window_v, (b, hkv, w, d), "(B, Hkv, W, D) as window_k")
    _expect_shape(op, "window_slots", window_slots, (w,), "(W,) from window_k")
    s = _check_slots(op, slots)
    for name, t in (("k", k), ("v", v)):
        _expect_shape(op, name, t, (b, hkv, s, d), "(B, Hkv, S, D) from window_k and slots")
        _expect_float(op, name, t)
    _expect_float(op, "window_k", window_k)
    _expect_float(op, "window_v", window_v)
    if window_slots.dtype != torch.int64:
        _fail(op, f"window_slots must be int64, but got {window_slots.dtype}")
    _expect_same_device(op, window_k=window_k, window_v=window_v, window_slots=window_slots, k=k, v=v, slots=slots)


@torch.library.custom_op("ckvp::window_append", mutates_args=("window_k", "window_v", "window_slots"),
                         schema="(Tensor(a!) window_k, Tensor(b!) window_v, Tensor(c!) window_slots, Tensor k, "
                                "Tensor v, Tensor slots) -> ()")
def window_append(window_k: torch.Tensor, window_v: torch.Tensor, window_slots: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, slots: torch.Tensor) -> None:
    """Keep a call's most recent tokens exact: write them into a layer's dense recent-window ring (in place).

    Args:
        window_k, window_v: (B, Hkv, W, D) float, the ring (``LatentKVStore(recent_window=W)``); entry
            ``slot % W`` holds that slot's post-RoPE key / value.
        window_slots: (W,) int64, each entry's slot (-1: empty).
        k, v: (B, Hkv, S, D) float, the call's exact post-RoPE keys and values.
        slots: (S,) int32|int64, their slots; the last min(S, W) are kept (distinct modulo W).
    Returns:
        None; see :func:`~ckvp_compile.kernels.reference.window_append_ref` (plain indexing: no host sync, so it
        runs inside CUDA graphs on any device).
    Raises:
        CKVPShapeError: a shape, dtype or device does not match the layout above.
    Reference: kernels/reference.py::window_append_ref; the dense recent window of KIVI (Liu et al., 2024,
    arXiv:2402.02750).
    """
    _check_window_append(window_k, window_v, window_slots, k, v, slots)
    _check_slot_values("window_append", slots, 2**62)
    ref.window_append_ref(window_k, window_v, window_slots, k, v, slots)


@window_append.register_fake
def _(window_k, window_v, window_slots, k, v, slots) -> None:
    _check_window_append(window_k, window_v, window_slots, k, v, slots)


# ----------------------------------------------------------------------------------------- ALR-KVD residual


def _check_residual(op: str, resid: torch.Tensor, b: Any, s_max: Any, hkv: Any, d: Any, group_layers: int,
                    resid_fmt: str) -> None:
    """resid: (B, S_max, W) uint8 with W the row width of ``resid_fmt`` over G_g*Hkv segments of D."""
    from ..kernels.residual import residual_offsets

    try:
        rf = parse_latent_format(resid_fmt)
    except ValueError as e:
        _fail(op, str(e))
    if not rf.quantized:
        _fail(op, f"resid_fmt must be a quantized format (e.g. 'int2/64'), but got {resid_fmt!r}")
    if group_layers < 1:
        _fail(op, f"group_layers must be >= 1, but got {group_layers}")
    width = rf.row_width(residual_offsets(group_layers, hkv, d))
    _expect_shape(op, "resid", resid, (b, s_max, width), f"(B, S_max, W) with W = {width} ({rf.name} rows of "
                  f"G_g*Hkv = {group_layers}*{hkv} segments of D = {d})")
    if resid.dtype != torch.uint8:
        _fail(op, f"resid must be uint8, but got {resid.dtype}")


def _check_residual_append(resid, latent, x, basis, offsets, slots, fmt, resid_fmt, group_layers) -> None:
    _check_latent_append(latent, x, basis, offsets, slots, fmt)
    op = "residual_append"
    gd = x.shape[-1]
    if group_layers < 1 or gd % group_layers:
        _fail(op, f"group_layers {group_layers} must divide G*D = {gd} (x.shape[-1])")
    _check_residual(op, resid, latent.shape[0], latent.shape[1], x.shape[1], gd // group_layers, group_layers,
                    resid_fmt)
    _expect_same_device(op, resid=resid, latent=latent)


@torch.library.custom_op(
    "ckvp::residual_append",
    mutates_args=("resid",),
    schema="(Tensor(a!) resid, Tensor latent, Tensor x, Tensor basis, int[] offsets, Tensor slots, str fmt, "
    "str resid_fmt, int group_layers) -> ()",
)
def residual_append(resid: torch.Tensor, latent: torch.Tensor, x: torch.Tensor, basis: torch.Tensor,
                    offsets: Sequence[int], slots: torch.Tensor, fmt: str, resid_fmt: str, group_layers: int) -> None:
    """Write the ALR-KVD residual of the new tokens: ``x - P dequant(latent)`` quantized in ``resid_fmt``.

    Args:
        resid: (B, S_max, W) uint8 (:mod:`ckvp_compile.kernels.residual` layout); mutated at ``resid[:, slots]``.
        latent, x, basis, offsets, slots, fmt: as :func:`latent_append`, called after it (``latent`` already
            holds the new tokens' rows).
        resid_fmt: the residual's quantized format (e.g. ``"int2/64"``).
        group_layers: G_g, layers in the group.
    Returns:
        None.
    Raises:
        CKVPShapeError: a shape, dtype, device or format does not match the layouts.
    Reference: kernels/residual.py::residual_append_ref
    """
    from ..kernels.residual import residual_append_ref

    _check_residual_append(resid, latent, x, basis, offsets, slots, fmt, resid_fmt, group_layers)
    residual_append_ref(resid, latent, x, basis, offsets, slots, fmt, resid_fmt, group_layers)


@residual_append.register_fake
def _(resid, latent, x, basis, offsets, slots, fmt, resid_fmt, group_layers) -> None:
    _check_residual_append(resid, latent, x, basis, offsets, slots, fmt, resid_fmt, group_layers)


def _check_reconstruct_residual(latent, basis_block, offsets, cos_table, sin_table, slot_pos, rope_form, rotary_dim,
                                new, slots, fmt, resid, layer, group_layers, resid_fmt) -> None:
    _check_latent_reconstruct(latent, basis_block, offsets, cos_table, sin_table, slot_pos, rope_form, rotary_dim,
                              new, slots, fmt)
    op = "latent_reconstruct_residual"
    if not 0 <= layer < group_layers:
        _fail(op, f"layer must be in [0, group_layers = {group_layers}), but got {layer}")
    _check_residual(op, resid, latent.shape[0], latent.shape[1], basis_block.shape[-3], basis_block.shape[-2],
                    group_layers, resid_fmt)
    _expect_same_device(op, resid=resid, latent=latent)


@torch.library.custom_op(
    "ckvp::latent_reconstruct_residual",
    mutates_args=(),
    schema="(Tensor latent, Tensor basis_block, int[] offsets, Tensor cos_table, Tensor sin_table, "
    "Tensor slot_pos, str rope_form, int rotary_dim, Tensor new, Tensor slots, str fmt, Tensor resid, int layer, "
    "int group_layers, str resid_fmt) -> Tensor",
)
def latent_reconstruct_residual(latent: torch.Tensor, basis_block: torch.Tensor, offsets: Sequence[int],
                                cos_table: torch.Tensor, sin_table: torch.Tensor, slot_pos: torch.Tensor,
                                rope_form: str, rotary_dim: int, new: torch.Tensor, slots: torch.Tensor, fmt: str,
                                resid: torch.Tensor, layer: int, group_layers: int, resid_fmt: str) -> torch.Tensor:
    """:func:`latent_reconstruct` plus layer ``layer``'s ALR-KVD residual, added before RoPE.

    Args:
        latent .. fmt: as :func:`latent_reconstruct`.
        resid: (B, S_max, W) uint8, the group's residual rows. layer: j in [0, group_layers).
        group_layers: G_g. resid_fmt: the residual's format.
    Returns:
        (B, Hkv, S_max, D) new.dtype, computed in fp32.
    Raises:
        CKVPShapeError: a shape, dtype, device, RoPE or format argument does not match the layouts.
    Reference: kernels/residual.py::latent_reconstruct_residual_ref
    """
    from ..kernels.residual import latent_reconstruct_residual_ref

    _check_reconstruct_residual(latent, basis_block, offsets, cos_table, sin_table, slot_pos, rope_form, rotary_dim,
                                new, slots, fmt, resid, layer, group_layers, resid_fmt)
    return latent_reconstruct_residual_ref(latent, basis_block, offsets, cos_table, sin_table, slot_pos, rope_form,
                                           rotary_dim, new, slots, fmt, resid, layer, group_layers,
                                           resid_fmt).contiguous()


@latent_reconstruct_residual.register_fake
def _(latent, basis_block, offsets, cos_table, sin_table, slot_pos, rope_form, rotary_dim, new, slots, fmt, resid,
      layer, group_layers, resid_fmt):
    _check_reconstruct_residual(latent, basis_block, offsets, cos_table, sin_table, slot_pos, rope_form, rotary_dim,
                                new, slots, fmt, resid, layer, group_layers, resid_fmt)
    return new.new_empty((latent.shape[0], basis_block.shape[-3], latent.shape[1], basis_block.shape[-2]))


#: The ops this module defines, by name.
OPS = {
    "window_append": window_append,
    "residual_append": residual_append,
    "latent_reconstruct_residual": latent_reconstruct_residual,
    "online_basis_fit": online_basis_fit,
    "latent_append": latent_append,
    "rope_table_update": rope_table_update,
    "latent_reconstruct": latent_reconstruct,
    "latent_attention": latent_attention,
}
