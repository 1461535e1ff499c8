"""Drive a model through static-cache prefill + greedy decode, and capture the Dynamo graphs of those calls.

Works for Hugging Face causal LMs (a ``transformers.StaticCache`` passed as the cache, with explicit
``position_ids``) and for :class:`~ckvp_compile.testing.gpt_fast.GptFastMoE` (``setup_caches`` +
``input_pos``), so tests can treat both model styles alike.

transformers 5.24 facts this module relies on (checked): the cache kwarg of ``*ForCausalLM.forward`` is
``cache`` (``past_key_values`` is a deprecated alias until 5.40) and there is no ``cache_position`` argument any
more: a ``StaticLayer`` writes at ``cumulative_length``, a 0-d long tensor it increments in place. Older
versions (5.17 on the GPU machine) take ``past_key_values`` and ``cache_position``; :func:`hf_step_kwargs`
picks whichever the model's signature has. It and :func:`make_static_cache` live in
:mod:`ckvp_compile.latent.capture` (calibration uses them too) and are re-exported here.

``StaticCache`` allocates its K/V buffers lazily, on the first ``update``: when the prefill call is compiled,
the buffers are created *inside the prefill graph* (``torch.zeros`` nodes) and returned as extra graph
outputs; in the decode graph they are placeholders (graph inputs, sources like
``L['kwargs']['cache'].layers[0].keys``), written by ``index_copy_`` at ``cumulative_length`` (a 0-d
placeholder, bumped with ``add_``; the prefill graph reads it too, through a ``.to(device)``). Because
``mark_static_address`` is skipped while Dynamo traces, buffers created by a compiled prefill are NOT static
addresses (no ``_dynamo_static_input_type``); after an eager prefill they are (``compile_prefill=False``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from ..latent.capture import hf_step_kwargs, make_static_cache
from .gpt_fast import GptFastMoE

__all__ = ["prefill_decode_logits", "capture_dynamo_graphs", "capture_prefill_decode_graphs", "hf_step_kwargs",
           "make_static_cache"]


def _is_gpt_fast(model: torch.nn.Module) -> bool:
    return isinstance(model, GptFastMoE) or hasattr(model, "setup_caches")


def _logits(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def prefill_decode_logits(model: torch.nn.Module, input_ids: torch.Tensor, n_decode: int, *,
                          compile_fn: Callable[[torch.nn.Module], Callable] | None = None,
                          max_cache_len: int = 64, compile_prefill: bool = True, cache: Any = None,
                          tokens: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Run a static-cache prefill then ``n_decode`` greedy decode steps; return every call's logits.

    A fresh cache is used per call (a new ``StaticCache``, or ``cache``; for gpt-fast, ``setup_caches`` zeroes or
    reallocates the per-layer caches). ``step = compile_fn(model) if compile_fn else model`` is what runs, e.g.
    ``compile_fn=lambda m: torch.compile(m, backend="ckvp")``. Runs under ``torch.no_grad()``.

    Args:
        model: a HF causal LM or a :class:`GptFastMoE` (anything with ``setup_caches``).
        input_ids: (B, S) long prompt.
        n_decode: number of decode steps (>= 0); each feeds the argmax of the previous step's last logits.
        compile_fn: wraps the model once, after the cache is set up.
        max_cache_len: cache length S_max; must be >= S + n_decode.
        compile_prefill: with False the prefill runs on the uncompiled model and only decode steps go through
            ``step`` (what ``generate()`` does): the HF ``StaticCache`` buffers then exist, marked static, before
            the first compiled call.
        cache: a HF model's cache to use instead of a new ``StaticCache`` (e.g. a ``CKVPStaticCache``, fresh).
        tokens: teacher forcing: step i feeds ``tokens[i]`` ((B, 1) long, e.g. another run's argmax) instead of
            this run's argmax; at least ``n_decode`` of them.
    Returns:
        [prefill logits (B, S, V), step 1 logits (B, 1, V), ..., step n_decode logits (B, 1, V)].
    Raises:
        ValueError: S + n_decode > max_cache_len, n_decode < 0, or fewer than n_decode ``tokens``.
    """
    bsz, seqlen = input_ids.shape
    if n_decode < 0 or seqlen + n_decode > max_cache_len:
        raise ValueError(
            f"need 0 <= n_decode and S + n_decode <= max_cache_len, but got S={seqlen}, n_decode={n_decode}, "
            f"max_cache_len={max_cache_len}"
        )
    if tokens is not None and len(tokens) < n_decode:
        raise ValueError(f"tokens (teacher forcing) holds {len(tokens)} steps but n_decode={n_decode}: pass at least "
                         f"n_decode (B, 1) token tensors, or n_decode={len(tokens)}")
    gpt_fast = _is_gpt_fast(model)
    with torch.no_grad():
        if gpt_fast:
            model.setup_caches(bsz, max_cache_len)
        elif cache is None:
            cache = make_static_cache(model, max_cache_len)
        step = compile_fn(model) if compile_fn is not None else model

        def call(ids: torch.Tensor, start: int, fn: Callable) -> torch.Tensor:
            if gpt_fast:
                return _logits(fn(ids, torch.arange(start, start + ids.shape[1], device=ids.device)))
            return _logits(fn(**hf_step_kwargs(model, ids, cache, start)))

        outs = [call(input_ids, 0, step if compile_prefill else model)]
        for i in range(n_decode):
            next_ids = tokens[i] if tokens is not None else outs[-1][:, -1].argmax(dim=-1, keepdim=True)  # (B, 1)
            outs.append(call(next_ids, seqlen + i, step))
    return outs


class _RecordingBackend:
    """A Dynamo backend that appends every graph it receives to ``self.graphs`` and runs it as is.

    Dynamo deletes ``node.meta["grapharg"]`` (the placeholder's ``GraphArg``, whose ``.source`` names the
    parameter, buffer or input) when it cleans up after compiling a frame; :meth:`restore_graphargs` puts it
    back so that recorded graphs look exactly as they did inside a backend.
    """

    def __init__(self) -> None:
        self.graphs: list[fx.GraphModule] = []
        self._graphargs: list[tuple[fx.Node, Any]] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        self.graphs.append(gm)
        self._graphargs += [(n, n.meta["grapharg"]) for n in gm.graph.find_nodes(op="placeholder")
                            if "grapharg" in n.meta]
        return gm.forward

    def restore_graphargs(self) -> None:
        """Re-attach the ``grapharg`` metadata Dynamo removed after compiling."""
        for node, grapharg in self._graphargs:
            node.meta.setdefault("grapharg", grapharg)


def capture_dynamo_graphs(model: Callable, *args: Any, **kwargs: Any) -> list[fx.GraphModule]:
    """Compile ``model`` with a recording backend, call it once, and return every graph Dynamo produced.

    Calls ``torch._dynamo.reset()`` first, compiles with ``dynamic=False`` and runs under ``torch.no_grad()``.
    The graphs are Dynamo (torch-level) graphs, as a backend receives them: parameters and buffers are
    placeholders, ``node.meta['example_value']`` holds fake tensors and ``node.meta['grapharg'].source``
    names each placeholder's origin (restored after Dynamo's cleanup). More than one graph means graph breaks.

    Args:
        model: an ``nn.Module`` or function.
        *args, **kwargs: the call's arguments.
    Returns:
        The ``fx.GraphModule`` of each compiled frame, in compile order.
    """
    torch._dynamo.reset()
    backend = _RecordingBackend()
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with torch.no_grad():
        compiled(*args, **kwargs)
    backend.restore_graphargs()
    return backend.graphs


def capture_prefill_decode_graphs(model: torch.nn.Module, input_ids: torch.Tensor, *, max_cache_len: int = 64,
                                  ) -> tuple[list[fx.GraphModule], list[fx.GraphModule]]:
    """Capture the Dynamo graphs of a static-cache prefill call and of the decode call that follows it.

    Both calls go through one compiled model (``dynamic=False``, after ``torch._dynamo.reset()``), so the decode
    call is a recompile at S=1. HF models: see the module docstring for where the lazily created
    ``StaticCache`` buffers appear (created in the prefill graph, placeholders in the decode graph).

    Args:
        model: a HF causal LM or a :class:`GptFastMoE`.
        input_ids: (B, S) long prompt, S + 1 <= max_cache_len.
        max_cache_len: cache length S_max.
    Returns:
        (prefill graphs, decode graphs); each list has one graph when the model compiles without breaks.
    """
    torch._dynamo.reset()
    backend = _RecordingBackend()
    phases: list[list[fx.GraphModule]] = []

    def compile_fn(m: torch.nn.Module) -> Callable:
        compiled = torch.compile(m, backend=backend, dynamic=False)

        def step(*args: Any, **kwargs: Any) -> Any:
            start = len(backend.graphs)
            out = compiled(*args, **kwargs)
            phases.append(backend.graphs[start:])
            return out

        return step

    prefill_decode_logits(model, input_ids, 1, compile_fn=compile_fn, max_cache_len=max_cache_len)
    backend.restore_graphargs()
    return phases[0], phases[1]
