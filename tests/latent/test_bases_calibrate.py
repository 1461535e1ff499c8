"""Cross-layer latent bases: calibration by graph structure, the properties DESIGN.md promises, rank allocation,
and the safetensors round trip.

Properties (DESIGN.md, "CKVP in numbers"), over random HF-family and gpt-fast models: bases are orthonormal; at
full rank P P^T x == x; on the calibration data the mean squared reconstruction error equals the sum of the
discarded eigenvalues; ranks meet the budget; 'energy' allocation discards no more normalised energy than
'uniform'.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ckvp_compile import CKVPConfig, CKVPConfigError, LatentBases, calibrate
from ckvp_compile.latent import KVMoments, allocate_ranks, collect_kv_moments, rank_budget
from ckvp_compile.latent.ranks import rank_steps
from ckvp_compile.testing import FIXTURE_MODEL_DIR, HF_FAMILIES, GptFastConfig, GptFastMoE, build_hf_moe, \
    load_fixture_model

RATIOS = (1.0, 2.0, 3.0, 4.0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: these tiny matmuls run ~1000x slower with 2 OpenMP threads on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _gpt_fast(seed: int = 0, **shape) -> GptFastMoE:
    torch.manual_seed(seed)
    cfg = dict(n_layer=3, dim=32, n_head=4, n_local_heads=2, head_dim=8)
    cfg.update(shape)
    return GptFastMoE(GptFastConfig(**cfg)).eval()


def _samples(n: int, shape: tuple[int, ...], seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, shape, generator=gen) for _ in range(n)]


def _normalised_discard(b: LatentBases) -> float:
    return sum(1 - b.retained_fraction(g, h, kind) for kind in "kv" for g in range(len(b.groups))
               for h in range(b.num_kv_heads))


def _check_bases(b: LatentBases, stacked: list, rho: float, alloc: str) -> None:
    """Orthonormality, the budget, and MSE == discarded energy on the collected x."""
    dense, latent = b.dense_elements_per_token(), b.latent_elements_per_token()
    budget = rank_budget(dense, rho)
    assert b.ratio() >= rho and latent <= budget
    if alloc == "energy":
        assert latent >= budget - 1
    else:  # uniform: one r everywhere (capped), and r + 1 would not fit
        caps = [len(layers) * b.head_dim for layers in b.groups for _ in range(b.num_kv_heads)] * 2
        flat = [r for kind in "kv" for rs in b.ranks(kind) for r in rs]
        r = max(flat)
        assert flat == [min(r, c) for c in caps]
        assert r == max(caps) or sum(min(r + 1, c) for c in caps) > budget
    for kind, idx in (("k", 0), ("v", 1)):
        for g, layers in enumerate(b.groups):
            x_all = torch.cat([s[g][idx] for s in stacked], dim=1)  # (Hkv, N, G_g*D) float64
            assert b.basis(kind)[g].shape == (b.num_kv_heads, len(layers) * b.head_dim, max(b.ranks(kind)[g]))
            for h, r in enumerate(b.ranks(kind)[g]):
                basis = b.basis(kind)[g][h]
                assert basis.dtype == torch.float32 and not basis[:, r:].any()
                p = basis[:, :r].double()
                torch.testing.assert_close(p.T @ p, torch.eye(r, dtype=torch.float64), atol=1e-5, rtol=0)
                x = x_all[h]
                mse = ((x - x @ p @ p.T) ** 2).sum(-1).mean().item()
                disc = b.discarded_energy(g, h, kind)
                trace = float(b.eigenvalues(kind)[g][h].sum())
                assert abs(mse - disc) <= 1e-4 * disc + 1e-9 * trace, (kind, g, h, r, mse, disc, trace)
                if r == len(layers) * b.head_dim:  # full rank: exact reconstruction
                    x32 = x.float()
                    recon = x32 @ basis @ basis.T
                    torch.testing.assert_close(recon, x32, rtol=1e-4, atol=1e-4 * float(x32.abs().max()))


@st.composite
def _random_models(draw):
    family = draw(st.sampled_from(HF_FAMILIES + ("gpt_fast",)))
    head_dim = draw(st.sampled_from((8, 16, 32)))
    num_heads = draw(st.sampled_from((1, 2, 4)))
    num_kv_heads = draw(st.sampled_from([k for k in (1, 2, 4) if num_heads % k == 0]))  # MHA / GQA / MQA
    shape = dict(num_layers=draw(st.integers(1, 5)), hidden=num_heads * head_dim, num_heads=num_heads,
                 num_kv_heads=num_kv_heads, head_dim=head_dim, num_experts=4, top_k=2, ffn=16)
    group_size = draw(st.sampled_from((1, 2, 4)))
    if family == "gpt_fast":
        torch.manual_seed(0)
        rope = draw(st.sampled_from(("complex", "rotate_half")))
        model = GptFastMoE(GptFastConfig.from_shape(shape, rope_form=rope)).eval()
    else:
        model = build_hf_moe(family, **shape)
    return family, shape, group_size, model


@given(case=_random_models(), batch=st.sampled_from((1, 2)))
def test_bases_properties_on_random_models(case, batch):
    """Groups follow make_layer_groups; bases orthonormal; full rank exact; MSE == discarded; budgets met;
    energy allocation discards no more normalised energy than uniform."""
    family, shape, group_size, model = case
    stacked: list = []
    moments = collect_kv_moments(model, _samples(2, (batch, 12)), group_size=group_size, progress=False,
                                 on_sample=stacked.append)
    layers = list(range(shape["num_layers"]))
    assert moments.groups == tuple(tuple(layers[i:i + group_size]) for i in range(0, len(layers), group_size))
    assert (moments.num_kv_heads, moments.head_dim) == (shape["num_kv_heads"], shape["head_dim"])
    assert moments.num_tokens == 2 * batch * 12 and len(stacked) == 2
    full = moments.bases(1.0)
    assert full.k_ranks == tuple((len(g) * shape["head_dim"],) * shape["num_kv_heads"] for g in full.groups)
    _check_bases(full, stacked, 1.0, "energy")
    top = full.dense_elements_per_token() / (2 * len(full.groups) * full.num_kv_heads)
    for rho in (r for r in RATIOS[1:] if r <= top):
        energy, uniform = moments.bases(rho, "energy"), moments.bases(rho, "uniform")
        _check_bases(energy, stacked, rho, "energy")
        _check_bases(uniform, stacked, rho, "uniform")
        assert _normalised_discard(energy) <= _normalised_discard(uniform) + 1e-9


@settings(max_examples=40)
@given(data=st.data())
def test_energy_allocation_is_optimal(data):
    """The greedy 'energy' ranks reach the brute-force maximum of the summed retained fractions."""
    units = data.draw(st.integers(1, 3))
    spectra = []
    for _ in range(units):
        n = data.draw(st.integers(1, 4))
        vals = data.draw(st.lists(st.floats(0, 10), min_size=n, max_size=n))
        spectra.append(torch.tensor(sorted(vals, reverse=True), dtype=torch.float64))
    budget = data.draw(st.integers(units, sum(s.numel() for s in spectra)))

    def score(ranks):
        return sum(float(s[:r].sum()) / float(s.sum()) if float(s.sum()) > 0 else 1.0 for s, r in zip(spectra, ranks))

    ranks = allocate_ranks(spectra, budget, "energy")
    assert sum(ranks) == budget and all(1 <= r <= s.numel() for r, s in zip(ranks, spectra))
    best = max(score(rs) for rs in itertools.product(*[range(1, s.numel() + 1) for s in spectra])
               if sum(rs) <= budget)
    assert score(ranks) >= best - 1e-12
    uniform = allocate_ranks(spectra, budget, "uniform")
    assert sum(uniform) <= budget and score(uniform) <= score(ranks) + 1e-12


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_block_ranks_fill_whole_blocks_within_the_budget(data):
    """With ``rank_block`` b every rank is 1, a multiple of min(8, b) up to b, a multiple of b, or the unit's full
    size; the ranks fit the budget, and every unit short of full rank stops at a step larger than what is left
    (the greedy never leaves a step unspent that fits). b = 1 is the exact 'energy' allocation."""
    units = data.draw(st.integers(1, 5))
    block = data.draw(st.sampled_from([1, 2, 8, 16, 32]))
    mode = data.draw(st.sampled_from(["energy", "uniform", "entropy"]))
    spectra = []
    for _ in range(units):
        n = data.draw(st.integers(1, 80))
        vals = data.draw(st.lists(st.floats(0, 10), min_size=n, max_size=n))
        spectra.append(torch.tensor(sorted(vals, reverse=True), dtype=torch.float64))
    caps = [s.numel() for s in spectra]
    budget = data.draw(st.integers(units, sum(caps)))
    weights = [data.draw(st.floats(0.01, 1.0)) for _ in spectra] if mode == "entropy" else None
    ranks = allocate_ranks(spectra, budget, mode, weights, rank_block=block)
    assert sum(ranks) <= budget
    for r, n in zip(ranks, caps):
        assert r in rank_steps(n, block)
        small = min(8, block)
        assert r in (1, n) or (r <= block and r % small == 0) or r % block == 0
    if block == 1:
        assert ranks == allocate_ranks(spectra, budget, mode, weights)
    elif mode != "uniform":
        left = budget - sum(ranks)
        for r, n in zip(ranks, caps):
            if r < n:
                st_ = rank_steps(n, block)
                assert st_[st_.index(r) + 1] - r > left


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_block_ranks_spend_the_budget_on_flat_spectra(data):
    """Flat stretches of a spectrum (equal eigenvalues, whose normalised step means differ only by rounding) never
    stop a unit early: the ranks still fit, and every unit short of full rank stops at a step larger than what is
    left."""
    units = data.draw(st.integers(1, 4))
    block = data.draw(st.sampled_from([2, 8, 16, 32]))
    spectra = []
    for _ in range(units):
        levels = data.draw(st.lists(st.sampled_from([0.0, 1e-15, 1e-13, 0.1, 1.0, 3.0]), min_size=1, max_size=3))
        lens = data.draw(st.lists(st.integers(1, 40), min_size=len(levels), max_size=len(levels)))
        vals = sorted((v for v, n in zip(levels, lens) for _ in range(n)), reverse=True)
        spectra.append(torch.tensor(vals, dtype=torch.float64))
    caps = [s.numel() for s in spectra]
    budget = data.draw(st.integers(units, sum(caps)))
    ranks = allocate_ranks(spectra, budget, rank_block=block)
    left = budget - sum(ranks)
    assert left >= 0
    for r, n in zip(ranks, caps):
        if r < n:
            st_ = rank_steps(n, block)
            assert st_[st_.index(r) + 1] - r > left, (ranks, budget)


def test_block_ranks_regressions():
    """Cases the first version of the step greedy stopped early on (found by review and hypothesis)."""
    assert allocate_ranks([torch.ones(100, dtype=torch.float64)] * 3, 300, rank_block=32) == [100, 100, 100]
    spectra = [torch.tensor(x, dtype=torch.float64) for x in ([0.0], [2.0, 1.0, 1.0, 1.0], [0.0], [0.0])]
    assert allocate_ranks(spectra, 7, rank_block=2) == [1, 4, 1, 1]


def test_rank_steps_and_bad_rank_block():
    assert rank_steps(256, 32)[:9] == [1, 8, 16, 24, 32, 64, 96, 128, 160] and rank_steps(256, 32)[-1] == 256
    assert rank_steps(20, 32) == [1, 8, 16, 20] and rank_steps(5, 1) == [1, 2, 3, 4, 5]
    assert rank_steps(64, 16) == [1, 8, 16, 32, 48, 64]
    for bad in (0, -8, 2.0, True):
        with pytest.raises(ValueError, match="rank_block"):
            allocate_ranks([torch.ones(8, dtype=torch.float64)], 4, rank_block=bad)


def test_rank_budget_never_undershoots_ratio():
    for dense in (96, 192, 2048, 4097):
        for rho in (1, 1.5, 2.0, 3, 3.3, 4.0, 7.0, 8.0):
            b = rank_budget(dense, rho)
            assert dense / b >= rho and dense / (b + 1) < rho


@pytest.mark.parametrize("family", ["mixtral", "gpt_fast"])
def test_collected_keys_are_pre_rope_and_values_as_cached(family):
    """Layer 0's recorded K is k_proj(norm(embed(ids))) before RoPE, in (B, Hkv, S, D) order, V likewise; the
    gpt-fast case has S == Hkv, where only the graph (not the shapes) tells the layouts apart."""
    b, s, hkv, d = 2, 4, 4, 8
    if family == "gpt_fast":
        model = _gpt_fast(n_head=4, n_local_heads=hkv)
        layer = model.layers[0]
        qkv = layer.attention.wqkv(layer.attention_norm(model.tok_embeddings(ids := _samples(1, (b, s))[0])))
        k, v = qkv[..., 4 * d:4 * d + hkv * d], qkv[..., 4 * d + hkv * d:]
    else:
        model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=hkv, head_dim=d, hidden=32)
        layer = model.model.layers[0]
        h = layer.input_layernorm(model.model.embed_tokens(ids := _samples(1, (b, s))[0]))
        k, v = layer.self_attn.k_proj(h), layer.self_attn.v_proj(h)
    stacked: list = []
    with torch.no_grad():
        k, v = (t.view(b, s, hkv, d).permute(2, 0, 1, 3).reshape(hkv, b * s, d).double() for t in (k, v))
    collect_kv_moments(model, [ids], group_size=2, progress=False, on_sample=stacked.append)
    xk, xv = stacked[0][0]
    torch.testing.assert_close(xk[..., :d], k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xv[..., :d], v, rtol=1e-5, atol=1e-5)


def test_calibrate_matches_moments_and_regroup():
    """calibrate() == collect_kv_moments().bases(); group_size= overrides the config and the last group is
    shorter; moments at G=2 regrouped to G=1 == moments collected at G=1."""
    model, samples = _gpt_fast(n_layer=3), _samples(3, (1, 16))
    bases = calibrate(model, samples, CKVPConfig(group_size=4), group_size=2, kv_ratio=2.0, progress=False)
    moments = collect_kv_moments(model, samples, group_size=2, progress=False)
    again = moments.bases(2.0)
    assert bases.groups == ((0, 1), (2,)) and bases.group_size == 2 and bases.num_tokens == 48
    assert bases.k_ranks == again.k_ranks and bases.v_ranks == again.v_ranks
    for g in range(2):
        torch.testing.assert_close(bases.k_basis[g], again.k_basis[g], rtol=0, atol=0)
    one = collect_kv_moments(model, samples, group_size=1, progress=False)
    regrouped = moments.regroup(1)
    assert regrouped.groups == one.groups == ((0,), (1,), (2,))
    for a, b in zip(regrouped.k + regrouped.v, one.k + one.v):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(CKVPConfigError, match="dividing 2"):
        moments.regroup(4)


def test_calibrate_through_an_already_compiled_forward():
    """The README's order: model.forward = torch.compile(model.forward, backend="ckvp") first, then calibrate():
    the same bases as on the plain model, and the compiled forward is back in place afterwards."""
    model, samples = build_hf_moe("mixtral", num_layers=2, hidden=32, head_dim=8), _samples(2, (1, 12))
    plain = calibrate(model, samples, group_size=2, kv_ratio=2.0, progress=False)
    compiled = torch.compile(model.forward, backend="ckvp", options={"compiler": "eager"})
    model.forward = compiled
    bases = calibrate(model, samples, group_size=2, kv_ratio=2.0, progress=False)
    assert model.forward is compiled
    assert bases.k_ranks == plain.k_ranks and bases.v_ranks == plain.v_ranks
    for a, b in zip(bases.k_basis + bases.v_basis, plain.k_basis + plain.v_basis):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_save_load_round_trip_and_fingerprint(tmp_path):
    model = _gpt_fast()
    bases = calibrate(model, _samples(2, (1, 16)), group_size=2, kv_ratio=2.0, progress=False)
    path = tmp_path / "bases.safetensors"
    bases.save(path)
    loaded = LatentBases.load(path, model=model)
    for field in ("groups", "num_kv_heads", "head_dim", "group_size", "target_ratio", "rank_allocation", "k_ranks",
                  "v_ranks", "model_fingerprint", "num_tokens"):
        assert getattr(loaded, field) == getattr(bases, field), field
    for name in ("k_basis", "v_basis", "k_eigenvalues", "v_eigenvalues"):
        for a, b in zip(getattr(loaded, name), getattr(bases, name)):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert loaded.summary() == bases.summary()
    # the same weights in bf16 still match; another model does not
    LatentBases.load(path, model=_gpt_fast().to(torch.bfloat16))
    with pytest.raises(CKVPConfigError, match=r"calibrated on another model.*GptFastMoE.*re-run ckvp_compile.calibrate"):
        LatentBases.load(path, model=_gpt_fast(seed=1))
    with pytest.raises(CKVPConfigError, match="MixtralForCausalLM"):
        LatentBases.load(path, model=build_hf_moe("mixtral"))
    with pytest.raises(CKVPConfigError, match="no latent bases file"):
        LatentBases.load(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CKVPConfigError, match="not a readable safetensors file"):
        LatentBases.load(tmp_path / "junk.safetensors")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(CKVPConfigError, match="not ckvp latent bases"):
        LatentBases.load(tmp_path / "other.safetensors")
    half = bases.to(dtype=torch.bfloat16)
    assert half.k_basis[0].dtype == torch.bfloat16 and half.k_eigenvalues[0].dtype == torch.float64
    assert bases.layer_block(1, 0, "v").shape == (2, 8, max(bases.v_ranks[1]))
    torch.testing.assert_close(bases.layer_block(0, 1, "k"), bases.k_basis[0][:, 8:16])


def test_errors_name_the_fix():
    model, samples = _gpt_fast(), _samples(1, (1, 8))
    # 3 layers in groups (0, 1), (2,); Hkv=2, D=8: dense 96 elements, at least 8 latents -> ratio <= 12
    with pytest.raises(CKVPConfigError, match=r"kv_ratio must be a number in \[1, 12\]"):
        calibrate(model, samples, group_size=2, kv_ratio=12.5, progress=False)
    with pytest.raises(CKVPConfigError, match="kv_ratio must be a number >= 1"):
        calibrate(model, samples, kv_ratio=0.5, progress=False)
    with pytest.raises(CKVPConfigError, match="rank_allocation must be one of"):
        calibrate(model, samples, rank_allocation="attention", progress=False)
    with pytest.raises(CKVPConfigError, match=r"group_size must be one of \[1, 2, 4, 8\]"):
        calibrate(model, samples, group_size=3, progress=False)
    with pytest.raises(CKVPConfigError, match="at least one sample"):
        calibrate(model, [], progress=False)
    with pytest.raises(CKVPConfigError, match="integer tensor of token ids"):
        calibrate(model, [torch.zeros(1, 8)], progress=False)

    class Cacheless(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.inner(ids)  # input_pos=None: no KV cache

    with pytest.raises(CKVPConfigError, match="no attention layer with a usable KV cache.*no KV-cache write.*"
                                              "Cacheless is neither.*Fix: pass a Hugging Face causal LM"):
        calibrate(Cacheless(model), samples, progress=False)


def test_fixture_model_ratio_4_group_4():
    """The trained fixture: 4 windows of 256 held-out bytes, kv_ratio 4, G=4 -> 2 groups; prints the ranks."""
    model = load_fixture_model()
    data = (FIXTURE_MODEL_DIR / "eval_text.txt").read_bytes()
    windows = [torch.tensor(list(data[i * 256:(i + 1) * 256])) for i in range(4)]
    bases = calibrate(model, windows, group_size=4, kv_ratio=4.0, progress=False)
    print("\n" + bases.summary())
    assert bases.groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and bases.num_tokens == 1024
    assert (bases.num_kv_heads, bases.head_dim) == (2, 64)
    assert bases.dense_elements_per_token() == 2048 and bases.latent_elements_per_token() == 512
    assert bases.model_fingerprint["k_weight"] == "model.layers.0.self_attn.k_proj.weight"
    for kind in "kv":
        for g in range(2):
            for h in range(2):
                assert bases.retained_fraction(g, h, kind) > 0.9


@pytest.mark.parametrize("fmt", ["float", "int8", "int4/16", ("int4/16", "int8/32"), ["float", "int4"]])
def test_calibrate_to_a_byte_ratio_meets_it_on_the_store(fmt):
    """calibrate(latent_format=...) fits ranks so that the store of that format (or (K, V) pair of formats, as the
    cache takes), bases and scales counted, holds kv_ratio times fewer bytes than a bf16 dense cache; and it keeps
    as much rank as that allows."""
    from ckvp_compile.kernels.latent_format import parse_latent_format
    from ckvp_compile.latent.budget import store_bytes
    from ckvp_compile.runtime.store import LatentKVStore
    from ckvp_compile.testing import build_hf_moe

    kfmt, vfmt = (fmt, fmt) if isinstance(fmt, str) else fmt
    model = build_hf_moe("mixtral", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16)
    samples = [torch.randint(0, 256, (1, 24)) for _ in range(2)]
    bases = calibrate(model, samples, group_size=2, kv_ratio=3.0, progress=False, latent_format=fmt, batch_size=2,
                      cache_len=256)
    assert bases.k_formats == (parse_latent_format(kfmt).name,) * len(bases.groups)
    assert bases.v_formats == (parse_latent_format(vfmt).name,) * len(bases.groups)
    store = LatentKVStore(bases, 2, 256, "cpu", torch.float32, latent_dtype=torch.bfloat16)  # 'auto': the formats
    nb = store.nbytes()
    assert nb.ratio_vs(torch.bfloat16) >= 3.0
    assert store_bytes(bases, 2, 256, kfmt, vfmt, torch.bfloat16) == nb.per_sequence_state + nb.bases
    assert bases.ratio() < 3.0 or fmt == "float"  # quantized latents buy rank beyond the element ratio


def test_byte_ratio_format_pairs_and_their_refusals():
    """A (K, V) format pair: the default rank block is the larger block where one divides the other, else 1 (any
    rank); rotation needs one quantized block on both sides; a format that is neither a name nor a pair of names is
    a CKVPConfigError naming both forms, raised by calibrate before any sample runs."""
    from ckvp_compile.latent.budget import bases_for_byte_ratio, default_rank_block, format_pair
    from ckvp_compile.testing import build_hf_moe

    assert format_pair("int4") == ("int4/32", "int4/32") and format_pair(("int4/16", "float")) == ("int4/16", "float")
    assert [default_rank_block(p) for p in (("int4/16", "int8/32"), ("int8/32", "int4/32"), ("int4/16", "float"),
                                            ("int4/32", "mix/32:4x16+2x16"))] == [32, 32, 1, 1]
    torch.manual_seed(0)
    model = build_hf_moe("mixtral", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32)
    moments = collect_kv_moments(model, [torch.randint(0, 256, (1, 64))], group_size=2, progress=False)
    for pair, step in ((("int4/16", "int8/32"), 32), (("int4/16", "float"), 1)):
        def fit(block):
            b = bases_for_byte_ratio(moments, 3.0, pair, batch_size=2, max_cache_len=256, rank_block=block)
            return b.k_ranks, b.v_ranks

        blocked, auto = fit(step), fit(None)
        assert auto in (blocked, fit(1))  # whole blocks, or any rank where they overshoot the ratio (the slack rule)
        assert all(r in rank_steps(64, step) for rs in (*blocked[0], *blocked[1]) for r in rs)
    rotated = bases_for_byte_ratio(moments, 3.0, ("int4/16", "int8/16"), batch_size=2, max_cache_len=256, rotate=True)
    assert rotated.rotation == "hadamard/16"
    for pair in (("int4/16", "int8/32"), ("int4", "float")):
        with pytest.raises(CKVPConfigError, match="rotate=True needs quantized latent formats of one block"):
            bases_for_byte_ratio(moments, 3.0, pair, rotate=True)
    for bad in (("int4",), ("int4", "int8", "int8"), 4, None, ("int4", "int5")):
        with pytest.raises(CKVPConfigError, match="latent_format"):
            bases_for_byte_ratio(moments, 3.0, bad)

    def samples():
        raise AssertionError("a sample ran before the format was checked")
        yield

    with pytest.raises(CKVPConfigError, match=r"a \(K, V\) pair"):
        calibrate(model, samples(), kv_ratio=3.0, progress=False, latent_format=("int4",))


def test_byte_ratio_ranks_fill_whole_quantization_blocks_by_default():
    """bases_for_byte_ratio with rank_block = the format's block keeps whole quantization blocks (aligned heads in
    the latent row), with 1 any rank, and both meet the byte ratio; the default takes the blocks unless they land
    more than AUTO_RANK_BLOCK_SLACK above the ratio. A bad rank_block is a CKVPConfigError that names the fix."""
    from ckvp_compile.latent.budget import AUTO_RANK_BLOCK_SLACK, bases_for_byte_ratio, default_rank_block, store_bytes
    from ckvp_compile.testing import build_hf_moe

    torch.manual_seed(0)
    model = build_hf_moe("mixtral", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32)
    moments = collect_kv_moments(model, [torch.randint(0, 256, (1, 96))], group_size=2, progress=False)
    assert default_rank_block("int4/16") == 16 and default_rank_block("float") == 1
    dense = 2 * 4 * 2 * 2 * 256 * 32 * 2  # K and V, layers, batch, KV heads, slots, head_dim, bf16 bytes
    kinds = set()
    for fmt, block in (("int4/16", 16), ("int8/16", 16)):
        def ratio(b):
            return dense / store_bytes(b, 2, 256, fmt, fmt, torch.bfloat16)

        blocked = bases_for_byte_ratio(moments, 3.0, fmt, batch_size=2, max_cache_len=256, rank_block=block)
        free = bases_for_byte_ratio(moments, 3.0, fmt, batch_size=2, max_cache_len=256, rank_block=1)
        auto = bases_for_byte_ratio(moments, 3.0, fmt, batch_size=2, max_cache_len=256)
        # coarser steps leave part of the budget unspent (at most about a step per unit: 20% at these tiny shapes)
        assert 3.0 <= min(ratio(blocked), ratio(free)) and max(ratio(blocked), ratio(free)) < 3.0 * 1.2
        ranks = [r for rs in (*blocked.k_ranks, *blocked.v_ranks) for r in rs]
        assert all(r in rank_steps(64, block) for r in ranks), ranks
        assert any(r not in rank_steps(64, block) for rs in (*free.k_ranks, *free.v_ranks) for r in rs)
        want = blocked if ratio(blocked) <= 3.0 * (1 + AUTO_RANK_BLOCK_SLACK) else free
        assert (auto.k_ranks, auto.v_ranks) == (want.k_ranks, want.v_ranks)
        kinds.add(want is blocked)
    assert kinds == {True, False}  # this case covers both branches (int4/16 lands 0.4% above, int8/16 10.8%)
    for bad in (0, -8, 2.0, True, "32"):
        with pytest.raises(CKVPConfigError, match="rank_block must be an int >= 1"):
            bases_for_byte_ratio(moments, 3.0, "int4", rank_block=bad)
        with pytest.raises(CKVPConfigError, match="rank_block must be an int >= 1"):
            moments.bases(3.0, rank_block=bad)
    with pytest.raises(CKVPConfigError, match="rank_block"):  # checked before the calibration passes
        calibrate(model, [torch.randint(0, 256, (1, 8))], kv_ratio=3.0, progress=False, rank_block=0)


def test_entropy_allocation_follows_the_measured_attention_entropy():
    """Calibration measures each KV head's normalised causal attention entropy (in [0, 1]); 'entropy' ranks
    weight each unit's energy by it (broad heads get more rank) and meet the same budget."""
    from ckvp_compile.latent import collect_kv_moments
    from ckvp_compile.latent.ranks import allocate_ranks
    from ckvp_compile.testing import build_hf_moe

    model = build_hf_moe("qwen3_moe", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(0)
    mom = collect_kv_moments(model, [torch.randint(0, 256, (2, 32), generator=g)], group_size=2, progress=False)
    assert sorted(mom.attn_entropy) == [0, 1]
    for e in mom.attn_entropy.values():
        assert e.shape == (2,) and bool(((e > 0) & (e <= 1)).all())
    energy, entropy = mom.bases(4.0, "energy"), mom.bases(4.0, "entropy")
    assert entropy.latent_elements_per_token() <= energy.dense_elements_per_token() / 4
    assert entropy.rank_allocation == "entropy"
    # the rule itself: with equal spectra, the broader unit gets the larger rank
    spectra = [torch.linspace(1, 0.1, 16, dtype=torch.float64)] * 2
    sharp, broad = allocate_ranks(spectra, 12, "entropy", [0.2, 0.9])
    assert broad > sharp and sharp + broad == 12
    with pytest.raises(ValueError, match="entropy"):
        allocate_ranks(spectra, 12, "entropy")


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_key_rank_cap_moves_the_budget_to_the_other_units(data):
    """key_rank_caps + allocate_ranks(max_ranks=...): every key unit keeps at most the cap (a whole-block rank with
    rank_block); with any rank the budget is spent exactly where the capped units can hold it (else all of them is),
    and every other unit keeps at least its uncapped rank: the energies stay normalised by the whole spectra, so the
    greedy's threshold can only drop when candidates are removed."""
    from ckvp_compile.latent.ranks import key_rank_caps

    n_k = data.draw(st.integers(1, 4))
    n_v = data.draw(st.integers(1, 4))
    sizes = data.draw(st.lists(st.integers(2, 40), min_size=n_k + n_v, max_size=n_k + n_v))
    spectra = [torch.sort(torch.rand(n, dtype=torch.float64) ** 3, descending=True).values for n in sizes]
    budget = data.draw(st.integers(len(sizes), sum(sizes)))
    cap = data.draw(st.integers(1, 40))
    caps, b2 = key_rank_caps(spectra, n_k, cap, budget)
    assert caps == [min(n, cap) for n in sizes[:n_k]] + sizes[n_k:] and b2 == min(budget, sum(caps))
    free = allocate_ranks(spectra, budget)
    ranks = allocate_ranks(spectra, b2, max_ranks=caps)
    assert all(r <= cap for r in ranks[:n_k]) and sum(ranks) == b2
    assert all(r >= f for r, f in zip(ranks[n_k:], free[n_k:])), (ranks, free)
    assert key_rank_caps(spectra, n_k, None, budget) == (None, budget)
    block = data.draw(st.sampled_from((2, 8)))
    caps_b, b3 = key_rank_caps(spectra, n_k, cap, budget, block)
    ranks_b = allocate_ranks(spectra, b3, rank_block=block, max_ranks=caps_b)
    assert all(r <= cap for r in ranks_b[:n_k]) and sum(ranks_b) <= b3
    assert all(r in rank_steps(n, block) for r, n in zip(ranks_b, sizes))
    with pytest.raises(ValueError, match="max_ranks"):
        allocate_ranks(spectra, len(sizes), max_ranks=[0] * len(sizes))


def test_byte_ratio_with_a_key_rank_cap():
    """bases_for_byte_ratio(max_key_rank=c): key ranks <= c, the byte ratio met as without the cap, the freed bytes
    in the value ranks; the decode bench's DecomposedMoments caps alike; a bad cap is a CKVPConfigError naming the
    fix, checked before calibration runs."""
    from ckvp_compile.bench.decode_models import DecomposedMoments
    from ckvp_compile.latent.budget import bases_for_byte_ratio, store_bytes
    from ckvp_compile.testing import build_hf_moe

    torch.manual_seed(0)
    model = build_hf_moe("mixtral", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32)
    moments = collect_kv_moments(model, [torch.randint(0, 256, (1, 96))], group_size=2, progress=False)
    dense = 2 * 4 * 2 * 2 * 256 * 32 * 2

    def ratio(b):
        return dense / store_bytes(b, 2, 256, "int8", "int8", torch.bfloat16)

    free = bases_for_byte_ratio(moments, 2.0, "int8", batch_size=2, max_cache_len=256, rank_block=1)
    cap = max(r for rs in free.k_ranks for r in rs) // 2
    capped = bases_for_byte_ratio(moments, 2.0, "int8", batch_size=2, max_cache_len=256, rank_block=1,
                                  max_key_rank=cap)
    assert max(r for rs in capped.k_ranks for r in rs) <= cap
    assert 2.0 <= ratio(capped) < 2.0 * 1.05 and 2.0 <= ratio(free) < 2.0 * 1.05
    assert sum(map(sum, capped.v_ranks)) > sum(map(sum, free.v_ranks))
    dec = DecomposedMoments.from_moments(moments).bases(2.0, max_key_rank=cap)
    assert max(r for rs in dec.k_ranks for r in rs) <= cap
    for bad in (0, -1, 2.0, True, "64"):
        with pytest.raises(CKVPConfigError, match="max_key_rank must be None"):
            bases_for_byte_ratio(moments, 3.0, "int4", max_key_rank=bad)
        with pytest.raises(CKVPConfigError, match="max_key_rank must be None"):
            moments.bases(3.0, max_key_rank=bad)
    with pytest.raises(CKVPConfigError, match="max_key_rank"):  # checked before the calibration passes
        calibrate(model, [torch.randint(0, 256, (1, 8))], kv_ratio=3.0, progress=False, max_key_rank=0)


def test_key_rank_cap_too_tight_for_the_ratio_is_refused_and_recorded():
    """A cap that leaves too few coordinates for the ratio (every unit at its cap still lands more than 5% above it)
    is a CKVPConfigError naming the reachable ratio; a cap that fits is recorded in the bases and survives
    save / load."""
    import tempfile

    from ckvp_compile.latent.budget import bases_for_byte_ratio

    torch.manual_seed(0)
    model = build_hf_moe("mixtral", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32)
    moments = collect_kv_moments(model, [torch.randint(0, 256, (1, 96))], group_size=4, progress=False)
    with pytest.raises(CKVPConfigError, match=r"max_key_rank=1 leaves too few .* kv_ratio >= "):
        bases_for_byte_ratio(moments, 1.5, "int4", batch_size=2, max_cache_len=256, max_key_rank=1)
    b = bases_for_byte_ratio(moments, 4.0, "int4", batch_size=2, max_cache_len=256, max_key_rank=16)
    assert b.max_key_rank == 16 and "key ranks capped at 16" in b.summary()
    with tempfile.TemporaryDirectory() as d:
        b.save(f"{d}/b.safetensors")
        assert LatentBases.load(f"{d}/b.safetensors").max_key_rank == 16


def test_load_refuses_edited_groups_and_reads_the_online_flag(tmp_path):
    """A bases file whose groups are not layers 0..L-1 in order is refused as corrupt; 'online' in the metadata is
    read as a flag ("false" once loaded as True)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    model, samples = _gpt_fast(n_layer=2), _samples(2, (1, 16))
    path = tmp_path / "b.safetensors"
    calibrate(model, samples, group_size=1, kv_ratio=2.0, progress=False).save(path)
    with safe_open(str(path), "pt") as f:
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    header.pop("meta_sha256")  # a file saved before the metadata's hash (which refuses any edit)
    meta = json.loads(header["meta"])
    for change, check in ((dict(groups=[[1], [0]]), "not consecutive"), (dict(online="false"), None)):
        edited = dict(header, meta=json.dumps({**meta, **change}))
        save_file(tensors, str(tmp_path / "e.safetensors"), metadata=edited)
        if check:
            with pytest.raises(CKVPConfigError, match=check):
                LatentBases.load(tmp_path / "e.safetensors")
        else:
            assert LatentBases.load(tmp_path / "e.safetensors").online is False


def test_key_space_is_kept_checked_and_defaults_for_old_files(tmp_path):
    """key_space='post_rope' travels from collect_kv_moments through regroup(), bases(), calibrate(), to(), save()
    / load() and repr; an unknown value is refused by LatentBases, calibrate, collect_kv_moments and
    build_latent_bases with the valid values named; a file saved before the field existed (no 'key_space' in its
    metadata) loads as 'pre_rope', and one with an unknown value is refused as corrupt."""
    import dataclasses
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from ckvp_compile.latent import build_latent_bases

    model, samples = _gpt_fast(n_layer=2), _samples(2, (1, 16))
    moments = collect_kv_moments(model, samples, group_size=2, progress=False, key_space="post_rope")
    assert moments.key_space == "post_rope" and moments.regroup(1).key_space == "post_rope"
    bases = calibrate(model, samples, group_size=2, kv_ratio=2.0, progress=False, key_space="post_rope")
    again = moments.bases(2.0)
    assert bases.key_space == again.key_space == "post_rope" and bases.k_ranks == again.k_ranks
    torch.testing.assert_close(bases.k_basis[0], again.k_basis[0], rtol=0, atol=0)
    assert bases.to(dtype=torch.bfloat16).key_space == "post_rope"
    assert "key_space='post_rope'" in repr(bases)
    assert "key_space" not in repr(calibrate(model, samples, group_size=2, kv_ratio=2.0, progress=False))
    path = tmp_path / "post.safetensors"
    bases.save(path)
    assert LatentBases.load(path, model=model).key_space == "post_rope"

    valid = r"key_space must be one of \['pre_rope', 'post_rope'\]"
    with pytest.raises(CKVPConfigError, match=valid + ".*got 'bad'"):
        dataclasses.replace(bases, key_space="bad")
    with pytest.raises(CKVPConfigError, match=valid + ".*got 'x'"):
        calibrate(model, samples, key_space="x", progress=False)
    with pytest.raises(CKVPConfigError, match=valid):
        collect_kv_moments(model, samples, key_space="post-rope", progress=False)
    with pytest.raises(CKVPConfigError, match=valid + ".*got None"):
        build_latent_bases(moments.groups, moments.k, moments.v, moments.num_tokens,
                           num_kv_heads=moments.num_kv_heads, head_dim=moments.head_dim, group_size=2,
                           target_ratio=2.0, rank_allocation="energy", model_fingerprint=moments.model_fingerprint,
                           key_space=None)

    with safe_open(str(path), "pt") as f:
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    header.pop("meta_sha256")  # a file saved before the metadata's hash (which refuses any edit)
    meta = json.loads(header["meta"])
    assert meta["key_space"] == "post_rope"
    old = {k: v for k, v in meta.items() if k != "key_space"}
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata=dict(header, meta=json.dumps(old)))
    loaded = LatentBases.load(tmp_path / "old.safetensors", model=model)
    assert loaded.key_space == "pre_rope" and loaded.k_ranks == bases.k_ranks
    save_file(tensors, str(tmp_path / "bad.safetensors"),
              metadata=dict(header, meta=json.dumps(dict(meta, key_space="rotated"))))
    with pytest.raises(CKVPConfigError, match="corrupt ckvp latent bases.*key_space must be one of"):
        LatentBases.load(tmp_path / "bad.safetensors")


def test_weighted_key_basis_of_post_rope_keys_is_plain_pca_and_says_why(caplog):
    """The weighted key basis averages the query weighting over RoPE's rotations (pre-RoPE keys): post-RoPE key
    moments get the identity weight (plain PCA), with a warning that names the key space, not a missing query."""
    import logging

    from ckvp_compile.latent.calibrate import KVMoments

    m = KVMoments(groups=((0,),), num_kv_heads=2, head_dim=4, group_size=1, k=[torch.eye(4).expand(2, 4, 4).double()],
                  v=[torch.eye(4).expand(2, 4, 4).double()], num_tokens=1, model_fingerprint={},
                  q_energy={0: torch.ones(2, 4, dtype=torch.float64)}, rope_form={0: "none"}, key_space="post_rope")
    with caplog.at_level(logging.WARNING, logger="ckvp_compile.latent.calibrate"):
        (w,) = m.weights("k")
    assert torch.equal(w, torch.eye(4, dtype=torch.float64).expand(2, 4, 4))
    assert "post-RoPE keys get plain PCA" in caplog.text and "no query" not in caplog.text


def test_hf_model_that_never_writes_its_cache_names_the_attention(monkeypatch):
    """An HF model whose layers never write the StaticCache calibrate passes (its update returns the new keys and
    values untouched, as an attention keeping its own cache would): the error says calibrate did pass a cache and
    names the attention implementation as the fix, not the caller's cache."""
    from transformers import StaticCache

    model = build_hf_moe("mixtral", num_layers=2)
    monkeypatch.setattr(StaticCache, "update", lambda self, k, v, *args, **kwargs: (k, v))
    with pytest.raises(CKVPConfigError, match="no KV-cache write: calibrate ran the prefill with a Hugging Face "
                                              "StaticCache \\(attention implementation 'sdpa'\\).*Fix: check that "
                                              "each attention layer calls past_key_values.update"):
        calibrate(model, [torch.randint(0, 256, (1, 16))], progress=False)


def test_gpt_fast_model_that_never_writes_its_cache_names_the_update(monkeypatch):
    """The same for a gpt-fast model whose KVCache.update writes nothing: the fix names kv_cache.update."""
    from ckvp_compile.testing import gpt_fast

    monkeypatch.setattr(gpt_fast.KVCache, "update", lambda self, pos, k, v: (k, v))
    with pytest.raises(CKVPConfigError, match="caches of setup_caches\\(\\).*Fix: each attention must write its "
                                              "cache in place \\(kv_cache.update"):
        calibrate(_gpt_fast(), [torch.randint(0, 256, (1, 16))], progress=False)


@pytest.mark.parametrize("key_space", ["pre_rope", "post_rope"])
def test_online_bases_save_and_load(tmp_path, key_space):
    """Online bases save (K and V hold their own placeholder tensors: safetensors refuses shared ones) and load back
    online, with their key space, ranks and groups."""
    from ckvp_compile.latent import online_bases

    model = _gpt_fast(n_layer=3)
    bases = online_bases(model, group_size=2, kv_ratio=4.0, key_space=key_space)
    path = tmp_path / "online.safetensors"
    bases.save(path)
    loaded = LatentBases.load(path, model=model)
    assert loaded.online and loaded.key_space == key_space
    assert loaded.groups == bases.groups and loaded.k_ranks == bases.k_ranks and loaded.v_ranks == bases.v_ranks
