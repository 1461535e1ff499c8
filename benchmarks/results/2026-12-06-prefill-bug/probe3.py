"""Probe 3: is the corruption in transformers' grouped_mm experts under Inductor? The fixture prefill under
backend="ckvp" with and without the expert GEMM rewrite (ckvp::moe_experts replaces HF's sort / histc /
torch._grouped_mm experts), dense cache, repeated shapes. Run: PYTHONPATH=. python3 <this> OUT.json"""
import json
import sys

import torch

from ckvp_compile.latent.capture import make_static_cache
from ckvp_compile.testing import load_fixture_model, prefill_decode_logits

model = load_fixture_model().to("cuda", torch.bfloat16).eval()
text = open("models/tiny-mixtral-pystdlib/eval_text.txt", "rb").read()
rows = []
for opts in ({"enable_expert_gemm": True}, {}, {"enable_expert_gemm": True}, {}):
    for b, s in ((2, 4), (2, 8), (1, 4), (2, 16)):
        ids = torch.tensor([list(text[5000 + 97 * i: 5000 + 97 * i + s]) for i in range(b)], device="cuda")
        want = prefill_decode_logits(model, ids, 0, max_cache_len=s + 1)[0].float()
        torch._dynamo.reset()
        comp = torch.compile(model, backend="ckvp", options=opts)
        got = prefill_decode_logits(model, ids, 0, compile_fn=lambda m: comp, max_cache_len=s + 1)[0].float()
        rows.append(dict(opts=opts, b=b, s=s, err=(got - want).abs().max().item()))
        print(rows[-1], flush=True)
        json.dump(rows, open(sys.argv[1], "w"), indent=1)
