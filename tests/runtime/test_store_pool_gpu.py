"""The latent store's private CUDA memory pool (runtime.store._private_pool): on a device whose general pool is full of
holes, the store's allocated bytes are its tensors' bytes; its memory returns once the store is gone; a tensor kept
beyond the store stays valid (skipped without CUDA; the lead runs it on the H200)."""

from __future__ import annotations

import gc

import pytest
import torch

from ckvp_compile.latent.bases import LatentBases
from ckvp_compile.runtime.store import LatentKVStore

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _bases(layers=8, group=4, hkv=8, d=128, rank=160):
    gen = torch.Generator().manual_seed(0)
    groups = tuple(tuple(range(i, min(i + group, layers))) for i in range(0, layers, group))
    basis = tuple(torch.linalg.qr(torch.randn(hkv, len(g) * d, rank, generator=gen))[0] for g in groups)
    ranks = tuple((rank,) * hkv for _ in groups)
    eig = tuple(torch.ones(hkv, len(g) * d, dtype=torch.float64) for g in groups)
    return LatentBases(groups=groups, num_kv_heads=hkv, head_dim=d, group_size=group, target_ratio=8.0,
                       rank_allocation="uniform", k_basis=basis, v_basis=basis, k_ranks=ranks, v_ranks=ranks,
                       k_eigenvalues=eig, v_eigenvalues=eig, model_fingerprint={}, num_tokens=1)


def _held(store):  # the store's tensors: per-sequence state (latents, slot positions, recent window) and bases
    nb = store.nbytes()
    return nb.per_sequence_state + (0 if nb.online_bases else nb.bases)


def test_store_bytes_are_its_tensors_bytes_beside_a_fragmented_pool():
    torch.cuda.empty_cache()
    # fragment the general pool: free every other block of 1.1-3.6 MiB, the sizes of a store's tensors
    keep, holes = [], []
    for i in range(64):
        t = torch.empty(int((1.1 + (i % 11) * 0.25) * 2**20), dtype=torch.uint8, device="cuda")
        (keep if i % 2 else holes).append(t)
    del holes
    base = torch.cuda.memory_allocated()
    store = LatentKVStore(_bases(), 1, 4120, "cuda", torch.bfloat16, "int4", "int4", recent_window=16)
    extra = torch.cuda.memory_allocated() - base - _held(store)
    assert store.mem_pool is not None
    # what is left: the kernels' index tables (a few KB, general pool) and one segment's tail at most
    assert 0 <= extra < 2**20 and extra < 0.05 * _held(store), (extra, _held(store))
    del keep


def test_pool_memory_returns_and_a_kept_tensor_stays_valid():
    gc.collect()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    store = LatentKVStore(_bases(), 2, 8192, "cuda", torch.bfloat16, "int4", "int4")
    kept = store.latent_k[0]
    assert torch.cuda.memory_reserved() > reserved
    del store
    gc.collect()
    kept.fill_(7)  # still its own memory: the pool keeps a block while a tensor holds it
    torch.cuda.synchronize()
    assert int(kept.sum()) == 7 * kept.numel()
    del kept
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= reserved + 2 * 2**20
