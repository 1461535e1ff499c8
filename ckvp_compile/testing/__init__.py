"""Test and example helpers: tiny MoE models, static-cache drivers, graph capture, Hypothesis strategies.

Library code (tests and examples import it; nothing in ``ckvp_compile`` outside this package does). Importing
it does not import ``transformers`` or ``hypothesis``; the functions that need them import them when called,
and :mod:`.strategies` needs ``hypothesis``.

Modules:
    models: :func:`build_hf_moe`, :func:`load_fixture_model`, and re-exports of the two below.
    gpt_fast: :class:`GptFastMoE`, a gpt-fast style Mixtral-MoE with ``setitem`` KV caches and einsum experts.
    decoding: :func:`prefill_decode_logits`, :func:`capture_dynamo_graphs`, :func:`capture_prefill_decode_graphs`.
    strategies: Hypothesis strategies for model shapes.
    bases: :func:`random_orthonormal_bases`, latent bases for store and kernel tests.
    equivalence: :func:`check_equivalence`, the property-based check of the backend on a user's own model
        (compiled against eager on Hypothesis-drawn prompts; needs ``hypothesis`` when called).
"""

from .equivalence import EquivalenceError, EquivalenceReport, check_equivalence
from .models import (
    EXPERTS_IMPLEMENTATIONS,
    FIXTURE_MODEL_DIR,
    HF_FAMILIES,
    GptFastConfig,
    GptFastMoE,
    build_hf_moe,
    capture_dynamo_graphs,
    capture_prefill_decode_graphs,
    load_fixture_model,
    prefill_decode_logits,
)

__all__ = [
    "EquivalenceError",
    "EquivalenceReport",
    "check_equivalence",
    "EXPERTS_IMPLEMENTATIONS",
    "FIXTURE_MODEL_DIR",
    "HF_FAMILIES",
    "GptFastConfig",
    "GptFastMoE",
    "build_hf_moe",
    "capture_dynamo_graphs",
    "capture_prefill_decode_graphs",
    "load_fixture_model",
    "prefill_decode_logits",
]
