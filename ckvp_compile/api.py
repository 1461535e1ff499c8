"""``ckvp_compile.compile``: ``torch.compile(backend="ckvp")`` plus what a backend cannot do, expert offload.

    compiled = ckvp_compile.compile(model, expert_offload=4)                 # nn.Module -> OptimizedModule
    model.forward = ckvp_compile.compile(model.forward, expert_offload=4)  # HF generate() calls model.forward
    ckvp_compile.offloader_of(model).stats()                               # hit rate, bytes copied, recall, ...

Why a wrapper: a torch.compile backend is called after Dynamo has traced the model, with the graph and its inputs
(the parameters among them, on the device they were traced on, passed in again at every call) but not the model.
It cannot move weights to host memory or swap the model's experts modules, and a model whose experts do not fit
on the device could not have been traced with them there in the first place. So offloading is a call on the model
before tracing (:func:`ckvp_compile.offload_experts`), and the ``expert_offload`` option of the backend states the
resident count, which the backend checks for every graph (``CKVPConfigError`` naming this function otherwise).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Mapping

import torch

from .config import CKVPConfig
from .errors import CKVPConfigError, CKVPWarning

__all__ = ["compile"]


def compile(model: Any, *, expert_offload: int = 0, offload_options: Mapping[str, Any] | None = None,
            options: Mapping[str, Any] | None = None, mode: str | None = None,
            **torch_compile_kwargs: Any) -> Callable:
    """Offload the model's experts (when asked), then ``torch.compile(model, backend="ckvp", options=...)``.

    Args:
        model: an ``nn.Module``, or a bound method of one (``model.forward``: what HF ``generate()`` calls).
        expert_offload: C, experts kept resident on the device per MoE layer, 1..E, the rest in (pinned) host
            memory (:func:`ckvp_compile.offload_experts`, in place on the module); 0: no offload. A model already
            offloaded with C resident is used as it is. May be given in ``options`` instead (not both, unless equal).
        offload_options: further keyword arguments of :func:`ckvp_compile.offload_experts` (``margin``,
            ``lookahead``, ``policy``, ``prefetch``, ``predictor``, ``measure_stalls``); for a model already
            offloaded, the ones it was offloaded with (or none).
        options: the backend's options (:class:`CKVPConfig` fields); ``expert_offload`` is added to them.
        mode: ``torch.compile``'s mode; passed as ``options["mode"]`` (torch refuses ``mode`` with ``options``).
        **torch_compile_kwargs: any other ``torch.compile`` argument (``fullgraph``, ``dynamic``, ``disable``).
    Returns:
        What ``torch.compile`` returns for ``model``: an ``OptimizedModule`` for a module, a function for a method.
        Statistics: ``ckvp_compile.offloader_of(model).stats()`` (:class:`~ckvp_compile.runtime.offload_policy.
        OffloadStats`). Run the model under ``torch.no_grad()`` / ``torch.inference_mode()`` (the offload op has
        no autograd formula; ``generate()`` does this).
    Raises:
        CKVPConfigError: ``backend=`` given; ``model`` not a module or a method of one; a bad option (including
            ``expert_offload`` not an int or outside 1..E, with E the model's experts per layer); ``expert_offload``
            given twice with different values; a model with no offloadable experts, or already offloaded with
            another resident count or other ``offload_options``.
        TypeError: a keyword argument ``torch.compile`` does not take (raised before any expert moves).
    """
    from .runtime.offload import _find_moe_layers, offload_experts, offloader_of, owning_module

    if "backend" in torch_compile_kwargs:
        raise CKVPConfigError("ckvp_compile.compile always uses backend='ckvp'; for another backend call "
                              "torch.compile directly")
    # an argument torch.compile does not take raises its TypeError here, before the model's experts move
    inspect.signature(torch.compile).bind(model, **torch_compile_kwargs)
    opts = dict(options or {})
    if expert_offload and opts.get("expert_offload", expert_offload) != expert_offload:
        raise CKVPConfigError(f"expert_offload={expert_offload!r} conflicts with options['expert_offload']="
                              f"{opts['expert_offload']!r}; give one")
    if expert_offload or "expert_offload" not in opts:
        opts["expert_offload"] = expert_offload
    with warnings.catch_warnings():  # validate now; the backend validates (and warns) again when it runs
        warnings.simplefilter("ignore", CKVPWarning)
        config = CKVPConfig.from_options(opts, mode=mode)
    if mode not in (None, "default"):
        opts["mode"] = config.mode
    resident = config.expert_offload
    if resident:
        opts_off = dict(offload_options or {})
        known = set(inspect.signature(offload_experts).parameters) - {"model", "resident"}
        if set(opts_off) - known:
            raise CKVPConfigError(f"offload_options {sorted(set(opts_off) - known)} are not options of "
                                  f"ckvp_compile.offload_experts; the options are {sorted(known)}")
        current = offloader_of(model)  # raises for a non-module
        if current is not None:
            if current.planner.capacity != resident:
                raise CKVPConfigError(
                    f"expert_offload={resident}, but the model is already offloaded with "
                    f"{current.planner.capacity} experts resident per layer; give that number, or load the model again")
            if any(k not in current.options or current.options[k] != v for k, v in opts_off.items()):
                raise CKVPConfigError(  # they would be silently ignored: the experts are offloaded already
                    f"offload_options {opts_off} differ from those the model was offloaded with "
                    f"({current.options or 'unknown'}); offload options apply only when the experts are offloaded: "
                    "give the same ones (or none), or load the model again")
        else:
            target = owning_module(model)
            layers = _find_moe_layers(target)
            if layers:
                e = int(layers[0]["module"].gate_up_proj.shape[0])
                if not 1 <= resident <= e:
                    raise CKVPConfigError(
                        f"expert_offload must be in 1..{e} (experts kept resident per MoE layer; the model has {e} "
                        f"per layer; {e} keeps all on the device), or 0 for no offload, got {resident}")
            offload_experts(target, resident=resident, **opts_off)
    elif offload_options:
        raise CKVPConfigError("offload_options are given but expert_offload is 0; set expert_offload=C (1..E)")
    return torch.compile(model, backend="ckvp", options=opts, **torch_compile_kwargs)
