"""Tiny random-weight dense Hugging Face causal LMs (GPT-2, Llama) for attention tests.

Their ``attn_implementation="eager"`` attention casts the probabilities differently: GPT-2 with
``attn_weights.type(value.dtype)``, Llama with ``.to(query.dtype)``; GPT-2 has no RoPE (learned positions) and one
fused QKV projection (``c_attn``, a Conv1D: ``addmm``). Imports ``transformers`` when called.
"""

from __future__ import annotations

import torch

#: Architectures :func:`build_hf_dense` builds.
DENSE_ARCHS = ("gpt2", "llama")


def build_hf_dense(arch: str, *, attn_implementation: str = "sdpa", num_layers: int = 2, num_heads: int = 4,
                   num_kv_heads: int = 2, head_dim: int = 16, seed: int = 0, **config_overrides) -> torch.nn.Module:
    """Build a tiny random-weight GPT2LMHeadModel ('gpt2', MHA: ``num_kv_heads`` is ignored) or LlamaForCausalLM
    ('llama', GQA), vocabulary 256 (byte ids), 64 positions, ``initializer_range=0.1``, in eval mode, fp32 on CPU.
    ``config_overrides`` go to the config last (e.g. GPT-2's ``reorder_and_upcast_attn=True``: scores by ``baddbmm``).

    Raises:
        ValueError: an unknown ``arch``.
    """
    import transformers

    if arch not in DENSE_ARCHS:
        raise ValueError(f"arch must be one of {DENSE_ARCHS}, but got {arch!r}")
    common = dict(vocab_size=256, bos_token_id=0, eos_token_id=0, initializer_range=0.1,
                  attn_implementation=attn_implementation)
    common.update(config_overrides)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_positions=64, n_embd=num_heads * head_dim, n_layer=num_layers,
                                      n_head=num_heads, **common)
        cls = transformers.GPT2LMHeadModel
    else:
        cfg = transformers.LlamaConfig(hidden_size=num_heads * head_dim, intermediate_size=4 * head_dim,
                                       num_hidden_layers=num_layers, num_attention_heads=num_heads,
                                       num_key_value_heads=num_kv_heads, head_dim=head_dim,
                                       max_position_embeddings=64, **common)
        cls = transformers.LlamaForCausalLM
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = cls(cfg).eval()
    finally:
        torch.random.set_rng_state(state)
    assert model.config._attn_implementation == attn_implementation
    return model
