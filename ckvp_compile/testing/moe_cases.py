"""Hypothesis strategies and tensor builders for the expert GEMM ops and kernels (bounded, cheap on 2 CPU cores).

:func:`moe_routing_cases` draws a case (sizes, a routing mode, a seed); :func:`make_moe_inputs` turns it into
tensors. Routing modes cover what the kernels must get right:

==============  ===========================================================================================
mode            routing
==============  ===========================================================================================
``random``      each token picks A distinct experts uniformly (most experts non-empty for large T)
``one_expert``  every token's slot 0 is expert 0 and its other slots use experts 1..A-1: expert 0 holds all T
                tokens, experts >= A are empty
``skewed``      experts drawn from a narrow window of 2A experts near E/2: many empty experts on both sides
``duplicate``   a token may name the same expert in several slots (not produced by top-k, still well defined)
==============  ===========================================================================================
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

__all__ = ["ROUTING_MODES", "make_moe_inputs", "moe_routing_cases"]

ROUTING_MODES = ("random", "one_expert", "skewed", "duplicate")


@st.composite
def _cases(draw, max_experts: int, max_top_k: int, max_tokens: int, dims: tuple[int, ...]) -> dict:
    num_experts = draw(st.integers(1, max_experts))
    top_k = draw(st.integers(1, min(max_top_k, num_experts)))
    return dict(
        tokens=draw(st.integers(1, max_tokens)),
        num_experts=num_experts,
        top_k=top_k,
        hidden=draw(st.sampled_from(dims)),
        ffn=draw(st.sampled_from(dims)),
        mode=draw(st.sampled_from(ROUTING_MODES)),
        seed=draw(st.integers(0, 2**16)),
    )


def moe_routing_cases(max_experts: int = 64, max_top_k: int = 8, max_tokens: int = 48,
                      dims: tuple[int, ...] = (8, 16, 24, 40, 64)) -> st.SearchStrategy[dict]:
    """Draw expert-op cases: dict(tokens T, num_experts E, top_k A, hidden Dm, ffn I, mode, seed).

    Bounds (inclusive): E in 1..max_experts, A in 1..min(max_top_k, E), T in 1..max_tokens, Dm and I from
    ``dims`` (odd multiples of 8 included so tiles are partial), mode from :data:`ROUTING_MODES`.
    Shrinks towards one expert, top-1, one token, the smallest dims, 'random'.
    """
    return _cases(max_experts, max_top_k, max_tokens, dims)


def make_moe_inputs(case: dict, dtype: torch.dtype = torch.float32, device: str = "cpu",
                    fused_gate_up: bool = True) -> dict[str, torch.Tensor]:
    """Build the tensors of a :func:`moe_routing_cases` case.

    Args:
        case: a drawn case. dtype: of hidden and the weights. device: where to put them.
        fused_gate_up: give w_gate / w_up as the two halves of one HF-style (E, 2I, Dm) tensor (strided views).
    Returns:
        dict(hidden (T, Dm), topk_ids (T, A) int64, topk_weights (T, A) fp32 rows summing to 1, w_gate,
        w_up (E, I, Dm), w_down (E, Dm, I)); weights scaled by 1/sqrt(fan-in) so outputs stay O(1).
    """
    g = torch.Generator().manual_seed(case["seed"])
    t, e, a, dm, i = case["tokens"], case["num_experts"], case["top_k"], case["hidden"], case["ffn"]
    mode = case["mode"]
    if mode == "one_expert":
        ids = torch.arange(a).expand(t, a).clone()
    elif mode == "skewed":
        lo = max(0, e // 2 - a)
        window = min(e - lo, 2 * a)
        ids = torch.stack([lo + torch.randperm(window, generator=g)[:a] for _ in range(t)])
    elif mode == "duplicate":
        ids = torch.randint(0, e, (t, a), generator=g)
    else:
        ids = torch.stack([torch.randperm(e, generator=g)[:a] for _ in range(t)])
    weights = torch.rand(t, a, generator=g) + 0.05
    weights = weights / weights.sum(-1, keepdim=True)
    gate_up = torch.randn(e, 2 * i, dm, generator=g) / dm ** 0.5
    if fused_gate_up:
        w_gate, w_up = gate_up[:, :i], gate_up[:, i:]
    else:
        w_gate, w_up = gate_up[:, :i].contiguous(), gate_up[:, i:].contiguous()
    w_down = torch.randn(e, dm, i, generator=g) / i ** 0.5
    hidden = torch.randn(t, dm, generator=g)
    out = dict(hidden=hidden, topk_ids=ids.to(torch.int64), topk_weights=weights, w_gate=w_gate, w_up=w_up,
               w_down=w_down)
    for k in ("hidden", "w_gate", "w_up", "w_down"):
        out[k] = out[k].to(dtype)
    return {k: v.to(device) for k, v in out.items()}
