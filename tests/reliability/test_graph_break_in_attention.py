"""A graph break between a latent cache's write and its attention: the backend's clear error, not a crash.

``generate(output_attentions=True)`` on an SDPA model logs a warning inside the attention forward; Dynamo breaks the
graph at that logging call, so one graph holds the cache write and the next the attention. The rewrite pairs the
two within a graph only; the unpaired write went on into the latent cache's placeholder (a stride-0 phantom) and
failed with "more than one element of the written-to tensor refers to a single memory location" (found by an
adversarial review, 2026-12-06). Now the binding reports such a write and the backend refuses the graph, naming
the graph break; the model stays usable without the option.
"""

from __future__ import annotations

import pytest
import torch

from ckvp_compile.errors import UnsupportedGraphError
from ckvp_compile.latent import calibrate
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import build_hf_moe

CACHE = 24


def _sdpa_logs_output_attentions() -> bool:
    """Whether this transformers' SDPA integration logs for output_attentions=True (the graph break below)."""
    import inspect

    from transformers.integrations import sdpa_attention

    return "output_attentions" in inspect.getsource(sdpa_attention.sdpa_attention_forward)


@pytest.mark.parametrize("graph_break", ["output_attentions", "graph_break()"])
def test_a_graph_break_between_cache_write_and_attention_is_named(graph_break, monkeypatch):
    """The user's case (``output_attentions=True``, where transformers logs inside SDPA's forward) and an explicit
    ``torch._dynamo.graph_break()`` at the same place (every transformers version)."""
    from transformers import StaticCache
    from transformers.modeling_utils import AttentionInterface

    if graph_break == "output_attentions" and not _sdpa_logs_output_attentions():
        pytest.skip("this transformers' SDPA forward does not log for output_attentions (no graph break)")
    kw = dict(output_attentions=True, return_dict_in_generate=True) if graph_break == "output_attentions" else {}
    torch._dynamo.reset()
    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    assert model.config._attn_implementation == "sdpa"
    bases = calibrate(model, [torch.randint(0, 256, (1, 12)) for _ in range(2)], group_size=2, kv_ratio=1.0,
                      progress=False)
    ids = torch.randint(1, 256, (1, 6))

    def run(cache, **kw):
        with torch.no_grad():
            return model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False,
                                  disable_compile=True, **kw)

    dense = run(StaticCache(config=model.config, max_cache_len=CACHE))
    if graph_break == "graph_break()":  # after calibrate(), which refuses a split graph itself
        sdpa = AttentionInterface._global_mapping["sdpa"]

        def sdpa_after_a_break(*args, **kwargs):
            torch._dynamo.graph_break()
            return sdpa(*args, **kwargs)

        monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", sdpa_after_a_break)
    eager_forward = model.forward
    model.forward = torch.compile(eager_forward, backend="ckvp", options={"compiler": "aot_eager"})
    try:
        with pytest.raises(UnsupportedGraphError, match="graph breaks between the cache write and the attention"):
            run(CKVPStaticCache(model.config, bases, max_cache_len=CACHE), **kw)
        # the same call with a dense cache runs (HF returns no attention weights under SDPA)
        out = run(StaticCache(config=model.config, max_cache_len=CACHE), **kw)
        assert (out.sequences if kw else out).tolist() == dense.tolist()
        if graph_break == "output_attentions":  # without the option the latent cache gives dense's tokens
            assert run(CKVPStaticCache(model.config, bases, max_cache_len=CACHE)).tolist() == dense.tolist()
    finally:
        model.forward = eager_forward
        torch._dynamo.reset()
