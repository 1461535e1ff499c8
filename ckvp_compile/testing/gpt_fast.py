"""A gpt-fast style Mixtral-MoE transformer, written from scratch, for tests and examples.

It reproduces the graph *shape* that gpt-fast (``pytorch-labs/gpt-fast``, ``mixtral-moe/model.py``) hands to
Dynamo, which is the second model style the ``ckvp`` backend must understand besides Hugging Face:

* a :class:`KVCache` module per layer whose ``k_cache`` / ``v_cache`` buffers, (B, Hkv, S_max, D), are written
  in place with ``k_out[:, :, input_pos] = k_val`` (``operator.setitem`` in the Dynamo graph);
* attention through ``F.scaled_dot_product_attention`` with a boolean mask taken from a causal buffer indexed by
  ``input_pos``; GQA by ``repeat_interleave`` of K/V over the query heads of each KV head;
* RoPE either in complex form (``view_as_complex(x) * freqs_cis``, adjacent pairs rotate) or in rotate-half
  form (``x * cos + rotate_half(x) * sin``, halves rotate), chosen by :attr:`GptFastConfig.rope_form`;
* :class:`MOEFeedForward`: gate linear -> softmax -> top-k -> renormalise -> :class:`ConditionalFeedForward`,
  which gathers ``w1[expert_indices]``, ``w3[...]``, ``w2[...]`` and contracts with ``einsum`` (the
  "weight-gather einsum" experts form).

Dimension glossary: B batch, S query length, S_max cache length, H query heads, Hkv KV heads, D head dim,
Dm model dim, T tokens (B*S), E experts, A active experts per token, I expert intermediate size, V vocab.

Source: modelled on pytorch-labs/gpt-fast ``mixtral-moe/model.py`` (BSD-3-Clause); no code copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GptFastConfig", "GptFastMoE", "KVCache", "MOEFeedForward", "ConditionalFeedForward"]


@dataclass
class GptFastConfig:
    """Shape of a :class:`GptFastMoE` (gpt-fast ``ModelArgs`` names).

    ``dim`` need not equal ``n_head * head_dim``: the projections map Dm -> H*D -> Dm.
    """

    n_layer: int = 2
    """Number of transformer blocks (L)."""
    dim: int = 64
    """Model dimension (Dm)."""
    n_head: int = 4
    """Query heads (H)."""
    n_local_heads: int = 2
    """KV heads (Hkv); must divide ``n_head`` (MHA when equal, MQA when 1)."""
    head_dim: int = 16
    """Head dimension (D); even."""
    num_experts: int = 4
    """Routed experts per layer (E)."""
    num_activated_experts: int = 2
    """Experts per token (A), 1..E."""
    intermediate_size: int = 32
    """Expert FFN width (I)."""
    vocab_size: int = 256
    """Vocabulary size (V)."""
    block_size: int = 256
    """Longest position the RoPE table and causal buffer cover."""
    rope_base: float = 10000.0
    """RoPE theta."""
    rope_form: Literal["complex", "rotate_half"] = "complex"
    """'complex': adjacent (even, odd) pairs rotate via ``view_as_complex``; 'rotate_half': halves rotate."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    @classmethod
    def from_shape(cls, shape: Mapping[str, int], **overrides) -> "GptFastConfig":
        """Map :func:`~ckvp_compile.testing.models.build_hf_moe` shape kwargs (``num_layers, hidden, num_heads,
        num_kv_heads, head_dim, num_experts, top_k, ffn``, e.g. from ``strategies.moe_model_shapes``) onto a
        config; missing keys keep their defaults, ``overrides`` (e.g. ``rope_form``) apply last."""
        names = {"num_layers": "n_layer", "hidden": "dim", "num_heads": "n_head", "num_kv_heads": "n_local_heads",
                 "head_dim": "head_dim", "num_experts": "num_experts", "top_k": "num_activated_experts",
                 "ffn": "intermediate_size"}
        unknown = set(shape) - set(names)
        if unknown:
            raise ValueError(f"unknown shape keys {sorted(unknown)}; valid keys: {sorted(names)}")
        return cls(**{names[k]: v for k, v in shape.items()}, **overrides)

    def __post_init__(self) -> None:
        if self.rope_form not in ("complex", "rotate_half"):
            raise ValueError(f"rope_form must be 'complex' or 'rotate_half', but got {self.rope_form!r}")
        if self.n_head % self.n_local_heads != 0:
            raise ValueError(
                f"n_local_heads must divide n_head, but got n_head={self.n_head}, n_local_heads={self.n_local_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, but got {self.head_dim}")
        if not 1 <= self.num_activated_experts <= self.num_experts:
            raise ValueError(
                f"num_activated_experts must be in 1..num_experts={self.num_experts}, "
                f"but got {self.num_activated_experts}"
            )


class KVCache(nn.Module):
    """Static per-layer K/V cache, written in place at ``input_pos``.

    Buffers:
        k_cache, v_cache: (B_max, Hkv, S_max, D) dtype, zero-initialised.
    """

    def __init__(self, max_batch_size: int, max_seq_length: int, n_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device))

    def update(self, input_pos: torch.Tensor, k_val: torch.Tensor,
               v_val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k_val``/``v_val`` at ``input_pos`` and return the whole caches.

        Args:
            input_pos: (S,) long, positions to write.
            k_val, v_val: (B, Hkv, S, D), B == B_max.
        Returns:
            (k_cache, v_cache), each (B_max, Hkv, S_max, D).
        """
        k_out, v_out = self.k_cache, self.v_cache
        k_out[:, :, input_pos] = k_val
        v_out[:, :, input_pos] = v_val
        return k_out, v_out


class RMSNorm(nn.Module):
    """RMS normalisation over the last dim, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def _rope_tables(cfg: GptFastConfig) -> dict[str, torch.Tensor]:
    """Precompute RoPE tables for positions 0..block_size-1.

    Returns:
        complex form: {'freqs_cis': (block_size, D/2, 2) fp32, (cos, sin) pairs for ``view_as_complex``};
        rotate_half form: {'rope_cos', 'rope_sin': (block_size, D) fp32}.
    """
    inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    angles = torch.outer(torch.arange(cfg.block_size, dtype=torch.float64), inv_freq)  # (S_max, D/2)
    if cfg.rope_form == "complex":
        # Stored as real (cos, sin) pairs: Module.to(bf16) would drop the imaginary part of a complex buffer.
        return {"freqs_cis": torch.view_as_real(torch.polar(torch.ones_like(angles), angles)).float()}
    full = torch.cat([angles, angles], dim=-1)  # (S_max, D)
    return {"rope_cos": full.cos().float(), "rope_sin": full.sin().float()}


def apply_rope_complex(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of ``x`` by ``freqs_cis``.

    Args:
        x: (B, S, H, D) float.
        freqs_cis: (S, D/2, 2) float, (cos, sin) of each pair's angle; computed in fp32.
    Returns:
        (B, S, H, D) x.dtype.
    """
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, S, H, D/2)
    fc = torch.view_as_complex(freqs_cis.float())  # (S, D/2)
    out = torch.view_as_real(xc * fc[None, :, None, :]).flatten(3)
    return out.type_as(x)


def apply_rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of ``x`` (Hugging Face / Llama layout).

    Args:
        x: (B, S, H, D) float.
        cos, sin: (S, D) fp32.
    Returns:
        (B, S, H, D) x.dtype.
    """
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (x.float() * cos + rotated.float() * sin).type_as(x)


class Attention(nn.Module):
    """Fused-QKV GQA attention with RoPE and an optional :class:`KVCache`."""

    def __init__(self, cfg: GptFastConfig) -> None:
        super().__init__()
        self.cfg = cfg
        q_size, kv_size = cfg.n_head * cfg.head_dim, cfg.n_local_heads * cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, q_size + 2 * kv_size, bias=False)
        self.wo = nn.Linear(q_size, cfg.dim, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...], mask: torch.Tensor,
                input_pos: torch.Tensor, use_cache: bool) -> torch.Tensor:
        cfg = self.cfg
        bsz, seqlen, _ = x.shape
        q_size, kv_size = cfg.n_head * cfg.head_dim, cfg.n_local_heads * cfg.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, cfg.n_head, cfg.head_dim)
        k = k.view(bsz, seqlen, cfg.n_local_heads, cfg.head_dim)
        v = v.view(bsz, seqlen, cfg.n_local_heads, cfg.head_dim)
        if cfg.rope_form == "complex":
            q, k = apply_rope_complex(q, rope[0]), apply_rope_complex(k, rope[0])
        else:
            q, k = apply_rope_rotate_half(q, *rope), apply_rope_rotate_half(k, *rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H|Hkv, S, D)
        if use_cache:
            k, v = self.kv_cache.update(input_pos, k, v)  # (B, Hkv, S_max, D)
        rep = cfg.n_head // cfg.n_local_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, q_size)
        return self.wo(y)


class ConditionalFeedForward(nn.Module):
    """Experts as stacked weights, applied by gathering each token's experts and contracting with einsum.

    Parameters:
        w1, w3: (E, I, Dm) gate and up projections; w2: (E, Dm, I) down projection.
    """

    def __init__(self, cfg: GptFastConfig) -> None:
        super().__init__()
        e, i, d = cfg.num_experts, cfg.intermediate_size, cfg.dim
        self.w1 = nn.Parameter(torch.empty(e, i, d))
        self.w2 = nn.Parameter(torch.empty(e, d, i))
        self.w3 = nn.Parameter(torch.empty(e, i, d))

    def forward(self, x: torch.Tensor, expert_indices: torch.Tensor) -> torch.Tensor:
        """Args: x (T, Dm); expert_indices (T, A) long. Returns: (T, A, Dm)."""
        w1 = self.w1[expert_indices]  # (T, A, I, Dm)
        w3 = self.w3[expert_indices]  # (T, A, I, Dm)
        w2 = self.w2[expert_indices]  # (T, A, Dm, I)
        h = F.silu(torch.einsum("ti,taoi->tao", x, w1)) * torch.einsum("ti,taoi->tao", x, w3)  # (T, A, I)
        return torch.einsum("tao,taio->tai", h, w2)


class MOEFeedForward(nn.Module):
    """Router (linear -> softmax -> top-k -> renormalise) followed by :class:`ConditionalFeedForward`."""

    def __init__(self, cfg: GptFastConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.cond_ffn = ConditionalFeedForward(cfg)
        self.dim = cfg.dim
        self.num_activated_experts = cfg.num_activated_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x (B, S, Dm). Returns: (B, S, Dm)."""
        shape = x.shape
        x = x.view(-1, self.dim)  # (T, Dm)
        weights = F.softmax(self.gate(x), dim=-1)  # (T, E)
        weights, indices = torch.topk(weights, self.num_activated_experts, dim=-1)  # (T, A)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.cond_ffn(x, indices)  # (T, A, Dm)
        return torch.einsum("tai,ta->ti", out, weights).view(shape)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then h + moe(norm(h))."""

    def __init__(self, cfg: GptFastConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.block_sparse_moe = MOEFeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, rope, mask, input_pos, use_cache):
        h = x + self.attention(self.attention_norm(x), rope, mask, input_pos, use_cache)
        return h + self.block_sparse_moe(self.ffn_norm(h))


class GptFastMoE(nn.Module):
    """gpt-fast style Mixtral-MoE decoder with static per-layer KV caches.

    Weights are random (``init_std``-normal for linears and experts, ones for norms), drawn from the global
    RNG: seed it (``torch.manual_seed``) before construction for reproducible models.

    Buffers (non-persistent): ``causal_mask`` (block_size, block_size) bool lower-triangular, and the RoPE
    tables of :func:`_rope_tables`.
    """

    def __init__(self, config: GptFastConfig | None = None, *, init_std: float = 0.1) -> None:
        super().__init__()
        self.config = cfg = config or GptFastConfig()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("causal_mask", mask, persistent=False)
        for name, table in _rope_tables(cfg).items():
            self.register_buffer(name, table, persistent=False)
        self.max_batch_size = -1
        self.max_seq_length = -1
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=init_std)

    def setup_caches(self, max_batch_size: int, max_seq_length: int) -> None:
        """Give every layer a zeroed :class:`KVCache` of (max_batch_size, Hkv, max_seq_length, D).

        Existing caches of the same shape are zeroed in place (same tensors, so compiled code keeps its
        static addresses); otherwise new ones are allocated in the dtype/device of the weights.

        Raises:
            ValueError: max_seq_length > config.block_size.
        """
        cfg = self.config
        if max_seq_length > cfg.block_size:
            raise ValueError(f"max_seq_length must be <= block_size={cfg.block_size}, but got {max_seq_length}")
        if (max_batch_size, max_seq_length) == (self.max_batch_size, self.max_seq_length):
            for layer in self.layers:
                layer.attention.kv_cache.k_cache.zero_()
                layer.attention.kv_cache.v_cache.zero_()
            return
        w = self.output.weight
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch_size, max_seq_length, cfg.n_local_heads, cfg.head_dim,
                                               dtype=w.dtype, device=w.device)
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """Run the decoder.

        Args:
            idx: (B, S) long token ids.
            input_pos: (S,) long absolute positions of ``idx``. With ``None`` the caches are neither read nor
                written and ``idx`` is treated as a whole sequence from position 0 (a cacheless full forward).
        Returns:
            (B, S, V) logits in the weights' dtype.
        Raises:
            RuntimeError: ``input_pos`` given before :meth:`setup_caches`.
        """
        seqlen = idx.shape[1]
        use_cache = input_pos is not None
        if use_cache:
            if self.max_seq_length < 0:
                raise RuntimeError("GptFastMoE: call setup_caches(max_batch_size, max_seq_length) before "
                                   "passing input_pos, or pass input_pos=None for a cacheless forward")
            kv_len = self.max_seq_length
        else:
            input_pos = torch.arange(seqlen, device=idx.device)
            kv_len = seqlen
        mask = self.causal_mask[None, None, input_pos, :kv_len]  # (1, 1, S, S_kv)
        if self.config.rope_form == "complex":
            rope = (self.freqs_cis[input_pos],)
        else:
            rope = (self.rope_cos[input_pos], self.rope_sin[input_pos])
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, rope, mask, input_pos, use_cache)
        return self.output(self.norm(x))
