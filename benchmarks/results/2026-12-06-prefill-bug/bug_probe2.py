"""Second GPU probe of the wrong batched prefill. bug_probe.py found it with a *dense* StaticCache too (so not in the
latent cache), every ckvp::latent_attention call equal to the reference on the tensors it got, and the fixture's
experts compiled from transformers' ``grouped_mm`` experts (sort, histc, ``torch._grouped_mm``) by Inductor.

Sections (OUT/probe2.json):
  plain      torch.compile(model) with Inductor and no ckvp, dense StaticCache: is it PyTorch / transformers alone?
  experts    the same with experts_implementation="eager", and with "grouped_mm" (is it the grouped_mm experts?)
  moe_block  layer 0's sparse MoE block alone, compiled (Inductor) against eager, on (B, S, 256) random bf16 inputs
  repeat     the ckvp backend (latent 4x, Inductor; with this commit's OuterProductPass) at batch 2 x 2 tokens, with the
             latent attention op's Triton kernels and with its reference (USE_TRITON False), then at other shapes
  rotary     the model's rotary embedding alone, compiled, against eager
  bmm        Inductor's RoPE bmm operand strides (from r1's output code) in eager torch.bmm, against contiguous ones

Run: PYTHONPATH=. python3 benchmarks/results/2026-12-06-prefill-bug/bug_probe2.py OUT_DIR
"""
import json
import os
import sys
import traceback

import torch

import ckvp_compile  # noqa: F401  (registers the backend)
import ckvp_compile.ops.latent_attention_cuda as cuda_ops
from ckvp_compile.latent import calibrate
from ckvp_compile.latent.capture import make_static_cache
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import load_fixture_model, prefill_decode_logits

OUT = sys.argv[1]
os.makedirs(OUT, exist_ok=True)
RES: dict = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(0))


def section(name):
    def deco(fn):
        try:
            RES[name] = fn()
        except Exception:  # noqa: BLE001
            RES[name] = dict(error=traceback.format_exc()[-3000:])
        print(name, json.dumps(RES[name], default=str)[:3000], flush=True)
        json.dump(RES, open(os.path.join(OUT, "probe2.json"), "w"), indent=1, default=str)
        return fn
    return deco


model = load_fixture_model().to("cuda", torch.bfloat16).eval()
print("experts implementation:", model.config._experts_implementation, flush=True)
text = open("models/tiny-mixtral-pystdlib/eval_text.txt", "rb").read()


def ids_for(b, s):
    ids = torch.tensor([list(text[5000 + 97 * i: 5000 + 97 * i + s]) for i in range(b)], device="cuda")
    ids[0, 0] = 0
    return ids


def err(b, s, compile_fn, cache_fn=None):
    ids = ids_for(b, s)
    want = prefill_decode_logits(model, ids, 0, max_cache_len=s + 1, cache=make_static_cache(model, s + 1))[0].float()
    torch._dynamo.reset()
    comp = compile_fn(model)
    cache = cache_fn(b, s) if cache_fn else make_static_cache(model, s + 1)
    got = prefill_decode_logits(model, ids, 0, compile_fn=lambda m: comp, max_cache_len=s + 1, cache=cache)[0].float()
    torch._dynamo.reset()
    return dict(b=b, s=s, err=round((got - want).abs().max().item(), 4),
                per_seq=[round((got[i] - want[i]).abs().max().item(), 4) for i in range(b)])


SHAPES = ((2, 2), (1, 4), (2, 4))


@section("bmm")
def _bmm():
    """Inductor's RoPE frequency bmm with its buffers' strides (output_code of r1: (2, 32, 1) strides (32, 1, 64) times
    (2, 1, 2) strides (2, 4, 1)), at several storage offsets, against the contiguous product."""
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for b, s in ((2, 2), (2, 4), (3, 2), (1, 4)):
        for off in (0, 1, 2, 4, 8, 16):
            a_base = torch.randn(4096, device="cuda", generator=g)
            b_base = torch.randn(4096, device="cuda", generator=g)
            a = a_base.as_strided((b, 32, 1), (32, 1, 64), off)
            bb = b_base.as_strided((b, 1, s), (s, 4 if s <= 4 else s * 2, 1), off)
            want = a.contiguous() @ bb.contiguous()
            got = torch.bmm(a, bb)
            rows.append(dict(b=b, s=s, off=off, err=(got - want).abs().max().item()))
    return rows


@section("rotary")
def _rotary():
    """The model's rotary embedding alone, compiled with Inductor, against eager: cos / sin of position_ids (B, S)."""
    rot = model.model.rotary_emb
    rows = []
    for b, s in ((2, 2), (1, 4), (2, 4), (2, 1), (3, 2)):
        x = torch.zeros(b, s, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
        pos = torch.arange(s, device="cuda").expand(b, s).contiguous()
        with torch.no_grad():
            cw, sw = rot(x, pos)
            torch._dynamo.reset()
            cg, sg = torch.compile(rot)(x, pos)
        rows.append(dict(b=b, s=s, cos_err=(cg.float() - cw.float()).abs().max().item(),
                         sin_err=(sg.float() - sw.float()).abs().max().item()))
    torch._dynamo.reset()
    return rows


@section("plain")
def _plain():
    return [err(b, s, torch.compile) for b, s in SHAPES]


@section("repeat")
def _repeat():
    samples = [torch.tensor([list(text[i * 256:(i + 1) * 256])], device="cuda") for i in range(8)]
    bases = calibrate(model, samples, kv_ratio=4, progress=False)

    def cache(b, s):
        return CKVPStaticCache(model.config, bases, max_cache_len=s + 1, max_batch_size=b, device="cuda",
                               dtype=torch.bfloat16)

    rows = []
    for use in (True, False):
        cuda_ops.USE_TRITON = use
        rows.append(dict(use_triton=use, **err(2, 2, lambda m: torch.compile(m, backend="ckvp"), cache)))
    cuda_ops.USE_TRITON = True
    for b, s in ((2, 4), (2, 8), (3, 2), (2, 1), (1, 4)):
        rows.append(dict(use_triton=True, **err(b, s, lambda m: torch.compile(m, backend="ckvp"), cache)))
    return rows


@section("experts")
def _experts():
    rows = []
    for impl in ("eager", "grouped_mm"):
        try:
            model.set_experts_implementation(impl)
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(impl=impl, error=str(exc)[:300]))
            continue
        for b, s in ((2, 2),):
            rows.append(dict(impl=impl, compiler="inductor", **err(b, s, torch.compile)))
            rows.append(dict(impl=impl, compiler="ckvp dense", **err(
                b, s, lambda m: torch.compile(m, backend="ckvp"))))
    model.set_experts_implementation("grouped_mm")
    return rows


@section("moe_block")
def _moe_block():
    layer = model.model.layers[0]
    block = layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for b, s in ((2, 2), (1, 4), (8, 8)):
        x = torch.randn(b, s, model.config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g)
        with torch.no_grad():
            want = block(x)
            want = want[0] if isinstance(want, tuple) else want
            torch._dynamo.reset()
            got = torch.compile(block)(x)
            got = got[0] if isinstance(got, tuple) else got
            flat = torch.compile(block)(x.reshape(1, b * s, -1))
            flat = flat[0] if isinstance(flat, tuple) else flat
        rows.append(dict(b=b, s=s, err=round((got.float() - want.float()).abs().max().item(), 4),
                         err_as_one_sequence=round((flat.float().reshape(want.shape) - want.float()).abs().max().item(), 4)))
    torch._dynamo.reset()
    return rows
