"""Layer numbering of attention and MoE sites: nested module paths, several models, unnumbered graphs, and
top-k sampling over vocabulary logits (not a router)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from ckvp_compile.analysis import UNNUMBERED_NOTE, analyze
from ckvp_compile.analysis.graph import assign_layer_indices, layer_prefix
from ckvp_compile.analysis.moe import find_moe_sites
from ckvp_compile.errors import UnsupportedGraphError
from ckvp_compile.testing import GptFastConfig, GptFastMoE, capture_dynamo_graphs

TOKENS = torch.tensor([[1, 2, 3]])
SMALL = dict(dim=32, n_head=2, n_local_heads=1, head_dim=16, intermediate_size=16, block_size=32)


def _one(graphs):
    assert len(graphs) == 1, f"expected one graph, got {len(graphs)}"
    return graphs[0]


def _sites(a):
    return ([(s.layer, s.module_path) for s in a.attention], [(s.layer, s.module_path) for s in a.moe])


# ---------------------------------------------------------------------------------------------- the helpers


@pytest.mark.parametrize("path, prefix", [
    ("model.layers.3.self_attn", "model.layers.3"),
    ("stages.1.layers.0.attn", "stages.1.layers.0"),
    ("G.models.1.layers.0.block_sparse_moe", "G.models.1.layers.0"),
    ("h.12", "h.12"),
    ("0.attn", "0"),
    ("blocks.b0.attention", None),
    ("lm_head", None),
    ("", None),
])
def test_layer_prefix_is_up_to_the_last_integer(path, prefix):
    assert layer_prefix(path) == prefix


def test_assign_layer_indices():
    a, m = "attention", "moe"
    # one stem: the integers themselves, in any order, attention and MoE of a layer agree
    assert assign_layer_indices([(0, "model.layers.2", a), (1, "model.layers.2", m), (2, "model.layers.0", a)]) \
        == [2, 2, 0]
    # nested stems (stages.<s>.layers.<j>): distinct prefixes numbered in graph order, no collisions
    items = [(0, "stages.0.layers.0", a), (1, "stages.0.layers.0", m), (2, "stages.0.layers.1", a),
             (3, "stages.1.layers.0", a), (4, "stages.1.layers.0", m), (5, "stages.1.layers.1", a)]
    assert assign_layer_indices(items) == [0, 0, 1, 2, 2, 3]
    # no prefixes: per kind in graph order
    assert assign_layer_indices([(0, None, a), (1, None, m), (2, None, a), (3, None, m)]) == [0, 0, 1, 1]
    # unnumbered items take the integers not used by numbered ones
    assert assign_layer_indices([(0, "layers.0", a), (1, None, a), (2, "layers.2", a)]) == [0, 1, 2]
    assert assign_layer_indices([(0, "layers.0", a), (1, None, a), (2, "layers.1", a)]) == [0, 2, 1]
    assert assign_layer_indices([]) == []


# ---------------------------------------------------------------------------------------------- real graphs


class _Stages(GptFastMoE):
    """gpt-fast MoE whose 4 layers sit in 2 stages of 2: ``stages.<s>.layers.<j>``."""

    def __init__(self, cfg):
        super().__init__(cfg)
        layers = list(self.layers)
        self.stages = nn.ModuleList([nn.Module(), nn.Module()])
        self.stages[0].layers = nn.ModuleList(layers[:2])
        self.stages[1].layers = nn.ModuleList(layers[2:])

    def forward(self, idx, input_pos):
        mask = self.causal_mask[None, None, input_pos, : self.max_seq_length]
        rope = (self.freqs_cis[input_pos],)
        x = self.tok_embeddings(idx)
        for stage in self.stages:
            for layer in stage.layers:
                x = layer(x, rope, mask, input_pos, True)
        return self.output(self.norm(x))


def test_nested_layer_paths_do_not_collide():
    """stages.1.layers.0 and stages.0.layers.1 used to both be layer 0/1 (first integer of the path)."""
    model = _Stages(GptFastConfig(n_layer=4, **SMALL)).eval()
    model.setup_caches(1, 32)
    a = analyze(_one(capture_dynamo_graphs(model, TOKENS, torch.arange(3))))
    attention, moe = _sites(a)
    assert [layer for layer, _ in attention] == [0, 1, 2, 3]
    assert [layer for layer, _ in moe] == [0, 1, 2, 3]
    assert attention[2][1] == "stages.1.layers.0.attention" and moe[2][1] == "stages.1.layers.0.block_sparse_moe"
    assert a.notes == ()


def test_a_function_calling_two_models():
    """models[0] and models[1] (draft and target, an ensemble): four distinct layers, not two."""
    torch.manual_seed(1)
    models = [GptFastMoE(GptFastConfig(n_layer=2, **SMALL)).eval() for _ in range(2)]
    for m in models:
        m.setup_caches(1, 32)

    def both(idx, pos):
        return models[0](idx, pos) + models[1](idx, pos)

    a = analyze(_one(capture_dynamo_graphs(both, TOKENS, torch.arange(3))))
    attention, moe = _sites(a)
    assert [layer for layer, _ in attention] == [0, 1, 2, 3] == [layer for layer, _ in moe]
    assert [p.split(".layers.")[0][-8:] for _, p in attention] == ["models.0", "models.0", "models.1", "models.1"]
    assert len({s.k_cache.cache_source for s in a.attention}) == 4


def test_compiled_submodule_gets_a_note():
    """One TransformerBlock compiled on its own: no layer number in any path, so the graph says so."""
    model = GptFastMoE(GptFastConfig(n_layer=2, **SMALL)).eval()
    model.setup_caches(1, 32)
    pos = torch.arange(3)
    mask = model.causal_mask[None, None, pos, : model.max_seq_length]
    x = model.tok_embeddings(TOKENS)
    block = model.layers[1]
    a = analyze(_one(capture_dynamo_graphs(block, x, (model.freqs_cis[pos],), mask, pos, True)))
    assert _sites(a) == ([(0, "attention")], [(0, "block_sparse_moe")])  # the sites themselves are unchanged
    assert a.notes == (UNNUMBERED_NOTE,)
    assert "graph may be reused for several layers" in UNNUMBERED_NOTE


# ---------------------------------------------------------------------------------------------- sampling top-k


class _TinyLM(nn.Module):
    """A dense LM (no MoE at all); V = 256."""

    def __init__(self, vocab=256, dim=32, numbered=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([nn.Linear(dim, dim)]) if numbered else None
        self.mlp = None if numbered else nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab)

    def body(self, h):
        h = torch.relu(self.layers[0](h)) if self.layers is not None else torch.relu(self.mlp(h))
        return self.lm_head(h)

    def forward(self, ids):
        return self.body(self.emb(ids))


def _sampler(lm, embeds=False):
    def sample_topk(x):
        logits = (lm.body(x) if embeds else lm(x))[:, -1]
        probs = torch.softmax(logits, dim=-1)
        return torch.topk(probs, 8, dim=-1)  # candidates for top-k sampling

    return sample_topk


def test_sampling_topk_over_vocabulary_is_not_a_router():
    """softmax + topk over the LM head's logits (E = V = 256 <= 1024) is sampling, not an MoE graph break."""
    fn = _sampler(_TinyLM().eval())
    assert find_moe_sites(_one(capture_dynamo_graphs(fn, TOKENS)).graph) == ([], [])
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(fn, backend="ckvp", options={"compiler": "eager"})(TOKENS)
    assert not [w for w in caught if "ckvp" in str(w.message)]
    torch._dynamo.reset()
    torch.compile(fn, backend="ckvp", options={"compiler": "eager", "strict": True})(TOKENS)  # no error


def test_sampling_topk_outside_numbered_layers_is_not_a_router():
    """No embedding in the graph (embeddings passed in), but the model has numbered layers and the LM head is
    outside them: not a router either."""
    fn = _sampler(_TinyLM(numbered=True).eval(), embeds=True)
    assert find_moe_sites(_one(capture_dynamo_graphs(fn, torch.randn(1, 3, 32))).graph) == ([], [])


def test_router_without_experts_still_reported_in_a_numbered_layer():
    """The eager-experts graph break is still found: a router inside layers.<i> whose indices leave the graph."""

    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(32, 8)

        def forward(self, x):
            return torch.topk(torch.softmax(self.gate(x), dim=-1), 2, dim=-1)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(256, 32)
            self.layers = nn.ModuleList([Router()])

        def forward(self, ids):
            return self.layers[0](self.emb(ids))

    sites, unsupported = find_moe_sites(_one(capture_dynamo_graphs(Model().eval(), TOKENS)).graph)
    assert sites == [] and [(u.kind, u.layer) for u in unsupported] == [("eager_loop_graph_break", 0)]


def test_strict_sampling_does_not_raise():
    fn = _sampler(_TinyLM().eval())
    try:
        torch.compile(fn, backend="ckvp", options={"compiler": "eager", "strict": True})(TOKENS)
    except UnsupportedGraphError as exc:  # pragma: no cover - the failure being tested
        pytest.fail(f"strict=True refused a dense sampling step: {exc}")
