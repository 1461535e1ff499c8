"""Inductor lowering of ``ckvp::moe_experts``: the routed experts as two autotuned grouped-GEMM ``TritonTemplate``\\ s.

The lowering decomposes one op into Inductor IR (notation of :mod:`ckvp_compile.kernels.moe_reference`)::

    sorted_ids, tile_expert = ckvp::moe_align(topk_ids, E, ROUTE_M)        extern (one Triton launch on CUDA)
    act   = ckvp_moe_gate_up(hidden, sorted_ids, tile_expert, W_gate, W_up)  (P_pad, I)  template | extern | grouped_mm
    pairs = ckvp_moe_down(act, sorted_ids, tile_expert, W_down, topk_w)      (P, Dm) fp32 template | extern | grouped_mm
    out   = pairs.view(T, A, Dm).sum(1).to(hidden.dtype)                      Inductor reduction

``ROUTE_M`` is the M bucket (:func:`~ckvp_compile.kernels.grouped_gemm.block_m_for`: 16/32/64/128 from the mean
rows per expert). Each GEMM's choices:

* ``ckvp_moe_gate_up`` / ``ckvp_moe_down`` (TritonTemplate): the configs of
  :func:`~ckvp_compile.kernels.grouped_gemm.gate_up_configs` / :func:`~ckvp_compile.kernels.grouped_gemm.down_configs`
  for that bucket (BLOCK_M <= ROUTE_M, BLOCK_N, BLOCK_K, warps, stages; split-K configs excluded: they need an
  atomic, zero-filled output). They compute every row of each used ROUTE_M tile, pad rows included;
* ``ckvp_moe_gate_up_extern`` / ``ckvp_moe_down_extern``: the ops ``ckvp::moe_gate_up`` / ``ckvp::moe_down`` (the
  same kernels with the untuned default config on CUDA, the PyTorch reference elsewhere);
* ``ckvp_moe_gate_up_grouped_mm`` / ``ckvp_moe_down_grouped_mm``: the ops ``ckvp::moe_gate_up_grouped_mm`` /
  ``ckvp::moe_down_grouped_mm`` (:mod:`ckvp_compile.kernels.moe_grouped_mm`): the P pair rows gathered
  compactly in expert order, ``torch._grouped_mm`` (CUTLASS, TMA, ragged M through int32 group ends: no padding
  compute), a Triton epilogue scattering them back (SiLU-and-multiply into the padded (P_pad, I) layout;
  routing weight into the (P, Dm) pair buffer). Offered where that GEMM runs fused without a host sync
  (:func:`grouped_mm_choice_ok`: CUDA bf16, compute capability 9.x/10.x, Dm and I multiples of 8, weights with
  16-byte aligned strides and offsets). Its extra work (about ten small routing launches per GEMM, the row
  gathers and scatters) pays at large M, where the padding waste of the templates is largest.

Inductor's ``autotune_select_algorithm`` times them per (E, N, K, M bucket, dtype) with a representative routing
(balanced random top-k, from the static sizes) and caches the winner; the two GEMMs pick independently (every
choice reads and writes the same padded layout: pad rows of ``act`` are unspecified and never read into a
stored result).

When which choice: on CPU (and any non-CUDA device) the extern ops are the only choice, so Inductor calls the
reference parts (exact against the eager op). On CUDA with ``max_autotune`` (or ``max_autotune_gemm``): every
template config, the extern and, where :func:`grouped_mm_choice_ok`, the grouped_mm extern. On CUDA otherwise:
the first template config only (no timing at compile time).
Symbolic sizes (``dynamic=True``) or T == 0: the whole op stays one extern call (``ckvp::moe_experts``).

One copy of the math: the template bodies call ``_ckvp_gate_up_tile`` / ``_ckvp_down_tile``, the ``@triton.jit``
helpers of :mod:`ckvp_compile.kernels.grouped_gemm` that the plain kernels call too; the template source appends
their source text (``JITFunction.src``), so the generated module defines them next to the kernel.

Registered by :func:`ckvp_compile.lowering.register_all` (the backend calls it); importing this module imports
Inductor, defines the templates and extern choices, and registers nothing until :func:`register` is called (the
ops must be defined first: :func:`ckvp_compile.ops.register_all`).
Source: the lowering/template split of ``torch/_inductor/kernel/mm_grouped.py`` and ``flex_attention`` (helper
``@triton.jit`` functions after the kernel body), read in torch 2.13; no code copied.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .. import _compat
from ..kernels import grouped_gemm as gg
from ..kernels import moe_grouped_mm as gm
from ..kernels import moe_reference as moe_ref

logger = logging.getLogger(__name__)

__all__ = ["EXTERN_NAMES", "GROUPED_MM_NAMES", "TEMPLATE_NAMES", "grouped_mm_choice_ok", "register",
           "template_configs", "tuned_moe_down", "tuned_moe_experts", "tuned_moe_gate_up"]

_api = _compat.inductor_template_api()
aten, prims = torch.ops.aten, torch.ops.prims

#: Names of the templates (Inductor's autotuning log shows them; generated kernels define the helpers below).
TEMPLATE_NAMES = ("ckvp_moe_gate_up", "ckvp_moe_down")
#: Names of the extern choices in ``torch._inductor.select_algorithm.extern_kernels``.
EXTERN_NAMES = ("ckvp_moe_gate_up_extern", "ckvp_moe_down_extern")
#: Names of the ``torch._grouped_mm`` extern choices (offered in autotune mode only, :func:`grouped_mm_choice_ok`).
GROUPED_MM_NAMES = ("ckvp_moe_gate_up_grouped_mm", "ckvp_moe_down_grouped_mm")


def _helper_source(fn: Any) -> str:
    """``@triton.jit`` + the source of a jit helper from its ``def`` line (``JITFunction.src``; under the Triton
    interpreter the wrapped Python function's source)."""
    src = getattr(fn, "src", None)
    if src is None:
        import inspect
        import textwrap

        src = textwrap.dedent(inspect.getsource(fn.fn))
    return "\n\n@triton.jit\n" + src[src.index("def "):].rstrip() + "\n"


_GATE_UP_SOURCE = r'''
{{def_kernel("X", "SORTED", "TILE_EXPERT", "WG", "WU")}}
    act, rows, cols, live = _ckvp_gate_up_tile(
        X, WG, WU, SORTED, TILE_EXPERT, tl.program_id(0), tl.program_id(1),
        {{size("WG", 1)}}, {{size("WG", 2)}}, NUM_PAIRS,
        {{stride("X", 0)}}, {{stride("X", 1)}},
        {{stride("WG", 0)}}, {{stride("WG", 1)}}, {{stride("WG", 2)}},
        {{stride("WU", 0)}}, {{stride("WU", 1)}}, {{stride("WU", 2)}},
        TOP_K, ROUTE_M, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    idx_m = rows[:, None]
    idx_n = cols[None, :]
    mask = live[:, None] & (idx_n < {{size("WG", 1)}})
    {{store_output(("idx_m", "idx_n"), "act", "mask", val_shape=("BLOCK_M", "BLOCK_N"))}}
''' + _helper_source(gg._ckvp_gate_up_tile)

_DOWN_SOURCE = r'''
{{def_kernel("ACT", "SORTED", "TILE_EXPERT", "WD", "TOPK_W")}}
    acc, pair, cols = _ckvp_down_tile(
        ACT, WD, SORTED, TILE_EXPERT, TOPK_W, tl.program_id(0), tl.program_id(1), 0,
        {{size("WD", 1)}}, {{size("WD", 2)}}, NUM_PAIRS,
        {{stride("ACT", 0)}}, {{stride("ACT", 1)}},
        {{stride("WD", 0)}}, {{stride("WD", 1)}}, {{stride("WD", 2)}},
        {{stride("TOPK_W", 0)}}, {{stride("TOPK_W", 1)}},
        TOP_K, ROUTE_M, BLOCK_M, BLOCK_N, BLOCK_K, 1, PRECISION)
    idx_m = pair[:, None]
    idx_n = cols[None, :]
    mask = (idx_m < NUM_PAIRS) & (idx_n < {{size("WD", 1)}})
    {{store_output(("idx_m", "idx_n"), "acc", "mask", val_shape=("BLOCK_M", "BLOCK_N"))}}
''' + _helper_source(gg._ckvp_down_tile)


@_api.SymbolicGridFn
def moe_tile_grid(rows, n, meta, *, cdiv):
    """Grid of both templates: (sorted rows / BLOCK_M sub-tiles, output columns / BLOCK_N, 1)."""
    return (cdiv(rows, meta["BLOCK_M"]), cdiv(n, meta["BLOCK_N"]), 1)


gate_up_template = _api.TritonTemplate(name=TEMPLATE_NAMES[0], grid=moe_tile_grid, source=_GATE_UP_SOURCE)
down_template = _api.TritonTemplate(name=TEMPLATE_NAMES[1], grid=moe_tile_grid, source=_DOWN_SOURCE)
gate_up_extern = _api.ExternKernelChoice(torch.ops.ckvp.moe_gate_up.default, name=EXTERN_NAMES[0],
                                         op_overload=torch.ops.ckvp.moe_gate_up.default, has_out_variant=False)
down_extern = _api.ExternKernelChoice(torch.ops.ckvp.moe_down.default, name=EXTERN_NAMES[1],
                                      op_overload=torch.ops.ckvp.moe_down.default, has_out_variant=False)
gate_up_grouped_mm = _api.ExternKernelChoice(torch.ops.ckvp.moe_gate_up_grouped_mm.default, name=GROUPED_MM_NAMES[0],
                                             op_overload=torch.ops.ckvp.moe_gate_up_grouped_mm.default,
                                             has_out_variant=False)
down_grouped_mm = _api.ExternKernelChoice(torch.ops.ckvp.moe_down_grouped_mm.default, name=GROUPED_MM_NAMES[1],
                                          op_overload=torch.ops.ckvp.moe_down_grouped_mm.default,
                                          has_out_variant=False)


def template_configs(kind: str, route_m: int, itemsize: int) -> list[gg.GemmConfig]:
    """The template configs for one GEMM ('gate_up' or 'down') and M bucket ``route_m``: the kernels' candidate
    lists without split-K (a template writes each output element once)."""
    cands = gg.gate_up_configs(route_m, itemsize) if kind == "gate_up" else gg.down_configs(route_m, itemsize)
    return [c for c in cands if c.split_k == 1]


def _static_ints(*sizes: Any) -> list[int] | None:
    """The sizes as Python ints, or None when any is symbolic."""
    out = []
    for s in sizes:
        try:
            out.append(int(s))
        except TypeError:
            return None
    return out


def _mode(layout: Any) -> str:
    """'autotune' (CUDA, max-autotune), 'template' (CUDA, one default template config) or 'extern'."""
    if layout.device.type != "cuda" or layout.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return "extern"
    cfg = _api.config
    backends = str(getattr(cfg, "max_autotune_gemm_backends", "TRITON")).upper()
    if "TRITON" not in backends:
        return "extern"
    return "autotune" if (cfg.max_autotune or cfg.max_autotune_gemm) else "template"


def _cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA ``device`` (None elsewhere or without a visible GPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def grouped_mm_choice_ok(device: torch.device, dtype: torch.dtype, k: int, weights: list[tuple | None]) -> bool:
    """Whether to offer the ``torch._grouped_mm`` extern choice for one GEMM.

    Args:
        device, dtype: of the activations and weights. k: the contraction size (Dm for gate/up, I for down: the
            row length of the compact activations). weights: per weight, (size, stride, offset from a 16-byte
            aligned start) in elements as Python ints, or None when unknown (symbolic, or a buffer that may be
            misaligned).
    Returns:
        True when ``torch._grouped_mm`` runs fused without a host sync
        (:func:`~ckvp_compile.kernels.moe_grouped_mm.supports_grouped_mm`), the compact activation rows are
        16-byte aligned (``k`` a multiple of 8 in bf16) and every weight passes
        :func:`~ckvp_compile.kernels.moe_grouped_mm.weight_operand_ok`.
    """
    if not gm.supports_grouped_mm(device, dtype, _cuda_capability(device)):
        return False
    itemsize = dtype.itemsize
    if (k * itemsize) % gm.ALIGN_BYTES:
        return False
    return all(w is not None and gm.weight_operand_ok(*w, itemsize) for w in weights)


def _weight_meta(node: Any) -> tuple | None:
    """(size, stride, offset) of a realized IR input as Python ints (the offset in elements from its buffer's
    start: a slice of a graph input, e.g. ``gate_up_proj[:, I:]``, is a view with an offset), or None when any is
    symbolic."""
    try:
        layout = node.get_layout()
        return (tuple(int(s) for s in node.get_size()), tuple(int(s) for s in node.get_stride()),
                int(getattr(layout, "offset", 0)))
    except (TypeError, AttributeError, NotImplementedError):
        return None


def _buffer_aligned(node: Any) -> bool:
    """Whether the buffer under an IR input starts 16-byte aligned: Inductor lists the graph inputs it cannot
    assume aligned (every CPU input; a GPU input whose example was misaligned) in ``V.graph.unaligned_buffers``
    and copies a GPU input that was aligned at compile time but is not at run time."""
    try:
        return node.get_name() not in getattr(_api.V.graph, "unaligned_buffers", ())
    except (AttributeError, NotImplementedError):
        return False


def _weights_for_choice(*nodes: Any) -> list[tuple | None]:
    """The ``weights`` argument of :func:`grouped_mm_choice_ok`: each node's meta, None where unknown or where
    its buffer may be misaligned."""
    return [_weight_meta(n) if _buffer_aligned(n) else None for n in nodes]


def _routing_gen(num_tokens: int, top_k: int, num_experts: int, route_m: int) -> dict[int, Any]:
    """input_gen_fns for the routing inputs (positions 1 and 2): a balanced random routing with the real sizes
    (random int tensors would index out of bounds), computed once for both."""
    cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def routing(node: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if "r" not in cache:
            g = torch.Generator().manual_seed(0)
            ids = torch.rand(num_tokens, num_experts, generator=g).argsort(-1)[:, :top_k]
            cache["r"] = tuple(t.to(node.get_device()) for t in moe_ref.moe_align_ref(ids, num_experts, route_m))
        return cache["r"]

    return {1: lambda node: routing(node)[0], 2: lambda node: routing(node)[1]}


def _precision(dtype: torch.dtype) -> str:
    return "'ieee'" if dtype == torch.float32 else "'tf32'"


def tuned_moe_gate_up(hidden, sorted_ids, tile_expert, w_gate, w_up, top_k: int, block_m: int):
    """Lowering of ``ckvp::moe_gate_up``: (P_pad, I) hidden.dtype from template or extern choices (module doc)."""
    inputs = list(_api.realize_inputs(hidden, sorted_ids, tile_expert, w_gate, w_up))
    hidden, sorted_ids, tile_expert, w_gate, w_up = inputs
    sizes = _static_ints(*hidden.get_size(), sorted_ids.get_size()[0], *w_gate.get_size())
    p_pad, n = sorted_ids.get_size()[0], w_gate.get_size()[1]
    layout = _api.FixedLayout(hidden.get_device(), hidden.get_dtype(), [p_pad, n], [n, 1])
    extern = gate_up_extern.bind(inputs, layout, top_k=top_k, block_m=block_m)
    mode = _mode(layout) if sizes is not None else "extern"
    if mode == "extern":
        return _api.autotune_select_algorithm(TEMPLATE_NAMES[0], [extern], inputs, layout)
    t, num_experts = sizes[0], sizes[3]
    configs = template_configs("gate_up", block_m, hidden.get_dtype().itemsize)
    choices: list[Any] = []
    for c in configs if mode == "autotune" else configs[:1]:
        gate_up_template.maybe_append_choice(
            choices, input_nodes=inputs, layout=layout, num_stages=c.num_stages, num_warps=c.num_warps,
            TOP_K=top_k, ROUTE_M=block_m, BLOCK_M=c.rows(block_m), BLOCK_N=c.block_n, BLOCK_K=c.block_k,
            NUM_PAIRS=t * top_k, PRECISION=_precision(hidden.get_dtype()))
    if mode == "autotune" or not choices:
        choices.append(extern)
    if mode == "autotune" and grouped_mm_choice_ok(layout.device, hidden.get_dtype(), sizes[1],
                                                   _weights_for_choice(w_gate, w_up)):
        choices.append(gate_up_grouped_mm.bind(inputs, layout, top_k=top_k, block_m=block_m))
    return _api.autotune_select_algorithm(TEMPLATE_NAMES[0], choices, inputs, layout,
                                          input_gen_fns=_routing_gen(t, top_k, num_experts, block_m))


def tuned_moe_down(act, sorted_ids, tile_expert, w_down, topk_weights, block_m: int):
    """Lowering of ``ckvp::moe_down``: (P, Dm) fp32 from template or extern choices (module doc)."""
    inputs = list(_api.realize_inputs(act, sorted_ids, tile_expert, w_down, topk_weights))
    act, sorted_ids, tile_expert, w_down, topk_weights = inputs
    t, top_k = topk_weights.get_size()
    num_experts, dm = w_down.get_size()[0], w_down.get_size()[1]
    layout = _api.FixedLayout(act.get_device(), torch.float32, [t * top_k, dm], [dm, 1])
    extern = down_extern.bind(inputs, layout, block_m=block_m)
    sizes = _static_ints(t, top_k, num_experts, *act.get_size(), *w_down.get_size())
    mode = _mode(layout) if sizes is not None and act.get_dtype() in (torch.float16, torch.bfloat16, torch.float32) \
        else "extern"
    if mode == "extern":
        return _api.autotune_select_algorithm(TEMPLATE_NAMES[1], [extern], inputs, layout)
    t, top_k, num_experts = sizes[:3]
    p_pad = sizes[3]
    configs = template_configs("down", block_m, act.get_dtype().itemsize)
    choices: list[Any] = []
    for c in configs if mode == "autotune" else configs[:1]:
        down_template.maybe_append_choice(
            choices, input_nodes=inputs, layout=layout, num_stages=c.num_stages, num_warps=c.num_warps,
            call_sizes=[p_pad, dm], TOP_K=top_k, ROUTE_M=block_m, BLOCK_M=c.rows(block_m), BLOCK_N=c.block_n,
            BLOCK_K=c.block_k, NUM_PAIRS=t * top_k, PRECISION=_precision(act.get_dtype()))
    if mode == "autotune" or not choices:
        choices.append(extern)
    if mode == "autotune" and grouped_mm_choice_ok(layout.device, act.get_dtype(), sizes[4],
                                                   _weights_for_choice(w_down)):
        choices.append(down_grouped_mm.bind(inputs, layout, block_m=block_m))
    return _api.autotune_select_algorithm(TEMPLATE_NAMES[1], choices, inputs, layout,
                                          input_gen_fns=_routing_gen(t, top_k, num_experts, block_m))


def tuned_moe_experts(hidden, topk_ids, topk_weights, w_gate, w_up, w_down):
    """Lowering of ``ckvp::moe_experts``: routing extern, the two tuned GEMMs, an Inductor sum over the top-k.

    Args: the op's IR inputs (shapes in :func:`ckvp_compile.ops.moe.moe_experts`). Returns: (T, Dm) hidden.dtype.
    Symbolic sizes or T == 0 keep the whole op as one extern call.
    """
    sizes = _static_ints(*hidden.get_size(), *topk_ids.get_size(), *w_gate.get_size())
    if sizes is None or sizes[0] == 0:
        return _api.fallback_handler(torch.ops.ckvp.moe_experts.default, add_to_fallback_set=False)(
            hidden, topk_ids, topk_weights, w_gate, w_up, w_down)
    t, dm, _, top_k, num_experts = sizes[:5]
    route_m = gg.block_m_for(t * top_k, num_experts)
    align = _api.fallback_handler(torch.ops.ckvp.moe_align.default, add_to_fallback_set=False)
    sorted_ids, tile_expert = align(topk_ids, num_experts, route_m)
    act = tuned_moe_gate_up(hidden, sorted_ids, tile_expert, w_gate, w_up, top_k, route_m)
    pairs = tuned_moe_down(act, sorted_ids, tile_expert, w_down, topk_weights, route_m)
    low = _api.lowerings
    out = low[aten.sum.dim_IntList](low[aten.view.default](pairs, [t, top_k, dm]), [1])
    if hidden.get_dtype() != torch.float32:
        out = low[prims.convert_element_type.default](out, hidden.get_dtype())
    return out


_REGISTERED: list[str] = []


def register() -> list[str]:
    """Register the lowerings of ``ckvp::moe_experts``, ``ckvp::moe_gate_up`` and ``ckvp::moe_down`` (idempotent);
    return the op names."""
    if not _REGISTERED:
        for op, fn in ((torch.ops.ckvp.moe_experts.default, tuned_moe_experts),
                       (torch.ops.ckvp.moe_gate_up.default, tuned_moe_gate_up),
                       (torch.ops.ckvp.moe_down.default, tuned_moe_down)):
            _api.register_lowering(op, type_promotion_kind=None)(fn)
            _REGISTERED.append(str(op.name()))
    return list(_REGISTERED)
