"""Adversarial checks of a latent KV cache under hand-written ("eager") attention, softmax(Q K^T * s + mask) V:
variants that must give the dense model's logits (full-rank latent) or be refused with the reason, never silently
wrong numbers. gpt-fast style models (ckvp_compile.testing.gpt_fast) whose attention is replaced by a hand-written
one; CPU, ``compiler="aot_eager"``.
"""

from __future__ import annotations

import math

import pytest
import torch

import ckvp_compile.testing.gpt_fast as gf
from ckvp_compile import CKVPBackend, CKVPConfig, CKVPConfigError, CKVPError
from ckvp_compile.latent import calibrate
from ckvp_compile.runtime.hf_cache import use_latent_cache

N_DECODE = 3
PROMPT = 6


def _eager_attention(q, k, v, mask):
    """softmax(Q K^T / sqrt(D), masked) V, K / V repeated to the query heads."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return p @ v


def _with_attention(attend, rope=True):
    """gf.Attention.forward with ``attend(q, k, v, mask, k_new, v_new)`` after the cache update (k / v: what the
    cache update returned, k_new / v_new: this call's keys and values); ``rope=False``: no RoPE (GPT-2 style)."""

    def forward(self, x, rope, mask, input_pos, use_cache):
        cfg = self.cfg
        bsz, seqlen, _ = x.shape
        q_size, kv_size = cfg.n_head * cfg.head_dim, cfg.n_local_heads * cfg.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, cfg.n_head, cfg.head_dim)
        k = k.view(bsz, seqlen, cfg.n_local_heads, cfg.head_dim)
        v = v.view(bsz, seqlen, cfg.n_local_heads, cfg.head_dim)
        if with_rope:
            q, k = gf.apply_rope_complex(q, rope[0]), gf.apply_rope_complex(k, rope[0])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k_new, v_new = k, v
        _POS[0] = input_pos
        if use_cache:
            k, v = self.kv_cache.update(input_pos, k, v)
        y = attend(q, k, v, mask, k_new, v_new)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, q_size))

    with_rope = rope
    return forward


def _model_and_bases(monkeypatch, attend, rope=True):
    """A 2-layer gpt-fast model, full-rank bases calibrated on its plain form with ``_eager_attention``, then ``attend``
    patched in."""
    torch.manual_seed(0)
    model = gf.GptFastMoE(gf.GptFastConfig(n_layer=2)).eval()
    monkeypatch.setattr(gf.Attention, "forward",
                        _with_attention(lambda q, k, v, m, kn, vn: _eager_attention(q, k, v, m), rope))
    bases = calibrate(model, [torch.randint(0, 256, (1, 16))], group_size=2, kv_ratio=1.0, progress=False)
    monkeypatch.setattr(gf.Attention, "forward", _with_attention(attend, rope))
    return model, bases


def _latent_vs_dense(model, bases):
    """(latent-cache logits of the compiled model, dense eager logits): a PROMPT-token prefill and N_DECODE steps."""
    ids = torch.arange(PROMPT)[None] + 3

    def run(fn):
        outs = [fn(ids, torch.arange(PROMPT))]
        for i in range(N_DECODE):
            outs.append(fn(outs[-1][:, -1:].argmax(-1), torch.tensor([PROMPT + i])))
        return outs

    with torch.no_grad():
        model.setup_caches(1, 32)
        want = run(model)
        model.setup_caches(1, 32)
        use_latent_cache(model, bases, latent_format="float")
        step = torch.compile(model, backend=CKVPBackend(CKVPConfig(compiler="aot_eager")), fullgraph=True)
        return run(step), want


def _assert_close_all(got, want, tol=2e-4):
    assert len(got) == len(want) == N_DECODE + 1
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"step {i}: {m}")


def test_plain_hand_written_attention_full_rank_latent_equals_dense(monkeypatch):
    model, bases = _model_and_bases(monkeypatch, lambda q, k, v, m, kn, vn: _eager_attention(q, k, v, m))
    _assert_close_all(*_latent_vs_dense(model, bases))


def _scale_read_keys(q, k, v, m, kn, vn):
    k.mul_(0.9)  # k is the cache buffer: the scaling persists, compounding over the steps
    return _eager_attention(q, k, v, m)


def _scale_read_keys_view(q, k, v, m, kn, vn):
    kk = k[:, :, :]
    kk.mul_(0.9)
    return _eager_attention(q, kk, v, m)


def _shift_read_values_view(q, k, v, m, kn, vn):
    vv = v[:, :, :16]
    vv.add_(0.01)
    return _eager_attention(q, k, v, m)


def _zero_first_slot(q, k, v, m, kn, vn):
    k[:, :, 0] = 0.0  # a second, non-positional write into the cache
    return _eager_attention(q, k, v, m)


def _attend_then_rewrite_keys(q, k, v, m, kn, vn):
    y = _eager_attention(q, k, v, m)
    k[:, :, _POS[0]] = kn * 0.5  # a second positional write, after the attention: what later calls read
    return y


def _write_twice(q, k, v, m, kn, vn):
    k[:, :, _POS[0]] = kn * 0.5  # overwrites the update's write before the attention reads it
    return _eager_attention(q, k, v, m)


#: the current call's input_pos, for attends that write the cache themselves
_POS: list[torch.Tensor] = [torch.zeros(1, dtype=torch.long)]


@pytest.mark.parametrize("attend", [_scale_read_keys, _scale_read_keys_view, _shift_read_values_view,
                                    _zero_first_slot, _attend_then_rewrite_keys, _write_twice])
def test_a_cache_written_in_place_besides_its_positional_write_is_refused(attend, monkeypatch):
    """The cache read back is changed in place (``k.mul_``, through a view, a ``setitem`` at a fixed slot), or written
    at the positions a second time (after the attention: what later calls read; or before it): in eager the change
    persists in the cache (and compounds over the steps); a latent cache rebuilds the keys of the one write it
    rewrites, without it (decode logits off by 0.1-0.4 with full-rank bases, no warning). The analysis refuses the
    layer and names the write; calibrate() says why, a compiled call on a latent cache fails."""
    model, bases = _model_and_bases(monkeypatch, attend)
    with pytest.raises(CKVPConfigError, match="in place"):
        calibrate(model, [torch.randint(0, 256, (1, 16))], group_size=2, kv_ratio=1.0, progress=False)
    with pytest.raises(CKVPError):
        _latent_vs_dense(model, bases)


def _scale_written_keys(q, k, v, m, kn, vn):
    kn.mul_(2.0)  # the key just written into the cache, changed after the write
    return _eager_attention(q, k, v, m)


def _shift_written_values(q, k, v, m, kn, vn):
    vn.add_(1.0)
    return _eager_attention(q, k, v, m)


@pytest.mark.parametrize("attend", [_scale_written_keys, _shift_written_values])
def test_a_key_or_value_changed_in_place_after_its_cache_write_is_refused(attend, monkeypatch):
    """Without RoPE (GPT-2 style), the key (value) written into the cache is changed in place after the write: the
    dense cache holds it before the change, the latent rewrite appended it after (decode logits off by 0.6 (3.0) at
    full rank, no warning). With RoPE the rotation's own in-place check refused the key; now the write is checked."""
    model, bases = _model_and_bases(monkeypatch, attend, rope=False)
    with pytest.raises(CKVPConfigError, match="changed in place after that write"):
        calibrate(model, [torch.randint(0, 256, (1, 16))], group_size=2, kv_ratio=1.0, progress=False)
    with pytest.raises(CKVPError):
        _latent_vs_dense(model, bases)


def test_a_no_rope_hand_written_attention_full_rank_latent_equals_dense(monkeypatch):
    model, bases = _model_and_bases(monkeypatch, lambda q, k, v, m, kn, vn: _eager_attention(q, k, v, m), rope=False)
    _assert_close_all(*_latent_vs_dense(model, bases))
