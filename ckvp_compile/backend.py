"""The ``ckvp`` torch.compile backend: analysis -> plan -> rewrite -> inner compiler.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so
``torch.compile(model, backend="ckvp", options={...})`` works without importing this package once it is installed.
Run from a source tree (``PYTHONPATH=.``, no entry point), importing ``ckvp_compile`` registers the name instead
(:func:`_register_from_source_tree`); never both: with the entry point present, a lookup that loads it would
otherwise fail with "duplicate name".

Flow for each graph Dynamo captures:

1. :func:`ckvp_compile.analysis.analyze` finds the attention / KV-cache and MoE sites (read-only); with the
   ``expert_offload`` option, every MoE layer must already be offloaded with that many experts resident
   (offloading moves weights, which only a call on the model can do: :func:`ckvp_compile.compile`);
2. :func:`ckvp_compile.plan.make_plan` decides what to rewrite and reports what cannot be used
   (an :class:`UnsupportedPatternWarning` with reason and fix, or :class:`UnsupportedGraphError` with
   ``strict=True``);
3. the 'torch' passes rewrite the Dynamo graph (on a copy: if a pass fails, the original graph is compiled
   and a warning says why, so the model stays usable);
4. the inner compiler runs: full Inductor (``compile_fx`` with the one :class:`PostGradPassManager` as
   ``post_grad_custom_post_pass``), ``aot_eager`` (AOTAutograd + the same post-grad passes, no codegen),
   or ``eager``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Sequence

import torch
import torch.fx as fx

from . import _compat
from .analysis import GraphAnalysis, analyze
from .analysis.graph import CAPTURE_UNSAFE_OPS, capture_unsafe_calls, op_name
from .analysis.sites import UnsupportedSite, format_layers
from .config import CKVPConfig
from .errors import CKVPConfigError, CKVPError, CKVPWarning, UnsupportedGraphError, UnsupportedPatternWarning
from .passes import CKVPPass, PassResult, PostGradPassManager, build_passes, failed_pass, run_passes
from .passes.expert_gemm import SKIPPED_SITE_NOTE, ExpertGemmPass
from .passes.latent_kv_cache import LatentKVCachePass, LatentRewritePlan
from .plan import EXPERT_GEMM_AUTO_OFF, EXPERT_GEMM_OFF, Plan, make_plan
from .runtime.binding import bind_latent_store
from .runtime.store import LatentKVStore, lookup_phantom, note_compiled_size

logger = logging.getLogger(__name__)


@dataclass
class GraphRecord:
    """What the backend did to one captured graph (collected by a :class:`CompileRecorder`).

    Attributes:
        index: order of capture. analysis, plan: the findings and decisions.
        dynamo_before / dynamo_after: Python code of the Dynamo graph before and after the 'torch' passes.
        post_grad_before / post_grad_after: code of the functional ATen graph around the post-grad passes
            ('' when the inner compiler has no post-grad stage, or Inductor's cache skipped the passes).
        pass_results: one entry per pass run.
        fell_back: the reason the original graph was compiled instead of the rewritten one, or ''.
        dropped_passes: pass name -> the error it raised, for a pass left out of a graph compiled with the other
            rewrites (the expert GEMM rewrite failing in a graph that reads a latent KV cache, whose rewrite
            succeeds without it); empty otherwise.
    """

    index: int
    analysis: GraphAnalysis
    plan: Plan
    dynamo_before: str = ""
    dynamo_after: str = ""
    post_grad_before: str = ""
    post_grad_after: str = ""
    pass_results: list[PassResult] = field(default_factory=list)
    fell_back: str = ""
    dropped_passes: dict[str, str] = field(default_factory=dict)


@dataclass
class CompileRecorder:
    """Collects a :class:`GraphRecord` per graph; pass one to :class:`CKVPBackend` to inspect a compile.

    While recording, Inductor's FX graph cache is disabled (a cache hit would skip the post-grad passes
    and leave nothing to show).
    """

    graphs: list[GraphRecord] = field(default_factory=list)


#: Why a MoE site is kept when ``enable_expert_gemm`` is on but the call needs gradients.
EXPERT_GEMM_GRAD = ("this call needs gradients and ckvp::moe_experts is inference-only: run under torch.no_grad() "
                    "or torch.inference_mode() to rewrite it")


def _with_expert_reason(plan: Plan, reason: str) -> Plan:
    """``plan`` (made with the expert rewrite switched off) with its MoE decisions giving ``reason`` instead of
    advising to set ``enable_expert_gemm=True`` (which the user did, or left to 'auto')."""
    return dataclasses.replace(plan, decisions=tuple(
        dataclasses.replace(d, reason=reason) if d.kind == "moe" and d.reason in (EXPERT_GEMM_OFF, EXPERT_GEMM_AUTO_OFF)
        else d for d in plan.decisions))


def resolve_expert_gemm(config: CKVPConfig, example_inputs: Sequence[Any]) -> CKVPConfig:
    """``config`` with ``enable_expert_gemm='auto'`` resolved to True for a graph that runs on CUDA (some input is a
    CUDA tensor) without gradients; otherwise ``config`` unchanged (the plan keeps an unresolved 'auto' off).

    Why CUDA: there the rewrite runs ckvp's Triton grouped GEMMs, faster than the experts' own code and right where
    Inductor's compile of transformers' grouped_mm experts was not (benchmarks/results/2026-12-06-prefill-bug);
    elsewhere the op is the PyTorch reference.

    Args:
        config: the backend's options. example_inputs: the graph's inputs (tensors, symbolic ints, anything).
    Returns: a :class:`CKVPConfig` (not re-validated: its warnings were given once, at construction).
    Raises nothing.
    """
    if config.enable_expert_gemm == "auto" and _on_cuda(example_inputs) and not _needs_grad(example_inputs):
        resolved = copy.copy(config)  # (not dataclasses.replace: validated already, its warnings given once)
        object.__setattr__(resolved, "enable_expert_gemm", True)  # a frozen dataclass
        return resolved
    return config


class CKVPBackend:
    """A configured ``ckvp`` backend; ``torch.compile(model, backend=CKVPBackend(config))`` also works.

    Args:
        config: the options (default: all defaults).
        recorder: collects what happened to each graph, for inspection.
        extra_passes: additional :class:`CKVPPass` objects to run after the planned ones, by their
            ``stage`` (for tests and experiments).
    Raises (when called):
        UnsupportedGraphError: with ``config.strict`` and a site the rewrites cannot use.
    """

    def __init__(
        self,
        config: CKVPConfig | None = None,
        *,
        recorder: CompileRecorder | None = None,
        extra_passes: Sequence[CKVPPass] = (),
    ) -> None:
        self.config = config or CKVPConfig()
        self.recorder = recorder
        self.extra_passes = list(extra_passes)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        config = resolve_expert_gemm(self.config, example_inputs)
        analysis = analyze(gm)
        if config.expert_offload:
            if _needs_grad(example_inputs):  # (checked first: a traced graph-break there reads as an unknown MoE)
                raise _compat.surface_through_dynamo(UnsupportedGraphError(
                    "ckvp: expert offload is inference-only, but this call needs gradients (grad mode is on and "
                    "parameters require grad). Fix: run the model under torch.no_grad() or torch.inference_mode() "
                    "(HF generate() does); to train, load the model without offloading its experts."))
            _check_expert_offload(gm, analysis, config.expert_offload)
        binding = bind_latent_store(gm.graph, example_inputs, analysis)
        plan = make_plan(analysis, config, binding)
        if config.enable_expert_gemm == "auto" and _on_cuda(example_inputs):  # kept 'auto' on CUDA: gradients
            plan = _with_expert_reason(plan, EXPERT_GEMM_GRAD)
        if _needs_grad(example_inputs):  # the ckvp ops are inference-only (no autograd formulas)
            if plan.latent_groups:
                raise _compat.surface_through_dynamo(UnsupportedGraphError(
                    "ckvp: the latent KV cache is inference-only, but this call needs gradients (grad mode is on "
                    "and parameters require grad). Fix: run the model under torch.no_grad() or "
                    "torch.inference_mode() (HF generate() does), or use a dense cache for training."
                ))
            if any(d.rewrite and d.kind == "moe" for d in plan.decisions):
                warnings.warn("ckvp: the expert GEMM rewrite is skipped for a call that needs gradients (its ops "
                              "are inference-only); run under torch.no_grad() or torch.inference_mode() to use it",
                              UnsupportedPatternWarning, stacklevel=2)
                config = dataclasses.replace(config, enable_expert_gemm=False)
                plan = _with_expert_reason(make_plan(analysis, config, binding), EXPERT_GEMM_GRAD)
        if plan.blocking:
            raise _compat.surface_through_dynamo(UnsupportedGraphError(
                "ckvp: this graph reads a ckvp latent KV cache that cannot be rewritten, so it cannot run: "
                + "; ".join(plan.blocking)
                + (". Fix: set enable_latent_kv=True (the default), or use a dense cache (transformers StaticCache / "
                   "the model's own)." if not config.enable_latent_kv else
                   ". Fix: use a dense cache (transformers StaticCache / the model's own) for this model, or "
                   "report the model with the output of ckvp-inspect.")
            ))
        self._report_unsupported(plan)
        record = GraphRecord(len(self.recorder.graphs) if self.recorder else 0, analysis, plan)
        if self.recorder is not None:
            self.recorder.graphs.append(record)

        torch_passes, post_grad_passes = build_passes(plan, analysis, binding)
        torch_passes += [p for p in self.extra_passes if p.stage == "torch"]
        post_grad_passes += [p for p in self.extra_passes if p.stage == "post_grad"]

        record.dynamo_before = gm.code
        gm = self._run_torch_passes(gm, torch_passes, record, must_succeed=bool(plan.latent_groups))
        record.dynamo_after = gm.code
        latent = next((p for p in torch_passes if isinstance(p, LatentKVCachePass)), None)
        # MoE layers planned for the expert rewrite but left as written: all after a failed rewrite, else those the
        # pass skipped (its notes)
        experts = next((p for p in torch_passes if isinstance(p, ExpertGemmPass)), None)
        if record.fell_back or ExpertGemmPass.name in record.dropped_passes:
            left = {d.layer for d in plan.decisions if d.kind == "moe"}
        else:
            left = {n for n, note in (experts.notes if experts else {}).items() if note.startswith(SKIPPED_SITE_NOTE)}
        at_risk = grouped_mm_experts_at_risk(analysis, plan, example_inputs, config.compiler, left_by_passes=left)
        if at_risk:
            if _needs_grad(example_inputs):
                fix = GROUPED_MM_FIX_GRAD
            elif config.enable_expert_gemm is True:  # planned, but kept: an unsupported pattern, or a pass skipped it
                fix = GROUPED_MM_FIX_KEPT
            else:
                fix = GROUPED_MM_FIX
            warnings.warn(GROUPED_MM_EXPERTS_RISK.format(layers=_layer_list(at_risk), fix=fix), CKVPWarning,
                          stacklevel=2)
        if latent is not None:
            store_inputs = _StoreArgs(latent.plan)
            example_inputs = list(example_inputs) + _compat.static_fake_inputs(store_inputs.tensors(latent.plan.store))

        def on_graph(when: str, graph: fx.Graph) -> None:
            code = graph.python_code("self").src
            if when == "before":
                record.post_grad_before = code
            else:
                record.post_grad_after = code

        manager = PostGradPassManager(
            post_grad_passes, config.compute_hash(), on_graph if self.recorder is not None else None
        )
        compiled = self._compile_inner(gm, example_inputs, manager)
        record.pass_results.extend(manager.results)
        if latent is not None:
            note_compiled_size(latent.plan.store)  # an eager call of a cache of another size then names the limit
            return store_inputs.wrap(compiled)
        return compiled

    # ------------------------------------------------------------------ steps
    def _report_unsupported(self, plan: Plan) -> None:
        for u in plan.unsupported:
            msg = u.message()
            if self.config.strict:
                err = UnsupportedGraphError(
                    msg.replace(" Left untouched.", "") + " (strict=True: set strict=False to compile it untouched)"
                )
                raise _compat.surface_through_dynamo(err)
            logger.info(msg)
        if self.config.warn_unsupported:
            for msg in _grouped_messages(plan.unsupported):
                warnings.warn(msg, UnsupportedPatternWarning, stacklevel=2)

    def _run_torch_passes(
        self, gm: fx.GraphModule, passes: list[CKVPPass], record: GraphRecord, must_succeed: bool = False
    ) -> fx.GraphModule:
        if not passes:
            return gm
        candidate = fx.GraphModule(gm, copy.deepcopy(gm.graph))
        try:
            with warnings.catch_warnings(record=True) as caught:  # the passes' own warnings: shown if the try stands
                warnings.simplefilter("always")
                results = run_passes(passes, candidate.graph)
                candidate.recompile()
                _compat.copy_dynamo_graph_metadata(gm, candidate)  # static inputs (CUDA graphs) survive the copy
        except Exception as exc:  # a rewrite bug must never break the user's model
            reason = f"{type(exc).__name__}: {exc}"
            if failed_pass(exc) == ExpertGemmPass.name and must_succeed:
                # the other rewrites (the latent KV cache) stand without it: rerun them on a fresh copy
                if self.config.strict:
                    raise _compat.surface_through_dynamo(UnsupportedGraphError(
                        f"ckvp: the expert GEMM rewrite failed ({reason}) (strict=True: set strict=False to compile "
                        "the other rewrites with the experts as written, or options={'enable_expert_gemm': False}); "
                        "please report it with the output of ckvp-inspect."
                    )) from exc
                record.dropped_passes[ExpertGemmPass.name] = reason
                warnings.warn(
                    f"ckvp: the expert GEMM rewrite failed ({reason}); compiling this graph with the other rewrites "
                    "and its experts as written. Fix: options={'enable_expert_gemm': False} skips the attempt; "
                    "please report it with the output of ckvp-inspect.",
                    UnsupportedPatternWarning,
                    stacklevel=3,
                )
                rest = [p for p in passes if p.name != ExpertGemmPass.name]
                return self._run_torch_passes(gm, rest, record, must_succeed)
            record.fell_back = reason
            if must_succeed:  # the untouched graph would read latent-cache phantoms: refuse, loudly
                which = {ExpertGemmPass.name: "expert GEMM", LatentKVCachePass.name: "latent KV"}.get(
                    failed_pass(exc) or LatentKVCachePass.name, failed_pass(exc))
                raise _compat.surface_through_dynamo(UnsupportedGraphError(
                    f"ckvp: the {which} rewrite failed ({record.fell_back}); a latent cache cannot run without "
                    "its rewrite. Fix: use a dense cache for this model, and report it with the output of "
                    "ckvp-inspect."
                )) from exc
            if self.config.strict:
                raise
            warnings.warn(
                f"ckvp: a rewrite failed ({record.fell_back}); compiling the graph unchanged. "
                "Please report this with the output of ckvp-inspect.",
                UnsupportedPatternWarning,
                stacklevel=3,
            )
            return gm
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        record.pass_results.extend(results)
        return candidate

    def _compile_inner(self, gm: fx.GraphModule, example_inputs: Sequence[Any], manager: PostGradPassManager) -> Callable:
        config = self.config
        if config.compiler == "inductor":
            from .lowering import register_all as register_lowerings

            register_lowerings()  # idempotent: the ckvp ops' Inductor lowerings (templates + extern fallback)
        if config.compiler == "eager":
            if manager.passes:
                logger.warning("ckvp: compiler='eager' runs no post-grad passes; %d skipped", len(manager.passes))
            return gm.forward
        if config.compiler == "aot_eager":
            return _compat.compile_with_aot_eager(gm, example_inputs, manager)
        patches = _compat.inductor_mode_options(config.mode)
        patches.update(config.inductor)
        if "post_grad_custom_post_pass" in patches:
            logger.warning("ckvp: options['inductor']['post_grad_custom_post_pass'] is replaced by ckvp's pass manager")
        patches["post_grad_custom_post_pass"] = manager
        if self.recorder is not None:
            patches["fx_graph_cache"] = False
        if patches.get("triton.cudagraphs") and any(getattr(t, "is_cuda", False) for t in example_inputs):
            _cudagraphs_off_for_host_syncs(gm, patches)
        return _compat.compile_with_inductor(gm, example_inputs, patches)


def _grouped_messages(sites: Sequence[UnsupportedSite]) -> list[str]:
    """The warning texts for ``sites``: one per (kind, fix) found in several layers, naming the layers
    (``'ckvp: layers 0-7: <reason of the first> Left untouched. Fix: ...'``), so a model whose every layer has the
    same pattern (a DynamicCache, say) warns once per graph rather than once per layer; a site alone, or one without
    a layer, keeps :meth:`UnsupportedSite.message`. The reason shown is the first layer's; where the layers' reasons
    differ the text says so (``ckvp-inspect`` and the INFO log list each). Never raises."""
    groups: dict[tuple[str, str], list[UnsupportedSite]] = {}
    out: list[tuple[int, str]] = []
    for i, u in enumerate(sites):
        if u.layer is None:
            out.append((i, u.message()))
        else:
            groups.setdefault((u.kind, u.fix), []).append(u)
    for members in groups.values():
        first = members[0]
        layers = sorted({u.layer for u in members})
        if len(layers) == 1 and len(members) == 1:
            out.append((sites.index(first), first.message()))
            continue
        same = all(u.reason == first.reason for u in members)
        note = "" if same else f" (layer {first.layer}'s reason; the other layers' differ in detail: ckvp-inspect)"
        where = f"layer {layers[0]}" if len(layers) == 1 else f"layers {format_layers(layers)}"
        out.append((sites.index(first), f"ckvp: {where}: {first.reason}{note} Left untouched. Fix: {first.fix}"))
    return [msg for _, msg in sorted(out, key=lambda item: item[0])]


def _cudagraphs_off_for_host_syncs(gm: fx.GraphModule, patches: dict[str, Any]) -> None:
    """Turn CUDA graphs off for ``gm`` (in ``patches``), with a warning naming the op and the fix, when ``gm``
    calls an op that synchronises with the host (``analysis.graph.CAPTURE_UNSAFE_OPS``): recording such a graph
    would stop with "Cannot copy between CPU and CUDA tensors during CUDA graph capture" (H200,
    benchmarks/results/2026-11-30-max-batch-h200). The graph still runs, compiled, without CUDA graphs."""
    found = capture_unsafe_calls(gm.graph)
    if not found:
        return
    patches["triton.cudagraphs"] = False
    reasons = "; ".join(f"{name} x{n}: {CAPTURE_UNSAFE_OPS[name][0]}" for name, n in found.items())
    fixes = "; or ".join(dict.fromkeys(CAPTURE_UNSAFE_OPS[name][1] for name in found))
    warnings.warn(f"ckvp: CUDA graphs are off for this graph (mode reduce-overhead / max-autotune asked for them): "
                  f"it calls ops that synchronise with the host, which a CUDA graph cannot capture ({reasons}). "
                  f"Fix: {fixes}.", UnsupportedPatternWarning, stacklevel=3)


#: Unsupported-site kinds of the MoE analysis (analysis/moe.py) that mean experts computed in the graph itself.
_MOE_UNSUPPORTED_KINDS = frozenset({"eager_loop_graph_break", "unknown_experts_form", "unknown_combine",
                                    "unsupported_router"})


def _check_expert_offload(gm: fx.GraphModule, analysis: GraphAnalysis, resident: int) -> None:
    """Check that every MoE layer of ``gm`` is served by an expert offloader keeping ``resident`` experts per layer.

    The backend cannot offload by itself: it receives the graph after Dynamo traced it, with the expert weights
    as graph inputs on the device they were traced on (Dynamo passes them in at every call, so nothing here
    could free them), and without the model (only its parameter tensors), so it cannot swap its experts
    modules. Offloading must happen to the model before tracing (:func:`ckvp_compile.compile` or
    :func:`ckvp_compile.offload_experts`); the option states the resident count the user expects, checked here.

    Args:
        gm: the Dynamo graph. analysis: its analysis. resident: the ``expert_offload`` option (>= 1).
    Raises:
        CKVPConfigError (re-raised unwrapped by Dynamo): a MoE layer whose experts the graph computes (not
            offloaded), or an offloader keeping another number of experts resident; the message names the fix.
    """
    inline = [f"layer {s.layer} (E={s.num_experts})" for s in analysis.moe]
    inline += [f"{'a layer' if u.layer in (None, -1) else f'layer {u.layer}'} ({u.kind})"
               for u in analysis.unsupported if u.kind in _MOE_UNSUPPORTED_KINDS]
    if inline:
        sizes = sorted({s.num_experts for s in analysis.moe})
        span = f"1..{sizes[0]}" if len(sizes) == 1 else "1..E"
        raise _compat.surface_through_dynamo(CKVPConfigError(
            f"ckvp: options={{'expert_offload': {resident}}} asks for offloaded experts, but this graph computes the "
            f"experts of {', '.join(inline)} from weights that are graph inputs on the device. A backend receives "
            "the graph after Dynamo traced the model and cannot move its weights, so offload the model before "
            f"compiling: ckvp_compile.compile(model, expert_offload={resident}, options=...) (offloads, then "
            f"torch.compile(backend='ckvp')), or ckvp_compile.offload_experts(model, resident={resident}) before "
            f"torch.compile. expert_offload must be in {span} (experts kept resident per layer), or 0 for no offload."
        ))
    from .ops.offload import lookup_offloader  # the op's module: imported when used (no registration at import)

    for node in gm.graph.nodes:
        if node.op != "call_function" or op_name(node) != "ckvp::offload_experts":
            continue
        handle = node.kwargs.get("handle", node.args[3] if len(node.args) > 3 else None)
        try:
            capacity = lookup_offloader(handle).planner.capacity
        except CKVPConfigError as exc:
            raise _compat.surface_through_dynamo(exc) from None
        if capacity != resident:
            raise _compat.surface_through_dynamo(CKVPConfigError(
                f"ckvp: options={{'expert_offload': {resident}}}, but the model's experts were offloaded with "
                f"{capacity} resident per layer (offloader handle {handle}). Give the same number (or leave the "
                "option out), or offload a freshly loaded model with the number you want."
            ))


def _on_cuda(example_inputs: Sequence[Any]) -> bool:
    """True when some graph input is a CUDA tensor (the graph runs on the GPU)."""
    return any(getattr(getattr(x, "device", None), "type", None) == "cuda" for x in example_inputs)


def _needs_grad(example_inputs: Sequence[Any]) -> bool:
    """True when the compiled call will record autograd: grad mode on and some input (parameter) requires grad."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


#: Warned (once per cache) at a multi-token call on online bases already fitted since the last reset.
ONLINE_BASES_NOT_REFITTED = (
    "ckvp: this cache's online latent bases were fitted at the first call after cache.reset(); this later call of "
    "several tokens (the next chunk of a chunked prefill, generate(prefill_chunk_size=...), or a new turn on the "
    "same cache) is projected onto them without refitting, which loses accuracy when the first call held only "
    "part of the prompt. Fix: pass the whole prompt in the first call (prefill_chunk_size=None), or use calibrated "
    "bases (ckvp_compile.calibrate)")


#: Warned at compile time for graphs :func:`grouped_mm_experts_at_risk` finds ({layers}: "layer 3" / "layers 0-7";
#: {fix}: :data:`GROUPED_MM_FIX` with the rewrite off, :data:`GROUPED_MM_FIX_GRAD` for a call that needs gradients,
#: :data:`GROUPED_MM_FIX_KEPT` for layers the rewrite, on, left as written).
GROUPED_MM_EXPERTS_RISK = (
    "ckvp: the experts of {layers} stay transformers' grouped_mm experts (sort, histc, torch._grouped_mm), which "
    "Inductor compiles here for CUDA. In GPU checks (torch 2.11 on an H100 and an H200, benchmarks/results/"
    "2026-12-06-prefill-bug) that compiled code gave wrong logits, different from run to run and sometimes NaN, at "
    "prefills of 2 to 32 tokens in all, of 1 to 3 sequences (plain torch.compile too, without ckvp), while ckvp's "
    "own expert GEMM was right in all 8 runs (dense cache). Fix: {fix}; check with "
    "ckvp_compile.testing.check_equivalence(model, options=...)")
GROUPED_MM_FIX = "options={'enable_expert_gemm': True} (or 'auto', the default) or compiler='aot_eager'"
GROUPED_MM_FIX_KEPT = ("compiler='aot_eager' (the expert GEMM rewrite is on but left these layers as written: see the "
                       "warnings above or ckvp-inspect)")
GROUPED_MM_FIX_GRAD = ("compiler='aot_eager' (this call needs gradients, and ckvp's expert GEMM is inference-only: "
                       "under torch.no_grad() the default enable_expert_gemm='auto' uses it)")


def grouped_mm_experts_at_risk(analysis: Any, plan: Any, example_inputs: Sequence[Any], compiler: str, *,
                               left_by_passes: Collection[int] = ()) -> list[int]:
    """Layers whose MoE experts stay transformers' ``grouped_mm`` form (not rewritten by the expert GEMM pass) in a
    graph Inductor compiles for CUDA: the case the GPU checks of benchmarks/results/2026-12-06-prefill-bug found
    wrong (plain ``torch.compile`` too). Empty when nothing is at risk.

    Args:
        analysis: the graph's :class:`GraphAnalysis`. plan: its :class:`Plan`. example_inputs: the graph's inputs
            (their devices tell CUDA). compiler: the inner compiler ('inductor' is the one affected).
        left_by_passes: layers the plan rewrites but the passes left as written (a site the expert pass could not
            read, or every layer when the rewrite failed and the graph is compiled unchanged).
    Returns: ascending layer numbers. Raises nothing.
    """
    if compiler != "inductor" or not _on_cuda(example_inputs):
        return []
    rewritten = {d.layer for d in plan.decisions if d.kind == "moe" and d.rewrite} - set(left_by_passes)
    return sorted({m.layer for m in analysis.moe if m.experts_form == "grouped_mm" and m.layer not in rewritten})


def _layer_list(layers: Sequence[int]) -> str:
    """'layer 3', 'layers 0-7' (three or more consecutive layers) or 'layers 0, 2, 5'."""
    if len(layers) == 1:
        return f"layer {layers[0]}"
    if len(layers) > 2 and list(layers) == list(range(layers[0], layers[-1] + 1)):
        return f"layers {layers[0]}-{layers[-1]}"
    return "layers " + ", ".join(str(x) for x in layers)


class _StoreArgs:
    """Supplies the latent-store tensors the rewritten graph takes as extra inputs, per call.

    The store is looked up at each call through the phantom cache tensor the graph receives, so one compiled
    graph serves every cache (state never leaks between caches or models).

    A paged store (``LatentKVStore(page_size=P)``) has its pages mapped before each call: the pass's slot probe
    computes the call's cache slots from the graph inputs, their maximum is read on the host (one device sync
    per call: the price of on-demand paging; the unpaged path has none), and ``store.ensure_mapped(max + 1)``
    maps every sequence's pages up to it. Where the slots are not computable from the inputs, every page of
    every sequence is mapped at the first call (correct, but no memory saved).
    """

    def __init__(self, plan: LatentRewritePlan) -> None:
        self.names = list(plan.extra_inputs)
        self.index = plan.store_input_index
        self.groups = [gr.group for gr in plan.groups]
        #: per rewritten group, its layers in site order (their recent-window rings follow the group's tensors)
        self.layers = [[site.layer for site in gr.sites] for gr in plan.groups]
        self.layout = plan.store.layout()
        self.fits_online_bases = plan.fits_online_bases
        #: (P_max, W) of the RoPE tables the graph was compiled with (None: a model without RoPE)
        rope = plan.store.rope_cos
        self.rope_shape = None if rope is None else tuple(rope.shape)
        self.paged = bool(getattr(plan.store, "page_size", 0))
        self.slot_probe, self.slot_inputs = plan.slot_probe, list(plan.slot_inputs)
        self.slot_probe_note = plan.slot_probe_note
        #: whether this graph writes RoPE tables it proves paired (None: writes none); each store records it at the
        #: graph's first call on it, before any kernel reads its tables (the pass recorded it for plan.store)
        self.rope_writer = plan.rope_writer
        self._rope_noted: weakref.WeakSet = weakref.WeakSet()
        #: the key projection weight the bases' fingerprint hashes (LatentBases.check_weight), once per bases object
        self.k_weight_input, self.k_weight_path = plan.k_weight_input, plan.k_weight_path
        self._bases_checked: dict[int, tuple[Any, int, int]] = {}
        if self.paged and self.slot_probe is None:
            logger.info("ckvp: paged latent store: this graph's cache slots cannot be read from its inputs (%s), so "
                        "every page of every sequence is mapped at its first call (correct, no memory saved by "
                        "paging)", plan.slot_probe_note)

    def tensors(self, store: LatentKVStore) -> list[Any]:
        if self.rope_shape is not None:  # another store of the same layout has no tables yet: allocate them
            store.ensure_rope_tables(self.rope_shape[1], self.rope_shape[0])
        elif store.rope_cos is None:  # a model without RoPE: the tables are unused, give empty ones
            store.ensure_rope_tables(1, 1)
        if self.rope_writer is not None and store not in self._rope_noted:  # may raise: see note_rope_writer
            store.note_rope_writer(self.rope_writer)
            self._rope_noted.add(store)
        out = [store.rope_cos, store.rope_sin, store.slot_pos]
        if self.paged:  # the page table follows the slot positions (the pass adds it there)
            out.append(store.page_table)
        for g, layers in zip(self.groups, self.layers):
            out += [store.latent_k[g], store.latent_v[g], store.basis_k[g], store.basis_v[g]]
            if getattr(store, "residual_format", ""):  # ALR-KVD residual rows (the pass adds them after the bases)
                out += [store.resid_k[g], store.resid_v[g]]
            if getattr(store, "recent_window", 0):  # the dense recent window's ring of each layer, site order
                for layer in layers:
                    out += [store.window_k[layer], store.window_v[layer], store.window_slots[layer]]
        assert len(out) == len(self.names), (self.names, len(out))  # internal: pass and wrapper agree
        return out

    def wrap(self, compiled: Callable) -> Callable:
        index = self.index

        def run(*args: Any) -> Any:
            hit = lookup_phantom(args[index])
            if hit is None:
                raise UnsupportedGraphError(
                    "ckvp: a graph compiled for a ckvp latent cache was called with another cache; "
                    "call torch._dynamo.reset() or keep one cache type per compiled model"
                )
            if hit[0].layout() != self.layout:
                raise UnsupportedGraphError(
                    "ckvp: a graph compiled for one ckvp latent cache was called with a cache of another layout "
                    "(batch size, length, ranks, latent format, dtype, paging: page_size / num_pages, latent_layout, "
                    "or the bases' key_space); call torch._dynamo.reset() before switching, or keep one cache layout "
                    "per compiled model"
                )
            store = hit[0]
            self.check_bases(store, args)
            if store.online and not self.fits_online_bases and not store.online_fitted:
                raise CKVPError(
                    "ckvp: this cache uses online latent bases, which are fitted from each sequence's prompt at its "
                    "prefill; the first call after cache.reset() must hold at least 2 tokens (a prompt of one token "
                    "cannot fit them). Use calibrated bases (ckvp_compile.calibrate) for one-token prompts."
                )
            if store.online and self.fits_online_bases and store.online_fitted and not store.online_refit_warned:
                store.online_refit_warned = True  # once per cache
                warnings.warn(ONLINE_BASES_NOT_REFITTED, CKVPWarning, stacklevel=2)
            if self.paged:
                self.map_pages(store, args)
            out = compiled(*args, *self.tensors(store))
            if store.online and self.fits_online_bases:
                store.online_fitted = True
            return out

        return run

    def check_bases(self, store: LatentKVStore, args: Sequence[Any]) -> None:
        """At the first call with each bases object (and again if the weight changes), check that the store's bases
        were calibrated with this model's key projection weight (``LatentBases.check_weight``; raises
        CKVPConfigError naming the fix)."""
        if self.k_weight_input is None:
            return
        bases, weight = store.bases, args[self.k_weight_input]
        key = (weakref.ref(bases), id(weight), getattr(weight, "_version", 0))
        seen = self._bases_checked.get(id(bases))
        if seen is not None and seen[0]() is bases and seen[1:] == key[1:]:
            return
        bases.check_weight(weight, self.k_weight_path, source="the latent bases of this ckvp cache")
        if len(self._bases_checked) > 64:  # stale entries of bases that are gone
            self._bases_checked = {k: v for k, v in self._bases_checked.items() if v[0]() is not None}
        self._bases_checked[id(bases)] = key

    def map_pages(self, store: LatentKVStore, args: Sequence[Any]) -> None:
        """Map the pages of a paged ``store`` that a call with ``args`` (the graph's original inputs) touches: slots
        [0, highest slot + 1) of every sequence (one device sync, reading the slots' maximum), or every slot when
        the graph has no slot probe. A slot beyond the cache is left to the ops' own error.

        Raises:
            CKVPConfigError: the store's page pool runs out (the message names the num_pages that would do).
        """
        if self.slot_probe is None:
            try:
                store.ensure_mapped(store.max_cache_len)
            except CKVPConfigError as e:
                raise CKVPConfigError(
                    f"{e} (this graph's cache slots cannot be read from its inputs ({self.slot_probe_note}), so "
                    f"every page of every sequence is mapped at its first call: a pool for this model needs "
                    f"num_pages >= batch x max_cache_len / page_size)") from None
            return
        slots = [t for t in self.slot_probe(*(args[i] for i in self.slot_inputs)) if t.numel()]
        if slots:
            hi = int(torch.stack([t.max().long() for t in slots]).max()) + 1  # the one host read per call
            store.ensure_mapped(max(0, min(hi, store.max_cache_len)))


def ckvp_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                 options: dict[str, Any] | None = None) -> Callable:
    """The ``ckvp`` backend as ``torch.compile`` calls it: ``ckvp_backend(gm, example_inputs, **kw)``.

    Args:
        gm: the Dynamo graph (torch level; parameters and buffers are placeholders).
        example_inputs: fake or real example inputs, one per placeholder.
        mode: torch.compile's ``mode`` (passed only when not "default").
        options: torch.compile's ``options`` dict; keys are :class:`CKVPConfig` fields.
    Returns:
        The compiled callable.
    Raises:
        CKVPConfigError: an unknown option or a bad value (names the valid keys or range).
        UnsupportedGraphError: ``strict=True`` and a site the rewrites cannot use.
    """
    try:
        config = CKVPConfig.from_options(options, mode=mode)
    except CKVPConfigError as exc:
        raise _compat.surface_through_dynamo(exc) from None
    return CKVPBackend(config)(gm, example_inputs)


def _register_from_source_tree(entry_point_names: Any = None) -> bool:
    """Register ``"ckvp"`` with Dynamo unless an installed distribution's ``torch_dynamo_backends`` entry point
    already names it (Dynamo then loads :func:`ckvp_backend` from there, and a second registration would raise
    "duplicate name"). Returns whether it registered. ``entry_point_names``: the entry point names to assume
    (tests); default: the installed ones (``importlib.metadata``)."""
    if entry_point_names is None:
        from importlib.metadata import entry_points
        entry_point_names = entry_points(group="torch_dynamo_backends").names
    if "ckvp" in entry_point_names:
        return False
    try:
        torch._dynamo.register_backend(ckvp_backend, name="ckvp")
    except AssertionError:  # already registered (a reload of this module)
        return False
    return True


_register_from_source_tree()
