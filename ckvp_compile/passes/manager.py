"""The pass managers: one for the Dynamo graph, one ``CustomGraphPass`` for Inductor's post-grad hook.

Inductor caches compiled graphs keyed (among other things) by the ``uuid()`` of the custom passes in its
config; a pass without a uuid bypasses the cache, and a stale uuid would serve code compiled by an older
pass. :func:`package_source_hash` therefore hashes every ``.py`` / ``.jinja`` source file of the package
except ``testing/`` and ``inspection/`` (passes, lowerings and kernels, but also the ops' fake kernels, the
runtime, the latent calibration and the analysis all shape the compiled code, and none is in Inductor's key),
and the manager's uuid adds the options' hash and its passes' own uuids. The hash is recomputed when a file's
(path, mtime, size) changes, so an edit within a running process is seen.
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
#: Package subdirectories that cannot change compiled code: their sources are not hashed.
UNHASHED_DIRS = ("testing", "inspection")
HASHED_SUFFIXES = (".py", ".jinja")


def hashed_source_files() -> list[Path]:
    """Return the package's ``.py`` / ``.jinja`` files outside :data:`UNHASHED_DIRS`, in sorted order."""
    out = []
    for path in sorted(_PACKAGE_DIR.rglob("*")):
        rel = path.relative_to(_PACKAGE_DIR).parts
        if path.suffix in HASHED_SUFFIXES and rel[0] not in UNHASHED_DIRS and "__pycache__" not in rel \
                and path.is_file():
            out.append(path)
    return out


def package_source_hash() -> str:
    """Return the sha256 of the package's sources (:func:`hashed_source_files`: relative path and contents).

    Each call lists the files and stats them; the contents are re-read only when some file's
    (path, st_mtime_ns, st_size) differs from a previous call, so edits in a running process are seen.
    """
    stamps = []
    for path in hashed_source_files():
        try:
            st = path.stat()
        except OSError:  # removed while listing
            continue
        stamps.append((str(path.relative_to(_PACKAGE_DIR)), st.st_mtime_ns, st.st_size))
    return _hash_sources(str(_PACKAGE_DIR), tuple(stamps))


@functools.lru_cache(maxsize=16)
def _hash_sources(root: str, stamps: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for rel, _, _ in stamps:
        try:
            data = (Path(root) / rel).read_bytes()
        except OSError:
            data = b""
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


package_source_hash.cache_clear = _hash_sources.cache_clear  # type: ignore[attr-defined]  # the old lru_cache API


#: Note :func:`run_passes` adds to the exception of a pass that raised, followed by the pass's name.
FAILED_PASS_NOTE = "raised in the ckvp pass: "


def failed_pass(exc: BaseException) -> str | None:
    """The name of the pass whose exception ``exc`` is (raised through :func:`run_passes`), or None."""
    return next((n[len(FAILED_PASS_NOTE):] for n in getattr(exc, "__notes__", ()) if n.startswith(FAILED_PASS_NOTE)),
                None)


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
    Raises:
        whatever a pass raises, with the note ``FAILED_PASS_NOTE + name`` naming the pass (:func:`failed_pass`).
    """
    if on_graph is not None:
        on_graph("before", graph)
    results = []
    for p in passes:
        try:
            res = p(graph)
            if res.matched:
                graph.lint()  # (inside: a graph the pass left malformed is its failure too)
        except Exception as exc:
            exc.add_note(FAILED_PASS_NOTE + p.name)
            raise
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
        """Hash of the package's sources (:func:`package_source_hash`), the options, and each pass's own uuid."""
        h = hashlib.sha256()
        h.update(package_source_hash().encode())
        h.update(self.config_hash.encode())
        for p in self.passes:
            h.update(p.name.encode())
            h.update(p.uuid().encode())
        return h.hexdigest()
