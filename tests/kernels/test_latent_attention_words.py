"""The word pass (ckvp_compile/kernels/latent_attention_words.py) against ``latent_attention_ref`` under the Triton
interpreter (a child process, as tests/kernels/test_latent_attention_triton.py), its code unpacking and its layout.

Property test (hypothesis, tiny shapes, derandomized): the lane test's cases (no RoPE, batch 1-2, Hkv 1-4, GQA ratios
1-5, unequal per-head ranks mostly on 4-byte words, int8 / int4 / int2 latents whose blocks hold whole words, 1-3
query tokens, exact window tokens, masks of several broadcast shapes, pages, padded rows) with word-pass tiles,
context splits and loop pipelining; the launcher runs the word kernel exactly where its layout and row alignment
apply. Fixed cases: G = 2-5 with several slot groups per tensor-core row (G = 1 left to the lane pass), several
quantization blocks per head, a wholly finfo.min-masked head, queries far outside fp16's range (the coefficients'
power-of-two scaling), the word pass taking precedence over the lane pass, the defaults, and calls it leaves to
the other kernels. Workspaces are filled with NaN. Bound: relative error (Frobenius) <= 1e-3. A second test checks
the code unpacking exactly (every code value at 8, 4 and 2 bits against its label).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _expects_words(p: dict) -> tuple[dict | None, bool]:
    """(words_layout of the case, whether the launcher should run the word kernel): the layout, and whether the rows
    meet the launcher's alignment check besides (the lane pass's, ``rows_on_words``)."""
    from test_latent_attention_lanes import _offsets, rows_on_words

    from ckvp_compile.kernels.latent_attention_words import words_layout
    from ckvp_compile.kernels.latent_format import parse_latent_format

    kf, vf = parse_latent_format(p["kfmt"]), parse_latent_format(p["vfmt"])
    lay = words_layout(p["ratio"], kf, vf, _offsets(p["rk"]), _offsets(p["rv"]), max(p["rk"]), max(p["rv"]), 1, 1)
    return (None, False) if lay is None else (lay, rows_on_words(p))


def _main() -> None:
    import dataclasses

    import torch
    from hypothesis import given, settings
    from hypothesis import strategies as st

    import test_latent_attention_triton as base_tests
    from test_latent_attention_lanes import _lanes_case, _NanEmpty

    from ckvp_compile.kernels import latent_attention_triton as lat
    from ckvp_compile.kernels.latent_attention_triton import DecodeConfig

    assert os.environ.get("TRITON_INTERPRET") == "1"
    lat.torch = _NanEmpty(torch)  # the launcher's fresh buffers hold NaN (this process only runs these checks)

    def check(p, cfg):
        base_tests.check_as_close_as_per_head(p, cfg, "words")
        lay, expected = _expects_words(p)
        assert lat._LAST_LAUNCH["words"] == expected, (p, cfg, lay, dict(lat._LAST_LAUNCH))
        return expected

    # one sequence (the interpreter's time is per program), two where the batch is part of the case
    eq = dict(seed=1, b=1, hkv=4, ratio=1, d=32, kv_len=37, s=1, extra=3, rk=[16] * 4, rv=[16] * 4, kfmt="int4/32",
              vfmt="int4/32", rope="none", rd=0, mask=None, mask_shape="bhsk", mask_p=0.3, dtype=torch.bfloat16,
              pos_dtype=torch.int32)
    cfg0 = DecodeConfig(words=True, num_warps=1, min_tiles=1, target_programs=4, block_n_w=16, loop_stages_w=None)
    g4 = dict(eq, ratio=4)
    # it takes precedence over the lane pass when both are on; G = 1 it leaves to the lane pass
    assert check(g4, dataclasses.replace(cfg0, lanes=16)) and lat._LAST_LAUNCH["lanes"] == 0
    assert not check(eq, dataclasses.replace(cfg0, lanes=16)) and lat._LAST_LAUNCH["lanes"] > 0
    for case, c in (
            # G = 4: four slot groups per tensor-core row; unequal ranks, a rank-0 head, bool mask of one row
            (dict(eq, b=2, ratio=4, rk=[24, 40, 8, 0], rv=[32, 8, 16, 16], mask="bool", mask_shape="b1sk"), cfg0),
            # a head wholly masked by finfo.min (the clamp before the log2 conversion)
            (dict(g4, mask="finfo", s=2, win=3, dtype=torch.float32), dataclasses.replace(cfg0, loop_stages_w=2)),
            # several quantization blocks per head (int4/8 keys: 5 blocks at rank 40; int2/16 values), G = 3
            (dict(eq, hkv=2, ratio=3, rk=[40, 32], rv=[16, 32], kfmt="int4/8", vfmt="int2/16", s=2, win=17,
                  unused=2, mask="add"), dataclasses.replace(cfg0, split=2)),
            # int8 keys and values, pages, padded rows, several blocks per head (int8/4, int8/8)
            (dict(eq, b=2, ratio=2, rk=[12, 4, 0, 8], rv=[8, 8, 4, 0], page=4, seed=3, layout="padded",
                  kfmt="int8/4", vfmt="int8/8"), dataclasses.replace(cfg0, block_n_w=32, loop_stages_w=2)),
            # value ranks wider than the key ranks, per-head masks, fp32 (a strict 1e-3)
            (dict(g4, rk=[32, 16, 16, 8], kfmt="int8/32", vfmt="int2/32", rv=[32, 64, 16, 48], s=2, win=3,
                  unused=2, mask="add", mask_shape="1hsk", dtype=torch.float32), cfg0),
            # G = 5 (padded to 8) at a longer context, several tiles per split
            (dict(eq, ratio=5, hkv=3, kv_len=150, rk=[8, 24, 16], rv=[4, 12, 8], kfmt="int4/8", vfmt="int8/4",
                  dtype=torch.float16), dataclasses.replace(cfg0, split=2)),
            # per-sequence (online, 4-D) bases: the query fold and the value projection step per sequence
            (dict(g4, b=2, rk=[24, 40, 8, 0], rv=[32, 8, 16, 16], online=True, seed=5), cfg0)):
        assert check(case, c), case
    # small value latents (block scales near 7e-5 and 7e-6; int8 ones smaller still) and no exact token: the
    # weights' power-of-two scaling per tile keeps p * scale out of fp16's subnormals (1.3e-3 and 1.3e-2 before)
    for vs, vf in ((1e-4, "int4/32"), (1e-5, "int4/32"), (1e-3, "int8/32")):
        p = dict(g4, hkv=1, rk=[32], rv=[32], vfmt=vf, dtype=torch.float32, unused=1, v_size=vs)
        base_tests._check(p, cfg0)
        assert lat._LAST_LAUNCH["words"]
    # queries far outside fp16's range either way: the coefficients' power-of-two scaling keeps them exact
    for qs in (3e4, 1e-5, 1e36):
        p = dict(g4, dtype=torch.float32, q_scale=qs)
        base_tests._check(p, cfg0)
        assert lat._LAST_LAUNCH["words"]
    # on by default where the H200 measured it faster (benchmarks/results/2026-12-03-words-h200): table-free GQA at
    # padded key ranks 32-128; not at rank 16 (the absorbed pass), not at G = 1 (the lane pass), not with tables
    from ckvp_compile.kernels.latent_attention_triton import default_config

    d = default_config(4, 32, table_free=True)
    assert d.words and d.block_n_w == 64 and d.absorbed > 0  # (the absorbed pass where the words' layout fails)
    assert default_config(4, 128, table_free=True, rank_v=96).words
    assert not default_config(4, 16, table_free=True).words and not default_config(1, 32, table_free=True).words
    assert not default_config(4, 32).words and not default_config(4, 256, table_free=True).words
    assert not default_config(4, 32, table_free=True, code_bits=8).words  # 8-bit codes: the absorbed pass
    base_tests._check(dict(g4, rk=[32, 24, 32, 8], rv=[32, 16, 8, 32]), None)
    assert lat._LAST_LAUNCH["words"]
    # left to the other kernels: RoPE tables, MX latents, heads off 4-byte words
    for case in (dict(g4, rope="rotate_half", rd=16), dict(g4, kfmt="mxint4/32"),
                 dict(g4, vfmt="int2/16", rv=[8, 16, 40, 24])):
        base_tests._check(case, cfg0)
        assert not lat._LAST_LAUNCH["words"], (case, dict(lat._LAST_LAUNCH))

    @st.composite
    def cases(draw):
        p = _lanes_case(draw, st, torch)
        p["ratio"] = draw(st.sampled_from((4, 3, 5, 2, 1)))  # mostly the GQA ratios the word pass takes
        cfg = DecodeConfig(words=True, num_warps=1, split=draw(st.sampled_from((None, 1, 2, 3))), min_tiles=1,
                           target_programs=8, block_n_w=draw(st.sampled_from((16, 32))),
                           loop_stages_w=draw(st.sampled_from((None, 2))))
        return p, cfg

    n = int(os.environ.get("CKVP_WORDS_EXAMPLES", "10"))

    @settings(max_examples=n, deadline=None, derandomize=True, database=None)
    @given(cases())
    def prop(case):
        ran.append(check(*case))

    ran = []
    prop()
    assert 3 * sum(ran) >= len(ran), ran  # most drawn cases reach the kernel (at least a third)
    print("ok", n, sum(ran))


def test_words_kernel_matches_reference_under_interpreter():
    pytest.importorskip("triton")
    pytest.importorskip("hypothesis")
    from ckvp_compile.testing.interpreter import run_under_triton_interpreter

    proc = run_under_triton_interpreter(__file__, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("ok")


def test_code_words_unpack_exactly_under_interpreter():
    """_codes_fp16 / _word_labels: every column of the fp16 operand is ``1024 + code * 2^shift`` of the coordinate
    its label names, for random words at 8, 4 and 2 bits (all codes, the top bit of each byte included)."""
    pytest.importorskip("triton")
    from ckvp_compile.testing.interpreter import run_under_triton_interpreter

    proc = run_under_triton_interpreter(__file__, timeout=300, args=["unpack"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.strip().splitlines()[-1] == "ok unpack"


def _unpack_main() -> None:
    import torch
    import triton
    import triton.language as tl

    from ckvp_compile.kernels import latent_attention_words as law

    globals().update(_codes_fp16=law._codes_fp16, _word_labels=law._word_labels)  # (a jit function's globals)

    @triton.jit
    def unpack(w_ptr, out_ptr, coord_ptr, shift_ptr, BN: tl.constexpr, W: tl.constexpr, BITS: tl.constexpr):
        n = tl.arange(0, BN)
        words = tl.load(w_ptr + n[:, None] * W + tl.arange(0, W)[None, :])
        codes = _codes_fp16(words, BN, W, BITS)
        cols = tl.arange(0, W * 32 // BITS)
        tl.store(out_ptr + n[:, None] * (W * 32 // BITS) + cols[None, :], codes)
        coord, shift = _word_labels(W, BITS)
        tl.store(coord_ptr + cols, coord)
        tl.store(shift_ptr + cols, shift)

    gen = torch.Generator().manual_seed(0)
    for bits in (8, 4, 2):
        bn, w = 16, 4
        words = torch.randint(-(2**31), 2**31 - 1, (bn, w), generator=gen, dtype=torch.int64).to(torch.int32)
        words[0] = -1  # every code at its largest (the sign bit too)
        n_col = w * 32 // bits
        out = torch.empty(bn, n_col, dtype=torch.float16)
        coord = torch.empty(n_col, dtype=torch.int32)
        shift = torch.empty(n_col, dtype=torch.int32)
        unpack[(1,)](words, out, coord, shift, BN=bn, W=w, BITS=bits)
        # the latent's codes: little-endian bytes, low bits first
        u = words.view(torch.uint8).to(torch.int64).view(bn, w * 4)
        per = 8 // bits
        codes = torch.stack([(u >> (k * bits)) & ((1 << bits) - 1) for k in range(per)], dim=-1).view(bn, n_col)
        assert sorted(coord.tolist()) == list(range(n_col)), coord
        want = 1024.0 + codes[:, coord.long()].double() * (2.0 ** shift.double())[None, :]
        assert torch.equal(out.double(), want), (bits, out, want)
    print("ok unpack")


if __name__ == "__main__":
    if sys.argv[1:] == ["unpack"]:
        _unpack_main()
    else:
        _main()
