"""Per-layout index tables on the device, built when a latent store is built (outside CUDA-graph memory pools).

The kernels' launchers cache small index tables per (layout, format, device) so that no host-to-device copy
happens per decode step. Under ``torch.compile(mode="reduce-overhead")`` the first call of a graph is a
CUDA-graph-trees warm-up whose allocations come from the graph's private memory pool; a cached table made there
outlives the call, and recording then fails ("Detected N tensor(s) in the cudagraph pool not tracked as outputs":
on the H200, 2 per layer, traced to ``_head_meta``; benchmarks/results/2026-11-29-reliability-h200). Making the
copy on a side stream did not help on torch 2.11 (the pool took it too). So :func:`prepare_device_tables` fills
every cache a store's layouts will use when the store is built, before anything is compiled; a launcher called
later finds its table cached. Layouts first seen inside a compiled call (ops used without a store) still build
their table lazily, which is correct but not CUDA-graph-safe: a table first needed while a CUDA graph is being
captured (its host-to-device copy from pageable memory is not capturable) raises :func:`check_not_capturing`'s
error naming the table, instead of an opaque ``cudaErrorStreamCaptureInvalidated``.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["check_not_capturing", "prepare_device_tables"]


def prepare_device_tables(offsets: Sequence[int], fmt: str, basis_width: int, device: torch.device | str) -> None:
    """Build and cache every per-layout table the CUDA kernels and references use for one latent layout.

    Args:
        offsets: (Hkv + 1,) ints, the heads' latent column offsets (one group's K or V latent).
        fmt: the latent format name (:mod:`ckvp_compile.kernels.latent_format`).
        basis_width: R_max, the basis block's last dimension (the reference's per-head padding).
        device: the store's device; only CUDA devices are prepared (elsewhere there is no pool to avoid).
    Raises:
        ValueError: an unknown format (as :func:`~ckvp_compile.kernels.latent_format.parse_latent_format`).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return
    if device.index is None:  # the launchers key their caches by the tensors' device, which has an index
        device = torch.device("cuda", torch.cuda.current_device())
    _prepare(offsets, fmt, basis_width, device)


def check_not_capturing(what: str, device: torch.device | str) -> None:
    """Refuse to build a per-layout device table while the current CUDA stream is capturing a graph.

    Called by the table builders on a cache miss only (a hit costs nothing). The copy of a new table from host
    memory is not permitted during stream capture, and it would leave the table in the graph's memory pool.

    Args:
        what: the table, for the message. device: where the table would be built; only CUDA devices are checked.
    Raises:
        RuntimeError: a CUDA ``device`` and ``torch.cuda.is_current_stream_capturing()``; the message names the
            table and the fix (build the latent store, which calls :func:`prepare_device_tables`, or call it for
            the layout, before the first compiled call).
    """
    if torch.device(device).type != "cuda" or not torch.cuda.is_current_stream_capturing():
        return
    raise RuntimeError(
        f"ckvp: {what} for this layout is first needed while a CUDA graph is being captured, where building it "
        "(a host-to-device copy) is not permitted. Fix: build the latent store (CKVPStaticCache / LatentKVStore) "
        "before compiling, or call ckvp_compile.kernels.device_cache.prepare_device_tables(offsets, fmt, "
        "basis_width, device) for every layout the compiled ops use, before the first compiled call")


def _prepare(offsets: Sequence[int], fmt: str, basis_width: int, device: torch.device) -> None:
    """:func:`prepare_device_tables` on any device (the CPU tests call it directly): the same calls, with the same
    cache keys, as the launchers and references make."""
    from . import latent_attention_triton as lat
    from . import latent_quant_triton as lq
    from . import reference as ref
    from .latent_format import _code_byte_index, _e4m3_grid, _pad_index, parse_latent_format

    offsets = [int(o) for o in offsets]
    f = parse_latent_format(fmt)
    ref._head_columns(offsets, int(basis_width), device)
    ref._packed_columns(offsets, int(basis_width), device)  # ckvp::latent_append's gather (no boolean mask)
    lat._head_meta(offsets, f.name, device)
    if f.quantized:
        _pad_index(offsets, f, device)
        _code_byte_index(offsets, f, device)
    if f.meta_f8:  # the reference quantizer's e4m3 rounding table
        _e4m3_grid(str(device))
    if lq.unsupported_reason(f, torch.device("cuda")) is None:  # formats the Triton quant kernels take
        lq._tables(tuple(offsets), f.name, str(device))
        if lq.format_family(f) in ("int", "mix"):  # latent_append_triton's (head, coordinate) table
            lq._head_tables(tuple(offsets), f.name, str(device))
