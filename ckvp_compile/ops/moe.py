"""The grouped expert op: ``torch.ops.ckvp.moe_experts``, the routed experts of one MoE layer in one call.

Schema (both ops)::

    ckvp::moe_experts(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor w_gate, Tensor w_up,
        Tensor w_down) -> Tensor
    ckvp::moe_experts_triton(...the same...) -> Tensor

and its three parts, the form the Inductor lowering (``ckvp_compile/lowering/moe.py``) decomposes
``moe_experts`` into (each part is also the lowering's extern fallback)::

    ckvp::moe_align(Tensor topk_ids, int num_experts, int block_m) -> (Tensor sorted_ids, Tensor block_expert)
    ckvp::moe_gate_up(Tensor hidden, Tensor sorted_ids, Tensor block_expert, Tensor w_gate, Tensor w_up,
        int top_k, int block_m) -> Tensor act                          # (P_pad, I) hidden.dtype
    ckvp::moe_down(Tensor act, Tensor sorted_ids, Tensor block_expert, Tensor w_down, Tensor topk_weights,
        int block_m) -> Tensor pairs                                   # (P, Dm) fp32
    out = pairs.view(T, A, Dm).sum(1).to(hidden.dtype)

and the two parts' padding-free twins on ``torch._grouped_mm``, same schemas and contracts (extra autotuning
choices of the lowering on CUDA bf16; :mod:`ckvp_compile.kernels.moe_grouped_mm`)::

    ckvp::moe_gate_up_grouped_mm(...the arguments of moe_gate_up...) -> Tensor act      # (P_pad, I) hidden.dtype
    ckvp::moe_down_grouped_mm(...the arguments of moe_down...) -> Tensor pairs           # (P, Dm) fp32

``moe_experts_triton`` is the same computation as a ``torch.library.triton_op``: under ``torch.compile`` on CUDA
Inductor traces its body and emits the ckvp Triton kernels in its output code (the expert GEMM pass uses it for
CUDA graphs); on other devices it calls ``moe_experts``.

A ``torch.library.custom_op`` (opaque to Inductor: an extern call). Its eager kernel validates the inputs and
runs, on CUDA, the Triton grouped GEMMs of :mod:`ckvp_compile.kernels.grouped_gemm` (device-side routing, gate/up
GEMM with the SiLU epilogue, down GEMM with the routing weight, deterministic top-k combine; no host
synchronisation), and elsewhere the PyTorch reference :func:`ckvp_compile.kernels.moe_reference.moe_experts_ref`.
The ``register_fake`` kernel runs the same validation on shapes only, so a wrong shape fails at trace time with
the same message.

Weight layouts follow what the analysis reports for the supported models, with no copies: HF transformers 5.x
stores ``gate_up_proj`` (E, 2I, Dm), gate rows first, and ``down_proj`` (E, Dm, I): pass ``gate_up_proj[:, :I]``
and ``gate_up_proj[:, I:]`` (views); gpt-fast stores ``w1`` (gate) and ``w3`` (up) as (E, I, Dm) and ``w2``
(E, Dm, I). Any strides are accepted.

Not checked (it needs the data, a host sync on GPU): ``topk_ids`` values in [0, E). Out-of-range ids raise
PyTorch's index error on CPU.

Imported by :func:`ckvp_compile.ops.register_all`; importing this module defines the op.
"""

from __future__ import annotations

import torch

from ..errors import CKVPShapeError
from ..kernels import moe_reference as moe_ref

__all__ = ["OPS", "check_moe_experts", "moe_align", "moe_down", "moe_down_grouped_mm", "moe_experts",
           "moe_experts_triton", "moe_gate_up", "moe_gate_up_grouped_mm"]

_INDEX_DTYPES = (torch.int32, torch.int64)


def _fail(msg: str) -> None:
    raise CKVPShapeError(f"ckvp::moe_experts: {msg}")


def check_moe_experts(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> None:
    """Validate the inputs of :func:`moe_experts` (shapes, dtypes, devices; works on fake tensors).

    Raises:
        CKVPShapeError: naming the argument, the expected layout and the actual shape / dtype / device.
    """
    if hidden.dim() != 2:
        _fail(f"hidden must be 2-D (T, Dm), but got shape {tuple(hidden.shape)}; flatten the batch first "
              "(hidden.reshape(-1, Dm))")
    t, dm = hidden.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        _fail(f"topk_ids must be (T, A) with T = {t} (hidden.shape[0]), but got {tuple(topk_ids.shape)}")
    a = topk_ids.shape[1]
    if topk_ids.dtype not in _INDEX_DTYPES:
        _fail(f"topk_ids must be int32 or int64, but got {topk_ids.dtype}")
    if tuple(topk_weights.shape) != (t, a):
        _fail(f"topk_weights must be (T, A) = ({t}, {a}) like topk_ids, but got {tuple(topk_weights.shape)}")
    if not hidden.is_floating_point() or not topk_weights.is_floating_point():
        _fail(f"hidden and topk_weights must be floating point, but got {hidden.dtype} and {topk_weights.dtype}")
    if w_gate.dim() != 3 or w_gate.shape[2] != dm:
        _fail(f"w_gate must be (E, I, Dm) with Dm = {dm} (hidden.shape[1]), but got {tuple(w_gate.shape)}; "
              "HF's fused gate_up_proj (E, 2I, Dm) is passed as gate_up_proj[:, :I] and gate_up_proj[:, I:]")
    e, i = w_gate.shape[0], w_gate.shape[1]
    if tuple(w_up.shape) != (e, i, dm):
        _fail(f"w_up must be (E, I, Dm) = ({e}, {i}, {dm}) like w_gate, but got {tuple(w_up.shape)}")
    if tuple(w_down.shape) != (e, dm, i):
        _fail(f"w_down must be (E, Dm, I) = ({e}, {dm}, {i}) from w_gate, but got {tuple(w_down.shape)}; a "
              "(E, I, Dm) down weight must be passed transposed (w.transpose(1, 2), a view)")
    if not 1 <= a <= e:
        _fail(f"top-k A = {a} (topk_ids.shape[1]) must be in [1, E = {e}] (w_gate.shape[0])")
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if w.dtype != hidden.dtype:
            _fail(f"{name} must have hidden's dtype {hidden.dtype}, but got {w.dtype}; cast the weights once "
                  "(model.to(dtype)), not per call")
    devices = {n: x.device for n, x in (("hidden", hidden), ("topk_ids", topk_ids), ("topk_weights", topk_weights),
                                        ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down))}
    if len(set(devices.values())) > 1:
        _fail(f"all tensors must be on one device, but got {devices}")


@torch.library.custom_op("ckvp::moe_experts", mutates_args=())
def moe_experts(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
                w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Apply each token's top-k experts (SwiGLU FFNs) and sum them with the routing weights.

    Args:
        hidden: (T, Dm) fp32|bf16|fp16, the tokens (the router's input).
        topk_ids: (T, A) int32|int64, expert of each (token, slot), in [0, E).
        topk_weights: (T, A) float (any float dtype; used in fp32), routing weight of each (token, slot).
        w_gate, w_up: (E, I, Dm) hidden.dtype, any strides (views of HF's gate_up_proj are fine).
        w_down: (E, Dm, I) hidden.dtype, any strides.
    Returns:
        (T, Dm) hidden.dtype: ``out[t] = sum_a w[t,a] * W_down[e] (silu(W_gate[e] x_t) * W_up[e] x_t)`` with
        ``e = topk_ids[t, a]``; accumulates in fp32.
    Raises:
        CKVPShapeError: a shape, dtype or device does not match the layout above.
    Notes:
        CUDA: Triton grouped GEMMs (:func:`ckvp_compile.kernels.grouped_gemm.moe_experts_triton`), workspace
        P_pad*I*itemsize + P*Dm*4 bytes (P = T*A). Elsewhere: the PyTorch reference.
    Reference: kernels/moe_reference.py::moe_experts_ref (oracle: moe_experts_loop_ref)
    Source: algorithm of vLLM fused_moe / MegaBlocks (sorted, tile-padded routing; grouped GEMMs).
    """
    check_moe_experts(hidden, topk_ids, topk_weights, w_gate, w_up, w_down)
    if hidden.shape[0] == 0:
        return hidden.new_zeros(hidden.shape)
    if hidden.is_cuda:
        from ..kernels.grouped_gemm import moe_experts_triton

        return moe_experts_triton(hidden, topk_ids, topk_weights, w_gate, w_up, w_down)
    return moe_ref.moe_experts_ref(hidden, topk_ids, topk_weights, w_gate, w_up, w_down)


@moe_experts.register_fake
def _(hidden, topk_ids, topk_weights, w_gate, w_up, w_down) -> torch.Tensor:
    check_moe_experts(hidden, topk_ids, topk_weights, w_gate, w_up, w_down)
    return hidden.new_empty(hidden.shape)


def _moe_experts_triton(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """``ckvp::moe_experts`` as a ``torch.library.triton_op``: the same contract, traceable by Inductor.

    On CUDA the body (the routing kernel, the two grouped GEMM kernels and the combine kernel, launched through
    ``wrap_triton``) is traced into the graph, so Inductor emits the ckvp kernels in its output code, places them
    in its CUDA graphs and fuses the surrounding ops; the configs are the lists' first entries (no timing while
    tracing). Elsewhere it calls the opaque ``ckvp::moe_experts`` (the reference path), because a triton_op's CPU
    kernel is bypassed under AOTAutograd.

    Args, Returns, Raises: as :func:`moe_experts`.
    Reference: kernels/moe_reference.py::moe_experts_ref
    """
    check_moe_experts(hidden, topk_ids, topk_weights, w_gate, w_up, w_down)
    if hidden.is_cuda and hidden.shape[0] > 0:
        from ..kernels.grouped_gemm import moe_experts_triton

        return moe_experts_triton(hidden, topk_ids, topk_weights, w_gate, w_up, w_down)
    return torch.ops.ckvp.moe_experts(hidden, topk_ids, topk_weights, w_gate, w_up, w_down)


# ------------------------------------------------------------------------------------------------ the parts


@torch.library.custom_op("ckvp::moe_align", mutates_args=())
def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs by expert and pad each expert's rows to ``block_m`` (no host sync).

    Args:
        topk_ids: (T, A) int32|int64, values in [0, E). num_experts: E. block_m: the routing's M tile (16, 32, 64
            or 128 for the CUDA kernels).
    Returns:
        sorted_ids (P_pad,) int32 (pad rows hold P = T*A) and block_expert (P_pad / block_m,) int32 (-1 past the
        last expert), P_pad = :func:`~ckvp_compile.kernels.moe_reference.padded_rows`.
    Raises:
        CKVPShapeError: topk_ids is not a 2-D int tensor, or block_m < 1.
    Notes:
        CUDA: :func:`ckvp_compile.kernels.grouped_gemm.moe_align` (one launch); elsewhere the reference.
    Reference: kernels/moe_reference.py::moe_align_ref
    """
    _check_align(topk_ids, num_experts, block_m)
    if topk_ids.is_cuda:
        from ..kernels.grouped_gemm import moe_align as align

        return align(topk_ids, num_experts, block_m)
    return moe_ref.moe_align_ref(topk_ids, num_experts, block_m)


def _check_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    if topk_ids.dim() != 2 or topk_ids.dtype not in _INDEX_DTYPES:
        _fail(f"moe_align: topk_ids must be a (T, A) int32|int64 tensor, but got {tuple(topk_ids.shape)} "
              f"{topk_ids.dtype}")
    if block_m < 1 or num_experts < 1:
        _fail(f"moe_align: block_m and num_experts must be >= 1, but got {block_m} and {num_experts}")


@moe_align.register_fake
def _(topk_ids, num_experts, block_m):
    _check_align(topk_ids, num_experts, block_m)
    p_pad = moe_ref.padded_rows(topk_ids.numel(), num_experts, block_m)
    return (topk_ids.new_empty(p_pad, dtype=torch.int32), topk_ids.new_empty(p_pad // block_m, dtype=torch.int32))


@torch.library.custom_op("ckvp::moe_gate_up", mutates_args=())
def moe_gate_up(hidden: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, w_gate: torch.Tensor,
                w_up: torch.Tensor, top_k: int, block_m: int) -> torch.Tensor:
    """The grouped gate/up GEMM with the SiLU epilogue over the sorted, padded rows of :func:`moe_align`.

    Args:
        hidden: (T, Dm) float. sorted_ids, block_expert: from ``moe_align(topk_ids, E, block_m)``.
        w_gate, w_up: (E, I, Dm) hidden.dtype, any strides. top_k: A. block_m: the routing's M tile.
    Returns:
        (P_pad, I) hidden.dtype: row r = ``silu(x @ W_gate[e]^T) * (x @ W_up[e]^T)`` for its pair's token x and
        its tile's expert e (fp32 inside). Rows without a pair are unspecified: this kernel leaves tiles without a
        pair unwritten, and the lowering may pick :func:`moe_gate_up_grouped_mm`, which writes no pad row; every
        consumer (the down template and kernel, :func:`moe_down`, :func:`moe_down_grouped_mm`) reads pad rows
        into no stored result.
    Notes:
        CUDA: the Triton kernel with the untuned default config (``gate_up_configs(block_m)[0]``); the Inductor
        lowering autotunes the same kernel body as a template. Elsewhere the reference.
    Reference: kernels/moe_reference.py::grouped_gate_up_ref
    """
    if hidden.is_cuda:
        from ..kernels import grouped_gemm as gg

        cfg = gg.gate_up_configs(block_m, hidden.element_size())[0]
        return gg.grouped_gate_up(hidden, sorted_ids, block_expert, w_gate, w_up, top_k, block_m, cfg)
    return moe_ref.grouped_gate_up_ref(hidden, sorted_ids, block_expert, w_gate, w_up, top_k, block_m)


@moe_gate_up.register_fake
def _(hidden, sorted_ids, block_expert, w_gate, w_up, top_k, block_m):
    return hidden.new_empty(sorted_ids.shape[0], w_gate.shape[1])


@torch.library.custom_op("ckvp::moe_down", mutates_args=())
def moe_down(act: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, w_down: torch.Tensor,
             topk_weights: torch.Tensor, block_m: int) -> torch.Tensor:
    """The grouped down GEMM times each pair's routing weight, scattered back to pair order.

    Args:
        act: (P_pad, I) from :func:`moe_gate_up`. sorted_ids, block_expert: the routing. w_down: (E, Dm, I)
            act.dtype, any strides. topk_weights: (T, A) float, any strides. block_m: the routing's M tile.
    Returns:
        (P, Dm) fp32, row p = ``topk_weights.flatten()[p] * (act[r] @ W_down[e]^T)`` (every row written).
    Notes:
        CUDA: the Triton kernel with ``down_configs(block_m)[0]`` (no split-K: deterministic); elsewhere the
        reference.
    Reference: kernels/moe_reference.py::grouped_down_ref
    """
    if act.is_cuda:
        from ..kernels import grouped_gemm as gg

        cfg = next(c for c in gg.down_configs(block_m, act.element_size()) + [gg.GemmConfig(32, 64)] if c.split_k == 1)
        out = torch.empty(topk_weights.numel(), w_down.shape[1], dtype=torch.float32, device=act.device)
        return gg.grouped_down(act, sorted_ids, block_expert, w_down, topk_weights, block_m, cfg, out=out)
    return moe_ref.grouped_down_ref(act, sorted_ids, block_expert, w_down, topk_weights, block_m)


@moe_down.register_fake
def _(act, sorted_ids, block_expert, w_down, topk_weights, block_m):
    return act.new_empty(topk_weights.numel(), w_down.shape[1], dtype=torch.float32)


def _check_grouped_mm(name: str, x: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                      block_m: int) -> None:
    if sorted_ids.dim() != 1 or block_expert.dim() != 1 or block_m < 1 \
            or sorted_ids.shape[0] != block_expert.shape[0] * block_m:
        _fail(f"{name}: sorted_ids (P_pad,) and block_expert (P_pad / block_m,) must come from "
              f"moe_align(topk_ids, E, block_m={block_m}), but got {tuple(sorted_ids.shape)} and "
              f"{tuple(block_expert.shape)}")
    if x.dim() != 2:
        _fail(f"{name}: the activations must be 2-D, but got {tuple(x.shape)}")


@torch.library.custom_op("ckvp::moe_gate_up_grouped_mm", mutates_args=())
def moe_gate_up_grouped_mm(hidden: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                           w_gate: torch.Tensor, w_up: torch.Tensor, top_k: int, block_m: int) -> torch.Tensor:
    """:func:`moe_gate_up` on the compact pair rows with ``torch._grouped_mm`` (no padding compute).

    Args, Returns: as :func:`moe_gate_up` (contiguous (P_pad, I) hidden.dtype; on CUDA pad rows are not
        written, elsewhere they are 0).
    Raises:
        CKVPShapeError: the routing tensors do not have moe_align's shapes for ``block_m``.
    Notes:
        CUDA bf16 on sm90/sm100 with 16-byte aligned weights: two fused grouped GEMMs plus a Triton SiLU scatter,
        no host sync. Elsewhere the same compaction with a loop over the experts (one host read of the group
        ends). Numerics: g and u round to hidden.dtype before the fp32 SiLU (the template keeps them in fp32).
    Reference: kernels/moe_reference.py::grouped_gate_up_ref (equal on the pair rows);
        implementation: kernels/moe_grouped_mm.py::moe_gate_up_grouped_mm
    """
    from ..kernels import moe_grouped_mm as gm

    _check_grouped_mm("moe_gate_up_grouped_mm", hidden, sorted_ids, block_expert, block_m)
    return gm.moe_gate_up_grouped_mm(hidden, sorted_ids, block_expert, w_gate, w_up, top_k, block_m)


@moe_gate_up_grouped_mm.register_fake
def _(hidden, sorted_ids, block_expert, w_gate, w_up, top_k, block_m):
    _check_grouped_mm("moe_gate_up_grouped_mm", hidden, sorted_ids, block_expert, block_m)
    return hidden.new_empty(sorted_ids.shape[0], w_gate.shape[1])


@torch.library.custom_op("ckvp::moe_down_grouped_mm", mutates_args=())
def moe_down_grouped_mm(act: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                        w_down: torch.Tensor, topk_weights: torch.Tensor, block_m: int) -> torch.Tensor:
    """:func:`moe_down` on the compact pair rows with ``torch._grouped_mm`` (pad rows of ``act`` never read).

    Args, Returns: as :func:`moe_down` ((P, Dm) fp32, every row written).
    Raises:
        CKVPShapeError: the routing tensors do not have moe_align's shapes for ``block_m``.
    Notes:
        CUDA bf16 on sm90/sm100: a row gather, one fused grouped GEMM and a Triton weight-and-scatter kernel, no
        host sync; elsewhere a loop over the experts. The GEMM output rounds to act.dtype before the fp32
        weight multiply.
    Reference: kernels/moe_reference.py::grouped_down_ref;
        implementation: kernels/moe_grouped_mm.py::moe_down_grouped_mm
    """
    from ..kernels import moe_grouped_mm as gm

    _check_grouped_mm("moe_down_grouped_mm", act, sorted_ids, block_expert, block_m)
    return gm.moe_down_grouped_mm(act, sorted_ids, block_expert, w_down, topk_weights, block_m)


@moe_down_grouped_mm.register_fake
def _(act, sorted_ids, block_expert, w_down, topk_weights, block_m):
    _check_grouped_mm("moe_down_grouped_mm", act, sorted_ids, block_expert, block_m)
    return act.new_empty(topk_weights.numel(), w_down.shape[1], dtype=torch.float32)


try:
    import triton  # noqa: F401  (the triton_op needs Triton importable, even to trace the CPU branch)
except ImportError:  # pragma: no cover - CPU installs without Triton: only the opaque op exists
    moe_experts_triton = None
else:
    moe_experts_triton = torch.library.triton_op("ckvp::moe_experts_triton", _moe_experts_triton, mutates_args=())

#: op name -> its Python handle (read by :func:`ckvp_compile.ops.register_all`).
OPS = {"moe_experts": moe_experts, "moe_align": moe_align, "moe_gate_up": moe_gate_up, "moe_down": moe_down,
       "moe_gate_up_grouped_mm": moe_gate_up_grouped_mm, "moe_down_grouped_mm": moe_down_grouped_mm,
       **({"moe_experts_triton": moe_experts_triton} if moe_experts_triton else {})}
