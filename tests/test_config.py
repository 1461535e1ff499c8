"""CKVPConfig: option mapping, validation messages, hashing."""

import warnings

import pytest

from ckvp_compile import CKVPConfig, CKVPConfigError
from ckvp_compile.errors import CKVPWarning


def test_defaults_and_roundtrip():
    c = CKVPConfig()
    assert c.compiler == "inductor" and c.group_size == 4 and c.enable_latent_kv and c.enable_expert_gemm == "auto"
    d = c.to_dict(include_version=False)
    assert CKVPConfig.from_options(d) == c
    assert c.to_dict()["version"] == 1


def test_unknown_key_names_valid_keys():
    with pytest.raises(ValueError) as e:
        CKVPConfig.from_options({"group_sise": 4})
    msg = str(e.value)
    assert "group_sise" in msg and "group_size" in msg and "compiler" in msg and "'inductor'" in msg


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"group_size": 3}, "[1, 2, 4, 8]"),
        ({"group_size": "4"}, "must be an int"),
        ({"compiler": "tvm"}, "'inductor', 'aot_eager', 'eager'"),
        ({"mode": "fast"}, "reduce-overhead"),
        ({"strict": 1}, "must be a bool"),
        ({"inductor": ["max_autotune"]}, "must be a dict"),
        ({"enable_latent_kv": "yes"}, "must be a bool"),
        ({"enable_expert_gemm": "yes"}, "must be bool | 'auto'"),
        ({"enable_expert_gemm": 1}, "must be bool | 'auto'"),
        ({"enable_expert_gemm": None}, "got None"),
    ],
)
def test_bad_values_name_the_range(options, fragment):
    with pytest.raises(CKVPConfigError) as e:
        CKVPConfig.from_options(options)
    assert fragment in str(e.value)


def test_not_a_mapping():
    with pytest.raises(CKVPConfigError, match="dict"):
        CKVPConfig.from_options(["compiler"])


def test_mode_argument_and_conflict():
    assert CKVPConfig.from_options({}, mode="max-autotune").mode == "max-autotune"
    assert CKVPConfig.from_options({"mode": "reduce-overhead"}, mode=None).mode == "reduce-overhead"
    with pytest.raises(CKVPConfigError, match="conflicts"):
        CKVPConfig.from_options({"mode": "reduce-overhead"}, mode="max-autotune")


def test_hash_stable_and_sensitive():
    a = CKVPConfig(inductor={"max_autotune": True})
    b = CKVPConfig(inductor={"max_autotune": True})
    assert a.compute_hash() == b.compute_hash()
    assert a.compute_hash() != a.replace(group_size=2).compute_hash()
    assert a.compute_hash() != a.replace(inductor={"max_autotune": False}).compute_hash()


def test_inductor_dict_is_copied():
    patches = {"max_autotune": True}
    c = CKVPConfig(inductor=patches)
    h = c.compute_hash()
    patches["max_autotune"] = False
    assert c.compute_hash() == h


def test_describe_covers_every_field():
    names = [row[0] for row in CKVPConfig.describe()]
    assert names == list(CKVPConfig.from_options({}).to_dict(include_version=False))
    assert all(row[3] for row in CKVPConfig.describe()), "every option needs documentation"


# ---------------------------------------------------------------------------------------------- Inductor patches


def test_unknown_inductor_option_names_close_matches():
    with pytest.raises(CKVPConfigError) as e:
        CKVPConfig.from_options({"inductor": {"max_autotun": True}})
    msg = str(e.value)
    assert "'max_autotun'" in msg and "'max_autotune'" in msg and "torch._inductor.config" in msg
    with pytest.raises(CKVPConfigError, match="torch._inductor.config"):
        CKVPConfig(inductor={"no_such_option_anywhere": 1})


@pytest.mark.parametrize(
    "patch, fragment",
    [
        ({"max_autotune": 1}, "must be a bool"),
        ({"max_autotune": "yes"}, "must be a bool"),
        ({"realize_reads_threshold": 2.5}, "must be an int"),
        ({"realize_reads_threshold": True}, "must be an int"),
        ({"max_autotune_gemm_backends": ["ATEN"]}, "must be a str"),
        ({"max_autotune_subproc_result_timeout_seconds": "60"}, "must be a number"),
        ({"max_autotune": None}, "does not accept None"),
    ],
)
def test_inductor_option_of_the_wrong_type(patch, fragment):
    with pytest.raises(CKVPConfigError) as e:
        CKVPConfig(inductor=patch)
    assert fragment in str(e.value) and repr(next(iter(patch))) in str(e.value)


@pytest.mark.parametrize(
    "patch",
    [
        {"max_autotune": True, "triton.cudagraphs": False, "epilogue_fusion": False},
        {"max_autotune_subproc_result_timeout_seconds": 30},  # an int where the default is a float
        {"cpp.simdlen": 8, "compile_threads": None},  # default None; declared int | None
        {"fx_graph_cache": False, "max_autotune_gemm_backends": "ATEN,TRITON"},
    ],
)
def test_valid_inductor_options(patch):
    assert CKVPConfig(inductor=patch).inductor == patch


def test_non_json_inductor_value_is_refused_naming_the_key():
    """A value whose repr holds an address would make compute_hash() differ run to run: refused instead."""

    class Opaque:
        pass

    with pytest.raises(CKVPConfigError) as e:
        CKVPConfig(inductor={"cpp.simdlen": Opaque()})  # default None: any type, but it must be JSON-like
    assert "'cpp.simdlen'" in str(e.value) and "JSON" in str(e.value)
    c = CKVPConfig(inductor={"cpp.simdlen": 8})
    c.inductor["cpp.simdlen"] = Opaque()  # mutated in place after validation: compute_hash refuses too
    with pytest.raises(CKVPConfigError, match="'cpp.simdlen'"):
        c.compute_hash()


@pytest.mark.parametrize("compiler", ["aot_eager", "eager"])
def test_inductor_patches_ignored_without_inductor_warn(compiler):
    with pytest.warns(CKVPWarning, match="ignored") as rec:
        CKVPConfig(compiler=compiler, inductor={"max_autotune": True})
    assert f"compiler={compiler!r}" in str(rec[0].message) and "max_autotune" in str(rec[0].message)
    with pytest.warns(CKVPWarning, match="mode='reduce-overhead'"):
        CKVPConfig.from_options({"compiler": compiler, "mode": "reduce-overhead"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CKVPConfig(compiler=compiler)
        CKVPConfig(inductor={"max_autotune": True})  # compiler='inductor': applies, no warning


def test_bad_inductor_option_surfaces_through_torch_compile():
    import torch

    with pytest.raises(CKVPConfigError, match="max_autotune"):
        torch.compile(lambda x: x + 1, backend="ckvp", options={"inductor": {"max_autotun": True}})(torch.ones(2))


def test_to_dict_round_trips_through_from_options():
    """from_options() takes what to_dict() writes, its 'version' record included."""
    from ckvp_compile import CKVPConfig

    c = CKVPConfig(group_size=2, enable_expert_gemm=True, inductor={"max_autotune": True})
    assert CKVPConfig.from_options(c.to_dict()) == c
