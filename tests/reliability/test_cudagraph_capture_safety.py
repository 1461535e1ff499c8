"""CUDA-graph capture safety of the ckvp ops' code paths, checked on CPU (issue 8).

Under ``torch.compile(mode="reduce-overhead")`` the Python launchers of the extern ckvp ops run again while the
CUDA graph is recorded; a host sync, a copy from host memory or a table first built there breaks the recording
(on the H200, run 4 of benchmarks/results/2026-11-29-reliability-h200: ``cudaErrorStreamCaptureInvalidated``,
raised by the boolean-mask gather of ``ckvp::latent_append``'s reference projection). Checked here with
:class:`~ckvp_compile.testing.capture_safety.CaptureHazards` (Python-level calls; the CPU runs the same Python as the
CUDA path except the Triton launches, whose launchers are checked under the interpreter in
tests/kernels/test_latent_attention_triton.py): the second call of each code path makes no such call. The GPU half
(a real capture of one compiled decode step, then each op alone) is benchmarks/cudagraph_capture_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckvp_compile.kernels import device_cache
from ckvp_compile.kernels import reference as ref
from ckvp_compile.kernels.latent_format import _layout_index, parse_latent_format, quantize_latent_ref
from ckvp_compile.testing.capture_safety import CaptureHazards

CPU = torch.device("cpu")
#: host-only branches a CPU run takes and a CUDA run does not: quantize_latent_ref checks values for host tensors only
HOST_ONLY = ("latent_format.py:quantize_latent_ref",)
OFFSETS = [0, 13, 20]
FORMATS = ("float", "int8", "int4/32", "int2/8", "tern", "mxint8", "mix/8:8x5+2x8,4x7")


def _record(fn, *args):
    with CaptureHazards(allow=HOST_ONLY) as rec:
        out = fn(*args)
    return out, rec.hazards


def _append_case(fmt: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    f = parse_latent_format(fmt)
    r_pad, gd, s = 16, 32, 3
    width = f.row_width(OFFSETS) if f.quantized else OFFSETS[-1]
    latent = torch.zeros(2, 9, width, dtype=torch.uint8 if f.quantized else torch.float32)
    basis = torch.randn(2, gd, r_pad, generator=g)
    for h, (a, b) in enumerate(zip(OFFSETS, OFFSETS[1:])):
        basis[h, :, b - a:] = 0.0
    x = torch.randn(2, 2, s, gd, generator=g)
    slots = torch.tensor([4, 1, 7])
    return latent, x, basis, slots, r_pad


@pytest.mark.parametrize("fmt", FORMATS)
def test_latent_append_projection_is_capture_safe_and_exact(fmt):
    """ckvp::latent_append's CUDA path (reference projection + quantizer): no boolean mask, no host data, no copy
    once the store's tables are prepared; the rows are bit-equal to the former boolean-mask gather of the same
    projection, and close to the per-head projection."""
    latent, x, basis, slots, r_pad = _append_case(fmt)
    device_cache._prepare(OFFSETS, fmt, r_pad, CPU)  # what the store does when it is built
    for _ in range(2):
        _, hazards = _record(ref.latent_append_with, latent, x, basis, OFFSETS, slots, fmt, quantize_latent_ref)
        assert not hazards, "\n".join(map(str, hazards))
    z = torch.einsum("bhsk,hkr->bshr", x.float(), basis.float())
    _, valid = ref._head_columns(OFFSETS, r_pad, CPU)
    masked = z.reshape(2, 3, -1)[..., valid.flatten()]  # the former gather
    per_head = torch.cat([torch.einsum("bsk,kr->bsr", x[:, h].float(), basis[h, :, :b - a].float())
                          for h, (a, b) in enumerate(zip(OFFSETS, OFFSETS[1:]))], -1)
    torch.testing.assert_close(masked, per_head)
    if parse_latent_format(fmt).quantized:
        masked = quantize_latent_ref(masked, OFFSETS, fmt)
    assert torch.equal(latent[:, slots], masked.to(latent.dtype))
    untouched = [i for i in range(latent.shape[1]) if i not in slots.tolist()]
    assert not latent[:, untouched].any()


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(ranks=st.lists(st.integers(0, 9), min_size=1, max_size=5), extra=st.integers(0, 3))
def test_packed_columns_equal_the_boolean_mask(ranks, extra):
    """The rewrite of the gather: the cached integer index selects exactly the columns the boolean mask did, in
    order (head-major, each head's first r_h coordinates)."""
    offsets = [0]
    for r in ranks:
        offsets.append(offsets[-1] + r)
    r_pad = max(ranks) + extra
    _, valid = ref._head_columns(offsets, r_pad, CPU)
    idx = ref._packed_columns(offsets, r_pad, CPU)
    assert idx.dtype == torch.long and torch.equal(idx, valid.flatten().nonzero().flatten())
    z = torch.randn(2, 3, len(ranks) * r_pad)
    assert torch.equal(z.index_select(-1, idx), z[..., valid.flatten()])


@pytest.mark.parametrize("fmt", ["float", "int8", "int4/32", "tern", "mix/8:8x5+2x8,4x7"])
def test_reference_paths_of_a_step_are_capture_safe(fmt):
    """The other ops' CUDA fallbacks run the references: rope_table_update (always), latent_attention /
    latent_scores / latent_attention_from_scores / latent_reconstruct (unsupported inputs). Second call clean."""
    g = torch.Generator().manual_seed(1)
    latent, x, basis, slots, r_pad = _append_case(fmt)
    device_cache._prepare(OFFSETS, fmt, r_pad, CPU)
    ref.latent_append_with(latent, x, basis, OFFSETS, slots, fmt, quantize_latent_ref)
    b, hkv, s, d, p_max = 2, 2, 3, 16, 12
    block = basis[:, :d]
    cos_t, sin_t = torch.zeros(p_max, d), torch.zeros(p_max, d)
    cos_c, sin_c = torch.rand(p_max, d // 2, generator=g), torch.rand(p_max, d // 2, generator=g)  # complex form
    slot_pos = torch.zeros(b, 9, dtype=torch.int32)
    cos, sin = torch.rand(1, s, d, generator=g), torch.rand(1, s, d, generator=g)
    pos = torch.tensor([[3, 4, 5]])
    q = torch.randn(b, 2 * hkv, s, d, generator=g)
    nk, nv = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    mask = torch.rand(b, 1, s, 9, generator=g) > 0.3
    calls = [
        (ref.rope_table_update_ref, cos_t, sin_t, slot_pos, cos, sin, pos, slots),
        (ref.latent_attention_ref, q, latent, latent, block, block, OFFSETS, OFFSETS, cos_t, sin_t, slot_pos,
         "rotate_half", d, nk, nv, slots, mask, 0.25, 9, fmt, fmt),
        (ref.latent_scores_ref, q, latent, block, OFFSETS, cos_t, sin_t, slot_pos, "interleaved", d, slots, mask,
         0.25, 9, fmt),
        (ref.latent_reconstruct_ref, latent, block, OFFSETS, cos_c, sin_c, slot_pos, "complex", d, nk, slots, fmt),
    ]
    for fn, *args in calls:
        for _ in range(2):
            _, hazards = _record(fn, *args)
        assert not hazards, (fn.__name__, "\n".join(map(str, hazards)))
    sc = ref.latent_scores_ref(q, latent, block, OFFSETS, cos_t, sin_t, slot_pos, "none", 0, slots, mask, 0.25, 9, fmt)
    _, hazards = _record(ref.latent_attention_from_scores_ref, sc, q, latent, block, OFFSETS, nk, nv, slots, mask,
                         0.25, 9, fmt)
    assert not hazards, "\n".join(map(str, hazards))


def test_store_prepares_the_residual_layouts_too(monkeypatch):
    """A store with an ALR-KVD residual prepares its residual rows' tables at build time as well (they were built
    lazily, inside the first compiled call: in a CUDA-graph pool, or during capture)."""
    from ckvp_compile.kernels.residual import residual_offsets
    from ckvp_compile.latent import calibrate
    from ckvp_compile.runtime import store as store_mod
    from ckvp_compile.testing import build_hf_moe

    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    bases = calibrate(model, [torch.randint(0, 256, (1, 12))], group_size=2, kv_ratio=2.0, progress=False)
    seen: list = []
    monkeypatch.setattr(store_mod, "prepare_device_tables", lambda *a: seen.append((list(a[0]), a[1])))
    store = store_mod.LatentKVStore(bases, 1, 24, "cpu", torch.float32, residual_format="int2/64")
    for g, layers in enumerate(store.groups):
        assert (store.k_offsets[g], store.k_formats[g]) in seen and (store.v_offsets[g], store.v_formats[g]) in seen
        assert (residual_offsets(len(layers), store.num_kv_heads, store.head_dim), "int2/64") in seen


def test_a_table_first_needed_during_capture_raises_a_clear_error(monkeypatch):
    """A per-layout table not prepared before a CUDA graph is captured: a RuntimeError naming the fix, raised before
    any device work (instead of the capture failing on the host-to-device copy)."""
    pytest.importorskip("triton")
    from ckvp_compile.kernels import latent_attention_triton as lat
    from ckvp_compile.kernels import latent_quant_triton as lq

    cuda = torch.device("cuda", 0)
    f = parse_latent_format("int8")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    for cache in (ref._head_columns_cached, ref._packed_columns_cached, _layout_index, lq._tables):
        cache.cache_clear()
    lat._META.clear()
    for build in (lambda: ref._head_columns(OFFSETS, 16, cuda), lambda: ref._packed_columns(OFFSETS, 16, cuda),
                  lambda: _layout_index("pad", tuple(OFFSETS), f, str(cuda)),
                  lambda: lq._tables(tuple(OFFSETS), f.name, str(cuda)), lambda: lat._head_meta(OFFSETS, "int8", cuda)):
        with pytest.raises(RuntimeError, match="prepare_device_tables"):
            build()
    device_cache._prepare(OFFSETS, "int8", 16, CPU)  # off CUDA nothing is checked, even while "capturing"
    assert ref._packed_columns_cached.cache_info().currsize == 1


def test_moe_tuning_never_times_while_capturing(monkeypatch):
    """grouped_gemm._tune: during a capture, the first candidate, never timed (do_bench synchronises) nor cached."""
    pytest.importorskip("triton")
    from ckvp_compile.kernels import grouped_gemm as gg

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    cands = [gg.GemmConfig(32, 64), gg.GemmConfig(64, 64)]

    def launch(cfg):
        raise AssertionError("timed during a capture")

    key = ("capture-test",)
    assert gg._tune(key, cands, launch) is cands[0] and key not in gg._TUNED


@pytest.mark.parametrize("recent_window", [0, 4])
def test_compiled_decode_step_ops_are_capture_safe(monkeypatch, recent_window):
    """End to end: a tiny Mixtral with an int8 latent cache (and a dense recent window) compiled by the ckvp backend
    (aot_eager, so the ckvp ops run their CPU kernels: the same Python as the CUDA fallbacks); in the third decode
    step every reference the ops call makes no capture-unsafe call."""
    from ckvp_compile.latent import calibrate
    from ckvp_compile.latent.capture import hf_step_kwargs
    from ckvp_compile.runtime.hf_cache import CKVPStaticCache
    from ckvp_compile.testing import build_hf_moe

    names = ("latent_append_ref", "rope_table_update_ref", "latent_attention_ref", "latent_reconstruct_ref",
             "latent_scores_ref", "latent_attention_from_scores_ref", "window_append_ref")
    hazards: list = []
    ran: list[str] = []
    armed = [False]

    def wrap(name, fn):
        def run(*args, **kwargs):
            if not armed[0]:
                return fn(*args, **kwargs)
            ran.append(name)
            with CaptureHazards(allow=HOST_ONLY) as rec:
                out = fn(*args, **kwargs)
            hazards.extend(rec.hazards)
            return out
        return run

    for name in names:
        monkeypatch.setattr(ref, name, wrap(name, getattr(ref, name)))
    torch._dynamo.reset()
    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    bases = calibrate(model, [torch.randint(0, 256, (1, 12))], group_size=2, kv_ratio=2.0, latent_format="int8",
                      progress=False)
    cache = CKVPStaticCache(model.config, bases, max_cache_len=24, latent_format="int8", recent_window=recent_window)
    step = torch.compile(model, backend="ckvp", options={"compiler": "aot_eager"}, fullgraph=True)
    tok, pos = torch.randint(0, 256, (1, 5)), 0
    with torch.no_grad():
        for i in range(4):
            armed[0] = i == 3
            logits = step(**hf_step_kwargs(model, tok, cache, pos)).logits
            pos += tok.shape[1]
            tok = logits[:, -1:].argmax(-1)
    assert "latent_append_ref" in ran and "rope_table_update_ref" in ran, ran
    assert ("window_append_ref" in ran) == bool(recent_window), ran
    assert not hazards, "\n".join(map(str, hazards))


def test_gpu_capture_script_cpu_smoke(tmp_path):
    """benchmarks/cudagraph_capture_gpu.py's plumbing on CPU (no capture): the fixture's steps run through the op
    wrappers, every ckvp call of the prefill and the first decode step is recorded and re-run alone from its host
    copy, and the report is written."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "cudagraph_capture_gpu.py"), "--out",
                           str(tmp_path), "--device", "cpu", "--max-decode", "2",
                           "--budget-s", "100000"],  # no time-budget skip: a loaded CI machine must not fail it
                          capture_output=True, text=True,
                          timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads((tmp_path / "cudagraph_capture_gpu.json").read_text())
    assert [s["status"] for s in rep["steps"].values()] == ["ok", "ok", "ok"]
    launches = rep["steps"]["decode_1"]["op_launches"]
    assert launches.get("latent_append") and launches.get("rope_table_update") and launches.get("latent_attention")
    assert len(rep["per_op"]) == sum(launches.values()) + sum(rep["steps"]["prefill"]["op_launches"].values())
    assert all(r["eager"] == "ok" for r in rep["per_op"])
    assert not rep["steps"]["decode_1"]["op_hazards"], rep["steps"]["decode_1"]["op_hazards"]
    assert (tmp_path / "cudagraph_capture_gpu.md").read_text().startswith("# CUDA-graph capture")
