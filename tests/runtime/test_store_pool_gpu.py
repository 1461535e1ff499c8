"""The latent store's private CUDA memory pool (runtime.store._private_pool): on a device whose general pool is full of
holes, the store's allocated bytes are its tensors' bytes; its memory returns once the store is gone; a tensor kept
beyond the store stays valid (skipped without CUDA; the lead runs it on the H200)."""

from __future__ import annotations

import gc

import pytest
import torch

from ckvp_compile.runtime.store import LatentKVStore
from ckvp_compile.testing.bases import random_orthonormal_bases

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _bases():  # Mixtral-like: 8 layers in groups of 4, 8 KV heads of 128, rank 160
    return random_orthonormal_bases(8, 4, 8, 128, 160, target_ratio=8.0)


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
