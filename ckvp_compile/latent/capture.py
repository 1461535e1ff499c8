"""Drive one static-cache prefill of a model: the call whose Dynamo graph calibration reads.

Two model styles are driven (the same two the backend understands):

* a Hugging Face causal LM: a fresh ``transformers.StaticCache`` per call, explicit ``position_ids``. The cache
  keyword is ``cache`` in transformers >= 5.24 (``past_key_values`` before; a deprecated alias until 5.40) and
  ``cache_position`` exists only in older versions (5.17 on the GPU machine), so :func:`hf_step_kwargs` takes
  the names from the model's ``forward`` signature;
* a gpt-fast style model (``setup_caches(batch, seq)`` and ``forward(idx, input_pos)``): its own per-layer caches,
  zeroed or reallocated by ``setup_caches``.

Anything else is called as ``model(input_ids)``.

Library code: :mod:`ckvp_compile.testing.decoding` imports :func:`make_static_cache` and :func:`hf_step_kwargs`
from here (library code never imports ``ckvp_compile.testing``).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

import torch

__all__ = ["hf_step_kwargs", "is_gpt_fast", "is_hf_causal_lm", "kept_module_setup", "make_static_cache", "prefill",
           "uncompiled_forward"]


@contextlib.contextmanager
def uncompiled_forward(model: Any) -> Iterator[None]:
    """Inside the block, ``model`` runs its own ``forward`` even where the user replaced it with
    ``torch.compile(model.forward, ...)`` (the README's generate() recipe); the compiled one is put back after.

    A compiled forward would run as a compiled function of its own inside an outer ``torch.compile(model, ...)``,
    so the outer (recording) backend would see no graph. Raises nothing; a model without such a forward is left as
    it is.
    """
    compiled = getattr(model, "__dict__", {}).get("forward")
    if not hasattr(compiled, "_torchdynamo_orig_callable"):
        yield
        return
    del model.forward
    try:
        yield
    finally:
        model.forward = compiled


@contextlib.contextmanager
def kept_module_setup(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block the model may be re-set-up (gpt-fast ``setup_caches`` of another batch or length, latent
    phantoms swapped for dense buffers); on exit every module is put back as it was: its attributes, submodules,
    buffers and parameters (the same objects, so the user's caches, ``max_batch_size`` and any
    ``use_latent_cache`` phantoms return).

    Only the module *structure* is restored: a cache tensor the block wrote into in place (gpt-fast zeroes caches
    of an unchanged shape) keeps what was written. A KV cache's contents belong to the generation that filled it;
    the next prefill from position 0 overwrites every slot it reads. Raises nothing.
    """
    saved = []
    for module in model.modules():
        state = dict(module.__dict__)
        for key in ("_modules", "_buffers", "_parameters"):
            if isinstance(state.get(key), dict):
                state[key] = dict(state[key])
        saved.append((module, state))
    try:
        yield
    finally:
        for module, state in saved:
            module.__dict__.clear()
            module.__dict__.update(state)


def is_hf_causal_lm(model: torch.nn.Module) -> bool:
    """True for a Hugging Face ``PreTrainedModel`` (checked without importing transformers)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
               for c in type(model).__mro__)


def is_gpt_fast(model: torch.nn.Module) -> bool:
    """True for a gpt-fast style model: it has a callable ``setup_caches(max_batch_size, max_seq_length)``."""
    return callable(getattr(model, "setup_caches", None))


def make_static_cache(model: torch.nn.Module, max_cache_len: int):
    """Return a fresh, empty ``transformers.StaticCache`` for ``model`` holding ``max_cache_len`` tokens.

    The buffers are allocated lazily on the first ``update`` (inside the graph when that call is compiled), in
    the dtype and on the device of the keys written.
    """
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_cache_len)


def hf_step_kwargs(model: torch.nn.Module, input_ids: torch.Tensor, cache: Any, start: int) -> dict[str, Any]:
    """Keyword arguments for one cached forward of a Hugging Face causal LM.

    Args:
        model: the (uncompiled) HF model; its ``forward`` signature decides the argument names.
        input_ids: (B, S) long, the new tokens.
        cache: the ``StaticCache`` of this sequence.
        start: absolute position of ``input_ids[:, 0]``.
    Returns:
        ``input_ids``, ``position_ids`` (B, S) long, the cache under ``cache=`` (5.24) or ``past_key_values=``
        (older), ``cache_position`` (S,) long when the signature has it, and ``use_cache=True``.
    """
    bsz, seqlen = input_ids.shape
    positions = torch.arange(start, start + seqlen, device=input_ids.device)
    params = inspect.signature(model.forward).parameters
    kwargs: dict[str, Any] = {
        "input_ids": input_ids,
        "position_ids": positions[None].repeat(bsz, 1),
        "use_cache": True,
    }
    kwargs["cache" if "cache" in params else "past_key_values"] = cache
    if "cache_position" in params:
        kwargs["cache_position"] = positions
    return kwargs


def prefill(model: torch.nn.Module, fn: Callable, input_ids: torch.Tensor, max_cache_len: int) -> Any:
    """Run one prefill of ``input_ids`` from position 0 through ``fn`` (``model`` or a compiled ``model``).

    A fresh cache is set up first (a new ``StaticCache``; ``setup_caches`` for gpt-fast). Caller holds
    ``torch.no_grad()``.

    Args:
        model: the uncompiled model (its type decides how it is driven).
        fn: what is called, e.g. ``torch.compile(model, backend=...)``.
        input_ids: (B, S) long token ids.
        max_cache_len: cache length S_max >= S.
    Returns:
        Whatever ``fn`` returns.
    """
    bsz, seqlen = input_ids.shape
    if is_hf_causal_lm(model):
        return fn(**hf_step_kwargs(model, input_ids, make_static_cache(model, max_cache_len), 0))
    if is_gpt_fast(model):
        model.setup_caches(bsz, max_cache_len)
        return fn(input_ids, torch.arange(seqlen, device=input_ids.device))
    return fn(input_ids)
