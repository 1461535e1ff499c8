"""The one place that touches torch internals (Inductor, AOTAutograd, Dynamo) that differ across versions.

Supported: torch 2.11 (GPU image) and 2.13 (CPU machines). Every private symbol the package uses is
imported here and nowhere else; ``tests/test_compat.py`` checks that each one exists on the installed torch.
"""

from __future__ import annotations

import functools
import typing
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

# Symbols resolved lazily (importing Inductor costs ~1 s), listed so the compat test can check them all.
REQUIRED_SYMBOLS: tuple[tuple[str, str], ...] = (
    ("torch._inductor.compile_fx", "compile_fx"),
    ("torch._inductor.custom_graph_pass", "CustomGraphPass"),
    ("torch._inductor.decomposition", "select_decomp_table"),
    ("torch._inductor", "list_mode_options"),
    ("torch._inductor.config", "get_config_copy"),
    ("torch._dynamo.backends.common", "aot_autograd"),
    ("torch._dynamo.backends.debugging", "boxed_nop"),
    ("torch._guards", "TracingContext"),
    # Inductor templates and lowerings (ckvp_compile/lowering/), through inductor_template_api()
    ("torch._inductor.lowering", "register_lowering"),
    ("torch._inductor.lowering", "lowerings"),
    ("torch._inductor.lowering", "fallback_handler"),
    ("torch._inductor.select_algorithm", "TritonTemplate"),
    ("torch._inductor.select_algorithm", "ExternKernelChoice"),
    ("torch._inductor.select_algorithm", "autotune_select_algorithm"),
    ("torch._inductor.select_algorithm", "realize_inputs"),
    ("torch._inductor.select_algorithm", "SymbolicGridFn"),
    ("torch._inductor.utils", "use_triton_template"),
    ("torch._inductor.ir", "FixedLayout"),
    ("torch._inductor.ir", "ExternKernel"),
    ("torch._inductor.ir", "ReinterpretView"),
    ("torch._inductor.ir", "TensorBox"),
    ("torch._inductor.virtualized", "V"),
    ("torch._inductor.config", "max_autotune"),
    ("torch._inductor.kernel.mm_grouped", "tuned_grouped_mm"),
    ("torch._inductor.kernel.mm_grouped", "create_offsets"),
    # the store-write ordering pass (passes/store_write_order.py), through functionalized_mutation / node_storage
    ("torch._inductor.fx_utils", "get_node_storage"),
    ("torch._higher_order_ops.auto_functionalize", "auto_functionalized"),
    ("torch._higher_order_ops.auto_functionalize", "auto_functionalized_v2"),
)


def inductor_template_api() -> Any:
    """Return the Inductor symbols a template lowering needs, as one namespace (imports Inductor).

    Attributes: ``register_lowering``, ``lowerings`` (the op -> lowering dict), ``fallback_handler``,
    ``TritonTemplate``, ``ExternKernelChoice``, ``realize_inputs``, ``SymbolicGridFn``, ``use_triton_template``,
    ``FixedLayout``, ``V``, ``config`` (``torch._inductor.config``), ``require_contiguous`` (an IR input copied to
    contiguous strides if it is not), ``ReinterpretView`` and ``TensorBox`` (to wrap a view of a realized input's
    storage, e.g. HF's fused gate_up_proj seen through its two halves) and ``autotune_select_algorithm``, which
    returns the chosen node on every torch (2.11 returns the node, 2.13 a ``(node, choice)`` pair).
    """
    import types

    import torch._inductor.config as config
    from torch._inductor.ir import ExternKernel, FixedLayout, ReinterpretView, TensorBox
    from torch._inductor.lowering import fallback_handler, lowerings, register_lowering
    from torch._inductor.select_algorithm import (
        ExternKernelChoice,
        SymbolicGridFn,
        TritonTemplate,
        autotune_select_algorithm,
        realize_inputs,
    )
    from torch._inductor.utils import use_triton_template
    from torch._inductor.virtualized import V

    def select(*args: Any, **kwargs: Any) -> Any:
        out = autotune_select_algorithm(*args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    return types.SimpleNamespace(
        register_lowering=register_lowering, lowerings=lowerings, fallback_handler=fallback_handler,
        TritonTemplate=TritonTemplate, ExternKernelChoice=ExternKernelChoice, realize_inputs=realize_inputs,
        SymbolicGridFn=SymbolicGridFn, use_triton_template=use_triton_template, FixedLayout=FixedLayout, V=V,
        config=config, autotune_select_algorithm=select, require_contiguous=ExternKernel.require_contiguous,
        ReinterpretView=ReinterpretView, TensorBox=TensorBox,
    )


def grouped_mm_lowering() -> tuple[Callable | None, str | None]:
    """Return Inductor's registered lowering of ``aten._grouped_mm.default`` (``tuned_grouped_mm`` of
    ``torch/_inductor/kernel/mm_grouped.py``: its autotuned persistent TMA Triton template plus the aten extern),
    as ``(lowering, None)``, or ``(None, reason)`` where this torch cannot be used that way.

    The lowering is called as the FX node would call it, positionally in the op's schema order
    ``(mat_a (M, K), mat_b (G, K, N), offs (G,) int32)`` (the ATen schema ``_grouped_mm(Tensor self, Tensor mat2,
    Tensor? offs=None, Tensor? bias=None, ScalarType? out_dtype=None)``), and returns a ``TensorBox`` of (M, N)
    ``mat_a.dtype``. Read in torch 2.13 (``tuned_grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None,
    layout=None)``) and in a later upstream ``mm_grouped.py`` (same parameters, more template choices); torch 2.11
    (the GPU image) was not read here: the signature check below, and the path recorded by the GPU check script,
    cover it. Reasons: no ``torch._grouped_mm``, no registered lowering, or a lowering whose signature cannot take
    three positional tensors.
    """
    import inspect

    if not hasattr(torch, "_grouped_mm") or not hasattr(torch.ops.aten, "_grouped_mm"):
        return None, f"torch {torch.__version__} has no torch._grouped_mm"
    from torch._inductor.lowering import lowerings  # importing it registers every torch/_inductor/kernel lowering

    fn = lowerings.get(torch.ops.aten._grouped_mm.default)
    if fn is None:
        return None, "Inductor registers no lowering for aten._grouped_mm.default"
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return fn, None  # a C-level or opaque callable: the schema order is the contract
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 3 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        return None, (f"Inductor's aten._grouped_mm lowering has signature {inspect.signature(fn)} "
                      "(want mat_a, mat_b, offs positionally)")
    return fn, None


# group sizes Inductor's grouped-GEMM autotuning times instead of balanced ones: graph -> {offs buffer name: ends}
_AUTOTUNE_GROUP_ENDS: Any = None


def _current_graph() -> Any:
    from torch._inductor.virtualized import V

    try:
        return V.graph
    except Exception:  # noqa: BLE001 - outside a graph lowering: no table applies
        return None


def autotune_grouped_mm_with_group_sizes(offs: Any, sizes: Sequence[int]) -> str | None:
    """Make Inductor's ``aten._grouped_mm`` autotuning time this call's candidates with ``sizes`` rows per group.

    Inductor benchmarks its grouped-GEMM choices on synthetic group ends ``create_offsets``
    (``torch/_inductor/kernel/mm_grouped.py``, torch 2.11 and 2.13): perfectly balanced, aligned groups. For
    routed experts that is the best case: at Mixtral batch 512 (1024 pairs, 8 experts) every group is exactly 128
    rows, so 128-row tiles win, while a real routing puts ~130-150 rows on some experts and pays a second M tile
    there (measured on the H200: 698 us in the model against 496 us when autotuning). This wraps
    ``create_offsets`` once, process-wide, so that the ends of ``offs`` (and only of it, in the graph being
    lowered) are ``cumsum(sizes)``; every other grouped GEMM, the baselines' too, keeps Inductor's balanced ends.

    Args:
        offs: the group-ends IR node (int32 (G,)), realized here so that its buffer name is final.
        sizes: G non-negative ints, the rows of each group (sum = the GEMM's M).
    Returns:
        None when registered, else the reason it could not be (no such Inductor function, no graph being lowered);
        then Inductor's balanced ends are used, which is correct, only tuned for the balanced case.
    """
    global _AUTOTUNE_GROUP_ENDS
    import weakref

    try:
        import torch._inductor.kernel.mm_grouped as mm_grouped
    except ImportError as exc:  # pragma: no cover - checked by tests/test_compat.py
        return f"torch._inductor.kernel.mm_grouped: {exc}"
    original = getattr(mm_grouped, "create_offsets", None)
    if original is None:
        return "torch._inductor.kernel.mm_grouped has no create_offsets"
    graph = _current_graph()
    if graph is None:
        return "no Inductor graph is being lowered"
    if not getattr(original, "_ckvp_group_sizes", False):
        def create_offsets(offs_box: Any, *args: Any, **kwargs: Any) -> Any:
            table = _AUTOTUNE_GROUP_ENDS.get(_current_graph(), {}) if _AUTOTUNE_GROUP_ENDS is not None else {}
            try:
                ends = table.get(offs_box.get_name())
            except Exception:  # noqa: BLE001 - an unnamed node is not one of ours
                ends = None
            if ends is None:
                return original(offs_box, *args, **kwargs)
            return torch.tensor(ends, dtype=offs_box.get_dtype(), device=offs_box.get_device())

        create_offsets._ckvp_group_sizes = True  # type: ignore[attr-defined]
        mm_grouped.create_offsets = create_offsets
    if _AUTOTUNE_GROUP_ENDS is None:
        _AUTOTUNE_GROUP_ENDS = weakref.WeakKeyDictionary()
    offs.realize()
    ends, total = [], 0
    for n in sizes:
        total += int(n)
        ends.append(total)
    try:
        _AUTOTUNE_GROUP_ENDS.setdefault(graph, {})[offs.get_name()] = ends
    except TypeError as exc:  # a graph object that cannot be weakly referenced
        return f"cannot key the graph: {exc}"
    return None


def functionalized_mutation(node: fx.Node) -> tuple[Any, list[fx.Node]] | None:
    """Return ``(op, mutated)`` for a node of AOTAutograd's functional graph that stands for an in-place custom op,
    else None.

    Functionalization turns ``op(x, ...)`` with ``Tensor(a!) x`` into ``auto_functionalized_v2(op, ...,
    _all_bases=[x, ...])`` (torch 2.11 and 2.13 by default) or, with
    ``torch._inductor.config.enable_auto_functionalized_v2 = False``, into ``auto_functionalized(op, x=x, ...)``;
    Inductor's reinplace pass (``torch/_inductor/fx_passes/reinplace.py``) later decides whether each mutated
    tensor is written in place or cloned first.

    Args:
        node: any FX node of the post-grad graph.
    Returns:
        ``op``: the ``torch._ops.OpOverload`` wrapped; ``mutated``: the graph nodes it writes (``_all_bases`` for
        v2, the schema's ``Tensor(a!)`` arguments that are not None for v1), in schema order. None for any other
        node.
    """
    if node.op != "call_function" or not node.args:
        return None
    v1 = getattr(torch.ops.higher_order, "auto_functionalized", None)
    v2 = getattr(torch.ops.higher_order, "auto_functionalized_v2", None)
    op = node.args[0]
    if v2 is not None and node.target is v2:
        bases = node.kwargs.get("_all_bases", ())
        return op, [b for b in bases if isinstance(b, fx.Node)]
    if v1 is not None and node.target is v1:
        out: list[fx.Node] = []
        for arg in op._schema.arguments:
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.kwargs.get(arg.name)
            out.extend(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, fx.Node))
        return op, out
    return None


def node_storage(node: fx.Node) -> Any | None:
    """Return a hashable key of the storage behind ``node``'s fake value (``node.meta['val']``), equal for nodes
    that alias one tensor's memory (views, the graph input they view), as Inductor's reinplace pass computes it
    (``torch._inductor.fx_utils.get_node_storage``); None for a node without a tensor value."""
    from torch._inductor.fx_utils import get_node_storage

    return get_node_storage(node)


def custom_graph_pass_base() -> type:
    """Return Inductor's ``CustomGraphPass`` base class (post_grad_custom_post_pass objects derive from it)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def inductor_mode_options(mode: str) -> dict[str, Any]:
    """Return the Inductor config patches a ``torch.compile`` mode stands for ({} for 'default')."""
    if mode in (None, "default"):
        return {}
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


@functools.lru_cache(maxsize=1)
def inductor_config_defaults() -> dict[str, Any]:
    """Return every ``torch._inductor.config`` option, name -> default value.

    Nested options are dotted (``'triton.cudagraphs'``), as ``torch._inductor.config.patch`` takes them. An
    option whose default is computed at import (torch stores a sentinel) maps to its current value. Imports
    Inductor's config (lazily: only when ``inductor`` patches are given).
    """
    import torch._inductor.config as config

    out = dict(config.get_config_copy())
    entries = getattr(config, "_config", None) or {}
    for name, entry in entries.items():
        default = getattr(entry, "default", None)
        if type(default) is object:  # torch's "computed at import" sentinel
            try:
                default = out[name] if name in out else getattr(config, name)
            except AttributeError:
                continue
        out[name] = default
    return out


@functools.lru_cache(maxsize=None)
def inductor_config_accepts_none(name: str) -> bool:
    """True when the Inductor option ``name`` is declared to accept None (``bool | None``, ``int | None``...),
    or when its declared type is unknown on this torch."""
    import torch._inductor.config as config

    entry = (getattr(config, "_config", None) or {}).get(name)
    value_type = getattr(entry, "value_type", None)
    if value_type is None or value_type is type(None):
        return True
    if isinstance(value_type, str):
        return "None" in value_type
    return type(None) in typing.get_args(value_type)


def compile_with_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], config_patches: dict[str, Any]) -> Callable:
    """Compile a Dynamo graph with full Inductor under ``config_patches`` (as ``backend="inductor"`` does)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=config_patches)


def compile_with_aot_eager(
    gm: fx.GraphModule, example_inputs: Sequence[Any], post_grad_pass: Callable[[fx.Graph], None]
) -> Callable:
    """Run AOTAutograd with Inductor's decompositions, apply ``post_grad_pass`` to the functional ATen graph,
    and run the result eagerly (no code generation). Input mutations stay in the graph, as under Inductor.
    """
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._inductor.decomposition import select_decomp_table

    def fw_compiler(fx_g: fx.GraphModule, inputs: Sequence[Any]) -> Callable:
        post_grad_pass(fx_g.graph)
        fx_g.graph.lint()
        fx_g.recompile()
        return boxed_nop(fx_g, inputs)

    backend = aot_autograd(
        fw_compiler=fw_compiler,
        decompositions=select_decomp_table(),
        keep_inference_input_mutations=True,
    )
    return backend(gm, example_inputs)


_PASSTHROUGH_TYPES: dict[type, type] = {}


def static_fake_inputs(tensors: Sequence[Any]) -> list[Any]:
    """Fake tensors with static shapes, in Dynamo's fake mode, for extra graph inputs the backend appends.

    Inductor fakifies real example inputs itself, with symbolic sizes when the graph is compiled with dynamic
    shapes; the latent store's tensors have fixed shapes, and symbolic ones break Inductor's decomposition of
    their in-place ops (``auto_functionalized``). Outside a Dynamo trace the tensors are returned unchanged.
    """
    import torch._guards

    ctx = torch._guards.TracingContext.try_get()
    mode = getattr(ctx, "fake_mode", None) if ctx is not None else None
    if mode is None:
        return list(tensors)
    return [mode.from_tensor(t, static_shapes=True) if isinstance(t, torch.Tensor) else t for t in tensors]


def copy_dynamo_graph_metadata(src: fx.GraphModule, dst: fx.GraphModule) -> None:
    """Give ``dst`` (a rewritten copy of the Dynamo graph ``src``) the metadata AOTAutograd reads from Dynamo graphs.

    AOTAutograd (``_try_get_metadata_from_dynamo``) trusts a graph as Dynamo's only when ``gm.meta`` has
    ``dynamo_compile_id`` and every placeholder has ``_dynamo_source``; only then does it compute the static
    input indices that CUDA graphs need (parameters and ``mark_static_address`` tensors such as the KV caches).
    A plain ``fx.GraphModule(gm, deepcopy(gm.graph))`` keeps ``node.meta`` but drops both, which made every
    input non-static: ``mode="reduce-overhead"`` then skipped CUDA graphs ("mutated inputs") on the H200.
    Placeholders match by name; one with no counterpart in ``src`` (an input a pass added) gets source None
    (AOTAutograd accepts that, as for DDP-split graphs). Missing attributes on ``src`` are left missing.
    """
    for key, value in getattr(src, "meta", {}).items():
        dst.meta.setdefault(key, value)
    if hasattr(src, "_param_name_to_source"):
        dst._param_name_to_source = src._param_name_to_source
    sources = {n.name: n._dynamo_source for n in src.graph.find_nodes(op="placeholder") if hasattr(n, "_dynamo_source")}
    if not sources:
        return
    for node in dst.graph.find_nodes(op="placeholder"):
        node._dynamo_source = sources.get(node.name)


def mark_static_placeholder(node: fx.Node) -> None:
    """Mark a placeholder a pass appended as a static input (fixed address across calls: AOTAutograd then lists it
    among the static input indices and Inductor's CUDA graphs neither copy it nor skip the graph when it is
    mutated), the way ``torch._dynamo.mark_static_address`` marks a tensor Dynamo sees (``tensor_dict``).
    A tensor that does change address makes CUDA-graph trees re-record, as for Dynamo's own static inputs."""
    node.meta.setdefault("tensor_dict", {})["_dynamo_static_input_type"] = "unguarded"
    if not hasattr(node, "_dynamo_source"):
        node._dynamo_source = None


def surface_through_dynamo(exc: Exception) -> Exception:
    """Return ``exc`` as an instance of a subclass of its own type that Dynamo re-raises unwrapped.

    Dynamo wraps any exception a backend raises in ``BackendCompilerFailed`` (a RuntimeError), except
    ``ShortenTraceback`` subclasses, which it re-raises as they are. A user who passes a bad option must
    see the ``ValueError`` itself, so errors meant for the user are re-typed through this function. When
    the running torch has no ``ShortenTraceback``, ``exc`` is returned unchanged (and arrives wrapped).
    """
    try:
        from torch._dynamo.exc import ShortenTraceback
    except ImportError:  # pragma: no cover - torch without it
        return exc
    base = type(exc)
    cls = _PASSTHROUGH_TYPES.get(base)
    if cls is None:

        def __init__(self, *args: Any) -> None:
            base.__init__(self, *args)
            self.first_useful_frame = None

        cls = type(base.__name__, (base, ShortenTraceback), {"__init__": __init__, "__module__": base.__module__})
        _PASSTHROUGH_TYPES[base] = cls
    new = cls(*exc.args)
    new.__cause__ = exc.__cause__
    return new
