"""Adversarial tests of calibration inputs and of the bases file: each case below was once accepted silently or
failed with a misleading message (an adversarial review, 2026-12-06).

* calibrate() on a model in training mode: dropout / router jitter were sampled into the bases (two runs on the
  same samples disagreed); now it runs in eval mode and puts each module's mode back.
* calibrate() and ``LatentBases.load(model=...)`` on a ``torch.compile(model)`` wrapper: "no KV-cache write" and
  "calibrated on another model"; now the wrapped module is used.
* a model whose weights are on the meta device: a bare ``RuntimeError`` from ``.item()``.
* ``LatentBases.load`` of a file whose bases are NaN, integer or not orthonormal, whose ranks are fractional, whose
  formats are unknown or not one per group: loaded, then generated wrong tokens or failed later.
* the bf16 and fp16 copies of one checkpoint: refused as "another model" (their roundings hash differently).
* ``bases_for_byte_ratio`` with batch_size / max_cache_len < 1 or non-float dtypes: an unreachable-ratio message or
  a bare ``TypeError``.
"""

from __future__ import annotations

import json

import pytest
import torch

from ckvp_compile import CKVPConfigError, LatentBases, calibrate
from ckvp_compile.latent import collect_kv_moments, model_fingerprint
from ckvp_compile.latent.budget import bases_for_byte_ratio
from ckvp_compile.testing import build_hf_moe


def _model(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    return build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=seed).to(dtype)


def _samples(n: int = 2, s: int = 24) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (1, s), generator=g) for _ in range(n)]


def _assert_same_bases(a: LatentBases, b: LatentBases) -> None:
    assert (a.k_ranks, a.v_ranks) == (b.k_ranks, b.v_ranks)
    for x, y in zip(a.k_basis + a.v_basis, b.k_basis + b.v_basis):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_calibrate_runs_a_training_mode_model_in_eval_mode_and_restores_its_modes():
    # training mode matters: router jitter and dropout on the attention probabilities
    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, router_jitter_noise=0.5,
                         attention_dropout=0.5)
    want = calibrate(model, _samples(), group_size=2, kv_ratio=2.0, progress=False)
    model.train()
    model.model.layers[1].eval()  # a mixed state must come back as it was
    modes = {name: m.training for name, m in model.named_modules()}
    got = calibrate(model, _samples(), group_size=2, kv_ratio=2.0, progress=False)
    _assert_same_bases(got, want)
    assert {name: m.training for name, m in model.named_modules()} == modes


def test_calibrate_and_load_see_through_a_compiled_module(tmp_path):
    model = _model()
    want = calibrate(model, _samples(), group_size=2, kv_ratio=2.0, progress=False)
    compiled = torch.compile(model, backend="ckvp", options={"compiler": "aot_eager"})
    got = calibrate(compiled, _samples(), group_size=2, kv_ratio=2.0, progress=False)
    _assert_same_bases(got, want)
    assert got.model_fingerprint == want.model_fingerprint
    path = tmp_path / "bases.safetensors"
    got.save(path)
    LatentBases.load(path, model=compiled)  # the compiled wrapper is the calibrated model


def test_a_model_without_loaded_weights_is_a_clear_error():
    with torch.device("meta"):
        model = _model()
    with pytest.raises(CKVPConfigError, match="weights are not loaded.*meta device.*Fix: load the weights"):
        calibrate(model, _samples(1), progress=False)


def _tampered(tmp_path, bases: LatentBases, tensors=None, meta=None) -> str:
    """``bases`` saved, then re-written with some tensors / metadata fields replaced."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = tmp_path / "src.safetensors"
    bases.save(src)
    with safe_open(str(src), framework="pt") as f:
        header = dict(f.metadata())
        data = {k: f.get_tensor(k) for k in f.keys()}
    data.update({k: t.contiguous() for k, t in (tensors or {}).items()})
    fields = json.loads(header["meta"])
    fields.update(meta or {})
    header["meta"] = json.dumps(fields)
    out = tmp_path / "tampered.safetensors"
    save_file(data, str(out), metadata=header)
    return str(out)


def test_load_refuses_corrupt_values_and_keeps_sound_files(tmp_path):
    model = _model()
    bases = calibrate(model, _samples(), group_size=2, kv_ratio=2.0, progress=False, latent_format="int4/16")
    k0 = bases.k_basis[0]
    nan = k0.clone()
    nan[0, 0, 0] = float("nan")
    cases = {
        "not a finite float tensor": dict(tensors={"k_basis.0": nan}),
        "not a finite float tensor \\(dtype torch.int32\\)": dict(tensors={"k_basis.0": k0.round().to(torch.int32)}),
        "are not orthonormal": dict(tensors={"v_basis.0": bases.v_basis[0] * 3}),
        "k_ranks .* are not all ints": dict(meta={"k_ranks": [[r + 0.5 for r in bases.k_ranks[0]]]}),
        "k_formats: latent format must be": dict(meta={"k_formats": ["int5"]}),
        "v_formats 'int4' is not a list of one format per group": dict(meta={"v_formats": "int4"}),
        "group_size 0 is not an int": dict(meta={"group_size": 0}),
        "target_ratio nan": dict(meta={"target_ratio": float("nan")}),
        "max_key_rank -5 < 1": dict(meta={"max_key_rank": -5}),
    }
    for why, change in cases.items():
        with pytest.raises(CKVPConfigError, match=f"holds corrupt ckvp latent bases .*{why}"):
            LatentBases.load(_tampered(tmp_path, bases, **change))
    # sound files of every basis dtype still load (an fp8 copy of an orthonormal basis is within the tolerance)
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn):
        path = tmp_path / f"b_{dtype}.safetensors".replace("torch.", "")
        bases.to(dtype=dtype).save(path)
        assert LatentBases.load(path, model=model).k_basis[0].dtype == dtype


def test_the_bf16_and_fp16_copies_of_one_checkpoint_share_bases(tmp_path):
    """Bases calibrated on either 16-bit copy of an fp32 checkpoint load for the other (their roundings hash
    differently, the sampled values agree within 2^-8); another checkpoint of the same shape is still refused."""
    for a, b in ((torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)):
        bases = calibrate(_model(a), _samples(1), group_size=2, kv_ratio=2.0, progress=False)
        path = tmp_path / "bases.safetensors"
        bases.save(path)
        other = _model(b)
        fp = model_fingerprint(other, bases.model_fingerprint["k_weight"])
        assert fp["k_weight_sha256"] != bases.model_fingerprint["k_weight_sha256"]  # the hashes alone would refuse
        LatentBases.load(path, model=other)
        w = other.model.layers[0].self_attn.k_proj.weight
        bases.check_weight(w, "model.layers.0.self_attn.k_proj.weight")  # the backend's check at the first call
        with pytest.raises(CKVPConfigError, match="calibrated on another model"):
            LatentBases.load(path, model=_model(b, seed=1))
        with pytest.raises(CKVPConfigError, match="calibrated on another model"):
            bases.check_weight(w * 1.01, "model.layers.0.self_attn.k_proj.weight")


def test_a_model_that_shares_only_layer_0_is_refused(tmp_path):
    """The fingerprint hashed layer 0's key projection only: a model that shares it but not the later layers (a
    fine-tune that froze layer 0) loaded the bases. Every later layer's key projection is sampled too; the
    bf16 copy of the calibrated model still loads them."""
    model = _model()
    bases = calibrate(model, _samples(1), group_size=2, kv_ratio=2.0, progress=False)
    path = tmp_path / "bases.safetensors"
    bases.save(path)
    assert set(bases.model_fingerprint["layer_k_samples"]) == {"model.layers.1.self_attn.k_proj.weight"}
    other = _model(seed=1)
    with torch.no_grad():
        other.model.layers[0].self_attn.k_proj.weight.copy_(model.model.layers[0].self_attn.k_proj.weight)
    with pytest.raises(CKVPConfigError, match="calibrated on another model.*model.layers.1.self_attn.k_proj.weight "
                                              "has other values"):
        LatentBases.load(path, model=other)
    LatentBases.load(path, model=_model(torch.bfloat16))


def test_byte_ratio_arguments_are_checked():
    moments = collect_kv_moments(_model(), _samples(1), group_size=2, progress=False)
    for kwargs, why in (({"batch_size": 0}, "batch_size must be an int >= 1"),
                        ({"batch_size": 2.5}, "batch_size must be an int >= 1"),
                        ({"max_cache_len": -5}, "max_cache_len must be an int >= 1"),
                        ({"dense_dtype": "bf16"}, "dense_dtype must be a floating torch.dtype"),
                        ({"latent_dtype": torch.int8}, "latent_dtype must be a floating torch.dtype"),
                        ({"basis_dtype": torch.int8}, "basis_dtype must be a floating torch.dtype")):
        with pytest.raises(CKVPConfigError, match=why):
            bases_for_byte_ratio(moments, 2.0, "int4", **kwargs)
    with pytest.raises(CKVPConfigError, match="cache_len must be an int >= 1"):
        calibrate(_model(), _samples(1), progress=False, latent_format="int4", cache_len=0)


def test_samples_past_the_models_positions_warn_once_per_length():
    """A sample longer than config.max_position_embeddings runs (RoPE extends) but its keys are out of distribution:
    one CKVPWarning per such length, naming the limit; samples within it warn nothing."""
    import warnings

    from ckvp_compile import CKVPWarning

    model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calibrate(model, _samples(2, 16), group_size=2, kv_ratio=2.0, progress=False)
        assert not [w for w in caught if issubclass(w.category, CKVPWarning)]
        calibrate(model, [*_samples(2, 24), *_samples(1, 20)], group_size=2, kv_ratio=2.0, progress=False)
    got = [str(w.message) for w in caught if issubclass(w.category, CKVPWarning)]
    assert len(got) == 2 and all("max_position_embeddings (16)" in m for m in got), got
    assert "a sample of 24 tokens" in got[0] and "a sample of 20 tokens" in got[1]


# ---------------------------------------------------------------------------------------------------------------
# A second adversarial review (2026-12-07): each case below was accepted silently or failed without naming the fix.


def test_save_refuses_paths_that_are_not_files_naming_the_fix(tmp_path, monkeypatch):
    """``save(None)`` wrote a file named 'None' in the working directory; a missing parent directory or a directory
    path raised safetensors' bare I/O error; ``load(None)`` a ``TypeError``."""
    bases = calibrate(_model(), _samples(1), group_size=2, kv_ratio=2.0, progress=False)
    monkeypatch.chdir(tmp_path)
    for path, why in ((None, "path must be a file path .*got None"),
                      (b"bases.safetensors", "path must be a file path"),
                      ("", "path must be a file path"),
                      (tmp_path, "is a directory; give a file path inside it"),
                      (tmp_path / "missing" / "b.safetensors", "does not exist; create it first")):
        with pytest.raises(CKVPConfigError, match=why):
            bases.save(path)
        if path != tmp_path:
            with pytest.raises(CKVPConfigError, match="path must be a file path|no latent bases file"):
                LatentBases.load(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    bases.save(tmp_path / "ok.safetensors")  # a pathlib.Path and a str both work
    _assert_same_bases(LatentBases.load(str(tmp_path / "ok.safetensors")), bases)


def test_a_damaged_byte_in_a_saved_file_is_refused(tmp_path):
    """safetensors has no checksum: a flipped byte in an eigenvalue (or a sign in a basis entry, which moves
    orthonormality by less than the tolerance) loaded silently. ``save`` now records the tensors' sha256."""
    bases = calibrate(_model(), _samples(), group_size=2, kv_ratio=2.0, progress=False)
    path = tmp_path / "bases.safetensors"
    bases.save(path)
    data = path.read_bytes()
    bad = tmp_path / "damaged.safetensors"
    for offset in (-10, -1):  # bytes of the last tensor, v_eigenvalues.0 (float64): no other check sees them
        damaged = bytearray(data)
        damaged[offset] ^= 0x80
        bad.write_bytes(bytes(damaged))
        with pytest.raises(CKVPConfigError, match="holds corrupt ckvp latent bases .*damaged or edited after save"):
            LatentBases.load(bad)
    # the sign of a basis entry flipped: the kept columns stay orthonormal within the tolerance, the basis is not
    # the calibrated one
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    k0 = tensors["k_basis.0"].clone()
    r = bases.k_ranks[0][0]
    cols = k0[0, :, :r]
    i, j = divmod(int(torch.where(cols != 0, cols.abs(), torch.inf).argmin()), r)
    k0[0, i, j] = -k0[0, i, j]
    err = float((k0[0, :, :r].double().mT @ k0[0, :, :r].double() - torch.eye(r, dtype=torch.float64)).abs().max())
    assert err < 0.05  # below ORTHONORMAL_TOL: only the hash tells
    save_file(dict(tensors, **{"k_basis.0": k0}), str(bad), metadata=header)
    with pytest.raises(CKVPConfigError, match="holds corrupt ckvp latent bases .*damaged or edited after save"):
        LatentBases.load(bad)
    _assert_same_bases(LatentBases.load(path), bases)  # the sound file still loads


def test_edited_metadata_is_refused(tmp_path):
    """The JSON metadata (ranks, key space, formats) is read as it is: a rank lowered by a flipped bit, or the key
    space switched, gave other bases silently (logits off by 0.4). ``save`` records its sha256 too; a file without
    that entry (saved before it) still loads."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    bases = calibrate(_model(), _samples(), group_size=2, kv_ratio=2.0, progress=False)
    path = tmp_path / "bases.safetensors"
    bases.save(path)
    with safe_open(str(path), framework="pt") as f:
        header, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    fields = json.loads(header["meta"])
    bad = tmp_path / "edited.safetensors"
    for change in ({"key_space": "post_rope"}, {"num_tokens": fields["num_tokens"] + 1}):  # valid: only the hash tells
        save_file(tensors, str(bad), metadata=dict(header, meta=json.dumps({**fields, **change})))
        with pytest.raises(CKVPConfigError, match="holds corrupt ckvp latent bases .*metadata's sha256"):
            LatentBases.load(bad)
    old = {k: v for k, v in header.items() if k != "meta_sha256"}
    save_file(tensors, str(bad), metadata=old)
    _assert_same_bases(LatentBases.load(bad), bases)


def test_load_refuses_eigenvalues_that_are_no_spectrum_even_without_a_checksum(tmp_path):
    """Files saved before the checksum (no ``tensors_sha256``) are still read; their eigenvalues must be >= 0 and
    descending per head, as the spectrum of a second moment is (the planner and summary() read them)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    bases = calibrate(_model(), _samples(), group_size=2, kv_ratio=2.0, progress=False)
    src = tmp_path / "src.safetensors"
    bases.save(src)
    with safe_open(str(src), framework="pt") as f:
        header = {k: v for k, v in f.metadata().items() if k != "tensors_sha256"}
        data = {k: f.get_tensor(k) for k in f.keys()}
    old = tmp_path / "old.safetensors"
    save_file(data, str(old), metadata=header)
    _assert_same_bases(LatentBases.load(old, model=_model()), bases)  # an old file without the hash loads
    e = data["k_eigenvalues.0"]
    for bad in (e.flip(-1), torch.cat([e[:, :1], -e[:, 1:2], e[:, 2:]], dim=1)):
        save_file(dict(data, **{"k_eigenvalues.0": bad.contiguous()}), str(old), metadata=header)
        with pytest.raises(CKVPConfigError, match="k_eigenvalues.0 are not >= 0 and descending"):
            LatentBases.load(old)


def test_to_refuses_a_non_float_dtype():
    """``to(dtype=torch.int8)`` rounded every basis entry to 0 and returned unusable bases (refused only when a saved
    copy was loaded); a dtype given as a string raised torch's long TypeError."""
    bases = calibrate(_model(), _samples(1), group_size=2, kv_ratio=2.0, progress=False)
    for dtype in (torch.int8, torch.bool, "float16"):
        with pytest.raises(CKVPConfigError, match="dtype must be a floating torch.dtype"):
            bases.to(dtype=dtype)
    assert bases.to(dtype=torch.bfloat16).k_basis[0].dtype == torch.bfloat16
    assert bases.to().k_basis[0].dtype == torch.float32


def test_calibrate_names_the_fix_for_a_bare_tensor_or_a_non_module():
    """One 1-D tensor of ids as ``samples`` was iterated id by id ("got tensor () torch.int64"); ``model=None`` and
    ``samples=None`` raised bare AttributeError / TypeError. A (N, S) tensor still works: its rows are samples."""
    model = _model()
    ids = _samples(1)[0]
    with pytest.raises(CKVPConfigError, match=r"got one tensor \(24,\).*calibrate\(model, \[ids\]\)"):
        calibrate(model, ids[0], group_size=2, kv_ratio=2.0, progress=False)
    with pytest.raises(CKVPConfigError, match="samples must be an iterable .*got NoneType"):
        calibrate(model, None, group_size=2, kv_ratio=2.0, progress=False)
    for bad in (None, "model"):
        with pytest.raises(CKVPConfigError, match="model must be a torch.nn.Module"):
            calibrate(bad, [ids], group_size=2, kv_ratio=2.0, progress=False)
    _assert_same_bases(calibrate(model, ids, group_size=2, kv_ratio=2.0, progress=False),
                       calibrate(model, [ids], group_size=2, kv_ratio=2.0, progress=False))


# ---------------------------------------------------------------------------------------------------------------
# A review of the second review's fixes (2026-12-07): each case below failed with them and passes now.


def test_calibrate_takes_a_map_style_dataset_of_samples():
    """The samples check wanted ``collections.abc.Iterable``, which a map-style ``torch.utils.data.Dataset``
    (``__getitem__`` and ``__len__``, no ``__iter__``) is not, although a for loop iterates it: such a dataset,
    accepted before the check, was refused as "not an iterable"."""

    class Windows(torch.utils.data.Dataset):
        def __init__(self, samples):
            self.samples = samples

        def __getitem__(self, i):
            return self.samples[i]  # IndexError past the end ends the iteration

        def __len__(self):
            return len(self.samples)

    model = _model()
    _assert_same_bases(calibrate(model, Windows(_samples()), group_size=2, kv_ratio=2.0, progress=False),
                       calibrate(model, _samples(), group_size=2, kv_ratio=2.0, progress=False))


def test_the_checksum_covers_only_the_bases_tensors_and_names_the_fix_for_a_converted_file(tmp_path):
    """``save`` hashes the tensors it writes, but ``load`` hashed every tensor in the file: a file another tool added
    a tensor to (its own bases untouched, loading before the checksum) was refused as damaged. A file whose tensors
    were converted on purpose is still refused (a stale hash), and the message names how to load it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    model = _model()
    bases = calibrate(model, _samples(), group_size=2, kv_ratio=2.0, progress=False)
    src = tmp_path / "src.safetensors"
    bases.save(src)
    with safe_open(str(src), framework="pt") as f:
        header, data = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    extra = tmp_path / "extra.safetensors"
    save_file(dict(data, notes=torch.arange(3.0)), str(extra), metadata=header)
    _assert_same_bases(LatentBases.load(extra, model=model), bases)
    converted = {k: t.to(torch.bfloat16) if "basis" in k else t for k, t in data.items()}
    path = tmp_path / "bf16.safetensors"
    save_file(converted, str(path), metadata=header)
    with pytest.raises(CKVPConfigError, match="damaged or edited after save.*'tensors_sha256' metadata entry is "
                                              "removed"):
        LatentBases.load(path, model=model)
    save_file(converted, str(path), metadata={k: v for k, v in header.items() if k != "tensors_sha256"})
    assert LatentBases.load(path, model=model).k_basis[0].dtype == torch.bfloat16
