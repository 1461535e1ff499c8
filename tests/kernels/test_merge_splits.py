"""The merges of split partials for calls without an attention mask, under the Triton interpreter: the one-pass merge
(``latent_attention_triton._merge_splits_kernel``, ``one_pass_merge=True``) and the fp32 multiply-add merge, one warp
a query head (``_merge_fma_kernel``, ``fma_merge=True``): random calls through the launcher must match the PyTorch
reference, and must really have run the merge drawn.

The MMA pass (its default user) needs a GPU; here the per-head split kernels write the same partials (m, l and the
value latent per split and query head), so the merge is checked on their output: GQA ratios 1-4 (G_PAD rounding),
split counts below, at and past one tile of ``MERGE_SPLITS_BLOCK`` splits (and splits with no slot: length shorter
than the split plan), exact tokens none / one / a window of several blocks with unused entries, the output split
over D or not, bf16 / fp32 / fp16 queries, fp32 and bf16 value bases. The GPU side is
benchmarks/mma_attention_gpu.py's check.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _check_cases(n_examples: int) -> None:
    import dataclasses

    import torch
    from hypothesis import given, settings
    from hypothesis import strategies as st

    sys.path.insert(0, HERE)
    from test_latent_attention_triton import _check  # noqa: E402  (the reference comparison of the kernel tests)

    from ckvp_compile.kernels import latent_attention_triton as lat
    from ckvp_compile.kernels.latent_attention_triton import DecodeConfig

    @st.composite
    def cases(draw):
        hkv = draw(st.integers(1, 2))
        kv_len = draw(st.sampled_from((5, 37, 100)))
        p = dict(seed=draw(st.integers(0, 2**16)), b=draw(st.integers(1, 2)), hkv=hkv,
                 ratio=draw(st.sampled_from((1, 2, 3, 4))), d=draw(st.sampled_from((32, 64))), kv_len=kv_len,
                 s=1, extra=draw(st.integers(0, 3)),
                 rk=draw(st.lists(st.integers(1, 16), min_size=hkv, max_size=hkv)),
                 rv=draw(st.lists(st.integers(1, 16), min_size=hkv, max_size=hkv)),
                 kfmt=draw(st.sampled_from(("int4/32", "int8/32", "float"))),
                 vfmt=draw(st.sampled_from(("int4/32", "mxint8/8", "float"))), rope="none", rd=0, mask=None,
                 mask_shape="bhsk", mask_p=0.0,
                 dtype=draw(st.sampled_from((torch.float32, torch.bfloat16, torch.float16))),
                 pos_dtype=torch.int32, win=draw(st.sampled_from((0, 1, 3, 40))),
                 unused=draw(st.sampled_from((0, 0, 2))))
        # one tile of 16 slots per split: 1 .. 7 splits (the fixed cases below take more than one tile of partials)
        fma = draw(st.booleans())
        cfg = DecodeConfig(block_n=16, block_r=16, num_warps=1, min_tiles=1, block_n_v=16, target_programs=1,
                           split=draw(st.sampled_from((None, 1, 3, 7))), one_pass_merge=not fma, fma_merge=fma,
                           reduce_split_d=draw(st.booleans()))
        return p, cfg

    @settings(max_examples=n_examples, deadline=None, derandomize=True, database=None)
    @given(cases())
    def prop(case):
        p, cfg = case
        _check(p, cfg)
        assert lat._LAST_LAUNCH["one_pass_merge"] is cfg.one_pass_merge, lat._LAST_LAUNCH
        assert lat._LAST_LAUNCH["fma_merge"] is cfg.fma_merge, lat._LAST_LAUNCH
        assert lat._LAST_LAUNCH["reduce_split_d"] is cfg.reduce_split_d

    prop()
    # the fixed corners: more splits than one tile of partials, a window longer than one block of exact tokens,
    # both D forms; and a masked call keeps the per-head merge
    base = dict(seed=3, b=2, hkv=2, ratio=3, d=32, kv_len=40 * 16 + 3, s=1, extra=2, rk=[12, 5], rv=[7, 9],
                kfmt="int4/32", vfmt="int8/32", rope="none", rd=0, mask=None, mask_shape="bhsk", mask_p=0.0,
                dtype=torch.float32, pos_dtype=torch.int32, win=40, unused=2)
    cfg = DecodeConfig(block_n=16, block_r=16, num_warps=1, min_tiles=1, block_n_v=16, split=41,
                       one_pass_merge=True)
    fcfg = dataclasses.replace(cfg, fma_merge=True)  # (it takes precedence over one_pass_merge)
    # (one sequence and KV head for the four long calls: the interpreter's time grows with the programs, and the
    # corner is the split count; two of each in the calls below)
    one = dict(base, b=1, hkv=1, rk=[12], rv=[7])
    for split_d in (True, False):
        for c in (cfg, fcfg):
            _check(one, dataclasses.replace(c, reduce_split_d=split_d))
            assert lat._LAST_LAUNCH["n_split"] == 41 and lat._LAST_LAUNCH["fma_merge"] is (c is fcfg)
            assert lat._LAST_LAUNCH["one_pass_merge"] is (c is cfg)
    for c in (cfg, fcfg):  # empty splits; two query tokens at GQA 4 in bf16 (the fma merge's (s, head) grid axis)
        _check(dict(base, win=0, unused=0, kv_len=5, ratio=1), dataclasses.replace(c, split=3))
    _check(dict(base, s=2, ratio=4, dtype=torch.bfloat16, win=3, kv_len=7 * 16 + 5), dataclasses.replace(fcfg, split=7))
    assert lat._LAST_LAUNCH["fma_merge"] is True
    _check(dict(base, mask="bool", mask_shape="b1sk", mask_p=0.3, kv_len=100, win=20), dataclasses.replace(fcfg, split=5))
    assert lat._LAST_LAUNCH["one_pass_merge"] is False  # a mask: the per-head merge applies it
    assert lat._LAST_LAUNCH["fma_merge"] is False


def _main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _check_cases(int(os.environ.get("CKVP_MERGE_EXAMPLES", "6")))
    print("ok")


def test_merges_match_reference_under_interpreter():
    """The random and fixed cases above, in a child process under the interpreter."""
    pytest.importorskip("triton")
    pytest.importorskip("hypothesis")
    from ckvp_compile.testing.interpreter import run_under_triton_interpreter

    proc = run_under_triton_interpreter(__file__, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.strip().splitlines()[-1] == "ok"


if __name__ == "__main__":
    _main()


@pytest.mark.parametrize("split_d", [False, True])
def test_merges_compile_for_sm90_without_spills(split_d):
    """The one-pass and fma merges at Mixtral's 32:8 heads, head_dim 128, rank 32 (the MMA pass's shapes), compiled
    for sm_90a: no register spills (a first build of the one-pass merge padded the partials' tile to 16 heads and
    spilled: 850 us a call on the H200); the fma merge's grid has a program per query head and channel slice."""
    from ckvp_compile.testing.sm90 import compile_latent_attention, ptxas_stats, sm90_compile_available

    why = sm90_compile_available()
    if why:
        pytest.skip(why)
    from ckvp_compile.bench.attention import make_inputs
    from ckvp_compile.kernels.latent_attention_triton import DecodeConfig

    args = make_inputs(8, 4096, "int4/32", 32, dev="cpu", heads=(32, 8), rope="none")
    for fma in (False, True):
        cfg = DecodeConfig(words=True, one_pass_merge=True, fma_merge=fma, reduce_split_d=split_d)
        merge = [k for k in compile_latent_attention(args, cfg) if k.name in ("one-pass merge", "fma merge")]
        assert len(merge) == 1 and merge[0].name == ("fma merge" if fma else "one-pass merge"), merge
        assert merge[0].grid == (8 * 8, 4 if fma else 1, 4 if split_d else 1)
        stats = ptxas_stats(merge[0].compiled.asm["ptx"])
        assert stats["spill_store_bytes"] in (0, None), stats["ptxas"]
