"""Diagnose check_equivalence's dense bf16 failure of run2 (batch 3, prompt length 9, prefill): is ckvp's output
further from the float32 model than bf16 eager and plain Inductor are, and do the routers' top-k choices of the
failing token sit on a near-tie?

Run from the repository root: PYTHONPATH=. python3 benchmarks/results/2026-12-07-gpu/bf16_failure_diag.py OUT.json
"""
import json
import os
import sys

import torch

from ckvp_compile.testing import load_fixture_model
from ckvp_compile.testing.decoding import prefill_decode_logits

# PROMPT (JSON list of rows) and TOKEN ("b,s") from the environment; the default is run2's failing prompt
ids = torch.tensor(json.loads(os.environ.get("PROMPT", "[[0,0,0,0,0,0,0,0,0],[0,0,0,0,0,0,0,0,0],[1,30,0,0,0,0,0,0,0]]")),
                   device="cuda")
tok_b, tok_s = map(int, os.environ.get("TOKEN", "2,4").split(","))
ref = load_fixture_model().to("cuda").eval()  # float32
bf = load_fixture_model().to("cuda", torch.bfloat16).eval()
out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "prompt": ids.tolist(), "token": [tok_b, tok_s]}

# router logits of every layer (float32 model and bf16 eager): the top-2 gap (2nd - 3rd) at each token
gaps = {}
for name, m in (("fp32", ref), ("bf16", bf)):
    rl = []
    hooks = [blk.mlp.gate.register_forward_hook(lambda mod, a, o: rl.append(a[0].float() @ mod.weight.float().t()))
             for blk in m.model.layers]
    with torch.no_grad():
        m(ids)
    for h in hooks:
        h.remove()
    gaps[name] = rl
picks = []
for layer, (a, b) in enumerate(zip(gaps["fp32"], gaps["bf16"])):
    ta, tb = a.topk(3, -1), b.topk(3, -1)
    gap = (ta.values[:, 1] - ta.values[:, 2]).view(*ids.shape)
    picks.append({"layer": layer, "min_gap_fp32": gap.min().item(), "gap_at_token": gap[tok_b, tok_s].item(),
                  "top2_differs_fp32_vs_bf16": int((ta.indices[:, :2].sort(-1).values
                                                    != tb.indices[:, :2].sort(-1).values).any(-1).sum())})
out["routers"] = picks
print("routers:", picks, flush=True)

want = prefill_decode_logits(ref, ids, 0, max_cache_len=ids.shape[1])[0].float()
runs = {"bf16 eager": lambda m: m}
runs["ckvp default (inductor, expert GEMM)"] = lambda m: torch.compile(m, backend="ckvp")
runs["ckvp enable_expert_gemm=False"] = lambda m: torch.compile(m, backend="ckvp",
                                                                options={"enable_expert_gemm": False})
runs["plain inductor"] = lambda m: torch.compile(m)
runs["ckvp aot_eager (expert GEMM)"] = lambda m: torch.compile(m, backend="ckvp",
                                                              options={"compiler": "aot_eager",
                                                                       "enable_expert_gemm": True})
res = {}
eager_bf = None
for name, fn in runs.items():
    torch._dynamo.reset()
    got = prefill_decode_logits(bf, ids, 0, max_cache_len=ids.shape[1], compile_fn=fn)[0].float()
    if eager_bf is None:
        eager_bf = got
    res[name] = {"max_abs_vs_fp32": (got - want).abs().max().item(),
                 "max_abs_vs_fp32_at_token": (got[tok_b, tok_s] - want[tok_b, tok_s]).abs().max().item(),
                 "max_abs_vs_bf16_eager": (got - eager_bf).abs().max().item(),
                 "argmax_agrees_fp32": float((got.argmax(-1) == want.argmax(-1)).float().mean())}
    print(name, res[name], flush=True)
out["logits"] = res
json.dump(out, open(sys.argv[1], "w"), indent=1)
