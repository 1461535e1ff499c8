"""CKVPConfig: option mapping, validation messages, hashing."""

import pytest

from ckvp_compile import CKVPConfig, CKVPConfigError


def test_defaults_and_roundtrip():
    c = CKVPConfig()
    assert c.compiler == "inductor" and c.group_size == 4 and c.enable_latent_kv and not c.enable_expert_gemm
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
        ({"enable_expert_gemm": True}, "NYI"),
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
    a = CKVPConfig(compiler="eager", inductor={"max_autotune": True})
    b = CKVPConfig(compiler="eager", inductor={"max_autotune": True})
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
