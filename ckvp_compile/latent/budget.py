"""Byte budgets: the ranks that meet a target KV compression ratio counted in bytes, for a latent format.

:func:`~ckvp_compile.latent.calibrate` takes ``kv_ratio`` in *elements* (dense K/V elements over latent
elements per token). What a user sees on the device is bytes: latent rows in their storage format
(:mod:`ckvp_compile.kernels.latent_format`: 16-bit floats, or int8 / int4 / int2 codes plus fp16 block scales),
one int32 RoPE position per slot, and the bases themselves. :func:`store_bytes` counts those bytes for a
:class:`~ckvp_compile.latent.LatentBases` exactly as :class:`~ckvp_compile.runtime.store.LatentKVStore`
allocates them, and :func:`fit_byte_ratio` searches the element ratio whose bases meet a byte ratio.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Callable

import torch

from ..errors import CKVPConfigError
from ..kernels.latent_format import parse_latent_format
from ..kernels.latent_layout import padded_units
from .ranks import max_key_rank_error, rank_block_error

__all__ = ["AUTO_RANK_BLOCK_SLACK", "bases_for_byte_ratio", "check_budget_args", "default_rank_block", "dense_kv_bytes",
           "fit_byte_ratio", "format_pair", "store_bytes", "window_bytes"]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dense_kv_bytes(bases: Any, batch_size: int, max_cache_len: int, dtype: torch.dtype) -> int:
    """Bytes of the dense K and V caches the bases replace: layers x 2 x B x Hkv x S_max x D x itemsize."""
    layers = sum(len(g) for g in bases.groups)
    return 2 * layers * batch_size * bases.num_kv_heads * max_cache_len * bases.head_dim * _itemsize(dtype)


def _check_window(recent_window: Any) -> None:
    if isinstance(recent_window, bool) or not isinstance(recent_window, int) or recent_window < 0:
        raise CKVPConfigError(f"recent_window must be an int >= 0 (tokens kept dense; 0: none), got {recent_window!r}")


def window_bytes(bases: Any, batch_size: int, recent_window: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of a store's dense recent window (``LatentKVStore(recent_window=W)``): per layer and sequence, W
    exact keys and values of Hkv x D elements in ``dtype`` (the store's ``latent_dtype``), plus each layer's (W,)
    int64 ring slots. Raises CKVPConfigError for a negative or non-integer ``recent_window``."""
    _check_window(recent_window)
    if not recent_window:
        return 0
    layers = sum(len(g) for g in bases.groups)
    per_seq = 2 * layers * bases.num_kv_heads * recent_window * bases.head_dim * _itemsize(dtype)
    return batch_size * per_seq + layers * recent_window * 8


def store_bytes(bases: Any, batch_size: int, max_cache_len: int, k_format: str = "float", v_format: str = "float",
                latent_dtype: torch.dtype = torch.bfloat16, with_bases: bool = True,
                basis_dtype: torch.dtype | None = None, residual_format: str = "", recent_window: int = 0,
                page_size: int = 0, num_pages: int | None = None) -> int:
    """Bytes a :class:`~ckvp_compile.runtime.store.LatentKVStore` of these bases holds for B sequences of S_max
    slots: latent rows (from :data:`~ckvp_compile.kernels.latent_layout.MIN_PADDED_ROW` units on, each padded to
    :data:`~ckvp_compile.kernels.latent_layout.ROW_ALIGN` units, as a row-major store allocates them; a unit-major
    one holds up to 15 units a row less), int32 slot positions and (``with_bases``) the bases in ``basis_dtype``
    (default ``latent_dtype``, as the store), plus the ALR-KVD residual rows of keys and values when
    ``residual_format`` is given (:mod:`ckvp_compile.kernels.residual`) and the dense recent window of
    ``recent_window`` tokens (:func:`window_bytes`). A format of ``"auto"`` takes the bases' planned per-group
    formats (``k_formats`` / ``v_formats``), else ``"float"``.
    A paged store (``page_size`` P > 0) holds ``num_pages + 1`` pages of P latent rows (default num_pages:
    B * S_max / P; the last page is the trash page) instead of B x S_max rows, plus its (B, S_max / P) int32
    page table.

    RoPE tables are not counted (a cache of the model's own cos / sin; ``StoreBytes.rope_tables``).

    Raises:
        ValueError: ``num_pages`` without a ``page_size`` (the store refuses it too).
    """
    if num_pages is not None and not page_size:
        raise ValueError(f"num_pages={num_pages} needs a page_size > 0 (a paged store)")

    def per_group(fmt: str, planned: Any) -> list:
        if fmt == "auto":
            return [parse_latent_format(f) for f in planned] if planned else [parse_latent_format("float")] * n
        return [parse_latent_format(fmt)] * n

    n = len(bases.groups)
    kfs, vfs = per_group(k_format, getattr(bases, "k_formats", ())), per_group(v_format, getattr(bases, "v_formats", ()))
    item = _itemsize(latent_dtype)
    latent_row = 0  # bytes of one slot's latent rows, every group, K and V
    for kf, vf, ranks_k, ranks_v in zip(kfs, vfs, bases.k_ranks, bases.v_ranks):
        for f, ranks in ((kf, ranks_k), (vf, ranks_v)):
            offsets = [0]
            for r in ranks:
                offsets.append(offsets[-1] + int(r))
            unit = 1 if f.quantized else item  # row-major rows padded to ROW_ALIGN units (empty_latent)
            latent_row += padded_units(f.row_width(offsets)) * unit
    per_token = 4  # slot_pos
    if residual_format:
        from ..kernels.residual import residual_offsets

        rf = parse_latent_format(residual_format)
        per_token += sum(2 * rf.row_width(residual_offsets(len(g), bases.num_kv_heads, bases.head_dim))
                         for g in bases.groups)
    slots = batch_size * max_cache_len
    if page_size:
        pages = batch_size * (max_cache_len // page_size) if num_pages is None else num_pages
        latent = latent_row * (pages + 1) * page_size + 4 * batch_size * (max_cache_len // page_size)
    else:
        latent = latent_row * slots
    total = per_token * slots + latent + window_bytes(bases, batch_size, recent_window, latent_dtype)
    if with_bases:
        total += sum(p.numel() for p in (*bases.k_basis, *bases.v_basis)) * _itemsize(basis_dtype or latent_dtype)
    return total


def _check_target(target: Any) -> None:
    """Raise CKVPConfigError unless ``target`` is a finite number >= 1 (a NaN would end the search at rank 1)."""
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not math.isfinite(target) or target < 1:
        raise CKVPConfigError(f"kv_ratio must be a finite number >= 1 (dense bytes / latent bytes), got {target!r}")


def fit_byte_ratio(build: Callable[[float], Any], target: float, max_elements_ratio: float,
                   bytes_ratio: Callable[[Any], float], iterations: int = 40) -> Any:
    """Return the bases with the most latent elements whose byte ratio is >= ``target``.

    Args:
        build: element ratio -> LatentBases (e.g. ``lambda r: moments.bases(r, "uniform")``); larger ratios
            give smaller (or equal) ranks.
        target: the byte ratio to meet (>= 1).
        max_elements_ratio: the largest element ratio ``build`` accepts (every rank 1).
        bytes_ratio: LatentBases -> dense bytes / held bytes (e.g. via :func:`store_bytes`).
        iterations: bisection steps over the element ratio.
    Raises:
        CKVPConfigError: the target is not a finite number >= 1, or not reachable even at the largest element ratio.
    """
    _check_target(target)
    lo, hi = 1.0, float(max_elements_ratio)
    best = build(hi)
    if bytes_ratio(best) < target:
        raise CKVPConfigError(f"a byte ratio of {target:g} is not reachable (at most {bytes_ratio(best):.3g} at rank 1 "
                              "everywhere); lower kv_ratio, use fewer bits, a longer cache or a shorter "
                              "recent_window")
    if bytes_ratio(build(lo)) >= target:
        return build(lo)
    for _ in range(iterations):
        mid = (lo + hi) / 2
        b = build(mid)
        if bytes_ratio(b) >= target:
            hi, best = mid, b
        else:
            lo = mid
    return best


def bases_for_byte_ratio(moments: Any, kv_ratio: float, latent_format: str | tuple[str, str] = "float", *,
                         batch_size: int = 1,
                         max_cache_len: int = 4096, rank_allocation: str = "energy", basis: str = "pca",
                         dense_dtype: torch.dtype = torch.bfloat16,
                         latent_dtype: torch.dtype = torch.bfloat16, basis_dtype: torch.dtype | None = None,
                         rotate: bool = False, residual_format: str = "", recent_window: int = 0,
                         rank_block: int | None = None, max_key_rank: int | None = None) -> Any:
    """Bases from collected moments whose store meets ``kv_ratio`` in bytes (see :func:`store_bytes`).

    Args:
        moments: :class:`~ckvp_compile.latent.KVMoments` (``collect_kv_moments``).
        kv_ratio: dense bytes / store bytes (latents, slot positions and bases; not the RoPE tables) for
            ``batch_size`` sequences of ``max_cache_len`` slots; 1.0 means full rank (a control: the store then
            holds more than the dense cache).
        latent_format: storage of the latents (``"float"`` = ``latent_dtype``, ``"int8"``, ``"int4/64"``, ...), one
            format for keys and values or a (K, V) pair of them (as ``CKVPStaticCache(latent_format=...)`` takes; the
            ranks are allocated by energy alone, whatever each side's bytes per coordinate).
        batch_size, max_cache_len: the cache the ratio is counted for (the bases are shared by the batch).
        rank_allocation, basis: as for :func:`~ckvp_compile.latent.calibrate` ('weighted' bases get the ranks
            the 'pca' fit chose).
        dense_dtype: the dense cache compared against (the checkpoint's dtype, usually bf16).
        latent_dtype: dtype of 'float' latents and of the bases on the device.
        basis_dtype: dtype of the bases on the device when not ``latent_dtype`` (e.g. ``torch.float8_e4m3fn``).
        rotate: rotate each head's columns in blocks of the format's quantization block
            (:func:`~ckvp_compile.latent.rotation.rotate_basis_blocks`: equal-variance coordinates per block,
            same subspace); recorded as ``rotation="hadamard/<block>"``. Needs a quantized format (one block for
            keys and values).
        residual_format: '' or the ALR-KVD residual's format (e.g. ``"int2/64"``), whose bytes count.
        recent_window: the store's dense recent window (tokens), whose bytes count (:func:`window_bytes`).
        rank_block: ranks in whole blocks of this many coordinates (:func:`~ckvp_compile.latent.allocate_ranks`);
            None (default): the format's quantization block for a uniform quantized format (of a pair: the larger
            block where both are uniform quantized and one block divides the other, else 1; each head's codes
            fill whole blocks and start aligned in the latent row: the decode kernel loads them as vectors)
            unless those coarser steps overshoot ``kv_ratio`` by more than :data:`AUTO_RANK_BLOCK_SLACK` (small
            models, where one step is a large share of the budget), then 1 (any rank), as for other formats.
        max_key_rank: None, or a cap on every key unit's rank, the bytes going to the other units
            (:func:`~ckvp_compile.latent.ranks.key_rank_caps`; with whole-block ranks the cap rounds down to a
            block step); recorded in the bases.
    Returns:
        :class:`~ckvp_compile.latent.LatentBases` with ``latent_format`` recorded as every group's
        ``k_formats`` / ``v_formats`` (a cache built with ``latent_format="auto"``, the default, stores that).
    Raises:
        CKVPConfigError: an unknown format (or not a name or a (K, V) pair of names), batch_size / max_cache_len
            < 1, a non-float dense_dtype / latent_dtype / basis_dtype, rotate=True with formats of unequal or no
            blocks, a ratio no rank reaches, a ``rank_block`` that is not an int >= 1, a ``max_key_rank`` that is not
            None or an int >= 1, or one that leaves too few coordinates for ``kv_ratio`` (more than 5% above it with
            every unit at its cap; the message names the reachable ratio).
    """
    _check_target(kv_ratio)
    check_budget_args(batch_size, max_cache_len, dense_dtype, latent_dtype)
    if basis_dtype is not None:
        check_budget_args(1, 1, basis_dtype, basis_dtype, names=("basis_dtype", "basis_dtype"))
    kfmt, vfmt = format_pair(latent_format)
    auto = rank_block is None
    if auto:
        rank_block = default_rank_block((kfmt, vfmt))
    if rank_block_error(rank_block):
        raise CKVPConfigError(rank_block_error(rank_block) + " (or None: the format's block)")
    if max_key_rank_error(max_key_rank):
        raise CKVPConfigError(max_key_rank_error(max_key_rank))
    cap = {"max_key_rank": max_key_rank} if max_key_rank is not None else {}  # moments without the option work
    _check_window(recent_window)
    if rotate:
        blocks = {parse_latent_format(f).block if parse_latent_format(f).quantized else None for f in (kfmt, vfmt)}
        if None in blocks or len(blocks) > 1:
            raise CKVPConfigError("rotate=True needs quantized latent formats of one block for keys and values (their "
                                  f"blocks are what is rotated), got {(kfmt, vfmt) if kfmt != vfmt else kfmt!r}")
    if kv_ratio == 1.0:
        full = moments.bases(1.0, rank_allocation, basis, rank_block=rank_block, **cap)
        out = dataclasses.replace(full, k_formats=(kfmt,) * len(full.groups), v_formats=(vfmt,) * len(full.groups))
        return _rotated(out, kfmt) if rotate else out

    def byte_ratio(b: Any) -> float:
        return _byte_ratio(b, kfmt, vfmt, batch_size=batch_size, max_cache_len=max_cache_len, dense_dtype=dense_dtype,
                           latent_dtype=latent_dtype, basis_dtype=basis_dtype, residual_format=residual_format,
                           recent_window=recent_window)

    layers = sum(len(g) for g in moments.groups)
    top = layers * moments.head_dim / len(moments.groups)  # the element ratio at rank 1 everywhere

    def fit(block: int) -> Any:
        return fit_byte_ratio(lambda r: moments.bases(r, rank_allocation, "pca", rank_block=block, **cap), kv_ratio,
                              top, byte_ratio)

    if cap:  # the cap leaves enough coordinates for the ratio? (every unit at its cap: the smallest store)
        floor = byte_ratio(moments.bases(1.0, rank_allocation, "pca", rank_block=1, **cap))
        if floor > kv_ratio * (1 + AUTO_RANK_BLOCK_SLACK):
            raise CKVPConfigError(
                f"max_key_rank={max_key_rank} leaves too few latent coordinates for kv_ratio={kv_ratio:g}: with every "
                f"unit at its cap the store is already {floor:.2f}x smaller than the dense cache; raise "
                f"max_key_rank, or ask for kv_ratio >= {floor:.2f}")
    pca = fit(rank_block)
    if auto and rank_block > 1 and byte_ratio(pca) > kv_ratio * (1 + AUTO_RANK_BLOCK_SLACK):
        free = fit(1)  # whole blocks would leave too much of the budget unspent (a small model): any rank, if closer
        if byte_ratio(free) < byte_ratio(pca):
            rank_block, pca = 1, free
    # 'weighted' bases keep the ranks of the 'pca' fit, hence its bytes
    out = pca if basis == "pca" else moments.bases(pca.target_ratio, rank_allocation, basis, rank_block=rank_block,
                                                   **cap)
    n = len(out.groups)  # the formats the ranks were fitted for: a cache with latent_format="auto" uses them
    out = dataclasses.replace(out, k_formats=(kfmt,) * n, v_formats=(vfmt,) * n)
    return _rotated(out, kfmt) if rotate else out


def check_budget_args(batch_size: Any, cache_len: Any, dense_dtype: Any, latent_dtype: Any, *,
                      names: tuple[str, str] = ("dense_dtype", "latent_dtype"),
                      len_name: str = "max_cache_len") -> None:
    """Raise :class:`CKVPConfigError` (naming the fix) unless the cache a byte ratio is counted for is valid:
    ``batch_size`` and ``cache_len`` ints >= 1, ``dense_dtype`` and ``latent_dtype`` floating ``torch.dtype``s."""
    for name, n in (("batch_size", batch_size), (len_name, cache_len)):
        if isinstance(n, bool) or not hasattr(n, "__index__") or operator.index(n) < 1:
            raise CKVPConfigError(f"{name} must be an int >= 1 (the cache the byte ratio is counted for: batch_size "
                                  f"sequences x {len_name} slots), got {n!r}")
    for name, dt, of in ((names[0], dense_dtype, "the dense cache the ratio is counted against"),
                         (names[1], latent_dtype, "the bases and float latents")):
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            raise CKVPConfigError(f"{name} must be a floating torch.dtype (e.g. torch.bfloat16), the element type "
                                  f"of {of}; got {dt!r}")


def format_pair(latent_format: Any) -> tuple[str, str]:
    """The (key, value) latent format names of ``latent_format``: one format name for both, or a (K, V) pair.

    Raises:
        CKVPConfigError: neither a format name nor a pair of them, or an unknown format (the message lists the
            known ones).
    """
    if isinstance(latent_format, str):
        names = (latent_format, latent_format)
    elif isinstance(latent_format, (tuple, list)) and len(latent_format) == 2:
        names = tuple(latent_format)
    else:
        raise CKVPConfigError(f"latent_format must be a format name (e.g. 'int4') or a (K, V) pair of them (e.g. "
                              f"('int4', 'int8')), got {latent_format!r}")
    try:
        k, v = (parse_latent_format(n).name for n in names)
    except (ValueError, TypeError) as e:
        raise CKVPConfigError(f"latent_format: {e}") from None
    return k, v


#: How far above the requested byte ratio the default whole-block ranks of :func:`bases_for_byte_ratio` may land
#: before it falls back to any rank (a fraction: 0.05 = 5% fewer bytes than asked for, i.e. rank left unspent).
AUTO_RANK_BLOCK_SLACK = 0.05


def _byte_ratio(b: Any, kfmt: str, vfmt: str, *, batch_size: int, max_cache_len: int, dense_dtype: torch.dtype,
                latent_dtype: torch.dtype, basis_dtype: torch.dtype | None, residual_format: str, recent_window: int,
                **_: Any) -> float:
    """Dense bytes / store bytes of bases ``b`` with keys stored in ``kfmt``, values in ``vfmt`` (see
    :func:`store_bytes`)."""
    return (dense_kv_bytes(b, batch_size, max_cache_len, dense_dtype)
            / store_bytes(b, batch_size, max_cache_len, kfmt, vfmt, latent_dtype, basis_dtype=basis_dtype,
                          residual_format=residual_format, recent_window=recent_window))


def default_rank_block(latent_format: str | tuple[str, str]) -> int:
    """The ``rank_block`` :func:`bases_for_byte_ratio` uses by default for ``latent_format``: the quantization block
    of a uniform quantized format (``"int4"`` -> 32, ``"int2/16"`` -> 16), else 1; for a (K, V) pair, the larger of
    the two blocks where both are > 1 and one divides the other (whole blocks on both sides), else 1. Raises
    ValueError for an unknown format (CKVPConfigError for a malformed pair)."""
    if not isinstance(latent_format, str):
        k, v = (default_rank_block(f) for f in format_pair(latent_format))
        return max(k, v) if k > 1 and v > 1 and max(k, v) % min(k, v) == 0 else 1
    f = parse_latent_format(latent_format)
    return int(f.block) if f.quantized and not f.mixed and f.block > 1 else 1


def _rotated(bases: Any, fmt: str) -> Any:
    """``bases`` with each head's columns rotated in blocks of the (uniform, quantized) format's block."""
    from .rotation import rotate_basis_blocks

    block = parse_latent_format(fmt).block
    rot = {f"{kind}_basis": tuple(rotate_basis_blocks(p, r, block) for p, r in zip(bases.basis(kind), bases.ranks(kind)))
           for kind in ("k", "v")}
    return dataclasses.replace(bases, rotation=f"hadamard/{block}", **rot)
