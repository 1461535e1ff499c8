"""A reproducer for PyTorch / transformers, without ckvp: transformers' grouped_mm experts (sort, histc,
torch._grouped_mm) compiled by Inductor for CUDA give wrong prefill logits (../2026-12-06-prefill-bug: wrong, run to
run different, sometimes NaN, at prefills of 2-32 tokens). Only torch and transformers are imported; the model is the
repository's trained fixture (models/tiny-mixtral-pystdlib, a small Mixtral) in bf16 with a StaticCache.

For each shape and round: eager logits against torch.compile(model) (Inductor, default mode), the largest |difference|
(bf16 noise here is about 0.2); then the same with experts_implementation="eager" (HF's loop) for contrast.

Run from the repository root: python3 benchmarks/results/2026-12-07-gpu/upstream_repro.py OUT.json
"""
import json
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, StaticCache

MODEL = "models/tiny-mixtral-pystdlib"
SHAPES = ((2, 4), (2, 8), (1, 4), (2, 16), (3, 8))
out = {"torch": torch.__version__, "transformers": transformers.__version__, "gpu": torch.cuda.get_device_name(0)}
text = open(f"{MODEL}/eval_text.txt", "rb").read()


def logits(model, fn, ids):
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 1)
    pos = torch.arange(ids.shape[1], device=ids.device)
    with torch.no_grad():
        return fn(input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True).logits.float()


model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16).cuda().eval()
for impl in ("grouped_mm", "eager"):
    model.set_experts_implementation(impl)
    rows = []
    for rnd in range(2):
        for b, s in SHAPES:
            torch._dynamo.reset()
            ids = torch.tensor([list(text[5000 + 97 * i: 5000 + 97 * i + s]) for i in range(b)], device="cuda")
            want = logits(model, model, ids)
            got = logits(model, torch.compile(model), ids)
            d = (got - want).abs().max().item()
            rows.append({"round": rnd, "batch": b, "tokens": s, "max_abs_diff": d, "nan": bool(got.isnan().any())})
            print(impl, rows[-1], flush=True)
    out[impl] = rows
    json.dump(out, open(sys.argv[1], "w"), indent=1)
