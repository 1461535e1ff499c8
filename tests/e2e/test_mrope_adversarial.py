"""Multimodal RoPE (mrope) of the MoE vision-language families against the latent KV cache.

Qwen3-VL-MoE, GLM-4V-MoE, ERNIE-4.5-VL-MoE and Qwen3.5-MoE rotate keys by tables built from three position
streams (temporal, height, width: ``rope_parameters['mrope_section']`` gives each stream its share of the
frequencies), passed as position ids of shape (3, B, S), or (4, B, S) with the text positions first (what
``generate()`` builds). The latent store keeps one RoPE table row per position, shared by the batch
(``ckvp.rope_table_update``), so:

* text-only input with (B, S) position ids: the model expands them to three equal streams, mrope is plain RoPE, and
  the full-rank latent cache (``kv_ratio=1``, float latents) gives the dense model's logits over a prefill and
  decode steps;
* three streams that differ (an image in the prompt), given as (3, B, S) / (4, B, S): refused, naming mrope (it was
  refused as "RoPE positions not identified: ... a graph break before the layers" about the ``inv_freq`` buffer);
* the same tables reached from (B, S) positions shifted per sequence inside the graph (Qwen-VL's decode positions
  after an image, ``arange(...).expand(3, B, -1) + rope_deltas``): refused, naming mrope. It ran with the tables
  keyed by the wrong positions: logits off by up to 1.2 with no warning;
* with a dense cache the backend keeps the model's attention and says why.

Tiny random-weight models, no downloads; each VL family's ``ForConditionalGeneration`` is run on text only (its
vision tower is built, and not called), Qwen3.5-MoE's text ``ForCausalLM`` as it is. Conventions as in
``test_attention_architectures_adversarial.py``.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from ckvp_compile import CKVPBackend, CKVPConfig, CKVPError, CompileRecorder, UnsupportedPatternWarning
from ckvp_compile.latent import calibrate
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing.decoding import make_static_cache

CACHE = 32
PROMPT = 6
N_DECODE = 6
TOL = 2e-4  # fp32 full rank, as tests/e2e/test_attention_architectures_adversarial.py
MROPE = r"multimodal RoPE \(mrope"

#: text model shapes every tiny model shares (head_dim 16: 8 frequencies, mrope_section [4, 2, 2] or per family)
TEXT = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=32, max_position_embeddings=512, initializer_range=0.1,
            tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
#: token ids kept out of the prompts' range (0..199): the vision special tokens
SPECIAL = dict(image_token_id=250, video_token_id=251)


def _qwen3_vl_moe():
    """Qwen3-VL-MoE: interleaved mrope (``freqs_thw[..., 1:6:3] = freq[1, ..., 1:6:3]``, written in place)."""
    text = dict(TEXT, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2], mrope_interleaved=True))
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
                  deepstack_visual_indexes=[0], patch_size=4, num_position_embeddings=16)
    return "qwen3_vl_moe", dict(text_config=text, vision_config=vision, vision_start_token_id=252,
                                vision_end_token_id=253, **SPECIAL), "Qwen3VLMoeForConditionalGeneration"


def _glm4v_moe():
    """GLM-4V-MoE: sectioned mrope (``cat([m[i % 3] for m in freq.split(mrope_section)])``) on half the head dim
    (partial rotary), q/k/v biases, a shared expert."""
    text = dict(TEXT, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                first_k_dense_replace=0, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                              mrope_section=[2, 1, 1], partial_rotary_factor=0.5))
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64, patch_size=4,
                  image_size=16)
    return "glm4v_moe", dict(text_config=text, vision_config=vision, image_start_token_id=252,
                             image_end_token_id=253, video_start_token_id=254, video_end_token_id=255,
                             **SPECIAL), "Glm4vMoeForConditionalGeneration"


def _ernie4_5_vl_moe():
    """ERNIE-4.5-VL-MoE: GPT-J style (interleaved pairs) mrope, h / w interleaved then t (``repeat_interleave``),
    text and vision experts."""
    text = dict(TEXT, moe_intermediate_size=[32, 32], moe_num_experts=4, moe_k=2, moe_num_shared_experts=1,
                mlp_layer_types=["sparse", "sparse"], rope_parameters=dict(
                    rope_type="default", rope_theta=10000.0, mrope_section=[2, 2, 4]))
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, patch_size=4)
    return "ernie4_5_vl_moe", dict(text_config=text, vision_config=vision, image_start_token_id=252,
                                   image_end_token_id=253, video_start_token_id=254, video_end_token_id=255,
                                   **SPECIAL), "Ernie4_5_VLMoeForConditionalGeneration"


def _qwen3_5_moe():
    """Qwen3.5-MoE's text model (a ForCausalLM): interleaved mrope on half the head dim (partial rotary), a gated
    attention output; every layer full attention (its default mixes in linear-attention layers, which keep no KV
    cache)."""
    text = dict(TEXT, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                num_experts_per_tok=2, layer_types=["full_attention"] * 2, rope_parameters=dict(
                    rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1], mrope_interleaved=True,
                    partial_rotary_factor=0.5))
    return "qwen3_5_moe_text", text, "Qwen3_5MoeForCausalLM"


FAMILIES = {"qwen3_vl_moe": _qwen3_vl_moe, "glm4v_moe": _glm4v_moe, "ernie4_5_vl_moe": _ernie4_5_vl_moe,
            "qwen3_5_moe": _qwen3_5_moe}


def _build(family: str):
    """The tiny random ``family`` model (seed 0, eval, fp32, SDPA): its ForConditionalGeneration, or the text model's
    ForCausalLM; skipped where the installed transformers lacks it (5.17 has no GLM-4V-MoE, ERNIE-4.5-VL-MoE or
    Qwen3.5-MoE)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip(f"transformers.models.{family}")
    model_type, kwargs, cls_name = FAMILIES[family]()
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    config = transformers.AutoConfig.for_model(model_type, **{"tie_word_embeddings": False, **kwargs})
    torch.manual_seed(0)
    return cls._from_config(config, attn_implementation="sdpa").eval()


#: the prompts' (3, S) position streams, per sequence: a 2x2-patch image (temporal position fixed, height and width
#: over the grid, from the image's start position) after two text tokens / after one, then text after the image's
#: largest position, as Qwen-VL's ``get_rope_index`` lays them out
PROMPT_STREAMS = torch.tensor([
    [[0, 1, 2, 2, 2, 2], [0, 1, 2, 2, 3, 3], [0, 1, 2, 3, 2, 3]],
    [[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]],
])


def _positions(kind: str, batch: int, start: int, n: int) -> torch.Tensor:
    """Position ids of ``n`` tokens from ``start`` (``n == PROMPT`` when ``start`` is 0).

    ``"text"``: (B, S), one stream. ``"3"``: (3, B, S), streams that differ (:data:`PROMPT_STREAMS`), each continued
    after the prompt from its largest position + 1, in every stream. ``"4"``: the same with the text positions first,
    (4, B, S), as ``generate()`` passes them.
    """
    text = torch.arange(start, start + n)[None].repeat(batch, 1)
    if kind == "text":
        return text
    prompt = PROMPT_STREAMS[:batch].transpose(0, 1)  # (3, B, PROMPT)
    if start == 0:
        streams = prompt[..., :n]
    else:
        shift = prompt.amax(dim=(0, 2)) + 1 - PROMPT  # (B,): the next position after the prompt, at index PROMPT
        streams = (text + shift[:, None])[None].expand(3, -1, -1)
    return streams if kind == "3" else torch.cat([text[None], streams])


def _cache_kw(model) -> str:
    """The cache argument's name: ``cache`` (transformers >= 5.24), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _run(step, cache, ids: torch.Tensor, kind: str, teacher: list[torch.Tensor] | None = None):
    """Prefill ``ids`` then N_DECODE steps through ``step``, every call with explicit ``kind`` positions; each step
    feeds ``teacher``'s argmax token (the dense run's), or its own."""
    outs: list[torch.Tensor] = []
    b = ids.shape[0]
    kw = {_cache_kw(getattr(step, "_orig_mod", step)): cache, "use_cache": True}
    with torch.no_grad():
        outs.append(step(input_ids=ids, position_ids=_positions(kind, b, 0, PROMPT), **kw).logits)
        for i in range(N_DECODE):
            tok = (teacher or outs)[i][:, -1:].argmax(-1)
            outs.append(step(input_ids=tok, position_ids=_positions(kind, b, PROMPT + i, 1), **kw).logits)
    return outs


def _bases(model):
    samples = [torch.randint(0, 200, (1, 20), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    return calibrate(model, samples, group_size=2, kv_ratio=1.0, progress=False)


def _latent_step(model, bases, batch: int, rec: CompileRecorder | None = None, module=None):
    """``module`` (default ``model``) compiled with the ckvp backend (aot_eager), and a full-rank latent cache."""
    torch._dynamo.reset()
    cache = CKVPStaticCache(model.config, bases, max_cache_len=CACHE, max_batch_size=batch)
    backend = CKVPBackend(CKVPConfig(compiler="aot_eager"), recorder=rec)
    return torch.compile(module if module is not None else model, backend=backend), cache


def _prompt(batch: int) -> torch.Tensor:
    return torch.randint(0, 200, (batch, PROMPT), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_mrope_text_only_positions_full_rank_equal_dense(family):
    """(B, S) position ids (text only): the three streams are equal and mrope is plain RoPE; the full-rank latent
    cache gives the dense logits over a prefill and decode steps, and it really is the latent store that does."""
    model = _build(family)
    ids = _prompt(2)
    dense = _run(model, make_static_cache(model, CACHE), ids, "text")
    rec = CompileRecorder()
    step, cache = _latent_step(model, _bases(model), 2, rec)
    latent = _run(step, cache, ids, "text", dense)
    for i, (a, b) in enumerate(zip(latent, dense)):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL, msg=lambda m: f"step {i}: {m}")
    assert rec.graphs and all("ckvp.latent_append.default(" in g.dynamo_after for g in rec.graphs)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("streams", ["3", "4"])
def test_mrope_position_streams_that_differ_are_refused_naming_mrope(family, streams):
    """Regression: (3, B, S) or (4, B, S) position ids whose streams differ (an image in the prompt) were refused as
    "RoPE positions not identified: the cos / sin tables come from the graph input ..._inv_freq_, computed in an
    earlier graph (a graph break before the layers ...)": a buffer every RoPE reads, and no graph break. The refusal
    now names multimodal RoPE, the position ids and the fix; the dense model still runs afterwards."""
    model = _build(family)
    ids = _prompt(2)
    dense = _run(model, make_static_cache(model, CACHE), ids, streams)
    step, cache = _latent_step(model, _bases(model), 2)
    with pytest.raises(CKVPError, match=MROPE + r".*position_ids of shape \(B, S\)"):
        _run(step, cache, ids, streams, dense)
    torch._dynamo.reset()
    again = _run(model, make_static_cache(model, CACHE), ids, streams)
    for a, b in zip(again, dense):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _ShiftedPositions(torch.nn.Module):
    """``model`` fed Qwen-VL's decode positions after an image, computed in the graph as transformers does
    (``Qwen3VLMoeModel.compute_3d_position_ids``): the text positions (B, S) expanded to the three streams and
    shifted by each sequence's ``rope_deltas`` (B, 1)."""

    def __init__(self, model: torch.nn.Module, rope_deltas: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.rope_deltas = rope_deltas

    def forward(self, input_ids, position_ids, cache, use_cache=True):
        streams = position_ids[None].expand(3, -1, -1) + self.rope_deltas
        return self.model(input_ids=input_ids, position_ids=streams, use_cache=use_cache,
                          **{_cache_kw(self.model): cache})


def test_mrope_positions_shifted_per_sequence_in_the_graph_are_refused_not_wrong():
    """Regression (wrong numbers, no warning): (B, S) positions shifted per sequence inside the graph reach the
    tables as three streams. The rewrite keyed the store's tables by the nearest (B, S) integer tensor above them:
    in the prefill the unshifted positions (both sequences wrote the same rows, with different tables), in a decode
    step (S = 1) the (B, 1) shifts themselves (every step wrote rows 0 and 3). Logits were off by up to 1.2 from
    the first decode step. Now refused, naming mrope and the shift's input."""
    model = _build("qwen3_vl_moe")
    ids = _prompt(2)
    shifted = _ShiftedPositions(model, torch.tensor([[0], [3]]))
    dense = _run(shifted, make_static_cache(model, CACHE), ids, "text")
    step, cache = _latent_step(model, _bases(model), 2, module=shifted)
    with pytest.raises(CKVPError, match=MROPE + r".*rope_deltas"):
        _run(step, cache, ids, "text", dense)


def test_mrope_streams_with_a_dense_cache_keep_the_attention_and_say_why():
    """With a dense StaticCache the backend keeps the model's attention for (4, B, S) position ids: the logits are
    eager's, and a warning per graph names mrope and the fix (before, nothing was said: a latent cache then failed
    with a reason about a graph break)."""
    model = _build("qwen3_vl_moe")
    ids = _prompt(1)
    dense = _run(model, make_static_cache(model, CACHE), ids, "4")
    torch._dynamo.reset()
    step = torch.compile(model, backend=CKVPBackend(CKVPConfig(compiler="aot_eager")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _run(step, make_static_cache(model, CACHE), ids, "4")
    messages = [str(w.message) for w in caught if issubclass(w.category, UnsupportedPatternWarning)]
    assert any("mrope" in m and "position_ids of shape (B, S)" in m for m in messages), messages
    for a, b in zip(out, dense):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_rope_table_keys_grow_with_the_computation_not_exponentially_with_its_depth():
    """Regression (compile time): ``table_key`` froze each argument's key again at every level, so a key grew about
    2.6 times per producer hop; Qwen3-VL-MoE's 16-hop mrope tables took about 30 s per graph to compare (a tiny model
    compiled its prefill in 36 s, now in about 1 s)."""
    import torch.fx as fx

    from ckvp_compile.analysis.rope import table_key

    graph = fx.Graph()
    node = graph.placeholder("x")
    for i in range(14):
        node = graph.call_function(torch.mul, (node, 1.0 + i))

    def size(key) -> int:
        inner = getattr(key, "key", key)
        return 1 + sum(size(v) for v in inner) if isinstance(inner, tuple) else 1

    assert size(table_key(node)) < 500
    assert table_key(node) == table_key(node, _memo={}) and hash(table_key(node)) == hash(table_key(node, _memo={}))
