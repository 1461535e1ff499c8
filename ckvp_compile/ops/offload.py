"""The offloaded experts op: ``torch.ops.ckvp.offload_experts``, one MoE layer's routed experts served from a
device cache of experts that lives in an :class:`~ckvp_compile.runtime.offload.ExpertOffloader`.

Schema::

    ckvp::offload_experts(Tensor hidden, Tensor topk_ids, Tensor topk_weights, int handle, int layer) -> Tensor

The offloader's state (host store, device slots, streams, statistics) is mutable Python state, so the op refers
to it through an integer ``handle`` (:func:`register_offloader`), which Dynamo records as a constant. The op is
opaque to Inductor (a ``torch.library.custom_op``: one extern call, the graph stays whole) and declared
functional: its output is a new tensor that the rest of the layer uses, so it is never dead-code eliminated,
and its side effects (copies, cache updates, the next layers' prefetches) happen inside that call, ordered by
the data dependence of the residual stream from layer to layer. It synchronises the host with the device
once per call (the routing decides which copies to issue), so it cannot run inside a CUDA graph
(``cudagraph_unsafe``).

The ``register_fake`` kernel checks shapes and returns ``hidden.new_empty(hidden.shape)``.

Imported by :func:`ckvp_compile.ops.register_all` and by :func:`ckvp_compile.runtime.offload.offload_experts`.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

from ..errors import CKVPConfigError, CKVPShapeError

__all__ = ["OPS", "hold_weakly", "lookup_offloader", "offload_experts", "register_offloader", "unregister_offloader"]

_OFFLOADERS: dict[int, Any] = {}  # handle -> offloader, or a weakref.ref to it (hold_weakly)
_NEXT_HANDLE = itertools.count(1)


def register_offloader(offloader: Any) -> int:
    """Keep ``offloader`` alive under a new integer handle and return the handle (> 0)."""
    handle = next(_NEXT_HANDLE)
    _OFFLOADERS[handle] = offloader
    return handle


def unregister_offloader(handle: int) -> None:
    """Drop the offloader of ``handle`` (later calls of the op with it raise :class:`CKVPConfigError`)."""
    _OFFLOADERS.pop(handle, None)


def hold_weakly(handle: int) -> None:
    """Keep the offloader of ``handle`` registered only while something else holds it (an offloaded model's
    modules, the caller): once it is collected, its handle is unregistered."""
    def drop(ref: weakref.ref, handle: int = handle) -> None:
        if _OFFLOADERS.get(handle) is ref:
            _OFFLOADERS.pop(handle, None)

    _OFFLOADERS[handle] = weakref.ref(_OFFLOADERS[handle], drop)


def lookup_offloader(handle: int) -> Any:
    """Return the offloader registered under ``handle``.

    Raises:
        CKVPConfigError: no live offloader has that handle (it was closed, its expert weights freed): load the model
            again and offload the fresh copy.
    """
    entry = _OFFLOADERS.get(handle)
    offloader = entry() if isinstance(entry, weakref.ref) else entry
    if offloader is None:
        raise CKVPConfigError(
            f"ckvp::offload_experts: no expert offloader with handle {handle} (it was closed and the expert weights "
            "freed with it, or freed with its model when neither the model nor the offloader was held any more, e.g. "
            "by a torch.export program of it, or the model was offloaded in another process); load the model again "
            "(e.g. from_pretrained) and call ckvp_compile.offload_experts on that fresh copy")
    return offloader


def _check(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    if hidden.dim() != 2:
        raise CKVPShapeError(f"ckvp::offload_experts: hidden must be (T, Dm), got {tuple(hidden.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0] or topk_ids.dtype not in (torch.int32, torch.int64):
        raise CKVPShapeError(f"ckvp::offload_experts: topk_ids must be (T={hidden.shape[0]}, A) int32|int64, got "
                             f"{tuple(topk_ids.shape)} {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or not topk_weights.is_floating_point():
        raise CKVPShapeError(f"ckvp::offload_experts: topk_weights must be float {tuple(topk_ids.shape)} like "
                             f"topk_ids, got {tuple(topk_weights.shape)} {topk_weights.dtype}")


_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("ckvp::offload_experts", mutates_args=(), tags=_TAGS)
def offload_experts(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, handle: int,
                    layer: int) -> torch.Tensor:
    """Apply layer ``layer``'s routed experts from the offloader's device cache; prefetch the next layers' experts.

    Args:
        hidden: (T, Dm) float, the experts' input (the MoE block's normalised hidden state).
        topk_ids: (T, A) int32|int64, expert of each (token, slot), in [0, E).
        topk_weights: (T, A) float, routing weights.
        handle: from :func:`register_offloader`. layer: MoE layer index in [0, L).
    Returns:
        (T, Dm) hidden.dtype, equal to ``ckvp::moe_experts`` with all experts resident
        (:meth:`ExpertOffloader.forward <ckvp_compile.runtime.offload.ExpertOffloader.forward>`).
    Raises:
        CKVPShapeError: bad shapes. CKVPConfigError: unknown handle, layer or expert id.
    Reference: ops/moe.py::moe_experts on the full expert weights.
    """
    _check(hidden, topk_ids, topk_weights)
    return lookup_offloader(handle).forward(layer, hidden, topk_ids, topk_weights)


@offload_experts.register_fake
def _(hidden, topk_ids, topk_weights, handle, layer) -> torch.Tensor:
    _check(hidden, topk_ids, topk_weights)
    return hidden.new_empty(hidden.shape)


def _no_backward(ctx, grad):
    raise CKVPConfigError("ckvp::offload_experts is inference-only: a backward reached the offloaded experts (the "
                          "forward ran with grad mode on). Fix: run the model under torch.no_grad() or "
                          "torch.inference_mode() (HF generate() does); to train, load the model without offloading "
                          "its experts")


# a backward through the op raises the error above (torch's own, without it, names no fix)
offload_experts.register_autograd(_no_backward, setup_context=lambda ctx, inputs, output: None)


#: op name -> its Python handle (read by :func:`ckvp_compile.ops.register_all`).
OPS = {"offload_experts": offload_experts}
