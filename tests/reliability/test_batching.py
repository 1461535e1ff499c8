"""Batching: sequences of different lengths in one batch, left-padded as HF does it, each at its own positions.

(tests/e2e/test_latent_kv.py checks two Qwen2-MoE sequences one padding apart; here three Mixtral sequences with
0, 3 and 6 pad tokens, one of them a single real token, with grouped layers.) At full rank the latent cache must
give the dense StaticCache's logits at every generated step and the same tokens.
"""

from __future__ import annotations

import torch

from ckvp_compile.latent import calibrate
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import build_hf_moe

CACHE = 24


def test_left_padded_batch_of_three_lengths_equals_dense():
    from transformers import StaticCache

    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    bases = calibrate(model, [torch.randint(0, 256, (1, 12)) for _ in range(2)], group_size=2, kv_ratio=1.0,
                      progress=False)
    ids = torch.randint(1, 256, (3, 7))
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 3, 6)):  # lengths 7, 4 and 1
        ids[row, :pad], mask[row, :pad] = 0, 0

    def run(cache):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6, do_sample=False,
                                 disable_compile=True, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
        return out.sequences, torch.stack(out.logits)

    dense_seq, dense_logits = run(StaticCache(config=model.config, max_cache_len=CACHE))
    eager_forward = model.forward
    model.forward = torch.compile(eager_forward, backend="ckvp", options={"compiler": "aot_eager"}, fullgraph=True)
    try:
        cache = CKVPStaticCache(model.config, bases, max_cache_len=CACHE, max_batch_size=3)
        latent_seq, latent_logits = run(cache)
    finally:
        model.forward = eager_forward
    torch.testing.assert_close(latent_logits, dense_logits, rtol=2e-4, atol=2e-4)
    assert latent_seq.tolist() == dense_seq.tolist()
    pos = cache.store.slot_pos[:, :7]
    assert pos[0].tolist() == list(range(7))
    assert pos[1, 3:].tolist() == list(range(4)) and pos[2, 6:].tolist() == [0]
    # each row is also what it would be alone, unpadded (the padding changes nothing but the slots)
    with torch.no_grad():
        alone = model.generate(ids[2:, 6:], past_key_values=StaticCache(config=model.config, max_cache_len=CACHE),
                               max_new_tokens=6, do_sample=False, disable_compile=True, pad_token_id=0)
    assert latent_seq[2, 7:].tolist() == alone[0, 1:].tolist()
