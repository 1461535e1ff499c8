"""The paged latent store (``LatentKVStore(page_size=P, num_pages=N)``): its host-side page allocator and bytes.

Properties, on random batch sizes, cache lengths, page sizes and pool sizes, over random sequences of
``ensure_mapped`` / ``release`` / ``reset``:

* no physical page is mapped twice, mapped + free pages == num_pages, each sequence's pages are a prefix of its
  logical pages, and the device page table equals the allocator's host view after every call;
* ``ensure_mapped`` maps exactly the pages the slots need; running out raises CKVPConfigError naming num_pages
  and leaves the table as it was;
* the layout (what a compiled graph bakes in) tells paged and unpaged stores apart, and the pools really are
  smaller when num_pages < B * S_max / P (tensor bytes, ``nbytes()``, ``latent.budget.store_bytes``);
* bad arguments are CKVPConfigErrors naming the fix; ``reorder`` (beam search) moves a paged store's rows.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckvp_compile.errors import CKVPConfigError, CKVPShapeError
from ckvp_compile.latent.budget import store_bytes
from ckvp_compile.runtime.store import LatentKVStore
from ckvp_compile.testing.bases import random_orthonormal_bases


def _bases(online: bool = False):
    """Tiny bases: 2 layers in one group, 2 KV heads of 8, rank 4."""
    return random_orthonormal_bases(2, 2, 2, 8, 4, online=online)


BASES = _bases()


def _store(b, s, page_size=0, num_pages=None, fmt="float", **kw):
    return LatentKVStore(BASES, b, s, "cpu", torch.float32, fmt, fmt, page_size=page_size, num_pages=num_pages, **kw)


def _check_invariants(store: LatentKVStore) -> None:
    host = store.host_page_table
    assert host.dtype == torch.int32 and host.shape == (store.batch_size, store.max_cache_len // store.page_size)
    assert torch.equal(store.page_table.cpu(), host)  # the device table is the host view
    mapped = host[host >= 0].tolist()
    assert len(mapped) == len(set(mapped)), "a physical page is mapped twice"
    assert all(0 <= p < store.num_pages for p in mapped), "the trash page (or beyond) is mapped"
    assert store.mapped_pages == len(mapped)
    assert store.mapped_pages + store.free_pages == store.num_pages
    for row in host.tolist():  # each sequence's mapped pages are a prefix of its logical pages
        n = sum(p >= 0 for p in row)
        assert all(p >= 0 for p in row[:n]) and all(p == -1 for p in row[n:])


@st.composite
def _paged_runs(draw):
    p = draw(st.sampled_from([1, 2, 4, 8]))
    b = draw(st.integers(1, 4))
    lpages = draw(st.integers(1, 6))
    s = p * lpages
    num_pages = draw(st.integers(1, b * lpages))
    op = st.one_of(
        st.tuples(st.just("map"), st.integers(0, s),
                  st.none() | st.lists(st.integers(0, b - 1), min_size=1, max_size=b)),
        st.tuples(st.just("release"), st.integers(0, b - 1)),
        st.tuples(st.just("reset")),
    )
    return b, s, p, num_pages, draw(st.lists(op, max_size=25))


@given(_paged_runs())
@settings(max_examples=60, deadline=None)
def test_the_page_allocator_never_double_maps_and_the_device_table_follows(run):
    b, s, p, num_pages, ops = run
    store = _store(b, s, p, num_pages)
    count = [0] * b  # the model: pages mapped per sequence
    _check_invariants(store)
    for op in ops:
        if op[0] == "map":
            _, length, seqs = op
            need = math.ceil(length / p)
            targets = range(b) if seqs is None else set(seqs)
            missing = sum(max(0, need - count[i]) for i in targets)
            before = (store.host_page_table, store.page_table.clone(), store.free_pages)
            if missing > num_pages - sum(count):
                with pytest.raises(CKVPConfigError, match="out of latent pages.*num_pages >= "):
                    store.ensure_mapped(length, seqs)
                after = (store.host_page_table, store.page_table, store.free_pages)
                assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
                assert before[2] == after[2]
            else:
                assert store.ensure_mapped(length, seqs) == missing
                for i in targets:
                    count[i] = max(count[i], need)
        elif op[0] == "release":
            assert store.release(op[1]) == count[op[1]]
            count[op[1]] = 0
        else:
            store.reset()
            count = [0] * b
        _check_invariants(store)
        host = store.host_page_table
        assert [int((row >= 0).sum()) for row in host] == count


def test_ensure_mapped_maps_in_order_and_says_how_many_pages_would_do():
    store = _store(2, 16, 4, num_pages=5)
    assert store.ensure_mapped(5) == 4  # 2 pages per sequence, sequence by sequence, lowest pages first
    assert store.host_page_table.tolist() == [[0, 1, -1, -1], [2, 3, -1, -1]]
    assert store.ensure_mapped(5) == 0  # already mapped: nothing to do
    with pytest.raises(CKVPConfigError, match=r"out of latent pages: 4 of 5 mapped.*num_pages >= 6"):
        store.ensure_mapped(9)
    assert store.host_page_table.tolist() == [[0, 1, -1, -1], [2, 3, -1, -1]]
    assert store.ensure_mapped(9, [1]) == 1
    assert store.release(0) == 2 and store.free_pages == 2
    assert store.ensure_mapped(13, [1]) == 1  # the lowest free page
    assert store.host_page_table.tolist() == [[-1, -1, -1, -1], [2, 3, 4, 0]]
    with pytest.raises(CKVPShapeError, match="max_cache_len"):
        store.ensure_mapped(17)
    with pytest.raises(CKVPShapeError, match="outside"):
        store.release(2)
    store.reset()
    assert store.mapped_pages == 0 and store.free_pages == 5 and bool((store.page_table == -1).all())


def test_an_unpaged_store_has_no_page_table_and_mapping_is_a_no_op():
    store = _store(2, 16)
    assert store.page_table is None and store.host_page_table is None and store.page_size == 0
    assert store.ensure_mapped(16) == 0 and store.release(0) == 0
    assert store.mapped_pages == store.free_pages == 0
    assert store.latent_k[0].shape[:2] == (2, 16) and store.nbytes().page_table == 0


def test_the_layout_tells_paged_stores_apart():
    layouts = {_store(2, 16).layout(), _store(2, 16, 4).layout(), _store(2, 16, 8).layout(),
               _store(2, 16, 4, num_pages=3).layout()}
    assert len(layouts) == 4
    assert _store(2, 16, 4).layout() == _store(2, 16, 4, num_pages=8).layout()  # 8 is the default


@pytest.mark.parametrize("fmt", ["float", "int4"])
def test_a_smaller_pool_holds_fewer_bytes(fmt):
    b, s, p = 4, 32, 4
    full, paged, small = _store(b, s, fmt=fmt), _store(b, s, p, fmt=fmt), _store(b, s, p, num_pages=5, fmt=fmt)
    for store, rows in ((paged, b * s // p + 1), (small, 6)):
        for pool, ref in zip((*store.latent_k, *store.latent_v), (*full.latent_k, *full.latent_v)):
            assert pool.shape == (rows, p, ref.shape[-1]) and pool.dtype == ref.dtype
            assert pool.nbytes == rows * p * ref.nbytes // (b * s)  # the pools really are this size
        nb = store.nbytes()
        assert nb.latent == sum(t.untyped_storage().nbytes() for t in (*store.latent_k, *store.latent_v))
        assert nb.page_table == b * (s // p) * 4 == store.page_table.nbytes
        assert nb.per_sequence_state == nb.latent + nb.slot_positions + nb.page_table
        assert nb.dense_equivalent == full.nbytes().dense_equivalent  # the dense cache it stands for
        assert store_bytes(BASES, b, s, fmt, fmt, torch.float32, with_bases=False, page_size=p,
                           num_pages=store.num_pages) == nb.per_sequence_state
    assert store_bytes(BASES, b, s, fmt, fmt, torch.float32, with_bases=False) == full.nbytes().per_sequence_state
    assert small.nbytes().per_sequence_state < full.nbytes().per_sequence_state / 2
    assert small.nbytes().ratio > 2 * full.nbytes().ratio


def test_bad_paging_arguments_name_the_fix():
    with pytest.raises(CKVPConfigError, match="does not divide max_cache_len=18"):
        _store(1, 18, 4)
    with pytest.raises(CKVPConfigError, match=r"num_pages must be an int in \[1, 4\]"):
        _store(1, 16, 4, num_pages=0)
    with pytest.raises(CKVPConfigError, match="more could never be mapped"):  # beyond B * S_max / P
        _store(1, 16, 4, num_pages=5)
    with pytest.raises(CKVPConfigError, match="page_size > 0"):
        _store(1, 16, 0, num_pages=4)
    for bad in (-1, True, 2.0):
        with pytest.raises(CKVPConfigError, match="page_size must be an int"):
            _store(1, 16, bad)
    with pytest.raises(CKVPConfigError, match="residual.*not supported yet"):
        _store(1, 16, 4, residual_format="int2/64")
    with pytest.raises(CKVPConfigError, match="online bases is not supported yet"):
        LatentKVStore(_bases(online=True), 1, 16, "cpu", torch.float32, page_size=4)


def _logical(store: LatentKVStore, pool: torch.Tensor) -> torch.Tensor:
    """(B, S_max, W): each sequence's rows through the page table, unmapped rows zero."""
    table = store.page_table.long()
    rows = pool[table.clamp(min=0)] * (table >= 0)[..., None, None]
    return rows.reshape(store.batch_size, store.max_cache_len, -1)


def test_reorder_moves_a_paged_store_s_rows():
    store = _store(3, 8, 2, num_pages=8)
    store.ensure_mapped(4, [0])
    store.ensure_mapped(6, [1])
    store.ensure_mapped(2, [2])
    for pool in (*store.latent_k, *store.latent_v):
        pool.copy_(torch.randn(pool.shape))
    store.slot_pos.copy_(torch.arange(24).view(3, 8))
    before = [_logical(store, pool) for pool in (*store.latent_k, *store.latent_v)]
    index = torch.tensor([1, 1, 0])
    store.reorder(index)
    _check_invariants(store)
    assert [int((row >= 0).sum()) for row in store.host_page_table] == [3, 3, 2]
    for pool, old in zip((*store.latent_k, *store.latent_v), before):
        torch.testing.assert_close(_logical(store, pool), old[index], rtol=0, atol=0)
    assert torch.equal(store.slot_pos, torch.arange(24).view(3, 8)[index])
    with pytest.raises(CKVPConfigError, match="num_pages >= 9"):
        store.reorder(torch.tensor([0, 0, 0]))  # three copies of 3 pages do not fit 8
    assert [int((row >= 0).sum()) for row in store.host_page_table] == [3, 3, 2]


def test_the_slot_probe_reads_a_call_s_slots_from_its_inputs_or_says_why_not():
    """The pass replays the slots' computation on the host (HF: ``arange(S) + cumulative_length``); a graph that
    writes the counter before computing the slots from it gets no probe, and the backend then maps every page
    at the first call."""
    from torch import fx

    from ckvp_compile.backend import _StoreArgs
    from ckvp_compile.passes.latent_kv_cache import LatentRewritePlan, _slot_probe

    def hf_like(x, counter):
        slots = torch.arange(3, device=counter.device) + counter
        counter.add_(3)
        return x[:, slots]

    def bumped_first(x, counter):
        counter.add_(3)
        return x[:, torch.arange(3, device=counter.device) + counter]

    gm = fx.symbolic_trace(hf_like)
    slots = next(n for n in gm.graph.nodes if n.name == "add")
    probe, indices, note = _slot_probe(gm.graph, [slots])
    assert note == "" and indices == [1]  # the counter, read before the graph bumps it
    assert probe(torch.tensor(5))[0].tolist() == [5, 6, 7]
    gm = fx.symbolic_trace(bumped_first)
    slots = next(n for n in gm.graph.nodes if n.name == "add")
    probe, indices, note = _slot_probe(gm.graph, [slots])
    assert probe is None and "after the graph writes it" in note

    store = _store(2, 16, 4, num_pages=8)
    args = _StoreArgs(LatentRewritePlan(store, [], 0, slot_probe=None, slot_probe_note=note))
    args.map_pages(store, [])
    assert store.mapped_pages == 8  # every page of every sequence
    plan = LatentRewritePlan(store, [], 0, slot_probe=fx.symbolic_trace(lambda c: (torch.arange(3) + c,)),
                             slot_inputs=[1])
    store.reset()
    _StoreArgs(plan).map_pages(store, [None, torch.tensor(6)])  # slots 6..8: 3 pages of 4 per sequence
    assert store.mapped_pages == 6


@pytest.mark.parametrize("fmt", ["float", "int4"])
def test_the_decode_bench_fills_a_paged_cache_through_its_pages(fmt):
    from ckvp_compile.bench.decode_models import fill_cache_, kv_bytes_held
    from ckvp_compile.runtime.hf_cache import CKVPStaticCache
    from ckvp_compile.testing import build_hf_moe

    config = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8).config
    plain = CKVPStaticCache(config, BASES, max_cache_len=16, max_batch_size=2, latent_format=fmt)
    paged = CKVPStaticCache(config, BASES, max_cache_len=16, max_batch_size=2, latent_format=fmt, page_size=4,
                            num_pages=6)
    fill_cache_(plain, 10)
    fill_cache_(paged, 10)
    store = paged.store
    assert store.mapped_pages == 6
    for pool, ref in zip((*store.latent_k, *store.latent_v), (*plain.store.latent_k, *plain.store.latent_v)):
        assert torch.equal(_logical(store, pool)[:, :10], ref[:, :10])
    assert kv_bytes_held(paged) < kv_bytes_held(plain)
