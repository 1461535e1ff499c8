"""``analysis.rope.tables_paired``: proving from the graph alone that RoPE tables hold one angle per rotated pair
(HF's ``cat((freqs, freqs), -1)``), which lets the decode kernel read half of each table; and the store's record of
its table writers, which declares the tables to the kernel (``RopeSite.tables_paired`` -> ``LatentKVStore``)."""

from __future__ import annotations

import pytest
import torch

from ckvp_compile.analysis.attention import find_attention_sites
from ckvp_compile.analysis.rope import tables_paired
from ckvp_compile.errors import CKVPConfigError
from ckvp_compile.kernels.latent_attention_triton import declare_paired_tables, paired_tables_declared
from ckvp_compile.testing.decoding import capture_dynamo_graphs, capture_prefill_decode_graphs
from ckvp_compile.testing.models import HF_FAMILIES, build_hf_moe

SHAPE = dict(hidden=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4, top_k=2, ffn=32)


def _store():
    """A tiny float latent store on the CPU (one group of two layers, two KV heads of 8 channels, rank 4)."""
    from ckvp_compile.latent.bases import LatentBases
    from ckvp_compile.runtime.store import LatentKVStore

    basis = (torch.linalg.qr(torch.randn(2, 16, 4, generator=torch.Generator().manual_seed(0)))[0],)
    eig = (torch.ones(2, 16, dtype=torch.float64),)
    bases = LatentBases(groups=((0, 1),), num_kv_heads=2, head_dim=8, group_size=2, target_ratio=2.0,
                        rank_allocation="uniform", k_basis=basis, v_basis=basis, k_ranks=((4, 4),),
                        v_ranks=((4, 4),), k_eigenvalues=eig, v_eigenvalues=eig, model_fingerprint={}, num_tokens=1)
    return LatentKVStore(bases, 1, 8, "cpu", torch.float32)


def _table_node(fn, *args):
    """The node ``fn`` returns, in its Dynamo graph."""
    (gm,) = capture_dynamo_graphs(fn, *args)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    ret = out.args[0]
    return ret[0] if isinstance(ret, (tuple, list)) else ret


F = torch.randn(1, 5, 8)


def _set0(t):
    t[..., 0] = 0.0
    return t


def _square(f):
    """A (16, 16) paired table: a column of it is as wide as a row."""
    g = f[0, :2].reshape(16)[:8].expand(16, 8) + torch.arange(16.0)[:, None]
    return torch.cat((g, g), -1)


def _add_view(t):
    t[..., :4].add_(1.0)
    return t


@pytest.mark.parametrize("fn, form, want", [
    (lambda f: (torch.cat((f, f), -1).cos() * 0.5).to(torch.bfloat16).unsqueeze(1), "rotate_half", True),
    (lambda f: torch.cat((f, f), dim=2).sin(), "rotate_half", True),
    (lambda f: torch.cat((f, f), -1).cos()[0], "rotate_half", True),  # a leading-dim index keeps the pairs
    (lambda f: torch.cat((f, f), -1).cos(), "interleaved", False),  # cat pairs j with j + W/2, not 2j with 2j+1
    (lambda f: torch.cat((f, 2 * f), -1).cos(), "rotate_half", False),
    (lambda f: torch.cat((f, f), 0).cos(), "rotate_half", False),  # not along the last dim
    (lambda f: torch.cat((f, f), -1).cos() * f.sum(-1, keepdim=True), "rotate_half", False),  # a tensor factor
    (lambda f: torch.cat((f, f), -1).cos()[..., :8], "rotate_half", False),  # the last dim sliced
    (lambda f: f.cos(), "rotate_half", False),  # an input table: nothing to prove it by
    (lambda f: f.repeat_interleave(2, -1).cos(), "interleaved", True),
    (lambda f: f.repeat_interleave(3, -1).cos(), "interleaved", False),
    (lambda f: torch.stack((f, f), -1).flatten(-2).sin(), "interleaved", True),
    (lambda f: torch.stack((f, f + 1), -1).flatten(-2).sin(), "interleaved", False),
    (lambda f: torch.cat((f, f), -1).cos(), "complex", False),
    # a write in place after the cat (or after cos), directly or through a view: the dataflow no longer tells
    (lambda f: _set0(torch.cat((f, f), -1)).cos(), "rotate_half", False),
    (lambda f: _set0(torch.cat((f, f), -1).cos()), "rotate_half", False),
    (lambda f: torch.cat((f, f), -1).mul_(2.0).cos(), "rotate_half", False),
    (lambda f: _add_view(torch.cat((f, f), -1)).sin(), "rotate_half", False),
    # an op on the last dim whose result happens to have the table's width
    (lambda f: _square(f).cos().select(-1, 3), "rotate_half", False),
    (lambda f: _square(f).cos().select(1, 3), "rotate_half", False),
    (lambda f: _square(f).cos().select(0, 3), "rotate_half", True),
])
def test_tables_paired_by_construction(fn, form, want):
    assert tables_paired(_table_node(fn, F), form) is want


@pytest.mark.parametrize("name", HF_FAMILIES)
def test_hf_families_build_paired_tables(name):
    """Every HF MoE family builds its tables as ``cat((freqs, freqs), -1)``: proven in prefill and decode graphs."""
    pre, dec = capture_prefill_decode_graphs(build_hf_moe(name, **SHAPE), torch.tensor([[1, 2, 3, 4, 5]]),
                                             max_cache_len=16)
    for gm in (*pre, *dec):
        sites, _ = find_attention_sites(gm.graph)
        assert sites and all(s.rope is not None and s.rope.tables_paired for s in sites)


def test_store_declares_only_while_every_writer_is_proven():
    store = _store()
    store.ensure_rope_tables(8)
    cos, sin = store.rope_cos, store.rope_sin
    assert store.rope_paired is None and not paired_tables_declared(cos, sin)
    store.note_rope_writer(True)
    store.note_rope_writer(True)
    assert store.rope_paired is True and paired_tables_declared(cos, sin)
    assert not paired_tables_declared(cos.clone(), sin.clone())  # copies are never taken for the declared tables
    store.ensure_rope_tables(8, num_positions=16)  # reallocated tables carry the declaration over
    assert paired_tables_declared(store.rope_cos, store.rope_sin) and not paired_tables_declared(cos, sin)
    with pytest.raises(CKVPConfigError, match="cannot prove"):
        store.note_rope_writer(False)
    assert store.rope_paired is False and not paired_tables_declared(store.rope_cos, store.rope_sin)
    store.note_rope_writer(True)  # once unproven, always unpaired
    assert store.rope_paired is False and not paired_tables_declared(store.rope_cos, store.rope_sin)


def test_unproven_first_writer_never_declares():
    store = _store()
    store.ensure_rope_tables(8)
    store.note_rope_writer(False)
    store.note_rope_writer(True)
    assert store.rope_paired is False and not paired_tables_declared(store.rope_cos, store.rope_sin)


def test_declaration_follows_the_tensor():
    cos, sin = torch.zeros(4, 8), torch.zeros(4, 8)
    declare_paired_tables(cos, sin)
    assert paired_tables_declared(cos, sin) and paired_tables_declared(cos[:], sin[:])  # same storage and layout
    assert not paired_tables_declared(cos[:2], sin[:2])  # another shape
    declare_paired_tables(cos, sin, False)
    assert not paired_tables_declared(cos, sin)
