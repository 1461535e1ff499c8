"""The rank-and-bits planner (latent/planner.py): budgets met in bytes as the store counts them, plans that
parse and match the ranks, more bytes never cost fidelity in the planner's own error model, and a planned
cache compiles and runs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckvp_compile import CKVPBackend, CKVPConfig
from ckvp_compile.errors import CKVPConfigError
from ckvp_compile.kernels.latent_format import parse_latent_format
from ckvp_compile.latent import LatentBases, calibrate
from ckvp_compile.latent.budget import dense_kv_bytes, store_bytes
from ckvp_compile.latent.planner import _block_errors, plan_bits, plan_for_byte_ratio
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import build_hf_moe, prefill_decode_logits
from ckvp_compile.testing.decoding import hf_step_kwargs


def _full_bases(num_layers=4, group_size=2, head_dim=16, num_kv_heads=2):
    model = build_hf_moe("mixtral", num_layers=num_layers, num_heads=4, num_kv_heads=num_kv_heads, head_dim=head_dim)
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 256, (1, 48), generator=g) for _ in range(3)]
    return model, calibrate(model, samples, group_size=group_size, kv_ratio=1.0, progress=False)


@pytest.fixture(scope="module")
def full():
    return _full_bases()


@given(ratio=st.sampled_from([2.0, 3.0, 5.0, 8.0]), block=st.sampled_from([8, 16]), batch=st.integers(1, 4))
@settings(max_examples=10)
def test_byte_ratio_is_met_as_the_store_counts_it(full, ratio, block, batch):
    _, bases = full
    try:
        planned = plan_for_byte_ratio(bases, ratio, batch_size=batch, max_cache_len=128, block=block)
    except CKVPConfigError as e:  # too few bytes for one block per unit: refused, with the fix named
        assert "lower kv_ratio" in str(e) and (block, ratio) != (8, 2.0)
        return
    held = store_bytes(planned, batch, 128, "auto", "auto", torch.bfloat16)
    assert dense_kv_bytes(planned, batch, 128, torch.bfloat16) / held >= ratio
    for kind in ("k", "v"):
        for g, fmt in enumerate(getattr(planned, f"{kind}_formats")):
            f = parse_latent_format(fmt)
            assert f.mixed and f.block == block
            offsets = [0]
            for r in planned.ranks(kind)[g]:
                offsets.append(offsets[-1] + r)
            f.pieces(offsets)  # the plan matches the ranks (raises otherwise)
            basis = planned.basis(kind)[g]
            for h, r in enumerate(planned.ranks(kind)[g]):  # truncated: zero beyond each head's rank
                assert torch.equal(basis[h, :, r:], torch.zeros_like(basis[h, :, r:]))
                torch.testing.assert_close(basis[h, :, :r], bases.basis(kind)[g][h, :, :r])
    store = CKVPStaticCache(full[0].config, planned, max_cache_len=128, max_batch_size=batch,
                            latent_dtype=torch.bfloat16).store
    nb = store.nbytes()
    assert nb.per_sequence_state + nb.bases == held


def _model_error(bases, planned):
    """The planner's error model summed over units, for the planned bits (lower is better)."""
    total = 0.0
    gen = torch.Generator().manual_seed(0)
    for kind in ("k", "v"):
        for g, fmt in enumerate(getattr(planned, f"{kind}_formats")):
            f = parse_latent_format(fmt)
            for h, segs in enumerate(f.segments):
                eig = bases.eigenvalues(kind)[g][h]
                errs = _block_errors(eig, f.block, 256, gen)
                bits = [b for b, c in segs for _ in range(c // f.block + (c % f.block > 0))]
                bits += [0] * (len(errs) - len(bits))
                total += sum(e[b] for e, b in zip(errs, bits)) / float(eig.sum())
    return total


def test_more_bytes_never_raise_the_planned_error(full):
    _, bases = full
    errs = [_model_error(bases, plan_bits(bases, budget, block=8, tokens_sharing_bases=10**9))
            for budget in (60, 120, 240, 480)]
    assert errs == sorted(errs, reverse=True) and errs[-1] < errs[0]


def test_a_budget_below_one_block_per_unit_is_a_clear_error(full):
    with pytest.raises(CKVPConfigError, match="lower kv_ratio"):
        plan_bits(full[1], 10.0, block=8)
    with pytest.raises(CKVPConfigError, match="full-rank"):
        plan_bits(plan_bits(full[1], 200.0, block=8), 200.0, block=8)


def test_planned_cache_compiles_runs_and_saves(full, tmp_path):
    model, bases = full
    planned = plan_for_byte_ratio(bases, 3.0, batch_size=1, max_cache_len=4096, block=8)
    planned.save(tmp_path / "planned.safetensors")
    loaded = LatentBases.load(tmp_path / "planned.safetensors", model=model)
    assert loaded.k_formats == planned.k_formats and loaded.v_ranks == planned.v_ranks
    ids = torch.randint(0, 256, (1, 6))
    eager = prefill_decode_logits(model, ids, 4, max_cache_len=32)
    cache = CKVPStaticCache(model.config, loaded, max_cache_len=32)  # latent_format='auto': the plan
    assert cache.store.k_formats == list(planned.k_formats)
    step = torch.compile(model, backend=CKVPBackend(CKVPConfig(compiler="aot_eager")), fullgraph=True)
    with torch.no_grad():
        out = step(**hf_step_kwargs(model, ids, cache, 0)).logits
        tok = out[:, -1:].argmax(-1)
        for i in range(4):
            out2 = step(**hf_step_kwargs(model, tok, cache, ids.shape[1] + i)).logits
            tok = out2[:, -1:].argmax(-1)
    assert torch.isfinite(out2).all()
    assert (out2 - eager[-1]).abs().max() < 0.5 * eager[-1].abs().max()  # lossy, but tracks the model
