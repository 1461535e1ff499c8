"""The graph-diff inspection tool: what the ``ckvp`` backend finds in a model's graphs and what it rewrites.

    report = ckvp_compile.inspection.inspect_model("models/tiny-mixtral-pystdlib")
    print(report.to_text())            # per-layer sites, groups, KV bytes/token, unsupported, diffs
    open("report.html", "w").write(report.to_html())

    # with a ckvp latent KV cache, so the latent rewrite runs and report.latent shows groups, ranks and bytes
    report = ckvp_compile.inspection.inspect_model("models/tiny-mixtral-pystdlib",
                                                   latent={"kv_ratio": 4, "latent_format": "int8"})

Also the ``ckvp-inspect`` console script (``python -m ckvp_compile.inspection``), see :mod:`.cli`.
Modules: :mod:`.capture` loads and drives the model, :mod:`.report` records and describes, :mod:`.latent` the
latent-cache options and the "latent KV" section, :mod:`.render` formats text and HTML, :mod:`.cli` is the
command line.
"""

from __future__ import annotations

from .latent import LatentGroupRow, LatentInspectOptions, LatentReport
from .report import GraphDiff, GraphReport, InspectionReport, LayerRow, inspect_model

__all__ = ["GraphDiff", "GraphReport", "InspectionReport", "LatentGroupRow", "LatentInspectOptions", "LatentReport",
           "LayerRow", "inspect_model"]
