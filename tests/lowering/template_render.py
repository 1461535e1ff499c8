"""Render an Inductor ``TritonTemplate`` outside a compiled graph, for tests under the Triton interpreter.

:func:`render_template` builds a bare ``GraphLowering`` with CPU input layouts (each tensor's own strides and
storage offset), asks the template for one choice with the given meta-parameters, loads the generated module and
returns its kernel. With ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors, so a template's generated code is
checked against the PyTorch reference on a machine without a GPU. Uses Inductor internals directly: test support
only, outside the package (whose Inductor use goes through ``ckvp_compile._compat``); read from torch 2.13's
``select_algorithm.py``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["render_template"]


def render_template(template: Any, inputs: dict[str, torch.Tensor], layout_shape: Sequence[int],
                    layout_dtype: torch.dtype, call_sizes: Sequence[int] | None = None,
                    **meta: Any) -> tuple[Any, str]:
    """Render ``template`` for ``inputs`` (name -> CPU tensor) and a contiguous output of ``layout_shape``.

    Returns:
        (the generated kernel's Triton function, the generated module's source). Under ``TRITON_INTERPRET=1``
        the function is an interpreted kernel: launch it as ``fn[grid](*inputs.values(), out)``.
    Raises:
        whatever Inductor raises for a template that does not render (the test then fails with it).
    """
    import torch.utils._triton as triton_utils
    from torch._inductor import config as inductor_config
    from torch._inductor import ir
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.graph import GraphLowering
    from torch._inductor.select_algorithm import realize_inputs
    from torch._inductor.virtualized import V

    triton_utils.triton_hash_with_backend = lambda: "cpu-interpreter-test"  # no Triton driver on this machine
    gm = torch.fx.symbolic_trace(lambda z: z)
    with inductor_config.patch(cpu_backend="triton"):
        graph = GraphLowering(gm)
        with V.set_graph_handler(graph):
            nodes = []
            for name, t in inputs.items():
                base = ir.TensorBox.create(ir.InputBuffer(name=name, layout=ir.FixedLayout(
                    t.device, t.dtype, list(t.shape), list(t.stride()), offset=t.storage_offset())))
                graph.graph_inputs[name] = base
                nodes.append(base)
            nodes = list(realize_inputs(*nodes))
            strides, acc = [], 1
            for n in reversed(list(layout_shape)):
                strides.append(acc)
                acc *= n
            layout = ir.FixedLayout(torch.device("cpu"), layout_dtype, list(layout_shape), list(reversed(strides)))
            choice = template.generate(input_nodes=nodes, layout=layout, call_sizes=call_sizes, **meta)
            mod = PyCodeCache.load_by_key_path(choice.bmreq.module_cache_key, choice.bmreq.module_path)
            with open(choice.bmreq.module_path) as fh:
                return getattr(mod, choice.bmreq.kernel_name).fn, fh.read()
