"""Rank each (layer group, KV head) key unit needs to keep 90 / 95 / 99 / 99.9% of its calibration energy, with
the key bases fitted before RoPE (pre_rope) and after (post_rope), on the fixture's 16 calibration windows of 512
tokens (the fidelity bench's calibration). Values do not depend on the key space (printed once for scale).

    PYTHONPATH=. python benchmarks/results/2026-12-03-post-rope-keys-cpu/key_spectra.py > key_spectra.txt

writes the per-unit ranks to key_spectra.json beside this file.
"""
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from ckvp_compile.bench.fidelity import DEFAULT_MODEL_DIR, _collect_moments, load_token_ids, split_windows

model = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL_DIR), dtype=torch.float32, attn_implementation="sdpa",
                                             local_files_only=True).eval()
windows = split_windows(load_token_ids(DEFAULT_MODEL_DIR / "eval_text.txt", model, DEFAULT_MODEL_DIR), 512)[:16]
FRACTIONS = (0.9, 0.95, 0.99, 0.999)
out = {}


def need(ev: torch.Tensor, f: float) -> int:
    c = ev.double().cumsum(0) / ev.double().sum()
    return int((c < f).sum()) + 1


for space in ("pre_rope", "post_rope"):
    mom = _collect_moments(model, windows, [1, 4], 4, False, key_space=space)
    for g in (1, 4):
        full = mom[g].bases(1.0, "uniform")
        for kind in ("k",) if space == "post_rope" else ("k", "v"):
            rows = {f: [need(ev[h], f) for ev in full.eigenvalues(kind) for h in range(ev.shape[0])] for f in FRACTIONS}
            n = full.eigenvalues(kind)[0].shape[1]
            trace = sum(float(ev.sum()) for ev in full.eigenvalues(kind))
            out[f"{kind}:{space}:G={g}"] = dict(coords=n, trace=trace, **{str(f): r for f, r in rows.items()})
            print(f"{kind} {space:9s} G={g} (unit of {n} coords, trace {trace:.1f}): " + "; ".join(
                f"{100 * f:g}%: mean {sum(r) / len(r):.1f} [{min(r)}-{max(r)}]" for f, r in rows.items()))
Path(__file__).with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
