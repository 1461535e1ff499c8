"""How a latent cache's bytes are laid out in device memory: row-major or unit-major.

A latent cache is logically ``(B, S_max, W)`` (or a page pool ``(N_pages + 1, P, W)``): one row of W units (bytes
of a quantized format, elements of ``float``) per cached slot, head h's codes, then every block's scales and mins
(:mod:`~ckvp_compile.kernels.latent_format`). The layout only chooses the strides of that same logical tensor:

- ``row-major`` (the default): strides ``(S_max * W', W', 1)``; each slot's row is contiguous, and starts every
  :data:`ROW_ALIGN` units (``W'`` = W rounded up to them by :func:`empty_latent` from :data:`MIN_PADDED_ROW` units
  on; the padding is never read).
- ``unit-major``: strides ``(S_max * W, 1, S_max)``; each unit (byte column) is contiguous over the slots of a
  sequence (of a page). A per-head pass reads a few units of every row (rank 8 at int4/32: 4 code bytes and a
  4-byte scale and min out of a row of 96 bytes for 16 heads): row-major, each slot's few bytes sit in their own
  32-byte sector, unit-major, a tile of 64 slots reads 64 contiguous bytes per unit. Nsight Compute on the H200
  put 72% (key pass) and 95% (value pass) of the sectors the row-major kernels fetch as excess
  (benchmarks/results/2026-11-30-small-rank-ncu-h200); this layout was the structural fix to time against it.
  On the H200 the kernels run slower on it (1.14-1.94x per call, benchmarks/results/2026-12-01-largebatch-h200):
  they load rows, and an fp16 scale becomes two byte columns. Whole calls were timed with both latents unit-major;
  a store may hold the value latents alone so (``"row-major/unit-major"``, :func:`key_value_layouts`).

Every kernel and reference addresses the latent through its strides, so both layouts give the same results
(tests/kernels/test_latent_layout.py); a write of one slot's row touches W sectors unit-major instead of one or
two, which the decode step's single new token makes cheap. Source: the sector arithmetic above; the layout is the
usual structure-of-arrays transposition of a row store.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["LAYOUTS", "MIN_PADDED_ROW", "ROW_ALIGN", "STORE_LAYOUTS", "empty_latent", "held_units_per_row",
           "key_value_layouts", "layout_of", "padded_units", "to_layout"]

#: The layouts of one latent tensor.
LAYOUTS = ("row-major", "unit-major")

#: What a store's ``latent_layout`` may be (``CKVPStaticCache(latent_layout=...)``): one of :data:`LAYOUTS` for the key
#: and value latents alike, or ``"KEYS/VALUES"`` for each its own (e.g. ``"row-major/unit-major"``: only the value
#: latents unit-major, whose per-head value pass reads a few bytes of every row).
STORE_LAYOUTS = LAYOUTS + tuple(f"{k}/{v}" for k in LAYOUTS for v in LAYOUTS if k != v)


#: Units (bytes of a quantized latent, elements of a float one) that a row-major latent's row stride is a multiple
#: of (:func:`empty_latent` pads each row to it). The kernels take the row stride in units, and Triton vectorises row
#: loads only when that integer is divisible by 16 (it specialises integer arguments on it): calibrated plans give
#: a layer unequal per-head ranks, so rows of 420 or 500 bytes, which the H200 read 1.3-1.6x slower than the same
#: ranks in 16-byte rows (benchmarks/results/2026-12-01-step-calls-h200). The padding is never read or written.
ROW_ALIGN = 16

#: Rows narrower than this many units stay packed: their padding would cost more than 1/8 of the row (a toy model's
#: 8-byte rows would double, and a byte ratio the planner reached would no longer be reachable).
MIN_PADDED_ROW = 128


def padded_units(width: int, align: int = ROW_ALIGN, min_width: int = MIN_PADDED_ROW) -> int:
    """The row stride, in units, of a row-major latent of ``width`` units per row: ``width`` rounded up to a
    multiple of ``align``, or ``width`` itself below ``min_width``.

    Raises:
        ValueError: a negative width or a non-positive alignment.
    """
    if width < 0 or align < 1:
        raise ValueError(f"width must be >= 0 and align >= 1, got {width} and {align}")
    if width < min_width:
        return width
    return -(-width // align) * align


def held_units_per_row(latent: torch.Tensor) -> int:
    """Units one slot's row of ``latent`` (..., rows, W) holds in storage: its row stride when row-major (padding
    included), W when unit-major (whose slots are not padded)."""
    if latent.dim() >= 2 and latent.stride(-1) == 1:
        if latent.shape[-2] > 1:
            return int(latent.stride(-2))
        if latent.dim() >= 3 and latent.shape[-3] > 1:  # one slot per sequence: the next dim's stride is its row
            return int(latent.stride(-3))
    return int(latent.shape[-1])


def _check(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"latent layout must be one of {LAYOUTS}, got {layout!r}")


def key_value_layouts(latent_layout: str) -> tuple[str, str]:
    """The (key latents', value latents') layouts of a store's ``latent_layout`` (:data:`STORE_LAYOUTS`).

    Raises:
        ValueError: not one of :data:`STORE_LAYOUTS` (the message lists them).
    """
    if latent_layout not in STORE_LAYOUTS:
        raise ValueError(f"latent_layout must be one of {STORE_LAYOUTS}, got {latent_layout!r}")
    k, _, v = latent_layout.partition("/")
    return k, v or k


def empty_latent(rows: Sequence[int], width: int, layout: str, dtype: torch.dtype,
                 device: torch.device | str) -> torch.Tensor:
    """A zeroed latent cache of logical shape ``(*rows, width)`` in ``layout``.

    Args:
        rows: the leading dims, (B, S_max) or a page pool's (N_pages + 1, P). width: W, units per row.
        layout: one of :data:`LAYOUTS`. dtype, device: as ``torch.zeros``.
    Returns:
        (*rows, width) ``dtype`` zeros; row-major: a view of (*rows, :func:`padded_units`) storage whose rows start
        every :data:`ROW_ALIGN` units (contiguous when ``width`` fills them or is below :data:`MIN_PADDED_ROW`);
        unit-major: a transposed view of
        contiguous (*rows[:-1], width, rows[-1]) storage (``x.transpose(-1, -2).is_contiguous()``).
    Raises:
        ValueError: an unknown layout, or fewer than one leading dim.
    """
    _check(layout)
    rows = tuple(int(r) for r in rows)
    if not rows:
        raise ValueError("a latent cache has at least one leading dim (the slots)")
    if layout == "row-major":
        return torch.zeros(*rows, padded_units(width), dtype=dtype, device=device)[..., :width]
    return torch.zeros(*rows[:-1], width, rows[-1], dtype=dtype, device=device).transpose(-1, -2)


def to_layout(latent: torch.Tensor, layout: str) -> torch.Tensor:
    """A copy of ``latent`` (..., rows, W) with the same values stored in ``layout`` (always a new tensor: writes to
    it never reach ``latent``).

    Raises:
        ValueError: an unknown layout or a tensor of fewer than 2 dims.
    """
    _check(layout)
    if latent.dim() < 2:
        raise ValueError(f"a latent cache is (..., rows, W), got shape {tuple(latent.shape)}")
    if layout == "row-major":
        return latent.clone(memory_format=torch.contiguous_format)
    return latent.transpose(-1, -2).clone(memory_format=torch.contiguous_format).transpose(-1, -2)


def layout_of(latent: torch.Tensor) -> str | None:
    """The layout of ``latent`` (..., rows, W): 'row-major' when contiguous or contiguous but for padded rows (as
    :func:`empty_latent` allocates them: unit stride 1, a row stride >= W, each leading dim spanning the next one
    whole), 'unit-major' when its last two dims' transpose is contiguous, None otherwise (a size-1 rows or W dim is
    both: reported 'row-major')."""
    if latent.is_contiguous():
        return "row-major"
    if latent.dim() >= 2 and latent.transpose(-1, -2).is_contiguous():
        return "unit-major"
    if latent.dim() >= 2 and latent.stride(-1) == 1 and latent.stride(-2) >= latent.shape[-1] and all(
            latent.stride(i) == latent.shape[i + 1] * latent.stride(i + 1) for i in range(latent.dim() - 2)):
        return "row-major"
    return None
