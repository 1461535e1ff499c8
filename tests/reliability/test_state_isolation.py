"""State isolation: latent state never leaks between caches, models or generate() calls, and does not grow.

* two caches of one compiled model, stepped alternately, each give what they give alone;
* two models (same shapes, other weights) compiled in one process, each with its own cache, stepped alternately;
* a second ``generate()`` (fresh cache, or the same cache after ``reset()``) equals the first; without ``reset()``
  the latent cache does exactly what a dense ``StaticCache`` does (HF continues the cached sequence);
* 200 decode steps: the store tensors keep their storage (no reallocation), no registry or Python-side list
  grows, no tensor is leaked, and nothing recompiles. (The 1000-step device-memory check on CUDA is in
  benchmarks/reliability_gpu.py.)
"""

from __future__ import annotations

import gc

import torch
from torch._dynamo.utils import counters

from ckvp_compile.latent import calibrate
from ckvp_compile.runtime import store as store_module
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import build_hf_moe, prefill_decode_logits
from ckvp_compile.testing.decoding import hf_step_kwargs

SHAPE = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
CACHE = 24
N_DECODE = 6


def _setup(seed=0):
    model = build_hf_moe("mixtral", seed=seed, **SHAPE)
    bases = calibrate(model, [torch.randint(0, 256, (1, 12)) for _ in range(2)], group_size=2, kv_ratio=1.0,
                      progress=False)
    return model, bases


def _compile(model):
    return torch.compile(model, backend="ckvp", options={"compiler": "aot_eager"}, fullgraph=True)


class _Stepper:
    """Greedy prefill + decode of one sequence through ``step`` with ``cache``, one call per ``next()``."""

    def __init__(self, step, model, ids, cache):
        self.step, self.model, self.ids, self.cache = step, model, ids, cache
        self.logits: list[torch.Tensor] = []
        self.calls = 0

    def next(self):
        if self.calls == 0:
            ids, start = self.ids, 0
        else:
            ids, start = self.logits[-1][:, -1:].argmax(-1), self.ids.shape[1] + self.calls - 1
        with torch.no_grad():
            self.logits.append(self.step(**hf_step_kwargs(self.model, ids, self.cache, start)).logits)
        self.calls += 1


def _assert_close_all(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4, msg=lambda m: f"step {i}: {m}")


def test_two_caches_of_one_model_stepped_alternately_do_not_share_state():
    model, bases = _setup()
    step = _compile(model)
    prompts = [torch.randint(0, 256, (1, 6)), torch.randint(0, 256, (1, 6))]
    runs = [_Stepper(step, model, p, CKVPStaticCache(model.config, bases, CACHE)) for p in prompts]
    for _ in range(N_DECODE + 1):
        for r in runs:
            r.next()
    for r, p in zip(runs, prompts):
        _assert_close_all(r.logits, prefill_decode_logits(model, p, N_DECODE, max_cache_len=CACHE))
    assert not torch.equal(runs[0].logits[-1], runs[1].logits[-1])  # the two sequences really differ


def test_two_models_in_one_process_do_not_share_state():
    (m0, b0), (m1, b1) = _setup(seed=0), _setup(seed=1)
    ids = torch.randint(0, 256, (1, 6))
    runs = [_Stepper(_compile(m), m, ids, CKVPStaticCache(m.config, b, CACHE)) for m, b in ((m0, b0), (m1, b1))]
    for _ in range(N_DECODE + 1):
        for r in runs:
            r.next()
    for r, m in zip(runs, (m0, m1)):
        _assert_close_all(r.logits, prefill_decode_logits(m, ids, N_DECODE, max_cache_len=CACHE))


def test_each_generate_starts_clean():
    from transformers import StaticCache

    model, bases = _setup()
    kw = dict(max_new_tokens=N_DECODE, do_sample=False, disable_compile=True, pad_token_id=0)
    first, second = torch.randint(1, 256, (1, 5)), torch.randint(1, 256, (1, 9))
    with torch.no_grad():
        dense_first = model.generate(first, past_key_values=StaticCache(config=model.config, max_cache_len=CACHE), **kw)
        reused = StaticCache(config=model.config, max_cache_len=CACHE)
        model.generate(first, past_key_values=reused, **kw)
        dense_unreset = model.generate(second, past_key_values=reused, **kw)  # HF: continues the cached sequence
    eager_forward = model.forward
    model.forward = torch.compile(eager_forward, backend="ckvp", options={"compiler": "aot_eager"})
    try:
        with torch.no_grad():
            a = model.generate(first, past_key_values=CKVPStaticCache(model.config, bases, CACHE), **kw)
            b = model.generate(first, past_key_values=CKVPStaticCache(model.config, bases, CACHE), **kw)
            cache = CKVPStaticCache(model.config, bases, CACHE)
            c = model.generate(first, past_key_values=cache, **kw)
            cache.reset()
            d = model.generate(first, past_key_values=cache, **kw)
            latent_unreset = model.generate(second, past_key_values=cache, **kw)
    finally:
        model.forward = eager_forward
    assert a.tolist() == b.tolist() == c.tolist() == d.tolist() == dense_first.tolist()
    assert latent_unreset.tolist() == dense_unreset.tolist()


def _store_tensors(store):
    names = ("latent_k", "latent_v", "basis_k", "basis_v", "resid_k", "resid_v")
    out = {f"{n}[{i}]": t for n in names for i, t in enumerate(getattr(store, n, ()) or ())}
    out.update(slot_pos=store.slot_pos, rope_cos=store.rope_cos, rope_sin=store.rope_sin)
    return out


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def test_200_decode_steps_reallocate_nothing_and_grow_nothing():
    model = build_hf_moe("mixtral", num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, hidden=32)
    bases = calibrate(model, [torch.randint(0, 256, (1, 12))], group_size=1, kv_ratio=1.0, progress=False)
    cache = CKVPStaticCache(model.config, bases, max_cache_len=208)
    run = _Stepper(_compile(model), model, torch.randint(0, 256, (1, 4)), cache)
    run.next()
    run.next()  # prefill + one decode step compile the two graphs
    store = cache.store
    ptrs = {k: t.data_ptr() for k, t in _store_tensors(store).items()}
    sizes = (len(store._phantoms), len(store_module._PHANTOMS), counters["stats"]["unique_graphs"])
    run.logits = run.logits[-1:]  # keep only what the next step reads
    live = _live_tensors()
    for _ in range(200):
        run.next()
        run.logits = run.logits[-1:]
    assert {k: t.data_ptr() for k, t in _store_tensors(store).items()} == ptrs
    assert (len(store._phantoms), len(store_module._PHANTOMS), counters["stats"]["unique_graphs"]) == sizes
    assert _live_tensors() <= live
    assert store.slot_pos[0, :205].tolist() == list(range(205))  # 4 prompt tokens + 201 decode steps
    assert int(cache.layers[0].cumulative_length) == 205
