"""The Inductor lowering of the latent decode attention (ckvp_compile/lowering/latent_attention.py).

* Registration: ``register_all`` lowers ``ckvp::latent_scores`` and ``ckvp::latent_attention``.
* CPU Inductor: both ops stay one extern call each (the reference), bit-identical to the eager op.
* The key-pass template, rendered by the installed Inductor with CPU layouts and run under ``TRITON_INTERPRET=1``
  (in a child process, this file as a script), matches ``latent_scores_ref`` on hypothesis-drawn tiny cases:
  GQA 1-4, float / int / mxint latents, the RoPE forms, bool and additive masks with broadcast dims, several
  new tokens, tile sizes smaller and larger than the context.
The GPU side (autotuning picks a template in a compiled model) is benchmarks/latent_attention_lowering_gpu.py.
"""

from __future__ import annotations

import os as _os
import sys as _sys

_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))  # template_render

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))


def _case(**kw):
    base = dict(seed=1, b=2, hkv=2, ratio=2, d=32, kv_len=37, s=1, extra=3, rk=[12, 12], rv=[7, 7], kfmt="int8/8",
                vfmt="int8/32", rope="rotate_half", rd=16, mask=None, mask_shape="bhsk", mask_p=0.3,
                dtype=torch.float32, pos_dtype=torch.int32)
    base.update(kw)
    return base


def test_register_all_lowers_the_latent_attention_ops():
    pytest.importorskip("triton")
    from ckvp_compile.lowering import register_all

    names = register_all()
    assert "ckvp::latent_scores" in names and "ckvp::latent_attention" in names
    assert register_all() == names


def test_without_autotuning_the_plain_kernel_keeps_the_forms_the_template_lacks(monkeypatch):
    """Without max-autotune the whole op stays the plain kernel where its default has a form the template lacks:
    one query head per KV head up to MAX_ROTATED_RANK (the head-chunk pass up to rank 8, then the rotated / grouped
    key passes), GQA up to rank 128 (one pass); wider GQA ranks (two passes either way) and G = 1 past the rotated
    limit leave the template eligible.
    Without RoPE tables the one-pass kernels over chunks of KV heads (lane, absorbed) count too.
    The tuning override reaches the decision (a forced two-pass GQA config makes the template eligible)."""
    pytest.importorskip("triton")
    from ckvp_compile.kernels import latent_attention_triton as lat
    from ckvp_compile.lowering.latent_attention import plain_kernel_preferred

    monkeypatch.delenv(lat.CONFIG_ENV, raising=False)
    for rank in (1, 8, 12, 16, 33, 96, 100, lat.MAX_ROTATED_RANK):
        form = "chunks of KV heads" if rank <= 8 else "rotated / grouped"  # the head-chunk pass up to rank 8
        assert form in plain_kernel_preferred(16, 16, rank)
        assert "one-pass" in plain_kernel_preferred(32, 8, rank)
    assert plain_kernel_preferred(16, 16, lat.MAX_ROTATED_RANK + 1) is None
    assert plain_kernel_preferred(32, 8, 129) is None and plain_kernel_preferred(32, 8, 256) is None
    # no RoPE tables (post-RoPE key bases): the lane pass at one query head per KV head; for GQA the absorbed pass at
    # rank 16 and the word pass at ranks 32-128 with codes of at most 4 bits (8-bit codes: the absorbed pass up to
    # rank 32, the one-pass form past it); the lowering asks this under max-autotune too: the template has no such form
    for rank in (8, 32, 96, 128):
        assert "lane pass" in plain_kernel_preferred(16, 16, rank, table_free=True)
    assert "absorbed pass" in plain_kernel_preferred(32, 8, 16, table_free=True)
    for rank in (32, 96, 128):
        assert "word pass" in plain_kernel_preferred(32, 8, rank, table_free=True, code_bits=4)
    assert "absorbed pass" in plain_kernel_preferred(32, 8, 32, table_free=True, code_bits=8)
    assert "MMA pass" in plain_kernel_preferred(32, 8, 32, table_free=True, code_bits=8)  # rank 32, 8-bit codes
    assert "MMA pass" not in plain_kernel_preferred(32, 8, 96, table_free=True, code_bits=8)
    assert "one-pass" in plain_kernel_preferred(32, 8, 96, table_free=True, code_bits=8)
    # autotuned, only those one-pass chunk kernels keep the call from the template
    assert "lane pass" in plain_kernel_preferred(16, 16, 32, table_free=True, autotuned=True)
    assert "word pass" in plain_kernel_preferred(32, 8, 96, table_free=True, autotuned=True, code_bits=2)
    assert plain_kernel_preferred(32, 8, 96, table_free=True, autotuned=True, code_bits=8) is None
    # the value rank counts: rank-32 keys with rank-256 values take no lane pass by default
    assert "lane" not in (plain_kernel_preferred(16, 16, 32, table_free=True, rank_v=256) or "")
    monkeypatch.setenv(lat.CONFIG_ENV, '{"two_pass": true}')
    assert plain_kernel_preferred(32, 8, 96) is None
    monkeypatch.setenv(lat.CONFIG_ENV, '{"lanes": 0, "head_chunks": 0}')
    assert "lane" not in (plain_kernel_preferred(16, 16, 32, table_free=True) or "")


def test_the_template_refuses_latents_it_would_copy():
    """The template's inputs are made contiguous, so a unit-major latent or one with padded rows
    (kernels.latent_layout) would be copied whole on every call: they are refused (the plain kernel reads the latent
    at its strides); a contiguous one is not (a size-1 dim's stride does not matter).
    Stand-in IR nodes: the refusal reads only devices, sizes, strides and dtypes."""
    pytest.importorskip("triton")
    from ckvp_compile.lowering.latent_attention import template_refusal

    class Node:
        def __init__(self, size, stride=None, dtype=torch.bfloat16):
            self.size, self.stride, self.dtype = size, stride, dtype

        def get_device(self):
            return torch.device("cuda", 0)

        def get_size(self):
            return self.size

        def get_stride(self):
            return self.stride

        def get_dtype(self):
            return self.dtype

    b, s_max, width, hkv, d, r = 2, 64, 20, 2, 16, 8
    q, basis = Node((b, 4, 1, d)), Node((hkv, d, r))
    offsets, args = [0, r, 2 * r], ("rotate_half", None, s_max, "int4/32")
    row = Node((b, s_max, width), (s_max * width, width, 1), torch.uint8)
    unit = Node((b, s_max, width), (s_max * width, 1, s_max), torch.uint8)
    padded = Node((b, s_max, width), (s_max * 32, 32, 1), torch.uint8)  # padded rows (empty_latent)
    assert template_refusal(q, row, basis, offsets, *args) is None
    assert "unit-major" in template_refusal(q, unit, basis, offsets, *args)
    assert "padded" in template_refusal(q, padded, basis, offsets, *args)
    assert template_refusal(q, Node((1, s_max, width), (7, width, 1), torch.uint8), basis, offsets, *args) is None


@pytest.mark.parametrize("mask", [None, "bool", "add"])
def test_cpu_inductor_keeps_the_ops_as_exact_extern_calls(mask):
    pytest.importorskip("triton")
    from test_latent_attention_triton import _inputs

    from ckvp_compile.lowering import register_all

    register_all()
    args = _inputs(_case(mask=mask, mask_shape="b1sk", s=2))
    (q, lk, lv, bk, bv, ko, vo, cos, sin, sp, rf, rd, nk, nv, sl, mk, sc, kv, kf, vf) = args

    def f(q, lk, lv, bk, bv, cos, sin, sp, nk, nv, sl, mk):
        return (torch.ops.ckvp.latent_attention(q, lk, lv, bk, bv, ko, vo, cos, sin, sp, rf, rd, nk, nv, sl, mk, sc,
                                                kv, kf, vf),
                torch.ops.ckvp.latent_scores(q, lk, bk, ko, cos, sin, sp, rf, rd, sl, mk, sc, kv, kf))

    torch._dynamo.reset()
    got = torch.compile(f, backend="inductor", fullgraph=True)(q, lk, lv, bk, bv, cos, sin, sp, nk, nv, sl, mk)
    want = f(q, lk, lv, bk, bv, cos, sin, sp, nk, nv, sl, mk)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


# ------------------------------------------------------------------------------------------ template (child)


def _check_template(p: dict, block_n: int, block_r: int, fma: bool, key_codes: bool = False,
                    r_loop: bool = False) -> None:
    import math

    import triton
    from test_latent_attention_triton import _inputs

    from ckvp_compile.kernels import latent_attention_triton as lat
    from ckvp_compile.kernels import reference as ref
    from ckvp_compile.kernels.latent_format import parse_latent_format
    from ckvp_compile.lowering import latent_attention as la
    from template_render import render_template

    (q, lk, lv, bk, bv, ko, vo, cos, sin, sp, rf, rd, nk, nv, sl, mk, sc, kv, kf, vf) = _inputs(p)
    b, h, s, d = q.shape
    hkv = bk.shape[0]
    g = h // hkv
    f = parse_latent_format(kf)
    rank = ko[1] - ko[0]
    cb = f.code_bytes(ko)[0] if f.quantized else rank
    nb = -(-rank // f.block) if f.quantized else 0
    scale_base = sum(f.code_bytes(ko)) if f.quantized else 0
    mask_t = None if mk is None else mk.contiguous()

    class _Node:  # what la._mask_meta reads from an IR node
        def __init__(self, t):
            self.t = t

        def get_size(self):
            return list(self.t.shape)

        def get_dtype(self):
            return self.t.dtype

    rope = lat._ROPE_CODE[rf]
    rdim = 0 if rope == 0 else rd
    rk_pad = lat._np2(bk.shape[-1])
    key_codes = lat._key_codes_ok(lat.DecodeConfig(key_codes=key_codes), f, bk, rk_pad)
    block_r = f.block if key_codes else min(block_r, rk_pad)
    meta = dict(
        num_stages=1, num_warps=1, HKV=hkv, G=g, G_PAD=lat._np2(g), G_LOOP=lat._np2(g, 1), S_Q=s, N_EXACT=sl.shape[0],
        BH=b * hkv, KV_LEN=kv, D=d, HALF_VAL=rdim // 2, HALF=lat._np2(rdim // 2), REST=lat._np2(d - rdim), HAS_ROT=rope != 0,
        HAS_REST=d > rdim, ROPE=rope, RK_MAX=bk.shape[-1], RK_PAD=rk_pad, QK_SCALE=sc * math.log2(math.e),
        K_RANK=rank, K_HEAD_COLS=cb, K_HEAD_BLOCKS=nb, K_SCALE_BASE=scale_base,
        K_MIN_BASE=scale_base + 2 * f.num_blocks(ko) if f.quantized else 0, K_BITS=f.bits, K_QBLOCK=max(f.block, 1),
        K_MX=f.pow2, Q_EXACT=False, ZK_EXACT=f.pow2, BK_EXACT=False, F32_DOT=True, K_ALIGN=lat._align([cb]),
        PAIRED_TABLE=False, BLOCK_N=block_n, BLOCK_R=block_r, FMA_SCORES=fma, K_BLOCKWISE=lat._blockwise(f, block_r),
        KEY_CODES=key_codes, R_LOOP=r_loop and rk_pad > block_r,
        **la._mask_meta(None if mask_t is None else _Node(mask_t), b, h, s, kv))
    inputs = dict(q=q, lk=lk, bk=bk, cos=cos, sin=sin, pos=sp, slots=sl, mask=q if mask_t is None else mask_t)
    fn, src = render_template(la.scores_template, inputs, (b * hkv * s * g, kv), torch.float32, **meta)
    assert "def _tile_scores(" in src and "def _latent_tile(" in src
    out = torch.full((b * hkv * s * g, kv), float("nan"))
    fn[(triton.cdiv(kv, block_n), b * hkv, s)](*inputs.values(), out)
    want = ref.latent_scores_ref(q, lk, bk, ko, cos, sin, sp, rf, rd, sl, mk, sc, kv, kf).view(-1, kv)
    assert torch.equal(torch.isneginf(out), torch.isneginf(want)), p
    fin = torch.isfinite(want)
    if bool(fin.any()):
        err = float((out[fin] - want[fin]).abs().max())
        assert err <= 1e-4 * (1.0 + float(want[fin].abs().max())), (p, err)


def _check_templates(n_examples: int) -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ckvp_compile.lowering import register_all

    assert os.environ.get("TRITON_INTERPRET") == "1"
    register_all()

    @st.composite
    def cases(draw):
        hkv = draw(st.integers(1, 2))
        d = draw(st.sampled_from((16, 32)))
        rope = draw(st.sampled_from(("rotate_half", "interleaved", "complex", "none")))
        rd = 0 if rope == "none" else draw(st.sampled_from([x for x in (8, 16, d) if x <= d]))
        r = draw(st.integers(1, 20))
        kv_len = draw(st.integers(1, 40))
        s = draw(st.integers(1, min(3, kv_len)))
        p = _case(seed=draw(st.integers(0, 999)), b=draw(st.integers(1, 2)), hkv=hkv, ratio=draw(st.integers(1, 4)),
                  d=d, kv_len=kv_len, s=s, rk=[r] * hkv, rv=[4] * hkv,
                  kfmt=draw(st.sampled_from(("float", "int8/8", "int4/32", "mxint8/8", "mxint4/32", "int2/8"))),
                  rope=rope, rd=rd, mask=draw(st.sampled_from((None, "bool", "add"))),
                  mask_shape=draw(st.sampled_from(("bhsk", "b1sk", "1hsk", "sk"))),
                  win=draw(st.sampled_from((0, 5, 20))), unused=draw(st.sampled_from((0, 2))),
                  basis_dtype=draw(st.sampled_from((torch.float32, torch.bfloat16))))
        return (p, draw(st.sampled_from((16, 32))), draw(st.sampled_from((8, 16, 32))), draw(st.booleans()),
                draw(st.booleans()), draw(st.booleans()))

    @settings(max_examples=n_examples, deadline=None, derandomize=True, database=None)
    @given(cases())
    def prop(case):
        _check_template(*case)

    prop()
    print("ok", n_examples)


def test_scores_template_renders_and_matches_the_reference_under_interpreter():
    pytest.importorskip("triton")
    pytest.importorskip("hypothesis")
    from ckvp_compile.testing.interpreter import run_under_triton_interpreter

    proc = run_under_triton_interpreter(__file__, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("ok")


if __name__ == "__main__":
    _check_templates(int(os.environ.get("CKVP_SCORES_TEMPLATE_EXAMPLES", "12")))
