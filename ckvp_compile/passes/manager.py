"""The pass managers: one for the Dynamo graph, one ``CustomGraphPass`` for Inductor's post-grad hook.

Inductor caches compiled graphs keyed (among other things) by the ``uuid()`` of the custom passes in its
config; a pass without a uuid bypasses the cache, and a stale uuid would serve code compiled by an older
pass. :func:`package_source_hash` therefore hashes every source file of the package's ``passes/``,
``lowering/`` and ``kernels/`` directories (custom lowerings and templates are not in Inductor's key
either), and the manager's uuid adds the options' hash and its passes' own uuids.
torch 2.11 accepts a single object for ``post_grad_custom_post_pass``, not a list: hence one manager.
Prior art: vLLM ``vllm/compilation/pass_manager.py`` (PostGradPassManager).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from typing import Callable, Sequence

import torch.fx as fx

from .._compat import custom_graph_pass_base
from .base import CKVPPass, PassResult

logger = logging.getLogger(__name__)

_PACKAGE_DIR = Path(__file__).resolve().parent.parent
HASHED_DIRS = ("passes", "lowering", "kernels")


@functools.lru_cache(maxsize=1)
def package_source_hash() -> str:
    """Return the sha256 of every ``.py``/``.jinja`` file under passes/, lowering/ and kernels/ (sorted paths)."""
    h = hashlib.sha256()
    for sub in HASHED_DIRS:
        for path in sorted((_PACKAGE_DIR / sub).rglob("*")):
            if path.suffix in (".py", ".jinja") and path.is_file():
                h.update(str(path.relative_to(_PACKAGE_DIR)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def run_passes(
    passes: Sequence[CKVPPass],
    graph: fx.Graph,
    on_graph: Callable[[str, fx.Graph], None] | None = None,
) -> list[PassResult]:
    """Run ``passes`` in order on ``graph`` (in place), linting after each that rewrote something.

    No dead-code elimination here: FX's DCE drops in-place method calls on the torch-level graph (e.g. HF's
    ``cumulative_length.add_``), so each pass removes the nodes it makes dead itself.

    Args:
        passes: passes of one stage.
        graph: the graph to rewrite.
        on_graph: called as ``on_graph("before", graph)`` and ``on_graph("after", graph)`` (for inspection).
    Returns:
        One :class:`PassResult` per pass.
    """
    if on_graph is not None:
        on_graph("before", graph)
    results = []
    for p in passes:
        res = p(graph)
        if res.matched:
            graph.lint()
        results.append(res)
    if on_graph is not None:
        on_graph("after", graph)
    return results


class PostGradPassManager(custom_graph_pass_base()):  # type: ignore[misc]
    """The single ``post_grad_custom_post_pass`` object: runs the ckvp post-grad passes in order.

    Args:
        passes: the post-grad passes chosen by the plan (may be empty: then it is a no-op).
        config_hash: :meth:`CKVPConfig.compute_hash` of the options in force.
        on_graph: optional hook, see :func:`run_passes` (used by the inspection tool).
    """

    def __init__(
        self,
        passes: Sequence[CKVPPass],
        config_hash: str,
        on_graph: Callable[[str, fx.Graph], None] | None = None,
    ) -> None:
        self.passes = list(passes)
        self.config_hash = config_hash
        self.on_graph = on_graph
        self.results: list[PassResult] = []
        self.calls = 0

    def __call__(self, graph: fx.Graph) -> None:
        self.calls += 1
        self.results.extend(run_passes(self.passes, graph, self.on_graph))

    def uuid(self) -> str:
        """Hash of the package's pass/lowering/kernel sources, the options, and each pass's own uuid."""
        h = hashlib.sha256()
        h.update(package_source_hash().encode())
        h.update(self.config_hash.encode())
        for p in self.passes:
            h.update(p.name.encode())
            h.update(p.uuid().encode())
        return h.hexdigest()
