"""The decode attention kernels on ``-f8`` latents (one float8_e4m3fn span and one e4m3 min byte per block,
``kernels/latent_format.py``): read correctly where supported, refused (a fallback that reads them) everywhere else.

* Under the Triton interpreter (a child process, this file as a script; see test_latent_attention_triton.py), against
  ``latent_attention_ref`` with that file's bound (relative error <= 1e-3): a hypothesis property over tiny shapes
  (batch 1-2, Hkv 1-3, GQA ratios 1-4, kv_len up to 40, uniform ``int8/int4/int2`` ``-f8`` formats of several blocks
  per head, power-of-two and not, and ``mix/<block>-f8`` bit plans drawn per head, an fp16-metadata value latent
  beside ``-f8`` keys, static and paged latents, row-major / padded / unit-major rows, the RoPE forms, masks, window
  tokens, one- and two-pass forms, the hoisted and rotated basis, the grouped key pass, the code-domain key rebuild,
  the rank loop, the fused merge, and the chunk / absorbed / lane / word passes switched on (which must decline);
  11 examples, ``CKVP_LATENT_F8_EXAMPLES`` raises it); fixed cases: each per-head path really runs
  (``_LAST_LAUNCH``), the separate key / value launches, and the key-pass template rendered by Inductor.
* The kernels the launcher runs on ``-f8`` latents compile for sm_90a (without a GPU, as test_sm90_compile.py).
* The fast paths refuse ``-f8`` (no fp16 metadata read from ``-f8`` rows): with the same inputs in the fp16 format
  each table-free pass runs, with ``-f8`` it does not and the result still matches the reference; every layout
  function (chunk, absorbed, lane, word, MMA) returns None; the word loads are off; the head tables' byte bases;
  ``unsupported_reason`` on CUDA names ``F8_META_GPU_CHECKED`` while it is off; the template refuses them while
  ``F8_META_TEMPLATE_GPU_CHECKED`` is off and takes them once it is on;
  ``plain_kernel_preferred`` does not count the passes that refuse them.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # test_latent_attention_triton (shared helpers)

F8_FORMATS = ("int8/32-f8", "int8/8-f8", "int4/32-f8", "int4/8-f8", "int4/6-f8", "int2/16-f8", "int2/4-f8")


def _mix_plan(draw, ranks, block):
    """A ``mix/<block>-f8`` plan for heads of ``ranks`` (each >= 1): per head 1-3 pieces of distinct widths, cut at
    block boundaries (what the kernel reads: ``_mix_supported``)."""
    from hypothesis import strategies as st

    heads = []
    for r in ranks:
        cuts = sorted(draw(st.lists(st.sampled_from(range(block, r, block)), unique=True, max_size=2))
                      if r > block else [])
        widths = draw(st.permutations((8, 4, 2)))[:len(cuts) + 1]
        edges = [0, *cuts, r]
        heads.append("+".join(f"{w}x{b - a}" for w, a, b in zip(widths, edges, edges[1:])))
    return f"mix/{block}-f8:" + ",".join(heads)


def _check_property(n_examples: int) -> None:
    import torch
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from test_latent_attention_triton import _check

    from ckvp_compile.kernels.latent_attention_triton import DecodeConfig

    @st.composite
    def cases(draw):
        hkv = draw(st.integers(1, 3))
        d = draw(st.sampled_from((16, 32)))
        rope = draw(st.sampled_from(("rotate_half", "interleaved", "complex", "none")))
        kv_len = draw(st.integers(1, 40))
        rk = draw(st.lists(st.integers(1, 24), min_size=hkv, max_size=hkv))
        rv = draw(st.lists(st.integers(1, 24), min_size=hkv, max_size=hkv))
        kfmt = draw(st.sampled_from(F8_FORMATS + ("mix",)))
        vfmt = draw(st.sampled_from(F8_FORMATS + ("mix", "int4/8")))  # int4/8: fp16 metadata beside -f8 keys
        if kfmt == "mix":
            kfmt = _mix_plan(draw, rk, draw(st.sampled_from((8, 16))))
        if vfmt == "mix":
            vfmt = _mix_plan(draw, rv, draw(st.sampled_from((8, 16))))
        p = dict(seed=draw(st.integers(0, 2**16)), b=draw(st.integers(1, 2)), hkv=hkv,
                 ratio=draw(st.sampled_from((1, 2, 3, 4))), d=d, kv_len=kv_len, s=draw(st.integers(1, min(2, kv_len))),
                 extra=draw(st.integers(0, 4)), rk=rk, rv=rv, kfmt=kfmt, vfmt=vfmt, rope=rope,
                 rd=0 if rope == "none" else 2 * draw(st.integers(1, d // 2)),
                 mask=draw(st.sampled_from((None, "bool", "add"))),
                 mask_shape=draw(st.sampled_from(("bhsk", "b1sk", "k"))), mask_p=0.3, dtype=torch.float32,
                 pos_dtype=torch.int32, win=draw(st.sampled_from((0, 3))), unused=draw(st.sampled_from((0, 1))),
                 page=draw(st.sampled_from((0, 4, 8))),
                 layout=draw(st.sampled_from(("row-major", "padded", "unit-major"))))
        basis = draw(st.sampled_from((None, torch.bfloat16, torch.float8_e4m3fn)))  # exact ones: key_codes applies
        if basis is not None:
            p["basis_dtype"] = basis
        fast = draw(st.sampled_from((None, "head_chunks", "absorbed", "lanes", "words")))  # must decline -f8
        cfg = DecodeConfig(block_n=16, block_r=draw(st.sampled_from((8, 16, 32))), num_warps=1,
                           split=draw(st.sampled_from((None, 1, 2))), min_tiles=1, target_programs=2,
                           hoist_basis=draw(st.booleans()), fma_scores=draw(st.booleans()),
                           fma_values=draw(st.booleans()), two_pass=draw(st.booleans()),
                           block_n_v=draw(st.sampled_from((None, 16))), r_loop=draw(st.booleans()),
                           key_codes=draw(st.booleans()), fuse_merge=draw(st.booleans()),
                           rotate_basis=draw(st.booleans()), head_group=draw(st.sampled_from((0, 2))),
                           **({} if fast is None else {fast: True if fast == "words" else 16}))
        return p, cfg

    @settings(max_examples=n_examples, deadline=None, derandomize=True, database=None)
    @given(cases())
    def prop(case):
        from ckvp_compile.kernels import latent_attention_triton as lat

        _check(*case)
        assert not any(lat._LAST_LAUNCH[k] for k in ("head_chunks", "absorbed", "lanes", "words", "mma")), case

    prop()


def _check_fixed() -> None:
    import dataclasses
    import math

    import torch
    from test_latent_attention_triton import _check, _inputs

    from ckvp_compile.kernels import latent_attention_triton as lat
    from ckvp_compile.kernels import reference as ref
    from ckvp_compile.kernels.latent_attention_triton import DecodeConfig

    base = dict(seed=1, b=1, hkv=2, ratio=2, d=32, kv_len=29, s=2, extra=3, rk=[20, 5], rv=[7, 17],
                kfmt="int4/8-f8", vfmt="int8/8-f8", rope="rotate_half", rd=16, mask="bool", mask_shape="b1sk",
                mask_p=0.3, dtype=torch.float32, pos_dtype=torch.int32, win=3)
    cfg = DecodeConfig(block_n=16, block_r=16, num_warps=1, split=3)
    # the per-head passes (two-pass, one-pass with the rank loop), uniform and mix plans, fp16 metadata on one side
    _check(dict(base, b=2), cfg)
    _check(dict(base, kfmt="mix/8-f8:8x16+2x4,4x5", vfmt="int2/4-f8", page=4, layout="unit-major"),
           dataclasses.replace(cfg, two_pass=False, r_loop=True, block_r=8))
    _check(dict(base, kfmt="int4/8", vfmt="mix/16-f8:4x7,2x16+8x1", rope="complex", rd=32), cfg)
    # the code-domain key rebuild (one quantization block per chunk, e4m3 spans as the blocks' scales)
    codes = dict(base, rk=[33, 20], kfmt="int4/16-f8", basis_dtype=torch.bfloat16)
    assert lat._key_codes_ok(DecodeConfig(key_codes=True), lat.parse_latent_format("int4/16-f8"),
                             torch.empty(0, dtype=torch.bfloat16), 64)
    _check(codes, dataclasses.replace(cfg, key_codes=True))
    # one query head per KV head: the rotated basis, and the grouped key pass (heads within one block)
    g1 = dict(base, hkv=3, ratio=1, rk=[12, 5, 9], rv=[4, 9, 7], kfmt="int8/32-f8", vfmt="int4/32-f8")
    rot = dataclasses.replace(cfg, hoist_basis=True, fma_scores=True, fma_values=True, rotate_basis=True)
    _check(g1, rot)
    assert lat._LAST_LAUNCH["rot_basis"] is True
    _check(dict(g1, kfmt="int2/16-f8", page=8, seed=3), dataclasses.replace(rot, head_group=2, min_tiles=1,
                                                                            target_programs=1))
    assert lat._LAST_LAUNCH["head_group"] == 2
    # the two halves as separate launches (ckvp::latent_scores, ckvp::latent_attention_from_scores)
    (q, lk, lv, bk, bv, ko, vo, cos, sin, sp, rf, rd, nk, nv, sl, mk, sc_, kv, kf, vf) = _inputs(base)
    sc = lat.latent_scores_triton(q, lk, bk, ko, cos, sin, sp, rf, rd, sl, mk, sc_, kv, kf, config=cfg)
    sc_want = ref.latent_scores_ref(q, lk, bk, ko, cos, sin, sp, rf, rd, sl, mk, sc_, kv, kf)
    fin = torch.isfinite(sc_want)
    assert torch.equal(torch.isneginf(sc), torch.isneginf(sc_want))
    assert float((sc[fin] - sc_want[fin]).abs().max()) <= 1e-3 * float(sc_want[fin].abs().max()) + 1e-5
    out = lat.latent_attention_from_scores_triton(sc_want, q, lv, bv, vo, nk, nv, sl, mk, sc_, kv, vf, config=cfg)
    want = ref.latent_attention_from_scores_ref(sc_want, q, lv, bv, vo, nk, nv, sl, mk, sc_, kv, vf)
    assert float((out - want).norm() / want.norm()) <= 1e-3

    # the table-free passes read fp16 block metadata only: with the fp16 formats each one runs, with -f8 ones (same
    # shapes, same config) it declines, and the per-head kernels' result matches the reference
    eq = dict(base, hkv=4, ratio=1, kv_len=17, rk=[16] * 4, rv=[16] * 4, kfmt="int4/32", vfmt="int4/32", rope="none",
              rd=0, mask=None, s=1, win=0)
    fast = DecodeConfig(num_warps=1, min_tiles=1, target_programs=2, block_n_c=16, block_n_a=16, block_n_l=16,
                        block_n_w=16, loop_stages_c=None, loop_stages_a=None, loop_stages_l=None, loop_stages_w=None)
    for key, case, c in (("head_chunks", eq, dataclasses.replace(fast, head_chunks=64)),
                         ("lanes", eq, dataclasses.replace(fast, lanes=16)),
                         ("absorbed", dict(eq, ratio=4), dataclasses.replace(fast, absorbed=64)),
                         ("words", dict(eq, ratio=4), dataclasses.replace(fast, words=True))):
        for k8, v8 in ((False, False), (True, False), (False, True)):
            f8 = dict(case, kfmt=case["kfmt"] + "-f8" * k8, vfmt=case["vfmt"] + "-f8" * v8)
            err = _check(f8, c)
            assert bool(lat._LAST_LAUNCH[key]) is not (k8 or v8), (key, f8["kfmt"], f8["vfmt"], err)
    # the defaults of table-free calls (lane / chunk passes at G = 1, absorbed / word / MMA passes for GQA) decline too
    for case in (dict(eq, kfmt="int4/32-f8", vfmt="int4/32-f8"), dict(eq, ratio=4, vfmt="int4/32-f8")):
        _check(case, None)
        assert not any(lat._LAST_LAUNCH[k] for k in ("head_chunks", "absorbed", "lanes", "words", "mma"))

    # the key-pass template, rendered by Inductor and run here, on -f8 keys (K_META8; the spans' byte base)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lowering"))
    import triton
    from template_render import render_template

    from ckvp_compile.lowering import latent_attention as la

    for kfmt, rope, rd_ in (("int4/8-f8", "rotate_half", 16), ("int8/32-f8", "none", 0)):
        p = dict(base, rk=[12, 12], kfmt=kfmt, rope=rope, rd=rd_, mask="add", mask_shape="bhsk")
        (q, lk, lv, bk, bv, ko, vo, cos, sin, sp, rf, rd, nk, nv, sl, mk, sc_, kv, kf, vf) = _inputs(p)
        f = lat.parse_latent_format(kf)
        b, h, s, d = q.shape
        hkv, g, rope_code = bk.shape[0], h // bk.shape[0], lat._ROPE_CODE[rf]
        scale_base = sum(f.code_bytes(ko))
        meta = dict(
            num_stages=1, num_warps=1, HKV=hkv, G=g, G_PAD=lat._np2(g), G_LOOP=lat._np2(g, 1), S_Q=s,
            N_EXACT=sl.shape[0], BH=b * hkv, KV_LEN=kv, D=d, HALF_VAL=rd // 2, HALF=lat._np2(rd // 2),
            REST=lat._np2(d - rd), HAS_ROT=rope_code != 0, HAS_REST=d > rd, ROPE=rope_code, RK_MAX=bk.shape[-1],
            RK_PAD=lat._np2(bk.shape[-1]), QK_SCALE=sc_ * math.log2(math.e), K_RANK=12,
            K_HEAD_COLS=f.code_bytes(ko)[0], K_HEAD_BLOCKS=-(-12 // f.block), K_SCALE_BASE=scale_base,
            K_MIN_BASE=scale_base + f.num_blocks(ko), K_BITS=f.bits, K_QBLOCK=f.block, K_MX=False, K_META8=True,
            Q_EXACT=False, ZK_EXACT=False, BK_EXACT=False, F32_DOT=True, K_ALIGN=lat._align([f.code_bytes(ko)[0]]),
            PAIRED_TABLE=False, BLOCK_N=16, BLOCK_R=16, FMA_SCORES=False, K_BLOCKWISE=lat._blockwise(f, 16),
            KEY_CODES=False, R_LOOP=False, MASK_KIND=2, M_SB=h * s * kv, M_SH=s * kv, M_SS=kv, M_ST=1)
        inputs = dict(q=q, lk=lk, bk=bk, cos=cos, sin=sin, pos=sp, slots=sl, mask=mk.contiguous())
        fn, src = render_template(la.scores_template, inputs, (b * hkv * s * g, kv), torch.float32, **meta)
        assert "def _scale_min(" in src
        got = torch.full((b * hkv * s * g, kv), float("nan"))
        fn[(triton.cdiv(kv, 16), b * hkv, s)](*inputs.values(), got)
        want = ref.latent_scores_ref(q, lk, bk, ko, cos, sin, sp, rf, rd, sl, mk, sc_, kv, kf).view(-1, kv)
        assert torch.equal(torch.isneginf(got), torch.isneginf(want))
        fin = torch.isfinite(want)
        assert float((got[fin] - want[fin]).abs().max()) <= 1e-4 * (1.0 + float(want[fin].abs().max())), kfmt


def _compile_sm90() -> None:
    """Compile (for sm_90a, no GPU: :mod:`ckvp_compile.testing.sm90`) the kernels the launcher runs on -f8 latents:
    GQA's one pass with the code-domain key rebuild, one query head per KV head with the defaults (grouped key pass,
    rotated basis) over paged latents, and mix plans with the rank loop (the interpreter accepts what the compiler
    may reject, e.g. the e4m3 bitcasts)."""
    import torch
    from test_sm90_compile import _inputs

    from ckvp_compile.kernels.latent_attention_triton import DecodeConfig, default_config
    from ckvp_compile.kernels.latent_format import parse_latent_format
    from ckvp_compile.testing.sm90 import compile_latent_attention

    gqa = dict(b=2, t=256, heads=(32, 8), d=128, k_ranks=[64] * 8, v_ranks=[96] * 8, page=0, seed=0)
    for p, fmts, cfg, want in (
            (gqa, ("int4/32-f8", "int8/32-f8"), DecodeConfig(two_pass=False, key_codes=True), "one-pass"),
            (dict(gqa, b=8, t=16384, heads=(16, 16), k_ranks=[12] * 16, v_ranks=[12] * 16, page=64),
             ("int2/16-f8", "int4/8-f8"), default_config(1, 16, paired=True, rank=12), "grouped key pass"),
            (dict(gqa, heads=(4, 2), k_ranks=[64, 40], v_ranks=[7, 9]),
             ("mix/8-f8:8x16+4x32+2x16,4x24+2x16", "mix/8-f8:4x7,8x8+2x1"), DecodeConfig(r_loop=True, block_r=16),
             "value pass")):
        args, table = _inputs(**p, kfmt="float", vfmt="float")  # shapes only: -f8 rows of the same offsets
        args = list(args)
        for i, fmt in ((1, fmts[0]), (2, fmts[1])):
            args[i] = torch.empty(*args[i].shape[:-1], parse_latent_format(fmt).row_width(args[i + 4]),
                                  dtype=torch.uint8)
        args[-2:] = fmts
        kernels = compile_latent_attention(tuple(args), cfg, page_table=table)
        assert want in [k.name for k in kernels] and all(k.compiled.asm.get("cubin") for k in kernels), fmts


def _main(part: str) -> None:
    if part == "sm90":
        _compile_sm90()
        print("compiled ok")
        return
    assert os.environ.get("TRITON_INTERPRET") == "1"
    if part == "fixed":
        _check_fixed()
        print("ok", part)
    else:
        n = int(os.environ.get("CKVP_LATENT_F8_EXAMPLES", "11"))
        _check_property(n)
        print("ok", n)


@pytest.mark.parametrize("part", ["fixed", "property"])
def test_f8_latents_match_reference_under_interpreter(part):
    """The fixed cases and the hypothesis property, each in a child process under the interpreter."""
    pytest.importorskip("triton")
    pytest.importorskip("hypothesis")
    from ckvp_compile.testing.interpreter import run_under_triton_interpreter

    proc = run_under_triton_interpreter(__file__, timeout=900, args=[part])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("ok")


@pytest.mark.slow
def test_f8_kernels_compile_for_sm90():
    """:func:`_compile_sm90` in a child process without the interpreter (as tests/kernels/test_sm90_compile.py)."""
    import subprocess
    from pathlib import Path

    pytest.importorskip("triton")
    from ckvp_compile.testing.sm90 import sm90_compile_available

    why = sm90_compile_available() if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") else None
    if why:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", TRITON_DEFAULT_FP_FUSION=env.get("TRITON_DEFAULT_FP_FUSION", "1"),
               PYTHONPATH=os.pathsep.join(filter(None, (str(Path(__file__).resolve().parents[2]),
                                                        env.get("PYTHONPATH")))))
    proc = subprocess.run([sys.executable, __file__, "sm90"], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert "compiled ok" in proc.stdout


def test_fast_paths_refuse_f8_formats():
    """Every kernel that reads fp16 block metadata refuses ``-f8`` formats in its gate (its fp16 twin accepted with
    the same arguments), the head tables put the mins after one span byte per block, and on CUDA the launcher refuses
    -f8 until a GPU run checks it (the op then runs the reference)."""
    pytest.importorskip("triton")
    import types

    import torch

    from ckvp_compile.kernels import latent_attention_triton as lat
    from ckvp_compile.kernels.latent_attention_absorbed import absorbed_layout
    from ckvp_compile.kernels.latent_attention_chunks import chunk_layout
    from ckvp_compile.kernels.latent_attention_lanes import lanes_layout
    from ckvp_compile.kernels.latent_attention_words import words_layout
    from ckvp_compile.kernels.latent_format import parse_latent_format as plf

    off = [0, 32, 64, 96, 128]
    for fmt in ("int4/32", "int8/32", "int2/16"):
        f16, f8 = plf(fmt), plf(fmt + "-f8")
        for k, v in ((f16, f16), (f8, f16), (f16, f8)):
            want = k is f16 and v is f16
            assert (chunk_layout(64, 1, k, v, off, off, 32, 32, 4, 1, 1) is not None) is want, (fmt, k, v)
            assert (absorbed_layout(64, 4, k, v, off, off, 32, 32, 4, 1, 1) is not None) is want
            assert (lanes_layout(16, 1, k, v, off, off, 32, 32, 4, 1, 1) is not None) is want
            assert (words_layout(4, k, v, off, off, 32, 32, 1, 1) is not None) is want
    try:
        from ckvp_compile.kernels import latent_attention_mma as lam
    except ImportError:  # a Triton without Gluon: no MMA pass at all
        lam = None
    if lam is not None:
        for fmt, lay in (("int4/32", "row-major"), ("int8/32", "unit-major")):
            f16, f8 = plf(fmt), plf(fmt + "-f8")
            for k, v in ((f16, f16), (f8, f8), (f8, f16)):
                got = lam._mma_layout(4, k, v, tuple(off), tuple(off), 32, 32, (lay, lay), 64, 0, 64)
                assert (got is not None) is (k is f16 and v is f16), (fmt, k, v)
    # fp16 word loads are off for -f8 rows; the head tables' byte bases: mins after NB span bytes (fp16: 2 NB)
    rows = torch.zeros(2, 8, 96, dtype=torch.uint8)
    assert lat._words(plf("int4/32"), rows, 64, 72) and not lat._words(plf("int4/32-f8"), rows, 64, 68)
    cpu = torch.device("cpu")
    for fmt, nb, code in (("int4/32", 4, 64), ("int2/16", 8, 32), ("mix/16:8x32+4x16,4x32+2x16,2x48", 9, 72)):
        _, sb16, mb16, _ = lat._head_meta([0, 48, 96, 144] if fmt.startswith("mix") else off[:4] + [128], fmt, cpu)
        _, sb8, mb8, _ = lat._head_meta([0, 48, 96, 144] if fmt.startswith("mix") else off[:4] + [128],
                                        fmt.replace(":", "-f8:") if fmt.startswith("mix") else fmt + "-f8", cpu)
        assert (sb16, mb16, sb8, mb8) == (code, code + 2 * nb, code, code + nb), fmt
    # on CUDA (a stand-in query: the format check comes first) -f8 goes to the reference until checked on a GPU
    q = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    lat_t = torch.zeros(1, 4, 48, dtype=torch.uint8)
    saved = lat.F8_META_GPU_CHECKED
    try:
        lat.F8_META_GPU_CHECKED = False  # (set since the H200 run; the refusal still guards a new flag's default)
        for k_fmt, v_fmt in (("int4/32-f8", "int4/32"), ("int4/32", "int4/32-f8"), ("mix/32-f8:4x32", "int4/32")):
            reason = lat.unsupported_reason(q, lat_t, lat_t, lat_t, lat_t, "none", None, lat_t, lat_t, k_fmt, v_fmt)
            assert reason is not None and "-f8" in reason and "F8_META_GPU_CHECKED" in reason, (k_fmt, v_fmt, reason)
    finally:
        lat.F8_META_GPU_CHECKED = saved


def test_lowering_refuses_or_plans_around_f8():
    """The key-pass template refuses -f8 keys until F8_META_TEMPLATE_GPU_CHECKED (the extern op then decides), and
    ``plain_kernel_preferred`` does not count the table-free passes that decline -f8 latents."""
    pytest.importorskip("triton")
    import torch

    from ckvp_compile.lowering import latent_attention as la

    class Node:  # what template_refusal reads from an IR node
        def __init__(self, size, stride, dtype):
            self.size, self.stride, self.dtype = size, stride, dtype

        def get_device(self):
            return torch.device("cuda", 0)

        def get_size(self):
            return self.size

        def get_stride(self):
            return self.stride

        def get_dtype(self):
            return self.dtype

    q, basis = Node((2, 4, 1, 16), None, torch.bfloat16), Node((2, 16, 8), None, torch.bfloat16)
    row = Node((2, 64, 12), (64 * 12, 12, 1), torch.uint8)
    assert la.template_refusal(q, row, basis, [0, 8, 16], "rotate_half", None, 64, "int4/32") is None
    saved = la.F8_META_TEMPLATE_GPU_CHECKED
    try:
        la.F8_META_TEMPLATE_GPU_CHECKED = False
        reason = la.template_refusal(q, row, basis, [0, 8, 16], "rotate_half", None, 64, "int4/32-f8")
        assert reason is not None and "F8_META_TEMPLATE_GPU_CHECKED" in reason
        la.F8_META_TEMPLATE_GPU_CHECKED = True  # checked on the H200: the template takes -f8 keys
        assert la.template_refusal(q, row, basis, [0, 8, 16], "rotate_half", None, 64, "int4/32-f8") is None
    finally:
        la.F8_META_TEMPLATE_GPU_CHECKED = saved
    for heads, rank in ((16, 8), (16, 96), (32, 16), (32, 32), (32, 96)):
        fp16 = la.plain_kernel_preferred(heads, heads // (1 if heads == 16 else 4), rank, table_free=True,
                                         code_bits=4)
        f8 = la.plain_kernel_preferred(heads, heads // (1 if heads == 16 else 4), rank, table_free=True,
                                       code_bits=4, meta_f8=True) or ""
        assert "pass" in fp16 and not any(w in f8 for w in ("lane", "word", "absorbed", "chunk", "MMA")), (fp16, f8)
    assert la.plain_kernel_preferred(32, 8, 96, table_free=True, autotuned=True, code_bits=4, meta_f8=True) is None


if __name__ == "__main__":
    _main(sys.argv[1] if len(sys.argv) > 1 else "property")
