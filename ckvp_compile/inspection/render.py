"""Render an :class:`~ckvp_compile.inspection.report.InspectionReport` as plain text or as one HTML page.

Both renderers show the same content: the model summary, the "latent KV" section when the model ran with a
latent cache (groups, rank per head for K and V, formats, bytes per token, the store's measured bytes, page and
window), then per graph the analysis notes, the layer table, groups, KV bytes per token, decisions, unsupported
patterns, pass results (nodes each pass replaced, ckvp ops it added), replaced nodes and the diffs. The
text form cuts each diff to :data:`TEXT_DIFF_LINES` lines unless ``full``; the HTML form
(``templates/report.html.jinja``, jinja2 with autoescape on) is self-contained: inline CSS, no scripts or
external resources, diffs as colored ``<pre>`` blocks, and the rewritten graphs' code in collapsed ``<details>``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Sequence

from .latent import LatentGroupRow
from .report import LayerRow, format_groups

if TYPE_CHECKING:
    from .report import GraphDiff, GraphReport, InspectionReport

#: Lines of each diff shown by the text renderer unless ``full=True``.
TEXT_DIFF_LINES = 40

#: Characters of one diff line shown by the text renderer unless ``full=True`` (a graph's ``forward(...)`` signature
#: is one line of many kilobytes).
TEXT_DIFF_WIDTH = 240

#: Options shown in the header (the rest are in ``to_dict()['options']``).
_HEADER_OPTIONS = ("compiler", "mode", "group_size", "enable_latent_kv", "enable_expert_gemm", "strict")


def options_line(report: "InspectionReport") -> str:
    """Return the header's options summary, e.g. 'compiler=aot_eager group_size=4 ... (hash 1a2b3c4d)'."""
    opts = report.config.to_dict()
    parts = [f"{k}={opts[k]}" for k in _HEADER_OPTIONS]
    if opts["inductor"]:
        parts.append(f"inductor={opts['inductor']}")
    return " ".join(parts) + f" (hash {report.config.compute_hash()[:8]})"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Return a plain-text table: columns padded to their widest cell, separated by ' | '.

    Args:
        headers: column titles. rows: the cells, one sequence per row, as many as ``headers``.
    Returns:
        The lines: header, a '-+-' rule, then one line per row (trailing spaces stripped).
    """
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    line = lambda cells: " | ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [line(headers), "-+-".join("-" * w for w in widths)] + [line(r) for r in rows]


def _counts(items: Any) -> str:
    return ", ".join(f"{op} x{n}" for op, n in items)


def _pass_line(r: Any, added: dict[str, int] | None = None) -> str:
    """One pass result: sites rewritten, nodes removed per op, and (when known) the ckvp ops it added."""
    if r.skipped:
        return f"{r.name} ({r.stage}): skipped: {r.skipped}"
    line = (f"{r.name} ({r.stage}): {r.matched} site(s) rewritten in {r.elapsed_ms:.1f} ms; "
            f"replaced {_counts(r.replaced) or 'nothing'}")
    if added:
        line += f"; added {_counts(added.items())}"
    return line


def _pass_lines(g: "GraphReport") -> list[str]:
    """One line per pass result, each followed by its per-layer notes (what it left as it was, and why)."""
    from .report import format_layers

    out = []
    for r, added in zip(g.pass_results, g.pass_added()):
        out.append(_pass_line(r, added))
        folded: dict[str, list[int]] = {}
        for layer, note in getattr(r, "notes", ()):
            folded.setdefault(note, []).append(layer)
        out += [f"  {r.name} note, layers [{format_layers(layers)}]: {note}" for note, layers in folded.items()]
    return out


def _stage_added_lines(g: "GraphReport") -> list[str]:
    """'ckvp ops added by the torch passes: ...' for stages where several passes ran (not attributable)."""
    out = []
    attributed = {r.stage for r, a in zip(g.pass_results, g.pass_added()) if a is not None}
    for stage in ("torch", "post_grad"):
        added = g.added_ckvp_ops(stage)
        if added and stage not in attributed:
            out.append(f"ckvp ops added by the '{stage}' passes: {_counts(added.items())}")
    return out


def latent_text(latent: Any) -> list[str]:
    """Return the "latent KV" section as text lines (header, per-group table, bytes, store, page, window)."""
    out = ["latent KV (CKVP store the model ran with):", "  " + latent.header_line()]
    out += ["  " + ln for ln in format_table(LatentGroupRow.HEADERS, [r.cells() for r in latent.groups])]
    out += ["  " + ln for ln in latent.lines()]
    return out


def _diff_text(d: "GraphDiff", full: bool) -> list[str]:
    out = [f"diff {d.title}: {d.stat()}"]
    if d.changed:
        shown = d.lines if full else d.lines[:TEXT_DIFF_LINES]
        for ln in shown:
            if not full and len(ln) > TEXT_DIFF_WIDTH:
                ln = f"{ln[:TEXT_DIFF_WIDTH]} ... ({len(ln) - TEXT_DIFF_WIDTH} more characters)"
            out.append(("    " + ln).rstrip())
        if len(shown) < len(d.lines):
            out.append(f"    ... {len(d.lines) - len(shown)} more diff lines (--full, or to_text(full=True), "
                       "shows them all)")
    return out


def _graph_text(g: "GraphReport", full: bool) -> list[str]:
    a = g.analysis
    out = [f"=== graph {g.index} ({g.phase}): {a.num_nodes} nodes, {len(a.attention)} attention sites, "
           f"{len(a.moe)} MoE sites ==="]
    out += [f"note: {n}" for n in a.notes]
    rows = g.layer_rows()
    if rows:
        out += format_table(LayerRow.HEADERS, [r.cells() for r in rows])
    else:
        out.append("no attention or MoE sites found in this graph")
    out.append(f"groups: {format_groups(g.plan.groups)}"
               + (f" (latent cache in groups #{', #'.join(map(str, g.plan.latent_groups))})"
                  if g.plan.latent_groups else ""))
    out.append(f"KV bytes/token: {g.kv_bytes_line()}")
    out.append("decisions:" + ("" if g.plan.decisions else " none"))
    out += ["  " + ln for ln in g.decision_lines()]
    out.append("unsupported:" + ("" if g.plan.unsupported else " none"))
    for u in g.plan.unsupported:
        where = f"layer {u.layer}" if u.layer is not None else "graph"
        out.append(f"  {where} [{u.kind}]: {u.reason} Fix: {u.fix}")
    out.append("passes:" + ("" if g.pass_results else " none run"))
    out += ["  " + ln for ln in _pass_lines(g) + _stage_added_lines(g)]
    out.append("replaced nodes: " + (", ".join(f"{op} x{n}" for op, n in g.replaced.items()) or "none"))
    if g.fell_back:
        out.append(f"FELL BACK to the original graph: {g.fell_back}")
    for name, reason in g.dropped_passes.items():
        out.append(f"DROPPED the {name} pass (compiled with the other rewrites): {reason}")
    for d in g.diffs:
        out += _diff_text(d, full)
    return out


def render_text(report: "InspectionReport", *, full: bool = False) -> str:
    """Render ``report`` as plain text.

    Args:
        report: the inspection report.
        full: show every diff line whole (default: the first :data:`TEXT_DIFF_LINES` of each diff, each cut to
            :data:`TEXT_DIFF_WIDTH` characters).
    Returns:
        The text, ending with a newline.
    """
    main = report.main_graph
    out = [
        f"ckvp inspection of {report.model}",
        f"options: {options_line(report)}",
        f"captured {len(report.graphs)} graph(s) in {report.elapsed_s:.1f} s",
        f"model summary: {report.summary_line()}"
        + (f"  (from graph {main.index}, {main.phase})" if main is not None else ""),
    ]
    if main is not None:
        out.append(f"KV bytes/token: {main.kv_bytes_line()}")
        split = [g for g in report.graphs if g.phase == main.phase and g.num_sites]
        if len(split) > 1:
            out.append(f"note: the {main.phase} was captured as {len(split)} graphs with sites (graph breaks); the "
                       f"summary and KV bytes above are graph {main.index}'s alone, and each graph numbers its layers "
                       "from 0: see every graph below")
    groups = report.latent.bases.group_size if report.latent is not None and report.latent.bases is not None else None
    if groups is not None and groups != report.config.group_size:
        out.append(f"note: the latent bases fix G={groups} layers per group; the group_size={report.config.group_size}"
                   " option does not apply to a latent cache")
    if report.latent is not None:
        out += [""] + latent_text(report.latent)
    for g in report.graphs:
        out += [""] + _graph_text(g, full)
    if report.warnings:
        out += ["", "warnings:"] + [f"  {w}" for w in report.warnings]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- HTML


def _diff_class(line: str) -> str:
    if line.startswith(("+++", "---")):
        return "meta"
    if line.startswith("@@"):
        return "hunk"
    if line.startswith("+"):
        return "add"
    if line.startswith("-"):
        return "del"
    return "ctx"


@functools.lru_cache(maxsize=1)
def _environment() -> Any:
    import jinja2

    return jinja2.Environment(
        loader=jinja2.PackageLoader("ckvp_compile.inspection", "templates"),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )


def html_context(report: "InspectionReport") -> dict[str, Any]:
    """Return the template's variables: the report reduced to strings, lists and dicts (no logic left)."""
    main = report.main_graph
    graphs = []
    for g in report.graphs:
        graphs.append({
            "index": g.index,
            "phase": g.phase,
            "num_nodes": g.analysis.num_nodes,
            "num_attention": len(g.analysis.attention),
            "num_moe": len(g.analysis.moe),
            "notes": list(g.analysis.notes),
            "rows": [r.cells() for r in g.layer_rows()],
            "groups": format_groups(g.plan.groups),
            "latent_groups": ", ".join(map(str, g.plan.latent_groups)),
            "kv_bytes": g.kv_bytes_line(),
            "decisions": g.decision_lines(),
            "unsupported": [{"where": f"layer {u.layer}" if u.layer is not None else "graph", "kind": u.kind,
                             "reason": u.reason, "fix": u.fix} for u in g.plan.unsupported],
            "passes": _pass_lines(g) + _stage_added_lines(g),
            "replaced": list(g.replaced.items()),
            "fell_back": g.fell_back,
            "dropped_passes": list(g.dropped_passes.items()),
            "diffs": [{"title": d.title, "stat": d.stat(), "changed": d.changed,
                       "lines": [(_diff_class(ln), ln) for ln in d.lines]} for d in g.diffs],
            "code": [(title, code) for title, code in (("Dynamo graph after the 'torch' passes", g.dynamo_after),
                                                        ("post-grad ATen graph after the 'post_grad' passes",
                                                         g.post_grad_after)) if code],
        })
    return {
        "model": report.model,
        "options": options_line(report),
        "elapsed": f"{report.elapsed_s:.1f}",
        "summary": report.summary_line(),
        "main": f"graph {main.index}, {main.phase}" if main is not None else "",
        "kv_bytes": main.kv_bytes_line() if main is not None else "n/a",
        "headers": LayerRow.HEADERS,
        "graphs": graphs,
        "warnings": list(report.warnings),
        "latent": _latent_context(report.latent),
    }


def _latent_context(latent: Any) -> dict[str, Any] | None:
    if latent is None:
        return None
    return {"header": latent.header_line(), "headers": LatentGroupRow.HEADERS,
            "rows": [r.cells() for r in latent.groups], "lines": latent.lines()}


def render_html(report: "InspectionReport") -> str:
    """Render ``report`` as one self-contained HTML page (every value HTML-escaped by jinja2's autoescape).

    Args:
        report: the inspection report.
    Returns:
        The page's HTML.
    """
    return _environment().get_template("report.html.jinja").render(**html_context(report))
