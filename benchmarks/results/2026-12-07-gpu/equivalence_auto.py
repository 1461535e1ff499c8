"""check_equivalence on CUDA with the default options (enable_expert_gemm='auto': ckvp's expert GEMM replaces
transformers' grouped_mm experts in graphs on CUDA): the fixture model in bf16, Inductor, a dense cache (exact up to
bf16 rounding) and a 4x latent cache of calibrated bases (a bound of 4 logits); then enable_expert_gemm=False (the upstream bug
of ../2026-12-06-prefill-bug, expected to fail, with the backend's CKVPWarning).

Run from the repository root: PYTHONPATH=. python3 benchmarks/results/2026-12-07-gpu/equivalence_auto.py OUT.json [EXAMPLES]
[CASES: comma-separated indices of the cases below, default all]
"""
import json
import sys
import time
import warnings

import torch

from ckvp_compile.errors import CKVPWarning
from ckvp_compile.latent import calibrate
from ckvp_compile.testing import check_equivalence, load_fixture_model

import ckvp_compile.testing.equivalence as _eq

_run = _eq.prefill_decode_logits


def _timed(model, ids, n, **kw):  # one line per run of an example: which, its sizes, seconds (where the time goes)
    t = time.time()
    try:
        return _run(model, ids, n, **kw)
    finally:
        which = "compiled" if kw.get("compile_fn") else "eager"
        print(f"  {which} B={ids.shape[0]} S={ids.shape[1]} N={n}: {time.time() - t:.1f} s", flush=True)


_eq.prefill_decode_logits = _timed
examples = int(sys.argv[2]) if len(sys.argv) > 2 else 4
out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "examples": examples}
model = load_fixture_model().to("cuda", torch.bfloat16).eval()
text = open("models/tiny-mixtral-pystdlib/eval_text.txt", "rb").read()
samples = [torch.tensor([list(text[i * 256:(i + 1) * 256])], device="cuda") for i in range(8)]
t0 = time.time()
bases = calibrate(model, samples, kv_ratio=4, progress=False)
print(f"calibrated in {time.time() - t0:.0f} s", flush=True)
cases = (("dense, default options", {}),
         # (bound 4: on CPU, torch 2.13, aot_eager, the same draws reach 2.12 on random prompts; no shrinking, which
         # at Inductor's compile time per example ran past the call's limit on the H100)
         ("latent 4x, default options, bound 4.0", dict(bases=bases, max_logit_error=4.0, shrink=False)),
         ("dense, enable_expert_gemm=False", dict(options={"enable_expert_gemm": False}, shrink=False)))
only = sys.argv[3].split(",") if len(sys.argv) > 3 else None  # e.g. "1" runs the latent case only
for i, (name, kw) in enumerate(cases):
    if only is not None and str(i) not in only:
        continue
    t = time.time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = check_equivalence(model, max_examples=examples, max_batch=3, max_prompt_len=32, max_decode_steps=4, **kw)
    risk = sorted({str(w.message)[:90] for w in caught if issubclass(w.category, CKVPWarning)
                   and "grouped_mm experts" in str(w.message)})
    out[name] = {"report": r.to_text(), "passed": r.passed, "examples": r.examples, "max_abs_error": r.max_abs_error,
                 "grouped_mm_warning": risk, "wall_s": round(time.time() - t, 1)}
    print(name, "|", r.to_text(), "| grouped_mm warning:", risk, f"({time.time() - t:.0f} s)", flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
