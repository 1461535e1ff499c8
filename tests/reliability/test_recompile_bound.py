"""Recompiles: prompts of varying length, then decode, through HF ``generate()`` with a latent cache.

The bound (also in the README's reliability table): with one model, one :class:`CKVPStaticCache` layout and the
default ``dynamic=None``, ``torch.compile(model.forward, backend="ckvp")`` compiles at most **3 graphs** for any
number of prompt lengths and decode steps:

1. the first prefill, with its prompt length S as a constant;
2. the decode step (S = 1; Dynamo specialises sizes 0 and 1, so it never shares the prefill graph);
3. one prefill graph with a symbolic S, compiled when a second prompt length appears (automatic dynamic shapes);
   every later prompt length reuses it.

No decode step after the first of a process compiles anything. Counted with ``torch._dynamo.utils.counters``
(``stats/unique_graphs``: graphs handed to the backend) after every forward call.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from ckvp_compile.latent import calibrate
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import build_hf_moe

MAX_GRAPHS = 3
PROMPT_LENGTHS = (5, 9, 17)
NEW_TOKENS = 20
CACHE = 48


def test_varying_prompts_then_decode_compile_a_bounded_number_of_graphs():
    """Prompts of 5, 9, 17 tokens, each followed by 20 greedy decode steps (HF generate, one CKVPStaticCache reset
    between prompts): at most 3 graphs in all, none compiled by a decode step after the first one, and every
    generation equal to the dense StaticCache one (full rank: the latent cache is exact)."""
    from transformers import StaticCache

    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    bases = calibrate(model, [torch.randint(0, 256, (1, 20)) for _ in range(3)], group_size=2, kv_ratio=1.0,
                      progress=False)
    eager_forward = model.forward
    compiled = torch.compile(eager_forward, backend="ckvp", options={"compiler": "aot_eager"})
    log: list[tuple[int, int]] = []  # (query length S of the call, graphs compiled so far) per forward call

    def counted_forward(*args, **kwargs):
        out = compiled(*args, **kwargs)
        log.append((kwargs["input_ids"].shape[1], counters["stats"]["unique_graphs"]))
        return out

    kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False, disable_compile=True, pad_token_id=0)
    cache = CKVPStaticCache(model.config, bases, max_cache_len=CACHE)
    counters.clear()
    for length in PROMPT_LENGTHS:
        ids = torch.randint(1, 256, (1, length))
        with torch.no_grad():
            dense = model.generate(ids, past_key_values=StaticCache(config=model.config, max_cache_len=CACHE), **kw)
            cache.reset()
            model.forward = counted_forward
            try:
                latent = model.generate(ids, past_key_values=cache, **kw)
            finally:
                model.forward = eager_forward
        assert latent.tolist() == dense.tolist(), f"prompt of {length} tokens"

    calls_per_prompt = NEW_TOKENS  # generate() runs the prefill, then NEW_TOKENS - 1 decode steps
    assert len(log) == len(PROMPT_LENGTHS) * calls_per_prompt
    assert [s for s, _ in log[::calls_per_prompt]] == list(PROMPT_LENGTHS)
    graphs = log[-1][1]
    assert 2 <= graphs <= MAX_GRAPHS, log
    first_decode = log[1][1]
    for i, (s, n) in enumerate(log[2:], start=2):
        if s == 1:  # a decode step: nothing new since the previous call
            assert n == log[i - 1][1], f"call {i} (decode) compiled a graph: {log}"
    assert first_decode == 2  # prefill + decode


def test_a_cache_size_past_the_recompile_limit_is_named_in_the_error(monkeypatch):
    """Each CKVPStaticCache size (batch, slots) compiles its own prefill and decode graphs; past Dynamo's
    recompile_limit (lowered here to 2: one size) the next size runs eagerly and the cache refuses it. The error
    names the sizes compiled, the limit and the fix (one cache reused), not only a generic graph-break story; the
    size compiled before still works."""
    from ckvp_compile import CKVPError

    import ckvp_compile.runtime.store as store_module

    monkeypatch.setattr(store_module, "_COMPILED_SIZES", set())  # sizes other tests of this process compiled
    torch._dynamo.reset()
    model = build_hf_moe("mixtral", num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
    bases = calibrate(model, [torch.randint(0, 256, (1, 20))], group_size=1, kv_ratio=1.0, progress=False)
    model.forward = torch.compile(model.forward, backend="ckvp", options={"compiler": "aot_eager"})
    kw = dict(max_new_tokens=3, do_sample=False, disable_compile=True, pad_token_id=0)
    ids = torch.randint(1, 256, (1, 5))
    try:
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=2):
            model.generate(ids, past_key_values=CKVPStaticCache(model.config, bases, max_cache_len=16), **kw)
            with pytest.raises(CKVPError, match=r"max_cache_len=24\).*\(1, 16\).*recompile_limit \(2\).*reuse it"):
                model.generate(ids, past_key_values=CKVPStaticCache(model.config, bases, max_cache_len=24), **kw)
            model.generate(ids, past_key_values=CKVPStaticCache(model.config, bases, max_cache_len=16), **kw)
    finally:
        del model.forward
        torch._dynamo.reset()
