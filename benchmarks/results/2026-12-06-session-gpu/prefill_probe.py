"""Probe of check_equivalence's GPU finding: a 4x latent cache's *prefill* logits of 1-token prompts at batch 2
differ from dense by 2.65 (CUDA, Inductor). Per (compiler, B, S): max |compiled - eager| of the prefill logits and
of one decode step (teacher-forced), fixture in bf16, the same bases for every row.

Run: PYTHONPATH=. python3 benchmarks/results/2026-12-06-session-gpu/prefill_probe.py OUT.json (DENSE=1: a dense
cache instead, to see whether Inductor alone, without the latent rewrite, shows it; not run yet)
"""
import json
import os
import sys

import torch

from ckvp_compile.latent import calibrate
from ckvp_compile.testing import load_fixture_model
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.latent.capture import make_static_cache
from ckvp_compile.testing import prefill_decode_logits


def _run(model, fn, ids, steps, tokens, cache):
    """Prefill + ``steps`` decode calls through ``fn`` (teacher-forced by ``tokens``): float logits and the argmax
    tokens (the driver the runs used, since folded into testing.prefill_decode_logits)."""
    outs = [x.float() for x in prefill_decode_logits(model, ids, steps, compile_fn=lambda m: fn,
                                                     max_cache_len=ids.shape[1] + 1, tokens=tokens, cache=cache)]
    return outs, [o[:, -1].argmax(dim=-1, keepdim=True) for o in outs[:-1]]


model = load_fixture_model().to("cuda", torch.bfloat16).eval()
text = open("models/tiny-mixtral-pystdlib/eval_text.txt", "rb").read()
samples = [torch.tensor([list(text[i * 256:(i + 1) * 256])], device="cuda") for i in range(8)]
bases = calibrate(model, samples, kv_ratio=4, progress=False)
rows = []
DENSE = os.environ.get("DENSE") == "1"
for compiler in ("inductor", "aot_eager"):
    for b, s in ((1, 1), (2, 1), (2, 2), (1, 4), (2, 4), (2, 16)):
        ids = torch.tensor([list(text[5000 + 97 * i: 5000 + 97 * i + s]) for i in range(b)], device="cuda")
        ids[0, 0] = 0
        want, fed = _run(model, model, ids, 1, None, make_static_cache(model, s + 1))
        torch._dynamo.reset()
        comp = torch.compile(model, backend="ckvp", options={"compiler": compiler})
        cache = (make_static_cache(model, s + 1) if DENSE else  # DENSE=1: the same rows with a dense cache
                 CKVPStaticCache(model.config, bases, max_cache_len=s + 1, max_batch_size=b, device="cuda",
                                 dtype=torch.bfloat16))
        try:
            got, _ = _run(model, comp, ids, 1, fed, cache)
            errs = [round((g - w).abs().max().item(), 4) for g, w in zip(got, want)]
            per_seq = [round((got[0][i] - want[0][i]).abs().max().item(), 4) for i in range(b)]
            row = dict(compiler=compiler, b=b, s=s, prefill=errs[0], step1=errs[1], prefill_per_seq=per_seq)
        except Exception as exc:  # noqa: BLE001
            row = dict(compiler=compiler, b=b, s=s, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        print(row, flush=True)
        rows.append(row)
torch._dynamo.reset()
json.dump(dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(0), rows=rows), open(sys.argv[1], "w"),
          indent=1)
