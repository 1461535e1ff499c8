"""Expert offload decisions without tensors: per-layer slot caches, the replacement policy, prefetch selection and
the statistics.

:class:`OffloadPlanner` decides, for every MoE layer call, which experts are resident, which are copied (on demand
or as a prefetch), into which device slot, and in how many rounds the call runs when its experts do not all fit.
It holds no tensors, so the same object drives the tensor executor
(:class:`~ckvp_compile.runtime.offload.ExpertOffloader`) and the replay of a recorded routing trace
(:func:`ckvp_compile.runtime.prediction.replay_trace`); the CPU tests check both agree.

Notation: E experts per layer, A top-k, C slots (experts kept resident) per layer, L layers.

Policies (``policy=``), chosen by measurement on the fixture's real routing (``ckvp-bench offload --recall-only``,
``benchmarks/results/2026-11-29-offload-recall/``):

* ``"lru"``: evict the resident expert whose last demand use (or last prediction) is oldest.
* ``"lfu"``: evict the resident expert with the fewest demand uses so far (ties: LRU).

Both protect the experts of the current round and the experts just predicted for a layer, and neither evicts an
expert a prediction has marked unless nothing else is left. A prediction of a resident expert refreshes its LRU
time ("keep the predicted experts").

Source: the LRU expert cache and next-layer gate prediction of Eliseev & Mazur, "Fast Inference of
Mixture-of-Experts Language Models with Offloading" (2023), and the prefetch / cache split of MoE-Infinity
(Xue et al., 2024) and ProMoE (Song et al., 2024), re-derived; no code copied.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import CKVPConfigError

__all__ = ["POLICIES", "LayerCache", "OffloadPlanner", "OffloadStats", "Round", "check_rows"]

#: Replacement policies :class:`LayerCache` implements.
POLICIES = ("lru", "lfu")


@dataclass
class OffloadStats:
    """Counters of an expert offloader since its creation or last :meth:`reset`.

    Attributes:
        calls: MoE layer calls. tokens: rows (T) over all calls. rounds: calls that needed more than one round
            (their distinct experts did not fit in the C slots at once).
        lookups: distinct (call, expert) pairs the routing needed; ``hits + misses == lookups``.
        hits: needed experts already resident or in flight (a prefetch counts as a hit; its wait is in
            ``stall_ms``). misses: needed experts copied on demand.
        prefetch_copies: experts copied ahead of use by a prediction. prefetch_useful: prefetched experts later
            used by their layer before eviction. prefetch_wasted: prefetched experts evicted unused.
        expert_bytes: bytes of one expert (gate, up and down weights).
        bytes_demand, bytes_prefetch: bytes copied host -> device on demand / as prefetches;
            ``bytes_copied = bytes_demand + bytes_prefetch = (misses + prefetch_copies) * expert_bytes``.
        recall_actual: distinct experts used by layer calls that had a next-layer (distance 1) prediction.
        recall_topk_hits: of those, how many were in the union of the tokens' predicted top-A.
        recall_margin_hits: ... in the union of the predicted top-(A + margin) (what the prefetch targets).
        stall_ms: time the compute stream waited for expert copies (CUDA events around the waits; 0 on CPU,
            where copies are synchronous and nothing overlaps).
    """

    calls: int = 0
    tokens: int = 0
    rounds: int = 0
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    prefetch_copies: int = 0
    prefetch_useful: int = 0
    prefetch_wasted: int = 0
    expert_bytes: int = 0
    bytes_demand: int = 0
    bytes_prefetch: int = 0
    recall_actual: int = 0
    recall_topk_hits: int = 0
    recall_margin_hits: int = 0
    stall_ms: float = 0.0

    @property
    def bytes_copied(self) -> int:
        """All bytes copied host -> device (demand + prefetch)."""
        return self.bytes_demand + self.bytes_prefetch

    @property
    def hit_rate(self) -> float:
        """hits / lookups (NaN before the first lookup)."""
        return self.hits / self.lookups if self.lookups else float("nan")

    @property
    def recall_topk(self) -> float:
        """Top-A recall of the next layer's experts: recall_topk_hits / recall_actual (NaN without predictions)."""
        return self.recall_topk_hits / self.recall_actual if self.recall_actual else float("nan")

    @property
    def recall_margin(self) -> float:
        """Recall of the predicted top-(A + margin): recall_margin_hits / recall_actual."""
        return self.recall_margin_hits / self.recall_actual if self.recall_actual else float("nan")

    def to_dict(self) -> dict:
        """Every counter and derived rate, JSON-serialisable."""
        return dict(asdict(self), bytes_copied=self.bytes_copied, hit_rate=self.hit_rate,
                    recall_topk=self.recall_topk, recall_margin=self.recall_margin)


@dataclass(frozen=True)
class Round:
    """One round of a layer call: the experts computed together and the copies it needs first.

    Attributes:
        experts: distinct expert ids of this round (at most C), ascending.
        slot_of: expert id -> device slot, for every expert of the round.
        loads: (expert, slot) demand copies to issue before the round's compute.
    """

    experts: tuple[int, ...]
    slot_of: dict[int, int]
    loads: tuple[tuple[int, int], ...]


class LayerCache:
    """The C device slots of one layer: which expert each holds and the replacement state.

    Args:
        num_experts: E. capacity: C in [1, E]. policy: one of :data:`POLICIES`.
    Initial state: slot s holds expert s (s < C), as :class:`~ckvp_compile.runtime.offload.ExpertOffloader`
    fills it at creation (those copies are not counted).
    Raises:
        CKVPConfigError: capacity out of [1, E] or an unknown policy.
    """

    def __init__(self, num_experts: int, capacity: int, policy: str = "lfu") -> None:
        if not 1 <= capacity <= num_experts:
            raise CKVPConfigError(f"resident experts per layer must be in [1, E={num_experts}], got {capacity}")
        if policy not in POLICIES:
            raise CKVPConfigError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
        self.num_experts, self.capacity, self.policy = num_experts, capacity, policy
        self.slots: list[int] = list(range(capacity))  # expert held by each slot
        self.where: dict[int, int] = {e: e for e in range(capacity)}  # expert -> slot
        self.last_use = [0] * capacity  # per slot, the clock of the last demand use / prediction
        self.prefetched_unused = [False] * capacity  # per slot: filled by a prefetch, not yet used
        self.uses = [0] * num_experts  # per expert: demand uses (LFU)
        self.clock = 0

    def resident(self, expert: int) -> bool:
        """Whether ``expert`` is in a slot (its copy may still be in flight)."""
        return expert in self.where

    def touch(self, expert: int, *, demand: bool) -> None:
        """Record a use of a resident expert (``demand``) or a prediction of it (refreshes LRU time only)."""
        self.clock += 1
        self.last_use[self.where[expert]] = self.clock
        if demand:
            self.uses[expert] += 1

    def allocate(self, expert: int, protected: set[int]) -> tuple[int, int]:
        """Choose the slot ``expert`` is copied into, evicting by the policy; never evicts ``protected`` experts.

        Returns:
            (slot, evicted expert id or -1).
        Raises:
            RuntimeError: every slot holds a protected expert (a planner bug: rounds never protect more than C).
        """
        candidates = [s for s, e in enumerate(self.slots) if e not in protected]
        if not candidates:
            raise RuntimeError(f"no evictable slot for expert {expert}: all {self.capacity} slots protected")
        if self.policy == "lfu":
            slot = min(candidates, key=lambda s: (self.uses[self.slots[s]], self.last_use[s], s))
        else:
            slot = min(candidates, key=lambda s: (self.last_use[s], s))
        evicted = self.slots[slot]
        del self.where[evicted]
        self.slots[slot] = expert
        self.where[expert] = slot
        self.clock += 1
        self.last_use[slot] = self.clock
        return slot, evicted


@dataclass
class _Pending:
    topk: set[int]
    margin: set[int]


class OffloadPlanner:
    """Every offload decision of a model's MoE layers, and the statistics (no tensors).

    Args:
        num_layers: L. num_experts: E. top_k: A. capacity: C resident experts per layer, in [1, E].
        policy: replacement policy, one of :data:`POLICIES`.
        prefetch: issue predicted copies (False: on-demand fetching only; predictions are still scored for
            recall if given).
        margin: extra predicted experts per token beyond A (the prefetch targets each token's top-(A + margin)).
        lookahead: predict layers L+1 .. L+lookahead from layer L's input (>= 1).
        expert_bytes: bytes of one expert, for the byte counters.
    Raises:
        CKVPConfigError: a value out of range (the message names it).
    """

    def __init__(self, *, num_layers: int, num_experts: int, top_k: int, capacity: int, policy: str = "lfu",
                 prefetch: bool = True, margin: int = 0, lookahead: int = 1, expert_bytes: int = 0) -> None:
        if not 1 <= top_k <= num_experts:
            raise CKVPConfigError(f"top_k must be in [1, E={num_experts}], got {top_k}")
        if margin < 0 or lookahead < 1:
            raise CKVPConfigError(f"margin must be >= 0 and lookahead >= 1, got margin={margin}, lookahead={lookahead}")
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.capacity, self.policy, self.prefetch = capacity, policy, prefetch
        self.margin, self.lookahead = margin, lookahead
        self.caches = [LayerCache(num_experts, capacity, policy) for _ in range(num_layers)]
        self.stats = OffloadStats(expert_bytes=expert_bytes)
        self._pending: dict[int, _Pending] = {}

    def reset_stats(self) -> None:
        """Zero the counters (the cache contents stay)."""
        self.stats = OffloadStats(expert_bytes=self.stats.expert_bytes)
        self._pending.clear()

    @property
    def predict_width(self) -> int:
        """Candidates per token a prediction ranks: min(E, A + margin)."""
        return min(self.num_experts, self.top_k + self.margin)

    def demand(self, layer: int, rows: list[list[int]]) -> list[Round]:
        """Plan one layer call: hits, demand copies and rounds, and update the statistics.

        Args:
            layer: layer index in [0, L). rows: per token, its A expert ids (the routing, on the host).
        Returns:
            The rounds, in order. Round 1 holds every needed expert already resident plus as many misses as fit;
            later rounds hold the remaining misses, C at a time (each evicting the previous round's experts).
        """
        cache, st = self.caches[layer], self.stats
        needed = sorted({e for row in rows for e in row})
        st.calls += 1
        st.tokens += len(rows)
        st.lookups += len(needed)
        pending = self._pending.pop(layer, None)
        if pending is not None:
            st.recall_actual += len(needed)
            st.recall_topk_hits += len(pending.topk.intersection(needed))
            st.recall_margin_hits += len(pending.margin.intersection(needed))
        hit = [e for e in needed if cache.resident(e)]
        miss = [e for e in needed if not cache.resident(e)]
        st.hits += len(hit)
        st.misses += len(miss)
        st.bytes_demand += len(miss) * st.expert_bytes
        for e in hit:
            slot = cache.where[e]
            if cache.prefetched_unused[slot]:
                cache.prefetched_unused[slot] = False
                st.prefetch_useful += 1
            cache.touch(e, demand=True)
        groups = [hit + miss[: cache.capacity - len(hit)]]
        rest = miss[cache.capacity - len(hit):]
        groups += [rest[i:i + cache.capacity] for i in range(0, len(rest), cache.capacity)]
        if len(groups) > 1:
            st.rounds += 1
        rounds = []
        for group in groups:
            protected = set(group)
            loads = []
            for e in group:
                if not cache.resident(e):
                    slot, evicted = cache.allocate(e, protected)
                    self._evicted(cache, slot, evicted)
                    loads.append((e, slot))
                    cache.uses[e] += 1
            rounds.append(Round(tuple(sorted(group)), {e: cache.where[e] for e in group}, tuple(loads)))
        return rounds

    def predict(self, layer: int, ranked: dict[int, list[list[int]]]) -> list[tuple[int, int, int]]:
        """Record the predictions made at ``layer`` and plan the prefetch copies they call for.

        Args:
            layer: the layer whose input made the predictions.
            ranked: target layer j (layer < j <= layer + lookahead, j < L) -> per token, its predicted experts
                best first (``predict_width`` of them; the first A are the predicted top-A).
        Returns:
            (target layer, expert, slot) copies, in issue order (nearest layer first, then the experts most
            tokens predicted). Empty when ``prefetch`` is off.
        """
        loads: list[tuple[int, int, int]] = []
        for j in sorted(ranked):
            rows = ranked[j]
            if j == layer + 1:
                self._pending[j] = _Pending({e for r in rows for e in r[: self.top_k]}, {e for r in rows for e in r})
            if not self.prefetch:
                continue
            cache = self.caches[j]
            score: dict[int, tuple[int, int]] = {}
            for r in rows:  # rank: tokens predicting it (more first), then best position in any token's ranking
                for pos, e in enumerate(r):
                    n, best = score.get(e, (0, pos))
                    score[e] = (n + 1, min(best, pos))
            chosen = sorted(score, key=lambda e: (-score[e][0], score[e][1], e))[: cache.capacity]
            protected = set(chosen)
            for e in chosen:
                if cache.resident(e):
                    cache.touch(e, demand=False)
                    continue
                slot, evicted = cache.allocate(e, protected)
                self._evicted(cache, slot, evicted)
                cache.prefetched_unused[slot] = True
                self.stats.prefetch_copies += 1
                self.stats.bytes_prefetch += self.stats.expert_bytes
                loads.append((j, e, slot))
        return loads

    def _evicted(self, cache: LayerCache, slot: int, evicted: int) -> None:
        if cache.prefetched_unused[slot]:
            self.stats.prefetch_wasted += 1
        cache.prefetched_unused[slot] = False


def check_rows(rows: list[list[int]], num_experts: int, what: str = "topk_ids") -> None:
    """Raise :class:`CKVPConfigError` naming the first expert id outside [0, E) in ``rows``."""
    for t, row in enumerate(rows):
        for e in row:
            if not 0 <= e < num_experts:
                raise CKVPConfigError(f"{what}[{t}] holds expert id {e}, outside [0, E={num_experts})")
