"""Small constant tensors cached per layout on a device, allocated outside CUDA-graph memory pools.

The kernels' launchers cache small index tables per (layout, device) so that no host-to-device copy happens per
decode step. Under ``torch.compile(mode="reduce-overhead")`` the first call of a graph is a CUDA-graph-trees warm-up
whose allocations on the current stream come from the graph's private memory pool; a cached tensor made there
outlives the call, and recording then fails ("Detected N tensor(s) in the cudagraph pool not tracked as outputs",
seen on the H200: benchmarks/results/2026-11-29-reliability-h200). :func:`persistent_to_device` makes the copy on
a side stream, whose allocations the pool does not take (the pool serves the stream it was entered on), and
orders the current stream after it. Source: ``torch/_inductor/cudagraph_trees.py`` (``_use_cuda_memory_pool_manager``
routes the current stream's allocations to the pool), read in torch 2.13.
"""

from __future__ import annotations

import torch

__all__ = ["persistent_to_device"]

_SIDE: dict[int, torch.cuda.Stream] = {}


def persistent_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy the host tensor ``t`` (any shape and dtype, small) to ``device`` for a cache that lives for the process.

    On CUDA the copy is allocated and made on a side stream (outside any CUDA-graph pool the current stream may be
    allocating from), then the current stream waits for it; during a CUDA-graph capture, where no new stream work
    may be issued, it falls back to a plain ``t.to(device)`` (a cache should be filled by the warm-up call before).
    Elsewhere it is ``t.to(device)``. Returns the device tensor; raises what ``Tensor.to`` raises.
    """
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return t.to(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    side = _SIDE.get(index)
    if side is None:
        side = _SIDE[index] = torch.cuda.Stream(device=index)
    current = torch.cuda.current_stream(index)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        out = t.to(device)
    current.wait_stream(side)
    return out
