"""Replay a call bug_probe.py saved (bad_<kind>.pt: the arguments, with the strides Inductor gave them) on the CPU:
the Triton kernel under TRITON_INTERPRET=1, at the recorded layouts and contiguous, against the reference.

Run: TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/results/2026-12-06-prefill-bug/replay_cpu.py bad_attention.pt
"""
import sys

import torch

import ckvp_compile.kernels.latent_attention_triton as lat
from ckvp_compile.kernels import reference as ref

saved = torch.load(sys.argv[1], weights_only=False)
args, strides, kw = saved["args"], saved["strides"], saved["kw"]


def relayout(a, st):
    if not isinstance(a, torch.Tensor) or st is None:
        return a
    stride, off = st
    if any(s == 0 for s in stride):  # broadcast dims: expand a contiguous base
        base = a.index_select(0, torch.tensor([0])) if stride[0] == 0 else a
        return base.contiguous().expand(a.shape) if base.shape != a.shape else a
    need = off + sum((n - 1) * s for n, s in zip(a.shape, stride)) + 1
    buf = torch.zeros(need, dtype=a.dtype)
    t = buf.as_strided(a.shape, stride, off)
    t.copy_(a)
    return t


laid = [relayout(a, st) for a, st in zip(args, strides)]
want = ref.latent_attention_ref(*args, *kw.values()).float() if len(args) == 20 else None
for name, a in (("recorded layout", laid), ("contiguous", args)):
    got = lat.latent_attention_triton(*a, **kw).float()
    print(name, (got - want).abs().max().item(), [(got[i] - want[i]).abs().max().item() for i in range(got.shape[0])])
