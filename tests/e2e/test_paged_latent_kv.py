"""The paged latent store end to end: ``CKVPStaticCache(page_size=P, num_pages=N)`` through ``backend="ckvp"``.

Paging changes where latent rows live, never what is computed, so a paged cache must give the logits of the
unpaged cache, bit for bit (within 1e-6), through prefill and decode, for float and int4 latents, with
``aot_eager`` and with Inductor. Pages are mapped on demand before each call (from the call's slots, which the
pass reads from the graph's inputs), so a pool just large enough for the tokens run works; one page fewer raises
a CKVPConfigError naming num_pages and leaves the table as it was; ``reset()`` and ``release(b)`` give pages back.
Unit-major latents (``latent_layout="unit-major"``) are checked here the same way: strides never change results.
"""

from __future__ import annotations

import re

import pytest
import torch

from ckvp_compile import CKVPBackend, CKVPConfig, CompileRecorder
from ckvp_compile.errors import CKVPConfigError
from ckvp_compile.kernels.latent_layout import layout_of
from ckvp_compile.latent import calibrate
from ckvp_compile.runtime.hf_cache import CKVPStaticCache, use_latent_cache
from ckvp_compile.testing import GptFastConfig, GptFastMoE, build_hf_moe, prefill_decode_logits
from ckvp_compile.testing.decoding import hf_step_kwargs

PROMPT = 6
N_DECODE = 8
CACHE = 32
BATCH = 2


@pytest.fixture(scope="module")
def model_and_bases():
    torch.manual_seed(0)
    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    samples = [torch.randint(0, 256, (1, 20)) for _ in range(3)]
    bases = calibrate(model, samples, group_size=2, kv_ratio=2.0, progress=False)  # lossy: a paging bug shows
    return model, bases


def _cache(model, bases, fmt="float", **paging):
    return CKVPStaticCache(model.config, bases, max_cache_len=CACHE, max_batch_size=BATCH, latent_format=fmt,
                           **paging)


def _run(model, ids, cache, compiler="aot_eager", n_decode=N_DECODE, feed=None, rec=None, before_step=None):
    """Prefill + ``n_decode`` steps through a fresh backend='ckvp' compile; each step feeds the previous argmax, or
    ``feed[i]``'s (a reference run's logits: both runs see the same tokens). ``before_step(i)`` runs before
    decode step i."""
    torch._dynamo.reset()  # a graph is compiled for one cache layout (paging included)
    step = torch.compile(model, backend=CKVPBackend(CKVPConfig(compiler=compiler), recorder=rec), fullgraph=True)
    with torch.no_grad():
        outs = [step(**hf_step_kwargs(model, ids, cache, 0)).logits]
        for i in range(n_decode):
            if before_step is not None:
                before_step(i)
            prev = outs[-1] if feed is None else feed[i]
            outs.append(step(**hf_step_kwargs(model, prev[:, -1:].argmax(-1), cache, ids.shape[1] + i)).logits)
    return outs


def _assert_equal(got, want, rows=slice(None)):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        err = (a[rows] - b[rows]).abs().max().item()
        assert err <= 1e-6, f"step {i}: max |paged - unpaged| = {err}"


_REF: dict = {}


def _reference(model, bases, ids, fmt, compiler="aot_eager"):
    """The unpaged cache's logits (computed once per format, compiler and prompt)."""
    key = (fmt, compiler, tuple(ids.flatten().tolist()))
    if key not in _REF:
        _REF[key] = _run(model, ids, _cache(model, bases, fmt), compiler)
    return _REF[key]


def _ids(seed=1):
    return torch.randint(0, 256, (BATCH, PROMPT), generator=torch.Generator().manual_seed(seed))


# each page size and each format (paged float latents at page 8 run with Inductor below, paged int4 ones at page 4 in
# the pool, reconstruct and recent-window tests)
@pytest.mark.parametrize("page_size,fmt", [(4, "float"), (8, "int4")])
def test_paged_equals_unpaged_and_maps_pages_on_demand(model_and_bases, page_size, fmt):
    model, bases = model_and_bases
    ids = _ids()
    want = _reference(model, bases, ids, fmt)
    rec = CompileRecorder()
    cache = _cache(model, bases, fmt, page_size=page_size)
    got = _run(model, ids, cache, rec=rec)
    _assert_equal(got, want)
    store = cache.store
    tokens = PROMPT + N_DECODE
    per_seq = -(-tokens // page_size)
    assert store.mapped_pages == BATCH * per_seq < store.num_pages == BATCH * CACHE // page_size  # on demand
    assert torch.equal(store.page_table.cpu(), store.host_page_table)
    for g in rec.graphs:  # the page table is one graph input, the last argument of every latent op
        assert not g.fell_back, g.fell_back
        calls = re.findall(r"torch\.ops\.ckvp\.latent_(?:append|attention|reconstruct)\.default\((.*)\)", g.dynamo_after)
        assert calls and all(c.rstrip().endswith("ckvp_page_table") for c in calls), calls
        assert g.dynamo_after.count("ckvp_page_table = ") == 1


@pytest.mark.parametrize("compiler,page_size,fmt,layout", [
    ("aot_eager", 0, "int4", "unit-major"), ("aot_eager", 4, "float", "unit-major"),
    ("inductor", 0, "int4", "unit-major"), ("inductor", 4, "int4", "unit-major"),
    ("aot_eager", 4, "int4", "row-major/unit-major")])
def test_unit_major_latents_equal_row_major(model_and_bases, compiler, page_size, fmt, layout):
    """``latent_layout="unit-major"`` (kernels.latent_layout) changes the latents' strides only: the logits of the
    row-major unpaged cache, paged or not, with aot_eager and Inductor, and no graph falls back; likewise with the
    value latents alone unit-major (``"row-major/unit-major"``, with aot_eager: under Inductor each latent is a graph
    input of its own strides, unit-major in the cases above and row-major in the reference)."""
    model, bases = model_and_bases
    ids = _ids()
    want = _reference(model, bases, ids, fmt, compiler)
    rec = CompileRecorder()
    cache = _cache(model, bases, fmt, page_size=page_size, latent_layout=layout)
    keys_unit = layout == "unit-major"
    assert all(layout_of(t) == "unit-major" and not t.is_contiguous() for t in cache.store.latent_v)
    assert all(layout_of(t) == ("unit-major" if keys_unit else "row-major") for t in cache.store.latent_k)
    _assert_equal(_run(model, ids, cache, compiler, rec=rec), want)
    for g in rec.graphs:
        assert not g.fell_back, g.fell_back


# float latents (paged int4 ones with Inductor: test_unit_major_latents_equal_row_major[inductor-4-int4-unit-major])
@pytest.mark.parametrize("page_size,fmt", [(8, "float")])
def test_paged_equals_unpaged_with_inductor(model_and_bases, page_size, fmt):
    model, bases = model_and_bases
    ids = _ids()
    want = _reference(model, bases, ids, fmt, "inductor")
    cache = _cache(model, bases, fmt, page_size=page_size)
    _assert_equal(_run(model, ids, cache, "inductor"), want)
    assert cache.store.mapped_pages == BATCH * -(-(PROMPT + N_DECODE) // page_size)


@pytest.mark.parametrize("variant", ["reconstruct", "recent_window"])
def test_paged_equals_unpaged_through_reconstruct_and_with_a_recent_window(variant):
    """A hand-written softmax(QK^T)V keeps ckvp.latent_reconstruct (paged too); a dense recent window is not
    paged and reads the same exact tokens."""
    torch.manual_seed(0)
    attn = "eager" if variant == "reconstruct" else "sdpa"
    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, attn_implementation=attn)
    bases = calibrate(model, [torch.randint(0, 256, (1, 20)) for _ in range(3)], group_size=2, kv_ratio=2.0,
                      progress=False)
    extra = {"recent_window": 4} if variant == "recent_window" else {}
    ids = _ids()
    want = _run(model, ids, _cache(model, bases, "int4", **extra))
    rec = CompileRecorder()
    got = _run(model, ids, _cache(model, bases, "int4", page_size=4, **extra), rec=rec)
    _assert_equal(got, want)
    op = "latent_reconstruct" if variant == "reconstruct" else "window_append"
    assert all(f"ckvp.{op}" in g.dynamo_after for g in rec.graphs)


def test_a_pool_just_large_enough_works_and_one_page_fewer_is_a_clear_error(model_and_bases):
    model, bases = model_and_bases
    ids = _ids()
    want = _reference(model, bases, ids, "int4")
    page = 4
    enough = BATCH * -(-(PROMPT + N_DECODE) // page)  # every token's page, for both sequences
    cache = _cache(model, bases, "int4", page_size=page, num_pages=enough)
    _assert_equal(_run(model, ids, cache), want)
    assert cache.store.free_pages == 0

    small = _cache(model, bases, "int4", page_size=page, num_pages=enough - 1)
    tables = []
    with pytest.raises(CKVPConfigError, match=rf"out of latent pages.*num_pages >= {enough}"):
        _run(model, ids, small, before_step=lambda i: tables.append(small.store.host_page_table))
    assert torch.equal(small.store.host_page_table, tables[-1])  # the failed call changed nothing
    assert torch.equal(small.store.page_table.cpu(), tables[-1])
    # the model (and the small cache) stay usable: a shorter sequence fits the small pool after reset()
    small.reset()
    assert small.store.mapped_pages == 0
    short = 2
    _assert_equal(_run(model, ids, small, n_decode=short), want[:short + 1])
    # and a bigger cache after that
    _assert_equal(_run(model, ids, _cache(model, bases, "int4", page_size=page, num_pages=enough)), want)


def test_reset_then_a_new_prompt_equals_a_fresh_cache(model_and_bases):
    model, bases = model_and_bases
    cache = _cache(model, bases, "float", page_size=4, num_pages=BATCH * 4)
    _run(model, _ids(2), cache)
    assert cache.store.mapped_pages == BATCH * 4
    cache.reset()
    assert cache.store.mapped_pages == 0 and bool((cache.store.page_table == -1).all())
    ids = _ids(3)
    _assert_equal(_run(model, ids, cache), _reference(model, bases, ids, "float"))


def test_release_frees_one_sequence_without_touching_the_others(model_and_bases):
    """Sequence 1 is released after 3 decode steps: its pages go back to the pool (and are mapped again, to the
    lowest free pages, at the next call); sequence 0's logits stay those of the unpaged run."""
    model, bases = model_and_bases
    ids = _ids()
    want = _reference(model, bases, ids, "float")
    cache = _cache(model, bases, "float", page_size=4, num_pages=BATCH * 4)
    store = cache.store
    freed = []

    def release_after_three(i):
        if i == 3:
            before = store.mapped_pages
            freed.append(store.release(1))
            assert store.mapped_pages == before - freed[-1] and bool((store.page_table[1] == -1).all())

    got = _run(model, ids, cache, feed=want, before_step=release_after_three)
    assert freed == [3]  # slots [0, 9): 3 pages of 4
    _assert_equal(got, want, rows=slice(0, 1))
    assert store.mapped_pages == BATCH * 4 and torch.equal(store.page_table.cpu(), store.host_page_table)
    assert [int((row >= 0).sum()) for row in store.host_page_table] == [4, 4]


def test_gpt_fast_paged_equals_unpaged():
    torch.manual_seed(0)
    model = GptFastMoE(GptFastConfig(n_layer=2)).eval()
    samples = [torch.randint(0, 256, (1, 20)) for _ in range(3)]
    bases = calibrate(model, samples, group_size=2, kv_ratio=2.0, progress=False)
    ids = torch.randint(0, 256, (1, PROMPT))
    stores = []

    def compile_latent(page_size, layout="row-major"):
        def fn(m):
            torch._dynamo.reset()
            stores.append(use_latent_cache(m, bases, latent_format="int4", page_size=page_size,
                                           latent_layout=layout))
            return torch.compile(m, backend=CKVPBackend(CKVPConfig(compiler="aot_eager")), fullgraph=True)
        return fn

    want = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=CACHE, compile_fn=compile_latent(0))
    got = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=CACHE, compile_fn=compile_latent(4))
    _assert_equal(got, want)
    assert stores[-1].mapped_pages == -(-(PROMPT + N_DECODE) // 4)  # from input_pos, on demand
    # unit-major latents (kernels.latent_layout), paged: the same logits
    got = prefill_decode_logits(model, ids, N_DECODE, max_cache_len=CACHE,
                                compile_fn=compile_latent(4, "unit-major"))
    assert stores[-1].latent_layout == "unit-major"
    _assert_equal(got, want)


def test_generate_with_prompts_of_several_lengths_maps_pages_on_demand(model_and_bases):
    """HF generate() with prompts of 5, 9 and 17 tokens (a dynamic-length prefill graph, whose slots depend on a
    symbolic length) and reset() between them: the tokens of the unpaged cache, and only the pages reached."""
    model, bases = model_and_bases
    forward = model.forward
    runs = {}
    try:
        for page in (0, 4):
            torch._dynamo.reset()
            model.forward = torch.compile(forward, backend=CKVPBackend(CKVPConfig(compiler="aot_eager")))
            cache = CKVPStaticCache(model.config, bases, max_cache_len=48, max_batch_size=1, page_size=page)
            runs[page] = []
            for n in (5, 9, 17):
                ids = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n))
                with torch.no_grad():
                    out = model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False,
                                         disable_compile=True)
                # the last new token is not fed back: slots [0, n + 5)
                runs[page].append((out, cache.store.mapped_pages))
                cache.reset()
    finally:
        model.forward = forward
    for (want, _), (got, mapped), n in zip(runs[0], runs[4], (5, 9, 17)):
        assert torch.equal(got, want)
        assert mapped == -(-(n + 5) // 4)


class _CountedPositions(torch.nn.Module):
    """A gpt-fast model behind a wrapper that keeps its own position counter and bumps it in place, directly or
    through a view, before deriving the call's positions from it (what a serving wrapper may do)."""

    def __init__(self, inner: torch.nn.Module, through_view: bool):
        super().__init__()
        self.inner, self.through_view = inner, through_view
        self.register_buffer("n", torch.zeros(1, dtype=torch.long))

    def forward(self, idx):
        s = idx.shape[1]
        if self.through_view:
            self.n[0].add_(s)
        else:
            self.n.add_(s)
        return self.inner(idx, torch.arange(s) + self.n - s)


@pytest.mark.parametrize("through_view", [False, True])
def test_slots_read_after_an_in_place_write_map_every_page(through_view):
    """The slot probe replays the graph's slot computation before the call; slots computed from an input the
    graph writes first (here a counter bumped in place, also through an indexing view) cannot be probed, so every
    page is mapped at the first call: still equal to the unpaged cache (a probe reading the counter before the bump
    under-estimated every call's slots, and the writes went to the trash page)."""
    torch.manual_seed(0)
    inner = GptFastMoE(GptFastConfig(n_layer=2)).eval()
    bases = calibrate(inner, [torch.randint(0, 256, (1, 20)) for _ in range(3)], group_size=2, kv_ratio=2.0,
                      progress=False)
    ids = torch.randint(0, 256, (1, 6))
    outs = {}
    for page in (0, 4):
        torch._dynamo.reset()
        model = _CountedPositions(inner, through_view)
        inner.setup_caches(1, 32)
        store = use_latent_cache(inner, bases, latent_format="float", page_size=page)
        step = torch.compile(model, backend=CKVPBackend(CKVPConfig(compiler="aot_eager")), fullgraph=True)
        with torch.no_grad():
            o = [step(ids)]
            for _ in range(4):
                o.append(step(o[-1][:, -1:].argmax(-1)))
        outs[page] = o
        if page:
            assert store.mapped_pages == 32 // 4  # no probe: every page at the first call
    for got, want in zip(outs[4], outs[0]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
