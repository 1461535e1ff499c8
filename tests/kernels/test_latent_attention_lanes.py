"""The lane table-free kernel (ckvp_compile/kernels/latent_attention_lanes.py) against ``latent_attention_ref`` under
the Triton interpreter (a child process, as tests/kernels/test_latent_attention_triton.py), and its layout.

Property test (hypothesis, tiny shapes, derandomized): no RoPE (post-RoPE key bases), batch 1-2, Hkv 1-4, GQA
ratios 1-5 (non-power-of-two included), unequal per-head ranks for K and V drawn mostly so that every head's code
bytes start on a 4-byte word (rank-0 heads included; now and then an unaligned rank, which the launcher leaves to
the other kernels), int8 / int4 / int2 latents whose blocks hold whole 32-bit words (one to several blocks per
head), 1-3 query tokens, exact window tokens (unused entries too), bool / additive masks of several broadcast
shapes, pages, padded rows, lane targets (heads per program), tile sizes, context splits and loop pipelining; the
launcher runs the lane kernel exactly where its layout and row alignment apply. Fixed cases: the launcher picks the
lane kernel for table-free calls when asked (G = 1 and G = 4), and leaves calls with RoPE tables, MX latents, heads
off 4-byte words and value ranks past ``MAX_VALUE_WORDS`` words to the other kernels (which still match the
reference); the default config runs it for a table-free G = 1 call. The launcher's fresh buffers (workspaces) are
filled with NaN, so a kernel that leaves part of one unwritten fails every time. Bound: relative error (Frobenius)
<= 1e-3.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: blocks of whole 32-bit words of codes (block * bits >= 32): the formats the lane kernel can take
INT_FORMATS = ("int8/32", "int8/8", "int8/4", "int4/32", "int4/16", "int4/8", "int2/16", "int2/32")
#: ranks whose heads keep later heads' code bytes on 4-byte words at every width (multiples of 16), at int4 / int8
#: (multiples of 8), at int8 (4, 12); 3 and 13 never (the launcher's fallback)
K_RANKS = (0, 4, 8, 12, 16, 16, 24, 32, 32, 3)
V_RANKS = (0, 4, 8, 8, 12, 16, 16, 20, 24, 28, 32, 13)


def _offsets(ranks):
    out = [0]
    for r in ranks:
        out.append(out[-1] + r)
    return out


def _lanes_case(draw, st, torch):
    hkv = draw(st.integers(1, 4))
    kv_len = draw(st.integers(1, 48))
    d = draw(st.sampled_from((16, 32, 64)))
    p = dict(seed=draw(st.integers(0, 2**16)), b=draw(st.integers(1, 2)), hkv=hkv,
             ratio=draw(st.sampled_from((1, 2, 3, 4, 5))), d=d, kv_len=kv_len, s=draw(st.integers(1, min(3, kv_len))),
             extra=draw(st.integers(0, 4)),
             rk=draw(st.lists(st.sampled_from(K_RANKS), min_size=hkv, max_size=hkv)),
             rv=draw(st.lists(st.sampled_from(V_RANKS), min_size=hkv, max_size=hkv)),
             kfmt=draw(st.sampled_from(INT_FORMATS)), vfmt=draw(st.sampled_from(INT_FORMATS)), rope="none", rd=0,
             mask=draw(st.sampled_from((None, "bool", "add"))),
             mask_shape=draw(st.sampled_from(("bhsk", "b1sk", "1hsk", "sk", "k"))),
             mask_p=draw(st.sampled_from((0.2, 0.7))),
             dtype=draw(st.sampled_from((torch.float32, torch.bfloat16, torch.float16))), pos_dtype=torch.int32,
             win=draw(st.sampled_from((0, 0, 3, 17))), unused=draw(st.sampled_from((0, 0, 1, 2))),
             page=draw(st.sampled_from((0, 0, 4, 8))), layout=draw(st.sampled_from(("row-major", "padded"))))
    if max(p["rk"]) == 0:
        p["rk"][0] = 16
    if max(p["rv"]) == 0:
        p["rv"][0] = 16
    return p


def rows_on_words(p: dict) -> bool:
    """Whether a case's latent rows meet the launcher's alignment check of the lane and word passes
    (``_word_rows``): rows on 4-byte words (the row stride of the row-major or padded latents, paged or not; a dim
    of size 1 is exempt) and the fp16 scales / mins on even bytes (the code bytes before them)."""
    from ckvp_compile.kernels.latent_format import parse_latent_format
    from ckvp_compile.kernels.latent_layout import padded_units

    ok = True
    for f, o in ((parse_latent_format(p["kfmt"]), _offsets(p["rk"])), (parse_latent_format(p["vfmt"]), _offsets(p["rv"]))):
        w = f.row_width(o)
        stride = w if p.get("layout", "row-major") == "row-major" else padded_units(w, min_width=0) + 16
        s_max = p["kv_len"] + p.get("extra", 0)
        if p.get("page"):
            ok = ok and stride % 4 == 0
        else:  # the launcher leaves size-1 dims' strides unchecked (never stepped along); _words wants them even
            ok = (ok and stride % 2 == 0 and (p["b"] == 1 or s_max * stride % 4 == 0)
                  and (s_max == 1 or stride % 4 == 0))
        ok = ok and sum(f.code_bytes(o)) % 2 == 0
    return ok


def _expects_lanes(p: dict, cfg) -> tuple[dict | None, bool]:
    """(lanes_layout of the case, whether the launcher should run the lane kernel): the layout, and whether the rows
    meet the launcher's alignment check besides (:func:`rows_on_words`)."""
    from ckvp_compile.kernels.latent_attention_lanes import lanes_layout
    from ckvp_compile.kernels.latent_format import parse_latent_format

    kf, vf = parse_latent_format(p["kfmt"]), parse_latent_format(p["vfmt"])
    lay = lanes_layout(cfg.lanes, p["ratio"], kf, vf, _offsets(p["rk"]), _offsets(p["rv"]), max(p["rk"]),
                       max(p["rv"]), p["hkv"], 1, 1)
    return (None, False) if lay is None else (lay, rows_on_words(p))


class _NanEmpty:
    """The ``torch`` module with ``empty`` filling float tensors with NaN: swapped into the launcher's module while
    it runs, so a kernel that leaves part of a workspace unwritten (which the next kernel reads) fails every time,
    not only where freed memory happens to hold a NaN or inf."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def empty(self, *args, **kwargs):
        t = self._torch.empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t


def _main() -> None:
    import dataclasses

    import torch
    from hypothesis import given, settings
    from hypothesis import strategies as st

    import test_latent_attention_triton as base_tests
    from ckvp_compile.kernels import latent_attention_triton as lat
    from ckvp_compile.kernels.latent_attention_lanes import MAX_VALUE_WORDS
    from ckvp_compile.kernels.latent_attention_triton import DecodeConfig

    assert os.environ.get("TRITON_INTERPRET") == "1"
    lat.torch = _NanEmpty(torch)  # the launcher's fresh buffers hold NaN (this process only runs these checks)

    def check(p, cfg):
        base_tests.check_as_close_as_per_head(p, cfg, "lanes")
        lay, expected = _expects_lanes(p, cfg)
        # the kernel ran wherever its layout and the rows' alignment apply (else the launcher's fallback did,
        # checked the same way), with the layout's heads per program
        ran = lat._LAST_LAUNCH["lanes"]
        assert (ran > 0) == expected, (p, cfg, lay, dict(lat._LAST_LAUNCH))
        assert not expected or ran == lay["NH"], (p, cfg, lay, ran)
        return expected

    # a table-free call takes it (G = 1 and G = 4); not one with RoPE tables, MX latents, heads off 4-byte words or
    # value ranks past MAX_VALUE_WORDS words, which the other kernels take (and match the reference)
    # one sequence (the interpreter's time is per program), two where the batch is part of the case
    eq = dict(seed=1, b=1, hkv=4, ratio=1, d=32, kv_len=37, s=1, extra=3, rk=[16] * 4, rv=[16] * 4, kfmt="int4/32",
              vfmt="int4/32", rope="none", rd=0, mask=None, mask_shape="bhsk", mask_p=0.3, dtype=torch.bfloat16,
              pos_dtype=torch.int32)
    on = DecodeConfig(lanes=16)
    for case in (eq, dict(eq, b=2, ratio=4, rk=[24, 40, 8, 0], rv=[32, 8, 16, 16], mask="bool", mask_shape="b1sk"),
                 dict(eq, mask="finfo", s=2, win=3, dtype=torch.float32)):  # a head wholly masked by finfo.min
        assert check(case, on)
        assert lat._LAST_LAUNCH["lanes"] > 0, dict(lat._LAST_LAUNCH)
    for case in (dict(eq, rope="rotate_half", rd=16),
                 dict(eq, kfmt="mxint4/32"),  # MX latents
                 dict(eq, vfmt="int2/16", rv=[8, 16, 40, 24]),  # value code bytes 2, 4, 10, 6: heads off words
                 dict(eq, rv=[8 * MAX_VALUE_WORDS + 8, 8, 16, 16])):  # int4: value ranks past MAX_VALUE_WORDS words
        base_tests._check(case, on)
        assert lat._LAST_LAUNCH["lanes"] == 0, (case, dict(lat._LAST_LAUNCH))
    base_tests._check(eq, None)  # the default config runs it at G = 1 without tables
    assert lat._LAST_LAUNCH["lanes"] > 0, dict(lat._LAST_LAUNCH)

    cfg0 = DecodeConfig(num_warps=1, min_tiles=1, target_programs=4, lanes=16, block_n_l=16, loop_stages_l=None)
    # fixed: one KV head; several query tokens with exact window tokens (unused ones too) and additive masks;
    # several quantization blocks per head (int4/8, int8/4 keys); int8 / int2 values; paged and padded rows; one
    # mask row shared by the heads; GQA with a non-power-of-two group; lanes below one KV head's query heads;
    # value ranks padded below the workspace's 16 columns (int8 rank 8, int4 rank 8: RVP 8 < RV_PAD 16)
    for case, c in ((dict(eq, hkv=1, rk=[16], rv=[16]), cfg0),
                    (dict(eq, hkv=2, ratio=3, rk=[40, 32], rv=[16, 32], kfmt="int4/8", vfmt="int2/16", s=2, win=17,
                          unused=2, mask="add"), dataclasses.replace(cfg0, lanes=32)),
                    (dict(eq, b=2, ratio=2, rk=[12, 4, 0, 8], rv=[8, 8, 4, 0], page=4, seed=3, layout="padded",
                          kfmt="int8/4", vfmt="int8/8"), dataclasses.replace(cfg0, block_n_l=32, loop_stages_l=2)),
                    (dict(eq, rk=[32, 16, 16, 8], kfmt="int8/32", vfmt="int2/32", rv=[32, 64, 16, 48], s=2, win=3,
                          unused=2, mask="add", mask_shape="1hsk", dtype=torch.float32),
                     dataclasses.replace(cfg0, lanes=4, loop_stages_l=2)),
                    (dict(eq, mask="bool", mask_shape="sk", s=2, page=8, seed=4), dataclasses.replace(cfg0, lanes=1)),
                    (dict(eq, ratio=5, hkv=3, rk=[8, 24, 16], rv=[4, 12, 8], kfmt="int4/8", vfmt="int8/4",
                          dtype=torch.float16), dataclasses.replace(cfg0, block_n_l=32, split=2)),
                    # the widest value ranks taken (int4: MAX_VALUE_WORDS words of codes)
                    (dict(eq, hkv=2, ratio=2, rk=[16, 8], rv=[8 * MAX_VALUE_WORDS, 8], s=2, win=3, mask="add",
                          mask_shape="b1sk"), cfg0),
                    # per-sequence (online, 4-D) bases: the query fold and the value projection step per sequence
                    (dict(eq, b=2, rk=[24, 40, 8, 0], rv=[32, 8, 16, 16], online=True, seed=5), cfg0)):
        assert check(case, c), case

    @st.composite
    def cases(draw):
        p = _lanes_case(draw, st, torch)
        cfg = DecodeConfig(num_warps=1, split=draw(st.sampled_from((None, 1, 2, 3))), min_tiles=1, target_programs=8,
                           lanes=draw(st.sampled_from((1, 4, 16, 32))), block_n_l=draw(st.sampled_from((16, 32))),
                           loop_stages_l=draw(st.sampled_from((None, 2))))
        return p, cfg

    # 12: the derandomized draws past the twelfth were variations of it (the GQA case of ratio 4, s = 3)
    n = int(os.environ.get("CKVP_LANES_EXAMPLES", "12"))

    @settings(max_examples=n, deadline=None, derandomize=True, database=None)
    @given(cases())
    def prop(case):
        ran.append(check(*case))

    ran = []
    prop()
    assert 3 * sum(ran) >= len(ran), ran  # most drawn cases reach the kernel (at least a third)
    print("ok", n, sum(ran))


def test_lanes_kernel_matches_reference_under_interpreter():
    pytest.importorskip("triton")
    pytest.importorskip("hypothesis")
    from ckvp_compile.testing.interpreter import run_under_triton_interpreter

    proc = run_under_triton_interpreter(__file__, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("ok")


def test_default_config_takes_the_lane_pass_for_table_free_g1():
    """default_config: the lane pass for table-free G = 1 calls up to rank 128 (where its layout applies at launch;
    else the chunk pass it also sets); not with RoPE tables, not for GQA (the absorbed pass), not past rank 128."""
    pytest.importorskip("triton")
    from ckvp_compile.kernels.latent_attention_triton import default_config

    for rp in (16, 32, 64, 128):
        cfg = default_config(1, rp, paired=True, table_free=True)
        assert cfg.lanes > 0 and cfg.head_chunks > 0, (rp, cfg)
    assert default_config(1, 16, table_free=True, rank_v=256).lanes == 0
    assert default_config(1, 256, table_free=True).lanes == 0
    assert default_config(1, 32).lanes == 0 and default_config(1, 32, paired=True).lanes == 0
    assert default_config(4, 32, table_free=True).lanes == 0 and default_config(4, 32, table_free=True).absorbed > 0


def test_lanes_layout_claims_hold():
    """lanes_layout / lanes_heads: chunks of NH KV heads (a power of two) whose query heads stay within the lane
    target (or one KV head), covering every KV head; padded ranks powers of two of at least one code word and the
    rank; None for what the kernel does not read (lanes 0, MX / float latents, unit-major rows, heads off 4-byte
    words, blocks of part of a word, value ranks past MAX_VALUE_WORDS words)."""
    pytest.importorskip("triton")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ckvp_compile.kernels.latent_attention_lanes import MAX_VALUE_WORDS, lanes_heads, lanes_layout
    from ckvp_compile.kernels.latent_format import parse_latent_format

    i4 = parse_latent_format("int4/32")
    lay = lanes_layout(16, 1, i4, i4, _offsets([16] * 16), _offsets([16] * 16), 16, 16, 16, 1, 1)
    assert lay == dict(RKP=16, RVP=16, NH=16, n_chunks=1, GP=1)
    lay = lanes_layout(16, 4, i4, i4, _offsets([32] * 8), _offsets([32] * 8), 32, 32, 8, 1, 1)
    assert lay["NH"] == 4 and lay["n_chunks"] == 2 and lay["GP"] == 4 and lay["RVP"] == 32
    lay = lanes_layout(16, 3, i4, parse_latent_format("int2/16"), _offsets([24, 40, 8, 0]), _offsets([16, 64, 16, 32]),
                       40, 64, 4, 1, 1)
    assert lay["RKP"] == 64 and lay["RVP"] == 64 and lay["GP"] == 4 and lay["NH"] == 4
    lay = lanes_layout(1, 5, i4, i4, _offsets([8]), _offsets([1]), 8, 1, 1, 1, 1)  # one word of codes at least
    assert lay["NH"] == 1 and lay["GP"] == 8 and lay["RKP"] == 8 and lay["RVP"] == 8
    o16 = _offsets([16])
    assert lanes_layout(0, 1, i4, i4, o16, o16, 16, 16, 1, 1, 1) is None  # off
    for bad in ("mxint4/32", "float", "int4/4", "int2/8", "int8/2", "int4/6"):  # MX, float, blocks of part of a word
        f = parse_latent_format(bad)
        assert lanes_layout(16, 1, f, i4, o16, o16, 16, 16, 1, 1, 1) is None, bad
        assert lanes_layout(16, 1, i4, f, o16, o16, 16, 16, 1, 1, 1) is None, bad
    assert lanes_layout(16, 1, i4, i4, o16, o16, 16, 16, 1, 4, 1) is None  # unit-major rows
    assert lanes_layout(16, 1, i4, i4, o16, o16, 16, 16, 1, 1, 4) is None
    i2 = parse_latent_format("int2/16")
    off = _offsets([8, 16, 40, 24])  # int2 code bytes 2, 4, 10, 6: heads off 4-byte words
    assert lanes_layout(16, 1, i4, i2, _offsets([16] * 4), off, 16, 40, 4, 1, 1) is None
    assert lanes_layout(16, 1, i2, i4, off, _offsets([16] * 4), 40, 16, 4, 1, 1) is None
    assert lanes_layout(16, 1, i4, i4, _offsets([16, 3]), _offsets([16, 16]), 16, 16, 2, 1, 1) is not None  # last head
    # a rank-0 head reads no word, wherever its (empty) codes start: int2 code bytes 2, 0, 4 (head 1 off a word)
    assert lanes_layout(16, 1, i2, i4, _offsets([8, 0, 16]), _offsets([16] * 3), 16, 16, 3, 1, 1) is None
    assert lanes_layout(16, 1, i2, i4, _offsets([8, 0]), _offsets([16] * 2), 8, 16, 2, 1, 1) is not None
    # value ranks past MAX_VALUE_WORDS words (int4: 8 codes a word, int8: 4); keys may be wider
    wide = 8 * MAX_VALUE_WORDS
    assert lanes_layout(16, 1, i4, i4, o16, _offsets([wide]), 16, wide, 1, 1, 1)["RVP"] == wide
    assert lanes_layout(16, 1, i4, i4, o16, _offsets([wide + 8]), 16, wide + 8, 1, 1, 1) is None
    i8 = parse_latent_format("int8/32")
    assert lanes_layout(16, 1, i4, i8, o16, _offsets([wide // 2 + 1]), 16, wide // 2 + 1, 1, 1, 1) is None
    assert lanes_layout(16, 1, i8, i4, _offsets([128]), _offsets([32]), 128, 32, 1, 1, 1)["RKP"] == 128

    bits_of = {"int8/32": 8, "int8/4": 8, "int4/8": 4, "int4/32": 4, "int2/16": 2, "int2/32": 2}

    @settings(max_examples=200, deadline=None, derandomize=True, database=None)
    @given(st.integers(0, 64), st.integers(1, 8), st.sampled_from(sorted(bits_of)), st.sampled_from(sorted(bits_of)),
           st.integers(1, 16), st.data())
    def prop(lanes, group, kname, vname, hkv, data):
        kf, vf = parse_latent_format(kname), parse_latent_format(vname)
        rk = data.draw(st.lists(st.sampled_from((0, 4, 8, 16, 24, 32, 40, 64, 3)), min_size=hkv, max_size=hkv))
        rv = data.draw(st.lists(st.sampled_from((0, 4, 8, 16, 24, 32, 64, 5)), min_size=hkv, max_size=hkv))
        rk[0], rv[0] = max(rk[0], 1), max(rv[0], 1)
        ko, vo = _offsets(rk), _offsets(rv)
        lay = lanes_layout(lanes, group, kf, vf, ko, vo, max(rk), max(rv), hkv, 1, 1)
        aligned = all(c % 4 == 0 for f, o in ((kf, ko), (vf, vo))
                      for c, n in zip(_offsets(f.code_bytes(o))[:-1], f.code_bytes(o)) if n)  # rank 0: no words
        rvp = 1 << (max(max(rv), 32 // vf.bits) - 1).bit_length()  # the next power of two
        fits = rvp * vf.bits <= 32 * MAX_VALUE_WORDS
        assert (lay is not None) == (lanes > 0 and aligned and fits), (lanes, group, kname, vname, rk, rv, lay)
        if lay is None:
            return
        gp, nh = lay["GP"], lay["NH"]
        assert gp >= group and gp & (gp - 1) == 0 and gp < 2 * group
        assert nh & (nh - 1) == 0 and (nh * gp <= lanes or nh == 1) and nh < 2 * hkv
        assert lay["n_chunks"] * nh >= hkv and (lay["n_chunks"] - 1) * nh < hkv
        assert nh == lanes_heads(gp, lanes, hkv)
        for key, f, r in (("RKP", kf, max(rk)), ("RVP", vf, max(rv))):
            rp = lay[key]
            assert rp & (rp - 1) == 0 and rp >= 32 // f.bits and rp >= r and (rp < 2 * r or rp == 32 // f.bits)
        assert lay["RVP"] * vf.bits <= 32 * MAX_VALUE_WORDS

    prop()
    # the most heads whose query heads stay within the target: doubling NH would pass it or the KV heads
    for gp in (1, 2, 4, 8):
        for lanes in (0, 1, 4, 16, 32, 64):
            for hkv in (1, 2, 3, 8, 16, 40):
                nh = lanes_heads(gp, lanes, hkv)
                assert nh >= 1 and (nh == 1 or nh * gp <= lanes) and (2 * nh * gp > lanes or nh >= hkv)


if __name__ == "__main__":
    _main()
