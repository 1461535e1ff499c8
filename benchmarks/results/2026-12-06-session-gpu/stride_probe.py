"""Probe 2 of the B=2, S>=2 prefill mismatch under Inductor (prefill_probe.json): every ckvp::latent_attention
call's Triton result against the reference on the same tensors, with the tensors' shapes and strides.

Run: PYTHONPATH=. python3 benchmarks/results/2026-12-06-session-gpu/stride_probe.py OUT.json
"""
import json
import sys

import torch

import ckvp_compile.ops.latent_attention_cuda as cuda_ops
from ckvp_compile.kernels import reference as ref
from ckvp_compile.latent import calibrate
from ckvp_compile.latent.capture import make_static_cache
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import load_fixture_model
from ckvp_compile.testing import prefill_decode_logits


def _run(model, fn, ids, steps, tokens, cache):
    """Prefill + ``steps`` decode calls through ``fn`` (teacher-forced by ``tokens``): float logits and the argmax
    tokens (the driver the runs used, since folded into testing.prefill_decode_logits)."""
    outs = [x.float() for x in prefill_decode_logits(model, ids, steps, compile_fn=lambda m: fn,
                                                     max_cache_len=ids.shape[1] + 1, tokens=tokens, cache=cache)]
    return outs, [o[:, -1].argmax(dim=-1, keepdim=True) for o in outs[:-1]]


calls = []
triton_fn = cuda_ops.latent_attention_triton


def recording(*args, page_table=None):
    out = triton_fn(*args, page_table=page_table)
    want = ref.latent_attention_ref(*args, page_table)
    names = ("q", "latent_k", "latent_v", "basis_k_block", "basis_v_block", "k_offsets", "v_offsets", "cos_table",
             "sin_table", "slot_pos", "rope_form", "rotary_dim", "new_k", "new_v", "slots", "attn_mask", "scale",
             "kv_len", "k_fmt", "v_fmt")
    info = {n: (list(a.shape), list(a.stride()), str(a.dtype)) if isinstance(a, torch.Tensor) else repr(a)
            for n, a in zip(names, args) if n not in ("k_offsets", "v_offsets")}
    info["err_vs_ref"] = (out.float() - want.float()).abs().max().item()
    info["out_stride"] = list(out.stride())
    calls.append(info)
    return out


cuda_ops.latent_attention_triton = recording
reasons = []
reason_fn = cuda_ops.unsupported_reason


def recording_reason(q, *args, **kwargs):
    r = reason_fn(q, *args, **kwargs)
    reasons.append((list(q.shape), list(q.stride()), r))
    return r


cuda_ops.unsupported_reason = recording_reason
model = load_fixture_model().to("cuda", torch.bfloat16).eval()
text = open("models/tiny-mixtral-pystdlib/eval_text.txt", "rb").read()
samples = [torch.tensor([list(text[i * 256:(i + 1) * 256])], device="cuda") for i in range(8)]
bases = calibrate(model, samples, kv_ratio=4, progress=False)
res = {}
for compiler in ("inductor", "aot_eager"):
    calls.clear()
    reasons.clear()
    b, s = 2, 4
    ids = torch.tensor([list(text[5000 + 97 * i: 5000 + 97 * i + s]) for i in range(b)], device="cuda")
    want, fed = _run(model, model, ids, 0, None, make_static_cache(model, s + 1))
    torch._dynamo.reset()
    comp = torch.compile(model, backend="ckvp", options={"compiler": compiler})
    cache = CKVPStaticCache(model.config, bases, max_cache_len=s + 1, max_batch_size=b, device="cuda",
                            dtype=torch.bfloat16)
    got, _ = _run(model, comp, ids, 0, None, cache)
    res[compiler] = dict(prefill_err=(got[0] - want[0]).abs().max().item(), calls=calls[:2],
                         n_calls=len(calls), call_errs=[c["err_vs_ref"] for c in calls], reasons=reasons[:3],
                         n_reasons=len(reasons))
    print(compiler, res[compiler]["prefill_err"], res[compiler]["call_errs"], flush=True)
    print(json.dumps(calls[:1]), reasons[:2], flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
