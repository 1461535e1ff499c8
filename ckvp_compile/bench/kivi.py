"""KIVI, a baseline of the fixture bench (``ckvp-bench decode --shape fixture --baseline kivi:BITS:GROUP:RESIDUAL``).

KIVI: Liu, Yuan, Jin, Zhong, Xu, Braverman, Chen, Hu, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
Cache", ICML 2024, arXiv:2402.02750. Asymmetric min-max quantization (a scale and a zero point, float16 each, per
group) of the KV cache:

- keys per channel: each channel of a KV head is quantized over groups of ``GROUP`` consecutive tokens. Keys are
  quantized after RoPE (the key states the attention writes to the cache), as KIVI does;
- values per token: each token is quantized over groups of ``GROUP`` consecutive channels. The channels of a token
  are its KV heads' channels one after the other, so a group no larger than the head dim stays inside one head
  (KIVI's code); a larger one (``GROUP = 128`` on the fixture's 64-wide heads) spans heads;
- the residual: the newest tokens stay in full precision (bf16 here, the dtype the ratio is counted against).
  Values keep the newest ``RESIDUAL`` tokens. Keys can only be quantized in whole groups: KIVI keeps them in full
  precision until ``RESIDUAL`` of them have gathered, then quantizes all at once (its code needs ``RESIDUAL`` to be a
  multiple of ``GROUP``). Here they flush every :attr:`KIVIConfig.key_flush` = ``GROUP * ceil(RESIDUAL / GROUP)``
  tokens, which is ``RESIDUAL`` when it is a multiple of ``GROUP`` and one group otherwise (``kivi:4:32:16`` keeps
  0-31 keys and 16 values in full precision);
- the timing: a step attends the cache as it stood before the step, plus its own new tokens in full precision
  (the prefill attends its prompt unquantized); the tokens the step pushed out of the residual are quantized
  afterwards, for the next steps (KIVI's Algorithm 1 and code).

This is a fake-quantized numerics baseline: the dense ``StaticCache`` of the model holds the dequantized values
in the model's dtype (quantize, then dequantize in float32), and the attention is the model's own. Nothing is
packed or allocated at KIVI's size: the bytes (:func:`kivi_kv_bytes`) are computed from the format (``BITS`` per
element packed, 2 + 2 bytes of scale and zero point per group, 2 bytes per residual element).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CKVPConfigError

__all__ = ["KIVIConfig", "dequantize_groups", "kivi_cache", "kivi_kv_bytes", "kivi_ratio", "kivi_state_lengths",
           "quantize_groups", "quantize_keys", "quantize_values"]


@dataclass(frozen=True)
class KIVIConfig:
    """One KIVI format: ``bits`` per quantized element (1-8), ``group`` elements per (scale, zero point) pair and
    ``residual`` newest tokens kept in full precision (:mod:`ckvp_compile.bench.kivi`)."""

    bits: int
    group: int
    residual: int

    @classmethod
    def parse(cls, spec: str) -> "KIVIConfig":
        """Parse ``kivi:BITS:GROUP:RESIDUAL`` (e.g. ``kivi:4:32:16``). Raises :class:`CKVPConfigError` (a
        ValueError) naming the expected form for anything else: another prefix, a part that is not an integer,
        BITS outside 1..8, GROUP < 1, RESIDUAL < 0."""
        parts = spec.split(":")
        form = f"expected kivi:BITS:GROUP:RESIDUAL (e.g. kivi:4:32:16), got {spec!r}"
        if len(parts) != 4 or parts[0] != "kivi":
            raise CKVPConfigError(f"baseline: {form}")
        try:
            bits, group, residual = (int(p) for p in parts[1:])
        except ValueError:
            raise CKVPConfigError(f"baseline: BITS, GROUP and RESIDUAL must be integers; {form}") from None
        if not 1 <= bits <= 8:
            raise CKVPConfigError(f"baseline {spec!r}: BITS must be in 1..8, got {bits}")
        if group < 1 or residual < 0:
            raise CKVPConfigError(f"baseline {spec!r}: GROUP must be >= 1 and RESIDUAL >= 0")
        return cls(bits, group, residual)

    @property
    def spec(self) -> str:
        """The option string, ``kivi:BITS:GROUP:RESIDUAL``."""
        return f"kivi:{self.bits}:{self.group}:{self.residual}"

    @property
    def label(self) -> str:
        """A table label, e.g. ``KIVI-4 g32 r16``."""
        return f"KIVI-{self.bits} g{self.group} r{self.residual}"

    @property
    def key_flush(self) -> int:
        """Keys are quantized in blocks of this many tokens (a multiple of ``group``, at least ``residual``):
        the full-precision keys of a sequence of L tokens are its last ``L % key_flush``."""
        return self.group * max(1, math.ceil(self.residual / self.group))

    @property
    def format_ratio(self) -> float:
        """Bytes of a bf16 cache over KIVI's, residual left out (long contexts): 16 / (bits + 2 * 16 / group)."""
        return 16 / (self.bits + 32 / self.group)


def _fp16(x: torch.Tensor, direction: float) -> torch.Tensor:
    """``x`` (float32) rounded to float16 toward ``direction`` (-inf: the largest float16 <= x; +inf: the
    smallest >= x). Raises ValueError when a value is outside float16's range."""
    h = x.to(torch.float16)
    if not torch.isfinite(h).all():
        raise ValueError("KIVI: a group's minimum or scale does not fit in float16")
    wrong = h.float() > x if direction < 0 else h.float() < x
    return torch.where(wrong, torch.nextafter(h, torch.full_like(h, direction)), h)


def quantize_groups(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max quantization of the groups along the last dim of ``x`` (..., G), any float dtype.

    Returns ``codes`` (..., G) uint8 in [0, 2**bits - 1], ``scale`` and ``zero`` (..., 1) float16. The zero point is
    the group's minimum rounded down to float16 and the scale (max - zero) / (2**bits - 1) rounded up, so that
    every element lies in [zero, zero + (2**bits - 1) * scale] and :func:`dequantize_groups` is within scale / 2 of
    it (up to float32 rounding). KIVI stores the same two float16 numbers per group (rounded to nearest); the
    directed rounding only makes the bound exact. A constant group has scale 0 when its value is a float16.
    Raises ValueError for bits outside 1..8 or a group whose minimum or scale does not fit in float16.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"KIVI: bits must be in 1..8, got {bits}")
    xf = x.float()
    levels = 2 ** bits - 1
    zero = _fp16(xf.amin(-1, keepdim=True), float("-inf"))
    scale = _fp16((xf.amax(-1, keepdim=True) - zero.float()) / levels, float("inf"))
    s = scale.float()
    codes = torch.where(s > 0, torch.round((xf - zero.float()) / torch.where(s > 0, s, 1.0)), 0.0)
    return codes.clamp(0, levels).to(torch.uint8), scale, zero


def dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``codes * scale + zero`` in float32 (shapes as :func:`quantize_groups` returns them)."""
    return codes.float() * scale.float() + zero.float()


def quantize_keys(k: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """KIVI's per-channel key quantization, fake-quantized: ``k`` (B, H, T, D) with T a multiple of ``group``;
    each channel of each head is quantized over groups of ``group`` consecutive tokens. Returns the dequantized
    keys, (B, H, T, D) in ``k``'s dtype. Raises ValueError when T is not a multiple of ``group``."""
    b, h, t, d = k.shape
    if t % group:
        raise ValueError(f"KIVI keys: {t} tokens are not whole groups of {group}")
    g = k.reshape(b, h, t // group, group, d).transpose(-1, -2)  # (B, H, T/G, D, G): a group runs along tokens
    return dequantize_groups(*quantize_groups(g, bits)).transpose(-1, -2).reshape(b, h, t, d).to(k.dtype)


def quantize_values(v: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """KIVI's per-token value quantization, fake-quantized: ``v`` (B, H, T, D); each token's H * D channels (head
    after head) are quantized in groups of ``group`` consecutive channels. Returns the dequantized values,
    (B, H, T, D) in ``v``'s dtype. Raises ValueError when H * D is not a multiple of ``group``."""
    b, h, t, d = v.shape
    if (h * d) % group:
        raise ValueError(f"KIVI values: {h} heads x {d} channels are not whole groups of {group}")
    g = v.permute(0, 2, 1, 3).reshape(b, t, h * d // group, group)
    return dequantize_groups(*quantize_groups(g, bits)).reshape(b, t, h, d).permute(0, 2, 1, 3).to(v.dtype)


def kivi_state_lengths(cfg: KIVIConfig, tokens: int) -> tuple[int, int]:
    """How many of the first ``tokens`` tokens of a sequence KIVI holds quantized once they are all in the cache:
    ``(keys, values)`` = ``(tokens - tokens % key_flush, max(tokens - residual, 0))``; the rest are full precision."""
    return tokens - tokens % cfg.key_flush, max(tokens - cfg.residual, 0)


def kivi_kv_bytes(cfg: KIVIConfig, tokens: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of one layer's KIVI cache for one sequence of ``tokens`` tokens (keys and values, all ``kv_heads``
    heads of ``head_dim`` channels): quantized elements at ``bits`` bits (packed, rounded up to whole bytes per
    tensor), a float16 scale and a float16 zero point per group, bf16 residual elements. Raises ValueError when
    the groups do not tile the channels (values)."""
    c = kv_heads * head_dim
    if c % cfg.group:
        raise ValueError(f"KIVI values: {kv_heads} heads x {head_dim} channels are not whole groups of {cfg.group}")
    nk, nv = kivi_state_lengths(cfg, tokens)
    quant = math.ceil(nk * c * cfg.bits / 8) + math.ceil(nv * c * cfg.bits / 8)
    params = 4 * (nk // cfg.group) * c + 4 * nv * (c // cfg.group)  # (scale, zero) in float16 per group
    residual = 2 * c * ((tokens - nk) + (tokens - nv))
    return quant + params + residual


def kivi_ratio(cfg: KIVIConfig, tokens: int, kv_heads: int, head_dim: int) -> float:
    """Bytes of a bf16 dense cache over KIVI's (:func:`kivi_kv_bytes`), both holding ``tokens`` tokens."""
    return 2 * 2 * tokens * kv_heads * head_dim / kivi_kv_bytes(cfg, tokens, kv_heads, head_dim)


def kivi_cache(model: torch.nn.Module, max_len: int, cfg: KIVIConfig) -> Any:
    """A dense ``StaticCache`` of ``max_len`` slots for ``model`` whose contents follow KIVI (``cfg``): new key and
    value states (B, H, S, D), keys after RoPE, are stored rounded to bf16 (in the model's dtype); before a step
    writes, the tokens KIVI holds quantized at the cache's current length (:func:`kivi_state_lengths`) and not yet
    quantized are replaced, in place, by their dequantized values (:func:`quantize_keys`,
    :func:`quantize_values`). So a step attends the cache as it was plus its own tokens in full precision, as in
    KIVI. One batch of sequences at the same positions per cache: make a new one per batch. Raises ValueError on the first step when the value
    groups do not tile the KV heads' channels."""
    from ..latent.capture import make_static_cache

    cache = make_static_cache(model, max_len)
    update = cache.update
    seen: dict[int, int] = {}  # layer -> tokens written
    done: dict[int, tuple[int, int]] = {}  # layer -> (keys, values) quantized so far

    def kivi_update(key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
                    **kwargs: Any) -> Any:
        keys, values = update(key_states.to(torch.bfloat16).to(key_states.dtype),
                              value_states.to(torch.bfloat16).to(value_states.dtype), layer_idx, *args, **kwargs)
        before = seen.get(layer_idx, 0)
        seen[layer_idx] = before + key_states.shape[-2]
        (k0, v0), (k1, v1) = done.get(layer_idx, (0, 0)), kivi_state_lengths(cfg, before)
        if k1 > k0:  # the returned tensors are the cache's storage: quantized once, for every later step
            keys[:, :, k0:k1] = quantize_keys(keys[:, :, k0:k1], cfg.bits, cfg.group)
        if v1 > v0:
            values[:, :, v0:v1] = quantize_values(values[:, :, v0:v1], cfg.bits, cfg.group)
        done[layer_idx] = (k1, v1)
        return keys, values

    cache.update = kivi_update
    return cache
