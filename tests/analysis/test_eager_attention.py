"""Hugging Face ``attn_implementation="eager"`` attention (a hand-written softmax(QK^T)V) is found as ``softmax_qkv``,
with its static-cache writes, in models whose eager attention casts the probabilities differently: GPT-2 casts
them with ``attn_weights.type(value.dtype)`` (Llama / Mixtral / Qwen with ``.to(query.dtype)``)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.fx as fx

from ckvp_compile.analysis.attention import find_attention_sites
from ckvp_compile.analysis.graph import node_map, op_name
from ckvp_compile.testing.decoding import capture_prefill_decode_graphs
from ckvp_compile.testing.dense import build_hf_dense

PROMPT_LEN, CACHE_LEN = 5, 32


@functools.lru_cache(maxsize=None)
def _captured(arch: str, impl: str) -> tuple[list[fx.GraphModule], list[fx.GraphModule]]:
    model = build_hf_dense(arch, attn_implementation=impl)
    ids = torch.randint(0, 256, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    return capture_prefill_decode_graphs(model, ids, max_cache_len=CACHE_LEN)


@pytest.mark.parametrize("arch,kv_heads", [("gpt2", 4), ("llama", 2)])
@pytest.mark.parametrize("phase", [0, 1], ids=["prefill", "decode"])
def test_hf_eager_attention_and_cache_writes_are_found(arch, kv_heads, phase):
    graphs = _captured(arch, "eager")[phase]
    assert len(graphs) == 1
    gm = graphs[0]
    sites, unsupported = find_attention_sites(gm.graph)
    assert unsupported == [] and [s.layer for s in sites] == [0, 1]
    nodes = node_map(gm.graph)
    for s in sites:
        assert s.form == "softmax_qkv" and op_name(nodes[s.attention_node]) == "matmul"
        assert (s.num_heads, s.num_kv_heads, s.head_dim) == (4, kv_heads, 16)
        assert s.scale == pytest.approx(0.25)
        assert (s.rope is None) == (arch == "gpt2")
        for c in (s.k_cache, s.v_cache):
            assert c is not None and c.form == "index_copy_" and c.cache_shape == (1, kv_heads, CACHE_LEN, 16)
            assert nodes[c.write_node] < nodes[s.attention_node]
        # GPT-2's fused c_attn (Conv1D: addmm) projects Q, K and V at once
        assert s.k_proj is not None and s.v_proj is not None and s.o_proj is not None


def test_gpt2_eager_finds_what_sdpa_finds():
    """The same layers, heads and cache buffers as with attn_implementation='sdpa'."""
    for phase in (0, 1):
        (eager,), (sdpa,) = _captured("gpt2", "eager")[phase], _captured("gpt2", "sdpa")[phase]
        a, b = find_attention_sites(eager.graph)[0], find_attention_sites(sdpa.graph)[0]
        assert [(s.layer, s.num_heads, s.num_kv_heads, s.head_dim, s.k_cache.cache_source, s.v_cache.cache_source)
                for s in a] == [(s.layer, s.num_heads, s.num_kv_heads, s.head_dim, s.k_cache.cache_source,
                                 s.v_cache.cache_source) for s in b]
        assert {s.form for s in a} == {"softmax_qkv"} and {s.form for s in b} == {"sdpa"}


# ------------------------------------------------------------------------------------------------------------------
# cache writes that no understood attention reads: reported, never "no KV-cache write found"


def test_gpt2_reordered_baddbmm_attention_is_reported_with_its_cache_writes():
    """GPT-2's reorder_and_upcast_attn computes the scores with baddbmm (not matched): each layer's static-cache
    writes are reported as unrecognised_attention, and the plan says the layer is kept and why."""
    from ckvp_compile import CKVPConfig
    from ckvp_compile.analysis import analyze
    from ckvp_compile.plan import UNRECOGNISED_ATTENTION, make_plan

    model = build_hf_dense("gpt2", attn_implementation="eager", reorder_and_upcast_attn=True)
    ids = torch.randint(0, 256, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    pre, dec = capture_prefill_decode_graphs(model, ids, max_cache_len=CACHE_LEN)
    for (gm,) in (pre, dec):
        a = analyze(gm.graph)
        assert a.attention == ()
        assert [(u.kind, u.layer) for u in a.unsupported] == [("unrecognised_attention", 0),
                                                               ("unrecognised_attention", 1)]
        nodes = node_map(gm.graph)
        for u in a.unsupported:
            assert "KV-cache writes were found" in u.reason and "index_copy_ into" in u.reason
            assert [op_name(nodes[n]) for n in u.nodes] == ["index_copy_", "index_copy_"]
        plan = make_plan(a, CKVPConfig())
        assert [(d.kind, d.layer, d.rewrite, d.reason) for d in plan.decisions] == [
            ("attention", 0, False, UNRECOGNISED_ATTENTION), ("attention", 1, False, UNRECOGNISED_ATTENTION)]


class _TableKeyAttention(torch.nn.Module):
    """softmax(Q K^T) V over a static cache whose keys are multiplied by a position table before the write (a
    position-dependent transform that is not a recognised RoPE): the attention is found, its key path is not
    understood."""

    def __init__(self, d: int = 16, s_max: int = 8) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(d, d, bias=False) for _ in range(3))
        self.register_buffer("table", torch.randn(s_max, d))
        self.register_buffer("k_cache", torch.zeros(1, 1, s_max, d))
        self.register_buffer("v_cache", torch.zeros(1, 1, s_max, d))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        q, k, v = (p(x)[:, None] for p in (self.q, self.k, self.v))
        k = k * self.table[pos]
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        p = torch.softmax(q @ self.k_cache.transpose(-1, -2) * 0.25, dim=-1)
        return p @ self.v_cache


def test_attention_whose_key_path_is_not_understood_reports_why():
    from ckvp_compile.testing.decoding import capture_dynamo_graphs

    torch.manual_seed(0)
    (gm,) = capture_dynamo_graphs(_TableKeyAttention().eval(), torch.randn(1, 3, 16), torch.arange(3))
    sites, unsupported = find_attention_sites(gm.graph)
    assert sites == [] and [u.kind for u in unsupported] == ["unrecognised_attention"]
    (u,) = unsupported
    assert "reads the KV cache written by index_copy_ into" in u.reason
    assert "transformed by a table" in u.reason


def test_a_site_whose_values_are_not_traced_to_the_cache_says_so():
    """Keys read from a cache buffer, values through an op the trace does not follow (relu of the value cache): the
    decision names the untraced side instead of 'no KV-cache write found', and nothing is rewritten."""
    import torch.nn.functional as F

    from ckvp_compile import CKVPConfig, analyze, make_plan

    class HalfTraced(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("kc", torch.zeros(1, 2, 16, 8))
            self.register_buffer("vc", torch.zeros(1, 2, 16, 8))
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x, pos):
            b, s, _ = x.shape
            q, k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, -1))
            self.kc.index_copy_(2, pos, k)
            self.vc.index_copy_(2, pos, v)
            return F.scaled_dot_product_attention(q, self.kc, torch.relu(self.vc)).transpose(1, 2).reshape(b, s, 16)

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(HalfTraced(), backend=capture)(torch.randn(1, 3, 16), torch.arange(3))
    analysis = analyze(graphs[0])
    assert [(s.k_cache is not None, s.v_cache is not None) for s in analysis.attention] == [(True, False)]
    (decision,) = make_plan(analysis, CKVPConfig()).decisions
    assert not decision.rewrite
    assert decision.reason.startswith("the keys come from a cache write but the values were not traced"), decision
