"""Tiny MoE models for tests and examples: random Hugging Face models of four families, the trained fixture, and
a gpt-fast style model.

* :func:`build_hf_moe` builds a random-weight ``*ForCausalLM`` of one of :data:`HF_FAMILIES` from a config, with
  every shape field set explicitly (no hub access, ever).
* :func:`load_fixture_model` loads the trained tiny Mixtral in ``models/tiny-mixtral-pystdlib``.
* :class:`GptFastMoE` / :class:`GptFastConfig` (defined in :mod:`.gpt_fast`) and the drivers
  :func:`prefill_decode_logits`, :func:`capture_dynamo_graphs`, :func:`capture_prefill_decode_graphs` (defined in
  :mod:`.decoding`) are re-exported here so tests import everything from one place.

How transformers 5.x selects the experts implementation (checked on 5.24): experts classes are decorated with
``transformers.integrations.moe.use_experts_implementation``; their ``forward`` looks up
``config._experts_implementation`` in ``ALL_EXPERTS_FUNCTIONS`` ("grouped_mm", "batched_mm", "deepgemm",
"sonicmoe"; "eager" = the class's own loop over hit experts). The value comes from the
``experts_implementation=`` kwarg of ``from_config`` / ``from_pretrained`` (or ``PretrainedConfig(...,
experts_implementation=...)``); ``None`` resolves to "grouped_mm". ``model.set_experts_implementation(name)``
switches it after construction.

Under Dynamo (checked on torch 2.13 CPU with ``backend="eager"``, prefill and decode with a ``StaticCache``):
"grouped_mm" and "batched_mm" compile with ``fullgraph=True`` in fp32 and bf16 for all four families (one
graph per call). "eager" does not: ``nonzero`` over the hit experts is data-dependent, ``fullgraph=True``
raises ``UserError: Could not extract specialized integer from data-dependent expression``, and without
it a 2-layer model breaks into about 14 prefill graphs and Dynamo hits ``recompile_limit`` (8) on
transformers' ``deprecate_kwarg`` wrapper, whose code object is shared by every decorated forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import CKVPModelLoadError
from .decoding import capture_dynamo_graphs, capture_prefill_decode_graphs, prefill_decode_logits
from .gpt_fast import GptFastConfig, GptFastMoE

__all__ = [
    "HF_FAMILIES",
    "EXPERTS_IMPLEMENTATIONS",
    "FIXTURE_MODEL_DIR",
    "build_hf_moe",
    "load_fixture_model",
    "GptFastConfig",
    "GptFastMoE",
    "prefill_decode_logits",
    "capture_dynamo_graphs",
    "capture_prefill_decode_graphs",
]

#: Hugging Face MoE families :func:`build_hf_moe` can build.
HF_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")

#: Experts implementations accepted by :func:`build_hf_moe` (transformers also has GPU-only ones).
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")

#: The trained tiny Mixtral fixture (8 layers, hidden 256, 4 heads x 64, 2 KV heads, 4 experts top-2, vocab 256).
FIXTURE_MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-mixtral-pystdlib"


def _family_config_kwargs(family: str, *, num_layers: int, hidden: int, num_heads: int, num_kv_heads: int,
                          head_dim: int, num_experts: int, top_k: int, ffn: int) -> dict[str, Any]:
    """Config kwargs that pin every shape of ``family`` to the requested values."""
    common = dict(
        vocab_size=256,
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        num_experts_per_tok=top_k,
        max_position_embeddings=512,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        use_cache=True,
    )
    if family == "mixtral":
        return dict(common, num_local_experts=num_experts, intermediate_size=ffn, sliding_window=None,
                    router_jitter_noise=0.0)
    if family == "qwen2_moe":
        # intermediate_size is only used by dense layers (none with mlp_only_layers=[]); shared expert = ffn.
        return dict(common, num_experts=num_experts, moe_intermediate_size=ffn, intermediate_size=ffn,
                    shared_expert_intermediate_size=ffn, decoder_sparse_step=1, mlp_only_layers=[],
                    use_sliding_window=False)
    if family == "qwen3_moe":
        return dict(common, num_experts=num_experts, moe_intermediate_size=ffn, intermediate_size=ffn,
                    decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False)
    if family == "olmoe":
        return dict(common, num_experts=num_experts, intermediate_size=ffn)
    raise ValueError(f"family must be one of {HF_FAMILIES}, but got {family!r}")


def build_hf_moe(family: str, *, num_layers: int = 2, hidden: int = 64, num_heads: int = 4,
                 num_kv_heads: int = 2, head_dim: int = 16, num_experts: int = 4, top_k: int = 2, ffn: int = 32,
                 experts_implementation: str = "grouped_mm", attn_implementation: str = "sdpa",
                 dtype: torch.dtype = torch.float32, seed: int = 0,
                 **config_overrides: Any):
    """Build a tiny random-weight Hugging Face MoE causal LM, in eval mode.

    Families and classes: 'mixtral' -> MixtralForCausalLM, 'qwen2_moe' -> Qwen2MoeForCausalLM (with a sigmoid-
    gated shared expert of width ``ffn`` and q/k/v biases), 'qwen3_moe' -> Qwen3MoeForCausalLM (per-head q/k
    RMSNorm), 'olmoe' -> OlmoeForCausalLM (q/k RMSNorm over the whole projection). Vocabulary 256 (byte ids),
    max_position_embeddings 512, every layer sparse, no sliding window, ``initializer_range=0.1`` (larger
    than the 0.02 default so that attention and routing are far from uniform and cache bugs show in logits).

    Args:
        family: one of :data:`HF_FAMILIES`.
        num_layers, hidden, num_heads, num_kv_heads, head_dim, num_experts, top_k, ffn: shapes (L, Dm, H, Hkv,
            D, E, A, I); ``head_dim`` is set explicitly, so ``hidden`` need not equal ``num_heads * head_dim``
            (except for olmoe, whose q/k norms assume it).
        experts_implementation: one of :data:`EXPERTS_IMPLEMENTATIONS`; on CPU fp32 "grouped_mm" runs the
            opaque ``transformers::grouped_mm_fallback`` custom op, bf16 runs ``aten._grouped_mm``; "eager"
            loops over hit experts with ``nonzero`` (graph breaks under Dynamo, see the module docstring).
        attn_implementation: "sdpa" or "eager" (softmax(QK^T)V written out).
        dtype: parameter dtype.
        seed: ``torch.manual_seed`` value used for the weights (the global RNG state is restored afterwards).
        **config_overrides: any further config field (e.g. ``norm_topk_prob=True``, ``rope_parameters=...``),
            applied last.
    Returns:
        ``transformers.PreTrainedModel`` in eval mode on CPU.
    Raises:
        ValueError: unknown family or experts implementation, num_kv_heads not dividing num_heads, top_k not
            in 1..num_experts, or olmoe with hidden != num_heads * head_dim.
    """
    if family not in HF_FAMILIES:
        raise ValueError(f"family must be one of {HF_FAMILIES}, but got {family!r}")
    if experts_implementation not in EXPERTS_IMPLEMENTATIONS:
        raise ValueError(
            f"experts_implementation must be one of {EXPERTS_IMPLEMENTATIONS}, but got {experts_implementation!r}"
        )
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_kv_heads must divide num_heads, but got {num_kv_heads} and {num_heads}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..num_experts={num_experts}, but got {top_k}")
    if family == "olmoe" and hidden != num_heads * head_dim:
        raise ValueError(
            f"olmoe needs hidden == num_heads * head_dim (its q/k norms are sized from hidden), but got "
            f"hidden={hidden}, num_heads={num_heads}, head_dim={head_dim}"
        )
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = _family_config_kwargs(family, num_layers=num_layers, hidden=hidden, num_heads=num_heads,
                                   num_kv_heads=num_kv_heads, head_dim=head_dim, num_experts=num_experts,
                                   top_k=top_k, ffn=ffn)
    kwargs.update(config_overrides)
    config = AutoConfig.for_model(family, **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation,
            experts_implementation=experts_implementation,
        )
    return model.eval()


def load_fixture_model(path: str | Path | None = None, dtype: torch.dtype = torch.float32):
    """Load the trained tiny Mixtral fixture (offline, from a local directory), in eval mode.

    Args:
        path: model directory; default :data:`FIXTURE_MODEL_DIR`.
        dtype: parameter dtype (the checkpoint is bf16; fp32 is the reference for fidelity tests).
    Returns:
        ``MixtralForCausalLM``: 8 layers, hidden 256, 4 query heads x 64, 2 KV heads, 4 experts top-2,
        vocab 256 (token id = byte value), sdpa attention, grouped_mm experts.
    Raises:
        CKVPModelLoadError: the directory or its ``config.json`` is missing.
    """
    path = Path(path) if path is not None else FIXTURE_MODEL_DIR
    if not (path / "config.json").is_file():
        raise CKVPModelLoadError(
            f"no model at {path} (config.json missing); the fixture lives in {FIXTURE_MODEL_DIR}, copied from "
            "shared/models/tiny-mixtral-pystdlib"
        )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                 local_files_only=True)
    return model.eval()
