"""Load a model and drive it through a recorded ``ckvp`` compile: the calls whose graphs the report shows.

Three kinds of model are driven without example inputs:

* a Hugging Face causal LM: a static-cache prefill of ``prompt_len`` random token ids, then (``decode=True``)
  one decode step, both with a fresh ``transformers.StaticCache`` (or, given latent bases, a fresh
  :class:`~ckvp_compile.runtime.hf_cache.CKVPStaticCache`). The cache argument is called ``cache`` in
  transformers >= 5.24 (``past_key_values`` before) and ``cache_position`` exists only in older versions, so
  the keyword names are taken from the model's ``forward`` signature;
* a gpt-fast style model (anything with ``setup_caches(batch, seq)`` and ``forward(idx, input_pos)``): the same
  prefill and decode through its own caches (given latent bases, turned into latent-store phantoms by
  :func:`~ckvp_compile.runtime.hf_cache.use_latent_cache`, and given back by :meth:`LatentCaches.restore`);
* any other ``nn.Module``: one call with the user's example inputs.

This module only runs models; what was recorded is turned into a report by :mod:`.report`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import CKVPModelLoadError
from ..latent.capture import is_hf_causal_lm

#: Seed of the random prompt, so two inspections of one model see the same tokens.
PROMPT_SEED = 0


def load_model_dir(path: str | Path, dtype: str = "float32") -> torch.nn.Module:
    """Load a Hugging Face causal LM from a local directory, in eval mode, without network access and without
    running code shipped with the checkpoint (``trust_remote_code=False``).

    Args:
        path: a directory holding ``config.json`` and the weights (``model.safetensors`` ...).
        dtype: 'float32' (default), 'bfloat16', 'float16', or 'auto' (the checkpoint's own dtype).
    Returns:
        The model (an ``*ForCausalLM``).
    Raises:
        CKVPModelLoadError: the path does not exist, is not a directory, has no ``config.json``, or
            transformers cannot load it (the message keeps transformers' first line and names the fix; a model
            that needs its own code says so).
        ValueError: an unknown ``dtype``.
    """
    if dtype not in ("float32", "bfloat16", "float16", "auto"):
        raise ValueError(f"dtype must be 'float32', 'bfloat16', 'float16' or 'auto', got {dtype!r}")
    path = Path(path)
    if not path.exists():
        raise CKVPModelLoadError(f"model directory {str(path)!r} does not exist; pass the directory of a Hugging "
                                 "Face model (config.json + weights)")
    if not path.is_dir():
        raise CKVPModelLoadError(f"{str(path)!r} is a file, not a model directory; pass the directory that holds "
                                 "config.json and the weights")
    if not (path / "config.json").is_file():
        raise CKVPModelLoadError(f"{str(path)!r} has no config.json, so it is not a Hugging Face model directory; "
                                 "pass the directory that holds config.json and the weights")
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:  # pragma: no cover - transformers is an optional dependency
        raise CKVPModelLoadError(f"loading {str(path)!r} needs transformers: pip install 'ckvp-compile[hf]' "
                                 f"({exc})") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype if dtype == "auto" else getattr(torch, dtype),
                                                     local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError ... for a bad directory
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if "custom code" in first or "trust_remote_code" in first:
            raise CKVPModelLoadError(f"{str(path)!r} holds a model with its own code, which is not run here "
                                     "(trust_remote_code=False). Fix: load it yourself, e.g. AutoModelForCausalLM."
                                     "from_pretrained(path, trust_remote_code=True), after reading that code, and "
                                     "call ckvp_compile.inspect(model)") from None
        raise CKVPModelLoadError(f"cannot load a causal LM from {str(path)!r}: {type(exc).__name__}: {first}; "
                                 "check that config.json and the weights belong to a causal LM") from None
    return model.eval()


def is_gpt_fast(model: torch.nn.Module) -> bool:
    """True for a gpt-fast style model: ``setup_caches(batch, seq)`` and a ``config.vocab_size``."""
    return callable(getattr(model, "setup_caches", None)) and hasattr(getattr(model, "config", None), "vocab_size")


def _device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _dtype_of(model: torch.nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


@dataclass
class LatentCaches:
    """The latent caches an inspection drives the model with, and what they replaced.

    Attributes:
        bases: the :class:`~ckvp_compile.latent.LatentBases`. k_format, v_format: latent storage formats.
        latent_dtype: dtype of 'float' latents (None: the model's dtype).
        stores: every :class:`~ckvp_compile.runtime.store.LatentKVStore` made, in order (one per prefill).
    """

    bases: Any
    k_format: str = "float"
    v_format: str = "float"
    latent_dtype: torch.dtype | None = None
    stores: list[Any] = field(default_factory=list)
    _saved: list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor]] = field(default_factory=list, repr=False)

    def hf_cache(self, model: torch.nn.Module, max_cache_len: int) -> Any:
        """Return a fresh batch-1 ``CKVPStaticCache`` for an HF model (its store is appended to ``stores``)."""
        from ..runtime.hf_cache import CKVPStaticCache

        cache = CKVPStaticCache(model.config, self.bases, max_cache_len, 1, device=_device_of(model),
                                dtype=_dtype_of(model), latent_format=(self.k_format, self.v_format),
                                latent_dtype=self.latent_dtype)
        self.stores.append(cache.store)
        return cache

    def gpt_fast(self, model: torch.nn.Module) -> None:
        """Turn a gpt-fast model's (just set up) dense caches into phantoms of a new store, keeping the buffers."""
        from ..runtime.hf_cache import use_latent_cache

        if not self._saved:
            self._saved = [(m, m.k_cache, m.v_cache) for m in model.modules()
                           if isinstance(getattr(m, "k_cache", None), torch.Tensor)
                           and isinstance(getattr(m, "v_cache", None), torch.Tensor)]
        self.stores.append(use_latent_cache(model, self.bases, (self.k_format, self.v_format), self.latent_dtype))

    def restore(self) -> None:
        """Give a gpt-fast model back the dense cache buffers it had before :meth:`gpt_fast` (no-op for HF)."""
        from ..runtime.hf_cache import allow_eager_calls

        for m, k, v in self._saved:
            m.k_cache, m.v_cache = k, v
            allow_eager_calls(m)
            if hasattr(m, "ckvp_store"):
                del m.ckvp_store
        self._saved = []


def _hf_kwargs(model: torch.nn.Module, ids: torch.Tensor, cache: Any, start: int) -> dict[str, Any]:
    """Keyword arguments of one cached forward of an HF causal LM (names from its ``forward`` signature)."""
    params = inspect.signature(model.forward).parameters
    positions = torch.arange(start, start + ids.shape[1], device=ids.device)
    kwargs: dict[str, Any] = {"input_ids": ids, "position_ids": positions[None].repeat(ids.shape[0], 1),
                              "use_cache": True}
    kwargs["cache" if "cache" in params else "past_key_values"] = cache
    if "cache_position" in params:
        kwargs["cache_position"] = positions
    return kwargs


def run_phases(
    model: torch.nn.Module,
    compiled: Callable,
    example_inputs: tuple | list | dict | None,
    *,
    decode: bool,
    max_cache_len: int,
    prompt_len: int,
    latent: LatentCaches | None = None,
) -> list[tuple[str, Callable[[], Any]]]:
    """Return the calls to make, as ``(phase, thunk)`` pairs, in order; calling each thunk runs that phase.

    Args:
        model: the uncompiled model (its type decides how it is driven).
        compiled: ``torch.compile(model, ...)``.
        example_inputs: a tuple/list of positional arguments or a dict of keyword arguments; ``None`` drives an
            HF or gpt-fast model through prefill (+ decode).
        decode: add one decode step after the prefill (ignored with ``example_inputs``).
        max_cache_len: static cache length S_max.
        prompt_len: prefill length S.
        latent: drive the model with latent caches of these bases instead of dense ones (HF or gpt-fast
            models only; each prefill makes a new store, appended to ``latent.stores``).
    Returns:
        ``[("prefill", f), ("decode", f)]`` or ``[("call", f)]``.
    Raises:
        ValueError: no example inputs for a model that cannot be driven without them, or
            ``prompt_len + decode > max_cache_len``, or ``prompt_len < 1``, or ``latent`` with example inputs.
    """
    if example_inputs is not None and latent is not None:
        raise ValueError("a latent-cache inspection drives the model itself (an HF causal LM or a gpt-fast style "
                         "model); leave example_inputs out")
    if example_inputs is not None:
        if isinstance(example_inputs, dict):
            return [("call", lambda: compiled(**example_inputs))]
        args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        return [("call", lambda: compiled(*args))]
    hf, gpt_fast = is_hf_causal_lm(model), is_gpt_fast(model)
    if not (hf or gpt_fast):
        raise ValueError(f"{type(model).__name__} is neither a Hugging Face causal LM nor a gpt-fast style model; "
                         "pass example_inputs (a tuple of arguments or a dict of keyword arguments)")
    if prompt_len < 1 or prompt_len + int(decode) > max_cache_len:
        raise ValueError(f"need 1 <= prompt_len and prompt_len + decode <= max_cache_len, but got "
                         f"prompt_len={prompt_len}, decode={decode}, max_cache_len={max_cache_len}")
    device = _device_of(model)
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=gen).to(device)
    state: dict[str, Any] = {}

    if hf:
        from transformers import StaticCache

        def step(ids: torch.Tensor, start: int) -> Any:
            if start == 0:
                state["cache"] = (StaticCache(config=model.config, max_cache_len=max_cache_len) if latent is None
                                  else latent.hf_cache(model, max_cache_len))
            out = compiled(**_hf_kwargs(model, ids, state["cache"], start))
            state["logits"] = out.logits
            return out
    else:

        def step(ids: torch.Tensor, start: int) -> Any:
            if start == 0:
                if latent is not None:
                    latent.restore()  # dense buffers back before setup_caches zeroes them
                model.setup_caches(1, max_cache_len)
                if latent is not None:
                    latent.gpt_fast(model)
            out = compiled(ids, torch.arange(start, start + ids.shape[1], device=device))
            state["logits"] = out
            return out

    def next_token() -> torch.Tensor:
        return state["logits"][:, -1].argmax(dim=-1, keepdim=True)  # (B, 1)

    phases: list[tuple[str, Callable[[], Any]]] = [("prefill", lambda: step(prompt, 0))]
    if decode:
        phases.append(("decode", lambda: step(next_token(), prompt_len)))
    return phases
