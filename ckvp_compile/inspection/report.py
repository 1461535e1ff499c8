"""The inspection report: compile a model with a recording ``ckvp`` backend and describe what it did.

:func:`inspect_model` compiles (by default with the cheap ``aot_eager`` inner compiler, so the post-grad ATen
graph is recorded without code generation), drives the model through prefill and decode, and returns an
:class:`InspectionReport`: per captured graph, the sites found per layer, the plan (layer groups, decisions and
their reasons, KV bytes per token before and after), unsupported patterns with reason and fix, what the passes
replaced and which ``ckvp`` ops they added, and unified diffs of the Dynamo graph and of the post-grad ATen
graph before and after the rewrites.
Given latent options (:class:`~.latent.LatentInspectOptions`) the model runs with a ckvp latent KV cache, so
the latent rewrite really happens, and the report adds the "latent KV" section (:class:`~.latent.LatentReport`).
Rendering lives in :mod:`.render`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..analysis.sites import ATTENTION_UNSUPPORTED_KINDS, AttentionSite, GraphAnalysis, MoESite, format_layers
from ..backend import CKVPBackend, CompileRecorder, GraphRecord
from ..config import CKVPConfig
from ..errors import CKVPWarning
from ..passes import CKVPPass, PassResult
from ..passes.expert_gemm import SKIPPED_SITE_NOTE, ExpertGemmPass
from ..plan import LayerGroup, Plan
from ..latent.capture import kept_module_setup, uncompiled_forward
from .capture import LatentCaches, is_gpt_fast, is_hf_causal_lm, load_model_dir, run_phases
from .latent import LatentInspectOptions, LatentReport, format_pair, resolve_bases

REPORT_VERSION = 2

_CKVP_OP = re.compile(r"torch\.ops\.ckvp\.(\w+)")

#: Inner compiler of an inspection unless the options name one: records the post-grad graph, no codegen.
DEFAULT_INSPECTION_COMPILER = "aot_eager"


# ---------------------------------------------------------------------------------------------- formatting


def format_groups(groups: Sequence[LayerGroup]) -> str:
    """Return the layer groups as ``'[0-3] [4-7]'`` (``'none'`` when there are none)."""
    return " ".join(f"[{format_layers(g.layers)}]" for g in groups) or "none"


@dataclass(frozen=True)
class LayerRow:
    """One row of the per-layer table, as display strings ('-' where the layer has no such site).

    Attributes:
        layer: layer index. attention: 'sdpa' / 'softmax_qkv'. heads: 'H/Hkv/D' plus the GQA ratio and form.
        rope: form and rotary dim ("paired": tables proven to hold one angle per rotated pair). cache_write: the
        K and V write forms. moe: scoring, order, renormalise, shared expert. experts: 'E/top-k'.
        experts_form: how the expert GEMMs are computed.
    """

    layer: int
    attention: str
    heads: str
    rope: str
    cache_write: str
    moe: str
    experts: str
    experts_form: str

    #: Column titles, in field order.
    HEADERS = ("layer", "attention", "H/Hkv/D", "RoPE", "cache write", "MoE", "E/top-k", "experts form")

    def cells(self) -> tuple[str, ...]:
        """Return the row's cells as strings, in :attr:`HEADERS` order."""
        return (str(self.layer), self.attention, self.heads, self.rope, self.cache_write, self.moe, self.experts,
                self.experts_form)


def _attention_cells(s: AttentionSite | None) -> tuple[str, str, str, str]:
    if s is None:
        return "-", "-", "-", "-"
    heads = f"{s.num_heads}/{s.num_kv_heads}/{s.head_dim}"
    if s.gqa_ratio > 1:
        heads += f" GQA {s.gqa_ratio} ({s.gqa_form})"
    if s.rope is None:
        rope = "none"
    else:
        rope = (f"{s.rope.form} d={s.rope.rotary_dim}" + (" partial" if s.rope.partial else "")
                + (" paired" if s.rope.tables_paired else ""))
    writes = [w for w in (s.k_cache, s.v_cache) if w is not None]
    if not writes:
        cache = "none"
    elif len(writes) == 2 and writes[0].form == writes[1].form:
        cache = writes[0].form
    else:
        cache = " ".join(f"{w.kind}:{w.form}" for w in writes)
    return s.form, heads, rope, cache


def _moe_cells(m: MoESite | None) -> tuple[str, str, str]:
    if m is None:
        return "-", "-", "-"
    moe = f"{m.scoring} {'then' if m.softmax_before_topk else 'after'} top-k"
    if m.renormalize:
        moe += ", renorm"
    if m.shared_expert is not None:
        moe += ", +shared" + (" (gated)" if m.shared_expert.gate_node is not None else "")
    return moe, f"{m.num_experts}/{m.top_k}", m.experts_form


# ---------------------------------------------------------------------------------------------- diffs


@dataclass(frozen=True)
class GraphDiff:
    """A unified diff of one graph's code before and after a stage's rewrites.

    Attributes:
        name: 'dynamo' (the torch-level graph, around the 'torch' passes) or 'post_grad' (the functional ATen
            graph, around the 'post_grad' passes). title: a human label.
        recorded: False when the stage produced no code (compiler='eager' has no post-grad graph).
        lines: the unified diff, one line per item, without newlines; empty when nothing changed.
        added, removed: changed line counts. size: lines of the 'after' code.
    """

    name: str
    title: str
    recorded: bool
    lines: tuple[str, ...]
    added: int
    removed: int
    size: int

    @property
    def changed(self) -> bool:
        """True when the rewrites changed the code."""
        return bool(self.lines)

    @classmethod
    def of(cls, name: str, title: str, before: str, after: str) -> "GraphDiff":
        """Diff ``before`` against ``after`` (difflib unified diff, 3 lines of context)."""
        if not before and not after:
            return cls(name, title, False, (), 0, 0, 0)
        lines = tuple(difflib.unified_diff(before.splitlines(), after.splitlines(), f"{name} before",
                                           f"{name} after", lineterm=""))
        added = sum(1 for ln in lines if ln.startswith("+") and not ln.startswith("+++"))
        removed = sum(1 for ln in lines if ln.startswith("-") and not ln.startswith("---"))
        return cls(name, title, True, lines, added, removed, len(after.splitlines()))

    def stat(self) -> str:
        """Return a one-line summary: '+3 -1 lines' / 'no change (812 lines)' / 'not recorded'."""
        if not self.recorded:
            return "not recorded (this inner compiler has no such stage)"
        if not self.changed:
            return f"no change ({self.size} lines)"
        return f"+{self.added} -{self.removed} lines"


# ---------------------------------------------------------------------------------------------- reports


@dataclass
class GraphReport(GraphRecord):
    """What the backend found and did in one captured graph: a :class:`~ckvp_compile.backend.GraphRecord`
    plus the model call that captured it.

    Attributes:
        phase: 'prefill', 'decode' or 'call'. Every other field is the record's (analysis, plan, graph code
            around each stage, pass results, fallback reason).
        kv_bytes_per_token_latent: with a latent cache, the KV bytes one token takes after the rewrite as the
            store holds them (the rewritten groups' rows in their formats + the int32 slot position, plus the
            dense K/V of layers left dense); None without one (the plan's figure is shown then).
    """

    phase: str = "call"
    kv_bytes_per_token_latent: int | None = None

    @classmethod
    def from_record(cls, record: GraphRecord, phase: str) -> "GraphReport":
        """Build the report of one :class:`~ckvp_compile.backend.GraphRecord`."""
        fields = {f.name: getattr(record, f.name) for f in dataclasses.fields(GraphRecord)}
        fields["pass_results"] = list(record.pass_results)
        return cls(**fields, phase=phase)

    @property
    def num_sites(self) -> int:
        """Attention plus MoE sites found."""
        return len(self.analysis.attention) + len(self.analysis.moe)

    def layer_rows(self) -> list[LayerRow]:
        """Return one :class:`LayerRow` per layer that holds an attention or MoE site, in layer order."""
        attn, moe = self.analysis.attention_by_layer(), self.analysis.moe_by_layer()
        return [LayerRow(layer, *_attention_cells(attn.get(layer)), *_moe_cells(moe.get(layer)))
                for layer in self.analysis.layers]

    def effective_decisions(self) -> list[Any]:
        """The plan's decisions as they turned out: a MoE site the plan meant to rewrite but the expert GEMM pass
        left as it was (its note says why) is kept, with the pass's reason (the plan is made before the pass reads
        the site in detail); so is every planned MoE site of a graph whose expert GEMM pass failed and was dropped
        (:attr:`dropped_passes`), and every site of a graph that fell back to the original (:attr:`fell_back`)."""
        left = {layer: note for r in self.pass_results if r.name == ExpertGemmPass.name
                for layer, note in r.notes if note.startswith(SKIPPED_SITE_NOTE)}
        dropped = self.dropped_passes.get(ExpertGemmPass.name)
        out = []
        for d in self.plan.decisions:
            if d.rewrite and self.fell_back:
                d = dataclasses.replace(d, rewrite=False, reason=f"the graph fell back to the original: "
                                                                 f"{self.fell_back}")
            elif d.kind == "moe" and d.rewrite and dropped:
                d = dataclasses.replace(d, rewrite=False, reason=f"the expert GEMM pass failed and was dropped: "
                                                                 f"{dropped}")
            elif d.kind == "moe" and d.rewrite and d.layer in left:
                d = dataclasses.replace(d, rewrite=False, reason=f"the expert GEMM pass: {left[d.layer]}")
            out.append(d)
        return out

    def decision_lines(self) -> list[str]:
        """Return :meth:`effective_decisions` folded by (kind, verdict, reason): 'attention [0-7]: kept: <reason>'."""
        folded: dict[tuple[str, bool, str], list[int]] = {}
        for d in self.effective_decisions():
            folded.setdefault((d.kind, d.rewrite, d.reason), []).append(d.layer)
        return [f"{kind} [{format_layers(layers)}]: {'rewrite' if rewrite else 'kept'}: {reason}"
                for (kind, rewrite, reason), layers in folded.items()]

    def kv_bytes_line(self) -> str:
        """Return 'dense -> planned' KV bytes per token, with the ratio; or why there is none.

        With a latent cache the 'after' figure is :attr:`kv_bytes_per_token_latent` (bytes the store holds).
        """
        dense, planned = self.plan.kv_bytes_per_token_dense, self.plan.kv_bytes_per_token_planned
        sites = {s.layer for s in self.analysis.attention}
        refused = sorted({u.layer for u in self.analysis.unsupported
                          if u.kind in ATTENTION_UNSUPPORTED_KINDS and u.layer is not None and u.layer not in sites})
        only = (f"; counts the attention sites only: layer{'s' if len(refused) > 1 else ''} "
                f"[{format_layers(refused)}] left dense and not counted, see unsupported" if refused else "")
        if self.kv_bytes_per_token_latent is not None and dense:
            after = self.kv_bytes_per_token_latent
            return (f"{dense} -> {after} ({dense / after:.2f}x smaller; latent rows in their storage format + "
                    f"slot position, per sequence{only})")
        if not dense:
            if any(u.kind == "unrecognised_attention" for u in self.analysis.unsupported):
                return "n/a (KV-cache writes found, but no attention that reads them was recognised: see unsupported)"
            if refused:
                return (f"n/a (no attention site to count: the KV caches of layer{'s' if len(refused) > 1 else ''} "
                        f"[{format_layers(refused)}] are left dense for the reasons under unsupported)")
            return "n/a (no KV-cache write found)"
        if planned == dense:
            return f"{dense} -> {planned} (unchanged{only})"
        return (f"{dense} -> {planned} ({dense / planned:.2f}x smaller{only})" if planned
                else f"{dense} -> 0{only}")

    @functools.cached_property
    def diffs(self) -> tuple[GraphDiff, GraphDiff]:
        """The Dynamo-graph diff and the post-grad ATen-graph diff."""
        return (
            GraphDiff.of("dynamo", "Dynamo graph, before -> after the 'torch' passes",
                         self.dynamo_before, self.dynamo_after),
            GraphDiff.of("post_grad", "post-grad ATen graph, before -> after the 'post_grad' passes",
                         self.post_grad_before, self.post_grad_after),
        )

    def added_ckvp_ops(self, stage: str) -> dict[str, int]:
        """Return ``ckvp`` ops added by a stage's passes: calls of ``torch.ops.ckvp.<op>`` in the code after the
        stage minus before it, per op name ('torch': the Dynamo graph; 'post_grad': the ATen graph)."""
        before, after = ((self.dynamo_before, self.dynamo_after) if stage == "torch"
                         else (self.post_grad_before, self.post_grad_after))
        counts: dict[str, int] = {}
        for op in _CKVP_OP.findall(after):
            counts[op] = counts.get(op, 0) + 1
        for op in _CKVP_OP.findall(before):
            counts[op] = counts.get(op, 0) - 1
        return {f"ckvp.{op}": n for op, n in sorted(counts.items()) if n > 0}

    def pass_added(self) -> list[dict[str, int] | None]:
        """Per entry of ``pass_results``: the ckvp ops it added, when it is the only pass that ran in its stage
        (the code is recorded per stage, not per pass); None when several share the stage or it was skipped."""
        ran: dict[str, int] = {}
        for r in self.pass_results:
            if not r.skipped:
                ran[r.stage] = ran.get(r.stage, 0) + 1
        return [self.added_ckvp_ops(r.stage) if not r.skipped and ran[r.stage] == 1 else None
                for r in self.pass_results]

    @property
    def replaced(self) -> dict[str, int]:
        """Nodes removed per canonical op name, summed over every pass run on this graph."""
        out: dict[str, int] = {}
        for r in self.pass_results:
            for op, n in r.replaced:
                out[op] = out.get(op, 0) + n
        return dict(sorted(out.items()))

    def to_dict(self) -> dict[str, Any]:
        """Return the graph's report as JSON-serialisable data (dataclasses as dicts, tuples as lists)."""
        plan = dataclasses.asdict(self.plan)
        plan["planned_decisions"] = plan["decisions"]  # as planned, before the passes read the sites
        plan["decisions"] = [dataclasses.asdict(d) for d in self.effective_decisions()]  # as the text shows them
        return {
            "index": self.index,
            "phase": self.phase,
            "num_nodes": self.analysis.num_nodes,
            "num_attention_sites": len(self.analysis.attention),
            "num_moe_sites": len(self.analysis.moe),
            "layers": [dataclasses.asdict(r) for r in self.layer_rows()],
            "groups": format_groups(self.plan.groups),
            "kv_bytes_per_token": {"dense": self.plan.kv_bytes_per_token_dense,
                                   "planned": self.plan.kv_bytes_per_token_planned,
                                   "latent": self.kv_bytes_per_token_latent},
            "analysis": dataclasses.asdict(self.analysis),
            "plan": plan,
            "pass_results": [dataclasses.asdict(r) for r in self.pass_results],
            "replaced": self.replaced,
            "added_ckvp_ops": {"torch": self.added_ckvp_ops("torch"), "post_grad": self.added_ckvp_ops("post_grad")},
            "latent_groups": list(self.plan.latent_groups),
            "kv_bytes_per_token_latent": self.kv_bytes_per_token_latent,
            "fell_back": self.fell_back,
            "dropped_passes": dict(self.dropped_passes),
            "diffs": [{"name": d.name, "title": d.title, "recorded": d.recorded, "added": d.added,
                       "removed": d.removed, "diff": "\n".join(d.lines)} for d in self.diffs],
            "code": {"dynamo_before": self.dynamo_before, "dynamo_after": self.dynamo_after,
                     "post_grad_before": self.post_grad_before, "post_grad_after": self.post_grad_after},
        }


@dataclass
class InspectionReport:
    """The result of :func:`inspect_model`: one :class:`GraphReport` per captured graph plus a model summary.

    The summary (``num_attention_sites``, ``num_moe_sites``, ``groups``) is taken from the graph with the most
    sites: prefill and decode usually each hold every layer, and a graph break splits layers across graphs.

    Attributes:
        model: the model's name (its directory name, or its class name).
        config: the options the backend ran with. graphs: the captured graphs, in capture order.
        warnings: the ckvp warnings raised while compiling (unsupported patterns, rewrites that fell back).
        elapsed_s: wall time of the compile and calls (and of a calibration, when one ran).
        latent: the "latent KV" section when the model ran with a latent cache, else None.
    """

    model: str
    config: CKVPConfig
    graphs: list[GraphReport]
    warnings: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    latent: LatentReport | None = None

    @property
    def main_graph(self) -> GraphReport | None:
        """The graph with the most sites (the first such), or None when nothing was captured."""
        return max(self.graphs, key=lambda g: g.num_sites, default=None)

    @property
    def num_attention_sites(self) -> int:
        """Attention sites of :attr:`main_graph` (0 without graphs)."""
        g = self.main_graph
        return len(g.analysis.attention) if g else 0

    @property
    def num_moe_sites(self) -> int:
        """MoE sites of :attr:`main_graph` (0 without graphs)."""
        g = self.main_graph
        return len(g.analysis.moe) if g else 0

    @property
    def groups(self) -> tuple[LayerGroup, ...]:
        """Layer groups of :attr:`main_graph` (empty without graphs)."""
        g = self.main_graph
        return g.plan.groups if g else ()

    def summary_line(self) -> str:
        """Return e.g. '8 attention sites, 8 MoE sites, 2 groups: [0-3] [4-7]'."""
        n = len(self.groups)
        return (f"{self.num_attention_sites} attention sites, {self.num_moe_sites} MoE sites, "
                f"{n} group{'s' if n != 1 else ''}: {format_groups(self.groups)}")

    def to_dict(self) -> dict[str, Any]:
        """Return the whole report as JSON-serialisable data (``json.dumps`` works on it as is)."""
        return {
            "version": REPORT_VERSION,
            "model": self.model,
            "options": self.config.to_dict(),
            "summary": {"num_attention_sites": self.num_attention_sites, "num_moe_sites": self.num_moe_sites,
                        "groups": [list(g.layers) for g in self.groups],
                        "main_graph": self.main_graph.index if self.main_graph else None},
            "elapsed_s": self.elapsed_s,
            "warnings": list(self.warnings),
            "latent": self.latent.to_dict() if self.latent is not None else None,
            "graphs": [g.to_dict() for g in self.graphs],
        }

    def to_text(self, *, full: bool = False) -> str:
        """Render as plain text; diffs are cut to a few dozen lines unless ``full``. See :mod:`.render`."""
        from .render import render_text

        return render_text(self, full=full)

    def to_html(self) -> str:
        """Render as one self-contained HTML page (inline CSS, no external resources). See :mod:`.render`."""
        from .render import render_html

        return render_html(self)


# ---------------------------------------------------------------------------------------------- entry point


def _resolve_config(options: Mapping[str, Any] | CKVPConfig | None) -> CKVPConfig:
    if isinstance(options, CKVPConfig):
        return options
    opts = dict(options or {})
    opts.setdefault("compiler", DEFAULT_INSPECTION_COMPILER)
    return CKVPConfig.from_options(opts)


def inspect_model(
    model_or_dir: torch.nn.Module | str | Path,
    example_inputs: tuple | list | dict | None = None,
    *,
    options: Mapping[str, Any] | CKVPConfig | None = None,
    decode: bool = True,
    max_cache_len: int = 128,
    prompt_len: int = 8,
    extra_passes: Sequence[CKVPPass] = (),
    dynamic: bool | None = False,
    latent: LatentInspectOptions | Mapping[str, Any] | None = None,
) -> InspectionReport:
    """Compile a model with the ``ckvp`` backend while recording, run it, and report what the backend did.

    Resets Dynamo before and after; the model itself is not modified (an HF model gets a fresh
    ``StaticCache``; a gpt-fast model's ``setup_caches`` is called, and its cache setup put back after:
    :func:`~ckvp_compile.latent.capture.kept_module_setup`), so it runs as before afterwards.

    With ``latent`` the model runs with a ckvp latent KV cache instead (bases from a file, or calibrated now on a
    few samples), so the latent rewrite runs; the report's ``latent`` section describes the store (groups,
    rank per head for K and V, formats, bytes per token) and each graph's KV bytes line is measured on it. A
    gpt-fast model gets its dense cache buffers back afterwards.

    Args:
        model_or_dir: an ``nn.Module``, or the path of a local Hugging Face model directory (loaded in float32).
        example_inputs: a tuple of positional arguments or a dict of keyword arguments for one call. ``None``
            drives an HF causal LM or a gpt-fast style model through a static-cache prefill of ``prompt_len``
            random tokens and, with ``decode``, one decode step.
        options: :class:`CKVPConfig` fields as a dict (``compiler`` defaults to 'aot_eager' here, which records
            the post-grad ATen graph without code generation), or a ready :class:`CKVPConfig`.
        decode: also run (and report) one decode step after the prefill.
        max_cache_len: static cache length S_max (default 128). prompt_len: prefill length S.
        extra_passes: extra :class:`CKVPPass` objects to run after the planned ones (tests, experiments).
        dynamic: ``torch.compile``'s ``dynamic``. The default ``False`` compiles prefill and decode each for
            its own shapes, as static-cache decoding does; ``None`` lets Dynamo mark the sequence length
            dynamic on the decode recompile, as a plain ``torch.compile(model)`` would.
        latent: a :class:`~.latent.LatentInspectOptions` (or a dict of its fields, e.g.
            ``{"kv_ratio": 4, "latent_format": "int8"}``): inspect with a latent cache. Needs an HF causal LM or
            a gpt-fast style model and no ``example_inputs``.
    Returns:
        An :class:`InspectionReport` with one :class:`GraphReport` per captured graph.
    Raises:
        CKVPModelLoadError: ``model_or_dir`` is a path that is not a loadable model directory.
        CKVPConfigError: an unknown option or a bad value; bad latent options, bases calibrated for another
            model, or a kv_ratio the model cannot reach (the message names the range).
        TypeError: ``model_or_dir`` is neither a module / callable nor a path.
        ValueError: no ``example_inputs`` for a model that needs them, prompt/cache lengths that do not fit,
            or ``latent`` with ``example_inputs`` or a model that is neither an HF causal LM nor gpt-fast style.
        UnsupportedGraphError: ``strict=True`` and a site the rewrites cannot use.
    """
    config = _resolve_config(options)
    latent_opts = LatentInspectOptions.of(latent)
    if latent_opts is not None and example_inputs is not None:
        raise ValueError("a latent-cache inspection drives the model itself (an HF causal LM or a gpt-fast style "
                         "model) through prefill and decode; leave example_inputs out")
    if isinstance(model_or_dir, (str, Path)):
        name = Path(model_or_dir).name or str(model_or_dir)
        model = load_model_dir(model_or_dir)
    elif isinstance(model_or_dir, torch.nn.Module) or callable(model_or_dir):
        name, model = type(model_or_dir).__name__, model_or_dir
    else:
        raise TypeError(f"inspect: give a torch.nn.Module (or a callable) or the path of a local Hugging Face model "
                        f"directory, got {type(model_or_dir).__name__}")
    start = time.perf_counter()
    kept = (kept_module_setup(model) if isinstance(model, torch.nn.Module) and callable(getattr(model, "setup_caches", None))
            else contextlib.nullcontext())  # a gpt-fast model's cache setup, put back after
    with kept:
        return _inspect(model, name, example_inputs, config, latent_opts, start, decode=decode,
                        max_cache_len=max_cache_len, prompt_len=prompt_len, extra_passes=extra_passes,
                        dynamic=dynamic)


def _inspect(model: Any, name: str, example_inputs: Any, config: CKVPConfig, latent_opts: Any, start: float, *,
             decode: bool, max_cache_len: int, prompt_len: int, extra_passes: Sequence[CKVPPass],
             dynamic: bool | None) -> InspectionReport:
    """:func:`inspect_model` after its arguments are checked and the model is loaded."""
    caches, source = None, ""
    if latent_opts is not None:
        if not (is_hf_causal_lm(model) or is_gpt_fast(model)):
            raise ValueError(f"{type(model).__name__} is neither a Hugging Face causal LM nor a gpt-fast style model;"
                             " a latent-cache inspection needs one of them (or inspect it without latent=)")
        with torch.no_grad():
            bases, source = resolve_bases(model, latent_opts, config.group_size)
        k_format, v_format = format_pair(latent_opts.latent_format)
        caches = LatentCaches(bases, k_format, v_format, latent_opts.latent_dtype)
    recorder = CompileRecorder()
    backend = CKVPBackend(config, recorder=recorder, extra_passes=extra_passes)
    torch._dynamo.reset()
    phases_of_graphs: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            compiled = torch.compile(model, backend=backend, fullgraph=False, dynamic=dynamic)
            with torch.no_grad(), uncompiled_forward(model):
                for phase, call in run_phases(model, compiled, example_inputs, decode=decode,
                                              max_cache_len=max_cache_len, prompt_len=prompt_len, latent=caches):
                    call()
                    phases_of_graphs += [phase] * (len(recorder.graphs) - len(phases_of_graphs))
        finally:
            torch._dynamo.reset()
            if caches is not None:
                caches.restore()
    ckvp_warnings: list[str] = []
    for w in caught:
        if issubclass(w.category, CKVPWarning):
            if str(w.message) not in ckvp_warnings:
                ckvp_warnings.append(str(w.message))
        else:  # not ours: hand it on unchanged
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    graphs = [GraphReport.from_record(r, phase) for r, phase in zip(recorder.graphs, phases_of_graphs)]
    latent_report = None
    if caches is not None and caches.stores:
        store = caches.stores[-1]
        latent_report = LatentReport.of(store, source)
        for g in graphs:
            g.kv_bytes_per_token_latent = _latent_kv_bytes(g, latent_report) if g.plan.latent_groups else None
    return InspectionReport(name, config, graphs, ckvp_warnings, time.perf_counter() - start, latent_report)


def _latent_kv_bytes(g: GraphReport, latent: LatentReport) -> int:
    """KV bytes per token of one sequence after ``g``'s rewrite: its rewritten groups' latent rows + the slot
    position, plus the dense K and V of its cache-writing layers outside those groups."""
    rows = {r.index: r for r in latent.groups}
    covered = {layer for i in g.plan.latent_groups for layer in rows[i].layers}
    dense = sum(s.num_kv_heads * s.head_dim * (s.k_cache.itemsize + s.v_cache.itemsize)
                for s in g.analysis.attention
                if s.layer not in covered and s.k_cache is not None and s.v_cache is not None)
    row_bytes = {i: r.k_bytes_per_token + r.v_bytes_per_token for i, r in rows.items()}
    slot_bytes = latent.latent_bytes_per_token - sum(row_bytes.values())  # the int32 slot position
    return dense + slot_bytes + sum(row_bytes[i] for i in g.plan.latent_groups)
