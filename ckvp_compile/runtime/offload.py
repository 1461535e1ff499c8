"""Expert offload: expert weights in (pinned) host memory, a per-layer device cache of C experts, and next-layer
prediction with prefetch on a side CUDA stream.

    handle = ckvp_compile.offload_experts(model, resident=4, margin=1)   # HF Mixtral-style model, in place
    model(...)                        # eager, or torch.compile(model.forward, backend="ckvp")
    handle.stats()                    # OffloadStats: hit rate, recall, bytes copied, stall time

Per layer (E experts, C resident slots, A top-k), one :meth:`ExpertOffloader.forward` call:

1. On the compute stream, the predictors of layers L+1 .. L+lookahead score layer L's input (a (T, Dm) x (Dm, E)
   product each) and take each token's top-(A + margin); with layer L's routing this is copied to the host in
   **one** synchronisation (which experts to copy is a host decision).
2. :class:`~ckvp_compile.runtime.offload_policy.OffloadPlanner` splits layer L's experts into hits and misses and
   into rounds of at most C experts. Misses are copied on demand on the copy stream, each copy ordered after the
   last compute that read its slot (an event per slot), and each slot's ``ready`` event recorded after it; the
   compute stream waits on the round's ``ready`` events (the wait is timed with CUDA events: ``stall_ms``), then
   runs ``ckvp::moe_experts`` on the slot buffers with the routing remapped to slots.
3. The planner picks layer L+1's (.. L+lookahead's) predicted experts (the C most-predicted) and the copy stream
   copies those not resident, queued after layer L's demand copies, so they run while layer L (and the following
   layers' attention) computes. A wrong prediction only costs bytes: layer L+1 fetches its misses on demand in
   step 2, so the output is the all-resident output whatever the prediction.

Prediction: layer L+1's router applied to layer L's residual stream after attention, normalised by layer L+1's
RMSNorm. The MoE block of layer L only sees ``norm_L(r) = w_L * r / rms(r)``; since ``norm_{L+1}(r) = norm_L(r) *
(w_{L+1} / w_L)``, the predictor is layer L+1's router weight with its columns scaled by ``w_{L+1} / w_L``
(``predictor="norm"``; coordinates where ``|w_L|`` is below 1e-6 of its largest value get 0). ``"router"`` applies
layer L+1's router to layer L's MoE input unchanged. Recall of both on the fixture:
``benchmarks/results/2026-11-29-offload-recall/``.

Exactness: a round whose experts all fit computes ``ckvp::moe_experts`` with ids remapped to slots: every
expert sees the same rows in the same order as with all experts resident, so the result is bitwise equal (on
the PyTorch reference path; on CUDA the Triton kernels tile those rows the same way). A call needing more than
C experts runs in rounds over gathered (token, slot) pairs and sums each token's A pair outputs in fp32 in slot
order, as the grouped kernel does: bitwise equal in fp32; in bf16 / fp16 each pair output is rounded to the
dtype before that sum (within the dtype's rounding of the all-resident output).

Weights: the offloader holds its own copies (the replaced experts modules and their parameters are released, so
a device copy of them is freed). ``model.state_dict()`` of the offloaded model lists them under their
original keys ``<experts>.gate_up_proj`` (E, 2I, Dm) / ``<experts>.down_proj`` (E, Dm, I), in expert order: the host
store's tensors (on CPU, sharing its memory as a plain model's state dict shares its parameters'), so ``torch.save``
/ safetensors files of an offloaded model load into an offloaded or a plain model. ``model.load_state_dict(sd)`` on
the offloaded model hands ``sd``'s ``<experts>.gate_up_proj`` / ``<experts>.down_proj`` to
:meth:`ExpertOffloader.load_weights` (host store and resident slots; compiled graphs read them at run time, no
recompile). An in-place edit of a state-dict tensor (the host store) is seen by the next layer call (its version
counter moved), which refreshes that layer's resident slots from the host store. The predictors follow the model's
router and norm weights the same way: :func:`offload_experts` keeps those parameters as the predictors' sources, and
a layer call whose sources were written or replaced (``load_state_dict``, an in-place edit, a ``.data`` swap, a
new ``Parameter`` or a new router / norm module: version counter, storage or object changed) refolds that layer's
predictors first (a stale predictor would cost bytes, never correctness). Writes through ``.data`` in place
(``w.data.copy_(x)``) move ``.data``'s own version counter, not the parameter's, so they are not seen: call
:meth:`ExpertOffloader.refold_predictors` after them.

Physics (H200, DESIGN.md): a Mixtral-8x7B expert is 352 MB, 6.35 ms over PCIe at 55.5 GB/s, against about 0.2
to 0.7 ms of compute per MoE layer. Prefetch overlaps copies with compute, it does not make them cheaper: per
token, time >= max(copy bytes / link bandwidth, compute), against their sum on demand; the bytes copied are set
by the hit rate (capacity, policy, routing locality) and by wrong predictions. ``ckvp-bench offload`` measures it.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from ..errors import CKVPConfigError, CKVPShapeError
from ..ops import moe as _moe_ops  # noqa: F401  (defines ckvp::moe_experts)
from ..ops import offload as _offload_ops  # noqa: F401  (defines ckvp::offload_experts)
from .offload_policy import POLICIES, OffloadPlanner, OffloadStats, Round, check_rows

__all__ = ["PREDICTORS", "ExpertOffloader", "OffloadedExperts", "fold_norm_predictor", "offload_experts",
           "offloader_of", "owning_module"]

#: How the next layers' routers are applied to layer L's MoE input (see the module docstring).
PREDICTORS = ("norm", "router")


def fold_norm_predictor(router_next: torch.Tensor, norm_next: torch.Tensor | None,
                        norm_this: torch.Tensor | None) -> torch.Tensor:
    """Return the (E, Dm) predictor ``router_next * (norm_next / norm_this)`` (columns scaled), or ``router_next``.

    Args:
        router_next: (E, Dm) float, router weight of the predicted layer.
        norm_next, norm_this: (Dm,) RMSNorm weights before the predicted layer's / this layer's MoE block, or None
            (then the router is returned unchanged).
    Returns:
        (E, Dm) router_next.dtype: applied to this layer's MoE input ``norm_this(r)`` it gives
        ``router_next(norm_next(r))``, exactly where ``|norm_this| >= 1e-6 * max|norm_this|`` (0 elsewhere).
    """
    if norm_next is None or norm_this is None:
        return router_next.detach().clone()
    this = norm_this.detach().float()
    keep = this.abs() >= 1e-6 * this.abs().max().clamp_min(1e-30)
    ratio = torch.where(keep, norm_next.detach().float() / torch.where(keep, this, torch.ones_like(this)), 0.0)
    return (router_next.detach().float() * ratio).to(router_next.dtype)


class ExpertOffloader:
    """Host store, per-layer device expert caches, prediction and prefetch for L MoE layers.

    Args:
        gate_up: per layer, (E, 2I, Dm) float expert weights, gate rows first (HF transformers 5.x layout), any
            device; copied into the host store (pinned when ``device`` is CUDA).
        down: per layer, (E, Dm, I), same dtype.
        resident: C, experts kept on the device per layer, in [1, E].
        top_k: A. device: where the slots live and the experts compute.
        predictors: per layer L, the (E, Dm) predictors of layers L+1 .. L+lookahead (see
            :func:`fold_norm_predictor`); ``None``: no prediction (on-demand only, no recall statistics).
        predictor_sources: per layer L and predicted layer, a callable returning the current
            ``(router_next, norm_next, norm_this)`` tensors its predictor is folded from (``predictors``' nesting;
            norms may be None), e.g. the model's live parameters: a layer call after one of them was written or
            replaced refolds that layer's predictors. None: the predictors are fixed.
        prefetch: issue the predicted copies (False: predictions are still scored for recall).
        margin: predicted experts per token beyond A. lookahead: layers predicted ahead (>= 1).
        policy: one of :data:`~ckvp_compile.runtime.offload_policy.POLICIES`.
        measure_stalls: time the compute stream's waits with CUDA events (``stall_ms``).
        share_host: on a CPU device, use CPU weights as the host store without copying them (with a CUDA
            device, pinned contiguous CPU weights are always shared: several offloaders can serve one store;
            inference tensors are always copied, so that the store stays writable outside inference mode).
    Memory: device C * 3 * I * Dm * itemsize bytes per layer; host E times that per layer.
    Raises:
        CKVPConfigError: a value out of range. CKVPShapeError: inconsistent weight shapes or dtypes.
    """

    def __init__(self, gate_up: Sequence[torch.Tensor], down: Sequence[torch.Tensor], *, resident: int, top_k: int,
                 device: torch.device | str, predictors: Sequence[Sequence[torch.Tensor]] | None = None,
                 prefetch: bool = True, margin: int = 0, lookahead: int = 1, policy: str = "lfu",
                 measure_stalls: bool = True, share_host: bool = False,
                 predictor_sources: Sequence[Sequence[Callable[[], tuple]]] | None = None) -> None:
        if len(gate_up) != len(down) or not gate_up:
            raise CKVPShapeError(f"gate_up and down must list the same layers (>= 1), got {len(gate_up)} and {len(down)}")
        e, two_i, dm = gate_up[0].shape
        i = two_i // 2
        for n, (gu, dn) in enumerate(zip(gate_up, down)):
            if tuple(gu.shape) != (e, 2 * i, dm) or tuple(dn.shape) != (e, dm, i) or gu.dtype != dn.dtype:
                raise CKVPShapeError(f"layer {n}: gate_up must be (E, 2I, Dm) = ({e}, {2 * i}, {dm}) and down (E, Dm, I) "
                                     f"= ({e}, {dm}, {i}) of one dtype, got {tuple(gu.shape)} {gu.dtype} and "
                                     f"{tuple(dn.shape)} {dn.dtype}")
        if policy not in POLICIES:
            raise CKVPConfigError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" means the current device: pin it
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_layers, self.num_experts, self.top_k, self.ffn, self.dm = len(gate_up), e, top_k, i, dm
        self.dtype = gate_up[0].dtype
        self.lookahead = lookahead
        cuda = self.device.type == "cuda"
        pin = cuda and torch.cuda.is_available()

        share = pin or share_host  # CUDA: pinned contiguous CPU weights are used as they are

        def host(w: torch.Tensor) -> torch.Tensor:
            if (share and w.device.type == "cpu" and w.is_contiguous() and (w.is_pinned() or not pin)
                    and not w.is_inference()):
                return w.detach()
            out = torch.empty(w.shape, dtype=w.dtype, pin_memory=pin)
            return out.copy_(w.detach())

        expert_bytes = 3 * i * dm * self.dtype.itemsize
        self.planner = OffloadPlanner(num_layers=self.num_layers, num_experts=e, top_k=top_k, capacity=resident,
                                      policy=policy, prefetch=prefetch and predictors is not None, margin=margin,
                                      lookahead=lookahead, expert_bytes=expert_bytes)
        # normal tensors even when built under torch.inference_mode(): every later call writes the slots (and
        # load_state_dict the host store) in place, which inference tensors refuse outside inference mode
        with torch.inference_mode(False):
            self.host_gate_up = [host(w) for w in gate_up]
            self.host_down = [host(w) for w in down]
            self.slot_gate_up = [torch.empty((resident, 2 * i, dm), dtype=self.dtype, device=self.device)
                                 for _ in range(self.num_layers)]
            self.slot_down = [torch.empty((resident, dm, i), dtype=self.dtype, device=self.device)
                              for _ in range(self.num_layers)]
            for n in range(self.num_layers):  # LayerCache's initial state: slot s holds expert s
                self.slot_gate_up[n].copy_(self.host_gate_up[n][:resident])
                self.slot_down[n].copy_(self.host_down[n][:resident])
        self._host_versions = [self._host_version(n) for n in range(self.num_layers)]
        self._stale: set[int] = set()  # layers whose slots may not hold what the planner says (a failed call)
        self.predictors = None
        if predictors is not None:
            if len(predictors) != self.num_layers:
                raise CKVPShapeError(f"predictors must have one entry per layer ({self.num_layers}), got {len(predictors)}")
            self.predictors = [[p.detach().to(self.device, self.dtype) for p in ps[: lookahead]] for ps in predictors]
        self._sources = None
        if predictor_sources is not None:
            if self.predictors is None or [len(s) for s in predictor_sources] != [len(p) for p in predictors]:
                raise CKVPShapeError("predictor_sources must have the nesting of predictors (one callable returning "
                                     "(router_next, norm_next, norm_this) per predictor)")
            self._sources = [list(srcs[: lookahead]) for srcs in predictor_sources]
            self._stamped: list[list[torch.Tensor]] = [[] for _ in range(self.num_layers)]
            self._source_stamps = [self._stamp(n, hold=True) for n in range(self.num_layers)]
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self.measure_stalls = measure_stalls and cuda
        self._ready: list[list[Any]] = [[None] * resident for _ in range(self.num_layers)]
        self._read_done: list[list[Any]] = [[None] * resident for _ in range(self.num_layers)]
        self._stall_events: list[tuple[Any, Any]] = []
        self._stall_ms = 0.0
        if cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self.options: dict[str, Any] = {}  # offload_experts' keyword options, recorded by it
        self.handle = _offload_ops.register_offloader(self)

    # ------------------------------------------------------------------ statistics
    def stats(self) -> OffloadStats:
        """Return a snapshot of the statistics (waits for the timed stall events; no other synchronisation)."""
        for start, end in self._stall_events:
            end.synchronize()
            self._stall_ms += start.elapsed_time(end)
        self._stall_events.clear()
        return replace(self.planner.stats, stall_ms=self._stall_ms)

    def reset_stats(self) -> None:
        """Zero the statistics; the cache contents stay."""
        self.stats()
        self.planner.reset_stats()
        self._stall_ms = 0.0

    def close(self) -> None:
        """Unregister the handle (the offloaded model stops working) and free the buffers."""
        _offload_ops.unregister_offloader(self.handle)
        self.host_gate_up = self.host_down = self.slot_gate_up = self.slot_down = []

    def load_weights(self, layer: int, gate_up: torch.Tensor | None = None, down: torch.Tensor | None = None) -> None:
        """Replace layer ``layer``'s expert weights: the host store and the device slots that hold its experts.

        Compiled graphs read the weights through the offloader at run time, so no recompilation is needed.
        ``OffloadedExperts`` calls this from ``model.load_state_dict`` (keys ``<experts>.gate_up_proj`` /
        ``<experts>.down_proj``, as before offloading). Waits for every pending copy and compute on the device first.

        Args:
            layer: in [0, L). gate_up: (E, 2I, Dm), down: (E, Dm, I), any device and float dtype (cast to the
                offloader's dtype, as ``load_state_dict`` casts into a parameter); None keeps that weight.
        Raises:
            CKVPConfigError: layer out of range, or the offloader was closed. CKVPShapeError: a weight of another
                shape.
        """
        if not self.host_gate_up:
            raise CKVPConfigError("load_weights: this offloader was closed and its expert weights freed; load the "
                                  "model again and offload it again")
        if not 0 <= layer < self.num_layers:
            raise CKVPConfigError(f"layer must be in [0, {self.num_layers}), got {layer}")
        pairs = [(w, store) for w, store in ((gate_up, self.host_gate_up[layer]), (down, self.host_down[layer]))
                 if w is not None]
        for w, store in pairs:
            if tuple(w.shape) != tuple(store.shape) or not w.is_floating_point():
                raise CKVPShapeError(f"layer {layer}: expert weight must be float {tuple(store.shape)}, got "
                                     f"{tuple(w.shape)} {w.dtype}")
        self._refill(layer, pairs)

    def _refill(self, layer: int, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
        """Copy each (new weight, host store) pair into the store, then refill layer ``layer``'s resident slots
        from the host store and record its version counters."""
        if self.device.type == "cuda":  # no copy in flight may read the host store or write a slot while we do
            torch.cuda.synchronize(self.device)
        with torch.no_grad():
            for w, store in pairs:
                store.copy_(w.detach())
            for slot, expert in enumerate(self.planner.caches[layer].slots):
                self.slot_gate_up[layer][slot].copy_(self.host_gate_up[layer][expert])
                self.slot_down[layer][slot].copy_(self.host_down[layer][expert])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._host_versions[layer] = self._host_version(layer)
        self._stale.discard(layer)

    def _stamp(self, layer: int, hold: bool = False) -> tuple:
        """(object, version, storage pointer) of every source tensor of ``layer``'s predictors (inference tensors
        have no version counter: -1, their object and storage still count). ``hold`` (at each fold): keep the
        tensors (a few (E, Dm) and (Dm,) weights) until the next fold, so that a freed storage's address cannot
        come back as a new weight's; the per-call check holds nothing."""
        tensors = [t for src in self._sources[layer] for t in src() if t is not None]
        if hold:
            self._stamped[layer] = [t.detach() for t in tensors]
        return tuple((id(t), -1 if t.is_inference() else t._version, t.data_ptr()) for t in tensors)

    def _changed(self, layer: int) -> bool:
        """Whether ``layer``'s predictor sources moved since its last fold."""
        return self._stamp(layer) != self._source_stamps[layer]

    def refold_predictors(self, layer: int | None = None) -> None:
        """Fold ``layer``'s predictors (every layer's when None) again from their sources' current values
        (:func:`fold_norm_predictor`); a layer call does it by itself when a source was written.

        Raises:
            CKVPConfigError: the offloader has no predictor sources (built with fixed ``predictors``), was closed,
                or ``layer`` is out of range.
        """
        if self._sources is None:
            raise CKVPConfigError("this offloader's predictors were given as fixed tensors (no predictor_sources): "
                                  "nothing to refold from; build it with offload_experts")
        if not self.host_gate_up:
            raise CKVPConfigError("this offloader was closed; offload the model again")
        if layer is not None and not (isinstance(layer, int) and 0 <= layer < self.num_layers):
            raise CKVPConfigError(f"layer must be in [0, {self.num_layers}) or None (every layer), got {layer!r}")
        for n in range(self.num_layers) if layer is None else (layer,):
            for j, src in enumerate(self._sources[n]):
                router, norm_next, norm_this = src()
                if router is None or tuple(router.shape) != tuple(self.predictors[n][j].shape):
                    continue  # e.g. a router module swapped for one without an (E, Dm) weight: keep the last fold
                folded = fold_norm_predictor(router, norm_next, norm_this)
                self.predictors[n][j] = folded.detach().to(self.device, self.dtype)
            self._source_stamps[n] = self._stamp(n, hold=True)

    def _host_version(self, layer: int) -> tuple[int, int] | None:
        """The version counters of layer ``layer``'s host store (they move with every in-place write, also through
        the state dict's tensors, which share them); None for inference tensors (no counter)."""
        try:
            return self.host_gate_up[layer]._version, self.host_down[layer]._version
        except RuntimeError:
            return None

    def host_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return layer ``layer``'s full expert weights: the host store, detached (shares its memory).

        Returns:
            (gate_up (E, 2I, Dm), down (E, Dm, I)), the offloader's dtype, on CPU, in expert order (whatever the
            device slots hold). Writing into them in place changes the experts: the next call of that layer
            refreshes its resident slots from the host store.
        Raises:
            CKVPConfigError: layer out of range, or the offloader was closed (its weights were freed).
        """
        if not self.host_gate_up:
            raise CKVPConfigError("the expert offloader was closed and its expert weights freed; load the model "
                                  "again (and offload it again) to get them")
        if not 0 <= layer < self.num_layers:
            raise CKVPConfigError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return self.host_gate_up[layer].detach(), self.host_down[layer].detach()

    def device_bytes(self) -> int:
        """Bytes of the device expert slots (all layers)."""
        return sum(t.numel() * t.element_size() for t in self.slot_gate_up + self.slot_down)

    # ------------------------------------------------------------------ the layer call
    def forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Compute layer ``layer``'s routed experts from the device cache; prefetch the next layers' experts.

        Args:
            layer: in [0, L). hidden: (T, Dm) the model dtype, on ``device``. topk_ids: (T, A) int32|int64.
            topk_weights: (T, A) float.
        Returns:
            (T, Dm) hidden.dtype, the all-resident ``ckvp::moe_experts`` output (see the module docstring).
        Raises:
            CKVPConfigError: layer or an expert id out of range. CKVPShapeError: shapes, dtype or device. Any
            exception raised during the copies or the compute (``KeyboardInterrupt``, out of memory) propagates,
            and the next call of each layer it had planned refills that layer's slots from the host store first,
            so later calls stay exact.
        """
        if not 0 <= layer < self.num_layers:
            raise CKVPConfigError(f"layer must be in [0, {self.num_layers}), got {layer}")
        if hidden.dtype != self.dtype or hidden.device != self.device or hidden.shape[-1] != self.dm:
            raise CKVPShapeError(f"hidden must be (T, {self.dm}) {self.dtype} on {self.device} (the offloaded experts' "
                                 f"dtype and device), got {tuple(hidden.shape)} {hidden.dtype} on {hidden.device}. "
                                 "The offloaded experts keep the dtype and device they had at offload time "
                                 "(model.to() does not move them): cast or move the model before "
                                 "ckvp_compile.offload_experts, or load it again and offload it again")
        if layer in self._stale or (self._host_versions[layer] is not None
                                    and self._host_version(layer) != self._host_versions[layer]):
            self._refill(layer)  # an earlier call failed, or the host store was written in place: slots follow
        if self._sources is not None and self._changed(layer):
            self.refold_predictors(layer)  # router / norm weights were written (load_state_dict): refold
        t, a = topk_ids.shape
        targets = []
        if self.predictors is not None:
            targets = [j for j in range(layer + 1, min(self.num_layers, layer + self.lookahead + 1))]
        width = self.planner.predict_width
        parts = [topk_ids.reshape(-1).to(torch.int64)]
        for j in targets:
            logits = hidden @ self.predictors[layer][j - layer - 1].T  # (T, E)
            parts.append(logits.topk(width, dim=-1).indices.reshape(-1))
        flat = torch.cat(parts).tolist() if t else []  # the one host synchronisation
        rows = [flat[r * a:(r + 1) * a] for r in range(t)]
        check_rows(rows, self.num_experts)
        ranked = {}
        for n, j in enumerate(targets):
            base = t * a + n * t * width
            ranked[j] = [flat[base + r * width: base + (r + 1) * width] for r in range(t)]
        if t == 0:
            return hidden.new_zeros(hidden.shape)
        rounds = self.planner.demand(layer, rows)
        try:
            if len(rounds) == 1:
                out = self._round_direct(layer, rounds[0], hidden, rows, topk_weights)
            else:
                out = self._rounds_gathered(layer, rounds, hidden, rows, topk_weights)
            for j, expert, slot in self.planner.predict(layer, ranked):
                self._copy(j, expert, slot)
        except BaseException:
            # the planner already places this call's experts (every round) and predictions in slots, but a failure
            # (an interrupt, an out-of-memory) may have come before their copies: the next call of each layer this
            # call planned refills its slots from the host store first, or it would read stale experts
            self._stale.update([layer, *targets])
            raise
        return out

    def _upload(self, data: list) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.tensor(data, dtype=torch.int64, pin_memory=True).to(self.device, non_blocking=True)
        return torch.tensor(data, dtype=torch.int64, device=self.device)

    def _copy(self, layer: int, expert: int, slot: int) -> None:
        gu, dn = self.slot_gate_up[layer][slot], self.slot_down[layer][slot]
        if self.copy_stream is None:
            gu.copy_(self.host_gate_up[layer][expert])
            dn.copy_(self.host_down[layer][expert])
            return
        done = self._read_done[layer][slot]
        with torch.cuda.stream(self.copy_stream):
            if done is not None:
                self.copy_stream.wait_event(done)
            gu.copy_(self.host_gate_up[layer][expert], non_blocking=True)
            dn.copy_(self.host_down[layer][expert], non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.copy_stream)
        self._ready[layer][slot] = ready

    def _prepare(self, layer: int, rnd: Round) -> None:
        """Issue the round's demand copies and make the compute stream wait for every slot it reads."""
        for expert, slot in rnd.loads:
            self._copy(layer, expert, slot)
        if self.copy_stream is None:
            return
        stream = torch.cuda.current_stream(self.device)
        waits = [self._ready[layer][rnd.slot_of[e]] for e in rnd.experts]
        waits = [w for w in waits if w is not None]
        start = end = None
        if self.measure_stalls and waits:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
        for w in waits:
            stream.wait_event(w)
        if start is not None:
            end.record(stream)
            self._stall_events.append((start, end))

    def _finish(self, layer: int, rnd: Round) -> None:
        if self.copy_stream is None:
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        for e in rnd.experts:
            self._read_done[layer][rnd.slot_of[e]] = done

    def _weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gu, i = self.slot_gate_up[layer], self.ffn
        return gu[:, :i], gu[:, i:], self.slot_down[layer]

    def _round_direct(self, layer: int, rnd: Round, hidden: torch.Tensor, rows: list[list[int]],
                      topk_weights: torch.Tensor) -> torch.Tensor:
        slot_ids = self._upload([[rnd.slot_of[e] for e in row] for row in rows])
        self._prepare(layer, rnd)
        out = torch.ops.ckvp.moe_experts(hidden, slot_ids, topk_weights, *self._weights(layer))
        self._finish(layer, rnd)
        return out

    def _rounds_gathered(self, layer: int, rounds: list[Round], hidden: torch.Tensor, rows: list[list[int]],
                         topk_weights: torch.Tensor) -> torch.Tensor:
        t, a = len(rows), len(rows[0])
        flat = [e for row in rows for e in row]
        pairs_out = torch.zeros((t * a, self.dm), dtype=torch.float32, device=self.device)
        weights = topk_weights.reshape(-1, 1)
        for rnd in rounds:
            members = set(rnd.experts)
            pairs = [p for p, e in enumerate(flat) if e in members]
            idx = self._upload(pairs)
            slot_ids = self._upload([[rnd.slot_of[flat[p]]] for p in pairs])
            x = hidden.index_select(0, torch.div(idx, a, rounding_mode="floor"))
            w = weights.index_select(0, idx)
            self._prepare(layer, rnd)
            y = torch.ops.ckvp.moe_experts(x, slot_ids, w, *self._weights(layer))
            self._finish(layer, rnd)
            pairs_out.index_copy_(0, idx, y.float())
        return pairs_out.view(t, a, self.dm).sum(1).to(hidden.dtype)


class _Lease:
    """Shared by the :class:`OffloadedExperts` modules of one :func:`offload_experts` call; holds the offloader,
    which the registry holds only weakly: once neither the modules (the model) nor the caller hold it, it is
    freed with its host store and device slots and its handle unregistered."""

    __slots__ = ("offloader",)

    def __init__(self, offloader: Any) -> None:
        self.offloader = offloader


class OffloadedExperts(torch.nn.Module):
    """Drop-in replacement of an HF experts module: ``forward(hidden, top_k_index, top_k_weights)`` calls
    ``ckvp::offload_experts`` with this layer's offloader handle (integers, constants to Dynamo).

    Holds no parameters: the weights live in the offloader's host store and device slots. Its state dict still has
    the experts module's ``gate_up_proj`` (E, 2I, Dm) and ``down_proj`` (E, Dm, I), on CPU
    (:meth:`ExpertOffloader.host_weights`), and loading one replaces the offloader's copies. ``lease``: an object
    the modules of one offloader share, holding it (:func:`offload_experts`; the registry holds it only weakly).
    """

    def __init__(self, handle: int, layer: int, num_experts: int, lease: _Lease | None = None) -> None:
        super().__init__()
        self.handle, self.layer, self.num_experts = handle, layer, num_experts
        self._lease = lease

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """(T, Dm), (T, A) int, (T, A) float -> (T, Dm) hidden_states.dtype (see :class:`ExpertOffloader`). Inference
        only: a backward through it raises CKVPConfigError (``ckvp::offload_experts``)."""
        return torch.ops.ckvp.offload_experts(hidden_states, top_k_index, top_k_weights, self.handle, self.layer)

    def __deepcopy__(self, memo: dict) -> "OffloadedExperts":
        """Refused: a copy would share this layer's offloader (one host store and device cache by handle), so
        changing the copy's expert weights would change the original's. Raises CKVPConfigError naming the fix."""
        raise CKVPConfigError("copy.deepcopy of a model whose experts are offloaded would share the offloader with "
                              "the original (loading weights into the copy would change both). Fix: copy the model "
                              "before ckvp_compile.offload_experts and offload each copy, or load it again")

    def __reduce_ex__(self, protocol: int):
        """Refused (``torch.save(model)``, pickling): the module holds only a handle into this process's offloader.
        Raises CKVPConfigError naming the fix (save ``model.state_dict()``, which holds the expert weights)."""
        raise CKVPConfigError("an expert-offloaded model cannot be pickled (torch.save(model)): its experts live in "
                              "this process's offloader. Fix: save model.state_dict() (it holds the full expert "
                              "weights) and load it into a new model, then offload that")

    def extra_repr(self) -> str:
        return f"handle={self.handle}, layer={self.layer}, num_experts={self.num_experts}"

    #: The experts module's parameters before offloading, now held by the offloader (state-dict key suffixes).
    WEIGHT_KEYS = ("gate_up_proj", "down_proj")

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """``model.state_dict()``: ``<prefix>gate_up_proj`` / ``<prefix>down_proj``, the full expert weights of
        this layer as before offloading (the offloader's host store, on CPU, shared; see
        :meth:`ExpertOffloader.host_weights`). Raises CKVPConfigError when the offloader was closed (its weights
        were freed: a state dict without them would lose the experts when saved)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        try:
            offloader = _offload_ops.lookup_offloader(self.handle)
        except CKVPConfigError:
            offloader = None
        if offloader is None or not offloader.host_gate_up:
            raise CKVPConfigError(f"state_dict: the expert offloader of {prefix.rstrip('.') or 'the experts'} "
                                  f"(handle {self.handle}) was closed and its expert weights freed, so a state "
                                  "dict would lack them; load the model again (and offload it again) to save it")
        gate_up, down = offloader.host_weights(self.layer)
        destination[prefix + "gate_up_proj"] = gate_up
        destination[prefix + "down_proj"] = down

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """``model.load_state_dict(sd)``: ``sd``'s ``<prefix>gate_up_proj`` (E, 2I, Dm) / ``<prefix>down_proj``
        (E, Dm, I) replace the offloader's copies of this layer's experts (host store and resident slots); a shape
        mismatch is reported like a parameter's (``load_state_dict`` raises RuntimeError), and so, with
        ``strict=True``, is a missing key (``Missing key(s)``). Without this, the offloader kept serving the weights
        it copied at offload time (with ``strict=False`` silently)."""
        found = {k: state_dict[prefix + k] for k in self.WEIGHT_KEYS if prefix + k in state_dict}
        if strict:
            missing_keys.extend(prefix + k for k in self.WEIGHT_KEYS if prefix + k not in state_dict)
        if found:
            try:
                _offload_ops.lookup_offloader(self.handle).load_weights(
                    self.layer, found.get("gate_up_proj"), found.get("down_proj"))
            except (CKVPShapeError, CKVPConfigError) as exc:
                error_msgs.append(f"while loading {', '.join(prefix + k for k in found)}: {exc}")
        rest = {k: v for k, v in state_dict.items() if k[len(prefix):] not in self.WEIGHT_KEYS}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)


def _submodule(model: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _find_moe_layers(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Experts modules with fused ``gate_up_proj`` (E, 2I, Dm) and ``down_proj`` (E, Dm, I) parameters (or already
    :class:`OffloadedExperts`), in module order, with their router weight and the RMSNorm weight before their MoE
    block when found."""
    found = []
    for name, mod in model.named_modules():
        gu, dn = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
        fused = isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3
        if not (fused or isinstance(mod, OffloadedExperts)):
            continue
        parent_path, _, attr = name.rpartition(".")
        block = _submodule(model, parent_path) if parent_path else model
        router_mod = getattr(block, "gate", None)
        layer_path = parent_path.rpartition(".")[0]
        layer_mod = _submodule(model, layer_path) if layer_path else None
        norm_mod = getattr(layer_mod, "post_attention_layernorm", None)
        found.append(dict(name=name, module=mod, block=block, attr=attr, router=getattr(router_mod, "weight", None),
                          norm=getattr(norm_mod, "weight", None),
                          router_path=".".join(p for p in (parent_path, "gate") if p) if router_mod is not None else None,
                          norm_path=(".".join(p for p in (layer_path, "post_attention_layernorm") if p)
                                     if norm_mod is not None else None)))
    return found


def _live_sources(model: torch.nn.Module, nxt: dict[str, Any], this: dict[str, Any] | None) -> Callable[[], tuple]:
    """The predictor sources of :class:`ExpertOffloader`: the current router weight of layer ``nxt`` and (norm
    predictor) the norm weights of ``nxt`` and ``this``, looked up in ``model`` by module path at each call (so a
    replaced router or norm module is seen; the model is held weakly: once it is gone the sources are the last
    ones seen). Only the module paths are kept: ``nxt`` / ``this`` also hold the experts modules, whose weights
    (on the device) must be freed once offloaded."""
    ref = weakref.ref(model)
    last: list[tuple] = []
    router_path, norms = nxt["router_path"], None if this is None else (nxt["norm_path"], this["norm_path"])

    def weight(path: str | None) -> torch.Tensor | None:
        mod = _submodule(ref(), path) if path is not None else None
        return getattr(mod, "weight", None)

    def sources() -> tuple:
        if ref() is None and last:
            return last[0]
        out = (weight(router_path), None, None) if norms is None else (
            weight(router_path), weight(norms[0]), weight(norms[1]))
        last[:] = [out]
        return out
    return sources


def _overrides_gate(mod: torch.nn.Module) -> bool:
    """Whether ``mod``'s class replaces transformers' gate step (``_apply_gate``: ``act(gate) * up`` by default) with
    its own, e.g. DeepSeek-V4's clamp of gate and up to ``swiglu_limit``. False where transformers has no such hook."""
    gate = getattr(type(mod), "_apply_gate", None)
    if gate is None:
        return False
    try:
        from transformers.integrations import moe as hf_moe
    except ImportError:  # a transformers without the hook's module: any _apply_gate is the class's own
        return True
    return gate is not getattr(hf_moe, "_default_apply_gate", None)


def _check_experts_module(name: str, mod: torch.nn.Module) -> None:
    """Raise :class:`CKVPConfigError` unless ``mod`` computes plain SwiGLU experts over fused (E, 2I, Dm)
    ``gate_up_proj`` and (E, Dm, I) ``down_proj``: what :class:`OffloadedExperts` computes in its place."""
    bad = [f"{flag}={getattr(mod, flag)}" for flag, ok in (("is_transposed", False), ("is_concatenated", True),
                                                           ("has_bias", False), ("has_gate", True),
                                                           ("has_post_expert_norm", False))
           if getattr(mod, flag, ok) != ok]
    gu, dn = mod.gate_up_proj, mod.down_proj
    if gu.shape[1] % 2 or tuple(dn.shape) != (gu.shape[0], gu.shape[2], gu.shape[1] // 2):
        bad.append(f"gate_up_proj {tuple(gu.shape)} and down_proj {tuple(dn.shape)} are not (E, 2I, Dm) and "
                   "(E, Dm, I), e.g. Llama-4's transposed (E, Dm, 2I) and (E, I, Dm)")
    if _overrides_gate(mod):
        bad.append(f"{type(mod).__name__} has its own gate step (_apply_gate, e.g. a clamp of gate and up)")
    act = getattr(mod, "act_fn", None)
    probe = torch.linspace(-4, 4, 17)
    if act is None or not torch.allclose(act(probe), F.silu(probe)):
        bad.append("activation is not SiLU")
    if bad:
        raise CKVPConfigError(f"offload_experts: experts module {name!r} is not a SwiGLU experts module with fused "
                              f"(E, 2I, Dm) gate_up_proj and (E, Dm, I) down_proj ({', '.join(bad)}); only that "
                              "layout (HF Mixtral / Qwen-MoE / OLMoE in transformers 5.x) can be offloaded")


def _check_offload_types(**options: Any) -> None:
    """Raise :class:`CKVPConfigError` naming the option unless ``resident`` / ``margin`` / ``lookahead`` are ints
    (``__index__``: numpy ints too; not bools: Python's ``True == 1``) and ``prefetch`` / ``measure_stalls`` are
    bools. Called before any module moves, so a bad value leaves the model as it was (``margin=1.5`` used to be
    accepted, then broke every forward)."""
    for name, value in options.items():
        flag = name in ("prefetch", "measure_stalls")
        ok = isinstance(value, bool) if flag else not isinstance(value, bool) and hasattr(type(value), "__index__")
        if not ok:
            raise CKVPConfigError(f"offload_experts: {name} must be {'True or False' if flag else 'an int'}, got "
                                  f"{value!r} ({type(value).__name__})")


def offload_experts(model: torch.nn.Module, resident: int, *, margin: int = 0, lookahead: int = 1,
                    policy: str = "lfu", prefetch: bool = True, predictor: str = "norm",
                    measure_stalls: bool = True) -> ExpertOffloader:
    """Move an HF MoE model's expert weights to host memory and serve them from a device cache, in place.

    Every experts module with fused ``gate_up_proj`` / ``down_proj`` parameters (transformers 5.x Mixtral,
    Qwen2/3-MoE, OLMoE, SwiGLU) is replaced by an :class:`OffloadedExperts`; its weights go to the host store
    (pinned on CUDA) and C = ``resident`` of them per layer to device slots. Works eagerly and under
    ``torch.compile(..., backend="ckvp")`` (the experts are one opaque ``ckvp::offload_experts`` call per layer).

    Args:
        model: the model, on the device the experts should compute on (its expert parameters' device).
        resident: C, experts kept on the device per layer, 1 <= C <= E.
        margin: predicted experts per token beyond top-A. lookahead: layers predicted ahead of each layer.
        policy: "lfu" (default: the best hit rate on the fixture's routing, on demand and with prefetch) or "lru".
        prefetch: False fetches on demand only (the baseline; recall is still measured).
        predictor: "norm" (next router on the next layer's RMSNorm of the residual stream; default) or "router"
            (next router on this layer's MoE input).
    Returns:
        The :class:`ExpertOffloader`: ``.stats()``, ``.reset_stats()``, ``.close()`` (its predictors refold by
        themselves when the model's router or norm weights change, e.g. ``load_state_dict``); ``.options``, the
        keyword options above. The offloader stays registered while the model's offloaded experts modules or the
        caller hold it; once neither does (``del model``), it is freed with its host store and slots. A program that
        holds neither (``torch.export`` of the model) needs one of them kept alive while it runs.
    Raises:
        CKVPConfigError: no offloadable experts module, an unsupported experts layout, or a value out of range.
    """
    if predictor not in PREDICTORS:
        raise CKVPConfigError(f"predictor must be one of {list(PREDICTORS)}, got {predictor!r}")
    _check_offload_types(resident=resident, margin=margin, lookahead=lookahead, prefetch=prefetch,
                         measure_stalls=measure_stalls)
    layers = _find_moe_layers(model)
    if not layers:
        raise CKVPConfigError("offload_experts: the model has no experts module with fused 3-D gate_up_proj and "
                              "down_proj parameters (transformers 5.x MoE models); nothing to offload")
    for info in layers:
        if isinstance(info["module"], OffloadedExperts):
            raise CKVPConfigError(f"offload_experts: {info['name']} is already offloaded (handle "
                                  f"{info['module'].handle}); offload a freshly loaded model")
        _check_experts_module(info["name"], info["module"])
    first = layers[0]["module"]
    e = first.gate_up_proj.shape[0]
    block = layers[0]["block"]  # the top-k: the MoE block's, its router's (Qwen-MoE, OLMoE), or the config's
    top_k = (getattr(block, "top_k", None) or getattr(getattr(block, "gate", None), "top_k", None)
             or getattr(getattr(model, "config", None), "num_experts_per_tok", None))
    if top_k is None:
        raise CKVPConfigError("offload_experts: cannot find the top-k (block.top_k, block.gate.top_k or "
                              "config.num_experts_per_tok)")
    predictors = sources = None
    if all(info["router"] is not None and tuple(info["router"].shape) == (e, first.gate_up_proj.shape[2])
           for info in layers):
        predictors, sources = [], []
        for n, info in enumerate(layers):
            ps, ss = [], []
            for nxt in layers[n + 1: n + 1 + lookahead]:
                norms = (nxt["norm"], info["norm"]) if predictor == "norm" else (None, None)
                ps.append(fold_norm_predictor(nxt["router"], *norms))
                ss.append(_live_sources(model, nxt, info if predictor == "norm" else None))
            predictors.append(ps)
            sources.append(ss)
    offloader = ExpertOffloader([info["module"].gate_up_proj for info in layers],
                                [info["module"].down_proj for info in layers], resident=resident, top_k=int(top_k),
                                device=first.gate_up_proj.device, predictors=predictors, prefetch=prefetch,
                                margin=margin, lookahead=lookahead, policy=policy, measure_stalls=measure_stalls,
                                predictor_sources=sources)
    offloader.options = dict(margin=margin, lookahead=lookahead, policy=policy, prefetch=prefetch,
                             predictor=predictor, measure_stalls=measure_stalls)
    # the registry holds the offloader only while the model's OffloadedExperts modules (or the caller) hold it
    lease = _Lease(offloader)
    _offload_ops.hold_weakly(offloader.handle)
    for n, info in enumerate(layers):
        setattr(info["block"], info["attr"], OffloadedExperts(offloader.handle, n, e, lease))
    return offloader


def owning_module(model: Any) -> torch.nn.Module:
    """Return the ``nn.Module`` that ``model`` is, wraps or is a bound method of.

    Args:
        model: an ``nn.Module``, a bound method of one (``model.forward``), or a function wrapping such a method
            (``torch.compile(model.forward)`` keeps it as ``__wrapped__``).
    Raises:
        CKVPConfigError: no module found.
    """
    module = model
    for _ in range(8):
        if isinstance(module, torch.nn.Module):
            return module
        owner = getattr(module, "__self__", None)
        module = owner if isinstance(owner, torch.nn.Module) else getattr(module, "__wrapped__", None)
    raise CKVPConfigError(f"expected an nn.Module or a bound method of one (model.forward), got {type(model).__name__}")


def offloader_of(model: Any) -> ExpertOffloader | None:
    """Return the :class:`ExpertOffloader` serving ``model``'s offloaded experts, or None when none are offloaded.

    Args:
        model: an ``nn.Module`` (also a ``torch.compile`` wrapper of one, whose ``_orig_mod`` is a submodule) or a
            bound method of one (``model.forward``, compiled or not).
    Returns:
        The offloader (``.stats()``, ``.reset_stats()``, ``.close()``), found through the model's
        :class:`OffloadedExperts` modules; None when the model has none.
    Raises:
        CKVPConfigError: ``model`` is not a module or a method of one; its experts are served by more than one
            offloader (only possible by offloading parts of a model by hand); or its offloader was closed.
    """
    module = owning_module(model)
    handles = {m.handle for m in module.modules() if isinstance(m, OffloadedExperts)}
    if not handles:
        return None
    if len(handles) > 1:
        raise CKVPConfigError(f"the model's experts are served by {len(handles)} offloaders (handles "
                              f"{sorted(handles)}); offload the whole model with one offload_experts call")
    return _offload_ops.lookup_offloader(handles.pop())
