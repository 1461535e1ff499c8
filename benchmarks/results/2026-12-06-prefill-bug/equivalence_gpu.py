"""check_equivalence on CUDA with the default Inductor compiler: the fixture model in bf16, a dense cache with the
expert GEMM rewrite (exact up to bf16 tolerance), and a 4x latent cache of calibrated bases (a bound).

Run from the repository root: PYTHONPATH=. python3 benchmarks/results/2026-12-06-prefill-bug/equivalence_gpu.py OUT.json [EXAMPLES]
(../2026-12-06-session-gpu/equivalence_gpu.py's check, with the expert GEMM rewrite on: the latent cache end to end
without transformers' grouped_mm experts under Inductor; then without it, the case that failed)
"""
import json
import sys
import time

import torch

from ckvp_compile.latent import calibrate
from ckvp_compile.testing import check_equivalence, load_fixture_model

out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
model = load_fixture_model().to("cuda", torch.bfloat16).eval()
text = open("models/tiny-mixtral-pystdlib/eval_text.txt", "rb").read()
samples = [torch.tensor([list(text[i * 256:(i + 1) * 256])], device="cuda") for i in range(8)]
bases = calibrate(model, samples, kv_ratio=4, progress=False)
for name, kw in (("dense, expert GEMM", dict(options={"enable_expert_gemm": True})),
                 ("latent 4x, expert GEMM, bound 2.0", dict(options={"enable_expert_gemm": True}, bases=bases,
                                                            max_logit_error=2.0)),
                 ("latent 4x, HF grouped_mm experts, bound 2.0", dict(bases=bases, max_logit_error=2.0))):
    t = time.time()
    r = check_equivalence(model, max_examples=int(sys.argv[2]) if len(sys.argv) > 2 else 3, max_batch=2, max_prompt_len=32, max_decode_steps=4, **kw)
    out[name] = {"report": r.to_text(), "passed": r.passed, "examples": r.examples,
                 "max_abs_error": r.max_abs_error, "wall_s": round(time.time() - t, 1)}
    print(r.to_text(), f"({time.time() - t:.0f} s)", flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)

