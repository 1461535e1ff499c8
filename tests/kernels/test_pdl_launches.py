"""Programmatic dependent launch along the MMA pass (query fold -> pass -> merge), on CPU.

Nothing here runs on a GPU (benchmarks/mma_attention_gpu.py ``--variants pdl`` does, CUDA graphs included). These
tests check what decides correctness before that:

* :func:`~ckvp_compile.kernels.latent_attention_triton.pdl_launches` is off off CUDA, under the interpreter and below
  sm_90; on sm_90 ``CKVP_PDL=1`` / ``0`` decides, else :data:`PDL_GPU_CHECKED` or a split of at most
  :data:`PDL_MAX_TILES` tiles;
* the launcher (the real ``_launch``, kernels recorded) passes ``launch_pdl`` and ``PDL`` to the pass and to the
  merge, and ``pdl`` to the fold, exactly when it is on, and never on the other passes; the fold waits itself only
  with ``pdl_fold``;
* compiled for sm_90a, each kernel has its instructions where the chain needs them: the fold
  ``griddepcontrol.launch_dependents`` and no wait (with ``PDL_WAIT``: a wait first, before any load); the pass
  ``wait`` before ``launch_dependents``, and before ``wait`` only scalar loads of what earlier launches wrote (head
  metadata, exact-token slots, page-table entries) and its first tile's L2 prefetch, none of the folded query; the
  merge ``wait`` before any fp32 load (the partials) and before any store (only the bf16 value basis and query are
  read before it); without PDL, none of them.
"""

from __future__ import annotations

import re

import pytest
import torch

lam = pytest.importorskip("ckvp_compile.kernels.latent_attention_mma")

from ckvp_compile.kernels import latent_attention_absorbed as laa  # noqa: E402
from ckvp_compile.kernels import latent_attention_triton as lat  # noqa: E402
from test_mma_unit_guards import _inputs, _launch, _Recorder, _unit_from, on_fake_gpu  # noqa: E402,F401


def test_pdl_is_off_off_cuda_and_until_checked(monkeypatch):
    monkeypatch.delenv("CKVP_PDL", raising=False)
    assert lat.pdl_launches(torch.device("cpu")) is False
    monkeypatch.setenv("CKVP_PDL", "1")
    assert lat.pdl_launches(torch.device("cpu")) is False  # never off CUDA
    monkeypatch.setattr(lat, "_interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert lat.pdl_launches(torch.device("cuda", 0)) is True
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert lat.pdl_launches(torch.device("cuda", 0)) is False  # griddepcontrol needs sm_90
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv("CKVP_PDL", "0")
    assert lat.pdl_launches(torch.device("cuda", 0)) is False
    monkeypatch.delenv("CKVP_PDL")
    assert lat.pdl_launches(torch.device("cuda", 0)) is lat.PDL_GPU_CHECKED
    # by default on for short splits only (the fixed costs' share), whatever PDL_GPU_CHECKED says for the others
    assert lat.pdl_launches(torch.device("cuda", 0), lat.PDL_MAX_TILES) is True
    assert lat.pdl_launches(torch.device("cuda", 0), lat.PDL_MAX_TILES + 1) is lat.PDL_GPU_CHECKED
    monkeypatch.setenv("CKVP_PDL", "0")
    assert lat.pdl_launches(torch.device("cuda", 0), 1) is False
    monkeypatch.delenv("CKVP_PDL")
    monkeypatch.setattr(lat, "_interpreting", lambda: True)
    monkeypatch.setenv("CKVP_PDL", "1")
    assert lat.pdl_launches(torch.device("cuda", 0)) is False


@pytest.mark.parametrize("on", [True, False])
@pytest.mark.parametrize("b", [2, 64])  # the merge split over D (few rows) and the one-pass merge
@pytest.mark.parametrize("fma", [False, True])  # latent_attention_triton.fma_merge_on: the fma merge either way
def test_launcher_chains_the_mma_launches_only_when_on(monkeypatch, on_fake_gpu, on, b, fma):
    rec = dict(unit=_Recorder(), reduce=_Recorder(), merge=_Recorder(), fma=_Recorder())
    folds = []
    monkeypatch.setattr(lam, "_mma_unit_kernel", rec["unit"])
    monkeypatch.setattr(lat, "_latent_attention_reduce_kernel", rec["reduce"])
    monkeypatch.setattr(lat, "_merge_splits_kernel", rec["merge"])
    monkeypatch.setattr(lat, "_merge_fma_kernel", rec["fma"])
    monkeypatch.setattr(lat, "fma_merge_on", lambda: fma)
    monkeypatch.setattr(lat, "_interpreting", lambda: False)
    monkeypatch.setattr(lat, "unsupported_reason", lambda *a, **k: None)
    monkeypatch.setattr(lat, "_fold_query", lambda q, *a, **k: folds.append(a) or torch.zeros(1))
    monkeypatch.setattr(lat, "pdl_launches", lambda device, tiles_per_split=None: on)
    monkeypatch.setattr(lat, "_sm_count", lambda device: 100)  # rows B * Hkv: 4 split over D, 128 not
    saved = dict(lat._LAST_LAUNCH)
    try:
        args = _inputs(b=b, s_max=128, hkv=2, g=4)
        lk, _ = _unit_from(args[1])
        lv, _ = _unit_from(args[2])
        _launch(args, lk, lv)
        assert lat._LAST_LAUNCH["mma"] and lat._LAST_LAUNCH["pdl"] is on
    finally:
        lat._LAST_LAUNCH.clear()
        lat._LAST_LAUNCH.update(saved)
    (unit,) = rec["unit"].calls
    merges = rec["reduce"].calls + rec["merge"].calls + rec["fma"].calls
    assert len(merges) == 1
    assert (rec["fma"].calls != []) == fma
    assert (rec["merge"].calls != []) == (b == 64 and not fma)  # the one-pass merge where the rows fill the SMs
    assert folds[0][-1] is on  # _fold_query's pdl argument
    for _, _, kw in (unit, merges[0]):
        assert kw["PDL"] is on
        assert kw.get("launch_pdl", False) is on


_PTRS = {"q_ptr": "*bf16", "nk_ptr": "*bf16", "nv_ptr": "*bf16", "bv_ptr": "*bf16", "slots_ptr": "*i64",
         "mask_ptr": "*i1", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": "*bf16",
         "qf_ptr": "*fp32", "bk_ptr": "*bf16", "kmeta_ptr": "*i32"}


def _compile(kernel, constexprs: dict, pdl: bool, num_warps: int = 4):
    """``kernel`` (a ``@triton.jit``) compiled for sm_90a with bf16 inputs, fp32 partials and int32 scalars."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {}
    for p in kernel.params:
        sig[p.name] = ("constexpr" if p.is_constexpr else _PTRS[p.name] if p.name.endswith("_ptr")
                       else "fp32" if p.name == "qk_scale" else "i32")
    src = ASTSource(kernel, sig, constexprs={**constexprs, "PDL": pdl})
    opts = {"num_warps": num_warps, **({"launch_pdl": True} if pdl else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]


def _skip_without_sm90():
    from ckvp_compile.testing.sm90 import sm90_compile_available

    why = sm90_compile_available()
    if why:
        pytest.skip(why)


MERGE = dict(G_PAD=16, D_PAD=128, RV_PAD=32, BLOCK_D=128, BV_EXACT=True, F32_DOT=False, NB=16, SPLIT_BLOCK=16,
             SPLIT_D=False)


@pytest.mark.parametrize("which", ["one-pass", "per-head", "fma"])
def test_merge_waits_before_the_partials_and_its_stores(which):
    _skip_without_sm90()
    if which == "one-pass":
        kernel, cx = lat._merge_splits_kernel, dict(MERGE, G_SMALL=4)
    elif which == "fma":
        kernel, cx = lat._merge_fma_kernel, dict(D_PAD=128, RV_PAD=32, BLOCK_D=32, NB=16, SPLIT_BLOCK=32)
    else:
        kernel, cx = lat._latent_attention_reduce_kernel, dict(MERGE, MASK=0, G_LOOP=4)
    ptx = _compile(kernel, cx, True)
    assert ptx.count("griddepcontrol.wait") == 1 and "launch_dependents" not in ptx
    pre = ptx[:ptx.index("griddepcontrol.wait")]
    assert "st.global" not in pre
    assert not re.search(r"ld\.global[.\w]*\.(b32|f32|v2\.b32|v4\.b32)", pre)  # no partials (fp32) before it
    if which != "per-head":  # the value basis and the query (and the fma merge's exact tokens), before the wait
        assert re.search(r"ld\.global[.\w]*\.b16", pre)
    else:
        assert "ld.global" not in pre
    assert "griddepcontrol" not in _compile(kernel, cx, False)


def test_fold_lets_the_pass_launch_and_does_not_wait():
    _skip_without_sm90()
    cx = dict(QP=16, D_PAD=128, RKP=32, RKF=32, Q_EXACT=True, BK_EXACT=True, F32_DOT=False)
    ptx = _compile(laa._fold_query_kernel, cx, True)
    assert "griddepcontrol.launch_dependents" in ptx and "griddepcontrol.wait" not in ptx
    assert "griddepcontrol" not in _compile(laa._fold_query_kernel, cx, False)


def test_fold_as_a_dependent_waits_before_it_reads_and_triggers():
    """PDL_WAIT (``pdl_fold``): the fold waits for the kernel before it first, before any load, then lets the MMA
    pass launch (whose reads before its own wait then follow every earlier kernel)."""
    _skip_without_sm90()
    cx = dict(QP=16, D_PAD=128, RKP=32, RKF=32, Q_EXACT=True, BK_EXACT=True, F32_DOT=False, PDL_WAIT=True)
    ptx = _compile(laa._fold_query_kernel, cx, True)
    wait, trig = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    assert 0 <= wait < trig and "ld.global" not in ptx[:wait] and "ld.global" in ptx[trig:]


def test_fold_waits_only_when_asked(monkeypatch):
    """The launcher launches the fold as a programmatic dependent (``launch_pdl``, ``PDL_WAIT``) only where the
    chain is on and ``pdl_fold`` says so (``CKVP_PDL_FOLD``; off by default)."""
    calls = []

    class _Fold:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append(k)

    monkeypatch.setattr(laa, "_fold_query_kernel", _Fold())
    q = torch.zeros(1, 4, 1, 16)
    bk = torch.zeros(1, 16, 32)
    meta = torch.zeros(3, dtype=torch.int32)
    for env, pdl, want in ((None, True, False), ("1", True, True), ("1", False, False), ("0", True, False)):
        if env is None:
            monkeypatch.delenv("CKVP_PDL_FOLD", raising=False)
        else:
            monkeypatch.setenv("CKVP_PDL_FOLD", env)
        lat._fold_query(q, bk, meta, 32, 1.0, False, pdl)
        kw = calls[-1]
        assert kw.get("launch_pdl", False) is want and kw.get("PDL_WAIT", False) is want and kw["PDL"] is pdl
    assert lat.PDL_FOLD_GPU_CHECKED is False


@pytest.mark.parametrize("bits", [8, 4])
def test_mma_pass_waits_before_the_folded_query_and_triggers_before_its_stores(bits):
    _skip_without_sm90()
    k = lam.compile_for_sm90(4, 4, 64, unit_major=True, bits=bits, lanes=True, pdl=True)
    ptx = k.asm["ptx"]
    trig, wait = ptx.find("griddepcontrol.launch_dependents"), ptx.find("griddepcontrol.wait")
    assert 0 <= wait < trig and ptx.count("griddepcontrol.wait") == 1 and ptx.count("launch_dependents") == 1
    assert "st.global" not in ptx[:trig] and "st.global" in ptx[trig:]  # after the tile loops, before the partials'
    # stores
    # before the wait: only scalar loads of what the call's earlier launches wrote (the four head metadata words, the
    # exact tokens' slots, the split's page-table entries) and the first tile's L2 prefetch (EARLY); the folded
    # query (vector loads) after it; no store
    pre = ptx[:wait]
    loads = re.findall(r"ld\.global\S*", pre)
    assert 4 < len(loads) <= 10 and all(x in ("ld.global.b32", "ld.global.b64") for x in loads), loads
    assert re.search(r"ld\.global\.v\d", ptx[wait:]) and not re.search(r"ld\.global(\.\S+)?\.v\d", pre)
    assert "st.global" not in pre and pre.count("cp.async.bulk.prefetch.L2") == 2
    assert "griddepcontrol" not in lam.compile_for_sm90(4, 4, 64, unit_major=True, bits=bits, lanes=True).asm["ptx"]
