"""Next-layer expert prediction measured on a model's real routing, and trace replay through the offload planner.

:func:`capture_routing_trace` runs an HF MoE model over token windows and records, per layer and token, the
experts the router chose and the ranking each predictor gives for the next ``lookahead`` layers from this layer's
MoE input (predictors: :data:`~ckvp_compile.runtime.offload.PREDICTORS`, built by
:func:`~ckvp_compile.runtime.offload.fold_norm_predictor`, the exact ones :func:`offload_experts` uses).
:func:`prediction_recall` scores them; :func:`replay_trace` feeds the trace, token by token as batch-1 decoding
would, through :class:`~ckvp_compile.runtime.offload_policy.OffloadPlanner` (the decision code the GPU offloader
runs), giving hit rate and copies per token for each capacity, policy and prefetch setting without a GPU.

A causal model's routing of token t is the same whether the window is run at once or decoded token by token, so
one forward pass per window gives the decode trace.

Source: the next-layer gate prediction of Eliseev & Mazur (2023), "Fast Inference of Mixture-of-Experts Language
Models with Offloading"; recall as in MoE-Infinity / ProMoE (fraction of the experts used that were predicted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .offload import PREDICTORS, _find_moe_layers, fold_norm_predictor
from .offload_policy import OffloadPlanner, OffloadStats

__all__ = ["RoutingTrace", "capture_routing_trace", "prediction_recall", "replay_trace"]


@dataclass
class RoutingTrace:
    """Routing of every (window, token, layer) and each predictor's ranking of the next layers' experts.

    Attributes:
        num_layers: L. num_experts: E. top_k: A.
        routed: per window, (S, L, A) int64, the experts each token used in each layer.
        ranked: predictor -> per window, (S, L, lookahead, E) int64: from layer l's MoE input, the experts of
            layer l+d (d = 1..lookahead) ranked best first (rows past the last layer are -1).
    """

    num_layers: int
    num_experts: int
    top_k: int
    lookahead: int
    routed: list[torch.Tensor] = field(default_factory=list)
    ranked: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        """Tokens in the trace."""
        return sum(r.shape[0] for r in self.routed)


@torch.no_grad()
def capture_routing_trace(model: torch.nn.Module, windows: list[torch.Tensor], *, lookahead: int = 2,
                          predictors: tuple[str, ...] = PREDICTORS) -> RoutingTrace:
    """Run ``model`` on each (1, S) window of token ids and record its routing and the predictors' rankings.

    Args:
        model: an HF MoE causal LM whose MoE blocks have ``gate`` routers returning
            ``(logits, weights, indices)`` (transformers 5.x Mixtral, Qwen-MoE, OLMoE); plain or offloaded.
        windows: (1, S) int64 token ids each. lookahead: layers predicted ahead (>= 1).
        predictors: names from :data:`~ckvp_compile.runtime.offload.PREDICTORS`.
    Returns:
        A :class:`RoutingTrace`.
    Raises:
        ValueError: the model has no MoE layers with routers, or a window is not (1, S).
    """
    layers = _find_moe_layers(model)
    if not layers or any(info["router"] is None for info in layers):
        raise ValueError("capture_routing_trace needs an HF MoE model whose MoE blocks have a .gate router")
    n_layers, e = len(layers), layers[0]["router"].shape[0]
    mats = {name: [[fold_norm_predictor(nxt["router"], *((nxt["norm"], info["norm"]) if name == "norm" else (None, None)))
                    for nxt in layers[n + 1: n + 1 + lookahead]] for n, info in enumerate(layers)]
            for name in predictors}
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(idx):
        def fn(module, args, output):
            seen[idx] = (args[0].reshape(-1, args[0].shape[-1]), output[2])
        return fn

    handles = [info["block"].gate.register_forward_hook(hook(n)) for n, info in enumerate(layers)]
    top_k = None
    trace = RoutingTrace(n_layers, e, 0, lookahead, ranked={name: [] for name in predictors})
    try:
        for w in windows:
            if w.dim() != 2 or w.shape[0] != 1:
                raise ValueError(f"each window must be (1, S) token ids, got {tuple(w.shape)}")
            seen.clear()
            model(w)
            routed = torch.stack([seen[n][1] for n in range(n_layers)], dim=1).to(torch.int64)  # (S, L, A)
            top_k = routed.shape[-1]
            trace.routed.append(routed)
            for name in predictors:
                ranks = torch.full((routed.shape[0], n_layers, lookahead, e), -1, dtype=torch.int64)
                for n in range(n_layers):
                    x = seen[n][0]
                    for d, p in enumerate(mats[name][n]):
                        logits = x.float() @ p.float().T
                        ranks[:, n, d] = logits.argsort(dim=-1, descending=True, stable=True)
                trace.ranked[name].append(ranks)
    finally:
        for h in handles:
            h.remove()
    trace.top_k = int(top_k or 0)
    return trace


def prediction_recall(trace: RoutingTrace, predictor: str, distance: int = 1, margin: int = 0) -> float:
    """Per-token recall of layer l+distance's experts by the predicted top-(A + margin), over all tokens and l.

    Returns:
        sum |predicted ∩ used| / sum |used| (each token uses A experts per layer), in [0, 1].
    """
    if not 1 <= distance <= trace.lookahead:
        raise ValueError(f"distance must be in [1, {trace.lookahead}] (the trace's lookahead), got {distance}")
    width = min(trace.num_experts, trace.top_k + margin)
    hit = total = 0
    for routed, ranks in zip(trace.routed, trace.ranked[predictor]):
        pred = ranks[:, : trace.num_layers - distance, distance - 1, :width]  # (S, L-d, width)
        used = routed[:, distance:]  # (S, L-d, A)
        hit += int((used.unsqueeze(-1) == pred.unsqueeze(-2)).any(-1).sum())
        total += used.numel()
    return hit / total if total else float("nan")


def replay_trace(trace: RoutingTrace, *, capacity: int, policy: str = "lfu", prefetch: bool = True, margin: int = 0,
                 lookahead: int = 1, predictor: str = "norm", tokens_per_call: int = 1) -> OffloadStats:
    """Replay the trace through an :class:`OffloadPlanner`, as batch-1 decoding (or calls of several tokens).

    Args:
        capacity: C resident experts per layer. policy, prefetch, margin, lookahead: as the offloader's.
        predictor: which of the trace's rankings the prefetch uses. tokens_per_call: tokens per layer call
            (1: decoding; the window length: what one prefill call of the window does).
    Returns:
        The planner's :class:`OffloadStats` (stall_ms 0: no timing here).
    """
    if lookahead > trace.lookahead:
        raise ValueError(f"lookahead {lookahead} exceeds the trace's ({trace.lookahead})")
    planner = OffloadPlanner(num_layers=trace.num_layers, num_experts=trace.num_experts, top_k=trace.top_k,
                             capacity=capacity, policy=policy, prefetch=prefetch, margin=margin, lookahead=lookahead)
    width = planner.predict_width
    for routed, ranks in zip(trace.routed, trace.ranked[predictor]):
        for start in range(0, routed.shape[0], tokens_per_call):
            r = routed[start:start + tokens_per_call].tolist()  # (t, L, A)
            k = ranks[start:start + tokens_per_call].tolist()  # (t, L, lookahead, E)
            for layer in range(trace.num_layers):
                planner.demand(layer, [tok[layer] for tok in r])
                ranked = {layer + d: [tok[layer][d - 1][:width] for tok in k]
                          for d in range(1, lookahead + 1) if layer + d < trace.num_layers}
                planner.predict(layer, ranked)
    return planner.stats
