"""Inductor lowering of ``ckvp::moe_experts``: two autotuned grouped-GEMM ``TritonTemplate``\\ s over a tile-padded
routing (small M), or Inductor's own grouped-GEMM lowering over compact expert-sorted rows (large M).

The lowering decomposes one op into Inductor IR (notation of :mod:`ckvp_compile.kernels.moe_reference`; P = T*A
pairs). Which path: :func:`large_m_path_reason` (large M: CUDA, bf16, max-autotune, static sizes, routing bucket
``ROUTE_M >= LARGE_M_ROUTE_M`` (128: more than 48 rows per expert), operands ``torch._grouped_mm`` takes fused;
:data:`FORCE_LARGE_M_PATH` forces it for tests); every call's path and reason go to :data:`DECISIONS` and the log.

Padded path (the default; small M, decode)::

    sorted_ids, tile_expert = ckvp::moe_align(topk_ids, E, ROUTE_M)        extern (one Triton launch on CUDA)
    act   = ckvp_moe_gate_up(hidden, sorted_ids, tile_expert, W_gate, W_up)  (P_pad, I)  template | extern | grouped_mm
    pairs = ckvp_moe_down(act, sorted_ids, tile_expert, W_down, topk_w)      (P, Dm) fp32 template | extern | grouped_mm
    out   = pairs.view(T, A, Dm).sum(1).to(hidden.dtype)                      Inductor reduction

Large-M path (:func:`_large_m_experts`; every line Inductor IR built through the registered ATen lowerings, so
Inductor fuses the pointwise and gather steps and autotunes its grouped-GEMM template)::

    ids    = topk_ids.view(P).long()                                          (P,)
    onehot = ids[:, None] == arange(E)[None, :]                               (P, E)      fused into the scan
    csum   = cumsum(onehot, 0)                                                (P, E)      scan (aten.cumsum on CPU)
    counts = csum[P - 1];  ends = cumsum(counts);  offs = ends.int()           (E,)        group ends, int32
    inv    = sum_e onehot * (ends - counts - 1 + csum)                         (P,)        compact row of each pair
    perm   = sort(ids * P + arange(P)).indices                                (P,)        pair of each compact row
    x      = hidden[perm // A]                                                (P, Dm)     gather
    h      = grouped_mm(x, W_gate_up^T, offs)                                 (P, 2I)     one GEMM on HF's fused
             (or gate, up = grouped_mm(x, W_gate^T, offs), grouped_mm(x, W_up^T, offs))   (E, 2I, Dm) view, else two
    act    = (silu(gate.float()) * up.float()).to(hidden.dtype)               (P, I)      pointwise
    y      = grouped_mm(act, W_down^T, offs)                                  (P, Dm)
    out    = (y[inv].view(T, A, Dm).float() * topk_w[..., None]).sum(1)       (T, Dm)     gather + reduction
             .to(hidden.dtype)

``grouped_mm`` is Inductor's lowering of ``aten._grouped_mm`` (``tuned_grouped_mm`` in
``torch/_inductor/kernel/mm_grouped.py``, reached through :func:`ckvp_compile._compat.grouped_mm_lowering`):
in max-autotune on sm90+ it times its persistent TMA Triton template configs against the aten extern
(``torch._grouped_mm``, CUTLASS) with balanced group ends, as it does for HF's ``grouped_mm`` experts. Static
shapes, no host sync, no padding compute: every kernel sees P rows. The keys ``ids * P + p`` are unique, so the
sort's order (expert-major, pair order inside an expert) is the one ``inv`` inverts, stable or not. Numerics
against the padded path (bf16): gate, up and y round to bf16 before the fp32 SiLU and the fp32 weighted sum (the
templates keep them in fp32); fp32 runs are exact up to the GEMMs' summation order. On CPU (forced path)
Inductor's lowering has only the aten extern, which calls ``torch._grouped_mm`` eagerly (torch 2.13 runs it on
CPU in fp32 too; only its meta kernel insists on bf16, and Inductor's lowering does not run the meta kernel).
Inductor's FX graph cache does not see :data:`FORCE_LARGE_M_PATH` or :data:`LARGE_M_ROUTE_M`: tests that flip them
compile with ``force_disable_caches``.

``ROUTE_M`` is the M bucket (:func:`~ckvp_compile.kernels.grouped_gemm.block_m_for`: 16/32/64/128 from the mean
rows per expert). Each GEMM's choices in the padded path:

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

When which choice: on CPU (and any non-CUDA device) the padded path with the extern ops as the only choice, so
Inductor calls the reference parts (exact against the eager op). On CUDA with ``max_autotune`` (or
``max_autotune_gemm``): the large-M path where :func:`large_m_path_reason` allows (``ROUTE_M`` 128), else every
template config, the extern and, where :func:`grouped_mm_choice_ok`, the grouped_mm extern. On CUDA otherwise:
the padded path with one template config, no timing at compile time: the first candidate whose grid fills
the SMs (:func:`default_template_config`; at Qwen1.5-MoE's decode shapes narrower N tiles than the first).
Symbolic sizes (``dynamic=True``) or T == 0: the whole op stays one extern call (``ckvp::moe_experts``).

One copy of the math: the template bodies call ``_ckvp_gate_up_tile`` / ``_ckvp_down_tile``, the ``@triton.jit``
helpers of :mod:`ckvp_compile.kernels.grouped_gemm` that the plain kernels call too; the template source appends
their source text (``JITFunction.src``), so the generated module defines them next to the kernel.

Registered by :func:`ckvp_compile.lowering.register_all` (the backend calls it); importing this module imports
Inductor, defines the templates and extern choices, and registers nothing until :func:`register` is called (the
ops must be defined first: :func:`ckvp_compile.ops.register_all`).
Source: the lowering/template split of ``torch/_inductor/kernel/mm_grouped.py`` and ``flex_attention`` (helper
``@triton.jit`` functions after the kernel body), read in torch 2.13; no code copied. Large-M path: the compact
grouped-GEMM form of transformers ``integrations/moe.py::grouped_mm_experts_forward`` (sort by expert,
``_grouped_mm`` with cumulative counts), rebuilt from static-shape IR (one-hot scan instead of a histogram).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .. import _compat
from ..kernels import grouped_gemm as gg
from ..kernels import moe_grouped_mm as gm
from ..kernels import moe_reference as moe_ref
from ..ops import register_all as _register_ops

logger = logging.getLogger(__name__)

__all__ = ["DECISIONS", "EXTERN_NAMES", "FORCE_LARGE_M_PATH", "GROUPED_MM_NAMES", "LARGE_M_ROUTE_M", "TEMPLATE_NAMES",
           "default_template_config",
           "grouped_mm_choice_ok", "large_m_path_reason", "register", "representative_group_sizes", "template_configs",
           "tuned_moe_down", "tuned_moe_experts", "tuned_moe_gate_up"]

_api = _compat.inductor_template_api()
aten, prims = torch.ops.aten, torch.ops.prims
_register_ops()  # the extern choices below name torch.ops.ckvp.*: importable on its own (idempotent)

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


def default_template_config(configs: list[gg.GemmConfig], route_m: int, num_pairs: int, num_experts: int, n: int,
                            sms: int) -> gg.GemmConfig:
    """The one config compiled without max-autotune: the first of ``configs`` (the H200 tuning winner at
    Mixtral shape) whose grid fills the GPU, else the one with the most programs.

    A bandwidth-bound grouped GEMM at decode needs a program on every SM: at Qwen1.5-MoE's shape and batch 1 (4 of
    60 experts hit, I = 1408) the first gate/up config's 128-column tiles make 4 x 11 = 44 programs for 132 SMs,
    and the shared expert's (I = 5632) 44 as well. Programs are counted as the non-empty M tiles, at least
    ``max(min(E, P), P / rows)`` for P (token, expert) pairs, times the N tiles ``cdiv(n, block_n)``.

    Args:
        configs: the candidates in preference order (:func:`template_configs`), not empty.
        route_m: the routing's M tile; num_pairs: P = tokens x top-k; num_experts: E; n: output columns (the
            expert FFN width for gate/up, the model width for down); sms: the device's streaming multiprocessors.
    Returns:
        One of ``configs``.
    Raises:
        ValueError: ``configs`` is empty (the lowerings pass only non-empty lists).
    Source: a wave-quantisation heuristic measured on the H200 (neutral at Qwen1.5-MoE's batch-1 step, 4.79 ->
    4.77 ms: benchmarks/results/2026-11-30-decode-e2e-h200, moe-default-config).
    """
    def programs(c: gg.GemmConfig) -> int:
        m_tiles = max(min(num_experts, num_pairs), -(-num_pairs // c.rows(route_m)))
        return m_tiles * -(-n // c.block_n)

    return next((c for c in configs if programs(c) >= sms), max(configs, key=programs))


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (132 on an H200; 1 without a visible GPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


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
    if mode != "autotune":
        configs = [default_template_config(configs, block_m, t * top_k, num_experts, int(n),
                                           _sm_count(layout.device))] if configs else []
    choices: list[Any] = []
    for c in configs:
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
    if mode != "autotune":
        configs = [default_template_config(configs, block_m, t * top_k, num_experts, int(dm),
                                           _sm_count(layout.device))] if configs else []
    choices: list[Any] = []
    for c in configs:
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


#: Routing M bucket (:func:`~ckvp_compile.kernels.grouped_gemm.block_m_for`) from which :func:`tuned_moe_experts`
#: takes the large-M path (compact rows, Inductor's own grouped-GEMM lowering): the 128 bucket, i.e. more than 48
#: rows per expert on average (Mixtral-8x7B shape from batch 256 on). Chosen from the H200 run of 2026-11-29
#: (batch 512, ~128 rows per expert: the tile-padded templates took 606 + 331 us against 479 + 243 us for
#: Inductor's grouped_mm template); retune it when the check script's batch rows show the crossover.
LARGE_M_ROUTE_M = 128
#: Take the large-M path wherever it can be built, whatever the device, dtype, mode and M (tests: the path on CPU,
#: where Inductor's grouped_mm lowering calls ``torch._grouped_mm`` eagerly). Set with ``monkeypatch.setattr`` and
#: compile with ``torch._inductor.config.patch(force_disable_caches=True)``: Inductor's FX graph cache key does not
#: include this flag, so a cached graph of the other path would be reused.
FORCE_LARGE_M_PATH = False
#: The path each :func:`tuned_moe_experts` call took, newest last (at most :data:`_MAX_DECISIONS`): dict(path
#: 'large_m' | 'padded' | 'extern', reason (why not large_m; None when taken), tokens, top_k, experts, hidden,
#: ffn, route_m, fused_gate_up (large_m only: one GEMM over HF's fused gate_up_proj)).
DECISIONS: list[dict] = []
_MAX_DECISIONS = 64


def _record(path: str, reason: str | None, **info: Any) -> None:
    DECISIONS.append(dict(path=path, reason=reason, **info))
    del DECISIONS[:-_MAX_DECISIONS]
    logger.info("ckvp::moe_experts lowered as %s (%s) %s", path, reason or "large-M conditions met", info)


def large_m_path_reason(device: torch.device, dtype: torch.dtype, mode: str, route_m: int, dm: int, ffn: int,
                        weights: Callable[[], list[tuple | None]]) -> str | None:
    """Why :func:`tuned_moe_experts` does not take the large-M path, or None when it does.

    Args:
        device, dtype: of hidden and the weights. mode: :func:`_mode` of the output layout. route_m: the routing's
            M bucket. dm, ffn: Dm and I (the K of the gate/up and of the down GEMM). weights: returns, per weight
            (gate, up, down), (size, stride, offset) as in :func:`grouped_mm_choice_ok` (None: unknown or maybe
            misaligned); called only when every other condition holds (it realizes the weight inputs).
    Returns:
        None when: Inductor's ``aten._grouped_mm`` lowering is usable (:func:`ckvp_compile._compat.grouped_mm_lowering`)
        and either :data:`FORCE_LARGE_M_PATH`, or all of: CUDA, max-autotune (``mode == 'autotune'``, so that
        Inductor autotunes its grouped-GEMM template), ``route_m >= LARGE_M_ROUTE_M``, and both GEMMs pass
        :func:`grouped_mm_choice_ok` (bf16 on compute capability 9.x/10.x: ``torch._grouped_mm``'s meta kernel
        accepts bf16 only and its fp16 path loops over the groups with a host sync, so the extern choice of
        Inductor's autotuning must not be that; 16-byte aligned rows and weights, which the TMA template needs).
        Otherwise a short reason (logged, and recorded in :data:`DECISIONS`).
    """
    _, why = _compat.grouped_mm_lowering()
    if why is not None:
        return why
    if FORCE_LARGE_M_PATH:
        return None
    if device.type != "cuda":
        return f"device {device.type} (CUDA only)"
    if mode != "autotune":
        return "not max-autotune (Inductor would not autotune its grouped_mm template)"
    if route_m < LARGE_M_ROUTE_M:
        return f"route_m {route_m} < LARGE_M_ROUTE_M {LARGE_M_ROUTE_M}"
    metas = weights()
    if not (grouped_mm_choice_ok(device, dtype, dm, metas[:2]) and grouped_mm_choice_ok(device, dtype, ffn, metas[2:])):
        return (f"torch._grouped_mm not fused for these operands (dtype {dtype}, capability "
                f"{_cuda_capability(device)}, Dm {dm}, I {ffn}, weights {metas}): bf16, sm90/sm100, 16-byte alignment")
    return None


def _fused_gate_up(w_gate: Any, w_up: Any, num_experts: int, ffn: int, dm: int) -> Any | None:
    """HF's fused (E, 2I, Dm) ``gate_up_proj`` when ``w_gate`` / ``w_up`` are its two halves, else None.

    Detected on the realized views: both are ``ReinterpretView``\\ s of one buffer with strides (2I*Dm, Dm, 1) and
    up's offset = gate's offset + I*Dm. Returns a ``TensorBox`` of the (E, 2I, Dm) view at gate's offset (the rows
    gate then up of each expert, in the buffer's own offset frame, as the halves are).
    """
    g, u = _api.realize_inputs(w_gate, w_up)
    if not (isinstance(g, _api.ReinterpretView) and isinstance(u, _api.ReinterpretView)):
        return None
    mg, mu = _weight_meta(g), _weight_meta(u)
    try:
        same = g.get_name() == u.get_name()
    except (AttributeError, NotImplementedError):
        return None
    want = ((num_experts, ffn, dm), (2 * ffn * dm, dm, 1))
    if not (same and mg is not None and mu is not None and mg[:2] == want and mu[:2] == want
            and mu[2] - mg[2] == ffn * dm):
        return None
    layout = _api.FixedLayout(g.get_device(), g.get_dtype(), [num_experts, 2 * ffn, dm], [2 * ffn * dm, dm, 1],
                              g.get_layout().offset)
    return _api.TensorBox(_api.ReinterpretView(data=g.data, layout=layout))


def representative_group_sizes(pairs: int, groups: int, alignment: int = 8) -> list[int]:
    """Rows per expert of a typical uniform top-k routing: what the large-M path autotunes its GEMMs on.

    A router that spreads ``pairs`` (token, slot) pairs uniformly over ``groups`` experts gives multinomial counts:
    mean P/E, standard deviation sqrt(P (1/E)(1 - 1/E)). This returns one deterministic draw's worth of spread: the
    E normal quantiles ``Phi^-1((e + 1/2) / E)`` scaled to that mean and deviation, rounded to ``alignment`` rows
    (Inductor's synthetic ends are aligned too), clamped at 0; the last group takes the rest, so that the sum is
    ``pairs`` (where the mean is below the alignment, that can be all of them).

    Args: pairs >= 0, groups >= 1, alignment >= 1 (rows). Returns: ``groups`` ints summing to ``pairs``.
    Raises: ValueError for groups < 1, pairs < 0 or alignment < 1.
    """
    from statistics import NormalDist

    if groups < 1 or pairs < 0 or alignment < 1:
        raise ValueError(f"need groups >= 1, pairs >= 0, alignment >= 1; got {groups}, {pairs}, {alignment}")
    mean = pairs / groups
    std = (pairs * (1.0 / groups) * (1.0 - 1.0 / groups)) ** 0.5
    z = [NormalDist().inv_cdf((e + 0.5) / groups) for e in range(groups)]
    sizes = [max(0, int(round((mean + std * zi) / alignment)) * alignment) for zi in z[:-1]]
    while sum(sizes) > pairs:  # too many rows before the last group: trim the largest (its first index keeps them
        e = sizes.index(max(sizes))  # ascending), one alignment at a time
        sizes[e] -= alignment
    return sizes + [pairs - sum(sizes)]


def _large_m_experts(hidden, topk_ids, topk_weights, w_gate, w_up, w_down, t: int, top_k: int, num_experts: int,
                     dm: int, ffn: int) -> tuple[Any, bool]:
    """The routed experts over compact expert-sorted rows, in Inductor IR, with Inductor's grouped-GEMM lowering.

    Args: the op's IR inputs and static sizes T, A, E, Dm, I. Returns: ((T, Dm) hidden.dtype, whether gate and up
    ran as one GEMM over HF's fused gate_up_proj). Steps (module doc, "large-M path"); static shapes, no host sync:
    ids (P,) int64; one-hot (P, E) and its cumsum over P; group ends ``offs`` = cumsum of the counts (int32);
    ``inv[p]`` = the compact row of pair p (group start + rank among its expert's pairs, pair order);
    ``perm`` = the pair of each compact row (argsort of ``ids * P + p``: unique keys, so any sort gives the same
    order, the one ``inv`` inverts); x = hidden[perm // A]; gate/up = grouped_mm(x, W^T, offs) (one call on the
    fused (E, 2I, Dm) view when :func:`_fused_gate_up` finds it); act = silu(gate) * up in fp32, rounded to
    hidden.dtype; y = grouped_mm(act, W_down^T, offs); out[t] = sum_a w[t, a] * y[inv[t*A + a]] in fp32.
    """
    low = _api.lowerings
    grouped_mm, _ = _compat.grouped_mm_lowering()
    cvt, view = low[prims.convert_element_type.default], low[aten.view.default]
    add, sub, mul = low[aten.add.Tensor], low[aten.sub.Tensor], low[aten.mul.Tensor]
    permute, index = low[aten.permute.default], low[aten._unsafe_index.Tensor]
    cumsum, isum = low[aten.cumsum.default], low[aten.sum.dim_IntList]
    dtype, device, f32 = hidden.get_dtype(), hidden.get_device(), torch.float32
    p = t * top_k

    def iota(n: int) -> Any:
        return low[prims.iota.default](n, start=0, step=1, dtype=torch.int64, device=device, requires_grad=False)

    ids = cvt(view(topk_ids, [p]), torch.int64)                                   # (P,) expert of each pair
    onehot = cvt(low[aten.eq.Tensor](view(ids, [p, 1]), view(iota(num_experts), [1, num_experts])), torch.int64)
    csum = cumsum(onehot, 0)                                                      # (P, E) pairs of e up to p
    counts = low[aten.select.int](csum, 0, p - 1)                                 # (E,)
    ends = cumsum(counts, 0)                                                      # (E,) group ends
    offs = cvt(ends, torch.int32)
    why = _compat.autotune_grouped_mm_with_group_sizes(offs, representative_group_sizes(p, num_experts))
    if why is not None:
        logger.info("ckvp moe large-M: autotuning on balanced groups (%s)", why)
    first = sub(sub(ends, counts), 1)                                             # (E,) group start - 1
    inv = isum(mul(onehot, add(csum, view(first, [1, num_experts]))), [1])        # (P,) compact row of pair p
    inv.realize()  # its own (P,) buffer: else Inductor inlines the E-term sum into every output element's index
    key = add(mul(ids, p), iota(p))                                               # unique: expert-major, pair order
    _, perm = low[aten.sort.stable](key, stable=True, dim=0)                      # (P,) pair of compact row c
    tok = low[aten.div.Tensor_mode](perm, top_k, rounding_mode="floor")
    x = index(hidden, [tok])                                                      # (P, Dm)

    fused = _fused_gate_up(w_gate, w_up, num_experts, ffn, dm)
    if fused is not None:
        h = grouped_mm(x, permute(fused, [0, 2, 1]), offs)                        # (P, 2I)
        gate = low[aten.slice.Tensor](h, 1, 0, ffn)
        up = low[aten.slice.Tensor](h, 1, ffn, 2 * ffn)
    else:
        gate = grouped_mm(x, permute(w_gate, [0, 2, 1]), offs)                    # (P, I)
        up = grouped_mm(x, permute(w_up, [0, 2, 1]), offs)
    g, u = cvt(gate, f32), cvt(up, f32)
    act = cvt(mul(mul(g, low[aten.sigmoid.default](g)), u), dtype)                # (P, I) silu(gate) * up
    y = grouped_mm(act, permute(w_down, [0, 2, 1]), offs)                        # (P, Dm)
    rows = index(y, [view(inv, [t, top_k])])                                      # (T, A, Dm) back in pair order
    weights = low[aten.unsqueeze.default](cvt(topk_weights, f32), 2)
    out = isum(mul(cvt(rows, f32), weights), [1])                                 # (T, Dm) fp32
    return (cvt(out, dtype) if dtype != f32 else out), fused is not None


def tuned_moe_experts(hidden, topk_ids, topk_weights, w_gate, w_up, w_down):
    """Lowering of ``ckvp::moe_experts``: the large-M path (compact rows, Inductor's grouped_mm lowering) where
    :func:`large_m_path_reason` allows, else the routing extern, the two tuned GEMMs and an Inductor sum over the
    top-k (module doc).

    Args: the op's IR inputs (shapes in :func:`ckvp_compile.ops.moe.moe_experts`). Returns: (T, Dm) hidden.dtype.
    Symbolic sizes or T == 0 keep the whole op as one extern call. Each call appends its path to :data:`DECISIONS`.
    """
    sizes = _static_ints(*hidden.get_size(), *topk_ids.get_size(), *w_gate.get_size())
    if sizes is None or sizes[0] == 0:
        _record("extern", "symbolic sizes" if sizes is None else "no tokens")
        return _api.fallback_handler(torch.ops.ckvp.moe_experts.default, add_to_fallback_set=False)(
            hidden, topk_ids, topk_weights, w_gate, w_up, w_down)
    t, dm, _, top_k, num_experts, ffn = sizes[:6]
    route_m = gg.block_m_for(t * top_k, num_experts)
    info = dict(tokens=t, top_k=top_k, experts=num_experts, hidden=dm, ffn=ffn, route_m=route_m)
    layout = _api.FixedLayout(hidden.get_device(), hidden.get_dtype(), [t, dm], [dm, 1])
    reason = large_m_path_reason(layout.device, hidden.get_dtype(), _mode(layout), route_m, dm, ffn,
                                 lambda: _weights_for_choice(*_api.realize_inputs(w_gate, w_up, w_down)))
    if reason is None:
        out, fused = _large_m_experts(hidden, topk_ids, topk_weights, w_gate, w_up, w_down, t, top_k, num_experts,
                                      dm, ffn)
        _record("large_m", None, fused_gate_up=fused, **info)
        return out
    _record("padded", reason, **info)
    if num_experts == 1:  # e.g. a shared expert: the routing is the identity, no sort (no moe_align launch)
        sorted_ids, tile_expert = _one_expert_routing(t * top_k, route_m, layout.device)
    else:
        align = _api.fallback_handler(torch.ops.ckvp.moe_align.default, add_to_fallback_set=False)
        sorted_ids, tile_expert = align(topk_ids, num_experts, route_m)
    act = tuned_moe_gate_up(hidden, sorted_ids, tile_expert, w_gate, w_up, top_k, route_m)
    pairs = tuned_moe_down(act, sorted_ids, tile_expert, w_down, topk_weights, route_m)
    low = _api.lowerings
    out = low[aten.sum.dim_IntList](low[aten.view.default](pairs, [t, top_k, dm]), [1])
    if hidden.get_dtype() != torch.float32:
        out = low[prims.convert_element_type.default](out, hidden.get_dtype())
    return out


def _one_expert_routing(p: int, block_m: int, device: torch.device) -> tuple[Any, Any]:
    """``moe_align``'s outputs for E = 1 as Inductor IR, without reading the ids (all pairs go to expert 0):
    sorted_ids[i] = min(i, P) over P_pad rows (pad rows hold P) and tile_expert[t] = 0 for tiles that start below P,
    :data:`~ckvp_compile.kernels.moe_reference.PAD_EXPERT` after; int32, equal to ``moe_align_ref(ids, 1, block_m)``
    for any valid ids."""
    low = _api.lowerings
    p_pad = moe_ref.padded_rows(p, 1, block_m)

    def iota(n: int) -> Any:
        return low[prims.iota.default](n, start=0, step=1, dtype=torch.int32, device=device, requires_grad=False)

    sorted_ids = low[aten.clamp_max.default](iota(p_pad), p)
    tile_start = low[aten.mul.Tensor](iota(p_pad // block_m), block_m)
    past = low[prims.convert_element_type.default](low[aten.ge.Scalar](tile_start, p), torch.int32)
    tile_expert = low[aten.mul.Tensor](past, moe_ref.PAD_EXPERT)  # expert 0, or the pad marker past P
    return sorted_ids, tile_expert


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
