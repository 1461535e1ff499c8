"""Base class of every ckvp graph pass, with a source-hash ``uuid()`` for Inductor's FX graph cache."""

from __future__ import annotations

import hashlib
import inspect
import logging
import time
from dataclasses import dataclass

import torch.fx as fx

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PassResult:
    """What one pass did to one graph.

    Attributes:
        name: the pass's name. stage: 'torch' (Dynamo graph) or 'post_grad' (functional ATen graph).
        matched: how many sites it rewrote. skipped: the reason it did not apply, or ''.
        elapsed_ms: wall time of the pass in milliseconds.
        replaced: count of removed nodes per canonical op name (``analysis.graph.op_name``).
        notes: per site (layer), what the pass chose to leave as it was there and why (a pass's ``notes``
            dict; empty reasons are omitted).
    """

    name: str
    stage: str
    matched: int
    skipped: str
    elapsed_ms: float
    replaced: tuple[tuple[str, int], ...] = ()
    notes: tuple[tuple[int, str], ...] = ()


class CKVPPass:
    """A graph rewrite. Subclasses set ``name`` and ``stage`` and implement :meth:`apply`.

    ``stage`` is 'torch' for passes on the Dynamo graph (run by the backend before the inner compiler)
    or 'post_grad' for passes on the functional ATen graph (run by the one Inductor custom pass manager).
    A pass that cannot apply returns a reason from :meth:`is_applicable` and is skipped, never raises.
    """

    name: str = "ckvp_pass"
    stage: str = "post_grad"

    def is_applicable(self, graph: fx.Graph) -> str:
        """Return '' when the pass should run on ``graph``, else the reason it is skipped."""
        return ""

    def apply(self, graph: fx.Graph) -> int:
        """Rewrite ``graph`` in place; return the number of sites rewritten."""
        raise NotImplementedError(f"{type(self).__name__}.apply")

    def uuid(self) -> str:
        """Return a hash of this pass's class source; changes whenever the pass's code changes."""
        try:
            src = inspect.getsource(type(self))
        except (OSError, TypeError):  # defined interactively: fall back to its qualified name
            src = type(self).__qualname__
        return hashlib.sha256(src.encode()).hexdigest()

    def __call__(self, graph: fx.Graph) -> PassResult:
        """Run the pass on ``graph`` with timing and before/after node counts; see :class:`PassResult`."""
        reason = self.is_applicable(graph)
        if reason:
            logger.debug("ckvp pass %s skipped: %s", self.name, reason)
            return PassResult(self.name, self.stage, 0, reason, 0.0)
        before = _op_counts(graph)
        start = time.perf_counter()
        matched = self.apply(graph)
        elapsed = (time.perf_counter() - start) * 1e3
        after = _op_counts(graph)
        replaced = tuple(sorted((k, v - after.get(k, 0)) for k, v in before.items() if v > after.get(k, 0)))
        logger.info("ckvp pass %s: %d site(s) rewritten in %.1f ms", self.name, matched, elapsed)
        notes = tuple(sorted((k, v) for k, v in getattr(self, "notes", {}).items() if v))
        return PassResult(self.name, self.stage, matched, "", elapsed, replaced, notes)


def _op_counts(graph: fx.Graph) -> dict[str, int]:
    from ..analysis.graph import op_name

    counts: dict[str, int] = {}
    for n in graph.nodes:
        k = op_name(n)
        counts[k] = counts.get(k, 0) + 1
    return counts
