"""Latent KV caches users hand to their models: ``CKVPStaticCache`` (HF) and ``use_latent_cache`` (gpt-fast).

The recipe (README, "Latent KV cache")::

    bases = ckvp_compile.calibrate(model, samples, kv_ratio=4)          # once per model; bases.save(path)
    cache = CKVPStaticCache(model.config, bases, max_cache_len=4096, max_batch_size=8)
    model.forward = torch.compile(model.forward, backend="ckvp")
    model.generate(ids, past_key_values=cache, disable_compile=True, ...)

The cache's per-layer dense K/V tensors are zero-memory phantoms of a
:class:`~ckvp_compile.runtime.store.LatentKVStore`; only the store's latents take memory. The ckvp backend
rewrites the model's cache writes and reads into the store. Used eagerly (without the backend), the cache
raises a :class:`~ckvp_compile.errors.CKVPError` saying so instead of computing anything.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from ..errors import CKVPConfigError, CKVPError
from .store import COPY_REFUSED, LatentKVStore, uncompiled_size_reason

_EAGER_ERROR = (
    "This is a ckvp latent KV cache: its dense K/V tensors hold no data and only a model compiled with "
    "torch.compile(..., backend='ckvp') can use it. Compile the model's forward with the ckvp backend, or use a "
    "dense cache (transformers StaticCache) for eager runs. If the forward is compiled with the ckvp backend, "
    "torch.compile split it at a graph break (an earlier error inside it, or unsupported code) and runs the cache "
    "update outside the graph: call torch._dynamo.reset() and run again (TORCH_LOGS=graph_breaks shows the break; "
    "a frame past torch._dynamo.config.recompile_limit also runs eagerly). Two common ways to run it "
    "uncompiled: torch.compile(model).generate(...) (generate calls the original forward: compile model.forward "
    "instead), and transformers' own compilation in generate() (compile_config, or its automatic compile of decode "
    "steps, runs the prefill uncompiled): compile model.forward yourself and pass disable_compile=True."
)
_EAGER_ERROR_BUFFERS = (
    "This module's k_cache / v_cache are ckvp latent-cache phantoms (use_latent_cache): they hold no data and only "
    "a model compiled with torch.compile(..., backend='ckvp') can use them. Compile the model with the ckvp "
    "backend, or, for eager runs, give the modules dense buffers again (new cache modules: gpt-fast's "
    "setup_caches(...) keeps the caches of an unchanged shape). If the model is compiled with "
    "the ckvp backend, torch.compile ran this module outside the graph (a graph break, or a frame past "
    "torch._dynamo.config.recompile_limit): pass fullgraph=True to see why, or call torch._dynamo.reset()."
)


def _raise_config_error(message: str, compiling: bool) -> None:
    """Raise the error for a cache that does not fit the model, from outside the traced code, and drop Dynamo's
    compiled frames.

    Dynamo breaks the graph at this call (``torch.compiler.disable``) and runs it eagerly, so the user gets the
    :class:`CKVPConfigError` itself (torch 2.11's Dynamo failed to trace a ``raise`` of it in the cache update, with
    an internal AssertionError). Dynamo has compiled the frames up to the call, split at it, and would keep them: a
    later call, with a correct cache too (even one built before this error), would reuse the split frames and run the
    cache update as a graph of its own, without its attention (an unclear error at the write into the latent cache's
    placeholder). So it calls ``torch._dynamo.reset()`` first (other compiled functions in the process recompile on
    their next call). ``compiling``: ``torch.compiler.is_compiling()`` at the call site (here, outside the trace, it is
    always False); an eager call resets nothing.
    """
    if compiling:
        torch._dynamo.reset()
    raise CKVPConfigError(message)


#: Why fullgraph=True stops at the cache check (Dynamo's message names the reason; the graph break is the point).
_MISFIT_REASON = ("the CKVPStaticCache does not fit the model (its dtype or max_batch_size): compile without "
                  "fullgraph=True to get the CKVPConfigError that names the fix")
try:
    _raise_config_error = torch.compiler.disable(_raise_config_error, reason=_MISFIT_REASON)
except TypeError:  # a torch without disable(reason=...)
    _raise_config_error = torch.compiler.disable(_raise_config_error)


def _static_cache_base():
    from transformers import StaticCache

    return StaticCache


def _check_bases(bases: Any, layers: int | list[int], num_kv_heads: int, head_dim: int) -> None:
    """Raise :class:`CKVPConfigError` unless ``bases`` cover exactly ``layers`` (a count: layers 0..n-1; or the
    indices of the layers that keep a KV cache) with ``num_kv_heads`` KV heads of ``head_dim``."""
    if not all(hasattr(bases, a) for a in ("groups", "num_kv_heads", "head_dim")):
        raise CKVPConfigError(
            f"bases must be the LatentBases of this model, got {type(bases).__name__}. Fix: bases = "
            "ckvp_compile.calibrate(model, samples, kv_ratio=...) (or LatentBases.load(path, model=model))")
    covered = sorted(layer for g in bases.groups for layer in g)
    expected = list(range(layers)) if isinstance(layers, int) else sorted(layers)
    if covered != expected or (bases.num_kv_heads, bases.head_dim) != (num_kv_heads, head_dim):
        which = (f"{len(expected)} layers" if expected == list(range(len(expected))) else
                 f"KV caches in layers {expected}")
        raise CKVPConfigError(
            f"the bases cover layers {covered} with Hkv={bases.num_kv_heads}, D={bases.head_dim}, but the model has "
            f"{which} with Hkv={num_kv_heads}, D={head_dim}. Fix: calibrate bases for this model "
            "(ckvp_compile.calibrate)."
        )


def _layer_kv_shape(cfg: Any) -> tuple[int, int]:
    """(Hkv, D) of one (layer's) text config; global access that transformers refuses (a per-layer attribute of a
    heterogeneous config) raises its ``RuntimeError``."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    num_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return num_kv, head_dim


def _kv_shape(text: Any, layers: list[int]) -> tuple[int, int]:
    """The (Hkv, D) every cached layer's K/V has, from the model's text config.

    Args:
        text: the text config (``config.get_text_config()``).
        layers: indices of the layers that keep a KV cache.
    Returns:
        (num_kv_heads, head_dim), both ints.
    Raises:
        CKVPConfigError: a heterogeneous config (transformers' ``per_layer_config``, e.g. Gemma-4) whose layers
            have different KV shapes; the latent store holds one shape.
    """
    try:
        return _layer_kv_shape(text)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError: read each layer's config
        per_layer = getattr(text, "per_layer_config", None)
        if per_layer is None:
            raise
    shapes = [_layer_kv_shape(per_layer[i]) for i in layers]
    if len(set(shapes)) > 1:
        raise CKVPConfigError(
            f"this model's layers have different KV shapes (Hkv, D) {sorted(set(shapes))} (a per-layer config); "
            "the ckvp latent cache holds one shape for every layer. Fix: use a dense cache "
            "(cache_implementation='static') with backend='ckvp'.")
    return shapes[0]


class CKVPStaticCache(_static_cache_base()):  # type: ignore[misc]
    """A transformers ``StaticCache`` whose storage is the ckvp cross-layer latent store.

    Args:
        config: the model's config (``model.config``).
        bases: :class:`~ckvp_compile.latent.LatentBases` calibrated for this model.
        max_cache_len: S_max, slots per sequence.
        max_batch_size: B.
        device, dtype: of the model's K/V (default: cpu, and float32).
        latent_format: storage of the key and value latents, one format for both or a (K, V) pair:
            ``"auto"`` (default: the bases' planned per-group formats from :mod:`ckvp_compile.latent.planner`,
            else ``"float"``), ``"float"``, ``"int8"``, ``"int4"``, ``"int2"``, optionally with ``/block`` (see
            :mod:`ckvp_compile.kernels.latent_format`).
        latent_dtype: dtype of ``"float"`` latents (default ``dtype``).
        basis_dtype: dtype of the bases on the device (default ``latent_dtype``; ``torch.float8_e4m3fn`` halves
            their bytes, see :class:`~ckvp_compile.runtime.store.LatentKVStore`).
        residual_format: '' (default, none) or the ALR-KVD residual's quantized format, e.g. ``"int2/64"``
            (:mod:`ckvp_compile.kernels.residual`).
        recent_window: keep the keys and values of the last ``recent_window`` tokens exact (dense) beside the
            latent (default 0: none); see :class:`~ckvp_compile.runtime.store.LatentKVStore`.
        page_size: P > 0 pages the latents (vLLM-style page table; default 0: one contiguous row per sequence
            and slot): memory is taken from a pool of ``num_pages`` pages of P slots as each call's slots are
            reached (the backend maps them before the call, at the price of one device sync per call), so
            sequences of different lengths share one pool. Must divide max_cache_len.
        num_pages: pages in the pool (default: max_batch_size * max_cache_len / page_size, every slot mappable);
            fewer hold less memory and raise :class:`~ckvp_compile.errors.CKVPConfigError` when exhausted.
            ``self.store.release(b)`` gives sequence b's pages back, :meth:`reset` all of them.
        latent_layout: ``"row-major"`` (default) or ``"unit-major"``, or ``"KEYS/VALUES"`` for each its own (e.g.
            ``"row-major/unit-major"``): the latents' strides (:mod:`ckvp_compile.kernels.latent_layout`; same
            results; unit-major is slower on the H200).
    Raises:
        CKVPConfigError: the bases do not match the model's layers, KV heads or head dim (only the layers that keep
            a cache count: a KV-shared layer, which HF's StaticCache gives a ``DummyLayer``, reads an earlier
            layer's); layers of different KV shapes (a per-layer config); a sliding-window layer; an unknown format; a
            recent_window outside [0, max_cache_len); a bad page_size / num_pages, or paging with a
            residual_format or online bases; (when used) the page pool runs out.
        CKVPError: (when used) any eager use; compile the model with ``backend="ckvp"``.
    Notes:
        Memory: ``self.store.nbytes()`` (latents or their page pools, slot positions, the page table and the
        recent window per sequence; bases and RoPE tables once).
    """

    def __init__(self, config: Any, bases: Any, max_cache_len: int, max_batch_size: int = 1,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 latent_format: str | tuple[str, str] = "auto", latent_dtype: torch.dtype | None = None,
                 basis_dtype: torch.dtype | None = None, residual_format: str = "", recent_window: int = 0,
                 page_size: int = 0, num_pages: int | None = None, latent_layout: str = "row-major") -> None:
        super().__init__(config=config, max_cache_len=max_cache_len)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        # layers that keep a cache: HF gives the others (KV-shared layers reading an earlier layer's keys and
        # values, e.g. Gemma-4's num_kv_shared_layers; layers without attention) a DummyLayer, which stores nothing
        cached = [i for i, layer in enumerate(self.layers) if callable(getattr(layer, "lazy_initialization", None))]
        sliding = [i for i, layer in enumerate(self.layers) if getattr(layer, "is_sliding", False)]
        if sliding:  # first: calibrate() covers only the full-attention layers of such a model
            raise CKVPConfigError(
                f"this model uses sliding-window attention (layers {sliding[:8]}{'...' if len(sliding) > 8 else ''}; "
                f"config sliding_window={getattr(text, 'sliding_window', None)}), whose cache keeps only a window of "
                f"recent tokens; the ckvp latent cache does not support it yet. Fix: use a dense cache "
                f"(cache_implementation='static') with backend='ckvp', or a model without a sliding window.")
        num_kv, head_dim = _kv_shape(text, cached)
        _check_bases(bases, cached, num_kv, head_dim)
        k_format, v_format = _formats(latent_format)
        self.store = LatentKVStore(bases, max_batch_size, max_cache_len, device, dtype, k_format, v_format,
                                   latent_dtype, basis_dtype, residual_format, recent_window, page_size, num_pages,
                                   latent_layout)
        for i in cached:
            layer = self.layers[i]
            # HF's lazy_initialization sets the layer's shapes, dtype and flags, and allocates the dense K/V from
            # the probe's device: a meta probe allocates nothing (a real one would need one layer's dense cache,
            # which at large batch x context does not fit: the capacity the latent cache exists for)
            probe = torch.empty(max_batch_size, num_kv, 0, head_dim, device="meta", dtype=dtype)
            counter = getattr(layer, "cumulative_length", None)
            layer.lazy_initialization(probe, probe)
            layer.device = self.store.device
            if isinstance(counter, torch.Tensor):  # the layer's length counter: lazy_initialization moved it to meta
                layer.cumulative_length = counter.to(self.store.device)
                torch._dynamo.mark_static_address(layer.cumulative_length)
            layer.keys = self.store.phantom(i, "k")
            layer.values = self.store.phantom(i, "v")
            for t in (layer.keys, layer.values):
                torch._dynamo.mark_static_address(t)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        """As ``StaticCache.update``, traced by the ckvp backend.

        Raises:
            CKVPConfigError: the model's K/V dtype or batch size is not the cache's (the message names the
                argument to fix). Raised while torch.compile traces, it marks Dynamo's frames for a reset at the
                next ``CKVPStaticCache(...)``, so the model compiles afresh with a correct cache.
            CKVPError: called in eager code (not under the ckvp backend).
        """
        if key_states.dtype != self.store.dtype:  # else SDPA fails while tracing, on mixed dtypes
            _raise_config_error(
                f"this ckvp latent KV cache was built for {self.store.dtype} K/V, but the model's keys are "
                f"{key_states.dtype}. Fix: CKVPStaticCache(..., dtype={key_states.dtype}).",
                torch.compiler.is_compiling())
        if key_states.shape[0] != self.store.batch_size:  # else the cache write fails while tracing, on shapes
            _raise_config_error(
                f"this ckvp latent KV cache holds max_batch_size={self.store.batch_size} sequences, but the model "
                f"runs a batch of {key_states.shape[0]}. Fix: CKVPStaticCache(..., max_batch_size="
                f"{key_states.shape[0]}) (a latent cache serves exactly its batch size).",
                torch.compiler.is_compiling())
        if not torch.compiler.is_compiling():
            raise CKVPError(uncompiled_size_reason(self.store) + _EAGER_ERROR)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: reorder the store's sequences (StaticCache's own reorder would replace the phantoms by dense
        NaN tensors)."""
        self.store.reorder(beam_idx)

    def __deepcopy__(self, memo: dict) -> "CKVPStaticCache":
        """Refused (HF's prompt-reuse recipe deep-copies a prefilled cache): raises CKVPConfigError naming the fix
        (a new cache, prefilled again); a copy's tensors would not be registered with the compiled graphs."""
        raise CKVPConfigError(COPY_REFUSED)

    def reset(self) -> None:
        """Start over (a new ``generate()``): zero the store's latents and every layer's length counter, and unmap
        every page of a paged store."""
        self.store.reset()
        for layer in self.layers:
            counter = getattr(layer, "cumulative_length", None)
            if isinstance(counter, torch.Tensor):
                counter.zero_()


def _formats(latent_format: str | tuple[str, str]) -> tuple[str, str]:
    if isinstance(latent_format, str):
        return latent_format, latent_format
    if isinstance(latent_format, (tuple, list)) and len(latent_format) == 2:
        return latent_format[0], latent_format[1]
    raise CKVPConfigError(f"latent_format must be a format name or a (K, V) pair of them, got {latent_format!r}")


def use_latent_cache(model: torch.nn.Module, bases: Any, latent_format: str | tuple[str, str] = "auto",
                     latent_dtype: torch.dtype | None = None,
                     basis_dtype: torch.dtype | None = None, recent_window: int = 0, page_size: int = 0,
                     num_pages: int | None = None, latent_layout: str = "row-major") -> LatentKVStore:
    """Replace a gpt-fast-style model's per-layer ``k_cache`` / ``v_cache`` buffers by latent-store phantoms.

    Call after the model's ``setup_caches(max_batch_size, max_seq_length)``. Buffers are found as pairs of
    (B, Hkv, S_max, D) buffers named ``k_cache`` and ``v_cache`` in the modules of each numbered layer, in
    layer order.

    Args:
        model: the model (its caches already set up).
        bases: :class:`~ckvp_compile.latent.LatentBases` calibrated for it.
        latent_format, latent_dtype, basis_dtype, recent_window, page_size, num_pages, latent_layout: as for
            :class:`CKVPStaticCache` (a paged store's pages are mapped by the backend before each call, from the
            model's ``input_pos``).
    Returns:
        The :class:`LatentKVStore` now holding the model's KV state (``store.reset()`` starts over and unmaps
        every page, ``store.release(b)`` unmaps sequence b's); each cache module keeps it as ``ckvp_store``.
    Raises:
        CKVPConfigError: no such buffers, the bases do not match them, or bad paging arguments (see
            :class:`~ckvp_compile.runtime.store.LatentKVStore`).
    """
    caches = [m for m in model.modules() if isinstance(getattr(m, "k_cache", None), torch.Tensor)
              and isinstance(getattr(m, "v_cache", None), torch.Tensor)]
    if not caches:
        raise CKVPConfigError("no module with k_cache / v_cache buffers found; call model.setup_caches(...) first")
    b, hkv, s, d = caches[0].k_cache.shape
    _check_bases(bases, len(caches), hkv, d)
    store = LatentKVStore(bases, b, s, caches[0].k_cache.device, caches[0].k_cache.dtype, *_formats(latent_format),
                          latent_dtype, basis_dtype, recent_window=recent_window, page_size=page_size,
                          num_pages=num_pages, latent_layout=latent_layout)
    for i, m in enumerate(caches):
        m.k_cache = store.phantom(i, "k")
        m.v_cache = store.phantom(i, "v")
        m.ckvp_store = store  # the model keeps its store alive (the phantom registry only holds weak refs)
        _refuse_eager_calls(m)
    return store


def _refuse_eager_calls(module: torch.nn.Module) -> None:
    """Make the cache module's ``update`` and ``forward`` raise :class:`CKVPError` outside torch.compile.

    Eagerly, ``k_cache[:, :, input_pos] = k`` writes into the phantom's one shared element (PyTorch only warns)
    and later reads return it: wrong logits without an error. Under Dynamo the guard is the constant
    ``is_compiling() == True`` and vanishes from the graph. The guard is a method bound to the module that calls
    the class's own method. Idempotent.
    """
    for name in ("update", "forward"):
        if name in vars(module) or not callable(getattr(type(module), name, None)):
            continue  # no such method, or already an instance attribute (guarded, or a user's own override)

        def guarded(self: torch.nn.Module, *args: Any, _name: str = name, **kwargs: Any) -> Any:
            if not torch.compiler.is_compiling():
                store = getattr(self, "ckvp_store", None)
                raise CKVPError((uncompiled_size_reason(store) if store is not None else "") + _EAGER_ERROR_BUFFERS)
            return getattr(type(self), _name)(self, *args, **kwargs)

        guarded._ckvp_refuses_eager = True  # type: ignore[attr-defined]
        setattr(module, name, types.MethodType(guarded, module))


def allow_eager_calls(module: torch.nn.Module) -> None:
    """Undo :func:`use_latent_cache`'s eager guard on one cache module (after its dense buffers are put back).

    Args:
        module: a module :func:`use_latent_cache` bound (others are left as they are).
    Raises:
        Nothing: a module without the guard is left as it is. The caller puts the dense ``k_cache`` / ``v_cache``
        back first (as ``inspection.capture.LatentCaches.restore`` does); with phantoms left, eager calls compute
        garbage again.
    """
    for name in ("update", "forward"):
        bound = vars(module).get(name)
        if getattr(getattr(bound, "__func__", None), "_ckvp_refuses_eager", False):
            delattr(module, name)
