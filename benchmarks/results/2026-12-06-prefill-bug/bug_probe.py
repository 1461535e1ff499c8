"""One-call GPU probe of the wrong batched prefill (benchmarks/results/2026-12-06-session-gpu/README.md, section 3):
a 4x latent cache's prefill logits of 2 sequences x 2-4 tokens are 4-9 off under Inductor on CUDA, right under
aot_eager and at batch 1.

Sections (each result appended to OUT/probe.json as it comes):
  dense     Inductor with a dense StaticCache (is it Inductor alone?)
  calls     every ckvp::latent_attention / latent_scores / from_scores call's Triton result against the reference
            on the tensors Inductor passes (strides, dtypes), and whether each output is still intact after the
            whole forward (aliasing / a later overwrite); the lowering's DEBUG log (which path each call took)
  reference Inductor with the ops' CUDA kernels off (USE_TRITON False: the references): our kernels or the graph?
  replay    the first call that disagrees with the reference, saved (OUT/bad_call.pt), replayed with each tensor
            made contiguous in turn and with CKVP_DECODE_CONFIG overrides, to find the layout / config at fault
Inductor's output code of the failing compile goes to OUT/output_code.txt.

Run: PYTHONPATH=. python3 benchmarks/results/2026-12-06-prefill-bug/bug_probe.py OUT_DIR
"""
import io
import json
import logging
import os
import sys
import traceback

import torch

import ckvp_compile.kernels.latent_attention_triton as lat
import ckvp_compile.ops.latent_attention_cuda as cuda_ops
from ckvp_compile.kernels import reference as ref
from ckvp_compile.latent import calibrate
from ckvp_compile.latent.capture import make_static_cache
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import load_fixture_model, prefill_decode_logits

OUT = sys.argv[1]
os.makedirs(OUT, exist_ok=True)
RES: dict = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(0))


def save():
    json.dump(RES, open(os.path.join(OUT, "probe.json"), "w"), indent=1, default=str)


def section(name):
    def deco(fn):
        try:
            RES[name] = fn()
        except Exception:  # noqa: BLE001
            RES[name] = dict(error=traceback.format_exc()[-3000:])
        print(name, json.dumps(RES[name], default=str)[:3000], flush=True)
        save()
        return fn
    return deco


model = load_fixture_model().to("cuda", torch.bfloat16).eval()
text = open("models/tiny-mixtral-pystdlib/eval_text.txt", "rb").read()
samples = [torch.tensor([list(text[i * 256:(i + 1) * 256])], device="cuda") for i in range(8)]
bases = calibrate(model, samples, kv_ratio=4, progress=False)


def ids_for(b, s):
    ids = torch.tensor([list(text[5000 + 97 * i: 5000 + 97 * i + s]) for i in range(b)], device="cuda")
    ids[0, 0] = 0
    return ids


def prefill_err(b, s, compiler="inductor", dense=False):
    """max |compiled - eager| of the prefill logits, overall and per sequence."""
    ids = ids_for(b, s)
    want = prefill_decode_logits(model, ids, 0, max_cache_len=s + 1, cache=make_static_cache(model, s + 1))[0].float()
    torch._dynamo.reset()
    comp = torch.compile(model, backend="ckvp", options={"compiler": compiler})
    cache = (make_static_cache(model, s + 1) if dense else
             CKVPStaticCache(model.config, bases, max_cache_len=s + 1, max_batch_size=b, device="cuda",
                             dtype=torch.bfloat16))
    got = prefill_decode_logits(model, ids, 0, compile_fn=lambda m: comp, max_cache_len=s + 1, cache=cache)[0].float()
    torch._dynamo.reset()
    return dict(b=b, s=s, compiler=compiler, dense=dense, err=round((got - want).abs().max().item(), 4),
                per_seq=[round((got[i] - want[i]).abs().max().item(), 4) for i in range(b)])


@section("dense")
def _dense():
    return [prefill_err(b, s, dense=True) for b, s in ((2, 2), (2, 4), (1, 4))]


# ---- recording wrappers around the CUDA kernels (the ops' registered CUDA impls call these module globals)
CALLS: list = []
KEEP: list = []
BAD: dict = {}
ATT_NAMES = ("q", "latent_k", "latent_v", "basis_k_block", "basis_v_block", "k_offsets", "v_offsets", "cos_table",
             "sin_table", "slot_pos", "rope_form", "rotary_dim", "new_k", "new_v", "slots", "attn_mask", "scale",
             "kv_len", "k_fmt", "v_fmt")


def _desc(names, args):
    return {n: ([list(a.shape), list(a.stride()), str(a.dtype), a.storage_offset()] if isinstance(a, torch.Tensor)
                else repr(a)) for n, a in zip(names, args) if n not in ("k_offsets", "v_offsets")}


OVERRIDES = ({"two_pass": True}, {"two_pass": False}, {"split": 1}, {"fma_scores": True}, {"fma_scores": False},
             {"key_fp16": False}, {"key_fp16": True}, {"loop_stages": 1}, {"paired_tables": False},
             {"one_pass_merge": False}, {"reduce_split_d": False}, {"fma_merge": False}, {"p_bf16": False},
             {"f32_dots": True}, {"key_split": False}, {"block_n": 16}, {"min_tiles": 64})


def _replay(fn, ref_fn, args, kw):
    """At the moment of the first bad call, on Inductor's own tensors: the call again, with every tensor cloned
    contiguous, with each tensor cloned in turn, and under CKVP_DECODE_CONFIG overrides."""
    want = ref_fn(*args, *kw.values()).float()

    def err(a):
        try:
            return round((fn(*a, **kw).float() - want).abs().max().item(), 4)
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {str(exc)[:200]}"

    rows = dict(again=err(args), all_contiguous=err([a.contiguous().clone() if isinstance(a, torch.Tensor) else a
                                                     for a in args]))
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            rows[f"clone_{i}"] = err([x.contiguous().clone() if j == i else x for j, x in enumerate(args)])
    for ov in OVERRIDES:
        os.environ[lat.CONFIG_ENV] = json.dumps(ov)
        try:
            rows[json.dumps(ov)] = err(args)
        finally:
            os.environ.pop(lat.CONFIG_ENV, None)
    rows["ref_on_clones_vs_ref"] = round((ref_fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args],
                                                 *kw.values()).float() - want).abs().max().item(), 4)
    return rows


def _wrap(kind, fn, ref_fn, names):
    def rec(*args, **kw):
        out = fn(*args, **kw)
        torch.cuda.synchronize()
        want = ref_fn(*args, *kw.values())
        err = (out.float() - want.float()).abs().max().item()
        info = dict(kind=kind, err_vs_ref=err, out=[list(out.shape), list(out.stride())], args=_desc(names, args))
        for i, n in enumerate(names):
            if n in ("slots", "slot_pos", "kv_len") and isinstance(args[i], torch.Tensor):
                info[n + "_vals"] = args[i].tolist()
        if err > 0.05 and kind not in BAD:
            per_b = [(out[i].float() - want[i].float()).abs().max().item() for i in range(out.shape[0])]
            BAD[kind] = dict(err=err, per_batch=per_b, info=info, replay=_replay(fn, ref_fn, args, kw))
            torch.save(dict(args=[a.detach().cpu() if isinstance(a, torch.Tensor) else a for a in args],
                            strides=[(a.stride(), a.storage_offset()) if isinstance(a, torch.Tensor) else None
                                     for a in args], kw=kw),
                       os.path.join(OUT, f"bad_{kind}.pt"))
        CALLS.append(info)
        KEEP.append((out, out.clone()))
        return out
    return rec


cuda_ops.latent_attention_triton = _wrap("attention", lat.latent_attention_triton, ref.latent_attention_ref, ATT_NAMES)
cuda_ops.latent_scores_triton = _wrap("scores", lat.latent_scores_triton, ref.latent_scores_ref,
                                      ("q", "latent_k", "basis_k_block", "k_offsets", "cos_table", "sin_table",
                                       "slot_pos", "rope_form", "rotary_dim", "slots", "attn_mask", "scale",
                                       "kv_len", "k_fmt"))
cuda_ops.latent_attention_from_scores_triton = _wrap(
    "from_scores", lat.latent_attention_from_scores_triton, ref.latent_attention_from_scores_ref,
    ("scores", "q", "latent_v", "basis_v_block", "v_offsets", "new_k", "new_v", "slots", "attn_mask", "scale",
     "kv_len", "v_fmt"))

LOG = io.StringIO()
_h = logging.StreamHandler(LOG)
for name in ("ckvp_compile.lowering.latent_attention", "ckvp_compile.ops.latent_attention_cuda",
             "ckvp_compile.backend"):
    logging.getLogger(name).setLevel(logging.DEBUG)
    logging.getLogger(name).addHandler(_h)


@section("calls")
def _calls():
    rows = []
    for compiler in ("inductor", "aot_eager"):
        CALLS.clear()
        KEEP.clear()
        LOG.seek(0)
        LOG.truncate()
        if compiler == "inductor":
            torch._logging.set_logs(output_code=True)
            code = io.StringIO()
            oh = logging.StreamHandler(code)
            logging.getLogger("torch._inductor").addHandler(oh)
        r = prefill_err(2, 2, compiler)
        if compiler == "inductor":
            torch._logging.set_logs()
            logging.getLogger("torch._inductor").removeHandler(oh)
            open(os.path.join(OUT, "output_code.txt"), "w").write(code.getvalue())
        r["n_calls"] = len(CALLS)
        r["call_errs"] = [(c["kind"], round(c["err_vs_ref"], 4)) for c in CALLS]
        r["overwritten_after"] = [i for i, (o, c) in enumerate(KEEP) if not torch.equal(o, c)]
        r["first_calls"] = CALLS[:3]
        r["log"] = LOG.getvalue()[-4000:]
        rows.append(r)
    return rows


@section("reference")
def _reference():
    import ckvp_compile.kernels.latent_quant_triton as lq
    rows = []
    cuda_ops.USE_TRITON = False
    try:
        rows.append(dict(attention_ref=True, **prefill_err(2, 2)))
        old = lq.USE_TRITON if hasattr(lq, "USE_TRITON") else None
        if old is not None:
            lq.USE_TRITON = False
            rows.append(dict(attention_ref=True, append_ref=True, **prefill_err(2, 2)))
            lq.USE_TRITON = old
    finally:
        cuda_ops.USE_TRITON = True
    return rows


@section("replay")
def _replay_section():
    return BAD or "no call disagreed with the reference"


@section("more_shapes")
def _more():
    return [prefill_err(b, s) for b, s in ((2, 1), (3, 2), (2, 8))]
