"""Hand-written attention blocks for the attention-analysis tests: the forms HF and gpt-fast models don't cover.

:class:`HandModel` stacks :class:`HandAttention` blocks under ``layers.<i>.attn`` and is configured by
:class:`HandSpec`: RoPE form (interleaved via ``stack(-x_odd, x_even)``, gpt-fast's real pairs form, complex,
rotate-half through ``split`` or written out with ``cat``, none), partial rotary, the cache write
(``setitem``, ``index_put_``, ``index_copy_``, functional ``index_put``, none), the attention product
(``@``, ``einsum``, ``bmm`` over (B*H, S, D)), GQA (``repeat_interleave``, HF-style ``expand``, broadcast over
a group dim) and an optional sliding-window mask built from positions in the graph.

In eager mode each block keeps its pre-RoPE key in ``last_k_in`` (B, Hkv, S, D), the reference the tests
compare the analysis' ``k_in`` against. :class:`ClassicMLA` is a DeepSeek-V2-style multi-head latent
attention with ``cat(k_nope, k_pe.expand(...))`` keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class HandSpec:
    rope: str = "interleaved"  # interleaved | pairs | complex | rotate_half_split | halves_cat | signed_table | none
    rotary_dim: int | None = None  # None: the whole head
    cache: str | None = "setitem"  # setitem | index_put_ | index_copy_ | index_put | None
    product: str = "matmul"  # matmul | einsum | bmm
    gqa: str = "repeat_interleave"  # repeat_interleave | expand | broadcast
    window: int | None = None  # sliding window size, None for plain causal
    n_layer: int = 2
    dim: int = 48
    n_head: int = 4
    n_kv: int = 2
    head_dim: int = 16
    max_len: int = 16


def _tables(spec: HandSpec, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (S, rd/2) of the rotation angles at ``pos``."""
    rd = spec.rotary_dim or spec.head_dim
    inv = 1.0 / (10000 ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    ang = pos.float()[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


def rope(x: torch.Tensor, spec: HandSpec, pos: torch.Tensor) -> torch.Tensor:
    """Apply ``spec.rope`` to x (B, H, S, D), rotating the first ``rotary_dim`` channels."""
    if spec.rope == "none":
        return x
    rd = spec.rotary_dim or x.shape[-1]
    if rd < x.shape[-1]:
        if spec.rope == "rotate_half_split":
            x_rot, x_pass = torch.split(x, [rd, x.shape[-1] - rd], dim=-1)
        else:
            x_rot, x_pass = x[..., :rd], x[..., rd:]
        return torch.cat([_rotate(x_rot, spec, pos), x_pass], dim=-1)
    return _rotate(x, spec, pos)


def _rotate(x: torch.Tensor, spec: HandSpec, pos: torch.Tensor) -> torch.Tensor:
    cos, sin = _tables(spec, pos)  # (S, rd/2)
    if spec.rope == "interleaved":
        c, s = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
        rot = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        return x * c + rot * s
    if spec.rope == "pairs":
        xs = x.float().reshape(*x.shape[:-1], -1, 2)
        out = torch.stack([xs[..., 0] * cos - xs[..., 1] * sin, xs[..., 1] * cos + xs[..., 0] * sin], -1)
        return out.flatten(3).type_as(x)
    if spec.rope == "complex":
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        out = torch.view_as_real(xc * torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))).flatten(3)
        return out.type_as(x)
    half = x.shape[-1] // 2
    c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    if spec.rope == "rotate_half_split":
        x1, x2 = torch.split(x, [half, half], dim=-1)
        return x * c + torch.cat([-x2, x1], dim=-1) * s
    if spec.rope == "signed_table":  # rotate-half with the sign folded into the sine table: not recognised
        sign = torch.cat([-torch.ones(half), torch.ones(half)])
        return x * c + torch.cat([x[..., half:], x[..., :half]], dim=-1) * (s * sign)
    if spec.rope == "halves_cat":
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    raise ValueError(spec.rope)


class HandAttention(nn.Module):
    """softmax(Q K^T * scale + mask) V written out, per :class:`HandSpec`."""

    def __init__(self, spec: HandSpec, batch: int) -> None:
        super().__init__()
        self.spec = spec
        d, h, hkv = spec.head_dim, spec.n_head, spec.n_kv
        self.wq = nn.Linear(spec.dim, h * d, bias=False)
        self.wk = nn.Linear(spec.dim, hkv * d, bias=False)
        self.wv = nn.Linear(spec.dim, hkv * d, bias=False)
        self.wo = nn.Linear(h * d, spec.dim, bias=False)
        if spec.cache is not None:
            self.register_buffer("k_cache", torch.zeros(batch, hkv, spec.max_len, d))
            self.register_buffer("v_cache", torch.zeros(batch, hkv, spec.max_len, d))
        self.last_k_in: torch.Tensor | None = None

    def _write(self, buf: torch.Tensor, pos: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
        kind = self.spec.cache
        if kind == "setitem":
            buf[:, :, pos] = val
        elif kind == "index_copy_":
            buf.index_copy_(2, pos, val)
        elif kind in ("index_put_", "index_put"):
            b = torch.arange(buf.shape[0])[:, None, None]
            hh = torch.arange(buf.shape[1])[None, :, None]
            idx = (b, hh, pos[None, None, :])
            if kind == "index_put":
                return torch.index_put(buf, idx, val)
            buf.index_put_(idx, val)
        return buf

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        bsz, seqlen, _ = x.shape
        h, hkv, d = spec.n_head, spec.n_kv, spec.head_dim
        q = self.wq(x).view(bsz, seqlen, h, d).transpose(1, 2)
        k = self.wk(x).view(bsz, seqlen, hkv, d).transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, hkv, d).transpose(1, 2)
        if not torch.compiler.is_compiling():
            self.last_k_in = k.detach().clone()
        q, k = rope(q, spec, pos), rope(k, spec, pos)
        if spec.cache is not None:
            k = self._write(self.k_cache, pos, k)
            v = self._write(self.v_cache, pos, v)
            kpos = torch.arange(spec.max_len)
        else:
            kpos = pos
        mask = kpos[None, :] <= pos[:, None]  # (S, T)
        if spec.window is not None:
            mask = mask & (kpos[None, :] > pos[:, None] - spec.window)
        bias = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
        g = h // hkv
        if spec.gqa == "repeat_interleave":
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        elif spec.gqa == "expand":
            t = k.shape[2]
            k = k[:, :, None].expand(bsz, hkv, g, t, d).reshape(bsz, h, t, d)
            v = v[:, :, None].expand(bsz, hkv, g, t, d).reshape(bsz, h, t, d)
        scale = 1.0 / math.sqrt(d)
        if spec.gqa == "broadcast":
            qg = q.view(bsz, hkv, g, seqlen, d)
            scores = qg @ k.unsqueeze(2).transpose(-2, -1) * scale + bias
            p = F.softmax(scores.float(), dim=-1).type_as(q)
            out = (p @ v.unsqueeze(2)).reshape(bsz, h, seqlen, d)
        elif spec.product == "einsum":
            scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale + bias
            p = scores.softmax(dim=-1)
            out = torch.einsum("bhqk,bhkd->bhqd", p, v)
        elif spec.product == "bmm":
            t = k.shape[2]
            q3, k3, v3 = q.reshape(bsz * h, seqlen, d), k.reshape(bsz * h, t, d), v.reshape(bsz * h, t, d)
            scores = torch.bmm(q3, k3.transpose(1, 2)).view(bsz, h, seqlen, t) / math.sqrt(d)
            p = torch.softmax(scores + bias, dim=-1).view(bsz * h, seqlen, t)
            out = torch.bmm(p, v3).view(bsz, h, seqlen, d)
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) * scale
            p = F.softmax(scores + bias, dim=-1)
            out = torch.matmul(p, v)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, h * d))


class _Block(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x, pos)


class HandModel(nn.Module):
    """``spec.n_layer`` residual blocks ``layers.<i>.attn`` over a (B, S, dim) input; forward(x, pos)."""

    def __init__(self, spec: HandSpec, batch: int = 1, attn_cls: type[nn.Module] | None = None) -> None:
        super().__init__()
        make = attn_cls or HandAttention
        self.layers = nn.ModuleList(_Block(make(spec, batch)) for _ in range(spec.n_layer))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, pos)
        return x


class ClassicMLA(nn.Module):
    """DeepSeek-V2-style MLA: keys = cat(k_nope from kv_b(norm(latent)), k_pe (one RoPE'd head) expanded)."""

    def __init__(self, spec: HandSpec, batch: int) -> None:
        super().__init__()
        self.spec = spec
        self.rank, self.d_nope, self.d_rope, self.d_v = 12, 8, 8, 8
        h = spec.n_head
        self.wq = nn.Linear(spec.dim, h * (self.d_nope + self.d_rope), bias=False)
        self.wkv_a = nn.Linear(spec.dim, self.rank + self.d_rope, bias=False)
        self.kv_norm = nn.RMSNorm(self.rank)
        self.wkv_b = nn.Linear(self.rank, h * (self.d_nope + self.d_v), bias=False)
        self.wo = nn.Linear(h * self.d_v, spec.dim, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        h = self.spec.n_head
        rspec = HandSpec(rope="rotate_half_split", head_dim=self.d_rope)
        q = self.wq(x).view(bsz, seqlen, h, -1).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [self.d_nope, self.d_rope], dim=-1)
        latent, k_pe = torch.split(self.wkv_a(x), [self.rank, self.d_rope], dim=-1)
        k_pe = k_pe.view(bsz, seqlen, 1, self.d_rope).transpose(1, 2)
        q_pe, k_pe = rope(q_pe, rspec, pos), rope(k_pe, rspec, pos)
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seqlen, h, -1).transpose(1, 2)
        k_nope, v = torch.split(kv, [self.d_nope, self.d_v], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(bsz, h, seqlen, self.d_rope)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
