"""Block-rotated bases (latent/rotation.py), fp8 bases in the store, and the ALR-KVD residual
(kernels/residual.py, ckvp::residual_append / ckvp::latent_reconstruct_residual) down to a compiled model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckvp_compile import CKVPBackend, CKVPConfig, CompileRecorder
from ckvp_compile.kernels.latent_format import dequantize_latent_ref, parse_latent_format, quantize_latent_ref
from ckvp_compile.kernels.reference import latent_append_ref
from ckvp_compile.kernels.residual import residual_offsets
from ckvp_compile.latent import calibrate
from ckvp_compile.latent.budget import dense_kv_bytes, store_bytes
from ckvp_compile.latent.planner import plan_for_byte_ratio
from ckvp_compile.latent.rotation import block_rotation, rotate_basis_blocks
from ckvp_compile.ops import latent_kv  # noqa: F401  registers torch.ops.ckvp.*
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import build_hf_moe, prefill_decode_logits
from ckvp_compile.testing.decoding import hf_step_kwargs


@given(n=st.integers(1, 70))
@settings(max_examples=25, deadline=None)
def test_block_rotation_is_orthonormal_and_flat(n):
    q = block_rotation(n)
    torch.testing.assert_close(q.T @ q, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    assert q.abs().max() <= (2.0 / n) ** 0.5 + 1e-12  # flat: no coordinate keeps a block's variance to itself


@given(hkv=st.integers(1, 3), n=st.integers(4, 40), block=st.sampled_from([4, 8, 16]), seed=st.integers(0, 99))
@settings(max_examples=20, deadline=None)
def test_rotated_basis_spans_the_same_subspace(hkv, n, block, seed):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(hkv, n, n, generator=g, dtype=torch.float64))
    ranks = [int(r) for r in torch.randint(1, n + 1, (hkv,), generator=g)]
    rmax = max(ranks)
    basis = q[:, :, :rmax] * (torch.arange(rmax)[None, :] < torch.tensor(ranks)[:, None])[:, None, :]
    rot = rotate_basis_blocks(basis, ranks, block)
    for h, r in enumerate(ranks):
        p, pr = basis[h, :, :r], rot[h, :, :r]
        torch.testing.assert_close(pr.T @ pr, torch.eye(r, dtype=torch.float64), atol=1e-10, rtol=0)
        torch.testing.assert_close(pr @ pr.T, p @ p.T, atol=1e-10, rtol=0)  # same projector
        assert torch.equal(rot[h, :, r:], torch.zeros_like(rot[h, :, r:]))


def test_rotation_cuts_the_quantization_error_of_a_steep_block():
    """Per-token int4 blocks of coordinates whose variances fall 100x: the rotated block loses much less."""
    g = torch.Generator().manual_seed(0)
    lam = torch.logspace(0, -2, 32, dtype=torch.float64)
    z = (torch.randn(4096, 32, generator=g, dtype=torch.float64) * lam.sqrt()).float()
    q = block_rotation(32).float()
    offs = [0, 32]

    def err(x):
        return float(((dequantize_latent_ref(quantize_latent_ref(x, offs, "int4"), offs, "int4") - x) ** 2).sum())

    assert err(z @ q) < 0.7 * err(z)  # (z Q) Q^T = z: the same vectors in rotated coordinates (0.52x measured)


@pytest.fixture(scope="module")
def tiny():
    model = build_hf_moe("mixtral", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 256, (1, 48), generator=g) for _ in range(3)]
    return model, calibrate(model, samples, group_size=2, kv_ratio=1.0, progress=False)


def test_planner_rotate_and_fp8_bases_meet_the_ratio_as_the_store_counts_it(tiny):
    model, full = tiny
    planned = plan_for_byte_ratio(full, 4.0, batch_size=2, max_cache_len=256, block=8, rotate=True,
                                  basis_dtype=torch.float8_e4m3fn)
    assert planned.rotation == "hadamard/8"
    held = store_bytes(planned, 2, 256, "auto", "auto", torch.bfloat16, basis_dtype=torch.float8_e4m3fn)
    assert dense_kv_bytes(planned, 2, 256, torch.bfloat16) / held >= 4.0
    store = CKVPStaticCache(model.config, planned, max_cache_len=256, max_batch_size=2, latent_dtype=torch.bfloat16,
                            basis_dtype=torch.float8_e4m3fn).store
    assert store.basis_k[0].dtype == torch.float8_e4m3fn
    nb = store.nbytes()
    assert nb.bases == sum(p.numel() for p in (*planned.k_basis, *planned.v_basis))  # one byte per element
    assert nb.ratio_vs(torch.bfloat16) * held == pytest.approx(dense_kv_bytes(planned, 2, 256, torch.bfloat16))
    for kind in ("k", "v"):  # rotated within the span of each head's leading components
        for g, ranks in enumerate(planned.ranks(kind)):
            for h, r in enumerate(ranks):
                p, pr = full.basis(kind)[g][h, :, :r].double(), planned.basis(kind)[g][h, :, :r].double()
                torch.testing.assert_close(p @ (p.T @ pr), pr, atol=1e-5, rtol=0)


@given(b=st.integers(1, 2), hkv=st.integers(1, 2), glayers=st.integers(1, 3), s=st.integers(1, 5),
       rank=st.integers(1, 8), fmt=st.sampled_from(["int4/8", "int8", "float"]),
       rfmt=st.sampled_from(["int2/16", "int2/64", "int4/8"]), seed=st.integers(0, 999))
@settings(max_examples=30, deadline=None)
def test_residual_reconstructs_within_half_a_residual_step(b, hkv, glayers, s, rank, fmt, rfmt, seed):
    """ALR-KVD: low rank + residual rebuilds every element within half a step of the residual's block."""
    d, s_max = 8, 6
    gd = glayers * d
    gen = torch.Generator().manual_seed(seed)
    rank = min(rank, gd)
    basis = torch.linalg.qr(torch.randn(hkv, gd, gd, generator=gen))[0][:, :, :rank].contiguous()
    offsets = [h * rank for h in range(hkv + 1)]
    f = parse_latent_format(fmt)
    latent = torch.zeros(b, s_max, f.row_width(offsets), dtype=f.storage_dtype(torch.float32))
    rf = parse_latent_format(rfmt)
    roffs = residual_offsets(glayers, hkv, d)
    resid = torch.zeros(b, s_max, rf.row_width(roffs), dtype=torch.uint8)
    x = torch.randn(b, hkv, s, gd, generator=gen)
    slots = torch.randperm(s_max, generator=gen)[:s]
    latent_append_ref(latent, x, basis, offsets, slots, fmt)
    torch.ops.ckvp.residual_append(resid, latent, x, basis, offsets, slots, fmt, rfmt, glayers)
    # the half-step bound of each residual block, from its stored scale
    step = torch.zeros(b, s_max, roffs[-1])
    n_code = sum(rf.code_bytes(roffs))
    scales = resid[..., n_code:n_code + 2 * rf.num_blocks(roffs)].clone().view(torch.float16).float()
    per_seg = -(-d // rf.block)
    for seg in range(glayers * hkv):
        for k in range(per_seg):
            lo, hi = seg * d + k * rf.block, min(seg * d + (k + 1) * rf.block, (seg + 1) * d)
            step[..., lo:hi] = scales[..., seg * per_seg + k, None]
    empty = torch.zeros(1, 1)
    for j in range(glayers):
        out = torch.ops.ckvp.latent_reconstruct_residual(
            latent, basis[:, j * d:(j + 1) * d], offsets, empty, empty, empty, "none", 0,
            torch.zeros(b, hkv, 0, d), torch.zeros(0, dtype=torch.long), fmt, resid, j, glayers, rfmt)
        want = x[..., j * d:(j + 1) * d]  # (B, Hkv, S, D)
        got = out[:, :, slots]
        bound = step.view(b, s_max, glayers, hkv, d)[:, :, j].permute(0, 2, 1, 3)[:, :, slots] / 2
        assert ((got - want).abs() <= bound + 1e-5 * (1 + want.abs())).all()


def test_residual_op_rejects_a_wrong_width():
    x = torch.randn(1, 1, 2, 16)
    basis = torch.linalg.qr(torch.randn(1, 16, 16))[0][:, :, :4].contiguous()
    latent = torch.zeros(1, 4, 4)
    with pytest.raises(ValueError, match="resid must be"):
        torch.ops.ckvp.residual_append(torch.zeros(1, 4, 3, dtype=torch.uint8), latent, x, basis, [0, 4],
                                       torch.tensor([0, 1]), "float", "int2/64", 2)


def test_alr_cache_compiles_attends_by_reconstruct_and_tracks_dense(tiny):
    """A rank-2 latent alone is far from dense; with an int8 residual the compiled model is close to it."""
    model, _ = tiny
    low = calibrate(model, [torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(1))],
                    group_size=2, kv_ratio=16.0, progress=False)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    eager = prefill_decode_logits(model, ids, 3, max_cache_len=16)

    def run(residual):
        torch._dynamo.reset()
        cache = CKVPStaticCache(model.config, low, max_cache_len=16, latent_format="int8", residual_format=residual)
        rec = CompileRecorder()
        step = torch.compile(model, backend=CKVPBackend(CKVPConfig(compiler="aot_eager"), recorder=rec),
                             fullgraph=True)
        outs = []
        with torch.no_grad():
            step(**hf_step_kwargs(model, ids, cache, 0))
            for i in range(3):  # teacher-forced with the dense model's tokens, compared step by step
                tok = eager[i][:, -1:].argmax(-1)
                outs.append(step(**hf_step_kwargs(model, tok, cache, ids.shape[1] + i)).logits)
        return outs, cache, rec

    outs, cache, rec = run("int8/16")
    assert cache.store.nbytes().residual == 2 * sum(t.numel() for t in cache.store.resid_k)
    plain, _, _ = run("")
    err = max(float((o - e).abs().max()) for o, e in zip(outs, eager[1:]))
    err_plain = max(float((o - e).abs().max()) for o, e in zip(plain, eager[1:]))
    assert err < 0.05 * max(float(e.abs().max()) for e in eager[1:])
    assert err < 0.25 * err_plain
    torch._dynamo.reset()
