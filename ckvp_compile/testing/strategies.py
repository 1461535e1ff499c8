"""Hypothesis strategies for property tests, bounded so every drawn case stays cheap on a 2-core CPU.

Follows the bounded-strategy form of PyTorch's ``torch/testing/_internal/hypothesis_utils.py``: every dimension
has a documented range and the total size has a hard cap (:data:`MAX_PARAMS`).

Shapes drawn by :func:`moe_model_shapes` plug straight into the model builders::

    build_hf_moe("mixtral", **shape)
    GptFastMoE(GptFastConfig.from_shape(shape))
"""

from __future__ import annotations

import numbers
from typing import Mapping

from hypothesis import strategies as st

__all__ = ["HEAD_DIMS", "HIDDEN_SIZES", "FFN_SIZES", "NUM_HEADS", "MAX_ATTN_WIDTH", "MAX_PARAMS", "VOCAB_SIZE",
           "estimate_moe_params", "moe_model_shapes"]

#: Head dimensions D drawn.
HEAD_DIMS = (8, 16, 32, 64)
#: Query head counts H drawn (non-powers of two included); only those with H*D <= MAX_ATTN_WIDTH are used.
NUM_HEADS = (1, 2, 3, 4, 6, 8, 12, 16)
#: Upper bound of the attention width H*D.
MAX_ATTN_WIDTH = 128
#: Model dims Dm drawn when the hidden size is not tied to H*D.
HIDDEN_SIZES = (16, 32, 48, 64, 96, 128)
#: Expert FFN widths I drawn.
FFN_SIZES = (16, 32, 48, 64)
#: Vocabulary of the tiny models (:func:`~ckvp_compile.testing.models.build_hf_moe`, GptFastConfig default).
VOCAB_SIZE = 256
#: Upper bound on :func:`estimate_moe_params` of every drawn shape ("well under 1M").
MAX_PARAMS = 500_000


def estimate_moe_params(shape: Mapping[str, int], vocab_size: int = VOCAB_SIZE) -> int:
    """Upper-bound the parameter count of a model built from ``shape`` (any family).

    Counts embeddings + LM head, q/k/v/o projections with biases, router, routed experts (3 matrices each) and
    one shared expert (Qwen2-MoE), q/k norms and the layer norms.

    Args:
        shape: dict with the keys of :func:`moe_model_shapes`.
        vocab_size: V.
    Returns:
        An int >= the exact count of every family's model of that shape.
    """
    dm, h, hkv, d = shape["hidden"], shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    e, i = shape["num_experts"], shape["ffn"]
    attn = dm * (h + 2 * hkv) * d + (h + 2 * hkv) * d + h * d * dm
    experts = 3 * e * dm * i + 3 * dm * i + dm * e + dm  # routed + shared expert + router + shared gate
    norms = 2 * dm + 2 * h * d
    return 2 * vocab_size * dm + dm + shape["num_layers"] * (attn + experts + norms)


@st.composite
def _shapes(draw, max_layers: int, hidden_matches_heads: bool) -> dict[str, int]:
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    num_heads = draw(st.sampled_from([h for h in NUM_HEADS if h * head_dim <= MAX_ATTN_WIDTH]))
    # MHA (Hkv == H), GQA (1 < Hkv < H) and MQA (Hkv == 1) are all divisors of H.
    num_kv_heads = draw(st.sampled_from([k for k in range(1, num_heads + 1) if num_heads % k == 0]))
    if hidden_matches_heads or draw(st.booleans()):
        hidden = num_heads * head_dim
    else:
        hidden = draw(st.sampled_from(HIDDEN_SIZES))
    num_experts = draw(st.integers(2, 8))
    top_k = draw(st.integers(1, min(4, num_experts)))
    ffn = draw(st.sampled_from(FFN_SIZES))
    shape = dict(num_layers=1, hidden=hidden, num_heads=num_heads, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, num_experts=num_experts, top_k=top_k, ffn=ffn)
    one_layer = estimate_moe_params(shape)
    per_layer = one_layer - estimate_moe_params(dict(shape, num_layers=0))
    fit = (MAX_PARAMS - (one_layer - per_layer)) // per_layer
    shape["num_layers"] = draw(st.integers(1, max(1, min(max_layers, fit))))
    return shape


def moe_model_shapes(max_layers: int = 8, *, hidden_matches_heads: bool = False) -> st.SearchStrategy[dict]:
    """Draw MoE decoder shapes, as keyword arguments of :func:`~ckvp_compile.testing.models.build_hf_moe`.

    Bounds (all inclusive):

    ============  ======================================================================================
    key           values
    ============  ======================================================================================
    head_dim      one of :data:`HEAD_DIMS` (8, 16, 32, 64)
    num_heads     one of :data:`NUM_HEADS` with num_heads * head_dim <= :data:`MAX_ATTN_WIDTH` (128)
    num_kv_heads  any divisor of num_heads: MHA (= num_heads), GQA, MQA (= 1)
    hidden        num_heads * head_dim (half the draws, or always with ``hidden_matches_heads``), otherwise
                  one of :data:`HIDDEN_SIZES` (16..128)
    num_experts   2..8
    top_k         1..min(4, num_experts)
    ffn           one of :data:`FFN_SIZES` (16..64)
    num_layers    1..max_layers, lowered so that :func:`estimate_moe_params` <= :data:`MAX_PARAMS` (500k);
                  the dims above keep a one-layer model under 360k parameters, so at least one layer always fits
    ============  ======================================================================================

    Shrinking goes towards small head_dim, one head, hidden = heads * head_dim, 2 experts, top-1, one layer.

    Args:
        max_layers: largest num_layers drawn (>= 1).
        hidden_matches_heads: always draw hidden == num_heads * head_dim (needed by OLMoE, whose q/k norms are
            sized from hidden).
    Returns:
        A strategy of dicts with keys num_layers, hidden, num_heads, num_kv_heads, head_dim, num_experts,
        top_k, ffn.
    Raises:
        ValueError: max_layers is not an int >= 1 (a float such as 2.5 would otherwise fail only at the first draw).
    """
    if isinstance(max_layers, bool) or not isinstance(max_layers, numbers.Integral) or max_layers < 1:
        raise ValueError(f"max_layers must be an int >= 1, but got {max_layers!r}")
    return _shapes(int(max_layers), hidden_matches_heads)  # numpy ints too
