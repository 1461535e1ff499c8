"""Pure-PyTorch twins of the ckvp kernels: the math every kernel, op and test is checked against.

This module imports torch only (no Triton): the CPU path, the tests and the benchmarks all use it.

Latent KV notation (DESIGN.md, "CKVP in numbers"). A group of ``G`` layers, ``Hkv`` KV heads of dim ``D``,
``H`` query heads (``H % Hkv == 0``), batch ``B``, ``S`` new tokens, ``S_max`` cache slots. For KV head ``h``
the group stacks the ``G`` layers' pre-RoPE keys of one token, ``x_t`` in R^(G*D), and keeps only the latent
``z_t = P_h^T x_t`` in R^(r_h), ``P_h`` an orthonormal (G*D, r_h) basis. Layer ``j`` rebuilds its key from its
row block, ``P_h[j*D:(j+1)*D] z_t``, then applies RoPE at the token's position. Values likewise, without RoPE.

Packed layout shared by every function here:

==============  ===========================================================================================
``latent``      (B, S_max, R_tot) any float dtype; KV head ``h`` owns columns ``offsets[h]:offsets[h+1]``;
                or (B, S_max, row_bytes) uint8 in a quantized ``fmt`` (:mod:`.latent_format`)
``offsets``     Hkv+1 non-decreasing ints, ``offsets[0] == 0``, ``R_tot = offsets[-1]``; ``r_h`` its width
``basis``       (Hkv, G*D, R_max), zero beyond each head's rank (columns ``r_h:`` of head ``h``); or
                (B, Hkv, G*D, R_max), one basis per sequence (online bases)
``basis_block`` (Hkv, D, R_max), layer ``j``'s rows ``basis[:, j*D:(j+1)*D, :]`` (or (B, Hkv, D, R_max))
``cos_table``   (P_max, W) indexed by RoPE *position*; ``W`` per :func:`rope_table_width`
``slot_pos``    (B, S_max) int32, the RoPE position of every cache slot of every sequence
``page_table``  optional, (B, S_max / P) int32: a *paged* latent is a pool (N_pages + 1, P, W) of pages of P slots
                and slot ``t`` of sequence ``b`` lives at ``pool[page_table[b, t // P], t % P]``; -1 marks an
                unmapped page, read as zero rows; writes to unmapped slots land in the last (trash) page, which
                no mapped slot reads (vLLM's PagedAttention layout, Kwon et al., SOSP 2023)
==============  ===========================================================================================

RoPE forms (``apply_rope_ref``), each over the first ``rotary_dim`` channels, the rest passing through:

* ``rotate_half`` (HF / Llama): ``x*cos + cat(-x2, x1)*sin`` with ``x1, x2`` the halves; tables of width
  ``rotary_dim`` (HF's ``cat(freqs, freqs)``).
* ``interleaved`` (GPT-J): pairs ``(x0, x1), (x2, x3), ...`` rotated, ``x*cos + stack(-x_odd, x_even)*sin``;
  tables of width ``rotary_dim`` with each frequency repeated twice (``f0, f0, f1, f1, ...``), as GPT-J's
  ``duplicate_interleave`` makes them. Tables of width ``rotary_dim/2`` are not accepted: repeat them first.
* ``complex`` (gpt-fast / Meta): pairs as complex numbers times ``cos + i*sin``; tables of width
  ``rotary_dim/2`` (the real and imaginary parts of ``freqs_cis``).
* ``none``: identity (values).

All math runs in fp32; results are cast to the documented dtype at the end.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from .device_cache import check_not_capturing
from .latent_format import dequantize_latent_ref, parse_latent_format, quantize_latent_ref

__all__ = [
    "ROPE_FORMS",
    "apply_rope_ref",
    "latent_append_ref",
    "latent_attention_from_scores_ref",
    "latent_attention_ref",
    "latent_reconstruct_ref",
    "latent_scores_ref",
    "online_basis_fit_ref",
    "paged_gather",
    "paged_rows",
    "rope_table_update_ref",
    "rope_table_width",
    "sdpa_ref",
    "unpack_latent_ref",
]

#: RoPE forms the latent ops understand ('none' for values).
ROPE_FORMS = ("none", "rotate_half", "interleaved", "complex")


def rope_table_width(form: str, rotary_dim: int) -> int:
    """Return the width W of the cos/sin tables of a RoPE form (0 for 'none')."""
    if form == "none":
        return 0
    if form in ("rotate_half", "interleaved"):
        return rotary_dim
    if form == "complex":
        return rotary_dim // 2
    raise ValueError(f"rope form must be one of {ROPE_FORMS}, but got {form!r}")


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, form: str, rotary_dim: int) -> torch.Tensor:
    """Apply rotary position embedding to the first ``rotary_dim`` channels of ``x``, as the model does.

    Args:
        x: (..., D) float.
        cos, sin: broadcastable to (..., W), W = :func:`rope_table_width` (form, rotary_dim).
        form: one of :data:`ROPE_FORMS`.
        rotary_dim: channels rotated, even, <= D; channels ``rotary_dim:`` pass through.
    Returns:
        (..., D) in the promoted dtype of ``x``, ``cos`` and ``sin``.
    """
    if form == "none":
        return x
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if form == "rotate_half":
        x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]
        out = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    elif form == "interleaved":
        x_even, x_odd = rot[..., 0::2], rot[..., 1::2]
        out = rot * cos + torch.stack((-x_odd, x_even), dim=-1).flatten(-2) * sin
    elif form == "complex":
        x_even, x_odd = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x_even * cos - x_odd * sin, x_odd * cos + x_even * sin), dim=-1).flatten(-2)
    else:
        raise ValueError(f"rope form must be one of {ROPE_FORMS}, but got {form!r}")
    return torch.cat((out, rest.to(out.dtype)), dim=-1)


def _head_columns(offsets: Sequence[int], r_pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (idx, valid), both (Hkv, r_pad): latent column of head h's j-th latent coordinate, and j < r_h."""
    return _head_columns_cached(tuple(int(o) for o in offsets), int(r_pad), str(device))


@functools.lru_cache(maxsize=256)
def _head_columns_cached(offsets: tuple[int, ...], r_pad: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_head_columns`, built once per layout and device (no host-to-device copy per decode step)."""
    check_not_capturing("the per-head latent column table", device)
    off = torch.tensor(offsets, dtype=torch.long, device=device)
    j = torch.arange(r_pad, device=device)
    valid = j[None, :] < (off[1:] - off[:-1])[:, None]
    idx = torch.where(valid, off[:-1, None] + j[None, :], torch.zeros_like(valid, dtype=torch.long))
    return idx, valid


def _packed_columns(offsets: Sequence[int], r_pad: int, device: torch.device) -> torch.Tensor:
    """(R_tot,) long: for packed latent column c (head h, coordinate j = c - offsets[h]), its index ``h * r_pad + j``
    in the per-head zero-padded (Hkv * r_pad) layout; i.e. ``valid.flatten().nonzero()`` of :func:`_head_columns`,
    computed on the host from the offsets and cached per layout and device.

    Gathering with it replaces boolean-mask indexing (``z[..., valid.flatten()]``), which is a data-dependent
    ``nonzero``: a host synchronisation, not permitted while a CUDA graph is captured (the reduce-overhead
    recording of ckvp::latent_append failed there on the H200, benchmarks/results/2026-11-29-reliability-h200/run4).
    """
    return _packed_columns_cached(tuple(int(o) for o in offsets), int(r_pad), str(device))


@functools.lru_cache(maxsize=256)
def _packed_columns_cached(offsets: tuple[int, ...], r_pad: int, device: str) -> torch.Tensor:
    """:func:`_packed_columns`, built once per layout and device (prepared with the store's tables:
    :func:`~ckvp_compile.kernels.device_cache.prepare_device_tables`)."""
    check_not_capturing("the packed latent column index", device)
    cols = [h * r_pad + j for h, (a, b) in enumerate(zip(offsets, offsets[1:])) for j in range(b - a)]
    return torch.tensor(cols, dtype=torch.long).to(device)


def unpack_latent_ref(latent: torch.Tensor, offsets: Sequence[int], r_pad: int, fmt: str = "float") -> torch.Tensor:
    """Split the packed latent into per-head, zero-padded coordinates.

    Args:
        latent: (B, T, R_tot) float, packed as described in the module docstring; or (B, T, row_bytes) uint8
            in a quantized ``fmt`` (:mod:`ckvp_compile.kernels.latent_format`), dequantized first.
        offsets: Hkv+1 ints.
        r_pad: padded rank R_max (>= every r_h).
        fmt: the latent's storage format.
    Returns:
        (B, Hkv, T, r_pad) fp32, zero in columns ``r_h:`` of head ``h``.
    """
    if parse_latent_format(fmt).quantized:
        latent = dequantize_latent_ref(latent, offsets, fmt)
    b, t = latent.shape[:2]
    hkv = len(offsets) - 1
    if latent.shape[-1] == 0 or r_pad == 0:
        return latent.new_zeros((b, hkv, t, r_pad), dtype=torch.float32)
    idx, valid = _head_columns(offsets, r_pad, latent.device)
    z = latent[..., idx.flatten()].float().view(b, t, hkv, r_pad)
    z = torch.where(valid[None, None], z, 0.0)  # other heads' columns (or NaN) never leak in
    return z.permute(0, 2, 1, 3)


def latent_append_ref(
    latent: torch.Tensor, x: torch.Tensor, basis: torch.Tensor, offsets: Sequence[int], slots: torch.Tensor,
    fmt: str = "float", page_table: torch.Tensor | None = None,
) -> None:
    """Project the group's stacked new keys (or values) onto each head's basis and store them in the latent.

    Args:
        latent: (B, S_max, R_tot) float, written in place at ``latent[:, slots]``.
        x: (B, Hkv, S, G*D) float, the G layers' pre-RoPE keys of the new tokens, layer-major.
        basis: (Hkv, G*D, R_max) float, orthonormal columns, zero beyond each head's rank.
        offsets: Hkv+1 ints, head h owns latent columns offsets[h]:offsets[h+1].
        slots: (S,) int, distinct cache slots of the new tokens.
        fmt: the latent's storage format; a quantized one takes a uint8 (B, S_max, row_bytes) latent.
        page_table: optional (B, S_max / P) int; then ``latent`` is a page pool (N_pages + 1, P, W).
    Returns:
        None. ``latent[:, slots, offsets[h]:offsets[h+1]] = x[:, h] @ basis[h, :, :r_h]`` in fp32, cast to
        latent.dtype (or quantized per :func:`~ckvp_compile.kernels.latent_format.quantize_latent_ref`).
    """
    latent_append_with(latent, x, basis, offsets, slots, fmt, quantize_latent_ref, page_table)


def paged_rows(page_table: torch.Tensor, slots: torch.Tensor, page_size: int, trash_page: int) -> torch.Tensor:
    """Flat row indices into a page pool viewed as (N_pages + 1) * P rows.

    Args:
        page_table: (B, S_max / P) int32|int64, physical page of each logical page, -1 = unmapped.
        slots: (S,) int, logical slots (< S_max).
        page_size: P, slots per page. trash_page: the pool's last page index (N_pages), where unmapped slots go.
    Returns:
        (B, S) int64: ``page * P + slot % P`` with page = ``page_table[b, slot // P]`` (``trash_page`` when -1).
    """
    s = slots.long()
    page = page_table.long().index_select(1, s // page_size)
    page = torch.where(page >= 0, page, torch.full_like(page, trash_page))
    return page * page_size + (s % page_size)[None, :]


def paged_gather(pool: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """The contiguous (B, S_max, W) latent a page pool stands for (reads only; unmapped pages read as zeros).

    Args:
        pool: (N_pages + 1, P, W), any dtype (float latents or uint8 rows). page_table: (B, S_max / P) int.
    Returns:
        (B, S_max, W) pool.dtype with S_max = page_table.shape[1] * P; a copy.
    """
    b, n = page_table.shape
    p = pool.shape[1]
    pages = page_table.long()
    rows = pool.index_select(0, pages.clamp(min=0).reshape(-1)).reshape(b, n * p, pool.shape[2])
    mapped = (pages >= 0).repeat_interleave(p, dim=1, output_size=n * p)  # (B, S_max)
    return torch.where(mapped[..., None], rows, torch.zeros((), dtype=pool.dtype, device=pool.device))


def latent_append_with(latent: torch.Tensor, x: torch.Tensor, basis: torch.Tensor, offsets: Sequence[int],
                       slots: torch.Tensor, fmt: str, quantize, page_table: torch.Tensor | None = None) -> None:
    """:func:`latent_append_ref` with ``quantize(packed, offsets, fmt) -> rows`` as the quantizer (the CUDA kernel
    of ``ckvp::latent_append`` passes the bit-equal Triton one); with ``page_table``, ``latent`` is a page pool
    (module docstring) and the rows go to their pages."""
    b, hkv, s, _ = x.shape
    r_pad = basis.shape[-1]
    eq = "bhsk,bhkr->bshr" if basis.dim() == 4 else "bhsk,hkr->bshr"
    z = torch.einsum(eq, x.float(), basis.float())  # (B, S, Hkv, R_max)
    # (B, S, R_tot): head-major, as the layout. A cached integer gather, not a boolean mask (a host sync, which
    # broke CUDA-graph capture of this op on the H200)
    packed = z.reshape(b, s, hkv * r_pad).index_select(-1, _packed_columns(offsets, r_pad, latent.device))
    if parse_latent_format(fmt).quantized:
        packed = quantize(packed, offsets, fmt)
    if page_table is None:
        latent[:, slots.long()] = packed.to(latent.dtype)
        return
    rows = paged_rows(page_table, slots, latent.shape[1], latent.shape[0] - 1).reshape(-1)  # (B * S,)
    p = latent.shape[1]  # by (page, row in page): any layout of the pool (kernels.latent_layout)
    latent.index_put_((rows // p, rows % p), packed.to(latent.dtype).reshape(b * s, -1))


def online_basis_fit_ref(basis: torch.Tensor, x: torch.Tensor, offsets: Sequence[int], slots: torch.Tensor) -> None:
    """Fit each sequence's basis from its own tokens, when the call starts the sequence (online bases).

    Args:
        basis: (B, Hkv, G*D, R_max) float, mutated in place when ``slots`` holds slot 0.
        x: (B, Hkv, S, G*D) float, the group's stacked new pre-RoPE keys (or values) of this call.
        offsets: Hkv+1 ints; head h keeps the top ``r_h = offsets[h+1] - offsets[h]`` eigenvectors.
        slots: (S,) int, the new tokens' slots.
    Returns:
        None. When ``min(slots) == 0``: ``basis[b, h, :, :r_h]`` = the top-r_h eigenvectors (descending
        eigenvalues, each vector's largest-magnitude entry positive) of ``x[b, h]^T x[b, h]``, zero beyond
        r_h; otherwise unchanged. Decided on the device (``torch.where``), without a host synchronisation.
    Source: xKV (Chang et al. 2025), per-prompt SVD of the stacked cross-layer keys.
    """
    xf = x.float()
    moment = torch.einsum("bhsk,bhsl->bhkl", xf, xf)
    _, evecs = torch.linalg.eigh(moment)  # ascending
    evecs = evecs.flip(-1)[..., : basis.shape[-1]]
    idx = evecs.abs().argmax(dim=-2, keepdim=True)
    evecs = evecs * torch.sign(torch.gather(evecs, -2, idx)).clamp_min(0).mul(2).sub(1)
    _, keep = _head_columns(offsets, basis.shape[-1], basis.device)  # (Hkv, R_max): j < r_h
    fitted = torch.where(keep[None, :, None, :], evecs, 0.0).to(basis.dtype)
    first = slots.min() == 0
    basis.copy_(torch.where(first, fitted, basis))


def rope_table_update_ref(
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    slot_pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Record the model's RoPE tables at the new tokens' positions and each new slot's position.

    Args:
        cos_table, sin_table: (P_max, W) float, written in place at rows ``position_ids``.
        slot_pos: (B, S_max) int32, written in place at columns ``slots``.
        cos, sin: (B or 1, S, W) float, the model's tables for the new tokens.
        position_ids: (B or 1, S) int, the new tokens' RoPE positions (< P_max).
        slots: (S,) int, the new tokens' cache slots.
    Returns:
        None. ``cos_table[position_ids] = cos``, ``sin_table[position_ids] = sin``,
        ``slot_pos[:, slots] = position_ids``. The tables are a model constant per position, so the batch row
        that writes a shared position does not matter.
    """
    bp = max(cos.shape[0], sin.shape[0], position_ids.shape[0])
    s, w = cos.shape[1], cos.shape[2]
    pos = position_ids.long().expand(bp, s)
    cos_table[pos] = cos.expand(bp, s, w).to(cos_table.dtype)
    sin_table[pos] = sin.expand(bp, s, w).to(sin_table.dtype)
    slot_pos[:, slots.long()] = position_ids.to(slot_pos.dtype).expand(slot_pos.shape[0], s)


def exact_slots(slots: torch.Tensor, n_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where a call's exact tokens go, without a host synchronisation (CUDA graphs).

    Args:
        slots: (N,) int, the exact tokens' cache slots; ``-1`` (any negative value) marks an unused entry, e.g. a
            recent-window ring that is not full yet (:class:`~ckvp_compile.runtime.store.LatentKVStore`'s
            ``recent_window``). The used ones are distinct and < ``n_slots``.
        n_slots: the slots attended (kv_len, or S_max).
    Returns:
        ``(valid, idx, taken)``: (N,) bool, the entry is used; (N,) int64, its slot, or the scratch slot
        ``n_slots`` just past the end for an unused entry (callers pad their slot axis by one and drop it);
        (n_slots,) bool, the slot holds an exact token (its latent row is not attended).
    """
    s = slots.long()
    valid = s >= 0
    idx = torch.where(valid, s, n_slots)
    # index_fill_, not ``taken[idx] = True``: a Python value assigned by indexing is copied from the host, which
    # CUDA graph capture refuses
    taken = torch.zeros(n_slots + 1, dtype=torch.bool, device=slots.device).index_fill_(0, idx, True)
    return valid, idx, taken[:n_slots]


def window_append_ref(window_k: torch.Tensor, window_v: torch.Tensor, window_slots: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write a call's tokens into a layer's dense recent-window ring, in place, without a host synchronisation.

    Args:
        window_k, window_v: (B, Hkv, W, D) float, the ring: entry ``slot % W`` holds the token of that slot.
        window_slots: (W,) int64, each entry's slot (-1: empty).
        k, v: (B, Hkv, S, D) float, the call's exact post-RoPE keys and values.
        slots: (S,) int, their slots. Only the last ``min(S, W)`` are kept (the most recent ones, when the slots
            increase as a static cache writes them); those must be distinct modulo W (consecutive slots are).
    Returns:
        None. Entries of older tokens stay until a later slot of the same residue replaces them; attention keeps
        only entries below the current call's first slot (see the ``recent_window`` rewrite in
        ``passes/latent_kv_cache.py``), so a rewound sequence never reads the tokens it abandoned.
    """
    w = window_k.shape[2]
    n = min(w, slots.shape[0])
    last = slots[slots.shape[0] - n:].long()
    ring = torch.remainder(last, w)
    window_k[:, :, ring] = k[:, :, k.shape[2] - n:].to(window_k.dtype)
    window_v[:, :, ring] = v[:, :, v.shape[2] - n:].to(window_v.dtype)
    window_slots[ring] = last


def _pad_slot(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with one zero slot appended along ``dim`` (the scratch slot of :func:`exact_slots`)."""
    shape = list(x.shape)
    shape[dim] = 1
    return torch.cat((x, x.new_zeros(shape)), dim)


def _mask_with_scratch(attn_mask: torch.Tensor | None, b: int, h: int, s: int, kv_len: int,
                       device: torch.device) -> torch.Tensor:
    """``attn_mask`` (broadcastable to (B, H, S, kv_len)) with the scratch slot's column appended, masked out."""
    if attn_mask is None:
        return torch.arange(kv_len + 1, device=device) < kv_len
    m = attn_mask.expand(b, h, s, kv_len)
    if m.dtype == torch.bool:
        return torch.cat((m, m.new_zeros(b, h, s, 1)), -1)
    return torch.cat((m, m.new_full((b, h, s, 1), float("-inf"))), -1)


def _rebuild(
    latent: torch.Tensor,
    basis_block: torch.Tensor,
    offsets: Sequence[int],
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    slot_pos: torch.Tensor,
    rope_form: str,
    rotary_dim: int,
    fmt: str = "float",
) -> torch.Tensor:
    """(B, Hkv, T, D) fp32: every slot of ``latent`` (B, T, R_tot) rebuilt and rotated at ``slot_pos`` (B, T)."""
    z = unpack_latent_ref(latent, offsets, basis_block.shape[-1], fmt)  # (B, Hkv, T, R_max)
    pre = torch.einsum("bhtr,bhdr->bhtd" if basis_block.dim() == 4 else "bhtr,hdr->bhtd", z, basis_block.float())
    if rope_form == "none":
        return pre
    pos = slot_pos.long()
    cos = cos_table.float()[pos][:, None]  # (B, 1, T, W)
    sin = sin_table.float()[pos][:, None]
    return apply_rope_ref(pre, cos, sin, rope_form, rotary_dim)


def latent_reconstruct_ref(
    latent: torch.Tensor,
    basis_block: torch.Tensor,
    offsets: Sequence[int],
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    slot_pos: torch.Tensor,
    rope_form: str,
    rotary_dim: int,
    new: torch.Tensor,
    slots: torch.Tensor,
    fmt: str = "float",
    page_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rebuild one layer's dense cache from the group latent, with RoPE, current-call tokens exact.

    Args:
        latent: (B, S_max, R_tot) float.
        basis_block: (Hkv, D, R_max) float, this layer's rows of the group basis.
        offsets: Hkv+1 ints.
        cos_table, sin_table: (P_max, W) float, position-indexed (ignored for rope_form 'none').
        slot_pos: (B, S_max) int, RoPE position of every slot (values < P_max; ignored for 'none').
        rope_form: one of :data:`ROPE_FORMS`.
        rotary_dim: channels rotated (ignored for 'none').
        new: (B, Hkv, N, D) float, exact tokens (post-RoPE for keys): this call's, and a recent window's.
        slots: (N,) int, their slots; -1 marks an unused entry (see :func:`exact_slots`).
        fmt: the latent's storage format (see :func:`unpack_latent_ref`).
        page_table: optional (B, S_max / P) int; then ``latent`` is a page pool (module docstring).
    Returns:
        (B, Hkv, S_max, D) new.dtype: ``RoPE(latent_h @ basis_block[h, :, :r_h]^T)`` per head and slot, with
        the used ``slots`` replaced by ``new``.
    """
    if page_table is not None:
        latent = paged_gather(latent, page_table)
    out = _rebuild(latent, basis_block, offsets, cos_table, sin_table, slot_pos, rope_form, rotary_dim, fmt)
    _, idx, _ = exact_slots(slots, out.shape[2])  # unused entries land in the scratch slot, dropped
    out = _pad_slot(out, 2)
    out[:, :, idx] = new.float()
    return out[:, :, :-1].to(new.dtype)


def _attention_weights(
    q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """(B, Hkv, H/Hkv, S, T) fp32 softmax weights of q (B, H, S, D) over k (B, Hkv, T, D), GQA by grouping.

    A row that the mask removes entirely gets weight 0 everywhere, as torch SDPA's math path does.
    """
    b, h, s, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    qf = q.float().reshape(b, hkv, h // hkv, s, d)
    scores = torch.einsum("bgrsd,bgtd->bgrst", qf, k.float()) * scale
    if attn_mask is not None:
        mask = attn_mask.expand(b, h, s, t).reshape(b, hkv, h // hkv, s, t)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
    weights = torch.softmax(scores, dim=-1)
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)
    return torch.where(dead, 0.0, weights)


def sdpa_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Dense scaled-dot-product attention with GQA, the baseline the latent attention approximates.

    Args:
        q: (B, H, S, D) float.
        k, v: (B, Hkv, T, D) float, H % Hkv == 0; query head i reads KV head i // (H/Hkv).
        attn_mask: broadcastable to (B, H, S, T): bool (True = attend) or additive float; None = no mask.
        scale: score scale, default 1/sqrt(D).
    Returns:
        (B, H, S, D) q.dtype, computed in fp32.
    """
    b, h, s, d = q.shape
    scale = d**-0.5 if scale is None else scale
    w = _attention_weights(q, k, attn_mask, scale)
    out = torch.einsum("bgrst,bgtd->bgrsd", w, v.float())
    return out.reshape(b, h, s, d).to(q.dtype)


def latent_attention_ref(
    q: torch.Tensor,
    latent_k: torch.Tensor,
    latent_v: torch.Tensor,
    basis_k_block: torch.Tensor,
    basis_v_block: torch.Tensor,
    k_offsets: Sequence[int],
    v_offsets: Sequence[int],
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    slot_pos: torch.Tensor,
    rope_form: str,
    rotary_dim: int,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    slots: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
    kv_len: int,
    k_fmt: str = "float",
    v_fmt: str = "float",
    page_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attend over cache slots [0, kv_len) of the latent K/V, values absorbed, current-call tokens exact.

    Args:
        q: (B, H, S, D) float, post-RoPE queries.
        latent_k, latent_v: (B, S_max, Rk_tot) / (B, S_max, Rv_tot) float.
        basis_k_block, basis_v_block: (Hkv, D, Rk_max) / (Hkv, D, Rv_max) float, this layer's rows.
        k_offsets, v_offsets: Hkv+1 ints each.
        cos_table, sin_table, slot_pos, rope_form, rotary_dim: the keys' RoPE, as in
            :func:`latent_reconstruct_ref`.
        new_k, new_v: (B, Hkv, N, D) float, the exact keys (post-RoPE) and values: this call's tokens, and those
            of a recent window kept dense (N may differ from S).
        slots: (N,) int, their slots, distinct and < kv_len; -1 marks an unused entry (see :func:`exact_slots`).
        attn_mask: broadcastable to (B, H, S, kv_len), bool (True = attend) or additive float, or None.
        scale: score scale.
        kv_len: slots attended, 1 <= kv_len <= S_max.
        k_fmt, v_fmt: the latents' storage formats (see :func:`unpack_latent_ref`).
        page_table: optional (B, S_max / P) int; then ``latent_k`` / ``latent_v`` are page pools (module
            docstring), read through the table (only the pages below kv_len).
    Returns:
        (B, H, S, D) q.dtype, fp32 accumulation. With ``w`` the softmax weights, latent slots contribute
        ``(w_past @ latent_v_h) @ basis_v_block[h, :, :r_h]^T`` (value absorption: the dense values are never
        formed) and the exact tokens' slots contribute ``w_exact @ new_v``.
    """
    b, h, s, d = q.shape
    if page_table is not None:
        used = page_table[:, :-(-kv_len // latent_k.shape[1])]  # the pages holding slots < kv_len
        latent_k, latent_v = paged_gather(latent_k, used), paged_gather(latent_v, used)
    valid, idx, taken = exact_slots(slots, kv_len)
    new_k = new_k.float().masked_fill(~valid[:, None], 0.0)  # unused entries are never read (NaN-safe)
    new_v = new_v.float().masked_fill(~valid[:, None], 0.0)
    k = _rebuild(latent_k[:, :kv_len], basis_k_block, k_offsets, cos_table, sin_table, slot_pos[:, :kv_len],
                 rope_form, rotary_dim, k_fmt)
    k = _pad_slot(k, 2)  # the scratch slot of unused entries: masked out below
    k[:, :, idx] = new_k.float()
    mask = _mask_with_scratch(attn_mask, b, h, s, kv_len, q.device)
    w = _attention_weights(q, k, mask, scale)  # (B, Hkv, G, S, kv_len + 1)
    zv = unpack_latent_ref(latent_v[:, :kv_len], v_offsets, basis_v_block.shape[-1], v_fmt)  # (B, Hkv, kv_len, Rv)
    zv = zv.masked_fill(taken[:, None], 0.0)  # the exact tokens' slots come from new_v below
    absorbed = torch.einsum("bgrst,bgtk->bgrsk", w[..., :kv_len], zv)  # (B, Hkv, G, S, Rv): per query head
    eq = "bgrsk,bgdk->bgrsd" if basis_v_block.dim() == 4 else "bgrsk,gdk->bgrsd"
    out = torch.einsum(eq, absorbed, basis_v_block.float())
    out = out + torch.einsum("bgrsn,bgnd->bgrsd", w[..., idx], new_v.float())
    return out.reshape(b, h, s, d).to(q.dtype)


#: log2(e): the two-pass form keeps scores in log2 units (softmax by exp2, as the kernels compute it)
LOG2E = 1.4426950408889634


def _mask_scores(sc: torch.Tensor, attn_mask: torch.Tensor | None, cols: torch.Tensor | None, b: int, hkv: int,
                 g: int, s: int, kv_len: int) -> torch.Tensor:
    """Apply ``attn_mask`` (broadcastable to (B, H, S, kv_len)) to log2-unit scores (B, Hkv, S, G, N) whose N
    columns are mask columns ``cols`` (None: all kv_len)."""
    if attn_mask is None:
        return sc
    m = attn_mask.expand(b, hkv * g, s, kv_len)
    if cols is not None:
        m = m[..., cols]
    m = m.reshape(b, hkv, g, s, -1).transpose(2, 3)
    if m.dtype == torch.bool:
        return sc.masked_fill(~m, float("-inf"))
    m = m.float()  # finite values clamped so that finfo(float32).min stays finite in log2 units (as the kernels)
    return sc + torch.where(m == float("-inf"), m, m.clamp_min(-2.3e38)) * LOG2E


def latent_scores_ref(
    q: torch.Tensor,
    latent_k: torch.Tensor,
    basis_k_block: torch.Tensor,
    k_offsets: Sequence[int],
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    slot_pos: torch.Tensor,
    rope_form: str,
    rotary_dim: int,
    slots: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
    kv_len: int,
    k_fmt: str = "float",
) -> torch.Tensor:
    """The key half of :func:`latent_attention_ref`: scores of every query head over cache slots [0, kv_len).

    Args: as :func:`latent_attention_ref` (``q`` (B, H, S, D), ``latent_k`` (B, S_max, Rk_tot) ...).
    Returns:
        (B, Hkv, S, H/Hkv, kv_len) fp32, contiguous: ``scale * log2(e) * q . k`` with k the rebuilt, rotated key of
        the slot, plus an additive mask times log2(e); ``-inf`` where a bool mask is False and at the exact
        tokens' ``slots`` (their exact keys enter in :func:`latent_attention_from_scores_ref`).
    """
    b, h, s, d = q.shape
    k = _rebuild(latent_k[:, :kv_len], basis_k_block, k_offsets, cos_table, sin_table, slot_pos[:, :kv_len],
                 rope_form, rotary_dim, k_fmt)  # (B, Hkv, T, D)
    hkv = k.shape[1]
    g = h // hkv
    sc = torch.einsum("bgrsd,bgtd->bgsrt", q.float().reshape(b, hkv, g, s, d), k) * (scale * LOG2E)
    sc = _mask_scores(sc, attn_mask, None, b, hkv, g, s, kv_len)
    return sc.masked_fill(exact_slots(slots, kv_len)[2], float("-inf")).contiguous()


def latent_attention_from_scores_ref(
    scores: torch.Tensor,
    q: torch.Tensor,
    latent_v: torch.Tensor,
    basis_v_block: torch.Tensor,
    v_offsets: Sequence[int],
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    slots: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
    kv_len: int,
    v_fmt: str = "float",
) -> torch.Tensor:
    """The value half of :func:`latent_attention_ref`, from the scores of :func:`latent_scores_ref`.

    Args:
        scores: (B, Hkv, S, G, kv_len) fp32 log2-unit scores of the cache slots (exact tokens' slots at -inf).
        q, latent_v, basis_v_block, v_offsets, new_k, new_v, slots, attn_mask, scale, kv_len, v_fmt: as
            :func:`latent_attention_ref`.
    Returns:
        (B, H, S, D) q.dtype: softmax over the cache slots and the exact tokens' keys (``new_k``, masked at their
        slots' columns; unused entries never read), latent values absorbed in latent space and projected once, the
        exact tokens' values exact; rows the mask removes entirely are 0.
    """
    b, h, s, d = q.shape
    hkv = new_k.shape[1]
    g = h // hkv
    valid, idx, taken = exact_slots(slots, kv_len)
    new_k = new_k.float().masked_fill(~valid[:, None], 0.0)  # unused entries are never read (NaN-safe)
    new_v = new_v.float().masked_fill(~valid[:, None], 0.0)
    s_new = torch.einsum("bgrsd,bgnd->bgsrn", q.float().reshape(b, hkv, g, s, d), new_k) * (scale * LOG2E)
    s_new = _mask_scores(s_new, attn_mask, torch.where(valid, idx, 0), b, hkv, g, s, kv_len)
    s_new = s_new.masked_fill(~valid, float("-inf"))
    allsc = torch.cat((scores.float(), s_new), dim=-1)
    mx = allsc.amax(dim=-1, keepdim=True)
    w = torch.exp2(allsc - torch.where(torch.isneginf(mx), 0.0, mx))
    l = w.sum(dim=-1, keepdim=True)
    w = torch.where(l > 0, w / torch.where(l > 0, l, 1.0), 0.0)
    zv = unpack_latent_ref(latent_v[:, :kv_len], v_offsets, basis_v_block.shape[-1], v_fmt)  # (B, Hkv, T, Rv)
    zv = zv.masked_fill(taken[:, None], 0.0)  # never attended (-inf); zeroed so that stale rows cannot make NaN
    absorbed = torch.einsum("bgsrt,bgtk->bgsrk", w[..., :kv_len], zv)
    eq = "bgsrk,bgdk->bgsrd" if basis_v_block.dim() == 4 else "bgsrk,gdk->bgsrd"
    out = torch.einsum(eq, absorbed, basis_v_block.float())
    out = out + torch.einsum("bgsrn,bgnd->bgsrd", w[..., kv_len:], new_v.float())
    return out.permute(0, 1, 3, 2, 4).reshape(b, h, s, d).to(q.dtype)
